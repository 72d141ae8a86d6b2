"""Two calls of kvcupy's prefill over a bf16 auto cache (bf16 query: the
producer build's direct rows) and two of torch's flash SDPA on the same shape
(4 x 8192 causal, 32 query / 8 KV heads, d = 128), for a profiler:

    PYTHONPATH=. ncu --clock-control none -k regex:"prefill_attention|flash" -s 1 -c 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
        --section WarpStateStats --section InstructionStats python3 tools/prefill_profile_pair.py

(-s 1 -c 2: kvcupy's second call and flash's first.) Needs torch with CUDA.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvcupy as kc

SEQUENCES, TOKENS, QUERY_HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 8192, 32, 8, 128, 16


def main() -> None:
    pages = SEQUENCES * TOKENS // BLOCK_SIZE
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn((pages, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), generator=generator, device="cuda",
                       dtype=torch.bfloat16)
    cache = kc.wrap_cache(rows, rows.clone(), kv_dtype="auto")
    table = np.random.default_rng(0).permutation(pages).astype(np.int32).reshape(SEQUENCES, -1)
    batch = kc.plan_batch(block_table=table, seq_lens=np.full(SEQUENCES, TOKENS, np.int32),
                          cu_seqlens_q=np.arange(SEQUENCES + 1, dtype=np.int32) * TOKENS, block_size=BLOCK_SIZE,
                          num_blocks=pages)
    query = torch.randn((SEQUENCES * TOKENS, QUERY_HEADS, HEAD_SIZE), generator=generator, device="cuda",
                        dtype=torch.bfloat16)
    out = torch.empty_like(query)
    for _ in range(2):
        kc.paged_attention(query, cache, batch=batch, out=out)
    dense_query = query.view(SEQUENCES, TOKENS, QUERY_HEADS, HEAD_SIZE).transpose(1, 2)
    dense_rows = torch.randn((SEQUENCES, KV_HEADS, TOKENS, HEAD_SIZE), generator=generator, device="cuda",
                             dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            torch.nn.functional.scaled_dot_product_attention(dense_query, dense_rows, dense_rows, is_causal=True,
                                                             enable_gqa=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
