"""Everything the commands draw on the terminal: rich tables of their reports, and their progress.

Each function takes the JSON-ready report a command builds, so the table and
`--json` always show the same numbers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _verdict(passed: bool) -> str:
    return "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"


@dataclass(frozen=True)
class ProgressDisplay:
    """advance(description): one unit of work is done, `description` names it.
    status(description): what runs now, when it may run long (it does not advance).
    note(text): a line that stays, above the bar on a terminal."""

    advance: Callable[[str], None]
    status: Callable[[str], None]
    note: Callable[[str], None]


@contextmanager
def progress_display(total: int, console: Console) -> Iterator[ProgressDisplay]:
    """A transient bar (gone when done) on a terminal. Elsewhere (a log, a pipe,
    CI) no bar, but each status is printed as a line of its own, so that a
    long quiet step, such as compiling kernels, is explained where it happens."""
    def line(text: str) -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    if not console.is_terminal:
        yield ProgressDisplay(advance=lambda description: None, status=line, note=line)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=total)
        yield ProgressDisplay(
            advance=lambda description: progress.update(task, advance=1, description=description),
            status=lambda description: progress.update(task, description=description),
            note=line)


def first_compile_note(cache_dir: str | None) -> str:
    """What a user waits for while kvcupy's CPU kernels compile, and why only once."""
    kept = (f"later runs load them from {cache_dir}" if cache_dir else
            "no cache folder can be written here (set KVCUPY_CACHE_DIR), so every run compiles them")
    return ("Compiling kvcupy's CPU kernels (Numba; rotation, quantization, paged attention): "
            "a first run does this once, usually in about a minute on 2 cores (longer on a busy "
            f"machine); {kept}.")


@contextmanager
def announcing_compiles(display: ProgressDisplay) -> Iterator[None]:
    """While the block runs, say so when one of kvcupy's CPU kernels compiles: a note
    the first time, then the kernel's name as the status. A run that finds them
    compiled (in this process, or in the cache on disk) says nothing."""
    from kvcupy.backends import cpu, cpu_kernels

    noted = []

    def report(kernel: str) -> None:
        if not noted:
            display.note(first_compile_note(cpu_kernels.CACHE_DIR))
            noted.append(kernel)
        display.status(f"compiling {kernel} (first run only)")

    with cpu.reporting_compiles(report):
        yield


def repro_tables(report: dict) -> Group:
    rotation = report["rotation"]
    title = (f"kvcupy repro: head size {report['head_size']}, {report['num_heads']}/"
             f"{report['num_kv_heads']} query/KV heads, block size {report['block_size']}, "
             f"{report['prompt_len']} prompt + {report['decode_steps']} decode tokens, "
             f"backend {report['backend']}, seed {report['seed']}")
    plan = (f"rotation {rotation['kind']}: {rotation['plan']}; rotate + inverse in float32: "
            f"rel. err {rotation['roundtrip_rel_err']:.1e} (bound {rotation['roundtrip_bound']:.0e}) "
            f"{_verdict(rotation['passed'])}")
    impl_bound = report["results"][0]["impl_rel_err_bound"]
    results = Table(show_edge=False, pad_edge=False, caption_justify="left", caption=(
        "attn err: against float64 attention on the original K/V; impl err: against the float64 "
        f"oracle on the same cache (bound {impl_bound:.0e}); rel. err = ||out - ref|| / ||ref|| "
        "over all prefill and decode outputs; bytes: one token's K and V in one layer, scales "
        "included"))
    results.add_column("KV dtype", no_wrap=True)
    for column in ("attn err", "bound", "impl err", "bytes", "vs fp16", "check"):
        results.add_column(column, justify="right")
    for result in report["results"]:
        results.add_row(result["kv_dtype"], f"{result['attn_rel_err_vs_fp64']:.2e}",
                        f"{result['attn_rel_err_bound']:.2e}", f"{result['impl_rel_err_vs_oracle']:.1e}",
                        str(result["bytes_per_token"]), f"{result['bytes_vs_fp16']:.2f}x",
                        _verdict(result["passed"]))
    summary = "every check passed" if report["passed"] else "some checks failed"
    return Group(title, plan, results, f"{_verdict(report['passed'])}: {summary}")


def info_tables(info: dict) -> Group:
    versions = Table(title="kvcupy info", title_justify="left")
    versions.add_column("package")
    versions.add_column("version")
    for package, version in info["versions"].items():
        versions.add_row(package, version)
    backends = Table()
    for column in ("backend", "usable", "detail"):
        backends.add_column(column)
    for status in info["backends"]:
        usable = "[green]yes[/]" if status["usable"] else "[red]no[/]"
        backends.add_row(status["name"], usable, status["detail"])
    return Group(versions, backends)


def bench_tables(report: dict) -> Group:
    """One table per benchmark shape (phase), its NumPy baseline in the title."""
    blas = ", ".join(f"{pool['library']} {pool['num_threads']}" for pool in report["blas"]) or "none found"
    load = "unknown" if report["load_average"] is None else f"{report['load_average']:.2f}"
    header = (f"kvcupy bench: backend {report['backend']}, {report['model_dtype']} inputs, "
              f"block size {report['block_size']}, median of repeated calls over {report['rounds']} "
              "interleaved rounds; speedup = NumPy "
              "float32 dense attention on already-dequantized K/V / kvcupy (> 1: kvcupy faster)\n"
              f"threads: {report['threads']} on both sides (kvcupy's Numba kernels; NumPy's BLAS, pinned "
              f"with threadpoolctl: {blas}); {report['cores']} cores, load average {load} at the start")
    tables = {}
    for case in report["cases"]:
        if case["phase"] not in tables:
            causal = ", causal" if case["phase"] == "prefill" else ""
            title = (f"{case['phase']}: {case['num_seqs']} seq x {case['seq_len']} tokens{causal}, "
                     f"{case['num_heads']}/{case['num_kv_heads']} heads, d = {case['head_size']}; "
                     f"numpy {1e3 * case['baseline_median_s']:.2f} ms")
            table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
            for column in ("KV dtype", "rotation", "kvcupy ms", "speedup", "cache GB/s"):
                table.add_column(column, justify="left" if column in ("KV dtype", "rotation") else "right")
            tables[case["phase"]] = table
        tables[case["phase"]].add_row(case["kv_dtype"], case["rotation"], f"{1e3 * case['median_s']:.2f}",
                                      f"{case['speedup_vs_baseline']:.2f}x", f"{case['cache_gb_per_s']:.2f}")
    warnings = [f"[bold yellow]warning:[/] {escape(warning)}" for warning in report["warnings"]]
    return Group(header, *tables.values(), *warnings)
