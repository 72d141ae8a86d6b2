"""The CUDA specialisations kvcupy can launch: what `kvcupy check` compiles.

Each kernel family (one entry file in kernels_cu/ and the module that
launches it) contributes one function `specialisations(all: bool) ->
list[Specialisation]` and adds it to FAMILIES below. It lists the (entry,
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
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np

from kvcupy.formats import CPP_TYPES


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


# Kernel families: "module:function" (imported only when listed) or a function here.
FAMILIES: tuple[str | Callable[[bool], list[Specialisation]], ...] = (
    selftest_specialisations,
    "kvcupy.backends.cuda:specialisations",
    "kvcupy.backends.cuda_attention:specialisations",
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
