"""NVRTC builds of the kernels_hip/ sources for an NVIDIA GPU, through
kernels_hip/wave64_on_cuda.cuh (two warps as one 64-lane wave): shared by the
compile tests here and the GPU tests that run them (tests/gpu/test_hip_emulation.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvcupy import jit

REPO = Path(__file__).resolve().parents[2]
HIP_DIR = REPO / "kernels_hip"
CUDA_DIR = REPO / "kernels_cu"


class EmulationCompileError(RuntimeError):
    pass


def nvrtc_missing() -> str | None:
    """Why NVRTC cannot compile here (no CuPy, or no libnvrtc behind it); None if it can."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as error:
        return str(error) or type(error).__name__
    return None


def compile_source(source: str, name: str, defines: Mapping[str, object], arch: str) -> bytes:
    """The cubin of `source` (a .hip entry's text, or a probe's) with kernels_hip/ and
    kernels_cu/ as include folders, in that order."""
    from cupy.cuda import nvrtc
    options = ["--std=c++17", f"--gpu-architecture={arch}", f"-I{HIP_DIR}", f"-I{CUDA_DIR}",
               *jit.cuda_include_options(), *jit.define_flags(defines)]
    program = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program).rstrip("\x00") or str(error)
            raise EmulationCompileError(f"NVRTC could not compile {name} ({' '.join(options)}):\n{log}") from None
        return jit.whole_cubin(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)


def compile_entry(entry: str, defines: Mapping[str, object], arch: str = "sm_90") -> bytes:
    """kernels_hip/<entry>.hip, as HIP code on an NVIDIA GPU."""
    path = HIP_DIR / f"{entry}.hip"
    return compile_source(path.read_text(), str(path), defines, arch)


# Probes of the emulated wave64 primitives and of hip_compat.h's software
# conversions (the latter against the PTX instructions they stand in for).
# Blocks of 128 threads: two waves. The shuffle probe's `op`: SHUFFLE_OPS.
SHUFFLE_OPS = ("xor", "index", "down", "up", "xor64", "ballot")
PROBE_SOURCE = r'''
#include "hip_compat.h"

extern "C" __global__ void shuffle_probe(const unsigned* in, unsigned long long* out, int op, int arg, int width) {
    const unsigned v = in[threadIdx.x];
    unsigned long long r = 0;
    switch (op) {
        case 0: r = __shfl_xor(v, arg, width); break;
        case 1: r = __shfl(v, arg, width); break;
        case 2: r = __shfl_down(v, unsigned(arg), width); break;
        case 3: r = __shfl_up(v, unsigned(arg), width); break;
        case 4: r = __shfl_xor((static_cast<unsigned long long>(v) << 32) | ~v, arg, width); break;
        default: r = __ballot64(int(v & 1u)); break;
    }
    out[threadIdx.x] = r;
}

// Per 32-bit pattern x: hip_compat's results, then the hardware's, six of each.
extern "C" __global__ void conversion_probe(const unsigned* in, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned x = in[i], y = in[(i + 1) % n];
    const float fx = __uint_as_float(x), fy = __uint_as_float(y);
    unsigned* own = out + 12 * i;
    own[0] = kvc_hip::f16_bits_of(fx);
    own[1] = kvc_hip::bf16_bits_of(fx);
    own[2] = __float_as_uint(kvc_hip::f16_bits_to_float((unsigned short)(x & 0xffffu)));
    own[3] = __float_as_uint(kvc_hip::add_toward_zero(fx, fy));
    own[4] = kvc_hip::max_halves(x, y) ^ kvc_hip::min_halves(x, y) * 3u;
    own[5] = unsigned(kvc_hip::min3(int(x), int(y), int(x ^ y))) ^ unsigned(kvc_hip::max3(int(x), int(y), int(x ^ y)));
    unsigned short h, b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(fx));
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(fx));
    float wide;
    asm("{.reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t;}" : "=f"(wide) : "h"((unsigned short)(x & 0xffffu)));
    own[6] = h;
    own[7] = b;
    own[8] = __float_as_uint(wide);
    own[9] = __float_as_uint(__fadd_rz(fx, fy));
    own[10] = __vmaxu2(x, y) ^ __vminu2(x, y) * 3u;
    own[11] = unsigned(__vimin3_s32(int(x), int(y), int(x ^ y))) ^ unsigned(__vimax3_s32(int(x), int(y), int(x ^ y)));
}

// hip_compat's e4m3fn decoder over all 256 codes.
extern "C" __global__ void e4m3fn_probe(float* out) {
    out[threadIdx.x] = kvc_hip::e4m3fn_to_float(threadIdx.x);
}
'''


def compile_probes(arch: str = "sm_90") -> bytes:
    return compile_source(PROBE_SOURCE, "wave64_probes.cu", {}, arch)


def shuffle_reference(values, op: str, arg: int, width: int) -> list[int]:
    """What each lane of a 64-lane wave gets (HIP 5.2's definitions; __shfl's
    source taken modulo width), from its wave's `values` (64 distinct u32)."""
    def source(lane: int) -> int:
        start, within = lane & ~(width - 1), lane & (width - 1)
        if op in ("xor", "xor64"):
            target = lane ^ arg
            return lane if target >= start + width else target
        if op == "index":
            return start + (arg & (width - 1))
        if op == "down":
            return lane if within + arg >= width else lane + arg
        return lane if within < arg else lane - arg   # up

    if op == "ballot":
        mask = sum(1 << lane for lane in range(64) if values[lane] & 1)
        return [mask] * 64
    found = [values[source(lane)] for lane in range(64)]
    if op == "xor64":
        return [(v << 32) | (~v & 0xFFFFFFFF) for v in found]
    return found
