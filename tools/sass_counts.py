"""Opcode counts of a kernel build's machine code: the whole kernel and each loop.

    PYTHONPATH=. python3 tools/sass_counts.py ENTRY 'DEFINES_JSON' [--arch sm_90] [--top 25]

Compiles kernels_cu/ENTRY.cu with the defines as the launcher would
(jit.compile_entry; no GPU needed), disassembles the cubin with `cuobjdump -sass`
(on PATH, or from the nvidia-cuda-cuobjdump wheel: `pip install
nvidia-cuda-cuobjdump`) and prints, for every kernel in it, its instruction
count and opcodes by frequency, then the same for each loop: the span from a
backward branch's target to the branch (inner loops and rarely taken paths
included; the counts are of the code, not of what runs). Opcodes keep their
modifiers (`LOP3.LUT`, `HMMA.16816.F32`); predicates are dropped. E.g. the int4
decode build of 64-token tiles at d = 128:

    python3 tools/sass_counts.py attention '{"KVC_ATTN_KV": 0, "KVC_HEAD_PAD": 128,
        "KVC_HEADS": 8, "KVC_QUADS": 1, "KVC_TILE": 64, "KVC_STAGES": 3,
        "KVC_CHUNK": 16, "KVC_MIN_BLOCKS": 1, "KVC_STAGING": 2}'

(`kvcupy.backends.cuda.kernels.Kernel(...).defines` gives a build's defines.)
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvcupy import jit

FUNCTION = re.compile(r"^\s*Function : (\S+)")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P[0-9T]\s+")
BRANCH_TARGET = re.compile(r"\bBRA(?:\.\S+)?\s+(?:!?U?P[0-9T],\s*)?0x([0-9a-f]+)")


def cuobjdump() -> str:
    """The cuobjdump to run: one on PATH, else the nvidia-cuda-cuobjdump wheel's."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    raise SystemExit("no cuobjdump: put one on PATH or pip install nvidia-cuda-cuobjdump")


def kernels(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each kernel's instructions as (address, text without predicate), in order."""
    found: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if match := FUNCTION.match(line):
            current = found.setdefault(match.group(1), [])
        elif current is not None and (match := INSTRUCTION.match(line)):
            current.append((int(match.group(1), 16), PREDICATE.sub("", match.group(2))))
    return found


def opcode(text: str) -> str:
    return text.split()[0] if text.split() else text


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of every backward branch's span, largest first."""
    spans = set()
    for address, text in code:
        if (match := BRANCH_TARGET.search(text)) and int(match.group(1), 16) <= address:
            spans.add((int(match.group(1), 16), address))
    return sorted(spans, key=lambda span: span[0] - span[1])


def report(title: str, instructions: list[str], top: int) -> None:
    counts = collections.Counter(opcode(text) for text in instructions)
    print(f"{title}: {len(instructions)} instructions")
    for name, count in counts.most_common(top):
        print(f"  {count:6d}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entry")
    parser.add_argument("defines", help="a JSON object of -D defines")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--top", type=int, default=25, help="opcodes listed per span")
    args = parser.parse_args()
    result = jit.compile_entry(args.entry, json.loads(args.defines), args.arch)
    print(f"{result.key}: registers {result.registers}, spills {result.spills}")
    with tempfile.TemporaryDirectory() as folder:
        # A cubin cached before jit kept the whole image lacks its last byte: cuobjdump needs it.
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(jit.whole_cubin(result.path.read_bytes()))
        sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    for name, code in kernels(sass).items():
        report(name, [text for _, text in code], args.top)
        for first, last in loops(code):
            body = [text for address, text in code if first <= address <= last]
            report(f"{name} loop {first:#x}..{last:#x}", body, args.top)


if __name__ == "__main__":
    main()
