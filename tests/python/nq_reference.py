"""An independent float64 reference of the NQ format, written from the format
documentation alone (csrc/include/nexuskv/core/nq_format.h): its own grouping
and padding, its own outlier choice, its own directed rounding of zero/scale
into the meta dtype and its own decoder of the packed bit layout.  It imports
nothing from nexuskv.  Shared by the operator tests."""

from __future__ import annotations

import math

import torch

F64 = torch.float64
FLT_MIN = torch.finfo(torch.float32).tiny  # smallest normal float32, 2^-126


# ---------------------------------------------------------------------------------------------
# Reference: grouping
# ---------------------------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def to_groups(x: torch.Tensor, G: int, axis: int, pad_value=0.0) -> torch.Tensor:
    """[N, T, D] -> [N, A, B, G]: each group's entries in position order, padded with pad_value."""
    N, T, D = x.shape
    if axis == -2:
        A = ceil_div(T, G)
        xp = torch.full((N, A * G, D), pad_value, dtype=x.dtype)
        xp[:, :T] = x
        return xp.reshape(N, A, G, D).permute(0, 1, 3, 2).contiguous()
    B = ceil_div(D, G)
    xp = torch.full((N, T, B * G), pad_value, dtype=x.dtype)
    xp[:, :, :D] = x
    return xp.reshape(N, T, B, G)


def from_groups(g: torch.Tensor, T: int, D: int, axis: int) -> torch.Tensor:
    """Inverse of to_groups (drops the padding)."""
    N, A, B, G = g.shape
    if axis == -2:
        return g.permute(0, 1, 3, 2).reshape(N, A * G, B)[:, :T]
    return g.reshape(N, A, B * G)[:, :, :D]


def per_element(meta: torch.Tensor, T: int, D: int, G: int, axis: int) -> torch.Tensor:
    """[N, A, B] per-group values -> [N, T, D] per-element values."""
    if axis == -2:
        return meta.repeat_interleave(G, dim=1)[:, :T]
    return meta.repeat_interleave(G, dim=2)[:, :, :D]


# ---------------------------------------------------------------------------------------------
# Reference: directed rounding into the meta dtype, ulps
# ---------------------------------------------------------------------------------------------


def round_directed(v: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Float64 v rounded towards +inf (up) or -inf (down) into dtype.  A nearest
    conversion gives one of the two neighbours of v in dtype (also through an
    intermediate float32), so one step fixes the wrong side."""
    r = v.to(dtype)
    rd = r.to(F64)
    wrong = rd < v if up else rd > v
    step = torch.nextafter(r, torch.full_like(r, math.inf if up else -math.inf))
    return torch.where(wrong, step, r)


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of dtype at |v| (the larger of the two spacings around it), in float64."""
    a = v.abs().to(F64)
    lo = a.to(dtype).to(F64)
    up = torch.nextafter(a.to(dtype), torch.full_like(a, math.inf, dtype=dtype)).to(F64)
    dn = torch.nextafter(a.to(dtype), torch.zeros_like(a, dtype=dtype)).to(F64)
    # At the top of the range next-up is inf; the spacing below then is the right one.
    s_up = torch.where(torch.isinf(up), lo - dn, up - lo)
    return torch.maximum(s_up, lo - dn)


# ---------------------------------------------------------------------------------------------
# Reference: quantization parameters and outliers
# ---------------------------------------------------------------------------------------------


def reference_params(x: torch.Tensor, bits: int, G: int, axis: int, k: int, meta_dtype: torch.dtype):
    """x: [N, T, D] (any float dtype).  Returns dict of [N, A, B] float64 tensors
    (zero, scale, dense min/max, n) and sorted outlier positions [N, A, B, k]."""
    qmax = 2**bits - 1
    x64 = x.to(F64)
    g = to_groups(x64, G, axis, pad_value=math.inf)
    N, A, B, _ = g.shape
    valid = to_groups(torch.ones_like(x64), G, axis, pad_value=0.0) > 0
    flat = g.reshape(-1, G)
    n = valid.reshape(-1, G).sum(1)  # entries per group (partial last groups have fewer)
    # Rank by (value, position): a stable sort keeps positions ascending among equal values,
    # padding (+inf) goes last.
    sv, sp = torch.sort(flat, dim=1, stable=True)
    M = flat.shape[0]
    rows = torch.arange(M)
    big = n > k
    if k == 0:
        best = torch.zeros(M, dtype=torch.long)
    else:
        # Candidate i drops the i lowest and the k-i highest entries.  The op compares the
        # candidate ranges in float32 (the documented float32 arithmetic); comparing the
        # same float32 differences makes near-ties resolve identically (first best i wins).
        i = torch.arange(k + 1)
        lo_idx = i.expand(M, k + 1)
        hi_idx = (n[:, None] - 1 - (k - i)[None, :]).clamp(min=0)
        lo = sv.gather(1, lo_idx.clamp(max=G - 1)).to(torch.float32)
        hi = sv.gather(1, hi_idx).to(torch.float32)
        ranges = torch.where(big[:, None], hi - lo, torch.zeros_like(hi))
        best = torch.argmin(ranges, dim=1)  # first minimum
    mn = sv[rows, best.clamp(max=G - 1)]
    mx = sv[rows, (n - 1 - (k - best)).clamp(min=0)]
    mn = torch.where(big, mn, torch.zeros_like(mn))  # no dense entry: zero = scale = 0
    mx = torch.where(big, mx, torch.zeros_like(mx))
    # Outlier positions.
    if k > 0:
        rank = torch.arange(G).expand(M, G)
        is_out_rank = (rank < best[:, None]) | ((rank >= (n - (k - best))[:, None]) & (rank < n[:, None]))
        is_out_pos = torch.zeros(M, G, dtype=torch.bool).scatter(1, sp, is_out_rank)
        key = torch.where(is_out_pos, torch.arange(G).expand(M, G), torch.full((M, G), G + 1))
        pos = torch.sort(key, dim=1).values[:, :k]
        small_pos = torch.minimum(torch.arange(k)[None, :], (n - 1)[:, None])  # n <= k: all, last repeated
        pos = torch.where(big[:, None], pos, small_pos)
    else:
        pos = torch.zeros(M, 0, dtype=torch.long)
    zero = round_directed(mn, meta_dtype, up=False)
    # nq_format.h: a positive scale is at least the smallest normal float32 (FLT_MIN), so that
    # 1 / scale stays finite; a subnormal one is clamped up to it before the rounding into the
    # meta dtype (a larger scale still covers the range).
    exact = (mx - zero.to(F64)) / qmax
    exact = torch.where((exact > 0) & (exact < FLT_MIN), torch.full_like(exact, FLT_MIN), exact)
    scale = round_directed(exact, meta_dtype, up=True)
    shape = (N, A, B)
    return {
        "zero": zero.reshape(shape),
        "scale": scale.reshape(shape),
        "mn": mn.reshape(shape),
        "mx": mx.reshape(shape),
        "n": n.reshape(shape),
        "pos": pos.reshape(N, A, B, k),
        "valid": valid,
    }


# ---------------------------------------------------------------------------------------------
# Reference: unpacking of the documented bit layout
# ---------------------------------------------------------------------------------------------


def reference_unpack(codes: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    """codes uint8 [R, row_bytes] -> int64 [R, padded D] (padding channels included)."""
    c = codes.to(torch.int64)
    R, rb = c.shape
    if bits in (2, 4, 8):
        planes = 8 // bits
        ch = c.reshape(R, rb // 16, 1, 16)
        shifts = (torch.arange(planes) * bits).reshape(1, 1, planes, 1)
        # channel 16*j + l of a chunk = (byte l >> bits*j) & mask
        out = (ch >> shifts) & (2**bits - 1)
        return out.reshape(R, -1)
    assert bits == 3
    ch = c.reshape(R, rb // 24, 24)
    low = reference_unpack(ch[:, :, :16].reshape(R, -1), 2, D).reshape(R, rb // 24, 64)
    hb = ch[:, :, 16:24].reshape(R, rb // 24, 1, 8)  # byte 16 + (i % 8), bit i // 8
    high = (hb >> torch.arange(8).reshape(1, 1, 8, 1)) & 1  # [R, chunks, j = i // 8, l = i % 8]
    return (low | (high.reshape(R, rb // 24, 64) << 2)).reshape(R, -1)


def chunk_geometry(bits: int):
    return {2: (64, 16), 3: (64, 24), 4: (32, 16), 8: (16, 16)}[bits]


# ---------------------------------------------------------------------------------------------
# Reference: dequantization of compressed buffers
# ---------------------------------------------------------------------------------------------


def reference_dequantize(parts, bits: int, G: int, axis: int, D: int, segment_starts=None) -> torch.Tensor:
    """The five buffers (codes, scale, zero, outlier_idx, outlier_val) [..., ] -> x_hat [..., T, D]
    in float64, from the documented layout.  segment_starts [..., S] (DGQ, axis -2) replaces the
    fixed token groups by the listed segments."""
    codes, scale, zero, idx, val = parts
    lead = codes.shape[:-2]
    T, rb = codes.shape[-2:]
    N = max(1, math.prod(lead))
    c = reference_unpack(codes.reshape(N * T, rb), bits, D)[:, :D].reshape(N, T, D).to(F64)
    s = scale.reshape(N, *scale.shape[-2:]).to(F64)
    z = zero.reshape(N, *zero.shape[-2:]).to(F64)
    k = idx.shape[-1]
    idx = idx.reshape(N, *idx.shape[-3:]).long()
    val = val.reshape(N, *val.shape[-3:]).to(F64)
    if axis == -2:
        if segment_starts is None:
            starts = torch.arange(s.shape[1]).mul(G).expand(N, -1)
        else:
            starts = segment_starts.reshape(N, -1).long()
        # token t belongs to the last segment whose start <= t
        seg = (torch.arange(T)[None, :, None] >= starts[:, None, :]).sum(-1) - 1  # [N, T]
        s_el = s.gather(1, seg[:, :, None].expand(N, T, D))
        z_el = z.gather(1, seg[:, :, None].expand(N, T, D))
        out = c * s_el + z_el
        for n in range(N):
            for a in range(s.shape[1]):
                a_start = int(starts[n, a])
                for slot in range(k):
                    t = a_start + idx[n, a, :, slot]  # [D]
                    ok = t < T
                    ch = torch.arange(D)[ok]
                    out[n, t[ok], ch] = val[n, a, ok, slot]
    else:
        out = c * per_element(s, T, D, G, axis) + per_element(z, T, D, G, axis)
        for slot in range(k):
            ch = torch.arange(s.shape[2])[None, :] * G + idx[:, :, :, slot]  # [N, T, B]
            ok = ch < D
            n_i, t_i, b_i = ok.nonzero(as_tuple=True)
            out[n_i, t_i, ch[n_i, t_i, b_i]] = val[n_i, t_i, b_i, slot]
    return out.reshape(*lead, T, D)
