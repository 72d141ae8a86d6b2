"""The write, rotate and copy-on-write launchers (kernels_cu/write.cu, rotate.cu,
copy_blocks.cu) and the specialisations they ask jit for.

Arguments arrive validated (ops.py) as interop.Arrays of CuPy data: bfloat16
as uint16 bits and fp8 as uint8 bits, the logical dtype beside them. Each
launcher picks its kernel's specialisation (compile-time -D constants, named
from formats.CPP_TYPES), proves alignments, and passes pointers, element
strides and explicitly typed scalars, on CuPy's current stream on the device
the arrays live on; nothing here waits for the device. Index arrays already on
the device are never read back (the kernels guard every id instead).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ... import formats
from ...formats import CPP_TYPES
from ...rotation import RotationPlan, largest_pow2_divisor
from . import arrays, launch
from .device import (_alignment, _cache_model_dtype, _contiguous_rows, _element_strides, _function,
                     _logical_dtype, _persistent_grid, _rotation_on)

if TYPE_CHECKING:
    import cupy


# --- vector layout --------------------------------------------------------

# Tuning knobs, each a -D constant (so part of a specialisation's key): the
# values one lane holds (rotation.cuh, RotationLayout: more means fewer
# shuffle stages but more registers), the write kernel's block size, and the
# kernels' __launch_bounds__ minimum blocks per SM. Quantized writes are bound
# by shuffles (the rotation's float64 transform, the per-vector absmax) and take
# the most values a lane; an auto write without rotation, a conversion and a
# copy, takes few. The kron mix's extra registers spill at 32 (write) and 64
# (rotate) values a lane: it keeps the smaller counts, as do rotations of long
# heads. Minimum blocks: 4 keep the write kernel within 128 registers without
# spills (5 spill); rotate takes 4 from d = 128 up, and 3 below, where its
# sign masks (rotate.cu, Signs) need more registers than 4 blocks leave.
WRITE_LANE_VALUES = 32           # quantized caches
WRITE_MIN_BLOCKS = 4
WRITE_KRON_LANE_VALUES = 16
WRITE_KRON_MIN_BLOCKS = 4
WRITE_PLAIN_LANE_VALUES = 8      # auto caches without rotation: a conversion and a copy
WRITE_PLAIN_MIN_BLOCKS = 4
ROTATE_LANE_VALUES = 64          # blockdiag up to ROTATE_WIDE_MAX_HEAD
ROTATE_WIDE_MAX_HEAD = 160
ROTATE_NARROW_LANE_VALUES = 32
WRITE_THREADS = 128
ROTATE_MIN_BLOCKS = 3
ROTATE_LONG_MIN_BLOCKS = 4       # head sizes from ROTATE_LONG_HEAD up
ROTATE_LONG_HEAD = 128


@dataclass(frozen=True)
class VectorLayout:
    head_size: int
    pow2: int        # POW2: the Sylvester factor (for no rotation: only a layout)
    rows: int        # ROWS = head_size / pow2
    columns: int     # COLUMNS: consecutive columns of each row a lane holds
    rotated: bool
    kron: bool

    @property
    def lanes(self) -> int:
        return self.pow2 // self.columns

    @property
    def values(self) -> int:
        return self.rows * self.columns

    @property
    def defines(self) -> dict:
        return {"KVC_HEAD_SIZE": self.head_size, "KVC_POW2": self.pow2, "KVC_ROWS": self.rows,
                "KVC_COLUMNS": self.columns, "KVC_ROTATE": int(self.rotated), "KVC_KRON": int(self.kron)}


@functools.lru_cache(maxsize=None)
def vector_layout(head_size: int, plan: RotationPlan | None, lane_values: int) -> VectorLayout:
    """How a group of lanes holds one vector of `head_size` values under `plan`."""
    if plan is None or plan.is_identity:
        pow2 = largest_pow2_divisor(head_size)
        rows, rotated, kron = head_size // pow2, False, False
    else:
        pow2, rows, rotated, kron = plan.pow2_size, plan.mix_size, True, plan.kind == "kron"
    columns = min(pow2, 32)
    while columns > 1 and rows * columns > lane_values and pow2 // (columns // 2) <= 32:
        columns //= 2
    if columns == 1 and rows * 2 <= lane_values:
        columns = 2   # keep an int4 byte's two values in one lane where the registers allow
    return VectorLayout(head_size, pow2, rows, columns, rotated, kron)


# --- write path -----------------------------------------------------------

def _write_tuning(kv_dtype: str, plan: RotationPlan | None) -> tuple[int, int]:
    """(values a lane holds, minimum blocks per SM) of the write kernel."""
    rotated = plan is not None and not plan.is_identity
    if not rotated and not formats.kv_dtype_info(kv_dtype).quantized:
        return WRITE_PLAIN_LANE_VALUES, WRITE_PLAIN_MIN_BLOCKS
    if rotated and plan.kind == "kron":
        return WRITE_KRON_LANE_VALUES, WRITE_KRON_MIN_BLOCKS
    return WRITE_LANE_VALUES, WRITE_MIN_BLOCKS


def _rotate_lane_values(head_size: int, plan: RotationPlan | None) -> int:
    """Values a lane holds in the rotate kernel for `plan` (see the tuning notes above)."""
    if plan is not None and plan.kind == "kron" or head_size > ROTATE_WIDE_MAX_HEAD:
        return ROTATE_NARROW_LANE_VALUES
    return ROTATE_LANE_VALUES


def write_defines(head_size: int, kv_dtype: str, cache_dtype: np.dtype, input_dtype: np.dtype,
                  plan: RotationPlan | None) -> tuple:
    """The write kernel's specialisation under the current tuning: sorted (define,
    value) pairs. cache_dtype: the model dtype an auto cache stores (ignored for
    quantized caches)."""
    lane_values, min_blocks = _write_tuning(kv_dtype, plan)
    return _write_defines(head_size, kv_dtype, np.dtype(cache_dtype), np.dtype(input_dtype), plan,
                          lane_values, min_blocks, WRITE_THREADS)


@functools.lru_cache(maxsize=None)
def _write_defines(head_size: int, kv_dtype: str, cache_dtype: np.dtype, input_dtype: np.dtype,
                   plan: RotationPlan | None, lane_values: int, min_blocks: int, threads: int) -> tuple:
    layout = vector_layout(head_size, plan, lane_values)
    info = formats.kv_dtype_info(kv_dtype)
    input_dtype = np.dtype(input_dtype)
    defines = {**layout.defines,
               **info.kernel_defines(np.dtype(cache_dtype) if not info.quantized else input_dtype),
               "KVC_INPUT_T": CPP_TYPES[input_dtype],
               "KVC_ROUND_TO_INPUT": int(layout.rotated and plan.rounds_to_input_dtype
                                         and input_dtype != np.float32),
               "KVC_MIN_BLOCKS": min_blocks, "KVC_THREADS": threads}
    return tuple(sorted(defines.items()))


def reshape_and_cache(key, value, cache, slots, *, function=None, uploads=None):
    """Write key/value (interop.Arrays [T, Hk, d]) at slots (a SlotMapping), one launch.
    `function` (device index, entry, kernel, defines) -> kernel and `uploads` (a backend's
    arrays module): where another backend (rocm) takes its kernels and uploads from,
    launched through CuPy. CUDA's own launch is packed (launch.py) and comes back as a
    launch.RecordedCall that a later call differing only in the data pointers of key,
    value and the cache's tensors, in that order, replays (kvcupy.replay), unless a
    row copy was made; None otherwise."""
    import cupy
    packed = function is None
    function, uploads = function or _function, uploads or arrays
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return None
    device = cache.device
    with cupy.cuda.Device(device.index):
        slot_ids = slots.on(uploads, device)
        keys, values = _contiguous_rows(key.data), _contiguous_rows(value.data)
        defines = write_defines(head_size, cache.kv_dtype, _cache_model_dtype(cache), key.dtype, cache.rotation)
        layout = vector_layout(head_size, cache.rotation, _write_tuning(cache.kv_dtype, cache.rotation)[0])
        kernel = function(device.index, "write", "reshape_and_cache", defines)

        key_cache, value_cache = cache.key_cache, cache.value_cache
        k_scales, v_scales = cache.k_scale_cache, cache.v_scale_cache
        quantized = k_scales is not None
        scale_args = ([k_scales, v_scales, *_element_strides(k_scales, 3), *_element_strides(v_scales, 3)]
                      if quantized else [np.uint64(0), np.uint64(0), *[np.int64(0)] * 6])
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
        if not packed:
            kernel((grid,), (threads,), args)
            return None
        write = launch.PackedLaunch.from_args(launch.function_handle(kernel), (grid,), (threads,), args,
                                              replayed=(key.data, value.data, key_cache, value_cache, k_scales,
                                                        v_scales))
        write(cupy.cuda.get_current_stream().ptr)
    return launch.RecordedCall((write,)) if keys is key.data and values is value.data else None


# --- rotation -------------------------------------------------------------

def rotate_defines(head_size: int, plan: RotationPlan | None, input_dtype: np.dtype, output_dtype: np.dtype,
                   orders: bool) -> tuple:
    """The rotate kernel's specialisation under the current tuning."""
    return _rotate_defines(head_size, plan, np.dtype(input_dtype), np.dtype(output_dtype), bool(orders),
                           _rotate_lane_values(head_size, plan),
                           ROTATE_LONG_MIN_BLOCKS if head_size >= ROTATE_LONG_HEAD else ROTATE_MIN_BLOCKS)


@functools.lru_cache(maxsize=None)
def _rotate_defines(head_size: int, plan: RotationPlan | None, input_dtype: np.dtype, output_dtype: np.dtype,
                    orders: bool, lane_values: int, min_blocks: int) -> tuple:
    layout = vector_layout(head_size, plan, lane_values)
    defines = {**layout.defines, "KVC_INPUT_T": CPP_TYPES[np.dtype(input_dtype)],
               "KVC_OUTPUT_T": CPP_TYPES[np.dtype(output_dtype)], "KVC_ORDERS": int(orders),
               "KVC_MIN_BLOCKS": min_blocks}
    return tuple(sorted(defines.items()))


def rotate_threads(layout: VectorLayout) -> int:
    """rotate.cu: kThreads."""
    return 32 if layout.values > 64 else 128


def rotate_rows(x: cupy.ndarray, out: cupy.ndarray, plan: RotationPlan | None, *, inverse: bool,
                divisor: float, read_order: cupy.ndarray | None = None,
                write_order: cupy.ndarray | None = None, x_dtype=None, out_dtype=None, function=None,
                record: bool = False):
    """out[v, k] = y[write_order[k]] / divisor, y = H (s * x'[v]) (inverse: s * (H^T x'[v])),
    x'[v, i] = x[v, read_order[i]]: cpu_kernels.rotate_rows, bit for bit.

    x, out: CuPy [N, d]; x float16 / bfloat16 (uint16 bits) / float32, out float32 or
    x's dtype (x_dtype / out_dtype give the logical dtypes; uint16 means bfloat16 by
    default). Arithmetic in float64, one rounding to float32, then one to out's dtype.
    Orders: int32 arrays of length d or None. plan None or "none": only orders and divisor.
    `function`: as reshape_and_cache's. record (CUDA's own launch): launch packed and
    return a launch.RecordedCall replayable with other (x, out) pointers where x needed
    no copy and no orders were given; None otherwise.
    """
    import cupy
    record = record and function is None
    function = function or _function
    num_rows, head_size = x.shape
    if out.shape != x.shape:
        raise ValueError(f"out has shape {out.shape}; expected x's {x.shape}")
    if out.strides[1] != out.itemsize:
        raise ValueError(f"out must have a contiguous last axis (strides {out.strides})")
    if num_rows == 0:
        return None
    device_index = x.device.id
    given = x
    with cupy.cuda.Device(device_index):
        x = _contiguous_rows(x)
        orders = [None if o is None else cupy.ascontiguousarray(cupy.asarray(o, dtype=np.int32))
                  for o in (read_order, write_order)]
        use_orders = any(o is not None for o in orders)
        defines = rotate_defines(head_size, plan, _logical_dtype(x, x_dtype), _logical_dtype(out, out_dtype),
                                 use_orders)
        layout = vector_layout(head_size, plan, _rotate_lane_values(head_size, plan))
        kernel = function(device_index, "rotate", "rotate_rows", defines)
        divisor = float(divisor)
        # rotate.cu's Divide: keep (1), multiply by the reciprocal (a power of two:
        # exact, so the same as dividing), or divide.
        exact = divisor != 0 and math.isfinite(divisor) and math.frexp(abs(divisor))[0] == 0.5
        mode = 0 if divisor == 1.0 else 1 if exact else 2
        threads = rotate_threads(layout)
        grid = _persistent_grid(device_index, kernel, threads, num_rows, threads // layout.lanes)
        args = (x, np.int64(x.strides[0] // x.itemsize), out, np.int64(out.strides[0] // out.itemsize),
                np.int64(num_rows), _rotation_on(plan, device_index), np.int32(bool(inverse)),
                np.float64(divisor), np.float64(1.0 / divisor if exact else 0.0), np.int32(mode),
                *(np.uint64(0) if o is None else o for o in orders),
                np.int32(_alignment(x.data.ptr, x.strides[0])), np.int32(_alignment(out.data.ptr, out.strides[0])))
        if not record:
            kernel((grid,), (threads,), args)
            return None
        rotation = launch.PackedLaunch.from_args(launch.function_handle(kernel), (grid,), (threads,), args,
                                                 replayed=(given, out))
        rotation(cupy.cuda.get_current_stream().ptr)
    return launch.RecordedCall((rotation,)) if x is given and not use_orders else None


def rotate(x, plan: RotationPlan, inverse: bool, out, *, function=None):
    """out.data = rotation of x.data (interop.Arrays of the same shape and dtype). CUDA's
    own launch comes back as a launch.RecordedCall replayable with other (x, out)
    pointers (kvcupy.replay), where rotate_rows gives one; None otherwise."""
    if plan.is_identity:
        out.data[...] = x.data
        return None
    head_size = plan.head_size
    rows = x.data.reshape(-1, head_size)         # a copy unless x is contiguous
    out_rows = out.data.reshape(-1, head_size)   # out is fresh and contiguous: a view
    # Recorded only where the rows are a view of x itself, starting where x starts.
    return rotate_rows(rows, out_rows, plan, inverse=inverse, divisor=float(plan.norm) if inverse else 1.0,
                       x_dtype=x.dtype, out_dtype=out.dtype, function=function,
                       record=bool(x.data.flags.c_contiguous))


# --- copy-on-write --------------------------------------------------------

# copy_blocks.cu: TensorCopy, eight int64 fields in this order (CuPy has no structured
# dtypes: a record travels as one row of an int64 array).
TENSOR_COPY_FIELDS = ("base", "block_stride", "slot_stride", "head_stride", "heads", "rows", "row_bytes",
                      "width")
COPY_THREADS = 256
_MAX_DESCRIPTOR_SETS = 64
_descriptor_sets: OrderedDict = OrderedDict()


def _tensor_copy(tensor: cupy.ndarray) -> tuple:
    """One TensorCopy record: a block is rows (slot, head) of row_bytes contiguous bytes,
    merged into longer rows where the strides allow."""
    slots, heads = tensor.shape[1], tensor.shape[2]
    row_bytes = tensor.itemsize * (tensor.shape[3] if tensor.ndim == 4 else 1)
    block_stride, slot_stride, head_stride = tensor.strides[:3]
    if head_stride == row_bytes or heads == 1:
        row_bytes, heads, head_stride = row_bytes * heads, 1, 0
        if slot_stride == row_bytes or slots == 1:
            row_bytes, slots, slot_stride = row_bytes * slots, 1, 0
    width = _alignment(tensor.data.ptr, block_stride, slot_stride, head_stride, row_bytes)
    return (tensor.data.ptr, block_stride, slot_stride, head_stride, heads, slots * heads, row_bytes, width)


def copy_blocks(caches, pairs: np.ndarray, *, function=None) -> None:
    """Block pairs[i, 0] onto pairs[i, 1] in every tensor of every cache: one launch
    (`function`: as reshape_and_cache's)."""
    import cupy
    function = function or _function
    pairs = np.ascontiguousarray(pairs, np.int64).reshape(-1, 2)
    if not pairs.size:
        return
    tensors = [tensor for cache in caches for tensor in cache.tensors()]
    device_index = caches[0].device.index
    with cupy.cuda.Device(device_index):
        if np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
            # A block both read and written: NumPy's semantics (every source read
            # before any write) need a gather first. Rare; not worth a kernel.
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
        kernel = function(device_index, "copy_blocks", "copy_blocks", ())
        device_pairs = cupy.asarray(pairs)
        for first in range(0, len(records), 65535):   # gridDim.y <= 65535
            part = descriptors[first:first + 65535]
            kernel((len(pairs), len(part)), (COPY_THREADS,), (part, device_pairs, np.int64(caches[0].num_blocks)))
