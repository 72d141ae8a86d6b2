"""What the host pays for the pieces of a kvcupy call on a GPU (microseconds,
median of 7 rounds of 2000 repetitions), to see where tools/host_overhead.py's
time goes: device and stream switches, torch tensors through DLPack or straight
from their pointers, CuPy kernel launches by argument count (12, the merge's,
also as a programmatic dependent through cuda_launch; 56, about the attention
kernel's 54, also packed through cuda_launch), and one decode call
(kvcupy.paged_attention, its grids launched plainly and as programmatic dependents).

    PYTHONPATH=. python3 tools/host_primitives.py

Prints one JSON line a primitive. The timed kernels are empty, so the GPU runs
them faster than the host issues them: no launch waits for the device (a hold
kernel covers the first round of each launch series, and the decode call's).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import cupy
import numpy as np
import torch

import kvcupy as kc
from kvcupy import interop
from kvcupy.bench import kernels as bench_kernels
from kvcupy.backends.cuda import launch as cuda_launch
from kvcupy.backends.cuda.tuning import DEFAULT_TUNING

SOURCE = r"""
extern "C" __global__ void few(const float* a, float* b, int n, float s) {
  if (threadIdx.x == 0 && n < 0) b[0] = a[0] * s;
}
extern "C" __global__ void many(ARGS) {
  if (threadIdx.x == 0 && n0 < 0) b0[0] = 1.f;
}
"""


def many_signature(count: int) -> tuple[str, list, str]:
    """A kernel signature of `count` arguments in the attention launch's mix (a pointer,
    then int64, int32 and float32 in turn), matching host values, and cuda_launch's
    parameter codes for them."""
    parameters, values, codes = ["float* b0", "int n0"], [cupy.zeros(1, cupy.float32), np.int32(1)], "Pi"
    kinds = [("const void*", "P", lambda: cupy.zeros(1, cupy.float32)), ("long long", "q", lambda: np.int64(3)),
             ("int", "i", lambda: np.int32(2)), ("float", "f", lambda: np.float32(0.5))]
    for index in range(count - 2):
        kind, code, make = kinds[index % 4]
        parameters.append(f"{kind} x{index}")
        values.append(make())
        codes += code
    return ", ".join(parameters), values, codes


def timed(function, repeats: int = 2000) -> float:
    rounds = []
    for _ in range(7):
        begin = time.perf_counter()
        for _ in range(repeats):
            function()
        rounds.append((time.perf_counter() - begin) * 1e6 / repeats)
        cupy.cuda.get_current_stream().synchronize()
    return statistics.median(rounds)


def report(name: str, microseconds: float) -> None:
    print(json.dumps({"primitive": name, "us": round(microseconds, 2)}), flush=True)


def main() -> None:
    hold = bench_kernels.get_function("hold_stream", "hold_stream", {})
    signature, values, _ = many_signature(56)
    module = cupy.RawModule(code=SOURCE.replace("ARGS", signature))
    few, many = module.get_function("few"), module.get_function("many")
    a, b = cupy.zeros(1, cupy.float32), cupy.zeros(1, cupy.float32)
    x = torch.randn((32, 32, 128), device="cuda", dtype=torch.bfloat16)

    def hold_for(seconds: float):
        hold((1,), (1,), (np.uint64(int(seconds * 1e9)),))

    device = cupy.cuda.Device(0)

    def cupy_device():
        with device:
            pass
    report("with cupy.cuda.Device(0): pass", timed(cupy_device))

    def torch_device():
        with torch.cuda.device(0):
            pass
    report("with torch.cuda.device(0): pass", timed(torch_device))
    report("torch.cuda.current_stream(0).cuda_stream", timed(lambda: torch.cuda.current_stream(0).cuda_stream))
    stream = cupy.cuda.get_current_stream()

    def running():
        with interop.running_like(x):
            pass
    report("interop.running_like(torch tensor): enter + exit", timed(running))

    def as_array():
        with interop.running_like(x):
            interop.as_array(x, "x")
    report("running_like + interop.as_array(torch bf16)", timed(as_array))

    def raw_view():
        view = x.view(torch.int16)
        memory = cupy.cuda.UnownedMemory(view.data_ptr(), view.untyped_storage().nbytes(), view, 0)
        cupy.ndarray(tuple(view.shape), cupy.int16, cupy.cuda.MemoryPointer(memory, 0),
                     tuple(2 * s for s in view.stride()))
    report("cupy.ndarray from a torch pointer", timed(raw_view))

    def x_dlpack():
        x.__dlpack__(stream=stream.ptr or 1)
    report("torch __dlpack__(stream)", timed(x_dlpack))

    hold_for(1.0)
    report("launch, 4 arguments", timed(lambda: few((1,), (32,), (a, b, np.int32(1), np.float32(2.0))), 500))
    cupy.cuda.get_current_stream().synchronize()
    hold_for(1.0)
    report("launch, 56 arguments", timed(lambda: many((1,), (32,), tuple(values)), 500))
    cupy.cuda.get_current_stream().synchronize()
    _, _, codes_56 = many_signature(56)
    many_handle = cuda_launch.function_handle(many)
    hold_for(1.0)
    report("launch packed (cuda_launch), 56 arguments",
           timed(lambda: cuda_launch.launch(many_handle, (1,), (32,), codes_56, tuple(values),
                                            stream=cupy.cuda.get_current_stream().ptr), 500))
    cupy.cuda.get_current_stream().synchronize()
    # The merge's launch: 12 arguments, through CuPy or as a programmatic dependent.
    signature_12, values_12, codes_12 = many_signature(12)
    twelve = cupy.RawModule(code=SOURCE.replace("ARGS", signature_12)).get_function("many")
    twelve_handle = cuda_launch.function_handle(twelve)
    hold_for(1.0)
    report("launch, 12 arguments", timed(lambda: twelve((1,), (32,), tuple(values_12)), 500))
    cupy.cuda.get_current_stream().synchronize()
    hold_for(1.0)
    report("launch as a dependent (cuda_launch), 12 arguments",
           timed(lambda: cuda_launch.launch(twelve_handle, (1,), (32,), codes_12, tuple(values_12),
                                            stream=cupy.cuda.get_current_stream().ptr, dependent=True), 500))
    cupy.cuda.get_current_stream().synchronize()

    num_seqs, seq_len, pages = 32, 1024, 64
    table = np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages)
    cache = kc.allocate_cache(num_seqs * pages, 16, 8, 128, kv_dtype="int4_per_token_head", device="cuda")
    query = cupy.random.standard_normal((num_seqs, 32, 128), dtype=cupy.float32).astype(cupy.float16)
    out = cupy.empty_like(query)
    for dependent in (False, True):
        tuning = replace(DEFAULT_TUNING, dependent_launch=dependent)
        batch = kc.plan_batch(block_table=table, seq_lens=np.full(num_seqs, seq_len, np.int32), block_size=16,
                              num_blocks=num_seqs * pages, num_query_tokens=num_seqs, tuning=tuning)
        kc.paged_attention(query, cache, batch=batch, out=out)
        hold_for(2.0)
        report(f"kvcupy.paged_attention, CuPy fp16, decode 32 x 1024 int4, dependent launches {dependent}",
               timed(lambda: kc.paged_attention(query, cache, batch=batch, out=out), 300))
        cupy.cuda.get_current_stream().synchronize()


if __name__ == "__main__":
    main()
