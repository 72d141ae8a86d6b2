"""CPU backend: host-side preparation around the Numba kernels in `cpu_kernels`.

Implements the protocol of `kvcupy.backends`. Arguments arrive validated
(ops.py) as interop.Arrays of NumPy data. This module turns them into what the
kernels take: float32 working copies, byte views of the cache, the decode
mode, and the int4 storage-order permutation.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import numba
import numpy as np
from numba.core import event

from .. import formats
from ..rotation import RotationPlan, query_divisor, round_for_cache
from . import cpu_kernels as kernels

name = "cpu"
device_kind = "cpu"


def availability() -> tuple[bool, str]:
    return True, f"Numba {numba.__version__}, {numba.get_num_threads()} threads"


def import_dlpack(x) -> np.ndarray:
    return np.from_dlpack(x)


def dlpack_stream(device) -> None:
    return None   # host memory: no stream to order on


def device_context(device):
    return contextlib.nullcontext()   # the host has nothing to make current


def stream_context(device, stream: int):
    return contextlib.nullcontext()


def synchronize(device) -> None:
    """The host's work is done when its call returns."""


def zeros(shape: tuple, dtype, device) -> np.ndarray:
    return np.zeros(shape, dtype)


def empty(shape: tuple, dtype, device) -> np.ndarray:
    return np.empty(shape, dtype)


def upload(array: np.ndarray, device) -> np.ndarray:
    return array


def upload_into(target: np.ndarray, array: np.ndarray) -> None:
    target[...] = array


class _CompileListener(event.Listener):
    """Numba's "numba:compile" events (a compile, never a load from its cache) of
    cpu_kernels' functions; report(name) for the outermost one only: the kernel a
    call runs, not the helpers Numba compiles inside it."""

    def __init__(self, report: Callable[[str], None]):
        self.report = report
        self.depth = 0

    def on_start(self, ev) -> None:
        function = ev.data["dispatcher"].py_func
        if function.__module__ == kernels.__name__:
            self.depth += 1
            if self.depth == 1:
                self.report(function.__name__)

    def on_end(self, ev) -> None:
        if ev.data["dispatcher"].py_func.__module__ == kernels.__name__:
            self.depth -= 1


@contextlib.contextmanager
def reporting_compiles(report: Callable[[str], None]) -> Iterator[None]:
    """Within the block, report(kernel name) as Numba starts compiling a CPU kernel.
    Kernels compiled before, in this process or in kernels.CACHE_DIR, report nothing."""
    with event.install_listener("numba:compile", _CompileListener(report)):
        yield


# Below this many float32 values of work, a call runs on the calling thread.
# Numba's worker threads (OpenMP) wake in microseconds on an idle machine, but
# when another core is busy a wake-up can wait a whole scheduler slice, far
# longer than a small call's work, which gains nothing from a second thread.
PARALLEL_MIN_VALUES = 1 << 18


@contextlib.contextmanager
def _threads_for(num_values: int):
    if num_values >= PARALLEL_MIN_VALUES:
        yield
        return
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(threads)


# --- rotation -------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _identity_order(head_size: int) -> np.ndarray:
    return np.arange(head_size, dtype=np.int64)


def _rotate_float32(x32: np.ndarray, plan: RotationPlan, inverse: bool, divisor: float | None = None,
                    read_order: np.ndarray | None = None, write_order: np.ndarray | None = None
                    ) -> np.ndarray:
    """Rotate the rows of a float32 [..., d] array; returns float32. divisor: by default
    the inverse's norm (1 forward); the orders permute the input and output channels."""
    flat = np.ascontiguousarray(x32.reshape(-1, plan.head_size))
    out = np.empty_like(flat)
    if divisor is None:
        divisor = float(plan.norm) if inverse else 1.0
    identity = _identity_order(plan.head_size)
    with _threads_for(flat.size):
        kernels.rotate_rows(flat, out, plan.sign_vector(), plan.mix_matrix(), plan.kind == "kron",
                            plan.pow2_size, inverse, divisor,
                            identity if read_order is None else read_order,
                            identity if write_order is None else write_order)
    return out.reshape(x32.shape)


def rotate(x, plan: RotationPlan, inverse: bool, out) -> None:
    """out.data = rotation of x.data (interop.Arrays of the same shape and dtype)."""
    if plan.is_identity:
        out.data[...] = x.data
        return
    out.data[...] = _rotate_float32(x.data.astype(np.float32), plan, inverse)


def rotate_for_cache(x: np.ndarray, plan: RotationPlan | None) -> np.ndarray:
    """The float32 vectors that get quantized (same rule as reference.rotate_for_cache)."""
    x32 = x.astype(np.float32)
    if plan is None or plan.is_identity:
        return x32
    return round_for_cache(_rotate_float32(x32, plan, inverse=False), x.dtype, plan)


# --- write path -----------------------------------------------------------



def encode(x: np.ndarray, kv_dtype: str, plan: RotationPlan | None, cache_dtype: np.dtype):
    """[T, Hk, d] model-dtype vectors -> (stored [T, Hk, d_stored], scales [T, Hk] or None)."""
    rotated = rotate_for_cache(x, plan)
    if kv_dtype == "auto":
        return rotated.astype(cache_dtype), None
    info = formats.kv_dtype_info(kv_dtype)
    vectors = np.ascontiguousarray(rotated.reshape(-1, rotated.shape[-1]))
    codes = np.empty((vectors.shape[0], info.stored_head_size(vectors.shape[1])), info.storage)
    scales = np.empty(vectors.shape[0], np.float32)
    zero_points = np.zeros(vectors.shape[0], np.uint8)
    with _threads_for(vectors.size):
        kernels.quantize_vectors(vectors, info.kernel_id, codes, scales, zero_points)
    if kv_dtype == "int4_per_token_head":
        scales = formats.encode_int4_scale(scales, zero_points)
    return codes.reshape(x.shape[:-1] + codes.shape[-1:]), scales.reshape(x.shape[:-1])


def reshape_and_cache(key, value, cache, slots) -> None:
    """Write key/value (interop.Arrays [T, Hk, d]) at slots (a checked SlotMapping)."""
    slot_mapping = slots.host
    valid = slot_mapping >= 0
    blocks, offsets = np.divmod(slot_mapping[valid], cache.block_size)
    for x, data, scales in ((key.data, cache.key_cache, cache.k_scale_cache),
                            (value.data, cache.value_cache, cache.v_scale_cache)):
        stored, scale = encode(x[valid], cache.kv_dtype, cache.rotation, data.dtype)
        data[blocks, offsets] = stored
        if scales is not None:
            scales[blocks, offsets] = scale


# --- read path ------------------------------------------------------------

_NO_SCALES = np.zeros((1, 1, 1), np.uint32)


def _decode_plan(cache) -> tuple[int, np.ndarray, np.ndarray]:
    """(decode mode, K data view, V data view) the attention kernel reads."""
    if cache.kv_dtype == "int4_per_token_head":
        return kernels.DECODE_INT4, cache.key_cache, cache.value_cache
    if cache.kv_dtype == "fp8_per_token_head":
        return kernels.DECODE_FP8, cache.key_cache, cache.value_cache
    if cache.kv_dtype == "int8_per_token_head":
        return kernels.DECODE_INT8, cache.key_cache.view(np.uint8), cache.value_cache.view(np.uint8)
    if cache.key_cache.dtype == np.float32:
        return kernels.DECODE_LINEAR, cache.key_cache, cache.value_cache
    mode = kernels.DECODE_FP16 if cache.key_cache.dtype == np.float16 else kernels.DECODE_BF16
    return mode, cache.key_cache.view(np.uint16), cache.value_cache.view(np.uint16)


def _inverse_permutation(order: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return inverse


def storage_order(kv_dtype: str, head_size: int) -> np.ndarray | None:
    """Permutation from the model's channel order to the order rows decode in."""
    if kv_dtype != "int4_per_token_head":
        return None
    return np.concatenate([np.arange(0, head_size, 2), np.arange(1, head_size, 2)])


# A work item of the attention kernel takes a run of consecutive query tokens
# of one sequence and decodes each K/V row once for all of them: a prefill
# then decodes its keys once per run instead of once per token. A run has at
# most RUN_QUERY_ROWS (token, query head) rows of one KV head: enough to
# amortise decoding; more would only grow the kernel's per-item buffers.
RUN_QUERY_ROWS = 32


def query_runs(cu_seqlens_q: np.ndarray, group: int) -> np.ndarray:
    """int32 [R + 1]: run r is query tokens runs[r] .. runs[r + 1] - 1, all of one sequence."""
    tokens_per_run = max(1, RUN_QUERY_ROWS // group)
    starts = [np.arange(begin, end, tokens_per_run)
              for begin, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())]
    return np.append(np.concatenate(starts or [np.empty(0, np.int64)]), cu_seqlens_q[-1]).astype(np.int32)


# A work item also takes a span of consecutive KV heads, so that it reads a
# block's rows whole (a row holds every head side by side). Spans shrink to
# leave each thread ITEMS_PER_LANE items to balance, and to keep an item's
# scores (a segment of columns per query row) within SPAN_SCORES floats.
ITEMS_PER_LANE = 2
SPAN_SCORES = 1 << 17


def heads_per_item(runs: np.ndarray, num_kv_heads: int, group: int, longest: int, lanes: int) -> int:
    """KV heads per attention work item, for query runs `runs` (see query_runs)."""
    num_runs = len(runs) - 1
    run_scores = int(np.diff(runs).max(initial=1)) * group * min(max(longest, 1), kernels.SEGMENT)
    by_balance = num_runs * num_kv_heads // (ITEMS_PER_LANE * lanes)
    by_memory = SPAN_SCORES // run_scores
    return max(1, min(num_kv_heads, by_balance, by_memory))


@dataclass(frozen=True)
class AttentionPlan:
    """What one batch needs on the CPU, made once per BatchPlan (every layer reuses it)."""

    token_seq: np.ndarray    # [T] int32: each query token's sequence
    runs: np.ndarray         # query runs (query_runs)
    head_span: int           # KV heads per work item (heads_per_item)
    values_read: int         # work, for the threading threshold


def plan_attention(batch, cache, num_query_heads: int, num_query_tokens: int) -> AttentionPlan:
    seq_lens = batch.host["seq_lens"]
    cu_seqlens_q = batch.host["cu_seqlens_q"]
    num_kv_heads = cache.num_kv_heads
    group = num_query_heads // num_kv_heads
    # Work: every query token reads up to its whole sequence, in every KV head.
    values_read = int(np.dot(np.diff(cu_seqlens_q), seq_lens)) * num_kv_heads * cache.head_size
    runs = query_runs(cu_seqlens_q, group)
    lanes = numba.get_num_threads() if values_read >= PARALLEL_MIN_VALUES else 1
    head_span = heads_per_item(runs, num_kv_heads, group, int(seq_lens.max(initial=1)), lanes)
    token_seq = np.repeat(np.arange(len(seq_lens), dtype=np.int32), np.diff(cu_seqlens_q))
    return AttentionPlan(token_seq, runs, head_span, values_read)


def paged_attention(query, cache, batch, plan: AttentionPlan, *, softmax_scale: float,
                    sliding_window: int | None, softcap: float, sinks, out) -> None:
    """out.data = attention (query, out: interop.Arrays [T, Hq, d]; model channel order)."""
    rotation = cache.rotation
    rotated = rotation is not None and not rotation.is_identity
    order = storage_order(cache.kv_dtype, cache.head_size)
    q = query.data.astype(np.float32)
    if rotated:
        # One pass: rotate, scale, and permute to storage order.
        q = _rotate_float32(q, rotation, inverse=False, divisor=query_divisor(rotation, softmax_scale),
                            write_order=order)
    else:
        q = q * np.float32(softmax_scale)
        if order is not None:
            q = q[..., order]
    q = np.ascontiguousarray(q)

    mode, key_data, value_data = _decode_plan(cache)
    has_scales = cache.k_scale_cache is not None
    k_bits = cache.k_scale_cache.view(np.uint32) if has_scales else _NO_SCALES
    v_bits = cache.v_scale_cache.view(np.uint32) if has_scales else _NO_SCALES
    has_sinks = sinks is not None
    sink_logits = sinks.data.astype(np.float32) if has_sinks else np.zeros(q.shape[1], np.float32)

    result = np.empty_like(q)
    with _threads_for(plan.values_read):
        kernels.paged_attention(q, key_data, value_data, k_bits, v_bits, has_scales, mode,
                                batch.host["block_table"], batch.host["seq_lens"],
                                batch.host["cu_seqlens_q"], plan.token_seq, plan.runs,
                                int(sliding_window or 0), np.float32(softcap), sink_logits,
                                has_sinks, result, plan.head_span, numba.get_num_threads())
    if rotated:
        # One pass: back to model channel order, and rotate back.
        read_order = None if order is None else _inverse_permutation(order)
        result = _rotate_float32(result, rotation, inverse=True, read_order=read_order)
    elif order is not None:
        restored = np.empty_like(result)
        restored[..., order] = result
        result = restored
    out.data[...] = result


# --- copy-on-write --------------------------------------------------------

def copy_blocks(caches, pairs: np.ndarray) -> None:
    """Block pairs[i, 0] onto pairs[i, 1], every tensor of every cache."""
    sources, destinations = pairs[:, 0], pairs[:, 1]
    for cache in caches:
        for tensor in cache.tensors():
            tensor[destinations] = tensor[sources]
