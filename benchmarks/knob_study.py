"""Issue 21's unbuilt knobs measured on nexuskv's own cache before any is built: non-uniform
codebooks, outliers by fraction, pre-RoPE keys, a fitted rotation.

A study, not a timing, and decode-exact: the real model runs in float32, once per text window,
with an attention function (transformers' AttentionInterface) that gives every query what
nexuskv's cache shows it when decoding token by token.  The cache's policy (nexuskv/cache.h):
the first `sinks` tokens stay exact; when the full-precision tail holds more than `residual`
tokens, the oldest whole chunks of `chunk` tokens beyond it are compressed.  So after L tokens
the positions [sinks, sinks + chunk * floor((L - sinks - residual) / chunk)) are compressed, the
rest exact, and a chunk's codes depend only on its own tokens: the query at position p (L = p + 1)
sees the chunks compressed by then through their dequantized K/V and every other key and value
exact.  One forward then equals decoding with the cache: the rule is checked against
KVCache.compressed_lengths at start-up, and tests/python/test_knob_study.py holds one forward of
the `uniform` row to decoding token by token through the real cache on tiny models.  (`nexuskv
eval`'s first forward attends over its own K/V exactly; where a layer keeps no tail, its last
query would see the first chunk compressed when decoding: one query per window.)  Sliding-window
layers keep no sinks and their own tail (`--window-residual`), as nexuskv.hf.cache_for makes
them.

Quantizers, per compressed chunk [kv_heads, chunk, D]: keys per channel over groups of `group`
tokens, values per token over groups of `group` channels (one per head when group >= D):
- `uniform`: nexuskv's own nq_compress / nq_decompress (bf16 scales and zeros, fitted key ranges):
  what the cache stores, bit for bit; `1 outlier per group`: nq's own fixed count;
- `uniform, study quantizer`: the study's Python quantizer at nq's levels (its least-squares fit
  is its own): the control that the rows through it are compared with;
- `codebook`: the 2^b levels of each group are zero + range * t_i with t a table per layer, kv head
  and K / V (or per key channel: `codebook-ch`) fitted by Lloyd-Max (1-D k-means) on the
  calibration text's normalized entries (x - min) / (max - min) of the same groups; each entry
  takes the nearest level; range and zero bf16; keys' range and zero refitted by least squares
  to the chosen levels (two rounds); `ends pinned`: the end levels stay at the group's min and
  max, only the inner ones are fitted;
- `outliers F`: dense-and-sparse: per chunk and kv head, the fraction F of the entries farthest
  from their group's median (in units of the group's median absolute deviation) is kept exact
  (bf16 value + 1-byte position), the group's range taken over the rest; a 1-byte count per
  group;
- `rotation`: K (and V) quantized in another orthonormal basis of head_dim, queries alike (scores
  exact up to the codes): nexuskv's randomized Hadamard (`rotate=True`'s, bit for bit) or the KLT
  (eigenvectors of the calibration text's covariance per layer, K / V and kv head: a fitted
  rotation; its bf16 [D, D] table counted like a codebook's);
- `prerope`: keys quantized before RoPE (the keys the layer's apply_rotary_pos_emb received,
  recorded by wrapping it), RoPE applied to the dequantized keys (what a fused kernel that
  rotates keys on the fly would attend over).

Bits per element count every byte of the compressed part (codes, scales, zeros, outliers, their
positions and counts; a codebook table amortized over --bytes-tokens tokens).  Perplexity over
--windows segments of --tokens tokens after the tokenizer's sequence start, as `nexuskv eval`
cuts them; change against the same model with exact K/V, per segment and pooled.

    python benchmarks/knob_study.py --model gemma3-270m --text /usr/share/games/fortunes/songs-poems \
        --out benchmarks/knob_study-gemma3-270m-poems.json
    python benchmarks/knob_study.py summarize benchmarks/knob_study-*.json   # the tables, paired verdicts
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

import nexuskv
from nexuskv import evaluate
from nexuskv.models import as_sequence, load_model, load_text, model_name, sequence_prefix, text_tokens

META = torch.bfloat16  # scales, zeros, exact outliers: what a bf16 deployment stores
CALIB_TEXT = "/usr/share/games/fortunes/literature"  # what `calibrate` fits recipes on (RESULTS.md)


@dataclass(frozen=True)
class Row:
    name: str
    bits: int
    fit: bool = True  # keys' ranges fitted by least squares (the default cache's)
    # None: nq_compress itself; "uniform": the study's quantizer with nq's levels (its control);
    # "head": a table per layer, kv head and K/V; "pinned": the same with the end levels at the
    # group's min and max; "channel": keys per channel too
    codebook: Optional[str] = None
    outliers: float = 0.0  # fraction of each chunk's entries kept exact
    fixed_outliers: int = 0  # nq_compress's own: this many exact entries in every group
    prerope: bool = False
    # an orthogonal change of basis of each layer's and kv head's head_dim before quantizing (q
    # rotated alike: scores exact up to the codes), "hadamard": nexuskv's own randomized
    # Hadamard (cache_for(rotate=True)); "klt": the eigenvectors of the calibration text's key
    # (or value) covariance, a fitted rotation; applied to keys, and to values if `rotate_values`
    rotation: Optional[str] = None
    rotate_values: Optional[str] = None


@dataclass
class Policy:
    sinks: int
    residual: int
    chunk: int

    def compressed(self, length: int) -> int:
        """Compressed tokens after `length` tokens (nexuskv/cache.h, "Policy")."""
        return self.chunk * max(0, (length - self.sinks - self.residual) // self.chunk)


def check_policy(policy: Policy, group: int, head_dim: int = 64, upto: int = 400) -> None:
    """The rule above against the real cache, token by token."""
    cache = nexuskv.cache.make_cache(
        key_bits=4,
        key_group_size=group,
        value_group_size=group,
        residual=policy.residual,
        sinks=policy.sinks,
        meta_dtype=META,
    )
    for n in range(1, upto + 1):
        cache.append(torch.randn(1, 1, 1, head_dim), torch.randn(1, 1, 1, head_dim), None)
        got = int(cache.compressed_lengths()[0])
        if got != policy.compressed(n):
            sys.exit(
                f"knob_study: the policy rule says {policy.compressed(n)} compressed tokens after {n}, "
                f"the cache holds {got} ({policy})"
            )


# ---------------------------------------------------------------------------------------------
# quantizers: x [H, T, D] (one compressed chunk of one layer) -> x_hat of the same shape


def _groups(x: torch.Tensor, axis: int, group: int) -> torch.Tensor:
    """[H, T, D] -> [H, groups, n] with the group's entries last (axis -2: per channel over
    `group` tokens; -1: per token over `group` channels)."""
    h, t, d = x.shape
    if axis == -2:
        return x.reshape(h, t // group, group, d).transpose(2, 3).reshape(h, (t // group) * d, group)
    g = min(group, d)
    return x.reshape(h, t * (d // g), g)


def _ungroup(y: torch.Tensor, shape, axis: int, group: int) -> torch.Tensor:
    h, t, d = shape
    if axis == -2:
        return y.reshape(h, t // group, d, group).transpose(2, 3).reshape(h, t, d)
    return y.reshape(h, t, d)


def uniform_levels(bits: int) -> torch.Tensor:
    return torch.arange(2**bits, dtype=torch.float32) / (2**bits - 1)


def quantize_levels(g: torch.Tensor, levels: torch.Tensor, fit: bool, exact: Optional[torch.Tensor] = None):
    """g [H, G, n] groups; levels [H or 1, G or 1, L] normalized in [0, 1]; exact [H, G, n] bool
    (entries kept as they are: outliers).  Range and zero from min / max of the other entries
    (bf16), each entry at its nearest level; `fit`: range and zero refitted by least squares to
    the chosen levels, twice.  Returns the dequantized groups."""
    inf = torch.tensor(float("inf"))
    keep = torch.ones_like(g, dtype=torch.bool) if exact is None else ~exact
    mn = torch.where(keep, g, inf).amin(-1, keepdim=True)
    mx = torch.where(keep, g, -inf).amax(-1, keepdim=True)
    zero, rng = mn, (mx - mn)
    for rounds in range(3 if fit else 1):
        zero = zero.to(META).float()
        rng = rng.to(META).float()
        vals = zero + rng * levels  # [H, G, L]
        code = (g.unsqueeze(-1) - vals.unsqueeze(-2)).abs().argmin(-1)  # [H, G, n]
        t = torch.gather(levels.expand(g.shape[0], g.shape[1], -1), -1, code)
        if not fit or rounds == 2:
            break
        # least squares x ~ zero + rng * t over the kept entries (ties: keep min / max)
        w = keep.float()
        n = w.sum(-1, keepdim=True)
        st, sx = (w * t).sum(-1, keepdim=True), (w * g).sum(-1, keepdim=True)
        stt, stx = (w * t * t).sum(-1, keepdim=True), (w * t * g).sum(-1, keepdim=True)
        det = n * stt - st * st
        ok = det > 1e-12 * n * n
        new_rng = torch.where(ok, (n * stx - st * sx) / det.clamp_min(1e-30), rng)
        new_zero = torch.where(ok, (sx - new_rng * st) / n.clamp_min(1), zero)
        zero, rng = new_zero, new_rng.clamp_min(0)
    out = zero + rng * t
    return out if exact is None else torch.where(exact, g.to(META).float(), out)


def outlier_mask(g: torch.Tensor, fraction: float) -> torch.Tensor:
    """The `fraction` of all entries of g [H, G, n] (per kv head) farthest from their group's
    median in units of its median absolute deviation."""
    med = g.median(-1, keepdim=True).values
    dev = (g - med).abs()
    mad = dev.median(-1, keepdim=True).values.clamp_min(1e-8)
    score = (dev / mad).reshape(g.shape[0], -1)
    k = int(round(fraction * score.shape[1]))
    mask = torch.zeros_like(score, dtype=torch.bool)
    if k:
        mask.scatter_(1, score.topk(k, dim=1).indices, True)
    return mask.reshape(g.shape)


def nq_roundtrip(x: torch.Tensor, bits: int, group: int, axis: int, fit: bool, outliers: int = 0) -> torch.Tensor:
    parts = nexuskv.nq_compress(
        x.unsqueeze(0),
        bits,
        min(group, x.shape[-1]) if axis == -1 else group,
        axis,
        num_outliers=outliers,
        meta_dtype=META,
        fit_range=fit,
    )
    return nexuskv.nq_decompress(
        *parts, bits, min(group, x.shape[-1]) if axis == -1 else group, axis, x.shape[-1], out_dtype=torch.float32
    )[0]


# ---------------------------------------------------------------------------------------------
# codebooks: Lloyd-Max on the calibration text's normalized group entries


def lloyd(u: torch.Tensor, bits: int, iters: int = 40, bins: int = 2048, pinned: bool = False) -> torch.Tensor:
    """2^bits levels minimizing the squared error of u (entries in [0, 1]) by 1-D k-means on a
    histogram, started at the uniform levels; `pinned`: the end levels stay at 0 and 1 (each
    group's min and max stay exact), only the inner ones move."""
    hist = torch.histc(u.float().clamp(0, 1), bins=bins, min=0, max=1)
    centers = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
    hist = hist.double()
    lv = uniform_levels(bits).double()
    for _ in range(iters):
        edges = (lv[1:] + lv[:-1]) / 2
        idx = torch.bucketize(centers, edges)
        mass = torch.zeros_like(lv).index_add_(0, idx, hist)
        mom = torch.zeros_like(lv).index_add_(0, idx, hist * centers)
        new = torch.where(mass > 0, mom / mass.clamp_min(1e-30), lv)
        if pinned:
            new[0], new[-1] = 0.0, 1.0
        lv = new
    return lv.float().sort().values


def normalized(g: torch.Tensor) -> torch.Tensor:
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    return (g - mn) / (mx - mn).clamp_min(1e-12)


# ---------------------------------------------------------------------------------------------
# the attention that shows every query what the cache shows it


class Study:
    def __init__(self, model, args):
        self.model, self.args = model, args
        self.row: Optional[Row] = None
        self.codebooks: Dict[tuple, torch.Tensor] = {}  # (layer, "k" | "v", bits, per) -> [H, G or 1, L]
        self.rotations: Dict[tuple, torch.Tensor] = {}  # (layer, "k" | "v", "klt") -> [H, D, D] orthogonal
        self.calibration: Optional[Dict] = None  # layer -> list of (k, v, k_pre, window) while collecting
        self.pre: Dict[int, tuple] = {}  # id(post-RoPE key) -> (pre-RoPE key, cos, sin, apply)
        self.calls = 0  # quantized layer calls (the path ran)

    def policy(self, window) -> Policy:
        a = self.args
        if window is None:
            return Policy(a.sinks, a.residual, a.group)
        return Policy(0, a.window_residual, a.group)

    def quantize(self, layer: int, x: torch.Tensor, kind: str, row: Row) -> torch.Tensor:
        """x [H, T, D], T a whole number of chunks -> dequantized."""
        axis = -2 if kind == "k" else -1
        group = self.args.group
        fit = row.fit and kind == "k"
        if row.codebook is None and row.outliers == 0:
            return nq_roundtrip(x, row.bits, group, axis, fit, row.fixed_outliers)
        g = _groups(x, axis, group)
        if row.codebook in ("head", "channel", "pinned"):
            per = "channel" if (row.codebook == "channel" and kind == "k") else row.codebook
            if per == "channel" and kind == "v":
                per = "head"
            levels = self.codebooks[(layer, kind, row.bits, per)]
            levels = levels.repeat(1, g.shape[1] // levels.shape[1], 1)  # per channel: [H, D, L] per token block
        else:  # "uniform": the study's own quantizer with nq's levels (the control of the Python path)
            levels = uniform_levels(row.bits).view(1, 1, -1)
        exact = outlier_mask(g, row.outliers) if row.outliers else None
        return _ungroup(quantize_levels(g, levels, fit, exact), x.shape, axis, group)

    def rotated_quantize(self, layer: int, x: torch.Tensor, kind: str, row: Row, how: Optional[str]):
        """quantize() in a rotated basis: x R quantized, then rotated back (R orthogonal, [H, D, D])."""
        if how is None:
            return self.quantize(layer, x, kind, row)
        if how == "hadamard":  # the cache's own transform (its butterflies round as the cache's do)
            from nexuskv.compressors import rotation_signs
            from nexuskv.ops import hadamard_rotate

            signs = rotation_signs(x.shape[-1], self.args.seed)
            return hadamard_rotate(self.quantize(layer, hadamard_rotate(x, signs), kind, row), signs, inverse=True)
        r = self.rotations[(layer, kind, how)]
        return self.quantize(layer, x @ r, kind, row) @ r.transpose(-1, -2)

    def compressed_view(self, layer, k, v, k_pre, window, row: Row):
        """Full-length K/V [H, n, D] in which every position that is ever compressed holds
        its dequantized value, and the number of such positions' start."""
        pol = self.policy(window)
        n = k.shape[-2]
        end = pol.sinks + pol.compressed(n)
        kq, vq = k.clone(), v.clone()
        if end > pol.sinks:
            s = slice(pol.sinks, end)
            if row.prerope:
                pre, cos, sin, apply = k_pre
                kp = self.quantize(layer, pre[0, :, s], "k", row).unsqueeze(0)
                _, kr = apply(kp, kp, cos[:, s], sin[:, s])
                kq[:, s] = kr[0]
            else:
                kq[:, s] = self.rotated_quantize(layer, k[:, s], "k", row, row.rotation)
            vq[:, s] = self.rotated_quantize(layer, v[:, s], "v", row, row.rotate_values)
            self.calls += 1
        return kq, vq, pol

    def attention(
        self, module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kwargs
    ):
        layer = module.layer_idx
        b, hq, n, d = query.shape
        assert b == 1
        hk = key.shape[1]
        scaling = scaling if scaling is not None else d**-0.5
        window = sliding_window
        pre = self.pre.pop(id(key), None)
        if self.calibration is not None:
            self.calibration.setdefault(layer, []).append(
                (key[0].clone(), value[0].clone(), None if pre is None else pre[0][0].clone(), window)
            )
        k, v = key[0].float(), value[0].float()
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        rep = hq // hk
        q = query[0].float()
        s_exact = torch.einsum("hqd,hkd->hqk", q, k.repeat_interleave(rep, 0)) * scaling
        if self.row is None:
            s, p_weights_split = s_exact, None
        else:
            if self.row.prerope and pre is None:
                raise RuntimeError(f"knob_study: layer {layer}: no pre-RoPE key recorded")
            kq, vq, pol = self.compressed_view(layer, k, v, pre, window, self.row)
            s_quant = torch.einsum("hqd,hkd->hqk", q, kq.repeat_interleave(rep, 0)) * scaling
            # M[p, j]: key j is compressed when the query at p attends (L = p + 1 tokens)
            comp_end = torch.tensor([pol.sinks + pol.compressed(p + 1) for p in range(n)])
            m = (pos[None, :] >= pol.sinks) & (pos[None, :] < comp_end[:, None])
            s = torch.where(m, s_quant, s_exact)
            p_weights_split = (m, vq)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, -1)
        vr = v.repeat_interleave(rep, 0)
        if p_weights_split is None:
            out = p @ vr
        else:
            m, vq = p_weights_split
            mf = m.float()
            out = (p * (1 - mf)) @ vr + (p * mf) @ vq.repeat_interleave(rep, 0)
        return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None


def install(study: Study, model):
    """Registers the study's attention and records pre-RoPE keys by wrapping the modeling
    module's apply_rotary_pos_emb (Llama and Gemma 3 call it by its module-level name).
    Returns the function that undoes both."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from nexuskv.hf_compat import attention_implementation

    AttentionInterface.register("nexuskv_knob_study", study.attention)
    AttentionMaskInterface.register("nexuskv_knob_study", sdpa_mask)
    previous = attention_implementation(model.config)
    model.set_attn_implementation("nexuskv_knob_study")
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb

    def recording(q, k, cos, sin, *a, **kw):
        qe, ke = original(q, k, cos, sin, *a, **kw)
        study.pre[id(ke)] = (k, cos, sin, original)
        return qe, ke

    module.apply_rotary_pos_emb = recording

    def restore():
        module.apply_rotary_pos_emb = original
        model.set_attn_implementation(previous)
        study.pre.clear()

    return restore


def collect(study: Study, seqs) -> Dict[int, list]:
    """Each layer's (k, v, pre-RoPE k, window) on the calibration windows, exact attention."""
    study.calibration, study.row = {}, None
    with torch.inference_mode():
        for ids in seqs:
            study.model(ids, use_cache=False)
    cal, study.calibration = study.calibration, None
    return cal


def fit_rotations(study: Study, cal: Dict[int, list]) -> None:
    """The KLT of each layer's and kv head's keys and values: eigenvectors of their covariance
    over the calibration windows' positions that get compressed (sinks left out)."""
    for layer, items in cal.items():
        for i, kind in enumerate(("k", "v")):
            xs = [item[i][:, study.policy(item[3]).sinks :].float() for item in items]  # [H, T, D]
            x = torch.cat(xs, 1).double()
            x = x - x.mean(1, keepdim=True)
            cov = x.transpose(1, 2) @ x / x.shape[1]
            _, vecs = torch.linalg.eigh(cov)  # columns: principal axes, ascending variance
            study.rotations[(layer, kind, "klt")] = vecs.flip(-1).float().contiguous()


def fit_codebooks(study: Study, cal: Dict[int, list], bits_list) -> None:
    """Lloyd-Max tables from the calibration windows' compressed chunks."""
    g = study.args.group
    for layer, items in cal.items():
        per_kind = {"k": [], "v": [], "kc": []}
        for k, v, k_pre, window in items:
            pol = study.policy(window)
            end = pol.sinks + (k.shape[-2] - pol.sinks) // g * g  # every whole chunk: a sample of the groups
            s = slice(pol.sinks, end)
            kk = k_pre if (study.args.prerope_codebooks and k_pre is not None) else k
            gk = normalized(_groups(kk[:, s].float(), -2, g))  # [H, D * chunks, g]
            per_kind["k"].append(gk.reshape(gk.shape[0], -1))
            per_kind["kc"].append(
                gk.reshape(gk.shape[0], -1, k.shape[-1], g).transpose(1, 2).reshape(gk.shape[0], k.shape[-1], -1)
            )
            gv = normalized(_groups(v[:, s].float(), -1, g))
            per_kind["v"].append(gv.reshape(gv.shape[0], -1))
        k_all, v_all = torch.cat(per_kind["k"], 1), torch.cat(per_kind["v"], 1)
        kc_all = torch.cat(per_kind["kc"], 2)
        for bits in bits_list:
            t = study.codebooks
            for kind, a in (("k", k_all), ("v", v_all)):
                for per, pinned in (("head", False), ("pinned", True)):
                    t[(layer, kind, bits, per)] = torch.stack(
                        [lloyd(a[h], bits, pinned=pinned) for h in range(a.shape[0])]
                    ).unsqueeze(1)
            # per key channel: [H, D, L] repeated over the chunk's groups (groups run channel-major
            # within a chunk: index = chunk_group * D + channel)
            ch = torch.stack(
                [
                    torch.stack([lloyd(kc_all[h, c], bits) for c in range(kc_all.shape[1])])
                    for h in range(kc_all.shape[0])
                ]
            )
            t[(layer, "k", bits, "channel")] = ch  # [H, D, L]


def effective_bits(row: Row, head_dim: int, group: int, heads_layers: int, bytes_tokens: int) -> Dict[str, float]:
    """Bits per element of the compressed part (keys, values, both), everything counted: nq's
    format (eval_caches._nq_bits: codes, bf16 scale and zero, fixed outliers as bf16 value + byte
    position), plus what a knob adds."""
    from nexuskv.eval_caches import _nq_bits

    def one(kind: str) -> float:
        b = _nq_bits(row.bits, group, head_dim, row.fixed_outliers, META, META, channel_groups=kind == "v")
        n = group if kind == "k" else min(group, head_dim)
        if row.outliers:
            b += row.outliers * (16 + 8) + 8 / n  # value + position, a count per group
        if row.codebook in ("head", "channel", "pinned"):
            tables = (head_dim if (row.codebook == "channel" and kind == "k") else 1) * heads_layers
            b += tables * (2**row.bits) * 16 / (bytes_tokens * head_dim * heads_layers)
        if (row.rotation if kind == "k" else row.rotate_values) == "klt":  # a bf16 [D, D] matrix per layer and head
            b += head_dim * 16 / bytes_tokens
        return b

    k, v = one("k"), one("v")
    return {"keys": k, "values": v, "kv": (k + v) / 2}


def nll_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits.float()[0]
    return torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")


def rows_for(bits_list, knobs) -> List[Row]:
    rows = []
    for b in bits_list:
        base = Row(f"{b}-bit uniform", b)
        rows.append(base)
        if "control" in knobs:
            rows.append(Row(f"{b}-bit uniform, study quantizer", b, codebook="uniform"))
        if "codebook" in knobs:
            rows.append(Row(f"{b}-bit codebook", b, codebook="head"))
        if "pinned" in knobs:
            rows.append(Row(f"{b}-bit codebook, ends pinned", b, codebook="pinned"))
        if "codebook-ch" in knobs:
            rows.append(Row(f"{b}-bit codebook per key channel", b, codebook="channel"))
        if "outliers" in knobs:
            rows.append(Row(f"{b}-bit outliers 1%", b, outliers=0.01))
            rows.append(Row(f"{b}-bit outliers 0.5%", b, outliers=0.005))
            rows.append(Row(f"{b}-bit 1 outlier per group", b, fixed_outliers=1))
        if "prerope" in knobs:
            rows.append(Row(f"{b}-bit pre-RoPE keys", b, prerope=True))
        if {"codebook", "prerope"} <= set(knobs):
            rows.append(Row(f"{b}-bit codebook + pre-RoPE", b, codebook="head", prerope=True))
        if {"outliers", "prerope"} <= set(knobs):
            rows.append(Row(f"{b}-bit outliers 1% + pre-RoPE", b, outliers=0.01, prerope=True))
        if {"pinned", "outliers", "prerope"} <= set(knobs):
            rows.append(
                Row(
                    f"{b}-bit codebook, ends pinned + outliers 1% + pre-RoPE",
                    b,
                    codebook="pinned",
                    outliers=0.01,
                    prerope=True,
                )
            )
        if "rotation" in knobs:
            rows.append(
                Row(f"{b}-bit Hadamard K and V (rotate=True)", b, rotation="hadamard", rotate_values="hadamard")
            )
            rows.append(Row(f"{b}-bit fitted rotation (KLT) keys", b, rotation="klt"))
            rows.append(
                Row(f"{b}-bit fitted rotation (KLT) keys, Hadamard values", b, rotation="klt", rotate_values="hadamard")
            )
            rows.append(Row(f"{b}-bit fitted rotation (KLT) K and V", b, rotation="klt", rotate_values="klt"))
        if "nofit" in knobs:
            rows.append(Row(f"{b}-bit uniform min/max", b, fit=False))
            if "codebook" in knobs:
                rows.append(Row(f"{b}-bit codebook min/max", b, fit=False, codebook="head"))
    return rows


def baseline_of(row: Dict) -> Optional[str]:
    """The row a knob row is compared with: the study's own quantizer at nq's levels for rows
    through it (codebooks, outliers by fraction), nq_compress at the same bits for the others
    (the study quantizer's own row among them: the control)."""
    plain = f"{row['bits']}-bit uniform"
    if row["name"] == plain:
        return None
    through_study = row["codebook"] not in (None, "uniform") or row["outliers"]
    return f"{plain}, study quantizer" if through_study else plain


def summarize(paths: List[str]) -> str:
    """A markdown table per model and text (runs of the same ones merged, a later run's row
    replacing an earlier one of the same name; their dense perplexities must agree): ΔPPL,
    its range over the segments, and the paired verdict against the row's baseline."""
    from nexuskv.evaluate import paired_verdict

    runs: Dict[tuple, Dict] = {}
    for path in paths:
        doc = json.load(open(path))
        a = doc["args"]
        key = (doc["model"], doc["text"], a["group"], a["sinks"], a["residual"], a["window_residual"])
        if key in runs and any(abs(a - b) > 1e-3 * a for a, b in zip(runs[key]["dense"], doc["dense"])):
            raise SystemExit(f"knob_study: {path}: other segments than the earlier run of {key}")
        merged = runs.setdefault(key, dict(doc, rows={}))
        merged["rows"].update({r["name"]: r for r in doc["rows"]})
    out = []
    for (model, text, group, sinks, residual, window_residual), doc in runs.items():
        policy = f"groups of {group}, {sinks} sinks, tail {residual}, sliding layers' tail {window_residual}"
        dense = ", ".join(f"{d:.3f}" for d in doc["dense"])
        out += [
            f"\n{model}, {os.path.basename(text)}; {policy} (dense {dense})\n",
            "| row | bits | ΔPPL % [range] | against | paired verdict |",
            "|---|---|---|---|---|",
        ]
        rows = doc["rows"]
        for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["bits"]):  # stable: run order within a width
            base = baseline_of(r)
            if base not in rows and base is not None:  # a run without the control: nq's own row
                base = f"{r['bits']}-bit uniform"
            verdict = ""
            if base in rows:
                v = paired_verdict(
                    *[dict(x, repeats=[{"delta_ppl_pct": d} for d in x["repeats"]]) for x in (r, rows[base])]
                )
                verdict = f"{v['verdict']} ({v['diff_pct']:+.2f})"
            out.append(
                f"| {name} | {r['effective_bits']['kv']:.3f} | {r['delta_ppl_pct']:+.2f} "
                f"[{min(r['repeats']):+.2f} .. {max(r['repeats']):+.2f}] | {base or '-'} | {verdict or '-'} |"
            )
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        print(summarize(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="nexuskv.models.load_model's path or name (default: SmolLM2)")
    ap.add_argument("--text", default=None, help="evaluation text (default: Debian's reference manual)")
    ap.add_argument("--calib-text", default=CALIB_TEXT, help="codebooks are fitted on it")
    ap.add_argument("--calib-windows", type=int, default=1)
    ap.add_argument("--windows", type=int, default=3, help="segments of --tokens tokens (the eval's repeats)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=64, help="key tokens / value channels per group (= chunk)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--residual", type=int, default=60, help="tail of full-attention layers (cache_for: 60)")
    ap.add_argument("--window-residual", type=int, default=0, help="tail of sliding-window layers (cache_for: 0)")
    ap.add_argument("--bits", default="4,3,2")
    ap.add_argument(
        "--knobs",
        default="control,codebook,pinned,outliers,prerope",
        help="row families: control, codebook, pinned, codebook-ch, outliers, prerope, rotation, nofit",
    )
    ap.add_argument("--seed", type=int, default=0, help="the Hadamard rows' random signs (cache_for's seed)")
    ap.add_argument("--prerope-codebooks", action="store_true", help="fit the key tables on pre-RoPE keys")
    ap.add_argument("--rows", default=None, help="only rows whose name contains one of these (comma-separated)")
    ap.add_argument("--bytes-tokens", type=int, default=4096, help="tokens a codebook table is amortized over")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    load_start = os.getloadavg()
    model, tok = load_model(torch.float32, attn_implementation="sdpa", path=args.model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    study = Study(model, args)
    check_policy(Policy(args.sinks, args.residual, args.group), args.group)
    check_policy(Policy(0, args.window_residual, args.group), args.group)

    prefix = sequence_prefix(tok)
    body = text_tokens(tok, load_text(args.text), args.windows * args.tokens)
    segments = [
        evaluate.windows(body[:, r * args.tokens : (r + 1) * args.tokens], prefix, args.tokens)
        for r in range(args.windows)
    ]
    cal_body = text_tokens(tok, load_text(args.calib_text), args.calib_windows * args.tokens)
    cal_seqs = [
        as_sequence(prefix, cal_body[:, r * args.tokens : (r + 1) * args.tokens - len(prefix)])
        for r in range(args.calib_windows)
    ]

    # the harness with exact K/V reproduces the model's own SDPA logits
    ids0 = segments[0][0]
    with torch.inference_mode():
        ref = model(ids0, use_cache=False).logits
    install(study, model)
    with torch.inference_mode():
        mine = model(ids0, use_cache=False).logits
    err = float((mine - ref).abs().max())
    if err > 1e-3:
        sys.exit(f"knob_study: the study's exact attention differs from SDPA by {err}")
    print(f"harness: exact attention == SDPA within {err:.2e}", flush=True)

    bits_list = [int(b) for b in args.bits.split(",")]
    knobs = [k for k in args.knobs.split(",") if k]
    if any(k.startswith("codebook") or k in ("pinned", "rotation") for k in knobs):
        t0 = time.time()
        cal = collect(study, cal_seqs)
        if any(k.startswith("codebook") or k == "pinned" for k in knobs):
            fit_codebooks(study, cal, bits_list)
        if "rotation" in knobs:
            fit_rotations(study, cal)
        print(
            f"codebooks / rotations fitted on {args.calib_windows} x {args.tokens} tokens of {args.calib_text} "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )

    def run(row: Optional[Row]) -> List[Dict]:
        study.row = row
        out = []
        for seqs in segments:
            nll = torch.cat([nll_of(model, ids) for ids in seqs if ids.shape[1] > 1])
            out.append({"nll_sum": float(nll.sum()), "tokens": int(nll.numel())})
        return out

    dense = run(None)
    print(
        "dense perplexity per segment: " + ", ".join(f"{math.exp(d['nll_sum'] / d['tokens']):.4f}" for d in dense),
        flush=True,
    )
    rows = rows_for(bits_list, knobs)
    if args.rows:
        rows = [r for r in rows if any(s in r.name for s in args.rows.split(","))]
    layers = cfg.num_hidden_layers
    heads_layers = layers * cfg.num_key_value_heads
    results = []
    for row in rows:
        t0 = time.time()
        study.calls = 0
        per = run(row)
        assert study.calls > 0, "no chunk was compressed: the path under study did not run"
        deltas = [
            100 * (math.exp(r["nll_sum"] / r["tokens"]) / math.exp(d["nll_sum"] / d["tokens"]) - 1)
            for r, d in zip(per, dense)
        ]
        pooled = 100 * (
            math.exp(sum(r["nll_sum"] for r in per) / sum(r["tokens"] for r in per))
            / math.exp(sum(d["nll_sum"] for d in dense) / sum(d["tokens"] for d in dense))
            - 1
        )
        eb = effective_bits(row, head_dim, args.group, heads_layers, args.bytes_tokens)
        results.append(
            dict(asdict(row), delta_ppl_pct=pooled, repeats=deltas, effective_bits=eb, seconds=time.time() - t0)
        )
        print(
            f"{row.name:48s} {eb['kv']:.3f} bits  ΔPPL {pooled:+.2f} %  ["
            + ", ".join(f"{x:+.2f}" for x in deltas)
            + f"]  ({time.time() - t0:.0f} s)",
            flush=True,
        )
    doc = dict(
        model=model_name(args.model),
        text=args.text or "debian-reference",
        calib_text=args.calib_text,
        args=vars(args),
        dense=[math.exp(d["nll_sum"] / d["tokens"]) for d in dense],
        rows=results,
        date=datetime.datetime.utcnow().isoformat(timespec="minutes") + "Z",
        machine=platform.platform(),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        load_average_at_start=load_start,
        load_average_at_end=os.getloadavg(),
    )
    if args.out:
        json.dump(doc, open(args.out, "w"), indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
