"""`kvcupy bench`: paged attention over quantized caches against NumPy dense attention, in one run.

The baseline is what a NumPy user would write: float32 dense attention
(batched matmul, softmax, matmul) on K/V that are *already dequantized*, so
the baseline pays for no decoding at all. GQA is handled by reshaping the
query to [S, Hk, group * Lq, d], so each KV head is read once for its group.
Each KV dtype gets kvcupy's default rotation (blockdiag for int4, none for
the others), as allocate_cache gives it.
Both sides get the same float16 inputs; kvcupy writes them into its cache
first (not timed).

Every case is timed with time.perf_counter around whole calls, in `rounds`
rounds: each round times the baseline and then every KV dtype, so slow
phases of a shared machine fall on all of them alike rather than on whichever
case ran then. Each kvcupy case is called once before the rounds, which is
where its kernels compile on a first run (the command says so when they do).
Both sides run on the same number of threads (`same_threads`): kvcupy's Numba
kernels and NumPy's BLAS, pinned with threadpoolctl; the report says how many,
and the machine's load average when the run began (timings taken while other
programs share the cores say little). Before its timed calls in a round, a case
is called untimed for at least `warmup` calls and SETTLE_S seconds: its
memory is warm after that, and the previous case's threads have gone idle
(OpenBLAS workers keep spinning for about 0.1 s after a matmul, and slow the
next case's first calls while they do). Each case's timed calls of all rounds are pooled
and their median is reported. speedup_vs_baseline = baseline median /
kvcupy median: above 1, kvcupy is faster.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numba
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import kvcupy
from kvcupy import formats
from kvcupy.bench.run import Progress, split_repeats
from kvcupy.bench.shapes import Shape, attended_tokens

BLOCK_SIZE = 16
MODEL_DTYPE = np.dtype(np.float16)
SEED = 0


# A Llama-3-8B-like layer (32 query heads, 8 KV heads, d = 128) at a long context.
FULL_SHAPES = (Shape("decode", 8, 4096, 32, 8, 128), Shape("prefill", 1, 2048, 32, 8, 128))
# Small enough for tests: a second or two in all.
QUICK_SHAPES = (Shape("decode", 2, 256, 8, 2, 128), Shape("prefill", 1, 128, 8, 2, 128))

@dataclass(frozen=True)
class Inputs:
    key: np.ndarray     # [S * L, Hk, d] model dtype; sequence s holds tokens s*L .. s*L+L-1
    value: np.ndarray
    query: np.ndarray   # [S * Lq, Hq, d] model dtype: the last Lq tokens of each sequence


def make_inputs(shape: Shape, rng: np.random.Generator) -> Inputs:
    num_tokens = shape.num_seqs * shape.seq_len
    kv_shape = (num_tokens, shape.num_kv_heads, shape.head_size)
    query_shape = (shape.num_seqs * shape.query_len, shape.num_heads, shape.head_size)
    key = rng.standard_normal(kv_shape).astype(MODEL_DTYPE)
    value = rng.standard_normal(kv_shape).astype(MODEL_DTYPE)
    query = rng.standard_normal(query_shape).astype(MODEL_DTYPE)
    return Inputs(key, value, query)


SETTLE_S = 0.3


def time_calls(call: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """Seconds of `repeats` timed calls, after at least `warmup` untimed calls and SETTLE_S seconds."""
    start = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - start < SETTLE_S:
        call()
        calls += 1
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return times


def dense_attention_call(shape: Shape, inputs: Inputs) -> Callable[[], np.ndarray]:
    """NumPy float32 dense attention on the (already dequantized) K/V; returns the call.

    The query becomes [S, Hk, group * Lq, d], so one matmul per (sequence, KV
    head) serves its whole query group and K/V are read once per group.
    """
    S, L, Lq, Hk, d = shape.num_seqs, shape.seq_len, shape.query_len, shape.num_kv_heads, shape.head_size
    keys = inputs.key.astype(np.float32).reshape(S, L, Hk, d).transpose(0, 2, 1, 3)
    keys_t = np.ascontiguousarray(keys.swapaxes(-1, -2))                       # [S, Hk, d, L]
    values = np.ascontiguousarray(inputs.value.astype(np.float32).reshape(S, L, Hk, d).transpose(0, 2, 1, 3))
    query = inputs.query.astype(np.float32).reshape(S, Lq, Hk, shape.group, d).transpose(0, 2, 3, 1, 4)
    query = np.ascontiguousarray(query * np.float32(1.0 / math.sqrt(d))).reshape(S, Hk, shape.group * Lq, d)
    # Prefill is causal: query i (position L - Lq + i) sees keys 0 .. L - Lq + i.
    # A decode query sees every key, so it gets no mask to add.
    mask = np.triu(np.full((Lq, L), -np.inf, np.float32), k=L - Lq + 1) if Lq > 1 else None

    def attend() -> np.ndarray:
        scores = np.matmul(query, keys_t)                                       # [S, Hk, group * Lq, L]
        if mask is not None:
            scores.reshape(S, Hk, shape.group, Lq, L)[...] += mask
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return np.matmul(scores, values)                                        # [S, Hk, group * Lq, d]

    return attend


def paged_attention_call(shape: Shape, inputs: Inputs, kv_dtype: str, device: str):
    """kvcupy paged attention over a freshly written cache; returns (the call, the cache)."""
    blocks_per_seq = math.ceil(shape.seq_len / BLOCK_SIZE)
    cache = kvcupy.allocate_cache(shape.num_seqs * blocks_per_seq, BLOCK_SIZE, shape.num_kv_heads,
                                  shape.head_size, kv_dtype=kv_dtype, device=device,
                                  dtype=MODEL_DTYPE.name)
    block_table = np.arange(shape.num_seqs * blocks_per_seq, dtype=np.int32).reshape(shape.num_seqs, -1)
    positions = np.arange(shape.seq_len)
    slot_mapping = (block_table[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).ravel()
    kvcupy.reshape_and_cache(inputs.key, inputs.value, cache, slot_mapping.astype(np.int64))
    seq_lens = np.full(shape.num_seqs, shape.seq_len, np.int32)
    cu_seqlens_q = np.arange(shape.num_seqs + 1, dtype=np.int32) * shape.query_len

    def attend():
        return kvcupy.paged_attention(inputs.query, cache, block_table=block_table,
                                      seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q)

    return attend, cache


def default_threads() -> int:
    """Threads both sides get unless told: as many as Numba starts (every core, by default)."""
    return numba.config.NUMBA_NUM_THREADS


def load_average() -> float | None:
    """The machine's load average over the last minute; None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_machine_warning(load: float | None, cores: int) -> str | None:
    """A warning when other work already keeps more than every core busy."""
    if load is None or load <= cores:
        return None
    return (f"the load average ({load:.2f}) is above this machine's {cores} cores: other programs "
            "share the CPUs, so these timings are not to be trusted; bench an idle machine")


def blas_pools() -> list[dict]:
    """NumPy's BLAS libraries (threadpoolctl) and the threads each runs on now."""
    return [{"library": pool["internal_api"], "version": pool.get("version"), "num_threads": pool["num_threads"]}
            for pool in threadpool_info() if pool["user_api"] == "blas"]


@contextmanager
def same_threads(threads: int) -> Iterator[None]:
    """Both sides on `threads` threads: kvcupy's Numba kernels and NumPy's BLAS.

    Left alone, each side sizes its own pool (OpenBLAS from its build and
    OPENBLAS_NUM_THREADS, Numba from NUMBA_NUM_THREADS), and a ratio of two
    different thread counts compares the counts as much as the kernels.
    """
    saved = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            yield
    finally:
        numba.set_num_threads(saved)


def bench_shape(shape: Shape, kv_dtypes: tuple[str, ...], device: str, warmup: int, repeats: int,
                rounds: int, progress: Progress) -> list[dict]:
    """The baseline and each KV dtype on one shape, interleaved in rounds.
    progress(name): a case's calls in a round are done."""
    inputs = make_inputs(shape, np.random.default_rng(SEED))
    calls = {"baseline": dense_attention_call(shape, inputs)}
    caches = {}
    for kv_dtype in kv_dtypes:
        # Writing the cache and the first call compile the kernels a case needs, where
        # they are not compiled yet: before the rounds, so that no timed call compiles.
        calls[kv_dtype], caches[kv_dtype] = paged_attention_call(shape, inputs, kv_dtype, device)
        calls[kv_dtype]()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for count in split_repeats(repeats, rounds):
        for name, call in calls.items():
            times[name] += time_calls(call, warmup, count)
            progress(f"{shape.phase}: {'numpy float32 dense' if name == 'baseline' else name}")
    baseline_s = statistics.median(times["baseline"])
    num_tokens = shape.num_seqs * shape.seq_len
    cases = []
    for kv_dtype in kv_dtypes:
        seconds = statistics.median(times[kv_dtype])
        cache_bytes = attended_tokens(shape) * formats.kv_dtype_info(kv_dtype).bytes_per_token(
            shape.num_kv_heads, shape.head_size, MODEL_DTYPE)
        cases.append({**asdict(shape), "kv_dtype": kv_dtype, "rotation": caches[kv_dtype].rotation.kind,
                      "query_tokens": shape.num_seqs * shape.query_len, "context_tokens": num_tokens,
                      "repeats": len(times[kv_dtype]), "median_s": seconds, "baseline_median_s": baseline_s,
                      "speedup_vs_baseline": baseline_s / seconds,
                      "cache_bytes_read": cache_bytes, "cache_gb_per_s": cache_bytes / seconds / 1e9})
    return cases


def run_bench(shapes: tuple[Shape, ...], kv_dtypes: tuple[str, ...], device: str, warmup: int,
              repeats: dict[str, int], rounds: int, progress: Progress, threads: int,
              load: float | None = None) -> dict:
    """repeats: timed calls per case and phase ("decode", "prefill"), spread over `rounds` rounds;
    threads: what both sides run on (same_threads); load: the load average as the run began."""
    cases = []
    with same_threads(threads):
        blas = blas_pools()
        for shape in shapes:
            cases += bench_shape(shape, kv_dtypes, device, warmup, repeats[shape.phase], rounds, progress)
    cores = os.cpu_count() or 1
    warning = busy_machine_warning(load, cores)
    return {"backend": device, "model_dtype": MODEL_DTYPE.name, "block_size": BLOCK_SIZE,
            "warmup": warmup, "settle_s": SETTLE_S, "rounds": rounds, "threads": threads,
            "blas": blas, "cores": cores, "load_average": load, "warnings": [warning] if warning else [],
            "cases": cases}


def total_steps(shapes: tuple[Shape, ...], kv_dtypes: tuple[str, ...], repeats: dict[str, int],
                rounds: int) -> int:
    return sum(len(split_repeats(repeats[shape.phase], rounds)) * (1 + len(kv_dtypes)) for shape in shapes)
