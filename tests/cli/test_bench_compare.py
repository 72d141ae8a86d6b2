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
