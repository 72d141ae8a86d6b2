"""kvcupy.jit: sources found in a checkout and in an installed wheel, keys that see every
included header, the disk cache (hits, concurrent builders, sidecars), NVRTC's reports.

None of this needs a GPU, only CuPy and NVRTC (the cuda13 extra); without them
the module is skipped. Kernels compile for sm_90 unless a test says otherwise.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="needs CuPy (the cuda13 extra)")
try:
    from cupy.cuda import nvrtc
    nvrtc.getVersion()
except Exception as error:   # CuPy is there but libnvrtc is not
    pytest.skip(f"NVRTC is not loadable: {error}", allow_module_level=True)

from kvcupy import jit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ARCH = "sm_90"
ELF_MAGIC = b"\x7fELF"   # a cubin is an ELF file

# A kernel whose body the tests vary; `{tag}` makes each test's source (so its key) its own.
ENTRY_SOURCE = """\
// {tag}
#include "outer.cuh"
extern "C" __global__ void kvc_test_add(const float* x, float* y, int n) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = add_value(x[i]);
}}
"""
OUTER_HEADER = '#pragma once\n#include "inner/values.cuh"\n'
INNER_HEADER = "#pragma once\n__device__ inline float add_value(float v) { return v + ADDEND; }\n"


def _write_kernels(folder: Path, tag: str, addend: str = "1.0f") -> Path:
    (folder / "inner").mkdir(parents=True, exist_ok=True)
    (folder / "test_add.cu").write_text(ENTRY_SOURCE.format(tag=tag))
    (folder / "outer.cuh").write_text(OUTER_HEADER)
    (folder / "inner" / "values.cuh").write_text(f"#define ADDEND {addend}\n" + INNER_HEADER)
    return folder


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    # One root for this module's tests: NVRTC unpacks its bundled headers (~26 MB) there once.
    return tmp_path_factory.mktemp("kvcupy-cache")


@pytest.fixture
def kernels(tmp_path, monkeypatch, cache_root, request) -> Path:
    """A private kernels_cu/ (test_add.cu -> outer.cuh -> inner/values.cuh) and the shared cache."""
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache_root))
    monkeypatch.setenv(jit.SOURCE_DIR_ENV, str(tmp_path / "kernels_cu"))
    return _write_kernels(tmp_path / "kernels_cu", tag=request.node.nodeid)


def _rewrite(path: Path, text: str) -> None:
    """Change a file so that its (mtime, size) memo key changes too, whatever the clock's grain."""
    stat = path.stat()
    path.write_text(text)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


# ---------------------------------------------------------------- sources and keys

def test_source_dir_of_a_checkout_is_the_top_level_kernels_cu(monkeypatch):
    monkeypatch.delenv(jit.SOURCE_DIR_ENV, raising=False)
    assert jit.source_dir() == REPO / "kernels_cu"


def test_source_files_follow_includes_transitively(kernels):
    assert list(jit.source_files("test_add")) == ["inner/values.cuh", "outer.cuh", "test_add.cu"]


def test_key_changes_when_a_transitively_included_header_changes(kernels):
    before = jit.specialisation_key("test_add", {}, ARCH)
    _rewrite(kernels / "inner" / "values.cuh", "#define ADDEND 2.0f\n" + INNER_HEADER)
    after = jit.specialisation_key("test_add", {}, ARCH)
    assert before != after, "editing a header the entry includes through another header must change the key"


def test_key_ignores_files_the_entry_does_not_include(kernels):
    before = jit.specialisation_key("test_add", {}, ARCH)
    (kernels / "unrelated.cuh").write_text("#error never included\n")
    assert jit.specialisation_key("test_add", {}, ARCH) == before


def test_key_names_entry_defines_and_arch(kernels):
    key = jit.specialisation_key("test_add", {"A": 1, "B": "float"}, ARCH)
    entry, defines_digest, arch, content = key.rsplit("-", 3)
    assert (entry, arch) == ("test_add", ARCH)
    assert len(defines_digest) == 8 and len(content) == 12
    assert jit.specialisation_key("test_add", {"B": "float", "A": 1}, ARCH) == key, "define order must not matter"
    for other in ({"A": 2, "B": "float"}, {"A": 1}):
        assert jit.specialisation_key("test_add", other, ARCH) != key, f"defines {other}"
    assert jit.specialisation_key("test_add", {"A": 1, "B": "float"}, "sm_80") != key


def test_define_flags_spell_c_values():
    assert jit.define_flags({"B": True, "A": 3, "C": None, "D": "__half"}) == ("-DA=3", "-DB=1", "-DC", "-DD=__half")
    with pytest.raises(ValueError, match="not a C identifier"):
        jit.define_flags({"A B": 1})


def test_extra_options_enter_the_key_and_the_build(kernels, monkeypatch):
    plain = jit.specialisation_key("test_add", {}, ARCH)
    monkeypatch.setattr(jit, "EXTRA_OPTIONS", ("-lineinfo",))
    key = jit.specialisation_key("test_add", {}, ARCH)
    assert key != plain, "a cubin built with other options must not be served for the plain key"
    result = jit.compile_entry("test_add", {}, ARCH)
    assert result.key == key and not result.cached
    assert "-lineinfo" in json.loads(result.path.with_suffix(".json").read_text())["options"]


def test_extra_options_come_from_the_environment_and_bad_ones_name_themselves(kernels):
    script = ("from kvcupy import jit; print(list(jit.EXTRA_OPTIONS))\n"
              "try:\n    jit.compile_entry('test_add', {}, 'sm_90')\n"
              "except jit.CompileError as error:\n    print('--no-such-option' in str(error))\n")
    env = {**os.environ, jit.NVRTC_OPTIONS_ENV: " -lineinfo  --no-such-option ", "PYTHONPATH": str(REPO)}
    printed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout.split("\n")[:2] == ["['-lineinfo', '--no-such-option']", "True"], printed.stderr


# ---------------------------------------------------------------- compiling and the disk cache

def test_second_compile_is_a_disk_cache_hit(kernels):
    first = jit.compile_entry("test_add", {}, ARCH)
    started = time.perf_counter()
    second = jit.compile_entry("test_add", {}, ARCH)
    hit_seconds = time.perf_counter() - started
    assert not first.cached and second.cached
    assert second.path == first.path and second.key == first.key
    assert second.registers == first.registers
    assert hit_seconds < 0.2, f"a disk-cache hit took {hit_seconds:.3f} s"
    assert first.path.read_bytes().startswith(ELF_MAGIC)
    assert first.path.parent == Path(os.environ[jit.CACHE_DIR_ENV]) / f"nvrtc-{'.'.join(map(str, jit.nvrtc_version()))}" / ARCH


def test_cached_cubin_is_as_long_as_its_elf_header_says(kernels):
    """The cubin on disk is the whole ELF image: CuPy's nvrtc.getCUBIN drops its last
    byte (a zero, the end of the program header table), which jit puts back, so that
    cuobjdump and nvdisasm read the cache's cubins."""
    image = jit.compile_entry("test_add", {"KVC_WHOLE": 1}, ARCH).path.read_bytes()
    program_offset, = struct.unpack_from("<Q", image, 0x20)
    entry_size, count = struct.unpack_from("<HH", image, 0x36)
    assert count > 0 and len(image) >= program_offset + entry_size * count


def testwhole_cubin_restores_a_dropped_terminator_only():
    """Up to 8 missing bytes come back as zeros; a whole image, a longer gap (no
    dropped terminator) and a non-ELF blob are left as they are."""
    header = bytearray(0x40)
    header[:4] = ELF_MAGIC
    struct.pack_into("<QQ", header, 0x20, 0x40, 0)        # program headers right after the header
    struct.pack_into("<HHHH", header, 0x36, 0x38, 1, 0x40, 0)
    whole = bytes(header) + bytes(range(0x38))             # one program header: 0x78 bytes in all
    assert jit.elf_extent(whole) == len(whole) == 0x78
    assert jit.whole_cubin(whole[:-1]) == whole[:-1] + b"\0"
    assert jit.whole_cubin(whole[:-8]) == whole[:-8] + bytes(8)
    assert jit.whole_cubin(whole[:-9]) == whole[:-9]
    assert jit.whole_cubin(whole) == whole
    assert jit.whole_cubin(b"not an elf image" * 8) == b"not an elf image" * 8


def test_a_new_process_finds_the_cubin_on_disk(kernels):
    built = jit.compile_entry("test_add", {"ADDEND_UNUSED": 1}, ARCH)
    script = textwrap.dedent(f"""
        import time
        from kvcupy import jit
        started = time.perf_counter()
        result = jit.compile_entry("test_add", {{"ADDEND_UNUSED": 1}}, "{ARCH}")
        print(result.cached, result.path, time.perf_counter() - started)
    """)
    cached, path, seconds = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                           text=True, env=os.environ.copy()).stdout.split()
    assert (cached, Path(path)) == ("True", built.path)
    # A few hundredths of a second (most of it loading libnvrtc for its version); the bound
    # leaves room for a busy CI machine. The 0.2 s target, module load included, is the gpu test's below.
    assert float(seconds) < 1.0, f"a new process took {float(seconds):.3f} s to find the cubin"


def test_sidecar_records_the_build(kernels):
    result = jit.compile_entry("test_add", {"KVC_X": 7}, ARCH)
    record = json.loads(result.path.with_suffix(".json").read_text())
    assert record["key"] == result.key and record["arch"] == ARCH
    assert record["defines"] == {"KVC_X": "7"}
    assert "-DKVC_X=7" in record["options"] and f"--gpu-architecture={ARCH}" in record["options"]
    assert set(record["sources"]) == {"test_add.cu", "outer.cuh", "inner/values.cuh"}
    assert record["registers"] == result.registers and record["spills"] == result.spills
    assert record["seconds"] > 0


def test_registers_and_spills_come_from_ptxas(kernels):
    result = jit.compile_entry("test_add", {}, ARCH)
    assert set(result.registers) == {"kvc_test_add"}
    assert 1 <= result.registers["kvc_test_add"] <= 255
    assert result.spills == {"kvc_test_add": 0}


def test_parse_ptxas_log_skips_device_functions():
    log = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Function properties for helper
        ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
        ptxas info    : Compiling entry function 'kernel_a' for 'sm_90'
        ptxas info    : Function properties for kernel_a
        ptxas         .     16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
        ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size
        ptxas info    : Compiling entry function 'kernel_b' for 'sm_90'
        ptxas info    : Function properties for kernel_b
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 32 registers, used 0 barriers
        """)
    assert jit.parse_ptxas_log(log) == ({"kernel_a": 255, "kernel_b": 32}, {"kernel_a": 32, "kernel_b": 0})


def test_compile_error_carries_the_nvrtc_log(kernels):
    _rewrite(kernels / "inner" / "values.cuh", INNER_HEADER.replace("ADDEND", "undefined_addend"))
    for attempt in range(2):   # the lock is released after a failure: a retry fails the same way
        with pytest.raises(jit.CompileError) as raised:
            jit.compile_entry("test_add", {}, ARCH)
        assert 'identifier "undefined_addend" is undefined' in raised.value.log, f"attempt {attempt}"
        assert raised.value.log in str(raised.value)
    folder = Path(os.environ[jit.CACHE_DIR_ENV]) / f"nvrtc-{'.'.join(map(str, jit.nvrtc_version()))}" / ARCH
    assert not list(folder.glob(f"{raised.value.key}.cubin")), "a failed build must leave no cubin"


def test_missing_entry_names_the_path(kernels):
    with pytest.raises(FileNotFoundError, match="no_such_entry.cu"):
        jit.compile_entry("no_such_entry", {}, ARCH)


def _only_files_of(key: str, folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith(key))


def test_threads_compiling_one_key_build_it_once(kernels):
    results = [None] * 4

    def build(index: int) -> None:
        results[index] = jit.compile_entry("test_add", {"KVC_THREADS": 1}, ARCH)

    threads = [threading.Thread(target=build, args=(index,)) for index in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(not result.cached for result in results) == 1, [result.cached for result in results]
    assert len({result.path for result in results}) == 1
    key = results[0].key
    assert _only_files_of(key, results[0].path.parent) == [f"{key}.cubin", f"{key}.json", f"{key}.lock"]


def test_two_processes_compiling_one_key_both_succeed(kernels):
    # A body heavy enough (an unrolled loop) that the two compiles overlap.
    heavy = "#pragma once\n__device__ inline float add_value(float v) {\n" \
            "  #pragma unroll\n  for (int i = 0; i < 2000; ++i) v = v * 1.0001f + ADDEND;\n  return v;\n}\n"
    _rewrite(kernels / "inner" / "values.cuh", "#define ADDEND 1.0f\n" + heavy)
    script = textwrap.dedent(f"""
        from kvcupy import jit
        result = jit.compile_entry("test_add", {{}}, "{ARCH}")
        print(result.cached, result.path)
    """)
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=os.environ.copy()) for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, err
    reports = [out.split() for out, _ in outputs]
    assert sorted(cached for cached, _ in reports) == ["False", "True"], reports
    path = Path(reports[0][1])
    assert {Path(found) for _, found in reports} == {path}
    assert path.read_bytes().startswith(ELF_MAGIC)
    key = path.stem
    assert _only_files_of(key, path.parent) == [f"{key}.cubin", f"{key}.json", f"{key}.lock"], \
        "exactly one cubin, its sidecar and its lock; no temporary file left behind"


# ---------------------------------------------------------------- the shipped kernels

def test_selftest_compiles_with_cuda_fp16_and_bf16_headers(monkeypatch, cache_root):
    """selftest.cu includes <cuda_fp16.h> and <cuda_bf16.h> (NVRTC's bundled headers must be
    found) and types.cuh, whose types formats.CPP_TYPES names."""
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache_root))
    monkeypatch.delenv(jit.SOURCE_DIR_ENV, raising=False)
    for arch in ("sm_80", "sm_89", "sm_90"):
        for value_type in ("kvc::half", "kvc::bfloat16", "float"):
            result = jit.compile_entry("selftest", {"KVC_SELFTEST_T": value_type}, arch)
            assert "kvc_selftest_scale" in result.registers, f"{arch} {value_type}"


def test_check_command_reports_and_fails_with_the_log(kernels, monkeypatch):
    from typer.testing import CliRunner

    from cli.app import app
    from kvcupy.backends.cuda import specs as cuda_specs
    monkeypatch.setattr(cuda_specs, "FAMILIES", (cuda_specs.selftest_specialisations,))
    monkeypatch.delenv(jit.SOURCE_DIR_ENV)
    passed = CliRunner().invoke(app, ["check", "--arch", "sm_80,sm_90", "--json"])
    assert passed.exit_code == 0, passed.output
    report = json.loads(passed.stdout)
    assert {row["arch"] for row in report["results"]} == {"sm_80", "sm_90"}
    assert all(row["registers"] > 0 for row in report["results"])

    (kernels / "selftest.cu").write_text('extern "C" __global__ void kvc_selftest_scale() { broken; }\n')
    monkeypatch.setenv(jit.SOURCE_DIR_ENV, str(kernels))
    failed = CliRunner().invoke(app, ["check", "--arch", "sm_90"])
    assert failed.exit_code == 1, failed.output
    assert 'identifier "broken" is undefined' in failed.stdout


def test_check_builds_arch_specific_kernels_for_their_base_arch_only(monkeypatch, cache_root):
    """A specialisation that needs sm_90a (such as the prefill kernel's wgmma build) is
    built for sm_90a when the check asks for sm_90, and not at all for sm_80."""
    from typer.testing import CliRunner

    from cli.app import app
    from kvcupy.backends.cuda import specs as cuda_specs

    def sm_90a_probe(all: bool):
        return [cuda_specs.Specialisation("selftest", ("kvc_selftest_scale",),
                                          {"KVC_SELFTEST_T": "float", "KVC_SELFTEST_SCALE": 2}, "sm_90a")]

    monkeypatch.setattr(cuda_specs, "FAMILIES", (cuda_specs.selftest_specialisations, sm_90a_probe))
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache_root))
    monkeypatch.delenv(jit.SOURCE_DIR_ENV, raising=False)
    passed = CliRunner().invoke(app, ["check", "--arch", "sm_80,sm_90", "--json"])
    assert passed.exit_code == 0, passed.output
    built = {(row["entry"], row["arch"]) for row in json.loads(passed.stdout)["results"]}
    assert built == {("selftest", "sm_80"), ("selftest", "sm_90"), ("selftest", "sm_90a")}


def test_check_compiles_the_kernels_and_defines_asked_for(kernels, monkeypatch, cache_root):
    """--kernel and --define keep the specialisations that have those kernels and
    values (a cache filled for one model's builds); a name that is no kernel, a
    define that is not NAME=VALUE or a selection of nothing is refused, compiling
    nothing. (A two-kernel probe entry: asking for one of its kernels builds both.)"""
    from typer.testing import CliRunner

    from cli.app import app
    from kvcupy.backends.cuda import specs as cuda_specs

    def scales(all: bool):
        return [cuda_specs.Specialisation("selftest", ("kvc_selftest_scale",),
                                          {"KVC_SELFTEST_T": value_type, "KVC_SELFTEST_SCALE": scale})
                for value_type in ("kvc::half", "float") for scale in (2, 3)]

    for name in ("selftest.cu", "types.cuh"):
        (kernels / name).write_text((REPO / "kernels_cu" / name).read_text())
    (kernels / "probe.cu").write_text('extern "C" __global__ void probe_first(int* x) { x[0] = 1; }\n'
                                      'extern "C" __global__ void probe_second(int* x) { x[0] = 2; }\n')

    def two_kernel_probe(all: bool):
        return [cuda_specs.Specialisation("probe", ("probe_first", "probe_second"), {}, "sm_90a")]

    monkeypatch.setattr(cuda_specs, "FAMILIES", (scales, two_kernel_probe))
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache_root))
    monkeypatch.setenv(jit.SOURCE_DIR_ENV, str(kernels))

    def built(*options):
        result = CliRunner().invoke(app, ["check", "--arch", "sm_90", "--json", *options])
        assert result.exit_code == 0, result.output
        return sorted((row["function"], row["defines"].get("KVC_SELFTEST_T"), row["defines"].get("KVC_SELFTEST_SCALE"))
                      for row in json.loads(result.stdout)["results"])

    assert built("--kernel", "probe_second") == [("probe_first", None, None), ("probe_second", None, None)]
    assert built("--define", "KVC_SELFTEST_SCALE=3") == [("kvc_selftest_scale", "float", "3"),
                                                       ("kvc_selftest_scale", "kvc::half", "3")]
    assert built("--kernel", "kvc_selftest_scale,probe_first", "--define", "KVC_SELFTEST_T=float",
                 "--define", "KVC_SELFTEST_SCALE=2") == [("kvc_selftest_scale", "float", "2")]
    for options, named in ((["--kernel", "paged_attention"], "--kernel"), (["--define", "KVC_SELFTEST_T"], "--define"),
                           (["--define", "KVC_SELFTEST_SCALE=5"], "--define")):
        refused = CliRunner().invoke(app, ["check", "--arch", "sm_90", *options])
        assert refused.exit_code == 2 and named in refused.output, refused.output


# ---------------------------------------------------------------- an installed wheel

def _source_names(folder: Path) -> set[str]:
    """Every file a kernel of `folder` needs: its entries and all they include."""
    names = set()
    for entry in folder.glob("*.cu"):
        names.update(jit.source_files(entry.stem, folder))
    return names


def test_installed_wheel_compiles_from_its_own_sources(tmp_path, cache_root):
    """Build the wheel, install it apart from the checkout, and compile selftest from it."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                    str(REPO)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("kvcupy-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("kernels_cu", "kernels_hip"):
        if (REPO / folder).is_dir():
            missing = {name for name in _source_names(REPO / folder) if f"kvcupy/{folder}/{name}" not in shipped}
            assert not missing, f"{folder} files missing from the wheel (package-data in pyproject.toml): {missing}"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    script = textwrap.dedent(f"""
        import kvcupy
        from kvcupy import jit
        result = jit.compile_entry("selftest", {{"KVC_SELFTEST_T": "kvc::half", "KVC_SELFTEST_SCALE": 3}}, "{ARCH}")
        print(kvcupy.__file__, jit.source_dir(), result.registers["kvc_selftest_scale"])
    """)
    env = {key: value for key, value in os.environ.items() if key != jit.SOURCE_DIR_ENV}
    env.update(PYTHONPATH=str(site), **{jit.CACHE_DIR_ENV: str(cache_root)})
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    package, sources, registers = subprocess.run([sys.executable, "-c", script], cwd=workdir, env=env, check=True,
                                                 capture_output=True, text=True).stdout.split()
    assert Path(package).is_relative_to(site), f"imported {package}, not the installed wheel"
    assert Path(sources) == site / "kvcupy" / "kernels_cu"
    assert int(registers) > 0


# ---------------------------------------------------------------- on a GPU

def _gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() == 0, reason="needs a CUDA GPU")
def test_selftest_runs_on_the_current_stream(monkeypatch, cache_root):
    import cupy
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache_root))
    monkeypatch.delenv(jit.SOURCE_DIR_ENV, raising=False)
    kernel = jit.get_function("selftest", "kvc_selftest_scale", {"KVC_SELFTEST_T": "float", "KVC_SELFTEST_SCALE": 3})
    assert jit.get_function("selftest", "kvc_selftest_scale",
                            {"KVC_SELFTEST_SCALE": 3, "KVC_SELFTEST_T": "float"}) is not None
    x = cupy.arange(1000, dtype=cupy.float32)
    y = cupy.zeros_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kernel((4,), (256,), (x, y, cupy.int32(x.size)))
    stream.synchronize()
    cupy.testing.assert_array_equal(y, x * 3)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() == 0, reason="needs a CUDA GPU")
def test_a_new_process_loads_a_cached_kernel_within_the_target(monkeypatch, cache_root):
    """The JIT target: a new process loads a compiled kernel from disk in <= 0.2 s after imports."""
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache_root))
    monkeypatch.delenv(jit.SOURCE_DIR_ENV, raising=False)
    script = textwrap.dedent("""
        import time
        import cupy
        from kvcupy import jit
        cupy.cuda.Device().synchronize()   # the CUDA context exists before the clock starts
        started = time.perf_counter()
        jit.get_function("selftest", "kvc_selftest_scale", {"KVC_SELFTEST_T": "kvc::half", "KVC_SELFTEST_SCALE": 5})
        print(time.perf_counter() - started)
    """)
    run = lambda: float(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                       text=True, env=os.environ.copy()).stdout)
    first = run()           # compiles (or finds a cubin from an earlier run)
    second = run()
    assert first <= 5.0, f"first compile took {first:.2f} s"
    assert second <= 0.2, f"loading from the disk cache took {second:.3f} s"
