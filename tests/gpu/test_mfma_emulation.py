"""kernels_hip/mfma.h's wrappers run on an NVIDIA GPU through their emulation
(kernels_hip/mfma_on_cuda.cuh: two warps as one 64-lane wave), by the probes of
kernels_hip/mfma_probe.hip compiled by NVRTC.

Each probe against NumPy's A @ B + C (tests/hip/test_mfma_layouts.probe_case):
matrices of distinct small integers (fp8: multiples of 1/16), every sum exact
in the result type, so results compare bit for bit and a transposed or
permuted lane layout shows as wrong entries; several waves a block and several
instructions a wave, each with its own operands, so that a wave reading
another's staging, or a lane restaging before the wave has read, shows too.
And the emulation's e4m3fnuz decoder at all 256 codes against ml_dtypes.
"""

from __future__ import annotations

import tempfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvcupy import backends, jit

pytestmark = pytest.mark.gpu
_status = backends.status("cuda")
if not _status.usable:
    pytest.skip(f"the CUDA backend is not usable here: {_status.detail}", allow_module_level=True)

import cupy  # noqa: E402  (only where the backend is usable)

from ..hip import emulation  # noqa: E402
from ..hip import test_mfma_layouts as layouts  # noqa: E402


@pytest.fixture(scope="module")
def probes():
    path = Path(tempfile.mkdtemp(prefix="kvcupy-mfma-probes-")) / "mfma_probe.cubin"
    path.write_bytes(emulation.compile_entry("mfma_probe", {}, jit.device_arch()))
    return cupy.RawModule(path=str(path))


def run_probe(probes, name: str, a_bits, b_bits, c, calls: int) -> np.ndarray:
    waves = c.shape[0]
    d = cupy.zeros(c.shape, dtype=c.dtype)
    probes.get_function(name)((1,), (64 * waves,), (cupy.asarray(a_bits), cupy.asarray(b_bits), cupy.asarray(c), d,
                                                      np.int32(calls)))
    return cupy.asnumpy(d)


@pytest.mark.parametrize("waves,calls", [(1, 1), (2, 3), (4, 2)], ids=("1wave-1call", "2waves-3calls", "4waves-2calls"))
@pytest.mark.parametrize("name", list(layouts.PROBES))
def test_emulated_instruction_is_a_times_b_plus_c(probes, name, waves, calls):
    rng = np.random.default_rng(zlib.crc32(f"{name}{waves}{calls}".encode()))
    a_bits, b_bits, c, want = layouts.probe_case(layouts.PROBES[name], waves, calls, rng)
    got = run_probe(probes, name, a_bits, b_bits, c, calls)
    wrong = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    assert wrong.size == 0, (f"{name}: {len(wrong)} of {got.size} differ, first D[{tuple(wrong[0][1:])}] "
                             f"of wave {wrong[0][0]}: {got[tuple(wrong[0])]} for {want[tuple(wrong[0])]}")


def test_emulated_f16_instruction_on_inexact_inputs_is_near_float64(probes):
    """Random normal halves: the emulation's f32 sum within a few units of the exact one's magnitude."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 2, 16, 16)).astype(np.float16)
    b = rng.standard_normal((2, 2, 16, 16)).astype(np.float16)
    c = rng.standard_normal((2, 16, 16)).astype(np.float32)
    got = run_probe(probes, "mfma_f16_probe", a.view(np.uint16), b.view(np.uint16), c, 2)
    exact = np.einsum("wnik,wnkj->wij", a.astype(np.float64), b.astype(np.float64)) + c
    scale = np.einsum("wnik,wnkj->wij", np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))) + np.abs(c)
    assert (np.abs(got - exact) <= 40 * np.finfo(np.float32).eps * scale).all()


def test_emulated_e4m3fnuz_decoder_matches_ml_dtypes(probes):
    out = cupy.zeros(256, dtype=np.float32)
    probes.get_function("e4m3fnuz_probe")((1,), (256,), (out,))
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    got = cupy.asnumpy(out)
    assert np.isnan(want).sum() == 1 and np.isnan(want[0x80])   # FNUZ: 0x80 alone, and no -0
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(want)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))
