"""What vLLM's per-token pages cost in perplexity, and what would win it back.

A study, not a timing: the real model (SmolLM2-135M-Instruct from its GGUF by default) runs
in float32, and inside every attention layer its keys and values are replaced by what a
cache would hand back.  Per-token rows: K/V rounded to bf16 (as a bf16 engine holds them),
optionally centered by a recipe, Hadamard-rotated with ``rotation_signs(D, seed)`` and
rounded to bf16 again, quantized by ``nq_compress(x, bits, group, axis=-1)`` (bf16 scales
and zeros): exactly what a bf16 page stores (paged_format.h), dequantized and un-rotated in
float32 as the paged kernel does.  Every query attends over the quantized K/V of the whole
prompt, its own tokens included, as the vLLM backend's prefill does.  The per-channel row
quantizes keys per channel over blocks of 64 tokens of the whole prompt (nexuskv's own
cache without its tail and sinks, and with its open group quantized too: an idealization,
since a cache must keep the open group exact).  Rows with an exact window keep each query's W
newest keys and values (its own included; bf16) exact: what a page format with a
full-precision ring of the newest W tokens per block would give.  Rows with a fitted
transform (issue 21's fitted rotation and key smoothing, tried on per-token keys) write
M^-T (k - m) instead of k - m and attend with M q: exact in q . k for any invertible M, and M
changes where the key's rounding error lands.  "full" is the M that minimizes the expected
squared score error E|q . e|^2 when e's size follows the key's norm (per-token rounding after
the Hadamard rotation): M^T M = Sq^-1/2 (Sq^1/2 Sk Sq^1/2)^1/2 Sq^-1/2 (the geometric mean of
Sq^-1 and Sk; Sq the queries' second moment per kv head, Sk the centered keys' covariance,
both on the calibration text), predicted to reduce that error's variance by the factor
(sum of the singular values of Sk^1/2 Sq^1/2)^2 / (tr Sq tr Sk); "diag" is the optimum over
diagonal M, per-channel smoothing (channel c scaled by (Sk_cc / Sq_cc)^1/4 in q, its inverse
in k), factor (sum_c (Sq_cc Sk_cc)^1/2)^2 / (tr Sq tr Sk).  The transform is recipe-only (no bytes), like the centering.

Perplexity of a text (default: Debian's reference manual) over ``--windows`` segments of
``--tokens`` consecutive tokens (each after the tokenizer's sequence start, one forward pass
each), change against the same float32 model with exact K/V, for each rotation seed: one
run's change moves by up to a point and a half with the seed, so compare means and ranges.
The recipe is calibrated on another text (songs and poems, Debian's fortunes package) over
the same kind of segments, as ``python -m nexuskv calibrate`` measures it.  A model with a
logit soft-cap is refused (centering is not exact under it).

    python benchmarks/paged_quality_study.py --out benchmarks/paged_quality_study.json

Bytes per (token, kv head) are those of the format each row stands for, every scale and
zero counted (head_dim D, bf16): per-token pages ``paged.slot_bytes``; per-channel keys
D * bits / 8 + 4 * D / 64 (a bf16 scale and zero per channel per 64 tokens) instead of the
per-token keys' bytes; an exact window of W tokens adds W * 4 * D / P (W bf16 keys and values
per block of P tokens; P = 128 here, vLLM's CPU default: with 16-token blocks a window costs
eight times as much).  Rows that leave K or V exact are ablations: no bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from nexuskv import hadamard_rotate, models, nq_compress, nq_decompress, paged
from nexuskv.calibrate import text_windows
from nexuskv.compressors import rotation_signs
from nexuskv.eval_caches import head_dim_of
from nexuskv.recipe import calibrate

BLOCK = 128  # tokens per page block: vLLM's CPU default, the window rows' bytes assume it
CHANNEL_GROUP = 64  # tokens per group of the per-channel keys (nexuskv's own cache default)


@dataclass(frozen=True)
class Row:
    name: str
    bits: int = 4
    key_bits: int = 0  # 0: bits
    value_bits: int = 0  # 0: bits
    group: int = 0  # channels per group of a token; 0: --group
    keys: bool = True  # quantize the keys
    values: bool = True  # quantize the values
    center: bool = False  # subtract the recipe's key means first
    per_channel_keys: bool = False
    window: int = 0  # each query's newest W keys / values exact
    transform: str = ""  # "full" / "diag": a fitted M, q -> M q, k - m -> M^-T (k - m) (see above)
    fit: str = ""  # least-squares fitted ranges (nq_compress fit_range): "keys" or "all", as NEXUSKV_VLLM_FIT_RANGE

    @property
    def kv_bits(self) -> tuple[int, int]:
        return self.key_bits or self.bits, self.value_bits or self.bits


ROWS = [
    Row("4-bit (the backend's default)"),
    Row("4-bit, recipe", center=True),
    Row("4-bit, recipe, groups of 32", center=True, group=32),
    Row("4-bit, recipe, fitted transform", center=True, transform="full"),
    Row("4-bit, recipe, fitted smoothing", center=True, transform="diag"),
    Row("4-bit, recipe, fitted transform, keys only", center=True, transform="full", values=False),
    Row("4-bit, recipe, keys only", center=True, values=False),
    Row("4-bit, values only", keys=False),
    Row("4-bit, per-channel keys, no window", per_channel_keys=True),
    Row("4-bit, recipe, exact window 8", center=True, window=8),
    Row("4-bit, recipe, exact window 16", center=True, window=16),
    Row("4-bit, recipe, exact window 32", center=True, window=32),
    Row("8-bit keys, 4-bit values", key_bits=8),
    Row("8-bit keys, 3-bit values", key_bits=8, value_bits=3),
    Row("8-bit keys, 2-bit values", key_bits=8, value_bits=2),
    Row("2-bit, recipe", bits=2, center=True),
    Row("2-bit, recipe, exact window 32", bits=2, center=True, window=32),
    Row("4-bit, fitted key ranges", fit="keys"),
    Row("4-bit, fitted ranges", fit="all"),
    Row("4-bit, recipe, fitted key ranges", center=True, fit="keys"),
    Row("3-bit, recipe", bits=3, center=True),
    Row("3-bit, recipe, fitted key ranges", bits=3, center=True, fit="keys"),
    Row("3-bit, recipe, fitted ranges", bits=3, center=True, fit="all"),
    Row("2-bit, recipe, fitted key ranges", bits=2, center=True, fit="keys"),
    Row("2-bit, recipe, fitted ranges", bits=2, center=True, fit="all"),
    Row("4-bit, recipe, fitted ranges", center=True, fit="all"),
    Row("4-bit, recipe, groups of 32, fitted key ranges", center=True, group=32, fit="keys"),
    Row("4-bit, recipe, groups of 32, fitted ranges", center=True, group=32, fit="all"),
    Row("4-bit, recipe, fitted smoothing, fitted key ranges", center=True, transform="diag", fit="keys"),
    Row("4-bit, recipe, fitted key ranges, exact window 8", center=True, window=8, fit="keys"),
]


def row_bytes(row: Row, head_dim: int, group: int) -> float | None:
    """Bytes per (token, kv head) of the format the row stands for; None for an ablation."""
    if not (row.keys and row.values):
        return None
    group = min(row.group or group, head_dim)
    kb, vb = row.kv_bits
    b = paged.slot_bytes(head_dim, torch.bfloat16, kb, vb, group, 0)
    if row.per_channel_keys:  # per-channel key codes and metadata instead of per-token ones
        per_token_keys = head_dim * kb / 8 + 4 * math.ceil(head_dim / group)
        b += head_dim * kb / 8 + 4 * head_dim / CHANNEL_GROUP - per_token_keys
    return b + row.window * 4 * head_dim / BLOCK


def _matrix_power(x: torch.Tensor, p: float) -> torch.Tensor:
    """x^p of symmetric positive definite matrices [..., D, D]."""
    w, vec = torch.linalg.eigh(x)
    return (vec * w.clamp_min(torch.finfo(x.dtype).tiny).pow(p)[..., None, :]) @ vec.transpose(-1, -2)


@torch.no_grad()
def fitted_transforms(model, windows, key_center: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The rows' fitted M per layer and kv head ({"full", "diag"}: float64 [layers, kv_heads,
    D, D]) from the queries' and centered keys' second moments over `windows`, and each M's
    predicted factor on the score error's variance ({"full", "diag"}: [layers, kv_heads])."""
    from nexuskv.models import capture_qkv

    sq = sk = None
    seen = 0
    for ids in windows:
        for i, layer in enumerate(capture_qkv(model, ids)):
            q, k = layer.q.double()[0], layer.k.double()[0]  # [heads, T, D]
            k = k - key_center[i].double()[:, None, :]
            heads, d = k.shape[0], k.shape[-1]
            q = q.reshape(heads, -1, d)  # a kv head's queries: those of its GQA group
            if sq is None:
                sq = torch.zeros(len(key_center), heads, d, d, dtype=torch.float64)
                sk = torch.zeros_like(sq)
            sq[i] += q.transpose(1, 2) @ q / (q.shape[1] // k.shape[1])
            sk[i] += k.transpose(1, 2) @ k
        seen += ids.shape[1]
    sq, sk = sq / seen, sk / seen
    eye = torch.eye(sq.shape[-1], dtype=torch.float64)
    # A ridge of 1e-3 of the mean eigenvalue: directions no calibration query used stay finite.
    sq = sq + 1e-3 * sq.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    sk = sk + 1e-3 * sk.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    root, inv_root = _matrix_power(sq, 0.5), _matrix_power(sq, -0.5)
    middle = root @ sk @ root
    mtm = inv_root @ _matrix_power((middle + middle.transpose(-1, -2)) / 2, 0.5) @ inv_root
    full = _matrix_power((mtm + mtm.transpose(-1, -2)) / 2, 0.5)
    a, b = sq.diagonal(dim1=-2, dim2=-1), sk.diagonal(dim1=-2, dim2=-1)
    diag = torch.diag_embed((b / a).pow(0.25))
    sv = torch.linalg.eigvalsh(middle).clamp_min(0).sqrt().sum(-1)
    predicted = {
        "full": sv.square() / (a.sum(-1) * b.sum(-1)),
        "diag": (a * b).sqrt().sum(-1).square() / (a.sum(-1) * b.sum(-1)),
    }
    return {"full": full, "diag": diag}, predicted


class Study:
    """The attention function every layer of the model calls (transformers' interface)."""

    def __init__(self, group: int, center: torch.Tensor):
        self.group = group  # the rows' default
        self.center = center  # the recipe's key means [layers, kv_heads, D]
        self.row: Row | None = None
        self.signs = None
        self.transforms: dict = {}  # fitted_transforms()

    def per_token(self, x: torch.Tensor, bits: int, fit: bool) -> torch.Tensor:
        """x [1, heads, T, D] (bf16) as a bf16 page returns it: rotated, quantized per token,
        dequantized and un-rotated in float32."""
        group = min(self.row.group or self.group, x.shape[-1])
        r = hadamard_rotate(x, self.signs)  # rounded to x's dtype, as the write does
        p = nq_compress(r, bits, group, -1, fit_range=fit)
        back = nq_decompress(*p, bits, group, -1, x.shape[-1], out_dtype=torch.float32)
        return hadamard_rotate(back, self.signs, inverse=True)

    @staticmethod
    def per_channel(x: torch.Tensor, bits: int, fit: bool) -> torch.Tensor:
        p = nq_compress(x, bits, CHANNEL_GROUP, -2, fit_range=fit)
        return nq_decompress(*p, bits, CHANNEL_GROUP, -2, x.shape[-1], out_dtype=torch.float32)

    def __call__(self, module, q, k, v, mask, **kw):
        row = self.row
        if row is None:
            return sdpa_attention_forward(module, q, k, v, mask, **kw)
        if kw.get("softcap"):
            sys.exit("paged_quality_study: a logit soft-cap makes centering inexact; not supported")
        k, v = k.bfloat16(), v.bfloat16()
        if row.center:  # exact under softmax: q.(k - m) = q.k - q.m
            k = k - self.center[module.layer_idx][None, :, None, :].bfloat16()
        if row.transform:  # exact: (M q) . (M^-T k) = q . k
            m = self.transforms[row.transform][module.layer_idx].float()  # [kv_heads, D, D], symmetric
            q = q @ m.repeat_interleave(q.shape[1] // k.shape[1], 0)[None]
            k = (k.float() @ torch.linalg.inv(m)[None]).bfloat16()  # rounded as a bf16 write would be
        kq, vq = k.float(), v.float()
        kb, vb = row.kv_bits
        if row.keys:
            fit = row.fit in ("keys", "all")
            kq = self.per_channel(k, kb, fit) if row.per_channel_keys else self.per_token(k, kb, fit)
        if row.values:
            vq = self.per_token(v, vb, row.fit == "all")
        if not row.window:
            return sdpa_attention_forward(module, q, kq, vq, mask, **kw)
        # Query i sees keys j <= i (within the layer's sliding window); those with i - j < W
        # exact, the older ones quantized.
        T = q.shape[2]
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        causal = j <= i
        if kw.get("sliding_window"):  # Gemma 3's local layers
            causal &= i - j < kw["sliding_window"]
        exact = causal & (i - j < row.window)
        n_rep = module.num_key_value_groups  # GQA: q head h reads kv head h // n_rep
        ke, ve = repeat_kv(k.float(), n_rep), repeat_kv(v.float(), n_rep)
        kq, vq = repeat_kv(kq, n_rep), repeat_kv(vq, n_rep)
        scaling = kw.get("scaling") or module.scaling
        scores = torch.where(exact, q @ ke.transpose(-1, -2), q @ kq.transpose(-1, -2)) * scaling
        w = torch.softmax(scores.masked_fill(~causal, -math.inf), -1)
        out = (w * exact) @ ve + (w * ~exact) @ vq
        return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def perplexity(model, seqs) -> float:
    nll, count = 0.0, 0
    for s in seqs:
        logp = torch.log_softmax(model(s).logits[0, :-1].float(), -1).gather(1, s[0, 1:, None])
        nll -= logp.sum().item()
        count += logp.numel()
    return math.exp(nll / count)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model for nexuskv.models.load_model (default: SmolLM2)")
    ap.add_argument("--text", default=None, help="evaluation text (default: Debian's reference manual)")
    ap.add_argument("--calib-text", default="/usr/share/games/fortunes/songs-poems")
    ap.add_argument("--windows", type=int, default=3, help="segments of each text")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per segment")
    ap.add_argument("--group", type=int, default=64, help="channels per group of a token")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    names = [r.name for r in ROWS]
    unknown = [r for r in a.rows or [] if r not in names]
    if unknown:
        ap.error(f"unknown rows {unknown}; rows: {names}")
    torch.manual_seed(0)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    model, tok = models.load_model(dtype=torch.float32, attn_implementation="sdpa", path=a.model)
    evals = text_windows(tok, a.text, a.windows, a.tokens)
    calib = text_windows(tok, a.calib_text, a.windows, a.tokens)
    recipe, _ = calibrate(model, calib)
    study = Study(a.group, recipe.key_center)
    predicted = None
    if any(r.transform and (not a.rows or r.name in a.rows) for r in ROWS):
        study.transforms, predicted = fitted_transforms(model, calib, recipe.key_center)
        print(
            f"predicted score-error variance (mean over layers and heads): fitted transform "
            f"x{predicted['full'].mean():.3f}, fitted smoothing x{predicted['diag'].mean():.3f}"
        )
    AttentionInterface.register("nexuskv_study", study)
    # SDPA's masks for it (sliding windows included), as nexuskv.models.capture_qkv does:
    # without a mask builder transformers builds none, and every layer would attend causally
    # over the whole past.
    AttentionMaskInterface.register("nexuskv_study", sdpa_mask)
    model.set_attn_implementation("nexuskv_study")
    head_dim = head_dim_of(model.config)
    name = a.model or models.SMOLLM2
    dense = perplexity(model, evals)
    print(f"{name}, float32, {a.windows} x {a.tokens} tokens, exact K/V perplexity {dense:.4f}")
    print(f"{'row':40s} {'bytes':>6s}  " + "  ".join(f"seed {s}" for s in a.seeds) + "     mean")
    results = []
    for row in ROWS:
        if a.rows and row.name not in a.rows:
            continue
        changes = []
        for seed in a.seeds:
            study.row, study.signs = row, rotation_signs(head_dim, seed)
            changes.append(100 * (perplexity(model, evals) / dense - 1))
            study.row = None
        mean = sum(changes) / len(changes)
        b = row_bytes(row, head_dim, a.group)
        shown = f"{b:6.1f}" if b is not None else f"{'-':>6s}"
        print(f"{row.name:40s} {shown}  " + "  ".join(f"{c:+6.2f}" for c in changes) + f"  {mean:+6.2f} %", flush=True)
        results.append({"row": asdict(row), "bytes_per_token_head": b, "change_pct": changes, "mean_change_pct": mean})
    report = {
        "model": name,
        "head_dim": head_dim,
        "dense_perplexity": dense,
        "text": a.text or "debian-reference-en",
        "calibration_text": a.calib_text,
        "segments": f"{a.windows} x {a.tokens} consecutive tokens from the start of each text",
        "group": a.group,
        "block_size_for_windows": BLOCK,
        "seeds": a.seeds,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "rows": results,
    }
    if predicted is not None:
        for kind, name in (("full", "fitted_transform"), ("diag", "fitted_smoothing")):
            report[f"{name}_predicted_variance_factor"] = {
                "mean": predicted[kind].mean().item(),
                "per_layer": predicted[kind].mean(1).tolist(),
            }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
