// The model dtypes as kernels see them, without CUDA's own fp16/bf16 headers:
// NVRTC from the pip wheel ships no cuda_fp16.h / cuda_bf16.h, so the few
// conversions kernels need are written here in PTX (sm_80 and newer).
// formats.CPP_TYPES names these types; kernels get them as -D defines.
#pragma once

namespace kvc {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned long long u64;

#define KVC_INFINITY __int_as_float(0x7f800000)

struct half { u16 bits; };
struct bfloat16 { u16 bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) {
  float f;
  asm("{.reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bfloat16 x) { return __uint_as_float(u32(x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half from_float<half>(float x) {
  u16 bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
  return half{bits};
}
template <> __device__ __forceinline__ bfloat16 from_float<bfloat16>(float x) {
  u16 bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
  return bfloat16{bits};
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
__device__ __forceinline__ float2 unpack_bf162(u32 x) {
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}

}  // namespace kvc
