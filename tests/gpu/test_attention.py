"""CUDA paged attention against the float64 oracle on the same quantized cache.

The cache is written once on the host (the CPU backend, whose bytes equal the
oracle's), copied to the GPU and wrapped there, so that these tests judge the
attention kernel alone; the GPU write path has its own tests.

Tolerance, from the arithmetic (attention.cuh): every cache code enters the
tensor-core products exactly; the query enters as a two-term fp16 split
(relative error below 2^-21); scores accumulate in fp32. The probabilities
enter the P.V product rounded to fp16 (relative error at most 2^-11 each),
while the denominator sums them in fp32: the output is off by at most 2^-11
~ 4.9e-4 relative, plus fp32 accumulation (~1e-6) and the rounding of the
output to its dtype (half an ulp: 2^-11 fp16, 2^-8 bf16 per element, about
a third of that in norm). The prefill kernel rotates the query (and, with
one split, the output) itself, as mma products with the rotation's 0 / +-1
entries, at most 256 products summed in fp32 (below 256 x 2^-24 = 2^-16 ~
1.5e-5 of the row's magnitudes): fp16 and bf16 queries enter those products
exactly (as fp16 and bf16 operands), fp32 ones as fp16 high and low parts
(2^-21 relative), and so do the rows rotated back into an fp32 output; rows
rotated back into a 16-bit output enter as one fp16 term (at most 2^-11
relative a value, about 2^-11 / sqrt(3) ~ 2.8e-4 of the output's norm once
the rotation has mixed them: no more than the output's own rounding, which
the bound adds). ATTENTION_BOUND = 2e-3 leaves room for the sum of these
over long contexts, and is well under a wrong scale, zero-point or mask
(errors of order 1e-2 and up). Checked over the whole output and per channel.

The prefill kernel's wgmma build (sm_90) takes the rotated query as one fp16
term: each element off by at most 2^-11 relative (the row scaled by a power
of two first), the same as attending with a query perturbed that much. A
score then moves by sum_i dq_i k_i: independent roundings add in quadrature,
about 2^-11 / sqrt(3) x |q o k| (~1e-3 of a logit on these tests' data; a
worst case, every rounding aligned, is not a realistic bound). The output
moves by the probability-weighted mean of those shifts times (v - o), which
averages further: measured 3-5e-4 relative on these tests' cases (two terms:
2-3e-4), inside the same bound. Its auto caches enter the products as fp16
rows: fp16 ones as they are, a bf16 row times a power of two of its own
(exact for every value down to 2^-30 of the row's largest, smaller ones off by
under 2^-38 of it), so the same arithmetic holds, with P times 2^10. The
producer build's direct rows: fp16 ones (PREFILL_DIRECT_F16) enter as they
are (the same arithmetic); bf16 ones enter as bf16 operands under a bf16 query
that is not rotated, so the query and every row enter exactly and only P
rounds, to bf16: each probability off by at most 2^-9 relative (about
2^-9 / sqrt(3) ~ 1.1e-3 RMS), and the output by the probability-weighted mean
of those errors times the values, which averages over the tokens that carry
weight: inside the same bound. Those outputs are bf16, whose own rounding
(2^-9) the bound adds.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, reference

from ..helpers import paged_batch

pytestmark = pytest.mark.gpu

if not backends.status("cuda").usable:
    pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}",
                allow_module_level=True)

import cupy  # noqa: E402  (only where the backend is usable)

from ..device_arrays import DeviceBf16, device_query, device_view, from_device  # noqa: E402

from kvcupy.backends.cuda import kernels, planner  # noqa: E402
from kvcupy.backends.cuda.kernels import PrefillKernel  # noqa: E402
from kvcupy.backends.cuda.tuning import DEFAULT_TUNING  # noqa: E402

ATTENTION_BOUND = 2e-3
NEVER = 1 << 30   # a key count no test reaches: tunings that switch a build off


def prefill_tuning(build: str):
    """The planner's tuning that takes `build` ("producer", "wgmma" or "mma.sync")
    for the prefill kernel on sm_90, from any number of keys."""
    keys = 0 if build == "producer" else NEVER
    return replace(DEFAULT_TUNING, prefill_wgmma=build != "mma.sync", prefill_producer_min_keys=keys,
                   prefill_producer_min_keys_rotated=keys)
OUTPUT_ROUNDING = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0 ** -12,
                   np.dtype(kc.formats.MODEL_DTYPES["bfloat16"]): 2.0 ** -9}


def host_cache(rng, batch, kv_dtype, head_size, num_kv_heads, block_size, model_dtype, rotation):
    plan = None if rotation == "default" else kc.rotation_plan(head_size, rotation)
    cache = kc.allocate_cache(batch.num_blocks, block_size, num_kv_heads, head_size, kv_dtype,
                              rotation=plan, dtype=model_dtype)
    shape = (batch.num_tokens, num_kv_heads, head_size)
    # Keys with a few outlier channels, as in repro: the rotation has work to do.
    keys = rng.standard_normal(shape).astype(np.float32)
    keys[..., :4] *= 8
    values = rng.standard_normal(shape).astype(np.float32)
    kc.reshape_and_cache(keys.astype(model_dtype), values.astype(model_dtype), cache, batch.slot_mapping)
    return cache


def check(case: str, out, expected, out_dtype):
    bound = ATTENTION_BOUND + OUTPUT_ROUNDING[np.dtype(out_dtype)]
    assert np.isfinite(out).all(), f"{case}: non-finite output"
    overall = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert overall <= bound, f"{case}: relative error {overall:.2e} > {bound:.1e}"
    # Per channel: a bias confined to a few channels (e.g. the first of each
    # rotation block) hides in the overall norm; it cannot hide here.
    rows = out.reshape(-1, out.shape[-1])
    want = expected.reshape(-1, expected.shape[-1])
    per_channel = np.linalg.norm(rows - want, axis=0) / np.linalg.norm(want, axis=0)
    worst = int(np.argmax(per_channel))
    assert per_channel[worst] <= 2 * bound, (
        f"{case}: channel {worst} relative error {per_channel[worst]:.2e} > {2 * bound:.1e}")
    return overall


def run_case(*, kv_dtype="int4_per_token_head", head_size=128, block_size=16, num_kv_heads=2, group=4,
             seq_lens=(300, 1000), query_lens=(1, 1), query_dtype=np.float32, model_dtype=np.float16,
             rotation="default", seed=0, tuning=None, **options):
    rng = np.random.default_rng(seed)
    batch = paged_batch(rng, list(seq_lens), list(query_lens), block_size)
    cache = host_cache(rng, batch, kv_dtype, head_size, num_kv_heads, block_size, model_dtype, rotation)
    num_heads = num_kv_heads * group
    query = (rng.standard_normal((batch.num_queries, num_heads, head_size)) * 2).astype(query_dtype)
    if options.get("sinks") is not None:
        options["sinks"] = rng.standard_normal(num_heads).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args, **options)
    if tuning is not None:
        args = dict(batch=kc.plan_batch(**args, block_size=block_size, num_blocks=batch.num_blocks,
                                        num_query_tokens=batch.num_queries, tuning=tuning))
    result = kc.paged_attention(device_query(query), device_view(cache), **args, **options)
    return from_device(result, np.dtype(query_dtype)), expected


def recorded_prefill_builds(monkeypatch) -> list:
    """The prefill builds the planner takes from now on (planner._prefill_kernel), in order."""
    chosen = []
    plan_build = planner._prefill_kernel

    def recorded_build(*args):
        chosen.append(plan_build(*args))
        return chosen[-1]

    monkeypatch.setattr(planner, "_prefill_kernel", recorded_build)
    return chosen


HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 256)
KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_every_head_size_and_kv_dtype(kv_dtype, head_size):
    out, expected = run_case(kv_dtype=kv_dtype, head_size=head_size, seq_lens=(37, 700, 1500),
                             query_lens=(1, 1, 1), seed=head_size)
    check(f"{kv_dtype} d={head_size}", out, expected, np.float32)


@pytest.mark.parametrize("block_size", (8, 16, 32, 128))
@pytest.mark.parametrize("group", (1, 4, 8, 16))
def test_block_sizes_and_gqa(block_size, group):
    out, expected = run_case(block_size=block_size, group=group, num_kv_heads=2 if group < 16 else 1,
                             seq_lens=(129, 517), seed=block_size + group)
    check(f"B={block_size} group={group}", out, expected, np.float32)


@pytest.mark.parametrize("query_dtype", (np.float16, "bfloat16", np.float32))
@pytest.mark.parametrize("kv_dtype,model_dtype", [("int4_per_token_head", np.float16),
                                                  ("auto", np.float16), ("auto", "bfloat16"),
                                                  ("fp8_per_token_head", "bfloat16")])
def test_query_and_model_dtypes(query_dtype, kv_dtype, model_dtype):
    bf16 = kc.formats.MODEL_DTYPES["bfloat16"]
    query_dtype = bf16 if query_dtype == "bfloat16" else np.dtype(query_dtype)
    model_dtype = bf16 if model_dtype == "bfloat16" else np.dtype(model_dtype)
    out, expected = run_case(kv_dtype=kv_dtype, query_dtype=query_dtype, model_dtype=model_dtype)
    check(f"{kv_dtype}/{model_dtype} q={query_dtype}", out, expected, query_dtype)


@pytest.mark.parametrize("mode,seq_lens,query_lens", [
    ("spec-decode", (200, 900), (4, 8)),
    ("prefill", (300, 77), (300, 77)),
    ("chunked prefill", (1000, 200), (64, 200)),
    ("mixed", (500, 40, 2000, 9), (1, 40, 5, 9)),
])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_query_length(mode, seq_lens, query_lens, kv_dtype):
    out, expected = run_case(kv_dtype=kv_dtype, seq_lens=seq_lens, query_lens=query_lens)
    check(f"{mode} {kv_dtype}", out, expected, np.float32)


PREFILL_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160)


@pytest.mark.parametrize("query_rows", ["model", "float32"])
@pytest.mark.parametrize("build", ["producer", "wgmma", "mma.sync"])
@pytest.mark.parametrize("head_size", PREFILL_HEAD_SIZES)
@pytest.mark.parametrize("kv_dtype,model_dtype", [(kv, np.float16) for kv in KV_DTYPES] + [("auto", "bfloat16")])
def test_prefill_every_head_size_and_kv_dtype(kv_dtype, model_dtype, head_size, build, query_rows):
    """The prefill kernel (prefill.cuh; head sizes above its class fall back to the
    decode kernel's row tiles): a prompt, a chunk over a longer context, a short
    prompt and a decode row in one batch, so partial row and key tiles, diagonal
    tiles and skipped ones all occur. Both builds of quantized caches where the
    GPU has wgmma (sm_90): the warpgroup one with and without its producer
    warpgroup, and the mma.sync one that older GPUs take. Auto caches of both
    16-bit dtypes: the wgmma builds copy fp16 rows and convert bf16 ones to fp16
    with a power of two a row. Queries of the model's dtype (a serving model's:
    the rotated builds without the float32 rows' code, PrefillKernel.wide_rows
    False) and float32 ones (the builds with it)."""
    warpgroups = build in ("producer", "wgmma")
    hopper = cupy.cuda.Device().compute_capability == "90"
    if warpgroups and not (hopper and head_size <= 128):
        pytest.skip("the wgmma build serves sm_90 GPUs, head sizes up to 128")
    model_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if model_dtype == "bfloat16" else np.dtype(model_dtype)
    rng = np.random.default_rng(head_size)
    seq_lens, query_lens = [300, 1000, 77, 5], [300, 130, 77, 1]
    batch = paged_batch(rng, seq_lens, query_lens, 16)
    cache = host_cache(rng, batch, kv_dtype, head_size, 2, 16, model_dtype, "default")
    query_dtype = model_dtype if query_rows == "model" else np.dtype(np.float32)
    query = (rng.standard_normal((batch.num_queries, 8, head_size)) * 2).astype(query_dtype)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args)
    planned = kc.plan_batch(**args, block_size=16, num_blocks=batch.num_blocks, num_query_tokens=batch.num_queries,
                            tuning=prefill_tuning(build))
    out = from_device(kc.paged_attention(device_query(query), device_view(cache), batch=planned), query_dtype)
    (plan,) = planned._backend_plans.values()
    assert isinstance(plan.kernel, PrefillKernel) == (head_size <= 128), plan.kernel
    assert getattr(plan.kernel, "wgmma", False) == warpgroups, plan.kernel
    assert getattr(plan.kernel, "producer", False) == (build == "producer"), plan.kernel
    check(f"prefill {build} {kv_dtype}/{model_dtype} d={head_size} q={query_dtype}", out, expected, query_dtype)


@pytest.mark.parametrize("build", ["producer", "wgmma", "mma.sync"])
def test_prefill_bf16_rows_beyond_fp16_range(build):
    """bf16 cache rows from 2^-40 to 2^40 (fp16 holds 2^-24 .. 65504): the wgmma
    builds convert each row to fp16 with a power of two of its own, so no value
    overflows to inf and no row's small values vanish, and tokens whose V rows
    are 2^40 apart still meet in one output. The query is scaled down so the
    logits stay of order 10 (keys up to 2^40 x 8)."""
    warpgroups = build in ("producer", "wgmma")
    if warpgroups and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma builds serve sm_90 GPUs")
    bf16 = kc.formats.MODEL_DTYPES["bfloat16"]
    rng = np.random.default_rng(40)
    seq_lens, query_lens = [700, 300], [200, 300]
    batch = paged_batch(rng, seq_lens, query_lens, 16)
    cache = kc.allocate_cache(batch.num_blocks, 16, 2, 128, "auto", dtype=bf16)
    shape = (batch.num_tokens, 2, 128)

    def row_scales():   # a power of two a (token, KV head) row, 2^-40 .. 2^40
        return np.exp2(rng.integers(-40, 41, (batch.num_tokens, 2, 1)))

    keys = rng.standard_normal(shape) * row_scales()
    values = rng.standard_normal(shape) * row_scales()
    kc.reshape_and_cache(keys.astype(bf16), values.astype(bf16), cache, batch.slot_mapping)
    query = (rng.standard_normal((batch.num_queries, 8, 128)) * 2.0 ** -38).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args)
    planned = kc.plan_batch(**args, block_size=16, num_blocks=batch.num_blocks, num_query_tokens=batch.num_queries,
                            tuning=prefill_tuning(build))
    out = from_device(kc.paged_attention(cupy.asarray(query), device_view(cache), batch=planned), np.float32)
    (plan,) = planned._backend_plans.values()
    assert plan.kernel.wgmma == warpgroups and plan.kernel.producer == (build == "producer"), plan.kernel
    check(f"prefill {build} bf16 rows 2^-40 .. 2^40", out, expected, np.float32)


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=700), dict(softcap=5.0), dict(sinks=True)],
                         ids=["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("kv_dtype,head_size", [("int4_per_token_head", 128), ("int4_per_token_head", 96),
                                                ("int8_per_token_head", 96), ("fp8_per_token_head", 64)])
@pytest.mark.parametrize("query_dtype", (np.float16, np.float32))
def test_prefill_producer_build_over_long_keys(kv_dtype, head_size, query_dtype, options, monkeypatch):
    """The wgmma build with its producer warpgroup (taken from
    Tuning.prefill_producer_min_keys keys): a chunk of 256 tokens over 5744 cached and a
    prompt of 700 in one batch, so that the producer's raw stages and decoded
    buffers wrap around many times (95 key tiles) and the consumers' output
    products of each tile meet the next tile's softmax; blockdiag caches, the
    query rotated in the kernel (an fp16 query: the build without the float32
    rows' code; a float32 one: the build with it), and window, softcap or sinks."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the producer build is a wgmma build: sm_90 GPUs")
    chosen = recorded_prefill_builds(monkeypatch)
    options = dict(options, sinks=np.zeros(1)) if options.get("sinks") else options   # random logits in run_case
    out, expected = run_case(kv_dtype=kv_dtype, head_size=head_size, seq_lens=(6000, 700), query_lens=(256, 700),
                             query_dtype=query_dtype, rotation="blockdiag", seed=head_size, **options)
    assert chosen and all(kernel.producer for kernel in chosen), chosen
    check(f"prefill producer {kv_dtype} d={head_size} q={query_dtype} {options}", out, expected, query_dtype)


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=100, softcap=5.0, sinks=True)],
                         ids=["plain", "window softcap sinks"])
@pytest.mark.parametrize("rotation", ("none", "blockdiag"))
@pytest.mark.parametrize("head_size", (128, 80, 64, 32))
@pytest.mark.parametrize("kv_dtype,model_dtype", [(kv, np.float16) for kv in KV_DTYPES]
                         + [("auto", "bfloat16"), ("int8_per_token_head", "bfloat16")])
def test_prefill_short_prompt_builds(kv_dtype, model_dtype, head_size, rotation, options, monkeypatch):
    """Short prompts (Tuning.prefill_short_keys keys at most) take the build without
    the producer at prefill_short_warps warps, prefill_short_tile-token tiles and
    two blocks a multiprocessor where those fit (not 16-bit rows at d = 128), and
    caches without a rotation a build without the rotation's code (KVC_ROTATED
    0); rotated caches take the short build too. A prompt at the limit, a chunk over cached keys, a short prompt
    and a decode row in one batch, the query in the cache's dtype (its rows by
    bulk copies; without a rotation, quantized caches take them straight into
    the products' layout: prefill.cuh's direct_query, a bf16 query scaled there)."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the short-prompt builds are wgmma builds: sm_90 GPUs")
    chosen = recorded_prefill_builds(monkeypatch)
    model_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if model_dtype == "bfloat16" else np.dtype(model_dtype)
    options = dict(options, sinks=np.zeros(1)) if options.get("sinks") else options   # random logits in run_case
    longest = DEFAULT_TUNING.prefill_short_keys
    out, expected = run_case(kv_dtype=kv_dtype, head_size=head_size, seq_lens=(longest, 200, 77, 9),
                             query_lens=(longest, 120, 77, 1), model_dtype=model_dtype, query_dtype=model_dtype,
                             rotation=rotation, seed=head_size, **options)
    sixteen_bit_128 = kv_dtype == "auto" and head_size > 96
    assert chosen and all(not kernel.producer and kernel.rotated == (rotation != "none")
                          and (kernel.warps == DEFAULT_TUNING.prefill_short_warps) != sixteen_bit_128
                          for kernel in chosen), chosen
    check(f"prefill short {kv_dtype}/{model_dtype} {rotation} d={head_size} {options}", out, expected, model_dtype)


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=700), dict(softcap=5.0), dict(sinks=True)],
                         ids=["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("head_size", (128, 96, 80, 64, 32))
@pytest.mark.parametrize("model_dtype,query_dtype,rotation,direct", [
    ("bfloat16", "bfloat16", "none", True), ("bfloat16", "bfloat16", "blockdiag", False),
    ("bfloat16", np.float32, "none", False), (np.float16, "bfloat16", "blockdiag", True),
    (np.float16, np.float16, "none", True)])
def test_prefill_direct_rows(model_dtype, query_dtype, rotation, direct, head_size, options, monkeypatch):
    """The producer build over auto caches copies the rows straight into the
    products' layout (prefill.cuh, DIRECT): bf16 rows as bf16 operands where the
    query is bf16 and not rotated (otherwise the decoding pass, which these cases
    pin too), and fp16 rows under any query. A
    chunk of 256 tokens over 5744 cached and a prompt of 700: 95 key tiles
    through the buffers; d = 80 pads its rows to 96 dims with zero-filled
    copies. The direct tiles are swizzled: 128-byte columns at d = 128 and 64,
    64-byte ones at 96 (80) and 32 (a warp copying 2 and 8 rows at a time)."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the producer build is a wgmma build: sm_90 GPUs")
    taken = []   # the builds the calls take
    for_query = kernels.PrefillKernel.for_query

    def recorded(kernel, *args):
        taken.append(for_query(kernel, *args))
        return taken[-1]

    monkeypatch.setattr(kernels.PrefillKernel, "for_query", recorded)
    bf16 = kc.formats.MODEL_DTYPES["bfloat16"]
    model_dtype = bf16 if model_dtype == "bfloat16" else np.dtype(model_dtype)
    query_dtype = bf16 if query_dtype == "bfloat16" else np.dtype(query_dtype)
    options = dict(options, sinks=np.zeros(1)) if options.get("sinks") else options   # random logits in run_case
    out, expected = run_case(kv_dtype="auto", head_size=head_size, seq_lens=(6000, 700), query_lens=(256, 700),
                             model_dtype=model_dtype, query_dtype=query_dtype, rotation=rotation, seed=head_size,
                             **options)
    assert taken and all(kernel.producer and kernel.direct == direct for kernel in taken), taken
    check(f"prefill direct={direct} {model_dtype} rows, q={query_dtype} {rotation} d={head_size} {options}", out,
          expected, query_dtype)


@pytest.mark.parametrize("build", ["producer", "wgmma"])
@pytest.mark.parametrize("layout", ["packed", "rows off 16 bytes"])
@pytest.mark.parametrize("query_dtype", (np.float16, "bfloat16"))
@pytest.mark.parametrize("kv_dtype,rotation,head_size", [("int4_per_token_head", "blockdiag", 128),
                                                         ("int8_per_token_head", "blockdiag", 96),
                                                         ("fp8_per_token_head", "none", 64),
                                                         ("auto", "none", 36)])
def test_prefill_query_and_output_rows_by_bulk_copies_or_not(kv_dtype, rotation, head_size, query_dtype, layout,
                                                             build):
    """The wgmma build without the producer brings 16-bit query rows into shared
    memory, and writes the output's, by bulk copies where every row's start and
    size are 16-byte multiples (prefill.cuh, bulk_rows), and by each lane's own
    loads and stores otherwise (and always in the producer build): here a query
    whose head stride is d + 2 and an `out` that starts 4 bytes past a 16-byte
    boundary, and d = 36. A prompt of 100 tokens (blocks of one or two key
    tiles: the inverse rotation's fragments come with the query), one of 500
    and a chunk of 300 over 3000, with sinks. (Which path a block took is not
    observable here: the layouts choose it, prefill.cuh's bulk_rows.)"""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma builds serve sm_90 GPUs")
    bf16 = query_dtype == "bfloat16"
    query_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if bf16 else np.dtype(query_dtype)
    rng = np.random.default_rng(head_size)
    batch = paged_batch(rng, [100, 500, 3000], [100, 500, 300], 16)
    cache = host_cache(rng, batch, kv_dtype, head_size, 2, 16, np.float16, rotation)
    shape = (batch.num_queries, 8, head_size)
    query = (rng.standard_normal(shape) * 2).astype(query_dtype)
    sinks = rng.standard_normal(8).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args, sinks=sinks)
    bits = query.view(np.uint16)
    off = layout != "packed"
    # Off 16 bytes: the query a view whose head stride is d + 2 elements, `out`
    # contiguous from 4 bytes past an allocation's start.
    query_bits = cupy.zeros((shape[0], 8, head_size + 2 * off), cupy.uint16)
    query_bits[..., :head_size] = cupy.asarray(bits)
    query_bits = query_bits[..., :head_size]
    out_backing = cupy.full(int(np.prod(shape)) + 2, 0xFFFF, cupy.uint16)   # NaN bits in either dtype
    out_bits = out_backing[2 * off:2 * off + int(np.prod(shape))].reshape(shape)
    wrap = DeviceBf16 if bf16 else (lambda array: array.view(cupy.float16))
    planned = kc.plan_batch(**args, block_size=16, num_blocks=batch.num_blocks, num_query_tokens=batch.num_queries,
                            tuning=prefill_tuning(build))
    kc.paged_attention(wrap(query_bits), device_view(cache), batch=planned, sinks=cupy.asarray(sinks),
                       out=wrap(out_bits))
    (plan,) = planned._backend_plans.values()
    assert plan.kernel.wgmma and plan.kernel.producer == (build == "producer"), plan.kernel
    out = from_device(DeviceBf16(out_bits) if bf16 else out_bits.view(cupy.float16), query_dtype)
    check(f"prefill {build} {layout} {kv_dtype} {rotation} d={head_size} q={query_dtype}", out, expected,
          query_dtype)
    assert (cupy.asnumpy(out_backing[:2 * off]) == 0xFFFF).all()   # nothing written before `out`
    if not off:
        assert (cupy.asnumpy(out_backing[-2:]) == 0xFFFF).all()   # nor after it


@pytest.mark.parametrize("block_size", (8, 32, 128))
@pytest.mark.parametrize("group", (1, 8))
@pytest.mark.parametrize("query_dtype", (np.float16, "bfloat16"))
def test_prefill_block_sizes_gqa_and_query_dtypes(block_size, group, query_dtype):
    query_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if query_dtype == "bfloat16" else np.dtype(query_dtype)
    out, expected = run_case(block_size=block_size, group=group, seq_lens=(129, 517), query_lens=(129, 200),
                             query_dtype=query_dtype, seed=block_size + group)
    check(f"prefill B={block_size} group={group} q={query_dtype}", out, expected, query_dtype)


@pytest.mark.parametrize("options", [dict(sliding_window=100), dict(softcap=5.0), dict(sinks=True),
                                     dict(sliding_window=33, softcap=2.0, sinks=True)],
                         ids=["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("query_lens", [(1, 1), (40, 300)], ids=["decode", "prefill"])
def test_window_softcap_sinks(options, query_lens):
    options = dict(options)
    if options.get("sinks"):
        options["sinks"] = np.zeros(1)   # replaced by random logits in run_case
    out, expected = run_case(seq_lens=(700, 300), query_lens=query_lens, **options)
    check(f"{options} {query_lens}", out, expected, np.float32)


@pytest.mark.parametrize("rotation", ["blockdiag", "kron", "none"])
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head"])
def test_rotations(rotation, kv_dtype):
    out, expected = run_case(kv_dtype=kv_dtype, head_size=96, rotation=rotation)
    check(f"{kv_dtype} {rotation}", out, expected, np.float32)


@pytest.mark.parametrize("context", [1, 2, 15, 16, 17, 255, 1024, 4097, 32768])
def test_context_lengths(context):
    out, expected = run_case(seq_lens=(context, max(1, context // 3)), num_kv_heads=8, group=4,
                             seed=context)
    check(f"context {context}", out, expected, np.float32)


def test_context_131072():
    out, expected = run_case(seq_lens=(131072,), query_lens=(1,), num_kv_heads=8, group=4, seed=7)
    check("context 131072", out, expected, np.float32)


@pytest.mark.parametrize("query_lens", [(1, 1), (50, 30)], ids=["decode", "prefill"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES + ("auto-bf16",))
def test_a_nan_key_gives_nan_exactly_where_it_is_seen(kv_dtype, query_lens):
    """auto-bf16: the wgmma prefill builds convert a bf16 row to fp16 with a
    scale from its largest finite magnitude; the NaN must survive that."""
    rng = np.random.default_rng(5)
    batch = paged_batch(rng, [50, 30], list(query_lens), 16)
    model_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if kv_dtype == "auto-bf16" else np.dtype(np.float16)
    kv_dtype = "auto" if kv_dtype == "auto-bf16" else kv_dtype
    cache = host_cache(rng, batch, kv_dtype, 64, 2, 16, model_dtype, "default")
    bad = np.full((1, 2, 64), np.nan, model_dtype)
    bad[0, 1] = 1.0   # only KV head 0 is broken
    kc.reshape_and_cache(bad, bad, cache, batch.slot_mapping[:1])   # token 0 of sequence 0
    query = rng.standard_normal((batch.num_queries, 8, 64)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    out = from_device(kc.paged_attention(cupy.asarray(query), device_view(cache), **args), np.float32)
    finite = np.isfinite(out).all(axis=-1)
    # Sequence 0 (every one of its query tokens sees token 0), query heads 0-3 read
    # KV head 0: NaN. Everything else finite.
    first = query_lens[0]
    assert not finite[:first, :4].any() and finite[:first, 4:].all() and finite[first:].all(), finite


@pytest.mark.parametrize("query_lens", [(1, 1), (40, 20)], ids=["decode", "prefill"])
def test_out_of_range_ids_never_fault(query_lens):
    """Device metadata is not read back: bad block ids and lengths give garbage
    rows, never an access outside the cache (compute-sanitizer checks the reads)."""
    rng = np.random.default_rng(9)
    batch = paged_batch(rng, [40, 20], list(query_lens), 16)
    cache = device_view(host_cache(rng, batch, "int4_per_token_head", 64, 2, 16, np.float16, "default"))
    table = batch.block_table.copy()
    table[0, 0], table[1, 0] = 10 ** 6, -5
    query = cupy.asarray(rng.standard_normal((batch.num_queries, 8, 64)).astype(np.float32))
    out = kc.paged_attention(query, cache, block_table=cupy.asarray(table),
                             seq_lens=cupy.asarray(np.array([10 ** 6, 20], np.int32)),
                             cu_seqlens_q=cupy.asarray(batch.cu_seqlens_q))
    cupy.cuda.Device().synchronize()
    assert out.shape == (batch.num_queries, 8, 64)
    with pytest.raises(ValueError, match="block_table"):
        kc.paged_attention(query, cache, block_table=cupy.asarray(table),
                           seq_lens=cupy.asarray(batch.seq_lens), cu_seqlens_q=cupy.asarray(batch.cu_seqlens_q),
                           validate=True)


def _attention_plan(query, cache, args, tuning=DEFAULT_TUNING):
    """The batch planned for these arguments and the CUDA plan kc.paged_attention made for it."""
    batch = kc.plan_batch(**args, block_size=cache.block_size, num_blocks=cache.num_blocks,
                          num_query_tokens=query.shape[0], tuning=tuning)
    kc.paged_attention(query, cache, batch=batch)
    (plan,) = batch._backend_plans.values()
    return batch, plan


@pytest.mark.parametrize("row_staging", [True, False], ids=["rows", "bulk"])
@pytest.mark.parametrize("head_size,fits", [(64, True), (96, True), (128, True), (256, None), (80, False)])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_kv_heads,block_size", [(8, 16), (4, 32), (8, 128), (4, 8)])
def test_bulk_staging(kv_dtype, head_size, fits, num_kv_heads, block_size, row_staging):
    """Quantized pages staged on sm_90 by row copies or bulk copies (a block
    serving every KV head, head sizes at a class boundary), with partial tiles,
    runs over 2-5 pages a tile, pages past a sequence's end and spec-decode
    rows; auto caches take row copies only (where a block serves 4k heads),
    head size 80 (padded to 96) keeps per-thread copies.
    fits: whether the pages take an mbarrier staging (None: either)."""
    rng = np.random.default_rng(head_size + num_kv_heads)
    batch = paged_batch(rng, [1, 37, 700, 2048], [1, 1, 3, 1], block_size)
    cache = host_cache(rng, batch, kv_dtype, head_size, num_kv_heads, block_size, np.float16, "default")
    query = rng.standard_normal((batch.num_queries, 4 * num_kv_heads, head_size)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args)
    view = device_view(cache)
    planned, plan = _attention_plan(cupy.asarray(query), view, args,
                                    replace(DEFAULT_TUNING, row_staging=row_staging))
    if fits is not None:
        capable = int(cupy.cuda.Device().compute_capability) >= 90
        rows = row_staging and plan.kernel.stages >= kernels.ROW_STAGING_MIN_STAGES
        staged = kernels.STAGE_ROWS if rows else kernels.STAGE_BULK
        if kv_dtype == "auto":
            rows = fits and capable and row_staging and plan.kernel.heads % 4 == 0
            expected_staging = kernels.STAGE_ROWS if rows else kernels.STAGE_THREADS
        else:
            expected_staging = staged if fits and capable else kernels.STAGE_THREADS
        assert plan.kernel.staging == expected_staging, plan.kernel
    out = from_device(kc.paged_attention(cupy.asarray(query), view, batch=planned), np.float32)
    check(f"{kv_dtype} d={head_size} Hk={num_kv_heads} B={block_size}", out, expected, np.float32)


@pytest.mark.parametrize("seq_lens,block_size,rotation,options", [
    ((1, 17, 64, 65, 700), 16, "default", {}),
    ((4097, 300), 8, "default", {}),
    ((2048, 129), 128, "none", {}),
    ((32768, 1000), 32, "default", {}),
    ((700, 300), 16, "default", dict(sliding_window=100, softcap=5.0, sinks=True)),
    ((128, 129, 192, 256), 16, "default", dict(one_split=True)),
], ids=["short", "block8", "block128-none", "32768", "window-softcap-sinks", "early-last-stage"])
@pytest.mark.parametrize("head_size,stages", [(128, 3), (96, 3), (96, 2)])
def test_int4_decode_with_64_token_tiles(head_size, stages, seq_lens, block_size, rotation, options):
    """int4 decode on 64-token tiles (planner._long_tile), forced here for
    splits of any length (the planner takes them for splits of 1024 keys and more),
    at d = 128 and 96 (three 128-byte lines a token's row), and at d = 96 the two-block
    build of two stages (row copies issued before a tile; the planner's from 2048
    keys a split) as well as the one-block build: partial tiles, pages of 8 to 128
    tokens, a window, softcap and sinks; and one split a sequence of 2, 3 and 4
    tiles, around the three-stage build's copies of its last stage before tile 0
    (kEarlyLast)."""
    options = dict(options)
    one_split = options.pop("one_split", False)
    tuning = replace(DEFAULT_TUNING, long_tile_min_split_tokens=0,
                     two_block_min_split_tokens=0 if stages == 2 else NEVER,
                     max_splits=1 if one_split else DEFAULT_TUNING.max_splits)   # one: 2, 3, 3 and 4 tiles a block
    rng = np.random.default_rng(len(seq_lens) + block_size)
    batch = paged_batch(rng, list(seq_lens), [1] * len(seq_lens), block_size)
    cache = host_cache(rng, batch, "int4_per_token_head", head_size, 8, block_size, np.float16, rotation)
    query = (rng.standard_normal((batch.num_queries, 32, head_size)) * 2).astype(np.float32)
    if options.get("sinks"):
        options["sinks"] = rng.standard_normal(32).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args, **options)
    view = device_view(cache)
    planned = kc.plan_batch(**args, block_size=block_size, num_blocks=batch.num_blocks,
                            num_query_tokens=batch.num_queries, tuning=tuning)
    out = from_device(kc.paged_attention(cupy.asarray(query), view, batch=planned, **options), np.float32)
    (plan,) = planned._backend_plans.values()
    assert (plan.kernel.tile, plan.kernel.stages) == (kernels.DECODE_LONG_TILE, stages), plan.kernel
    assert plan.num_splits == 1 or not one_split, plan.num_splits
    check(f"long tiles {seq_lens} B={block_size} {rotation} {options}", out, expected, np.float32)


def _two_query_case(seed: int, seq_lens, query_lens, tuning=DEFAULT_TUNING) -> tuple:
    """An int4 cache (d = 128, 8 KV heads, block size 16, the default rotation) over
    `seq_lens`, two fp16 queries of 32 heads for `query_lens`, the batch's
    arguments, the cache's device view and its plan: the dependent-launch tests'
    case, where alternating queries on one plan expose a read that came too early."""
    rng = np.random.default_rng(seed)
    batch = paged_batch(rng, list(seq_lens), list(query_lens), 16)
    cache = host_cache(rng, batch, "int4_per_token_head", 128, 8, 16, np.float16, "default")
    queries = [(rng.standard_normal((batch.num_queries, 32, 128)) * 2).astype(np.float16) for _ in range(2)]
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    planned = kc.plan_batch(**args, block_size=16, num_blocks=batch.num_blocks, num_query_tokens=batch.num_queries,
                            tuning=tuning)
    return cache, queries, args, device_view(cache), planned


@pytest.mark.parametrize("seq_lens,query_lens", [((32768, 8192, 300, 5000), (1, 1, 1, 1)),
                                                   ((8192, 6000), (256, 128))], ids=["decode", "chunked"])
def test_dependent_merge_waits_for_the_splits(seq_lens, query_lens):
    """The merge launched as a programmatic dependent (sm_90: launch.py; its
    blocks may start while the attention grid runs) reads the splits' finished
    states: calls alternating between two queries on one plan (one workspace,
    so a merge that read too early would find the other query's states) equal
    the plainly launched grids' (Tuning.dependent_launch off) bit for bit, and
    the oracle's."""
    plain_tuning = replace(DEFAULT_TUNING, dependent_launch=False)

    def outputs(tuning) -> tuple:
        cache, queries, args, view, planned = _two_query_case(sum(seq_lens), seq_lens, query_lens, tuning)
        device_queries = [cupy.asarray(query) for query in queries]
        results = [cupy.asnumpy(kc.paged_attention(device_queries[call % 2], view, batch=planned))
                   for call in range(6)]
        cupy.cuda.get_current_stream().synchronize()
        (plan,) = planned._backend_plans.values()
        return results, plan, cache, queries, args

    plain, plain_plan, *_ = outputs(plain_tuning)
    dependent, plan, cache, queries, args = outputs(DEFAULT_TUNING)
    assert plan.num_splits > 1, plan
    capability = int(cupy.cuda.Device().compute_capability)
    assert plan.dependent_launch == (capability >= 90) and not plain_plan.dependent_launch
    for call, (want, got) in enumerate(zip(plain, dependent)):
        assert np.array_equal(want, got), f"call {call}: the dependent merge's output differs"
    for which, query in enumerate(queries):
        expected = reference.paged_attention(query, cache, **args)
        check(f"query {which}", dependent[which].astype(np.float64), expected, np.float16)


# A kernel that lets its dependents launch at once, then writes `dst` only after
# wait_ns: an attention kernel launched as its programmatic dependent that read
# the query before its griddepcontrol.wait would find the old rows.
LATE_COPY = r"""
extern "C" __global__ void late_copy(const unsigned short* src, unsigned short* dst, long long n,
                                     long long wait_ns) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (threadIdx.x == 0) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)wait_ns);
  }
  __syncthreads();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


@pytest.mark.parametrize("seq_lens,query_lens", [((8192, 300, 5000), (1, 1, 1)), ((700, 300), (700, 300))],
                         ids=["decode-merged", "prefill-direct"])
def test_dependent_attention_waits_for_the_kernel_before_it(seq_lens, query_lens):
    """The attention kernel launched as a programmatic dependent (sm_90,
    Tuning.dependent_launch) reads nothing before the kernel ahead of it is done:
    the query rows written late by a kernel that lets its dependents launch at
    once (late_copy, 200 us after its start) are the ones attended, in a split
    decode (its merge then lets the next call in) and in a one-launch prefill."""
    cache, queries, args, view, planned = _two_query_case(sum(seq_lens) + sum(query_lens), seq_lens, query_lens)
    late_copy = cupy.RawKernel(LATE_COPY, "late_copy")
    sources = [cupy.asarray(query) for query in queries]
    rows = cupy.empty_like(sources[0])
    kc.paged_attention(sources[0], view, batch=planned)   # compiled and planned before the timed race
    outputs = []
    for call in range(4):   # the rows hold the other query when each copy starts
        rows[...] = sources[(call + 1) % 2]
        late_copy((8,), (256,), (sources[call % 2], rows, np.int64(rows.size), np.int64(200_000)))
        outputs.append(cupy.asnumpy(kc.paged_attention(rows, view, batch=planned)))
    cupy.cuda.get_current_stream().synchronize()
    (plan,) = planned._backend_plans.values()
    capability = int(cupy.cuda.Device().compute_capability)
    assert plan.dependent_launch == (capability >= 90)
    assert plan.num_splits > 1 or query_lens[0] > 1, plan   # decode: split, so merged
    expected = [reference.paged_attention(query, cache, **args) for query in queries]
    for call, got in enumerate(outputs):
        check(f"call {call}", got.astype(np.float64), expected[call % 2], np.float16)


def test_one_batch_plan_serves_caches_of_every_format():
    """A batch planned once and passed with caches of other KV dtypes: each call
    gets its own kernel (the plan is keyed by the cache's format and layout)."""
    rng = np.random.default_rng(21)
    batch = paged_batch(rng, [300, 1000], [1, 1], 16)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    query = rng.standard_normal((2, 32, 128)).astype(np.float32)
    shared = kc.plan_batch(**args, block_size=16, num_blocks=batch.num_blocks, num_query_tokens=2)
    for kv_dtype in KV_DTYPES:
        cache = host_cache(rng, batch, kv_dtype, 128, 8, 16, np.float16, "default")
        expected = reference.paged_attention(query, cache, **args)
        out = from_device(kc.paged_attention(cupy.asarray(query), device_view(cache), batch=shared), np.float32)
        check(f"{kv_dtype} on a shared plan", out, expected, np.float32)
    assert len(shared._backend_plans) == len(KV_DTYPES)


@pytest.mark.parametrize("model_dtype", [np.float16, "bfloat16"])
def test_auto_cache_allocated_on_the_gpu(model_dtype):
    """An auto cache that allocate_cache made on the GPU (CuPy holds bfloat16 as
    uint16 bits) and the GPU write path filled, against the oracle on the CPU's
    cache of the same inputs."""
    model_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if model_dtype == "bfloat16" else np.dtype(model_dtype)
    rng = np.random.default_rng(8)
    batch = paged_batch(rng, [90, 333], [1, 1], 16)
    keys, values = (rng.standard_normal((batch.num_tokens, 8, 64)).astype(model_dtype) for _ in range(2))
    host = kc.allocate_cache(batch.num_blocks, 16, 8, 64, "auto", dtype=model_dtype.name)
    kc.reshape_and_cache(keys, values, host, batch.slot_mapping)
    device = kc.allocate_cache(batch.num_blocks, 16, 8, 64, "auto", dtype=model_dtype.name, device="cuda")
    kc.reshape_and_cache(device_query(keys), device_query(values), device, cupy.asarray(batch.slot_mapping))
    query = rng.standard_normal((2, 32, 64)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    out = from_device(kc.paged_attention(cupy.asarray(query), device, **args), np.float32)
    check(f"auto {model_dtype} allocated on the GPU", out, reference.paged_attention(query, host, **args),
          np.float32)


@pytest.mark.parametrize("shape", ["prompts", "chunk"])
@pytest.mark.parametrize("query_dtype", (np.float16, "bfloat16", np.float32))
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "auto"])
@pytest.mark.parametrize("rotation,head_size", [("blockdiag", 128), ("blockdiag", 96), ("blockdiag", 64),
                                                ("kron", 80), ("none", 64), ("blockdiag", 40)])
def test_prefill_rotates_its_query_and_output(rotation, head_size, kv_dtype, query_dtype, shape):
    """prefill.cuh takes the caller's query and rotates it itself (an mma with the
    rotation's fragments, and for blocks of 32 dims and up butterflies across
    16-dim groups: 3 stages at 128, 2 at 64, 1 at 96); with one split ("prompts",
    pinned: the planner would split these short prompts' keys in two) it also
    normalises, adds the sinks, rotates back and writes `out` itself, unless the
    rotation's blocks are narrower than a fragment (d = 40: blocks of 8), which
    take the merge and the rotate kernel like several splits ("chunk") do. Sinks
    throughout."""
    query_dtype = kc.formats.MODEL_DTYPES["bfloat16"] if query_dtype == "bfloat16" else np.dtype(query_dtype)
    seq_lens, query_lens = ((200, 77), (200, 77)) if shape == "prompts" else ((4000, 600), (256, 64))
    rng = np.random.default_rng(head_size)
    batch = paged_batch(rng, list(seq_lens), list(query_lens), 16)
    cache = host_cache(rng, batch, kv_dtype, head_size, 2, 16, np.float16, rotation)
    query = (rng.standard_normal((batch.num_queries, 8, head_size)) * 2).astype(query_dtype)
    sinks = rng.standard_normal(8).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args, sinks=sinks)
    tuning = replace(DEFAULT_TUNING, max_splits=1) if shape == "prompts" else DEFAULT_TUNING
    planned = kc.plan_batch(**args, block_size=16, num_blocks=batch.num_blocks, num_query_tokens=batch.num_queries,
                            tuning=tuning)
    out = from_device(kc.paged_attention(device_query(query), device_view(cache), batch=planned,
                                         sinks=cupy.asarray(sinks)), query_dtype)
    (plan,) = planned._backend_plans.values()
    assert isinstance(plan.kernel, PrefillKernel)
    assert (plan.num_splits == 1) == (shape == "prompts"), plan.num_splits
    check(f"prefill {rotation} d={head_size} {kv_dtype} q={query_dtype} {shape}", out, expected, query_dtype)


def test_block_sizes_that_are_no_power_of_two_are_refused():
    """The kernels find a token's page by shifting: a cache of 24-token blocks gets a
    clear error from the CUDA backend (the CPU backend takes it), not wrong pages."""
    rng = np.random.default_rng(0)
    batch = paged_batch(rng, [100], [1], 24)
    cache = host_cache(rng, batch, "int4_per_token_head", 64, 2, 24, np.float16, "default")
    query = rng.standard_normal((1, 8, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="block_size=24"):
        kc.paged_attention(device_query(query), device_view(cache), block_table=batch.block_table,
                           seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)


@pytest.mark.parametrize("query_lens", [(1, 1), (150, 40)], ids=["decode", "prefill"])
def test_strided_out(query_lens):
    """An `out` that is a strided view gets every row (through a contiguous copy)."""
    rng = np.random.default_rng(11)
    batch = paged_batch(rng, [200, 40], list(query_lens), 16)
    cache = host_cache(rng, batch, "int4_per_token_head", 64, 2, 16, np.float16, "default")
    query = rng.standard_normal((batch.num_queries, 8, 64)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    expected = reference.paged_attention(query, cache, **args)
    backing = cupy.full((batch.num_queries, 8, 65), np.nan, cupy.float32)
    out = backing[..., :64]
    kc.paged_attention(cupy.asarray(query), device_view(cache), **args, out=out)
    check(f"strided out {query_lens}", cupy.asnumpy(out).astype(np.float64), expected, np.float32)
    assert np.isnan(cupy.asnumpy(backing[..., 64])).all()   # nothing written past the view
