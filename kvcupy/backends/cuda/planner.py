"""The CUDA attention planner: which build of attention.cu serves a batch, and
how its work is cut. The plan is made once per BatchPlan and reused by every layer.

Decode and short query runs take attention.cuh's kernel: warps per block (one
per KV head, up to 8, so that a block reads whole cache rows), query rows per
warp, tokens per pipeline stage. Prefill (a sequence bringing at least
tuning.prefill_min_rows query rows per KV head, head sizes up to
PREFILL_MAX_HEAD_PAD) takes prefill.cuh's: 128 query rows of one KV head a
block, each tile decoded once into shared memory (on sm_90 it takes its wgmma
build, compiled for sm_90a, with 192 rows a block). Either way the plan splits
each sequence's keys across blocks (split-KV) from the batch's shape and the
GPU's multiprocessor count (prefill: choose_prefill_splits), and holds the
device copies of the work list and the workspace, so a layer's call allocates
nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ... import formats, jit
from . import launch
from .device import _cache_model_dtype
from .fragments import rotation_fragments
from .kernels import (DECODE_LONG_TILE, DECODE_ROUND_TILE, HEAD_CLASS, KV_BF16, KV_F16, KV_FP8, KV_INT4, KV_INT8,
                      MAX_HEAD_PAD_FOUR_QUADS, MAX_SPLITS, PREFILL_MAX_HEAD_PAD, ROW_STAGING_MIN_STAGES,
                      SHARED_BYTES_PER_SM, STAGE_BULK, STAGE_ROWS, STAGE_THREADS, STAGES, Kernel, PrefillKernel)
from .tuning import DEFAULT_TUNING, Tuning


def kv_code(cache) -> int:
    if cache.kv_dtype == "int4_per_token_head":
        return KV_INT4
    if cache.kv_dtype == "int8_per_token_head":
        return KV_INT8
    if cache.kv_dtype == "fp8_per_token_head":
        return KV_FP8
    storage = _cache_model_dtype(cache)   # CuPy holds bfloat16 as uint16 bits, as the write path reads them
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
    bulk copies of whole pages. Whole rows beat per-thread copies, most at
    d = 96 (tools/decode_variants.py compares the two)."""
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
    (rows issued before a tile would gain for int8 but lose as much for fp8),
    per-thread copies otherwise."""
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
    handles: dict = field(default_factory=dict)  # CUfunctions for launch.py: builds, merges by output dtype
    # sm_90 and newer (unless the tuning says otherwise): the attention grid and the
    # merge launched as programmatic dependents (launch.py).
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
        """entry_function's CUfunction, for launch.py's packed launch."""
        handle = self.handles.get(kernel)
        if handle is None:
            handle = self.handles[kernel] = launch.function_handle(self.entry_function(kernel))
        return handle

    def merge_handle(self, out_dtype) -> int:
        """merge_function's CUfunction, for launch.py's packed launch."""
        handle = self.handles.get(out_dtype)
        if handle is None:
            handle = self.handles[out_dtype] = launch.function_handle(self.merge_function(out_dtype))
        return handle

    def for_query(self, query_dtype, rotation, out_dtype):
        """The plan's kernel's for_query build for this query dtype, rotation and output dtype."""
        key = (query_dtype, rotation, out_dtype)
        kernel = self.builds.get(key)
        if kernel is None:
            kernel = self.builds[key] = self.kernel.for_query(query_dtype, rotation, out_dtype)
        return kernel


CAPTURE_ADVICE = ("build the plan with kvcupy.plan_batch(...) and make one call with batch= before the capture "
                  "(it uploads the plan and allocates its workspace), then pass the same batch= to the captured calls")


_CAPTURE_IMPLICIT = 906   # cudaErrorStreamCaptureImplicit


def capturing() -> bool:
    """Whether CuPy's current stream (a call's own, inside interop.running_on) is being
    captured into a CUDA graph. CUDA answers cudaErrorStreamCaptureImplicit for the
    legacy stream while another stream captures in a mode that work on it would
    break: that counts as capturing too. (A capture an error has invalidated
    already raises CuPy's own RuntimeError, which says so.)"""
    import cupy
    runtime = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    try:
        return bool(runtime.streamIsCapturing(stream))
    except runtime.CUDARuntimeError as error:
        if error.status == _CAPTURE_IMPLICIT:
            return True
        raise


def refuse_under_capture(what: str) -> None:
    """RuntimeError, before anything reaches the stream, where a call would `what`
    (an upload, an allocation, a compile) while its stream is being captured: a
    host-to-device copy there invalidates the caller's graph."""
    if capturing():
        raise RuntimeError(f"paged_attention would {what} while the stream is being captured: {CAPTURE_ADVICE}")


@dataclass(frozen=True)
class Work:
    """What plan_attention decides, on the host: the build, the (sequence, row tile)
    work items in launch order, the splits and keys a split, the KV head groups."""

    kernel: Kernel | PrefillKernel
    tiles: np.ndarray        # int32 [num_tiles, 2]
    num_splits: int
    split_tokens: int
    head_groups: int


def plan_work(batch, cache, num_query_heads: int, num_query_tokens: int, capability: int, sms: int,
              tuning: Tuning = DEFAULT_TUNING) -> Work:
    """plan_attention's choices for a GPU of compute capability `capability` with `sms`
    multiprocessors, from what the host knows of the batch: the query lengths and
    sequence lengths where it holds them, else the batch's bounds (BatchPlan.bounds:
    the caller's max_query_len / max_seq_len, else the whole query and block table).
    Each sequence counts at the bound where its own length is unknown, so a batch of
    equal sequences is planned alike from host metadata and from device metadata
    with exact hints."""
    if cache.block_size & (cache.block_size - 1):
        # attention.cuh finds a token's page and slot by shift and mask.
        raise ValueError(f"block_size={cache.block_size}: the CUDA attention kernels need a power of two "
                         "(the CPU backend takes any block size)")
    group = num_query_heads // cache.num_kv_heads
    kv = kv_code(cache)
    max_query_len, longest = batch.bounds(num_query_tokens)
    seq_lens = batch.host_seq_lens
    offsets = batch.host_query_offsets
    query_lens = None if offsets is None else np.diff(offsets)
    max_rows = group * max_query_len
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
        per_seq = max(1, -(-max_query_len * group // rows_per_tile))
        seqs = np.repeat(np.arange(batch.num_seqs), per_seq)
        within = np.tile(np.arange(per_seq), batch.num_seqs)
    keys_seen = None
    if isinstance(kernel, PrefillKernel):
        # The blocks that see the most keys first, so that the last wave is short ones.
        lens = longest if seq_lens is None else seq_lens[seqs]
        runs = max_query_len if query_lens is None else query_lens[seqs]
        keys_seen = lens - runs + np.minimum((within + 1) * rows_per_tile, runs * group) // group
        order = np.argsort(-keys_seen, kind="stable")
        seqs, within, keys_seen = seqs[order], within[order], keys_seen[order]
    tiles = np.stack([seqs, within], axis=1).astype(np.int32).reshape(-1, 2)
    head_groups = cache.num_kv_heads // kernel.kv_heads_per_block

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
    return Work(kernel, tiles, splits, split_tokens, head_groups)


def plan_attention(batch, cache, num_query_heads: int, num_query_tokens: int) -> Plan:
    """plan_work on this GPU, its work items uploaded. Refused while the call's stream
    is being captured (the upload would break the graph): a plan is built once,
    before any capture (CAPTURE_ADVICE)."""
    tuning = DEFAULT_TUNING if batch.tuning is None else batch.tuning
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning={tuning!r}: the CUDA backend takes a kvcupy.backends.cuda.tuning.Tuning")
    refuse_under_capture("build and upload its plan")
    import cupy
    device = cache.device
    capability = _compute_capability(device)
    with cupy.cuda.Device(device.index):
        sms = cupy.cuda.Device(device.index).attributes["MultiProcessorCount"]
    work = plan_work(batch, cache, num_query_heads, num_query_tokens, capability, sms, tuning)
    return Plan(work.kernel, _upload(work.tiles, device), len(work.tiles), work.num_splits, work.split_tokens,
                work.head_groups,
                dependent_launch=tuning.dependent_launch and capability >= launch.MIN_COMPUTE_CAPABILITY)


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
