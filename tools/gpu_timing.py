"""Shared by the GPU measurement tools: the median time of a call by CUDA events."""

from __future__ import annotations

import json
import os
import time

import cupy
import numpy as np

from kvcupy.bench import kernels as bench_kernels
from kvcupy.bench.runner import hold_seconds

# Each round is queued behind hold_stream, as `kvcupy bench` does (the same
# hold_seconds): the events then time the GPU's work back to back, not how fast
# Python issues launches (a decode call at 32 x 8192 takes about as long on the
# host as on the GPU).


def median_call_ms(call, rounds: int, calls_per_round: int, warmup: int = 3) -> float:
    """Median over `rounds` of the mean time of `calls_per_round` back-to-back calls
    between two CUDA events on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    cupy.cuda.get_current_stream().synchronize()
    begin = time.perf_counter()
    call()
    host_s = time.perf_counter() - begin
    hold = bench_kernels.get_function("hold_stream", "hold_stream", {})
    hold_ns = int(hold_seconds(calls_per_round * host_s) * 1e9)
    times = []
    for _ in range(rounds):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.get_current_stream().synchronize()
        hold((1,), (1,), (np.uint64(hold_ns),))
        start.record()
        for _ in range(calls_per_round):
            call()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / calls_per_round)
    return float(np.median(times))


def save_results(name: str, records: list) -> None:
    """`records` as JSON to `name` in the folder the environment variable OUT names,
    else in the current folder."""
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as handle:
        json.dump(records, handle, indent=1)
