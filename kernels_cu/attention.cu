// Entry points of the attention family: specialised by -D constants (the
// launcher's Kernel.defines and PrefillKernel.defines give them):
//   paged_attention: KVC_ATTN_KV (attention.cuh's KV_* codes), KVC_HEAD_PAD, KVC_HEADS
//     (warps = KV heads per block), KVC_QUADS, KVC_TILE, KVC_STAGES, KVC_CHUNK, KVC_STAGING,
//     KVC_ROWS_BEFORE, KVC_MIN_BLOCKS;
//   prefill_attention: KVC_PREFILL_KV, KVC_HEAD_PAD, KVC_WARPS, KVC_TILE, KVC_STAGES, KVC_CHUNK,
//     KVC_MIN_BLOCKS, KVC_WGMMA, KVC_PRODUCER, KVC_DIRECT, KVC_SWIZZLE, KVC_ROTATED, KVC_WIDE_ROWS;
//   merge_splits: KVC_OUT_T.
#include "attention.cuh"
#include "prefill.cuh"

using namespace kvc_attn;

// Both attention entries take the fields of Params as parameters (params.cuh says
// why not the struct itself) and hand the kernel code one Params of them.
#define KVC_PARAMETER(type, name) type name,
#define KVC_LAST_PARAMETER(type, name) type name
#define KVC_ARGUMENT(type, name) name,
#define KVC_ATTENTION_PARAMETERS KVC_ATTENTION_FIELDS(KVC_PARAMETER, KVC_LAST_PARAMETER)
#define KVC_ATTENTION_PARAMS Params{KVC_ATTENTION_FIELDS(KVC_ARGUMENT, KVC_ARGUMENT)}

#ifdef KVC_ATTN_KV
// Decode and short query runs: one warp a KV head.
typedef Attention<KVC_ATTN_KV, KVC_HEAD_PAD, KVC_HEADS, KVC_QUADS, KVC_TILE, KVC_STAGES, KVC_CHUNK> Kernel;

extern "C" __global__ void __launch_bounds__(32 * KVC_HEADS, KVC_MIN_BLOCKS) paged_attention(KVC_ATTENTION_PARAMETERS) {
  enter_dependent_grid();   // launched as a dependent (Tuning.dependent_launch)
  Kernel::run(KVC_ATTENTION_PARAMS, block_shift);
}
#endif

#ifdef KVC_PREFILL_KV
#ifndef KVC_WGMMA
#define KVC_WGMMA 0
#endif
#ifndef KVC_PRODUCER
#define KVC_PRODUCER 0
#endif
#ifndef KVC_DIRECT
#define KVC_DIRECT 0
#endif
// Prefill: KVC_WARPS warps of 16 query rows a block, one KV head (prefill.cuh);
// KVC_WGMMA=1 (sm_90a builds): warpgroup products; KVC_PRODUCER=1 with it: the
// last warpgroup stages and decodes the tiles for the others; KVC_DIRECT=1 with
// that (16-bit caches): it copies them into the products' layout, no decoding.
typedef Prefill<KVC_PREFILL_KV, KVC_HEAD_PAD, KVC_WARPS, KVC_TILE, KVC_STAGES, KVC_CHUNK, KVC_WGMMA != 0,
                KVC_PRODUCER != 0, KVC_DIRECT != 0>
    PrefillKernel;

extern "C" __global__ void __launch_bounds__(32 * KVC_WARPS, KVC_MIN_BLOCKS) prefill_attention(KVC_ATTENTION_PARAMETERS) {
  enter_dependent_grid();   // launched as a dependent (Tuning.dependent_launch)
  PrefillKernel::run(KVC_ATTENTION_PARAMS, block_shift);
}
#endif

#ifdef KVC_OUT_T
extern "C" __global__ void merge_splits(const float* part_out, const float* part_stats, const float* sinks,
                                        KVC_OUT_T* out, int num_splits, int num_tokens, int num_heads,
                                        int head_size, int split_warps, const unsigned* signs, int sign_shift,
                                        float out_factor) {
  kvc_attn::merge_splits<KVC_OUT_T>(part_out, part_stats, sinks, out, num_splits, num_tokens, num_heads,
                                    head_size, split_warps, signs, sign_shift, out_factor);
}
#endif
