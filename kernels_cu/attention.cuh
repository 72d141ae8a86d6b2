// Paged attention over a quantized (or plain) KV cache, on tensor cores.
//
// One thread block serves one (sequence, query row tile, KV-head group, split of
// the keys); one warp serves one KV head. A cache row holds every KV head of a
// token side by side, so the block stages a tile of tokens for all its heads as
// contiguous bytes (cp.async, or a bulk copy per page on sm_90; STAGES deep) and
// each warp reads its head's rows from shared memory.
//
// The warp computes with mma.sync m16n8k16 (fp16, or bf16 for bf16 caches,
// fp32 accumulators), 16 tokens a step:
//   scores  S^T[token, column] = K[token, :] . Q^T[:, column]     M = tokens, N = columns
//   output  O^T[dim, column] += V^T[dim, token] . P^T[token, column]   M = dims, N = columns
// Rows are (query token, query head of the KV head's group) pairs, 4 per
// "quad". A quad's 8 score columns hold each row twice, as the high and the
// low fp16 half of a two-term split of the query (q = hi + lo), so that scores
// keep ~22 bits of the query instead of fp16's 11: S = C[2r] + C[2r + 1], both
// in the lane t = r that then owns the row's softmax. The output's 8 columns
// hold the rows of two quads (or one quad's probabilities as high and low
// halves), so a lane's accumulators are the rows it computed the softmax of.
// P^T reaches the output product's fragment layout through movmatrix.
//
// Cache codes enter the products exactly: int4 nibbles and int8 codes as
// OFFSET + code (exact fp16 integers), fp8 e4m3 as a subset of fp16 times
// 2^-8. For K the offsets and zero-points come out on the score side (per-row
// sums of the query); V codes lose theirs before the product (code - zp, still
// exact), so the output accumulators never carry a large common part. Scales
// apply in fp32 on the score side (K) and on the probability side (V). For V
// the probabilities are multiplied by scale / R, R the largest V scale seen
// so far by this warp (a running reference, rescaled like the softmax
// maximum), so that the fp16 operand stays in [0, 1] whatever the scales.
//
// A head-dimension permutation is free where Q and K share it, so each
// format's bytes are read in the order that drops them straight into the
// fragment registers; the output is written back in the cache's (rotated)
// channel order. key_dim_of / value_dim_of spell out those permutations.
//
// The parts (kernels_cu/decode_*.cuh), one job each:
//   decode_traits     compile-time shape, number formats, shared-memory layout (Traits)
//   decode_block      which rows and keys a block serves (DecodeBlock)
//   decode_staging    the page window and the three ways of copying a tile into a stage
//   decode_fragments  what a lane reads of a staged row; codes -> exact mma operands
//   decode_query      the caller's query: loads, scaling and rotation into shared memory
//   decode_softmax    the masks' row range and the accumulators' rescaling
//   decode_epilogue   a split's partial state (part_stats, part_out)
// Attention::run composes them: set-up, the pipeline's prologue, the query
// fragments, the loop over tiles (waits and copies, then per softmax round
// the score product, the softmax and the output product), the epilogue. The
// round stays in run() rather than in helpers: NVVM simplifies a helper on
// its own before inlining it, and for the round's address arithmetic,
// accumulators and loop-carried state that changes the instruction order and
// register allocation of the compiled kernel.
#pragma once

#include "merge.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "types.cuh"

// How tiles reach shared memory (KVC_STAGING). 0: every thread copies pieces with
// cp.async and the block syncs each tile. Where a page holds the block's KV
// heads as one contiguous run of bytes (sm_90; the launcher's
// _bulk_copies_fit), two mbarrier pipelines: a "full" barrier per stage that
// completes when the stage's copies have landed, an "empty" one that every
// thread arrives on when done with the stage, and no block-wide sync.
//   1 (bulk): warp 0 alone copies each page's part of a tile with one
//     cp.async.bulk per tensor (K, V and their scales), after waiting on the
//     stage's empty barrier; tokens stay unpadded (the page's own layout: some
//     bank conflicts). Stale rows outside the keys stay in shared memory:
//     quantized caches only (their codes are always finite).
//   2 (rows): every thread copies 16-byte pieces of a token's rows with
//     cp.async into the padded rows of layout 0 and arrives on the full
//     barrier through cp.async.mbarrier.arrive.noinc. Where both fit the
//     launcher takes these (Tuning.row_staging): they sustain a higher copy
//     rate than warp 0's bulk copies.
#ifndef KVC_STAGING
#define KVC_STAGING 0
#endif
#define KVC_STAGE_THREADS 0
#define KVC_STAGE_BULK 1
#define KVC_STAGE_ROWS 2
// Either mbarrier pipeline (bulk or row copies).
#define KVC_MBARRIERS (KVC_STAGING != KVC_STAGE_THREADS)

// Row staging: each thread issues its copies of the next tile before computing
// the current one (after every warp has left that stage), not after: two stages
// then keep a tile in flight (two blocks a multiprocessor at d = 96).
#ifndef KVC_ROWS_BEFORE
#define KVC_ROWS_BEFORE 0
#endif

namespace kvc_attn {

using namespace kvc;   // types, conversions and the PTX wrappers (ptx.cuh)

enum { KV_INT4 = 0, KV_INT8 = 1, KV_FP8 = 2, KV_F16 = 3, KV_BF16 = 4 };

}  // namespace kvc_attn

#include "decode_traits.cuh"
#include "decode_block.cuh"
#include "decode_staging.cuh"
#include "decode_fragments.cuh"
#include "decode_query.cuh"
#include "decode_softmax.cuh"
#include "decode_epilogue.cuh"

namespace kvc_attn {

// --- the block ---------------------------------------------------------------

// The page window's helpers (PageTable) stay reachable through an instance of
// this struct: the prefill kernel keeps its pages with them.
template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct Attention : PageTable {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  typedef DecodeStaging<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> Staging;
  typedef DecodeFragments<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> F;
  typedef DecodeQuery<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> Query;
  typedef DecodeSoftmax<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> Softmax;
  typedef DecodeEpilogue<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> Epilogue;

  static __device__ void run(const Params& p, int block_shift) {
    constexpr int KC = T::kKChunks, MD = T::kDimTiles, NP = T::kColumnTiles, GS = T::kRoundSteps;
    constexpr bool kLowSlot = T::kLowSlot, kQuantized = T::kQuantized, kOffset = T::kOffset, kBf16 = T::kBf16;
    constexpr float kLog2e = Softmax::kLog2e;
    extern __shared__ __align__(16) u8 smem[];
    // Score product S^T[token, column] = K[token, :] . Q^T[:, column] per quad of
    // 4 query rows: column 2r + part is row r's high (part 0) or low (part 1)
    // fp16 half, so thread (g, t) ends with the scores of row t, tokens g and
    // g + 8 (c0 + c1, c2 + c3): every lane a row of its own, no lane idle.
    // Output product O^T[dim, column] += V^T[dim, token] . P^T[token, column]
    // per pair of quads: column 2t + j is row t of quad 2 np + j, or with an odd
    // number of quads, the low half of the last quad's probabilities (j = 1).
    // Either way a lane's accumulators belong to the rows it computes the
    // softmax of: rescaling them needs no shuffle.
    DecodeBlock b;
    int q_len, seq_len;
    block_rows<HEADS, T::kRows>(p, b, q_len, seq_len);
    // Ids from a device, unchecked: a tile that means nothing writes nothing.
    if (q_len <= 0 || seq_len < q_len || b.row_begin >= b.total_rows || b.q_begin < 0 ||
        b.q_begin + q_len > p.num_tokens) return;
    block_keys<T::kRows, TILE>(p, b, q_len, seq_len);
    const int warp = b.warp, g = b.g, t = b.t, head0 = b.head0, kv_head = b.kv_head, split = b.split;
    const int q_begin = b.q_begin, row_begin = b.row_begin, total_rows = b.total_rows, context = b.context;
    const int key_lo = b.key_lo, key_hi = b.key_hi, num_tiles = b.num_tiles;
    const int* const table = b.table;

    u8* const barriers = smem + T::kBarrierOffset;   // bulk and row staging: full[STAGES], then empty[STAGES]
    // The caller's query (p.query null) is read and rotated before the first
    // tiles' copies go out, with the first pages' ids loading alongside (the
    // same depth of dependent loads): issued after those copies, its loads would
    // queue behind every block's, and the block would enter its loop long after
    // its first tiles had landed, the next tiles' copies waiting on the loop.
    // Each warp works its rows out a quad at a time in its part of the last
    // stage, which no copy fills before every warp has its fragments.
    const bool own_query = p.query == nullptr;
    float* const query_rows = reinterpret_cast<float*>(smem + (STAGES - 1) * T::kStageBytes) + warp * 4 * HEAD_PAD;
    static_assert(HEADS * 4 * HEAD_PAD * 4 <= T::kStageBytes, "a quad's rows fit in a stage");
    typename Query::QueryBits query_bits;
    if (own_query) Query::load_query_quad(p, q_begin, row_begin, total_rows, kv_head, query_bits);
    // Warp 0 stages the tiles under bulk copies, every warp otherwise: those keep the window.
    typename Staging::PageWindow window{};
    if (KVC_STAGING != KVC_STAGE_BULK || warp == 0) window = Staging::first_window(p, table, key_lo, key_hi, block_shift);
    if (own_query) {
      Query::rotate_query_quad(p, query_bits, query_rows);
      __syncwarp();
    }
    if constexpr (KVC_STAGING == KVC_STAGE_ROWS) {
      if (threadIdx.x < STAGES) {
        mbarrier_init(barriers + 8 * threadIdx.x, T::kThreads);               // every thread's copies
        mbarrier_init(barriers + 8 * (STAGES + threadIdx.x), T::kThreads);    // every reader
      }
      __syncthreads();
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) {
          Staging::slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_rows(p, smem, s, head0, key_lo + s * TILE, key_lo, key_hi, block_shift, window);
          cp_async_arrive_noinc(barriers + 8 * s);
        }
      }
    } else if constexpr (KVC_STAGING == KVC_STAGE_BULK) {
      if (threadIdx.x < STAGES) {
        mbarrier_init(barriers + 8 * threadIdx.x, 32);                // warp 0's lanes
        mbarrier_init(barriers + 8 * (STAGES + threadIdx.x), T::kThreads);  // every reader
      }
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
          if (s < num_tiles) {
            Staging::slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
            Staging::stage_pages(p, smem, s, head0, key_lo + s * TILE, block_shift, window);
          }
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) {
          Staging::slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_tile(p, smem, s, head0, key_lo + s * TILE, key_lo, key_hi, block_shift, window);
        }
        cp_async_commit();
      }
    }

    // Query fragments: lane (g, t) holds column g of each quad, i.e. the high
    // (g even) or low (g odd) fp16 part of row g / 2. Per row: row_unscale,
    // offset_weight and zero_point_weight (what the products' code offsets add
    // to a score, per unit of OFFSET and of zero-point: sums of the row as the
    // products see it, hi + lo, high int4 nibbles' dims counted 16 times for
    // the codes), moved to the lanes t that own the row's softmax.
    u32 qb[QUADS][KC][2];
    float row_unscale[QUADS], offset_weight[QUADS], zero_point_weight[QUADS];
    int row_position[QUADS];
    bool row_valid[QUADS];
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
        Query::load_query_quad(p, q_begin, row_begin + quad * 4, total_rows, kv_head, query_bits);
        Query::rotate_query_quad(p, query_bits, query_rows);
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
      const float unscale = 1.f / up, weight = T::kOffsetValue * sum_over_quad(sum), zp_weight = sum_over_quad(code_sum);
      row_unscale[quad] = __shfl_sync(0xffffffffu, unscale, 8 * t);
      offset_weight[quad] = __shfl_sync(0xffffffffu, weight, 8 * t);
      zero_point_weight[quad] = __shfl_sync(0xffffffffu, zp_weight, 8 * t);
      const int own_row = row_begin + quad * 4 + t;
      row_valid[quad] = own_row < total_rows;
      row_position[quad] = context + own_row / p.group;
    }

    // Every warp is done with its query rows before copies land there (tile 0's loop).
    if (own_query) __syncthreads();
    // Row staging, copies after the tile, 64-token tiles (int4 decode's, which
    // the planner takes for long splits: Tuning.long_tile_min_split_tokens): the
    // last stage is free here (it held the query rows), so tile STAGES - 1 goes
    // out before tile 0's math, not after it. Shorter tiles keep the copies after
    // tile 0: their splits are too short to gain by it, and a compile-time choice
    // spares the long splits a run-time test of the split's length.
    constexpr bool kEarlyLast = KVC_STAGING == KVC_STAGE_ROWS && !KVC_ROWS_BEFORE && TILE >= 64;
    if constexpr (kEarlyLast) {
      constexpr int kLast = STAGES - 1;
      if (kLast < num_tiles) {
        Staging::slide_window(window, p, table, (key_lo + kLast * TILE) >> block_shift, key_lo, key_hi, block_shift);
        Staging::stage_rows(p, smem, kLast, head0, key_lo + kLast * TILE, key_lo, key_hi, block_shift, window);
        cp_async_arrive_noinc(barriers + 8 * kLast);
      }
    }

    // The range of the rows' positions, against which a round's masks are skipped.
    int min_row_position, max_row_position;
    Softmax::row_position_range(row_valid, row_position, min_row_position, max_row_position);

    float out[MD][NP][4];
#pragma unroll
    for (int np = 0; np < NP; ++np) {
#pragma unroll
      for (int md = 0; md < MD; ++md)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[md][np][i] = 0.f;
    }
    float running_max[QUADS], running_sum[QUADS];
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad) {
      running_max[quad] = -KVC_INFINITY;
      running_sum[quad] = 0.f;
    }
    float reference = kQuantized ? 0.f : 1.f;   // R: the V scale the accumulators are in

    for (int tile = 0; tile < num_tiles; ++tile) {
      const int next = tile + STAGES - 1;   // the tile whose copies go out with this one
      const int next_base = key_lo + next * TILE;
      if constexpr (KVC_STAGING == KVC_STAGE_ROWS) {
        mbarrier_wait(barriers + 8 * (tile % STAGES), (tile / STAGES) & 1);
        if (KVC_ROWS_BEFORE && next < num_tiles) {
          // Its stage last held tile - 1: every warp must be done with that.
          if (next >= STAGES) mbarrier_wait(barriers + 8 * (STAGES + next % STAGES), (next / STAGES - 1) & 1);
          Staging::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_rows(p, smem, next % STAGES, head0, next_base, key_lo, key_hi, block_shift, window);
          cp_async_arrive_noinc(barriers + 8 * (next % STAGES));
        }
      } else if constexpr (KVC_STAGING == KVC_STAGE_BULK) {
        if (warp == 0 && next < num_tiles) {
          // Its stage last held tile - 1: wait until every warp is done with that.
          if (next >= STAGES) {
            mbarrier_wait(barriers + 8 * (STAGES + next % STAGES), (next / STAGES - 1) & 1);
            fence_proxy_async();   // those reads (generic proxy) before the copies' writes (async proxy)
          }
          Staging::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_pages(p, smem, next % STAGES, head0, next_base, block_shift, window);
        }
        mbarrier_wait(barriers + 8 * (tile % STAGES), (tile / STAGES) & 1);
      } else {
        cp_async_wait<STAGES - 2>();
        // Everyone is done with the stage the next copy overwrites (tile - 1's).
        __syncthreads();
        if (next < num_tiles) {
          Staging::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_tile(p, smem, next % STAGES, head0, next_base, key_lo, key_hi, block_shift, window);
        }
        cp_async_commit();   // (an empty group at the end keeps wait_group's count in step)
      }
      const int base = key_lo + tile * TILE;
      const u8* keys = smem + (tile % STAGES) * T::kStageBytes + warp * T::kRowBytes;
      const u8* values = keys + T::kKeyBytes;
      const u32* key_scales = reinterpret_cast<const u32*>(smem + (tile % STAGES) * T::kStageBytes +
                                                           T::kKeyBytes + T::kValueBytes) + warp;
      const u32* value_scales = key_scales + TILE * HEADS;

      // Steps of 16 tokens, GS of them a softmax round (decode: a tile's two
      // steps, one quad of rows): the round's score products are independent
      // chains, and its maxima, sums, reference and rescaling are worked out
      // once for 16 GS tokens instead of once a step.
#pragma unroll 1
      for (int round = 0; round < TILE / (16 * GS); ++round) {
        const int first_step = round * GS;
        // Scores of tokens g (c0 + c1) and g + 8 (c2 + c3) of each step, row t of each quad.
        float score[GS][QUADS][4];
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
        // This thread's tokens of step j: g (i = 0) and g + 8 (i = 1).
        float key_scale[GS][2], value_scale[GS][2], key_zero_point[GS][2];
        float largest_value_scale = 0.f;
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
        float tile_reference = reference;
        if constexpr (kQuantized) tile_reference = fmaxf(reference, max_over_columns(largest_value_scale));
        // Approximate division suffices: these only choose the units of the
        // accumulators, and `unchanged` compares the references themselves.
        bool unchanged = tile_reference == reference;
        const float rescale_values =
            unchanged ? 1.f : tile_reference > 0.f ? __fdividef(reference, tile_reference) : 0.f;
        const float to_reference = tile_reference > 0.f ? __fdividef(1.f, tile_reference) : 1.f;
        reference = tile_reference;

        // Probabilities times value scale / R of tokens g, g + 8 of each step per
        // quad, as the fp16 (bf16) values the output product sees: high halves,
        // and the low halves where an operand carries them.
        float weighted_high[GS][QUADS][2], weighted_low[GS][QUADS][2];
        float alpha[QUADS];
        const int round_first = base + first_step * 16;
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
        Softmax::rescale(alpha, rescale_values, unchanged, out);
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
      if constexpr (KVC_MBARRIERS) mbarrier_arrive(barriers + 8 * (STAGES + tile % STAGES));   // done with the stage
      if constexpr (KVC_STAGING == KVC_STAGE_ROWS && !KVC_ROWS_BEFORE) {
        if (next < num_tiles && (!kEarlyLast || next >= STAGES)) {   // (or it went out before the loop)
          // Its stage last held tile - 1: every warp must be done with that.
          if (next >= STAGES) mbarrier_wait(barriers + 8 * (STAGES + next % STAGES), (next / STAGES - 1) & 1);
          Staging::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_rows(p, smem, next % STAGES, head0, next_base, key_lo, key_hi, block_shift, window);
          cp_async_arrive_noinc(barriers + 8 * (next % STAGES));
        }
      }
    }
    cp_async_wait<0>();

    Epilogue::store(p, g, t, split, row_begin, q_begin, kv_head, row_valid, running_max, running_sum, reference, out);
  }
};


// An attention entry's first step (attention.cu: the decode and prefill
// kernels): nothing is read before the kernel ahead is done, and only then may
// the merge's grid start. Let in at the start of both kernels instead, the merge
// and the next call's attention grid could wait at once, their blocks holding
// slots the running grid needs: so at most one grid waits at a time.
__device__ __forceinline__ void enter_dependent_grid() {
  wait_for_prerequisites();
  allow_dependent_launch();
}

}  // namespace kvc_attn
