"""The JIT targets on a GPU: a kernel's first compile, then its load from the disk cache.

    PYTHONPATH=. python3 tools/jit_timing.py

Runs three fresh processes against one empty compile cache (KVCUPY_CACHE_DIR in
a temporary folder). Each imports CuPy and kvcupy and starts the CUDA context
before its clock starts (the targets are "after imports"), then gets the int4
decode attention kernel (d = 128, 8 KV heads a block, bulk staging) and reads
one of its attributes, which loads the module. The first process compiles it;
the others find it on disk. Prints one JSON object: seconds per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def _one_process() -> dict:
    import cupy

    from kvcupy import jit
    from kvcupy.backends.cuda_attention import KV_INT4, Kernel

    defines = Kernel(KV_INT4, 128, 8, 1, 32, 16, True).defines
    cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))   # the CUDA context, not counted
    begin = time.perf_counter()
    function = jit.get_function("attention", "paged_attention", defines)
    function.max_threads_per_block   # reading an attribute loads the module
    seconds = time.perf_counter() - begin
    compiled = jit.compile_entry("attention", defines)   # the record of what was built
    return {"seconds": round(seconds, 4), "nvrtc_seconds": compiled.seconds}


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
