"""Numba kernels of the CPU backend: rotation, quantization, paged attention.

Kernels see only NumPy arrays of plain dtypes; `cpu.py` prepares them.
Quantization runs in float32 without fast-math, in FORMAT.md's order, so its
bytes equal the oracle's. Attention uses fast-math reassociation so that LLVM
vectorises its dot products; its results then differ from the oracle only by
float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# Reassociation lets LLVM vectorise reductions; no nnan/ninf, since masked and
# sink logits may be infinite.
ATTENTION_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# How a stored row decodes (one code path per family, chosen per row, never per value).
DECODE_INT4 = 0     # packed nibbles, (code - zero_point) * scale'
DECODE_LINEAR = 1   # value * scale (int8, float32 "auto")
DECODE_TABLE = 2    # table[code] * scale (fp8, float16/bfloat16 "auto" read as uint16)

QUANT_INT4, QUANT_INT8, QUANT_FP8 = 0, 1, 2


# --- rotation -------------------------------------------------------------

@njit(cache=True, inline="always")
def _fwht_rows(buf, rows, pow2):
    """In-place unnormalised Walsh-Hadamard transform (Sylvester order) of each row."""
    for r in range(rows):
        base = r * pow2
        h = 1
        while h < pow2:
            for i in range(base, base + pow2, 2 * h):
                for j in range(i, i + h):
                    a = buf[j]
                    b = buf[j + h]
                    buf[j] = a + b
                    buf[j + h] = a - b
            h *= 2


@njit(parallel=True, cache=True)
def rotate_rows(x, out, signs, mix, use_mix, pow2, inverse, norm):
    """out[v] = H (s * x[v]) or s * (H^T x[v]) / norm, with H = mix (x) H_pow2.

    x, out: float32 [N, d]. Arithmetic in float64, rounded once to float32.
    """
    num_vectors, d = x.shape
    rows = d // pow2
    for v in prange(num_vectors):
        buf = np.empty(d, np.float64)
        for i in range(d):
            buf[i] = x[v, i] if inverse else x[v, i] * signs[i]
        _fwht_rows(buf, rows, pow2)
        if use_mix:
            mixed = np.zeros(d, np.float64)
            for r in range(rows):
                for a in range(rows):
                    weight = mix[a, r] if inverse else mix[r, a]
                    for j in range(pow2):
                        mixed[r * pow2 + j] += weight * buf[a * pow2 + j]
            buf = mixed
        for i in range(d):
            out[v, i] = buf[i] * signs[i] / norm if inverse else buf[i]


# --- quantization (float32, FORMAT.md's order, no fast-math) --------------

@njit(cache=True, inline="always")
def _round_half_away(v):
    # vLLM's rounding: add +-0.5 in float32, truncate toward zero.
    half = np.float32(0.5) if v >= 0 else np.float32(-0.5)
    return np.float32(np.trunc(np.float32(v + half)))


@njit(cache=True, inline="always")
def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


@njit(cache=True)
def float_to_e4m3fn(v):
    """Bits of e4m3fn(v): round to nearest even, saturating at +-448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(np.float64(v)), 448.0)
    if a < 2.0 ** -6:
        # Subnormal range, step 2^-9; a code of 8 is the smallest normal.
        return sign | int(np.rint(a * 512.0))
    mantissa, exponent = math.frexp(a)       # a = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent -= 1
    fraction = int(np.rint((mantissa * 2.0 - 1.0) * 8.0))
    if fraction == 8:
        exponent += 1
        fraction = 0
    return sign | ((exponent + 7) << 3) | fraction


@njit(parallel=True, cache=True)
def quantize_vectors(x, kind, codes, scales, zero_points):
    """Quantize each row of x (float32 [N, d]) into codes [N, d_stored] (uint8 or int8),
    scales [N] float32 and zero_points [N] (int4 only)."""
    num_vectors, d = x.shape
    min_scale = np.float32(1e-6)
    for v in prange(num_vectors):
        row = x[v]
        if kind == QUANT_INT4:
            lo = row[0]
            hi = row[0]
            for i in range(1, d):
                lo = min(lo, row[i])
                hi = max(hi, row[i])
            scale = max(np.float32(np.float32(hi - lo) / np.float32(15.0)), min_scale)
            zero_point = _clamp(_round_half_away(np.float32(-lo / scale)), np.float32(0), np.float32(15))
            inv_scale = np.float32(np.float32(1.0) / scale)
            for j in range(d // 2):
                q_even = _clamp(_round_half_away(np.float32(np.float32(row[2 * j] * inv_scale) + zero_point)),
                                np.float32(0), np.float32(15))
                q_odd = _clamp(_round_half_away(np.float32(np.float32(row[2 * j + 1] * inv_scale) + zero_point)),
                               np.float32(0), np.float32(15))
                codes[v, j] = int(q_even) | (int(q_odd) << 4)
            zero_points[v] = int(zero_point)
        else:
            absmax = np.float32(0.0)
            for i in range(d):
                absmax = max(absmax, abs(row[i]))
            limit = np.float32(127.0) if kind == QUANT_INT8 else np.float32(448.0)
            scale = max(np.float32(absmax / limit), min_scale)
            inv_scale = np.float32(np.float32(1.0) / scale)
            for i in range(d):
                scaled = np.float32(row[i] * inv_scale)
                if kind == QUANT_INT8:
                    codes[v, i] = int(_clamp(_round_half_away(scaled), np.float32(-128), np.float32(127)))
                else:
                    codes[v, i] = float_to_e4m3fn(scaled)
        scales[v] = scale


# --- attention ------------------------------------------------------------

# The inner loops below are separate functions, each compiled with fast-math,
# because LLVM vectorises them reliably there and not inside the parallel
# loop body (checked on the generated AVX2 code: vfmadd231ps, vcvtdq2ps).

@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _dot(a, b):
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _axpy(acc, weight, x):
    for i in range(acc.shape[0]):
        acc[i] += weight * x[i]


@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _unpack_int4(stored, low, high):
    # int32 arithmetic: Numba's default int64 cannot use AVX2's vcvtdq2ps.
    for j in range(stored.shape[0]):
        byte = np.int32(stored[j])
        low[j] = np.float32(np.int32(byte & np.int32(15)))
        high[j] = np.float32(np.int32(byte >> np.int32(4)))


@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _convert(stored, row):
    for i in range(row.shape[0]):
        row[i] = np.float32(stored[i])


@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _lookup(stored, table, row):
    for i in range(row.shape[0]):
        row[i] = table[np.int32(stored[i])]


@njit(cache=True, inline="always")
def _bits_to_float(bits):
    return np.uint32(bits).view(np.float32)


@njit(cache=True, inline="always")
def _decode_row(mode, data, scale_bits, has_scales, table, block, offset, head, row):
    """Fill row (float32 [d]) from one stored vector, in storage order; return
    (scale, zero_point) such that the vector is (row - zero_point) * scale.

    Leaving scale and zero-point to the caller lets it apply them once per
    score and once per probability instead of once per value. int4 rows come
    out de-interleaved (low nibbles, then high nibbles); the caller permutes
    the query and the output to match.
    """
    stored = data[block, offset, head]
    if mode == DECODE_INT4:
        bits = scale_bits[block, offset, head]
        half = row.shape[0] // 2
        _unpack_int4(stored, row[:half], row[half:])
        return _bits_to_float(bits & 0xFFFFFFF0), np.float32(bits & 0xF)
    if mode == DECODE_LINEAR:
        _convert(stored, row)
    else:
        _lookup(stored, table, row)
    scale = _bits_to_float(scale_bits[block, offset, head]) if has_scales else np.float32(1.0)
    return scale, np.float32(0.0)


@njit(cache=True, inline="always")
def _decode_tile(mode, data, scale_bits, has_scales, table, block_table, seq, first, count,
                 kv_head, rows, scales, zero_points):
    """Decode up to TILE rows starting at position `first`; missing rows get scale 0."""
    block_size = data.shape[1]
    for r in range(TILE):
        if r < count:
            pos = first + r
            block = block_table[seq, pos // block_size]
            scales[r], zero_points[r] = _decode_row(mode, data, scale_bits, has_scales, table,
                                                    block, pos % block_size, kv_head, rows[r])
        else:
            scales[r] = 0.0
            zero_points[r] = 0.0


@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _dot_tile(q, rows, dots):
    """dots[r] = q . rows[r] for the TILE rows, reading q once."""
    acc0 = acc1 = acc2 = acc3 = np.float32(0.0)
    for i in range(q.shape[0]):
        acc0 += q[i] * rows[0, i]
        acc1 += q[i] * rows[1, i]
        acc2 += q[i] * rows[2, i]
        acc3 += q[i] * rows[3, i]
    dots[0], dots[1], dots[2], dots[3] = acc0, acc1, acc2, acc3


@njit(fastmath=ATTENTION_FASTMATH, cache=True)
def _axpy_tile(acc, weights, rows):
    """acc += sum_r weights[r] * rows[r]: one load and store of acc per TILE rows."""
    w0, w1, w2, w3 = weights[0], weights[1], weights[2], weights[3]
    for i in range(acc.shape[0]):
        acc[i] += w0 * rows[0, i] + w1 * rows[1, i] + w2 * rows[2, i] + w3 * rows[3, i]


# Keys and values are decoded TILE rows at a time, so that each accumulator is
# loaded and stored once per TILE rows (the micro-kernels above are written for 4).
TILE = 4


@njit(parallel=True, fastmath=ATTENTION_FASTMATH, cache=True)
def paged_attention(query, key_data, value_data, k_scale_bits, v_scale_bits, has_scales,
                    mode, table, block_table, seq_lens, cu_seqlens_q, token_seq,
                    sliding_window, softcap, sinks, has_sinks, out):
    """Causal paged attention in the rotated, storage-ordered domain.

    query, out: float32 [T, Hq, d]; query is already rotated, permuted to
    storage order and multiplied by softmax_scale / rotation norm.
    One work item is (query token, KV head): it serves the whole GQA group,
    so each K/V row is decoded once for all query heads that read it.
    """
    num_tokens, num_heads, d = query.shape
    num_kv_heads = key_data.shape[2]
    group = num_heads // num_kv_heads
    for item in prange(num_tokens * num_kv_heads):
        token = item // num_kv_heads
        kv_head = item % num_kv_heads
        heads = query[token, kv_head * group:(kv_head + 1) * group]
        seq = token_seq[token]
        position = seq_lens[seq] - cu_seqlens_q[seq + 1] + token
        first = 0 if sliding_window <= 0 else max(0, position - sliding_window + 1)
        count = position - first + 1

        rows = np.zeros((TILE, d), np.float32)
        tile_scales = np.empty(TILE, np.float32)
        tile_zero_points = np.empty(TILE, np.float32)
        dots = np.empty(TILE, np.float32)
        scores = np.empty((group, count + TILE), np.float32)   # room for a partial last tile
        query_sums = np.empty(group, np.float32)
        for g in range(group):
            query_sums[g] = np.sum(heads[g])

        for j in range(0, count, TILE):
            _decode_tile(mode, key_data, k_scale_bits, has_scales, table, block_table, seq,
                         first + j, count - j, kv_head, rows, tile_scales, tile_zero_points)
            for g in range(group):
                _dot_tile(heads[g], rows, dots)
                for r in range(TILE):
                    # q.k = scale * (q.row - zero_point * sum(q))
                    scores[g, j + r] = tile_scales[r] * (dots[r] - tile_zero_points[r] * query_sums[g])

        denominator = np.empty(group, np.float32)
        for g in range(group):
            logits = scores[g, :count]
            if softcap > 0:
                for j in range(count):
                    logits[j] = softcap * np.tanh(logits[j] / softcap)
            top = np.max(logits)
            if has_sinks:
                top = max(top, sinks[kv_head * group + g])
            total = np.float32(0.0)
            for j in range(count):
                logits[j] = np.exp(logits[j] - top)
                total += logits[j]
            if has_sinks:
                total += np.exp(sinks[kv_head * group + g] - top)   # mass without a value
            denominator[g] = total

        acc_out = np.zeros((group, d), np.float32)
        zero_point_mass = np.zeros(group, np.float32)
        weights = np.empty(TILE, np.float32)
        for j in range(0, count, TILE):
            _decode_tile(mode, value_data, v_scale_bits, has_scales, table, block_table, seq,
                         first + j, count - j, kv_head, rows, tile_scales, tile_zero_points)
            for g in range(group):
                # p * v = (p * scale) * row - p * scale * zero_point; missing rows have scale 0
                for r in range(TILE):
                    weights[r] = scores[g, j + r] * tile_scales[r]
                    zero_point_mass[g] += weights[r] * tile_zero_points[r]
                _axpy_tile(acc_out[g], weights, rows)
        for g in range(group):
            inv = np.float32(1.0) / denominator[g]
            for i in range(d):
                out[token, kv_head * group + g, i] = (acc_out[g, i] - zero_point_mass[g]) * inv
