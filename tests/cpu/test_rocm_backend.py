"""The rocm backend without an AMD GPU: CuPy's HIP build is faked at the boundary (a
stand-in `cupy` module reporting `is_hip`, an MI300's properties, hipRTC recording
what it is asked to compile), and what kvcupy does on top of it is real: selection,
availability reasons, the hipRTC build's key, options and disk cache, and the
refusal of paged attention."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import backends, interop, jit
from kvcupy.backends import rocm
from kvcupy.backends.rocm import arrays as rocm_arrays

MI300 = "gfx942:sramecc+:xnack-"
HIP_RUNTIME = 70051831   # HIP 7.0
HIPRTC = (7, 0)


class FakeRuntime:
    """cupy.cuda.runtime of CuPy's ROCm build on a machine with `count` devices of `arch`."""

    def __init__(self, arch: str = MI300, count: int = 1, is_hip: bool = True):
        self.is_hip, self.arch, self.count, self.device = is_hip, arch, count, 0
        self.runtime_version = HIP_RUNTIME

    def getDeviceCount(self):
        return self.count

    def getDevice(self):
        return self.device

    def getDeviceProperties(self, index):
        return {"name": b"AMD Instinct MI300X\0", "gcnArchName": self.arch.encode() + b"\0\0"}

    def runtimeGetVersion(self):
        return self.runtime_version


class FakeHiprtc:
    """cupy.cuda.nvrtc as CuPy's ROCm build binds it: hipRTC. Records each program's
    source, name and options; `error_log` makes every compile fail with that log."""

    class NVRTCError(Exception):
        pass

    def __init__(self):
        self.programs, self.error_log, self.version = [], None, HIPRTC

    def getVersion(self):
        return self.version

    def createProgram(self, source, name, headers, include_names):
        self.programs.append({"source": source, "name": name, "options": None})
        return len(self.programs)

    def compileProgram(self, program, options):
        self.programs[program - 1]["options"] = list(options)
        if self.error_log is not None:
            raise self.NVRTCError("HIPRTC_ERROR_COMPILATION (6)")

    def getPTX(self, program):
        return f"code object {program}".encode()

    def getProgramLog(self, program):
        return self.error_log or ""

    def destroyProgram(self, program):
        pass


class FakeRawModule:
    loaded: list = []

    def __init__(self, code=None, path=None, options=(), backend="nvrtc"):
        self.path = path
        FakeRawModule.loaded.append(path)

    def get_function(self, name):
        return ("kernel", name, self.path)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path):
    """CuPy for ROCm on an MI300, in sys.modules; the driver's device node present;
    every memo of the backend's and the JIT's answers cleared before and after."""
    runtime, hiprtc = FakeRuntime(), FakeHiprtc()
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime, cuda.nvrtc = runtime, hiprtc
    cuda.Device = lambda index=None: contextlib.nullcontext()
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.__version__ = "14.2.0"
    cupy.cuda = cuda
    cupy.RawModule = FakeRawModule
    cupy._environment = types.SimpleNamespace(get_rocm_path=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    node = tmp_path / "kfd"
    node.touch()
    monkeypatch.setitem(backends.GPU_DEVICE_NODES, "rocm", str(node))
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(jit, "_hip_versions", None)
    monkeypatch.setattr(jit, "_hip_modules", {})
    monkeypatch.setattr(FakeRawModule, "loaded", [])
    _forget_answers()
    yield cupy
    _forget_answers()


def _forget_answers():
    rocm_arrays.availability.cache_clear()
    for memo in (backends._statuses, backends._loaded):
        memo.pop("rocm", None)
    backends._serving.clear()


@pytest.fixture
def hip_kernels(tmp_path, monkeypatch):
    """kernels_hip/ (test.hip includes its own hip_only.h and kernels_cu's shared.cuh)
    and kernels_cu/ (shared.cuh includes types.cuh beside it)."""
    hip, cu = tmp_path / "kernels_hip", tmp_path / "kernels_cu"
    hip.mkdir()
    cu.mkdir()
    (hip / "test.hip").write_text('#include "hip_only.h"\n#include "shared.cuh"\n'
                                  'extern "C" __global__ void kvc_test(float* y) { y[0] = VALUE; }\n')
    (hip / "hip_only.h").write_text("#pragma once\n")
    (cu / "shared.cuh").write_text('#pragma once\n#include "types.cuh"\n')
    (cu / "types.cuh").write_text("#define VALUE 1.0f\n")
    (cu / "unused.cuh").write_text("#error never included\n")
    monkeypatch.setenv(jit.HIP_SOURCE_DIR_ENV, str(hip))
    monkeypatch.setenv(jit.SOURCE_DIR_ENV, str(cu))
    monkeypatch.setattr(jit, "HIP_EXTRA_OPTIONS", ())
    return hip, cu


# ---------------------------------------------------------------- the registry

def test_every_registered_backend_has_a_module_with_the_protocol():
    protocol = [name for name in vars(backends.Backend) if not name.startswith("_")]
    assert {"availability", "paged_attention", "dlpack_stream", "stream_context"} <= set(protocol)
    for name, (target, kind) in backends._REGISTRY.items():
        module = importlib.import_module(target)
        missing = [member for member in protocol if not hasattr(module, member)]
        assert not missing, f"backend {name!r} ({target}) lacks {missing}"
        assert (module.name, module.device_kind) == (name, kind)


def test_a_rocm_dlpack_device_goes_to_the_rocm_backend(fake_cupy, hip_kernels):
    class OnRocm:
        def __dlpack__(self, **kwargs):
            raise AssertionError("not exported here")

        def __dlpack_device__(self):
            return (10, 1)

    device = interop.device_of(OnRocm())
    assert device == interop.Device("rocm", 1)
    assert backends.for_device(device) is rocm


def test_a_rocm_device_without_a_usable_backend_names_the_reason(fake_cupy, hip_kernels):
    fake_cupy.cuda.runtime.arch = "gfx1100"
    with pytest.raises(ValueError, match=r"cache is on rocm:0, but the ROCM backend is unavailable here: .*gfx1100"):
        backends.for_device(interop.Device("rocm", 0), "cache")


@pytest.mark.parametrize(("usable", "chosen"), [({"cuda", "rocm", "cpu"}, "cuda"), ({"rocm", "cpu"}, "rocm"),
                                                ({"cpu"}, "cpu")])
def test_auto_prefers_cuda_then_rocm_then_cpu(monkeypatch, usable, chosen):
    monkeypatch.setattr(backends, "status", lambda name: backends.BackendStatus(name, name, name in usable, "faked"))
    assert backends.resolve("auto") == chosen


# ---------------------------------------------------------------- availability

def test_available_on_an_mi300_with_cupy_for_rocm(fake_cupy, hip_kernels):
    usable, detail = rocm.availability()
    assert usable, detail
    assert detail.startswith("AMD Instinct MI300X (gfx942), HIP 7.0, hipRTC 7.0, CuPy 14.2.0")
    assert "not yet on AMD hardware" in detail
    assert backends.status("rocm").usable


def test_cupy_for_cuda_is_named_with_the_package_rocm_needs(fake_cupy, monkeypatch):
    fake_cupy.cuda.runtime.is_hip = False
    monkeypatch.setattr(rocm_arrays, "_cupy_distribution", lambda: "cupy-cuda13x")
    usable, detail = rocm.availability()
    assert not usable
    assert detail == ("CuPy is the CUDA build (cupy-cuda13x); the rocm backend needs cupy-rocm-7-0 "
                      "(pip install 'kvcupy[rocm]')")


def test_without_cupy_or_driver_every_reason_is_given(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy fails, find_spec says absent
    monkeypatch.setitem(backends.GPU_DEVICE_NODES, "rocm", str(tmp_path / "no-kfd"))
    _forget_answers()
    try:
        usable, detail = rocm.availability()
    finally:
        _forget_answers()
    assert not usable
    assert detail == ("CuPy is not installed; the rocm backend needs cupy-rocm-7-0 (pip install 'kvcupy[rocm]'); "
                      f"no AMD (ROCm) GPU driver ({tmp_path / 'no-kfd'} is missing)")


@pytest.mark.parametrize("arch", ["gfx1100", "gfx908:sramecc+:xnack-"])
def test_an_unsupported_gfx_arch_is_named(fake_cupy, hip_kernels, arch):
    fake_cupy.cuda.runtime.arch = arch
    usable, detail = rocm.availability()
    assert not usable
    assert detail == (f"AMD Instinct MI300X is {arch.split(':')[0]}; kvcupy's HIP kernels are built for "
                      "gfx90a (MI200) and gfx942 (MI300)")


def test_no_device_and_missing_hip_sources_are_reasons(fake_cupy, hip_kernels, monkeypatch, tmp_path):
    fake_cupy.cuda.runtime.count = 0
    assert rocm.availability() == (False, "no ROCm device")
    rocm_arrays.availability.cache_clear()
    fake_cupy.cuda.runtime.count = 1
    monkeypatch.setenv(jit.HIP_SOURCE_DIR_ENV, str(tmp_path / "absent"))
    usable, detail = rocm.availability()
    assert not usable and str(tmp_path / "absent") in detail and "HIP sources" in detail


@pytest.mark.parametrize(("handle", "named"), [(0, 0), (0x5F00, 0x5F00)])
def test_dlpack_names_the_default_stream_as_rocm_does(fake_cupy, handle, named):
    """DLPack's stream numbers differ by platform: the default stream is 1 on CUDA but 0
    on ROCm, where 1 and 2 are not streams."""
    fake_cupy.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=handle)
    assert rocm.dlpack_stream(interop.Device("rocm", 0)) == named


def test_gfx_arch_strips_feature_suffixes():
    assert jit.gfx_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert jit.gfx_arch(b"gfx90a:xnack+\0\0\0") == "gfx90a"
    assert jit.gfx_arch("gfx942") == "gfx942"


# ---------------------------------------------------------------- hipRTC keys and options

def test_hip_sources_follow_includes_across_both_folders(fake_cupy, hip_kernels):
    assert list(jit.hip_source_files("test")) == ["kernels_cu/shared.cuh", "kernels_cu/types.cuh",
                                                   "kernels_hip/hip_only.h", "kernels_hip/test.hip"]


@pytest.mark.parametrize("entry", ["write", "rotate", "copy_blocks"])
def test_the_launched_entries_are_in_the_checkout_and_include_their_cuda_twin(monkeypatch, entry):
    monkeypatch.delenv(jit.HIP_SOURCE_DIR_ENV, raising=False)
    monkeypatch.delenv(jit.SOURCE_DIR_ENV, raising=False)
    assert jit.hip_source_dir() == Path(__file__).resolve().parents[2] / "kernels_hip"
    names = jit.hip_source_files(entry)
    assert {f"kernels_hip/{entry}.hip", f"kernels_cu/{entry}.cu"} <= set(names), sorted(names)


def test_hip_key_names_the_gfx_arch_and_covers_both_versions(fake_cupy, hip_kernels):
    key = jit.hip_specialisation_key("test", {"A": 1}, "gfx942")
    entry, defines_digest, arch, content = key.rsplit("-", 3)
    assert (entry, arch, len(defines_digest), len(content)) == ("test", "gfx942", 8, 12)
    other_arch = jit.hip_specialisation_key("test", {"A": 1}, "gfx90a")
    assert other_arch.split("-")[2] == "gfx90a" and other_arch.split("-")[3] != content
    fake_cupy.cuda.runtime.runtime_version = HIP_RUNTIME + 1
    jit._hip_versions = None
    assert jit.hip_specialisation_key("test", {"A": 1}, "gfx942") != key, "a new HIP runtime must rebuild"
    fake_cupy.cuda.runtime.runtime_version = HIP_RUNTIME
    fake_cupy.cuda.nvrtc.version = (7, 1)
    jit._hip_versions = None
    assert jit.hip_specialisation_key("test", {"A": 1}, "gfx942") != key, "a new hipRTC must rebuild"


def test_hip_key_sees_a_kernels_cu_header_and_ignores_unincluded_files(fake_cupy, hip_kernels):
    hip, cu = hip_kernels
    key = jit.hip_specialisation_key("test", {}, "gfx942")
    (cu / "unused.cuh").write_text("#error still never included\n")
    assert jit.hip_specialisation_key("test", {}, "gfx942") == key
    (cu / "types.cuh").write_text("#define VALUE 2.0f  // another value, another size\n")
    assert jit.hip_specialisation_key("test", {}, "gfx942") != key


def test_hip_options_take_a_bare_gfx_arch(fake_cupy):
    assert jit.hip_compile_options({"B": "float", "A": 3}, "gfx942") == (
        "-std=c++17", "-O3", "-ffp-contract=off", "--offload-arch=gfx942", "-DA=3", "-DB=float")
    with pytest.raises(ValueError, match=r"arch='gfx942:sramecc\+' is not a bare gfx arch"):
        jit.hip_compile_options({}, "gfx942:sramecc+")


def test_cuda_keys_are_unchanged(tmp_path, monkeypatch):
    """A CUDA key of fixed sources, defines, options and NVRTC version: the value the
    JIT gave before it learnt HIP, so CUDA caches stay valid."""
    root = tmp_path / "kernels_cu"
    (root / "inner").mkdir(parents=True)
    (root / "entry.cu").write_text('#include "outer.cuh"\nextern "C" __global__ void k(float* y) { y[0] = VALUE; }\n')
    (root / "outer.cuh").write_text('#pragma once\n#include "inner/values.cuh"\n')
    (root / "inner" / "values.cuh").write_text("#define VALUE 1.0f\n")
    monkeypatch.setattr(jit, "_nvrtc_version", (13, 0))
    monkeypatch.setattr(jit, "EXTRA_OPTIONS", ())
    assert list(jit.source_files("entry", root)) == ["entry.cu", "inner/values.cuh", "outer.cuh"]
    assert jit.specialisation_key("entry", {"A": 1, "B": "float"}, "sm_90", root=root) == \
        "entry-3f6e9315-sm_90-89e658d978a9"


def test_hiprtc_gets_arch_include_folders_and_defines(fake_cupy, hip_kernels, tmp_path):
    hip, cu = hip_kernels
    rocm_include = tmp_path / "rocm" / "include"
    (rocm_include / "hip").mkdir(parents=True)
    (rocm_include / "hip" / "hip_runtime.h").touch()
    fake_cupy._environment.get_rocm_path = lambda: str(tmp_path / "rocm")
    jit.compile_hip_entry("test", {"KVC_HEAD_SIZE": 128, "KVC_INPUT_T": "__half"}, "gfx942")
    (program,) = fake_cupy.cuda.nvrtc.programs
    assert program["name"] == str(hip.resolve() / "test.hip")
    assert program["source"] == (hip / "test.hip").read_text()
    assert program["options"] == ["-std=c++17", "-O3", "-ffp-contract=off", "--offload-arch=gfx942",
                                  "-DKVC_HEAD_SIZE=128", "-DKVC_INPUT_T=__half",
                                  f"-I{hip.resolve()}", f"-I{cu.resolve()}", f"-I{rocm_include}"]


def test_code_objects_are_cached_on_disk_per_hiprtc_version_and_arch(fake_cupy, hip_kernels, tmp_path):
    first = jit.compile_hip_entry("test", {"A": 1}, "gfx942")
    assert not first.cached
    assert first.path == tmp_path / "cache" / "hiprtc-7.0" / "gfx942" / f"{first.key}.hsaco"
    assert first.path.read_bytes() == b"code object 1"
    record = json.loads(first.path.with_suffix(".json").read_text())
    assert (record["arch"], record["hip_runtime_version"], record["hiprtc_version"]) == ("gfx942", HIP_RUNTIME,
                                                                                        list(HIPRTC))
    assert record["sources"] == jit.hip_source_files("test")
    again = jit.compile_hip_entry("test", {"A": 1}, "gfx942")
    assert again.cached and again.key == first.key and len(fake_cupy.cuda.nvrtc.programs) == 1
    other = jit.compile_hip_entry("test", {"A": 1}, "gfx90a")
    assert other.path.parent.name == "gfx90a" and len(fake_cupy.cuda.nvrtc.programs) == 2


def test_get_hip_function_builds_for_the_device_arch_and_loads_the_code_object(fake_cupy, hip_kernels):
    kernel = jit.get_hip_function("test", "kvc_test", {"A": 1})
    assert kernel[:2] == ("kernel", "kvc_test")
    assert Path(kernel[2]).parent.name == "gfx942" and Path(kernel[2]).suffix == ".hsaco"
    assert jit.get_hip_function("test", "kvc_test", {"A": 1}) == kernel
    assert FakeRawModule.loaded == [kernel[2]], "a second lookup is served from memory"


def test_a_hiprtc_error_carries_its_log(fake_cupy, hip_kernels):
    fake_cupy.cuda.nvrtc.error_log = "test.hip:3:40: error: use of undeclared identifier 'VALUE'"
    with pytest.raises(jit.CompileError, match=r"hipRTC could not compile test-") as error:
        jit.compile_hip_entry("test", {}, "gfx942")
    assert "undeclared identifier 'VALUE'" in error.value.log
    assert "--offload-arch=gfx942" in error.value.options


def test_a_missing_hip_entry_names_its_path(fake_cupy, hip_kernels):
    hip, _ = hip_kernels
    with pytest.raises(FileNotFoundError, match=r"no HIP kernel entry 'absent': .*absent\.hip does not exist"):
        jit.hip_specialisation_key("absent", {}, "gfx942")


# ---------------------------------------------------------------- launches

class DeviceArray(np.ndarray):
    """Host memory standing in for a CuPy array: `.data.ptr` and `.device.id` as CuPy has them."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self):
        return types.SimpleNamespace(id=0)


def _on_device(array) -> DeviceArray:
    return np.ascontiguousarray(array).view(DeviceArray)


def _argument(value):
    """A launch argument as comparable data: device arrays by address and layout, the
    rest by type and value."""
    if isinstance(value, DeviceArray):
        return ("device", value.data.ptr, value.shape, value.strides)
    if isinstance(value, np.ndarray):
        return ("values", value.dtype.str, value.tolist())
    return (type(value).__name__, value.item() if isinstance(value, np.generic) else value)


def _recorded_launches(module, monkeypatch) -> list:
    """Every launch `module`'s launchers make, with the specialisation each asked for."""
    launches = []

    def function(device_index, entry, name, defines):
        return lambda grid, block, args: launches.append(
            (entry, name, tuple(defines), tuple(grid), tuple(block), [_argument(a) for a in args]))

    monkeypatch.setattr(module, "_function", function)
    return launches


@pytest.fixture
def launchers(fake_cupy, monkeypatch):
    """The CUDA and ROCm launcher modules, with their launches recorded, over the fake CuPy."""
    from kvcupy.backends.cuda import device as cuda_device, write as cuda_write
    from kvcupy.backends.rocm import write as rocm_write
    fake_cupy.asarray = lambda array, dtype=None: np.asarray(array, dtype)
    monkeypatch.setattr(cuda_device, "_device_rotations", {})
    return {"cuda": (cuda_write, _recorded_launches(cuda_write, monkeypatch)),
            "rocm": (rocm_write, _recorded_launches(rocm_write, monkeypatch))}


@pytest.mark.parametrize("kv_dtype", ["int4_per_token_head", "int8_per_token_head", "auto"])
def test_the_write_launch_is_the_cuda_launchers(launchers, kv_dtype):
    rng = np.random.default_rng(0)
    host = kc.allocate_cache(4, 16, 2, 96, kv_dtype, dtype=np.float16)
    tensors = {name: None if getattr(host, name) is None else _on_device(getattr(host, name))
               for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")}
    cache = types.SimpleNamespace(device=interop.Device("rocm", 0), kv_dtype=kv_dtype, rotation=host.rotation,
                                  block_size=16, num_slots=64, storage_dtype=tensors["key_cache"].dtype, **tensors)
    keys = _on_device(rng.standard_normal((5, 2, 96)).astype(np.float16))
    values = _on_device(rng.standard_normal((5, 2, 96)).astype(np.float16))
    slot_ids = _on_device(np.arange(5, dtype=np.int32))
    slots = types.SimpleNamespace(on=lambda backend, device: slot_ids)
    for name, (module, _) in launchers.items():
        # CUDA's own launch is packed (the driver's call): given a function getter, as
        # rocm gives its own, it launches through CuPy with the arguments it packs.
        getter = {"function": module._function} if name == "cuda" else {}
        module.reshape_and_cache(interop.Array(keys, np.dtype(np.float16), cache.device, "cupy", "key"),
                                 interop.Array(values, np.dtype(np.float16), cache.device, "cupy", "value"),
                                 cache, slots, **getter)
    (cuda_launch,), (rocm_launch,) = (launches for _, launches in launchers.values())
    assert rocm_launch[:2] == ("write", "reshape_and_cache")
    assert rocm_launch == cuda_launch


@pytest.mark.parametrize("inverse", [False, True])
def test_the_rotate_launch_is_the_cuda_launchers(launchers, inverse):
    plan = kc.rotation_plan(128)
    x = _on_device(np.random.default_rng(1).standard_normal((7, 128)).astype(np.float32))
    out = _on_device(np.zeros((7, 128), np.float32))
    for module, _ in launchers.values():
        module.rotate_rows(x, out, plan, inverse=inverse, divisor=3.0 if inverse else 1.0)
    (cuda_launch,), (rocm_launch,) = (launches for _, launches in launchers.values())
    assert rocm_launch[:2] == ("rotate", "rotate_rows")
    assert rocm_launch == cuda_launch


def test_the_copy_blocks_launch_is_the_cuda_launchers(launchers):
    tensor = _on_device(np.zeros((4, 16, 2, 64), np.float16))
    cache = types.SimpleNamespace(device=interop.Device("rocm", 0), num_blocks=4, tensors=lambda: [tensor, tensor])
    for module, _ in launchers.values():
        module.copy_blocks([cache], np.array([[0, 2], [1, 3]]))
    (cuda_launch,), (rocm_launch,) = (launches for _, launches in launchers.values())
    assert rocm_launch[:2] == ("copy_blocks", "copy_blocks")
    assert rocm_launch == cuda_launch


# ---------------------------------------------------------------- attention

def _mfma_plan(seq_lens, query_lens, *, group=4, kv_heads=2, head_size=128, compute_units=304, hints=True):
    """rocm.attention.plan_work for a batch of host metadata (hints: plan_batch's own
    bounds) or of device metadata with only the bounds known (hints=False)."""
    from kvcupy.backends.rocm import attention as rocm_attention
    block_size = 16
    pages = [-(-n // block_size) for n in seq_lens]
    table = np.zeros((len(seq_lens), max(pages)), np.int32)
    offsets = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    batch = kc.plan_batch(block_table=table, seq_lens=np.array(seq_lens, np.int32), cu_seqlens_q=offsets,
                          block_size=block_size, num_blocks=1, num_query_tokens=int(offsets[-1]))
    if not hints:
        batch = types.SimpleNamespace(num_seqs=len(seq_lens), host_query_offsets=None,
                                      bounds=lambda tokens: (max(query_lens), max(seq_lens)))
    cache = types.SimpleNamespace(num_kv_heads=kv_heads, head_size=head_size, kv_dtype="int4_per_token_head")
    return rocm_attention.plan_work(batch, cache, group * kv_heads, int(offsets[-1]), compute_units)


@pytest.mark.parametrize("seq_lens,query_lens,group", [((300, 1000), (1, 1), 4), ((300, 64, 1000), (100, 64, 7), 4),
                                                       ((513, 1, 90), (1, 1, 90), 16), ((131072,), (1,), 8)])
def test_the_mfma_plan_covers_every_row_and_key_once(seq_lens, query_lens, group):
    from kvcupy.backends.rocm.attention import KEYS_PER_STEP, ROWS_PER_TILE
    work = _mfma_plan(seq_lens, query_lens, group=group)
    # Row tiles: each sequence's query rows (tokens x group) in tiles of 16, in order.
    want = [(seq, tile) for seq, length in enumerate(query_lens) for tile in range(-(-length * group // ROWS_PER_TILE))]
    assert [tuple(row) for row in work.tiles] == want
    # Splits: whole steps of keys, together covering the longest sequence, none empty.
    assert work.split_tokens % KEYS_PER_STEP == 0
    assert work.num_splits * work.split_tokens >= max(seq_lens) > (work.num_splits - 1) * work.split_tokens
    assert work.kernel.defines == {"KVC_MFMA_KV": 0, "KVC_HEAD_PAD": 128}


def test_the_mfma_plan_splits_a_short_batch_and_not_a_wide_one():
    long_decode = _mfma_plan((32768,), (1,))
    assert long_decode.num_splits > 16   # one sequence: the splits are the parallelism
    from kvcupy.backends.rocm.attention import WAVES_PER_CU
    sequences = 2 * 304 * WAVES_PER_CU // 8   # two whole waves of blocks over 304 compute units
    wide = _mfma_plan((512,) * sequences, (1,) * sequences, kv_heads=8)
    assert wide.num_splits == 1


def test_the_mfma_plan_from_bounds_gives_every_sequence_the_bounds_tiles():
    work = _mfma_plan((300, 1000), (5, 40), hints=False)
    assert [tuple(row) for row in work.tiles] == [(seq, tile) for seq in range(2) for tile in range(10)]


@pytest.mark.parametrize("head_size,pad", [(32, 32), (34, 48), (80, 80), (96, 96), (250, 256), (256, 256)])
def test_the_mfma_build_pads_the_head_to_whole_steps(head_size, pad):
    assert _mfma_plan((100,), (1,), head_size=head_size).kernel.head_pad == pad


def test_the_attention_arguments_are_the_packed_parameters_in_order():
    """ParameterStruct.arguments (HIP launches through CuPy) and .pack (CUDA's packed
    launch) give the same fields: each argument converted as its code says."""
    from kvcupy.backends.cuda.launch import parameter_layout
    from kvcupy.backends.cuda.params import ATTENTION_PARAMS
    device_array = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x7F00_0000_1000))
    values = dict(query=device_array, key_cache=0x2000, num_tokens=7, group=4, window=100, softcap=5.0,
                  k_block_stride=1 << 40, split_tokens=256)
    arguments = ATTENTION_PARAMS.arguments(values)
    assert len(arguments) == len(ATTENTION_PARAMS.names)
    by_name = dict(zip(ATTENTION_PARAMS.names, arguments))
    assert by_name["query"] is device_array and by_name["key_cache"] == 0x2000
    assert by_name["num_tokens"].dtype == np.int32 and by_name["k_block_stride"].dtype == np.int64
    assert by_name["softcap"].dtype == np.float32 and by_name["value_cache"] == 0
    flat = [0x7F00_0000_1000 if a is device_array else a.item() for a in arguments]
    assert parameter_layout(ATTENTION_PARAMS.signature).pack(*flat) == ATTENTION_PARAMS.pack(values)
    with pytest.raises(KeyError, match="no field 'nope'"):
        ATTENTION_PARAMS.arguments({"nope": 1})
