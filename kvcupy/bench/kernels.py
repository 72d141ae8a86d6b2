"""The bench's own kernels (kvcupy/bench/kernels_cu/, not shipped with the
library's kernels_cu/): stream_pages.cu, the ceiling of paged decode, and
hold_stream.cu, which holds a stream while the host queues a timed series.
They compile through jit like the library's, from this folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import formats, jit
from .shapes import ALL_KV_DTYPES, BLOCK_SIZE, FULL_SIZES, QUICK_SIZES

SOURCE_DIR = Path(__file__).resolve().parent / "kernels_cu"
STREAM_THREADS = 256


def get_function(entry: str, function: str, defines: dict):
    """jit.get_function of one of the bench's kernels (the current device)."""
    return jit.get_function(entry, function, defines, root=SOURCE_DIR)


def compile_entry(entry: str, defines: dict, arch: str) -> jit.CompileResult:
    """jit.compile_entry of one of the bench's kernels (no GPU needed)."""
    return jit.compile_entry(entry, defines, arch, root=SOURCE_DIR)


def stream_defines(num_kv_heads: int, head_size: int, kv_dtype: str, model_dtype: np.dtype) -> dict:
    """-D defines of kernels_cu/stream_pages.cu for one cache geometry."""
    info = formats.kv_dtype_info(kv_dtype)
    row = num_kv_heads * info.stored_head_size(head_size) * info.storage_dtype(model_dtype).itemsize
    return {"KVC_THREADS": STREAM_THREADS, "KVC_BLOCK_SIZE": BLOCK_SIZE, "KVC_ROW_BYTES": row,
            "KVC_SCALE_ROW_BYTES": 4 * num_kv_heads if info.quantized else 0}



def kernel_specialisations(all: bool) -> list[tuple[str, tuple[str, ...], dict]]:
    """(entry, kernels, defines) of the bench's own kernels, as `kvcupy check` lists
    them (kvcupy.backends.cuda.specs): the full run's geometries, and the quick
    run's too with all=True. The model dtype only sizes an "auto" row, where
    bf16 and fp16 agree."""
    geometries = {(s.num_kv_heads, s.head_size) for s in FULL_SIZES.decode}
    if all:
        geometries |= {(s.num_kv_heads, s.head_size) for s in QUICK_SIZES.decode}
    bf16 = formats.MODEL_DTYPES["bfloat16"]
    defines = {tuple(sorted(stream_defines(heads, head_size, kv_dtype, bf16).items()))
               for heads, head_size in geometries for kv_dtype in ALL_KV_DTYPES}
    return [("hold_stream", ("hold_stream",), {})] + [
        ("stream_pages", ("stream_pages",), dict(d)) for d in sorted(defines)]
