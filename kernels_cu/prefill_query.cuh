// The query rows of a warp, read (from global memory, or from their bulk
// copies in shared memory: bulk_rows) and rotated into the cache's channel
// order (load_query), or, for builds without a rotation, moved into the
// products' layout as they are (direct_query). run() (prefill.cuh) scales
// them into the build's operand.
#pragma once

#include "prefill_block.cuh"
#include "prefill_rotation.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillQuery : Ktraits {
  using Ktraits::KV;
  using Ktraits::HEAD_PAD;
  using Ktraits::KC;
  using Ktraits::ND;
  using Ktraits::WGMMA;
  using Ktraits::PRODUCER;
  using Ktraits::kThreads;
  using Ktraits::kRows;
  using Ktraits::kDecodedStride;
  using Ktraits::kDecodedOffset;
  using Ktraits::kDecodedBytes;
  using Ktraits::kQueryBytes;
  using Ktraits::kWarpgroupQueryBytes;
  using Ktraits::kLastBufferOffset;
  using Ktraits::kFragmentBytes;
  using Ktraits::kGroupShift;
  using Ktraits::kWideRows;
  using Ktraits::channel_of;
  using Ktraits::rotation_shift;
  using Ktraits::pack;
  using Ktraits::unpack;
  typedef PrefillBlock<Ktraits> Block;
  typedef PrefillRotation<Ktraits> Rotation;

  // Bulk rows (wgmma builds without the producer: short prompts' build, sm_90):
  // query and output rows whose starts and sizes are 16-byte multiples (16-bit
  // elements) move between global and shared memory by the copy engine, a row
  // a cp.async.bulk, instead of each lane's 4-byte pairs. A short prompt's
  // block otherwise spends much of its time waiting on those, until the query
  // is loaded and rotated. The producer build keeps the lanes' loads: in its
  // long blocks that wait is a small share, less than the bulk path costs.
  // The rows are staged in the decoded buffers, kDecodedStride apart (the
  // lanes' 4-byte pairs then fall in distinct banks): the query's before the
  // first tile is decoded, the output's once every consumer is past the last
  // tile. Where they leave the last decoded buffer clear and the rotation's
  // fragments fit it (kEarlyInverse), a block with fewer tiles than buffers,
  // which never fills it, gets the inverse rotation's fragments there with the
  // query (run(), early_inverse).
  static __device__ __forceinline__ bool bulk_rows(const void* rows, long long token_stride, long long head_stride,
                                                   int dtype, int head_size) {
    return WGMMA && !PRODUCER && dtype != kDtypeF32 && head_size % 8 == 0 && reinterpret_cast<unsigned long long>(rows) % 16 == 0 &&
           token_stride % 8 == 0 && head_stride % 8 == 0;
  }

  // This lane's 16-bit query pairs of rows g (r = 0) and g + 8 (r = 1), logical
  // dims 8 n + 2t (j = 0 low half) and + 1 (high), from the rows at rows[r] (the
  // caller's query, or its bulk copy in shared memory): bits[n][r], zeros past
  // the head size and for rows past the last; channel l for the rotation's
  // products, channel_of(l) where the channels are read in place (CACHE_ORDER).
  // Every load goes out before any value is used: a short prompt's block
  // otherwise waits out one memory latency per branch.
  template <bool CACHE_ORDER>
  static __device__ __forceinline__ void load_query_pairs(const Params& p, const void* const (&rows)[2],
                                                          const bool (&row_valid)[2], u32 (&bits)[ND][2]) {
    const int t = threadIdx.x & 3;
    // int4's cache order splits a pair (channels t and t + 4 of a group of 8).
    constexpr bool kSplitPairs = CACHE_ORDER && KV == KV_INT4;
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const u16* q = static_cast<const u16*>(rows[r]);
        const int logical = 8 * n + 2 * t;
        if constexpr (kSplitPairs) {
          const int c0 = channel_of(logical), c1 = channel_of(logical + 1);
          const u32 lo = row_valid[r] && c0 < p.head_size ? q[c0] : 0u;
          const u32 hi = row_valid[r] && c1 < p.head_size ? q[c1] : 0u;
          bits[n][r] = lo | (hi << 16);
        } else {   // a pair never straddles a row: head sizes are even, rows pair-aligned (host)
          const bool ok = row_valid[r] && logical < p.head_size;
          bits[n][r] = ok ? *reinterpret_cast<const u32*>(q + logical) : 0u;
        }
      }
  }

  // This lane's query elements as load_query_pairs reads them (fp32 queries:
  // each value), as floats times `factor`: raw[n][2 r + j].
  template <bool CACHE_ORDER>
  static __device__ __forceinline__ void load_query_elements(const Params& p, const void* const (&rows)[2],
                                                             const bool (&row_valid)[2], float factor,
                                                             float (&raw)[ND][4]) {
    const int t = threadIdx.x & 3;
    if (kWideRows && p.query_dtype == kDtypeF32) {
      float v[ND][4];
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int logical = 8 * n + 2 * t + (i & 1);
          const int channel = CACHE_ORDER ? channel_of(logical) : logical;
          const bool ok = row_valid[i >> 1] && channel < p.head_size;
          v[n][i] = ok ? static_cast<const float*>(rows[i >> 1])[channel] : 0.f;
        }
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) raw[n][i] = v[n][i] * factor;
      return;
    }
    u32 bits[ND][2];   // [n][r]: the pair (j = 0 low, j = 1 high)
    load_query_pairs<CACHE_ORDER>(p, rows, row_valid, bits);
    const bool f16 = p.query_dtype == kDtypeF16;
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 v = f16 ? unpack_half2(bits[n][r]) : unpack_bf162(bits[n][r]);
        raw[n][2 * r] = v.x * factor;
        raw[n][2 * r + 1] = v.y * factor;
      }
  }

  // values[kc][h][r][j]: the query row g + 8 r of this warp, logical dim
  // 16 kc + 8 h + 2t + j, rotated into the cache's channel order, from the
  // caller's query, times `pending` less than the softmax scale / norm (the
  // caller folds that factor into the rows' scaling). A rotation is a product
  // with the host's matrix (entries 0 and +-1, exact in fp16 and bf16),
  // accumulated in fp32, then the butterflies across groups where the host
  // factored those out (rotation_stages): fp16 and bf16 queries enter the
  // products as they are (bf16 ones against the matrix's bf16 fragments), so
  // exactly and without a conversion or a scaling pass; fp32 ones split into
  // fp16 high and low parts (rotate_rows). The matrix's fragments are staged in
  // `scratch` (the block's query rows, written only after), unless they fall
  // in 16-dim groups: few, read where they lie. Every thread of the block calls
  // this. Without a rotation the channels are read in place. `staged`: the
  // block's rows and the fragments came by bulk copies (run()), complete once
  // `query_barrier` is; null: read from global memory.
  static __device__ __forceinline__ void load_query(const Params& p, int q_begin, int row_begin, int kv_head,
                                                    const bool (&row_valid)[2], u8* scratch, const u8* staged,
                                                    u8* query_barrier, float (&values)[KC][2][2][2],
                                                    float& pending) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const void* rows[2];
    if (staged != nullptr) {
      mbarrier_wait(query_barrier, 0);
#pragma unroll
      for (int r = 0; r < 2; ++r) rows[r] = staged + (16 * (threadIdx.x >> 5) + (lane >> 2) + 8 * r) * kDecodedStride;
    } else {
      const int element_bytes = p.query_dtype == kDtypeF32 ? 4 : 2;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_begin + (lane >> 2) + 8 * r;
        const long long start =
            row_valid[r] ? Block::row_offset(p, q_begin, row, kv_head, p.q_token_stride, p.q_head_stride) : 0;
        rows[r] = static_cast<const u8*>(p.query_in) + start * element_bytes;
      }
    }
    // The fragments in shared memory: staged here, or come with the rows (bulk);
    // without bulk copies, those in 16-dim groups are read where they lie.
    const bool staged_fragments = rotation_shift(p) >= 0 && (rotation_shift(p) != kGroupShift || staged != nullptr);
    if (rotation_shift(p) < 0) {
      float raw[ND][4];   // C-fragment order: raw[n][i] = row g + 8 (i / 2), dim 8 n + 2t + i % 2
      load_query_elements<true>(p, rows, row_valid, p.query_factor, raw);
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) values[n >> 1][n & 1][i >> 1][i & 1] = raw[n][i];
      pending = 1.f;
      return;
    }
    const u8* fragments = staged_fragments ? scratch : reinterpret_cast<const u8*>(forward_fragments(p));
    if (staged_fragments && staged == nullptr) {
      Rotation::stage_fragments(forward_fragments(p), scratch);
      __syncthreads();
    }
    auto emit = [&](int n, const float (&y)[4]) {
#pragma unroll
      for (int i = 0; i < 4; ++i) values[n >> 1][n & 1][i >> 1][i & 1] = y[i];
    };
    const int shift = rotation_shift(p), stages = p.rotation_stages;
    if constexpr (kWideRows) {
      // The build float32 calls take (kvcupy.paged_attention's output has the
      // query's dtype, so a float32 query here): every query through the
      // two-term products, one copy of them. A 16-bit query would keep each
      // value whole in the two fp16 terms unless it lay some 2^28 below its
      // row's largest (fp16_range_scale).
      float raw[ND][4];
      load_query_elements<false>(p, rows, row_valid, 1.f, raw);
      const float factor[2] = {p.query_factor, p.query_factor};
      Rotation::template rotate_rows<true, true>(raw, fragments, shift, stages, true, factor, emit);
      pending = 1.f;
    } else {
      u32 pairs[KC][4];   // A fragments: register 2h + r of k step ks holds row g + 8r, dims 16 ks + 8h + 2t, +1
      if (staged != nullptr) {
        // ldmatrix: lanes 8m .. 8m + 7 address matrix m's rows (rows 8 (m & 1).., dims 8 (m >> 1)..).
        const u8* lane_row =
            staged + (16 * (threadIdx.x >> 5) + (lane & 7) + 8 * ((lane >> 3) & 1)) * kDecodedStride + 16 * (lane >> 4);
#pragma unroll
        for (int ks = 0; ks < KC; ++ks) ldmatrix_x4(pairs[ks], lane_row + 32 * ks);
        // The bulk copies filled rows up to the head size and the block's last row only.
#pragma unroll
        for (int ks = 0; ks < KC; ++ks)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (!row_valid[j & 1] || 16 * ks + 8 * (j >> 1) + 2 * t >= p.head_size) pairs[ks][j] = 0u;
      } else {
        u32 bits[ND][2];
        load_query_pairs<false>(p, rows, row_valid, bits);
#pragma unroll
        for (int ks = 0; ks < KC; ++ks)
#pragma unroll
          for (int j = 0; j < 4; ++j) pairs[ks][j] = bits[2 * ks + (j >> 1)][j & 1];
      }
      const float unscaled[2] = {1.f, 1.f};
      Rotation::template rotation_products<true, false, true, false>(pairs, pairs, false, fragments, shift, stages,
                                                                     unscaled, emit, p.query_dtype == kDtypeBf16);
      pending = p.query_factor;
    }
    // Every warp done with the staged fragments: the query rows go there next.
    if (staged_fragments) __syncthreads();
  }

  // The forward rotation's fragments for this call's query: the host's fp16
  // ones, then its bf16 ones (a bf16 query's products take bf16 operands, but
  // in the float32 calls' build, whose two terms are fp16).
  static __device__ __forceinline__ const uint2* forward_fragments(const Params& p) {
    return p.rotation_fwd + (!kWideRows && p.query_dtype == kDtypeBf16 ? kFragmentBytes / 8 : 0);
  }

  // Quantized caches' builds without a rotation or producer (kDirectQuery), bulk
  // rows: this warp's 16 staged query rows into the products' core matrices, as
  // they are for an fp16 query, bf16 ones times the power of two that brings the
  // row's largest |q| near 2^14 (exact: bf16's 8 bits fit fp16's 11, but for
  // values 2^24 below that largest, as in load_query's path); the softmax scale
  // goes into row_unscale (a float32 product on the scores instead of an fp16
  // rounding of q x scale). Lane (g, t) moves the 16-byte pieces t, t + 4, .. of
  // rows g and g + 8, whole (int4's with their pairs in the cache's order,
  // channel_of): nothing else mixes dims, so any split of a row serves. Pieces
  // past head_size (whole pieces: bulk rows' head sizes are multiples of 8) and
  // rows past the last are zeros. This spares a short block load_query's path,
  // a large share of its instructions. 16-bit rows keep load_query's path: like
  // kTrimmed's trims, this one worsens the register allocation of their 12-warp
  // build, which already spills.
  static __device__ __forceinline__ void direct_query(const Params& p, const u8* staged, u8* query_rows,
                                                      const bool (&row_valid)[2], float (&row_unscale)[2]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    constexpr int kMine = HEAD_PAD / 32;   // pieces of 8 dims a lane and row
    const bool bf16 = p.query_dtype == kDtypeBf16;
    uint4 pieces[2][kMine];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < kMine; ++j) {
        const int piece = t + 4 * j;
        const u8* source = staged + (16 * warp + g + 8 * r) * kDecodedStride + 16 * piece;
        uint4 x = row_valid[r] && 8 * piece < p.head_size ? *reinterpret_cast<const uint4*>(source)
                                                           : make_uint4(0u, 0u, 0u, 0u);
        if constexpr (KV == KV_INT4)   // logical pairs (0, 1), (2, 3), .. hold channels (0, 4), (1, 5), ..
          x = make_uint4(__byte_perm(x.x, x.z, 0x5410), __byte_perm(x.x, x.z, 0x7632), __byte_perm(x.y, x.w, 0x5410),
                         __byte_perm(x.y, x.w, 0x7632));
        pieces[r][j] = x;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float up = 1.f;
      if (bf16) {
        // |q| orders as its bits less the sign (NaN and inf above every finite value).
        u32 largest = 0u;
#pragma unroll
        for (int j = 0; j < kMine; ++j) {
          largest = __vmaxu2(largest, pieces[r][j].x & 0x7fff7fffu);
          largest = __vmaxu2(largest, pieces[r][j].y & 0x7fff7fffu);
          largest = __vmaxu2(largest, pieces[r][j].z & 0x7fff7fffu);
          largest = __vmaxu2(largest, pieces[r][j].w & 0x7fff7fffu);
        }
        largest = max(largest & 0xffffu, largest >> 16);
        largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
        largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
        up = fp16_range_scale(__uint_as_float(largest << 16));
        auto scaled = [&](u32 pair) {
          return pack_half2(__uint_as_float(pair << 16) * up, __uint_as_float(pair & 0xffff0000u) * up);
        };
#pragma unroll
        for (int j = 0; j < kMine; ++j) {
          uint4& x = pieces[r][j];
          x = make_uint4(scaled(x.x), scaled(x.y), scaled(x.z), scaled(x.w));
        }
      }
      row_unscale[r] = p.query_factor / up;
#pragma unroll
      for (int j = 0; j < kMine; ++j)
        *reinterpret_cast<uint4*>(query_rows + kvc_wgmma::core_offset(16 * (warp & 3) + g + 8 * r, 8 * (t + 4 * j),
                                                                      HEAD_PAD)) = pieces[r][j];
    }
  }

};

}  // namespace kvc_attn
