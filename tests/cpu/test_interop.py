"""Arrays from any DLPack producer go in and come back in the caller's framework."""

import ctypes
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, interop

from ..helpers import paged_batch
from .test_backends import fake  # noqa: F401  (a fixture: a "cuda" backend running on the host)


class DLPackOnly:
    """A foreign host tensor: only the DLPack protocol, no NumPy conversion."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class LabelledProducer(DLPackOnly):
    """Exports bfloat16 / float8_e4m3fn NumPy data with their own DLPack type codes,
    as torch and JAX do (NumPy itself cannot export them)."""

    CODES = {np.dtype(ml_dtypes.bfloat16): 4, np.dtype(ml_dtypes.float8_e4m3fn): 10}

    def __dlpack__(self, **kwargs):
        raw = self._array.view(np.uint16 if self._array.itemsize == 2 else np.uint8)
        capsule = raw.__dlpack__(**kwargs)
        name = b"dltensor_versioned" if kwargs.get("max_version") else b"dltensor"
        tensor = interop._get_pointer(capsule, name) + interop._TENSOR_OFFSETS[name]
        ctypes.c_uint8.from_address(tensor + interop._DTYPE_CODE_OFFSET).value = self.CODES[self._array.dtype]
        return capsule


class ForeignDevice(DLPackOnly):
    def __dlpack_device__(self):
        return (2, 0)   # kDLCUDA


def run(make):
    """Write and attend with every array argument passed through `make`."""
    rng = np.random.default_rng(0)
    batch = paged_batch(rng, [30, 3], [2, 3], 16)
    key_cache = np.zeros((batch.num_blocks, 16, 2, 32), np.uint8)
    scales = [np.zeros((batch.num_blocks, 16, 2), np.float32) for _ in range(2)]
    value_cache = key_cache.copy()
    cache = kc.wrap_cache(make(key_cache), make(value_cache), make(scales[0]), make(scales[1]),
                          kv_dtype="int4_per_token_head")
    kv = rng.standard_normal((batch.num_tokens, 2, 64)).astype(np.float32)
    kc.reshape_and_cache(make(kv), make(kv), cache, make(batch.slot_mapping))
    query = rng.standard_normal((batch.num_queries, 4, 64)).astype(np.float32)
    out = kc.paged_attention(make(query), cache, block_table=make(batch.block_table),
                             seq_lens=make(batch.seq_lens), cu_seqlens_q=make(batch.cu_seqlens_q))
    return key_cache, out


def assert_same_attention(framework_out, numpy_out):
    """The CPU attention of a framework's arrays against the same call on NumPy's.
    Arrays that arrive read-only (JAX's) take another Numba specialisation of the
    same kernel, compiled with fastmath reassociation, so its float32 sums may
    round differently: one CI run differed by up to 6e-8 (an ulp or two, values
    near 0.1-0.3) in 58 of 512 outputs. One int8 code off by one moves an output
    by its token's probability times its scale, about 5e-4 here (1/48 x 3/127)."""
    np.testing.assert_allclose(np.asarray(framework_out), numpy_out, rtol=1e-5, atol=1e-6)


def test_dlpack_producer_is_read_and_written_zero_copy():
    key_cache, out = run(DLPackOnly)
    assert key_cache.any(), "the write went through DLPack into the caller's memory"
    _, expected = run(lambda a: a)
    np.testing.assert_array_equal(out, expected)


def test_device_array_without_a_usable_backend_is_refused_by_name(monkeypatch):
    """A CUDA array where the CUDA backend cannot run: the error names the argument
    and says why the backend is unavailable (not "must be in host memory")."""
    monkeypatch.setattr(backends, "status", lambda name: backends.BackendStatus(
        name, backends._REGISTRY[name][1], name == "cpu", "CuPy is not installed"))
    query = ForeignDevice(np.zeros((1, 4, 64), np.float32))
    cache = kc.allocate_cache(2, 16, 2, 64)
    with pytest.raises(ValueError, match="query is on cuda:0, but the CUDA backend is unavailable "
                                         "here: CuPy is not installed"):
        kc.paged_attention(query, cache, block_table=np.zeros((1, 1), np.int32),
                           seq_lens=np.ones(1, np.int32))


def test_index_arguments_may_be_lists():
    rng = np.random.default_rng(1)
    cache = kc.allocate_cache(4, 16, 2, 64)
    kv = rng.standard_normal((3, 2, 64)).astype(np.float32)
    kc.reshape_and_cache(kv, kv, cache, [0, 1, 2])
    query = rng.standard_normal((1, 4, 64)).astype(np.float32)
    from_lists = kc.paged_attention(query, cache, block_table=[[0]], seq_lens=[3])
    from_arrays = kc.paged_attention(query, cache, block_table=np.zeros((1, 1), np.int32),
                                     seq_lens=np.array([3], np.int32))
    np.testing.assert_array_equal(from_lists, from_arrays)
    with pytest.raises(TypeError, match="slot_mapping has dtype float64"):
        kc.reshape_and_cache(kv, kv, cache, [0.0, 1.0, 2.0])


def test_mixed_frameworks_name_both_arguments():
    """key and value of one call come from one framework (the write's own data)."""
    cache = kc.allocate_cache(4, 16, 2, 64)
    kv = np.zeros((3, 2, 64), np.float32)
    with pytest.raises(TypeError, match="key is a numpy array but value is a dlpack array"):
        kc.reshape_and_cache(kv, DLPackOnly(kv), cache, np.arange(3))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_bfloat16_and_float8_cross_dlpack_tagged(dtype):
    """Producers export these with DLPack codes NumPy cannot import (kDLBfloat,
    kDLFloat8_e4m3fn); interop relabels them and keeps the logical dtype."""
    data = np.arange(8, dtype=np.float32).astype(dtype)
    producer = LabelledProducer(data)
    array = interop.as_array(producer, "x")
    assert array.dtype == np.dtype(dtype)
    assert array.data.ctypes.data == data.ctypes.data, "zero-copy"
    np.testing.assert_array_equal(array.data.view(np.uint8), data.view(np.uint8))


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    key_cache, out = run(lambda a: torch.from_dlpack(a))
    assert isinstance(out, torch.Tensor)
    _, expected = run(lambda a: a)
    np.testing.assert_array_equal(out.numpy(), expected)
    bf16 = torch.randn(3, 64).to(torch.bfloat16)
    rotated = kc.rotate(bf16, kc.rotation_plan(64))
    assert rotated.dtype == torch.bfloat16


def test_jax_arrays_go_in_and_the_result_comes_back_as_jax():
    """JAX arrays are immutable, so a cache cannot live in one; everything read
    (K/V to write, the query, the batch description) may be JAX, and the
    output comes back as a JAX array, bfloat16 included."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(2)
    batch = paged_batch(rng, [30, 3], [2, 3], 16)
    cache = kc.allocate_cache(batch.num_blocks, 16, 2, 64)
    reference_cache = kc.allocate_cache(batch.num_blocks, 16, 2, 64)
    kv = rng.standard_normal((batch.num_tokens, 2, 64)).astype(np.float32)
    kc.reshape_and_cache(jnp.asarray(kv), jnp.asarray(kv), cache, jnp.asarray(batch.slot_mapping))
    kc.reshape_and_cache(kv, kv, reference_cache, batch.slot_mapping)
    np.testing.assert_array_equal(cache.key_cache, reference_cache.key_cache)
    query = rng.standard_normal((batch.num_queries, 4, 64)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    out = kc.paged_attention(jnp.asarray(query), cache, **{k: jnp.asarray(v) for k, v in args.items()})
    assert isinstance(out, jax.Array)
    assert_same_attention(out, kc.paged_attention(query, cache, **args))
    rotated = kc.rotate(jnp.asarray(query, dtype=jnp.bfloat16), kc.rotation_plan(64))
    assert isinstance(rotated, jax.Array) and rotated.dtype == jnp.bfloat16


def test_torch_float8_and_bfloat16_tensors_keep_their_dtype():
    torch = pytest.importorskip("torch")
    for dtype, logical in ((torch.bfloat16, ml_dtypes.bfloat16), (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn)):
        tensor = torch.randn(4, 64).to(dtype)
        array = interop.as_array(tensor, "key")
        assert array.dtype == np.dtype(logical) and array.data.ctypes.data == tensor.data_ptr()
    with pytest.raises(TypeError, match="query has dtype float8_e4m3fn"):
        kc.paged_attention(torch.zeros(1, 4, 64).to(torch.float8_e4m3fn), kc.allocate_cache(2, 16, 2, 64),
                           block_table=[[0]], seq_lens=[1])


# --- JAX: immutable arrays, the functional write, results without copies ------

def jax_cache(kv_dtype: str, num_blocks: int = 6):
    """(a kvcupy cache in NumPy, the same zero cache in JAX arrays)."""
    jnp = pytest.importorskip("jax").numpy
    host = kc.allocate_cache(num_blocks, 16, 2, 64, kv_dtype=kv_dtype, dtype="bfloat16")
    tensors = [jnp.asarray(np.asarray(t)) for t in host.tensors()]
    return host, kc.wrap_cache(*tensors, kv_dtype=kv_dtype, rotation=host.rotation)


def test_jax_arrays_are_never_written_in_place():
    jnp = pytest.importorskip("jax").numpy
    _, cache = jax_cache("int8_per_token_head")
    kv = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(TypeError, match="cache.key_cache is a JAX array, and JAX arrays are immutable"):
        kc.reshape_and_cache(kv, kv, cache, np.arange(2))
    with pytest.raises(TypeError, match=r"caches\[0\] is a JAX array"):
        kc.copy_blocks([cache], [[0, 1]])
    query = jnp.zeros((1, 4, 64), jnp.float32)
    with pytest.raises(TypeError, match="out is a JAX array"):
        kc.paged_attention(query, cache, block_table=[[0]], seq_lens=[1], out=jnp.zeros_like(query))


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto"])
def test_updated_cache_stores_what_reshape_and_cache_stores(kv_dtype):
    """The functional form writes the same bytes (padding slots skipped), returns
    new JAX arrays and leaves the given cache as it was."""
    jnp = pytest.importorskip("jax").numpy
    host, cache = jax_cache(kv_dtype)
    rng = np.random.default_rng(3)
    for slots in (np.arange(20), np.array([20, -1, 47, 33])):
        kv = rng.standard_normal((len(slots), 2, 64)).astype(ml_dtypes.bfloat16)
        kc.reshape_and_cache(kv, kv, host, slots)
        before = [np.asarray(t).copy() for t in cache.tensors()]
        updated = kc.updated_cache(jnp.asarray(kv), jnp.asarray(kv), cache,
                                   jnp.asarray(slots) if len(slots) == 20 else slots)
        for old, unchanged in zip(cache.tensors(), before):
            np.testing.assert_array_equal(np.asarray(old), unchanged, err_msg="the given cache")
        for new, expected, name in zip(updated.tensors(), host.tensors(), ("K", "V", "K scales", "V scales")):
            assert new.dtype == np.asarray(expected).dtype or new.dtype == ml_dtypes.float8_e4m3fn
            np.testing.assert_array_equal(np.asarray(new).view(np.uint8), np.asarray(expected).view(np.uint8),
                                          err_msg=f"{kv_dtype} {name}")
        cache = updated
    query = rng.standard_normal((2, 4, 64)).astype(np.float32)
    args = dict(block_table=[[0, 1, 2], [0, 1, 2]], seq_lens=[21, 48])
    assert_same_attention(kc.paged_attention(jnp.asarray(query), cache, **args),
                          kc.paged_attention(query, host, **args))


def test_updated_cache_with_donation_writes_into_the_given_buffers():
    """donate=True: XLA reuses the cache's buffers (same addresses, old arrays deleted),
    even after the cache was read by attention (kvcupy drops its own views first)."""
    jax = pytest.importorskip("jax")
    _, cache = jax_cache("int4_per_token_head")
    kv = np.random.default_rng(4).standard_normal((5, 2, 64)).astype(np.float32)
    cache = kc.updated_cache(kv, kv, cache, np.arange(5))
    kc.paged_attention(np.zeros((1, 4, 64), np.float32), cache, block_table=[[0]], seq_lens=[5])
    addresses = [t.unsafe_buffer_pointer() for t in cache.tensors()]
    copied = kc.updated_cache(kv, kv, cache, np.arange(5, 10))
    donated = kc.updated_cache(kv, kv, cache, np.arange(5, 10), donate=True)
    assert all(t.is_deleted() for t in cache.tensors())
    assert [t.unsafe_buffer_pointer() for t in donated.tensors()] == addresses
    for a, b in zip(copied.tensors(), donated.tensors()):
        assert isinstance(b, jax.Array)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_updated_cache_takes_only_jax_caches_and_names_bad_arguments():
    jnp = pytest.importorskip("jax").numpy
    host, cache = jax_cache("int8_per_token_head")
    kv = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(TypeError, match="cache.key_cache is a numpy array, which kvcupy writes in place"):
        kc.updated_cache(kv, kv, host, np.arange(2))
    with pytest.raises(ValueError, match=r"key has shape \(2, 3, 64\)"):
        kc.updated_cache(np.zeros((2, 3, 64), np.float32), np.zeros((2, 3, 64), np.float32), cache, np.arange(2))
    with pytest.raises(ValueError, match="slot_mapping holds slot 96"):
        kc.updated_cache(kv, kv, cache, jnp.array([0, 96]))


def test_jax_values_kvcupy_cannot_read_are_refused_by_name():
    jax = pytest.importorskip("jax")
    cache = kc.allocate_cache(2, 16, 2, 64)

    def traced(query):
        kc.paged_attention(query, cache, block_table=[[0]], seq_lens=[1])
        return query
    with pytest.raises(TypeError, match="query is a traced JAX value: kvcupy runs eagerly"):
        jax.jit(traced)(jax.numpy.zeros((1, 4, 64)))


def test_sharded_jax_arrays_are_refused_by_name():
    """Over two (host) devices, a JAX array's DLPack export would hand over one shard."""
    pytest.importorskip("jax")
    script = ("import jax, numpy as np, kvcupy as kc\n"
              "mesh = jax.sharding.Mesh(np.array(jax.devices()), ('d',))\n"
              "spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d'))\n"
              "query = jax.device_put(np.zeros((2, 4, 64), np.float32), spec)\n"
              "try:\n"
              "    kc.paged_attention(query, kc.allocate_cache(2, 16, 2, 64), block_table=[[0], [0]], seq_lens=[1, 1])\n"
              "except TypeError as error:\n"
              "    print(error)\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "query is a JAX array on 2 devices" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_results_go_back_to_jax_without_a_copy(dtype):
    """Host results cross into JAX through DLPack (XLA takes 64-byte aligned host memory
    as it is), bfloat16 and float8 labelled as themselves: no copy, no bitcast."""
    jax = pytest.importorskip("jax")
    raw = np.zeros(4096 + 64, np.uint8)
    start = -raw.ctypes.data % 64
    data = raw[start:start + 4096].view(dtype)
    data[:] = np.arange(data.size) % 7
    result = interop.to_jax(interop.Array(data, np.dtype(dtype), interop.HOST, "native", "out"),
                               jax.numpy.zeros(1))
    assert isinstance(result, jax.Array) and result.dtype == np.dtype(dtype)
    assert result.unsafe_buffer_pointer() == data.ctypes.data
    np.testing.assert_array_equal(np.asarray(result).view(np.uint8), data.view(np.uint8))


# --- where a call runs: devices and streams -------------------------------------

class OnDevice(DLPackOnly):
    """Host memory that says it lives on CUDA device `index` (served by FakeBackend)."""

    def __init__(self, array, index=0):
        super().__init__(array)
        self.index = index

    def __dlpack_device__(self):
        return (2, self.index)


def test_index_and_data_arrays_on_another_device_are_refused_by_name(fake):
    cache = kc.allocate_cache(4, 16, 2, 64, device="cuda")
    kv = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(TypeError, match="slot_mapping is on cuda:1; expected the host or cuda:0"):
        kc.reshape_and_cache(OnDevice(kv), OnDevice(kv), cache, OnDevice(np.arange(2), 1))
    query = OnDevice(np.zeros((1, 4, 64), np.float32))
    with pytest.raises(TypeError, match="block_table is on cuda:1; expected the host or cuda:0"):
        kc.paged_attention(query, cache, block_table=OnDevice(np.zeros((1, 1), np.int32), 1), seq_lens=[1])
    with pytest.raises(TypeError, match="query is on cuda:1 but the cache is on cuda:0"):
        kc.paged_attention(OnDevice(np.zeros((1, 4, 64), np.float32), 1), cache, block_table=[[0]], seq_lens=[1])
    assert fake.calls == [], "nothing reached the backend"


class StreamLoggingBackend:
    """A GPU backend's device and stream contexts, logging what running_on does."""

    def __init__(self):
        self.log = []

    def _context(self, *entry):
        log = self.log

        class Context:
            def __enter__(self):
                log.append(("enter",) + entry)

            def __exit__(self, *exc):
                log.append(("exit",) + entry)
        return Context()

    def device_context(self, device):
        return self._context("device", device.index)

    def stream_context(self, device, ptr):
        return self._context("stream", ptr)


def test_running_on_makes_the_device_current_then_the_callers_stream(monkeypatch):
    """On a GPU: the device first (CuPy takes a stream only on its own device), then
    the caller's stream; left in reverse order. The backend's own current stream (no
    source) is left as it is; the host needs neither."""
    backend = StreamLoggingBackend()
    monkeypatch.setattr(interop, "_stream_backend", lambda device: None if device.kind == "cpu" else backend)
    monkeypatch.setattr(interop.StreamSource, "stream", lambda source: source.handle)
    with interop.running_on(interop.Device("cuda", 1), interop.StreamSource("test", 0xBEEF)):
        backend.log.append("work")
    assert backend.log == [("enter", "device", 1), ("enter", "stream", 0xBEEF), "work",
                           ("exit", "stream", 0xBEEF), ("exit", "device", 1)]
    backend.log.clear()
    with interop.running_on(interop.Device("cuda", 0)):
        backend.log.append("work")
    assert backend.log == [("enter", "device", 0), "work", ("exit", "device", 0)]
    backend.log.clear()
    with interop.running_on(interop.HOST, interop.StreamSource("test", 0xBEEF)):
        backend.log.append("work")
    assert backend.log == ["work"]


def test_running_on_leaves_the_device_again_when_the_stream_cannot_be_had(monkeypatch):
    """A failure while switching (the caller's stream cannot be asked for) leaves
    what was already entered, and the error reaches the caller."""
    backend = StreamLoggingBackend()
    monkeypatch.setattr(interop, "_stream_backend", lambda device: backend)

    def unavailable(source):
        raise RuntimeError("no stream")
    monkeypatch.setattr(interop.StreamSource, "stream", unavailable)
    with pytest.raises(RuntimeError, match="no stream"):
        with interop.running_on(interop.Device("cuda", 1), interop.StreamSource("test", 0xBEEF)):
            backend.log.append("work")
    assert backend.log == [("enter", "device", 1), ("exit", "device", 1)]


def test_every_backend_serves_the_stream_protocol():
    """interop asks the backend, never CuPy, for devices and streams: each backend
    module has the three functions (the CUDA one imports without CuPy)."""
    import importlib
    for module in ("kvcupy.backends.cpu", "kvcupy.backends.cuda"):
        backend = importlib.import_module(module)
        for function in ("device_context", "stream_context", "synchronize"):
            assert callable(getattr(backend, function, None)), f"{module} lacks {function}"


def test_stream_sources_follow_the_framework():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    assert interop.stream_source(np.zeros(1)) == interop.CUPY_STREAM
    assert interop.stream_source(torch.zeros(1)) == interop.CUPY_STREAM, "a host tensor has no stream"
    assert interop.stream_source(jax.numpy.zeros(1)) == interop.CUPY_STREAM, "nor does a host JAX array"


def test_copy_on_write_runs_on_the_stream_of_the_managers_last_call(fake, monkeypatch):
    """reserve() has no arrays of its own: its copies run where the latest write or
    attention ran (torch's current stream for a torch caller), in order with them."""
    entered = []
    running_on = interop.running_on

    def recording(device, source=interop.CUPY_STREAM):
        entered.append((device, source))
        return running_on(device, source)
    monkeypatch.setattr(interop, "running_on", recording)
    monkeypatch.setattr(interop, "stream_source", lambda x: interop.StreamSource("caller", id(x)))
    mgr = kc.PagedKVCache(1, 8, 16, 2, 64, device="cuda")
    kv = OnDevice(np.random.default_rng(5).standard_normal((20, 2, 64)).astype(np.float32))
    first = mgr.add_sequence()
    mgr.write(0, kv, kv, mgr.reserve([first], 20))
    second = mgr.fork(first)
    entered.clear()
    fake.calls.clear()
    mgr.reserve([first, second], 1)
    assert fake.calls == ["copy_blocks"]
    assert entered[0] == (interop.Device("cuda", 0), interop.StreamSource("caller", id(kv)))


def test_a_refused_donation_falls_back_to_the_copy(monkeypatch):
    """Where XLA refuses to donate a buffer something else views (its GPU client),
    updated_cache writes through the copying form instead of failing."""
    pytest.importorskip("jax")
    from kvcupy import functional
    host, cache = jax_cache("int8_per_token_head")
    kv = np.random.default_rng(6).standard_normal((3, 2, 64)).astype(np.float32)
    kc.reshape_and_cache(kv, kv, host, np.arange(3))
    copying = functional._scatter(False)

    def refusing(*args):
        raise RuntimeError("INVALID_ARGUMENT: Donation requested for buffer with external reference")
    monkeypatch.setattr(functional, "_scatter", lambda donate: refusing if donate else copying)
    updated = kc.updated_cache(kv, kv, cache, np.arange(3), donate=True)
    for new, expected in zip(updated.tensors(), host.tensors()):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))
    assert not cache.key_cache.is_deleted()
