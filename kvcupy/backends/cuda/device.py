"""Device helpers the CUDA launchers share: the compiled-function memo, the
persistent grid, alignment and stride arithmetic, logical dtypes of CuPy
arrays (bfloat16 held as uint16 bits) and rotation plans as the kernels read
them on the device.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import numpy as np

from ... import jit
from ...interop import BFLOAT16
from ...rotation import RotationPlan

if TYPE_CHECKING:
    import cupy


# --- shared launch helpers ------------------------------------------------

def _alignment(*byte_values: int, cap: int = 16) -> int:
    """The largest power of two (<= cap) dividing every value: pointers, byte strides, sizes."""
    alignment = cap
    for value in byte_values:
        value = abs(int(value))
        if value:
            alignment = min(alignment, value & -value)
    return alignment


def _element_strides(array: cupy.ndarray, axes: int) -> list[np.int64]:
    return [np.int64(array.strides[axis] // array.itemsize) for axis in range(axes)]


def _contiguous_rows(array: cupy.ndarray) -> cupy.ndarray:
    """The array with a contiguous last axis (a copy only if it has none)."""
    import cupy
    if array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        return cupy.ascontiguousarray(array)
    return array


def _logical_dtype(array: cupy.ndarray, given) -> np.dtype:
    """The model dtype of a CuPy array: `given`, else its dtype, uint16 read as bfloat16 bits."""
    if given is not None:
        return np.dtype(given)
    return BFLOAT16 if array.dtype == np.uint16 else np.dtype(array.dtype)


def _function(device_index: int, entry: str, function: str, defines: tuple):
    return _memoised_function(device_index, entry, function, defines, jit.EXTRA_OPTIONS,
                              os.environ.get(jit.SOURCE_DIR_ENV))


@functools.lru_cache(maxsize=None)
def _memoised_function(device_index: int, entry: str, function: str, defines: tuple, options: tuple,
                       source_override: str | None):
    """`options` (jit.EXTRA_OPTIONS) and `source_override` ($KVCUPY_KERNEL_DIR), which
    get_function reads, only key the memo: a tool that changes them gets the other build."""
    import cupy
    with cupy.cuda.Device(device_index):
        return jit.get_function(entry, function, dict(defines))


@functools.lru_cache(maxsize=None)
def _resident_blocks(device_index: int, kernel, threads: int) -> int | None:
    """Blocks of `threads` of `kernel` that run at once on the whole device: the
    grid of a persistent kernel (write.cu, rotate.cu walk their items by its
    stride). None when the driver cannot say: any grid is correct, a full one
    (one item per group) only gives up the prefetching."""
    import cupy
    function = getattr(kernel, "kernel", kernel)   # a cupy.RawKernel wraps the driver function
    try:
        with cupy.cuda.Device(device_index):
            processors = cupy.cuda.Device(device_index).attributes["MultiProcessorCount"]
            per_processor = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, threads, 0)
    except Exception:
        return None
    return max(1, processors * per_processor)


def _persistent_grid(device_index: int, kernel, threads: int, items: int, items_per_block: int) -> int:
    blocks = -(-items // items_per_block)
    resident = _resident_blocks(device_index, kernel, threads)
    return max(1, blocks if resident is None else min(blocks, resident))


# --- rotation plans on the device -----------------------------------------

SIGN_WORDS, MIX_WORDS = 8, 32   # rotation.cuh: kSignWords, kMixWords


def rotation_words(plan: RotationPlan | None) -> np.ndarray:
    """uint32 words rotation.cuh reads: the sign bits (bit i set: s[i] = -1), then the
    kron mix one word per row (bit a of word r: M[r][a] = -1), forward, then transposed."""
    words = np.zeros(SIGN_WORDS + 2 * MIX_WORDS, np.uint32)
    if plan is None or plan.is_identity:
        return words
    negative = np.zeros(32 * SIGN_WORDS, np.uint8)
    negative[:plan.head_size] = np.asarray(plan.signs) < 0
    words[:SIGN_WORDS] = np.packbits(negative, bitorder="little").view("<u4")
    if plan.kind == "kron":
        mix = plan.mix_matrix() < 0
        weights = np.uint32(1) << np.arange(plan.mix_size, dtype=np.uint32)
        words[SIGN_WORDS:SIGN_WORDS + plan.mix_size] = (mix * weights).sum(axis=1, dtype=np.uint32)
        words[SIGN_WORDS + MIX_WORDS:SIGN_WORDS + MIX_WORDS + plan.mix_size] = (mix.T * weights).sum(
            axis=1, dtype=np.uint32)
    return words


_device_rotations: dict = {}


def _rotation_on(plan: RotationPlan | None, device_index: int) -> cupy.ndarray:
    """A plan's words on one device, uploaded once per (plan, device)."""
    import cupy
    key = (plan, device_index)
    found = _device_rotations.get(key)
    if found is None:
        with cupy.cuda.Device(device_index):
            found = _device_rotations.setdefault(key, cupy.asarray(rotation_words(plan)))
    return found



def _cache_model_dtype(cache) -> np.dtype:
    """The dtype an auto cache stores (CuPy holds bfloat16 as uint16 bits)."""
    return BFLOAT16 if cache.storage_dtype == np.uint16 else np.dtype(cache.storage_dtype)
