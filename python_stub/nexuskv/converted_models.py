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
the tokenizer reloaded from DIR must encode and decode a probe text, the special tokens and
the chat template as the GGUF's does (else only the weights are kept and the tokenizer is
rebuilt from the GGUF each time, as without the cache); the weights are the GGUF's float32
ones, written by save_pretrained.  An entry is named by the GGUF file's path, size and
modification time and the transformers version, and appears whole or not at all (written
under a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Optional

import torch

ENV = "NEXUSKV_CONVERTED_MODELS"
FORMAT = 1  # of an entry's layout: model/ (+ tokenizer/ when it passed the check)
_PROBE = "The Debian system: apt-get install ñandú — 42 € 日本語\n\tend."


def entry_dir(gguf_path: str) -> Optional[str]:
    """Where the conversion of `gguf_path` is kept, None when the cache is off."""
    root = os.environ.get(ENV, "").strip()
    if not root:
        return None
    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{FORMAT}"
    return os.path.join(root, f"{os.path.basename(gguf_path)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def tokenizers_agree(a, b) -> bool:
    """Whether tokenizer b encodes and decodes as a does (the probe, with and without special
    tokens; the special tokens; the chat template)."""
    for kw in ({}, {"add_special_tokens": False}):
        ids = a(_PROBE, **kw).input_ids
        if ids != b(_PROBE, **kw).input_ids or a.decode(ids) != b.decode(ids):
            return False
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template")
    return all(getattr(a, n, None) == getattr(b, n, None) for n in names) and len(a) == len(b)


def load_tokenizer(entry: str):
    """The kept tokenizer of an entry, None when the entry has none."""
    path = os.path.join(entry, "tokenizer")
    if not os.path.isdir(path):
        return None
    from transformers import PreTrainedTokenizerFast

    # The fast class itself: tokenizer.json holds the whole pipeline (the class named in
    # tokenizer_config.json can rebuild it differently on transformers 5, see docs/vllm.md).
    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


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


def convert(where: str, kw: dict, tokenizer) -> Optional[str]:
    """Converts the GGUF at where/kw["gguf_file"] into its entry (once) and returns the entry,
    None when the cache is off.  `tokenizer` is the one loaded from the GGUF (the reference
    of the check)."""
    entry = entry_dir(os.path.join(where, kw["gguf_file"]))
    if entry is None or os.path.isdir(entry):
        return entry
    from transformers import AutoModelForCausalLM

    os.makedirs(os.path.dirname(entry), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(entry))
    try:
        _save_weights(
            AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw), os.path.join(tmp, "model")
        )
        tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        if not tokenizers_agree(tokenizer, load_tokenizer(tmp)):
            shutil.rmtree(os.path.join(tmp, "tokenizer"))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process kept the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry
