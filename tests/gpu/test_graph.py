"""A decode step (write, then attention) with its metadata on the device does not
synchronise with the host: it is captured in a CUDA graph and replayed, with
new tokens and lengths written into the same device buffers between replays.
Prefill and mixed batches replay as they run eagerly when their plan was built
and run once before the capture; a call that would upload its plan during the
capture is refused before it reaches the stream."""

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

from ..device_arrays import device_view  # noqa: E402
from ..helpers import paged_batch  # noqa: E402
from .test_attention import ATTENTION_BOUND, check, host_cache  # noqa: E402


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


# --- torch.cuda.graph: prefill and mixed batches, refusals, a whole decode step ----

def torch_cache(torch, cache):
    """A CuPy-held cache as torch tensors over the same memory, as an engine holds it."""
    tensors = (None if t is None else torch.from_dlpack(t) for t in cache.tensors())
    return kc.wrap_cache(*tensors, kv_dtype=cache.kv_dtype, rotation=cache.rotation)


def warmed(torch, call):
    """Run call() once on a side stream, as torch asks before a capture: this first call
    builds the plan, uploads it, compiles the kernels and allocates the workspace."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)


BATCHES = {   # (sequence lengths, new query tokens)
    "prefill": ([300, 77, 600], [300, 77, 600]),
    "mixed": ([900, 150, 2000, 333], [1, 150, 1, 90]),   # two decode, a prompt, a chunk of one
}


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("metadata", ["host", "device"])
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "fp8_per_token_head"])
def test_a_planned_batch_replays_from_a_torch_graph_as_it_runs_eagerly(torch_cuda, kind, metadata, kv_dtype):
    """A plan built (plan_batch, host metadata or device metadata with its hints) and run
    once before the capture: the captured call replays to the eager call's bytes, and
    reads the query buffer as it is at each replay."""
    torch = torch_cuda
    rng = np.random.default_rng(1)
    seq_lens, query_lens = BATCHES[kind]
    batch = paged_batch(rng, seq_lens, query_lens, 16)
    host = host_cache(rng, batch, kv_dtype, 128, 2, 16, np.float16, "default")
    cache = torch_cache(torch, device_view(host))
    num_heads = 8
    index = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    hints = {}
    if metadata == "device":
        index = {name: torch.from_numpy(a).cuda() for name, a in index.items()}
        hints = dict(max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    plan = kc.plan_batch(**index, **hints, block_size=16, num_blocks=batch.num_blocks,
                         num_query_tokens=batch.num_queries)
    queries = [(rng.standard_normal((batch.num_queries, num_heads, 128)) * 2).astype(np.float16) for _ in range(2)]
    query = torch.from_numpy(queries[0]).cuda()
    eager, replayed = torch.empty_like(query), torch.full_like(query, float("nan"))

    warmed(torch, lambda: kc.paged_attention(query, cache, batch=plan, out=eager))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kc.paged_attention(query, cache, batch=plan, out=replayed)
    for step, values in enumerate(queries):
        query.copy_(torch.from_numpy(values))
        graph.replay()
        kc.paged_attention(query, cache, batch=plan, out=eager)
        torch.cuda.synchronize()
        expected = reference.paged_attention(values, host, block_table=batch.block_table, seq_lens=batch.seq_lens,
                                             cu_seqlens_q=batch.cu_seqlens_q)
        check(f"{kind}, step {step}", eager.cpu().numpy().astype(np.float64), expected, np.float16)
        assert replayed.cpu().numpy().tobytes() == eager.cpu().numpy().tobytes(), f"step {step}"


@pytest.mark.parametrize("prepared", ["no plan", "plan never run"])
def test_a_call_that_would_upload_its_plan_under_capture_is_refused(torch_cuda, prepared):
    """Metadata as CUDA tensors and no plan run before the capture: the call would
    upload its plan while the stream captures, which breaks the caller's graph. It is
    refused before it reaches the stream: the rest of the capture replays."""
    torch = torch_cuda
    rng = np.random.default_rng(2)
    batch = paged_batch(rng, [500, 64], [1, 64], 16)
    cache = torch_cache(torch, device_view(host_cache(rng, batch, "int4_per_token_head", 128, 2, 16, np.float16,
                                                      "default")))
    index = {name: torch.from_numpy(a).cuda() for name, a in
             dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q).items()}
    hints = dict(max_query_len=64, max_seq_len=500)
    if prepared == "plan never run":
        index = dict(batch=kc.plan_batch(**index, **hints, block_size=16, num_blocks=batch.num_blocks))
    else:
        index.update(hints)
    query = torch.ones((batch.num_queries, 8, 128), dtype=torch.float16, device="cuda")
    out = torch.zeros_like(query)
    counter = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"paged_attention would build and upload its plan while the stream is "
                                           r"being captured: build the plan with kvcupy\.plan_batch"):
        with torch.cuda.graph(graph):
            counter.add_(1)
            kc.paged_attention(query, cache, out=out, **index)
    graph.replay()
    torch.cuda.synchronize()
    assert counter.item() == 1 and not out.any()


def test_a_decode_step_of_several_layers_replays_with_its_buffers_rewritten(torch_cuda):
    """docs/design.md's recipe: a whole decode step (write and attention in every layer)
    captured once over device buffers (block table, lengths, slot ids, K/V, query) that
    the loop rewrites in place (copy_) before each replay, a sequence taking a new page
    on the way. Each replay equals the same step run eagerly on a twin cache, to the byte
    (outputs and caches)."""
    torch = torch_cuda
    rng = np.random.default_rng(3)
    num_layers, num_seqs, num_kv_heads, num_heads, head_size, block_size = 3, 3, 2, 8, 128, 16
    context, steps = 2 * block_size - 1, 3   # the second step writes into a third page
    num_blocks = 3 * num_seqs + 2
    table = np.zeros((num_seqs, 3), np.int32)
    table[:, :2] = np.arange(2 * num_seqs).reshape(num_seqs, 2)
    third_pages = rng.permutation(np.arange(2 * num_seqs, num_blocks))[:num_seqs]
    positions = np.arange(context)
    history_slots = torch.from_numpy((table[:, positions // block_size] * block_size
                                      + positions % block_size).reshape(-1)).cuda()
    twins = []
    for _ in range(2):   # the captured caches, then the eager ones: the same history
        layers = [kc.wrap_cache(*(None if t is None else torch.from_dlpack(t) for t in kc.allocate_cache(
            num_blocks, block_size, num_kv_heads, head_size, device="cuda").tensors()),
            kv_dtype="int4_per_token_head") for _ in range(num_layers)]
        history = np.random.default_rng(4)
        for layer in layers:
            rows = torch.from_numpy(history.standard_normal((num_seqs * context, num_kv_heads, head_size))
                                    .astype(np.float16)).cuda()
            kc.reshape_and_cache(rows, rows, layer, history_slots)
        twins.append(layers)

    # The step's device buffers: written in place before every replay.
    block_table = torch.from_numpy(table).cuda()
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    slot_mapping = torch.zeros(num_seqs, dtype=torch.int64, device="cuda")
    keys = torch.zeros((num_layers, num_seqs, num_kv_heads, head_size), dtype=torch.float16, device="cuda")
    values, queries = torch.zeros_like(keys), torch.zeros((num_layers, num_seqs, num_heads, head_size),
                                                          dtype=torch.float16, device="cuda")
    # The hint holds for every replay: the longest length any step reaches.
    batch = kc.plan_batch(block_table=block_table, seq_lens=seq_lens, block_size=block_size,
                          num_blocks=num_blocks, max_seq_len=context + steps)
    slots = kc.plan_slots(slot_mapping, num_slots=num_blocks * block_size)
    outs = [torch.zeros_like(queries) for _ in twins]

    def fill(step):
        position = context + step
        if position // block_size == 2:
            table[:, 2] = third_pages
        slot_ids = table[:, position // block_size].astype(np.int64) * block_size + position % block_size
        block_table.copy_(torch.from_numpy(table))
        seq_lens.copy_(torch.full((num_seqs,), position + 1, dtype=torch.int32))
        slot_mapping.copy_(torch.from_numpy(slot_ids))
        for buffer in (keys, values, queries):
            buffer.copy_(torch.from_numpy(rng.standard_normal(tuple(buffer.shape)).astype(np.float16)))

    def decode_step(layers, out):
        for layer, cache in enumerate(layers):
            kc.reshape_and_cache(keys[layer], values[layer], cache, slots)
            kc.paged_attention(queries[layer], cache, batch=batch, out=out[layer])

    fill(0)
    for layers, out in zip(twins, outs):
        warmed(torch, lambda: decode_step(layers, out))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step(twins[0], outs[0])
    for step in range(steps):
        fill(step)
        graph.replay()
        decode_step(twins[1], outs[1])
        torch.cuda.synchronize()
        assert outs[0].cpu().numpy().tobytes() == outs[1].cpu().numpy().tobytes(), f"step {step}"
        assert not outs[0].isnan().any(), f"step {step}"
        for layer, (captured, eager) in enumerate(zip(*twins)):
            for a, b in zip(captured.tensors(), eager.tensors()):
                assert a.cpu().numpy().tobytes() == b.cpu().numpy().tobytes(), f"step {step}, layer {layer}"


@pytest.mark.parametrize("capture", ["torch", "cupy"])
def test_a_paged_kv_cache_decode_step_replays_as_it_runs_eagerly(torch_cuda, capture):
    """PagedKVCache.decode_step: a bucket of 4 rows captured once (every layer's write
    and attention) and replayed for 3 steps whose batches change (3, 2, then 3
    sequences, one taking a new page), the buffers rewritten by begin() between
    replays. Each replay equals a twin manager's eager step, to the byte (the
    sequences' outputs and every layer's cache)."""
    torch = torch_cuda
    rng = np.random.default_rng(5)
    num_layers, max_batch, num_kv_heads, num_heads, head_size, block_size = 2, 4, 2, 8, 128, 16
    context = 2 * block_size - 1
    managers = [kc.PagedKVCache(num_layers, 12, block_size, num_kv_heads, head_size, device="cuda")
                for _ in range(2)]
    history = rng.standard_normal((num_layers, 3 * context, num_kv_heads, head_size)).astype(np.float16)
    for manager in managers:
        seq_ids = [manager.add_sequence() for _ in range(3)]
        slot_mapping = manager.reserve(seq_ids, context)
        for layer in range(num_layers):
            rows = torch.from_numpy(history[layer]).cuda()
            manager.write(layer, rows, rows, slot_mapping)
    steps = [manager.decode_step(max_batch, max_seq_len=context + 3) for manager in managers]
    keys = torch.zeros((num_layers, max_batch, num_kv_heads, head_size), dtype=torch.float16, device="cuda")
    values = torch.zeros_like(keys)
    queries = torch.zeros((num_layers, max_batch, num_heads, head_size), dtype=torch.float16, device="cuda")
    outs = [torch.zeros_like(queries) for _ in steps]

    # A call runs on its arrays' stream: torch's current one for torch tensors, CuPy's
    # (the one capturing) for CuPy arrays: views of the same memory, made before the capture.
    view = (lambda x: x) if capture == "torch" else cupy.from_dlpack
    inputs = [view(x) for x in (keys, values, queries)]
    outputs = [view(out) for out in outs]

    def run_layers(twin):
        step, out = steps[twin], outputs[twin]   # twin 0 is captured, twin 1 runs eagerly
        for layer in range(num_layers):
            step.write(layer, inputs[0][layer], inputs[1][layer])
            step.attention(layer, inputs[2][layer], out=out[layer])

    def fill():
        for buffer in (keys, values, queries):
            buffer.copy_(torch.from_numpy(rng.standard_normal(tuple(buffer.shape)).astype(np.float16)))

    batches = [[0, 1, 2], [0, 2], [0, 1, 2]]
    for step in steps:
        step.begin(batches[0])
    fill()
    if capture == "torch":
        warmed(torch, lambda: run_layers(0))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_layers(0)
        replay = graph.replay
    else:
        run_layers(0)   # plans, compiles and uploads, before the capture
        stream = cupy.cuda.Stream(non_blocking=True)
        torch.cuda.synchronize()
        with stream:
            stream.begin_capture()
            run_layers(0)
            cupy_graph = stream.end_capture()

        def replay():
            torch.cuda.synchronize()
            cupy_graph.launch(stream)
            stream.synchronize()
    # The capture wrote nothing: the twin catches up on the step as it ran eagerly.
    run_layers(1)
    for number, seq_ids in enumerate(batches):
        if number:
            for step in steps:
                step.begin(seq_ids)
            fill()
            replay()
            run_layers(1)
        torch.cuda.synchronize()
        rows = len(seq_ids)
        assert outs[0][:, :rows].cpu().numpy().tobytes() == outs[1][:, :rows].cpu().numpy().tobytes(), number
        assert not outs[0][:, :rows].isnan().any(), number
        for layer, (captured, eager) in enumerate(zip(managers[0].layers, managers[1].layers)):
            for a, b in zip(captured.tensors(), eager.tensors()):
                assert cupy.asnumpy(a).tobytes() == cupy.asnumpy(b).tobytes(), (number, layer)
