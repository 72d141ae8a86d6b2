// Which work a decode block serves: its (sequence, query row tile) from the
// tile list, its KV heads and its split of the keys from the grid, and from
// those the rows and the key range [key_lo, key_hi) its tiles cover.
// Included by attention.cuh.
#pragma once

#include "params.cuh"

namespace kvc_attn {

// One lane's view of its block: warp = KV head of the block, lane (g, t) as the
// mma fragments name it. Rows are (query token, query head of the group) pairs,
// flattened: row r of the sequence is query token q_begin + r / group.
struct DecodeBlock {
  int warp, lane, g, t;
  int head0, kv_head, split;
  int seq, q_begin, row_begin, total_rows;
  int context;                  // position of the first query token
  int key_lo, key_hi, num_tiles;
  const int* table;             // the sequence's row of the block table
};

// In two steps, with the test of the ids between them left to the caller
// (`return` there, not a result of these): the code after it then knows that
// the block's first row lies inside its sequence's rows.
// The block's rows (ROWS from row_begin), and of its sequence the number of
// query tokens q_len and of keys seq_len (capped by the block table).
template <int HEADS, int ROWS>
__device__ __forceinline__ void block_rows(const Params& p, DecodeBlock& b, int& q_len, int& seq_len) {
  b.warp = threadIdx.x >> 5, b.lane = threadIdx.x & 31;
  b.g = b.lane >> 2, b.t = b.lane & 3;
  const int seq = p.tiles[2 * blockIdx.y], row_tile = p.tiles[2 * blockIdx.y + 1];
  b.head0 = blockIdx.z * HEADS;
  b.kv_head = b.head0 + b.warp;
  b.split = blockIdx.x;
  b.q_begin = p.cu_seqlens_q[seq];
  q_len = p.cu_seqlens_q[seq + 1] - b.q_begin;
  seq_len = min(p.seq_lens[seq], p.table_width * p.block_size);
  b.row_begin = row_tile * ROWS;
  b.total_rows = q_len * p.group;
  b.seq = seq;
}

// The keys [key_lo, key_hi) the block's rows see of its split, in TILE-token tiles.
template <int ROWS, int TILE>
__device__ __forceinline__ void block_keys(const Params& p, DecodeBlock& b, int q_len, int seq_len) {
  b.context = seq_len - q_len;
  const int last_row = min(b.row_begin + ROWS, b.total_rows) - 1;
  const int first_position = b.context + b.row_begin / p.group;
  const int last_position = b.context + last_row / p.group;
  b.key_lo = max(p.window ? first_position - p.window + 1 : 0, b.split * p.split_tokens);
  b.key_hi = min(last_position + 1, (b.split + 1) * p.split_tokens);
  b.table = p.block_table + static_cast<long long>(b.seq) * p.table_width;
  b.num_tiles = b.key_hi > b.key_lo ? (b.key_hi - b.key_lo + TILE - 1) / TILE : 0;
}

}  // namespace kvc_attn
