"""Backends: one protocol every backend implements, and one registry of them.

A backend serves one kind of device ("cpu", "cuda", "rocm"). `ops.py`
validates a call, finds the backend by where the call's arrays live
(`for_device`), and hands it arguments that are already checked: `Array`s
of its own array type (interop), a `KVCache` whose tensors it can read, a
`BatchPlan` / `SlotMapping` whose host contents were checked once. A backend
writes results into the `out` it is given. Its writes, rotations and attention
calls may return the launches they made, for `kvcupy.replay` to repeat with other data
pointers (an object with `replay(stream, pointers)`), or None.

Backend modules are imported lazily: `kvcupy.backends.cuda` imports CuPy,
which a CPU-only machine lacks, so the registry records module paths and
asks each module's `availability()` only when asked.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

# name -> (module path, device kind). `auto` picks the first usable of AUTO_ORDER.
_REGISTRY: dict[str, tuple[Any, str]] = {
    "cpu": ("kvcupy.backends.cpu", "cpu"),
    "cuda": ("kvcupy.backends.cuda", "cuda"),
    "rocm": ("kvcupy.backends.rocm", "rocm"),
}
AUTO_ORDER = ("cuda", "rocm", "cpu")
# Device nodes the kernel drivers create: NVIDIA's driver and AMD's ROCm (KFD) driver.
GPU_DEVICE_NODES = {"cuda": "/dev/nvidiactl", "rocm": "/dev/kfd"}
GPU_VENDORS = {"cuda": "NVIDIA", "rocm": "AMD (ROCm)"}


class Backend(Protocol):
    """What every backend provides. Arrays are interop.Array (data in the
    backend's array type); caches are KVCache views of the backend's arrays."""

    name: str
    device_kind: str

    def availability(self) -> tuple[bool, str]:
        """(usable here, what runs it or every reason it cannot run)."""

    def import_dlpack(self, x) -> Any:
        """The backend's array viewing a DLPack producer's memory on its device."""

    def dlpack_stream(self, device) -> int | None:
        """The stream a producer should order its work on before handing memory over
        (DLPack's `stream` argument): the stream this backend will launch on."""

    def device_context(self, device) -> Any:
        """A context manager making `device` current for the backend's launches and
        allocations (nullcontext where there is nothing to make current)."""

    def stream_context(self, device, stream: int) -> Any:
        """A context manager making `stream` (a handle of another framework's stream on
        `device`, current already) the one the backend launches on."""

    def synchronize(self, device) -> None:
        """Wait for the work the backend queued on `device` (its current stream)."""

    def zeros(self, shape: tuple, dtype, device) -> Any:
        """A zero-filled array on `device` (dtype: NumPy dtype, bfloat16/fp8 as bits)."""

    def empty(self, shape: tuple, dtype, device) -> Any:
        """An uninitialised array on `device`, as zeros."""

    def rotate(self, x, plan, inverse: bool, out) -> Any:
        """out = plan's rotation (or its inverse) of x's last axis, in x's dtype; the
        launches made, replayable with (x, out) pointers, or None."""

    def reshape_and_cache(self, key, value, cache, slots) -> Any:
        """Rotate, quantize and write key/value [T, Hk, d] at slots.device_slots;
        the launches made, replayable with (key, value) pointers, or None."""

    def plan_attention(self, batch, cache, num_query_heads: int, num_query_tokens: int) -> Any:
        """The backend's own plan for one batch (work items, split-KV sizes), built
        once per BatchPlan and kept on it."""

    def paged_attention(self, query, cache, batch, plan, *, softmax_scale: float,
                        sliding_window: int | None, softcap: float, sinks, out) -> Any:
        """out[T, Hq, d] = attention of query over the cache, FORMAT's semantics; the
        launches made, replayable with (query, out) pointers, or None."""

    def copy_blocks(self, caches: Sequence, pairs) -> None:
        """For every cache, copy block pairs[i, 0] onto block pairs[i, 1] (all tensors)."""

    def upload(self, array, device) -> Any:
        """A host (NumPy) index array on `device`, as the backend's array."""

    def upload_into(self, target, array) -> None:
        """A host (NumPy) array into the existing device array `target`, in place."""


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here; the message says why."""


@dataclass(frozen=True)
class BackendStatus:
    name: str
    device_kind: str
    usable: bool
    detail: str   # what runs it, or every reason it cannot run


_loaded: dict[str, Any] = {}
# Whether a backend can run does not change within a process: asked once (a
# GPU backend's answer costs a driver query), then served from here.
_statuses: dict[str, "BackendStatus"] = {}
_serving: dict[str, Any] = {}   # device kind -> its usable backend, once found


def register(name: str, backend, device_kind: str) -> None:
    """Add (or replace) a backend: a module path or an object with the protocol.
    The last one registered for a device kind serves that kind."""
    _REGISTRY[name] = (backend, device_kind)
    _loaded.pop(name, None)
    _statuses.pop(name, None)
    _serving.clear()


def unregister(name: str) -> None:
    _REGISTRY.pop(name)
    _loaded.pop(name, None)
    _statuses.pop(name, None)
    _serving.clear()


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _machine_gaps(device_kind: str) -> list[str]:
    """What this machine lacks for a GPU backend, whatever kvcupy ships."""
    gaps = []
    if importlib.util.find_spec("cupy") is None:
        gaps.append("CuPy is not installed")
    node = GPU_DEVICE_NODES.get(device_kind)
    if node and not os.path.exists(node):
        gaps.append(f"no {GPU_VENDORS[device_kind]} GPU driver ({node} is missing)")
    return gaps


def _load(name: str):
    """The backend object, or BackendUnavailable with the reason it is not there."""
    if name not in _REGISTRY:
        raise ValueError(f"backend={name!r} is not a backend; expected one of {names()}")
    if name in _loaded:
        return _loaded[name]
    target, device_kind = _REGISTRY[name]
    if not isinstance(target, str):
        _loaded[name] = target
        return target
    if target not in sys.modules and importlib.util.find_spec(target) is None:
        reasons = ["not in this build of kvcupy"] + _machine_gaps(device_kind)
        raise BackendUnavailable("; ".join(reasons))
    try:
        module = importlib.import_module(target)
    except ImportError as error:
        reasons = _machine_gaps(device_kind) or [f"importing it failed: {error}"]
        raise BackendUnavailable("; ".join(reasons)) from None
    _loaded[name] = module
    return module


def status(name: str) -> BackendStatus:
    if name in _statuses:
        return _statuses[name]
    device_kind = _REGISTRY[name][1] if name in _REGISTRY else "?"
    try:
        backend = _load(name)
    except BackendUnavailable as error:
        found = BackendStatus(name, device_kind, False, str(error))
    else:
        usable, detail = backend.availability()
        found = BackendStatus(name, device_kind, bool(usable), detail)
    if name in _REGISTRY:
        _statuses[name] = found
    return found


def list_backends() -> list[BackendStatus]:
    """Every registered backend, whether it can run here, and why (not)."""
    return [status(name) for name in names()]


def resolve(requested: str = "auto") -> str:
    """The backend to run on: `requested`, or for "auto" the first usable of AUTO_ORDER."""
    if requested == "auto":
        for name in AUTO_ORDER:
            if name in _REGISTRY and status(name).usable:
                return name
        raise BackendUnavailable("no kvcupy backend is usable here")
    found = status(requested)
    if not found.usable:
        raise BackendUnavailable(f"backend {requested!r} is not usable here: {found.detail}")
    return requested


def get(name: str):
    """The usable backend `name`, or BackendUnavailable saying why not."""
    return _load(resolve(name))


def for_device(device, argument: str = "the arrays"):
    """The backend serving `device` (an interop.Device), or a ValueError that names
    the argument found there and says why its backend cannot run."""
    if device.kind in _serving:
        return _serving[device.kind]
    serving = [name for name, (_, kind) in _REGISTRY.items() if kind == device.kind]
    if not serving:
        raise ValueError(f"{argument} is on {device}; no kvcupy backend serves {device.kind} devices")
    name = serving[-1]
    found = status(name)
    if not found.usable:
        raise ValueError(f"{argument} is on {device}, but the {name.upper()} backend is "
                         f"unavailable here: {found.detail}")
    if status is _status:   # not replaced (tests replace it to fake a machine)
        _serving[device.kind] = _load(name)
    return _load(name)


_status = status
