// One softmax round's two products in the decode kernel (Attention::run's
// loop over a tile's steps of 16 tokens): the score product of the round's
// steps, the tokens' scales, and the output product of the probabilities
// with the value codes. Included by attention.cuh.
#pragma once

#include "decode_fragments.cuh"
#include "decode_traits.cuh"
#include "ptx.cuh"

namespace kvc_attn {

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeProducts {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  typedef DecodeFragments<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> F;
  static constexpr int KC = T::kKChunks, MD = T::kDimTiles, NP = T::kColumnTiles, GS = T::kRoundSteps;
  static constexpr bool kLowSlot = T::kLowSlot, kQuantized = T::kQuantized, kOffset = T::kOffset, kBf16 = T::kBf16;

  // Scores of the round's GS steps from step first_step of this warp's staged
  // keys: score[j][quad] holds tokens g (c0 + c1) and g + 8 (c2 + c3) of step
  // j, row t of the quad, before any scale or offset.
  static __device__ __forceinline__ void score_product(const u8* keys, int first_step, const u32 (&qb)[QUADS][KC][2],
                                                       float (&score)[GS][QUADS][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < GS; ++j)
#pragma unroll
      for (int quad = 0; quad < QUADS; ++quad)
#pragma unroll
        for (int i = 0; i < 4; ++i) score[j][quad][i] = 0.f;
#pragma unroll
    for (int j = 0; j < GS; ++j) {
      // The A fragment of k step kc is the two tokens' {b0, b1} pairs interleaved.
      const u8* row = keys + ((first_step + j) * 16 + g) * T::kKeyStride;
      u32 words[2][T::kKeyWords];
#pragma unroll
      for (int vector = 0; vector < T::kKeyWords / T::kKeyVector; ++vector) {
        load_lane_vector<F::kKeyVecBytes, 4>(row, t, vector, words[0]);
        load_lane_vector<F::kKeyVecBytes, 4>(row + 8 * T::kKeyStride, t, vector, words[1]);
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          if (F::key_word_of(kc) / T::kKeyVector != vector) continue;
          u32 a[4];
          F::key_fragment(words[0], kc, a[0], a[2]);
          F::key_fragment(words[1], kc, a[1], a[3]);
#pragma unroll
          for (int quad = 0; quad < QUADS; ++quad)
            mma<kBf16>(score[j][quad], a, qb[quad][kc][0], qb[quad][kc][1]);
        }
      }
    }
  }

  // The scales (K's times the fp8 code unit, V's) and K's zero-points of this
  // thread's tokens of each step, g (i = 0) and g + 8 (i = 1), and the largest
  // V scale among them.
  static __device__ __forceinline__ void token_scales(const u32* key_scales, const u32* value_scales, int first_step,
                                                      int base, int key_hi, float (&key_scale)[GS][2],
                                                      float (&value_scale)[GS][2], float (&key_zero_point)[GS][2],
                                                      float& largest_value_scale) {
    const int g = (threadIdx.x & 31) >> 2;
    largest_value_scale = 0.f;
#pragma unroll
    for (int j = 0; j < GS; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int column = (first_step + j) * 16 + g + 8 * i;
        const u32 key_bits = kQuantized ? key_scales[column * HEADS] : 0u;
        const u32 value_bits = kQuantized ? value_scales[column * HEADS] : 0u;
        key_scale[j][i] = kQuantized ? F::scale_of(key_bits) * T::kCodeUnit : 1.f;
        key_zero_point[j][i] = F::zero_point_of(key_bits);
        value_scale[j][i] = kQuantized ? F::scale_of(value_bits) * T::kCodeUnit : 1.f;
        // A row past the keys holds stale bytes under bulk staging: its scale
        // must not set R (its probability is 0 anyway).
        if (KVC_MBARRIERS && base + column >= key_hi) value_scale[j][i] = 0.f;
        largest_value_scale = fmaxf(largest_value_scale, value_scale[j][i]);
      }
    }
  }

  // out += V^T P^T over the round's steps: the probabilities (times V scale /
  // R, as high and low 16-bit halves) against this warp's staged value codes.
  static __device__ __forceinline__ void output_product(const u8* values, const u32* value_scales, int first_step,
                                                        const float (&weighted_high)[GS][QUADS][2],
                                                        const float (&weighted_low)[GS][QUADS][2],
                                                        float (&out)[MD][NP][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < GS; ++j) {
      // P^T fragments of step j: lane (g, t) packs row g (token), columns 2t,
      // 2t + 1 of each 8 x 8 half (tokens 0-7, 8-15) and the transpose hands
      // it column g, tokens 2t, 2t + 1: the B fragment {b0, b1}.
      u32 pb[NP][2][2];   // [np][high, low][b0, b1]
#pragma unroll
      for (int np = 0; np < NP; ++np) {
        const int second = min(2 * np + 1, QUADS - 1);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float w0 = weighted_high[j][2 * np][i];
          const float w1 = kLowSlot && np == NP - 1 ? weighted_low[j][2 * np][i] : weighted_high[j][second][i];
          pb[np][0][i] = F::transpose8x8(F::pack(w0, w1));
          if constexpr (kBf16 && !kLowSlot)
            pb[np][1][i] = F::transpose8x8(F::pack(weighted_low[j][2 * np][i], weighted_low[j][second][i]));
        }
      }
      // Lane g's share of the value rows of tokens 2t, 2t+1, 2t+8, 2t+9, a vector
      // of units at a time, each used by the M tiles it holds.
      u32 words[4][(T::kValueUnits + 1) / 2];
      const u32* const rows[4] = {words[0], words[1], words[2], words[3]};
      // OFFSET + zero-point of the A fragment's tokens, per register (rows g
      // and g + 8 of tokens 2t, 2t + 1, then of 2t + 8, 2t + 9), subtracted
      // from every code before the product (exactly: integers in fp16). Left
      // in, they add OFFSET x sum(P) to every accumulator, and the tensor
      // cores' fp32 sums, which truncate, lose a share of that large common
      // part that grows with the keys summed: a bias common to every channel.
      u32 centre[4];
      if constexpr (kOffset) {
        const u32* scale_words = value_scales + ((first_step + j) * 16 + 2 * t) * HEADS;
        F::offset_pairs(scale_words[0], scale_words[HEADS], centre[0], centre[1]);
        F::offset_pairs(scale_words[8 * HEADS], scale_words[9 * HEADS], centre[2], centre[3]);
      }
#pragma unroll
      for (int vector = 0; vector < F::kValueLoads; ++vector) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
          F::load_value_vector(values + ((first_step + j) * 16 + 2 * t + (c & 1) + 8 * (c >> 1)) * T::kValueStride,
                            g, vector, words[c]);
#pragma unroll
        for (int md = 0; md < MD; ++md) {
          if (F::value_load_of(md) != vector) continue;
          u32 a[4];
          F::value_fragment(rows, md, a);
          if constexpr (kOffset) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = sub_half2(a[i], centre[i]);
          }
#pragma unroll
          for (int np = 0; np < NP; ++np) {
            mma<kBf16>(out[md][np], a, pb[np][0][0], pb[np][0][1]);
            if constexpr (kBf16 && !kLowSlot) mma<kBf16>(out[md][np], a, pb[np][1][0], pb[np][1][1]);
          }
        }
      }
    }
  }
};

}  // namespace kvc_attn
