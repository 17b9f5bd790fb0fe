"""Serving engines that wrap a transformers model.

nexuskv's cache and attention plug into the transformers model itself
(nexuskv.hf); an engine that wraps the model only has to be seen through:

    from nexuskv.integrations import deepspeed as ds
    module = ds.unwrap(engine)                  # DeepSpeed v1 InferenceEngine -> its module
    heads = ds.kv_heads_per_rank(engine)        # KV heads this tensor-parallel rank holds

Nothing here imports an engine: an object can only be an engine's if the
engine's package is already imported.  What the paged servers (DeepSpeed-FastGen,
vLLM) would need is written down in docs/deepspeed.md; vLLM itself: nexuskv.integrations.vllm
(docs/vllm.md), imported by vLLM through its plugin entry point, not from here."""

from . import deepspeed

__all__ = ["deepspeed"]
