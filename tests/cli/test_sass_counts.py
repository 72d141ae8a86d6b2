"""tools/sass_counts.py's reading of `cuobjdump -sass` text: kernels, opcodes, loops."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "sass_counts.py"

# The shape of cuobjdump's listing (addresses, predicates, encodings), two kernels.
LISTING = """
        code for sm_90
                Function : first_kernel
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   LOP3.LUT R2, R1, 0xf, RZ, 0xc0, !PT ;  /* 0x0000000f01027812 */
        /*0020*/               @P0 FADD R3, R2, R2 ;                       /* 0x0000000202030221 */
        /*0030*/              @!P1 HMMA.16816.F32 R4, R8, R12, R4 ;        /* 0x0000000c08047223 */
        /*0040*/                   LOP3.LUT R2, R2, 0xf0, RZ, 0xc0, !PT ; /* 0x000000f002027812 */
        /*0050*/              @!P2 BRA 0x10 ;                              /* 0xfffffffc00b8a947 */
        /*0060*/                   BRA 0x80 ;                              /* 0x0000000000047947 */
        /*0070*/                   EXIT ;                                  /* 0x000000000000794d */
                ..........
                Function : second_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   BRA 0x10;                              /* 0xfffffffc00fc7947 */
"""


def load_tool():
    spec = importlib.util.spec_from_file_location("sass_counts", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_kernels_and_their_instructions_without_predicates():
    found = load_tool().kernels(LISTING)
    assert list(found) == ["first_kernel", "second_kernel"]
    first = found["first_kernel"]
    assert [address for address, _ in first] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    assert first[2][1] == "FADD R3, R2, R2" and first[3][1].startswith("HMMA.16816.F32")
    assert [load_tool().opcode(text) for _, text in first[:4]] == ["LDC", "LOP3.LUT", "FADD", "HMMA.16816.F32"]


def test_loops_are_the_backward_branches_spans():
    tool = load_tool()
    found = tool.kernels(LISTING)
    assert tool.loops(found["first_kernel"]) == [(0x10, 0x50)]    # the forward BRA 0x80 is no loop
    assert tool.loops(found["second_kernel"]) == [(0x10, 0x10)]   # a branch to itself
