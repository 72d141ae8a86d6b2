"""Attention over long contexts: no error that grows with the number of keys.

A bias common to every value channel in the rotated space (what an offset
left in the products and summed over every token leaves behind) comes out of
the inverse rotation in the first channel of each rotation block, and without
a rotation (int8) in every channel alike. It hides in the overall norm and in
peaked attention, whose output is large; flat attention over many keys, whose
output is small (about 1/sqrt(n) of a value for n keys), shows it. So each case
runs flat and peaked queries over 256 to 131072 keys and checks, per output
channel, the mean |error| and the signed mean error over the rows, both
relative to the oracle's RMS over every channel.

The model the bounds come from. The codes enter the products exactly, minus
their zero-point, so the fp32 accumulators sum terms p_j (c_j - z_j) of either
sign: their partial sums are random walks (about sqrt(k) terms' size after k
keys), and a rounding of each (at most 2^-23 of it, even when the hardware
truncates) over a split's n keys in n / 16 steps adds up to about
2^-23 sqrt(n / 32) of the output's own size: under 1e-5 at n = 131072. What
remains does not depend on n: the query and the probabilities enter as two
fp16 terms each (2^-22 relative), scores and the softmax in fp32, and the
output's rounding to the query's dtype (compared against the oracle rounded
the same way). Hence every channel's error must stay below 1e-3 at every
context, the signed mean likewise (a bias is no smaller than the magnitude it
makes), and, for float32 outputs (a 16-bit output's error is a few ulps
flipped by its rounding), the worst channel at the longest context within
GROWTH times its value at the shortest, plus FLOOR for cases where both are
near zero.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, reference
from kvcupy.formats import MODEL_DTYPES

SEQUENCES, KV_HEADS, GROUP, BLOCK_SIZE = 2, 2, 4, 16
CPU_CONTEXTS = (256, 4096, 32768)
GPU_CONTEXTS = (256, 4096, 32768, 131072)
QUERY_FACTORS = {"flat": 0.05, "peaked": 4.0}   # logits' spread about 0.1 and 7
QUERY_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(MODEL_DTYPES["bfloat16"]))
PREFILL_QUERY_TOKENS = 16   # x GROUP = 64 rows a KV head: the GPU's prefill kernel
BOUND = 1e-3
# A 16-bit output's own rounding: where the kernel's float32 result and the
# oracle fall on either side of a rounding boundary they differ by an ulp
# (2u relative, u the unit roundoff), a few rows of a channel at most.
OUTPUT_ROUNDING = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0 ** -11,
                   np.dtype(MODEL_DTYPES["bfloat16"]): 2.0 ** -8}
GROWTH, FLOOR = 4.0, 5e-5


@functools.lru_cache(maxsize=None)
def long_cache(kv_dtype: str, head_size: int, context: int):
    """A host cache of SEQUENCES x `context` tokens (bfloat16 keys with 4 outlier
    channels x 8, values N(0, 1)), written by the CPU backend: the bytes every
    backend writes (docs/format.md)."""
    rng = np.random.default_rng(context + head_size)
    pages = -(-context // BLOCK_SIZE)
    block_table = rng.permutation(SEQUENCES * pages).astype(np.int32).reshape(SEQUENCES, pages)
    positions = np.arange(context)
    slot_mapping = (block_table[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).reshape(-1)
    shape = (SEQUENCES * context, KV_HEADS, head_size)
    keys = rng.standard_normal(shape, dtype=np.float32)
    keys[..., :4] *= 8
    values = rng.standard_normal(shape, dtype=np.float32)
    bf16 = MODEL_DTYPES["bfloat16"]
    cache = kc.allocate_cache(SEQUENCES * pages, BLOCK_SIZE, KV_HEADS, head_size, kv_dtype, dtype="bfloat16")
    kc.reshape_and_cache(keys.astype(bf16), values.astype(bf16), cache, slot_mapping.astype(np.int64))
    return cache, block_table


def query_rows(head_size: int, query_tokens: int, factor: float) -> np.ndarray:
    """Queries N(0, 1) x factor, exact in every query dtype (bfloat16 values within
    float16's normal range)."""
    rng = np.random.default_rng(head_size)
    query = rng.standard_normal((SEQUENCES * query_tokens, KV_HEADS * GROUP, head_size), dtype=np.float32)
    query = np.where(np.abs(query) < 2.0 ** -6, np.float32(2.0 ** -6), query) * np.float32(factor)
    return query.astype(MODEL_DTYPES["bfloat16"]).astype(np.float32)


def batch_args(context: int, query_tokens: int) -> dict:
    return dict(seq_lens=np.full(SEQUENCES, context, np.int32),
                cu_seqlens_q=np.arange(SEQUENCES + 1, dtype=np.int32) * query_tokens)


@functools.lru_cache(maxsize=None)
def oracle(kv_dtype: str, head_size: int, context: int, attention: str, query_tokens: int) -> np.ndarray:
    cache, block_table = long_cache(kv_dtype, head_size, context)
    query = query_rows(head_size, query_tokens, QUERY_FACTORS[attention])
    return reference.paged_attention(query, cache, block_table=block_table, **batch_args(context, query_tokens))


def attend(backend: str, kv_dtype: str, head_size: int, context: int, attention: str, query_tokens: int,
           query_dtype: np.dtype) -> np.ndarray:
    cache, block_table = long_cache(kv_dtype, head_size, context)
    query = query_rows(head_size, query_tokens, QUERY_FACTORS[attention]).astype(query_dtype)
    args = dict(block_table=block_table, **batch_args(context, query_tokens))
    if backend == "cpu":
        return np.asarray(kc.paged_attention(query, cache, **args)).astype(np.float64)
    from ..device_arrays import device_query, device_view, from_device
    return from_device(kc.paged_attention(device_query(query), device_view(cache), **args), query_dtype)


def channel_errors(out: np.ndarray, want: np.ndarray, out_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per channel: mean |error| and signed mean error over the rows, over the RMS
    of every channel, against the oracle rounded to the output's dtype."""
    want = want.reshape(-1, want.shape[-1])
    error = out.reshape(want.shape) - want.astype(out_dtype).astype(np.float64)
    rms = np.sqrt(np.mean(want ** 2))
    return np.mean(np.abs(error), axis=0) / rms, np.mean(error, axis=0) / rms


BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("attention", sorted(QUERY_FACTORS))
@pytest.mark.parametrize("head_size", [96, 128])
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head"])
def test_the_error_per_channel_does_not_grow_with_the_context(backend, phase, query_dtype, attention, head_size,
                                                              kv_dtype):
    if backend == "cuda" and not backends.status("cuda").usable:
        pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}")
    contexts = GPU_CONTEXTS if backend == "cuda" else CPU_CONTEXTS
    query_tokens = 1 if phase == "decode" else PREFILL_QUERY_TOKENS
    bound = BOUND + OUTPUT_ROUNDING[query_dtype]
    worst = {}
    for context in contexts:
        case = f"{backend} {phase} {kv_dtype} d={head_size} {attention} {query_dtype.name} context={context}"
        out = attend(backend, kv_dtype, head_size, context, attention, query_tokens, query_dtype)
        mean_abs, signed = channel_errors(out, oracle(kv_dtype, head_size, context, attention, query_tokens),
                                          query_dtype)
        channel = int(np.argmax(mean_abs))
        assert mean_abs[channel] <= bound, f"{case}: channel {channel} mean |error| {mean_abs[channel]:.2e}"
        channel = int(np.argmax(np.abs(signed)))
        assert abs(signed[channel]) <= bound, f"{case}: channel {channel} signed mean error {signed[channel]:.2e}"
        worst[context] = float(mean_abs.max())
    if query_dtype != np.float32:
        return   # a 16-bit output's error is whole ulps flipped in rounding: no trend to read
    shortest, longest = contexts[0], contexts[-1]
    assert worst[longest] <= GROWTH * worst[shortest] + FLOOR, (
        f"{backend} {phase} {kv_dtype} d={head_size} {attention} {query_dtype.name}: the worst channel's error "
        f"grows from {worst[shortest]:.2e} ({shortest} keys) to {worst[longest]:.2e} ({longest} keys)")
