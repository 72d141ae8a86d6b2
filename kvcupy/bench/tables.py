"""The CUDA bench's report as tables (the same numbers as --json)."""

from __future__ import annotations

from typing import Any

from rich.console import Group as RichGroup
from rich.table import Table

from .run import _fastest
from .runner import HOST_PROBE_CALLS
from .shapes import SHORT_NAMES


def _storage_name(record: dict) -> str:
    """The caches a step record ran on, named as its cases are, without eager / graphed."""
    kv = record["kv_dtype"]
    return {"kvcupy": f"kvcupy {SHORT_NAMES.get(kv, kv)}", "dense": "torch dense bf16"}.get(record["impl"],
                                                                                           f"{record['impl']} {kv}")


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


def _step_table(group: dict) -> Table:
    """A step group: each implementation's step time and the attention-bound tokens/s,
    against torch dense bf16 graphed, eager against graphed, and the writes' share."""
    columns = ("case", "step ms", "tokens/s", "TB/s", "vs dense graphed", "vs graphed", "writes' share",
               "host ms")
    table = Table(title=group["label"], title_justify="left", show_edge=False, pad_edge=False,
                  caption_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    notes = []
    for record in group["cases"]:
        if record["status"] != "ok":
            notes.append(f"{record['name']}: {record['status']} ({record['reason']})")
            continue
        table.add_row(record["name"], _number(record["median_ms"], ".3f"), _number(record["tokens_per_s"], ",.0f"),
                      _number(record["tb_per_s"], ".2f"), _number(record.get("speedup_vs_dense_graphed"), ".2f", "x"),
                      _number(record.get("speed_vs_graphed"), ".2f", "x"), _number(record.get("write_share"), ".1%"),
                      _number(record.get("host_ms"), ".3f"))
        if record.get("layers_share_caches"):
            notes.append(f"{_storage_name(record)}: {record['layers_share_caches']}")
    # The cases of one storage share the note; say it once.
    table.caption = "; ".join(dict.fromkeys(notes)) or None
    return table


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
    steps = [group for group in report["groups"] if group["kind"] == "step"]
    if steps:
        header += (f" Step groups: {steps[0]['timing']}; tokens/s = sequences / step time, attention alone; "
                   "vs dense graphed: torch dense bf16 graphed's time / the case's; vs graphed: the case "
                   "graphed's time / eager's.")
    parts: list[Any] = [header]
    columns = ("case", "ms", "TB/s", "TFLOP/s", "vs SDPA", "vs copy", "vs stream", "host ms")
    for group in report["groups"]:
        if group["kind"] == "step":
            parts.append(_step_table(group))
            continue
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
    if "not_run" in report:
        left = report["not_run"]
        parts.append(f"Not run ({left['reason']}): " + "; ".join(left["groups"]))
    return RichGroup(*parts)
