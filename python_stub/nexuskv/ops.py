"""The nexuskv operator surface in Python: typed wrappers with docstrings and
the fake (meta) kernels that let torch.compile and torch.export trace the
operators without running them.  Schemas live in ops/registration.cpp; the
compressed format is documented in csrc/include/nexuskv/core/nq_format.h."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

from . import _format, _loader

_loader.load()

__all__ = [
    "NQParts",
    "DGQParts",
    "nq_compress",
    "nq_decompress",
    "dgq_compress",
    "dgq_decompress",
    "dgq_fused_attention",
    "hadamard_rotate",
]


class NQParts(NamedTuple):
    """The five tensors of one NQ-compressed tensor x[..., T, D]."""

    codes: torch.Tensor  # uint8 [..., T, row_bytes]   packed codes, one row per token
    scale: torch.Tensor  # meta  [..., A, B]           per-group scale
    zero: torch.Tensor  # meta  [..., A, B]           per-group zero (the group minimum)
    outlier_idx: torch.Tensor  # uint8 [..., A, B, k]  position of each outlier in its group
    outlier_val: torch.Tensor  # x.dtype [..., A, B, k] exact outlier values


class DGQParts(NamedTuple):
    """The six tensors of one DGQ-compressed tensor: NQParts with data-chosen token groups."""

    codes: torch.Tensor  # uint8 [..., T, row_bytes]
    scale: torch.Tensor  # meta  [..., S, D]            per segment and channel
    zero: torch.Tensor  # meta  [..., S, D]
    outlier_idx: torch.Tensor  # uint8 [..., S, D, k]    position inside the segment
    outlier_val: torch.Tensor  # x.dtype [..., S, D, k]
    segment_starts: torch.Tensor  # int32 [..., S]     first token of each segment (unused: T)


def nq_compress(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    axis: int,
    num_outliers: int = 0,
    meta_dtype: Optional[torch.dtype] = None,
    fit_range: bool = False,
) -> NQParts:
    """Block-quantizes x[..., tokens, head_dim] (float32, float16 or bfloat16).

    Args:
        bits: 2, 3, 4 or 8 bits per code.
        group_size: elements per quantization group (1..256).
        axis: -2 groups ``group_size`` consecutive tokens of one channel (per-channel
            quantization, the KIVI choice for keys); -1 groups ``group_size``
            consecutive channels of one token (per-token quantization, for values).
        num_outliers: k < group_size entries per group kept exactly (dense-and-sparse).
        meta_dtype: dtype of scale and zero; default x.dtype (never overflows).
        fit_range: each group's scale and zero fitted by least squares on its own codes
            instead of min/max (nq_format.h, "Fitted ranges"): the same format, about half
            the squared error at 2 bits; every non-outlier decodes to the nearest of its
            group's 2^bits levels, entries past the fitted range to its end levels.

    Rejects NaN/Inf in x.  Inference only: x must not require grad under grad mode.
    """
    op = "nq_compress"
    return NQParts(
        *torch.ops.nexuskv.nq_compress(
            x,
            _int(op, "bits", bits),
            _int(op, "group_size", group_size),
            _int(op, "axis", axis),
            _int(op, "num_outliers", num_outliers),
            meta_dtype,
            _bool(op, "fit_range", fit_range),
        )
    )


def nq_decompress(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    outlier_idx: torch.Tensor,
    outlier_val: torch.Tensor,
    bits: int,
    group_size: int,
    axis: int,
    head_dim: int,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Inverse of nq_compress: x_hat[..., tokens, head_dim] in out_dtype
    (default outlier_val.dtype, the compressed tensor's dtype).  Every
    non-outlier element is within scale/2 of the original; outliers are exact.

    bits, group_size, axis and head_dim must be the ones the buffers were compressed with.
    A mismatch is an error where it changes the sizes the buffers must have (bytes per token,
    the shape of scale/zero/outliers), and an outlier position outside its group is an error;
    parameters that give the same sizes cannot be told from the buffers (group 16 read as 17
    when both make as many groups; per-token 4-bit head_dim 64 in groups of 16 read as 2-bit
    head_dim 128 in groups of 32) and decode to wrong values: keep the format with the
    buffers, as nexuskv.NQ / DGQ and the cache do."""
    op = "nq_decompress"
    return torch.ops.nexuskv.nq_decompress(
        codes,
        scale,
        zero,
        outlier_idx,
        outlier_val,
        _int(op, "bits", bits),
        _int(op, "group_size", group_size),
        _int(op, "axis", axis),
        _int(op, "head_dim", head_dim),
        out_dtype,
    )


def dgq_compress(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    granule: int = 16,
    max_len: Optional[int] = None,
    num_outliers: int = 0,
    meta_dtype: Optional[torch.dtype] = None,
    fit_range: bool = False,
) -> DGQParts:
    """Per-channel quantization of x[..., tokens, head_dim] over token groups that follow the
    data (DGQ): S = ceil(tokens / group_size) segments per row, each a whole number of
    ``granule`` tokens and at most ``max_len`` (default: the smallest multiple of granule
    >= 2 * group_size; at most 256) tokens, cut
    where merging would raise the quantization error most (changes of per-channel range).
    Same bits per element as nq_compress(x, bits, group_size, -2) plus one int32 per segment;
    ``fit_range`` as there."""
    op = "dgq_compress"
    return DGQParts(
        *torch.ops.nexuskv.dgq_compress(
            x,
            _int(op, "bits", bits),
            _int(op, "group_size", group_size),
            _int(op, "granule", granule),
            _int(op, "max_len", max_len),
            _int(op, "num_outliers", num_outliers),
            meta_dtype,
            _bool(op, "fit_range", fit_range),
        )
    )


def dgq_decompress(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    outlier_idx: torch.Tensor,
    outlier_val: torch.Tensor,
    segment_starts: torch.Tensor,
    bits: int,
    group_size: int,
    head_dim: int,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Inverse of dgq_compress (the format parameters as for nq_decompress: those of the
    compression; segment_starts must be ordered segments of [0, tokens] starting at 0)."""
    op = "dgq_decompress"
    return torch.ops.nexuskv.dgq_decompress(
        codes,
        scale,
        zero,
        outlier_idx,
        outlier_val,
        segment_starts,
        _int(op, "bits", bits),
        _int(op, "group_size", group_size),
        _int(op, "head_dim", head_dim),
        out_dtype,
    )


def dgq_fused_attention(
    q: torch.Tensor,
    k_cache: Sequence[torch.Tensor],
    v_cache: Sequence[torch.Tensor],
    k_format: Sequence[int],
    v_format: Sequence[int],
    compressed_lens: torch.Tensor,
    k_tail: Optional[torch.Tensor] = None,
    v_tail: Optional[torch.Tensor] = None,
    tail_lens: Optional[torch.Tensor] = None,
    rotation_signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    k_sink: Optional[torch.Tensor] = None,
    v_sink: Optional[torch.Tensor] = None,
    sink_lens: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """softmax(softcap(q . K^T * scale) + causal mask) . V straight from the compressed cache.

    Args:
        q: [batch, q_heads, q_len, head_dim]; q_heads a multiple of kv_heads (GQA); head_dim a
            multiple of 16, at most 256.  The q_len queries are the last q_len positions of
            their sequence, causal among themselves.
        k_cache, v_cache: the NQ buffers (codes, scale, zero, outlier_idx, outlier_val) of K and V,
            each [batch, kv_heads, ...], plus segment_starts for DGQ keys.
        k_format, v_format: (bits, group_size, axis) of each.
        compressed_lens: [batch] compressed tokens of each sequence (<= the cache's capacity).
        k_tail, v_tail: optional [batch, kv_heads, tail_tokens, head_dim] full-precision newest
            tokens, positioned after the compressed ones; tail_lens [batch] how many are valid.
        rotation_signs: [head_dim] +-1 when the cache holds hadamard_rotate(K/V, signs).
        scale: softmax scale, default head_dim ** -0.5.
        k_sink, v_sink: optional [batch, kv_heads, sink_tokens, head_dim] full-precision first tokens
            (attention sinks), positioned before the compressed ones; sink_lens [batch] how many are
            valid.  Positions of a sequence: sinks, compressed, tail.  Sinks and tail are in the
            original basis also when the cache is rotated.
        window: sliding window: the query at position p sees the keys at positions
            (p - window, p] (as transformers' sliding_window; positions count the sinks too).
            Tiles before the oldest query's window are not read.
        softcap: logit soft-capping, score -> softcap * tanh(score / softcap) after the scale
            (Gemma 2's attn_logit_softcapping).

    Returns [batch, q_heads, q_len, head_dim] in q's dtype; zeros for a sequence of length 0.
    Never materializes the dequantized cache: it works tile by tile in float32."""
    op = "dgq_fused_attention"
    return torch.ops.nexuskv.dgq_fused_attention(
        q,
        list(k_cache),
        list(v_cache),
        _ints(op, "k_format", k_format),
        _ints(op, "v_format", v_format),
        compressed_lens,
        k_tail,
        v_tail,
        tail_lens,
        rotation_signs,
        _float(op, "scale", scale),
        k_sink,
        v_sink,
        sink_lens,
        _int(op, "window", window),
        _float(op, "softcap", softcap),
    )


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Randomized Hadamard rotation of the last dim n (a power of two): H (signs * x) / sqrt(n).
    Orthogonal, so q.k is unchanged when q and k are both rotated; inverse=True undoes it."""
    return torch.ops.nexuskv.hadamard_rotate(x, signs, _bool("hadamard_rotate", "inverse", inverse))


# ---- argument types ----------------------------------------------------------------------
# The dispatcher turns Python bools into ints and floats (bits=True is bits=1, scale=True is
# 1.0): the wrappers refuse a bool where a number is meant, and a number where a bool is.


def _int(op: str, name: str, v):
    if isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be an int, got bool {v}")
    return v


def _bool(op: str, name: str, v):
    if not isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(v).__name__} {v!r}")
    return v


def _ints(op: str, name: str, v):
    if any(isinstance(e, bool) for e in v):
        raise TypeError(f"{op}: {name} must hold ints, got {list(v)}")
    return list(v)


def _float(op: str, name: str, v):
    if isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be a float, got bool {v}")
    return v


def _bool(op: str, name: str, v):
    if not isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(v).__name__} {v!r}")
    return v


# ---- fake kernels --------------------------------------------------------------------------
# When every size is a concrete int, a fake kernel runs the C++ meta kernel (nexuskv_meta::<op>,
# csrc/aten/meta_kernels.cpp: the same shape/dtype checks as the real kernels, and the outputs
# they allocate) on meta copies of its inputs, outside fake mode, and returns fake tensors of
# those outputs' sizes and dtypes.  With symbolic sizes (torch.compile(dynamic=True),
# torch.export) it falls back to the shape arithmetic below.  Devices are checked here: a meta
# copy has none of its own (one meta tensor among CPU tensors dispatches here too).

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _concrete(args) -> bool:
    return all(isinstance(n, int) for t in _tensors(args) for n in (*t.shape, *t.stride()))


def _one_device(op: str, named) -> None:
    """named: (name, tensor or None) pairs; the first tensor's device is the reference."""
    named = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
    name0, t0 = named[0]
    for name, t in named[1:]:
        if t.device != t0.device:
            raise RuntimeError(
                f"{op}: all tensors must be on one device, {name0} is on {t0.device} but {name} is on {t.device}"
            )


def _meta_outputs(op: str, args, keep_aliasing: bool = False):
    """Runs nexuskv_meta::<op> on meta copies of args; its outputs (meta tensors).
    keep_aliasing: tensors that share a storage are copied as views of one meta storage
    (the same element offsets and strides), so that the meta kernel sees the overlaps the
    real kernel would."""
    storages: dict = {}
    if keep_aliasing:
        for t in _tensors(args):
            key = StorageWeakRef(t.untyped_storage())
            end = (t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
            storages[key] = max(storages.get(key, 0), end if t.numel() else 0)

    def copy(a):
        if isinstance(a, torch.Tensor):
            if not keep_aliasing:
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            key = StorageWeakRef(a.untyped_storage())
            base = storages[key]
            if not isinstance(base, torch.UntypedStorage):
                base = storages[key] = torch.empty(base, dtype=torch.uint8, device="meta").untyped_storage()
            return torch.empty(0, dtype=a.dtype, device="meta").set_(base, a.storage_offset(), a.shape, a.stride())
        if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
            return [copy(t) for t in a]
        return a

    with unset_fake_temporarily(), torch._C._DisableTorchDispatch():
        return getattr(torch.ops.nexuskv_meta, op)(*[copy(a) for a in args])


def _like(ref: torch.Tensor, outputs):
    """Fake (or meta) tensors on ref's device with the sizes and dtypes of the meta outputs."""
    if isinstance(outputs, torch.Tensor):
        return ref.new_empty(outputs.shape, dtype=outputs.dtype)
    return tuple(ref.new_empty(o.shape, dtype=o.dtype) for o in outputs)


def _check_params(op: str, bits: int, group_size: int, axis: int) -> None:
    torch._check(bits in _format.SUPPORTED_BITS, lambda: f"{op}: bits must be one of 2, 3, 4, 8, got {bits}")
    torch._check(
        1 <= group_size <= _format.MAX_GROUP_SIZE,
        lambda: f"{op}: group_size must be in [1, {_format.MAX_GROUP_SIZE}], got {group_size}",
    )
    torch._check(axis in (-2, -1), lambda: f"{op}: axis must be -2 or -1, got {axis}")


@torch.library.register_fake("nexuskv::nq_compress")
def _nq_compress_fake(x, bits, group_size, axis, num_outliers=0, meta_dtype=None, fit_range=False):
    args = (x, bits, group_size, axis, num_outliers, meta_dtype, fit_range)
    if _concrete(args):
        return _like(x, _meta_outputs("nq_compress", args))
    _check_params("nq_compress", bits, group_size, axis)
    torch._check(x.dim() >= 2, lambda: "nq_compress: x must have shape [..., tokens, head_dim]")
    torch._check(x.dtype in _FLOATS, lambda: f"nq_compress: x must be float32, float16 or bfloat16, got {x.dtype}")
    torch._check(0 <= num_outliers < group_size, lambda: "nq_compress: num_outliers must be in [0, group_size)")
    torch._check(
        meta_dtype is None or meta_dtype in _FLOATS,
        lambda: f"nq_compress: meta_dtype must be float32, float16 or bfloat16, got {meta_dtype}",
    )
    *lead, tokens, head_dim = x.shape
    a, b = _format.meta_shape(tokens, head_dim, group_size, axis)
    meta = meta_dtype or x.dtype
    return (
        x.new_empty((*lead, tokens, _format.row_bytes(bits, head_dim)), dtype=torch.uint8),
        x.new_empty((*lead, a, b), dtype=meta),
        x.new_empty((*lead, a, b), dtype=meta),
        x.new_empty((*lead, a, b, num_outliers), dtype=torch.uint8),
        x.new_empty((*lead, a, b, num_outliers), dtype=x.dtype),
    )


def _parts_named(parts):
    return list(zip(("codes", "scale", "zero", "outlier_idx", "outlier_val", "segment_starts"), parts))


@torch.library.register_fake("nexuskv::nq_decompress")
def _nq_decompress_fake(codes, scale, zero, outlier_idx, outlier_val, bits, group_size, axis, head_dim, out_dtype=None):
    _one_device("nq_decompress", _parts_named((codes, scale, zero, outlier_idx, outlier_val)))
    args = (codes, scale, zero, outlier_idx, outlier_val, bits, group_size, axis, head_dim, out_dtype)
    if _concrete(args):
        return _like(codes, _meta_outputs("nq_decompress", args))
    _check_params("nq_decompress", bits, group_size, axis)
    torch._check(codes.dtype == torch.uint8, lambda: "nq_decompress: codes must be uint8")
    torch._check(codes.dim() >= 2, lambda: "nq_decompress: codes must have shape [..., tokens, row_bytes]")
    torch._check(
        codes.shape[-1] == _format.row_bytes(bits, head_dim),
        lambda: "nq_decompress: codes row bytes do not match bits and head_dim",
    )
    *lead, tokens, _ = codes.shape
    return codes.new_empty((*lead, tokens, head_dim), dtype=out_dtype or outlier_val.dtype)


@torch.library.register_fake("nexuskv::dgq_compress")
def _dgq_compress_fake(x, bits, group_size, granule=16, max_len=None, num_outliers=0, meta_dtype=None, fit_range=False):
    args = (x, bits, group_size, granule, max_len, num_outliers, meta_dtype, fit_range)
    if _concrete(args):
        return _like(x, _meta_outputs("dgq_compress", args))
    parts = _nq_compress_fake(x, bits, group_size, -2, num_outliers, meta_dtype)
    *lead, tokens, _ = x.shape
    return (*parts, x.new_empty((*lead, _format.ceil_div(tokens, group_size)), dtype=torch.int32))


@torch.library.register_fake("nexuskv::dgq_decompress")
def _dgq_decompress_fake(
    codes, scale, zero, outlier_idx, outlier_val, segment_starts, bits, group_size, head_dim, out_dtype=None
):
    _one_device("dgq_decompress", _parts_named((codes, scale, zero, outlier_idx, outlier_val, segment_starts)))
    args = (codes, scale, zero, outlier_idx, outlier_val, segment_starts, bits, group_size, head_dim, out_dtype)
    if _concrete(args):
        return _like(codes, _meta_outputs("dgq_decompress", args))
    return _nq_decompress_fake(codes, scale, zero, outlier_idx, outlier_val, bits, group_size, -2, head_dim, out_dtype)


@torch.library.register_fake("nexuskv::dgq_fused_attention")
def _dgq_fused_attention_fake(
    q,
    k_cache,
    v_cache,
    k_format,
    v_format,
    compressed_lens,
    k_tail=None,
    v_tail=None,
    tail_lens=None,
    rotation_signs=None,
    scale=None,
    k_sink=None,
    v_sink=None,
    sink_lens=None,
    window=None,
    softcap=None,
):
    named = [("q", q)] + [("k_cache", t) for t in k_cache] + [("v_cache", t) for t in v_cache]
    named += [
        ("compressed_lens", compressed_lens),
        ("k_tail", k_tail),
        ("v_tail", v_tail),
        ("tail_lens", tail_lens),
        ("rotation_signs", rotation_signs),
        ("k_sink", k_sink),
        ("v_sink", v_sink),
        ("sink_lens", sink_lens),
    ]
    _one_device("dgq_fused_attention", named)
    args = (
        q,
        list(k_cache),
        list(v_cache),
        list(k_format),
        list(v_format),
        compressed_lens,
        k_tail,
        v_tail,
        tail_lens,
        rotation_signs,
        scale,
        k_sink,
        v_sink,
        sink_lens,
        window,
        softcap,
    )
    if _concrete(args):
        return _like(q, _meta_outputs("dgq_fused_attention", args))
    torch._check(q.dim() == 4, lambda: "dgq_fused_attention: q must have shape [batch, q_heads, q_len, head_dim]")
    torch._check(
        len(k_cache) in (5, 6) and len(v_cache) in (5, 6),
        lambda: "dgq_fused_attention: k_cache and v_cache must hold 5 or 6 tensors",
    )
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("nexuskv::hadamard_rotate")
def _hadamard_rotate_fake(x, signs, inverse=False):
    _one_device("hadamard_rotate", [("x", x), ("rotation signs", signs)])
    if _concrete((x, signs)):
        return _like(x, _meta_outputs("hadamard_rotate", (x, signs, inverse)))
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("nexuskv::static_kv_append_")
def _static_kv_append_fake(k_store, v_store, k_tail, v_tail, lengths, k, v, k_format, v_format, residual):
    named = [("k", k), ("v", v), ("k_tail", k_tail), ("v_tail", v_tail), ("lengths", lengths)]
    named += [("k_store", t) for t in k_store] + [("v_store", t) for t in v_store]
    _one_device("static_kv_append_", named)
    args = (list(k_store), list(v_store), k_tail, v_tail, lengths, k, v, list(k_format), list(v_format), residual)
    if _concrete(args):
        # The kernel's checks (it returns nothing), aliasing included: the meta copies of
        # tensors that share a storage share one meta storage, at the same offsets.
        _meta_outputs("static_kv_append_", args, keep_aliasing=True)
    return None


@torch.library.register_fake("nexuskv::paged_kv_write_")
def _paged_kv_write_fake(
    pages,
    key,
    value,
    slot_mapping,
    key_bits,
    value_bits,
    group_size,
    num_outliers=0,
    rotation_signs=None,
    key_fit_range=False,
    value_fit_range=False,
    exact_window=0,
):
    named = [("pages", pages), ("key", key), ("value", value), ("slot_mapping", slot_mapping)]
    _one_device("paged_kv_write_", named + [("rotation_signs", rotation_signs)])
    args = (
        pages,
        key,
        value,
        slot_mapping,
        key_bits,
        value_bits,
        group_size,
        num_outliers,
        rotation_signs,
        key_fit_range,
        value_fit_range,
        exact_window,
    )
    if _concrete(args):
        _meta_outputs("paged_kv_write_", args)
    return None


@torch.library.register_fake("nexuskv::paged_exact_write_")
def _paged_exact_write_fake(
    pages, key, value, slot_mapping, key_bits, value_bits, group_size, num_outliers, exact_window
):
    named = [("pages", pages), ("key", key), ("value", value), ("slot_mapping", slot_mapping)]
    _one_device("paged_exact_write_", named)
    args = (pages, key, value, slot_mapping, key_bits, value_bits, group_size, num_outliers, exact_window)
    if _concrete(args):
        _meta_outputs("paged_exact_write_", args)
    return None


@torch.library.register_fake("nexuskv::paged_attention")
def _paged_attention_fake(
    q,
    pages,
    block_table,
    seq_lens,
    query_start_loc,
    key_bits,
    value_bits,
    group_size,
    num_outliers=0,
    rotation_signs=None,
    scale=None,
    window=None,
    softcap=None,
    exact_window=0,
    key=None,
    value=None,
):
    named = [("q", q), ("pages", pages), ("block_table", block_table), ("seq_lens", seq_lens)]
    named += [("query_start_loc", query_start_loc), ("rotation_signs", rotation_signs), ("key", key), ("value", value)]
    _one_device("paged_attention", named)
    args = (
        q,
        pages,
        block_table,
        seq_lens,
        query_start_loc,
        key_bits,
        value_bits,
        group_size,
        num_outliers,
        rotation_signs,
        scale,
        window,
        softcap,
        exact_window,
        key,
        value,
    )
    if _concrete(args):
        return _like(q, _meta_outputs("paged_attention", args))
    torch._check(q.dim() == 3, lambda: "paged_attention: q must have shape [num_tokens, q_heads, head_dim]")
    return torch.empty_like(q, memory_format=torch.contiguous_format)
