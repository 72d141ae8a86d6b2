"""The CPU (Numba) backend against the float64 oracle, on the same quantized cache.

Cache bytes must be identical. The one allowed difference: a rotated value
computed in another summation order can land on the other side of a float32
rounding tie, moving a code by one in at most 0.1% of values (counted here).
Attention must agree within 1e-5 relative: the backend accumulates in float32
(dot products of <= 256 terms, softmax sums of <= a few hundred terms), whose
rounding error is a few 2^-24 times sqrt(terms), far below 1e-5.
"""

from dataclasses import replace

import ml_dtypes
import numba
import numpy as np
import pytest

import kvcupy as kc
from kvcupy import reference
from kvcupy import formats
from kvcupy.backends import cpu, cpu_kernels, cpu_simd
from kvcupy.rotation import kron_factors

from ..helpers import BLOCK_SIZES, HEAD_SIZES, KV_DTYPES, paged_batch, relative_error

INPUT_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
ROTATIONS = ("blockdiag", "vllm", "kron", "none")
ATTENTION_RTOL = 1e-5
MAX_TIE_FRACTION = 1e-3


def make_plan(head_size, rotation):
    if rotation == "vllm":
        return kc.rotation_plan(head_size, "blockdiag", preset="vllm")
    return kc.rotation_plan(head_size, rotation)


def fresh_cache(batch, block_size, num_kv_heads, head_size, kv_dtype, plan, dtype="float16"):
    return kc.allocate_cache(batch.num_blocks, block_size, num_kv_heads, head_size,
                             kv_dtype=kv_dtype, rotation=plan, dtype=dtype)


def oracle_copy(cache):
    """An empty cache of the same geometry, written only by the oracle."""
    zeros = lambda t: None if t is None else np.zeros_like(t)
    return replace(cache, key_cache=zeros(cache.key_cache), value_cache=zeros(cache.value_cache),
                   k_scale_cache=zeros(cache.k_scale_cache), v_scale_cache=zeros(cache.v_scale_cache))


def codes_of(cache_tensor, kv_dtype):
    if kv_dtype == "int4_per_token_head":
        return reference.unpack_int4(cache_tensor).astype(np.int64)
    if kv_dtype == "auto":
        return cache_tensor.view(np.uint16 if cache_tensor.itemsize == 2 else np.uint32).astype(np.int64)
    return cache_tensor.view(np.uint8 if kv_dtype == "fp8_per_token_head" else np.int8).astype(np.int64)


def assert_same_cache(actual, expected, case):
    for name in ("key_cache", "value_cache"):
        a = codes_of(getattr(actual, name), actual.kv_dtype)
        e = codes_of(getattr(expected, name), expected.kv_dtype)
        differ = a != e
        assert np.abs(a - e).max(initial=0) <= 1, f"{case}: {name} codes differ by more than 1"
        assert differ.mean() <= MAX_TIE_FRACTION, f"{case}: {name} {differ.sum()} codes at ties"
    for name in ("k_scale_cache", "v_scale_cache"):
        a, e = getattr(actual, name), getattr(expected, name)
        if a is None:
            continue
        ulps = np.abs(a.view(np.int32).astype(np.int64) - e.view(np.int32))
        assert (ulps > 0).mean() <= MAX_TIE_FRACTION and ulps.max() <= 16, f"{case}: {name}"


WRITE_CASES = [(kv_dtype, d, rotation) for kv_dtype in KV_DTYPES for d in HEAD_SIZES
               for rotation in ROTATIONS if rotation != "kron" or kron_factors(d)]


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kv_dtype,head_size,rotation", WRITE_CASES)
def test_cache_bytes_match_oracle(kv_dtype, head_size, rotation, block_size, input_dtype):
    plan = make_plan(head_size, rotation)
    rng = np.random.default_rng(head_size * 7 + block_size)
    batch = paged_batch(rng, [block_size + 5, 2 * block_size + 1], [1, 1], block_size)
    num_kv_heads = 2
    shape = (batch.num_tokens, num_kv_heads, head_size)
    key = (rng.standard_normal(shape) * 3).astype(INPUT_DTYPES[input_dtype])
    value = rng.standard_normal(shape).astype(INPUT_DTYPES[input_dtype])
    slots = batch.slot_mapping.copy()
    slots[::7] = -1                               # padding tokens are skipped

    cache = fresh_cache(batch, block_size, num_kv_heads, head_size, kv_dtype, plan, input_dtype)
    expected = oracle_copy(cache)
    kc.reshape_and_cache(key, value, cache, slots)
    reference.reshape_and_cache(key, value, expected, slots)
    assert_same_cache(cache, expected, f"{kv_dtype} d={head_size} B={block_size} {input_dtype} {rotation}")


FEATURES = {
    "plain": {},
    "sliding_window": {"sliding_window": 9},
    "softcap": {"softcap": 4.0},
    "sinks": {"sinks": "random"},
    "all": {"sliding_window": 20, "softcap": 30.0, "sinks": "random"},
}


def worst_row_error(out, expected):
    """Largest relative error of one (token, head) output row: stricter than the
    whole-matrix error, which a few wrong rows among many could pass."""
    return float((np.linalg.norm(out - expected, axis=-1) / np.linalg.norm(expected, axis=-1)).max())


def run_attention_case(kv_dtype, head_size, block_size, features, plan, seed=0,
                       num_heads=8, num_kv_heads=2, query_dtype=np.float32, cache_dtype="float16"):
    rng = np.random.default_rng(seed)
    # Decode, a prefill with history, and a fresh prefill, in one varlen batch.
    batch = paged_batch(rng, [3 * block_size + 3, 41, 17], [1, 6, 17], block_size)
    cache = fresh_cache(batch, block_size, num_kv_heads, head_size, kv_dtype, plan, cache_dtype)
    kv_shape = (batch.num_tokens, num_kv_heads, head_size)
    key = (rng.standard_normal(kv_shape) * 2).astype(np.float16)
    value = rng.standard_normal(kv_shape).astype(np.float16)
    kc.reshape_and_cache(key, value, cache, batch.slot_mapping)
    query = rng.standard_normal((batch.num_queries, num_heads, head_size)).astype(query_dtype)
    kwargs = dict(features)
    if kwargs.get("sinks") == "random":
        kwargs["sinks"] = rng.standard_normal(num_heads).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens,
                cu_seqlens_q=batch.cu_seqlens_q, **kwargs)
    return kc.paged_attention(query, cache, **args), reference.paged_attention(query, cache, **args)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attention_matches_oracle(kv_dtype, head_size, block_size, features):
    plan = kc.rotation_plan(head_size, "blockdiag" if kv_dtype != "auto" else "none")
    out, expected = run_attention_case(kv_dtype, head_size, block_size, FEATURES[features], plan,
                                       seed=head_size + block_size)
    assert out.dtype == np.float32 and out.shape == expected.shape
    error = relative_error(out, expected)
    assert error <= ATTENTION_RTOL, f"{kv_dtype} d={head_size} B={block_size} {features}: {error:.2e}"


@pytest.mark.parametrize("rotation", ["kron", "vllm", "none"])
@pytest.mark.parametrize("head_size", [80, 96, 128])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attention_other_rotations(kv_dtype, head_size, rotation):
    out, expected = run_attention_case(kv_dtype, head_size, 16, FEATURES["all"],
                                       make_plan(head_size, rotation), seed=3)
    assert relative_error(out, expected) <= ATTENTION_RTOL, f"{kv_dtype} d={head_size} {rotation}"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 1), (12, 3)])
def test_attention_gqa_and_mqa(num_heads, num_kv_heads):
    out, expected = run_attention_case("int4_per_token_head", 96, 16, FEATURES["plain"],
                                       kc.rotation_plan(96), num_heads=num_heads,
                                       num_kv_heads=num_kv_heads)
    assert relative_error(out, expected) <= ATTENTION_RTOL


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 1)])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_every_row_of_a_prefill_run_matches(num_heads, num_kv_heads, features):
    """A work item serves a run of query tokens (up to 32 // group of them);
    each (token, head) row must match on its own, whatever its place in a run."""
    out, expected = run_attention_case("int4_per_token_head", 96, 16, FEATURES[features],
                                       kc.rotation_plan(96), num_heads=num_heads,
                                       num_kv_heads=num_kv_heads, seed=5)
    assert worst_row_error(out, expected) <= ATTENTION_RTOL


@pytest.mark.parametrize("head_size", [40, 72, 100])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_int4_head_sizes_outside_the_register_loops(head_size, features):
    """int4 rows of d / 2 bytes, d / 2 not a multiple of 8, take the generic
    decode-to-buffer path instead of cpu_simd's loops; it must match as well."""
    assert (head_size // 2) % cpu_simd.LANES
    out, expected = run_attention_case("int4_per_token_head", head_size, 16, FEATURES[features],
                                       kc.rotation_plan(head_size), seed=head_size)
    assert worst_row_error(out, expected) <= ATTENTION_RTOL


@pytest.mark.parametrize("features", [{}, {"softcap": 30.0, "sinks": "random"}, {"sliding_window": 700}])
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "fp8_per_token_head"])
def test_sequences_longer_than_a_segment(kv_dtype, features):
    """An item walks its columns in segments of cpu_kernels.SEGMENT with an online
    softmax across them: decodes and prefill runs that cross segment boundaries,
    with and without a window that starts inside one, must match row by row."""
    rng = np.random.default_rng(31)
    segment = cpu_kernels.SEGMENT
    batch = paged_batch(rng, [2 * segment + 77, segment + 1, 3 * segment], [40, 1, 1], 16)
    cache = fresh_cache(batch, 16, 2, 64, kv_dtype, kc.rotation_plan(64))
    kv_shape = (batch.num_tokens, 2, 64)
    kc.reshape_and_cache((rng.standard_normal(kv_shape) * 2).astype(np.float16),
                         rng.standard_normal(kv_shape).astype(np.float16), cache, batch.slot_mapping)
    query = rng.standard_normal((batch.num_queries, 8, 64)).astype(np.float32)
    kwargs = dict(features)
    if "sinks" in kwargs:
        kwargs["sinks"] = rng.standard_normal(8).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q, **kwargs)
    out = kc.paged_attention(query, cache, **args)
    assert worst_row_error(out, reference.paged_attention(query, cache, **args)) <= ATTENTION_RTOL


@pytest.mark.parametrize("head_span", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head"])
def test_every_kv_head_span_gives_the_same_rows(kv_dtype, head_span, monkeypatch):
    """A work item takes a span of KV heads; spans that do and do not divide the
    head count (4) must give every row, each matching on its own."""
    monkeypatch.setattr(cpu, "heads_per_item", lambda *args: head_span)
    out, expected = run_attention_case(kv_dtype, 96, 16, FEATURES["all"], kc.rotation_plan(96),
                                       num_heads=8, num_kv_heads=4, seed=head_span)
    assert worst_row_error(out, expected) <= ATTENTION_RTOL


@pytest.mark.parametrize(("tokens_per_run", "group", "num_kv_heads", "longest", "expected"), [
    (1, 4, 8, 4096, 8),      # a decode batch of 8: whole rows a work item, 8 items for 2 threads
    (1, 4, 8, 100, 8),
    (8, 4, 8, 4096, 8),      # prefill runs of 32 query rows: 8 heads x 32 rows x 512 columns of scores
    (8, 8, 8, 4096, 4),      # runs of 64 query rows: 4 heads keep the scores within SPAN_SCORES
])
def test_heads_per_item(tokens_per_run, group, num_kv_heads, longest, expected):
    runs = np.arange(0, 8 * tokens_per_run + 1, tokens_per_run, dtype=np.int32)   # 8 runs
    assert cpu.heads_per_item(runs, num_kv_heads, group, longest, lanes=2) == expected


def test_heads_per_item_leaves_every_thread_items():
    runs = np.array([0, 1], np.int32)   # one decoding sequence
    assert cpu.heads_per_item(runs, 8, 4, 4096, lanes=2) == 2   # 4 items of 2 heads
    assert cpu.heads_per_item(runs, 1, 4, 4096, lanes=4) == 1   # never less than one head


@pytest.mark.parametrize(("cu_seqlens_q", "group", "expected"), [
    ([0, 1, 2], 4, [0, 1, 2]),                # decode: a run per sequence
    ([0, 10, 13], 4, [0, 8, 10, 13]),         # 8 tokens x 4 heads a run; runs stop at sequences
    ([0, 0, 3], 1, [0, 3]),                   # a sequence without queries has no run
    ([0, 40], 64, [0] + list(range(1, 41))),  # a group of 64: one token a run
])
def test_query_runs(cu_seqlens_q, group, expected):
    assert cpu.query_runs(np.array(cu_seqlens_q), group).tolist() == expected


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int4_per_token_head"])
def test_attention_over_each_model_dtype(kv_dtype, cache_dtype):
    """An "auto" cache stores the model dtype (decoded from its bits by the kernel); a
    quantized cache's scales are float32 whatever the model dtype."""
    plan = kc.rotation_plan(128, "none" if kv_dtype == "auto" else "blockdiag")
    out, expected = run_attention_case(kv_dtype, 128, 16, FEATURES["all"], plan, cache_dtype=cache_dtype)
    assert relative_error(out, expected) <= ATTENTION_RTOL, f"{kv_dtype} {cache_dtype}"


@pytest.mark.parametrize("query_dtype", [np.float16, ml_dtypes.bfloat16])
def test_attention_output_in_query_dtype(query_dtype):
    out, expected = run_attention_case("int8_per_token_head", 128, 16, FEATURES["plain"],
                                       kc.rotation_plan(128), query_dtype=query_dtype)
    assert out.dtype == np.dtype(query_dtype)
    # The float32 result is rounded once to the query dtype: half an ulp of it.
    eps = float(ml_dtypes.finfo(query_dtype).eps)
    assert relative_error(out, expected) <= eps / 2 + ATTENTION_RTOL


def test_softmax_scale_is_applied():
    plan = kc.rotation_plan(64)
    out, expected = run_attention_case("fp8_per_token_head", 64, 16, {"softmax_scale": 0.7}, plan)
    assert relative_error(out, expected) <= ATTENTION_RTOL


def test_out_argument_is_written_in_place():
    rng = np.random.default_rng(5)
    batch = paged_batch(rng, [20], [1], 16)
    cache = fresh_cache(batch, 16, 2, 64, "int4_per_token_head", None)
    kv = rng.standard_normal((20, 2, 64)).astype(np.float32)
    kc.reshape_and_cache(kv, kv, cache, batch.slot_mapping)
    query = rng.standard_normal((1, 4, 64)).astype(np.float32)
    out = np.zeros_like(query)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens)
    result = kc.paged_attention(query, cache, out=out, **args)
    assert result is out
    np.testing.assert_array_equal(out, kc.paged_attention(query, cache, **args))


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "fp8_per_token_head"])
def test_vllm_inline_scale_layout(kv_dtype):
    """vLLM keeps the float32 scale in padding at the end of each head row and
    hands kernels strided views; the same bytes and attention must come out."""
    head_size, block_size, num_kv_heads = 96, 16, 2
    rng = np.random.default_rng(11)
    batch = paged_batch(rng, [40, 7], [3, 7], block_size)
    plan = kc.rotation_plan(head_size, preset="vllm")
    separate = fresh_cache(batch, block_size, num_kv_heads, head_size, kv_dtype, plan)
    stored = separate.key_cache.shape[-1] * separate.key_cache.itemsize
    # [num_blocks, 2 (K, V), block_size, Hk, stored bytes + 4 bytes of scale + pad to 16]
    row_bytes = -(-(stored + 4) // 16) * 16
    buffer = np.zeros((batch.num_blocks, 2, block_size, num_kv_heads, row_bytes), np.uint8)
    storage = separate.key_cache.dtype

    def views(kv):
        data = buffer[:, kv, ..., :stored].view(storage)
        scales = buffer[:, kv, ..., stored:stored + 4].view(np.float32)[..., 0]
        return data, scales

    (key_data, k_scales), (value_data, v_scales) = views(0), views(1)
    inline = kc.wrap_cache(key_data, value_data, k_scales, v_scales, kv_dtype=kv_dtype, rotation=plan)
    key = rng.standard_normal((batch.num_tokens, num_kv_heads, head_size)).astype(ml_dtypes.bfloat16)
    value = rng.standard_normal(key.shape).astype(ml_dtypes.bfloat16)
    for cache in (separate, inline):
        kc.reshape_and_cache(key, value, cache, batch.slot_mapping)
    for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"):
        np.testing.assert_array_equal(getattr(inline, name), getattr(separate, name), err_msg=name)

    query = rng.standard_normal((batch.num_queries, 6, head_size)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q)
    # Strided and contiguous views compile to differently vectorised loops: the
    # same arithmetic summed in another order, so equal only to float32 rounding.
    out_inline = kc.paged_attention(query, inline, **args)
    assert relative_error(out_inline, kc.paged_attention(query, separate, **args)) <= 1e-6
    assert relative_error(out_inline, reference.paged_attention(query, inline, **args)) <= ATTENTION_RTOL


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "fp8_per_token_head"])
def test_long_decode_stays_within_1e5(kv_dtype):
    """4096 keys: float32 sums over thousands of terms must still meet 1e-5
    (a zero-point applied as one correction at the end cancelled to 1.3e-4)."""
    rng = np.random.default_rng(21)
    batch = paged_batch(rng, [4096, 3000], [1, 1], 16)
    cache = fresh_cache(batch, 16, 1, 128, kv_dtype, None)
    kv_shape = (batch.num_tokens, 1, 128)
    kc.reshape_and_cache(rng.standard_normal(kv_shape).astype(np.float16),
                         rng.standard_normal(kv_shape).astype(np.float16), cache, batch.slot_mapping)
    query = rng.standard_normal((2, 4, 128)).astype(np.float32)
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens)
    error = relative_error(kc.paged_attention(query, cache, **args),
                           reference.paged_attention(query, cache, **args))
    assert error <= ATTENTION_RTOL, f"{kv_dtype}: {error:.2e}"


def test_small_float_decoders_match_every_code():
    """The kernels decode fp8 and 16-bit floats in integer arithmetic; each code
    must give exactly the float32 that ml_dtypes / NumPy give (NaNs as NaNs)."""
    codes8 = np.arange(256, dtype=np.int64)
    codes16 = np.arange(65536, dtype=np.int64)
    cases = [
        (cpu_kernels.e4m3fn_to_float32, codes8, formats.fp8_decode_table()),
        (cpu_kernels.float16_to_float32, codes16,
         codes16.astype(np.uint16).view(np.float16).astype(np.float32)),
        (cpu_kernels.bfloat16_to_float32, codes16,
         codes16.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)),
    ]
    for decode, codes, expected in cases:
        decoded = decode_all(decode, codes)
        nan = np.isnan(expected)
        assert np.array_equal(np.isnan(decoded), nan), decode.__name__
        assert np.array_equal(decoded[~nan].view(np.uint32), expected[~nan].view(np.uint32)), decode.__name__


def decode_all(decode, codes):
    @numba.njit
    def run(codes):
        out = np.empty(codes.shape[0], np.float32)
        for i in range(codes.shape[0]):
            out[i] = decode(codes[i])
        return out
    return run(codes)


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "fp8_per_token_head"])
def test_all_threads_share_the_work_items(kv_dtype, monkeypatch):
    """Small calls run on one thread; this one takes the parallel path, where
    every thread claims (run, KV-head span) items from one atomic counter. An item
    no thread claimed would leave its rows as uninitialised memory."""
    monkeypatch.setattr(cpu, "PARALLEL_MIN_VALUES", 0)
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS
    out, expected = run_attention_case(kv_dtype, 80, 16, FEATURES["all"], kc.rotation_plan(80),
                                       num_heads=12, num_kv_heads=3, seed=8)
    assert worst_row_error(out, expected) <= ATTENTION_RTOL


# --- compiles, as the command line reports them ------------------------------

def test_reporting_compiles_names_the_outermost_kvcupy_kernel_only():
    """A compile of a cpu_kernels function is reported once, by its name (not the helpers
    compiled inside it); compiled kernels and other code's Numba functions report nothing."""
    seen = []
    fresh = numba.njit(cpu_kernels._max.py_func)   # a copy with no disk cache: it must compile

    def foreign(x):
        return x + 1

    cpu_kernels._max(np.ones(4, np.float32))       # compiled (or loaded from the cache) here
    with cpu.reporting_compiles(seen.append):
        cpu_kernels._max(np.ones(4, np.float32))
        numba.njit(foreign)(1)
        fresh(np.ones(4, np.float32))
        fresh(np.ones(4, np.float32))              # compiled by the call before
    assert seen == ["_max"]
    fresh(np.ones(4, np.float64))                  # outside the block: not reported
    assert seen == ["_max"]
