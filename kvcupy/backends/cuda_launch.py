"""Launches as programmatic dependents: a kernel whose blocks may start while the
kernel ahead of it in the stream is still running (sm_90 and newer).

CuPy's `Function.__call__` takes no launch attributes, so these launches go
through the driver's `cuLaunchKernelEx` (ctypes, libcuda: no new dependency)
with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION set. The kernel so
launched must execute `griddepcontrol.wait` (attention.cuh, `wait_for_prerequisites`)
before it reads anything the kernel ahead of it writes; the kernel ahead lets
it start early with `griddepcontrol.launch_dependents` (`allow_dependent_launch`).
Without that attribute both instructions are no-ops, so one build serves both
kinds of launch.

What it saves: the gap between the last block of one kernel and the first of
the next (about 5 us between decode's attention and its merge at 32 x 8192 on
an H200, tools/decode_trace.py), out of calls of 50-100 us.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID (cuda.h)
MIN_COMPUTE_CAPABILITY = 90             # griddepcontrol: PTX ISA 7.8, sm_90


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


def _programmatic_attribute() -> LaunchAttribute:
    attribute = LaunchAttribute()
    attribute.id = PROGRAMMATIC_STREAM_SERIALIZATION
    # programmaticStreamSerializationAllowed: the union's leading int.
    attribute.value = (1).to_bytes(4, "little") + bytes(60)
    return attribute


_PROGRAMMATIC = _programmatic_attribute()


@functools.cache
def _driver():
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    driver.cuLaunchKernelEx.restype = ctypes.c_int
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return driver


# Kernel arguments as the driver wants them: a pointer to each value. Device
# arrays pass their address; NumPy scalars their C type (as CuPy's launch does).
_C_TYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def c_argument(value):
    """`value` as the ctypes object whose address the launch passes."""
    if isinstance(value, np.generic):
        c_type = _C_TYPES.get(value.dtype)
        if c_type is None:
            raise TypeError(f"kernel argument of dtype {value.dtype} has no C type here")
        return c_type(value.item())
    pointer = getattr(getattr(value, "data", None), "ptr", None)
    if pointer is None:
        raise TypeError(f"kernel argument {type(value).__name__} is neither a device array nor a NumPy scalar")
    return ctypes.c_void_p(pointer)


def launch_config(grid: tuple, block: tuple, shared_bytes: int, stream: int) -> LaunchConfig:
    """The CUlaunchConfig of a programmatic-dependent launch."""
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    return LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, stream,
                        ctypes.pointer(_PROGRAMMATIC), 1)


def launch_dependent(function, grid: tuple, block: tuple, args: tuple, *, stream: int,
                     shared_bytes: int = 0) -> None:
    """Launches `function` (a cupy.RawKernel, as jit.get_function gives, or a
    cupy.cuda.Function) on `stream` (a handle) as a programmatic dependent of the
    kernel queued before it."""
    values = [c_argument(value) for value in args]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
    config = launch_config(grid, block, shared_bytes, stream)
    driver = _driver()
    handle = getattr(function, "kernel", function).ptr   # RawKernel.kernel: the current device's CUfunction
    result = driver.cuLaunchKernelEx(ctypes.byref(config), handle, pointers, None)
    if result != 0:
        name = ctypes.c_char_p()
        driver.cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({result})")
