"""What the MFMA attention kernel would reach on an MI300X, estimated from its gfx942
code without AMD hardware: an estimate, not a measurement.

    PYTHONPATH=. python tools/mfma_estimate.py            # print the tables (markdown)
    PYTHONPATH=. python tools/mfma_estimate.py --write    # put them in docs/performance.md
    PYTHONPATH=. python tools/mfma_estimate.py --json

For each KV kind at d = 128 (the bench's geometry: 32 query / 8 KV heads), the
gfx942 build (rocm.offline, Debian's clang++-19) is disassembled and its key-step
loop found: the outermost backward branch whose body holds the v_mfma
instructions. Per step, the instructions of that body, with the staging loop
inside it that reads whole words counted as many times as it iterates (16 keys
x the row's 4-byte words / 64 lanes), the narrow one (unaligned caches) not at
all, each other inner loop once. Registers
and LDS give the waves a SIMD can hold.

The time model, per wave-step on one SIMD of MI300X (304 CUs x 4 SIMDs at
2.1 GHz; 5.3 TB/s of HBM; 1307 dense fp16 TFLOP/s, i.e. 512 flops a cycle a
SIMD, so one 16x16x16 MFMA of 8192 flops keeps the matrix unit 16 cycles): a
wave64 vector instruction takes 4 cycles of its SIMD (16 lanes), an MFMA 16; the
issue time lies between the larger of the two (matrix and vector work of
different waves overlapping fully) and their sum (not at all). LDS, scalar and
memory latency are not modelled; the memory bound is the cache's bytes over
5.3 TB/s. The shapes: decode of 32 sequences x 8192 keys, and a prefill of 8
prompts x 2048 tokens (causal).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcupy.backends.rocm import offline
from kvcupy.backends.rocm.attention import KEYS_PER_STEP, ROWS_PER_TILE, MfmaKernel, head_pad

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ROOT / "docs" / "performance.md"
MARKERS = ("<!-- mfma_estimate -->", "<!-- /mfma_estimate -->")

CUS, SIMDS_PER_CU, CLOCK_HZ, HBM_BYTES_PER_S = 304, 4, 2.1e9, 5.3e12
VALU_CYCLES, MFMA_CYCLES = 4, 16
VGPRS_PER_SIMD_LANE, MAX_WAVES_PER_SIMD, VGPR_GRANULE, LDS_PER_CU = 512, 8, 8, 65536
HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128
KINDS = {"int4": 0, "int8": 1, "fp8": 2, "bf16 rows": 4}
ROW_BYTES = {0: HEAD_SIZE // 2 + 4, 1: HEAD_SIZE + 4, 2: HEAD_SIZE + 4, 4: 2 * HEAD_SIZE}   # a token's K row + scale
WORDS = {0: HEAD_SIZE // 8, 1: HEAD_SIZE // 4, 2: HEAD_SIZE // 4, 4: HEAD_SIZE // 2}   # 4-byte words a row

_LABEL = re.compile(r"^([0-9a-f]+) <(\w+)>:$")
_INSTRUCTION = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*([^/]*)//\s*([0-9A-F]+):")


def listing(kernel: MfmaKernel) -> str:
    with tempfile.TemporaryDirectory() as folder:
        code_object = Path(folder) / "attention.co"
        offline.compile_hip("attention", kernel.defines, "gfx942", keep=code_object)
        resources = offline.read_resources(code_object)["mfma_attention"]
        text = subprocess.run([offline.OBJDUMP, "-d", "--symbolize-operands", str(code_object)],
                              capture_output=True, text=True, check=True).stdout
    return text, resources


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(address, mnemonic, operands) in order; labels as (address, "<label>", name)."""
    found = []
    for line in text.splitlines():
        if match := _LABEL.match(line):
            found.append((int(match.group(1), 16), "<label>", match.group(2)))
        elif match := _INSTRUCTION.match(line):
            found.append((int(match.group(3), 16), match.group(1), match.group(2).strip()))
    return found


def loops(code: list) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each backward branch's body."""
    labels = {name: index for index, (_, mnemonic, name) in enumerate(code) if mnemonic == "<label>"}
    found = []
    for index, (_, mnemonic, operands) in enumerate(code):
        if mnemonic.startswith(("s_cbranch", "s_branch")) and operands in labels and labels[operands] < index:
            found.append((labels[operands], index))
    return found


def classify(mnemonic: str) -> str:
    return next((name for name, pattern in offline.INSTRUCTION_CLASSES if pattern.match(mnemonic)), "other")


def step_mix(code: list, kv: int) -> dict[str, float]:
    """Instructions a key step executes, by class (see the module's docstring)."""
    def counts(first: int, last: int) -> dict[str, int]:
        mix: dict[str, int] = {}
        for _, mnemonic, _ in code[first:last + 1]:
            if mnemonic != "<label>":
                kind = classify(mnemonic)
                mix[kind] = mix.get(kind, 0) + 1
        return mix

    found = loops(code)
    with_mfma = [(a, b) for a, b in found if any(m.startswith("v_mfma") for _, m, _ in code[a:b + 1])]
    first, last = max(with_mfma, key=lambda loop: loop[1] - loop[0])
    total = {name: float(count) for name, count in counts(first, last).items()}
    staging_iterations = math.ceil(KEYS_PER_STEP * WORDS[kv] / 64)
    inner = [(a, b) for a, b in found if first <= a and b <= last and (a, b) != (first, last)]
    outermost = [(a, b) for a, b in inner if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in inner)]
    for a, b in outermost:
        body = counts(a, b)
        if not body.get("global_load"):
            continue
        loads = {mnemonic for _, mnemonic, _ in code[a:b + 1] if classify(mnemonic) == "global_load"}
        # The staging by words runs `staging_iterations` times; the narrow (byte) one not at all.
        times = staging_iterations if loads <= {"global_load_dword"} else 0
        for name, count in body.items():
            total[name] = total.get(name, 0.0) + (times - 1) * count
    return total


def waves_per_simd(resources) -> int:
    registers = -(-(resources.vgprs + resources.agprs) // VGPR_GRANULE) * VGPR_GRANULE
    by_registers = min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD_LANE // registers)
    by_lds = (LDS_PER_CU // max(1, resources.lds_bytes)) // SIMDS_PER_CU   # one-wave blocks
    return max(1, min(by_registers, by_lds))


def shapes() -> dict[str, dict]:
    """Wave-steps, cache bytes and useful flops of the two shapes."""
    group = HEADS // KV_HEADS
    decode_keys = 32 * 8192
    prefill_steps, prefill_keys = 0, 0
    prompt = 2048
    for tile in range(prompt * group // ROWS_PER_TILE):
        seen = (tile * ROWS_PER_TILE + ROWS_PER_TILE - 1) // group + 1
        prefill_steps += math.ceil(seen / KEYS_PER_STEP)
        prefill_keys += seen
    return {
        "decode 32 x 8192": dict(steps=32 * KV_HEADS * 8192 // KEYS_PER_STEP, tokens=decode_keys,
                                 flops=4 * HEADS * HEAD_SIZE * decode_keys),
        "prefill 8 x 2048": dict(steps=8 * KV_HEADS * prefill_steps, tokens=8 * prompt,
                                 flops=8 * 4 * HEADS * HEAD_SIZE * (prompt * (prompt + 1) // 2)),
    }


def estimate() -> list[dict]:
    rows = []
    simds = CUS * SIMDS_PER_CU
    for name, kv in KINDS.items():
        kernel = MfmaKernel(kv, head_pad(HEAD_SIZE))
        text, resources = listing(kernel)
        mix = step_mix(instructions(text), kv)
        vector = mix.get("valu", 0.0) * VALU_CYCLES
        matrix = mix.get("mfma", 0.0) * MFMA_CYCLES
        row = dict(kind=name, vgprs=resources.vgprs, agprs=resources.agprs, lds_bytes=resources.lds_bytes,
                   waves_per_simd=waves_per_simd(resources), step=mix, shapes={})
        for shape, sizes in shapes().items():
            seconds = [sizes["steps"] * cycles / simds / CLOCK_HZ for cycles in (max(vector, matrix), vector + matrix)]
            read = sizes["tokens"] * KV_HEADS * 2 * ROW_BYTES[kv]   # the cache once
            row["shapes"][shape] = dict(issue_us=[s * 1e6 for s in seconds], memory_us=read / HBM_BYTES_PER_S * 1e6,
                                        tflops=[sizes["flops"] / s / 1e12 for s in seconds])
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| KV | VGPRs + AGPRs | LDS | waves / SIMD | a key step: MFMA / VALU / LDS / global loads |",
             "|---|---|---|---|---|"]
    for row in rows:
        step = row["step"]
        lines.append(f"| {row['kind']} | {row['vgprs']} + {row['agprs']} | {row['lds_bytes']} B | "
                     f"{row['waves_per_simd']} | {step.get('mfma', 0):.0f} / {step.get('valu', 0):.0f} / "
                     f"{step.get('lds', 0):.0f} / {step.get('global_load', 0):.0f} |")
    lines += ["", "| KV | shape | HBM bound | issue estimate | at the estimate |", "|---|---|---|---|---|"]
    for row in rows:
        for shape, found in row["shapes"].items():
            low, high = found["issue_us"]
            flops = found["tflops"]
            lines.append(f"| {row['kind']} | {shape} | {found['memory_us']:.0f} us | {low:.0f}-{high:.0f} us | "
                         f"{flops[1]:.0f}-{flops[0]:.0f} TFLOP/s |")
    return "\n".join(lines)


def write(table: str) -> None:
    text = PERFORMANCE.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    PERFORMANCE.write_text(text[:start + len(MARKERS[0])] + "\n" + table + "\n" + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/performance.md")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    rows = estimate()
    if options.json:
        json.dump(rows, sys.stdout, indent=1)
        return 0
    table = markdown(rows)
    if options.write:
        write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
