// The merge of split-KV partial states (attention.cu's merge_splits entry) and
// the blockdiag butterflies it and the decode kernel share.
#pragma once

#include "types.cuh"
#ifndef KVC_NO_PTX
#include "ptx.cuh"   // wait_for_prerequisites, allow_dependent_launch (kernels_hip/hip_compat.h's without PTX)
#endif

namespace kvc_attn {

using namespace kvc;

// --- blockdiag butterflies on rows a warp holds ---------------------------------
// A warp here is 32 lanes: a CUDA warp, or half of a 64-lane wave (each half
// serves its own row; shuffles of width 32 stay in their half).

// H_b (b = 2^shift, the host's log2 b, uniform) on every block of b channels
// of ROWS rows, lane l holding channels l + 32 k of each (v[r][k]): in
// float32, the Sylvester stages h = 1, 2, .., b / 2; partners less than 32
// channels apart sit in other lanes (shuffles), wider ones in the same lane.
// Channels past a row's end must hold 0: their blocks lie wholly past it (b
// divides the head size), so they never meet a real channel.
template <int ROWS, int SLOTS>
__device__ __forceinline__ void warp_butterflies(float (&v)[ROWS][SLOTS], int lane, int shift) {
#pragma unroll
  for (int stage = 0; stage < 8; ++stage) {
    if (stage >= shift) break;
    const int h = 1 << stage;
    if (h < 32) {
      const bool upper = lane & h;
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int k = 0; k < SLOTS; ++k) {
          const float other = exchange_lanes(segment_lanes<32>(lane_in_wave()), v[r][k], h, 32);
          v[r][k] = upper ? other - v[r][k] : v[r][k] + other;
        }
    } else {
      const int j = h >> 5;
#pragma unroll
      for (int k = 0; k < SLOTS; ++k) {
        if ((k & j) || k + j >= SLOTS) continue;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const float a = v[r][k], b = v[r][k + j];
          v[r][k] = a + b;
          v[r][k + j] = a - b;
        }
      }
    }
  }
}

// Combine the splits' partial states of every (query token, head) row:
// out = sum_s o_s e^{m_s - M} / (sum_s l_s e^{m_s - M} + e^{sink - M}),
// rotated back where sign_shift >= 0 (blockdiag: H_b on every block of
// b = 2^sign_shift channels, then the signs, times out_factor = 1 / b; in
// float32, where the rotate kernel it replaces worked in float64).
// A block of kMergeWarps warps serves kMergeWarps / split_warps rows (one
// block a row would spend most of its time in block scheduling); the
// split_warps warps of a row (a power of two) sum splits phase, phase +
// split_warps, ... of channels lane, lane + 32, ... with all of a split's loads
// in flight, and the row's first warp adds up their sums: one warp a row would
// leave a merge of many splits bound by memory latency.
constexpr int kMergeWarps = 8;         // the launcher's MERGE_WARPS
constexpr int kMergeMaxSplits = 256;   // the launcher's MAX_SPLITS
constexpr int kMergeSlots = 8;         // channels lane + 32 k of head sizes up to 256

template <typename OUT>
__device__ void merge_splits(const float* part_out, const float* part_stats, const float* sinks, OUT* out,
                             int num_splits, int num_tokens, int num_heads, int head_size, int split_warps,
                             const u32* signs, int sign_shift, float out_factor) {
  __shared__ float weights[kMergeWarps][kMergeMaxSplits];
  __shared__ float partial[kMergeWarps][32 * kMergeSlots];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneMask warp_lanes = segment_lanes<32>(lane_in_wave());   // this warp's lanes of its wave
  const int phase = warp & (split_warps - 1);   // < num_splits (host)
  const long long rows = static_cast<long long>(num_tokens) * num_heads;
  const long long row = static_cast<long long>(blockIdx.x) * (kMergeWarps / split_warps) + warp / split_warps;
  const bool active = row < rows;
  float merged_row[1][kMergeSlots];   // warp_butterflies' shape: one row
  float (&merged)[kMergeSlots] = merged_row[0];
  u32 sign_words[kMergeSlots];
  float total = 0.f;
  if (active) {
    // Every load that waits on nothing goes out first (the sink, the sign
    // words, the first split's values, the statistics of splits lane, lane +
    // 32, ...): one after another they would make the merge a chain of memory
    // latencies.
    // The sinks and signs come from before the attention grid, which began
    // only after them: they need no wait.
    const bool has_sink = sinks != nullptr;
    const float sink = has_sink ? sinks[row % num_heads] : -KVC_INFINITY;
#pragma unroll
    for (int k = 0; k < kMergeSlots; ++k) sign_words[k] = sign_shift >= 0 ? __ldg(signs + k) : 0u;
    wait_for_prerequisites();
    allow_dependent_launch();   // the next call's attention grid, which waits for this one (attention.cu)
    const float* first_row = part_out + (phase * rows + row) * head_size;
#pragma unroll
    for (int k = 0; k < kMergeSlots; ++k) merged[k] = lane + 32 * k < head_size ? first_row[lane + 32 * k] : 0.f;
    const float2* stats = reinterpret_cast<const float2*>(part_stats);   // (max, sum) a split and row
    const float2 own = lane < num_splits ? stats[lane * rows + row] : make_float2(-KVC_INFINITY, 0.f);

    float peak = own.x;
    for (int s = lane + 32; s < num_splits; s += 32) peak = fmaxf(peak, stats[s * rows + row].x);
    for (int offset = 16; offset >= 1; offset /= 2) peak = fmaxf(peak, exchange_lanes(warp_lanes, peak, offset, 32));
    peak = fmaxf(peak, sink);
    const float shift = peak == -KVC_INFINITY ? 0.f : peak;
    for (int s = lane; s < num_splits; s += 32) {
      const float2 state = s == lane ? own : stats[s * rows + row];
      const float weight = expf(state.x - shift);
      total += state.y * weight;
      weights[warp][s] = weight;   // NaN for a NaN state
    }
    for (int offset = 16; offset >= 1; offset /= 2) total += exchange_lanes(warp_lanes, total, offset, 32);
    if (has_sink) total += expf(sink - shift);
    sync_lanes(warp_lanes);
    // A split that saw nothing of this row (weight 0) adds nothing, whatever it holds.
    const float first_weight = weights[warp][phase];
#pragma unroll
    for (int k = 0; k < kMergeSlots; ++k) merged[k] = first_weight != 0.f ? merged[k] * first_weight : 0.f;
#pragma unroll 2
    for (int s = phase + split_warps; s < num_splits; s += split_warps) {
      const float weight = weights[warp][s];
      const float* split_row = part_out + (s * rows + row) * head_size;
#pragma unroll
      for (int k = 0; k < kMergeSlots; ++k) {
        const int c = lane + 32 * k;
        if (c < head_size) {
          const float value = split_row[c];
          merged[k] += weight != 0.f ? value * weight : 0.f;
        }
      }
    }
  }
  if (split_warps > 1) {
#pragma unroll
    for (int k = 0; k < kMergeSlots; ++k) partial[warp][lane + 32 * k] = active ? merged[k] : 0.f;
    __syncthreads();
    if (!active || phase != 0) return;
    for (int w = 1; w < split_warps; ++w)
#pragma unroll
      for (int k = 0; k < kMergeSlots; ++k) merged[k] += partial[warp + w][lane + 32 * k];
  } else if (!active) {
    return;
  }
#pragma unroll
  for (int k = 0; k < kMergeSlots; ++k) {
    // 0 past the head (no division): those blocks lie wholly past it (b divides d).
    if (lane + 32 * k < head_size) merged[k] /= total;
  }
  if (sign_shift >= 0) {
    warp_butterflies(merged_row, lane, sign_shift);
#pragma unroll
    for (int k = 0; k < kMergeSlots; ++k) {
      const bool negative = (sign_words[k] >> lane) & 1u;   // channel lane + 32 k
      merged[k] = (negative ? -merged[k] : merged[k]) * out_factor;
    }
  }
#pragma unroll
  for (int k = 0; k < kMergeSlots; ++k) {
    const int c = lane + 32 * k;
    if (c < head_size) out[row * static_cast<long long>(head_size) + c] = kvc::from_float<OUT>(merged[k]);
  }
}

}  // namespace kvc_attn
