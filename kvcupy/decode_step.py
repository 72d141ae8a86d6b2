"""DecodeStep: a PagedKVCache's decode step over metadata buffers that stay put.

A CUDA graph replays the launches it captured with the arguments they had,
so the block table, lengths and slot ids a captured step reads must live in
the same device buffers at every replay, rewritten in place between them.
A DecodeStep owns those buffers for a batch bucket (up to `max_batch`
sequences, each at most `max_seq_len` tokens long) and the plans built over
them once (`batch`, `slots`); `begin` reserves one token for each sequence
of the step and writes their metadata into the buffers; `write` and
`attention` are a layer's two calls, which a graph captures:

    step = mgr.decode_step(max_batch=32, max_seq_len=8192)
    step.begin(seq_ids)
    run_layers(step)                     # step.write / step.attention per layer: plans, compiles
    with torch.cuda.graph(graph):
        run_layers(step)
    for each later step:
        step.begin(seq_ids)              # the buffers, in place, on the current stream
        (the model's inputs into the captured tensors), graph.replay()

Rows past the step's sequences are padding: their writes go nowhere (slot
-1), their attention reads one token of page 0 and their output is
unspecified. On the CPU the same calls run eagerly (no graphs there), with
the plans rebuilt by each `begin`.
"""

from __future__ import annotations

import numpy as np

from . import backends, interop, ops
from .batch import BatchPlan, SlotMapping, plan_batch, plan_slots

# What a padding row's slot id is: a write skips it.
PADDING_SLOT = -1


class DecodeStep:
    """One new token for each of up to `max_batch` sequences of `manager`, every
    layer, over metadata buffers that keep their addresses: built by
    `PagedKVCache.decode_step` (module docstring)."""

    def __init__(self, manager, max_batch: int, max_seq_len: int):
        """manager: the PagedKVCache; max_batch and max_seq_len as it checked them."""
        self.manager = manager
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.table_width = -(-self.max_seq_len // manager.block_size)
        if self.table_width > manager.num_blocks:
            raise ValueError(f"max_seq_len={max_seq_len} needs {self.table_width} pages of "
                             f"{manager.block_size} tokens; the cache has {manager.num_blocks}")
        self.seq_ids: list = []
        self._unwritten_layers: set[int] = set()
        device = manager.device
        if device.kind == "cpu":
            self._buffers = self._padding()
        else:
            backend = backends.for_device(device)
            with interop.running_on(device, manager._stream):
                self._buffers = {name: backend.upload(array, device) for name, array in self._padding().items()}
        self._plan()   # on a GPU once: the plans read the buffers, whose contents begin() rewrites

    @property
    def batch(self) -> BatchPlan:
        """The attention metadata every layer's call takes (the buffers, with the bounds)."""
        return self._batch

    @property
    def slots(self) -> SlotMapping:
        """The slot ids every layer's write takes (the buffer)."""
        return self._slots

    def _padding(self) -> dict[str, np.ndarray]:
        """Host metadata of a step of padding rows only."""
        return {"block_table": np.zeros((self.max_batch, self.table_width), np.int32),
                "seq_lens": np.ones(self.max_batch, np.int32),
                "slot_mapping": np.full(self.max_batch, PADDING_SLOT, np.int64)}

    def _plan(self) -> None:
        manager = self.manager
        self._batch = plan_batch(block_table=self._buffers["block_table"], seq_lens=self._buffers["seq_lens"],
                                 block_size=manager.block_size, num_blocks=manager.num_blocks,
                                 max_query_len=1, max_seq_len=self.max_seq_len)
        self._slots = plan_slots(self._buffers["slot_mapping"], num_slots=manager.num_blocks * manager.block_size)

    def begin(self, seq_ids) -> np.ndarray:
        """Reserve the next token of each of `seq_ids` (PagedKVCache.reserve) and write
        the step's block table, lengths and slot ids into the buffers, on the stream
        of the manager's latest call; returns reserve()'s slot_mapping. Row i of the
        step's key, value, query and out is seq_ids[i]'s. Checks first and changes
        nothing where a sequence would pass max_seq_len or the batch max_batch."""
        manager = self.manager
        seq_ids = manager._distinct_known(seq_ids)
        if not seq_ids:
            raise ValueError("seq_ids is empty; a step serves at least one sequence")
        if len(seq_ids) > self.max_batch:
            raise ValueError(f"seq_ids holds {len(seq_ids)} sequences; this step takes at most "
                             f"max_batch={self.max_batch}")
        for seq_id in seq_ids:
            if manager.seq_len(seq_id) + 1 > self.max_seq_len:
                raise ValueError(f"sequence {seq_id!r} would reach {manager.seq_len(seq_id) + 1} tokens; "
                                 f"this step was built for max_seq_len={self.max_seq_len}")
        slot_mapping = manager.reserve(seq_ids, 1)
        host = self._padding()
        for row, seq_id in enumerate(seq_ids):
            pages = manager.block_table(seq_id)
            host["block_table"][row, :len(pages)] = pages
            host["seq_lens"][row] = manager.seq_len(seq_id)
        host["slot_mapping"][:len(seq_ids)] = slot_mapping
        self._fill(host)
        # This step tracks which layers hold the new tokens (write below); a
        # replayed graph writes them all without Python seeing it.
        for layer in range(manager.num_layers):
            manager._written(layer, slot_mapping)
        self._unwritten_layers = set(range(manager.num_layers))
        self.seq_ids = seq_ids
        return slot_mapping

    def _fill(self, host: dict[str, np.ndarray]) -> None:
        device = self.manager.device
        if device.kind == "cpu":
            for name, array in host.items():
                self._buffers[name][...] = array
            self._plan()   # a host plan holds the contents it checked
            return
        backend = backends.for_device(device)
        with interop.running_on(device, self.manager._stream):
            for name, array in host.items():
                backend.upload_into(self._buffers[name], array)

    def write(self, layer: int, key, value) -> None:
        """Layer `layer`'s new K/V [max_batch, Hk, d] into its cache (rows past the
        step's sequences are skipped)."""
        cache = self.manager._layer_cache(layer)
        ops.reshape_and_cache(key, value, cache, self._slots)
        self.manager._stream = interop.stream_source(key)
        self._unwritten_layers.discard(layer)

    def attention(self, layer: int, query, *, softmax_scale: float | None = None,
                  sliding_window: int | None = None, softcap: float = 0.0, sinks=None, out=None):
        """kvcupy.paged_attention of query [max_batch, Hq, d] over layer `layer`: row i
        is the step's sequence i (rows past them: unspecified). Raises RuntimeError
        when no begin() came first or this step's tokens are not written to the layer."""
        cache = self.manager._layer_cache(layer)
        if not self.seq_ids:
            raise RuntimeError("call begin(seq_ids) before the step's attention")
        if layer in self._unwritten_layers:
            raise RuntimeError(f"layer {layer} does not hold this step's tokens yet: call "
                               f"write({layer}, key, value) before attention over it")
        out = ops.paged_attention(query, cache, batch=self._batch,
                                  softmax_scale=softmax_scale, sliding_window=sliding_window,
                                  softcap=softcap, sinks=sinks, out=out)
        self.manager._stream = interop.stream_source(query)
        return out
