"""`kvcupy bench --backend cuda` (kvcupy/bench/, cli/plot.py, kvcupy/bench/kernels_cu/).

Without a GPU: the byte and FLOP accounting against numbers worked by hand,
the planning of groups and cases, the whole run and its JSON report through a
fake runner (the real one needs a GPU), the tables, the plot, the CLI's
plumbing, and that the bench's kernels compile through NVRTC. With a GPU
(`pytest -m gpu`): the streaming kernel reads exactly the bytes it should,
the hold kernel holds, and `--quick` runs end to end.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import io
import json
import re

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import app as app_module
from cli import plot
from cli.app import app
from kvcupy import backends, formats
from kvcupy import bench as bench_cuda   # the package the CLI calls: CudaRunner is patched there
from kvcupy.bench import accounting as bench_accounting
from kvcupy.bench import kernels as bench_kernels
from kvcupy.bench import run as bench_run
from kvcupy.bench import shapes as bench_shapes
from kvcupy.bench.accounting import (attention_bytes, attention_flops, cache_bytes, case_bytes, copy_bytes,
                                     query_output_bytes, rotate_bytes, stream_bytes, write_bytes)
from kvcupy.bench.shapes import DECODE_D96, DECODE_MAIN, WRITE_MAIN, Case, Group, RotateShape, Shape
from kvcupy.bench.tables import tables
from kvcupy.bench.targets import TARGETS

runner = CliRunner()

BF16 = formats.MODEL_DTYPES["bfloat16"]
FP16 = formats.MODEL_DTYPES["float16"]
KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")
H200_L2 = 50 * 2**20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plain_text(output: str) -> str:
    """Rich's error panel without its box and line wrapping, to search for phrases."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", output).split())


# --- accounting, worked by hand -------------------------------------------

# One token's K and V over 8 KV heads: per head K + V codes and two float32 scales.
# int4 d = 128: 64 + 64 + 8 bytes; int8/fp8: 128 + 128 + 8; auto (bf16): 256 + 256.
@pytest.mark.parametrize("kv_dtype, per_head", [("int4_per_token_head", 64 + 64 + 8),
                                                ("int8_per_token_head", 128 + 128 + 8),
                                                ("fp8_per_token_head", 128 + 128 + 8),
                                                ("auto", 256 + 256)])
def test_decode_cache_bytes_of_the_target_shape(kv_dtype, per_head):
    expected = 32 * 32768 * 8 * per_head
    assert cache_bytes(DECODE_MAIN, kv_dtype, BF16) == expected, kv_dtype


def test_decode_int4_reads_1_14_gb():
    assert cache_bytes(DECODE_MAIN, "int4_per_token_head", BF16) == 1_140_850_688   # ~1.14e9
    # d = 96 reads 96/128 of the codes, no padding: 48 + 48 + 8 bytes a head.
    assert cache_bytes(DECODE_D96, "int4_per_token_head", BF16) == 32 * 32768 * 8 * (48 + 48 + 8)


def test_decode_query_and_output_bytes():
    # 32 sequences x 1 token x 32 heads x 128 values x 2 bytes, read once and written once.
    assert query_output_bytes(DECODE_MAIN, BF16) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert attention_bytes(DECODE_MAIN, "int4_per_token_head", BF16) == 1_140_850_688 + 524_288


def test_dense_sdpa_decode_moves_the_bf16_cache_of_kvcupys_auto_case():
    """Dense bf16 SDPA on the decode targets' shape reads every token's K and V in
    bf16 once, plus the query and output: the bytes of kvcupy's auto (bf16) case,
    so "auto within 10% of SDPA" compares times of equal traffic, and 512 / 136
    times int4's (d = 128), so "int4 >= 2.7x SDPA" asks int4 for 2.7 x 136 / 512
    of SDPA's bandwidth."""
    decode = Group("decode", DECODE_MAIN, KV_DTYPES)
    sdpa = case_bytes(decode, Case("sdpa", sdpa_backend="default"), BF16)
    assert sdpa == 32 * 32768 * 8 * 128 * 2 * 2 + 524_288
    assert sdpa == case_bytes(decode, Case("kvcupy", "auto"), BF16)
    int4 = case_bytes(decode, Case("kvcupy", "int4_per_token_head"), BF16)
    assert (sdpa - 524_288) * 136 == (int4 - 524_288) * 512


def test_decode_flops_are_4_lq_lk_d_hq_per_sequence():
    assert attention_flops(DECODE_MAIN) == 32 * 4 * 1 * 32768 * 128 * 32 == 17_179_869_184
    # At 1.14 GB in 0.335 ms (the 3.4 TB/s target) that is ~51 TFLOP/s of int4 decode.
    assert attention_flops(DECODE_MAIN) / 0.335e-3 / 1e12 == pytest.approx(51.3, abs=0.1)


@pytest.mark.parametrize("num_seqs, seq_len", [(4, 8192), (1, 2048), (64, 128)])
def test_causal_prefill_flops_count_the_triangle(num_seqs, seq_len):
    shape = Shape("prefill", num_seqs, seq_len, 32, 8, 128)
    # Query token i sees keys 0..i: L (L + 1) / 2 (query, key) pairs a sequence.
    expected = num_seqs * 4 * 128 * 32 * seq_len * (seq_len + 1) // 2
    assert attention_flops(shape) == expected
    square = num_seqs * 4 * seq_len * seq_len * 128 * 32
    assert attention_flops(shape) / square == pytest.approx(0.5 * (seq_len + 1) / seq_len)


def test_chunked_prefill_flops_count_the_cached_keys_in_full():
    """The chunked prefill target: 2048 new tokens over 30720 cached, the
    rectangle of cached keys counted in full, the new tokens' own triangle as above."""
    shape = bench_shapes.PREFILL_CHUNKED
    assert (shape.num_seqs, shape.query_len, shape.seq_len - shape.query_len) == (4, 2048, 30720)
    rectangle = 2048 * 30720
    triangle = 2048 * 2049 // 2
    assert attention_flops(shape) == 4 * 4 * 128 * 32 * (rectangle + triangle)
    # The query and output are the new tokens'; the cache is read once, all of it.
    assert query_output_bytes(shape, BF16) == 2 * 4 * 2048 * 32 * 128 * 2
    assert cache_bytes(shape, "int4_per_token_head", BF16) == 4 * 32768 * 8 * 136


def test_chunked_prefill_is_labelled_as_such():
    assert Group("prefill", bench_shapes.PREFILL_CHUNKED, KV_DTYPES).label == (
        "prefill 4 x 2048 new over 30720 cached, causal, 32/8 heads, d = 128")
    assert Group("prefill", Shape("prefill", 4, 8192, 32, 8, 128), KV_DTYPES).label == (
        "prefill 4 x 8192 causal, 32/8 heads, d = 128")


def test_sdpa_takes_the_lower_right_diagonal_for_a_chunk():
    runner = bench_cuda.CudaRunner.__new__(bench_cuda.CudaRunner)
    assert runner._sdpa_causal(Shape("prefill", 4, 8192, 32, 8, 128)) == {"is_causal": True}
    torch = pytest.importorskip("torch")
    runner.torch = torch
    # 2 new tokens over 4 cached: query i (position 4 + i) sees keys 0 .. 4 + i,
    # as kvcupy and the oracle mask it (is_causal would give it keys 0 .. i).
    small = runner._sdpa_causal(Shape("prefill", 1, 6, 2, 1, 8, new_tokens=2))["attn_mask"]
    assert small._materialize().tolist() == [[True] * 5 + [False], [True] * 6]
    mask = runner._sdpa_causal(bench_shapes.PREFILL_CHUNKED)["attn_mask"]
    assert (mask.seq_len_q, mask.seq_len_kv) == (2048, 32768)


def test_prefill_bytes_read_the_cache_once():
    shape = Shape("prefill", 4, 8192, 32, 8, 128)
    assert cache_bytes(shape, "int4_per_token_head", BF16) == 4 * 8192 * 8 * 136
    assert query_output_bytes(shape, BF16) == 2 * 4 * 8192 * 32 * 128 * 2


@pytest.mark.parametrize("kv_dtype, written_per_head", [("int4_per_token_head", 136),
                                                        ("int8_per_token_head", 264), ("auto", 512)])
def test_write_path_bytes_read_bf16_and_write_the_packed_cache(kv_dtype, written_per_head):
    read = 2 * 32768 * 8 * 128 * 2                  # K and V, bf16
    assert write_bytes(WRITE_MAIN, kv_dtype, BF16) == read + 32768 * 8 * written_per_head
    if kv_dtype == "int4_per_token_head":
        assert write_bytes(WRITE_MAIN, kv_dtype, BF16) == 134_217_728 + 35_651_584


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_rotate_bytes_read_and_write_each_vector(head_size):
    assert rotate_bytes(RotateShape(1 << 20, head_size), BF16) == 2 * 2**20 * head_size * 2


def test_copy_moves_the_partners_bytes():
    group = Group("write", WRITE_MAIN, KV_DTYPES)
    for kv_dtype in KV_DTYPES:
        partner = case_bytes(group, Case("kvcupy", kv_dtype), BF16)
        assert case_bytes(group, Case("copy", kv_dtype), BF16) == partner, kv_dtype   # even here
    assert copy_bytes(7) == 6   # an odd count: the copy copies 3 bytes, reads and writes 6


def test_stream_bytes_are_the_cache_and_one_word_a_block():
    group = Group("decode", DECODE_MAIN, KV_DTYPES)
    case = Case("stream", "int4_per_token_head", splits=64)
    assert case_bytes(group, case, BF16) == stream_bytes(DECODE_MAIN, "int4_per_token_head", BF16, 64) \
        == 1_140_850_688 + 4 * 32 * 64


def test_only_attention_cases_have_flops():
    decode = Group("decode", DECODE_MAIN, KV_DTYPES)
    assert bench_accounting.case_flops(decode, Case("kvcupy", "auto")) == attention_flops(DECODE_MAIN)
    assert bench_accounting.case_flops(decode, Case("sdpa", sdpa_backend="default")) == attention_flops(DECODE_MAIN)
    for case in (Case("copy", "auto"), Case("stream", "auto", splits=64)):
        assert bench_accounting.case_flops(decode, case) is None, case


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_kv_heads, head_size", [(8, 128), (8, 96), (2, 64), (1, 34), (4, 256)])
@pytest.mark.parametrize("model_dtype", [BF16, FP16])
def test_stream_defines_cover_a_tokens_bytes(kv_dtype, num_kv_heads, head_size, model_dtype):
    """K row + V row + their scales, as the kernel reads them, is what formats counts a token."""
    defines = bench_kernels.stream_defines(num_kv_heads, head_size, kv_dtype, model_dtype)
    per_token = formats.kv_dtype_info(kv_dtype).bytes_per_token(num_kv_heads, head_size, model_dtype)
    assert 2 * (defines["KVC_ROW_BYTES"] + defines["KVC_SCALE_ROW_BYTES"]) == per_token, defines
    assert defines["KVC_THREADS"] == bench_kernels.STREAM_THREADS
    assert defines["KVC_BLOCK_SIZE"] == bench_shapes.BLOCK_SIZE


def test_stream_defines_of_int4_at_d128():
    assert bench_kernels.stream_defines(8, 128, "int4_per_token_head", BF16) == {
        "KVC_THREADS": 256, "KVC_BLOCK_SIZE": 16, "KVC_ROW_BYTES": 8 * 64, "KVC_SCALE_ROW_BYTES": 8 * 4}


def test_input_sets_rotate_only_what_l2_could_hold():
    assert bench_accounting.input_sets(1_140_850_688, H200_L2) == 1
    assert bench_accounting.input_sets(4 * H200_L2, H200_L2) == 1
    # 32 x 1024 int4 decode: 35.6 MB; six of them are 4 x 50 MiB.
    short = cache_bytes(Shape("decode", 32, 1024, 32, 8, 128), "int4_per_token_head", BF16)
    assert bench_accounting.input_sets(short, H200_L2) == 6
    assert bench_accounting.input_sets(1000, H200_L2) == bench_accounting.MAX_INPUT_SETS


def test_stream_splits_stop_at_one_page_a_split():
    assert bench_shapes.stream_splits(DECODE_MAIN) == (32, 64, 128, 256, 512)
    assert bench_shapes.stream_splits(Shape("decode", 32, 1024, 32, 8, 128)) == (32, 64)   # 64 pages
    assert bench_shapes.stream_splits(Shape("decode", 2, 100, 8, 2, 128)) == (7,)          # 7 pages


@pytest.mark.parametrize("repeats, estimate_ms, expected", [
    (30, 0.3, 30), (30, 1000.0, 5), (30, 300.0, 10), (3, 1e4, 3), (30, 0.0, 30)])
def test_case_repeats_fit_the_budget(repeats, estimate_ms, expected):
    assert bench_run.case_repeats(repeats, estimate_ms) == expected


# --- planning ---------------------------------------------------------------

def full_config(**counts) -> bench_run.BenchConfig:
    return bench_run.make_config("all", None, KV_DTYPES, False, **counts)


def test_full_run_has_every_fixed_shape_and_sweeps_without_duplicates():
    groups = full_config().groups
    decode = [g.shape for g in groups if g.kind == "decode" and not g.sweep]
    assert decode == [DECODE_MAIN, DECODE_D96, Shape("decode", 32, 8192, 32, 8, 128),
                      Shape("decode", 8, 32768, 32, 8, 128)]
    sweep = [g for g in groups if g.sweep and g.kind == "decode"]
    # 8k and 32k are decode groups already, with every KV dtype.
    assert [g.shape.seq_len for g in sweep] == [1024, 2048, 4096, 16384, 65536, 131072]
    assert all(g.kv_dtypes == ("int4_per_token_head",) for g in sweep)
    assert [g.shape for g in groups if g.kind == "prefill" and not g.sweep] == [
        Shape("prefill", 4, 8192, 32, 8, 128), Shape("prefill", 4, 8192, 32, 8, 96),
        Shape("prefill", 1, 2048, 32, 8, 128), Shape("prefill", 64, 128, 32, 8, 128),
        Shape("prefill", 4, 32768, 32, 8, 128, new_tokens=2048)]
    # The prefill sweep: 16384 tokens a batch, 512 .. 16384 a prompt, int4 beside SDPA.
    prefill_sweep = [g for g in groups if g.sweep and g.kind == "prefill"]
    assert [(g.shape.num_seqs, g.shape.seq_len) for g in prefill_sweep] == [
        (32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
    assert all(g.kv_dtypes == ("int4_per_token_head",) and g.shape.num_heads == 32 and g.shape.head_size == 128
               for g in prefill_sweep)
    assert [g.shape for g in groups if g.kind == "write"] == [WRITE_MAIN]
    assert [g.shape.head_size for g in groups if g.kind == "rotate"] == [64, 96, 128, 256]


def test_a_decode_group_times_every_peer():
    cases = bench_shapes.group_cases(Group("decode", DECODE_MAIN, KV_DTYPES))
    by_impl = {impl: [c for c in cases if c.impl == impl] for impl in ("kvcupy", "sdpa", "copy", "stream")}
    assert [c.kv_dtype for c in by_impl["kvcupy"]] == list(KV_DTYPES)
    assert [c.sdpa_backend for c in by_impl["sdpa"]] == ["default"]
    assert [c.kv_dtype for c in by_impl["copy"]] == list(KV_DTYPES)
    assert len(by_impl["stream"]) == 4 * 5
    assert {c.splits for c in by_impl["stream"]} == {32, 64, 128, 256, 512}
    assert len(cases) == sum(map(len, by_impl.values()))


def test_prefill_times_each_sdpa_backend():
    cases = bench_shapes.group_cases(Group("prefill", Shape("prefill", 1, 2048, 32, 8, 128), KV_DTYPES))
    assert [c.sdpa_backend for c in cases if c.impl == "sdpa"] == ["default", "flash", "cudnn"]


def test_prefill_times_int4_again_over_device_metadata():
    shape = Shape("prefill", 64, 128, 32, 8, 128)
    cases = bench_shapes.group_cases(Group("prefill", shape, KV_DTYPES))
    (device,) = [c for c in cases if c.device_metadata]
    assert (device.impl, device.kv_dtype, device.name) == ("kvcupy", "int4_per_token_head",
                                                           "kvcupy int4, device metadata")
    assert not any(c.device_metadata for c in bench_shapes.group_cases(Group("prefill", shape, KV_DTYPES,
                                                                             sweep=True)))


def test_the_device_metadata_case_is_graded_against_its_host_twin(fake_report):
    group = group_of(fake_report, "prefill", Shape("prefill", 64, 128, 32, 8, 128))
    device = record_of(group, "kvcupy int4, device metadata")
    assert device["device_metadata"] is True and device["speed_vs_host_metadata"] == pytest.approx(1.0)
    assert "device_metadata" not in record_of(group, "kvcupy int4")
    targets = {t["target"]: t for t in fake_report["targets"]}
    graded = targets["prefill int4, 64 x 128 causal, device metadata and host bounds: time within 10% of host "
                     "metadata"]
    assert graded["measured"] == pytest.approx(1.0) and graded["met"] is True


@pytest.mark.parametrize("phase, groups, kinds", [
    ("all", None, {"decode", "prefill", "write", "rotate"}),
    ("decode", None, {"decode"}),
    ("prefill", None, {"prefill"}),
    ("all", "write, rotate", {"write", "rotate"}),
    ("prefill", "sweep", {"decode"}),
    ("all", "prefill_sweep", {"prefill"}),
])
def test_phase_and_groups_choose_the_groups(phase, groups, kinds):
    config = bench_run.make_config(phase, groups, KV_DTYPES, True)
    assert {g.kind for g in config.groups} == kinds, (phase, groups)


def test_unknown_group_names_the_choices():
    with pytest.raises(ValueError, match="'decode,bogus' is not a comma-separated list of decode, sweep, "
                                         "prefill, prefill_sweep, write, rotate"):
        bench_run.parse_groups("decode,bogus")


def test_counts_not_given_take_the_cuda_defaults():
    assert full_config().repeats == bench_run.DEFAULT_REPEATS
    config = full_config(repeats=7, prefill_repeats=2, rounds=1, warmup=0)
    assert config.repeats == {"decode": 7, "prefill": 2, "write": 7, "rotate": 7}
    assert (config.rounds, config.warmup) == (1, 0)


def test_sweep_times_int4_or_the_one_dtype_asked_for():
    assert bench_shapes.sweep_kv_dtypes(KV_DTYPES) == ("int4_per_token_head",)
    assert bench_shapes.sweep_kv_dtypes(("fp8_per_token_head",)) == ("fp8_per_token_head",)


# --- a whole run on a fake device --------------------------------------------

# TB/s each implementation reaches on the fake device; a stream with fewer splits is slower.
FAKE_RATES = {"kvcupy": 3.5, "sdpa": 4.6, "copy": 4.0, "stream": 4.3}


class FakeRunner:
    """Times nothing: each call "takes" its case's bytes at FAKE_RATES. SDPA cuDNN is
    missing, and kvcupy fp8 prefill raises, as a broken kernel would."""

    model_dtype = BF16
    l2_bytes = H200_L2

    def __init__(self):
        self.groups_ended = 0
        self.built: list[tuple[Group, Case, int]] = []

    def describe(self) -> dict:
        return {"device": {"name": "Fake H200", "arch": "sm_90", "sms": 132, "l2_bytes": self.l2_bytes,
                           "memory_bytes": 141 * 2**30},
                "versions": {"kvcupy": "0", "torch": None}, "torch_unavailable": None}

    @staticmethod
    def fake_ms(group: Group, case: Case) -> float:
        ms = case_bytes(group, case, BF16) / (FAKE_RATES[case.impl] * 1e12) * 1e3
        return ms * (1 + 6.4 / case.splits) if case.impl == "stream" else ms

    def build(self, group, case, sets):
        if case.impl == "sdpa" and case.sdpa_backend == "cudnn":
            raise bench_run.PeerSkipped("torch 0 cannot select the cudnn SDPA backend")
        if group.kind == "prefill" and case.kv_dtype == "fp8_per_token_head":
            raise RuntimeError("an illegal memory access was encountered\nsecond line")
        self.built.append((group, case, sets))
        ms = self.fake_ms(group, case)
        return [lambda: ms] * sets, {"gqa": "fake"} if case.impl == "sdpa" else {}

    def warm_up(self, calls, warmup):
        return calls[0](), 0.05

    def time(self, calls, count, host_ms):
        return bench_run.Timing([calls[0]()] * count, idle_ms=0.0)

    def end_group(self):
        self.groups_ended += 1


@pytest.fixture(scope="module")
def fake_report() -> dict:
    config = full_config(repeats=4, prefill_repeats=2, rounds=2)
    steps = []
    report = bench_run.run_bench(config, FakeRunner(), steps.append, lambda text: None)
    assert len(steps) == bench_run.total_steps(config)
    return report


def group_of(report: dict, kind: str, shape) -> dict:
    from dataclasses import asdict
    wanted = {**asdict(shape), "block_size": 16}
    [group] = [g for g in report["groups"] if g["kind"] == kind and g["shape"] == wanted]
    return group


def record_of(group: dict, name: str) -> dict:
    [record] = [r for r in group["cases"] if r["name"] == name]
    return record


def test_report_is_strict_json_with_every_group(fake_report):
    text = json.dumps(fake_report, allow_nan=False)
    assert json.loads(text) == fake_report
    assert set(fake_report) == {"backend", "device", "versions", "torch_unavailable", "model_dtype",
                                "block_size", "timing", "sweep", "prefill_sweep", "groups", "targets"}
    assert fake_report["backend"] == "cuda" and fake_report["model_dtype"] == "bfloat16"
    assert len(fake_report["groups"]) == len(full_config().groups)
    assert fake_report["timing"]["repeats"] == {"decode": 4, "prefill": 2, "write": 4, "rotate": 4}
    assert fake_report["sweep"] == {"num_seqs": 32, "num_heads": 32, "num_kv_heads": 8, "head_size": 128,
                                    "seq_lens": [1024 << k for k in range(8)],
                                    "kv_dtypes": ["int4_per_token_head"]}


def test_timed_case_records_rates_and_ratios(fake_report):
    group = group_of(fake_report, "decode", DECODE_MAIN)
    int4 = record_of(group, "kvcupy int4")
    assert int4["status"] == "ok" and int4["repeats"] == 4 and int4["input_sets"] == 1
    assert int4["bytes"] == 1_140_850_688 + 524_288 and int4["flops"] == 17_179_869_184
    assert int4["tb_per_s"] == pytest.approx(3.5)
    assert int4["tflop_per_s"] == pytest.approx(17_179_869_184 / int4["median_ms"] / 1e9)
    sdpa = record_of(group, "torch sdpa")
    assert int4["speedup_vs_sdpa"] == pytest.approx(sdpa["median_ms"] / int4["median_ms"])
    assert int4["sdpa_peer"] == "torch sdpa" and sdpa["gqa"] == "fake"
    assert int4["bandwidth_vs_copy"] == pytest.approx(3.5 / 4.0)
    # The ceiling is the fastest split count: 512 splits here.
    assert int4["stream_splits"] == 512
    assert int4["bandwidth_vs_stream"] == pytest.approx(3.5 / (4.3 / (1 + 6.4 / 512)), rel=1e-3)
    assert int4["gpu_idle_fraction"] == 0.0 and int4["host_ms"] == 0.05


def test_small_cases_rotate_input_sets(fake_report):
    group = group_of(fake_report, "decode", Shape("decode", 32, 1024, 32, 8, 128))
    assert record_of(group, "kvcupy int4")["input_sets"] == 6


def test_skipped_and_failed_peers_are_reported_not_raised(fake_report):
    group = group_of(fake_report, "prefill", Shape("prefill", 4, 8192, 32, 8, 128))
    cudnn = record_of(group, "torch sdpa cudnn")
    assert cudnn["status"] == "skipped" and "cudnn" in cudnn["reason"]
    fp8 = record_of(group, "kvcupy fp8")
    assert fp8["status"] == "failed"
    assert fp8["reason"] == "RuntimeError: an illegal memory access was encountered"
    assert fp8["flops"] == attention_flops(Shape("prefill", 4, 8192, 32, 8, 128)) and "median_ms" not in fp8
    # The prefill ratio is against the fastest SDPA backend that ran.
    int4 = record_of(group, "kvcupy int4")
    assert int4["sdpa_peer"] in ("torch sdpa", "torch sdpa flash")
    assert int4["bandwidth_vs_copy"] is None and int4["bandwidth_vs_stream"] is None


def test_targets_are_judged_from_the_same_records(fake_report):
    targets = {t["target"]: t for t in fake_report["targets"]}
    assert len(targets) == len(TARGETS)
    tb = targets["decode int4, 32 x 32768, d = 128: >= 3.4 TB/s"]
    assert tb["measured"] == pytest.approx(3.5) and tb["met"] is True
    speedup = targets["decode int4, 32 x 32768, d = 128: >= 2.7x dense bf16 SDPA"]
    assert speedup["met"] is True
    auto = targets["decode auto (bf16), 32 x 32768, d = 128: time within 10% of SDPA"]
    assert auto["met"] is False   # 3.5 TB/s on the same bytes as SDPA's 4.6
    prefill = targets["prefill int4, 4 x 8192 causal, d = 128: >= 300 TFLOP/s"]
    int4 = record_of(group_of(fake_report, "prefill", Shape("prefill", 4, 8192, 32, 8, 128)), "kvcupy int4")
    assert prefill["measured"] == pytest.approx(int4["tflop_per_s"]) and prefill["metric"] == "tflop_per_s"


def test_runner_frees_every_group_and_builds_each_case_once():
    fake = FakeRunner()
    config = bench_run.make_config("all", None, KV_DTYPES, True, repeats=2, prefill_repeats=1, rounds=2)
    bench_run.run_bench(config, fake, lambda text: None, lambda text: None)
    assert fake.groups_ended == len(config.groups)
    built = [(g.label, c) for g, c, _ in fake.built]
    assert len(built) == len(set(built))


def rendered(report: dict) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(tables(report))
    return console.file.getvalue()


def test_tables_show_the_report(fake_report):
    text = rendered(fake_report)
    assert "decode 32 x 32768, 32/8 heads, d = 128" in text
    captions = " ".join(text.split())   # captions wrap at the table's width
    assert "torch sdpa cudnn: skipped (torch 0 cannot select the cudnn SDPA backend)" in captions
    assert "kvcupy fp8: failed (RuntimeError: an illegal memory access was encountered)" in captions
    assert "targets" in text


def test_tables_show_each_calls_host_time(fake_report):
    """The host's time to issue a call (host_ms) sits beside the GPU time it is left out of."""
    text = rendered({**fake_report, "groups": [group_of(fake_report, "decode", DECODE_MAIN)]})
    assert "host ms" in text
    int4_row = next(line for line in text.splitlines() if line.strip().startswith("kvcupy int4"))
    assert int4_row.split()[-1] == "0.050"


def test_tables_show_the_streaming_ceiling_alone(fake_report):
    text = rendered({**fake_report, "groups": [group_of(fake_report, "decode", DECODE_MAIN)]})
    assert "stream int4, 512 splits" in text and "stream int4, 64 splits" not in text


# --- plot -----------------------------------------------------------------------

def test_bandwidth_series_follow_the_sweep(fake_report):
    series = plot.bandwidth_series(fake_report)
    assert set(series) == {"kvcupy int4", "torch sdpa, dense bfloat16",
                           "stream int4 pages (no math, best split count)", "copy, same bytes as int4"}
    for label, points in series.items():
        assert [n for n, _ in points] == [1024 << k for k in range(8)], label
    assert all(rate == pytest.approx(4.0) for _, rate in series["copy, same bytes as int4"])


def test_prefill_series_follow_the_prefill_sweep(fake_report):
    assert fake_report["prefill_sweep"] == {
        "tokens": 16384, "num_heads": 32, "num_kv_heads": 8, "head_size": 128,
        "seq_lens": [512 << k for k in range(6)], "num_seqs": [32, 16, 8, 4, 2, 1],
        "kv_dtypes": ["int4_per_token_head"]}
    series = plot.prefill_series(fake_report)
    # cuDNN is skipped on the fake device: no line for it.
    assert set(series) == {"kvcupy int4", "torch sdpa, dense bfloat16", "torch sdpa flash, dense bfloat16"}
    for label, points in series.items():
        assert [n for n, _ in points] == [512 << k for k in range(6)], label
    group = group_of(fake_report, "prefill", Shape("prefill", 4, 4096, 32, 8, 128))
    assert series["kvcupy int4"][3][1] == record_of(group, "kvcupy int4")["tflop_per_s"]


def test_the_main_prefill_shapes_stay_out_of_the_prefill_sweep(fake_report):
    """4 x 8192 is no point of the sweep (2 x 8192 is: 16384 tokens a batch)."""
    lengths = [(g["shape"]["num_seqs"], g["shape"]["seq_len"]) for g in plot._prefill_sweep_groups(fake_report)]
    assert (4, 8192) not in lengths and (2, 8192) in lengths


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_a_png(fake_report, tmp_path):
    path = plot.plot_report(fake_report, tmp_path / "sweeps.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_plot_draws_the_one_sweep_a_report_has(fake_report, tmp_path, kind):
    report = {**fake_report, "groups": [g for g in fake_report["groups"] if g["kind"] == kind]}
    assert bool(plot.bandwidth_series(report)) == (kind == "decode")
    assert bool(plot.prefill_series(report)) == (kind == "prefill")
    assert plot.plot_report(report, tmp_path / f"{kind}.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_of_no_sweep_says_so(fake_report, tmp_path):
    report = {**fake_report, "groups": [g for g in fake_report["groups"] if g["kind"] == "write"]}
    with pytest.raises(ValueError, match="the report holds neither sweep"):
        plot.plot_report(report, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ImportError, match=r"--plot needs matplotlib, which is not installed: pip install "
                                          r"'kvcupy\[plot\]'"):
        plot.require_matplotlib()


# --- the command line -------------------------------------------------------------

def test_bench_refuses_cuda_where_it_cannot_run():
    if backends.status("cuda").usable:
        pytest.skip("the CUDA backend is usable on this machine")
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick"])
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert "Invalid value for '--backend': backend 'cuda' is not usable here:" in message, message
    assert result.stdout == ""


@pytest.mark.parametrize("args, options", [
    (["--plot", "out.png"], "'--plot'"),
    (["--groups", "write"], "'--groups'"),
    (["--groups", "write", "--plot", "x.png"], "'--groups' / '--plot'"),
    (["--time-limit", "60"], "'--time-limit'"),
])
def test_cuda_only_options_are_refused_on_the_cpu(args, options):
    result = runner.invoke(app, ["bench", "--backend", "cpu", *args])
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert f"Invalid value for {options}: only with --backend cuda (this run uses cpu)" in message, message


def runs_on_fake_cuda(monkeypatch, runner_class) -> list:
    """`bench` believes CUDA is usable and runs on `runner_class`; returns the runners made."""
    made = []

    def make_runner():
        made.append(runner_class())
        return made[-1]

    monkeypatch.setattr(app_module, "_device", lambda backend: "cuda")
    monkeypatch.setattr(bench_cuda, "CudaRunner", make_runner)
    return made


@pytest.fixture
def fake_cuda(monkeypatch):
    return runs_on_fake_cuda(monkeypatch, FakeRunner)


def test_cli_dispatches_cuda_to_bench_cuda(fake_cuda):
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "write,rotate",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [g["kind"] for g in report["groups"]] == ["write", "rotate", "rotate"]
    assert report["timing"]["repeats"] == bench_run.DEFAULT_REPEATS   # the CPU's defaults are not passed on
    assert len(fake_cuda) == 1


def test_cli_passes_counts_the_user_gave(fake_cuda):
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--phase", "decode",
                                 "--repeats", "3", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {g["kind"] for g in report["groups"]} == {"decode"}
    assert report["timing"]["repeats"]["decode"] == 3 and report["timing"]["rounds"] == 1
    assert report["timing"]["repeats"]["prefill"] == bench_run.DEFAULT_REPEATS["prefill"]


def test_a_time_limit_leaves_later_groups_out_and_names_them():
    """No group starts once the limit has passed; those left are listed, and the
    groups timed before it are reported as usual."""
    config = bench_run.make_config("all", "write,rotate", KV_DTYPES, True, rounds=1, time_limit_s=10)
    ticks = iter([0.0, 0.0, 9.0, 10.0])   # the start, then before each of the three groups
    said = []
    report = bench_run.run_bench(config, FakeRunner(), lambda text: None, said.append, clock=lambda: next(ticks))
    labels = [group.label for group in config.groups]
    assert [group["label"] for group in report["groups"]] == labels[:2]
    assert report["not_run"] == {"reason": "the time limit of 10 s was reached", "groups": labels[2:]}
    assert said[-1] == "time limit of 10 s reached: 1 groups not run"
    assert "not_run" not in bench_run.run_bench(dataclasses.replace(config, time_limit_s=None), FakeRunner(),
                                                lambda text: None, lambda text: None)


def test_cli_time_limit_reaches_the_run_and_the_tables(fake_cuda, monkeypatch):
    clock = iter([0.0, 0.0, 5.0, 5.0]).__next__   # the start, then before the write and the two rotates
    monkeypatch.setattr(bench_cuda, "run_bench", functools.partial(bench_run.run_bench, clock=clock))
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "write,rotate",
                                 "--time-limit", "5"])
    assert result.exit_code == 0, result.output
    assert ("Not run (the time limit of 5 s was reached): rotate 16384 vectors, d = 64; rotate 16384 vectors, "
            "d = 96") in plain_text(result.stdout)


def test_cli_tables_without_json(fake_cuda):
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "rotate"])
    assert result.exit_code == 0, result.output
    assert "rotate 16384 vectors, d = 64" in result.stdout and "kvcupy rotate" in result.stdout


def test_cli_bad_groups_is_a_usage_error(fake_cuda):
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--groups", "decode,warmup"])
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert "Invalid value for '--groups': 'decode,warmup' is not a comma-separated list" in message, message
    assert fake_cuda == []   # refused before anything ran


def test_cli_plot_without_matplotlib_is_refused_before_the_run(fake_cuda, monkeypatch):
    def missing():
        raise ImportError("--plot needs matplotlib, which is not installed: " + plot.INSTALL_HINT)
    monkeypatch.setattr(plot, "require_matplotlib", missing)
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--plot", "out.png"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--plot': --plot needs matplotlib" in plain_text(result.stderr)
    assert fake_cuda == []


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
@pytest.mark.parametrize("phase, counts, sweep", [
    ("decode", ["--repeats", "2"], [(4, 512), (4, 8192)]),               # 4 x 2048 is a decode group
    ("prefill", ["--prefill-repeats", "2"], [(4, 128), (2, 256)]),       # 512 tokens a batch
])
def test_cli_json_and_plot(fake_cuda, tmp_path, phase, counts, sweep):
    path = tmp_path / f"{phase}.png"
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--phase", phase, *counts,
                                 "--rounds", "1", "--json", "--plot", str(path)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)          # stdout holds the report alone
    assert [(g["shape"]["num_seqs"], g["shape"]["seq_len"]) for g in report["groups"] if g["sweep"]] == sweep
    assert f"plot: {path}" in plain_text(result.stderr)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_cli_plot_of_groups_without_a_sweep_is_refused_before_the_run(fake_cuda):
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "write",
                                 "--plot", "out.png"])
    assert result.exit_code == 2, result.output
    assert ("Invalid value for '--plot': it draws the decode and prefill sweeps and the step group, and "
            "these groups time none of them") in plain_text(result.stderr)
    assert fake_cuda == []


# --- the bench's kernels compile (NVRTC, no GPU) -----------------------------------

def _nvrtc_missing() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as error:   # CuPy is there but libnvrtc is not
        return f"NVRTC is not loadable: {error}"
    return None


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bench_kernels_compile_without_spills(arch, tmp_path, monkeypatch):
    from kvcupy import jit
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path))
    specs = bench_kernels.kernel_specialisations(all=arch == "sm_90")
    entries = {entry for entry, _, _ in specs}
    assert entries == {"stream_pages", "hold_stream"}
    for entry, functions, defines in specs:
        result = bench_kernels.compile_entry(entry, defines, arch)
        for function in functions:
            assert result.spills.get(function, 0) == 0, (entry, defines, result.spills)


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
def test_stream_pages_compiles_for_odd_rows(tmp_path, monkeypatch):
    """Rows that 16-byte loads do not tile (int4 at d = 34: 17 bytes a head) take narrower words."""
    from kvcupy import jit
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path))
    defines = bench_kernels.stream_defines(1, 34, "int4_per_token_head", BF16)
    assert defines["KVC_ROW_BYTES"] == 17
    bench_kernels.compile_entry("stream_pages", {**defines, "KVC_BLOCK_SIZE": 8}, "sm_90")


# --- on a GPU -----------------------------------------------------------------------

def _gpu_missing() -> str | None:
    missing = _nvrtc_missing()
    if missing:
        return missing
    import cupy
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:   # no driver
        return f"no CUDA device: {error}"
    return None if count else "no CUDA device"


def stream_reference(key, value, k_scale, v_scale, block_table, seq_lens, num_splits,
                     block_size) -> np.ndarray:
    """What stream_pages writes: per (sequence, split), the XOR of every 4-byte word of the
    rows it reads (rows here are whole 4-byte words, so its wider loads fold the same)."""
    num_blocks = key.shape[0]
    out = np.zeros((len(seq_lens), num_splits), np.uint32)
    for seq, length in enumerate(seq_lens):
        length = max(0, min(int(length), block_table.shape[1] * block_size))
        pages = -(-length // block_size)
        per_split = -(-pages // num_splits)
        for split in range(num_splits):
            word = np.uint32(0)
            for page in range(split * per_split, min(pages, (split + 1) * per_split)):
                block = int(block_table[seq, page])
                if not 0 <= block < num_blocks:
                    continue   # the kernel guards ids: nothing outside the cache is read
                rows = min(block_size, length - page * block_size)
                for tensor in (key, value, k_scale, v_scale):
                    words = np.ascontiguousarray(tensor[block, :rows]).view(np.uint32).ravel()
                    word ^= np.bitwise_xor.reduce(words, initial=np.uint32(0))
            out[seq, split] = word
    return out


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_missing() is not None, reason=str(_gpu_missing()))
@pytest.mark.parametrize("num_kv_heads, stored_head_size, num_splits", [(8, 64, 4), (2, 48, 3), (1, 16, 1)])
def test_stream_pages_reads_exactly_the_pages_of_each_sequence(num_kv_heads, stored_head_size, num_splits):
    import cupy
    block_size, num_blocks = 16, 40
    rng = np.random.default_rng(7)
    key, value = (rng.integers(0, 256, (num_blocks, block_size, num_kv_heads, stored_head_size), np.uint8)
                  for _ in range(2))
    scale_shape = (num_blocks, block_size, num_kv_heads)
    k_scale, v_scale = (rng.integers(0, 2**32, scale_shape, np.uint32).view(np.float32) for _ in range(2))
    # Lengths with partial last pages, an empty sequence, one past its table (clipped);
    # ids out of range and padding (-1) that must be skipped.
    seq_lens = np.array([37, 0, 16, 200, 5], np.int32)
    block_table = rng.permutation(num_blocks)[:5 * 8].reshape(5, 8).astype(np.int32)
    block_table[0, 1] = num_blocks + 3
    block_table[3, 6] = -1
    defines = {"KVC_THREADS": 256, "KVC_BLOCK_SIZE": block_size,
               "KVC_ROW_BYTES": num_kv_heads * stored_head_size, "KVC_SCALE_ROW_BYTES": 4 * num_kv_heads}
    kernel = bench_kernels.get_function("stream_pages", "stream_pages", defines)
    out = cupy.zeros((len(seq_lens), num_splits), cupy.uint32)
    kernel((num_splits, len(seq_lens)), (256,), (
        cupy.asarray(key), cupy.asarray(value), cupy.asarray(k_scale), cupy.asarray(v_scale),
        cupy.asarray(block_table), cupy.asarray(seq_lens), out, np.int32(block_table.shape[1]),
        np.int32(num_blocks)))
    expected = stream_reference(key, value, k_scale, v_scale, block_table, seq_lens, num_splits, block_size)
    np.testing.assert_array_equal(out.get(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_missing() is not None, reason=str(_gpu_missing()))
def test_hold_stream_holds_the_stream():
    import cupy
    hold = bench_kernels.get_function("hold_stream", "hold_stream", {})
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    hold((1,), (1,), (np.uint64(2_000_000),))
    end.record()
    end.synchronize()
    assert cupy.cuda.get_elapsed_time(start, end) >= 1.9


@pytest.mark.gpu
@pytest.mark.skipif(not backends.status("cuda").usable, reason="the CUDA backend is not usable here")
def test_quick_cuda_bench_runs_end_to_end(tmp_path):
    result = runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--repeats", "3",
                                 "--prefill-repeats", "2", "--rounds", "1", "--warmup", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    records = [r for g in report["groups"] for r in g["cases"]]
    failed = [(r["name"], r["reason"]) for r in records if r["status"] == "failed"]
    assert not failed, failed
    for record in records:
        if record["status"] == "ok":
            assert record["median_ms"] > 0 and record["tb_per_s"] > 0, record
            if record["impl"] in ("copy", "stream"):
                assert record["gpu_idle_fraction"] < 0.5, record   # the hold kept the queue ahead
    assert all(r["status"] == "ok" for r in records if r["impl"] in ("kvcupy", "copy", "stream"))
