"""The HIP builds (kernels_hip/) run on an NVIDIA GPU through the wave64 emulation
(kernels_hip/wave64_on_cuda.cuh: two warps as one 64-lane wave), against the
same oracles as the CUDA kernels.

(a) Each emulated primitive against its definition (HIP 5.2's), with distinct
lane values, and hip_compat.h's software conversions against the PTX
instructions they replace. (b) The write, rotate, copy and merge kernels: the
CUDA backend's launchers run unchanged, with the same arguments, but every
kernel of those entries comes from the HIP source compiled by NVRTC through the
emulation (jit.get_function is swapped for the module), and the tests of
tests/gpu/test_write.py and a split-KV case of test_attention.py run over
their grids: cache bytes equal to the CPU backend's, rotations bit for bit.
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

from kvcupy.backends.cuda import device as cuda_device  # noqa: E402

from ..hip import emulation  # noqa: E402
from . import test_attention as cuda_attention  # noqa: E402
from . import test_write as cuda_write  # noqa: E402

# CUDA entry -> its HIP twin, for the kernels the HIP builds cover.
HIP_TWINS = {("write", "reshape_and_cache"): "write", ("rotate", "rotate_rows"): "rotate",
             ("copy_blocks", "copy_blocks"): "copy_blocks", ("attention", "merge_splits"): "merge"}


@pytest.fixture(scope="module", autouse=True)
def hip_kernels():
    """jit.get_function gives the HIP build of every kernel HIP_TWINS lists (the other
    attention kernels stay CUDA's) while this module runs; the launchers' memo is
    emptied on both sides so that no build crosses over. Yields the builds made."""
    original = jit.get_function
    modules: dict = {}
    folder = tempfile.TemporaryDirectory(prefix="kvcupy-hip-emulation-")

    def hip_function(entry, function, defines, arch=None, root=None):
        twin = HIP_TWINS.get((entry, function))
        if twin is None:
            return original(entry, function, defines, arch, root)
        key = (twin, jit.define_flags(defines), arch or jit.device_arch())
        if key not in modules:
            path = Path(folder.name) / f"{twin}-{len(modules)}.cubin"
            path.write_bytes(emulation.compile_entry(twin, defines, key[2].rstrip("a")))
            modules[key] = cupy.RawModule(path=str(path))
        return modules[key].get_function(function)

    cuda_device._memoised_function.cache_clear()
    jit.get_function = hip_function
    try:
        yield modules
    finally:
        jit.get_function = original
        cuda_device._memoised_function.cache_clear()
        folder.cleanup()


# --- (a) the primitives -------------------------------------------------------------

@pytest.fixture(scope="module")
def probes():
    path = Path(tempfile.mkdtemp(prefix="kvcupy-hip-probes-")) / "probes.cubin"
    path.write_bytes(emulation.compile_probes(jit.device_arch()))
    return cupy.RawModule(path=str(path))


SHUFFLE_CASES = [(op, arg, width) for width in (2, 8, 32, 64)
                 for op, args in (("xor", (1, 5, 16, 31, 32, 63)), ("index", (0, 3, 31, 40, 63)),
                                  ("down", (1, 4, 16, 33)), ("up", (1, 4, 16, 33)),
                                  ("xor64", (1, 16, 32)), ("ballot", (0,)))
                 for arg in args]


@pytest.mark.parametrize("op,arg,width", SHUFFLE_CASES)
def test_emulated_primitive_matches_its_definition(probes, op, arg, width):
    rng = np.random.default_rng(zlib.crc32(f"{op}{arg}{width}".encode()))
    values = rng.choice(2**32, size=128, replace=False).astype(np.uint32)   # distinct across both waves
    out = cupy.zeros(128, dtype=np.uint64)
    probes.get_function("shuffle_probe")((1,), (128,), (cupy.asarray(values), out, np.int32(emulation.SHUFFLE_OPS.index(op)),
                                                        np.int32(arg), np.int32(width)))
    got = cupy.asnumpy(out)
    for wave in range(2):
        want = emulation.shuffle_reference([int(v) for v in values[64 * wave: 64 * wave + 64]], op, arg, width)
        assert [int(v) for v in got[64 * wave: 64 * wave + 64]] == want, f"wave {wave}"


def _patterns(rng, count: int) -> np.ndarray:
    """32-bit patterns: random bits, then float32 values near every half / bfloat16 rounding
    edge (ties, subnormals, overflow), zeros, infinities and NaNs."""
    edges = np.array([0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0x477fefff, 0x477ff000,
                      0x38800000, 0x387fffff, 0x33000000, 0x33000001, 0x32ffffff, 0x3f801000, 0x3f803000,
                      0x3f808000, 0x3f818000, 0x7f7fffff, 0x00000001], dtype=np.uint32)
    near_halves = (rng.integers(0x33000000, 0x47800000, count // 2, dtype=np.uint32) & ~np.uint32(0xfff)) | np.uint32(0x1000)
    return np.concatenate([edges, near_halves, rng.integers(0, 2**32, count, dtype=np.uint32)]).astype(np.uint32)


def test_software_conversions_match_the_ptx_instructions(probes):
    patterns = _patterns(np.random.default_rng(5), 1 << 16)
    out = cupy.zeros(12 * patterns.size, dtype=np.uint32)
    probes.get_function("conversion_probe")(((patterns.size + 127) // 128,), (128,),
                                            (cupy.asarray(patterns), out, np.int32(patterns.size)))
    both = cupy.asnumpy(out).reshape(-1, 2, 6)
    # Per result: its name and the (magnitude mask, infinity) of its NaN test, None for integers:
    # NaN payloads may differ, but a NaN must stay one.
    results = (("f16_bits_of", (0x7fff, 0x7c00)), ("bf16_bits_of", (0x7fff, 0x7f80)),
               ("f16_bits_to_float", (0x7fffffff, 0x7f800000)), ("add_toward_zero", (0x7fffffff, 0x7f800000)),
               ("max/min_halves", None), ("min3/max3", None))
    for column, (name, nan_test) in enumerate(results):
        ours, ptx = both[:, 0, column], both[:, 1, column]
        nan = (ptx & nan_test[0]) > nan_test[1] if nan_test else np.zeros(ptx.shape, bool)
        if nan_test:
            assert (((ours & nan_test[0]) > nan_test[1]) == nan).all(), f"{name}: NaN where the hardware's is not"
        wrong = np.flatnonzero((ours != ptx) & ~nan)
        assert wrong.size == 0, f"{name}: {wrong.size} differ, first at pattern {patterns[wrong[0]]:#010x}"


def test_e4m3fn_decoder_matches_ml_dtypes(probes):
    out = cupy.zeros(256, dtype=np.float32)
    probes.get_function("e4m3fn_probe")((1,), (256,), (out,))
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = cupy.asnumpy(out)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(want)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


# --- (b) the kernels --------------------------------------------------------------

@pytest.mark.parametrize("case", cuda_write.WRITE_CASES, ids=str)
def test_hip_write_matches_cpu_bytes(case):
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    cpu_cache, gpu_cache, _ = cuda_write.write_both(case, rng)
    cuda_write.assert_same_bytes(cpu_cache, gpu_cache, str(case), auto_nan_ok=case.kv_dtype == "auto")


@pytest.mark.parametrize("case", cuda_write.ROTATE_CASES, ids=str)
@pytest.mark.parametrize("inverse", (False, True), ids=("forward", "inverse"))
def test_hip_rotate_matches_cpu_bits(case, inverse):
    cuda_write.test_rotate_matches_cpu_bits(case, inverse)


@pytest.mark.parametrize("head_size", cuda_write.ORDER_HEAD_SIZES)
@pytest.mark.parametrize("rotation", ("blockdiag", "kron", "none"))
@pytest.mark.parametrize("dtype", cuda_write.INPUT_DTYPES, ids=lambda d: d.name)
def test_hip_rotate_rows_with_orders_and_divisor_matches_cpu_kernel(head_size, rotation, dtype):
    cuda_write.test_rotate_rows_with_orders_and_divisor_matches_cpu_kernel(head_size, rotation, dtype)


@pytest.mark.parametrize("head_size", (96, 128, 256))
@pytest.mark.parametrize("dtype", (cuda_write.BF16, cuda_write.FP16), ids=lambda d: d.name)
def test_hip_write_and_rotate_match_cpu_at_the_integer_paths_edges(head_size, dtype):
    cuda_write.test_write_and_rotate_match_cpu_at_the_integer_paths_edges(head_size, dtype)


def test_hip_copy_blocks_matches_cpu_for_every_tensor_of_every_layer():
    cuda_write.test_copy_blocks_matches_cpu_for_every_tensor_of_every_layer()


@pytest.mark.parametrize("query_dtype", (np.float32, np.float16, "bfloat16"))
@pytest.mark.parametrize("rotation,options", [("none", {}), ("blockdiag", {}), ("blockdiag", {"sinks": True})],
                         ids=("none", "blockdiag", "blockdiag-sinks"))
def test_hip_merge_of_split_keys_matches_the_oracle(query_dtype, rotation, options, hip_kernels):
    """Long sequences split over many blocks: CUDA's attention, the HIP merge."""
    query_dtype = ml_dtypes.bfloat16 if query_dtype == "bfloat16" else np.dtype(query_dtype)
    out, expected = cuda_attention.run_case(seq_lens=(700, 3000), query_lens=(1, 1), query_dtype=query_dtype,
                                            rotation=rotation, seed=11, **options)
    cuda_attention.check(f"merge {rotation} {options} q={query_dtype}", out, expected, query_dtype)
    assert any(key[0] == "merge" for key in hip_kernels), "no HIP merge ran: the case did not split"
