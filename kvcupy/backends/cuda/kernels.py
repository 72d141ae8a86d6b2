"""The attention kernels' specialisations as data: attention.cuh's codes and
structural constants, and the frozen descriptors of a decode build (Kernel,
attention.cuh) and a prefill build (PrefillKernel, prefill.cuh), each giving
its -D defines, threads and shared memory. No CuPy: listing builds needs no GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ... import formats

# attention.cuh's KV_* codes (tests/jit/test_kernel_constants.py holds the two sides equal).
# The quantized codes and fp16 rows are the formats table's kernel ids (the
# write kernels' KVC_KV_DTYPE); bf16 rows, which the write path takes as auto, follow.
KV_INT4, KV_INT8, KV_FP8, KV_F16 = (formats.KV_DTYPES[name].kernel_id for name in
                                    ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto"))
KV_BF16 = KV_F16 + 1
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
MAX_SPLITS = 256         # merge.cuh: kMergeMaxSplits
MERGE_WARPS = 8          # merge.cuh: kMergeWarps (split_warps of them a row)
MERGE_SIGNATURE = "PPPPiiiiiPif"   # attention.cu's merge_splits parameters (launch.py's codes)
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
