"""The short-prompt target's shape for a profiler, or SDPA's times on it.

    PYTHONPATH=.:tools ncu --clock-control none -k regex:"prefill_attention|cudnn" -c 4 \
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
        --section InstructionStats python3 tools/prefill_profile_short.py
    PYTHONPATH=.:tools ncu --clock-control none -k regex:prefill_attention -c 1 --section SourceCounters \
        --page source --print-source sass --csv python3 tools/prefill_profile_short.py
    PYTHONPATH=.:tools python3 tools/prefill_profile_short.py --time

Profiled: two calls of kvcupy's prefill over an int8 cache without a rotation
(the planner's short build; --kv-dtype and --rotation name another cache, e.g.
--kv-dtype int4_per_token_head --rotation blockdiag), 64 sequences x 128
tokens, 32 query / 8 KV heads, d = 128, block size 16
(prefill_variants.make_case), then two of torch's cuDNN SDPA on dense bf16
tensors of the same shape. --time prints instead the medians
of SDPA's cuDNN and flash backends at 64 x 128 and 32 x 256 (CUDA events around
two calls, 15 of them after 5 warm-up calls; no hold kernel, unlike the bench's
method, so read them beside the bench's, not as its). Needs torch with CUDA.
"""

from __future__ import annotations

import argparse
import json

import cupy
import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvcupy as kc
from prefill_variants import BLOCK_SIZE, KV_HEADS, QUERY_HEADS, make_case   # tools/, beside this script

SEQUENCES, TOKENS, HEAD_SIZE = 64, 128, 128


def sdpa(sequences: int, tokens: int):
    query = torch.randn((sequences, QUERY_HEADS, tokens, HEAD_SIZE), device="cuda", dtype=torch.bfloat16)
    rows = torch.randn((sequences, KV_HEADS, tokens, HEAD_SIZE), device="cuda", dtype=torch.bfloat16)
    return lambda: torch.nn.functional.scaled_dot_product_attention(query, rows, rows, is_causal=True,
                                                                    enable_gqa=True)


def sdpa_times() -> dict:
    times = {}
    for sequences, tokens in ((64, 128), (32, 256)):
        call = sdpa(sequences, tokens)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend):
                for _ in range(5):
                    call()
                samples = []
                for _ in range(15):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call()
                    call()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / 2)
            times[f"{name} {sequences}x{tokens} ms"] = round(float(np.median(samples)), 4)
    return times


def profiled_calls(kv_dtype: str, rotation: str) -> None:
    case = make_case(kv_dtype, SEQUENCES, TOKENS, TOKENS, HEAD_SIZE, rotation, np.random.default_rng(0))
    batch = kc.plan_batch(block_table=case["table"], seq_lens=np.full(SEQUENCES, TOKENS, np.int32),
                          cu_seqlens_q=np.arange(SEQUENCES + 1, dtype=np.int32) * TOKENS,
                          block_size=BLOCK_SIZE, num_blocks=case["pages"])
    out = cupy.empty_like(case["query"])
    for _ in range(2):
        kc.paged_attention(case["query"], case["cache"], batch=batch, out=out)
    cupy.cuda.Device().synchronize()
    call = sdpa(SEQUENCES, TOKENS)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(2):
            call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="SDPA's medians instead of the profiled calls")
    parser.add_argument("--kv-dtype", default="int8_per_token_head")
    parser.add_argument("--rotation", default="none", help="the cache's rotation kind (make_case)")
    options = parser.parse_args()
    if options.time:
        print(json.dumps(sdpa_times()))
    else:
        profiled_calls(options.kv_dtype, options.rotation)
