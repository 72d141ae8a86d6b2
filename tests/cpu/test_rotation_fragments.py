"""The prefill kernel's rotation operands (fragments.rotation_fragments),
checked on the host: the fragments are unpacked the way mma.m16n8k16 hands
them to lane (g, t), and the products prefill.cuh forms with them must be the
oracle's rotation (query) and inverse rotation (output), in the kernel's
logical dim order. NumPy only: no GPU, and it runs in CI."""

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import reference
from kvcupy.rotation import sylvester
from kvcupy.backends.cuda import fragments, kernels


def unpack_fragments(fragments: np.ndarray, bf16: bool = False) -> np.ndarray:
    """[K/16, N/8, 32, 2] uint32 -> B [K, N] float64, reading each word as the
    PTX fragment layout says: lane (g, t) holds B[2t, 2t + 1][g] in its first
    register and B[2t + 8, 2t + 9][g] in its second, the lower k in the low half
    (fp16 values, or with bf16 the high halves of float32 ones)."""
    k_steps, n_tiles = fragments.shape[:2]
    b = np.full((16 * k_steps, 8 * n_tiles), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for register, k in ((0, 2 * t), (1, 2 * t + 8)):
            words = fragments[:, :, lane, register]
            for half, shift in ((0, 0), (1, 16)):
                halves = (words >> shift) & 0xFFFF
                if bf16:
                    values = (halves.astype(np.uint32) << 16).view(np.float32)
                else:
                    values = halves.astype(np.uint16).view(np.float16)
                b[np.arange(k_steps)[:, None] * 16 + k + half, np.arange(n_tiles)[None, :] * 8 + g] = values
    assert not np.isnan(b).any()
    return b


def all_fragments(plan, head_pad: int, kv: int) -> list:
    """rotation_fragments' operands as B matrices: the forward one's fp16 and bf16
    copies, then the inverse."""
    forward, inverse = fragments.rotation_fragments(plan, head_pad, kv)
    assert forward.shape == (2, *inverse.shape)
    return [unpack_fragments(forward[0]), unpack_fragments(forward[1], bf16=True), unpack_fragments(inverse)]


def butterflies_across_groups(v: np.ndarray, stages: int) -> np.ndarray:
    """prefill.cuh's butterflies_across_groups on one row of logical dims:
    (H_{2^stages} (x) I_16) on every block of 2^stages x 16 dims."""
    if stages == 0:
        return v
    blocks = v.reshape(-1, 2 ** stages, 16)
    return np.einsum("ab,nbc->nac", sylvester(2 ** stages), blocks).reshape(v.shape)


CASES = [(128, "blockdiag"), (64, "blockdiag"), (32, "blockdiag"), (96, "blockdiag"), (80, "blockdiag"),
         (40, "blockdiag"), (34, "blockdiag"), (80, "kron"), (112, "kron"), (96, "kron"), (64, "none")]


@pytest.mark.parametrize("kv", [kernels.KV_INT4, kernels.KV_INT8, kernels.KV_BF16])
@pytest.mark.parametrize("head_size,kind", CASES)
def test_fragments_rotate_like_the_oracle(head_size, kind, kv):
    plan = kc.rotation_plan(head_size, kind)
    head_pad = -(-head_size // kernels.HEAD_CLASS) * kernels.HEAD_CLASS
    channels = fragments.logical_channels(head_pad, kv)
    stored = channels < head_size
    rng = np.random.default_rng(head_size)
    if plan.is_identity:
        assert fragments.rotation_shift(plan) == -1   # the kernel reads and writes channels in place
        return
    forward, forward_bf16, inverse = all_fragments(plan, head_pad, kv)
    assert set(np.unique(forward)) <= {-1.0, 0.0, 1.0}   # exact in fp16 and bf16
    np.testing.assert_array_equal(forward_bf16, forward)   # the bf16 query's copy: the same matrix
    stages = fragments.rotation_stages(plan)

    # Query: q (channels, zero-padded) times the forward B, then the butterflies
    # across groups = the rotated query's logical dims, each the channel
    # channel_of(l) of reference.rotate.
    q = np.zeros(head_pad)
    q[:head_size] = rng.standard_normal(head_size)
    rotated = reference.rotate(q[:head_size], plan)
    want = np.where(stored, rotated[np.minimum(channels, head_size - 1)], 0.0)
    np.testing.assert_allclose(butterflies_across_groups(q @ forward, stages), want, rtol=0, atol=1e-12)

    # Output: rows in logical order through the butterflies, times the inverse
    # B, over the norm = the oracle's inverse rotation, channel by channel.
    y = rng.standard_normal(head_size)
    logical = butterflies_across_groups(np.where(stored, y[np.minimum(channels, head_size - 1)], 0.0), stages)
    np.testing.assert_allclose((logical @ inverse)[:head_size] / plan.norm,
                               reference.rotate(y, plan, inverse=True), rtol=0, atol=1e-12)
    assert not (logical @ inverse)[head_size:].any()   # nothing written past the head


@pytest.mark.parametrize("head_size,stages", [(128, 3), (64, 2), (96, 1), (32, 1), (80, 0), (112, 0)])
def test_wide_blocks_leave_their_sylvester_factor_to_butterflies(head_size, stages):
    """A blockdiag rotation of 2^(4 + stages) dims a block: fragments in 16-dim
    groups (shift 4, the kernel's fast path), the rest as butterflies."""
    plan = kc.rotation_plan(head_size, "blockdiag")
    assert (fragments.rotation_shift(plan), fragments.rotation_stages(plan)) == (4, stages)
    assert fragments.rotation_stages(kc.rotation_plan(head_size, "kron")) == 0


@pytest.mark.parametrize("head_size,kind", CASES)
def test_skipped_fragments_are_zero(head_size, kind):
    """prefill.cuh skips fragment (ks, nt) unless (16 ks) >> shift == (8 nt) >> shift:
    every skipped fragment must be all zero (a skipped nonzero would drop a term)."""
    plan = kc.rotation_plan(head_size, kind)
    shift = fragments.rotation_shift(plan)
    if shift < 0:
        return
    head_pad = -(-head_size // kernels.HEAD_CLASS) * kernels.HEAD_CLASS
    for b in all_fragments(plan, head_pad, kernels.KV_INT4):   # values: a zero entry may be -0 (a sign times 0)
        for ks in range(b.shape[0] // 16):
            for nt in range(b.shape[1] // 8):
                if (16 * ks) >> shift != (8 * nt) >> shift:
                    assert not b[16 * ks:16 * ks + 16, 8 * nt:8 * nt + 8].any(), (ks, nt)


def test_narrow_blocks_keep_every_fragment():
    """Blocks of 2, 4 or 8 dims share fragments: no fragment may be skipped there."""
    for head_size in (34, 36, 40, 72, 120):
        plan = kc.rotation_plan(head_size, "blockdiag")
        assert plan.block < 16 and fragments.rotation_shift(plan) == 30
