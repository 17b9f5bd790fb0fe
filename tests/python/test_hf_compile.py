"""torch.compile of a decode step through the nexuskv cache: no data-dependent Python
branch is left in the binding's hot path, so the only graph breaks are the calls on the
C++ cache (a TorchBind object that has no fake class yet: dynamo cannot trace its
methods).  This pins that state: a new .item()/bool() in hf.py fails here."""

import torch

from hf_helpers import forward, tiny_model


def test_decode_step_breaks_only_at_the_cache_object():
    import nexuskv.hf as nhf

    model = tiny_model("llama")  # 2 layers
    model.set_attn_implementation("nexuskv")
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = nhf.cache_for(model, bits=4, group_size=16, residual=16)
    torch._dynamo.reset()
    with torch.no_grad():
        forward(model, ids, cache)  # the prefill runs eagerly
        ex = torch._dynamo.explain(lambda x: forward(model, x, cache).logits)(ids[:, -1:])
    reasons = [str(r.reason) for r in ex.break_reasons]
    assert reasons and all("torch.classes.nexuskv.KVCache" in r for r in reasons), reasons
    # Measured: 7 graphs / 6 breaks for 2 layers (before: 10 / 9, with a .item() per layer).
    assert ex.graph_break_count <= 3 * len(model.model.layers)
    assert cache.get_seq_length() == ids.shape[1] + 1  # the traced step did run through the cache
