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


// --- compile-time shape ----------------------------------------------------

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct Traits {
  static_assert(HEAD_PAD % 32 == 0 && HEAD_PAD >= 32 && HEAD_PAD <= 256, "head size class");
  static_assert(TILE % 16 == 0, "tiles are whole 16-token mma steps");
  static_assert(CHUNK == 1 || CHUNK == 4 || CHUNK == 8 || CHUNK == 16, "copy granule");
  static_assert(QUADS == 1 || QUADS == 2 || QUADS == 4, "4, 8 or 16 query rows a warp");
  static constexpr int kThreads = 32 * HEADS;
  static constexpr bool kBf16 = KV == KV_BF16;
  // Bytes of one stored head row at the padded head size.
  static constexpr int kDimBits = KV == KV_INT4 ? 4 : (KV == KV_INT8 || KV == KV_FP8) ? 8 : 16;
  static constexpr int kRowBytes = HEAD_PAD * kDimBits / 8;
  static constexpr int kKChunks = HEAD_PAD / 16;   // k steps of the score product
  static constexpr int kDimTiles = HEAD_PAD / 16;  // M tiles of the output product
  // What one lane reads of a token's row in shared memory: a key row is read by
  // the 4 lanes t of a token, kKeyWords 32-bit words each, in vectors of
  // kKeyVector words (vector i of lane t at word (4 i + t) kKeyVector); a value
  // row by the 8 lanes g, kValueUnits 16-bit units each, in vectors of
  // kValueVector units (vector i of lane g at unit (8 i + g) kValueVector;
  // int4 at d = 96 loads its 3 units otherwise: Attention::kSplitValues).
  static constexpr int kHeadsBytes = HEADS * kRowBytes;
  static constexpr int kKeyWords = kRowBytes / 16;
  static constexpr int kKeyVector = kKeyWords % 4 == 0 ? 4 : kKeyWords % 2 == 0 ? 2 : 1;
  static constexpr int kValueUnits = kRowBytes / 16;
  static constexpr int kValueVector =
      kValueUnits % 8 == 0 ? 8 : kValueUnits % 4 == 0 ? 4 : kValueUnits % 2 == 0 ? 2 : 1;
  // Token strides in shared memory, in bytes, free of bank conflicts. Keys: a
  // load's wavefront takes 128 / (4 lanes x A bytes) tokens g, A = 4 kKeyVector,
  // each reading 4A consecutive bytes: a stride of 4A modulo 8A places them side by side.
  // Values: the 4 tokens 2t of a wavefront read at most 32 consecutive bytes
  // each: a stride of 16 modulo 32 keeps 2 x stride an odd multiple of 32.
  static constexpr __host__ __device__ int padded(int bytes, int a) {
    return bytes + ((a - bytes % (2 * a)) + 2 * a) % (2 * a);
  }
  static constexpr bool kUnpadded = KVC_STAGING == KVC_STAGE_BULK;   // pages copied as they are
  static constexpr int kKeyStride = kUnpadded ? kHeadsBytes : padded(kHeadsBytes, 16 * kKeyVector);
  static constexpr int kValueStride = kUnpadded ? kHeadsBytes : padded(kHeadsBytes, 16);
  static constexpr int kKeyBytes = TILE * kKeyStride;
  static constexpr int kValueBytes = TILE * kValueStride;
  static constexpr int kScaleBytes = TILE * HEADS * 4;
  static constexpr int kStageBytes = kKeyBytes + kValueBytes + 2 * kScaleBytes;
  // Bulk staging: STAGES "full" then STAGES "empty" mbarriers after the stages.
  static constexpr int kBarrierOffset = STAGES * kStageBytes;
  static constexpr int kSharedBytes = kBarrierOffset + (KVC_MBARRIERS ? 16 * STAGES : 0);
  static_assert(kUnpadded || (kKeyStride % (32 * kKeyVector) == 16 * kKeyVector && kValueStride % 32 == 16),
                "strides");
  static_assert(!KVC_MBARRIERS || (kHeadsBytes % 16 == 0 && HEADS % 4 == 0), "bulk or row copies: 16-byte rows");
};

// --- what a lane reads of a row ------------------------------------------------

// Lane `lane` of the LANES lanes that read one row takes its bytes in vectors
// of VEC bytes, vector i at byte (LANES i + lane) VEC: the offset in the row
// of its byte b.
template <int VEC, int LANES>
__device__ __forceinline__ int lane_byte_offset(int lane, int b) {
  return (b / VEC) * (LANES * VEC) + lane * VEC + b % VEC;
}

// Vector i of VEC bytes of lane `lane`'s share of `row` into words[VEC / 4 i ...]
// (VEC = 2: into the low or high half of words[i / 2]).
template <int VEC, int LANES>
__device__ __forceinline__ void load_lane_vector(const u8* row, int lane, int i, u32* words) {
  const u8* at = row + (i * LANES + lane) * VEC;
  if constexpr (VEC == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(at);
    words[4 * i] = v.x, words[4 * i + 1] = v.y, words[4 * i + 2] = v.z, words[4 * i + 3] = v.w;
  } else if constexpr (VEC == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(at);
    words[2 * i] = v.x, words[2 * i + 1] = v.y;
  } else if constexpr (VEC == 4) {
    words[i] = *reinterpret_cast<const u32*>(at);
  } else {
    const u32 unit = *reinterpret_cast<const u16*>(at);
    words[i / 2] = i % 2 ? words[i / 2] | (unit << 16) : unit;
  }
}

// --- conversions of stored codes to mma operands ------------------------------

// e4m3 bytes in the high byte of each half -> fp16 bits of value * 2^-8 (exact:
// sign stays, exponent and mantissa shift right by one; subnormals map to
// subnormals). NaN (0x7F) maps to a finite value: the format never stores it.
__device__ __forceinline__ u32 fp8_pair(u32 bytes_in_high_of_halves) {
  return (bytes_in_high_of_halves & 0x80008000u) | ((bytes_in_high_of_halves >> 1) & 0x3F803F80u);
}

// --- a split's partial state ---------------------------------------------------

// Row `row` (query token q_begin + row / group, query head kv_head x group +
// row % group) of split `split`: its index in part_stats (2 words each) and
// part_out (head_size each); split_rows = split x num_tokens.
__device__ __forceinline__ long long part_index(const Params& p, long long split_rows, int q_begin, int row,
                                                int kv_head) {
  return (split_rows + q_begin + row / p.group) * p.num_heads + kv_head * p.group + row % p.group;
}

// Its running maximum (natural units) and sum, stored by one lane.
__device__ __forceinline__ void store_part_stats(const Params& p, long long index, float running_max, float sum) {
  p.part_stats[2 * index] = running_max;
  p.part_stats[2 * index + 1] = sum;
}

// --- staging one token's pieces ---------------------------------------------

// Piece `offset` (CHUNK bytes; 4 bytes by plain loads for CHUNK 1, rows whose
// length is no multiple of 4) of one token's K and V rows of KV head `head`
// into shared memory; zero-filled for an invalid token or past the row's end.
template <int CHUNK>
__device__ __forceinline__ void stage_row_piece(const Params& p, u8* key_dst, u8* value_dst, int block,
                                                long long slot, int head, int offset, bool valid) {
  const u8* key_src = p.key_cache + block * p.k_block_stride + slot * p.k_slot_stride + head * p.k_head_stride + offset;
  const u8* value_src =
      p.value_cache + block * p.v_block_stride + slot * p.v_slot_stride + head * p.v_head_stride + offset;
  if constexpr (CHUNK == 1) {
    for (int b = 0; b < 4; ++b) {
      const bool ok = valid && offset + b < p.row_bytes;
      key_dst[b] = ok ? key_src[b] : u8(0);
      value_dst[b] = ok ? value_src[b] : u8(0);
    }
  } else {
    const int bytes = valid && offset < p.row_bytes ? CHUNK : 0;
    cp_async(key_dst, bytes ? key_src : p.key_cache, bytes, CHUNK);
    cp_async(value_dst, bytes ? value_src : p.value_cache, bytes, CHUNK);
  }
}

// One token's K and V scale words of KV head `head`; zero for an invalid token.
__device__ __forceinline__ void stage_scale_words(const Params& p, u8* key_dst, u8* value_dst, int block,
                                                  long long slot, int head, bool valid) {
  const u8* key_src = p.k_scales + block * p.ks_block_stride + slot * p.ks_slot_stride + head * p.ks_head_stride;
  const u8* value_src = p.v_scales + block * p.vs_block_stride + slot * p.vs_slot_stride + head * p.vs_head_stride;
  cp_async(key_dst, valid ? key_src : p.k_scales, valid ? 4 : 0, 4);
  cp_async(value_dst, valid ? value_src : p.v_scales, valid ? 4 : 0, 4);
}

}  // namespace kvc_attn

namespace kvc_attn {

// --- the block ---------------------------------------------------------------

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct Attention {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  static constexpr int KC = T::kKChunks;
  static constexpr int MD = T::kDimTiles;
  static constexpr bool kQuantized = KV == KV_INT4 || KV == KV_INT8 || KV == KV_FP8;
  static constexpr bool kBf16 = T::kBf16;
  static constexpr float kLog2e = 1.4426950408889634f;

  // Code offsets: conversions leave OFFSET + code in fp16 (int4: the nibble
  // under 0x6400 = 1024; int8: the biased byte under 0x6400 = 1024 + 128), exact;
  // scores subtract OFFSET (and the zero-point) once per score, value codes
  // before the output product. fp8 and plain caches have none.
  static constexpr bool kOffset = KV == KV_INT4 || KV == KV_INT8;
  static constexpr u32 kOffsetHalf = KV == KV_INT8 ? 0x6480u : 0x6400u;   // 1152 or 1024 in fp16
  static constexpr float kOffsetValue = KV == KV_INT8 ? 1152.f : 1024.f;
  // fp8 codes enter the products as e4m3 * 2^-8 (fp8_pair): scales carry the 2^8.
  static constexpr float kCodeUnit = KV == KV_FP8 ? 256.f : 1.f;
  static constexpr int kWorkPerThread = (TILE * HEADS * (T::kRowBytes / (CHUNK == 1 ? 4 : CHUNK)) +
                                         T::kThreads - 1) / T::kThreads;

  // The physical blocks of the pages of the keys [lo, hi), read from the block
  // table 32 pages at a time and one window ahead: lane l holds page base + l
  // (current) and base + 32 + l (next), -1 for a page outside [lo, hi) or an
  // id outside the cache. A tile's copies then never wait on the block table:
  // under full load a table read queues behind the page traffic, and with one
  // tile of lead the copies would stall on it.
  struct PageWindow {
    int base, current, next;
  };

  static __device__ __forceinline__ int load_page(const Params& p, const int* table, int page, int lo, int hi,
                                                  int block_shift) {
    const int page_start = page << block_shift;
    int block = -1;
    if (page_start < hi && page_start + p.block_size > lo) {
      block = table[page];
      if (block < 0 || block >= p.num_blocks) block = -1;
    }
    return block;
  }

  static __device__ __forceinline__ PageWindow first_window(const Params& p, const int* table, int lo, int hi,
                                                            int block_shift) {
    const int lane = threadIdx.x & 31;
    const int base = lo >> block_shift;
    return {base, load_page(p, table, base + lane, lo, hi, block_shift),
            load_page(p, table, base + 32 + lane, lo, hi, block_shift)};
  }

  // Slide the window so that it starts within 32 pages of `page` (called with
  // each tile's first page in order: a tile spans at most 33 pages, so the
  // tile then lies inside the two halves).
  static __device__ __forceinline__ void slide_window(PageWindow& w, const Params& p, const int* table, int page,
                                                      int lo, int hi, int block_shift) {
    if (page - w.base >= 32) {
      w.base += 32;
      w.current = w.next;
      w.next = load_page(p, table, w.base + 32 + (threadIdx.x & 31), lo, hi, block_shift);
    }
  }

  // The block of `page` (base <= page < base + 64). Every lane takes part.
  static __device__ __forceinline__ int block_of(const PageWindow& w, int page) {
    const int index = page - w.base;
    const int current = __shfl_sync(0xffffffffu, w.current, index & 31);
    const int next = __shfl_sync(0xffffffffu, w.next, index & 31);
    return index < 32 ? current : next;
  }

  // Stage `stage` <- keys/values/scales of tokens base .. base + TILE - 1 that lie in
  // [lo, hi); the others, and every id outside the cache, are zero-filled.
  static __device__ __forceinline__ void stage_tile(const Params& p, u8* smem, int stage, int head0, int base,
                                                    int lo, int hi, int block_shift, const PageWindow& window) {
    u8* keys = smem + stage * T::kStageBytes;
    u8* values = keys + T::kKeyBytes;
    u8* key_scales = values + T::kValueBytes;
    u8* value_scales = key_scales + T::kScaleBytes;
    constexpr int kPieces = T::kRowBytes / (CHUNK == 1 ? 4 : CHUNK);
    constexpr int kWork = TILE * HEADS * kPieces;
    constexpr int kTokenPieces = HEADS * kPieces;
    if constexpr (CHUNK > 1 && T::kThreads % kTokenPieces == 0 && TILE % (T::kThreads / kTokenPieces) == 0) {
      // Every token a thread copies takes the same head and piece: the piece's
      // offsets once a tile, a block id and two addresses a token (the loop
      // below works all of that out again for every piece).
      constexpr int kTokenStep = T::kThreads / kTokenPieces;
      const int rest = threadIdx.x % kTokenPieces, first = threadIdx.x / kTokenPieces;
      const int head = rest / kPieces, offset = (rest - head * kPieces) * CHUNK;
      const bool in_row = offset < p.row_bytes;
      const long long key_part = (head0 + head) * p.k_head_stride + offset;
      const long long value_part = (head0 + head) * p.v_head_stride + offset;
      u8* const key_dst = keys + first * T::kKeyStride + head * T::kRowBytes + offset;
      u8* const value_dst = values + first * T::kValueStride + head * T::kRowBytes + offset;
#pragma unroll
      for (int i = 0; i < TILE / kTokenStep; ++i) {
        const int position = base + first + i * kTokenStep;
        const int block = block_of(window, position >> block_shift);
        const long long slot = position & (p.block_size - 1);
        const int bytes = in_row && block >= 0 && position >= lo && position < hi ? CHUNK : 0;
        const u8* key_src = p.key_cache + block * p.k_block_stride + slot * p.k_slot_stride + key_part;
        const u8* value_src = p.value_cache + block * p.v_block_stride + slot * p.v_slot_stride + value_part;
        cp_async(key_dst + i * kTokenStep * T::kKeyStride, bytes ? key_src : p.key_cache, bytes, CHUNK);
        cp_async(value_dst + i * kTokenStep * T::kValueStride, bytes ? value_src : p.value_cache, bytes, CHUNK);
      }
    } else {
#pragma unroll 1
      for (int i = 0; i < kWorkPerThread; ++i) {
        const int c = threadIdx.x + i * T::kThreads;
        const int token = c / (HEADS * kPieces);
        const int rest = c - token * (HEADS * kPieces);
        const int head = rest / kPieces;
        const int piece = rest - head * kPieces;
        const int position = base + token;
        // Every lane takes part in the shuffle, also past the end of the work.
        const int block = block_of(window, position >> block_shift);
        if (c >= kWork) continue;
        const bool valid_token = block >= 0 && position >= lo && position < hi;
        const long long slot = position & (p.block_size - 1);
        const int offset = piece * (CHUNK == 1 ? 4 : CHUNK);
        stage_row_piece<CHUNK>(p, keys + token * T::kKeyStride + head * T::kRowBytes + offset,
                               values + token * T::kValueStride + head * T::kRowBytes + offset, block, slot,
                               head0 + head, offset, valid_token);
      }
    }
    if constexpr (kQuantized) {
#pragma unroll 1
      for (int i = 0; i < (TILE * HEADS + T::kThreads - 1) / T::kThreads; ++i) {
        const int c = threadIdx.x + i * T::kThreads;
        const int token = c / HEADS, head = c - token * HEADS;
        const int position = base + token;
        const int block = block_of(window, position >> block_shift);
        if (c >= TILE * HEADS) continue;
        const bool valid_token = block >= 0 && position >= lo && position < hi;
        const long long slot = position & (p.block_size - 1);
        stage_scale_words(p, key_scales + 4 * c, value_scales + 4 * c, block, slot, head0 + head, valid_token);
      }
    }
  }

  // Bulk staging (KVC_STAGE_BULK), by warp 0: lane 4 r + kind copies page run r of
  // the tile (the tokens of base .. base + TILE - 1 on its r-th page) of tensor
  // `kind` (K, V, K scales, V scales). A run on no page of the sequence, or on
  // a block id outside the cache, is skipped: its scores are masked and its
  // stale codes finite. Every lane arrives on the stage's full barrier,
  // announcing the bytes it copies.
  static __device__ __forceinline__ void stage_pages(const Params& p, u8* smem, int stage, int head0, int base,
                                                     int block_shift, const PageWindow& window) {
    const int lane = threadIdx.x & 31;
    const int run = lane >> 2, kind = lane & 3;
    const int first_page = base >> block_shift;
    const int page = first_page + run;
    const int block = block_of(window, page);
    const int run_begin = max(base, page << block_shift);
    const int run_end = min(base + TILE, (page + 1) << block_shift);
    void* full = smem + T::kBarrierOffset + 8 * stage;
    u32 bytes = 0;
    if (run_begin < run_end && block >= 0) {
      const int token = run_begin - base;
      const long long slot = run_begin & (p.block_size - 1);
      u8* keys = smem + stage * T::kStageBytes;
      u8* destination;
      const u8* source;
      if (kind < 2) {
        destination = keys + kind * T::kKeyBytes + token * T::kHeadsBytes;
        source = kind == 0
            ? p.key_cache + block * p.k_block_stride + slot * p.k_slot_stride + head0 * p.k_head_stride
            : p.value_cache + block * p.v_block_stride + slot * p.v_slot_stride + head0 * p.v_head_stride;
        bytes = (run_end - run_begin) * T::kHeadsBytes;
      } else {
        destination = keys + 2 * T::kKeyBytes + (kind - 2) * T::kScaleBytes + token * HEADS * 4;
        source = kind == 2
            ? p.k_scales + block * p.ks_block_stride + slot * p.ks_slot_stride + head0 * p.ks_head_stride
            : p.v_scales + block * p.vs_block_stride + slot * p.vs_slot_stride + head0 * p.vs_head_stride;
        bytes = (run_end - run_begin) * HEADS * 4;
      }
      mbarrier_arrive_expect(full, bytes);
      bulk_copy(destination, source, bytes, full);
    } else {
      mbarrier_arrive_expect(full, 0);
    }
  }

  // Row staging (KVC_STAGE_ROWS), by every thread: the tile's token rows (every
  // KV head of the block side by side, one contiguous run in the page) into the
  // padded rows of the per-thread layout, kLanesPerToken threads a token, each
  // copying 16-byte pieces part, part + kLanesPerToken, ... of its K and V rows
  // and then of the scale rows: one block id and one address a thread and
  // pass (one pass a tile, two for 64-token tiles of 8 warps), the pieces at
  // constant offsets from it. A token outside [lo, hi) or
  // on an id outside the cache is zero-filled. The caller then arrives on the
  // stage's full barrier through cp_async_arrive_noinc.
  static __device__ __forceinline__ void stage_rows(const Params& p, u8* smem, int stage, int head0, int base,
                                                    int lo, int hi, int block_shift, const PageWindow& window) {
    // At least 8 threads a token where its rows allow, so that each copy instruction of
    // a warp takes whole 128-byte lines of four tokens' rows (four threads a token would
    // take half lines of eight tokens), in several passes a tile where the block is
    // short of threads.
    constexpr int kLanesPerToken = T::kHeadsBytes >= 128 && T::kThreads / TILE < 8 ? 8 : T::kThreads / TILE;
    static_assert(T::kThreads % kLanesPerToken == 0 && TILE % (T::kThreads / kLanesPerToken) == 0,
                  "whole threads a token, whole passes a tile");
    constexpr int kTokensPerPass = T::kThreads / kLanesPerToken;
    constexpr int kScaleBytes = HEADS * 4;
    u8* const keys = smem + stage * T::kStageBytes;
    const int part = threadIdx.x % kLanesPerToken;
#pragma unroll
    for (int pass = 0; pass < TILE / kTokensPerPass; ++pass) {
      const int token = pass * kTokensPerPass + threadIdx.x / kLanesPerToken;
      const int position = base + token;
      const int block = block_of(window, position >> block_shift);
      const bool valid = block >= 0 && position >= lo && position < hi;
      const long long slot = position & (p.block_size - 1);
      const int bytes = valid ? 16 : 0;
      // An invalid token copies nothing (zero bytes) from a harmless address.
      const u8* key_row = valid ? p.key_cache + block * p.k_block_stride + slot * p.k_slot_stride +
                                      head0 * p.k_head_stride
                                : p.key_cache;
      const u8* value_row = valid ? p.value_cache + block * p.v_block_stride + slot * p.v_slot_stride +
                                        head0 * p.v_head_stride
                                  : p.value_cache;
      u8* const key_dst = keys + token * T::kKeyStride;
      u8* const value_dst = keys + T::kKeyBytes + token * T::kValueStride;
#pragma unroll
      for (int k = 0; k < (T::kHeadsBytes / 16 + kLanesPerToken - 1) / kLanesPerToken; ++k) {
        const int offset = 16 * (part + k * kLanesPerToken);
        if ((T::kHeadsBytes / 16) % kLanesPerToken == 0 || offset < T::kHeadsBytes) {
          cp_async(key_dst + offset, key_row + offset, bytes, 16);
          cp_async(value_dst + offset, value_row + offset, bytes, 16);
        }
      }
      if constexpr (kQuantized) {
        static_assert(kScaleBytes % 16 == 0 && 2 * kScaleBytes / 16 <= kLanesPerToken, "one scale piece a thread");
        // Threads part < kScaleBytes / 16 copy K scale pieces, the next ones V's.
        const bool key = part < kScaleBytes / 16;
        const int offset = 16 * (key ? part : part - kScaleBytes / 16);
        if (part < 2 * kScaleBytes / 16) {
          const u8* row = !valid ? p.k_scales
                          : key  ? p.k_scales + block * p.ks_block_stride + slot * p.ks_slot_stride +
                                      head0 * p.ks_head_stride
                                 : p.v_scales + block * p.vs_block_stride + slot * p.vs_slot_stride +
                                      head0 * p.vs_head_stride;
          u8* const destination = keys + T::kKeyBytes + T::kValueBytes + (key ? 0 : T::kScaleBytes) +
                                  token * kScaleBytes;
          cp_async(destination + offset, row + offset, bytes, 16);
        }
      }
    }
  }

  // int4: the scale word's low 4 bits are the zero-point, the rest the scale.
  static __device__ __forceinline__ float scale_of(u32 bits) {
    return KV == KV_INT4 ? __uint_as_float(bits & ~0xFu) : __uint_as_float(bits);
  }

  static __device__ __forceinline__ float zero_point_of(u32 bits) { return KV == KV_INT4 ? float(bits & 0xFu) : 0.f; }

  // int4 codes enter the products as OFFSET + code for the low nibble of each
  // byte and OFFSET + 16 code for the high one (no shift needed to place it):
  // logical dims 16 kc + 8.. 15 of the keys (the query there is divided by 16)
  // and output rows g + 8 of the values (the sums there are divided by 16).
  static constexpr float kHighNibble = KV == KV_INT4 ? 16.f : 1.f;

  // OFFSET + zero-point of two tokens as fp16 pairs, for low nibbles and (x16) high ones.
  static __device__ __forceinline__ void offset_pairs(u32 bits_a, u32 bits_b, u32& low, u32& high) {
    if constexpr (KV == KV_INT4) {
      const u32 both = prmt(bits_a, bits_b, 0x5410u);   // each token's low half: zero-point in bits 0..3
      low = lop_and_or(both, 0x000F000Fu, 0x64006400u);
      high = lop_and_or(both << 4, 0x00F000F0u, 0x64006400u);
    } else {
      low = high = kOffsetHalf | (kOffsetHalf << 16);
    }
  }

  // Channel permutations: key_dim_of / value_dim_of map a logical dim of the
  // products to the cache's channel (the stored value's index in the row).
  static constexpr int kKeyVecBytes = 4 * T::kKeyVector;
  static constexpr int kValueVecBytes = 2 * T::kValueVector;
  // int4 at d = 96: a lane's 6 bytes of a value row in one 4-byte load (units 0
  // and 1, at 4g) and one 2-byte load (unit 2, at 32 + 2g), where the uniform
  // vectors would take three 2-byte loads.
  static constexpr bool kSplitValues = KV == KV_INT4 && HEAD_PAD == 96;
  static constexpr int kValueLoads = kSplitValues ? 2 : T::kValueUnits / T::kValueVector;

  // Byte b of lane g's share of a value row: its offset in the row.
  static __device__ __forceinline__ int value_byte_offset(int g, int b) {
    if constexpr (kSplitValues) return b < 4 ? 4 * g + b : 32 + 2 * g + (b - 4);
    else return lane_byte_offset<kValueVecBytes, 8>(g, b);
  }

  // Load `vector` (< kValueLoads) of lane g's share of a value row into its words
  // (two 16-bit units a word, the first in the low half).
  static __device__ __forceinline__ void load_value_vector(const u8* row, int g, int vector, u32* words) {
    if constexpr (kSplitValues) {   // units 0 and 1 (bytes 0-3 of the share), then unit 2 (bytes 4-5)
      if (vector == 0) words[0] = *reinterpret_cast<const u32*>(row + value_byte_offset(g, 0));
      else words[1] = *reinterpret_cast<const u16*>(row + value_byte_offset(g, 4));
    } else {
      load_lane_vector<kValueVecBytes, 8>(row, g, vector, words);
    }
  }

  // Keys: lane t's words become one token's fp16 pairs of logical dims
  // 16 kc + 2t + {0, 1} and 16 kc + 8 + 2t + {0, 1} (key_fragment).
  static __device__ __forceinline__ int key_dim_of(int logical) {
    const int kc = logical >> 4, pos = logical & 15;
    const int high8 = pos >> 3, t = (pos & 7) >> 1, half = pos & 1;
    if constexpr (KV == KV_INT4) {
      // word kc / 2, nibbles n0..n7: pair (n_k, n_{k+4}), k = 2 (kc % 2) + high8.
      const int n = 2 * (kc & 1) + high8 + 4 * half;
      return 2 * lane_byte_offset<kKeyVecBytes, 4>(t, 4 * (kc >> 1) + n / 2) + n % 2;
    } else if constexpr (KV == KV_INT8 || KV == KV_FP8) {
      return lane_byte_offset<kKeyVecBytes, 4>(t, 4 * kc + 2 * high8 + half);
    } else {
      return lane_byte_offset<kKeyVecBytes, 4>(t, 4 * (2 * kc + high8) + 2 * half) / 2;
    }
  }

  // Values: lane g's 16-bit unit u, for the tokens of the A fragment's columns
  // (2t, 2t+1, 2t+8, 2t+9), gives rows g (r = 0) and g + 8 (r = 1) of M tile md:
  // logical dim 16 md + g + 8 r.
  static __device__ __forceinline__ int value_dim_of(int logical) {
    const int md = logical >> 4, pos = logical & 15, g = pos & 7, r = pos >> 3;
    if constexpr (KV == KV_INT4) {
      // unit md / 2, byte md % 2: low nibble row g, high nibble row g + 8.
      return 2 * value_byte_offset(g, md) + r;
    } else if constexpr (KV == KV_INT8 || KV == KV_FP8) {
      return lane_byte_offset<kValueVecBytes, 8>(g, 2 * md + r);
    } else {
      return lane_byte_offset<kValueVecBytes, 8>(g, 2 * (2 * md + r)) / 2;
    }
  }

  // One token's half of k step kc's A fragment (a0, a2 for token g; a1, a3 for g + 8):
  // dims 16 kc + 2t + {0, 1} and 16 kc + 8 + 2t + {0, 1}, from lane t's words of its key row.
  static __device__ __forceinline__ void key_fragment(const u32* words, int kc, u32& b0, u32& b1) {
    if constexpr (KV == KV_INT4) {
      const u32 word = (kc & 1) ? words[kc >> 1] >> 8 : words[kc >> 1];
      b0 = lop_and_or(word, 0x000F000Fu, 0x64006400u);
      b1 = lop_and_or(word, 0x00F000F0u, 0x64006400u);
    } else if constexpr (KV == KV_INT8) {
      b0 = (prmt(words[kc], 0u, 0x4140u) ^ 0x00800080u) | 0x64006400u;
      b1 = (prmt(words[kc], 0u, 0x4342u) ^ 0x00800080u) | 0x64006400u;
    } else if constexpr (KV == KV_FP8) {
      b0 = fp8_pair(prmt(words[kc], 0u, 0x1404u));
      b1 = fp8_pair(prmt(words[kc], 0u, 0x3424u));
    } else {
      b0 = words[2 * kc];
      b1 = words[2 * kc + 1];
    }
  }

  // Lane g's 16-bit unit u of two tokens' value rows as one word (first token low).
  static __device__ __forceinline__ u32 unit_pair(const u32* first, const u32* second, int u) {
    return prmt(first[u >> 1], second[u >> 1], (u & 1) ? 0x7632u : 0x5410u);
  }

  // The word of lane t's share of a key row that holds k step kc (f16: and the next).
  static constexpr __host__ __device__ int key_word_of(int kc) {
    return KV == KV_INT4 ? kc >> 1 : KV == KV_INT8 || KV == KV_FP8 ? kc : 2 * kc;
  }

  // The 16-bit unit of lane g's share of a value row that holds M tile md's rows.
  static constexpr __host__ __device__ int value_unit_of(int md) {
    return KV == KV_INT4 ? md >> 1 : KV == KV_INT8 || KV == KV_FP8 ? md : 2 * md;
  }

  // The load (load_value_vector) that brings M tile md's unit.
  static constexpr __host__ __device__ int value_load_of(int md) {
    return kSplitValues ? (value_unit_of(md) < 2 ? 0 : 1) : value_unit_of(md) / T::kValueVector;
  }

  // The A fragment of output M tile md from lane g's words of the rows of
  // tokens 2t, 2t+1, 2t+8, 2t+9 (rows[0..3]): OFFSET + code.
  static __device__ __forceinline__ void value_fragment(const u32* const (&rows)[4], int md, u32 (&a)[4]) {
    const int u = value_unit_of(md);
    if constexpr (KV == KV_INT4) {
      const int shift = (md & 1) ? 8 : 0;
      const u32 c01 = unit_pair(rows[0], rows[1], u) >> shift, c23 = unit_pair(rows[2], rows[3], u) >> shift;
      a[0] = lop_and_or(c01, 0x000F000Fu, 0x64006400u);
      a[1] = lop_and_or(c01, 0x00F000F0u, 0x64006400u);
      a[2] = lop_and_or(c23, 0x000F000Fu, 0x64006400u);
      a[3] = lop_and_or(c23, 0x00F000F0u, 0x64006400u);
    } else if constexpr (KV == KV_INT8 || KV == KV_FP8) {
      const u32 c01 = unit_pair(rows[0], rows[1], u), c23 = unit_pair(rows[2], rows[3], u);
      if constexpr (KV == KV_INT8) {
        a[0] = (prmt(c01, 0u, 0x4240u) ^ 0x00800080u) | 0x64006400u;
        a[1] = (prmt(c01, 0u, 0x4341u) ^ 0x00800080u) | 0x64006400u;
        a[2] = (prmt(c23, 0u, 0x4240u) ^ 0x00800080u) | 0x64006400u;
        a[3] = (prmt(c23, 0u, 0x4341u) ^ 0x00800080u) | 0x64006400u;
      } else {
        a[0] = fp8_pair(prmt(c01, 0u, 0x2404u));
        a[1] = fp8_pair(prmt(c01, 0u, 0x3414u));
        a[2] = fp8_pair(prmt(c23, 0u, 0x2404u));
        a[3] = fp8_pair(prmt(c23, 0u, 0x3414u));
      }
    } else {
      a[0] = unit_pair(rows[0], rows[1], u);
      a[1] = unit_pair(rows[0], rows[1], u + 1);
      a[2] = unit_pair(rows[2], rows[3], u);
      a[3] = unit_pair(rows[2], rows[3], u + 1);
    }
  }

  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    return kBf16 ? pack_bf162(lo, hi) : pack_half2(lo, hi);
  }

  static __device__ __forceinline__ float2 unpack(u32 x) {
    return kBf16 ? unpack_bf162(x) : unpack_half2(x);
  }

  // P^T fragments from P: thread (g, t) holds the b16 pair of row g, columns
  // 2t, 2t + 1 of an 8 x 8 matrix and receives the pair of its transpose.
  static __device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
  }

  // Decode reading the caller's query (p.query null): the 4 rows of one quad,
  // row_begin .. row_begin + 3 of the tile (rows past total_rows zero), into
  // rows[r][channel] in float32: times query_factor and, where sign_shift >= 0,
  // rotated (s * x, then H_b on every block of b = 2^sign_shift channels,
  // warp_butterflies: as the rotate kernel would, in float32, a few ulp
  // against its float64). This replaces a rotate launch, and its float32
  // round trip through global memory, per decode step. In two steps: the
  // loads (a value's bits: float32, or a 16-bit value in the low half) and
  // the rotation, which run() does for the first quad before the first tiles'
  // copies go out (see there).
  static constexpr int kQuerySlots = HEAD_PAD / 32;
  // The quad's rows (a value's bits each) and, where the query is rotated, the
  // sign words of its channels lane + 32 k.
  struct QueryBits {
    u32 rows[4][kQuerySlots];
    u32 signs[kQuerySlots];
  };

  static __device__ __forceinline__ void load_query_quad(const Params& p, int q_begin, int row_begin,
                                                         int total_rows, int kv_head, QueryBits& bits) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = row_begin + r;
      const bool valid = row < total_rows;
      const long long start = valid ? (q_begin + row / p.group) * p.q_token_stride +
                                          static_cast<long long>(kv_head * p.group + row % p.group) * p.q_head_stride
                                    : 0;
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) {
        const int channel = lane + 32 * k;
        u32 b = 0u;   // 0.0 in every dtype
        if (valid && channel < p.head_size) {
          b = p.query_dtype == kDtypeF32 ? __float_as_uint(static_cast<const float*>(p.query_in)[start + channel])
                                         : u32(static_cast<const u16*>(p.query_in)[start + channel]);
        }
        bits.rows[r][k] = b;
      }
    }
    // The signs too: loaded later, they would queue behind every block's first
    // copies and hold the block out of its loop.
#pragma unroll
    for (int k = 0; k < kQuerySlots; ++k) bits.signs[k] = p.sign_shift >= 0 ? __ldg(p.signs + k) : 0u;
  }

  static __device__ __forceinline__ void rotate_query_quad(const Params& p, const QueryBits& bits, float* rows) {
    const int lane = threadIdx.x & 31;
    float v[4][kQuerySlots];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) {
        const u32 b = bits.rows[r][k];
        v[r][k] = p.query_dtype == kDtypeF32   ? __uint_as_float(b)
                  : p.query_dtype == kDtypeF16 ? kvc::to_float(kvc::half{u16(b)})
                                               : kvc::to_float(kvc::bfloat16{u16(b)});
      }
    if (p.sign_shift >= 0) {
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) {
        const u32 negative = (bits.signs[k] >> lane) & 1u;   // channel lane + 32 k
#pragma unroll
        for (int r = 0; r < 4; ++r) v[r][k] = negative ? -v[r][k] : v[r][k];
      }
      warp_butterflies(v, lane, p.sign_shift);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < kQuerySlots; ++k) rows[r * HEAD_PAD + lane + 32 * k] = v[r][k] * p.query_factor;
  }

  static __device__ void run(const Params& p, int block_shift) {
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
    constexpr int NP = (QUADS + 1) / 2;                   // output column tiles
    // 16-token steps a softmax round (the loop over a tile's keys).
    constexpr int GS = QUADS == 1 ? TILE / 16 : 1;
    static_assert(TILE % (16 * GS) == 0, "whole rounds a tile");
    constexpr bool kLowSlot = QUADS % 2 == 1;             // the last tile's j = 1: low halves
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int seq = p.tiles[2 * blockIdx.y], row_tile = p.tiles[2 * blockIdx.y + 1];
    const int head0 = blockIdx.z * HEADS;
    const int kv_head = head0 + warp;
    const int split = blockIdx.x;

    // The tile's rows: (query token, query head of the group), flattened.
    const int q_begin = p.cu_seqlens_q[seq];
    const int q_len = p.cu_seqlens_q[seq + 1] - q_begin;
    const int seq_len = min(p.seq_lens[seq], p.table_width * p.block_size);
    constexpr int ROWS = 4 * QUADS;
    const int row_begin = row_tile * ROWS;
    const int total_rows = q_len * p.group;
    // Ids from a device, unchecked: a tile that means nothing writes nothing.
    if (q_len <= 0 || seq_len < q_len || row_begin >= total_rows || q_begin < 0 ||
        q_begin + q_len > p.num_tokens) return;
    const int context = seq_len - q_len;   // position of the first query token
    const int last_row = min(row_begin + ROWS, total_rows) - 1;
    const int first_position = context + row_begin / p.group;
    const int last_position = context + last_row / p.group;
    const int key_lo = max(p.window ? first_position - p.window + 1 : 0, split * p.split_tokens);
    const int key_hi = min(last_position + 1, (split + 1) * p.split_tokens);
    const int* table = p.block_table + static_cast<long long>(seq) * p.table_width;

    const int num_tiles = key_hi > key_lo ? (key_hi - key_lo + TILE - 1) / TILE : 0;
    u8* const barriers = smem + T::kBarrierOffset;   // bulk and row staging: full[STAGES], then empty[STAGES]
    // Row staging: each warp copies its share of tile t + STAGES - 1 after
    // computing tile t (of 64-token tiles, tile STAGES - 1 before the loop,
    // where its stage frees) rather than before, into the stage of tile t - 1,
    // which by then the other warps have most likely left too (issued before t,
    // every warp would wait there for the slowest). With two stages that would
    // leave no copy in flight: the launcher takes bulk copies there, or issues
    // them before the tile (KVC_ROWS_BEFORE: two blocks a multiprocessor, d = 96).
    static_assert(KVC_STAGING != KVC_STAGE_ROWS || STAGES >= 3 || KVC_ROWS_BEFORE, "row staging: three stages or more");
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
    QueryBits query_bits;
    if (own_query) load_query_quad(p, q_begin, row_begin, total_rows, kv_head, query_bits);
    // Warp 0 stages the tiles under bulk copies, every warp otherwise: those keep the window.
    PageWindow window{};
    if (KVC_STAGING != KVC_STAGE_BULK || warp == 0) window = first_window(p, table, key_lo, key_hi, block_shift);
    if (own_query) {
      rotate_query_quad(p, query_bits, query_rows);
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
          slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
          stage_rows(p, smem, s, head0, key_lo + s * TILE, key_lo, key_hi, block_shift, window);
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
            slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
            stage_pages(p, smem, s, head0, key_lo + s * TILE, block_shift, window);
          }
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) {
          slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
          stage_tile(p, smem, s, head0, key_lo + s * TILE, key_lo, key_hi, block_shift, window);
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
        load_query_quad(p, q_begin, row_begin + quad * 4, total_rows, kv_head, query_bits);
        rotate_query_quad(p, query_bits, query_rows);
        __syncwarp();
      }
      float values[KC][4];
      float largest = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int logical = 16 * kc + 2 * t + (i & 1) + 8 * (i >> 1);
          const int channel = key_dim_of(logical);
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
          const float high = i >= 2 ? kHighNibble : 1.f;   // dims 16 kc + 8.. (exact: a power of two)
          const float v = values[kc][i] * up / high;
          const float hi = unpack(pack(v, 0.f)).x;
          const float lo = unpack(pack(v - hi, 0.f)).x;
          sum += hi + lo;
          code_sum += (hi + lo) * high;
          part[i] = (g & 1) ? lo : hi;
        }
        qb[quad][kc][0] = pack(part[0], part[1]);
        qb[quad][kc][1] = pack(part[2], part[3]);
      }
      // Row t of the quad lives in lanes g = 2t, 2t + 1: lane 8t has it whole.
      const float unscale = 1.f / up, weight = kOffsetValue * sum_over_quad(sum), zp_weight = sum_over_quad(code_sum);
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
        slide_window(window, p, table, (key_lo + kLast * TILE) >> block_shift, key_lo, key_hi, block_shift);
        stage_rows(p, smem, kLast, head0, key_lo + kLast * TILE, key_lo, key_hi, block_shift, window);
        cp_async_arrive_noinc(barriers + 8 * kLast);
      }
    }

    // Extremes over the tile's valid rows (the same in every lane): masks can be
    // skipped for a step that every row sees whole. Rows past the end are left
    // unmasked then: they only ever feed outputs that are never written.
    int min_row_position = 0x7fffffff, max_row_position = -1;
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
          slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          stage_rows(p, smem, next % STAGES, head0, next_base, key_lo, key_hi, block_shift, window);
          cp_async_arrive_noinc(barriers + 8 * (next % STAGES));
        }
      } else if constexpr (KVC_STAGING == KVC_STAGE_BULK) {
        if (warp == 0 && next < num_tiles) {
          // Its stage last held tile - 1: wait until every warp is done with that.
          if (next >= STAGES) {
            mbarrier_wait(barriers + 8 * (STAGES + next % STAGES), (next / STAGES - 1) & 1);
            fence_proxy_async();   // those reads (generic proxy) before the copies' writes (async proxy)
          }
          slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          stage_pages(p, smem, next % STAGES, head0, next_base, block_shift, window);
        }
        mbarrier_wait(barriers + 8 * (tile % STAGES), (tile / STAGES) & 1);
      } else {
        cp_async_wait<STAGES - 2>();
        // Everyone is done with the stage the next copy overwrites (tile - 1's).
        __syncthreads();
        if (next < num_tiles) {
          slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          stage_tile(p, smem, next % STAGES, head0, next_base, key_lo, key_hi, block_shift, window);
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
            load_lane_vector<kKeyVecBytes, 4>(row, t, vector, words[0]);
            load_lane_vector<kKeyVecBytes, 4>(row + 8 * T::kKeyStride, t, vector, words[1]);
  #pragma unroll
            for (int kc = 0; kc < KC; ++kc) {
              if (key_word_of(kc) / T::kKeyVector != vector) continue;
              u32 a[4];
              key_fragment(words[0], kc, a[0], a[2]);
              key_fragment(words[1], kc, a[1], a[3]);
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
            key_scale[j][i] = kQuantized ? scale_of(key_bits) * kCodeUnit : 1.f;
            key_zero_point[j][i] = zero_point_of(key_bits);
            value_scale[j][i] = kQuantized ? scale_of(value_bits) * kCodeUnit : 1.f;
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
              weighted_high[j][quad][i] = unpack(pack(w, 0.f)).x;
              weighted_low[j][quad][i] = unpack(pack(w - weighted_high[j][quad][i], 0.f)).x;
            }
          }
          running_sum[quad] = running_sum[quad] * alpha[quad] + sum;
        }
        // Rescale the accumulators, unless no row's max and not R moved (the common
        // case once a few tiles are in). Column 2t + j is this lane's row of quad 2 np + j.
        if (!__all_sync(0xffffffffu, unchanged)) {
  #pragma unroll
          for (int np = 0; np < NP; ++np) {
            const float f0 = alpha[2 * np] * rescale_values;
            const int second = kLowSlot && np == NP - 1 ? 2 * np : min(2 * np + 1, QUADS - 1);
            const float f1 = alpha[second] * rescale_values;
  #pragma unroll
            for (int md = 0; md < MD; ++md) {
              out[md][np][0] *= f0;
              out[md][np][1] *= f1;
              out[md][np][2] *= f0;
              out[md][np][3] *= f1;
            }
          }
        }
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
              pb[np][0][i] = transpose8x8(pack(w0, w1));
              if constexpr (kBf16 && !kLowSlot)
                pb[np][1][i] = transpose8x8(pack(weighted_low[j][2 * np][i], weighted_low[j][second][i]));
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
            offset_pairs(scale_words[0], scale_words[HEADS], centre[0], centre[1]);
            offset_pairs(scale_words[8 * HEADS], scale_words[9 * HEADS], centre[2], centre[3]);
          }
  #pragma unroll
          for (int vector = 0; vector < kValueLoads; ++vector) {
  #pragma unroll
            for (int c = 0; c < 4; ++c)
              load_value_vector(values + ((first_step + j) * 16 + 2 * t + (c & 1) + 8 * (c >> 1)) * T::kValueStride,
                                g, vector, words[c]);
  #pragma unroll
            for (int md = 0; md < MD; ++md) {
              if (value_load_of(md) != vector) continue;
              u32 a[4];
              value_fragment(rows, md, a);
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
          slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          stage_rows(p, smem, next % STAGES, head0, next_base, key_lo, key_hi, block_shift, window);
          cp_async_arrive_noinc(barriers + 8 * (next % STAGES));
        }
      }
    }
    cp_async_wait<0>();

    // Partial state of this split: max and sum per row (lanes g == 0), and the
    // accumulators times R in the cache's channel order.
    const long long split_rows = static_cast<long long>(split) * p.num_tokens;
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad) {
      const int row = row_begin + quad * 4 + t;
      const float sum = sum_over_columns(running_sum[quad]);
      // Columns 2t (+ 2t + 1 for the low halves) of tile quad / 2 hold this row.
      const int np = quad / 2, j = quad % 2;
      const bool with_low = kLowSlot && np == NP - 1;
      if (!row_valid[quad]) continue;
      const long long index = part_index(p, split_rows, q_begin, row, kv_head);
      if (g == 0) store_part_stats(p, index, running_max[quad], sum);
      float* destination = p.part_out + index * p.head_size;
#pragma unroll
      for (int md = 0; md < MD; ++md) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int channel = value_dim_of(16 * md + g + 8 * r);
          const float unit = r ? reference / kHighNibble : reference;
          const float accumulated = with_low ? out[md][np][2 * r] + out[md][np][2 * r + 1] : out[md][np][2 * r + j];
          if (channel < p.head_size) destination[channel] = accumulated * unit;
        }
      }
    }
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
