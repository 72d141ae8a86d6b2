"""The bench's step group (`kvcupy bench --backend cuda --groups step`) without a GPU:
its cases, the bytes a step moves worked by hand, the memory-fit rule, a whole run
with its records, ratios and targets on a fake device, the tables, the plot's
series and the command line. The GPU side (kvcupy/bench/step.py) runs only on a GPU;
here its metadata and the dense peer's GQA folding (torch on the CPU) are checked."""

from __future__ import annotations

import importlib.util
import io
import json
from dataclasses import asdict

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import plot
from cli.app import app
from kvcupy import bench as bench_cuda
from kvcupy import formats
from kvcupy.bench import accounting
from kvcupy.bench import run as bench_run
from kvcupy.bench import shapes
from kvcupy.bench import step as bench_step
from kvcupy.bench.shapes import BLOCK_SIZE, LLAMA_3_8B, PHI_3_MINI, Case, Group, StepShape
from kvcupy.bench.tables import tables

from .test_bench_cuda import runs_on_fake_cuda
from kvcupy.bench.targets import STEP_TARGETS, TARGETS, evaluate_targets

BF16 = formats.MODEL_DTYPES["bfloat16"]
KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")
QUANTIZED = KV_DTYPES[:3]
GIB = 2**30
H100_MEMORY, H200_MEMORY = 80 * GIB, 141 * GIB
H200_L2 = 50 * 2**20
LLAMA_32_32K = StepShape.of(LLAMA_3_8B, 32, 32768)
LLAMA_32_8K = StepShape.of(LLAMA_3_8B, 32, 8192)
NO_FLASHINFER = "flashinfer cannot be imported: ModuleNotFoundError: No module named 'flashinfer'"

cli_runner = CliRunner()


def step_config(quick: bool, kv_dtypes=KV_DTYPES, **counts) -> bench_run.BenchConfig:
    return bench_run.make_config("all", "step", kv_dtypes, quick, **counts)


# --- the cases ------------------------------------------------------------------

def test_models_have_their_attention_geometry():
    assert (LLAMA_3_8B.num_layers, LLAMA_3_8B.num_heads, LLAMA_3_8B.num_kv_heads, LLAMA_3_8B.head_size) == \
        (32, 32, 8, 128)
    assert (PHI_3_MINI.num_layers, PHI_3_MINI.num_heads, PHI_3_MINI.num_kv_heads, PHI_3_MINI.head_size) == \
        (32, 32, 32, 96)


def test_full_step_run_is_every_model_batch_and_context():
    groups = step_config(False).groups
    assert all(g.kind == "step" and not g.sweep for g in groups)
    found = [(g.shape.model, g.shape.num_seqs, g.shape.seq_len) for g in groups]
    assert found == [(model, batch, context) for model in ("Llama-3-8B", "Phi-3-mini")
                     for batch in (1, 8, 32, 64) for context in (1024, 8192, 32768)]
    assert all(g.shape.num_layers == 32 for g in groups)
    # The step times the quantized KV dtypes; bf16 is torch's dense cache.
    assert all(g.kv_dtypes == QUANTIZED for g in groups)


def test_quick_step_run_is_both_models_small():
    groups = step_config(True).groups
    assert [(g.shape.model, g.shape.num_seqs, g.shape.seq_len) for g in groups] == [
        ("Llama-3-8B", 1, 1024), ("Llama-3-8B", 8, 1024), ("Phi-3-mini", 1, 1024), ("Phi-3-mini", 8, 1024)]
    assert {g.shape for g in groups} <= set(shapes.FULL_SIZES.step)


def test_step_runs_only_when_asked_for():
    assert not [g for g in bench_run.make_config("all", None, KV_DTYPES, False).groups if g.kind == "step"]
    assert bench_run.parse_groups("step, decode") == ("decode", "step")
    kinds = {g.kind for g in bench_run.make_config("decode", "write,step", KV_DTYPES, True).groups}
    assert kinds == {"write", "step"}


def test_step_takes_the_quantized_kv_dtypes_asked_for():
    assert shapes.step_kv_dtypes(("fp8_per_token_head", "auto")) == ("fp8_per_token_head",)
    [group, *_] = step_config(True, kv_dtypes=("int8_per_token_head",)).groups
    kvcupy_cases = [c for c in shapes.group_cases(group) if c.impl == "kvcupy"]
    assert {c.kv_dtype for c in kvcupy_cases} == {"int8_per_token_head"}


def test_a_step_group_times_every_implementation():
    group = Group("step", LLAMA_32_8K, QUANTIZED)
    names = [c.name for c in shapes.group_cases(group)]
    assert names == [
        "kvcupy int4 eager", "kvcupy int4 graphed", "kvcupy int4 graphed, no writes",
        "kvcupy int8 eager", "kvcupy int8 graphed", "kvcupy int8 graphed, no writes",
        "kvcupy fp8 eager", "kvcupy fp8 graphed", "kvcupy fp8 graphed, no writes",
        "torch dense bf16 eager", "torch dense bf16 graphed",
        "flashinfer bf16 eager", "flashinfer bf16 graphed", "flashinfer fp8_e4m3 eager", "flashinfer fp8_e4m3 graphed"]
    storages = list(dict.fromkeys(shapes.step_storage(c) for c in shapes.group_cases(group)))
    assert storages == [("kvcupy", kv) for kv in QUANTIZED] + [("dense", None), ("flashinfer", "bf16"),
                                                               ("flashinfer", "fp8_e4m3")]
    assert group.label == "step Llama-3-8B (32 layers, 32/8 heads, d = 128), 32 x 8192"


def test_step_shape_has_one_layers_attention_and_write():
    assert LLAMA_32_32K.layer == shapes.Shape("decode", 32, 32768, 32, 8, 128)
    assert LLAMA_32_32K.layer_write == shapes.WriteShape(32, 8, 128)
    assert shapes.STEP_MAIN == LLAMA_32_32K and shapes.STEP_SHORT == LLAMA_32_8K


# --- bytes and FLOPs, worked by hand ---------------------------------------------

LLAMA_ATTENTION_32K = 32 * 32768 * 8 * 136 + 2 * 32 * 32 * 128 * 2     # int4 cache + query and output
LLAMA_WRITE_INT4 = 2 * 32 * 8 * 128 * 2 + 32 * 8 * 136                  # bf16 K/V read, one token written


def test_int4_step_bytes_are_every_layers_attention_and_write():
    case = Case("kvcupy", "int4_per_token_head", graphed=True)
    assert accounting.step_bytes(LLAMA_32_32K, case, BF16) == 32 * (LLAMA_ATTENTION_32K + LLAMA_WRITE_INT4)
    group = Group("step", LLAMA_32_32K, QUANTIZED)
    # The same bytes as the decode group's int4 case and the write group's, a layer.
    decode, write = accounting.attention_bytes(LLAMA_32_32K.layer, "int4_per_token_head", BF16), \
        accounting.write_bytes(LLAMA_32_32K.layer_write, "int4_per_token_head", BF16)
    assert accounting.case_bytes(group, case, BF16) == 32 * (decode + write)
    bare = Case("kvcupy", "int4_per_token_head", graphed=True, writes=False)
    assert accounting.case_bytes(group, bare, BF16) == 32 * LLAMA_ATTENTION_32K


@pytest.mark.parametrize("case, per_head", [
    (Case("dense", graphed=True), 2 * 128 * 2),                            # bf16 K and V
    (Case("flashinfer", "bf16", graphed=False), 2 * 128 * 2),
    (Case("flashinfer", "fp8_e4m3", graphed=True), 2 * 128),               # one byte a value, no scale rows
    (Case("kvcupy", "int8_per_token_head", graphed=False), 2 * 128 + 8),  # codes and two float32 scales
    (Case("kvcupy", "fp8_per_token_head", graphed=True), 2 * 128 + 8),
])
def test_step_bytes_count_the_storage_of_each_implementation(case, per_head):
    per_token = 8 * per_head
    assert accounting.step_token_bytes(LLAMA_32_32K, case, BF16) == per_token
    attention = 32 * 32768 * per_token + 2 * 32 * 32 * 128 * 2
    write = 2 * 32 * 8 * 128 * 2 + 32 * per_token
    assert accounting.step_bytes(LLAMA_32_32K, case, BF16) == 32 * (attention + write)


def test_phi3_step_bytes_at_d96():
    shape = StepShape.of(PHI_3_MINI, 8, 1024)
    int4 = Case("kvcupy", "int4_per_token_head", graphed=True)
    per_token = 32 * (48 + 48 + 8)
    assert accounting.step_token_bytes(shape, int4, BF16) == per_token == 3328
    attention = 8 * 1024 * per_token + 2 * 8 * 32 * 96 * 2
    write = 2 * 8 * 32 * 96 * 2 + 8 * per_token
    assert accounting.step_bytes(shape, int4, BF16) == 32 * (attention + write)


def test_step_flops_are_every_layers_decode_flops():
    group = Group("step", LLAMA_32_32K, QUANTIZED)
    expected = 32 * 4 * 128 * 32 * 32 * 32768
    assert accounting.case_flops(group, Case("dense", graphed=True)) == expected
    assert accounting.step_flops(LLAMA_32_32K) == 32 * accounting.attention_flops(LLAMA_32_32K.layer)


def test_paged_caches_are_whole_pages_and_dense_ones_the_context():
    shape = StepShape.of(LLAMA_3_8B, 2, 1000)    # 63 pages of 16 a sequence: 1008 tokens
    int4 = Case("kvcupy", "int4_per_token_head", graphed=True)
    assert accounting.step_layer_cache_bytes(shape, int4, BF16) == 2 * 1008 * 8 * 136
    assert accounting.step_layer_cache_bytes(shape, Case("dense", graphed=True), BF16) == 2 * 1000 * 8 * 512
    assert accounting.step_input_bytes(shape, BF16) == 2 * 2 * (8 + 32) * 128 * 2


# --- the memory-fit rule -----------------------------------------------------------

def test_a_step_whose_layers_all_fit_gets_a_cache_a_layer():
    int4 = Case("kvcupy", "int4_per_token_head", graphed=True)
    shape = StepShape.of(LLAMA_3_8B, 64, 32768)    # 32 layers x 2.125 GiB
    fit = accounting.step_fit(shape, int4, BF16, 1, H100_MEMORY, H200_L2)
    assert fit.layer_caches == 32 and fit.reason is None
    assert fit.needed_bytes == 32 * (64 * 32768 * 1088 + 2 * 64 * 40 * 128 * 2)
    assert fit.needed_bytes <= accounting.STEP_MEMORY_FRACTION * H100_MEMORY


def test_a_step_too_large_shares_caches_between_layers():
    """Dense bf16 at 32 x 32k: 4 GiB a layer, 128 GiB for 32 layers. On 80 GiB, 72 GiB
    usable holds 17 such caches; no layer finds another's 4 GiB in a 50 MiB L2."""
    dense = Case("dense", graphed=True)
    fit = accounting.step_fit(LLAMA_32_32K, dense, BF16, 1, H100_MEMORY, H200_L2)
    assert fit.layer_caches == 17
    assert fit.needed_bytes == 17 * 4 * GIB + 32 * accounting.step_input_bytes(LLAMA_32_32K, BF16)
    assert fit.reason == ("32 layers' caches of 4.0 GiB each take 128.0 GiB, more than 72.0 GiB (90% of the "
                          "GPU's 80.0 GiB): the layers take turns over 17 caches")


def test_a_step_that_fits_neither_way_is_refused_with_the_reason():
    # A small cache cannot be shared: the next layer would read it from L2.
    small = accounting.step_fit(StepShape.of(LLAMA_3_8B, 1, 1024), Case("kvcupy", "int8_per_token_head", graphed=True),
                                BF16, 1, 32 * 2**20, H200_L2)
    assert small.layer_caches == 0
    assert small.reason.startswith("does not fit: 32 layers' caches of 0.0 GiB each take 0.1 GiB")
    assert small.reason.endswith("a layer's cache is too small to share (the next layer would find it in L2)")
    # Phi-3-mini dense at 64 x 32k: one layer's 24 GiB is more than a 16 GiB GPU holds.
    big = accounting.step_fit(StepShape.of(PHI_3_MINI, 64, 32768), Case("dense", graphed=False), BF16, 1,
                              16 * GIB, H200_L2)
    assert big.layer_caches == 0
    assert big.reason == "does not fit: one layer's cache of 24.0 GiB is more than 14.4 GiB (90% of the GPU's 16.0 GiB)"


def test_input_sets_multiply_the_memory():
    int4 = Case("kvcupy", "int4_per_token_head", graphed=True)
    shape = StepShape.of(LLAMA_3_8B, 1, 1024)
    one = accounting.step_fit(shape, int4, BF16, 1, H100_MEMORY, H200_L2)
    three = accounting.step_fit(shape, int4, BF16, 3, H100_MEMORY, H200_L2)
    assert three.needed_bytes == 3 * one.needed_bytes and three.layer_caches == 32


def fits_everywhere(memory_bytes: int) -> dict[tuple, int]:
    """(model, batch, context, storage) -> distinct caches, over the full run."""
    found = {}
    for shape in shapes.FULL_SIZES.step:
        for case in shapes.step_cases(Group("step", shape, QUANTIZED)):
            sized = Case(case.impl, case.kv_dtype, graphed=True)
            moved = accounting.step_bytes(shape, sized, BF16)
            sets = accounting.input_sets(moved, H200_L2)
            fit = accounting.step_fit(shape, sized, BF16, sets, memory_bytes, H200_L2)
            found[(shape.model, shape.num_seqs, shape.seq_len, shapes.step_storage(case))] = fit.layer_caches
    return found


def test_on_an_80_gib_gpu_only_the_largest_steps_share_caches():
    found = fits_everywhere(H100_MEMORY)
    assert all(n > 0 for n in found.values())    # every case runs
    llama_shared = {key[1:]: n for key, n in found.items() if n < 32 and key[0] == "Llama-3-8B"}
    # Llama int4 fits everywhere (68 GiB at 64 x 32k); bf16 from 32 x 32k (128 GiB), int8 / fp8 at 64 x 32k.
    assert llama_shared == {
        (32, 32768, ("dense", None)): 17, (32, 32768, ("flashinfer", "bf16")): 17,
        (64, 32768, ("dense", None)): 8, (64, 32768, ("flashinfer", "bf16")): 8,
        (64, 32768, ("flashinfer", "fp8_e4m3")): 17, (64, 32768, ("kvcupy", "int8_per_token_head")): 17,
        (64, 32768, ("kvcupy", "fp8_per_token_head")): 17}
    # Phi-3-mini keeps 32 KV heads: its bf16 cache shares from 8 x 32k (3 GiB a layer).
    assert found[("Phi-3-mini", 8, 32768, ("dense", None))] == 23
    assert found[("Phi-3-mini", 8, 8192, ("dense", None))] == 32
    assert found[("Phi-3-mini", 64, 32768, ("kvcupy", "int4_per_token_head"))] == 11


# --- the GPU side's metadata and the dense peer's GQA ---------------------------------

def test_step_metadata_writes_each_sequences_last_token_into_its_own_pages():
    shape = StepShape.of(LLAMA_3_8B, 3, 40)   # 3 pages a sequence, the last one partly filled
    meta = bench_step.step_metadata(shape)
    assert meta.block_table.shape == (3, 3) and meta.block_table.dtype == np.int32
    assert sorted(meta.block_table.ravel()) == list(range(9)) and meta.num_blocks == 9
    assert meta.seq_lens.tolist() == [40, 40, 40]
    # Position 39: page 2, offset 7.
    assert meta.slots.tolist() == [int(meta.block_table[s, 2]) * 16 + 7 for s in range(3)]
    assert not np.array_equal(meta.block_table.ravel(), np.arange(9))   # shuffled pages


def test_folded_gqa_query_is_attention_with_each_kv_heads_query_heads():
    """The dense peer reads the query [S, Hq, d] as [S, Hk, group, d]: query head h
    attends with KV head h // group, as repeating each KV head group times gives."""
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    S, Hq, Hk, L, d = 2, 8, 2, 37, 16
    query = torch.randn(S, Hq, d, generator=generator)
    keys, values = (torch.randn(S, Hk, L, d, generator=generator) for _ in range(2))
    attend = torch.nn.functional.scaled_dot_product_attention
    folded = attend(query.view(S, Hk, Hq // Hk, d), keys, values).reshape(S, Hq, d)
    repeated = attend(query.unsqueeze(2), keys.repeat_interleave(Hq // Hk, dim=1),
                      values.repeat_interleave(Hq // Hk, dim=1)).squeeze(2)
    torch.testing.assert_close(folded, repeated)


# --- a whole step run on a fake device -----------------------------------------------

LAYER_WRITE_MS = 0.003        # a layer's write launch, whatever its bytes
EAGER_HOST_MS = 0.06          # the host's time to issue a layer's write and attention
EAGER_PLAN_MS = 0.2           # planning a step
RATES = {"kvcupy": 3.5, "dense": 4.4}


def fake_step_ms(shape: StepShape, case: Case) -> float:
    """Attention at RATES, a fixed cost a layer's write; an eager step at the host's
    pace where that is slower, and its planning on top."""
    attention = accounting.step_bytes(shape, Case(case.impl, case.kv_dtype, graphed=True, writes=False), BF16)
    gpu = attention / (RATES[case.impl] * 1e12) * 1e3 + (shape.num_layers * LAYER_WRITE_MS if case.writes else 0)
    if case.graphed:
        return gpu
    return max(gpu, shape.num_layers * EAGER_HOST_MS) + EAGER_PLAN_MS


class FakeStepRunner:
    """Times nothing; FlashInfer is missing, as on the GPU machine; fp8 at Phi-3-mini
    fails, as a broken kernel would. Keeps the order of builds and frees."""

    model_dtype = BF16
    l2_bytes = H200_L2
    memory_bytes = H100_MEMORY

    def __init__(self):
        self.events: list[tuple] = []

    def describe(self) -> dict:
        return {"device": {"name": "Fake H100", "arch": "sm_90", "sms": 132, "l2_bytes": self.l2_bytes,
                           "memory_bytes": self.memory_bytes},
                "versions": {"kvcupy": "0", "torch": "0"}, "torch_unavailable": None}

    def build(self, group, case, sets):
        self.events.append(("build", group.label, case, sets))
        if case.impl == "flashinfer":
            raise bench_run.PeerSkipped(NO_FLASHINFER)
        if case.kv_dtype == "fp8_per_token_head" and group.shape.model == "Phi-3-mini":
            raise RuntimeError("an illegal memory access was encountered")
        fit = accounting.step_fit(group.shape, Case(case.impl, case.kv_dtype, graphed=True), BF16, sets,
                                  self.memory_bytes, self.l2_bytes)
        ms = fake_step_ms(group.shape, case)
        return [lambda: ms] * sets, {"layer_caches": fit.layer_caches, "memory_bytes": fit.needed_bytes,
                                     "layers_share_caches": fit.reason}

    def warm_up(self, calls, warmup):
        return calls[0](), 0.5

    def time(self, calls, count, host_ms):
        raise AssertionError("step cases are timed back to back, never behind the hold")

    def time_steps(self, calls, count):
        return bench_run.Timing([calls[0]()] * count, idle_ms=0.0)

    def end_group(self):
        self.events.append(("end",))


@pytest.fixture(scope="module")
def step_run() -> tuple[dict, FakeStepRunner, bench_run.BenchConfig]:
    config = step_config(False, repeats=4, rounds=2)
    fake, steps = FakeStepRunner(), []
    fake.status_lines = []
    report = bench_run.run_bench(config, fake, steps.append, fake.status_lines.append)
    assert len(steps) == bench_run.total_steps(config)
    return report, fake, config


def step_group(report: dict, shape: StepShape) -> dict:
    [group] = [g for g in report["groups"] if g["kind"] == "step" and g["shape"] == {**asdict(shape), "block_size": 16}]
    return group


def record_of(group: dict, name: str) -> dict:
    [record] = [r for r in group["cases"] if r["name"] == name]
    return record


def test_step_report_is_strict_json(step_run):
    report, _, config = step_run
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    assert len(report["groups"]) == 24 and len(config.groups) == 24
    group = step_group(report, LLAMA_32_8K)
    assert group["label"] == "step Llama-3-8B (32 layers, 32/8 heads, d = 128), 32 x 8192"
    assert group["shape"] == {"model": "Llama-3-8B", "num_layers": 32, "num_seqs": 32, "seq_len": 8192,
                              "num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16}
    assert group["timing"] == bench_run.STEP_TIMING


def test_step_records_hold_time_tokens_and_ratios(step_run):
    report, _, _ = step_run
    group = step_group(report, LLAMA_32_32K)
    graphed = record_of(group, "kvcupy int4 graphed")
    expected_ms = fake_step_ms(LLAMA_32_32K, Case("kvcupy", "int4_per_token_head", graphed=True))
    assert graphed["status"] == "ok" and graphed["repeats"] == 4
    assert graphed["median_ms"] == pytest.approx(expected_ms)
    assert (graphed["impl"], graphed["kv_dtype"], graphed["graphed"], graphed["writes"]) == \
        ("kvcupy", "int4_per_token_head", True, True)
    assert graphed["tokens_per_s"] == pytest.approx(32 / (expected_ms * 1e-3))
    assert graphed["bytes"] == 32 * (LLAMA_ATTENTION_32K + LLAMA_WRITE_INT4)
    assert graphed["tb_per_s"] == pytest.approx(graphed["bytes"] / (expected_ms * 1e-3) / 1e12)
    assert graphed["flops"] == accounting.step_flops(LLAMA_32_32K)
    assert graphed["gpu_idle_fraction"] is None and graphed["host_ms"] == 0.5
    dense = record_of(group, "torch dense bf16 graphed")
    assert graphed["speedup_vs_dense_graphed"] == pytest.approx(dense["median_ms"] / graphed["median_ms"])
    assert dense["speedup_vs_dense_graphed"] == pytest.approx(1.0)
    # Dense bf16 at 32 x 32k takes turns over 17 caches on 80 GiB; the record says so.
    assert dense["layer_caches"] == 17 and "take turns over 17 caches" in dense["layers_share_caches"]
    assert graphed["layer_caches"] == 32 and graphed["layers_share_caches"] is None


def test_eager_is_compared_with_graphed_and_writes_are_weighed(step_run):
    report, _, _ = step_run
    group = step_group(report, LLAMA_32_8K)
    eager, graphed = record_of(group, "kvcupy int4 eager"), record_of(group, "kvcupy int4 graphed")
    bare = record_of(group, "kvcupy int4 graphed, no writes")
    assert eager["speed_vs_graphed"] == pytest.approx(graphed["median_ms"] / eager["median_ms"])
    assert graphed["write_share"] == pytest.approx(1 - bare["median_ms"] / graphed["median_ms"])
    assert graphed["write_share"] == pytest.approx(32 * LAYER_WRITE_MS / graphed["median_ms"], rel=0.02)
    assert "write_share" not in bare and "speed_vs_graphed" not in graphed
    assert record_of(group, "torch dense bf16 eager")["speed_vs_graphed"] < 1


def test_flashinfer_and_failures_are_recorded_not_raised(step_run):
    report, _, _ = step_run
    group = step_group(report, StepShape.of(PHI_3_MINI, 8, 8192))
    for name in ("flashinfer bf16 eager", "flashinfer bf16 graphed", "flashinfer fp8_e4m3 eager",
                 "flashinfer fp8_e4m3 graphed"):
        record = record_of(group, name)
        assert record["status"] == "skipped" and record["reason"] == NO_FLASHINFER, name
        assert record["bytes"] > 0 and "median_ms" not in record
    fp8 = record_of(group, "kvcupy fp8 graphed")
    assert fp8["status"] == "failed" and fp8["reason"] == "RuntimeError: an illegal memory access was encountered"
    assert record_of(group, "kvcupy int4 graphed")["status"] == "ok"


def test_a_failing_case_is_named_on_the_status_line_as_it_fails(step_run):
    report, fake, _ = step_run
    group = step_group(report, StepShape.of(PHI_3_MINI, 8, 8192))
    said = [line for line in fake.status_lines if line.startswith(group["label"] + ": ") and ": failed: " in line]
    failed = [f"{group['label']}: {r['name']}: failed: {r['reason']}" for r in group["cases"] if r["status"] == "failed"]
    assert said == failed and f"{group['label']}: kvcupy fp8 graphed: failed: " \
        "RuntimeError: an illegal memory access was encountered" in said


def test_each_storage_is_built_timed_and_freed_before_the_next(step_run):
    _, fake, config = step_run
    label = config.groups[0].label
    events = [e for e in fake.events if e[0] == "end" or e[1] == label]
    events = events[:next(i for i, e in enumerate(events) if e[0] == "build" and e[1] != label)] \
        if any(e[0] == "build" and e[1] != label for e in events) else events
    builds_between_ends, current = [], []
    for event in events:
        if event[0] == "end":
            builds_between_ends.append(current)
            current = []
        else:
            current.append(shapes.step_storage(event[2]))
    assert [set(storages) for storages in builds_between_ends[:6]] == [
        {("kvcupy", kv)} for kv in QUANTIZED] + [{("dense", None)}, {("flashinfer", "bf16")},
                                                 {("flashinfer", "fp8_e4m3")}]
    assert [len(storages) for storages in builds_between_ends[:6]] == [3, 3, 3, 2, 2, 2]


def test_a_storages_cases_share_its_input_sets():
    """The no-writes case moves fewer bytes but runs on the input sets the case
    with writes sized: every case of a storage asks for as many."""
    fake = FakeStepRunner()
    config = bench_run.make_config("all", "step", ("int4_per_token_head",), True, repeats=2, rounds=1)
    bench_run.run_bench(config, fake, lambda text: None, lambda text: None)
    asked = {}
    for _, label, case, sets in (e for e in fake.events if e[0] == "build"):
        asked.setdefault((label, shapes.step_storage(case)), set()).add(sets)
    assert all(len(sets) == 1 for sets in asked.values()), asked
    # Llama 1 x 1024 int4: 35 MB a step, 6 sets to cover 4 x 50 MiB of L2.
    assert asked[(config.groups[0].label, ("kvcupy", "int4_per_token_head"))] == {6}


def test_a_storages_arrays_are_unreferenced_when_it_ends():
    """When a storage's batch ends (runner.end_group frees the memory pools), nothing
    the bench keeps still refers to what its cases' calls hold: a whole model's caches
    left alive fill the GPU for the next storage."""
    import gc
    import weakref

    class Arrays:
        pass

    class HoldingRunner(FakeStepRunner):
        def __init__(self):
            super().__init__()
            self.held, self.alive_at_end = [], []

        def build(self, group, case, sets):
            calls, info = super().build(group, case, sets)
            arrays = Arrays()
            self.held.append(weakref.ref(arrays))
            return [lambda arrays=arrays, call=call: (arrays, call())[1] for call in calls], info

        def end_group(self):
            gc.collect()
            self.alive_at_end.append(sum(ref() is not None for ref in self.held))
            super().end_group()

    fake = HoldingRunner()
    config = bench_run.make_config("all", "step", ("int4_per_token_head",), True, repeats=2, rounds=1)
    bench_run.run_bench(config, fake, lambda text: None, lambda text: None)
    assert fake.held and fake.alive_at_end and set(fake.alive_at_end) == {0}


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_the_torch_page_write_puts_each_sequences_token_in_its_page(kv):
    """FlashInfer's write for head sizes its append lacks: token `position` of each
    sequence lands in its page's slot (K in half 0, V in half 1), bit for bit as
    kv_type converts it, and nothing else changes."""
    torch = pytest.importorskip("torch")
    kv_type = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    S, Hk, d, seq_len = 3, 2, 96, 40
    pages = -(-seq_len // BLOCK_SIZE)
    table = np.random.default_rng(1).permutation(S * pages).astype(np.int32).reshape(S, pages)
    cache = torch.zeros((S * pages, 2, BLOCK_SIZE, Hk, d)).to(kv_type)
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(S, Hk, d, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    position = seq_len - 1
    bench_step.page_token_writer(torch, kv_type, table, position, "cpu")(cache, keys, values)
    expected = torch.zeros((S * pages, 2, BLOCK_SIZE, Hk, d)).to(kv_type)
    for seq in range(S):
        page, slot = table[seq, position // BLOCK_SIZE], position % BLOCK_SIZE
        expected[page, 0, slot], expected[page, 1, slot] = keys[seq].to(kv_type), values[seq].to(kv_type)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache.view(torch.uint8).count_nonzero() > 0


class _FakeGraphTorch:
    """torch's graph capture as StepBuilder._graph uses it, recording the order of events."""

    def __init__(self, events: list):

        class Graph:
            def replay(self):
                events.append("replay")

        class Context:
            def __init__(self, *args):
                pass

            def __enter__(self):
                events.append("capture")

            def __exit__(self, *exc):
                return False

        class Stream:
            def wait_stream(self, other):
                pass

        class Cuda:
            CUDAGraph = Graph
            graph = stream = Context

            @staticmethod
            def current_stream():
                return Stream()

        Cuda.Stream = Stream
        self.cuda = Cuda


def test_a_graphed_step_holds_what_its_graph_reads():
    """A CUDA graph keeps only what it allocated while capturing; the buffers its body
    reads (a FlashInfer wrapper's workspace, a plan's tile lists) live as long as the
    step call does, or replays read memory that was freed and reused."""
    import gc
    import weakref

    events = []

    class Workspace:
        pass

    def graphed_call():
        workspace = Workspace()

        def body():
            events.append(("body", workspace))

        builder = bench_step.StepBuilder(_FakeGraphTorch(events), None, BF16, H200_MEMORY, H200_L2)
        return builder._graph(body, lambda: events.append("refill")), weakref.ref(workspace)

    call, workspace = graphed_call()
    gc.collect()
    assert workspace() is not None
    events.clear()
    call()
    assert events == ["refill", "replay"]
    del call
    events.clear()
    gc.collect()
    assert workspace() is None


# --- targets -------------------------------------------------------------------------

def test_step_targets_are_judged_from_the_step_records(step_run):
    report, _, _ = step_run
    targets = {t["target"]: t for t in report["targets"]}
    assert set(targets) == {t.text for t in STEP_TARGETS}
    speedup = targets["step int4 graphed, Llama-3-8B 32 x 32768: >= 2.7x dense bf16 graphed"]
    graphed = record_of(step_group(report, LLAMA_32_32K), "kvcupy int4 graphed")
    assert speedup["measured"] == graphed["speedup_vs_dense_graphed"] and speedup["met"] is True
    # 8192 keys at 3.5 TB/s: 32 layers x (82 us + 3 us of write) = 2.7 ms, beyond the host's
    # 1.9 ms, so eager adds its 0.2 ms of planning: 0.93 of graphed's speed.
    eager = targets["step int4 eager, Llama-3-8B 32 x 8192: time within 15% of int4 graphed"]
    assert eager["measured"] == pytest.approx(0.93, abs=0.01) and eager["met"] is True
    writes = targets["step int4 graphed, Llama-3-8B 32 x 8192: the writes' share of the step <= 5%"]
    assert writes["measured"] == pytest.approx(0.035, abs=0.002) and writes["met"] is True
    assert writes["bound"] == 0.05 and writes["metric"] == "write_share"


def synthetic_group(shape: StepShape, records: list[dict]) -> dict:
    return {"kind": "step", "shape": {**asdict(shape), "block_size": 16}, "cases": records}


def step_record(kv_dtype, graphed, writes=True, **fields) -> dict:
    return {"impl": "kvcupy", "kv_dtype": kv_dtype, "graphed": graphed, "writes": writes, "status": "ok", **fields}


@pytest.mark.parametrize("share, met", [(0.049, True), (0.05, True), (0.08, False), (None, None)])
def test_the_writes_share_is_met_at_most_its_bound(share, met):
    group = synthetic_group(LLAMA_32_8K, [step_record("int4_per_token_head", True, write_share=share)])
    [result] = evaluate_targets([group])
    assert result["measured"] == share and result["met"] is met


@pytest.mark.parametrize("ratio, met", [(0.88, True), (0.86, False)])
def test_eager_within_15_percent_of_graphed(ratio, met):
    group = synthetic_group(LLAMA_32_8K, [step_record("int4_per_token_head", False, speed_vs_graphed=ratio)])
    [result] = evaluate_targets([group])
    assert result["met"] is met and result["bound"] == pytest.approx(1 / 1.15)


def test_step_targets_need_their_group_and_case():
    # Another shape, or the case missing (int4 not asked for): nothing to judge.
    assert evaluate_targets([synthetic_group(StepShape.of(LLAMA_3_8B, 8, 8192),
                                             [step_record("int4_per_token_head", True, write_share=0.01)])]) == []
    assert evaluate_targets([synthetic_group(LLAMA_32_8K, [step_record("int8_per_token_head", True,
                                                                       write_share=0.01)])]) == []
    assert {t.text for t in STEP_TARGETS}.isdisjoint(t.text for t in TARGETS)


# --- tables, plot, command line -------------------------------------------------------

def rendered(report: dict) -> str:
    console = Console(file=io.StringIO(), width=240)
    console.print(tables(report))
    return console.file.getvalue()


def test_tables_show_a_step_group(step_run):
    report, _, _ = step_run
    text = rendered({**report, "groups": [step_group(report, LLAMA_32_32K)]})
    assert "step Llama-3-8B (32 layers, 32/8 heads, d = 128), 32 x 32768" in text
    for column in ("step ms", "tokens/s", "vs dense graphed", "vs graphed", "writes' share"):
        assert column in text, column
    graphed = record_of(step_group(report, LLAMA_32_32K), "kvcupy int4 graphed")
    row = next(line for line in text.splitlines() if line.strip().startswith("kvcupy int4 graphed "))
    assert f"{graphed['median_ms']:.3f}" in row and f"{graphed['tokens_per_s']:,.0f}" in row
    captions = " ".join(text.split())
    assert f"flashinfer bf16 eager: skipped ({NO_FLASHINFER})" in captions
    assert captions.count("torch dense bf16: 32 layers' caches of 4.0 GiB each") == 1
    assert "Step groups: steps issued back to back without a hold" in captions


def test_step_series_are_graphed_tokens_per_second_by_batch(step_run):
    report, _, _ = step_run
    series = plot.step_series(report)
    assert set(series) == {"Llama-3-8B", "Phi-3-mini"}
    llama = series["Llama-3-8B"]
    assert set(llama) == {f"{name} graphed, {k}k context" for name in ("kvcupy int4", "kvcupy int8", "kvcupy fp8",
                                                                         "torch dense bf16") for k in (1, 8, 32)}
    assert [n for n, _ in llama["kvcupy int4 graphed, 32k context"]] == [1, 8, 32, 64]
    graphed = record_of(step_group(report, LLAMA_32_32K), "kvcupy int4 graphed")
    assert llama["kvcupy int4 graphed, 32k context"][2] == (32, graphed["tokens_per_s"])
    # Phi-3-mini's fp8 failed: no line for it.
    assert not [label for label in series["Phi-3-mini"] if label.startswith("kvcupy fp8")]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_draws_a_step_report(step_run, tmp_path):
    report, _, _ = step_run
    path = plot.plot_report(report, tmp_path / "step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def fake_cuda(monkeypatch):
    return runs_on_fake_cuda(monkeypatch, FakeStepRunner)


def test_cli_runs_the_step_group_to_json(fake_cuda):
    result = cli_runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "step",
                                     "--repeats", "3", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(g["kind"], g["shape"]["model"], g["shape"]["num_seqs"]) for g in report["groups"]] == [
        ("step", "Llama-3-8B", 1), ("step", "Llama-3-8B", 8), ("step", "Phi-3-mini", 1), ("step", "Phi-3-mini", 8)]
    int4 = record_of(report["groups"][0], "kvcupy int4 graphed")
    assert int4["repeats"] == 3 and int4["tokens_per_s"] > 0
    assert report["targets"] == []   # the targets' shapes are not in the quick run
    assert len(fake_cuda) == 1


def test_cli_kv_dtype_chooses_the_steps_kvcupy_cases(fake_cuda):
    result = cli_runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "step",
                                     "--kv-dtype", "int8_per_token_head", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    names = [r["name"] for r in json.loads(result.stdout)["groups"][0]["cases"]]
    assert [n for n in names if n.startswith("kvcupy")] == [
        "kvcupy int8 eager", "kvcupy int8 graphed", "kvcupy int8 graphed, no writes"]


def test_cli_prints_step_tables(fake_cuda):
    result = cli_runner.invoke(app, ["bench", "--backend", "cuda", "--quick", "--groups", "step", "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "step Phi-3-mini (32 layers, 32/32 heads, d = 96), 8 x 1024" in result.stdout
    assert "tokens/s" in result.stdout


# --- on a GPU -----------------------------------------------------------------------------

@pytest.mark.gpu
def test_quick_step_group_runs_on_the_gpu():
    from kvcupy import backends
    if not backends.status("cuda").usable:
        pytest.skip("the CUDA backend is not usable here")
    pytest.importorskip("torch")
    config = step_config(True, repeats=2, rounds=1, warmup=1)
    report = bench_run.run_bench(config, bench_cuda.CudaRunner(), lambda text: None, lambda text: None)
    records = [r for g in report["groups"] for r in g["cases"]]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 and r["tokens_per_s"] > 0
               for r in records if r["impl"] != "flashinfer"), [(r["name"], r.get("reason")) for r in records]
    assert all(r["status"] in ("ok", "skipped") for r in records if r["impl"] == "flashinfer")
