"""PagedKVCache: hands out the pages of a multi-layer paged KV cache.

All layers share one page numbering, so one block table per sequence serves
every layer: page `p` of a sequence holds its positions `i*B .. i*B+B-1` in
every layer's cache. Pages carry reference counts: `fork` shares all of a
sequence's pages, and a shared page is copied the first time one of its
sequences appends into it (copy-on-write). Only a partly filled last page can
ever need the copy, because tokens are only ever appended.

Sequence ids are any hashable values (ints when the manager picks them). An id
the manager does not hold raises KeyError naming it; every other bad argument
raises TypeError / ValueError, as ops.py's do, and changes nothing. Attention
over a layer that reserved tokens were not yet written to raises RuntimeError:
it would read whatever those slots held before.
"""

from __future__ import annotations

import itertools
import numbers
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from . import formats, interop, ops
from .batch import BatchPlan, SlotMapping, plan_batch, plan_slots
from .decode_step import DecodeStep
from .kvcache import KVCache
from .rotation import RotationPlan


class CacheFullError(RuntimeError):
    """The cache has no free page for the tokens asked for; nothing was changed."""


@dataclass(frozen=True)
class CacheStats:
    """Page and byte accounting of a PagedKVCache.

    bytes: the allocated cache tensors of all layers (data and scales);
    bytes_per_token: what one token costs across all layers, K and V, scales included.
    """

    pages_total: int
    pages_used: int
    pages_free: int
    sequences: int
    tokens: int
    bytes: int
    bytes_per_token: int


@dataclass(eq=False)
class _Reservation:
    """Tokens one reserve() call handed out, and the layers not yet written with them."""

    slot_mapping: np.ndarray                       # what reserve() returned
    new_tokens: dict                               # seq_id -> tokens reserved for it
    unwritten_layers: set = field(default_factory=set)


def _tokens(count: int) -> str:
    return f"{count} token{'' if count == 1 else 's'}"


def _count(value, name: str, minimum: int = 0) -> int:
    """An int >= minimum (a token count, by default)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def _index(value, name: str, size: int) -> int:
    """An int in 0..size-1 (a layer or page number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is out of range; expected 0..{size - 1}")
    return int(value)


def _counts(value, name: str, num_seqs: int) -> list[int]:
    """One count per sequence, from an int (the same for all) or a sequence of ints."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return [_count(value, name)] * num_seqs
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name}={value!r} must be an int or one int per sequence")
    if len(value) != num_seqs:
        raise ValueError(f"{name} has {len(value)} entries; expected one per sequence ({num_seqs})")
    return [_count(v, f"{name}[{i}]") for i, v in enumerate(value)]


class PagedKVCache:
    """Pages, block tables and slot mappings of a `num_layers`-layer paged KV cache.

    `layers[i]` is layer i's KVCache (kvcupy.allocate_cache); `rotation` is the
    plan every layer shares. A sequence starts with add_sequence() and ends with
    free(); each step of a serving loop reserves its new tokens' slots once, then
    every layer writes their K/V and attends:

    >>> import numpy as np, kvcupy as kc
    >>> mgr = kc.PagedKVCache(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64)
    >>> seq_ids = [mgr.add_sequence(), mgr.add_sequence()]
    >>> rng = np.random.default_rng(0)
    >>> for num_new_tokens in (5, 1):              # a prompt of 5 tokens each, then a decode step
    ...     slot_mapping = mgr.reserve(seq_ids, num_new_tokens)
    ...     tokens = len(seq_ids) * num_new_tokens
    ...     for layer in range(mgr.num_layers):    # the model's K/V and query of this layer
    ...         key, value = rng.standard_normal((2, tokens, 2, 64)).astype(np.float16)
    ...         query = rng.standard_normal((tokens, 4, 64)).astype(np.float16)
    ...         mgr.write(layer, key, value, slot_mapping)
    ...         out = mgr.attention(layer, query, seq_ids, query_lens=num_new_tokens)
    >>> out.shape                                  # [tokens, query heads, head size]
    (2, 4, 64)
    >>> mgr
    PagedKVCache(num_layers=2, kv_dtype='int4_per_token_head', head_size=64, num_kv_heads=2,
                 block_size=16, pages=2/8 used, sequences=2, tokens=12, device=cpu,
                 rotation='64 = 64 x 1 (block-diagonal H_64), preset kvcupy')
    >>> mgr.free(seq_ids[0])

    On a GPU, write and attention run on the stream of their arrays (torch's
    current stream for torch tensors, ...: kvcupy.ops); reserve's copy-on-write
    copies run on the stream of the latest such call, so a loop that stays on
    one stream stays ordered.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, kv_dtype: str = "int4_per_token_head", device: str = "cpu",
                 rotation: RotationPlan | None = None, dtype="float16"):
        num_layers = _count(num_layers, "num_layers", minimum=1)
        first = ops.allocate_cache(num_blocks, block_size, num_kv_heads, head_size, kv_dtype,
                                   rotation, device, dtype)
        # Every layer gets the plan the first one resolved, so "None" (the KV
        # dtype's default) means one and the same rotation everywhere.
        self.layers: list[KVCache] = [first] + [
            ops.allocate_cache(num_blocks, block_size, num_kv_heads, head_size, kv_dtype,
                               first.rotation, device, dtype)
            for _ in range(num_layers - 1)]
        self.rotation: RotationPlan = first.rotation
        self.num_blocks = first.num_blocks
        self.block_size = first.block_size
        self._bytes_per_token = num_layers * formats.kv_dtype_info(kv_dtype).bytes_per_token(
            num_kv_heads, head_size, formats.model_dtype(dtype))
        # Popped from the end: pages go out in increasing order while none was freed.
        self._free_pages: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._ref_counts = [0] * self.num_blocks
        self._block_tables: dict[Hashable, list[int]] = {}
        self._seq_lens: dict[Hashable, int] = {}
        self._auto_ids = itertools.count()
        # The current step's checked metadata: slot mappings by the id of the array
        # reserve() returned (read-only, so its contents cannot change), and batch
        # plans by (sequences, query lengths). Any change to the pages clears both.
        self._step_slots: dict[int, tuple[np.ndarray, SlotMapping]] = {}
        self._step_batches: dict[tuple, BatchPlan] = {}
        # Reserved tokens some layer has not been written with: attention over that
        # layer would read stale slots, so it refuses until write() has run.
        self._unwritten: list[_Reservation] = []
        # Whose stream the copy-on-write copies in reserve() run on: that of the
        # latest write / attention call's arrays (torch's current stream for torch
        # callers), so that they are ordered with the kernels around them.
        self._stream = interop.CUPY_STREAM

    def __repr__(self) -> str:
        # One line: geometry, format and occupancy, never the tensors' contents.
        first = self.layers[0]
        rotation = self.rotation.describe() + (f", preset {self.rotation.preset}" if self.rotation.preset else "")
        stats = self.stats()
        return (f"PagedKVCache(num_layers={self.num_layers}, kv_dtype={first.kv_dtype!r}, "
                f"head_size={first.head_size}, num_kv_heads={first.num_kv_heads}, "
                f"block_size={self.block_size}, pages={stats.pages_used}/{stats.pages_total} used, "
                f"sequences={stats.sequences}, tokens={stats.tokens}, device={self.device}, "
                f"rotation={rotation!r})")

    @property
    def device(self) -> interop.Device:
        """Where every layer's cache lives."""
        return self.layers[0].device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # --- sequences ----------------------------------------------------------

    @property
    def sequences(self) -> tuple:
        """Ids of the live sequences, in the order they were added."""
        return tuple(self._seq_lens)

    def seq_len(self, seq_id) -> int:
        """Tokens reserved for the sequence so far."""
        return self._seq_lens[self._known(seq_id)]

    def block_table(self, seq_id) -> tuple[int, ...]:
        """The sequence's pages, in logical order."""
        return tuple(self._block_tables[self._known(seq_id)])

    def ref_count(self, page: int) -> int:
        """How many live sequences hold page `page` (0: it is free)."""
        return self._ref_counts[_index(page, "page", self.num_blocks)]

    def add_sequence(self, seq_id=None):
        """Start an empty sequence; returns its id (a fresh int when seq_id is None)."""
        if seq_id is None:
            seq_id = next(i for i in self._auto_ids if i not in self._seq_lens)
        self._check_new_id(seq_id)
        self._block_tables[seq_id] = []
        self._seq_lens[seq_id] = 0
        return seq_id

    def fork(self, seq_id, new_seq_id=None):
        """A new sequence with the same tokens, sharing all of `seq_id`'s pages."""
        pages = self.block_table(seq_id)
        new_seq_id = self.add_sequence(new_seq_id)
        self._new_step()
        self._block_tables[new_seq_id] = list(pages)
        self._seq_lens[new_seq_id] = self._seq_lens[seq_id]
        for page in pages:
            self._ref_counts[page] += 1
        for reservation in self._unwritten:   # the fork reads the same pages, written or not
            if seq_id in reservation.new_tokens:
                reservation.new_tokens[new_seq_id] = reservation.new_tokens[seq_id]
        return new_seq_id

    def free(self, seq_id) -> None:
        """End the sequence; pages no other sequence holds become free."""
        for page in self._block_tables.pop(self._known(seq_id)):
            self._release(page)
        self._new_step()
        del self._seq_lens[seq_id]
        for reservation in self._unwritten:
            reservation.new_tokens.pop(seq_id, None)
        self._unwritten = [r for r in self._unwritten if r.new_tokens]

    # --- pages --------------------------------------------------------------

    def reserve(self, seq_ids, num_new_tokens) -> np.ndarray:
        """Make room for each sequence's next tokens; returns their int64 slot_mapping.

        num_new_tokens is an int (the same for every sequence) or one int per
        sequence. The slots of each sequence's new tokens follow one another in
        seq_ids order, ready for `write`. All or nothing: when the free pages do
        not cover every sequence (copy-on-write copies included), raises
        CacheFullError and changes nothing. The lengths advance at once: write
        the tokens (`write`, every layer) before the next `attention` over these
        sequences: until then, attention over a layer not written raises RuntimeError.
        """
        seq_ids = self._distinct_known(seq_ids)
        counts = _counts(num_new_tokens, "num_new_tokens", len(seq_ids))
        needed = self._pages_needed(seq_ids, counts)
        if needed > len(self._free_pages):
            raise CacheFullError(
                f"reserving {sum(counts)} tokens for {len(seq_ids)} sequence(s) needs {needed} "
                f"free pages; {len(self._free_pages)} of {self.num_blocks} are free")
        self._new_step()
        copies: list[tuple[int, int]] = []
        slots = [self._append(seq_id, count, copies) for seq_id, count in zip(seq_ids, counts)]
        with interop.running_on(self.device, self._stream):
            ops.copy_blocks(self.layers, np.array(copies, np.int64).reshape(-1, 2))
        slot_mapping = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        slot_mapping.flags.writeable = False
        self._step_slots[id(slot_mapping)] = (slot_mapping, plan_slots(
            slot_mapping, num_slots=self.num_blocks * self.block_size))
        new_tokens = {seq_id: count for seq_id, count in zip(seq_ids, counts) if count}
        if new_tokens:
            self._unwritten.append(_Reservation(slot_mapping, new_tokens, set(range(self.num_layers))))
        return slot_mapping

    def _new_step(self) -> None:
        self._step_slots.clear()
        self._step_batches.clear()

    def _pages_needed(self, seq_ids: list, counts: list[int]) -> int:
        """New pages for the appends, plus one per copy-on-write copy they force."""
        new_pages = 0
        appends_into = Counter()   # shared partly filled page -> sequences appending to it
        for seq_id, count in zip(seq_ids, counts):
            new_len = self._seq_lens[seq_id] + count
            new_pages += self._pages_for(new_len) - len(self._block_tables[seq_id])
            page = self._shared_last_page(seq_id) if count else None
            if page is not None:
                appends_into[page] += 1
        # When every holder of a page appends to it, the last one keeps it uncopied.
        copies = sum(min(n, self._ref_counts[page] - 1) for page, n in appends_into.items())
        return new_pages + copies

    def _append(self, seq_id, count: int, copies: list) -> np.ndarray:
        """Grow one sequence by `count` tokens (pages known to be free); their slots.
        A shared last page is replaced by a private one; (shared, private) joins `copies`."""
        if count and self._shared_last_page(seq_id) is not None:
            copies.append(self._private_last_page(seq_id))
        start = self._seq_lens[seq_id]
        table = self._block_tables[seq_id]
        while len(table) < self._pages_for(start + count):
            table.append(self._take_page())
        self._seq_lens[seq_id] = start + count
        positions = np.arange(start, start + count)
        pages = np.asarray(table, np.int64)[positions // self.block_size]
        return pages * self.block_size + positions % self.block_size

    def _shared_last_page(self, seq_id) -> int | None:
        """The sequence's last page if it is partly filled and held by another sequence too."""
        table = self._block_tables[seq_id]
        if self._seq_lens[seq_id] % self.block_size == 0 or self._ref_counts[table[-1]] == 1:
            return None
        return table[-1]

    def _private_last_page(self, seq_id) -> tuple[int, int]:
        """Give the sequence a private page for its shared last page; the caller
        copies it in every layer. (shared, private)."""
        table = self._block_tables[seq_id]
        shared, private = table[-1], self._take_page()
        table[-1] = private
        self._release(shared)
        return shared, private

    def _take_page(self) -> int:
        page = self._free_pages.pop()
        self._ref_counts[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._ref_counts[page] -= 1
        if self._ref_counts[page] == 0:
            self._free_pages.append(page)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- kernels ------------------------------------------------------------

    def decode_step(self, max_batch: int, max_seq_len: int) -> DecodeStep:
        """A decode step of up to max_batch sequences, each at most max_seq_len tokens
        long, over metadata buffers that keep their addresses from step to step: what
        a CUDA graph of a whole step (every layer's write and attention) replays
        (kvcupy.decode_step). Build one per batch bucket."""
        return DecodeStep(self, _count(max_batch, "max_batch", minimum=1),
                          _count(max_seq_len, "max_seq_len", minimum=1))

    def _layer_cache(self, layer: int) -> KVCache:
        return self.layers[_index(layer, "layer", self.num_layers)]

    def write(self, layer: int, key, value, slot_mapping) -> None:
        """Quantize key/value [T, Hk, d] into layer `layer` at `slot_mapping` (from reserve:
        checked once then, whatever the number of layers)."""
        cache = self._layer_cache(layer)
        given = slot_mapping
        known = self._step_slots.get(id(slot_mapping))
        if known is not None and known[0] is slot_mapping:
            slot_mapping = known[1]
        ops.reshape_and_cache(key, value, cache, slot_mapping)
        self._stream = interop.stream_source(key)
        self._written(layer, given)

    def _written(self, layer: int, slot_mapping) -> None:
        """Layer `layer` now holds the tokens of the reservation that returned slot_mapping."""
        mine = [r for r in self._unwritten if r.slot_mapping is slot_mapping]
        # A slot mapping reserve() did not return (a device copy of one, say) cannot be
        # traced to its tokens: it counts as writing every pending reservation's, so a
        # correct loop never sees a false refusal.
        for reservation in mine or self._unwritten:
            reservation.unwritten_layers.discard(layer)
        self._unwritten = [r for r in self._unwritten if r.unwritten_layers]

    def attention(self, layer: int, query, seq_ids, *, query_lens=None,
                  softmax_scale: float | None = None, sliding_window: int | None = None,
                  softcap: float = 0.0, sinks=None, out=None):
        """kvcupy.paged_attention of the sequences' newest tokens over layer `layer`.

        query [T, Hq, d] holds query_lens[i] tokens of seq_ids[i], back to back:
        the last query_lens[i] positions of that sequence (None: one each, decode).
        Raises RuntimeError when tokens reserve() gave these sequences have not
        been written to this layer yet.
        """
        cache = self._layer_cache(layer)
        if not isinstance(seq_ids, (list, tuple, str, bytes)) and hasattr(seq_ids, "__iter__"):
            seq_ids = list(seq_ids)   # read twice below
        batch = self.plan(seq_ids, query_lens)
        self._check_written(layer, seq_ids)
        shape = getattr(query, "shape", None)   # ops.paged_attention checks the rest of query
        if shape is not None and len(shape) == 3 and shape[0] != batch.num_query_tokens:
            asked = ("query_lens=None (one each, decode)" if query_lens is None
                     else f"query_lens={query_lens!r}")
            raise ValueError(f"query has {_tokens(shape[0])}; {asked} asks {batch.num_query_tokens} "
                             f"for the {len(seq_ids)} sequence(s) of seq_ids")
        out = ops.paged_attention(query, cache, batch=batch,
                                  softmax_scale=softmax_scale, sliding_window=sliding_window,
                                  softcap=softcap, sinks=sinks, out=out)
        self._stream = interop.stream_source(query)
        return out

    def plan(self, seq_ids, query_lens=None) -> BatchPlan:
        """The checked metadata of attention over these sequences' newest tokens:
        built once per step (until the pages change) and shared by every layer.
        Its max_query_len / max_seq_len hold the longest query run and sequence."""
        key = (tuple(seq_ids) if isinstance(seq_ids, (list, tuple)) else None,
               query_lens if query_lens is None or isinstance(query_lens, int) else tuple(query_lens))
        try:
            if key[0] is not None and key in self._step_batches:
                return self._step_batches[key]
        except TypeError:   # an unhashable id: _distinct_known names it below
            key = (None, None)
        seq_ids = self._distinct_known(seq_ids)
        query_lens = _counts(1 if query_lens is None else query_lens, "query_lens", len(seq_ids))
        for seq_id, query_len in zip(seq_ids, query_lens):
            if query_len > self._seq_lens[seq_id]:
                raise ValueError(f"query_lens asks {query_len} query tokens of sequence "
                                 f"{seq_id!r}, which has {self._seq_lens[seq_id]} tokens")
        cu_seqlens_q = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)]).astype(np.int32)
        seq_lens = np.array([self._seq_lens[s] for s in seq_ids], np.int32)
        # The manager knows every length on the host: the bounds go with the plan
        # (plan_batch checks them against the arrays) whatever device takes it.
        batch = plan_batch(block_table=self._batch_block_table(seq_ids), seq_lens=seq_lens,
                           cu_seqlens_q=cu_seqlens_q, block_size=self.block_size,
                           num_blocks=self.num_blocks, max_query_len=max(query_lens, default=0) or None,
                           max_seq_len=int(seq_lens.max(initial=0)) or None)
        if key[0] is not None:
            self._step_batches[key] = batch
        return batch

    def _batch_block_table(self, seq_ids: list) -> np.ndarray:
        """[S, max pages] int32. Unused entries hold page 0, a real page, so a
        kernel that loads a table entry past a sequence's end still reads inside
        the cache (it never uses what it reads there)."""
        width = max([len(self._block_tables[s]) for s in seq_ids], default=0)
        table = np.zeros((len(seq_ids), max(width, 1)), np.int32)
        for row, seq_id in enumerate(seq_ids):
            pages = self._block_tables[seq_id]
            table[row, :len(pages)] = pages
        return table

    # --- accounting ---------------------------------------------------------

    def stats(self) -> CacheStats:
        pages_free = len(self._free_pages)
        return CacheStats(
            pages_total=self.num_blocks,
            pages_used=self.num_blocks - pages_free,
            pages_free=pages_free,
            sequences=len(self._seq_lens),
            tokens=sum(self._seq_lens.values()),
            bytes=sum(int(t.nbytes) for layer in self.layers for t in layer.tensors()),
            bytes_per_token=self._bytes_per_token,
        )

    # --- argument checks ----------------------------------------------------

    def _check_written(self, layer: int, seq_ids) -> None:
        for reservation in self._unwritten:
            if layer not in reservation.unwritten_layers:
                continue
            for seq_id in seq_ids:
                if seq_id in reservation.new_tokens:
                    raise RuntimeError(
                        f"layer {layer} does not hold the {_tokens(reservation.new_tokens[seq_id])} "
                        f"reserve() gave sequence {seq_id!r} yet: call write({layer}, key, value, "
                        "slot_mapping) with reserve()'s slot_mapping before attention over it")

    def _known(self, seq_id):
        if not isinstance(seq_id, Hashable) or seq_id not in self._seq_lens:
            raise KeyError(f"seq_id={seq_id!r} is not a live sequence of this cache")
        return seq_id

    def _check_new_id(self, seq_id) -> None:
        if not isinstance(seq_id, Hashable):
            raise TypeError(f"seq_id={seq_id!r} must be hashable (an int or a str, say)")
        if seq_id in self._seq_lens:
            raise ValueError(f"seq_id={seq_id!r} is already a live sequence")

    def _distinct_known(self, seq_ids) -> list:
        """seq_ids as a list of live ids, each at most once."""
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids={seq_ids!r} must be a list of sequence ids")
        seq_ids = [self._known(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            repeated = next(s for s, n in Counter(seq_ids).items() if n > 1)
            raise ValueError(f"seq_ids lists sequence {repeated!r} more than once")
        return seq_ids
