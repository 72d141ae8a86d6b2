"""The HIP specialisations kvcupy can launch on AMD GPUs: what `kvcupy check --arch gfx...` compiles.

The HIP entries (kernels_hip/write.hip, rotate.hip, copy_blocks.hip,
merge.hip) keep their CUDA twins' kernels and -D defines, so their builds
are the CUDA families' own, listed by `cuda.specs`: the write family's
(write.cu, rotate.cu, copy_blocks.cu) as they are, and the merge builds of the
attention family (attention.cu's merge_splits, one a model dtype) with the
entry merge.hip. The MFMA attention (attention.hip) has builds of its own
(rocm.attention.builds): each KV kind at each padded head size.
all=False: a sample taking each code path once; all=True: every build.
Like `cuda.specs`, this imports no CuPy.
"""

from __future__ import annotations

from ..cuda.specs import Specialisation, attention_specialisations, write_specialisations
from .attention import ENTRY as ATTENTION_ENTRY
from .attention import FUNCTION as ATTENTION_FUNCTION
from .attention import builds as attention_builds

ENTRIES = ("write", "rotate", "copy_blocks", "merge", ATTENTION_ENTRY)
MERGE_FUNCTION = "merge_splits"
# The sample's head sizes: the smallest, a padded one (34 -> 48), the common
# ones and the largest; every KV kind at 128.
SAMPLE_HEAD_PADS = (32, 48, 96, 128, 256)


def merge_specialisations() -> list[Specialisation]:
    """merge.hip's builds: the CUDA merge's (one per output dtype), every one in the sample too."""
    return [spec._replace(entry="merge") for spec in attention_specialisations(False)
            if spec.functions == (MERGE_FUNCTION,)]


def mfma_attention_specialisations(all: bool = False) -> list[Specialisation]:
    """attention.hip's builds: every one (all=True), or each KV kind at 128 and int4 at
    SAMPLE_HEAD_PADS."""
    kernels = [kernel for kernel in attention_builds()
               if all or kernel.head_pad == 128 or (kernel.kv == 0 and kernel.head_pad in SAMPLE_HEAD_PADS)]
    return [Specialisation(ATTENTION_ENTRY, (ATTENTION_FUNCTION,), kernel.defines) for kernel in kernels]


def hip_specialisations(all: bool = False) -> list[Specialisation]:
    """Every HIP build the launchers can request (all=True), or a sample taking each code path once."""
    found = write_specialisations(all) + merge_specialisations() + mfma_attention_specialisations(all)
    unknown = {spec.entry for spec in found} - set(ENTRIES)
    if unknown:   # the write family grew an entry: kernels_hip/ needs its .hip twin
        raise RuntimeError(f"the CUDA write family has entries kernels_hip/ lacks: {sorted(unknown)}")
    return found
