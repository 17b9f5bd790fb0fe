"""The static compressed cache (nexuskv.static_cache, operator static_kv_append_): it holds
exactly what the dynamic cache holds for the same settings (the same codes, the same tail,
so attention equal to the bit), attention over it matches a float64 reference over its own
dense view, a call that raises stores nothing, the fake kernel checks what the kernel
checks, and a step compiles with fullgraph=True, exports with torch.export and runs from an
AOTInductor package with the same results as eager."""

import pytest
import torch
from test_cache import attention_f64

from nexuskv import nq_decompress
from nexuskv.cache import make_cache
from nexuskv.static_cache import StaticKVCache
from nq_reference import reference_dequantize

B, H, HQ, D = 2, 2, 4, 64
STEPS = [45, 1, 1, 3, 20, 1, 17, 1, 1, 16, 1]

CONFIGS = {
    "nq4": dict(),
    "nq2-outliers": dict(bits=2, outliers=2),
    "nq8-v24": dict(bits=8, value_bits=4, value_group_size=32),
    "dgq": dict(dynamic_keys=True),
    "window": dict(window=24),
    "residual0": dict(residual=0),
}


def _dynamic_twin(kw):
    kw = dict(kw)
    return make_cache(
        key_bits=kw.get("bits", 4),
        value_bits=kw.get("value_bits", kw.get("bits", 4)),
        key_group_size=16,
        value_group_size=kw.get("value_group_size", 16),
        key_outliers=kw.get("outliers", 0),
        value_outliers=kw.get("outliers", 0),
        key_dynamic=kw.get("dynamic_keys", False),
        residual=kw.get("residual", 8),
        window=kw.get("window"),
    )


def _static(kw, dtype=torch.float32, max_tokens=256):
    kw = dict(kw)
    kw.setdefault("residual", 8)
    return StaticKVCache(B, H, D, max_tokens, dtype, group_size=16, **kw)


def _steps(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    for n in STEPS:
        yield (
            torch.randn(B, HQ, n, D, generator=g).to(dtype),
            torch.randn(B, H, n, D, generator=g).to(dtype),
            torch.randn(B, H, n, D, generator=g).to(dtype),
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_holds_what_the_dynamic_cache_holds(name):
    kw = CONFIGS[name]
    static, dynamic = _static(kw), _dynamic_twin(kw)
    for q, k, v in _steps():
        out = static(q, k, v)
        dynamic.append(k, v, None)
        ref = dynamic.attend(q, None, None)
        if kw.get("window") is None:  # same buffers and kernel: equal to the bit
            assert torch.equal(out, ref), name
        else:  # the dynamic cache evicts what the window hides (other buffer offsets)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    comp, tail = static.lengths
    assert comp.min() > 0, "nothing was compressed"
    if kw.get("window") is None:
        assert comp.tolist() == dynamic.compressed_lengths().tolist()
    assert (static.seq_lengths() == sum(STEPS)).all()
    assert (tail >= static.residual).all() and (tail < static.residual + static.chunk).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_matches_float64_over_its_own_dense_view(dtype):
    static = _static(dict(outliers=1), dtype)
    for q, k, v in _steps(dtype, seed=1):
        out = static(q, k, v)
    comp, tail = (int(x) for x in static.lengths[:, 0])
    K = torch.cat(
        [
            nq_decompress(
                static.k_codes,
                static.k_scale,
                static.k_zero,
                static.k_outlier_idx,
                static.k_outlier_val,
                4,
                16,
                -2,
                D,
                torch.float32,
            )[:, :, :comp],
            static.k_tail[:, :, :tail].float(),
        ],
        2,
    )
    V = torch.cat(
        [
            nq_decompress(
                static.v_codes,
                static.v_scale,
                static.v_zero,
                static.v_outlier_idx,
                static.v_outlier_val,
                4,
                16,
                -1,
                D,
                torch.float32,
            )[:, :, :comp],
            static.v_tail[:, :, :tail].float(),
        ],
        2,
    )
    ref = attention_f64(q, K, V, [comp + tail] * B, D**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert float((out.double() - ref).abs().max()) < tol
    # the tail holds the newest tokens exactly
    assert torch.equal(static.k_tail[:, :, :tail], k[:, :, -tail:]) if tail <= k.shape[2] else True


def test_a_call_that_raises_stores_nothing():
    static = _static({}, max_tokens=64)
    static.append(torch.randn(B, H, 40, D), torch.randn(B, H, 40, D))
    before = {n: t.clone() for n, t in static.named_buffers()}
    bad = torch.randn(B, H, 1, D)
    bad[1, 0, 0, 3] = float("nan")
    with pytest.raises(RuntimeError, match="k and v must be finite"):
        static.append(bad, torch.randn(B, H, 1, D))
    with pytest.raises(RuntimeError, match="static cache is full"):  # 100 tokens: 80 to compress, 64 slots
        static.append(torch.randn(B, H, 60, D), torch.randn(B, H, 60, D))
    for n, t in static.named_buffers():
        assert torch.equal(t, before[n]), n


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(k=a["k"].half()), "k and v must be float32, float16 or bfloat16 of one dtype"),
        (lambda a: a.update(v=a["v"][:, :, :0]), "v must have k's shape"),
        (lambda a: a.update(k=a["k"][0], v=a["v"][0]), r"k must have shape \[batch, kv_heads, tokens, head_dim\]"),
        (
            lambda a: a.update(k=torch.randn(3, H, 1, D), v=torch.randn(3, H, 1, D)),
            r"k and v have batch 3 and kv_heads 2 .* but k_store holds codes of shape",
        ),
        (lambda a: a.update(lengths=a["lengths"].int()), r"lengths must be int64 \[2, batch=2\]"),
        (lambda a: a.update(k_tail=a["k_tail"][:, :, :3]), "k_tail and v_tail must have one capacity"),
        (
            lambda a: a.update(k_tail=a["k_tail"][:, :, :3], v_tail=a["v_tail"][:, :, :3]),
            "k_tail and v_tail must hold residual \\+ chunk - 1 = 23 tokens",
        ),
        (lambda a: a.update(k_format=[5, 16, -2]), "bits must be one of 2, 3, 4, 8"),
        (lambda a: a.update(k_format=[4, 32, -2]), "k_store: scale must have shape"),
        (lambda a: a.update(residual=-1), "residual must be >= 0"),
        (lambda a: a.update(k_store=a["k_store"][:4]), "k_store must hold the 5 tensors"),
        (lambda a: a.update(k=a["k"].to("meta"), v=a["v"].to("meta")), "all tensors must be on one device"),
    ],
)
def test_bad_input_is_a_clear_error_in_the_kernel_and_the_fake(mutate, match):
    from torch._subclasses.fake_tensor import FakeTensorMode

    static = _static({})
    args = dict(
        k_store=static._k_store(),
        v_store=static._v_store(),
        k_tail=static.k_tail,
        v_tail=static.v_tail,
        lengths=static.lengths,
        k=torch.randn(B, H, 1, D),
        v=torch.randn(B, H, 1, D),
        k_format=static.k_format,
        v_format=static.v_format,
        residual=static.residual,
    )
    mutate(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.nexuskv.static_kv_append_(**args)
    assert int(static.lengths.sum()) == 0
    if args["k"].device.type == "meta":
        return
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=match):
        fake = {
            n: mode.from_tensor(t)
            if isinstance(t, torch.Tensor)
            else [mode.from_tensor(x) for x in t]
            if isinstance(t, list) and isinstance(t[0], torch.Tensor)
            else t
            for n, t in args.items()
        }
        torch.ops.nexuskv.static_kv_append_(**fake)


def test_constructor_arguments_are_checked():
    for kw, match in [
        (dict(batch=0), "batch must be a positive int"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(residual=-2), "residual must be an int >= 0"),
        (dict(window=0), "window must be"),
        (dict(device="meta"), "runs on the CPU only"),
        (dict(bits=5), "bits must be one of"),
    ]:
        args = dict(batch=B, kv_heads=H, head_dim=D, max_tokens=64) | kw
        with pytest.raises((ValueError, RuntimeError), match=match):
            StaticKVCache(**args)


def test_opcheck():
    static = _static({})
    static.append(torch.randn(B, H, 30, D), torch.randn(B, H, 30, D))
    args = (
        static._k_store(),
        static._v_store(),
        static.k_tail,
        static.v_tail,
        static.lengths,
        torch.randn(B, H, 3, D),
        torch.randn(B, H, 3, D),
        static.k_format,
        static.v_format,
        static.residual,
    )
    # test_aot_dispatch_dynamic would run the op twice on the same buffers: the other
    # utils check the schema's mutation annotations, the fake kernel and the dispatcher.
    torch.library.opcheck(
        torch.ops.nexuskv.static_kv_append_.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def _decode(module, steps=24, seed=2):
    g = torch.Generator().manual_seed(seed)
    outs = []
    with torch.inference_mode():
        for n in [40] + [1] * steps:
            q, k, v = (
                torch.randn(1, HQ, n, D, generator=g),
                torch.randn(1, H, n, D, generator=g),
                torch.randn(1, H, n, D, generator=g),
            )
            outs.append(module(q, k, v))
    return outs


def test_a_step_compiles_with_fullgraph_and_equals_eager():
    torch._dynamo.reset()
    eager = StaticKVCache(1, H, D, 256, group_size=16, residual=8)
    compiled = StaticKVCache(1, H, D, 256, group_size=16, residual=8)
    step = torch.compile(compiled, fullgraph=True)
    for a, b in zip(_decode(eager), _decode(step)):
        assert torch.equal(a, b)
    assert compiled.lengths.tolist() == eager.lengths.tolist() and eager.lengths[0, 0] > 0


def test_export_and_aot_inductor_package_keep_state_and_results(tmp_path):
    cache = StaticKVCache(1, H, D, 256, group_size=16, residual=8)
    q, k, v = torch.randn(1, HQ, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    program = torch.export.export(cache, (q, k, v))
    mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert {"k_codes", "k_scale", "v_codes", "k_tail", "lengths"} <= mutated
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "step.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    ref = StaticKVCache(1, H, D, 256, group_size=16, residual=8)
    g = torch.Generator().manual_seed(3)
    for _ in range(40):  # crosses two chunk boundaries: compressions inside the package
        q, k, v = (
            torch.randn(1, HQ, 1, D, generator=g),
            torch.randn(1, H, 1, D, generator=g),
            torch.randn(1, H, 1, D, generator=g),
        )
        assert torch.equal(runner(q, k, v), ref(q, k, v))
    assert ref.lengths[0, 0] == 32


# ---- DGQ keys: the segment invariant (unused slots hold the compressed length) -----------


def _dense_view(static):
    """[B, H, L, D] float64 of what the cache holds (its compressed rows through the
    independent reference decoder, then its tail; zeros past each sequence's length), and
    the lengths per sequence."""
    (kb, kg), (vb, vg) = static.k_format[:2], static.v_format[:2]
    K, V, lens = [], [], []
    for b in range(static.lengths.shape[1]):
        comp, tail = (int(x) for x in static.lengths[:, b])
        k_c = v_c = torch.zeros(1, H, 0, D, dtype=torch.float64)
        if comp:
            k_parts = [t[b : b + 1, :, : comp if i == 0 else comp // kg] for i, t in enumerate(static._k_store())]
            k_c = reference_dequantize(k_parts[:5], kb, kg, -2, D, k_parts[5] if static._dynamic else None)
            v_c = reference_dequantize([t[b : b + 1, :, :comp] for t in static._v_store()], vb, vg, -1, D)
        K.append(torch.cat([k_c, static.k_tail[b : b + 1, :, :tail].double()], 2))
        V.append(torch.cat([v_c, static.v_tail[b : b + 1, :, :tail].double()], 2))
        lens.append(comp + tail)
    pad = max(lens)
    K = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, pad - x.shape[2])) for x in K])
    V = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, pad - x.shape[2])) for x in V])
    return K, V, lens


def _matches_its_dense_view(static, q):
    K, V, lens = _dense_view(static)
    ref = attention_f64(q, K, V, lens, D**-0.5)
    assert float((static.attend(q).double() - ref).abs().max()) < 1e-4


# max_tokens 512: a capacity of more than 256 tokens (one segment's most) needs the
# attention operator to length-check only the segments that hold compressed tokens.
@pytest.mark.parametrize("max_tokens", [64, 512])
def test_dgq_keys_attend_before_the_first_compression_after_it_and_after_reset(max_tokens):
    g = torch.Generator().manual_seed(5)
    static = StaticKVCache(B, H, D, max_tokens, group_size=16, residual=8, dynamic_keys=True)
    assert not static.k_segment_starts.any()  # an empty cache: every slot holds 0
    for _ in range(2):  # before and after reset()
        for n in [10, 1, 3]:  # all in the tail: nothing compressed yet
            static.append(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g))
            _matches_its_dense_view(static, torch.randn(B, HQ, 2, D, generator=g))
        assert static.lengths[0].sum() == 0
        static.append(torch.randn(B, H, 30, D, generator=g), torch.randn(B, H, 30, D, generator=g))
        comp = int(static.lengths[0, 0])
        assert comp == 32
        assert (static.k_segment_starts[:, :, comp // 16 :] == comp).all()  # the unused slots
        _matches_its_dense_view(static, torch.randn(B, HQ, 1, D, generator=g))
        static.reset()
        assert static.lengths.sum() == 0 and not static.k_segment_starts.any()


# ---- buffers the op writes must own their memory -------------------------------------------


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(v_tail=a["k_tail"]), "v_tail must not share memory with k_tail"),
        (
            lambda a: a.update(v_store=[a["k_store"][0]] + a["v_store"][1:]),
            r"v_store\[0\] \(codes\) must not share memory with k_store\[0\] \(codes\)",
        ),
        (
            lambda a: a.update(k_store=a["k_store"][:2] + [a["k_store"][1]] + a["k_store"][3:]),
            r"k_store\[2\] \(zero\) must not share memory with k_store\[1\] \(scale\)",
        ),
        (  # k_scale [2, 2, 16, 64] and v_scale [2, 2, 256, 4] have one size: one buffer for both
            lambda a: a.update(v_store=a["v_store"][:1] + [a["k_store"][1].view(B, H, 256, 4)] + a["v_store"][2:]),
            r"v_store\[1\] \(scale\) must not share memory with k_store\[1\] \(scale\)",
        ),
        (  # two tails that overlap in part, cut from one tensor
            lambda a: a.update(
                k_tail=(t := torch.zeros(B, H, 30, D))[:, :, :23],
                v_tail=t[:, :, 7:],
            ),
            "v_tail must not share memory with k_tail",
        ),
        (
            lambda a: a.update(k_store=[a["k_store"][0][:, :1].expand(B, H, -1, -1)] + a["k_store"][1:]),
            r"k_store\[0\] \(codes\) has elements that share memory",
        ),
        (
            lambda a: a.update(lengths=torch.zeros(2, 1, dtype=torch.long).expand(2, B)),
            "lengths has elements that share memory",
        ),
    ],
    ids=["tails", "codes", "scale-zero", "scales", "tails-partly", "expanded-codes", "expanded-lengths"],
)
def test_aliased_buffers_are_rejected_in_the_kernel_and_the_fake(mutate, match):
    from torch._subclasses.fake_tensor import FakeTensorMode

    static = _static({})
    static.append(torch.randn(B, H, 20, D), torch.randn(B, H, 20, D))  # compresses 0, so
    static.append(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))  # the next append compresses 16
    assert static.lengths[1, 0] == 21
    args = _op_args(static, torch.randn(B, H, 3, D), torch.randn(B, H, 3, D))
    mutate(args)
    before = [t.clone() for t in _written(args)]
    with pytest.raises(RuntimeError, match=match):
        torch.ops.nexuskv.static_kv_append_(**args)
    assert all(torch.equal(t, b) for t, b in zip(_written(args), before))
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=match):
        torch.ops.nexuskv.static_kv_append_(**_fake(mode, args))


def _op_args(static, k, v):
    return dict(
        k_store=static._k_store(),
        v_store=static._v_store(),
        k_tail=static.k_tail,
        v_tail=static.v_tail,
        lengths=static.lengths,
        k=k,
        v=v,
        k_format=static.k_format,
        v_format=static.v_format,
        residual=static.residual,
    )


def _written(args):
    return [*args["k_store"], *args["v_store"], args["k_tail"], args["v_tail"], args["lengths"]]


def _fake(mode, args):
    """args with fake tensors (from_tensor keeps which tensors share a storage)."""
    return {
        n: mode.from_tensor(t)
        if isinstance(t, torch.Tensor)
        else [mode.from_tensor(x) for x in t]
        if isinstance(t, list) and isinstance(t[0], torch.Tensor)
        else t
        for n, t in args.items()
    }


def test_seven_store_tensors_name_the_store_sizes():
    for kw in ({}, dict(dynamic_keys=True)):
        static = _static(kw)
        args = _op_args(static, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        args["k_store"] = args["k_store"][:5] + [torch.zeros(B, H, 16, dtype=torch.int32), static.k_codes.clone()]
        with pytest.raises(RuntimeError, match=r"k_store must hold the 5 tensors of an NQ tensor .* or the 6 of a DGQ"):
            torch.ops.nexuskv.static_kv_append_(**args)
        args = _op_args(static, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        args["v_store"] = args["v_store"] + [static.v_scale.clone()]
        with pytest.raises(RuntimeError, match="v_store must hold the 5 tensors of an NQ tensor"):
            torch.ops.nexuskv.static_kv_append_(**args)
        assert static.lengths.sum() == 0


# ---- values the cache reads: lengths, tails, scales ----------------------------------------


def _filled(kw=None, n=40):
    static = _static(kw or {}, max_tokens=64)
    g = torch.Generator().manual_seed(7)
    static.append(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g))
    return static  # 32 tokens compressed, 8 in the tail, of each sequence


@pytest.mark.parametrize(
    "poke",
    [
        lambda c: c.k_scale.__setitem__((1, 0, 1, 5), float("nan")),
        lambda c: c.k_zero.__setitem__((0, 1, 0, 0), float("inf")),
        lambda c: c.v_scale.__setitem__((1, 1, 31, 2), float("-inf")),
        lambda c: c.v_zero.__setitem__((0, 0, 0, 3), float("nan")),
        lambda c: c.k_outlier_val.__setitem__((0, 0, 1, 9, 0), float("nan")),
        lambda c: c.v_outlier_val.__setitem__((1, 0, 12, 1, 0), float("inf")),
        lambda c: c.k_tail.__setitem__((1, 1, 7, 0), float("nan")),
        lambda c: c.v_tail.__setitem__((0, 0, 0, 63), float("inf")),
    ],
    ids=["k_scale", "k_zero", "v_scale", "v_zero", "k_outlier_val", "v_outlier_val", "k_tail", "v_tail"],
)
def test_nan_or_inf_in_what_the_cache_holds_is_rejected_and_nothing_is_stored(poke):
    static = _filled(dict(outliers=1))
    poke(static)
    before = {n: t.clone() for n, t in static.named_buffers()}
    with pytest.raises(RuntimeError, match="holds NaN or Inf in the .* a corrupted buffer"):
        static.append(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
    for n, t in static.named_buffers():
        assert (
            torch.equal(t, before[n])
            or (t.isnan() == before[n].isnan()).all()
            and torch.equal(t.nan_to_num(), before[n].nan_to_num())
        ), n


def test_nan_where_the_cache_holds_nothing_is_not_read():
    static, ref = _filled(dict(outliers=1)), _filled(dict(outliers=1))
    static.k_scale[:, :, 2:] = float("nan")  # the rows of tokens 32.. (not compressed yet)
    static.v_scale[:, :, 32:] = float("nan")
    static.k_tail[:, :, 8:] = float("inf")  # past the 8 tail tokens
    g = torch.Generator().manual_seed(8)
    for n in [1, 10, 5]:  # compresses tokens 32..47: their rows are written
        k, v, q = (
            torch.randn(B, H, n, D, generator=g),
            torch.randn(B, H, n, D, generator=g),
            torch.randn(B, HQ, n, D, generator=g),
        )
        assert torch.equal(static(q, k, v), ref(q, k, v))
    assert static.lengths[0, 0] == 48


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda c: setattr(c, "lengths", c.lengths.int()), r"buffer lengths must be torch.int64 \[2, 2\]"),
        (lambda c: setattr(c, "lengths", torch.zeros(3, B, dtype=torch.long)), r"lengths must be torch.int64 \[2, 2\]"),
        (lambda c: c.lengths[0].fill_(20), "the lengths buffer is corrupt"),  # not a whole chunk
        (lambda c: c.lengths[0, 1].fill_(80), "the lengths buffer is corrupt"),  # beyond the capacity
        (lambda c: c.lengths[1, 0].fill_(24), "the lengths buffer is corrupt"),  # beyond the tail
        (lambda c: c.lengths[1, 1].fill_(-1), "the lengths buffer is corrupt"),
    ],
    ids=["int32", "3-rows", "half-chunk", "past-capacity", "past-tail", "negative"],
)
def test_corrupt_lengths_are_a_clear_error_at_attend(corrupt, match):
    static = _filled()
    corrupt(static)
    with pytest.raises(RuntimeError, match=match):
        static.attend(torch.randn(B, HQ, 1, D))


def test_a_compiled_attend_checks_the_lengths_in_its_one_graph():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    static = _filled()
    attend = torch.compile(static.attend, fullgraph=True)
    q = torch.randn(B, HQ, 1, D)
    assert torch.equal(attend(q), static.attend(q))
    static.lengths[0, 1] = 20
    with pytest.raises(RuntimeError, match="the lengths buffer is corrupt"):
        attend(q)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    "name, dtype",
    [("k_tail", torch.float16), ("v_tail", torch.bfloat16), ("k_scale", torch.float16), ("v_outlier_val", torch.half)],
)
def test_buffers_of_another_dtype_than_the_constructor_made_are_rejected(name, dtype):
    static = _filled()
    setattr(static, name, getattr(static, name).to(dtype))
    before = {n: t.clone() for n, t in static.named_buffers()}
    for call in (
        lambda: static.attend(torch.randn(B, HQ, 1, D)),
        lambda: static(*[torch.randn(B, h, 1, D) for h in (HQ, H, H)]),
    ):
        with pytest.raises(RuntimeError, match=f"buffer {name} must be torch.float32 .* as the constructor made it"):
            call()
    assert all(torch.equal(t, before[n]) for n, t in static.named_buffers())


def test_the_op_takes_tails_and_k_v_only_in_the_caches_dtype():
    static = _filled()
    half = torch.randn(B, H, 1, D, dtype=torch.float16)
    args = _op_args(static, half, half)
    args.update(k_tail=static.k_tail.half(), v_tail=static.v_tail.half())
    with pytest.raises(RuntimeError, match=r"k and v must have the cache's dtype Float \(that of k_store\[4\]"):
        torch.ops.nexuskv.static_kv_append_(**args)
    args = _op_args(static, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
    args.update(v_tail=static.v_tail.half())
    with pytest.raises(RuntimeError, match="v_tail must have the cache's dtype Float"):
        torch.ops.nexuskv.static_kv_append_(**args)
    assert static.lengths[:, 0].tolist() == [32, 8]


# ---- constructor arguments: named, with what was expected ----------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bits=5), "StaticKVCache: bits must be one of 2, 3, 4, 8, got 5"),
        (dict(value_bits=5), "StaticKVCache: value_bits must be one of 2, 3, 4, 8, got 5"),
        (dict(value_bits=True), "StaticKVCache: value_bits must be one of 2, 3, 4, 8, got True"),
        (dict(group_size=0), r"StaticKVCache: group_size must be an int in \[1, 256\], got 0"),
        (dict(value_group_size=300), r"StaticKVCache: value_group_size must be an int in \[1, 256\], got 300"),
        (dict(outliers=16, group_size=16), r"StaticKVCache: outliers .* in \[0, group_size\) = \[0, 16\), got 16"),
        (dict(value_outliers=8, value_group_size=8), r"value_outliers .* \[0, value_group_size\) = \[0, 8\), got 8"),
        (dict(dtype=torch.int32), "StaticKVCache: dtype must be torch.float32, torch.float16 or torch.bfloat16"),
        (dict(meta_dtype=torch.float64), "StaticKVCache: meta_dtype .* got torch.float64"),
        (dict(dynamic_keys=True, granule=0), r"StaticKVCache: granule must be an int in \[1, group_size\]"),
        (dict(dynamic_keys=True, group_size=200), "StaticKVCache: dynamic_keys=True needs segments"),
        (dict(dynamic_keys=1), "StaticKVCache: dynamic_keys must be a bool"),
        (dict(dynamic_keys=True, max_tokens=2**31), r"max_tokens must be at most 2147483584 .* int32"),
        (dict(max_tokens=2**45), r"StaticKVCache: max_tokens=35184372088832 and residual=8 .* need \d+ bytes"),
        (dict(residual=2**45), r"max_tokens=64 and residual=35184372088832 .* need \d+ bytes .* of memory"),
    ],
)
def test_constructor_errors_name_the_argument(kw, match):
    args = dict(batch=B, kv_heads=H, head_dim=D, max_tokens=64, residual=8) | kw
    with pytest.raises(ValueError, match=match):
        StaticKVCache(**args)


@pytest.mark.parametrize("kw", [{}, dict(dynamic_keys=True, outliers=2, value_bits=2), dict(dtype=torch.bfloat16)])
def test_the_size_check_counts_the_bytes_the_buffers_take(kw, monkeypatch):
    import nexuskv.static_cache as sc

    args = dict(batch=B, kv_heads=H, head_dim=D, max_tokens=100, group_size=16, residual=8) | kw
    made = StaticKVCache(**args).nbytes
    monkeypatch.setattr(sc, "_memory_bytes", lambda: made - 1)
    with pytest.raises(ValueError, match=f"need {made} bytes"):
        StaticKVCache(**args)
    monkeypatch.setattr(sc, "_memory_bytes", lambda: None)  # memory unknown: the allocator decides
    with pytest.raises(
        RuntimeError, match=r"StaticKVCache: allocating the \d+ bytes .* max_tokens=2097152, .* failed: "
    ):
        StaticKVCache(**(args | dict(batch=2**21, kv_heads=2**21, max_tokens=2**21)))  # past int64 bytes
