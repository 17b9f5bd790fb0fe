"""nexuskv: KV-cache compression for PyTorch as C++/CUDA custom operators.

    import nexuskv
    c = nexuskv.NQ.for_keys(bits=4).compress(k)      # k: [..., tokens, head_dim]
    k_hat = nexuskv.NQ.for_keys(bits=4).decompress(c)
    c.effective_bits                                  # every byte counted
"""

from .compressors import DEFAULT_KEY_PER, DEFAULT_VALUE_PER, NQ, KVCompressor, NQTensor, effective_bits
from .ops import NQParts, nq_compress, nq_decompress

__version__ = "0.1.0"

__all__ = ["NQ", "NQTensor", "NQParts", "KVCompressor", "effective_bits", "nq_compress", "nq_decompress",
           "DEFAULT_KEY_PER", "DEFAULT_VALUE_PER"]
