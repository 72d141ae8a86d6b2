"""The prefill kernel's own rotation (prefill.cuh, load_query / write_output):
the rotation as mma B fragments, and the shift and butterfly stages that go
with them. NumPy only."""

from __future__ import annotations

import numpy as np

from ...rotation import sylvester
from .kernels import KV_INT4


def logical_channels(head_pad: int, kv: int) -> np.ndarray:
    """prefill.cuh's channel_of: the cache channel of each logical dim of the products."""
    logical = np.arange(head_pad)
    if kv != KV_INT4:
        return logical
    within = logical & 7
    return (logical & ~7) + (within >> 1) + 4 * (within & 1)


def mma_b_fragments(b: np.ndarray, bf16: bool = False) -> np.ndarray:
    """B [K, N] (entries exact in fp16, or with bf16 in bf16) as m16n8k16 B fragments,
    [K/16, N/8, 32 lanes, 2] uint32: lane (g, t) of k step ks and n tile nt holds the
    16-bit pairs (B[16ks + 2t, 8nt + g], B[16ks + 2t + 1, ..]) and (B[16ks + 2t + 8, ..],
    B[16ks + 2t + 9, ..])."""
    k_steps, n_tiles = b.shape[0] // 16, b.shape[1] // 8
    ks, nt, lane = np.meshgrid(np.arange(k_steps), np.arange(n_tiles), np.arange(32), indexing="ij")
    g, t = lane >> 2, lane & 3
    k, n = 16 * ks + 2 * t, 8 * nt + g
    if bf16:   # the high half of the float32 (exact for the values this takes)
        bits = (b.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
    else:
        bits = b.astype(np.float16).view(np.uint16).astype(np.uint32)
    return np.stack([bits[k, n] | bits[k + 1, n] << 16, bits[k + 8, n] | bits[k + 9, n] << 16], axis=-1)


def rotation_fragments(rotation, head_pad: int, kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The forward and inverse rotation as the prefill kernel's mma operands.

    With F = H diag(s) (rotation.py: y = F x; x = F^T y / norm) and the kernel's
    dims in logical order (P[l, k] = F[channel_of(l), k], zero past the head
    size): the query's product is q P^T (B = P^T), the output's o P (B = P).
    The forward operand comes twice, [2, K/16, N/8, 32, 2]: as fp16 pairs for
    fp16 and fp32 queries, then as bf16 pairs for bf16 ones (prefill.cuh's
    forward_fragments), whose products take the query as it is."""
    d = rotation.head_size
    # With butterfly stages F = (H_{b/16} (x) I_16, per block) G, and the fragments hold G.
    matrix = np.kron(np.eye(d // 16), sylvester(16)) if rotation_stages(rotation) else rotation.matrix()
    forward = matrix * rotation.sign_vector()[None, :]
    channels = logical_channels(head_pad, kv)
    stored = channels < d
    p = np.zeros((head_pad, head_pad))
    p[np.flatnonzero(stored), :d] = forward[channels[stored]]
    return np.stack([mma_b_fragments(p.T), mma_b_fragments(p.T, bf16=True)]), mma_b_fragments(p)


def rotation_shift(rotation) -> int:
    """prefill.cuh's rotation_shift: -1 without a rotation; else log2 of the width of
    the independent blocks the rotation's fragments fall in: 16 dims for a
    block-diagonal rotation whose blocks span whole fragments (its 16-dim blocks,
    or for wider ones the factor beside rotation_stages), otherwise (kron,
    narrower blocks) one block for the whole head (30)."""
    if rotation is None or rotation.is_identity:
        return -1
    if rotation.kind == "blockdiag" and rotation.block >= 16:
        return 4
    return 30


def rotation_stages(rotation) -> int:
    """prefill.cuh's rotation_stages: butterflies across 16-dim groups that the kernel
    applies beside the fragments' products. A Sylvester block of b = 2^m >= 32 dims
    is H_b = H_{b/16} (x) H_16 = (H_{b/16} (x) I_16)(I_{b/16} (x) H_16): the fragments
    hold the second factor with the signs (16 of the 128 fragments at d = 128, not
    all 128), and m - 4 butterfly stages in registers do the first. 0 otherwise."""
    if rotation is None or rotation.is_identity or rotation.kind != "blockdiag" or rotation.block < 32:
        return 0
    return rotation.block.bit_length() - 5
