"""CUDA paged attention: plan a batch once, then launch kernels_cu/attention.cu.

A decode call is two launches on the caller's stream, none of which waits
for the host: the attention kernel reads the caller's query, scales and
rotates it (blockdiag: butterflies in a warp) and writes each split's
partial softmax state; the merge kernel combines the splits (and the
sinks), rotates back and writes `out`. On sm_90 and newer both are launched
as programmatic dependents (cuda_launch.py): the attention grid of whatever
the stream ran before it, the merge of the attention grid; their blocks wait
in the kernel (griddepcontrol.wait, before they read anything) instead of
behind the launch, and each grid lets the next one in once its own wait is
over, so that at most one grid waits at a time. A
kron plan's mix takes the rotate
kernel instead, before (the query, to float32) and after (the merged rows):
four launches. The prefill kernel reads the caller's query and rotates it
itself (mma products with the rotation's fragments, `rotation_fragments`);
with one split it also normalises, rotates back and writes `out`, so that a
prompt is one launch; with several, the merge (and for kron the rotate
kernel) follows as in decode.

The plan (made once per BatchPlan and reused by every layer) fixes what the
kernel is specialised on and how the work is cut. Decode and short query
runs take attention.cuh's kernel: warps per block (one per KV head, up to 8,
so that a block reads whole cache rows), query rows per warp, tokens per
pipeline stage. Prefill (a sequence bringing at least PREFILL_MIN_ROWS query
rows per KV head, head sizes up to PREFILL_MAX_HEAD_PAD) takes prefill.cuh's:
128 query rows of one KV head a block, each tile decoded once into shared
memory (on sm_90 it takes its wgmma build, compiled for
sm_90a, with 192 rows a block). Either way the plan splits each sequence's
keys across blocks (split-KV) from the batch's shape and the GPU's
multiprocessor count (prefill: choose_prefill_splits), and
holds the device copies of the work list and the workspace, so a layer's
call allocates nothing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from .. import formats, jit
from . import cuda_launch
from ..rotation import query_divisor, sylvester

# attention.cuh's KV_* codes.
KV_INT4, KV_INT8, KV_FP8, KV_F16, KV_BF16 = range(5)
HEAD_CLASS = 32          # head sizes are padded up to a multiple of this (masked)
STAGES = 3               # cp.async pipeline depth
STAGE_BYTES_TARGET = 40 * 1024   # keep a stage (K + V + scales) near this: 2 blocks a multiprocessor
SHARED_BYTES_PER_SM = 227 * 1024
# How a decode block stages its tiles (Kernel.staging, attention.cuh's KVC_STAGING):
# every thread copies pieces and the block syncs; warp 0 copies each page's
# run with one bulk copy; or every thread copies whole token rows, completing
# on the stage's mbarrier (no block-wide sync). The last two need sm_90 and
# pages whose rows hold the block's KV heads side by side (_bulk_copies_fit;
# 16-bit caches take row copies only, _row_copies_fit).
STAGE_THREADS, STAGE_BULK, STAGE_ROWS = 0, 1, 2
ROW_STAGING = True   # row copies rather than bulk copies where both fit
ROW_STAGING_MIN_STAGES = 3
MAX_SPLITS = 256         # attention.cuh: kMergeMaxSplits
MERGE_WARPS = 8          # attention.cuh: kMergeWarps (split_warps of them a row)
# sm_90 and newer: the merge's blocks may start before the attention grid ends
# (cuda_launch.py); False launches it plainly (tools/decode_variants.py's A/B).
DEPENDENT_MERGE = True
# sm_90 and newer: the attention kernel too is launched as a programmatic
# dependent of whatever the stream ran before it, its blocks waiting in the
# kernel (before any read) instead of behind the launch. False: plainly.
# H200, alternating in one process against e318999's kernels (int4, blockdiag,
# ms): 32 x 8192 0.0910 / 0.0908 against 0.0926 / 0.0929, 8 x 32768 0.0914 /
# 0.0916 against 0.0939 / 0.0936, 4 x 4096 0.0235 / 0.0234 against 0.0247 /
# 0.0244 (docs/gpu-notes.md, Decode).
DEPENDENT_ATTENTION = True
MERGE_SIGNATURE = "PPPPiiiiiPif"   # attention.cu's merge_splits parameters (cuda_launch's codes)
# The attention entries' 54 parameters (attention.cu, KVC_ATTENTION_ARGS), in
# cuda_launch's codes: packed into one buffer they cost the host less to launch
# than through CuPy's per-argument conversion (tools/host_primitives.py). False:
# CuPy's launch (the A/B there).
ATTENTION_SIGNATURE = "PPPPP" + "q" * 12 + "PPPPPP" + "i" * 11 + "ffPqqiPPiiffPqqiPiPi"
PACKED_LAUNCH = True
# Four quads (16 query rows a warp) double the accumulators of two: above this
# head size they spill even at 255 registers, so larger heads take more row tiles.
MAX_HEAD_PAD_FOUR_QUADS = 128
MIN_TILES_PER_SPLIT = 4  # a split below this many tiles costs more in merging than it gains
# Splits shorter than this take 16-token tiles (a shallower pipeline). 0: none
# do, since a 32-token tile is one softmax round of two steps (attention.cuh).
# Before the rounds 2048 paid (int4 d128 32 x 8192 1.60 -> 1.96 TB/s); with
# them, 0 against 2048 (H200, tools/decode_variants.py "long_split_tokens",
# alternating runs): 32 x 8192 2.18-2.20 vs 1.95, 8 x 32768 1.49-1.52 vs 1.50-1.51.
LONG_SPLIT_TOKENS = 0
# int8 / fp8 decode takes 32-token tiles (_round_tile) where they leave a
# multiprocessor at least this many warps (H200, tools/decode_variants.py,
# 32 x 32768, alternating runs): at d = 128 one block of 8 warps and 198 KiB
# against two of 16-token tiles, fp8 3.45 and 3.59 vs 3.25 and 3.26 TB/s, int8
# 3.82 and 3.82 vs 3.65 and 3.68 (two stages: fp8 3.43, the same); at d = 96
# two stages (two blocks) against three (one), int8 3.41 and 3.40 vs 3.27
# and 3.20, fp8 3.44 and 3.53 vs 3.11 and 3.06.
DECODE_ROUND_MIN_WARPS = 8
DECODE_ROUND_TILE = 32            # one softmax round of two 16-token steps (attention.cuh)
DECODE_ROUND_MAX_HEAD_PAD = 128   # larger heads: not measured, they keep 16-token tiles
# int4 decode of one quad at d = 128 and 96 with row copies takes 64-token
# tiles (_long_tile): one softmax round of four steps a tile, one block of 8
# warps a multiprocessor (219 KiB at d = 128, 162 at 96) instead of two of
# 32-token tiles, whose two blocks the schedulers serve unevenly
# (tools/decode_trace.py). H200, tools/decode_variants.py, blockdiag, one
# process a shape, ms, 64 vs 32: 32 x 32768 0.3269 / 0.3266 vs 0.3346 /
# 0.3344, 32 x 8192 0.0982 / 0.0982 vs 0.1053 / 0.1056, 8 x 32768 0.0988 /
# 0.0984 vs 0.1055 / 0.1061, 64 x 2048 0.0590 / 0.0591 vs 0.0672 / 0.0670.
# d = 96 was slower (0.3282 vs 0.2944) until the tiles' row copies took whole
# 128-byte lines (the 2026-12-03 late session): then 32 x 32768 0.2916 /
# 0.2911 vs 0.2926 / 0.2916, 32 x 8192 0.0822 / 0.0821 vs 0.0855 / 0.0854.
# Not taken: splits shorter than DECODE_LONG_TILE_MIN_SPLIT_TOKENS (4 x 4096,
# 16 splits of 256 keys: 0.0261 / 0.0260 vs 0.0252 / 0.0254).
DECODE_LONG_TILE = 64
DECODE_LONG_TILE_HEAD_PADS = (96, 128)
DECODE_LONG_TILE_MIN_SPLIT_TOKENS = 1024
# At d = 96 the 64-token tiles' math is bound by the latency of each warp's
# chains, two warps a scheduler (ncu: 0.53 issued a cycle, 27% of the stall
# samples waiting on a fixed latency): two stages instead of three, the row
# copies of tile t + 1 issued before tile t (attention.cuh's KVC_ROWS_BEFORE,
# Kernel.rows_before), fit two blocks a multiprocessor (_long_tile). H200,
# tools/decode_variants.py, blockdiag, alternating, ms, two blocks vs one:
# 32 x 32768 0.2753 / 0.2753 / 0.2755 vs 0.2884 / 0.2883 / 0.2880 (8 splits
# against 4); with splits of 1024 keys slower: 32 x 8192 0.0819 / 0.0818 vs
# 0.0814 / 0.0813, 8 x 32768 0.0826 / 0.0829 vs 0.0826 / 0.0825. Splits
# shorter than DECODE_TWO_BLOCK_MIN_SPLIT_TOKENS keep the one-block build.
DECODE_TWO_BLOCK_HEAD_PADS = (96,)
DECODE_TWO_BLOCK_MIN_SPLIT_TOKENS = 2048
# Prefill (prefill.cuh): batches whose longest query run has at least this many
# (query token, head) rows per KV head take the prefill kernel, head sizes up to
# PREFILL_MAX_HEAD_PAD (above, its register-held accumulators would spill).
PREFILL_MIN_ROWS = 64
PREFILL_MAX_HEAD_PAD = 128
# 128 query rows a block, each tile decoded once for all of them. Against 4 warps
# (2 blocks a multiprocessor) and against 32-token tiles, 4 x 8192 causal, d = 128,
# TFLOP/s (H200, tools/prefill_variants.py, one run, an earlier step of this kernel):
# int8 118 vs 72 and 108; int4 128 vs 133 and 105.
PREFILL_WARPS = 8
PREFILL_TILE = 64
PREFILL_STAGES = 3          # raw stages of quantized caches (besides the decoded tiles)
PREFILL_AUTO_STAGES = 2     # fp16 / bf16 rows, 4x the bytes of int4 ones (3 do not fit beside the wgmma buffers)
PREFILL_MIN_BLOCKS = 1      # 8 warps a multiprocessor: no spills (`kvcupy check --all`)
# sm_90 takes the warpgroup (wgmma, sm_90a) build of the prefill kernel (auto caches
# with PREFILL_WGMMA_AUTO); False keeps the mma.sync build everywhere (the tests run
# both on Hopper).
PREFILL_WGMMA = True
# The wgmma build runs three warpgroups (192 query rows) a block: three warps a
# scheduler instead of two hide more of the softmax's and the decoding's latencies.
# int4, blockdiag, d = 128, TFLOP/s against 8 warps (H200, tools/prefill_variants.py,
# one run): 4 x 8192 causal 266 vs 235, 2048 new over 30720 cached 253 vs 249,
# 64 x 128 0.29 vs 0.33 ms. (168 registers a thread; the spills sit in the
# prologue and the epilogue, two spill instructions in the loop.)
PREFILL_WGMMA_WARPS = 12
# The wgmma build with a producer warpgroup (prefill.cuh, PRODUCER): of its 12
# warps, four stage and decode the tiles while two warpgroups (128 query rows)
# run the products and the softmax in FlashAttention-3's intra-warpgroup order,
# ordered by mbarriers, on 224 registers (setmaxnreg), none spilled. Measured
# (H200, tools/prefill_variants.py, blockdiag, d = 128, TFLOP/s, against the
# 3-warpgroup build in one process, 2026-12-02 after the race fix): int4 4 x 8192
# causal 301.5 vs 273.3, 2048 new over 30720 cached 331.0 vs 282.1; int8 239.1 /
# 254.1 vs 230.7 / 236.0; fp8 233.7 / 248.1 vs 227.9 / 232.3; d = 96 271.8 /
# 294.8 vs 235.5 / 241.1. Short prompts (ms, producer vs 3 warpgroups): 64 x 128
# 0.258 vs 0.238, 16 x 512 0.324 vs 0.315, 1 x 2048 0.185 vs 0.210, 4 x 2048
# 0.634 vs 0.654, 1 x 4096 0.522 vs 0.625: the producer build from
# PREFILL_PRODUCER_MIN_KEYS keys a sequence (512 to 2048: measured later, below).
# Since then (the query in registers, raw rows read without bank conflicts;
# docs/gpu-history.md, Prefill): 4 x 8192 int4 335.8, int8 287.1, fp8 278.6; then (int8 bytes
# permuted under 0x64, fp8 by cvt.rn.f16x2.e4m3x2) int8 307.8 and, on the bench,
# int8 304.7, fp8 309.0; then (quantized codes a fixed piece a stager: prefill.cuh,
# stage_tile) int8 307.1 -> 334.6, fp8 310.7 -> 334.3 and, on the bench, int8
# 326.9, fp8 339.6.
PREFILL_PRODUCER = True
PREFILL_PRODUCER_MIN_KEYS = 2048
# Quantized caches with a rotation and 16-byte copies take the producer build from
# fewer keys, since its staging takes each stager's piece once (prefill.cuh,
# stage_tile). H200, tools/prefill_variants.py, alternating, two rounds, ms, the
# build below 2048 keys -> the producer's: d = 128 blockdiag, 32 x 304 int4
# 0.2960 -> 0.2985, int8 0.3271 -> 0.3152, fp8 0.3442 -> 0.3356; 16 x 512 int4
# 0.2838 -> 0.2789, int8 0.3177 -> 0.2930, fp8 0.3287 -> 0.3046; 4 x 1536 int8
# 0.4287 -> 0.3682, fp8 0.4373 -> 0.3709; 256 new over 768 cached (8 x 1024)
# int4 0.1688 -> 0.1359, int8 0.1944 -> 0.1445, fp8 0.1964 -> 0.1427; d = 96
# blockdiag 16 x 512 int4 / int8 / fp8 +3 / +1.4 / +1.7%, 32 x 304 -0.4 / -3 /
# -3.5%. Without a rotation the build below keeps its lighter code (no rotation)
# and int4 lost 30% at 16 x 512 (0.2389 -> 0.3108), so those keep 2048.
PREFILL_PRODUCER_MIN_KEYS_ROTATED = 512
# 16-bit (auto) caches take the wgmma builds too: their decoding pass copies fp16
# rows into the core-matrix layout and converts bf16 rows to fp16 with a power of
# two a row (prefill.cuh, decode_tile), so the products and the softmax are the
# quantized caches' own. False keeps them on the mma.sync build (bf16 operands).
# H200, 4 x 8192 causal, d = 128, TFLOP/s: fp16 rows 195 (mma.sync) -> 253 -> 303
# (their staging's offsets once a tile; tools/prefill_variants.py); bf16 on the
# bench 163 -> 218 -> 250 (flash SDPA 336-348 in the same runs).
PREFILL_WGMMA_AUTO = True
# The producer build over bf16 caches copies their rows straight into the
# products' layout (prefill.cuh, DIRECT), where the query is bf16 and not rotated
# (PrefillKernel.for_query): bf16 operands, no decoding pass, no per-token
# scales. H200, 4 x 8192 causal, d = 128 (tools/prefill_variants.py, bf16 rows
# and query, alternating): 250.8 / 249.2 decoded -> 300.1 / 300.5 TFLOP/s
# direct with three tiles in flight; 2048 over 30720 cached 267.7 / 267.4 ->
# 324.2 / 317.2. fp16 rows gained nothing in the core matrices (decoded 302.2 /
# 301.9, direct 302.0 / 293.4 with one tile in flight), but swizzled
# (PREFILL_SWIZZLE) they do: decoded 300.5 / 296.6 -> direct 374.7 / 370.9,
# chunked 322.2 / 319.0 -> 395.0 / 398.3 (2026-12-03, alternating), so
# PREFILL_DIRECT_F16 is on.
PREFILL_DIRECT = True
PREFILL_DIRECT_F16 = True
# Tiles in flight beside the consumers' three buffers (as many as fit, at most
# this). bf16, 4 x 8192 / chunked: 0 -> 276.8 / 289.0, 1 -> 310.8 / 328.5,
# 2 -> 308.9 / 326.8, 3 -> 303.2 / 322.6 (one run).
PREFILL_DIRECT_STAGES = 1
# Direct tiles in a swizzled layout (prefill.cuh, kSwizzleBytes): 128-byte
# columns where head_pad is a multiple of 64, 64-byte ones at 96 and 32; the
# copies then take whole rows. H200, bf16 rows and query (tools/prefill_variants.py,
# alternating, two rounds), core matrices -> swizzled, TFLOP/s: d = 128, 4 x
# 8192 307.2 / 307.8 -> 377.2 / 373.3, 2048 over 30720 cached 331.4 / 330.7 ->
# 419.3 / 412.4 (ncu, 4 x 8192: L2 throughput 88.9% -> 29.0%, 7.18 -> 5.82
# ms); d = 96 (64-byte, 2026-12-03) 253.5 / 252.3 -> 284.8 / 286.2, chunked
# 268.1 / 268.5 -> 308.9 / 310.5. The decoding pass's tiles
# swizzled (quantized caches, fp16 rows decoded) measured no gain: int4 342.5
# -> 324.7-333.5, int8 307.8 -> 277-308, fp8 312.9 -> 285-313 by producer
# registers and batch (docs/gpu-notes.md).
PREFILL_SWIZZLE = True
# Short prompts: the build without the producer (the longest sequence below
# PREFILL_PRODUCER_MIN_KEYS keys) spends a block's time mostly on its query's
# loads and its output's stores, which overlap only with another block's work.
# Caches without a rotation take a build without the rotation's code
# (PREFILL_UNROTATED: with that code its registers spilled 676 bytes at 12
# warps, int8 d = 128; without it none), and batches whose longest sequence
# holds at most PREFILL_SHORT_KEYS keys take
# PREFILL_SHORT_WARPS warps and PREFILL_SHORT_TILE-token tiles at
# PREFILL_SHORT_BLOCKS blocks a multiprocessor where two fit (not 16-bit rows at
# d = 128), rotated caches too (PREFILL_SHORT_ROTATED; their build spills 2.7 KB
# of registers, in the query's rotation, and still gains). H200, d = 128,
# tools/prefill_variants.py, ms, two rounds in one process, the kernels before
# (commit ada9a07) against these:
#   int8, no rotation: 64 x 128 0.1892 / 0.1892 -> 0.1338 / 0.1338; 32 x 256
#     0.2308 / 0.2318 -> 0.1775 / 0.1777 (12 warps without the rotation's code
#     0.2061 / 0.2058); 16 x 512 (12 warps) 0.2899 / 0.2911 -> 0.2597 / 0.2602
#     (8 warps, an earlier run: 0.2677 / 0.2674 against 0.2588 / 0.2589)
#   fp8, no rotation: 64 x 128 0.1903 / 0.1906 -> 0.1371 / 0.1367; 32 x 256
#     0.2340 / 0.2337 -> 0.1835 / 0.1839; 16 x 512 0.2932 / 0.2936 -> 0.2608 / 0.2617
#   int4, blockdiag: 64 x 128 0.2225 / 0.2229 -> 0.2059 / 0.2061; 32 x 256
#     0.2543 / 0.2549 -> 0.2453 / 0.2454
PREFILL_UNROTATED = True
# Rotated prefill builds for calls whose query and output rows are 16-bit leave
# the float32 rows' two-term rotations out (PrefillKernel.wide_rows, prefill.cuh's
# KVC_WIDE_ROWS); float32 calls take the build with them (kvcupy.paged_attention
# writes an output of the query's dtype, so a call is one or the other). The JIT
# target (a first compile within 5 s) had slipped: 7.4 s for the int4 short
# build and 5.5-5.7 s for the producer builds in one bench on the lent H200
# (NVRTC 13.0), 7.3-8.6 s for the d = 128 prefill builds on another such
# machine. Without that code, and with mma_either, 2.9-3.3 s on a third, 4.0-5.9
# s on a fourth (prefill.cuh, kWideRows; docs/gpu-notes.md). The cost, int4
# / int8 / fp8 blockdiag (tools/prefill_variants.py, ec0b4b6's kernels against
# these, two rounds, ms or TFLOP/s): 64 x 128 0.1558 / 0.1544 -> 0.1556 / 0.1548,
# 0.1614 / 0.1615 -> 0.1641 / 0.1622, 0.1880 / 0.1882 -> 0.1813 / 0.1814; 4 x
# 8192 348.0 / 350.7 -> 345.5 / 348.1, 330.5 / 334.0 -> 333.7 / 334.0, 332.6 /
# 333.4 -> 329.7 / 331.0; 2048 over 30720 384.0 / 384.4 -> 382.3 / 382.4, 364.4
# / 362.5 -> 364.5 / 364.8, 366.9 / 366.8 -> 363.7 / 363.1.
PREFILL_NARROW_ROWS = True
PREFILL_SHORT_KEYS = 256
PREFILL_SHORT_WARPS = 8
PREFILL_SHORT_TILE = 32
PREFILL_SHORT_BLOCKS = 2
PREFILL_SHORT_ROTATED = True   # rotated caches take the short build too


@dataclass(frozen=True)
class Kernel:
    """One specialisation of the attention kernel (its -D defines) and its shared memory."""

    kv: int
    head_pad: int
    heads: int          # warps per block = KV heads per block
    quads: int          # query rows a warp, 4 each: 1, 2 or 4
    tile: int           # tokens per pipeline stage
    chunk: int          # bytes per cp.async (1: plain byte loads)
    staging: int = 0    # attention.cuh's KVC_STAGING: STAGE_THREADS, STAGE_BULK or STAGE_ROWS
    stages: int = STAGES  # pipeline depth in tiles

    entry = "paged_attention"
    arch = None         # the device's own arch (PrefillKernel's wgmma build asks for sm_90a)
    kv_heads_per_block = property(lambda self: self.heads)

    @functools.cached_property
    def threads(self) -> int:
        return 32 * self.heads

    @functools.cached_property
    def rows_per_tile(self) -> int:
        return 4 * self.quads

    @functools.cached_property
    def blocks_per_sm(self) -> int:
        """Blocks a multiprocessor should hold: 16 warps up to head size 128 with one
        quad (registers capped at 128 a thread to fit them: no spills there, per
        `kvcupy check --all`), 8 for more accumulators; fewer where shared memory is short."""
        by_shared = max(1, SHARED_BYTES_PER_SM // self.shared_bytes)
        by_warps = max(1, (16 if self.quads == 1 and self.head_pad <= 128 else 8) // self.heads)
        return min(by_shared, by_warps)

    @functools.cached_property
    def rows_before(self) -> bool:
        """Row copies of the next tile issued before the current one (attention.cuh's
        KVC_ROWS_BEFORE): with fewer than ROW_STAGING_MIN_STAGES stages, issued after
        it they would leave no tile in flight."""
        return self.staging == STAGE_ROWS and self.stages < ROW_STAGING_MIN_STAGES

    @property
    def defines(self) -> dict:
        defines = {"KVC_ATTN_KV": self.kv, "KVC_HEAD_PAD": self.head_pad, "KVC_HEADS": self.heads,
                   "KVC_QUADS": self.quads, "KVC_TILE": self.tile, "KVC_STAGES": self.stages,
                   "KVC_CHUNK": self.chunk, "KVC_MIN_BLOCKS": self.blocks_per_sm,
                   "KVC_STAGING": self.staging}
        if self.rows_before:   # (only then: every other build keeps its compile key)
            defines["KVC_ROWS_BEFORE"] = 1
        return defines

    @functools.cached_property
    def row_bytes(self) -> int:
        bits = 4 if self.kv == KV_INT4 else 8 if self.kv in (KV_INT8, KV_FP8) else 16
        return self.head_pad * bits // 8

    @functools.cached_property
    def shared_bytes(self) -> int:
        """attention.cuh's Traits::kSharedBytes (the same arithmetic)."""
        def padded(size: int, a: int) -> int:   # the next size = a modulo 2a
            return size + (a - size % (2 * a)) % (2 * a)
        heads_bytes = self.heads * self.row_bytes
        lane_words = self.row_bytes // 16
        key_vector = 4 if lane_words % 4 == 0 else 2 if lane_words % 2 == 0 else 1
        key_stride, value_stride = padded(heads_bytes, 16 * key_vector), padded(heads_bytes, 16)
        if self.staging == STAGE_BULK:   # pages copied as they are: unpadded rows
            key_stride = value_stride = heads_bytes
        stage = self.tile * (key_stride + value_stride) + 2 * self.tile * self.heads * 4
        mbarriers = 16 * self.stages if self.staging != STAGE_THREADS else 0   # two a stage
        return self.stages * stage + mbarriers


@dataclass(frozen=True)
class PrefillKernel:
    """One specialisation of prefill.cuh: WARPS warps of 16 query rows a block, one KV
    head, keys TILE at a time, decoded once per block into shared memory."""

    kv: int
    head_pad: int
    tile: int
    chunk: int
    warps: int = PREFILL_WARPS
    wgmma: bool = False   # warpgroup products (sm_90a only)
    producer: bool = False   # with wgmma: the last warpgroup stages and decodes, the others compute
    direct: bool = False   # with the producer, 16-bit rows: copied into the products' layout, not decoded
    rotated: bool = True   # False: a build for caches without a rotation (its code left out)
    wide_rows: bool = True   # False (rotated builds): 16-bit query and output rows only (for_query)
    min_blocks: int | None = None   # __launch_bounds__ blocks a multiprocessor wanted (None: PREFILL_MIN_BLOCKS)

    entry = "prefill_attention"
    kv_heads_per_block = 1

    @classmethod
    def planned(cls, kv: int, head_pad: int, chunk: int, wgmma: bool, producer: bool = False) -> "PrefillKernel":
        """The specialisation the planner takes: its tile, and warps by build;
        `producer` asks for the wgmma build's producer warpgroup."""
        producer = wgmma and producer
        return cls(kv, head_pad, PREFILL_TILE, chunk, PREFILL_WGMMA_WARPS if wgmma else PREFILL_WARPS, wgmma, producer)

    def for_query(self, query_dtype, rotation, out_dtype) -> "PrefillKernel":
        """The build a call takes: the direct one (PREFILL_DIRECT) for bf16 rows in the
        producer build under a bf16 query without rotation (bf16 operands hold
        such a query exactly, as fp16 ones hold an fp16 query), and for fp16 rows
        with PREFILL_DIRECT_F16; a rotated build without the float32 rows' code
        (wide_rows False, PREFILL_NARROW_ROWS) where neither the query nor the
        output is float32."""
        kernel = self
        if (PREFILL_NARROW_ROWS and self.rotated and np.dtype(query_dtype) != np.float32
                and np.dtype(out_dtype) != np.float32):
            kernel = replace(kernel, wide_rows=False)
        rows = (KV_F16, KV_BF16) if PREFILL_DIRECT_F16 else (KV_BF16,)
        if not (PREFILL_DIRECT and self.producer and self.kv in rows and self.chunk >= 4):
            return kernel
        if self.kv == KV_BF16 and (np.dtype(query_dtype) != formats.MODEL_DTYPES["bfloat16"]
                                   or (rotation is not None and not rotation.is_identity)):
            return kernel
        return replace(kernel, direct=True)

    @functools.cached_property
    def quantized(self) -> bool:
        return self.kv in (KV_INT4, KV_INT8, KV_FP8)

    @functools.cached_property
    def decoded(self) -> bool:
        """Whether tiles pass through fp16 decoded buffers (prefill.cuh's kDecoded)."""
        return self.quantized or self.wgmma

    @functools.cached_property
    def stages(self) -> int:
        """Raw stages; direct builds: tiles in flight beside the consumers' three
        buffers, as many as fit (PREFILL_DIRECT_STAGES at most)."""
        if self.direct:
            fitting = [s for s in range(PREFILL_DIRECT_STAGES + 1) if self._shared_bytes(s) <= SHARED_BYTES_PER_SM]
            return max(fitting, default=0)
        return PREFILL_STAGES if self.quantized else PREFILL_AUTO_STAGES

    @functools.cached_property
    def threads(self) -> int:
        return 32 * self.warps

    @functools.cached_property
    def consumer_warps(self) -> int:
        """Warps with query rows (all but the producer warpgroup)."""
        return self.warps - 4 if self.producer else self.warps

    @functools.cached_property
    def rows_per_tile(self) -> int:
        return 16 * self.consumer_warps

    @functools.cached_property
    def blocks_per_sm(self) -> int:
        wanted = PREFILL_MIN_BLOCKS if self.min_blocks is None else self.min_blocks
        return max(1, min(wanted, SHARED_BYTES_PER_SM // self.shared_bytes))

    @functools.cached_property
    def arch(self) -> str | None:
        """The arch to compile for: sm_90a for wgmma, else the device's own."""
        return "sm_90a" if self.wgmma else None

    @property
    def defines(self) -> dict:
        defines = {"KVC_PREFILL_KV": self.kv, "KVC_HEAD_PAD": self.head_pad, "KVC_WARPS": self.warps,
                   "KVC_TILE": self.tile, "KVC_STAGES": self.stages, "KVC_CHUNK": self.chunk,
                   "KVC_MIN_BLOCKS": self.blocks_per_sm}
        if self.producer:
            defines["KVC_PRODUCER"] = 1
        if self.direct:
            defines["KVC_DIRECT"] = 1
        if self.swizzled:
            defines["KVC_SWIZZLE"] = 1
        if not self.rotated:
            defines["KVC_ROTATED"] = 0
        if not self.wide_rows:
            defines["KVC_WIDE_ROWS"] = 0
        return {**defines, "KVC_WGMMA": 1} if self.wgmma else defines

    @functools.cached_property
    def swizzled(self) -> bool:
        """Whether the decoded tiles take a swizzled layout (prefill.cuh's kSwizzled: 128-byte
        columns where head_pad is a multiple of 64, else 64-byte ones)."""
        return PREFILL_SWIZZLE and self.direct

    @functools.cached_property
    def shared_bytes(self) -> int:
        """prefill.cuh's Prefill::kSharedBytes (the same arithmetic)."""
        return self._shared_bytes(self.stages)

    def _shared_bytes(self, stages: int) -> int:
        bits = 4 if self.kv == KV_INT4 else 8 if self.quantized else 16
        decoded_stride = 2 * self.head_pad + 16
        row = 2 * self.head_pad if self.wgmma else decoded_stride   # wgmma: unpadded core matrices
        row_bytes = self.head_pad * bits // 8
        # quantized rows: an odd number of 16-byte units apart (decoding reads them bank-conflict free)
        raw_stride = (row_bytes + 16 * (row_bytes % 32 == 0)) if self.quantized else decoded_stride
        scales = 4 * self.tile if self.quantized else 0
        stage = 0 if self.direct else 2 * self.tile * raw_stride + 2 * scales
        align = 1024 if self.swizzled else 1   # swizzled tiles start on 1024-byte boundaries

        def aligned(size: int) -> int:
            return -(-size // align) * align

        buffers = stages + 3 if self.direct else 3 if self.wgmma else 2
        buffer = aligned(2 * self.tile * row + (0 if self.direct else 2 * 4 * self.tile))   # rows, then K and V scales
        decoded = buffers * buffer if self.decoded else 0
        queries = self.consumer_warps * (1 if self.wgmma else 2) * 16 * row   # query terms: wgmma takes one
        barriers = 2 * 8 * buffers if self.producer else 0   # full and empty, a decoded buffer each
        barriers += 16 if self.wgmma else 0   # the bulk rows' barrier (and padding)
        return aligned(stages * stage) + decoded + queries + barriers


def kv_code(cache) -> int:
    if cache.kv_dtype == "int4_per_token_head":
        return KV_INT4
    if cache.kv_dtype == "int8_per_token_head":
        return KV_INT8
    if cache.kv_dtype == "fp8_per_token_head":
        return KV_FP8
    from .cuda import _cache_model_dtype   # CuPy holds bfloat16 as uint16 bits, as the write path reads them
    storage = _cache_model_dtype(cache)
    if storage == np.float16:
        return KV_F16
    if storage == formats.MODEL_DTYPES["bfloat16"]:
        return KV_BF16
    raise ValueError(f"the CUDA backend attends over auto caches of float16 or bfloat16; this cache "
                     f"stores {storage}")


def _stored_row_bytes(cache, kv: int) -> int:
    """Bytes of one KV head's row of the cache as stored (the unpadded head size)."""
    return cache.head_size * (4 if kv == KV_INT4 else 8 if kv in (KV_INT8, KV_FP8) else 16) // 8


def _copy_granule(cache, row_bytes: int) -> int:
    """Largest cp.async size dividing the row, every byte stride and the base addresses."""
    data = (cache.key_cache, cache.value_cache)
    values = [row_bytes] + [s for a in data for s in a.strides[:3]] + [a.data.ptr for a in data]
    for chunk in (16, 8, 4):
        if all(v % chunk == 0 for v in values):
            return chunk
    return 1


def _bulk_copies_fit(cache, kv: int, heads: int, stored_row: int, head_pad: int, capability: int) -> bool:
    """Whether warp 0 can stage a tile with one bulk copy per page and tensor
    (attention.cuh, KVC_STAGE_BULK; row copies need the same): sm_90 or newer, a quantized cache (stale rows hold
    finite codes), the unpadded head size, a block serving every KV head, each
    page's rows dense (token after token, heads side by side) and 16-byte sized
    and aligned, and pages of at least 8 tokens (a tile's runs fit warp 0's lanes)."""
    if (capability < 90 or kv not in (KV_INT4, KV_INT8, KV_FP8) or cache.head_size != head_pad
            or heads != cache.num_kv_heads or heads % 4 or (heads * stored_row) % 16 or cache.block_size < 8):
        return False
    for array, head_bytes in ((cache.key_cache, stored_row), (cache.value_cache, stored_row),
                              (cache.k_scale_cache, 4), (cache.v_scale_cache, 4)):
        block_stride, slot_stride, head_stride = array.strides[:3]
        if (head_stride != head_bytes or slot_stride != heads * head_bytes or block_stride % 16
                or array.data.ptr % 16):
            return False
    return True


def _row_copies_fit(cache, kv: int, heads: int, stored_row: int, head_pad: int, capability: int) -> bool:
    """Whether the threads of a block over a 16-bit (auto) cache can stage whole token
    rows of its KV heads (attention.cuh, KVC_STAGE_ROWS; quantized caches take them
    where bulk copies fit): sm_90 or newer, the unpadded head size, a multiple of 4
    heads a block (whole threads a token), the block's heads side by side in a row
    and 16-byte aligned rows. A token outside its sequence is zero-filled, not
    copied, so stale rows (which may hold NaN) never enter, as they would under
    bulk copies of whole pages. Measured (H200, tools/decode_variants.py, fp16
    32 x 32768, 4 heads a block, two alternating runs): d = 96 0.785 / 0.788 ms
    against 0.859 / 0.868 with per-thread copies, d = 128 1.037 / 1.060 against
    1.048 / 1.067, 32 x 8192 0.280 / 0.280 against 0.283 / 0.282."""
    if capability < 90 or kv not in (KV_F16, KV_BF16) or cache.head_size != head_pad or heads % 4:
        return False
    for array in (cache.key_cache, cache.value_cache):
        block_stride, slot_stride, head_stride = array.strides[:3]
        if head_stride != stored_row or slot_stride % 16 or block_stride % 16 or array.data.ptr % 16:
            return False
    return True


def _choose_kernel(cache, kv: int, rows_per_sequence: int, capability: int) -> Kernel:
    head_pad = -(-cache.head_size // HEAD_CLASS) * HEAD_CLASS
    quads = 1 if rows_per_sequence <= 4 else 2 if rows_per_sequence <= 8 or head_pad > MAX_HEAD_PAD_FOUR_QUADS else 4
    stored_row = _stored_row_bytes(cache, kv)
    num_kv_heads = cache.num_kv_heads
    best, best_bulk = None, False
    for heads in (8, 4, 2, 1):
        if num_kv_heads % heads:
            continue
        for tile in (DECODE_ROUND_TILE, 16):
            bulk = _bulk_copies_fit(cache, kv, heads, stored_row, head_pad, capability)
            rows = bulk or _row_copies_fit(cache, kv, heads, stored_row, head_pad, capability)
            staging = STAGE_ROWS if rows and ROW_STAGING else STAGE_BULK if bulk else STAGE_THREADS
            kernel = Kernel(kv, head_pad, heads, quads, tile, _copy_granule(cache, stored_row), staging)
            if kernel.shared_bytes <= STAGES * STAGE_BYTES_TARGET + 16 * STAGES:
                return _long_tile(_settle_staging(_round_tile(kernel), bulk))
            best, best_bulk = kernel, bulk
    return _settle_staging(best, best_bulk)


def _settle_staging(kernel: Kernel, bulk_fits: bool = True) -> Kernel:
    """Row copies go out a tile late (attention.cuh, which asserts
    ROW_STAGING_MIN_STAGES stages for them unless they go out before a tile, as
    _long_tile's two-block build has them); with fewer, bulk copies where they fit
    (int8 / fp8 at d = 96, two stages, H200, alternating runs: rows issued early
    measured 3.65-3.66 / 3.31-3.33 TB/s against 3.47-3.50 / 3.51-3.53), per-thread copies otherwise."""
    if kernel.staging == STAGE_ROWS and kernel.stages < ROW_STAGING_MIN_STAGES:
        return replace(kernel, staging=STAGE_BULK if bulk_fits else STAGE_THREADS)
    return kernel


def _round_tile(kernel: Kernel) -> Kernel:
    """32-token tiles for decode over 1-byte codes too, where a block's stages still
    fit a multiprocessor with at least DECODE_ROUND_MIN_WARPS warps: a tile of
    one quad is one softmax round of two steps (attention.cuh), which pays for
    a lost second block. Two stages instead of three where that keeps more
    warps (more blocks) a multiprocessor."""
    if (kernel.tile == DECODE_ROUND_TILE or kernel.quads != 1 or kernel.kv not in (KV_INT8, KV_FP8)
            or kernel.head_pad > DECODE_ROUND_MAX_HEAD_PAD):
        return kernel
    best = kernel
    for stages in (STAGES, 2):
        wider = replace(kernel, tile=DECODE_ROUND_TILE, stages=stages)
        warps = wider.blocks_per_sm * wider.heads
        if (wider.shared_bytes <= SHARED_BYTES_PER_SM and warps >= DECODE_ROUND_MIN_WARPS
                and (best is kernel or warps > best.blocks_per_sm * best.heads)):
            best = wider
    return best


def _long_tile(kernel: Kernel) -> Kernel:
    """64-token tiles for int4 decode of one quad at DECODE_LONG_TILE_HEAD_PADS with
    row copies, where one block of them fills a multiprocessor with at least
    DECODE_ROUND_MIN_WARPS warps: the measured builds (plan_attention keeps 32
    for short splits). At DECODE_TWO_BLOCK_HEAD_PADS, two stages where that fits
    two such blocks (rows_before; plan_attention keeps three for short splits)."""
    if (kernel.kv != KV_INT4 or kernel.quads != 1 or kernel.tile != DECODE_ROUND_TILE or kernel.staging != STAGE_ROWS
            or kernel.head_pad not in DECODE_LONG_TILE_HEAD_PADS):
        return kernel
    longer = replace(kernel, tile=DECODE_LONG_TILE)
    if longer.shared_bytes > SHARED_BYTES_PER_SM or longer.blocks_per_sm != 1 or longer.heads < DECODE_ROUND_MIN_WARPS:
        return kernel
    two_blocks = replace(longer, stages=2)
    if kernel.head_pad in DECODE_TWO_BLOCK_HEAD_PADS and two_blocks.blocks_per_sm == 2:
        return two_blocks
    return longer


def choose_splits(base_blocks: int, slots: int, most: int) -> int:
    """Splits per (sequence, row tile, head group): the count that minimises the
    waves of blocks times each block's share of the keys, ceil(base * s / slots) / s,
    the smallest such s on a tie. Whole waves matter: 17 splits of 32 sequences
    on 264 block slots are 2.06 waves, i.e. three rounds for 2.06 rounds of work."""
    best, best_cost = 1, float("inf")
    for splits in range(1, max(1, min(most, MAX_SPLITS)) + 1):
        cost = math.ceil(base_blocks * splits / slots) / splits
        if cost < best_cost * 0.95:   # more splits only for a clear gain: each adds merge traffic
            best, best_cost = splits, cost
    return best


# A prefill block's fixed cost (reading and rotating its query rows, the first
# copies, rotating and writing its output), in keys of work: 64 x 128 prompts
# (int4, d = 128, H200) spend about five 64-key tiles' time a block.
PREFILL_BLOCK_KEYS = 320
PREFILL_SPLIT_GAIN = 0.9   # splitting a prefill's keys must promise 10% (the merges cost too)


def choose_prefill_splits(keys_seen: np.ndarray, head_groups: int, slots: int, longest: int, tile: int,
                          most: int) -> int:
    """Splits for a prefill plan, from the keys each row tile sees (a causal prompt's
    tiles see ever more; choose_splits' equal blocks would misjudge them). Modelled
    time: the blocks taken longest first in waves of `slots`, each wave as long as
    its longest block, a block costing its keys plus PREFILL_BLOCK_KEYS; every head
    group runs the same tiles. The fewest splits within PREFILL_SPLIT_GAIN of the best."""
    tiles_a_wave = slots / head_groups
    candidates = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s <= min(most, MAX_SPLITS)]
    best, best_cost = 1, math.inf
    for splits in candidates:
        per_split = -(-longest // splits)
        split_tokens = -(-per_split // tile) * tile   # whole tiles
        starts = np.arange(splits, dtype=np.int64) * split_tokens
        work = np.clip(keys_seen[:, None].astype(np.int64) - starts[None, :], 0, split_tokens)
        blocks = np.sort(work[work > 0])[::-1] + PREFILL_BLOCK_KEYS
        if len(blocks) == 0:
            return 1
        firsts = (np.arange(math.ceil(len(blocks) / tiles_a_wave)) * tiles_a_wave).astype(np.int64)
        cost = float(blocks[firsts].sum())
        if cost < best_cost * PREFILL_SPLIT_GAIN:
            best, best_cost = splits, cost
    return best


# --- the prefill kernel's own rotation (prefill.cuh, load_query / write_output) ---

def dtype_code(dtype) -> int:
    """attention.cuh's kDtype* code of a query / output dtype."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return 0
    if dtype == np.float16:
        return 1
    if dtype == formats.MODEL_DTYPES["bfloat16"]:
        return 2
    raise TypeError(f"no attention kernel reads or writes {dtype}")


def logical_channels(head_pad: int, kv: int) -> np.ndarray:
    """prefill.cuh's channel_of: the cache channel of each logical dim of the products."""
    logical = np.arange(head_pad)
    if kv != KV_INT4:
        return logical
    within = logical & 7
    return (logical & ~7) + (within >> 1) + 4 * (within & 1)


def mma_b_fragments(b: np.ndarray, bf16: bool = False) -> np.ndarray:
    """B [K, N] (entries exact in fp16, or with bf16 in bf16) as m16n8k16 B fragments,
    [K/16, N/8, 32 lanes, 2] uint32: lane (g, t) of k step ks and n tile nt holds the
    16-bit pairs (B[16ks + 2t, 8nt + g], B[16ks + 2t + 1, ..]) and (B[16ks + 2t + 8, ..],
    B[16ks + 2t + 9, ..])."""
    k_steps, n_tiles = b.shape[0] // 16, b.shape[1] // 8
    ks, nt, lane = np.meshgrid(np.arange(k_steps), np.arange(n_tiles), np.arange(32), indexing="ij")
    g, t = lane >> 2, lane & 3
    k, n = 16 * ks + 2 * t, 8 * nt + g
    if bf16:   # the high half of the float32 (exact for the values this takes)
        bits = (b.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
    else:
        bits = b.astype(np.float16).view(np.uint16).astype(np.uint32)
    return np.stack([bits[k, n] | bits[k + 1, n] << 16, bits[k + 8, n] | bits[k + 9, n] << 16], axis=-1)


def rotation_fragments(rotation, head_pad: int, kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The forward and inverse rotation as the prefill kernel's mma operands.

    With F = H diag(s) (rotation.py: y = F x; x = F^T y / norm) and the kernel's
    dims in logical order (P[l, k] = F[channel_of(l), k], zero past the head
    size): the query's product is q P^T (B = P^T), the output's o P (B = P).
    The forward operand comes twice, [2, K/16, N/8, 32, 2]: as fp16 pairs for
    fp16 and fp32 queries, then as bf16 pairs for bf16 ones (prefill.cuh's
    forward_fragments), whose products take the query as it is."""
    d = rotation.head_size
    # With butterfly stages F = (H_{b/16} (x) I_16, per block) G, and the fragments hold G.
    matrix = np.kron(np.eye(d // 16), sylvester(16)) if rotation_stages(rotation) else rotation.matrix()
    forward = matrix * rotation.sign_vector()[None, :]
    channels = logical_channels(head_pad, kv)
    stored = channels < d
    p = np.zeros((head_pad, head_pad))
    p[np.flatnonzero(stored), :d] = forward[channels[stored]]
    return np.stack([mma_b_fragments(p.T), mma_b_fragments(p.T, bf16=True)]), mma_b_fragments(p)


def rotation_shift(rotation) -> int:
    """prefill.cuh's rotation_shift: -1 without a rotation; else log2 of the width of
    the independent blocks the rotation's fragments fall in: 16 dims for a
    block-diagonal rotation whose blocks span whole fragments (its 16-dim blocks,
    or for wider ones the factor beside rotation_stages), otherwise (kron,
    narrower blocks) one block for the whole head (30)."""
    if rotation is None or rotation.is_identity:
        return -1
    if rotation.kind == "blockdiag" and rotation.block >= 16:
        return 4
    return 30


def rotation_stages(rotation) -> int:
    """prefill.cuh's rotation_stages: butterflies across 16-dim groups that the kernel
    applies beside the fragments' products. A Sylvester block of b = 2^m >= 32 dims
    is H_b = H_{b/16} (x) H_16 = (H_{b/16} (x) I_16)(I_{b/16} (x) H_16): the fragments
    hold the second factor with the signs (16 of the 128 fragments at d = 128, not
    all 128), and m - 4 butterfly stages in registers do the first. 0 otherwise."""
    if rotation is None or rotation.is_identity or rotation.kind != "blockdiag" or rotation.block < 32:
        return 0
    return rotation.block.bit_length() - 5


@dataclass(eq=False)
class Plan:
    kernel: Kernel | PrefillKernel
    tiles: object             # device int32 [num_tiles, 2]: (sequence, row tile)
    num_tiles: int
    num_splits: int
    split_tokens: int
    head_groups: int
    workspace: dict = field(default_factory=dict)
    strides: dict = field(default_factory=dict)
    functions: dict = field(default_factory=dict)
    rotations: dict = field(default_factory=dict)
    builds: dict = field(default_factory=dict)   # for_query's builds, by query dtype and rotation
    handles: dict = field(default_factory=dict)  # CUfunctions for cuda_launch: builds, merges by output dtype
    # sm_90 and newer: the merge (and, with DEPENDENT_ATTENTION, the attention grid)
    # launched as programmatic dependents (cuda_launch).
    dependent_merge: bool = False

    def rotation_operands(self, rotation, head_pad: int, kv: int, device):
        """rotation_fragments on the device, made once per plan and rotation."""
        key = (rotation, head_pad, kv)
        if key not in self.rotations:
            if rotation is None or rotation.is_identity:
                self.rotations[key] = (None, None)
            else:
                self.rotations[key] = tuple(_upload(f, device) for f in rotation_fragments(rotation, head_pad, kv))
        return self.rotations[key]

    def function(self, name: str, defines: dict, kernel=None):
        """A compiled kernel of attention.cu, looked up once per plan (the per-layer
        call then does no compile-cache work); `kernel`: the attention build the
        call takes (the plan's, or its for_query variant), for its entry."""
        kernel = kernel or self.kernel
        key = (name, tuple(sorted(defines.items())))
        if key not in self.functions:
            arch = kernel.arch if name == kernel.entry else None
            function = jit.get_function("attention", name, defines, arch)
            if name == kernel.entry:
                function.max_dynamic_shared_size_bytes = kernel.shared_bytes
            self.functions[key] = function
        return self.functions[key]

    # The per-call lookups below are memoised by keys of their own (functions in
    # `functions`, builds in `builds`): a layer's call then builds no defines and
    # sorts nothing (host time; tools/host_overhead.py).
    def entry_function(self, kernel):
        """`function` of the attention build `kernel`'s own entry."""
        function = self.functions.get(kernel)
        if function is None:
            function = self.functions[kernel] = self.function(kernel.entry, kernel.defines, kernel)
        return function

    def merge_function(self, out_dtype):
        """`function` of merge_splits writing `out_dtype`."""
        key = ("merge_splits", out_dtype)
        function = self.functions.get(key)
        if function is None:
            function = self.functions[key] = self.function("merge_splits",
                                                           {"KVC_OUT_T": formats.CPP_TYPES[out_dtype]})
        return function

    def entry_handle(self, kernel) -> int:
        """entry_function's CUfunction, for cuda_launch's packed launch."""
        handle = self.handles.get(kernel)
        if handle is None:
            handle = self.handles[kernel] = cuda_launch.function_handle(self.entry_function(kernel))
        return handle

    def merge_handle(self, out_dtype) -> int:
        """merge_function's CUfunction, for cuda_launch's dependent launch."""
        handle = self.handles.get(out_dtype)
        if handle is None:
            handle = self.handles[out_dtype] = cuda_launch.function_handle(self.merge_function(out_dtype))
        return handle

    def for_query(self, query_dtype, rotation, out_dtype):
        """The plan's kernel's for_query build for this query dtype, rotation and output dtype."""
        key = (query_dtype, rotation, out_dtype)
        kernel = self.builds.get(key)
        if kernel is None:
            kernel = self.builds[key] = self.kernel.for_query(query_dtype, rotation, out_dtype)
        return kernel


def plan_attention(batch, cache, num_query_heads: int, num_query_tokens: int) -> Plan:
    import cupy
    if cache.block_size & (cache.block_size - 1):
        # attention.cuh finds a token's page and slot by shift and mask.
        raise ValueError(f"block_size={cache.block_size}: the CUDA attention kernels need a power of two "
                         "(the CPU backend takes any block size)")
    device = cache.device
    group = num_query_heads // cache.num_kv_heads
    kv = kv_code(cache)
    host = batch.host
    # Lengths on a device: plan for the longest sequence the block table allows.
    longest = int(host["seq_lens"].max(initial=1)) if host is not None else batch.table_width * batch.block_size
    offsets = batch.host_query_offsets
    query_lens = None if offsets is None else np.diff(offsets)
    max_rows = group * (int(query_lens.max(initial=1)) if query_lens is not None else num_query_tokens)
    capability = _compute_capability(device)
    kernel = _choose_kernel(cache, kv, max_rows, capability)
    if max_rows >= PREFILL_MIN_ROWS and kernel.head_pad <= PREFILL_MAX_HEAD_PAD:
        rotated = cache.rotation is not None and not cache.rotation.is_identity
        kernel = _prefill_kernel(kv, kernel.head_pad, _copy_granule(cache, _stored_row_bytes(cache, kv)), capability,
                                 longest, rotated)
    rows_per_tile = kernel.rows_per_tile
    if query_lens is not None:
        row_tiles = -(-query_lens * group // rows_per_tile)
        seqs = np.repeat(np.arange(batch.num_seqs), row_tiles)
        within = np.arange(len(seqs)) - np.repeat(np.cumsum(row_tiles) - row_tiles, row_tiles)
    else:
        per_seq = max(1, -(-num_query_tokens * group // rows_per_tile))
        seqs = np.repeat(np.arange(batch.num_seqs), per_seq)
        within = np.tile(np.arange(per_seq), batch.num_seqs)
    keys_seen = None
    if isinstance(kernel, PrefillKernel) and host is not None and query_lens is not None:
        # The blocks that see the most keys first, so that the last wave is short ones.
        keys_seen = (host["seq_lens"][seqs] - query_lens[seqs]
                     + np.minimum((within + 1) * rows_per_tile, query_lens[seqs] * group) // group)
        order = np.argsort(-keys_seen, kind="stable")
        seqs, within, keys_seen = seqs[order], within[order], keys_seen[order]
    tiles = np.stack([seqs, within], axis=1).astype(np.int32).reshape(-1, 2)
    head_groups = cache.num_kv_heads // kernel.kv_heads_per_block

    with cupy.cuda.Device(device.index):
        sms = cupy.cuda.Device(device.index).attributes["MultiProcessorCount"]

    def split_keys(kernel: Kernel) -> tuple[int, int]:
        most = max(1, -(-longest // (MIN_TILES_PER_SPLIT * kernel.tile)))
        slots = sms * kernel.blocks_per_sm
        if keys_seen is not None:
            splits = choose_prefill_splits(keys_seen, head_groups, slots, longest, kernel.tile, most)
        else:
            splits = choose_splits(len(tiles) * head_groups, slots, most)
        split_tokens = -(-longest // splits)
        split_tokens = -(-split_tokens // kernel.tile) * kernel.tile
        return -(-longest // split_tokens), split_tokens

    kernel, splits, split_tokens = _fit_tile_to_splits(kernel, split_keys)
    return Plan(kernel, _upload(tiles, device), len(tiles), splits, split_tokens, head_groups,
                dependent_merge=capability >= cuda_launch.MIN_COMPUTE_CAPABILITY)


def _prefill_kernel(kv: int, head_pad: int, chunk: int, capability: int, longest: int,
                    rotated: bool) -> PrefillKernel:
    """The prefill build for a batch whose longest sequence holds `longest` keys, over a
    cache with a rotation or not: wgmma on sm_90 (16-bit caches with
    PREFILL_WGMMA_AUTO), with the producer warpgroup (PREFILL_PRODUCER) from
    producer_min_keys keys; mma.sync otherwise. Without the producer, the
    build for short prompts where it applies (PREFILL_UNROTATED, PREFILL_SHORT_*)."""
    takes_wgmma = kv in (KV_INT4, KV_INT8, KV_FP8) or PREFILL_WGMMA_AUTO
    wgmma = PREFILL_WGMMA and capability == 90 and takes_wgmma
    producer = PREFILL_PRODUCER and longest >= producer_min_keys(kv, chunk, rotated)
    kernel = PrefillKernel.planned(kv, head_pad, chunk, wgmma, producer=producer)
    if not wgmma or kernel.producer:
        return kernel
    if PREFILL_UNROTATED and not rotated:
        kernel = replace(kernel, rotated=False)
    if longest <= PREFILL_SHORT_KEYS and (PREFILL_SHORT_ROTATED or not kernel.rotated):
        short = replace(kernel, warps=PREFILL_SHORT_WARPS, tile=PREFILL_SHORT_TILE, min_blocks=PREFILL_SHORT_BLOCKS)
        if short.blocks_per_sm >= PREFILL_SHORT_BLOCKS:   # (16-bit rows at d = 128 do not fit twice)
            kernel = short
    return kernel


def producer_min_keys(kv: int, chunk: int, rotated: bool) -> int:
    """Keys (the longest sequence's) from which the prefill takes the producer build:
    PREFILL_PRODUCER_MIN_KEYS_ROTATED for quantized caches with a rotation and
    16-byte copies, else PREFILL_PRODUCER_MIN_KEYS."""
    if kv in (KV_INT4, KV_INT8, KV_FP8) and rotated and chunk >= 16:
        return min(PREFILL_PRODUCER_MIN_KEYS, PREFILL_PRODUCER_MIN_KEYS_ROTATED)
    return PREFILL_PRODUCER_MIN_KEYS


def _short_prompt_builds(kv: int, head_pad: int, chunk: int) -> list:
    """The sm_90 builds without the producer that _prefill_kernel can take (rotated or
    not, up to PREFILL_SHORT_KEYS keys and beyond), each once."""
    builds = []
    for rotated in (True, False):
        for longest in (PREFILL_SHORT_KEYS, PREFILL_SHORT_KEYS + 1):
            below_producer = producer_min_keys(kv, chunk, rotated) - 1
            kernel = _prefill_kernel(kv, head_pad, chunk, 90, min(longest, below_producer), rotated)
            if kernel not in builds:
                builds.append(kernel)
    return builds


def _fit_tile_to_splits(kernel, split_keys) -> tuple:
    """The kernel with a tile its splits are long enough for, its splits and keys a
    split (split_keys(kernel)). A decode kernel's 64-token tiles step down to 32
    where a split would hold fewer than DECODE_LONG_TILE_MIN_SPLIT_TOKENS keys,
    then any longer tile to 16 below LONG_SPLIT_TOKENS; each step splits again
    (shorter tiles allow more splits); before those, a two-block build of 64-token
    tiles (_long_tile) takes one block of three stages where a split would hold
    fewer than DECODE_TWO_BLOCK_MIN_SPLIT_TOKENS keys. Prefill kernels keep theirs."""
    splits, split_tokens = split_keys(kernel)
    while isinstance(kernel, Kernel):
        if kernel.tile == DECODE_LONG_TILE and kernel.rows_before and split_tokens < DECODE_TWO_BLOCK_MIN_SPLIT_TOKENS:
            kernel = replace(kernel, stages=STAGES)   # one block of three stages
        elif kernel.tile == DECODE_LONG_TILE and split_tokens < DECODE_LONG_TILE_MIN_SPLIT_TOKENS:
            kernel = replace(kernel, tile=DECODE_ROUND_TILE)
        elif kernel.tile > 16 and split_tokens < LONG_SPLIT_TOKENS:
            kernel = replace(kernel, tile=16)
        else:
            break
        splits, split_tokens = split_keys(kernel)
    return kernel, splits, split_tokens


def _compute_capability(device) -> int:
    import cupy
    return int(cupy.cuda.Device(device.index).compute_capability)


def _upload(array: np.ndarray, device):
    import cupy
    with cupy.cuda.Device(device.index):
        return cupy.asarray(array)


def _rotate_rows(*args, **kwargs):
    from . import cuda   # the backend module owns the rotation kernels
    return cuda.rotate_rows(*args, **kwargs)


def _buffer(plan: Plan, name: str, shape: tuple, device):
    """A float32 buffer of one call's shape, made once per plan, name and shape."""
    import cupy
    key = (name, shape, device.index)
    if key not in plan.workspace:
        with cupy.cuda.Device(device.index):
            plan.workspace[key] = cupy.zeros(shape, cupy.float32)
    return plan.workspace[key]


def _strides(plan: Plan, cache) -> tuple:
    """Byte strides (block, slot, head) of K, V and their scales: twelve kernel arguments,
    worked out once per cache (a layer's call then only passes them)."""
    key = id(cache.key_cache), id(cache.k_scale_cache)
    if key not in plan.strides:
        scales = (cache.k_scale_cache, cache.v_scale_cache) if cache.k_scale_cache is not None else (
            cache.key_cache, cache.value_cache)
        values = tuple(np.int64(s) for a in (cache.key_cache, cache.value_cache) + scales for s in a.strides[:3])
        plan.strides[key] = (values, cache)   # the cache kept alive: its ids stay its own
    return plan.strides[key][0]


def _pair_aligned(array) -> bool:
    """Rows of `array` [T, H, d] start at a pair of elements (prefill.cuh reads and
    writes pairs), its last axis contiguous."""
    size = array.itemsize
    return (array.strides[2] == size and array.strides[0] % (2 * size) == 0
            and array.strides[1] % (2 * size) == 0 and array.data.ptr % (2 * size) == 0)


def _prefill_io(plan: Plan, query, cache, softmax_scale: float, sinks, out) -> tuple:
    """The prefill kernel's own arguments (attention.cuh, Params: query_in .. direct).

    The kernel reads the caller's query and rotates it itself. With one split
    it also normalises, rotates back and writes `out`, unless `out` is not
    pair-aligned or the rotation's blocks are narrower than an mma fragment
    (16 dims), where a product would carry a non-finite value across blocks:
    those go through the merge (which rotates back block by block)."""
    import cupy
    kernel, rotation = plan.kernel, cache.rotation
    q = query.data if _pair_aligned(query.data) else cupy.ascontiguousarray(query.data)
    forward, inverse = plan.rotation_operands(rotation, kernel.head_pad, kernel.kv, cache.device)
    shift = rotation_shift(rotation)
    norm = 1 if shift < 0 else rotation.norm
    # Blocks narrower than a fragment: a product would carry a NaN or inf across them.
    narrow = rotation is not None and rotation.kind == "blockdiag" and rotation.block < 16
    direct = plan.num_splits == 1 and not narrow and _pair_aligned(out.data)
    size = q.itemsize
    return (q, np.int64(q.strides[0] // size), np.int64(q.strides[1] // size), np.int32(dtype_code(query.dtype)),
            forward if forward is not None else np.uintp(0), inverse if inverse is not None else np.uintp(0),
            np.int32(shift), np.int32(rotation_stages(rotation)),
            np.float32(1.0 / query_divisor(rotation, softmax_scale)), np.float32(1.0 / norm),
            out.data, np.int64(out.data.strides[0] // out.data.itemsize),
            np.int64(out.data.strides[1] // out.data.itemsize), np.int32(dtype_code(out.dtype)),
            sinks if sinks is not None else np.uintp(0), np.int32(direct))


def merge_split_warps(num_splits: int) -> int:
    """Warps that share one row's merge (attention.cuh, merge_splits): the largest power
    of two up to MERGE_WARPS and the split count."""
    return min(MERGE_WARPS, 1 << (max(1, num_splits).bit_length() - 1))


def _in_kernel_rotation(rotation) -> bool:
    """Whether the decode kernel (the query) and the merge (the output) apply the
    rotation themselves: none, or blockdiag (butterflies within a warp). A kron
    plan's mix goes through the rotate kernel, before and after."""
    return rotation is None or rotation.is_identity or rotation.kind == "blockdiag"


def sign_shift(rotation) -> int:
    """The kernels' sign_shift: log2 b of a blockdiag rotation's blocks (butterflies
    within a warp, attention.cuh's warp_butterflies); -1 without a rotation."""
    if rotation is None or rotation.is_identity:
        return -1
    if rotation.kind != "blockdiag":
        raise ValueError(f"rotation kind {rotation.kind!r}: the kernels' butterflies are blockdiag only")
    return rotation.block.bit_length() - 1


def _sign_operands(rotation, device) -> tuple:
    """(sign words, sign_shift) of the kernels' blockdiag butterflies; (null, -1): none,
    or a plan they do not apply (_in_kernel_rotation)."""
    from .cuda import _rotation_on
    if not _in_kernel_rotation(rotation) or sign_shift(rotation) < 0:
        return np.uintp(0), np.int32(-1)
    return _rotation_on(rotation, device.index), np.int32(sign_shift(rotation))


def _decode_io(query, rotation, softmax_scale: float, signs: tuple) -> tuple:
    """The decode kernel's values of the prefill arguments, and its own: where it
    reads the caller's query itself (_in_kernel_rotation), that query, how to
    scale it and `signs` (_sign_operands) to rotate it; otherwise a rotated
    float32 query comes as `query`."""
    import cupy
    null = np.uintp(0)
    if not _in_kernel_rotation(rotation):
        q, strides, code, factor = null, (0, 0), 0, 1.0
    else:
        q = query.data if query.data.strides[2] == query.data.itemsize else cupy.ascontiguousarray(query.data)
        strides = (q.strides[0] // q.itemsize, q.strides[1] // q.itemsize)
        code, factor = dtype_code(query.dtype), 1.0 / query_divisor(rotation, softmax_scale)
    return (q, np.int64(strides[0]), np.int64(strides[1]), np.int32(code), null, null, np.int32(-1),
            np.int32(0), np.float32(factor), np.float32(1), null, np.int64(0), np.int64(0), np.int32(0),
            null, np.int32(0)) + signs


def paged_attention(query, cache, batch, plan: Plan, *, softmax_scale: float, sliding_window,
                    softcap: float, sinks, out) -> None:
    import cupy
    if not out.data.flags.c_contiguous:
        # The merge (and the rotate kernel) write whole rows back to back: a strided
        # `out` gets them through a contiguous copy.
        with cupy.cuda.Device(cache.device.index):
            rows = replace(out, data=cupy.empty(out.data.shape, out.data.dtype))
        paged_attention(query, cache, batch, plan, softmax_scale=softmax_scale, sliding_window=sliding_window,
                        softcap=softcap, sinks=sinks, out=rows)
        out.data[...] = rows.data
        return
    device = cache.device
    num_tokens, num_heads, head_size = query.shape
    rows = (num_tokens, num_heads, head_size)
    rotation = cache.rotation
    rotated = rotation is not None and not rotation.is_identity
    from . import cuda
    arrays = batch.arrays(cuda, device)
    kernel = plan.kernel
    prefill = isinstance(kernel, PrefillKernel)
    if prefill:
        kernel = plan.for_query(query.dtype, rotation, out.dtype)
    in_kernel = _in_kernel_rotation(rotation)
    with cupy.cuda.Device(device.index):
        sink_logits = None if sinks is None else cupy.asarray(sinks.data, dtype=cupy.float32)
        # The decode kernel's and the merge's butterflies (null, -1: none, or kron).
        signs = _sign_operands(rotation, device)
        if prefill:
            io = _prefill_io(plan, query, cache, softmax_scale, sink_logits, out) + (np.uintp(0), np.int32(-1))
        else:
            io = _decode_io(query, rotation, softmax_scale, signs)
        direct = bool(io[-3])
        query_rows = None
        if not prefill and not in_kernel:
            # 1. The query in float32, rotated (kron), scaled (softmax scale, rotation norm).
            query_rows = _buffer(plan, "query", rows, device)
            _rotate_rows(query.data.reshape(-1, head_size), query_rows.reshape(-1, head_size),
                         rotation, inverse=False, divisor=query_divisor(rotation, softmax_scale),
                         x_dtype=query.dtype, out_dtype=np.dtype(np.float32))
        # 2. Partial softmax states of every split (prefill with one split: `out` itself).
        part_out = None if direct else _buffer(plan, "part_out", (plan.num_splits,) + rows, device)
        part_stats = None if direct else _buffer(plan, "part_stats", (plan.num_splits, num_tokens, num_heads, 2),
                                                 device)
        has_scales = cache.k_scale_cache is not None
        code_unit = 256.0 if kernel.kv == KV_FP8 else 1.0
        table = arrays["block_table"]
        null = np.uintp(0)
        grid = (plan.num_splits, plan.num_tiles, plan.head_groups)
        attention_args = (
            query_rows if query_rows is not None else null, cache.key_cache, cache.value_cache,
            cache.k_scale_cache if has_scales else cache.key_cache,
            cache.v_scale_cache if has_scales else cache.value_cache,
            *_strides(plan, cache), table, arrays["seq_lens"], arrays["cu_seqlens_q"], plan.tiles,
            part_out if part_out is not None else null, part_stats if part_stats is not None else null,
            num_tokens, num_heads, num_heads // cache.num_kv_heads, head_size,
            cache.key_cache.shape[3] * cache.key_cache.itemsize, cache.block_size,
            int(cache.block_size).bit_length() - 1, cache.num_blocks, table.shape[1], plan.split_tokens,
            sliding_window or 0, softcap, code_unit, *io)
        if PACKED_LAUNCH:
            cuda_launch.launch(plan.entry_handle(kernel), grid, (kernel.threads,), ATTENTION_SIGNATURE,
                               attention_args, stream=cupy.cuda.get_current_stream().ptr,
                               shared_bytes=kernel.shared_bytes,
                               dependent=plan.dependent_merge and DEPENDENT_ATTENTION)
        else:
            plan.entry_function(kernel)(grid, (kernel.threads,),
                                        cuda_launch.numpy_arguments(ATTENTION_SIGNATURE, attention_args),
                                        shared_mem=kernel.shared_bytes)
        if direct:
            return
        # 3. Merge the splits (and the sinks), rotating back into `out` (none or
        # blockdiag); 4. a kron plan's rotate launch.
        target = out.data if in_kernel else _buffer(plan, "out", rows, device)
        target_dtype = out.dtype if in_kernel else np.dtype(np.float32)   # out.data: raw storage of bf16
        split_warps = merge_split_warps(plan.num_splits)
        merge_grid = (-(-num_tokens * num_heads * split_warps // MERGE_WARPS),)
        merge_args = (part_out, part_stats, sink_logits if sink_logits is not None else null,
                      target, np.int32(plan.num_splits), np.int32(num_tokens), np.int32(num_heads),
                      np.int32(head_size), np.int32(split_warps), *signs,
                      np.float32(1.0 / (rotation.norm if rotated else 1)))
        if plan.dependent_merge and DEPENDENT_MERGE:
            # Its blocks start as the attention's leave, not after the launch gap.
            cuda_launch.launch(plan.merge_handle(target_dtype), merge_grid, (32 * MERGE_WARPS,), MERGE_SIGNATURE,
                               merge_args, stream=cupy.cuda.get_current_stream().ptr, dependent=True)
        else:
            plan.merge_function(target_dtype)(merge_grid, (32 * MERGE_WARPS,), merge_args)
        if not in_kernel:
            _rotate_rows(target.reshape(-1, head_size), out.data.reshape(-1, head_size),
                         rotation, inverse=True, divisor=float(rotation.norm),
                         x_dtype=np.dtype(np.float32), out_dtype=out.dtype)


# --- what `kvcupy check` compiles (cuda_specs.FAMILIES) --------------------

def specialisations(all: bool) -> list:
    """(entry, kernels, defines) of attention.cu. all=True: every KV dtype x head-size
    class x query rows per warp, at 8 and 4 warps a block and 16-byte copies (the
    aligned caches the library allocates), plus the merge kernel for
    every dtype, and the prefill kernel for every KV dtype and head-size class up to
    PREFILL_MAX_HEAD_PAD; else a sample that takes each code path once, the 4-byte
    and byte-wise copies of strided and odd-length rows among them."""
    from .cuda_specs import Specialisation
    models = list(formats.MODEL_DTYPES.values())
    found = [Specialisation("attention", ("merge_splits",), {"KVC_OUT_T": formats.CPP_TYPES[d]})
             for d in models]
    kernels = []
    if all:
        for kv in (KV_INT4, KV_INT8, KV_FP8, KV_F16, KV_BF16):
            for head_pad in range(HEAD_CLASS, 257, HEAD_CLASS):
                for heads in (8, 4):
                    for quads in (1, 2, 4) if head_pad <= MAX_HEAD_PAD_FOUR_QUADS else (1, 2):
                        tile = 32 if kv == KV_INT4 else 16
                        # Every staging: bulk or row copies on sm_90 where the pages allow them (16-bit caches: rows).
                        quantized = kv in (KV_INT4, KV_INT8, KV_FP8)
                        stagings = (STAGE_THREADS, STAGE_BULK, STAGE_ROWS) if quantized else (STAGE_THREADS, STAGE_ROWS)
                        settled = [_settle_staging(_round_tile(Kernel(kv, head_pad, heads, quads, tile, 16, staging)),
                                                   quantized)
                                   for staging in stagings]
                        longer = [_long_tile(kernel) for kernel in settled]
                        # and the one-block build that the two-block one's short splits take
                        one_block = [replace(kernel, stages=STAGES) for kernel in longer if kernel.rows_before]
                        kernels += settled + [kernel for kernel in longer + one_block if kernel not in settled]
                if head_pad <= PREFILL_MAX_HEAD_PAD:
                    kernels.append(PrefillKernel.planned(kv, head_pad, 16, False))
                    kernels += _short_prompt_builds(kv, head_pad, 16)
                    kernels.append(PrefillKernel.planned(kv, head_pad, 16, True, producer=True))
                    if kv in (KV_F16, KV_BF16):
                        kernels.append(replace(kernels[-1], direct=True))
    else:
        int4_rows = Kernel(KV_INT4, 128, 8, 1, DECODE_ROUND_TILE, 16, STAGE_ROWS)
        kernels = [int4_rows, _long_tile(int4_rows),
                   Kernel(KV_INT4, 96, 8, 4, 32, 4),
                   Kernel(KV_INT4, 64, 2, 2, 32, 1), Kernel(KV_INT8, 256, 8, 2, 16, 16),
                   Kernel(KV_FP8, 128, 4, 4, 16, 16, STAGE_ROWS), Kernel(KV_FP8, 128, 8, 1, 32, 16, STAGE_ROWS),
                   Kernel(KV_INT8, 96, 8, 1, 32, 16, STAGE_BULK, 2), Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS),
                   _long_tile(Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS)),
                   replace(_long_tile(Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS)), stages=STAGES),
                   Kernel(KV_F16, 128, 4, 1, 16, 16), Kernel(KV_BF16, 128, 4, 1, 16, 16, STAGE_ROWS),
                   Kernel(KV_BF16, 96, 4, 2, 16, 8), Kernel(KV_BF16, 64, 4, 1, 16, 16),
                   PrefillKernel.planned(KV_INT4, 128, 16, False), PrefillKernel.planned(KV_INT8, 96, 4, False),
                   PrefillKernel.planned(KV_FP8, 64, 16, False), PrefillKernel.planned(KV_F16, 128, 16, False),
                   PrefillKernel.planned(KV_BF16, 32, 1, False),
                   PrefillKernel.planned(KV_INT4, 128, 16, True), PrefillKernel.planned(KV_FP8, 96, 4, True),
                   PrefillKernel.planned(KV_INT8, 32, 16, True),
                   PrefillKernel.planned(KV_INT4, 128, 16, True, producer=True),
                   PrefillKernel.planned(KV_INT8, 96, 4, True, producer=True),
                   PrefillKernel.planned(KV_BF16, 128, 16, True, producer=True),
                   PrefillKernel.planned(KV_F16, 64, 8, True), PrefillKernel.planned(KV_BF16, 96, 16, True),
                   *_short_prompt_builds(KV_INT4, 128, 16), *_short_prompt_builds(KV_FP8, 96, 4),
                   *_short_prompt_builds(KV_BF16, 128, 16)]
        # The direct builds: a stager's own piece (d = 128, 16-byte pieces; d = 64, 8-byte), the general loop (d = 96),
        # as a 16-bit call takes them (a bf16 row's direct build serves a bf16 query alone).
        kernels += [replace(PrefillKernel.planned(kv, head_pad, chunk, True, producer=True), direct=True,
                            wide_rows=False)
                    for kv, head_pad, chunk in ((KV_BF16, 128, 16), (KV_F16, 96, 16), (KV_F16, 64, 8))]
        # Builds for 16-bit rows only: mma.sync, wgmma, producer and short.
        kernels += [replace(kernel, wide_rows=False)
                    for kernel in (PrefillKernel.planned(KV_INT4, 128, 16, False),
                                   PrefillKernel.planned(KV_FP8, 96, 4, True),
                                   PrefillKernel.planned(KV_INT4, 128, 16, True, producer=True),
                                   *_short_prompt_builds(KV_INT4, 128, 16))
                    if kernel.rotated]
    if all:   # every rotated prefill build's twin for 16-bit rows only (for_query)
        kernels += [replace(kernel, wide_rows=False) for kernel in kernels
                    if isinstance(kernel, PrefillKernel) and kernel.rotated]
    found += [Specialisation("attention", (kernel.entry,), kernel.defines, kernel.arch)
              for kernel in kernels]
    # The wgmma operand-layout probes of tests/test_gpu_wgmma.py.
    found.append(Specialisation("wgmma_check", ("wgmma_scores", "wgmma_values"), {}, "sm_90a"))
    return found
