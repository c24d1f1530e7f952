"""Spherical KV production kernels: CuPy RawModule CUDA C + thin launchers (docs/design.md §6).

Importing this package does not import CuPy; the launchers do, on first use.
"""
from .ada_decode import DecodeWorkspace, ada_decode, choose_splits, make_workspace
from .encode import encode_into_pages, encode_kv_into_pages
from .from_cache import decode_cache, kernel_inputs, upload_pool
from .kernel_tables import KernelTables, PackedPages, kernel_tables, pack_pages, rotation_signs
from .retier import retier

__all__ = ["ada_decode", "DecodeWorkspace", "choose_splits", "make_workspace",
           "encode_into_pages", "encode_kv_into_pages", "retier", "KernelTables", "PackedPages", "kernel_tables",
           "pack_pages", "rotation_signs", "decode_cache", "kernel_inputs", "upload_pool"]
