"""Per-channel error of decode attention against the float64 oracle, by context,
for one or several kernel source folders on the same cache and query.

    PYTHONPATH=. python3 tools/decode_bias.py [--device cuda] [--contexts 256,4096,32768,131072]
        [--kv-dtypes int4_per_token_head,int8_per_token_head] [--head-sizes 128]
        [--factors 1,0.05] [--src NAME=DIR ...] [--json FILE]

The case is tests/gpu/test_long_context_error.py's: 2 sequences of `context` tokens,
2 KV heads, 4 query heads a KV head, block size 16, bfloat16 keys (4 outlier
channels x 8) and values N(0, 1); float32 queries N(0, 1) times each factor
(1: moderately peaked; 0.05: the softmax nearly uniform and the output small,
where an error common to many tokens shows). Per output channel: mean |out -
oracle| over the rows and the signed mean, over the oracle's RMS. Prints one
JSON line a case: the overall relative error, the worst channel, the first
channel of every rotation block (where the inverse rotation puts an error
common to a block) and the median channel.

--src NAME=DIR (repeatable) runs the attention compiled from each folder of
kernel sources (KVCUPY_KERNEL_DIR), e.g. an older version's kernels_cu/ beside
the current one, in one process.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import kvcupy as kc
from kvcupy import jit, reference
from tests.gpu.test_long_context_error import batch_args, channel_errors, long_cache, query_rows


def attend(query: np.ndarray, cache, block_table, context: int, device: str) -> np.ndarray:
    args = dict(block_table=block_table, **batch_args(context, 1))
    if device == "cpu":
        return np.asarray(kc.paged_attention(query, cache, **args))
    import cupy
    from tests.device_arrays import device_view
    return cupy.asnumpy(kc.paged_attention(cupy.asarray(query), device_view(cache), **args))


def use_sources(directory: str | None) -> None:
    """Compile from `directory` (None: the default kernels_cu/) from now on."""
    if directory:
        os.environ[jit.SOURCE_DIR_ENV] = os.path.abspath(directory)
    else:
        os.environ.pop(jit.SOURCE_DIR_ENV, None)


def summary(cache, out: np.ndarray, want: np.ndarray) -> dict:
    mean_abs, signed = channel_errors(out, want, np.dtype(np.float32))
    plan = cache.rotation
    starts = [0] if plan is None or plan.is_identity else list(range(0, cache.head_size, plan.block))
    overall = float(np.linalg.norm(out.reshape(want.shape) - want) / np.linalg.norm(want))
    return dict(overall=overall, worst_channel=int(np.argmax(mean_abs)), worst=float(mean_abs.max()),
                block_starts={c: float(mean_abs[c]) for c in starts}, median=float(np.median(mean_abs)),
                worst_signed=float(np.abs(signed).max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default="256,4096,32768,131072")
    parser.add_argument("--kv-dtypes", default="int4_per_token_head,int8_per_token_head")
    parser.add_argument("--head-sizes", default="128")
    parser.add_argument("--factors", default="1,0.05", help="query scale factors")
    parser.add_argument("--src", action="append", default=[], help="NAME=DIR: kernel sources to run")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args()
    sources = [tuple(item.split("=", 1)) for item in args.src] or [("current", None)]
    records = []
    for kv_dtype in args.kv_dtypes.split(","):
        for head_size in map(int, args.head_sizes.split(",")):
            for context in map(int, args.contexts.split(",")):
                cache, block_table = long_cache(kv_dtype, head_size, context)
                for factor in map(float, args.factors.split(",")):
                    query = query_rows(head_size, 1, factor)
                    want = reference.paged_attention(query, cache, block_table=block_table,
                                                     **batch_args(context, 1))
                    for name, directory in sources:
                        use_sources(directory)
                        out = attend(query, cache, block_table, context, args.device)
                        record = dict(src=name, kv_dtype=kv_dtype, head_size=head_size, context=context,
                                      query_factor=factor, **summary(cache, out, want))
                        print(json.dumps(record), flush=True)
                        records.append(record)
    use_sources(None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
