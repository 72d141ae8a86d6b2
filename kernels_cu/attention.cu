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

// The arguments every attention entry takes, in launch order.
#define KVC_ATTENTION_ARGS                                                                                  \
  const float *query, const u8 *key_cache, const u8 *value_cache, const u8 *k_scales,                       \
      const u8 *v_scales, long long k_block, long long k_slot, long long k_head, long long v_block,         \
      long long v_slot, long long v_head, long long ks_block, long long ks_slot, long long ks_head,         \
      long long vs_block, long long vs_slot, long long vs_head, const int *block_table,                     \
      const int *seq_lens, const int *cu_seqlens_q, const int *tiles, float *part_out,                      \
      float *part_stats, int num_tokens, int num_heads, int group, int head_size, int row_bytes,            \
      int block_size, int block_shift, int num_blocks, int table_width, int split_tokens, int window,       \
      float softcap, float code_unit, const void *query_in, long long q_token_stride,                       \
      long long q_head_stride, int query_dtype, const uint2 *rotation_fwd, const uint2 *rotation_inv,       \
      int rotation_shift, int rotation_stages, float query_factor, float out_factor, void *out,             \
      long long out_token_stride, long long out_head_stride, int out_dtype, const float *sinks,             \
      int direct, const unsigned *signs, int sign_shift

namespace {

// The twelve byte strides (block, slot, head of K, V, K scales, V scales) come
// by value: every thread has them from the start (as a device array read into
// shared memory, they would cost each block a memory round trip and a barrier
// before its first load of the batch plan).
__device__ __forceinline__ Params make_params(KVC_ATTENTION_ARGS) {
  Params p;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.k_scales = k_scales;
  p.v_scales = v_scales;
  p.k_block_stride = k_block;
  p.k_slot_stride = k_slot;
  p.k_head_stride = k_head;
  p.v_block_stride = v_block;
  p.v_slot_stride = v_slot;
  p.v_head_stride = v_head;
  p.ks_block_stride = ks_block;
  p.ks_slot_stride = ks_slot;
  p.ks_head_stride = ks_head;
  p.vs_block_stride = vs_block;
  p.vs_slot_stride = vs_slot;
  p.vs_head_stride = vs_head;
  p.block_table = block_table;
  p.seq_lens = seq_lens;
  p.cu_seqlens_q = cu_seqlens_q;
  p.tiles = tiles;
  p.part_out = part_out;
  p.part_stats = part_stats;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.group = group;
  p.head_size = head_size;
  p.row_bytes = row_bytes;
  p.block_size = block_size;
  p.num_blocks = num_blocks;
  p.table_width = table_width;
  p.split_tokens = split_tokens;
  p.window = window;
  p.softcap = softcap;
  p.code_unit = code_unit;
  p.query_in = query_in;
  p.q_token_stride = q_token_stride;
  p.q_head_stride = q_head_stride;
  p.query_dtype = query_dtype;
  p.rotation_fwd = rotation_fwd;
  p.rotation_inv = rotation_inv;
  p.rotation_shift = rotation_shift;
  p.rotation_stages = rotation_stages;
  p.query_factor = query_factor;
  p.out_factor = out_factor;
  p.out = out;
  p.out_token_stride = out_token_stride;
  p.out_head_stride = out_head_stride;
  p.out_dtype = out_dtype;
  p.sinks = sinks;
  p.direct = direct;
  p.signs = signs;
  p.sign_shift = sign_shift;
  return p;
}

#define KVC_ATTENTION_PARAMS                                                                                \
  make_params(query, key_cache, value_cache, k_scales, v_scales, k_block, k_slot, k_head, v_block,          \
              v_slot, v_head, ks_block, ks_slot, ks_head, vs_block, vs_slot, vs_head, block_table,          \
              seq_lens, cu_seqlens_q, tiles, part_out, part_stats, num_tokens, num_heads, group,            \
              head_size, row_bytes, block_size, block_shift, num_blocks, table_width, split_tokens,         \
              window, softcap, code_unit, query_in, q_token_stride, q_head_stride, query_dtype,             \
              rotation_fwd, rotation_inv, rotation_shift, rotation_stages, query_factor, out_factor,        \
              out, out_token_stride, out_head_stride, out_dtype, sinks, direct, signs, sign_shift)

}  // namespace

#ifdef KVC_ATTN_KV
// Decode and short query runs: one warp a KV head.
typedef Attention<KVC_ATTN_KV, KVC_HEAD_PAD, KVC_HEADS, KVC_QUADS, KVC_TILE, KVC_STAGES, KVC_CHUNK> Kernel;

extern "C" __global__ void __launch_bounds__(32 * KVC_HEADS, KVC_MIN_BLOCKS) paged_attention(KVC_ATTENTION_ARGS) {
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

extern "C" __global__ void __launch_bounds__(32 * KVC_WARPS, KVC_MIN_BLOCKS) prefill_attention(KVC_ATTENTION_ARGS) {
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
