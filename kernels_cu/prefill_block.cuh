// A prefill block's rows and its warps' roles: where a query row lies
// (row_token, row_head, row_offset), and the barriers and register moves
// between the warps with query rows (the consumers) and the producer warpgroup.
#pragma once

#include "prefill_traits.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillBlock : Ktraits {
  using Ktraits::PRODUCER;
  using Ktraits::kConsumerWarps;
  using Ktraits::kConsumerThreads;
  using Ktraits::kTrimmed;

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
};

}  // namespace kvc_attn
