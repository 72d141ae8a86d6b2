// Per-token-head quantization of FORMAT.md, bit for bit what
// cpu_kernels.quantize_vectors stores: float32 arithmetic in the format's
// order with correctly rounded division and no contraction (every rounding
// step is an explicit __f*_rn intrinsic, which NVRTC never fuses into an FMA).
#pragma once

#include "common.cuh"

namespace kvc {

// KV dtype ids: formats.KVDtype.kernel_id.
constexpr int kInt4 = 0, kInt8 = 1, kFp8 = 2, kAuto = 3;

// FORMAT.md, non-finite input: codes 0 and this quiet NaN as the scale word.
constexpr u32 kNonFiniteScale = 0x7fc00000u;
constexpr float kMinScale = 1e-6f;
constexpr float kFloatMax = 3.402823466e38f;
// Adding 2^23 leaves a float in [0, 2^23) as an integer in the low mantissa bits.
constexpr float kTwo23 = 8388608.0f;

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
// (VALUES each, any order): `scale_word` for the scale cache, `code(x)` per value.
template <int KV_DTYPE> struct Quantizer;

template <> struct Quantizer<kInt4> {
    float inv_scale, zero_point;
    bool finite;
    u32 scale_word;

    template <int VALUES, class Group>
    __device__ __forceinline__ Quantizer(const float (&x)[VALUES], const Group& group) {
        float lo = x[0], hi = x[0];
#pragma unroll
        for (int i = 1; i < VALUES; ++i) { lo = min_nan(lo, x[i]); hi = max_nan(hi, x[i]); }
        lo = group.min(lo);
        hi = group.max(hi);
        // A NaN anywhere made both NaN; an inf made one of them infinite.
        finite = fabsf(lo) <= kFloatMax && fabsf(hi) <= kFloatMax;
        const float scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), 15.0f), kMinScale);
        zero_point = fminf(fmaxf(round_half_away(__fdiv_rn(-lo, scale)), 0.0f), 15.0f);
        inv_scale = __fdiv_rn(1.0f, scale);
        scale_word = finite ? (__float_as_uint(scale) & ~0xfu) | u32(zero_point) : kNonFiniteScale;
    }
    // clamp(round_half_away(x / scale + zp), 0, 15). Adding +0.5 instead of
    // -0.5 below zero changes nothing: both clamp to 0. The floor of the
    // clamped value is an add toward zero of 2^23.
    __device__ __forceinline__ u32 code(float x) const {
        const float v = __fadd_rn(__fadd_rn(__fmul_rn(x, inv_scale), zero_point), 0.5f);
        const float clamped = fminf(fmaxf(v, 0.0f), 15.0f);
        return finite ? __float_as_uint(__fadd_rz(clamped, kTwo23)) & 0xfu : 0u;
    }
};

template <int KV_DTYPE> struct SymmetricQuantizer {
    static constexpr float kLimit = KV_DTYPE == kInt8 ? 127.0f : 448.0f;
    float inv_scale;
    bool finite;
    u32 scale_word;

    template <int VALUES, class Group>
    __device__ __forceinline__ SymmetricQuantizer(const float (&x)[VALUES], const Group& group) {
        float absmax = 0.0f;
#pragma unroll
        for (int i = 0; i < VALUES; ++i) absmax = max_nan(absmax, fabsf(x[i]));
        absmax = group.max(absmax);
        finite = absmax <= kFloatMax;
        const float scale = fmaxf(__fdiv_rn(absmax, kLimit), kMinScale);
        inv_scale = __fdiv_rn(1.0f, scale);
        scale_word = finite ? __float_as_uint(scale) : kNonFiniteScale;
    }
    __device__ __forceinline__ u32 code(float x) const {
        if (!finite) return 0u;
        const float scaled = __fmul_rn(x, inv_scale);
        if constexpr (KV_DTYPE == kInt8) {
            const float rounded = fminf(fmaxf(round_half_away(scaled), -128.0f), 127.0f);
            return u32(__float2int_rz(rounded)) & 0xffu;
        } else {
            return e4m3fn_bits(scaled);
        }
    }
};

template <> struct Quantizer<kInt8> : SymmetricQuantizer<kInt8> { using SymmetricQuantizer::SymmetricQuantizer; };
template <> struct Quantizer<kFp8> : SymmetricQuantizer<kFp8> { using SymmetricQuantizer::SymmetricQuantizer; };

}  // namespace kvc
