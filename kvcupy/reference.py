"""The float64 NumPy oracle: every operation of docs/format.md, slow and obviously right.

Rotation and attention run in float64. Quantization runs in float32 exactly
as docs/format.md writes it, so that the bytes it produces are the bytes every
backend must produce. Nothing here is fast; everything here is checkable by
reading it next to docs/format.md.
"""

from __future__ import annotations

import numpy as np

from . import formats
from .formats import FP8_DTYPE, FP8_MAX, INT4_LEVELS, INT8_MAX, MIN_SCALE, NONFINITE_SCALE_BITS
from .rotation import RotationPlan


# --- rotation -------------------------------------------------------------

def rotate(x: np.ndarray, plan: RotationPlan, inverse: bool = False) -> np.ndarray:
    """y = H (s * x), or its inverse x = s * (H^T y) / norm, over the last axis, float64.

    Each block of plan.block channels is its own product, as docs/format.md splits
    the vector: one dense d x d product would carry a NaN of one block into the
    others through the matrix's zeros between blocks (0 * NaN is NaN).
    """
    x = np.asarray(x, dtype=np.float64)
    matrix, signs = plan.matrix()[:plan.block, :plan.block], plan.sign_vector()
    blocks = x.shape[:-1] + (plan.blocks, plan.block)
    if inverse:
        return (x.reshape(blocks) @ matrix).reshape(x.shape) * signs / plan.norm
    return ((x * signs).reshape(blocks) @ matrix.T).reshape(x.shape)


def rotate_for_cache(x: np.ndarray, plan: RotationPlan | None) -> np.ndarray:
    """The float32 vector that gets quantized: rotated in float64, rounded to float32,
    and for the vllm preset rounded to the input dtype first (docs/format.md)."""
    rotated = x if plan is None or plan.is_identity else rotate(x, plan)
    rotated = np.asarray(rotated)
    if plan is not None and plan.rounds_to_input_dtype and x.dtype != np.float32:
        rotated = rotated.astype(x.dtype)
    return rotated.astype(np.float32)


# --- quantization (float32, in docs/format.md's order) ------------------------

def round_half_away(v: np.ndarray) -> np.ndarray:
    """vLLM's rounding: add +-0.5 in float32, then truncate toward zero."""
    v = np.asarray(v, np.float32)
    return np.trunc(v + np.copysign(np.float32(0.5), v))


# docs/format.md, non-finite input: a vector holding a NaN or +-inf is stored as
# codes 0 and formats.NONFINITE_SCALE_BITS (a quiet NaN) as its scale word, so
# that every reader sees a NaN scale and attention over it is NaN, never a
# finite, plausible entry. Its low four bits are 0: as an int4 scale word it is
# zero-point 0, and still this NaN.


def _split_nonfinite(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x with its non-finite vectors zeroed, which vectors those were): the
    quantizers below then run on finite numbers only."""
    x = np.asarray(x, np.float32)
    nonfinite = ~np.isfinite(x).all(axis=-1)
    if nonfinite.any():
        x = np.where(nonfinite[..., None], np.float32(0), x)
    return x, nonfinite


def _mark_nonfinite(codes: np.ndarray, scale: np.ndarray, nonfinite: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Codes 0 and scale word NONFINITE_SCALE_BITS for the non-finite vectors."""
    if not nonfinite.any():
        return codes, scale
    nan_scale = np.array(NONFINITE_SCALE_BITS, np.uint32).view(np.float32)
    codes = np.where(nonfinite[..., None], np.zeros((), codes.dtype), codes)
    return codes, np.where(nonfinite, nan_scale, np.asarray(scale, np.float32))


def quantize_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes 0..15 of each vector (last axis) and its encoded float32 scale."""
    x, nonfinite = _split_nonfinite(x)
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    scale = np.maximum((hi - lo) / np.float32(INT4_LEVELS), MIN_SCALE)
    zero_point = np.clip(round_half_away(-lo / scale), 0, INT4_LEVELS)
    inv_scale = (np.float32(1) / scale)[..., None]
    codes = np.clip(round_half_away(x * inv_scale + zero_point[..., None]), 0, INT4_LEVELS)
    return _mark_nonfinite(codes.astype(np.uint8), formats.encode_int4_scale(scale, zero_point), nonfinite)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, nonfinite = _split_nonfinite(x)
    scale = np.maximum(np.abs(x).max(axis=-1) / np.float32(INT8_MAX), MIN_SCALE)
    inv_scale = (np.float32(1) / scale)[..., None]
    codes = np.clip(round_half_away(x * inv_scale), -128, 127)
    return _mark_nonfinite(codes.astype(np.int8), scale, nonfinite)


def quantize_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, nonfinite = _split_nonfinite(x)
    scale = np.maximum(np.abs(x).max(axis=-1) / np.float32(FP8_MAX), MIN_SCALE)
    inv_scale = (np.float32(1) / scale)[..., None]
    # Clipping first makes the conversion saturate instead of overflowing to NaN.
    values = np.clip(x * inv_scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return _mark_nonfinite(values.view(np.uint8), scale, nonfinite)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Byte j = code[2j] | code[2j+1] << 4 (even element in the low nibble)."""
    codes = np.asarray(codes, np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def encode(x: np.ndarray, kv_dtype: str, plan: RotationPlan | None,
           cache_dtype: np.dtype | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Vectors [..., d] (model dtype) -> (stored values, float32 scales or None)."""
    rotated = rotate_for_cache(x, plan)
    if kv_dtype == "int4_per_token_head":
        codes, scale = quantize_int4(rotated)
        return pack_int4(codes), scale
    if kv_dtype == "int8_per_token_head":
        return quantize_int8(rotated)
    if kv_dtype == "fp8_per_token_head":
        return quantize_fp8(rotated)
    if kv_dtype == "auto":
        return rotated.astype(cache_dtype), None
    raise ValueError(f"kv_dtype={kv_dtype!r} is not a KV dtype")


def decode(stored: np.ndarray, scale: np.ndarray | None, kv_dtype: str) -> np.ndarray:
    """Stored values -> float64 vectors in the rotated domain."""
    if kv_dtype == "int4_per_token_head":
        step, zero_point = formats.decode_int4_scale(scale)
        codes = unpack_int4(stored).astype(np.float64)
        return (codes - zero_point[..., None]) * step[..., None].astype(np.float64)
    if kv_dtype == "int8_per_token_head":
        return stored.astype(np.float64) * np.asarray(scale, np.float64)[..., None]
    if kv_dtype == "fp8_per_token_head":
        values = np.asarray(stored, np.uint8).view(FP8_DTYPE).astype(np.float64)
        return values * np.asarray(scale, np.float64)[..., None]
    if kv_dtype == "auto":
        return np.asarray(stored).astype(np.float64)
    raise ValueError(f"kv_dtype={kv_dtype!r} is not a KV dtype")


def decode_original(stored, scale, kv_dtype: str, plan: RotationPlan | None) -> np.ndarray:
    """Stored values -> float64 vectors in the model's own (unrotated) domain."""
    values = decode(stored, scale, kv_dtype)
    return values if plan is None or plan.is_identity else rotate(values, plan, inverse=True)


# --- paged cache ----------------------------------------------------------

def reshape_and_cache(key, value, cache, slot_mapping) -> None:
    """Quantize key/value [T, Hk, d] and write token t to slot slot_mapping[t] (< 0: skip)."""
    cache_dtype = cache.key_cache.dtype
    for x, data, scales in ((key, cache.key_cache, cache.k_scale_cache),
                            (value, cache.value_cache, cache.v_scale_cache)):
        stored, scale = encode(np.asarray(x), cache.kv_dtype, cache.rotation, cache_dtype)
        for token, slot in enumerate(np.asarray(slot_mapping)):
            if slot < 0:
                continue
            block, offset = divmod(int(slot), cache.block_size)
            data[block, offset] = stored[token].view(data.dtype)
            if scales is not None:
                scales[block, offset] = scale[token]


def gather_sequence(cache, block_table_row: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 keys and values [seq_len, Hk, d] of one sequence, unrotated."""
    positions = np.arange(seq_len)
    blocks = np.asarray(block_table_row)[positions // cache.block_size]
    offsets = positions % cache.block_size

    def read(data, scales):
        scale = None if scales is None else scales[blocks, offsets]
        return decode_original(data[blocks, offsets], scale, cache.kv_dtype, cache.rotation)

    return read(cache.key_cache, cache.k_scale_cache), read(cache.value_cache, cache.v_scale_cache)


def attend(query: np.ndarray, keys: np.ndarray, values: np.ndarray, *, softmax_scale: float,
           sliding_window: int | None = None, softcap: float = 0.0,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of one sequence's new tokens, float64.

    query [Lq, Hq, d] are the last Lq positions of a sequence whose keys and
    values [L, Hk, d] are all given.
    """
    query = np.asarray(query, np.float64)
    num_queries, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = np.repeat(keys, group, axis=1)       # query head h reads KV head h // group
    values = np.repeat(values, group, axis=1)

    scores = softmax_scale * np.einsum("qhd,khd->hqk", query, keys, optimize=True)
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    query_pos = seq_len - num_queries + np.arange(num_queries)[:, None]
    key_pos = np.arange(seq_len)[None, :]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    scores = np.where(visible[None], scores, -np.inf)

    peak = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[:, None, None]
        peak = np.maximum(peak, sink)
    weights = np.exp(scores - peak)
    denominator = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + np.exp(sink - peak)   # the sink adds mass, no value
    probs = weights / denominator
    return seen_sums(probs, values, visible)


def seen_sums(probs: np.ndarray, values: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """out[q, h] = sum over the keys k that query q sees of probs[h, q, k] values[k, h]:
    probs [Hq, Lq, L], values [L, Hq, d], visible [Lq, L] -> [Lq, Hq, d] float64.

    A hidden key's weight is 0, but 0 * NaN is NaN, and a NaN value a query does
    not attend must not reach it. Where every value is finite a hidden key's zero
    adds exactly nothing, and one batched product serves every query; otherwise
    each query sums over the values it sees (seen_sums_by_query)."""
    if not np.isfinite(values).all():
        return seen_sums_by_query(probs, values, visible)
    seen_probs = np.where(visible[None], probs, 0.0)
    return np.ascontiguousarray(np.matmul(seen_probs, values.transpose(1, 0, 2)).transpose(1, 0, 2))


def seen_sums_by_query(probs: np.ndarray, values: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """seen_sums, a query at a time over the values it sees (gathering them once a
    query: for long contexts, seconds of copies)."""
    out = np.empty((probs.shape[1], probs.shape[0], values.shape[-1]))
    for i in range(probs.shape[1]):
        seen = visible[i]
        out[i] = np.einsum("hk,khd->hd", probs[:, i, seen], values[seen], optimize=True)
    return out


def paged_attention(query, cache, *, block_table, seq_lens, cu_seqlens_q=None,
                    softmax_scale=None, sliding_window=None, softcap=0.0,
                    sinks=None) -> np.ndarray:
    """Attention of every sequence's new tokens over the paged cache, float64 [T, Hq, d]."""
    query = np.asarray(query)
    seq_lens = np.asarray(seq_lens)
    if cu_seqlens_q is None:
        cu_seqlens_q = np.arange(len(seq_lens) + 1)
    if softmax_scale is None:
        softmax_scale = 1.0 / np.sqrt(query.shape[-1])
    out = np.zeros(query.shape, np.float64)
    for seq, seq_len in enumerate(seq_lens):
        start, end = int(cu_seqlens_q[seq]), int(cu_seqlens_q[seq + 1])
        if end == start:
            continue
        keys, values = gather_sequence(cache, block_table[seq], int(seq_len))
        out[start:end] = attend(query[start:end], keys, values, softmax_scale=softmax_scale,
                                sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    return out
