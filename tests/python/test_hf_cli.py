"""The CLIs (demo, report, eval): arguments are checked before any model is loaded and
a user error is one line on stderr, every flag documents its default, and --model takes
a local Hugging Face directory (here a tiny sliding-window model saved with the real
model's tokenizer)."""

import json
import time

import pytest
import torch

from hf_helpers import requires_model

COMMANDS = ["demo", "report", "eval"]


def _run(argv, capsys):
    from nexuskv.__main__ import main

    t0 = time.perf_counter()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err, time.perf_counter() - t0


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "bad, message",
    [
        (["--text", "/nonexistent"], "--text /nonexistent: no such file"),
        (["--model", "/nonexistent"], "--model /nonexistent: not a Hugging Face model directory"),
        (["--model", "/nonexistent/x.gguf"], "--model /nonexistent/x.gguf: no such GGUF file"),
        (["--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: no such directory"),
    ],
)
def test_bad_paths_fail_fast_in_one_line(command, bad, message, capsys, monkeypatch):
    from nexuskv import models

    def never(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", never)
    if "--model" not in bad:
        monkeypatch.setattr(models, "check_model_path", lambda path: None)
    rc, out, err, seconds = _run([command] + bad, capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and seconds < 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
        (["eval", "--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
        (["eval", "--tokens", "x"], "--tokens must be an integer, got 'x'"),
        (["report", "--queries", "-1"], "--queries must be >= 1, got -1"),
        (["demo", "--bits", "5"], "invalid choice: 5"),
    ],
)
def test_bad_numbers_fail_fast_in_one_line(argv, message, capsys):
    rc, out, err, seconds = _run(argv, capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert seconds < 5


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_its_default(command):
    from nexuskv.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
    text = sub.format_help()
    assert text.count("(default:") >= len(sub._actions) - 1


@pytest.mark.parametrize("command", ["demo", "calibrate"])
def test_the_sinks_default_is_cache_fors(command):
    """A recipe is allocated for a number of sinks and the demo's cache keeps sinks as
    cache_for's does: both CLIs default to the sinks cache_for keeps when given none."""
    import inspect

    import nexuskv.hf as nhf
    from nexuskv.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    assert sub.get_default("sinks") == nhf.DEFAULT_SINKS == 4
    assert inspect.signature(nhf.cache_for).parameters["sinks"].default is None  # None: DEFAULT_SINKS, 0 if static


def test_the_demos_cache_is_cache_fors_unless_told():
    """demo --bits B with no --group-size / --residual runs the cache cache_for(model, bits=B,
    sinks=--sinks) makes (ec.default_cache: 2 bits its groups of 128 and 128-token tails, 4 bits
    the byte policy); the flags change only what they name."""
    import dataclasses

    from nexuskv import demo
    from nexuskv import eval_caches as ec
    from nexuskv.__main__ import build_parser

    def setting(*argv):
        return demo.setting_from_args(build_parser().parse_args(["demo", *argv]))

    assert setting() == ec.default_cache(4) and setting("--bits", "2") == ec.default_cache(2)
    assert setting("--sinks", "0") == ec.default_cache(4, sinks=0) == ec.nexuskv(4, 64, window_residual=0)
    assert setting("--bits", "2", "--residual", "32", "--group-size", "32", "--rotate", "--min-max") == (
        dataclasses.replace(
            ec.default_cache(2), residual=32, group_size=32, value_group_size=32, rotate=True, fit_range=False
        )
    )
    assert ec.default_cache(2).group_size == 128 and ec.default_cache(4).residual == 60


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Mistral (sliding window 32) saved as a Hugging Face directory, with the
    real model's tokenizer (its vocabulary sizes the embedding)."""
    import transformers as tf

    from nexuskv import models

    tok = tf.AutoTokenizer.from_pretrained(models.gguf_dir(), gguf_file=models.GGUF_FILE)
    cfg = tf.MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-mistral")
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _with(marks):
    def wrap(f):
        for m in marks:
            f = m(f)
        return f

    return wrap


@_with(requires_model)
def test_demo_and_eval_run_a_local_model_directory(tiny_model_dir, tmp_path, capsys):
    rc, out, err, _ = _run(
        [
            "demo",
            "--model",
            tiny_model_dir,
            "--new-tokens",
            "3",
            "--context-tokens",
            "64",
            "--residual",
            "16",
            "--group-size",
            "16",
            "--json",
            str(tmp_path / "d.json"),
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 0, err
    doc = json.loads((tmp_path / "d.json").read_text())
    assert len(doc["runs"]["nexuskv"]["tokens"]) == 3
    rc, out, err, _ = _run(
        [
            "eval",
            "--model",
            tiny_model_dir,
            "--tokens",
            "128",
            "--window",
            "128",
            "--chunk",
            "32",
            "--bits",
            "8",
            "--tails",
            "0",
            "--ablations",
            "",
            "--no-best-2bit",
            "--no-quanto",
            "--new-tokens",
            "2",
            "--prompt-tokens",
            "16",
            "--bytes-tokens",
            "128",
            "--no-progress",
            "--json",
            str(tmp_path / "e.json"),
        ],
        capsys,
    )
    assert rc == 0, err
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["model"] == tiny_model_dir.rstrip("/").split("/")[-1]
    rows = {r["name"]: r for r in doc["rows"]}
    assert abs(rows["nexuskv 8-bit tail 0 K g64"]["delta_ppl_pct"]) < 5
