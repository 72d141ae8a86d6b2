"""The bounds `kvcupy repro` checks against, each with the reason for its size."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvcupy import reference
from kvcupy.formats import FP8_MAX, INT4_LEVELS, INT8_MAX
from kvcupy.rotation import RotationPlan

# Rotate, then rotate back, in float32. The CPU backend transforms in float64
# and rounds to float32 once each way: about two float32 roundings, 2 * 2^-24
# ~ 1.2e-7 relative (measured on repro's keys, head size 96: 7e-9 blockdiag,
# 1.6e-8 kron; float16 inputs make most sums exact). A float32 butterfly on a
# GPU rounds once per stage, log2(256) = 8 stages at most. 1e-6 covers both and
# still catches a wrong sign or norm, which costs an error of order 1.
ROUNDTRIP_BOUND = 1e-6

# The implementation against the float64 oracle reading the same cache. Both
# see identical stored values, so only float32 arithmetic separates them: dot
# products over d <= 256 channels and softmax sums over the keys, whose
# rounding grows like sqrt(n) * 2^-24 (~1.4e-6 for 544 keys). Measured on
# repro (head size 96, 544 tokens): 3.2e-7 to 3.5e-7 for every KV dtype.
# 1e-5 is DESIGN.md's bound for every backend against the oracle.
IMPL_BOUND = 1e-5

# Half an e4m3fn ulp, relative: 3 mantissa bits. Below the smallest normal
# (2^-6) the step is the subnormal one, 2^-9, so the absolute error is 2^-10.
FP8_HALF_ULP = 2.0 ** -4
FP8_SUBNORMAL_HALF_STEP = 2.0 ** -10


def _half_steps(rotated: np.ndarray, kv_dtype: str, model_dtype: np.dtype) -> np.ndarray:
    """The largest rounding error docs/format.md allows on each value the cache stores
    (rotated: [..., d] float64, the vectors before quantization; same shape)."""
    if kv_dtype == "int4_per_token_head":
        step = (rotated.max(axis=-1) - rotated.min(axis=-1)) / INT4_LEVELS
        return np.broadcast_to(step[..., None] / 2, rotated.shape)
    if kv_dtype == "int8_per_token_head":
        step = np.abs(rotated).max(axis=-1) / INT8_MAX
        return np.broadcast_to(step[..., None] / 2, rotated.shape)
    if kv_dtype == "fp8_per_token_head":
        scale = np.abs(rotated).max(axis=-1, keepdims=True) / FP8_MAX
        return np.maximum(np.abs(rotated) * FP8_HALF_ULP, scale * FP8_SUBNORMAL_HALF_STEP)
    # auto: the model dtype's own rounding (ml_dtypes.finfo also knows bfloat16)
    return np.abs(rotated) * float(ml_dtypes.finfo(model_dtype).eps) / 2


def format_resolution(x: np.ndarray, kv_dtype: str, plan: RotationPlan,
                      model_dtype: np.dtype) -> float:
    """||largest rounding error the KV dtype allows|| / ||vectors||, on the vectors
    as the cache stores them (rotated). For int4 this is half the quantization step
    (max - min) / 15 of each vector: outlier channels widen that range, and the
    rotation narrows it by spreading them."""
    rotated = reference.rotate_for_cache(x, plan).astype(np.float64)
    return float(np.linalg.norm(_half_steps(rotated, kv_dtype, model_dtype)) / np.linalg.norm(rotated))


def attention_bound(key_resolution: float, value_resolution: float) -> float:
    """Bound on attention's relative error against float64 attention on the original K/V.

    To first order, V's rounding reaches the output as a weighted mean of
    per-token errors, so at most V's relative resolution; K's rounding moves
    each logit by softmax_scale * q.dK, which shifts weight between keys by a
    comparable relative amount. Measured on repro's workload, the error is
    0.35 to 0.62 of key + value resolution for every KV dtype and rotation at
    head size 96 (seed 0, default lengths), and at most 0.68 for head sizes 64
    to 256: the bound has about 1.5x headroom, while a cache that rounds to the
    wrong level or loses a scale or zero-point exceeds it. IMPL_BOUND covers
    float32 arithmetic where the format itself is exact (auto, no rotation).
    """
    return key_resolution + value_resolution + IMPL_BOUND
