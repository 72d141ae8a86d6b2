"""Where a prefill call's time goes, block by block: global-timer stamps of every
prefill block (prefill.cuh's marks in the KVC_TRACE build) over one call.

    PYTHONPATH=.:tools python3 tools/prefill_trace.py [VARIANT] [SHAPE]

VARIANT is a prefill_variants.py variant (JSON object; default the planner's
build, blockdiag caches, int4), SHAPE [sequences, context, new tokens] (default
[64, 128, 128], the short-prompt target). After warm-up calls of the traced
build, one call runs on an idle GPU; times are in microseconds from the first
block's start. Thread 0 of each block stamps its milestones (so they time warp
0's progress): start, the first tiles' copies issued, the query loaded and
rotated in registers, its rows in shared memory, the first tile landed and
decoded, the loop entered, tile 0 done, the loop left, (blocks that rotate
their output back) the rows normalised, and the end. Prints percentiles of
each phase, and per multiprocessor: blocks run, the time they were busy
against the span from its first start to its last end, and the gap between one
block's end and the next block's start there (one block a multiprocessor: the
launch gap). Writes prefill-trace-SxN.json (every stamp) to $OUT (or the current folder). Read
microseconds, not less: the timer ticks in tens of nanoseconds or more.
"""

from __future__ import annotations

import json
import os
import sys

import cupy
import numpy as np

import kvcupy as kc
from decode_trace import (COPIES_OUT, DONE, FIRST_LANDED, FIRST_TILE, LOOP, LOOP_EXIT, OUTPUT_NORMALISED,  # tools/
                          QUERY_READY, QUERY_ROTATED, SM, START, TRACE_BLOCKS, idle_call_us, percentiles,
                          traced_tables)
from prefill_variants import make_case, with_variant


def main() -> None:
    variant = {"name": "planned", "rotation": "blockdiag", **(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})}
    sequences, context, new_tokens = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [64, 128, 128]
    kv_dtype = variant.get("dtypes", ["int4_per_token_head"])[0]
    variant["defines"] = {**variant.get("defines", {}), "KVC_TRACE": TRACE_BLOCKS}
    case = make_case(kv_dtype, sequences, context, new_tokens, variant.get("head_size", 128), variant["rotation"],
                     np.random.default_rng(0))
    batch = kc.plan_batch(block_table=case["table"], seq_lens=np.full(sequences, context, np.int32),
                          cu_seqlens_q=np.arange(sequences + 1, dtype=np.int32) * new_tokens,
                          block_size=16, num_blocks=case["pages"])
    out = cupy.empty_like(case["query"])
    call_us = with_variant(variant, lambda: idle_call_us(
        lambda: kc.paged_attention(case["query"], case["cache"], batch=batch, out=out)))
    (plan,) = batch._backend_plans.values()
    (table,) = [table for flags, table in traced_tables("KVC_TRACE") if any("KVC_PREFILL_KV" in f for f in flags)]
    stamps = table[table[:, START] > 0]
    origin = stamps[:, START].min()

    def us(column):
        return (stamps[:, column].astype(np.int64) - np.int64(origin)) / 1e3

    with_products = stamps[:, FIRST_TILE] > 0   # blocks of at least two tiles stamp the first's end
    rotated_back = stamps[:, OUTPUT_NORMALISED] > 0   # blocks that rotate their output back
    report = dict(kv_dtype=kv_dtype, shape=[sequences, context, new_tokens], kernel=str(plan.kernel),
                  splits=plan.num_splits, blocks=len(stamps), call_event_us=round(call_us, 2),
                  block_time=percentiles(us(DONE) - us(START)),
                  copies_out=percentiles(us(COPIES_OUT) - us(START)),
                  query_rotated=percentiles(us(QUERY_ROTATED) - us(COPIES_OUT)),
                  query_ready=percentiles(us(QUERY_READY) - us(QUERY_ROTATED)),
                  first_landed=percentiles(us(FIRST_LANDED) - us(QUERY_READY)),
                  first_decoded=percentiles(us(LOOP) - us(FIRST_LANDED)),
                  first_tile=percentiles((us(FIRST_TILE) - us(LOOP))[with_products]),
                  loop=percentiles(us(LOOP_EXIT) - us(LOOP)),
                  epilogue=percentiles(us(DONE) - us(LOOP_EXIT)),
                  output_normalised=percentiles((us(OUTPUT_NORMALISED) - us(LOOP_EXIT))[rotated_back]),
                  output_rotated_stored=percentiles((us(DONE) - us(OUTPUT_NORMALISED))[rotated_back]),
                  done=percentiles(us(DONE)))
    sms = stamps[:, SM].astype(np.int64)
    per_sm = {"blocks": [], "busy_share": [], "gap": []}
    for sm in np.unique(sms):
        mine = np.argsort(us(START)[sms == sm])
        starts, ends = us(START)[sms == sm][mine], us(DONE)[sms == sm][mine]
        per_sm["blocks"].append(len(starts))
        per_sm["busy_share"].append(float(np.sum(ends - starts) / (ends.max() - starts.min())))
        per_sm["gap"].extend((starts[1:] - ends[:-1]).tolist())
    report.update({f"sm_{name}": percentiles(np.asarray(values)) for name, values in per_sm.items()})
    for name, value in report.items():
        print(f"{name:>22}: {value}")
    folder = os.environ.get("OUT", ".")
    with open(os.path.join(folder, f"prefill-trace-{sequences}x{new_tokens}.json"), "w") as f:
        json.dump(dict(report=report, stamps=stamps.tolist()), f)


if __name__ == "__main__":
    main()
