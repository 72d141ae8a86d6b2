"""The CUDA backend's write path, rotation and block copies, against the CPU backend.

Cache bytes must be identical, scale words included: both backends follow
docs/format.md's arithmetic exactly (float64 butterflies in the same order, one
rounding to float32, float32 quantization with correctly rounded division and
no contraction; the kernels' int32 path for 16-bit inputs forms the same
sums exactly, where float64 does not round), so there is no tie to land on
either side of. Every differing
byte is counted and reported per tensor. Rotations are compared bit for bit
too (the same arithmetic); the only allowed difference anywhere is the payload
of a NaN, which CUDA returns canonical.

The grid is chosen to stay fast: every head size meets every KV dtype once,
and each case's input dtype, rotation and block size rotate so that every pair
of (KV dtype, input dtype, rotation) values appears somewhere. Every kernel
specialisation the module launches is compiled up front, in parallel.
"""

from __future__ import annotations

import ctypes
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, formats, jit
from kvcupy.rotation import kron_factors

pytestmark = pytest.mark.gpu
_status = backends.status("cuda")
if not _status.usable:
    pytest.skip(f"the CUDA backend is not usable here: {_status.detail}", allow_module_level=True)

import cupy  # noqa: E402  (only where the backend is usable)

from kvcupy.backends import cpu_kernels  # noqa: E402
from kvcupy.backends.cuda import write  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16, FP32 = np.dtype(np.float16), np.dtype(np.float32)
INPUT_DTYPES = (BF16, FP16, FP32)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 256)
BLOCK_SIZES = (16, 32, 128, 24)   # 24: the write kernel's division path (no power of two)
KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "auto")
ROTATIONS = ("blockdiag", "kron", "none", "vllm")
NONFINITE_SCALE = np.uint32(formats.NONFINITE_SCALE_BITS)


def make_plan(head_size: int, rotation: str):
    if rotation == "vllm":
        return kc.rotation_plan(head_size, "blockdiag", preset="vllm")
    if rotation == "kron" and not kron_factors(head_size):
        return kc.rotation_plan(head_size, "blockdiag")
    return kc.rotation_plan(head_size, rotation)


# --- inputs -----------------------------------------------------------------

class Bfloat16Bits:
    """CuPy uint16 bits shown as bfloat16 through DLPack (CuPy has no bfloat16): what
    a torch or JAX bfloat16 tensor hands kvcupy, without needing either."""

    # dlpack.h: DLTensor's dtype code sits 20 bytes in; the versioned capsule's
    # DLTensor 32 bytes into DLManagedTensorVersioned. kDLBfloat = 4.
    _OFFSETS = {b"dltensor": 0, b"dltensor_versioned": 32}

    def __init__(self, bits):
        self.bits = bits

    def __dlpack_device__(self):
        return self.bits.__dlpack_device__()

    def __dlpack__(self, *args, **kwargs):
        capsule = self.bits.__dlpack__(*args, **kwargs)
        get_name = ctypes.pythonapi.PyCapsule_GetName
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        name = get_name(capsule)
        tensor = get_pointer(capsule, name) + self._OFFSETS[name]
        ctypes.c_uint8.from_address(tensor + 20).value = 4
        return capsule


def on_device(x: np.ndarray):
    """A host array as the GPU argument the public API takes (bfloat16 through DLPack)."""
    if x.dtype == BF16:
        return Bfloat16Bits(cupy.asarray(x.view(np.uint16)))
    return cupy.asarray(x)


def host_bits(x) -> np.ndarray:
    data = x.bits if isinstance(x, Bfloat16Bits) else x
    return cupy.asnumpy(data)


def kv_values(rng, num_tokens: int, num_heads: int, head_size: int, dtype: np.dtype,
              nonfinite: bool = False) -> np.ndarray:
    """Vectors whose scales span many binades, plus zero, constant and tiny ones."""
    x = rng.standard_normal((num_tokens, num_heads, head_size))
    x *= np.exp(rng.uniform(-6.0, 6.0, (num_tokens, num_heads, 1)))
    x[0, 0] = 0.0
    x[1 % num_tokens, -1] = 1.5
    x[2 % num_tokens, 0] *= 1e-30 if dtype == FP32 else 1e-4   # subnormal inputs
    x[3 % num_tokens, -1, ::3] = -0.0
    if nonfinite:
        x[4 % num_tokens, 0, 5] = np.nan
        x[5 % num_tokens, -1, 0] = np.inf
        x[6 % num_tokens, 0, -1] = -np.inf
        # Finite, but its rotation overflows float32 (fp16 / bf16 saturate at their max here).
        x[7 % num_tokens, -1] = 3e38 if dtype == FP32 else float(ml_dtypes.finfo(dtype).max)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


# --- comparison -------------------------------------------------------------

FIELDS = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


def as_bytes(tensor) -> np.ndarray:
    data = np.asarray(tensor) if isinstance(tensor, np.ndarray) else cupy.asnumpy(tensor)
    return np.ascontiguousarray(data).view(np.uint8)


def differing_bytes(expected_cache, actual_cache, auto_nan_ok: bool = False) -> dict:
    """{tensor: (differing bytes, first few (index, expected, actual))} for tensors that differ."""
    found = {}
    for field in FIELDS:
        expected, actual = getattr(expected_cache, field), getattr(actual_cache, field)
        if expected is None:
            continue
        e, a = as_bytes(expected), as_bytes(actual)
        differ = e != a
        if auto_nan_ok:
            # auto caches store NaN as given: only the payload may differ (CUDA's is canonical).
            width = np.asarray(expected).dtype.itemsize
            words = lambda b: b.reshape(-1, width).view({2: np.uint16, 4: np.uint32}[width])[:, 0]
            exp_bits = {2: 10 if np.asarray(expected).dtype == FP16 else 7, 4: 23}[width]
            def is_nan(b):
                w = words(b).astype(np.uint64)
                exponent = (w >> exp_bits) & ((1 << (8 * width - 1 - exp_bits)) - 1)
                return (exponent == (1 << (8 * width - 1 - exp_bits)) - 1) & ((w & ((1 << exp_bits) - 1)) != 0)
            both = np.repeat(is_nan(e) & is_nan(a), width)
            differ = differ.reshape(-1) & ~both
            differ = differ.reshape(e.shape)
        count = int(differ.sum())
        if count:
            where = np.argwhere(differ)[:5]
            found[field] = (count, [(tuple(int(i) for i in w), int(e[tuple(w)]), int(a[tuple(w)])) for w in where])
    return found


def assert_same_bytes(expected_cache, actual_cache, case: str, auto_nan_ok: bool = False) -> None:
    found = differing_bytes(expected_cache, actual_cache, auto_nan_ok)
    assert not found, f"{case}: differing bytes per tensor (count, first (index, cpu, cuda)): {found}"


# --- the write grid ---------------------------------------------------------

@dataclass(frozen=True)
class WriteCase:
    head_size: int
    kv_dtype: str
    input_dtype: np.dtype
    rotation: str
    block_size: int
    cache_dtype: np.dtype   # what an auto cache stores
    nonfinite: bool

    def __str__(self) -> str:
        cache = f"/{self.cache_dtype.name}" if self.kv_dtype == "auto" else ""
        return (f"d{self.head_size}-{self.kv_dtype.split('_')[0]}{cache}-{self.input_dtype.name}-"
                f"{self.rotation}-B{self.block_size}{'-nonfinite' if self.nonfinite else ''}")

    @property
    def plan(self):
        return make_plan(self.head_size, self.rotation)


def write_cases() -> list[WriteCase]:
    cases = []
    for i, head_size in enumerate(HEAD_SIZES):
        for k, kv_dtype in enumerate(KV_DTYPES):
            input_dtype = INPUT_DTYPES[(i + k) % 3]
            rotation = ROTATIONS[(i + 2 * k) % 4]
            cache_dtype = INPUT_DTYPES[(i + 2 * k + 1) % 3]
            block_size = BLOCK_SIZES[(i + k) % len(BLOCK_SIZES)]
            cases.append(WriteCase(head_size, kv_dtype, input_dtype, rotation, block_size, cache_dtype,
                                   nonfinite=(i + k) % 2 == 0))
    # The format vLLM uses most, at the head sizes of most models: every rotation x input dtype.
    for head_size in (96, 128):
        for rotation in ROTATIONS:
            for input_dtype in INPUT_DTYPES:
                cases.append(WriteCase(head_size, "int4_per_token_head", input_dtype, rotation, 16,
                                       input_dtype, nonfinite=False))
    return list({str(c): c for c in cases}.values())


WRITE_CASES = write_cases()


@dataclass(frozen=True)
class RotateCase:
    head_size: int
    rotation: str
    dtype: np.dtype

    def __str__(self) -> str:
        return f"d{self.head_size}-{self.rotation}-{self.dtype.name}"


ROTATE_CASES = [RotateCase(d, r, INPUT_DTYPES[(i + j) % 3])
                for i, d in enumerate(HEAD_SIZES) for j, r in enumerate(("blockdiag", "kron", "vllm"))
                if r != "kron" or kron_factors(d)]
ORDER_HEAD_SIZES = (96, 128)


def _specialisations() -> set:
    """Every (entry, defines) this module launches."""
    wanted = {("copy_blocks", ())}
    for case in WRITE_CASES:
        wanted.add(("write", write.write_defines(case.head_size, case.kv_dtype, case.cache_dtype,
                                                case.input_dtype, case.plan)))
    for case in ROTATE_CASES:
        wanted.add(("rotate", write.rotate_defines(case.head_size, make_plan(case.head_size, case.rotation),
                                                  case.dtype, case.dtype, False)))
    for head_size in ORDER_HEAD_SIZES:
        for rotation in ("blockdiag", "kron", "none"):
            for dtype in INPUT_DTYPES:
                wanted.add(("rotate", write.rotate_defines(head_size, make_plan(head_size, rotation), dtype,
                                                          FP32, True)))
    return wanted


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every specialisation the module launches, in parallel (NVRTC releases the GIL)."""
    arch = jit.device_arch()
    wanted = sorted(_specialisations())
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 4)) as pool:
        results = list(pool.map(lambda spec: jit.compile_entry(spec[0], dict(spec[1]), arch), wanted))
    spills = {r.key: r.spills for r in results if any(r.spills.values())}
    print(f"\n{len(results)} specialisations for {arch}; registers "
          f"{min(v for r in results for v in r.registers.values())}.."
          f"{max(v for r in results for v in r.registers.values())}; spills: {spills or 'none'}")
    return results


def write_both(case: WriteCase, rng, num_tokens: int = 37, num_kv_heads: int = 2, num_blocks: int = 5):
    """(cpu cache, cuda cache, slot_mapping) after writing the same K/V into both."""
    slots = rng.permutation(num_blocks * case.block_size)[:num_tokens].astype(np.int64)
    slots[::7] = -1                                                     # padding tokens
    key = kv_values(rng, num_tokens, num_kv_heads, case.head_size, case.input_dtype, case.nonfinite)
    value = kv_values(rng, num_tokens, num_kv_heads, case.head_size, case.input_dtype, case.nonfinite)
    caches = []
    for device, k, v in (("cpu", key, value), ("cuda", on_device(key), on_device(value))):
        cache = kc.allocate_cache(num_blocks, case.block_size, num_kv_heads, case.head_size,
                                  kv_dtype=case.kv_dtype, rotation=case.plan, device=device,
                                  dtype=case.cache_dtype.name)
        with np.errstate(over="ignore", invalid="ignore"):
            kc.reshape_and_cache(k, v, cache, slots)
        caches.append(cache)
    return caches[0], caches[1], slots


@pytest.mark.parametrize("case", WRITE_CASES, ids=str)
def test_write_matches_cpu_bytes(case):
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    cpu_cache, gpu_cache, _ = write_both(case, rng)
    assert_same_bytes(cpu_cache, gpu_cache, str(case), auto_nan_ok=case.kv_dtype == "auto")


@pytest.mark.parametrize("kv_dtype", formats.QUANTIZED_KV_DTYPES)
@pytest.mark.parametrize("rotation", ("blockdiag", "none"))
def test_nonfinite_vectors_store_nan_scale_and_zero_codes(kv_dtype, rotation):
    case = WriteCase(128, kv_dtype, FP32, rotation, 16, FP32, nonfinite=True)
    rng = np.random.default_rng(7)
    num_blocks, num_tokens = 2, 8
    key = kv_values(rng, num_tokens, 2, 128, FP32, nonfinite=True)
    slots = np.arange(num_tokens, dtype=np.int64)
    cache = kc.allocate_cache(num_blocks, 16, 2, 128, kv_dtype=kv_dtype, rotation=case.plan, device="cuda",
                              dtype="float32")
    kc.reshape_and_cache(on_device(key), on_device(key), cache, slots)
    scales = cupy.asnumpy(cache.k_scale_cache).view(np.uint32).reshape(-1, 2)[:num_tokens]
    codes = cupy.asnumpy(cache.key_cache).view(np.uint8).reshape(-1, 2, cache.key_cache.shape[-1])[:num_tokens]
    with np.errstate(over="ignore", invalid="ignore"):
        rotated = np.asarray(kc.rotate(key, case.plan)).astype(np.float32) if rotation != "none" else key
    nonfinite = ~np.isfinite(rotated).all(axis=-1)
    assert nonfinite.sum() == (3 if rotation == "none" else 4), "NaN, +-inf (and an overflowing rotation)"
    assert (scales[nonfinite] == NONFINITE_SCALE).all(), f"{case}: scale words {scales[nonfinite]}"
    assert (codes[nonfinite] == 0).all(), f"{case}: codes of non-finite vectors are not all 0"
    assert (scales[~nonfinite] != NONFINITE_SCALE).all()


def test_write_with_device_slots_never_touches_memory_outside_the_cache():
    """vLLM's inline scales (strided views into one buffer), in the middle of a
    sentinel-filled allocation; device slot ids with padding and ids outside the
    cache (validate off): valid ids land as on the CPU, nothing else changes."""
    head_size, block_size, num_kv_heads, num_blocks, num_tokens = 128, 16, 4, 6, 50
    plan = kc.rotation_plan(head_size, "blockdiag", preset="vllm")
    stored = head_size // 2
    row = stored + 4 + 12                          # codes | fp32 scale | 12 bytes of padding
    per_cache = num_blocks * block_size * num_kv_heads * row
    guard = 4096
    rng = np.random.default_rng(11)
    key = kv_values(rng, num_tokens, num_kv_heads, head_size, BF16)
    value = kv_values(rng, num_tokens, num_kv_heads, head_size, BF16)
    num_slots = num_blocks * block_size
    slots = rng.permutation(num_slots)[:num_tokens].astype(np.int64)
    slots[[1, 9, 17, 25, 33, 41]] = [-1, -5, num_slots, num_slots + 1, 2**31 - 1, -2**31]
    valid = np.where((slots >= 0) & (slots < num_slots), slots, -1)

    expected = kc.allocate_cache(num_blocks, block_size, num_kv_heads, head_size, rotation=plan)
    kc.reshape_and_cache(key, value, expected, valid)

    for index_dtype in (np.int32, np.int64):
        memory = cupy.full(2 * guard + 2 * per_cache, 0xA5, np.uint8)
        words = memory.view(np.float32)
        views = []
        for which in range(2):
            first = guard + which * per_cache
            shape = (num_blocks, block_size, num_kv_heads)
            rows = memory[first:first + per_cache].reshape(*shape, row)
            scales = words[first // 4:(first + per_cache) // 4].reshape(*shape, row // 4)[..., stored // 4]
            views.append((rows[..., :stored], scales))
        cache = kc.wrap_cache(views[0][0], views[1][0], views[0][1], views[1][1],
                              kv_dtype="int4_per_token_head", rotation=plan)
        kc.reshape_and_cache(on_device(key), on_device(value), cache,
                             cupy.asarray(slots.astype(index_dtype)), validate=False)
        host = cupy.asnumpy(memory)
        case = f"inline scales, {np.dtype(index_dtype).name} device slot_mapping"
        outside = np.concatenate([host[:guard], host[-guard:]])
        assert (outside == 0xA5).all(), f"{case}: {(outside != 0xA5).sum()} bytes outside the cache changed"
        padding = host[guard:-guard].reshape(2, num_blocks, block_size, num_kv_heads, row)[..., stored + 4:]
        assert (padding == 0xA5).all(), f"{case}: row padding changed"
        written = np.zeros(num_slots, bool)
        written[valid[valid >= 0]] = True
        for which, (codes, scales) in enumerate(views):
            got_codes = cupy.asnumpy(codes).reshape(num_slots, num_kv_heads, stored)
            got_scales = cupy.asnumpy(scales).reshape(num_slots, num_kv_heads).view(np.uint32)
            want = [expected.key_cache, expected.value_cache][which].reshape(num_slots, num_kv_heads, stored)
            want_scales = [expected.k_scale_cache, expected.v_scale_cache][which].reshape(
                num_slots, num_kv_heads).view(np.uint32)
            differ = (got_codes[written] != want[written]).sum() + (got_scales[written] != want_scales[written]).sum()
            assert differ == 0, f"{case}: {differ} differing bytes/words in written slots"
            assert (got_codes[~written] == 0xA5).all(), f"{case}: an unwritten slot changed"


def test_write_captures_in_a_cuda_graph():
    """No host-device synchronisation inside reshape_and_cache with device metadata:
    the call captures into a CUDA graph, and replaying it writes what a call does."""
    case = WriteCase(128, "int4_per_token_head", FP16, "blockdiag", 16, FP16, False)
    rng = np.random.default_rng(3)
    key = on_device(kv_values(rng, 24, 2, 128, FP16))
    value = on_device(kv_values(rng, 24, 2, 128, FP16))
    slots = cupy.asarray(rng.permutation(64)[:24].astype(np.int64))
    caches = [kc.allocate_cache(4, 16, 2, 128, rotation=case.plan, device="cuda") for _ in range(2)]
    kc.reshape_and_cache(key, value, caches[0], slots)   # compiles, uploads the plan
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        kc.reshape_and_cache(key, value, caches[1], slots)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert_same_bytes(caches[0], caches[1], "graph replay")


# --- rotation -----------------------------------------------------------------

@pytest.mark.parametrize("case", ROTATE_CASES, ids=str)
@pytest.mark.parametrize("inverse", (False, True), ids=("forward", "inverse"))
def test_rotate_matches_cpu_bits(case, inverse):
    plan = make_plan(case.head_size, case.rotation)
    rng = np.random.default_rng(case.head_size)
    x = (rng.standard_normal((3, 41, case.head_size)) * np.exp(rng.uniform(-5, 5, (3, 41, 1)))).astype(case.dtype)
    x[0, 0, :4] = [0.0, -0.0, 1e-30, -1e-30]
    expected = np.asarray(kc.rotate(x, plan, inverse=inverse))
    got = kc.rotate(on_device(x), plan, inverse=inverse)
    got = cupy.asnumpy(got)
    bits = {2: np.uint16, 4: np.uint32}[case.dtype.itemsize]
    differ = expected.view(bits) != got.view(bits)
    assert not differ.any(), (f"{case} {'inverse' if inverse else 'forward'}: {int(differ.sum())} of "
                              f"{differ.size} values differ in their bits")


@pytest.mark.parametrize("head_size", ORDER_HEAD_SIZES)
@pytest.mark.parametrize("rotation", ("blockdiag", "kron", "none"))
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: d.name)
def test_rotate_rows_with_orders_and_divisor_matches_cpu_kernel(head_size, rotation, dtype):
    """write.rotate_rows (attention's query and output path) against cpu_kernels.rotate_rows."""
    plan = make_plan(head_size, rotation)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((67, head_size)).astype(dtype)
    read_order = rng.permutation(head_size).astype(np.int32)
    write_order = rng.permutation(head_size).astype(np.int32)
    identity = np.arange(head_size, dtype=np.int64)
    for inverse, divisor, orders in ((False, 3.7, (None, write_order)), (True, 96.0, (read_order, None)),
                                     (False, 0.125, (read_order, write_order))):
        if plan.is_identity:
            # No transform: only the orders and the divisor (no CPU kernel path: numpy).
            gathered = x.astype(np.float32)[:, identity if orders[0] is None else orders[0]].astype(np.float64)
            expected = (gathered[:, identity if orders[1] is None else orders[1]] / divisor).astype(np.float32)
        else:
            expected = np.empty((x.shape[0], head_size), np.float32)
            cpu_kernels.rotate_rows(x.astype(np.float32), expected, plan.sign_vector(), plan.mix_matrix(),
                                    plan.kind == "kron", plan.pow2_size, inverse, divisor,
                                    identity if orders[0] is None else orders[0].astype(np.int64),
                                    identity if orders[1] is None else orders[1].astype(np.int64))
        source = cupy.asarray(x.view(np.uint16) if dtype == BF16 else x)
        out = cupy.empty((x.shape[0], head_size), np.float32)
        write.rotate_rows(source, out, plan, inverse=inverse, divisor=divisor,
                         read_order=None if orders[0] is None else cupy.asarray(orders[0]),
                         write_order=None if orders[1] is None else cupy.asarray(orders[1]), x_dtype=dtype)
        got = cupy.asnumpy(out)
        differ = expected.view(np.uint32) != got.view(np.uint32)
        assert not differ.any(), (f"d{head_size} {rotation} {dtype.name} inverse={inverse} divisor={divisor} "
                                  f"orders={[o is not None for o in orders]}: {int(differ.sum())} values differ")


# --- the exact integer path's edges --------------------------------------------

def grid_edge_vectors(head_size: int, dtype: np.dtype, rng, signs: np.ndarray) -> np.ndarray:
    """[vectors, head_size] at the edges of the write and rotate kernels' exact
    integer path (rotation.cuh, exact_grid), each beside its neighbour across the
    edge, which takes float64: the smallest magnitude at 2^-W of the
    largest's binade and one binade below (W = 22 - significant bits: 14 for
    bfloat16, 11 for half), and the same with zeros (which take float64); a
    block of signed zeros beside non-zero blocks, and one beside an exact
    cancellation (float64 gives -0 there: the pattern is set after `signs`,
    the plan's sign vector); the largest in the lowest binade
    the grid allows and the one below (bfloat16: half has no such range); the
    largest finite values (a rotation that overflows float32 for bfloat16)."""
    window = 22 - {BF16: 8, FP16: 11}[dtype]
    pow2 = head_size & -head_size

    def spread(scale: float) -> np.ndarray:
        return rng.uniform(1.0, 1.9, head_size) * rng.choice((-1.0, 1.0), head_size) * scale

    vectors = []
    for exponent in (-window, -window - 1):
        v = spread(1.0)
        v[0], v[5] = 1.99, -(2.0 ** exponent)
        vectors.append(v)
        v = v.copy()
        v[7::9] = 0.0
        v[11::9] = -0.0
        vectors.append(v)
    v = spread(1.0)
    v[:pow2] = 0.0
    v[1:pow2:3] = -0.0
    vectors.append(v)
    v = np.zeros(head_size)
    v[: pow2 // 2] = -0.0
    v[pow2 // 2], v[pow2 // 2 + 1] = 1.0, -1.0
    vectors.append(v * signs)
    if dtype == BF16:
        vectors += [spread(2.0 ** (22 - 127)), spread(2.0 ** (21 - 127))]
    largest = float(ml_dtypes.finfo(dtype).max)
    vectors.append(np.clip(spread(largest / 2), -largest, largest))
    return np.stack(vectors).astype(dtype)


@pytest.mark.parametrize("head_size", (96, 128, 256))
@pytest.mark.parametrize("dtype", (BF16, FP16), ids=lambda d: d.name)
def test_write_and_rotate_match_cpu_at_the_integer_paths_edges(head_size, dtype):
    for rotation in ("blockdiag", "vllm"):
        plan = make_plan(head_size, rotation)
        rng = np.random.default_rng(head_size)
        vectors = grid_edge_vectors(head_size, dtype, rng, np.asarray(plan.sign_vector(), np.float64))
        key = vectors[:, None, :]
        value = -key[::-1]
        slots = np.arange(len(vectors), dtype=np.int64)
        for kv_dtype in ("int4_per_token_head", "fp8_per_token_head", "auto"):
            caches = []
            for device, k, v in (("cpu", key, value), ("cuda", on_device(key), on_device(value))):
                cache = kc.allocate_cache(1, 16, 1, head_size, kv_dtype=kv_dtype, rotation=plan, device=device,
                                          dtype=dtype.name)
                with np.errstate(over="ignore", invalid="ignore"):
                    kc.reshape_and_cache(k, v, cache, slots)
                caches.append(cache)
            assert_same_bytes(*caches, f"d{head_size} {dtype.name} {rotation} {kv_dtype}",
                              auto_nan_ok=kv_dtype == "auto")
        for inverse in (False, True):
            with np.errstate(over="ignore", invalid="ignore"):
                expected = np.asarray(kc.rotate(vectors, plan, inverse=inverse))
            got = cupy.asnumpy(kc.rotate(on_device(vectors), plan, inverse=inverse))
            differ = expected.view(np.uint16) != got.view(np.uint16)
            assert not differ.any(), (f"d{head_size} {dtype.name} {rotation} inverse={inverse}: values "
                                      f"{np.argwhere(differ)[:5].tolist()} differ in their bits")


# --- copy-on-write ------------------------------------------------------------

def test_copy_blocks_matches_cpu_for_every_tensor_of_every_layer():
    rng = np.random.default_rng(13)
    num_blocks, block_size, heads, head_size = 9, 16, 2, 96
    layouts = [("int4_per_token_head", "float16"), ("fp8_per_token_head", "bfloat16"), ("auto", "bfloat16")]
    host, device = [], []
    for kv_dtype, dtype in layouts:
        cpu_cache = kc.allocate_cache(num_blocks, block_size, heads, head_size, kv_dtype=kv_dtype, dtype=dtype)
        for tensor in cpu_cache.tensors():
            tensor.view(np.uint8)[...] = rng.integers(0, 256, tensor.view(np.uint8).shape, dtype=np.uint8)
        gpu_cache = kc.allocate_cache(num_blocks, block_size, heads, head_size, kv_dtype=kv_dtype,
                                      dtype=dtype, device="cuda")
        for field in FIELDS:
            source, target = getattr(cpu_cache, field), getattr(gpu_cache, field)
            if source is not None:
                target[...] = cupy.asarray(source.view(target.dtype))
        host.append(cpu_cache)
        device.append(gpu_cache)
    # A strided cache too: K | k_scale and V | v_scale in one row per head, as vLLM keeps them.
    memory = cupy.asarray(rng.integers(0, 256, (2, num_blocks, block_size, heads, 48 + 4), dtype=np.uint8))
    scales = memory.view(np.float32)[..., 48 // 4]
    device.append(kc.wrap_cache(memory[0, ..., :48], memory[1, ..., :48], scales[0], scales[1],
                                kv_dtype="int4_per_token_head"))
    host_memory = cupy.asnumpy(memory)
    for pairs in (np.array([[0, 5], [3, 7], [2, 8]]), np.array([[1, 2], [2, 4]])):   # the second chains
        kc.copy_blocks(host, pairs)
        kc.copy_blocks(device, pairs)
        expected_memory = host_memory.copy()
        expected_memory[:, pairs[:, 1]] = host_memory[:, pairs[:, 0]]
        host_memory = expected_memory
        for cpu_cache, gpu_cache, (kv_dtype, _) in zip(host, device, layouts):
            assert_same_bytes(cpu_cache, gpu_cache, f"copy_blocks {kv_dtype} pairs {pairs.tolist()}")
        assert (cupy.asnumpy(memory) == expected_memory).all(), "strided cache (inline scales)"
