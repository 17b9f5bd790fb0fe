"""Recipes (nexuskv.recipe) and `python -m nexuskv calibrate`: the key means against an
independent float64 computation of the post-RoPE keys, the file round trip, every way a
file or a model can be wrong, and why centering is allowed at all (softmax is blind to a
common key shift, soft-capping is not)."""

import json
import math

import pytest
import torch

from hf_helpers import requires_model, tiny_model
from nexuskv.recipe import Recipe, calibrate, model_facts


def _windows(vocab, n=2, tokens=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, tokens), generator=g) for _ in range(n)]


def _keys_by_hand(model, ids):
    """Post-RoPE keys of every layer of a Llama, [kv_heads, tokens, head_dim] float64, from
    the k_proj outputs (forward hooks) and the model's rotary embedding, not through the
    attention function calibrate reads them from."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg, raw = model.config, []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: raw.append(o.detach()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(ids)
            pos = torch.arange(ids.shape[1])[None]
            cos, sin = model.model.rotary_emb(raw[0], pos)
    finally:
        for h in hooks:
            h.remove()
    d = cfg.hidden_size // cfg.num_attention_heads
    out = []
    for k in raw:
        k = k.view(1, ids.shape[1], cfg.num_key_value_heads, d).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        out.append(k[0].double())
    return out


def test_key_means_match_float64_keys_computed_by_hand():
    model = tiny_model("llama")
    windows = _windows(model.config.vocab_size)
    recipe, spread = calibrate(model, windows, {"model": "tiny llama"})
    per_window = [_keys_by_hand(model, w) for w in windows]
    for i in range(model.config.num_hidden_layers):
        keys = torch.cat([w[i] for w in per_window], 1)  # [kv_heads, all tokens, d]
        mean = keys.mean(1)
        torch.testing.assert_close(recipe.key_center[i].double(), mean, rtol=0, atol=1e-5)
        rms = (keys - mean[:, None]).square().sum(-1).mean(1).sqrt()
        torch.testing.assert_close(spread[i].double(), rms, rtol=1e-4, atol=1e-5)
        assert mean.abs().max() > 1e-3  # the test compares something that is not zero
    assert recipe.model == model_facts(model.config)
    assert recipe.model["num_hidden_layers"] == 2 and recipe.model["head_dim"] == 16


def test_centering_keys_leaves_attention_unchanged_without_softcap_only():
    """softmax(q . (k - m)) == softmax(q . k) for any m, row by row (float64); with tanh
    soft-capping it is not, which is why a recipe is refused on soft-capped layers."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 16, generator=g, dtype=torch.float64) for _ in range(3))
    k = k + 4 * torch.randn(16, generator=g, dtype=torch.float64)  # a large common offset
    m = torch.randn(16, generator=g, dtype=torch.float64) * 3

    def attend(keys, cap=None):
        s = q @ keys.T / 4
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        return torch.softmax(s, -1) @ v

    torch.testing.assert_close(attend(k - m), attend(k), rtol=0, atol=1e-12)
    assert (attend(k - m, cap=2.0) - attend(k, cap=2.0)).abs().max() > 1e-3


def test_round_trip_is_exact(tmp_path):
    model = tiny_model("llama")
    recipe, _ = calibrate(model, _windows(model.config.vocab_size), {"model": "tiny llama", "tokens": 40})
    path = str(tmp_path / "r.safetensors")
    recipe.save(path)
    back = Recipe.load(path)
    assert torch.equal(back.key_center, recipe.key_center)
    assert back.model == recipe.model and back.source == recipe.source
    back.check_model(model_facts(model.config))  # its own model passes


def test_another_model_is_refused_naming_what_differs():
    llama, qwen3 = tiny_model("llama"), tiny_model("qwen3")
    recipe, _ = calibrate(llama, _windows(llama.config.vocab_size, n=1), {"model": "tiny llama"})
    with pytest.raises(
        ValueError,
        match=r"recipe measured on tiny llama does not fit .*model_type 'qwen3' "
        r"\(recipe: 'llama'\).*head_dim 32 \(recipe: 16\)",
    ):
        recipe.check_model(model_facts(qwen3.config))


def _header(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["nexuskv_recipe"]), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "no such file"),
        ("garbage", "not a safetensors file"),
        ("no_header", "no nexuskv_recipe header"),
        ("list_header", "no nexuskv_recipe header"),
        ("no_fact", "the header's model facts lack 'head_dim'"),
        ("version", "version 3; this nexuskv reads 'nexuskv-recipe' versions 1, 2"),
        ("no_tensor", "no key_center tensor"),
        ("shape", r"key_center must be float32 \[2, 2, 16\]"),
        ("nan", "key_center holds NaN or Inf"),
        ("dtype", "key_center must be float32"),
        ("source", "the header's source must be an object"),
        ("model_str", "the header's model facts must be an object"),
    ],
)
def test_bad_files_fail_clearly(tmp_path, damage, message):
    from safetensors.torch import save_file

    model = tiny_model("llama")
    good = str(tmp_path / "good.safetensors")
    calibrate(model, _windows(model.config.vocab_size, n=1))[0].save(good)
    header, tensors = _header(good)
    path = str(tmp_path / "bad.safetensors")
    if damage == "garbage":
        open(path, "wb").write(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    elif damage == "no_header":
        save_file(tensors, path)
    elif damage != "missing":
        if damage == "version":
            header["version"] = 3
        elif damage == "list_header":
            header = [header]
        elif damage == "no_fact":
            del header["model"]["head_dim"]
        elif damage == "source":
            header["source"] = "poems"
        elif damage == "model_str":
            header["model"] = "llama"
        elif damage == "no_tensor":
            tensors = {"other": tensors["key_center"]}
        elif damage == "shape":
            tensors["key_center"] = tensors["key_center"][:, :, :8].contiguous()
        elif damage == "nan":
            tensors["key_center"][1, 0, 3] = math.nan
        elif damage == "dtype":
            tensors["key_center"] = tensors["key_center"].half()
        save_file(tensors, path, metadata={"nexuskv_recipe": json.dumps(header)})
    with pytest.raises(ValueError, match=message):
        Recipe.load(path)


def test_calibrate_cli_needs_out_and_checks_its_folder(capsys, monkeypatch):
    from nexuskv import models
    from nexuskv.__main__ import main

    def never(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", never)
    monkeypatch.setattr(models, "check_model_path", lambda path: None)
    monkeypatch.setattr(models, "check_text_path", lambda path: None)
    with pytest.raises(SystemExit) as e:
        main(["calibrate"])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    assert main(["calibrate", "--out", "/nonexistent/dir/r.safetensors"]) == 2
    assert "--out /nonexistent/dir/r.safetensors: no such directory" in capsys.readouterr().err
    # the bit map's arguments (calibrate --bits-budget), also before the model is loaded
    assert main(["calibrate", "--out", "/tmp/r.safetensors", "--bits-choices", "2,5"]) == 2
    assert "--bits-choices must be a comma-separated list among [2, 3, 4, 8], got '2,5'" in capsys.readouterr().err
    assert main(["calibrate", "--out", "/tmp/r.safetensors", "--bits-budget", "0"]) == 2
    assert "--bits-budget must be > 0" in capsys.readouterr().err


@requires_model[0]
@requires_model[1]
def test_calibrate_cli_on_the_real_model(tmp_path, capsys):
    """SmolLM2: the keys' channel means are as large as their spread around them (what
    centering takes out of a per-token key group's range), in every layer."""
    from nexuskv.__main__ import main

    out = str(tmp_path / "smollm2.safetensors")
    assert main(["calibrate", "--tokens", "128", "--windows", "1", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    recipe = Recipe.load(out)
    assert recipe.model["num_hidden_layers"] == 30 and recipe.model["num_key_value_heads"] == 3
    assert recipe.source["tokens"] == 128 and recipe.source["windows"] == 1
    norms = recipe.key_center.norm(dim=-1)  # [layers, kv_heads]
    assert norms.mean(-1).min() > 3.0, norms.mean(-1)
