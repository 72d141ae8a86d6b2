"""Shared by the GPU measurement tools: the median time of a call by CUDA events."""

from __future__ import annotations

import cupy
import numpy as np


def median_call_ms(call, rounds: int, calls_per_round: int, warmup: int = 3) -> float:
    """Median over `rounds` of the mean time of `calls_per_round` back-to-back calls
    between two CUDA events on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(rounds):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls_per_round):
            call()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / calls_per_round)
    return float(np.median(times))
