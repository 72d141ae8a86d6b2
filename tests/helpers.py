"""Shared test fixtures: random paged batches and comparisons that name the case."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEAD_SIZES = (64, 80, 96, 112, 128, 160, 192, 256)
BLOCK_SIZES = (16, 32)
KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")


@dataclass
class PagedBatch:
    """Where a varlen batch's tokens live: shuffled physical pages per sequence."""

    seq_lens: np.ndarray        # [S] int32, total lengths
    query_lens: np.ndarray      # [S] new tokens per sequence
    cu_seqlens_q: np.ndarray    # [S+1] int32
    block_table: np.ndarray     # [S, max_blocks] int32, unused entries -1
    slot_mapping: np.ndarray    # [sum(seq_lens)] int64: every token of every sequence
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum())

    @property
    def num_queries(self) -> int:
        return int(self.cu_seqlens_q[-1])


def paged_batch(rng, seq_lens, query_lens, block_size, spare_blocks=3) -> PagedBatch:
    seq_lens = np.asarray(seq_lens, np.int32)
    query_lens = np.asarray(query_lens, np.int32)
    pages = [-(-int(n) // block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    physical = rng.permutation(num_blocks)
    block_table = np.full((len(seq_lens), max(pages)), -1, np.int32)
    slots, used = [], 0
    for seq, (length, count) in enumerate(zip(seq_lens, pages)):
        block_table[seq, :count] = physical[used:used + count]
        used += count
        positions = np.arange(length)
        slots.append(block_table[seq, positions // block_size] * block_size + positions % block_size)
    cu_seqlens_q = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return PagedBatch(seq_lens, query_lens, cu_seqlens_q, block_table,
                      np.concatenate(slots).astype(np.int64), num_blocks)


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def snapshot(cache) -> list[bytes]:
    """The cache's bytes, to show a rejected call changed nothing."""
    return [np.asarray(t).tobytes() for t in cache.tensors()]
