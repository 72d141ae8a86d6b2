"""The CUDA planner's tunables (planner.py reads them; docs/design.md gives the reasons)."""

from __future__ import annotations

from dataclasses import dataclass

from .kernels import MAX_SPLITS


@dataclass(frozen=True)
class Tuning:
    """The CUDA planner's tunables: how it cuts a batch's work and which builds it
    takes. Data, not switches: a variant is `dataclasses.replace(DEFAULT_TUNING, ...)`
    given to `kvcupy.plan_batch(tuning=...)`. docs/design.md gives the reasons."""

    # Decode (attention.cuh).
    stage_bytes_target: int = 40 * 1024   # a stage (K + V + scales) near this fits two blocks a multiprocessor
    row_staging: bool = True              # row copies rather than bulk copies where both fit
    min_tiles_per_split: int = 4          # a shorter split costs more in merging than it gains
    max_splits: int = MAX_SPLITS          # splits of a sequence's keys at most (decode and prefill)
    round_min_warps: int = 8              # 1-byte codes take 32-token tiles where a multiprocessor keeps this many warps
    round_max_head_pad: int = 128         # larger heads keep 16-token tiles
    long_tile_head_pads: tuple = (96, 128)   # int4 heads whose one-quad builds take 64-token tiles
    long_tile_min_split_tokens: int = 1024   # shorter splits keep 32-token tiles
    two_block_head_pads: tuple = (96,)    # of those, heads whose latency-bound chains want two blocks (two stages)
    two_block_min_split_tokens: int = 2048   # shorter splits keep one block of three stages
    dependent_launch: bool = True         # sm_90: attention and merge grids start as programmatic dependents
    # Prefill (prefill.cuh).
    prefill_min_rows: int = 64            # (query token, head) rows a KV head from which the prefill kernel serves
    prefill_wgmma: bool = True            # sm_90 takes the warpgroup builds (False: mma.sync, as sm_80 does)
    prefill_producer_min_keys: int = 2048    # longest sequence from which the producer warpgroup pays
    prefill_producer_min_keys_rotated: int = 512   # the same for rotated quantized caches with 16-byte copies
    prefill_short_keys: int = 256         # up to this longest sequence: the short build (fewer warps, two blocks)
    prefill_short_warps: int = 8
    prefill_short_tile: int = 32
    prefill_short_blocks: int = 2
    prefill_block_keys: int = 320         # a prefill block's fixed cost (query in, output out) in keys of work
    prefill_split_gain: float = 0.9       # splitting a prefill's keys must promise 10% (the merges cost too)


DEFAULT_TUNING = Tuning()
