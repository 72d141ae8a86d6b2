"""The write path's cost with and without its rotation, against a copy of the same bytes.

    PYTHONPATH=.:tools python3 tools/write_rotations.py   (from the repository root: cli/ too)

The bench's write shape (32768 tokens x 8 KV heads, d = 128, bf16 keys and
values from torch, pages in random order) into int4 and int8 caches rotated
blockdiag and not rotated at all, alternating over two rounds: the median
milliseconds of a reshape_and_cache call (gpu_timing), its TB/s on the bytes
read and written, and the fraction of a device-to-device copy of as many bytes.
The unrotated int4 write bounds what any cheaper rotation could reach: the
quantizer and packing alone. Prints one line a case and writes
write_rotations.json to $OUT (or the current folder).
"""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np
import torch

import kvcupy as kc
from kvcupy.bench.accounting import copy_bytes, write_bytes
from kvcupy.bench.shapes import WriteShape
from gpu_timing import median_call_ms, save_results   # tools/, beside this script

TOKENS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32768, 8, 128, 16


def main() -> None:
    torch.manual_seed(0)
    key, value = (torch.randn(TOKENS, KV_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pages = TOKENS // BLOCK_SIZE
    order = np.random.default_rng(0).permutation(pages)
    positions = np.arange(TOKENS)
    slots = torch.as_tensor(order[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE, device="cuda",
                            dtype=torch.int64)
    results = []
    for round_ in range(2):
        for kv_dtype in ("int4_per_token_head", "int8_per_token_head"):
            for rotation in ("blockdiag", "none"):
                cache = kc.allocate_cache(pages, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype, device="cuda",
                                          rotation=kc.rotation_plan(HEAD_SIZE, rotation))
                # The bench's count: K and V read, the packed rows and scales written.
                moved = write_bytes(WriteShape(TOKENS, KV_HEADS, HEAD_SIZE), kv_dtype, np.dtype(ml_dtypes.bfloat16))
                ms = median_call_ms(lambda: kc.reshape_and_cache(key, value, cache, slots), rounds=15,
                                    calls_per_round=10)
                source = cupy.empty(copy_bytes(moved) // 2, cupy.uint8)   # read + written = the bytes moved
                target = cupy.empty_like(source)
                copy_ms = median_call_ms(lambda: target.__setitem__(Ellipsis, source), rounds=15, calls_per_round=10)
                record = dict(round=round_, kv_dtype=kv_dtype, rotation=rotation, ms=round(ms, 4),
                              tb_per_s=round(moved / ms / 1e9, 3), copy_ms=round(copy_ms, 4),
                              fraction_of_copy=round(copy_ms / ms, 3))
                print(record, flush=True)
                results.append(record)
    save_results("write_rotations.json", results)


if __name__ == "__main__":
    main()
