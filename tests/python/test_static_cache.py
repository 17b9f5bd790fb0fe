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
        (lambda a: a.update(k=torch.randn(3, H, 1, D), v=torch.randn(3, H, 1, D)), r"k_store must be \[batch=3"),
        (lambda a: a.update(lengths=a["lengths"].int()), r"lengths must be int64 \[2, batch=2\]"),
        (lambda a: a.update(k_tail=a["k_tail"][:, :, :3]), "k_tail and v_tail must have one capacity"),
        (lambda a: a.update(k_tail=a["k_tail"][:, :, :3], v_tail=a["v_tail"][:, :, :3]), "the tail must hold"),
        (lambda a: a.update(k_format=[5, 16, -2]), "bits must be one of 2, 3, 4, 8"),
        (lambda a: a.update(k_format=[4, 32, -2]), "k: scale must have shape"),
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
