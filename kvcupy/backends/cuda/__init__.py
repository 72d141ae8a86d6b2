"""CUDA backend: the protocol of `kvcupy.backends`, served by CuPy launches of
the kernels in kernels_cu/ (compiled by jit.py).

The modules below, each importing only those listed before it:

    kernels.py    attention.cuh's codes and constants; Kernel, PrefillKernel (a build's defines)
    tuning.py     Tuning: the planner's tunables, as data
    launch.py     packed and programmatic-dependent launches (driver API via ctypes)
    arrays.py     availability; CuPy arrays, streams and uploads on a device
    device.py     the compiled-function memo, persistent grids, alignments, rotation words
    fragments.py  the prefill kernel's rotation operands (mma fragments)
    write.py      the write, rotate and copy-on-write launchers and their defines
    planner.py    the attention plan: build, tiles, splits (Plan)
    attention.py  the attention launches of a plan
    specs.py      every specialisation the backend can launch (for `kvcupy check`)

CuPy is imported inside the functions that use it: this package imports on a
machine without CuPy, where `availability()` says what is missing.
"""

from .arrays import (availability, current_stream, device_context, device_kind, device_view, dlpack_stream, empty,
                     import_dlpack, name, stream_context, synchronize, upload, upload_into, zeros)
from .attention import paged_attention
from .planner import plan_attention
from .specs import specialisations
from .write import copy_blocks, reshape_and_cache, rotate

__all__ = ["availability", "copy_blocks", "current_stream", "device_context", "device_kind", "device_view",
           "dlpack_stream", "empty", "import_dlpack", "name", "paged_attention", "plan_attention", "reshape_and_cache",
           "rotate", "specialisations", "stream_context", "synchronize", "upload", "upload_into", "zeros"]
