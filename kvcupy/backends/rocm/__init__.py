"""ROCm backend: the protocol of `kvcupy.backends` on AMD Instinct GPUs (gfx90a,
gfx942) through CuPy for ROCm, launching kernels_hip/ compiled by hipRTC (jit.py).

It shares what is the same on HIP with the CUDA backend rather than copying it:
CuPy arrays and streams (cuda.arrays), launch arithmetic and rotation words
(cuda.device), and each kernel's specialisation and arguments (cuda.write), so
a HIP kernel gets the defines and parameters of its CUDA twin.

    arrays.py     availability (CuPy's HIP build, the device's gfx arch); arrays and streams
    write.py      the write, rotate and copy-on-write launchers of the kernels_hip/ entries
    attention.py  paged attention: the MFMA kernel's plan and launches, then the merge

CuPy is imported inside the functions that use it: this package imports on a
machine without CuPy, where `availability()` says what is missing.
"""

from .arrays import (availability, current_stream, device_context, device_kind, device_view, dlpack_stream, empty,
                     import_dlpack, name, stream_context, synchronize, upload, upload_into, zeros)
from .attention import paged_attention, plan_attention
from .write import copy_blocks, reshape_and_cache, rotate

__all__ = ["availability", "copy_blocks", "current_stream", "device_context", "device_kind", "device_view",
           "dlpack_stream", "empty", "import_dlpack", "name", "paged_attention", "plan_attention", "reshape_and_cache",
           "rotate", "stream_context", "synchronize", "upload", "upload_into", "zeros"]
