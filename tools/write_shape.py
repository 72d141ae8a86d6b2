"""One write-path shape for profilers (ncu, compute-sanitizer): the bench's
32768 tokens x 8 KV heads, d = 128, bf16 keys and values into a GPU cache
(int4 by default, blockdiag rotation), three reshape_and_cache calls (profile the third).

    PYTHONPATH=. ncu --clock-control none -k regex:reshape_and_cache -s 2 -c 1 python3 tools/write_shape.py [kv_dtype]

torch supplies the bf16 inputs (CuPy has no bfloat16); kvcupy takes them through DLPack.
"""

from __future__ import annotations

import sys

import torch

import kvcupy as kc

TOKENS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32768, 8, 128, 16


def main() -> None:
    kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "int4_per_token_head"
    cache = kc.allocate_cache(TOKENS // BLOCK_SIZE, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype,
                              device="cuda")
    torch.manual_seed(0)
    key, value = (torch.randn(TOKENS, KV_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
    slots = torch.arange(TOKENS, device="cuda", dtype=torch.int64)
    for _ in range(3):
        kc.reshape_and_cache(key, value, cache, slots)
    torch.cuda.synchronize()
    print(f"{kv_dtype}: {TOKENS} tokens x {KV_HEADS} KV heads, d = {HEAD_SIZE}, rotation {cache.rotation}")


if __name__ == "__main__":
    main()
