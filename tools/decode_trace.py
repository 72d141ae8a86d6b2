"""Where a decode call's time goes, block by block: global-timer stamps of every
attention and merge block (attention.cuh's KVC_TRACE build) over one call.

    PYTHONPATH=.:tools python3 tools/decode_trace.py [KV_DTYPE] [SHAPE] [DEFINES]

SHAPE is a JSON object over decode_variants.py's default shape (e.g.
'{"batch": 32, "context": 8192, "rotation": "blockdiag"}'); DEFINES, a JSON object
of extra -D defines for the attention build (timing variants). After warm-up calls
of the traced build, one call runs on an idle GPU; times are in microseconds
from the first attention block's start. Prints percentiles of each block's
phases (prologue and its steps, first tile's wait, tile loop, epilogue), when
half and three quarters of its tiles were in, when blocks start and end (and
per multiprocessor), the merge's span (with its blocks' wait for the attention
grid's results over: merge_waited), and writes trace-KV_DTYPE-BxL.json
(every stamp) to $OUT (or the current folder). The stamps cost a few
instructions a block; the timer ticks in tens of nanoseconds or more, so read
microseconds, not less.
"""

from __future__ import annotations

import json
import os
import sys

import cupy
import numpy as np

import kvcupy as kc
from kvcupy import jit
from kvcupy.backends import cuda_attention
from decode_variants import DEFAULT_SHAPE, decode_case   # tools/, beside this script

TRACE_BLOCKS = 16384
MARKS = 16           # attention.cuh: KVC_TRACE_MARKS, its TraceMark order below
START, LOOP, FIRST_TILE, LOOP_EXIT, DONE, SM, HALF, THREE_QUARTERS, PAGE_IDS, COPIES_OUT, QUERY_READY = range(11)
OUTPUT_NORMALISED, FIRST_LANDED, QUERY_ROTATED = range(11, 14)   # the prefill kernel's own (prefill_trace.py)
QUERY_IN, BARRIERS = 14, 15   # decode: the first quad's query bits in; past the barriers' setup


def traced_tables(defines_key: str) -> list:
    """Every loaded module's stamp table of the traced builds, as (entry flags, uint64 array)."""
    found = []
    for key, module in jit._modules.items():
        if any(defines_key in flag for flag in key[3]):
            table = module.get_global("kvc_trace")
            found.append((key[3], cupy.ndarray((TRACE_BLOCKS, MARKS), np.uint64, table).get()))
    return found


def idle_call_us(call) -> float:
    """Microseconds of one call() on an idle GPU (CUDA events), after five warm-up calls."""
    for _ in range(5):
        call()
    cupy.cuda.Device().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    call()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3


def percentiles(values: np.ndarray) -> dict:
    return {f"p{q}": round(float(np.percentile(values, q)), 2) for q in (0, 10, 50, 90, 100)} if len(values) else {}


def main() -> None:
    kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "int4_per_token_head"
    shape = {**DEFAULT_SHAPE, **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})}
    case = decode_case(kv_dtype, shape, np.random.default_rng(0))
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    plain = cuda_attention.Plan.function

    def traced(self, name, defines, kernel=None):
        more = extra if "KVC_OUT_T" not in defines else {}   # (the merge's build takes none)
        return plain(self, name, {**defines, **more, "KVC_TRACE": TRACE_BLOCKS}, kernel)

    cuda_attention.Plan.function = traced
    batch = kc.plan_batch(block_table=case["table"], seq_lens=np.full(shape["batch"], shape["context"], np.int32),
                          block_size=shape["block_size"], num_blocks=case["pages"])
    out = cupy.empty_like(case["query"])
    call_us = idle_call_us(lambda: kc.paged_attention(case["query"], case["cache"], batch=batch, out=out))
    (plan,) = batch._backend_plans.values()

    tables = {("merge" if any("KVC_OUT_T" in f for f in flags) else "attention"): table
              for flags, table in traced_tables("KVC_TRACE")}
    attention = tables["attention"]
    blocks = plan.num_splits * plan.num_tiles * plan.head_groups
    attention = attention[:min(blocks, TRACE_BLOCKS)]
    origin = attention[:, START].min()

    def us(column, table=attention):
        return (table[:, column].astype(np.int64) - np.int64(origin)) / 1e3

    report = dict(kv_dtype=kv_dtype, shape=shape, kernel=str(plan.kernel), splits=plan.num_splits,
                  blocks=blocks, call_event_us=round(call_us, 2),
                  start=percentiles(us(START)), loop_entry=percentiles(us(LOOP)),
                  first_tile=percentiles(us(FIRST_TILE)), loop_exit=percentiles(us(LOOP_EXIT)),
                  done=percentiles(us(DONE)),
                  prologue=percentiles(us(LOOP) - us(START)),
                  page_ids_in=percentiles(us(PAGE_IDS) - us(START)),
                  barriers_set=percentiles(us(BARRIERS) - us(START)),
                  first_copies_out=percentiles(us(COPIES_OUT) - us(START)),
                  query_in=percentiles(us(QUERY_IN) - us(START)),
                  query_rotated=percentiles(us(QUERY_ROTATED) - us(START)),
                  query_fragments=percentiles(us(QUERY_READY) - us(START)), first_wait=percentiles(us(FIRST_TILE) - us(LOOP)),
                  tile_loop=percentiles(us(LOOP_EXIT) - us(FIRST_TILE)),
                  half_tiles=percentiles(us(HALF)), three_quarters=percentiles(us(THREE_QUARTERS)),
                  epilogue=percentiles(us(DONE) - us(LOOP_EXIT)))
    sms = attention[:, SM].astype(np.int64)
    per_sm_end = np.array([us(DONE)[sms == s].max() for s in np.unique(sms)])
    per_sm_start = np.array([us(START)[sms == s].min() for s in np.unique(sms)])
    report["sm_first_start"] = percentiles(per_sm_start)
    report["sm_last_done"] = percentiles(per_sm_end)
    if "merge" in tables:
        merge = tables["merge"]
        used = merge[:, START] > 0
        merge = merge[used]
        report["merge_blocks"] = int(used.sum())
        report["merge_start"] = percentiles(us(START, merge))
        # A dependent merge's blocks start early and wait in the kernel (LOOP: the wait over).
        waited = merge[merge[:, LOOP] > 0]
        report["merge_waited"] = percentiles(us(LOOP, waited)) if len(waited) else None
        report["merge_done"] = percentiles(us(DONE, merge))
    for name, value in report.items():
        print(f"{name:>15}: {value}")
    folder = os.environ.get("OUT", ".")
    with open(os.path.join(folder, f"trace-{kv_dtype}-{shape['batch']}x{shape['context']}.json"), "w") as f:
        json.dump(dict(report=report, attention=attention.tolist(),
                       merge=tables["merge"][tables["merge"][:, START] > 0].tolist() if "merge" in tables else []),
                  f)


if __name__ == "__main__":
    main()
