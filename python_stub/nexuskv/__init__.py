"""nexuskv: KV-cache compression for PyTorch as C++/CUDA custom operators.

    import nexuskv
    c = nexuskv.NQ.for_keys(bits=4).compress(k)      # k: [..., tokens, head_dim]
    k_hat = nexuskv.NQ.for_keys(bits=4).decompress(c)
    c.effective_bits                                  # every byte counted
    out = nexuskv.fused_attention(q, ck, cv, lens)    # attention straight from the compressed cache
"""

from . import cache  # noqa: F401  (nexuskv.cache.make_cache: the compressed KV cache)
from .attention import fused_attention
from .compressors import (DEFAULT_KEY_PER, DEFAULT_VALUE_PER, DGQ, NQ, KVCompressor, NQTensor, effective_bits,
                          rotation_signs)
from .ops import (DGQParts, NQParts, dgq_compress, dgq_decompress, dgq_fused_attention, hadamard_rotate, nq_compress,
                  nq_decompress)

__version__ = "0.1.0"

__all__ = ["NQ", "DGQ", "NQTensor", "NQParts", "DGQParts", "KVCompressor", "effective_bits", "rotation_signs",
           "nq_compress", "nq_decompress", "dgq_compress", "dgq_decompress", "dgq_fused_attention",
           "hadamard_rotate", "fused_attention", "DEFAULT_KEY_PER", "DEFAULT_VALUE_PER"]
