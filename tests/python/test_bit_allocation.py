"""Mixed precision across layers (nexuskv.bit_allocation, cache_for(bit_map= / recipe=),
calibrate --bits-budget, eval --recipes): the greedy allocation against a brute-force
optimum, the bits each layer's C++ cache really holds and what its bytes and error say,
the sensitivity measurement's zero point, recipes with bit maps, and every bad input."""

import itertools
import json
import pathlib

import pytest
import torch

from hf_helpers import requires_model, tiny_model
from nexuskv import bit_allocation as ba
from nexuskv import eval_caches as ec
from nexuskv import evaluate
from nexuskv.hf import cache_for
from nexuskv.recipe import Recipe, calibrate

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _cost(bits):
    return (bits + 0.5, bits + 0.5)  # a format with 16-bit scale and zero per group of 64


def test_allocation_stays_in_budget_and_is_greedy_optimal_on_small_cases():
    """Every budget: the average bits stay within it; with convex per-tensor scores (each
    extra bit buys less than the one before, as measured) greedy reaches the brute-force
    minimum of the summed scores whenever whole steps fill the budget."""
    g = torch.Generator().manual_seed(0)
    choices = [2, 3, 4]
    for trial in range(20):
        drop1 = torch.rand(3, 2, generator=g) * 10  # 2 -> 3 bits
        drop2 = drop1 * torch.rand(3, 2, generator=g)  # 3 -> 4 bits: buys less
        scores = torch.stack([drop1 + drop2, drop2, torch.zeros(3, 2)], -1)
        for budget in (2.5, 3.0, 3.5, 4.0, 4.5):
            bit_map = ba.allocate(scores, choices, _cost, budget)
            assert ba.average_bits(bit_map, _cost) <= budget + 1e-9
            total = sum(float(scores[i, t, choices.index(bit_map[i][t])]) for i in range(3) for t in range(2))
            best = min(
                sum(float(scores[i, t, choices.index(b[2 * i + t])]) for i in range(3) for t in range(2))
                for b in itertools.product(choices, repeat=6)
                if sum(x + 0.5 for x in b) / 6 <= budget + 1e-9
            )
            assert total == pytest.approx(best, abs=1e-5), (trial, budget, bit_map)


def test_allocation_upgrades_the_most_sensitive_tensor_first_and_refuses_an_impossible_budget():
    scores = torch.tensor([[[3.0, 2.0, 1.0], [5.0, 1.0, 0.0]], [[9.0, 8.0, 0.0], [1.0, 1.0, 1.0]]])
    assert ba.allocate(scores, [2, 3, 4], _cost, 2.5) == [[2, 2], [2, 2]]
    assert ba.allocate(scores, [2, 3, 4], _cost, 3.0) == [[2, 2], [4, 2]]  # 9 -> 0 for two bits: 4.5 per bit
    assert ba.allocate(scores, [2, 3, 4], _cost, 3.5) == [[3, 3], [4, 2]]
    assert ba.allocate(scores, [2, 3, 4], _cost, 8.5) == [[4, 4], [4, 2]]  # no gain, no bits spent
    with pytest.raises(
        ValueError, match="keys at 2 and values at 2 bits everywhere take 2.500 effective bits, over the budget of 2.4"
    ):
        ba.allocate(scores, [2, 3, 4], _cost, 2.4)
    with pytest.raises(ValueError, match="choices must be ascending"):
        ba.allocate(scores, [4, 3, 2], _cost, 3.0)


def test_allocation_from_a_floor():
    """Values start at 3 bits: the two bits left go to the tensor that gains most per bit."""
    scores = torch.tensor([[[3.0, 2.0, 1.0], [5.0, 1.0, 0.0]], [[9.0, 8.0, 0.0], [1.0, 1.0, 1.0]]])
    assert ba.allocate(scores, [2, 3, 4], _cost, 3.0, floor=(2, 3)) == [[2, 3], [2, 3]]
    assert ba.allocate(scores, [2, 3, 4], _cost, 3.5, floor=(2, 3)) == [[2, 3], [4, 3]]
    assert ba.allocate(scores, [2, 3, 4], _cost, 4.5, floor=(4, 4)) == [[4, 4], [4, 4]]
    with pytest.raises(ValueError, match="keys at 4 and values at 4 bits everywhere take 4.500 effective bits"):
        ba.allocate(scores, [2, 3, 4], _cost, 3.5, floor=(4, 4))
    with pytest.raises(ValueError, match=r"floor \(2, 8\) must be among the choices \[2, 3, 4\]"):
        ba.allocate(scores, [2, 3, 4], _cost, 3.5, floor=(2, 8))


def test_choose_measures_each_floors_map_whole_and_overrules_misleading_scores():
    """Scores that say values never matter and keys do: from the lowest floor the greedy
    allocation leaves values at 2 bits; from the 4-bit floor the same budget gives 4 bits
    everywhere.  Measured whole on the window, the 4-bit map is closer to the reference,
    and choose returns it; every candidate fits the budget and has a KL > 0."""
    model = tiny_model("llama")
    windows = [torch.randint(3, 200, (1, 96), generator=torch.Generator().manual_seed(1))]
    scores = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]]])  # [layers, K/V, (2, 4) bits]
    cost = {2: (4.0, 4.0), 4: (6.0, 6.0)}.__getitem__  # groups of 16, bf16 scale and zero, head_dim 64
    lines = []
    bit_map, candidates = ba.choose(
        model, windows, scores, [2, 4], cost, 6.0, progress=lines.append, residual=16, group_size=16
    )
    assert [c["bit_map"] for c in candidates] == [[[4, 2], [4, 2]], [[4, 4], [4, 4]]]
    assert [c["floor"] for c in candidates] == [[2, 2], [2, 4]]  # (4, 2), (4, 4) repeat those maps
    assert [c["effective_bits"] for c in candidates] == [5.0, 6.0]
    assert all(c["kl"] > 0 for c in candidates) and len(lines) == 2
    assert candidates[1]["kl"] < candidates[0]["kl"] and bit_map == [[4, 4], [4, 4]]
    assert model.config._attn_implementation != "nexuskv"  # the model is left as it was
    with pytest.raises(ValueError, match="2 bits everywhere are over the budget of 3.0"):
        ba.choose(model, windows, scores, [2, 4], cost, 3.0)


def _config(layer, name):
    return int(layer.cache.state_dict()[f"config.{name}"])


def _bits(cache):
    return [(_config(layer, "key_bits"), _config(layer, "value_bits")) for layer in cache.layers]


def _filled(cache, model, tokens=160, seed=0):
    """Appends the same random K/V to every layer of `cache` (through update, the dense path)
    and returns what each layer then holds, dequantized (update hands a chunk's own tokens to
    the attention exact, as decoding sees them; the cache compresses them after)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    k = torch.randn(1, cfg.num_key_value_heads, tokens, d, generator=g)
    v = torch.randn(1, cfg.num_key_value_heads, tokens, d, generator=g)
    for i in range(len(cache.layers)):
        cache.update(k, v, i)
    return k, v, [cache.layers[i].cache.dense(None)[:2] for i in range(len(cache.layers))]


def test_each_layer_holds_the_bits_of_its_map_and_its_error_follows_them():
    """Layer 0 keys at 2 bits, values at 8; layer 1 the other way round: each layer's C++
    cache is configured so, and the dequantized K/V each holds are as far from the input
    as those bits allow (round to nearest: at most half a step of the group's range), the
    2-bit tensors far more than the 8-bit ones: the map reaches the stored codes."""
    model = tiny_model("llama")
    # min/max ranges: the half-step bound below is theirs (fitted ranges clamp the extremes)
    cache = cache_for(model, bit_map=[[2, 8], [8, 2]], residual=0, fused=False, fit_range=False)
    assert _bits(cache) == [(2, 8), (8, 2)]
    k, v, outs = _filled(cache, model, tokens=128)
    err = [((ko - k).abs().max().item(), (vo - v).abs().max().item()) for ko, vo in outs]
    span = max(k.max() - k.min(), v.max() - v.min()).item()
    assert err[0][0] <= span / 3 / 2 * 1.01 and err[1][1] <= span / 3 / 2 * 1.01  # 2 bits: 3 steps
    assert err[0][1] <= span / 255 / 2 * 1.05 and err[1][0] <= span / 255 / 2 * 1.05  # 8 bits: 255 steps
    assert err[0][0] > 10 * err[0][1] and err[1][1] > 10 * err[1][0]
    uniform = cache_for(model, bits=2, value_bits=8, residual=0, fused=False, fit_range=False)
    _, _, same = _filled(uniform, model, tokens=128)
    torch.testing.assert_close(outs[0][0], same[0][0], rtol=0, atol=0)  # layer 0 == a uniform 2/8 cache


def test_the_fused_path_reads_each_layers_own_bits():
    """Through the model with attention "nexuskv" (fused over the compressed cache): a map of
    2 bits everywhere gives exactly the logits of bits=2, and a map with layer 1 at 8 bits
    gives logits unlike both all-2 and all-8 (each layer's kernel reads its own codes)."""
    from nexuskv.hf import ATTN_IMPLEMENTATION, cache_argument

    model = tiny_model("llama")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 200, (1, 96), generator=torch.Generator().manual_seed(2))

    def logits(**kw):
        cache = cache_for(model, residual=16, group_size=16, **kw)
        with torch.no_grad():
            out = [model(ids[:, s : s + 16], **{cache_argument(model): cache}).logits for s in range(0, 96, 16)]
        assert all(layer.cache.state_dict()["lengths.compressed"].item() > 0 for layer in cache.layers)
        return torch.cat(out, 1)

    torch.testing.assert_close(logits(bit_map=[[2, 2], [2, 2]]), logits(bits=2), rtol=0, atol=0)
    mixed, two, eight = logits(bit_map=[[2, 2], [8, 8]]), logits(bits=2), logits(bits=8)
    assert (mixed - two).abs().max() > 1e-4 and (mixed - eight).abs().max() > 1e-4


def test_the_recipe_bit_map_reaches_the_cache_and_the_static_cache(tmp_path):
    model = tiny_model("llama")
    recipe, _ = calibrate(model, [torch.randint(3, 200, (1, 40))], {"model": "tiny llama"})
    recipe.bit_map = torch.tensor([[3, 4], [4, 2]], dtype=torch.int32)
    recipe.sensitivity = torch.rand(2, 2, 3)
    recipe.bits = {"budget": 3.25, "choices": [2, 3, 4], "group_size": 64, "residual": 128, "sinks": 0}
    path = str(tmp_path / "r.safetensors")
    recipe.save(path)
    back = Recipe.load(path)
    assert torch.equal(back.bit_map, recipe.bit_map) and torch.equal(back.sensitivity, recipe.sensitivity)
    assert back.bits == recipe.bits
    for r in (path, back):
        cache = cache_for(model, recipe=r)
        assert _bits(cache) == [(3, 4), (4, 2)]
    static = cache_for(model, recipe=path, static=True, max_cache_len=64)
    assert [(layer.settings["bits"], layer.settings["value_bits"]) for layer in static.layers] == [(3, 4), (4, 2)]


def test_cache_for_takes_the_groups_tails_and_sinks_the_recipe_was_allocated_for(tmp_path):
    """cache_for(model, recipe=FILE) with no other settings is the cache the recipe's map was
    allocated and measured with (its `bits` header: groups, tails, sinks), i.e. eval's row of
    the recipe (ec.from_recipe: the same logits); without a window_residual in the header the
    sliding-window layers take its tail too; settings given win (values then grouped as the
    keys given)."""
    model = tiny_model("gemma3")  # sliding, full, sliding
    ids = torch.randint(3, 200, (1, 160), generator=torch.Generator().manual_seed(2))
    recipe, _ = calibrate(model, [ids[:, :40]], {"model": "tiny gemma3"})
    recipe.bit_map = torch.tensor([[2, 4], [4, 2], [3, 3]], dtype=torch.int32)
    recipe.bits = {
        "budget": 3.25,
        "choices": [2, 3, 4],
        "group_size": 32,
        "value_group_size": 16,
        "residual": 24,
        "window_residual": 8,
        "sinks": 2,
        "fit_range": True,
    }
    path = str(tmp_path / "r.safetensors")
    recipe.save(path)

    def policy(cache):
        return [
            tuple(_config(layer, k) for k in ("key_group_size", "value_group_size", "residual", "sinks"))
            for layer in cache.layers
        ]

    def logits(cache):
        with torch.no_grad():
            return torch.cat(
                [
                    model(ids[:, i : i + 32], past_key_values=cache, use_cache=True).logits
                    for i in range(0, ids.shape[1], 32)
                ],
                1,
            )

    cache = cache_for(model, recipe=path)
    assert policy(cache) == [(32, 16, 8, 0), (32, 16, 24, 2), (32, 16, 8, 0)]
    ours = logits(cache)
    assert int(cache.layers[1].cache.compressed_lengths()[0]) > 0
    assert torch.equal(logits(ec.make_cache(model, ec.from_recipe(path))), ours)
    assert not torch.equal(
        logits(
            cache_for(model, recipe=path, group_size=32, value_group_size=16, residual=24, window_residual=8, sinks=0)
        ),
        ours,
    )
    assert policy(cache_for(model, recipe=path, group_size=64, residual=60, sinks=4)) == [
        (64, 64, 60, 0),
        (64, 64, 60, 4),
        (64, 64, 60, 0),
    ]
    assert _config(cache.layers[1], "key_fit_range") == 1
    for name, bad in (("group_size", 0), ("residual", "60"), ("sinks", -1), ("window_residual", 1.5)):
        broken = Recipe.load(path)
        broken.bits[name] = bad
        with pytest.raises(ValueError, match=rf"the recipe's bits.{name} must be an int >= [01], got"):
            cache_for(model, recipe=broken)
    del recipe.bits["window_residual"]
    recipe.bits["fit_range"] = False  # allocated for min/max ranges: the cache keeps them
    path = str(tmp_path / "r2.safetensors")  # another path: eval_caches caches recipes by path
    recipe.save(path)
    cache = cache_for(model, recipe=path)
    assert policy(cache) == [(32, 16, 24, 0), (32, 16, 24, 2), (32, 16, 24, 0)]
    assert "config.key_fit_range" not in cache.layers[1].cache.state_dict()  # written only when on
    assert torch.equal(logits(ec.make_cache(model, ec.from_recipe(path))), logits(cache))


def test_bad_bit_maps_and_recipes_fail_clearly(tmp_path):
    model, qwen3 = tiny_model("llama"), tiny_model("qwen3")
    for bad, message in [
        ([[2, 4]], "bit_map has 1 layers, the model 2"),
        ([[2, 4], [5, 4]], r"bit_map\[1\] = \[5, 4\]: key and value bits must be among 2, 3, 4, 8"),
        ([[2, 4], [4]], "one pair per layer"),
        ([[2, 4], [4.5, 4]], "one pair per layer"),
        ([], "one pair per layer"),
        ("2424", "one pair per layer"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache_for(model, bit_map=bad)
    from nexuskv.compressors import NQ

    with pytest.raises(ValueError, match="do not combine with compressor="):
        cache_for(model, bit_map=[[2, 2], [4, 4]], compressor=NQ(bits=4))
    recipe, _ = calibrate(model, [torch.randint(3, 200, (1, 40))], {"model": "tiny llama"})
    with pytest.raises(ValueError, match="this recipe has no bit map"):
        cache_for(model, recipe=recipe)
    recipe.bit_map = torch.tensor([[2, 2], [4, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="a bit_map or a recipe, not both"):
        cache_for(model, recipe=recipe, bit_map=[[2, 2], [4, 4]])
    with pytest.raises(ValueError, match="recipe measured on tiny llama does not fit this model"):
        cache_for(qwen3, recipe=recipe)
    with pytest.raises(TypeError, match="recipe must be a nexuskv.recipe.Recipe or a path"):
        cache_for(model, recipe=3)
    for tensor, message in [
        (torch.tensor([[2, 2], [5, 4]], dtype=torch.int32), r"bit_map holds \[5\]"),
        (torch.tensor([[2, 2]], dtype=torch.int32), r"bit_map must be int32 \[2, 2\]"),
        (torch.tensor([[2, 2], [4, 4]], dtype=torch.int64), r"bit_map must be int32"),
    ]:
        from safetensors.torch import load_file, save_file

        good = str(tmp_path / "good.safetensors")
        recipe.save(good)
        tensors = load_file(good)
        tensors["bit_map"] = tensor
        from safetensors import safe_open

        with safe_open(good, framework="pt") as f:
            meta = f.metadata()
        bad = str(tmp_path / "bad.safetensors")
        save_file(tensors, bad, metadata=meta)
        with pytest.raises(ValueError, match=message):
            Recipe.load(bad)


def test_a_version_1_recipe_still_loads_without_a_bit_map(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("llama")
    recipe, _ = calibrate(model, [torch.randint(3, 200, (1, 40))], {"model": "tiny llama"})
    path = str(tmp_path / "v1.safetensors")
    recipe.save(path)
    with safe_open(path, framework="pt") as f:
        header = json.loads(f.metadata()["nexuskv_recipe"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header["version"] = 1
    save_file(tensors, path, metadata={"nexuskv_recipe": json.dumps(header)})
    back = Recipe.load(path)
    assert back.bit_map is None and torch.equal(back.key_center, recipe.key_center)


def test_sensitivity_is_zero_at_the_reference_bits_and_positive_below():
    """At the reference's own bits the cache is the reference's, so the KL is exactly 0
    (the measurement compares like with like); at 2 bits it is > 0 for every tensor."""
    model = tiny_model("llama")
    windows = [torch.randint(3, 200, (1, 96), generator=torch.Generator().manual_seed(1))]
    scores = ba.sensitivity(model, windows, [2, 8], residual=16, group_size=16, sinks=0)
    assert scores.shape == (2, 2, 2)
    assert torch.equal(scores[..., 1], torch.zeros(2, 2))
    assert (scores[..., 0] > 0).all(), scores
    assert model.config._attn_implementation != "nexuskv"  # the model is left as it was


def test_eval_row_of_a_recipe_counts_each_layers_bits_and_meets_targets_by_budget(tmp_path):
    model = tiny_model("llama")
    recipe, _ = calibrate(model, [torch.randint(3, 200, (1, 40))], {"model": "tiny llama"})
    recipe.bit_map = torch.tensor([[2, 4], [4, 2]], dtype=torch.int32)
    recipe.bits = {"budget": 3.25, "choices": [2, 3, 4], "group_size": 64, "residual": 128, "sinks": 4}
    path = str(tmp_path / "mixed.safetensors")
    recipe.save(path)
    s = ec.from_recipe(path)
    assert s.name == "nexuskv recipe mixed.safetensors tail 128 K g64 sinks 4" and s.sinks == 4
    bits = ec.effective_bits(s, 64, torch.float32)  # d64: 2-bit 2.5, 4-bit 4.5 (bf16 scale + zero per 64)
    assert bits == {"keys": 3.5, "values": 3.5, "kv": 3.5}
    cache = ec.make_cache(model, s)
    assert [_config(layer, "key_bits") for layer in cache.layers] == [2, 4]
    rows = [
        dict(
            s.as_dict(),
            kind=ec.NEXUSKV,
            effective_bits={"kv": 3.2},
            delta_ppl_pct=0.7,
            repeats=[{}, {}],
            delta_ppl_pct_min=0.5,
            delta_ppl_pct_max=0.9,
        )
    ]
    lines = evaluate.targets(rows)
    assert any(
        line.startswith("3-bit class, 128-token tail, <= 3.25 effective bits: best ΔPPL +0.70 %")
        and line.endswith("target <= 0.75 %: met")
        for line in lines
    ), lines
    assert not any(line.startswith("2-bit class") for line in lines)
    # against one width everywhere with the same tail and sinks (not against another tail)
    uniform = [ec.nexuskv(3, 128, sinks=4), ec.nexuskv(3, 128), ec.nexuskv(3, 64, sinks=4)]
    rows += [
        dict(
            u.as_dict(),
            knobs=list(u.knobs),
            effective_bits={"kv": 3.5},
            delta_ppl_pct=1.1,
            repeats=[{"delta_ppl_pct": 1.2}, {"delta_ppl_pct": 1.0}],
        )
        for u in uniform
    ]
    rows[0]["repeats"] = [{"delta_ppl_pct": 0.6}, {"delta_ppl_pct": 0.8}]
    effects = evaluate.recipe_effects(rows)
    assert [(e["uniform"], e["verdict"]) for e in effects] == [(uniform[0].name, "lower")]


def test_calibrate_cli_allocates_a_bit_map_and_reuses_its_sensitivity(tmp_path, capsys):
    """`calibrate --bits-budget` on a tiny Llama (head_dim 64, two layers) saved as a model
    directory: the map meets the budget and spends it; a second budget, and other choices
    (8 bits is the reference: score 0), are allocated from the first file's sensitivity;
    settings or choices it was not measured with are refused."""
    import transformers as tf
    from test_eval_protocol import SENTENCES, bos_tokenizer

    from nexuskv.__main__ import main

    model_dir, text = tmp_path / "tiny", tmp_path / "text.txt"
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    tf.LlamaForCausalLM(config).save_pretrained(model_dir)
    bos_tokenizer().save_pretrained(model_dir)
    text.write_text(SENTENCES * 40)
    first, second = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    args = ["calibrate", "--model", str(model_dir), "--text", str(text), "--tokens", "160", "--windows", "1"]
    settings = ["--group-size", "16", "--residual", "16"]
    # groups of 16 with bf16 scale and zero: 2 bits cost 4.0, 4 bits 6.0
    assert main(args + settings + ["--bits-choices", "2,4", "--bits-budget", "5.0", "--out", first]) == 0
    assert "bit map (5.000 effective bits, budget 5.0)" in capsys.readouterr().out
    a = Recipe.load(first)
    assert a.bit_map.shape == (2, 2) and a.bits["effective_bits"] == 5.0 and (a.bit_map == 4).sum() == 2
    # the distinct maps it measured whole (floors 2/2, 2/4 and 4/2 fit 5.0 bits; keys at 4 and values
    # at 4 differ), the chosen one of least KL
    candidates = a.bits["candidates"]
    maps = [c["bit_map"] for c in candidates]
    assert len(maps) >= 2 and all(maps.count(m) == 1 for m in maps) and [[4, 2], [4, 2]] in maps
    chosen = [c for c in candidates if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["bit_map"] == a.bit_map.tolist()
    assert chosen[0]["kl"] == min(c["kl"] for c in candidates)
    assert (a.sensitivity[..., 0] > a.sensitivity[..., 1]).all()  # 2 bits move the model more than 4
    reuse = settings + ["--sensitivity-from", first, "--out", second]
    assert main(args + reuse + ["--bits-choices", "2,4", "--bits-budget", "6.0"]) == 0
    b = Recipe.load(second)
    assert torch.equal(b.sensitivity, a.sensitivity) and (b.bit_map == 4).all()
    assert main(args + reuse + ["--bits-choices", "4,8", "--bits-budget", "8.0"]) == 0
    c = Recipe.load(second)
    assert torch.equal(c.sensitivity[..., 0], a.sensitivity[..., 1])
    assert torch.equal(c.sensitivity[..., 1], torch.zeros(2, 2))
    assert (c.bit_map == 8).sum() == 2 and c.bits["effective_bits"] == 8.0
    capsys.readouterr()
    assert main(args + reuse + ["--bits-choices", "3,4", "--bits-budget", "6.0"]) == 1
    assert "measured at [2, 4] bits, not at [3]" in capsys.readouterr().err
    other = ["--group-size", "16", "--residual", "32"] + reuse[4:]
    assert main(args + other + ["--bits-choices", "2,4", "--bits-budget", "6.0"]) == 1
    assert "measured with other settings: residual 16 (now 32)" in capsys.readouterr().err
    assert main(args + reuse + ["--bits-choices", "2,4", "--bits-budget", "6.0", "--fit-range"]) == 1
    assert "measured with other settings: fit_range False (now True)" in capsys.readouterr().err
    assert main(args + reuse + ["--bits-choices", "2,4", "--bits-budget", "6.0", "--window-residual", "0"]) == 1
    assert "measured with other settings: window_residual None (now 0)" in capsys.readouterr().err
    # --window-residual: the sliding layers' tail the map is allocated for, recorded for eval --recipes
    windowed = str(tmp_path / "w.safetensors")
    assert (
        main(
            args
            + settings
            + ["--bits-choices", "2,4", "--bits-budget", "5.0", "--window-residual", "0", "--out", windowed]
        )
        == 0
    )
    assert Recipe.load(windowed).bits["window_residual"] == 0 and a.bits["window_residual"] is None
    from nexuskv import eval_caches as ec

    assert ec.from_recipe(windowed).window_residual == 0 and ec.from_recipe(first).window_residual is None
    # --fit-range: measured with fitted key ranges (other scores), recorded for eval --recipes
    fitted = str(tmp_path / "f.safetensors")
    assert (
        main(args + settings + ["--bits-choices", "2,4", "--bits-budget", "5.0", "--fit-range", "--out", fitted]) == 0
    )
    f = Recipe.load(fitted)
    assert f.bits["fit_range"] is True and not torch.equal(f.sensitivity, a.sensitivity)
    assert a.bits["fit_range"] is False
    assert ec.from_recipe(fitted).fit_range and not ec.from_recipe(first).fit_range
    # the chosen map measured with the values fitted too: asked for when that lowered its KL
    chosen_kl = next(c["kl"] for c in f.bits["candidates"] if c["chosen"])
    assert f.bits["value_fit_range"] == (f.bits["value_fit_kl"] < chosen_kl) and "value_fit_range" not in a.bits
    assert ec.from_recipe(fitted).value_fit_range == f.bits["value_fit_range"]
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)

    def value_fit(cache):  # from the C++ cache's saved config
        return int(cache.layers[0].cache.state_dict().get("config.value_fit_range", torch.tensor(0))) == 1

    for asks in (True, False):  # cache_for takes the recipe's choice unless told otherwise
        f.bits["value_fit_range"] = asks
        assert value_fit(cache_for(model, recipe=f)) == asks
        assert not value_fit(cache_for(model, recipe=f, value_fit_range=False))
        assert cache_for(model, recipe=f, static=True, max_cache_len=64) is not None  # no fit there: min/max
    # one width offered: the map is uniform, no sensitivity measured (it could not change the map),
    # the value fit still decided on the windows' whole KL
    capsys.readouterr()
    uniform = str(tmp_path / "u.safetensors")
    assert main(args + settings + ["--bits-choices", "4", "--bits-budget", "6.0", "--fit-range", "--out", uniform]) == 0
    out = capsys.readouterr().out
    assert "sensitivity: not measured (one choice, 4 bits" in out and "layer 0 K" not in out
    u = Recipe.load(uniform)
    assert (u.bit_map == 4).all() and u.bits["sensitivity_windows"] == 0 and not u.sensitivity.any()
    assert [c["bit_map"] for c in u.bits["candidates"]] == [[[4, 4], [4, 4]]] and "value_fit_kl" in u.bits


@requires_model[0]
@requires_model[1]
def test_the_committed_smollm2_recipes_fit_smollm2():
    from nexuskv.models import load_model

    model, _ = load_model(torch.float32)
    for path in sorted((BENCHMARKS / "recipes").glob("*-smol-*.safetensors")):
        recipe = Recipe.load(str(path))
        assert _bits(cache_for(model, recipe=str(path))) == [tuple(row) for row in recipe.bit_map.tolist()]


def test_the_committed_recipes_fit_their_budgets_and_runs():
    """Every committed recipe (benchmarks/recipes): its map's effective bits, recomputed from
    the format with the groups it was allocated for, are what its header says and within its
    budget; where it holds candidates (bit_allocation.choose), the map is the one of least KL;
    every committed run of it (benchmarks/mixed-*.json) reports those bits."""
    recipes = {p.name: Recipe.load(str(p)) for p in sorted((BENCHMARKS / "recipes").glob("*.safetensors"))}
    assert recipes
    runs = [json.loads(p.read_text()) for p in sorted(BENCHMARKS.glob("mixed-*.json"))]
    for name, r in recipes.items():
        b = r.bits
        head_dim = r.key_center.shape[-1]
        costs = {
            x: ba.tensor_bits(x, head_dim, b["group_size"], b["value_group_size"], torch.bfloat16, torch.float32)
            for x in (2, 3, 4, 8)
        }
        reached = ba.average_bits(r.bit_map.tolist(), costs.__getitem__)
        assert reached == pytest.approx(b["effective_bits"], abs=1e-4) and reached <= b["budget"] + 1e-9, name
        if "candidates" in b:
            chosen = min(b["candidates"], key=lambda c: c["kl"])
            assert chosen["bit_map"] == r.bit_map.tolist() and chosen["chosen"], name
            assert all(c["effective_bits"] <= b["budget"] + 1e-9 for c in b["candidates"]), name
        rows = [row for d in runs for row in d["rows"] if row.get("recipe") == name]
        assert all(row["effective_bits"]["kv"] == pytest.approx(reached, abs=1e-9) for row in rows), name
