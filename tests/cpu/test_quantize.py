"""The oracle's quantization against hand-worked cases and docs/format.md's bounds."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvcupy import formats, reference
from kvcupy.backends import cpu_kernels


def test_int4_hand_worked():
    x = np.arange(16, dtype=np.float32) * 0.5          # lo 0, hi 7.5: scale 0.5, zero-point 0
    codes, encoded = reference.quantize_int4(x)
    np.testing.assert_array_equal(codes, np.arange(16))
    packed = reference.pack_int4(codes)
    assert packed[:2].tolist() == [0x10, 0x32]          # even element in the low nibble
    assert encoded.view(np.uint32) == np.float32(0.5).view(np.uint32)

    shifted = np.arange(16, dtype=np.float32) - 1.0     # lo -1: scale 1, zero-point 1
    codes, encoded = reference.quantize_int4(shifted)
    np.testing.assert_array_equal(codes, np.arange(16))
    scale, zero_point = formats.decode_int4_scale(encoded)
    assert (scale, zero_point) == (1.0, 1)
    np.testing.assert_array_equal(reference.decode(reference.pack_int4(codes), encoded,
                                                   "int4_per_token_head"), shifted)


def test_round_half_away_from_zero_as_vllm_does_it():
    values = np.array([2.5, -2.5, 0.5, -0.5, 1.49, 0.49999997], np.float32)
    # 0.49999997 + 0.5 rounds to 1.0 in float32 before truncation: vLLM's result.
    np.testing.assert_array_equal(reference.round_half_away(values), [3, -3, 1, -1, 1, 1])


@pytest.mark.parametrize("zero_point", range(16))
def test_int4_scale_encoding_round_trip(zero_point):
    scale = np.float32(0.0123)
    encoded = formats.encode_int4_scale(scale, zero_point)
    decoded_scale, decoded_zero_point = formats.decode_int4_scale(encoded)
    assert decoded_zero_point == zero_point
    assert decoded_scale.view(np.uint32) == scale.view(np.uint32) & ~np.uint32(0xF)


def test_zero_vector_uses_minimum_scale():
    for quantize in (reference.quantize_int4, reference.quantize_int8, reference.quantize_fp8):
        codes, scale = quantize(np.zeros(32, np.float32))
        assert float(scale) == pytest.approx(1e-6, rel=1e-5)


def test_int8_hand_worked():
    x = np.array([1.27, -1.27, 0.005, 0.015, 0.0], np.float32)
    codes, scale = reference.quantize_int8(x)
    assert scale == np.float32(1.27) / np.float32(127)
    assert codes.tolist() == [127, -127, 1, 2, 0]       # 0.5 and 1.5 round away from zero


def test_fp8_saturates_at_448():
    x = np.array([1.0, -1.0, 1e-3], np.float32)
    codes, scale = reference.quantize_fp8(x)
    values = codes.view(formats.FP8_DTYPE).astype(np.float32)
    assert values[0] == 448.0 and values[1] == -448.0


vectors = hnp.arrays(np.float32, st.integers(16, 64).map(lambda n: 2 * n),
                     elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_int4_error_within_half_a_step(x):
    # The zero-point must be a code (0..15), so [lo, hi] is covered only when it
    # holds 0: true of rotated vectors, whose entries sum-cancel around 0.
    assume(x.min() <= 0 <= x.max())
    codes, encoded = reference.quantize_int4(x)
    step, _ = formats.decode_int4_scale(encoded)
    decoded = reference.decode(reference.pack_int4(codes), encoded, "int4_per_token_head")
    # Half a step of rounding; the decoded step drops 4 mantissa bits (relative
    # 2^-19) over at most 15 steps; float32 rounding of x * (1 / scale).
    bound = float(step) * (0.5 + 15 * 2.0 ** -19) + 1e-6 * np.abs(x).max()
    assert np.all(np.abs(decoded - x) <= bound)


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_int8_error_within_half_a_step(x):
    codes, scale = reference.quantize_int8(x)
    decoded = reference.decode(codes, scale, "int8_per_token_head")
    assert np.all(np.abs(decoded - x) <= 0.5 * float(scale) * (1 + 1e-5) + 1e-6 * np.abs(x).max())


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_fp8_relative_error_within_half_an_ulp(x):
    codes, scale = reference.quantize_fp8(x)
    decoded = reference.decode(codes, scale, "fp8_per_token_head")
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals; below 2^-6
    # (subnormals) the absolute step is 2^-9 in scaled units.
    bound = np.maximum(np.abs(x) * 2.0 ** -4, 2.0 ** -10 * float(scale)) * (1 + 1e-5)
    assert np.all(np.abs(decoded - x) <= bound + 1e-6 * np.abs(x).max())


@given(hnp.arrays(np.uint8, st.integers(1, 64).map(lambda n: 2 * n), elements=st.integers(0, 15)))
def test_pack_unpack_inverse(codes):
    np.testing.assert_array_equal(reference.unpack_int4(reference.pack_int4(codes)), codes)


def test_numba_e4m3fn_conversion_matches_ml_dtypes():
    """Every e4m3fn value, the midpoints between neighbours (ties) and their float32 neighbours."""
    finite = np.arange(256, dtype=np.uint8).view(formats.FP8_DTYPE).astype(np.float32)
    finite = np.unique(finite[np.isfinite(finite)])
    midpoints = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    probes = np.concatenate([finite, midpoints, np.nextafter(midpoints, np.float32(np.inf)),
                             np.nextafter(midpoints, np.float32(-np.inf)),
                             np.random.default_rng(0).uniform(-448, 448, 20000).astype(np.float32),
                             np.float32([447.9, 448.0, -448.0, 1e-9, -0.0, 0.0])])
    expected = probes.astype(formats.FP8_DTYPE).view(np.uint8)
    actual = np.array([cpu_kernels.float_to_e4m3fn(np.float32(v)) for v in probes], np.uint8)
    mismatched = probes[actual != expected]
    assert mismatched.size == 0, mismatched[:10]


def test_fp8_decode_table_matches_ml_dtypes():
    table = formats.fp8_decode_table()
    expected = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(table, expected)


@pytest.mark.parametrize("kv_dtype,bytes_", [("int4_per_token_head", 2 * 8 * (48 + 4)),
                                             ("int8_per_token_head", 2 * 8 * (96 + 4)),
                                             ("fp8_per_token_head", 2 * 8 * (96 + 4))])
def test_bytes_per_token(kv_dtype, bytes_):
    assert formats.kv_dtype_info(kv_dtype).bytes_per_token(8, 96) == bytes_
    assert formats.kv_dtype_info("auto").bytes_per_token(8, 96, np.float16) == 2 * 8 * 96 * 2
