// The decode kernel reading the caller's query itself: a quad of rows loaded
// (float32 or 16-bit), scaled and rotated in float32 into the warp's rows in
// shared memory, from which Attention::run takes its score fragments.
// Included by attention.cuh.
#pragma once

#include "decode_traits.cuh"
#include "merge.cuh"
#include "params.cuh"

namespace kvc_attn {

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeQuery {
  // Decode reading the caller's query (p.query null): the 4 rows of one quad,
  // row_begin .. row_begin + 3 of the tile (rows past total_rows zero), into
  // rows[r][channel] in float32: times query_factor and, where sign_shift >= 0,
  // rotated (s * x, then H_b on every block of b = 2^sign_shift channels,
  // warp_butterflies: as the rotate kernel would, in float32, a few ulp
  // against its float64). This replaces a rotate launch, and its float32
  // round trip through global memory, per decode step. In two steps: the
  // loads (a value's bits: float32, or a 16-bit value in the low half) and
  // the rotation, which run() does for the first quad before the first tiles'
  // copies go out (see there).
  static constexpr int kQuerySlots = HEAD_PAD / 32;
  // The quad's rows (a value's bits each) and, where the query is rotated, the
  // sign words of its channels lane + 32 k.
  struct QueryBits {
    u32 rows[4][kQuerySlots];
    u32 signs[kQuerySlots];
  };

  static __device__ __forceinline__ void load_query_quad(const Params& p, int q_begin, int row_begin,
                                                         int total_rows, int kv_head, QueryBits& bits) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = row_begin + r;
      const bool valid = row < total_rows;
      const long long start = valid ? (q_begin + row / p.group) * p.q_token_stride +
                                          static_cast<long long>(kv_head * p.group + row % p.group) * p.q_head_stride
                                    : 0;
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) {
        const int channel = lane + 32 * k;
        u32 b = 0u;   // 0.0 in every dtype
        if (valid && channel < p.head_size) {
          b = p.query_dtype == kDtypeF32 ? __float_as_uint(static_cast<const float*>(p.query_in)[start + channel])
                                         : u32(static_cast<const u16*>(p.query_in)[start + channel]);
        }
        bits.rows[r][k] = b;
      }
    }
    // The signs too: loaded later, they would queue behind every block's first
    // copies and hold the block out of its loop.
#pragma unroll
    for (int k = 0; k < kQuerySlots; ++k) bits.signs[k] = p.sign_shift >= 0 ? __ldg(p.signs + k) : 0u;
  }

  static __device__ __forceinline__ void rotate_query_quad(const Params& p, const QueryBits& bits, float* rows) {
    const int lane = threadIdx.x & 31;
    float v[4][kQuerySlots];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) {
        const u32 b = bits.rows[r][k];
        v[r][k] = p.query_dtype == kDtypeF32   ? __uint_as_float(b)
                  : p.query_dtype == kDtypeF16 ? kvc::to_float(kvc::half{u16(b)})
                                               : kvc::to_float(kvc::bfloat16{u16(b)});
      }
    if (p.sign_shift >= 0) {
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) {
        const u32 negative = (bits.signs[k] >> lane) & 1u;   // channel lane + 32 k
#pragma unroll
        for (int r = 0; r < 4; ++r) v[r][k] = negative ? -v[r][k] : v[r][k];
      }
      warp_butterflies(v, lane, p.sign_shift);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) rows[r * HEAD_PAD + lane + 32 * k] = v[r][k] * p.query_factor;
  }
};

}  // namespace kvc_attn
