"""Converted GGUF models kept on disk, opt-in: ``NEXUSKV_CONVERTED_MODELS=DIR``.

Why: transformers reads a GGUF file's metadata four times per load (two configs, the
tokenizer, the weights) and rebuilds its tokenizer each time: SmolLM2-135M takes 25-30 s to
load on two cores, of which the weights themselves are a fraction.  With the variable set,
nexuskv.models.load_model converts a GGUF once into DIR as a Hugging Face directory (the
dequantized weights in float32, so that every dtype asked for later is the same cast of the
same values as from the GGUF; the config; the tokenizer) and loads from there afterwards
(a few seconds).  The test suite sets it to a folder of its build (tests/run.sh), so the
conversion is cached within one run and never between runs.

What is reused must be what a fresh load gives, so a conversion is checked before it is kept:
the tokenizer reloaded from DIR must agree with the GGUF's (tokenizers_agree: probe texts,
special and added tokens, the chat template, the vocabulary, padding and truncation sides;
else only the weights are kept and the tokenizer is rebuilt from the GGUF each time, as
without the cache); the weights are the GGUF's float32 ones, written by save_pretrained.  An
entry is named by the GGUF file's path, size and modification time, the transformers and
tokenizers versions and the source of nexuskv's conversion code, and appears whole or not at all (written
under a temporary name `.converting-<pid>-*`, then renamed; a conversion killed midway
leaves that folder behind, and the next conversion into DIR deletes it once no process of that
pid is alive on this machine).  A model loaded from an entry reports the GGUF's folder as
its name_or_path, as a fresh load does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Optional

import torch

ENV = "NEXUSKV_CONVERTED_MODELS"
FORMAT = 1  # of an entry's layout: model/ (+ tokenizer/ when it passed the check)
_SIDES = "nexuskv_sides.json"  # beside the saved tokenizer: its padding and truncation sides
_PROBE = "The Debian system: apt-get install ñandú — 42 € 日本語\n\tend."


def entry_dir(gguf_path: str) -> Optional[str]:
    """Where the conversion of `gguf_path` is kept, None when the cache is off."""
    root = os.environ.get(ENV, "").strip()
    if not root:
        return None
    import tokenizers
    import transformers

    st = os.stat(gguf_path)
    # What makes the conversion: the file, the libraries that read it, and nexuskv's own code
    # that builds its tokenizer and writes the entry (their source, so a fix changes the name).
    here = os.path.dirname(os.path.abspath(__file__))
    code = hashlib.sha256()
    for name in ("converted_models.py", "gguf_tokenizer.py", "models.py"):
        with open(os.path.join(here, name), "rb") as f:
            code.update(f.read())
    key = "|".join(
        map(
            str,
            (
                os.path.abspath(gguf_path),
                st.st_size,
                st.st_mtime_ns,
                transformers.__version__,
                tokenizers.__version__,
                code.hexdigest(),
                FORMAT,
            ),
        )
    )
    return os.path.join(root, f"{os.path.basename(gguf_path)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def tokenizers_agree(a, b) -> bool:
    """Whether tokenizer b encodes and decodes as a does: probe texts (plain, with whitespace
    runs, with every special and added token written out) with and without special tokens,
    decoding with and without them, a chat rendered by the template; the special tokens,
    the template itself, the padding side and the vocabulary."""
    added = "".join(f" {t} x" for t in sorted(a.get_vocab().keys() & set(a.all_special_tokens)))
    added += "".join(f"{t}y " for t in sorted(a.get_added_vocab()))
    for text in (_PROBE, "  two  spaces\n\n\tand tabs   ", added):
        for kw in ({}, {"add_special_tokens": False}):
            ids = a(text, **kw).input_ids
            if ids != b(text, **kw).input_ids:
                return False
            if any(a.decode(ids, skip_special_tokens=s) != b.decode(ids, skip_special_tokens=s) for s in (False, True)):
                return False
    if getattr(a, "chat_template", None):
        chat = [{"role": "user", "content": _PROBE}, {"role": "assistant", "content": "apt"}]
        try:
            if a.apply_chat_template(chat, tokenize=False) != b.apply_chat_template(chat, tokenize=False):
                return False
        except Exception:  # a template that cannot render this chat: compared as text below
            pass
    names = (
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "chat_template",
        "padding_side",
        "truncation_side",
    )
    return all(getattr(a, n, None) == getattr(b, n, None) for n in names) and a.get_vocab() == b.get_vocab()


def load_tokenizer(entry: str):
    """The kept tokenizer of an entry, None when the entry has none."""
    path = os.path.join(entry, "tokenizer")
    if not os.path.isdir(path):
        return None
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(path, _SIDES)) as f:
        sides = json.load(f)
    # The fast class itself: tokenizer.json holds the whole pipeline (the class named in
    # tokenizer_config.json can rebuild it differently on transformers 5, see docs/vllm.md).
    # The padding and truncation sides are not in what save_pretrained writes from a GGUF's
    # tokenizer (SmolLM2's pads left): passed back as they were.
    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True, **sides)


def _save_weights(gguf_model, path: str) -> None:
    """save_pretrained of a GGUF-loaded model's float32 weights.  Through a plain model of the
    same config: transformers 5 marks a GGUF-loaded model quantized and refuses to save it."""
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no memory, no random init: every tensor is assigned below
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_conversions(root: str) -> list[str]:
    """Deletes the `.converting-<pid>-*` folders in `root` whose process is gone (a conversion
    killed midway); those of live processes (a conversion under way) stay.  Returns the names
    deleted."""
    removed = []
    for name in sorted(os.listdir(root)):
        parts = name.split("-")
        if not name.startswith(".converting-") or len(parts) < 3 or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or _pid_alive(int(parts[1])):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed


def convert(entry: str, where: str, kw: dict, tokenizer) -> None:
    """Converts the GGUF at where/kw["gguf_file"] into `entry` (its entry_dir()) unless it is
    there already.  `tokenizer` is the one loaded from the GGUF (the reference of the check)."""
    root = os.path.dirname(entry)
    os.makedirs(root, exist_ok=True)
    remove_stale_conversions(root)
    if os.path.isdir(entry):
        return
    from transformers import AutoModelForCausalLM

    tmp = tempfile.mkdtemp(prefix=f".converting-{os.getpid()}-", dir=root)
    try:
        _save_weights(
            AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw), os.path.join(tmp, "model")
        )
        tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, "tokenizer", _SIDES), "w") as f:
            json.dump({"padding_side": tokenizer.padding_side, "truncation_side": tokenizer.truncation_side}, f)
        if not tokenizers_agree(tokenizer, load_tokenizer(tmp)):
            shutil.rmtree(os.path.join(tmp, "tokenizer"))
        try:
            os.rename(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(entry):  # not "another process kept the same conversion first"
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
