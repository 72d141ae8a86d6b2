"""Tests of the HIP builds (kernels_hip/) that need no GPU: offline compiles for
gfx90a and gfx942 through Debian's compilers, the HIP specialisation list, and
NVRTC compiles of the same sources through the wave64 emulation that
tests/gpu/test_hip_emulation.py runs on an NVIDIA GPU."""
