"""PagedKVCache.decode_step: a step of every layer over metadata buffers that keep
their addresses (kvcupy/decode_step.py). On the CPU its calls equal the
manager's own write and attention to the byte; padding rows write nothing;
bad steps change nothing. (tests/gpu/test_graph.py replays it from CUDA graphs.)"""

import numpy as np
import pytest

import kvcupy as kc

LAYERS, KV_HEADS, HEADS, HEAD_SIZE, BLOCK = 2, 2, 4, 64, 16


def manager_with_history(kv_dtype="int4_per_token_head", context=20, sequences=3, seed=0):
    rng = np.random.default_rng(seed)
    manager = kc.PagedKVCache(num_layers=LAYERS, num_blocks=16, block_size=BLOCK, num_kv_heads=KV_HEADS,
                              head_size=HEAD_SIZE, kv_dtype=kv_dtype)
    seq_ids = [manager.add_sequence() for _ in range(sequences)]
    slot_mapping = manager.reserve(seq_ids, context)
    for layer in range(LAYERS):
        key, value = rng.standard_normal((2, sequences * context, KV_HEADS, HEAD_SIZE)).astype(np.float16)
        manager.write(layer, key, value, slot_mapping)
    return manager, seq_ids


def step_inputs(rng, rows):
    key, value = rng.standard_normal((2, rows, KV_HEADS, HEAD_SIZE)).astype(np.float16)
    return key, value, rng.standard_normal((rows, HEADS, HEAD_SIZE)).astype(np.float16)


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto"])
def test_a_step_equals_the_managers_own_calls(kv_dtype):
    """Steps of 3, 2 and 3 sequences in a bucket of 4 (one crossing into a new page):
    outputs and caches equal a twin manager driven by reserve / write / attention."""
    managers = [manager_with_history(kv_dtype)[0] for _ in range(2)]
    step = managers[0].decode_step(max_batch=4, max_seq_len=24)
    rng = np.random.default_rng(1)
    for seq_ids in ([0, 1, 2], [0, 2], [0, 1, 2]):
        assert np.array_equal(step.begin(seq_ids), twin_slots := managers[1].reserve(seq_ids, 1))
        rows = len(seq_ids)
        for layer in range(LAYERS):
            key, value, query = step_inputs(rng, 4)
            step.write(layer, key, value)
            managers[1].write(layer, key[:rows], value[:rows], twin_slots)
            out = step.attention(layer, query)
            expected = managers[1].attention(layer, query[:rows], seq_ids)
            assert out.shape == (4, HEADS, HEAD_SIZE)
            assert out[:rows].tobytes() == expected.tobytes()
    for mine, theirs in zip(managers[0].layers, managers[1].layers):
        for a, b in zip(mine.tensors(), theirs.tensors()):
            assert a is None and b is None or a.tobytes() == b.tobytes()
    assert [managers[0].seq_len(s) for s in (0, 1, 2)] == [23, 22, 23]


def test_padding_rows_write_nothing_and_read_inside_the_cache():
    manager, _ = manager_with_history()
    before = [t.copy() for t in manager.layers[0].tensors()]
    step = manager.decode_step(max_batch=8, max_seq_len=64)
    slot_mapping = step.begin([1])
    key, value, query = step_inputs(np.random.default_rng(2), 8)
    step.write(0, key, value)
    step.attention(0, query)
    changed = [np.flatnonzero((a != b).reshape(a.shape[0] * a.shape[1], -1).any(axis=1))
               for a, b in zip(manager.layers[0].tensors(), before)]
    for slots in changed:   # only the one reserved slot
        assert slots.tolist() == slot_mapping.tolist()


def test_bad_steps_raise_and_change_nothing():
    manager, seq_ids = manager_with_history(context=20)
    step = manager.decode_step(max_batch=2, max_seq_len=21)
    with pytest.raises(ValueError, match=r"seq_ids holds 3 sequences; this step takes at most max_batch=2"):
        step.begin(seq_ids)
    step.begin([0])   # 21 tokens: the bound
    with pytest.raises(ValueError, match=r"sequence 0 would reach 22 tokens; this step was built for "
                                         r"max_seq_len=21"):
        step.begin([0, 1])
    assert [manager.seq_len(s) for s in seq_ids] == [21, 20, 20]
    with pytest.raises(KeyError, match="seq_id=7"):
        step.begin([7])
    with pytest.raises(ValueError, match="seq_ids is empty"):
        step.begin([])
    with pytest.raises(ValueError, match=r"max_seq_len=10000 needs 625 pages of 16 tokens; the cache has 16"):
        manager.decode_step(max_batch=2, max_seq_len=10000)
    with pytest.raises(ValueError, match=r"max_batch=0 must be >= 1"):
        manager.decode_step(max_batch=0, max_seq_len=32)
    with pytest.raises(TypeError, match=r"max_seq_len=2.5 must be an int"):
        manager.decode_step(max_batch=1, max_seq_len=2.5)


def test_attention_waits_for_begin_and_the_layers_write():
    manager, _ = manager_with_history()
    step = manager.decode_step(max_batch=2, max_seq_len=32)
    key, value, query = step_inputs(np.random.default_rng(3), 2)
    with pytest.raises(RuntimeError, match=r"call begin\(seq_ids\) before the step's attention"):
        step.attention(0, query)
    step.begin([0, 1])
    with pytest.raises(RuntimeError, match=r"layer 1 does not hold this step's tokens yet"):
        step.attention(1, query)
    with pytest.raises(ValueError, match=r"layer=2 is out of range"):
        step.write(2, key, value)
    step.write(1, key, value)
    step.attention(1, query)
