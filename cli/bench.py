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
where its kernels compile (the progress display says so, since on a first
run that call alone takes seconds). Before its timed calls in a round, a case
is called untimed for at least `warmup` calls and SETTLE_S seconds: its
memory is warm after that, and the previous case's threads have gone idle
(OpenBLAS workers keep spinning for about 0.1 s after a matmul; measured on
a 2-core machine, the first four kvcupy decode calls after the baseline took
2-3x their steady time). Each case's timed calls of all rounds are pooled
and their median is reported. speedup_vs_baseline = baseline median /
kvcupy median: above 1, kvcupy is faster.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

import kvcupy
from kvcupy import formats

BLOCK_SIZE = 16
MODEL_DTYPE = np.dtype(np.float16)
ALL_KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")
SEED = 0


@dataclass(frozen=True)
class Shape:
    """One benchmark case: decode (one new token per sequence) or causal prefill:
    of each sequence's seq_len tokens the last new_tokens are the query, the
    rest are cached (chunked prefill); new_tokens 0: the whole prompt is new."""

    phase: str
    num_seqs: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    new_tokens: int = 0

    @property
    def query_len(self) -> int:
        return 1 if self.phase == "decode" else (self.new_tokens or self.seq_len)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


# A Llama-3-8B-like layer (32 query heads, 8 KV heads, d = 128) at a long context.
FULL_SHAPES = (Shape("decode", 8, 4096, 32, 8, 128), Shape("prefill", 1, 2048, 32, 8, 128))
# Small enough for tests: a second or two in all.
QUICK_SHAPES = (Shape("decode", 2, 256, 8, 2, 128), Shape("prefill", 1, 128, 8, 2, 128))

Progress = Callable[[str], None]   # called with the name of a step that ended, or starts


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


def split_repeats(repeats: int, rounds: int) -> list[int]:
    """Timed calls per round: `repeats` spread as evenly as possible, rounds with none dropped."""
    per_round = [repeats // rounds + (index < repeats % rounds) for index in range(rounds)]
    return [count for count in per_round if count]


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


def attended_tokens(shape: Shape) -> int:
    """Cached tokens summed over the query tokens that attend to them: the cache
    bytes read, in tokens, when each query reads its visible K/V once. Decode
    reads each sequence's cache once; a causal prefill of L tokens L(L+1)/2 rows."""
    first = shape.seq_len - shape.query_len + 1   # keys the first query token sees
    per_seq = (first + shape.seq_len) * shape.query_len // 2
    return shape.num_seqs * per_seq


def bench_shape(shape: Shape, kv_dtypes: tuple[str, ...], device: str, warmup: int, repeats: int,
                rounds: int, progress: Progress, status: Progress) -> list[dict]:
    """The baseline and each KV dtype on one shape, interleaved in rounds.
    progress(name): a case's calls in a round are done; status(text): what starts now."""
    inputs = make_inputs(shape, np.random.default_rng(SEED))
    calls = {"baseline": dense_attention_call(shape, inputs)}
    caches = {}
    for kv_dtype in kv_dtypes:
        # Writing the cache and the first call compile the kernels this case needs
        # (Numba: seconds each, first run only; later runs load them from its cache).
        status(f"{shape.phase}: {kv_dtype}: compiling kernels (first run only)")
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
              repeats: dict[str, int], rounds: int, progress: Progress, status: Progress) -> dict:
    """repeats: timed calls per case and phase ("decode", "prefill"), spread over `rounds` rounds."""
    cases = []
    for shape in shapes:
        cases += bench_shape(shape, kv_dtypes, device, warmup, repeats[shape.phase], rounds, progress,
                             status)
    return {"backend": device, "model_dtype": MODEL_DTYPE.name, "block_size": BLOCK_SIZE,
            "warmup": warmup, "settle_s": SETTLE_S, "rounds": rounds, "cases": cases}


def total_steps(shapes: tuple[Shape, ...], kv_dtypes: tuple[str, ...], repeats: dict[str, int],
                rounds: int) -> int:
    return sum(len(split_repeats(repeats[shape.phase], rounds)) * (1 + len(kv_dtypes)) for shape in shapes)
