// Paged attention over a quantized (or plain) KV cache, on tensor cores.
//
// One thread block serves one (sequence, query row tile, KV-head group, split of
// the keys); one warp serves one KV head. A cache row holds every KV head of a
// token side by side, so the block stages a tile of tokens for all its heads as
// contiguous bytes (cp.async, or a bulk copy per page on sm_90; STAGES deep) and
// each warp reads its head's rows from shared memory.
//
// The warp computes with mma.sync m16n8k16 (fp16, or bf16 for bf16 caches,
// fp32 accumulators):
//   scores  S[row, token] = Q[row, :] . K[token, :]       M = query rows, N = tokens
//   output  O^T[dim, row] += V^T[dim, token] . P^T[token, row]   M = dims, N = rows
// Rows are (query token, query head of the KV head's group) pairs, 8 per M tile;
// the other 8 rows of each M tile carry the low half of a two-term split of the
// query (q = hi + lo, both fp16), so that scores keep ~22 bits of the query
// instead of fp16's 11 at no extra instruction: S = C[row] + C[row + 8].
// The score fragments of the first product are, per thread, exactly the P
// fragments the second one needs (FlashAttention-2's register reuse).
//
// Cache codes enter the products exactly: int4 nibbles and int8 codes are
// small integers, fp8 e4m3 is a subset of fp16 times 2^-8, and the int4
// zero-point is subtracted while converting (code - zp is an exact fp16
// integer). Scales apply in fp32 on the score side (K) and on the
// probability side (V). For V the probabilities are multiplied by
// scale / R, R the largest V scale seen so far by this warp (a running
// reference, rescaled like the softmax maximum), so that the fp16 operand
// stays in [0, 1] whatever the scales.
//
// A head-dimension permutation is free where Q and K share it, so each
// format's bytes are read in the order that drops them straight into the
// fragment registers; the output is written back in the cache's (rotated)
// channel order. key_dim_of / value_dim_of spell out those permutations.
#pragma once

#include "types.cuh"

// Staging by the bulk-copy engine (sm_90): where a page holds the block's KV
// heads as one contiguous run of bytes (all of the cache's heads in one
// block), warp 0 alone copies each page's part of a tile with one
// cp.async.bulk per tensor (K, V and their scales), completing on a "full"
// mbarrier per stage; every thread arrives on the stage's "empty" mbarrier when
// done with it, and warp 0 waits for that before refilling it. The other warps
// never wait for each other. Tokens are stored unpadded there (the page's own
// layout): some shared-memory bank conflicts, traded for a handful of copy
// instructions a tile. The launcher chooses it (quantized caches only: a stale
// row outside the keys is then always finite codes).
#ifndef KVC_BULK
#define KVC_BULK 0
#endif

// Diagnostics only (the launcher never sets it): stage every tile and skip the
// math, to time the copy pipeline alone. Outputs are meaningless.
#ifndef KVC_STAGING_ONLY
#define KVC_STAGING_ONLY 0
#endif

namespace kvc_attn {

using kvc::u16;
using kvc::u32;
using kvc::u8;
using kvc::pack_bf162;
using kvc::pack_half2;
using kvc::unpack_bf162;
using kvc::unpack_half2;

enum { KV_INT4 = 0, KV_INT8 = 1, KV_FP8 = 2, KV_F16 = 3, KV_BF16 = 4 };

// --- compile-time shape ----------------------------------------------------

template <int KV, int HEAD_PAD, int HEADS, int M_TILES, int TILE, int STAGES, int CHUNK>
struct Traits {
  static_assert(HEAD_PAD % 32 == 0 && HEAD_PAD >= 32 && HEAD_PAD <= 256, "head size class");
  static_assert(TILE % 16 == 0, "tiles are whole 16-token mma steps");
  static_assert(CHUNK == 1 || CHUNK == 4 || CHUNK == 8 || CHUNK == 16, "copy granule");
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
  // kValueVector units (vector i of lane g at unit (8 i + g) kValueVector).
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
  static constexpr int kKeyStride = KVC_BULK ? kHeadsBytes : padded(kHeadsBytes, 16 * kKeyVector);
  static constexpr int kValueStride = KVC_BULK ? kHeadsBytes : padded(kHeadsBytes, 16);
  static constexpr int kKeyBytes = TILE * kKeyStride;
  static constexpr int kValueBytes = TILE * kValueStride;
  static constexpr int kScaleBytes = TILE * HEADS * 4;
  static constexpr int kStageBytes = kKeyBytes + kValueBytes + 2 * kScaleBytes;
  // Bulk staging: STAGES "full" then STAGES "empty" mbarriers after the stages.
  static constexpr int kBarrierOffset = STAGES * kStageBytes;
  static constexpr int kSharedBytes = kBarrierOffset + (KVC_BULK ? 16 * STAGES : 0);
  static_assert(KVC_BULK || (kKeyStride % (32 * kKeyVector) == 16 * kKeyVector && kValueStride % 32 == 16),
                "strides");
  static_assert(!KVC_BULK || (kHeadsBytes % 16 == 0 && HEADS % 4 == 0), "bulk copies: 16-byte rows");
};

struct Params {
  const float* query;        // [T, Hq, d] rotated, scaled; cache channel order
  const u8* key_cache;       // element strides below are in bytes for the data
  const u8* value_cache;
  const u8* k_scales;        // float32 words
  const u8* v_scales;
  long long k_block_stride, k_slot_stride, k_head_stride;       // bytes
  long long v_block_stride, v_slot_stride, v_head_stride;
  long long ks_block_stride, ks_slot_stride, ks_head_stride;    // bytes
  long long vs_block_stride, vs_slot_stride, vs_head_stride;
  const int* block_table;    // [S, table_width]
  const int* seq_lens;       // [S]
  const int* cu_seqlens_q;   // [S + 1]
  const int* tiles;          // [num_tiles, 2]: (sequence, row tile)
  float* part_out;           // [splits, T, Hq, d]: unnormalised outputs
  float* part_stats;         // [splits, T, Hq, 2]: (running max, sum of exp)
  int num_tokens;            // T
  int num_heads;             // Hq
  int group;                 // Hq / Hk
  int head_size;             // d
  int row_bytes;             // stored bytes of one head row at d
  int block_size;
  int num_blocks;
  int table_width;
  int split_tokens;          // keys per split (a multiple of TILE)
  int window;                // sliding window, 0: none
  float softcap;             // 0: none
  float code_unit;           // fp8: 2^8, since codes enter as e4m3 * 2^-8; else 1
};

// --- small helpers ---------------------------------------------------------

__device__ __forceinline__ u32 lop_and_or(u32 x, u32 mask, u32 bits) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));  // (x & m) | b
  return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}


template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void cp_async(void* shared, const void* global, int bytes_valid, int size) {
  u32 address = static_cast<u32>(__cvta_generic_to_shared(shared));
  if (size == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(bytes_valid));
  } else if (size == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(address), "l"(global), "r"(bytes_valid));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(global), "r"(bytes_valid));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// mbarrier and bulk copies (sm_90): a stage's barrier completes when every
// thread has arrived and the bytes each announced have landed. Older archs
// compile them to traps: the launcher never picks bulk staging there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVC_SM90(statement) __trap()
#else
#define KVC_SM90(statement) statement
#endif

__device__ __forceinline__ u32 shared_address(const void* pointer) {
  return static_cast<u32>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void mbarrier_init(void* barrier, int count) {
  KVC_SM90(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(count)
                        : "memory"));
}

__device__ __forceinline__ void mbarrier_arrive_expect(void* barrier, u32 bytes) {
  KVC_SM90(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                        ::"r"(shared_address(barrier)), "r"(bytes) : "memory"));
}

__device__ __forceinline__ void mbarrier_arrive(void* barrier) {
  KVC_SM90(asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory"));
}

__device__ __forceinline__ void mbarrier_wait(void* barrier, u32 parity) {
  u32 done = 0;
  while (!done) {
    KVC_SM90(asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                          " selp.u32 %0, 1, 0, p;\n}\n"
                          : "=r"(done) : "r"(shared_address(barrier)), "r"(parity) : "memory"));
  }
}

// Orders shared-memory accesses this thread has seen (generic proxy) before its
// later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  KVC_SM90(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
}

__device__ __forceinline__ void bulk_copy(void* shared, const void* global, u32 bytes, void* barrier) {
  KVC_SM90(asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                        ::"r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(shared_address(barrier))
                        : "memory"));
}

// 2^x to ~2 ulp (MUFU.EX2); exact 0 for -inf, NaN for NaN.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float max_over_quad(float x) {   // the 4 lanes of one groupID
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float sum_over_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

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

}  // namespace kvc_attn

namespace kvc_attn {

// --- the block ---------------------------------------------------------------

template <int KV, int HEAD_PAD, int HEADS, int M_TILES, int TILE, int STAGES, int CHUNK>
struct Attention {
  typedef Traits<KV, HEAD_PAD, HEADS, M_TILES, TILE, STAGES, CHUNK> T;
  static constexpr int KC = T::kKChunks;
  static constexpr int MD = T::kDimTiles;
  static constexpr bool kQuantized = KV == KV_INT4 || KV == KV_INT8 || KV == KV_FP8;
  static constexpr bool kBf16 = T::kBf16;
  static constexpr float kLog2e = 1.4426950408889634f;

  // Code offsets: conversions leave OFFSET + code in fp16 (int4: the nibble
  // under 0x6400 = 1024; int8: the biased byte under 0x6400 = 1024 + 128), exact;
  // the products subtract OFFSET (and the zero-point) once per score and once
  // per output row instead of once per value. fp8 and plain caches have none.
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
  // tile of lead that wait cost a quarter of the bandwidth (H200, ncu).
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
      u8* key_dst = keys + token * T::kKeyStride + head * T::kRowBytes + offset;
      u8* value_dst = values + token * T::kValueStride + head * T::kRowBytes + offset;
      const u8* key_src = p.key_cache + block * p.k_block_stride + slot * p.k_slot_stride +
                          (head0 + head) * p.k_head_stride + offset;
      const u8* value_src = p.value_cache + block * p.v_block_stride + slot * p.v_slot_stride +
                            (head0 + head) * p.v_head_stride + offset;
      if constexpr (CHUNK == 1) {
        // Rows whose length is no multiple of 4 bytes: plain byte loads.
        for (int b = 0; b < 4; ++b) {
          const bool ok = valid_token && offset + b < p.row_bytes;
          key_dst[b] = ok ? key_src[b] : u8(0);
          value_dst[b] = ok ? value_src[b] : u8(0);
        }
      } else {
        const int bytes = valid_token && offset < p.row_bytes ? CHUNK : 0;
        cp_async(key_dst, bytes ? key_src : p.key_cache, bytes, CHUNK);
        cp_async(value_dst, bytes ? value_src : p.value_cache, bytes, CHUNK);
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
        const u8* key_src = p.k_scales + block * p.ks_block_stride + slot * p.ks_slot_stride +
                            (head0 + head) * p.ks_head_stride;
        const u8* value_src = p.v_scales + block * p.vs_block_stride + slot * p.vs_slot_stride +
                              (head0 + head) * p.vs_head_stride;
        cp_async(key_scales + 4 * c, valid_token ? key_src : p.k_scales, valid_token ? 4 : 0, 4);
        cp_async(value_scales + 4 * c, valid_token ? value_src : p.v_scales, valid_token ? 4 : 0, 4);
      }
    }
  }

  // Bulk staging (KVC_BULK), by warp 0: lane 4 r + kind copies page run r of
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

  // OFFSET + zero-point (x16 for high nibbles) of two tokens as an fp16 pair.
  static __device__ __forceinline__ u32 offset_pair(u32 bits_a, u32 bits_b, bool high) {
    if constexpr (KV == KV_INT4) {
      const int shift = high ? 4 : 0;
      return (0x6400u | ((bits_a & 0xFu) << shift)) | ((0x6400u | ((bits_b & 0xFu) << shift)) << 16);
    }
    return kOffsetHalf | (kOffsetHalf << 16);
  }

  // Channel permutations: key_dim_of / value_dim_of map a logical dim of the
  // products to the cache's channel (the stored value's index in the row).
  static constexpr int kKeyVecBytes = 4 * T::kKeyVector;
  static constexpr int kValueVecBytes = 2 * T::kValueVector;

  // Keys: lane t's word w becomes fp16 pairs that are the B fragment's {b0, b1}
  // (logical dims 16 kc + 2t + {0, 1}) and {b2, b3} (16 kc + 8 + 2t + {0, 1}).
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
      return 2 * lane_byte_offset<kValueVecBytes, 8>(g, md) + r;
    } else if constexpr (KV == KV_INT8 || KV == KV_FP8) {
      return lane_byte_offset<kValueVecBytes, 8>(g, 2 * md + r);
    } else {
      return lane_byte_offset<kValueVecBytes, 8>(g, 2 * (2 * md + r)) / 2;
    }
  }

  // The B fragment {b0b1, b2b3} of k step kc from lane t's words of one token's key row.
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

  static __device__ void run(const Params& p, int block_shift) {
    extern __shared__ __align__(16) u8 smem[];
    // One softmax step takes 16 tokens: 2 n tiles of the score product, 1 k step
    // of the output product (a 32-token step needs ~90 more registers: spills).
    constexpr int NT = 2;
    constexpr int KS = 1;
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
    constexpr int ROWS = 8 * M_TILES;
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

    // Query fragments: rows 0-7 of each M tile the high fp16 part, rows 8-15 the low;
    // offset_weight, zero_point_weight: what the products' code offsets add to a
    // score, per unit of OFFSET and of zero-point (sums of the row as the products
    // see it, hi + lo, with high int4 nibbles' dims counted 16 times for the codes).
    u32 qa[M_TILES][KC][4];
    float row_unscale[M_TILES], offset_weight[M_TILES], zero_point_weight[M_TILES];
    int row_position[M_TILES];
    bool row_valid[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      const int row = row_begin + mt * 8 + g;
      row_valid[mt] = row < total_rows;
      const int token = row / p.group;
      row_position[mt] = context + token;
      const float* q = p.query + (static_cast<long long>(q_begin + token) * p.num_heads +
                                  kv_head * p.group + row % p.group) * p.head_size;
      float values[KC][4];
      float largest = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int logical = 16 * kc + 2 * t + (i & 1) + 8 * (i >> 1);
          const int channel = key_dim_of(logical);
          values[kc][i] = row_valid[mt] && channel < p.head_size ? q[channel] : 0.f;
          largest = fmaxf(largest, fabsf(values[kc][i]));
        }
      }
      largest = max_over_quad(largest);
      // A power of two keeps the largest |q| near 2^14: inside fp16's range, and exact.
      int exponent = 0;
      frexpf(largest, &exponent);
      const float up = largest > 0.f && isfinite(largest) ? ldexpf(1.f, 14 - exponent) : 1.f;
      row_unscale[mt] = 1.f / up;
      float sum = 0.f, code_sum = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        float hi[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float high = i >= 2 ? kHighNibble : 1.f;   // dims 16 kc + 8.. (exact: a power of two)
          const float v = values[kc][i] * up / high;
          hi[i] = unpack(pack(v, 0.f)).x;
          lo[i] = unpack(pack(v - hi[i], 0.f)).x;
          sum += hi[i] + lo[i];
          code_sum += (hi[i] + lo[i]) * high;
        }
        qa[mt][kc][0] = pack(hi[0], hi[1]);
        qa[mt][kc][1] = pack(lo[0], lo[1]);
        qa[mt][kc][2] = pack(hi[2], hi[3]);
        qa[mt][kc][3] = pack(lo[2], lo[3]);
      }
      offset_weight[mt] = kOffsetValue * sum_over_quad(sum);
      zero_point_weight[mt] = sum_over_quad(code_sum);
    }

    // Extremes over the tile's valid rows (the same in every warp): masks can be
    // skipped for a step that every row sees whole. Rows past the end are left
    // unmasked then: they only ever feed outputs that are never written.
    int min_row_position = 0x7fffffff, max_row_position = -1;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      if (row_valid[mt]) {
        min_row_position = min(min_row_position, row_position[mt]);
        max_row_position = max(max_row_position, row_position[mt]);
      }
    }
    for (int offset = 16; offset >= 1; offset /= 2) {
      min_row_position = min(min_row_position, __shfl_xor_sync(0xffffffffu, min_row_position, offset));
      max_row_position = max(max_row_position, __shfl_xor_sync(0xffffffffu, max_row_position, offset));
    }

    float out[MD][M_TILES][4];
    // sum_j p'_j (OFFSET + zp_j) per row in out's layout for dim row 0, and (OFFSET + 16 zp_j) for dim row 8.
    float offset_sum[M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) offset_sum[mt][i] = 0.f;
#pragma unroll
      for (int md = 0; md < MD; ++md)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[md][mt][i] = 0.f;
    }
    float running_max[M_TILES], running_sum[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      running_max[mt] = -KVC_INFINITY;
      running_sum[mt] = 0.f;
    }
    float reference = kQuantized ? 0.f : 1.f;   // R: the V scale the accumulators are in

    const int num_tiles = key_hi > key_lo ? (key_hi - key_lo + TILE - 1) / TILE : 0;
    u8* const barriers = smem + T::kBarrierOffset;   // bulk staging: full[STAGES], then empty[STAGES]
    // Warp 0 stages the tiles under bulk copies, every warp otherwise: those keep the window.
    PageWindow window{};
    if (!KVC_BULK || warp == 0) window = first_window(p, table, key_lo, key_hi, block_shift);
    if constexpr (KVC_BULK) {
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
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int next = tile + STAGES - 1;   // the tile whose copies go out now
      const int next_base = key_lo + next * TILE;
      if constexpr (KVC_BULK) {
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

#pragma unroll 1
      for (int step = 0; step < (KVC_STAGING_ONLY ? 0 : TILE / 16); ++step) {
        // Scores of tokens nt*8 + 2t + {0, 1}, rows g (high + low parts).
        float score[M_TILES][NT][4];
  #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
  #pragma unroll
          for (int nt = 0; nt < NT; ++nt)
  #pragma unroll
            for (int i = 0; i < 4; ++i) score[mt][nt][i] = 0.f;
  #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const u8* row = keys + (step * 16 + nt * 8 + g) * T::kKeyStride;
          u32 words[T::kKeyWords];
  #pragma unroll
          for (int vector = 0; vector < T::kKeyWords / T::kKeyVector; ++vector) {
            load_lane_vector<kKeyVecBytes, 4>(row, t, vector, words);
  #pragma unroll
            for (int kc = 0; kc < KC; ++kc) {
              if (key_word_of(kc) / T::kKeyVector != vector) continue;
              u32 b0, b1;
              key_fragment(words, kc, b0, b1);
  #pragma unroll
              for (int mt = 0; mt < M_TILES; ++mt) mma<kBf16>(score[mt][nt], qa[mt][kc], b0, b1);
            }
          }
        }
        // This thread's column tokens: nt*8 + 2t + {0, 1}, i = 2 nt + {0, 1}.
        float key_scale[2 * NT], value_scale[2 * NT], key_zero_point[2 * NT];
        u32 value_bits[2 * NT];
  #pragma unroll
        for (int i = 0; i < 2 * NT; ++i) {
          const int column = step * 16 + (i >> 1) * 8 + 2 * t + (i & 1);
          const u32 key_bits = kQuantized ? key_scales[column * HEADS] : 0u;
          key_scale[i] = kQuantized ? scale_of(key_bits) * kCodeUnit : 1.f;
          key_zero_point[i] = zero_point_of(key_bits);
          value_bits[i] = kQuantized ? value_scales[column * HEADS] : 0u;
          value_scale[i] = kQuantized ? scale_of(value_bits[i]) * kCodeUnit : 1.f;
          // A row past the keys holds stale bytes under bulk staging: its scale
          // must not set R (its probability is 0 anyway).
          if (KVC_BULK && base + column >= key_hi) value_scale[i] = 0.f;
        }
        float tile_reference = reference;
        if constexpr (kQuantized) {
          float largest = value_scale[0];
  #pragma unroll
          for (int i = 1; i < 2 * NT; ++i) largest = fmaxf(largest, value_scale[i]);
          tile_reference = fmaxf(reference, max_over_quad(largest));
        }
        // Approximate division suffices: these only choose the units of the
        // accumulators, and `unchanged` compares the references themselves.
        bool unchanged = tile_reference == reference;
        const float rescale_values =
            unchanged ? 1.f : tile_reference > 0.f ? __fdividef(reference, tile_reference) : 0.f;
        const float to_reference = tile_reference > 0.f ? __fdividef(1.f, tile_reference) : 1.f;
        reference = tile_reference;

        u32 pb[M_TILES][KS][2][2];   // P^T fragments per k step (and their low parts for bf16 caches)
        float alpha[M_TILES];
  #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          float s[2 * NT];
          float tile_max = -KVC_INFINITY;
          // Every row sees every token of this step (the usual decode step): no masks.
          const int step_first = base + step * 16;
          const bool all_visible = step_first + 16 <= key_hi && step_first + 15 <= min_row_position &&
                                   (p.window == 0 || step_first > max_row_position - p.window);
  #pragma unroll
          for (int i = 0; i < 2 * NT; ++i) {
            const int nt = i >> 1, c = i & 1;
            float raw = score[mt][nt][c] + score[mt][nt][c + 2];
            if constexpr (KV == KV_INT4) raw -= fmaf(key_zero_point[i], zero_point_weight[mt], offset_weight[mt]);
            else if constexpr (kOffset) raw -= offset_weight[mt];
            float v = raw * row_unscale[mt] * key_scale[i];
            if (p.softcap > 0.f) v = p.softcap * tanhf(v / p.softcap);
            s[i] = v;
          }
          if (!all_visible) {   // uniform across the warp: a branch, not selects on every score
  #pragma unroll
            for (int i = 0; i < 2 * NT; ++i) {
              const int position = step_first + (i >> 1) * 8 + 2 * t + (i & 1);
              const bool visible = row_valid[mt] && position < key_hi && position <= row_position[mt] &&
                                   (p.window == 0 || position > row_position[mt] - p.window);
              if (!visible) s[i] = -KVC_INFINITY;
            }
          }
  #pragma unroll
          for (int i = 0; i < 2 * NT; ++i) tile_max = fmaxf(tile_max, s[i]);
          tile_max = max_over_quad(tile_max);
          const float new_max = fmaxf(running_max[mt], tile_max);
          const float shift = new_max == -KVC_INFINITY ? 0.f : new_max;
          alpha[mt] = new_max == running_max[mt] ? 1.f : fast_exp2((running_max[mt] - shift) * kLog2e);
          unchanged = unchanged && alpha[mt] == 1.f;
          running_max[mt] = new_max;
          float weighted[2 * NT], sum = 0.f;
  #pragma unroll
          for (int i = 0; i < 2 * NT; ++i) {
            const float prob = fast_exp2((s[i] - shift) * kLog2e);
            sum += prob;
            // A token no row here sees adds nothing, even with a NaN scale.
            weighted[i] = prob == 0.f ? 0.f : prob * (kQuantized ? value_scale[i] * to_reference : 1.f);
          }
          running_sum[mt] = running_sum[mt] * alpha[mt] + sum;
  #pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
            pb[mt][ks][0][0] = pack(weighted[4 * ks + 0], weighted[4 * ks + 1]);
            pb[mt][ks][0][1] = pack(weighted[4 * ks + 2], weighted[4 * ks + 3]);
            if constexpr (kBf16) {
              const float2 h01 = unpack(pb[mt][ks][0][0]), h23 = unpack(pb[mt][ks][0][1]);
              pb[mt][ks][1][0] = pack(weighted[4 * ks + 0] - h01.x, weighted[4 * ks + 1] - h01.y);
              pb[mt][ks][1][1] = pack(weighted[4 * ks + 2] - h23.x, weighted[4 * ks + 3] - h23.y);
            }
          }
        }
        // Rescale the accumulators, unless no row's max and not R moved (the common
        // case once a few tiles are in). Their columns are rows 2t, 2t+1, whose
        // factors live in the lanes with groupID 2t and 2t+1.
        if (!__all_sync(0xffffffffu, unchanged)) {
  #pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            const float f0 = __shfl_sync(0xffffffffu, alpha[mt], (2 * t) * 4) * rescale_values;
            const float f1 = __shfl_sync(0xffffffffu, alpha[mt], (2 * t + 1) * 4) * rescale_values;
  #pragma unroll
            for (int md = 0; md < MD; ++md) {
              out[md][mt][0] *= f0;
              out[md][mt][1] *= f1;
              out[md][mt][2] *= f0;
              out[md][mt][3] *= f1;
            }
            offset_sum[mt][0] *= f0;
            offset_sum[mt][1] *= f1;
            offset_sum[mt][2] *= f0;
            offset_sum[mt][3] *= f1;
          }
        }
  #pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const int first = step * 16 + ks * 16;
          // Lane g's share of the value rows of tokens 2t, 2t+1, 2t+8, 2t+9, a vector
          // of units at a time, each used by the M tiles it holds.
          u32 words[4][(T::kValueUnits + 1) / 2];
          const u32* const rows[4] = {words[0], words[1], words[2], words[3]};
  #pragma unroll
          for (int vector = 0; vector < T::kValueUnits / T::kValueVector; ++vector) {
  #pragma unroll
            for (int c = 0; c < 4; ++c)
              load_lane_vector<kValueVecBytes, 8>(values + (first + 2 * t + (c & 1) + 8 * (c >> 1)) * T::kValueStride,
                                                  g, vector, words[c]);
  #pragma unroll
            for (int md = 0; md < MD; ++md) {
              if (value_unit_of(md) / T::kValueVector != vector) continue;
              u32 a[4];
              value_fragment(rows, md, a);
  #pragma unroll
              for (int mt = 0; mt < M_TILES; ++mt) {
                mma<kBf16>(out[md][mt], a, pb[mt][ks][0][0], pb[mt][ks][0][1]);
                if constexpr (kBf16) mma<kBf16>(out[md][mt], a, pb[mt][ks][1][0], pb[mt][ks][1][1]);
              }
            }
          }
          if constexpr (kOffset) {
            // One more product whose A has two rows, OFFSET + zp of each token for
            // low-nibble dims (row 0) and OFFSET + 16 zp for high ones (row 8): it
            // sums what the offsets added to every output channel, exactly.
            u32 a[4] = {0u, 0u, 0u, 0u};
            if (g == 0) {
              a[0] = offset_pair(value_bits[4 * ks + 0], value_bits[4 * ks + 1], false);
              a[1] = offset_pair(value_bits[4 * ks + 0], value_bits[4 * ks + 1], true);
              a[2] = offset_pair(value_bits[4 * ks + 2], value_bits[4 * ks + 3], false);
              a[3] = offset_pair(value_bits[4 * ks + 2], value_bits[4 * ks + 3], true);
            }
  #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) mma<kBf16>(offset_sum[mt], a, pb[mt][ks][0][0], pb[mt][ks][0][1]);
          }
        }
      }
      if constexpr (KVC_BULK) mbarrier_arrive(barriers + 8 * (STAGES + tile % STAGES));   // done with the stage
    }
    cp_async_wait<0>();

    // Partial state of this split: max and sum per row (lanes t == 0), and the
    // accumulators times R in the cache's channel order.
    const long long split_rows = static_cast<long long>(split) * p.num_tokens;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      const float sum = sum_over_quad(running_sum[mt]);
      const int row = row_begin + mt * 8 + g;
      if (t == 0 && row_valid[mt]) {
        const long long index =
            (split_rows + q_begin + row / p.group) * p.num_heads + kv_head * p.group + row % p.group;
        p.part_stats[2 * index] = running_max[mt];
        p.part_stats[2 * index + 1] = sum;
      }
      // The offsets' sums for rows 2t, 2t+1 sit in lane t (groupID 0): [c] for
      // output rows g, [c + 2] for rows g + 8.
      float offsets[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) offsets[i] = kOffset ? __shfl_sync(0xffffffffu, offset_sum[mt][i], t) : 0.f;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int out_row = row_begin + mt * 8 + 2 * t + c;
        if (out_row >= total_rows) continue;
        const long long index = (split_rows + q_begin + out_row / p.group) * p.num_heads +
                                kv_head * p.group + out_row % p.group;
        float* destination = p.part_out + index * p.head_size;
#pragma unroll
        for (int md = 0; md < MD; ++md) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int channel = value_dim_of(16 * md + g + 8 * r);
            const float unit = r ? reference / kHighNibble : reference;
            if (channel < p.head_size) destination[channel] = (out[md][mt][c + 2 * r] - offsets[c + 2 * r]) * unit;
          }
        }
      }
    }
  }
};

// Combine the splits' partial states of every (query token, head) row:
// out = sum_s o_s e^{m_s - M} / (sum_s l_s e^{m_s - M} + e^{sink - M}).
template <typename OUT>
__device__ void merge_splits(const float* part_out, const float* part_stats, const float* sinks, OUT* out,
                             int num_splits, int num_tokens, int num_heads, int head_size) {
  const int row = blockIdx.x;
  const int head = row % num_heads;
  const long long rows = static_cast<long long>(num_tokens) * num_heads;
  float peak = -KVC_INFINITY;
  for (int s = 0; s < num_splits; ++s) peak = fmaxf(peak, part_stats[2 * (s * rows + row)]);
  const bool has_sink = sinks != nullptr;
  if (has_sink) peak = fmaxf(peak, sinks[head]);
  const float shift = peak == -KVC_INFINITY ? 0.f : peak;
  float total = has_sink ? expf(sinks[head] - shift) : 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float m = part_stats[2 * (s * rows + row)];
    total += part_stats[2 * (s * rows + row) + 1] * expf(m - shift);
  }
  for (int c = threadIdx.x; c < head_size; c += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float m = part_stats[2 * (s * rows + row)];
      const float weight = expf(m - shift);
      if (weight != 0.f || isnan(m)) acc += part_out[(s * rows + row) * head_size + c] * weight;
    }
    const float value = acc / total;
    out[row * static_cast<long long>(head_size) + c] = kvc::from_float<OUT>(value);
  }
}

}  // namespace kvc_attn
