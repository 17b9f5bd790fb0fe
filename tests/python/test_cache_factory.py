"""nexuskv.cache.make_cache (the one Python way to build a KVCache) and the cache as a
value: state_dict / from_state_dict through torch.save + torch.load(weights_only=True),
pickle and torch.save of the TorchBind object, copy.deepcopy, clone(), to().  A restored
or copied cache must hold the same bytes and continue bit-exactly as the original."""

import copy
import io
import pickle

import pytest
import torch

import nexuskv
from nexuskv.cache import from_state_dict, make_cache

CONFIGS = {
    "nq": dict(key_group_size=32, value_group_size=32, residual=16),
    "dgq_rotate_sinks": dict(key_bits=3, key_dynamic=True, key_group_size=32, value_group_size=32, residual=8,
                             sinks=3, rotate=True, seed=7, key_outliers=1),
    "window": dict(key_bits=2, key_group_size=16, value_group_size=16, residual=4, window=40),
    "meta16": dict(key_group_size=32, value_group_size=32, residual=16, meta_dtype=torch.float16),
}


def feed(cache, steps, seed, B=3, H=2, D=64, dtype=torch.float32, prefill=70):
    """A ragged prefill (sequence 2 left-padded), then `steps` single-token appends; returns
    the queries of each step's attend() and the outputs."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    if prefill:
        valid = torch.ones(B, prefill, dtype=torch.bool)
        valid[-1, :prefill // 3] = False
        cache.append(torch.randn(B, H, prefill, D, generator=g).to(dtype),
                     torch.randn(B, H, prefill, D, generator=g).to(dtype), valid)
    for _ in range(steps):
        cache.append(torch.randn(B, H, 1, D, generator=g).to(dtype), torch.randn(B, H, 1, D, generator=g).to(dtype),
                     None)
        if not cache.is_external():
            outs.append(cache.attend(torch.randn(B, 2 * H, 1, D, generator=g).to(dtype), None, None))
    return outs


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def assert_continue_alike(a, b, seed=99, steps=40):
    assert a.lengths().tolist() == b.lengths().tolist()
    assert a.nbytes() == b.nbytes() and a.used_nbytes() == b.used_nbytes()
    for x, y in zip(feed(a, steps, seed, prefill=0), feed(b, steps, seed, prefill=0)):
        assert torch.equal(x, y)
    assert_same_state(a, b)


# ---- the factory -------------------------------------------------------------------------------


def test_make_cache_defaults_are_the_documented_ones():
    cache = make_cache()
    assert cache.chunk() == 64 and cache.sinks() == 0 and cache.window() is None and not cache.is_external()
    st = cache.state_dict()
    cfg = {k[len("config."):]: int(v) for k, v in st.items() if k.startswith("config.") and v.dtype == torch.long}
    assert cfg == dict(storage=0, key_bits=4, key_group_size=64, key_axis=-2, key_outliers=0, key_dynamic=0,
                       key_granule=16, value_bits=4, value_group_size=64, value_axis=-1, value_outliers=0,
                       value_dynamic=0, value_granule=16, residual=128, sinks=0, rotate=0, seed=0,
                       external_chunk=0)
    assert "config.key_meta_dtype" not in st and "config.window" not in st


def test_make_cache_is_the_positional_constructor_by_name():
    kw = dict(key_bits=3, key_group_size=32, key_axis=-2, key_outliers=1, key_dynamic=True, value_bits=2,
              value_group_size=16, value_axis=-1, value_outliers=0, residual=16, rotate=True, seed=3, sinks=2,
              external_chunk=0, meta_dtype=torch.bfloat16)
    a = make_cache(**kw)
    b = torch.classes.nexuskv.KVCache(*kw.values())  # the order older releases used
    feed(a, 3, 0), feed(b, 3, 0)
    assert_same_state(a, b)
    assert nexuskv.cache.make_cache is make_cache  # `import nexuskv` is enough


@pytest.mark.parametrize("kw, error", [(dict(key_bits="4"), TypeError), (dict(rotate=1), TypeError),
                                       (dict(residual=2 ** 64), ValueError), (dict(window=1.5), TypeError),
                                       (dict(meta_dtype="bf16"), TypeError)])
def test_make_cache_rejects_wrong_types(kw, error):
    with pytest.raises(error, match="make_cache: "):
        make_cache(**kw)


# ---- save and load -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_survives_torch_save_and_weights_only_load(name, tmp_path):
    cache = make_cache(**CONFIGS[name])
    feed(cache, 30, 1)
    assert cache.compressed_lengths().min() > 0  # the compressed path is what is saved
    if name == "window":
        assert cache.evicted_lengths().min() > 0
    torch.save(cache.state_dict(), tmp_path / "cache.pt")
    state = torch.load(tmp_path / "cache.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    restored = from_state_dict(state)
    assert_same_state(cache, restored)
    assert_continue_alike(cache, restored)


def test_state_dict_of_a_new_and_of_an_external_cache():
    new = make_cache(residual=5)
    restored = from_state_dict(new.state_dict())
    assert restored.lengths().tolist() == [] and restored.nbytes() == 0
    ext = make_cache(external_chunk=16, residual=8, sinks=2)
    feed(ext, 5, 2)
    seq, off, ks, vs = ext.take_due_chunks()
    assert seq.numel() > 0
    feed(ext, 20, 3, prefill=0)  # chunks due again: they are part of the state
    restored = from_state_dict(ext.state_dict())
    a, b = ext.take_due_chunks(), restored.take_due_chunks()
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist() and len(a[2]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a[2] + a[3], b[2] + b[3]))
    assert_same_state(ext, restored)


def test_pickle_torch_save_deepcopy_and_clone_of_the_object(tmp_path):
    cache = make_cache(**CONFIGS["dgq_rotate_sinks"])
    feed(cache, 10, 4)
    buf = io.BytesIO()
    torch.save(cache, buf)
    buf.seek(0)
    copies = [pickle.loads(pickle.dumps(cache)), torch.load(buf, weights_only=False), copy.deepcopy(cache),
              cache.clone()]
    for c in copies:
        assert isinstance(c, torch.ScriptObject)
        assert_same_state(cache, c)
    # Each copy is independent: appending to it leaves the original (and the other copies) unchanged.
    before = cache.state_dict()
    assert_continue_alike(copies[2], copies[3])
    after = cache.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert_continue_alike(cache, copies[0])


def test_corrupt_state_is_a_clear_error():
    cache = make_cache(**CONFIGS["nq"])
    feed(cache, 2, 5)
    good = cache.state_dict()

    def bad(**changes):
        st = dict(good)
        for k, v in changes.items():
            if v is None:
                del st[k.replace("__", ".")]
            else:
                st[k.replace("__", ".")] = v
        return st

    cases = [(bad(nexuskv__version=torch.tensor(2)), "format version 2 is not supported"),
             (bad(config__residual=None), "no entry 'config.residual'"),
             (bad(lengths__compressed=torch.tensor([10 ** 6, 0, 0])),
              r"lengths.compressed\[0\] = 1000000 exceeds the compressed buffers"),
             (bad(tail__k=good["tail.k"].half()), "entry 'tail.k' must be Float"),
             (bad(keys__scale=good["keys.scale"][..., :3]), "entry 'keys.scale' must be"),
             (bad(config__key_group_size=torch.tensor(0)), "key_group_size must be in"),
             (bad(lengths__tail=torch.tensor([1.0, 2.0, 3.0])), "must be an integer tensor of shape")]
    for state, message in cases:
        with pytest.raises(RuntimeError, match=message):
            from_state_dict(state)
    with pytest.raises(TypeError, match="dict of str -> Tensor"):
        from_state_dict({"a": 1})


def poked(t, value, index=0):
    t = t.clone()
    t.view(-1)[index] = value
    return t


def test_state_values_a_cache_could_not_hold_are_a_clear_error():
    # Found by scripts/bad_input_sweep.py: these loaded silently, and then a NaN tail made the
    # cache stuck once its chunk was due (every later append raised), a NaN/Inf scale made
    # every attend() NaN, a corrupt outlier position failed only at the first read, and a
    # state without 'shape' loaded as an empty cache (every token lost).
    cache = make_cache(**CONFIGS["dgq_rotate_sinks"])
    feed(cache, 2, 5)
    good = cache.state_dict()
    assert int(cache.compressed_lengths().max()) > 0
    cases = [({"tail.k": poked(good["tail.k"], float("nan"))}, "entry 'tail.k' holds NaN or Inf"),
             ({"sinks.v": poked(good["sinks.v"], -float("inf"))}, "entry 'sinks.v' holds NaN or Inf"),
             ({"keys.scale": good["keys.scale"].clone().fill_(float("inf"))}, "entry 'keys.scale' holds NaN or Inf"),
             ({"values.zero": good["values.zero"].clone().fill_(float("nan"))}, "entry 'values.zero' holds NaN or Inf"),
             ({"keys.outlier_idx": good["keys.outlier_idx"].clone().fill_(250)},
              "entry 'keys.outlier_idx' does not decode under 'keys.segment_starts' .*outlier_idx holds a position "
              "outside its group")]
    for changes, message in cases:
        with pytest.raises(RuntimeError, match="KVCache.from_state_dict: .*" + message):
            from_state_dict({**good, **changes})
    no_shape = {k: v for k, v in good.items() if k != "shape"}
    with pytest.raises(RuntimeError, match="has entry '.*' but no 'shape'"):
        from_state_dict(no_shape)
    from_state_dict(good)  # the untouched state still loads
    new = make_cache(**CONFIGS["nq"]).state_dict()
    assert "shape" not in new and from_state_dict(new).lengths().numel() == 0


def test_state_entries_that_require_grad_load_inference_only():
    # Once kept requiring grad, so that every attend() of the restored cache raised.
    cache = make_cache(**CONFIGS["nq"])
    feed(cache, 2, 5)
    state = {k: v.clone().requires_grad_(True) if v.is_floating_point() and v.numel() else v
             for k, v in cache.state_dict().items()}
    restored = from_state_dict(state)
    q = torch.randn(3, 4, 1, 64)
    assert torch.equal(restored.attend(q, None, None), cache.attend(q, None, None))
    assert not any(t.requires_grad for t in restored.state_dict().values())


def test_restored_cache_is_independent_of_the_state_tensors():
    cache = make_cache(**CONFIGS["nq"])
    feed(cache, 2, 6)
    state = cache.state_dict()
    restored = from_state_dict(state)
    snapshot = {k: v.clone() for k, v in state.items()}
    feed(restored, 40, 7, prefill=0)  # writes its buffers in place
    assert all(torch.equal(state[k], snapshot[k]) for k in state)


# ---- to() --------------------------------------------------------------------------------------


def test_to_moves_and_keeps_working():
    cache = make_cache(**CONFIGS["nq"])
    cache.to("cpu")  # a new cache: nothing to move
    feed(cache, 3, 8)
    twin = cache.clone()
    cache.to("cpu")
    assert_continue_alike(cache, twin)
    with pytest.raises(RuntimeError, match="to\\(\\): the cache must stay on a device with data"):
        cache.to("meta")
    with pytest.raises(RuntimeError):
        cache.to("nonsense")
