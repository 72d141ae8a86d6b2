"""Shared by the GPU measurement tools: the median time of a call by CUDA events."""

from __future__ import annotations

import time

import cupy
import numpy as np

from kvcupy import jit

# Each round is queued behind hold_stream (as `kvcupy bench` does), which sleeps on
# the GPU for HOLD_MARGIN x the host time of issuing the round: the events then time
# the GPU's work back to back, not how fast Python issues launches (a decode call
# at 32 x 8192 takes about as long on the host as on the GPU).
HOLD_MARGIN = 2.0
MIN_HOLD_S, MAX_HOLD_S = 1e-3, 0.2


def median_call_ms(call, rounds: int, calls_per_round: int, warmup: int = 3) -> float:
    """Median over `rounds` of the mean time of `calls_per_round` back-to-back calls
    between two CUDA events on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    cupy.cuda.get_current_stream().synchronize()
    begin = time.perf_counter()
    call()
    host_s = time.perf_counter() - begin
    hold = jit.get_function("hold_stream", "hold_stream", {})
    hold_ns = int(min(MAX_HOLD_S, max(MIN_HOLD_S, HOLD_MARGIN * calls_per_round * host_s)) * 1e9)
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
