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
//   prefill_softmax.cuh   a score tile's softmax: masked scores, P and row sums
//   prefill_producer.cuh  the producer warpgroup's loops (the producer build)
//   prefill_epilogue.cuh  normalising, rotating back and writing the output
// Prefill::run below composes them: the block's prologue, the query operand,
// the tile loop of the build (the consumers' FlashAttention-3 order in the
// producer build, else one block barrier a tile) and the end. The tile loops
// stay in run(), the softmax's running state with them (softmax_tile):
// NVRTC optimises each function on its own before inlining it, so the same
// loops as functions of their own compile to other machine code (another
// register allocation).
#pragma once

#include "prefill_epilogue.cuh"
#include "prefill_producer.cuh"
#include "prefill_query.cuh"
#include "prefill_softmax.cuh"
#include "prefill_staging.cuh"

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
// intra-warpgroup order (run()): a tile's output products run under the next
// tile's softmax. Their score products take the query from registers (32 of
// them at d = 128), so that shared memory serves the tensor cores only K and V.

namespace kvc_attn {

template <int KV, int HEAD_PAD, int WARPS, int TILE, int STAGES, int CHUNK, bool WGMMA = false, bool PRODUCER = false,
          bool DIRECT = false>
struct Prefill : PrefillTraits<KV, HEAD_PAD, WARPS, TILE, STAGES, CHUNK, WGMMA, PRODUCER, DIRECT> {
  typedef PrefillTraits<KV, HEAD_PAD, WARPS, TILE, STAGES, CHUNK, WGMMA, PRODUCER, DIRECT> Ktraits;
  typedef PrefillBlock<Ktraits> Block;
  typedef PrefillStaging<Ktraits> Staging;
  typedef PrefillQuery<Ktraits> Query;
  typedef PrefillSoftmax<Ktraits> Softmax;
  typedef PrefillProducer<Ktraits> Producer;
  typedef PrefillEpilogue<Ktraits> Epilogue;
  typedef typename Ktraits::Pages Pages;
  using Ktraits::KC;
  using Ktraits::NT;
  using Ktraits::ND;
  using Ktraits::kThreads;
  using Ktraits::kConsumerWarps;
  using Ktraits::kConsumerThreads;
  using Ktraits::kStagers;
  using Ktraits::kRows;
  using Ktraits::kQuantized;
  using Ktraits::kDecoded;
  using Ktraits::kUnitScales;
  using Ktraits::kSwizzled;
  using Ktraits::kSwizzleBytes;
  using Ktraits::kRotated;
  using Ktraits::kBf16;
  using Ktraits::kSplitP;
  using Ktraits::kProbabilityLift;
  using Ktraits::kLog2e;
  using Ktraits::kRawTensorBytes;
  using Ktraits::kStageBytes;
  using Ktraits::kDecodedStride;
  using Ktraits::kDecodedTensorBytes;
  using Ktraits::kDecodedBuffers;
  using Ktraits::kDecodedOffset;
  using Ktraits::kDecodedBufferBytes;
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
    int row_position[2];
    bool row_valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_begin + g + 8 * r;
      row_valid[r] = !producer && row < total_rows;
      row_position[r] = context + Block::row_token(p, row);
    }
    int min_position = row_valid[0] ? row_position[0] : 0x7fffffff;
    int max_position = row_valid[1] ? row_position[1] : row_valid[0] ? row_position[0] : -1;
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

    // The first tiles' copies go out before the query is read: the two
    // latencies overlap (a short prompt's block sees only a tile or two).
    const int num_tiles = key_hi > key_lo ? (key_hi - key_lo + TILE - 1) / TILE : 0;
    // Plain caches: raw stages STAGES - 1 tiles ahead, the products read the
    // stage. Quantized caches: raw stages STAGES tiles ahead, and tile + 1 is
    // decoded into the other decoded buffer while tile's products run, so one
    // barrier a tile orders everything: after it, every thread is done with
    // tile - 1's products (the buffer decoded next) and with decoding tile
    // (whose raw stage is refilled next), and tile + 1's copies have landed.
    constexpr int kAhead = kDecoded ? STAGES : STAGES - 1;
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
    const int stager = PRODUCER ? threadIdx.x - kConsumerThreads : threadIdx.x;
    typename Pages::PageWindow window{};
    if (!PRODUCER || producer) {
      window = Pages::first_window(p, table, key_lo, key_hi, block_shift);
#pragma unroll
      for (int s = 0; s < kAhead; ++s) {
        if (s < num_tiles) {
          Pages::slide_window(window, p, table, (key_lo + s * TILE) >> block_shift, key_lo, key_hi, block_shift);
          Staging::stage_tile(p, smem, s, kv_head, key_lo + s * TILE, key_lo, key_hi, block_shift, window, stager);
        }
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
    float row_unscale[2];
    // PRODUCER: the score products take the query from registers (rs_k): the
    // high parts as the warp's A fragments, register 2h + r of k step kc holding
    // row g + 8r, dims 16 kc + 8h + 2t (+1), so shared memory serves only K and V.
    u32 query_fragments[PRODUCER ? KC : 1][4];
    if (kDirectQuery && bulk_query) {
      mbarrier_wait(query_barrier, 0);
      Query::direct_query(p, decoded, query_rows, row_valid, row_unscale);
      fence_proxy_async();   // read by wgmma after the loop's first barrier
      __syncwarp();
    } else {
      float values[KC][2][2][2];   // [kc][h][r][j]
      float pending;               // the softmax scale / norm the values still lack
      Query::load_query(p, q_begin, row_begin, kv_head, row_valid, query_area, bulk_query ? decoded : nullptr,
                        query_barrier, values, pending);
      if constexpr (PRODUCER) {   // past the block's last barrier: the roles part
        if (producer) {
          Block::template registers_down<kProducerRegs>();
          Producer::produce(p, smem, kv_head, key_lo, key_hi, block_shift, table, num_tiles, window, full, empty,
                            stager);
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
        row_unscale[r] = pending / up;
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
    const float exp_scale[2] = {row_unscale[0] * kLog2e, row_unscale[1] * kLog2e};
    // ldmatrix addresses of this lane: Q matrices rows 0-7 / 8-15 x dims +0 / +8.
    const u8* const query_lane = query_rows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kDecodedStride + 16 * (lane >> 4);

    float out[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[n][i] = 0.f;
    float running_max[2] = {-KVC_INFINITY, -KVC_INFINITY}, running_sum[2] = {0.f, 0.f};
    float reference = kDecoded && !kUnitScales ? 0.f : 1.f;   // R: the V scale the accumulators are in

    if (!PRODUCER && kDecoded && num_tiles > 0) {
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      Staging::decode_tile(smem, decoded, stager);
    }
    // A tile's softmax, its scores in `score` (in place), its decoded scales: the
    // running maxima, sums and reference updated, P in p_high (bf16: and p_low);
    // returns the factors of the accumulators' rows g and g + 8 for the tile.
    auto softmax_tile = [&](float (&score)[NT][4], const float* key_scales, const float* value_scales, int base,
                            u32 (&p_high)[NT][2], u32 (&p_low)[kSplitP ? NT : 1][2]) {
      // Scores in "row units" (z = q_up . k x key scale: the row's true logit
      // times 2^k, the row's query scaling, exact), capped and masked; the tile's
      // maximum per row. The softmax then works in log2 units through one FMA a
      // score: p = 2^(z c - m c), c = 2^-k log2(e).
      const bool all_visible = base + TILE <= key_hi && base + TILE - 1 <= min_position &&
                               (p.window == 0 || base > max_position - p.window);
      float tile_max[2] = {-KVC_INFINITY, -KVC_INFINITY};
      // Uniform across the warp: two code paths, not selects on every score.
      if (all_visible)
        Softmax::template row_unit_scores<false>(score, key_scales, p, base, t, key_hi, row_position, row_valid,
                                                 row_unscale, tile_max);
      else
        Softmax::template row_unit_scores<true>(score, key_scales, p, base, t, key_hi, row_position, row_valid,
                                                row_unscale, tile_max);
      // V scales of the tile: the new reference R.
      float tile_reference = reference;
      if constexpr (kDecoded && !kUnitScales) {
        float chain[4] = {};   // independent chains, as in row_unit_scores
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float2 scale = *reinterpret_cast<const float2*>(value_scales + 8 * n + 2 * t);
          chain[n & 3] = fmaxf(chain[n & 3], fmaxf(scale.x, scale.y));
        }
        float largest = fmaxf(fmaxf(chain[0], chain[1]), fmaxf(chain[2], chain[3]));
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
        tile_reference = fmaxf(reference, largest);
      }
      const float rescale_values = kUnitScales || tile_reference == reference ? 1.f
                                   : tile_reference > 0.f ? __fdividef(reference, tile_reference) : 0.f;
      const float to_reference = kUnitScales ? kProbabilityLift
                                 : tile_reference > 0.f ? __fdividef(kProbabilityLift, tile_reference)
                                                        : kProbabilityLift;
      reference = tile_reference;

      float alpha[2], shift[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m = max_over_quad(tile_max[r]);
        const float new_max = fmaxf(running_max[r], m);
        shift[r] = new_max == -KVC_INFINITY ? 0.f : new_max * exp_scale[r];
        alpha[r] = new_max == running_max[r] ? 1.f : fast_exp2(fmaf(running_max[r], exp_scale[r], -shift[r]));
        running_max[r] = new_max;
      }
      // Probabilities times V scale / R, as the P operand's fp16 (bf16) pairs.
      float tile_sum[2] = {0.f, 0.f};
      if (all_visible)
        Softmax::template probabilities<false>(score, value_scales, to_reference, exp_scale, shift, t, p_high, p_low,
                                               tile_sum);
      else
        Softmax::template probabilities<true>(score, value_scales, to_reference, exp_scale, shift, t, p_high, p_low,
                                              tile_sum);
#pragma unroll
      for (int r = 0; r < 2; ++r) running_sum[r] = running_sum[r] * alpha[r] + tile_sum[r];
      return make_float2(alpha[0] * rescale_values, alpha[1] * rescale_values);
    };
    auto rescale_out = [&](float2 factor) {
      if (!__all_sync(0xffffffffu, factor.x == 1.f && factor.y == 1.f)) {
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          out[n][0] *= factor.x;
          out[n][1] *= factor.x;
          out[n][2] *= factor.y;
          out[n][3] *= factor.y;
        }
      }
    };
    // wgmma: a tile's score products (the query rows and its decoded keys, both
    // from shared memory), issued and committed.
    auto issue_scores = [&](float (&score)[NT][4], const u8* keys) {
      if constexpr (WGMMA) {
        kvc_wgmma::hold(score);
        kvc_wgmma::fence();
        // k step kc: dims 16 kc.., 256 bytes on (a descriptor counts 16-byte
        // units); swizzled, 32 bytes within a column of kSwizzleBytes / 2 dims
        // (swizzled_offset), kKeySteps k steps a column.
        constexpr int kKeySteps = kSwizzled ? kSwizzleBytes / 32 : 1;
        const kvc_wgmma::u64 key_operand = kSwizzled
                                               ? kvc_wgmma::descriptor<kSwizzleBytes>(keys, 16, 8 * kSwizzleBytes)
                                               : kvc_wgmma::descriptor(keys, 128, 16 * HEAD_PAD);
        if constexpr (PRODUCER) {   // the query from registers
#pragma unroll
          for (int kc = 0; kc < KC; ++kc)
            kvc_wgmma::Products<TILE, kBf16>::rs_k(
                score, query_fragments[kc],
                key_operand +
                    (kSwizzled ? (kc / kKeySteps * TILE * kSwizzleBytes + kc % kKeySteps * 32) / 16 : 16 * kc));
        } else {   // the query rows from shared memory
          const kvc_wgmma::u64 query_operand = kvc_wgmma::descriptor(query_rows, 128, 16 * HEAD_PAD);
#pragma unroll
          for (int kc = 0; kc < KC; ++kc)
            kvc_wgmma::Products<TILE, kBf16>::ss(score, query_operand + 16 * kc, key_operand + 16 * kc);
        }
        kvc_wgmma::commit();
      }
    };
    // wgmma: a tile's output products (P from registers, the V rows of its decoded
    // buffer), issued (the caller commits them).
    auto issue_values = [&](const u32 (&p_high)[NT][2], const u8* values) {
      if constexpr (WGMMA) {
        kvc_wgmma::hold(out);
        kvc_wgmma::fence();
        // B = V rows 16 j.. (K, tokens) x dims (N): core matrices 128 bytes apart along the dims.
        // Swizzled: columns TILE x kSwizzleBytes apart, 8-token groups 8 x kSwizzleBytes.
        const kvc_wgmma::u64 value_operand =
            kSwizzled ? kvc_wgmma::descriptor<kSwizzleBytes>(values, TILE * kSwizzleBytes, 8 * kSwizzleBytes)
                      : kvc_wgmma::descriptor(values, 16 * HEAD_PAD, 128);
#pragma unroll
        for (int j = 0; j < TILE / 16; ++j) {
          const u32 a_high[4] = {p_high[2 * j][0], p_high[2 * j][1], p_high[2 * j + 1][0], p_high[2 * j + 1][1]};
          kvc_wgmma::Products<HEAD_PAD, kBf16>::rs_mn(   // 32 j HEAD_PAD bytes on; swizzled, 16 j kSwizzleBytes
              out, a_high, value_operand + (kSwizzled ? kSwizzleBytes * j : 2 * j * HEAD_PAD));
        }
      }
    };
    if constexpr (PRODUCER) {
      // FlashAttention-3's order within a warpgroup: tile's score products, then
      // tile - 1's output products, both in flight while tile's softmax runs once
      // its scores are in (P of tile - 1 and tile in separate registers). No
      // branch around a product (ptxas would serialise them all): a tile this
      // warpgroup does not see runs too, its scores all masked.
      u32 p_previous[NT][2], p_low[1][2];
      const u8* previous_values = decoded;
      for (int tile = 0; tile < num_tiles; ++tile) {
        mbarrier_wait(full + 8 * (tile % kDecodedBuffers), (tile / kDecodedBuffers) & 1);
        const u8* keys = decoded + (tile % kDecodedBuffers) * kDecodedBufferBytes;
        const u8* values = keys + kDecodedTensorBytes;
        const float* key_scales = reinterpret_cast<const float*>(keys + 2 * kDecodedTensorBytes);
        const float* value_scales = key_scales + TILE;
        float score[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) score[n][i] = 0.f;
        issue_scores(score, keys);
        if (tile > 0) issue_values(p_previous, previous_values);
        kvc_wgmma::commit();   // (empty at tile 0: complete at once)
        kvc_wgmma::wait<1>();   // the scores; the output products run on
        kvc_wgmma::hold(score);
        u32 p_current[NT][2];
        const float2 factor = softmax_tile(score, key_scales, value_scales, key_lo + tile * TILE, p_current, p_low);
        kvc_wgmma::wait<0>();
        kvc_wgmma::hold(out);
        rescale_out(factor);   // (no product in flight) for tile's output products, issued next
        if (tile >= 1) mbarrier_arrive(empty + 8 * ((tile - 1) % kDecodedBuffers));   // done with tile - 1's buffer
#pragma unroll
        for (int n = 0; n < NT; ++n) p_previous[n][0] = p_current[n][0], p_previous[n][1] = p_current[n][1];
        previous_values = values;
      }
      if (num_tiles > 0) {
        issue_values(p_previous, previous_values);
        kvc_wgmma::commit();
      }
    }
    for (int tile = 0; tile < num_tiles && !PRODUCER; ++tile) {
      cp_async_wait<STAGES - 2>();   // quantized: tile + 1 landed; plain: tile
      __syncthreads();
      const int next = tile + kAhead;
      if (next < num_tiles) {
        const int next_base = key_lo + next * TILE;
        Pages::slide_window(window, p, table, next_base >> block_shift, key_lo, key_hi, block_shift);
        Staging::stage_tile(p, smem, next % STAGES, kv_head, next_base, key_lo, key_hi, block_shift, window, stager);
      }
      cp_async_commit();   // (an empty group at the end keeps wait_group's count in step)
      u8* const next_decoded = decoded + ((tile + 1) % kDecodedBuffers) * kDecodedBufferBytes;
      if (!WGMMA && kQuantized && tile + 1 < num_tiles)
        Staging::decode_tile(smem + ((tile + 1) % STAGES) * kStageBytes, next_decoded, stager);
      const u8* keys = kDecoded ? decoded + (tile % kDecodedBuffers) * kDecodedBufferBytes
                                : smem + (tile % STAGES) * kStageBytes;
      const u8* values = keys + (kDecoded ? kDecodedTensorBytes : kRawTensorBytes);
      const float* key_scales = reinterpret_cast<const float*>(keys + 2 * kDecodedTensorBytes);
      const float* value_scales = key_scales + TILE;
      const int base = key_lo + tile * TILE;
      // Tiles no row of this warp (warpgroup) sees (causal, window): nothing to do.
      const bool unseen = max_position < 0 || base > max_position ||
                          (p.window != 0 && base + TILE - 1 <= min_position - p.window);

      // Scores: thread (g, t) holds rows g (c0, c1) and g + 8 (c2, c3), tokens 8 n + 2t (+1).
      float score[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) score[n][i] = 0.f;
      if constexpr (WGMMA) {
        // Issued, then the next tile decoded while they run.
        if (!unseen) issue_scores(score, keys);
        if (tile + 1 < num_tiles)
          Staging::decode_tile(smem + ((tile + 1) % STAGES) * kStageBytes, next_decoded, stager);
        kvc_wgmma::wait<0>();   // these scores, and the previous tile's output products
        kvc_wgmma::hold(score);
        kvc_wgmma::hold(out);
      }
      if (unseen) continue;
#pragma unroll
      for (int kc = 0; kc < KC && !WGMMA; kc += 2) {
        u32 q_high[2][4], q_low[2][4];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          ldmatrix_x4(q_high[k], query_lane + 32 * (kc + k));
          ldmatrix_x4(q_low[k], query_lane + kQueryBytes + 32 * (kc + k));
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          // Matrices: tokens 8n.. x dims 16 kc, 16 kc + 8, 16 kc + 16, 16 kc + 24.
          u32 b[4];
          ldmatrix_x4(b, keys + (8 * n + (lane & 7)) * kDecodedStride + 2 * (16 * kc + 8 * (lane >> 3)));
          mma<kBf16>(score[n], q_high[0], b[0], b[1]);
          mma<kBf16>(score[n], q_low[0], b[0], b[1]);
          mma<kBf16>(score[n], q_high[1], b[2], b[3]);
          mma<kBf16>(score[n], q_low[1], b[2], b[3]);
        }
      }

      u32 p_high[NT][2], p_low[kSplitP ? NT : 1][2];
      rescale_out(softmax_tile(score, key_scales, value_scales, base, p_high, p_low));
      // Output: k step j is tokens 16 j .. 16 j + 15, i.e. score tiles 2j, 2j + 1.
      if constexpr (WGMMA) {   // waited for by the next tile's wait (or after the loop)
        issue_values(p_high, values);
        kvc_wgmma::commit();
      }
#pragma unroll
      for (int j = 0; j < TILE / 16 && !WGMMA; ++j) {
        const u32 a_high[4] = {p_high[2 * j][0], p_high[2 * j][1], p_high[2 * j + 1][0], p_high[2 * j + 1][1]};
        u32 a_low[4];
        if constexpr (kSplitP) {
          a_low[0] = p_low[2 * j][0], a_low[1] = p_low[2 * j][1];
          a_low[2] = p_low[2 * j + 1][0], a_low[3] = p_low[2 * j + 1][1];
        }
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
          // Matrices (transposed): tokens 16j.. and 16j + 8.. x dims 8n.., then 8(n + 1)...
          u32 b[4];
          ldmatrix_x4_trans(b, values + (16 * j + (lane & 7) + 8 * ((lane >> 3) & 1)) * kDecodedStride +
                                   2 * (8 * n + 8 * (lane >> 4)));
          mma<kBf16>(out[n], a_high, b[0], b[1]);
          mma<kBf16>(out[n + 1], a_high, b[2], b[3]);
          if constexpr (kSplitP) {
            mma<kBf16>(out[n], a_low, b[0], b[1]);
            mma<kBf16>(out[n + 1], a_low, b[2], b[3]);
          }
        }
      }
    }
    if constexpr (WGMMA) {
      kvc_wgmma::wait<0>();
      kvc_wgmma::hold(out);
    }
    cp_async_wait<0>();
    if constexpr (kProbabilityLift != 1.f) reference *= 1.f / kProbabilityLift;   // the accumulators' unit (exact)

    if (p.direct) {
      Epilogue::write_output(p, out, running_max, running_sum, reference, row_unscale, q_begin, row_begin, total_rows,
                             kv_head, row_valid, query_area, decoded, bulk_out, early_inverse);
      return;
    }
    // Partial state of this split: max and sum per row, the accumulators times R.
    const long long split_rows = static_cast<long long>(split) * p.num_tokens;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = sum_over_quad(running_sum[r]);
      if (!row_valid[r]) continue;
      const int row = row_begin + g + 8 * r;
      const long long index = part_index(p, split_rows, q_begin, row, kv_head);
      if (t == 0) store_part_stats(p, index, running_max[r] * row_unscale[r], sum);   // 2^-k: exact
      float* destination = p.part_out + index * p.head_size;
#pragma unroll
      for (int n = 0; n < ND; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int channel = channel_of(8 * n + 2 * t + j);
          if (channel < p.head_size) destination[channel] = out[n][2 * r + j] * reference;
        }
      }
    }
  }
};

}  // namespace kvc_attn
