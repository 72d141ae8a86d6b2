"""A/B timings of the prefill attention kernel under planner variants, in one process.

    PYTHONPATH=. python3 tools/prefill_variants.py VARIANTS [SHAPES]

VARIANTS is a JSON list; each variant has a "name" and any of:
  "dtypes":     KV dtypes to time (default ["int4_per_token_head"]); "auto_bf16": an auto
                cache of bf16 rows under a bf16 query (torch tensors; "auto" is fp16 rows
                under an fp16 query)
  "src":        a folder of kernel sources to compile instead of kernels_cu/ (KVCUPY_KERNEL_DIR)
  "tuning":     planner tunables, {field: value} of kvcupy.backends.cuda.tuning.Tuning (e.g.
                {"prefill_wgmma": false}, {"prefill_producer_min_keys": 0},
                {"prefill_short_keys": 0}, {"max_splits": 1}, {"prefill_split_gain": 0.8})
  "rotation":   the caches' rotation kind (default "none"; the bench's caches use "blockdiag")
  "head_size":  default 128
  "nvrtc_options": extra NVRTC options for every build (jit.EXTRA_OPTIONS, in place of
                $KVCUPY_NVRTC_OPTIONS's), e.g. ["-Ofc=mid"]
SHAPES is a JSON list of [sequences, context, new tokens] (default [[4, 8192, 8192]]:
the prefill target's causal prompt; [4, 32768, 2048] is its chunked prefill, 2048
new tokens over 30720 cached). 32 query / 8 KV heads, d = 128 (or "head_size"
in a variant), block size 16, pages in random order, random codes and scales,
no rotation unless a variant names one.

Each (variant, dtype, shape) is timed as the whole paged_attention call (the
prefill kernel, and the merge and inverse rotation when it splits the keys),
two calls between CUDA events after 3 warm-up calls,
the median of 7, each pair queued behind a hold kernel (gpu_timing); TFLOP/s
counts 4 d Hq per (query, key it sees): the causal square by halves, a chunk's
cached part in full. Prints one JSON line a case
and writes prefill_variants.json (gpu_timing.save_results).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import cupy
import numpy as np

import kvcupy as kc
from kvcupy import jit
from kvcupy.backends.cuda.tuning import DEFAULT_TUNING
from gpu_timing import median_call_ms, save_results   # tools/, beside this script

QUERY_HEADS, KV_HEADS, BLOCK_SIZE = 32, 8, 16


def make_case(kv_dtype: str, sequences: int, context: int, new_tokens: int, head_size: int, rotation: str,
              rng) -> dict:
    pages = sequences * context // BLOCK_SIZE
    info = kc.formats.kv_dtype_info("auto" if kv_dtype == "auto_bf16" else kv_dtype)
    rows = (pages, BLOCK_SIZE, KV_HEADS, info.stored_head_size(head_size))
    rotation = kc.rotation_plan(head_size, rotation)
    query_shape = (sequences * new_tokens, QUERY_HEADS, head_size)
    query = cupy.asarray(rng.standard_normal(query_shape).astype(np.float16))
    if kv_dtype == "auto_bf16":   # CuPy has no bfloat16: torch's tensors, through DLPack
        import torch
        key = torch.as_tensor(rng.standard_normal(rows), device="cuda").to(torch.bfloat16)
        cache = kc.wrap_cache(key, key.clone(), kv_dtype="auto", rotation=rotation)
        query = torch.as_tensor(cupy.asnumpy(query).astype(np.float32), device="cuda").to(torch.bfloat16)
    elif kv_dtype == "auto":
        key = cupy.asarray(rng.standard_normal(rows).astype(np.float16))
        cache = kc.wrap_cache(key, key.copy(), kv_dtype="auto", rotation=rotation)
    else:
        key, value = (cupy.asarray(rng.integers(0, 256, rows, dtype=np.uint8)).view(info.storage) for _ in range(2))
        scales = cupy.asarray((rng.random(rows[:3]) * 0.1 + 0.01).astype(np.float32))
        cache = kc.wrap_cache(key, value, scales, scales.copy(), kv_dtype=kv_dtype, rotation=rotation)
    first = context - new_tokens + 1                     # keys the first new token sees
    attended = sequences * (first + context) * new_tokens // 2
    return dict(cache=cache, sequences=sequences, context=context, new_tokens=new_tokens, pages=pages,
                table=rng.permutation(pages).astype(np.int32).reshape(sequences, -1),
                query=query,
                flops=4 * head_size * QUERY_HEADS * attended)


def time_case(case: dict, tuning) -> tuple[float, object]:
    batch = kc.plan_batch(block_table=case["table"], seq_lens=np.full(case["sequences"], case["context"], np.int32),
                          cu_seqlens_q=np.arange(case["sequences"] + 1, dtype=np.int32) * case["new_tokens"],
                          block_size=BLOCK_SIZE, num_blocks=case["pages"], tuning=tuning)
    query = case["query"]
    out = cupy.empty_like(query) if isinstance(query, cupy.ndarray) else query.new_empty(query.shape)

    def call():
        kc.paged_attention(case["query"], case["cache"], batch=batch, out=out)

    ms = median_call_ms(call, rounds=7, calls_per_round=2)
    (plan,) = batch._backend_plans.values()
    return ms, plan


def with_variant(variant: dict, run):
    """run(tuning) with the variant's tuning, kernel sources and NVRTC options, restored after."""
    source = os.environ.get(jit.SOURCE_DIR_ENV)
    plain_options = jit.EXTRA_OPTIONS
    jit.EXTRA_OPTIONS = tuple(variant.get("nvrtc_options", plain_options))
    if "src" in variant:
        os.environ[jit.SOURCE_DIR_ENV] = os.path.abspath(variant["src"])
    try:
        return run(replace(DEFAULT_TUNING, **variant.get("tuning", {})))
    finally:
        jit.EXTRA_OPTIONS = plain_options
        if source is None:
            os.environ.pop(jit.SOURCE_DIR_ENV, None)
        else:
            os.environ[jit.SOURCE_DIR_ENV] = source


def main() -> None:
    variants = json.loads(sys.argv[1])
    shapes = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [[4, 8192, 8192]]
    rng = np.random.default_rng(0)
    cases, results = {}, []
    for variant in variants:
        head_size = variant.get("head_size", 128)
        rotation = variant.get("rotation", "none")
        for kv_dtype in variant.get("dtypes", ["int4_per_token_head"]):
            for sequences, context, new_tokens in shapes:
                key = (kv_dtype, sequences, context, new_tokens, head_size, rotation)
                if key not in cases:
                    cases[key] = make_case(kv_dtype, sequences, context, new_tokens, head_size, rotation, rng)
                record = dict(name=variant["name"], kv_dtype=kv_dtype, shape=[sequences, context, new_tokens],
                              head_size=head_size, rotation=rotation)
                try:
                    ms, plan = with_variant(variant, lambda tuning: time_case(cases[key], tuning))
                    record.update(ms=ms, tflop_per_s=cases[key]["flops"] / ms / 1e9, kernel=str(plan.kernel),
                                  splits=plan.num_splits)
                except Exception as error:   # one variant failing to build must not stop the others
                    record.update(error=f"{type(error).__name__}: {error}"[-400:])
                print(json.dumps(record), flush=True)
                results.append(record)
    save_results("prefill_variants.json", results)


if __name__ == "__main__":
    main()
