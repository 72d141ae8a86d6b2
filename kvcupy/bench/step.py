"""The step group on the GPU (`--groups step`): one decode step of a whole model's
attention, as a serving loop issues it, one call a step.

- kvcupy eager: the step's metadata on the host, as PagedKVCache builds it,
  planned once (`plan_batch`, `plan_slots`); then in each layer
  `reshape_and_cache` of the new token and `paged_attention` with `out=`.
- kvcupy graphed: the same layers over device metadata, planned and run once,
  then captured whole in one torch CUDA graph (docs/design.md, "CUDA graphs");
  a call copies the step's lengths and slot ids into those buffers in place
  and replays. "no writes": the same without the writes, to weigh them.
- torch dense bf16, eager and graphed: in each layer `index_copy_` of the new
  token into [batch, kv_heads, seq_len, d] K and V, then
  `scaled_dot_product_attention`.
- FlashInfer's paged decode over bf16 and fp8 pages, where flashinfer imports.

Every layer has its own cache where all fit (accounting.step_fit); the new
token of each sequence is its last, at position seq_len - 1.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import kvcupy

from . import accounting
from .run import PeerSkipped, _error_text
from .shapes import BLOCK_SIZE, Case, Group, StepShape, step_storage

SEED = 0
FLASHINFER_WORKSPACE_BYTES = 128 << 20
# Untimed steps on a side stream before a capture, as torch asks: kernels load, plans upload.
CAPTURE_WARMUP_STEPS = 2


@dataclass(frozen=True)
class StepMetadata:
    """A step's batch as an engine's page allocator leaves it: each sequence's pages
    shuffled over the cache, its new token's slot at position seq_len - 1."""

    block_table: np.ndarray     # [S, pages] int32
    seq_lens: np.ndarray        # [S] int32
    slots: np.ndarray           # [S] int64
    num_blocks: int


def step_metadata(shape: StepShape) -> StepMetadata:
    pages = math.ceil(shape.seq_len / BLOCK_SIZE)
    num_blocks = shape.num_seqs * pages
    table = np.random.default_rng(SEED).permutation(num_blocks).astype(np.int32).reshape(shape.num_seqs, pages)
    position = shape.seq_len - 1
    slots = table[:, position // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + position % BLOCK_SIZE
    return StepMetadata(table, np.full(shape.num_seqs, shape.seq_len, np.int32), slots, num_blocks)


@dataclass
class _InputSet:
    """One input set: its distinct caches (layer i runs on caches[i % len]) and every
    layer's new K and V [S, Hk, d], query and output [S, Hq, d], stacked by layer."""

    caches: list
    keys: Any
    values: Any
    queries: Any
    outs: Any


@dataclass
class _Storage:
    fit: accounting.StepFit
    sets: list[_InputSet]


@dataclass
class _GraphedStep:
    """A step call: before_replay, then one replay of graph. It holds body, what graph
    captured: a graph keeps only the memory allocated while it was captured, not the
    buffers body reads (plans, workspaces, block tables), which would otherwise be freed
    and reused under it."""

    graph: Any
    body: Callable[[], None]
    before_replay: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.before_replay is not None:
            self.before_replay()
        self.graph.replay()


class StepBuilder:
    """Builds the step cases on the current CUDA device; the caches of one
    implementation and KV dtype (shapes.step_storage) are made by its first case
    and shared by the others until `clear`."""

    def __init__(self, torch, torch_reason: str | None, model_dtype: np.dtype, memory_bytes: int, l2_bytes: int):
        self.torch, self.torch_reason = torch, torch_reason
        self.model_dtype, self.memory_bytes, self.l2_bytes = model_dtype, memory_bytes, l2_bytes
        self._storage: dict[tuple, _Storage] = {}
        self._refused: dict[tuple, str] = {}

    def build(self, group: Group, case: Case, sets: int) -> tuple[list[Callable[[], Any]], dict]:
        if self.torch is None:   # graphs, the dense peer and the bf16 inputs are torch's
            raise PeerSkipped(self.torch_reason)
        flashinfer = self._flashinfer() if case.impl == "flashinfer" else None
        shape, meta = group.shape, step_metadata(group.shape)
        storage = self._storage_for(shape, case, sets, meta)
        used = storage.sets[:sets]
        if case.impl == "kvcupy":
            calls, info = self._kvcupy(shape, case, used, meta)
        elif case.impl == "dense":
            calls, info = self._dense(shape, case, used)
        else:
            calls, info = self._flashinfer_calls(flashinfer, shape, case, used, meta)
        fit = storage.fit
        return calls, {**info, "layer_caches": fit.layer_caches, "memory_bytes": fit.needed_bytes,
                       "layers_share_caches": fit.reason}

    def clear(self) -> None:
        self._storage.clear()
        self._refused.clear()
        gc.collect()   # graphs and closures hold device memory until collected

    # Storage: caches and inputs.

    def _storage_for(self, shape: StepShape, case: Case, sets: int, meta: StepMetadata) -> _Storage:
        key = step_storage(case)
        if key in self._refused:
            raise PeerSkipped(self._refused[key])
        if key not in self._storage:
            sized = dataclasses.replace(case, writes=True)   # every case of a storage holds the same
            fit = accounting.step_fit(shape, sized, self.model_dtype, sets, self.memory_bytes, self.l2_bytes)
            if fit.layer_caches == 0:
                self._refused[key] = fit.reason
                raise PeerSkipped(fit.reason)
            self._storage[key] = _Storage(fit, [self._input_set(shape, case, fit.layer_caches, meta, index)
                                                for index in range(sets)])
        return self._storage[key]

    def _randn(self, shape: tuple, seed: int):
        torch = self.torch
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    def _input_set(self, shape: StepShape, case: Case, num_caches: int, meta: StepMetadata, index: int) -> _InputSet:
        seed = SEED + 1000 * index
        if case.impl == "kvcupy":
            caches = self._paged_caches(shape, case.kv_dtype, num_caches, meta, seed)
        elif case.impl == "dense":
            caches = self._dense_caches(shape, num_caches, seed)
        else:
            caches = self._flashinfer_caches(shape, case.kv_dtype, num_caches, meta, seed)
        S, L = shape.num_seqs, shape.num_layers
        kv_shape, q_shape = (L, S, shape.num_kv_heads, shape.head_size), (L, S, shape.num_heads, shape.head_size)
        queries = self._randn(q_shape, seed + 3)
        return _InputSet(caches, self._randn(kv_shape, seed + 1), self._randn(kv_shape, seed + 2), queries,
                         self.torch.empty_like(queries))

    def _paged_caches(self, shape: StepShape, kv_dtype: str, count: int, meta: StepMetadata, seed: int) -> list:
        torch = self.torch
        caches = []
        for _ in range(count):
            cache = kvcupy.allocate_cache(meta.num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_size,
                                          kv_dtype=kv_dtype, device="cuda", dtype=self.model_dtype.name)
            # Torch views of the same memory: every argument of a call from one framework,
            # whose current stream (the capture's, under torch.cuda.graph) the calls take.
            caches.append(kvcupy.wrap_cache(*(torch.from_dlpack(t) for t in cache.tensors()),
                                            kv_dtype=kv_dtype, rotation=cache.rotation))
        positions = np.arange(shape.seq_len)
        for seq in range(shape.num_seqs):   # one sequence's tokens at a time bounds the temporaries
            row = meta.block_table[seq]
            slots = kvcupy.plan_slots(row[positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                                      + positions % BLOCK_SIZE, num_slots=meta.num_blocks * BLOCK_SIZE)
            kv_shape = (shape.seq_len, shape.num_kv_heads, shape.head_size)
            key, value = self._randn(kv_shape, seed + 2 * seq + 10), self._randn(kv_shape, seed + 2 * seq + 11)
            for cache in caches:
                kvcupy.reshape_and_cache(key, value, cache, slots)
        return caches

    def _dense_caches(self, shape: StepShape, count: int, seed: int) -> list:
        torch = self.torch
        generator = torch.Generator(device="cuda").manual_seed(seed)
        dims = (shape.num_seqs, shape.num_kv_heads, shape.seq_len, shape.head_size)
        return [tuple(torch.empty(dims, device="cuda", dtype=torch.bfloat16).normal_(generator=generator)
                      for _ in range(2)) for _ in range(count)]

    def _flashinfer_caches(self, shape: StepShape, kv: str, count: int, meta: StepMetadata, seed: int) -> list:
        torch = self.torch
        generator = torch.Generator(device="cuda").manual_seed(seed)
        dims = (meta.num_blocks, 2, BLOCK_SIZE, shape.num_kv_heads, shape.head_size)   # FlashInfer's NHD pages
        caches = []
        for _ in range(count):
            if kv == "bf16":
                caches.append(torch.empty(dims, device="cuda", dtype=torch.bfloat16).normal_(generator=generator))
            else:
                pages = torch.empty(dims, device="cuda", dtype=torch.float8_e4m3fn)
                # Bytes below 0x58: finite positive e4m3 values under 16, none of them NaN.
                pages.view(torch.uint8).random_(0, 0x58, generator=generator)
                caches.append(pages)
        return caches

    # The step calls.

    def _graph(self, body: Callable[[], None], before_replay: Callable[[], None] | None = None) -> _GraphedStep:
        """body captured in a torch CUDA graph, after warm-up steps on a side stream."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_STEPS):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return _GraphedStep(graph, body, before_replay)

    def _kvcupy(self, shape: StepShape, case: Case, sets: list[_InputSet], meta: StepMetadata) -> tuple[list, dict]:
        torch, layers = self.torch, shape.num_layers
        num_slots = meta.num_blocks * BLOCK_SIZE

        def layers_of(data: _InputSet, batch, slots) -> None:
            for layer in range(layers):
                cache = data.caches[layer % len(data.caches)]
                if case.writes:
                    kvcupy.reshape_and_cache(data.keys[layer], data.values[layer], cache, slots)
                kvcupy.paged_attention(data.queries[layer], cache, batch=batch, out=data.outs[layer])

        if not case.graphed:
            def eager_step(data: _InputSet) -> None:
                batch = kvcupy.plan_batch(block_table=meta.block_table, seq_lens=meta.seq_lens,
                                          block_size=BLOCK_SIZE, num_blocks=meta.num_blocks,
                                          num_query_tokens=shape.num_seqs)
                layers_of(data, batch, kvcupy.plan_slots(meta.slots, num_slots=num_slots))

            return ([functools.partial(eager_step, data) for data in sets],
                    {"metadata": "on the host, planned every step"})
        # The buffers an engine rewrites between replays; the plan's bounds hold for every replay.
        table = torch.from_numpy(meta.block_table).cuda()
        lens, slot_ids = torch.from_numpy(meta.seq_lens).cuda(), torch.from_numpy(meta.slots).cuda()
        lens_source, slots_source = (torch.from_numpy(a).pin_memory() for a in (meta.seq_lens, meta.slots))
        batch = kvcupy.plan_batch(block_table=table, seq_lens=lens, block_size=BLOCK_SIZE, num_blocks=meta.num_blocks,
                                  num_query_tokens=shape.num_seqs, max_query_len=1, max_seq_len=shape.seq_len)
        slots = kvcupy.plan_slots(slot_ids, num_slots=num_slots)

        def refill() -> None:
            lens.copy_(lens_source, non_blocking=True)
            slot_ids.copy_(slots_source, non_blocking=True)

        return ([self._graph(functools.partial(layers_of, data, batch, slots), refill) for data in sets],
                {"metadata": "on the device, lengths and slot ids copied in before each replay"})

    def _dense(self, shape: StepShape, case: Case, sets: list[_InputSet]) -> tuple[list, dict]:
        torch = self.torch
        attend = torch.nn.functional.scaled_dot_product_attention
        S, Hk, d = shape.num_seqs, shape.num_kv_heads, shape.head_size
        group = shape.num_heads // Hk
        position = torch.full((1,), shape.seq_len - 1, dtype=torch.int64, device="cuda")
        position_source = position.cpu().pin_memory()

        def step(data: _InputSet) -> None:
            for layer in range(shape.num_layers):
                keys, values = data.caches[layer % len(data.caches)]
                if case.writes:
                    keys.index_copy_(2, position, data.keys[layer].unsqueeze(2))
                    values.index_copy_(2, position, data.values[layer].unsqueeze(2))
                # GQA folded into the query length: a KV head's query heads become its query
                # rows [S, Hk, group, d], so K/V are read once a KV head and any SDPA backend
                # takes it. Repeating KV heads reads group x the bytes (or keeps group x the
                # cache), and enable_gqa limits the backends; the decode group's SDPA does the same.
                attend(data.queries[layer].view(S, Hk, group, d), keys, values)

        info = {"gqa": "folded into the query length"}
        if not case.graphed:
            return [functools.partial(step, data) for data in sets], info

        def refill() -> None:
            position.copy_(position_source, non_blocking=True)

        return [self._graph(functools.partial(step, data), refill) for data in sets], info

    def _flashinfer(self):
        try:
            return importlib.import_module("flashinfer")
        except Exception as error:   # ImportError, or a build that fails as it loads
            raise PeerSkipped(f"flashinfer cannot be imported: {_error_text(error)}") from None

    def _flashinfer_calls(self, flashinfer, shape: StepShape, case: Case, sets: list[_InputSet],
                          meta: StepMetadata) -> tuple[list, dict]:
        torch = self.torch
        S = shape.num_seqs
        kv_type = torch.bfloat16 if case.kv_dtype == "bf16" else torch.float8_e4m3fn
        pages = meta.block_table.shape[1]
        indptr = torch.arange(S + 1, dtype=torch.int32, device="cuda") * pages
        indices = torch.from_numpy(meta.block_table.ravel()).cuda()
        last_page_len = torch.full((S,), (shape.seq_len - 1) % BLOCK_SIZE + 1, dtype=torch.int32, device="cuda")
        write, writer = self._flashinfer_writer(flashinfer, shape, kv_type, meta, (indices, indptr, last_page_len),
                                                sets[0])
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        buffers = dict(paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                       paged_kv_last_page_len_buffer=last_page_len) if case.graphed else {}
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=bool(case.graphed),
                                                                **buffers)

        def plan() -> None:
            wrapper.plan(indptr, indices, last_page_len, shape.num_heads, shape.num_kv_heads, shape.head_size,
                         BLOCK_SIZE, q_data_type=torch.bfloat16, kv_data_type=kv_type)

        def layers_of(data: _InputSet) -> None:
            for layer in range(shape.num_layers):
                cache = data.caches[layer % len(data.caches)]
                if case.writes:
                    write(cache, data.keys[layer], data.values[layer])
                wrapper.run(data.queries[layer], cache, out=data.outs[layer])

        info = {"flashinfer": getattr(flashinfer, "__version__", None), "write": writer}
        if not case.graphed:
            def eager_step(data: _InputSet) -> None:
                plan()
                layers_of(data)

            return [functools.partial(eager_step, data) for data in sets], info
        plan()
        return [self._graph(functools.partial(layers_of, data)) for data in sets], info

    def _flashinfer_writer(self, flashinfer, shape: StepShape, kv_type, meta: StepMetadata, page_metadata: tuple,
                           probe: _InputSet) -> tuple[Callable, str]:
        """The step's write of each sequence's new token into FlashInfer's pages, and what
        it is: FlashInfer's append_paged_kv_cache, or, for a head size its page module
        does not take (d = 96), torch's index_put_ into the same pages (the write an
        engine serving such a model brings). The probe is one append, into the first
        input set's first cache, of the token the step writes there anyway."""
        torch = self.torch
        S = shape.num_seqs
        indices, indptr, last_page_len = page_metadata
        batch_indices = torch.arange(S, dtype=torch.int32, device="cuda")
        positions = torch.full((S,), shape.seq_len - 1, dtype=torch.int32, device="cuda")

        def append(cache, keys, values) -> None:
            flashinfer.page.append_paged_kv_cache(keys.to(kv_type), values.to(kv_type), batch_indices, positions,
                                                  cache, indices, indptr, last_page_len, kv_layout="NHD")

        try:
            append(probe.caches[0], probe.keys[0], probe.values[0])
        except RuntimeError as error:   # raised as it dispatches, before any launch
            write = page_token_writer(torch, kv_type, meta.block_table, shape.seq_len - 1, "cuda")
            return write, f"torch index_put_ (append_paged_kv_cache: {_error_text(error)})"
        return append, "flashinfer append_paged_kv_cache"


def page_token_writer(torch, kv_type, block_table: np.ndarray, position: int, device: str) -> Callable:
    """write(cache, keys, values): each sequence's K and V [S, Hk, d] at token `position`
    into FlashInfer's NHD pages [blocks, 2, BLOCK_SIZE, Hk, d] of dtype kv_type, by torch
    indexing through block_table, on the values' bits (index_put_ takes every integer
    dtype, not every float8 one)."""
    pages = torch.from_numpy(block_table[:, position // BLOCK_SIZE].astype(np.int64)).to(device)
    offset = position % BLOCK_SIZE
    bits = {1: torch.uint8, 2: torch.int16}[kv_type.itemsize]

    def write(cache, keys, values) -> None:
        raw = cache.view(bits)
        raw[pages, 0, offset] = keys.to(kv_type).view(bits)
        raw[pages, 1, offset] = values.to(kv_type).view(bits)

    return write
