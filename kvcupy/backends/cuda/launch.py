"""Kernel launches through the driver's `cuLaunchKernelEx` (ctypes, libcuda: no
new dependency), the parameters packed into one buffer, for two reasons CuPy's
`Function.__call__` does not serve:

- **Programmatic dependents** (sm_90 and newer): a kernel whose blocks may start
  while the kernel ahead of it in the stream is still running. CuPy takes no
  launch attributes; these launches set
  CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
- **Host time** for kernels of many parameters: CuPy converts each argument on
  its own; packed in one buffer, a launch with as many parameters as the
  attention kernel's costs the host about half as much (tools/host_primitives.py).

A kernel launched as a dependent must execute `griddepcontrol.wait`
(attention.cuh, `wait_for_prerequisites`) before it reads anything the kernel
ahead of it writes; the kernel ahead lets it start early with
`griddepcontrol.launch_dependents` (`allow_dependent_launch`). Without that
attribute both instructions are no-ops, so one build serves both kinds of
launch. The attention and merge kernels let their dependents in only after
their own wait: let in at their start, the next call's attention grid and its
merge would both wait at once, their blocks holding slots the running grid needs.

What a dependent launch saves: the gap between the last block of one kernel
and the first of the next, a few microseconds a call, which matters beside a
short decode step.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

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


def launch_attribute(attribute_id: int, payload: bytes) -> LaunchAttribute:
    """A CUlaunchAttribute whose value union starts with `payload`, copied byte for
    byte: assigned to the char array, bytes stop at the first zero byte (a cluster
    dimension (4, 1, 1) would reach the driver as (4, 0, 0))."""
    attribute = LaunchAttribute()
    attribute.id = attribute_id
    ctypes.memmove(ctypes.addressof(attribute) + LaunchAttribute.value.offset, payload, len(payload))
    return attribute


# programmaticStreamSerializationAllowed: the union's leading int.
_PROGRAMMATIC = launch_attribute(PROGRAMMATIC_STREAM_SERIALIZATION, (1).to_bytes(4, "little"))


_NO_ATTRIBUTES = ctypes.POINTER(LaunchAttribute)()


@functools.cache
def _driver():
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p]
    driver.cuLaunchKernelEx.restype = ctypes.c_int
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return driver


# Kernel arguments in one buffer laid out as the kernel's parameters (the
# driver's CU_LAUNCH_PARAM_BUFFER_POINTER form of `extra`): each at its natural
# alignment. A signature is a string of codes, one a parameter: "P" a pointer
# (a device array, or an integer address such as np.uintp(0) for null), "i"
# int32, "q" int64, "I" uint32, "Q" uint64, "f" float32, "d" float64. One
# struct.pack of the whole buffer costs the host less than a ctypes object and
# pointer a parameter (tools/host_primitives.py).
_SIZES = {"P": 8, "i": 4, "q": 8, "I": 4, "Q": 8, "f": 4, "d": 8}
_SCALAR_TYPES = {"P": np.uintp, "i": np.int32, "q": np.int64, "I": np.uint32, "Q": np.uint64, "f": np.float32,
                 "d": np.float64}
_BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0   # CU_LAUNCH_PARAM_* (cuda.h)


@functools.cache
def parameter_layout(signature: str) -> struct.Struct:
    """The packed layout of kernel parameters `signature` (see above)."""
    codes, offset = ["<"], 0
    for code in signature:
        size = _SIZES.get(code)
        if size is None:
            raise ValueError(f"signature {signature!r}: no parameter code {code!r}")
        padding = -offset % size
        codes.append("x" * padding + ("Q" if code == "P" else code))
        offset += padding + size
    return struct.Struct("".join(codes))


@functools.cache
def _pointer_positions(signature: str) -> tuple:
    return tuple(index for index, code in enumerate(signature) if code == "P")


def _address(value) -> int:
    """A pointer parameter's value: a device array's address, or an integer address."""
    pointer = getattr(getattr(value, "data", None), "ptr", None)   # a NumPy integer's data: a memoryview
    if pointer is not None:
        return pointer
    if isinstance(value, (int, np.integer)):
        return int(value)
    raise TypeError(f"kernel argument {type(value).__name__} is neither a device array nor an address")


class ParameterStruct:
    """A kernel's parameters as one named field list: (name, code) pairs in order,
    codes as a signature's; packed as that signature is (each field at its natural
    alignment, which is also a C struct's layout of the same fields)."""

    def __init__(self, fields: tuple):
        self.names = tuple(name for name, _ in fields)
        self.signature = "".join(code for _, code in fields)
        self._layout = parameter_layout(self.signature)
        self.size = self._layout.size   # the parameter bytes: no tail padding (the driver takes exactly these)
        self._index = {name: index for index, name in enumerate(self.names)}
        if len(self._index) != len(self.names):
            raise ValueError("a field name repeats")
        self._zeros = tuple(0.0 if code in "fd" else 0 for code in self.signature)
        self._pointers = frozenset(index for index, code in enumerate(self.signature) if code == "P")
        # Each field's byte offset in the parameter buffer.
        self.offsets = dict(zip(self.names, parameter_offsets(self.signature)))

    def pack(self, values: dict) -> bytes:
        """The parameter bytes: `values` by field name (device arrays or addresses for
        pointers), every other field zero."""
        fields = list(self._zeros)
        index_of, pointers = self._index, self._pointers
        for name, value in values.items():
            index = index_of.get(name)
            if index is None:
                raise KeyError(f"the parameter struct has no field {name!r}")
            if index in pointers:
                try:   # a device array (the common case, first): its address
                    value = value.data.ptr
                except AttributeError:
                    value = _address(value)
            fields[index] = value
        return self._layout.pack(*fields)

    def arguments(self, values: dict) -> tuple:
        """The fields in order as a kernel call's arguments (CuPy's `Function.__call__`,
        which HIP launches take): `values` by name, pointers as given (device arrays or
        addresses), scalars as NumPy scalars of the field's type, every other field zero."""
        fields = [_SCALAR_TYPES[code](0) for code in self.signature]
        for name, value in values.items():
            index = self._index.get(name)
            if index is None:
                raise KeyError(f"the parameter struct has no field {name!r}")
            code = self.signature[index]
            fields[index] = (value if hasattr(value, "data") else np.uintp(value)) if code == "P" else \
                _SCALAR_TYPES[code](value)
        return tuple(fields)


def pack_parameters(signature: str, args: tuple) -> bytes:
    """`args` packed as the kernel's parameter buffer."""
    if len(args) != len(signature):
        raise ValueError(f"signature {signature!r} takes {len(signature)} arguments, not {len(args)}")
    layout = parameter_layout(signature)
    values = list(args)
    for index in _pointer_positions(signature):
        values[index] = _address(values[index])
    return layout.pack(*values)


@functools.lru_cache(maxsize=256)
def launch_config(grid: tuple, block: tuple, shared_bytes: int, stream: int, dependent: bool) -> LaunchConfig:
    """The CUlaunchConfig of a launch, as a programmatic dependent or plain (cached:
    a call's grid, block and stream repeat from layer to layer)."""
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    attributes = (ctypes.pointer(_PROGRAMMATIC), 1) if dependent else (_NO_ATTRIBUTES, 0)
    return LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, stream,
                        *attributes)


def function_handle(function) -> int:
    """The CUfunction of `function` (a cupy.RawKernel, as jit.get_function gives,
    or a cupy.cuda.Function) on the current device; callers keep it (Plan.handles)
    rather than ask the RawKernel again at every launch."""
    return getattr(function, "kernel", function).ptr


def launch(handle: int, grid: tuple, block: tuple, signature: str, args: tuple, *, stream: int,
           shared_bytes: int = 0, dependent: bool = False) -> None:
    """Launches kernel `handle` (function_handle) with `args` of parameter
    `signature` on `stream` (a handle); dependent: as a programmatic dependent of
    the kernel queued before it. Dynamic shared memory above 48 KB needs the
    function's attribute set first (a RawKernel's max_dynamic_shared_size_bytes)."""
    PackedLaunch(handle, grid, block, pack_parameters(signature, args), shared_bytes=shared_bytes,
                 dependent=dependent)(stream)


def signature_of(args: tuple) -> str:
    """The parameter signature of a CuPy-style argument tuple: "P" for a device array,
    the code of each NumPy scalar's type otherwise (np.uint64(0) as a null pointer
    packs as "Q", the same eight bytes)."""
    codes = []
    for arg in args:
        if getattr(getattr(arg, "data", None), "ptr", None) is not None:   # a device array
            codes.append("P")
            continue
        code = next((c for c, kind in _SCALAR_TYPES.items() if type(arg) is kind and c != "P"), None)
        if code is None:
            raise TypeError(f"kernel argument {type(arg).__name__} is neither a device array nor a typed NumPy scalar")
        codes.append(code)
    return "".join(codes)


def parameter_offsets(signature: str) -> tuple:
    """Each parameter's byte offset in the packed buffer of `signature`."""
    offsets, offset = [], 0
    for code in signature:
        size = _SIZES[code]
        offset += -offset % size
        offsets.append(offset)
        offset += size
    return tuple(offsets)


def pointer_patches(offsets, values, arrays: tuple) -> tuple:
    """(byte offset, role) of each parameter whose value is arrays[role] itself:
    `offsets` and `values` by parameter (dicts by name, or sequences by position)."""
    keys = values.keys() if isinstance(values, dict) else range(len(values))
    return tuple((offsets[key], role) for key in keys for role, array in enumerate(arrays)
                 if array is not None and values[key] is array)


class PackedLaunch:
    """One kernel launch whose parameter buffer is packed once. Launched again, it
    patches only the pointer fields named in `patches` ((byte offset, index into the
    call's `pointers`) pairs: the caller's query and out, say) and takes the call's
    stream: what a repeated call costs the host is one driver call.

    The driver copies the parameters during the call; a lock keeps two threads from
    patching one buffer at once."""

    __slots__ = ("handle", "grid", "block", "shared_bytes", "dependent", "patches", "_buffer", "_size",
                 "_extra", "_configs", "_lock")

    def __init__(self, handle: int, grid: tuple, block: tuple, packed: bytes, *, shared_bytes: int = 0,
                 dependent: bool = False, patches: tuple = ()):
        self.handle, self.shared_bytes, self.dependent = handle, shared_bytes, dependent
        self.grid, self.block = tuple(grid), tuple(block)
        self.patches = tuple(patches)
        self._buffer = ctypes.create_string_buffer(packed, len(packed))
        self._size = ctypes.c_size_t(len(packed))
        self._extra = (ctypes.c_void_p * 5)(_BUFFER_POINTER, ctypes.addressof(self._buffer), _BUFFER_SIZE,
                                            ctypes.addressof(self._size), _END)
        self._configs = {}
        self._lock = threading.Lock()

    @classmethod
    def from_args(cls, handle: int, grid: tuple, block: tuple, args: tuple, *, shared_bytes: int = 0,
                  dependent: bool = False, replayed: tuple = ()) -> PackedLaunch:
        """A launch of CuPy-style `args` (signature_of), patched at replay where an
        argument is replayed[role] itself (pointer_patches)."""
        signature = signature_of(args)
        return cls(handle, grid, block, pack_parameters(signature, args), shared_bytes=shared_bytes,
                   dependent=dependent, patches=pointer_patches(parameter_offsets(signature), args, replayed))

    def __call__(self, stream: int, pointers: tuple | None = None) -> None:
        """Launches on `stream`; `pointers`: the replayed call's, for the patched fields
        (None: as packed)."""
        config = self._configs.get(stream)
        if config is None:
            if len(self._configs) > 16:   # a caller cycling through streams
                self._configs.clear()
            config = self._configs[stream] = launch_config(self.grid, self.block, self.shared_bytes, stream,
                                                           self.dependent)
        with self._lock:
            if pointers is not None:
                for offset, role in self.patches:
                    _POINTER.pack_into(self._buffer, offset, pointers[role])
            result = _driver().cuLaunchKernelEx(ctypes.byref(config), self.handle, None, self._extra)
        if result != 0:
            _raise_launch_error(result)


_POINTER = struct.Struct("<Q")


def _raise_launch_error(result: int) -> None:
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({result})")


class RecordedCall:
    """The launches a call made, in order, replayable for a later call that differs
    only in its data pointers (`kvcupy.replay`): `replay(stream, pointers)` patches
    each launch's pointer fields from `pointers` and launches it on `stream`."""

    __slots__ = ("launches",)

    def __init__(self, launches):
        self.launches = tuple(launches)

    def replay(self, stream: int, pointers: tuple) -> None:
        for packed in self.launches:
            packed(stream, pointers)
