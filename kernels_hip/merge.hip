// The HIP build of attention.cu's merge_splits entry (kernels_cu/merge.cuh):
// the same kernel name, parameters and -D define (KVC_OUT_T), over
// hip_compat.h's primitives. A block's 32-lane warps are the halves of its
// 64-lane waves.
#include "hip_compat.h"
#include "merge.cuh"

extern "C" __global__ void merge_splits(
    const float* part_out, const float* part_stats, const float* sinks, KVC_OUT_T* out,
    int num_splits, int num_tokens, int num_heads, int head_size, int split_warps,
    const unsigned* signs, int sign_shift, float out_factor) {
  kvc_attn::merge_splits<KVC_OUT_T>(part_out, part_stats, sinks, out, num_splits, num_tokens,
                                    num_heads, head_size, split_warps, signs, sign_shift, out_factor);
}
