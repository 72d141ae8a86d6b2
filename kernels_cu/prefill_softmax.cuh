// Online softmax over a block's score tiles, FlashAttention-style, a tile at a
// time: its scores capped, masked and in "row units" with each row's maxima
// (row_unit_scores), and its P operand with each row's sums (probabilities).
// Each row's query was scaled by a power of two (the query operand:
// prefill.cuh's run(), or direct_query), undone by row_unscale; the output
// accumulators hold sum p x V scale / R, R the largest V scale seen so far, so
// that the P operand stays in [0, 1] whatever the scales. PrefillRows keeps a
// warp's running maxima, sums, R and accumulators between tiles, and folds each
// tile in (softmax_tile, rescale_out) for the mainloops.
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

// A warp's rows g and g + 8 (r = 0, 1) through a mainloop: what the masks
// read (positions, validity, the query's scaling), fixed before the first
// tile, and the online softmax's running state (row maxima and sums, R, the
// output accumulators). Thread (g, t) holds tokens 8 n + 2t (+1) of score
// tile n and channels 8 n + 2t (+1) of output tile n.
template <class Ktraits>
struct PrefillRows : PrefillSoftmax<Ktraits> {
  using Ktraits::NT;
  using Ktraits::ND;
  using Ktraits::TILE;
  using Ktraits::kDecoded;
  using Ktraits::kUnitScales;
  using Ktraits::kSplitP;
  using Ktraits::kProbabilityLift;
  typedef PrefillSoftmax<Ktraits> Softmax;

  int row_position[2];   // the rows' key positions: each sees keys up to its own
  bool row_valid[2];
  float row_unscale[2];  // undoes the query's power-of-two scaling
  float exp_scale[2];    // row_unscale x log2(e)
  int min_position, max_position;   // over the warp's (wgmma: warpgroup's) rows
  int key_hi, t;
  float out[ND][4];
  float running_max[2], running_sum[2];
  float reference;       // R: the V scale the accumulators are in

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[n][i] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) running_max[r] = -KVC_INFINITY, running_sum[r] = 0.f;
    reference = kDecoded && !kUnitScales ? 0.f : 1.f;
  }

  // Whether no row sees a key of the tile at `base` (causal, window).
  __device__ __forceinline__ bool unseen(const Params& p, int base) const {
    return max_position < 0 || base > max_position || (p.window != 0 && base + TILE - 1 <= min_position - p.window);
  }

  // A tile's softmax, its scores in `score` (in place), its decoded scales: the
  // running maxima, sums and R updated, P in p_high (bf16: and p_low);
  // returns the factors of the accumulators' rows g and g + 8 for the tile.
  __device__ __forceinline__ float2 softmax_tile(const Params& p, float (&score)[NT][4], const float* key_scales,
                                                 const float* value_scales, int base, u32 (&p_high)[NT][2],
                                                 u32 (&p_low)[kSplitP ? NT : 1][2]) {
    // Scores in "row units" (z = q_up . k x key scale: the row's true logit
    // times 2^k, the row's query scaling, exact), capped and masked; the tile's
    // maximum per row. The softmax then works in log2 units through one FMA a
    // score: p = 2^(z c - m c), c = 2^-k log2(e).
    const bool all_visible = base + TILE <= key_hi && base + TILE - 1 <= min_position &&
                             (p.window == 0 || base > max_position - p.window);
    float tile_max[2] = {-KVC_INFINITY, -KVC_INFINITY};
    // Uniform across the warp: two code paths, not selects on every score.
    if (all_visible)
      Softmax::template row_unit_scores<false>(score, key_scales, p, base, t, key_hi, row_position, row_valid,
                                               row_unscale, tile_max);
    else
      Softmax::template row_unit_scores<true>(score, key_scales, p, base, t, key_hi, row_position, row_valid,
                                              row_unscale, tile_max);
    // V scales of the tile: the new reference R.
    float tile_reference = reference;
    if constexpr (kDecoded && !kUnitScales) {
      float chain[4] = {};   // independent chains, as in row_unit_scores
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float2 scale = *reinterpret_cast<const float2*>(value_scales + 8 * n + 2 * t);
        chain[n & 3] = fmaxf(chain[n & 3], fmaxf(scale.x, scale.y));
      }
      float largest = fmaxf(fmaxf(chain[0], chain[1]), fmaxf(chain[2], chain[3]));
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
      tile_reference = fmaxf(reference, largest);
    }
    const float rescale_values = kUnitScales || tile_reference == reference ? 1.f
                                 : tile_reference > 0.f ? __fdividef(reference, tile_reference) : 0.f;
    const float to_reference = kUnitScales ? kProbabilityLift
                               : tile_reference > 0.f ? __fdividef(kProbabilityLift, tile_reference)
                                                      : kProbabilityLift;
    reference = tile_reference;

    float alpha[2], shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m = max_over_quad(tile_max[r]);
      const float new_max = fmaxf(running_max[r], m);
      shift[r] = new_max == -KVC_INFINITY ? 0.f : new_max * exp_scale[r];
      alpha[r] = new_max == running_max[r] ? 1.f : fast_exp2(fmaf(running_max[r], exp_scale[r], -shift[r]));
      running_max[r] = new_max;
    }
    // Probabilities times V scale / R, as the P operand's fp16 (bf16) pairs.
    float tile_sum[2] = {0.f, 0.f};
    if (all_visible)
      Softmax::template probabilities<false>(score, value_scales, to_reference, exp_scale, shift, t, p_high, p_low,
                                             tile_sum);
    else
      Softmax::template probabilities<true>(score, value_scales, to_reference, exp_scale, shift, t, p_high, p_low,
                                            tile_sum);
#pragma unroll
    for (int r = 0; r < 2; ++r) running_sum[r] = running_sum[r] * alpha[r] + tile_sum[r];
    return make_float2(alpha[0] * rescale_values, alpha[1] * rescale_values);
  }

  // The accumulators' rows g and g + 8 times a tile's factors (skipped where
  // the whole warp's are 1: the common case once the maxima settle).
  __device__ __forceinline__ void rescale_out(float2 factor) {
    if (!__all_sync(0xffffffffu, factor.x == 1.f && factor.y == 1.f)) {
#pragma unroll
      for (int n = 0; n < ND; ++n) {
        out[n][0] *= factor.x;
        out[n][1] *= factor.x;
        out[n][2] *= factor.y;
        out[n][3] *= factor.y;
      }
    }
  }
};

}  // namespace kvc_attn
