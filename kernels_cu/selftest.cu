// selftest: the smallest kernel kvcupy ships. The JIT tests and `kvcupy check`
// compile it to prove that the sources (with the headers they include) reach
// an installed wheel, that NVRTC finds its bundled <cuda_fp16.h> and
// <cuda_bf16.h> (jit.cuda_include_options), and that -D defines reach the code:
// KVC_SELFTEST_T is an input type spelt as formats.CPP_TYPES spells it,
// KVC_SELFTEST_SCALE a constant.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "types.cuh"

#ifndef KVC_SELFTEST_T
#define KVC_SELFTEST_T float
#endif
#ifndef KVC_SELFTEST_SCALE
#define KVC_SELFTEST_SCALE 2
#endif

// kvc's 16-bit types hold the same bits as CUDA's: either may view a buffer.
static_assert(sizeof(kvc::half) == sizeof(__half) && sizeof(kvc::bfloat16) == sizeof(__nv_bfloat16),
              "kvc::half / kvc::bfloat16 must match CUDA's layouts");

// y[i] = float(x[i]) * KVC_SELFTEST_SCALE for i < n.
extern "C" __global__ void kvc_selftest_scale(const KVC_SELFTEST_T* __restrict__ x,
                                              float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = kvc::to_float(x[i]) * KVC_SELFTEST_SCALE;
}
