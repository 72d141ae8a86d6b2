"""tools/gpu_check.sh without a GPU: the stages it takes (an unknown one refused before
anything runs) and the commands each runs, through stand-ins for nvidia-smi and python3."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def _stand_ins(tmp_path):
    """A bin folder whose nvidia-smi and python3 log their arguments and working folder to calls.log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("nvidia-smi", "python3"):
        stand_in = bin_dir / name
        stand_in.write_text(f'#!/usr/bin/env bash\necho "{name} $* @ $PWD" >> "{log}"\n')
        stand_in.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}, log


@pytest.mark.parametrize("stages, named", [
    ("bench,warmup", "warmup"),
    ("test", "test"),
    ("tests:0-11,step,steps", "steps"),
])
def test_an_unknown_stage_is_named_and_nothing_runs(tmp_path, stages, named):
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), stages], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"unknown stage '{named}' (stages: tests, memcheck, bench, host, step, transformers, quick, compare" in result.stderr
    assert result.stdout == "" and not out.exists()


def test_every_stage_the_header_lists_is_one_it_runs():
    text = SCRIPT.read_text()
    lines = text.splitlines()[2:]
    block = lines[:next(index for index, line in enumerate(lines) if not line.startswith("#   "))]
    header = [line[1:].split()[0] for line in block if not line.startswith("#    ")]
    known = text.split('known="')[1].split('"')[0].split()
    assert header == known
    for stage in known:
        assert f"\n        {stage}" in text.split("for stage in ${stages//,/ }; do\n    case")[1]


def test_the_stages_asked_for_run_in_order_and_no_others(tmp_path):
    """With nvidia-smi and python3 stand-ins that log their arguments: each stage's
    commands, in the order given, the tests' parts passed on."""
    env, log = _stand_ins(tmp_path)
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), "host,tests:12-23,bench"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    calls = [line.rsplit(" @ ", 1)[0] for line in log.read_text().splitlines()]
    assert calls[0] == "nvidia-smi -L"
    assert calls[1] == "python3 tools/host_overhead.py --frameworks torch,cupy"
    assert calls[2].startswith("python3 tools/gpu_tests.py --parts 24 --only 12-23 --logs ")
    assert calls[3] == "python3 -m cli bench --backend cuda --json"
    assert len(calls) == 4
    assert (out / "tests-12-23.log").exists() and (out / "bench.json").exists()


def test_compare_refuses_without_a_baseline_checkout(tmp_path):
    env, log = _stand_ins(tmp_path)
    for baseline in ({}, {"BASELINE": str(tmp_path / "missing")}):
        result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "bench,compare"], capture_output=True,
                                text=True, timeout=60, env={**env, **baseline})
        assert result.returncode == 2 and "the compare stage needs BASELINE" in result.stderr
    assert not log.exists() and not (tmp_path / "out").exists()


def test_compare_benches_both_checkouts_in_turn_then_compares_them(tmp_path):
    env, log = _stand_ins(tmp_path)
    baseline = tmp_path / "baseline"
    (baseline / "cli").mkdir(parents=True)
    (baseline / "cli" / "__main__.py").write_text("")
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), "compare"], capture_output=True, text=True,
                            timeout=60, env={**env, "BASELINE": str(baseline)})
    assert result.returncode == 0, result.stderr
    here = str(SCRIPT.parents[1])
    calls = log.read_text().splitlines()
    warm = "python3 -m cli bench --backend cuda --json --rounds 1 --repeats 1 --prefill-repeats 1 --warmup 0"
    assert sorted(calls[1:3]) == sorted([f"{warm} @ {baseline}", f"{warm} @ {here}"])
    timed = "python3 -m cli bench --backend cuda --json"
    assert calls[3:7] == [f"{timed} @ {here}", f"{timed} @ {baseline}", f"{timed} @ {baseline}", f"{timed} @ {here}"]
    reports = [str(out / f"compare-{run}.json") for run in ("baseline-1", "this-1", "baseline-2", "this-2")]
    assert calls[7] == f"python3 tools/bench_compare.py {' '.join(reports)} @ {here}"
    assert len(calls) == 8
