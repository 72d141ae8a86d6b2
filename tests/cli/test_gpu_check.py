"""tools/gpu_check.sh without a GPU: the stages it takes (an unknown one refused before
anything runs) and the commands each runs, through stand-ins for nvidia-smi and python3."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


@pytest.mark.parametrize("stages, named", [
    ("bench,warmup", "warmup"),
    ("test", "test"),
    ("tests:0-11,step,steps", "steps"),
])
def test_an_unknown_stage_is_named_and_nothing_runs(tmp_path, stages, named):
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), stages], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"unknown stage '{named}' (stages: tests, memcheck, bench, host, step, transformers, quick" in result.stderr
    assert result.stdout == "" and not out.exists()


def test_every_stage_the_header_lists_is_one_it_runs():
    text = SCRIPT.read_text()
    header = [line[1:].split()[0] for line in text.splitlines()[1:16] if line.startswith("#   ") and
              not line.startswith("#    ")]
    known = text.split('known="')[1].split('"')[0].split()
    assert header == known
    for stage in known:
        assert f"\n        {stage}" in text.split("for stage in ${stages//,/ }; do\n    case")[1]


def test_the_stages_asked_for_run_in_order_and_no_others(tmp_path):
    """With nvidia-smi and python3 stand-ins that log their arguments: each stage's
    commands, in the order given, the tests' parts passed on."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("nvidia-smi", "python3"):
        stand_in = bin_dir / name
        stand_in.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\n')
        stand_in.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out), "host,tests:12-23,bench"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "nvidia-smi -L"
    assert calls[1] == "python3 tools/host_overhead.py --frameworks torch,cupy"
    assert calls[2].startswith("python3 tools/gpu_tests.py --parts 24 --only 12-23 --logs ")
    assert calls[3] == "python3 -m cli bench --backend cuda --json"
    assert len(calls) == 4
    assert (out / "tests-12-23.log").exists() and (out / "bench.json").exists()
