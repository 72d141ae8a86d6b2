"""Seeded synthetic attention inputs with the outlier channels that real keys have.

Keys: every channel is N(0, 1) except a few per KV head, which carry a large
offset shared by all tokens plus a wider spread. Real keys look like this: a
handful of channels per head sit far from zero, with magnitudes an order of
magnitude above the rest, for every token (KIVI, Liu et al. 2024, and
KVQuant, Hooper et al. 2024, quantize keys per channel for this reason).
Per-token quantization then spends its levels on the outliers' range, which
is what the Hadamard rotation repairs by spreading each outlier over a whole
block of channels.

Values: N(0, 1), no outlier channels (the same studies find none in values).

Queries: each query head looks for one earlier key (its target, drawn
uniformly from the positions it may see), so attention is peaked rather than
uniform: q = QUERY_GAIN * centred target key + N(0, 1). The key is centred
(the per-channel mean over tokens removed) because an offset shared by all
keys adds the same logit to every key and changes no attention weight.

Everything comes from one NumPy Generator seeded by `seed`, in a fixed order,
so a seed names one workload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OUTLIER_CHANNELS_PER_HEAD = 4
OUTLIER_OFFSET_RANGE = (10.0, 20.0)  # |offset|, in units of a normal channel's std
OUTLIER_SPREAD = 3.0                 # std of an outlier channel around its offset
# With head size 96 the target's logit stands about 6.5 above the others'
# mean (QUERY_GAIN * |centred k|^2 / sqrt(d), |centred k|^2 ~ 92 + 4 * 3^2),
# whose spread is about 1.5: attention is peaked, yet not one-hot.
QUERY_GAIN = 0.5


@dataclass(frozen=True)
class Workload:
    """Inputs for one sequence: token t has position t."""

    query: np.ndarray   # [T, num_heads, head_size] float32
    key: np.ndarray     # [T, num_kv_heads, head_size] model dtype
    value: np.ndarray   # [T, num_kv_heads, head_size] model dtype


def outlier_keys(rng: np.random.Generator, num_tokens: int, num_kv_heads: int,
                 head_size: int) -> np.ndarray:
    """float64 keys [T, Hk, d] with OUTLIER_CHANNELS_PER_HEAD outlier channels per head."""
    keys = rng.standard_normal((num_tokens, num_kv_heads, head_size))
    shape = (num_kv_heads, OUTLIER_CHANNELS_PER_HEAD)
    channels = rng.random((num_kv_heads, head_size)).argsort(axis=1)[:, :OUTLIER_CHANNELS_PER_HEAD]
    offsets = rng.uniform(*OUTLIER_OFFSET_RANGE, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    heads = np.arange(num_kv_heads)[:, None]
    keys[:, heads, channels] = keys[:, heads, channels] * OUTLIER_SPREAD + offsets
    return keys


def targeted_queries(rng: np.random.Generator, keys: np.ndarray, num_heads: int) -> np.ndarray:
    """float64 queries [T, Hq, d]; query head h reads KV head h // (Hq // Hk)."""
    num_tokens, num_kv_heads, head_size = keys.shape
    centred = keys - keys.mean(axis=0)
    kv_head = np.arange(num_heads) // (num_heads // num_kv_heads)
    # target[t, h] uniform in 0..t: the causal mask lets token t see positions 0..t.
    target = (rng.random((num_tokens, num_heads)) * (np.arange(num_tokens)[:, None] + 1)).astype(np.int64)
    noise = rng.standard_normal((num_tokens, num_heads, head_size))
    return QUERY_GAIN * centred[target, kv_head[None, :]] + noise


def make_workload(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                  seed: int, model_dtype=np.float16) -> Workload:
    rng = np.random.default_rng(seed)
    keys = outlier_keys(rng, num_tokens, num_kv_heads, head_size)
    values = rng.standard_normal((num_tokens, num_kv_heads, head_size))
    queries = targeted_queries(rng, keys, num_heads)
    return Workload(query=queries.astype(np.float32), key=keys.astype(model_dtype),
                    value=values.astype(model_dtype))
