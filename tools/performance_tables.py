"""Render the GPU performance tables of docs/performance.md and README.md from the bench reports.

A report is the JSON that `kvcupy bench --backend cuda --groups
decode,prefill,write,rotate --json` prints, kept as docs/measurements/<gpu>.json,
one file per GPU kind (REPORTS). The primary kind's report fills the main
tables and the README's summary; each other kind's fills its own section of
docs/performance.md (tables named "<kind>-<table>"). Every number in a table
comes from a report: nothing is typed by hand, so a new report changes the
documents only through this script.

In a document, each table sits between two marker lines,
`<!-- performance_tables: NAME -->` and `<!-- /performance_tables: NAME -->`;
the script replaces what lies between them and leaves the prose alone.

    python tools/performance_tables.py            # print every table
    python tools/performance_tables.py --write    # rewrite the tables in the documents
    python tools/performance_tables.py --check    # exit 1 when a document's table differs

tests/cli/test_performance_tables.py renders the tables again and checks that the
documents hold them, so the documents cannot drift from the report.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "docs" / "measurements"
PRIMARY = "h200"
REPORTS = {kind: MEASUREMENTS / f"{kind}.json" for kind in (PRIMARY, "h100")}
REPORT = REPORTS[PRIMARY]
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"

KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")
SHORT = {"int4_per_token_head": "int4", "int8_per_token_head": "int8", "fp8_per_token_head": "fp8",
         "auto": "auto (bf16)"}
SDPA_BACKENDS = (("default", "SDPA default"), ("cudnn", "SDPA cuDNN"), ("flash", "SDPA flash"))


# --- reading the report -------------------------------------------------------

def load(path: Path = REPORT) -> dict:
    return json.loads(Path(path).read_text())


def load_all() -> dict[str, dict]:
    """Every kind's report, by kind."""
    return {kind: load(path) for kind, path in REPORTS.items()}


def groups(report: dict, kind: str) -> list[dict]:
    """The report's groups of one kind (decode, prefill, write, rotate), sweeps left out."""
    return [g for g in report["groups"] if g["kind"] == kind and not g.get("sweep")]


def case(group: dict, impl: str, kv_dtype: str | None = None, sdpa_backend: str | None = None) -> dict | None:
    """The group's case of `impl` ("kvcupy", "sdpa", "copy") for a KV dtype or an SDPA backend."""
    for record in group["cases"]:
        if record["impl"] != impl or record.get("device_metadata"):   # that case feeds its target alone
            continue
        if kv_dtype is not None and record["kv_dtype"] != kv_dtype:
            continue
        if sdpa_backend is not None and record["sdpa_backend"] != sdpa_backend:
            continue
        return record
    return None


def fastest_stream(group: dict, kv_dtype: str) -> dict | None:
    """The streaming kernel's fastest split count for a KV dtype: the paged-decode ceiling."""
    runs = [r for r in group["cases"] if r["impl"] == "stream" and r["kv_dtype"] == kv_dtype and r["status"] == "ok"]
    return max(runs, key=lambda r: r["tb_per_s"], default=None)


def heads(report: dict) -> str:
    """"32/8 heads": the attention groups' query and KV heads (one geometry in a full run)."""
    found = {(g["shape"]["num_heads"], g["shape"]["num_kv_heads"])
             for g in report["groups"] if g["kind"] in ("decode", "prefill")}
    return ", ".join(f"{q}/{k} heads" for q, k in sorted(found))


def shape_label(group: dict) -> str:
    """"32 x 32768, d = 128", "4 x 2048 new over 30720 cached, d = 128", "32768 tokens, d = 128"."""
    shape = group["shape"]
    if group["kind"] == "rotate":
        return f"d = {shape['head_size']}"
    if group["kind"] == "write":
        return f"{shape['num_tokens']} tokens x {shape['num_kv_heads']} KV heads, d = {shape['head_size']}"
    if shape.get("new_tokens"):
        cached = shape["seq_len"] - shape["new_tokens"]
        sizes = f"{shape['num_seqs']} x {shape['new_tokens']} new over {cached} cached"
    else:
        sizes = f"{shape['num_seqs']} x {shape['seq_len']}"
    causal = " causal" if group["kind"] == "prefill" and not shape.get("new_tokens") else ""
    return f"{sizes}{causal}, d = {shape['head_size']}"


# --- formatting ---------------------------------------------------------------

def cell(record: dict | None, render: Callable[[dict], str]) -> str:
    if record is None:
        return "-"
    if record["status"] != "ok":
        return record["status"]
    return render(record)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def tb(record: dict) -> str:
    return f"{record['tb_per_s']:.2f}"


def tflops(record: dict) -> str:
    return f"{record['tflop_per_s']:.1f}"


def ms(record: dict) -> str:
    return f"{record['median_ms']:.3f}"


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


# --- the tables -----------------------------------------------------------------

def run_table(report: dict) -> str:
    """What ran the bench: the GPU, the software, the timing settings."""
    device, versions, timing = report["device"], report["versions"], report["timing"]
    rows = [
        ["GPU", f"{device['name']} ({device['arch']}, {device['sms']} multiprocessors, "
                f"{device['l2_bytes'] >> 20} MiB L2)"],
        ["software", f"kvcupy {versions['kvcupy']}, NVRTC {versions['nvrtc']}, CuPy {versions['cupy']}, "
                     f"torch {versions.get('torch') or 'absent'}"],
        ["inputs", f"{report['model_dtype']}, block size {report['block_size']}, {heads(report)}"],
        ["timing", f"{timing['clock'].replace('cuda', 'CUDA')}, {timing['statistic']} of {timing['rounds']} interleaved rounds, "
                   f"{timing['warmup']} warm-up calls a case"],
    ]
    return table(["", ""], rows)


def targets_table(report: dict) -> str:
    """The goals the bench grades (kvcupy/bench/targets.py, TARGETS) and where this report stands."""
    rows = []
    for target in report["targets"]:
        measured = target["measured"]
        if measured is None:
            value = "-"
        elif target["metric"] in ("bandwidth_vs_copy",):
            value = percent(measured)
        elif target["metric"] in ("speedup_vs_sdpa", "speed_vs_host_metadata"):
            value = f"{measured:.2f}x"
        else:
            value = f"{measured:.2f}" if target["metric"] == "tb_per_s" else f"{measured:.1f}"
        rows.append([target["target"], value, {True: "yes", False: "no", None: "-"}[target["met"]]])
    return table(["target", "measured", "met"], rows)


def decode_table(report: dict) -> str:
    """TB/s of every KV dtype (speed against SDPA), SDPA, the copy and the streaming ceiling."""
    header = ["decode, TB/s (x SDPA's speed)", *(SHORT[kv] for kv in KV_DTYPES), "SDPA bf16",
              "copy of the int4 bytes", "int4 pages streamed"]
    rows = []
    for group in groups(report, "decode"):
        int4 = case(group, "kvcupy", "int4_per_token_head")
        label = shape_label(group) + (f" (int4 {ms(int4)} ms)" if int4 and int4["status"] == "ok" else "")
        row = [label]
        for kv in KV_DTYPES:
            row.append(cell(case(group, "kvcupy", kv),
                            lambda r: f"{tb(r)} ({r['speedup_vs_sdpa']:.2f}x)" if r.get("speedup_vs_sdpa")
                            else tb(r)))
        row.append(cell(case(group, "sdpa"), tb))
        row.append(cell(case(group, "copy", "int4_per_token_head"), tb))
        row.append(cell(fastest_stream(group, "int4_per_token_head"), tb))
        rows.append(row)
    return table(header, rows)


def prefill_table(report: dict, render: Callable[[dict], str], unit: str) -> str:
    header = [f"prefill, {unit}", *(SHORT[kv] for kv in KV_DTYPES), *(name for _, name in SDPA_BACKENDS)]
    rows = []
    for group in groups(report, "prefill"):
        row = [shape_label(group)]
        row += [cell(case(group, "kvcupy", kv), render) for kv in KV_DTYPES]
        row += [cell(case(group, "sdpa", sdpa_backend=backend), render) for backend, _ in SDPA_BACKENDS]
        rows.append(row)
    return table(header, rows)


def write_table(report: dict) -> str:
    """reshape_and_cache: time, bandwidth and its share of a copy of the same bytes."""
    rows = []
    for group in groups(report, "write"):
        for kv in KV_DTYPES:
            record = case(group, "kvcupy", kv)
            rows.append([f"{shape_label(group)}, into {SHORT[kv]}", cell(record, ms), cell(record, tb),
                         cell(record, lambda r: percent(r["bandwidth_vs_copy"]))])
    return table(["write (bf16 in)", "ms", "TB/s", "of copy bandwidth"], rows)


def rotate_table(report: dict) -> str:
    rows = []
    for group in groups(report, "rotate"):
        record = case(group, "kvcupy")
        rows.append([f"{group['shape']['num_vectors']} bf16 vectors, {shape_label(group)}",
                     record.get("rotation", "-") if record else "-", cell(record, ms), cell(record, tb),
                     cell(record, lambda r: percent(r["bandwidth_vs_copy"]))])
    return table(["rotate", "plan", "ms", "TB/s", "of copy bandwidth"], rows)


def readme_table(report: dict) -> str:
    """The README's summary at d = 128: every KV dtype against torch's SDPA (its default
    dispatch, the peer `speedup_vs_sdpa` divides by) on dense bf16 K/V."""
    rows = []
    for group in groups(report, "decode"):
        if group["shape"]["head_size"] != 128:
            continue
        row = [f"decode {shape_label(group)}, TB/s"]
        row += [cell(case(group, "kvcupy", kv), tb) for kv in KV_DTYPES]
        row.append(cell(case(group, "sdpa"), tb))
        row.append(cell(case(group, "kvcupy", "int4_per_token_head"),
                        lambda r: f"{r['speedup_vs_sdpa']:.2f}x"))
        rows.append(row)
    for group in groups(report, "prefill"):
        shape = group["shape"]
        if shape["head_size"] != 128 or shape["seq_len"] < 8192:   # the long prompts and the chunk
            continue
        row = [f"prefill {shape_label(group)}, TFLOP/s"]
        row += [cell(case(group, "kvcupy", kv), tflops) for kv in KV_DTYPES]
        row.append(cell(case(group, "sdpa", sdpa_backend="default"), tflops))
        row.append(cell(case(group, "kvcupy", "int4_per_token_head"),
                        lambda r: f"{r['speedup_vs_sdpa']:.2f}x"))
        rows.append(row)
    header = [f"{report['device']['name']}, {heads(report)}", *(SHORT[kv] for kv in KV_DTYPES), "torch SDPA (bf16)",
              "int4 x SDPA's speed"]
    return table(header, rows)


# Table name -> renderer; DOCUMENTS says which document holds which.
TABLES: dict[str, Callable[[dict], str]] = {
    "run": run_table,
    "targets": targets_table,
    "decode": decode_table,
    "prefill": lambda report: prefill_table(report, tflops, "TFLOP/s"),
    "prefill_ms": lambda report: prefill_table(report, ms, "ms"),
    "write": write_table,
    "rotate": rotate_table,
    "readme": readme_table,
}
# The tables of another kind's section.
OTHER_KIND_TABLES = ("run", "targets", "decode", "prefill", "write", "rotate")
DOCUMENTS: dict[Path, tuple[str, ...]] = {
    PERFORMANCE: ("run", "targets", "decode", "prefill", "prefill_ms", "write", "rotate",
                  *(f"{kind}-{name}" for kind in REPORTS if kind != PRIMARY for name in OTHER_KIND_TABLES)),
    README: ("readme",),
}


def render_all(reports: dict[str, dict]) -> dict[str, str]:
    """Every table, by name: the primary kind's under TABLES' names, the others' as "<kind>-<name>"."""
    tables = {name: render(reports[PRIMARY]) for name, render in TABLES.items()}
    for kind, report in reports.items():
        if kind != PRIMARY:
            tables.update({f"{kind}-{name}": TABLES[name](report) for name in OTHER_KIND_TABLES})
    return tables


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- performance_tables: {name} -->\n)(.*?)(<!-- /performance_tables: {name} -->)", re.S)


def marked_table(text: str, name: str) -> str | None:
    """What a document holds between the markers of table `name` (None: no markers)."""
    found = _block(name).search(text)
    return None if found is None else found.group(2).rstrip("\n")


def with_tables(text: str, tables: dict[str, str], names: tuple[str, ...]) -> str:
    """The document with each named table put between its markers (ValueError: markers missing)."""
    for name in names:
        pattern = _block(name)
        if not pattern.search(text):
            raise ValueError(f"no <!-- performance_tables: {name} --> markers")
        text = pattern.sub(lambda m: m.group(1) + tables[name] + "\n" + m.group(3), text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the tables in the documents")
    action.add_argument("--check", action="store_true", help="exit 1 when a document's table differs")
    args = parser.parse_args(argv)
    tables = render_all(load_all())
    if not (args.write or args.check):
        for name, text in tables.items():
            print(f"<!-- performance_tables: {name} -->\n{text}\n")
        return 0
    # Every document is rendered before any is written: a missing marker changes nothing.
    updates = {document: with_tables(document.read_text(), tables, names) for document, names in DOCUMENTS.items()}
    stale = [document for document, text in updates.items() if text != document.read_text()]
    for document in stale:
        if args.write:
            document.write_text(updates[document])
        print(f"{'rewrote' if args.write else 'differs'}: {document.relative_to(ROOT)}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
