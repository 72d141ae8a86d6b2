// How the decode kernel's tiles reach shared memory: the window of page ids
// read ahead from the block table, and the three ways of copying a tile into
// a stage (KVC_STAGING: cp.async pieces, bulk copies of pages, cp.async rows
// under mbarriers). Attention::run orders them (its pipeline of STAGES stages).
// Included by attention.cuh.
#pragma once

#include "decode_traits.cuh"
#include "params.cuh"
#include "ptx.cuh"

namespace kvc_attn {

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

// --- the window of page ids ----------------------------------------------------

// The physical blocks of the pages of the keys [lo, hi), read from the block
// table 32 pages at a time and one window ahead: lane l holds page base + l
// (current) and base + 32 + l (next), -1 for a page outside [lo, hi) or an
// id outside the cache. A tile's copies then never wait on the block table:
// under full load a table read queues behind the page traffic, and with one
// tile of lead the copies would stall on it. (The prefill kernel keeps its
// pages the same way, through Attention, which derives from this.)
struct PageTable {
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
};

// --- a decode block's tiles ------------------------------------------------------

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeStaging : PageTable {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  static constexpr bool kQuantized = T::kQuantized;
  static constexpr int kWorkPerThread = (TILE * HEADS * (T::kRowBytes / (CHUNK == 1 ? 4 : CHUNK)) +
                                         T::kThreads - 1) / T::kThreads;

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

  // Row staging, copies after the tile, 64-token tiles (int4 decode's, which
  // the planner takes for long splits: Tuning.long_tile_min_split_tokens): the
  // last stage is free once the query rows are read, so tile STAGES - 1 goes
  // out before tile 0's math (early_last), not after it. Shorter tiles keep
  // the copies after tile 0: their splits are too short to gain by it, and a
  // compile-time choice spares the long splits a run-time test of the split's length.
  static constexpr bool kEarlyLast = KVC_STAGING == KVC_STAGE_ROWS && !KVC_ROWS_BEFORE && TILE >= 64;

  // The pipeline's prologue: the stages' barriers (mbarrier staging) and the
  // copies of tiles 0 .. STAGES - 2.
  static __device__ __forceinline__ void prologue(const Params& p, u8* smem, PageWindow& window, const int* table,
                                                  int head0, int key_lo, int key_hi, int num_tiles, int block_shift) {
    u8* const barriers = smem + T::kBarrierOffset;   // full[STAGES], then empty[STAGES]
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
      if (threadIdx.x < 32) {   // warp 0
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
  }

  // Row staging of 64-token tiles: tile STAGES - 1's copies, once every warp
  // is done with its query rows in that stage.
  static __device__ __forceinline__ void early_last(const Params& p, u8* smem, PageWindow& window, const int* table,
                                                    int head0, int key_lo, int key_hi, int num_tiles,
                                                    int block_shift) {
    u8* const barriers = smem + T::kBarrierOffset;
    if constexpr (kEarlyLast) {
      constexpr int kLast = STAGES - 1;
      if (kLast < num_tiles) {
        slide_window(window, p, table, (key_lo + kLast * TILE) >> block_shift, key_lo, key_hi, block_shift);
        stage_rows(p, smem, kLast, head0, key_lo + kLast * TILE, key_lo, key_hi, block_shift, window);
        cp_async_arrive_noinc(barriers + 8 * kLast);
      }
    }
  }

  // Before tile `tile`'s math: wait until its copies have landed, and issue
  // tile + STAGES - 1's where they go out before the math.
  static __device__ __forceinline__ void before_tile(const Params& p, u8* smem, PageWindow& window,
                                                     const int* table, int head0, int tile, int key_lo, int key_hi,
                                                     int num_tiles, int block_shift) {
    u8* const barriers = smem + T::kBarrierOffset;
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
      if (threadIdx.x < 32 && next < num_tiles) {
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
  }

  // After tile `tile`'s math: this thread is done with its stage, and row
  // staging issues tile + STAGES - 1's copies.
  static __device__ __forceinline__ void after_tile(const Params& p, u8* smem, PageWindow& window,
                                                    const int* table, int head0, int tile, int key_lo, int key_hi,
                                                    int num_tiles, int block_shift) {
    u8* const barriers = smem + T::kBarrierOffset;
    const int next = tile + STAGES - 1;
    const int next_base = key_lo + next * TILE;
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

  // Row staging: each warp copies its share of tile t + STAGES - 1 after
  // computing tile t (of 64-token tiles, tile STAGES - 1 before the loop,
  // where its stage frees) rather than before, into the stage of tile t - 1,
  // which by then the other warps have most likely left too (issued before t,
  // every warp would wait there for the slowest). With two stages that would
  // leave no copy in flight: the launcher takes bulk copies there, or issues
  // them before the tile (KVC_ROWS_BEFORE: two blocks a multiprocessor, d = 96).
  static_assert(KVC_STAGING != KVC_STAGE_ROWS || STAGES >= 3 || KVC_ROWS_BEFORE, "row staging: three stages or more");

};

}  // namespace kvc_attn
