// A split's partial state, which merge_splits (merge.cuh) combines: per row
// its running maximum and sum (part_stats) and its output accumulators
// (part_out). The index helpers serve the prefill kernel too. Included by
// attention.cuh.
#pragma once

#include "decode_fragments.cuh"
#include "params.cuh"
#include "ptx.cuh"

namespace kvc_attn {

// Row `row` (query token q_begin + row / group, query head kv_head x group +
// row % group) of split `split`: its index in part_stats (2 words each) and
// part_out (head_size each); split_rows = split x num_tokens.
__device__ __forceinline__ long long part_index(const Params& p, long long split_rows, int q_begin, int row,
                                                int kv_head) {
  return (split_rows + q_begin + row / p.group) * p.num_heads + kv_head * p.group + row % p.group;
}

// Its running maximum (natural units) and sum, stored by one lane.
__device__ __forceinline__ void store_part_stats(const Params& p, long long index, float running_max, float sum) {
  p.part_stats[2 * index] = running_max;
  p.part_stats[2 * index + 1] = sum;
}

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeEpilogue {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  typedef DecodeFragments<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> F;
  static constexpr int MD = T::kDimTiles, NP = T::kColumnTiles;
  static constexpr bool kLowSlot = T::kLowSlot;

  // Partial state of this split: max and sum per row (lanes g == 0), and the
  // accumulators times R in the cache's channel order.
  static __device__ __forceinline__ void store(const Params& p, int g, int t, int split, int row_begin, int q_begin,
                                               int kv_head, const bool (&row_valid)[QUADS],
                                               const float (&running_max)[QUADS], const float (&running_sum)[QUADS],
                                               float reference, const float (&acc)[MD][NP][4]) {
    const long long split_rows = static_cast<long long>(split) * p.num_tokens;
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad) {
      const int row = row_begin + quad * 4 + t;
      const float sum = sum_over_columns(running_sum[quad]);
      // Columns 2t (+ 2t + 1 for the low halves) of tile quad / 2 hold this row.
      const int np = quad / 2, j = quad % 2;
      const bool with_low = kLowSlot && np == NP - 1;
      if (!row_valid[quad]) continue;
      const long long index = part_index(p, split_rows, q_begin, row, kv_head);
      if (g == 0) store_part_stats(p, index, running_max[quad], sum);
      float* destination = p.part_out + index * p.head_size;
#pragma unroll
      for (int md = 0; md < MD; ++md) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int channel = F::value_dim_of(16 * md + g + 8 * r);
          const float unit = r ? reference / T::kHighNibble : reference;
          const float accumulated = with_low ? acc[md][np][2 * r] + acc[md][np][2 * r + 1] : acc[md][np][2 * r + j];
          if (channel < p.head_size) destination[channel] = accumulated * unit;
        }
      }
    }
  }
};

}  // namespace kvc_attn
