"""`kvcupy check`: compile the CUDA specialisations kvcupy can launch, without a GPU.

What to compile comes from `kvcupy.backends.cuda.specs` (a sample, or --all);
each is built through NVRTC for each --arch and reported with the registers
and spills ptxas logged. A specialisation that does not compile, or whose
module lacks a kernel its launcher asks for, fails the check (exit status 1)
and its NVRTC log is printed. AMD archs (--arch gfx90a,gfx942, alone or
mixed with sm_XY) compile `kvcupy.backends.rocm.specs`' HIP builds through
Debian's compilers (`rocm.offline`) and report the code objects' registers,
scratch and LDS.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvcupy import jit
from kvcupy.backends.cuda.specs import Specialisation, specialisations
from kvcupy.backends.rocm import offline
from kvcupy.backends.rocm.attention import ENTRY as ATTENTION_ENTRY
from kvcupy.backends.rocm.specs import hip_specialisations

HIP_ARCHES = offline.ARCHES

from . import render

DEFAULT_ARCHES = "sm_80,sm_89,sm_90"
ARCH_PATTERN = re.compile(r"sm_(\d+)a?")
HIP_ARCH_PATTERN = re.compile(r"gfx[0-9a-f]+")


def split_arches(text: str) -> tuple[list[str], list[str]]:
    """'sm_90,gfx942' -> (['sm_90'], ['gfx942']): the NVIDIA and the AMD archs, in their order."""
    arches = [arch.strip() for arch in text.split(",") if arch.strip()]
    if not arches:
        raise typer.BadParameter("no arch given", param_hint="'--arch'")
    hip = [arch for arch in arches if HIP_ARCH_PATTERN.fullmatch(arch)]
    for arch in hip:
        if arch not in HIP_ARCHES:
            raise typer.BadParameter(f"{arch!r} is not an AMD arch the HIP check builds; it builds "
                                     + ", ".join(HIP_ARCHES) + ".", param_hint="'--arch'")
    return [arch for arch in arches if arch not in hip], hip


def parse_arches(text: str) -> list[str]:
    """'sm_80,sm_90' -> ['sm_80', 'sm_90'], each one NVRTC can target."""
    from cupy.cuda import nvrtc
    supported = set(nvrtc.getSupportedArchs())
    arches = [arch.strip() for arch in text.split(",") if arch.strip()]
    for arch in arches:
        found = ARCH_PATTERN.fullmatch(arch)
        if found is None or int(found.group(1)) not in supported:
            raise typer.BadParameter(f"{arch!r} is not an arch this NVRTC targets; it targets "
                                     + ", ".join(f"sm_{n}" for n in sorted(supported))
                                     + " (and the HIP check " + ", ".join(HIP_ARCHES) + ").",
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


def sampled(count: int, seed: str, listing: Callable[[bool], list[Specialisation]] = specialisations,
            ) -> list[Specialisation]:
    """The representative sample (every kernel family and KV dtype, each code path
    once) and `count` more drawn from every specialisation, each once; `listing`:
    the specialisations (all: bool), CUDA's or HIP's."""
    chosen, seen = [], set()
    for spec in listing(False) + drawn(listing(True), count, seed):
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


def hip_sampled(all_specs: bool, count: int, seed: str) -> list[Specialisation]:
    """The HIP builds: every one (all_specs), or the sample and `count` more drawn by `seed`."""
    return hip_specialisations(True) if all_specs else sampled(count, seed, hip_specialisations)


def _compile_hip_one(spec: Specialisation, arch: str) -> tuple[list[dict], dict | None]:
    """(one row per kernel, failure or None) of one HIP build on one AMD arch."""
    defines = jit.define_values(spec.defines)
    try:
        result = offline.compile_hip(spec.entry, spec.defines, arch)
    except offline.OfflineCompileError as error:
        return [], {"entry": spec.entry, "arch": arch, "defines": defines, "key": f"{spec.entry}.hip {arch}",
                    "log": error.log}
    missing = [function for function in spec.functions if function not in result.kernels]
    rows = [{"entry": spec.entry, "function": function, "arch": arch, "seconds": round(result.seconds, 3),
             "vgprs": resources.vgprs, "agprs": resources.agprs, "sgprs": resources.sgprs,
             "scratch": resources.scratch_bytes, "spills": resources.vgpr_spills + resources.sgpr_spills,
             "lds": resources.lds_bytes, "mfma": result.instructions.get(function, {}).get("mfma", 0),
             "defines": defines}
            for function in spec.functions if (resources := result.kernels.get(function)) is not None]
    failure = None
    if missing:
        failure = {"entry": spec.entry, "arch": arch, "defines": defines, "key": f"{spec.entry}.hip {arch}",
                   "log": f"kernels missing from the code object (not extern \"C\"?): {', '.join(missing)}; "
                          f"it has: {', '.join(result.kernels) or 'none'}"}
    elif spec.entry == ATTENTION_ENTRY and not all(result.instructions[f].get("mfma") for f in spec.functions):
        # A silent scalar fallback (an arch guard that missed) must not pass.
        failure = {"entry": spec.entry, "arch": arch, "defines": defines, "key": f"{spec.entry}.hip {arch}",
                   "log": f"no v_mfma instruction in {', '.join(spec.functions)}: the attention products "
                          "did not compile to MFMA for this arch"}
    return rows, failure


def run_hip_check(arches: list[str], specs: list[Specialisation], jobs: int,
                  advance: Callable[[str], None] = lambda description: None) -> dict:
    """Compile every HIP build for every AMD arch, `jobs` compiler processes at a time."""
    work = [(spec, arch) for arch in arches for spec in specs]
    started = time.perf_counter()

    def compile_and_report(item):
        outcome = _compile_hip_one(*item)
        advance(f"{item[0].entry}.hip {item[1]}")
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:   # each compile is its own process
        outcomes = list(pool.map(compile_and_report, work))
    failures = [failure for _, failure in outcomes if failure is not None]
    return {"arches": arches, "source_dir": str(jit.hip_source_dir()), "specialisations": len(work),
            "results": [row for found, _ in outcomes for row in found], "failures": failures,
            "seconds": round(time.perf_counter() - started, 1), "passed": not failures}


def hip_check_tables(report: dict) -> Group:
    table = Table(title=f"kvcupy check (HIP): {report['specialisations']} specialisation(s) x arch, "
                        f"sources {report['source_dir']}, {report['seconds']} s",
                  title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("kernel")
    table.add_column("defines", overflow="fold")
    table.add_column("arch")
    for column in ("seconds", "VGPRs", "AGPRs", "SGPRs", "scratch", "spills", "LDS", "MFMA"):
        table.add_column(column, justify="right")
    for row in report["results"]:
        defines = " ".join(f"{name}={value}" for name, value in row["defines"].items())
        table.add_row(row["function"], defines, row["arch"], f"{row['seconds']:.2f}", str(row["vgprs"]),
                      str(row["agprs"]), str(row["sgprs"]), str(row["scratch"]), str(row["spills"]),
                      str(row["lds"]), str(row["mfma"]))
    parts = [table]
    for failure in report["failures"]:
        defines = " ".join(f"{name}={value}" for name, value in failure["defines"].items())
        parts.append(f"[bold red]FAIL[/] {failure['key']} ({defines}):")
        parts.append(Text(failure["log"]))
    verdict = "[bold green]PASS[/]" if report["passed"] else f"[bold red]FAIL[/]: {len(report['failures'])} failed"
    parts.append("per lane: VGPRs, AGPRs, SGPRs; scratch: private segment bytes (spilled registers, "
                 f"local arrays); spills: registers spilled; LDS: shared bytes a block; MFMA: v_mfma instructions in "
                 f"the code (the attention builds must have some). {verdict}")
    return Group(*parts)


def check(
    arch: str = typer.Option(DEFAULT_ARCHES, help="Comma-separated archs to compile for (sm_XY; "
                             "gfx90a and gfx942: the HIP builds, through Debian's hipcc and clang++-19)."),
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
    (its NVRTC log is printed); 2 if NVRTC is not installed (the cuda13 extra). AMD archs
    (gfx90a, gfx942) compile the HIP builds offline instead and report their VGPRs, AGPRs,
    SGPRs, scratch (spills) and LDS; 2 if a compiler they need is missing.
    """
    cuda_arches, hip_arches = split_arches(arch)
    if all_specs and sample:
        raise typer.BadParameter("--all compiles every specialisation already; --sample adds to the "
                                 "representative one", param_hint="'--sample'")
    reports = {}
    if cuda_arches:
        try:
            from cupy.cuda import nvrtc
            nvrtc.getVersion()
        except Exception as error:   # CuPy raises more than ImportError when NVRTC is missing
            # soft_wrap: one line however narrow the console, so that the message reads whole in a log.
            Console(stderr=True).print(f"kvcupy check needs CuPy and NVRTC (pip install 'kvcupy[cuda13]'): {error}",
                                       markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        arches = parse_arches(",".join(cuda_arches))
        specs = select(specialisations(True) if all_specs else sampled(sample, seed), kernels, defines)
        with render.progress_display(len(specs) * len(arches), Console(stderr=True)) as display:
            reports["cuda"] = run_check(arches, specs, jobs, display.advance)
        reports["cuda"]["all"] = all_specs
    if hip_arches:
        try:
            offline.require_tools(hip_arches)
        except offline.MissingCompiler as error:
            Console(stderr=True).print(f"kvcupy check --arch {','.join(hip_arches)}: {error}",
                                       markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        specs = select(hip_sampled(all_specs, sample, seed), kernels, defines)
        with render.progress_display(len(specs) * len(hip_arches), Console(stderr=True)) as display:
            reports["hip"] = run_hip_check(hip_arches, specs, jobs, display.advance)
        reports["hip"]["all"] = all_specs
    # The CUDA report as it always was, the HIP one under "hip" beside it.
    report = dict(reports.get("cuda", {}))
    if "hip" in reports:
        report["hip"] = reports["hip"]
    passed = all(part["passed"] for part in reports.values())
    report["passed"] = passed
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        console = Console()
        if not console.is_terminal:   # a CI log: whole keys on one line each, not folded into 80 columns
            console = Console(width=160)
        if "cuda" in reports:
            console.print(check_tables(reports["cuda"]))
        if "hip" in reports:
            console.print(hip_check_tables(reports["hip"]))
    raise typer.Exit(0 if passed else 1)
