"""`kvcupy bench --backend cuda --plot PATH`: the bench's two sweeps, drawn.

Reads the report `kvcupy.bench.run_bench` builds (the same numbers as --json).
Decode: effective bandwidth against context length, the decode groups of the
sweep's geometry, one line per series (kvcupy at the sweep's KV dtypes, dense
bf16 SDPA, the streaming kernel at its fastest split count, and the
device-to-device copy of the same bytes: the measured copy-bandwidth line).
Prefill: TFLOP/s against prompt length, the causal prefill groups of the
prefill sweep's geometry (a fixed number of tokens a batch), kvcupy beside
each SDPA backend. Step: for each model the step group timed, attention-bound
tokens/s against batch size, each graphed implementation at each context
length. A report gets a panel for each of these it holds. matplotlib is an
optional extra (`pip install 'kvcupy[plot]'`), imported only here.
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


def _prefill_sweep_groups(report: dict) -> list[dict]:
    """The causal prefill groups of the prefill sweep's geometry (its lengths at its
    tokens a batch, whether timed for the sweep or as one of the main shapes)."""
    sweep = report.get("prefill_sweep")
    if not sweep:
        return []
    geometry = ("num_heads", "num_kv_heads", "head_size")

    def in_sweep(shape: dict) -> bool:
        return (all(shape[key] == sweep[key] for key in geometry) and shape["seq_len"] in sweep["seq_lens"]
                and shape["num_seqs"] == max(1, sweep["tokens"] // shape["seq_len"]))

    return sorted((g for g in report["groups"] if g["kind"] == "prefill" and in_sweep(g["shape"])),
                  key=lambda g: g["shape"]["seq_len"])


def prefill_series(report: dict) -> dict[str, list[tuple[int, float]]]:
    """label -> [(prompt length, TFLOP/s)], by increasing length; timed cases only."""
    series: dict[str, list[tuple[int, float]]] = {}
    kv_dtypes = report["prefill_sweep"]["kv_dtypes"] if _prefill_sweep_groups(report) else []
    for group in _prefill_sweep_groups(report):
        seq_len = group["shape"]["seq_len"]
        for record in group["cases"]:
            wanted = record["impl"] == "sdpa" or (record["impl"] == "kvcupy" and record["kv_dtype"] in kv_dtypes)
            if wanted and record["status"] == "ok" and record.get("tflop_per_s") is not None:
                label = record["name"] + (f", dense {report['model_dtype']}" if record["impl"] == "sdpa" else "")
                series.setdefault(label, []).append((seq_len, record["tflop_per_s"]))
    return series


def step_series(report: dict) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """model -> label -> [(batch, tokens/s)], by increasing batch: the step groups'
    graphed cases with their writes, timed ones only."""
    models: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for group in report["groups"]:
        if group["kind"] != "step":
            continue
        shape = group["shape"]
        for record in group["cases"]:
            if record["status"] == "ok" and record["graphed"] and record["writes"]:
                label = f"{record['name']}, {shape['seq_len'] // 1024}k context"
                models.setdefault(shape["model"], {}).setdefault(label, []).append(
                    (shape["num_seqs"], record["tokens_per_s"]))
    return {model: {label: sorted(points) for label, points in series.items()} for model, series in models.items()}


def _draw_steps(axes, model: str, series: dict[str, list[tuple[int, float]]], implementations: list[str],
                device: str) -> None:
    # One colour an implementation, the same in every model's panel; one line style a context length.
    styles = ("-", "--", ":", "-.")
    contexts = sorted({label.rsplit(", ", 1)[1] for label in series}, key=lambda c: int(c.split("k")[0]))
    for label, points in series.items():
        implementation, context = label.rsplit(", ", 1)
        batches, rates = zip(*points)
        axes.plot(batches, rates, color=f"C{implementations.index(implementation) % 10}",
                  linestyle=styles[contexts.index(context) % len(styles)], marker="o", label=label)
    batches = sorted({n for points in series.values() for n, _ in points})
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(batches, [str(n) for n in batches])
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="x-small", loc="best")
    axes.set_xlabel("batch (sequences, one new token each a step)")
    axes.set_ylabel("tokens/s, attention alone (batch / step time)")
    axes.set_title(f"decode step of {model}, every layer's write and attention, CUDA graphs; {device}",
                   fontsize="medium")


def _length_ticks(axes, seq_lens: list[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(seq_lens, [f"{n // 1024}k" if n >= 1024 else str(n) for n in seq_lens])
    axes.set_ylim(bottom=0)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="small", loc="best")


def _draw_series(axes, series: dict[str, list[tuple[int, float]]], styles: dict) -> None:
    for label, points in series.items():
        line, marker = styles.get(label.split()[0].rstrip(","), ("-", "o"))
        seq_lens, rates = zip(*points)
        axes.plot(seq_lens, rates, linestyle=line, marker=marker, label=label)


def plot_report(report: dict, path: Path | str) -> Path:
    """Draw the report's sweeps and steps to `path` (a PNG, or any format matplotlib
    infers from the suffix): decode bandwidth, prefill TFLOP/s and each model's step
    tokens/s, a panel each that the report holds. ValueError when it holds none."""
    require_matplotlib()
    # The object-oriented API: no pyplot, no global backend choice, no display needed.
    from matplotlib.figure import Figure

    decode, prefill, steps = bandwidth_series(report), prefill_series(report), step_series(report)
    panels = [name for name, series in (("decode", decode), ("prefill", prefill)) if series] + list(steps)
    if not panels:
        raise ValueError("the report holds neither sweep nor a step: time the sweep, prefill_sweep or "
                         "step groups")
    device, block_size = report["device"]["name"], report["block_size"]
    figure = Figure(figsize=(8, 5 * len(panels)), layout="constrained")
    axes_of = dict(zip(panels, figure.subplots(len(panels), 1, squeeze=False)[:, 0]))
    if "decode" in axes_of:
        axes, sweep = axes_of["decode"], report["sweep"]
        _draw_series(axes, decode, {"kvcupy": ("-", "o"), "torch": ("-", "s"), "stream": (":", "^"),
                                    "copy": ("--", "")})
        _length_ticks(axes, sorted({g["shape"]["seq_len"] for g in _sweep_groups(report)}))
        axes.set_xlabel("context length (tokens per sequence)")
        axes.set_ylabel("effective TB/s (bytes the case must move / median time)")
        axes.set_title(f"decode: {sweep['num_seqs']} sequences, {sweep['num_heads']}/{sweep['num_kv_heads']} "
                       f"heads, d = {sweep['head_size']}, block size {block_size}; {device}", fontsize="medium")
    if "prefill" in axes_of:
        axes, sweep = axes_of["prefill"], report["prefill_sweep"]
        _draw_series(axes, prefill, {"kvcupy": ("-", "o"), "torch": ("--", "s")})
        _length_ticks(axes, sorted({g["shape"]["seq_len"] for g in _prefill_sweep_groups(report)}))
        axes.set_xlabel("prompt length (tokens per sequence; batch = tokens / length)")
        axes.set_ylabel("TFLOP/s (causal: 4 d Hq per query and key it sees)")
        axes.set_title(f"causal prefill: {sweep['tokens']} tokens a batch, {sweep['num_heads']}/"
                       f"{sweep['num_kv_heads']} heads, d = {sweep['head_size']}, block size {block_size}; "
                       f"{device}", fontsize="medium")
    implementations = list(dict.fromkeys(label.rsplit(", ", 1)[0] for series in steps.values() for label in series))
    for model, series in steps.items():
        _draw_steps(axes_of[model], model, series, implementations, device)
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path
