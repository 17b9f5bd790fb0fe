"""nexuskv: KV-cache compression for PyTorch as C++/CUDA custom operators.

    import nexuskv
    c = nexuskv.NQ.for_keys(bits=4).compress(k)      # k: [..., tokens, head_dim]
    k_hat = nexuskv.NQ.for_keys(bits=4).decompress(c)
    c.effective_bits                                  # every byte counted
    out = nexuskv.fused_attention(q, ck, cv, lens)    # attention straight from the compressed cache
"""

from pathlib import Path as _Path

from . import cache  # noqa: F401  (nexuskv.cache.make_cache: the compressed KV cache)
from .attention import fused_attention
from .compressors import (DEFAULT_KEY_PER, DEFAULT_VALUE_PER, DGQ, NQ, KVCompressor, NQTensor, effective_bits,
                          rotation_signs)
from .ops import (DGQParts, NQParts, dgq_compress, dgq_decompress, dgq_fused_attention, hadamard_rotate, nq_compress,
                  nq_decompress)

__version__ = "0.1.0"

# For C++ applications: CMAKE_PREFIX_PATH entry under which find_package(nexuskv) finds the
# headers, libnexuskv and the CMake config this package ships (as torch.utils.cmake_prefix_path).
cmake_prefix_path = str(_Path(__file__).resolve().parent / "share" / "cmake")

__all__ = ["NQ", "DGQ", "NQTensor", "NQParts", "DGQParts", "KVCompressor", "effective_bits", "rotation_signs",
           "nq_compress", "nq_decompress", "dgq_compress", "dgq_decompress", "dgq_fused_attention",
           "hadamard_rotate", "fused_attention", "DEFAULT_KEY_PER", "DEFAULT_VALUE_PER", "cmake_prefix_path"]
