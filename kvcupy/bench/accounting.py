"""The CUDA bench's accounting: the bytes a case must move and the FLOPs it does
(the package docstring says what is counted), and how many input sets keep a
case's data out of L2."""

from __future__ import annotations

import math

import numpy as np

from .. import formats
from .shapes import Case, Group, RotateShape, Shape, WriteShape, attended_tokens

# A case moving less than this many times the L2 gets copies of its inputs to rotate among.
L2_ROTATE_FACTOR = 4
MAX_INPUT_SETS = 8


def cache_bytes(shape: Shape, kv_dtype: str, model_dtype: np.dtype) -> int:
    """K and V of every cached token, scales included: what an attention over
    the batch reads at least once."""
    per_token = formats.kv_dtype_info(kv_dtype).bytes_per_token(shape.num_kv_heads, shape.head_size,
                                                                 model_dtype)
    return shape.num_seqs * shape.seq_len * per_token


def query_output_bytes(shape: Shape, model_dtype: np.dtype) -> int:
    """The query read and the output written, model dtype."""
    return 2 * shape.num_seqs * shape.query_len * shape.num_heads * shape.head_size * model_dtype.itemsize


def attention_bytes(shape: Shape, kv_dtype: str, model_dtype: np.dtype) -> int:
    return cache_bytes(shape, kv_dtype, model_dtype) + query_output_bytes(shape, model_dtype)


def attention_flops(shape: Shape) -> int:
    """4 * d * Hq per (query token, key it sees): QK^T and PV, 2 FLOP a multiply-add each."""
    return 4 * shape.head_size * shape.num_heads * attended_tokens(shape)


def stream_bytes(shape: Shape, kv_dtype: str, model_dtype: np.dtype, splits: int) -> int:
    """The cache, and one 4-byte word written per thread block."""
    return cache_bytes(shape, kv_dtype, model_dtype) + 4 * shape.num_seqs * splits


def write_bytes(shape: WriteShape, kv_dtype: str, model_dtype: np.dtype) -> int:
    """K and V read in the model dtype, the packed cache (scales included) written."""
    read = 2 * shape.num_tokens * shape.num_kv_heads * shape.head_size * model_dtype.itemsize
    written = shape.num_tokens * formats.kv_dtype_info(kv_dtype).bytes_per_token(
        shape.num_kv_heads, shape.head_size, model_dtype)
    return read + written


def rotate_bytes(shape: RotateShape, model_dtype: np.dtype) -> int:
    return 2 * shape.num_vectors * shape.head_size * model_dtype.itemsize


def copy_bytes(partner_bytes: int) -> int:
    """A copy of half the partner's bytes moves (reads + writes) as many in all."""
    return 2 * (partner_bytes // 2)


def case_bytes(group: Group, case: Case, model_dtype: np.dtype) -> int:
    shape = group.shape
    if group.kind == "write":
        moved = write_bytes(shape, case.kv_dtype, model_dtype)
    elif group.kind == "rotate":
        moved = rotate_bytes(shape, model_dtype)
    elif case.impl == "stream":
        return stream_bytes(shape, case.kv_dtype, model_dtype, case.splits)
    else:   # SDPA reads the dense K/V an "auto" cache holds
        moved = attention_bytes(shape, "auto" if case.impl == "sdpa" else case.kv_dtype, model_dtype)
    return copy_bytes(moved) if case.impl == "copy" else moved


def case_flops(group: Group, case: Case) -> int | None:
    if group.kind in ("decode", "prefill") and case.impl in ("kvcupy", "sdpa"):
        return attention_flops(group.shape)
    return None


def input_sets(moved_bytes: int, l2_bytes: int) -> int:
    """Copies of a case's inputs to rotate among, so that no call finds the
    previous call's data in L2."""
    if moved_bytes >= L2_ROTATE_FACTOR * l2_bytes:
        return 1
    return min(MAX_INPUT_SETS, math.ceil(L2_ROTATE_FACTOR * l2_bytes / max(moved_bytes, 1)))
