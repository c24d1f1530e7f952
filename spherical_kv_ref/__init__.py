"""Spherical KV — NumPy reference (the specification that engines import).

A compressed key/value cache for LLM decoding: ``SphericalCodec`` (encode, logits from
codes and their error bounds, decode), ``attention``, the ``TierLadder``, the paged
``SphericalKVCache`` with RDR (``rdr``) to compress a sequence to a byte budget. The
documents are in the project's docs/ folder: docs/design.md (how the parts fit, the decode
specification, the serving path), docs/format.md (the storage format), docs/ada.md
(logits from codes and their errors), docs/paged.md (pages and the cache), docs/rdr.md
(retention under a byte budget), docs/kernels.md (the GPU kernels); the README's "Public
API" section lists the calls."""
from . import codebooks, rotation
from .ada import attention, dense_attention, softmax
from .codec import Encoded, SphericalCodec, code_words, pack_codes, unpack_codes, vector_bytes
from .tiers import TierLadder

__all__ = ["Encoded", "SphericalCodec", "SphericalKVCache", "TierLadder", "attention",
           "dense_attention", "softmax", "code_words", "pack_codes", "unpack_codes",
           "vector_bytes", "codebooks", "rotation", "paged", "rdr", "__version__"]
__version__ = "0.1.0"
from .cache import SphericalKVCache
from . import paged
from . import rdr
