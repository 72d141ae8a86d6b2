"""Repeated calls replay their launches (kvcupy.replay): a call that differs from an
earlier one only in its data pointers makes no full call into the backend, and
writes the bytes the full path writes for the same arguments (validate=True
always takes the full path, so it is the reference here). Calls whose launches
read a copy (kron's float32 query, a strided query) are never recorded, and a
call whose arguments differ in anything else takes the full path and its checks."""

from __future__ import annotations

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends

pytestmark = pytest.mark.gpu

if not backends.status("cuda").usable:
    pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}",
                allow_module_level=True)

import cupy  # noqa: E402

from kvcupy import replay  # noqa: E402
from kvcupy.backends import cuda as cuda_backend  # noqa: E402

from ..helpers import paged_batch  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 8, 2, 16


@pytest.fixture
def full_calls(monkeypatch):
    """How often each of the CUDA backend's entries ran (a replay runs none)."""
    counts = {"paged_attention": 0, "reshape_and_cache": 0, "rotate": 0}

    def counted(name):
        original = getattr(cuda_backend, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return call

    for name in counts:
        monkeypatch.setattr(cuda_backend, name, counted(name))
    return counts


def arrays_of(framework: str, torch_module=None):
    """randn(shape, seed) and empty(shape) in fp16 on the GPU, in `framework`."""
    if framework == "torch":
        torch = torch_module

        def randn(shape, seed):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            return torch.randn(shape, generator=generator, device="cuda", dtype=torch.float16)
        return randn, lambda shape: torch.empty(shape, device="cuda", dtype=torch.float16)

    def randn(shape, seed):
        return cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    return randn, lambda shape: cupy.empty(shape, cupy.float16)


def host(x) -> np.ndarray:
    return x.cpu().numpy() if hasattr(x, "cpu") else cupy.asnumpy(x)


def filled_cache(kv_dtype, head_size, rotation, seq_lens, query_lens, seed=0):
    """A cache with every token of a random paged batch written, and the batch."""
    rng = np.random.default_rng(seed)
    layout = paged_batch(rng, seq_lens, query_lens, BLOCK_SIZE)
    cache = kc.allocate_cache(layout.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size, kv_dtype,
                              rotation=rotation, device="cuda")
    tokens = rng.standard_normal((layout.num_tokens, NUM_KV_HEADS, head_size)).astype(np.float16)
    kc.reshape_and_cache(cupy.asarray(tokens), cupy.asarray(tokens[::-1].copy()), cache, layout.slot_mapping)
    return cache, layout


@pytest.fixture(params=["torch", "cupy"])
def framework(request):
    if request.param == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA device here")
        return "torch", torch
    return "cupy", None


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto"])
@pytest.mark.parametrize("query_len", [1, 7])
@pytest.mark.parametrize("head_size", [96, 128])
def test_a_repeated_call_replays_the_full_paths_launches(full_calls, framework, kv_dtype, query_len, head_size):
    name, torch = framework
    randn, empty = arrays_of(name, torch)
    seq_lens = [40, 300, 17]
    cache, layout = filled_cache(kv_dtype, head_size, None, seq_lens, [query_len] * 3)
    batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens,
                          cu_seqlens_q=layout.cu_seqlens_q, block_size=BLOCK_SIZE, num_blocks=layout.num_blocks)
    shape = (layout.num_queries, NUM_HEADS, head_size)
    kc.paged_attention(randn(shape, 1), cache, batch=batch, out=empty(shape))
    assert full_calls["paged_attention"] == 1 and len(batch._replays) == 1

    query, out = randn(shape, 2), empty(shape)
    kc.paged_attention(query, cache, batch=batch, out=out)
    assert full_calls["paged_attention"] == 1
    kc.paged_attention(query, cache, batch=batch)           # without out=: a key of its own
    fresh = kc.paged_attention(query, cache, batch=batch)   # replayed, out allocated by the replay
    assert full_calls["paged_attention"] == 2
    assert type(fresh) is type(query)

    expected = kc.paged_attention(query, cache, batch=batch, validate=True)
    assert full_calls["paged_attention"] == 3
    assert host(out).tobytes() == host(expected).tobytes()
    assert host(fresh).tobytes() == host(expected).tobytes()


def test_device_metadata_without_a_plan_replays_with_new_contents(full_calls, torch_cuda):
    torch = torch_cuda
    randn, empty = arrays_of("torch", torch)
    seq_lens = [90, 33, 250, 64]
    cache, layout = filled_cache("int4_per_token_head", 128, None, seq_lens, [1] * 4)
    block_table = torch.as_tensor(layout.block_table, device="cuda")
    lengths = torch.as_tensor(layout.seq_lens, device="cuda")
    shape = (4, NUM_HEADS, 128)
    kc.paged_attention(randn(shape, 1), cache, block_table=block_table, seq_lens=lengths, out=empty(shape))
    # The same tensors with new contents (a decode step later shortened here): a
    # device plan never read them on the host, so the replay reads the new ones.
    lengths -= torch.as_tensor([5, 0, 17, 1], device="cuda", dtype=lengths.dtype)
    query, out = randn(shape, 2), empty(shape)
    kc.paged_attention(query, cache, block_table=block_table, seq_lens=lengths, out=out)
    assert full_calls["paged_attention"] == 1
    expected = kc.paged_attention(query, cache, block_table=block_table, seq_lens=lengths, validate=True)
    assert host(out).tobytes() == host(expected).tobytes()


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "auto"])
@pytest.mark.parametrize("planned", [True, False], ids=["SlotMapping", "device slot ids"])
def test_a_repeated_write_replays_the_full_paths_launch(full_calls, framework, kv_dtype, planned):
    name, torch = framework
    randn, _ = arrays_of(name, torch)
    num_tokens, head_size, num_blocks = 21, 96, 4
    slot_ids = np.random.default_rng(3).permutation(num_blocks * BLOCK_SIZE)[:num_tokens]
    device_slots = torch.as_tensor(slot_ids, device="cuda") if name == "torch" else cupy.asarray(slot_ids)
    caches = [kc.allocate_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size, kv_dtype, device="cuda")
              for _ in range(2)]
    slots = kc.plan_slots(device_slots, num_slots=num_blocks * BLOCK_SIZE) if planned else device_slots
    shape = (num_tokens, NUM_KV_HEADS, head_size)
    kc.reshape_and_cache(randn(shape, 1), randn(shape, 2), caches[0], slots)
    key, value = randn(shape, 3), randn(shape, 4)
    kc.reshape_and_cache(key, value, caches[0], slots)
    assert full_calls["reshape_and_cache"] == 1
    kc.reshape_and_cache(key, value, caches[1], device_slots, validate=True)
    for replayed, full in zip(caches[0].tensors(), caches[1].tensors()):
        assert cupy.asnumpy(replayed).tobytes() == cupy.asnumpy(full).tobytes()


def test_calls_that_read_a_copy_are_not_recorded(full_calls):
    randn, empty = arrays_of("cupy")
    kron = kc.rotation_plan(96, "kron")
    cache, layout = filled_cache("int4_per_token_head", 96, kron, [50, 20], [1, 1])
    batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens, block_size=BLOCK_SIZE,
                          num_blocks=layout.num_blocks)
    for seed in (1, 2):
        kc.paged_attention(randn((2, NUM_HEADS, 96), seed), cache, batch=batch, out=empty((2, NUM_HEADS, 96)))
    cache, layout = filled_cache("int8_per_token_head", 96, None, [50, 20], [1, 1])
    batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens, block_size=BLOCK_SIZE,
                          num_blocks=layout.num_blocks)
    for seed in (1, 2):   # a query without a contiguous last axis is copied
        strided = randn((2, NUM_HEADS, 192), seed)[:, :, ::2]
        kc.paged_attention(strided, cache, batch=batch, out=empty((2, NUM_HEADS, 96)))
    assert full_calls["paged_attention"] == 4
    assert not batch._replays


def test_a_call_that_differs_in_more_than_pointers_is_checked_again(full_calls):
    randn, empty = arrays_of("cupy")
    cache, layout = filled_cache("int4_per_token_head", 128, None, [50, 20], [1, 1])
    batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens, block_size=BLOCK_SIZE,
                          num_blocks=layout.num_blocks)
    shape = (2, NUM_HEADS, 128)
    kc.paged_attention(randn(shape, 1), cache, batch=batch, out=empty(shape))
    with pytest.raises(TypeError, match="out has dtype float32"):
        kc.paged_attention(randn(shape, 2), cache, batch=batch, out=cupy.empty(shape, cupy.float32))
    with pytest.raises(TypeError, match="softmax_scale=True must be a number"):
        kc.paged_attention(randn(shape, 2), cache, batch=batch, out=empty(shape), softmax_scale=True)
    with pytest.raises(ValueError, match="query has 3 tokens"):
        kc.paged_attention(randn((3, NUM_HEADS, 128), 2), cache, batch=batch, out=empty((3, NUM_HEADS, 128)))
    assert full_calls["paged_attention"] == 1   # each refused by the full path's checks


def test_a_replayed_call_is_captured_in_a_cuda_graph(full_calls, torch_cuda):
    torch = torch_cuda
    randn, empty = arrays_of("torch", torch)
    cache, layout = filled_cache("int4_per_token_head", 128, None, [300, 77, 5], [1, 1, 1])
    batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens, block_size=BLOCK_SIZE,
                          num_blocks=layout.num_blocks)
    shape = (3, NUM_HEADS, 128)
    query, out = randn(shape, 1), empty(shape)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kc.paged_attention(randn(shape, 2), cache, batch=batch, out=empty(shape))   # recorded
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            kc.paged_attention(query, cache, batch=batch, out=out)
    query.copy_(randn(shape, 3))
    graph.replay()
    torch.cuda.synchronize()
    assert full_calls["paged_attention"] == 1
    expected = kc.paged_attention(query, cache, batch=batch, validate=True)
    assert host(out).tobytes() == host(expected).tobytes()


def test_a_recorded_call_serves_every_layers_cache(full_calls, framework):
    name, torch = framework
    randn, empty = arrays_of(name, torch)
    layers = [filled_cache("int8_per_token_head", 128, None, [70, 20, 33], [1, 1, 1], seed=seed)
              for seed in range(3)]
    layout = layers[0][1]   # every seed's batch has the same page count: one geometry
    batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens, block_size=BLOCK_SIZE,
                          num_blocks=layout.num_blocks)
    slots = kc.plan_slots(np.arange(3, dtype=np.int64), num_slots=layout.num_blocks * BLOCK_SIZE)
    shape, token = (3, NUM_HEADS, 128), (3, NUM_KV_HEADS, 128)
    for cache, _ in layers:   # the first layer's calls record, the others' replay them
        kc.reshape_and_cache(randn(token, 5), randn(token, 6), cache, slots)
        kc.paged_attention(randn(shape, 1), cache, batch=batch, out=empty(shape))
    full = dict(full_calls)
    outs = [empty(shape) for _ in layers]
    query = randn(shape, 2)
    for (cache, _), out in zip(layers, outs):
        kc.paged_attention(query, cache, batch=batch, out=out)
    assert full_calls == full   # every layer replayed
    for (cache, _), out in zip(layers, outs):
        expected = kc.paged_attention(query, cache, batch=batch, validate=True)
        assert host(out).tobytes() == host(expected).tobytes()


def test_sinks_on_the_host_are_copied_each_call_and_device_sinks_replay(full_calls):
    randn, empty = arrays_of("cupy")
    cache, layout = filled_cache("int4_per_token_head", 128, None, [50, 20], [1, 1])
    shape = (2, NUM_HEADS, 128)
    logits = np.random.default_rng(4).standard_normal(NUM_HEADS).astype(np.float32)
    for sinks, recorded in ((logits, False), (cupy.asarray(logits), True)):
        batch = kc.plan_batch(block_table=layout.block_table, seq_lens=layout.seq_lens, block_size=BLOCK_SIZE,
                              num_blocks=layout.num_blocks)
        before = full_calls["paged_attention"]
        query, out = randn(shape, 1), empty(shape)
        for _ in range(2):
            kc.paged_attention(query, cache, batch=batch, sinks=sinks, out=out)
        assert full_calls["paged_attention"] - before == (1 if recorded else 2)
        assert bool(batch._replays) == recorded
        expected = kc.paged_attention(query, cache, batch=batch, sinks=sinks, validate=True)
        assert cupy.asnumpy(out).tobytes() == cupy.asnumpy(expected).tobytes()


@pytest.mark.parametrize("kind", ["blockdiag", "kron"])
@pytest.mark.parametrize("head_size", [96, 128])
def test_a_repeated_rotation_replays_into_a_new_output(full_calls, framework, kind, head_size, monkeypatch):
    monkeypatch.setattr(replay.ROTATIONS, "_replays", {})   # what other tests recorded
    name, torch = framework
    randn, _ = arrays_of(name, torch)
    plan = kc.rotation_plan(head_size, kind)
    shape = (9, 4, head_size)
    for inverse in (False, True):
        before = full_calls["rotate"]
        kc.rotate(randn(shape, 1), plan, inverse=inverse)
        x = randn(shape, 2)
        got = kc.rotate(x, plan, inverse=inverse)
        assert full_calls["rotate"] == before + 1 and type(got) is type(x)
        expected = kc.rotate(host(x), plan, inverse=inverse)   # the CPU backend, to the bit
        assert host(got).tobytes() == np.asarray(expected).tobytes()
    before = full_calls["rotate"]
    for seed in (3, 4):   # rows that are not a view of x: copied, so never recorded
        kc.rotate(randn((9, 8, head_size), seed)[:, ::2], plan)
    assert full_calls["rotate"] == before + 2
