"""KVCache robustness (issue 8 items 4-8, 15, 18): every constructor argument checked up
front (no crash, no overflow, no half-built cache), NaN/Inf/out-of-range K/V rejected at
append before anything is stored (no token lost, the cache never stuck), atomic appends,
inference-only appends, clear errors for bad masks and beam indices, and one cache shared
by two threads with exact lengths."""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from nexuskv.cache import make_cache
from test_cache import attention_f64

# The TorchBind constructor's positional order (make_cache passes the same fields by name).
FIELDS = ["key_bits", "key_group_size", "key_axis", "key_outliers", "key_dynamic", "value_bits", "value_group_size",
          "value_axis", "value_outliers", "residual", "rotate", "seed", "sinks", "external_chunk", "meta_dtype",
          "window"]
DEFAULTS = dict(key_bits=4, key_group_size=32, key_axis=-2, key_outliers=0, key_dynamic=False, value_bits=4,
                value_group_size=32, value_axis=-1, value_outliers=0, residual=16, rotate=False, seed=0, sinks=0,
                external_chunk=0, meta_dtype=None, window=None)


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in its own Python: a crash (SIGFPE, abort) fails the test instead of pytest."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


BAD_SETTINGS = [
    (dict(key_group_size=0), "key_group_size must be in [1, 256], got 0"),  # SIGFPE at append before
    (dict(value_group_size=0, value_axis=-2), "value_group_size must be in [1, 256], got 0"),
    (dict(value_group_size=0), "value_group_size must be in [1, 256], got 0"),
    (dict(key_group_size=257), "key_group_size must be in [1, 256], got 257"),
    (dict(key_bits=5), "key_bits must be one of 2, 3, 4, 8, got 5"),
    (dict(key_bits=2 ** 32 + 4), "key_bits must be one of 2, 3, 4, 8, got 4294967300"),
    (dict(value_bits=0), "value_bits must be one of 2, 3, 4, 8, got 0"),
    (dict(key_axis=0), "key_axis must be -2 (groups of tokens per channel) or -1"),
    (dict(value_axis=3), "value_axis must be -2"),
    (dict(key_outliers=-1), "key_outliers must be in [0, group_size) = [0, 32), got -1"),
    (dict(value_outliers=32), "value_outliers must be in [0, group_size) = [0, 32), got 32"),
    (dict(key_dynamic=True, key_axis=-1), "key_dynamic (DGQ) groups need axis -2"),
    (dict(key_dynamic=True, key_group_size=200), "key_dynamic (DGQ) groups need 2 * group_size rounded up"),
    (dict(meta_dtype=torch.int32), "key_meta_dtype must be float32, float16, bfloat16 or None, got Int"),
    (dict(residual=-1), "residual must be in [0, 2147483647], got -1"),
    (dict(residual=2 ** 63 - 1), "residual must be in [0, 2147483647], got 9223372036854775807"),
    (dict(residual=2 ** 40), "residual must be in [0, 2147483647], got 1099511627776"),
    (dict(sinks=2 ** 40), "sinks must be in [0, 2147483647], got 1099511627776"),
    (dict(sinks=-2), "sinks must be in [0, 2147483647], got -2"),
    (dict(external_chunk=-1), "external_chunk must be in [0, 2147483647], got -1"),
    (dict(external_chunk=2 ** 62), "external_chunk must be in [0, 2147483647]"),
    (dict(external_chunk=16, rotate=True), "external storage does not rotate"),
    (dict(window=0), "window must be in [1, 2147483647], got 0"),
    (dict(window=16, sinks=2), "a sliding window (window=16) needs sinks=0"),
]


def test_every_constructor_argument_is_checked_up_front():
    # The positional TorchBind constructor, in a fresh process: before these checks a bad
    # setting was accepted and then crashed the process (SIGFPE) or failed later, half-way
    # through an append.  One line per setting; a crash fails the test with the last one done.
    cases = [[repr(changes.get(f, DEFAULTS[f])) for f in FIELDS] for changes, _ in BAD_SETTINGS]
    run = run_isolated(f"""
        import torch, nexuskv
        for args in [{", ".join("(" + ", ".join(c) + ",)" for c in cases)}]:
            try:
                cache = torch.classes.nexuskv.KVCache(*args)
            except RuntimeError as e:
                print("CONSTRUCTOR:", str(e).splitlines()[0], flush=True)
            else:
                try:
                    cache.append(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), None)
                    cache.attend(torch.randn(1, 2, 1, 64), None)
                    print("ACCEPTED", flush=True)
                except RuntimeError as e:
                    print("LATER:", str(e).splitlines()[0], flush=True)
    """)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, f"crashed ({run.returncode}) after {len(lines)} settings: {run.stderr[-2000:]}"
    assert len(lines) == len(BAD_SETTINGS)
    for (changes, message), line in zip(BAD_SETTINGS, lines):
        assert line.startswith("CONSTRUCTOR: KVCache: " + message), (changes, line)
        # the same through the factory (which checks meta_dtype itself, under its own name)
        with pytest.raises((RuntimeError, ValueError), match="KVCache: |make_cache: meta_dtype"):
            make_cache(**{**DEFAULTS, **changes})


def test_valid_limits_are_accepted():
    # The largest settings are usable: nothing is allocated for them up front.
    cache = make_cache(residual=2 ** 31 - 1, sinks=2 ** 31 - 1, key_group_size=256, value_group_size=256)
    cache.append(torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64), None)
    assert cache.lengths().tolist() == [300] and cache.nbytes() < 2 * 300 * 64 * 4 * 2
    assert make_cache(key_group_size=255, key_axis=-2, value_group_size=256, value_axis=-2).chunk() == 255 * 256


# ---- NaN / Inf / range: rejected before anything is stored -----------------------------------


def kv(B=2, n=40, H=2, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g).to(dtype), torch.randn(B, H, n, D, generator=g).to(dtype)


@pytest.mark.parametrize("bad, message", [(float("nan"), "holds NaN"), (float("inf"), "holds Inf"),
                                          (-float("inf"), "holds Inf")])
@pytest.mark.parametrize("external", [False, True])
def test_non_finite_kv_is_rejected_and_nothing_is_lost(bad, message, external):
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8, external_chunk=16 if external else 0)
    cache.append(*kv(n=20), None)  # tokens wait in the tail
    state = cache.state_dict()
    for which in (0, 1):
        k, v = kv(n=30, seed=1)
        (k, v)[which][1, 0, 5, 3] = bad  # sequence 1 only: sequence 0 must not be half-applied
        with pytest.raises(RuntimeError, match=f"KVCache: {'kv'[which]} {message}.*nothing of this append was"):
            cache.append(k, v, None)
    after = cache.state_dict()
    assert all(torch.equal(state[key], after[key]) for key in state)  # atomic: exactly as before
    # The cache is not stuck: later appends compress the old tokens and keep going.
    for step in range(10):
        cache.append(*kv(n=7, seed=10 + step), None)
    assert cache.lengths().tolist() == [90, 90] and cache.compressed_lengths().min() > 0


def test_values_beyond_the_meta_dtype_are_rejected_at_append():
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8, meta_dtype=torch.float16)
    k, v = kv(n=30, dtype=torch.bfloat16)
    v[0, 1, 3, 7] = 7e4  # bf16 holds it, the fp16 scales/zeros of its group could not
    with pytest.raises(RuntimeError, match="v holds a value of magnitude 70144.*float16.*use meta_dtype=torch.bf"):
        cache.append(k, v, None)
    assert cache.lengths().tolist() == []  # a failed first append leaves the cache new
    v[0, 1, 3, 7] = 6e4
    cache.append(k, v, None)
    for _ in range(5):
        cache.append(*kv(n=9, dtype=torch.bfloat16), None)
    assert cache.compressed_lengths().tolist() == [64, 64]
    # float32 K/V: a group whose range would overflow float32 (issue 8 item 14) cannot get in.
    wide = make_cache(key_group_size=16, value_group_size=16, residual=8)
    k, v = kv(n=30)
    k[0, 0, 0, 0], k[0, 0, 1, 0] = 3e38, -3e38
    with pytest.raises(RuntimeError, match="k holds a value of magnitude 3e\\+38"):
        wide.append(k, v, None)


# ---- atomic appends ----------------------------------------------------------------------------


def test_failed_first_append_does_not_fix_the_shape():
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8)
    for bad in [(torch.empty(2, 2, 5, 64, device="meta"), torch.empty(2, 2, 5, 64, device="meta"), None),
                (torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64), torch.ones(2, 5, dtype=torch.long)),
                (torch.randn(2, 2, 5, 64).fill_(float("nan")), torch.randn(2, 2, 5, 64), None)]:
        with pytest.raises(RuntimeError, match="KVCache: "):
            cache.append(*bad)
        assert cache.lengths().tolist() == [] and cache.nbytes() == 0
    cache.append(*kv(B=3, H=1, D=32, n=40), None)  # any shape: nothing was fixed
    assert cache.lengths().tolist() == [40, 40, 40]


def test_meta_tensors_are_a_clear_error():
    cache = make_cache()
    with pytest.raises(RuntimeError, match="k and v must hold data \\(CPU or accelerator tensors\\), got a meta"):
        cache.append(torch.empty(1, 1, 1, 64, device="meta"), torch.empty(1, 1, 1, 64, device="meta"), None)
    cache.append(*kv(), None)
    with pytest.raises(RuntimeError, match="q must hold data, got a meta tensor"):
        cache.attend(torch.empty(2, 4, 1, 64, device="meta"), None, None)


# ---- inference only ----------------------------------------------------------------------------


def test_requires_grad_kv_under_grad_mode_is_rejected():
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8)
    k, v = kv()
    k.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only, but k or v requires grad while grad mode is on"):
        cache.append(k, v, None)
    assert cache.lengths().tolist() == []
    with torch.no_grad():
        cache.append(k, v, None)
    cache.append(k.detach(), v, None)
    q = torch.randn(2, 4, 1, 64)
    K, V, lens = cache.dense(torch.float32)
    assert float((cache.attend(q, None, None).double() - attention_f64(q, K, V, lens, 0.125)).abs().max()) < 1e-4


# ---- masks and beam indices --------------------------------------------------------------------


@pytest.mark.parametrize("mask", [torch.ones(2, 40, dtype=torch.uint8), torch.ones(2, 40), torch.ones(2, 40).long(),
                                  torch.ones(2, 40, dtype=torch.complex64)])
def test_valid_must_be_bool(mask):
    cache = make_cache()
    with pytest.raises(RuntimeError, match="valid must be a bool tensor, got"):
        cache.append(*kv(), mask)
    with pytest.raises(RuntimeError, match="valid must have shape \\[2, 40\\], got \\[2, 39\\]"):
        cache.append(*kv(), torch.ones(2, 39, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="valid must be on the CPU or on k's device"):
        cache.append(*kv(), torch.ones(2, 40, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("beam_idx, message", [
    (torch.tensor([True, False]), "beam_idx must be an integer tensor of shape \\[2\\], got Bool"),
    (torch.tensor([0, 1], dtype=torch.complex64), "beam_idx must be an integer tensor of shape \\[2\\], got Complex"),
    (torch.tensor([0.0, 1.0]), "beam_idx must be an integer tensor of shape \\[2\\], got Float"),
    (torch.empty(2, dtype=torch.long, device="meta"), "beam_idx must be an integer tensor with data, got a meta"),
    (torch.tensor([[0, 1]]), "beam_idx must be an integer tensor of shape \\[2\\], got Long \\[1, 2\\]"),
    (torch.tensor([0, -1]), "beam_idx\\[1\\] = -1 is outside \\[0, 2\\)"),
])
def test_bad_beam_idx_is_a_clear_error(beam_idx, message):
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8)
    cache.append(*kv(), None)
    state = cache.state_dict()
    with pytest.raises(RuntimeError, match=message):
        cache.reorder(beam_idx)
    after = cache.state_dict()
    assert all(torch.equal(state[key], after[key]) for key in state)
    cache.reorder(torch.tensor([1, 1], dtype=torch.int32))  # any integer dtype
    K, _, _ = cache.dense(None)
    assert torch.equal(K[0], K[1])


# ---- threads -----------------------------------------------------------------------------------


def test_two_threads_share_one_cache_with_exact_lengths():
    # Before: hundreds of size errors and lengths off by tens of tokens.
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8)
    cache.append(*kv(B=2, n=4), None)
    per_thread, errors = 2000, []
    k1, v1 = kv(B=2, n=1, seed=3)
    q = torch.randn(2, 4, 1, 64)

    def work():
        try:
            for i in range(per_thread):
                cache.append(k1, v1, None)
                if i % 50 == 0:
                    cache.attend(q, None, None)
                    cache.lengths(), cache.nbytes()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    total = 4 + 2 * per_thread
    assert cache.lengths().tolist() == [total, total]
    assert cache.compressed_lengths().tolist() == [(total - 8) // 16 * 16] * 2
    K, V, lens = cache.dense(torch.float32)
    c = cache.compressed_lengths()[0].item()
    assert torch.equal(K[:, :, c:total], k1.expand(2, 2, total - c, 64))  # the tail holds exactly what came
    ref = attention_f64(q, K, V, lens, 0.125)
    assert float((cache.attend(q, None, None).double() - ref).norm() / ref.norm()) < 1e-4


def test_handed_over_chunks_are_copies_not_views_of_the_callers_kv():
    cache = make_cache(external_chunk=16, residual=0)
    k, v = torch.randn(1, 1, 16, 64), torch.randn(1, 1, 16, 64)
    want = k.clone()
    cache.append(k, v, None)
    k.fill_(7.0)  # the caller reuses its buffer
    _, _, ks, _ = cache.take_due_chunks()
    assert torch.equal(ks[0], want[0])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8])
def test_dense_in_an_integer_dtype_is_a_clear_error(dtype):
    # Once returned the dequantized K/V truncated to integers.
    cache = make_cache(key_group_size=16, value_group_size=16, residual=8)
    cache.append(*kv(n=40), None)
    with pytest.raises(RuntimeError, match=r"KVCache: dense\(\) dtype must be a floating dtype"):
        cache.dense(dtype)
    k64, _, _ = cache.dense(torch.float64)  # a floating dtype is fine
    assert torch.equal(k64, cache.dense(torch.float32)[0].double())


def external_with_a_compressed_chunk():
    cache = make_cache(key_group_size=16, value_group_size=16, residual=16, external_chunk=16)
    cache.append(*kv(n=40), None)
    cache.take_due_chunks()
    assert cache.compressed_lengths().tolist() == [16, 16]
    return cache


def test_crop_with_non_finite_survivors_is_rejected_and_changes_nothing():
    # Once the NaN survivors of the cut chunk went into the tail and were handed over again
    # (take_due_chunks) to a front end whose compressor then rejects them: tokens lost.
    cache = external_with_a_compressed_chunk()
    good = [torch.zeros(2, 16, 64)] * 2
    with pytest.raises(RuntimeError, match=r"crop_with\(\): k_compressed\[0\] or v_compressed\[0\] holds NaN"):
        cache.crop_with(8, [torch.full((2, 16, 64), float("nan"))] * 2, good)
    assert cache.lengths().tolist() == [40, 40] and cache.compressed_lengths().tolist() == [16, 16]
    cache.crop_with(8, good, good)
    assert cache.lengths().tolist() == [8, 8] and cache.compressed_lengths().tolist() == [0, 0]


@pytest.mark.parametrize("method", ["dense_with", "crop_with"])
def test_integer_compressed_parts_are_rejected(method):
    # Once converted to the cache dtype silently: a front end handing over codes, not K/V.
    cache = external_with_a_compressed_chunk()
    ints, good = [torch.zeros(2, 16, 64, dtype=torch.int64)] * 2, [torch.zeros(2, 16, 64)] * 2
    with pytest.raises(RuntimeError, match=method + r"\(\): [kv]_compressed\[0\] must be dequantized"):
        cache.dense_with(ints, good, None) if method == "dense_with" else cache.crop_with(8, ints, good)
