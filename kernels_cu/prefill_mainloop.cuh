// The tile loops, one a build, each streaming the block's key tiles through
// the products and the online softmax of a warp's rows (PrefillRows):
//   mma_sync   every warp stages and decodes; one block barrier a tile orders
//              the copies, the decoding and the products (mma.sync, a warp's
//              16 rows);
//   wgmma      the same order, the products a warpgroup's wgmma chains: a
//              tile's score products run while the next tile is decoded;
//   consumers  the producer build's warps with query rows, fed by the producer
//              warpgroup (prefill_producer.cuh) through mbarriers, in
//              FlashAttention-3's order within a warpgroup.
// The staging order (mma_sync, wgmma): plain caches stage raw tiles STAGES - 1
// ahead and the products read the stage; quantized caches stage STAGES tiles
// ahead and decode tile + 1 into the other decoded buffer while tile's
// products run, so one barrier a tile orders everything: after it, every
// thread is done with tile - 1's products (the buffer decoded next) and with
// decoding tile (whose raw stage is refilled next), and tile + 1's copies
// have landed.
#pragma once

#include "prefill_products.cuh"
#include "prefill_softmax.cuh"
#include "prefill_staging.cuh"

namespace kvc_attn {

template <class Ktraits>
struct PrefillMainloop : Ktraits {
  using Ktraits::TILE;
  using Ktraits::STAGES;
  using Ktraits::KC;
  using Ktraits::NT;
  using Ktraits::kQuantized;
  using Ktraits::kDecoded;
  using Ktraits::kSplitP;
  using Ktraits::kStageBytes;
  using Ktraits::kRawTensorBytes;
  using Ktraits::kDecodedOffset;
  using Ktraits::kDecodedBuffers;
  using Ktraits::kDecodedBufferBytes;
  using Ktraits::kDecodedTensorBytes;
  typedef PrefillStaging<Ktraits> Staging;
  typedef PrefillProducts<Ktraits> Products;
  typedef PrefillRows<Ktraits> Rows;
  typedef typename Staging::Keys Keys;
  // How far ahead of the products tiles are staged (see the header).
  static constexpr int kAhead = kDecoded ? STAGES : STAGES - 1;

  // A tile's operands in a decoded buffer or a raw stage: K rows, V rows, and
  // (decoded) the K and V scales.
  struct Operands {
    const u8* keys;
    const u8* values;
    const float* key_scales;
    const float* value_scales;
  };
  static __device__ __forceinline__ Operands operands(const u8* buffer) {
    const u8* values = buffer + (kDecoded ? kDecodedTensorBytes : kRawTensorBytes);
    const float* key_scales = reinterpret_cast<const float*>(buffer + 2 * kDecodedTensorBytes);
    return Operands{buffer, values, key_scales, key_scales + TILE};
  }

  // A score tile's accumulators cleared (the products add into them).
  static __device__ __forceinline__ void zero(float (&score)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) score[n][i] = 0.f;
  }

  // Decoded builds (quantized caches; every wgmma build): tile 0's copies
  // landed and decoded before the loop.
  static __device__ __forceinline__ void decode_first(u8* smem, const Keys& keys) {
    if (kDecoded && keys.num_tiles > 0) {
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      Staging::decode_tile(smem, smem + kDecodedOffset, keys.stager);
    }
  }

  // The top of tile `tile` (mma_sync, wgmma): its copies (quantized: tile + 1's)
  // landed, the block barrier, and the copies kAhead tiles on issued.
  static __device__ __forceinline__ void next_copies(const Params& p, u8* smem, Keys& keys, int tile) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = tile + kAhead;
    if (next < keys.num_tiles) Staging::copy_tile(p, smem, keys, next, next % STAGES);
    cp_async_commit();   // (an empty group at the end keeps wait_group's count in step)
  }

  // Where tile `tile`'s operands are: its decoded buffer, or (plain caches) its raw stage.
  static __device__ __forceinline__ u8* tile_buffer(u8* smem, int tile) {
    return kDecoded ? smem + kDecodedOffset + (tile % kDecodedBuffers) * kDecodedBufferBytes
                    : smem + (tile % STAGES) * kStageBytes;
  }

  // The mma.sync build: a warp's 16 rows; `query_lane`: its ldmatrix row of
  // the query's terms.
  static __device__ __forceinline__ void mma_sync(const Params& p, u8* smem, Keys& keys, Rows& rows,
                                                  const u8* query_lane, int lane) {
    decode_first(smem, keys);
    for (int tile = 0; tile < keys.num_tiles; ++tile) {
      next_copies(p, smem, keys, tile);
      if (kQuantized && tile + 1 < keys.num_tiles)
        Staging::decode_tile(smem + ((tile + 1) % STAGES) * kStageBytes, tile_buffer(smem, tile + 1),
                             keys.stager);
      const int base = keys.lo + tile * TILE;
      if (rows.unseen(p, base)) continue;   // no row of this warp sees the tile
      const Operands tile_operands = operands(tile_buffer(smem, tile));
      float score[NT][4];
      zero(score);
      Products::mma_scores(score, query_lane, tile_operands.keys, lane);
      u32 p_high[NT][2], p_low[kSplitP ? NT : 1][2];
      rows.rescale_out(
          rows.softmax_tile(p, score, tile_operands.key_scales, tile_operands.value_scales, base, p_high, p_low));
      Products::mma_values(rows.out, p_high, p_low, tile_operands.values, lane);
    }
  }

  // The wgmma build without a producer: a tile's score products issued, the
  // next tile decoded while they run, then its softmax and its output
  // products, waited for by the next tile's wait (or after the loop).
  static __device__ __forceinline__ void wgmma(const Params& p, u8* smem, Keys& keys, Rows& rows,
                                               const u8* query_rows) {
    decode_first(smem, keys);
    for (int tile = 0; tile < keys.num_tiles; ++tile) {
      next_copies(p, smem, keys, tile);
      const int base = keys.lo + tile * TILE;
      const bool unseen = rows.unseen(p, base);   // by the warpgroup's rows
      const Operands tile_operands = operands(tile_buffer(smem, tile));
      float score[NT][4];
      zero(score);
      if (!unseen) Products::wgmma_scores(score, tile_operands.keys, query_rows);
      if (tile + 1 < keys.num_tiles)
        Staging::decode_tile(smem + ((tile + 1) % STAGES) * kStageBytes, tile_buffer(smem, tile + 1),
                             keys.stager);
      kvc_wgmma::wait<0>();   // these scores, and the previous tile's output products
      kvc_wgmma::hold(score);
      kvc_wgmma::hold(rows.out);
      if (unseen) continue;
      u32 p_high[NT][2], p_low[kSplitP ? NT : 1][2];
      rows.rescale_out(
          rows.softmax_tile(p, score, tile_operands.key_scales, tile_operands.value_scales, base, p_high, p_low));
      Products::wgmma_values(rows.out, p_high, tile_operands.values);
      kvc_wgmma::commit();
    }
    kvc_wgmma::wait<0>();
    kvc_wgmma::hold(rows.out);
  }

  // The producer build's consumers, FlashAttention-3's order within a
  // warpgroup: tile's score products, then tile - 1's output products, both in
  // flight while tile's softmax runs once its scores are in (P of tile - 1 and
  // tile in separate registers). No branch around a product (ptxas would
  // serialise them all): a tile this warpgroup does not see runs too, its
  // scores all masked. `full` / `empty`: the decoded buffers' barriers.
  static __device__ __forceinline__ void consumers(const Params& p, u8* smem, int key_lo, int num_tiles, Rows& rows,
                                                   const u32 (&query_fragments)[KC][4], u8* full, u8* empty) {
    u32 p_previous[NT][2], p_low[1][2];
    const u8* previous_values = smem + kDecodedOffset;
    for (int tile = 0; tile < num_tiles; ++tile) {
      mbarrier_wait(full + 8 * (tile % kDecodedBuffers), (tile / kDecodedBuffers) & 1);
      const Operands tile_operands = operands(tile_buffer(smem, tile));
      float score[NT][4];
      zero(score);
      Products::wgmma_scores(score, tile_operands.keys, query_fragments);
      if (tile > 0) Products::wgmma_values(rows.out, p_previous, previous_values);
      kvc_wgmma::commit();    // (empty at tile 0: complete at once)
      kvc_wgmma::wait<1>();   // the scores; the output products run on
      kvc_wgmma::hold(score);
      u32 p_current[NT][2];
      const float2 factor = rows.softmax_tile(p, score, tile_operands.key_scales, tile_operands.value_scales,
                                              key_lo + tile * TILE, p_current, p_low);
      kvc_wgmma::wait<0>();
      kvc_wgmma::hold(rows.out);
      rows.rescale_out(factor);   // (no product in flight) for tile's output products, issued next
      if (tile >= 1) mbarrier_arrive(empty + 8 * ((tile - 1) % kDecodedBuffers));   // done with tile - 1's buffer
#pragma unroll
      for (int n = 0; n < NT; ++n) p_previous[n][0] = p_current[n][0], p_previous[n][1] = p_current[n][1];
      previous_values = tile_operands.values;
    }
    if (num_tiles > 0) {
      Products::wgmma_values(rows.out, p_previous, previous_values);
      kvc_wgmma::commit();
    }
    kvc_wgmma::wait<0>();
    kvc_wgmma::hold(rows.out);
  }
};

}  // namespace kvc_attn
