"""Which builds' machine code two kernel source folders compile to differently.

    PYTHONPATH=. python3 tools/cubin_text.py OLD_DIR [NEW_DIR] [--arch sm_90] [--all] [--only TEXT]

Compiles the specialisations `kvcupy check` compiles (its sample; --all: every one)
from each folder (KVCUPY_KERNEL_DIR; NEW_DIR defaults to kernels_cu/) with this
machine's NVRTC, no GPU needed (--only: the builds whose entry and defines
contain TEXT, e.g. prefill_attention or KVC_WGMMA=1), and compares the cubins' .text sections: the
instructions. The rest of a cubin differs between sources whose code is the same
(its sidecar records, symbol tables), so whole-file hashes say nothing. A
refactor that should not change a kernel shows `same` for every build; sources
that do not build under one folder show `new` or `gone`. (Run `git archive REV
kernels_cu | tar -x -C DIR` to get a commit's sources into DIR/kernels_cu.) The
builds are the ones this checkout's launcher lists: a define the old sources do not
know is ignored there, so a build that is new in this checkout compares with
whatever the old sources make of its defines.

A build that spills to local memory under either folder also shows ptxas's
spill bytes, old -> new (`spills 108 -> 0`): a change that leaves a kernel's
meaning alone can still cost registers, and a spill in a tile loop costs time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
from pathlib import Path

from kvcupy import jit
from kvcupy.backends.cuda import specs as cuda_specs

SECTION_HEADER = struct.Struct("<IIQQQQ")   # ELF64: name, type, flags, address, offset, size


def text_sections(cubin: bytes) -> dict[str, str]:
    """sha256 (12 digits) of each .text section of an ELF64 cubin, by section name."""
    header_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [SECTION_HEADER.unpack_from(cubin, header_offset + i * entry_size) for i in range(count)]
    names_at = sections[names_index][4]
    found = {}
    for name, _, _, _, offset, size in sections:
        label = cubin[names_at + name: cubin.index(b"\0", names_at + name)].decode()
        if label.startswith(".text"):
            found[label] = hashlib.sha256(cubin[offset: offset + size]).hexdigest()[:12]
    return found


def compiled_code(folder: str, specs, arch: str, only: str = "") -> dict[str, tuple[dict, int] | str]:
    """Per specialisation (entry and defines), its .text hashes and spill bytes (ptxas's
    stores and loads, over its kernels), or why it did not build."""
    saved = os.environ.get(jit.SOURCE_DIR_ENV)
    os.environ[jit.SOURCE_DIR_ENV] = folder
    code = {}
    try:
        for spec in specs:
            target = spec.target(arch)
            if target is None:
                continue
            key = f"{spec.entry} {target} {jit.define_flags(spec.defines)}"
            if only not in f"{spec.functions[0]} {key}":
                continue
            try:
                result = jit.compile_entry(spec.entry, spec.defines, target)
                code[key] = text_sections(Path(result.path).read_bytes()), sum(result.spills.values())
            except jit.CompileError as error:
                code[key] = f"does not build: {str(error).splitlines()[0]}"
    finally:
        if saved is None:
            os.environ.pop(jit.SOURCE_DIR_ENV, None)
        else:
            os.environ[jit.SOURCE_DIR_ENV] = saved
    return code


def comparison(old: dict, new: dict) -> list[str]:
    """A line a build (compiled_code's results under each folder): same, differs, new,
    gone or unbuilt (each side's error below it), with the spill bytes where any."""
    lines = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key), new.get(key)
        if before is None or after is None:
            verdict = "new" if before is None else "gone"
        elif isinstance(before, str) or isinstance(after, str):
            verdict = "unbuilt"   # (a source that does not compile here: its error, below)
        else:
            verdict = "same" if before[0] == after[0] else "differs"
        spills = [side[1] for side in (before, after) if isinstance(side, tuple)]
        shown = f"  spills {' -> '.join(map(str, spills))}" if any(spills) else ""
        lines.append(f"{verdict:8} {key}{shown}")
        lines += [f"         {side}" for side in (before, after) if isinstance(side, str)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default=str(jit.source_dir()))
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--only", default="", help="only the builds whose entry and defines contain this")
    options = parser.parse_args()
    specs = cuda_specs.specialisations(all=options.all)
    old, new = (compiled_code(folder, specs, options.arch, options.only) for folder in (options.old, options.new))
    print("\n".join(comparison(old, new)))


if __name__ == "__main__":
    main()
