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
//   decode_staging    the page window, the three ways of copying a tile into a
//                     stage, and the pipeline's order (prologue, before and after a tile)
//   decode_fragments  what a lane reads of a staged row; codes -> exact mma operands
//   decode_query      the caller's query: loads, scaling and rotation into shared
//                     memory, and the score product's query fragments
//   decode_products   a softmax round's score product, token scales and output product
//   decode_softmax    probabilities, masks, running maximum and sum, the rescaling
//   decode_epilogue   a split's partial state (part_stats, part_out)
// Attention::run composes them: set-up, the pipeline's prologue, the query
// fragments, the loop over tiles (waits and copies, then per softmax round
// the score product, the probabilities and the output product), the epilogue.
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
#include "decode_products.cuh"
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
  typedef DecodeProducts<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> Products;

  static __device__ void run(const Params& p, int block_shift) {
    constexpr int KC = T::kKChunks, MD = T::kDimTiles, NP = T::kColumnTiles, GS = T::kRoundSteps;
    constexpr bool kQuantized = T::kQuantized;
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
    if (KVC_STAGING != KVC_STAGE_BULK || warp == 0)
      window = Staging::first_window(p, table, key_lo, key_hi, block_shift);
    if (own_query) {
      Query::rotate_query_quad(p, query_bits, query_rows);
      __syncwarp();
    }
    Staging::prologue(p, smem, window, table, head0, key_lo, key_hi, num_tiles, block_shift);

    u32 qb[QUADS][KC][2];
    float row_unscale[QUADS], offset_weight[QUADS], zero_point_weight[QUADS];
    int row_position[QUADS];
    bool row_valid[QUADS];
    Query::score_fragments(p, own_query, query_rows, q_begin, row_begin, total_rows, kv_head, context,
                           query_bits, qb, row_unscale, offset_weight, zero_point_weight, row_position, row_valid);

    // Every warp is done with its query rows before copies land there (tile 0's loop).
    if (own_query) __syncthreads();
    Staging::early_last(p, smem, window, table, head0, key_lo, key_hi, num_tiles, block_shift);

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
      Staging::before_tile(p, smem, window, table, head0, tile, key_lo, key_hi, num_tiles, block_shift);
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
        Products::score_product(keys, first_step, qb, score);
        float key_scale[GS][2], value_scale[GS][2], key_zero_point[GS][2], largest_value_scale;
        Products::token_scales(key_scales, value_scales, first_step, base, key_hi, key_scale, value_scale,
                               key_zero_point, largest_value_scale);
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
        Softmax::probabilities(p, round_first, key_hi, min_row_position, max_row_position, score, key_scale,
                               key_zero_point, value_scale, to_reference, row_unscale, offset_weight, zero_point_weight,
                               row_valid, row_position, running_max, running_sum, alpha, unchanged, weighted_high,
                               weighted_low);
        Softmax::rescale(alpha, rescale_values, unchanged, out);
        Products::output_product(values, value_scales, first_step, weighted_high, weighted_low, out);
      }
      Staging::after_tile(p, smem, window, table, head0, tile, key_lo, key_hi, num_tiles, block_shift);
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
