"""Paged attention on ROCm: not built yet.

The CUDA attention kernels are built on mma.sync and wgmma, which AMD GPUs
lack; ROCm needs its own decode and prefill kernels on MFMA instructions for
gfx90a and gfx942. Until those exist a call is refused with that reason,
never answered by a kernel that was not written for the device.
"""

from __future__ import annotations

ATTENTION_MISSING = (
    "paged_attention is not available on ROCm devices yet: it needs kvcupy's MFMA attention kernels "
    "for gfx90a (MI200) and gfx942 (MI300) (decode, prefill and the split merge in kernels_hip/), which this "
    "version does not have. reshape_and_cache, rotate and copy_blocks do run on ROCm; for attention, "
    "copy the cache and query to the host and call it there (the cpu backend).")


def plan_attention(batch, cache, num_query_heads: int, num_query_tokens: int):
    raise NotImplementedError(ATTENTION_MISSING)


def paged_attention(query, cache, batch, plan, *, softmax_scale: float, sliding_window: int | None,
                    softcap: float, sinks, out) -> None:
    raise NotImplementedError(ATTENTION_MISSING)
