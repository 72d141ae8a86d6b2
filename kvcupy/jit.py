"""Find a kernel source, specialise it, compile it through NVRTC, cache the module.

A specialisation is an entry (`kernels_cu/<entry>.cu`), its -D defines and an
arch (`sm_90`). NVRTC comes from CuPy's bindings (`cupy.cuda.nvrtc`, the pip
NVRTC wheel): no CUDA toolkit and no C++ compiler on the user's machine.

Compiled cubins live on disk per arch, in `cache_dir()/nvrtc-<version>/<arch>/`,
each named by its key `<entry>-<defines digest>-<arch>-<hash>`; the hash covers
every byte of the entry and of every header it includes with `#include "..."`
(transitively), the options, the NVRTC version and the arch, so an edited
header never serves a stale binary (CuPy's own cache key ignores headers). A
JSON sidecar beside each cubin records what was built and what ptxas reported.
Loaded modules are memoised per device in memory.

On ROCm the same scheme builds `kernels_hip/<entry>.hip` with hipRTC (CuPy for
ROCm binds it as `cupy.cuda.nvrtc`) for the device's gfx arch: code objects in
`cache_dir()/hiprtc-<version>/<gfx arch>/`, keyed as above with the HIP runtime
and hipRTC versions in the hash (`compile_hip_entry`, `get_hip_function`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

try:
    import fcntl
except ImportError:   # Windows: no flock; the atomic rename alone still never shows a torn file
    fcntl = None

SOURCE_DIR_ENV = "KVCUPY_KERNEL_DIR"
CACHE_DIR_ENV = "KVCUPY_CACHE_DIR"
# -Xptxas=-v makes ptxas log registers and spills per kernel (read by parse_ptxas_log).
BASE_OPTIONS = ("--std=c++17", "-Xptxas=-v")
NVRTC_OPTIONS_ENV = "KVCUPY_NVRTC_OPTIONS"
# Options every compile adds after BASE_OPTIONS (part of every key): $KVCUPY_NVRTC_OPTIONS,
# split at whitespace, e.g. "-lineinfo" for a profiler's source view; tools/*_variants.py
# set it ("nvrtc_options") to time one kernel compiled two ways.
EXTRA_OPTIONS: tuple[str, ...] = tuple(os.environ.get(NVRTC_OPTIONS_ENV, "").split())

Defines = Mapping[str, object]


@dataclass(frozen=True)
class CompileResult:
    key: str                  # names the cubin on disk: <entry>-<defines digest>-<arch>-<hash>
    arch: str                 # sm_XY
    seconds: float            # NVRTC wall time when this cubin was built (also when it came from the cache)
    registers: dict           # kernel name -> registers per thread, from the ptxas log
    spills: dict              # kernel name -> bytes of spill stores + loads
    cached: bool              # found on disk: nothing was compiled by this call
    path: Path                # the cubin


class CompileError(RuntimeError):
    """NVRTC (or hipRTC, `compiler`) rejected a specialisation; `log` is its program log."""

    def __init__(self, key: str, options: tuple, log: str, compiler: str = "NVRTC"):
        super().__init__(f"{compiler} could not compile {key} (options: {' '.join(options)}):\n{log}")
        self.key = key
        self.options = options
        self.log = log


# ---------------------------------------------------------------- sources

def _kernel_folder(name: str, override_env: str, what: str) -> Path:
    """Kernel folder `name`: $override_env, else inside the package (a wheel), else beside it (a checkout)."""
    override = os.environ.get(override_env)
    if override:
        return Path(override).resolve()
    package = Path(__file__).resolve().parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kvcupy's {what} sources ({name}/) are missing from this installation")


def source_dir() -> Path:
    """kernels_cu/: $KVCUPY_KERNEL_DIR, else inside the package (a wheel), else beside it (a checkout)."""
    return _kernel_folder("kernels_cu", SOURCE_DIR_ENV, "CUDA")


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
# (path, mtime_ns, size) -> (sha256 hex, quoted includes): a process hashes each file once,
# and a file edited while the process runs is read again.
_file_memo: dict[tuple, tuple[str, tuple[str, ...]]] = {}


def _read_source(path: Path) -> tuple[str, tuple[str, ...]]:
    stat = path.stat()
    memo_key = (str(path), stat.st_mtime_ns, stat.st_size)
    found = _file_memo.get(memo_key)
    if found is None:
        text = path.read_bytes()
        found = (hashlib.sha256(text).hexdigest(), tuple(m.decode() for m in _INCLUDE.findall(text)))
        _file_memo[memo_key] = found
    return found


def _resolve_include(name: str, including: Path, *roots: Path) -> Path | None:
    """Where NVRTC (hipRTC) finds `#include "name"`: beside the including file, then in
    each -I<root> in order.

    None for a header that is not ours (e.g. a quoted CUDA header): the compiler
    supplies it, and its version in the key covers it.
    """
    for base in (including.parent, *roots):
        candidate = (base / name).resolve()
        if candidate.is_file():
            return candidate
    return None


def source_files(entry: str, root: Path | None = None) -> dict[str, str]:
    """The entry and every header it includes, transitively: relative name -> sha256.

    A header included under an #if counts too: hashing one file too many only
    costs a rebuild, missing one would serve a stale binary.
    """
    root = root or source_dir()
    entry_path = root / f"{entry}.cu"
    if not entry_path.is_file():
        raise FileNotFoundError(f"no kernel entry {entry!r}: {entry_path} does not exist")
    return _included_files(entry_path, (root,), lambda path: os.path.relpath(path, root))


def _included_files(entry_path: Path, roots: tuple[Path, ...], name_of) -> dict[str, str]:
    """name_of(path) -> sha256 of `entry_path` and every file it includes, transitively,
    searching `roots` as the compiler's -I folders."""
    digests: dict[str, str] = {}
    pending = [entry_path.resolve()]
    while pending:
        path = pending.pop()
        name = name_of(path)
        if name in digests:
            continue
        digest, includes = _read_source(path)
        digests[name] = digest
        for include in includes:
            resolved = _resolve_include(include, path, *roots)
            if resolved is not None:
                pending.append(resolved)
    return dict(sorted(digests.items()))


# ---------------------------------------------------------------- keys and options

_nvrtc_version: tuple[int, int] | None = None


def nvrtc_version() -> tuple[int, int]:
    global _nvrtc_version
    if _nvrtc_version is None:
        from cupy.cuda import nvrtc
        _nvrtc_version = tuple(nvrtc.getVersion())
    return _nvrtc_version


def define_values(defines: Defines) -> dict[str, str | None]:
    """Each define's value as C reads it: True/False are 1/0 (C has no `True`); None defines
    the name bare."""
    values = {}
    for name, value in sorted(defines.items()):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"define name {name!r} is not a C identifier")
        values[name] = None if value is None else str(int(value) if isinstance(value, bool) else value)
    return values


def define_flags(defines: Defines) -> tuple[str, ...]:
    """-DNAME=value, sorted by name."""
    return tuple(f"-D{name}" if value is None else f"-D{name}={value}"
                 for name, value in define_values(defines).items())


def compile_options(defines: Defines, arch: str, extra_options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Options that change the cubin (and so enter the key); include paths are added at compile time."""
    return (*BASE_OPTIONS, f"--gpu-architecture={arch}", *EXTRA_OPTIONS, *extra_options, *define_flags(defines))


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def specialisation_key(entry: str, defines: Defines, arch: str, extra_options: tuple[str, ...] = (),
                       root: Path | None = None) -> str:
    """`<entry>-<defines digest>-<arch>-<hash>`: readable in a listing, unique by content."""
    options = compile_options(defines, arch, extra_options)
    content = _digest(source_files(entry, root), options, nvrtc_version(), arch)
    defines_digest = _digest(define_flags(defines))[:8]
    return f"{entry.replace('/', '.')}-{defines_digest}-{arch}-{content[:12]}"


def device_arch() -> str:
    """sm_XY of the current CUDA device (plain sm_90 on H100/H200: no sm_90a-only features used)."""
    import cupy
    return f"sm_{cupy.cuda.Device().compute_capability}"


# ---------------------------------------------------------------- the disk cache

def cache_dir() -> Path:
    """Root of the compile cache: $KVCUPY_CACHE_DIR, else $XDG_CACHE_HOME/kvcupy or ~/.cache/kvcupy."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvcupy"


def _version_dir() -> Path:
    major, minor = nvrtc_version()
    return cache_dir() / f"nvrtc-{major}.{minor}"


def cache_size_bytes() -> int:
    """Bytes under cache_dir() (cubins, sidecars and NVRTC's unpacked headers); 0 when absent."""
    total = 0
    for folder, _, files in os.walk(cache_dir()):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an flock on lock_path: one compiler per key across threads and processes.

    flock (not lockf): its locks belong to the open file, so two threads of one
    process that open the file separately exclude each other too. The lock file
    stays: deleting it would let a third process lock a fresh inode.
    """
    with open(lock_path, "a+b") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


def _write_atomically(path: Path, data: bytes) -> None:
    """Write beside `path`, then rename: a reader sees the old file or the whole new one."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


# ---------------------------------------------------------------- NVRTC

_include_options_memo: dict[Path, tuple[str, ...]] = {}


def _nvrtc_bundles_headers() -> bool:
    """NVRTC 13.x carries cuda_fp16.h, cuda_bf16.h, cuda_fp8.h and CCCL in libnvrtc-builtins
    but only hands them out unpacked (nvrtcInstallBundledHeaders, nvrtc.h)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        library = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:
        return False
    return hasattr(library, "nvrtcInstallBundledHeaders")


def cuda_include_options() -> tuple[str, ...]:
    """Where NVRTC finds <cuda_fp16.h> and friends.

    NVRTC 13's --use-bundled-headers=<dir> unpacks its own headers into <dir>
    once (under a file lock of its own) and adds -I<dir> and -I<dir>/cccl.
    Older NVRTC (the cuda12 extra) has no bundle: use a CUDA toolkit's
    include/ if CuPy finds one. These paths stay out of the key: the headers
    they hold are fixed by the NVRTC version, which is in it.
    """
    headers = _version_dir() / "include"
    if headers not in _include_options_memo:
        if _nvrtc_bundles_headers():
            _include_options_memo[headers] = (f"--use-bundled-headers={headers}",)
        else:
            _include_options_memo[headers] = _toolkit_include_options()
    return _include_options_memo[headers]


def _toolkit_include_options() -> tuple[str, ...]:
    try:
        from cupy import _environment
        toolkit = Path(_environment.get_cuda_path() or "/nonexistent") / "include"
    except Exception:   # CuPy's search raises on some broken installs; then there is no toolkit
        return ()
    return (f"-I{toolkit}",) if (toolkit / "cuda_fp16.h").is_file() else ()


# ELF64 header fields (little endian) that say where a cubin's tables end: e_phoff,
# e_shoff, then e_phentsize, e_phnum, e_shentsize, e_shnum.
_ELF_TABLE_OFFSETS = struct.Struct("<QQ")        # at 0x20
_ELF_TABLE_SIZES = struct.Struct("<HHHH")        # at 0x36
_ELF_MAX_MISSING = 8   # more missing than this is no dropped terminator: left alone


def elf_extent(image: bytes) -> int:
    """The length an ELF64 image declares: the end of its program and section header tables."""
    program_offset, section_offset = _ELF_TABLE_OFFSETS.unpack_from(image, 0x20)
    program_size, program_count, section_size, section_count = _ELF_TABLE_SIZES.unpack_from(image, 0x36)
    return max(program_offset + program_size * program_count, section_offset + section_size * section_count)


def whole_cubin(cubin: bytes) -> bytes:
    """The cubin with the zero byte CuPy's nvrtc.getCUBIN drops put back.

    getCUBIN returns one byte less than nvrtcGetCUBINSize says (it strips a trailing
    NUL, as for PTX text; CuPy 14.2 with NVRTC 13.0 and 13.5), the last byte of the
    program header table, which NVRTC leaves zero. The driver loads the short image,
    but cuobjdump and nvdisasm reject it ("does not contain device code")."""
    if len(cubin) < 0x40 or not cubin.startswith(b"\x7fELF"):
        return cubin
    missing = elf_extent(cubin) - len(cubin)
    return cubin + bytes(missing) if 0 < missing <= _ELF_MAX_MISSING else cubin


def _nvrtc_compile(root: Path, entry: str, key: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    """(cubin, program log) of kernels_cu/<entry>.cu, or CompileError carrying the log."""
    return _runtime_compile(root / f"{entry}.cu", key, (*options, f"-I{root}", *cuda_include_options()), "NVRTC",
                            lambda nvrtc, program: nvrtc.getCUBIN(program))


def _runtime_compile(source: Path, key: str, options: tuple[str, ...], compiler: str,
                     image: Callable) -> tuple[bytes, str]:
    """(image(nvrtc, program) made whole, program log) of `source` compiled by CuPy's
    nvrtc binding (NVRTC, or hipRTC on ROCm), or CompileError carrying the log."""
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(source.read_text(), str(source), [], [])
    try:
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program).rstrip("\x00") or str(error)
            raise CompileError(key, options, log, compiler=compiler) from None
        return whole_cubin(image(nvrtc, program)), nvrtc.getProgramLog(program).rstrip("\x00")
    finally:
        nvrtc.destroyProgram(program)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> tuple[dict[str, int], dict[str, int]]:
    """(registers, spill bytes) per kernel from `ptxas -v` output.

    ptxas writes, per kernel: "Compiling entry function 'k' for 'sm_90'",
    "Function properties for k", "... N bytes spill stores, M bytes spill loads",
    "Used R registers". Non-kernel (noinline) functions get properties lines too;
    they are left out.
    """
    registers: dict[str, int] = {}
    spills: dict[str, int] = {}
    entry = properties_of = None
    for line in log.splitlines():
        if found := _ENTRY.search(line):
            entry = found.group(1)
        elif found := _PROPERTIES.search(line):
            properties_of = found.group(1)
        elif (found := _SPILLS.search(line)) and properties_of is not None:
            spills[properties_of] = int(found.group(1)) + int(found.group(2))
        elif (found := _REGISTERS.search(line)) and entry is not None:
            registers[entry] = int(found.group(1))
    spills = {name: spills.get(name, 0) for name in registers}
    return registers, spills


# ---------------------------------------------------------------- compile and load

def _sidecar_path(cubin: Path) -> Path:
    return cubin.with_suffix(".json")


def _cached_result(key: str, arch: str, cubin: Path) -> CompileResult:
    try:
        record = json.loads(_sidecar_path(cubin).read_text())
    except (OSError, ValueError):   # a sidecar is written before its cubin; only a hand-made mess lacks one
        record = {}
    return CompileResult(key, arch, record.get("seconds", 0.0), record.get("registers", {}),
                         record.get("spills", {}), True, cubin)


def compile_entry(entry: str, defines: Defines | None = None, arch: str | None = None,
                  extra_options: tuple[str, ...] = (), root: Path | None = None) -> CompileResult:
    """The cubin of one specialisation, from the disk cache or compiled now. Needs no GPU
    when `arch` is given (the current device's arch otherwise). `root`: the folder of
    the entry and its headers (default: source_dir(); the bench compiles its own)."""
    defines = dict(defines or {})
    arch = arch or device_arch()
    root = Path(root) if root is not None else source_dir()
    key = specialisation_key(entry, defines, arch, extra_options, root)

    def build() -> tuple[bytes, dict]:
        options = compile_options(defines, arch, extra_options)
        started = time.perf_counter()
        cubin, log = _nvrtc_compile(root, entry, key, options)
        registers, spills = parse_ptxas_log(log)
        return cubin, {"key": key, "entry": entry, "arch": arch, "defines": define_values(defines),
                       "options": list(options), "nvrtc_version": list(nvrtc_version()),
                       "sources": source_files(entry, root), "seconds": round(time.perf_counter() - started, 3),
                       "registers": registers, "spills": spills, "log": log}

    return _cached_or_built(_version_dir() / arch / f"{key}.cubin", key, arch, build)


def _cached_or_built(path: Path, key: str, arch: str, build: Callable[[], tuple[bytes, dict]]) -> CompileResult:
    """The compiled image at `path` (its sidecar beside it), or `build()`'s (image, record)
    written there under the key's lock: two processes never build or write one key at once."""
    if path.is_file():
        return _cached_result(key, arch, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.parent / f"{key}.lock"):
        if path.is_file():   # another thread or process built it while this one waited
            return _cached_result(key, arch, path)
        image, record = build()
        # Sidecar first: whoever sees the image finds its record.
        _write_atomically(_sidecar_path(path), json.dumps(record, indent=1).encode())
        _write_atomically(path, image)
    return CompileResult(key, arch, record["seconds"], record["registers"], record["spills"], False, path)


_lock = threading.Lock()
_modules: dict = {}


def get_function(entry: str, function: str, defines: Defines, arch: str | None = None,
                 root: Path | None = None):
    """Kernel `function` (extern "C") of kernels_cu/<entry>.cu with `defines`, for the current
    device (a cupy.RawKernel: it launches on CuPy's current stream). `arch` defaults to the
    device's own, e.g. sm_90; pass "sm_90a" for a kernel that needs sm_90a-only instructions.
    `root`: another source folder than source_dir(), as for compile_entry."""
    import cupy
    memo_key = (cupy.cuda.runtime.getDevice(), os.environ.get(SOURCE_DIR_ENV), root and str(root), entry,
                define_flags(defines), arch, EXTRA_OPTIONS)
    return _loaded(_modules, memo_key, lambda: compile_entry(entry, defines, arch or device_arch(),
                                                             root=root)).get_function(function)


def _loaded(modules: dict, memo_key: tuple, compiled: Callable[[], CompileResult]):
    """The cupy.RawModule of `memo_key` in `modules`, loaded from `compiled()`'s file on
    first use (two threads may both load it; one module is kept)."""
    import cupy
    module = modules.get(memo_key)
    if module is None:
        module = cupy.RawModule(path=str(compiled().path))
        with _lock:
            module = modules.setdefault(memo_key, module)
    return module


# ---------------------------------------------------------------- HIP (ROCm): hipRTC

# The rocm backend's portable kernels: kernels_hip/<entry>.hip, compiled by hipRTC
# through CuPy for ROCm (its `cupy.cuda.nvrtc` binds hipRTC there). The entries
# include headers of kernels_cu/ too, so both folders are -I folders, kernels_hip first.
HIP_SOURCE_DIR_ENV = "KVCUPY_HIP_KERNEL_DIR"
HIP_SUFFIX = ".hip"
# No contraction: the cache's bytes follow the format's separate roundings, and clang's
# HIP default fuses a product and a sum into one FMA (hip_compat.h says the same).
HIP_BASE_OPTIONS = ("-std=c++17", "-O3", "-ffp-contract=off")
HIPRTC_OPTIONS_ENV = "KVCUPY_HIPRTC_OPTIONS"
# As EXTRA_OPTIONS, for hipRTC: NVRTC's options mean nothing to it, so they have their own variable.
HIP_EXTRA_OPTIONS: tuple[str, ...] = tuple(os.environ.get(HIPRTC_OPTIONS_ENV, "").split())
# How the key names each include folder's files: fixed labels, so a source override
# ($KVCUPY_HIP_KERNEL_DIR, $KVCUPY_KERNEL_DIR) keeps the names of the files it holds.
_HIP_ROOT_LABELS = ("kernels_hip", "kernels_cu")


def hip_source_dir() -> Path:
    """kernels_hip/: $KVCUPY_HIP_KERNEL_DIR, else inside the package (a wheel), else beside it (a checkout)."""
    return _kernel_folder("kernels_hip", HIP_SOURCE_DIR_ENV, "HIP")


def hip_include_dirs() -> tuple[Path, Path]:
    """The -I folders of a HIP build, in search order: kernels_hip/, then kernels_cu/."""
    return hip_source_dir(), source_dir()


def hip_source_files(entry: str, roots: tuple[Path, ...] | None = None) -> dict[str, str]:
    """`kernels_hip/<entry>.hip` and every header it includes, transitively, from either
    folder: "kernels_hip/<name>" or "kernels_cu/<name>" -> sha256."""
    roots = tuple(Path(root).resolve() for root in (roots or hip_include_dirs()))
    entry_path = roots[0] / f"{entry}{HIP_SUFFIX}"
    if not entry_path.is_file():
        raise FileNotFoundError(f"no HIP kernel entry {entry!r}: {entry_path} does not exist")

    def name_of(path: Path) -> str:
        for label, root in zip(_HIP_ROOT_LABELS, roots):
            if path.is_relative_to(root):
                return f"{label}/{path.relative_to(root).as_posix()}"
        return os.path.relpath(path, roots[0])

    return _included_files(entry_path, roots, name_of)


def gfx_arch(name: str | bytes) -> str:
    """A device's gcnArchName without its feature suffixes: "gfx942:sramecc+:xnack-" ->
    "gfx942". A code object built for the bare arch runs with either xnack setting."""
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode()
    return name.split(":", 1)[0].strip()


def hip_device_arch() -> str:
    """The gfx arch of CuPy's current ROCm device (gfx90a on MI200, gfx942 on MI300)."""
    import cupy
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return gfx_arch(properties["gcnArchName"])


_hip_versions: dict | None = None


def hip_versions() -> dict[str, object]:
    """{"hip_runtime": HIP_VERSION (major * 10**7 + minor * 10**5 + patch), "hiprtc":
    (major, minor)}: the code object depends on both, so both enter the key."""
    global _hip_versions
    if _hip_versions is None:
        import cupy
        from cupy.cuda import nvrtc
        _hip_versions = {"hip_runtime": int(cupy.cuda.runtime.runtimeGetVersion()),
                         "hiprtc": tuple(nvrtc.getVersion())}
    return _hip_versions


def hip_compile_options(defines: Defines, arch: str, extra_options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """hipRTC options that change the code object (and so enter the key); include folders
    are added at compile time."""
    if not re.fullmatch(r"gfx[0-9a-f]+", arch):
        raise ValueError(f"arch={arch!r} is not a bare gfx arch such as 'gfx942'")
    return (*HIP_BASE_OPTIONS, f"--offload-arch={arch}", *HIP_EXTRA_OPTIONS, *extra_options,
            *define_flags(defines))


def hip_specialisation_key(entry: str, defines: Defines, arch: str, extra_options: tuple[str, ...] = (),
                           roots: tuple[Path, ...] | None = None) -> str:
    """`<entry>-<defines digest>-<gfx arch>-<hash>`, the hash over the sources, the options,
    the HIP runtime and hipRTC versions and the arch."""
    options = hip_compile_options(defines, arch, extra_options)
    content = _digest(hip_source_files(entry, roots), options, hip_versions(), arch)
    defines_digest = _digest(define_flags(defines))[:8]
    return f"{entry.replace('/', '.')}-{defines_digest}-{arch}-{content[:12]}"


def _hip_version_dir() -> Path:
    major, minor = hip_versions()["hiprtc"]
    return cache_dir() / f"hiprtc-{major}.{minor}"


def hip_include_options() -> tuple[str, ...]:
    """ROCm's include/ where CuPy finds a ROCm installation (hipRTC does not always find
    it alone). Out of the key: its headers are fixed by the HIP version, which is in it."""
    try:
        from cupy import _environment
        include = Path(_environment.get_rocm_path() or "/nonexistent") / "include"
    except Exception:   # as for the CUDA toolkit: a broken install means none
        return ()
    return (f"-I{include}",) if (include / "hip" / "hip_runtime.h").is_file() else ()


def _hiprtc_compile(roots: tuple[Path, ...], entry: str, key: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    """(code object, program log) of kernels_hip/<entry>.hip, or CompileError carrying the log.
    On ROCm getPTX is hiprtcGetCode, the code object (an ELF64 image); CuPy drops its
    last byte as for PTX text, which whole_cubin puts back."""
    return _runtime_compile(roots[0] / f"{entry}{HIP_SUFFIX}", key,
                            (*options, *(f"-I{root}" for root in roots), *hip_include_options()), "hipRTC",
                            lambda nvrtc, program: nvrtc.getPTX(program))


def compile_hip_entry(entry: str, defines: Defines | None = None, arch: str | None = None,
                      extra_options: tuple[str, ...] = (), roots: tuple[Path, ...] | None = None) -> CompileResult:
    """The code object of one HIP specialisation, from the disk cache
    (`cache_dir()/hiprtc-<version>/<gfx arch>/<key>.hsaco`) or compiled now by hipRTC.
    `roots`: the -I folders, the entry's first (default: hip_include_dirs())."""
    defines = dict(defines or {})
    arch = arch or hip_device_arch()
    roots = tuple(Path(root) for root in (roots or hip_include_dirs()))
    key = hip_specialisation_key(entry, defines, arch, extra_options, roots)

    def build() -> tuple[bytes, dict]:
        options = hip_compile_options(defines, arch, extra_options)
        started = time.perf_counter()
        code, log = _hiprtc_compile(roots, entry, key, options)
        versions = hip_versions()
        return code, {"key": key, "entry": entry, "arch": arch, "defines": define_values(defines),
                      "options": list(options), "hip_runtime_version": versions["hip_runtime"],
                      "hiprtc_version": list(versions["hiprtc"]), "sources": hip_source_files(entry, roots),
                      "seconds": round(time.perf_counter() - started, 3), "registers": {}, "spills": {},
                      "log": log}

    return _cached_or_built(_hip_version_dir() / arch / f"{key}.hsaco", key, arch, build)


_hip_modules: dict = {}


def get_hip_function(entry: str, function: str, defines: Defines, arch: str | None = None,
                     roots: tuple[Path, ...] | None = None):
    """Kernel `function` (extern "C") of kernels_hip/<entry>.hip with `defines`, for CuPy's
    current ROCm device (a cupy.RawKernel launching on CuPy's current stream); `arch`
    defaults to the device's gfx arch."""
    import cupy
    memo_key = (cupy.cuda.runtime.getDevice(), os.environ.get(HIP_SOURCE_DIR_ENV), os.environ.get(SOURCE_DIR_ENV),
                roots and tuple(map(str, roots)), entry, define_flags(defines), arch, HIP_EXTRA_OPTIONS)
    return _loaded(_hip_modules, memo_key, lambda: compile_hip_entry(entry, defines, arch or hip_device_arch(),
                                                                     roots=roots)).get_function(function)
