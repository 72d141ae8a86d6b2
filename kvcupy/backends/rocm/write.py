"""The write, rotate and copy-on-write launchers of the ROCm backend: the kernels of
kernels_hip/write.hip, rotate.hip and copy_blocks.hip, which keep the CUDA entries'
kernel names, parameter lists and -D defines.

So each launch here takes its specialisation (cuda.write's define and layout
functions) and its arguments exactly as the CUDA launcher computes them; only
the compiled function comes from hipRTC (jit.get_hip_function). Arguments
arrive validated (ops.py); launches go to CuPy's current stream on the arrays'
device and nothing here waits for the device.
"""

from __future__ import annotations

import functools
import math
import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from ... import jit
from ...rotation import RotationPlan
from ..cuda.device import (_alignment, _cache_model_dtype, _contiguous_rows, _element_strides, _logical_dtype,
                           _persistent_grid, _rotation_on)
from ..cuda.write import (COPY_THREADS, TENSOR_COPY_FIELDS, _rotate_lane_values, _tensor_copy, _write_tuning,
                          rotate_defines, rotate_threads, vector_layout, write_defines)
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


# --- write path -----------------------------------------------------------

def reshape_and_cache(key, value, cache, slots) -> None:
    """Write key/value (interop.Arrays [T, Hk, d]) at slots (a SlotMapping), one launch."""
    import cupy
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    device = cache.device
    with cupy.cuda.Device(device.index):
        slot_ids = slots.on(arrays, device)
        keys, values = _contiguous_rows(key.data), _contiguous_rows(value.data)
        defines = write_defines(head_size, cache.kv_dtype, _cache_model_dtype(cache), key.dtype, cache.rotation)
        layout = vector_layout(head_size, cache.rotation, _write_tuning(cache.kv_dtype, cache.rotation)[0])
        kernel = _function(device.index, "write", "reshape_and_cache", defines)

        key_cache, value_cache = cache.key_cache, cache.value_cache
        k_scales, v_scales = cache.k_scale_cache, cache.v_scale_cache
        scale_args = ([k_scales, v_scales, *_element_strides(k_scales, 3), *_element_strides(v_scales, 3)]
                      if k_scales is not None else [np.uint64(0), np.uint64(0), *[np.int64(0)] * 6])
        input_align = _alignment(keys.data.ptr, values.data.ptr, *keys.strides[:2], *values.strides[:2])
        cache_align = _alignment(key_cache.data.ptr, value_cache.data.ptr, *key_cache.strides[:3],
                                 *value_cache.strides[:3])
        threads = dict(defines)["KVC_THREADS"]
        grid = _persistent_grid(device.index, kernel, threads, 2 * num_tokens * num_heads, threads // layout.lanes)
        args = (keys, values, *_element_strides(keys, 2), *_element_strides(values, 2),
                slot_ids, np.int32(slot_ids.dtype == np.int64), np.int64(slot_ids.strides[0] // slot_ids.itemsize),
                np.int32(num_tokens), np.int32(num_heads),
                key_cache, value_cache, scale_args[0], scale_args[1],
                *_element_strides(key_cache, 3), *_element_strides(value_cache, 3), *scale_args[2:],
                np.int32(cache.block_size), np.int64(cache.num_slots),
                _rotation_on(cache.rotation, device.index), np.int32(input_align), np.int32(cache_align))
        kernel((grid,), (threads,), args)


# --- rotation -------------------------------------------------------------

def rotate_rows(x: cupy.ndarray, out: cupy.ndarray, plan: RotationPlan | None, *, inverse: bool,
                divisor: float, read_order: cupy.ndarray | None = None,
                write_order: cupy.ndarray | None = None, x_dtype=None, out_dtype=None) -> None:
    """cuda.write.rotate_rows on a ROCm device: the same contract and arguments."""
    import cupy
    num_rows, head_size = x.shape
    if out.shape != x.shape:
        raise ValueError(f"out has shape {out.shape}; expected x's {x.shape}")
    if out.strides[1] != out.itemsize:
        raise ValueError(f"out must have a contiguous last axis (strides {out.strides})")
    if num_rows == 0:
        return
    device_index = x.device.id
    with cupy.cuda.Device(device_index):
        x = _contiguous_rows(x)
        orders = [None if o is None else cupy.ascontiguousarray(cupy.asarray(o, dtype=np.int32))
                  for o in (read_order, write_order)]
        defines = rotate_defines(head_size, plan, _logical_dtype(x, x_dtype), _logical_dtype(out, out_dtype),
                                 any(o is not None for o in orders))
        layout = vector_layout(head_size, plan, _rotate_lane_values(head_size, plan))
        kernel = _function(device_index, "rotate", "rotate_rows", defines)
        divisor = float(divisor)
        # The kernel's Divide modes: keep (0), multiply by the reciprocal where it is a
        # power of two and so exact (1), divide (2).
        exact = divisor != 0 and math.isfinite(divisor) and math.frexp(abs(divisor))[0] == 0.5
        mode = 0 if divisor == 1.0 else 1 if exact else 2
        threads = rotate_threads(layout)
        grid = _persistent_grid(device_index, kernel, threads, num_rows, threads // layout.lanes)
        args = (x, np.int64(x.strides[0] // x.itemsize), out, np.int64(out.strides[0] // out.itemsize),
                np.int64(num_rows), _rotation_on(plan, device_index), np.int32(bool(inverse)),
                np.float64(divisor), np.float64(1.0 / divisor if exact else 0.0), np.int32(mode),
                *(np.uint64(0) if o is None else o for o in orders),
                np.int32(_alignment(x.data.ptr, x.strides[0])), np.int32(_alignment(out.data.ptr, out.strides[0])))
        kernel((grid,), (threads,), args)


def rotate(x, plan: RotationPlan, inverse: bool, out) -> None:
    """out.data = rotation of x.data (interop.Arrays of the same shape and dtype)."""
    if plan.is_identity:
        out.data[...] = x.data
        return
    head_size = plan.head_size
    rotate_rows(x.data.reshape(-1, head_size), out.data.reshape(-1, head_size), plan, inverse=inverse,
                divisor=float(plan.norm) if inverse else 1.0, x_dtype=x.dtype, out_dtype=out.dtype)


# --- copy-on-write --------------------------------------------------------

_MAX_DESCRIPTOR_SETS = 64
_descriptor_sets: OrderedDict = OrderedDict()


def copy_blocks(caches, pairs: np.ndarray) -> None:
    """Block pairs[i, 0] onto pairs[i, 1] in every tensor of every cache: one launch."""
    import cupy
    pairs = np.ascontiguousarray(pairs, np.int64).reshape(-1, 2)
    if not pairs.size:
        return
    tensors = [tensor for cache in caches for tensor in cache.tensors()]
    device_index = caches[0].device.index
    with cupy.cuda.Device(device_index):
        if np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
            # A block both read and written: every source must be read before any
            # write, which a gather gives. Rare; not worth a kernel.
            sources, destinations = cupy.asarray(pairs[:, 0]), cupy.asarray(pairs[:, 1])
            for tensor in tensors:
                tensor[destinations] = tensor[sources]
            return
        records = tuple(_tensor_copy(tensor) for tensor in tensors)
        key = (device_index, records)
        descriptors = _descriptor_sets.get(key)
        if descriptors is None:
            descriptors = cupy.asarray(np.array(records, np.int64).reshape(-1, len(TENSOR_COPY_FIELDS)))
            _descriptor_sets[key] = descriptors
            if len(_descriptor_sets) > _MAX_DESCRIPTOR_SETS:
                _descriptor_sets.popitem(last=False)
        kernel = _function(device_index, "copy_blocks", "copy_blocks", ())
        device_pairs = cupy.asarray(pairs)
        for first in range(0, len(records), 65535):   # the kernel's grid y walks tensors; keep it in range
            part = descriptors[first:first + 65535]
            kernel((len(pairs), len(part)), (COPY_THREADS,), (part, device_pairs, np.int64(caches[0].num_blocks)))
