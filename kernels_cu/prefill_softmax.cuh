// Online softmax over a block's score tiles, FlashAttention-style, a tile at
// a time: its scores capped, masked and in "row units" with each row's maxima
// (row_unit_scores), and its P operand with each row's sums
// (probabilities). Each row's query was scaled by a power of two (the query
// operand, prefill.cuh's run()), undone by row_unscale; the output
// accumulators hold sum p x V scale / R, R the largest V scale seen so far,
// so that the P operand stays in [0, 1] whatever the scales. The running
// maxima, sums and R, and the accumulators' rescaling, are the tile loop's
// (prefill.cuh: softmax_tile).
#pragma once

#include "prefill_traits.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillSoftmax : Ktraits {
  using Ktraits::NT;
  using Ktraits::kDecoded;
  using Ktraits::kUnitScales;
  using Ktraits::kSplitP;
  using Ktraits::pack;
  using Ktraits::unpack;

  // Scores of a tile in "row units": z = (q x 2^k) . k x key scale, the row's
  // true logit times 2^k (its query scaling, a power of two: exact); capped;
  // with MASKED, -inf where the row does not see the token. The row maxima.
  template <bool MASKED>
  static __device__ __forceinline__ void row_unit_scores(float (&score)[NT][4], const float* key_scales,
                                                         const Params& p, int base, int t, int key_hi,
                                                         const int (&row_position)[2], const bool (&row_valid)[2],
                                                         const float (&row_unscale)[2], float (&tile_max)[2]) {
    // Four independent chains a row (n odd or even, i odd or even), not one: a
    // row's 16 maxima would otherwise wait on each other's latency.
    float chain[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) chain[r][c] = -KVC_INFINITY;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float2 key_scale = kDecoded && !kUnitScales
                                   ? *reinterpret_cast<const float2*>(key_scales + 8 * n + 2 * t)
                                   : make_float2(1.f, 1.f);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1;
        float z = score[n][i] * (i & 1 ? key_scale.y : key_scale.x);
        if (p.softcap > 0.f) z = p.softcap * tanhf(z * row_unscale[r] / p.softcap) / row_unscale[r];
        if constexpr (MASKED) {
          const int position = base + 8 * n + 2 * t + (i & 1);
          const bool visible = row_valid[r] && position < key_hi && position <= row_position[r] &&
                               (p.window == 0 || position > row_position[r] - p.window);
          if (!visible) z = -KVC_INFINITY;
        }
        score[n][i] = z;
        float& link = chain[r][2 * (n & 1) + (i & 1)];
        link = fmaxf(link, z);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
      tile_max[r] = fmaxf(tile_max[r], fmaxf(fmaxf(chain[r][0], chain[r][1]), fmaxf(chain[r][2], chain[r][3])));
  }

  // The P operand: p = 2^(z c - shift) (c = 2^-k log2 e) times V scale / R, as
  // fp16 (bf16: high and low) pairs; the row sums of p. With MASKED, a masked
  // token (p = 0) adds nothing even with a NaN scale.
  template <bool MASKED>
  static __device__ __forceinline__ void probabilities(const float (&score)[NT][4], const float* value_scales,
                                                       float to_reference, const float (&exp_scale)[2],
                                                       const float (&shift)[2], int t, u32 (&p_high)[NT][2],
                                                       u32 (&p_low)[kSplitP ? NT : 1][2], float (&tile_sum)[2]) {
    float chain[2][4] = {};   // four independent sums a row, as in row_unit_scores
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float2 value_scale = kDecoded && !kUnitScales
                               ? *reinterpret_cast<const float2*>(value_scales + 8 * n + 2 * t)
                               : make_float2(1.f, 1.f);
      value_scale.x *= to_reference;
      value_scale.y *= to_reference;
      float w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float prob = fast_exp2(fmaf(score[n][i], exp_scale[i >> 1], -shift[i >> 1]));
        chain[i >> 1][2 * (n & 1) + (i & 1)] += prob;
        w[i] = kDecoded ? prob * (i & 1 ? value_scale.y : value_scale.x) : prob;
        if (kDecoded && !kUnitScales && MASKED && prob == 0.f) w[i] = 0.f;
      }
      p_high[n][0] = pack(w[0], w[1]);
      p_high[n][1] = pack(w[2], w[3]);
      if constexpr (kSplitP) {
        const float2 h0 = unpack(p_high[n][0]), h1 = unpack(p_high[n][1]);
        p_low[n][0] = pack(w[0] - h0.x, w[1] - h0.y);
        p_low[n][1] = pack(w[2] - h1.x, w[3] - h1.y);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) tile_sum[r] += (chain[r][0] + chain[r][1]) + (chain[r][2] + chain[r][3]);
  }
};

}  // namespace kvc_attn
