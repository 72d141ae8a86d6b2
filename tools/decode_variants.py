"""A/B timings of the decode attention kernel under variants, in one process.

    PYTHONPATH=. python3 tools/decode_variants.py VARIANTS [SHAPE]

VARIANTS is a JSON list; each variant has a "name" and any of:
  "dtypes":  KV dtypes to time (default ["int4_per_token_head"]; "auto": an fp16 cache)
  "src":     a folder of kernel sources to compile instead of kernels_cu/
             (KVCUPY_KERNEL_DIR), e.g. an older version's, for a side-by-side
  "tuning":  planner tunables, {field: value} of kvcupy.backends.cuda.tuning.Tuning (e.g.
             {"row_staging": false}, {"dependent_launch": false}, {"max_splits": 8})
  "nvrtc_options": extra NVRTC options for every build (jit.EXTRA_OPTIONS, in place of
             $KVCUPY_NVRTC_OPTIONS's), e.g. ["-Ofc=mid"] or ["-lineinfo"]
SHAPE is a JSON object overriding the default decode shape: batch 32, context
32768, d 128, 8 KV / 32 query heads, block size 16, rotation "none" (pages in
random order, random codes and scales).

Each (variant, dtype) is timed as the whole paged_attention call (query scale,
attention, merge), 10 calls between two CUDA events after 3 warm-up calls, the
median of 15 such pairs, each queued behind a hold kernel (gpu_timing: the GPU's
time, not the host's); TB/s counts the packed K/V and scale bytes. Prints one
line a case and writes variants.json (gpu_timing.save_results). The
bench (`kvcupy bench --backend cuda`) is the reference for absolute numbers;
this is for comparing kernel versions and planner choices on one GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace

import cupy
import numpy as np

import kvcupy as kc
from kvcupy import jit
from kvcupy.backends.cuda.tuning import DEFAULT_TUNING, Tuning
from gpu_timing import median_call_ms, save_results   # tools/, beside this script

DEFAULT_SHAPE = dict(batch=32, context=32768, head_size=128, kv_heads=8, query_heads=32, block_size=16,
                     rotation="none")


@contextlib.contextmanager
def sources_and_options(variant: dict):
    """The variant's kernel sources and NVRTC options in force, restored after."""
    saved_source = os.environ.get(jit.SOURCE_DIR_ENV)
    saved_options = jit.EXTRA_OPTIONS
    jit.EXTRA_OPTIONS = tuple(variant.get("nvrtc_options", saved_options))
    if variant.get("src"):
        os.environ[jit.SOURCE_DIR_ENV] = os.path.abspath(variant["src"])
    else:
        os.environ.pop(jit.SOURCE_DIR_ENV, None)
    try:
        yield
    finally:
        jit.EXTRA_OPTIONS = saved_options
        if saved_source is None:
            os.environ.pop(jit.SOURCE_DIR_ENV, None)
        else:
            os.environ[jit.SOURCE_DIR_ENV] = saved_source


def tuning_of(variant: dict) -> Tuning:
    """The variant's tunables; JSON lists become the tuples Tuning's fields hold."""
    fields = {name: tuple(value) if isinstance(value, list) else value
              for name, value in variant.get("tuning", {}).items()}
    return replace(DEFAULT_TUNING, **fields)


def decode_case(kv_dtype: str, shape: dict, rng) -> dict:
    """A cache of random codes and scales in shuffled pages, its block table and a query."""
    pages = shape["batch"] * shape["context"] // shape["block_size"]
    info = kc.formats.kv_dtype_info(kv_dtype)
    rows = (pages, shape["block_size"], shape["kv_heads"], info.stored_head_size(shape["head_size"]))
    rotation = kc.rotation_plan(shape["head_size"], shape["rotation"])
    if info.quantized:
        key, value = (cupy.asarray(rng.integers(0, 256, rows, dtype=np.uint8)).view(info.storage) for _ in range(2))
        scales = cupy.asarray((rng.random(rows[:3]) * 0.1 + 0.01).astype(np.float32))
        cache = kc.wrap_cache(key, value, scales, scales.copy(), kv_dtype=kv_dtype, rotation=rotation)
    else:   # auto: fp16 rows, no scales
        key, value = (cupy.asarray(rng.standard_normal(rows).astype(np.float16)) for _ in range(2))
        scales = cupy.zeros(0, np.float32)
        cache = kc.wrap_cache(key, value, kv_dtype=kv_dtype, rotation=rotation)
    table = rng.permutation(pages).astype(np.int32).reshape(shape["batch"], -1)
    query = cupy.asarray(rng.standard_normal((shape["batch"], shape["query_heads"], shape["head_size"]))
                         .astype(np.float16))
    return dict(cache=cache, table=table, query=query, pages=pages,
                bytes=key.nbytes + value.nbytes + 2 * scales.nbytes)


def time_case(case: dict, shape: dict, tuning) -> tuple[float, object]:
    """Median milliseconds of one call, and the attention plan it ran."""
    batch = kc.plan_batch(block_table=case["table"], seq_lens=np.full(shape["batch"], shape["context"], np.int32),
                          block_size=shape["block_size"], num_blocks=case["pages"], tuning=tuning)
    out = cupy.empty_like(case["query"])

    def call():
        kc.paged_attention(case["query"], case["cache"], batch=batch, out=out)

    ms = median_call_ms(call, rounds=15, calls_per_round=10)
    (plan,) = batch._backend_plans.values()
    return ms, plan


def main() -> None:
    variants = json.loads(sys.argv[1])
    shape = {**DEFAULT_SHAPE, **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})}
    rng = np.random.default_rng(0)
    cases, results = {}, []
    for variant in variants:
        for kv_dtype in variant.get("dtypes", ["int4_per_token_head"]):
            if kv_dtype not in cases:
                cases[kv_dtype] = decode_case(kv_dtype, shape, rng)
            record = dict(variant=variant["name"], dtype=kv_dtype)
            try:
                with sources_and_options(variant):
                    ms, plan = time_case(cases[kv_dtype], shape, tuning_of(variant))
                record.update(ms=ms, tb_per_s=cases[kv_dtype]["bytes"] / ms / 1e9, kernel=str(plan.kernel),
                              splits=plan.num_splits)
            except Exception as error:   # a variant that does not compile or launch is reported, not fatal
                record.update(error=repr(error)[:400])
            print(record, flush=True)
            results.append(record)
    save_results("variants.json", results)


if __name__ == "__main__":
    main()
