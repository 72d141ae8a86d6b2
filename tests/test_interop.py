"""Arrays from any DLPack producer go in and come back in the caller's framework."""

import numpy as np
import pytest

import kvcupy as kc

from .helpers import paged_batch


class DLPackOnly:
    """A foreign host tensor: only the DLPack protocol, no NumPy conversion."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


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


def test_device_arrays_are_refused_by_name():
    query = ForeignDevice(np.zeros((1, 4, 64), np.float32))
    cache = kc.allocate_cache(2, 16, 2, 64)
    with pytest.raises(ValueError, match="query is on DLPack device 2:0"):
        kc.paged_attention(query, cache, block_table=np.zeros((1, 1), np.int32),
                           seq_lens=np.ones(1, np.int32))


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
