"""The CUDA write kernel's quantizer arithmetic (kernels_cu/quantize.cuh), restated
in float32 NumPy one rounding at a time, against the oracle's quantizers on the
same vectors. The kernel takes a vector on its integer path as float(n) and a
power-of-two unit (the vector is float(n) x unit) and
- folds the unit into the reciprocal scale: x * (r * unit) for (x * unit) * r,
  both products by unit exact (r * unit stays normal: quantize.cuh says why);
- works int4's code out 16 times smaller, v / 16 = (x * r / 16 + zp / 16) + 1 / 32,
  so that a saturating add clamps at 0 and the floor is an add of 2^19 toward zero.
Both rest on scaling by a power of two commuting with rounding; the cases below
aim at where it could fail: exact ties (small integer vectors), a code of 16
before the clamp, products too small to scale exactly, the clamped minimum
scale, and units across the integer path's range. The GPU tests check the
kernel's bytes against the CPU backend's."""

from __future__ import annotations

import numpy as np
import pytest

from kvcupy import reference

F32 = np.float32
MIN_SCALE = F32(1e-6)


def kernel_int4(f: np.ndarray, unit: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale word as float32) as quantize.cuh's Quantizer<kInt4> computes them for float(n) = f."""
    unit = F32(unit)
    lo, hi = f.min() * unit, f.max() * unit
    scale = np.maximum(F32(hi - lo) / F32(15), MIN_SCALE)
    zero_point = np.clip(reference.round_half_away(-lo / scale), 0, 15).astype(F32)
    code_scale = F32(F32(F32(1) / scale) * unit) * F32(0.0625)
    v = F32(F32(f * code_scale) + F32(zero_point * F32(0.0625))) + F32(0.03125)
    v = np.minimum(np.clip(v, F32(0), F32(1)), F32(0.9375))   # the saturating add, then 15 / 16
    word = (scale.view(np.uint32) & ~np.uint32(0xF)) | np.uint32(zero_point)
    return np.floor(v * F32(16)).astype(np.uint8), word.view(F32)


def kernel_int8(f: np.ndarray, unit: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale) as quantize.cuh's SymmetricQuantizer<kInt8> computes them."""
    unit = F32(unit)
    absmax = np.maximum(np.abs(f.min()), np.abs(f.max())) * unit
    scale = np.maximum(absmax / F32(127), MIN_SCALE)
    code_scale = F32(F32(1) / scale) * unit
    codes = np.clip(reference.round_half_away(f * code_scale), -128, 127)
    return codes.astype(np.int8), scale


def integer_vectors(rng) -> list[np.ndarray]:
    """float(n) vectors of 128 values: small integers (exact ties everywhere), spreads
    up to the integer path's 2^30, all-equal values, and one outlier far above the rest."""
    vectors = [np.arange(-1, 15, dtype=F32).repeat(8),          # scale 1, zero-point 1: ties
               np.arange(-7, 9, dtype=F32).repeat(8),
               np.arange(-1, 30, 2, dtype=F32).repeat(8),       # zero-point 0.5 away: v reaches 16
               np.resize(np.r_[np.arange(-253, 254, 4), 254], 128).astype(F32),   # int8: scale 2, ties
               np.full(128, 5, F32), np.full(128, -3, F32)]     # the minimum scale
    for bits in (4, 8, 12, 20, 24, 30):
        vectors.append(rng.integers(-2 ** bits + 1, 2 ** bits, 128).astype(F32))
        vectors.append(rng.integers(0, 2 ** bits, 128).astype(F32))
    spiky = rng.integers(-50, 50, 128).astype(F32)
    spiky[7] = F32(2 ** 29)
    vectors.append(spiky)
    return vectors


# The integer path's units run from 2^-126 to 2^106; the vector must stay finite.
UNITS = [2.0 ** e for e in (-126, -120, -100, -60, -30, -8, 0, 8, 30, 60, 90)]


QUANTIZERS = {"int4": (kernel_int4, reference.quantize_int4), "int8": (kernel_int8, reference.quantize_int8)}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: f"2^{int(np.log2(u))}")
@pytest.mark.parametrize("kv", QUANTIZERS)
def test_codes_and_scale_word_match_the_oracle(kv, unit):
    kernel, oracle = QUANTIZERS[kv]
    for f in integer_vectors(np.random.default_rng(4)):
        expected_codes, expected_scale = oracle(f * F32(unit))
        codes, scale = kernel(f, unit)
        assert np.array_equal(codes, expected_codes), (kv, f[:8], unit)
        assert np.asarray(scale, F32).view(np.uint32) == np.asarray(expected_scale, F32).view(np.uint32), (kv, unit)


def test_the_cases_reach_a_code_of_16_before_the_clamp():
    """The clamp at 15 matters: some value reaches v = 16 (its zero-point a tie rounded away)."""
    f = np.arange(-1, 30, 2, dtype=F32).repeat(8) * F32(0.5)
    lo, hi = f.min(), f.max()
    scale = np.maximum((hi - lo) / F32(15), MIN_SCALE)
    zero_point = np.clip(reference.round_half_away(-lo / scale), 0, 15)
    assert (F32(f * (F32(1) / scale)) + zero_point + F32(0.5) >= 16).any()
