"""One fused decode attention call for a profiler (needs a GPU): llama-like 32 q / 8 kv heads,
head_dim 128, bf16, keys per channel / values per token in groups of 64, no outliers, the
decode kernel (contig_decode_kernel, what a decode step runs by default) or, with a fourth
argument "mma", the 16-row tensor-core kernel (attention_mma_kernel); called twice (profile the
second launch: ncu --launch-skip 1).

    ncu --clock-control none --kernel-name "regex:contig_decode|attention_mma" --launch-skip 1 \\
        --launch-count 1 --set full python benchmarks/ncu_attention_case.py 64 32768 4   # batch, context, bits
"""

from __future__ import annotations

import os
import sys

import torch

import nexuskv
from nexuskv.ops import dgq_fused_attention


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[3:] not in ([], ["decode"], ["mma"]):
        print(__doc__, file=sys.stderr)
        return 2
    B, T, bits = (int(a) for a in argv[:3])
    kernel = argv[3] if len(argv) == 4 else "decode"
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q = randn(B, 32, 1, 128)
    kc = nexuskv.nq_compress(randn(B, 8, T, 128), bits, 64, -2)
    vc = nexuskv.nq_compress(randn(B, 8, T, 128), bits, 64, -1)
    lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
    os.environ["NEXUSKV_CUDA_ATTENTION"] = kernel  # (the call fails if that kernel does not take it)
    for _ in range(2):
        dgq_fused_attention(q, kc, vc, [bits, 64, -2], [bits, 64, -1], lens)
    torch.cuda.synchronize()
    print("done", B, T, bits, kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
