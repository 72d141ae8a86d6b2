"""`kvcupy check`: compile the CUDA specialisations kvcupy can launch, without a GPU.

What to compile comes from `kvcupy.backends.cuda.specs` (a sample, or --all);
each is built through NVRTC for each --arch and reported with the registers
and spills ptxas logged. A specialisation that does not compile, or whose
module lacks a kernel its launcher asks for, fails the check (exit status 1)
and its NVRTC log is printed.
"""

from __future__ import annotations

import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvcupy import jit
from kvcupy.backends.cuda.specs import Specialisation, specialisations

from . import render

DEFAULT_ARCHES = "sm_80,sm_89,sm_90"
ARCH_PATTERN = re.compile(r"sm_(\d+)a?")


def parse_arches(text: str) -> list[str]:
    """'sm_80,sm_90' -> ['sm_80', 'sm_90'], each one NVRTC can target."""
    from cupy.cuda import nvrtc
    supported = set(nvrtc.getSupportedArchs())
    arches = [arch.strip() for arch in text.split(",") if arch.strip()]
    for arch in arches:
        found = ARCH_PATTERN.fullmatch(arch)
        if found is None or int(found.group(1)) not in supported:
            raise typer.BadParameter(f"{arch!r} is not an arch this NVRTC targets; it targets "
                                     + ", ".join(f"sm_{n}" for n in sorted(supported)) + ".",
                                     param_hint="'--arch'")
    if not arches:
        raise typer.BadParameter("no arch given", param_hint="'--arch'")
    return arches


def select(specs: list[Specialisation], kernels: str | None, defines: list[str]) -> list[Specialisation]:
    """The specialisations with one of `kernels` (comma-separated function names;
    None: any) whose defines hold every NAME=VALUE of `defines`: those of one
    model's head size, say, to fill a compile cache ahead of a run."""
    if kernels is not None:
        wanted = {name.strip() for name in kernels.split(",") if name.strip()}
        known = {function for spec in specs for function in spec.functions}
        if not wanted or wanted - known:
            raise typer.BadParameter(f"{sorted(wanted - known) or kernels!r}: not kernels of these specialisations; "
                                     f"they have {', '.join(sorted(known))}", param_hint="'--kernel'")
        specs = [spec for spec in specs if wanted & set(spec.functions)]
    for text in defines:
        name, equals, value = text.partition("=")
        if not (equals and name.strip() and value.strip()):
            raise typer.BadParameter(f"{text!r} is not NAME=VALUE", param_hint="'--define'")
        specs = [spec for spec in specs if jit.define_values(spec.defines).get(name.strip(), ...) == value.strip()]
    if not specs:
        raise typer.BadParameter("no specialisation has those kernels and defines", param_hint="'--define'")
    return specs


def _stable_key(spec: Specialisation) -> tuple:
    return spec.entry, spec.functions, tuple(sorted(jit.define_values(spec.defines).items())), spec.arch or ""


def drawn(every: list[Specialisation], count: int, seed: str) -> list[Specialisation]:
    """`count` specialisations of `every` drawn at random, the same ones for the same
    seed on any machine (the list is put in a fixed order first)."""
    ordered = sorted(every, key=_stable_key)
    return random.Random(seed).sample(ordered, min(count, len(ordered)))


def sampled(count: int, seed: str) -> list[Specialisation]:
    """The representative sample (every kernel family and KV dtype, each code path
    once) and `count` more drawn from every specialisation, each once."""
    chosen, seen = [], set()
    for spec in specialisations(False) + drawn(specialisations(True), count, seed):
        key = _stable_key(spec)
        if key not in seen:
            seen.add(key)
            chosen.append(spec)
    return chosen


def _compile_one(spec: Specialisation, arch: str) -> tuple[list[dict], dict | None]:
    """(one row per kernel, failure or None) of one specialisation on one arch."""
    defines = jit.define_values(spec.defines)
    try:
        result = jit.compile_entry(spec.entry, spec.defines, arch)
    except jit.CompileError as error:
        return [], {"entry": spec.entry, "arch": arch, "defines": defines, "key": error.key, "log": error.log}
    rows, missing = [], []
    for function in spec.functions:
        if function not in result.registers:
            missing.append(function)
            continue
        rows.append({"key": result.key, "entry": spec.entry, "function": function, "arch": arch,
                     "seconds": round(result.seconds, 3), "registers": result.registers[function],
                     "spills": result.spills[function], "cached": result.cached, "defines": defines})
    failure = None
    if missing:
        failure = {"entry": spec.entry, "arch": arch, "defines": defines, "key": result.key,
                   "log": f"kernels missing from the module (not extern \"C\"?): {', '.join(missing)}; "
                          f"it has: {', '.join(result.registers) or 'none'}"}
    return rows, failure


def run_check(arches: list[str], specs: list[Specialisation], jobs: int,
              advance: Callable[[str], None] = lambda description: None) -> dict:
    """Compile every specialisation for every arch, `jobs` at a time (NVRTC compiles
    distinct programs concurrently, and CuPy's binding releases the GIL around it)."""
    work = [(spec, spec.target(arch)) for arch in arches for spec in specs if spec.target(arch)]

    def compile_and_report(item):
        outcome = _compile_one(*item)
        advance(f"{item[0].entry} {item[1]}")
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        outcomes = list(pool.map(compile_and_report, work))
    rows = [row for found, _ in outcomes for row in found]
    failures = [failure for _, failure in outcomes if failure is not None]
    return {"arches": arches, "nvrtc_version": ".".join(map(str, jit.nvrtc_version())),
            "source_dir": str(jit.source_dir()), "cache_dir": str(jit.cache_dir()),
            "specialisations": len(work), "results": rows, "failures": failures, "passed": not failures}


def check_tables(report: dict) -> Group:
    table = Table(title=f"kvcupy check: {report['specialisations']} specialisation(s) x arch, NVRTC "
                        f"{report['nvrtc_version']}, sources {report['source_dir']}",
                  title_justify="left", show_edge=False, pad_edge=False)
    # fold, not ellipsis: a key is only useful whole (it names the cubin in the cache).
    for column in ("key", "function"):
        table.add_column(column, overflow="fold")
    table.add_column("arch")
    for column in ("seconds", "registers", "spills"):
        table.add_column(column, justify="right")
    table.add_column("cached")
    for row in report["results"]:
        table.add_row(row["key"], row["function"], row["arch"], f"{row['seconds']:.2f}",
                      str(row["registers"]), str(row["spills"]), "yes" if row["cached"] else "")
    parts = [table]
    for failure in report["failures"]:
        defines = " ".join(f"{name}={value}" for name, value in failure["defines"].items())
        parts.append(f"[bold red]FAIL[/] {failure['key']} ({defines}):")
        parts.append(Text(failure["log"]))   # a log, not rich markup: its [..] must print as they are
    verdict = "[bold green]PASS[/]" if report["passed"] else f"[bold red]FAIL[/]: {len(report['failures'])} failed"
    parts.append(f"seconds: NVRTC time of the build (cached: built earlier, found in {report['cache_dir']}). "
                 f"{verdict}")
    return Group(*parts)


def check(
    arch: str = typer.Option(DEFAULT_ARCHES, help="Comma-separated archs to compile for (sm_XY)."),
    all_specs: bool = typer.Option(False, "--all", help="Every specialisation the library can launch, "
                                   "not a representative sample."),
    sample: int = typer.Option(0, min=0, help="Besides the representative sample, this many "
                               "specialisations drawn at random from --all's."),
    seed: str = typer.Option("0", help="Seed of --sample's draw (e.g. a commit id: each commit "
                             "checks other builds, reproducibly)."),
    kernels: str | None = typer.Option(None, "--kernel", help="Only specialisations with one of these "
                                       "kernels (comma-separated, e.g. prefill_attention,paged_attention)."),
    defines: list[str] = typer.Option([], "--define", help="Only specialisations built with NAME=VALUE "
                                      "(repeatable, e.g. KVC_HEAD_PAD=128)."),
    jobs: int = typer.Option(os.cpu_count() or 1, min=1, help="Compiles at a time (default: the CPU count)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables."),
) -> None:
    """Compile the CUDA kernels kvcupy can launch, through NVRTC, without a GPU.

    Prints each specialisation's key, arch, compile seconds, registers and
    spills (from ptxas). Compiled cubins land in the compile cache, so a later
    run on a GPU of that arch loads them: with --kernel and --define (and the
    GPU's NVRTC major.minor, which is in the key), a machine without a GPU can
    fill a cache for one model's builds ahead of a run. Exit status 1 if any fails to compile
    (its NVRTC log is printed); 2 if NVRTC is not installed (the cuda13 extra).
    """
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as error:   # CuPy raises more than ImportError when NVRTC is missing
        # soft_wrap: one line however narrow the console, so that the message reads whole in a log.
        Console(stderr=True).print(f"kvcupy check needs CuPy and NVRTC (pip install 'kvcupy[cuda13]'): {error}",
                                   markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    arches = parse_arches(arch)
    if all_specs and sample:
        raise typer.BadParameter("--all compiles every specialisation already; --sample adds to the "
                                 "representative one", param_hint="'--sample'")
    specs = select(specialisations(True) if all_specs else sampled(sample, seed), kernels, defines)
    with render.progress_display(len(specs) * len(arches), Console(stderr=True)) as display:
        report = run_check(arches, specs, jobs, display.advance)
    report["all"] = all_specs
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        console = Console()
        if not console.is_terminal:   # a CI log: whole keys on one line each, not folded into 80 columns
            console = Console(width=160)
        console.print(check_tables(report))
    raise typer.Exit(0 if report["passed"] else 1)
