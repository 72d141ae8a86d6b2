"""The prefill planner's split choice (planner.choose_prefill_splits) and
build choice (_prefill_kernel), on the host: no GPU, so it runs in CI."""

from dataclasses import replace

import numpy as np
import pytest

from kvcupy import formats
from kvcupy.backends.cuda import kernels, planner
from kvcupy.backends.cuda.tuning import DEFAULT_TUNING

SLOTS, TILE = 132, 64   # an H200's multiprocessors, one prefill block each


def causal_tiles(sequences: int, context: int, new: int, group: int = 4, rows: int = 192) -> np.ndarray:
    """Keys each row tile of `rows` (query token, head) rows sees, as plan_attention counts them."""
    per_sequence = -(-new * group // rows)
    within = np.arange(per_sequence)
    seen = context - new + np.minimum((within + 1) * rows, new * group) // group
    return np.sort(np.tile(seen, sequences))[::-1]


def test_many_blocks_take_no_split():
    """Prompts and chunks that fill the GPU several times over: merges would only cost."""
    for sequences, context, new in ((4, 8192, 8192), (1, 2048, 2048), (4, 32768, 2048), (64, 128, 128)):
        tiles = causal_tiles(sequences, context, new)
        assert planner.choose_prefill_splits(tiles, 8, SLOTS, context, TILE, most=context // 256) == 1


def test_a_few_long_blocks_are_split():
    """Two row tiles of one KV head over 32768 cached keys: two busy multiprocessors
    of 132 unless the keys are split, and the split count stays within `most`."""
    tiles = causal_tiles(1, 32768, 96)
    assert len(tiles) == 2
    splits = planner.choose_prefill_splits(tiles, 1, SLOTS, 32768, TILE, most=32)
    assert 16 <= splits <= 32


# --- which prefill build (planner._prefill_kernel) ----------------------------

QUANTIZED = (kernels.KV_INT4, kernels.KV_INT8, kernels.KV_FP8)
TUNING = DEFAULT_TUNING


def prefill_kernel(kv, head_pad, chunk, capability, longest, rotated, tuning=TUNING):
    return planner._prefill_kernel(kv, head_pad, chunk, capability, longest, rotated, tuning)


@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("head_pad", (32, 96, 128))
@pytest.mark.parametrize("rotated", (True, False))
def test_long_prompts_take_the_producer_warpgroup(kv, head_pad, rotated):
    """From Tuning.prefill_producer_min_keys keys: 12 warps, of which the last
    warpgroup stages and decodes, so a block holds 128 query rows (8 consumer warps of 16)."""
    kernel = prefill_kernel(kv, head_pad, 16, 90, TUNING.prefill_producer_min_keys, rotated)
    assert (kernel.wgmma, kernel.producer, kernel.warps, kernel.rows_per_tile) == (True, True, 12, 128)
    assert kernel.defines["KVC_PRODUCER"] == 1
    assert kernel.rotated and "KVC_ROTATED" not in kernel.defines   # one producer build for either cache
    assert kernel.shared_bytes <= kernels.SHARED_BYTES_PER_SM


@pytest.mark.parametrize("kv", QUANTIZED)
def test_shorter_prompts_keep_three_warpgroups_of_rows(kv):
    kernel = prefill_kernel(kv, 128, 16, 90, planner.producer_min_keys(kv, 16, True, TUNING) - 1, True)
    assert (kernel.wgmma, kernel.producer, kernel.rows_per_tile, kernel.rotated) == (True, False, 192, True)
    assert "KVC_PRODUCER" not in kernel.defines and "KVC_ROTATED" not in kernel.defines


@pytest.mark.parametrize("kv", QUANTIZED + (kernels.KV_F16, kernels.KV_BF16))
@pytest.mark.parametrize("chunk", (16, 8))
@pytest.mark.parametrize("rotated", (True, False))
def test_rotated_quantized_caches_take_the_producer_from_fewer_keys(kv, chunk, rotated):
    """Quantized caches with a rotation and 16-byte copies: the producer build from
    prefill_producer_min_keys_rotated keys; the others from prefill_producer_min_keys."""
    fewer = kv in QUANTIZED and rotated and chunk == 16
    least = TUNING.prefill_producer_min_keys_rotated if fewer else TUNING.prefill_producer_min_keys
    assert planner.producer_min_keys(kv, chunk, rotated, TUNING) == least
    assert TUNING.prefill_short_keys < TUNING.prefill_producer_min_keys_rotated < TUNING.prefill_producer_min_keys
    assert prefill_kernel(kv, 128, chunk, 90, least, rotated).producer
    assert not prefill_kernel(kv, 128, chunk, 90, least - 1, rotated).producer


F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), formats.MODEL_DTYPES["bfloat16"]


@pytest.mark.parametrize("kv", QUANTIZED + (kernels.KV_F16, kernels.KV_BF16))
@pytest.mark.parametrize("keys", (TUNING.prefill_short_keys, TUNING.prefill_producer_min_keys))
@pytest.mark.parametrize("query_dtype,out_dtype", [(F16, F16), (BF16, BF16), (F16, BF16), (F32, BF16),
                                                   (BF16, F32), (F32, F32)])
def test_16_bit_rows_take_a_rotated_build_without_the_float32_rows_code(kv, keys, query_dtype, out_dtype):
    """A rotated build serves a call whose query and output are both 16-bit without
    the float32 rows' two-term rotations (wide_rows False, KVC_WIDE_ROWS 0); a
    float32 query or output takes the build with them, and builds without the
    rotation's code have no such code to leave out."""
    narrow = query_dtype != F32 and out_dtype != F32
    for rotated in (True, False):
        planned = prefill_kernel(kv, 128, 16, 90, keys, rotated)
        kernel = planned.for_query(query_dtype, None, out_dtype)
        # (the producer build keeps the rotation's code for either cache)
        assert kernel.wide_rows == (not (narrow and planned.rotated))
        assert ("KVC_WIDE_ROWS" in kernel.defines) == (narrow and planned.rotated)
        # and in all else the build a float32 output would take
        assert replace(kernel, wide_rows=True) == planned.for_query(query_dtype, None, F32)


@pytest.mark.parametrize("kv", QUANTIZED + (kernels.KV_F16, kernels.KV_BF16))
@pytest.mark.parametrize("head_pad", (32, 64, 96, 128))
def test_caches_without_a_rotation_take_a_build_without_its_code(kv, head_pad):
    kernel = prefill_kernel(kv, head_pad, 16, 90, TUNING.prefill_producer_min_keys - 1, False)
    assert (kernel.producer, kernel.rotated, kernel.defines["KVC_ROTATED"]) == (False, False, 0)


@pytest.mark.parametrize("kv", QUANTIZED + (kernels.KV_F16, kernels.KV_BF16))
@pytest.mark.parametrize("head_pad", (32, 64, 96, 128))
@pytest.mark.parametrize("rotated", (True, False))
def test_short_prompts_take_the_short_build_where_two_blocks_fit(kv, head_pad, rotated):
    """Up to prefill_short_keys keys: prefill_short_warps warps and
    prefill_short_tile-token tiles, prefill_short_blocks blocks a multiprocessor,
    declared in its launch bounds; where they do not fit (16-bit rows at d = 128),
    the 12-warp build."""
    short = prefill_kernel(kv, head_pad, 16, 90, TUNING.prefill_short_keys, rotated)
    longer = prefill_kernel(kv, head_pad, 16, 90, TUNING.prefill_short_keys + 1, rotated)
    assert (longer.warps, longer.tile, longer.blocks_per_sm) == (kernels.PREFILL_WGMMA_WARPS, kernels.PREFILL_TILE, 1)
    assert short.rotated == longer.rotated == rotated
    candidate = replace(short, warps=TUNING.prefill_short_warps, tile=TUNING.prefill_short_tile)
    fits = 2 * candidate.shared_bytes <= kernels.SHARED_BYTES_PER_SM
    if fits:
        assert (short.warps, short.tile, short.blocks_per_sm) == (TUNING.prefill_short_warps,
                                                                  TUNING.prefill_short_tile, 2)
        assert short.defines["KVC_MIN_BLOCKS"] == 2
    else:
        assert short == longer
    assert fits == (kv not in (kernels.KV_F16, kernels.KV_BF16) or head_pad < 128)


@pytest.mark.parametrize("kv", QUANTIZED + (kernels.KV_F16, kernels.KV_BF16))
@pytest.mark.parametrize("capability", (80, 89, 90))
def test_the_producer_only_serves_the_wgmma_build(kv, capability):
    """GPUs without wgmma take the mma.sync build at any length; on sm_90 every
    KV dtype takes the wgmma build, auto caches too."""
    kernel = prefill_kernel(kv, 128, 16, capability, 1 << 20, True)
    wgmma = capability == 90
    assert (kernel.wgmma, kernel.producer) == (wgmma, wgmma)
    if not wgmma:
        assert kernel.rows_per_tile == 16 * kernel.warps


@pytest.mark.parametrize("kv", QUANTIZED + (kernels.KV_F16, kernels.KV_BF16))
def test_a_tuning_without_wgmma_takes_the_mma_sync_build_on_sm_90(kv):
    kernel = prefill_kernel(kv, 128, 16, 90, 1 << 20, True, replace(TUNING, prefill_wgmma=False))
    assert (kernel.wgmma, kernel.producer, kernel.rows_per_tile) == (False, False, 16 * kernel.warps)


@pytest.mark.parametrize("longest", (TUNING.prefill_short_keys + 1, 1 << 20))
def test_a_tuning_whose_producer_needs_more_keys_keeps_three_warpgroups(longest):
    never = replace(TUNING, prefill_producer_min_keys=1 << 30, prefill_producer_min_keys_rotated=1 << 30)
    kernel = prefill_kernel(kernels.KV_INT4, 128, 16, 90, longest, True, never)
    assert (kernel.wgmma, kernel.producer, kernel.rows_per_tile) == (True, False, 192)
