"""`kvcupy bench --backend cuda`: kvcupy on the GPU against its peers and the physical limits, in one run.

Every group of cases shares one shape. A group times kvcupy (each KV dtype)
and, beside it:
- torch `scaled_dot_product_attention` in bf16 on dense K/V (when torch is
  installed): the bar any quantized cache must beat;
- a device-to-device copy (cudaMemcpyAsync) moving as many bytes as the case
  reads and writes: the copy-bandwidth line;
- decode only: `kernels_cu/stream_pages.cu`, which reads the same pages of
  the same cache through the same block table on a split-KV grid and does
  nothing else: the ceiling of paged decode. It runs at several split
  counts; the fastest is the ceiling.

Groups: decode (batch 32 x 32768, 32/8 heads, d = 128 and 96; 32 x 8192;
8 x 32768), the decode sweep over context lengths that `--plot` draws, causal
prefill (4 x 8192 at d = 128 and 96, 1 x 2048, 64 x 128, and chunked: 4
sequences of 2048 new tokens over 30720 cached), the prefill sweep over
prompt lengths (16384 tokens a batch, as FlashAttention's benchmarks count
them) that `--plot` draws too, the write path (`reshape_and_cache`) and
`rotate`.

Accounting. TB/s = bytes the case must read and write / median time.
Attention must read every cached token's K and V once, scales included
(`formats.bytes_per_token`), and read the query and write the output; a
prefill tile re-read from L2 is not counted. SDPA's bytes are those of the
same attention over dense model-dtype K/V with num_kv_heads heads. The write
path reads K and V and writes the packed cache; rotate reads and writes each
vector once. Index arrays (block table, slot mapping) are left out: under
0.3% of any case of the full run. TFLOP/s = 4 * head_size * num_heads *
(keys each query token sees, summed), i.e. 4 Lq Lk d Hq per sequence, the
triangle for a causal prefill (a chunked one: its cached keys in full, the
new tokens' own triangle). A copy case copies half its partner's bytes, so
it moves as many bytes in all and its TB/s compares with the partner's
directly.

Timing. CUDA events around each call, on the one stream torch and CuPy share
(the legacy default stream). A case is first called `warmup` times untimed
(kernels compile there). Each timed series is queued behind `hold_stream`, a
kernel that sleeps on the GPU while the host issues the series, so calls run
back to back and the events time the GPU, not Python's launch rate; the host
time of one call and the GPU's idle time between timed calls (zero when the
queue stayed ahead) are reported beside. When a case moves less than
L2_ROTATE_FACTOR x the L2 size, it gets several input sets (caches, tensors)
and the calls rotate among them, so no call finds its data in L2. Rounds
interleave the cases of a group, as the CPU bench does, and each case's
median over all rounds is reported.

A peer that cannot run here (torch missing, an SDPA backend torch does not
have) is reported as skipped with the reason; a case whose set-up or call
raises is reported as failed with the error. Neither ends the run.
"""

from __future__ import annotations

import functools
import importlib
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
from rich.console import Group as RichGroup
from rich.table import Table

import kvcupy
from kvcupy import formats

from .bench import ALL_KV_DTYPES, Progress, Shape, attended_tokens, split_repeats

BLOCK_SIZE = 16
SEED = 0
STREAM_THREADS = 256
STREAM_SPLITS = (32, 64, 128, 256, 512)
SDPA_BACKENDS = ("default", "flash", "cudnn")   # prefill; decode uses the default dispatch

# A case moving less than this many times the L2 gets copies of its inputs to rotate among.
L2_ROTATE_FACTOR = 4
MAX_INPUT_SETS = 8
# Timed calls: `repeats` per case, fewer (never under MIN_REPEATS) when they
# would take more than CASE_BUDGET_S of GPU time.
CASE_BUDGET_S = 3.0
MIN_REPEATS = 5
# The hold ahead of a series lasts HOLD_MARGIN x the host time to issue it, within these bounds.
HOLD_MARGIN = 2.0
MIN_HOLD_S, MAX_HOLD_S = 1e-3, 0.2
HOST_PROBE_CALLS = 3

DEFAULT_REPEATS = {"decode": 30, "prefill": 10, "write": 30, "rotate": 30}
DEFAULT_ROUNDS = 3
DEFAULT_WARMUP = 5

GROUP_KINDS = ("decode", "sweep", "prefill", "prefill_sweep", "write", "rotate")
KINDS_OF_PHASE = {"all": GROUP_KINDS, "decode": ("decode", "sweep"), "prefill": ("prefill", "prefill_sweep")}
SHORT_NAMES = {"int4_per_token_head": "int4", "int8_per_token_head": "int8",
               "fp8_per_token_head": "fp8", "auto": "auto"}


def hold_seconds(series_host_s: float) -> float:
    """How long hold_stream sleeps ahead of a series that takes the host series_host_s to issue."""
    return min(MAX_HOLD_S, max(MIN_HOLD_S, HOLD_MARGIN * series_host_s))


# --- shapes and cases -----------------------------------------------------

@dataclass(frozen=True)
class WriteShape:
    """reshape_and_cache of num_tokens tokens, K and V [num_tokens, num_kv_heads, head_size]."""

    num_tokens: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class RotateShape:
    """kvcupy.rotate of num_vectors vectors of head_size (the default blockdiag plan)."""

    num_vectors: int
    head_size: int


@dataclass(frozen=True)
class Group:
    """Cases timed on one shape. kind: "decode", "prefill", "write" or "rotate";
    sweep: a decode context length or a prefill prompt length added for --plot's sweeps."""

    kind: str
    shape: Shape | WriteShape | RotateShape
    kv_dtypes: tuple[str, ...]
    sweep: bool = False

    @property
    def label(self) -> str:
        s = self.shape
        if self.kind in ("decode", "prefill"):
            if self.kind == "prefill" and s.query_len < s.seq_len:
                tokens = f"{s.num_seqs} x {s.query_len} new over {s.seq_len - s.query_len} cached, causal"
            else:
                tokens = f"{s.num_seqs} x {s.seq_len}" + (" causal" if self.kind == "prefill" else "")
            return f"{self.kind} {tokens}, {s.num_heads}/{s.num_kv_heads} heads, d = {s.head_size}"
        if self.kind == "write":
            return f"write {s.num_tokens} tokens x {s.num_kv_heads} KV heads, d = {s.head_size}"
        return f"rotate {s.num_vectors} vectors, d = {s.head_size}"


@dataclass(frozen=True)
class Case:
    """One timed thing: impl "kvcupy", "sdpa", "copy" or "stream". kv_dtype:
    kvcupy's KV dtype, or the one whose bytes a copy or stream moves."""

    impl: str
    kv_dtype: str | None = None
    sdpa_backend: str | None = None
    splits: int | None = None

    @property
    def name(self) -> str:
        short = SHORT_NAMES.get(self.kv_dtype, "")
        if self.impl == "kvcupy":
            return f"kvcupy {short}" if self.kv_dtype else "kvcupy rotate"
        if self.impl == "sdpa":
            return "torch sdpa" + ("" if self.sdpa_backend == "default" else f" {self.sdpa_backend}")
        if self.impl == "copy":
            return f"copy ({short} bytes)" if self.kv_dtype else "copy"
        return f"stream {short}, {self.splits} splits"


# Shapes of the targets (Llama-3-8B-like layer: 32 query / 8 KV heads).
DECODE_MAIN = Shape("decode", 32, 32768, 32, 8, 128)
DECODE_D96 = Shape("decode", 32, 32768, 32, 8, 96)
DECODE_SHORT = Shape("decode", 32, 8192, 32, 8, 128)
DECODE_FEW = Shape("decode", 8, 32768, 32, 8, 128)
PREFILL_MAIN = Shape("prefill", 4, 8192, 32, 8, 128)
PREFILL_D96 = Shape("prefill", 4, 8192, 32, 8, 96)
PREFILL_SHORT = Shape("prefill", 64, 128, 32, 8, 128)
PREFILL_CHUNKED = Shape("prefill", 4, 32768, 32, 8, 128, new_tokens=2048)   # 2048 new over 30720 cached
WRITE_MAIN = WriteShape(32768, 8, 128)
ROTATE_HEAD_SIZES = (64, 96, 128, 256)


@dataclass(frozen=True)
class Sizes:
    decode: tuple[Shape, ...]
    sweep: Shape                    # geometry of the sweep; its seq_len is unused
    sweep_seq_lens: tuple[int, ...]
    prefill: tuple[Shape, ...]
    prefill_sweep: Shape            # geometry of the prefill sweep; num_seqs and seq_len unused
    prefill_sweep_seq_lens: tuple[int, ...]
    prefill_sweep_tokens: int       # prompts a length: this many tokens / the length (at least one)
    write: tuple[WriteShape, ...]
    rotate: tuple[RotateShape, ...]

    def prefill_sweep_shape(self, seq_len: int) -> Shape:
        geometry = self.prefill_sweep
        return Shape("prefill", max(1, self.prefill_sweep_tokens // seq_len), seq_len, geometry.num_heads,
                     geometry.num_kv_heads, geometry.head_size)


FULL_SIZES = Sizes(
    decode=(DECODE_MAIN, DECODE_D96, DECODE_SHORT, DECODE_FEW),
    sweep=DECODE_MAIN, sweep_seq_lens=tuple(1024 << k for k in range(8)),   # 1k .. 128k
    prefill=(PREFILL_MAIN, PREFILL_D96, Shape("prefill", 1, 2048, 32, 8, 128), PREFILL_SHORT, PREFILL_CHUNKED),
    prefill_sweep=PREFILL_MAIN, prefill_sweep_seq_lens=tuple(512 << k for k in range(6)),   # 512 .. 16k
    prefill_sweep_tokens=16384,
    write=(WRITE_MAIN,),
    rotate=tuple(RotateShape(1 << 20, d) for d in ROTATE_HEAD_SIZES))
# A smoke test: every path, small shapes, seconds.
QUICK_SIZES = Sizes(
    decode=(Shape("decode", 4, 2048, 8, 2, 128), Shape("decode", 4, 2048, 8, 2, 96)),
    sweep=Shape("decode", 4, 2048, 8, 2, 128), sweep_seq_lens=(512, 2048, 8192),
    prefill=(Shape("prefill", 2, 512, 8, 2, 128), Shape("prefill", 2, 1024, 8, 2, 128, new_tokens=256)),
    prefill_sweep=Shape("prefill", 2, 512, 8, 2, 128), prefill_sweep_seq_lens=(128, 256), prefill_sweep_tokens=512,
    write=(WriteShape(2048, 2, 128),),
    rotate=(RotateShape(1 << 14, 64), RotateShape(1 << 14, 96)))


def sweep_kv_dtypes(kv_dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """The sweep times int4 (or the first KV dtype asked for, without int4)."""
    return ("int4_per_token_head",) if "int4_per_token_head" in kv_dtypes else kv_dtypes[:1]


def plan_groups(kinds: tuple[str, ...], kv_dtypes: tuple[str, ...], sizes: Sizes) -> tuple[Group, ...]:
    """The groups of `kinds` (GROUP_KINDS), in run order. A sweep length that a
    decode (prefill) group already times is not timed twice."""
    groups = []
    if "decode" in kinds:
        groups += [Group("decode", shape, kv_dtypes) for shape in sizes.decode]
    if "sweep" in kinds:
        timed = {group.shape for group in groups}
        for seq_len in sizes.sweep_seq_lens:
            shape = Shape("decode", sizes.sweep.num_seqs, seq_len, sizes.sweep.num_heads,
                          sizes.sweep.num_kv_heads, sizes.sweep.head_size)
            if shape not in timed:
                groups.append(Group("decode", shape, sweep_kv_dtypes(kv_dtypes), sweep=True))
    if "prefill" in kinds:
        groups += [Group("prefill", shape, kv_dtypes) for shape in sizes.prefill]
    if "prefill_sweep" in kinds:
        timed = {group.shape for group in groups}
        for seq_len in sizes.prefill_sweep_seq_lens:
            shape = sizes.prefill_sweep_shape(seq_len)
            if shape not in timed:
                groups.append(Group("prefill", shape, sweep_kv_dtypes(kv_dtypes), sweep=True))
    if "write" in kinds:
        groups += [Group("write", shape, kv_dtypes) for shape in sizes.write]
    if "rotate" in kinds:
        groups += [Group("rotate", shape, ()) for shape in sizes.rotate]
    return tuple(groups)


def stream_splits(shape: Shape) -> tuple[int, ...]:
    """Split counts the streaming kernel runs at: STREAM_SPLITS up to one page a split."""
    pages = math.ceil(shape.seq_len / BLOCK_SIZE)
    return tuple(s for s in STREAM_SPLITS if s <= pages) or (pages,)


def group_cases(group: Group) -> tuple[Case, ...]:
    kvcupy_cases = tuple(Case("kvcupy", kv_dtype) for kv_dtype in group.kv_dtypes)
    copies = tuple(Case("copy", kv_dtype) for kv_dtype in group.kv_dtypes)
    if group.kind == "rotate":
        return Case("kvcupy"), Case("copy")
    if group.kind == "write":
        return kvcupy_cases + copies
    if group.kind == "prefill":
        return kvcupy_cases + tuple(Case("sdpa", sdpa_backend=b) for b in SDPA_BACKENDS)
    streams = tuple(Case("stream", kv_dtype, splits=splits)
                    for kv_dtype in group.kv_dtypes for splits in stream_splits(group.shape))
    return kvcupy_cases + (Case("sdpa", sdpa_backend="default"),) + copies + streams


# --- accounting -----------------------------------------------------------

def cache_bytes(shape: Shape, kv_dtype: str, model_dtype: np.dtype) -> int:
    """K and V of every cached token, scales included: what an attention over
    the batch reads at least once."""
    per_token = formats.kv_dtype_info(kv_dtype).bytes_per_token(shape.num_kv_heads, shape.head_size,
                                                                 model_dtype)
    return shape.num_seqs * shape.seq_len * per_token


def query_output_bytes(shape: Shape, model_dtype: np.dtype) -> int:
    """The query read and the output written, model dtype."""
    return 2 * shape.num_seqs * shape.query_len * shape.num_heads * shape.head_size * model_dtype.itemsize


def attention_bytes(shape: Shape, kv_dtype: str, model_dtype: np.dtype) -> int:
    return cache_bytes(shape, kv_dtype, model_dtype) + query_output_bytes(shape, model_dtype)


def attention_flops(shape: Shape) -> int:
    """4 * d * Hq per (query token, key it sees): QK^T and PV, 2 FLOP a multiply-add each."""
    return 4 * shape.head_size * shape.num_heads * attended_tokens(shape)


def stream_bytes(shape: Shape, kv_dtype: str, model_dtype: np.dtype, splits: int) -> int:
    """The cache, and one 4-byte word written per thread block."""
    return cache_bytes(shape, kv_dtype, model_dtype) + 4 * shape.num_seqs * splits


def write_bytes(shape: WriteShape, kv_dtype: str, model_dtype: np.dtype) -> int:
    """K and V read in the model dtype, the packed cache (scales included) written."""
    read = 2 * shape.num_tokens * shape.num_kv_heads * shape.head_size * model_dtype.itemsize
    written = shape.num_tokens * formats.kv_dtype_info(kv_dtype).bytes_per_token(
        shape.num_kv_heads, shape.head_size, model_dtype)
    return read + written


def rotate_bytes(shape: RotateShape, model_dtype: np.dtype) -> int:
    return 2 * shape.num_vectors * shape.head_size * model_dtype.itemsize


def copy_bytes(partner_bytes: int) -> int:
    """A copy of half the partner's bytes moves (reads + writes) as many in all."""
    return 2 * (partner_bytes // 2)


def case_bytes(group: Group, case: Case, model_dtype: np.dtype) -> int:
    shape = group.shape
    if group.kind == "write":
        moved = write_bytes(shape, case.kv_dtype, model_dtype)
    elif group.kind == "rotate":
        moved = rotate_bytes(shape, model_dtype)
    elif case.impl == "stream":
        return stream_bytes(shape, case.kv_dtype, model_dtype, case.splits)
    else:   # SDPA reads the dense K/V an "auto" cache holds
        moved = attention_bytes(shape, "auto" if case.impl == "sdpa" else case.kv_dtype, model_dtype)
    return copy_bytes(moved) if case.impl == "copy" else moved


def case_flops(group: Group, case: Case) -> int | None:
    if group.kind in ("decode", "prefill") and case.impl in ("kvcupy", "sdpa"):
        return attention_flops(group.shape)
    return None


def input_sets(moved_bytes: int, l2_bytes: int) -> int:
    """Copies of a case's inputs to rotate among, so that no call finds the
    previous call's data in L2."""
    if moved_bytes >= L2_ROTATE_FACTOR * l2_bytes:
        return 1
    return min(MAX_INPUT_SETS, math.ceil(L2_ROTATE_FACTOR * l2_bytes / max(moved_bytes, 1)))


def stream_defines(num_kv_heads: int, head_size: int, kv_dtype: str, model_dtype: np.dtype) -> dict:
    """-D defines of kernels_cu/stream_pages.cu for one cache geometry."""
    info = formats.kv_dtype_info(kv_dtype)
    row = num_kv_heads * info.stored_head_size(head_size) * info.storage_dtype(model_dtype).itemsize
    return {"KVC_THREADS": STREAM_THREADS, "KVC_BLOCK_SIZE": BLOCK_SIZE, "KVC_ROW_BYTES": row,
            "KVC_SCALE_ROW_BYTES": 4 * num_kv_heads if info.quantized else 0}


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


def parse_groups(text: str) -> tuple[str, ...]:
    """"decode,write" -> ("decode", "write"); ValueError naming the choices."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [kind for kind in kinds if kind not in GROUP_KINDS]
    if unknown or not kinds:
        raise ValueError(f"{text!r} is not a comma-separated list of {', '.join(GROUP_KINDS)}")
    return tuple(kind for kind in GROUP_KINDS if kind in kinds)


def make_config(phase: str, groups: str | None, kv_dtypes: tuple[str, ...], quick: bool, *,
                repeats: int | None = None, prefill_repeats: int | None = None,
                rounds: int | None = None, warmup: int | None = None) -> BenchConfig:
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
                       DEFAULT_WARMUP if warmup is None else warmup, sweep, prefill_sweep)


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
    return {"name": case.name, "impl": case.impl, "kv_dtype": case.kv_dtype,
            "sdpa_backend": case.sdpa_backend, "splits": case.splits}


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
             and (kv_dtype == "any" or r["kv_dtype"] == kv_dtype)]
    return min(found, key=lambda r: r["median_ms"]) if found else None


def add_ratios(records: list[dict]) -> None:
    """On each timed kvcupy record: speedup_vs_sdpa = fastest SDPA's time / kvcupy's
    (> 1: kvcupy faster); bandwidth_vs_copy / bandwidth_vs_stream = kvcupy's TB/s
    over the copy's of the same bytes / over the fastest streaming split count's."""
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


def run_group(group: Group, config: BenchConfig, runner: Runner, progress: Progress,
              status: Progress) -> dict:
    """Set up every case of the group, time them in interleaved rounds, report them."""
    cases = group_cases(group)
    model_dtype = runner.model_dtype
    ready: dict[Case, _Ready] = {}
    untimed: dict[Case, dict] = {}
    try:
        status(f"{group.label}: setting up {len(cases)} cases")
        for case in cases:
            if case.impl == "kvcupy":   # its inputs are written and its kernels compile: seconds
                status(f"{group.label}: {case.name}: writing inputs, compiling kernels (first run only)")
            sets = input_sets(case_bytes(group, case, model_dtype), runner.l2_bytes)
            try:
                calls, info = runner.build(group, case, sets)
                estimate_ms, host_ms = runner.warm_up(calls, config.warmup)
            except PeerSkipped as skipped:
                untimed[case] = untimed_record(group, case, model_dtype, "skipped", str(skipped))
                continue
            except Exception as error:   # one case's failure (out of memory, a kernel error) ends only it
                untimed[case] = untimed_record(group, case, model_dtype, "failed", _error_text(error))
                continue
            count = case_repeats(config.repeats[group.kind], estimate_ms)
            ready[case] = _Ready(calls, info, sets, host_ms, split_repeats(count, config.rounds))
        for round_index in range(config.rounds):
            for case in cases:
                entry = ready.get(case)
                if entry is not None and case not in untimed and round_index < len(entry.per_round):
                    try:
                        timing = runner.time(entry.calls, entry.per_round[round_index], entry.host_ms)
                    except Exception as error:
                        untimed[case] = untimed_record(group, case, model_dtype, "failed", _error_text(error))
                    else:
                        entry.ms += timing.ms
                        entry.idle_ms += timing.idle_ms
                progress(f"{group.label}: {case.name}")
    finally:
        for entry in ready.values():
            entry.calls = []   # the group's arrays go before the next group allocates its own
        runner.end_group()
    records = [untimed[case] if case in untimed else timed_record(group, case, model_dtype, ready[case])
               for case in cases]
    add_ratios(records)
    return {"kind": group.kind, "label": group.label, "sweep": group.sweep,
            "shape": {**asdict(group.shape), "block_size": BLOCK_SIZE}, "cases": records}


def run_bench(config: BenchConfig, runner: Runner, progress: Progress, status: Progress) -> dict:
    groups = [run_group(group, config, runner, progress, status) for group in config.groups]
    return {"backend": "cuda", **runner.describe(), "model_dtype": runner.model_dtype.name,
            "block_size": BLOCK_SIZE,
            "timing": {"clock": "cuda events", "statistic": "median", "warmup": config.warmup,
                       "repeats": config.repeats, "rounds": config.rounds,
                       "queued_behind_hold": True, "l2_rotate_factor": L2_ROTATE_FACTOR,
                       "case_budget_s": CASE_BUDGET_S},
            "sweep": config.sweep, "prefill_sweep": config.prefill_sweep, "groups": groups,
            "targets": evaluate_targets(groups)}


# --- the targets ------------------------------------------------------

@dataclass(frozen=True)
class Target:
    text: str
    kind: str
    shape: Shape | WriteShape | RotateShape
    kv_dtype: str | None
    metric: str     # a key of the kvcupy case's record
    bound: float    # met when the measured value is >= bound


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
    # The prefill issue's (causal FLOP counted over the triangle only).
    *(Target(f"prefill {SHORT_NAMES[kv]}, 4 x 8192 causal, d = 128: >= 300 TFLOP/s", "prefill", PREFILL_MAIN,
             kv, "tflop_per_s", 300.0) for kv in ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head")),
    Target("prefill int4, 64 x 128 causal, d = 128: >= 50% of SDPA bf16", "prefill", PREFILL_SHORT,
           "int4_per_token_head", "speedup_vs_sdpa", 0.5),
    # Chunked: every cached key counted in full, the new tokens' own triangle as above.
    Target("prefill int4, 4 x 2048 new over 30720 cached, d = 128: >= 300 TFLOP/s", "prefill", PREFILL_CHUNKED,
           "int4_per_token_head", "tflop_per_s", 300.0),
    Target("write int4, 32768 tokens x 8 heads, d = 128: >= 70% of copy bandwidth", "write", WRITE_MAIN,
           "int4_per_token_head", "bandwidth_vs_copy", 0.7),
    *(Target(f"rotate d = {d}: >= 80% of copy bandwidth", "rotate", RotateShape(1 << 20, d), None,
             "bandwidth_vs_copy", 0.8) for d in ROTATE_HEAD_SIZES),
)


def evaluate_targets(groups: list[dict]) -> list[dict]:
    """Each target whose group ran: measured value, bound, met (None: not measured)."""
    results = []
    for target in TARGETS:
        shape = {**asdict(target.shape), "block_size": BLOCK_SIZE}
        group = next((g for g in groups if g["kind"] == target.kind and g["shape"] == shape), None)
        if group is None:
            continue
        record = next((r for r in group["cases"]
                       if r["impl"] == "kvcupy" and r["kv_dtype"] == target.kv_dtype), None)
        if record is None:
            continue
        measured = record.get(target.metric)
        results.append({"target": target.text, "metric": target.metric, "measured": measured,
                        "bound": target.bound, "met": None if measured is None else measured >= target.bound})
    return results


# --- the CUDA runner ----------------------------------------------------------

class _Tensors:
    """Model-dtype tensors on the GPU: torch bf16 when torch is here (CuPy has
    no bfloat16), else CuPy float16."""

    def __init__(self, cupy, torch):
        self.cupy, self.torch = cupy, torch
        self.dtype = formats.MODEL_DTYPES["bfloat16" if torch is not None else "float16"]

    def randn(self, shape: tuple, seed: int):
        if self.torch is not None:
            generator = self.torch.Generator(device="cuda").manual_seed(seed)
            return self.torch.randn(shape, generator=generator, device="cuda", dtype=self.torch.bfloat16)
        rng = self.cupy.random.default_rng(seed)
        return rng.standard_normal(shape, dtype=self.cupy.float32).astype(self.cupy.float16)

    def tokens(self, x):
        """[S, H, L, d] -> a contiguous [S * L, H, d]."""
        S, H, L, d = x.shape
        if self.torch is not None:
            return x.transpose(1, 2).reshape(S * L, H, d).contiguous()
        return self.cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(S * L, H, d)

    def copy(self, x):
        return x.clone() if self.torch is not None else x.copy()

    def empty_like(self, x):
        return self.torch.empty_like(x) if self.torch is not None else self.cupy.empty_like(x)


@dataclass
class _AttentionData:
    """One attention group's inputs: dense K/V [S, Hk, L, d], query [S, Hq, Lq, d],
    a block table of shuffled pages and its batch plan."""

    key: Any
    value: Any
    query: Any
    block_table: np.ndarray     # [S, pages per sequence] int32
    num_blocks: int
    batch: Any                  # kvcupy.BatchPlan


class CudaRunner:
    """Builds and times the cases on the current CUDA device."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.torch, self.torch_reason = self._import_torch()
        self.tensors = _Tensors(cupy, self.torch)
        self.model_dtype = self.tensors.dtype
        device = cupy.cuda.Device()
        self.properties = cupy.cuda.runtime.getDeviceProperties(device.id)
        self.l2_bytes = int(self.properties["l2CacheSize"])
        self.stream = cupy.cuda.get_current_stream()
        if self.torch is not None and self.torch.cuda.current_stream().cuda_stream != self.stream.ptr:
            raise RuntimeError("torch's current CUDA stream is not CuPy's; the bench times every peer "
                               "on one stream (leave both on the default stream)")
        from kvcupy import jit
        self.jit = jit
        self.hold = jit.get_function("hold_stream", "hold_stream", {})
        self._attention: _AttentionData | None = None
        self._caches: dict[str, list] = {}      # kv_dtype -> the group's caches, one per input set
        self._written: set[int] = set()         # ids of those caches written

    @staticmethod
    def _import_torch():
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            return None, "torch is not installed"
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} sees no CUDA device"
        return torch, None

    def describe(self) -> dict:
        cupy, props = self.cupy, self.properties
        name = props["name"]
        device = {"name": name.decode() if isinstance(name, bytes) else str(name),
                  "arch": f"sm_{props['major']}{props['minor']}", "sms": int(props["multiProcessorCount"]),
                  "l2_bytes": self.l2_bytes, "memory_bytes": int(props["totalGlobalMem"])}
        versions = {"kvcupy": kvcupy.__version__, "cupy": cupy.__version__,
                    "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                    "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
                    "nvrtc": ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
                    "torch": self.torch.__version__ if self.torch is not None else None}
        return {"device": device, "versions": versions, "torch_unavailable": self.torch_reason}

    # Setting up cases.

    def build(self, group: Group, case: Case, sets: int) -> tuple[list[Callable[[], Any]], dict]:
        if case.impl == "copy":
            return self._copy(case_bytes(group, case, self.model_dtype), sets), {}
        if group.kind == "rotate":
            return self._rotate(group.shape, sets)
        if group.kind == "write":
            return self._write(group.shape, case.kv_dtype, sets), {}
        if case.impl == "kvcupy":
            return self._kvcupy_attention(group, case.kv_dtype, sets), {}
        if case.impl == "sdpa":
            return self._sdpa(group, case.sdpa_backend, sets)
        return self._stream(group, case, sets)

    def _attention_data(self, group: Group) -> _AttentionData:
        if self._attention is None:
            s = group.shape
            pages = math.ceil(s.seq_len / BLOCK_SIZE)
            rng = np.random.default_rng(SEED)
            # Pages in a shuffled order, as a serving engine's free list leaves them.
            block_table = rng.permutation(s.num_seqs * pages).astype(np.int32).reshape(s.num_seqs, pages)
            batch = kvcupy.plan_batch(
                block_table=block_table, seq_lens=np.full(s.num_seqs, s.seq_len, np.int32),
                cu_seqlens_q=np.arange(s.num_seqs + 1, dtype=np.int32) * s.query_len,
                block_size=BLOCK_SIZE, num_blocks=s.num_seqs * pages,
                num_query_tokens=s.num_seqs * s.query_len)
            randn = self.tensors.randn
            self._attention = _AttentionData(
                key=randn((s.num_seqs, s.num_kv_heads, s.seq_len, s.head_size), SEED),
                value=randn((s.num_seqs, s.num_kv_heads, s.seq_len, s.head_size), SEED + 1),
                query=randn((s.num_seqs, s.num_heads, s.query_len, s.head_size), SEED + 2),
                block_table=block_table, num_blocks=s.num_seqs * pages, batch=batch)
        return self._attention

    def _group_caches(self, group: Group, kv_dtype: str, sets: int, written: bool) -> list:
        """The group's caches of `kv_dtype`, at least `sets` of them; written: holding the group's K/V."""
        data = self._attention_data(group)
        s = group.shape
        caches = self._caches.setdefault(kv_dtype, [])
        while len(caches) < sets:
            caches.append(kvcupy.allocate_cache(data.num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_size,
                                                kv_dtype=kv_dtype, device="cuda",
                                                dtype=self.model_dtype.name))
        if written:
            positions = np.arange(s.seq_len)
            for cache in caches[:sets]:
                if id(cache) in self._written:
                    continue
                for seq in range(s.num_seqs):   # one sequence at a time bounds the token-major copies
                    row = data.block_table[seq]
                    slots = (row[positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                             + positions % BLOCK_SIZE)
                    kvcupy.reshape_and_cache(self.tensors.tokens(data.key[seq:seq + 1]),
                                             self.tensors.tokens(data.value[seq:seq + 1]), cache, slots)
                self._written.add(id(cache))
        return caches[:sets]

    def _kvcupy_attention(self, group: Group, kv_dtype: str, sets: int) -> list:
        data = self._attention_data(group)
        calls = []
        for cache in self._group_caches(group, kv_dtype, sets, written=True):
            query = self.tensors.tokens(data.query)    # each set its own query and output
            out = self.tensors.empty_like(query)
            calls.append(functools.partial(kvcupy.paged_attention, query, cache, batch=data.batch, out=out))
        return calls

    def _sdpa_function(self, backend: str) -> Callable:
        torch = self.torch
        if torch is None:
            raise PeerSkipped(self.torch_reason)
        attend = torch.nn.functional.scaled_dot_product_attention
        if backend == "default":
            return attend
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        except (ImportError, AttributeError):
            raise PeerSkipped(f"torch {torch.__version__} cannot select the {backend} SDPA backend "
                              "(torch.nn.attention.sdpa_kernel)") from None

        def attend_with(*args, **kwargs):
            with sdpa_kernel(chosen):
                return attend(*args, **kwargs)

        return attend_with

    def _sdpa(self, group: Group, backend: str, sets: int) -> tuple[list, dict]:
        attend = self._sdpa_function(backend)
        data = self._attention_data(group)
        s = group.shape
        copies = [(data.query, data.key, data.value)] + [
            tuple(self.tensors.copy(t) for t in (data.query, data.key, data.value)) for _ in range(sets - 1)]
        if s.phase == "decode":
            # GQA folded into the query length: the group's query heads are its KV
            # head's query rows, so K/V are read once per KV head and any backend can run it.
            folded = (s.num_seqs, s.num_kv_heads, s.group, s.head_size)
            calls = [functools.partial(attend, q.reshape(folded), k, v) for q, k, v in copies]
            return self._probe(calls, backend), {"gqa": "folded into the query length"}
        causal = self._sdpa_causal(s)
        calls = [functools.partial(attend, q, k, v, **causal, enable_gqa=True) for q, k, v in copies]
        try:
            return self._probe(calls, backend), {"gqa": "enable_gqa"}
        except PeerSkipped as native:
            # This backend (or this torch) has no native GQA: repeat K/V heads, outside the timing.
            expanded = [functools.partial(attend, q, k.repeat_interleave(s.group, dim=1),
                                          v.repeat_interleave(s.group, dim=1), **causal)
                        for q, k, v in copies]
            try:
                return self._probe(expanded, backend), {"gqa": "K/V heads repeated before timing"}
            except PeerSkipped as repeated:
                raise PeerSkipped(f"{native}; with K/V heads repeated: {repeated}") from None

    def _sdpa_causal(self, shape: Shape) -> dict:
        """SDPA's causal arguments. A chunk over cached keys needs its diagonal at
        the bottom right (query i sees keys up to L - Lq + i); is_causal puts it at
        the top left, so such a chunk takes torch's lower-right causal bias."""
        if shape.query_len == shape.seq_len:
            return {"is_causal": True}
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError:
            raise PeerSkipped(f"torch {self.torch.__version__} has no lower-right causal bias "
                              "(torch.nn.attention.bias.causal_lower_right)") from None
        return {"attn_mask": causal_lower_right(shape.query_len, shape.seq_len)}

    @staticmethod
    def _probe(calls: list, backend: str) -> list:
        """The calls, if the backend runs them; PeerSkipped with torch's reason if not."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                calls[0]()
            except (RuntimeError, TypeError) as error:
                why = "; ".join(str(w.message).splitlines()[0] for w in caught[:2])
                because = f" ({why})" if why else ""
                raise PeerSkipped(f"SDPA {backend}: {_error_text(error)}{because}") from None
        return calls

    def _copy(self, moved_bytes: int, sets: int) -> list:
        size = moved_bytes // 2
        calls = []
        for _ in range(sets):
            source = self.cupy.empty(size, self.cupy.uint8)
            target = self.cupy.empty(size, self.cupy.uint8)
            calls.append(functools.partial(target.data.copy_from_device_async, source.data, size))
        return calls

    def _stream(self, group: Group, case: Case, sets: int) -> tuple[list, dict]:
        cupy = self.cupy
        s = group.shape
        data = self._attention_data(group)
        kernel = self.jit.get_function("stream_pages", "stream_pages", stream_defines(
            s.num_kv_heads, s.head_size, case.kv_dtype, self.model_dtype))
        block_table = cupy.asarray(data.block_table)
        seq_lens = cupy.full(s.num_seqs, s.seq_len, cupy.int32)
        calls = []
        for cache in self._group_caches(group, case.kv_dtype, sets, written=False):
            arrays = kvcupy.cache_arrays(cache)
            tensors = [arrays.key_cache, arrays.value_cache, arrays.k_scale_cache, arrays.v_scale_cache]
            if not all(t is None or (t.flags.c_contiguous and t.data.ptr % 16 == 0) for t in tensors):
                raise RuntimeError("stream_pages reads page-major, contiguous, 16-byte aligned caches")
            key, value, k_scale, v_scale = (t if t is not None else arrays.key_cache for t in tensors)
            out = cupy.empty((s.num_seqs, case.splits), cupy.uint32)
            args = (key, value, k_scale, v_scale, block_table, seq_lens, out,
                    np.int32(block_table.shape[1]), np.int32(data.num_blocks))
            calls.append(functools.partial(kernel, (case.splits, s.num_seqs), (STREAM_THREADS,), args))
        return calls, {}

    def _write(self, shape: WriteShape, kv_dtype: str, sets: int) -> list:
        pages = math.ceil(shape.num_tokens / BLOCK_SIZE)
        page_order = np.random.default_rng(SEED).permutation(pages)
        positions = np.arange(shape.num_tokens)
        slots = kvcupy.plan_slots(page_order[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
                                  num_slots=pages * BLOCK_SIZE)
        calls = []
        for index in range(sets):
            kv_shape = (shape.num_tokens, shape.num_kv_heads, shape.head_size)
            key = self.tensors.randn(kv_shape, SEED + 2 * index)
            value = self.tensors.randn(kv_shape, SEED + 2 * index + 1)
            cache = kvcupy.allocate_cache(pages, BLOCK_SIZE, shape.num_kv_heads, shape.head_size,
                                          kv_dtype=kv_dtype, device="cuda", dtype=self.model_dtype.name)
            calls.append(functools.partial(kvcupy.reshape_and_cache, key, value, cache, slots))
        return calls

    def _rotate(self, shape: RotateShape, sets: int) -> tuple[list, dict]:
        plan = kvcupy.rotation_plan(shape.head_size, "blockdiag")
        calls = [functools.partial(kvcupy.rotate, self.tensors.randn((shape.num_vectors, shape.head_size),
                                                                     SEED + index), plan)
                 for index in range(sets)]
        return calls, {"rotation": plan.describe()}

    # Timing.

    def warm_up(self, calls: list, warmup: int) -> tuple[float, float]:
        for index in range(max(1, warmup)):
            calls[index % len(calls)]()
        self.stream.synchronize()
        begin = time.perf_counter()
        for index in range(HOST_PROBE_CALLS):
            calls[index % len(calls)]()
        host_ms = (time.perf_counter() - begin) * 1e3 / HOST_PROBE_CALLS
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record(self.stream)
        calls[0]()
        end.record(self.stream)
        end.synchronize()
        return self.cupy.cuda.get_elapsed_time(start, end), host_ms

    def time(self, calls: list, count: int, host_ms: float) -> Timing:
        cuda = self.cupy.cuda
        events = [(cuda.Event(), cuda.Event()) for _ in range(count)]
        self.stream.synchronize()
        hold_s = hold_seconds(count * host_ms * 1e-3)
        self.hold((1,), (1,), (np.uint64(int(hold_s * 1e9)),))
        for index, (start, end) in enumerate(events):
            start.record(self.stream)
            calls[index % len(calls)]()
            end.record(self.stream)
        events[-1][1].synchronize()
        ms = [cuda.get_elapsed_time(start, end) for start, end in events]
        idle = sum(cuda.get_elapsed_time(events[i][1], events[i + 1][0]) for i in range(count - 1))
        return Timing(ms, idle)

    def end_group(self) -> None:
        self._attention = None
        self._caches.clear()
        self._written.clear()
        self.stream.synchronize()
        self.cupy.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()


# --- tables -------------------------------------------------------------------

def _number(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _shown(records: list[dict]) -> list[dict]:
    """Timed records, the streaming kernel at its fastest split count only."""
    shown = []
    for record in records:
        if record["status"] != "ok":
            continue
        if record["impl"] == "stream" and record is not _fastest(records, "stream", record["kv_dtype"]):
            continue
        shown.append(record)
    return shown


def tables(report: dict) -> RichGroup:
    """One table per group, then the targets; the same numbers as --json."""
    device = report["device"]
    header = (f"kvcupy bench: {device['name']} ({device['arch']}, {device['sms']} SMs, "
              f"L2 {device['l2_bytes'] / 2**20:.0f} MiB), {report['model_dtype']} inputs, block size "
              f"{report['block_size']}; median of CUDA-event times over {report['timing']['rounds']} rounds. "
              "TB/s: bytes the case must read and write / time. vs SDPA: SDPA time / kvcupy time "
              "(> 1: kvcupy faster); vs copy, vs stream: kvcupy TB/s / theirs. host ms: the host's "
              f"time to issue one call ({HOST_PROBE_CALLS} calls after warm-up), which the GPU times leave "
              "out: where it exceeds ms, eager calls wait on the host.")
    parts: list[Any] = [header]
    columns = ("case", "ms", "TB/s", "TFLOP/s", "vs SDPA", "vs copy", "vs stream", "host ms")
    for group in report["groups"]:
        rows = [(record["name"], _number(record["median_ms"], ".3f"), _number(record["tb_per_s"], ".2f"),
                 _number(record["tflop_per_s"], ".1f"), _number(record.get("speedup_vs_sdpa"), ".2f", "x"),
                 _number(record.get("bandwidth_vs_copy"), ".0%"),
                 _number(record.get("bandwidth_vs_stream"), ".0%"), _number(record.get("host_ms"), ".3f"))
                for record in _shown(group["cases"])]
        # A column no case of the group fills (TFLOP/s of a copy group, vs stream of prefill) is left out.
        kept = [i for i, column in enumerate(columns) if i < 3 or any(row[i] != "-" for row in rows)]
        table = Table(title=group["label"] + ("  (sweep)" if group["sweep"] else ""), title_justify="left",
                      show_edge=False, pad_edge=False, caption_justify="left")
        for i in kept:
            table.add_column(columns[i], justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*(row[i] for i in kept))
        missing = [f"{r['name']}: {r['status']} ({r['reason']})"
                   for r in group["cases"] if r["status"] != "ok"]
        if missing:
            table.caption = "; ".join(missing)
        parts.append(table)
    if report["targets"]:
        targets = Table(title="targets (issue 8, H200)", title_justify="left", show_edge=False,
                        pad_edge=False)
        for column in ("target", "measured", "bound", "met"):
            targets.add_column(column, justify="left" if column == "target" else "right")
        verdicts = {True: "[bold green]yes[/]", False: "[bold red]no[/]", None: "-"}
        for target in report["targets"]:
            targets.add_row(target["target"], _number(target["measured"], ".2f"), f"{target['bound']:.2f}",
                            verdicts[target["met"]])
        parts.append(targets)
    return RichGroup(*parts)


# --- kvcupy check -------------------------------------------------------------

def kernel_specialisations(all: bool) -> list[tuple[str, tuple[str, ...], dict]]:
    """(entry, kernels, defines) of the bench's own kernels, as `kvcupy check` lists
    them (kvcupy.backends.cuda_specs): the full run's geometries, and the quick
    run's too with all=True. The model dtype only sizes an "auto" row, where
    bf16 and fp16 agree."""
    geometries = {(s.num_kv_heads, s.head_size) for s in FULL_SIZES.decode}
    if all:
        geometries |= {(s.num_kv_heads, s.head_size) for s in QUICK_SIZES.decode}
    bf16 = formats.MODEL_DTYPES["bfloat16"]
    defines = {tuple(sorted(stream_defines(heads, head_size, kv_dtype, bf16).items()))
               for heads, head_size in geometries for kv_dtype in ALL_KV_DTYPES}
    return [("hold_stream", ("hold_stream",), {})] + [
        ("stream_pages", ("stream_pages",), dict(d)) for d in sorted(defines)]
