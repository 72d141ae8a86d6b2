"""The performance tables of docs/performance.md and README.md are the ones
tools/performance_tables.py renders from the bench report kept beside them
(docs/measurements/), so the documents cannot drift from the measurements."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "performance_tables.py"
MEASUREMENTS = ROOT / "docs" / "measurements"


def load_tool():
    spec = importlib.util.spec_from_file_location("performance_tables", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_tool()
TABLES = tool.render_all(tool.load_all())
PLACEMENTS = [(document, name) for document, names in tool.DOCUMENTS.items() for name in names]


@pytest.mark.parametrize("document, name", PLACEMENTS,
                         ids=[f"{d.name}:{n}" for d, n in PLACEMENTS])
def test_document_holds_the_rendered_table(document, name):
    held = tool.marked_table(document.read_text(), name)
    assert held is not None, f"{document.name} lacks the markers of table {name!r}"
    assert held == TABLES[name], (f"{document.name}'s {name!r} table differs from the report's; "
                                  "run `python tools/performance_tables.py --write`")


def test_every_table_has_a_place():
    placed = {name for _, name in PLACEMENTS}
    assert placed == set(TABLES), f"tables rendered but not placed: {set(TABLES) - placed}"


def test_documents_state_the_commands():
    for document in tool.DOCUMENTS:
        text = document.read_text()
        assert "python tools/performance_tables.py --write" in text, document.name
        assert "kvcupy bench --backend cuda --groups decode,prefill,write,rotate --json" in text, document.name
    assert "(docs/performance.md)" in tool.README.read_text()


def test_one_report_per_gpu_kind_and_nothing_else():
    files = sorted(path.name for path in MEASUREMENTS.iterdir())
    expected = sorted(path.name for path in tool.REPORTS.values())
    assert files == expected, f"docs/measurements/ holds {files}; expected one bench report a GPU kind"


@pytest.mark.parametrize("kind", sorted(tool.REPORTS))
def test_each_report_is_a_full_bench_of_every_group(kind):
    report = json.loads(tool.REPORTS[kind].read_text())
    assert report["backend"] == "cuda"
    kinds = {group["kind"] for group in report["groups"]}
    assert kinds == {"decode", "prefill", "write", "rotate"}, kinds
    for group in report["groups"]:
        failed = [c["name"] for c in group["cases"] if c["status"] == "failed"]
        assert not failed, f"{group['label']}: {failed} failed"
    assert report["targets"], "the report grades the bench's targets"


def test_check_mode_agrees(capsys):
    assert tool.main(["--check"]) == 0, capsys.readouterr().err


def test_a_missing_marker_is_an_error():
    with pytest.raises(ValueError, match="readme"):
        tool.with_tables("no markers here", TABLES, ("readme",))


def test_a_table_is_replaced_between_its_markers_only():
    text = ("before\n<!-- performance_tables: rotate -->\nold\n<!-- /performance_tables: rotate -->\nafter\n")
    updated = tool.with_tables(text, TABLES, ("rotate",))
    assert updated.startswith("before\n") and updated.endswith("after\n")
    assert tool.marked_table(updated, "rotate") == TABLES["rotate"]
    assert tool.with_tables(updated, TABLES, ("rotate",)) == updated
