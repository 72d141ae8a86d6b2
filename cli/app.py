"""The `kvcupy` command line: parse options, run a command's module, print its report.

Reports go to stdout, as rich tables or, with --json, as one JSON object and
nothing else; progress goes to stderr (a bar on a terminal, else status
lines). Exit status: 0 when every check passed, 1 when a check failed, 2 for
a usage error (including a backend that cannot run here).
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console, RenderableType
from typer.core import TyperCommand, TyperGroup

import kvcupy
from kvcupy.backends import BackendUnavailable, names as backend_names, resolve as resolve_backend
from kvcupy.formats import QUANTIZED_KV_DTYPES
from kvcupy.rotation import RotationPlan, check_head_size

from . import bench as bench_module
from kvcupy import bench as bench_cuda
from . import check as check_module
from . import plot as plot_module
from . import render
from .info import collect_info
from .repro import ReproConfig, run_repro, total_steps


def _flags_without_type(params: list) -> list:
    """A flag takes no value, so --help gives it no type column (typer 0.29 labels each `<bool>`)."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))


# Markdown mode: typer's "rich" mode keeps the hard line breaks of a docstring in the
# command list and in every paragraph after the first; Markdown reflows them.
app = typer.Typer(help="kvcupy: quantized (INT4 / INT8 / FP8) paged KV caches for LLM inference.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode="markdown", cls=_Group)


# The registry's backends (kvcupy.backends), plus "auto".
Backend = Enum("Backend", {name: name for name in ("auto",) + backend_names()}, type=str)


class Rotation(str, Enum):
    blockdiag = "blockdiag"
    kron = "kron"
    none = "none"


class KvDtype(str, Enum):
    all = "all"
    quantized = "quantized"
    int4_per_token_head = "int4_per_token_head"
    int8_per_token_head = "int8_per_token_head"
    fp8_per_token_head = "fp8_per_token_head"
    auto = "auto"


class Phase(str, Enum):
    all = "all"
    decode = "decode"
    prefill = "prefill"


# What `--kv-dtype all` and `--kv-dtype quantized` stand for, in every command. repro's
# default is quantized: auto's check costs one more float64 oracle pass, about a fifth of
# the run, and shows no more than float16 rounding of the rotated vectors.
KV_DTYPE_GROUPS = {KvDtype.all: QUANTIZED_KV_DTYPES + ("auto",), KvDtype.quantized: QUANTIZED_KV_DTYPES}
KV_DTYPE_GROUPS_HELP = "all: int4, int8, fp8 and auto (float16, unquantized); quantized: the first three."
BACKEND_HELP = "auto: a GPU backend when one is usable, else cpu. `kvcupy info` lists what is usable here."
JSON_HELP = "Print one JSON object on stdout instead of tables."


def _parse_choice(choices: type[Enum], value: Any) -> Enum:
    if isinstance(value, choices):
        return value
    try:
        return choices(value)
    except ValueError:
        expected = ", ".join(repr(choice.value) for choice in choices)
        raise typer.BadParameter(f"{value!r} is not one of {expected}.") from None


def choice_option(default: Enum, help: str) -> Any:
    """A typer.Option taking one of the values of `default`'s Enum; the command gets the Enum.

    The option is a plain string that kvcupy's own callback checks and converts:
    typer's Enum options behave differently across versions (0.29 checks choices
    inside a pydantic validator, whose message starts with "Value error, "; 0.27
    handed a custom parser's result over as None). The metavar spaces out its
    `|`s because rich folds the help's type column inside a word when no space
    lets it wrap between choices.
    """
    choices = type(default)

    def to_choice(value: str) -> Enum:   # typer reads a callback's signature: no partial
        return _parse_choice(choices, value)

    return typer.Option(default.value, help=help, callback=to_choice,
                        metavar="<" + " | ".join(choice.value for choice in choices) + ">")


def int_option(default: int | None, help: str, minimum: int | None = None,
               maximum: Callable[[], int] | None = None) -> Any:
    """A typer.Option taking an integer; the command gets an int (or None, the default).

    Like choice_option, a plain string that kvcupy's callback converts, so that a
    bad value is named as the user typed it (typer 0.29's pydantic message does not
    repeat it). maximum: called when a value is checked (e.g. Numba's thread count).
    """
    def to_int(value: str | int | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        try:
            number = int(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not an integer.") from None
        if minimum is not None and number < minimum:
            raise typer.BadParameter(f"{value!r} is below {minimum}, the least it takes.")
        if maximum is not None and number > maximum():
            raise typer.BadParameter(f"{value!r} is above {maximum()}, the most it takes here.")
        return number

    metavar = "<int>" if minimum is None else f"<int, at least {minimum}>"
    return typer.Option(default, help=help, callback=to_int, metavar=metavar)


def _given_options(ctx: typer.Context, *names: str) -> list[str]:
    """The options among `names` (parameter names) that the user set, spelt as on the command line."""
    def given(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
    return [f"'--{name.replace('_', '-')}'" for name in names if given(name)]


def _rotation_plan(ctx: typer.Context, head_size: int, rotation: Rotation) -> RotationPlan:
    """The plan, or a usage error that blames only options the user gave."""
    try:
        check_head_size(head_size)   # even, 32..256 (docs/format.md), whatever the rotation
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="'--head-size'") from None
    try:
        return kvcupy.rotation_plan(head_size, rotation.value)
    except ValueError as error:
        # The pair does not fit (kron needs d = m * 2^k): blame whichever of the two was chosen.
        culprits = _given_options(ctx, "head_size", "rotation") or ["'--head-size'", "'--rotation'"]
        raise typer.BadParameter(str(error), param_hint=" / ".join(culprits)) from None


def _device(backend: Backend) -> str:
    try:
        return resolve_backend(backend.value)
    except BackendUnavailable as error:
        raise typer.BadParameter(str(error), param_hint="'--backend'") from None


def _kv_dtypes(kv_dtype: KvDtype) -> tuple[str, ...]:
    return KV_DTYPE_GROUPS.get(kv_dtype, (kv_dtype.value,))


def _print_report(report: dict, as_json: bool, render_report: Callable[[dict], RenderableType]) -> None:
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        Console().print(render_report(report))


@app.command(cls=_Command)
def repro(
    ctx: typer.Context,
    head_size: str = int_option(96, help="Head size d (even, 32..256); 96 is Phi-3-mini's."),
    kv_dtype: str = choice_option(KvDtype.quantized, help="KV dtypes to check; " + KV_DTYPE_GROUPS_HELP),
    rotation: str = choice_option(Rotation.blockdiag, help="Rotation applied before quantizing."),
    backend: str = choice_option(Backend.auto, help=BACKEND_HELP),
    prompt_len: str = int_option(512, minimum=1, help="Prompt tokens (one prefill call)."),
    decode_steps: str = int_option(32, minimum=0, help="Decode steps after the prompt, one token each."),
    seed: str = int_option(0, help="Seed of the synthetic Q/K/V."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Check a head size end to end: rotation, format error and implementation error of each KV dtype.

    Runs a Phi-3-mini-like attention layer (32/32 heads, block size 16) through
    PagedKVCache on synthetic K with outlier channels, and checks the rotation,
    the attention error of each KV dtype against float64, and the
    implementation against the oracle on the same cache. Exit status 0 only if
    every check passes. A first run on the CPU compiles kvcupy's kernels (Numba),
    once: it says so while it does.
    """
    plan = _rotation_plan(ctx, head_size, rotation)   # a usage error before any backend is probed
    device = _device(backend)
    config = ReproConfig(head_size=head_size, kv_dtypes=_kv_dtypes(kv_dtype),
                         rotation=plan, backend=device, prompt_len=prompt_len,
                         decode_steps=decode_steps, seed=seed)
    with render.progress_display(total_steps(config), Console(stderr=True)) as display, \
            render.announcing_compiles(display):
        report = run_repro(config, display.advance)
    _print_report(report, as_json, render.repro_tables)
    raise typer.Exit(0 if report["passed"] else 1)


@app.command(cls=_Command)
def bench(
    ctx: typer.Context,
    backend: str = choice_option(Backend.auto, help=BACKEND_HELP),
    kv_dtype: str = choice_option(KvDtype.all, help="KV dtypes to time; " + KV_DTYPE_GROUPS_HELP),
    phase: str = choice_option(Phase.all, help="Decode (8 seqs x 4096 tokens), prefill (1 x 2048, "
                                 "causal) or both."),
    repeats: str = int_option(9, minimum=1, help="Timed calls per decode case, over all rounds (the "
                              "median is reported)."),
    prefill_repeats: str = int_option(3, minimum=1, help="Timed calls per prefill case (each takes seconds)."),
    rounds: str = int_option(3, minimum=1, help="Rounds; each times the baseline, then every KV dtype."),
    warmup: str = int_option(1, minimum=0, help="Untimed calls before a case's timed calls in a round "
                             "(and at least 0.3 s of them)."),
    threads: str | None = int_option(None, minimum=1, maximum=bench_module.default_threads,
                                     help="CPU only: threads for both sides, kvcupy's Numba kernels and "
                                     "NumPy's BLAS (pinned with threadpoolctl) [default: as many as Numba "
                                     "runs, every core unless NUMBA_NUM_THREADS says fewer]."),
    quick: bool = typer.Option(False, help="Small shapes (2 x 256 decode, 1 x 128 prefill; 8/2 heads)."),
    groups: str | None = typer.Option(None, help="CUDA only: case groups to time, comma-separated, of "
                                      "decode, sweep, prefill, prefill_sweep, write, rotate (default: those "
                                      "of --phase), and step (whole models' decode steps, eager and "
                                      "graphed, against dense bf16: only when named)."),
    plot: Path | None = typer.Option(None, help="CUDA only: draw decode bandwidth against context length, "
                                     "with the measured copy line, prefill TFLOP/s against prompt "
                                     "length and the step group's tokens/s against batch, to this PNG "
                                     "(needs matplotlib: pip install 'kvcupy[plot]')."),
    time_limit: str | None = int_option(None, minimum=1, help="CUDA only: seconds after which no further "
                                        "group starts; the report lists the groups left out, so a run "
                                        "cut short still reports what it timed."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Time paged decode and prefill for each KV dtype against NumPy dense attention.

    The layer is Llama-3-8B-like (32/8 heads, d = 128); the baseline is NumPy
    float32 dense attention on already-dequantized K/V, timed in the same run,
    both sides on the same number of threads (--threads; the report says how
    many). It warns when the machine's load average is above its core count:
    timings shared with other programs say little. A first run compiles
    kvcupy's kernels, once, and says so while it does.

    With --backend cuda, decode, prefill, the write path and rotate run against
    torch SDPA in bf16, a device-to-device copy of the same bytes and a kernel
    that only streams the same pages, timed with CUDA events; counts not given
    take the CUDA defaults (30 timed calls a case, 10 for prefill, 5 warm-up
    calls).
    """
    device = _device(backend)
    if device == "cuda":
        if _given_options(ctx, "threads"):
            raise typer.BadParameter("only with --backend cpu (this run uses cuda)", param_hint="'--threads'")
        _bench_cuda(ctx, kv_dtype, phase, groups, quick, plot, as_json)
        return
    cuda_only = _given_options(ctx, "groups", "plot", "time_limit")
    if cuda_only:
        raise typer.BadParameter(f"only with --backend cuda (this run uses {device})",
                                 param_hint=" / ".join(cuda_only))
    shapes = tuple(shape for shape in (bench_module.QUICK_SHAPES if quick else bench_module.FULL_SHAPES)
                   if phase is Phase.all or shape.phase == phase.value)
    kv_dtypes = _kv_dtypes(kv_dtype)
    repeats_by_phase = {"decode": repeats, "prefill": prefill_repeats}
    steps = bench_module.total_steps(shapes, kv_dtypes, repeats_by_phase, rounds)
    threads = threads or bench_module.default_threads()
    load = bench_module.load_average()
    stderr = Console(stderr=True)
    stderr.print(f"timing on {threads} thread(s), kvcupy and NumPy alike", markup=False, highlight=False)
    warning = bench_module.busy_machine_warning(load, os.cpu_count() or 1)
    if warning:
        stderr.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
    with render.progress_display(steps, stderr) as display, render.announcing_compiles(display):
        report = bench_module.run_bench(shapes, kv_dtypes, device, warmup, repeats_by_phase, rounds,
                                        display.advance, threads, load)
    _print_report(report, as_json, render.bench_tables)


def _bench_cuda(ctx: typer.Context, kv_dtype: KvDtype, phase: Phase, groups: str | None, quick: bool,
                plot: Path | None, as_json: bool) -> None:
    """`bench` on CUDA: counts the user did not give take bench_cuda's defaults."""
    counts = {name: ctx.params[name] for name in ("repeats", "prefill_repeats", "rounds", "warmup")
              if _given_options(ctx, name)}
    try:
        config = bench_cuda.make_config(phase.value, groups, _kv_dtypes(kv_dtype), quick, **counts,
                                        time_limit_s=ctx.params["time_limit"])
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="'--groups'") from None
    if plot is not None:   # before the run, not after it
        if not any(group.kind in ("decode", "step") or group.sweep for group in config.groups):
            raise typer.BadParameter("it draws the decode and prefill sweeps and the step group, and these "
                                     "groups time none of them (add sweep, prefill_sweep or step to --groups)",
                                     param_hint="'--plot'")
        try:
            plot_module.require_matplotlib()
        except ImportError as error:
            raise typer.BadParameter(str(error), param_hint="'--plot'") from None
    with render.progress_display(bench_cuda.total_steps(config), Console(stderr=True)) as display:
        report = bench_cuda.run_bench(config, bench_cuda.CudaRunner(), display.advance, display.status)
    _print_report(report, as_json, bench_cuda.tables)
    if plot is not None:
        try:
            written = plot_module.plot_report(report, plot)
        except ValueError as error:   # every case of both sweeps failed or was skipped
            Console(stderr=True).print(f"no plot: {error}", markup=False, highlight=False)
            raise typer.Exit(1) from None
        Console(stderr=True).print(f"plot: {written}", markup=False, highlight=False)


@app.command(cls=_Command)
def info(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """Versions of kvcupy and its dependencies, and which backends are usable here (and why not)."""
    report = collect_info()
    _print_report(report, as_json, render.info_tables)


app.command(name="check", cls=_Command)(check_module.check)
