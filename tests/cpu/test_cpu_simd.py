"""The hand-vectorised loops (cpu_simd) against NumPy on the same stored rows:
int4 codes, and fp16 / bf16 bits.

They compute in float32 with a different summation order from NumPy's
float64: dot products of <= 256 terms, sums of <= 16 rows, so errors stay a
few 2^-24 relative; 1e-6 leaves room and still catches any wrong lane,
nibble, zero-point or row.
"""

import numba
import numpy as np
import pytest

from kvcupy.backends import cpu_kernels, cpu_simd

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


# --- fp16 / bf16 rows -------------------------------------------------------

HALF_FLOAT_KINDS = {"fp16": cpu_simd.FLOAT16_ROWS, "bf16": cpu_simd.BFLOAT16_ROWS}
HALF_FLOAT_SCORE_KERNELS = {(kind, heads): callable_from_python(cpu_simd.make_half_float_scores(rows, heads))
                            for kind, rows in HALF_FLOAT_KINDS.items() for heads in (1, 2, 4)}
HALF_FLOAT_ACCUMULATE_KERNELS = {(kind, heads): callable_from_python(cpu_simd.make_half_float_accumulate(rows, heads))
                                 for kind, rows in HALF_FLOAT_KINDS.items() for heads in (1, 2, 4)}


def make_half_float_cache(rng, kind, head_size, strided):
    """Random fp16 or bf16 rows [block, row, head, value] as uint16 bits (the view the
    kernel reads), and their float64 values. Every 7th value is tiny: fp16
    subnormals (below 2^-14), which the conversion must keep exactly.
    strided: rows padded as in vLLM's inline-scale layout.
    """
    shape = (4, 16, 3, head_size + (12 if strided else 0))
    values = rng.standard_normal(shape).astype(np.float32)
    values.reshape(-1)[::7] *= np.float32(2.0 ** -20)
    if kind == "fp16":
        bits = values.astype(np.float16).view(np.uint16)
        exact = bits.view(np.float16).astype(np.float64)
    else:
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)   # truncated to bfloat16
        exact = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if strided:
        bits, exact = bits[..., :head_size], exact[..., :head_size]
    return bits, exact


# A kernel that reads a row's second half from the first half's place, swaps
# q's halves, converts bf16 bits as fp16 (or the other way), skips the
# subnormals, or misses the last rows of a step fails these by far more than
# RTOL: every such mistake changes whole values, not roundings.
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("kind", sorted(HALF_FLOAT_KINDS))
@pytest.mark.parametrize("head_size,heads,n", CASES)
def test_half_float_scores_match_numpy(head_size, heads, n, kind, strided):
    rng = np.random.default_rng(head_size * 10 + heads + n)
    data, exact = make_half_float_cache(rng, kind, head_size, strided)
    block, offset, head = 2, 16 - n, 1
    q = rng.standard_normal((heads + 3, head_size)).astype(np.float32)
    out = np.full((heads + 3, 5 + n + 3), np.nan, np.float32)
    HALF_FLOAT_SCORE_KERNELS[kind, heads](q, 1, data, block, offset, head, n, out, 5)

    rows = exact[block, offset:offset + n, head]
    expected = q[1:1 + heads].astype(np.float64) @ rows.T
    # Zero-mean values cancel: bound the error by the sum of the terms' magnitudes.
    magnitude = np.abs(q[1:1 + heads]).astype(np.float64) @ np.abs(rows).T
    got = out[1:1 + heads, 5:5 + n]
    assert (np.abs(got - expected) <= RTOL * magnitude).all(), f"{kind} d={head_size} heads={heads} n={n}"
    assert np.isnan(out[0]).all() and np.isnan(out[1 + heads:]).all() and np.isnan(out[:, :5]).all()


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("kind", sorted(HALF_FLOAT_KINDS))
@pytest.mark.parametrize("head_size,heads,n", CASES)
def test_half_float_accumulate_matches_numpy(head_size, heads, n, kind, strided):
    rng = np.random.default_rng(head_size * 10 + heads + n + 1)
    data, exact = make_half_float_cache(rng, kind, head_size, strided)
    block, offset, head = 1, 0, 2
    acc = rng.standard_normal((heads + 3, head_size)).astype(np.float32)
    before = acc.copy()
    weights = rng.random((heads + 3, 3 + 16)).astype(np.float32)
    HALF_FLOAT_ACCUMULATE_KERNELS[kind, heads](acc, 2, data, block, offset, head, n, weights, 1, 3)

    rows = exact[block, :n, head]
    expected = before[2:2 + heads] + weights[1:1 + heads, 3:3 + n].astype(np.float64) @ rows
    magnitude = np.abs(before[2:2 + heads]) + weights[1:1 + heads, 3:3 + n].astype(np.float64) @ np.abs(rows)
    assert (np.abs(acc[2:2 + heads] - expected) <= RTOL * magnitude).all(), f"{kind} d={head_size} heads={heads} n={n}"
    np.testing.assert_array_equal(acc[:2], before[:2])
    np.testing.assert_array_equal(acc[2 + heads:], before[2 + heads:])


@pytest.mark.parametrize("kind", sorted(HALF_FLOAT_KINDS))
def test_half_float_conversion_keeps_special_values(kind):
    """inf, -inf, NaN, the extreme finite values and the smallest fp16 subnormal pass
    through unchanged: a value that overflowed fp16 must not come back finite."""
    specials = np.array([np.inf, -np.inf, np.nan, 1.0, 65504.0, -65504.0, 2.0 ** -24, -3.0], np.float32)
    if kind == "fp16":
        bits = specials.astype(np.float16).view(np.uint16)
        expected = bits.view(np.float16).astype(np.float32)
    else:
        bits = (specials.view(np.uint32) >> 16).astype(np.uint16)   # 65504 truncates to 65280
        expected = (bits.astype(np.uint32) << 16).view(np.float32)
    data = np.tile(bits, 2).reshape(1, 1, 1, 16)   # d = 16: one tile per half-row
    acc = np.zeros((1, 16), np.float32)
    HALF_FLOAT_ACCUMULATE_KERNELS[kind, 1](acc, 0, data, 0, 0, 0, 1, np.ones((1, 1), np.float32), 0, 0)
    np.testing.assert_array_equal(acc[0], np.tile(expected, 2), err_msg=kind)


@pytest.mark.parametrize("bad", ["nan", "+inf", "-inf"])
@pytest.mark.parametrize("kind", sorted(HALF_FLOAT_KINDS))
def test_only_a_chunk_with_a_nonfinite_value_leaves_the_register_loops(kind, bad):
    """cpu_kernels sends a prefill run's value chunk through these loops only when
    _finite_half_float_chunk finds no inf or NaN in it (the buffer path keeps such
    a row from the run's rows that do not see it). The largest finite values,
    exponent bits all ones but one, must not count as non-finite."""
    mode = {"fp16": cpu_kernels.DECODE_FP16, "bf16": cpu_kernels.DECODE_BF16}[kind]
    largest = np.uint16(0x7BFF if kind == "fp16" else 0x7F7F)
    data = np.full((3, 16, 2, 64), largest, np.uint16)
    data[:, ::2] |= np.uint16(0x8000)   # and the most negative
    value = np.float32({"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}[bad])
    data[2, 9, 1, 63] = value.astype(np.float16).view(np.uint16) if kind == "fp16" else value.view(np.uint32) >> 16
    block_table = np.array([[1, 2, 0]], np.int32)   # positions 16 .. 31 are block 2
    finite = {(start, end, head): cpu_kernels._finite_half_float_chunk(mode, data, block_table, 0, 16, start, end, head)
              for start, end, head in [(0, 48, 1), (16, 48, 1), (16, 25, 1), (16, 26, 1), (26, 48, 1), (16, 48, 0)]}
    # Only chunks of head 1 that reach row 9 of block 2 (position 25) hold the bad value.
    assert finite == {(0, 48, 1): True, (16, 48, 1): False, (16, 25, 1): True, (16, 26, 1): False,
                      (26, 48, 1): True, (16, 48, 0): True}, f"{kind} {bad}"
