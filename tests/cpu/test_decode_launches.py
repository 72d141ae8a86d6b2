"""How a decode step is launched (kvcupy.backends.cuda.attention.paged_attention), on the host: no GPU,
so it runs in CI. The attention kernel reads and rotates the caller's query, and
the merge rotates the output back, wherever the rotation is none or blockdiag;
a kron plan keeps the rotate launches before and after."""

import pytest

import kvcupy as kc
from kvcupy.backends.cuda import attention


@pytest.mark.parametrize("splits,warps", [(1, 1), (2, 2), (3, 2), (4, 4), (7, 4), (8, 8), (9, 8), (32, 8),
                                          (256, 8)])
def test_merge_split_warps(splits, warps):
    """A power of two, at most the split count (every warp of a row has a split:
    merge_splits reads split `phase` unconditionally) and at most a block's warps."""
    assert attention.merge_split_warps(splits) == warps


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("preset", ["kvcupy", "vllm"])
def test_blockdiag_and_no_rotation_stay_in_the_kernels(head_size, preset):
    assert attention._in_kernel_rotation(kc.rotation_plan(head_size, "blockdiag", preset))
    assert attention._in_kernel_rotation(kc.rotation_plan(head_size, "none"))
    assert attention._in_kernel_rotation(None)


@pytest.mark.parametrize("head_size", [96, 160, 224])
def test_kron_keeps_the_rotate_launches(head_size):
    assert not attention._in_kernel_rotation(kc.rotation_plan(head_size, "kron"))


@pytest.mark.parametrize("head_size", range(32, 257, 2))
def test_sign_shift_is_the_blockdiag_block(head_size):
    """b = 2^sign_shift divides the head size and leaves an odd count of blocks
    (b the largest such power of two); b <= 256: the kernels' 8 butterfly stages."""
    shift = attention.sign_shift(kc.rotation_plan(head_size, "blockdiag"))
    assert 0 < shift <= 8 and head_size % (1 << shift) == 0 and (head_size >> shift) % 2 == 1
    assert attention.sign_shift(kc.rotation_plan(head_size, "none")) == attention.sign_shift(None) == -1


def test_sign_shift_refuses_kron():
    with pytest.raises(ValueError, match="blockdiag only"):
        attention.sign_shift(kc.rotation_plan(96, "kron"))
