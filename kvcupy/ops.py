"""Public operations: validate every argument once, then hand the work to a backend.

Every check runs before the first write, so a rejected call leaves the cache
byte-for-byte as it was. Errors name the argument, the value and what was
expected: TypeError for a wrong type, dtype or placement, ValueError for a
wrong shape or value.

The backend is the one serving the device the call's data lives on (the
cache's device; `kvcupy.backends`). Data arguments (query, key, value, out,
sinks) must live there too and, within one call, come from one framework: the
result comes back in that framework. Index arguments (slot_mapping,
block_table, seq_lens, cu_seqlens_q) may be on the host instead, where they
are checked in full and uploaded once (`kvcupy.batch` states the policy).

Each public function runs where its first data argument lives
(`interop.running_like`): that device is current for the call, and on a GPU
every launch goes to the caller's stream (torch's current stream, JAX's
stream for external data, CuPy's current stream otherwise). Nothing here
waits for a device. JAX arrays are never written: a JAX cache goes through
`kvcupy.updated_cache`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import backends, formats, interop, replay
from .batch import BatchPlan, SlotMapping, plan_batch, plan_slots
from .formats import FP8_DTYPE, MODEL_DTYPES
from .interop import Array, Device
from .kvcache import CacheArrays, KVCache
from .rotation import RotationPlan, check_head_size, rotation_plan

DEVICE_KINDS = ("cpu", "cuda", "rocm")


# --- argument checks ------------------------------------------------------

def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return int(value)


def _float_array(x, name: str) -> Array:
    array = interop.as_array(x, name)
    if array.dtype not in MODEL_DTYPES.values():
        raise TypeError(f"{name} has dtype {array.dtype}; expected one of {sorted(MODEL_DTYPES)}")
    return array


def _expect_shape(array, shape: tuple, name: str, what: str) -> None:
    if tuple(array.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(array.shape)}; expected {shape} ({what})")


def _parse_device(device) -> Device:
    """"cpu", "cuda", "cuda:1", "rocm" (or a Device) as a Device."""
    if isinstance(device, Device):
        return device
    kind, _, index = str(device).partition(":")
    if not isinstance(device, str) or kind not in DEVICE_KINDS or (index and not index.isdigit()):
        raise ValueError(f"device={device!r} is not a device; expected one of {DEVICE_KINDS} "
                         "(optionally with an index, 'cuda:1')")
    return Device(kind, int(index or 0))


def _on_cache_device(arrays: list[Array], cache: CacheArrays) -> None:
    """Data arguments live where the cache does, and come from one framework."""
    interop.same_placement(arrays)
    if arrays[0].device != cache.device:
        raise TypeError(f"{arrays[0].name} is on {arrays[0].device} but the cache is on "
                        f"{cache.device}; one call runs on one device")


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


def _writable(array: Array) -> None:
    flags = getattr(array.data, "flags", None)
    if flags is not None and hasattr(flags, "writeable") and not flags.writeable:
        raise ValueError(f"{array.name} is read-only; this call writes into it")


# --- rotation -------------------------------------------------------------

def rotate(x, plan: RotationPlan, inverse: bool = False):
    """Rotate the last axis of x with `plan` (inverse=True undoes it); same dtype as x."""
    if not isinstance(plan, RotationPlan):
        raise TypeError(f"plan must be a RotationPlan, got {type(plan).__name__}")
    inverse = bool(inverse)
    call = replay.rotate_call(x, plan, inverse)
    if call is not None and call.recorded is not None:
        return call.run()
    with interop.running_like(x):
        return _rotate(x, plan, inverse, call)


def _rotate(x, plan: RotationPlan, inverse: bool, call=None):
    array = _float_array(x, "x")
    if array.ndim == 0 or array.shape[-1] != plan.head_size:
        raise ValueError(f"x has shape {array.shape}; its last axis must be the plan's "
                         f"head_size={plan.head_size}")
    backend = backends.for_device(array.device, "x")
    out = _new_array(backend, array.shape, array.dtype, array.device, "out")
    recorded = backend.rotate(array, plan, bool(inverse), out)
    if call is not None:
        call.keep(recorded, replay.ROTATIONS)
    return interop.like(out, x)


def _new_array(backend, shape, dtype: np.dtype, device: Device, name: str) -> Array:
    return Array(backend.empty(tuple(shape), dtype, device), np.dtype(dtype), device, "native", name)


# --- caches ---------------------------------------------------------------

def allocate_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   kv_dtype: str = "int4_per_token_head", rotation: RotationPlan | None = None,
                   device: str = "cpu", dtype="float16") -> KVCache:
    """A zero-filled cache on `device` ("cpu", "cuda", "cuda:1", "rocm"); `dtype` is
    the model dtype an "auto" cache stores.

    On a GPU the zero fill runs on CuPy's current stream of that device, which
    this call then waits for (once): the cache is ready for work on any stream."""
    num_blocks = _positive_int(num_blocks, "num_blocks")
    block_size = _positive_int(block_size, "block_size")
    num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
    info = formats.kv_dtype_info(kv_dtype)
    head_size = check_head_size(head_size)
    plan = _resolve_rotation(rotation, kv_dtype, head_size)
    where = _parse_device(device)
    backend = backends.for_device(where, f"device={device!r}")
    storage = info.storage_dtype(formats.model_dtype(dtype))
    shape = (num_blocks, block_size, num_kv_heads, info.stored_head_size(head_size))

    def zeros(shape, dtype):
        return backend.zeros(shape, dtype, where)

    scales = (lambda: zeros(shape[:3], np.float32)) if info.quantized else (lambda: None)
    with interop.running_on(where):
        cache = KVCache(zeros(shape, storage), zeros(shape, storage), scales(), scales(),
                        kv_dtype, plan, head_size)
        interop.synchronize(where)
    return cache


def _check_strides(array, name: str, contiguous_last_axis: bool = True) -> None:
    """Element strides everywhere; K/V rows also need a contiguous last axis.
    (Scales are [block, slot, head]: inline in vLLM's rows, their head axis is strided.)"""
    itemsize = array.dtype.itemsize
    strides = tuple(array.strides)
    if contiguous_last_axis and array.ndim and array.shape[-1] > 1 and strides[-1] != itemsize:
        raise ValueError(f"{name} must have a contiguous last axis (strides {strides})")
    if any(s % itemsize for s in strides):
        raise ValueError(f"{name} has strides {strides} that are not whole elements")


def wrap_cache(key_cache, value_cache, k_scale_cache=None, v_scale_cache=None, *,
               kv_dtype: str, rotation: RotationPlan | None = None) -> KVCache:
    """A KVCache over existing tensors (e.g. vLLM's), without copying them.

    Tensors may be strided views (scales inline in each head row, as vLLM keeps
    them); each needs a contiguous last axis and whole-element strides. JAX
    arrays make a read-only cache: attention reads it, `kvcupy.updated_cache`
    returns a new one with tokens written.
    """
    with interop.running_like(key_cache):
        return _wrap_cache(key_cache, value_cache, k_scale_cache, v_scale_cache, kv_dtype, rotation)


def _wrap_cache(key_cache, value_cache, k_scale_cache, v_scale_cache, kv_dtype: str,
                rotation: RotationPlan | None) -> KVCache:
    info = formats.kv_dtype_info(kv_dtype)
    keys = interop.as_array(key_cache, "key_cache")
    values = interop.as_array(value_cache, "value_cache")
    allowed = ([info.storage] + ([FP8_DTYPE] if kv_dtype == "fp8_per_token_head" else [])
               if info.quantized else list(MODEL_DTYPES.values()))
    for array in (keys, values):
        if array.dtype not in allowed:
            raise TypeError(f"{array.name} has dtype {array.dtype}; kv_dtype={kv_dtype!r} stores "
                            f"{[str(np.dtype(a)) for a in allowed]}")
        if array.ndim != 4:
            raise ValueError(f"{array.name} has shape {array.shape}; expected "
                             "[num_blocks, block_size, num_kv_heads, stored_head_size]")
        _check_strides(array.data, array.name)
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"value_cache {values.shape} {values.dtype} must match key_cache "
                         f"{keys.shape} {keys.dtype}")
    interop.same_placement([keys, values])
    head_size = check_head_size(keys.shape[3] * info.values_per_element)
    plan = _resolve_rotation(rotation, kv_dtype, head_size)

    for scales, name in ((k_scale_cache, "k_scale_cache"), (v_scale_cache, "v_scale_cache")):
        if not info.quantized:
            if scales is not None:
                raise ValueError(f"{name} must be None for kv_dtype='auto'")
            continue
        if scales is None:
            raise ValueError(f"{name} is required for kv_dtype={kv_dtype!r}")
        array = interop.as_array(scales, name)
        if array.dtype != np.float32:
            raise TypeError(f"{name} has dtype {array.dtype}; expected float32")
        _expect_shape(array, keys.shape[:3], name, "[num_blocks, block_size, num_kv_heads]")
        _check_strides(array.data, name, contiguous_last_axis=False)
        interop.same_placement([keys, array])
    return KVCache(key_cache, value_cache, k_scale_cache, v_scale_cache, kv_dtype, plan, head_size)


def cache_arrays(cache) -> CacheArrays:
    """The cache as its backend reads it (made once per KVCache, then reused)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache (allocate_cache / wrap_cache), got {type(cache).__name__}")
    if cache._arrays is not None:
        return cache._arrays
    with interop.running_like(cache.key_cache):
        return _make_cache_arrays(cache)


def _make_cache_arrays(cache: KVCache) -> CacheArrays:
    def view(tensor, name):
        if tensor is None:
            return None
        array = interop.as_array(tensor, name)
        if array.dtype == FP8_DTYPE and array.device.kind == "cpu":
            return Array(array.data.view(np.uint8), np.dtype(np.uint8), array.device, array.framework, name)
        return array

    fields = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
    arrays = [view(getattr(cache, f), f"cache.{f}") for f in fields]
    present = [a for a in arrays if a is not None]
    interop.same_placement(present)
    backends.for_device(present[0].device, "cache.key_cache")
    info = formats.kv_dtype_info(cache.kv_dtype)
    storage = info.storage if info.quantized else present[0].dtype
    result = CacheArrays(*[None if a is None else a.data for a in arrays], cache.kv_dtype,
                         cache.rotation, cache.head_size, storage, present[0].device)
    object.__setattr__(cache, "_arrays", result)
    return result


def _viewed(cache):
    """`cache`, its backend views made (cache_arrays) where it is a KVCache: a replay's
    key reads them. Anything else comes back as it is, for the full path to refuse."""
    if isinstance(cache, KVCache) and cache._arrays is None:
        cache_arrays(cache)
    return cache


def copy_blocks(caches, pairs) -> None:
    """Copy block pairs[i, 0] onto block pairs[i, 1] in every cache of `caches`
    (all tensors): copy-on-write for all layers in one backend call."""
    caches = list(caches)
    if not caches:
        return
    with interop.running_like(getattr(caches[0], "key_cache", None)):
        _copy_blocks(caches, pairs)


def _copy_blocks(caches: list, pairs) -> None:
    arrays = [cache_arrays(c) for c in caches]
    for i, cache in enumerate(caches):
        for tensor in cache.tensors():
            interop.immutable(tensor, f"caches[{i}]")
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    num_blocks = arrays[0].num_blocks
    if pairs.size and (pairs.min() < 0 or pairs.max() >= num_blocks):
        raise ValueError(f"pairs refer to block {int(pairs.max() if pairs.max() >= num_blocks else pairs.min())}; "
                         f"the caches have blocks 0..{num_blocks - 1}")
    for i, a in enumerate(arrays[1:], 1):
        if a.device != arrays[0].device or a.num_blocks != num_blocks:
            raise ValueError(f"caches[{i}] ({a.device}, {a.num_blocks} blocks) differs from "
                             f"caches[0] ({arrays[0].device}, {num_blocks} blocks)")
    if pairs.size:
        backends.for_device(arrays[0].device, "caches").copy_blocks(arrays, pairs)


# --- write path -----------------------------------------------------------

def reshape_and_cache(key, value, cache: KVCache, slot_mapping, *, validate: bool = False) -> None:
    """Rotate, quantize and write key/value [T, Hk, d] to their slots (in place).

    slot_mapping[t] = block * block_size + offset; negative entries are padding.
    It may be a SlotMapping (kvcupy.batch.plan_slots) checked once for many layers.
    """
    call = None if validate else replay.write_call(key, value, _viewed(cache), slot_mapping)
    if call is not None and call.recorded is not None:
        call.run()
        return
    with interop.running_like(key):
        _reshape_and_cache(key, value, cache, slot_mapping, validate, call)


def _reshape_and_cache(key, value, cache: KVCache, slot_mapping, validate: bool, call) -> None:
    arrays = cache_arrays(cache)
    for tensor, name in zip(cache.tensors(), ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")):
        interop.immutable(tensor, f"cache.{name}")
    keys = _float_array(key, "key")
    values = _float_array(value, "value")
    _on_cache_device([keys, values], arrays)
    expected = (keys.shape[0] if keys.ndim else 0, arrays.num_kv_heads, arrays.head_size)
    _expect_shape(keys, expected, "key", "[num_tokens, num_kv_heads, head_size] of the cache")
    _expect_shape(values, keys.shape, "value", "the shape of key")
    if values.dtype != keys.dtype:
        raise TypeError(f"value has dtype {values.dtype}; expected key's dtype {keys.dtype}")
    if isinstance(slot_mapping, SlotMapping):
        slots = slot_mapping
    elif call is not None and call.plan is not None:
        slots = call.plan   # planned before for these device slot ids
    else:
        slots = plan_slots(slot_mapping, num_slots=arrays.num_slots, validate=validate)
    if slots.num_tokens != keys.shape[0]:
        raise ValueError(f"slot_mapping has shape ({slots.num_tokens},); expected "
                         f"({keys.shape[0]},) (one slot per token)")
    slots.check_device(arrays.device)
    for tensor, name in zip(arrays.tensors(), ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")):
        _writable(Array(tensor, arrays.storage_dtype, arrays.device, "native", f"cache.{name}"))
    recorded = backends.for_device(arrays.device, "cache").reshape_and_cache(keys, values, arrays, slots)
    if call is not None:
        call.keep(recorded, slots)


# --- read path ------------------------------------------------------------

def _check_scalar(value, name: str, *, minimum: float, allow_equal: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (value == minimum and not allow_equal):
        bound = ">=" if allow_equal else ">"
        raise ValueError(f"{name}={value} must be finite and {bound} {minimum}")
    return value


def _batch(batch, arrays: CacheArrays, num_tokens: int, block_table, seq_lens, cu_seqlens_q,
           max_query_len, max_seq_len, validate: bool) -> BatchPlan:
    if batch is None:
        if block_table is None or seq_lens is None:
            raise TypeError("paged_attention needs block_table and seq_lens (or batch=)")
        return plan_batch(block_table=block_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                          block_size=arrays.block_size, num_blocks=arrays.num_blocks,
                          num_query_tokens=num_tokens, max_query_len=max_query_len,
                          max_seq_len=max_seq_len, validate=validate)
    if not isinstance(batch, BatchPlan):
        raise TypeError(f"batch must be a BatchPlan (kvcupy.plan_batch), got {type(batch).__name__}")
    if any(a is not None for a in (block_table, seq_lens, cu_seqlens_q)):
        raise TypeError("pass either batch= or block_table/seq_lens/cu_seqlens_q, not both")
    if max_query_len is not None or max_seq_len is not None:
        raise TypeError("max_query_len / max_seq_len go to kvcupy.plan_batch with the metadata they "
                        "bound; batch= carries its own")
    if (batch.block_size, batch.num_blocks) != (arrays.block_size, arrays.num_blocks):
        raise ValueError(f"batch was planned for {batch.num_blocks} blocks of {batch.block_size}; "
                         f"the cache has {arrays.num_blocks} of {arrays.block_size}")
    if batch.num_query_tokens not in (None, num_tokens):
        raise ValueError(f"query has {num_tokens} token{'' if num_tokens == 1 else 's'}; batch was planned for "
                         f"{batch.num_query_tokens} (its cu_seqlens_q, or one per sequence "
                         "when planned without one)")
    return batch


def paged_attention(query, cache: KVCache, *, block_table=None, seq_lens=None, cu_seqlens_q=None,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    batch: BatchPlan | None = None, softmax_scale: float | None = None,
                    sliding_window: int | None = None, softcap: float = 0.0, sinks=None,
                    out=None, validate: bool = False):
    """Causal attention of query [T, Hq, head_size] over the paged cache.

    cu_seqlens_q [S+1] delimits each sequence's new tokens in `query` (None:
    one token per sequence, i.e. decode); seq_lens [S] are the sequences'
    lengths including those tokens; block_table [S, max_blocks] maps logical
    to physical blocks. max_query_len / max_seq_len: Python ints that no
    sequence's new query tokens / keys exceed, for metadata on a device (as
    flash-attn's varlen call takes them): a GPU plans its work for them instead
    of for the whole query and block table; checked where the host knows the
    contents (host metadata, validate=True), trusted otherwise (a sequence that
    breaks them gets an unspecified output). Instead of all these, `batch`
    (kvcupy.plan_batch) is metadata checked and planned once for many layers,
    and the form a CUDA graph can capture (after one call with it outside the
    capture, which builds and uploads the plan). sinks [Hq]: one extra
    logit per query head that joins the softmax denominator without a value
    (gpt-oss). Returns [T, Hq, d] in the query's dtype and framework; written
    into `out` when given. validate=True also checks metadata that lives on a
    device (a synchronisation).
    """
    call = None if validate else replay.attention_call(
        query, _viewed(cache), out, batch, (block_table, seq_lens, cu_seqlens_q), (max_query_len, max_seq_len),
        (softmax_scale, sliding_window, softcap), sinks)
    if call is not None and call.recorded is not None:
        result = call.run()
        return out if out is not None else result
    with interop.running_like(query):
        return _paged_attention(query, cache, block_table, seq_lens, cu_seqlens_q, max_query_len, max_seq_len,
                                batch, softmax_scale, sliding_window, softcap, sinks, out, validate, call)


def _paged_attention(query, cache: KVCache, block_table, seq_lens, cu_seqlens_q, max_query_len, max_seq_len,
                     batch, softmax_scale, sliding_window, softcap: float, sinks, out, validate: bool, call):
    arrays = cache_arrays(cache)
    q = _float_array(query, "query")
    if q.ndim != 3 or q.shape[2] != arrays.head_size:
        raise ValueError(f"query has shape {q.shape}; expected [num_tokens, num_heads, "
                         f"{arrays.head_size}]")
    num_heads = q.shape[1]
    if num_heads == 0 or num_heads % arrays.num_kv_heads:
        raise ValueError(f"query has {num_heads} heads; expected a multiple of the cache's "
                         f"{arrays.num_kv_heads} KV heads")
    data = [q]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(arrays.head_size)
    softmax_scale = _check_scalar(softmax_scale, "softmax_scale", minimum=0.0, allow_equal=False)
    softcap = _check_scalar(softcap, "softcap", minimum=0.0, allow_equal=True)
    if sliding_window is not None:
        sliding_window = _positive_int(sliding_window, "sliding_window")
    sink_logits = None
    if sinks is not None:
        sink_logits = interop.as_array(sinks, "sinks")
        if sink_logits.dtype.kind != "f" and sink_logits.dtype not in MODEL_DTYPES.values():
            raise TypeError(f"sinks has dtype {sink_logits.dtype}; expected a float dtype")
        _expect_shape(sink_logits, (num_heads,), "sinks", "one logit per query head")
        interop.on_device_or_host(sink_logits, arrays.device)   # parameters, like index arrays
    out_array = None
    if out is not None:
        interop.immutable(out, "out")
        out_array = interop.as_array(out, "out")
        if out_array.dtype != q.dtype:
            raise TypeError(f"out has dtype {out_array.dtype}; expected the query's {q.dtype}")
        _expect_shape(out_array, q.shape, "out", "the query's shape")
        _writable(out_array)
        data.append(out_array)
    _on_cache_device(data, arrays)
    if batch is None and call is not None and call.plan is not None:
        plan = call.plan   # planned before for these device metadata tensors
    else:
        plan = _batch(batch, arrays, q.shape[0], block_table, seq_lens, cu_seqlens_q, max_query_len, max_seq_len,
                      validate)
    plan.check_device(arrays.device)

    backend = backends.for_device(arrays.device, "cache")
    backend_plan = plan.backend_plan(
        (backend.name, arrays.plan_key, num_heads, q.shape[0]),
        lambda: backend.plan_attention(plan, arrays, num_heads, q.shape[0]))
    target = out_array or _new_array(backend, q.shape, q.dtype, q.device, "out")
    recorded = backend.paged_attention(q, arrays, plan, backend_plan, softmax_scale=softmax_scale,
                                       sliding_window=sliding_window, softcap=softcap, sinks=sink_logits,
                                       out=target)
    if call is not None:
        call.keep(recorded, plan)
    return out if out is not None else interop.like(target, query)
