"""A decode step (write, then attention) with its metadata on the device does not
synchronise with the host: it is captured in a CUDA graph and replayed, with
new tokens and lengths written into the same device buffers between replays."""

from __future__ import annotations

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, reference

pytestmark = pytest.mark.gpu

if not backends.status("cuda").usable:
    pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}",
                allow_module_level=True)

import cupy  # noqa: E402

from .test_attention import ATTENTION_BOUND  # noqa: E402


def host_copy(cache):
    return kc.wrap_cache(*(None if t is None else cupy.asnumpy(t) for t in cache.tensors()),
                         kv_dtype=cache.kv_dtype, rotation=cache.rotation)


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "fp8_per_token_head"])
def test_decode_step_replays_from_a_cuda_graph(kv_dtype):
    rng = np.random.default_rng(0)
    num_seqs, num_kv_heads, num_heads, head_size, block_size = 3, 2, 8, 128, 16
    context, steps = 40, 3
    pages = -(-(context + steps) // block_size)
    cache = kc.allocate_cache(num_seqs * pages, block_size, num_kv_heads, head_size, kv_dtype, device="cuda")
    table = np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages)
    positions = np.arange(context)
    history = rng.standard_normal((num_seqs * context, num_kv_heads, head_size)).astype(np.float16)
    history_slots = (table[:, positions // block_size] * block_size + positions % block_size).reshape(-1)
    kc.reshape_and_cache(cupy.asarray(history), cupy.asarray(history), cache, history_slots)

    # The step's buffers, on the device, written in place before each replay.
    key = cupy.zeros((num_seqs, num_kv_heads, head_size), cupy.float16)
    value = cupy.zeros_like(key)
    query = cupy.zeros((num_seqs, num_heads, head_size), cupy.float16)
    out = cupy.zeros_like(query)
    slot_mapping = cupy.zeros(num_seqs, cupy.int64)
    seq_lens = cupy.zeros(num_seqs, cupy.int32)
    block_table = cupy.asarray(table)
    batch = kc.plan_batch(block_table=block_table, seq_lens=seq_lens, block_size=block_size,
                          num_blocks=cache.num_blocks)
    slots = kc.plan_slots(slot_mapping, num_slots=cache.num_slots)

    def fill(step):
        position = context + step
        slot_mapping[...] = cupy.asarray(table[:, position // block_size] * block_size + position % block_size)
        seq_lens[...] = position + 1
        for array in (key, value, query):
            array[...] = cupy.asarray(rng.standard_normal(array.shape).astype(np.float16))

    def decode_step():
        kc.reshape_and_cache(key, value, cache, slots)
        kc.paged_attention(query, cache, batch=batch, out=out)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fill(0)
        decode_step()   # compiles, plans and allocates the workspace: all before the capture
        stream.begin_capture()
        decode_step()
        graph = stream.end_capture()
        for step in range(steps):
            fill(step)
            graph.launch(stream)
            stream.synchronize()
            expected = reference.paged_attention(cupy.asnumpy(query), host_copy(cache), block_table=table,
                                                 seq_lens=np.full(num_seqs, context + step + 1))
            actual = cupy.asnumpy(out).astype(np.float64)
            error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
            assert error <= ATTENTION_BOUND + 2.0 ** -12, f"step {step}: relative error {error:.2e}"
