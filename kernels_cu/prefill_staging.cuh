// Tiles of the paged cache into shared memory: the copies (cp.async, a piece
// of a row a copy: stage_tile, and for DIRECT builds straight into the
// products' layout: stage_direct) and the decoding pass that turns a raw
// stage into the fp16 rows and float scales the products read (decode_tile).
// Whoever stages (every thread, or the producer warpgroup: kStagers threads)
// calls these with its index among the stagers.
#pragma once

#include "prefill_traits.cuh"

namespace kvc_attn {

// a * b + c on fp16 pairs, one rounding (exact wherever the result is representable).
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

template <class Ktraits>
struct PrefillStaging : Ktraits {
  using Ktraits::KV;
  using Ktraits::HEAD_PAD;
  using Ktraits::TILE;
  using Ktraits::STAGES;
  using Ktraits::CHUNK;
  using Ktraits::WGMMA;
  using Ktraits::PRODUCER;
  using Ktraits::DIRECT;
  using Ktraits::kStagers;
  using Ktraits::kQuantized;
  using Ktraits::kDecoded;
  using Ktraits::kRowBytes;
  using Ktraits::kRawStride;
  using Ktraits::kRawTensorBytes;
  using Ktraits::kRawScaleBytes;
  using Ktraits::kStageBytes;
  using Ktraits::kDecodedOffset;
  using Ktraits::kDecodedBufferBytes;
  using Ktraits::kDecodedTensorBytes;
  using Ktraits::kSwizzled;
  using Ktraits::kSwizzleBytes;
  using Ktraits::kFp8Convert;
  using Ktraits::kCodeUnit;
  using Ktraits::tile_offset;
  using Ktraits::decoded_at;
  typedef typename Ktraits::Pages Pages;

  // The keys a block streams and who stages them: tiles of TILE keys from `lo`
  // (key_lo), below `hi`, of KV head `head`, through a window over the
  // sequence's `table`; num_tiles of them; `stager`: this thread's index
  // among the stagers.
  struct Keys {
    const int* table;
    int head, lo, hi, block_shift, num_tiles, stager;
    typename Pages::PageWindow window;
  };

  // Tile `tile`'s copies into stage (DIRECT: decoded buffer) `stage`, the
  // window first slid to its first page.
  static __device__ __forceinline__ void copy_tile(const Params& p, u8* smem, Keys& keys, int tile, int stage) {
    const int base = keys.lo + tile * TILE;
    Pages::slide_window(keys.window, p, keys.table, base >> keys.block_shift, keys.lo, keys.hi, keys.block_shift);
    stage_tile(p, smem, stage, keys.head, base, keys.lo, keys.hi, keys.block_shift, keys.window, keys.stager);
  }

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
};

}  // namespace kvc_attn
