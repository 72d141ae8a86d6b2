"""conftest's --shard: N parts that partition the selected tests."""

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import parse_shard

SAMPLE = Path(__file__).with_name("test_rotation.py")


def collected(*options) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             *options, str(SAMPLE)], capture_output=True, text=True,
                            cwd=SAMPLE.parent.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_parts_partition_the_selection():
    everything = collected()
    parts = [collected("--shard", f"{k}/3") for k in range(3)]
    assert len(everything) > 3
    assert sorted(sum(parts, [])) == sorted(everything)
    assert all(abs(len(part) - len(everything) / 3) < 1 for part in parts)


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_bad_shards_are_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def run_tool(tmp_path, *arguments) -> subprocess.CompletedProcess:
    tool = SAMPLE.parent.parent / "tools" / "gpu_tests.py"
    return subprocess.run([sys.executable, str(tool), "--logs", str(tmp_path), *arguments], capture_output=True,
                          text=True, cwd=SAMPLE.parent.parent)


def test_gpu_tests_tool_runs_the_parts_and_sums_them(tmp_path):
    """tools/gpu_tests.py: three parts of a selection run together, their passed
    tests summed (deselected ones, the other parts' share, not); a part that
    cannot run (a path that does not exist) makes the exit status 1."""
    expected = len(collected())
    ran = run_tool(tmp_path, "--parts", "3", "--", "-q", str(SAMPLE))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.splitlines()[-1] == f"total: {expected} passed", ran.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["part0.log", "part1.log", "part2.log"]
    broken = run_tool(tmp_path, "--parts", "2", "--", "-q", str(SAMPLE.with_name("no_such_test.py")))
    assert broken.returncode == 1 and "2 parts failed" in broken.stdout, broken.stdout + broken.stderr
