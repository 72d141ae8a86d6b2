"""The CUDA bench's run: its configuration, the groups of cases timed in
interleaved rounds on a Runner, and the report's records and ratios."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .accounting import L2_ROTATE_FACTOR, case_bytes, case_flops, input_sets
from .shapes import (BLOCK_SIZE, FULL_SIZES, GROUP_KINDS, KINDS_OF_PHASE, QUICK_SIZES, Case, Group, StepShape,
                     group_cases, plan_groups, step_storage, sweep_kv_dtypes)
from .targets import evaluate_targets

Progress = Callable[[str], None]   # called with the name of a step that ended, or starts

# would take more than CASE_BUDGET_S of GPU time.
CASE_BUDGET_S = 3.0
MIN_REPEATS = 5

DEFAULT_REPEATS = {"decode": 30, "prefill": 10, "write": 30, "rotate": 30}
DEFAULT_ROUNDS = 3
DEFAULT_WARMUP = 5
# A whole-model step is a decode step: the decode count (--repeats) is its count of timed steps.
REPEATS_KIND = {"step": "decode"}
STEP_TIMING = ("steps issued back to back without a hold: CUDA events between consecutive steps, so a "
               "step whose host work outlasts its GPU work is timed at the host's pace, as a serving "
               "loop runs")


def split_repeats(repeats: int, rounds: int) -> list[int]:
    """Timed calls per round: `repeats` spread as evenly as possible, rounds with none dropped."""
    per_round = [repeats // rounds + (index < repeats % rounds) for index in range(rounds)]
    return [count for count in per_round if count]


def case_repeats(repeats: int, estimate_ms: float) -> int:
    """`repeats`, cut so that the case's timed calls take about CASE_BUDGET_S (never under MIN_REPEATS)."""
    if estimate_ms <= 0:
        return repeats
    return max(min(repeats, MIN_REPEATS), min(repeats, int(CASE_BUDGET_S * 1e3 / estimate_ms)))


# --- configuration ----------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    groups: tuple[Group, ...]
    repeats: dict[str, int]    # timed calls per case, by group kind
    rounds: int
    warmup: int
    sweep: dict                # the sweep's geometry, for the report and the plot
    prefill_sweep: dict        # the prefill sweep's, likewise
    time_limit_s: float | None = None   # no group starts after this long; the report names those left


def parse_groups(text: str) -> tuple[str, ...]:
    """"decode,write" -> ("decode", "write"); ValueError naming the choices."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [kind for kind in kinds if kind not in GROUP_KINDS]
    if unknown or not kinds:
        raise ValueError(f"{text!r} is not a comma-separated list of {', '.join(GROUP_KINDS)}")
    return tuple(kind for kind in GROUP_KINDS if kind in kinds)


def make_config(phase: str, groups: str | None, kv_dtypes: tuple[str, ...], quick: bool, *,
                repeats: int | None = None, prefill_repeats: int | None = None,
                rounds: int | None = None, warmup: int | None = None,
                time_limit_s: float | None = None) -> BenchConfig:
    """The run the CLI asked for. Counts left None take the CUDA defaults;
    `groups` (GROUP_KINDS, comma-separated) overrides the phase's groups."""
    kinds = parse_groups(groups) if groups is not None else KINDS_OF_PHASE[phase]
    sizes = QUICK_SIZES if quick else FULL_SIZES
    counts = dict(DEFAULT_REPEATS)
    if repeats is not None:
        counts.update(decode=repeats, write=repeats, rotate=repeats)
    if prefill_repeats is not None:
        counts["prefill"] = prefill_repeats
    sweep = {"num_seqs": sizes.sweep.num_seqs, "num_heads": sizes.sweep.num_heads,
             "num_kv_heads": sizes.sweep.num_kv_heads, "head_size": sizes.sweep.head_size,
             "seq_lens": list(sizes.sweep_seq_lens), "kv_dtypes": list(sweep_kv_dtypes(kv_dtypes))}
    prefill_sweep = {"tokens": sizes.prefill_sweep_tokens, "num_heads": sizes.prefill_sweep.num_heads,
                     "num_kv_heads": sizes.prefill_sweep.num_kv_heads, "head_size": sizes.prefill_sweep.head_size,
                     "seq_lens": list(sizes.prefill_sweep_seq_lens),
                     "num_seqs": [sizes.prefill_sweep_shape(n).num_seqs for n in sizes.prefill_sweep_seq_lens],
                     "kv_dtypes": list(sweep_kv_dtypes(kv_dtypes))}
    return BenchConfig(plan_groups(kinds, kv_dtypes, sizes), counts,
                       DEFAULT_ROUNDS if rounds is None else rounds,
                       DEFAULT_WARMUP if warmup is None else warmup, sweep, prefill_sweep, time_limit_s)


def total_steps(config: BenchConfig) -> int:
    return sum(len(group_cases(group)) for group in config.groups) * config.rounds


# --- running ------------------------------------------------------------------

class PeerSkipped(Exception):
    """A peer cannot run here (e.g. torch is not installed); the message says why."""


@dataclass
class Timing:
    ms: list[float]     # each timed call, by CUDA events
    idle_ms: float      # GPU time between the calls of the series, waiting for the host


class Runner(Protocol):
    """What run_bench needs of a device: CudaRunner, or a fake in the tests."""

    model_dtype: np.dtype
    l2_bytes: int

    def describe(self) -> dict:
        """{"device": ..., "versions": ..., "torch_unavailable": why not, or None}, for the report."""

    def build(self, group: Group, case: Case, sets: int) -> tuple[list[Callable[[], Any]], dict]:
        """One call per input set, and facts for the case's record; PeerSkipped when it cannot run."""

    def warm_up(self, calls: list[Callable[[], Any]], warmup: int) -> tuple[float, float]:
        """Calls them untimed; returns (estimated GPU ms a call, host ms to issue a call)."""

    def time(self, calls: list[Callable[[], Any]], count: int, host_ms: float) -> Timing:
        """`count` timed calls, rotating among `calls`."""

    def time_steps(self, calls: list[Callable[[], Any]], count: int) -> Timing:
        """`count` whole-model steps issued back to back (STEP_TIMING), rotating among `calls`."""

    def end_group(self) -> None:
        """Frees what the group's cases hold."""


@dataclass
class _Ready:
    calls: list[Callable[[], Any]]
    info: dict
    sets: int
    host_ms: float
    per_round: list[int]
    ms: list[float] = field(default_factory=list)
    idle_ms: float = 0.0


def _error_text(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:300]


def _case_fields(case: Case) -> dict:
    fields = {"name": case.name, "impl": case.impl, "kv_dtype": case.kv_dtype,
              "sdpa_backend": case.sdpa_backend, "splits": case.splits}
    if case.graphed is not None:
        fields.update(graphed=case.graphed, writes=case.writes)
    if case.device_metadata:
        fields["device_metadata"] = True
    return fields


def _rate(amount: int | None, ms: float) -> float | None:
    """amount per second, in units of 1e12 (TB/s, TFLOP/s)."""
    if amount is None or ms <= 0:
        return None
    return amount / (ms * 1e-3) / 1e12


def timed_record(group: Group, case: Case, model_dtype: np.dtype, ready: _Ready) -> dict:
    median_ms = statistics.median(ready.ms)
    moved, flops = case_bytes(group, case, model_dtype), case_flops(group, case)
    busy_ms = sum(ready.ms)
    return {**_case_fields(case), "status": "ok", "median_ms": median_ms, "min_ms": min(ready.ms),
            "repeats": len(ready.ms), "input_sets": ready.sets, "bytes": moved, "flops": flops,
            "tb_per_s": _rate(moved, median_ms), "tflop_per_s": _rate(flops, median_ms),
            "host_ms": ready.host_ms,
            "gpu_idle_fraction": ready.idle_ms / (ready.idle_ms + busy_ms) if busy_ms > 0 else None,
            **ready.info}


def untimed_record(group: Group, case: Case, model_dtype: np.dtype, status: str, reason: str) -> dict:
    return {**_case_fields(case), "status": status, "reason": reason,
            "bytes": case_bytes(group, case, model_dtype), "flops": case_flops(group, case)}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _fastest(records: list[dict], impl: str, kv_dtype: Any = "any") -> dict | None:
    found = [r for r in records if r["status"] == "ok" and r["impl"] == impl
             and (kv_dtype == "any" or r["kv_dtype"] == kv_dtype) and not r.get("device_metadata")]
    return min(found, key=lambda r: r["median_ms"]) if found else None


def add_ratios(records: list[dict]) -> None:
    """On each timed kvcupy record: speedup_vs_sdpa = fastest SDPA's time / kvcupy's
    (> 1: kvcupy faster); bandwidth_vs_copy / bandwidth_vs_stream = kvcupy's TB/s
    over the copy's of the same bytes / over the fastest streaming split count's;
    on a device-metadata record speed_vs_host_metadata = the host-metadata case's
    time / its own."""
    for record in records:
        if record["impl"] != "kvcupy" or record["status"] != "ok":
            continue
        sdpa = _fastest(records, "sdpa")
        copy = _fastest(records, "copy", record["kv_dtype"])
        stream = _fastest(records, "stream", record["kv_dtype"])
        record["speedup_vs_sdpa"] = _ratio(sdpa["median_ms"], record["median_ms"]) if sdpa else None
        record["sdpa_peer"] = sdpa["name"] if sdpa else None
        record["bandwidth_vs_copy"] = _ratio(record["tb_per_s"], copy["tb_per_s"]) if copy else None
        record["bandwidth_vs_stream"] = _ratio(record["tb_per_s"], stream["tb_per_s"]) if stream else None
        record["stream_splits"] = stream["splits"] if stream else None
        if record.get("device_metadata"):
            host = _fastest(records, "kvcupy", record["kv_dtype"])
            record["speed_vs_host_metadata"] = _ratio(host["median_ms"], record["median_ms"]) if host else None


def _step_record(records: list[dict], impl: str, kv_dtype: str | None, graphed: bool,
                 writes: bool = True) -> dict | None:
    found = [r for r in records if r["status"] == "ok" and r["impl"] == impl and r["kv_dtype"] == kv_dtype
             and r["graphed"] == graphed and r["writes"] == writes]
    return found[0] if found else None


def add_step_ratios(shape: StepShape, records: list[dict]) -> None:
    """On each timed step record: tokens_per_s = sequences / step time (each sequence
    gains a token a step; attention alone, so a bound on the model's rate);
    speedup_vs_dense_graphed = torch dense bf16 graphed's time / this one's;
    on eager records speed_vs_graphed = the same case graphed's time / this one's;
    on graphed records with writes write_share = 1 - (time without writes / time with)."""
    dense = _step_record(records, "dense", None, True)
    for record in records:
        if record["status"] != "ok":
            continue
        record["gpu_idle_fraction"] = None   # back to back, a step's idle time is inside its time
        record["tokens_per_s"] = shape.num_seqs / (record["median_ms"] * 1e-3)
        record["speedup_vs_dense_graphed"] = _ratio(dense["median_ms"], record["median_ms"]) if dense else None
        twin = _step_record(records, record["impl"], record["kv_dtype"], True)
        if not record["graphed"]:
            record["speed_vs_graphed"] = _ratio(twin["median_ms"], record["median_ms"]) if twin else None
        elif record["writes"]:
            bare = _step_record(records, record["impl"], record["kv_dtype"], True, writes=False)
            record["write_share"] = 1 - bare["median_ms"] / record["median_ms"] if bare else None


def _set_up(group: Group, case: Case, sets: int, config: BenchConfig, runner: Runner) -> _Ready:
    """A case built and warmed up. Its calls are held by the _Ready alone (no caller's
    local): clearing them frees the case's arrays before the next storage allocates."""
    calls, info = runner.build(group, case, sets)
    estimate_ms, host_ms = runner.warm_up(calls, config.warmup)
    count = case_repeats(config.repeats[REPEATS_KIND.get(group.kind, group.kind)], estimate_ms)
    return _Ready(calls, info, sets, host_ms, split_repeats(count, config.rounds))


def _time_cases(group: Group, cases: tuple[Case, ...], config: BenchConfig, runner: Runner,
                progress: Progress, status: Progress) -> dict[Case, dict]:
    """Set up the cases, time them in interleaved rounds, free them; a record each."""
    model_dtype = runner.model_dtype
    ready: dict[Case, _Ready] = {}
    untimed: dict[Case, dict] = {}
    step = group.kind == "step"

    def failed(case: Case, error: Exception) -> dict:
        # Said at once as well: a fault that breaks the CUDA context ends the run at the
        # group's closing synchronisation, before the report names the case.
        status(f"{group.label}: {case.name}: failed: {_error_text(error)}")
        return untimed_record(group, case, model_dtype, "failed", _error_text(error))

    try:
        status(f"{group.label}: setting up {len(cases)} cases")
        for case in cases:
            if case.impl == "kvcupy":   # its inputs are written and its kernels compile: seconds
                status(f"{group.label}: {case.name}: writing inputs, compiling kernels (first run only)")
            # A step case without writes runs on its storage's input sets, sized with them.
            sized = dataclasses.replace(case, writes=True) if step else case
            sets = input_sets(case_bytes(group, sized, model_dtype), runner.l2_bytes)
            try:
                ready[case] = _set_up(group, case, sets, config, runner)
            except PeerSkipped as skipped:
                untimed[case] = untimed_record(group, case, model_dtype, "skipped", str(skipped))
            except Exception as error:   # one case's failure (out of memory, a kernel error) ends only it
                untimed[case] = failed(case, error)
        for round_index in range(config.rounds):
            for case in cases:
                entry = ready.get(case)
                if entry is not None and case not in untimed and round_index < len(entry.per_round):
                    try:
                        if step:
                            timing = runner.time_steps(entry.calls, entry.per_round[round_index])
                        else:
                            timing = runner.time(entry.calls, entry.per_round[round_index], entry.host_ms)
                    except Exception as error:
                        untimed[case] = failed(case, error)
                    else:
                        entry.ms += timing.ms
                        entry.idle_ms += timing.idle_ms
                progress(f"{group.label}: {case.name}")
    finally:
        for entry in ready.values():
            entry.calls = []   # the group's arrays go before the next group allocates its own
        runner.end_group()
    return {case: untimed[case] if case in untimed else timed_record(group, case, model_dtype, ready[case])
            for case in cases}


def run_group(group: Group, config: BenchConfig, runner: Runner, progress: Progress,
              status: Progress) -> dict:
    """Set up every case of the group, time them in interleaved rounds, report them.
    A step group does so one storage at a time (shapes.step_storage): one
    implementation's caches of a whole model may fill most of the GPU, so they are
    freed before the next implementation allocates its own."""
    cases = group_cases(group)
    if group.kind == "step":
        storages = dict.fromkeys(step_storage(case) for case in cases)
        batches = [tuple(case for case in cases if step_storage(case) == storage) for storage in storages]
    else:
        batches = [cases]
    by_case: dict[Case, dict] = {}
    for batch in batches:
        by_case.update(_time_cases(group, batch, config, runner, progress, status))
    records = [by_case[case] for case in cases]
    result = {"kind": group.kind, "label": group.label, "sweep": group.sweep,
              "shape": {**asdict(group.shape), "block_size": BLOCK_SIZE}, "cases": records}
    if group.kind == "step":
        add_step_ratios(group.shape, records)
        result["timing"] = STEP_TIMING
    else:
        add_ratios(records)
    return result


def run_bench(config: BenchConfig, runner: Runner, progress: Progress, status: Progress,
              clock: Callable[[], float] = time.monotonic) -> dict:
    """Every group of config in order; with a time limit, the groups due after it are
    left out and listed under "not_run", so a long run cut short still reports."""
    start = clock()
    groups, not_run = [], []
    for group in config.groups:
        if config.time_limit_s is not None and clock() - start >= config.time_limit_s:
            not_run.append(group.label)
            continue
        groups.append(run_group(group, config, runner, progress, status))
    if not_run:
        status(f"time limit of {config.time_limit_s:g} s reached: {len(not_run)} groups not run")
    return {"backend": "cuda", **runner.describe(), "model_dtype": runner.model_dtype.name,
            "block_size": BLOCK_SIZE,
            "timing": {"clock": "cuda events", "statistic": "median", "warmup": config.warmup,
                       "repeats": config.repeats, "rounds": config.rounds,
                       "queued_behind_hold": True, "l2_rotate_factor": L2_ROTATE_FACTOR,
                       "case_budget_s": CASE_BUDGET_S},
            "sweep": config.sweep, "prefill_sweep": config.prefill_sweep, "groups": groups,
            "targets": evaluate_targets(groups),
            **({"not_run": {"reason": f"the time limit of {config.time_limit_s:g} s was reached",
                            "groups": not_run}} if not_run else {})}
