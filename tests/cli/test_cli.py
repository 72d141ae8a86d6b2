"""The `kvcupy` command line through typer's CliRunner: reports parse, checks pass, exit codes hold."""

from __future__ import annotations

import inspect
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import bench as bench_module
from cli import bounds, render
from cli.app import KvDtype, app, bench, repro
from kvcupy.backends import status as backend_status

runner = CliRunner()

QUANTIZED_KV_DTYPES = ["int4_per_token_head", "int8_per_token_head", "fp8_per_token_head"]
ALL_KV_DTYPES = QUANTIZED_KV_DTYPES + ["auto"]
# Fewer tokens than the default 512 + 32: the same checks in about a second per KV dtype.
SMALL_REPRO = ["repro", "--head-size", "96", "--prompt-len", "64", "--decode-steps", "4"]
RESULT_KEYS = {"kv_dtype", "attn_rel_err_vs_fp64", "attn_rel_err_bound", "impl_rel_err_vs_oracle",
               "impl_rel_err_bound", "bytes_per_token", "bytes_vs_fp16", "passed"}


def plain_text(output: str) -> str:
    """Rich's error panel without its box and line wrapping, to search for phrases."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", output).split())


def run_json(args: list[str]) -> tuple[int, dict]:
    """Exit code and the JSON report, which must be all of stdout."""
    result = runner.invoke(app, [*args, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.stdout)


def test_repro_json_reports_every_check_and_passes():
    exit_code, report = run_json(SMALL_REPRO)
    assert exit_code == 0, report
    assert report["passed"] is True
    assert report["head_size"] == 96 and report["backend"] == "cpu"
    rotation = report["rotation"]
    assert (rotation["kind"], rotation["block"], rotation["blocks"]) == ("blockdiag", 32, 3)
    assert rotation["plan"].startswith("96 = 32 x 3")
    assert 0 <= rotation["roundtrip_rel_err"] <= 1e-6
    assert [result["kv_dtype"] for result in report["results"]] == QUANTIZED_KV_DTYPES
    for result in report["results"]:
        assert set(result) == RESULT_KEYS, result["kv_dtype"]
        assert result["passed"] is True, result
        assert 0 < result["attn_rel_err_vs_fp64"] <= result["attn_rel_err_bound"], result
        assert 0 <= result["impl_rel_err_vs_oracle"] <= 1e-5, result
    # 32 KV heads x (K + V) x (d / 2 bytes + a 4-byte scale) for int4.
    bytes_per_token = {result["kv_dtype"]: result["bytes_per_token"] for result in report["results"]}
    assert bytes_per_token == {"int4_per_token_head": 64 * 52, "int8_per_token_head": 64 * 100,
                               "fp8_per_token_head": 64 * 100}


def test_repro_auto_is_the_float16_baseline():
    exit_code, report = run_json([*SMALL_REPRO, "--kv-dtype", "auto"])
    assert exit_code == 0, report
    [result] = report["results"]
    assert (result["bytes_per_token"], result["bytes_vs_fp16"]) == (64 * 192, 1.0)


@pytest.mark.parametrize("rotation, block, blocks", [("kron", 96, 1), ("none", 1, 96)])
def test_repro_passes_with_every_rotation(rotation, block, blocks):
    exit_code, report = run_json([*SMALL_REPRO, "--rotation", rotation, "--kv-dtype", "int4_per_token_head"])
    assert exit_code == 0, report
    assert (report["rotation"]["kind"], report["rotation"]["block"], report["rotation"]["blocks"]) == \
        (rotation, block, blocks)


def test_repro_exits_1_when_a_check_fails(monkeypatch):
    monkeypatch.setattr(bounds, "IMPL_BOUND", 0.0)   # no float32 implementation meets this
    exit_code, report = run_json([*SMALL_REPRO, "--kv-dtype", "int8_per_token_head"])
    assert exit_code == 1
    assert report["passed"] is False and report["results"][0]["passed"] is False


def test_rotation_cuts_int4_attention_error_on_outlier_keys():
    """Acceptance: with the default rotation, int4's attention error is at most 0.6x the
    error without rotation, at repro's default sizes (512 prompt + 32 decode tokens)."""
    errors = {}
    for rotation in ("blockdiag", "none"):
        _, report = run_json(["repro", "--head-size", "96", "--kv-dtype", "int4_per_token_head",
                              "--rotation", rotation])
        errors[rotation] = report["results"][0]["attn_rel_err_vs_fp64"]
    assert errors["blockdiag"] <= 0.6 * errors["none"], errors


@pytest.mark.parametrize("command", ["repro", "bench"])
@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_gpu_backend_fails_with_the_reason(command, backend):
    if backend_status(backend).usable:
        pytest.skip(f"{backend} is usable on this machine")
    result = runner.invoke(app, [command, "--backend", backend])
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert f"backend '{backend}' is not usable here: {backend_status(backend).detail}" in message, message
    assert result.stdout == ""


def test_unsupported_head_size_is_a_usage_error():
    result = runner.invoke(app, ["repro", "--head-size", "97"])
    assert result.exit_code == 2, result.output
    assert "head_size=97 is not supported" in plain_text(result.stderr)


@pytest.mark.parametrize("args", [["--head-size", "95"], ["--head-size", "95", "--rotation", "kron"]])
def test_bad_head_size_blames_head_size_alone(args):
    """A head size outside 32..256 (or odd) is wrong whatever the rotation."""
    result = runner.invoke(app, ["repro", *args])
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert "Invalid value for '--head-size': head_size=95 is not supported" in message, message
    assert "--rotation" not in message, message


def test_head_size_without_kron_rotation_blames_both_given_options():
    result = runner.invoke(app, ["repro", "--head-size", "72", "--rotation", "kron"])   # 72 = 9 x 8
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert "Invalid value for '--head-size' / '--rotation': head_size=72 has no kron rotation" in message, \
        message


@pytest.mark.parametrize(("command", "option", "value", "choices"), [
    ("repro", "--kv-dtype", "int3", "'all', 'quantized', 'int4_per_token_head', 'int8_per_token_head', "
                                    "'fp8_per_token_head', 'auto'"),
    ("repro", "--rotation", "hadamard", "'blockdiag', 'kron', 'none'"),
    ("bench", "--backend", "tpu", "'auto', 'cpu', 'cuda', 'rocm'"),
    ("bench", "--phase", "warmup", "'all', 'decode', 'prefill'"),
])
def test_unknown_choice_gets_kvcupys_message(command, option, value, choices):
    result = runner.invoke(app, [command, option, value])
    assert result.exit_code == 2, result.output
    message = plain_text(result.stderr)
    assert f"Invalid value for '{option}': '{value}' is not one of {choices}." in message, message
    assert "Value error" not in message, message


def help_lines(args: list[str], columns: int) -> list[str]:
    """The help screen as rich draws it `columns` wide, each line without its box and margins."""
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return [re.sub(r"[\u2500-\u257f]", " ", line).strip() for line in result.stdout.splitlines()]


def docstring_line_ends(command) -> list[str]:
    """The last three words of every docstring line that does not end its paragraph."""
    paragraphs = inspect.cleandoc(command.__doc__).split("\n\n")
    return [" ".join(line.split()[-3:]) for paragraph in paragraphs for line in paragraph.splitlines()[:-1]]


@pytest.mark.parametrize("columns", [120, 200])
@pytest.mark.parametrize("args", [[], ["repro"], ["bench"]])
def test_help_reflows_docstring_paragraphs(args, columns):
    """No help line stops where a docstring line does: on a screen wider than the
    source lines, a paragraph drawn with its hard line breaks would."""
    lines = help_lines(args, columns)
    commands = {"repro": repro, "bench": bench}
    for command in [commands[args[0]]] if args else commands.values():
        for line_end in docstring_line_ends(command):
            assert not any(line.endswith(line_end) for line in lines), (args, columns, line_end)


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", ["repro", "bench"])
def test_help_wraps_choice_lists_between_choices(command, columns):
    help_text = "\n".join(help_lines([command], columns))
    for choice in KvDtype:
        assert re.search(rf"(^|[<| ]){choice.value}([>| ]|$)", help_text, re.M), (command, columns, choice)


def test_info_json_lists_versions_and_backends():
    exit_code, info = run_json(["info"])
    assert exit_code == 0
    assert {"kvcupy", "python", "numpy", "numba", "ml_dtypes"} <= set(info["versions"])
    usable = {status["name"]: status["usable"] for status in info["backends"]}
    assert usable == {name: backend_status(name).usable for name in ("cpu", "cuda", "rocm")}
    assert usable["cpu"] is True
    assert all(status["detail"] for status in info["backends"])


def test_info_names_the_extra_nvrtc_options(monkeypatch):
    pytest.importorskip("cupy", reason="the compiler's lines need CuPy (the cuda13 extra)")
    from kvcupy import jit
    monkeypatch.setattr(jit, "EXTRA_OPTIONS", ())
    assert "nvrtc extra options" not in run_json(["info"])[1]["versions"]
    monkeypatch.setattr(jit, "EXTRA_OPTIONS", ("-lineinfo", "-DKVC_X=1"))
    assert run_json(["info"])[1]["versions"]["nvrtc extra options"] == "-lineinfo -DKVC_X=1"

def test_python_dash_m_cli_is_the_same_command():
    repo_root = Path(__file__).resolve().parents[2]
    completed = subprocess.run([sys.executable, "-m", "cli", "info", "--json"], cwd=repo_root,
                               capture_output=True, text=True, check=True)
    assert json.loads(completed.stdout)["versions"]["kvcupy"]


def test_cli_modules_import_each_other_relatively():
    """The wheel installs cli/ as kvcupy.cli: an absolute `cli` import would fail there."""
    for path in (Path(__file__).resolve().parents[2] / "cli").glob("*.py"):
        assert not re.search(r"^\s*(from|import) cli\b", path.read_text(), re.M), path.name


def test_bench_quick_json_reports_ratios():
    exit_code, report = run_json(["bench", "--quick", "--repeats", "3", "--prefill-repeats", "2"])
    assert exit_code == 0
    assert report["backend"] == "cpu"
    cases = {(case["phase"], case["kv_dtype"]): case for case in report["cases"]}
    assert set(cases) == {(phase, kv_dtype) for phase in ("decode", "prefill") for kv_dtype in ALL_KV_DTYPES}
    for name, case in cases.items():
        assert case["median_s"] > 0 and case["baseline_median_s"] > 0, name
        assert math.isclose(case["speedup_vs_baseline"], case["baseline_median_s"] / case["median_s"]), name
        assert case["cache_gb_per_s"] > 0, name
        assert case["repeats"] == (3 if name[0] == "decode" else 2), name
    assert report["rounds"] == 3


def test_progress_display_shows_the_status_and_notes_on_a_terminal():
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    with render.progress_display(3, terminal) as display:
        display.note("Compiling kvcupy's CPU kernels: once")
        display.status("compiling paged_attention (first run only)")
    assert "compiling paged_attention (first run only)" in terminal.file.getvalue()
    assert "Compiling kvcupy's CPU kernels: once\n" in terminal.file.getvalue()


def test_progress_display_off_a_terminal_prints_status_and_note_lines_only():
    log = Console(file=io.StringIO(), force_terminal=False, width=40)
    with render.progress_display(3, log) as display:
        display.advance("decode: numpy float32 dense")
        display.note("Compiling kvcupy's CPU kernels (Numba): a first run does this once")
        display.status("compiling paged_attention (first run only)")
    assert log.file.getvalue() == ("Compiling kvcupy's CPU kernels (Numba): a first run does this once\n"
                                   "compiling paged_attention (first run only)\n")


@pytest.mark.parametrize(("repeats", "rounds", "expected"), [
    (9, 3, [3, 3, 3]), (7, 3, [3, 2, 2]), (2, 3, [1, 1]), (1, 1, [1]), (5, 2, [3, 2]),
])
def test_bench_spreads_repeats_over_rounds(repeats, rounds, expected):
    assert bench_module.split_repeats(repeats, rounds) == expected


class FakeClock:
    """time.perf_counter for bench: each call of the timed function takes CALL_S."""

    CALL_S = 2.0 ** -7   # exact in binary, so that sums of it compare exactly

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def perf_counter(self) -> float:
        return self.now

    def call(self) -> None:
        self.calls.append(self.now)
        self.now += self.CALL_S


@pytest.mark.parametrize(("warmup", "untimed"), [(2, 4), (6, 6), (0, 4)])
def test_bench_times_exactly_the_requested_calls_after_settling(monkeypatch, warmup, untimed):
    """Untimed calls go on for `warmup` calls and until SETTLE_S has passed, and no longer.
    (A fake clock: on a loaded machine the real one makes any bound on the last call flaky.)"""
    clock = FakeClock()
    monkeypatch.setattr(bench_module, "time", clock)
    monkeypatch.setattr(bench_module, "SETTLE_S", 4 * FakeClock.CALL_S)
    times = bench_module.time_calls(clock.call, warmup=warmup, repeats=3)
    assert times == [FakeClock.CALL_S] * 3
    assert len(clock.calls) == untimed + 3
