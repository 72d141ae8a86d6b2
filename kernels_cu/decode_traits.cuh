// The decode kernel's compile-time shape: what one specialisation's template
// arguments make of a warp's rows, the tile's steps and rounds, the formats'
// code offsets and the shared-memory layout of a stage. Included by
// attention.cuh, after the KV codes (KV_*) and the staging choice (KVC_STAGING).
#pragma once

#include "types.cuh"

namespace kvc_attn {

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

  // A warp's rows: 4 a quad. The score product takes one quad at a time (its 8
  // columns: each row's high and low query halves); the output product takes
  // two quads a column tile, or, with an odd number of quads, the last quad's
  // probabilities as high and low halves (kLowSlot, column j = 1 of the last
  // tile). Either way a lane's accumulators belong to the rows it computes the
  // softmax of.
  static constexpr int kRows = 4 * QUADS;
  static constexpr int kColumnTiles = (QUADS + 1) / 2;   // N tiles of the output product
  static constexpr bool kLowSlot = QUADS % 2 == 1;
  // 16-token steps a softmax round (the loop over a tile's keys): a single quad
  // takes the tile's steps in one round, more quads a step a round.
  static constexpr int kRoundSteps = QUADS == 1 ? TILE / 16 : 1;
  static_assert(TILE % (16 * kRoundSteps) == 0, "whole rounds a tile");

  // Number formats. Code offsets: conversions leave OFFSET + code in fp16 (int4:
  // the nibble under 0x6400 = 1024; int8: the biased byte under 0x6400 = 1024 +
  // 128), exact; scores subtract OFFSET (and the zero-point) once per score,
  // value codes before the output product. fp8 and plain caches have none.
  static constexpr bool kQuantized = KV == KV_INT4 || KV == KV_INT8 || KV == KV_FP8;
  static constexpr bool kOffset = KV == KV_INT4 || KV == KV_INT8;
  static constexpr u32 kOffsetHalf = KV == KV_INT8 ? 0x6480u : 0x6400u;   // 1152 or 1024 in fp16
  static constexpr float kOffsetValue = KV == KV_INT8 ? 1152.f : 1024.f;
  // fp8 codes enter the products as e4m3 * 2^-8 (fp8_pair): scales carry the 2^8.
  static constexpr float kCodeUnit = KV == KV_FP8 ? 256.f : 1.f;
  // int4 codes enter the products as OFFSET + code for the low nibble of each
  // byte and OFFSET + 16 code for the high one (no shift needed to place it):
  // logical dims 16 kc + 8.. 15 of the keys (the query there is divided by 16)
  // and output rows g + 8 of the values (the sums there are divided by 16).
  static constexpr float kHighNibble = KV == KV_INT4 ? 16.f : 1.f;

  // What one lane reads of a token's row in shared memory: a key row is read by
  // the 4 lanes t of a token, kKeyWords 32-bit words each, in vectors of
  // kKeyVector words (vector i of lane t at word (4 i + t) kKeyVector); a value
  // row by the 8 lanes g, kValueUnits 16-bit units each, in vectors of
  // kValueVector units (vector i of lane g at unit (8 i + g) kValueVector;
  // int4 at d = 96 loads its 3 units otherwise: DecodeFragments::kSplitValues).
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

}  // namespace kvc_attn
