// The producer warpgroup's loops (the producer build, sm_90a): the last
// warpgroup stages and decodes the tiles (produce; DIRECT builds copy 16-bit
// rows straight into the products' layout: produce_direct) while the others,
// the consumers (prefill_mainloop.cuh: consumers), only run the products and
// the softmax. They are ordered by mbarriers instead of a block barrier a
// tile: per decoded buffer, "full" (the producer's 128 threads have filled it)
// and "empty" (every consumer thread is done with it).
#pragma once

#include "prefill_block.cuh"
#include "prefill_staging.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillProducer : Ktraits {
  using Ktraits::STAGES;
  using Ktraits::DIRECT;
  using Ktraits::kStageBytes;
  using Ktraits::kDecodedOffset;
  using Ktraits::kDecodedBuffers;
  using Ktraits::kDecodedBufferBytes;
  typedef PrefillBlock<Ktraits> Block;
  typedef PrefillStaging<Ktraits> Staging;

  // The producer warpgroup's loop: tile's raw stage (copies issued STAGES - 1
  // tiles ahead) decoded into buffer tile % kDecodedBuffers once the consumers
  // are done with that buffer's previous tile. One barrier of the producer's
  // own a tile: every stager's copies of the tile have landed, and every
  // stager is done decoding tile - 1, whose raw stage is refilled next.
  static __device__ __forceinline__ void produce(const Params& p, u8* smem, typename Staging::Keys& keys, u8* full,
                                                 u8* empty) {
    u8* const decoded = smem + kDecodedOffset;
    if constexpr (DIRECT) {
      produce_direct(p, smem, keys, full, empty);
      return;
    }
    // Tile t's copies are the t-th group: the first STAGES went out before the
    // loop, and each pass from the second on commits one group (tile t - 1 +
    // STAGES, or none near the end). Before tile t's wait, STAGES groups are
    // committed at t = 0 and STAGES + t - 1 after: all but STAGES - 1, then
    // STAGES - 2, of them must have landed.
#pragma unroll 1
    for (int tile = 0; tile < keys.num_tiles; ++tile) {
      if (tile == 0) cp_async_wait<STAGES - 1>();
      else cp_async_wait<STAGES - 2>();
      Block::producer_sync();
      if (tile >= 1) {
        const int next = tile - 1 + STAGES;
        if (next < keys.num_tiles) Staging::copy_tile(p, smem, keys, next, next % STAGES);
        cp_async_commit();
      }
      const int buffer = tile % kDecodedBuffers;
      if (tile >= kDecodedBuffers) mbarrier_wait(empty + 8 * buffer, (tile / kDecodedBuffers - 1) & 1);
      Staging::decode_tile(smem + (tile % STAGES) * kStageBytes, decoded + buffer * kDecodedBufferBytes, keys.stager);
      mbarrier_arrive(full + 8 * buffer);
    }
    cp_async_wait<0>();
  }

  // DIRECT: tile t's copies go straight into decoded buffer t % kDecodedBuffers,
  // once the consumers are done with that buffer's previous tile, as the t-th
  // cp.async group (the first STAGES went out before the loop, as raw tiles
  // do). Pass t (from STAGES on) issues tile t, or an empty group near the end,
  // then waits until all but the newest STAGES groups have landed: tile t -
  // STAGES is in; each stager makes its own copies' writes visible to the
  // async proxy (the wgmma operands) and arrives on that tile's "full" barrier.
  // Buffers t - STAGES .. t are in flight then, and the consumers hold two
  // more (a tile's scores, the tile before's output products): STAGES + 3.
  static __device__ __forceinline__ void produce_direct(const Params& p, u8* smem, typename Staging::Keys& keys,
                                                        u8* full, u8* empty) {
#pragma unroll 1
    for (int tile = STAGES; tile < keys.num_tiles + STAGES; ++tile) {
      if (tile < keys.num_tiles) {
        const int buffer = tile % kDecodedBuffers;
        if (tile >= kDecodedBuffers) mbarrier_wait(empty + 8 * buffer, (tile / kDecodedBuffers - 1) & 1);
        Staging::copy_tile(p, smem, keys, tile, buffer);
      }
      cp_async_commit();
      cp_async_wait<STAGES>();
      fence_proxy_async();
      mbarrier_arrive(full + 8 * ((tile - STAGES) % kDecodedBuffers));
    }
  }
};

}  // namespace kvc_attn
