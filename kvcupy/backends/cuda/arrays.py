"""The CUDA backend's availability and its arrays: CuPy arrays on a device, the
streams DLPack exchanges name, and the host index arrays batch.py uploads.

CuPy is imported where it is used, not with this package: a machine without
CuPy imports the backend, and `availability` says what it lacks.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ... import backends, jit
from ...formats import FP8_DTYPE
from ...interop import BFLOAT16

if TYPE_CHECKING:
    import cupy

# The backend's name and device kind; batch.py's uploads key on `name` and call
# `upload` (the launchers pass this module as the backend that holds them).
name = "cuda"
device_kind = "cuda"

# The kernels use sm_80 instructions (cvt.rn.bf16.f32, min.NaN.f32).
MIN_COMPUTE_CAPABILITY = 80


# --- availability ---------------------------------------------------------

def _version(number: int) -> str:
    """CUDA's 12040 -> "12.4"."""
    return f"{number // 1000}.{number % 1000 // 10}"


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(usable, what runs it or why not). Asked on every call's dispatch: computed once."""
    gaps = backends._machine_gaps(device_kind)
    if gaps:
        return False, "; ".join(gaps)
    import cupy
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:   # no driver, or a driver older than CuPy's runtime
        return False, f"no usable CUDA device ({type(error).__name__}: {error})"
    if count == 0:
        return False, "no CUDA device"
    try:
        properties = cupy.cuda.runtime.getDeviceProperties(0)
        gpu = properties["name"].decode() if isinstance(properties["name"], bytes) else str(properties["name"])
        capability = properties["major"] * 10 + properties["minor"]
        driver = _version(cupy.cuda.runtime.driverGetVersion())
        runtime = _version(cupy.cuda.runtime.runtimeGetVersion())
    except Exception as error:
        return False, f"the CUDA device cannot be queried ({type(error).__name__}: {error})"
    try:
        nvrtc = ".".join(str(n) for n in jit.nvrtc_version())
    except Exception as error:
        return False, f"{gpu}: NVRTC is not usable ({type(error).__name__}: {error})"
    if capability < MIN_COMPUTE_CAPABILITY:
        return False, f"{gpu} is sm_{capability}; kvcupy's CUDA kernels need sm_{MIN_COMPUTE_CAPABILITY} or newer"
    devices = f"{count} x {gpu}" if count > 1 else gpu
    return True, (f"{devices} (sm_{capability}), CUDA driver {driver}, runtime {runtime}, "
                  f"NVRTC {nvrtc}, CuPy {cupy.__version__}")


# --- arrays ---------------------------------------------------------------

def _storage(dtype) -> np.dtype:
    """CuPy has no bfloat16 or float8: they are stored as their bits."""
    dtype = np.dtype(dtype)
    if dtype == BFLOAT16:
        return np.dtype(np.uint16)
    if dtype == FP8_DTYPE:
        return np.dtype(np.uint8)
    return dtype


def import_dlpack(x) -> cupy.ndarray:
    import cupy
    return cupy.from_dlpack(x)


def current_stream(device) -> int:
    """The handle of CuPy's current stream on `device` (0: the legacy default stream)."""
    import cupy
    with cupy.cuda.Device(device.index):
        return cupy.cuda.get_current_stream().ptr


def device_view(pointer: int, shape: tuple, dtype: np.dtype, element_strides: tuple, owner, device) -> cupy.ndarray:
    """A CuPy array over memory another framework owns on `device` (interop's torch
    views): `shape` and `element_strides` (non-negative, in elements) from `pointer`,
    `owner` kept alive with it."""
    import cupy
    strides = tuple(stride * dtype.itemsize for stride in element_strides)
    extent = dtype.itemsize + sum((size - 1) * stride for size, stride in zip(shape, strides))
    memory = cupy.cuda.UnownedMemory(pointer, extent, owner, device.index)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


def dlpack_stream(device) -> int:
    """CuPy's current stream on `device`, as DLPack names it: 1 for the legacy default
    stream (whose handle is 0, which DLPack reserves), else the cudaStream_t (2 is the
    per-thread default stream in both conventions)."""
    import cupy
    with cupy.cuda.Device(device.index):
        handle = cupy.cuda.get_current_stream().ptr
    return handle or 1


def zeros(shape: tuple, dtype, device) -> cupy.ndarray:
    import cupy
    with cupy.cuda.Device(device.index):
        return cupy.zeros(shape, _storage(dtype))


def empty(shape: tuple, dtype, device) -> cupy.ndarray:
    import cupy
    with cupy.cuda.Device(device.index):
        return cupy.empty(shape, _storage(dtype))


def upload(array: np.ndarray, device) -> cupy.ndarray:
    import cupy
    with cupy.cuda.Device(device.index):
        return cupy.asarray(array)
