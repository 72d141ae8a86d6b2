// The end of a block with one split (`direct`): the rows normalised (the
// merge's arithmetic for a single split, sinks included), rotated back and
// written to the output in its dtype (write_output). With several splits the
// block writes its partial softmax state for merge_splits instead (run()).
#pragma once

#include "prefill_block.cuh"
#include "prefill_rotation.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillEpilogue : Ktraits {
  using Ktraits::KV;
  using Ktraits::ND;
  using Ktraits::kConsumerThreads;
  using Ktraits::kDecodedStride;
  using Ktraits::kLastBufferOffset;
  using Ktraits::kGroupShift;
  using Ktraits::kTrimmed;
  using Ktraits::kWideRows;
  using Ktraits::kInverseByGroups;
  using Ktraits::channel_of;
  using Ktraits::rotation_shift;
  typedef PrefillBlock<Ktraits> Block;
  typedef PrefillRotation<Ktraits> Rotation;

  // One split saw every key (`direct`): the merge's arithmetic for a single
  // split (merge_splits: the sink joins the denominator), the inverse rotation
  // (the host's fragments staged in `scratch`, the block's query rows, no
  // longer read; `early_inverse`: already in the last decoded buffer), and the
  // rows written to `out` in its dtype: `bulk_out`, staged in the decoded
  // buffers and written by bulk copies, a row a lane of the warp's first 16.
  // Every consumer thread calls this.
  static __device__ __forceinline__ void write_output(const Params& p, float (&out)[ND][4],
                                                      const float (&running_max)[2],
                                                      const float (&running_sum)[2], float reference,
                                                      const float (&row_unscale)[2], int q_begin, int row_begin,
                                                      int total_rows, int kv_head, const bool (&row_valid)[2],
                                                      u8* scratch, u8* decoded, bool bulk_out, bool early_inverse) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int element_bytes = p.out_dtype == kDtypeF32 ? 4 : 2;
    u8* const staged = decoded + 16 * (threadIdx.x >> 5) * kDecodedStride;   // bulk_out: this warp's 16 rows
    u8* rows[2];
    float weights[2], factors[2], totals[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_begin + (lane >> 2) + 8 * r;
      const int head = kv_head * p.group + Block::row_head(p, row);
      const long long start =
          row_valid[r] ? Block::row_offset(p, q_begin, row, kv_head, p.out_token_stride, p.out_head_stride) : 0;
      rows[r] = bulk_out ? staged + ((lane >> 2) + 8 * r) * kDecodedStride
                         : static_cast<u8*>(p.out) + start * element_bytes;
      const float sum = sum_over_quad(running_sum[r]);
      const float m = running_max[r] * row_unscale[r];
      const float sink = p.sinks != nullptr && row_valid[r] ? p.sinks[head] : -KVC_INFINITY;
      const float peak = fmaxf(m, sink);
      const float shift = peak == -KVC_INFINITY ? 0.f : peak;
      const float weight = expf(m - shift);
      const float total = sum * weight + (p.sinks != nullptr ? expf(sink - shift) : 0.f);
      // A row that saw nothing (weight 0) adds nothing, whatever its accumulators
      // hold: a select a value (kTrimmed: below, left out where every row of
      // the warp saw something).
      const float factor = reference * weight / total;
      weights[r] = weight;
      totals[r] = total;
      factors[r] = factor;
      if constexpr (!kTrimmed) {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& o = out[n][2 * r + j];
            o = weight != 0.f ? o * factor : 0.f / total;
          }
      }
    }
    // What the inverse rotation's products still multiply each row by.
    float row_factor[2] = {p.out_factor, p.out_factor};
    if constexpr (kTrimmed) {
      if (__all_sync(0xffffffffu, weights[0] != 0.f && weights[1] != 0.f)) {
        if (rotation_shift(p) >= 0) {   // the products' row scaling takes the factors along
#pragma unroll
          for (int r = 0; r < 2; ++r) row_factor[r] *= factors[r];
        } else {
#pragma unroll
          for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) out[n][i] *= factors[i >> 1];
        }
      } else {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1;
            out[n][i] = weights[r] != 0.f ? out[n][i] * factors[r] : 0.f / totals[r];
          }
      }
    }
    const bool staged_fragments = rotation_shift(p) >= 0 && rotation_shift(p) != kGroupShift && !early_inverse;
    // Every consumer is past its last read of the query rows and of the decoded
    // buffers, which the fragments and the staged rows overwrite.
    if (staged_fragments || bulk_out) Block::consumers_sync();
    if (rotation_shift(p) < 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!row_valid[r]) continue;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          if constexpr (KV != KV_INT4 && kTrimmed) {   // the channels in place: a pair a store (even head sizes)
            const int channel = 8 * n + 2 * t;
            if (channel < p.head_size)
              store_output_pair(p.out_dtype, rows[r], channel, out[n][2 * r], out[n][2 * r + 1]);
          } else {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int channel = channel_of(8 * n + 2 * t + j);
              if (channel < p.head_size) store_output(p.out_dtype, rows[r], channel, out[n][2 * r + j]);
            }
          }
        }
      }
    } else {
      const u8* fragments = reinterpret_cast<const u8*>(p.rotation_inv);
      if (early_inverse) {
        fragments = decoded + kLastBufferOffset;
      } else if (staged_fragments) {
        Rotation::template stage_fragments<kConsumerThreads>(p.rotation_inv, scratch);
        Block::consumers_sync();
        fragments = scratch;
      }
      // The inverse rotation: the Sylvester factor across groups first, then the products.
      Rotation::butterflies_across_groups(out, p.rotation_stages);
      auto store_tile = [&](int n, const float (&y)[4]) {   // n tile n of rows g, g + 8
        const int channel = 8 * n + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (row_valid[r] && channel < p.head_size) store_output_pair(p.out_dtype, rows[r], channel, y[2 * r], y[2 * r + 1]);
      };
      // 16-bit outputs take the rows as one fp16 term: at most 2^-11 relative a
      // value before the rotation mixes them, as much as an fp16 output's own
      // rounding and an eighth of a bf16 one's (tests/gpu/test_attention.py:
      // the bound); fp32 outputs keep two.
      // The float32 calls' build keeps one copy of the products, the low
      // terms' for a float32 output (a 16-bit one would take the high alone).
      if constexpr (kWideRows)
        Rotation::template rotate_rows<true, !kInverseByGroups>(out, fragments, rotation_shift(p), 0,
                                                                p.out_dtype == kDtypeF32, row_factor, store_tile);
      else
        Rotation::template rotate_rows<false, !kInverseByGroups>(out, fragments, rotation_shift(p), 0, false,
                                                                 row_factor, store_tile);
    }
    if (bulk_out) {
      fence_proxy_async();   // this lane's stores before the copy engine reads them
      __syncwarp();
      const int row = row_begin + lane;
      if (lane < 16 && row < total_rows) {
        const long long start = Block::row_offset(p, q_begin, row, kv_head, p.out_token_stride, p.out_head_stride);
        bulk_store(static_cast<u8*>(p.out) + 2 * start, staged + lane * kDecodedStride, 2 * p.head_size);
        bulk_stores_read();   // before the block's shared memory goes
      }
    }
  }

  static __device__ __forceinline__ void store_output(int dtype, u8* row, int channel, float v) {
    if (kWideRows && dtype == kDtypeF32) reinterpret_cast<float*>(row)[channel] = v;
    else if (dtype == kDtypeF16) reinterpret_cast<kvc::half*>(row)[channel] = kvc::from_float<kvc::half>(v);
    else reinterpret_cast<kvc::bfloat16*>(row)[channel] = kvc::from_float<kvc::bfloat16>(v);
  }

  static __device__ __forceinline__ void store_output_pair(int dtype, u8* row, int channel, float v0, float v1) {
    if (kWideRows && dtype == kDtypeF32)
      *reinterpret_cast<float2*>(reinterpret_cast<float*>(row) + channel) = make_float2(v0, v1);
    else if (dtype == kDtypeF16) *reinterpret_cast<u32*>(reinterpret_cast<u16*>(row) + channel) = pack_half2(v0, v1);
    else *reinterpret_cast<u32*>(reinterpret_cast<u16*>(row) + channel) = pack_bf162(v0, v1);
  }
};

}  // namespace kvc_attn
