"""The premise of the CUDA kernels' integer rotation path (kernels_cu/rotation.cuh,
exact_grid and exact_rotation), on the host: for every vector its test
admits, the float64 butterflies of cpu_kernels.rotate_rows never round, so
their result equals the exact integer sums on the grid rounded once to
float32. The model below restates the kernel's test: the largest magnitude
sets k (largest * 2^k < 2^22), every |x| is at least 2^(top + P - 22 - 127)
(so a zero fails it), and the grid stays within float32's normal range. The
GPU tests check the kernels against the CPU bit for bit on both sides of
each edge."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvcupy as kc
from kvcupy.backends import cpu_kernels
from kvcupy.rotation import sylvester

BF16 = np.dtype(ml_dtypes.bfloat16)
SIGNIFICANT_BITS = {BF16: 8, np.dtype(np.float16): 11}


def admitted(x: np.ndarray, significant_bits: int) -> tuple[bool, int]:
    """(whether exact_grid takes the integer path for this signed float32 vector, its k)."""
    magnitudes = np.abs(x.astype(np.float32))
    if not np.isfinite(magnitudes).all():
        return False, 0
    top = int(magnitudes.max().view(np.uint32) >> 23)
    ok = 22 <= top <= 254 and magnitudes.min() >= 2.0 ** (top + significant_bits - 22 - 127)
    return ok, 148 - top


def integer_rotation(x: np.ndarray, pow2: int, k: int) -> np.ndarray:
    """H (x * 2^k) summed exactly in integers, rounded once to float32, scaled back."""
    on_grid = x.astype(np.float64) * 2.0 ** k
    assert (on_grid == np.round(on_grid)).all() and (np.abs(on_grid) < 2 ** 22).all()
    sums = on_grid.astype(np.int64).reshape(-1, pow2) @ sylvester(pow2).astype(np.int64).T
    assert (np.abs(sums) < 2 ** 30).all()
    return (sums.reshape(-1).astype(np.float32) * np.float32(2.0 ** -k)).astype(np.float32)


def vectors(rng, head_size: int, dtype: np.dtype) -> np.ndarray:
    """Random vectors over many scales, with zeros, tiny values and wide ranges."""
    x = rng.standard_normal((400, head_size)) * np.exp(rng.uniform(-20, 20, (400, 1)))
    x[::5, ::7] = 0.0
    x[1::5, 3] *= 2.0 ** rng.integers(-16, -8, 80)
    x[2::5, 5] = -0.0
    x[3::5, :: max(1, head_size // 4)] *= 2.0 ** -12
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", SIGNIFICANT_BITS, ids=lambda d: d.name)
@pytest.mark.parametrize("head_size", (64, 96, 128, 256))
def test_admitted_vectors_rotate_exactly_as_float64_does(head_size, dtype):
    rng = np.random.default_rng(head_size)
    plan = kc.rotation_plan(head_size, "blockdiag")
    x = vectors(rng, head_size, dtype).astype(np.float32)
    identity = np.arange(head_size, dtype=np.int64)
    expected = np.empty_like(x)
    with np.errstate(over="ignore", invalid="ignore"):
        cpu_kernels.rotate_rows(x, expected, plan.sign_vector(), plan.mix_matrix(), False, plan.pow2_size,
                                False, 1.0, identity, identity)
    signs = np.asarray(plan.sign_vector(), np.float32)
    taken = 0
    for row, want in zip(x, expected):
        signed = row * signs
        ok, k = admitted(signed, SIGNIFICANT_BITS[dtype])
        if not ok:
            continue
        taken += 1
        with np.errstate(over="ignore"):
            got = integer_rotation(signed, plan.pow2_size, k)
        assert (got.view(np.uint32) == want.view(np.uint32)).all()
    assert 0 < taken < len(x)   # both sides of the test occur in this data


def test_zero_inputs_can_give_float64_a_negative_zero():
    """Why a zero keeps a vector off the integer path: a block of -0 beside an
    exact cancellation (1 - 1 = +0) gives float64 a -0 where integers give +0."""
    plan = kc.rotation_plan(64, "blockdiag")
    signed = np.full(64, -0.0, np.float32)
    signed[32:] = 0.0
    signed[32], signed[33] = 1.0, -1.0
    signs = np.asarray(plan.sign_vector(), np.float32)
    out = np.empty((1, 64), np.float32)
    identity = np.arange(64, dtype=np.int64)
    cpu_kernels.rotate_rows((signed * signs)[None], out, plan.sign_vector(), plan.mix_matrix(), False, 64, False,
                            1.0, identity, identity)
    negative_zeros = (out[0] == 0) & np.signbit(out[0])
    assert negative_zeros.any()
    assert not admitted(signed, 8)[0]
    integers = integer_rotation(signed, 64, 0)
    assert not ((integers == 0) & np.signbit(integers)).any()   # the integer path's zeros are all +0
