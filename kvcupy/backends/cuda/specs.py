"""The CUDA specialisations kvcupy can launch: what `kvcupy check` compiles.

Each kernel family (one entry file in kernels_cu/ and the module that
launches it) has one function `..._specialisations(all: bool) ->
list[Specialisation]` here, listed in FAMILIES below. It lists the (entry,
kernels, defines) its launcher can ask `jit.get_function` for, built by the
same code the launcher uses to pick its defines, so that a specialisation the
library can launch is one `kvcupy check` compiles:
- all=True: every specialisation the launcher can request (`check --all`; CI
  runs it for sm_90);
- all=False: a representative sample, a few seconds' worth, covering every
  code path once (each KV dtype, each query dtype, the smallest and largest
  head-size class, ...).

This module imports no CuPy: listing specialisations needs no GPU.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np

from ... import formats
from ...formats import CPP_TYPES
from ...interop import BFLOAT16
from ...rotation import kron_factors, rotation_plan
from .kernels import (DECODE_ROUND_TILE, HEAD_CLASS, KV_BF16, KV_F16, KV_FP8, KV_INT4, KV_INT8,
                      MAX_HEAD_PAD_FOUR_QUADS, PREFILL_MAX_HEAD_PAD, STAGE_BULK, STAGE_ROWS, STAGE_THREADS, STAGES,
                      Kernel, PrefillKernel)
from .planner import _long_tile, _round_tile, _settle_staging, _short_prompt_builds
from .tuning import DEFAULT_TUNING
from .write import rotate_defines, write_defines


class Specialisation(NamedTuple):
    entry: str                   # kernels_cu/<entry>.cu
    functions: tuple[str, ...]   # its extern "C" kernels that the launcher gets
    defines: dict                # -D NAME=value, exactly as the launcher passes them to jit
    arch: str | None = None      # an arch-specific target (sm_90a): built only for its base arch

    def target(self, arch: str) -> str | None:
        """The arch to build this for when the check asks for `arch`; None: not there."""
        if self.arch is None:
            return arch
        return self.arch if self.arch.rstrip("a") == arch else None


def selftest_specialisations(all: bool) -> list[Specialisation]:
    """kernels_cu/selftest.cu: one per input type the dtype table names (all), or fp16 alone."""
    dtypes = (np.float16, ml_dtypes.bfloat16, np.float32) if all else (np.float16,)
    return [Specialisation("selftest", ("kvc_selftest_scale",),
                           {"KVC_SELFTEST_T": CPP_TYPES[np.dtype(dtype)], "KVC_SELFTEST_SCALE": 2})
            for dtype in dtypes]


CHECK_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 256)


def _check_plans(head_size: int) -> list:
    plans = [rotation_plan(head_size, "none"), rotation_plan(head_size, "blockdiag"),
             rotation_plan(head_size, "blockdiag", preset="vllm")]
    if kron_factors(head_size):
        plans.append(rotation_plan(head_size, "kron"))
    return plans


def write_specialisations(all: bool) -> list[Specialisation]:
    """write.py's kernels (write.cu, rotate.cu, copy_blocks.cu): with all=True,
    every KV dtype x input dtype x rotation (x auto cache dtype) over CHECK_HEAD_SIZES;
    else one of each code path (each KV dtype, input dtype and rotation kind, the
    smallest and largest head size, the orders, the copy)."""
    models = list(formats.MODEL_DTYPES.values())
    found = [Specialisation("copy_blocks", ("copy_blocks",), {})]
    if all:
        for head_size in CHECK_HEAD_SIZES:
            for plan in _check_plans(head_size):
                for input_dtype in models:
                    for kv_dtype, info in formats.KV_DTYPES.items():
                        for cache_dtype in (models if not info.quantized else [input_dtype]):
                            found.append(Specialisation("write", ("reshape_and_cache",), dict(write_defines(
                                head_size, kv_dtype, cache_dtype, input_dtype, plan))))
                    for output_dtype in {input_dtype, np.dtype(np.float32)}:
                        for orders in (False, True):
                            found.append(Specialisation("rotate", ("rotate_rows",), dict(rotate_defines(
                                head_size, plan, input_dtype, output_dtype, orders))))
        # Presets that differ only in their signs (runtime data) share a build.
        return list({(spec.entry, tuple(sorted(spec.defines.items()))): spec for spec in found}.values())
    bf16, fp16, fp32 = BFLOAT16, np.dtype(np.float16), np.dtype(np.float32)
    for head_size, kind, preset, kv_dtype, input_dtype in (
            (128, "blockdiag", "kvcupy", "int4_per_token_head", bf16),
            (96, "blockdiag", "vllm", "int4_per_token_head", fp16),
            (96, "kron", "kvcupy", "int8_per_token_head", fp32),
            (256, "none", None, "fp8_per_token_head", bf16),
            (32, "blockdiag", "kvcupy", "auto", fp16)):
        plan = rotation_plan(head_size, kind, preset)
        found.append(Specialisation("write", ("reshape_and_cache",), dict(write_defines(
            head_size, kv_dtype, input_dtype, input_dtype, plan))))
        found.append(Specialisation("rotate", ("rotate_rows",), dict(rotate_defines(
            head_size, plan, input_dtype, fp32 if kind == "kron" else input_dtype, kind == "blockdiag"))))
    return found


def attention_specialisations(all: bool) -> list[Specialisation]:
    """attention.cu's kernels (planner.py's builds). all=True: every KV dtype x head-size
    class x query rows per warp, at 8 and 4 warps a block and 16-byte copies (the
    aligned caches the library allocates), plus the merge kernel for
    every dtype, and the prefill kernel for every KV dtype and head-size class up to
    PREFILL_MAX_HEAD_PAD; else a sample that takes each code path once, the 4-byte
    and byte-wise copies of strided and odd-length rows among them."""
    models = list(formats.MODEL_DTYPES.values())
    found = [Specialisation("attention", ("merge_splits",), {"KVC_OUT_T": formats.CPP_TYPES[d]})
             for d in models]
    kernels = []
    if all:
        for kv in (KV_INT4, KV_INT8, KV_FP8, KV_F16, KV_BF16):
            for head_pad in range(HEAD_CLASS, 257, HEAD_CLASS):
                for heads in (8, 4):
                    for quads in (1, 2, 4) if head_pad <= MAX_HEAD_PAD_FOUR_QUADS else (1, 2):
                        tile = 32 if kv == KV_INT4 else 16
                        # Every staging: bulk or row copies on sm_90 where the pages allow them (16-bit caches: rows).
                        quantized = kv in (KV_INT4, KV_INT8, KV_FP8)
                        stagings = (STAGE_THREADS, STAGE_BULK, STAGE_ROWS) if quantized else (STAGE_THREADS, STAGE_ROWS)
                        settled = [_settle_staging(_round_tile(Kernel(kv, head_pad, heads, quads, tile, 16, staging),
                                                               DEFAULT_TUNING),
                                                   quantized)
                                   for staging in stagings]
                        longer = [_long_tile(kernel, DEFAULT_TUNING) for kernel in settled]
                        # and the one-block build that the two-block one's short splits take
                        one_block = [replace(kernel, stages=STAGES) for kernel in longer if kernel.rows_before]
                        kernels += settled + [kernel for kernel in longer + one_block if kernel not in settled]
                if head_pad <= PREFILL_MAX_HEAD_PAD:
                    kernels.append(PrefillKernel.planned(kv, head_pad, 16, False))
                    kernels += _short_prompt_builds(kv, head_pad, 16)
                    kernels.append(PrefillKernel.planned(kv, head_pad, 16, True, producer=True))
                    if kv in (KV_F16, KV_BF16):
                        kernels.append(replace(kernels[-1], direct=True))
    else:
        int4_rows = Kernel(KV_INT4, 128, 8, 1, DECODE_ROUND_TILE, 16, STAGE_ROWS)
        kernels = [int4_rows, _long_tile(int4_rows, DEFAULT_TUNING),
                   Kernel(KV_INT4, 96, 8, 4, 32, 4),
                   Kernel(KV_INT4, 64, 2, 2, 32, 1), Kernel(KV_INT8, 256, 8, 2, 16, 16),
                   Kernel(KV_FP8, 128, 4, 4, 16, 16, STAGE_ROWS), Kernel(KV_FP8, 128, 8, 1, 32, 16, STAGE_ROWS),
                   Kernel(KV_INT8, 96, 8, 1, 32, 16, STAGE_BULK, 2), Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS),
                   _long_tile(Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS), DEFAULT_TUNING),
                   replace(_long_tile(Kernel(KV_INT4, 96, 8, 1, 32, 16, STAGE_ROWS), DEFAULT_TUNING), stages=STAGES),
                   Kernel(KV_F16, 128, 4, 1, 16, 16), Kernel(KV_BF16, 128, 4, 1, 16, 16, STAGE_ROWS),
                   Kernel(KV_BF16, 96, 4, 2, 16, 8), Kernel(KV_BF16, 64, 4, 1, 16, 16),
                   PrefillKernel.planned(KV_INT4, 128, 16, False), PrefillKernel.planned(KV_INT8, 96, 4, False),
                   PrefillKernel.planned(KV_FP8, 64, 16, False), PrefillKernel.planned(KV_F16, 128, 16, False),
                   PrefillKernel.planned(KV_BF16, 32, 1, False),
                   PrefillKernel.planned(KV_INT4, 128, 16, True), PrefillKernel.planned(KV_FP8, 96, 4, True),
                   PrefillKernel.planned(KV_INT8, 32, 16, True),
                   PrefillKernel.planned(KV_INT4, 128, 16, True, producer=True),
                   PrefillKernel.planned(KV_INT8, 96, 4, True, producer=True),
                   PrefillKernel.planned(KV_BF16, 128, 16, True, producer=True),
                   PrefillKernel.planned(KV_F16, 64, 8, True), PrefillKernel.planned(KV_BF16, 96, 16, True),
                   *_short_prompt_builds(KV_INT4, 128, 16), *_short_prompt_builds(KV_FP8, 96, 4),
                   *_short_prompt_builds(KV_BF16, 128, 16)]
        # The direct builds: a stager's own piece (d = 128, 16-byte pieces; d = 64, 8-byte), the general loop (d = 96),
        # as a 16-bit call takes them (a bf16 row's direct build serves a bf16 query alone).
        kernels += [replace(PrefillKernel.planned(kv, head_pad, chunk, True, producer=True), direct=True,
                            wide_rows=False)
                    for kv, head_pad, chunk in ((KV_BF16, 128, 16), (KV_F16, 96, 16), (KV_F16, 64, 8))]
        # Builds for 16-bit rows only: mma.sync, wgmma, producer and short.
        kernels += [replace(kernel, wide_rows=False)
                    for kernel in (PrefillKernel.planned(KV_INT4, 128, 16, False),
                                   PrefillKernel.planned(KV_FP8, 96, 4, True),
                                   PrefillKernel.planned(KV_INT4, 128, 16, True, producer=True),
                                   *_short_prompt_builds(KV_INT4, 128, 16))
                    if kernel.rotated]
    if all:   # every rotated prefill build's twin for 16-bit rows only (for_query)
        kernels += [replace(kernel, wide_rows=False) for kernel in kernels
                    if isinstance(kernel, PrefillKernel) and kernel.rotated]
    found += [Specialisation("attention", (kernel.entry,), kernel.defines, kernel.arch)
              for kernel in kernels]
    return found


# Kernel families: "module:function" (imported only when listed) or a function here.
FAMILIES: tuple[str | Callable[[bool], list[Specialisation]], ...] = (
    selftest_specialisations,
    write_specialisations,
    attention_specialisations,
)


def _family_function(family) -> Callable[[bool], list[Specialisation]]:
    if callable(family):
        return family
    module, function = family.split(":")
    return getattr(importlib.import_module(module), function)


def specialisations(all: bool = False) -> list[Specialisation]:
    """Every family's specialisations (all=True) or its sample, in FAMILIES order, each
    once (a family's sample can name one build twice, e.g. the prefill kernel's
    planned build and a short-prompt list's long-prompt build)."""
    found: dict[tuple, Specialisation] = {}
    for family in FAMILIES:
        for spec in map(Specialisation._make, _family_function(family)(all)):
            found.setdefault((spec.entry, spec.functions, tuple(sorted(spec.defines.items())), spec.arch), spec)
    return list(found.values())
