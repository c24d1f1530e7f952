"""Spherical KV — NumPy reference (the specification that engines import).

See docs/format.md for the storage format and DESIGN §7 for the public API."""
from . import codebooks, rotation
from .ada import attention, dense_attention, softmax
from .codec import Encoded, SphericalCodec, code_words, pack_codes, unpack_codes, vector_bytes
from .tiers import TierLadder

__all__ = ["Encoded", "SphericalCodec", "TierLadder", "attention", "dense_attention",
           "softmax", "code_words", "pack_codes", "unpack_codes", "vector_bytes",
           "codebooks", "rotation"]
__version__ = "0.1.0"
from .cache import SphericalKVCache
from . import paged
from . import rdr
