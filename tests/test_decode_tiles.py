"""The decode planner's tile and stage choice for 1-byte codes
(cuda_attention._round_tile), on the host: no GPU, so it runs in CI."""

import pytest

from kvcupy.backends import cuda_attention as ca
from kvcupy.backends.cuda_attention import KV_BF16, KV_FP8, KV_INT4, KV_INT8, Kernel

ONE_BYTE = (KV_INT8, KV_FP8)


def sixteen_token(kv: int, head_pad: int, heads: int = 8, quads: int = 1) -> Kernel:
    return Kernel(kv, head_pad, heads, quads, 16, 16, ca.STAGE_ROWS)


@pytest.mark.parametrize("kv", ONE_BYTE)
def test_d128_takes_one_block_of_32_token_tiles(kv):
    """Three stages of 32 tokens x 8 heads fill a multiprocessor: one block of 8 warps
    (measured faster than two blocks of 16-token tiles)."""
    chosen = ca._round_tile(sixteen_token(kv, 128))
    assert (chosen.tile, chosen.stages, chosen.blocks_per_sm) == (32, 3, 1)


@pytest.mark.parametrize("kv", ONE_BYTE)
def test_d96_keeps_two_blocks_with_two_stages(kv):
    chosen = ca._round_tile(sixteen_token(kv, 96))
    assert (chosen.tile, chosen.stages, chosen.blocks_per_sm) == (32, 2, 2)


@pytest.mark.parametrize("kv", ONE_BYTE)
@pytest.mark.parametrize("heads", (8, 4, 2, 1))
@pytest.mark.parametrize("head_pad", range(32, 257, 32))
def test_a_wider_tile_fits_and_keeps_enough_warps(kv, heads, head_pad):
    before = sixteen_token(kv, head_pad, heads)
    chosen = ca._round_tile(before)
    if chosen == before:
        return
    assert chosen.tile == 32 and head_pad <= ca.DECODE_ROUND_MAX_HEAD_PAD
    assert chosen.shared_bytes <= ca.SHARED_BYTES_PER_SM
    assert chosen.blocks_per_sm * chosen.heads >= ca.DECODE_ROUND_MIN_WARPS
    other = Kernel(kv, head_pad, heads, 1, 32, 16, ca.STAGE_ROWS, 5 - chosen.stages)   # the stage count not taken
    assert other.blocks_per_sm * other.heads <= chosen.blocks_per_sm * chosen.heads


@pytest.mark.parametrize("kernel", [
    sixteen_token(KV_INT8, 128, quads=2),       # GQA 8 / speculative decoding: two quads a warp
    sixteen_token(KV_FP8, 160),                 # above the measured head sizes
    sixteen_token(KV_BF16, 128),                # auto caches
    Kernel(KV_INT4, 128, 8, 1, 32, 16, ca.STAGE_ROWS),   # int4 has 32-token tiles already
], ids=("two-quads", "d160", "auto", "int4"))
def test_others_keep_their_kernel(kernel):
    assert ca._round_tile(kernel) == kernel


@pytest.mark.parametrize("kv", ONE_BYTE)
def test_row_copies_need_three_stages(kv):
    """Row staging issues its copies a tile late (attention.cuh asserts three
    stages for it): a two-stage kernel takes bulk copies instead."""
    chosen = ca._settle_staging(ca._round_tile(sixteen_token(kv, 96)))
    assert (chosen.stages, chosen.staging) == (2, ca.STAGE_BULK)
    chosen = ca._settle_staging(ca._round_tile(sixteen_token(kv, 128)))
    assert (chosen.stages, chosen.staging) == (3, ca.STAGE_ROWS)
    int4 = Kernel(KV_INT4, 128, 8, 1, 32, 16, ca.STAGE_ROWS)
    assert ca._settle_staging(int4) == int4
