"""Host time a call spends in Python before its kernels are queued, per public
operation, on the bench's shapes (32 query / 8 KV heads, d = 128, block size
16; torch bf16 tensors, or CuPy fp16 arrays), beside torch's own SDPA on the
same query and a dense cache of the same context.

    PYTHONPATH=. python3 tools/host_overhead.py [--calls 400] [--profile OUT.txt] [--frameworks torch,cupy]

Cases: attention and writes with a plan reused across calls (`plan_batch`,
`plan_slots`: what a model's layers share), and with the metadata as device
arrays on each call and no plan ("device metadata"). Repeated calls replay
their launches (kvcupy.replay); the first calls, made during warm-up, take
the full path.

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


def attention_case(framework: str, kv_dtype: str, num_seqs: int, seq_len: int, query_len: int,
                   planned: bool = True):
    randn, dtype = tensors(framework)
    pages = math.ceil(seq_len / BLOCK_SIZE)
    table = np.random.default_rng(0).permutation(num_seqs * pages).astype(np.int32).reshape(num_seqs, pages)
    lens = np.full(num_seqs, seq_len, np.int32)
    starts = np.arange(num_seqs + 1, dtype=np.int32) * query_len
    cache = kc.allocate_cache(num_seqs * pages, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype, device="cuda",
                              dtype=dtype)
    query = randn((num_seqs * query_len, HEADS, HEAD_SIZE), 1)
    out = randn((num_seqs * query_len, HEADS, HEAD_SIZE), 2)
    if planned:
        batch = kc.plan_batch(block_table=table, seq_lens=lens, cu_seqlens_q=starts, block_size=BLOCK_SIZE,
                              num_blocks=num_seqs * pages, num_query_tokens=num_seqs * query_len)
        return lambda: kc.paged_attention(query, cache, batch=batch, out=out)
    table, lens, starts = (on_device(framework, array) for array in (table, lens, starts))
    starts = starts if query_len > 1 else None
    return lambda: kc.paged_attention(query, cache, block_table=table, seq_lens=lens, cu_seqlens_q=starts,
                                      max_query_len=query_len, max_seq_len=seq_len, out=out)


def on_device(framework: str, array: np.ndarray):
    if framework == "torch":
        import torch
        return torch.as_tensor(array, device="cuda")
    return cupy.asarray(array)


def write_case(framework: str, kv_dtype: str, num_tokens: int, planned: bool = True):
    randn, dtype = tensors(framework)
    pages = math.ceil(num_tokens / BLOCK_SIZE)
    slot_ids = np.arange(num_tokens, dtype=np.int64)
    slots = kc.plan_slots(slot_ids, num_slots=pages * BLOCK_SIZE) if planned else on_device(framework, slot_ids)
    cache = kc.allocate_cache(pages, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype, device="cuda", dtype=dtype)
    key, value = randn((num_tokens, KV_HEADS, HEAD_SIZE), 3), randn((num_tokens, KV_HEADS, HEAD_SIZE), 4)
    return lambda: kc.reshape_and_cache(key, value, cache, slots)


def rotate_case(framework: str, num_vectors: int):
    randn, _ = tensors(framework)
    plan = kc.rotation_plan(HEAD_SIZE, "blockdiag")
    x = randn((num_vectors, HEAD_SIZE), 5)
    return lambda: kc.rotate(x, plan)


def sdpa_case(num_seqs: int, seq_len: int, query_len: int):
    """torch's SDPA on the same query over a dense bf16 cache [S, Hkv, context, d]
    (GQA by enable_gqa): its host cost."""
    import torch.nn.functional as F
    randn, _ = tensors("torch")
    query = randn((num_seqs, HEADS, query_len, HEAD_SIZE), 1)
    keys = randn((num_seqs, KV_HEADS, seq_len, HEAD_SIZE), 2)
    values = randn((num_seqs, KV_HEADS, seq_len, HEAD_SIZE), 3)
    causal = query_len > 1 and query_len == seq_len
    return lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=causal, enable_gqa=True)


def cases(framework: str):
    yield "decode int4 32 x 8192", attention_case(framework, "int4_per_token_head", 32, 8192, 1)
    yield "decode int4 32 x 8192, device metadata", attention_case(framework, "int4_per_token_head", 32, 8192, 1,
                                                                   planned=False)
    yield "decode int8 8 x 32768", attention_case(framework, "int8_per_token_head", 8, 32768, 1)
    yield "prefill int4 64 x 128", attention_case(framework, "int4_per_token_head", 64, 128, 128)
    yield "prefill int4 64 x 128, device metadata", attention_case(framework, "int4_per_token_head", 64, 128, 128,
                                                                   planned=False)
    yield "write int4 32768", write_case(framework, "int4_per_token_head", 32768)
    yield "write int4 32 (decode step)", write_case(framework, "int4_per_token_head", 32)
    yield "write int4 32 (decode step), device slots", write_case(framework, "int4_per_token_head", 32,
                                                                  planned=False)
    yield "rotate 2^16 x 128", rotate_case(framework, 1 << 16)
    if framework == "torch":
        yield "SDPA decode bf16 32 x 8192", sdpa_case(32, 8192, 1)
        yield "SDPA decode bf16 8 x 32768", sdpa_case(8, 32768, 1)
        yield "SDPA prefill bf16 64 x 128", sdpa_case(64, 128, 128)


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
