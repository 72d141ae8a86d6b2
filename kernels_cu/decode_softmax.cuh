// The decode kernel's online softmax: which rows' positions the masks
// compare against, a round's scores to masked, capped probabilities (with
// the running maximum and sum), and the accumulators' rescaling when a
// maximum or the V reference moved. Included by attention.cuh.
#pragma once

#include "decode_fragments.cuh"
#include "decode_traits.cuh"
#include "params.cuh"
#include "ptx.cuh"

namespace kvc_attn {

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeSoftmax {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  typedef DecodeFragments<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> F;
  static constexpr int MD = T::kDimTiles, NP = T::kColumnTiles, GS = T::kRoundSteps;
  static constexpr bool kLowSlot = T::kLowSlot, kQuantized = T::kQuantized, kOffset = T::kOffset;
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

  // The round's scores to probabilities, per quad: offsets and scales applied,
  // capped (softcap), masked where a row does not see a token (skipped where
  // every row sees the whole round), the running maximum and sum moved on
  // (alpha: the factor the accumulators take; unchanged stays true only where
  // no maximum moved), and each probability times V scale / R (to_reference)
  // as the 16-bit high and low halves the output product takes.
  static __device__ __forceinline__ void probabilities(
      const Params& p, int round_first, int key_hi, int min_row_position, int max_row_position,
      const float (&score)[GS][QUADS][4], const float (&key_scale)[GS][2], const float (&key_zero_point)[GS][2],
      const float (&value_scale)[GS][2], float to_reference, const float (&row_unscale)[QUADS],
      const float (&offset_weight)[QUADS], const float (&zero_point_weight)[QUADS], const bool (&row_valid)[QUADS],
      const int (&row_position)[QUADS], float (&running_max)[QUADS], float (&running_sum)[QUADS],
      float (&alpha)[QUADS], bool& unchanged, float (&weighted_high)[GS][QUADS][2],
      float (&weighted_low)[GS][QUADS][2]) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad) {
      float s[GS][2];
      // Every row sees every token of this round (the usual decode round): no masks.
      const bool all_visible = round_first + 16 * GS <= key_hi && round_first + 16 * GS - 1 <= min_row_position &&
                               (p.window == 0 || round_first > max_row_position - p.window);
      float largest = -KVC_INFINITY;
#pragma unroll
      for (int j = 0; j < GS; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float raw = score[j][quad][2 * i] + score[j][quad][2 * i + 1];
          if constexpr (KV == KV_INT4)
            raw -= fmaf(key_zero_point[j][i], zero_point_weight[quad], offset_weight[quad]);
          else if constexpr (kOffset)
            raw -= offset_weight[quad];
          float v = raw * row_unscale[quad] * key_scale[j][i];
          if (p.softcap > 0.f) v = p.softcap * tanhf(v / p.softcap);
          s[j][i] = v;
        }
      }
      if (!all_visible) {   // uniform across the warp: a branch, not selects on every score
#pragma unroll
        for (int j = 0; j < GS; ++j) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int position = round_first + 16 * j + g + 8 * i;
            const bool visible = row_valid[quad] && position < key_hi && position <= row_position[quad] &&
                                 (p.window == 0 || position > row_position[quad] - p.window);
            if (!visible) s[j][i] = -KVC_INFINITY;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < GS; ++j) largest = fmaxf(largest, fmaxf(s[j][0], s[j][1]));
      const float tile_max = max_over_columns(largest);
      const float new_max = fmaxf(running_max[quad], tile_max);
      const float shift = new_max == -KVC_INFINITY ? 0.f : new_max;
      alpha[quad] = new_max == running_max[quad] ? 1.f : fast_exp2((running_max[quad] - shift) * kLog2e);
      unchanged = unchanged && alpha[quad] == 1.f;
      running_max[quad] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < GS; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float prob = fast_exp2((s[j][i] - shift) * kLog2e);
          sum += prob;
          // A token no row here sees adds nothing, even with a NaN scale.
          const float w = prob == 0.f ? 0.f : prob * (kQuantized ? value_scale[j][i] * to_reference : 1.f);
          weighted_high[j][quad][i] = F::unpack(F::pack(w, 0.f)).x;
          weighted_low[j][quad][i] = F::unpack(F::pack(w - weighted_high[j][quad][i], 0.f)).x;
        }
      }
      running_sum[quad] = running_sum[quad] * alpha[quad] + sum;
    }
  }
};

}  // namespace kvc_attn
