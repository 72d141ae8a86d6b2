"""Arrays from any DLPack producer go in and come back in the caller's framework."""

import ctypes

import ml_dtypes
import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, interop

from .helpers import paged_batch


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
    np.testing.assert_array_equal(np.asarray(out), kc.paged_attention(query, cache, **args))
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
