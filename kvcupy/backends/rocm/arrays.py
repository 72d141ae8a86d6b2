"""The ROCm backend's availability and its arrays.

CuPy's Python API is the same on ROCm (its `cupy.cuda` names bind HIP there),
so allocation, uploads, views, devices and streams are the CUDA backend's own
functions. What differs: whether this CuPy is the ROCm build and the GPU one we
build for, and the stream number DLPack uses for the default stream.

CuPy is imported where it is used, not with this package: a machine without
CuPy imports the backend, and `availability` says what it lacks.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

from ... import backends, jit
from ..cuda.arrays import (current_stream, device_context, device_view, empty, import_dlpack, stream_context,
                           synchronize, upload, upload_into, zeros)

__all__ = ["CUPY_ROCM", "GFX_ARCHS", "availability", "current_stream", "device_context", "device_kind",
           "device_view", "dlpack_stream", "empty", "import_dlpack", "name", "stream_context", "synchronize",
           "upload", "upload_into", "zeros"]

# The backend's name and device kind; batch.py's uploads key on `name` and call `upload`.
name = "rocm"
device_kind = "rocm"

# The gfx archs kvcupy's HIP kernels are written and tested for: MI200 and MI300.
GFX_ARCHS = {"gfx90a": "MI200", "gfx942": "MI300"}
CUPY_ROCM = "cupy-rocm-7-0"
_INSTALL_HINT = f"the rocm backend needs {CUPY_ROCM} (pip install 'kvcupy[rocm]')"


def _hip_version(number: int) -> str:
    """HIP_VERSION 70051831 -> "7.0" (major * 10**7 + minor * 10**5 + patch)."""
    return f"{number // 10_000_000}.{number // 100_000 % 100}"


def _cupy_distribution() -> str:
    """The installed distribution that provides `cupy` (cupy-cuda13x, ...), for a message."""
    try:
        found = importlib.metadata.packages_distributions().get("cupy") or []
    except Exception:   # broken metadata only costs the message its package name
        found = []
    return found[0] if found else "cupy"


def _cupy_gaps() -> list[str]:
    """What CuPy lacks for this backend: not installed, or built for CUDA."""
    if importlib.util.find_spec("cupy") is None:
        return [f"CuPy is not installed; {_INSTALL_HINT}"]
    import cupy
    if not getattr(cupy.cuda.runtime, "is_hip", False):
        return [f"CuPy is the CUDA build ({_cupy_distribution()}); {_INSTALL_HINT}"]
    return []


def _text(value) -> str:
    return value.split(b"\0", 1)[0].decode() if isinstance(value, bytes) else str(value)


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(usable, what runs it or every reason it cannot run). Computed once."""
    gaps = _cupy_gaps()
    node = backends.GPU_DEVICE_NODES[device_kind]
    if not os.path.exists(node):
        gaps.append(f"no {backends.GPU_VENDORS[device_kind]} GPU driver ({node} is missing)")
    if gaps:
        return False, "; ".join(gaps)
    import cupy
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as error:   # no driver, or one older than CuPy's HIP runtime
        return False, f"no usable ROCm device ({type(error).__name__}: {error})"
    if count == 0:
        return False, "no ROCm device"
    try:
        properties = runtime.getDeviceProperties(0)
        gpu = _text(properties["name"])
        arch = jit.gfx_arch(properties["gcnArchName"])
        hip = _hip_version(runtime.runtimeGetVersion())
    except Exception as error:
        return False, f"the ROCm device cannot be queried ({type(error).__name__}: {error})"
    if arch not in GFX_ARCHS:
        built = " and ".join(f"{gfx} ({product})" for gfx, product in GFX_ARCHS.items())
        return False, f"{gpu} is {arch}; kvcupy's HIP kernels are built for {built}"
    try:
        hiprtc = ".".join(str(n) for n in jit.hip_versions()["hiprtc"])
    except Exception as error:
        return False, f"{gpu}: hipRTC is not usable ({type(error).__name__}: {error})"
    try:
        sources = jit.hip_source_dir()
    except FileNotFoundError as error:
        return False, str(error)
    if not sources.is_dir():   # $KVCUPY_HIP_KERNEL_DIR names a folder that is not there
        return False, f"kvcupy's HIP sources are missing: {sources} is not a folder"
    devices = f"{count} x {gpu}" if count > 1 else gpu
    return True, (f"{devices} ({arch}), HIP {hip}, hipRTC {hiprtc}, CuPy {cupy.__version__}; "
                  "MFMA attention verified through an emulation, not yet on AMD hardware")


def dlpack_stream(device) -> int:
    """CuPy's current stream on `device`, as DLPack names it on ROCm: the hipStream_t,
    0 for the default stream (DLPack reserves 1 and 2 on CUDA only)."""
    import cupy
    with cupy.cuda.Device(device.index):
        return cupy.cuda.get_current_stream().ptr
