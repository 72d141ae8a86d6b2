"""The GPU tests (or any pytest selection) in N processes that share one GPU.

    PYTHONPATH=. python3 tools/gpu_tests.py [--parts 16] [--only K-L] [--logs DIR] [--timeout S] [-- PYTEST_ARGS...]

Part k runs `pytest --shard k/N PYTEST_ARGS` (tests/conftest.py; PYTEST_ARGS
default to `-m gpu -q tests`: the GPU-marked cases of every folder, tests/gpu/'s
and the few elsewhere, e.g. the decoders', the bench's and the JIT's), so the
parts compile the builds their tests take side by side instead of one process
compiling them all in turn; the JIT's file locks keep two parts from compiling
one build twice. Each part's output goes to DIR/part<k>.log. Prints each
part's summary line, each failing test (the short summary's FAILED and ERROR
lines, with -rfE) and the totals (a part stopped by --timeout: the outcomes
its log shows so far, from pytest's progress characters or, with -v, its
result words); the exit status is 1 where a part failed, errored or ran out of
time, else 0. --only K-L starts parts K to L alone (of --parts N, from 0): a
suite too long for one job's time limit runs as several jobs with the same N,
e.g. --parts 30 --only 0-14, then --only 15-29, whose parts together cover the
selection once.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

DEFAULT_PYTEST_ARGS = ("-m", "gpu", "-q", "tests")
# pytest's closing line, e.g. "3 failed, 120 passed, 5 skipped, 2 deselected in 41.20s"
OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")
NO_TESTS = 5   # pytest's exit status when a part selects nothing


def summary_line(log: str) -> str:
    """The last line of a pytest log that counts outcomes ("" when there is none)."""
    lines = [line for line in log.splitlines() if OUTCOME.search(line) and " in " in line]
    return lines[-1].strip("= ") if lines else ""


# pytest's short test summary lines (-rfE): "FAILED path::test - reason", "ERROR path::test ..."
SHORT_SUMMARY = re.compile(r"^(FAILED|ERROR) \S+")


def failure_lines(log: str) -> list[str]:
    """The short test summary's FAILED and ERROR lines of a part's log (pytest -rfE), so
    that the report names each failing test even where the part logs do not travel.
    A part stopped by the time limit prints no summary: with -v its results so far
    name them instead ("FAILED path::test")."""
    summary = [line.rstrip() for line in log.splitlines() if SHORT_SUMMARY.match(line)]
    if summary:
        return summary
    return [f"{word} {test}" for test, word in VERBOSE_FAILURE.findall(log)]


def outcome_counts(line: str) -> Counter:
    """{"passed": 3, "error": 1, ...} of a summary line; deselected tests (the other
    parts' share) are not counted."""
    counts = Counter()
    for number, outcome in OUTCOME.findall(line):
        if outcome != "deselected":
            counts[outcome.rstrip("s") if outcome.startswith(("error", "warning")) else outcome] += int(number)
    return counts


# What a part had done when its time ran out: pytest's progress characters
# (-q: "..F.s" lines) or its verbose results ("test.py::name PASSED").
PROGRESS_LINE = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")
VERBOSE_FAILURE = re.compile(r"^(\S+::.*?) (FAILED|ERROR)(?= |$)", re.M)   # ids may hold spaces
VERBOSE_RESULT = re.compile(r"::.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?= |$)")
PROGRESS_OUTCOMES = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed"}
VERBOSE_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                    "XFAIL": "xfailed", "XPASS": "xpassed"}


def progress_counts(log: str) -> Counter:
    """The outcomes a part's log shows before its summary line: those of a part
    stopped by the time limit, which never printed one."""
    counts = Counter()
    for line in log.splitlines():
        progress = PROGRESS_LINE.match(line.strip())
        if progress:
            counts.update(PROGRESS_OUTCOMES[c] for c in progress.group(1))
        else:
            counts.update(VERBOSE_OUTCOMES[word] for word in VERBOSE_RESULT.findall(line))
    return counts


def parse_only(text: str, parts: int) -> range:
    """--only's "K-L" (or "K"): parts K to L of `parts`, both included."""
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"--only takes K or K-L (part numbers), not {text!r}") from None
    if not 0 <= low <= high < parts:
        raise ValueError(f"--only {text}: parts are numbered 0 to {parts - 1}, the first no later than the last")
    return range(low, high + 1)


def run_parts(parts: int, pytest_args: list[str], logs: Path, timeout_s: float,
              indices: range | None = None) -> tuple[Counter, list[str]]:
    """Start the parts (`indices` of `parts`: every one by default), wait for them;
    (summed outcomes, one report line a part)."""
    logs.mkdir(parents=True, exist_ok=True)
    started = []
    for index in indices if indices is not None else range(parts):
        log_path = logs / f"part{index}.log"
        handle = open(log_path, "w")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--shard={index}/{parts}", *pytest_args]
        # A wide terminal: pytest cuts a short summary line's reason to the width.
        environment = {**os.environ, "COLUMNS": "400"}
        started.append((index, log_path, handle, subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                                                  env=environment)))
    deadline = time.monotonic() + timeout_s
    totals, lines = Counter(), []
    for index, log_path, handle, process in started:
        timed_out = False
        try:
            status = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            status, timed_out = process.wait(), True
            totals["parts timed out"] += 1
        handle.close()
        log = log_path.read_text(errors="replace")
        line = summary_line(log)
        counts = outcome_counts(line)
        if timed_out and not line:   # what it had done: counted, and said to be partial
            counts = progress_counts(log)
            done = ", ".join(f"{count} {name}" for name, count in sorted(counts.items())) or "nothing"
            line = f"stopped at the time limit after {done}"
        if status not in (0, NO_TESTS) and not timed_out and not (counts["failed"] or counts["error"]):
            totals["parts failed"] += 1   # a crash or a usage error: no failed test counted
        totals.update(counts)
        lines.append(f"part {index}: exit {status}: {line or 'no summary'}")
        lines.extend(f"  {failure}" for failure in failure_lines(log))
    return totals, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--only", help="K-L: start parts K to L of --parts alone (numbered from 0)")
    parser.add_argument("--logs", type=Path, default=Path("gpu-test-logs"))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for all parts together")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    if args.parts < 1:
        parser.error("--parts must be at least 1")
    try:
        indices = parse_only(args.only, args.parts) if args.only is not None else None
    except ValueError as error:
        parser.error(str(error))
    totals, lines = run_parts(args.parts, args.pytest_args or list(DEFAULT_PYTEST_ARGS), args.logs, args.timeout,
                              indices)
    print("\n".join(lines))
    print("total: " + (", ".join(f"{count} {name}" for name, count in sorted(totals.items())) or "nothing ran"))
    bad = totals["failed"] or totals["error"] or totals["parts timed out"] or totals["parts failed"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
