"""Programmatic dependent launch: a kernel started while the kernel before it on the stream
still runs, its CTAs scheduled on the SMs that kernel's early CTAs leave, each waiting in
``griddepcontrol.wait`` (csrc pdl_wait) until the earlier grid has completed and its writes are
visible. CuPy's RawKernel launches without launch attributes, so this goes through the
driver's ``cuLaunchKernelEx``; ``launch`` returns False where the driver has no such entry
point (the caller then launches plainly: the wait returns at once after a plain launch).
``SPHERICAL_KV_PDL=0`` in the environment turns it off (every launch plain), to measure what it
buys and to tell its effects from others'.

A stream being captured into a CUDA graph gets a plain launch. On the H200 (driver 580.159), a
decode step captured with the merge as a programmatic dependent replayed different numbers from
the same step run eagerly (up to 0.9 in a unit-scale output, from the first replay); captured
with plain launches it replays them bit for bit (tests/test_device_cache.py, the graph and
torch.compile cases). The merge's early start is an eager-path gain only.
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from ._module import cupy

_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID (cuda.h)


class _Attr(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (here its int)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _launch_ex():
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.c_void_p]
    return fn


def _param(a):
    """One kernel argument as the ctypes value the driver copies (as CuPy passes it)."""
    if isinstance(a, cupy().ndarray):
        return ctypes.c_void_p(a.data.ptr)
    for np_type, c_type in ((np.uint64, ctypes.c_uint64), (np.int64, ctypes.c_int64),
                            (np.int32, ctypes.c_int32), (np.float32, ctypes.c_float)):
        if isinstance(a, np_type):
            return c_type(a.item())
    raise TypeError(f"no kernel argument of type {type(a).__name__}")


def _dim3(v) -> tuple:
    v = tuple(int(x) for x in (v if isinstance(v, tuple) else (v,)))
    return v + (1,) * (3 - len(v))


@functools.lru_cache(maxsize=None)
def _supported(device_id: int) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 or newer."""
    return int(cupy().cuda.Device(device_id).compute_capability) >= 90


def launch(fn, grid, block, args, shared_mem: int = 0) -> bool:
    """Launches ``fn`` (a kernel of the module, as returned by ``kernel``) on the current
    stream as a programmatic dependent of the work before it. False: not available here
    (no such driver entry point, or a GPU older than compute capability 9.0)."""
    launch_ex = _launch_ex()
    if os.environ.get("SPHERICAL_KV_PDL", "1") == "0" or launch_ex is None or not _supported(cupy().cuda.Device().id):
        return False
    stream = cupy().cuda.get_current_stream()
    if stream.is_capturing():
        return False
    vals = [_param(a) for a in args]
    ptrs = (ctypes.c_void_p * max(1, len(vals)))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _Config(shared_mem=int(shared_mem), stream=stream.ptr,
                  attrs=ctypes.pointer(attr), num_attrs=1)
    cfg.grid[:] = _dim3(grid)
    cfg.block[:] = _dim3(block)
    rc = launch_ex(ctypes.byref(cfg), ctypes.c_void_p(int(fn.kernel.ptr)), ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {rc})")
    return True
