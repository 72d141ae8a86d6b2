"""Bench JSONs side by side: each kvcupy case's median time, new against old.

    python3 tools/bench_compare.py OLD.json NEW.json [OLD.json NEW.json ...] [--tolerance 0.03]

Every file is `kvcupy bench --backend cuda --json` output, e.g. an older
checkout's bench and this one's, run one after the other on the same GPU.
Given several pairs, each side's time of a case is the mean over its runs: runs
in the order old, new, new, old (tools/gpu_check.sh's compare stage) cancel
a GPU's steady drift between them.
Cases are matched by group label and case name; only kvcupy's own cases are
compared (the peers, SDPA and the copy, are the same code on both sides and
show how much the GPU itself drifted between the runs). Prints one line a
case, new / old time, and exits 1 where any case is slower than the tolerance
allows (a case faster by more than the tolerance is reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import sys


def kvcupy_cases(report: dict) -> dict[tuple[str, str], float]:
    """{(group label, case name): median ms} of the report's kvcupy cases that ran."""
    found = {}
    for group in report.get("groups", []):
        for case in group.get("cases", []):
            if case.get("impl") == "kvcupy" and case.get("status") == "ok" and case.get("median_ms"):
                found[(group["label"], case["name"])] = case["median_ms"]
    return found


def peer_drift(old: dict, new: dict) -> list[float]:
    """new / old time of every peer case (not kvcupy's) present in both."""
    ratios = []
    for group_old, group_new in zip(old.get("groups", []), new.get("groups", [])):
        if group_old.get("label") != group_new.get("label"):
            continue
        before = {c["name"]: c for c in group_old["cases"] if c.get("impl") != "kvcupy" and c.get("median_ms")}
        for case in group_new["cases"]:
            if case.get("impl") != "kvcupy" and case["name"] in before and case.get("median_ms"):
                ratios.append(case["median_ms"] / before[case["name"]]["median_ms"])
    return ratios


def combined(reports: list[dict]) -> dict:
    """One report of the cases that ran in every one of `reports`, each with the mean
    of their median times (a single report comes back as it is)."""
    if len(reports) == 1:
        return reports[0]
    groups = []
    for group in reports[0].get("groups", []):
        twins = [next((g for g in r.get("groups", []) if g.get("label") == group.get("label")), None)
                 for r in reports[1:]]
        if any(twin is None for twin in twins):
            continue
        cases = []
        for case in group.get("cases", []):
            times = [case.get("median_ms") if case.get("status", "ok") == "ok" else None]
            for twin in twins:
                match = next((c for c in twin["cases"] if c["name"] == case["name"]), {})
                times.append(match.get("median_ms") if match.get("status", "ok") == "ok" else None)
            if all(times):
                cases.append({**case, "median_ms": sum(times) / len(times)})
        groups.append({"label": group["label"], "cases": cases})
    return {"groups": groups}


def compare(old: dict, new: dict, tolerance: float) -> tuple[list[str], bool]:
    """Lines of the comparison and whether every common kvcupy case is within tolerance."""
    before, after = kvcupy_cases(old), kvcupy_cases(new)
    lines, within = [], True
    for key in [k for k in after if k in before]:
        ratio = after[key] / before[key]
        verdict = "slower" if ratio > 1 + tolerance else "faster" if ratio < 1 - tolerance else "same"
        within = within and verdict != "slower"
        lines.append(f"{verdict:6} {ratio:6.3f}  {before[key]:9.4f} -> {after[key]:9.4f} ms  {key[0]}: {key[1]}")
    only = sorted(set(before) ^ set(after))
    lines += [f"only in {'old' if key in before else 'new'}: {key[0]}: {key[1]}" for key in only]
    drift = sorted(peer_drift(old, new))
    if drift:
        lines.append(f"peers (same code both sides), new / old: median {drift[len(drift) // 2]:.3f}, "
                     f"range {drift[0]:.3f} - {drift[-1]:.3f} over {len(drift)} cases")
    return lines, within


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="OLD.json NEW.json", help="pairs of bench reports")
    parser.add_argument("--tolerance", type=float, default=0.03)
    options = parser.parse_args()
    if len(options.reports) % 2:
        parser.error(f"{len(options.reports)} reports given: they come in pairs, OLD.json NEW.json")
    loaded = []
    for path in options.reports:
        with open(path) as report:
            loaded.append(json.load(report))
    lines, within = compare(combined(loaded[0::2]), combined(loaded[1::2]), options.tolerance)
    print("\n".join(lines))
    sys.exit(0 if within else 1)


if __name__ == "__main__":
    main()
