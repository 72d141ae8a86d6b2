"""The goals the CUDA bench grades itself against, and how a report stands."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .shapes import (BLOCK_SIZE, DECODE_D96, DECODE_FEW, DECODE_MAIN, DECODE_SHORT, PREFILL_CHUNKED, PREFILL_MAIN,
                     PREFILL_SHORT, ROTATE_HEAD_SIZES, SHORT_NAMES, STEP_MAIN, STEP_SHORT, Case,
                     RotateShape, Shape, StepShape, WriteShape)


@dataclass(frozen=True)
class Target:
    text: str
    kind: str
    shape: Shape | WriteShape | RotateShape
    kv_dtype: str | None
    metric: str     # a key of the kvcupy case's record
    bound: float    # met when the measured value is >= bound
    device_metadata: bool = False   # read off the kvcupy case given device metadata


TARGETS = (
    Target("decode int4, 32 x 32768, d = 128: >= 3.4 TB/s", "decode", DECODE_MAIN,
           "int4_per_token_head", "tb_per_s", 3.4),
    Target("decode int4, 32 x 32768, d = 128: >= 2.7x dense bf16 SDPA", "decode", DECODE_MAIN,
           "int4_per_token_head", "speedup_vs_sdpa", 2.7),
    Target("decode int4, 32 x 32768, d = 96: >= 3.4 TB/s", "decode", DECODE_D96,
           "int4_per_token_head", "tb_per_s", 3.4),
    Target("decode int8, 32 x 32768, d = 128: >= 3.4 TB/s", "decode", DECODE_MAIN,
           "int8_per_token_head", "tb_per_s", 3.4),
    Target("decode fp8, 32 x 32768, d = 128: >= 3.4 TB/s", "decode", DECODE_MAIN,
           "fp8_per_token_head", "tb_per_s", 3.4),
    Target("decode auto (bf16), 32 x 32768, d = 128: time within 10% of SDPA", "decode", DECODE_MAIN,
           "auto", "speedup_vs_sdpa", 1 / 1.1),
    Target("decode int4, 32 x 8192, d = 128: >= 3.2 TB/s", "decode", DECODE_SHORT,
           "int4_per_token_head", "tb_per_s", 3.2),
    Target("decode int4, 8 x 32768, d = 128: >= 3.2 TB/s", "decode", DECODE_FEW,
           "int4_per_token_head", "tb_per_s", 3.2),
    # Causal prefill: FLOP counted over the triangle only.
    *(Target(f"prefill {SHORT_NAMES[kv]}, 4 x 8192 causal, d = 128: >= 300 TFLOP/s", "prefill", PREFILL_MAIN,
             kv, "tflop_per_s", 300.0) for kv in ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head")),
    Target("prefill int4, 64 x 128 causal, d = 128: >= 50% of SDPA bf16", "prefill", PREFILL_SHORT,
           "int4_per_token_head", "speedup_vs_sdpa", 0.5),
    Target("prefill int4, 64 x 128 causal, device metadata and host bounds: time within 10% of host metadata",
           "prefill", PREFILL_SHORT, "int4_per_token_head", "speed_vs_host_metadata", 1 / 1.1, device_metadata=True),
    # Chunked: every cached key counted in full, the new tokens' own triangle as above.
    Target("prefill int4, 4 x 2048 new over 30720 cached, d = 128: >= 300 TFLOP/s", "prefill", PREFILL_CHUNKED,
           "int4_per_token_head", "tflop_per_s", 300.0),
    *(Target(f"rotate d = {d}: >= 80% of copy bandwidth", "rotate", RotateShape(1 << 20, d), None,
             "bandwidth_vs_copy", 0.8) for d in ROTATE_HEAD_SIZES),
)


@dataclass(frozen=True)
class StepTarget:
    """A goal of a whole-model decode step (the step group), read off one case's record."""

    text: str
    shape: StepShape
    case: Case
    metric: str         # a key of the case's record (run.add_step_ratios)
    bound: float
    at_most: bool = False   # met when measured <= bound (else >= bound)


STEP_INT4 = "int4_per_token_head"
STEP_TARGETS = (
    StepTarget("step int4 graphed, Llama-3-8B 32 x 32768: >= 2.7x dense bf16 graphed", STEP_MAIN,
               Case("kvcupy", STEP_INT4, graphed=True), "speedup_vs_dense_graphed", 2.7),
    # Eager: planned once a step and issued layer by layer; the host must keep ahead of the GPU.
    StepTarget("step int4 eager, Llama-3-8B 32 x 8192: time within 15% of int4 graphed", STEP_SHORT,
               Case("kvcupy", STEP_INT4, graphed=False), "speed_vs_graphed", 1 / 1.15),
    StepTarget("step int4 graphed, Llama-3-8B 32 x 8192: the writes' share of the step <= 5%", STEP_SHORT,
               Case("kvcupy", STEP_INT4, graphed=True), "write_share", 0.05, at_most=True),
)


def _group_of(groups: list[dict], kind: str, shape) -> dict | None:
    wanted = {**asdict(shape), "block_size": BLOCK_SIZE}
    return next((g for g in groups if g["kind"] == kind and g["shape"] == wanted), None)


def _graded(text: str, metric: str, bound: float, record: dict, at_most: bool = False) -> dict:
    measured = record.get(metric)
    met = None if measured is None else (measured <= bound if at_most else measured >= bound)
    return {"target": text, "metric": metric, "measured": measured, "bound": bound, "met": met}


def evaluate_targets(groups: list[dict]) -> list[dict]:
    """Each target whose group ran: measured value, bound, met (None: not measured)."""
    results = []
    for target in TARGETS:
        group = _group_of(groups, target.kind, target.shape)
        record = group and next((r for r in group["cases"] if r["impl"] == "kvcupy" and r["kv_dtype"] == target.kv_dtype
                                 and r.get("device_metadata", False) == target.device_metadata), None)
        if record:
            results.append(_graded(target.text, target.metric, target.bound, record))
    for target in STEP_TARGETS:
        group, case = _group_of(groups, "step", target.shape), target.case
        record = group and next((r for r in group["cases"] if r["impl"] == case.impl and r["kv_dtype"] == case.kv_dtype
                                 and r.get("graphed") == case.graphed and r.get("writes") == case.writes), None)
        if record:
            results.append(_graded(target.text, target.metric, target.bound, record, target.at_most))
    return results
