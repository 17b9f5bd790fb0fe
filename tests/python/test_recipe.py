"""Recipes (nexuskv.recipe) and `python -m nexuskv calibrate`: the key means against an
independent float64 computation of the post-RoPE keys, the file round trip, every way a
file or a model can be wrong, and why centering is allowed at all (softmax is blind to a
common key shift, soft-capping is not)."""

import json
import math
from pathlib import Path

import pytest
import torch

from hf_helpers import requires_model, tiny_model
from nexuskv.cache import make_cache
from nexuskv.recipe import Recipe, calibrate, model_facts

COMMITTED = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "recipes").glob("*.safetensors"))


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
    "damage, message, cpp_message",
    [
        ("missing", "no such file", "no such file"),
        ("garbage", "not a safetensors file", "not a safetensors file: its header is not JSON"),
        ("truncated", "not a safetensors file", "not a safetensors file: its header claims"),
        ("no_header", "no nexuskv_recipe header", "no nexuskv_recipe header"),
        ("list_header", "no nexuskv_recipe header", "the nexuskv_recipe header must be a JSON object, got an array"),
        ("no_fact", "the header's model facts lack 'head_dim'", "model facts need head_dim as an integer >= 1"),
        (
            "version",
            "version 3; this nexuskv reads 'nexuskv-recipe' versions 1, 2",
            "version 3; this nexuskv reads 'nexuskv-recipe' versions 1 to 2",
        ),
        ("format", "format 'other'", "format 'other'"),
        ("no_tensor", "no key_center tensor", "no key_center tensor"),
        ("shape", r"key_center must be float32 \[2, 2, 16\]", r"key_center must be float32 \[2, 2, 16\]"),
        ("nan", "key_center holds NaN or Inf", "key_center holds NaN or Inf"),
        ("dtype", "key_center must be float32", 'tensor "key_center" must be F32'),
        ("source", "the header's source must be an object", "the header's source must be an object"),
        ("model_str", "the header's model facts must be an object", "the header's model facts must be an object"),
        ("bit_map_bits", r"bit_map holds \[5\]", r"bit_map holds 5 \(layer 1\)"),
        ("bit_map_shape", r"bit_map must be int32 \[2, 2\]", r"bit_map must be int32 \[2, 2\]"),
        ("bit_map_dtype", r"bit_map must be int32", 'tensor "bit_map" must be I32'),
        ("sensitivity_alone", "sensitivity must be", "sensitivity must be"),
        ("meta_dtype", "bits.meta_dtype must be one of", "bits.meta_dtype must be one of"),
    ],
)
def test_bad_files_fail_clearly(tmp_path, damage, message, cpp_message):
    """Python's reader (ValueError) and the C++ one (torch.classes.nexuskv.Recipe: RuntimeError
    naming the path) refuse the same files for the same reasons."""
    from safetensors.torch import save_file

    model = tiny_model("llama")
    good = str(tmp_path / "good.safetensors")
    recipe = calibrate(model, _windows(model.config.vocab_size, n=1))[0]
    recipe.bit_map = torch.full((2, 2), 4, dtype=torch.int32)  # a version-2 file with a bit map
    recipe.bits = {"group_size": 64, "meta_dtype": "bfloat16"}
    recipe.save(good)
    header, tensors = _header(good)
    path = str(tmp_path / "bad.safetensors")
    if damage == "garbage":
        open(path, "wb").write(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    elif damage == "truncated":
        open(path, "wb").write(open(good, "rb").read()[:100])
    elif damage == "no_header":
        save_file(tensors, path)
    elif damage != "missing":
        if damage == "version":
            header["version"] = 3
        elif damage == "format":
            header["format"] = "other"
        elif damage == "list_header":
            header = [header]
        elif damage == "no_fact":
            del header["model"]["head_dim"]
        elif damage == "source":
            header["source"] = "poems"
        elif damage == "model_str":
            header["model"] = "llama"
        elif damage == "meta_dtype":
            header["bits"]["meta_dtype"] = "int8"
        elif damage == "no_tensor":
            tensors = {"other": tensors["key_center"]}
        elif damage == "shape":
            tensors["key_center"] = tensors["key_center"][:, :, :8].contiguous()
        elif damage == "nan":
            tensors["key_center"][1, 0, 3] = math.nan
        elif damage == "dtype":
            tensors["key_center"] = tensors["key_center"].half()
        elif damage == "bit_map_bits":
            tensors["bit_map"][1, 0] = 5
        elif damage == "bit_map_shape":
            tensors["bit_map"] = tensors["bit_map"][:1].contiguous()
        elif damage == "bit_map_dtype":
            tensors["bit_map"] = tensors["bit_map"].long()
        elif damage == "sensitivity_alone":
            tensors["sensitivity"] = torch.zeros(2, 2, 3)
            del tensors["bit_map"]
        save_file(tensors, path, metadata={"nexuskv_recipe": json.dumps(header)})
    with pytest.raises(ValueError, match=message):
        Recipe.load(path)
    with pytest.raises(RuntimeError, match=f"Recipe {path}: .*{cpp_message}"):
        torch.classes.nexuskv.Recipe(path)
    Recipe.load(good), torch.classes.nexuskv.Recipe(good)  # the undamaged file loads in both


def _empty_of(dtype: int) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def test_recipes_are_committed():
    assert len(COMMITTED) >= 10  # the runs of RESULTS.md "Mixed precision" (the test below is over them)


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_the_cpp_reader_reads_what_python_reads(path):
    """torch.classes.nexuskv.Recipe (nexuskv/recipe.h: LibTorch and TorchScript) on every
    committed recipe: the same facts, key means and bit map as nexuskv.recipe, bit for bit, and
    the integer and boolean settings of the header's bits."""
    py, cpp = Recipe.load(str(path)), torch.classes.nexuskv.Recipe(str(path))
    facts = py.model
    assert cpp.path() == str(path) and cpp.version() == 2 and cpp.model_type() == facts["model_type"]
    assert (cpp.layers(), cpp.kv_heads(), cpp.head_dim()) == (
        facts["num_hidden_layers"],
        facts["num_key_value_heads"],
        facts["head_dim"],
    )
    assert torch.equal(cpp.key_center(), py.key_center)
    assert cpp.has_bit_map() and torch.equal(cpp.bit_map(), py.bit_map)
    by_layer = [(cpp.key_bits(i), cpp.value_bits(i)) for i in range(cpp.layers())]
    assert by_layer == [tuple(r) for r in py.bit_map.tolist()]
    settings = {k: v for k, v in py.bits.items() if isinstance(v, int) and not isinstance(v, bool)}
    assert {"group_size", "residual", "sinks"} <= settings.keys()
    assert all(cpp.setting(k) == v for k, v in settings.items())
    assert cpp.setting("candidates") is None and cpp.setting("no such setting") is None
    flags = {k: v for k, v in py.bits.items() if isinstance(v, bool)}
    assert all(cpp.flag(k) == v for k, v in flags.items())
    assert cpp.flag("fit_range") == flags.get("fit_range")  # None in recipes from before fitted ranges
    assert cpp.flag("group_size") is None  # an integer, not a flag
    # A dtype is an int outside TorchScript; compare through a tensor of that dtype made there.
    assert torch.jit.script(_empty_of)(cpp.meta_dtype()).dtype == getattr(torch, py.bits["meta_dtype"])
    cpp.check_geometry(cpp.layers(), cpp.kv_heads(), cpp.head_dim())
    with pytest.raises(
        RuntimeError,
        match=rf"was measured on another model: layers {cpp.layers() + 1} \(recipe: "
        rf"{cpp.layers()}\), head_dim 7 \(recipe: {cpp.head_dim()}\); calibrate on this model",
    ):
        cpp.check_geometry(cpp.layers() + 1, cpp.kv_heads(), 7)
    for bad in (-1, cpp.layers()):
        with pytest.raises(RuntimeError, match=rf"key_bits: layer must be in \[0, {cpp.layers()}\), got {bad}"):
            cpp.key_bits(bad)


def test_a_recipe_without_bit_map_in_cpp(tmp_path):
    """A version-1 recipe (key means only) loads in C++; what needs a bit map says so."""
    from safetensors.torch import save_file

    model = tiny_model("llama")
    recipe = calibrate(model, _windows(model.config.vocab_size, n=1))[0]
    path = str(tmp_path / "v1.safetensors")
    header = {"format": "nexuskv-recipe", "version": 1, "model": recipe.model}
    save_file({"key_center": recipe.key_center}, path, metadata={"nexuskv_recipe": json.dumps(header)})
    cpp = torch.classes.nexuskv.Recipe(path)
    assert cpp.version() == 1 and not cpp.has_bit_map() and cpp.bit_map() is None and cpp.meta_dtype() is None
    assert torch.equal(cpp.key_center(), Recipe.load(path).key_center)
    with pytest.raises(RuntimeError, match="value_bits needs a bit map, and this recipe has none"):
        cpp.value_bits(0)


def _layer_cache(path: str, layer: int, residual: int) -> torch.classes.nexuskv.KVCache:
    """A layer's cache as a TorchScript program builds it from a recipe (scripted below):
    the layer's bits from the map, the groups, sinks and meta dtype it was allocated for."""
    r = torch.classes.nexuskv.Recipe(path)
    group = r.setting("group_size")
    value_group = r.setting("value_group_size")
    sinks = r.setting("sinks")
    assert group is not None and value_group is not None and sinks is not None
    return torch.classes.nexuskv.KVCache(
        r.key_bits(layer),
        group,
        -2,
        0,
        False,
        r.value_bits(layer),
        value_group,
        -1,
        0,
        residual,
        False,
        0,
        sinks,
        0,
        r.meta_dtype(),
        None,
    )


def test_torchscript_builds_each_layers_cache_from_a_recipe():
    """A scripted function builds every layer's KVCache from the C++ reader; each holds the
    layer's bits: the same bytes and the same dequantized K/V as the cache Python builds from
    nexuskv.recipe for that layer (make_cache), and the bytes differ where the bits do."""
    scripted = torch.jit.script(_layer_cache)
    path = str(next(p for p in COMMITTED if "smol" in p.name))
    py = Recipe.load(path)
    b = py.bits
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, py.model["num_key_value_heads"], 200, py.model["head_dim"], generator=g).bfloat16()
    v = torch.randn(k.shape, generator=g).bfloat16()
    seen = {}
    for layer, (kb, vb) in enumerate(py.bit_map.tolist()):
        ts = scripted(path, layer, 16)
        ref = make_cache(
            key_bits=kb,
            key_group_size=b["group_size"],
            value_bits=vb,
            value_group_size=b["value_group_size"],
            residual=16,
            sinks=b["sinks"],
            meta_dtype=getattr(torch, b["meta_dtype"]),
        )
        for c in (ts, ref):
            c.append(k, v, None)
        assert ts.compressed_lengths().tolist() == [200 - 16 - b["sinks"] - (200 - 16 - b["sinks"]) % b["group_size"]]
        assert ts.nbytes() == ref.nbytes() and ts.compressed_nbytes() == ref.compressed_nbytes()
        for x, y in zip(ts.dense(None), ref.dense(None)):
            assert torch.equal(x, y)
        seen.setdefault((kb, vb), ts.compressed_nbytes())
    assert len(set(seen.values())) == len(seen) > 1  # the map's widths really differ in bytes


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


def test_damaged_bytes_never_crash_the_cpp_reader(tmp_path):
    """600 random damages of a real recipe's bytes (flipped bytes in the header or the data,
    cuts, insertions, a forged header length): the C++ reader loads the file or raises a
    RuntimeError naming it, never crashes or hangs (the sanitizer job runs this under ASan and
    UBSan); whatever it loads, Python's reader loads too, with the same key means and bit map."""
    import random

    good = open(COMMITTED[0], "rb").read()
    n = int.from_bytes(good[:8], "little")
    rng = random.Random(0)
    path = str(tmp_path / "damaged.safetensors")
    loaded = refused = 0
    for case in range(600):
        b = bytearray(good)
        kind = case % 4
        if kind == 0:  # bytes of the JSON header
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(8, 8 + n)] = rng.randrange(256)
        elif kind == 1:  # anywhere, the tensor data included
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == 2:  # a cut or an insertion
            at = rng.randrange(len(b))
            b = b[:at] if rng.random() < 0.5 else b[:at] + bytes(rng.randrange(256) for _ in range(5)) + b[at:]
        else:  # a forged header length
            b[:8] = rng.choice([0, 1, n - 1, n + 1, len(b), 2**63, 2**64 - 1]).to_bytes(8, "little")
        open(path, "wb").write(bytes(b))
        try:
            cpp = torch.classes.nexuskv.Recipe(path)
        except RuntimeError as e:
            assert f"Recipe {path}: " in str(e)
            refused += 1
            continue
        loaded += 1
        py = Recipe.load(path)
        assert torch.equal(cpp.key_center(), py.key_center)
        assert cpp.has_bit_map() == (py.bit_map is not None)
        if py.bit_map is not None:
            assert torch.equal(cpp.bit_map(), py.bit_map)
    assert refused > 300 and loaded > 0  # both outcomes were exercised
