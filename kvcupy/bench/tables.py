"""The CUDA bench's report as tables (the same numbers as --json)."""

from __future__ import annotations

from typing import Any

from rich.console import Group as RichGroup
from rich.table import Table

from .run import _fastest
from .runner import HOST_PROBE_CALLS


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _shown(records: list[dict]) -> list[dict]:
    """Timed records, the streaming kernel at its fastest split count only."""
    shown = []
    for record in records:
        if record["status"] != "ok":
            continue
        if record["impl"] == "stream" and record is not _fastest(records, "stream", record["kv_dtype"]):
            continue
        shown.append(record)
    return shown


def tables(report: dict) -> RichGroup:
    """One table per group, then the targets; the same numbers as --json."""
    device = report["device"]
    header = (f"kvcupy bench: {device['name']} ({device['arch']}, {device['sms']} SMs, "
              f"L2 {device['l2_bytes'] / 2**20:.0f} MiB), {report['model_dtype']} inputs, block size "
              f"{report['block_size']}; median of CUDA-event times over {report['timing']['rounds']} rounds. "
              "TB/s: bytes the case must read and write / time. vs SDPA: SDPA time / kvcupy time "
              "(> 1: kvcupy faster); vs copy, vs stream: kvcupy TB/s / theirs. host ms: the host's "
              f"time to issue one call ({HOST_PROBE_CALLS} calls after warm-up), which the GPU times leave "
              "out: where it exceeds ms, eager calls wait on the host.")
    parts: list[Any] = [header]
    columns = ("case", "ms", "TB/s", "TFLOP/s", "vs SDPA", "vs copy", "vs stream", "host ms")
    for group in report["groups"]:
        rows = [(record["name"], _number(record["median_ms"], ".3f"), _number(record["tb_per_s"], ".2f"),
                 _number(record["tflop_per_s"], ".1f"), _number(record.get("speedup_vs_sdpa"), ".2f", "x"),
                 _number(record.get("bandwidth_vs_copy"), ".0%"),
                 _number(record.get("bandwidth_vs_stream"), ".0%"), _number(record.get("host_ms"), ".3f"))
                for record in _shown(group["cases"])]
        # A column no case of the group fills (TFLOP/s of a copy group, vs stream of prefill) is left out.
        kept = [i for i, column in enumerate(columns) if i < 3 or any(row[i] != "-" for row in rows)]
        table = Table(title=group["label"] + ("  (sweep)" if group["sweep"] else ""), title_justify="left",
                      show_edge=False, pad_edge=False, caption_justify="left")
        for i in kept:
            table.add_column(columns[i], justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*(row[i] for i in kept))
        missing = [f"{r['name']}: {r['status']} ({r['reason']})"
                   for r in group["cases"] if r["status"] != "ok"]
        if missing:
            table.caption = "; ".join(missing)
        parts.append(table)
    if report["targets"]:
        targets = Table(title="targets (H200)", title_justify="left", show_edge=False,
                        pad_edge=False)
        for column in ("target", "measured", "bound", "met"):
            targets.add_column(column, justify="left" if column == "target" else "right")
        verdicts = {True: "[bold green]yes[/]", False: "[bold red]no[/]", None: "-"}
        for target in report["targets"]:
            targets.add_row(target["target"], _number(target["measured"], ".2f"), f"{target['bound']:.2f}",
                            verdicts[target["met"]])
        parts.append(targets)
    return RichGroup(*parts)
