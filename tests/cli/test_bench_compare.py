"""tools/bench_compare.py: kvcupy's cases matched across two bench reports,
slower past the tolerance fails, the peers show the GPU's own drift."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "tools" / "bench_compare.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def report(int4_ms, sdpa_ms, extra=()):
    cases = [{"name": "kvcupy int4", "impl": "kvcupy", "status": "ok", "median_ms": int4_ms},
             {"name": "torch sdpa", "impl": "torch", "status": "ok", "median_ms": sdpa_ms}, *extra]
    return {"groups": [{"label": "decode 32 x 8192", "cases": cases}]}


def test_within_tolerance_passes_and_names_the_case():
    lines, within = tool.compare(report(1.00, 2.0), report(1.02, 2.0), 0.03)
    assert within
    assert lines[0].startswith("same") and "decode 32 x 8192: kvcupy int4" in lines[0]
    assert "median 1.000" in lines[-1]


def test_slower_past_tolerance_fails_and_faster_does_not():
    assert not tool.compare(report(1.00, 2.0), report(1.04, 2.0), 0.03)[1]
    lines, within = tool.compare(report(1.00, 2.0), report(0.90, 2.2), 0.03)
    assert within and lines[0].startswith("faster")
    assert "median 1.100" in lines[-1]


def test_cases_on_one_side_only_are_listed_not_compared():
    int8 = {"name": "kvcupy int8", "impl": "kvcupy", "status": "ok", "median_ms": 5.0}
    lines, within = tool.compare(report(1.0, 2.0), report(1.0, 2.0, [int8]), 0.03)
    assert within
    assert "only in new: decode 32 x 8192: kvcupy int8" in lines


def test_failed_cases_are_skipped():
    failed = report(1.0, 2.0)
    failed["groups"][0]["cases"][0]["status"] = "error"
    assert tool.kvcupy_cases(failed) == {}


def test_several_runs_a_side_compare_by_their_mean_time():
    olds = [report(1.00, 2.0), report(1.10, 2.2)]
    news = [report(1.06, 2.1), report(1.08, 2.1)]
    lines, within = tool.compare(tool.combined(olds), tool.combined(news), 0.03)
    assert within and lines[0].startswith("same") and " 1.019 " in lines[0]   # 1.07 / 1.05
    assert "median 1.000" in lines[-1]


def test_a_case_missing_or_failed_in_one_run_is_left_out_of_the_mean():
    failed = report(1.0, 2.0)
    failed["groups"][0]["cases"][0]["status"] = "error"
    merged = tool.combined([report(1.0, 2.0), failed])
    assert [case["name"] for case in merged["groups"][0]["cases"]] == ["torch sdpa"]
    assert tool.kvcupy_cases(merged) == {}


def test_the_command_takes_reports_in_pairs(tmp_path):
    import json
    import subprocess
    import sys
    paths = []
    for index, ms in enumerate((1.0, 1.01, 1.02, 1.0)):
        path = tmp_path / f"r{index}.json"
        path.write_text(json.dumps(report(ms, 2.0)))
        paths.append(str(path))
    tool_path = str(ROOT / "tools" / "bench_compare.py")
    ok = subprocess.run([sys.executable, tool_path, *paths], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("same")
    odd = subprocess.run([sys.executable, tool_path, *paths[:3]], capture_output=True, text=True)
    assert odd.returncode == 2 and "they come in pairs" in odd.stderr
