"""The Hugging Face binding's cache features on the real model (SmolLM2-135M-Instruct):
sink tokens, a user's own KVCompressor end to end (policy in C++, the user's objects in
Python, attention over their dequantized output), honest bytes, beam search, and
clear errors for a cache used with another model or bad K/V."""

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from nexuskv import hf_compat

from hf_helpers import LONG_PROMPT, PROMPT, agreement, compressed, forward, greedy, requires_model

pytestmark = requires_model


class Int8PerToken:
    """A user's compressor written here: int8 codes, one float32 absmax scale per token row.
    Implements the KVCompressor protocol (compress, decompress, nbytes)."""

    def compress(self, x):
        scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return torch.round(x.float() / scale).to(torch.int8), scale, x.dtype

    def decompress(self, c, dtype=None):
        codes, scale, orig = c
        return (codes.float() * scale).to(dtype or orig)

    def nbytes(self, c):
        return c[0].numel() * c[0].element_size() + c[1].numel() * c[1].element_size()


class ReferenceLayer(CacheLayerMixin):
    """The test's own model of the policy, written independently of nexuskv: dense K/V in
    which the first `sinks` tokens and the newest ones stay exact, and the positions
    [sinks, sinks + c) pass through compress/decompress, c = the whole chunks beyond the
    residual.  (The compressor works per token, so chunk boundaries do not change its output.)"""

    is_sliding = False
    is_compileable = False

    def __init__(self, compressor, sinks, residual, chunk):
        super().__init__()
        self.comp, self.sinks, self.residual, self.chunk = compressor, sinks, residual, chunk
        self.k = self.v = None

    def lazy_initialization(self, key_states, value_states=None):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.k = key_states if self.k is None else torch.cat([self.k, key_states], -2)
        self.v = value_states if self.v is None else torch.cat([self.v, value_states], -2)
        L, s = self.k.shape[-2], self.sinks
        c = max(0, L - s - self.residual) // self.chunk * self.chunk if L > s else 0
        k, v = self.k.clone(), self.v.clone()
        if c:
            k[:, :, s:s + c] = self.comp.decompress(self.comp.compress(self.k[:, :, s:s + c]))
            v[:, :, s:s + c] = self.comp.decompress(self.comp.compress(self.v[:, :, s:s + c]))
        return k, v

    def get_seq_length(self):
        return 0 if self.k is None else self.k.shape[-2]

    def get_mask_sizes(self, cache_position_or_length):
        return self.get_seq_length() + hf_compat.query_length(cache_position_or_length), 0

    def get_max_cache_shape(self):  # transformers 4.57
        return -1

    def get_max_length(self):  # transformers 5
        return -1

    def reorder_cache(self, beam_idx):
        self.k, self.v = self.k.index_select(0, beam_idx), self.v.index_select(0, beam_idx)


def reference_cache(model, **kw):
    return Cache(layers=[ReferenceLayer(**kw) for _ in range(model.config.num_hidden_layers)])


def test_sinks_generate_and_dense_view(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    dense = greedy(model, ids, 32)
    cache = nhf.cache_for(model, bits=8, group_size=16, residual=16, sinks=4)
    ours = greedy(model, ids, 32, cache)
    assert agreement(ours[0], dense[0]) == 32
    layer = cache.layers[0].cache
    assert layer.sinks() == 4 and layer.lengths().tolist() == [ids.shape[1] + 31]
    # The sinks are the first tokens' K exactly (the model's own K from a dense forward; layer 0,
    # whose K/V do not depend on attention outputs).
    from transformers import DynamicCache
    ref = DynamicCache()
    with torch.no_grad():
        forward(model, ids, ref)
    kd, _, _ = layer.dense(None)
    torch.testing.assert_close(kd[:, :, :4], ref.layers[0].keys[:, :, :4], rtol=0, atol=0)


def test_user_compressor_end_to_end_matches_its_reference(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    comp = Int8PerToken()
    kw = dict(sinks=2, residual=8)
    cache = nhf.cache_for(model, compressor=comp, group_size=4, **kw)
    layer = cache.layers[0]
    assert layer.cache.is_external() and layer.fused is False
    with torch.no_grad():
        a = forward(model, ids, cache).logits
        b = forward(model, ids, reference_cache(model, compressor=comp, chunk=4, **kw)).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # generate(): every step through the user's compressor, against the reference policy.
    n = 24
    cache = nhf.cache_for(model, compressor=comp, group_size=4, **kw)
    ours = greedy(model, ids, n, cache)
    ref = greedy(model, ids, n, reference_cache(model, compressor=comp, chunk=4, **kw))
    assert agreement(ours[0], ref[0]) == n
    L = ids.shape[1] + n - 1
    c = (L - 2 - 8) // 4 * 4
    lay = cache.layers[0].cache
    assert lay.lengths().tolist() == [L] and lay.compressed_lengths().tolist() == [c]
    # Honest bytes, counted independently: per layer, the user's int8 codes and float32 scales
    # of c tokens (K and V), plus the C++ cache's float32 sink and tail buffers
    # (tail capacity = residual + chunk).
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    per_layer = 2 * (H * c * D + H * c * 4) + 2 * H * D * 4 * (2 + 8 + 4)
    assert cache.nbytes == cfg.num_hidden_layers * per_layer


def test_nq_compressor_objects_take_the_fused_path(loaded):
    import nexuskv.hf as nhf
    from nexuskv.compressors import NQ

    model, tok = loaded
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    a = nhf.cache_for(model, compressor=NQ.for_keys(8, 16), value_compressor=NQ.for_values(8, 16), residual=16)
    # NQ objects keep scales/zeros in the input dtype unless told (cache_for's default is 16-bit).
    b = nhf.cache_for(model, bits=8, group_size=16, residual=16, meta_dtype=model.dtype, fit_range=False)
    assert not a.layers[0].cache.is_external() and a.layers[0].external is None and a.layers[0]._fused_now()
    assert greedy(model, ids, 8, a).tolist() == greedy(model, ids, 8, b).tolist()
    assert compressed(a) > 0 and compressed(a) == compressed(b)
    assert a.nbytes == b.nbytes


def test_beam_search_matches_the_dense_cache(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    n = 16
    dense = greedy(model, ids, n, num_beams=2)
    cache = nhf.cache_for(model, bits=8, group_size=16, residual=16, sinks=2)
    ours = greedy(model, ids, n, cache, num_beams=2)
    assert compressed(cache) > 0
    assert agreement(ours[0], dense[0]) == n


def test_beam_search_with_a_user_compressor(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    comp, kw = Int8PerToken(), dict(sinks=2, residual=8)
    ours = greedy(model, ids, 12, nhf.cache_for(model, compressor=comp, group_size=4, **kw), num_beams=2)
    ref = greedy(model, ids, 12, reference_cache(model, compressor=comp, chunk=4, **kw), num_beams=2)
    assert agreement(ours[0], ref[0]) == 12


def test_cache_for_another_model_or_bad_states_is_a_clear_error(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    cfg = model.config
    ids = tok(PROMPT, return_tensors="pt").input_ids
    short = nhf.NexusKVCache(4, fused=True)  # a cache of a 4-layer model
    with torch.no_grad(), pytest.raises(ValueError, match="made for a model with 4 layers, but layer_idx 4 uses it"):
        forward(model, ids, short)
    cache = nhf.cache_for(model)
    H, D = cfg.num_key_value_heads, cfg.head_dim
    with pytest.raises(ValueError, match=f"made for a model with {H} KV heads of head_dim {D}"):
        cache.update(torch.randn(1, H + 1, 3, D), torch.randn(1, H + 1, 3, D), 0)
    with pytest.raises(ValueError, match=f"made for a model with {H} KV heads of head_dim {D}"):
        cache.update(torch.randn(1, H, 3, 2 * D), torch.randn(1, H, 3, 2 * D), 0)
    with pytest.raises(ValueError, match="key and value states must have one shape"):
        cache.update(torch.randn(1, H, 3, D), torch.randn(1, H, 2, D), 0)
    with pytest.raises(TypeError, match="must be float32, float16 or bfloat16, got torch.int64"):
        cache.update(torch.ones(1, H, 3, D, dtype=torch.long), torch.ones(1, H, 3, D, dtype=torch.long), 0)
    with pytest.raises(TypeError, match="must implement the KVCompressor protocol"):
        nhf.cache_for(model, compressor=object())


def test_reset_cache_is_reusable(loaded):
    import nexuskv.hf as nhf

    model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    for make in (lambda: nhf.cache_for(model, bits=8, group_size=16, residual=16, sinks=2),
                 lambda: nhf.cache_for(model, compressor=Int8PerToken(), group_size=4, residual=8, sinks=2)):
        cache = make()
        first = greedy(model, ids, 8, cache)
        cache.reset()
        assert cache.layers[0].cache.lengths().tolist() == [] and cache.get_seq_length() == 0
        with pytest.raises(RuntimeError, match="a new or reset cache holds no tokens"):
            cache.layers[0].cache.reorder(torch.tensor([0]))
        assert greedy(model, ids, 8, cache).tolist() == first.tolist()
