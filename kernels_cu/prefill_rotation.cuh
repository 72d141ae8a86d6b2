// The rotation's products on a warp's 16 rows, shared by the query (forward,
// prefill_query.cuh) and the output (inverse, prefill_epilogue.cuh): the
// host's rotation matrix as mma B fragments (staged in shared memory, or read
// where they lie in 16-dim groups), the rows as fp16 (or bf16) A operands, one
// or two terms, and the Sylvester butterflies across 16-dim groups.
#pragma once

#include "prefill_traits.cuh"

namespace kvc_attn {

// mma<BF16> with the operands' type chosen at run time: both instructions,
// predicated, one of them issued for nothing (no branch a product). The query's
// rotation products take it for fp16 and bf16 queries alike: NVRTC then compiles
// one copy of those products, not one for each type (a large share of a build).
__device__ __forceinline__ void mma_either(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, bool bf16) {
  asm volatile("{\n .reg .pred is_bf16;\n setp.ne.u32 is_bf16, %10, 0;\n"
               " @is_bf16 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               " @!is_bf16 mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n}\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(u32(bf16)));
}

// The power of two that brings |x| <= m near 2^14 (fp16's range, exact to apply).
__device__ __forceinline__ float fp16_range_scale(float m) {
  int exponent = 0;
  frexpf(m, &exponent);
  return m > 0.f && isfinite(m) ? ldexpf(1.f, 14 - exponent) : 1.f;
}

template <class Ktraits>
struct PrefillRotation : Ktraits {
  using Ktraits::KC;
  using Ktraits::ND;
  using Ktraits::kThreads;
  using Ktraits::kFragmentBytes;
  using Ktraits::kGroupShift;

  // Whether the (k step, n tile) fragment of a rotation matrix can hold a
  // nonzero: its 16 rows and 8 columns lie in one independent block of
  // 2^shift dims (the host's rotation_shift: large where every fragment counts).
  // Skipping the others saves products and keeps a non-finite value inside its block.
  static __device__ __forceinline__ bool fragment_used(int shift, int ks, int nt) {
    return (16 * ks) >> shift == (8 * nt) >> shift;
  }

  // The rotation's fragments (the launcher's rotation_fragments: [KC][ND][32
  // lanes] x 8 bytes, HEAD_PAD^2 x 2 bytes in all) into shared memory at `to`,
  // every thread of the block copying 16 bytes at a time. Read from there, a
  // warp's fragment is one conflict-free 8-byte access a lane.
  template <int THREADS = kThreads>
  static __device__ __forceinline__ void stage_fragments(const uint2* from, u8* to) {
    constexpr int kWords = kFragmentBytes / 16;
    constexpr int kRounds = (kWords + THREADS - 1) / THREADS;
    const uint4* source = reinterpret_cast<const uint4*>(from);
    uint4* target = reinterpret_cast<uint4*>(to);
    uint4 words[kRounds];   // every load out before the first store
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int at = threadIdx.x + i * THREADS;
      if (at < kWords) words[i] = __ldg(source + at);
    }
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int at = threadIdx.x + i * THREADS;
      if (at < kWords) target[at] = words[i];
    }
  }

  // A operands (16 rows x HEAD_PAD, the rows' values `x` in C-fragment order:
  // x[n][i] = row g + 8 (i / 2), dim 8 n + 2t + i % 2) times the power of two
  // `up[r]` that brings each row's largest |x| near 2^14, split into fp16
  // high and (WITH_LOW) low parts (~22 bits).
  template <bool WITH_LOW>
  static __device__ __forceinline__ void split_rows(const float (&x)[ND][4], const float (&up)[2],
                                                    u32 (&high)[KC][4], u32 (&low)[KC][4]) {
#pragma unroll
    for (int ks = 0; ks < KC; ++ks) {
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        // a0: row g, dims 16 ks + 2t..; a1: row g + 8; a2, a3: the same rows, dims + 8.
        const float* pair = &x[2 * ks + (a >> 1)][2 * (a & 1)];
        const float v0 = pair[0] * up[a & 1], v1 = pair[1] * up[a & 1];
        high[ks][a] = pack_half2(v0, v1);
        if constexpr (WITH_LOW) {
          const float2 rounded = unpack_half2(high[ks][a]);
          low[ks][a] = pack_half2(v0 - rounded.x, v1 - rounded.y);
        }
      }
    }
  }

  // The rotation's Sylvester factor across 16-dim groups: v <- v (H_{2^stages}
  // (x) I_16) on every block of 2^stages x 16 logical dims (C-fragment order:
  // tile n holds dims 8 n.., so group n >> 1). Logical and cache order share
  // the groups (channel_of stays within 8 dims), so the factor is the same in
  // both. Uniform across the block: `stages` comes from the host.
  static __device__ __forceinline__ void butterflies_across_groups(float (&v)[ND][4], int stages) {
#pragma unroll
    for (int k = 0; (2 << k) < ND; ++k) {
      if (k >= stages) break;
      const int h = 2 << k;   // tiles between partners: groups 1 << k apart, two tiles a group
#pragma unroll
      for (int n = 0; n < ND; ++n) {
        if ((n & h) || n + h >= ND) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float a = v[n][i], b = v[n + h][i];
          v[n][i] = a + b;
          v[n + h][i] = a - b;
        }
      }
    }
  }

  // y = x M for this warp's 16 rows (x in C-fragment order, M's fragments in
  // shared memory), each row times factor[r], then (ACROSS_GROUPS) `stages`
  // butterflies across groups (rotation_products). x enters as fp16 terms of
  // the row times the power of two up[r] that brings its largest |x| near 2^14
  // (undone on y): two (~22 bits) where MAY_LOW and with_low, else one (exact
  // where x holds fp16 or bf16 values, 2^-11 relative otherwise); without
  // MAY_LOW the low terms are not even worked out.
  template <bool MAY_LOW, bool ACROSS_GROUPS, class Emit>
  static __device__ __forceinline__ void rotate_rows(const float (&x)[ND][4], const u8* fragments, int shift,
                                                     int stages, bool with_low, const float (&factor)[2], Emit emit) {
    float largest[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) largest[i >> 1] = fmaxf(largest[i >> 1], fabsf(x[n][i]));
    const float up[2] = {fp16_range_scale(max_over_quad(largest[0])), fp16_range_scale(max_over_quad(largest[1]))};
    u32 high[KC][4], low[KC][4];
    split_rows<MAY_LOW>(x, up, high, low);
    const float scale[2] = {factor[0] / up[0], factor[1] / up[1]};
    rotation_products<false, MAY_LOW, ACROSS_GROUPS, true>(high, low, with_low, fragments, shift, stages, scale,
                                                          emit);
  }

  // y = A M for this warp's 16 rows: A their fp16 (or bf16: EITHER_TYPE) A fragments
  // `high` (register 2h + r of k step ks: row g + 8r, dims 16 ks + 8h + 2t, +1),
  // plus `low` where MAY_LOW and with_low; M's fragments (fp16 or bf16 like A)
  // at `fragments`; each row times scale[r] where SCALED; then (ACROSS_GROUPS)
  // `stages` butterflies across groups (the forward rotation's order: M, then
  // the Sylvester factor); emit(n, y[4]) takes n tile n's C fragment. Without
  // ACROSS_GROUPS (the inverse, whose butterflies come first) each group of
  // four n tiles is emitted as soon as it is done, so that y is never held
  // whole (the epilogue's registers). EITHER_TYPE: the operands are bf16 where
  // `bf16`, else fp16, chosen at run time (mma_either); otherwise fp16.
  template <bool EITHER_TYPE, bool MAY_LOW, bool ACROSS_GROUPS, bool SCALED, class Emit>
  static __device__ __forceinline__ void rotation_products(const u32 (&high)[KC][4], const u32 (&low)[KC][4],
                                                           bool with_low, const u8* fragments, int shift,
                                                           int stages, const float (&scale)[2], Emit emit,
                                                           bool bf16 = false) {
    const int lane = threadIdx.x & 31;
    const uint2* b = reinterpret_cast<const uint2*>(fragments) + lane;
    auto product = [&](float (&c)[4], const u32 (&a)[4], uint2 fragment) {
      if constexpr (EITHER_TYPE) mma_either(c, a, fragment.x, fragment.y, bf16);
      else mma<false>(c, a, fragment.x, fragment.y);
    };
    float y[ND][4];
    // Four n tiles at a time: four independent accumulator chains keep the
    // tensor pipe busy where one chain would wait out every product's latency.
    static_assert(ND % 4 == 0, "whole groups of n tiles");
#pragma unroll
    for (int n0 = 0; n0 < ND; n0 += 4) {
      float acc[4][4] = {};
      if (shift == kGroupShift) {   // n tile n meets k step n / 2 alone: no tests
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int ks = (n0 + j) >> 1;
          const uint2 fragment = b[(ks * ND + n0 + j) * 32];
          product(acc[j], high[ks], fragment);
          if (MAY_LOW && with_low) product(acc[j], low[ks], fragment);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < KC; ++ks) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (!fragment_used(shift, ks, n0 + j)) continue;
            const uint2 fragment = b[(ks * ND + n0 + j) * 32];
            product(acc[j], high[ks], fragment);
            if (MAY_LOW && with_low) product(acc[j], low[ks], fragment);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) y[n0 + j][i] = SCALED ? acc[j][i] * scale[i >> 1] : acc[j][i];
      if constexpr (!ACROSS_GROUPS) {
#pragma unroll
        for (int j = 0; j < 4; ++j) emit(n0 + j, y[n0 + j]);
      }
    }
    if constexpr (ACROSS_GROUPS) {
      butterflies_across_groups(y, stages);
#pragma unroll
      for (int n = 0; n < ND; ++n) emit(n, y[n]);
    }
  }
};

}  // namespace kvc_attn
