"""FlashInfer's paged decode for a GPU machine without network access or a CUDA compiler.

    python3 tools/flashinfer_bundle.py OUT.tar.xz [--version 0.7.4] [--arch 9.0a]
        [--head-sizes 128,96] [--cuda 13.0] [--python 3.12] [--build-python PYTHON]

Builds one tarball that the step bench's FlashInfer rows (`kvcupy bench --groups
step`) can run from: FlashInfer's Python package without its C++ sources, its
batch-decode modules (bf16 query and output; bf16 and fp8 e4m3 KV; each head size)
and its page-append module compiled here ahead of time for --arch, and the pure-Python
and binary packages it imports, for the GPU machine's --python. FlashInfer loads a
module from `flashinfer/data/aot/NAME/NAME.so` before it would compile one, so the
GPU machine needs neither nvcc nor FlashInfer's 700 MB of sources. On it:

    mkdir -p /tmp/flashinfer && tar -xJf OUT.tar.xz -C /tmp/flashinfer
    PYTHONPATH=/tmp/flashinfer:$PYTHONPATH FLASHINFER_DISABLE_JIT=1 kvcupy bench --backend cuda --groups step

(FLASHINFER_DISABLE_JIT: a call that needs a module the bundle lacks fails naming it
instead of trying to compile.) This machine needs PyPI, a C++ compiler and a Python
with torch (a CPU build will do: --build-python); CUDA's compiler comes from its
PyPI wheels, matching --cuda, which must not be newer than the GPU machine's driver.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# CUDA's compiler as PyPI wheels: nvcc and its pieces (cicc, ptxas, the crt and
# runtime headers, libcudart), all at the toolkit release --cuda names.
CUDA_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-nvvm")
# What `import flashinfer` and its decode path import beyond torch and numpy (the
# GPU machine's own), for the GPU machine's Python.
RUNTIME_PACKAGES = ("apache-tvm-ffi>=0.1.11,<0.2", "einops", "tabulate", "nvidia-ml-py", "requests", "urllib3",
                    "certifi", "idna")
# What building the modules here needs beyond the runtime packages.
BUILD_PACKAGES = ("ninja", "jinja2")
# FlashInfer's C++ sources that its module generators copy even when a module is
# already built (the decode and page-append modules' own files).
GENERATOR_SOURCES = ("batch_decode.cu", "batch_decode_jit_binding.cu", "page.cu", "flashinfer_page_binding.cu")
# Files of the FlashInfer wheel the bundle keeps: Python, its data tables and the
# templates its generators render.
KEPT_SUFFIXES = (".py", ".json", ".jinja", ".typed")

BUILD_SCRIPT = """
import sys, torch
from flashinfer.jit.attention.modules import gen_batch_decode_module
from flashinfer.jit.page import gen_page_module
specs = [gen_page_module()]
for head in [int(h) for h in sys.argv[1].split(",")]:
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        specs.append(gen_batch_decode_module(torch.bfloat16, kv, torch.bfloat16, torch.int32, head, head, 0,
                                             False, False))
for spec in specs:
    spec.build(verbose=False)
    print(spec.name, flush=True)
"""


def kept(name: str) -> bool:
    """Whether a file of the FlashInfer wheel (its path inside the wheel) goes into the bundle."""
    if ".dist-info/" in name:
        return True
    if name in {f"flashinfer/data/csrc/{source}" for source in GENERATOR_SOURCES}:
        return True
    return name.startswith("flashinfer/") and name.endswith(KEPT_SUFFIXES)


def pip(*args: str, python: str = sys.executable) -> None:
    subprocess.run([python, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True)


def cuda_toolkit(work: Path, cuda: str) -> Path:
    """nvcc and its pieces from PyPI, laid out as a CUDA_HOME FlashInfer's build accepts."""
    target = work / "cuda"
    pip("install", "--no-deps", "--target", str(target), *(f"{wheel}=={cuda}.*" for wheel in CUDA_WHEELS))
    home = target / "nvidia" / f"cu{cuda.split('.')[0]}"
    (home / "lib64").symlink_to("lib")
    (home / "lib" / "libcudart.so").symlink_to(next(home.glob("lib/libcudart.so.*")).name)
    # The link step names -lcuda; the driver library itself is the GPU machine's.
    stubs = home / "lib" / "stubs"
    stubs.mkdir()
    empty = work / "empty.c"
    empty.write_text("")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"),
                    str(empty)], check=True)
    return home


def build_modules(site: Path, deps: Path, cuda_home: Path, options) -> Path:
    """Compile the decode and page modules with FlashInfer's own build; returns its JIT folder."""
    workspace = site.parent / "workspace"
    env = dict(os.environ, CUDA_HOME=str(cuda_home), FLASHINFER_CUDA_ARCH_LIST=options.arch,
               FLASHINFER_WORKSPACE_BASE=str(workspace), PYTHONPATH=f"{site}{os.pathsep}{deps}",
               PATH=f"{cuda_home / 'bin'}{os.pathsep}{deps / 'bin'}{os.pathsep}{os.environ['PATH']}")
    subprocess.run([options.build_python, "-c", BUILD_SCRIPT, options.head_sizes], env=env, check=True)
    folders = list(workspace.glob("**/cached_ops"))
    if len(folders) != 1:
        raise SystemExit(f"expected one cached_ops folder under {workspace}, found {folders}")
    return folders[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the tarball to write (.tar.xz)")
    parser.add_argument("--version", default="0.7.4", help="flashinfer-python's release")
    parser.add_argument("--arch", default="9.0a", help="FLASHINFER_CUDA_ARCH_LIST to compile for")
    parser.add_argument("--head-sizes", default="128,96", help="the decode modules' head sizes")
    parser.add_argument("--cuda", default="13.0", help="the CUDA release whose compiler builds the modules")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (for binary packages)")
    parser.add_argument("--build-python", default=sys.executable, help="a Python with torch, to run the build")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        pip("download", "--no-deps", "-d", str(work), f"flashinfer-python=={options.version}")
        wheel = zipfile.ZipFile(next(work.glob("flashinfer_python-*.whl")))
        full, bundle = work / "full", work / "bundle"
        wheel.extractall(full)
        build_deps = work / "build-deps"
        pip("install", "--no-deps", "--target", str(build_deps), *RUNTIME_PACKAGES, *BUILD_PACKAGES,
            python=options.build_python)
        cached_ops = build_modules(full, build_deps, cuda_toolkit(work, options.cuda), options)

        for name in wheel.namelist():
            if kept(name):
                wheel.extract(name, bundle)
        for module in sorted(path for path in cached_ops.iterdir() if (path / f"{path.name}.so").exists()):
            target = bundle / "flashinfer" / "data" / "aot" / module.name
            target.mkdir(parents=True)
            (target / f"{module.name}.so").write_bytes((module / f"{module.name}.so").read_bytes())
            print("module", module.name)
        pip("install", "--no-deps", "--target", str(bundle), "--only-binary=:all:", "--python-version",
            options.python, "--platform", "manylinux_2_28_x86_64", *RUNTIME_PACKAGES)
        with tarfile.open(options.out, "w:xz") as tar:
            for path in sorted(bundle.iterdir()):
                tar.add(path, arcname=path.name)
    print(f"{options.out}: {options.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
