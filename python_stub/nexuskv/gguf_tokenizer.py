"""Gemma's tokenizer rebuilt from a GGUF file's metadata, for transformers 4.x.

transformers 4.57 builds a Gemma GGUF's tokenizer as a sentencepiece *Unigram* model from
the file's scores.  Gemma's vocabulary is a sentencepiece *BPE* model and its GGUF carries no
merge list, so that tokenizer cuts words into fragments ("In the beginning" becomes
`In ▁t he ▁b eg in ning`), and every perplexity taken through it measures the wrong text.
transformers 5.x rebuilds the merges; this module does the same for the 4.x line so that
both lines give one token sequence (tests/python/test_tokenizers.py compares them).

Why the merges can be recovered: a sentencepiece BPE vocabulary lists its pieces in the order
training created them, and encoding merges, at each step, the adjacent pair whose union is the
piece listed earliest.  So every split of a piece into two pieces of the vocabulary is a merge
ranked by the position of their union.  Two splits of one piece tie there; they are ordered by
their parts' positions, which matters only when both pairs stand in one word at the same step.
The result is checked token for token against transformers 5.x on three texts
(tests/python/test_hf_tokenizer.py).

The GGUF header is read by a small parser of its key/value section (`read_metadata`), not by
gguf.GGUFReader, which maps and describes every tensor first (~25 s for Gemma 3 270M).
"""

from __future__ import annotations

import mmap
import struct
from typing import Dict, Iterable, List, Optional, Tuple

# GGUF value types (gguf/constants.py GGUFValueType): fixed-size scalars by struct code.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3_text")
SPACE = "\u2581"  # sentencepiece's visible space


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header ends early (offset {self.pos}, want {size} more bytes)")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: GGUF string of {n} bytes runs past the file")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALAR:
            return self.take("<" + _SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<IQ")
            if etype in _SCALAR:
                size = struct.calcsize(_SCALAR[etype])
                if not keep:
                    self.pos += size * count
                    return count
                out = list(struct.unpack_from(f"<{count}{_SCALAR[etype]}", self.buf, self.pos))
                self.pos += size * count
                return out
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else count
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at offset {self.pos}")


def read_metadata(path: str, arrays: Iterable[str] = ()) -> Dict[str, object]:
    """The key/value metadata of a GGUF file (versions 2 and 3, little-endian).  Arrays are
    returned in full only for the keys in `arrays`; every other array as its length."""
    keep = set(arrays)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        magic = bytes(buf[:4])
        cur.pos = 4
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {magic!r})")
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (big-endian or unknown); expected 2 or 3")
        _tensors, count = cur.take("<QQ")
        meta: Dict[str, object] = {}
        for _ in range(count):
            key = cur.string()
            meta[key] = cur.value(cur.take("<I"), key in keep)
        return meta


# The arrays gemma_tokenizer needs in full (read_metadata returns other arrays as lengths).
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")


def recover_merges(tokens: List[str], mergeable: List[bool]) -> List[Tuple[str, str]]:
    """Every (left, right) whose concatenation is a mergeable piece, both parts mergeable
    pieces, ranked by the position of the concatenation, then of left, then of right."""
    index = {t: i for i, t in enumerate(tokens) if mergeable[i]}
    ranked = []
    for i, piece in enumerate(tokens):
        if not mergeable[i] or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = index.get(piece[:cut]), index.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((i, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def gemma_tokenizer(path: str, meta: Optional[Dict[str, object]] = None):
    """A transformers fast tokenizer for a Gemma GGUF: BPE over the file's vocabulary with
    merges recovered from its order, byte fallback, spaces spelled as U+2581 by the
    normalizer, control tokens special and user-defined tokens matched whole.  `meta`: the
    file's read_metadata(path, TOKENIZER_ARRAYS), if the caller has read it already."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    meta = read_metadata(path, TOKENIZER_ARRAYS) if meta is None else meta
    arch = meta.get("general.architecture")
    if arch not in GEMMA_ARCHITECTURES or meta.get("tokenizer.ggml.model") != "llama":
        raise ValueError(f"{path}: not a Gemma sentencepiece GGUF (architecture {arch!r})")
    if "tokenizer.ggml.merges" in meta:
        raise ValueError(f"{path}: the file lists its merges; load it with transformers' own GGUF tokenizer")
    # Pieces of two or more spaces are stored with real spaces; the normalizer spells spaces
    # as U+2581 before the model sees them, so the vocabulary must too.
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in meta["tokenizer.ggml.tokens"]]
    types = meta["tokenizer.ggml.token_type"]
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(tokens)} tokens but {len(types)} token types")

    def token(key: str) -> Optional[str]:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    unk = token("unknown_token_id")
    # User-defined pieces (newline, space and tab runs, HTML tags) are matched whole, as
    # sentencepiece does: the space runs through their merges (they are spelled with U+2581
    # now, and their low positions make those merges come first), the rest as added tokens.
    mergeable = [k in (NORMAL, USER_DEFINED) for k in types]
    whole = [t for t, k in zip(tokens, types) if k == USER_DEFINED and SPACE not in t]
    model = BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=recover_merges(tokens, mergeable),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    control = [t for t, k in zip(tokens, types) if k == CONTROL]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in whole])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=unk,
        pad_token=token("padding_token_id"),
        padding_side="left",
    )
    _set_template(
        tok, bool(meta.get("tokenizer.ggml.add_bos_token", True)), bool(meta.get("tokenizer.ggml.add_eos_token", False))
    )
    return tok


def follow_bos_eos_flags(tok, meta: Dict[str, object]):
    """Makes a fast tokenizer start / end a sequence as the GGUF file whose metadata is
    `meta` says (`tokenizer.ggml.add_bos_token` / `add_eos_token`), where it says.
    transformers 4.57 ignores the flags for a GPT-2 style vocabulary: SmolLM2's file says no
    BOS, 4.57 adds `<|im_start|>` and 5.x adds nothing."""
    bos, eos = meta.get("tokenizer.ggml.add_bos_token"), meta.get("tokenizer.ggml.add_eos_token")
    if bos is None and eos is None:
        return tok
    plain = tok("a", add_special_tokens=False).input_ids
    full = tok("a").input_ids
    has_bos = len(full) > len(plain) and full[0] == tok.bos_token_id
    has_eos = len(full) > len(plain) and full[-1] == tok.eos_token_id
    add_bos = has_bos if bos is None else bool(bos)
    add_eos = has_eos if eos is None else bool(eos)
    if (add_bos, add_eos) != (has_bos, has_eos):
        _set_template(tok, add_bos, add_eos)
    return tok


def _set_template(tok, add_bos: bool, add_eos: bool) -> None:
    """A post-processor that adds exactly the BOS / EOS asked for (and the attributes some
    tokenizer classes rebuild their post-processor from, so that they agree)."""
    from tokenizers import processors

    for name, value in (("add_bos_token", add_bos), ("add_eos_token", add_eos)):
        if hasattr(tok, "_" + name):
            setattr(tok, "_" + name, value)
    bos, eos = tok.bos_token, tok.eos_token
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = [(t, tok.convert_tokens_to_ids(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )
