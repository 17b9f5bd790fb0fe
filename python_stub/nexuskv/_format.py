"""Sizes of the NQ format, mirrored from csrc/include/nexuskv/core/nq_format.h
(the one place the byte layout is documented).  Used by the fake kernels and
the byte accounting; works on plain ints and on torch SymInts."""

from __future__ import annotations

SUPPORTED_BITS = (2, 3, 4, 8)
MAX_GROUP_SIZE = 256  # outlier_idx is one byte
AXIS_TOKENS = -2  # groups of consecutive tokens, one scale per channel (keys)
AXIS_CHANNELS = -1  # groups of consecutive channels, one scale per token (values)


def ceil_div(a, b):
    return -(-a // b)


def chunk_channels(bits: int) -> int:
    return 16 if bits == 8 else 32 if bits == 4 else 64


def chunk_bytes(bits: int) -> int:
    return 24 if bits == 3 else 16


def row_bytes(bits: int, head_dim):
    """Bytes of one packed token row of head_dim codes."""
    return ceil_div(head_dim, chunk_channels(bits)) * chunk_bytes(bits)


def meta_shape(tokens, head_dim, group_size: int, axis: int):
    """(A, B): the trailing dims of scale/zero for one row."""
    if axis == AXIS_TOKENS:
        return ceil_div(tokens, group_size), head_dim
    return tokens, ceil_div(head_dim, group_size)
