"""The attention launcher's shared-memory arithmetic (kernels.py's
`shared_bytes`, what it allocates) equals the kernels' own (`kSharedBytes`,
what they use), for the sample `kvcupy check` compiles: both builds of the
prefill kernel and the decode kernel's stagings. The constants come from the
PTX NVRTC emits (no GPU needed); a launcher that allocated less than its
kernel uses would fault only on a GPU.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cupy", reason="needs CuPy (the cuda13 extra)")
try:
    from cupy.cuda import nvrtc
    nvrtc.getVersion()
except Exception as error:   # CuPy is there but libnvrtc is not
    pytest.skip(f"NVRTC is not loadable: {error}", allow_module_level=True)

from kvcupy import jit  # noqa: E402
from kvcupy.backends.cuda import specs  # noqa: E402
from kvcupy.backends.cuda.kernels import Kernel, PrefillKernel  # noqa: E402

KERNELS = [spec for spec in specs.attention_specialisations(all=False)
           if spec.functions[0] in ("paged_attention", "prefill_attention")]


def ptx(defines: dict, arch: str) -> str:
    root = jit.source_dir()
    source = root / "attention.cu"
    options = ["--std=c++17", f"--gpu-architecture=compute_{arch[3:]}", *jit.define_flags(defines), f"-I{root}",
               *jit.cuda_include_options()]
    program = nvrtc.createProgram(source.read_text(), str(source), [], [])
    nvrtc.compileProgram(program, options)
    return nvrtc.getPTX(program).decode().rstrip("\x00")


def launcher_kernel(defines: dict) -> Kernel | PrefillKernel:
    if "KVC_PREFILL_KV" in defines:
        return PrefillKernel(defines["KVC_PREFILL_KV"], defines["KVC_HEAD_PAD"], defines["KVC_TILE"],
                             defines["KVC_CHUNK"], defines["KVC_WARPS"], bool(defines.get("KVC_WGMMA", 0)),
                             bool(defines.get("KVC_PRODUCER", 0)), bool(defines.get("KVC_DIRECT", 0)),
                             bool(defines.get("KVC_ROTATED", 1)), wide_rows=bool(defines.get("KVC_WIDE_ROWS", 1)),
                             min_blocks=defines["KVC_MIN_BLOCKS"])
    return Kernel(defines["KVC_ATTN_KV"], defines["KVC_HEAD_PAD"], defines["KVC_HEADS"], defines["KVC_QUADS"],
                  defines["KVC_TILE"], defines["KVC_CHUNK"], defines["KVC_STAGING"], defines["KVC_STAGES"])


def kernel_constant(text: str, kernel: Kernel | PrefillKernel) -> int:
    """kSharedBytes of the kernel's own template instance (Itanium-mangled in the PTX)."""
    if isinstance(kernel, PrefillKernel):
        arguments = (kernel.kv, kernel.head_pad, kernel.warps, kernel.tile, kernel.stages, kernel.chunk)
        flags = (kernel.wgmma, kernel.producer, kernel.direct)
        name = "7PrefillI" + "".join(f"Li{a}E" for a in arguments) + "".join(f"Lb{int(f)}E" for f in flags)
    else:
        arguments = (kernel.kv, kernel.head_pad, kernel.heads, kernel.quads, kernel.tile, kernel.stages,
                     kernel.chunk)
        name = "6TraitsI" + "".join(f"Li{a}E" for a in arguments)
    found = re.search(rf"_ZN8kvc_attn{name}E12kSharedBytesE = (\d+);", text)
    assert found, f"no kSharedBytes of {name} in the PTX"
    return int(found.group(1))


@pytest.mark.parametrize("spec", KERNELS, ids=lambda spec: ",".join(f"{name.removeprefix('KVC_')}={value}"
                                                                  for name, value in spec.defines.items()))
def test_launcher_allocates_what_the_kernel_uses(spec):
    kernel = launcher_kernel(spec.defines)
    assert kernel.defines == spec.defines   # the same specialisation, rebuilt from its defines
    assert kernel_constant(ptx(spec.defines, spec.arch or "sm_90"), kernel) == kernel.shared_bytes


def test_the_sample_holds_every_prefill_build():
    builds = {(kernel.wgmma, kernel.producer) for kernel in (launcher_kernel(spec.defines) for spec in KERNELS
                                                             if "KVC_PREFILL_KV" in spec.defines)}
    assert builds == {(False, False), (True, False), (True, True)}
