// The MFMA instructions the HIP attention kernels use, one typed wrapper each
// (namespace kvc_mfma), over a 64-lane wave: D = A * B + C with A 16 x K,
// B K x 16, C and D 16 x 16, each lane holding the elements mfma_on_cuda.cuh's
// header lists (the AMD matrix instruction calculator's layouts).
//
// Built by hipcc / hipRTC, a wrapper is the clang builtin; compiled by NVRTC
// (no __HIPCC__), it is mfma_on_cuda.cuh's emulation over two warps as one
// wave. A wrapper exists only where its instruction does (KVC_MFMA_HAS_*):
// on an arch without it, the builtin is not a front-end error but a backend
// "Cannot select" that aborts the whole compile (clang's BuiltinsAMDGPU.def
// gates these on mai-insts alone), so a call is stopped here, by name.
#pragma once

#include "hip_compat.h"

#if defined(__HIPCC__)
#if defined(__gfx90a__)
#define KVC_MFMA_GFX90A 1
#elif defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define KVC_MFMA_GFX94X 1   // one MFMA set for the three (LLVM's FeatureISAVersion9_4_Common)
#endif
#else
#define KVC_MFMA_EMULATED 1
#include "mfma_on_cuda.cuh"
#endif

// Which wrappers exist. 16x16x16 i8 is CDNA2's (LLVM defines it for gfx908 and
// gfx90a only), 16x16x32 i8 and fp8 CDNA3's; 16x16x32 i8 is two 16x16x16 on gfx90a.
#if defined(KVC_MFMA_GFX90A) || defined(KVC_MFMA_GFX94X) || defined(KVC_MFMA_EMULATED)
#define KVC_MFMA_HAS_F16 1
#define KVC_MFMA_HAS_BF16 1
#define KVC_MFMA_HAS_I8_16X16X32 1
#else
#define KVC_MFMA_HAS_F16 0
#define KVC_MFMA_HAS_BF16 0
#define KVC_MFMA_HAS_I8_16X16X32 0
#endif
#if defined(KVC_MFMA_GFX90A) || defined(KVC_MFMA_EMULATED)
#define KVC_MFMA_HAS_I8_16X16X16 1
#else
#define KVC_MFMA_HAS_I8_16X16X16 0
#endif
#if defined(KVC_MFMA_GFX94X) || defined(KVC_MFMA_EMULATED)
#define KVC_MFMA_HAS_FP8 1
#else
#define KVC_MFMA_HAS_FP8 0
#endif

namespace kvc_mfma {

typedef unsigned int u32;

// The operand types the builtins take (BuiltinsAMDGPU.def: V4h, V4s, V4f, V4i;
// 8-bit operands: int, 4 a lane, or 64-bit, 8 a lane). Element e of a 16-bit
// operand is bits 16*(e%2) of register e/2; byte e of an 8-bit one is bits
// 8*(e%4) of register e/4.
#if defined(__HIPCC__)
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
typedef short bf16x4 __attribute__((ext_vector_type(4)));   // bfloat16 bits
typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef int i32x4 __attribute__((ext_vector_type(4)));

// Four 16-bit values from two words, elements 0 and 1 in `low` (low half first).
__device__ __forceinline__ f16x4 f16x4_of_words(u32 low, u32 high) {
    f16x4 x;
    const u32 words[2] = {low, high};
    __builtin_memcpy(&x, words, sizeof(x));
    return x;
}
__device__ __forceinline__ bf16x4 bf16x4_of_words(u32 low, u32 high) {
    bf16x4 x;
    const u32 words[2] = {low, high};
    __builtin_memcpy(&x, words, sizeof(x));
    return x;
}
#else
using kvc_mfma_emu::bf16x4;
using kvc_mfma_emu::f16x4;
using kvc_mfma_emu::f32x4;
using kvc_mfma_emu::i32x4;

__device__ __forceinline__ f16x4 f16x4_of_words(u32 low, u32 high) { return f16x4{{low, high}}; }
__device__ __forceinline__ bf16x4 bf16x4_of_words(u32 low, u32 high) { return bf16x4{{low, high}}; }
#endif

__device__ __forceinline__ f32x4 make_f32x4(float d0, float d1, float d2, float d3) {
    f32x4 x;
    x[0] = d0;
    x[1] = d1;
    x[2] = d2;
    x[3] = d3;
    return x;
}
__device__ __forceinline__ i32x4 make_i32x4(int d0, int d1, int d2, int d3) {
    i32x4 x;
    x[0] = d0;
    x[1] = d1;
    x[2] = d2;
    x[3] = d3;
    return x;
}

// The builtin `name`, or its emulation; the immediates cbsz, abid, blgp are 0
// throughout (no broadcast of a lane group's A, no swizzle of B's lanes).
#if defined(KVC_MFMA_EMULATED)
#define KVC_MFMA_CALL(name, a, b, c) kvc_mfma_emu::name<0, 0, 0>(a, b, c)
#else
#define KVC_MFMA_CALL(name, a, b, c) __builtin_amdgcn_##name(a, b, c, 0, 0, 0)
#endif

#if KVC_MFMA_HAS_F16
// f32 += f16: v_mfma_f32_16x16x16f16 (gfx94x spells it v_mfma_f32_16x16x16_f16).
__device__ __forceinline__ f32x4 mfma_f32_16x16x16_f16(f16x4 a, f16x4 b, f32x4 c) {
    return KVC_MFMA_CALL(mfma_f32_16x16x16f16, a, b, c);
}
#endif

#if KVC_MFMA_HAS_BF16
// f32 += bf16: v_mfma_f32_16x16x16bf16_1k (gfx94x: v_mfma_f32_16x16x16_bf16, re-encoded).
__device__ __forceinline__ f32x4 mfma_f32_16x16x16_bf16(bf16x4 a, bf16x4 b, f32x4 c) {
    return KVC_MFMA_CALL(mfma_f32_16x16x16bf16_1k, a, b, c);
}
#endif

#if KVC_MFMA_HAS_I8_16X16X16
// i32 += i8, four bytes a lane: v_mfma_i32_16x16x16i8 (gfx90a).
__device__ __forceinline__ i32x4 mfma_i32_16x16x16_i8(int a, int b, i32x4 c) {
    return KVC_MFMA_CALL(mfma_i32_16x16x16i8, a, b, c);
}

// 16x16x32 i8 as two 16x16x16: bytes 0-3 of a lane's operand hold k = 8g .. 8g+3,
// bytes 4-7 k = 8g+4 .. 8g+7, and 16x16x16 reads byte e of either half as its
// k = 4g+e for A and B alike, so each call sums half of the k and the two
// make the 32-term sum, exactly (integers).
__device__ __forceinline__ i32x4 mfma_i32_16x16x32_i8_by_halves(long long a, long long b, i32x4 c) {
    const unsigned long long ua = static_cast<unsigned long long>(a), ub = static_cast<unsigned long long>(b);
    const i32x4 low = mfma_i32_16x16x16_i8(int(u32(ua)), int(u32(ub)), c);
    return mfma_i32_16x16x16_i8(int(u32(ua >> 32)), int(u32(ub >> 32)), low);
}
#endif

#if KVC_MFMA_HAS_I8_16X16X32
// i32 += i8, eight bytes a lane: v_mfma_i32_16x16x32_i8 on gfx94x, two 16x16x16 on gfx90a.
__device__ __forceinline__ i32x4 mfma_i32_16x16x32_i8(long long a, long long b, i32x4 c) {
#if defined(KVC_MFMA_GFX90A)
    return mfma_i32_16x16x32_i8_by_halves(a, b, c);
#else
    return KVC_MFMA_CALL(mfma_i32_16x16x32_i8, a, b, c);
#endif
}
#endif

#if KVC_MFMA_HAS_FP8
// f32 += fp8 x fp8, both e4m3fnuz (MI300's fp8, not the cache's OCP e4m3fn):
// v_mfma_f32_16x16x32_fp8_fp8 (gfx94x).
__device__ __forceinline__ f32x4 mfma_f32_16x16x32_fp8(long long a, long long b, f32x4 c) {
    return KVC_MFMA_CALL(mfma_f32_16x16x32_fp8_fp8, a, b, c);
}
#endif

#undef KVC_MFMA_CALL

}  // namespace kvc_mfma
