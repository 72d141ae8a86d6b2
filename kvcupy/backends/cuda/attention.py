"""CUDA paged attention: launch kernels_cu/attention.cu for a batch the planner planned.

A decode call is two launches on the caller's stream, none of which waits
for the host: the attention kernel reads the caller's query, scales and
rotates it (blockdiag: butterflies in a warp) and writes each split's
partial softmax state; the merge kernel combines the splits (and the
sinks), rotates back and writes `out`. On sm_90 and newer both are launched
as programmatic dependents (launch.py): the attention grid of whatever
the stream ran before it, the merge of the attention grid; their blocks wait
in the kernel (griddepcontrol.wait, before they read anything) instead of
behind the launch, and each grid lets the next one in once its own wait is
over, so that at most one grid waits at a time. A kron plan's mix takes the
rotate kernel instead, before (the query, to float32) and after (the merged
rows): four launches. The prefill kernel reads the caller's query and rotates
it itself (mma products with the rotation's fragments,
`fragments.rotation_fragments`); with one split it also normalises, rotates
back and writes `out`, so that a prompt is one launch; with several, the
merge (and for kron the rotate kernel) follows as in decode.

Under CUDA graph capture (the call's stream capturing) a call launches only:
everything it would otherwise do on first use (upload the batch's metadata and
the rotation's operands, allocate the workspace, load the kernels) or on every
call (copy a strided query or out, convert sinks) is refused with a RuntimeError
before anything reaches the stream (planner.CAPTURE_ADVICE says what to do), so
the caller's graph is never broken by an upload or an allocation it cannot replay.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...rotation import query_divisor
from . import arrays as backend
from . import launch
from .device import _rotation_on
from .fragments import rotation_shift, rotation_stages
from .kernels import KV_FP8, MERGE_SIGNATURE, MERGE_WARPS, PrefillKernel, dtype_code
from .params import ATTENTION_PARAMS
from .planner import Plan, capturing, refuse_under_capture
from .write import rotate_rows

# A replay's pointers (launch.RecordedCall, kvcupy.replay): the caller's query and
# out, then the cache's key_cache, value_cache, k_scale_cache and v_scale_cache.
REPLAY_QUERY, REPLAY_OUT = 0, 1
MERGE_OFFSETS = launch.parameter_offsets(MERGE_SIGNATURE)


def _buffer(plan: Plan, name: str, shape: tuple, device, captured: bool = False):
    """A float32 buffer of one call's shape, made once per plan, name and shape
    (`captured`: the stream is being captured, where making one is refused)."""
    import cupy
    key = (name, shape, device.index)
    if key not in plan.workspace:
        if captured:
            refuse_under_capture(f"allocate its {name} workspace for {shape}")
        with cupy.cuda.Device(device.index):
            plan.workspace[key] = cupy.zeros(shape, cupy.float32)
    return plan.workspace[key]


def _strides(plan: Plan, cache) -> dict:
    """Byte strides (block, slot, head) of K, V and their scales: twelve Params fields,
    worked out once per cache (a layer's call then only passes them)."""
    key = id(cache.key_cache), id(cache.k_scale_cache)
    if key not in plan.strides:
        scales = (cache.k_scale_cache, cache.v_scale_cache) if cache.k_scale_cache is not None else (
            cache.key_cache, cache.value_cache)
        values = {f"{prefix}_{axis}_stride": int(stride)
                  for prefix, array in zip(("k", "v", "ks", "vs"), (cache.key_cache, cache.value_cache) + scales)
                  for axis, stride in zip(("block", "slot", "head"), array.strides[:3])}
        plan.strides[key] = (values, cache)   # the cache kept alive: its ids stay its own
    return plan.strides[key][0]


def _pair_aligned(array) -> bool:
    """Rows of `array` [T, H, d] start at a pair of elements (prefill.cuh reads and
    writes pairs), its last axis contiguous."""
    size = array.itemsize
    return (array.strides[2] == size and array.strides[0] % (2 * size) == 0
            and array.strides[1] % (2 * size) == 0 and array.data.ptr % (2 * size) == 0)


def _prefill_io(plan: Plan, query, cache, softmax_scale: float, sinks, out, captured: bool = False) -> dict:
    """The prefill kernel's own Params fields (params.cuh: query_in .. direct).

    The kernel reads the caller's query and rotates it itself. With one split
    it also normalises, rotates back and writes `out`, unless `out` is not
    pair-aligned or the rotation's blocks are narrower than an mma fragment
    (16 dims), where a product would carry a non-finite value across blocks:
    those go through the merge (which rotates back block by block)."""
    import cupy
    kernel, rotation = plan.kernel, cache.rotation
    aligned = _pair_aligned(query.data)
    if captured and not aligned:
        refuse_under_capture("copy a query whose rows do not start at a pair of elements")
    q = query.data if aligned else cupy.ascontiguousarray(query.data)
    if captured and (rotation, kernel.head_pad, kernel.kv) not in plan.rotations:
        refuse_under_capture("upload the rotation's operands")
    forward, inverse = plan.rotation_operands(rotation, kernel.head_pad, kernel.kv, cache.device)
    shift = rotation_shift(rotation)
    norm = 1 if shift < 0 else rotation.norm
    # Blocks narrower than a fragment: a product would carry a NaN or inf across them.
    narrow = rotation is not None and rotation.kind == "blockdiag" and rotation.block < 16
    direct = plan.num_splits == 1 and not narrow and _pair_aligned(out.data)
    fields = dict(query_in=q, q_token_stride=q.strides[0] // q.itemsize, q_head_stride=q.strides[1] // q.itemsize,
                  query_dtype=dtype_code(query.dtype), rotation_shift=shift,
                  rotation_stages=rotation_stages(rotation),
                  query_factor=1.0 / query_divisor(rotation, softmax_scale), out_factor=1.0 / norm,
                  out=out.data, out_token_stride=out.data.strides[0] // out.data.itemsize,
                  out_head_stride=out.data.strides[1] // out.data.itemsize, out_dtype=dtype_code(out.dtype),
                  direct=int(direct), sign_shift=-1)
    if forward is not None:
        fields.update(rotation_fwd=forward, rotation_inv=inverse)
    if sinks is not None:
        fields["sinks"] = sinks
    return fields


def merge_split_warps(num_splits: int) -> int:
    """Warps that share one row's merge (merge.cuh, merge_splits): the largest power
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
    if not _in_kernel_rotation(rotation) or sign_shift(rotation) < 0:
        return np.uintp(0), np.int32(-1)
    return _rotation_on(rotation, device.index), np.int32(sign_shift(rotation))


def _decode_io(query, rotation, softmax_scale: float, signs: tuple, captured: bool = False) -> dict:
    """The decode kernel's own Params fields: where it reads the caller's query
    itself (_in_kernel_rotation), that query, how to scale it and `signs`
    (_sign_operands) to rotate it; otherwise a rotated float32 query comes as
    `query` and these stay zero."""
    import cupy
    fields = dict(signs=signs[0], sign_shift=int(signs[1]), out_factor=1.0, query_factor=1.0)
    if _in_kernel_rotation(rotation):
        contiguous = query.data.strides[2] == query.data.itemsize
        if captured and not contiguous:
            refuse_under_capture("copy a query without a contiguous last axis")
        q = query.data if contiguous else cupy.ascontiguousarray(query.data)
        fields.update(query_in=q, q_token_stride=q.strides[0] // q.itemsize, q_head_stride=q.strides[1] // q.itemsize,
                      query_dtype=dtype_code(query.dtype),
                      query_factor=1.0 / query_divisor(rotation, softmax_scale))
    return fields


def _check_prepared(plan: Plan, kernel, sinks, device, rotation) -> None:
    """Under capture: the plan holds the attention build and the sign words this call
    launches with (an earlier call outside the capture made them), and sinks need no
    conversion; otherwise the RuntimeError of refuse_under_capture. The workspace,
    the merge and the query's operands are checked where they are taken."""
    if kernel not in plan.handles:
        refuse_under_capture("load its attention kernel")
    if ("signs", rotation) not in plan.rotations:
        refuse_under_capture("upload the rotation's sign words")
    if sinks is not None and (sinks.device != device or sinks.dtype != np.float32):
        refuse_under_capture(f"copy sinks ({sinks.dtype} on {sinks.device}) to float32 on {device} "
                             "(pass them so)")


def paged_attention(query, cache, batch, plan: Plan, *, softmax_scale: float, sliding_window,
                    softcap: float, sinks, out) -> launch.RecordedCall | None:
    """The attention of `plan`'s batch into `out` (interop.Arrays of CuPy data).
    Returns the call's launches as a RecordedCall where a later call that differs only
    in the query's and out's data pointers can replay them (kvcupy.replay): every
    step a packed launch, reading the caller's query and writing the caller's out
    directly (no copy of either, no conversion of sinks); None otherwise."""
    import cupy
    captured = capturing()
    if not out.data.flags.c_contiguous:
        # The merge (and the rotate kernel) write whole rows back to back: a strided
        # `out` gets them through a contiguous copy.
        if captured:
            refuse_under_capture("copy its result into a strided out (pass a contiguous one)")
        with cupy.cuda.Device(cache.device.index):
            rows = replace(out, data=cupy.empty(out.data.shape, out.data.dtype))
        paged_attention(query, cache, batch, plan, softmax_scale=softmax_scale, sliding_window=sliding_window,
                        softcap=softcap, sinks=sinks, out=rows)
        out.data[...] = rows.data
        return None
    device = cache.device
    num_tokens, num_heads, head_size = query.shape
    rows = (num_tokens, num_heads, head_size)
    rotation = cache.rotation
    rotated = rotation is not None and not rotation.is_identity
    if captured and not batch.uploaded(backend, device):
        refuse_under_capture("upload the batch's metadata")
    arrays = batch.arrays(backend, device)
    kernel = plan.kernel
    prefill = isinstance(kernel, PrefillKernel)
    if prefill:
        kernel = plan.for_query(query.dtype, rotation, out.dtype)
    in_kernel = _in_kernel_rotation(rotation)
    if captured:
        _check_prepared(plan, kernel, sinks, device, rotation)
    with cupy.cuda.Device(device.index):
        stream = cupy.cuda.get_current_stream().ptr
        sink_logits = None if sinks is None else cupy.asarray(sinks.data, dtype=cupy.float32)
        # The decode kernel's and the merge's butterflies (null, -1: none, or kron).
        signs = plan.rotations.get(("signs", rotation))
        if signs is None:
            signs = plan.rotations[("signs", rotation)] = _sign_operands(rotation, device)
        if prefill:
            io = _prefill_io(plan, query, cache, softmax_scale, sink_logits, out, captured)
        else:
            io = _decode_io(query, rotation, softmax_scale, signs, captured)
        direct = bool(io.get("direct"))
        # Every buffer first, so that a refusal under capture comes before any launch.
        query_rows = None if prefill or in_kernel else _buffer(plan, "query", rows, device, captured)
        # Partial softmax states of every split (prefill with one split: `out` itself).
        part_out = None if direct else _buffer(plan, "part_out", (plan.num_splits,) + rows, device, captured)
        part_stats = None if direct else _buffer(plan, "part_stats", (plan.num_splits, num_tokens, num_heads, 2),
                                                 device, captured)
        target = None if direct else out.data if in_kernel else _buffer(plan, "out", rows, device, captured)
        target_dtype = out.dtype if in_kernel else np.dtype(np.float32)   # out.data: raw storage of bf16
        if captured and not direct and ("merge_splits", target_dtype) not in plan.functions:
            refuse_under_capture("load its merge kernel")
        if captured and query_rows is not None and not query.data.flags.c_contiguous:
            refuse_under_capture("copy a strided query for the rotate kernel")
        if query_rows is not None:
            # 1. The query in float32, rotated (kron), scaled (softmax scale, rotation norm).
            rotate_rows(query.data.reshape(-1, head_size), query_rows.reshape(-1, head_size),
                         rotation, inverse=False, divisor=query_divisor(rotation, softmax_scale),
                         x_dtype=query.dtype, out_dtype=np.dtype(np.float32))
        # 2. The attention grid.
        has_scales = cache.k_scale_cache is not None
        code_unit = 256.0 if kernel.kv == KV_FP8 else 1.0
        table = arrays["block_table"]
        null = np.uintp(0)
        grid = (plan.num_splits, plan.num_tiles, plan.head_groups)
        fields = dict(
            query=query_rows if query_rows is not None else null, key_cache=cache.key_cache,
            value_cache=cache.value_cache, k_scales=cache.k_scale_cache if has_scales else cache.key_cache,
            v_scales=cache.v_scale_cache if has_scales else cache.value_cache,
            **_strides(plan, cache), block_table=table, seq_lens=arrays["seq_lens"],
            cu_seqlens_q=arrays["cu_seqlens_q"], tiles=plan.tiles,
            part_out=part_out if part_out is not None else null,
            part_stats=part_stats if part_stats is not None else null,
            num_tokens=num_tokens, num_heads=num_heads, group=num_heads // cache.num_kv_heads,
            head_size=head_size, row_bytes=cache.key_cache.shape[3] * cache.key_cache.itemsize,
            block_size=cache.block_size, block_shift=int(cache.block_size).bit_length() - 1,
            num_blocks=cache.num_blocks, table_width=table.shape[1], split_tokens=plan.split_tokens,
            window=sliding_window or 0, softcap=softcap, code_unit=code_unit, **io)
        # What a replay patches (in REPLAY_QUERY's order): the caller's query and out
        # where the kernels read or write them directly, and the cache's tensors.
        replayed = (query.data, out.data, cache.key_cache, cache.value_cache, cache.k_scale_cache,
                    cache.v_scale_cache)
        steps = [launch.PackedLaunch(plan.entry_handle(kernel), grid, (kernel.threads,), ATTENTION_PARAMS.pack(fields),
                                     shared_bytes=kernel.shared_bytes, dependent=plan.dependent_launch,
                                     patches=launch.pointer_patches(ATTENTION_PARAMS.offsets, fields, replayed))]
        steps[0](stream)
        if not direct:
            # 3. Merge the splits (and the sinks), rotating back into `out` (none or
            # blockdiag); on sm_90 its blocks start as the attention's leave.
            split_warps = merge_split_warps(plan.num_splits)
            merge_grid = (-(-num_tokens * num_heads * split_warps // MERGE_WARPS),)
            merge_args = (part_out, part_stats, sink_logits if sink_logits is not None else null,
                          target, np.int32(plan.num_splits), np.int32(num_tokens), np.int32(num_heads),
                          np.int32(head_size), np.int32(split_warps), *signs,
                          np.float32(1.0 / (rotation.norm if rotated else 1)))
            merge = launch.PackedLaunch(
                plan.merge_handle(target_dtype), merge_grid, (32 * MERGE_WARPS,),
                launch.pack_parameters(MERGE_SIGNATURE, merge_args), dependent=plan.dependent_launch,
                patches=launch.pointer_patches(MERGE_OFFSETS, merge_args, replayed))
            merge(stream)
            steps.append(merge)
        if not direct and not in_kernel:
            # 4. A kron plan's rotate launch.
            rotate_rows(target.reshape(-1, head_size), out.data.reshape(-1, head_size),
                         rotation, inverse=True, divisor=float(rotation.norm),
                         x_dtype=np.dtype(np.float32), out_dtype=out.dtype)
            return None
    patched = {role for step in steps for _, role in step.patches}
    # Sinks on the host, or not float32, reach the kernels as a copy made by this call.
    copied_sinks = sinks is not None and sink_logits.data.ptr != getattr(getattr(sinks.data, "data", None), "ptr", None)
    if query_rows is not None or not {REPLAY_QUERY, REPLAY_OUT} <= patched or copied_sinks:
        return None
    return launch.RecordedCall(steps)
