"""The tokenizers of the packaged models (models.load_tokenizer) on every transformers line
tests/run.sh runs (4.57 main, 5.x beside it): a known sentence to its exact ids, BOS as each
GGUF file says, and Gemma's rebuilt tokenizer (gguf_tokenizer.py) against an independent
sentencepiece-BPE encoder on a small written GGUF, and against transformers 5.x's own on
real text."""

import gzip
import os
import random
import struct

import pytest

from nexuskv import converted_models, gguf_tokenizer, models

SENTENCE = "In the beginning God created the heaven and the earth."
# The real tokens (transformers 5.24; transformers 4.57's own Gemma tokenizer cut this
# sentence into 27 fragments, the bug gguf_tokenizer.py fixes).
GEMMA3_IDS = [2, 902, 506, 6534, 3803, 4464, 506, 20808, 532, 506, 7764, 236761]  # <bos> In ▁the ...
SMOLLM2_IDS = [788, 260, 3616, 1839, 2312, 260, 10419, 284, 260, 3103, 30]  # no BOS: the file says so

needs_smollm2 = pytest.mark.skipif(not models.model_available(), reason=f"needs {models.GGUF_PACKAGE}")
needs_gemma3 = pytest.mark.skipif(not models.gemma3_available(), reason=f"needs {models.GEMMA3_PACKAGE}")


@pytest.fixture(scope="module", autouse=True)
def _tokenizers_built_from_the_gguf():
    """These tests are of the tokenizers nexuskv and transformers build from a GGUF, not of the
    copies kept by NEXUSKV_CONVERTED_MODELS (tests/run.sh sets it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(converted_models.ENV, raising=False)
        yield


@pytest.fixture(scope="module")
def gemma3():
    return models.load_tokenizer(models.GEMMA3)


@needs_smollm2
def test_smollm2_sentence_ids_and_no_bos():
    tok = models.load_tokenizer(models.SMOLLM2)
    ids = tok(SENTENCE).input_ids
    assert ids == SMOLLM2_IDS, tok.convert_ids_to_tokens(ids)
    assert tok.decode(ids) == SENTENCE
    assert models.sequence_prefix(tok) == []


@needs_gemma3
def test_gemma3_sentence_ids_and_bos(gemma3):
    ids = gemma3(SENTENCE).input_ids
    assert ids == GEMMA3_IDS, gemma3.convert_ids_to_tokens(ids)
    assert gemma3.decode(ids, skip_special_tokens=True) == SENTENCE
    assert models.sequence_prefix(gemma3) == [2]
    # Whole-matched pieces: control tokens, a newline run, a space run, an HTML tag, byte fallback.
    text = "<start_of_turn>user\n\nhi  there<table>\u00e9\U0001f642<end_of_turn>"
    ids = gemma3(text, add_special_tokens=False).input_ids
    pieces = gemma3.convert_ids_to_tokens(ids)
    assert pieces[0] == "<start_of_turn>" and pieces[-1] == "<end_of_turn>"
    assert "\n\n" in pieces and "\u2581\u2581" in pieces and "<table>" in pieces
    assert gemma3.decode(ids) == text


@needs_gemma3
def test_gemma3_equals_transformers_5_on_real_text(gemma3):
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x builds a wrong Gemma tokenizer; tests/run.sh runs this under 5.x")
    from transformers import AutoTokenizer

    path = models.gemma3_gguf()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["  two  spaces\tand\ttabs\n\n\nthree newlines <b>bold</b> \u00fc\u00f1\u00ee \u65e5\u672c \U0001f642"]
    if os.path.isfile(models.DEFAULT_TEXT):
        with gzip.open(models.DEFAULT_TEXT, "rt", encoding="utf-8") as f:
            texts.append(f.read(60000))
    if os.path.isfile(models.POEMS_TEXT):
        with open(models.POEMS_TEXT, encoding="utf-8", errors="replace") as f:
            texts.append(f.read(60000))
    for text in texts:
        assert gemma3(text).input_ids == ref(text).input_ids


# --- gguf_tokenizer on small files written here -------------------------------------------

# A sentencepiece-BPE vocabulary in creation order (control tokens first, then pieces).
TINY = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "\n\n",
    "  ",
    "<0x41>",
    "\u2581",
    "a",
    "b",
    "c",
    "ab",
    "\u2581a",
    "bc",
    "\u2581ab",
    "abc",
    "ca",
    "\u2581abc",
    "bca",
]
TINY_TYPES = [3, 3, 3, 3, 4, 4, 6] + [1] * (len(TINY) - 7)


def write_gguf(path, arch="gemma3", tokens=TINY, types=TINY_TYPES, add_bos=True, merges=None):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [-float(i) for i in range(len(tokens))])
    w.add_array("tokenizer.ggml.token_type", types)
    if merges is not None:
        w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return str(path)


def spm_bpe_reference(word, vocab):
    """Sentencepiece BPE as its papers state it: start from characters (unknown ones as
    <unk>), repeatedly merge the adjacent pair whose union is the earliest-listed normal or
    user-defined piece, leftmost on ties; no merge list involved."""
    symbols = list(word)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            rank = vocab.get(symbols[i] + symbols[i + 1])
            if rank is not None and TINY_TYPES[rank] in (1, 4) and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return [vocab.get(s, 3) for s in symbols]


def test_read_metadata_round_trip(tmp_path):
    path = write_gguf(tmp_path / "t.gguf")
    meta = gguf_tokenizer.read_metadata(path, ("tokenizer.ggml.tokens",))
    assert meta["general.architecture"] == "gemma3"
    assert meta["tokenizer.ggml.tokens"] == TINY
    assert meta["tokenizer.ggml.token_type"] == len(TINY)  # not asked for: its length
    assert meta["tokenizer.ggml.bos_token_id"] == 2 and meta["tokenizer.ggml.add_bos_token"] is True


def test_read_metadata_refuses_bad_files(tmp_path):
    good = open(write_gguf(tmp_path / "t.gguf"), "rb").read()
    cases = {"magic": b"GGUX" + good[4:], "version": good[:4] + struct.pack("<I", 7) + good[8:], "truncated": good[:60]}
    for name, data in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=str(bad)):
            gguf_tokenizer.read_metadata(str(bad), ("tokenizer.ggml.tokens",))


def test_recover_merges_ranks_by_the_union():
    merges = gguf_tokenizer.recover_merges(TINY, [k in (1, 4) for k in TINY_TYPES])
    assert merges[:3] == [("a", "b"), ("\u2581", "a"), ("b", "c")]
    # "abc" splits as a+bc and ab+c: both, in the union's place, ordered by the left part.
    i = merges.index(("a", "bc"))
    assert merges[i + 1] == ("ab", "c")
    assert all(len(left + right) >= 2 for left, right in merges)


def test_gemma_tokenizer_matches_spm_bpe_on_random_text(tmp_path):
    tok = gguf_tokenizer.gemma_tokenizer(write_gguf(tmp_path / "t.gguf"))
    # The file stores the space run with real spaces; the text's spaces arrive as U+2581.
    vocab = {t.replace(" ", "\u2581"): i for i, t in enumerate(TINY)}
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(1, 12)))
        want = spm_bpe_reference(text.replace(" ", "\u2581"), vocab)
        assert tok(text, add_special_tokens=False).input_ids == want, text
        assert tok(text).input_ids == [2] + want
    # A user-defined run of newlines is matched whole; an unknown character falls back to bytes
    # ("A" has its byte piece in this vocabulary).
    assert tok("a\n\nb", add_special_tokens=False).input_ids == [8, 4, 9]
    assert tok("A", add_special_tokens=False).input_ids == [6]


def test_gemma_tokenizer_follows_the_bos_flag_and_refuses_other_files(tmp_path):
    tok = gguf_tokenizer.gemma_tokenizer(write_gguf(tmp_path / "nobos.gguf", add_bos=False))
    assert tok("ab").input_ids == [11]
    with pytest.raises(ValueError, match="not a Gemma"):
        gguf_tokenizer.gemma_tokenizer(write_gguf(tmp_path / "llama.gguf", arch="llama"))
    with pytest.raises(ValueError, match="lists its merges"):
        gguf_tokenizer.gemma_tokenizer(write_gguf(tmp_path / "m.gguf", merges=["a b"]))
