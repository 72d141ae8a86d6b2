"""The HIP builds without a GPU: every specialisation compiled offline for gfx90a and
gfx942 (Debian's hipcc and clang++-19; skipped where they are not installed), the
code-object metadata reader, the specialisation list, `kvcupy check --arch gfx...`,
and NVRTC compiles of the same sources through the wave64 emulation (skipped
without CuPy and NVRTC)."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from kvcupy import formats
from kvcupy.backends.cuda.specs import attention_specialisations, write_specialisations
from kvcupy.backends.rocm import offline, specs

from .emulation import nvrtc_missing

SAMPLE = specs.hip_specialisations(False)
MERGE_LDS = (8 * 256 + 8 * 32 * 8) * 4   # merge.cuh: weights[kMergeWarps][kMergeMaxSplits], partial[..][32 * kMergeSlots]


def _have(*tools: str) -> bool:
    return all(shutil.which(tool) for tool in tools)


def needs_compilers(arch: str):
    tool = offline.COMPILERS[arch]
    return pytest.mark.skipif(not _have(tool, offline.READELF, offline.OBJDUMP),
                              reason=f"{tool}, {offline.READELF} or {offline.OBJDUMP} is not installed "
                                     f"(apt-get install {offline.PACKAGES[tool]} {offline.PACKAGES[offline.READELF]})")


needs_nvrtc = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC is not loadable: {nvrtc_missing()}")


def spec_id(spec) -> str:
    return f"{spec.entry}-" + "-".join(f"{value}" for value in spec.defines.values()) if spec.defines else spec.entry


# --- the specialisation list ------------------------------------------------------

@pytest.mark.parametrize("all_builds", (False, True), ids=("sample", "all"))
def test_hip_builds_are_the_cuda_write_family_merge_builds_and_mfma_attention(all_builds):
    found = specs.hip_specialisations(all_builds)
    cuda_merges = [spec for spec in attention_specialisations(False) if spec.functions == ("merge_splits",)]
    attention = [spec for spec in found if spec.entry == "attention"]
    assert found == (write_specialisations(all_builds) + [spec._replace(entry="merge") for spec in cuda_merges]
                     + attention)
    assert {spec.defines["KVC_OUT_T"] for spec in found if spec.entry == "merge"} == {
        formats.CPP_TYPES[dtype] for dtype in formats.MODEL_DTYPES.values()}
    assert {spec.entry for spec in found} == set(specs.ENTRIES)
    # Every KV kind; every padded head size of 32..256 in --all.
    assert {spec.defines["KVC_MFMA_KV"] for spec in attention} == {0, 1, 2, 3, 4}
    pads = {spec.defines["KVC_HEAD_PAD"] for spec in attention}
    assert pads == (set(range(32, 257, 16)) if all_builds else set(specs.SAMPLE_HEAD_PADS))
    assert len(attention) == len({tuple(sorted(spec.defines.items())) for spec in attention})


# --- offline compiles ---------------------------------------------------------------

@pytest.mark.parametrize("arch", [pytest.param(arch, marks=needs_compilers(arch)) for arch in offline.ARCHES])
@pytest.mark.parametrize("spec", SAMPLE, ids=spec_id)
def test_every_sampled_build_compiles_offline(spec, arch, tmp_path):
    code_object = tmp_path / "kernel.co"
    result = offline.compile_hip(spec.entry, spec.defines, arch, keep=code_object)
    assert code_object.read_bytes()[:4] == b"\x7fELF"
    for function in spec.functions:
        resources = result.kernels[function]
        assert resources.vgprs > 0 and resources.sgprs > 0, resources
        if function == "merge_splits":
            assert resources.lds_bytes == MERGE_LDS, resources
        mfma = result.instructions[function]["mfma"]
        if spec.entry == "attention":
            # Q.K and P.V: (query terms + 1) MFMA a 16-channel step at the least, no scratch.
            terms = 3 if spec.defines["KVC_MFMA_KV"] == 4 else 2
            assert mfma >= (terms + 1) * spec.defines["KVC_HEAD_PAD"] // 16, result.instructions
            assert resources.scratch_bytes == 0, resources
        else:
            assert mfma == 0, result.instructions


LISTING = """\
code.co:\tfile format elf64-amdgpu

Disassembly of section .text:

0000000000001000 <first>:
\ts_load_dwordx4 s[4:7], s[0:1], 0x0                         // 000000001000: C00A0100 00000000
\tv_mfma_f32_16x16x16f16 a[0:3], v[2:3], v[4:5], a[0:3]     // 000000001008: D3CD8000 04020902
\tds_read_b64 v[2:3], v4                                    // 000000001010: D8EC0000 02000004
\tglobal_load_dword v1, v[2:3], off                         // 000000001018: DC508000 017F0002
\tv_add_f32_e32 v1, v1, v2                                  // 000000001020: 02020501
\ts_cbranch_scc1 65533                                      // 000000001024: BF85FFFD
\ts_endpgm                                                  // 000000001028: BF810000

0000000000001100 <second>:
\tglobal_store_dword v[0:1], v2, off                        // 000000001100: DC708000 007F0200
\ts_endpgm                                                  // 000000001108: BF810000
"""


def test_the_instruction_mix_counts_each_kernels_own_classes():
    mix = offline.instruction_mix(LISTING)
    assert set(mix) == {"first", "second"}
    assert {name: count for name, count in mix["first"].items() if count} == {
        "scalar_memory": 1, "mfma": 1, "lds": 1, "global_load": 1, "valu": 1, "branch": 1, "salu": 1}
    assert {name: count for name, count in mix["second"].items() if count} == {"global_store": 1, "salu": 1}


def test_check_fails_an_attention_build_without_mfma(monkeypatch):
    """A scalar fallback (an arch guard that missed) compiles, but check must refuse it."""
    from cli import check as check_module
    spec = specs.mfma_attention_specialisations()[0]
    resources = offline.KernelResources("mfma_attention", 100, 0, 50, 0, 0, 0, 1024)
    result = offline.OfflineResult("attention", "gfx942", spec.defines, 0.1, {"mfma_attention": resources}, (),
                                   {"mfma_attention": {"mfma": 0, "valu": 900}})
    monkeypatch.setattr(check_module.offline, "compile_hip", lambda *args: result)
    rows, failure = check_module._compile_hip_one(spec, "gfx942")
    assert rows and rows[0]["mfma"] == 0
    assert failure is not None and "no v_mfma instruction" in failure["log"]
    result = offline.OfflineResult("attention", "gfx942", spec.defines, 0.1, {"mfma_attention": resources}, (),
                                   {"mfma_attention": {"mfma": 24, "valu": 900}})
    monkeypatch.setattr(check_module.offline, "compile_hip", lambda *args: result)
    assert check_module._compile_hip_one(spec, "gfx942")[1] is None


NOTES = """\
Displaying notes found in: .note
  Owner                Data size 	Description
  AMDGPU               0x00000754	NT_AMDGPU_METADATA (AMDGPU Metadata)
    AMDGPU Metadata:
        ---
amdhsa.kernels:
  - .agpr_count:     4
    .args:
      - .offset:         0
        .size:           8
        .value_kind:     global_buffer
    .group_segment_fixed_size: 16384
    .name:           first
    .private_segment_fixed_size: 324
    .sgpr_count:     78
    .sgpr_spill_count: 2
    .vgpr_count:     128
    .vgpr_spill_count: 86
  - .agpr_count:     0
    .group_segment_fixed_size: 0
    .name:           second
    .private_segment_fixed_size: 0
    .sgpr_count:     20
    .vgpr_count:     9
amdhsa.target:   amdgcn-amd-amdhsa--gfx90a
...
"""


@pytest.mark.parametrize("name,expected", [
    ("first", offline.KernelResources("first", 128, 4, 78, 324, 86, 2, 16384)),
    ("second", offline.KernelResources("second", 9, 0, 20, 0, 0, 0, 0)),
])
def test_metadata_reader_takes_each_kernels_own_fields(name, expected):
    fields = offline.kernel_metadata(NOTES)
    assert set(fields) == {"first", "second"}
    assert offline._resources(fields[name]) == expected


@pytest.mark.parametrize("arch,tool", list(offline.COMPILERS.items()))
def test_a_missing_compiler_names_its_debian_packages(arch, tool, monkeypatch):
    monkeypatch.setattr(offline.shutil, "which", lambda name: None if name == tool else f"/usr/bin/{name}")
    with pytest.raises(offline.MissingCompiler, match=f"apt-get install {offline.PACKAGES[tool]}"):
        offline.require_tools([arch])


@pytest.mark.parametrize("arch", ("gfx908", "sm_90", "gfx1100"))
def test_an_arch_the_offline_build_lacks_is_refused_by_name(arch):
    with pytest.raises(ValueError, match=f"arch '{arch}'"):
        offline.compile_hip("copy_blocks", {}, arch)


@needs_compilers("gfx90a")
@pytest.mark.parametrize("defines,error", [({"KVC_OUT_T": "no_such_type"}, "no_such_type")])
def test_a_build_that_fails_reports_the_compilers_log(defines, error):
    with pytest.raises(offline.OfflineCompileError, match=error):
        offline.compile_hip("merge", defines, "gfx90a")


# --- kvcupy check ---------------------------------------------------------------

@pytest.mark.parametrize("arches", [
    pytest.param("gfx90a", marks=needs_compilers("gfx90a")),
    pytest.param("gfx942", marks=needs_compilers("gfx942")),
    pytest.param("sm_90,gfx90a", marks=[needs_compilers("gfx90a"), needs_nvrtc]),
])
def test_check_reports_the_hip_builds_of_each_amd_arch(arches):
    from cli.app import app
    result = CliRunner().invoke(app, ["check", "--arch", arches, "--kernel", "copy_blocks,merge_splits", "--jobs", "2"])
    assert result.exit_code == 0, result.output
    for arch in arches.split(","):
        assert f"│ {arch} " in result.output, result.output
    assert ("kvcupy check (HIP)" in result.output) and ("NVRTC" in result.output) == arches.startswith("sm_")
    assert "PASS" in result.output


@pytest.mark.parametrize("arches,refused", [("gfx908", "gfx908"), ("gfx90a,gfx1030", "gfx1030")])
def test_check_refuses_an_amd_arch_it_does_not_build(arches, refused):
    from cli.app import app
    result = CliRunner().invoke(app, ["check", "--arch", arches])
    assert result.exit_code == 2
    assert f"'{refused}' is not an AMD arch" in " ".join(result.output.replace("│", " ").split())


# --- NVRTC through the wave64 emulation ------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("spec", SAMPLE, ids=spec_id)
def test_every_sampled_build_compiles_for_nvidia_through_the_emulation(spec):
    from tests.hip import emulation
    cubin = emulation.compile_entry(spec.entry, spec.defines)
    for function in spec.functions:
        assert function.encode() + b"\0" in cubin


@needs_nvrtc
def test_the_emulation_probes_compile():
    from tests.hip import emulation
    cubin = emulation.compile_probes()
    for kernel in ("shuffle_probe", "conversion_probe", "e4m3fn_probe"):
        assert kernel.encode() + b"\0" in cubin
