"""Per-channel error of decode attention against the float64 oracle, by context.

    PYTHONPATH=. python3 tools/decode_bias.py [--device cuda] [--contexts 256,4096,32768,131072]
        [--kv-dtypes int4_per_token_head,int8_per_token_head] [--head-sizes 128]
        [--attention normal,flat,peaked] [--src NAME=DIR ...] [--seed 0] [--json FILE]

The case: 2 sequences of `context` tokens, 2 KV heads, 4 query heads a KV head,
block size 16, keys and values N(0, 1) in bfloat16 (keys with 4 outlier
channels x 8) written by reshape_and_cache on the device, float32 queries
N(0, 1) times a factor: 1 ("normal"), 0.05 ("flat": the softmax nearly uniform,
the output small) or 4 ("peaked"). The oracle (reference.paged_attention) reads
the same cache bytes. Per output channel c: mean |out - oracle| over the rows,
and the signed mean, both divided by the oracle's RMS over every channel.
Prints one line a case with the overall relative error, the worst channel, the
first channel of every rotation block (where the inverse rotation puts an
error common to a block) and the median channel.

--src NAME=DIR (repeatable) runs the attention over each folder of kernel
sources (KVCUPY_KERNEL_DIR) on the same cache and query, e.g. an older
version's kernels_cu/ beside the current one.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import kvcupy as kc
from kvcupy import jit, reference
from kvcupy.formats import MODEL_DTYPES

QUERY_FACTORS = {"normal": 1.0, "flat": 0.05, "peaked": 4.0}
SEQUENCES, KV_HEADS, GROUP, BLOCK_SIZE = 2, 2, 4, 16


def channel_errors(out: np.ndarray, want: np.ndarray) -> dict:
    """Error statistics of [rows..., channels] outputs, relative to the oracle's RMS."""
    rows = out.reshape(-1, out.shape[-1]).astype(np.float64)
    want = want.reshape(rows.shape).astype(np.float64)
    rms = float(np.sqrt(np.mean(want ** 2)))
    error = rows - want
    return dict(overall=float(np.linalg.norm(error) / np.linalg.norm(want)),
                mean_abs=np.mean(np.abs(error), axis=0) / rms,
                signed=np.mean(error, axis=0) / rms)


def make_case(kv_dtype: str, head_size: int, context: int, seed: int, device: str):
    """The cache written on `device`, its host copy, the block table and the lengths."""
    rng = np.random.default_rng(seed)
    pages = -(-context // BLOCK_SIZE)
    num_blocks = SEQUENCES * pages
    block_table = rng.permutation(num_blocks).astype(np.int32).reshape(SEQUENCES, pages)
    positions = np.arange(context)
    slot_mapping = (block_table[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).reshape(-1)
    shape = (SEQUENCES * context, KV_HEADS, head_size)
    keys = rng.standard_normal(shape, dtype=np.float32)
    keys[..., :4] *= 8
    values = rng.standard_normal(shape, dtype=np.float32)
    bf16 = MODEL_DTYPES["bfloat16"]
    keys, values = keys.astype(bf16), values.astype(bf16)
    cache = kc.allocate_cache(num_blocks, BLOCK_SIZE, KV_HEADS, head_size, kv_dtype, device=device, dtype="bfloat16")
    if device == "cpu":
        kc.reshape_and_cache(keys, values, cache, slot_mapping.astype(np.int64))
    else:
        import torch

        def on_device(x):
            return torch.from_numpy(x.view(np.uint16)).to(device).view(torch.bfloat16)

        kc.reshape_and_cache(on_device(keys), on_device(values), cache,
                             torch.from_numpy(slot_mapping.astype(np.int64)).to(device))
    host = kc.wrap_cache(*(to_host(t) for t in (cache.key_cache, cache.value_cache,
                                                 cache.k_scale_cache, cache.v_scale_cache)),
                         kv_dtype=kv_dtype, rotation=cache.rotation)
    return cache, host, block_table, np.full(SEQUENCES, context, np.int32)


def to_host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def attend(query: np.ndarray, cache, block_table, seq_lens, device: str) -> np.ndarray:
    cu_seqlens_q = np.arange(SEQUENCES + 1, dtype=np.int32)
    if device == "cpu":
        return np.asarray(kc.paged_attention(query, cache, block_table=block_table, seq_lens=seq_lens,
                                             cu_seqlens_q=cu_seqlens_q))
    import cupy
    out = kc.paged_attention(cupy.asarray(query), cache, block_table=block_table, seq_lens=seq_lens,
                             cu_seqlens_q=cu_seqlens_q)
    return cupy.asnumpy(out)


def use_sources(directory: str | None) -> None:
    """Compile from `directory` (None: the default kernels_cu/) from now on."""
    if directory:
        os.environ[jit.SOURCE_DIR_ENV] = os.path.abspath(directory)
    else:
        os.environ.pop(jit.SOURCE_DIR_ENV, None)


def block_starts(cache) -> list[int]:
    plan = cache.rotation
    if plan is None or plan.is_identity:
        return [0]
    return list(range(0, cache.head_size, plan.block))


def summary(stats: dict, starts: list[int]) -> dict:
    mean_abs, signed = stats["mean_abs"], stats["signed"]
    return dict(overall=stats["overall"], worst_channel=int(np.argmax(mean_abs)), worst=float(mean_abs.max()),
                block_starts={c: float(mean_abs[c]) for c in starts}, median=float(np.median(mean_abs)),
                worst_signed=float(np.abs(signed).max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default="256,4096,32768,131072")
    parser.add_argument("--kv-dtypes", default="int4_per_token_head,int8_per_token_head")
    parser.add_argument("--head-sizes", default="128")
    parser.add_argument("--attention", default="normal")
    parser.add_argument("--src", action="append", default=[], help="NAME=DIR: kernel sources to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args()
    sources = [tuple(item.split("=", 1)) for item in args.src] or [("current", None)]
    records = []
    for kv_dtype in args.kv_dtypes.split(","):
        for head_size in map(int, args.head_sizes.split(",")):
            for context in map(int, args.contexts.split(",")):
                cache, host, block_table, seq_lens = make_case(kv_dtype, head_size, context, args.seed, args.device)
                rng = np.random.default_rng(args.seed + 1)
                base_query = rng.standard_normal((SEQUENCES, KV_HEADS * GROUP, head_size), dtype=np.float32)
                for attention in args.attention.split(","):
                    query = (base_query * np.float32(QUERY_FACTORS[attention])).astype(np.float32)
                    want = reference.paged_attention(query, host, block_table=block_table, seq_lens=seq_lens,
                                                     cu_seqlens_q=np.arange(SEQUENCES + 1, dtype=np.int32))
                    for name, directory in sources:
                        use_sources(directory)
                        out = attend(query, cache, block_table, seq_lens, args.device)
                        record = dict(src=name, kv_dtype=kv_dtype, head_size=head_size, context=context,
                                      attention=attention,
                                      **summary(channel_errors(out, want), block_starts(host)))
                        print(json.dumps(record), flush=True)
                        records.append(record)
    use_sources(None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
