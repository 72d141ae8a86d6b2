// The decode kernel reading the caller's query itself: a quad of rows loaded
// (float32 or 16-bit), scaled and rotated in float32 into the warp's rows in
// shared memory, from which Attention::run takes its score fragments.
// Included by attention.cuh.
#pragma once

#include "decode_fragments.cuh"
#include "decode_traits.cuh"
#include "merge.cuh"
#include "params.cuh"

namespace kvc_attn {

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeQuery {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  typedef DecodeFragments<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> F;
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

  // The score product's B fragments of every quad (qb), from the caller's
  // query (p.query) or, own_query, from the rows the block reads itself into
  // query_rows (the first quad's are in already): lane (g, t) holds column g of
  // each quad, the high (g even) or low (g odd) fp16 part of row g / 2. Per
  // row: row_unscale, offset_weight and zero_point_weight (what the products'
  // code offsets add to a score, per unit of OFFSET and of zero-point: sums of
  // the row as the products see it, hi + lo, high int4 nibbles' dims counted
  // 16 times for the codes), its position and whether it exists, moved to the
  // lanes t that own the row's softmax.
  static __device__ __forceinline__ void score_fragments(
      const Params& p, bool own_query, float* query_rows, int q_begin, int row_begin, int total_rows, int kv_head,
      int context, QueryBits& query_bits, u32 (&qb)[QUADS][T::kKChunks][2], float (&row_unscale)[QUADS],
      float (&offset_weight)[QUADS], float (&zero_point_weight)[QUADS], int (&row_position)[QUADS],
      bool (&row_valid)[QUADS]) {
    constexpr int KC = T::kKChunks;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad) {
      const int row = row_begin + quad * 4 + (g >> 1);
      const bool valid = row < total_rows;
      const int token = row / p.group;
      const float* q = own_query ? query_rows + (g >> 1) * HEAD_PAD
                                 : p.query + (static_cast<long long>(q_begin + token) * p.num_heads +
                                              kv_head * p.group + row % p.group) * p.head_size;
      if (own_query && quad > 0) {   // the first quad's rows are in already
        __syncwarp();   // every lane is done with the previous quad's rows
        load_query_quad(p, q_begin, row_begin + quad * 4, total_rows, kv_head, query_bits);
        rotate_query_quad(p, query_bits, query_rows);
        __syncwarp();
      }
      float values[KC][4];
      float largest = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int logical = 16 * kc + 2 * t + (i & 1) + 8 * (i >> 1);
          const int channel = F::key_dim_of(logical);
          values[kc][i] = valid && channel < p.head_size ? q[channel] : 0.f;
          largest = fmaxf(largest, fabsf(values[kc][i]));
        }
      }
      largest = max_over_quad(largest);
      // A power of two keeps the largest |q| near 2^14: inside fp16's range, and exact.
      int exponent = 0;
      frexpf(largest, &exponent);
      const float up = largest > 0.f && isfinite(largest) ? ldexpf(1.f, 14 - exponent) : 1.f;
      float sum = 0.f, code_sum = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        float part[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float high = i >= 2 ? T::kHighNibble : 1.f;   // dims 16 kc + 8.. (exact: a power of two)
          const float v = values[kc][i] * up / high;
          const float hi = F::unpack(F::pack(v, 0.f)).x;
          const float lo = F::unpack(F::pack(v - hi, 0.f)).x;
          sum += hi + lo;
          code_sum += (hi + lo) * high;
          part[i] = (g & 1) ? lo : hi;
        }
        qb[quad][kc][0] = F::pack(part[0], part[1]);
        qb[quad][kc][1] = F::pack(part[2], part[3]);
      }
      // Row t of the quad lives in lanes g = 2t, 2t + 1: lane 8t has it whole.
      const float unscale = 1.f / up, weight = T::kOffsetValue * sum_over_quad(sum);
      const float zp_weight = sum_over_quad(code_sum);
      row_unscale[quad] = __shfl_sync(0xffffffffu, unscale, 8 * t);
      offset_weight[quad] = __shfl_sync(0xffffffffu, weight, 8 * t);
      zero_point_weight[quad] = __shfl_sync(0xffffffffu, zp_weight, 8 * t);
      const int own_row = row_begin + quad * 4 + t;
      row_valid[quad] = own_row < total_rows;
      row_position[quad] = context + own_row / p.group;
    }
  }
};

}  // namespace kvc_attn
