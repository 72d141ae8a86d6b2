"""Repeated calls at the cost of their launches.

A serving engine calls `paged_attention` and `reshape_and_cache` once a layer
and a step with arguments that differ from an earlier call's only in where
their data lives: the same cache and plan, the same shapes, dtypes, strides and
scalars. The full path (argument checks, array views, planning, packing the
kernels' parameters) then runs once for that kind of call. A backend that can
replay what it did returns its launches (`backends.cuda.launch.RecordedCall`);
they are kept on the call's plan (`BatchPlan`, `SlotMapping`) under a key, and
a later call with an equal key replays them: each launch's pointer fields
patched with the call's own data pointers, on the caller's current stream.

A key holds everything the checks and the launches depend on other than the
data pointers: the cache's layout (format, rotation, its tensors' shapes,
strides and alignments: one recorded call serves every layer's cache of that
layout, its tensors' addresses patched in too), each data argument's
framework type, dtype, shape, strides, device and pointer alignment (the
launchers read alignments up to 16 bytes), and the scalars with their types. Every check `ops` makes is a function of these, so a call with an equal
key passes them as the recorded one did; and the backend records only calls
whose launches read and write the caller's arrays themselves (no copy of a
strided query, no kron rotation through a float32 buffer, no sinks
conversion). A replay launches only: it is safe under CUDA graph capture.

`rotate` calls are kept in one process-wide table, keyed by the plan as well.

Takes this path: torch tensors (the class itself, not a subclass; not
requiring grad) and CuPy arrays on a GPU whose device is the current one,
without validate=True. Metadata given as device arrays instead of a plan is
planned once for its tensors (their contents do not enter a device plan:
`kvcupy.batch`); host metadata is checked at every call, as the validation
policy asks. Everything else takes the full path every time.
"""

from __future__ import annotations

import sys

# Entries a plan or the metadata memo keeps before starting over (a cache of
# calls, not of results: dropping it costs one full call per kind of call).
MAX_ENTRIES = 1024
MAX_METADATA_PLANS = 64

_metadata_plans: dict = {}   # device metadata -> BatchPlan / SlotMapping


class _Rotations:
    """Where `rotate`'s recorded calls are kept (it takes no plan of a batch)."""

    _replays: dict = {}


ROTATIONS = _Rotations()


def _torch():
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


def _cupy():
    cupy = sys.modules.get("cupy")
    return getattr(cupy, "ndarray", None) if cupy is not None else None


def array_key(x) -> tuple | None:
    """(key, data pointer, device index) of a GPU array a replay can take, else None."""
    kind = type(x)
    if kind is _torch() and kind is not None:
        if x.requires_grad or not x.is_cuda:
            return None
        pointer, device = x.data_ptr(), x.get_device()
        return (kind, x.dtype, x.shape, x.stride(), device, pointer & 15), pointer, device
    if kind is _cupy() and kind is not None:
        pointer, device = x.data.ptr, x.device.id
        return (kind, x.dtype, x.shape, x.strides, device, pointer & 15), pointer, device
    return None


def _current_device() -> int | None:
    """CuPy's current device (whose context holds the kernels), None where CuPy cannot say."""
    try:
        import cupy
        return cupy.cuda.runtime.getDevice()
    except Exception:   # no CuPy, or no driver: the full path says what is missing
        return None


def _first_argument(x) -> tuple | None:
    """array_key of a call's first data argument, which sets where the call runs: None
    unless a replay can take it and its device is the current one (the kernels were
    loaded in that device's context)."""
    described = array_key(x)
    if described is None or described[2] != _current_device():
        return None
    return described


def _stream(x, device: int) -> int:
    """The caller's current stream for `x`: torch's on the tensor's device, else CuPy's."""
    if type(x) is _torch():
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    import cupy
    return cupy.cuda.get_current_stream().ptr


def _new_like(x):
    """An uninitialised contiguous array of x's shape and dtype, in x's framework."""
    if type(x) is _torch():
        import torch
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    import cupy
    return cupy.empty(x.shape, x.dtype)


def _cache(cache) -> tuple | None:
    """(layout, addresses) of a cache from its backend views (CacheArrays, which ops
    makes once a cache before its first call): recorded calls serve every cache of
    one layout, each layer's own, with its tensors' addresses patched in. None for
    anything without views (not a KVCache: the full path refuses it)."""
    arrays = getattr(cache, "_arrays", None)
    return None if arrays is None else (arrays.replay_layout, arrays.addresses)


def _keep(memo: dict, key, value, limit: int) -> None:
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value


class Call:
    """One public call's replay key and pointers: `run()` replays a recorded call,
    `keep(recorded, plan, cache)` records one after the full path has run it.
    `plan`: the plan kept for the call's device metadata, where it came without one."""

    __slots__ = ("key", "pointers", "device", "first", "fresh_out", "metadata_key", "recorded", "plan")

    def __init__(self, key, memo, pointers, device, first, metadata_key=None, plan=None, fresh_out=False):
        self.key, self.pointers, self.device, self.first = key, pointers, device, first
        self.metadata_key, self.plan, self.fresh_out = metadata_key, plan, fresh_out
        self.recorded = memo.get(key) if memo is not None else None

    def run(self):
        """Replays the recorded call; returns the output it allocated (an attention
        call without out=), else None."""
        pointers, result = self.pointers, None
        if self.fresh_out:
            result = _new_like(self.first)
            pointers = (pointers[0], array_key(result)[1]) + pointers[2:]
        self.recorded.replay(_stream(self.first, self.device), pointers)
        return result

    def keep(self, recorded, plan) -> None:
        """Keep `recorded` (a backend's RecordedCall, or None: nothing to replay) for
        later calls with this key, and `plan` (the BatchPlan / SlotMapping the full
        path made or was given) for later calls with the same device metadata."""
        if self.metadata_key is not None and self.plan is None:
            _keep(_metadata_plans, self.metadata_key, plan, MAX_METADATA_PLANS)
        if recorded is not None:
            _keep(plan._replays, self.key, recorded, MAX_ENTRIES)


def _geometry(cache) -> tuple | None:
    """(block size, blocks) of a KVCache (what plan_batch and plan_slots take of it);
    None for anything else, which the full path refuses."""
    try:
        return cache.block_size, cache.num_blocks
    except AttributeError:
        return None


def _metadata(arrays: tuple, extra: tuple):
    """(key, plan kept for it or None) of metadata given as device arrays instead of a
    plan; None where any is on the host (or not an array a replay takes)."""
    parts = []
    for array in arrays:
        if array is None:
            parts.append(None)
            continue
        described = array_key(array)
        if described is None:
            return None
        parts.append(described[:2])
    key = (tuple(parts), extra)
    return key, _metadata_plans.get(key)


def attention_call(query, cache, out, batch, metadata: tuple, hints: tuple, scalars: tuple, sinks) -> Call | None:
    """The replay of a `paged_attention` call, or None where it cannot replay.
    metadata: (block_table, seq_lens, cu_seqlens_q); hints: (max_query_len,
    max_seq_len); scalars: (softmax_scale, sliding_window, softcap)."""
    query_described = _first_argument(query)
    if query_described is None:
        return None
    query_key, query_pointer, device = query_described
    if out is None:
        out_key, out_pointer = None, None
    else:
        out_described = array_key(out)
        if out_described is None:
            return None
        out_key, out_pointer, _ = out_described
    sinks_key = None
    if sinks is not None:
        sinks_described = array_key(sinks)
        if sinks_described is None:
            return None
        sinks_key = sinks_described[:2]
    described_cache = _cache(cache)
    if described_cache is None:
        return None
    layout, addresses = described_cache
    # The scalars with their types: True == 1.0, but the full path refuses a bool.
    softmax_scale, sliding_window, softcap = scalars
    key = (layout, query_key, out_key, type(softmax_scale), softmax_scale, type(sliding_window), sliding_window,
           type(softcap), softcap, sinks_key)
    metadata_key = None
    if batch is None:
        geometry = _geometry(cache)
        if geometry is None:
            return None
        found = _metadata(metadata, (geometry, query_key[2][0], tuple((type(hint), hint) for hint in hints)))
        if found is None:
            return None
        metadata_key, batch = found
    elif metadata[0] is not None or metadata[1] is not None or metadata[2] is not None or \
            hints[0] is not None or hints[1] is not None:
        return None   # both forms at once: the full path says what is wrong
    memo = getattr(batch, "_replays", None)
    return Call(key, memo, (query_pointer, out_pointer) + addresses, device, query, metadata_key, batch,
                fresh_out=out is None)


def write_call(key, value, cache, slot_mapping) -> Call | None:
    """The replay of a `reshape_and_cache` call, or None where it cannot replay."""
    key_described, value_described = _first_argument(key), array_key(value)
    if key_described is None or value_described is None:
        return None
    key_key, key_pointer, device = key_described
    value_key, value_pointer, _ = value_described
    described_cache = _cache(cache)
    if described_cache is None:
        return None
    layout, addresses = described_cache
    metadata_key = None
    slots = slot_mapping
    if not hasattr(slot_mapping, "_replays"):
        geometry = _geometry(cache)
        if geometry is None:
            return None
        found = _metadata((slot_mapping,), geometry)
        if found is None:
            return None
        metadata_key, slots = found
    memo = getattr(slots, "_replays", None)
    return Call((layout, key_key, value_key), memo, (key_pointer, value_pointer) + addresses, device, key,
                metadata_key, slots)


def rotate_call(x, plan, inverse: bool) -> Call | None:
    """The replay of a `rotate` call (the output allocated anew), or None where it cannot replay."""
    described = _first_argument(x)
    if described is None:
        return None
    x_key, x_pointer, device = described
    return Call((x_key, plan, inverse), ROTATIONS._replays, (x_pointer, None), device, x,
                plan=ROTATIONS, fresh_out=True)
