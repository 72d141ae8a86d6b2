"""`kvcupy bench --backend cuda --plot PATH`: effective bandwidth against context length.

Reads the report `bench_cuda.run_bench` builds (the same numbers as --json):
the decode groups of the sweep's geometry, one line per series (kvcupy at
the sweep's KV dtypes, dense bf16 SDPA, the streaming kernel at its fastest
split count, and the device-to-device copy of the same bytes: the measured
copy-bandwidth line). matplotlib is an optional extra (`pip install
'kvcupy[plot]'`), imported only here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = "pip install 'kvcupy[plot]' (or: pip install matplotlib)"


def require_matplotlib() -> None:
    """ImportError saying how to install matplotlib, when it is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}")


def _sweep_groups(report: dict) -> list[dict]:
    sweep = report["sweep"]
    geometry = ("num_seqs", "num_heads", "num_kv_heads", "head_size")
    return sorted((g for g in report["groups"] if g["kind"] == "decode"
                   and all(g["shape"][key] == sweep[key] for key in geometry)),
                  key=lambda g: g["shape"]["seq_len"])


def bandwidth_series(report: dict) -> dict[str, list[tuple[int, float]]]:
    """label -> [(context length, TB/s)], by increasing context; timed cases only."""
    short = {"int4_per_token_head": "int4", "int8_per_token_head": "int8",
             "fp8_per_token_head": "fp8", "auto": "auto"}
    series: dict[str, list[tuple[int, float]]] = {}

    def add(label: str, seq_len: int, record: dict | None) -> None:
        if record is not None and record["status"] == "ok" and record["tb_per_s"] is not None:
            series.setdefault(label, []).append((seq_len, record["tb_per_s"]))

    def fastest(records: list[dict]) -> dict | None:
        timed = [r for r in records if r["status"] == "ok"]
        return min(timed, key=lambda r: r["median_ms"]) if timed else None

    for group in _sweep_groups(report):
        seq_len, cases = group["shape"]["seq_len"], group["cases"]
        for kv_dtype in report["sweep"]["kv_dtypes"]:
            name = short.get(kv_dtype, kv_dtype)
            of_dtype = [r for r in cases if r["kv_dtype"] == kv_dtype]
            add(f"kvcupy {name}", seq_len, fastest([r for r in of_dtype if r["impl"] == "kvcupy"]))
            add(f"stream {name} pages (no math, best split count)", seq_len,
                fastest([r for r in of_dtype if r["impl"] == "stream"]))
            add(f"copy, same bytes as {name}", seq_len, fastest([r for r in of_dtype if r["impl"] == "copy"]))
        add(f"torch sdpa, dense {report['model_dtype']}", seq_len,
            fastest([r for r in cases if r["impl"] == "sdpa"]))
    return series


def plot_bandwidth(report: dict, path: Path | str) -> Path:
    """Draw bandwidth_series to `path` (a PNG, or any format matplotlib infers from the suffix)."""
    require_matplotlib()
    # The object-oriented API: no pyplot, no global backend choice, no display needed.
    from matplotlib.figure import Figure

    sweep, device = report["sweep"], report["device"]
    figure = Figure(figsize=(8, 5), layout="constrained")
    axes = figure.subplots()
    styles = {"kvcupy": ("-", "o"), "torch": ("-", "s"), "stream": (":", "^"), "copy": ("--", "")}
    for label, points in bandwidth_series(report).items():
        line, marker = styles.get(label.split()[0].rstrip(","), ("-", "o"))
        seq_lens, rates = zip(*points)
        axes.plot(seq_lens, rates, linestyle=line, marker=marker, label=label)
    axes.set_xscale("log", base=2)
    seq_lens = sorted({g["shape"]["seq_len"] for g in _sweep_groups(report)})
    axes.set_xticks(seq_lens, [f"{n // 1024}k" if n >= 1024 else str(n) for n in seq_lens])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("context length (tokens per sequence)")
    axes.set_ylabel("effective TB/s (bytes the case must move / median time)")
    axes.set_title(f"decode: {sweep['num_seqs']} sequences, {sweep['num_heads']}/{sweep['num_kv_heads']} "
                   f"heads, d = {sweep['head_size']}, block size {report['block_size']}; {device['name']}",
                   fontsize="medium")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="small", loc="best")
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path
