"""Host time a call spends in Python before its kernels are queued, per public
operation, on the bench's shapes (32 query / 8 KV heads, d = 128, block size
16; torch bf16 tensors through DLPack, as `kvcupy bench --backend cuda`).

    PYTHONPATH=. python3 tools/host_overhead.py [--calls 400] [--profile OUT.txt] [--frameworks torch,cupy]

For each case: warm-up calls, then `--calls` calls timed with perf_counter
while the GPU is held busy by a hold kernel (so that no call waits for the
device; the queue never fills: the hold lasts longer than the calls), then a
synchronisation. Prints one JSON line a case (median and mean microseconds a
call over 5 batches of calls/5) and, with --profile, writes cProfile's
listing of each case (sorted by internal time) to OUT.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import statistics
import time

import cupy
import numpy as np

import kvcupy as kc
from kvcupy.bench import kernels as bench_kernels

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_SIZE = 16, 32, 8, 128


def tensors(framework: str):
    """randn(shape, seed) in bf16 (torch) or fp16 (CuPy: no bfloat16) on the GPU."""
    if framework == "torch":
        import torch

        def randn(shape, seed):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            return torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
        return randn, "bfloat16"

    def randn(shape, seed):
        return cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    return randn, "float16"


def attention_case(framework: str, kv_dtype: str, num_seqs: int, seq_len: int, query_len: int):
    randn, dtype = tensors(framework)
    pages = math.ceil(seq_len / BLOCK_SIZE)
    table = np.random.default_rng(0).permutation(num_seqs * pages).astype(np.int32).reshape(num_seqs, pages)
    batch = kc.plan_batch(block_table=table, seq_lens=np.full(num_seqs, seq_len, np.int32),
                          cu_seqlens_q=np.arange(num_seqs + 1, dtype=np.int32) * query_len,
                          block_size=BLOCK_SIZE, num_blocks=num_seqs * pages, num_query_tokens=num_seqs * query_len)
    cache = kc.allocate_cache(num_seqs * pages, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype, device="cuda",
                              dtype=dtype)
    query = randn((num_seqs * query_len, HEADS, HEAD_SIZE), 1)
    out = randn((num_seqs * query_len, HEADS, HEAD_SIZE), 2)
    return lambda: kc.paged_attention(query, cache, batch=batch, out=out)


def write_case(framework: str, kv_dtype: str, num_tokens: int):
    randn, dtype = tensors(framework)
    pages = math.ceil(num_tokens / BLOCK_SIZE)
    slots = kc.plan_slots(np.arange(num_tokens, dtype=np.int64), num_slots=pages * BLOCK_SIZE)
    cache = kc.allocate_cache(pages, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype, device="cuda", dtype=dtype)
    key, value = randn((num_tokens, KV_HEADS, HEAD_SIZE), 3), randn((num_tokens, KV_HEADS, HEAD_SIZE), 4)
    return lambda: kc.reshape_and_cache(key, value, cache, slots)


def rotate_case(framework: str, num_vectors: int):
    randn, _ = tensors(framework)
    plan = kc.rotation_plan(HEAD_SIZE, "blockdiag")
    x = randn((num_vectors, HEAD_SIZE), 5)
    return lambda: kc.rotate(x, plan)


def cases(framework: str):
    yield "decode int4 32 x 8192", attention_case(framework, "int4_per_token_head", 32, 8192, 1)
    yield "decode int8 8 x 32768", attention_case(framework, "int8_per_token_head", 8, 32768, 1)
    yield "prefill int4 64 x 128", attention_case(framework, "int4_per_token_head", 64, 128, 128)
    yield "write int4 32768", write_case(framework, "int4_per_token_head", 32768)
    yield "write int4 32 (decode step)", write_case(framework, "int4_per_token_head", 32)
    yield "rotate 2^16 x 128", rotate_case(framework, 1 << 16)


def time_calls(call, calls: int, hold) -> list[float]:
    """Microseconds a call, one figure for each of 5 batches of calls / 5, behind a hold kernel."""
    per_batch = max(1, calls // 5)
    figures = []
    for _ in range(5):
        cupy.cuda.get_current_stream().synchronize()
        hold((1,), (1,), (np.uint64(int(per_batch * 2e-3 * 1e9)),))   # 2 ms a call: longer than any
        begin = time.perf_counter()
        for _ in range(per_batch):
            call()
        figures.append((time.perf_counter() - begin) * 1e6 / per_batch)
        cupy.cuda.get_current_stream().synchronize()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--frameworks", default="torch,cupy")
    args = parser.parse_args()
    hold = bench_kernels.get_function("hold_stream", "hold_stream", {})
    listing = io.StringIO()
    for framework in args.frameworks.split(","):
        for name, call in cases(framework):
            for _ in range(5):
                call()
            cupy.cuda.get_current_stream().synchronize()
            figures = time_calls(call, args.calls, hold)
            print(json.dumps({"case": name, "framework": framework, "median_us": round(statistics.median(figures), 1),
                              "mean_us": round(statistics.fmean(figures), 1)}), flush=True)
            if args.profile:
                profiler = cProfile.Profile()
                cupy.cuda.get_current_stream().synchronize()
                hold((1,), (1,), (np.uint64(int(args.calls * 4e-3 * 1e9)),))
                profiler.enable()
                for _ in range(args.calls):
                    call()
                profiler.disable()
                cupy.cuda.get_current_stream().synchronize()
                listing.write(f"\n===== {name} ({framework}), {args.calls} calls\n")
                stats = pstats.Stats(profiler, stream=listing)
                stats.sort_stats("tottime").print_stats(25)
                stats.sort_stats("cumulative").print_stats(35)
    if args.profile:
        with open(args.profile, "w") as file:
            file.write(listing.getvalue())


if __name__ == "__main__":
    main()
