// What a decode lane reads of a staged row and the mma operands it builds
// from it: the lane's share of key and value rows, the channel permutations
// that share implies (key_dim_of / value_dim_of), the conversions of cache
// codes to exact fp16 (bf16) fragments, the scale words' parts, and the
// 16-bit packing and transposes of the probabilities. Included by attention.cuh.
#pragma once

#include "decode_traits.cuh"
#include "ptx.cuh"

namespace kvc_attn {

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

template <int KV, int HEAD_PAD, int HEADS, int QUADS, int TILE, int STAGES, int CHUNK>
struct DecodeFragments {
  typedef Traits<KV, HEAD_PAD, HEADS, QUADS, TILE, STAGES, CHUNK> T;
  static constexpr bool kBf16 = T::kBf16;
  static constexpr u32 kOffsetHalf = T::kOffsetHalf;

  // int4: the scale word's low 4 bits are the zero-point, the rest the scale.
  static __device__ __forceinline__ float scale_of(u32 bits) {
    return KV == KV_INT4 ? __uint_as_float(bits & ~0xFu) : __uint_as_float(bits);
  }

  static __device__ __forceinline__ float zero_point_of(u32 bits) { return KV == KV_INT4 ? float(bits & 0xFu) : 0.f; }

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

  // Two values as the products' 16-bit pair (fp16, or bf16 for bf16 caches), the first low.
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
};

}  // namespace kvc_attn
