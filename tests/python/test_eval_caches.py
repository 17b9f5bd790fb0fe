"""The caches `eval` and `demo` compare: effective bits from the format against the
bytes the caches really hold, byte accounting of each cache kind, the settings
grid, greedy agreement.  No model needed (random K/V, small configs)."""

import dataclasses
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, QuantizedCache

from nexuskv import eval_caches as ec
from nexuskv import hf
from nexuskv.generation import agreement

H, D = 3, 64  # SmolLM2's kv heads and head_dim


def _kv(tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, H, tokens, D, generator=g).to(dtype)
    return k, torch.randn(1, H, tokens, D, generator=g).to(dtype)


def _nexuskv_cache(s: ec.Setting, dtype):
    return hf.NexusKVCache(
        1,
        key_bits=s.bits,
        value_bits=s.bits,
        group_size=s.group_size,
        value_group_size=s.value_group_size,
        residual=s.residual,
        key_outliers=s.key_outliers,
        value_outliers=s.value_outliers,
        dynamic_keys=s.dgq,
        rotate=s.rotate,
        sinks=s.sinks,
        fused=False,
        meta_dtype=ec.meta_dtype_for(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "s",
    [
        ec.nexuskv(4, 0),
        ec.nexuskv(2, 0),
        ec.nexuskv(8, 0, key_outliers=1, value_outliers=1),
        ec.nexuskv(3, 0, dgq=True),
        ec.nexuskv(2, 0, group_size=128, key_outliers=2),
        ec.nexuskv(2, 0, group_size=128, value_group_size=32, rotate=True),
        # value groups longer than head_dim (one per token) or not dividing it
        # (a partial last group): they pay per group, not per group_size
        ec.nexuskv(3, 0, group_size=128, value_group_size=128),
        ec.nexuskv(2, 0, value_group_size=48),
    ],
    ids=lambda s: s.name,
)
def test_nexuskv_effective_bits_are_the_real_bytes(s, dtype):
    """Filled in one append of whole groups with no tail, the cache's compressed part is
    exactly the compressed tokens: its real bytes give the effective bits."""
    tokens = 512
    cache = _nexuskv_cache(s, dtype)
    cache.update(*_kv(tokens, dtype), 0)
    b = ec.cache_bytes(cache)
    measured = 8 * b["compressed"] / (2 * H * tokens * D)
    assert measured == pytest.approx(ec.effective_bits(s, D, dtype)["kv"], rel=1e-12)
    assert b["total"] == cache.nbytes == b["compressed"] + b["full_precision"]


def test_sixteen_bit_metadata_for_a_float32_model():
    """An fp32 model's cache keeps bf16 scales and zeros: 4-bit g64 is 4.5 bits, not 5."""
    assert ec.effective_bits(ec.nexuskv(4, 128), D, torch.float32)["kv"] == 4.5
    assert ec.effective_bits(ec.nexuskv(2, 128), D, torch.float32)["kv"] == 2.5
    # An fp32 outlier costs its index byte and 32 bits: 2 + (2*16 + 40) / 128 for keys.
    bits = ec.effective_bits(ec.nexuskv(2, 128, group_size=128, key_outliers=1), D, torch.float32)
    assert bits["keys"] == 2 + 72 / 128 and bits["values"] == 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 2])
def test_quanto_effective_bits_are_its_real_bytes(bits, dtype):
    """transformers' QuantizedCache (optimum-quanto): the first update quantizes all it
    gets, so its bytes are codes + a scale and a shift per 64 values."""
    tokens = 256
    s = ec.quanto(bits)
    cache = QuantizedCache(backend="quanto", config=LlamaConfig(num_hidden_layers=2), nbits=bits)
    for layer in range(2):
        cache.update(*_kv(tokens, dtype, seed=layer), layer)
    b = ec.cache_bytes(cache)
    assert b["full_precision"] == 0
    assert 8 * b["compressed"] / (2 * 2 * H * tokens * D) == ec.effective_bits(s, D, dtype)["kv"]


def test_dense_and_tail_bytes():
    tokens = 300
    dense = DynamicCache()
    dense.update(*_kv(tokens, torch.bfloat16), 0)
    assert ec.cache_bytes(dense) == {
        "total": 2 * H * tokens * D * 2,
        "compressed": 0,
        "full_precision": 2 * H * tokens * D * 2,
        "used": 2 * H * tokens * D * 2,
    }
    s = ec.nexuskv(4, 128)
    cache = _nexuskv_cache(s, torch.bfloat16)
    cache.update(*_kv(tokens, torch.bfloat16), 0)
    b = ec.cache_bytes(cache)
    # 300 tokens, 128 kept: two whole groups of 64 compressed (one append: no spare capacity).
    assert b["compressed"] * 8 == ec.effective_bits(s, D, torch.bfloat16)["kv"] * 2 * H * 128 * D
    assert b["full_precision"] >= 2 * H * (tokens - 128) * D * 2  # the tail, in bf16
    assert b["total"] == cache.nbytes


def test_cache_bytes_rejects_other_objects():
    with pytest.raises(TypeError, match="cache_bytes: expected"):
        ec.cache_bytes(object())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_stay_outside_the_compressed_bits(dtype):
    # 4 sinks + 512 tokens, no tail: the compressed part is exactly 512 tokens at the
    # formula's bits; the sinks are full-precision bytes, reported with the tail.
    s = dataclasses.replace(ec.RECOMMENDED_2BIT, residual=0)
    assert s.sinks == 4
    cache = _nexuskv_cache(s, dtype)
    cache.update(*_kv(4 + 512, dtype), 0)
    b = ec.cache_bytes(cache)
    assert 8 * b["compressed"] / (2 * H * 512 * D) == pytest.approx(ec.effective_bits(s, D, dtype)["kv"], rel=1e-12)
    assert b["full_precision"] >= 2 * H * 4 * D * dtype.itemsize
    assert b["total"] == cache.nbytes == b["compressed"] + b["full_precision"]


def test_grid():
    rows = ec.grid()
    assert rows[0] == ec.DENSE_SETTING and len(rows) == len(set(rows))
    assert {(r.bits, r.residual) for r in rows if r.kind == ec.NEXUSKV} >= {
        (b, t) for b in (8, 4, 3, 2) for t in (0, 128)
    }
    # quanto as transformers runs it and with 16-bit scales (equal bits, issue 14)
    assert [(r.bits, r.meta) for r in rows if r.kind == ec.QUANTO] == [
        (4, None),
        (4, ec.META_16),
        (2, None),
        (2, ec.META_16),
    ]
    assert ec.RECOMMENDED_2BIT in rows
    names = [r.name for r in rows]
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="ablations must be among"):
        ec.grid(ablations=["bogus"])
    # base rows with knobs on (eval --base-knobs)
    rows = ec.grid(
        bits=(4, 2), tails=(60,), base_knobs=("sinks", "fit"), ablation_bits=(), best_2bit=False, quanto_bits=()
    )
    assert [(r.bits, r.residual, r.sinks, r.fit_range) for r in rows[1:]] == [(4, 60, 4, True), (2, 60, 4, True)]
    with pytest.raises(ValueError, match="ablations must be among"):
        ec.grid(base_knobs=["bogus"])


def test_parse_settings():
    rows = ec.grid()
    assert ec.parse_settings("all", rows) == rows
    assert [s.kind for s in ec.parse_settings("quanto", rows)] == [ec.QUANTO] * 4
    with pytest.raises(ValueError, match="no setting matches 'nothing'"):
        ec.parse_settings("nothing", rows)


def test_agreement():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == {"leading": 4, "match": 1.0}
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4]) == {"leading": 1, "match": 0.75}
    assert agreement([5, 2], [1, 2]) == {"leading": 0, "match": 0.5}
    with pytest.raises(ValueError):
        agreement([], [])


def test_float32_cache_with_bf16_metadata_attends_over_its_own_dequantized_kv():
    """A float32 KVCache with bf16 scales/zeros: every element within one 4-bit step of
    its group's range, and the fused attention equals float64 attention over dense()."""
    tokens, residual = 320, 64
    k, v = _kv(tokens, torch.float32, seed=3)
    cache = torch.classes.nexuskv.KVCache(4, 64, -2, 0, False, 4, 64, -1, 0, residual, False, 0, 0, 0, torch.bfloat16)
    cache.append(k, v, None)
    K, V, lengths = cache.dense(None)
    assert lengths.tolist() == [tokens] and cache.compressed_nbytes() > 0
    # keys per channel over 64 tokens, values per token over 64 channels: one step = range / 15
    kg = k[:, :, :256].reshape(1, H, 4, 64, D)
    k_step = (kg.amax(3) - kg.amin(3)) / 15
    assert ((K[:, :, :256] - k[:, :, :256]).reshape(1, H, 4, 64, D).abs() <= k_step.unsqueeze(3)).all()
    v_step = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / 15
    assert ((V - v).abs() <= v_step).all()
    assert torch.equal(K[:, :, 256:], k[:, :, 256:])  # the tail is kept exactly
    q = torch.randn(1, 3 * H, 2, D)
    scores = q.double() @ K.double().repeat_interleave(3, 1).transpose(-1, -2) / D**0.5
    scores[..., 0, -1] = float("-inf")  # causal: the first of the two queries does not see the last key
    ref = scores.softmax(-1) @ V.double().repeat_interleave(3, 1)
    torch.testing.assert_close(cache.attend(q, None).double(), ref, atol=1e-5, rtol=1e-4)


def test_the_default_cache_row_is_what_cache_for_makes():
    """`eval --default-cache`'s row runs the cache cache_for(model) makes with no settings
    (tails, sinks, bits and groups alike): the same logits on a sliding-window model, and
    not those of the row without sinks."""
    from hf_helpers import tiny_model

    model = tiny_model("gemma2")  # sliding and full-attention layers
    ids = torch.randint(3, 200, (1, 200), generator=torch.Generator().manual_seed(0))
    s = ec.default_cache()
    assert (s.bits, s.residual + s.sinks, s.window_residual, s.sinks, s.fit_range) == (
        4,
        hf.DEFAULT_RESIDUAL,
        0,
        hf.DEFAULT_SINKS,
        True,
    )

    def logits(cache):  # in chunks, as the eval runs: a prefill alone attends over its own K/V
        with torch.no_grad():
            chunks = [ids[:, i : i + 64] for i in range(0, ids.shape[1], 64)]
            return torch.cat([model(c, past_key_values=cache, use_cache=True).logits for c in chunks], 1)

    ours = logits(hf.cache_for(model))
    assert torch.equal(logits(ec.make_cache(model, s)), ours)
    assert not torch.equal(logits(ec.make_cache(model, dataclasses.replace(s, sinks=0))), ours)
    assert not torch.equal(logits(ec.make_cache(model, dataclasses.replace(s, fit_range=False))), ours)
    # without sinks the default is min/max ranges (the fit raised ΔPPL without them)
    assert torch.equal(
        logits(hf.cache_for(model, sinks=0)),
        logits(ec.make_cache(model, dataclasses.replace(s, residual=hf.DEFAULT_RESIDUAL, sinks=0, fit_range=False))),
    )


def _policy(cache):
    """Per layer: (key group, value group, tail, sinks, fitted keys), from the C++ cache's config."""
    out = []
    for layer in cache.layers:
        sd = layer.cache.state_dict()
        out.append(
            tuple(int(sd["config." + k]) for k in ("key_group_size", "value_group_size", "residual", "sinks"))
            + (bool(int(sd.get("config.key_fit_range", torch.tensor(0)))),)
        )
    return out


def test_the_2bit_default_is_groups_of_128_and_the_tail_on_every_layer():
    """cache_for(model, bits=2) with no other settings (hf.default_policy): keys over 128
    tokens and values over 128 channels, a 128-token tail on full-attention and sliding-window
    layers alike, the 4 sinks on full-attention layers, fitted keys; eval's default_cache(2) row
    is that cache (the same logits, compressed chunks on the full-attention layer), not the
    4-bit policy at 2 bits.  A wider width on either side keeps the 4-bit policy; given
    settings win."""
    from hf_helpers import tiny_model

    model = tiny_model("gemma3")  # sliding, full, sliding (window 32)
    ids = torch.randint(3, 200, (1, 400), generator=torch.Generator().manual_seed(1))

    def logits(cache):
        with torch.no_grad():
            chunks = [ids[:, i : i + 64] for i in range(0, ids.shape[1], 64)]
            return torch.cat([model(c, past_key_values=cache, use_cache=True).logits for c in chunks], 1)

    low = (hf.LOW_BITS_GROUP_SIZE, hf.LOW_BITS_GROUP_SIZE, hf.LOW_BITS_RESIDUAL)
    assert low == (128, 128, 128)
    cache = hf.cache_for(model, bits=2)
    assert _policy(cache) == [low + (0, True), low + (hf.DEFAULT_SINKS, True), low + (0, True)]
    ours = logits(cache)
    assert int(cache.layers[1].cache.compressed_lengths()[0]) == 256  # 128 x floor((400 - 4 - 128) / 128)
    assert torch.equal(logits(ec.make_cache(model, ec.default_cache(2))), ours)
    assert not torch.equal(logits(hf.cache_for(model, bits=2, group_size=64, residual=60, window_residual=0)), ours)
    four = [(64, 64, 0, 0, True), (64, 64, hf.DEFAULT_RESIDUAL - hf.DEFAULT_SINKS, hf.DEFAULT_SINKS, True)]
    assert _policy(hf.cache_for(model, bits=2, value_bits=4))[:2] == four
    assert _policy(hf.cache_for(model, bits=4, value_bits=2))[:2] == four
    assert _policy(hf.cache_for(model))[:2] == four
    assert _policy(hf.cache_for(model, bits=2, group_size=32, residual=16))[:2] == [
        (32, 32, 16, 0, True),
        (32, 32, 16, 4, True),
    ]
    assert _policy(hf.cache_for(model, bits=2, window_residual=8, sinks=0))[:2] == [
        (128, 128, 8, 0, False),
        (128, 128, 128, 0, False),
    ]


@pytest.mark.parametrize("tokens", [63, 64, 68, 127, 128, 131, 200, 4096])
def test_the_default_sinks_cost_no_bytes_over_the_byte_policy(tokens):
    """cache_for's 4 default sinks count towards the 64 full-precision tokens of the byte policy
    (a 60-token tail): at every length the cache holds what a 64-token tail without sinks does."""
    from hf_helpers import tiny_model

    model = tiny_model("llama")
    g = model.config
    kv = torch.randn(
        1,
        g.num_key_value_heads,
        tokens,
        g.hidden_size // g.num_attention_heads,
        generator=torch.Generator().manual_seed(tokens),
    )

    def nbytes(cache):  # the bytes of the tokens held (capacity aside)
        for i in range(g.num_hidden_layers):
            cache.update(kv, kv, i)
        return ec.cache_bytes(cache)["used"]

    default = hf.cache_for(model, fused=False)
    assert nbytes(default) == nbytes(hf.cache_for(model, residual=64, sinks=0, fused=False))
    # a 64-token tail beside the sinks holds a group more at some lengths (4096: 60 tokens more)
    more = nbytes(hf.cache_for(model, residual=64, sinks=4, fused=False)) - nbytes(hf.cache_for(model, fused=False))
    assert more > 0 if tokens == 4096 else more >= 0
