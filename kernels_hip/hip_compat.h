// What the kernels_cu sources need to build for AMD GPUs (kernels_hip/*.hip
// include this first, then the CUDA sources themselves): the portable
// primitives types.cuh leaves to a build without PTX, for waves of 64 lanes,
// and the few CUDA intrinsics that ROCm 5.2's HIP lacks.
//
// Compiled by NVRTC instead (no __HIPCC__: the tests run these builds on an
// NVIDIA GPU), wave64_on_cuda.cuh supplies the HIP API below with two warps
// as one wave.
#pragma once

#define KVC_NO_PTX 1

#if defined(__HIPCC__)
// Before HIP's headers: their __fadd_rn and __fmul_rn are a plain + and *,
// which contraction would fuse into one FMA (the cache's bytes follow the
// format's separate roundings). Compile with -ffp-contract=off as well: hiprtc
// reads those headers before this one.
// No hip_fp16.h: its functions live in an unnamed namespace, where the
// kernels' own unnamed namespace finds its __ldg(const __half*) and stops
// looking (hiding the __ldg of every other type); the conversions are below.
#pragma clang fp contract(off)
#include <hip/hip_runtime.h>
// CUDA's second launch bound counts blocks a multiprocessor; HIP reads it as
// waves a SIMD, which for blocks of several waves asks for several times the
// occupancy meant and caps the registers (spills). Translated: the blocks'
// waves spread over a compute unit's four SIMDs.
#undef __launch_bounds__
#define KVC_LAUNCH_BOUNDS_1(threads) __attribute__((amdgpu_flat_work_group_size(1, threads)))
#define KVC_LAUNCH_BOUNDS_2(threads, blocks)                          \
  __attribute__((amdgpu_flat_work_group_size(1, threads),            \
                 amdgpu_waves_per_eu(((blocks) * (((threads) + 63) / 64) + 3) / 4)))
#define KVC_LAUNCH_BOUNDS_PICK(first, second, chosen, ...) chosen
#define __launch_bounds__(...) \
  KVC_LAUNCH_BOUNDS_PICK(__VA_ARGS__, KVC_LAUNCH_BOUNDS_2, KVC_LAUNCH_BOUNDS_1, )(__VA_ARGS__)
#else
#include "wave64_on_cuda.cuh"
#endif

namespace kvc_hip {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// IEEE half -> float, exact (NaN keeps its payload, made quiet).
__device__ __forceinline__ float f16_bits_to_float(u16 bits) {
    const u32 sign = u32(bits & 0x8000u) << 16;
    const u32 exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
    if (exponent == 0) {   // zero or subnormal: mantissa x 2^-24, exact in float32
        const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
        return __uint_as_float(__float_as_uint(magnitude) | sign);
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> IEEE half bits, round to nearest even; overflow gives inf, NaN the
// canonical 0x7fff (as PTX's cvt.rn.f16.f32 does).
__device__ __forceinline__ u16 f16_bits_of(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7fffu;
    if (magnitude >= 0x477ff000u) return u16(sign | 0x7c00u);   // 65520 and up round to inf
    if (magnitude >= 0x38800000u) {                           // a normal half: drop 13 bits
        const u32 rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
        return u16(sign | ((rounded >> 13) - (112u << 10)));
    }
    // A subnormal half (steps of 2^-24): the significand shifted right, nearest even.
    const int shift = 126 - int(magnitude >> 23);
    if (shift > 24) return u16(sign);
    const u32 significand = (magnitude & 0x7fffffu) | 0x800000u;
    const u32 kept = significand >> shift, dropped = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return u16(sign | (kept + (dropped > half || (dropped == half && (kept & 1u)))));
}

// float -> bfloat16 bits, round to nearest even; NaN gives 0x7fff (cvt.rn.bf16.f32's).
__device__ __forceinline__ u16 bf16_bits_of(float x) {
    const u32 bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return u16((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// OCP float8 e4m3fn (the cache's fp8 codes) -> float, exact. MI300's own fp8
// is e4m3fnuz (bias 8, one NaN): its conversions read other numbers from the
// same bits, so the codes are decoded here, never reinterpreted.
__device__ __forceinline__ float e4m3fn_to_float(u32 code) {
    const u32 sign = (code & 0x80u) << 24, exponent = (code >> 3) & 0xfu, mantissa = code & 7u;
    if (exponent == 0xfu && mantissa == 7u) return __uint_as_float(sign | 0x7fc00000u);
    const float magnitude = exponent == 0 ? float(mantissa) * 0.001953125f   // subnormal: mantissa x 2^-9
                                          : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
    return __uint_as_float(__float_as_uint(magnitude) | sign);
}

// a + b rounded toward zero: the nearest-even sum, stepped one unit toward
// zero where its exact error (Knuth's two-sum) shows it was rounded away.
__device__ __forceinline__ float add_toward_zero(float a, float b) {
    const float sum = a + b;
    if (!(fabsf(sum) <= 3.402823466e38f)) {
        const bool overflowed = fabsf(a) <= 3.402823466e38f && fabsf(b) <= 3.402823466e38f && sum == sum;
        return overflowed ? copysignf(3.402823466e38f, sum) : sum;
    }
    const float b_part = sum - a;
    const float error = (a - (sum - b_part)) + (b - b_part);
    const bool away = error != 0.0f && ((error < 0.0f) != (sum < 0.0f));
    return away ? __uint_as_float(__float_as_uint(sum) - 1u) : sum;
}

__device__ __forceinline__ int min3(int a, int b, int c) { return min(a, min(b, c)); }
__device__ __forceinline__ int max3(int a, int b, int c) { return max(a, max(b, c)); }

// The larger (smaller) of each pair of unsigned 16-bit halves.
__device__ __forceinline__ u32 max_halves(u32 a, u32 b) {
    return max(a & 0xffffu, b & 0xffffu) | (max(a >> 16, b >> 16) << 16);
}
__device__ __forceinline__ u32 min_halves(u32 a, u32 b) {
    return min(a & 0xffffu, b & 0xffffu) | (min(a >> 16, b >> 16) << 16);
}

#if defined(__HIPCC__)
// Lanes of one wave see each other's shared-memory writes: a wave runs in
// lockstep, so ordering the memory operations is all there is to do.
__device__ __forceinline__ void sync_wave_lanes(u64) {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
__device__ __forceinline__ void opaque(u32& x) { asm volatile("" : "+v"(x)); }
#endif

}  // namespace kvc_hip

#if defined(__HIPCC__)
// CUDA intrinsics the shared sources call that ROCm 5.2 does not define.
__device__ __forceinline__ int __vimin3_s32(int a, int b, int c) { return kvc_hip::min3(a, b, c); }
__device__ __forceinline__ int __vimax3_s32(int a, int b, int c) { return kvc_hip::max3(a, b, c); }
__device__ __forceinline__ unsigned __vmaxu2(unsigned a, unsigned b) { return kvc_hip::max_halves(a, b); }
__device__ __forceinline__ unsigned __vminu2(unsigned a, unsigned b) { return kvc_hip::min_halves(a, b); }
#ifndef OCML_BASIC_ROUNDED_OPERATIONS
__device__ __forceinline__ float __fadd_rz(float a, float b) { return kvc_hip::add_toward_zero(a, b); }
#endif
#endif

namespace kvc {

typedef unsigned int u32;
typedef unsigned short u16;

constexpr int kWaveLanes = 64;
using LaneMask = unsigned long long;

__device__ __forceinline__ int lane_in_wave() { return threadIdx.x & (kWaveLanes - 1); }

// HIP 5.2's shuffles take no mask: a wave's active lanes run together.
template <class T>
__device__ __forceinline__ T exchange_lanes(LaneMask, T value, int lane_mask, int width) {
    return __shfl_xor(value, lane_mask, width);
}
__device__ __forceinline__ void sync_lanes(LaneMask mask) { kvc_hip::sync_wave_lanes(mask); }
__device__ __forceinline__ void opaque_register(u32& x) { kvc_hip::opaque(x); }

// NaN when either operand is NaN (a sum with a NaN is one), else fminf / fmaxf.
__device__ __forceinline__ float min_nan(float a, float b) { return a != a || b != b ? a + b : fminf(a, b); }
__device__ __forceinline__ float max_nan(float a, float b) { return a != a || b != b ? a + b : fmaxf(a, b); }

__device__ __forceinline__ float f16_bits_to_float(u16 bits) { return kvc_hip::f16_bits_to_float(bits); }
__device__ __forceinline__ u16 f16_bits_of(float x) { return kvc_hip::f16_bits_of(x); }
__device__ __forceinline__ u16 bf16_bits_of(float x) { return kvc_hip::bf16_bits_of(x); }

// Pairs packed in 32 bits, the first value in the low half.
__device__ __forceinline__ u32 pack_half2(float first, float second) {
    return u32(f16_bits_of(first)) | (u32(f16_bits_of(second)) << 16);
}
__device__ __forceinline__ u32 pack_bf162(float first, float second) {
    return u32(bf16_bits_of(first)) | (u32(bf16_bits_of(second)) << 16);
}
__device__ __forceinline__ float2 unpack_half2(u32 x) {
    return make_float2(f16_bits_to_float(u16(x & 0xffffu)), f16_bits_to_float(u16(x >> 16)));
}

// No programmatic dependent launch: a grid starts after the one before it.
__device__ __forceinline__ void allow_dependent_launch() {}
__device__ __forceinline__ void wait_for_prerequisites() {}

}  // namespace kvc
