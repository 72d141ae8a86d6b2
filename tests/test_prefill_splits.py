"""The prefill planner's split choice (cuda_attention.choose_prefill_splits), on
the host: NumPy only, no GPU, so it runs in CI."""

import numpy as np

from kvcupy.backends import cuda_attention as ca

SLOTS, TILE = 132, 64   # an H200's multiprocessors, one prefill block each


def causal_tiles(sequences: int, context: int, new: int, group: int = 4, rows: int = 192) -> np.ndarray:
    """Keys each row tile of `rows` (query token, head) rows sees, as plan_attention counts them."""
    per_sequence = -(-new * group // rows)
    within = np.arange(per_sequence)
    seen = context - new + np.minimum((within + 1) * rows, new * group) // group
    return np.sort(np.tile(seen, sequences))[::-1]


def test_many_blocks_take_no_split():
    """Prompts and chunks that fill the GPU several times over: merges would only cost."""
    for sequences, context, new in ((4, 8192, 8192), (1, 2048, 2048), (4, 32768, 2048), (64, 128, 128)):
        tiles = causal_tiles(sequences, context, new)
        assert ca.choose_prefill_splits(tiles, 8, SLOTS, context, TILE, most=context // 256) == 1


def test_a_few_long_blocks_are_split():
    """Two row tiles of one KV head over 32768 cached keys: two busy multiprocessors
    of 132 unless the keys are split, and the split count stays within `most`."""
    tiles = causal_tiles(1, 32768, 96)
    assert len(tiles) == 2
    splits = ca.choose_prefill_splits(tiles, 1, SLOTS, 32768, TILE, most=32)
    assert 16 <= splits <= 32
