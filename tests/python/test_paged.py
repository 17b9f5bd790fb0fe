"""The paged operators (paged_slot_bytes, paged_kv_write_, paged_attention, paged_exact_write_)
against the documented page format and a float64 reference.

The pages are decoded here from the layout as paged_format.h documents it (offsets computed
in this file), the tokens' buffers compared bit for bit with nq_compress of the same token,
then dequantized by the test's own reference decoder (nq_reference.py) and attended over in
float64 (causal, sliding window, soft-cap, GQA, rotation undone with an explicit Hadamard
matrix).  Chunked prefill must give bit-identical pages and outputs.  Bad input: clear
errors naming the argument."""

from __future__ import annotations

import math
import re

import pytest
import torch
from devices import DEVICES
from test_attention import rotation_matrix

from nexuskv import _format, paged
from nexuskv.ops import hadamard_rotate, nq_compress
from nq_reference import F64, reference_dequantize

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


# ---- the layout, from the format's documentation --------------------------------------------


def slot_bytes_doc(D, kb, vb, G, k, dtype, W=0, P=16):
    xb = torch.empty(0, dtype=dtype).element_size()
    bg = math.ceil(D / G)
    ring = math.ceil(2 * W * D * xb / P)  # the exact window's two rings [W, D], spread over the P slots
    return _format.row_bytes(kb, D) + _format.row_bytes(vb, D) + bg * (4 * xb + 2 * k * (xb + 1)) + ring


def ring_rows(pages, block, head, fmt, D, dtype, value):
    """The ring [W, D] of a head page's keys (or values), by paged_format.h: after the P code slots."""
    P, W = pages.shape[2], fmt.exact_window
    xb = torch.empty(0, dtype=dtype).element_size()
    code = slot_bytes_doc(D, fmt.key_bits, fmt.value_bits, fmt.group_size, fmt.num_outliers, dtype)
    start = P * code + (W * D * xb if value else 0)
    return pages[block, head].reshape(-1)[start : start + W * D * xb].view(dtype).reshape(W, D)


def head_page_buffers(pages, block, head, fmt, D, dtype, value):
    """The NQ buffers of a head page's keys (or values) as [P, ...] tensors, by paged_format.h."""
    P = pages.shape[2]
    hp = pages[block, head].reshape(-1)
    xb = torch.empty(0, dtype=dtype).element_size()
    bg, k = math.ceil(D / fmt.group_size), fmt.num_outliers
    krb, vrb = _format.row_bytes(fmt.key_bits, D), _format.row_bytes(fmt.value_bits, D)
    meta = P * bg * xb
    off = {"kc": 0, "vc": P * krb}
    off["ks"] = off["vc"] + P * vrb
    off["kz"], off["vs"], off["vz"] = off["ks"] + meta, off["ks"] + 2 * meta, off["ks"] + 3 * meta
    off["kov"] = off["ks"] + 4 * meta
    off["vov"] = off["kov"] + meta * k
    off["koi"] = off["vov"] + meta * k
    off["voi"] = off["koi"] + P * bg * k
    assert off["voi"] + P * bg * k == P * slot_bytes_doc(D, fmt.key_bits, fmt.value_bits, fmt.group_size, k, dtype)
    p = "v" if value else "k"
    rb = vrb if value else krb

    def take(name, n, dt=None):
        b = hp[off[name] : off[name] + n]
        return b.view(dt) if dt is not None else b

    codes = take(p + "c", P * rb).reshape(P, rb)
    scale = take(p + "s", meta, dtype).reshape(P, bg)
    zero = take(p + "z", meta, dtype).reshape(P, bg)
    oval = take(p + "ov", meta * k, dtype).reshape(P, bg, k)
    oidx = take(p + "oi", P * bg * k).reshape(P, bg, k)
    return codes, scale, zero, oidx, oval


def token_buffers(pages, table_row, positions, head, fmt, D, dtype, value):
    """The buffers of tokens `positions` of a request (block table row) as [T, ...] tensors."""
    P = pages.shape[2]
    per = [head_page_buffers(pages, int(table_row[t // P]), head, fmt, D, dtype, value) for t in positions]
    return [torch.stack([b[i][t % P] for b, t in zip(per, positions)]) for i in range(5)]


# ---- a random serving step --------------------------------------------------------------------


class Pool:
    """A block pool, requests with random (shuffled) block tables, and the K/V written so far."""

    def __init__(self, fmt, kv_heads=2, D=64, P=32, num_blocks=40, dtype=torch.bfloat16, device="cpu", seed=0):
        self.fmt, self.H, self.D, self.P, self.dtype, self.device = fmt, kv_heads, D, P, dtype, device
        self.g = torch.Generator().manual_seed(seed)
        C = fmt.slot_bytes(D, dtype, P)
        self.pages = torch.zeros(num_blocks, kv_heads, P, C, dtype=torch.uint8, device=device)
        self.free = torch.randperm(num_blocks, generator=self.g).tolist()
        self.tables, self.k, self.v = [], [], []
        self.signs = fmt.signs(D, device)

    def add_request(self):
        self.tables.append([])
        self.k.append(torch.empty(0, self.H, self.D, dtype=self.dtype))
        self.v.append(torch.empty(0, self.H, self.D, dtype=self.dtype))
        return len(self.tables) - 1

    def new_kv(self, n, outlier_channel=None):
        k = torch.randn(n, self.H, self.D, generator=self.g)
        v = torch.randn(n, self.H, self.D, generator=self.g)
        if outlier_channel is not None:
            k[..., outlier_channel] *= 30
        return k.to(self.dtype), v.to(self.dtype)

    def slots(self, r, n):
        """Slots of the next n tokens of request r (allocating blocks)."""
        start = self.k[r].shape[0]
        out = []
        for t in range(start, start + n):
            if t // self.P >= len(self.tables[r]):
                self.tables[r].append(self.free.pop())
            out.append(self.tables[r][t // self.P] * self.P + t % self.P)
        return out

    def attend(self, q, table, lens, qsl, **kw):
        """paged.attention over the last step's tokens; with an exact window, their own K/V
        passed in, and their rings written after it (as a serving engine's step does)."""
        W = self.fmt.exact_window
        dev = self.device
        key, value = (x.to(dev) for x in self.last_kv) if W else (None, None)
        out = paged.attention(
            q.to(dev),
            self.pages,
            table.to(dev),
            lens.to(dev),
            qsl.to(dev),
            self.fmt,
            self.signs,
            key=key,
            value=value,
            **kw,
        )
        if W:
            paged.write_exact_(self.pages, key, value, self.last_slots.to(dev), self.fmt)
        return out

    def step(self, new, kv=None):
        """new: {request: n_new_tokens}; writes their K/V (random, or kv[request] = (k, v)) in a
        shuffled order and returns the attention arguments for those tokens."""
        keys, values, slots, qsl, lens = [], [], [], [0], []
        reqs = list(new)
        for r in reqs:
            k, v = kv[r] if kv else self.new_kv(new[r])
            slots += self.slots(r, new[r])
            keys.append(k)
            values.append(v)
            self.k[r] = torch.cat([self.k[r], k])
            self.v[r] = torch.cat([self.v[r], v])
            qsl.append(qsl[-1] + new[r])
            lens.append(self.k[r].shape[0])
        k, v, s = torch.cat(keys), torch.cat(values), torch.tensor(slots, dtype=torch.int64)
        self.last_kv, self.last_slots = (k, v), s  # in query order (Pool.attend)
        order = torch.randperm(len(s), generator=self.g)
        paged.write_(
            self.pages,
            k[order].to(self.device),
            v[order].to(self.device),
            s[order].to(self.device),
            self.fmt,
            self.signs,
        )
        width = max(len(self.tables[r]) for r in reqs) + 2
        table = torch.full((len(reqs), width), -1, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, : len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.int32)
        return reqs, table, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32)


def reference(pool, reqs, table, lens, qsl, q, q_heads, scale, window=None, softcap=None):
    """float64 attention over the dequantized pages, per request; [num_tokens, q_heads, D].
    With an exact window W, the query at position p reads keys and values (p - W, p] as they
    were written (pool.k / pool.v), rotated like the pages' so that one V serves both."""
    fmt, D, H, W = pool.fmt, pool.D, pool.H, pool.fmt.exact_window
    out = torch.zeros(q.shape[0], q_heads, D, dtype=F64)
    R = rotation_matrix(pool.signs.cpu()) if fmt.rotate else torch.eye(D, dtype=F64)
    group = q_heads // H
    for i, r in enumerate(reqs):
        L, q0, q1 = int(lens[i]), int(qsl[i]), int(qsl[i + 1])
        for h in range(H):
            kb = token_buffers(pool.pages.cpu(), table[i], range(L), h, fmt, D, pool.dtype, False)
            vb = token_buffers(pool.pages.cpu(), table[i], range(L), h, fmt, D, pool.dtype, True)
            K = reference_dequantize(kb, fmt.key_bits, fmt.group_size, -1, D)
            V = reference_dequantize(vb, fmt.value_bits, fmt.group_size, -1, D)
            qpos = torch.arange(L - (q1 - q0), L)[:, None]
            kpos = torch.arange(L)[None, :]
            exact = (kpos > qpos - W) & (kpos <= qpos)  # [queries, L]
            Kx, Vx = pool.k[reqs[i]][:, h].to(F64) @ R.T, pool.v[reqs[i]][:, h].to(F64) @ R.T
            for j in range(group):
                hq = h * group + j
                qr = q[q0:q1, hq].to(F64) @ R.T
                s = torch.where(exact, qr @ Kx.T, qr @ K.T) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                mask = kpos <= qpos
                if window:
                    mask &= kpos > qpos - window
                s = s.masked_fill(~mask, -math.inf)
                p = torch.softmax(s, -1)
                out[q0:q1, hq] = ((p * ~exact) @ V + (p * exact) @ Vx) @ R
    return out


def check_close(got, want, dtype, vmax):
    # float32 accumulation (scores of |s| < ~20, ~D ulps) and the output's rounding to dtype.
    tol = vmax * (EPS[dtype] + 1e-4)
    err = (got.to(F64) - want).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


# ---- the format -------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128, 80])
@pytest.mark.parametrize("kb,vb", [(4, 4), (2, 2), (8, 4), (3, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G,k", [(64, 0), (32, 2), (16, 1)])
def test_slot_bytes_follow_the_documented_formula(D, kb, vb, dtype, G, k):
    assert paged.slot_bytes(D, dtype, kb, vb, G, k) == slot_bytes_doc(D, kb, vb, G, k, dtype)


def test_slot_bytes_of_the_common_formats():
    # SmolLM2 (D = 64, bf16): 256 bytes per token and kv head uncompressed.
    assert paged.slot_bytes(64, torch.bfloat16, 4, 4, 64) == 72  # 3.56x
    assert paged.slot_bytes(64, torch.bfloat16, 2, 2, 64) == 40  # 6.4x
    assert paged.slot_bytes(128, torch.float16, 4, 4, 64) == 144  # 4.5 bits per element
    assert paged.PagedFormat().bits_per_element(128, torch.float16) == 4.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fmt",
    [
        paged.PagedFormat(4, 4, 64, 0, rotate=False),
        paged.PagedFormat(2, 3, 32, 2, rotate=False),
        paged.PagedFormat(8, 2, 64, 1, rotate=True, seed=5),
        paged.PagedFormat(2, 4, 32, 1, rotate=True, seed=2, key_fit_range=True, value_fit_range=True),
    ],
    ids=["4-4", "2-3-out2", "8-2-rot", "2-4-out1-rot-fit"],
)
def test_write_stores_each_token_as_nq_compress_does(device, dtype, fmt):
    pool = Pool(fmt, kv_heads=3, D=64, P=16, dtype=dtype, device=device, seed=1)
    r0, r1 = pool.add_request(), pool.add_request()
    pool.step({r0: 37, r1: 5})
    pool.step({r0: 1, r1: 20})
    for r in (r0, r1):
        for h in range(pool.H):
            for value, x in ((False, pool.k[r][:, h]), (True, pool.v[r][:, h])):
                if fmt.rotate:
                    x = hadamard_rotate(x, pool.signs.cpu())
                bits = fmt.value_bits if value else fmt.key_bits
                fit = fmt.value_fit_range if value else fmt.key_fit_range
                want = nq_compress(x, bits, fmt.group_size, -1, fmt.num_outliers, fit_range=fit)
                got = token_buffers(pool.pages.cpu(), pool.tables[r], range(x.shape[0]), h, fmt, 64, dtype, value)
                for name, a, b in zip(("codes", "scale", "zero", "outlier_idx", "outlier_val"), got, want):
                    assert torch.equal(a.reshape(b.shape), b), (r, h, value, name)


def test_write_skips_slot_minus_one_and_leaves_other_slots():
    fmt = paged.PagedFormat(4, 4, 64, rotate=False)
    pages = torch.zeros(4, 2, 16, fmt.slot_bytes(64, torch.float16), dtype=torch.uint8)
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    paged.write_(pages, k, k, torch.tensor([5, -1, 40]), fmt)
    # Slots with a (nonzero) key scale: [block, head, offset].  (Slots are not contiguous bytes:
    # a head page holds each buffer for all its tokens.)
    touched = torch.stack(
        [
            torch.stack(
                [head_page_buffers(pages, b, h, fmt, 64, torch.float16, False)[1].ne(0).any(-1) for h in range(2)]
            )
            for b in range(4)
        ]
    )
    assert touched[0, :, 5].all() and touched[2, :, 8].all()
    assert int(touched.sum()) == 4  # two tokens x two heads; the skipped token wrote nothing
    assert int(pages.ne(0).sum()) > 0


# ---- attention --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fmt,kv_heads,q_heads,window,softcap",
    [
        (paged.PagedFormat(4, 4, 64, 0, rotate=True), 3, 9, None, None),
        (paged.PagedFormat(2, 2, 32, 1, rotate=True, seed=3), 2, 4, None, None),
        (paged.PagedFormat(8, 4, 64, 0, rotate=False), 1, 4, 23, None),
        (paged.PagedFormat(3, 8, 16, 2, rotate=False), 2, 2, 40, 30.0),
        (paged.PagedFormat(4, 2, 64, 0, rotate=True), 1, 12, None, None),
        # Groups of 48: a last group of 16 channels with more outliers (20) than channels.
        (paged.PagedFormat(4, 4, 48, 20, rotate=True), 2, 4, 50, None),
        (paged.PagedFormat(2, 3, 32, 1, rotate=True, seed=3, key_fit_range=True), 2, 4, None, None),
    ],
    ids=[
        "4bit-gqa3",
        "2bit-out1",
        "8-4-window",
        "3-8-window-softcap",
        "4-2-gqa12",
        "group48-out20-window",
        "2-3-out1-fit",
    ],
)
def test_attention_matches_float64_over_a_serving_sequence(device, dtype, fmt, kv_heads, q_heads, window, softcap):
    """Prefill, chunked prefill and decode of three requests in ragged batches, against float64
    attention over the dequantized pages."""
    pool = Pool(fmt, kv_heads=kv_heads, D=64, P=32, dtype=dtype, device=device, seed=7)
    a, b, c = pool.add_request(), pool.add_request(), pool.add_request()
    g = torch.Generator().manual_seed(11)
    steps = [{a: 70, b: 3}, {a: 1, b: 45, c: 33}, {a: 1, b: 1, c: 1}, {c: 64, a: 1}]
    for new in steps:
        reqs, table, lens, qsl = pool.step(new)
        n = int(qsl[-1])
        q = torch.randn(n + 3, q_heads, 64, generator=g).to(dtype)  # 3 padding rows
        scale = 0.125
        got = paged.attention(
            q.to(device),
            pool.pages,
            table.to(device),
            lens.to(device),
            qsl.to(device),
            fmt,
            pool.signs,
            scale=scale,
            window=window,
            softcap=softcap,
        ).cpu()
        assert got.dtype == dtype and got.shape == q.shape
        assert torch.equal(got[n:], torch.zeros_like(got[n:]))
        want = reference(pool, reqs, table, lens, qsl, q[:n], q_heads, scale, window, softcap)
        vmax = max(float(pool.v[r].abs().max()) for r in reqs) * 1.5  # dequantized values may exceed |v| a little
        check_close(got[:n], want, dtype, vmax)


@pytest.mark.parametrize("window", [None, 19])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("exact_window", [0, 8, 32])
def test_chunked_prefill_gives_the_same_bits(window, peaked, exact_window):
    """A 150-token prompt in one step or in chunks of 37, 16 or 5 (and shuffled write orders):
    the same pages and, for every query, the same output bit for bit.  Peaked: every fifth query
    40x larger, so that its rows take a third key limb on AVX512-VNNI (paged_int_keys.h) while
    the rest of its block of four rows takes two.  With an exact window, a query's exact rows
    come from the step's own K/V or from the rings (chunks of 5 < W: from both) alike."""
    fmt = paged.PagedFormat(4, 4, 64, exact_window=exact_window)
    g = torch.Generator().manual_seed(0)
    q_all, k_all, v_all = (torch.randn(150, h, 64, generator=g) for h in (4, 2, 2))
    if peaked:
        q_all[::5] *= 40
    q_all, k_all, v_all = (x.to(torch.bfloat16) for x in (q_all, k_all, v_all))
    outs, pages = [], []
    for chunk in (150, 37, 16, 5):
        pool = Pool(fmt, kv_heads=2, D=64, P=32, dtype=torch.bfloat16, seed=chunk)  # other write orders
        pool.free = list(range(40))  # the same blocks in every run
        r = pool.add_request()
        got = []
        for s in range(0, 150, chunk):
            n = min(chunk, 150 - s)
            reqs, table, lens, qsl = pool.step({r: n}, kv={r: (k_all[s : s + n], v_all[s : s + n])})
            got.append(pool.attend(q_all[s : s + n], table, lens, qsl, window=window))
        outs.append(torch.cat(got))
        pages.append(pool.pages.clone())
    for i in range(1, 4):
        assert torch.equal(pages[0], pages[i]) and torch.equal(outs[0], outs[i]), i


# ---- the exact window ---------------------------------------------------------------------------


@pytest.mark.parametrize("W,P", [(8, 128), (8, 16), (1, 16), (16, 16), (5, 32), (3, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 80])
def test_slot_bytes_with_an_exact_window(W, P, dtype, D):
    assert paged.slot_bytes(D, dtype, 4, 2, 32, 1, W, P) == slot_bytes_doc(D, 4, 2, 32, 1, dtype, W, P)
    assert paged.slot_bytes(D, dtype, 4, 2, 32, 1, 0, P) == slot_bytes_doc(D, 4, 2, 32, 1, dtype)


def test_slot_bytes_of_exact_windows_in_common_blocks():
    fmt = paged.PagedFormat(exact_window=8)
    assert fmt.slot_bytes(64, torch.bfloat16, 128) == 88  # 72 + 8 x 2 x 64 x 2 / 128: 2.9x against bf16
    assert fmt.slot_bytes(64, torch.bfloat16, 16) == 200  # the same ring over 16 slots
    assert fmt.bits_per_element(64, torch.bfloat16, 128) == 5.5


@pytest.mark.parametrize("device", DEVICES)
def test_rings_hold_each_blocks_newest_tokens(device):
    """After every step each block's ring holds its newest W tokens (token t at row t % W), as
    written, unrotated: by the layout of paged_format.h."""
    fmt = paged.PagedFormat(4, 4, 64, exact_window=5)
    pool = Pool(fmt, kv_heads=2, D=64, P=16, dtype=torch.float16, device=device, seed=3)
    r = pool.add_request()
    g = torch.Generator().manual_seed(1)
    for n in (37, 1, 1, 9, 2):
        reqs, table, lens, qsl = pool.step({r: n})
        pool.attend(torch.randn(n, 2, 64, generator=g).half(), table, lens, qsl)
        L = pool.k[r].shape[0]
        for b, block in enumerate(pool.tables[r]):
            filled = min(16, L - 16 * b)
            for h in range(2):
                for value, x in ((False, pool.k[r]), (True, pool.v[r])):
                    ring = ring_rows(pool.pages.cpu(), block, h, fmt, 64, torch.float16, value)
                    for t in range(max(0, filled - 5), filled):
                        assert torch.equal(ring[t % 5], x[16 * b + t, h]), (L, b, h, value, t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fmt,kv_heads,q_heads,window,softcap",
    [
        (paged.PagedFormat(4, 4, 64, 0, rotate=True, exact_window=8), 2, 4, None, None),
        (paged.PagedFormat(2, 2, 32, 1, rotate=True, seed=3, exact_window=16), 1, 3, 23, None),
        (paged.PagedFormat(4, 4, 64, 0, rotate=False, exact_window=32), 2, 2, 20, 30.0),
        (paged.PagedFormat(8, 4, 64, 0, rotate=True, exact_window=1), 3, 9, None, None),
        (paged.PagedFormat(3, 2, 16, 2, rotate=False, key_fit_range=True, exact_window=3), 2, 4, 40, None),
    ],
    ids=["4bit-w8", "2bit-w16-window23", "4bit-w32-window20-softcap", "8-4-w1-gqa3", "3-2-w3-fit-window40"],
)
def test_exact_window_matches_float64_over_a_serving_sequence(device, dtype, fmt, kv_heads, q_heads, window, softcap):
    """Each query's W newest keys and values exact (the step's own rows and the rings), the older
    ones dequantized, against float64; ragged prefill, chunked prefill and decode (chunks shorter
    and longer than W, blocks of 32, sliding windows shorter than W included).  A kernel that
    read the window from the codes fails here: 2-8-bit codes are further off than the bound."""
    pool = Pool(fmt, kv_heads=kv_heads, D=64, P=32, dtype=dtype, device=device, seed=7)
    a, b, c = pool.add_request(), pool.add_request(), pool.add_request()
    g = torch.Generator().manual_seed(11)
    steps = [{a: 70, b: 3}, {a: 1, b: 45, c: 33}, {a: 1, b: 1, c: 1}, {c: 2, a: 1}, {c: 64, a: 5}]
    for new in steps:
        reqs, table, lens, qsl = pool.step(new)
        n = int(qsl[-1])
        q = torch.randn(n + 3, q_heads, 64, generator=g).to(dtype)  # 3 padding rows
        if fmt.exact_window:
            pool.last_kv = tuple(torch.cat([x, x[:3]]) for x in pool.last_kv)  # rows for the padding too
            pool.last_slots = torch.cat([pool.last_slots, torch.full((3,), -1)])
        got = pool.attend(q, table, lens, qsl, scale=0.125, window=window, softcap=softcap).cpu()
        assert got.dtype == dtype and got.shape == q.shape
        assert torch.equal(got[n:], torch.zeros_like(got[n:]))
        want = reference(pool, reqs, table, lens, qsl, q[:n], q_heads, 0.125, window, softcap)
        vmax = max(float(pool.v[r].abs().max()) for r in reqs) * 1.5
        check_close(got[:n], want, dtype, vmax)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_peaked_scores_stay_within_the_bf16_bound(bits):
    """bf16 queries 1000x larger than usual (scores in the thousands, a softmax of a few keys):
    AVX512-VNNI's integer scores take a third query limb where two could move a score by more
    than 2^-9 (paged_int_keys.h), so the output stays as close to float64 as elsewhere.  With
    two limbs only, the 2-bit case fails here (measured: max error 0.036 > 0.022)."""
    fmt = paged.PagedFormat(bits, 4, 64, 0, rotate=False)
    pool = Pool(fmt, kv_heads=2, D=64, P=32, dtype=torch.bfloat16, seed=5)
    r = pool.add_request()
    g = torch.Generator().manual_seed(3)
    reqs, table, lens, qsl = pool.step({r: 100})
    q = (torch.randn(100, 4, 64, generator=g) * 1000).to(torch.bfloat16)
    got = paged.attention(q, pool.pages, table, lens, qsl, fmt, pool.signs, scale=0.125)
    want = reference(pool, reqs, table, lens, qsl, q, 4, 0.125)
    check_close(got, want, torch.bfloat16, float(pool.v[r].abs().max()) * 1.5)


def test_rotation_helps_per_token_keys_with_an_outlier_channel():
    """Why rotation is the default: per-token 4-bit keys with one channel 30x the others."""
    errs = {}
    for rotate in (False, True):
        fmt = paged.PagedFormat(4, 4, 64, rotate=rotate)
        pool = Pool(fmt, kv_heads=1, D=64, P=32, dtype=torch.float32, seed=2)
        r = pool.add_request()
        k, v = pool.new_kv(200, outlier_channel=5)
        slots = torch.tensor(pool.slots(r, 200))
        paged.write_(pool.pages, k, v, slots, fmt, pool.signs)
        kh = reference_dequantize(
            token_buffers(pool.pages, pool.tables[r], range(200), 0, fmt, 64, torch.float32, False), 4, 64, -1, 64
        )
        if rotate:
            kh = kh @ rotation_matrix(pool.signs)
        mask = torch.ones(64, dtype=torch.bool)
        mask[5] = False
        errs[rotate] = (kh[:, mask] - k[:, 0, mask].to(F64)).abs().mean().item()
    assert errs[True] < errs[False] / 2.5, errs  # 0.47 -> 0.16


# ---- operator hygiene -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=True)
    pool = Pool(fmt, kv_heads=2, D=64, P=16, dtype=torch.float16, device=device, seed=4)
    r = pool.add_request()
    reqs, table, lens, qsl = pool.step({r: 20})
    k, v = pool.new_kv(2)
    slots = torch.tensor(pool.slots(r, 2), device=device)
    torch.library.opcheck(
        torch.ops.nexuskv.paged_kv_write_.default,
        (pool.pages, k.to(device), v.to(device), slots, 4, 4, 64, 0, pool.signs),
    )
    torch.library.opcheck(
        torch.ops.nexuskv.paged_kv_write_.default,
        (pool.pages, k.to(device), v.to(device), slots, 4, 4, 64, 0, pool.signs, True, False),
    )
    q = torch.randn(20, 4, 64, dtype=torch.float16, device=device)
    args = (q, pool.pages, table.to(device), lens.to(device), qsl.to(device), 4, 4, 64, 0, pool.signs, None, 8, None)
    torch.library.opcheck(torch.ops.nexuskv.paged_attention.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_exact_window(device):
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=True, exact_window=4)
    pool = Pool(fmt, kv_heads=2, D=64, P=16, dtype=torch.float16, device=device, seed=4)
    r = pool.add_request()
    reqs, table, lens, qsl = pool.step({r: 20})
    k, v = (x.to(device) for x in pool.last_kv)
    slots = pool.last_slots.to(device)
    q = torch.randn(20, 4, 64, dtype=torch.float16, device=device)
    args = (q, pool.pages, table.to(device), lens.to(device), qsl.to(device), 4, 4, 64, 0, pool.signs, None, None)
    torch.library.opcheck(torch.ops.nexuskv.paged_attention.default, args + (None, 4, k, v))
    torch.library.opcheck(torch.ops.nexuskv.paged_exact_write_.default, (pool.pages, k, v, slots, 4, 4, 64, 0, 4))
    pw = (pool.pages, k, v, slots, 4, 4, 64, 0, pool.signs, False, False, 4)
    torch.library.opcheck(torch.ops.nexuskv.paged_kv_write_.default, pw)


def test_compiles_with_fullgraph():
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=False)
    pool = Pool(fmt, kv_heads=1, D=64, P=16, dtype=torch.float32, seed=4)
    r = pool.add_request()
    reqs, table, lens, qsl = pool.step({r: 20})
    k, v = pool.new_kv(1)
    slots = torch.tensor(pool.slots(r, 1))
    q = torch.randn(1, 2, 64)

    def step(pages, k, v, slots, q, table, lens, qsl):
        torch.ops.nexuskv.paged_kv_write_(pages, k, v, slots, 4, 4, 64)
        return torch.ops.nexuskv.paged_attention(q, pages, table, lens, qsl, 4, 4, 64)

    eager_pages = pool.pages.clone()
    lens1, qsl1 = lens + 1, torch.tensor([0, 1], dtype=torch.int32)
    want = step(eager_pages, k, v, slots, q, table, lens1, qsl1)
    got = torch.compile(step, fullgraph=True)(pool.pages, k, v, slots, q, table, lens1, qsl1)
    assert torch.equal(got, want) and torch.equal(pool.pages, eager_pages)


def test_inference_only():
    fmt = paged.PagedFormat(4, 4, 64, rotate=False)
    pages = torch.zeros(2, 1, 16, fmt.slot_bytes(64, torch.float32), dtype=torch.uint8)
    k = torch.randn(1, 1, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only.*'key'"):
        paged.write_(pages, k, k.detach(), torch.tensor([0]), fmt)


# ---- bad input ----------------------------------------------------------------------------------


def _setup():
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=False)
    pages = torch.zeros(4, 2, 16, fmt.slot_bytes(64, torch.bfloat16), dtype=torch.uint8)
    k = torch.randn(3, 2, 64).bfloat16()
    paged.write_(pages, k, k, torch.tensor([0, 1, 2]), fmt)
    q = torch.randn(3, 4, 64).bfloat16()
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    return fmt, pages, k, q, table, lens, qsl


W = torch.ops.nexuskv.paged_kv_write_
A = torch.ops.nexuskv.paged_attention
X = torch.ops.nexuskv.paged_exact_write_


def _bad_cases():
    fmt, pages, k, q, table, lens, qsl = _setup()
    s3 = torch.tensor([0, 1, 2])
    i32 = torch.int32
    pw = torch.zeros(4, 2, 16, paged.slot_bytes(64, torch.bfloat16, 4, 4, 64, 0, 4, 16), dtype=torch.uint8)

    def AW(*tail, key=k, value=k, pages=pw, exact=4):  # attention over pages with an exact window of 4
        return A(q, pages, table, lens, qsl, 4, 4, 64, 0, None, None, None, None, exact, key, value, *tail)

    exact_cases = [
        ("exact window > block", lambda: W(pw, k, k, s3, 4, 4, 64, 0, None, False, False, 17), r"exact_window must"),
        ("exact window < 0", lambda: W(pw, k, k, s3, 4, 4, 64, 0, None, False, False, -1), r"\[0, min\(block_size"),
        ("exact window bytes", lambda: W(pw, k, k, s3, 4, 4, 64, 0, None, False, False, 8), "exact_window=8"),
        ("exact without key", lambda: AW(key=None, value=None), "required with exact_window > 0"),
        ("exact key alone", lambda: AW(value=None), "key and value go together"),
        ("key without exact", lambda: AW(pages=pages, exact=0), r"read only with an exact window"),
        ("exact key shape", lambda: AW(key=k[:2]), r"key must have shape \[num_tokens, kv_heads, head_dim\]"),
        ("exact value heads", lambda: AW(value=k[:, :1]), r"value must have shape .* got \[3, 1, 64\]"),
        ("exact key dtype", lambda: AW(key=k.float()), "key must have q's dtype"),
        ("exact key device", lambda: AW(key=k.to("meta")), "on q's device|one device"),
        ("exact write, no ring", lambda: X(pages, k, k, s3, 4, 4, 64, 0, 0), "have no ring to write"),
        ("exact write slot", lambda: X(pw, k, k, torch.tensor([0, 1, 99]), 4, 4, 64, 0, 4), r"slot_mapping\[2\] is 99"),
        ("exact write twice", lambda: X(pw, k, k, torch.tensor([1, 1, 2]), 4, 4, 64, 0, 4), "holds slot 1 twice"),
        ("exact write bytes", lambda: X(pw, k, k, s3, 4, 4, 64, 0, 2), "exact_window=2"),
        ("exact write heads", lambda: X(pw, k[:, :1], k[:, :1], s3, 4, 4, 64, 0, 4), "key has 1 kv heads"),
        (
            "slot bytes without block",
            lambda: torch.ops.nexuskv.paged_slot_bytes(64, 4, 4, 64, 0, torch.bfloat16, 8),
            "give block_size",
        ),
    ]
    return exact_cases + [
        ("slot range", lambda: W(pages, k, k, torch.tensor([0, 1, 64]), 4, 4, 64), r"slot_mapping\[2\] is 64, outside"),
        ("slot below -1", lambda: W(pages, k, k, torch.tensor([0, -2, 1]), 4, 4, 64), r"slot_mapping\[1\] is -2"),
        ("slot twice", lambda: W(pages, k, k, torch.tensor([3, 1, 3]), 4, 4, 64), "holds slot 3 twice"),
        ("slot dtype", lambda: W(pages, k, k, s3.int(), 4, 4, 64), "slot_mapping must be Long"),
        ("slot count", lambda: W(pages, k, k, s3[:2], 4, 4, 64), "one slot per token"),
        ("bits", lambda: W(pages, k, k, s3, 5, 4, 64), "key_bits must be one of"),
        ("value bits", lambda: W(pages, k, k, s3, 4, 1, 64), "value_bits must be one of"),
        ("slot bytes", lambda: W(pages, k, k, s3, 2, 4, 64), r"bytes per slot .* take 56"),
        ("dtype mismatch", lambda: W(pages, k.float(), k.float(), s3, 4, 4, 64), r"take 80 \(paged_slot_bytes\)"),
        ("heads", lambda: W(pages, k[:, :1], k[:, :1], s3, 4, 4, 64), "key has 1 kv heads"),
        ("value shape", lambda: W(pages, k, k[:2], s3, 4, 4, 64), "value must have key's shape"),
        ("key dims", lambda: W(pages, k[0], k[0], s3, 4, 4, 64), r"key must have shape \[num_tokens"),
        ("key int", lambda: W(pages, k.int(), k.int(), s3, 4, 4, 64), "key must be float32"),
        ("pages dtype", lambda: W(pages.float(), k, k, s3, 4, 4, 64), "pages must be uint8"),
        ("pages view", lambda: W(pages[:, :, ::2], k, k, s3, 4, 4, 64), "pages must be contiguous"),
        ("block size", lambda: W(pages[:, :, :8].contiguous(), k, k, s3, 4, 4, 64), "block_size .* multiple of 16"),
        ("nan", lambda: W(pages, k * float("nan"), k, s3, 4, 4, 64), "key or value holds NaN or Inf"),
        ("outliers", lambda: W(pages, k, k, s3, 4, 4, 64, 64), r"num_outliers must be in \[0, group_size\)"),
        ("group", lambda: W(pages, k, k, s3, 4, 4, 0), r"group_size must be in \[1, 256\]"),
        ("signs", lambda: W(pages, k, k, s3, 4, 4, 64, 0, torch.ones(32)), r"rotation_signs must have shape \[64\]"),
        ("sign values", lambda: W(pages, k, k, s3, 4, 4, 64, 0, torch.full((64,), 0.5)), "must all be \\+1 or -1"),
        ("meta device", lambda: W(pages, k.to("meta"), k, s3, 4, 4, 64), "all tensors must be on one device"),
        ("q dims", lambda: A(q[0], pages, table, lens, qsl, 4, 4, 64), r"q must have shape \[num_tokens"),
        ("q heads", lambda: A(q[:, :3], pages, table, lens, qsl, 4, 4, 64), r"positive multiple of pages' kv heads"),
        ("head_dim", lambda: A(q[..., :40], pages, table, lens, qsl, 4, 4, 64), "head_dim must be a multiple of 16"),
        ("q dtype", lambda: A(q.float(), pages, table, lens, qsl, 4, 4, 64), "the dtype the keys and values were"),
        ("table dtype", lambda: A(q, pages, table.long(), lens, qsl, 4, 4, 64), "block_table must be Int"),
        ("table rows", lambda: A(q, pages, table.repeat(2, 1), lens, qsl, 4, 4, 64), "one row per request"),
        ("qsl entries", lambda: A(q, pages, table, lens, qsl[:1], 4, 4, 64), "num_reqs \\+ 1 = 2 entries"),
        (
            "qsl start",
            lambda: A(q, pages, table, lens, torch.tensor([1, 3], dtype=i32), 4, 4, 64),
            r"query_start_loc\[0\] must be 0",
        ),
        (
            "qsl past q",
            lambda: A(q, pages, table, lens + 1, torch.tensor([0, 4], dtype=i32), 4, 4, 64),
            "at most q's tokens",
        ),
        (
            "qsl order",
            lambda: A(
                q,
                pages.repeat(1, 1, 1, 1),
                table.repeat(2, 1),
                torch.tensor([3, 3], dtype=i32),
                torch.tensor([0, 3, 2], dtype=i32),
                4,
                4,
                64,
            ),
            "non-decreasing",
        ),
        ("seq shorter", lambda: A(q, pages, table, lens - 1, qsl, 4, 4, 64), r"seq_lens\[0\] = 2 must be at least"),
        ("seq longer", lambda: A(q, pages, table, lens + 30, qsl, 4, 4, 64), "at most block_table's blocks"),
        (
            "block id",
            lambda: A(q, pages, torch.tensor([[9, 1]], dtype=i32), lens, qsl, 4, 4, 64),
            r"block_table\[0, 0\] = 9 is not a block of pages",
        ),
        ("window", lambda: A(q, pages, table, lens, qsl, 4, 4, 64, 0, None, None, 0), "window must be at least 1"),
        (
            "softcap",
            lambda: A(q, pages, table, lens, qsl, 4, 4, 64, 0, None, None, None, -1.0),
            "softcap must be positive",
        ),
        ("scale", lambda: A(q, pages, table, lens, qsl, 4, 4, 64, 0, None, float("inf")), "scale must be finite"),
        ("format mismatch", lambda: A(q, pages, table, lens, qsl, 4, 4, 64, 1), "bytes per slot"),
    ]


CASES = _bad_cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_clear_message(case):
    _, call, message = case
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        call()


def test_unused_block_table_entries_may_hold_anything():
    """Entries past a request's blocks (and before its window) are never read: vLLM pads
    block tables with arbitrary ids."""
    fmt, pages, k, q, table, lens, qsl = _setup()
    want = A(q, pages, table, lens, qsl, 4, 4, 64)
    got = A(q, pages, torch.tensor([[0, -7]], dtype=torch.int32), lens, qsl, 4, 4, 64)
    assert torch.equal(got, want)


def test_corrupt_outlier_positions_are_an_error():
    fmt = paged.PagedFormat(4, 4, 16, 1, rotate=False)
    pages = torch.zeros(2, 1, 16, fmt.slot_bytes(64, torch.float32), dtype=torch.uint8)
    k = torch.randn(2, 1, 64)
    paged.write_(pages, k, k, torch.tensor([0, 1]), fmt)
    buf = head_page_buffers(pages, 0, 0, fmt, 64, torch.float32, False)[3]
    buf[1, 2, 0] = 200  # inside the page tensor: a view
    with pytest.raises(RuntimeError, match=re.escape("outlier position outside its group")):
        paged.attention(
            torch.randn(2, 1, 64),
            pages,
            torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32),
            fmt,
        )
