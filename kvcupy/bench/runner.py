"""The CUDA runner: builds each case of a group on the current device (kvcupy,
torch SDPA, a copy, the streaming kernel) and times it with CUDA events,
queued behind hold_stream."""

from __future__ import annotations

import functools
import importlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import kvcupy

from .. import formats
from . import kernels
from .accounting import case_bytes
from .run import PeerSkipped, Timing, _error_text
from .shapes import BLOCK_SIZE, Case, Group, RotateShape, Shape, WriteShape
from .step import StepBuilder

SEED = 0
# The hold ahead of a series lasts HOLD_MARGIN x the host time to issue it, within these bounds.
HOLD_MARGIN = 2.0
MIN_HOLD_S, MAX_HOLD_S = 1e-3, 0.2
HOST_PROBE_CALLS = 3


def hold_seconds(series_host_s: float) -> float:
    """How long hold_stream sleeps ahead of a series that takes the host series_host_s to issue."""
    return min(MAX_HOLD_S, max(MIN_HOLD_S, HOLD_MARGIN * series_host_s))



class _Tensors:
    """Model-dtype tensors on the GPU: torch bf16 when torch is here (CuPy has
    no bfloat16), else CuPy float16."""

    def __init__(self, cupy, torch):
        self.cupy, self.torch = cupy, torch
        self.dtype = formats.MODEL_DTYPES["bfloat16" if torch is not None else "float16"]

    def randn(self, shape: tuple, seed: int):
        if self.torch is not None:
            generator = self.torch.Generator(device="cuda").manual_seed(seed)
            return self.torch.randn(shape, generator=generator, device="cuda", dtype=self.torch.bfloat16)
        rng = self.cupy.random.default_rng(seed)
        return rng.standard_normal(shape, dtype=self.cupy.float32).astype(self.cupy.float16)

    def tokens(self, x):
        """[S, H, L, d] -> a contiguous [S * L, H, d]."""
        S, H, L, d = x.shape
        if self.torch is not None:
            return x.transpose(1, 2).reshape(S * L, H, d).contiguous()
        return self.cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(S * L, H, d)

    def copy(self, x):
        return x.clone() if self.torch is not None else x.copy()

    def on_device(self, array: np.ndarray):
        """A host array on the GPU, in the framework the tensors come from."""
        return self.torch.as_tensor(array, device="cuda") if self.torch is not None else self.cupy.asarray(array)

    def empty_like(self, x):
        return self.torch.empty_like(x) if self.torch is not None else self.cupy.empty_like(x)


@dataclass
class _AttentionData:
    """One attention group's inputs: dense K/V [S, Hk, L, d], query [S, Hq, Lq, d],
    a block table of shuffled pages and its batch plan."""

    key: Any
    value: Any
    query: Any
    block_table: np.ndarray     # [S, pages per sequence] int32
    num_blocks: int
    batch: Any                  # kvcupy.BatchPlan


class CudaRunner:
    """Builds and times the cases on the current CUDA device."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.torch, self.torch_reason = self._import_torch()
        self.tensors = _Tensors(cupy, self.torch)
        self.model_dtype = self.tensors.dtype
        device = cupy.cuda.Device()
        self.properties = cupy.cuda.runtime.getDeviceProperties(device.id)
        self.l2_bytes = int(self.properties["l2CacheSize"])
        self.memory_bytes = int(self.properties["totalGlobalMem"])
        self.stream = cupy.cuda.get_current_stream()
        if self.torch is not None and self.torch.cuda.current_stream().cuda_stream != self.stream.ptr:
            raise RuntimeError("torch's current CUDA stream is not CuPy's; the bench times every peer "
                               "on one stream (leave both on the default stream)")
        self.hold = kernels.get_function("hold_stream", "hold_stream", {})
        self._attention: _AttentionData | None = None
        self._caches: dict[str, list] = {}      # kv_dtype -> the group's caches, one per input set
        self._written: set[int] = set()         # ids of those caches written
        self._step = StepBuilder(self.torch, self.torch_reason, self.model_dtype, self.memory_bytes, self.l2_bytes)

    @staticmethod
    def _import_torch():
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            return None, "torch is not installed"
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} sees no CUDA device"
        return torch, None

    def describe(self) -> dict:
        cupy, props = self.cupy, self.properties
        name = props["name"]
        device = {"name": name.decode() if isinstance(name, bytes) else str(name),
                  "arch": f"sm_{props['major']}{props['minor']}", "sms": int(props["multiProcessorCount"]),
                  "l2_bytes": self.l2_bytes, "memory_bytes": self.memory_bytes}
        versions = {"kvcupy": kvcupy.__version__, "cupy": cupy.__version__,
                    "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                    "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
                    "nvrtc": ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
                    "torch": self.torch.__version__ if self.torch is not None else None}
        return {"device": device, "versions": versions, "torch_unavailable": self.torch_reason}

    # Setting up cases.

    def build(self, group: Group, case: Case, sets: int) -> tuple[list[Callable[[], Any]], dict]:
        if group.kind == "step":
            return self._step.build(group, case, sets)
        if case.impl == "copy":
            return self._copy(case_bytes(group, case, self.model_dtype), sets), {}
        if group.kind == "rotate":
            return self._rotate(group.shape, sets)
        if group.kind == "write":
            return self._write(group.shape, case.kv_dtype, sets), {}
        if case.impl == "kvcupy":
            return self._kvcupy_attention(group, case.kv_dtype, sets, case.device_metadata), {}
        if case.impl == "sdpa":
            return self._sdpa(group, case.sdpa_backend, sets)
        return self._stream(group, case, sets)

    def _attention_data(self, group: Group) -> _AttentionData:
        if self._attention is None:
            s = group.shape
            pages = math.ceil(s.seq_len / BLOCK_SIZE)
            rng = np.random.default_rng(SEED)
            # Pages in a shuffled order, as a serving engine's free list leaves them.
            block_table = rng.permutation(s.num_seqs * pages).astype(np.int32).reshape(s.num_seqs, pages)
            batch = kvcupy.plan_batch(
                block_table=block_table, seq_lens=np.full(s.num_seqs, s.seq_len, np.int32),
                cu_seqlens_q=np.arange(s.num_seqs + 1, dtype=np.int32) * s.query_len,
                block_size=BLOCK_SIZE, num_blocks=s.num_seqs * pages,
                num_query_tokens=s.num_seqs * s.query_len)
            randn = self.tensors.randn
            self._attention = _AttentionData(
                key=randn((s.num_seqs, s.num_kv_heads, s.seq_len, s.head_size), SEED),
                value=randn((s.num_seqs, s.num_kv_heads, s.seq_len, s.head_size), SEED + 1),
                query=randn((s.num_seqs, s.num_heads, s.query_len, s.head_size), SEED + 2),
                block_table=block_table, num_blocks=s.num_seqs * pages, batch=batch)
        return self._attention

    def _group_caches(self, group: Group, kv_dtype: str, sets: int, written: bool) -> list:
        """The group's caches of `kv_dtype`, at least `sets` of them; written: holding the group's K/V."""
        data = self._attention_data(group)
        s = group.shape
        caches = self._caches.setdefault(kv_dtype, [])
        while len(caches) < sets:
            caches.append(kvcupy.allocate_cache(data.num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_size,
                                                kv_dtype=kv_dtype, device="cuda",
                                                dtype=self.model_dtype.name))
        if written:
            positions = np.arange(s.seq_len)
            for cache in caches[:sets]:
                if id(cache) in self._written:
                    continue
                for seq in range(s.num_seqs):   # one sequence at a time bounds the token-major copies
                    row = data.block_table[seq]
                    slots = (row[positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                             + positions % BLOCK_SIZE)
                    kvcupy.reshape_and_cache(self.tensors.tokens(data.key[seq:seq + 1]),
                                             self.tensors.tokens(data.value[seq:seq + 1]), cache, slots)
                self._written.add(id(cache))
        return caches[:sets]

    def _kvcupy_attention(self, group: Group, kv_dtype: str, sets: int, device_metadata: bool = False) -> list:
        data = self._attention_data(group)
        metadata = {"batch": data.batch}
        if device_metadata:
            s = group.shape
            metadata = dict(block_table=data.block_table, seq_lens=np.full(s.num_seqs, s.seq_len, np.int32),
                            cu_seqlens_q=np.arange(s.num_seqs + 1, dtype=np.int32) * s.query_len)
            metadata = {name: self.tensors.on_device(array) for name, array in metadata.items()}
            metadata.update(max_query_len=s.query_len, max_seq_len=s.seq_len)
        calls = []
        for cache in self._group_caches(group, kv_dtype, sets, written=True):
            query = self.tensors.tokens(data.query)    # each set its own query and output
            out = self.tensors.empty_like(query)
            calls.append(functools.partial(kvcupy.paged_attention, query, cache, out=out, **metadata))
        return calls

    def _sdpa_function(self, backend: str) -> Callable:
        torch = self.torch
        if torch is None:
            raise PeerSkipped(self.torch_reason)
        attend = torch.nn.functional.scaled_dot_product_attention
        if backend == "default":
            return attend
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        except (ImportError, AttributeError):
            raise PeerSkipped(f"torch {torch.__version__} cannot select the {backend} SDPA backend "
                              "(torch.nn.attention.sdpa_kernel)") from None

        def attend_with(*args, **kwargs):
            with sdpa_kernel(chosen):
                return attend(*args, **kwargs)

        return attend_with

    def _sdpa(self, group: Group, backend: str, sets: int) -> tuple[list, dict]:
        attend = self._sdpa_function(backend)
        data = self._attention_data(group)
        s = group.shape
        copies = [(data.query, data.key, data.value)] + [
            tuple(self.tensors.copy(t) for t in (data.query, data.key, data.value)) for _ in range(sets - 1)]
        if s.phase == "decode":
            # GQA folded into the query length: the group's query heads are its KV
            # head's query rows, so K/V are read once per KV head and any backend can run it.
            folded = (s.num_seqs, s.num_kv_heads, s.group, s.head_size)
            calls = [functools.partial(attend, q.reshape(folded), k, v) for q, k, v in copies]
            return self._probe(calls, backend), {"gqa": "folded into the query length"}
        causal = self._sdpa_causal(s)
        calls = [functools.partial(attend, q, k, v, **causal, enable_gqa=True) for q, k, v in copies]
        try:
            return self._probe(calls, backend), {"gqa": "enable_gqa"}
        except PeerSkipped as native:
            # This backend (or this torch) has no native GQA: repeat K/V heads, outside the timing.
            expanded = [functools.partial(attend, q, k.repeat_interleave(s.group, dim=1),
                                          v.repeat_interleave(s.group, dim=1), **causal)
                        for q, k, v in copies]
            try:
                return self._probe(expanded, backend), {"gqa": "K/V heads repeated before timing"}
            except PeerSkipped as repeated:
                raise PeerSkipped(f"{native}; with K/V heads repeated: {repeated}") from None

    def _sdpa_causal(self, shape: Shape) -> dict:
        """SDPA's causal arguments. A chunk over cached keys needs its diagonal at
        the bottom right (query i sees keys up to L - Lq + i); is_causal puts it at
        the top left, so such a chunk takes torch's lower-right causal bias."""
        if shape.query_len == shape.seq_len:
            return {"is_causal": True}
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError:
            raise PeerSkipped(f"torch {self.torch.__version__} has no lower-right causal bias "
                              "(torch.nn.attention.bias.causal_lower_right)") from None
        return {"attn_mask": causal_lower_right(shape.query_len, shape.seq_len)}

    @staticmethod
    def _probe(calls: list, backend: str) -> list:
        """The calls, if the backend runs them; PeerSkipped with torch's reason if not."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                calls[0]()
            except (RuntimeError, TypeError) as error:
                why = "; ".join(str(w.message).splitlines()[0] for w in caught[:2])
                because = f" ({why})" if why else ""
                raise PeerSkipped(f"SDPA {backend}: {_error_text(error)}{because}") from None
        return calls

    def _copy(self, moved_bytes: int, sets: int) -> list:
        size = moved_bytes // 2
        calls = []
        for _ in range(sets):
            source = self.cupy.empty(size, self.cupy.uint8)
            target = self.cupy.empty(size, self.cupy.uint8)
            calls.append(functools.partial(target.data.copy_from_device_async, source.data, size))
        return calls

    def _stream(self, group: Group, case: Case, sets: int) -> tuple[list, dict]:
        cupy = self.cupy
        s = group.shape
        data = self._attention_data(group)
        kernel = kernels.get_function("stream_pages", "stream_pages", kernels.stream_defines(
            s.num_kv_heads, s.head_size, case.kv_dtype, self.model_dtype))
        block_table = cupy.asarray(data.block_table)
        seq_lens = cupy.full(s.num_seqs, s.seq_len, cupy.int32)
        calls = []
        for cache in self._group_caches(group, case.kv_dtype, sets, written=False):
            arrays = kvcupy.cache_arrays(cache)
            tensors = [arrays.key_cache, arrays.value_cache, arrays.k_scale_cache, arrays.v_scale_cache]
            if not all(t is None or (t.flags.c_contiguous and t.data.ptr % 16 == 0) for t in tensors):
                raise RuntimeError("stream_pages reads page-major, contiguous, 16-byte aligned caches")
            key, value, k_scale, v_scale = (t if t is not None else arrays.key_cache for t in tensors)
            out = cupy.empty((s.num_seqs, case.splits), cupy.uint32)
            args = (key, value, k_scale, v_scale, block_table, seq_lens, out,
                    np.int32(block_table.shape[1]), np.int32(data.num_blocks))
            calls.append(functools.partial(kernel, (case.splits, s.num_seqs), (kernels.STREAM_THREADS,), args))
        return calls, {}

    def _write(self, shape: WriteShape, kv_dtype: str, sets: int) -> list:
        pages = math.ceil(shape.num_tokens / BLOCK_SIZE)
        page_order = np.random.default_rng(SEED).permutation(pages)
        positions = np.arange(shape.num_tokens)
        slots = kvcupy.plan_slots(page_order[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
                                  num_slots=pages * BLOCK_SIZE)
        calls = []
        for index in range(sets):
            kv_shape = (shape.num_tokens, shape.num_kv_heads, shape.head_size)
            key = self.tensors.randn(kv_shape, SEED + 2 * index)
            value = self.tensors.randn(kv_shape, SEED + 2 * index + 1)
            cache = kvcupy.allocate_cache(pages, BLOCK_SIZE, shape.num_kv_heads, shape.head_size,
                                          kv_dtype=kv_dtype, device="cuda", dtype=self.model_dtype.name)
            calls.append(functools.partial(kvcupy.reshape_and_cache, key, value, cache, slots))
        return calls

    def _rotate(self, shape: RotateShape, sets: int) -> tuple[list, dict]:
        plan = kvcupy.rotation_plan(shape.head_size, "blockdiag")
        calls = [functools.partial(kvcupy.rotate, self.tensors.randn((shape.num_vectors, shape.head_size),
                                                                     SEED + index), plan)
                 for index in range(sets)]
        return calls, {"rotation": plan.describe()}

    # Timing.

    def warm_up(self, calls: list, warmup: int) -> tuple[float, float]:
        for index in range(max(1, warmup)):
            calls[index % len(calls)]()
        self.stream.synchronize()
        begin = time.perf_counter()
        for index in range(HOST_PROBE_CALLS):
            calls[index % len(calls)]()
        host_ms = (time.perf_counter() - begin) * 1e3 / HOST_PROBE_CALLS
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record(self.stream)
        calls[0]()
        end.record(self.stream)
        end.synchronize()
        return self.cupy.cuda.get_elapsed_time(start, end), host_ms

    def time(self, calls: list, count: int, host_ms: float) -> Timing:
        cuda = self.cupy.cuda
        events = [(cuda.Event(), cuda.Event()) for _ in range(count)]
        self.stream.synchronize()
        hold_s = hold_seconds(count * host_ms * 1e-3)
        self.hold((1,), (1,), (np.uint64(int(hold_s * 1e9)),))
        for index, (start, end) in enumerate(events):
            start.record(self.stream)
            calls[index % len(calls)]()
            end.record(self.stream)
        events[-1][1].synchronize()
        ms = [cuda.get_elapsed_time(start, end) for start, end in events]
        idle = sum(cuda.get_elapsed_time(events[i][1], events[i + 1][0]) for i in range(count - 1))
        return Timing(ms, idle)

    def time_steps(self, calls: list, count: int) -> Timing:
        """run.STEP_TIMING: one event between consecutive steps, none held back, so each
        interval is a step's time at the pace of the slower of the host and the GPU."""
        cuda = self.cupy.cuda
        events = [cuda.Event() for _ in range(count + 1)]
        self.stream.synchronize()
        events[0].record(self.stream)
        for index in range(count):
            calls[index % len(calls)]()
            events[index + 1].record(self.stream)
        events[-1].synchronize()
        return Timing([cuda.get_elapsed_time(events[i], events[i + 1]) for i in range(count)], 0.0)

    def end_group(self) -> None:
        self._step.clear()
        self._attention = None
        self._caches.clear()
        self._written.clear()
        self.stream.synchronize()
        self.cupy.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()
