// Paged attention on MFMA (AMD CDNA: gfx90a, gfx942), decode and prefill alike:
// one 64-lane wave a block serves one row tile of one sequence and KV head (16
// query rows: (token, head in the group) pairs, the GQA group next to each other)
// over one split of its keys, 16 keys a step, and writes the split's partial
// softmax state; merge.hip combines the splits (and the sinks) and rotates back.
//
// Specialised by -D constants (the launcher's MfmaKernel.defines):
//   KVC_MFMA_KV   attention.cuh's KV_* codes (int4, int8, fp8, fp16 rows, bf16 rows)
//   KVC_HEAD_PAD  the head size rounded up to 16 (the products' depth steps)
//
// The arithmetic (kernels_cu/params.cuh's fields; the query comes rotated and
// scaled, in float32, from the rotate kernel):
//   S^T = K Q^T: A = 16 keys x 16 channels of a tile, B = the query rows; a
//     lane's result, keys 4g..4g+3 of row l%16 (g = l/16), is already the B
//     operand P^T of the value product, so probabilities never leave registers.
//   O^T = V^T P^T: A = 16 channels x 16 keys, the value tile transposed in LDS.
//   Quantized tiles enter as integer codes minus the zero-point (int4), codes
//   (int8) or e4m3 values (fp8), all exact in fp16. A key's K scale multiplies
//   its score after the product; its V scale, relative to the tile's largest
//   (which multiplies the product's result), multiplies its probability before
//   the value product. No term is summed apart from the codes it belongs to, so
//   no rounding gathers over the context into a common offset of every channel.
//   The query enters as fp16 terms (bf16 terms for bf16 rows) of a row scaled
//   by a power of two: two terms give 22 bits, three bf16 terms 24.
#include "hip_compat.h"
#include "mfma.h"
#include "params.cuh"

namespace kvc_mfma_attention {

using kvc_attn::Params;
using kvc_mfma::bf16x4;
using kvc_mfma::f16x4;
using kvc_mfma::f32x4;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

enum { KV_INT4 = 0, KV_INT8 = 1, KV_FP8 = 2, KV_F16 = 3, KV_BF16 = 4 };   // attention.cuh's codes

template <int KV, int HEAD_PAD>
struct Traits {
  static_assert(HEAD_PAD % 16 == 0 && HEAD_PAD >= 32 && HEAD_PAD <= 256, "head sizes 32 .. 256, padded to 16");
  static constexpr int kSteps = HEAD_PAD / 16;            // 16-channel steps of a product
  static constexpr int kKeys = 16;                        // keys a step
  static constexpr int kRows = 16;                        // query rows a tile
  static constexpr bool kQuantized = KV == KV_INT4 || KV == KV_INT8 || KV == KV_FP8;
  static constexpr bool kBf16 = KV == KV_BF16;
  static constexpr int kQueryTerms = kBf16 ? 3 : 2;
  // u16 elements a staged key row / value column; +4 keeps a lane's 8-byte reads
  // aligned and puts consecutive rows in different banks.
  static constexpr int kKeyPitch = HEAD_PAD + 4;
  static constexpr int kValuePitch = kKeys + 4;
};

template <int KV, int HEAD_PAD>
struct Shared {
  typedef Traits<KV, HEAD_PAD> T;
  u16 keys[T::kKeys * T::kKeyPitch];       // [key][channel], fp16 (bf16 for bf16 rows) bits
  u16 values[HEAD_PAD * T::kValuePitch];   // [channel][key]
  float key_step[T::kKeys], value_step[T::kKeys];
  int key_zero[T::kKeys], value_zero[T::kKeys];
  long long key_row[T::kKeys], value_row[T::kKeys];   // byte offsets of each key's rows, -1 outside the split
  int broken_value[T::kKeys];              // 16-bit rows: the key's value row held a NaN or inf
};

template <bool FIRST, class A, class B>
struct Pick { typedef A type; };
template <class A, class B>
struct Pick<false, A, B> { typedef B type; };

__device__ __forceinline__ void wave_sync() { kvc::sync_lanes(~0ull); }

// float -> fp16 bits, nearest even: the hardware's conversion on AMD (the software
// one, bit-exact with PTX for NaN payloads too, serves the emulated build).
__device__ __forceinline__ u16 half_bits(float x) {
#if defined(__HIPCC__)
  const _Float16 half = static_cast<_Float16>(x);
  u16 bits;
  __builtin_memcpy(&bits, &half, sizeof(bits));
  return bits;
#else
  return kvc::f16_bits_of(x);
#endif
}

// The row's elements as the MFMA reads them: fp16 bits, or bf16 bits for bf16 rows.
template <bool BF16>
__device__ __forceinline__ u16 operand_bits(float x) {
  return BF16 ? kvc::bf16_bits_of(x) : half_bits(x);
}
template <bool BF16>
__device__ __forceinline__ float operand_value(u16 bits) {
  return BF16 ? __uint_as_float(u32(bits) << 16) : kvc::f16_bits_to_float(bits);
}

template <int KV, int HEAD_PAD>
struct MfmaAttention {
  typedef Traits<KV, HEAD_PAD> T;
  typedef Shared<KV, HEAD_PAD> S;
  typedef typename Pick<T::kBf16, bf16x4, f16x4>::type Operand;

  static __device__ __forceinline__ Operand operand(u32 low, u32 high) {
    if constexpr (T::kBf16) return kvc_mfma::bf16x4_of_words(low, high);
    else return kvc_mfma::f16x4_of_words(low, high);
  }
  static __device__ __forceinline__ f32x4 product(Operand a, Operand b, f32x4 c) {
    if constexpr (T::kBf16) return kvc_mfma::mfma_f32_16x16x16_bf16(a, b, c);
    else return kvc_mfma::mfma_f32_16x16x16_f16(a, b, c);
  }
  static __device__ __forceinline__ u32 pack(float first, float second) {
    return u32(operand_bits<T::kBf16>(first)) | (u32(operand_bits<T::kBf16>(second)) << 16);
  }

  // A stored code (int4: one nibble) or 16-bit element as the products' operand bits.
  static __device__ __forceinline__ u16 code_bits(u32 code, int zero) {
    if constexpr (KV == KV_INT4) return half_bits(float(int(code) - zero));
    else if constexpr (KV == KV_INT8) return half_bits(float(int(code ^ 0x80u) - 0x80));
    else if constexpr (KV == KV_FP8) return half_bits(kvc_hip::e4m3fn_to_float(code));
    else return u16(code);
  }

  // `count` codes of one key's K and V rows, packed in a word from channel `channel`
  // on, into the tile: keys row-major, values transposed.
  template <int COUNT>
  static __device__ __forceinline__ void put_codes(S& shared, int key, int channel, u32 k_word, u32 v_word) {
    constexpr int kBits = KV == KV_INT4 ? 4 : T::kQuantized ? 8 : 16;
    constexpr u32 kMask = (1u << kBits) - 1u;
    const int k_zero = shared.key_zero[key], v_zero = shared.value_zero[key];
#pragma unroll
    for (int j = 0; j < COUNT; ++j) {
      const u32 k_code = (k_word >> (kBits * j)) & kMask, v_code = (v_word >> (kBits * j)) & kMask;
      shared.keys[key * T::kKeyPitch + channel + j] = code_bits(k_code, k_zero);
      // A 16-bit row is stored as given: a NaN or inf there would reach, as 0 x NaN,
      // the rows of the tile that cannot see its key. It enters as 0, and the rows
      // that see the key get a NaN weight instead (run).
      const u32 exponent_mask = T::kBf16 ? 0x7F80u : 0x7C00u;
      const bool broken = !T::kQuantized && (v_code & exponent_mask) == exponent_mask;
      if (broken) shared.broken_value[key] = 1;
      shared.values[(channel + j) * T::kValuePitch + key] = broken ? u16(0) : code_bits(v_code, v_zero);
    }
  }

  // Keys base .. base + 15 of the split into shared memory: codes as operand bits,
  // scales and zero-points. A key outside [begin, end) is staged as zeros with scale
  // 0, so that nothing stale enters. `words`: every row and stride is a whole number
  // of 4-byte words (the common case), read a word a lane; else a byte (a 16-bit
  // element) at a time.
  static __device__ void stage(const Params& p, S& shared, int sequence, int kv_head, int base, int begin, int end,
                               bool words) {
    const int l = kvc::lane_in_wave();
    if (l < T::kKeys) {
      const int position = base + l;
      long long k_row = -1, v_row = -1;
      float key_step = 0.f, value_step = 0.f;
      int key_zero = 0, value_zero = 0;
      if (position >= begin && position < end) {
        const int page = min(position / p.block_size, p.table_width - 1);
        const int id = p.block_table[static_cast<long long>(sequence) * p.table_width + page];
        const long long block = min(max(id, 0), p.num_blocks - 1);   // a bad id reads a real block, never past the cache
        const int slot = position % p.block_size;
        k_row = block * p.k_block_stride + slot * p.k_slot_stride + kv_head * p.k_head_stride;
        v_row = block * p.v_block_stride + slot * p.v_slot_stride + kv_head * p.v_head_stride;
        if (T::kQuantized) {
          const u32 k_word = *reinterpret_cast<const u32*>(p.k_scales + block * p.ks_block_stride +
                                                            slot * p.ks_slot_stride + kv_head * p.ks_head_stride);
          const u32 v_word = *reinterpret_cast<const u32*>(p.v_scales + block * p.vs_block_stride +
                                                            slot * p.vs_slot_stride + kv_head * p.vs_head_stride);
          // int4: the zero-point rides in the scale's four lowest mantissa bits (docs/format.md).
          const u32 mask = KV == KV_INT4 ? ~0xFu : ~0u;
          key_step = __uint_as_float(k_word & mask);
          value_step = __uint_as_float(v_word & mask);
          key_zero = KV == KV_INT4 ? int(k_word & 0xFu) : 0;
          value_zero = KV == KV_INT4 ? int(v_word & 0xFu) : 0;
        }
      }
      shared.key_row[l] = k_row;
      shared.value_row[l] = v_row;
      shared.broken_value[l] = 0;
      shared.key_step[l] = key_step;
      shared.value_step[l] = value_step;
      shared.key_zero[l] = key_zero;
      shared.value_zero[l] = value_zero;
    }
    wave_sync();
    constexpr int kChannelsPerByte = KV == KV_INT4 ? 2 : 1;
    constexpr int kUnitBytes = T::kQuantized ? 1 : 2;   // the narrow path's unit: a byte or a 16-bit element
    if (words) {
      constexpr int kPerWord = 4 * kChannelsPerByte / kUnitBytes;   // channels a word
      const int per_row = p.head_size / kPerWord;
      for (int i = l; i < T::kKeys * per_row; i += kvc::kWaveLanes) {
        const int key = i / per_row, word = i - key * per_row;
        const long long k_row = shared.key_row[key], v_row = shared.value_row[key];
        u32 k_word = 0, v_word = 0;
        if (k_row >= 0) {
          k_word = *reinterpret_cast<const u32*>(p.key_cache + k_row + 4 * word);
          v_word = *reinterpret_cast<const u32*>(p.value_cache + v_row + 4 * word);
        }
        put_codes<kPerWord>(shared, key, word * kPerWord, k_word, v_word);
      }
    } else {
      constexpr int kPerUnit = KV == KV_INT4 ? 2 : 1;
      const int per_row = p.head_size / kPerUnit;
      for (int i = l; i < T::kKeys * per_row; i += kvc::kWaveLanes) {
        const int key = i / per_row, unit = i - key * per_row;
        const long long k_row = shared.key_row[key], v_row = shared.value_row[key];
        u32 k_code = 0, v_code = 0;
        if (k_row >= 0) {
          const u8* k_at = p.key_cache + k_row + unit * kUnitBytes;
          const u8* v_at = p.value_cache + v_row + unit * kUnitBytes;
          k_code = kUnitBytes == 1 ? u32(*k_at) : u32(*reinterpret_cast<const u16*>(k_at));
          v_code = kUnitBytes == 1 ? u32(*v_at) : u32(*reinterpret_cast<const u16*>(v_at));
        }
        put_codes<kPerUnit>(shared, key, unit * kPerUnit, k_code, v_code);
      }
    }
    wave_sync();
  }

  static __device__ void run(const Params& p) {
    __shared__ S shared;
    const int l = kvc::lane_in_wave(), column = l & 15, group_of_lanes = l >> 4;
    // Tiles on x, whose grid dimension takes any count (a long prompt's row tiles), splits on y.
    const int split = blockIdx.y, kv_head = blockIdx.z;
    const int sequence = p.tiles[2 * blockIdx.x], row_tile = p.tiles[2 * blockIdx.x + 1];
    const int query_begin = p.cu_seqlens_q[sequence];
    const int query_len = p.cu_seqlens_q[sequence + 1] - query_begin;
    const int seq_len = p.seq_lens[sequence];
    const int rows = query_len * p.group;
    const int first_row = row_tile * T::kRows;
    if (first_row >= rows) return;   // a tile planned from a bound on the query length
    const int last_row = min(rows, first_row + T::kRows) - 1;

    // This lane's row (column of S^T): query token and head, and its position.
    const int row = first_row + column;
    const bool row_valid = row <= last_row;
    const int token = query_begin + row / p.group;
    const int head = kv_head * p.group + row % p.group;
    const int position = seq_len - query_len + row / p.group;
    const bool row_written = row_valid && token >= 0 && token < p.num_tokens;

    // The keys any row of the tile sees, cut to this split's.
    const int lowest = seq_len - query_len + first_row / p.group, highest = seq_len - query_len + last_row / p.group;
    const int seen_begin = p.window > 0 ? max(0, lowest - p.window + 1) : 0;
    const long long split_begin = static_cast<long long>(split) * p.split_tokens;
    const int begin = int(max(static_cast<long long>(seen_begin), split_begin));
    const int end = int(min(static_cast<long long>(highest) + 1, split_begin + p.split_tokens));

    // Whole words: every row and stride of K and V, and their bases, 4-byte aligned.
    const long long alignment = p.row_bytes | p.k_block_stride | p.k_slot_stride | p.k_head_stride | p.v_block_stride |
                                p.v_slot_stride | p.v_head_stride | reinterpret_cast<long long>(p.key_cache) |
                                reinterpret_cast<long long>(p.value_cache);
    const bool words = (alignment & 3) == 0;

    // Padding channels stay zero: the query's are zero, and 0 x stale NaN would not be.
    for (int i = l; i < T::kKeys * T::kKeyPitch; i += kvc::kWaveLanes) shared.keys[i] = 0;
    for (int i = l; i < HEAD_PAD * T::kValuePitch; i += kvc::kWaveLanes) shared.values[i] = 0;

    // The query row, times 2^shift (its largest magnitude brought to [256, 512)), as operand terms.
    float q[T::kSteps][4];
    float largest = 0.f;
    const float* query_row = p.query + (static_cast<long long>(token) * p.num_heads + head) * p.head_size;
#pragma unroll
    for (int s = 0; s < T::kSteps; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int channel = 16 * s + 4 * group_of_lanes + e;
        q[s][e] = row_written && channel < p.head_size ? query_row[channel] : 0.f;
        largest = fmaxf(largest, fabsf(q[s][e]));
      }
    largest = fmaxf(largest, __shfl_xor(largest, 16));
    largest = fmaxf(largest, __shfl_xor(largest, 32));
    int exponent = 0;
    if (largest > 0.f && largest <= 3.402823466e38f) exponent = int((__float_as_uint(largest) >> 23) & 0xFF) - 127;
    exponent = min(max(exponent, -100), 100);
    const float up = __uint_as_float(u32(127 + 8 - exponent) << 23), down = __uint_as_float(u32(127 - 8 + exponent) << 23);
    Operand query[T::kSteps][T::kQueryTerms];
#pragma unroll
    for (int s = 0; s < T::kSteps; ++s) {
      float rest[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) rest[e] = q[s][e] * up;
#pragma unroll
      for (int term = 0; term < T::kQueryTerms; ++term) {
        u16 bits[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          bits[e] = operand_bits<T::kBf16>(rest[e]);
          rest[e] -= operand_value<T::kBf16>(bits[e]);
        }
        query[s][term] = operand(u32(bits[0]) | (u32(bits[1]) << 16), u32(bits[2]) | (u32(bits[3]) << 16));
      }
    }

    float running_max = -KVC_INFINITY, sum = 0.f;
    f32x4 out[T::kSteps];
#pragma unroll
    for (int s = 0; s < T::kSteps; ++s) out[s] = kvc_mfma::make_f32x4(0.f, 0.f, 0.f, 0.f);

    for (int base = begin - (begin & 15); base < end; base += T::kKeys) {
      stage(p, shared, sequence, kv_head, base, begin, end, words);

      // Scores of keys 4g .. 4g + 3 for this lane's row.
      f32x4 score = kvc_mfma::make_f32x4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int s = 0; s < T::kSteps; ++s) {
        const u32* key_words = reinterpret_cast<const u32*>(shared.keys + column * T::kKeyPitch + 16 * s +
                                                            4 * group_of_lanes);
        const Operand keys = operand(key_words[0], key_words[1]);
#pragma unroll
        for (int term = 0; term < T::kQueryTerms; ++term) score = product(keys, query[s][term], score);
      }
      float probability[4], tile_max = -KVC_INFINITY;
      bool visible[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 4 * group_of_lanes + e, key_position = base + key;
        visible[e] = row_valid && key_position >= begin && key_position < end && key_position <= position &&
                     (p.window <= 0 || key_position > position - p.window);
        float value = score[e] * down;
        if (T::kQuantized) value *= shared.key_step[key];
        if (p.softcap > 0.f) value = p.softcap * tanhf(value / p.softcap);
        probability[e] = visible[e] ? value : -KVC_INFINITY;
        tile_max = kvc::max_nan(tile_max, probability[e]);
      }
      tile_max = kvc::max_nan(tile_max, __shfl_xor(tile_max, 16));
      tile_max = kvc::max_nan(tile_max, __shfl_xor(tile_max, 32));
      const float new_max = kvc::max_nan(running_max, tile_max);
      // Rows that have seen nothing yet keep max -inf, sum 0 and zero outputs.
      const float alpha = running_max == -KVC_INFINITY ? 0.f : expf(running_max - new_max);
      float tile_sum = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        probability[e] = visible[e] ? expf(probability[e] - new_max) : 0.f;
        tile_sum += probability[e];
      }
      tile_sum += __shfl_xor(tile_sum, 16);
      tile_sum += __shfl_xor(tile_sum, 32);
      sum = sum * alpha + tile_sum;
      running_max = new_max;

      // P^T for the value product: quantized tiles weigh each key by its value
      // scale relative to the tile's largest finite one (the product's result
      // then times that), so that the fp16 weights stay in [0, 1].
      float reference = 1.f;
      if (T::kQuantized) {
        float largest_step = 0.f;
#pragma unroll
        for (int key = 0; key < T::kKeys; ++key) largest_step = fmaxf(largest_step, shared.value_step[key]);
        if (largest_step > 0.f && largest_step <= 3.402823466e38f) reference = largest_step;
      }
      float weight[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 4 * group_of_lanes + e;
        if (T::kQuantized) weight[e] = visible[e] ? probability[e] * (shared.value_step[key] / reference) : 0.f;
        else weight[e] = visible[e] && shared.broken_value[key] ? __uint_as_float(0x7FC00000u) : probability[e];
      }
      const Operand weights = operand(pack(weight[0], weight[1]), pack(weight[2], weight[3]));
#pragma unroll
      for (int s = 0; s < T::kSteps; ++s) {
        const u32* value_words = reinterpret_cast<const u32*>(shared.values + (16 * s + column) * T::kValuePitch +
                                                              4 * group_of_lanes);
        const Operand values = operand(value_words[0], value_words[1]);
        // out holds channels 16 s + 4g + e of this lane's row.
        if (T::kQuantized) {
          const f32x4 tile_out = product(values, weights, kvc_mfma::make_f32x4(0.f, 0.f, 0.f, 0.f));
#pragma unroll
          for (int e = 0; e < 4; ++e) out[s][e] = out[s][e] * alpha + tile_out[e] * reference;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) out[s][e] *= alpha;
          out[s] = product(values, weights, out[s]);
        }
      }
      wave_sync();   // every lane's reads of the tile end before the next one is staged
    }

    if (!row_written) return;
    const long long index = (static_cast<long long>(split) * p.num_tokens + token) * p.num_heads + head;
    if (group_of_lanes == 0) {
      p.part_stats[2 * index] = running_max;
      p.part_stats[2 * index + 1] = sum;
    }
    float* out_row = p.part_out + index * p.head_size;
#pragma unroll
    for (int s = 0; s < T::kSteps; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int channel = 16 * s + 4 * group_of_lanes + e;
        if (channel < p.head_size) out_row[channel] = out[s][e];
      }
  }
};

}  // namespace kvc_mfma_attention

using namespace kvc_attn;   // the field types (u8, u32), as attention.cu's entries see them

#define KVC_PARAMETER(type, name) type name,
#define KVC_LAST_PARAMETER(type, name) type name
#define KVC_ARGUMENT(type, name) name,

// One wave a block: the split count, not the block, gives a short batch its parallelism.
extern "C" __global__ void __launch_bounds__(64) mfma_attention(KVC_ATTENTION_FIELDS(KVC_PARAMETER, KVC_LAST_PARAMETER)) {
  kvc_mfma_attention::MfmaAttention<KVC_MFMA_KV, KVC_HEAD_PAD>::run(
      kvc_attn::Params{KVC_ATTENTION_FIELDS(KVC_ARGUMENT, KVC_ARGUMENT)});
}
