"""The command line as a new user meets it: a CPU bench that pins both sides to one
thread count and says so, compile messages only when something compiles, usage
errors that repeat what was typed, and one meaning of `--kv-dtype all`."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from rich.console import Console
from threadpoolctl import threadpool_info
from typer.testing import CliRunner

from cli import bench as bench_module
from cli import render
from cli.app import app
from kvcupy.backends import cpu_kernels
from kvcupy.formats import QUANTIZED_KV_DTYPES

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
# One KV dtype, one call of each kind: the bench's plumbing in about a second.
TINY_BENCH = ["bench", "--quick", "--kv-dtype", "int8_per_token_head", "--repeats", "1",
              "--prefill-repeats", "1", "--rounds", "1", "--warmup", "0"]


def plain_text(output: str) -> str:
    """Rich's error panel without its box and line wrapping."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", output).split())


def blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


@pytest.fixture
def recorded_threads(monkeypatch):
    """The thread counts each side ran with, read inside its calls: the baseline's BLAS
    pools and kvcupy's Numba pool."""
    seen = {"numpy": [], "kvcupy": []}
    dense, paged = bench_module.dense_attention_call, bench_module.paged_attention_call

    def dense_call(*args):
        call = dense(*args)
        return lambda: (seen["numpy"].extend(blas_threads()), call())[1]

    def paged_call(*args):
        call, cache = paged(*args)
        return (lambda: (seen["kvcupy"].append(numba.get_num_threads()), call())[1]), cache

    monkeypatch.setattr(bench_module, "dense_attention_call", dense_call)
    monkeypatch.setattr(bench_module, "paged_attention_call", paged_call)
    return seen


@pytest.mark.parametrize("threads", sorted({1, bench_module.default_threads()}))
def test_bench_pins_both_sides_to_one_thread_count_and_says_so(recorded_threads, threads):
    assert blas_threads(), "NumPy's BLAS is not visible to threadpoolctl"
    numba_before, blas_before = numba.get_num_threads(), blas_threads()
    result = runner.invoke(app, [*TINY_BENCH, "--threads", str(threads), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["threads"] == threads
    assert report["blas"] and {pool["num_threads"] for pool in report["blas"]} == {threads}, report["blas"]
    assert recorded_threads["numpy"] and set(recorded_threads["numpy"]) == {threads}, recorded_threads
    assert recorded_threads["kvcupy"] and set(recorded_threads["kvcupy"]) == {threads}, recorded_threads
    assert f"timing on {threads} thread(s), kvcupy and NumPy alike" in result.stderr
    # Afterwards the process has its own thread counts back.
    assert (numba.get_num_threads(), blas_threads()) == (numba_before, blas_before)


def test_bench_table_names_the_thread_count():
    report = {"backend": "cpu", "model_dtype": "float16", "block_size": 16, "rounds": 3, "threads": 2,
              "blas": [{"library": "openblas", "version": "0.3", "num_threads": 2}], "cores": 2,
              "load_average": 0.5, "warnings": [], "cases": []}
    text = plain_text(render_to_text(render.bench_tables(report)))
    assert ("threads: 2 on both sides (kvcupy's Numba kernels; NumPy's BLAS, pinned with threadpoolctl: "
            "openblas 2); 2 cores, load average 0.50 at the start") in text, text


def render_to_text(renderable) -> str:
    console = Console(file=io.StringIO(), width=100)
    console.print(renderable)
    return console.file.getvalue()


@pytest.mark.parametrize("threads", ["0", str(bench_module.default_threads() + 1), "two"])
def test_bench_refuses_a_thread_count_numba_cannot_run(threads):
    result = runner.invoke(app, ["bench", "--threads", threads])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--threads': '{threads}' is" in plain_text(result.stderr), result.stderr


@pytest.mark.parametrize(("load", "warned"), [(0.3, False), (2.0, False), (5.5, True)])
def test_bench_warns_when_the_machine_is_loaded(monkeypatch, load, warned):
    monkeypatch.setattr(bench_module.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(bench_module.os, "cpu_count", lambda: 2)
    result = runner.invoke(app, [*TINY_BENCH, "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["load_average"], report["cores"]) == (load, 2)
    message = f"the load average ({load:.2f}) is above this machine's 2 cores"
    assert (message in plain_text(result.stderr)) is warned, result.stderr
    assert [message in warning for warning in report["warnings"]] == ([True] if warned else [])


def compile_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "ompiling" in line]


def test_a_run_whose_kernels_are_compiled_says_nothing_of_compiling():
    """The first bench in this process may compile (or load from disk); the second
    finds every kernel compiled and must not claim to compile."""
    runner.invoke(app, [*TINY_BENCH, "--json"])
    result = runner.invoke(app, [*TINY_BENCH, "--json"])
    assert result.exit_code == 0, result.output
    assert compile_lines(result.stderr) == [], result.stderr


def test_a_kernel_that_compiles_is_announced_once_with_what_and_how_long(monkeypatch):
    """A kernel compiled afresh (a copy of one of cpu_kernels' functions, so that
    nothing on disk serves it) makes the command say what compiles, how long a
    first run takes and where the kernels are kept."""
    runner.invoke(app, [*TINY_BENCH, "--json"])   # kvcupy's own kernels: compiled in this process
    paged = bench_module.paged_attention_call

    def compiling_call(*args):
        call, cache = paged(*args)
        fresh = numba.njit(cpu_kernels._max.py_func)   # no cache: compiles on its first call
        return (lambda: (fresh(np.ones(4, np.float32)), call())[1]), cache

    monkeypatch.setattr(bench_module, "paged_attention_call", compiling_call)
    result = runner.invoke(app, [*TINY_BENCH, "--json"])
    assert result.exit_code == 0, result.output
    lines = compile_lines(result.stderr)
    assert lines[0] == render.first_compile_note(cpu_kernels.CACHE_DIR), lines
    assert "about a minute on 2 cores" in lines[0] and "rotation, quantization, paged attention" in lines[0]
    assert lines[1:] == ["compiling _max (first run only)"] * 2, lines   # decode's case, then prefill's
    assert json.loads(result.stdout)["cases"]


def test_repro_announces_a_compile_and_only_then(monkeypatch):
    from cli import repro as repro_module

    args = ["repro", "--kv-dtype", "int8_per_token_head", "--prompt-len", "16", "--decode-steps", "1",
            "--json"]
    runner.invoke(app, args)   # kvcupy's own kernels: compiled in this process
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert compile_lines(result.stderr) == [], result.stderr
    roundtrip = repro_module.rotation_roundtrip_error

    def compiling_roundtrip(*args):
        numba.njit(cpu_kernels._max.py_func)(np.ones(4, np.float32))
        return roundtrip(*args)

    monkeypatch.setattr(repro_module, "rotation_roundtrip_error", compiling_roundtrip)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert compile_lines(result.stderr) == [render.first_compile_note(cpu_kernels.CACHE_DIR),
                                            "compiling _max (first run only)"], result.stderr


def test_the_compile_note_says_where_the_kernels_are_kept():
    assert render.first_compile_note("/somewhere/numba").endswith("later runs load them from /somewhere/numba.")
    assert "set KVCUPY_CACHE_DIR" in render.first_compile_note(None)


@pytest.mark.parametrize(("args", "option", "value"), [
    (["repro", "--head-size", "abc"], "--head-size", "abc"),
    (["repro", "--prompt-len", "1.5"], "--prompt-len", "1.5"),
    (["bench", "--repeats", "many"], "--repeats", "many"),
])
def test_a_value_that_is_not_an_integer_is_repeated(args, option, value):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': '{value}' is not an integer." in plain_text(result.stderr)


def test_a_value_below_the_minimum_is_repeated():
    result = runner.invoke(app, ["repro", "--prompt-len", "0"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--prompt-len': '0' is below 1, the least it takes." in plain_text(result.stderr)


@pytest.mark.parametrize("command", [[], ["repro"], ["bench"], ["info"], ["check"]])
def test_help_shows_no_type_for_flags(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout, result.stdout
    assert "--help" in result.stdout


def test_check_without_cupy_says_so_on_one_line(tmp_path):
    """A stand-in `cupy` that fails to import, as on a machine without CuPy."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise ImportError('No module named cupy (stand-in)')\n")
    completed = subprocess.run([sys.executable, "-m", "cli", "check"], cwd=ROOT, capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}", COLUMNS="40"))
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.splitlines() == [
        "kvcupy check needs CuPy and NVRTC (pip install 'kvcupy[cuda13]'): "
        "No module named cupy (stand-in)"], completed.stderr


@pytest.mark.parametrize("command", ["repro", "bench"])
def test_all_means_every_kv_dtype_in_every_command(command, monkeypatch):
    """`all` is int4, int8, fp8 and auto, `quantized` the first three, in repro and bench alike."""
    seen = []
    if command == "repro":
        from cli import app as app_module
        monkeypatch.setattr(app_module, "run_repro",
                            lambda config, progress: seen.append(config.kv_dtypes) or {"passed": True})
        monkeypatch.setattr(app_module, "_print_report", lambda *args: None)
    else:
        monkeypatch.setattr(bench_module, "run_bench",
                            lambda shapes, kv_dtypes, *args: seen.append(kv_dtypes) or {})
        monkeypatch.setattr("cli.app._print_report", lambda *args: None)
    for choice in ("all", "quantized"):
        result = runner.invoke(app, [command, "--kv-dtype", choice])
        assert result.exit_code == 0, result.output
    assert seen == [QUANTIZED_KV_DTYPES + ("auto",), QUANTIZED_KV_DTYPES], seen


def test_info_says_where_the_cpu_kernels_are_kept():
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["versions"]["cpu kernel cache"] == cpu_kernels.CACHE_DIR
