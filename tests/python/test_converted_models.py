"""NEXUSKV_CONVERTED_MODELS (nexuskv.converted_models): a GGUF converted once is loaded from
its entry afterwards, with the same weights, logits and tokens as from the GGUF itself; an
entry is named by the file and the transformers version; a tokenizer that would not
reload the same is not kept."""

import os

import torch

from hf_helpers import requires_model
from nexuskv import converted_models, models


@requires_model[0]
@requires_model[1]
def test_a_converted_model_loads_as_the_gguf_does(tmp_path, monkeypatch):
    monkeypatch.setenv(converted_models.ENV, "")
    ref, ref_tok = models.load_model(torch.bfloat16)  # from the GGUF, no cache
    monkeypatch.setenv(converted_models.ENV, str(tmp_path))
    entry = converted_models.entry_dir(os.path.join(models.gguf_dir(), models.GGUF_FILE))
    assert entry is not None and os.path.dirname(entry) == str(tmp_path) and not os.path.exists(entry)
    from transformers import AutoModelForCausalLM

    loaded_from = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def spy(where, *args, **kw):
        loaded_from.append(where)
        return from_pretrained(where, *args, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    models.load_model(torch.bfloat16)  # converts (a float32 load of the GGUF), then loads the entry
    assert sorted(os.listdir(entry)) == ["model", "tokenizer"] and os.listdir(tmp_path) == [os.path.basename(entry)]
    model, tok = models.load_model(torch.bfloat16)  # from the entry alone
    assert loaded_from == [models.gguf_dir(), os.path.join(entry, "model"), os.path.join(entry, "model")]
    assert model.name_or_path == ref.name_or_path == models.gguf_dir()  # what a fresh load reports
    # The entry kept its tokenizer (it reloads the same), and load_tokenizer takes it too.
    assert converted_models.load_tokenizer(entry) is not None
    assert converted_models.tokenizers_agree(ref_tok, models.load_tokenizer())
    state, ref_state = model.state_dict(), ref.state_dict()
    assert state.keys() == ref_state.keys()
    assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], ref_state[k]) for k in state)
    assert converted_models.tokenizers_agree(ref_tok, tok)
    assert models.sequence_prefix(tok) == models.sequence_prefix(ref_tok)
    text = models.load_text()[:2000]
    ids = ref_tok(text, return_tensors="pt").input_ids[:, :256]
    assert torch.equal(tok(text, return_tensors="pt").input_ids[:, :256], ids)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    # Another transformers version or another file is another entry.
    monkeypatch.setattr("transformers.__version__", "0.0.0")
    assert converted_models.entry_dir(os.path.join(models.gguf_dir(), models.GGUF_FILE)) != entry


@requires_model[0]
@requires_model[1]
def test_a_tokenizer_that_reloads_differently_is_told_apart():
    import copy

    tok = models.load_tokenizer()
    assert converted_models.tokenizers_agree(tok, copy.deepcopy(tok))
    other = copy.deepcopy(tok)
    other.chat_template = "{{ messages }}"
    assert not converted_models.tokenizers_agree(tok, other)
    other = copy.deepcopy(tok)
    other.add_special_tokens({"bos_token": "<|im_end|>"})
    assert not converted_models.tokenizers_agree(tok, other)


def test_the_cache_is_off_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(converted_models.ENV, raising=False)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert converted_models.entry_dir(str(f)) is None
    monkeypatch.setenv(converted_models.ENV, "  ")
    assert converted_models.entry_dir(str(f)) is None
    monkeypatch.setenv(converted_models.ENV, str(tmp_path / "c"))
    a = converted_models.entry_dir(str(f))
    f.write_bytes(b"xy")  # another size: another entry
    assert a.startswith(str(tmp_path / "c")) and converted_models.entry_dir(str(f)) != a


def test_a_conversion_killed_midway_is_cleaned_up_by_the_next(tmp_path):
    """A `.converting-<pid>-*` folder whose process is gone is deleted by the next convert()
    into the same folder; one of a live process (a conversion under way), a folder of another
    name and the entry itself stay."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    assert not converted_models._pid_alive(dead_pid)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f".converting-{dead_pid}-abc", f".converting-{live.pid}-def", ".converting-nopid", "other"]
        for name in names:
            (tmp_path / name / "model").mkdir(parents=True)
        entry = tmp_path / "entry"
        entry.mkdir()
        # The entry is there: convert() cleans up and returns without loading anything.
        converted_models.convert(str(entry), "unused", {}, tokenizer=None)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(names[1:] + ["entry"])
    finally:
        live.kill()
        live.wait()
    assert converted_models.remove_stale_conversions(str(tmp_path)) == [f".converting-{live.pid}-def"]
