"""Shared setup of the asv benchmarks: the GPU benchmarks (ada_decode, encode, retier) skip
themselves where CuPy sees no device, and time with CUDA events."""
import numpy as np


def gpu():
    """The cupy module, or NotImplementedError (asv's skip) without CuPy or a device."""
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise NotImplementedError("no CUDA device")
        return cp
    except ImportError:
        raise NotImplementedError("CuPy is not installed")
    except Exception as e:  # no driver
        raise NotImplementedError(str(e))


def gpu_us(cp, fn, reps: int = 1, warm: bool = False) -> float:
    """Median microseconds of ``fn()`` on the current stream over ``reps`` CUDA-event timings
    (``warm``: one untimed call first)."""
    if warm:
        fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(times))
