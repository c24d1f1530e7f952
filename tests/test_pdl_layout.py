"""CPU checks of the ctypes mirror of the driver's launch structures (cupy_kernels/_pdl.py):
a wrong offset would hand the driver garbage without any error on this side."""
import ctypes

from cupy_kernels import _pdl


def test_launch_attribute_layout_matches_cuda_h():
    # struct CUlaunchAttribute_st { CUlaunchAttributeID id; char pad[8 - sizeof(id)];
    #                               CUlaunchAttributeValue value; /* union of 64 bytes */ }
    assert ctypes.sizeof(_pdl._Attr) == 72
    assert _pdl._Attr.value.offset == 8
    a = _pdl._Attr(id=_pdl._PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    raw = bytes(a)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")


def test_launch_config_layout_matches_cuda_h():
    # struct CUlaunchConfig_st { unsigned gridDimX, Y, Z, blockDimX, Y, Z, sharedMemBytes;
    #                            CUstream hStream; CUlaunchAttribute *attrs; unsigned numAttrs; }
    c = _pdl._Config
    assert (c.grid.offset, c.block.offset, c.shared_mem.offset) == (0, 12, 24)
    assert (c.stream.offset, c.attrs.offset, c.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(c) == 56


def test_dim3():
    assert _pdl._dim3((4, 2)) == (4, 2, 1)
    assert _pdl._dim3(7) == (7, 1, 1)
    assert _pdl._dim3((1, 2, 3)) == (1, 2, 3)
