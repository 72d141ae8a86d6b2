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

Where a call runs (`running_on`): on the device its arrays live on, made
current for the call, and on the caller's stream: torch's current stream for
torch tensors, the stream JAX makes external data ready on for JAX arrays,
CuPy's current stream otherwise. The same stream is the one DLPack exchanges
name, so a handover between the caller and kvcupy costs no event and no
synchronisation.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
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


def _check_jax_array(x, name: str) -> None:
    """A JAX array kvcupy can read: concrete (kernels run eagerly, not under jax.jit)
    and on one device (JAX's DLPack export would hand over only its first shard)."""
    import jax
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} is a traced JAX value: kvcupy runs eagerly, outside jax.jit "
                        "(call it between jitted functions)")
    devices = x.devices()
    if len(devices) != 1:
        raise TypeError(f"{name} is a JAX array on {len(devices)} devices; pass one device's "
                        "shard (x.addressable_shards[i].data), one call per device")


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
    """x's DLPack capsule: versioned when the producer speaks DLPack 1.x, since
    NumPy marks arrays imported from legacy capsules read-only. `stream`: the
    consumer's stream (DLPack's convention), on which the producer orders its work."""
    kwargs = {} if stream is None else {"stream": stream}
    try:
        try:
            return x.__dlpack__(max_version=(1, 0), **kwargs)
        except TypeError:   # a producer from before DLPack 1.0
            return x.__dlpack__(**kwargs)
    except (BufferError, RuntimeError, TypeError, ValueError) as error:
        raise TypeError(f"{name} could not be exported through DLPack: {error}") from None


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dtype_field(capsule) -> tuple[ctypes.c_uint8, int]:
    """The capsule's DLDataType code (writable in place) and its bit width. Read by
    the capsule's own name: JAX answers a request for DLPack 1.x with a legacy one."""
    for name, offset in _TENSOR_OFFSETS.items():
        if _capsule_is_valid(capsule, name):
            tensor = _get_pointer(capsule, name) + offset
            code = ctypes.c_uint8.from_address(tensor + _DTYPE_CODE_OFFSET)
            return code, ctypes.c_uint8.from_address(tensor + _DTYPE_BITS_OFFSET).value
    raise TypeError("__dlpack__ returned no unused DLPack capsule")


# Logical dtypes NumPy and CuPy hold only as bits, and their DLPack codes.
_TAGGED_CODES = {BFLOAT16: (DLPACK_BFLOAT, 16), FP8_DTYPE: (DLPACK_FLOAT8_E4M3FN, 8)}


def _relabel_raw(x, name: str, stream=None):
    """(importable DLPack object, logical dtype or None): bfloat16 / float8 capsules
    relabelled as uint16 / uint8, so that NumPy and CuPy import them without a copy."""
    capsule = _export(x, name, stream)
    code, bits = _dtype_field(capsule)
    logical = next((dtype for dtype, tag in _TAGGED_CODES.items() if tag == (code.value, bits)), None)
    if logical is not None:
        code.value = DLPACK_UINT
    return _Relabelled(capsule, x.__dlpack_device__()), logical


class _Tagged:
    """Bits (uint16 / uint8, NumPy or CuPy) exported through DLPack as `dtype`
    (bfloat16 / float8_e4m3fn): a consumer that knows the type (JAX) imports
    them as such, without a copy. The consumer's stream passes through."""

    def __init__(self, bits, dtype: np.dtype):
        self._bits, self._code = bits, _TAGGED_CODES[dtype][0]

    def __dlpack__(self, *args, **kwargs):
        capsule = self._bits.__dlpack__(*args, **kwargs)
        code, _ = _dtype_field(capsule)
        code.value = self._code
        return capsule

    def __dlpack_device__(self):
        return self._bits.__dlpack_device__()


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


# torch dtypes a device view takes straight from the tensor's pointer: their
# storage dtype in CuPy and, where CuPy has none, the logical dtype (torch's
# bfloat16 as int16 bits, as _torch_raw's DLPack view gives them).
_torch_views: dict = {}


def _torch_view_dtypes() -> dict:
    if not _torch_views:
        import torch
        _torch_views.update({torch.float16: (np.dtype(np.float16), None), torch.float32: (np.dtype(np.float32), None),
                             torch.float64: (np.dtype(np.float64), None), torch.bfloat16: (np.dtype(np.int16), BFLOAT16),
                             torch.int8: (np.dtype(np.int8), None), torch.uint8: (np.dtype(np.uint8), None),
                             torch.int16: (np.dtype(np.int16), None), torch.int32: (np.dtype(np.int32), None),
                             torch.int64: (np.dtype(np.int64), None)})
        if hasattr(torch, "float8_e4m3fn"):
            _torch_views[torch.float8_e4m3fn] = (np.dtype(np.uint8), FP8_DTYPE)
    return _torch_views


def _torch_device_view(x, device: Device, backend):
    """(CuPy array over a torch GPU tensor's memory, logical dtype or None) built from
    its pointer, shape and strides, or None where the DLPack exchange must run.

    DLPack's export costs torch tens of microseconds of Python a tensor, and
    the exchange around it more (tools/host_primitives.py); all it adds
    here is the ordering of torch's pending work before the consumer's stream,
    which is nothing when that stream is torch's current one, the stream every
    kvcupy call on torch tensors runs on (`running_on`). So the view is built
    directly where the two streams are the same and the tensor is one DLPack
    would export as it is (strided, not requiring grad: DLPack refuses those
    with its own message, which the other path passes on). The array keeps
    the tensor alive, as DLPack's capsule would."""
    if not hasattr(backend, "device_view"):
        return None
    import torch
    raw = _torch_view_dtypes().get(x.dtype)
    if raw is None or x.requires_grad or x.numel() == 0 or not x.is_cuda or x.layout is not torch.strided:
        return None
    if not _torch_stream_is_current(device, backend):
        return None
    storage, logical = raw
    data = backend.device_view(x.data_ptr(), tuple(x.shape), storage, tuple(x.stride()), x, device)
    return data, logical


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
    when it is no array, or its device has no backend that can run here.

    On a GPU the producer orders its pending work before CuPy's current stream
    (DLPack's stream argument): inside `running_on` that is the caller's own
    stream, so the handover costs nothing."""
    if isinstance(x, np.ndarray):
        return Array(x, x.dtype, HOST, "numpy", name)
    if isinstance(x, np.generic) or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name} must be an array (NumPy, CuPy, torch, JAX or any DLPack "
                        f"tensor), got {type(x).__name__}")
    framework = framework_of(x)
    if framework == "jax":
        _check_jax_array(x, name)
    try:
        device = device_of(x)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    if device.kind == "cpu":
        data, dtype = _host_view(x, name)
        return Array(data, dtype, HOST, framework, name)

    from . import backends
    backend = backends.for_device(device, name)
    if framework == "cupy":
        # The backend's own array type: nothing to import (and no DLPack stream
        # handshake, which CuPy refuses while a stream is being captured).
        return Array(x, np.dtype(x.dtype), device, framework, name)
    tagged = None
    exporting = contextlib.nullcontext()
    if framework == "torch":
        view = _torch_device_view(x, device, backend)
        if view is not None:
            data, logical = view
            return Array(data, logical or np.dtype(data.dtype), device, framework, name)
        import torch
        x, tagged = _torch_raw(x)
        exporting = torch.cuda.device(device.index)   # torch exports only from the current device
    stream = backend.dlpack_stream(device)
    if framework == "jax" and stream_source(x).stream() is None:
        stream = None   # a JAX build without external streams: it hands over ready data
    with exporting:
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


def immutable(tensor, name: str) -> None:
    """A TypeError when `tensor` is a JAX array, which must never be written in place
    (JAX may share or reuse its buffer; on a GPU nothing else would stop the write)."""
    if framework_of(tensor) == "jax":
        raise TypeError(f"{name} is a JAX array, and JAX arrays are immutable: kvcupy never "
                        "writes into one (kvcupy.updated_cache returns a cache with the tokens "
                        "written; leave out= unset to get a new JAX array)")


# --- where a call runs: device and stream ----------------------------------

@dataclass(frozen=True)
class StreamSource:
    """Whose stream a call runs on: `framework` ("torch", "jax"; None for CuPy's
    current stream) and its handle on the device (torch: the device index; JAX:
    its Device). Asked at each call, so the stream current *then* is used."""

    framework: str | None = None
    handle: Any = None

    def stream(self) -> int | None:
        """The caller's stream pointer now, or None for CuPy's current stream."""
        if self.framework == "torch":
            import torch
            return int(torch.cuda.current_stream(self.handle).cuda_stream)
        if self.framework == "jax":
            return jax_ready_stream(self.handle)
        return None


CUPY_STREAM = StreamSource()
_JAX_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def stream_source(x) -> StreamSource:
    """The stream source of an argument: its framework's, when that framework
    has streams on a GPU (torch, JAX); CuPy's current stream for anything else."""
    framework = framework_of(x)
    if framework == "torch" and x.device.type == "cuda":   # ROCm builds of torch say "cuda" too
        return StreamSource("torch", x.device.index)
    if framework == "jax":
        import jax
        if not isinstance(x, jax.core.Tracer) and len(x.devices()) == 1:
            (device,) = x.devices()
            if device.platform in _JAX_GPU_PLATFORMS:
                return StreamSource("jax", device)
    return CUPY_STREAM


_jax_streams: dict = {}


def jax_ready_stream(device) -> int | None:
    """The stream kvcupy runs JAX arrays' calls on: one a JAX GPU device takes external
    data on (what jax.dlpack.from_dlpack passes to producers, and where JAX waits for
    them), asked once per device and kept. JAX hands out several such streams in turn
    (a call's write and its attention may get different ones), and
    kvcupy's own calls must stay ordered among themselves: a write, then the attention
    that reads it. Exchanges with JAX stay ordered whichever stream JAX names, through
    DLPack's stream argument. None where the JAX build does not implement it (then
    kvcupy uses CuPy's current stream and synchronises it before handing a result to
    JAX: see `like`)."""
    key = (device.platform, device.id)
    if key not in _jax_streams:
        try:
            _jax_streams[key] = int(device.get_stream_for_external_ready_events())
        except RuntimeError as error:   # jax.errors.JaxRuntimeError (XlaRuntimeError before it)
            if "UNIMPLEMENTED" not in str(error):
                raise
            _jax_streams[key] = None
    return _jax_streams[key]


def _stream_backend(device: Device):
    """The backend that launches kvcupy's work on `device`, where it has a device
    and streams to make current; None on the host, or where the device has no
    backend (as_array names the argument and the reason)."""
    if device.kind == "cpu":
        return None
    from . import backends
    try:
        return backends.for_device(device)
    except ValueError:
        return None


class running_on:
    """Run the enclosed kvcupy work on `device` (current for its backend and, for
    torch callers, for torch) and on `source`'s stream, made the backend's
    current stream (CuPy's, for the GPU backends): every launch and every DLPack
    exchange inside then uses it. Nothing waits:
    no stream or device synchronisation. (A class rather than a generator: a
    call enters it once, and its host time counts; tools/host_primitives.py.)"""

    def __init__(self, device: Device, source: StreamSource = None):
        self.device, self.source = device, source or CUPY_STREAM
        self.entered = []

    def __enter__(self):
        device = self.device
        backend = _stream_backend(device)
        if backend is None:
            return self
        try:
            self._enter(backend.device_context(device))
            if self.source.framework == "torch":
                import torch
                self._enter(torch.cuda.device(device.index))
            ptr = self.source.stream()
            if ptr is not None:
                self._enter(backend.stream_context(device, ptr))
                if self.source.framework == "torch":
                    self._enter(_TorchStreamEntered(device.index, ptr))
        except BaseException:   # what was entered is left again, as `with` will not
            self.__exit__(None, None, None)
            raise
        return self

    def _enter(self, context) -> None:
        context.__enter__()
        self.entered.append(context)

    def __exit__(self, *exc):
        while self.entered:
            self.entered.pop().__exit__(*exc)
        return False


_entered = threading.local()


class _TorchStreamEntered:
    """Notes, for this thread, the torch stream a `running_on` made CuPy's current one
    on a device, so that `_torch_device_view` need not ask torch again."""

    def __init__(self, device_index: int, ptr: int):
        self.stream = (device_index, ptr)

    def __enter__(self):
        if not hasattr(_entered, "torch_streams"):
            _entered.torch_streams = []
        _entered.torch_streams.append(self.stream)

    def __exit__(self, *exc):
        _entered.torch_streams.pop()


def _torch_stream_is_current(device: Device, backend) -> bool:
    """Whether torch's current stream on `device` is CuPy's current one: known without
    asking torch where the innermost `running_on` made it so."""
    current = backend.current_stream(device)
    streams = getattr(_entered, "torch_streams", None)
    if streams and streams[-1] == (device.index, current):
        return True
    import torch
    return int(torch.cuda.current_stream(device.index).cuda_stream) == current


def running_like(x):
    """`running_on` the device and stream of a call's first data argument `x`
    (nothing, when `x` is no array: the argument checks name it)."""
    try:
        device = device_of(x)
        source = stream_source(x) if device.kind != "cpu" else CUPY_STREAM
    except Exception:   # not an array, or one on no device kvcupy knows: as_array says which
        return contextlib.nullcontext()
    return running_on(device, source)


def synchronize(device: Device) -> None:
    """Wait for the work kvcupy queued on `device` (its backend's current stream)."""
    backend = _stream_backend(device)
    if backend is not None:
        backend.synchronize(device)


# --- results back to the caller --------------------------------------------

def like(result: Array, reference):
    """`result` in the framework of `reference`, zero-copy where DLPack allows.
    On a GPU, call it inside the call's `running_on`: the consumer's stream is
    then CuPy's current one and the handover needs no event."""
    framework = framework_of(reference)
    data = result.data
    if framework == "jax":
        return to_jax(result, reference)
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
    return data


def to_jax(result: Array, reference):
    """A JAX array over `result`'s memory, for a call whose first data argument was
    `reference`: bfloat16 / float8 exported with their own DLPack codes (no bitcast,
    no copy). XLA takes host memory without a copy only when it is 64-byte
    aligned; otherwise JAX copies it."""
    import jax
    data = result.data
    if result.dtype in _TAGGED_CODES:
        bits = data.view(np.uint16 if result.dtype.itemsize == 2 else np.uint8)
        data = _Tagged(bits, result.dtype)
    if result.device.kind != "cpu" and stream_source(reference).stream() is None:
        # JAX will take the result as ready at once: let kvcupy's launches finish first.
        synchronize(result.device)
    return jax.dlpack.from_dlpack(data)


def _host_like(data: np.ndarray, framework: str):
    if framework == "torch":
        import torch
        if data.dtype == BFLOAT16:
            return torch.from_dlpack(data.view(np.int16)).view(torch.bfloat16)
        if data.dtype == FP8_DTYPE:
            return torch.from_dlpack(data.view(np.uint8)).view(torch.float8_e4m3fn)
        return torch.from_dlpack(data)
    return data
