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
pipeline stage. Prefill (a sequence bringing at least tuning.prefill_min_rows query
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
SHARED_BYTES_PER_SM = 227 * 1024
# How a decode block stages its tiles (Kernel.staging, attention.cuh's KVC_STAGING):
# every thread copies pieces and the block syncs; warp 0 copies each page's
# run with one bulk copy; or every thread copies whole token rows, completing
# on the stage's mbarrier (no block-wide sync). The last two need sm_90 and
# pages whose rows hold the block's KV heads side by side (_bulk_copies_fit;
# 16-bit caches take row copies only, _row_copies_fit).
STAGE_THREADS, STAGE_BULK, STAGE_ROWS = 0, 1, 2
STAGES = 3               # a decode block's pipeline depth in tiles, unless a build says otherwise
# Row copies go out a tile late (after the tile is read): with fewer stages none would be in flight.
ROW_STAGING_MIN_STAGES = 3
MAX_SPLITS = 256         # attention.cuh: kMergeMaxSplits
MERGE_WARPS = 8          # attention.cuh: kMergeWarps (split_warps of them a row)
MERGE_SIGNATURE = "PPPPiiiiiPif"   # attention.cu's merge_splits parameters (cuda_launch's codes)
# The attention entries' 54 parameters (attention.cu, KVC_ATTENTION_ARGS) in
# cuda_launch's codes, packed into one buffer a launch.
ATTENTION_SIGNATURE = "PPPPP" + "q" * 12 + "PPPPPP" + "i" * 11 + "ffPqqiPPiiffPqqiPiPi"
# Four quads (16 query rows a warp) double the accumulators of two: above this
# head size they spill even at 255 registers, so larger heads take more row tiles.
MAX_HEAD_PAD_FOUR_QUADS = 128
DECODE_ROUND_TILE = 32   # one softmax round of two 16-token steps (attention.cuh)
DECODE_LONG_TILE = 64    # one round of four steps: int4 decode's long splits
PREFILL_MAX_HEAD_PAD = 128   # above, the prefill kernel's register-held accumulators would spill
PREFILL_WARPS = 8            # 128 query rows a block (mma.sync build), each tile decoded once for all
PREFILL_WGMMA_WARPS = 12     # three warpgroups: three warps a scheduler hide the softmax's latencies
PREFILL_TILE = 64
PREFILL_STAGES = 3           # raw stages of quantized caches (besides the decoded tiles)
PREFILL_AUTO_STAGES = 2      # fp16 / bf16 rows, 4x the bytes of int4 ones (3 do not fit beside the wgmma buffers)
PREFILL_MIN_BLOCKS = 1       # 8 warps a multiprocessor: no spills (`kvcupy check --all`)
PREFILL_DIRECT_STAGES = 1    # direct builds: raw tiles in flight beside the consumers' three buffers, at most


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
        """The build a call takes: the direct one for 16-bit rows in the producer
        build (fp16 rows always; bf16 rows under a bf16 query without rotation,
        which bf16 operands hold exactly, as fp16 ones hold an fp16 query); a
        rotated build without the float32 rows' code (wide_rows False) where
        neither the query nor the output is float32: a shorter first compile."""
        kernel = self
        if self.rotated and np.dtype(query_dtype) != np.float32 and np.dtype(out_dtype) != np.float32:
            kernel = replace(kernel, wide_rows=False)
        if not (self.producer and self.kv in (KV_F16, KV_BF16) and self.chunk >= 4):
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
        columns where head_pad is a multiple of 64, else 64-byte ones): the direct builds,
        whose copies then take whole rows without bank conflicts."""
        return self.direct

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


def _choose_kernel(cache, kv: int, rows_per_sequence: int, capability: int, tuning: Tuning) -> Kernel:
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
            staging = STAGE_ROWS if rows and tuning.row_staging else STAGE_BULK if bulk else STAGE_THREADS
            kernel = Kernel(kv, head_pad, heads, quads, tile, _copy_granule(cache, stored_row), staging)
            if kernel.shared_bytes <= STAGES * tuning.stage_bytes_target + 16 * STAGES:
                return _long_tile(_settle_staging(_round_tile(kernel, tuning), bulk), tuning)
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


def _round_tile(kernel: Kernel, tuning: Tuning) -> Kernel:
    """32-token tiles for decode over 1-byte codes too, where a block's stages still
    fit a multiprocessor with at least tuning.round_min_warps warps: a tile of
    one quad is one softmax round of two steps (attention.cuh), which pays for
    a lost second block. Two stages instead of three where that keeps more
    warps (more blocks) a multiprocessor."""
    if (kernel.tile == DECODE_ROUND_TILE or kernel.quads != 1 or kernel.kv not in (KV_INT8, KV_FP8)
            or kernel.head_pad > tuning.round_max_head_pad):
        return kernel
    best = kernel
    for stages in (STAGES, 2):
        wider = replace(kernel, tile=DECODE_ROUND_TILE, stages=stages)
        warps = wider.blocks_per_sm * wider.heads
        if (wider.shared_bytes <= SHARED_BYTES_PER_SM and warps >= tuning.round_min_warps
                and (best is kernel or warps > best.blocks_per_sm * best.heads)):
            best = wider
    return best


def _long_tile(kernel: Kernel, tuning: Tuning) -> Kernel:
    """64-token tiles for int4 decode of one quad at tuning.long_tile_head_pads with
    row copies, where one block of them fills a multiprocessor with at least
    tuning.round_min_warps warps: one softmax round of four steps a tile, one
    block instead of two whose schedulers serve them unevenly (plan_attention
    keeps 32 for short splits). At tuning.two_block_head_pads, two stages where
    that fits two such blocks (rows_before; plan_attention keeps three for
    short splits)."""
    if (kernel.kv != KV_INT4 or kernel.quads != 1 or kernel.tile != DECODE_ROUND_TILE or kernel.staging != STAGE_ROWS
            or kernel.head_pad not in tuning.long_tile_head_pads):
        return kernel
    longer = replace(kernel, tile=DECODE_LONG_TILE)
    if (longer.shared_bytes > SHARED_BYTES_PER_SM or longer.blocks_per_sm != 1
            or longer.heads < tuning.round_min_warps):
        return kernel
    two_blocks = replace(longer, stages=2)
    if kernel.head_pad in tuning.two_block_head_pads and two_blocks.blocks_per_sm == 2:
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


def choose_prefill_splits(keys_seen: np.ndarray, head_groups: int, slots: int, longest: int, tile: int,
                          most: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Splits for a prefill plan, from the keys each row tile sees (a causal prompt's
    tiles see ever more; choose_splits' equal blocks would misjudge them). Modelled
    time: the blocks taken longest first in waves of `slots`, each wave as long as
    its longest block, a block costing its keys plus tuning.prefill_block_keys; every
    head group runs the same tiles. The fewest splits within tuning.prefill_split_gain
    of the best."""
    tiles_a_wave = slots / head_groups
    candidates = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s <= min(most, MAX_SPLITS)]
    best, best_cost = 1, math.inf
    for splits in candidates:
        per_split = -(-longest // splits)
        split_tokens = -(-per_split // tile) * tile   # whole tiles
        starts = np.arange(splits, dtype=np.int64) * split_tokens
        work = np.clip(keys_seen[:, None].astype(np.int64) - starts[None, :], 0, split_tokens)
        blocks = np.sort(work[work > 0])[::-1] + tuning.prefill_block_keys
        if len(blocks) == 0:
            return 1
        firsts = (np.arange(math.ceil(len(blocks) / tiles_a_wave)) * tiles_a_wave).astype(np.int64)
        cost = float(blocks[firsts].sum())
        if cost < best_cost * tuning.prefill_split_gain:
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
    # sm_90 and newer (unless the tuning says otherwise): the attention grid and the
    # merge launched as programmatic dependents (cuda_launch).
    dependent_launch: bool = False

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
    tuning = DEFAULT_TUNING if batch.tuning is None else batch.tuning
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning={tuning!r}: the CUDA backend takes a kvcupy.backends.cuda_attention.Tuning")
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
    kernel = _choose_kernel(cache, kv, max_rows, capability, tuning)
    if max_rows >= tuning.prefill_min_rows and kernel.head_pad <= PREFILL_MAX_HEAD_PAD:
        rotated = cache.rotation is not None and not cache.rotation.is_identity
        kernel = _prefill_kernel(kv, kernel.head_pad, _copy_granule(cache, _stored_row_bytes(cache, kv)), capability,
                                 longest, rotated, tuning)
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
        most = min(tuning.max_splits, max(1, -(-longest // (tuning.min_tiles_per_split * kernel.tile))))
        slots = sms * kernel.blocks_per_sm
        if keys_seen is not None:
            splits = choose_prefill_splits(keys_seen, head_groups, slots, longest, kernel.tile, most, tuning)
        else:
            splits = choose_splits(len(tiles) * head_groups, slots, most)
        split_tokens = -(-longest // splits)
        split_tokens = -(-split_tokens // kernel.tile) * kernel.tile
        return -(-longest // split_tokens), split_tokens

    kernel, splits, split_tokens = _fit_tile_to_splits(kernel, split_keys, tuning)
    return Plan(kernel, _upload(tiles, device), len(tiles), splits, split_tokens, head_groups,
                dependent_launch=tuning.dependent_launch and capability >= cuda_launch.MIN_COMPUTE_CAPABILITY)


def _prefill_kernel(kv: int, head_pad: int, chunk: int, capability: int, longest: int,
                    rotated: bool, tuning: Tuning) -> PrefillKernel:
    """The prefill build for a batch whose longest sequence holds `longest` keys, over a
    cache with a rotation or not: wgmma on sm_90 (tuning.prefill_wgmma), with the
    producer warpgroup from producer_min_keys keys; mma.sync otherwise. Without
    the producer, a build without the rotation's code for caches without one
    (fewer registers), and the short build (fewer warps, two blocks a
    multiprocessor) up to tuning.prefill_short_keys keys, whose blocks spend
    their time mostly on the query's loads and the output's stores."""
    wgmma = tuning.prefill_wgmma and capability == 90
    producer = longest >= producer_min_keys(kv, chunk, rotated, tuning)
    kernel = PrefillKernel.planned(kv, head_pad, chunk, wgmma, producer=producer)
    if not wgmma or kernel.producer:
        return kernel
    if not rotated:
        kernel = replace(kernel, rotated=False)
    if longest <= tuning.prefill_short_keys:
        short = replace(kernel, warps=tuning.prefill_short_warps, tile=tuning.prefill_short_tile,
                        min_blocks=tuning.prefill_short_blocks)
        if short.blocks_per_sm >= tuning.prefill_short_blocks:   # (16-bit rows at d = 128 do not fit twice)
            kernel = short
    return kernel


def producer_min_keys(kv: int, chunk: int, rotated: bool, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Keys (the longest sequence's) from which the prefill takes the producer build:
    fewer for quantized caches with a rotation and 16-byte copies, whose staging
    takes each stager's piece once."""
    if kv in (KV_INT4, KV_INT8, KV_FP8) and rotated and chunk >= 16:
        return min(tuning.prefill_producer_min_keys, tuning.prefill_producer_min_keys_rotated)
    return tuning.prefill_producer_min_keys


def _short_prompt_builds(kv: int, head_pad: int, chunk: int, tuning: Tuning = DEFAULT_TUNING) -> list:
    """The sm_90 builds without the producer that _prefill_kernel can take (rotated or
    not, up to tuning.prefill_short_keys keys and beyond), each once."""
    builds = []
    for rotated in (True, False):
        for longest in (tuning.prefill_short_keys, tuning.prefill_short_keys + 1):
            below_producer = producer_min_keys(kv, chunk, rotated, tuning) - 1
            kernel = _prefill_kernel(kv, head_pad, chunk, 90, min(longest, below_producer), rotated, tuning)
            if kernel not in builds:
                builds.append(kernel)
    return builds


def _fit_tile_to_splits(kernel, split_keys, tuning: Tuning) -> tuple:
    """The kernel with a tile its splits are long enough for, its splits and keys a
    split (split_keys(kernel)). A two-block build of 64-token tiles (_long_tile)
    takes one block of three stages where a split would hold fewer than
    tuning.two_block_min_split_tokens keys; 64-token tiles step down to 32 where a
    split would hold fewer than tuning.long_tile_min_split_tokens; each step
    splits again (shorter tiles allow more splits). Prefill kernels keep theirs."""
    splits, split_tokens = split_keys(kernel)
    while isinstance(kernel, Kernel):
        if (kernel.tile == DECODE_LONG_TILE and kernel.rows_before
                and split_tokens < tuning.two_block_min_split_tokens):
            kernel = replace(kernel, stages=STAGES)   # one block of three stages
        elif kernel.tile == DECODE_LONG_TILE and split_tokens < tuning.long_tile_min_split_tokens:
            kernel = replace(kernel, tile=DECODE_ROUND_TILE)
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
        cuda_launch.launch(plan.entry_handle(kernel), grid, (kernel.threads,), ATTENTION_SIGNATURE,
                           attention_args, stream=cupy.cuda.get_current_stream().ptr,
                           shared_bytes=kernel.shared_bytes, dependent=plan.dependent_launch)
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
        if plan.dependent_launch:
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
                        settled = [_settle_staging(_round_tile(Kernel(kv, head_pad, heads, quads, tile, 16, staging),
                                                               DEFAULT_TUNING),
                                                   quantized)
                                   for staging in stagings]
                        longer = [_long_tile(kernel, DEFAULT_TUNING) for kernel in settled]
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
        kernels = [int4_rows, _long_tile(int4_rows, DEFAULT_TUNING),
                   Kernel(KV_INT4, 96, 8, 4, 32, 4),
                   Kernel(KV_INT4, 64, 2, 2, 32, 1), Kernel(KV_INT8, 256, 8, 2, 16, 16),
                   Kernel(KV_FP8, 128, 4, 4, 16, 16, STAGE_ROWS), Kernel(KV_FP8, 128, 8, 1, 32, 16, STAGE_ROWS),
                   Kernel(KV_INT8, 96, 8, 1, 32, 16, STAGE_BULK, 2), Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS),
                   _long_tile(Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS), DEFAULT_TUNING),
                   replace(_long_tile(Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS), DEFAULT_TUNING), stages=STAGES),
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
