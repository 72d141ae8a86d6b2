"""The HIP specialisations kvcupy can launch on AMD GPUs: what `kvcupy check --arch gfx...` compiles.

The HIP entries (kernels_hip/write.hip, rotate.hip, copy_blocks.hip,
merge.hip) keep their CUDA twins' kernels and -D defines, so their builds
are the CUDA families' own, listed by `cuda.specs`: the write family's
(write.cu, rotate.cu, copy_blocks.cu) as they are, and the merge builds of the
attention family (attention.cu's merge_splits, one a model dtype) with the
entry merge.hip. all=False: the write family's sample; all=True: every build.
Like `cuda.specs`, this imports no CuPy.
"""

from __future__ import annotations

from ..cuda.specs import Specialisation, attention_specialisations, write_specialisations

ENTRIES = ("write", "rotate", "copy_blocks", "merge")
MERGE_FUNCTION = "merge_splits"


def merge_specialisations() -> list[Specialisation]:
    """merge.hip's builds: the CUDA merge's (one per output dtype), every one in the sample too."""
    return [spec._replace(entry="merge") for spec in attention_specialisations(False)
            if spec.functions == (MERGE_FUNCTION,)]


def hip_specialisations(all: bool = False) -> list[Specialisation]:
    """Every HIP build the launchers can request (all=True), or a sample taking each code path once."""
    found = write_specialisations(all) + merge_specialisations()
    unknown = {spec.entry for spec in found} - set(ENTRIES)
    if unknown:   # the write family grew an entry: kernels_hip/ needs its .hip twin
        raise RuntimeError(f"the CUDA write family has entries kernels_hip/ lacks: {sorted(unknown)}")
    return found
