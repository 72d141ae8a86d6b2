// Pieces of the decode kernel's online softmax that stand apart from its
// round (the round itself, Attention::run's loop over a tile's steps, turns
// scores into masked, capped probabilities and keeps the running maximum,
// sum and V reference): which rows' positions the masks compare against,
// and the accumulators' rescaling when a maximum or the reference moved.
// Included by attention.cuh.
#pragma once

#include "decode_traits.cuh"
#include "ptx.cuh"

namespace kvc_attn {

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeSoftmax {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  static constexpr int MD = T::kDimTiles, NP = T::kColumnTiles;
  static constexpr bool kLowSlot = T::kLowSlot;
  static constexpr float kLog2e = 1.4426950408889634f;

  // Extremes over the tile's valid rows (the same in every lane): masks can be
  // skipped for a step that every row sees whole. Rows past the end are left
  // unmasked then: they only ever feed outputs that are never written.
  static __device__ __forceinline__ void row_position_range(const bool (&row_valid)[QUADS],
                                                            const int (&row_position)[QUADS], int& min_row_position,
                                                            int& max_row_position) {
    min_row_position = 0x7fffffff, max_row_position = -1;
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad) {
      if (row_valid[quad]) {
        min_row_position = min(min_row_position, row_position[quad]);
        max_row_position = max(max_row_position, row_position[quad]);
      }
    }
    for (int offset = 16; offset >= 1; offset /= 2) {
      min_row_position = min(min_row_position, __shfl_xor_sync(0xffffffffu, min_row_position, offset));
      max_row_position = max(max_row_position, __shfl_xor_sync(0xffffffffu, max_row_position, offset));
    }
  }

  // Rescale the accumulators, unless no row's max and not R moved (the common
  // case once a few tiles are in). Column 2t + j is this lane's row of quad 2 np + j.
  static __device__ __forceinline__ void rescale(const float (&alpha)[QUADS], float rescale_values, bool unchanged,
                                                 float (&acc)[MD][NP][4]) {
    if (!__all_sync(0xffffffffu, unchanged)) {
#pragma unroll
      for (int np = 0; np < NP; ++np) {
        const float f0 = alpha[2 * np] * rescale_values;
        const int second = kLowSlot && np == NP - 1 ? 2 * np : min(2 * np + 1, QUADS - 1);
        const float f1 = alpha[second] * rescale_values;
#pragma unroll
        for (int md = 0; md < MD; ++md) {
          acc[md][np][0] *= f0;
          acc[md][np][1] *= f1;
          acc[md][np][2] *= f0;
          acc[md][np][3] *= f1;
        }
      }
    }
  }
};

}  // namespace kvc_attn
