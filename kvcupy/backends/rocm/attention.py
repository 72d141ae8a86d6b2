"""Paged attention on ROCm: kernels_hip/attention.hip (MFMA, one 64-lane wave a
block) over the splits the plan cut, then merge.hip.

A call is three to five launches on the caller's stream, none of which waits for
the host: the rotate kernel turns the caller's query into float32 rows, rotated
and scaled (softmax scale, rotation norm); the attention grid writes each split's
partial softmax state; the merge combines the splits (and the sinks) and rotates
back (none or blockdiag) into `out`, or, for a kron rotation, into float32 rows
that the rotate kernel turns back. One build serves decode and prefill: a block
takes 16 query rows (tokens x the heads of a GQA group) of one sequence and KV
head, so a decode step of group g fills g of the rows and a prompt fills them all.

Kernels come from `write._function` (hipRTC), looked up at each call: the GPU
tests run these launchers on an NVIDIA GPU by replacing it with NVRTC builds of
the same sources through the wave64 and MFMA emulations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ... import formats
from ...rotation import query_divisor
from ..cuda.attention import _buffer, _sign_operands, _strides, merge_split_warps
from ..cuda.kernels import KV_BF16, KV_F16, KV_FP8, KV_INT4, KV_INT8, MAX_SPLITS, MERGE_WARPS
from ..cuda.params import ATTENTION_PARAMS
from ..cuda.planner import choose_splits, kv_code
from . import write

ENTRY, FUNCTION = "attention", "mfma_attention"
WAVE = 64                 # threads a block: one wave
ROWS_PER_TILE = 16        # query rows a block (attention.hip: kRows)
KEYS_PER_STEP = 16        # keys a step; splits hold whole steps
HEAD_STEP = 16            # head sizes are padded up to a multiple of this (a product's depth)
MIN_STEPS_PER_SPLIT = 8   # a split's keys pay for its merge traffic
WAVES_PER_CU = 6          # one-wave blocks a compute unit holds: 64 KB of LDS, about 10 KB a block


@dataclass(frozen=True)
class MfmaKernel:
    """One build of attention.hip: the KV kind (attention.cuh's KV_* codes) and the padded head size."""

    kv: int
    head_pad: int

    @property
    def defines(self) -> dict:
        return {"KVC_MFMA_KV": self.kv, "KVC_HEAD_PAD": self.head_pad}


def head_pad(head_size: int) -> int:
    return max(32, -(-head_size // HEAD_STEP) * HEAD_STEP)


@dataclass(frozen=True)
class Work:
    """What plan_work decides on the host: the build, the (sequence, row tile) work
    items, the splits and keys a split."""

    kernel: MfmaKernel
    tiles: np.ndarray   # int32 [num_tiles, 2]
    num_splits: int
    split_tokens: int


def plan_work(batch, cache, num_query_heads: int, num_query_tokens: int, compute_units: int) -> Work:
    """The build and the cut of a batch's work for a GPU of `compute_units`, from what
    the host knows: the query lengths where it holds them, else the batch's bound
    (BatchPlan.bounds), at which every sequence then counts."""
    group = num_query_heads // cache.num_kv_heads
    kernel = MfmaKernel(kv_code(cache), head_pad(cache.head_size))
    max_query_len, longest = batch.bounds(num_query_tokens)
    offsets = batch.host_query_offsets
    if offsets is not None:
        row_tiles = -(-np.diff(offsets).astype(np.int64) * group // ROWS_PER_TILE)
    else:
        row_tiles = np.full(batch.num_seqs, max(1, -(-max_query_len * group // ROWS_PER_TILE)), np.int64)
    seqs = np.repeat(np.arange(batch.num_seqs), row_tiles)
    within = np.arange(len(seqs)) - np.repeat(np.cumsum(row_tiles) - row_tiles, row_tiles)
    tiles = np.stack([seqs, within], axis=1).astype(np.int32).reshape(-1, 2)
    most = min(MAX_SPLITS, max(1, -(-longest // (MIN_STEPS_PER_SPLIT * KEYS_PER_STEP))))
    splits = choose_splits(max(1, len(tiles)) * cache.num_kv_heads, compute_units * WAVES_PER_CU, most)
    split_tokens = -(-(-(-longest // splits)) // KEYS_PER_STEP) * KEYS_PER_STEP
    return Work(kernel, tiles, -(-longest // split_tokens), split_tokens)


@dataclass(eq=False)
class Plan:
    """plan_work's choices with the work items on the device, and what a layer's call
    keeps from one call to the next: buffers, strides and compiled functions."""

    kernel: MfmaKernel
    tiles: object   # device int32 [num_tiles, 2]
    num_tiles: int
    num_splits: int
    split_tokens: int
    workspace: dict = field(default_factory=dict)
    strides: dict = field(default_factory=dict)
    rotations: dict = field(default_factory=dict)


def plan_attention(batch, cache, num_query_heads: int, num_query_tokens: int) -> Plan:
    """plan_work on this GPU, its work items uploaded."""
    import cupy
    device = cache.device
    with cupy.cuda.Device(device.index):
        compute_units = cupy.cuda.Device(device.index).attributes["MultiProcessorCount"]
        work = plan_work(batch, cache, num_query_heads, num_query_tokens, compute_units)
        tiles = cupy.asarray(work.tiles)
    return Plan(work.kernel, tiles, len(work.tiles), work.num_splits, work.split_tokens)


def _function(device_index: int, entry: str, function: str, defines: dict):
    return write._function(device_index, entry, function, tuple(sorted(defines.items())))


def paged_attention(query, cache, batch, plan: Plan, *, softmax_scale: float, sliding_window,
                    softcap: float, sinks, out) -> None:
    import cupy
    device, rotation = cache.device, cache.rotation
    shape = query.shape
    head_size = shape[2]
    rotated = rotation is not None and not rotation.is_identity
    in_merge = not rotated or rotation.kind == "blockdiag"   # the merge rotates back; else the rotate kernel
    arrays = batch.arrays(write.arrays, device)
    with cupy.cuda.Device(device.index):
        # The merge and the rotate kernel write whole rows back to back: a strided
        # `out` gets them through a contiguous copy.
        out_rows = out.data if out.data.flags.c_contiguous else cupy.empty(shape, out.data.dtype)
        # 1. The query in float32, rotated and scaled.
        query_rows = _buffer(plan, "query", shape, device)
        write.rotate_rows(cupy.ascontiguousarray(query.data).reshape(-1, head_size), query_rows.reshape(-1, head_size),
                          rotation, inverse=False, divisor=query_divisor(rotation, softmax_scale),
                          x_dtype=query.dtype, out_dtype=np.dtype(np.float32))
        # 2. The attention grid: each split's partial state.
        part_out = _buffer(plan, "part_out", (plan.num_splits,) + shape, device)
        part_stats = _buffer(plan, "part_stats", (plan.num_splits,) + shape[:2] + (2,), device)
        has_scales = cache.k_scale_cache is not None
        table = arrays["block_table"]
        arguments = ATTENTION_PARAMS.arguments(dict(
            query=query_rows, key_cache=cache.key_cache, value_cache=cache.value_cache,
            k_scales=cache.k_scale_cache if has_scales else cache.key_cache,
            v_scales=cache.v_scale_cache if has_scales else cache.value_cache,
            **_strides(plan, cache), block_table=table, seq_lens=arrays["seq_lens"],
            cu_seqlens_q=arrays["cu_seqlens_q"], tiles=plan.tiles, part_out=part_out, part_stats=part_stats,
            num_tokens=shape[0], num_heads=shape[1], group=shape[1] // cache.num_kv_heads,
            head_size=head_size, row_bytes=cache.key_cache.shape[3] * cache.key_cache.itemsize,
            block_size=cache.block_size, num_blocks=cache.num_blocks,
            table_width=table.shape[1], split_tokens=plan.split_tokens, window=sliding_window or 0,
            softcap=softcap))
        attention = _function(device.index, ENTRY, FUNCTION, plan.kernel.defines)
        attention((plan.num_tiles, plan.num_splits, cache.num_kv_heads), (WAVE,), arguments)
        # 3. The merge of the splits and the sinks, rotated back where it can; 4. kron's rotate launch.
        sink_logits = None if sinks is None else cupy.asarray(sinks.data, dtype=cupy.float32)
        signs = plan.rotations.get(("signs", rotation))
        if signs is None:
            signs = plan.rotations[("signs", rotation)] = _sign_operands(rotation, device)
        target = out_rows if in_merge else _buffer(plan, "out", shape, device)
        target_dtype = out.dtype if in_merge else np.dtype(np.float32)
        split_warps = merge_split_warps(plan.num_splits)
        merge = _function(device.index, "merge", "merge_splits", {"KVC_OUT_T": formats.CPP_TYPES[target_dtype]})
        merge((-(-shape[0] * shape[1] * split_warps // MERGE_WARPS),), (32 * MERGE_WARPS,),
              (part_out, part_stats, sink_logits if sink_logits is not None else np.uintp(0), target,
               np.int32(plan.num_splits), np.int32(shape[0]), np.int32(shape[1]), np.int32(head_size),
               np.int32(split_warps), *signs, np.float32(1.0 / (rotation.norm if rotated else 1))))
        if not in_merge:
            write.rotate_rows(target.reshape(-1, head_size), out_rows.reshape(-1, head_size), rotation,
                              inverse=True, divisor=float(rotation.norm), x_dtype=np.dtype(np.float32),
                              out_dtype=out.dtype)
        if out_rows is not out.data:
            out.data[...] = out_rows


def builds(head_sizes=range(32, 257, 2)) -> list[MfmaKernel]:
    """Every build of attention.hip the planner can take: each KV kind at each padded head size."""
    pads = sorted({head_pad(size) for size in head_sizes})
    return [MfmaKernel(kv, pad) for kv in (KV_INT4, KV_INT8, KV_FP8, KV_F16, KV_BF16) for pad in pads]


