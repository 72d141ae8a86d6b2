"""The CUDA bench's accounting: the bytes a case must move and the FLOPs it does
(the package docstring says what is counted), how many input sets keep a
case's data out of L2, and whether a whole-model step's caches fit the GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import formats
from .shapes import BLOCK_SIZE, Case, Group, RotateShape, Shape, StepShape, WriteShape, attended_tokens

# A case moving less than this many times the L2 gets copies of its inputs to rotate among.
L2_ROTATE_FACTOR = 4
MAX_INPUT_SETS = 8
# The share of the GPU's memory a step case's caches and inputs may take: the rest holds
# the CUDA context, the two frameworks' pools, the plans' workspaces and the graphs.
STEP_MEMORY_FRACTION = 0.9


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


def step_token_bytes(shape: StepShape, case: Case, model_dtype: np.dtype) -> int:
    """One token's K and V in one layer, as the case stores them: kvcupy's KV dtype
    (scales included), FlashInfer's fp8 one byte a value (one scale a tensor, not
    counted), torch's dense cache and FlashInfer's bf16 the model dtype."""
    if case.impl == "kvcupy":
        kv_dtype = case.kv_dtype
    elif case.impl == "flashinfer" and case.kv_dtype == "fp8_e4m3":
        return 2 * shape.num_kv_heads * shape.head_size
    else:
        kv_dtype = "auto"
    return formats.kv_dtype_info(kv_dtype).bytes_per_token(shape.num_kv_heads, shape.head_size, model_dtype)


def step_bytes(shape: StepShape, case: Case, model_dtype: np.dtype) -> int:
    """Every layer's attention (its whole cache, the query read, the output written) and,
    with writes, its new K and V read in the model dtype and written as stored."""
    per_token = step_token_bytes(shape, case, model_dtype)
    layer = shape.num_seqs * shape.seq_len * per_token + query_output_bytes(shape.layer, model_dtype)
    if case.writes:
        new = shape.layer_write
        layer += 2 * new.num_tokens * new.num_kv_heads * new.head_size * model_dtype.itemsize
        layer += new.num_tokens * per_token
    return shape.num_layers * layer


def step_flops(shape: StepShape) -> int:
    return shape.num_layers * attention_flops(shape.layer)


def step_layer_cache_bytes(shape: StepShape, case: Case, model_dtype: np.dtype) -> int:
    """One layer's cache as allocated: whole pages of BLOCK_SIZE tokens a sequence
    when paged, seq_len tokens a sequence for torch's dense cache."""
    tokens = shape.seq_len if case.impl == "dense" else math.ceil(shape.seq_len / BLOCK_SIZE) * BLOCK_SIZE
    return shape.num_seqs * tokens * step_token_bytes(shape, case, model_dtype)


def step_input_bytes(shape: StepShape, model_dtype: np.dtype) -> int:
    """One layer's step inputs and output: new K and V, the query and the output."""
    return 2 * shape.num_seqs * (shape.num_kv_heads + shape.num_heads) * shape.head_size * model_dtype.itemsize


@dataclass(frozen=True)
class StepFit:
    """Where a step case's caches go. layer_caches: the distinct caches each input
    set's layers run on (num_layers when every layer has its own; 0 when the case
    cannot run); needed_bytes: what they and the inputs take; reason: why not, or
    why layers share caches."""

    layer_caches: int
    needed_bytes: int
    reason: str | None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def step_fit(shape: StepShape, case: Case, model_dtype: np.dtype, sets: int, memory_bytes: int,
             l2_bytes: int) -> StepFit:
    """Every layer its own cache where all fit in STEP_MEMORY_FRACTION of the GPU's
    memory. Where they do not, layers take turns over as many caches as fit, but only
    where one layer's cache is at least L2_ROTATE_FACTOR x the L2: the next layer on
    the same cache finds none of it in L2, so the time is that of distinct caches.
    Otherwise the case does not run."""
    per_layer = step_layer_cache_bytes(shape, case, model_dtype)
    inputs = shape.num_layers * step_input_bytes(shape, model_dtype)
    budget = int(STEP_MEMORY_FRACTION * memory_bytes)
    needed = sets * (shape.num_layers * per_layer + inputs)
    if needed <= budget:
        return StepFit(shape.num_layers, needed, None)
    of_gpu = f"{_gib(budget)} ({STEP_MEMORY_FRACTION:.0%} of the GPU's {_gib(memory_bytes)})"
    too_big = (f"{shape.num_layers} layers' caches of {_gib(per_layer)} each take {_gib(needed)}, "
               f"more than {of_gpu}")
    caches = (budget - sets * inputs) // (sets * per_layer) if budget > sets * inputs else 0
    if per_layer < L2_ROTATE_FACTOR * l2_bytes:
        return StepFit(0, needed, f"does not fit: {too_big}, and a layer's cache is too small to share "
                                  "(the next layer would find it in L2)")
    if caches < 1:
        return StepFit(0, needed, f"does not fit: one layer's cache of {_gib(per_layer)} is more than {of_gpu}")
    return StepFit(caches, sets * (caches * per_layer + inputs),
                   f"{too_big}: the layers take turns over {caches} caches")


def case_bytes(group: Group, case: Case, model_dtype: np.dtype) -> int:
    shape = group.shape
    if group.kind == "step":
        return step_bytes(shape, case, model_dtype)
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
    if group.kind == "step":
        return step_flops(group.shape)
    if group.kind in ("decode", "prefill") and case.impl in ("kvcupy", "sdpa"):
        return attention_flops(group.shape)
    return None


def input_sets(moved_bytes: int, l2_bytes: int) -> int:
    """Copies of a case's inputs to rotate among, so that no call finds the
    previous call's data in L2."""
    if moved_bytes >= L2_ROTATE_FACTOR * l2_bytes:
        return 1
    return min(MAX_INPUT_SETS, math.ceil(L2_ROTATE_FACTOR * l2_bytes / max(moved_bytes, 1)))
