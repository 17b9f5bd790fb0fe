"""Bad inputs to nq_compress / nq_decompress: each raises RuntimeError (TypeError for a
Python bool where a number is meant) with a message that names the offending argument
(messages from csrc/aten/nq_args.cpp, ops/inference_only.cpp and nexuskv/ops.py), and the
fake kernels (torch.compile, torch.export, meta tensors) reject the same with the same message."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from nexuskv import nq_compress, nq_decompress

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def good_x(dtype=torch.float32, shape=(2, 3, 20, 64)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def good_parts(bits=4, G=8, axis=-2, k=2, shape=(2, 3, 20, 64)):
    return list(nq_compress(good_x(shape=shape), bits, G, axis, k))


# ---------------------------------------------------------------------------------------------
# nq_compress: parameters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool, torch.int8, torch.uint8])
def test_compress_wrong_dtype(dtype):
    x = torch.ones(2, 8, 16, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"nq_compress: x must be float32, float16 or bfloat16, got"):
        nq_compress(x, 4, 8, -1)


@pytest.mark.parametrize("bits", [1, 5, 16, 0, -4, 7])
def test_compress_unsupported_bits(bits):
    with pytest.raises(RuntimeError, match=rf"nq_compress: bits must be one of 2, 3, 4, 8, got {bits}"):
        nq_compress(good_x(), bits, 8, -1)


@pytest.mark.parametrize("group_size", [0, -1, -64, 257, 1024])
def test_compress_bad_group_size(group_size):
    with pytest.raises(RuntimeError, match=rf"nq_compress: group_size must be in \[1, 256\], got {group_size}"):
        nq_compress(good_x(), 4, group_size, -2)


@pytest.mark.parametrize("group_size,num_outliers", [(8, 8), (8, 9), (1, 1), (256, 256), (8, -1), (64, -5)])
def test_compress_bad_num_outliers(group_size, num_outliers):
    with pytest.raises(
        RuntimeError,
        match=r"nq_compress: num_outliers must be in \[0, group_size\) = "
        rf"\[0, {group_size}\), got {num_outliers}",
    ):
        nq_compress(good_x(), 4, group_size, -1, num_outliers)


def test_compress_group_bounds_accepted():
    # The boundaries of the valid ranges work (contrast for the rejections above).
    x = good_x()
    nq_compress(x, 4, 1, -1, 0)
    nq_compress(x, 4, 256, -2, 255)


@pytest.mark.parametrize("axis", [0, 1, -3, 2, -4])
def test_compress_bad_axis(axis):
    with pytest.raises(RuntimeError, match=rf"nq_compress: axis must be -2 .* or -1 .*, got {axis}"):
        nq_compress(good_x(), 4, 8, axis)


@pytest.mark.parametrize("shape", [(0, 8, 16), (2, 0, 16), (2, 8, 0), (0, 16), (16, 0), (3, 0, 0, 4)])
def test_compress_empty(shape):
    with pytest.raises(RuntimeError, match=r"nq_compress: x must not be empty, got shape"):
        nq_compress(torch.empty(shape), 4, 8, -1)


@pytest.mark.parametrize("shape", [(16,), (), (0,)])
def test_compress_too_few_dims(shape):
    with pytest.raises(
        RuntimeError,
        match=r"nq_compress: x must have shape \[\.\.\., tokens, head_dim\] "
        r"\(at least 2 dims\)",
    ):
        nq_compress(torch.zeros(shape), 4, 8, -1)


def test_compress_bad_meta_dtype():
    with pytest.raises(RuntimeError, match=r"nq_compress: meta_dtype must be float32, float16 or bfloat16"):
        nq_compress(good_x(), 4, 8, -1, 0, torch.int32)
    with pytest.raises(RuntimeError, match=r"nq_compress: meta_dtype must be float32, float16 or bfloat16"):
        nq_compress(good_x(), 4, 8, -1, 0, torch.float64)


# ---------------------------------------------------------------------------------------------
# nq_compress: values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("k", [0, 2])
def test_compress_non_finite(dtype, axis, bad, k):
    x = good_x(dtype)
    x[1, 2, 17, 63] = bad  # in the last (partial for axis=-2, G=8) group; with k=2 it may be an outlier
    with pytest.raises(RuntimeError, match=r"nq_compress: x contains NaN or Inf"):
        nq_compress(x, 4, 8, axis, k)


def test_compress_non_finite_non_contiguous():
    x = good_x().transpose(1, 2).contiguous().transpose(1, 2)
    x[0, 0, 0, 5] = math.nan
    assert not x.is_contiguous()
    with pytest.raises(RuntimeError, match=r"NaN or Inf"):
        nq_compress(x, 2, 16, -2)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("axis", [-2, -1])
def test_compress_meta_float16_overflow_range(bits, axis):
    # A group holding 1e6 and values near 0: scale = 1e6 / qmax > 65504 does not fit fp16.
    x = good_x()
    x[0, 0, 0, 0] = 1e6
    with pytest.raises(
        RuntimeError,
        match=r"nq_compress: a group's scale or zero does not fit in meta_dtype "
        r"Half .*use meta_dtype=float32 or bfloat16",
    ):
        nq_compress(x, bits, 8, axis, 0, torch.float16)
    # The same tensor with the default (float32) meta dtype is fine.
    nq_compress(x, bits, 8, axis, 0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_compress_meta_float16_overflow_zero(bits):
    # min = -1e6 rounded down into fp16 is -inf: zero does not fit.
    x = good_x()
    x[1, 1, 3, 7] = -1e6
    with pytest.raises(RuntimeError, match=r"does not fit in meta_dtype Half"):
        nq_compress(x, bits, 8, -1, 0, torch.float16)


def test_compress_large_value_as_outlier_fits_float16_meta():
    # With the 1e6 taken as an exact outlier the remaining group fits fp16 meta.
    x = good_x()
    x[0, 0, 0, 0] = 1e6
    p = nq_compress(x, 4, 8, -1, 1, torch.float16)
    assert torch.isfinite(p.scale).all() and 1e6 in p.outlier_val


# ---------------------------------------------------------------------------------------------
# nq_decompress: parameters and mismatched tensors
# ---------------------------------------------------------------------------------------------


def decompress(parts, bits=4, G=8, axis=-2, head_dim=64, out_dtype=None):
    return nq_decompress(*parts, bits, G, axis, head_dim, out_dtype)


def test_decompress_good_parts_work():
    assert decompress(good_parts()).shape == (2, 3, 20, 64)


@pytest.mark.parametrize("bits", [1, 5, 16])
def test_decompress_bad_bits(bits):
    with pytest.raises(RuntimeError, match=r"nq_decompress: bits must be one of 2, 3, 4, 8"):
        decompress(good_parts(), bits=bits)


@pytest.mark.parametrize("G", [0, -8, 257])
def test_decompress_bad_group_size(G):
    with pytest.raises(RuntimeError, match=r"nq_decompress: group_size must be in \[1, 256\]"):
        decompress(good_parts(), G=G)


@pytest.mark.parametrize("axis", [0, 1, -3])
def test_decompress_bad_axis(axis):
    with pytest.raises(RuntimeError, match=r"nq_decompress: axis must be -2"):
        decompress(good_parts(), axis=axis)


@pytest.mark.parametrize("head_dim", [0, -64])
def test_decompress_bad_head_dim(head_dim):
    with pytest.raises(RuntimeError, match=r"nq_decompress: head_dim must be positive"):
        decompress(good_parts(), head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.float32])
def test_decompress_codes_wrong_dtype(dtype):
    parts = good_parts()
    parts[0] = parts[0].to(dtype)
    with pytest.raises(RuntimeError, match=r"nq_decompress: codes must be uint8"):
        decompress(parts)


def test_decompress_codes_row_bytes_mismatch():
    parts = good_parts()  # 4 bits, head_dim 64: 32 bytes per token
    with pytest.raises(
        RuntimeError,
        match=r"nq_decompress: codes has 32 bytes per token, but bits=2 and "
        r"head_dim=64 pack into 16",
    ):
        decompress(parts, bits=2)
    with pytest.raises(RuntimeError, match=r"codes has 32 bytes per token, but bits=4 and head_dim=96 pack into 48"):
        decompress(parts, head_dim=96)
    parts[0] = parts[0][..., :16]
    with pytest.raises(RuntimeError, match=r"codes has 16 bytes per token"):
        decompress(parts)


def test_decompress_codes_bad_rank_or_empty():
    parts = good_parts()
    codes = parts[0]
    parts[0] = codes.reshape(-1)
    with pytest.raises(RuntimeError, match=r"nq_decompress: codes must have shape \[\.\.\., tokens, row_bytes\]"):
        decompress(parts)
    parts[0] = codes[:, :, :0]
    with pytest.raises(RuntimeError, match=r"nq_decompress: codes must not be empty"):
        decompress(parts)


@pytest.mark.parametrize("which,index", [("scale", 1), ("zero", 2)])
def test_decompress_meta_wrong_shape(which, index):
    parts = good_parts()
    for bad in (parts[index][..., :-1], parts[index][0], parts[index].unsqueeze(0), parts[index][:, :, :1]):
        p = list(parts)
        p[index] = bad
        with pytest.raises(
            RuntimeError,
            match=rf"nq_decompress: {which} must have shape \[2, 3, 3, 64\] "
            r"\(from codes and the format parameters\)",
        ):
            decompress(p)


def test_decompress_meta_shape_from_other_axis():
    # Parts made with axis=-2 read as axis=-1: the meta shape no longer matches.
    with pytest.raises(RuntimeError, match=r"nq_decompress: scale must have shape \[2, 3, 20, 8\]"):
        decompress(good_parts(), axis=-1)


def test_decompress_meta_dtypes_differ():
    parts = good_parts()
    parts[2] = parts[2].half()
    with pytest.raises(RuntimeError, match=r"nq_decompress: zero must have scale's dtype Float, got Half"):
        decompress(parts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8])
def test_decompress_scale_wrong_dtype(dtype):
    parts = good_parts()
    parts[1], parts[2] = parts[1].to(dtype), parts[2].to(dtype)
    with pytest.raises(RuntimeError, match=r"nq_decompress: scale must be float32, float16 or bfloat16"):
        decompress(parts)


def test_decompress_outlier_idx_wrong_shape():
    parts = good_parts()
    for bad in (parts[3][..., :1], parts[3][:, :, :2], parts[3][0]):
        p = list(parts)
        p[3] = bad
        with pytest.raises(RuntimeError, match=r"nq_decompress: (outlier_idx|outlier_val|scale) must have shape"):
            decompress(p)
    p = list(parts)
    p[3] = parts[3][:, :, :2]  # wrong A: named as outlier_idx
    with pytest.raises(RuntimeError, match=r"nq_decompress: outlier_idx must have shape \[2, 3, 3, 64, 2\]"):
        decompress(p)
    p[3] = torch.tensor(0, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"nq_decompress: outlier_idx must have shape \[\.\.\., A, B, k\]"):
        decompress(p)


def test_decompress_outlier_idx_k_too_large():
    parts = good_parts(G=2, k=1)
    parts[3] = torch.zeros(*parts[3].shape[:-1], 2, dtype=torch.uint8)
    with pytest.raises(
        RuntimeError,
        match=r"nq_decompress: num_outliers must be in \[0, group_size\) = \[0, 2\), "
        r"got 2",
    ):
        decompress(parts, G=2)


def test_decompress_outlier_val_k_differs_from_idx():
    parts = good_parts()
    parts[4] = parts[4][..., :1]
    with pytest.raises(RuntimeError, match=r"nq_decompress: outlier_val must have shape \[2, 3, 3, 64, 2\]"):
        decompress(parts)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.float32])
def test_decompress_outlier_idx_wrong_dtype(dtype):
    parts = good_parts()
    parts[3] = parts[3].to(dtype)
    with pytest.raises(RuntimeError, match=r"nq_decompress: outlier_idx must be uint8"):
        decompress(parts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8])
def test_decompress_outlier_val_wrong_dtype(dtype):
    parts = good_parts()
    parts[4] = parts[4].to(dtype)
    with pytest.raises(RuntimeError, match=r"nq_decompress: outlier_val must be float32, float16 or bfloat16"):
        decompress(parts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_decompress_bad_out_dtype(dtype):
    with pytest.raises(RuntimeError, match=r"nq_decompress: out_dtype must be float32, float16 or bfloat16"):
        decompress(good_parts(), out_dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_decompress_tensors_on_different_devices():
    parts = good_parts()
    parts[1] = parts[1].cuda()
    with pytest.raises(RuntimeError, match=r"device"):
        decompress(parts)


@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("bad", [8, 9, 255])
def test_decompress_corrupt_outlier_idx_beyond_group(axis, bad):
    parts = good_parts(axis=axis, G=8, k=2)
    head_dim = 64
    for where in ((0, 0, 0, 0, 0), (1, 2, -1, -1, 1)):  # first and last group of the tensor
        p = [t.clone() for t in parts]
        p[3][where] = bad
        # Guard bytes around the output would not catch a stray write; the op must refuse.
        with pytest.raises(RuntimeError, match=r"nq_decompress: outlier_idx holds a position outside its group"):
            decompress(p, axis=axis, head_dim=head_dim)


@pytest.mark.parametrize("axis", [-2, -1])
def test_decompress_corrupt_outlier_idx_beyond_partial_group(axis):
    # The last group along the grouped axis is partial: 20 tokens = 2*8 + 4 (axis -2),
    # 60 channels = 7*8 + 4 (axis -1).  Positions 4..7 are inside group_size but outside that group.
    shape = (2, 3, 20, 60)
    parts = good_parts(axis=axis, G=8, k=2, shape=shape)
    decompress(parts, axis=axis, head_dim=60)  # uncorrupted: fine
    p = [t.clone() for t in parts]
    if axis == -2:
        p[3][1, 2, -1, 5, 1] = 4  # token 16 + 4 = 20: past the end of the tensor
    else:
        p[3][1, 2, -1, -1, 1] = 6  # channel 56 + 6 = 62 >= 60: past the end of the row
    with pytest.raises(RuntimeError, match=r"outlier_idx holds a position outside its group"):
        decompress(p, axis=axis, head_dim=60)


# ---------------------------------------------------------------------------------------------
# Inference only
# ---------------------------------------------------------------------------------------------


def test_compress_requires_grad_rejected_under_grad_mode():
    x = good_x().requires_grad_()
    with pytest.raises(RuntimeError, match=r"nq_compress is inference-only .*argument 'x' requires grad"):
        nq_compress(x, 4, 8, -2)
    with torch.no_grad():
        p = nq_compress(x, 4, 8, -2, 1)
    assert not any(t.requires_grad for t in p)
    with torch.inference_mode():
        nq_compress(x, 4, 8, -2)
    # Not requiring grad: fine with grad mode on.
    nq_compress(x.detach(), 4, 8, -2)


@pytest.mark.parametrize("index,name", [(1, "scale"), (2, "zero"), (4, "outlier_val")])
def test_decompress_requires_grad_rejected_under_grad_mode(index, name):
    parts = good_parts()
    parts[index] = parts[index].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=rf"nq_decompress is inference-only .*argument '{name}' requires grad"):
        decompress(parts)
    with torch.no_grad():
        y = decompress(parts)
    assert not y.requires_grad
    with torch.inference_mode():
        decompress(parts)


# ---------------------------------------------------------------------------------------------
# Fake (meta) kernels reject what the real kernels reject, with the same message (issue 8,
# items 9, 10, 11, 16): the fake kernels run the C++ checks of the real ones
# ---------------------------------------------------------------------------------------------


def real_error(fn, args):
    with pytest.raises((RuntimeError, TypeError)) as e:
        fn(*args)
    return str(e.value).splitlines()[0]


def on_meta(args):
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, args)


def fake_error(fn, args):
    with FakeTensorMode() as mode:
        fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args)
        with pytest.raises((RuntimeError, TypeError)) as e:
            fn(*fake)
    return str(e.value).splitlines()[0]


def meta_error(fn, args):
    with pytest.raises((RuntimeError, TypeError)) as e:
        fn(*on_meta(args))
    return str(e.value).splitlines()[0]


def bad_compress_cases():
    x = good_x()
    return {
        "empty x": (x[:, :, :0], 4, 8, -1),
        "int32 meta_dtype": (x, 4, 8, -1, 0, torch.int32),
        "bits 2**32+4": (x, 2**32 + 4, 8, -1),
        "group 2**32+8": (x, 4, 2**32 + 8, -1),
        "outliers 2**32": (x, 4, 8, -1, 2**32),
        "int x": (x.long(), 4, 8, -1),
        "bool x": (x > 0, 4, 8, -1),
        "complex x": (x.to(torch.complex64), 4, 8, -1),
        "1-D x": (x.reshape(-1), 4, 8, -1),
    }


def bad_decompress_cases():
    parts = good_parts()
    mismatched = list(parts)
    mismatched[1] = parts[1][..., :-1]
    per_token = list(nq_compress(good_x(), 4, 16, -2))
    return {
        "mismatched scale": (*mismatched, 4, 8, -2, 64),
        "bits 2**32+4": (*parts, 2**32 + 4, 8, -2, 64),
        "4-bit D=64 read as 2-bit D=128": (*per_token, 2, 16, -2, 128),
        "group 16 read as 8": (*per_token, 4, 8, -2, 64),
        "zero of another dtype": (*parts[:2], parts[2].half(), *parts[3:], 4, 8, -2, 64),
        "complex out_dtype": (*parts, 4, 8, -2, 64, torch.complex64),
    }


@pytest.mark.parametrize("case", sorted(bad_compress_cases()))
def test_fake_compress_rejects_what_the_kernel_rejects(case):
    args = bad_compress_cases()[case]
    want = real_error(nq_compress, args)
    assert fake_error(nq_compress, args) == want
    assert meta_error(nq_compress, args) == want


@pytest.mark.parametrize("case", sorted(bad_decompress_cases()))
def test_fake_decompress_rejects_what_the_kernel_rejects(case):
    args = bad_decompress_cases()[case]
    want = real_error(nq_decompress, args)
    assert fake_error(nq_decompress, args) == want
    assert meta_error(nq_decompress, args) == want


@pytest.mark.parametrize(
    "index,name", [(0, "codes"), (1, "scale"), (2, "zero"), (3, "outlier_idx"), (4, "outlier_val")]
)
def test_decompress_one_meta_tensor_among_cpu_tensors(index, name):
    # Once returned uninitialized memory: the meta tensor sent the call to the fake kernel.
    parts = good_parts()
    parts[index] = parts[index].to("meta")
    with pytest.raises(
        RuntimeError,
        match=rf"nq_decompress: all tensors must be on one device, .*{name} is on "
        r"(meta|cpu)",
    ):
        decompress(parts)


def test_decompress_format_mismatches_detected_from_sizes():
    # What the buffers' sizes reveal is an error (the rest is documented in nq_decompress).
    x = good_x()
    with pytest.raises(RuntimeError, match=r"scale must have shape \[2, 3, 2, 128\]"):
        decompress(list(nq_compress(x, 4, 16, -2)), bits=2, G=16, head_dim=128)
    with pytest.raises(RuntimeError, match=r"scale must have shape \[2, 3, 20, 5\]"):
        decompress(list(nq_compress(x, 4, 16, -1)), bits=4, G=15, axis=-1, head_dim=64)


@pytest.mark.parametrize("kw", [dict(bits=True), dict(group_size=True), dict(axis=True), dict(num_outliers=True)])
def test_compress_bool_where_an_int_is_meant(kw):
    # The dispatcher would read True as 1 (group_size=True quantized in groups of one).
    args = dict(bits=4, group_size=8, axis=-1, num_outliers=0) | kw
    name = next(iter(kw))
    with pytest.raises(TypeError, match=rf"nq_compress: {name} must be an int, got bool True"):
        nq_compress(good_x(), **args)


def test_decompress_bool_where_an_int_is_meant():
    with pytest.raises(TypeError, match=r"nq_decompress: head_dim must be an int, got bool"):
        nq_decompress(*good_parts(), 4, 8, -2, True)


@pytest.mark.parametrize(
    "bad,match",
    [
        (2**32 + 4, "bits must be one of 2, 3, 4, 8, got 4294967300"),
        (-(2**63), "bits must be one of"),
        (2**31 + 4, "got 2147483652"),
    ],
)
def test_int64_arguments_checked_before_narrowing(bad, match):
    with pytest.raises(RuntimeError, match=match):
        nq_compress(good_x(), bad, 8, -1)
    with pytest.raises(RuntimeError, match=match):
        decompress(good_parts(), bits=bad)


def test_range_beyond_float32_has_a_true_message():
    # Finite float32 values whose range overflows float32: once "does not fit in meta_dtype Float
    # ... use meta_dtype=float32" (it was float32).
    x = torch.tensor([[-3e38, 3e38, 1.0, 2.0]])
    for axis, G in ((-1, 4), (-2, 1)):
        with pytest.raises(RuntimeError, match=r"nq_compress: a group's range max - min overflows float32"):
            nq_compress(x if axis == -1 else x.T.contiguous(), 4, 4 if axis == -1 else 4, axis)
    # Values within float32 range whose range fits are fine, and so is a huge outlier taken out.
    nq_compress(torch.tensor([[1e38, 2e38, 3e38, 1.0]]), 4, 4, -1)
    p = nq_compress(x, 4, 4, -1, 2)
    assert torch.isfinite(p.scale).all()
