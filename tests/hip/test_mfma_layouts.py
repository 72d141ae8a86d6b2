"""The MFMA layer (kernels_hip/mfma.h) without a GPU.

(a) A NumPy model of each instruction's lane layout, (lane, element) -> matrix
position, checked to cover A, B and D exactly once and against two sources
that do not derive from it: the closed forms kernels_hip/mfma_on_cuda.cuh
states, and the AMD matrix instruction calculator's own text (its formulas
and --matrix-layout rows, ROCm/amd_matrix_instruction_calculator v1.3.2).
(b) kernels_hip/mfma_probe.hip compiled offline for gfx90a and gfx942 (Debian's
compilers, as tests/hip/test_hip_builds.py): each probe holds its wrapper's
v_mfma instruction, and only the arch's own. (c) The same probe compiled by
NVRTC through the emulation, which tests/gpu/test_mfma_emulation.py runs.

`probe_case` builds the inputs and NumPy's D of a probe run; the GPU test uses it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from kvcupy.backends.rocm import offline

from .emulation import nvrtc_missing

OBJDUMP = "llvm-objdump-19"


# --- (a) the layouts --------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    depth: int          # K: A is 16 x K, B is K x 16
    element_bits: int   # of A's and B's elements

    @property
    def per_lane(self) -> int:
        return self.depth // 4


X16_16BIT, X16_8BIT, X32_8BIT = Shape(16, 16), Shape(16, 8), Shape(32, 8)


def owners(shape: Shape) -> dict[str, np.ndarray]:
    """Which lane element holds each matrix entry, as lane * per_lane + e (D: lane * 4 + e):
    the wave is 4 groups of 16 lanes, group g holding k = per_lane * g .. in order (A, B)
    and rows 4g .. 4g+3 (D), lane 16 g + x taking row x of A and column x of B and D."""
    held = np.arange(64 * shape.per_lane).reshape(4, 16, shape.per_lane)   # [g, x, e]
    b = held.transpose(0, 2, 1).reshape(shape.depth, 16)                   # B[per_lane g + e][x]
    d = np.arange(256).reshape(4, 16, 4).transpose(0, 2, 1).reshape(16, 16)  # D[4g + e][x]
    return {"A": b.T.copy(), "B": b, "D": d}


def closed_form(shape: Shape, matrix: str, lane: int, e: int) -> tuple[int, int]:
    """mfma_on_cuda.cuh's header: A[l%16][K/4*(l/16)+e], B[K/4*(l/16)+e][l%16], D[4*(l/16)+e][l%16]."""
    if matrix == "A":
        return lane % 16, shape.per_lane * (lane // 16) + e
    if matrix == "B":
        return shape.per_lane * (lane // 16) + e, lane % 16
    return 4 * (lane // 16) + e, lane % 16


def register_of(element_bits: int, e: int) -> tuple[int, int]:
    """(register, lowest bit) of element e of an operand: little-endian in 32-bit registers
    (clang's ext_vector operands; the calculator's v0.[15:0], v0.[31:16], ...)."""
    per_register = 32 // element_bits
    return e // per_register, element_bits * (e % per_register)


@pytest.mark.parametrize("shape", (X16_16BIT, X16_8BIT, X32_8BIT), ids=("16x16x16-16bit", "16x16x16-8bit", "16x16x32-8bit"))
def test_the_model_covers_every_entry_once_and_is_the_closed_form(shape):
    for matrix, held in owners(shape).items():
        count = 4 if matrix == "D" else shape.per_lane
        rows, columns = {"A": (16, shape.depth), "B": (shape.depth, 16), "D": (16, 16)}[matrix]
        assert held.shape == (rows, columns)
        assert np.array_equal(np.sort(held.ravel()), np.arange(64 * count)), f"{matrix}: not a bijection"
        for lane in range(64):
            for e in range(count):
                assert held[closed_form(shape, matrix, lane, e)] == lane * count + e, (matrix, lane, e)


# The calculator's "Register to matrix element mapping" (--detail-instruction), verbatim.
CALCULATOR_FORMULAS = {
    # CDNA3 v_mfma_f32_16x16x16_f16 (CDNA2's 16x16x16f16 and the bf16_1k ones: the same layout).
    X16_16BIT: """
        A i: (lane % 16)
        A k: 4 * floor(lane / 16) + 2 * GPR_num + floor(GPR_bits / 16)
        B j: (lane % 16)
        B k: 4 * floor(lane / 16) + 2 * GPR_num + floor(GPR_bits / 16)
        C or D i: 4 * floor(lane / 16) + (GPR_num % 4)
        C or D j: (lane % 16)
    """,
    # CDNA2 v_mfma_i32_16x16x16i8.
    X16_8BIT: """
        A k: 4 * floor(lane / 16) + floor(GPR_bits / 8)
    """,
    # CDNA3 v_mfma_i32_16x16x32_i8 / v_mfma_f32_16x16x32_fp8_fp8.
    X32_8BIT: """
        A k: 8 * floor(lane / 16) + 4 * GPR_num + floor(GPR_bits / 8)
        C or D i: 4 * floor(lane / 16) + (GPR_num % 4)
    """,
}

# Its "Matrix element to register mapping" for CDNA3 v_mfma_f32_16x16x16_f16, verbatim.
CALCULATOR_PLACEMENT = """
        A[i][k].block GPR: (floor(k / 2) % 2).[16*(k % 2)+15 : 16*(k % 2)]
        A[i][k].block Lane: 16 * floor(k / 4) + i
        B[k][j].block GPR: (floor(k / 2) % 2).[16*(k % 2)+15 : 16*(k % 2)]
        B[k][j].block Lane: 16 * floor(k / 4) + j
        C or D[i][j].block GPR: (i % 4)
        C or D[i][j].block Lane: 16 * floor(i / 4) + j
"""


def _formulas(text: str) -> dict[str, str]:
    return {name.strip(): formula.strip() for name, formula in
            (line.split(":", 1) for line in text.strip().splitlines())}


def _evaluate(formula: str, **names) -> int:
    value = eval(formula, {"__builtins__": {}, "floor": math.floor}, names)   # the calculator's arithmetic, trusted text
    assert value == int(value)
    return int(value)


@pytest.mark.parametrize("shape", list(CALCULATOR_FORMULAS), ids=("16x16x16-16bit", "16x16x16-8bit", "16x16x32-8bit"))
def test_the_model_matches_the_calculators_formulas(shape):
    formulas = _formulas(CALCULATOR_FORMULAS[shape])
    held = owners(shape)
    checked = 0
    for lane in range(64):
        for matrix, count, bits in (("A", shape.per_lane, shape.element_bits), ("B", shape.per_lane, shape.element_bits),
                                    ("D", 4, 32)):
            for e in range(count):
                register, low_bit = register_of(bits, e)
                names = {"lane": lane, "GPR_num": register, "GPR_bits": low_bit}
                prefix = "C or D" if matrix == "D" else matrix
                for axis, coordinate in zip((("i", "k"), ("k", "j"), ("i", "j"))["ABD".index(matrix)],
                                            np.argwhere(held[matrix] == lane * count + e)[0]):
                    if f"{prefix} {axis}" in formulas:
                        assert _evaluate(formulas[f"{prefix} {axis}"], **names) == coordinate, (matrix, axis, lane, e)
                        checked += 1
    assert checked >= 64 * shape.per_lane   # at least A's k for every lane element


def test_the_model_matches_the_calculators_placement_of_each_entry():
    formulas = _formulas(CALCULATOR_PLACEMENT)
    held = owners(X16_16BIT)
    for matrix, (first, second), prefix, count, bits in (("A", "ik", "A[i][k]", 4, 16), ("B", "kj", "B[k][j]", 4, 16),
                                                         ("D", "ij", "C or D[i][j]", 4, 32)):
        for position in np.ndindex(held[matrix].shape):
            names = dict(zip((first, second), map(int, position)))
            lane = _evaluate(formulas[f"{prefix}.block Lane"], **names)
            register_text = formulas[f"{prefix}.block GPR"]
            found = re.fullmatch(r"(.+)\.\[(.+) : (.+)\]", register_text)
            register, low_bit = (_evaluate(found.group(1), **names), _evaluate(found.group(3), **names)) if found else (
                _evaluate(register_text, **names), 0)
            e = next(e for e in range(count) if register_of(bits, e) == (register, low_bit))
            assert held[matrix][position] == lane * count + e, (matrix, position)


# The calculator's --matrix-layout rows (lanes 0, 1, 15, 16, 31, 32, 47, 48, 63), verbatim:
# CDNA3 v_mfma_i32_16x16x32_i8 (v_mfma_f32_16x16x32_fp8_fp8's are the same) and CDNA2 v_mfma_i32_16x16x16i8.
CALCULATOR_ROWS = {
    (X32_8BIT, "B"): """
| 0 | B[0][0] | B[1][0] | B[2][0] | B[3][0] | B[4][0] | B[5][0] | B[6][0] | B[7][0] |
| 1 | B[0][1] | B[1][1] | B[2][1] | B[3][1] | B[4][1] | B[5][1] | B[6][1] | B[7][1] |
| 15 | B[0][15] | B[1][15] | B[2][15] | B[3][15] | B[4][15] | B[5][15] | B[6][15] | B[7][15] |
| 16 | B[8][0] | B[9][0] | B[10][0] | B[11][0] | B[12][0] | B[13][0] | B[14][0] | B[15][0] |
| 31 | B[8][15] | B[9][15] | B[10][15] | B[11][15] | B[12][15] | B[13][15] | B[14][15] | B[15][15] |
| 32 | B[16][0] | B[17][0] | B[18][0] | B[19][0] | B[20][0] | B[21][0] | B[22][0] | B[23][0] |
| 47 | B[16][15] | B[17][15] | B[18][15] | B[19][15] | B[20][15] | B[21][15] | B[22][15] | B[23][15] |
| 48 | B[24][0] | B[25][0] | B[26][0] | B[27][0] | B[28][0] | B[29][0] | B[30][0] | B[31][0] |
| 63 | B[24][15] | B[25][15] | B[26][15] | B[27][15] | B[28][15] | B[29][15] | B[30][15] | B[31][15] |
""",
    (X32_8BIT, "D"): """
| 0 | D[0][0] | D[1][0] | D[2][0] | D[3][0] |
| 1 | D[0][1] | D[1][1] | D[2][1] | D[3][1] |
| 15 | D[0][15] | D[1][15] | D[2][15] | D[3][15] |
| 16 | D[4][0] | D[5][0] | D[6][0] | D[7][0] |
| 31 | D[4][15] | D[5][15] | D[6][15] | D[7][15] |
| 32 | D[8][0] | D[9][0] | D[10][0] | D[11][0] |
| 47 | D[8][15] | D[9][15] | D[10][15] | D[11][15] |
| 48 | D[12][0] | D[13][0] | D[14][0] | D[15][0] |
| 63 | D[12][15] | D[13][15] | D[14][15] | D[15][15] |
""",
    (X16_8BIT, "B"): """
| 0 | B[0][0] | B[1][0] | B[2][0] | B[3][0] |
| 1 | B[0][1] | B[1][1] | B[2][1] | B[3][1] |
| 15 | B[0][15] | B[1][15] | B[2][15] | B[3][15] |
| 16 | B[4][0] | B[5][0] | B[6][0] | B[7][0] |
| 31 | B[4][15] | B[5][15] | B[6][15] | B[7][15] |
| 32 | B[8][0] | B[9][0] | B[10][0] | B[11][0] |
| 47 | B[8][15] | B[9][15] | B[10][15] | B[11][15] |
| 48 | B[12][0] | B[13][0] | B[14][0] | B[15][0] |
| 63 | B[12][15] | B[13][15] | B[14][15] | B[15][15] |
""",
}


@pytest.mark.parametrize("shape,matrix", list(CALCULATOR_ROWS), ids=("16x16x32-B", "16x16x32-D", "16x16x16-8bit-B"))
def test_the_model_matches_the_calculators_layout_rows(shape, matrix):
    held = owners(shape)[matrix]
    count = 4 if matrix == "D" else shape.per_lane
    rows = CALCULATOR_ROWS[shape, matrix].strip().splitlines()
    assert len(rows) == 9
    for row in rows:
        lane, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == count
        for e, cell in enumerate(cells):
            position = tuple(int(x) for x in re.fullmatch(rf"{matrix}\[(\d+)\]\[(\d+)\]", cell).groups())
            assert held[position] == int(lane) * count + e, (lane, e, cell)


# --- the probes and their NumPy reference -------------------------------------------

@dataclass(frozen=True)
class Probe:
    kind: str    # "f16", "bf16", "i8", "fp8"
    shape: Shape
    arches: tuple[str, ...]                 # offline builds holding the probe
    instructions: dict[str, str]            # arch -> the v_mfma spellings its disassembly may show (regex)


F16_X16, BF16_X16 = r"v_mfma_f32_16x16x16_?f16", r"v_mfma_f32_16x16x16_?bf16(_1k)?"
I8_X16, I8_X32, FP8_X32 = r"v_mfma_i32_16x16x16_?i8", r"v_mfma_i32_16x16x32_?i8", r"v_mfma_f32_16x16x32_fp8_fp8"

PROBES = {
    "mfma_f16_probe": Probe("f16", X16_16BIT, ("gfx90a", "gfx942"), {"gfx90a": F16_X16, "gfx942": F16_X16}),
    "mfma_bf16_probe": Probe("bf16", X16_16BIT, ("gfx90a", "gfx942"), {"gfx90a": BF16_X16, "gfx942": BF16_X16}),
    "mfma_i8_16x16x16_probe": Probe("i8", X16_8BIT, ("gfx90a",), {"gfx90a": I8_X16}),
    # gfx90a has no 16x16x32 i8: two 16x16x16 a product.
    "mfma_i8_16x16x32_probe": Probe("i8", X32_8BIT, ("gfx90a", "gfx942"), {"gfx90a": I8_X16, "gfx942": I8_X32}),
    "mfma_i8_16x16x32_halves_probe": Probe("i8", X32_8BIT, ("gfx90a",), {"gfx90a": I8_X16}),
    "mfma_fp8_probe": Probe("fp8", X32_8BIT, ("gfx942",), {"gfx942": FP8_X32}),
}
EMULATION_ONLY = ("e4m3fnuz_probe",)


def _e4m3fnuz_exact_codes() -> np.ndarray:
    """e4m3fnuz codes of 0 and of magnitudes 1/2 .. 16: multiples of 2^-4 whose products
    (multiples of 2^-8, at most 256) sum exactly in f32 over 64 terms."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float64)
    keep = (values == 0) | ((np.abs(values) >= 0.5) & (np.abs(values) <= 16))
    return np.flatnonzero(keep).astype(np.uint8)


def _wrap_i32(x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.int64) + 2**31) % 2**32 - 2**31).astype(np.int32)


def probe_case(probe: Probe, waves: int, calls: int, rng: np.random.Generator):
    """(a bits [waves, calls, 16, K], b bits [waves, calls, K, 16], c [waves, 16, 16], NumPy's d):
    d[w] = sum over n of a[w][n] @ b[w][n] + c[w]. Every sum is exact in the result type
    (f32: integers below 2^24, fp8 multiples of 2^-8 below 2^15), so the emulation's
    order of additions cannot change it; i8 sums wrap, row 0 and 1 of C sitting at int32's ends."""
    depth = probe.shape.depth
    a_shape, b_shape = (waves, calls, 16, depth), (waves, calls, depth, 16)

    def distinct(shape, low, high):   # entries of each matrix distinct as far as the range allows
        count = int(np.prod(shape[2:]))
        picks = [np.concatenate([rng.permutation(np.arange(low, high)) for _ in range(-(-count // (high - low)))])[:count]
                 for _ in range(shape[0] * shape[1])]
        return np.stack(picks).reshape(shape)

    if probe.kind in ("f16", "bf16"):
        a, b = distinct(a_shape, -128, 128), distinct(b_shape, -128, 128)
        c = distinct((waves, 1, 16, 16), -4096, 4096).reshape(waves, 16, 16).astype(np.float32)
        dtype = np.float16 if probe.kind == "f16" else ml_dtypes.bfloat16
        a_bits, b_bits = a.astype(dtype).view(np.uint16), b.astype(dtype).view(np.uint16)
        d = (np.einsum("wnik,wnkj->wij", a.astype(np.float64), b.astype(np.float64)) + c).astype(np.float32)
    elif probe.kind == "i8":
        a, b = distinct(a_shape, -128, 128), distinct(b_shape, -128, 128)
        c = rng.integers(-2**31, 2**31, size=(waves, 16, 16), dtype=np.int64)
        c[:, 0, :], c[:, 1, :] = 2**31 - 1 - rng.integers(0, 100, 16), -2**31 + rng.integers(0, 100, 16)
        a_bits, b_bits = a.astype(np.int8).view(np.uint8), b.astype(np.int8).view(np.uint8)
        d = _wrap_i32(np.einsum("wnik,wnkj->wij", a.astype(np.int64), b.astype(np.int64)) + c)
        c = c.astype(np.int32)
    else:
        codes = _e4m3fnuz_exact_codes()
        a_bits, b_bits = rng.choice(codes, size=a_shape), rng.choice(codes, size=b_shape)
        c = distinct((waves, 1, 16, 16), -1024, 1024).reshape(waves, 16, 16).astype(np.float32)
        a, b = (bits.view(ml_dtypes.float8_e4m3fnuz).astype(np.float64) for bits in (a_bits, b_bits))
        d = (np.einsum("wnik,wnkj->wij", a, b) + c).astype(np.float32)
    return np.ascontiguousarray(a_bits), np.ascontiguousarray(b_bits), c, d


@pytest.mark.parametrize("name", list(PROBES))
def test_the_reference_cases_are_exact_and_not_symmetric(name):
    """The cases the GPU test runs: D differs from what a transposed A would give, i8 sums
    wrap, and float sums are exact in f32 whatever the order of the additions."""
    probe = PROBES[name]
    a_bits, b_bits, c, d = probe_case(probe, 2, 2, np.random.default_rng(1))
    assert a_bits.dtype == b_bits.dtype == (np.uint16 if probe.shape.element_bits == 16 else np.uint8)
    assert d.shape == c.shape == (2, 16, 16)
    if probe.kind == "i8":
        a, b = a_bits.view(np.int8).astype(np.int64), b_bits.view(np.int8).astype(np.int64)
        assert (np.einsum("wnik,wnkj->wij", a, b) + c != d).any(), "no int32 sum wraps"
    else:
        decode = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fnuz}[probe.kind]
        a, b = (bits.view(decode).astype(np.float64) for bits in (a_bits, b_bits))
        sums = np.einsum("wnik,wnkj->wij", a, b) + c
        assert np.array_equal(sums, d.astype(np.float64))
        # Every partial sum, in any order, is a multiple of `unit` no larger than `bound`: exact in f32.
        unit = 2.0**-8 if probe.kind == "fp8" else 1.0
        bound = np.einsum("wnik,wnkj->wij", np.abs(a), np.abs(b)) + np.abs(c)
        assert (np.einsum("wnik,wnkj->wnikj", a, b) % unit == 0).all() and bound.max() < 2**24 * unit
    if probe.shape.depth == 16:   # a square A: its transpose is the permuted layout's A
        a_t = np.swapaxes(a, 2, 3)
        assert not np.array_equal(np.einsum("wnik,wnkj->wij", a_t, b) + c, np.einsum("wnik,wnkj->wij", a, b) + c)


# --- (b) offline compiles for gfx90a and gfx942 -------------------------------------

def needs_tools(arch: str):
    tools = (offline.COMPILERS[arch], offline.READELF, OBJDUMP)
    missing = [tool for tool in tools if shutil.which(tool) is None]
    packages = {offline.COMPILERS[arch]: offline.PACKAGES[offline.COMPILERS[arch]], offline.READELF: "llvm-19",
                OBJDUMP: "llvm-19"}
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed "
                                                    f"(apt-get install {' '.join(packages[t] for t in missing)})")


@pytest.fixture(scope="module")
def disassembly(tmp_path_factory):
    """arch -> (the code object's kernels, kernel -> the v_mfma mnemonics of its disassembly in order)."""
    built = {}

    def build(arch: str):
        if arch not in built:
            code_object = tmp_path_factory.mktemp(f"mfma-{arch}") / "mfma_probe.co"
            result = offline.compile_hip("mfma_probe", {}, arch, keep=code_object)
            listing = subprocess.run([OBJDUMP, "-d", str(code_object)], capture_output=True, text=True, check=True).stdout
            mnemonics, current = {}, None
            for line in listing.splitlines():
                if found := re.match(r"^[0-9a-f]+ <(\w+)>:$", line):
                    current = mnemonics.setdefault(found.group(1), [])
                elif current is not None and (found := re.match(r"^\s+(v_mfma_\w+)", line)):
                    current.append(found.group(1))
            built[arch] = (set(result.kernels), mnemonics)
        return built[arch]

    return build


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=needs_tools(arch)) for arch in offline.ARCHES])
def test_each_probe_holds_its_instruction_and_only_its_archs(arch, disassembly):
    kernels, mnemonics = disassembly(arch)
    expected = {name for name, probe in PROBES.items() if arch in probe.arches}
    assert kernels == expected, f"{arch}: kernels {sorted(kernels)}"
    for name in expected:
        found = mnemonics.get(name, [])
        pattern = PROBES[name].instructions[arch]
        assert found and all(re.fullmatch(pattern, mnemonic) for mnemonic in found), f"{arch} {name}: {found}"
        if PROBES[name].shape.depth == 32 and arch == "gfx90a":   # two 16x16x16 a 16x16x32
            assert len(found) % 2 == 0, f"{arch} {name}: {found}"


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc is not installed (apt-get install hipcc libamdhip64-dev)")
def test_a_wrapper_the_arch_lacks_is_a_front_end_error_naming_it(tmp_path):
    """fp8 on gfx90a: the compiler names the missing wrapper, rather than its backend
    failing to select the builtin."""
    source = tmp_path / "lacks.hip"
    source.write_text('#include "mfma.h"\n'
                      'extern "C" __global__ void lacks(float* d) {\n'
                      '    const kvc_mfma::f32x4 x = kvc_mfma::mfma_f32_16x16x32_fp8(1, 1, kvc_mfma::make_f32x4(0, 0, 0, 0));\n'
                      '    d[0] = x[0];\n'
                      '}\n')
    command = offline.compile_command("mfma_probe", {}, "gfx90a", tmp_path / "lacks.co")
    command[command.index("-c") + 1] = str(source)
    completed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"},
                               cwd=tmp_path)
    log = completed.stderr + completed.stdout
    assert completed.returncode != 0
    assert "mfma_f32_16x16x32_fp8" in log and "Cannot select" not in log, log


# --- (c) NVRTC through the emulation -------------------------------------------------

needs_nvrtc = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC is not loadable: {nvrtc_missing()}")


@needs_nvrtc
def test_the_probe_compiles_for_nvidia_through_the_emulation():
    from tests.hip import emulation
    cubin = emulation.compile_entry("mfma_probe", {})
    for kernel in (*PROBES, *EMULATION_ONLY):
        assert kernel.encode() + b"\0" in cubin, kernel


@needs_nvrtc
@pytest.mark.parametrize("immediates", ("1, 0, 0", "0, 2, 0", "0, 0, 3"))
def test_the_emulation_refuses_cbsz_abid_and_blgp(immediates):
    from tests.hip import emulation
    source = ('#include "mfma.h"\n'
              'extern "C" __global__ void modified(float* d) {\n'
              '    const kvc_mfma::f16x4 a = kvc_mfma::f16x4_of_words(0u, 0u);\n'
              f'    d[0] = kvc_mfma_emu::mfma_f32_16x16x16f16<{immediates}>(a, a, kvc_mfma::make_f32x4(0, 0, 0, 0))[0];\n'
              '}\n')
    with pytest.raises(emulation.EmulationCompileError, match="cbsz = abid = blgp = 0"):
        emulation.compile_source(source, "modified.cu", {}, "sm_90")
    emulation.compile_source(source.replace(immediates, "0, 0, 0"), "unmodified.cu", {}, "sm_90")
