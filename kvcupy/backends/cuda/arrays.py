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


def device_context(device):
    """A context making `device` CuPy's current device (where launches and allocations go)."""
    import cupy
    return cupy.cuda.Device(device.index)


class _StreamHandle:
    """A bare stream handle in the CUDA stream protocol (`__cuda_stream__`), for CuPy's
    `Stream.from_external`."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_external_streams: dict = {}
_EXTERNAL_STREAMS_KEPT = 64


def stream_context(device, ptr: int):
    """A context making stream `ptr` (a handle another framework owns, on `device`,
    which must be current) CuPy's current stream. One CuPy view is kept per
    (device, handle): making one costs more than the rest of a switch. A view holds
    the handle only and never destroys the stream."""
    import cupy
    key = (cupy.cuda, device.index, ptr)   # (the module too: tests swap in a stand-in)
    stream = _external_streams.get(key)
    if stream is None:
        if len(_external_streams) >= _EXTERNAL_STREAMS_KEPT:
            _external_streams.clear()
        if hasattr(cupy.cuda.Stream, "from_external"):   # CuPy >= 14; it never destroys the stream
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device.index)
        _external_streams[key] = stream
    return stream


def synchronize(device) -> None:
    """Wait for CuPy's current stream on `device`."""
    import cupy
    with cupy.cuda.Device(device.index):
        cupy.cuda.get_current_stream().synchronize()


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


def upload_into(target: cupy.ndarray, array: np.ndarray) -> None:
    """Host `array` into the existing device array `target` (same shape and dtype), one
    copy on the current stream: `target` keeps its address (a CUDA graph reads it)."""
    target.set(np.ascontiguousarray(array, dtype=target.dtype))
