// Prefill attention (many query rows a sequence) on tensor cores, in the
// FlashAttention-2 orientation: a warp owns 16 query rows, a block WARPS x 16
// rows of one KV head, and the block streams that head's keys TILE tokens at
// a time through shared memory.
//
//   scores  S[row, token] = Q[row, :] . K[token, :]     M = rows, N = tokens
//   output  O[row, dim]  += P[row, token] . V[token, dim]  M = rows, N = dims
//
// Where the decode kernel (attention.cuh) converts each cache code in the
// registers of the one warp that uses it, here the codes a tile holds feed
// WARPS x 16 rows: the block first decodes the tile once, cooperatively, into
// fp16 (code - zero-point, an exact small integer; fp8: the e4m3 value on
// sm_89 and newer, e4m3 x 2^-8 before; both exact; auto caches: see decode_tile),
// and every warp then takes its mma operands from those rows with ldmatrix.
// Scales stay out of the operands, as in the decode kernel: K's on the score
// side, V's on the probability side (P x scale / R, R the largest V scale
// seen so far, so that the fp16 operand stays in [0, 1]; auto caches' times
// 2^10). The query enters as a two-term fp16 split (q = hi + lo, ~22 bits), so
// each score is two mmas; the wgmma build (below) takes one term
// (tests/gpu/test_attention.py: the bound). Auto caches (fp16 / bf16 rows) in
// the mma.sync build skip the decoding: warps read the staged rows directly
// (bf16: P enters as a two-term split too, bf16 keeping 8 bits); the wgmma
// builds decode them like codes, into fp16 rows with a power-of-two scale each.
//
// Rows are (query token, query head of the KV head's group) pairs, flattened
// as in the decode kernel; partial softmax states go to the same split
// buffers, merged by merge_splits.
//
// The kernel's pieces, one job a header, each a struct on one PrefillTraits
// argument:
//   prefill_traits.cuh    shape constants, shared-memory layout, operand types
//   prefill_block.cuh     where a block's query rows lie; the warps' roles and barriers
//   prefill_staging.cuh   tiles from the paged cache into shared memory; decoding
//   prefill_rotation.cuh  the rotation's products (query and output)
//   prefill_query.cuh     the query rows read and rotated
//   prefill_softmax.cuh   a score tile's softmax: masked scores, P and row sums;
//                         a warp's rows' running state between tiles (PrefillRows)
//   prefill_products.cuh  a tile's score and output products (mma.sync, wgmma)
//   prefill_mainloop.cuh  the tile loops: mma_sync, wgmma, and the producer
//                         build's consumers
//   prefill_producer.cuh  the producer warpgroup's loops (the producer build)
//   prefill_epilogue.cuh  normalising, rotating back and writing the output
// Prefill::run below composes them: the block's prologue (the keys it sees,
// the first tiles' copies, the query operand), the build's mainloop and the
// end.
#pragma once

#include "prefill_epilogue.cuh"
#include "prefill_mainloop.cuh"
#include "prefill_producer.cuh"
#include "prefill_query.cuh"

// WGMMA (sm_90a, quantized caches): each warpgroup's products are two wgmma
// chains instead of one mma.sync chain a warp. The scores take the query rows
// and the decoded keys from shared memory (descriptors), the output takes P from
// registers and the decoded values from shared memory, so a tile's rows are
// read once a warpgroup rather than once a warp. Decoded tiles and query rows
// are then laid out as core matrices (wgmma.cuh), three decoded buffers deep:
// a tile's score products run while the next tile is decoded, its output
// products while the next barrier, copies and score products are issued.

// PRODUCER (wgmma builds): the last warpgroup stages and decodes the tiles while
// the others (the consumers, 128 query rows) only run the products and the
// softmax, ordered by mbarriers instead of a block barrier a tile: per decoded
// buffer, "full" (the producer's 128 threads have decoded a tile into it) and
// "empty" (every consumer thread is done with it). Past the block's prologue
// the producer gives KVC_PRODUCER_REGS of its registers' worth back
// (setmaxnreg) so that the consumers run on 224; they take FlashAttention-3's
// intra-warpgroup order (prefill_mainloop.cuh): a tile's output products run
// under the next tile's softmax. Their score products take the query from
// registers (32 of them at d = 128), so that shared memory serves the tensor
// cores only K and V.

namespace kvc_attn {

template <int KV, int HEAD_PAD, int WARPS, int TILE, int STAGES, int CHUNK, bool WGMMA = false, bool PRODUCER = false,
          bool DIRECT = false>
struct Prefill : PrefillTraits<KV, HEAD_PAD, WARPS, TILE, STAGES, CHUNK, WGMMA, PRODUCER, DIRECT> {
  typedef PrefillTraits<KV, HEAD_PAD, WARPS, TILE, STAGES, CHUNK, WGMMA, PRODUCER, DIRECT> Ktraits;
  typedef PrefillBlock<Ktraits> Block;
  typedef PrefillStaging<Ktraits> Staging;
  typedef PrefillQuery<Ktraits> Query;
  typedef PrefillRows<Ktraits> Rows;
  typedef PrefillMainloop<Ktraits> Mainloop;
  typedef PrefillProducer<Ktraits> Producer;
  typedef PrefillEpilogue<Ktraits> Epilogue;
  typedef typename Ktraits::Pages Pages;
  using Ktraits::KC;
  using Ktraits::ND;
  using Ktraits::kThreads;
  using Ktraits::kConsumerWarps;
  using Ktraits::kConsumerThreads;
  using Ktraits::kStagers;
  using Ktraits::kRows;
  using Ktraits::kSwizzled;
  using Ktraits::kRotated;
  using Ktraits::kProbabilityLift;
  using Ktraits::kLog2e;
  using Ktraits::kDecodedStride;
  using Ktraits::kDecodedBuffers;
  using Ktraits::kDecodedOffset;
  using Ktraits::kDecodedBytes;
  using Ktraits::kQueryBytes;
  using Ktraits::kWarpgroupQueryBytes;
  using Ktraits::kBarrierOffset;
  using Ktraits::kQueryBarrierOffset;
  using Ktraits::kProducerRegs;
  using Ktraits::kConsumerRegs;
  using Ktraits::kLastBufferOffset;
  using Ktraits::kEarlyInverse;
  using Ktraits::kGroupShift;
  using Ktraits::kDirectQuery;
  using Ktraits::channel_of;
  using Ktraits::pack;
  using Ktraits::unpack;
  using Ktraits::rotation_shift;
  // What the launcher allocates (kvcupy.backends.cuda.kernels: PrefillKernel.shared_bytes).
  static constexpr int kSharedBytes = Ktraits::kSharedBytes;

  static __device__ void run(const Params& p, int block_shift) {
    extern __shared__ __align__(1024) u8 smem[];
    if constexpr (kSwizzled) {   // the swizzled layouts' premise: the address bits they XOR in are the row's
      if (static_cast<u32>(__cvta_generic_to_shared(smem)) % 1024 != 0) __trap();
    }
    if (!kRotated && p.rotation_shift >= 0) __trap();   // a rotated cache in a build without the rotation
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int seq = p.tiles[2 * blockIdx.y], row_tile = p.tiles[2 * blockIdx.y + 1];
    const int kv_head = blockIdx.z;
    const bool producer = PRODUCER && warp >= kConsumerWarps;   // uniform across a warpgroup
    const int split = blockIdx.x;

    const int q_begin = p.cu_seqlens_q[seq];
    const int q_len = p.cu_seqlens_q[seq + 1] - q_begin;
    const int seq_len = min(p.seq_lens[seq], p.table_width * p.block_size);
    const int block_row_begin = row_tile * kRows;
    const int total_rows = q_len * p.group;
    // Ids from a device, unchecked: a tile that means nothing writes nothing.
    if (q_len <= 0 || seq_len < q_len || block_row_begin >= total_rows || q_begin < 0 ||
        q_begin + q_len > p.num_tokens)
      return;
    const int context = seq_len - q_len;
    const int block_last_row = min(block_row_begin + kRows, total_rows) - 1;
    const int first_position = context + Block::row_token(p, block_row_begin);
    const int last_position = context + Block::row_token(p, block_last_row);
    const int key_lo = max(p.window ? first_position - p.window + 1 : 0, split * p.split_tokens);
    const int key_hi = min(last_position + 1, (split + 1) * p.split_tokens);
    const int* table = p.block_table + static_cast<long long>(seq) * p.table_width;

    // This warp's rows g (r = 0) and g + 8 (r = 1).
    const int row_begin = block_row_begin + 16 * warp;
    Rows rows;
    rows.key_hi = key_hi;
    rows.t = t;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_begin + g + 8 * r;
      rows.row_valid[r] = !producer && row < total_rows;
      rows.row_position[r] = context + Block::row_token(p, row);
    }
    int min_position = rows.row_valid[0] ? rows.row_position[0] : 0x7fffffff;
    int max_position = rows.row_valid[1] ? rows.row_position[1] : rows.row_valid[0] ? rows.row_position[0] : -1;
    for (int offset = 16; offset >= 4; offset /= 2) {
      min_position = min(min_position, __shfl_xor_sync(0xffffffffu, min_position, offset));
      max_position = max(max_position, __shfl_xor_sync(0xffffffffu, max_position, offset));
    }
    if constexpr (WGMMA) {   // a warpgroup's products are one instruction: it skips tiles as a whole
      const int group_begin = block_row_begin + 64 * (warp >> 2);
      const int group_last = min(group_begin + 64, total_rows) - 1;
      min_position = context + Block::row_token(p, group_begin);
      max_position = group_last >= group_begin ? context + Block::row_token(p, group_last) : -1;
    }
    rows.min_position = min_position;
    rows.max_position = max_position;

    // The first tiles' copies go out before the query is read: the two
    // latencies overlap (a short prompt's block sees only a tile or two).
    const int num_tiles = key_hi > key_lo ? (key_hi - key_lo + TILE - 1) / TILE : 0;
    // PRODUCER: the decoded buffers' barriers, and only the producer stages.
    u8* const full = smem + kBarrierOffset;
    u8* const empty = full + 8 * kDecodedBuffers;
    u8* const query_barrier = smem + kQueryBarrierOffset;
    u8* const decoded = smem + kDecodedOffset;
    u8* const query_area = decoded + kDecodedBytes;
    // Bulk rows (see bulk_rows): the block's query rows, the rotation's
    // fragments (to `query_area`, as stage_fragments would; in 16-dim groups
    // too, which are otherwise read from global memory, a latency a group of n
    // tiles) and, where the output is written here and the block has fewer
    // tiles than decoded buffers, the inverse rotation's (to the last buffer),
    // all on query_barrier: every thread arrives once, announcing its copies' bytes.
    const bool bulk_query = Query::bulk_rows(p.query_in, p.q_token_stride, p.q_head_stride, p.query_dtype, p.head_size);
    const bool bulk_out =
        p.direct && Query::bulk_rows(p.out, p.out_token_stride, p.out_head_stride, p.out_dtype, p.head_size);
    const bool early_inverse =
        kEarlyInverse && bulk_query && p.direct && rotation_shift(p) >= 0 && num_tiles < kDecodedBuffers;
    if constexpr (PRODUCER) {
      if (threadIdx.x < kDecodedBuffers) {
        mbarrier_init(full + 8 * threadIdx.x, kStagers);
        mbarrier_init(empty + 8 * threadIdx.x, kConsumerThreads);   // every consumer thread, after its reads
      }
    }
    if (WGMMA && bulk_query && threadIdx.x == 0) mbarrier_init(query_barrier, kThreads);
    if (PRODUCER || (WGMMA && bulk_query)) __syncthreads();
    if (WGMMA && bulk_query) {
      const int row = block_row_begin + threadIdx.x;   // the row this thread copies
      const bool copies_row = threadIdx.x < kRows && row < total_rows;
      const u32 row_bytes = 2 * p.head_size;
      // The fragments ([KC][ND][32 lanes] x 8 bytes) whole, by the last thread;
      // in 16-dim groups only the runs that hold nonzeros (k step ks: n tiles
      // 2 ks and 2 ks + 1, 512 bytes), by the last KC threads (the inverse's:
      // the KC before them).
      const int parts = rotation_shift(p) == kGroupShift ? KC : 1;
      const int slot = kThreads - 1 - threadIdx.x;
      const bool forward_part = rotation_shift(p) >= 0 && slot < parts;
      const bool inverse_part = early_inverse && slot >= parts && slot < 2 * parts;
      u32 part_bytes = 0, part_offset = 0;
      if (forward_part || inverse_part) {
        const int part = forward_part ? slot : slot - parts;
        part_bytes = parts == 1 ? HEAD_PAD * HEAD_PAD * 2 : 2 * 32 * 8;
        part_offset = parts == 1 ? 0 : (part * ND + 2 * part) * 32 * 8;
      }
      mbarrier_arrive_expect(query_barrier, (copies_row ? row_bytes : 0u) + part_bytes);
      if (copies_row) {
        const long long start = Block::row_offset(p, q_begin, row, kv_head, p.q_token_stride, p.q_head_stride);
        bulk_copy(decoded + threadIdx.x * kDecodedStride, static_cast<const u8*>(p.query_in) + 2 * start, row_bytes,
                  query_barrier);
      }
      if (part_bytes != 0) {
        const u8* source = reinterpret_cast<const u8*>(forward_part ? Query::forward_fragments(p) : p.rotation_inv);
        u8* target = forward_part ? query_area : decoded + kLastBufferOffset;
        bulk_copy(target + part_offset, source + part_offset, part_bytes, query_barrier);
      }
    }
    // The stager index from unsigned arithmetic: the signed form lets NVRTC turn
    // the staging's index tests into tests of threadIdx.x, which spills in the
    // int8 and fp8 producer builds.
    typename Staging::Keys keys{table, kv_head, key_lo, key_hi, block_shift, num_tiles,
                                static_cast<int>(PRODUCER ? threadIdx.x - kConsumerThreads : threadIdx.x)};
    if (!PRODUCER || producer) {
      keys.window = Pages::first_window(p, table, key_lo, key_hi, block_shift);
#pragma unroll
      for (int s = 0; s < Mainloop::kAhead; ++s) {
        if (s < num_tiles) Staging::copy_tile(p, smem, keys, s, s);
        cp_async_commit();
      }
    }
    // The query rows as the score product's A operand, high and low fp16 halves
    // in this warp's part of shared memory ([part][row][logical dim], rows
    // padded like decoded ones), read back with ldmatrix once per tile: held in
    // registers they would take 8 HEAD_PAD / 16 of them for the whole loop. Each
    // row is scaled by a power of two that brings its largest |q| near 2^14
    // (exact), undone on the scores. Lane (g, t) loads rows g and g + 8, dims
    // 16 kc + 8 h + 2t (+1): the pairs of the A fragments it will hold.
    u8* const query_rows = query_area + (WGMMA ? (warp >> 2) * kWarpgroupQueryBytes : warp * 2 * kQueryBytes);
    // PRODUCER: the score products take the query from registers (rs_k): the
    // high parts as the warp's A fragments, register 2h + r of k step kc holding
    // row g + 8r, dims 16 kc + 8h + 2t (+1), so shared memory serves only K and V.
    u32 query_fragments[PRODUCER ? KC : 1][4];
    if (kDirectQuery && bulk_query) {
      mbarrier_wait(query_barrier, 0);
      Query::direct_query(p, decoded, query_rows, rows.row_valid, rows.row_unscale);
      fence_proxy_async();   // read by wgmma after the loop's first barrier
      __syncwarp();
    } else {
      float values[KC][2][2][2];   // [kc][h][r][j]
      float pending;               // the softmax scale / norm the values still lack
      Query::load_query(p, q_begin, row_begin, kv_head, rows.row_valid, query_area, bulk_query ? decoded : nullptr,
                        query_barrier, values, pending);
      if constexpr (PRODUCER) {   // past the block's last barrier: the roles part
        if (producer) {
          Block::template registers_down<kProducerRegs>();
          Producer::produce(p, smem, keys, full, empty);
          return;
        }
        Block::template registers_up<kConsumerRegs>();
      }
      float largest[2] = {0.f, 0.f};
#pragma unroll
      for (int kc = 0; kc < KC; ++kc)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int j = 0; j < 2; ++j) largest[r] = fmaxf(largest[r], fabsf(values[kc][h][r][j]));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float up = fp16_range_scale(max_over_quad(largest[r]));
        rows.row_unscale[r] = pending / up;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float v0 = values[kc][h][r][0] * up, v1 = values[kc][h][r][1] * up;
            const u32 high = pack(v0, v1);
            const float2 rounded = unpack(high);
            const int dim = 16 * kc + 8 * h + 2 * t;
            if constexpr (PRODUCER) {
              query_fragments[kc][2 * h + r] = high;
            } else if constexpr (WGMMA) {   // the warpgroup's rows as core matrices, the high part alone
              *reinterpret_cast<u32*>(query_rows + kvc_wgmma::core_offset(16 * (warp & 3) + g + 8 * r, dim,
                                                                          HEAD_PAD)) = high;
            } else {
              u8* at = query_rows + (g + 8 * r) * kDecodedStride + 2 * dim;
              *reinterpret_cast<u32*>(at) = high;
              *reinterpret_cast<u32*>(at + kQueryBytes) = pack(v0 - rounded.x, v1 - rounded.y);
            }
          }
        }
      }
      if constexpr (WGMMA && !PRODUCER) fence_proxy_async();   // read by wgmma after the loop's first barrier
      __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) rows.exp_scale[r] = rows.row_unscale[r] * kLog2e;
    rows.start();
    if constexpr (PRODUCER) {
      Mainloop::consumers(p, smem, key_lo, num_tiles, rows, query_fragments, full, empty);
    } else if constexpr (WGMMA) {
      Mainloop::wgmma(p, smem, keys, rows, query_rows);
    } else {
      // ldmatrix addresses of this lane: Q matrices rows 0-7 / 8-15 x dims +0 / +8.
      const u8* const query_lane =
          query_rows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kDecodedStride + 16 * (lane >> 4);
      Mainloop::mma_sync(p, smem, keys, rows, query_lane, lane);
    }
    cp_async_wait<0>();
    if constexpr (kProbabilityLift != 1.f) rows.reference *= 1.f / kProbabilityLift;   // the accumulators' unit (exact)

    if (p.direct) {
      Epilogue::write_output(p, rows.out, rows.running_max, rows.running_sum, rows.reference, rows.row_unscale, q_begin,
                             row_begin, total_rows, kv_head, rows.row_valid, query_area, decoded, bulk_out,
                             early_inverse);
      return;
    }
    // Partial state of this split: max and sum per row, the accumulators times R.
    const long long split_rows = static_cast<long long>(split) * p.num_tokens;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = sum_over_quad(rows.running_sum[r]);
      if (!rows.row_valid[r]) continue;
      const int row = row_begin + g + 8 * r;
      const long long index = part_index(p, split_rows, q_begin, row, kv_head);
      if (t == 0) store_part_stats(p, index, rows.running_max[r] * rows.row_unscale[r], sum);   // 2^-k: exact
      float* destination = p.part_out + index * p.head_size;
#pragma unroll
      for (int n = 0; n < ND; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int channel = channel_of(8 * n + 2 * t + j);
          if (channel < p.head_size) destination[channel] = rows.out[n][2 * r + j] * rows.reference;
        }
      }
    }
  }
};

}  // namespace kvc_attn
