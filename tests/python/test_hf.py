"""Hugging Face binding on the real model (SmolLM2-135M-Instruct, GGUF):
generate() through the compressed cache, fused vs dequantize path, batching."""

import pytest
import torch

from hf_helpers import LONG_PROMPT, PROMPT, agreement, compressed, forward, greedy, requires_model

pytestmark = requires_model


def test_8bit_reproduces_dense_greedy_tokens(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    dense = greedy(model, ids, 64)
    cache = nhf.cache_for(model, bits=8, group_size=32, residual=32)
    ours = greedy(model, ids, 64, cache)
    assert agreement(ours[0], dense[0]) == 64
    assert cache.layers[0].cache.lengths().tolist() == [ids.shape[1] + 63]


def test_4bit_agreement(loaded):
    """4-bit with the prompt compressed: the next-token choice given the dense
    continuation as prefix (teacher forcing, so that one early flip does not decide the
    count) agrees with the dense cache's at most positions."""
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    n = 32
    dense = greedy(model, ids, n)
    cache = nhf.cache_for(model, bits=4, group_size=16, residual=16)
    with torch.no_grad():
        logits = [forward(model, ids, cache).logits[:, -1]]
        for t in range(n - 1):
            logits.append(forward(model, dense[:, t:t + 1], cache).logits[:, -1])
    ours = torch.stack(logits, 1).argmax(-1)
    assert compressed(cache) >= ids.shape[1] - 16  # the prompt is compressed, not held in the tail
    # Measured 32 of 32 (transformers 4.57), 30 (5.24); the model is small and 4-bit groups of 16 are coarse.
    assert int((ours == dense).sum()) >= 28


def test_fused_and_dequantize_paths_attend_alike(loaded):
    """On the real model's own compressed K/V, every layer's fused attention equals
    attention over the dequantized cache (what the dequantize path computes), for a
    prefill chunk after the first forward and a decode step.  (End-to-end logits of the
    two paths are no test: a 1e-6 difference in one layer's output flips 4-bit roundings
    in the next layers' K/V.)  The chunk is appended in held pieces, each attended before
    the next (KVCache.append_and_attend): each piece's reference replays that on a clone
    of the cache and reads it as the piece's queries saw it.  The first forward attends
    over its own K/V (no cache to read)."""
    import transformers as tf
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    cache = nhf.cache_for(model, bits=4, group_size=16, residual=16, fused=True)
    worst, pieces = [], []

    def checked(module, query, key, value, attention_mask, scaling=None, **kw):
        layer = cache.layers[module.layer_idx]
        first = layer.cache.lengths().numel() == 0
        q_len = query.shape[-2]
        cuts = [0, *layer.cache.compression_points(q_len), q_len]
        replay = None if first else layer.cache.clone()
        out, _ = nhf.nexuskv_attention(module, query, key, value, attention_mask, scaling=scaling, **kw)
        if first:
            return out, None
        pieces.append(len(cuts) - 1)
        for a, b in zip(cuts, cuts[1:]):
            replay.append(key[..., a:b, :], value[..., a:b, :], None, True)
            K, V, _ = replay.dense(None)
            ref = nhf.dense_attention(query[..., a:b, :], K, V, None, scaling)
            worst.append(float((out[:, a:b] - ref).abs().max() / ref.abs().max()))
        return out, None

    tf.AttentionInterface.register("nexuskv_checked", checked)
    model.set_attn_implementation("nexuskv_checked")
    try:
        with torch.no_grad():
            forward(model, ids[:, :40], cache)
            nxt = forward(model, ids[:, 40:], cache).logits[:, -1:].argmax(-1)
            forward(model, nxt, cache)
    finally:
        model.set_attn_implementation("nexuskv")
    assert compressed(cache) > 0 and max(pieces) > 1  # the chunk was cut
    assert len(worst) == sum(pieces) and max(worst) < 1e-4, max(worst)


def test_a_prefill_is_exact_and_a_chunk_is_attended_as_decoding(loaded, monkeypatch):
    """Which K/V a forward's queries see (nexuskv_attention): the first forward (a prefill)
    attends over its own K/V as the model computed them, then the cache compresses them, so
    a one-shot prefill gives the dense model's logits at 2 bits; a later chunk is cut at the
    cache's compression points and appended held piece by piece, so each query sees what
    decoding token by token shows it.  Chunks of 24 then give the logits of one token at a
    time (up to the float noise of a different kernel call, which can flip a 2-bit rounding
    in a deeper layer's K/V); a chunk appended whole before its attention (the binding before
    this) sees groups that close inside it compressed: far from them."""
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    kw = dict(bits=2, group_size=16, residual=16)

    def run(cache, step):
        out = [forward(model, ids[:, :8], cache).logits]
        out += [forward(model, ids[:, i : i + step], cache).logits for i in range(8, n, step)]
        return torch.cat(out, 1)

    def whole_chunk(layer, query, scaling, softcap):
        layer.append_pending(None)
        return layer.cache.attend(query, scaling, softcap).transpose(1, 2).contiguous()

    with torch.no_grad():
        dense = forward(model, ids).logits  # transformers' own cache: plain attention
        cache = nhf.cache_for(model, **kw)
        ours = forward(model, ids, cache).logits
        assert compressed(cache) >= n - 32  # the prompt is compressed now
        assert float((ours - dense).abs().max()) < 1e-3 * float(dense.abs().max())
        decoded = run(nhf.cache_for(model, **kw), 1)
        chunked = run(nhf.cache_for(model, **kw), 24)
        monkeypatch.setattr(nhf, "_attend_as_decoding", whole_chunk)
        whole = run(nhf.cache_for(model, **kw), 24)

    def gap(x):  # mean |d log p| of the next tokens against decoding, after the prefill
        lp = torch.log_softmax(x[0, 8:-1], -1).gather(-1, ids[0, 9:, None])
        return float((lp - torch.log_softmax(decoded[0, 8:-1], -1).gather(-1, ids[0, 9:, None])).abs().mean())

    assert gap(chunked) < 0.2 * gap(whole), (gap(chunked), gap(whole))


def test_batched_left_padding_matches_the_dense_cache(loaded):
    # The padding is dropped from the compressed cache, so each row is cached as if alone.
    # (Per-sequence generation is no reference here: on this model HF's own dense batched
    # generation with left padding already departs from it after 1 and 10 tokens.)
    import nexuskv.hf as nhf

    model, tok = loaded
    prompts = [LONG_PROMPT, "Packages are installed with"]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(attention_mask=batch.attention_mask, pad_token_id=tok.pad_token_id)
    cache = nhf.cache_for(model, bits=8, group_size=16, residual=16)
    ours = greedy(model, batch.input_ids, 16, cache, **kw)
    dense = greedy(model, batch.input_ids, 16, **kw)
    for i in range(len(prompts)):
        assert agreement(ours[i], dense[i]) == 16, i
    real = batch.attention_mask.sum(1)
    assert cache.layers[0].cache.lengths().tolist() == (real + 15).tolist()  # pads are not cached
    assert compressed(cache) > 0  # the long row is compressed


def test_cache_follows_the_attention_implementation(loaded):
    """A cache made while the model attends with "nexuskv" runs the dequantize path when
    the model switches to sdpa (and back); a cache forced onto the fused path with
    another attention is a clear error, not a silent one."""
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    cache = nhf.cache_for(model, bits=8, group_size=16, residual=16)
    forced = nhf.cache_for(model, bits=8, fused=True)
    model.set_attn_implementation("sdpa")
    try:
        dense = greedy(model, ids, 8)
        assert greedy(model, ids, 8, cache).tolist() == dense.tolist()
        with torch.no_grad(), pytest.raises(RuntimeError, match="never attended by attn_implementation='nexuskv'"):
            forward(model, ids, forced)
            forward(model, ids[:, -1:], forced)
    finally:
        model.set_attn_implementation("nexuskv")


def test_nexuskv_attention_with_a_dense_cache_warns_once(loaded):
    import warnings
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    nhf._warned.discard("dense")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = greedy(model, ids, 4)  # transformers' own DynamicCache
    hits = [w for w in caught if "do not come from a fused nexuskv cache" in str(w.message)]
    assert len(hits) == 1
    model.set_attn_implementation("sdpa")
    try:
        assert ours.tolist() == greedy(model, ids, 4).tolist()
    finally:
        model.set_attn_implementation("nexuskv")
