"""Public operations: validate every argument once, then hand the work to a backend.

Every check runs before the first write, so a rejected call leaves the cache
byte-for-byte as it was. Errors name the argument, the value and what was
expected: TypeError for a wrong type or dtype, ValueError for a wrong shape
or value.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import formats, interop
from .backends import cpu
from .formats import FP8_DTYPE, MODEL_DTYPES
from .kvcache import KVCache
from .rotation import RotationPlan, check_head_size, rotation_plan

DEVICES = ("cpu", "cuda", "rocm")
INDEX_DTYPES = (np.int32, np.int64)


# --- argument checks ------------------------------------------------------

def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return int(value)


def _float_array(x, name: str) -> np.ndarray:
    array = interop.to_host(x, name)
    if array.dtype not in MODEL_DTYPES.values():
        raise TypeError(f"{name} has dtype {array.dtype}; expected one of {sorted(MODEL_DTYPES)}")
    return array


def _index_array(x, name: str, ndim: int) -> np.ndarray:
    array = interop.to_host(x, name)
    if array.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {array.dtype}; expected int32 or int64")
    if array.ndim != ndim:
        raise ValueError(f"{name} has shape {array.shape}; expected {ndim} dimension(s)")
    return array


def _expect_shape(array: np.ndarray, shape: tuple, name: str, what: str) -> None:
    if array.shape != shape:
        raise ValueError(f"{name} has shape {array.shape}; expected {shape} ({what})")


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not a device; expected one of {DEVICES}")
    if device != "cpu":
        raise ValueError(
            f"device={device!r} is not available in this build: it has the CPU backend only "
            "(the CUDA and ROCm kernels are not part of it yet)")


def _resolve_rotation(rotation, kv_dtype: str, head_size: int) -> RotationPlan:
    """None means the KV dtype's default: blockdiag for int4, no rotation otherwise."""
    if rotation is None:
        kind = "blockdiag" if kv_dtype == "int4_per_token_head" else "none"
        return rotation_plan(head_size, kind)
    if not isinstance(rotation, RotationPlan):
        raise TypeError(f"rotation must be a RotationPlan (kvcupy.rotation_plan) or None, "
                        f"got {type(rotation).__name__}")
    if rotation.head_size != head_size:
        raise ValueError(f"rotation is for head_size={rotation.head_size}, the cache has "
                         f"head_size={head_size}")
    return rotation


# --- rotation -------------------------------------------------------------

def rotate(x, plan: RotationPlan, inverse: bool = False):
    """Rotate the last axis of x with `plan` (inverse=True undoes it); same dtype as x."""
    if not isinstance(plan, RotationPlan):
        raise TypeError(f"plan must be a RotationPlan, got {type(plan).__name__}")
    array = _float_array(x, "x")
    if array.ndim == 0 or array.shape[-1] != plan.head_size:
        raise ValueError(f"x has shape {array.shape}; its last axis must be the plan's "
                         f"head_size={plan.head_size}")
    return interop.like(cpu.rotate(array, plan, bool(inverse)), x)


# --- caches ---------------------------------------------------------------

def allocate_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   kv_dtype: str = "int4_per_token_head", rotation: RotationPlan | None = None,
                   device: str = "cpu", dtype="float16") -> KVCache:
    """A zero-filled cache; `dtype` is the model dtype an "auto" cache stores."""
    num_blocks = _positive_int(num_blocks, "num_blocks")
    block_size = _positive_int(block_size, "block_size")
    num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
    info = formats.kv_dtype_info(kv_dtype)
    head_size = check_head_size(head_size)
    plan = _resolve_rotation(rotation, kv_dtype, head_size)
    _check_device(device)
    storage = info.storage_dtype(formats.model_dtype(dtype))
    shape = (num_blocks, block_size, num_kv_heads, info.stored_head_size(head_size))

    def scales():
        return np.zeros(shape[:3], np.float32) if info.quantized else None

    return KVCache(np.zeros(shape, storage), np.zeros(shape, storage), scales(), scales(),
                   kv_dtype, plan, head_size)


def _check_strides(array: np.ndarray, name: str, contiguous_last_axis: bool = True) -> None:
    """Element strides everywhere; K/V rows also need a contiguous last axis.
    (Scales are [block, slot, head]: inline in vLLM's rows, their head axis is strided.)"""
    if contiguous_last_axis and array.ndim and array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        raise ValueError(f"{name} must have a contiguous last axis (strides {array.strides})")
    if any(s % array.itemsize for s in array.strides):
        raise ValueError(f"{name} has strides {array.strides} that are not whole elements")


def wrap_cache(key_cache, value_cache, k_scale_cache=None, v_scale_cache=None, *,
               kv_dtype: str, rotation: RotationPlan | None = None) -> KVCache:
    """A KVCache over existing tensors (e.g. vLLM's), without copying them.

    Tensors may be strided views (scales inline in each head row, as vLLM keeps
    them); each needs a contiguous last axis and whole-element strides.
    """
    info = formats.kv_dtype_info(kv_dtype)
    keys = interop.to_host(key_cache, "key_cache")
    values = interop.to_host(value_cache, "value_cache")
    allowed = ([info.storage] + ([FP8_DTYPE] if kv_dtype == "fp8_per_token_head" else [])
               if info.quantized else list(MODEL_DTYPES.values()))
    for array, name in ((keys, "key_cache"), (values, "value_cache")):
        if array.dtype not in allowed:
            raise TypeError(f"{name} has dtype {array.dtype}; kv_dtype={kv_dtype!r} stores "
                            f"{[str(np.dtype(a)) for a in allowed]}")
        if array.ndim != 4:
            raise ValueError(f"{name} has shape {array.shape}; expected "
                             "[num_blocks, block_size, num_kv_heads, stored_head_size]")
        _check_strides(array, name)
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"value_cache {values.shape} {values.dtype} must match key_cache "
                         f"{keys.shape} {keys.dtype}")
    head_size = check_head_size(keys.shape[3] * info.values_per_element)
    plan = _resolve_rotation(rotation, kv_dtype, head_size)

    scale_arrays = []
    for scales, name in ((k_scale_cache, "k_scale_cache"), (v_scale_cache, "v_scale_cache")):
        if not info.quantized:
            if scales is not None:
                raise ValueError(f"{name} must be None for kv_dtype='auto'")
            scale_arrays.append(None)
            continue
        if scales is None:
            raise ValueError(f"{name} is required for kv_dtype={kv_dtype!r}")
        array = interop.to_host(scales, name)
        if array.dtype != np.float32:
            raise TypeError(f"{name} has dtype {array.dtype}; expected float32")
        _expect_shape(array, keys.shape[:3], name, "[num_blocks, block_size, num_kv_heads]")
        _check_strides(array, name, contiguous_last_axis=False)
        scale_arrays.append(scales)
    return KVCache(key_cache, value_cache, scale_arrays[0], scale_arrays[1], kv_dtype, plan, head_size)


def _host_cache(cache) -> KVCache:
    """The cache with NumPy views of its tensors, fp8 viewed as its bytes."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache (allocate_cache / wrap_cache), got {type(cache).__name__}")

    def view(tensor, name):
        if tensor is None:
            return None
        array = interop.to_host(tensor, name)
        return array.view(np.uint8) if array.dtype == FP8_DTYPE else array

    return KVCache(view(cache.key_cache, "cache.key_cache"), view(cache.value_cache, "cache.value_cache"),
                   view(cache.k_scale_cache, "cache.k_scale_cache"),
                   view(cache.v_scale_cache, "cache.v_scale_cache"),
                   cache.kv_dtype, cache.rotation, cache.head_size)


# --- write path -----------------------------------------------------------

def reshape_and_cache(key, value, cache: KVCache, slot_mapping) -> None:
    """Rotate, quantize and write key/value [T, Hk, d] to their slots (in place).

    slot_mapping[t] = block * block_size + offset; negative entries are padding.
    """
    host = _host_cache(cache)
    keys = _float_array(key, "key")
    values = _float_array(value, "value")
    expected = (keys.shape[0] if keys.ndim else 0, host.num_kv_heads, host.head_size)
    _expect_shape(keys, expected, "key", "[num_tokens, num_kv_heads, head_size] of the cache")
    _expect_shape(values, keys.shape, "value", "the shape of key")
    if values.dtype != keys.dtype:
        raise TypeError(f"value has dtype {values.dtype}; expected key's dtype {keys.dtype}")
    slots = _index_array(slot_mapping, "slot_mapping", 1)
    _expect_shape(slots, keys.shape[:1], "slot_mapping", "one slot per token")
    valid = slots[slots >= 0]
    if valid.size and valid.max() >= host.num_slots:
        raise ValueError(f"slot_mapping holds slot {int(valid.max())}; the cache has "
                         f"{host.num_slots} slots ({host.num_blocks} blocks x {host.block_size})")
    if np.unique(valid).size != valid.size:
        raise ValueError("slot_mapping writes one slot twice; each slot takes at most one token")
    for tensor in host.tensors():
        if not tensor.flags.writeable:
            raise ValueError("cache tensors are read-only; reshape_and_cache writes in place")
    cpu.reshape_and_cache(keys, values, host, slots.astype(np.int64))


# --- read path ------------------------------------------------------------

def _check_scalar(value, name: str, *, minimum: float, allow_equal: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (value == minimum and not allow_equal):
        bound = ">=" if allow_equal else ">"
        raise ValueError(f"{name}={value} must be finite and {bound} {minimum}")
    return value


def _check_batch(host: KVCache, num_tokens: int, block_table, seq_lens, cu_seqlens_q):
    """Validated (block_table, seq_lens, cu_seqlens_q) as int32 arrays."""
    lens = _index_array(seq_lens, "seq_lens", 1)
    num_seqs = lens.shape[0]
    table = _index_array(block_table, "block_table", 2)
    if table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {table.shape[0]} rows; expected one per sequence ({num_seqs})")
    if cu_seqlens_q is None:
        starts = np.arange(num_seqs + 1)
    else:
        starts = _index_array(cu_seqlens_q, "cu_seqlens_q", 1)
        _expect_shape(starts, (num_seqs + 1,), "cu_seqlens_q", "num_seqs + 1 offsets")
    if starts[0] != 0 or starts[-1] != num_tokens or np.any(np.diff(starts) < 0):
        raise ValueError(f"cu_seqlens_q={starts.tolist()} must rise from 0 to the number of "
                         f"query tokens ({num_tokens})")
    query_lens = np.diff(starts)
    if np.any(lens < query_lens):
        seq = int(np.argmax(lens < query_lens))
        raise ValueError(f"seq_lens[{seq}]={int(lens[seq])} is shorter than its {int(query_lens[seq])} "
                         "new query tokens")
    capacity = table.shape[1] * host.block_size
    if num_seqs and lens.max() > capacity:
        raise ValueError(f"seq_lens holds {int(lens.max())} tokens; block_table rows cover "
                         f"{capacity} ({table.shape[1]} blocks x {host.block_size})")
    for seq in range(num_seqs):
        num_used = -(-int(lens[seq]) // host.block_size)   # ceil(seq_len / block_size)
        used = table[seq, :num_used]
        if used.size and (used.min() < 0 or used.max() >= host.num_blocks):
            bad = int(used.min() if used.min() < 0 else used.max())
            raise ValueError(f"block_table[{seq}] refers to block {bad}; the cache has "
                             f"blocks 0..{host.num_blocks - 1}")
    as_int32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)
    return as_int32(table), as_int32(lens), as_int32(starts)


def paged_attention(query, cache: KVCache, *, block_table, seq_lens, cu_seqlens_q=None,
                    softmax_scale: float | None = None, sliding_window: int | None = None,
                    softcap: float = 0.0, sinks=None, out=None):
    """Causal attention of query [T, Hq, head_size] over the paged cache.

    cu_seqlens_q [S+1] delimits each sequence's new tokens in `query` (None:
    one token per sequence, i.e. decode); seq_lens [S] are the sequences'
    lengths including those tokens; block_table [S, max_blocks] maps logical
    to physical blocks. sinks [Hq]: one extra logit per query head that joins
    the softmax denominator without a value (gpt-oss). Returns [T, Hq, d] in
    the query's dtype and framework; written into `out` when given.
    """
    host = _host_cache(cache)
    q = _float_array(query, "query")
    if q.ndim != 3 or q.shape[2] != host.head_size:
        raise ValueError(f"query has shape {q.shape}; expected [num_tokens, num_heads, "
                         f"{host.head_size}]")
    num_heads = q.shape[1]
    if num_heads == 0 or num_heads % host.num_kv_heads:
        raise ValueError(f"query has {num_heads} heads; expected a multiple of the cache's "
                         f"{host.num_kv_heads} KV heads")
    table, lens, starts = _check_batch(host, q.shape[0], block_table, seq_lens, cu_seqlens_q)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(host.head_size)
    softmax_scale = _check_scalar(softmax_scale, "softmax_scale", minimum=0.0, allow_equal=False)
    softcap = _check_scalar(softcap, "softcap", minimum=0.0, allow_equal=True)
    if sliding_window is not None:
        sliding_window = _positive_int(sliding_window, "sliding_window")
    sink_logits = None
    if sinks is not None:
        sink_logits = interop.to_host(sinks, "sinks")
        if sink_logits.dtype.kind != "f" and sink_logits.dtype not in MODEL_DTYPES.values():
            raise TypeError(f"sinks has dtype {sink_logits.dtype}; expected a float dtype")
        _expect_shape(sink_logits, (num_heads,), "sinks", "one logit per query head")
    out_array = None
    if out is not None:
        out_array = interop.to_host(out, "out")
        if out_array.dtype != q.dtype:
            raise TypeError(f"out has dtype {out_array.dtype}; expected the query's {q.dtype}")
        _expect_shape(out_array, q.shape, "out", "the query's shape")
        if not out_array.flags.writeable:
            raise ValueError("out is read-only")

    result = cpu.paged_attention(q, host, block_table=table, seq_lens=lens, cu_seqlens_q=starts,
                                 softmax_scale=softmax_scale, sliding_window=sliding_window,
                                 softcap=softcap, sinks=sink_logits)
    if out_array is not None:
        out_array[...] = result.astype(q.dtype)
        return out
    return interop.like(result.astype(q.dtype), query)
