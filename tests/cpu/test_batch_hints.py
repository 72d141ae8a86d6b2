"""max_query_len / max_seq_len: host bounds beside device metadata (plan_batch,
paged_attention, PagedKVCache), their checks, and what the CUDA planner makes of
them (planner.plan_work, on the host with a stand-in cache: no GPU, so it runs in CI)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends
from kvcupy.backends.cuda import kernels, planner

from ..helpers import paged_batch, snapshot
from .test_backends import FakeBackend, OnFakeDevice

SMS = 132   # an H200's multiprocessors
GROUP, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 8, 128, 16


@pytest.fixture
def fake():
    """Index arrays wrapped in OnFakeDevice then count as CUDA memory: the host never
    reads their contents (unless validate=True)."""
    backend = FakeBackend()
    backends.register("fake", backend, "cuda")
    yield backend
    backends.unregister("fake")


class Addressed:
    """What the planner reads of a device tensor: shape, byte strides, an address."""

    def __init__(self, array):
        self.shape, self.strides, self.itemsize = array.shape, array.strides, array.itemsize
        self.data = type("Pointer", (), {"ptr": 1 << 20})()


def stand_in_cache(kv_dtype: str, num_blocks: int):
    """A CUDA cache's CacheArrays as the planner sees it, from a host cache's geometry."""
    arrays = kc.cache_arrays(kc.allocate_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, kv_dtype))
    tensors = {name: None if getattr(arrays, name) is None else Addressed(getattr(arrays, name))
               for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")}
    return replace(arrays, **tensors, device=kc.Device("cuda", 0))


def metadata(batch, on_device: tuple, decode: bool = False) -> dict:
    """plan_batch's index arguments, those named in `on_device` as device arrays;
    decode: no cu_seqlens_q (one token each)."""
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens,
                cu_seqlens_q=None if decode else batch.cu_seqlens_q)
    return {name: OnFakeDevice(a) if name in on_device and a is not None else a for name, a in args.items()}


BATCHES = {   # (sequence lengths, new query tokens): every sequence alike
    "decode": ([1000] * 64, [1] * 64),
    "long decode": ([32768] * 2, [1] * 2),
    "speculative": ([3000] * 16, [4] * 16),
    "prompts": ([128] * 64, [128] * 64),
    "chunk": ([4096] * 4, [512] * 4),
}
ON_DEVICE = {"all": ("block_table", "seq_lens", "cu_seqlens_q"), "lengths": ("block_table", "seq_lens"),
             "table": ("block_table",)}


def work(batch_plan, cache, num_tokens: int, capability: int):
    return planner.plan_work(batch_plan, cache, GROUP * NUM_KV_HEADS, num_tokens, capability, SMS)


def same_work(a, b) -> bool:
    return ((a.kernel, a.num_splits, a.split_tokens, a.head_groups) == (b.kernel, b.num_splits, b.split_tokens,
                                                                        b.head_groups)
            and np.array_equal(a.tiles, b.tiles))


@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("placement", ON_DEVICE)
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "fp8_per_token_head", "auto"])
@pytest.mark.parametrize("capability", [90, 80])
def test_hints_plan_device_metadata_as_host_metadata(fake, name, placement, kv_dtype, capability):
    seq_lens, query_lens = BATCHES[name]
    batch = paged_batch(np.random.default_rng(0), seq_lens, query_lens, BLOCK_SIZE)
    cache = stand_in_cache(kv_dtype, batch.num_blocks)
    common = dict(block_size=BLOCK_SIZE, num_blocks=batch.num_blocks)
    decode = max(query_lens) == 1
    on_host = kc.plan_batch(**metadata(batch, (), decode), **common)
    hinted = kc.plan_batch(**metadata(batch, ON_DEVICE[placement], decode), **common,
                           max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    assert on_host.host is not None and hinted.host is None
    assert same_work(work(on_host, cache, batch.num_queries, capability),
                     work(hinted, cache, batch.num_queries, capability))


@pytest.mark.parametrize("placement", ["all", "lengths"])
def test_without_hints_device_metadata_plans_for_the_whole_query_and_table(fake, placement):
    """64 prompts of 128 tokens: unhinted, every sequence is planned as if it could hold
    all 8192 query tokens (64 times the row tiles) and, with seq_lens on the device,
    the block table's every key; hinted, as the host plans it."""
    batch = paged_batch(np.random.default_rng(1), [128] * 64, [128] * 64, BLOCK_SIZE, spare_blocks=0)
    batch.block_table = np.pad(batch.block_table, ((0, 0), (0, 24)))   # room for 512 keys a sequence
    cache = stand_in_cache("int4_per_token_head", batch.num_blocks)
    common = dict(block_size=BLOCK_SIZE, num_blocks=batch.num_blocks)
    unhinted = kc.plan_batch(**metadata(batch, ON_DEVICE[placement]), **common)
    hinted = kc.plan_batch(**metadata(batch, ON_DEVICE[placement]), **common, max_query_len=128, max_seq_len=128)
    assert unhinted.bounds(batch.num_queries) == ((8192 if placement == "all" else 128), 512)
    assert hinted.bounds(batch.num_queries) == (128, 128)
    slow, fast = (work(plan, cache, batch.num_queries, 90) for plan in (unhinted, hinted))
    rows = fast.kernel.rows_per_tile
    assert len(fast.tiles) == 64 * -(-128 * GROUP // rows)
    if placement == "all":
        assert len(slow.tiles) == 64 * -(-8192 * GROUP // slow.kernel.rows_per_tile) > 32 * len(fast.tiles)
    assert not same_work(slow, fast)


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("query_lens", [[1, 3, 1, 2], [300, 40, 1, 129]], ids=["decode", "mixed"])
def test_hints_on_uneven_batches_cover_every_tile_with_the_host_build(fake, capability, query_lens):
    """Sequences of different lengths: the device plan takes the host plan's build and
    holds every (sequence, row tile) the host plan launches (more where sequences are
    shorter than the longest, which the kernel skips)."""
    seq_lens = [4000, 700, 2500, 1300]
    batch = paged_batch(np.random.default_rng(2), seq_lens, query_lens, BLOCK_SIZE)
    cache = stand_in_cache("int8_per_token_head", batch.num_blocks)
    common = dict(block_size=BLOCK_SIZE, num_blocks=batch.num_blocks)
    host = work(kc.plan_batch(**metadata(batch, ()), **common), cache, batch.num_queries, capability)
    device = work(kc.plan_batch(**metadata(batch, ON_DEVICE["all"]), **common, max_query_len=max(query_lens),
                                max_seq_len=max(seq_lens)), cache, batch.num_queries, capability)
    assert device.kernel == host.kernel and isinstance(host.kernel, kernels.PrefillKernel) == (max(query_lens) > 64)
    assert {tuple(t) for t in host.tiles} <= {tuple(t) for t in device.tiles}


# --- the hints' checks --------------------------------------------------------

TABLE = np.array([[0, 1], [2, 3]], np.int32)        # 2 sequences, 32 keys each at most
LENS = np.array([20, 9], np.int32)
STARTS = np.array([0, 5, 12], np.int32)             # 5 and 7 new query tokens


def plan(**kwargs):
    args = dict(block_table=TABLE, seq_lens=LENS, cu_seqlens_q=STARTS, block_size=16, num_blocks=4)
    return kc.plan_batch(**{**args, **kwargs})


@pytest.mark.parametrize("name", ["max_query_len", "max_seq_len"])
@pytest.mark.parametrize("value,error", [(7.0, TypeError), ("20", TypeError), (True, TypeError),
                                         (np.array([20]), TypeError), (0, ValueError), (-3, ValueError)])
def test_a_hint_that_is_not_a_positive_int_is_named(name, value, error):
    with pytest.raises(error, match=f"{name}="):
        plan(**{name: value})


@pytest.mark.parametrize("hints,message", [
    (dict(max_seq_len=33), r"max_seq_len=33 exceeds what block_table's rows cover: 2 blocks x 16 = 32 tokens"),
    (dict(max_query_len=21, max_seq_len=20), r"max_query_len=21 exceeds max_seq_len=20"),
    (dict(max_query_len=6), r"max_query_len=6, but sequence 1 has 7 new query tokens \(cu_seqlens_q\)"),
    (dict(max_seq_len=19), r"max_seq_len=19, but seq_lens\[0\]=20"),
])
@pytest.mark.parametrize("validate", [False, True])
def test_hints_that_break_a_rule_or_the_host_contents_are_named(hints, message, validate):
    with pytest.raises(ValueError, match=message):
        plan(**hints, validate=validate)


@pytest.mark.parametrize("hints,message", [
    (dict(max_query_len=6), r"max_query_len=6, but sequence 1 has 7 new query tokens"),
    (dict(max_seq_len=19), r"max_seq_len=19, but seq_lens\[0\]=20"),
])
def test_device_contents_are_trusted_unless_validated(fake, hints, message):
    args = dict(block_table=OnFakeDevice(TABLE), seq_lens=OnFakeDevice(LENS), cu_seqlens_q=OnFakeDevice(STARTS))
    trusted = plan(**args, **hints)
    assert trusted.host is None and (trusted.max_query_len, trusted.max_seq_len) == (
        hints.get("max_query_len"), hints.get("max_seq_len"))
    with pytest.raises(ValueError, match=message):
        plan(**args, **hints, validate=True)


@pytest.mark.parametrize("hints,bounds", [
    ({}, (7, 20)), (dict(max_query_len=7), (7, 20)), (dict(max_query_len=10, max_seq_len=32), (10, 32))])
def test_host_metadata_bounds_are_the_hints_else_the_contents(hints, bounds):
    batch = plan(**hints)
    assert (batch.max_query_len, batch.max_seq_len) == bounds
    assert batch.bounds(12) == bounds
    assert batch.bounds(4) == (4, bounds[1])   # never more query tokens than the call has


def test_decode_without_offsets_knows_one_query_token_each(fake):
    batch = plan(cu_seqlens_q=None, block_table=OnFakeDevice(TABLE), seq_lens=OnFakeDevice(LENS))
    assert (batch.max_query_len, batch.max_seq_len) == (1, None)
    assert batch.bounds(2) == (1, 32)
    with pytest.raises(ValueError, match="max_seq_len=40 exceeds"):
        plan(cu_seqlens_q=None, block_table=OnFakeDevice(TABLE), seq_lens=OnFakeDevice(LENS), max_seq_len=40)


def host_cache():
    rng = np.random.default_rng(5)
    cache = kc.allocate_cache(4, 16, 2, 64)
    kv = rng.standard_normal((64, 2, 64)).astype(np.float32)
    kc.reshape_and_cache(kv, kv, cache, np.arange(64))
    return cache, rng.standard_normal((12, 4, 64)).astype(np.float32)


def test_paged_attention_takes_hints_and_checks_them():
    cache, query = host_cache()
    args = dict(block_table=TABLE, seq_lens=LENS, cu_seqlens_q=STARTS)
    plain = kc.paged_attention(query, cache, **args)
    np.testing.assert_array_equal(kc.paged_attention(query, cache, **args, max_query_len=7, max_seq_len=20), plain)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"max_seq_len=19, but seq_lens\[0\]=20"):
        kc.paged_attention(query, cache, **args, max_seq_len=19)
    out = np.zeros_like(query)
    with pytest.raises(ValueError, match="max_query_len=6, but sequence 1"):
        kc.paged_attention(query, cache, **args, max_query_len=6, out=out)
    assert snapshot(cache) == before and not out.any()


@pytest.mark.parametrize("hint", ["max_query_len", "max_seq_len"])
def test_hints_beside_a_batch_plan_are_refused(hint):
    cache, query = host_cache()
    with pytest.raises(TypeError, match="max_query_len / max_seq_len go to kvcupy.plan_batch"):
        kc.paged_attention(query, cache, batch=plan(), **{hint: 7})


@pytest.mark.parametrize("steps", [[(5, 1), (1, 1)], [(3, 9), (2, 1), (1, 4)]], ids=["even", "uneven"])
def test_the_manager_fills_the_hints_of_its_plans(steps):
    """PagedKVCache knows every length on the host: its plans carry the longest query run
    and the longest sequence of the step."""
    mgr = kc.PagedKVCache(num_layers=1, num_blocks=16, block_size=16, num_kv_heads=2, head_size=64)
    seqs = [mgr.add_sequence(), mgr.add_sequence()]
    lengths = [0, 0]
    for counts in steps:
        mgr.reserve(seqs, list(counts))
        lengths = [n + c for n, c in zip(lengths, counts)]
        batch = mgr.plan(seqs, list(counts))
        assert (batch.max_query_len, batch.max_seq_len) == (max(counts), max(lengths))


def test_a_plan_is_not_built_while_the_stream_captures(fake, monkeypatch):
    """plan_attention uploads its tile list: under capture it refuses before anything
    reaches the device, and says to build and run the plan before the capture."""
    monkeypatch.setattr(planner, "capturing", lambda: True)
    batch = paged_batch(np.random.default_rng(6), [40, 70], [1, 1], BLOCK_SIZE)
    device = kc.plan_batch(**metadata(batch, ON_DEVICE["all"], decode=True), block_size=BLOCK_SIZE,
                           num_blocks=batch.num_blocks, max_seq_len=70)
    with pytest.raises(RuntimeError, match=r"paged_attention would build and upload its plan while the stream is "
                                           r"being captured: build the plan with kvcupy\.plan_batch\(\.\.\.\) and "
                                           r"make one call with batch= before the capture"):
        planner.plan_attention(device, stand_in_cache("int4_per_token_head", batch.num_blocks), 16, 2)
