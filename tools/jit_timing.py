"""The JIT targets on a GPU: a kernel's first compile, then its load from the disk cache.

    PYTHONPATH=. python3 tools/jit_timing.py

Runs three fresh processes against one empty compile cache (KVCUPY_CACHE_DIR in
a temporary folder). Each imports CuPy and kvcupy and starts the CUDA context
before its clock starts (the targets are "after imports"), then gets each of
the kernels below and reads one of its attributes, which loads the module:
the int4 decode kernel the planner takes for d = 128 and 8 KV heads (row
staging), and the int4 prefill kernel at d = 128 in its sm_90 (wgmma, sm_90a,
with and without the producer warpgroup, and the short prompts' build) and
mma.sync builds, the largest the planner launches for that shape, each with
the float32 rows' code (a float32 query or output) and without it (16-bit
rows: PrefillKernel.wide_rows). The
first process compiles them; the others find them on disk. Prints one JSON
object: seconds per process and kernel (wall time, and NVRTC's own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def _kernels() -> dict:
    from dataclasses import replace

    from kvcupy.backends.cuda.kernels import KV_INT4, STAGE_ROWS, Kernel, PrefillKernel
    from kvcupy.backends.cuda.planner import _prefill_kernel
    from kvcupy.backends.cuda.tuning import DEFAULT_TUNING

    builds = {"prefill_producer": PrefillKernel.planned(KV_INT4, 128, 16, True, producer=True),
              "prefill_wgmma": PrefillKernel.planned(KV_INT4, 128, 16, True),
              "prefill_mma_sync": PrefillKernel.planned(KV_INT4, 128, 16, False),
              "prefill_short": _prefill_kernel(KV_INT4, 128, 16, 90, DEFAULT_TUNING.prefill_short_keys, True,
                                               DEFAULT_TUNING)}
    # Each as a call with a float32 query or output takes it, and (wide_rows False)
    # as one whose query and output are 16-bit.
    builds.update({f"{name}_16bit_rows": replace(kernel, wide_rows=False) for name, kernel in list(builds.items())})
    return {"decode": ("paged_attention", Kernel(KV_INT4, 128, 8, 1, 32, 16, STAGE_ROWS).defines, None),
            **{name: ("prefill_attention", kernel.defines, kernel.arch) for name, kernel in builds.items()}}


def _one_process() -> dict:
    import cupy

    from kvcupy import jit

    cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))   # the CUDA context, not counted
    results = {}
    for name, (function_name, defines, arch) in _kernels().items():
        begin = time.perf_counter()
        function = jit.get_function("attention", function_name, defines, arch)
        function.max_threads_per_block   # reading an attribute loads the module
        seconds = time.perf_counter() - begin
        compiled = jit.compile_entry("attention", defines, arch)   # the record of what was built
        results[name] = {"seconds": round(seconds, 4), "nvrtc_seconds": compiled.seconds}
    return results


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(_one_process()))
        return
    env = dict(os.environ, KVCUPY_CACHE_DIR=tempfile.mkdtemp(prefix="kvcupy-jit-"))
    results = {}
    for label in ("first_compile", "disk_load_1", "disk_load_2"):
        done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              check=True)
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
