#!/usr/bin/env python3
"""Bad-input sweep over nexuskv's public surface, as an outside tester would run it.

Every public operator (torch.ops.nexuskv.* through the typed wrappers of nexuskv.ops, and
the raw dispatcher calls where the wrappers add a check), the compressed cache
(nexuskv.cache.make_cache / KVCache: constructor, append, attend, dense, reorder, crop,
state_dict / from_state_dict) and the Hugging Face binding (nexuskv.hf.cache_for,
NexusKVLayer) gets

  * bad inputs, by category: wrong dtypes, bits, group sizes, outlier counts, shapes
    (empty / 0-D / 5-D), non-contiguous and stride-0 views, NaN / Inf / huge values,
    mismatched decompress inputs, GQA mismatches, bad lengths, tails, signs, meta tensors,
    grad mode, other arguments, corrupt state dicts;
  * valid edge cases (empty batch, length 0, partial groups, q_len > cached, fp16 / bf16 /
    fp32, non-contiguous and stride-0 views, subnormal and huge values), checked against a
    float64 reference (tests/python/nq_reference.py for the format; softmax over
    nq_decompress for attention) with tolerances from the math;
  * valid operation sequences (group "sequences"): seeded random appends, crops (inside the
    compressed part too), attends, state-dict round trips, clones and reorders over a grid
    of cache settings, each step checked against the appended-and-cropped tokens and
    float64 attention over the cache's own dense(); the static cache decoding from its
    first token; a peaked softmax with bf16 queries; pickle / torch.save of cache_for
    caches; crops through NexusKVLayer.crop;
  * forged state dicts and static-cache buffers (group "forged"), which must be refused;
  * errors whose message must name the argument at fault (group "messages").

Each case runs in its own forked process with a timeout.  Verdicts:
  bad input:  clear      an error (RuntimeError/ValueError/TypeError/IndexError/
                         NotImplementedError) whose message names the argument at fault:
                         the operator or constructor argument (k_store, value_bits), the
                         state-dict entry (lengths.evicted, keys.segment_starts), the method
                         argument (beam_idx, length) or, for a call the object's state does
                         not allow, the method (attend()).  The case lists those names (or
                         both sides of a mismatch); a name counts only whole (k is not named
                         by k_tail, segment_starts does not name keys.segment_starts), "_"
                         may be written as a space, and generic words ("must", "expected",
                         "shape", "finite": GENERIC_WORDS) are refused as hints
              unclear    an exception whose message does not name the argument at fault
              crash      the process died (signal, abnormal exit)
              hang       it ran past the timeout
              silent     it returned (garbage), or an error left a cache changed (lost data)
  valid case: pass / wrong (error above the tolerance) / error (raised) / crash / hang
The exit status is 1 when any case crashed, hung, was silent or unclear, or (valid) came
out wrong or raised.

    python scripts/bad_input_sweep.py --json results/bad_input_sweep.json
    python scripts/bad_input_sweep.py --only nq_compress --verbose
    python scripts/bad_input_sweep.py --group new          # sequences, forged, messages
    python scripts/bad_input_sweep.py --group cache --category state,lengths
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import re
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

import nexuskv
from nexuskv import cache as nkcache
from nexuskv import hf, ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
import nq_reference as ref  # noqa: E402  (the independent float64 reference of the format)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
NAN, INF = float("nan"), float("inf")
CLEAR_TYPES = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)
UNCLEAR_MARKS = ("internal assert", "expected a proper tensor", "please report a bug", "segmentation")


@dataclass
class Case:
    name: str  # target/what
    target: str  # the operator or API
    category: str  # bad-input category, or "valid"
    fn: Callable  # bad: makes the call; valid: returns (error, tolerance) or (error, tolerance, where)
    hints: Sequence[str] = ()  # bad: the names of the argument at fault, one of which a clear message names
    propagates: bool = False  # bad: non-finite buffer values, which may also come out as NaN/Inf
    group: str = ""  # the builder that made it (GROUPS): --group runs some of them


CASES: list[Case] = []
# The case groups, in the order they run; the last three are issue 18's (item 9): valid
# operation sequences, forged states and buffers, and messages that must name the argument.
GROUPS = ("operators", "cache", "hf", "static", "sequences", "forged", "messages", "paged")
NEW_GROUPS = ("sequences", "forged", "messages")
_group = ""  # the group the builder now running adds to (build_cases sets it)

# The "clear" rule: a message is clear when it names the argument at fault -- the operator
# or constructor argument (k_store, v_tail, value_bits), the state-dict entry
# (lengths.evicted, due.offset, keys.segment_starts), the method argument (beam_idx,
# length) -- as a whole name, not as part of a longer one (segment_starts does not name
# keys.segment_starts' neighbour outlier_idx; "k" is not named by "k_tail").  Words that
# any error says ("must", "expected", "shape", "dtype of", "finite") do not tell the
# caller which argument to fix, so a case may not list them: _check_hints refuses them.
GENERIC_WORDS = frozenset(
    """must expected shape float float32 float16 bfloat16 finite nan inf range empty tensor int integer row
    segment group argument arguments positional capacity chunk corrupt full holds heads meta fused external
    floating dequantized sequences queries value values keys outlier grad version layer error invalid wrong""".split()
)
# An argument, entry or dimension name; a method name with "()" (a call the object's state
# does not allow has no argument at fault); a name in quotes, for a state-dict entry whose
# name is also a generic word ('shape': the message must quote it).
_NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*(\(\))?|'[a-z_.]+'")


def _check_hints(name: str, hints: Sequence[str]) -> tuple:
    hints = tuple(h.lower() for h in hints)
    for h in hints:
        if not _NAME.fullmatch(h) or h in GENERIC_WORDS:
            raise ValueError(f"case {name!r}: hint {h!r} is not the name of an argument (see GENERIC_WORDS)")
    return hints


def names_argument(msg: str, hint: str) -> bool:
    """Whether msg (lower case) names hint as a whole name: not inside a longer identifier
    or dotted entry name (k in k_tail, segment_starts in keys.segment_starts); an
    underscore may be written as a space ("rotation signs" names rotation_signs)."""
    name = re.escape(hint).replace("_", "[_ ]")
    return re.search(r"(?<![\w.])" + name + r"(?![\w]|\.\w)", msg) is not None


def bad(target: str, category: str, what: str, fn: Callable, *hints: str) -> None:
    name = f"{target}/{what}"
    CASES.append(Case(name, target, category, fn, _check_hints(name, hints), group=_group))


def nonfinite(target: str, what: str, fn: Callable, *hints: str) -> None:
    """NaN/Inf in the values of compressed buffers given to a raw operator: the buffers'
    values are data (only positions, segment starts and lengths, which steer memory
    access, are checked), so either a clear error or NaN/Inf in the output is right;
    finite output would hide them (silent)."""
    name = f"{target}/{what}"
    CASES.append(Case(name, target, "values", fn, _check_hints(name, hints), True, group=_group))


def valid(target: str, what: str, fn: Callable) -> None:
    CASES.append(Case(f"{target}/{what}", target, "valid", fn, group=_group))


class LostData(Exception):
    """Raised by a bad case whose call raised but changed the state it should have kept."""


# ---- inputs --------------------------------------------------------------------------------


def rnd(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)


def poke(x: torch.Tensor, value: float, index=None) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[x.numel() // 2 if index is None else index] = value
    return x


def replace(seq, i, t):
    seq = list(seq)
    seq[i] = t
    return seq


def grad_leaf(t):
    return t.detach().clone().requires_grad_(True)


NQ_SHAPE = (2, 3, 40, 64)  # partial last token group at G=16


def nq_parts(shape=NQ_SHAPE, bits=4, G=16, axis=-2, k=1, dtype=F32, meta=None, seed=0):
    return list(ops.nq_compress(rnd(*shape, dtype=dtype, seed=seed), bits, G, axis, k, meta))


def nq_dec(parts, bits=4, G=16, axis=-2, D=64, out=None):
    return ops.nq_decompress(*parts, bits, G, axis, D, out)


def dgq_parts(shape=(2, 3, 80, 64), bits=4, G=32, granule=16, max_len=None, k=1, dtype=F32):
    return list(ops.dgq_compress(rnd(*shape, dtype=dtype), bits, G, granule, max_len, k))


def dgq_dec(parts, bits=4, G=32, D=64, out=None):
    return ops.dgq_decompress(*parts, bits, G, D, out)


def hadamard_f64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation_f64(signs: torch.Tensor) -> torch.Tensor:
    """R with rotate(x) = x @ R.T: R = H diag(signs) / sqrt(n)."""
    n = signs.shape[0]
    return hadamard_f64(n) @ torch.diag(signs.to(F64)) / math.sqrt(n)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(F64), b.to(F64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def attention_tol(q_dtype) -> float:
    # fp32 q: float32 tiles, 1e-4 relative (the suite's bound); fp16/bf16 q: the integer-key
    # path's documented 1e-3 plus rounding the output to q's dtype (eps/2 per element).
    return 1e-4 if q_dtype == F32 else 1e-3 + torch.finfo(q_dtype).eps


def attention_f64(q, K, V, lens, scale, window=None, softcap=None):
    """Causal float64 attention of the last q_len positions of each sequence over its
    first lens[b] keys K[b] [Hkv, L, D]; a query row that sees no key gives zeros."""
    B, Hq, Lq, D = q.shape
    out = torch.zeros(B, Hq, Lq, D, dtype=F64)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        g = Hq // K[b].shape[0]
        k, v = K[b][:, :L].to(F64).repeat_interleave(g, 0), V[b][:, :L].to(F64).repeat_interleave(g, 0)
        s = (q[b].to(F64) @ k.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        key, pos = torch.arange(L)[None, :], torch.arange(L - Lq, L)[:, None]
        hidden = key > pos
        if window is not None:
            hidden |= key <= pos - window
        s = s.masked_fill(hidden, -math.inf)
        seen = ~hidden.all(-1)
        p = torch.where(seen[None, :, None], torch.softmax(s.masked_fill(~seen[:, None], 0.0), -1), 0.0)
        out[b] = p @ v
    return out


class Att:
    """A valid dgq_fused_attention call (keywords in self.args) and its float64 reference:
    softmax over nq_decompress / dgq_decompress of the buffers (float32 out), rotated back."""

    def __init__(
        self,
        B=2,
        Hkv=2,
        Hq=4,
        Lq=1,
        D=64,
        T=64,
        kb=4,
        kG=32,
        kaxis=-2,
        kk=1,
        vb=4,
        vG=32,
        vaxis=-1,
        vk=1,
        dtype=F32,
        q_dtype=None,
        dgq=False,
        tail=8,
        tail_lens=(8, 3),
        comp_lens=(64, 40),
        sinks=0,
        sink_lens=None,
        rotate=False,
        window=None,
        softcap=None,
        seed=0,
    ):
        K, V = rnd(B, Hkv, T, D, dtype=dtype, seed=seed), rnd(B, Hkv, T, D, dtype=dtype, seed=seed + 1)
        self.signs = nexuskv.rotation_signs(D, seed) if rotate else None
        if rotate:
            K, V = ops.hadamard_rotate(K, self.signs), ops.hadamard_rotate(V, self.signs)
        kc = ops.dgq_compress(K, kb, kG, 16, None, kk) if dgq else ops.nq_compress(K, kb, kG, kaxis, kk)
        vc = ops.nq_compress(V, vb, vG, vaxis, vk)
        self.fmt = dict(kb=kb, kG=kG, kaxis=-2 if dgq else kaxis, vb=vb, vG=vG, vaxis=vaxis, D=D, dgq=dgq)
        a = dict(
            q=rnd(B, Hq, Lq, D, dtype=q_dtype or dtype, seed=seed + 2),
            k_cache=list(kc),
            v_cache=list(vc),
            k_format=[kb, kG, self.fmt["kaxis"]],
            v_format=[vb, vG, vaxis],
            compressed_lens=torch.tensor(comp_lens[:B] if B else [], dtype=torch.int64),
        )
        if tail:
            a.update(
                k_tail=rnd(B, Hkv, tail, D, dtype=dtype, seed=seed + 3),
                v_tail=rnd(B, Hkv, tail, D, dtype=dtype, seed=seed + 4),
                tail_lens=torch.tensor(tail_lens[:B] if B else [], dtype=torch.int64),
            )
        if sinks:
            a.update(
                k_sink=rnd(B, Hkv, sinks, D, dtype=dtype, seed=seed + 5),
                v_sink=rnd(B, Hkv, sinks, D, dtype=dtype, seed=seed + 6),
                sink_lens=torch.tensor((sink_lens or [sinks] * B)[:B], dtype=torch.int64),
            )
        a.update(rotation_signs=self.signs, window=window, softcap=softcap)
        self.args = a

    def call(self, **over):
        return ops.dgq_fused_attention(**{**self.args, **over})

    def raw(self, **over):
        """The dispatcher call without the wrapper's argument checks."""
        a = {**self.args, **over}
        return torch.ops.nexuskv.dgq_fused_attention(
            a["q"],
            a["k_cache"],
            a["v_cache"],
            a["k_format"],
            a["v_format"],
            a["compressed_lens"],
            a.get("k_tail"),
            a.get("v_tail"),
            a.get("tail_lens"),
            a.get("rotation_signs"),
            a.get("scale"),
            a.get("k_sink"),
            a.get("v_sink"),
            a.get("sink_lens"),
            a.get("window"),
            a.get("softcap"),
        )

    def reference(self):
        a, f = self.args, self.fmt
        if f["dgq"]:
            Kh = ops.dgq_decompress(*a["k_cache"], f["kb"], f["kG"], f["D"], F32)
        else:
            Kh = ops.nq_decompress(*a["k_cache"], f["kb"], f["kG"], f["kaxis"], f["D"], F32)
        Vh = ops.nq_decompress(*a["v_cache"], f["vb"], f["vG"], f["vaxis"], f["D"], F32)
        Kh, Vh = Kh.to(F64), Vh.to(F64)
        if self.signs is not None:
            R = rotation_f64(self.signs)
            Kh, Vh = Kh @ R, Vh @ R
        q = a["q"]
        B = q.shape[0]
        Ks, Vs, lens = [], [], []
        for b in range(B):
            parts_k, parts_v = [], []
            if a.get("k_sink") is not None:
                s = int(a["sink_lens"][b])
                parts_k.append(a["k_sink"][b, :, :s].to(F64)), parts_v.append(a["v_sink"][b, :, :s].to(F64))
            c = int(a["compressed_lens"][b])
            parts_k.append(Kh[b, :, :c]), parts_v.append(Vh[b, :, :c])
            if a.get("k_tail") is not None:
                t = int(a["tail_lens"][b])
                parts_k.append(a["k_tail"][b, :, :t].to(F64)), parts_v.append(a["v_tail"][b, :, :t].to(F64))
            Ks.append(torch.cat(parts_k, 1)), Vs.append(torch.cat(parts_v, 1))
            lens.append(Ks[-1].shape[1])
        scale = a.get("scale") or q.shape[-1] ** -0.5
        return attention_f64(q, Ks, Vs, lens, scale, a.get("window"), a.get("softcap"))

    def check(self, **over):
        self.args.update(over)
        out = self.call()
        if out.shape != self.args["q"].shape or out.dtype != self.args["q"].dtype:
            return INF, 0.0
        return rel_err(out, self.reference()), attention_tol(self.args["q"].dtype)


# ---- valid-case checks of the format ------------------------------------------------------


def meta_of(dtype, meta):
    return meta or dtype


def check_nq_roundtrip(x, bits, G, axis, k, meta=None, out=None):
    """x_hat = decompress(compress(x)) against the float64 reference's scale: every dense
    entry within scale/2 (+ float32 arithmetic, + rounding into the output dtype), every
    outlier exact (up to the output rounding).  Returns (max excess over the bound, 0)."""
    parts = ops.nq_compress(x, bits, G, axis, k, meta)
    x_hat = ops.nq_decompress(*parts, bits, G, axis, x.shape[-1], out)
    out_dtype = out or x.dtype
    if x_hat.shape != x.shape or x_hat.dtype != out_dtype:
        return INF, 0.0
    return _excess(x, x_hat, bits, G, axis, k, meta_of(x.dtype, meta), out_dtype), 0.0


def _excess(x, x_hat, bits, G, axis, k, meta, out_dtype, seg_scale=None):
    N = max(1, math.prod(x.shape[:-2]))
    T, D = x.shape[-2:]
    x3, h3 = x.reshape(N, T, D).to(F64), x_hat.reshape(N, T, D).to(F64)
    if seg_scale is None:
        p = ref.reference_params(x.reshape(N, T, D), bits, G, axis, k, meta)
        s_el = ref.per_element(p["scale"], T, D, G, axis)
        outlier = torch.zeros(N, T, D, dtype=torch.bool)
        if k:
            pos = p["pos"]  # [N, A, B, k] position in the group
            A, Bm = pos.shape[1:3]
            for n in range(N):
                for slot in range(k):
                    if axis == -2:
                        t = torch.arange(A)[:, None] * G + pos[n, :, :, slot]
                        ch = torch.arange(Bm)[None, :].expand(A, Bm)
                    else:
                        t = torch.arange(A)[:, None].expand(A, Bm)
                        ch = torch.arange(Bm)[None, :] * G + pos[n, :, :, slot]
                    ok = (t < T) & (ch < D)
                    outlier[n, t[ok], ch[ok]] = True
    else:
        s_el, outlier = seg_scale
    arith = 2.0**-22 * x3.abs()  # float32 code * scale + zero
    rounding = ref.ulp(h3, out_dtype) / 2 if out_dtype != F32 else torch.zeros_like(h3)
    bound = torch.where(outlier, rounding, s_el / 2 + arith + rounding)
    return float(((x3 - h3).abs() - bound).max().clamp_min(0)) if x3.numel() else 0.0


def check_dgq_roundtrip(x, bits, G, granule=16, max_len=None, k=0, meta=None):
    parts = ops.dgq_compress(x, bits, G, granule, max_len, k, meta)
    starts = parts[5]
    N = max(1, math.prod(x.shape[:-2]))
    T, D = x.shape[-2:]
    S = -(-T // G)
    limit = max_len or min(256, -(-2 * G // granule) * granule)
    st = starts.reshape(N, S).long()
    if starts.shape[-1] != S or int(st[:, 0].max()) != 0:
        return INF, 0.0
    x_hat = ops.dgq_decompress(*parts, bits, G, D, None)
    x3 = x.reshape(N, T, D)
    s_el = torch.zeros(N, T, D, dtype=F64)
    outlier = torch.zeros(N, T, D, dtype=torch.bool)
    for n in range(N):
        bounds = st[n].tolist() + [T]
        for s in range(S):
            a, b = bounds[s], bounds[s + 1]
            if b < a or (b - a) > limit or (b != T and (a % granule or b % granule)):
                return INF, 0.0
            if b == a:
                continue
            p = ref.reference_params(x3[n : n + 1, a:b], bits, b - a, -2, k, meta_of(x.dtype, meta))
            s_el[n, a:b] = p["scale"][0, 0][None, :]
            for slot in range(k):
                t = a + p["pos"][0, 0, :, slot]
                outlier[n, t, torch.arange(D)] = True
    return _excess(x, x_hat, bits, G, -2, k, meta_of(x.dtype, meta), x.dtype, (s_el, outlier)), 0.0


# ==== cases ===================================================================================

BAD_DTYPES = [torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    BAD_DTYPES.append(torch.float8_e4m3fn)
BAD_BITS = [0, 1, 5, 6, 7, 9, 16, -1, -4, 2**32 + 4, 2**63 - 1]
BAD_GROUPS = [0, -1, 257, 1024, 2**31, 2**32 + 16, -(2**63)]


def nq_compress_cases():
    op = "nq_compress"
    x = lambda **kw: rnd(2, 3, 40, 64, **kw)  # noqa: E731
    for dt in BAD_DTYPES:
        bad(op, "dtype", f"x {dt}", lambda dt=dt: ops.nq_compress(x().to(dt), 4, 16, -2), "x")
    for dt in (torch.int32, torch.float64, torch.bool, torch.uint8):
        bad(op, "dtype", f"meta_dtype {dt}", lambda dt=dt: ops.nq_compress(x(), 4, 16, -2, 0, dt), "meta_dtype")
    for b in BAD_BITS:
        bad(op, "bits", f"bits {b}", lambda b=b: ops.nq_compress(x(), b, 16, -2), "bits")
    bad(op, "bits", "bits=True", lambda: ops.nq_compress(x(), True, 16, -2), "bits")
    bad(op, "bits", "bits 4.0 (float)", lambda: ops.nq_compress(x(), 4.0, 16, -2), "bits")
    for g in BAD_GROUPS:
        bad(op, "group_size", f"group_size {g}", lambda g=g: ops.nq_compress(x(), 4, g, -1), "group_size")
    for G, k in ((16, -1), (16, 16), (16, 17), (256, 256), (16, 2**32 + 1), (8, 2**63 - 1)):
        bad(
            op, "outliers", f"num_outliers {k} G{G}", lambda G=G, k=k: ops.nq_compress(x(), 4, G, -2, k), "num_outliers"
        )
    for a in (0, 1, -3, 2, 3, 2**32 - 2):
        bad(op, "args", f"axis {a}", lambda a=a: ops.nq_compress(x(), 4, 16, a), "axis")
    for shape in ((), (64,), (0, 64), (2, 0, 64), (2, 3, 40, 0), (0, 3, 40, 64)):
        bad(op, "shape", f"x shape {shape}", lambda s=shape: ops.nq_compress(torch.zeros(s), 4, 16, -1), "x")
    for dt in (F32, F16, BF16):
        for axis in (-2, -1):
            for v in (NAN, INF, -INF):
                bad(
                    op,
                    "values",
                    f"x {dt} axis {axis} holds {v}",
                    lambda dt=dt, axis=axis, v=v: ops.nq_compress(poke(x(dtype=dt), v), 4, 16, axis, 1),
                    "x",
                )
    bad(
        op,
        "values",
        "fp32 range beyond FLT_MAX",
        lambda: ops.nq_compress(poke(poke(x(), 3e38, 0), -3e38, 64), 4, 16, -2),
        "x",
    )
    bad(
        op,
        "values",
        "bf16 1e6 into float16 meta",
        lambda: ops.nq_compress(poke(x(dtype=BF16), 1e6), 4, 16, -2, 0, F16),
        "meta_dtype",
        "x",
    )
    bad(
        op,
        "values",
        "fp32 1e30 into bfloat16->float16 meta",
        lambda: ops.nq_compress(poke(x(), 1e30), 8, 16, -1, 0, F16),
        "meta_dtype",
        "x",
    )
    # Non-contiguous and stride-0 views whose defect only the view shows.
    bad(
        op,
        "layout",
        "transposed view with NaN",
        lambda: ops.nq_compress(poke(rnd(2, 3, 64, 40), NAN, 7).transpose(-1, -2), 4, 16, -2),
        "x",
    )
    bad(
        op,
        "layout",
        "stride-0 expanded Inf",
        lambda: ops.nq_compress(torch.tensor(INF).expand(2, 40, 64), 4, 16, -1),
        "x",
    )
    bad(
        op,
        "layout",
        "strided slice with -Inf",
        lambda: ops.nq_compress(poke(rnd(2, 3, 80, 64), -INF, 64 * 2)[:, :, ::2], 4, 16, -2),
        "x",
    )
    bad(op, "meta", "meta x bits 5", lambda: ops.nq_compress(torch.empty(2, 40, 64, device="meta"), 5, 16, -2), "bits")
    bad(
        op,
        "meta",
        "meta x float64",
        lambda: ops.nq_compress(torch.empty(2, 40, 64, device="meta", dtype=F64), 4, 16, -2),
        "x",
    )
    bad(op, "meta", "meta x empty", lambda: ops.nq_compress(torch.empty(0, 40, 64, device="meta"), 4, 16, -2), "x")
    bad(
        op,
        "meta",
        "meta x num_outliers = G",
        lambda: ops.nq_compress(torch.empty(2, 40, 64, device="meta"), 4, 16, -2, 16),
        "num_outliers",
    )
    bad(
        op,
        "meta",
        "meta x meta_dtype int32",
        lambda: ops.nq_compress(torch.empty(2, 40, 64, device="meta"), 4, 16, -2, 0, torch.int32),
        "meta_dtype",
    )
    bad(op, "grad", "x requires grad", lambda: ops.nq_compress(grad_leaf(x()), 4, 16, -2), "x")
    bad(op, "grad", "non-leaf x requiring grad", lambda: ops.nq_compress(grad_leaf(x()) * 2, 4, 16, -1), "x")
    bad(op, "args", "meta_dtype 'float16' (str)", lambda: ops.nq_compress(x(), 4, 16, -2, 0, "float16"), "meta_dtype")
    bad(op, "args", "x is a list", lambda: ops.nq_compress([[1.0] * 64] * 16, 4, 16, -2), "x")

    # valid
    for i, (bits, axis, dt) in enumerate((b, a, d) for b in (2, 3, 4, 8) for a in (-2, -1) for d in (F32, F16, BF16)):
        k = (0, 1, 2)[i % 3]
        T, D, G = (37, 64, 16) if axis == -2 else (9, 40, 16)  # partial last groups
        valid(
            op,
            f"roundtrip {bits}b axis {axis} {dt} k{k} partial",
            lambda bits=bits, axis=axis, dt=dt, k=k, T=T, D=D, G=G: check_nq_roundtrip(
                rnd(2, 2, T, D, dtype=dt, seed=bits), bits, G, axis, k
            ),
        )
    valid(op, "5-D x", lambda: check_nq_roundtrip(rnd(2, 1, 2, 20, 32), 4, 8, -2, 1))
    valid(op, "G=1 per-token", lambda: check_nq_roundtrip(rnd(1, 5, 32), 4, 1, -1, 0))
    valid(op, "G=256 one group", lambda: check_nq_roundtrip(rnd(1, 300, 16), 2, 256, -2, 3))
    valid(op, "T=1", lambda: check_nq_roundtrip(rnd(1, 1, 64), 4, 64, -2, 0))
    valid(op, "partial group with fewer tokens than outliers", lambda: check_nq_roundtrip(rnd(1, 66, 16), 4, 64, -2, 3))
    valid(op, "transposed view", lambda: check_nq_roundtrip(rnd(2, 64, 40).transpose(-1, -2), 4, 16, -2, 1))
    valid(op, "stride-0 expanded", lambda: check_nq_roundtrip(rnd(1, 1, 64).expand(3, 40, 64), 4, 16, -2, 0))
    valid(op, "strided slice", lambda: check_nq_roundtrip(rnd(2, 80, 64)[:, ::2], 3, 16, -1, 1))
    valid(op, "subnormal fp32", lambda: check_nq_roundtrip(rnd(2, 32, 32, scale=1e-40), 4, 16, -2, 0))
    valid(op, "huge same-sign fp32", lambda: check_nq_roundtrip(rnd(2, 32, 32).abs() * 1e37 + 2e38, 4, 16, -1, 1))
    valid(op, "constant group", lambda: check_nq_roundtrip(torch.full((2, 32, 32), 3.25), 4, 16, -2, 0))
    valid(
        op, "bf16 in float16 meta (in range)", lambda: check_nq_roundtrip(rnd(2, 32, 64, dtype=BF16), 4, 16, -2, 0, F16)
    )
    valid(op, "fp32 to float16 out", lambda: check_nq_roundtrip(rnd(2, 32, 64), 4, 16, -1, 1, None, F16))
    valid(
        op,
        "meta tensors give meta outputs",
        lambda: _meta_shapes_ok(
            ops.nq_compress(torch.empty(2, 40, 64, device="meta"), 4, 16, -2, 1), (2, 40, 32), (2, 3, 64)
        ),
    )
    valid(
        op,
        "no_grad with requires_grad x",
        lambda: _no_grad(lambda: check_nq_roundtrip(grad_leaf(rnd(2, 16, 32)), 4, 8, -2, 0)),
    )


def _meta_shapes_ok(parts, codes_shape, meta_shape):
    ok = parts[0].device.type == "meta" and tuple(parts[0].shape) == codes_shape and tuple(parts[1].shape) == meta_shape
    return (0.0 if ok else INF), 0.0


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def nq_decompress_cases():
    op = "nq_decompress"
    good = lambda **kw: nq_parts(**kw)  # noqa: E731
    part_names = ("codes", "scale", "zero", "outlier_idx", "outlier_val")
    for b in (2, 8, 3, 5, 0, 2**32 + 4):
        bad(op, "bits", f"bits {b}", lambda b=b: nq_dec(good(), bits=b), "bits")
    for g in (8, 0, -1, 257, 2**32 + 16):
        bad(op, "group_size", f"group_size {g}", lambda g=g: nq_dec(good(), G=g), "group_size", "scale")
    for a in (-1, 0, 1):
        bad(op, "args", f"axis {a}", lambda a=a: nq_dec(good(), axis=a), "axis", "scale")
    for d in (32, 65, 0, -64, 96, 2**32 + 64):
        bad(op, "mismatch", f"head_dim {d}", lambda d=d: nq_dec(good(), D=d), "head_dim", "codes")
    for i, dt in (
        (0, torch.int8),
        (0, F32),
        (1, F64),
        (1, torch.int32),
        (2, F16),
        (3, torch.int64),
        (4, F64),
        (4, torch.int32),
    ):
        # zero must have scale's dtype: either may be the one at fault
        at_fault = (part_names[i], "scale") if i == 2 else (part_names[i],)
        bad(op, "dtype", f"part {i} {dt}", lambda i=i, dt=dt: nq_dec(replace(good(), i, good()[i].to(dt))), *at_fault)
    for dt in (torch.int32, F64, torch.uint8, torch.bool):
        bad(op, "dtype", f"out_dtype {dt}", lambda dt=dt: nq_dec(good(), out=dt), "out_dtype")
    bad(op, "shape", "codes 0-D", lambda: nq_dec(replace(good(), 0, torch.zeros((), dtype=torch.uint8))), "codes")
    bad(op, "shape", "codes 1-D", lambda: nq_dec(replace(good(), 0, torch.zeros(32, dtype=torch.uint8))), "codes")
    bad(
        op,
        "shape",
        "codes empty",
        lambda: nq_dec(replace(good(), 0, torch.zeros(2, 3, 0, 32, dtype=torch.uint8))),
        "codes",
    )
    bad(op, "shape", "codes 5-D extra lead", lambda: nq_dec(replace(good(), 0, good()[0][None])), "codes", "scale")
    bad(
        op,
        "mismatch",
        "codes one token short",
        lambda: nq_dec(replace(good(), 0, good()[0][:, :, :39])),
        "codes",
        "outlier_idx",
    )
    bad(
        op, "mismatch", "codes lead dims differ", lambda: nq_dec(replace(good(), 0, good()[0][:, :2])), "codes", "scale"
    )
    bad(op, "mismatch", "scale shape", lambda: nq_dec(replace(good(), 1, good()[1][..., :-1])), "scale")
    bad(op, "mismatch", "zero shape", lambda: nq_dec(replace(good(), 2, good()[2][:, :, :1])), "zero")
    bad(
        op,
        "mismatch",
        "scale/zero dtypes differ",
        lambda: nq_dec(replace(good(), 2, good()[2].to(F16))),
        "zero",
        "scale",
    )
    bad(
        op,
        "mismatch",
        "outlier_idx k 2 val k 1",
        lambda: nq_dec(replace(good(k=2), 4, good(k=1)[4])),
        "outlier_idx",
        "outlier_val",
    )
    bad(op, "mismatch", "outlier_idx shape", lambda: nq_dec(replace(good(), 3, good()[3][:, :, :1])), "outlier_idx")
    bad(
        op,
        "mismatch",
        "outlier_idx beyond group",
        lambda: nq_dec(replace(good(), 3, good()[3].fill_(200))),
        "outlier_idx",
    )
    bad(
        op,
        "mismatch",
        "outlier_idx beyond partial group",
        lambda: nq_dec(replace(good(), 3, _last_group(good()[3], 12))),
        "outlier_idx",
    )
    bad(op, "mismatch", "parts from axis -1 read as -2", lambda: nq_dec(good(axis=-1)), "axis", "scale")
    bad(op, "mismatch", "parts of 3-bit read as 4-bit", lambda: nq_dec(good(bits=3)), "bits", "codes")
    bad(
        op,
        "mismatch",
        "dgq parts given to nq (6 tensors)",
        lambda: ops.nq_decompress(*dgq_parts(), 4, 32, -2, 64),
        "bits",  # the sixth positional argument, where segment_starts landed
    )
    nonfinite(op, "NaN scale", lambda: nq_dec(replace(good(), 1, poke(good()[1], NAN))), "scale")
    nonfinite(op, "Inf zero", lambda: nq_dec(replace(good(), 2, poke(good()[2], INF))), "zero")
    nonfinite(op, "NaN outlier_val", lambda: nq_dec(replace(good(), 4, poke(good()[4], NAN))), "outlier_val")
    for i, nm in enumerate(("codes", "scale", "zero", "outlier_idx", "outlier_val")):
        bad(op, "meta", f"{nm} on meta", lambda i=i, nm=nm: nq_dec(replace(good(), i, good()[i].to("meta"))), nm)
    bad(
        op,
        "meta",
        "all meta, head_dim mismatch",
        lambda: nq_dec([t.to("meta") for t in good()], D=32),
        "head_dim",
        "codes",
    )
    bad(
        op,
        "meta",
        "all meta, outlier k mismatch",
        lambda: nq_dec([t.to("meta") for t in replace(good(k=2), 4, good(k=1)[4])]),
        "outlier_idx",
        "outlier_val",
    )
    for i, nm in ((1, "scale"), (2, "zero"), (4, "outlier_val")):
        bad(op, "grad", f"{nm} requires grad", lambda i=i: nq_dec(replace(good(), i, grad_leaf(good()[i]))), nm)
    bad(
        op,
        "layout",
        "stride-0 codes of wrong shape",
        lambda: nq_dec(replace(good(), 0, good()[0][:, :, :1].expand(2, 3, 49, 32))),
        "codes",
        "scale",
    )
    bad(op, "layout", "transposed codes", lambda: nq_dec(replace(good(), 0, good()[0].transpose(-1, -2))), "codes")
    bad(op, "args", "head_dim True", lambda: nq_dec(good(), D=True), "head_dim")

    # valid
    for bits, axis, dt in ((4, -2, F32), (2, -1, F16), (8, -2, BF16), (3, -1, F32)):
        valid(
            op,
            f"non-contiguous parts {bits}b axis {axis} {dt}",
            lambda bits=bits, axis=axis, dt=dt: _noncontig_dec(bits, axis, dt),
        )
    valid(
        op, "bf16 parts to float32 out", lambda: check_nq_roundtrip(rnd(2, 40, 64, dtype=BF16), 4, 16, -2, 1, None, F32)
    )
    valid(
        op,
        "all-meta parts give a meta output",
        lambda: (0.0 if nq_dec([t.to("meta") for t in nq_parts()]).shape == NQ_SHAPE else INF, 0.0),
    )


def _last_group(idx, value):
    idx = idx.clone()
    idx[:, :, -1] = value  # the last token group has 8 tokens (40 = 2*16 + 8)
    return idx


def _noncontig_dec(bits, axis, dt):
    x = rnd(3, 2, 40, 64, dtype=dt)
    parts = ops.nq_compress(x, bits, 16, axis, 1)
    # The same buffers as permuted / strided views (lead dims swapped back by a transpose).
    views = [p.transpose(0, 1).contiguous().transpose(0, 1) for p in parts]
    x_hat = ops.nq_decompress(*views, bits, 16, axis, 64)
    x_ref = ops.nq_decompress(*parts, bits, 16, axis, 64)
    if not torch.equal(x_hat, x_ref):
        return INF, 0.0
    return _excess(x, x_hat, bits, 16, axis, 1, dt, dt), 0.0


def dgq_cases():
    op = "dgq_compress"
    x = lambda **kw: rnd(2, 3, 80, 64, **kw)  # noqa: E731
    for dt in BAD_DTYPES[:5]:
        bad(op, "dtype", f"x {dt}", lambda dt=dt: ops.dgq_compress(x().to(dt), 4, 32), "x")
    for b in (0, 5, 9, -1, 2**32 + 4):
        bad(op, "bits", f"bits {b}", lambda b=b: ops.dgq_compress(x(), b, 32), "bits")
    for g in (0, -1, 257, 2**32 + 32):
        bad(op, "group_size", f"group_size {g}", lambda g=g: ops.dgq_compress(x(), 4, g), "group_size")
    for gr in (0, -1, 512, 2**32 + 16):
        bad(op, "args", f"granule {gr}", lambda gr=gr: ops.dgq_compress(x(), 4, 32, gr), "granule")
    for ml in (0, -16, 8, 40, 272, 2**32 + 64):
        bad(op, "args", f"max_len {ml}", lambda ml=ml: ops.dgq_compress(x(), 4, 32, 16, ml), "max_len")
    bad(op, "args", "max_len < group_size", lambda: ops.dgq_compress(x(), 4, 64, 16, 32), "max_len", "group_size")
    bad(op, "args", "default max_len above 256 (G=200)", lambda: ops.dgq_compress(x(), 4, 200), "max_len")
    for k in (-1, 32, 33):
        bad(op, "outliers", f"num_outliers {k}", lambda k=k: ops.dgq_compress(x(), 4, 32, 16, None, k), "num_outliers")
    for shape in ((), (64,), (0, 64), (2, 0, 64), (2, 80, 0)):
        bad(op, "shape", f"x shape {shape}", lambda s=shape: ops.dgq_compress(torch.zeros(s), 4, 32), "x")
    for v in (NAN, INF):
        bad(op, "values", f"x holds {v}", lambda v=v: ops.dgq_compress(poke(x(), v), 4, 32), "x")
    bad(
        op,
        "values",
        "fp16 into... range fine but bf16 1e6 to float16 meta",
        lambda: ops.dgq_compress(poke(x(dtype=BF16), 1e6), 4, 32, 16, None, 0, F16),
        "meta_dtype",
        "x",
    )
    bad(
        op,
        "layout",
        "transposed view with NaN",
        lambda: ops.dgq_compress(poke(rnd(2, 64, 80), NAN, 3).transpose(-1, -2), 4, 32),
        "x",
    )
    bad(
        op,
        "meta",
        "meta x granule 0",
        lambda: ops.dgq_compress(torch.empty(2, 80, 64, device="meta"), 4, 32, 0),
        "granule",
    )
    bad(op, "meta", "meta x empty", lambda: ops.dgq_compress(torch.empty(2, 0, 64, device="meta"), 4, 32), "x")
    bad(op, "grad", "x requires grad", lambda: ops.dgq_compress(grad_leaf(x()), 4, 32), "x")
    bad(op, "dtype", "meta_dtype int32", lambda: ops.dgq_compress(x(), 4, 32, 16, None, 0, torch.int32), "meta_dtype")
    for bits, G, gr, T, k, dt in (
        (4, 32, 16, 80, 1, F32),
        (2, 16, 16, 37, 0, F16),
        (8, 64, 16, 200, 2, BF16),
        (3, 32, 8, 100, 1, F32),
        (4, 8, 1, 23, 0, F32),
        (4, 64, 16, 66, 3, F32),
    ):
        valid(
            op,
            f"roundtrip {bits}b G{G} granule {gr} T{T} k{k} {dt}",
            lambda bits=bits, G=G, gr=gr, T=T, k=k, dt=dt: check_dgq_roundtrip(
                rnd(2, 2, T, 32, dtype=dt, seed=T), bits, G, gr, None, k
            ),
        )
    valid(
        op,
        "level shift in the data",
        lambda: check_dgq_roundtrip(torch.cat([rnd(1, 48, 32), rnd(1, 80, 32) * 50 + 100], 1), 4, 32, 16, None, 0),
    )
    valid(op, "transposed view", lambda: check_dgq_roundtrip(rnd(2, 32, 96).transpose(-1, -2), 4, 32, 16, None, 1))
    valid(op, "max_len = 2 * group_size", lambda: check_dgq_roundtrip(rnd(2, 64, 32), 4, 16, 16, 32, 0))
    valid(op, "granule 7", lambda: check_dgq_roundtrip(rnd(2, 90, 32), 4, 32, 7, None, 1))

    op = "dgq_decompress"
    good = lambda **kw: dgq_parts(**kw)  # noqa: E731

    def with_starts(fn):
        p = good()
        return dgq_dec(replace(p, 5, fn(p[5].clone())))

    for nm, fn in (
        ("int64", lambda s: s.long()),
        ("float", lambda s: s.float()),
        ("one more", lambda s: torch.cat([s, s[..., -1:]], -1)),
        ("one fewer", lambda s: s[..., :-1]),
        ("not from 0", lambda s: s.add_(16)),
        ("decreasing", lambda s: s.flip(-1).contiguous()),
        ("beyond T", lambda s: s.mul_(10)),
        ("negative", lambda s: s.sub_(32)),
        ("lead dims differ", lambda s: s[:1]),
        ("0-D", lambda s: s[0, 0, 0]),
        ("on meta", lambda s: s.to("meta")),
    ):
        bad(
            op,
            "mismatch" if nm != "on meta" else "meta",
            f"segment_starts {nm}",
            lambda fn=fn: with_starts(fn),
            "segment_starts",
        )
    bad(op, "mismatch", "segment_starts segment of 300 > 256", _long_segment, "segment_starts")
    for b in (2, 8, 5):
        bad(op, "bits", f"bits {b}", lambda b=b: dgq_dec(good(), bits=b), "bits", "codes")
    for g in (16, 0, 300):
        bad(op, "group_size", f"group_size {g}", lambda g=g: dgq_dec(good(), G=g), "group_size", "scale")
    for d in (32, 0, 72):
        bad(op, "mismatch", f"head_dim {d}", lambda d=d: dgq_dec(good(), D=d), "head_dim", "codes")
    bad(
        op,
        "mismatch",
        "nq parts + made-up starts",
        lambda: ops.dgq_decompress(
            *nq_parts(shape=(2, 3, 80, 64), G=32), torch.zeros(2, 3, 3, dtype=torch.int32), 4, 32, 64
        ),
        "segment_starts",  # made up: it is at fault, not the buffers nq_compress made
    )
    bad(
        op,
        "mismatch",
        "outlier_idx beyond segment",
        lambda: dgq_dec(replace(good(), 3, good()[3].fill_(250))),
        "outlier_idx",
    )
    bad(op, "grad", "scale requires grad", lambda: dgq_dec(replace(good(), 1, grad_leaf(good()[1]))), "scale")
    nonfinite(op, "NaN scale", lambda: dgq_dec(replace(good(), 1, poke(good()[1], NAN))), "scale")
    bad(op, "dtype", "out_dtype int8", lambda: dgq_dec(good(), out=torch.int8), "out_dtype")
    valid(op, "non-contiguous parts", lambda: _dgq_views())


def _long_segment():
    """A segment of 300 tokens: more than the 256 a segment may hold (outlier_idx is one byte)."""
    p = dgq_parts(shape=(1, 1, 300, 64), G=128)
    p[5] = p[5].clone()
    p[5][..., 1:] = 300
    return dgq_dec(p, G=128)


def _dgq_views():
    x = rnd(3, 2, 80, 64)
    parts = ops.dgq_compress(x, 4, 32, 16, None, 1)
    views = [p.transpose(0, 1).contiguous().transpose(0, 1) for p in parts]
    return (
        0.0 if torch.equal(ops.dgq_decompress(*views, 4, 32, 64), ops.dgq_decompress(*parts, 4, 32, 64)) else INF
    ), 0.0


def hadamard_cases():
    op = "hadamard_rotate"
    s64 = lambda: nexuskv.rotation_signs(64, 0)  # noqa: E731
    x = lambda **kw: rnd(3, 5, 64, **kw)  # noqa: E731
    for dt in BAD_DTYPES[:5]:
        bad(op, "dtype", f"x {dt}", lambda dt=dt: ops.hadamard_rotate(x().to(dt), s64()), "x")
    for dt in (torch.int32, torch.bool, torch.int8):
        bad(op, "signs", f"signs {dt}", lambda dt=dt: ops.hadamard_rotate(x(), s64().to(dt)), "signs")
    for nm, s in (
        ("length 32", lambda: s64()[:32]),
        ("length 65", lambda: torch.ones(65)),
        ("2-D", lambda: s64()[None]),
        ("0-D", lambda: torch.tensor(1.0)),
        ("on meta", lambda: s64().to("meta")),
    ):
        bad(
            op,
            "signs" if nm != "on meta" else "meta",
            f"signs {nm}",
            lambda s=s: ops.hadamard_rotate(x(), s()),
            "signs",
        )
    for nm, s in (
        ("zeros", lambda: torch.zeros(64)),
        ("0.5", lambda: torch.full((64,), 0.5)),
        ("NaN", lambda: poke(s64(), NAN)),
        ("2", lambda: poke(s64(), 2.0)),
    ):
        bad(op, "signs", f"signs value {nm}", lambda s=s: ops.hadamard_rotate(x(), s()), "signs")
    for n in (48, 3, 96):
        bad(
            op,
            "shape",
            f"n {n} not a power of two",
            lambda n=n: ops.hadamard_rotate(rnd(2, n), torch.ones(n)),
            "x",  # its last dimension n
            "n",
        )
    for shape in ((), (0, 64), (2, 0)):
        bad(
            op,
            "shape",
            f"x shape {shape}",
            lambda sh=shape: ops.hadamard_rotate(torch.zeros(sh), s64()),
            "x",
        )
    bad(op, "meta", "x on meta, signs cpu", lambda: ops.hadamard_rotate(x().to("meta"), s64()), "x", "signs")
    bad(
        op,
        "meta",
        "all meta, signs wrong length",
        lambda: ops.hadamard_rotate(x().to("meta"), torch.ones(32, device="meta")),
        "signs",
    )
    bad(op, "grad", "x requires grad", lambda: ops.hadamard_rotate(grad_leaf(x()), s64()), "x")
    bad(op, "grad", "signs requires grad", lambda: ops.hadamard_rotate(x(), grad_leaf(s64())), "signs")
    bad(op, "args", "inverse=1", lambda: ops.hadamard_rotate(x(), s64(), 1), "inverse")
    bad(
        op,
        "layout",
        "stride-0 signs of length 1 expanded to 64 but 0.5",
        lambda: ops.hadamard_rotate(x(), torch.tensor([0.5]).expand(64)),
        "signs",
    )

    def check(xx, signs, inverse=False):
        y = ops.hadamard_rotate(xx, signs, inverse)
        R = rotation_f64(signs)
        want = xx.to(F64) @ (R if inverse else R.T)
        eps = 2.0**-24 if xx.dtype == F32 else torch.finfo(xx.dtype).eps / 2
        # fp32 butterflies: log2(n) roundings of the row norm; the output rounded to x's dtype.
        n = xx.shape[-1]
        tol = (math.log2(n) + 1) * 2.0**-24 * xx.to(F64).norm(dim=-1, keepdim=True) + eps * want.abs()
        if y.shape != xx.shape or y.dtype != xx.dtype:
            return INF, 0.0
        return float(((y.to(F64) - want).abs() - tol).max().clamp_min(0)), 0.0

    for n in (1, 2, 16, 64, 128, 256):
        for dt in (F32, F16, BF16):
            valid(op, f"n {n} {dt}", lambda n=n, dt=dt: check(rnd(3, n, dtype=dt), nexuskv.rotation_signs(n, n)))
    valid(op, "inverse", lambda: check(rnd(4, 64), s64(), True))
    valid(op, "transposed view", lambda: check(rnd(64, 6).t(), s64()))
    valid(op, "stride-0 x", lambda: check(rnd(1, 64).expand(5, 64), s64()))
    valid(op, "non-contiguous signs", lambda: check(rnd(3, 64), nexuskv.rotation_signs(128, 1)[::2]))
    # finite exact results near FLT_MAX: a one-hot row, and rows of norm 2.4e38
    valid(op, "near FLT_MAX (one-hot)", lambda: check(torch.eye(64)[:3] * 3e38, s64()))
    valid(op, "near FLT_MAX (norm 2.4e38)", lambda: check(rnd(3, 64).sign() * 3e37, s64()))
    valid(op, "5-D x", lambda: check(rnd(2, 1, 2, 3, 32), nexuskv.rotation_signs(32, 2)))


def attention_cases():
    op = "dgq_fused_attention"
    A = Att
    q = lambda *shape, **kw: rnd(*shape, **kw)  # noqa: E731
    for dt in (F64, torch.int32, torch.bool, torch.uint8):
        bad(op, "dtype", f"q {dt}", lambda dt=dt: A().call(q=q(2, 4, 1, 64).to(dt)), "q")
    bad(op, "shape", "q 3-D", lambda: A().call(q=q(2, 4, 64)), "q")
    bad(op, "shape", "q 5-D", lambda: A().call(q=q(2, 4, 1, 1, 64)), "q")
    bad(op, "shape", "q 0-D", lambda: A().call(q=torch.tensor(1.0)), "q")
    bad(op, "shape", "q_len 0", lambda: A().call(q=q(2, 4, 0, 64)), "q")
    bad(op, "shape", "q head_dim 32 vs cache 64", lambda: A().call(q=q(2, 4, 1, 32)), "q", "k_cache")
    bad(op, "shape", "head_dim 72 (not a multiple of 16)", lambda: A(D=72, kG=8, vG=8).call(), "q", "k_cache")
    bad(
        op,
        "shape",
        "head_dim 512 (too large)",
        lambda: A(D=512, B=1, Hkv=1, Hq=1, T=16, comp_lens=(16,), tail=0).call(),
        "q",
        "k_cache",
    )
    bad(op, "shape", "q batch 3 vs cache 2", lambda: A().call(q=q(3, 4, 1, 64)), "q", "k_cache")
    bad(op, "gqa", "q_heads 3 kv_heads 2", lambda: A().call(q=q(2, 3, 1, 64)), "q", "q_heads")
    bad(op, "gqa", "q_heads 1 kv_heads 2", lambda: A().call(q=q(2, 1, 1, 64)), "q", "q_heads")
    bad(
        op,
        "gqa",
        "v_cache 1 head, k_cache 2",
        lambda: A().call(v_cache=A(Hkv=1, Hq=4).args["v_cache"]),
        "v_cache",
    )
    bad(
        op,
        "gqa",
        "k_tail 1 head, cache 2",
        lambda: A().call(k_tail=rnd(2, 1, 8, 64), v_tail=rnd(2, 1, 8, 64)),
        "k_tail",
        "v_tail",
    )
    bad(
        op,
        "gqa",
        "meta q_heads 3",
        lambda: A().call(q=torch.empty(2, 3, 1, 64, device="meta"), **_meta_args(A())),
        "q",
        "q_heads",
    )
    for nm, lens in (
        ("> capacity", [65, 40]),
        ("negative", [-1, 40]),
        ("2**40", [2**40, 1]),
        ("float", torch.tensor([64.0, 40.0])),
        ("int16", torch.tensor([64, 40], dtype=torch.int16)),
        ("bool", torch.tensor([True, False])),
        ("shape [3]", [64, 40, 1]),
        ("shape [2,1]", [[64], [40]]),
        ("0-D", torch.tensor(64)),
        ("on meta", torch.tensor([64, 40], device="meta")),
        ("int32 > capacity", torch.tensor([64, 99], dtype=torch.int32)),
    ):
        t = lens if isinstance(lens, torch.Tensor) else torch.tensor(lens)
        bad(
            op,
            "lengths" if nm != "on meta" else "meta",
            f"compressed_lens {nm}",
            lambda t=t: A().call(compressed_lens=t),
            "compressed_lens",
        )
    for nm, lens in (
        ("> tail capacity", [9, 3]),
        ("negative", [8, -2]),
        ("float", torch.tensor([8.0, 3.0])),
        ("shape [1]", [8]),
        ("2**33", [2**33, 0]),
    ):
        t = lens if isinstance(lens, torch.Tensor) else torch.tensor(lens)
        bad(op, "lengths", f"tail_lens {nm}", lambda t=t: A().call(tail_lens=t), "tail_lens")
    for nm, lens in (("> sink capacity", [5, 4]), ("negative", [-1, 4]), ("shape [3]", [4, 4, 4])):
        bad(
            op,
            "lengths",
            f"sink_lens {nm}",
            lambda lens=lens: A(sinks=4).call(sink_lens=torch.tensor(lens)),
            "sink_lens",
        )
    bad(
        op,
        "lengths",
        "q_len > a sequence's length",
        lambda: A(Lq=12, comp_lens=(0, 2), tail_lens=(3, 0)).call(),
        "q",
        "q_len",
    )
    bad(
        op,
        "lengths",
        "total length beyond int32",
        lambda: A().call(tail_lens=torch.tensor([8, 3]), compressed_lens=torch.tensor([2**31, 0])),
        "compressed_lens",
    )
    # tails and sinks
    bad(op, "tail", "k_tail without v_tail", lambda: A().call(v_tail=None), "k_tail", "v_tail")
    bad(op, "tail", "tail_lens without tail", lambda: A(tail=0).call(tail_lens=torch.tensor([1, 1])), "tail_lens")
    bad(op, "tail", "k_tail/v_tail token counts differ", lambda: A().call(v_tail=rnd(2, 2, 7, 64)), "k_tail", "v_tail")
    bad(op, "tail", "k_tail head_dim 32", lambda: A().call(k_tail=rnd(2, 2, 8, 32)), "k_tail")
    bad(op, "tail", "k_tail int32", lambda: A().call(k_tail=torch.zeros(2, 2, 8, 64, dtype=torch.int32)), "k_tail")
    bad(op, "tail", "k_tail 3-D", lambda: A().call(k_tail=rnd(2, 8, 64)), "k_tail")
    bad(op, "tail", "k_tail batch 1", lambda: A().call(k_tail=rnd(1, 2, 8, 64), v_tail=rnd(1, 2, 8, 64)), "k_tail")
    bad(op, "tail", "k_sink without v_sink", lambda: A(sinks=4).call(v_sink=None), "k_sink", "v_sink")
    bad(op, "tail", "sink_lens without sinks", lambda: A().call(sink_lens=torch.tensor([1, 1])), "sink_lens")
    bad(
        op,
        "tail",
        "v_sink float64",
        lambda: A(sinks=4).call(v_sink=rnd(2, 2, 4, 64, dtype=F64)),
        "v_sink",
        "k_sink",
    )
    bad(op, "meta", "k_tail on meta", lambda: A().call(k_tail=torch.empty(2, 2, 8, 64, device="meta")), "k_tail")
    bad(op, "meta", "tail_lens on meta", lambda: A().call(tail_lens=torch.tensor([8, 3], device="meta")), "tail_lens")
    bad(op, "meta", "q on meta, cache cpu", lambda: A().call(q=torch.empty(2, 4, 1, 64, device="meta")), "q")
    for i in range(5):
        bad(
            op,
            "meta",
            f"v_cache[{i}] on meta",
            lambda i=i: A().call(v_cache=replace(A().args["v_cache"], i, A().args["v_cache"][i].to("meta"))),
            "v_cache",
        )
    # signs
    bad(op, "signs", "rotation_signs length 32", lambda: A().call(rotation_signs=torch.ones(32)), "rotation_signs")
    bad(
        op,
        "signs",
        "rotation_signs int32",
        lambda: A().call(rotation_signs=torch.ones(64, dtype=torch.int32)),
        "rotation_signs",
    )
    bad(op, "signs", "rotation_signs 2-D", lambda: A().call(rotation_signs=torch.ones(1, 64)), "rotation_signs")
    bad(
        op,
        "signs",
        "rotation_signs value 0.5",
        lambda: A(rotate=True).call(rotation_signs=torch.full((64,), 0.5)),
        "rotation_signs",
    )
    bad(op, "signs", "rotation_signs zeros", lambda: A().call(rotation_signs=torch.zeros(64)), "rotation_signs")
    bad(
        op,
        "signs",
        "rotation_signs head_dim 48",
        lambda: A(D=48, kG=16, vG=16).call(rotation_signs=torch.ones(48)),
        "rotation_signs",
        "q",
    )
    bad(
        op,
        "meta",
        "rotation_signs on meta",
        lambda: A().call(rotation_signs=torch.ones(64, device="meta")),
        "rotation_signs",
    )
    # the compressed buffers and their formats
    bad(op, "mismatch", "k_format length 2", lambda: A().call(k_format=[4, 32]), "k_format")
    bad(op, "mismatch", "v_format length 4", lambda: A().call(v_format=[4, 32, -1, 0]), "v_format")
    bad(op, "bits", "k_format bits 5", lambda: A().call(k_format=[5, 32, -2]), "k_format", "k_cache")
    bad(op, "bits", "k_format bits 2 (row bytes differ)", lambda: A().call(k_format=[2, 32, -2]), "k_format", "k_cache")
    bad(op, "bits", "v_format bits 2**32+4", lambda: A().raw(v_format=[2**32 + 4, 32, -1]), "v_format", "v_cache")
    bad(op, "group_size", "k_format group 16", lambda: A().call(k_format=[4, 16, -2]), "k_format", "k_cache")
    bad(op, "group_size", "v_format group 0", lambda: A().call(v_format=[4, 0, -1]), "v_format", "v_cache")
    bad(op, "group_size", "v_format group 300", lambda: A().call(v_format=[4, 300, -1]), "v_format", "v_cache")
    bad(op, "args", "k_format axis 0", lambda: A().call(k_format=[4, 32, 0]), "k_format", "k_cache")
    bad(
        op,
        "mismatch",
        "k axis -1 given for axis -2 buffers",
        lambda: A().call(k_format=[4, 32, -1]),
        "k_format",
        "k_cache",
    )
    bad(op, "mismatch", "k_cache 4 tensors", lambda: A().call(k_cache=A().args["k_cache"][:4]), "k_cache")
    bad(op, "mismatch", "k_cache 7 tensors", lambda: A().call(k_cache=A().args["k_cache"] * 2), "k_cache")
    bad(
        op,
        "mismatch",
        "DGQ keys with axis -1",
        lambda: A(dgq=True).call(k_format=[4, 32, -1]),
        "k_format",
        "k_cache",
    )
    bad(
        op,
        "mismatch",
        "v_cache 6 tensors (DGQ values, axis -1)",
        lambda: A().call(v_cache=A(dgq=True).args["k_cache"]),
        "v_cache",
    )
    bad(
        op,
        "mismatch",
        "corrupt k outlier_idx",
        lambda: A().call(k_cache=replace(A().args["k_cache"], 3, A().args["k_cache"][3].clone().fill_(99))),
        "k_cache",
    )
    bad(
        op,
        "mismatch",
        "corrupt DGQ segment_starts",
        lambda: A(dgq=True).call(
            k_cache=replace(A(dgq=True).args["k_cache"], 5, A(dgq=True).args["k_cache"][5].flip(-1).contiguous())
        ),
        "k_cache",
    )
    bad(
        op,
        "dtype",
        "k codes int8",
        lambda: A().call(k_cache=replace(A().args["k_cache"], 0, A().args["k_cache"][0].to(torch.int8))),
        "k_cache",
    )
    bad(
        op,
        "dtype",
        "v scale float64",
        lambda: A().call(v_cache=replace(A().args["v_cache"], 1, A().args["v_cache"][1].double())),
        "v_cache",
    )
    bad(
        op,
        "mismatch",
        "k codes batch 3",
        lambda: A().call(k_cache=A(B=3, comp_lens=(1, 1, 1)).args["k_cache"]),
        "k_cache",
    )
    nonfinite(
        op,
        "NaN k scale",
        lambda: A().call(k_cache=replace(A().args["k_cache"], 1, A().args["k_cache"][1].clone().fill_(NAN))),
        "k_cache",
    )
    # scalars
    for nm, kw, hint in (
        ("scale NaN", dict(scale=NAN), "scale"),
        ("scale Inf", dict(scale=INF), "scale"),
        ("scale 1e39", dict(scale=1e39), "scale"),
        ("softcap 0", dict(softcap=0.0), "softcap"),
        ("softcap -1", dict(softcap=-1.0), "softcap"),
        ("softcap NaN", dict(softcap=NAN), "softcap"),
        ("softcap Inf", dict(softcap=INF), "softcap"),
        ("window 0", dict(window=0), "window"),
        ("window -5", dict(window=-5), "window"),
        ("scale True", dict(scale=True), "scale"),
        ("window True", dict(window=True), "window"),
    ):
        bad(op, "args", nm, lambda kw=kw: A().call(**kw), hint)
    bad(op, "args", "k_format holds a bool", lambda: A().call(k_format=[4, True, -2]), "k_format")
    bad(op, "grad", "q requires grad", lambda: A().call(q=grad_leaf(rnd(2, 4, 1, 64))), "q")
    bad(op, "grad", "k_tail requires grad", lambda: A().call(k_tail=grad_leaf(A().args["k_tail"])), "k_tail")
    bad(
        op,
        "grad",
        "k_cache outlier_val requires grad",
        lambda: A().call(k_cache=replace(A().args["k_cache"], 4, grad_leaf(A().args["k_cache"][4]))),
        "k_cache",
    )
    bad(
        op,
        "layout",
        "stride-0 compressed_lens of 3 expanded",
        lambda: A().call(compressed_lens=torch.tensor([64]).expand(3)),
        "compressed_lens",
    )
    bad(
        op,
        "layout",
        "q transposed to [B, Hq, D, Lq] shape",
        lambda: A(Lq=64).call(q=rnd(2, 4, 64, 64)[..., :48].transpose(-1, -2)),
        "q",
        "q_len",
    )

    # valid
    combos = [
        dict(),
        dict(Lq=4),
        dict(Lq=8, tail=8, tail_lens=(8, 8)),
        dict(Hq=2),
        dict(Hq=8),
        dict(Hkv=1, Hq=4),
        dict(dtype=F16),
        dict(dtype=BF16),
        dict(dtype=F16, q_dtype=F16, Lq=3),
        dict(dgq=True),
        dict(dgq=True, kk=0),
        dict(rotate=True),
        dict(rotate=True, dgq=True),
        dict(sinks=4),
        dict(sinks=4, sink_lens=[4, 1]),
        dict(window=20),
        dict(window=1),
        dict(softcap=5.0),
        dict(tail=0),
        dict(comp_lens=(0, 40)),
        dict(comp_lens=(0, 0), tail_lens=(0, 0)),
        dict(comp_lens=(0, 0), tail_lens=(8, 0)),
        dict(comp_lens=(33, 1)),
        dict(kb=2, vb=2),
        dict(kb=8, vb=3),
        dict(kb=3, vb=8),
        dict(kaxis=-1, vaxis=-2),
        dict(kaxis=-1, vaxis=-1),
        dict(kaxis=-2, vaxis=-2),
        # key outliers + value float-tile path (issue 8 item 1); partial group with fewer tokens than outliers
        dict(T=128, kG=64, kk=2, vaxis=-2, vG=64, vk=0, comp_lens=(128, 100), tail=0),
        dict(T=128, kG=64, kk=2, vG=24, comp_lens=(128, 128), tail=0),
        dict(T=66, kG=64, kk=3, comp_lens=(66, 65), tail=0),
        dict(B=2, D=16, T=9, kG=8, kk=2, vG=16, comp_lens=(0, 9), tail=0),
        dict(D=128, kG=64, vG=64),
        dict(D=16, kG=16, vG=16),
        dict(D=256, B=1, Hkv=1, Hq=2, comp_lens=(64,)),
        dict(D=48, kG=16, vG=16),
        dict(B=1, comp_lens=(64,)),
        dict(B=3, comp_lens=(64, 0, 17), tail_lens=(0, 5, 8)),
        # q_len > cached: the rows before the first cached position see nothing
        dict(Lq=12, comp_lens=(0, 40), tail_lens=(0, 0)),
        dict(Lq=5, B=3, comp_lens=(0, 0, 64), tail_lens=(0, 0, 8)),
        dict(Lq=4, window=3, softcap=2.0, sinks=2),
        dict(kG=1, vG=1, kk=0, vk=0, T=16, comp_lens=(16, 5)),
        dict(kG=256, T=300, comp_lens=(300, 257), vG=256),
    ]
    for i, c in enumerate(combos):
        valid(
            op,
            "valid " + (",".join(f"{k}={v}" for k, v in c.items()) or "default"),
            lambda c=c, i=i: Att(seed=i, **c).check(),
        )
    # An empty q is a documented clear error (also for an empty batch).
    bad(op, "shape", "B=0 (empty batch)", lambda: _empty_batch_attention(), "q")
    valid(op, "non-contiguous q", lambda: _noncontig_q())
    valid(op, "stride-0 q (one query broadcast over heads)", lambda: _stride0_q())
    valid(
        op,
        "int32 lengths",
        lambda: Att().check(
            compressed_lens=torch.tensor([64, 40], dtype=torch.int32), tail_lens=torch.tensor([8, 3], dtype=torch.int32)
        ),
    )
    valid(
        op,
        "fp16 tail with fp32 q and cache",
        lambda: Att().check(k_tail=rnd(2, 2, 8, 64, dtype=F16), v_tail=rnd(2, 2, 8, 64, dtype=F16)),
    )
    valid(op, "scale 0.01", lambda: Att().check(scale=0.01))
    valid(op, "tail without tail_lens (all valid)", lambda: _tail_all_valid())
    valid(
        op,
        "all-meta gives a meta output",
        lambda: (
            0.0
            if A().call(**_meta_args(A()), q=torch.empty(2, 4, 1, 64, device="meta")).device.type == "meta"
            else INF,
            0.0,
        ),
    )
    valid(op, "no_grad with requires_grad q", lambda: _no_grad(lambda: Att().check(q=grad_leaf(rnd(2, 4, 1, 64)))))


def _meta_args(a: Att):
    m = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    return {
        k: ([m(t) for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor) else m(v))
        for k, v in a.args.items()
        if k != "q"
    }


def _tail_all_valid():
    a = Att()
    out = a.call(tail_lens=None)  # every tail token valid: the reference with tail_lens [8, 8]
    a.args["tail_lens"] = torch.tensor([8, 8])
    return rel_err(out, a.reference()), attention_tol(F32)


def _empty_batch_attention():
    a = Att()
    empty = lambda t: t[:0] if isinstance(t, torch.Tensor) else t  # noqa: E731
    a.args = {
        k: (
            [empty(t) for t in v]
            if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
            else empty(v)
            if k != "rotation_signs"
            else v
        )
        for k, v in a.args.items()
    }
    return a.call()


def _noncontig_q():
    a = Att(Lq=3)
    return a.check(q=rnd(2, 3, 4, 64).transpose(1, 2))


def _stride0_q():
    a = Att()
    return a.check(q=rnd(2, 1, 1, 64).expand(2, 4, 1, 64))


# ---- the cache ---------------------------------------------------------------------------------

CACHE_DEFAULTS = dict(
    key_bits=4,
    key_group_size=16,
    key_axis=-2,
    key_outliers=0,
    key_dynamic=False,
    value_bits=4,
    value_group_size=16,
    value_axis=-1,
    value_outliers=0,
    residual=16,
    rotate=False,
    seed=0,
    sinks=0,
    external_chunk=0,
    meta_dtype=None,
    window=None,
)
CACHE_FIELDS = list(CACHE_DEFAULTS)


def mk(**kw):
    return nkcache.make_cache(**{**CACHE_DEFAULTS, **kw})


def kv(B=2, H=2, n=40, D=64, dtype=F32, seed=0):
    return rnd(B, H, n, D, dtype=dtype, seed=seed), rnd(B, H, n, D, dtype=dtype, seed=seed + 100)


def filled(n=40, **kw):
    c = mk(**kw)
    c.append(*kv(n=n), None)
    return c


def snapshot(c):
    return (c.lengths().tolist(), c.compressed_lengths().tolist(), c.evicted_lengths().tolist(), c.nbytes())


def kept(c, fn):
    """Runs fn(c), which must raise; if the cache changed, raises LostData instead."""
    before = snapshot(c)
    dense_before = c.dense(None) if before[0] and not c.is_external() else None
    try:
        fn(c)
    except Exception:
        after = snapshot(c)
        same = after == before and (
            dense_before is None or all(torch.equal(a, b) for a, b in zip(dense_before, c.dense(None)))
        )
        if not same:
            raise LostData(f"the call raised but the cache changed: {before} -> {after}")
        raise


def cache_cases():
    op = "KVCache()"
    for field, values in (
        ("key_bits", (0, 1, 5, 9, -1, 2**32 + 4)),
        ("value_bits", (0, 7, 2**63 - 1)),
        ("key_group_size", (0, -1, 257, 2**40)),
        ("value_group_size", (0, 300, -(2**63))),
        ("key_axis", (0, 1, -3)),
        ("value_axis", (2, -4)),
        ("key_outliers", (-1, 16, 2**40)),
        ("value_outliers", (16, -5)),
        ("residual", (-1, 2**63 - 1, 2**40)),
        ("sinks", (-1, 2**40)),
        ("window", (0, -1, 2**40)),
        ("external_chunk", (-1, 2**40)),
    ):
        cat = (
            "bits"
            if "bits" in field
            else "group_size"
            if "group" in field
            else "outliers"
            if "outliers" in field
            else "args"
        )
        for v in values:
            bad(op, cat, f"{field}={v}", lambda f=field, v=v: mk(**{f: v}).append(*kv(), None), field)
            raw_fields = ("key_bits", "key_group_size", "residual", "value_group_size")
            if field in raw_fields and v in (2**32 + 4, 0, 2**40):
                # the TorchBind constructor without make_cache's Python checks
                bad(
                    op,
                    cat,
                    f"raw {field}={v}",
                    lambda f=field, v=v: nkcache.KVCache(*[{**CACHE_DEFAULTS, f: v}[n] for n in CACHE_FIELDS]).append(
                        *kv(), None
                    ),
                    field,
                )
    bad(
        op,
        "group_size",
        "value_group_size 0 with axis -2",
        lambda: mk(value_group_size=0, value_axis=-2),
        "value_group_size",
    )
    bad(op, "dtype", "meta_dtype int32", lambda: mk(meta_dtype=torch.int32), "meta_dtype")
    bad(op, "dtype", "meta_dtype float64", lambda: mk(meta_dtype=F64), "meta_dtype")
    bad(op, "dtype", "meta_dtype 'half' (str)", lambda: mk(meta_dtype="half"), "meta_dtype")
    bad(op, "args", "key_dynamic=1", lambda: mk(key_dynamic=1), "key_dynamic")
    bad(op, "args", "rotate='yes'", lambda: mk(rotate="yes"), "rotate")
    bad(op, "args", "residual 1.5", lambda: mk(residual=1.5), "residual")
    bad(op, "args", "residual 2**64", lambda: mk(residual=2**64), "residual")
    bad(op, "args", "DGQ keys with axis -1", lambda: mk(key_dynamic=True, key_axis=-1), "key_dynamic", "key_axis")
    bad(
        op,
        "args",
        "DGQ keys G=200 (max_len > 256)",
        lambda: mk(key_dynamic=True, key_group_size=200),
        "key_dynamic",
        "key_group_size",
    )
    bad(op, "args", "window with sinks", lambda: mk(window=16, sinks=2), "window", "sinks")
    bad(op, "args", "external with rotate", lambda: mk(external_chunk=16, rotate=True), "external_chunk", "rotate")

    op = "KVCache.append"
    for dt in (F64, torch.int32, torch.bool, torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.int8):
        bad(op, "dtype", f"k/v {dt}", lambda dt=dt: mk().append(*(t.to(dt) for t in kv()), None), "k", "v")
    bad(op, "dtype", "k fp32, v fp16", lambda: mk().append(kv()[0], kv()[1].half(), None), "k", "v")
    for nm, shape in (("3-D", (2, 40, 64)), ("5-D", (2, 2, 1, 40, 64)), ("0-D", ()), ("head_dim 0", (2, 2, 40, 0))):
        bad(op, "shape", f"k/v {nm}", lambda s=shape: mk().append(torch.zeros(s), torch.zeros(s), None), "k", "v")
    bad(op, "shape", "k/v shapes differ", lambda: mk().append(rnd(2, 2, 40, 64), rnd(2, 2, 41, 64), None), "k", "v")
    bad(op, "shape", "rotate with head_dim 48", lambda: mk(rotate=True).append(*kv(D=48), None), "rotate", "k")
    for nm, second in (
        ("batch 3", dict(B=3)),
        ("heads 1", dict(H=1)),
        ("head_dim 32", dict(D=32)),
        ("dtype fp16", dict(dtype=F16)),
    ):
        bad(
            op,
            "mismatch",
            f"second append {nm}",
            lambda s=second: kept(filled(), lambda c: c.append(*kv(**{"n": 5, **s}), None)),
            "k",
            "v",
        )
    for nm, v in (("NaN", NAN), ("Inf", INF), ("-Inf", -INF)):
        bad(
            op,
            "values",
            f"k holds {nm}",
            lambda v=v: kept(filled(), lambda c: c.append(poke(kv(n=30)[0], v), kv(n=30)[1], None)),
            "k",
        )
        bad(
            op,
            "values",
            f"v of sequence 1 holds {nm} (atomic)",
            lambda v=v: kept(
                filled(), lambda c: c.append(kv(n=30)[0], poke(kv(n=30)[1], v, kv(n=30)[1].numel() - 5), None)
            ),
            "v",
        )
        bad(
            op,
            "values",
            f"external: k holds {nm}",
            lambda v=v: kept(filled(external_chunk=16), lambda c: c.append(poke(kv(n=30)[0], v), kv(n=30)[1], None)),
            "k",
        )
    bad(
        op,
        "values",
        "fp32 1e6 into float16 meta",
        lambda: kept(filled(meta_dtype=F16), lambda c: c.append(poke(kv(n=30)[0], 1e6), kv(n=30)[1], None)),
        "k",
        "meta_dtype",
    )
    bad(
        op,
        "values",
        "fp32 range beyond FLT_MAX",
        lambda: kept(filled(), lambda c: c.append(poke(poke(kv(n=30)[0], 3e38, 0), -3e38, 64), kv(n=30)[1], None)),
        "k",
    )
    bad(
        op,
        "layout",
        "stride-0 NaN k",
        lambda: mk().append(torch.tensor(NAN).expand(2, 2, 40, 64), kv()[1], None),
        "k",
    )
    bad(
        op,
        "layout",
        "transposed v with Inf",
        lambda: mk().append(kv()[0], poke(rnd(2, 2, 64, 40), INF, 7).transpose(-1, -2), None),
        "v",
    )
    for nm, mask in (
        ("int", torch.ones(2, 40, dtype=torch.int64)),
        ("float", torch.ones(2, 40)),
        ("shape [2]", torch.ones(2, dtype=torch.bool)),
        ("shape [2, 41]", torch.ones(2, 41, dtype=torch.bool)),
        ("shape [3, 40]", torch.ones(3, 40, dtype=torch.bool)),
        ("on meta", torch.ones(2, 40, dtype=torch.bool, device="meta")),
    ):
        bad(
            op,
            "mismatch" if nm != "on meta" else "meta",
            f"valid mask {nm}",
            lambda m=mask: kept(filled(), lambda c: c.append(*kv(), m)),
            "valid",
        )
    bad(op, "meta", "k/v on meta", lambda: mk().append(*(t.to("meta") for t in kv()), None), "k", "v")
    bad(op, "meta", "k on meta, v cpu", lambda: mk().append(kv()[0].to("meta"), kv()[1], None), "k")
    bad(
        op,
        "meta",
        "meta after a cpu append",
        lambda: kept(filled(), lambda c: c.append(*(t.to("meta") for t in kv(n=4)), None)),
        "k",
        "v",
    )
    bad(op, "grad", "k requires grad", lambda: mk().append(grad_leaf(kv()[0]), kv()[1], None), "k")
    bad(
        op,
        "grad",
        "v requires grad after an append",
        lambda: kept(filled(), lambda c: c.append(kv(n=3)[0], grad_leaf(kv(n=3)[1]), None)),
        "v",
    )
    bad(op, "args", "k is None", lambda: mk().append(None, kv()[1], None), "k")

    # An empty batch cannot fix the cache's shape: a clear error at the first append (a
    # B=0 append to a started cache would not match its batch either).
    bad(op, "shape", "first append with an empty batch", lambda: _cache_empty_batch(), "k", "v")

    op = "KVCache.attend"
    for nm, qq in (
        ("float64", rnd(2, 4, 1, 64, dtype=F64)),
        ("int32", torch.zeros(2, 4, 1, 64, dtype=torch.int32)),
        ("3-D", rnd(2, 4, 64)),
        ("5-D", rnd(2, 4, 1, 1, 64)),
        ("batch 3", rnd(3, 4, 1, 64)),
        ("head_dim 32", rnd(2, 4, 1, 32)),
        ("q_len 0", rnd(2, 4, 0, 64)),
        ("on meta", torch.empty(2, 4, 1, 64, device="meta")),
    ):
        cat = {"float64": "dtype", "int32": "dtype", "on meta": "meta"}.get(nm, "shape")
        bad(op, cat, f"q {nm}", lambda qq=qq: filled().attend(qq, None, None), "q")
    bad(
        op,
        "gqa",
        "q_heads 3 on 2 kv heads",
        lambda: filled().attend(rnd(2, 3, 1, 64), None, None),
        "q",
        "q_heads",
    )
    bad(
        op,
        "gqa",
        "q_heads 1 on 2 kv heads",
        lambda: filled().attend(rnd(2, 1, 1, 64), None, None),
        "q",
        "q_heads",
    )
    bad(op, "grad", "q requires grad", lambda: filled().attend(grad_leaf(rnd(2, 4, 1, 64)), None, None), "q")
    for nm, sc, cap in (
        ("scale NaN", NAN, None),
        ("scale Inf", INF, None),
        ("softcap 0", None, 0.0),
        ("softcap -3", None, -3.0),
    ):
        bad(op, "args", nm, lambda sc=sc, cap=cap: filled().attend(rnd(2, 4, 1, 64), sc, cap), nm.split()[0])
    bad(
        op,
        "shape",
        "q_len beyond the cached positions",
        lambda: filled(n=5).attend(rnd(2, 4, 6, 64), None, None),
        "q",
        "q_len",
    )

    op = "KVCache.reorder"
    for nm, idx, cat in (
        ("float", torch.tensor([1.0, 0.0]), "dtype"),
        ("bool", torch.tensor([True, False]), "dtype"),
        ("complex", torch.tensor([1 + 0j, 0j]), "dtype"),
        ("2-D", torch.tensor([[1, 0]]), "shape"),
        ("length 3", torch.tensor([1, 0, 1]), "shape"),
        ("0-D", torch.tensor(1), "shape"),
        ("index 2", torch.tensor([2, 0]), "args"),
        ("index -3", torch.tensor([-3, 0]), "args"),
        ("index 2**40", torch.tensor([2**40, 0]), "args"),
        ("on meta", torch.tensor([1, 0], device="meta"), "meta"),
    ):
        bad(op, cat, f"beam_idx {nm}", lambda idx=idx: kept(filled(), lambda c: c.reorder(idx)), "beam_idx")
    bad(op, "args", "beam_idx a list", lambda: kept(filled(), lambda c: c.reorder([1, 0])), "beam_idx")

    op = "KVCache.crop"
    bad(op, "args", "crop(-1)", lambda: kept(filled(), lambda c: c.crop(-1)), "length")
    bad(op, "args", "crop(-2**63)", lambda: kept(filled(), lambda c: c.crop(-(2**63))), "length")
    bad(op, "args", "crop(1.5)", lambda: kept(filled(), lambda c: c.crop(1.5)), "length")
    bad(op, "args", "crop into evicted positions", lambda: kept(_windowed(), lambda c: c.crop(3)), "length")

    op = "KVCache.dense"
    bad(op, "dtype", "dense(int32)", lambda: filled().dense(torch.int32), "dtype")
    bad(op, "dtype", "dense(bool)", lambda: filled().dense(torch.bool), "dtype")
    bad(op, "dtype", "dense_with(int8) (external)", lambda: _dense_with(torch.int8), "dtype")
    bad(op, "dtype", "dense_with integer parts", lambda: _dense_with(None, torch.int32), "k_compressed", "v_compressed")
    bad(op, "shape", "dense_with one part short", lambda: _dense_with(None, F32, -1), "k_compressed", "v_compressed")
    bad(
        op,
        "shape",
        "dense_with one part per sequence missing",
        lambda: _dense_with(None, F32, 0, 1),
        "k_compressed",
    )
    bad(
        op,
        "meta",
        "dense_with parts on meta",
        lambda: _dense_with(None, F32, 0, 0, "meta"),
        "k_compressed",
        "v_compressed",
    )
    nonfinite(
        op, "dense_with NaN parts", lambda: _dense_with(None, F32, 0, 0, "cpu", NAN)[0], "k_compressed", "v_compressed"
    )

    op = "KVCache methods"
    # A call the cache's state does not allow has no argument at fault: the message names the method.
    for nm, fn, at_fault in (
        ("attend", lambda c: c.attend(rnd(1, 1, 1, 64), None, None), "attend()"),
        ("dense", lambda c: c.dense(None), "dense()"),
        ("reorder", lambda c: c.reorder(torch.tensor([0])), "reorder()"),
        ("take_due_chunks", lambda c: c.take_due_chunks(), "take_due_chunks()"),
        ("dense_with", lambda c: c.dense_with([], [], None), "dense_with()"),
        ("crop_with", lambda c: c.crop_with(0, [], []), "crop_with()"),
        ("to(meta)", lambda c: c.to("meta"), "device"),
    ):
        bad(op, "args", f"{nm} on a new fused cache", lambda fn=fn: fn(mk()), at_fault)
    bad(op, "args", "to(meta) after an append", lambda: kept(filled(), lambda c: c.to("meta")), "device")
    bad(op, "args", "to('bogus')", lambda: kept(filled(), lambda c: c.to("bogus")), "device")
    bad(op, "args", "take_due_chunks on fused storage", lambda: filled().take_due_chunks(), "take_due_chunks()")
    bad(
        op,
        "args",
        "attend on external storage",
        lambda: filled(external_chunk=16).attend(rnd(2, 4, 1, 64), None, None),
        "attend()",
    )
    bad(
        op,
        "args",
        "dense_with while chunks are due",
        lambda: filled(external_chunk=16).dense_with([torch.zeros(2, 16, 64)] * 2, [torch.zeros(2, 16, 64)] * 2, None),
        "dense_with()",
        "take_due_chunks()",
    )
    bad(
        op,
        "values",
        "crop_with NaN survivors (into the tail)",
        lambda: kept(
            _external_taken(),
            lambda c: c.crop_with(8, [torch.full((2, 16, 64), NAN)] * 2, [torch.zeros(2, 16, 64)] * 2),
        ),
        "k_compressed",
    )
    bad(
        op,
        "shape",
        "crop_with part short",
        lambda: kept(
            _external_taken(), lambda c: c.crop_with(8, [torch.zeros(2, 15, 64)] * 2, [torch.zeros(2, 16, 64)] * 2)
        ),
        "k_compressed",
    )
    bad(
        op,
        "dtype",
        "crop_with integer parts",
        lambda: kept(
            _external_taken(),
            lambda c: c.crop_with(8, [torch.zeros(2, 16, 64, dtype=torch.int64)] * 2, [torch.zeros(2, 16, 64)] * 2),
        ),
        "k_compressed",
    )
    bad(
        op,
        "args",
        "crop on external storage inside a chunk",
        lambda: kept(_external_taken(), lambda c: c.crop(8)),
        "crop()",
        "crop_with()",
    )

    op = "KVCache.from_state_dict"
    sd = lambda **kw: filled(**kw).state_dict()  # noqa: E731

    def corrupt(fn, **kw):
        s = dict(sd(**kw))
        fn(s)
        return nkcache.from_state_dict(s)

    bad(op, "args", "not a dict", lambda: nkcache.from_state_dict([1, 2]), "state")
    bad(op, "args", "dict with a non-tensor", lambda: corrupt(lambda s: s.update(shape=[2, 2, 64])), "state", "'shape'")
    for key in ("nexuskv.version", "shape", "lengths.tail", "keys.codes", "tail.k", "config.key_bits"):
        bad(op, "state", f"missing {key}", lambda key=key: corrupt(lambda s: s.pop(key)), f"'{key}'")
    bad(
        op,
        "state",
        "version 99",
        lambda: corrupt(lambda s: s.update({"nexuskv.version": torch.tensor(99)})),
        "nexuskv.version",
    )
    bad(
        op,
        "bits",
        "config.key_bits 5",
        lambda: corrupt(lambda s: s.update({"config.key_bits": torch.tensor(5)})),
        "config.key_bits",
    )
    bad(
        op,
        "group_size",
        "config.value_group_size 0",
        lambda: corrupt(lambda s: s.update({"config.value_group_size": torch.tensor(0)})),
        "config.value_group_size",
    )
    bad(
        op,
        "lengths",
        "lengths.compressed > capacity",
        lambda: corrupt(lambda s: s.update({"lengths.compressed": torch.tensor([10**6, 0])})),
        "lengths.compressed",
    )
    bad(
        op,
        "lengths",
        "lengths.tail negative",
        lambda: corrupt(lambda s: s.update({"lengths.tail": torch.tensor([-1, 0])})),
        "lengths.tail",
    )
    bad(
        op,
        "lengths",
        "lengths.tail > tail capacity",
        lambda: corrupt(lambda s: s.update({"lengths.tail": torch.tensor([10**6, 0])})),
        "lengths.tail",
    )
    bad(
        op,
        "lengths",
        "lengths.compressed not a whole chunk",
        lambda: corrupt(lambda s: s.update({"lengths.compressed": s["lengths.compressed"] + 3})),
        "lengths.compressed",
    )
    bad(
        op,
        "lengths",
        "lengths.compressed batch 3",
        lambda: corrupt(lambda s: s.update({"lengths.compressed": torch.tensor([16, 16, 16])})),
        "lengths.compressed",
    )
    bad(
        op,
        "mismatch",
        "keys.codes truncated",
        lambda: corrupt(lambda s: s.update({"keys.codes": s["keys.codes"][:, :, :1]})),
        "keys.codes",
    )
    bad(
        op,
        "mismatch",
        "keys.scale float64",
        lambda: corrupt(lambda s: s.update({"keys.scale": s["keys.scale"].double()})),
        "keys.scale",
    )
    bad(
        op,
        "mismatch",
        "tail.k wrong head_dim",
        lambda: corrupt(lambda s: s.update({"tail.k": s["tail.k"][..., :32]})),
        "tail.k",
    )
    bad(
        op,
        "mismatch",
        "shape says batch 3",
        lambda: corrupt(lambda s: s.update(shape=torch.tensor([3, 2, 64]))),
        "'shape'",  # or the per-sequence entries it contradicts
        "lengths.sinks",
        "lengths.evicted",
        "lengths.compressed",
        "lengths.tail",
    )
    bad(
        op,
        "mismatch",
        "dtype entry int32",
        lambda: corrupt(lambda s: s.update(dtype=torch.empty(0, dtype=torch.int32))),
        "dtype",
    )
    bad(
        op,
        "mismatch",
        "keys.outlier_idx corrupt",
        lambda: corrupt(lambda s: s.update({"keys.outlier_idx": s["keys.outlier_idx"].fill_(200)}), key_outliers=1),
        "keys.outlier_idx",
    )
    bad(
        op,
        "values",
        "tail.k holds NaN",
        lambda: corrupt(lambda s: s.update({"tail.k": poke(s["tail.k"], NAN, 0)})),
        "tail.k",
    )
    bad(
        op,
        "values",
        "keys.scale holds Inf",
        lambda: corrupt(lambda s: s.update({"keys.scale": poke(s["keys.scale"], INF, 0)})),
        "keys.scale",
    )
    bad(
        op,
        "meta",
        "keys.codes on meta",
        lambda: corrupt(lambda s: s.update({"keys.codes": s["keys.codes"].to("meta")})),
        "keys.codes",
    )
    bad(
        op,
        "values",
        "sinks.v holds -Inf",
        lambda: corrupt(lambda s: s.update({"sinks.v": poke(s["sinks.v"], -INF, 3)}), sinks=4),
        "sinks.v",
    )
    bad(
        op,
        "values",
        "values.outlier_val holds NaN",
        lambda: corrupt(
            lambda s: s.update({"values.outlier_val": s["values.outlier_val"].fill_(NAN)}), value_outliers=1
        ),
        "values.outlier_val",
    )
    bad(
        op,
        "values",
        "values.zero holds NaN (per-token values)",
        lambda: corrupt(lambda s: s.update({"values.zero": s["values.zero"].fill_(NAN)})),
        "values.zero",
    )
    bad(
        op,
        "mismatch",
        "DGQ segment_starts corrupt",
        lambda: corrupt(
            lambda s: s.update({"keys.segment_starts": s["keys.segment_starts"].clone().fill_(5)}), key_dynamic=True
        ),
        "keys.segment_starts",
    )

    # valid
    op = "KVCache"
    for i, kw in enumerate(
        (
            dict(),
            dict(key_outliers=1, value_outliers=2),
            dict(key_dynamic=True),
            dict(rotate=True),
            dict(sinks=3),
            dict(window=24),
            dict(key_bits=2, value_bits=8),
            dict(key_axis=-1, value_axis=-2),
            dict(meta_dtype=BF16),
            dict(residual=0),
            dict(key_group_size=1, value_group_size=1),
            dict(key_group_size=64, value_group_size=24),
            dict(external_chunk=16),
        )
    ):
        for dt in (F32, F16, BF16) if i < 3 else (F32,):
            valid(op, f"decode {kw} {dt}", lambda kw=kw, dt=dt, i=i: _cache_decode(kw, dt, i))
    valid(op, "append of 0 tokens", lambda: _cache_zero_tokens())
    valid(op, "left padding via valid", lambda: _cache_padding())
    valid(op, "non-contiguous and stride-0 K/V", lambda: _cache_views())
    valid(op, "state_dict round trip continues bit-exactly", lambda: _cache_state_roundtrip())
    valid(op, "reorder with duplicates", lambda: _cache_reorder())
    valid(op, "crop inside the compressed part", lambda: _cache_crop())
    valid(op, "crop beyond the length keeps all", lambda: _cache_crop_beyond())
    valid(op, "dense(float64) = dense(float32) widened", lambda: _cache_dense64())
    valid(op, "fp16 q on an fp32 cache", lambda: _cache_q_dtype())
    valid(op, "state with requires-grad entries loads inference-only", lambda: _cache_state_grad())
    valid(op, "attend q_len = cached", lambda: _cache_decode({}, F32, 99, n0=7, steps=0, lq=7))


def _external_taken():
    c = filled(external_chunk=16)
    c.take_due_chunks()
    assert int(c.compressed_lengths()[0]) == 16
    return c


def _dense_with(dtype, part_dtype=F32, short=0, missing=0, device="cpu", fill=0.0):
    c = _external_taken()
    parts = [torch.full((2, int(n) + short, 64), fill, dtype=part_dtype, device=device) for n in c.compressed_lengths()]
    return c.dense_with(parts[missing:], parts, dtype)


def _windowed():
    c = mk(window=8, residual=0)
    c.append(*kv(n=64), None)
    for t in range(30):
        c.append(*kv(n=1, seed=t), None)
    assert int(c.evicted_lengths()[0]) > 0
    return c


def _cache_reference(c, q, scale=None, window=None):
    """softmax over the cache's own dense() (float32), the dequantize path."""
    k, v, lens = c.dense(F32)
    return attention_f64(q, k, v, lens, scale or q.shape[-1] ** -0.5, window)


def _dense_excess(c, K, V, kw, dtype):
    """dense() against the appended K/V: compressed tokens within the reference scale/2 of
    their group (computed from the original data), sinks and tail exact."""
    k, v, lens = c.dense(None)
    comp, sinks = c.compressed_lengths().tolist(), c.sinks()
    ev = c.evicted_lengths().tolist()
    worst = 0.0
    for which, orig, got in (("key", K, k), ("value", V, v)):
        bits, G, axis = kw.get(f"{which}_bits", 4), kw.get(f"{which}_group_size", 16), kw.get(f"{which}_axis", 0)
        axis = axis or (-2 if which == "key" else -1)
        kout = kw.get(f"{which}_outliers", 0)
        meta = kw.get("meta_dtype") or dtype
        for b in range(orig.shape[0]):
            L, n_c = int(lens[b]), comp[b]
            start = ev[b] + sinks  # first live compressed position in the original
            o = orig[b, :, ev[b] : ev[b] + L]
            g = got[b, :, :L]
            if not torch.equal(
                torch.cat([o[:, :sinks], o[:, sinks + n_c :]], 1), torch.cat([g[:, :sinks], g[:, sinks + n_c :]], 1)
            ):
                return INF
            if n_c == 0 or kw.get("key_dynamic") or kw.get("rotate"):
                continue  # (DGQ / rotated parts: checked through attention against dense())
            x = orig[b, :, start : start + n_c]
            worst = max(worst, _excess(x, g[:, sinks : sinks + n_c], bits, G, axis, kout, meta, dtype))
    return worst


def _cache_decode(kw, dtype, seed, n0=37, steps=20, lq=1):
    c = mk(**kw)
    B, H, Hq, D = 2, 2, 4, 64
    K, V = kv(B, H, n0 + steps, D, dtype, seed)
    c.append(K[:, :, :n0], V[:, :, :n0], None)
    err = 0.0
    window = kw.get("window")
    for t in range(n0, n0 + steps + 1):
        if t > n0:
            c.append(K[:, :, t - 1 : t], V[:, :, t - 1 : t], None)
        if c.is_external():
            c.take_due_chunks()
            continue
        q = rnd(B, Hq, lq, D, dtype=dtype, seed=t)
        err = max(err, rel_err(c.attend(q, None, None), _cache_reference(c, q, None, window)))
    if c.is_external():
        return (0.0 if c.lengths().tolist() == [n0 + steps] * B else INF), 0.0
    excess = _dense_excess(c, K, V, kw, dtype)
    tol = attention_tol(dtype)
    return max(err, tol + excess if excess > 0 else 0.0), tol


def _cache_dense64():
    c = filled(n=50)
    a, b = c.dense(F64), c.dense(F32)
    return (0.0 if all(torch.equal(x, y.double()) for x, y in zip(a[:2], b[:2])) else INF), 0.0


def _cache_q_dtype():
    c = filled(n=50)
    q = rnd(2, 4, 1, 64, dtype=F16)
    out = c.attend(q, None, None)
    if out.dtype != F16:
        return INF, 0.0
    return rel_err(out, _cache_reference(c, q)), attention_tol(F16)


def _cache_state_grad():
    c = filled(n=50)
    s = {k: (grad_leaf(v) if v.is_floating_point() and v.numel() else v) for k, v in c.state_dict().items()}
    d = nkcache.from_state_dict(s)
    d.append(*kv(n=3, seed=9), None)
    c.append(*kv(n=3, seed=9), None)
    q = rnd(2, 4, 1, 64)
    return (0.0 if torch.equal(d.attend(q, None, None), c.attend(q, None, None)) else INF), 0.0


def _cache_empty_batch():
    c = mk()
    try:
        c.append(*kv(B=0, n=40), None)
    except RuntimeError:
        if snapshot(c) != snapshot(mk()):
            raise LostData("a failed first append changed the cache")
        raise
    return c.attend(rnd(0, 4, 1, 64), None, None)


def _cache_zero_tokens():
    c = filled()
    before = c.dense(None)
    c.append(*kv(n=0), None)
    ok = c.lengths().tolist() == [40, 40] and all(torch.equal(a, b) for a, b in zip(before, c.dense(None)))
    return (0.0 if ok else INF), 0.0


def _cache_padding():
    c = mk()
    K, V = kv(n=40)
    valid_mask = torch.ones(2, 40, dtype=torch.bool)
    valid_mask[1, :13] = False
    c.append(K, V, valid_mask)
    if c.lengths().tolist() != [40, 27]:
        return INF, 0.0
    k, v, _ = c.dense(None)
    tail_ok = torch.equal(k[1, :, 27 - 16 : 27], K[1, :, 40 - 16 :]) and torch.equal(k[0, :, 24:40], K[0, :, 24:])
    q = rnd(2, 4, 1, 64)
    err = rel_err(c.attend(q, None, None), _cache_reference(c, q))
    return (err if tail_ok else INF), attention_tol(F32)


def _cache_views():
    K, V = kv(n=40)
    a, b = mk(), mk()
    a.append(K, V, None)
    b.append(K.transpose(1, 2).contiguous().transpose(1, 2), V.transpose(2, 3).contiguous().transpose(2, 3), None)
    one = rnd(2, 2, 1, 64)
    a.append(one.expand(2, 2, 5, 64).contiguous(), one.expand(2, 2, 5, 64).contiguous(), None)
    b.append(one.expand(2, 2, 5, 64), one.expand(2, 2, 5, 64), None)
    same = all(torch.equal(x, y) for x, y in zip(a.dense(None), b.dense(None)))
    return (0.0 if same else INF), 0.0


def _cache_state_roundtrip():
    import io

    c = filled(n=50, key_outliers=1)
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    d = nkcache.from_state_dict(torch.load(buf, weights_only=True))
    more = kv(n=20, seed=5)
    c.append(*more, None), d.append(*more, None)
    q = rnd(2, 4, 1, 64)
    same = torch.equal(c.attend(q, None, None), d.attend(q, None, None)) and all(
        torch.equal(x, y) for x, y in zip(c.dense(None), d.dense(None))
    )
    return (0.0 if same else INF), 0.0


def _cache_reorder():
    c = filled(n=50)
    k, v, _ = c.dense(None)
    c.reorder(torch.tensor([1, 1], dtype=torch.int32))
    k2, v2, lens = c.dense(None)
    ok = torch.equal(k2[0], k[1]) and torch.equal(k2[1], k[1]) and torch.equal(v2[0], v[1])
    return (0.0 if ok else INF), 0.0


def _cache_crop():
    c = filled(n=60)
    k, v, _ = c.dense(None)
    c.crop(20)
    k2, v2, lens = c.dense(None)
    ok = lens.tolist() == [20, 20] and torch.equal(k2, k[:, :, :20]) and torch.equal(v2, v[:, :, :20])
    return (0.0 if ok else INF), 0.0


def _cache_crop_beyond():
    c = filled(n=60)
    before = c.dense(None)
    c.crop(1000)
    ok = all(torch.equal(a, b) for a, b in zip(before, c.dense(None)))
    return (0.0 if ok else INF), 0.0


# ---- Hugging Face ---------------------------------------------------------------------------


def tiny_llama():
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def hf_cases():
    op = "hf.cache_for"
    for nm, kw, hints in (
        ("bits 5", dict(bits=5), ("bits",)),
        ("bits 0", dict(bits=0), ("bits",)),
        ("group_size 0", dict(group_size=0), ("group_size",)),
        ("group_size 300", dict(group_size=300), ("group_size",)),
        ("residual -1", dict(residual=-1), ("residual",)),
        ("residual 2**40", dict(residual=2**40), ("residual",)),
        ("outliers 64", dict(outliers=64), ("outliers",)),
        ("outliers -1", dict(outliers=-1), ("outliers",)),
        ("value_bits 7", dict(value_bits=7), ("value_bits",)),
        ("value_bits 0", dict(value_bits=0), ("value_bits",)),
        ("value_group_size 0", dict(value_group_size=0), ("value_group_size",)),
        ("value_outliers 99", dict(value_outliers=99), ("value_outliers",)),
        ("sinks -2", dict(sinks=-2), ("sinks",)),
        ("meta_dtype int32", dict(meta_dtype=torch.int32), ("meta_dtype",)),
        ("kv_heads 0", dict(kv_heads=0), ("kv_heads",)),
        ("kv_heads -1", dict(kv_heads=-1), ("kv_heads",)),
        ("kv_heads 'some'", dict(kv_heads="some"), ("kv_heads",)),
        ("compressor object()", dict(compressor=object()), ("compressor",)),
        ("value_compressor 3", dict(compressor=nexuskv.NQ(), value_compressor=3), ("value_compressor",)),
        ("rotate 'yes'", dict(rotate="yes"), ("rotate",)),
        ("dynamic_keys with G 200", dict(dynamic_keys=True, group_size=200), ("dynamic_keys", "group_size")),
        ("bits True", dict(bits=True), ("bits",)),
    ):
        cat = (
            "bits"
            if "bits" in nm
            else "group_size"
            if "group" in nm
            else "outliers"
            if "outliers" in nm
            else "dtype"
            if "dtype" in nm
            else "gqa"
            if "kv_heads" in nm
            else "args"
        )
        bad(op, cat, nm, lambda kw=kw: hf.cache_for(tiny_llama(), **kw), *hints)
    bad(op, "args", "model is not a model", lambda: hf.cache_for("llama"), "model")

    op = "hf.NexusKVLayer"

    def L(**s):
        return hf.NexusKVLayer({**dict(key_group_size=16, value_group_size=16, residual=16), **s}, fused=False)

    for nm, s, h in (
        ("key_group_size 0", dict(key_group_size=0), "key_group_size"),
        ("key_bits 5", dict(key_bits=5), "key_bits"),
        ("residual -1", dict(residual=-1), "residual"),
        ("unknown setting", dict(colour="red"), "colour"),
    ):
        bad(op, "args" if "group" not in nm else "group_size", f"settings {nm}", lambda s=s: L(**s).update(*kv()), h)
    bad(
        op,
        "shape",
        "update with 3-D states",
        lambda: L().update(rnd(2, 40, 64), rnd(2, 40, 64)),
        "key_states",
        "value_states",
    )
    bad(
        op,
        "shape",
        "update k/v shapes differ",
        lambda: L().update(rnd(2, 2, 40, 64), rnd(2, 2, 40, 32)),
        "key_states",
        "value_states",
    )
    bad(op, "dtype", "update int32 states", lambda: L().update(*(t.int() for t in kv())), "key_states", "value_states")
    bad(
        op,
        "dtype",
        "update float64 states",
        lambda: L().update(*(t.double() for t in kv())),
        "key_states",
        "value_states",
    )
    bad(op, "values", "update NaN states", lambda: L().update(poke(kv()[0], NAN), kv()[1]), "key_states")
    bad(op, "grad", "update requires-grad states", lambda: L().update(grad_leaf(kv()[0]), kv()[1]), "key_states")
    bad(
        op,
        "meta",
        "update meta states",
        lambda: L().update(*(t.to("meta") for t in kv())),
        "key_states",
        "value_states",
    )
    bad(
        op,
        "mismatch",
        "layer made for the model, other head_dim",
        lambda: hf.cache_for(tiny_llama()).layers[0].update(*kv(D=32)),
        "key_states",
    )
    bad(
        op,
        "gqa",
        "layer made for the model, other kv heads",
        lambda: hf.cache_for(tiny_llama()).layers[0].update(*kv(H=3, D=16)),
        "key_states",
    )
    bad(
        op,
        "args",
        "cache.update beyond the layers",
        lambda: hf.cache_for(tiny_llama()).update(*kv(D=16), 5),
        "layer_idx",
    )
    bad(op, "args", "reorder_cache beam index 7", lambda: _hf_filled().reorder_cache(torch.tensor([7, 0])), "beam_idx")
    bad(
        op,
        "args",
        "reorder_cache float beams",
        lambda: _hf_filled().reorder_cache(torch.tensor([1.0, 0.0])),
        "beam_idx",
    )

    op = "hf.NexusKVLayer batch"
    for nm, idx, h in (
        ("index 5", torch.tensor([5]), "indices"),
        ("float", torch.tensor([0.5]), "indices"),
        ("negative", torch.tensor([-1]), "indices"),
        ("2-D", torch.tensor([[0]]), "indices"),
        ("empty mask", torch.tensor([False, False]), "indices"),
    ):
        bad(op, "args", f"batch_select_indices {nm}", lambda idx=idx: _hf_filled().batch_select_indices(idx), h)
    for r in (0, -1, 1.5, True):
        bad(op, "args", f"batch_repeat_interleave({r})", lambda r=r: _hf_filled().batch_repeat_interleave(r), "repeats")
    for n in (0, -1, True):
        bad(op, "args", f"NexusKVCache({n})", lambda n=n: hf.NexusKVCache(n), "layers")
    bad(op, "args", "NexusKVCache(2, colour=1)", lambda: hf.NexusKVCache(2, colour=1), "colour")
    bad(op, "args", "NexusKVCache(2, key_bits=5)", lambda: hf.NexusKVCache(2, key_bits=5), "key_bits")

    op = "hf"
    valid(op, "batch_select_indices / batch_repeat_interleave keep the rows", lambda: _hf_batch())
    valid(op, "NexusKVLayer short update returns the exact states", lambda: _hf_exact())
    valid(op, "NexusKVLayer compressed update within the format's bound", lambda: _hf_compressed())
    valid(op, "cache_for forward = no-cache forward (prompt within the tail)", lambda: _hf_forward())


def _hf_filled():
    layer = hf.NexusKVLayer(dict(key_group_size=16, value_group_size=16, residual=16), fused=False)
    layer.update(*kv())
    return layer


def _hf_batch():
    layer = _hf_filled()
    k, v, _ = layer.cache.dense(None)
    layer.batch_repeat_interleave(2)
    k2, v2, lens = layer.cache.dense(None)
    ok = (
        lens.tolist() == [40] * 4 and torch.equal(k2[0], k[0]) and torch.equal(k2[1], k[0]) and torch.equal(k2[3], k[1])
    )
    layer.batch_select_indices(torch.tensor([False, False, True, False]))
    k3, v3, lens = layer.cache.dense(None)
    ok &= lens.tolist() == [40] and torch.equal(k3[0], k[1]) and torch.equal(v3[0], v[1])
    layer.batch_select_indices(torch.tensor([0, 0], dtype=torch.int32))
    ok &= layer.cache.lengths().tolist() == [40, 40] and torch.equal(layer.cache.dense(None)[0][1], k[1])
    return (0.0 if ok else INF), 0.0


def _hf_exact():
    K, V = kv(n=10)
    k, v = hf.NexusKVLayer(dict(residual=16), fused=False).update(K, V)
    return (0.0 if torch.equal(k, K) and torch.equal(v, V) else INF), 0.0


def _hf_compressed():
    K, V = kv(n=50)
    kw = dict(key_group_size=16, value_group_size=16, residual=16)
    layer = hf.NexusKVLayer(kw, fused=False)
    layer.update(K, V)
    if int(layer.cache.compressed_lengths()[0]) == 0:
        return INF, 0.0
    return _dense_excess(layer.cache, K, V, kw, F32), 0.0


def _hf_forward():
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        got = model(ids, past_key_values=hf.cache_for(model, residual=32, fused=False)).logits
    return rel_err(got, want), 1e-5


# ==== valid operation sequences (issue 18, items 1-5) ========================================
#
# Single calls on fresh objects miss what a cache does after a history: a crop inside a
# DGQ compressed part, appends after it, a state dict of the result.  A sequence case draws
# seeded random operations -- appends of 1 to 100 tokens, crops to any length (inside the
# compressed part too), attends, state_dict -> from_state_dict round trips (also through
# torch.save), clones, beam reorders -- and checks after every step that
#   * no step raised (each one is valid: crops stay clear of what a window evicted);
#   * the cache holds the appended-and-cropped positions, its sinks and never-compressed
#     tail tokens bit-exactly and every other token within 3 quantization steps of the
#     appended value (steps of the token's channel range for keys, of its own range for
#     values: a crop gives a cut chunk's survivors back to the tail dequantized, and they
#     are compressed again);
#   * a crop keeps every surviving token bit-identical (dense() before and after);
#   * attend() equals float64 softmax attention over the cache's own dense() within
#     row_tol per output row (the float32 accumulation; + half an ulp of q's dtype);
#   * a restored or cloned cache attends and dense()s bit-identically to the original,
#     and appending to a clone leaves the original as it was.
# A failing step reports its seed and the operations so far (a reproducer).

SEQ_MAX_TOKENS = 400
SEQ_SEEDS = 6  # per case; 4 cases per setting: 24 seeds per setting


def row_tol(q_dtype) -> float:
    """Per-row relative error of attention against float64: fp32 q: the suite's 1e-4;
    fp16/bf16 q: the kernel's documented 1e-3 for the integer-key path plus rounding the
    output into q's dtype (at most half an ulp of each element, so of the row's norm)."""
    return 1e-4 if q_dtype == F32 else 1e-3 + torch.finfo(q_dtype).eps / 2


def row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst relative error of an output row [..., D]; a row that sees no key is zero in both."""
    o, r = out.to(F64), ref.to(F64)
    if not o.numel():
        return 0.0
    return float(((o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).max())


def _quant_bound(x: torch.Tensor, axis: int, bits: int, dtype, lo=None, hi=None) -> torch.Tensor:
    """3 quantization steps of the range along axis that holds a token's group (x's own, or
    [lo, hi] when given: keys were grouped with tokens since cropped away), plus the
    rounding of 16-bit scales, zeros and outputs; x [H, T, D] float64."""
    lo = x.amin(axis, keepdim=True) if lo is None else lo
    hi = x.amax(axis, keepdim=True) if hi is None else hi
    mag = torch.maximum(hi.abs(), lo.abs())
    return (3 * (hi - lo) / (2**bits - 1) + (2.0**-6 if dtype != F32 else 2.0**-18) * mag).expand_as(x)


class _Appended:
    """The tokens a correct cache holds: every appended K/V row in order ([B, H, T, D],
    the input dtype), cut by crop() and permuted by reorder(); lossy[b, t]: token t of
    sequence b has been compressed (its value in the cache is approximate from then on);
    k_lo, k_hi [B, H, 1, D]: each key channel's range over every token ever appended,
    cropped ones included (a key group may have held them when it was quantized)."""

    def __init__(self, B, H, D, dtype):
        self.K = torch.zeros(B, H, 0, D, dtype=dtype)
        self.V = torch.zeros(B, H, 0, D, dtype=dtype)
        self.lossy = torch.zeros(B, 0, dtype=torch.bool)
        self.k_lo = torch.full((B, H, 1, D), INF, dtype=F64)
        self.k_hi = torch.full((B, H, 1, D), -INF, dtype=F64)

    @property
    def T(self) -> int:
        return self.K.shape[2]

    def append(self, k, v):
        self.K, self.V = torch.cat([self.K, k], 2), torch.cat([self.V, v], 2)
        self.lossy = torch.cat([self.lossy, torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool)], 1)
        if k.shape[2]:
            self.k_lo = torch.minimum(self.k_lo, k.to(F64).amin(2, keepdim=True))
            self.k_hi = torch.maximum(self.k_hi, k.to(F64).amax(2, keepdim=True))

    def mark_compressed(self, c):
        """Every position the cache has compressed so far (sinks + evicted + compressed)."""
        ends = (c.evicted_lengths() + c.compressed_lengths()).tolist()
        s = c.sinks()
        for b, n in enumerate(ends):
            self.lossy[b, s : s + n] = True

    def crop(self, length):
        self.K, self.V, self.lossy = self.K[:, :, :length], self.V[:, :, :length], self.lossy[:, :length]

    def reorder(self, idx):
        self.K, self.V, self.lossy = self.K[idx], self.V[idx], self.lossy[idx]
        self.k_lo, self.k_hi = self.k_lo[idx], self.k_hi[idx]


def _check_holds(c, ref: _Appended, kw: dict, dtype) -> tuple[float, str]:
    """(excess ratio, what) of the cache's positions and dense() against the appended tokens."""
    lens, ev, comp = c.lengths().tolist(), c.evicted_lengths().tolist(), c.compressed_lengths().tolist()
    S, W, T = c.sinks(), kw.get("window"), ref.T
    k, v, _ = c.dense(None)
    worst = 0.0
    for b in range(len(lens)):
        if lens[b] + ev[b] != T:
            return INF, f"sequence {b} holds {lens[b]} + {ev[b]} evicted positions, {T} were appended and kept"
        if ev[b] > (max(0, T - W + 1) if W else 0):
            return INF, f"sequence {b} evicted {ev[b]} positions that a query still sees (window {W})"
        s = min(S, T)
        live = list(range(s)) + list(range(s + ev[b], T))  # positions of the dense rows
        exact = torch.tensor(
            [p < s or (j >= s + comp[b] and not bool(ref.lossy[b, p])) for j, p in enumerate(live)], dtype=torch.bool
        )
        for which, want_all, got in (("key", ref.K, k), ("value", ref.V, v)):
            want = want_all[b][:, live].to(F64)
            have = got[b, :, : len(live)].to(F64)
            if not torch.equal(want[:, exact], have[:, exact]):
                return INF, f"sequence {b}: a full-precision {which} token differs from the appended one"
            if (~exact).any():
                axis, bits = (-2 if which == "key" else -1), kw.get(f"{which}_bits", 4)
                lo, hi = (ref.k_lo[b], ref.k_hi[b]) if which == "key" else (None, None)
                bound = _quant_bound(want, axis, bits, kw.get("meta_dtype") or dtype, lo, hi)[:, ~exact]
                e = (want[:, ~exact] - have[:, ~exact]).abs()
                worst = max(worst, float((e / bound.clamp_min(1e-30)).max()))
    return worst, f"a compressed token is {worst:.3g} x 3 quantization steps off"


def _check_attend(c, q, window) -> tuple[float, str]:
    out = c.attend(q, None, None)
    if out.shape != q.shape or out.dtype != q.dtype:
        return INF, f"attend() gave {tuple(out.shape)} {out.dtype} for q {tuple(q.shape)} {q.dtype}"
    k, v, lens = c.dense(F32)
    err = row_err(out, attention_f64(q, k, v, lens, q.shape[-1] ** -0.5, window))
    return err / row_tol(q.dtype), f"attend() row error {err:.3g} (tolerance {row_tol(q.dtype):.3g})"


def _restored(c, via_bytes: bool):
    state = c.state_dict()
    if via_bytes:
        import io

        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
    return nkcache.from_state_dict(state)


class SequenceError(RuntimeError):
    """A valid step raised: the message says which seed and which operations led there."""


def _random_op(c, ref, kw, dtype, g, seed, step):
    """The next operation of a random sequence: ("a", K, V) append, ("c", n) crop,
    ("sd" | "save",) state-dict round trip (directly | through torch.save), ("clone",),
    ("r", idx) reorder.  Appends dominate; every crop length is valid (with a window, one
    the cache can be cut to: the next query must not need an evicted position).  Odd
    seeds start with a prompt of 4 appends of 60 to 100 tokens: a compressed part past
    256 tokens, whose buffers then stay longer than any later crop leaves (item 1)."""
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B, H, _, D = ref.K.shape
    T, r = ref.T, float(torch.rand((), generator=g))
    W = kw.get("window")
    if T == 0 or r < 0.45 or (r >= 0.9 and B == 1) or (seed % 2 and step < 4):
        n = draw(60, 100) if seed % 2 and step < 4 else (1, draw(2, 16), draw(17, 100))[draw(0, 2)]
        if T + n > SEQ_MAX_TOKENS and not W:  # (a window keeps the live tokens few anyway)
            return ("c", T // 2)
        return (
            "a",
            rnd(B, H, n, D, dtype=dtype, seed=seed * 1000 + step),
            rnd(B, H, n, D, dtype=dtype, seed=seed * 1000 + step + 500),
        )
    if r < 0.7:
        lo = (int(c.evicted_lengths().max()) + W - 1) if W else 0
        return ("c", draw(min(lo, T), T + 4))
    if r < 0.8:
        return ("save" if draw(0, 1) else "sd",)
    if r < 0.9:
        return ("clone",)
    return ("r", torch.randint(0, B, (B,), generator=g))


def cache_sequence(kw: dict, dtype, seeds: Sequence[int], steps: int = 14, B: int = 2, script=None):
    """Runs seeded random operation sequences (or the one `script`, a list of _random_op
    tuples) on make_cache(**kw), checking after every step; (worst ratio, 1, where)."""
    H, Hq, D = 2, 4, 64
    if script is not None:
        B, H, _, D = script[0][1].shape
        Hq, steps = H, len(script)
    W = kw.get("window")
    worst, where = 0.0, ""
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        c, ref, log = mk(**kw), _Appended(B, H, D, dtype), []
        for step in range(steps):
            op = script[step] if script is not None else _random_op(c, ref, kw, dtype, g, seed, step)
            log.append(f"a{op[1].shape[2]}" if op[0] == "a" else f"c{op[1]}" if op[0] == "c" else op[0])
            q1 = rnd(B, Hq, 1, D, dtype=dtype, seed=seed + step)
            try:
                if op[0] == "a":
                    c.append(op[1], op[2], None)
                    ref.append(op[1], op[2])
                elif op[0] == "c":
                    ref.mark_compressed(c)  # what was compressed comes back approximate
                    before = c.dense(None)
                    c.crop(op[1])
                    ref.crop(op[1])
                    if not _crop_kept(before, c):
                        return INF, 1.0, f"seed {seed} {' '.join(log)}: crop() changed a token it kept"
                elif op[0] in ("sd", "save"):
                    d = _restored(c, op[0] == "save")
                    if not _same_cache(c, d, q1):
                        return INF, 1.0, f"seed {seed} {' '.join(log)}: the restored cache differs"
                    c = d if step % 2 else c  # go on with the restored cache half the time
                elif op[0] == "clone":
                    d = c.clone()
                    if not _same_cache(c, d, q1):
                        return INF, 1.0, f"seed {seed} {' '.join(log)}: the clone differs"
                    before = c.dense(None)
                    d.append(*(t.to(dtype) for t in kv(B, H, 3, D, seed=step)), None)
                    if not all(torch.equal(x, y) for x, y in zip(before, c.dense(None))):
                        return INF, 1.0, f"seed {seed} {' '.join(log)}: an append to the clone changed the original"
                else:
                    ref.mark_compressed(c)
                    c.reorder(op[1])
                    ref.reorder(op[1])
                ref.mark_compressed(c)
                ratio, what = _check_holds(c, ref, kw, dtype)
                if ratio > worst:
                    worst, where = ratio, f"seed {seed} {' '.join(log)}: {what}"
                live = int(c.lengths().min())
                if live:
                    lq = 1 + (seed + step) % min(4, live)
                    log.append(f"q{lq}")
                    ratio, what = _check_attend(c, rnd(B, Hq, lq, D, dtype=dtype, seed=seed * 7 + step), W)
                    if ratio > worst:
                        worst, where = ratio, f"seed {seed} {' '.join(log)}: {what}"
            except Exception as e:
                raise SequenceError(f"seed {seed} {' '.join(log)}: {type(e).__name__}: {e}") from None
            if worst == INF:
                return worst, 1.0, where
        if script is not None:  # the end state survives a round trip too
            d = _restored(c, False)
            if not _same_cache(c, d, rnd(B, Hq, 1, D, dtype=dtype, seed=seed)):
                return INF, 1.0, f"{' '.join(log)}: the restored cache differs"
    return worst, 1.0, where


def review_item1_script():
    """Issue 18 item 1 as the review wrote it: DGQ, G 32, residual 16, seed 25."""
    g = torch.Generator().manual_seed(25)
    ops_ = []
    for op, n in [("a", 48), ("a", 55), ("c", 100), ("a", 46), ("a", 78), ("c", 222), ("a", 36), ("a", 55), ("c", 54)]:
        ops_.append(
            ("c", n)
            if op == "c"
            else ("a", torch.randn(1, 1, n, 64, generator=g), torch.randn(1, 1, n, 64, generator=g))
        )
    return ops_


def review_item2(seeds: Sequence[int]):
    """Issue 18 item 2 as the review wrote it: crop(35) of 70 DGQ tokens (G 32, residual 5),
    over seeds; the crop must not raise and the 35 tokens must stay (attend over them)."""
    for seed in seeds:
        torch.manual_seed(seed)
        c = mk(key_dynamic=True, key_group_size=32, value_group_size=32, residual=5)
        c.append(torch.randn(1, 1, 70, 64), torch.randn(1, 1, 70, 64), None)
        try:
            c.crop(35)
        except Exception as e:
            raise SequenceError(f"seed {seed}: crop(35) of 70: {type(e).__name__}: {e}") from None
        if c.lengths().tolist() != [35]:
            return INF, 1.0, f"seed {seed}: holds {c.lengths().tolist()} after crop(35)"
        ratio, what = _check_attend(c, rnd(1, 1, 1, 64, seed=seed), None)
        if ratio > 1:
            return ratio, 1.0, f"seed {seed}: {what}"
    return 0.0, 1.0


def _crop_kept(before, c) -> bool:
    """Whether every token that crop() kept reads back (dense()) as it did before the crop:
    the survivors of a cut chunk go back to the tail as their decoded values, bit for bit."""
    k0, v0, _ = before
    k1, v1, lens = c.dense(None)
    return all(
        torch.equal(k1[b, :, :n], k0[b, :, :n]) and torch.equal(v1[b, :, :n], v0[b, :, :n])
        for b, n in enumerate(lens.tolist())
    )


def _same_cache(a, b, q) -> bool:
    same = a.lengths().tolist() == b.lengths().tolist()
    if same and int(a.lengths().min()) > 0:
        same = torch.equal(a.attend(q, None, None), b.attend(q, None, None))
    return same and all(torch.equal(x, y) for x, y in zip(a.dense(None), b.dense(None)))


def static_sequence(kw: dict, dtype, seeds: Sequence[int], steps: int = 12):
    """Seeded random decode on a StaticKVCache: forward(q, k, v) with 1 to 40 new tokens a
    step, from the first token on (before anything is compressed too).  After every step:
    the lengths buffer holds the appended tokens (whole chunks compressed), its tail holds
    the newest ones bit-exactly, its compressed part decodes (nq_decompress /
    dgq_decompress of its buffers) within 3 quantization steps, and the output equals
    float64 attention over what it holds within row_tol.  (worst ratio, 1, where)."""
    from nexuskv.static_cache import StaticKVCache

    B, H, Hq, D, G, cap = 2, 2, 4, 64, kw.get("group_size", 32), 256
    bits = kw.get("bits", 4)
    worst, where = 0.0, ""
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        s = StaticKVCache(B, H, D, cap, dtype, **kw)
        ref, log = _Appended(B, H, D, dtype), []
        for step in range(steps):
            n = (1, 1, int(torch.randint(2, 41, (1,), generator=g)))[int(torch.randint(0, 3, (1,), generator=g))]
            if ref.T + n > cap:
                break
            k, v = rnd(B, H, n, D, dtype=dtype, seed=seed * 100 + step), rnd(B, H, n, D, dtype=dtype, seed=seed + step)
            q = rnd(B, Hq, n, D, dtype=dtype, seed=seed * 3 + step)
            log.append(f"a{n}")
            try:
                out = s(q, k, v)
            except Exception as e:
                raise SequenceError(f"seed {seed} {' '.join(log)}: {type(e).__name__}: {e}") from None
            ref.append(k, v)
            n_c, n_t = (int(x) for x in s.lengths[:, 0])
            if s.lengths.tolist() != [[n_c] * B, [n_t] * B] or n_c + n_t != ref.T or n_c % G:
                return INF, 1.0, f"seed {seed} {' '.join(log)}: lengths {s.lengths.tolist()} for {ref.T} tokens"
            if not (
                torch.equal(s.k_tail[:, :, :n_t], ref.K[:, :, n_c:])
                and torch.equal(s.v_tail[:, :, :n_t], ref.V[:, :, n_c:])
            ):
                return INF, 1.0, f"seed {seed} {' '.join(log)}: the tail differs from the newest tokens"
            Kh, Vh = ref.K[:, :, :0].float(), ref.V[:, :, :0].float()
            if n_c:
                ks = s._k_store()
                if kw.get("dynamic_keys"):
                    # Only the slots of the compressed tokens: the unused ones past them are
                    # no segments (their outlier slots index nothing), as attention reads it.
                    used = -(-n_c // G)
                    ks = [ks[0][:, :, :n_c]] + [p[:, :, :used] for p in ks[1:]]
                    Kh = ops.dgq_decompress(*ks, bits, G, D, F32)
                else:
                    Kh = ops.nq_decompress(*ks, bits, G, -2, D, F32)[:, :, :n_c]
                Vh = ops.nq_decompress(*s._v_store(), bits, G, -1, D, F32)[:, :, :n_c]
                for b in range(B):
                    for which, want, have, axis in (("key", ref.K, Kh, -2), ("value", ref.V, Vh, -1)):
                        w = want[b, :, :n_c].to(F64)
                        e = (w - have[b].to(F64)).abs() / _quant_bound(w, axis, bits, dtype)
                        if float(e.max()) > max(worst, 1.0):
                            worst = float(e.max())
                            where = f"seed {seed} {' '.join(log)}: a compressed {which} is {worst:.3g} x 3 steps off"
            Kall = torch.cat([Kh, s.k_tail[:, :, :n_t].float()], 2)
            Vall = torch.cat([Vh, s.v_tail[:, :, :n_t].float()], 2)
            want = attention_f64(q, Kall, Vall, [ref.T] * B, D**-0.5, kw.get("window"))
            ratio = row_err(out, want) / row_tol(dtype)
            if out.dtype != dtype or ratio > max(worst, 1.0):
                worst = INF if out.dtype != dtype else ratio
                where = f"seed {seed} {' '.join(log)}: output row error {ratio * row_tol(dtype):.3g}"
    return worst, 1.0, where


PEAKED_TOL = 1e-3


def peaked_attention(q_dtype, via_cache: bool):
    """Item 4: a very peaked softmax, q exactly representable in bf16.  Key channel 0 is
    0 or 100 and q's channel 0 is 400, so the scores sit near 5e3 (= 400 * 100 / 8) for
    half the keys; among those the other channels (N(0, 1) keys, q of scale 16) decide,
    a few units apart.  With exact inputs only float32 arithmetic errs: a score of 5e3
    rounds by 5e3 * 2^-24 = 3e-4, which moves the output by about as much relative
    (plain float32 attention in torch: 2e-4 to 6e-4 on these seeds), so PEAKED_TOL =
    1e-3, plus half an ulp of q's dtype for the output rounding.  The same query values
    in float32 are the control.  (worst of seeds 4-6, tolerance)"""
    B, H, Hq, T, D = 1, 1, 4, 96, 64
    tol = PEAKED_TOL + (torch.finfo(q_dtype).eps / 2 if q_dtype != F32 else 0.0)
    worst = 0.0
    for seed in (4, 5, 6):
        g = torch.Generator().manual_seed(seed)
        K = torch.randn(B, H, T, D, generator=g)
        K[..., 0] = 100.0 * (torch.rand(B, H, T, generator=g) < 0.5)
        V = torch.randn(B, H, T, D, generator=g)
        q = (torch.randn(B, Hq, 1, D, generator=g) * 16).to(BF16)
        q[..., 0] = 400.0
        q = q.to(q_dtype)  # the bf16 values, also when the query runs in float32
        if via_cache:
            c = mk(key_group_size=32, value_group_size=32, residual=0)
            c.append(K, V, None)
            k, v, lens = c.dense(F32)
            err = row_err(c.attend(q, None, None), attention_f64(q, k, v, lens, D**-0.5))
        else:
            a = Att(B=1, Hkv=1, Hq=Hq, T=T, tail=0, comp_lens=(T,))
            a.args.update(
                k_cache=list(ops.nq_compress(K, 4, 32, -2, 0)), v_cache=list(ops.nq_compress(V, 4, 32, -1, 0)), q=q
            )
            err = row_err(a.call(), a.reference())
        worst = max(worst, err)
    return worst, tol


def _hf_pickle_roundtrip(static: bool, via: str):
    """Item 5: a cache_for cache saved after the prefill (pickle.dumps, or torch.save of the
    cache object) and loaded continues the decode with bit-identical logits."""
    import io
    import pickle

    model = tiny_llama()
    kw = dict(group_size=16, residual=16)
    if static:
        model.set_attn_implementation("nexuskv")
        kw.update(static=True, max_cache_len=96)
    cache = hf.cache_for(model, **kw)
    ids = torch.randint(0, 64, (1, 45), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(ids[:, :40], past_key_values=cache)
        if via == "pickle":
            copy = pickle.loads(pickle.dumps(cache))
        else:
            buf = io.BytesIO()
            torch.save(cache, buf)
            buf.seek(0)
            copy = torch.load(buf, weights_only=False)
        for t in range(40, 45):
            a = model(ids[:, t : t + 1], past_key_values=cache).logits
            b = model(ids[:, t : t + 1], past_key_values=copy).logits
            if not torch.equal(a, b):
                return INF, 0.0, f"token {t}: the loaded cache's logits differ"
    return 0.0, 0.0


HF_LOGIT_TOL = 1e-2


def hf_crop_sequence(seeds: Sequence[int], kw: dict):
    """Items 2 and 1 through transformers: a tiny Llama with a cache_for cache, a prefill
    of 40 to 120 tokens, then assisted decoding's pattern: a forward over 1 to 8 drafted
    tokens, and cache.crop() (NexusKVLayer.crop) back over the rejected ones -- or, one
    time in four, back to anywhere in the newer half.  No step may raise; the cache's
    length follows the kept tokens; the logits of every forward stay within HF_LOGIT_TOL
    relative of a no-cache forward over the same tokens (8-bit keys and values: their
    noise on this model is about 3e-3)."""
    model = tiny_llama()
    worst, where = 0.0, ""
    with torch.inference_mode():
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
            cache = hf.cache_for(model, fused=False, **kw)
            ids = torch.randint(0, 64, (1, draw(40, 120)), generator=g)
            log = [f"prefill {ids.shape[1]}"]
            try:
                model(ids, past_key_values=cache)
                for step in range(8):
                    new = torch.randint(0, 64, (1, draw(1, 8)), generator=g)
                    log.append(f"+{new.shape[1]}")
                    got = model(new, past_key_values=cache).logits
                    ids = torch.cat([ids, new], 1)
                    want = model(ids).logits[:, -new.shape[1] :]
                    ratio = rel_err(got, want) / HF_LOGIT_TOL
                    if ratio > worst:
                        worst, where = ratio, f"seed {seed} {' '.join(log)}: logits {ratio * HF_LOGIT_TOL:.3g} off"
                    T = ids.shape[1]
                    keep = draw(T // 2, T) if draw(0, 3) == 0 else T - draw(0, new.shape[1])
                    log.append(f"crop {keep}")
                    cache.crop(keep)
                    ids = ids[:, :keep]
                    if cache.get_seq_length() != keep:
                        return INF, 1.0, f"seed {seed} {' '.join(log)}: get_seq_length {cache.get_seq_length()}"
            except Exception as e:
                raise SequenceError(f"seed {seed} {' '.join(log)}: {type(e).__name__}: {e}") from None
    return worst, 1.0, where


SEQ_SETTINGS = [
    # (label, make_cache keywords, dtype, batch)
    ("nq G32 r16", dict(key_group_size=32, value_group_size=32, residual=16), F32, 2),
    ("nq G64 r0", dict(key_group_size=64, value_group_size=64, residual=0), F32, 2),
    ("nq G32 r5 fp16", dict(key_group_size=32, value_group_size=32, residual=5), F16, 2),
    ("nq G64 r128 bf16", dict(key_group_size=64, value_group_size=64, residual=128), BF16, 1),
    ("nq G32 r16 sinks4", dict(key_group_size=32, value_group_size=32, residual=16, sinks=4), F32, 2),
    ("nq G32 r5 window48", dict(key_group_size=32, value_group_size=32, residual=5, window=48), F32, 2),
    (
        "nq 8-bit G64 r5 outliers",
        dict(
            key_bits=8,
            value_bits=8,
            key_group_size=64,
            value_group_size=64,
            residual=5,
            key_outliers=1,
            value_outliers=1,
        ),
        F32,
        2,
    ),
    ("dgq G32 r16", dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=16), F32, 1),
    ("dgq G32 r5", dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=5), F32, 2),
    ("dgq G64 r0", dict(key_dynamic=True, key_group_size=64, value_group_size=64, residual=0), F32, 2),
    ("dgq G32 r128 fp16", dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=128), F16, 2),
    ("dgq G64 r16 bf16", dict(key_dynamic=True, key_group_size=64, value_group_size=64, residual=16), BF16, 2),
    ("dgq G32 r5 sinks4", dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=5, sinks=4), F32, 2),
    (
        "dgq G32 r16 window64",
        dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=16, window=64),
        F32,
        2,
    ),
    (
        "dgq G32 r0 outliers bf16",
        dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=0, key_outliers=1),
        BF16,
        1,
    ),
]
SEQ_CASES_PER_SETTING = 4


def sequence_cases():
    op = "KVCache sequence"
    for label, kw, dtype, B in SEQ_SETTINGS:
        for part in range(SEQ_CASES_PER_SETTING):
            seeds = range(part * SEQ_SEEDS, (part + 1) * SEQ_SEEDS)
            valid(
                op,
                f"{label} {B}x seeds {seeds.start}-{seeds.stop - 1}",
                lambda kw=kw, dtype=dtype, seeds=seeds, B=B: cache_sequence(kw, dtype, seeds, B=B),
            )
    dgq16 = dict(key_dynamic=True, key_group_size=32, value_group_size=32, residual=16)
    valid(
        op, "review item 1: DGQ crops, seed 25", lambda: cache_sequence(dgq16, F32, [0], script=review_item1_script())
    )
    valid(op, "review item 2: DGQ crop(35) of 70, seeds 0-39", lambda: review_item2(range(40)))
    op = "StaticKVCache sequence"
    for label, kw, dtype in (
        ("nq G32 r16", dict(group_size=32, residual=16), F32),
        ("nq G16 r0 bf16", dict(group_size=16, residual=0), BF16),
        ("dgq G32 r16", dict(group_size=32, residual=16, dynamic_keys=True), F32),
        ("dgq G32 r5 fp16", dict(group_size=32, residual=5, dynamic_keys=True), F16),
        ("dgq G64 r0 outliers", dict(group_size=64, residual=0, dynamic_keys=True, outliers=1), F32),
        ("nq G32 r5 window40", dict(group_size=32, residual=5, window=40), F32),
    ):
        valid(op, f"{label} seeds 0-3", lambda kw=kw, dtype=dtype: static_sequence(kw, dtype, range(4)))
    op = "peaked softmax"
    for q_dtype in (BF16, F32):
        for via_cache in (False, True):
            where = "KVCache.attend" if via_cache else "dgq_fused_attention"
            valid(
                op,
                f"{where} q {q_dtype} (bf16 values)".replace("torch.", ""),
                lambda q_dtype=q_dtype, via_cache=via_cache: peaked_attention(q_dtype, via_cache),
            )
    op = "hf sequence"
    for static in (False, True):
        for via in ("pickle", "torch.save"):
            valid(
                op,
                f"{via} of a {'static ' if static else ''}cache_for cache continues bit-exactly",
                lambda static=static, via=via: _hf_pickle_roundtrip(static, via),
            )
    for label, kw in (
        ("dgq G32 r5", dict(bits=8, group_size=32, residual=5, dynamic_keys=True)),
        ("nq G16 r16", dict(bits=8, group_size=16, residual=16)),
    ):
        valid(op, f"crop {label} seeds 0-9", lambda kw=kw: hf_crop_sequence(range(10), kw))


# ==== forged states and buffers (issue 18, items 6 and 7) =====================================
#
# from_state_dict promises that a cache it returns continues as the one that was saved; a
# state it cannot vouch for must be refused there, naming the entry.  The static cache's
# buffers are the operator's arguments: aliased, shared or corrupt ones must be refused by
# name too.  Either call returning is "silent".


def _dgq_state(**kw):
    """A DGQ cache's state: 150 tokens, 128 compressed in 4 segments of at most max_len 64
    (G 32, granule 16: starts [0, 32, 64, 80] in every row), 22 in the tail."""
    c = mk(key_dynamic=True, key_group_size=32, value_group_size=32, residual=16, **kw)
    c.append(*kv(n=150), None)
    return dict(c.state_dict())


def _forged(state: dict, **entries):
    """from_state_dict of state with entries replaced (fn(old) -> new, or a tensor)."""
    for key, new in entries.items():
        key = key.replace("__", ".")
        state[key] = new(state[key]) if callable(new) else new
    return nkcache.from_state_dict(state)


def _starts(fn):
    """A keys.segment_starts forgery: fn edits a copy of the starts [B, H, S] in place."""

    def edit(starts):
        starts = starts.clone()
        fn(starts)
        return starts

    return edit


def forged_cases():
    op = "KVCache.from_state_dict"
    bad(
        op,
        "state",
        "forged: DGQ state with config.key_dynamic 0",
        lambda: _forged(_dgq_state(), config__key_dynamic=torch.tensor(0)),
        "config.key_dynamic",
        "keys.segment_starts",
    )
    for what, fn in (
        ("off the granule", lambda s: s[..., 1].add_(1)),
        ("all zero", lambda s: s.zero_()),
        ("a segment longer than max_len", lambda s: s[..., 1:].copy_(torch.tensor([96, 96, 112]))),
    ):
        bad(
            op,
            "state",
            f"forged: keys.segment_starts {what}",
            lambda fn=fn: _forged(_dgq_state(), keys__segment_starts=_starts(fn)),
            "keys.segment_starts",
        )
    ext = lambda: dict(filled(external_chunk=16).state_dict())  # noqa: E731  (2 due chunks of 16)
    bad(
        op,
        "state",
        "forged: due.offset negative",
        lambda: _forged(ext(), due__offset=torch.tensor([-16, 0])),
        "due.offset",
    )
    bad(
        op,
        "state",
        "forged: due chunk shorter than the chunk",
        lambda: _forged(ext(), due__k__0=lambda t: t[:, :8], due__v__0=lambda t: t[:, :8]),
        "due.k.0",
        "due.v.0",
    )
    win = lambda: dict(_windowed().state_dict())  # noqa: E731  (window 8: 80 positions evicted)
    bad(
        op,
        "state",
        "forged: lengths.evicted 2**63 - 32",
        lambda: _forged(win(), lengths__evicted=torch.tensor([2**63 - 32] * 2)),
        "lengths.evicted",
    )
    bad(
        op,
        "state",
        "forged: config.window widened over evicted positions",
        lambda: _forged(win(), config__window=torch.tensor(64)),
        "config.window",
    )

    op = "static_kv_append_"
    for what, kw, at_fault in (
        ("k_tail passed as v_tail", lambda c: dict(v_tail=c.k_tail), ("v_tail", "k_tail")),
        ("v_store shares k_store's codes", lambda c: dict(v_store=[c.k_codes] + c._v_store()[1:]), ("v_store",)),
        ("k_store's zero is its scale", lambda c: dict(k_store=replace(c._k_store(), 2, c.k_scale)), ("k_store",)),
        ("fp16 tails in a float32 cache", lambda c: dict(k_tail=c.k_tail.half(), v_tail=c.v_tail.half()), ("k_tail",)),
    ):
        bad(op, "args", f"forged: {what}", lambda kw=kw: _static_forged_op(kw), *at_fault)
    op = "static_cache"
    bad(op, "values", "forged: append after a NaN stored k_scale", _static_nan_scale, "k_scale", "k_store")
    bad(op, "lengths", "forged: attend with lengths not whole chunks", _static_bad_lengths, "lengths")
    bad(op, "dtype", "forged: attend with fp16 tails in a float32 cache", _static_half_tails, "k_tail", "v_tail")


def _static_forged_op(kw):
    c = _static_filled()
    return _static_op(c, **kw(c))


def _static_nan_scale():
    c = _static_filled()  # 32 tokens compressed: two key groups of 16
    c.k_scale[0, 0, 0, 0] = NAN
    c.append(rnd(2, 2, 1, 64, seed=5), rnd(2, 2, 1, 64, seed=6))
    return c


def _static_half_tails():
    c = _static_filled()
    c.k_tail, c.v_tail = c.k_tail.half(), c.v_tail.half()
    return c.attend(rnd(2, 4, 1, 64))


def _static_bad_lengths():
    c = _static_filled()  # lengths [[32, 32], [8, 8]], chunks of 16
    c.lengths[0] = 24
    return c.attend(rnd(2, 4, 1, 64))


# ==== messages that must name the argument (issue 18, item 8) =================================


def message_cases():
    op = "static_cache"
    for name, kw, at_fault in [
        ("value_bits 5", dict(value_bits=5), "value_bits"),
        ("value_group_size 0", dict(value_group_size=0), "value_group_size"),
        ("value_group_size 300", dict(value_group_size=300), "value_group_size"),
        ("value_outliers = group", dict(value_outliers=16), "value_outliers"),
        ("dtype float64", dict(dtype=torch.float64), "dtype"),
        # far beyond any allocator (2^47 bytes of codes): the allocator's raw message is no answer
        ("max_tokens 2**40", dict(max_tokens=2**40), "max_tokens"),
        ("residual 2**40", dict(residual=2**40), "residual"),
    ]:
        bad(op, "args", f"constructor {name}", lambda kw=kw: _static(**kw), at_fault)
    op = "static_kv_append_"
    bad(
        op,
        "args",
        "k_store of 7 tensors",
        lambda: _static_kept(_static_filled(), lambda c: _static_op(c, k_store=c._k_store() + c._k_store()[:2])),
        "k_store",
    )
    bad(
        op,
        "args",
        "DGQ k_store of 7 tensors",
        lambda: _static_kept(
            _static_filled(dynamic_keys=True), lambda c: _static_op(c, k_store=c._k_store() + c._k_store()[:1])
        ),
        "k_store",
    )
    bad(
        op,
        "layout",
        "stride-0 k codes",  # 16 new tokens: a chunk is compressed into them
        lambda: _static_kept(
            _static_filled(),
            lambda c: _static_op(
                c,
                k_store=replace(c._k_store(), 0, c.k_codes[:, :, :1].expand_as(c.k_codes)),
                k=rnd(2, 2, 16, 64, seed=7),
                v=rnd(2, 2, 16, 64, seed=8),
            ),
        ),
        "k_store",
    )
    op = "KVCache.from_state_dict"
    bad(
        op,
        "state",
        "keys.segment_starts moved a granule (blamed on outlier_idx?)",
        lambda: _forged(_dgq_state(key_outliers=1), keys__segment_starts=_starts(lambda s: s[..., 1].add_(16))),
        "keys.segment_starts",
    )
    bad(
        op,
        "state",
        "due.seq truncated",
        lambda: _forged(dict(filled(external_chunk=16).state_dict()), due__seq=lambda t: t[:1]),
        "due.seq",
    )
    bad(
        op,
        "state",
        "keys.segment_starts of unused segments corrupt (fails at attend?)",
        _unused_starts,
        "keys.segment_starts",
    )


def _unused_starts():
    """The starts past the compressed length moved to the capacity: the last used segment
    then spans past 256 tokens, which from_state_dict must see, not the next attend()."""
    c = mk(key_dynamic=True, key_group_size=32, value_group_size=32, residual=16)
    c.append(*kv(n=400), None)
    c.crop(128)  # 128 compressed (starts 0, 32, 64, 112, then 128 for the unused), capacity 384
    state = dict(c.state_dict())
    capacity = state["keys.codes"].shape[2]
    return _forged(state, keys__segment_starts=_starts(lambda s: s[..., 4:].fill_(capacity)))


# ==== the runner ===========================================================================


def execute(case: Case) -> dict:
    torch.manual_seed(0)
    try:
        out = case.fn()
    except LostData as e:
        return {"status": "lost", "msg": str(e)}
    except BaseException as e:  # noqa: BLE001  (every exception is a result here)
        return {
            "status": "raised",
            "type": type(e).__name__,
            "clear_type": isinstance(e, CLEAR_TYPES),
            "msg": str(e).strip().splitlines()[0][:400] if str(e).strip() else "",
            "where": traceback.format_exc().splitlines()[-3][:200] if case.category == "valid" else "",
        }
    if case.category == "valid":
        err, tol, *where = out  # where: the step of a sequence that came out worst
        res = {"status": "checked", "err": float(err), "tol": float(tol)}
        return res | ({"where": str(where[0])[:400]} if where and where[0] else {})
    if case.propagates and isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
        return {"status": "propagated", "what": _describe(out) + " with NaN/Inf"}
    return {"status": "returned", "what": _describe(out)}


def _describe(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"Tensor{tuple(out.shape)} {out.dtype} {out.device}"
    if isinstance(out, (tuple, list)):
        return "(" + ", ".join(_describe(o) for o in out) + ")"
    return type(out).__name__


def run_isolated(case: Case, timeout: float) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            torch.set_num_threads(1)
            data = json.dumps(execute(case)).encode()
        except BaseException as e:  # noqa: BLE001
            data = json.dumps({"status": "raised", "type": "SweepError", "clear_type": False, "msg": repr(e)}).encode()
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    chunks, deadline, timed_out = [], time.monotonic() + timeout, False
    with os.fdopen(r, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([f], [], [], left)
            if ready:
                chunk = f.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"status": "hang"}
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"status": "crash", "signal": signal.Signals(os.WTERMSIG(status)).name}
    if os.WEXITSTATUS(status) != 0 or not chunks:
        return {"status": "crash", "exit": os.WEXITSTATUS(status)}
    return json.loads(b"".join(chunks))


def verdict(case: Case, res: dict) -> str:
    s = res["status"]
    if s in ("crash", "hang"):
        return s
    if case.category == "valid":
        if s == "checked":
            return "pass" if res["err"] <= res["tol"] else "wrong"
        return "error"
    if s in ("returned", "lost"):
        return "silent"
    if s == "propagated":
        return "propagated"
    msg = res.get("msg", "").lower()
    if (
        not res.get("clear_type")
        or any(m in msg for m in UNCLEAR_MARKS)
        or not any(names_argument(msg, h) for h in case.hints)
    ):
        return "unclear"
    return "clear"


BAD_VERDICTS = ["clear", "propagated", "unclear", "crash", "hang", "silent"]
VALID_VERDICTS = ["pass", "wrong", "error", "crash", "hang"]


def _static(**kw):
    from nexuskv.static_cache import StaticKVCache

    return StaticKVCache(**(dict(batch=2, kv_heads=2, head_dim=64, max_tokens=64, group_size=16, residual=8) | kw))


def _static_filled(n=40, **kw):
    c = _static(**kw)
    c.append(rnd(2, 2, n, 64, seed=1), rnd(2, 2, n, 64, seed=2))
    return c


def _static_kept(c, fn):
    """Runs fn(c), which must raise; if a buffer of the static cache changed, LostData."""
    before = {n: t.clone() for n, t in c.named_buffers()}
    try:
        fn(c)
    except Exception:
        if any(not torch.equal(t, before[n]) for n, t in c.named_buffers()):
            raise LostData("the call raised but the static cache changed") from None
        raise


def _static_args(c, **kw):
    a = dict(
        k_store=c._k_store(),
        v_store=c._v_store(),
        k_tail=c.k_tail,
        v_tail=c.v_tail,
        lengths=c.lengths,
        k=rnd(2, 2, 1, 64, seed=3),
        v=rnd(2, 2, 1, 64, seed=4),
        k_format=c.k_format,
        v_format=c.v_format,
        residual=c.residual,
    )
    return a | kw


def _static_op(c, **kw):
    return torch.ops.nexuskv.static_kv_append_(**_static_args(c, **kw))


def _static_decode(dtype, kw, steps=30):
    """Error of the static cache's attention against the dynamic cache's (same policy and
    format: equal to float32 rounding)."""
    s = _static(dtype=dtype, max_tokens=128, **kw)
    k = kw.get("outliers", 0)
    d = nkcache.make_cache(
        key_group_size=16,
        value_group_size=16,
        residual=8,
        key_outliers=k,
        value_outliers=k,
        key_dynamic=kw.get("dynamic_keys", False),
    )
    err = 0.0
    for i, n in enumerate([37] + [1] * steps):
        k, v, q = (
            rnd(2, 2, n, 64, dtype=dtype, seed=10 + i),
            rnd(2, 2, n, 64, dtype=dtype, seed=50 + i),
            rnd(2, 4, n, 64, dtype=dtype, seed=90 + i),
        )
        d.append(k, v, None)
        err = max(err, rel_err(s(q, k, v), d.attend(q, None, None)))
    assert s.lengths[0].min() > 0
    return err, 1e-5


def static_cache_cases():
    t = "static_cache"
    for name, kw, hint in [
        ("batch 0", dict(batch=0), "batch"),
        ("max_tokens -1", dict(max_tokens=-1), "max_tokens"),
        ("max_tokens float", dict(max_tokens=64.0), "max_tokens"),
        ("residual -1", dict(residual=-1), "residual"),
        ("window 0", dict(window=0), "window"),
        ("bits 5", dict(bits=5), "bits"),
        ("group_size 0", dict(group_size=0), "group_size"),
        ("group_size 300", dict(group_size=300), "group_size"),
        ("outliers = group", dict(outliers=16), "outliers"),
        ("meta dtype int", dict(meta_dtype=torch.int32), "meta_dtype"),
        ("device meta", dict(device="meta"), "device"),
        ("dtype int", dict(dtype=torch.int32), "dtype"),
    ]:
        bad(t, "args", f"constructor {name}", lambda kw=kw: _static(**kw), hint)
    bad(
        t,
        "values",
        "append NaN k",
        lambda: _static_kept(_static_filled(), lambda c: c.append(poke(rnd(2, 2, 1, 64), NAN), rnd(2, 2, 1, 64))),
        "k",
    )
    bad(
        t,
        "values",
        "append Inf v",
        lambda: _static_kept(_static_filled(), lambda c: c.append(rnd(2, 2, 1, 64), poke(rnd(2, 2, 1, 64), INF))),
        "v",
    )
    bad(
        t,
        "lengths",
        "append past the capacity",
        lambda: _static_kept(_static_filled(), lambda c: c.append(rnd(2, 2, 60, 64), rnd(2, 2, 60, 64))),
        "k",
        "max_tokens",
    )
    bad(
        t,
        "dtype",
        "append fp16 to fp32",
        lambda: _static_kept(
            _static_filled(), lambda c: c.append(rnd(2, 2, 1, 64, dtype=F16), rnd(2, 2, 1, 64, dtype=F16))
        ),
        "k",
        "v",
    )
    bad(
        t,
        "shape",
        "append 3-D",
        lambda: _static_kept(_static_filled(), lambda c: c.append(rnd(2, 1, 64), rnd(2, 1, 64))),
        "k",
    )
    bad(
        t,
        "gqa",
        "append other heads",
        lambda: _static_kept(_static_filled(), lambda c: c.append(rnd(2, 3, 1, 64), rnd(2, 3, 1, 64))),
        "k",
    )
    bad(
        t,
        "grad",
        "append requires grad",
        lambda: _static_kept(_static_filled(), lambda c: c.append(grad_leaf(rnd(2, 2, 1, 64)), rnd(2, 2, 1, 64))),
        "k",
    )
    bad(
        t,
        "meta",
        "append meta k/v",
        lambda: _static_kept(
            _static_filled(), lambda c: c.append(rnd(2, 2, 1, 64).to("meta"), rnd(2, 2, 1, 64).to("meta"))
        ),
        "k",
        "v",
    )
    t = "static_kv_append_"
    for name, kw, hint in [
        ("lengths int32", lambda c: dict(lengths=c.lengths.int()), "lengths"),
        ("lengths [1, B]", lambda c: dict(lengths=c.lengths[:1]), "lengths"),
        ("corrupt lengths", lambda c: dict(lengths=torch.tensor([[5, 5], [3, 3]])), "lengths"),
        ("tail too short", lambda c: dict(k_tail=c.k_tail[:, :, :3], v_tail=c.v_tail[:, :, :3]), "k_tail"),
        ("tails differ", lambda c: dict(k_tail=c.k_tail[:, :, :3]), "k_tail"),
        ("store of 4", lambda c: dict(k_store=c._k_store()[:4]), "k_store"),
        ("k_format short", lambda c: dict(k_format=[4, 16]), "k_format"),
        ("format mismatch", lambda c: dict(k_format=[4, 32, -2]), ("k_format", "k_store")),
        ("residual -1", lambda c: dict(residual=-1), "residual"),
        ("v other shape", lambda c: dict(v=rnd(2, 2, 2, 64)), "v"),
        ("k 5-D", lambda c: dict(k=rnd(1, 2, 2, 1, 64), v=rnd(1, 2, 2, 1, 64)), "k"),
        ("empty k", lambda c: dict(k=rnd(0, 2, 1, 64), v=rnd(0, 2, 1, 64)), "k"),
        ("meta lengths", lambda c: dict(lengths=c.lengths.to("meta")), "lengths"),
    ]:
        hints = hint if isinstance(hint, tuple) else (hint,)
        bad(t, "args", name, lambda kw=kw: _static_kept(_static_filled(), lambda c: _static_op(c, **kw(c))), *hints)
    for dtype in (F32, F16, BF16):
        for name, kw in [("nq", {}), ("dgq keys", dict(dynamic_keys=True)), ("outliers", dict(outliers=1))]:
            valid(
                "static_cache",
                f"decode vs the dynamic cache {name} {dtype}".replace("torch.", ""),
                lambda dtype=dtype, kw=kw: _static_decode(dtype, kw),
            )


# ---- paged KV (serving engines' block pools; paged_format.h) --------------------------------


def _paged_setup(dtype=torch.bfloat16, H=2, P=16, blocks=4, n=20, seed=0):
    """A pool with one request of n tokens in blocks 2, 0 (P-token blocks): (pages, q, table, lens, qsl, k, v)."""
    from nexuskv import paged

    C = paged.slot_bytes(64, dtype)
    pages = torch.zeros(blocks, H, P, C, dtype=torch.uint8)
    k, v = rnd(n, H, 64, dtype=dtype, seed=seed), rnd(n, H, 64, dtype=dtype, seed=seed + 1)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, t // P]) * P + t % P for t in range(n)])
    torch.ops.nexuskv.paged_kv_write_(pages, k, v, slots, 4, 4, 64)
    q = rnd(3, 2 * H, 64, dtype=dtype, seed=seed + 2)
    return pages, q, table, torch.tensor([n], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), k, v


def _paged_valid(dtype, window):
    """Attention over the pages against float64 attention over nq_compress'd rows."""
    pages, q, table, lens, qsl, k, v = _paged_setup(dtype)
    got = torch.ops.nexuskv.paged_attention(q, pages, table, lens, qsl, 4, 4, 64, 0, None, None, window)
    K = [ref.reference_dequantize(ops.nq_compress(k.transpose(0, 1), 4, 64, -1), 4, 64, -1, 64)]
    V = [ref.reference_dequantize(ops.nq_compress(v.transpose(0, 1), 4, 64, -1), 4, 64, -1, 64)]
    want = attention_f64(q.transpose(0, 1)[None], K, V, lens, 64**-0.5, window)[0].transpose(0, 1)
    return rel_err(got, want), attention_tol(dtype)


def paged_cases():
    W, A = torch.ops.nexuskv.paged_kv_write_, torch.ops.nexuskv.paged_attention
    op = "paged_kv_write_"

    def w(pages=None, key=None, value=None, slots=None, kb=4, vb=4, G=64, k=0, signs=None):
        p, _, _, _, _, kk, vv = _paged_setup()
        key = kk[:3] if key is None else key
        value = key if value is None else value
        slots = torch.tensor([5, 6, 7]) if slots is None else slots
        W(p if pages is None else pages(p), key, value, slots, kb, vb, G, k, signs)

    kk = lambda: rnd(3, 2, 64, dtype=torch.bfloat16)  # noqa: E731
    bad(op, "args", "slot past the pool", lambda: w(slots=torch.tensor([5, 6, 64])), "slot_mapping")
    bad(op, "args", "slot -2", lambda: w(slots=torch.tensor([5, -2, 7])), "slot_mapping")
    bad(op, "args", "slot twice", lambda: w(slots=torch.tensor([5, 6, 5])), "slot_mapping")
    bad(op, "dtype", "slots int32", lambda: w(slots=torch.tensor([5, 6, 7], dtype=torch.int32)), "slot_mapping")
    bad(op, "shape", "slots short", lambda: w(slots=torch.tensor([5, 6])), "slot_mapping")
    for b in (0, 5, 2**32 + 4):
        bad(op, "bits", f"key_bits {b}", lambda b=b: w(kb=b), "key_bits")
    bad(op, "bits", "value_bits 1", lambda: w(vb=1), "value_bits")
    bad(op, "group_size", "group_size 0", lambda: w(G=0), "group_size")
    bad(op, "outliers", "num_outliers = group_size", lambda: w(k=64), "num_outliers")
    bad(op, "mismatch", "format of other slot bytes", lambda: w(kb=2), "pages")
    bad(op, "dtype", "key float32 in a bf16 pool", lambda: w(key=kk().float()), "pages")
    bad(op, "dtype", "key int", lambda: w(key=kk().int()), "key")
    bad(op, "shape", "key 2-D", lambda: w(key=kk()[0]), "key")
    bad(op, "shape", "key heads", lambda: w(key=kk()[:, :1]), "key")
    # ("value" is a generic word to the clear rule: these messages must name key, whose
    # shape and dtype value must have.)
    bad(op, "mismatch", "value shape", lambda: w(value=kk()[:2]), "key")
    bad(op, "mismatch", "value dtype", lambda: w(value=kk().half()), "key")
    bad(op, "layout", "pages view", lambda: w(pages=lambda p: p[:, :, ::2]), "pages")
    bad(op, "dtype", "pages int8", lambda: w(pages=lambda p: p.to(torch.int8)), "pages")
    bad(op, "shape", "pages block 8", lambda: w(pages=lambda p: p[:, :, :8].contiguous()), "block_size")
    bad(op, "signs", "signs length 32", lambda: w(signs=torch.ones(32)), "rotation_signs")
    bad(op, "signs", "signs 0.5", lambda: w(signs=torch.full((64,), 0.5)), "rotation_signs")
    bad(op, "meta", "key on meta", lambda: w(key=kk().to("meta")), "key")
    bad(op, "grad", "key requires grad", lambda: w(key=grad_leaf(kk())), "key")
    bad(op, "values", "key NaN", lambda: w(key=poke(kk(), NAN)), "key")
    bad(op, "values", "value Inf", lambda: w(value=poke(kk(), INF)), "key")

    op = "paged_attention"

    def a(q=None, pages=None, table=None, lens=None, qsl=None, k=0, signs=None, scale=None, window=None, cap=None):
        p, qq, tt, ll, ss, _, _ = _paged_setup()
        return A(
            qq if q is None else q(qq),
            p if pages is None else pages(p),
            tt if table is None else table,
            ll if lens is None else lens,
            ss if qsl is None else qsl,
            4,
            4,
            64,
            k,
            signs,
            scale,
            window,
            cap,
        )

    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    bad(op, "shape", "q 2-D", lambda: a(q=lambda q: q[0]), "q")
    bad(op, "gqa", "q heads 3", lambda: a(q=lambda q: q[:, :3]), "q")
    bad(op, "shape", "head_dim 40", lambda: a(q=lambda q: q[..., :40]), "head_dim")
    bad(op, "mismatch", "q float32 over a bf16 pool", lambda: a(q=lambda q: q.float()), "q")
    bad(op, "dtype", "block_table int64", lambda: a(table=i32(2, 0, 3)[None].long()), "block_table")
    bad(op, "shape", "block_table rows", lambda: a(table=i32(2, 0, 3)[None].repeat(2, 1)), "block_table")
    bad(op, "shape", "query_start_loc short", lambda: a(qsl=i32(0)), "query_start_loc")
    bad(op, "lengths", "query_start_loc from 1", lambda: a(qsl=i32(1, 3)), "query_start_loc")
    bad(op, "lengths", "query_start_loc past q", lambda: a(qsl=i32(0, 4)), "query_start_loc")
    bad(op, "lengths", "seq_lens below q_len", lambda: a(lens=i32(2)), "seq_lens")
    bad(op, "lengths", "seq_lens past the table", lambda: a(lens=i32(49)), "seq_lens")
    bad(op, "lengths", "seq_lens -1", lambda: a(lens=i32(-1)), "seq_lens")
    bad(op, "args", "block id past the pool", lambda: a(table=i32(2, 9, 3)[None]), "block_table")
    bad(op, "args", "block id -1 read", lambda: a(table=i32(-1, 0, 3)[None]), "block_table")
    bad(op, "args", "window 0", lambda: a(window=0), "window")
    bad(op, "args", "softcap -1", lambda: a(cap=-1.0), "softcap")
    bad(op, "args", "scale NaN", lambda: a(scale=NAN), "scale")
    bad(op, "outliers", "format with outliers", lambda: a(k=1), "pages")
    bad(op, "meta", "table on meta", lambda: a(table=i32(2, 0, 3)[None].to("meta")), "block_table")
    bad(op, "grad", "q requires grad", lambda: a(q=lambda q: grad_leaf(q.float()).bfloat16()), "q")
    nonfinite(op, "q NaN", lambda: a(q=lambda q: poke(q, NAN)), "q")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for window in (None, 7):
            valid(op, f"{dtype} window {window} vs float64", lambda d=dtype, wnd=window: _paged_valid(d, wnd))

    # The exact window (pages with rings of 4 tokens per block of 16): its write and the attention's key / value.
    from nexuskv import paged

    def ring_pages():
        return torch.zeros(4, 2, 16, paged.slot_bytes(64, torch.bfloat16, 4, 4, 64, 0, 4, 16), dtype=torch.uint8)

    def aw(key=lambda k: k, value=lambda v: v, exact=4):
        _, qq, tt, ll, ss, _, _ = _paged_setup()
        kv = rnd(3, 2, 64, dtype=torch.bfloat16)
        k, v = key(kv), value(kv)
        return A(qq, ring_pages(), tt, ll, ss, 4, 4, 64, 0, None, None, None, None, exact, k, v)

    bad(op, "args", "exact window without key", lambda: aw(key=lambda k: None, value=lambda v: None), "key")
    bad(op, "args", "exact window, key alone", lambda: aw(value=lambda v: None), "key")
    bad(op, "args", "exact window past the block", lambda: aw(exact=17), "exact_window")
    bad(op, "mismatch", "exact window of other slot bytes", lambda: aw(exact=8), "exact_window")
    bad(op, "shape", "exact key tokens", lambda: aw(key=lambda k: k[:2]), "key")
    bad(op, "shape", "exact value heads", lambda: aw(value=lambda v: v[:, :1]), "kv_heads")
    bad(op, "dtype", "exact key float32", lambda: aw(key=lambda k: k.float()), "key")
    bad(op, "meta", "exact key on meta", lambda: aw(key=lambda k: k.to("meta")), "key")

    op = "paged_exact_write_"
    X = torch.ops.nexuskv.paged_exact_write_

    def xw(key=None, slots=None, exact=4, pages=ring_pages):
        key = kk() if key is None else key
        X(pages(), key, key, torch.tensor([5, 6, 7]) if slots is None else slots, 4, 4, 64, 0, exact)

    bad(op, "args", "ring slot past the pool", lambda: xw(slots=torch.tensor([5, 6, 64])), "slot_mapping")
    bad(op, "args", "ring slot twice", lambda: xw(slots=torch.tensor([5, 6, 5])), "slot_mapping")
    bad(op, "args", "exact window 0", lambda: xw(exact=0), "exact_window")
    bad(op, "args", "exact window past the block", lambda: xw(exact=17), "exact_window")
    bad(op, "mismatch", "pages without rings", lambda: xw(pages=lambda: _paged_setup()[0]), "exact_window")
    bad(op, "shape", "ring key heads", lambda: xw(key=kk()[:, :1]), "key")
    bad(op, "dtype", "ring key int", lambda: xw(key=kk().int()), "key")
    bad(op, "meta", "ring key on meta", lambda: xw(key=kk().to("meta")), "key")
    bad(op, "grad", "ring key requires grad", lambda: xw(key=grad_leaf(kk())), "key")


def build_cases():
    global _group
    for _group, builders in (
        ("operators", (nq_compress_cases, nq_decompress_cases, dgq_cases, hadamard_cases, attention_cases)),
        ("cache", (cache_cases,)),
        ("hf", (hf_cases,)),
        ("static", (static_cache_cases,)),
        ("sequences", (sequence_cases,)),
        ("forged", (forged_cases,)),
        ("messages", (message_cases,)),
        ("paged", (paged_cases,)),
    ):
        for build in builders:
            build()
    _group = ""
    names = collections.Counter(c.name for c in CASES)
    dup = [n for n, k in names.items() if k > 1]
    assert not dup, f"duplicate case names: {dup}"


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write every case and its verdict here")
    p.add_argument("--only", help="run the cases whose name contains this")
    p.add_argument(
        "--group",
        help=f"run these case groups only (comma-separated: {', '.join(GROUPS)}; 'new' = {', '.join(NEW_GROUPS)})",
    )
    p.add_argument("--category", help="run these categories only (comma-separated: valid, args, state, lengths, ...)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    p.add_argument("--verbose", action="store_true", help="print every case, not only the problems")
    args = p.parse_args(argv)
    build_cases()
    groups = set()
    for g in (args.group or "").split(","):
        groups |= set(NEW_GROUPS) if g == "new" else {g} if g else set()
    if groups - set(GROUPS):
        p.error(f"unknown group(s) {sorted(groups - set(GROUPS))}; the groups are {', '.join(GROUPS)} and new")
    categories = set(filter(None, (args.category or "").split(",")))
    cases = [
        c
        for c in CASES
        if (not args.only or args.only in c.name)
        and (not groups or c.group in groups)
        and (not categories or c.category in categories)
    ]
    results, t0 = [], time.monotonic()
    for i, case in enumerate(cases):
        res = run_isolated(case, args.timeout)
        v = verdict(case, res)
        results.append(
            {"name": case.name, "group": case.group, "target": case.target, "category": case.category, "verdict": v}
            | res
        )
        problem = v not in ("clear", "pass", "propagated")
        if problem or args.verbose:
            detail = res.get("msg") or res.get("what") or res.get("signal") or ""
            if res.get("status") == "checked":
                detail = f"err {res['err']:.3g} tol {res['tol']:.3g}" + (
                    f" at {res['where']}" if "where" in res else ""
                )
            print(
                f"[{i + 1}/{len(cases)}] {v.upper():8s} {case.name}: {res.get('type', '')} {detail}"[:400], flush=True
            )
    elapsed = time.monotonic() - t0
    bad_rows = [r for r in results if r["category"] != "valid"]
    valid_rows = [r for r in results if r["category"] == "valid"]
    cats = sorted({r["category"] for r in bad_rows})
    table = {c: collections.Counter(r["verdict"] for r in bad_rows if r["category"] == c) for c in cats}
    print(
        f"\n{len(bad_rows)} bad inputs, {len(valid_rows)} valid cases, {elapsed:.0f} s "
        f"(torch {torch.__version__}, nexuskv {nexuskv.__version__})\n"
    )
    print(f"{'bad inputs by category':24s}" + "".join(f"{v:>11s}" for v in BAD_VERDICTS) + f"{'total':>11s}")
    for c in cats:
        print(f"{c:24s}" + "".join(f"{table[c][v]:11d}" for v in BAD_VERDICTS) + f"{sum(table[c].values()):11d}")
    tot = collections.Counter(r["verdict"] for r in bad_rows)
    print(f"{'all':24s}" + "".join(f"{tot[v]:11d}" for v in BAD_VERDICTS) + f"{len(bad_rows):11d}")
    targets = sorted({r["target"] for r in results})
    by_target = {t: collections.Counter(r["verdict"] for r in results if r["target"] == t) for t in targets}
    print(f"\n{'by target':24s}" + "".join(f"{v:>11s}" for v in BAD_VERDICTS + VALID_VERDICTS[:3]))
    for t in targets:
        print(f"{t:24s}" + "".join(f"{by_target[t][v]:11d}" for v in BAD_VERDICTS + VALID_VERDICTS[:3]))
    run_groups = [g for g in GROUPS if any(r["group"] == g for r in results)]
    by_group = {g: collections.Counter(r["verdict"] for r in results if r["group"] == g) for g in run_groups}
    print(f"\n{'by group':24s}" + "".join(f"{v:>11s}" for v in BAD_VERDICTS + VALID_VERDICTS[:3]))
    for g in run_groups:
        print(f"{g:24s}" + "".join(f"{by_group[g][v]:11d}" for v in BAD_VERDICTS + VALID_VERDICTS[:3]))
    vt = collections.Counter(r["verdict"] for r in valid_rows)
    print(f"\n{'valid cases':24s}" + "".join(f"{v:>11s}" for v in VALID_VERDICTS) + f"{'total':>11s}")
    print(f"{'all':24s}" + "".join(f"{vt[v]:11d}" for v in VALID_VERDICTS) + f"{len(valid_rows):11d}")
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "bad": {c: dict(table[c]) for c in cats},
            "bad_total": dict(tot),
            "valid": dict(vt),
            "groups": {g: dict(by_group[g]) for g in run_groups},
            "n_bad": len(bad_rows),
            "n_valid": len(valid_rows),
            "seconds": round(elapsed, 1),
            "torch": torch.__version__,
        }
        path.write_text(json.dumps({"summary": summary, "cases": results}, indent=1))
        print(f"\nwrote {path}")
    failures = sum(tot[v] for v in ("crash", "hang", "silent", "unclear")) + sum(
        vt[v] for v in ("wrong", "error", "crash", "hang")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
