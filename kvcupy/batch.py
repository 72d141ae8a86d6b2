"""A step's metadata, checked once and shared by every layer: `BatchPlan`, `SlotMapping`.

Validation policy (the GPU's hot path must not synchronise):

- Metadata on the host (NumPy arrays, lists, what `PagedKVCache` builds) is
  checked in full on the host, where reading it is free: every slot id inside
  the cache and used at most once, every block id a sequence reads inside the
  cache, sequence lengths inside the block table and at least their query
  lengths. A backend on a device uploads it once per plan, not once per layer.
- Metadata already on a device gets shape and dtype checks only: reading its
  contents would cost a synchronisation. Every kernel guards every id it
  reads (a slot or block id outside the cache is skipped, a length is clipped
  to the block table), so no id, however wrong, reads or writes outside the
  cache; the output for a sequence with bad ids is then unspecified.
- `validate=True` checks device contents too, at the price of a copy to the
  host and a synchronisation.
- `max_query_len` / `max_seq_len` (host ints beside device metadata, as
  flash-attn's varlen call and vLLM take them) promise that no sequence has
  more new query tokens / more keys; a device backend plans its work for them
  instead of for the whole query and block table. The promise is checked
  wherever the contents are known on the host (host metadata, or
  validate=True) and trusted otherwise: a broken promise leaves the output of
  the sequences that break it unspecified, as a bad id does.

A plan is also where a backend hangs its own per-batch planning (CPU work
items, CUDA split-KV sizes): `backend_plan` builds it once per plan and key.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .interop import HOST, Array, index_array, on_device_or_host

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _index(x, name: str, ndim: int) -> Array:
    array = index_array(x, name)
    if array.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {array.dtype}; expected int32 or int64")
    if array.ndim != ndim:
        raise ValueError(f"{name} has shape {array.shape}; expected {ndim} dimension(s)")
    return array


def _to_host(array: Array) -> np.ndarray:
    """The contents of an index array on the host (a synchronisation for a device array)."""
    if array.device == HOST:
        return array.data
    return np.asarray(array.data.get() if hasattr(array.data, "get") else np.from_dlpack(array.data))


@dataclass(eq=False)
class _Uploads:
    """Index arrays as each device's backend holds them, made once per device."""

    host: dict[str, np.ndarray]
    device: dict[str, Array]
    copies: dict = field(default_factory=dict)

    def on(self, backend, device) -> dict[str, Any]:
        """name -> int32 array in the backend's array type on `device`."""
        key = (backend.name, device)
        if key not in self.copies:
            arrays = {name: backend.upload(array, device) for name, array in self.host.items()}
            arrays.update({name: array.data for name, array in self.device.items()})
            self.copies[key] = arrays
        return self.copies[key]

    def made(self, backend, device) -> bool:
        """Whether `on(backend, device)` has made its arrays already (it uploads nothing then)."""
        return (backend.name, device) in self.copies

    def check_device(self, device) -> None:
        """Index arrays passed on a device are on `device`, or a TypeError names one."""
        for array in self.device.values():
            on_device_or_host(array, device)


@dataclass(eq=False)
class BatchPlan:
    """Attention metadata of one step: block_table [S, W], seq_lens [S],
    cu_seqlens_q [S+1], for caches of `block_size` tokens a page and
    `num_blocks` pages. `checked`: the contents were checked (host metadata, or
    validate=True); `host`: the int32 host arrays when the contents are known.
    `max_query_len` / `max_seq_len`: bounds on every sequence's new query tokens
    and keys (the caller's hints, else the contents' maxima where the host knows
    them, else None)."""

    num_seqs: int
    block_size: int
    num_blocks: int
    checked: bool
    host: dict[str, np.ndarray] | None
    _uploads: _Uploads
    table_width: int = 0   # block_table's columns: with block_size, a bound on every length
    tuning: Any = None     # a backend's tunables (e.g. backends.cuda.tuning.Tuning); None: its defaults
    max_query_len: int | None = None
    max_seq_len: int | None = None
    _backend_plans: dict = field(default_factory=dict)
    _replays: dict = field(default_factory=dict)   # kvcupy.replay: recorded calls of this plan

    @property
    def num_query_tokens(self) -> int | None:
        return None if self.host is None else int(self.host["cu_seqlens_q"][-1])

    @property
    def host_query_offsets(self) -> np.ndarray | None:
        """cu_seqlens_q on the host when it is known there (decode builds it on the
        host even when the lengths live on a device)."""
        if self.host is not None:
            return self.host["cu_seqlens_q"]
        return self._uploads.host.get("cu_seqlens_q")

    @property
    def host_seq_lens(self) -> np.ndarray | None:
        """seq_lens on the host when it is known there (given on the host, or validated)."""
        if self.host is not None:
            return self.host["seq_lens"]
        return self._uploads.host.get("seq_lens")

    def arrays(self, backend, device) -> dict[str, Any]:
        """block_table, seq_lens, cu_seqlens_q as `backend`'s int32 arrays on `device`."""
        return self._uploads.on(backend, device)

    def uploaded(self, backend, device) -> bool:
        """Whether `arrays(backend, device)` would upload nothing (it did before)."""
        return self._uploads.made(backend, device)

    def bounds(self, num_query_tokens: int) -> tuple[int, int]:
        """(new query tokens, keys) that no sequence exceeds, for a call of
        `num_query_tokens` tokens: the plan's max_query_len / max_seq_len, where
        unknown the whole query and the whole block table's row. At least 1 each."""
        query = num_query_tokens if self.max_query_len is None else min(self.max_query_len, num_query_tokens)
        table = self.table_width * self.block_size   # kernels clip every length to it
        keys = table if self.max_seq_len is None else min(self.max_seq_len, table)
        return max(1, query), max(1, keys)

    def check_device(self, device) -> None:
        """Metadata that lives on a device lives on `device` (the call's), or a TypeError."""
        self._uploads.check_device(device)

    def backend_plan(self, key, build: Callable[[], Any]) -> Any:
        """A backend's own plan for this batch, built on first use and kept."""
        if key not in self._backend_plans:
            self._backend_plans[key] = build()
        return self._backend_plans[key]


def _check_contents(table: np.ndarray, lens: np.ndarray, starts: np.ndarray,
                    block_size: int, num_blocks: int, num_query_tokens: int | None,
                    starts_given: bool = True) -> None:
    """Every rule of the batch's contents, vectorised; ValueError naming the first break.
    starts_given: cu_seqlens_q came from the caller (else it is decode's one token each)."""
    if not starts_given and num_query_tokens is not None and starts[-1] != num_query_tokens:
        tokens = f"{num_query_tokens} query token{'' if num_query_tokens == 1 else 's'}"
        raise ValueError(f"{tokens} for {lens.size} sequences (seq_lens): "
                         "without cu_seqlens_q each sequence takes exactly one (decode); pass "
                         "cu_seqlens_q to give a sequence several")
    if starts[0] != 0 or np.any(np.diff(starts) < 0) or (
            num_query_tokens is not None and starts[-1] != num_query_tokens):
        expected = "" if num_query_tokens is None else f" ({num_query_tokens})"
        raise ValueError(f"cu_seqlens_q={starts.tolist()[:16]} must rise from 0 to the number of "
                         f"query tokens{expected}")
    query_lens = np.diff(starts)
    short = np.flatnonzero(lens < query_lens)
    if short.size:
        seq = int(short[0])
        raise ValueError(f"seq_lens[{seq}]={int(lens[seq])} is shorter than its "
                         f"{int(query_lens[seq])} new query tokens")
    capacity = table.shape[1] * block_size
    if lens.size and lens.max() > capacity:
        raise ValueError(f"seq_lens holds {int(lens.max())} tokens; block_table rows cover "
                         f"{capacity} ({table.shape[1]} blocks x {block_size})")
    pages_used = -(-lens.astype(np.int64) // block_size)
    used = np.arange(table.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        seq, column = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{seq}] refers to block {int(table[seq, column])} (column "
                         f"{column}); the cache has blocks 0..{num_blocks - 1}")


def _hint(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be a Python int (a bound known on the host) or None")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return int(value)


def _check_hints(max_query_len: int | None, max_seq_len: int | None, capacity: str, table_tokens: int) -> None:
    if max_seq_len is not None and max_seq_len > table_tokens:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds what block_table's rows cover: {capacity}")
    if max_query_len is not None and max_seq_len is not None and max_query_len > max_seq_len:
        raise ValueError(f"max_query_len={max_query_len} exceeds max_seq_len={max_seq_len}: a sequence's "
                         "new query tokens are among its keys")


def _check_promises(max_query_len: int | None, max_seq_len: int | None, query_lens: np.ndarray | None,
                    lens: np.ndarray | None) -> None:
    """The hints hold for the contents the host knows, or a ValueError names the first break."""
    if max_query_len is not None and query_lens is not None and query_lens.size and query_lens.max() > max_query_len:
        seq = int(np.argmax(query_lens))
        raise ValueError(f"max_query_len={max_query_len}, but sequence {seq} has {int(query_lens[seq])} new "
                         "query tokens (cu_seqlens_q)")
    if max_seq_len is not None and lens is not None and lens.size and lens.max() > max_seq_len:
        seq = int(np.argmax(lens))
        raise ValueError(f"max_seq_len={max_seq_len}, but seq_lens[{seq}]={int(lens[seq])}")


def plan_batch(*, block_table, seq_lens, cu_seqlens_q=None, block_size: int, num_blocks: int,
               num_query_tokens: int | None = None, max_query_len: int | None = None,
               max_seq_len: int | None = None, validate: bool = False, tuning=None) -> BatchPlan:
    """Check a batch's metadata once (module docstring's policy) and plan it.

    max_query_len / max_seq_len: Python ints no sequence's new query tokens /
    keys exceed (the module docstring's hints), for metadata on a device; None
    where unknown. `tuning`: the backend's tunables for this batch's plans (the
    CUDA backend's kvcupy.backends.cuda.tuning.Tuning); None takes its defaults."""
    lens = _index(seq_lens, "seq_lens", 1)
    num_seqs = lens.shape[0]
    table = _index(block_table, "block_table", 2)
    if table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {table.shape[0]} rows; expected one per sequence ({num_seqs})")
    if cu_seqlens_q is None:
        starts = Array(np.arange(num_seqs + 1, dtype=np.int32), np.dtype(np.int32), HOST, "numpy",
                       "cu_seqlens_q")
    else:
        starts = _index(cu_seqlens_q, "cu_seqlens_q", 1)
        if starts.shape != (num_seqs + 1,):
            raise ValueError(f"cu_seqlens_q has shape {starts.shape}; expected {(num_seqs + 1,)} "
                             "(num_seqs + 1 offsets)")
    max_query_len = _hint(max_query_len, "max_query_len")
    max_seq_len = _hint(max_seq_len, "max_seq_len")
    _check_hints(max_query_len, max_seq_len, f"{table.shape[1]} blocks x {block_size} = "
                 f"{table.shape[1] * block_size} tokens", table.shape[1] * block_size)
    named = {"block_table": table, "seq_lens": lens, "cu_seqlens_q": starts}
    devices = {a.device for a in named.values()} - {HOST}
    if len(devices) > 1:
        raise TypeError(f"block_table, seq_lens and cu_seqlens_q are on {sorted(map(str, devices))}; "
                        "expected one device (or the host)")

    on_host = all(a.device == HOST for a in named.values())
    host = None
    if on_host or validate:
        host = {name: np.ascontiguousarray(_to_host(a), dtype=np.int32) for name, a in named.items()}
        _check_contents(host["block_table"], host["seq_lens"], host["cu_seqlens_q"],
                        block_size, num_blocks, num_query_tokens, starts_given=cu_seqlens_q is not None)
    host_arrays = {name: host[name] for name, a in named.items() if a.device == HOST} if host else {
        name: np.ascontiguousarray(a.data, dtype=np.int32) for name, a in named.items() if a.device == HOST}
    device_arrays = {name: a for name, a in named.items() if a.device != HOST}
    # What the host knows of the contents (decode's one token each included), for the
    # promises' check and as the bounds where no hint was given.
    known = host if host is not None else host_arrays
    query_lens = np.diff(known["cu_seqlens_q"]) if "cu_seqlens_q" in known else None
    known_lens = known.get("seq_lens")
    _check_promises(max_query_len, max_seq_len, query_lens, known_lens)
    if max_query_len is None and query_lens is not None and query_lens.size:
        max_query_len = int(query_lens.max())
    if max_seq_len is None and known_lens is not None and known_lens.size:
        max_seq_len = int(known_lens.max())
    return BatchPlan(num_seqs, block_size, num_blocks, checked=host is not None, host=host,
                     _uploads=_Uploads(host_arrays, device_arrays), table_width=table.shape[1], tuning=tuning,
                     max_query_len=max_query_len, max_seq_len=max_seq_len)


@dataclass(eq=False)
class SlotMapping:
    """Where each written token goes: slot ids (block * block_size + offset; < 0
    skips the token), checked once (module docstring's policy)."""

    num_tokens: int
    checked: bool
    host: np.ndarray | None          # int64, when the contents are known
    _uploads: _Uploads
    _replays: dict = field(default_factory=dict)   # kvcupy.replay: recorded writes with these slots

    def on(self, backend, device):
        """The slot ids as `backend`'s int64 array on `device`."""
        return self._uploads.on(backend, device)["slot_mapping"]

    def check_device(self, device) -> None:
        """Slot ids that live on a device live on `device` (the call's), or a TypeError."""
        self._uploads.check_device(device)


def plan_slots(slot_mapping, *, num_slots: int, validate: bool = False) -> SlotMapping:
    slots = _index(slot_mapping, "slot_mapping", 1)
    host = None
    if slots.device == HOST or validate:
        host = np.ascontiguousarray(_to_host(slots), dtype=np.int64)
        valid = host[host >= 0]
        if valid.size and valid.max() >= num_slots:
            raise ValueError(f"slot_mapping holds slot {int(valid.max())}; the cache has "
                             f"{num_slots} slots")
        if np.unique(valid).size != valid.size:
            raise ValueError("slot_mapping writes one slot twice; each slot takes at most one token")
    if slots.device == HOST:
        uploads = _Uploads({"slot_mapping": host}, {})
    else:
        uploads = _Uploads({}, {"slot_mapping": slots})
    return SlotMapping(slots.shape[0], host is not None, host, uploads)
