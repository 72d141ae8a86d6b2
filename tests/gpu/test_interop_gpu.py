"""Framework handoff on the GPU: torch, JAX and CuPy arrays cross through DLPack without
copies, every launch runs on the caller's stream and on the device its arrays live on.

Zero-copy is shown by addresses: kvcupy's view of a caller's tensor starts where the
tensor does, and a result handed back starts where kvcupy wrote it. Streams are shown
two ways: by what CuPy's current stream is when each backend call runs (the
`launches` spy), and by work queued behind a long kernel on a non-default torch stream
that comes out right without any synchronisation in between. Two-GPU tests skip
where torch sees fewer than two devices.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, interop

pytestmark = pytest.mark.gpu

if not backends.status("cuda").usable:
    pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}",
                allow_module_level=True)

import cupy  # noqa: E402  (only where the backend is usable)

from kvcupy.backends import cuda as cuda_backend  # noqa: E402

HEAD_SIZE, BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS = 96, 16, 2, 4
NUM_TOKENS = 20                          # one sequence: page 0 full, page 1 partly
FIELDS = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
# torch.cuda._sleep spins this many cycles: ~0.25 s at an H200's ~2 GHz, far longer
# than the host needs to queue the calls that follow it.
SPIN_CYCLES = 500_000_000
# Attention against the CPU backend: the CUDA kernel's bound (test_attention.py)
# plus bfloat16's rounding of the output (2^-8 per element).
ATTENTION_BOUND = 2e-3 + 2.0 ** -8


@pytest.fixture
def two_gpus(torch_cuda):
    if torch_cuda.cuda.device_count() < 2 or cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    return torch_cuda


@pytest.fixture
def jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    return jax


@pytest.fixture
def launches(monkeypatch):
    """Every CUDA backend call, as (name, CuPy's current stream, current device) when it ran."""
    seen = []
    for name in ("rotate", "reshape_and_cache", "paged_attention", "copy_blocks"):
        def spy(*args, _name=name, _original=getattr(cuda_backend, name), **kwargs):
            seen.append((_name, cupy.cuda.get_current_stream().ptr, cupy.cuda.runtime.getDevice()))
            return _original(*args, **kwargs)
        monkeypatch.setattr(cuda_backend, name, spy)
    return seen


@pytest.fixture
def handed_back(monkeypatch):
    """Every result kvcupy hands back, as (address kvcupy wrote it at, what the caller got)."""
    seen = []

    def spy(result, reference, _like=interop.like):
        converted = _like(result, reference)
        # Device results only have an address (NumPy cannot even view a bfloat16 buffer).
        interface = getattr(result.data, "__cuda_array_interface__", None)
        seen.append((interface["data"][0] if interface else None, converted))
        return converted
    monkeypatch.setattr(interop, "like", spy)
    return seen


def normal(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def torch_int4_cache(torch, num_blocks: int = 4, device="cuda", heads: int = NUM_KV_HEADS):
    """An int4 cache in torch tensors, as a serving engine allocates it; (tensors, KVCache)."""
    shape = (num_blocks, BLOCK_SIZE, heads, HEAD_SIZE // 2)
    tensors = (torch.zeros(shape, dtype=torch.uint8, device=device),
               torch.zeros(shape, dtype=torch.uint8, device=device),
               torch.zeros(shape[:3], device=device), torch.zeros(shape[:3], device=device))
    return tensors, kc.wrap_cache(*tensors, kv_dtype="int4_per_token_head")


def host_bytes(tensor) -> np.ndarray:
    """A torch, CuPy, JAX or NumPy tensor's bytes on the host, for exact comparisons."""
    if isinstance(tensor, cupy.ndarray):
        tensor = tensor.get()
    elif interop.framework_of(tensor) == "torch":
        import torch   # NumPy holds neither bfloat16 nor float8 tensors: their bytes, then
        tensor = tensor.cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return np.asarray(tensor).reshape(-1).view(np.uint8)


def relative_error(actual, expected) -> float:
    actual, expected = (np.asarray(a, np.float64) for a in (actual, expected))
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def as_float(tensor) -> np.ndarray:
    return tensor.float().cpu().numpy()


# --- zero-copy ----------------------------------------------------------------

def test_torch_cache_and_out_are_written_in_place_and_results_come_back_zero_copy(torch_cuda, handed_back):
    torch = torch_cuda
    tensors, cache = torch_int4_cache(torch)
    for view, tensor, name in zip(kc.cache_arrays(cache).tensors(), tensors, FIELDS):
        assert view.data.ptr == tensor.data_ptr(), f"{name}: kvcupy reads the caller's memory"

    key = torch.from_numpy(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 0)).to("cuda", torch.bfloat16)
    kc.reshape_and_cache(key, key, cache, torch.arange(NUM_TOKENS, device="cuda"))
    host = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    kc.reshape_and_cache(key.cpu(), key.cpu(), host, np.arange(NUM_TOKENS))
    for tensor, expected, name in zip(tensors, host.tensors(), FIELDS):
        np.testing.assert_array_equal(host_bytes(tensor), host_bytes(expected),
                                      err_msg=f"{name}: the write landed in the torch tensor")

    query = torch.from_numpy(normal((1, NUM_HEADS, HEAD_SIZE), 1)).to("cuda", torch.bfloat16)
    metadata = dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"),
                    seq_lens=torch.tensor([NUM_TOKENS], dtype=torch.int32, device="cuda"))
    out = torch.full_like(query, float("nan"))
    address = out.data_ptr()
    assert kc.paged_attention(query, cache, out=out, **metadata) is out
    assert out.data_ptr() == address and not out.isnan().any()

    fresh = kc.paged_attention(query, cache, **metadata)
    written_at, returned = handed_back[-1]
    assert returned is fresh and fresh.data_ptr() == written_at, "the result is kvcupy's buffer, not a copy"
    assert fresh.device == query.device and fresh.dtype == torch.bfloat16
    assert torch.equal(fresh, out)
    expected = kc.paged_attention(query.cpu(), host, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    assert relative_error(as_float(fresh), as_float(expected)) < ATTENTION_BOUND


@pytest.mark.parametrize("kv_dtype, storage", [("fp8_per_token_head", "float8_e4m3fn"), ("auto", "bfloat16")])
def test_torch_bfloat16_and_float8_caches_cross_without_copies(torch_cuda, kv_dtype, storage):
    torch = torch_cuda
    shape = (4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    tensors = [torch.zeros(shape, dtype=getattr(torch, storage), device="cuda") for _ in range(2)]
    if kv_dtype != "auto":
        tensors += [torch.zeros(shape[:3], device="cuda") for _ in range(2)]
    cache = kc.wrap_cache(*tensors, kv_dtype=kv_dtype)
    for view, tensor, name in zip(kc.cache_arrays(cache).tensors(), tensors, FIELDS):
        assert view.data.ptr == tensor.data_ptr(), f"{name} ({tensor.dtype}) is read in place"

    key = torch.from_numpy(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 2)).to("cuda", torch.bfloat16)
    kc.reshape_and_cache(key, key, cache, np.arange(NUM_TOKENS))
    host = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, kv_dtype=kv_dtype, dtype="bfloat16")
    kc.reshape_and_cache(key.cpu(), key.cpu(), host, np.arange(NUM_TOKENS))
    for tensor, expected, name in zip(tensors, host.tensors(), FIELDS):
        np.testing.assert_array_equal(host_bytes(tensor), host_bytes(expected), err_msg=name)

    query = torch.from_numpy(normal((1, NUM_HEADS, HEAD_SIZE), 3)).to("cuda", torch.bfloat16)
    out = kc.paged_attention(query, cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    assert out.dtype == torch.bfloat16 and out.device == query.device
    expected = kc.paged_attention(query.cpu(), host, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    assert relative_error(as_float(out), as_float(expected)) < ATTENTION_BOUND


def test_torch_tensors_are_viewed_from_their_pointer_where_the_streams_agree(torch_cuda):
    """On torch's current stream (where every call on torch tensors runs) a tensor
    becomes a CuPy view built from its pointer, shape and strides, without
    DLPack's exchange; elsewhere, and for tensors DLPack refuses, the exchange
    runs as before. Either way the view is the tensor's memory, its strides
    kept, its logical dtype named."""
    torch = torch_cuda
    x = torch.randn((6, 4, 32), device="cuda", dtype=torch.bfloat16).transpose(0, 1)[:, 1:5]
    exchanged = []
    export = interop._export

    def counting(*args, **kwargs):
        exchanged.append(args[1])
        return export(*args, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interop, "_export", counting)
        with interop.running_like(x):
            view = interop.as_array(x, "x")
        assert not exchanged, "same stream: no DLPack exchange"
        assert view.data.data.ptr == x.data_ptr() and view.dtype == interop.BFLOAT16
        assert view.data.shape == tuple(x.shape) and view.data.strides == tuple(2 * s for s in x.stride())
        bits = cupy.asnumpy(view.data).view(np.uint16)
        np.testing.assert_array_equal(bits, x.cpu().view(torch.int16).numpy().view(np.uint16))

        side = torch.cuda.Stream()
        with torch.cuda.stream(side):   # torch's stream differs from CuPy's current one
            other = interop.as_array(x, "x")
        assert exchanged == ["x"] and other.data.data.ptr == x.data_ptr()

        with interop.running_like(x), pytest.raises(TypeError, match="x could not be exported"):
            interop.as_array(torch.zeros(3, device="cuda", requires_grad=True), "x")

    if hasattr(torch, "float8_e4m3fn"):
        codes = torch.zeros((2, 8), device="cuda", dtype=torch.float8_e4m3fn)
        with interop.running_like(codes):
            view = interop.as_array(codes, "codes")
        assert view.dtype == kc.formats.FP8_DTYPE and view.data.dtype == np.uint8
        assert view.data.data.ptr == codes.data_ptr()


def test_cupy_out_is_written_in_place():
    cache = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    assert isinstance(cache.key_cache, cupy.ndarray)
    key = cupy.asarray(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 4), cupy.float16)
    kc.reshape_and_cache(key, key, cache, cupy.arange(NUM_TOKENS))
    query = cupy.asarray(normal((1, NUM_HEADS, HEAD_SIZE), 5), cupy.float16)
    out = cupy.full(query.shape, cupy.nan, cupy.float16)
    assert kc.paged_attention(query, cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS], out=out) is out
    fresh = kc.paged_attention(query, cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    assert isinstance(fresh, cupy.ndarray) and bool((fresh == out).all())


def test_jax_arrays_cross_without_copies(jax_gpu, handed_back):
    jax, jnp = jax_gpu, jax_gpu.numpy
    gpu = jax.devices("gpu")[0]
    query = jax.device_put(jnp.asarray(normal((1, NUM_HEADS, HEAD_SIZE), 6), jnp.bfloat16), gpu)
    array = interop.as_array(query, "query")
    assert array.data.data.ptr == query.unsafe_buffer_pointer(), "kvcupy reads JAX's buffer"
    assert array.dtype == interop.BFLOAT16 and array.device == interop.Device("cuda", gpu.local_hardware_id)

    cache = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    key_np = normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 7)
    key = jax.device_put(key_np, gpu)
    kc.reshape_and_cache(key, key, cache, jax.device_put(np.arange(NUM_TOKENS, dtype=np.int32), gpu))
    out = kc.paged_attention(query, cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    written_at, returned = handed_back[-1]
    assert returned is out and out.unsafe_buffer_pointer() == written_at, "no copy, no bitcast"
    assert isinstance(out, jax.Array) and out.devices() == {gpu} and out.dtype == jnp.bfloat16

    # The same write and attention from CuPy: the same bytes, the same result.
    reference = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    kc.reshape_and_cache(cupy.asarray(key_np), cupy.asarray(key_np), reference, np.arange(NUM_TOKENS))
    for tensor, expected, name in zip(cache.tensors(), reference.tensors(), FIELDS):
        np.testing.assert_array_equal(host_bytes(tensor), host_bytes(expected), err_msg=name)
    query32 = normal((1, NUM_HEADS, HEAD_SIZE), 8)
    from_jax = kc.paged_attention(jax.device_put(query32, gpu), cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    from_cupy = kc.paged_attention(cupy.asarray(query32), reference, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    np.testing.assert_array_equal(np.asarray(from_jax), cupy.asnumpy(from_cupy))


def test_jax_cache_is_updated_functionally(jax_gpu):
    """JAX arrays are immutable: updated_cache returns a new cache; with donate=True
    XLA writes into the given buffers (same addresses) and deletes the old arrays."""
    jax = jax_gpu
    gpu = jax.devices("gpu")[0]
    reference = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    zeros = [jax.device_put(np.zeros(t.shape, t.dtype), gpu) for t in reference.tensors()]
    cache = kc.wrap_cache(*zeros, kv_dtype=reference.kv_dtype, rotation=reference.rotation)
    with pytest.raises(TypeError, match="cache.key_cache is a JAX array"):
        kc.reshape_and_cache(zeros[0], zeros[0], cache, np.arange(1))

    steps = [(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 9), np.arange(NUM_TOKENS)),
             (normal((3, NUM_KV_HEADS, HEAD_SIZE), 10), np.array([NUM_TOKENS, -1, NUM_TOKENS + 1]))]
    for donate, (key, slots) in zip((False, True), steps):
        kc.reshape_and_cache(cupy.asarray(key), cupy.asarray(key), reference, slots)
        addresses = [t.unsafe_buffer_pointer() for t in cache.tensors()]
        updated = kc.updated_cache(jax.device_put(key, gpu), jax.device_put(key, gpu), cache, slots,
                                   donate=donate)
        for tensor, expected, name in zip(updated.tensors(), reference.tensors(), FIELDS):
            np.testing.assert_array_equal(host_bytes(tensor), host_bytes(expected), err_msg=f"{name}, donate={donate}")
        assert cache.key_cache.is_deleted() == donate
        if donate:
            assert [t.unsafe_buffer_pointer() for t in updated.tensors()] == addresses, "updated in place"
        cache = updated
    query = normal((1, NUM_HEADS, HEAD_SIZE), 11)
    out = kc.paged_attention(jax.device_put(query, gpu), cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS + 2])
    expected = kc.paged_attention(cupy.asarray(query), reference, block_table=[[0, 1]], seq_lens=[NUM_TOKENS + 2])
    np.testing.assert_array_equal(np.asarray(out), cupy.asnumpy(expected))


# --- streams ------------------------------------------------------------------

def test_launches_run_on_the_callers_current_stream(torch_cuda, launches):
    """torch tensors: torch's current stream (a non-default one here), for calls on
    caches kvcupy allocated too, and for PagedKVCache's copy-on-write; CuPy arrays:
    CuPy's current stream."""
    torch = torch_cuda
    tensors, cache = torch_int4_cache(torch)
    key = torch.from_numpy(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 12)).cuda()
    query = torch.from_numpy(normal((1, NUM_HEADS, HEAD_SIZE), 13)).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kc.reshape_and_cache(key, key, cache, torch.arange(NUM_TOKENS, device="cuda"))
        kc.paged_attention(query, cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
        kc.rotate(query, cache.rotation)
        kc.copy_blocks([cache], [[0, 2]])
    side.synchronize()
    names = ["reshape_and_cache", "paged_attention", "rotate", "copy_blocks"]
    assert launches == [(name, side.cuda_stream, 0) for name in names]

    launches.clear()
    manager = kc.PagedKVCache(1, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    first = manager.add_sequence()
    with torch.cuda.stream(side):
        manager.write(0, key, key, manager.reserve([first], NUM_TOKENS))
        second = manager.fork(first)
        slots = manager.reserve([first, second], 1)   # both append into the shared half-full page: a copy
        manager.write(0, key[:2], key[:2], slots)
        manager.attention(0, torch.cat([query, query]), [first, second])
    side.synchronize()
    assert [name for name, *_ in launches] == ["reshape_and_cache", "copy_blocks", "reshape_and_cache",
                                               "paged_attention"]
    assert {(stream, device) for _, stream, device in launches} == {(side.cuda_stream, 0)}

    launches.clear()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kc.reshape_and_cache(cupy.asarray(key.cpu().numpy()), cupy.asarray(key.cpu().numpy()),
                             manager.layers[0], np.arange(NUM_TOKENS))
        kc.paged_attention(cupy.asarray(query.cpu().numpy()), manager.layers[0], block_table=[[0, 1]],
                           seq_lens=[NUM_TOKENS])
    stream.synchronize()
    assert launches == [("reshape_and_cache", stream.ptr, 0), ("paged_attention", stream.ptr, 0)]


def test_jax_calls_run_on_the_stream_jax_takes_external_data_on(jax_gpu, launches):
    jax = jax_gpu
    gpu = jax.devices("gpu")[0]
    # One of the streams JAX takes external data on, the same for every call (JAX
    # hands out several in turn); CuPy's current stream where this JAX build has none.
    ready = interop.jax_ready_stream(gpu)
    assert ready != cupy.cuda.get_current_stream().ptr, "a stream of JAX's own, not CuPy's"
    expected = ready or cupy.cuda.get_current_stream().ptr
    cache = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    key = jax.device_put(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 14), gpu)
    kc.reshape_and_cache(key, key, cache, np.arange(NUM_TOKENS))
    out = kc.paged_attention(jax.device_put(normal((1, NUM_HEADS, HEAD_SIZE), 15), gpu), cache,
                             block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    out.block_until_ready()
    assert launches == [("reshape_and_cache", expected, gpu.local_hardware_id),
                        ("paged_attention", expected, gpu.local_hardware_id)]


def test_torch_side_stream_orders_write_attention_and_readers(torch_cuda):
    """On a non-default torch stream, behind a long kernel: torch sets the inputs,
    kvcupy writes the cache and attends into out=, torch reads the cache and out;
    nothing synchronises in between. DLPack's handshake would order the inputs
    whatever stream kvcupy used, but the cache and out= have none per call: the
    readers see kvcupy's results only if kvcupy ran on the caller's stream."""
    torch = torch_cuda
    tensors, cache = torch_int4_cache(torch)
    slots = kc.plan_slots(np.arange(NUM_TOKENS), num_slots=cache.num_slots)
    batch = kc.plan_batch(block_table=np.array([[0, 1]], np.int32), seq_lens=np.array([NUM_TOKENS], np.int32),
                          block_size=BLOCK_SIZE, num_blocks=cache.num_blocks)
    first_key, next_key = (torch.from_numpy(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), s)).cuda() for s in (16, 17))
    first_query, next_query = (torch.from_numpy(normal((1, NUM_HEADS, HEAD_SIZE), s)).cuda() for s in (18, 19))
    key, query = first_key.clone(), first_query.clone()
    out = torch.empty_like(query)
    # Compiled, planned and uploaded ahead: the queued section below only launches.
    kc.reshape_and_cache(key, key, cache, slots)
    kc.paged_attention(query, cache, batch=batch, out=out)
    out.fill_(float("nan"))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
        key.copy_(next_key)
        query.copy_(next_query)
        kc.reshape_and_cache(key, key, cache, slots)
        kc.paged_attention(query, cache, batch=batch, out=out)
        seen = [t.clone() for t in tensors] + [out.clone()]
    torch.cuda.synchronize()

    expected_tensors, expected_cache = torch_int4_cache(torch)
    kc.reshape_and_cache(next_key, next_key, expected_cache, slots)
    expected_out = kc.paged_attention(next_query, expected_cache, batch=batch)
    torch.cuda.synchronize()
    for got, expected, name in zip(seen, list(expected_tensors) + [expected_out], FIELDS + ("out",)):
        assert torch.equal(got, expected), f"{name} read on the caller's stream after kvcupy's call"


def test_calls_return_while_the_stream_is_still_busy(torch_cuda):
    """kvcupy only queues work: behind a long kernel on the caller's stream, a write,
    an attention (with a fresh output) and a rotation all return before that kernel
    ends (no stream or device synchronisation, no blocking copy). Metadata is planned
    ahead, as PagedKVCache does once per step for every layer."""
    torch = torch_cuda
    tensors, cache = torch_int4_cache(torch)
    slots = kc.plan_slots(np.arange(NUM_TOKENS), num_slots=cache.num_slots)
    batch = kc.plan_batch(block_table=np.array([[0, 1]], np.int32), seq_lens=np.array([NUM_TOKENS], np.int32),
                          block_size=BLOCK_SIZE, num_blocks=cache.num_blocks)
    key = torch.from_numpy(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 20)).cuda()
    query = torch.from_numpy(normal((1, NUM_HEADS, HEAD_SIZE), 21)).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def step():
        kc.reshape_and_cache(key, key, cache, slots)
        return kc.paged_attention(query, cache, batch=batch), kc.rotate(query, cache.rotation)

    with torch.cuda.stream(side):
        warm = step()   # compiles, plans, and leaves buffers in CuPy's pool for this stream
    side.synchronize()
    del warm
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
        results = step()
        busy = not side.query()
    side.synchronize()
    assert busy, "a kvcupy call waited for the caller's stream"
    assert not any(bool(r.isnan().any()) for r in results)


def test_jax_producer_and_consumer_are_ordered_without_blocking(jax_gpu):
    """A JAX computation still running produces the query; kvcupy attends over it and
    a JAX op consumes the result. Right without block_until_ready in between: JAX
    orders its work with kvcupy's stream through DLPack."""
    jax, jnp = jax_gpu, jax_gpu.numpy
    gpu = jax.devices("gpu")[0]

    @jax.jit
    def slow_query(x, w):
        for _ in range(32):   # a few hundred ms of products: still running when kvcupy is called
            x = jnp.tanh(x @ w)
        return x[0, :NUM_HEADS * HEAD_SIZE].reshape(1, NUM_HEADS, HEAD_SIZE)

    x = jax.device_put(normal((4096, 4096), 22), gpu)
    w = jax.device_put(normal((4096, 4096), 23) / 64, gpu)
    cache = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda")
    key = jax.device_put(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 24), gpu)
    kc.reshape_and_cache(key, key, cache, np.arange(NUM_TOKENS))
    metadata = dict(block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
    slow_query(x, w).block_until_ready()   # compiled ahead

    query = slow_query(x, w)
    out = kc.paged_attention(query, cache, **metadata)
    doubled = out * 2.0
    expected = kc.paged_attention(query.block_until_ready(), cache, **metadata)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(expected) * 2.0)


# --- several GPUs -------------------------------------------------------------

def test_a_cache_on_the_second_gpu_is_served_there(two_gpus, launches):
    """Device 0 first, then the same calls on device 1: every launch runs with device 1
    current (a module compiled for device 0 would not even launch there), results
    stay on device 1 and equal device 0's, and the caller's current device is left
    as it was."""
    torch = two_gpus
    torch.cuda.set_device(0)
    key_np, query_np = normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 25), normal((1, NUM_HEADS, HEAD_SIZE), 26)
    results = {}
    for index in (0, 1):
        device = f"cuda:{index}"
        tensors, cache = torch_int4_cache(torch, device=device)
        key, query = torch.from_numpy(key_np).to(device), torch.from_numpy(query_np).to(device)
        launches.clear()
        kc.reshape_and_cache(key, key, cache, torch.arange(NUM_TOKENS, device=device))
        out = kc.paged_attention(query, cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS])
        kc.copy_blocks([cache], [[0, 2]])
        assert {launch_device for *_, launch_device in launches} == {index}, launches
        assert out.device == torch.device(device)
        assert torch.cuda.current_device() == 0
        results[index] = [t.cpu() for t in tensors] + [out.cpu()]
    for on_0, on_1, name in zip(results[0], results[1], FIELDS + ("out",)):
        assert torch.equal(on_0, on_1), name
    allocated = kc.allocate_cache(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda:1")
    assert all(t.device.id == 1 for t in allocated.tensors())


def test_mixed_devices_in_one_call_are_refused_by_name(two_gpus):
    torch = two_gpus
    tensors, cache = torch_int4_cache(torch, device="cuda:1")
    key = torch.from_numpy(normal((NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE), 27))
    query = torch.from_numpy(normal((1, NUM_HEADS, HEAD_SIZE), 28))
    on_0, on_1 = key.to("cuda:0"), key.to("cuda:1")
    slots_on_0 = torch.arange(NUM_TOKENS, device="cuda:0")
    table_on_0 = torch.tensor([[0, 1]], dtype=torch.int32, device="cuda:0")
    cases = [
        (lambda: kc.reshape_and_cache(on_0, on_0, cache, np.arange(NUM_TOKENS)),
         "key is on cuda:0 but the cache is on cuda:1"),
        (lambda: kc.reshape_and_cache(on_1, on_0, cache, np.arange(NUM_TOKENS)),
         "key is on cuda:1 but value is on cuda:0"),
        (lambda: kc.reshape_and_cache(on_1, on_1, cache, slots_on_0),
         "slot_mapping is on cuda:0; expected the host or cuda:1"),
        (lambda: kc.paged_attention(query.to("cuda:0"), cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS]),
         "query is on cuda:0 but the cache is on cuda:1"),
        (lambda: kc.paged_attention(query.to("cuda:1"), cache, block_table=table_on_0, seq_lens=[NUM_TOKENS]),
         "block_table is on cuda:0; expected the host or cuda:1"),
        (lambda: kc.paged_attention(query.to("cuda:1"), cache, block_table=[[0, 1]], seq_lens=[NUM_TOKENS],
                                    out=torch.empty_like(query, device="cuda:0")),
         "query is on cuda:1 but out is on cuda:0"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
    assert not any(bool(t.any()) for t in tensors), "a refused call wrote nothing"


def test_kv_heads_sharded_over_two_gpus_match_one_gpu(two_gpus):
    """Tensor parallelism: KV heads 0-1 (query heads 0-3) live on cuda:0, KV heads 2-3
    (query heads 4-7) on cuda:1. Each shard's cache holds exactly the bytes of its
    heads in the one-GPU cache, and the gathered outputs match the one-GPU output."""
    torch = two_gpus
    heads, query_heads = 4, 8
    seq_lens = [30, 7]
    slots = np.concatenate([np.arange(30), 2 * BLOCK_SIZE + np.arange(7)])
    metadata = dict(block_table=[[0, 1], [2, 0]], seq_lens=seq_lens)
    key = torch.from_numpy(normal((len(slots), heads, HEAD_SIZE), 29))
    value = torch.from_numpy(normal((len(slots), heads, HEAD_SIZE), 30))
    query = torch.from_numpy(normal((2, query_heads, HEAD_SIZE), 31))

    full_tensors, full = torch_int4_cache(torch, device="cuda:0", heads=heads)
    kc.reshape_and_cache(key.to("cuda:0"), value.to("cuda:0"), full, slots)
    full_out = kc.paged_attention(query.to("cuda:0"), full, **metadata)
    shard_outs = []
    for rank in (0, 1):
        device = f"cuda:{rank}"
        kv_heads, q_heads = slice(2 * rank, 2 * rank + 2), slice(4 * rank, 4 * rank + 4)
        tensors, shard = torch_int4_cache(torch, device=device, heads=2)
        kc.reshape_and_cache(key[:, kv_heads].to(device), value[:, kv_heads].to(device), shard, slots)
        shard_outs.append(kc.paged_attention(query[:, q_heads].contiguous().to(device), shard, **metadata))
        for tensor, whole, name in zip(tensors, full_tensors, FIELDS):
            assert torch.equal(tensor.cpu(), whole[:, :, kv_heads].cpu()), f"{name}, rank {rank}"
    gathered = torch.cat([out.to("cuda:0") for out in shard_outs], dim=1)
    assert relative_error(gathered.cpu().numpy(), full_out.cpu().numpy()) < 2e-3
