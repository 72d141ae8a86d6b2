"""The bounds `kvcupy repro` checks against, each with the reason for its size."""

from __future__ import annotations

import numpy as np

from kvcupy import formats, reference
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
# 1e-5 is the project's bound for the CPU backend against the oracle.
IMPL_BOUND = 1e-5

# The CUDA backend's products take the probabilities rounded to fp16 (relative
# error 2^-11 each, ~4.9e-4; tests/gpu/test_attention.py derives the bound),
# so its implementation error is held to 2e-3 instead.
GPU_IMPL_BOUND = 2e-3


def impl_bound(backend: str) -> float:
    return IMPL_BOUND if backend == "cpu" else GPU_IMPL_BOUND



def format_resolution(x: np.ndarray, kv_dtype: str, plan: RotationPlan,
                      model_dtype: np.dtype) -> float:
    """||largest rounding error the KV dtype allows|| / ||vectors||, on the vectors
    as the cache stores them (rotated). For int4 this is half the quantization step
    (max - min) / 15 of each vector: outlier channels widen that range, and the
    rotation narrows it by spreading them."""
    rotated = reference.rotate_for_cache(x, plan).astype(np.float64)
    half_steps = formats.kv_dtype_info(kv_dtype).half_steps(rotated, model_dtype)
    return float(np.linalg.norm(half_steps) / np.linalg.norm(rotated))


def attention_bound(key_resolution: float, value_resolution: float, impl: float = IMPL_BOUND) -> float:
    """Bound on attention's relative error against float64 attention on the original K/V.

    To first order, V's rounding reaches the output as a weighted mean of
    per-token errors, so at most V's relative resolution; K's rounding moves
    each logit by softmax_scale * q.dK, which shifts weight between keys by a
    comparable relative amount. Measured on repro's workload, the error is
    0.35 to 0.62 of key + value resolution for every KV dtype and rotation at
    head size 96 (seed 0, default lengths), and at most 0.68 for head sizes 64
    to 256: the bound has about 1.5x headroom, while a cache that rounds to the
    wrong level or loses a scale or zero-point exceeds it. `impl` (the backend's
    implementation bound) covers the arithmetic where the format itself is
    exact (auto, no rotation).
    """
    return key_resolution + value_resolution + impl
