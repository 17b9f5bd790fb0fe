"""KV compressors: the KVCompressor protocol, NQ (block quantization with exact
outliers) and DGQ (the same with data-chosen token groups), each optionally in
a randomized Hadamard basis.  A compressor turns a K or V tensor
[..., tokens, head_dim] into a compressed object and back, and reports the
bytes it really takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional, Protocol, runtime_checkable

import torch

from . import _format
from .ops import dgq_compress, dgq_decompress, hadamard_rotate, nq_compress, nq_decompress

__all__ = ["KVCompressor", "NQ", "DGQ", "NQTensor", "tensor_nbytes", "effective_bits", "rotation_signs",
           "DEFAULT_KEY_PER", "DEFAULT_VALUE_PER"]

# Measured by `python -m nexuskv report` on SmolLM2-135M (see README): per-channel
# keys give lower attention-output error than per-token keys at 4 and 2 bits,
# because a few key channels carry large offsets (KIVI's observation).
DEFAULT_KEY_PER = "channel"
DEFAULT_VALUE_PER = "token"

_AXIS_OF_PER = {"channel": _format.AXIS_TOKENS, "token": _format.AXIS_CHANNELS}


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rotation_signs(head_dim: int, seed: int) -> torch.Tensor:
    """The +-1 signs of the randomized Hadamard rotation, reproducible from the seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (head_dim,), generator=g).float().mul_(2).sub_(1)


@runtime_checkable
class KVCompressor(Protocol):
    """What a KV cache needs from a compressor.  ``compress`` takes a float tensor
    [..., tokens, head_dim] and returns any object; ``decompress`` inverts it;
    ``nbytes`` counts every byte that object holds (codes and all metadata).

    NQ and DGQ implement it; so can a class of your own, which then works through
    the cache (``nexuskv.hf.cache_for(model, compressor=...)``: the C++ cache hands it
    the chunks due for compression, attention runs over its ``decompress`` output).
    The C++ counterpart is ``nexuskv::KVCompressor`` (csrc/include/nexuskv/compressor.h)."""

    def compress(self, x: torch.Tensor) -> Any: ...

    def decompress(self, c: Any, dtype: Optional[torch.dtype] = None) -> torch.Tensor: ...

    def nbytes(self, c: Any) -> int: ...


def effective_bits(compressor: KVCompressor, c: Any, numel: int) -> float:
    """Bits per element, every scale, zero, index and outlier included."""
    return 8.0 * compressor.nbytes(c) / numel


@dataclass(frozen=True)
class NQTensor:
    """One NQ- or DGQ-compressed tensor: the buffers plus every format parameter needed to
    read them (bits, group_size, axis, head_dim = shape[-1], meta dtype, DGQ or not,
    rotation signs), checked against the buffers when it is made and immutable after, so
    that it cannot be read with the wrong parameters through NQ / DGQ."""

    parts: tuple  # NQParts, or DGQParts (+ segment_starts)
    bits: int
    group_size: int
    axis: int
    shape: torch.Size  # of the original tensor
    dtype: torch.dtype  # of the original tensor
    signs: Optional[torch.Tensor] = None  # [head_dim] when stored in the rotated basis
    dynamic: bool = False  # DGQ: data-chosen token groups (parts has segment_starts)
    meta_dtype: Optional[torch.dtype] = None  # of scale/zero; None: read off the parts

    def __post_init__(self):
        kind = "DGQ" if self.dynamic else "NQ"
        want = 6 if self.dynamic else 5
        if len(self.parts) != want:
            raise ValueError(f"NQTensor: a {kind} tensor has {want} parts, got {len(self.parts)}")
        meta = self.parts[1].dtype
        if self.meta_dtype is not None and self.meta_dtype != meta:
            raise ValueError(f"NQTensor: meta_dtype {self.meta_dtype} but the scales are {meta}")
        object.__setattr__(self, "meta_dtype", meta)
        object.__setattr__(self, "shape", torch.Size(self.shape))
        codes = self.parts[0]
        want_bytes = _format.row_bytes(self.bits, self.head_dim)
        if codes.shape[-1] != want_bytes or tuple(codes.shape[:-1]) != tuple(self.shape[:-1]):
            raise ValueError(f"NQTensor: codes of shape {tuple(codes.shape)} do not hold a {tuple(self.shape)} "
                             f"tensor at {self.bits} bits ({want_bytes} bytes per token)")
        if self.signs is not None and tuple(self.signs.shape) != (self.head_dim,):
            raise ValueError(f"NQTensor: rotation signs must have shape [{self.head_dim}], "
                             f"got {tuple(self.signs.shape)}")

    @property
    def head_dim(self) -> int:
        return self.shape[-1]

    @property
    def num_outliers(self) -> int:
        return self.parts[3].shape[-1]

    @property
    def format(self) -> List[int]:
        """[bits, group_size, axis], as dgq_fused_attention takes it."""
        return [self.bits, self.group_size, self.axis]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        extra = tensor_nbytes(self.signs) if self.signs is not None else 0
        return sum(tensor_nbytes(t) for t in self.parts) + extra

    @property
    def effective_bits(self) -> float:
        return 8.0 * self.nbytes / self.numel

    @property
    def bytes_ratio(self) -> float:
        """Size of the original tensor in its own dtype over the compressed size."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size() / self.nbytes


class _Quantizer:
    """What NQ and DGQ share (their fields: bits, group_size, num_outliers, meta_dtype,
    rotate = randomized Hadamard rotation of head_dim before quantization, seed of its signs)."""

    def _rotate(self, x: torch.Tensor):
        if not self.rotate:
            return x, None
        signs = rotation_signs(x.shape[-1], self.seed)
        return hadamard_rotate(x, signs), signs

    def _unrotate(self, x: torch.Tensor, c: NQTensor) -> torch.Tensor:
        return hadamard_rotate(x, c.signs, inverse=True) if c.signs is not None else x

    def _check_readable(self, c) -> None:
        """decompress(c) only for a tensor this compressor's format made."""
        name, dynamic = type(self).__name__, isinstance(self, DGQ)
        if not isinstance(c, NQTensor):
            raise TypeError(f"{name}.decompress: expected the NQTensor that {name}.compress returns, "
                            f"got {type(c).__name__}")
        if c.dynamic != dynamic:
            other = "DGQ (data-chosen token groups)" if c.dynamic else "NQ (fixed groups)"
            raise TypeError(f"{name}.decompress: this tensor was compressed by {other}; decompress it with "
                            f"{'DGQ' if c.dynamic else 'NQ'}")
        mine = dict(bits=self.bits, group_size=self.group_size, axis=self.axis, num_outliers=self.num_outliers,
                    meta_dtype=self.meta_dtype or c.dtype, rotate=self.rotate)
        theirs = dict(bits=c.bits, group_size=c.group_size, axis=c.axis, num_outliers=c.num_outliers,
                      meta_dtype=c.meta_dtype, rotate=c.signs is not None)
        wrong = [f"{k}={theirs[k]}" + f" (this {name} has {mine[k]})" for k in mine if mine[k] != theirs[k]]
        if wrong:
            raise ValueError(f"{name}.decompress: this tensor was compressed with " + ", ".join(wrong) +
                             f"; decompress it with the {name} that compressed it")

    def nbytes(self, c: NQTensor) -> int:
        return c.nbytes

    def _suffix(self) -> str:
        return ((f" k{self.num_outliers}" if self.num_outliers else "") + (" rot" if self.rotate else "")
                + (" fit" if self.fit_range else ""))


@dataclass(frozen=True)
class NQ(_Quantizer):
    """Block quantization: ``bits``-bit asymmetric codes per group of ``group_size``,
    ``num_outliers`` exact outliers per group.

    ``per="channel"``: each channel gets its own scale/zero over groups of consecutive
    tokens (KIVI's key quantization).  ``per="token"``: each token gets its own
    scale/zero over groups of consecutive channels (value quantization).
    ``rotate=True`` quantizes in a randomized Hadamard basis (spreads outlier channels).
    ``fit_range=True`` fits each group's scale and zero by least squares instead of
    min/max (ops.nq_compress; the same format and bytes)."""

    bits: int = 4
    group_size: int = 64
    per: Literal["channel", "token"] = "token"
    num_outliers: int = 0
    meta_dtype: Optional[torch.dtype] = field(default=None)
    rotate: bool = False
    seed: int = 0
    fit_range: bool = False

    def __post_init__(self):
        if self.per not in _AXIS_OF_PER:
            raise ValueError(f"NQ: per must be 'channel' or 'token', got {self.per!r}")

    @classmethod
    def for_keys(cls, bits: int = 4, group_size: int = 64, **kw) -> "NQ":
        return cls(bits=bits, group_size=group_size, per=DEFAULT_KEY_PER, **kw)

    @classmethod
    def for_values(cls, bits: int = 4, group_size: int = 64, **kw) -> "NQ":
        return cls(bits=bits, group_size=group_size, per=DEFAULT_VALUE_PER, **kw)

    @property
    def axis(self) -> int:
        return _AXIS_OF_PER[self.per]

    def compress(self, x: torch.Tensor) -> NQTensor:
        xr, signs = self._rotate(x)
        parts = nq_compress(xr, self.bits, self.group_size, self.axis, self.num_outliers, self.meta_dtype,
                            self.fit_range)
        return NQTensor(parts, self.bits, self.group_size, self.axis, x.shape, x.dtype, signs)

    def decompress(self, c: NQTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        self._check_readable(c)
        return self._unrotate(nq_decompress(*c.parts, c.bits, c.group_size, c.axis, c.head_dim, dtype), c)

    def expected_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        """Bytes of compress(x) for x of this shape and dtype, from the format alone
        (the formula documented in nq_format.h)."""
        *lead, tokens, head_dim = shape
        rows = torch.Size(lead).numel()
        a, b = _format.meta_shape(tokens, head_dim, self.group_size, self.axis)
        x_bytes = torch.empty((), dtype=dtype).element_size()
        meta_bytes = torch.empty((), dtype=self.meta_dtype or dtype).element_size()
        signs = 4 * head_dim if self.rotate else 0
        return rows * (tokens * _format.row_bytes(self.bits, head_dim)
                       + a * b * (2 * meta_bytes + self.num_outliers * (1 + x_bytes))) + signs

    def describe(self) -> str:
        return f"NQ{self.bits} g{self.group_size} per-{self.per}" + self._suffix()


@dataclass(frozen=True)
class DGQ(_Quantizer):
    """Per-channel quantization over token groups chosen from the data (dynamic groups):
    as many groups as fixed groups of ``group_size`` would make, each a whole number of
    ``granule`` tokens and at most ``max_len`` (default 2 * group_size), boundaries where
    the data's per-channel range changes.  For keys (or per-channel values).
    ``fit_range`` as for NQ."""

    bits: int = 4
    group_size: int = 64
    num_outliers: int = 0
    meta_dtype: Optional[torch.dtype] = field(default=None)
    rotate: bool = False
    seed: int = 0
    granule: int = 16
    max_len: Optional[int] = None
    fit_range: bool = False

    @property
    def axis(self) -> int:
        return _format.AXIS_TOKENS

    def compress(self, x: torch.Tensor) -> NQTensor:
        xr, signs = self._rotate(x)
        parts = dgq_compress(xr, self.bits, self.group_size, self.granule, self.max_len, self.num_outliers,
                             self.meta_dtype, self.fit_range)
        return NQTensor(parts, self.bits, self.group_size, self.axis, x.shape, x.dtype, signs, dynamic=True)

    def decompress(self, c: NQTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        self._check_readable(c)
        return self._unrotate(dgq_decompress(*c.parts, c.bits, c.group_size, c.head_dim, dtype), c)

    def describe(self) -> str:
        return f"DGQ{self.bits} g{self.group_size}/{self.granule}" + self._suffix()
