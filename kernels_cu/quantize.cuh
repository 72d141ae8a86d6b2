// Per-token-head quantization of docs/format.md, bit for bit what
// cpu_kernels.quantize_vectors stores: float32 arithmetic in the format's
// order with correctly rounded division and no contraction (every rounding
// step is an explicit __f*_rn intrinsic, which NVRTC never fuses into an FMA).
#pragma once

#include "common.cuh"

namespace kvc {

// KV dtype ids: formats.KVDtype.kernel_id.
constexpr int kInt4 = 0, kInt8 = 1, kFp8 = 2, kAuto = 3;

// docs/format.md, non-finite input: codes 0 and this quiet NaN as the scale word.
constexpr u32 kNonFiniteScale = 0x7fc00000u;
constexpr float kMinScale = 1e-6f;
constexpr float kFloatMax = 3.402823466e38f;
// Adding 2^23 leaves a float in [0, 2^23) as an integer in the low mantissa bits.
constexpr float kTwo23 = 8388608.0f;
constexpr float kSixteenth = 0.0625f;

// vLLM's rounding: add +-0.5 in float32, truncate toward zero.
__device__ __forceinline__ float round_half_away(float v) {
    return truncf(__fadd_rn(v, v >= 0.0f ? 0.5f : -0.5f));
}

// e4m3fn bits of v: round to nearest even, saturating at +-448 (cpu_kernels.float_to_e4m3fn).
__device__ __forceinline__ u32 e4m3fn_bits(float v) {
    const u32 sign = (__float_as_uint(v) >> 24) & 0x80u;
    const float a = fminf(fabsf(v), 448.0f);
    u32 code;
    if (a < 0.015625f) {
        // Subnormal range, step 2^-9: a * 512 is exact, and adding 2^23 rounds it
        // to the nearest even integer. A code of 8 is the smallest normal.
        code = __float_as_uint(__fadd_rn(__fmul_rn(a, 512.0f), kTwo23)) - __float_as_uint(kTwo23);
    } else {
        // Round the 23-bit mantissa to 3 bits, nearest even; a carry moves into
        // the exponent. Rebias 127 -> 7.
        u32 bits = __float_as_uint(a);
        bits += 0x7ffffu + ((bits >> 20) & 1u);
        code = (bits >> 20) - (120u << 3);
    }
    return sign | code;
}

// The scale word and codes of one vector whose values the group's lanes hold
// (VALUES each, any order) as x times `unit`, a power of two, with the lane's
// smallest and largest x where `known` (finite then): `scale_word` for
// the scale cache, `code(x)` per value, valid where `finite` (docs/format.md's
// non-finite rule stores codes 0 otherwise: the caller masks whole words with
// `keep`, rather than every code with a select). The extremes are scaled once, and so is
// the reciprocal scale that code() multiplies by: x * (r * unit) rounds the
// same real number as (x * unit) * r, r = 1 / scale rounded, since both
// products by unit are exact (normal results; with x on rotation.cuh's integer
// grid, |x| < 2^30 and unit in [2^-126, 2^106] keep r * unit in [2^-27, 2^126]).
template <int KV_DTYPE> struct Quantizer;

template <> struct Quantizer<kInt4> {
    float code_scale, zero_point;   // both / 16: see code()
    bool finite;
    u32 keep;   // all ones where finite, else 0
    u32 scale_word;

    template <int VALUES, class Group>
    __device__ __forceinline__ Quantizer(const float (&x)[VALUES], const LaneRange* known, const Group& group,
                                         float unit) {
        float lo = x[0], hi = x[0];
        if (known != nullptr) {
            lo = known->lo;
            hi = known->hi;
        } else {
#pragma unroll
            for (int i = 1; i < VALUES; ++i) { lo = min_nan(lo, x[i]); hi = max_nan(hi, x[i]); }
        }
        lo = __fmul_rn(group.min(lo), unit);
        hi = __fmul_rn(group.max(hi), unit);
        // A NaN anywhere made both NaN; an inf made one of them infinite.
        finite = fabsf(lo) <= kFloatMax && fabsf(hi) <= kFloatMax;
        const float scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), 15.0f), kMinScale);
        const float zp = fminf(fmaxf(round_half_away(__fdiv_rn(-lo, scale)), 0.0f), 15.0f);
        zero_point = zp * kSixteenth;
        code_scale = __fmul_rn(__fmul_rn(__fdiv_rn(1.0f, scale), unit), kSixteenth);
        scale_word = finite ? (__float_as_uint(scale) & ~0xfu) | u32(zp) : kNonFiniteScale;
        keep = finite ? ~0u : 0u;
    }
    // clamp(round_half_away(x / scale + zp), 0, 15). Adding +0.5 instead of
    // -0.5 below zero changes nothing: both clamp to 0. Worked out 16 times
    // smaller, v / 16 = (x * r / 16 + zp / 16) + 1 / 32 with every operand and
    // result scaled by 2^-4, which rounds each step alike (a product too small
    // for that is absorbed by the adds either way), so that a saturating add
    // clamps at 0 (and at 16) for free; the floor of 16 v / 16 clamped to 15 / 16
    // is then an add toward zero of 2^19.
    __device__ __forceinline__ u32 code(float x) const { return raw_code(x) & 0xfu; }
    // The byte of two values (the even one in the low nibble) in the low 8 bits.
    __device__ __forceinline__ u32 pair_byte(float even, float odd) const {
        return (raw_code(odd) << 4) + raw_code(even);   // 2^19's bits carry nothing into them
    }
    // The code in the low 4 bits above 2^19's own.
    __device__ __forceinline__ u32 raw_code(float x) const {
        const float v = __saturatef(__fadd_rn(__fadd_rn(__fmul_rn(x, code_scale), zero_point), 0.03125f));
        return __float_as_uint(__fadd_rz(fminf(v, 0.9375f), 524288.0f));
    }
};

template <int KV_DTYPE> struct SymmetricQuantizer {
    static constexpr float kLimit = KV_DTYPE == kInt8 ? 127.0f : 448.0f;
    float code_scale;
    bool finite;
    u32 keep;   // all ones where finite, else 0
    u32 scale_word;

    template <int VALUES, class Group>
    __device__ __forceinline__ SymmetricQuantizer(const float (&x)[VALUES], const LaneRange* known,
                                                  const Group& group, float unit) {
        float absmax = 0.0f;
        if (known != nullptr) {
            absmax = fmaxf(fabsf(known->lo), fabsf(known->hi));
        } else {
#pragma unroll
            for (int i = 0; i < VALUES; ++i) absmax = max_nan(absmax, fabsf(x[i]));
        }
        absmax = __fmul_rn(group.max(absmax), unit);
        finite = absmax <= kFloatMax;
        const float scale = fmaxf(__fdiv_rn(absmax, kLimit), kMinScale);
        code_scale = __fmul_rn(__fdiv_rn(1.0f, scale), unit);
        scale_word = finite ? __float_as_uint(scale) : kNonFiniteScale;
        keep = finite ? ~0u : 0u;
    }
    __device__ __forceinline__ u32 code(float x) const { return code_byte(x) & 0xffu; }
    // The code in the low 8 bits (int8: of its int32, two's complement).
    __device__ __forceinline__ u32 code_byte(float x) const {
        const float scaled = __fmul_rn(x, code_scale);
        if constexpr (KV_DTYPE == kInt8) {
            const float rounded = fminf(fmaxf(round_half_away(scaled), -128.0f), 127.0f);
            return u32(__float2int_rz(rounded));
        } else {
            return e4m3fn_bits(scaled);
        }
    }
};

template <> struct Quantizer<kInt8> : SymmetricQuantizer<kInt8> { using SymmetricQuantizer::SymmetricQuantizer; };
template <> struct Quantizer<kFp8> : SymmetricQuantizer<kFp8> { using SymmetricQuantizer::SymmetricQuantizer; };

}  // namespace kvc
