"""The ROCm backend's MFMA attention (kernels_hip/attention.hip and its launcher,
kvcupy/backends/rocm/attention.py) on an NVIDIA GPU: every kernel of the call —
the rotate kernel, the attention grid, the merge — is the HIP source compiled by
NVRTC through the wave64 and MFMA emulations (kernels_hip/wave64_on_cuda.cuh,
mfma_on_cuda.cuh), launched by the ROCm backend's own launchers, which stand in
for the CUDA backend's attention while this module runs.

Judged as the CUDA kernels are (tests/gpu/test_attention.py: the same cases,
bound and per-channel check; test_long_context_error.py: flat and peaked
attention to 131072 keys). The arithmetic (attention.hip's header): codes, minus
the zero-point, enter the products exactly as fp16; the query as two fp16 terms
(2^-22 relative) or three bf16 terms; scores and the softmax in fp32; the
probabilities enter the value product rounded to fp16 (2^-11 relative each; bf16
rows: 2^-9) while the denominator sums them in fp32. That is the CUDA decode
kernel's arithmetic, so its bound holds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, reference

pytestmark = pytest.mark.gpu
if not backends.status("cuda").usable:
    pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}", allow_module_level=True)

import cupy  # noqa: E402  (only where the backend is usable)

from kvcupy import jit  # noqa: E402
from kvcupy.backends import cuda as cuda_backend  # noqa: E402
from kvcupy.backends.rocm import attention as rocm_attention  # noqa: E402
from kvcupy.backends.rocm import write as rocm_write  # noqa: E402

from ..hip import emulation  # noqa: E402
from . import test_attention as cuda_cases  # noqa: E402
from . import test_long_context_error as long_context  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def hip_attention():
    """The CUDA backend's attention entry points are the ROCm backend's while this
    module runs, and every kernel those launch is the HIP build through the
    emulation. Yields the builds made: {(entry, defines): module}."""
    modules: dict = {}
    folder = tempfile.TemporaryDirectory(prefix="kvcupy-hip-attention-")
    arch = jit.device_arch().rstrip("a")

    def emulated(device_index, entry, function, defines):
        key = (entry, tuple(defines))
        if key not in modules:
            path = Path(folder.name) / f"{entry}-{len(modules)}.cubin"
            path.write_bytes(emulation.compile_entry(entry, dict(defines), arch))
            modules[key] = cupy.RawModule(path=str(path))
        return modules[key].get_function(function)

    saved = (rocm_write._function, cuda_backend.paged_attention, cuda_backend.plan_attention)
    rocm_write._function = emulated
    cuda_backend.paged_attention = rocm_attention.paged_attention
    cuda_backend.plan_attention = rocm_attention.plan_attention
    try:
        yield modules
    finally:
        rocm_write._function, cuda_backend.paged_attention, cuda_backend.plan_attention = saved
        folder.cleanup()


def test_the_calls_run_the_hip_builds(hip_attention):
    out, expected = cuda_cases.run_case(seq_lens=(40, 70), query_lens=(1, 9))
    cuda_cases.check("hip builds", out, expected, np.float32)
    entries = {entry for entry, _ in hip_attention}
    assert {"attention", "merge", "rotate"} <= entries, entries


HEAD_SIZES = (32, 34, 64, 80, 96, 112, 128, 160, 192, 250, 256)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_dtype", cuda_cases.KV_DTYPES)
def test_decode_every_head_size_and_kv_dtype(kv_dtype, head_size):
    out, expected = cuda_cases.run_case(kv_dtype=kv_dtype, head_size=head_size)
    cuda_cases.check(f"{kv_dtype} d={head_size}", out, expected, np.float32)


@pytest.mark.parametrize("head_size", (64, 96, 128))
@pytest.mark.parametrize("kv_dtype", cuda_cases.KV_DTYPES)
def test_prefill_every_kv_dtype(kv_dtype, head_size):
    out, expected = cuda_cases.run_case(kv_dtype=kv_dtype, head_size=head_size, seq_lens=(300, 90),
                                        query_lens=(120, 90), query_dtype=np.float16)
    cuda_cases.check(f"prefill {kv_dtype} d={head_size}", out, expected, np.float16)


@pytest.mark.parametrize("block_size", (8, 16, 32, 128))
@pytest.mark.parametrize("group", (1, 2, 4, 8, 16))
def test_block_sizes_and_gqa(block_size, group):
    out, expected = cuda_cases.run_case(block_size=block_size, group=group, seq_lens=(200, 500),
                                        query_lens=(1, 20))
    cuda_cases.check(f"block {block_size} group {group}", out, expected, np.float32)


@pytest.mark.parametrize("query_dtype", (np.float16, "bfloat16", np.float32))
@pytest.mark.parametrize("kv_dtype,model_dtype", [("int4_per_token_head", np.float16), ("auto", "bfloat16"),
                                                  ("auto", np.float16), ("fp8_per_token_head", "bfloat16")])
def test_query_and_model_dtypes(query_dtype, kv_dtype, model_dtype):
    query_dtype = kc.formats.MODEL_DTYPES.get(query_dtype, query_dtype)
    model_dtype = kc.formats.MODEL_DTYPES.get(model_dtype, model_dtype)
    out, expected = cuda_cases.run_case(kv_dtype=kv_dtype, model_dtype=model_dtype, query_dtype=query_dtype,
                                        query_lens=(1, 33))
    cuda_cases.check(f"{kv_dtype} {model_dtype} query {query_dtype}", out, expected, query_dtype)


@pytest.mark.parametrize("mode,seq_lens,query_lens", [
    ("decode", (1, 17, 1000), (1, 1, 1)),
    ("chunked prefill", (300, 64, 1000), (100, 64, 7)),
    ("mixed", (513, 1, 90, 2048), (1, 1, 90, 300)),
])
@pytest.mark.parametrize("kv_dtype", cuda_cases.KV_DTYPES)
def test_every_query_length(mode, seq_lens, query_lens, kv_dtype):
    out, expected = cuda_cases.run_case(kv_dtype=kv_dtype, seq_lens=seq_lens, query_lens=query_lens)
    cuda_cases.check(f"{mode} {kv_dtype}", out, expected, np.float32)


@pytest.mark.parametrize("options", [dict(sliding_window=100), dict(sliding_window=1), dict(softcap=5.0),
                                     dict(sinks=True), dict(sliding_window=100, softcap=5.0, sinks=True)],
                         ids=["window", "window 1", "softcap", "sinks", "all"])
@pytest.mark.parametrize("query_lens", [(1, 1), (40, 300)], ids=["decode", "prefill"])
def test_window_softcap_sinks(options, query_lens):
    out, expected = cuda_cases.run_case(seq_lens=(700, 900), query_lens=query_lens, **options)
    cuda_cases.check(f"{options} {query_lens}", out, expected, np.float32)


@pytest.mark.parametrize("rotation", ["blockdiag", "kron", "none"])
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head"])
@pytest.mark.parametrize("query_lens", [(1, 1), (30, 50)], ids=["decode", "prefill"])
def test_rotations(rotation, kv_dtype, query_lens):
    out, expected = cuda_cases.run_case(kv_dtype=kv_dtype, rotation=rotation, head_size=96, query_lens=query_lens,
                                        seq_lens=(300, 100))
    cuda_cases.check(f"{rotation} {kv_dtype}", out, expected, np.float32)


@pytest.mark.parametrize("context", [1, 2, 15, 16, 17, 255, 1024, 4097, 32768])
def test_context_lengths(context):
    out, expected = cuda_cases.run_case(seq_lens=(context, max(1, context // 3)), num_kv_heads=8, group=4,
                                        seed=context)
    cuda_cases.check(f"context {context}", out, expected, np.float32)


def test_context_131072():
    out, expected = cuda_cases.run_case(seq_lens=(131072,), query_lens=(1,), num_kv_heads=8, group=4, seed=7)
    cuda_cases.check("context 131072", out, expected, np.float32)


@pytest.mark.parametrize("query_lens", [(1, 1), (50, 30)], ids=["decode", "prefill"])
@pytest.mark.parametrize("kv_dtype", cuda_cases.KV_DTYPES + ("auto-bf16",))
def test_a_nan_key_gives_nan_exactly_where_it_is_seen(kv_dtype, query_lens):
    cuda_cases.test_a_nan_key_gives_nan_exactly_where_it_is_seen(kv_dtype, query_lens)


@pytest.mark.parametrize("query_lens", [(1, 1), (40, 20)], ids=["decode", "prefill"])
def test_out_of_range_ids_never_fault(query_lens):
    cuda_cases.test_out_of_range_ids_never_fault(query_lens)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("attention", sorted(long_context.QUERY_FACTORS))
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head"])
def test_the_error_per_channel_does_not_grow_with_the_context(phase, attention, kv_dtype):
    """test_long_context_error's check (float32 queries, d = 128) on the HIP build."""
    query_dtype = np.dtype(np.float32)
    query_tokens = 1 if phase == "decode" else long_context.PREFILL_QUERY_TOKENS
    worst = {}
    for context in long_context.GPU_CONTEXTS:
        case = f"hip {phase} {kv_dtype} {attention} context={context}"
        out = long_context.attend("cuda", kv_dtype, 128, context, attention, query_tokens, query_dtype)
        want = long_context.oracle(kv_dtype, 128, context, attention, query_tokens)
        mean_abs, signed = long_context.channel_errors(out, want, query_dtype)
        channel = int(np.argmax(mean_abs))
        assert mean_abs[channel] <= long_context.BOUND, f"{case}: channel {channel} mean |error| {mean_abs[channel]:.2e}"
        channel = int(np.argmax(np.abs(signed)))
        assert abs(signed[channel]) <= long_context.BOUND, f"{case}: channel {channel} signed {signed[channel]:.2e}"
        worst[context] = float(mean_abs.max())
    shortest, longest = long_context.GPU_CONTEXTS[0], long_context.GPU_CONTEXTS[-1]
    assert worst[longest] <= long_context.GROWTH * worst[shortest] + long_context.FLOOR, worst


@pytest.mark.parametrize("rotation", ["blockdiag", "kron"])
def test_a_strided_out_gets_the_rows(rotation):
    """`out` a view with padded rows: the merge's (and the rotate kernel's) whole rows
    reach it through a contiguous copy, and nothing beside the view changes."""
    rng = np.random.default_rng(3)
    batch = cuda_cases.paged_batch(rng, [90, 40], [1, 7], 16)
    cache = cuda_cases.host_cache(rng, batch, "int4_per_token_head", 64, 2, 16, np.float16, rotation)
    query = rng.standard_normal((batch.num_queries, 8, 64)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args)
    padded = cupy.full((batch.num_queries, 8, 80), 7.0, cupy.float32)
    kc.paged_attention(cupy.asarray(query), cuda_cases.device_view(cache), **args, out=padded[..., :64])
    got = cupy.asnumpy(padded)
    cuda_cases.check(f"strided out {rotation}", got[..., :64], expected, np.float32)
    assert (got[..., 64:] == 7.0).all()
