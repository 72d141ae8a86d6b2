// wgmma_check: the two warpgroup products of prefill.cuh (wgmma.cuh) on small
// tiles, for tests/gpu/test_wgmma.py to compare with NumPy. One warpgroup
// (128 threads), sm_90a builds only. `swap` exchanges a descriptor's two
// strides: the test shows that the product then goes wrong, i.e. that it
// pins which stride is which.
#include "../../../kernels_cu/ptx.cuh"   // fence_proxy_async
#include "../../../kernels_cu/wgmma.cuh"

using kvc::u16;
using kvc::u32;
using kvc::u8;
using namespace kvc_wgmma;

constexpr int kDims = 32;     // K of the score product: two k steps
constexpr int kTokens = 64;   // N of the score product, K of the output product
constexpr int kOut = 64;      // N of the output product

// Element (row, col) of a [rows][cols] fp16 array, into the core-matrix layout.
template <int ROWS, int COLS>
__device__ void to_core(const u16* from, u8* to) {
  for (int i = threadIdx.x; i < ROWS * COLS; i += blockDim.x)
    *reinterpret_cast<u16*>(to + core_offset(i / COLS, i % COLS, COLS)) = from[i];
}

__device__ void store(const float (&d)[8][4], float* out) {   // accumulators of a 64 x 64 product
  const int warp = threadIdx.x >> 5, g = (threadIdx.x >> 2) & 7, t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) out[(16 * warp + g + 8 * (i >> 1)) * 64 + 8 * j + 2 * t + (i & 1)] = d[j][i];
}

// scores[64 x kTokens] = query[64 x kDims] . keys[kTokens x kDims]^T (prefill: S = Q K^T).
extern "C" __global__ void __launch_bounds__(128) wgmma_scores(const u16* query, const u16* keys, float* scores,
                                                               int swap) {
  __shared__ __align__(128) u8 query_rows[2 * 64 * kDims * 2], key_rows[2 * kTokens * kDims * 2];
  to_core<64, kDims>(query, query_rows);
  to_core<kTokens, kDims>(keys, key_rows);
  kvc::fence_proxy_async();
  __syncthreads();
  const u32 along_k = swap ? 16 * kDims : 128, along_mn = swap ? 128 : 16 * kDims;
  float d[kTokens / 8][4] = {};
  hold(d);
  fence();
#pragma unroll
  for (int kc = 0; kc < kDims / 16; ++kc)
    Products<kTokens>::ss(d, descriptor(query_rows + 256 * kc, along_k, along_mn),
                          descriptor(key_rows + 256 * kc, along_k, along_mn));
  commit();
  wait<0>();
  hold(d);
  store(d, scores);
}

// out[64 x kOut] = p[64 x kTokens] . values[kTokens x kOut] (prefill: O = P V, P from registers).
extern "C" __global__ void __launch_bounds__(128) wgmma_values(const u16* p, const u16* values, float* out,
                                                               int swap) {
  // Twice the rows' bytes: with swapped strides the product reads past them (still in bounds).
  __shared__ __align__(128) u8 value_rows[2 * kTokens * kOut * 2];
  to_core<kTokens, kOut>(values, value_rows);
  kvc::fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x >> 5, g = (threadIdx.x >> 2) & 7, t = threadIdx.x & 3;
  const u32 along_k = swap ? 128 : 16 * kOut, along_mn = swap ? 16 * kOut : 128;
  float d[kOut / 8][4] = {};
  hold(d);
  fence();
#pragma unroll
  for (int j = 0; j < kTokens / 16; ++j) {
    // The m16n8k16 A fragment of rows 16 warp + g (+8), columns 16 j + 2t (+1, +8, +9).
    const u16* row = p + (16 * warp + g) * kTokens + 16 * j + 2 * t;
    const u32 a[4] = {*reinterpret_cast<const u32*>(row), *reinterpret_cast<const u32*>(row + 8 * kTokens),
                      *reinterpret_cast<const u32*>(row + 8), *reinterpret_cast<const u32*>(row + 8 * kTokens + 8)};
    Products<kOut>::rs_mn(d, a, descriptor(value_rows + 32 * j * kOut, along_k, along_mn));
  }
  commit();
  wait<0>();
  hold(d);
  store(d, out);
}
