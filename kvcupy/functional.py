"""Caches of immutable arrays (JAX): `updated_cache` returns the cache with new tokens written.

kvcupy never writes into a JAX array (JAX may share or reuse its buffers;
ops refuse it). Instead the tokens are rotated and quantized by kvcupy's own
write kernel into a staging cache of one slot per token, and a jitted JAX
scatter puts those rows at their slots in new arrays. The bytes are the ones
`reshape_and_cache` would store: a row's scale depends on that row alone
(docs/format.md), not on where it lands.

What it costs, besides the write kernel on the new tokens: without donation,
XLA's scatter first copies every cache tensor, so each call reads and writes
the whole cache (O(cache size)). With `donate=True`, XLA updates the given
cache's buffers in place, writing only the new rows (O(tokens)), and the
given cache's arrays are deleted. XLA can reuse a buffer only when nothing
else holds it: kvcupy drops its own views of the given cache first, but a
view the caller keeps (np.asarray of a tensor, a DLPack consumer) makes it
copy after all (JAX's CPU client does so itself; where its GPU client refuses
the donation, updated_cache runs the copying form).
"""

from __future__ import annotations

import functools

import numpy as np

from . import backends, formats, interop, ops
from .batch import plan_slots
from .interop import Array
from .kvcache import KVCache

_FIELDS = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


def updated_cache(key, value, cache: KVCache, slot_mapping, *, donate: bool = False,
                  validate: bool = False) -> KVCache:
    """`cache` (JAX arrays) with key/value [T, Hk, d] written at `slot_mapping`, as a
    new KVCache of new JAX arrays: the functional form of `reshape_and_cache`.

    slot_mapping follows reshape_and_cache (negative entries are padding; host
    contents are checked, device contents only with validate=True). donate=True
    lets XLA update the cache's buffers in place and deletes the given cache's
    arrays (module docstring: what each form costs).
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache (kvcupy.wrap_cache of JAX arrays), got "
                        f"{type(cache).__name__}")
    for tensor, name in zip(cache.tensors(), _FIELDS):
        framework = interop.framework_of(tensor)
        if framework != "jax":
            raise TypeError(f"cache.{name} is a {framework} array, which kvcupy writes in place: "
                            "use kvcupy.reshape_and_cache (updated_cache is for JAX caches)")
    with interop.running_like(key):
        arrays = ops.cache_arrays(cache)
        slots = plan_slots(slot_mapping, num_slots=arrays.num_slots, validate=validate)
        staging = _staging_cache(cache, arrays, slots.num_tokens)
        ops.reshape_and_cache(key, value, staging, np.arange(slots.num_tokens))
        if slots.num_tokens == 0:
            return cache
        rows = tuple(interop.to_jax(Array(tensor, _logical(tensor, arrays), arrays.device, "native", name), key)
                     for tensor, name in zip(staging.tensors(), _FIELDS))
        slot_ids = _jax_slots(slot_mapping, slots, cache)
    tensors = cache.tensors()
    if donate:
        # kvcupy's views of the buffers would keep XLA from reusing them.
        object.__setattr__(cache, "_arrays", None)
        del arrays
    try:
        updated = _scatter(bool(donate))(tensors, rows, slot_ids)
    except RuntimeError as error:
        # XLA's GPU client refuses (where its CPU client copies) to donate a buffer
        # that something else still views through DLPack; the buffers are untouched.
        if not donate or "external reference" not in str(error):
            raise
        updated = _scatter(False)(tensors, rows, slot_ids)
    scales = updated[2:] if len(updated) == 4 else (None, None)
    return KVCache(updated[0], updated[1], *scales, cache.kv_dtype, cache.rotation, cache.head_size)


def _staging_cache(cache: KVCache, arrays, num_tokens: int) -> KVCache:
    """One slot per token, in the cache's format, on its device: every row is
    written by the kernel, so it needs no zero fill (nor the wait that goes with it)."""
    backend = backends.for_device(arrays.device, "cache")
    heads, width = arrays.num_kv_heads, arrays.key_cache.shape[3]
    rows = (num_tokens, 1, heads, width)

    def empty(shape, dtype):
        return backend.empty(shape, dtype, arrays.device)

    info = formats.kv_dtype_info(cache.kv_dtype)
    storage = info.storage if info.quantized else arrays.storage_dtype
    scales = [empty(rows[:3], np.float32) for _ in range(2)] if info.quantized else [None, None]
    return KVCache(empty(rows, storage), empty(rows, storage), *scales, cache.kv_dtype,
                   cache.rotation, cache.head_size)


def _logical(tensor, arrays) -> np.dtype:
    """The dtype a staging tensor's bits mean: the cache's storage for K/V rows
    (bfloat16 rides as uint16 on a GPU), float32 for scales."""
    if tensor.ndim == 3:
        return np.dtype(np.float32)
    return np.dtype(arrays.storage_dtype)


def _jax_slots(slot_mapping, slots, cache: KVCache):
    """The slot ids as an int32 JAX array on the cache's device (int32: JAX without
    x64 holds no int64, and a cache's slot count fits)."""
    import jax
    (device,) = cache.key_cache.devices()
    if slots.host is not None:
        return jax.device_put(slots.host.astype(np.int32), device)
    ids = slot_mapping if interop.framework_of(slot_mapping) == "jax" else jax.dlpack.from_dlpack(slot_mapping)
    return jax.device_put(ids.astype(np.int32), device)


@functools.lru_cache(maxsize=2)
def _scatter(donate: bool):
    """rows[i] ([T, 1, ...]) into tensors[i] ([blocks, block_size, ...]) at slot ids
    (negative: skipped), one jitted function for all tensors; donating the tensors."""
    import jax
    import jax.numpy as jnp

    def scatter(tensors, rows, slot_ids):
        updated = []
        for tensor, row in zip(tensors, rows):
            flat = tensor.reshape((-1,) + tensor.shape[2:])
            row = row.reshape((row.shape[0],) + tensor.shape[2:])
            if row.dtype != tensor.dtype:   # fp8 rows staged as uint8 bits
                row = jax.lax.bitcast_convert_type(row, tensor.dtype)
            # Out of range, so mode="drop" skips it: padding never lands anywhere.
            index = jnp.where(slot_ids < 0, flat.shape[0], slot_ids)
            updated.append(flat.at[index].set(row, mode="drop").reshape(tensor.shape))
        return tuple(updated)

    return jax.jit(scatter, donate_argnums=(0,) if donate else ())
