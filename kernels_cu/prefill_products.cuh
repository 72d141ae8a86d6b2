// A score tile's and an output tile's tensor-core products, one function per
// build's way of issuing them:
//   mma.sync (a warp, 16 rows): scores from the query rows' two fp16 terms and
//     the K rows, output from P (bf16: two terms) and the V rows, operands read
//     from shared memory with ldmatrix (mma_scores, mma_values);
//   wgmma (a warpgroup, 64 rows): scores from the query rows in shared memory
//     or, in the producer build, from registers, and the decoded K rows;
//     output from P in registers and the decoded V rows (wgmma_scores,
//     wgmma_values). They are only issued here; the mainloop waits for them.
// Thread (g, t) of a warp holds rows g (c0, c1) and g + 8 (c2, c3) of each
// score tile n (tokens 8 n + 2t, +1) and output tile n (dims 8 n + 2t, +1).
#pragma once

#include "prefill_traits.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillProducts : Ktraits {
  using Ktraits::HEAD_PAD;
  using Ktraits::TILE;
  using Ktraits::KC;
  using Ktraits::NT;
  using Ktraits::ND;
  using Ktraits::kBf16;
  using Ktraits::kSplitP;
  using Ktraits::kSwizzled;
  using Ktraits::kSwizzleBytes;
  using Ktraits::kDecodedStride;
  using Ktraits::kQueryBytes;

  // mma.sync: score += Q K^T over the head's dims, the query's high and low
  // terms at `query_lane` (this lane's ldmatrix row; the low terms kQueryBytes
  // on), the keys' rows kDecodedStride apart.
  static __device__ __forceinline__ void mma_scores(float (&score)[NT][4], const u8* query_lane, const u8* keys,
                                                    int lane) {
#pragma unroll
    for (int kc = 0; kc < KC; kc += 2) {
      u32 q_high[2][4], q_low[2][4];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        ldmatrix_x4(q_high[k], query_lane + 32 * (kc + k));
        ldmatrix_x4(q_low[k], query_lane + kQueryBytes + 32 * (kc + k));
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        // Matrices: tokens 8n.. x dims 16 kc, 16 kc + 8, 16 kc + 16, 16 kc + 24.
        u32 b[4];
        ldmatrix_x4(b, keys + (8 * n + (lane & 7)) * kDecodedStride + 2 * (16 * kc + 8 * (lane >> 3)));
        mma<kBf16>(score[n], q_high[0], b[0], b[1]);
        mma<kBf16>(score[n], q_low[0], b[0], b[1]);
        mma<kBf16>(score[n], q_high[1], b[2], b[3]);
        mma<kBf16>(score[n], q_low[1], b[2], b[3]);
      }
    }
  }

  // mma.sync: out += P V; k step j is tokens 16 j .. 16 j + 15, score tiles 2j
  // and 2j + 1.
  static __device__ __forceinline__ void mma_values(float (&out)[ND][4], const u32 (&p_high)[NT][2],
                                                    const u32 (&p_low)[kSplitP ? NT : 1][2], const u8* values,
                                                    int lane) {
#pragma unroll
    for (int j = 0; j < TILE / 16; ++j) {
      const u32 a_high[4] = {p_high[2 * j][0], p_high[2 * j][1], p_high[2 * j + 1][0], p_high[2 * j + 1][1]};
      u32 a_low[4];
      if constexpr (kSplitP) {
        a_low[0] = p_low[2 * j][0], a_low[1] = p_low[2 * j][1];
        a_low[2] = p_low[2 * j + 1][0], a_low[3] = p_low[2 * j + 1][1];
      }
#pragma unroll
      for (int n = 0; n < ND; n += 2) {
        // Matrices (transposed): tokens 16j.. and 16j + 8.. x dims 8n.., then 8(n + 1)...
        u32 b[4];
        ldmatrix_x4_trans(b, values + (16 * j + (lane & 7) + 8 * ((lane >> 3) & 1)) * kDecodedStride +
                                 2 * (8 * n + 8 * (lane >> 4)));
        mma<kBf16>(out[n], a_high, b[0], b[1]);
        mma<kBf16>(out[n + 1], a_high, b[2], b[3]);
        if constexpr (kSplitP) {
          mma<kBf16>(out[n], a_low, b[0], b[1]);
          mma<kBf16>(out[n + 1], a_low, b[2], b[3]);
        }
      }
    }
  }

  // wgmma: the decoded keys' descriptor. k step kc is dims 16 kc.., 256 bytes
  // on (a descriptor counts 16-byte units); swizzled, 32 bytes within a column
  // of kSwizzleBytes / 2 dims (swizzled_offset), kKeySteps k steps a column.
  static constexpr int kKeySteps = kSwizzled ? kSwizzleBytes / 32 : 1;
  static __device__ __forceinline__ kvc_wgmma::u64 key_operand(const u8* keys) {
    return kSwizzled ? kvc_wgmma::descriptor<kSwizzleBytes>(keys, 16, 8 * kSwizzleBytes)
                     : kvc_wgmma::descriptor(keys, 128, 16 * HEAD_PAD);
  }

  // wgmma: a tile's score products, issued and committed, the query the
  // warpgroup's rows in shared memory as core matrices (the wgmma build).
  static __device__ __forceinline__ void wgmma_scores(float (&score)[NT][4], const u8* keys, const u8* query_rows) {
    kvc_wgmma::hold(score);
    kvc_wgmma::fence();
    const kvc_wgmma::u64 keys_at = key_operand(keys);
    const kvc_wgmma::u64 query_operand = kvc_wgmma::descriptor(query_rows, 128, 16 * HEAD_PAD);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc)
      kvc_wgmma::Products<TILE, kBf16>::ss(score, query_operand + 16 * kc, keys_at + 16 * kc);
    kvc_wgmma::commit();
  }

  // The same, the query the warp's A fragments in registers (the producer
  // build's consumers: shared memory then serves only K and V).
  static __device__ __forceinline__ void wgmma_scores(float (&score)[NT][4], const u8* keys,
                                                      const u32 (&query_fragments)[KC][4]) {
    kvc_wgmma::hold(score);
    kvc_wgmma::fence();
    const kvc_wgmma::u64 keys_at = key_operand(keys);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc)
      kvc_wgmma::Products<TILE, kBf16>::rs_k(
          score, query_fragments[kc],
          keys_at + (kSwizzled ? (kc / kKeySteps * TILE * kSwizzleBytes + kc % kKeySteps * 32) / 16 : 16 * kc));
    kvc_wgmma::commit();
  }

  // wgmma: a tile's output products (P from registers, the decoded V rows),
  // issued; the caller commits them. B = V rows 16 j.. (K, tokens) x dims (N):
  // core matrices 128 bytes apart along the dims; swizzled, columns TILE x
  // kSwizzleBytes apart, 8-token groups 8 x kSwizzleBytes.
  static __device__ __forceinline__ void wgmma_values(float (&out)[ND][4], const u32 (&p_high)[NT][2],
                                                      const u8* values) {
    kvc_wgmma::hold(out);
    kvc_wgmma::fence();
    const kvc_wgmma::u64 value_operand =
        kSwizzled ? kvc_wgmma::descriptor<kSwizzleBytes>(values, TILE * kSwizzleBytes, 8 * kSwizzleBytes)
                  : kvc_wgmma::descriptor(values, 16 * HEAD_PAD, 128);
#pragma unroll
    for (int j = 0; j < TILE / 16; ++j) {
      const u32 a_high[4] = {p_high[2 * j][0], p_high[2 * j][1], p_high[2 * j + 1][0], p_high[2 * j + 1][1]};
      kvc_wgmma::Products<HEAD_PAD, kBf16>::rs_mn(   // 32 j HEAD_PAD bytes on; swizzled, 16 j kSwizzleBytes
          out, a_high, value_operand + (kSwizzled ? kSwizzleBytes * j : 2 * j * HEAD_PAD));
    }
  }
};

}  // namespace kvc_attn
