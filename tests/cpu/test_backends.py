"""The backend registry: calls go to the backend of the device their arrays live on,
and a step's metadata is checked and planned once for all layers."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, cache as cache_module, interop
from kvcupy.backends import cpu

from ..helpers import paged_batch, relative_error


class OnFakeDevice:
    """Host memory that says it lives on CUDA device 0 (DLPack kDLCUDA)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (2, 0)

    @property
    def shape(self):
        return self.array.shape

    @property
    def nbytes(self):
        return self.array.nbytes


class FakeBackend:
    """Serves "cuda" devices by running the CPU backend on host memory, and records
    every protocol call it gets."""

    name = "fake"
    device_kind = "cuda"

    def __init__(self):
        self.calls = []

    def availability(self):
        return True, "a test double"

    def import_dlpack(self, x):
        # The "device" memory is host memory: import it as such.
        return np.from_dlpack(interop._Relabelled(x.__dlpack__(), (1, 0)))

    def zeros(self, shape, dtype, device):
        return OnFakeDevice(np.zeros(shape, dtype))

    def empty(self, shape, dtype, device):
        return np.empty(shape, dtype)

    def upload(self, array, device):
        return array

    def dlpack_stream(self, device):
        return None

    def device_context(self, device):
        return contextlib.nullcontext()

    def stream_context(self, device, stream):
        return contextlib.nullcontext()

    def synchronize(self, device):
        pass

    def __getattr__(self, method):
        """rotate, reshape_and_cache, plan_attention, paged_attention, copy_blocks:
        recorded, then done by the CPU backend."""
        def call(*args, **kwargs):
            self.calls.append(method)
            return getattr(cpu, method)(*args, **kwargs)
        return call


@pytest.fixture
def fake():
    backend = FakeBackend()
    backends.register("fake", backend, "cuda")
    yield backend
    backends.unregister("fake")


def test_calls_go_to_the_backend_of_the_arrays_device(fake, monkeypatch):
    host_calls = []
    for method in ("reshape_and_cache", "paged_attention", "rotate"):
        original = getattr(cpu, method)
        monkeypatch.setattr(cpu, method, lambda *a, _m=method, _f=original, **k: (host_calls.append(_m), _f(*a, **k))[1])
    rng = np.random.default_rng(0)
    batch = paged_batch(rng, [20, 7], [1, 7], 16)
    device_cache = kc.allocate_cache(batch.num_blocks, 16, 2, 64, device="cuda")
    host_cache = kc.allocate_cache(batch.num_blocks, 16, 2, 64)
    assert device_cache.device == interop.Device("cuda", 0) and host_cache.device == interop.HOST
    kv = rng.standard_normal((batch.num_tokens, 2, 64)).astype(np.float32)
    query = rng.standard_normal((batch.num_queries, 4, 64)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)

    kc.reshape_and_cache(OnFakeDevice(kv), OnFakeDevice(kv), device_cache, batch.slot_mapping)
    on_device = kc.paged_attention(OnFakeDevice(query), device_cache, **args)
    kc.rotate(OnFakeDevice(query), kc.rotation_plan(64))
    assert fake.calls == ["reshape_and_cache", "plan_attention", "paged_attention", "rotate"]
    assert host_calls == ["reshape_and_cache", "paged_attention", "rotate"]   # the fake's delegation

    host_calls.clear()
    kc.reshape_and_cache(kv, kv, host_cache, batch.slot_mapping)
    on_host = kc.paged_attention(query, host_cache, **args)
    assert host_calls == ["reshape_and_cache", "paged_attention"]
    assert fake.calls[4:] == []
    np.testing.assert_array_equal(on_device, on_host)


def test_data_on_another_device_than_the_cache_names_both(fake):
    device_cache = kc.allocate_cache(4, 16, 2, 64, device="cuda")
    kv = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(TypeError, match="key is on cpu but the cache is on cuda:0"):
        kc.reshape_and_cache(kv, kv, device_cache, np.arange(2))
    with pytest.raises(TypeError, match="key is on cuda:0 but value is on cpu"):
        kc.reshape_and_cache(OnFakeDevice(kv), kv, device_cache, np.arange(2))


def test_backend_listing_and_auto():
    statuses = {s.name: s for s in kc.list_backends()}
    assert statuses["cpu"].usable and statuses["cpu"].device_kind == "cpu"
    assert set(statuses) >= {"cpu", "cuda", "rocm"}
    expected = next(name for name in backends.AUTO_ORDER if statuses[name].usable)
    assert backends.resolve("auto") == expected


def test_a_32_layer_decode_step_checks_and_plans_once(monkeypatch):
    counts = {"plan_batch": 0, "plan_attention": 0, "plan_slots": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(cache_module, "plan_batch", counted("plan_batch", cache_module.plan_batch))
    monkeypatch.setattr(cache_module, "plan_slots", counted("plan_slots", cache_module.plan_slots))
    monkeypatch.setattr(cpu, "plan_attention", counted("plan_attention", cpu.plan_attention))
    rng = np.random.default_rng(0)
    mgr = kc.PagedKVCache(32, 16, 16, 2, 64)
    seqs = [mgr.add_sequence() for _ in range(3)]
    for query_lens in (5, 1):   # a prefill step, then a decode step
        counts.update(plan_batch=0, plan_attention=0, plan_slots=0)
        slot_mapping = mgr.reserve(seqs, query_lens)
        kv = rng.standard_normal((len(slot_mapping), 2, 64)).astype(np.float32)
        query = rng.standard_normal((3 * query_lens, 4, 64)).astype(np.float32)
        for layer in range(32):
            mgr.write(layer, kv, kv, slot_mapping)
            mgr.attention(layer, query, seqs, query_lens=query_lens)
        assert counts == {"plan_batch": 1, "plan_attention": 1, "plan_slots": 1}, counts


def test_copy_on_write_is_one_backend_call_for_all_layers(fake):
    mgr = kc.PagedKVCache(4, 8, 16, 2, 64, device="cuda")
    rng = np.random.default_rng(3)
    a = mgr.add_sequence()
    slots = mgr.reserve([a], 20)
    kv = rng.standard_normal((20, 2, 64)).astype(np.float32)
    for layer in range(4):
        mgr.write(layer, OnFakeDevice(kv), OnFakeDevice(kv), slots)
    b = mgr.fork(a)
    fake.calls.clear()
    mgr.reserve([a, b], 1)   # both append into the shared half-full page: one copy
    assert fake.calls == ["copy_blocks"]
    shared, private = mgr.block_table(b)[-1], mgr.block_table(a)[-1]
    for layer in mgr.layers:
        for tensor in layer.tensors():
            np.testing.assert_array_equal(tensor.array[private], tensor.array[shared])


def test_a_batch_plans_attention_once_per_cache_format(monkeypatch):
    """One BatchPlan passed with caches of two KV dtypes: the backend plans each
    format once (a plan made for int4 never serves an int8 cache), and both
    results match the oracle."""
    from kvcupy import reference

    calls = []
    original = cpu.plan_attention
    monkeypatch.setattr(cpu, "plan_attention", lambda *a, **k: calls.append(a[1].kv_dtype) or original(*a, **k))
    rng = np.random.default_rng(4)
    table = np.array([[0, 1], [2, 3]], np.int32)
    lens = np.array([20, 31], np.int32)
    batch = kc.plan_batch(block_table=table, seq_lens=lens, block_size=16, num_blocks=4, num_query_tokens=2)
    query = rng.standard_normal((2, 4, 64)).astype(np.float32)
    kv = rng.standard_normal((64, 2, 64)).astype(np.float32)
    for kv_dtype in ("int4_per_token_head", "int8_per_token_head", "int4_per_token_head"):
        cache = kc.allocate_cache(4, 16, 2, 64, kv_dtype)
        kc.reshape_and_cache(kv, kv, cache, np.arange(64))
        out = kc.paged_attention(query, cache, batch=batch)
        expected = reference.paged_attention(query, cache, block_table=table, seq_lens=lens)
        assert relative_error(out, expected) < 1e-5, kv_dtype
    assert calls == ["int4_per_token_head", "int8_per_token_head"]
