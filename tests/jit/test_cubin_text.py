"""tools/cubin_text.py: which builds two kernel source folders compile differently, and
their spill bytes; the comparison from stand-in results, one small build compiled for real."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "cubin_text.py"


def load_tool():
    pytest.importorskip("cupy", reason="needs CuPy (the cuda13 extra)")   # the tool imports the CUDA backend
    spec = importlib.util.spec_from_file_location("cubin_text", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_each_build_is_same_differs_new_gone_or_unbuilt_with_its_spills():
    old = {"a": ({".text.k": "1"}, 0), "b": ({".text.k": "1"}, 108), "c": ({".text.k": "1"}, 0),
           "d": "does not build: error X"}
    new = {"a": ({".text.k": "1"}, 0), "b": ({".text.k": "2"}, 0), "e": ({".text.k": "3"}, 16),
           "d": ({".text.k": "4"}, 0)}
    assert load_tool().comparison(old, new) == [
        "same     a",
        "differs  b  spills 108 -> 0",
        "gone     c",
        "unbuilt  d",
        "         does not build: error X",
        "new      e  spills 16",
    ]


def test_a_folder_against_itself_is_the_same_build_for_build():
    tool = load_tool()
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as error:   # CuPy is there but libnvrtc is not
        pytest.skip(f"NVRTC is not loadable: {error}")
    specs = tool.cuda_specs.specialisations(all=False)
    folder = str(tool.jit.source_dir())
    code = tool.compiled_code(folder, specs, "sm_90", only="copy_blocks")
    assert code and all(isinstance(result, tuple) and result[1] == 0 for result in code.values())
    lines = tool.comparison(code, tool.compiled_code(folder, specs, "sm_90", only="copy_blocks"))
    assert lines and all(line.startswith("same ") for line in lines)
