"""Facts the kernels and the Python side both state, held equal: the KV dtype
codes, the query/output dtype codes, the merge's limits and the format's
constants, read from kernels_cu/ as NVRTC sees them (the headers' text) and
from the modules that pass them. A change on one side alone fails here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvcupy import formats
from kvcupy.backends.cuda import kernels

KERNELS = Path(__file__).resolve().parents[2] / "kernels_cu"
HIP_KERNELS = KERNELS.parent / "kernels_hip"


def constants(header: str, folder: Path = KERNELS) -> dict[str, int | float]:
    """`constexpr <type> name = value` (several a line too) and enum members of a header."""
    text = (folder / header).read_text()
    found = {}
    for declaration in re.findall(r"constexpr\s+(?:int|u32|float)\s+([^;]+);", text):
        for name, value in re.findall(r"(\w+)\s*=\s*(0x[0-9a-fA-F]+|[0-9.e+-]+)[uf]?", declaration):
            found[name] = int(value, 0) if value.startswith("0x") or value.isdigit() else float(value)
    for body in re.findall(r"enum\s*\{([^}]*)\}", text):
        for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body):
            found[name] = int(value)
    return found


@pytest.mark.parametrize("folder,source", [(KERNELS, "attention.cuh"), (HIP_KERNELS, "attention.hip")])
def test_attention_kv_codes(folder, source):
    found = constants(source, folder)
    assert {name: found[name] for name in ("KV_INT4", "KV_INT8", "KV_FP8", "KV_F16", "KV_BF16")} == {
        "KV_INT4": kernels.KV_INT4, "KV_INT8": kernels.KV_INT8, "KV_FP8": kernels.KV_FP8,
        "KV_F16": kernels.KV_F16, "KV_BF16": kernels.KV_BF16}


def test_write_kv_codes_are_the_formats_table():
    found = constants("quantize.cuh")
    ids = {name: formats.KV_DTYPES[name].kernel_id for name in formats.KV_DTYPES}
    assert (found["kInt4"], found["kInt8"], found["kFp8"], found["kAuto"]) == (
        ids["int4_per_token_head"], ids["int8_per_token_head"], ids["fp8_per_token_head"], ids["auto"])


@pytest.mark.parametrize("name,dtype", [("kDtypeF32", np.float32), ("kDtypeF16", np.float16),
                                        ("kDtypeBf16", formats.MODEL_DTYPES["bfloat16"])])
def test_query_and_output_dtype_codes(name, dtype):
    assert constants("params.cuh")[name] == kernels.dtype_code(dtype)


def test_merge_limits():
    found = constants("merge.cuh")
    assert (found["kMergeWarps"], found["kMergeMaxSplits"]) == (kernels.MERGE_WARPS, kernels.MAX_SPLITS)


def test_format_constants():
    found = constants("quantize.cuh")
    assert found["kNonFiniteScale"] == formats.NONFINITE_SCALE_BITS
    assert np.float32(found["kMinScale"]) == np.float32(formats.MIN_SCALE)


def test_attention_params_layout_compiles_as_the_launcher_packs_it():
    # Every field's offset as a static_assert (the struct's layout of the fields is the
    # parameters' too): NVRTC refuses the program if the header and the launcher differ.
    pytest.importorskip("cupy", reason="needs CuPy (the cuda13 extra)")
    from cupy.cuda import nvrtc
    from kvcupy import jit
    from kvcupy.backends.cuda.params import ATTENTION_PARAMS
    checks = "".join(f"static_assert(offsetof(Params, {name}) == {offset}, \"{name}\");\n"
                     for name, offset in ATTENTION_PARAMS.offsets.items())
    source = ('#include "params.cuh"\nusing kvc_attn::Params;\n#define offsetof(T, f) __builtin_offsetof(T, f)\n'
              + checks)
    program = nvrtc.createProgram(source, "params_layout.cu", [], [])
    nvrtc.compileProgram(program, ["--std=c++17", f"-I{jit.source_dir()}", *jit.cuda_include_options()])
    # A wrong offset must fail the compile: the check above can fail.
    wrong = source.replace(f"== {ATTENTION_PARAMS.offsets['sign_shift']},", "== 1,")
    program = nvrtc.createProgram(wrong, "params_layout.cu", [], [])
    with pytest.raises(nvrtc.NVRTCError):
        nvrtc.compileProgram(program, ["--std=c++17", f"-I{jit.source_dir()}", *jit.cuda_include_options()])
