"""Arrays in and out: NumPy, CuPy, torch, JAX or any DLPack producer, zero-copy.

`as_array` turns an argument into an `Array`: the backend's own view of the
caller's memory (a NumPy array on the host, a CuPy array on a GPU), its
*logical* dtype and its device. Nothing is copied. bfloat16 and float8_e4m3fn
have no dtype in NumPy or CuPy's DLPack importers, so their DLPack header is
relabelled as unsigned integers of the same width before import and the
logical dtype is kept beside the array: on the host the view then carries
`ml_dtypes`' dtype, on a GPU it stays the raw bits (backends read bits anyway).

Which backend serves a device is the registry's business
(`kvcupy.backends`); a device whose backend cannot run here is refused with
the argument's name and the reason. Results go back to the caller's framework
(`like`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .formats import FP8_DTYPE

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Device:
    """Where an array lives: kind "cpu", "cuda" or "rocm", and the device number."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind == "cpu" else f"{self.kind}:{self.index}"


HOST = Device("cpu")

# dlpack.h's DLDeviceType: host-visible kinds read as host memory.
DLPACK_DEVICE_KINDS = {1: "cpu", 3: "cpu", 11: "cpu",      # kDLCPU, kDLCUDAHost, kDLROCMHost
                       2: "cuda", 13: "cuda",              # kDLCUDA, kDLCUDAManaged
                       10: "rocm"}                          # kDLROCM
# dlpack.h's DLDataTypeCode values that NumPy / CuPy cannot import.
DLPACK_UINT, DLPACK_BFLOAT, DLPACK_FLOAT8_E4M3FN = 1, 4, 10


@dataclass(frozen=True)
class Array:
    """An argument as a backend sees it.

    data: NumPy array (host) or the device backend's array type; for bfloat16
    and float8 on a device, a same-width unsigned view of the bits. dtype: the
    logical dtype (NumPy, with ml_dtypes' bfloat16 / float8_e4m3fn).
    """

    data: Any
    dtype: np.dtype
    device: Device
    framework: str
    name: str

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)


def framework_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module == "jaxlib":
        return "jax"
    return module if module in ("torch", "jax", "cupy") else "dlpack"


def device_of(x) -> Device:
    """The device of an array argument, from its DLPack device (NumPy: the host)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack_device__"):
        return HOST
    device_type, device_id = x.__dlpack_device__()
    kind = DLPACK_DEVICE_KINDS.get(int(device_type))
    if kind is None:
        raise ValueError(f"DLPack device type {int(device_type)} is not one kvcupy runs on "
                         "(host, CUDA or ROCm)")
    return Device(kind, 0 if kind == "cpu" else int(device_id))


# --- DLPack capsules ------------------------------------------------------

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# Where DLTensor sits in dlpack.h's capsule structs on a 64-bit platform:
# first in DLManagedTensor (legacy "dltensor"); after {version, manager_ctx,
# deleter, flags} in DLManagedTensorVersioned ("dltensor_versioned"). Inside
# DLTensor: data pointer, DLDevice (2 x int32), ndim (int32), then DLDataType
# {uint8 code, uint8 bits, uint16 lanes}.
_TENSOR_OFFSETS = {b"dltensor": 0, b"dltensor_versioned": 32}
_DTYPE_CODE_OFFSET, _DTYPE_BITS_OFFSET = 20, 21


class _Relabelled:
    """A DLPack capsule handed to an importer as if it were a tensor."""

    def __init__(self, capsule, device):
        self._capsule, self._device = capsule, device

    def __dlpack__(self, *args, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


def _export(x, name: str, stream=None):
    """(capsule, its name): versioned when the producer speaks DLPack 1.x, since
    NumPy marks arrays imported from legacy capsules read-only. `stream`: the
    consumer's stream (DLPack's convention), on which the producer orders its work."""
    kwargs = {} if stream is None else {"stream": stream}
    try:
        try:
            return x.__dlpack__(max_version=(1, 0), **kwargs), b"dltensor_versioned"
        except TypeError:   # a producer from before DLPack 1.0
            return x.__dlpack__(**kwargs), b"dltensor"
    except (BufferError, RuntimeError, TypeError, ValueError) as error:
        raise TypeError(f"{name} could not be exported through DLPack: {error}") from None


def _relabel_raw(x, name: str, stream=None):
    """(importable DLPack object, logical dtype or None): bfloat16 / float8 capsules
    relabelled as uint16 / uint8, so that NumPy and CuPy import them without a copy."""
    capsule, capsule_name = _export(x, name, stream)
    try:
        tensor = _get_pointer(capsule, capsule_name) + _TENSOR_OFFSETS[capsule_name]
    except ValueError:   # a 1.x producer that still answered with a legacy capsule
        capsule_name = b"dltensor"
        tensor = _get_pointer(capsule, capsule_name)
    code = ctypes.c_uint8.from_address(tensor + _DTYPE_CODE_OFFSET)
    bits = ctypes.c_uint8.from_address(tensor + _DTYPE_BITS_OFFSET).value
    logical = None
    if code.value == DLPACK_BFLOAT and bits == 16:
        logical = BFLOAT16
    elif code.value == DLPACK_FLOAT8_E4M3FN and bits == 8:
        logical = FP8_DTYPE
    if logical is not None:
        code.value = DLPACK_UINT
    return _Relabelled(capsule, x.__dlpack_device__()), logical


def _torch_raw(x):
    """torch tensors whose dtype DLPack may not carry (float8 in older torch): a
    same-width integer view, and the logical dtype."""
    import torch
    raw = {torch.bfloat16: (torch.int16, BFLOAT16)}
    if hasattr(torch, "float8_e4m3fn"):
        raw[torch.float8_e4m3fn] = (torch.uint8, FP8_DTYPE)
    if x.dtype in raw:
        view, logical = raw[x.dtype]
        return x.view(view), logical
    return x, None


def _host_view(x, name: str) -> tuple[np.ndarray, np.dtype]:
    if framework_of(x) == "jax":
        array = np.asarray(x)   # JAX arrays are immutable: a read-only view is all there is
        return array, array.dtype
    if framework_of(x) == "torch":
        x, logical = _torch_raw(x)
        array = np.from_dlpack(x)
    else:
        relabelled, logical = _relabel_raw(x, name)
        array = np.from_dlpack(relabelled)
    if logical is not None:
        array = array.view(logical)
    return array, array.dtype


def as_array(x, name: str) -> Array:
    """`x` as an Array, without copying; a TypeError / ValueError naming `name`
    when it is no array, or its device has no backend that can run here."""
    if isinstance(x, np.ndarray):
        return Array(x, x.dtype, HOST, "numpy", name)
    if isinstance(x, np.generic) or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name} must be an array (NumPy, CuPy, torch, JAX or any DLPack "
                        f"tensor), got {type(x).__name__}")
    try:
        device = device_of(x)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    framework = framework_of(x)
    if device.kind == "cpu":
        data, dtype = _host_view(x, name)
        return Array(data, dtype, HOST, framework, name)

    from . import backends
    backend = backends.for_device(device, name)
    if framework == "cupy":
        # The backend's own array type: nothing to import (and no DLPack stream
        # handshake, which CuPy refuses while a stream is being captured).
        return Array(x, np.dtype(x.dtype), device, framework, name)
    if framework == "torch":
        x, tagged = _torch_raw(x)
    else:
        tagged = None
    stream = backend.dlpack_stream(device)
    raw, logical = _relabel_raw(x, name, stream)
    data = backend.import_dlpack(raw)
    return Array(data, tagged or logical or np.dtype(data.dtype), device, framework, name)


def index_array(x, name: str) -> Array:
    """An index argument: any array, or an array-like of ints (a list, say), which
    NumPy converts on the host."""
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        return as_array(x, name)
    if isinstance(x, (str, bytes)) or np.isscalar(x) or x is None:
        raise TypeError(f"{name} must be an array of ints, got {type(x).__name__}")
    array = np.asarray(x)
    if array.size == 0 and array.dtype == np.float64:   # np.asarray([]) is float64
        array = array.astype(np.int64)
    return Array(array, array.dtype, HOST, "numpy", name)


def same_placement(arrays: list[Array]) -> None:
    """Data arguments of one call share one device and one framework, or a
    TypeError names the first two that differ."""
    first = arrays[0]
    for other in arrays[1:]:
        if other.device != first.device:
            raise TypeError(f"{first.name} is on {first.device} but {other.name} is on "
                            f"{other.device}; one call runs on one device")
        if other.framework != first.framework:
            raise TypeError(f"{first.name} is a {first.framework} array but {other.name} is a "
                            f"{other.framework} array; pass one framework's arrays to one call")


def on_device_or_host(index: Array, device: Device) -> None:
    """Index arguments may live on the host (checked there, then uploaded) or on
    the call's device."""
    if index.device not in (HOST, device):
        raise TypeError(f"{index.name} is on {index.device}; expected the host or {device}, "
                        "where the call's data lives")


def like(result: Array, reference):
    """`result` in the framework of `reference`, zero-copy where DLPack allows."""
    framework = framework_of(reference)
    data = result.data
    if result.device.kind == "cpu":
        return _host_like(data, framework)
    if framework == "torch":
        import torch
        tensor = torch.from_dlpack(data)
        if result.dtype == BFLOAT16:
            return tensor.view(torch.bfloat16)
        if result.dtype == FP8_DTYPE:
            return tensor.view(torch.float8_e4m3fn)
        return tensor
    if framework == "jax":
        import jax
        array = jax.dlpack.from_dlpack(data)
        if result.dtype in (BFLOAT16, FP8_DTYPE):   # the bits crossed as unsigned integers
            array = jax.lax.bitcast_convert_type(array, result.dtype)
        return array
    return data


def _host_like(data: np.ndarray, framework: str):
    if framework == "torch":
        import torch
        if data.dtype == BFLOAT16:
            return torch.from_dlpack(data.view(np.int16)).view(torch.bfloat16)
        if data.dtype == FP8_DTYPE:
            return torch.from_dlpack(data.view(np.uint8)).view(torch.float8_e4m3fn)
        return torch.from_dlpack(data)
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.asarray(data)
    return data
