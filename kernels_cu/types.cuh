// The model dtypes as kernels see them, without CUDA's own fp16/bf16 headers:
// NVRTC from the pip wheel ships no cuda_fp16.h / cuda_bf16.h, so the few
// conversions kernels need are written here in PTX (sm_80 and newer).
// formats.CPP_TYPES names these types; kernels get them as -D defines.
//
// The portable primitives: everything the write, rotate, copy and merge
// kernels do that is PTX or a warp intrinsic goes through the functions of the
// one block below. A build without PTX (kernels_hip/hip_compat.h, included
// first: HIP, or NVRTC running the HIP build on an NVIDIA GPU) defines
// KVC_NO_PTX and the same functions for waves of 64 lanes.
#pragma once

namespace kvc {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned long long u64;

#define KVC_INFINITY __int_as_float(0x7f800000)

#ifndef KVC_NO_PTX
constexpr int kWaveLanes = 32;   // lanes that run together: a warp
using LaneMask = u32;            // a bit a lane of the wave

__device__ __forceinline__ int lane_in_wave() { return threadIdx.x & (kWaveLanes - 1); }

// value of lane (own lane ^ lane_mask) in the same `width`-lane segment; mask: the lanes taking part.
template <class T>
__device__ __forceinline__ T exchange_lanes(LaneMask mask, T value, int lane_mask, int width) {
  return __shfl_xor_sync(mask, value, lane_mask, width);
}
// The lanes of `mask` see each other's shared-memory writes made before.
__device__ __forceinline__ void sync_lanes(LaneMask mask) { __syncwarp(mask); }

// Hides x's value from the optimiser (costs nothing, moves nothing).
__device__ __forceinline__ void opaque_register(u32& x) { asm volatile("" : "+r"(x)); }

// min / max that return NaN when either operand is NaN (PTX ISA 7.0, sm_80):
// a vector's range then carries any NaN or inf, which is the non-finite test.
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// IEEE half and bfloat16 bits, rounded to nearest even.
__device__ __forceinline__ float f16_bits_to_float(u16 bits) {
  float f;
  asm("{.reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "h"(bits));
  return f;
}
__device__ __forceinline__ u16 f16_bits_of(float x) {
  u16 bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
  return bits;
}
__device__ __forceinline__ u16 bf16_bits_of(float x) {
  u16 bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
  return bits;
}

// Pairs packed in 32 bits: the first value in the low half (mma's operand order).
__device__ __forceinline__ u32 pack_half2(float first, float second) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
  return r;
}
__device__ __forceinline__ u32 pack_bf162(float first, float second) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
  return r;
}
__device__ __forceinline__ float2 unpack_half2(u32 x) {
  float2 f;
  asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi;}"
      : "=f"(f.x), "=f"(f.y) : "r"(x));
  return f;
}
#endif

// The mask of the WIDTH consecutive lanes (a power of two) that hold `lane`.
template <int WIDTH>
__device__ __forceinline__ LaneMask segment_lanes(int lane) {
  return WIDTH == kWaveLanes ? ~LaneMask(0) : ((LaneMask(1) << WIDTH) - 1u) << (lane & ~(WIDTH - 1));
}

struct half { u16 bits; };
struct bfloat16 { u16 bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) { return f16_bits_to_float(x.bits); }
__device__ __forceinline__ float to_float(bfloat16 x) { return __uint_as_float(u32(x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half from_float<half>(float x) { return half{f16_bits_of(x)}; }
template <> __device__ __forceinline__ bfloat16 from_float<bfloat16>(float x) { return bfloat16{bf16_bits_of(x)}; }
__device__ __forceinline__ float2 unpack_bf162(u32 x) {
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}

}  // namespace kvc
