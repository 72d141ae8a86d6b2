"""`kvcupy info`: versions of kvcupy and what it runs on, and which backends are usable here."""

from __future__ import annotations

import importlib
import importlib.util
import platform
from dataclasses import asdict

import kvcupy

from kvcupy.backends import list_backends as all_backend_status

# Imported to read their versions; CuPy is optional and reported only when importable.
REQUIRED_PACKAGES = ("numpy", "numba", "ml_dtypes", "threadpoolctl")
OPTIONAL_PACKAGES = ("cupy",)


def _optional_version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.import_module(package).__version__
    except Exception as error:   # CuPy raises more than ImportError when its CUDA libraries are missing
        return f"installed, import fails: {error}"


def versions() -> dict[str, str]:
    found = {"kvcupy": kvcupy.__version__, "python": platform.python_version()}
    for package in REQUIRED_PACKAGES:
        found[package] = importlib.import_module(package).__version__
    for package in OPTIONAL_PACKAGES:
        version = _optional_version(package)
        if version is not None:
            found[package] = version
    return found


def compiler() -> dict[str, str]:
    """NVRTC's version and the kernel compile cache (where, how big), when CuPy is here."""
    if importlib.util.find_spec("cupy") is None:
        return {}
    from kvcupy import jit
    found = {"kernel cache": str(jit.cache_dir())}
    if jit.EXTRA_OPTIONS:   # $KVCUPY_NVRTC_OPTIONS: every kernel is built (and keyed) with these
        found["nvrtc extra options"] = " ".join(jit.EXTRA_OPTIONS)
    try:
        found["kernel cache size"] = f"{jit.cache_size_bytes() / 2**20:.1f} MiB"
        found["nvrtc"] = ".".join(map(str, jit.nvrtc_version()))
    except Exception as error:   # no NVRTC library: say so instead of failing `info`
        found["nvrtc"] = f"unavailable: {error}"
    return found


def cpu_kernel_cache() -> dict[str, str]:
    """Where the CPU backend's compiled kernels (Numba) are kept, across runs."""
    from kvcupy.backends import cpu_kernels
    return {"cpu kernel cache": cpu_kernels.CACHE_DIR or
            "none: no writable folder (set KVCUPY_CACHE_DIR); each run compiles the CPU kernels"}


def collect_info() -> dict:
    """Versions (with NVRTC and the compile cache where CuPy is installed), where the CPU
    kernels are cached, and every backend's status; the CUDA backend's detail names the GPU."""
    return {"versions": versions() | cpu_kernel_cache() | compiler(),
            "backends": [asdict(status) for status in all_backend_status()]}
