"""One attention call of a bench shape, for profilers (ncu, compute-sanitizer).

    PYTHONPATH=. ncu -k regex:paged_attention -s 2 -c 1 python3 tools/decode_shape.py [kv_dtype] [--prefill]

kv_dtype: any, auto too (an fp16 cache of random rows).

Decode (default): 32 sequences x 32768 tokens, one query token each. --prefill:
4 sequences x 8192 tokens attending causally to themselves (the prefill
target's shape). --shape SEQS,CONTEXT,QUERY_LEN: any other (64,128,128: the
short prompts). 32 query / 8 KV heads, d = 128, block size 16, on a cache of
random codes and scales in shuffled pages, no rotation unless --rotation says
one; three calls (profile the third).
Prints the kernel specialisation the plan chose and its split count.
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

import kvcupy as kc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kv_dtype", nargs="?", default="int4_per_token_head")
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--shape", default=None, help="SEQS,CONTEXT,QUERY_LEN")
    parser.add_argument("--rotation", default="none")
    args = parser.parse_args()
    kv_dtype, head_size = args.kv_dtype, args.head_size
    sequences, context = (4, 8192) if args.prefill else (32, 32768)
    query_len = context if args.prefill else 1
    if args.shape:
        sequences, context, query_len = (int(x) for x in args.shape.split(","))
    kv_heads, query_heads, block_size = 8, 32, 16
    rng = np.random.default_rng(0)
    pages = sequences * (-(-context // block_size))
    info = kc.formats.kv_dtype_info(kv_dtype)
    shape = (pages, block_size, kv_heads, info.stored_head_size(head_size))
    rotation = kc.rotation_plan(head_size, args.rotation)
    if info.quantized:
        key, value = (cupy.asarray(rng.integers(0, 256, shape, dtype=np.uint8)).view(info.storage) for _ in range(2))
        scales = cupy.asarray((rng.random((pages, block_size, kv_heads)) * 0.1 + 0.01).astype(np.float32))
        cache = kc.wrap_cache(key, value, scales, scales.copy(), kv_dtype=kv_dtype, rotation=rotation)
    else:   # auto: fp16 rows
        key, value = (cupy.asarray(rng.standard_normal(shape).astype(np.float16)) for _ in range(2))
        cache = kc.wrap_cache(key, value, kv_dtype=kv_dtype, rotation=rotation)
    table = rng.permutation(pages).astype(np.int32).reshape(sequences, -1)
    batch = kc.plan_batch(block_table=table, seq_lens=np.full(sequences, context, np.int32),
                          cu_seqlens_q=np.arange(sequences + 1, dtype=np.int32) * query_len,
                          block_size=block_size, num_blocks=pages)
    query = cupy.asarray(rng.standard_normal((sequences * query_len, query_heads, head_size)).astype(np.float16))
    out = cupy.empty_like(query)
    for _ in range(3):
        kc.paged_attention(query, cache, batch=batch, out=out)
    cupy.cuda.Device().synchronize()
    (plan,) = batch._backend_plans.values()
    print(plan.kernel, f"splits={plan.num_splits}")


if __name__ == "__main__":
    main()
