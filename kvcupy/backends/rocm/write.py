"""The write, rotate and copy-on-write launchers of the ROCm backend: the kernels of
kernels_hip/write.hip, rotate.hip and copy_blocks.hip, which keep the CUDA entries'
kernel names, parameter lists and -D defines.

So the launchers are the CUDA backend's (cuda.write), given where to take the
compiled function from (hipRTC: jit.get_hip_function) and this backend's
uploads; the specialisations and arguments are theirs to the letter. Arguments
arrive validated (ops.py); launches go to CuPy's current stream on the arrays'
device and nothing here waits for the device.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import numpy as np

from ... import jit
from ...rotation import RotationPlan
from ..cuda import write as cuda_write
from . import arrays

if TYPE_CHECKING:
    import cupy


def _function(device_index: int, entry: str, function: str, defines: tuple):
    return _memoised_function(device_index, entry, function, defines, jit.HIP_EXTRA_OPTIONS,
                              os.environ.get(jit.HIP_SOURCE_DIR_ENV), os.environ.get(jit.SOURCE_DIR_ENV))


@functools.lru_cache(maxsize=None)
def _memoised_function(device_index: int, entry: str, function: str, defines: tuple, options: tuple,
                       hip_override: str | None, cuda_override: str | None):
    """The options and the two source overrides, which get_hip_function reads, only key
    the memo: a tool that changes them gets the other build."""
    import cupy
    with cupy.cuda.Device(device_index):
        return jit.get_hip_function(entry, function, dict(defines))


# --- the CUDA launchers, with the HIP builds -------------------------------
# (`_function` looked up at each call: tests record launches by replacing it.)

def reshape_and_cache(key, value, cache, slots) -> None:
    """Write key/value (interop.Arrays [T, Hk, d]) at slots (a SlotMapping), one launch."""
    cuda_write.reshape_and_cache(key, value, cache, slots, function=_function, uploads=arrays)


def rotate_rows(x: cupy.ndarray, out: cupy.ndarray, plan: RotationPlan | None, **options) -> None:
    """cuda.write.rotate_rows on a ROCm device: the same contract and arguments."""
    cuda_write.rotate_rows(x, out, plan, function=_function, **options)


def rotate(x, plan: RotationPlan, inverse: bool, out) -> None:
    """out.data = rotation of x.data (interop.Arrays of the same shape and dtype)."""
    cuda_write.rotate(x, plan, inverse, out, function=_function)   # launched through CuPy: nothing to replay


def copy_blocks(caches, pairs: np.ndarray) -> None:
    """Block pairs[i, 0] onto pairs[i, 1] in every tensor of every cache: one launch."""
    cuda_write.copy_blocks(caches, pairs, function=_function)
