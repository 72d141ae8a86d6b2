// The attention kernels' one parameter: the whole call, passed by value, so
// every thread reads any field from the constant bank from its first cycle (a
// device array read into shared memory would cost each block a memory round trip
// and a barrier before its first load of the batch plan).
//
// The launcher packs it from one field list (kvcupy/backends/cuda/params.py,
// ATTENTION_PARAMS), each field at its natural alignment; tests/jit holds the
// two equal, field by field, by compiling static_asserts of every offset. Fields
// the decode kernel does not read stay zero.
#pragma once

#include "types.cuh"

namespace kvc_attn {

using kvc::u8;
using kvc::u32;

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
  int block_shift;            // log2 block_size
  int num_blocks;
  int table_width;
  int split_tokens;          // keys per split (a multiple of TILE)
  int window;                // sliding window, 0: none
  float softcap;             // 0: none
  float code_unit;           // fp8: 2^8, since codes enter as e4m3 * 2^-8; else 1
  // The prefill kernel's own input and output (prefill.cuh): it rotates the
  // query and, with one split, the output itself. The decode kernel reads
  // `query` and writes the split buffers only.
  const void* query_in;      // [T, Hq, d] as the caller gave it (query_dtype), unrotated
  long long q_token_stride, q_head_stride;         // elements
  int query_dtype;           // kDtypeF32, kDtypeF16, kDtypeBf16
  const uint2* rotation_fwd; // mma B fragments of the rotation (the launcher's rotation_fragments)
  const uint2* rotation_inv; // ... and of its inverse
  int rotation_shift;        // -1: no rotation; else log2 of the width of one independent
                             // block of fragments (the launcher's rotation_shift)
  int rotation_stages;       // butterfly stages across 16-dim groups beside the fragments'
                             // products (the launcher's rotation_stages)
  float query_factor;        // 1 / query_divisor: softmax scale / norm
  float out_factor;          // 1 / norm
  void* out;                 // [T, Hq, d] (out_dtype), written directly when `direct`
  long long out_token_stride, out_head_stride;     // elements
  int out_dtype;
  const float* sinks;        // [Hq] or null
  int direct;                // one split: normalise, rotate back and write `out` here
  // The decode kernel reads the caller's query (query_in) itself where `query`
  // is null: times query_factor, rotated where sign_shift >= 0 (blockdiag:
  // the signs, then H_b on every block of b = 2^sign_shift channels).
  const u32* signs;          // sign bits (bit i set: s[i] = -1), or null
  int sign_shift;            // log2 b; -1: no rotation
};

// Dtype codes of query_in and out (the launcher's dtype_code).
constexpr int kDtypeF32 = 0, kDtypeF16 = 1, kDtypeBf16 = 2;

}  // namespace kvc_attn
