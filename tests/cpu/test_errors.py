"""Bad calls raise an error naming the argument, and change nothing (docs/design.md, "Validation policy")."""

import numpy as np
import pytest

import kvcupy as kc

from ..helpers import paged_batch, snapshot

HEAD_SIZE, BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS = 64, 16, 2, 4


@pytest.fixture
def setup():
    """A written int4 cache, a valid write and a valid attention call to spoil one argument of."""
    rng = np.random.default_rng(0)
    batch = paged_batch(rng, [20, 5], [1, 5], BLOCK_SIZE)
    cache = kc.allocate_cache(batch.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    kv = rng.standard_normal((batch.num_tokens, NUM_KV_HEADS, HEAD_SIZE)).astype(np.float16)
    kc.reshape_and_cache(kv, kv, cache, batch.slot_mapping)
    write = dict(key=kv, value=kv.copy(), cache=cache, slot_mapping=batch.slot_mapping)
    attend = dict(query=rng.standard_normal((batch.num_queries, NUM_HEADS, HEAD_SIZE)).astype(np.float16),
                  cache=cache, block_table=batch.block_table, seq_lens=batch.seq_lens,
                  cu_seqlens_q=batch.cu_seqlens_q)
    return cache, write, attend


def call_write(write, **changes):
    args = {**write, **changes}
    kc.reshape_and_cache(args["key"], args["value"], args["cache"], args["slot_mapping"])


WRITE_ERRORS = [
    ("key", lambda w: w["key"].astype(np.float64), TypeError, "key has dtype float64"),
    ("key", lambda w: w["key"].tolist(), TypeError, "key must be an array"),
    ("key", lambda w: w["key"][:, :1], ValueError, "key has shape"),
    ("key", lambda w: w["key"][..., :32], ValueError, "key has shape"),
    ("value", lambda w: w["value"][:-1], ValueError, "value has shape"),
    ("value", lambda w: w["value"].astype(np.float32), TypeError, "value has dtype"),
    ("slot_mapping", lambda w: w["slot_mapping"].astype(np.float32), TypeError, "slot_mapping has dtype"),
    ("slot_mapping", lambda w: w["slot_mapping"][:-1], ValueError, "slot_mapping has shape"),
    ("slot_mapping", lambda w: w["slot_mapping"] + 10_000, ValueError, "slot_mapping holds slot"),
    ("slot_mapping", lambda w: np.zeros_like(w["slot_mapping"]), ValueError, "slot_mapping writes one slot twice"),
    ("cache", lambda w: "not a cache", TypeError, "cache must be a KVCache"),
]


@pytest.mark.parametrize("argument,spoil,error,message", WRITE_ERRORS)
def test_bad_write_changes_nothing(setup, argument, spoil, error, message):
    cache, write, _ = setup
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        call_write(write, **{argument: spoil(write)})
    assert snapshot(cache) == before


def test_write_into_read_only_cache(setup):
    cache, write, _ = setup
    cache.key_cache.flags.writeable = False
    before = snapshot(cache)
    with pytest.raises(ValueError, match="read-only"):
        call_write(write)
    assert snapshot(cache) == before


ATTENTION_ERRORS = [
    ("query", lambda a: a["query"].astype(np.int32), TypeError, "query has dtype"),
    ("query", lambda a: a["query"][..., :32], ValueError, "query has shape"),
    ("query", lambda a: a["query"][:, :3], ValueError, "query has 3 heads"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, "block_table has 1 rows"),
    ("block_table", lambda a: a["block_table"] + 100, ValueError, r"block_table\[0\] refers to block"),
    ("block_table", lambda a: a["block_table"].astype(np.float32), TypeError, "block_table has dtype"),
    ("seq_lens", lambda a: a["seq_lens"] + 1000, ValueError, "seq_lens holds"),
    ("seq_lens", lambda a: np.array([20, 2], np.int32), ValueError, r"seq_lens\[1\]=2 is shorter"),
    ("cu_seqlens_q", lambda a: np.array([0, 4, 7], np.int32), ValueError, "cu_seqlens_q="),
    ("cu_seqlens_q", lambda a: np.array([0, 6], np.int32), ValueError, "cu_seqlens_q has shape"),
    ("cu_seqlens_q", lambda a: np.array([0, 7, 6], np.int32), ValueError, "must rise from 0"),
    ("softmax_scale", lambda a: -1.0, ValueError, "softmax_scale=-1.0"),
    ("softmax_scale", lambda a: float("nan"), ValueError, "softmax_scale=nan"),
    ("softcap", lambda a: -2.0, ValueError, "softcap=-2.0"),
    ("sliding_window", lambda a: 0, ValueError, "sliding_window=0"),
    ("sliding_window", lambda a: 2.5, TypeError, "sliding_window=2.5"),
    ("sinks", lambda a: np.zeros(3, np.float32), ValueError, "sinks has shape"),
    ("out", lambda a: np.zeros((6, NUM_HEADS, HEAD_SIZE), np.float32), TypeError, "out has dtype"),
    ("out", lambda a: np.zeros((5, NUM_HEADS, HEAD_SIZE), np.float16), ValueError, "out has shape"),
]


@pytest.mark.parametrize("argument,spoil,error,message", ATTENTION_ERRORS)
def test_bad_attention_call(setup, argument, spoil, error, message):
    cache, _, attend = setup
    before = snapshot(cache)
    spoilt = spoil(attend)
    out_before = spoilt.copy() if argument == "out" else None
    with pytest.raises(error, match=message):
        kc.paged_attention(**{**attend, argument: spoilt})
    assert snapshot(cache) == before
    if out_before is not None:
        np.testing.assert_array_equal(spoilt, out_before)


ALLOCATE_ERRORS = [
    (dict(kv_dtype="int3"), ValueError, "kv_dtype='int3'"),
    (dict(head_size=95), ValueError, "head_size=95"),
    (dict(head_size=512), ValueError, "head_size=512"),
    (dict(num_blocks=0), ValueError, "num_blocks=0"),
    (dict(block_size=1.5), TypeError, "block_size=1.5"),
    (dict(device="cuda"), ValueError, "device='cuda'"),
    (dict(device="tpu"), ValueError, "device='tpu'"),
    (dict(rotation=kc.rotation_plan(96)), ValueError, "rotation is for head_size=96"),
    (dict(rotation="blockdiag"), TypeError, "rotation must be a RotationPlan"),
    (dict(kv_dtype="auto", dtype="int8"), ValueError, "dtype='int8'"),
]


@pytest.mark.parametrize("changes,error,message", ALLOCATE_ERRORS)
def test_bad_allocation(changes, error, message):
    args = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_size=64) | changes
    with pytest.raises(error, match=message):
        kc.allocate_cache(**args)


def test_wrap_cache_checks_its_tensors():
    keys = np.zeros((4, 16, 2, 32), np.uint8)
    scales = np.zeros((4, 16, 2), np.float32)
    with pytest.raises(TypeError, match="key_cache has dtype int8"):
        kc.wrap_cache(keys.view(np.int8), keys, scales, scales, kv_dtype="int4_per_token_head")
    with pytest.raises(ValueError, match="value_cache"):
        kc.wrap_cache(keys, keys[:2], scales, scales, kv_dtype="int4_per_token_head")
    with pytest.raises(ValueError, match="k_scale_cache is required"):
        kc.wrap_cache(keys, keys, None, scales, kv_dtype="int4_per_token_head")
    with pytest.raises(ValueError, match="v_scale_cache has shape"):
        kc.wrap_cache(keys, keys, scales, scales[:, :8], kv_dtype="int4_per_token_head")
    with pytest.raises(ValueError, match="contiguous last axis"):
        kc.wrap_cache(keys[..., ::2], keys[..., ::2], scales, scales, kv_dtype="int4_per_token_head")
    with pytest.raises(ValueError, match="k_scale_cache must be None"):
        kc.wrap_cache(np.zeros((4, 16, 2, 64), np.float16), np.zeros((4, 16, 2, 64), np.float16),
                      scales, None, kv_dtype="auto")


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="hadamard"), "kind='hadamard'"),
    (dict(preset="llama"), "preset='llama'"),
    (dict(head_size=33), "head_size=33"),
])
def test_bad_rotation_plan(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kc.rotation_plan(**({"head_size": 64} | kwargs))


def test_rotate_checks_its_input():
    plan = kc.rotation_plan(64)
    with pytest.raises(ValueError, match="plan's head_size=64"):
        kc.rotate(np.zeros((2, 32), np.float32), plan)
    with pytest.raises(TypeError, match="plan must be a RotationPlan"):
        kc.rotate(np.zeros((2, 64), np.float32), "blockdiag")


# Errors name the arguments as the caller gave them: one the caller left out is
# not quoted back at them with the value kvcupy filled in.
def test_decode_default_is_named_when_query_tokens_do_not_match(setup):
    cache, _, attend = setup
    before = snapshot(cache)
    one_token = attend["query"][:1]
    with pytest.raises(ValueError) as raised:
        kc.paged_attention(one_token, cache, block_table=attend["block_table"], seq_lens=attend["seq_lens"])
    assert str(raised.value) == ("1 query token for 2 sequences (seq_lens): without cu_seqlens_q each "
                                 "sequence takes exactly one (decode); pass cu_seqlens_q to give a "
                                 "sequence several")
    assert snapshot(cache) == before


def test_a_batch_planned_without_query_offsets_says_so(setup):
    cache, _, attend = setup
    batch = kc.plan_batch(block_table=attend["block_table"], seq_lens=attend["seq_lens"],
                          block_size=BLOCK_SIZE, num_blocks=cache.key_cache.shape[0])
    with pytest.raises(ValueError, match=r"^query has 6 tokens; batch was planned for 2 \(its cu_seqlens_q, "
                                         r"or one per sequence when planned without one\)$"):
        kc.paged_attention(attend["query"], cache, batch=batch)


def test_given_query_offsets_are_quoted_back(setup):
    cache, _, attend = setup
    with pytest.raises(ValueError, match=r"^cu_seqlens_q=\[0, 1, 5\] must rise from 0 to the number of "
                                         r"query tokens \(6\)$"):
        kc.paged_attention(**{**attend, "cu_seqlens_q": np.array([0, 1, 5], np.int32)})
