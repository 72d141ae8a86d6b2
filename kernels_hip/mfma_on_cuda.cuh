// The CDNA MFMA instructions mfma.h wraps, for NVRTC on an NVIDIA GPU: one
// 64-thread wave of wave64_on_cuda.cuh (two warps) computes what one AMD wave's
// instruction would. Lane layouts are the closed forms of the AMD matrix
// instruction calculator (ROCm/amd_matrix_instruction_calculator), with
// g = l / 16 the lane's group of 16:
//   16x16x16 (f16, bf16, 8-bit): lane l holds A[l%16][4g+e], B[4g+e][l%16];
//   16x16x32 (8-bit):            lane l holds A[l%16][8g+e], B[8g+e][l%16];
//   C and D, both:               lane l holds D[4g+e][l%16] (e = 0..3).
// Element e of an operand sits as in its registers: 16-bit e in bits
// 16*(e%2) of word e/2, byte e in bits 8*(e%4) of word e/4 (little-endian).
//
// Each lane stages its operand words in shared memory at those positions,
// the wave meets at its barrier, and each lane then computes its own four D
// elements from the staged A rows and B column; a second barrier keeps the
// next instruction's staging from overwriting rows still being read. So, as
// on AMD, every lane of the wave must take part, and the block must hold
// whole waves. Included by mfma.h, which names these for kernels.
#pragma once

#include "hip_compat.h"   // the wave (wave64_on_cuda.cuh) and kvc_hip::f16_bits_to_float

namespace kvc_mfma_emu {

typedef unsigned int u32;

// Operands as the registers hold them; the accumulators are four 32-bit values.
struct f16x4 { u32 words[2]; };    // IEEE half bits
struct bf16x4 { u32 words[2]; };   // bfloat16 bits
struct f32x4 {
    float v[4];
    __device__ __forceinline__ float& operator[](int e) { return v[e]; }
    __device__ __forceinline__ float operator[](int e) const { return v[e]; }
};
struct i32x4 {
    int v[4];
    __device__ __forceinline__ int& operator[](int e) { return v[e]; }
    __device__ __forceinline__ int operator[](int e) const { return v[e]; }
};

// MI300's fp8 (gfx940/941/942) is e4m3fnuz, not OCP e4m3fn: exponent bias 8,
// no infinities, no negative zero, 0x80 the only NaN (ROCm HIP docs, "FP8
// Numbers"; composable_kernel ck_tile/core/numeric/float8.hpp). Exact.
__device__ __forceinline__ float e4m3fnuz_to_float(u32 code) {
    code &= 0xffu;
    if (code == 0x80u) return __uint_as_float(0x7fc00000u);
    const u32 sign = (code & 0x80u) << 24, exponent = (code >> 3) & 0xfu, mantissa = code & 7u;
    const float magnitude = exponent == 0 ? float(mantissa) * 0.0009765625f   // subnormal: mantissa x 2^-10
                                          : __uint_as_float(((exponent + 119u) << 23) | (mantissa << 20));
    return __uint_as_float(__float_as_uint(magnitude) | sign);
}

__device__ __forceinline__ float f16_to_float(u32 bits) { return kvc_hip::f16_bits_to_float((unsigned short)bits); }
__device__ __forceinline__ float bf16_to_float(u32 bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ int i8_value(u32 bits) { return int(bits ^ 0x80u) - 0x80; }   // sign-extended byte

// A row of A, or a column of B, staged: 16 16-bit or 32 8-bit elements, in 8 words.
constexpr int kLineWords = 8;

struct Staging {
    u32 a[16 * kLineWords];   // row i of A at words kLineWords * i ..
    u32 b[16 * kLineWords];   // column j of B at words kLineWords * j ..
};

__device__ __forceinline__ Staging& wave_staging() {
    __shared__ Staging waves[kvc_wave64::kMaxWaves];
    return waves[kvc_wave64::wave()];
}

// Lane l's `count` words of A (row l%16) and of B (column l%16) go to words
// count * (l/16) .. of that line: the group's k, in order.
template <int count>
__device__ __forceinline__ const Staging& stage(const u32 (&a)[count], const u32 (&b)[count]) {
    Staging& staging = wave_staging();
    const int l = kvc_wave64::lane(), at = (l % 16) * kLineWords + (l / 16) * count;
#pragma unroll
    for (int i = 0; i < count; ++i) {
        staging.a[at + i] = a[i];
        staging.b[at + i] = b[i];
    }
    kvc_wave64::wave_barrier();
    return staging;
}

// Element k of a staged line of `bits`-wide elements.
template <int bits>
__device__ __forceinline__ u32 element(const u32* line, int k) {
    constexpr int per_word = 32 / bits;
    return (line[k / per_word] >> (bits * (k % per_word))) & ((1u << bits) - 1u);
}

// The lane's D[4g+e][l%16] = C + sum over k of A[4g+e][k] * B[k][l%16]: in
// f32, one fused multiply-add a k from k = 0 up. AMD documents no order or
// rounding within one instruction, so only sums exact in f32 compare equal to
// the hardware's; MI200's flushing of subnormal f16 / bf16 inputs and outputs
// (MIOpen docs, "MI200 MFMA behavior specifics") is not modelled.
template <int bits, int depth, class Decode>
__device__ __forceinline__ f32x4 float_products(const Staging& staging, f32x4 c, Decode decode) {
    const int l = kvc_wave64::lane();
    const u32* column = staging.b + (l % 16) * kLineWords;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const u32* row = staging.a + (4 * (l / 16) + e) * kLineWords;
        float sum = c[e];
        for (int k = 0; k < depth; ++k) sum = fmaf(decode(element<bits>(row, k)), decode(element<bits>(column, k)), sum);
        c[e] = sum;
    }
    kvc_wave64::wave_barrier();   // the wave's reads end before any lane stages again
    return c;
}

// As float_products for signed bytes: exact, the int32 sum wrapping as the hardware's does.
template <int depth>
__device__ __forceinline__ i32x4 int_products(const Staging& staging, i32x4 c) {
    const int l = kvc_wave64::lane();
    const u32* column = staging.b + (l % 16) * kLineWords;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const u32* row = staging.a + (4 * (l / 16) + e) * kLineWords;
        u32 sum = u32(c[e]);
        for (int k = 0; k < depth; ++k) sum += u32(i8_value(element<8>(row, k)) * i8_value(element<8>(column, k)));
        c[e] = int(sum);
    }
    kvc_wave64::wave_barrier();
    return c;
}

// cbsz, abid (broadcast of one lane group's A) and blgp (B lane swizzle) are
// not modelled: the calculator reports CBSZ/ABID unsupported for these
// instructions, and BLGP on CDNA3 too.
template <int cbsz, int abid, int blgp>
__device__ __forceinline__ void require_no_modifiers() {
    static_assert(cbsz == 0 && abid == 0 && blgp == 0, "the MFMA emulation takes cbsz = abid = blgp = 0 only");
}

__device__ __forceinline__ u32 low_word(long long x) { return u32(static_cast<unsigned long long>(x)); }
__device__ __forceinline__ u32 high_word(long long x) { return u32(static_cast<unsigned long long>(x) >> 32); }

// The builtins of the same names (clang's BuiltinsAMDGPU.def), the immediates as template arguments.
template <int cbsz = 0, int abid = 0, int blgp = 0>
__device__ __forceinline__ f32x4 mfma_f32_16x16x16f16(f16x4 a, f16x4 b, f32x4 c) {
    require_no_modifiers<cbsz, abid, blgp>();
    return float_products<16, 16>(stage<2>(a.words, b.words), c, f16_to_float);
}

template <int cbsz = 0, int abid = 0, int blgp = 0>
__device__ __forceinline__ f32x4 mfma_f32_16x16x16bf16_1k(bf16x4 a, bf16x4 b, f32x4 c) {
    require_no_modifiers<cbsz, abid, blgp>();
    return float_products<16, 16>(stage<2>(a.words, b.words), c, bf16_to_float);
}

template <int cbsz = 0, int abid = 0, int blgp = 0>
__device__ __forceinline__ i32x4 mfma_i32_16x16x16i8(int a, int b, i32x4 c) {
    require_no_modifiers<cbsz, abid, blgp>();
    const u32 a_words[1] = {u32(a)}, b_words[1] = {u32(b)};
    return int_products<16>(stage<1>(a_words, b_words), c);
}

template <int cbsz = 0, int abid = 0, int blgp = 0>
__device__ __forceinline__ i32x4 mfma_i32_16x16x32_i8(long long a, long long b, i32x4 c) {
    require_no_modifiers<cbsz, abid, blgp>();
    const u32 a_words[2] = {low_word(a), high_word(a)}, b_words[2] = {low_word(b), high_word(b)};
    return int_products<32>(stage<2>(a_words, b_words), c);
}

// A and B both e4m3fnuz.
template <int cbsz = 0, int abid = 0, int blgp = 0>
__device__ __forceinline__ f32x4 mfma_f32_16x16x32_fp8_fp8(long long a, long long b, f32x4 c) {
    require_no_modifiers<cbsz, abid, blgp>();
    const u32 a_words[2] = {low_word(a), high_word(a)}, b_words[2] = {low_word(b), high_word(b)};
    return float_products<8, 32>(stage<2>(a_words, b_words), c, e4m3fnuz_to_float);
}

}  // namespace kvc_mfma_emu
