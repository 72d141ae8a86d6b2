"""conftest's --shard: N parts that partition the selected tests."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import parse_shard

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "cpu" / "test_rotation.py"


def collected(*options) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             *options, str(SAMPLE)], capture_output=True, text=True,
                            cwd=ROOT)
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
    tool = ROOT / "tools" / "gpu_tests.py"
    return subprocess.run([sys.executable, str(tool), "--logs", str(tmp_path), *arguments], capture_output=True,
                          text=True, cwd=ROOT)


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


def test_parts_split_over_two_calls_cover_the_selection_once(tmp_path):
    """--only K-L: two calls, each starting half of four parts, pass every test of
    the selection between them, and log only their own parts."""
    expected = len(collected())
    first = run_tool(tmp_path / "first", "--parts", "4", "--only", "0-1", "--", "-q", str(SAMPLE))
    second = run_tool(tmp_path / "second", "--parts", "4", "--only", "2-3", "--", "-q", str(SAMPLE))
    counts = []
    for ran, logs, parts in ((first, "first", (0, 1)), (second, "second", (2, 3))):
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert sorted(path.name for path in (tmp_path / logs).iterdir()) == [f"part{k}.log" for k in parts]
        counts.append(int(ran.stdout.splitlines()[-1].removeprefix("total: ").removesuffix(" passed")))
    assert sum(counts) == expected and all(counts), (counts, expected)


@pytest.mark.parametrize("text", ["2-1", "0-4", "-1", "x", "1-y", "4"])
def test_bad_part_ranges_are_refused(text):
    """--only names the parts it cannot start, and starts none."""
    tool = load_tool()
    with pytest.raises(ValueError, match="--only"):
        tool.parse_only(text, 4)
    assert list(tool.parse_only("1-2", 4)) == [1, 2] and list(tool.parse_only("3", 4)) == [3]


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_tests", ROOT / "tools" / "gpu_tests.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_a_stopped_parts_progress_is_counted():
    """A part stopped by the time limit prints no summary line: its progress
    characters (-q) or result words (-v) say what it had done."""
    tool = load_tool()
    quiet = "..F.s" + "." * 67 + " [ 40%]\n..E.x\n"
    assert tool.progress_counts(quiet) == {"passed": 73, "failed": 1, "skipped": 1, "error": 1, "xfailed": 1}
    verbose = ("tests/test_a.py::test_one[int4-128] PASSED   [  1%]\n"
               "tests/test_a.py::test_two FAILED    [  2%]\n"
               "tests/test_a.py::test_three SKIPPED (no wgmma)   [  3%]\n"
               "E   AssertionError: 2 > 1\n")
    assert tool.progress_counts(verbose) == {"passed": 1, "failed": 1, "skipped": 1}


def test_a_part_that_runs_out_of_time_reports_what_it_did(tmp_path):
    """End to end: one quick test, then one that outlasts --timeout; the part is
    counted as timed out, its first test as passed, and the exit status is 1."""
    selection = tmp_path / "test_slow.py"
    selection.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n")
    ran = run_tool(tmp_path / "logs", "--parts", "1", "--timeout", "15", "--",
                   "-p", "tests.conftest", "-q", str(selection))
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "part 0: exit -9: stopped at the time limit after 1 passed" in ran.stdout, ran.stdout
    assert ran.stdout.splitlines()[-1] == "total: 1 parts timed out, 1 passed", ran.stdout


def test_each_failing_test_is_named_in_the_report(tmp_path):
    """With -rfE, a part's FAILED line follows its summary: the report names the test
    and its reason even where only the tool's output comes back."""
    selection = tmp_path / "test_fails.py"
    selection.write_text("def test_fine():\n    pass\n\ndef test_broken():\n    assert 1 == 2, 'one is not two'\n")
    ran = run_tool(tmp_path / "logs", "--parts", "1", "--", "-p", "tests.conftest", "-q", "-rfE", str(selection))
    assert ran.returncode == 1, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("part 0: exit 1: 1 failed, 1 passed"), ran.stdout
    assert lines[1].startswith("  FAILED ") and "test_broken" in lines[1] and "one is not two" in lines[1], ran.stdout
    assert load_tool().failure_lines("x\nFAILED a.py::t - E\nERROR b.py::u\nFAILED\n") == [
        "FAILED a.py::t - E", "ERROR b.py::u"]
    # A part stopped by the time limit has no summary: its verbose results name them.
    stopped = "a.py::t[x-1] PASSED [ 1%]\na.py::t[x two] FAILED [ 2%]\nb.py::u ERROR\n"
    assert load_tool().failure_lines(stopped) == ["FAILED a.py::t[x two]", "ERROR b.py::u"]
    assert load_tool().progress_counts(stopped) == {"passed": 1, "failed": 1, "error": 1}
