"""Which kvcupy backends can run here, why the others cannot, and what `--backend` picks.

A backend is usable when kvcupy ships it (a module `kvcupy.backends.<name>`)
and that module's `is_available()` says yes. For the GPU backends the status
also names what this machine lacks (CuPy, a GPU), so that a user sees every
reason at once instead of fixing them one by one.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

BACKENDS = ("cpu", "cuda", "rocm")
# `--backend auto` takes the first usable one: a GPU when there is one.
AUTO_ORDER = ("cuda", "rocm", "cpu")
# Device nodes the kernel drivers create: NVIDIA's driver and AMD's ROCm (KFD) driver.
GPU_DEVICE_NODES = {"cuda": "/dev/nvidiactl", "rocm": "/dev/kfd"}
GPU_VENDORS = {"cuda": "NVIDIA", "rocm": "AMD (ROCm)"}


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here; the message says why."""


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    detail: str   # what runs it, or every reason it cannot run


def _shipped_module(name: str):
    """kvcupy.backends.<name>, or None when this build of kvcupy has no such backend."""
    if importlib.util.find_spec(f"kvcupy.backends.{name}") is None:
        return None
    return importlib.import_module(f"kvcupy.backends.{name}")


def _machine_gaps(name: str) -> list[str]:
    """What this machine lacks for a GPU backend, whatever kvcupy ships."""
    gaps = []
    if importlib.util.find_spec("cupy") is None:
        gaps.append("CuPy is not installed")
    if not os.path.exists(GPU_DEVICE_NODES[name]):
        gaps.append(f"no {GPU_VENDORS[name]} GPU driver ({GPU_DEVICE_NODES[name]} is missing)")
    return gaps


def backend_status(name: str) -> BackendStatus:
    module = _shipped_module(name)
    if module is not None:
        usable, detail = module.is_available()
        return BackendStatus(name, bool(usable), detail)
    reasons = ["not in this build of kvcupy (it ships the CPU backend only)"]
    reasons += _machine_gaps(name) if name in GPU_DEVICE_NODES else []
    return BackendStatus(name, False, "; ".join(reasons))


def all_backend_status() -> list[BackendStatus]:
    return [backend_status(name) for name in BACKENDS]


def resolve_backend(requested: str) -> str:
    """The backend to run on: `requested`, or for "auto" the first usable of AUTO_ORDER."""
    if requested == "auto":
        for name in AUTO_ORDER:
            if backend_status(name).usable:
                return name
        raise BackendUnavailable("no kvcupy backend is usable here")
    status = backend_status(requested)
    if not status.usable:
        raise BackendUnavailable(f"backend {requested!r} is not usable here: {status.detail}")
    return requested
