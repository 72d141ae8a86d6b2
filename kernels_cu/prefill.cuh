// Prefill attention (many query rows a sequence) on tensor cores, in the
// FlashAttention-2 orientation: a warp owns 16 query rows, a block WARPS x 16
// rows of one KV head, and the block streams that head's keys TILE tokens at
// a time through shared memory.
//
//   scores  S[row, token] = Q[row, :] . K[token, :]     M = rows, N = tokens
//   output  O[row, dim]  += P[row, token] . V[token, dim]  M = rows, N = dims
//
// Where the decode kernel (attention.cuh) converts each cache code in the
// registers of the one warp that uses it, here the codes a tile holds feed
// WARPS x 16 rows: the block first decodes the tile once, cooperatively, into
// fp16 (code - zero-point, an exact small integer; fp8: the e4m3 value on
// sm_89 and newer, e4m3 x 2^-8 before; both exact; auto caches: see decode_tile),
// and every warp then takes its mma operands from those rows with ldmatrix.
// Scales stay out of the operands, as in the decode kernel: K's on the score
// side, V's on the probability side (P x scale / R, R the largest V scale
// seen so far, so that the fp16 operand stays in [0, 1]; auto caches' times
// 2^10). The query enters as a two-term fp16 split (q = hi + lo, ~22 bits), so
// each score is two mmas; the wgmma build (below) takes one term
// (tests/gpu/test_attention.py: the bound). Auto caches (fp16 / bf16 rows) in
// the mma.sync build skip the decoding: warps read the staged rows directly
// (bf16: P enters as a two-term split too, bf16 keeping 8 bits); the wgmma
// builds decode them like codes, into fp16 rows with a power-of-two scale each.
//
// Rows are (query token, query head of the KV head's group) pairs, flattened
// as in the decode kernel; partial softmax states go to the same split
// buffers, merged by merge_splits.
#pragma once

#include "attention.cuh"
#include "wgmma.cuh"

namespace kvc_attn {

// The largest power of two, at most `cap`, that divides n.
__host__ __device__ constexpr int largest_pow2_divisor(int n, int cap) {
  return n % cap == 0 || cap == 1 ? cap : largest_pow2_divisor(n, cap / 2);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* shared_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(shared_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* shared_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(shared_row)));
}

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

// a * b + c on fp16 pairs, one rounding (exact wherever the result is representable).
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// WGMMA (sm_90a, quantized caches): each warpgroup's products are two wgmma
// chains instead of one mma.sync chain a warp. The scores take the query rows
// and the decoded keys from shared memory (descriptors), the output takes P from
// registers and the decoded values from shared memory, so a tile's rows are
// read once a warpgroup rather than once a warp. Decoded tiles and query rows
// are then laid out as core matrices (wgmma.cuh), three decoded buffers deep:
// a tile's score products run while the next tile is decoded, its output
// products while the next barrier, copies and score products are issued.

// PRODUCER (wgmma builds): the last warpgroup stages and decodes the tiles while
// the others (the consumers, 128 query rows) only run the products and the
// softmax, ordered by mbarriers instead of a block barrier a tile: per decoded
// buffer, "full" (the producer's 128 threads have decoded a tile into it) and
// "empty" (every consumer thread is done with it). Past the block's prologue
// the producer gives KVC_PRODUCER_REGS of its registers' worth back
// (setmaxnreg) so that the consumers run on 224; they take FlashAttention-3's
// intra-warpgroup order (run()): a tile's output products run under the next
// tile's softmax. Their score products take the query from registers (32 of
// them at d = 128), so that shared memory serves the tensor cores only K and V.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVC_FP8_CONVERT 1   // cvt.rn.f16x2.e4m3x2
#else
#define KVC_FP8_CONVERT 0
#endif

#ifndef KVC_SWIZZLE
#define KVC_SWIZZLE 0   // Prefill::kSwizzled (the launcher's PrefillKernel.swizzled)
#endif
#ifndef KVC_ROTATED
#define KVC_ROTATED 1   // 0: no rotation's code at all (Prefill::kRotated; the launcher's PrefillKernel.rotated)
#endif
#ifndef KVC_WIDE_ROWS
#define KVC_WIDE_ROWS 1   // 0: 16-bit query and output rows only (Prefill::kWideRows; PrefillKernel.wide_rows)
#endif
#ifndef KVC_MIN_BLOCKS
#define KVC_MIN_BLOCKS 1   // the launch bounds' blocks a multiprocessor (attention.cu)
#endif
#ifndef KVC_PRODUCER_REGS
#define KVC_PRODUCER_REGS 56   // the fewest with which the producer's loop spills nothing
#endif

template <int KV, int HEAD_PAD, int WARPS, int TILE, int STAGES, int CHUNK, bool WGMMA = false, bool PRODUCER = false,
          bool DIRECT = false>
struct Prefill {
  static_assert(HEAD_PAD % 32 == 0 && HEAD_PAD <= 128, "head size class: 32 .. 128");
  static_assert(TILE % 16 == 0 && TILE <= 128, "tiles are whole 16-token k steps");
  static_assert(CHUNK == 1 || CHUNK == 4 || CHUNK == 8 || CHUNK == 16, "copy granule");
  static_assert(!WGMMA || (WARPS % 4 == 0 && TILE % 32 == 0), "wgmma: whole warpgroups, tiles of 32 .. 128 tokens");
  static_assert(!PRODUCER || (WGMMA && WARPS >= 8), "a producer warpgroup beside consumer warpgroups (wgmma)");
  static_assert(!DIRECT || (PRODUCER && (KV == KV_F16 || KV == KV_BF16) && CHUNK >= 4),
                "direct tiles: 16-bit rows of the producer build, whole 4-byte pieces");
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kConsumerWarps = PRODUCER ? WARPS - 4 : WARPS;   // warps with query rows
  static constexpr int kConsumerThreads = 32 * kConsumerWarps;
  static constexpr int kStagers = PRODUCER ? 128 : kThreads;            // threads that stage and decode
  static constexpr int kRows = 16 * kConsumerWarps;  // query rows a block
  static constexpr int KC = HEAD_PAD / 16;          // k steps of the score product
  static constexpr int NT = TILE / 8;               // score n tiles (8 tokens)
  static constexpr int ND = HEAD_PAD / 8;           // output n tiles (8 dims)
  static constexpr bool kQuantized = KV == KV_INT4 || KV == KV_INT8 || KV == KV_FP8;
  // Tiles decoded into fp16 rows and per-token scales before the products:
  // quantized caches, and 16-bit ones in wgmma builds (decode_tile: fp16 rows
  // copied, bf16 rows converted with a power-of-two scale a row).
  static constexpr bool kDecoded = kQuantized || WGMMA;
  // DIRECT (16-bit rows, the producer build): the producer copies the rows
  // straight into the decoded buffers' core matrices, where the products read
  // them as they are stored: no raw stages, no decoding pass, no scales (every
  // token's is 1). bf16 rows then enter as bf16 operands, the query and P
  // too; the launcher takes it for bf16 rows only where the query is bf16 and
  // not rotated (so the query enters exactly, as an fp16 query does fp16
  // rows), and P rounds to bf16 (2^-9 relative, FlashAttention's arithmetic).
  static constexpr bool kUnitScales = DIRECT;
  // DIRECT tiles take a swizzled layout (kvc_wgmma::swizzled_offset; KVC_SWIZZLE):
  // 128-byte columns where a row is whole ones (HEAD_PAD 64, 128), else 64-byte
  // ones (HEAD_PAD 32, 96). A warp then copies whole rows without bank
  // conflicts. Without KVC_SWIZZLE they keep the core matrices side by side
  // (kvc_wgmma::core_offset), as the decoding pass's tiles do: it could write
  // either (its stores go through decoded_at), but a swizzle buys its 16-byte
  // stores nothing and its per-store addresses cost the producer registers.
  static constexpr int kSwizzleBytes = !(DIRECT && KVC_SWIZZLE) ? 0 : HEAD_PAD % 64 == 0 ? 128 : 64;
  static constexpr bool kSwizzled = kSwizzleBytes != 0;
  // Builds for caches without a rotation (KVC_ROTATED 0) leave the query's and
  // the output's rotation out: their registers make the builds without the
  // producer spill (int8 at d = 128: 12 warps, or 8 at two blocks a multiprocessor).
  static constexpr bool kRotated = KVC_ROTATED != 0;
  // Builds for 16-bit query and output rows (KVC_WIDE_ROWS 0, the launcher's
  // choice where neither is float32) leave out the float32 rows' code: the
  // query's two-term rotation and the output's. The float32 calls' build keeps
  // one copy of each rotation's products (load_query, write_output). NVRTC's
  // compile time grows with the code, so builds that never need it leave it
  // out. The host never hands such a build a float32 query or output.
  static constexpr bool kWideRows = KVC_WIDE_ROWS != 0;
  // The output's inverse rotation emits each group of four n tiles as soon as it
  // is done (rotate_rows without ACROSS_GROUPS) where the launch bounds leave 128
  // registers a thread or fewer: the short-prompt build (8 warps, two blocks a
  // multiprocessor) spills less so. Builds with more keep the whole rows and emit
  // after: with registers to spare, the products then run back to back, not
  // interleaved with the stores.
  // Registers a thread that the launch bounds leave (KVC_MIN_BLOCKS blocks a multiprocessor).
  static constexpr int kBoundRegs = 65536 / (kThreads * KVC_MIN_BLOCKS);
  static constexpr bool kInverseByGroups = kBoundRegs <= 128;
  static_assert(!kSwizzled || HEAD_PAD % 32 == 0, "swizzled rows are whole 64-byte columns");
  // bf16 operands: the mma.sync build over bf16 rows read in place, whose P
  // then enters as a two-term split (kSplitP), and DIRECT bf16 rows. Every
  // other build's operands are fp16.
  static constexpr bool kBf16 = KV == KV_BF16 && (!kDecoded || DIRECT);
  static constexpr bool kSplitP = KV == KV_BF16 && !kDecoded;
  // The P operand is p x V scale / R times this (a power of two): 16-bit rows'
  // decoded values reach 2^14 (bf16) or 65504 (fp16) where codes stay below
  // 2^7, so P has room above 1, and a token whose V scale is far below R keeps
  // its fp16 precision (p x scale / R below 2^-14 would be subnormal). bf16
  // operands (float32's exponents) need no lift.
  static constexpr float kProbabilityLift = kDecoded && !kQuantized && !kBf16 ? 1024.f : 1.f;
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr int kDimBits = KV == KV_INT4 ? 4 : kQuantized ? 8 : 16;
  static constexpr int kRowBytes = HEAD_PAD * kDimBits / 8;   // a staged row (one KV head)
  // Staged rows: quantized ones are only read by the decoding pass (a run of
  // consecutive words of one row a thread, the threads of a warp on
  // consecutive rows), their stride an odd number of 16-byte units, so that
  // the 8 rows of a 128-byte span fall in distinct banks (unpadded rows of 128
  // bytes put a warp's 16-byte reads in one bank group: 8-way conflicts); fp16
  // rows go straight to ldmatrix and take the padding of decoded rows.
  // A decoded row: HEAD_PAD fp16 values + 16 bytes, so the 8 rows of an
  // ldmatrix fall in distinct banks (the stride is 16 or 80 modulo 128).
  static constexpr int kDecodedStride = 2 * HEAD_PAD + 16;
  static constexpr int kRawStride = !kQuantized ? kDecodedStride : kRowBytes % 32 == 0 ? kRowBytes + 16 : kRowBytes;
  static constexpr int kRawTensorBytes = TILE * kRawStride;
  static constexpr int kRawScaleBytes = kQuantized ? TILE * 4 : 0;
  static constexpr int kStageBytes = DIRECT ? 0 : 2 * kRawTensorBytes + 2 * kRawScaleBytes;
  // wgmma reads core matrices: no padding.
  static constexpr int kDecodedTensorBytes = TILE * (WGMMA ? 2 * HEAD_PAD : kDecodedStride);
  // A decoded tile (quantized caches): K rows, V rows, then K and V scales as
  // floats; two of them (the next tile decoded while this one is used), three
  // with wgmma (and the one before still read by output products in flight).
  // DIRECT: STAGES + 3, the tiles in flight besides those three.
  static constexpr int kDecodedBuffers = DIRECT ? STAGES + 3 : WGMMA ? 3 : 2;
  // Swizzled tiles start on 1024-byte boundaries (their pattern is the address's).
  static constexpr int kTileAlign = kSwizzled ? 1024 : 1;
  __host__ __device__ static constexpr int round_up(int bytes) { return (bytes + kTileAlign - 1) / kTileAlign * kTileAlign; }
  static constexpr int kDecodedOffset = round_up(STAGES * kStageBytes);   // the decoded buffers, after the stages
  static constexpr int kDecodedBufferBytes = round_up(2 * kDecodedTensorBytes + (kUnitScales ? 0 : 2 * TILE * 4));
  static constexpr int kDecodedBytes = kDecoded ? kDecodedBuffers * kDecodedBufferBytes : 0;
  // Query rows of a warp, high or low halves: 16 rows as decoded ones. With
  // wgmma, a warpgroup's 64 rows, one fp16 term (kQueryTerms: see run()).
  static constexpr int kQueryTerms = WGMMA ? 1 : 2;
  static constexpr int kQueryBytes = 16 * (WGMMA ? 2 * HEAD_PAD : kDecodedStride);
  static constexpr int kWarpgroupQueryBytes = 4 * kQueryBytes;
  static constexpr int kBarrierOffset =
      kDecodedOffset + kDecodedBytes + kConsumerWarps * kQueryTerms * kQueryBytes;
  // PRODUCER: full, then empty; then (wgmma builds) the bulk rows' barrier (see bulk_rows).
  static constexpr int kQueryBarrierOffset = kBarrierOffset + (PRODUCER ? 2 * 8 * kDecodedBuffers : 0);
  static constexpr int kBarrierBytes = kQueryBarrierOffset - kBarrierOffset + (WGMMA ? 16 : 0);
  static constexpr int kSharedBytes = kBarrierOffset + kBarrierBytes;
  // Registers a thread (setmaxnreg): the launch bounds' 168 at 12 warps (one
  // block a multiprocessor: the producer build's bounds), the producer's given
  // to the consumers.
  static constexpr int kLaunchRegs = kBoundRegs & ~7;
  static constexpr int kProducerRegs = KVC_PRODUCER_REGS;
  static constexpr int kConsumerRegs = ((kLaunchRegs * kThreads - kProducerRegs * 128) / kConsumerThreads) & ~7;
  // fp8 codes enter the products as e4m3 x 2^-8 (bit moves): the scales carry
  // the 2^8. sm_89 and newer convert e4m3 pairs to fp16 in one instruction, the
  // codes' own values (exact in fp16): their scales carry no 2^8.
  static constexpr bool kFp8Convert = KV == KV_FP8 && KVC_FP8_CONVERT;
  static constexpr float kCodeUnit = KV == KV_FP8 && !kFp8Convert ? 256.f : 1.f;

  // The decode kernel's helpers this one shares: the page window and its block ids.
  typedef Attention<KV, HEAD_PAD, 1, 1, 16, STAGES, CHUNK> Pages;

  // The cache channel of logical dim `logical` of the products. int4 decoding
  // turns a word's nibbles (channels 0..7) into fp16 pairs (0, 4), (1, 5),
  // (2, 6), (3, 7), stored in that order; the other formats keep theirs.
  static __device__ __forceinline__ int channel_of(int logical) {
    if constexpr (KV == KV_INT4) {
      const int p = logical & 7;
      return (logical & ~7) + (p >> 1) + 4 * (p & 1);
    }
    return logical;
  }

  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    return kBf16 ? pack_bf162(lo, hi) : pack_half2(lo, hi);
  }
  static __device__ __forceinline__ float2 unpack(u32 x) { return kBf16 ? unpack_bf162(x) : unpack_half2(x); }

  // One stager's share of a tile where every token it copies takes the same
  // piece (byte `offset` of the row): tokens first, first + STEP, .. of the
  // tile, token first + i STEP's piece to at(keys, i, token) and at(values,
  // i, token). The piece's offsets are worked out once; a token costs a block
  // id and two addresses. Tokens outside [lo, hi), ids outside the cache and
  // pieces past the row are zero-filled. A lane that is not `copying` only
  // takes part in the page lookups' shuffles.
  template <int STEP, class At>
  static __device__ __forceinline__ void copy_fixed_piece(const Params& p, u8* keys, u8* values, int first, int offset,
                                                          At at, int head, int base, int lo, int hi, int block_shift,
                                                          const typename Pages::PageWindow& window,
                                                          bool copying = true) {
    const bool in_row = offset < p.row_bytes;
    const long long key_part = head * p.k_head_stride + offset, value_part = head * p.v_head_stride + offset;
#pragma unroll
    for (int i = 0; i < (TILE + STEP - 1) / STEP; ++i) {
      const int token = first + i * STEP;
      const int position = base + token;
      const int block = Pages::block_of(window, position >> block_shift);   // every lane shuffles
      if ((TILE % STEP != 0 && token >= TILE) || !copying) continue;
      const bool valid = block >= 0 && position >= lo && position < hi;
      const long long slot = position & (p.block_size - 1);
      const int bytes = valid && in_row ? CHUNK : 0;
      const u8* key_src = p.key_cache + block * p.k_block_stride + slot * p.k_slot_stride + key_part;
      const u8* value_src = p.value_cache + block * p.v_block_stride + slot * p.v_slot_stride + value_part;
      cp_async(at(keys, i, token), bytes ? key_src : p.key_cache, bytes, CHUNK);
      cp_async(at(values, i, token), bytes ? value_src : p.value_cache, bytes, CHUNK);
    }
  }

  // Stage `stage` <- raw K / V rows (and scale words) of tokens base .. base + TILE - 1
  // in [lo, hi) of KV head `head`; other tokens, and ids outside the cache, zero-filled.
  // DIRECT: decoded buffer `stage` <- the rows in the products' layout (stage_direct).
  static __device__ __forceinline__ void stage_tile(const Params& p, u8* smem, int stage, int head, int base, int lo,
                                                    int hi, int block_shift,
                                                    const typename Pages::PageWindow& window, int stager) {
    u8* keys = smem + stage * kStageBytes;
    u8* values = keys + kRawTensorBytes;
    constexpr int kPieceBytes = CHUNK == 1 ? 4 : CHUNK;
    constexpr int kPieces = kRowBytes / kPieceBytes;
    if constexpr (DIRECT) {
      stage_direct<kPieces>(p, smem + kDecodedOffset + stage * kDecodedBufferBytes, head, base, lo, hi,
                            block_shift, window, stager);
      return;
    }
    // Every token a stager copies takes the same piece (copy_fixed_piece: the
    // piece's offsets once a tile, where the loop below works them out for every
    // piece): 16-bit rows, and quantized codes in the producer build. The scale
    // words keep their own loop below: folded into piece 0's stagers they would
    // leave those stagers the longest share. Quantized codes without a producer,
    // whose stagers also compute, keep the general loop: there the fixed piece
    // does not pay.
    constexpr bool kFixedPiece = CHUNK > 1 && kStagers % kPieces == 0 && (!kQuantized || PRODUCER);
    if constexpr (kFixedPiece) {
      constexpr int kTokenStep = kStagers / kPieces;
      const int piece = stager % kPieces, first = stager / kPieces;
      const int offset = piece * CHUNK;
      auto at = [&](u8* rows, int, int token) { return rows + token * kRawStride + offset; };
      copy_fixed_piece<kTokenStep>(p, keys, values, first, offset, at, head, base, lo, hi, block_shift, window);
    } else {
      constexpr int kWork = TILE * kPieces;
#pragma unroll 1
      for (int c0 = 0; c0 < kWork; c0 += kStagers) {
        const int c = c0 + stager;
        const int token = c / kPieces, piece = c - token * kPieces;
        const int position = base + token;
        const int block = Pages::block_of(window, position >> block_shift);   // every lane shuffles
        if (c >= kWork) continue;
        const bool valid = block >= 0 && position >= lo && position < hi;
        const long long slot = position & (p.block_size - 1);
        const int offset = piece * kPieceBytes;
        stage_row_piece<CHUNK>(p, keys + token * kRawStride + offset, values + token * kRawStride + offset, block,
                               slot, head, offset, valid);
      }
    }
    if constexpr (kQuantized) {
      u8* key_scales = values + kRawTensorBytes;
      u8* value_scales = key_scales + kRawScaleBytes;
#pragma unroll 1
      for (int c0 = 0; c0 < TILE; c0 += kStagers) {
        const int token = c0 + stager;
        const int position = base + token;
        const int block = Pages::block_of(window, position >> block_shift);
        if (token >= TILE) continue;
        const bool valid = block >= 0 && position >= lo && position < hi;
        const long long slot = position & (p.block_size - 1);
        stage_scale_words(p, key_scales + 4 * token, value_scales + 4 * token, block, slot, head, valid);
      }
    }
  }

  // DIRECT staging of a tile's rows into `buffer`. Swizzled tiles: each warp
  // copies whole rows, 32 / PIECES of them at a time, a row's pieces on
  // consecutive lanes (lanes past the last whole row idle: 8 of 32 at d = 96),
  // so that a warp reads whole rows from global memory and writes them in
  // distinct bank groups (kvc_wgmma::swizzled_offset). Each lane keeps its
  // piece (copy_fixed_piece), its tokens a multiple of 8 apart: the same swizzle
  // phase, a fixed byte step. The core matrices: work item c is piece (c / 8)
  // % PIECES of token 8 (c / (8 PIECES)) + c % 8: 8 lanes on the same piece of
  // 8 consecutive tokens, one core matrix's 128 contiguous bytes (a row's
  // pieces there lie 128 bytes apart, in one bank group), a warp's copies then
  // touching 8 rows. The launcher takes the swizzled layout (PrefillKernel.swizzled):
  // whole rows from global memory, without bank conflicts in shared memory.
  template <int PIECES>
  static __device__ __forceinline__ void stage_direct(const Params& p, u8* buffer, int head, int base, int lo, int hi,
                                                      int block_shift, const typename Pages::PageWindow& window,
                                                      int stager) {
    u8* const keys = buffer;
    u8* const values = buffer + kDecodedTensorBytes;
    constexpr int kWork = TILE * PIECES;
    constexpr int kRowsAWarp = PIECES <= 32 ? 32 / PIECES : 0;
    constexpr int kSwizzledStep = kStagers / 32 * kRowsAWarp;   // tokens between a lane's rows
    if constexpr (kSwizzled && kRowsAWarp > 0 && kSwizzledStep % 8 == 0) {
      const unsigned lane = stager & 31;   // unsigned: / and % by powers of two are shifts and masks
      const int piece = lane % PIECES, first = stager / 32 * kRowsAWarp + lane / PIECES;
      const int offset = piece * CHUNK;
      const int target = tile_offset(first, offset / 2);
      auto at = [&](u8* rows, int i, int) { return rows + target + i * kSwizzledStep * kSwizzleBytes; };
      copy_fixed_piece<kSwizzledStep>(p, keys, values, first, offset, at, head, base, lo, hi, block_shift, window,
                                      lane < kRowsAWarp * PIECES);
    } else if constexpr (!kSwizzled && kStagers % (8 * PIECES) == 0) {
      constexpr int kTokenStep = kStagers / PIECES;   // a multiple of 8
      const unsigned item = stager;
      const int piece = item / 8 % PIECES, first = item % 8 + 8 * (item / (8 * PIECES));
      const int offset = piece * CHUNK;
      const int target = tile_offset(first, offset / 2);
      // Tokens kTokenStep apart (a multiple of 8): whole core-matrix rows apart.
      auto at = [&](u8* rows, int i, int) { return rows + target + i * kTokenStep * 2 * HEAD_PAD; };
      copy_fixed_piece<kTokenStep>(p, keys, values, first, offset, at, head, base, lo, hi, block_shift, window);
    } else {   // the same items (one token a row of pieces where swizzled), their offsets worked out each time
      constexpr int S = kSwizzled ? 1 : 8;
#pragma unroll 1
      for (int c0 = 0; c0 < kWork; c0 += kStagers) {
        const unsigned c = c0 + stager;
        const int token = S * (c / (S * PIECES)) + c % S, piece = c / S % PIECES;
        const int position = base + token;
        const int block = Pages::block_of(window, position >> block_shift);   // every lane shuffles
        if (c >= kWork) continue;
        const bool valid = block >= 0 && position >= lo && position < hi;
        const long long slot = position & (p.block_size - 1);
        const int offset = piece * CHUNK;
        const int at = tile_offset(token, offset / 2);
        stage_row_piece<CHUNK>(p, keys + at, values + at, block, slot, head, offset, valid);
      }
    }
  }

  // Trims of a block's bookkeeping (row_token's unsigned division, the output's
  // channel pairs, write_output's selects skipped where no row needs them),
  // taken by quantized caches' builds only: the 12-warp build over 16-bit rows
  // already spills, and the trims shift its register allocation for the worse.
  static constexpr bool kTrimmed = kQuantized;

  // A query row's token and head within its KV head's group: row / group and
  // row % group, unsigned (rows are never negative: no sign fix-ups around the
  // divisions, which a short prompt's block runs a dozen times a thread).
  static __device__ __forceinline__ int row_token(const Params& p, int row) {
    if constexpr (kTrimmed) return static_cast<int>(static_cast<u32>(row) / static_cast<u32>(p.group));
    return row / p.group;
  }
  static __device__ __forceinline__ int row_head(const Params& p, int row) {
    if constexpr (kTrimmed) return static_cast<int>(static_cast<u32>(row) % static_cast<u32>(p.group));
    return row % p.group;
  }

  // Element offset of block row `row` in the query or the output (token_stride,
  // head_stride: its element strides): token q_begin + row / group, query head
  // kv_head x group + row % group.
  static __device__ __forceinline__ long long row_offset(const Params& p, int q_begin, int row, int kv_head,
                                                         long long token_stride, long long head_stride) {
    return (q_begin + row_token(p, row)) * token_stride +
           static_cast<long long>(kv_head * p.group + row_head(p, row)) * head_stride;
  }

  // Byte offset of dim `dim` of token `token` in a wgmma build's decoded K or V rows.
  static __device__ __forceinline__ int tile_offset(int token, int dim) {
    if constexpr (kSwizzled) return kvc_wgmma::swizzled_offset<kSwizzleBytes>(token, dim, TILE);
    return kvc_wgmma::core_offset(token, dim, HEAD_PAD);
  }

  // Where logical dim `dim` of decoded row `row` (K rows, then V rows) lies.
  static __device__ __forceinline__ u8* decoded_at(u8* decoded, int row, int dim) {
    if constexpr (WGMMA) return decoded + row / TILE * kDecodedTensorBytes + tile_offset(row % TILE, dim);
    return decoded + row * kDecodedStride + 2 * dim;
  }

  // Raw stage -> decoded tile: K and V rows as fp16 (code - zero-point), and
  // the scales as floats (times the fp8 code unit). Each thread decodes a run
  // of consecutive words of one row (a whole row with 4 warps and 64-token
  // tiles), so that a row's zero-point and biases are worked out once per
  // thread, not once per word.
  static __device__ __forceinline__ void decode_tile(const u8* stage, u8* decoded, int stager) {
    if constexpr (kQuantized) {
      const u32* scale_words = reinterpret_cast<const u32*>(stage + 2 * kRawTensorBytes);
      constexpr int kWordsPerRow = kRowBytes / 4;
      constexpr int kWords = 2 * TILE * kWordsPerRow;   // K rows, then V rows: one scale word a row
      // One run a thread where the threads divide the words evenly; otherwise
      // (12 warps) runs of up to 8 words, dealt out to the threads in turn.
      constexpr bool kOneRunEach = kWords % kStagers == 0;
      constexpr int kRun = kOneRunEach ? kWords / kStagers : largest_pow2_divisor(kWordsPerRow, 8);
      static_assert(kWordsPerRow % kRun == 0, "a run lies in one row");
      constexpr int kVector = kRun % 4 == 0 ? 4 : kRun % 2 == 0 ? 2 : 1;
      auto decode_run = [&](int run) {
        const int first = run * kRun;
        const int row = first / kWordsPerRow, word0 = first - row * kWordsPerRow;
        // int4: nibble c under 0x6400 is 1024 + c (low nibble) or 1024 + 16 c (high
        // nibble, not shifted down): add -(1024 + zp), or scale by 1/16 and add
        // -(64 + zp); both exact. fp16 bits of -(1024 + zp): 0xE400 + zp (the ulp
        // at 1024 is 1); of -(64 + zp): 0xD400 + 16 zp (ulp 1/16).
        const u32 zp = KV == KV_INT4 ? scale_words[row] & 0xFu : 0u;
        const u32 low_bias = (0xE400u + zp) * 0x10001u, high_bias = (0xD400u + 16u * zp) * 0x10001u;
        // Every load of a batch first: the decoding then waits on shared memory
        // once a batch, of at most 16 words (32 at once would spill the
        // producer's 56 registers: int8 at d = 128).
        constexpr int kBatch = kRun <= 16 ? kRun : kRun % 16 == 0 ? 16 : kRun / 2;   // 32 -> 16, 24 -> 12
        static_assert(kRun % kBatch == 0 && kBatch % kVector == 0, "whole batches of whole loads");
#pragma unroll
        for (int batch = 0; batch < kRun; batch += kBatch) {
          u32 codes[kBatch];
#pragma unroll
          for (int v = 0; v < kBatch; v += kVector) {
            const u8* source = stage + row * kRawStride + 4 * (word0 + batch + v);
            if constexpr (kVector == 4) {
              const uint4 raw = *reinterpret_cast<const uint4*>(source);
              codes[v] = raw.x, codes[v + 1] = raw.y, codes[v + 2] = raw.z, codes[v + 3] = raw.w;
            } else if constexpr (kVector == 2) {
              const uint2 raw = *reinterpret_cast<const uint2*>(source);
              codes[v] = raw.x, codes[v + 1] = raw.y;
            } else {
              codes[v] = *reinterpret_cast<const u32*>(source);
            }
          }
#pragma unroll
          for (int v = 0; v < kBatch; ++v) {
            const u32 code = codes[v];
            const int word = word0 + batch + v;
            if constexpr (KV == KV_INT4) {
              constexpr u32 kOne = 0x3C003C00u, kSixteenth = 0x2C002C00u;
              const u32 shifted = code >> 8;
              uint4 out;
              out.x = hfma2(lop_and_or(code, 0x000F000Fu, 0x64006400u), kOne, low_bias);          // channels 0, 4
              out.y = hfma2(lop_and_or(code, 0x00F000F0u, 0x64006400u), kSixteenth, high_bias);  // 1, 5
              out.z = hfma2(lop_and_or(shifted, 0x000F000Fu, 0x64006400u), kOne, low_bias);       // 2, 6
              out.w = hfma2(lop_and_or(shifted, 0x00F000F0u, 0x64006400u), kSixteenth, high_bias);  // 3, 7
              *reinterpret_cast<uint4*>(decoded_at(decoded, row, 8 * word)) = out;
            } else {
              // Two words (8 dims: 16 contiguous bytes of a decoded row) a store: 8-byte
              // stores into the core matrices would leave half of each wavefront unused.
              static_assert(kBatch % 2 == 0, "whole 8-dim runs");
              if (v % 2) continue;
              u32 pairs[4];
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const u32 bytes = codes[v + half];
                if constexpr (KV == KV_INT8) {
                  // 1024 + 128 + code (the sign bit flipped into a bias: once a word),
                  // the byte under fp16's 0x64 by the permute itself, plus -1152.
                  constexpr u32 kOne = 0x3C003C00u, kBias = 0xE480E480u;
                  const u32 biased = bytes ^ 0x80808080u;
                  pairs[2 * half] = hfma2(prmt(biased, 0x64646464u, 0x4140u), kOne, kBias);
                  pairs[2 * half + 1] = hfma2(prmt(biased, 0x64646464u, 0x4342u), kOne, kBias);
                } else if constexpr (kFp8Convert) {
                  pairs[2 * half] = e4m3x2_to_half2(static_cast<unsigned short>(bytes));
                  pairs[2 * half + 1] = e4m3x2_to_half2(static_cast<unsigned short>(bytes >> 16));
                } else {
                  pairs[2 * half] = fp8_pair(prmt(bytes, 0u, 0x1404u));
                  pairs[2 * half + 1] = fp8_pair(prmt(bytes, 0u, 0x3424u));
                }
              }
              *reinterpret_cast<uint4*>(decoded_at(decoded, row, 4 * word)) =
                  make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
            }
          }
        }
      };
      if constexpr (kOneRunEach) {
        decode_run(stager);
      } else {
        for (int run = stager; run < kWords / kRun; run += kStagers) decode_run(run);
      }
      // Scales: int4's scale word carries the zero-point in its low 4 bits.
      float* scales = reinterpret_cast<float*>(decoded + 2 * kDecodedTensorBytes);
      for (int c = stager; c < 2 * TILE; c += kStagers) {
        const u32 bits = scale_words[c];
        scales[c] = __uint_as_float(KV == KV_INT4 ? bits & ~0xFu : bits) * kCodeUnit;
      }
      if constexpr (WGMMA) fence_proxy_async();   // the rows are wgmma operands next (async proxy)
    } else if constexpr (kDecoded) {
      // 16-bit rows (wgmma builds), a whole row a thread: fp16 ones copied (scale
      // 1); a bf16 row, whose values may lie outside fp16's range, times the power
      // of two up = 2^(140 - E) that brings its largest |x| (biased exponent E)
      // into [2^13, 2^14), the row's scale 1 / up. Exact for every value within
      // 2^-30 of the row's largest (8 significant bits, fp16's subnormals reach
      // 2^-24); the smaller ones round to fp16, off by less than 2^-38 of the
      // largest. E at least 14 keeps both powers normal floats; a row with an
      // inf or a NaN (E = 255) keeps scale 1, so the non-finite value stays one.
      // (fp16_range_scale, the query rows' power, is the same power by frexpf
      // and ldexpf, but overflows to inf for a largest |x| below 2^-113, which
      // a cache row may hold; the scale here comes from E's bits directly.)
      constexpr int kWordsPerRow = kRowBytes / 4;
      // Words loaded before they are used: 16 (8 where bf16 converts them: 16
      // would spill the producer's registers at d = 128).
      constexpr int kBatch = KV == KV_BF16 ? 8 : 16;
      static_assert(kWordsPerRow % 16 == 0, "whole batches: head sizes are multiples of 32");
      float* scales = reinterpret_cast<float*>(decoded + 2 * kDecodedTensorBytes);
#pragma unroll 1
      for (int row = stager; row < 2 * TILE; row += kStagers) {   // K rows, then V rows
        const u8* source = stage + row * kRawStride;
        float up = 1.f, scale = 1.f;
        if constexpr (KV == KV_BF16) {
          u32 largest = 0;   // a bf16 pair whose magnitudes are the row's largest (signs aside)
          row_batches<kBatch>(source, [&](int, const uint4& raw) {
            largest = max_abs_bf16x2(largest, max_abs_bf16x2(max_abs_bf16x2(raw.x, raw.y), max_abs_bf16x2(raw.z, raw.w)));
          });
          largest &= 0x7FFF7FFFu;   // |x|'s bits: their order is the values'
          const u32 exponent = max(max(largest & 0xFFFFu, largest >> 16) >> 7, 14u);
          if (exponent < 255u) up = __uint_as_float((267u - exponent) << 23), scale = __uint_as_float((exponent - 13u) << 23);
        }
        row_batches<kBatch>(source, [&](int word, uint4 raw) {
          if constexpr (KV == KV_BF16)
            raw = make_uint4(scaled_half2(raw.x, up), scaled_half2(raw.y, up), scaled_half2(raw.z, up),
                             scaled_half2(raw.w, up));
          // 8 dims: 16 contiguous bytes of a core matrix's row
          *reinterpret_cast<uint4*>(decoded_at(decoded, row, 2 * word)) = raw;
        });
        scales[row] = scale;
      }
      fence_proxy_async();   // the rows are wgmma operands next (async proxy)
    }
  }

  // visit(word, raw) for a staged 16-bit row's words, BATCH at a time, each
  // batch loaded whole before the first is visited. (A member template, not a
  // generic lambda: NVRTC 13.0 takes a generic lambda's operator for a host function.)
  template <int BATCH, class Visit>
  static __device__ __forceinline__ void row_batches(const u8* source, Visit visit) {
    constexpr int kWordsPerRow = kRowBytes / 4;
#pragma unroll
    for (int batch = 0; batch < kWordsPerRow; batch += BATCH) {
      uint4 raw[BATCH / 4];
#pragma unroll
      for (int v = 0; v < BATCH / 4; ++v) raw[v] = *reinterpret_cast<const uint4*>(source + 4 * (batch + 4 * v));
#pragma unroll
      for (int v = 0; v < BATCH / 4; ++v) visit(batch + 4 * v, raw[v]);
    }
  }

  // The e4m3 codes in the low and high byte of `codes` as an fp16 pair (low
  // half from the low byte), their values exactly (sm_89 and newer).
  static __device__ __forceinline__ u32 e4m3x2_to_half2(unsigned short codes) {
    u32 r = 0;
#if KVC_FP8_CONVERT
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(codes));
#endif
    return r;
  }

  // Of each half of the bf16 pairs a and b, the one of larger magnitude (its
  // sign the two signs' xor; a NaN gives way to the other value: the row's
  // NaN stays one through its scale, whatever the scale).
  static __device__ __forceinline__ u32 max_abs_bf16x2(u32 a, u32 b) {
    u32 r;
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }

  // A bf16 pair times `up` (a power of two), as an fp16 pair.
  static __device__ __forceinline__ u32 scaled_half2(u32 pair, float up) {
    return pack_half2(__uint_as_float(pair << 16) * up, __uint_as_float(pair & 0xFFFF0000u) * up);
  }

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
  static_assert(!WGMMA || kRows * kDecodedStride <= kDecodedBytes, "the staged rows fit the decoded buffers");
  static constexpr int kLastBufferOffset = (kDecodedBuffers - 1) * kDecodedBufferBytes;
  static constexpr bool kEarlyInverse =
      kRows * kDecodedStride <= kLastBufferOffset && HEAD_PAD * HEAD_PAD * 2 <= kDecodedBufferBytes;
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

  // Whether the (k step, n tile) fragment of a rotation matrix can hold a
  // nonzero: its 16 rows and 8 columns lie in one independent block of
  // 2^shift dims (the host's rotation_shift: large where every fragment counts).
  // Skipping the others saves products and keeps a non-finite value inside its block.
  static __device__ __forceinline__ bool fragment_used(int shift, int ks, int nt) {
    return (16 * ks) >> shift == (8 * nt) >> shift;
  }
  // Fragments independent in 16-dim groups: a rotation whose blocks are 16 dims,
  // or the factor beside the butterflies across groups (the host's rotation_stages).
  // Those few fragments are read from global memory (L1) where they lie.
  static constexpr int kGroupShift = 4;
  // The host's rotation_shift (-1: none), as this build applies it.
  static __device__ __forceinline__ int rotation_shift(const Params& p) { return kRotated ? p.rotation_shift : -1; }

  // The rotation's fragments (the launcher's rotation_fragments: [KC][ND][32
  // lanes] x 8 bytes, HEAD_PAD^2 x 2 bytes in all) into shared memory at `to`,
  // every thread of the block copying 16 bytes at a time. Read from there, a
  // warp's fragment is one conflict-free 8-byte access a lane.
  static constexpr int kFragmentBytes = HEAD_PAD * HEAD_PAD * 2;
  static_assert(!kRotated || kFragmentBytes <= WARPS * kQueryTerms * kQueryBytes,
                "the fragments fit where the query rows go");
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

  // The power of two that brings |x| <= m near 2^14 (fp16's range, exact to apply).
  static __device__ __forceinline__ float fp16_range_scale(float m) {
    int exponent = 0;
    frexpf(m, &exponent);
    return m > 0.f && isfinite(m) ? ldexpf(1.f, 14 - exponent) : 1.f;
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
            row_valid[r] ? row_offset(p, q_begin, row, kv_head, p.q_token_stride, p.q_head_stride) : 0;
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
      stage_fragments(forward_fragments(p), scratch);
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
      rotate_rows<true, true>(raw, fragments, shift, stages, true, factor, emit);
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
      rotation_products<true, false, true, false>(pairs, pairs, false, fragments, shift, stages, unscaled, emit,
                                                  p.query_dtype == kDtypeBf16);
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
  static constexpr bool kDirectQuery = WGMMA && !PRODUCER && !kRotated && kQuantized;
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

  // A barrier of the warps with query rows (every warp without a producer).
  static __device__ __forceinline__ void consumers_sync() {
    if constexpr (PRODUCER) asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
    else __syncthreads();
  }
  static __device__ __forceinline__ void producer_sync() {
    asm volatile("bar.sync 2, 128;\n" ::: "memory");
  }
  template <int REGS>
  static __device__ __forceinline__ void registers_down() {
    KVC_WGMMA_ASM(asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)));
  }
  template <int REGS>
  static __device__ __forceinline__ void registers_up() {
    KVC_WGMMA_ASM(asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)));
  }

  // One split saw every key (`direct`): the merge's arithmetic for a single
  // split (merge_splits: the sink joins the denominator), the inverse rotation
  // (the host's fragments staged in `scratch`, the block's query rows, no
  // longer read; `early_inverse`: already in the last decoded buffer), and the
  // rows written to `out` in its dtype: `bulk_out`, staged in the decoded
  // buffers and written by bulk copies, a row a lane of the warp's first 16.
  // Every consumer thread calls this.
  static __device__ __forceinline__ void write_output(const Params& p, float (&out)[ND][4],
                                                      const float (&running_max)[2],
                                                      const float (&running_sum)[2], float reference,
                                                      const float (&row_unscale)[2], int q_begin, int row_begin,
                                                      int total_rows, int kv_head, const bool (&row_valid)[2],
                                                      u8* scratch, u8* decoded, bool bulk_out, bool early_inverse) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int element_bytes = p.out_dtype == kDtypeF32 ? 4 : 2;
    u8* const staged = decoded + 16 * (threadIdx.x >> 5) * kDecodedStride;   // bulk_out: this warp's 16 rows
    u8* rows[2];
    float weights[2], factors[2], totals[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_begin + (lane >> 2) + 8 * r;
      const int head = kv_head * p.group + row_head(p, row);
      const long long start =
          row_valid[r] ? row_offset(p, q_begin, row, kv_head, p.out_token_stride, p.out_head_stride) : 0;
      rows[r] = bulk_out ? staged + ((lane >> 2) + 8 * r) * kDecodedStride
                         : static_cast<u8*>(p.out) + start * element_bytes;
      const float sum = sum_over_quad(running_sum[r]);
      const float m = running_max[r] * row_unscale[r];
      const float sink = p.sinks != nullptr && row_valid[r] ? p.sinks[head] : -KVC_INFINITY;
      const float peak = fmaxf(m, sink);
      const float shift = peak == -KVC_INFINITY ? 0.f : peak;
      const float weight = expf(m - shift);
      const float total = sum * weight + (p.sinks != nullptr ? expf(sink - shift) : 0.f);
      // A row that saw nothing (weight 0) adds nothing, whatever its accumulators
      // hold: a select a value (kTrimmed: below, left out where every row of
      // the warp saw something).
      const float factor = reference * weight / total;
      weights[r] = weight;
      totals[r] = total;
      factors[r] = factor;
      if constexpr (!kTrimmed) {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& o = out[n][2 * r + j];
            o = weight != 0.f ? o * factor : 0.f / total;
          }
      }
    }
    // What the inverse rotation's products still multiply each row by.
    float row_factor[2] = {p.out_factor, p.out_factor};
    if constexpr (kTrimmed) {
      if (__all_sync(0xffffffffu, weights[0] != 0.f && weights[1] != 0.f)) {
        if (rotation_shift(p) >= 0) {   // the products' row scaling takes the factors along
#pragma unroll
          for (int r = 0; r < 2; ++r) row_factor[r] *= factors[r];
        } else {
#pragma unroll
          for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) out[n][i] *= factors[i >> 1];
        }
      } else {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1;
            out[n][i] = weights[r] != 0.f ? out[n][i] * factors[r] : 0.f / totals[r];
          }
      }
    }
    const bool staged_fragments = rotation_shift(p) >= 0 && rotation_shift(p) != kGroupShift && !early_inverse;
    // Every consumer is past its last read of the query rows and of the decoded
    // buffers, which the fragments and the staged rows overwrite.
    if (staged_fragments || bulk_out) consumers_sync();
    if (rotation_shift(p) < 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!row_valid[r]) continue;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          if constexpr (KV != KV_INT4 && kTrimmed) {   // the channels in place: a pair a store (even head sizes)
            const int channel = 8 * n + 2 * t;
            if (channel < p.head_size)
              store_output_pair(p.out_dtype, rows[r], channel, out[n][2 * r], out[n][2 * r + 1]);
          } else {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int channel = channel_of(8 * n + 2 * t + j);
              if (channel < p.head_size) store_output(p.out_dtype, rows[r], channel, out[n][2 * r + j]);
            }
          }
        }
      }
    } else {
      const u8* fragments = reinterpret_cast<const u8*>(p.rotation_inv);
      if (early_inverse) {
        fragments = decoded + kLastBufferOffset;
      } else if (staged_fragments) {
        stage_fragments<kConsumerThreads>(p.rotation_inv, scratch);
        consumers_sync();
        fragments = scratch;
      }
      // The inverse rotation: the Sylvester factor across groups first, then the products.
      butterflies_across_groups(out, p.rotation_stages);
      auto store_tile = [&](int n, const float (&y)[4]) {   // n tile n of rows g, g + 8
        const int channel = 8 * n + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (row_valid[r] && channel < p.head_size) store_output_pair(p.out_dtype, rows[r], channel, y[2 * r], y[2 * r + 1]);
      };
      // 16-bit outputs take the rows as one fp16 term: at most 2^-11 relative a
      // value before the rotation mixes them, as much as an fp16 output's own
      // rounding and an eighth of a bf16 one's (tests/gpu/test_attention.py:
      // the bound); fp32 outputs keep two.
      // The float32 calls' build keeps one copy of the products, the low
      // terms' for a float32 output (a 16-bit one would take the high alone).
      if constexpr (kWideRows)
        rotate_rows<true, !kInverseByGroups>(out, fragments, rotation_shift(p), 0, p.out_dtype == kDtypeF32,
                                             row_factor, store_tile);
      else
        rotate_rows<false, !kInverseByGroups>(out, fragments, rotation_shift(p), 0, false, row_factor, store_tile);
    }
    if (bulk_out) {
      fence_proxy_async();   // this lane's stores before the copy engine reads them
      __syncwarp();
      const int row = row_begin + lane;
      if (lane < 16 && row < total_rows) {
        const long long start = row_offset(p, q_begin, row, kv_head, p.out_token_stride, p.out_head_stride);
        bulk_store(static_cast<u8*>(p.out) + 2 * start, staged + lane * kDecodedStride, 2 * p.head_size);
        bulk_stores_read();   // before the block's shared memory goes
      }
    }
  }

  static __device__ __forceinline__ void store_output(int dtype, u8* row, int channel, float v) {
    if (kWideRows && dtype == kDtypeF32) reinterpret_cast<float*>(row)[channel] = v;
    else if (dtype == kDtypeF16) reinterpret_cast<kvc::half*>(row)[channel] = kvc::from_float<kvc::half>(v);
    else reinterpret_cast<kvc::bfloat16*>(row)[channel] = kvc::from_float<kvc::bfloat16>(v);
  }

  static __device__ __forceinline__ void store_output_pair(int dtype, u8* row, int channel, float v0, float v1) {
    if (kWideRows && dtype == kDtypeF32)
      *reinterpret_cast<float2*>(reinterpret_cast<float*>(row) + channel) = make_float2(v0, v1);
    else if (dtype == kDtypeF16) *reinterpret_cast<u32*>(reinterpret_cast<u16*>(row) + channel) = pack_half2(v0, v1);
    else *reinterpret_cast<u32*>(reinterpret_cast<u16*>(row) + channel) = pack_bf162(v0, v1);
  }

  // The producer warpgroup's loop: tile's raw stage (copies issued STAGES - 1
  // tiles ahead) decoded into buffer tile % kDecodedBuffers once the consumers
  // are done with that buffer's previous tile. One barrier of the producer's
  // own a tile: every stager's copies of the tile have landed, and every
  // stager is done decoding tile - 1, whose raw stage is refilled next.
  static __device__ __forceinline__ void produce(const Params& p, u8* smem, int kv_head, int key_lo, int key_hi,
                                                 int block_shift, const int* table, int num_tiles,
                                                 typename Pages::PageWindow& window, u8* full, u8* empty,
                                                 int stager) {
    u8* const decoded = smem + kDecodedOffset;
    if constexpr (DIRECT) {
      produce_direct(p, smem, kv_head, key_lo, key_hi, block_shift, table, num_tiles, window, full, empty, stager);
      return;
    }
    // Tile t's copies are the t-th group: the first STAGES went out before the
    // loop, and each pass from the second on commits one group (tile t - 1 +
    // STAGES, or none near the end). Before tile t's wait, STAGES groups are
    // committed at t = 0 and STAGES + t - 1 after: all but STAGES - 1, then
    // STAGES - 2, of them must have landed.
#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
      if (tile == 0) cp_async_wait<STAGES - 1>();
      else cp_async_wait<STAGES - 2>();
      producer_sync();
      if (tile >= 1) {
        const int next = tile - 1 + STAGES;
        if (next < num_tiles) {
          const int next_base = key_lo + next * TILE;
          Pages::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
          stage_tile(p, smem, next % STAGES, kv_head, next_base, key_lo, key_hi, block_shift, window, stager);
        }
        cp_async_commit();
      }
      const int buffer = tile % kDecodedBuffers;
      if (tile >= kDecodedBuffers) mbarrier_wait(empty + 8 * buffer, (tile / kDecodedBuffers - 1) & 1);
      decode_tile(smem + (tile % STAGES) * kStageBytes, decoded + buffer * kDecodedBufferBytes, stager);
      mbarrier_arrive(full + 8 * buffer);
    }
    cp_async_wait<0>();
  }

  // DIRECT: tile t's copies go straight into decoded buffer t % kDecodedBuffers,
  // once the consumers are done with that buffer's previous tile, as the t-th
  // cp.async group (the first STAGES went out before the loop, as raw tiles
  // do). Pass t (from STAGES on) issues tile t, or an empty group near the end,
  // then waits until all but the newest STAGES groups have landed: tile t -
  // STAGES is in; each stager makes its own copies' writes visible to the
  // async proxy (the wgmma operands) and arrives on that tile's "full" barrier.
  // Buffers t - STAGES .. t are in flight then, and the consumers hold two
  // more (a tile's scores, the tile before's output products): STAGES + 3.
  static __device__ __forceinline__ void produce_direct(const Params& p, u8* smem, int kv_head, int key_lo,
                                                        int key_hi, int block_shift, const int* table, int num_tiles,
                                                        typename Pages::PageWindow& window, u8* full, u8* empty,
                                                        int stager) {
#pragma unroll 1
    for (int tile = STAGES; tile < num_tiles + STAGES; ++tile) {
      if (tile < num_tiles) {
        const int buffer = tile % kDecodedBuffers;
        if (tile >= kDecodedBuffers) mbarrier_wait(empty + 8 * buffer, (tile / kDecodedBuffers - 1) & 1);
        const int base = key_lo + tile * TILE;
        Pages::slide_window(window, p, table, base >> block_shift, key_lo, key_hi, block_shift);
        stage_tile(p, smem, buffer, kv_head, base, key_lo, key_hi, block_shift, window, stager);
      }
      cp_async_commit();
      cp_async_wait<STAGES>();
      fence_proxy_async();
      mbarrier_arrive(full + 8 * ((tile - STAGES) % kDecodedBuffers));
    }
  }

  static __device__ void run(const Params& p, int block_shift) {
    extern __shared__ __align__(1024) u8 smem[];
    if constexpr (kSwizzled) {   // the swizzled layouts' premise: the address bits they XOR in are the row's
      if (static_cast<u32>(__cvta_generic_to_shared(smem)) % 1024 != 0) __trap();
    }
    if (!kRotated && p.rotation_shift >= 0) __trap();   // a rotated cache in a build without the rotation
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int seq = p.tiles[2 * blockIdx.y], row_tile = p.tiles[2 * blockIdx.y + 1];
    const int kv_head = blockIdx.z;
    const bool producer = PRODUCER && warp >= kConsumerWarps;   // uniform across a warpgroup
    const int split = blockIdx.x;

    const int q_begin = p.cu_seqlens_q[seq];
    const int q_len = p.cu_seqlens_q[seq + 1] - q_begin;
    const int seq_len = min(p.seq_lens[seq], p.table_width * p.block_size);
    const int block_row_begin = row_tile * kRows;
    const int total_rows = q_len * p.group;
    // Ids from a device, unchecked: a tile that means nothing writes nothing.
    if (q_len <= 0 || seq_len < q_len || block_row_begin >= total_rows || q_begin < 0 ||
        q_begin + q_len > p.num_tokens)
      return;
    const int context = seq_len - q_len;
    const int block_last_row = min(block_row_begin + kRows, total_rows) - 1;
    const int first_position = context + row_token(p, block_row_begin);
    const int last_position = context + row_token(p, block_last_row);
    const int key_lo = max(p.window ? first_position - p.window + 1 : 0, split * p.split_tokens);
    const int key_hi = min(last_position + 1, (split + 1) * p.split_tokens);
    const int* table = p.block_table + static_cast<long long>(seq) * p.table_width;

    // This warp's rows g (r = 0) and g + 8 (r = 1).
    const int row_begin = block_row_begin + 16 * warp;
    int row_position[2];
    bool row_valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_begin + g + 8 * r;
      row_valid[r] = !producer && row < total_rows;
      row_position[r] = context + row_token(p, row);
    }
    int min_position = row_valid[0] ? row_position[0] : 0x7fffffff;
    int max_position = row_valid[1] ? row_position[1] : row_valid[0] ? row_position[0] : -1;
    for (int offset = 16; offset >= 4; offset /= 2) {
      min_position = min(min_position, __shfl_xor_sync(0xffffffffu, min_position, offset));
      max_position = max(max_position, __shfl_xor_sync(0xffffffffu, max_position, offset));
    }
    if constexpr (WGMMA) {   // a warpgroup's products are one instruction: it skips tiles as a whole
      const int group_begin = block_row_begin + 64 * (warp >> 2);
      const int group_last = min(group_begin + 64, total_rows) - 1;
      min_position = context + row_token(p, group_begin);
      max_position = group_last >= group_begin ? context + row_token(p, group_last) : -1;
    }

    // The first tiles' copies go out before the query is read: the two
    // latencies overlap (a short prompt's block sees only a tile or two).
    const int num_tiles = key_hi > key_lo ? (key_hi - key_lo + TILE - 1) / TILE : 0;
    // Plain caches: raw stages STAGES - 1 tiles ahead, the products read the
    // stage. Quantized caches: raw stages STAGES tiles ahead, and tile + 1 is
    // decoded into the other decoded buffer while tile's products run, so one
    // barrier a tile orders everything: after it, every thread is done with
    // tile - 1's products (the buffer decoded next) and with decoding tile
    // (whose raw stage is refilled next), and tile + 1's copies have landed.
    constexpr int kAhead = kDecoded ? STAGES : STAGES - 1;
    // PRODUCER: the decoded buffers' barriers, and only the producer stages.
    u8* const full = smem + kBarrierOffset;
    u8* const empty = full + 8 * kDecodedBuffers;
    u8* const query_barrier = smem + kQueryBarrierOffset;
    u8* const decoded = smem + kDecodedOffset;
    u8* const query_area = decoded + kDecodedBytes;
    // Bulk rows (see bulk_rows): the block's query rows, the rotation's
    // fragments (to `query_area`, as stage_fragments would; in 16-dim groups
    // too, which are otherwise read from global memory, a latency a group of n
    // tiles) and, where the output is written here and the block has fewer
    // tiles than decoded buffers, the inverse rotation's (to the last buffer),
    // all on query_barrier: every thread arrives once, announcing its copies' bytes.
    const bool bulk_query = bulk_rows(p.query_in, p.q_token_stride, p.q_head_stride, p.query_dtype, p.head_size);
    const bool bulk_out =
        p.direct && bulk_rows(p.out, p.out_token_stride, p.out_head_stride, p.out_dtype, p.head_size);
    const bool early_inverse =
        kEarlyInverse && bulk_query && p.direct && rotation_shift(p) >= 0 && num_tiles < kDecodedBuffers;
    if constexpr (PRODUCER) {
      if (threadIdx.x < kDecodedBuffers) {
        mbarrier_init(full + 8 * threadIdx.x, kStagers);
        mbarrier_init(empty + 8 * threadIdx.x, kConsumerThreads);   // every consumer thread, after its reads
      }
    }
    if (WGMMA && bulk_query && threadIdx.x == 0) mbarrier_init(query_barrier, kThreads);
    if (PRODUCER || (WGMMA && bulk_query)) __syncthreads();
    if (WGMMA && bulk_query) {
      const int row = block_row_begin + threadIdx.x;   // the row this thread copies
      const bool copies_row = threadIdx.x < kRows && row < total_rows;
      const u32 row_bytes = 2 * p.head_size;
      // The fragments ([KC][ND][32 lanes] x 8 bytes) whole, by the last thread;
      // in 16-dim groups only the runs that hold nonzeros (k step ks: n tiles
      // 2 ks and 2 ks + 1, 512 bytes), by the last KC threads (the inverse's:
      // the KC before them).
      const int parts = rotation_shift(p) == kGroupShift ? KC : 1;
      const int slot = kThreads - 1 - threadIdx.x;
      const bool forward_part = rotation_shift(p) >= 0 && slot < parts;
      const bool inverse_part = early_inverse && slot >= parts && slot < 2 * parts;
      u32 part_bytes = 0, part_offset = 0;
      if (forward_part || inverse_part) {
        const int part = forward_part ? slot : slot - parts;
        part_bytes = parts == 1 ? HEAD_PAD * HEAD_PAD * 2 : 2 * 32 * 8;
        part_offset = parts == 1 ? 0 : (part * ND + 2 * part) * 32 * 8;
      }
      mbarrier_arrive_expect(query_barrier, (copies_row ? row_bytes : 0u) + part_bytes);
      if (copies_row) {
        const long long start = row_offset(p, q_begin, row, kv_head, p.q_token_stride, p.q_head_stride);
        bulk_copy(decoded + threadIdx.x * kDecodedStride, static_cast<const u8*>(p.query_in) + 2 * start, row_bytes,
                  query_barrier);
      }
      if (part_bytes != 0) {
        const u8* source = reinterpret_cast<const u8*>(forward_part ? forward_fragments(p) : p.rotation_inv);
        u8* target = forward_part ? query_area : decoded + kLastBufferOffset;
        bulk_copy(target + part_offset, source + part_offset, part_bytes, query_barrier);
      }
    }
    const int stager = PRODUCER ? threadIdx.x - kConsumerThreads : threadIdx.x;
    typename Pages::PageWindow window{};
    if (!PRODUCER || producer) {
      window = Pages::first_window(p, table, key_lo, key_hi, block_shift);
#pragma unroll
      for (int s = 0; s < kAhead; ++s) {
        if (s < num_tiles) {
          Pages::slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
          stage_tile(p, smem, s, kv_head, key_lo + s * TILE, key_lo, key_hi, block_shift, window, stager);
        }
        cp_async_commit();
      }
    }
    // The query rows as the score product's A operand, high and low fp16 halves
    // in this warp's part of shared memory ([part][row][logical dim], rows
    // padded like decoded ones), read back with ldmatrix once per tile: held in
    // registers they would take 8 HEAD_PAD / 16 of them for the whole loop. Each
    // row is scaled by a power of two that brings its largest |q| near 2^14
    // (exact), undone on the scores. Lane (g, t) loads rows g and g + 8, dims
    // 16 kc + 8 h + 2t (+1): the pairs of the A fragments it will hold.
    u8* const query_rows = query_area + (WGMMA ? (warp >> 2) * kWarpgroupQueryBytes : warp * 2 * kQueryBytes);
    float row_unscale[2];
    // PRODUCER: the score products take the query from registers (rs_k): the
    // high parts as the warp's A fragments, register 2h + r of k step kc holding
    // row g + 8r, dims 16 kc + 8h + 2t (+1), so shared memory serves only K and V.
    u32 query_fragments[PRODUCER ? KC : 1][4];
    if (kDirectQuery && bulk_query) {
      mbarrier_wait(query_barrier, 0);
      direct_query(p, decoded, query_rows, row_valid, row_unscale);
      fence_proxy_async();   // read by wgmma after the loop's first barrier
      __syncwarp();
    } else {
      float values[KC][2][2][2];   // [kc][h][r][j]
      float pending;               // the softmax scale / norm the values still lack
      load_query(p, q_begin, row_begin, kv_head, row_valid, query_area, bulk_query ? decoded : nullptr, query_barrier,
                 values, pending);
      if constexpr (PRODUCER) {   // past the block's last barrier: the roles part
        if (producer) {
          registers_down<kProducerRegs>();
          produce(p, smem, kv_head, key_lo, key_hi, block_shift, table, num_tiles, window, full, empty, stager);
          return;
        }
        registers_up<kConsumerRegs>();
      }
      float largest[2] = {0.f, 0.f};
#pragma unroll
      for (int kc = 0; kc < KC; ++kc)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int j = 0; j < 2; ++j) largest[r] = fmaxf(largest[r], fabsf(values[kc][h][r][j]));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float up = fp16_range_scale(max_over_quad(largest[r]));
        row_unscale[r] = pending / up;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float v0 = values[kc][h][r][0] * up, v1 = values[kc][h][r][1] * up;
            const u32 high = pack(v0, v1);
            const float2 rounded = unpack(high);
            const int dim = 16 * kc + 8 * h + 2 * t;
            if constexpr (PRODUCER) {
              query_fragments[kc][2 * h + r] = high;
            } else if constexpr (WGMMA) {   // the warpgroup's rows as core matrices, the high part alone
              *reinterpret_cast<u32*>(query_rows + kvc_wgmma::core_offset(16 * (warp & 3) + g + 8 * r, dim,
                                                                          HEAD_PAD)) = high;
            } else {
              u8* at = query_rows + (g + 8 * r) * kDecodedStride + 2 * dim;
              *reinterpret_cast<u32*>(at) = high;
              *reinterpret_cast<u32*>(at + kQueryBytes) = pack(v0 - rounded.x, v1 - rounded.y);
            }
          }
        }
      }
      if constexpr (WGMMA && !PRODUCER) fence_proxy_async();   // read by wgmma after the loop's first barrier
      __syncwarp();
    }
    const float exp_scale[2] = {row_unscale[0] * kLog2e, row_unscale[1] * kLog2e};
    // ldmatrix addresses of this lane: Q matrices rows 0-7 / 8-15 x dims +0 / +8.
    const u8* const query_lane = query_rows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kDecodedStride + 16 * (lane >> 4);

    float out[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[n][i] = 0.f;
    float running_max[2] = {-KVC_INFINITY, -KVC_INFINITY}, running_sum[2] = {0.f, 0.f};
    float reference = kDecoded && !kUnitScales ? 0.f : 1.f;   // R: the V scale the accumulators are in

    if (!PRODUCER && kDecoded && num_tiles > 0) {
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      decode_tile(smem, decoded, stager);
    }
    // A tile's softmax, its scores in `score` (in place), its decoded scales: the
    // running maxima, sums and reference updated, P in p_high (bf16: and p_low);
    // returns the factors of the accumulators' rows g and g + 8 for the tile.
    auto softmax_tile = [&](float (&score)[NT][4], const float* key_scales, const float* value_scales, int base,
                            u32 (&p_high)[NT][2], u32 (&p_low)[kSplitP ? NT : 1][2]) {
      // Scores in "row units" (z = q_up . k x key scale: the row's true logit
      // times 2^k, the row's query scaling, exact), capped and masked; the tile's
      // maximum per row. The softmax then works in log2 units through one FMA a
      // score: p = 2^(z c - m c), c = 2^-k log2(e).
      const bool all_visible = base + TILE <= key_hi && base + TILE - 1 <= min_position &&
                               (p.window == 0 || base > max_position - p.window);
      float tile_max[2] = {-KVC_INFINITY, -KVC_INFINITY};
      // Uniform across the warp: two code paths, not selects on every score.
      if (all_visible)
        row_unit_scores<false>(score, key_scales, p, base, t, key_hi, row_position, row_valid, row_unscale, tile_max);
      else
        row_unit_scores<true>(score, key_scales, p, base, t, key_hi, row_position, row_valid, row_unscale, tile_max);
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
        probabilities<false>(score, value_scales, to_reference, exp_scale, shift, t, p_high, p_low, tile_sum);
      else
        probabilities<true>(score, value_scales, to_reference, exp_scale, shift, t, p_high, p_low, tile_sum);
#pragma unroll
      for (int r = 0; r < 2; ++r) running_sum[r] = running_sum[r] * alpha[r] + tile_sum[r];
      return make_float2(alpha[0] * rescale_values, alpha[1] * rescale_values);
    };
    auto rescale_out = [&](float2 factor) {
      if (!__all_sync(0xffffffffu, factor.x == 1.f && factor.y == 1.f)) {
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          out[n][0] *= factor.x;
          out[n][1] *= factor.x;
          out[n][2] *= factor.y;
          out[n][3] *= factor.y;
        }
      }
    };
    // wgmma: a tile's score products (the query rows and its decoded keys, both
    // from shared memory), issued and committed.
    auto issue_scores = [&](float (&score)[NT][4], const u8* keys) {
      if constexpr (WGMMA) {
        kvc_wgmma::hold(score);
        kvc_wgmma::fence();
        // k step kc: dims 16 kc.., 256 bytes on (a descriptor counts 16-byte
        // units); swizzled, 32 bytes within a column of kSwizzleBytes / 2 dims
        // (swizzled_offset), kKeySteps k steps a column.
        constexpr int kKeySteps = kSwizzled ? kSwizzleBytes / 32 : 1;
        const kvc_wgmma::u64 key_operand = kSwizzled
                                               ? kvc_wgmma::descriptor<kSwizzleBytes>(keys, 16, 8 * kSwizzleBytes)
                                               : kvc_wgmma::descriptor(keys, 128, 16 * HEAD_PAD);
        if constexpr (PRODUCER) {   // the query from registers
#pragma unroll
          for (int kc = 0; kc < KC; ++kc)
            kvc_wgmma::Products<TILE, kBf16>::rs_k(
                score, query_fragments[kc],
                key_operand +
                    (kSwizzled ? (kc / kKeySteps * TILE * kSwizzleBytes + kc % kKeySteps * 32) / 16 : 16 * kc));
        } else {   // the query rows from shared memory
          const kvc_wgmma::u64 query_operand = kvc_wgmma::descriptor(query_rows, 128, 16 * HEAD_PAD);
#pragma unroll
          for (int kc = 0; kc < KC; ++kc)
            kvc_wgmma::Products<TILE, kBf16>::ss(score, query_operand + 16 * kc, key_operand + 16 * kc);
        }
        kvc_wgmma::commit();
      }
    };
    // wgmma: a tile's output products (P from registers, the V rows of its decoded
    // buffer), issued (the caller commits them).
    auto issue_values = [&](const u32 (&p_high)[NT][2], const u8* values) {
      if constexpr (WGMMA) {
        kvc_wgmma::hold(out);
        kvc_wgmma::fence();
        // B = V rows 16 j.. (K, tokens) x dims (N): core matrices 128 bytes apart along the dims.
        // Swizzled: columns TILE x kSwizzleBytes apart, 8-token groups 8 x kSwizzleBytes.
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
    if constexpr (PRODUCER) {
      // FlashAttention-3's order within a warpgroup: tile's score products, then
      // tile - 1's output products, both in flight while tile's softmax runs once
      // its scores are in (P of tile - 1 and tile in separate registers). No
      // branch around a product (ptxas would serialise them all): a tile this
      // warpgroup does not see runs too, its scores all masked.
      u32 p_previous[NT][2], p_low[1][2];
      const u8* previous_values = decoded;
      for (int tile = 0; tile < num_tiles; ++tile) {
        mbarrier_wait(full + 8 * (tile % kDecodedBuffers), (tile / kDecodedBuffers) & 1);
        const u8* keys = decoded + (tile % kDecodedBuffers) * kDecodedBufferBytes;
        const u8* values = keys + kDecodedTensorBytes;
        const float* key_scales = reinterpret_cast<const float*>(keys + 2 * kDecodedTensorBytes);
        const float* value_scales = key_scales + TILE;
        float score[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) score[n][i] = 0.f;
        issue_scores(score, keys);
        if (tile > 0) issue_values(p_previous, previous_values);
        kvc_wgmma::commit();   // (empty at tile 0: complete at once)
        kvc_wgmma::wait<1>();   // the scores; the output products run on
        kvc_wgmma::hold(score);
        u32 p_current[NT][2];
        const float2 factor = softmax_tile(score, key_scales, value_scales, key_lo + tile * TILE, p_current, p_low);
        kvc_wgmma::wait<0>();
        kvc_wgmma::hold(out);
        rescale_out(factor);   // (no product in flight) for tile's output products, issued next
        if (tile >= 1) mbarrier_arrive(empty + 8 * ((tile - 1) % kDecodedBuffers));   // done with tile - 1's buffer
#pragma unroll
        for (int n = 0; n < NT; ++n) p_previous[n][0] = p_current[n][0], p_previous[n][1] = p_current[n][1];
        previous_values = values;
      }
      if (num_tiles > 0) {
        issue_values(p_previous, previous_values);
        kvc_wgmma::commit();
      }
    }
    for (int tile = 0; tile < num_tiles && !PRODUCER; ++tile) {
      cp_async_wait<STAGES - 2>();   // quantized: tile + 1 landed; plain: tile
      __syncthreads();
      const int next = tile + kAhead;
      if (next < num_tiles) {
        const int next_base = key_lo + next * TILE;
        Pages::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
        stage_tile(p, smem, next % STAGES, kv_head, next_base, key_lo, key_hi, block_shift, window, stager);
      }
      cp_async_commit();   // (an empty group at the end keeps wait_group's count in step)
      u8* const next_decoded = decoded + ((tile + 1) % kDecodedBuffers) * kDecodedBufferBytes;
      if (!WGMMA && kQuantized && tile + 1 < num_tiles)
        decode_tile(smem + ((tile + 1) % STAGES) * kStageBytes, next_decoded, stager);
      const u8* keys = kDecoded ? decoded + (tile % kDecodedBuffers) * kDecodedBufferBytes
                                : smem + (tile % STAGES) * kStageBytes;
      const u8* values = keys + (kDecoded ? kDecodedTensorBytes : kRawTensorBytes);
      const float* key_scales = reinterpret_cast<const float*>(keys + 2 * kDecodedTensorBytes);
      const float* value_scales = key_scales + TILE;
      const int base = key_lo + tile * TILE;
      // Tiles no row of this warp (warpgroup) sees (causal, window): nothing to do.
      const bool unseen = max_position < 0 || base > max_position ||
                          (p.window != 0 && base + TILE - 1 <= min_position - p.window);

      // Scores: thread (g, t) holds rows g (c0, c1) and g + 8 (c2, c3), tokens 8 n + 2t (+1).
      float score[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) score[n][i] = 0.f;
      if constexpr (WGMMA) {
        // Issued, then the next tile decoded while they run.
        if (!unseen) issue_scores(score, keys);
        if (tile + 1 < num_tiles) decode_tile(smem + ((tile + 1) % STAGES) * kStageBytes, next_decoded, stager);
        kvc_wgmma::wait<0>();   // these scores, and the previous tile's output products
        kvc_wgmma::hold(score);
        kvc_wgmma::hold(out);
      }
      if (unseen) continue;
#pragma unroll
      for (int kc = 0; kc < KC && !WGMMA; kc += 2) {
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

      u32 p_high[NT][2], p_low[kSplitP ? NT : 1][2];
      rescale_out(softmax_tile(score, key_scales, value_scales, base, p_high, p_low));
      // Output: k step j is tokens 16 j .. 16 j + 15, i.e. score tiles 2j, 2j + 1.
      if constexpr (WGMMA) {   // waited for by the next tile's wait (or after the loop)
        issue_values(p_high, values);
        kvc_wgmma::commit();
      }
#pragma unroll
      for (int j = 0; j < TILE / 16 && !WGMMA; ++j) {
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
    if constexpr (WGMMA) {
      kvc_wgmma::wait<0>();
      kvc_wgmma::hold(out);
    }
    cp_async_wait<0>();
    if constexpr (kProbabilityLift != 1.f) reference *= 1.f / kProbabilityLift;   // the accumulators' unit (exact)

    if (p.direct) {
      write_output(p, out, running_max, running_sum, reference, row_unscale, q_begin, row_begin, total_rows, kv_head,
                   row_valid, query_area, decoded, bulk_out, early_inverse);
      return;
    }
    // Partial state of this split: max and sum per row, the accumulators times R.
    const long long split_rows = static_cast<long long>(split) * p.num_tokens;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = sum_over_quad(running_sum[r]);
      if (!row_valid[r]) continue;
      const int row = row_begin + g + 8 * r;
      const long long index = part_index(p, split_rows, q_begin, row, kv_head);
      if (t == 0) store_part_stats(p, index, running_max[r] * row_unscale[r], sum);   // 2^-k: exact
      float* destination = p.part_out + index * p.head_size;
#pragma unroll
      for (int n = 0; n < ND; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int channel = channel_of(8 * n + 2 * t + j);
          if (channel < p.head_size) destination[channel] = out[n][2 * r + j] * reference;
        }
      }
    }
  }
};

}  // namespace kvc_attn
