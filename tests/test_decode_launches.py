"""How a decode step is launched (cuda_attention.paged_attention), on the host: no GPU,
so it runs in CI. The attention kernel reads and rotates the caller's query, and
the merge rotates the output back, wherever the rotation is none or blockdiag;
a kron plan keeps the rotate launches before and after."""

import re

import pytest

import kvcupy as kc
from kvcupy import jit
from kvcupy.backends import cuda_attention as ca


def header_constant(name: str) -> int:
    text = (jit.source_dir() / "attention.cuh").read_text()
    return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))


def test_merge_constants_match_the_kernel():
    assert header_constant("kMergeWarps") == ca.MERGE_WARPS
    assert header_constant("kMergeMaxSplits") == ca.MAX_SPLITS


@pytest.mark.parametrize("splits,warps", [(1, 1), (2, 2), (3, 2), (4, 4), (7, 4), (8, 8), (9, 8), (32, 8),
                                          (256, 8)])
def test_merge_split_warps(splits, warps):
    """A power of two, at most the split count (every warp of a row has a split:
    merge_splits reads split `phase` unconditionally) and at most a block's warps."""
    assert ca.merge_split_warps(splits) == warps


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("preset", ["kvcupy", "vllm"])
def test_blockdiag_and_no_rotation_stay_in_the_kernels(head_size, preset):
    assert ca._in_kernel_rotation(kc.rotation_plan(head_size, "blockdiag", preset))
    assert ca._in_kernel_rotation(kc.rotation_plan(head_size, "none"))
    assert ca._in_kernel_rotation(None)


@pytest.mark.parametrize("head_size", [96, 160, 224])
def test_kron_keeps_the_rotate_launches(head_size):
    assert not ca._in_kernel_rotation(kc.rotation_plan(head_size, "kron"))


@pytest.mark.parametrize("head_size", [32, 34, 80, 96, 128, 256])
def test_butterflies_span_the_blockdiag_block(head_size):
    """The kernels' sign_shift is log2 b, b the largest power of two dividing the head size."""
    plan = kc.rotation_plan(head_size, "blockdiag")
    assert 1 << (plan.block.bit_length() - 1) == plan.block == head_size & -head_size
