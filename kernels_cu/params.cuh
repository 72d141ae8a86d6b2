// The attention kernels' interface: one list of fields (KVC_ATTENTION_FIELDS)
// that declares both the Params struct the kernel code reads and the entries'
// parameters (attention.cu), each field a parameter of its own. Scalar
// parameters rather than one struct by value: NVVM keeps scalar parameters in
// registers from the entry on, while a struct parameter's fields are reloaded
// from parameter space where used, which moves the blocks' set-up off the
// uniform datapath.
//
// The launcher packs the parameters from its copy of the list
// (kvcupy/backends/cuda/params.py, ATTENTION_PARAMS), each at its natural
// alignment, by name: fields a kernel does not read stay zero. Tests hold the
// two lists equal (names and types) and compile a static_assert of every offset.
#pragma once

#include "types.cuh"

namespace kvc_attn {

using kvc::u8;
using kvc::u32;

// The fields, in order: FIELD(type, name) each, the last one LAST(type, name)
// (a parameter list takes no trailing comma).
#define KVC_ATTENTION_FIELDS(FIELD, LAST) \
  FIELD(const float*, query) /* [T, Hq, d] rotated, scaled; cache channel order */                                 \
  FIELD(const u8*, key_cache) /* element strides below are in bytes for the data */                                \
  FIELD(const u8*, value_cache)                                                                                    \
  FIELD(const u8*, k_scales) /* float32 words */                                                                   \
  FIELD(const u8*, v_scales)                                                                                       \
  FIELD(long long, k_block_stride) FIELD(long long, k_slot_stride) FIELD(long long, k_head_stride) /* bytes */     \
  FIELD(long long, v_block_stride) FIELD(long long, v_slot_stride) FIELD(long long, v_head_stride)                 \
  FIELD(long long, ks_block_stride) FIELD(long long, ks_slot_stride) FIELD(long long, ks_head_stride) /* bytes */  \
  FIELD(long long, vs_block_stride) FIELD(long long, vs_slot_stride) FIELD(long long, vs_head_stride)              \
  FIELD(const int*, block_table) /* [S, table_width] */                                                            \
  FIELD(const int*, seq_lens) /* [S] */                                                                            \
  FIELD(const int*, cu_seqlens_q) /* [S + 1] */                                                                    \
  FIELD(const int*, tiles) /* [num_tiles, 2]: (sequence, row tile) */                                              \
  FIELD(float*, part_out) /* [splits, T, Hq, d]: unnormalised outputs */                                           \
  FIELD(float*, part_stats) /* [splits, T, Hq, 2]: (running max, sum of exp) */                                    \
  FIELD(int, num_tokens) /* T */                                                                                   \
  FIELD(int, num_heads) /* Hq */                                                                                   \
  FIELD(int, group) /* Hq / Hk */                                                                                  \
  FIELD(int, head_size) /* d */                                                                                    \
  FIELD(int, row_bytes) /* stored bytes of one head row at d */                                                    \
  FIELD(int, block_size)                                                                                           \
  FIELD(int, block_shift) /* log2 block_size */                                                                    \
  FIELD(int, num_blocks)                                                                                           \
  FIELD(int, table_width)                                                                                          \
  FIELD(int, split_tokens) /* keys per split (a multiple of TILE) */                                               \
  FIELD(int, window) /* sliding window, 0: none */                                                                 \
  FIELD(float, softcap) /* 0: none */                                                                              \
  FIELD(float, code_unit) /* fp8: 2^8, since codes enter as e4m3 * 2^-8; else 1 */                                 \
  /* The prefill kernel's own input and output (prefill.cuh): it rotates the */                                    \
  /* query and, with one split, the output itself. The decode kernel reads */                                      \
  /* `query` and writes the split buffers only. */                                                                 \
  FIELD(const void*, query_in) /* [T, Hq, d] as the caller gave it (query_dtype), unrotated */                     \
  FIELD(long long, q_token_stride) FIELD(long long, q_head_stride) /* elements */                                  \
  FIELD(int, query_dtype) /* kDtypeF32, kDtypeF16, kDtypeBf16 */                                                   \
  FIELD(const uint2*, rotation_fwd) /* mma B fragments of the rotation (the launcher's rotation_fragments) */      \
  FIELD(const uint2*, rotation_inv) /* ... and of its inverse */                                                   \
  FIELD(int, rotation_shift) /* -1: no rotation; else log2 of the width of one independent */                      \
  /* block of fragments (the launcher's rotation_shift) */                                                         \
  FIELD(int, rotation_stages) /* butterfly stages across 16-dim groups beside the fragments' */                    \
  /* products (the launcher's rotation_stages) */                                                                  \
  FIELD(float, query_factor) /* 1 / query_divisor: softmax scale / norm */                                         \
  FIELD(float, out_factor) /* 1 / norm */                                                                          \
  FIELD(void*, out) /* [T, Hq, d] (out_dtype), written directly when `direct` */                                   \
  FIELD(long long, out_token_stride) FIELD(long long, out_head_stride) /* elements */                              \
  FIELD(int, out_dtype)                                                                                            \
  FIELD(const float*, sinks) /* [Hq] or null */                                                                    \
  FIELD(int, direct) /* one split: normalise, rotate back and write `out` here */                                  \
  /* The decode kernel reads the caller's query (query_in) itself where `query` */                                 \
  /* is null: times query_factor, rotated where sign_shift >= 0 (blockdiag: */                                     \
  /* the signs, then H_b on every block of b = 2^sign_shift channels). */                                          \
  FIELD(const u32*, signs) /* sign bits (bit i set: s[i] = -1), or null */                                         \
  LAST(int, sign_shift) /* log2 b; -1: no rotation */

#define KVC_DECLARE_FIELD(type, name) type name;
struct Params {
  KVC_ATTENTION_FIELDS(KVC_DECLARE_FIELD, KVC_DECLARE_FIELD)
};
#undef KVC_DECLARE_FIELD

// Dtype codes of query_in and out (the launcher's dtype_code).
constexpr int kDtypeF32 = 0, kDtypeF16 = 1, kDtypeBf16 = 2;

}  // namespace kvc_attn
