"""Numba kernels of the CPU backend: rotation, quantization, paged attention.

Kernels see only NumPy arrays of plain dtypes; `cpu.py` prepares them.
Quantization runs in float32 without fast-math, in docs/format.md's order, so its
bytes equal the oracle's. Attention uses fast-math reassociation so that LLVM
vectorises its dot products; its results then differ from the oracle only by
float32 rounding.
"""

from __future__ import annotations

import math
import os
import tempfile

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .. import formats
from ..formats import FP8_MAX, INT4_LEVELS, INT8_MAX, MIN_SCALE, NONFINITE_SCALE_BITS, ZERO_POINT_MASK
from ..jit import cache_dir
from . import cpu_simd


def _writable_cache_dir() -> str | None:
    """Where Numba keeps these kernels' machine code: $NUMBA_CACHE_DIR when set (Numba's own
    setting), else numba-<version>/ under kvcupy's cache root (jit.cache_dir(): $KVCUPY_CACHE_DIR,
    else the user's cache folder); None when that folder cannot be written."""
    folder = numba.config.CACHE_DIR or os.path.join(cache_dir(), f"numba-{numba.__version__}")
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return None
    return folder


CACHE_DIR = _writable_cache_dir()


def cached_njit(**options):
    """numba.njit(**options) whose compiled code is kept in CACHE_DIR across processes.

    Never beside this file, where Numba's own `cache=True` writes: in an installed
    package that is site-packages, and files pip did not install there outlive an
    uninstall and shadow the next install of kvcupy. Without a writable CACHE_DIR
    the kernels compile in each process instead.
    """
    def decorate(function):
        if CACHE_DIR is None:
            return njit(**options)(function)
        # Numba reads CACHE_DIR once per function, here, as it picks where to cache it;
        # set for that moment only, so that other Numba users in the process see no change.
        user_setting = numba.config.CACHE_DIR
        numba.config.CACHE_DIR = CACHE_DIR
        try:
            return njit(cache=True, **options)(function)
        finally:
            numba.config.CACHE_DIR = user_setting
    return decorate

# Reassociation lets LLVM vectorise reductions; no nnan/ninf, since masked and
# sink logits may be infinite.
ATTENTION_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# How a stored row decodes (one code path per storage type, chosen per chunk, never per value).
DECODE_INT4 = 0     # packed nibbles, (code - zero_point) * scale'
DECODE_LINEAR = 1   # value * scale (float32 "auto")
DECODE_FP8 = 2      # e4m3fn bits * scale
DECODE_FP16 = 3     # float16 "auto", read as uint16 bits
DECODE_BF16 = 4     # bfloat16 "auto", read as uint16 bits
DECODE_INT8 = 5     # int8 codes * scale, read as uint8 bits

# quantize_vectors' kinds: the format table's kernel ids.
QUANT_INT4, QUANT_INT8, QUANT_FP8 = (formats.KV_DTYPES[name].kernel_id for name in formats.QUANTIZED_KV_DTYPES)


# --- rotation -------------------------------------------------------------

@cached_njit(inline="always")
def _fwht_rows(buf, rows, pow2):
    """In-place unnormalised Walsh-Hadamard transform (Sylvester order) of each row."""
    for r in range(rows):
        base = r * pow2
        h = 1
        if pow2 >= 4:
            # Stages h = 1 and 2 as one radix-4 butterfly: the same additions in
            # the same order, without the radix-2 loops' one- and two-long inner loops.
            for i in range(base, base + pow2, 4):
                a = buf[i] + buf[i + 1]
                b = buf[i] - buf[i + 1]
                c = buf[i + 2] + buf[i + 3]
                e = buf[i + 2] - buf[i + 3]
                buf[i] = a + c
                buf[i + 1] = b + e
                buf[i + 2] = a - c
                buf[i + 3] = b - e
            h = 4
        while h < pow2:
            for i in range(base, base + pow2, 2 * h):
                for j in range(i, i + h):
                    a = buf[j]
                    b = buf[j + h]
                    buf[j] = a + b
                    buf[j + h] = a - b
            h *= 2


@cached_njit(parallel=True)
def rotate_rows(x, out, signs, mix, use_mix, pow2, inverse, divisor, read_order, write_order):
    """out[v, k] = y[write_order[k]] / divisor, y = H (s * x'[v]) or s * (H^T x'[v]),
    x'[v, i] = x[v, read_order[i]], H = mix (x) H_pow2.

    x, out: float32 [N, d]. Arithmetic in float64, rounded once to float32.
    The orders let attention read and write the int4 storage order, and
    divisor fold in the norm and softmax scale, in the same pass.
    """
    num_vectors, d = x.shape
    rows = d // pow2
    for v in prange(num_vectors):
        buf = np.empty(d, np.float64)
        for i in range(d):
            value = np.float64(x[v, read_order[i]])
            buf[i] = value if inverse else value * signs[i]
        _fwht_rows(buf, rows, pow2)
        if use_mix:
            mixed = np.zeros(d, np.float64)
            for r in range(rows):
                for a in range(rows):
                    weight = mix[a, r] if inverse else mix[r, a]
                    for j in range(pow2):
                        mixed[r * pow2 + j] += weight * buf[a * pow2 + j]
            buf = mixed
        if inverse:
            for i in range(d):
                buf[i] *= signs[i]
        for k in range(d):
            out[v, k] = buf[write_order[k]] / divisor


# --- quantization (float32, docs/format.md's order, no fast-math) --------------

@cached_njit(inline="always")
def _round_half_away(v):
    # vLLM's rounding: add +-0.5 in float32, truncate toward zero.
    half = np.float32(0.5) if v >= 0 else np.float32(-0.5)
    return np.float32(np.trunc(np.float32(v + half)))


@cached_njit(inline="always")
def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


@cached_njit()
def float_to_e4m3fn(v):
    """Bits of e4m3fn(v): round to nearest even, saturating at +-448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(np.float64(v)), FP8_MAX)
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



@cached_njit(inline="always")
def _all_finite(row):
    """No value of the float32 row has its exponent bits all ones (inf or NaN).

    An integer max vectorises, so the check costs the quantizers next to
    nothing; an early exit at the first non-finite value would not vectorise.
    """
    top = np.int32(0)
    for i in range(row.shape[0]):
        top = max(top, np.int32(np.float32(row[i]).view(np.int32) & np.int32(0x7F800000)))
    return top != np.int32(0x7F800000)


@cached_njit(parallel=True)
def quantize_vectors(x, kind, codes, scales, zero_points):
    """Quantize each row of x (float32 [N, d]) into codes [N, d_stored] (uint8 or int8),
    scales [N] float32 and zero_points [N] (int4 only)."""
    num_vectors, d = x.shape
    min_scale = np.float32(MIN_SCALE)
    for v in prange(num_vectors):
        row = x[v]
        if not _all_finite(row):
            # Checked first: min, max and the clamps below would turn a NaN into a finite code.
            for j in range(codes.shape[1]):
                codes[v, j] = 0
            zero_points[v] = 0
            scale = np.uint32(NONFINITE_SCALE_BITS).view(np.float32)
        elif kind == QUANT_INT4:
            lo = row[0]
            hi = row[0]
            for i in range(1, d):
                lo = min(lo, row[i])
                hi = max(hi, row[i])
            scale = max(np.float32(np.float32(hi - lo) / np.float32(INT4_LEVELS)), min_scale)
            zero_point = _clamp(_round_half_away(np.float32(-lo / scale)), np.float32(0), np.float32(INT4_LEVELS))
            inv_scale = np.float32(np.float32(1.0) / scale)
            for j in range(d // 2):
                q_even = _clamp(_round_half_away(np.float32(np.float32(row[2 * j] * inv_scale) + zero_point)),
                                np.float32(0), np.float32(INT4_LEVELS))
                q_odd = _clamp(_round_half_away(np.float32(np.float32(row[2 * j + 1] * inv_scale) + zero_point)),
                               np.float32(0), np.float32(INT4_LEVELS))
                codes[v, j] = int(q_even) | (int(q_odd) << 4)
            zero_points[v] = int(zero_point)
        else:
            absmax = np.float32(0.0)
            for i in range(d):
                absmax = max(absmax, abs(row[i]))
            limit = np.float32(INT8_MAX) if kind == QUANT_INT8 else np.float32(FP8_MAX)
            scale = max(np.float32(absmax / limit), min_scale)
            inv_scale = np.float32(np.float32(1.0) / scale)
            for i in range(d):
                scaled = np.float32(row[i] * inv_scale)
                if kind == QUANT_INT8:
                    codes[v, i] = int(_clamp(_round_half_away(scaled), np.float32(-INT8_MAX - 1), np.float32(INT8_MAX)))
                else:
                    codes[v, i] = float_to_e4m3fn(scaled)
        scales[v] = scale


# --- attention ------------------------------------------------------------

@intrinsic
def _fetch_add(typingctx, counter, increment):
    """Atomically add `increment` to counter[0] (int64) and return its previous value.

    Numba offers no atomic operations on the CPU; this is LLVM's atomicrmw,
    sequentially consistent, as C11's atomic_fetch_add.
    """
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None
    signature = types.int64(counter, types.int64)

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        delta = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.atomic_rmw("add", array.data, delta, "seq_cst")

    return signature, codegen


def _make_prefetch_line(locality: int):
    """Intrinsic prefetch(data, block, row, head, element): hint that the cache line
    holding data[block, row, head, element] (a 4-D cache) will be read soon.
    LLVM's prefetch, for reading, with its locality hint: 3 = into every cache
    level (prefetcht0), 2 = into L2 and beyond (prefetcht1)."""
    @intrinsic
    def prefetch_line(typingctx, data, block, row, head, element):
        if not (isinstance(data, types.Array) and data.ndim == 4):
            return None
        signature = types.void(data, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, args[0])
            indices = [context.cast(builder, value, fromty, types.intp)
                       for value, fromty in zip(args[1:], sig.args[1:])]
            pointer = cgutils.get_item_pointer(context, builder, sig.args[0], array, indices, wraparound=False)
            byte_pointer = ir.IntType(8).as_pointer()
            int32 = ir.IntType(32)
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]),
                "llvm.prefetch.p0i8")
            builder.call(prefetch, [builder.bitcast(pointer, byte_pointer), int32(0), int32(locality), int32(1)])
            return context.get_dummy_value()

        return signature, codegen

    return prefetch_line


_prefetch_line = _make_prefetch_line(3)
# For cpu_simd's loops, which read rows straight from the cache: for them a
# prefetch into L2 pays better than into L1, the buffer path's choice.
_prefetch_line_to_l2 = _make_prefetch_line(2)


# The buffer path (every format but int4, and fp16 / bf16 without scales, with
# d a multiple of 16, which cpu_simd's loops take): a work item walks its
# rows, per KV head, in chunks of at most CHUNK rows of one block (one
# block_table lookup each), decodes a chunk into a float32 scratch buffer that
# stays in L1, and consumes that in tiles of two jobs of TILE rows: two query
# heads over the same rows (each row vector loaded serves both), or, for the
# last head of an odd group, one head over two row tiles. Either way a tile
# has 8 independent FMA chains, what two FMA units of latency 4 need to stay
# busy.
#
# Every inner loop lives in a fast-math function other than the parallel loop
# body, where LLVM vectorises it reliably (vfmadd231ps, vcvtdq2ps on ymm). The
# functions take whole arrays plus indices, never per-row views, and the ones
# the parallel body calls update no reference counts: for an array that all
# threads share, that is a contended atomic operation. The innermost index of
# each vectorised access is the loop variable itself; an index such as
# half + i, which LLVM cannot prove non-negative, makes it fall back to scalar
# code.
CHUNK = 16
TILE = 4   # rows per job: the tile functions below are written out for 4


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _unpack_int4(data, block, offset, n, head, zero_points, nibbles):
    """nibbles[r, 0] = low nibbles, nibbles[r, 1] = high nibbles of stored row
    offset + r, each minus the row's zero-point.

    Subtracting the zero-point here, not as one correction at the end, keeps
    the value accumulator a sum of centred terms: a sum of raw codes (mean
    ~7.5 steps) minus their zero-point mass cancels to a result ~100x smaller
    over thousands of tokens, and loses that factor in float32 precision.
    """
    for r in range(n):
        zero_point = zero_points[r]
        for j in range(nibbles.shape[2]):
            # int32 arithmetic: Numba's default int64 cannot use AVX2's vcvtdq2ps.
            byte = np.int32(data[block, offset + r, head, j])
            nibbles[r, 0, j] = np.float32(np.int32(byte & np.int32(15))) - zero_point
            nibbles[r, 1, j] = np.float32(np.int32(byte >> np.int32(4))) - zero_point


# int8 caches are read through a uint8 view, like int4 and fp8 ones: the
# attention kernel then compiles once for all three (each specialisation takes
# a good part of the first run's compile time).
@cached_njit(fastmath=ATTENTION_FASTMATH)
def _decode_int8(data, block, offset, n, head, rows):
    for r in range(n):
        for i in range(rows.shape[1]):
            # Sign-extend the byte: shift it to the top of an int32 and back.
            rows[r, i] = np.float32(np.int32(np.int32(np.int32(data[block, offset + r, head, i]) << np.int32(24))
                                             >> np.int32(24)))


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _convert(data, block, offset, n, head, rows):
    for r in range(n):
        for i in range(rows.shape[1]):
            rows[r, i] = np.float32(data[block, offset + r, head, i])


# The small-float decoders below move the bits into float32's places in int32
# arithmetic, with selects for the special cases, so that a row decodes as
# vector instructions; a 256- or 65536-entry lookup table would be a gather
# per value.

@cached_njit(inline="always")
def _small_float_to_float32(code, exponent_bits, mantissa_bits, ieee_specials):
    """float32 value of a sign | exponent | mantissa code, exponent bias 2^(exponent_bits-1) - 1.

    A normal number's exponent and mantissa shift into float32's fields, the
    bias difference added to the exponent; exponent 0 is subnormal, mantissa
    * 2^(1 - bias - mantissa_bits), exact in float32. An all-ones exponent is
    inf or NaN in IEEE formats (ieee_specials); the "fn" formats have no inf
    and their one NaN magnitude is all ones.
    """
    x = np.int32(code)
    sign_shift = exponent_bits + mantissa_bits
    all_ones = np.int32((1 << sign_shift) - 1)
    magnitude = np.int32(x & all_ones)
    sign = np.int32(np.int32(x >> sign_shift) << np.int32(31))
    bias = (1 << (exponent_bits - 1)) - 1
    to_float32 = np.int32(23 - mantissa_bits)
    normal = np.int32(np.int32(magnitude << to_float32) + np.int32((127 - bias) << 23))
    subnormal_step = np.int32((128 - bias - mantissa_bits) << 23).view(np.float32)
    subnormal = np.float32(np.float32(magnitude) * subnormal_step).view(np.int32)
    bits = normal if magnitude >= np.int32(1 << mantissa_bits) else subnormal
    if ieee_specials:
        special = np.int32(np.int32(magnitude << to_float32) | np.int32(0x7F800000))
        bits = special if magnitude >= np.int32(((1 << exponent_bits) - 1) << mantissa_bits) else bits
    else:
        bits = np.int32(0x7FC00000) if magnitude == all_ones else bits
    return np.int32(bits | sign).view(np.float32)


@cached_njit(inline="always")
def e4m3fn_to_float32(code):
    """float32 value of an e4m3fn code (0..255)."""
    return _small_float_to_float32(code, 4, 3, False)


@cached_njit(inline="always")
def float16_to_float32(code):
    """float32 value of IEEE half-precision bits (0..65535)."""
    return _small_float_to_float32(code, 5, 10, True)


@cached_njit(inline="always")
def bfloat16_to_float32(code):
    """float32 value of bfloat16 bits (0..65535): they are float32's upper half."""
    return np.int32(np.int32(code) << np.int32(16)).view(np.float32)


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _decode_fp8(data, block, offset, n, head, rows):
    for r in range(n):
        for i in range(rows.shape[1]):
            rows[r, i] = e4m3fn_to_float32(data[block, offset + r, head, i])


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _decode_fp16(data, block, offset, n, head, rows):
    for r in range(n):
        for i in range(rows.shape[1]):
            rows[r, i] = float16_to_float32(data[block, offset + r, head, i])


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _decode_bf16(data, block, offset, n, head, rows):
    for r in range(n):
        for i in range(rows.shape[1]):
            rows[r, i] = bfloat16_to_float32(data[block, offset + r, head, i])


@cached_njit(inline="always")
def _bits_to_float(bits):
    return np.uint32(bits).view(np.float32)


# Inlined: as a call, it would update its arrays' reference counts on every chunk.
@cached_njit(inline="always")
def _decode_chunk(mode, data, scale_bits, has_scales, block, offset, n, head,
                  rows, nibbles, scales, zero_points):
    """Decode stored rows offset .. offset+n-1 of one block into rows[:n] (float32
    [CHUNK + 2 * TILE, d]; nibbles is the same buffer seen as [rows, 2, d/2]), in
    storage order, so that row r times scales[r] is the stored vector.

    Leaving the scale to the caller lets it apply it once per score and once
    per probability instead of once per value. int4 rows come out
    de-interleaved (low nibbles, then high nibbles); the caller permutes the
    query and the output to match.
    """
    for r in range(n):
        zero_points[r] = 0.0
        if not has_scales:
            scales[r] = 1.0
        elif mode == DECODE_INT4:
            bits = scale_bits[block, offset + r, head]   # the zero-point is in the low 4 bits
            scales[r] = _bits_to_float(bits & 0xFFFFFFF0)
            zero_points[r] = np.float32(bits & ZERO_POINT_MASK)
        else:
            scales[r] = _bits_to_float(scale_bits[block, offset + r, head])
    # Rows up to the next whole tile get scale 0 and values 0, so that they drop
    # out: what an earlier chunk left there may be a NaN (an "auto" row), and 0 * NaN is NaN.
    for r in range(n, -(-n // (2 * TILE)) * 2 * TILE):
        scales[r] = 0.0
        for i in range(rows.shape[1]):
            rows[r, i] = 0.0
    if mode == DECODE_INT4:
        _unpack_int4(data, block, offset, n, head, zero_points, nibbles)
    elif mode == DECODE_LINEAR:
        _convert(data, block, offset, n, head, rows)
    elif mode == DECODE_INT8:
        _decode_int8(data, block, offset, n, head, rows)
    elif mode == DECODE_FP8:
        _decode_fp8(data, block, offset, n, head, rows)
    elif mode == DECODE_FP16:
        _decode_fp16(data, block, offset, n, head, rows)
    else:
        _decode_bf16(data, block, offset, n, head, rows)


@cached_njit(fastmath=ATTENTION_FASTMATH, inline="always")
def _score_tile(q, g, h, rows, r, s, scores, j0):
    """scores[g, j0 + r + k] = q[g] . rows[r + k] and scores[h, j0 + s + k] = q[h] . rows[s + k]
    for k < TILE."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for i in range(q.shape[1]):
        a0 += q[g, i] * rows[r, i]
        a1 += q[g, i] * rows[r + 1, i]
        a2 += q[g, i] * rows[r + 2, i]
        a3 += q[g, i] * rows[r + 3, i]
        b0 += q[h, i] * rows[s, i]
        b1 += q[h, i] * rows[s + 1, i]
        b2 += q[h, i] * rows[s + 2, i]
        b3 += q[h, i] * rows[s + 3, i]
    scores[g, j0 + r] = a0
    scores[g, j0 + r + 1] = a1
    scores[g, j0 + r + 2] = a2
    scores[g, j0 + r + 3] = a3
    scores[h, j0 + s] = b0
    scores[h, j0 + s + 1] = b1
    scores[h, j0 + s + 2] = b2
    scores[h, j0 + s + 3] = b3


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _score_chunk(q, rows, n, scales, scores, j0):
    """scores[g, j0 + r] = q[g] . rows[r] * scales[r] for r < n."""
    group = q.shape[0]
    for g in range(0, group - 1, 2):   # two heads over the same rows
        for r in range(0, n, TILE):
            _score_tile(q, g, g + 1, rows, r, r, scores, j0)
    if group % 2:   # the last head of an odd group over two row tiles
        for r in range(0, n, 2 * TILE):
            _score_tile(q, group - 1, group - 1, rows, r, r + TILE, scores, j0)
    for g in range(group):
        for r in range(n):
            scores[g, j0 + r] *= scales[r]


@cached_njit(fastmath=ATTENTION_FASTMATH, inline="always")
def _accumulate_tile(acc, g, h, probs, j0, scales, rows, r, s):
    """acc[g] += rows r .. r+3 and acc[h] += rows s .. s+3, each row weighted by its
    probability times its scale."""
    a0 = probs[g, j0 + r] * scales[r]
    a1 = probs[g, j0 + r + 1] * scales[r + 1]
    a2 = probs[g, j0 + r + 2] * scales[r + 2]
    a3 = probs[g, j0 + r + 3] * scales[r + 3]
    b0 = probs[h, j0 + s] * scales[s]
    b1 = probs[h, j0 + s + 1] * scales[s + 1]
    b2 = probs[h, j0 + s + 2] * scales[s + 2]
    b3 = probs[h, j0 + s + 3] * scales[s + 3]
    for i in range(acc.shape[1]):
        a = a0 * rows[r, i] + a1 * rows[r + 1, i] + a2 * rows[r + 2, i] + a3 * rows[r + 3, i]
        b = b0 * rows[s, i] + b1 * rows[s + 1, i] + b2 * rows[s + 2, i] + b3 * rows[s + 3, i]
        acc[g, i] += a
        acc[h, i] += b   # h may be g: then both add to the same row


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _accumulate_chunk(probs, j0, rows, n, scales, acc):
    """acc[g] += sum_r probs[g, j0 + r] * scales[r] * rows[r] over r < n."""
    group = acc.shape[0]
    # The tiles as in _score_chunk; past n, scales are 0 (the probabilities there are the next chunk's).
    for g in range(0, group - 1, 2):
        for r in range(0, n, TILE):
            _accumulate_tile(acc, g, g + 1, probs, j0, scales, rows, r, r)
    if group % 2:
        for r in range(0, n, 2 * TILE):
            _accumulate_tile(acc, group - 1, group - 1, probs, j0, scales, rows, r, r + TILE)


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _mark_nonfinite_rows(rows, n, scales):
    """Give the rows r < n of an "auto" chunk that hold a NaN or +-inf the form a
    quantized cache stores them in (docs/format.md): values 0, scale NaN, which
    _confine_nan_rows keeps from the query rows that do not see them (a weight
    of 0 times a NaN value would not)."""
    for r in range(n):
        top = np.int32(0)
        for i in range(rows.shape[1]):
            # Exponent bits all ones: inf or NaN. An integer max vectorises (see _max).
            top = max(top, np.int32(np.float32(rows[r, i]).view(np.int32) & np.int32(0x7F800000)))
        if top == np.int32(0x7F800000):
            scales[r] = np.uint32(NONFINITE_SCALE_BITS).view(np.float32)
            for i in range(rows.shape[1]):
                rows[r, i] = 0.0


@cached_njit()
def _confine_nan_rows(probs, j0, n, scales, acc):
    """Rows r < n with a NaN scale (non-finite vectors, docs/format.md) reach only the
    query rows that see them: row g with probs[g, j0 + r] != 0 gets acc[g] =
    NaN, and the scale becomes 0, so that a row with probability 0 does not get
    0 * NaN = NaN from the value sums. (A seen column's probability is never 0:
    _exp_nonpositive stops at exp(-87).) Called only for a chunk that has such a
    row (_any_nan): a NaN-safe weight inside the value tiles instead would slow
    every chunk for a case that is rare."""
    for r in range(n):
        if np.isnan(scales[r]):
            for g in range(acc.shape[0]):
                if probs[g, j0 + r] != 0:
                    for i in range(acc.shape[1]):
                        acc[g, i] = np.nan
            scales[r] = 0.0


# Inlined, so that the body calls _confine_nan_rows only for a chunk with a NaN
# scale: a call for every chunk, with its array views, is a visible cost.
@cached_njit(inline="always")
def _any_nan(scales, n):
    for r in range(n):
        if np.isnan(scales[r]):
            return True
    return False


@cached_njit(inline="always")
def _chunk_at(block_table, seq, block_size, position, end):
    """(block, offset, n) of the chunk of rows from `position`: it stops at the
    block's end, after CHUNK rows or at `end`, whichever comes first."""
    page, offset = divmod(position, block_size)
    n = min(CHUNK, block_size - offset, end - position)
    return block_table[seq, page], offset, n


# Rows ahead of the one being decoded whose cache lines are requested early:
# a head's rows lie a whole row of all heads apart, and a block's rows span
# few enough of them per 4 KiB page that the hardware prefetchers barely
# follow. int4 skips it: its loop is compute-bound on a quarter of the bytes,
# and the extra requests cost more than they hide.
PREFETCH_ROWS = 2 * CHUNK

# Columns (cached positions) per segment of a work item's online softmax: its
# scores buffer then holds at most SEGMENT + 2 * TILE columns per query row.
SEGMENT = 512


@cached_njit(inline="always")
def _load_chunk(mode, data, scale_bits, has_scales, block_table, seq, block_size, start, end, head,
                rows, nibbles, scales, zero_points):
    """Decode the chunk of rows from position `start` (see _chunk_at, _decode_chunk)
    and prefetch the one PREFETCH_ROWS further; returns the chunk's row count."""
    ahead = start + PREFETCH_ROWS
    if mode != DECODE_INT4 and ahead < end:
        block, offset, n = _chunk_at(block_table, seq, block_size, ahead, end)
        for r in range(n):
            _prefetch_line(data, block, offset + r, head, 0)
    block, offset, n = _chunk_at(block_table, seq, block_size, start, end)
    _decode_chunk(mode, data, scale_bits, has_scales, block, offset, n, head,
                  rows, nibbles, scales, zero_points)
    return n


# int4 rows with d a multiple of 16 skip the float32 buffer: the loops in
# cpu_simd unpack them in registers (tiles of 4, 2 and 1 query rows), saving
# the buffer's store and reload.
_int4_scores_4 = cpu_simd.make_int4_scores(4)
_int4_scores_2 = cpu_simd.make_int4_scores(2)
_int4_scores_1 = cpu_simd.make_int4_scores(1)
_int4_accumulate_4 = cpu_simd.make_int4_accumulate(4)
_int4_accumulate_2 = cpu_simd.make_int4_accumulate(2)
_int4_accumulate_1 = cpu_simd.make_int4_accumulate(1)


@cached_njit(inline="always")
def _int4_chunk(data, scale_bits, block_table, seq, block_size, start, end, head, scales, zero_codes):
    """(block, offset, n) of the chunk from `start` (see _chunk_at) with its rows'
    scales and zero-points read out; prefetches the chunk PREFETCH_ROWS further."""
    ahead = start + PREFETCH_ROWS
    if ahead < end:
        ahead_block, ahead_offset, ahead_n = _chunk_at(block_table, seq, block_size, ahead, end)
        for r in range(ahead_n):
            _prefetch_line_to_l2(data, ahead_block, ahead_offset + r, head, 0)
    block, offset, n = _chunk_at(block_table, seq, block_size, start, end)
    for r in range(n):
        bits = scale_bits[block, offset + r, head]   # the zero-point is in the low 4 bits
        scales[r] = _bits_to_float(bits & 0xFFFFFFF0)
        zero_codes[r] = np.int32(bits & ZERO_POINT_MASK)
    return block, offset, n


@cached_njit()
def _int4_scores(q, data, block, offset, head, n, zero_codes, scales, scores, column):
    """scores[g, column + r] = q[g] . row r * scales[r] for every row g of q, row r
    being data[block, offset + r, head]."""
    g = 0
    while g + 4 <= q.shape[0]:
        _int4_scores_4(q, g, data, block, offset, head, n, zero_codes, scales, scores, column)
        g += 4
    if g + 2 <= q.shape[0]:
        _int4_scores_2(q, g, data, block, offset, head, n, zero_codes, scales, scores, column)
        g += 2
    if g < q.shape[0]:
        _int4_scores_1(q, g, data, block, offset, head, n, zero_codes, scales, scores, column)


@cached_njit()
def _int4_accumulate(acc, data, block, offset, head, n, zero_codes, weights):
    """acc[g] += sum_r weights[g, r] * (codes of row r - zero_codes[r]) for every row g
    of acc, row r being data[block, offset + r, head]."""
    g = 0
    while g + 4 <= acc.shape[0]:
        _int4_accumulate_4(acc, g, data, block, offset, head, n, zero_codes, weights, g)
        g += 4
    if g + 2 <= acc.shape[0]:
        _int4_accumulate_2(acc, g, data, block, offset, head, n, zero_codes, weights, g)
        g += 2
    if g < acc.shape[0]:
        _int4_accumulate_1(acc, g, data, block, offset, head, n, zero_codes, weights, g)


# fp16 and bf16 rows ("auto" caches, no scales) with d a multiple of 16 skip
# the float32 buffer as well: cpu_simd converts 8 values at a time in
# registers (vcvtph2ps for fp16) for the same FMA chains, with their own
# prefetching (_half_float_chunk).
_fp16_scores_4 = cpu_simd.make_half_float_scores(cpu_simd.FLOAT16_ROWS, 4)
_fp16_scores_2 = cpu_simd.make_half_float_scores(cpu_simd.FLOAT16_ROWS, 2)
_fp16_scores_1 = cpu_simd.make_half_float_scores(cpu_simd.FLOAT16_ROWS, 1)
_fp16_accumulate_4 = cpu_simd.make_half_float_accumulate(cpu_simd.FLOAT16_ROWS, 4)
_fp16_accumulate_2 = cpu_simd.make_half_float_accumulate(cpu_simd.FLOAT16_ROWS, 2)
_fp16_accumulate_1 = cpu_simd.make_half_float_accumulate(cpu_simd.FLOAT16_ROWS, 1)
_bf16_scores_4 = cpu_simd.make_half_float_scores(cpu_simd.BFLOAT16_ROWS, 4)
_bf16_scores_2 = cpu_simd.make_half_float_scores(cpu_simd.BFLOAT16_ROWS, 2)
_bf16_scores_1 = cpu_simd.make_half_float_scores(cpu_simd.BFLOAT16_ROWS, 1)
_bf16_accumulate_4 = cpu_simd.make_half_float_accumulate(cpu_simd.BFLOAT16_ROWS, 4)
_bf16_accumulate_2 = cpu_simd.make_half_float_accumulate(cpu_simd.BFLOAT16_ROWS, 2)
_bf16_accumulate_1 = cpu_simd.make_half_float_accumulate(cpu_simd.BFLOAT16_ROWS, 1)


def _holds_16_bit_values(data):
    """Whether a cache array holds 16-bit values (fp16 or bf16 bits): a constant
    of each compiled kernel, see paged_attention's half_floats_in_registers."""
    return data.dtype == np.uint16


@overload(_holds_16_bit_values)
def _holds_16_bit_values_typed(data):
    holds = data.dtype == types.uint16
    return lambda data: holds


# A 16-bit row of d = 128 spans 4 cache lines (int4's spans one), so the
# first line alone leaves most of a row to the hardware prefetchers: every
# line is prefetched, one chunk ahead, into L2 (as for int4's loops).
HALF_FLOAT_PREFETCH_ROWS = CHUNK
CACHE_LINE_BYTES = 64


@cached_njit(inline="always")
def _half_float_chunk(data, block_table, seq, block_size, start, end, head):
    """(block, offset, n) of the chunk from `start` (see _chunk_at); prefetches
    every cache line of the chunk HALF_FLOAT_PREFETCH_ROWS further."""
    ahead = start + HALF_FLOAT_PREFETCH_ROWS
    if ahead < end:
        ahead_block, ahead_offset, ahead_n = _chunk_at(block_table, seq, block_size, ahead, end)
        for r in range(ahead_n):
            for element in range(0, data.shape[3], CACHE_LINE_BYTES // data.itemsize):
                _prefetch_line_to_l2(data, ahead_block, ahead_offset + r, head, element)
    return _chunk_at(block_table, seq, block_size, start, end)


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _finite_half_float_chunk(mode, data, block_table, seq, block_size, start, end, head):
    """Whether the chunk from `start` (see _chunk_at) holds only finite fp16 or bf16
    values (as mode says): no value with its exponent bits all ones."""
    block, offset, n = _chunk_at(block_table, seq, block_size, start, end)
    exponent = np.int32(0x7C00) if mode == DECODE_FP16 else np.int32(0x7F80)
    top = np.int32(0)
    for r in range(n):
        for i in range(data.shape[3]):
            # An integer max vectorises (see _max).
            top = max(top, np.int32(np.int32(data[block, offset + r, head, i]) & exponent))
    return top != exponent


# The two functions below take a chunk's position, not its rows, and the
# work item's arrays with the KV head's index k, not views: the kernel's body
# holds one plain call per phase for them. With the chunk lookup and the
# prefetch loop inlined into the body (as _int4_chunk is), they slowed the
# int4, int8 and fp8 decodes, which never run that code; called, they cost
# nothing measurable. Views (q[k]) as arguments add compile time.

@cached_njit()
def _half_float_scores(mode, queries, k, data, block_table, seq, block_size, start, end, head, all_scores, column):
    """scores[g, column + r] = q[g] . row r, q = queries[k] and scores = all_scores[k],
    for every row g of q and row r of the chunk from `start` (see
    _half_float_chunk; fp16 or bf16 bits, as mode says). Returns the chunk's
    row count."""
    q, scores = queries[k], all_scores[k]
    block, offset, n = _half_float_chunk(data, block_table, seq, block_size, start, end, head)
    g = 0
    while g + 4 <= q.shape[0]:
        if mode == DECODE_FP16:
            _fp16_scores_4(q, g, data, block, offset, head, n, scores, column)
        else:
            _bf16_scores_4(q, g, data, block, offset, head, n, scores, column)
        g += 4
    if g + 2 <= q.shape[0]:
        if mode == DECODE_FP16:
            _fp16_scores_2(q, g, data, block, offset, head, n, scores, column)
        else:
            _bf16_scores_2(q, g, data, block, offset, head, n, scores, column)
        g += 2
    if g < q.shape[0]:
        if mode == DECODE_FP16:
            _fp16_scores_1(q, g, data, block, offset, head, n, scores, column)
        else:
            _bf16_scores_1(q, g, data, block, offset, head, n, scores, column)
    return n


@cached_njit()
def _half_float_accumulate(mode, accs, k, data, block_table, seq, block_size, start, end, head, all_probs, column):
    """acc[g] += sum_r probs[g, column + r] * row r, acc = accs[k] and probs =
    all_probs[k], for every row g of acc and row r of the chunk from `start`
    (see _half_float_chunk; fp16 or bf16 bits, as mode says). Returns the
    chunk's row count."""
    acc, probs = accs[k], all_probs[k]
    block, offset, n = _half_float_chunk(data, block_table, seq, block_size, start, end, head)
    g = 0
    while g + 4 <= acc.shape[0]:
        if mode == DECODE_FP16:
            _fp16_accumulate_4(acc, g, data, block, offset, head, n, probs, g, column)
        else:
            _bf16_accumulate_4(acc, g, data, block, offset, head, n, probs, g, column)
        g += 4
    if g + 2 <= acc.shape[0]:
        if mode == DECODE_FP16:
            _fp16_accumulate_2(acc, g, data, block, offset, head, n, probs, g, column)
        else:
            _bf16_accumulate_2(acc, g, data, block, offset, head, n, probs, g, column)
        g += 2
    if g < acc.shape[0]:
        if mode == DECODE_FP16:
            _fp16_accumulate_1(acc, g, data, block, offset, head, n, probs, g, column)
        else:
            _bf16_accumulate_1(acc, g, data, block, offset, head, n, probs, g, column)
    return n


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _max(x):
    """max(x) of float32 values, taken over int32 keys that order like them: an
    integer max reduction vectorises (vpmaxsd), a float one only with nnan."""
    top = np.int32(-2147483648)
    for j in range(x.shape[0]):
        bits = np.float32(x[j]).view(np.int32)
        top = max(top, np.int32(bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))))
    return np.int32(top ^ ((top >> np.int32(31)) & np.int32(0x7FFFFFFF))).view(np.float32)


@cached_njit(fastmath=ATTENTION_FASTMATH, inline="always")
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (Cephes' expf), written out so that the softmax loop
    vectorises: np.exp is a scalar libm call per value. About 1 ulp for
    x > -10; below, where the terms are negligible, up to 5 ulp (3e-7)."""
    # exp(x) = 2^n * exp(f), n = rint(x / ln 2), |f| <= ln(2) / 2. Below -87, 2^n
    # would not be a normal float32; the comparison lets NaN through.
    x = np.float32(-87.0) if x < np.float32(-87.0) else x
    n = np.rint(x * np.float32(1.4426950408889634))
    f = x - n * np.float32(0.6931471805599453)
    p = np.float32(1.9875691500e-4)
    p = p * f + np.float32(1.3981999507e-3)
    p = p * f + np.float32(8.3334519073e-3)
    p = p * f + np.float32(4.1665795894e-2)
    p = p * f + np.float32(1.6666665459e-1)
    p = p * f + np.float32(5.0000001201e-1)
    two_to_n = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return (p * (f * f) + f + np.float32(1.0)) * two_to_n


@cached_njit(fastmath=ATTENTION_FASTMATH)
def _softmax_segment(scores, visible_from, visible_to, softcap, running_max, running_sum, acc):
    """One segment of an online softmax over the columns of scores.

    Row g sees columns visible_from[g] .. visible_to[g] - 1 (possibly none):
    those become exp(logit - m), the others up to the last visible column of
    any row 0, where m = max(running_max[g], the row's visible logits). The
    rows' running maximum and sum move to m, and acc[g] (the values weighted
    by the earlier segments' numerators) is rescaled to match.

    Each row's loops run over a view from its first visible column, so that
    their indices start at 0: LLVM vectorises them only when it can prove an
    index non-negative.
    """
    width = visible_to.max()
    for g in range(scores.shape[0]):
        row = scores[g, :width]
        for j in range(visible_from[g]):
            row[j] = 0.0
        visible = scores[g, visible_from[g]:visible_to[g]]
        tail = scores[g, visible_to[g]:width]
        for j in range(tail.shape[0]):
            tail[j] = 0.0
        if visible.shape[0] == 0:
            continue
        if softcap > 0:
            for j in range(visible.shape[0]):
                visible[j] = softcap * np.tanh(visible[j] / softcap)
        top = max(_max(visible), running_max[g])
        total = np.float32(0.0)
        for j in range(visible.shape[0]):
            visible[j] = _exp_nonpositive(visible[j] - top)
            total += visible[j]
        if top > running_max[g]:
            # exp(-inf) = 0 for a row with nothing before; its sum and acc are 0 anyway.
            factor = np.float32(np.exp(running_max[g] - top))
            running_sum[g] *= factor
            for i in range(acc.shape[1]):
                acc[g, i] *= factor
            running_max[g] = top
        running_sum[g] += total


@cached_njit(parallel=True, fastmath=ATTENTION_FASTMATH)
def paged_attention(query, key_data, value_data, k_scale_bits, v_scale_bits, has_scales,
                    mode, block_table, seq_lens, cu_seqlens_q, token_seq, run_starts,
                    sliding_window, softcap, sinks, has_sinks, out, head_span, lanes):
    """Causal paged attention in the rotated, storage-ordered domain.

    query, out: float32 [T, Hq, d]; query is already rotated, permuted to
    storage order and multiplied by softmax_scale / rotation norm.
    run_starts: int32 [R + 1]; run r is query tokens run_starts[r] ..
    run_starts[r + 1] - 1, consecutive tokens of one sequence.

    One work item is (run, span of up to head_span consecutive KV heads). It
    decodes each K/V row it needs once, for every query head of the KV head's
    GQA group and every token of its run: the run's (token, head) pairs are
    the rows of that KV head's query matrix. A token's causal mask and
    sliding window become the range of columns its rows see. The item walks
    its rows chunk by chunk, every KV head of the span per chunk: a cache
    row holds all KV heads side by side, so it reads a block's bytes in one
    sweep instead of one head's slice in every row.

    `lanes` workers (one per thread) claim items one at a time from a shared
    counter rather than taking a fixed share: items differ in cost (a varlen
    batch's sequences, sliding windows), and so do the cores of a shared
    machine, whose speeds change with the load beside them.
    """
    num_heads, d = query.shape[1], query.shape[2]
    block_size = key_data.shape[1]
    num_kv_heads = key_data.shape[2]
    group = num_heads // num_kv_heads
    spans = -(-num_kv_heads // head_span)
    num_items = (run_starts.shape[0] - 1) * spans
    # cpu_simd's loops read 8 contiguous values (bytes, 16-bit words) at a time.
    in_registers = (mode == DECODE_INT4 and has_scales and (d // 2) % cpu_simd.LANES == 0
                    and key_data.strides[3] == 1 and value_data.strides[3] == 1)
    # Known at compile time (each cache dtype compiles its own kernel): the
    # kernels of the other dtypes hold no branch to these loops.
    half_floats_in_registers = (_holds_16_bit_values(key_data)
                                and (mode == DECODE_FP16 or mode == DECODE_BF16) and not has_scales
                                and (d // 2) % cpu_simd.LANES == 0
                                and key_data.strides[3] == 2 and value_data.strides[3] == 2)
    next_item = np.zeros(1, np.int64)
    for lane in prange(lanes):
        while True:
            item = _fetch_add(next_item, 1)
            if item >= num_items:
                break
            run = item // spans
            first_kv_head = (item % spans) * head_span
            kv_heads = min(head_span, num_kv_heads - first_kv_head)
            first_token = run_starts[run]
            run_length = run_starts[run + 1] - first_token
            seq = token_seq[first_token]
            # Position of the run's first token in its sequence.
            first_position = seq_lens[seq] - cu_seqlens_q[seq + 1] + first_token

            # q[k, t * group + g]: token first_token + t, query head (first_kv_head + k) * group + g.
            q_rows = run_length * group
            q = np.empty((kv_heads, q_rows, d), np.float32)   # contiguous, so that its loops vectorise
            visible_from = np.empty(q_rows, np.int64)
            visible_to = np.empty(q_rows, np.int64)
            sink_rows = np.empty((kv_heads, q_rows if has_sinks else 0), np.float32)
            window_start = 0 if sliding_window <= 0 else max(0, first_position - sliding_window + 1)
            end = first_position + run_length   # one past the last token's position
            # Every token of the run sees positions last_window_start .. first_position.
            last_window_start = 0 if sliding_window <= 0 else max(0, end - sliding_window)
            for t in range(run_length):
                position = first_position + t
                first = 0 if sliding_window <= 0 else max(0, position - sliding_window + 1)
                for g in range(group):
                    row = t * group + g
                    visible_from[row] = first - window_start
                    visible_to[row] = position + 1 - window_start
                    for k in range(kv_heads):
                        head = (first_kv_head + k) * group + g
                        for i in range(d):
                            q[k, row, i] = query[first_token + t, head, i]
                        if has_sinks:
                            sink_rows[k, row] = sinks[head]
            # The run's columns (positions window_start ..) in segments of SEGMENT:
            # scores and softmax per segment (an online softmax across them), so
            # that the scores buffer stays in L2 however long the sequence.
            running_max = np.full((kv_heads, q_rows), -np.inf, np.float32)
            running_sum = np.zeros((kv_heads, q_rows), np.float32)
            if has_sinks:
                # A sink is a logit with no value: the sum starts at exp(sink - sink).
                running_max[:] = sink_rows
                running_sum[:] = 1.0
            acc = np.zeros((kv_heads, q_rows, d), np.float32)

            # Room for the rows of a last partial tile; zeros, so that they are finite.
            rows = np.zeros((CHUNK + 2 * TILE, d), np.float32)
            nibbles = rows.reshape((CHUNK + 2 * TILE, 2, d // 2))
            scales = np.empty(CHUNK + 2 * TILE, np.float32)
            zero_points = np.empty(CHUNK + 2 * TILE, np.float32)
            zero_codes = np.empty(CHUNK, np.int32)
            weights = np.empty((q_rows, CHUNK), np.float32)
            scores = np.empty((kv_heads, q_rows, min(SEGMENT, end - window_start) + 2 * TILE), np.float32)
            segment_from = np.empty(q_rows, np.int64)
            segment_to = np.empty(q_rows, np.int64)

            for segment_start in range(window_start, end, SEGMENT):
                segment_end = min(segment_start + SEGMENT, end)
                first_column = segment_start - window_start
                for row in range(q_rows):
                    segment_to[row] = max(0, min(visible_to[row] - first_column, segment_end - segment_start))
                    segment_from[row] = min(max(0, visible_from[row] - first_column), segment_to[row])

                start = segment_start
                while start < segment_end:
                    n = 0
                    for k in range(kv_heads):
                        kv_head = first_kv_head + k
                        if in_registers:
                            block, offset, n = _int4_chunk(key_data, k_scale_bits, block_table, seq, block_size,
                                                           start, segment_end, kv_head, scales, zero_codes)
                            _int4_scores(q[k], key_data, block, offset, kv_head, n, zero_codes, scales, scores[k],
                                         start - segment_start)
                        elif half_floats_in_registers:
                            n = _half_float_scores(mode, q, k, key_data, block_table, seq, block_size, start,
                                                   segment_end, kv_head, scores, start - segment_start)
                        else:
                            n = _load_chunk(mode, key_data, k_scale_bits, has_scales, block_table, seq, block_size,
                                            start, segment_end, kv_head, rows, nibbles, scales, zero_points)
                            _score_chunk(q[k], rows, n, scales, scores[k], start - segment_start)
                    start += n

                for k in range(kv_heads):
                    _softmax_segment(scores[k], segment_from, segment_to, softcap, running_max[k], running_sum[k],
                                     acc[k])
                    # The value tiles read up to 2 * TILE columns past the segment (padding rows, scale 0),
                    # where a register path's scores may have left a NaN or nothing: 0 * NaN is NaN.
                    scores[k, :, segment_end - segment_start:segment_end - segment_start + 2 * TILE] = 0.0

                start = segment_start
                while start < segment_end:
                    n = 0
                    for k in range(kv_heads):
                        kv_head = first_kv_head + k
                        column = start - segment_start
                        if in_registers:
                            block, offset, n = _int4_chunk(value_data, v_scale_bits, block_table, seq, block_size,
                                                           start, segment_end, kv_head, scales, zero_codes)
                            if _any_nan(scales, n):
                                _confine_nan_rows(scores[k], column, n, scales, acc[k])
                            for g in range(q_rows):
                                probabilities = scores[k, g, column:column + n]
                                for r in range(n):
                                    weights[g, r] = probabilities[r] * scales[r]
                            _int4_accumulate(acc[k], value_data, block, offset, kv_head, n, zero_codes, weights)
                        elif half_floats_in_registers and (run_length == 1 or _finite_half_float_chunk(
                                mode, value_data, block_table, seq, block_size, start, segment_end, kv_head)):
                            # In a run of several tokens, a chunk with a NaN or inf row takes the buffer
                            # path below, which keeps it from the rows that do not see it.
                            n = _half_float_accumulate(mode, acc, k, value_data, block_table, seq, block_size, start,
                                                       segment_end, kv_head, scores, column)
                        else:
                            n = _load_chunk(mode, value_data, v_scale_bits, has_scales, block_table, seq, block_size,
                                            start, segment_end, kv_head, rows, nibbles, scales, zero_points)
                            if not has_scales and (start < last_window_start or start + n > first_position + 1):
                                # A chunk with columns that some rows of the run do not see (never in a decode).
                                _mark_nonfinite_rows(rows, n, scales)
                            if _any_nan(scales, n):
                                _confine_nan_rows(scores[k], column, n, scales, acc[k])
                            _accumulate_chunk(scores[k], column, rows, n, scales, acc[k])
                    start += n
            for k in range(kv_heads):
                for t in range(run_length):
                    for g in range(group):
                        row = t * group + g
                        inv = np.float32(1.0) / running_sum[k, row]
                        for i in range(d):
                            out[first_token + t, (first_kv_head + k) * group + g, i] = acc[k, row, i] * inv
