"""The decode planner's tile and stage choice: 1-byte codes
(planner._round_tile), int4's long tiles (_long_tile) and the shorter
tiles of short splits (_fit_tile_to_splits), on the host: no GPU, so it runs
in CI."""

from dataclasses import replace

import pytest

from kvcupy.backends.cuda import kernels, planner, specs
from kvcupy.backends.cuda.kernels import KV_BF16, KV_FP8, KV_INT4, KV_INT8, Kernel
from kvcupy.backends.cuda.tuning import DEFAULT_TUNING

ONE_BYTE = (KV_INT8, KV_FP8)
TUNING = DEFAULT_TUNING


def sixteen_token(kv: int, head_pad: int, heads: int = 8, quads: int = 1) -> Kernel:
    return Kernel(kv, head_pad, heads, quads, 16, 16, kernels.STAGE_ROWS)


@pytest.mark.parametrize("kv", ONE_BYTE)
def test_d128_takes_one_block_of_32_token_tiles(kv):
    """Three stages of 32 tokens x 8 heads fill a multiprocessor: one block of 8 warps,
    which beats two blocks of 16-token tiles."""
    chosen = planner._round_tile(sixteen_token(kv, 128), TUNING)
    assert (chosen.tile, chosen.stages, chosen.blocks_per_sm) == (32, 3, 1)


@pytest.mark.parametrize("kv", ONE_BYTE)
def test_d96_keeps_two_blocks_with_two_stages(kv):
    chosen = planner._round_tile(sixteen_token(kv, 96), TUNING)
    assert (chosen.tile, chosen.stages, chosen.blocks_per_sm) == (32, 2, 2)


@pytest.mark.parametrize("kv", ONE_BYTE)
@pytest.mark.parametrize("heads", (8, 4, 2, 1))
@pytest.mark.parametrize("head_pad", range(32, 257, 32))
def test_a_wider_tile_fits_and_keeps_enough_warps(kv, heads, head_pad):
    before = sixteen_token(kv, head_pad, heads)
    chosen = planner._round_tile(before, TUNING)
    if chosen == before:
        return
    assert chosen.tile == 32 and head_pad <= TUNING.round_max_head_pad
    assert chosen.shared_bytes <= kernels.SHARED_BYTES_PER_SM
    assert chosen.blocks_per_sm * chosen.heads >= TUNING.round_min_warps
    other = Kernel(kv, head_pad, heads, 1, 32, 16, kernels.STAGE_ROWS, 5 - chosen.stages)   # the stage count not taken
    assert other.blocks_per_sm * other.heads <= chosen.blocks_per_sm * chosen.heads


@pytest.mark.parametrize("kernel", [
    sixteen_token(KV_INT8, 128, quads=2),       # GQA 8 / speculative decoding: two quads a warp
    sixteen_token(KV_FP8, 160),                 # above tuning.round_max_head_pad
    sixteen_token(KV_BF16, 128),                # auto caches
    Kernel(KV_INT4, 128, 8, 1, 32, 16, kernels.STAGE_ROWS),   # int4 has 32-token tiles already
], ids=("two-quads", "d160", "auto", "int4"))
def test_others_keep_their_kernel(kernel):
    assert planner._round_tile(kernel, TUNING) == kernel


@pytest.mark.parametrize("kv", ONE_BYTE)
def test_row_copies_need_three_stages(kv):
    """Row staging issues its copies a tile late (attention.cuh asserts three
    stages for it): a two-stage kernel takes bulk copies instead."""
    chosen = planner._settle_staging(planner._round_tile(sixteen_token(kv, 96), TUNING))
    assert (chosen.stages, chosen.staging) == (2, kernels.STAGE_BULK)
    chosen = planner._settle_staging(planner._round_tile(sixteen_token(kv, 128), TUNING))
    assert (chosen.stages, chosen.staging) == (3, kernels.STAGE_ROWS)
    int4 = Kernel(KV_INT4, 128, 8, 1, 32, 16, kernels.STAGE_ROWS)
    assert planner._settle_staging(int4) == int4


class FakeArray:
    """What the planner reads of a cache tensor: byte strides and an address."""

    def __init__(self, shape, itemsize, address=1 << 20, head_stride=None):
        strides = [itemsize]
        for size in reversed(shape[1:]):
            strides.insert(0, strides[0] * size)
        if head_stride is not None:
            strides[2] = head_stride
        self.strides, self.data = tuple(strides), type("Pointer", (), {"ptr": address})()


def auto_cache(head_size, num_kv_heads=8, block_size=16, head_stride=None):
    shape = (64, block_size, num_kv_heads, head_size)
    arrays = [FakeArray(shape, 2, head_stride=head_stride) for _ in range(2)]
    return type("Cache", (), dict(head_size=head_size, num_kv_heads=num_kv_heads, block_size=block_size,
                                  key_cache=arrays[0], value_cache=arrays[1]))()


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_auto_caches_take_row_copies_on_sm90(head_size):
    """16-bit caches take row copies (zero-filled past a sequence: no stale rows)
    where a block serves 4k heads of unpadded rows; bulk copies never."""
    chosen = planner._choose_kernel(auto_cache(head_size), KV_BF16, 1, 90, TUNING)
    assert chosen.staging == (kernels.STAGE_ROWS if chosen.heads % 4 == 0 else kernels.STAGE_THREADS)
    assert chosen.stages >= kernels.ROW_STAGING_MIN_STAGES or chosen.staging != kernels.STAGE_ROWS
    if head_size <= 128:
        assert chosen.staging == kernels.STAGE_ROWS


@pytest.mark.parametrize("case", ["sm80", "padded", "two heads", "strided heads", "rows off"])
def test_auto_caches_keep_thread_copies_otherwise(case):
    cache = {"padded": auto_cache(80), "two heads": auto_cache(128, num_kv_heads=2),
             "strided heads": auto_cache(128, head_stride=512)}.get(case, auto_cache(128))
    tuning = replace(TUNING, row_staging=case != "rows off")
    chosen = planner._choose_kernel(cache, KV_BF16, 1, 80 if case == "sm80" else 90, tuning)
    assert chosen.staging == kernels.STAGE_THREADS


@pytest.mark.parametrize("head_pad,stages,blocks", [(128, 3, 1), (96, 2, 2)])
def test_int4_takes_64_token_tiles(head_pad, stages, blocks):
    """int4, one quad, row copies: 64-token tiles (faster where splits are
    long: planner.py), at d = 128 one block of 8 warps a multiprocessor, at
    d = 96 two of two stages, their row copies issued before a tile."""
    chosen = planner._long_tile(Kernel(KV_INT4, head_pad, 8, 1, 32, 16, kernels.STAGE_ROWS), TUNING)
    assert (chosen.tile, chosen.stages, chosen.blocks_per_sm) == (kernels.DECODE_LONG_TILE, stages, blocks)
    assert chosen.shared_bytes <= kernels.SHARED_BYTES_PER_SM // blocks
    assert chosen.blocks_per_sm * chosen.heads >= TUNING.round_min_warps
    assert chosen.rows_before == (stages < kernels.ROW_STAGING_MIN_STAGES)
    assert chosen.defines.get("KVC_ROWS_BEFORE", 0) == int(chosen.rows_before)


@pytest.mark.parametrize("kernel", [
    Kernel(KV_INT4, 96, 4, 1, 32, 16, kernels.STAGE_ROWS),    # two blocks of 4 warps: not tuned for
    Kernel(KV_INT4, 64, 8, 1, 32, 16, kernels.STAGE_ROWS),    # not tuned for
    Kernel(KV_INT4, 128, 8, 2, 32, 16, kernels.STAGE_ROWS),   # two quads a warp
    Kernel(KV_INT4, 128, 8, 1, 32, 16, kernels.STAGE_BULK),   # bulk copies: not tuned for
    Kernel(KV_INT4, 128, 4, 1, 32, 16, kernels.STAGE_ROWS),   # one block of 4 warps would be left
    Kernel(KV_INT8, 128, 8, 1, 32, 16, kernels.STAGE_ROWS),   # 1-byte codes: a 64-token block does not fit
], ids=("d96-four-heads", "d64", "two-quads", "bulk", "four-heads", "int8"))
def test_others_keep_32_token_tiles(kernel):
    assert planner._long_tile(kernel, TUNING) == kernel


def test_check_compiles_the_long_tile():
    """`kvcupy check`'s sample and --all both build the kernels the planner takes."""
    one_block = Kernel(KV_INT4, 96, 8, 1, kernels.DECODE_LONG_TILE, 16, kernels.STAGE_ROWS)
    for kernel in (replace(one_block, head_pad=128), one_block, replace(one_block, stages=2)):
        for every in (False, True):
            assert any(spec.defines == kernel.defines for spec in specs.attention_specialisations(every)), kernel


def test_check_all_adds_only_the_long_tiles_other_builds():
    """--all keeps the 32-token builds that short splits step down to, and gives no
    two-stage build a three-stage twin that the planner never takes (only the
    two-block long tile has one: its short splits' one-block build)."""
    every = [spec.defines for spec in specs.attention_specialisations(True) if "KVC_STAGES" in spec.defines]
    for head_pad in (128, 96):
        assert Kernel(KV_INT4, head_pad, 8, 1, kernels.DECODE_ROUND_TILE, 16, kernels.STAGE_ROWS).defines in every
    for kv in (KV_INT8, KV_FP8):   # _round_tile's two stages at d = 96
        two_stages = Kernel(kv, 96, 8, 1, kernels.DECODE_ROUND_TILE, 16, kernels.STAGE_BULK, stages=2)
        assert two_stages.defines in every and replace(two_stages, stages=kernels.STAGES).defines not in every


def splitting(longest: int, slots: int = 132):
    """A stand-in for plan_attention's split_keys: the splits a sequence of `longest`
    keys gets on `slots` blocks, in whole tiles (4 tiles a split at least)."""
    def split_keys(kernel):
        splits = max(1, min(slots, longest // (TUNING.min_tiles_per_split * kernel.tile)))
        tokens = -(-longest // splits)
        tokens = -(-tokens // kernel.tile) * kernel.tile
        return -(-longest // tokens), tokens
    return split_keys


LONG = Kernel(KV_INT4, 128, 8, 1, kernels.DECODE_LONG_TILE, 16, kernels.STAGE_ROWS)


def test_long_tiles_stay_where_the_splits_are_long():
    kernel, splits, tokens = planner._fit_tile_to_splits(LONG, splitting(32768, slots=4), TUNING)
    assert (kernel, splits, tokens) == (LONG, 4, 8192)


def test_short_splits_take_32_token_tiles_and_split_again():
    """Splits of fewer than Tuning.long_tile_min_split_tokens keys: the 32-token
    kernel, with the splits worked out again for it."""
    kernel, splits, tokens = planner._fit_tile_to_splits(LONG, splitting(4096), TUNING)
    assert kernel == replace(LONG, tile=kernels.DECODE_ROUND_TILE)
    assert (splits, tokens) == splitting(4096)(kernel)
    assert tokens < TUNING.long_tile_min_split_tokens


TWO_BLOCKS = Kernel(KV_INT4, 96, 8, 1, kernels.DECODE_LONG_TILE, 16, kernels.STAGE_ROWS, stages=2)


def test_two_blocks_stay_where_the_splits_are_long():
    kernel, splits, tokens = planner._fit_tile_to_splits(TWO_BLOCKS, splitting(32768, slots=8), TUNING)
    assert (kernel, splits, tokens) == (TWO_BLOCKS, 8, 4096)


@pytest.mark.parametrize("longest,tile", [(8192, kernels.DECODE_LONG_TILE), (2048, kernels.DECODE_ROUND_TILE)])
def test_short_splits_take_one_block_of_three_stages(longest, tile):
    """Splits of fewer than Tuning.two_block_min_split_tokens keys: the one-block
    build of three stages, split again, and on to 32-token tiles where those
    splits are short too."""
    kernel, splits, tokens = planner._fit_tile_to_splits(TWO_BLOCKS, splitting(longest, slots=8), TUNING)
    assert kernel == replace(TWO_BLOCKS, stages=kernels.STAGES, tile=tile)
    assert not kernel.rows_before and (splits, tokens) == splitting(longest, slots=8)(kernel)


def test_prefill_kernels_keep_their_tile():
    prefill = kernels.PrefillKernel.planned(KV_INT4, 128, 16, True)
    assert planner._fit_tile_to_splits(prefill, splitting(256), TUNING)[0] == prefill
