"""The hand-vectorised int4 loops (cpu_simd) against NumPy on the same codes.

They compute in float32 with a different summation order from NumPy's
float64: dot products of <= 256 terms, sums of <= 16 rows, so errors stay a
few 2^-24 relative; 1e-6 leaves room and still catches any wrong lane,
nibble, zero-point or row.
"""

import numba
import numpy as np
import pytest

from kvcupy.backends import cpu_simd

RTOL = 1e-6


def callable_from_python(intrinsic):
    """An intrinsic is callable only from Numba code: a jitted function around it."""
    @numba.njit
    def call(*args):
        intrinsic(*args)
    return call


SCORE_KERNELS = {heads: callable_from_python(cpu_simd.make_int4_scores(heads)) for heads in (1, 2, 4)}
ACCUMULATE_KERNELS = {heads: callable_from_python(cpu_simd.make_int4_accumulate(heads)) for heads in (1, 2, 4)}


def make_cache(rng, head_size, strided):
    """Random int4 rows [block, row, head, byte]; strided: rows padded as in vLLM's inline-scale layout."""
    half = head_size // 2
    shape = (4, 16, 3, half + (12 if strided else 0))
    data = rng.integers(0, 256, shape, dtype=np.uint8)
    return data[..., :half] if strided else data


def codes(data, block, offset, n, head):
    """[n, d] codes of rows offset .. offset + n - 1, in storage order (low nibbles, then high)."""
    rows = data[block, offset:offset + n, head].astype(np.int64)
    return np.concatenate([rows & 15, rows >> 4], axis=1)


CASES = [(head_size, heads, n) for head_size in (64, 80, 96, 128, 192, 256)
         for heads in (1, 2, 4) for n in (1, 3, 16)]


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("head_size,heads,n", CASES)
def test_scores_match_numpy(head_size, heads, n, strided):
    rng = np.random.default_rng(head_size * 10 + heads + n)
    data = make_cache(rng, head_size, strided)
    block, offset, head = 2, 16 - n, 1
    q = rng.standard_normal((heads + 3, head_size)).astype(np.float32)
    zero_points = rng.integers(0, 16, 16).astype(np.int32)
    scales = rng.random(16).astype(np.float32)
    # The last step of up to 4 / heads rows may write 3 columns past the last row.
    out = np.full((heads + 3, 5 + n + 3), np.nan, np.float32)
    SCORE_KERNELS[heads](q, 1, data, block, offset, head, n, zero_points, scales, out, 5)

    centred = codes(data, block, offset, n, head) - zero_points[:n, None]
    expected = q[1:1 + heads].astype(np.float64) @ centred.T * scales[:n]
    got = out[1:1 + heads, 5:5 + n]
    assert np.abs(got - expected).max() <= RTOL * np.abs(expected).max()
    assert np.isnan(out[0]).all() and np.isnan(out[1 + heads:]).all() and np.isnan(out[:, :5]).all()


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("head_size,heads,n", CASES)
def test_accumulate_matches_numpy(head_size, heads, n, strided):
    rng = np.random.default_rng(head_size * 10 + heads + n + 1)
    data = make_cache(rng, head_size, strided)
    block, offset, head = 1, 0, 2
    acc = rng.standard_normal((heads + 3, head_size)).astype(np.float32)
    before = acc.copy()
    zero_points = rng.integers(0, 16, 16).astype(np.int32)
    weights = rng.random((heads + 3, 16)).astype(np.float32)
    ACCUMULATE_KERNELS[heads](acc, 2, data, block, offset, head, n, zero_points, weights, 1)

    centred = codes(data, block, offset, n, head) - zero_points[:n, None]
    expected = before[2:2 + heads] + weights[1:1 + heads, :n].astype(np.float64) @ centred
    assert np.abs(acc[2:2 + heads] - expected).max() <= RTOL * np.abs(expected).max()
    np.testing.assert_array_equal(acc[:2], before[:2])
    np.testing.assert_array_equal(acc[2 + heads:], before[2 + heads:])
