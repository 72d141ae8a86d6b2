"""Compile a kernels_hip/ entry for an AMD GPU without one: Debian's compilers, no ROCm runtime.

`compile_hip(entry, defines, arch)` builds `kernels_hip/<entry>.hip` with the
-D defines the launcher passes, for one arch, device code only, and reads the
code object's AMDGPU metadata: registers, spills, scratch and LDS per kernel.
`kvcupy check --arch gfx90a,gfx942` runs it over `rocm.specs`. The runtime
build (hipRTC, jit.py) compiles the same sources with the same defines.

Compilers, by arch (Debian 12's packages):
- gfx90a: `hipcc` (ROCm 5.2, clang 15): packages hipcc and libamdhip64-dev;
- gfx942: `clang++-19` with ROCm 5.2's headers and device libraries
  (clang 15 does not know gfx942): packages clang-19, lld-19, libamdhip64-dev.
  The 5.2 device libraries have no oclc_isa_version_942.bc; gfx940's, which
  the gfx94x targets share, serves under that name from a temporary folder.
The metadata comes from `llvm-readelf-19 --notes`, the instruction mix of each
kernel from `llvm-objdump-19 -d` (package llvm-19).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ... import jit

ARCHES = ("gfx90a", "gfx942")
# The run-time build's own options (separate roundings: hip_compat.h says why).
BASE_OPTIONS = jit.HIP_BASE_OPTIONS
DEVICE_LIBRARIES = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")
READELF = "llvm-readelf-19"
OBJDUMP = "llvm-objdump-19"
COMPILERS = {"gfx90a": "hipcc", "gfx942": "clang++-19"}
PACKAGES = {"hipcc": "hipcc libamdhip64-dev", "clang++-19": "clang-19 lld-19 libamdhip64-dev", READELF: "llvm-19", OBJDUMP: "llvm-19"}


class MissingCompiler(RuntimeError):
    """A tool the offline build needs is not installed; the message names its Debian packages."""


class OfflineCompileError(RuntimeError):
    """The compiler rejected a specialisation; `log` is its output."""

    def __init__(self, entry: str, arch: str, command: list[str], log: str):
        super().__init__(f"{entry}.hip did not compile for {arch}:\n{log}")
        self.entry, self.arch, self.command, self.log = entry, arch, command, log


@dataclass(frozen=True)
class KernelResources:
    """One kernel's resources as its code object records them (per lane, but LDS: per block)."""
    name: str
    vgprs: int
    agprs: int
    sgprs: int
    scratch_bytes: int     # private segment: spilled registers and local arrays
    vgpr_spills: int
    sgpr_spills: int
    lds_bytes: int         # group segment: static shared memory


@dataclass(frozen=True)
class OfflineResult:
    entry: str
    arch: str
    defines: dict
    seconds: float
    kernels: dict          # name -> KernelResources
    command: tuple
    instructions: dict     # name -> {instruction class: count} (instruction_mix)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise MissingCompiler(f"{name} is not installed: apt-get install {PACKAGES[name]} (Debian 12)")
    return found


def require_tools(arches) -> None:
    """MissingCompiler, naming the Debian packages, unless every tool `arches` need is installed."""
    for arch in arches:
        _check_arch(arch)
        _tool(COMPILERS[arch])
    _tool(READELF)
    _tool(OBJDUMP)


def _check_arch(arch: str) -> None:
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r}: the offline HIP build targets {', '.join(ARCHES)}")


def _device_library_folder(folder: Path) -> Path:
    """ROCm 5.2's device libraries, plus gfx940's ISA library as gfx942's, linked in `folder`."""
    if not (DEVICE_LIBRARIES / "ocml.bc").is_file():
        raise MissingCompiler(f"ROCm device libraries are missing from {DEVICE_LIBRARIES}: "
                              "apt-get install libamdhip64-dev (Debian 12; it brings rocm-device-libs)")
    folder.mkdir()
    for library in DEVICE_LIBRARIES.glob("*.bc"):
        (folder / library.name).symlink_to(library)
    gfx942 = folder / "oclc_isa_version_942.bc"
    if not gfx942.exists():
        gfx942.symlink_to(DEVICE_LIBRARIES / "oclc_isa_version_940.bc")
    return folder


def compile_command(entry: str, defines: Mapping[str, object], arch: str, output: Path,
                    device_libraries: Path | None = None) -> list[str]:
    """The compiler's command line: one arch, device code only, the code object itself (no bundle)."""
    _check_arch(arch)
    includes = [f"-I{folder}" for folder in jit.hip_include_dirs()]
    source = jit.hip_include_dirs()[0] / f"{entry}.hip"
    if not source.is_file():
        raise ValueError(f"entry {entry!r}: {source} does not exist")
    if arch == "gfx90a":
        compiler = [_tool("hipcc")]
    else:
        if device_libraries is None:
            raise ValueError("device_libraries: clang++-19 builds for gfx942 need the prepared library folder")
        compiler = [_tool("clang++-19"), "--rocm-path=/usr", f"--rocm-device-lib-path={device_libraries}"]
    return [*compiler, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "--no-gpu-bundle-output",
            *BASE_OPTIONS, *includes, *jit.define_flags(defines), "-c", str(source), "-o", str(output)]


_KERNEL_START = re.compile(r"^  - \.(\w+):\s*(.*)$")
_KERNEL_FIELD = re.compile(r"^    \.(\w+):\s*(\S.*)$")


def kernel_metadata(notes: str) -> dict[str, dict[str, str]]:
    """The scalar fields of each kernel in `llvm-readelf --notes` output (its
    amdhsa.kernels YAML list), by kernel name; nested lists (.args) are left out."""
    kernels, current, inside = [], None, False
    for line in notes.splitlines():
        if line.startswith("amdhsa.kernels:"):
            inside = True
            continue
        if inside and line and not line.startswith(" "):   # the next top-level key
            inside = False
        if not inside:
            continue
        if found := _KERNEL_START.match(line):
            current = {}
            kernels.append(current)
            current[found.group(1)] = found.group(2).strip()
        elif current is not None and (found := _KERNEL_FIELD.match(line)):
            current[found.group(1)] = found.group(2).strip()
    return {fields["name"]: fields for fields in kernels if "name" in fields}


def _resources(fields: dict[str, str]) -> KernelResources:
    def number(key: str) -> int:
        return int(fields.get(key, "0"), 0)

    return KernelResources(fields["name"], number("vgpr_count"), number("agpr_count"), number("sgpr_count"),
                           number("private_segment_fixed_size"), number("vgpr_spill_count"),
                           number("sgpr_spill_count"), number("group_segment_fixed_size"))


def read_resources(code_object: Path) -> dict[str, KernelResources]:
    """Each kernel's resources, from the code object's AMDGPU metadata note."""
    completed = subprocess.run([_tool(READELF), "--notes", str(code_object)], capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{READELF} could not read {code_object}: {completed.stderr.strip()}")
    return {name: _resources(fields) for name, fields in kernel_metadata(completed.stdout).items()}


# Instruction classes of a kernel's disassembly, by mnemonic (the first match counts).
INSTRUCTION_CLASSES = (
    ("mfma", re.compile(r"v_mfma_")),
    ("lds", re.compile(r"ds_")),
    ("global_load", re.compile(r"(global|buffer|flat)_load")),
    ("global_store", re.compile(r"(global|buffer|flat)_store")),
    ("scalar_memory", re.compile(r"s_(load|buffer_load|store)")),
    ("branch", re.compile(r"s_(cbranch|branch|setpc|swappc)")),
    ("valu", re.compile(r"v_")),
    ("salu", re.compile(r"s_")),
)
_LISTING_KERNEL = re.compile(r"^[0-9a-f]+ <([\w.]+)>:$")
_LISTING_INSTRUCTION = re.compile(r"^\s+([a-z_][a-z0-9_]*)\b")


def instruction_mix(listing: str) -> dict[str, dict[str, int]]:
    """{kernel: {class: count}} of `llvm-objdump -d` output: each instruction's mnemonic
    in the first INSTRUCTION_CLASSES class it matches, "other" where none does."""
    mixes, current = {}, None
    for line in listing.splitlines():
        if found := _LISTING_KERNEL.match(line):
            current = mixes.setdefault(found.group(1), {name: 0 for name, _ in INSTRUCTION_CLASSES} | {"other": 0})
        elif current is not None and (found := _LISTING_INSTRUCTION.match(line)):
            mnemonic = found.group(1)
            kind = next((name for name, pattern in INSTRUCTION_CLASSES if pattern.match(mnemonic)), "other")
            current[kind] += 1
    return mixes


def read_instruction_mix(code_object: Path) -> dict[str, dict[str, int]]:
    completed = subprocess.run([_tool(OBJDUMP), "-d", str(code_object)], capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{OBJDUMP} could not read {code_object}: {completed.stderr.strip()}")
    return instruction_mix(completed.stdout)


def compile_hip(entry: str, defines: Mapping[str, object] | None = None, arch: str = "gfx90a",
                keep: Path | None = None) -> OfflineResult:
    """Build `kernels_hip/<entry>.hip` for `arch` and read its kernels' resources.
    keep: a path to copy the code object to (it is built in a temporary folder)."""
    _check_arch(arch)
    defines = dict(defines or {})
    environment = {**os.environ, "HIP_PLATFORM": "amd"}   # nvcc on the PATH would make hipcc a CUDA driver
    with tempfile.TemporaryDirectory(prefix="kvcupy-hip-") as scratch:
        folder = Path(scratch)
        libraries = _device_library_folder(folder / "device-libs") if arch == "gfx942" else None
        output = folder / f"{entry}.{arch}.co"
        command = compile_command(entry, defines, arch, output, libraries)
        started = time.perf_counter()
        completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=folder)
        seconds = time.perf_counter() - started
        if completed.returncode != 0 or not output.is_file():
            raise OfflineCompileError(entry, arch, command, (completed.stderr + completed.stdout).strip())
        kernels = read_resources(output)
        instructions = read_instruction_mix(output)
        if keep is not None:
            shutil.copyfile(output, keep)
    return OfflineResult(entry, arch, defines, seconds, kernels, tuple(command),
                         {name: instructions.get(name, {}) for name in kernels})
