// Prefill's compile-time shape: the build's template arguments and -D choices,
// the block's warps and rows, the shared-memory layout (raw stages, decoded
// buffers, query rows, barriers) and the operand types, with the checks on
// them. Every other prefill_*.cuh piece takes these through one PrefillTraits
// argument (prefill.cuh), naming what it uses in its opening using-list.
#pragma once

#include "attention.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVC_FP8_CONVERT 1   // cvt.rn.f16x2.e4m3x2
#else
#define KVC_FP8_CONVERT 0
#endif

#ifndef KVC_SWIZZLE
#define KVC_SWIZZLE 0   // PrefillTraits::kSwizzled (the launcher's PrefillKernel.swizzled)
#endif
#ifndef KVC_ROTATED
#define KVC_ROTATED 1   // 0: no rotation's code at all (PrefillTraits::kRotated; the launcher's PrefillKernel.rotated)
#endif
#ifndef KVC_WIDE_ROWS
#define KVC_WIDE_ROWS 1   // 0: 16-bit query and output rows only (PrefillTraits::kWideRows; PrefillKernel.wide_rows)
#endif
#ifndef KVC_MIN_BLOCKS
#define KVC_MIN_BLOCKS 1   // the launch bounds' blocks a multiprocessor (attention.cu)
#endif
#ifndef KVC_PRODUCER_REGS
#define KVC_PRODUCER_REGS 56   // the fewest with which the producer's loop spills nothing
#endif

namespace kvc_attn {

// The largest power of two, at most `cap`, that divides n.
__host__ __device__ constexpr int largest_pow2_divisor(int n, int cap) {
  return n % cap == 0 || cap == 1 ? cap : largest_pow2_divisor(n, cap / 2);
}

// The ldmatrix loads of a warp's mma operands (the query rows, the decoded
// or staged K and V rows), shared by the query and the tile loop.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* shared_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(shared_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* shared_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(shared_row)));
}

template <int KV_, int HEAD_PAD_, int WARPS_, int TILE_, int STAGES_, int CHUNK_, bool WGMMA_, bool PRODUCER_,
          bool DIRECT_>
struct PrefillTraits {
  static constexpr int KV = KV_, HEAD_PAD = HEAD_PAD_, WARPS = WARPS_, TILE = TILE_, STAGES = STAGES_, CHUNK = CHUNK_;
  static constexpr bool WGMMA = WGMMA_, PRODUCER = PRODUCER_, DIRECT = DIRECT_;
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

  // Trims of a block's bookkeeping (row_token's unsigned division, the output's
  // channel pairs, write_output's selects skipped where no row needs them),
  // taken by quantized caches' builds only: the 12-warp build over 16-bit rows
  // already spills, and the trims shift its register allocation for the worse.
  static constexpr bool kTrimmed = kQuantized;

  // The bulk rows' space (prefill_query.cuh, bulk_rows): the block's query or
  // output rows in the decoded buffers; kEarlyInverse where they leave the
  // last buffer clear and the inverse rotation's fragments fit it.
  static_assert(!WGMMA || kRows * kDecodedStride <= kDecodedBytes, "the staged rows fit the decoded buffers");
  static constexpr int kLastBufferOffset = (kDecodedBuffers - 1) * kDecodedBufferBytes;
  static constexpr bool kEarlyInverse =
      kRows * kDecodedStride <= kLastBufferOffset && HEAD_PAD * HEAD_PAD * 2 <= kDecodedBufferBytes;

  // Fragments independent in 16-dim groups: a rotation whose blocks are 16 dims,
  // or the factor beside the butterflies across groups (the host's rotation_stages).
  // Those few fragments are read from global memory (L1) where they lie.
  static constexpr int kGroupShift = 4;
  // The host's rotation_shift (-1: none), as this build applies it.
  static __device__ __forceinline__ int rotation_shift(const Params& p) { return kRotated ? p.rotation_shift : -1; }
  // The rotation's fragments in shared memory (stage_fragments): HEAD_PAD^2 x 2
  // bytes, staged where the query rows go.
  static constexpr int kFragmentBytes = HEAD_PAD * HEAD_PAD * 2;
  static_assert(!kRotated || kFragmentBytes <= WARPS * kQueryTerms * kQueryBytes,
                "the fragments fit where the query rows go");

  // Quantized caches' builds without a rotation or producer take the bulk
  // query rows into the products' layout as they are (direct_query,
  // prefill_query.cuh).
  static constexpr bool kDirectQuery = WGMMA && !PRODUCER && !kRotated && kQuantized;

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
};

}  // namespace kvc_attn
