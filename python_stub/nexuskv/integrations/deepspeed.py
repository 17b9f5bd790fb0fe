"""DeepSpeed inference (v1 ``deepspeed.init_inference``) with the nexuskv cache.

Without kernel injection a v1 ``InferenceEngine`` runs the transformers module it
wraps (``engine.module``) unchanged, tensor-parallel or not: AutoTP only slices the
projection weights, so the model's own attention, and with it nexuskv's cache and
``attn_implementation="nexuskv"``, run on every rank over that rank's KV heads.
What a cache needs from the engine is therefore the module and the number of KV
heads the rank holds:

    import deepspeed, nexuskv.hf
    from nexuskv.integrations import deepspeed as ds
    engine = deepspeed.init_inference(model, dtype=torch.bfloat16, tensor_parallel={"tp_size": 2})
    module, heads = ds.unwrap_for_cache(engine)
    cache = nexuskv.hf.cache_for(module, kv_heads=heads)   # or cache_for(engine) once hf calls this

Engines this cannot serve are refused with the reason: kernel injection replaces the
model's attention by DeepSpeed's fused kernels with their own KV cache, and
DeepSpeed-FastGen (``InferenceEngineV2``) owns a blocked KV cache and attention of
its own (docs/deepspeed.md says what it would take).

deepspeed itself is never imported here: an object can only be an engine if the
caller has imported deepspeed already."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

_V1_ENGINE = ("deepspeed.inference.engine", "InferenceEngine")
_V2_ENGINE = ("deepspeed.inference.v2.engine_v2", "InferenceEngineV2")
_INJECTED_LAYER = ("deepspeed.model_implementations.transformers.ds_transformer", "DeepSpeedTransformerInference")


def _class(where: tuple[str, str]):
    """The DeepSpeed class named by (module, name) if that module is imported, else None."""
    module = sys.modules.get(where[0])
    return getattr(module, where[1], None) if module is not None else None


def _is(obj, where: tuple[str, str]) -> bool:
    cls = _class(where)
    return cls is not None and isinstance(obj, cls)


def is_engine(obj) -> bool:
    """True for a DeepSpeed v1 InferenceEngine (what deepspeed.init_inference returns)."""
    return _is(obj, _V1_ENGINE)


def unwrap(model):
    """The transformers model to give nexuskv: ``engine.module`` for a DeepSpeed v1
    InferenceEngine, the argument itself for anything that is not a DeepSpeed engine.
    Raises for engines whose attention does not go through the model's cache."""
    if _is(model, _V2_ENGINE):
        raise TypeError("nexuskv: a DeepSpeed-FastGen engine (InferenceEngineV2) keeps its own blocked KV cache and "
                        "attention kernels, which have no pluggable KV compression; use deepspeed.init_inference "
                        "(v1) without kernel injection, or see docs/deepspeed.md for what FastGen would need")
    if not is_engine(model):
        return model
    config = getattr(model, "_config", None)
    injected = bool(getattr(config, "replace_with_kernel_inject", False))
    layer_cls = _class(_INJECTED_LAYER)
    if injected or (layer_cls is not None and any(isinstance(m, layer_cls) for m in model.module.modules())):
        raise ValueError("nexuskv: this DeepSpeed engine was made with replace_with_kernel_inject=True: its fused "
                         "transformer kernels keep their own KV cache and never call the model's cache or "
                         "attention; make it with deepspeed.init_inference(model, replace_with_kernel_inject=False) "
                         "(AutoTP tensor parallelism works without injection)")
    return model.module


@dataclass(frozen=True)
class TensorParallel:
    """Where this process stands in the engine's tensor-parallel group."""

    size: int  # ranks that share each layer
    rank: int  # this process's rank within the group, 0 <= rank < size
    group: Any  # the torch.distributed process group (None when size == 1)


def tensor_parallel(model) -> TensorParallel:
    """The tensor-parallel group of a DeepSpeed v1 engine; size 1 for anything else."""
    if not is_engine(model):
        return TensorParallel(1, 0, None)
    size = int(model._config.tensor_parallel.tp_size)
    if size <= 1:
        return TensorParallel(1, 0, None)
    group = model.mp_group
    return TensorParallel(size, torch.distributed.get_rank(group=group), group)


def _text_config(module):
    config = module.config
    return getattr(config, "text_config", None) or config


def kv_heads_per_rank(model) -> Optional[int]:
    """The KV heads of each layer that this rank's attention sees, for a tensor-parallel
    DeepSpeed engine (AutoTP); None when the model is not sharded (the config's count
    holds).  AutoTP gives rank r ``kv // tp`` heads plus one if ``r < kv % tp``; this asks
    DeepSpeed's own shard rule for k_proj's output, so the two cannot drift apart."""
    tp = tensor_parallel(model)
    if tp.size == 1:
        return None
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size

    config = _text_config(unwrap(model))
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = get_shard_size(kv_heads * head_dim, tp.size, AutoTPMeta.from_model_config(config), name="self_attn.k_proj",
                           rank=tp.rank)
    if width % head_dim:
        raise ValueError(f"nexuskv: DeepSpeed AutoTP splits {kv_heads} KV heads of head_dim {head_dim} over "
                         f"{tp.size} ranks into {width} channels on rank {tp.rank}, not whole heads")
    return width // head_dim


def unwrap_for_cache(model, kv_heads: Optional[int | str] = None) -> tuple[Any, Optional[int | str]]:
    """(the transformers model, the KV heads per layer this process holds): what
    nexuskv.hf.cache_for needs from a DeepSpeed engine.  An explicit ``kv_heads`` is
    kept; otherwise a tensor-parallel engine's rank count, else None (the config's)."""
    if kv_heads is None and is_engine(model):
        kv_heads = kv_heads_per_rank(model)
    return unwrap(model), kv_heads


def nbytes_per_rank(cache, model) -> list[int]:
    """``cache.nbytes`` of every rank of the engine's tensor-parallel group, in rank
    order (a collective: every rank must call it).  Each rank's cache holds only its own
    KV heads, so the model's cache costs the sum of these."""
    tp = tensor_parallel(model)
    if tp.size == 1:
        return [int(cache.nbytes)]
    every: list[Any] = [None] * tp.size
    torch.distributed.all_gather_object(every, int(cache.nbytes), group=tp.group)  # any backend, NCCL too
    return [int(n) for n in every]
