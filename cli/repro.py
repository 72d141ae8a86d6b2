"""`kvcupy repro`: the attention layer that crashed vLLM, run end to end through PagedKVCache.

vLLM's int4_per_token_head cache failed on Phi-3-mini, whose head size (96)
is not a power of two. The scenario here is one such layer: 32 query heads,
32 KV heads, block size 16, float16 K/V. One sequence runs a prompt through
the manager (prefill), then decode steps, one token each; every step reserves
its slots, writes its K/V and attends, as a serving engine would.

For each KV dtype it measures:
- attention error against float64 attention on the original (unquantized,
  unrotated) K/V: what the format costs in accuracy;
- error against the float64 oracle reading the *same* quantized cache: the
  implementation's own error, with the format's error taken out;
- bytes per token, against float16.
Queries are float32, so the output keeps float32 precision and the
implementation's error is not hidden under float16 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

import kvcupy
from kvcupy import formats, reference
from kvcupy.rotation import RotationPlan

from . import bounds
from .synthetic import Workload, make_workload

# Phi-3-mini-4k: 32 attention heads, no GQA, head size 96 (hidden 3072).
NUM_HEADS = 32
NUM_KV_HEADS = 32
BLOCK_SIZE = 16
MODEL_DTYPE = np.dtype(np.float16)

Progress = Callable[[str], None]   # called as each unit of work ends, with its name


@dataclass(frozen=True)
class ReproConfig:
    head_size: int
    kv_dtypes: tuple[str, ...]
    rotation: RotationPlan
    backend: str
    prompt_len: int
    decode_steps: int
    seed: int

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.decode_steps

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)


def total_steps(config: ReproConfig) -> int:
    """Units of work reported to Progress: the float64 reference, then per KV dtype
    the prefill, each decode step and the oracle."""
    return 1 + len(config.kv_dtypes) * (config.decode_steps + 2)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| over all elements, in float64."""
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected))


def rotation_roundtrip_error(plan: RotationPlan, key: np.ndarray) -> float:
    """Relative error of rotating the keys and rotating them back, in float32."""
    key32 = key.astype(np.float32)
    rotated = kvcupy.rotate(key32, plan)
    return relative_error(kvcupy.rotate(rotated, plan, inverse=True), key32)


def run_through_manager(config: ReproConfig, kv_dtype: str, workload: Workload,
                        progress: Progress):
    """Prefill then decode one sequence; returns (outputs [T, Hq, d] float32,
    the layer's KVCache, each token's slot)."""
    num_blocks = math.ceil(config.num_tokens / BLOCK_SIZE)
    manager = kvcupy.PagedKVCache(1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, config.head_size,
                                  kv_dtype=kv_dtype, device=config.backend,
                                  rotation=config.rotation, dtype=MODEL_DTYPE.name)
    seq_id = manager.add_sequence()
    on_device = device_arrays(config.backend)
    outputs, slots = [], []
    # (first token, token count) of each step: the prompt, then one token per decode step
    steps = [(0, config.prompt_len)] + [(config.prompt_len + i, 1) for i in range(config.decode_steps)]
    for first, count in steps:
        tokens = slice(first, first + count)
        slot_mapping = manager.reserve([seq_id], count)
        manager.write(0, on_device(workload.key[tokens]), on_device(workload.value[tokens]), slot_mapping)
        outputs.append(to_host(manager.attention(0, on_device(workload.query[tokens]), [seq_id],
                                                 query_lens=[count], softmax_scale=config.softmax_scale)))
        slots.append(np.asarray(slot_mapping))
        step = "prefill" if first == 0 else f"decode {first - config.prompt_len + 1}"
        progress(f"{kv_dtype}: {step}")
    return np.concatenate(outputs), host_cache(manager.layers[0]), np.concatenate(slots)


def device_arrays(backend: str) -> Callable[[np.ndarray], object]:
    """Inputs as the backend's arrays: NumPy for the CPU, CuPy for a GPU."""
    if backend == "cpu":
        return lambda array: array
    import cupy
    return cupy.asarray


def to_host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


def host_cache(cache):
    """The cache with NumPy copies of its tensors (the oracle reads host memory)."""
    return kvcupy.wrap_cache(*(None if t is None else to_host(t) for t in
                               (cache.key_cache, cache.value_cache, cache.k_scale_cache, cache.v_scale_cache)),
                             kv_dtype=cache.kv_dtype, rotation=cache.rotation)


def block_table_from_slots(slot_mapping: np.ndarray) -> np.ndarray:
    """The sequence's block table [1, num_blocks], read off the slots the manager gave.

    docs/format.md puts position p at slot block_table[p // B] * B + p % B, so the
    slots fix the table; a manager that broke that layout fails here.
    """
    positions = np.arange(slot_mapping.size)
    blocks, offsets = np.divmod(slot_mapping, BLOCK_SIZE)
    table = blocks[::BLOCK_SIZE]
    if np.any(offsets != positions % BLOCK_SIZE) or np.any(blocks != table[positions // BLOCK_SIZE]):
        raise RuntimeError("the manager's slot mapping does not place position p at offset "
                           "p % block_size of one block per block_size positions")
    return table[None].astype(np.int32)


def oracle_on_cache(config: ReproConfig, workload: Workload, layer_cache, slot_mapping) -> np.ndarray:
    """float64 attention of every token over the final cache.

    Cache entries never change once written, so attending at the end, with
    the causal mask, gives each token the keys it saw when it ran: one oracle
    pass covers prefill and every decode step.
    """
    return reference.paged_attention(
        workload.query, layer_cache, block_table=block_table_from_slots(slot_mapping),
        seq_lens=np.array([config.num_tokens]), cu_seqlens_q=np.array([0, config.num_tokens]),
        softmax_scale=config.softmax_scale)


def check_kv_dtype(config: ReproConfig, kv_dtype: str, workload: Workload,
                   unquantized: np.ndarray, progress: Progress) -> dict:
    outputs, layer_cache, slot_mapping = run_through_manager(config, kv_dtype, workload, progress)
    oracle = oracle_on_cache(config, workload, layer_cache, slot_mapping)
    progress(f"{kv_dtype}: oracle")

    attn_error = relative_error(outputs, unquantized)
    attn_bound = bounds.attention_bound(
        bounds.format_resolution(workload.key, kv_dtype, config.rotation, MODEL_DTYPE),
        bounds.format_resolution(workload.value, kv_dtype, config.rotation, MODEL_DTYPE),
        impl=bounds.impl_bound(config.backend))
    impl_error = relative_error(outputs, oracle)
    info = formats.kv_dtype_info(kv_dtype)
    bytes_per_token = info.bytes_per_token(NUM_KV_HEADS, config.head_size, MODEL_DTYPE)
    fp16_bytes = formats.kv_dtype_info("auto").bytes_per_token(NUM_KV_HEADS, config.head_size, MODEL_DTYPE)
    return {
        "kv_dtype": kv_dtype,
        "attn_rel_err_vs_fp64": attn_error,
        "attn_rel_err_bound": attn_bound,
        "impl_rel_err_vs_oracle": impl_error,
        "impl_rel_err_bound": bounds.impl_bound(config.backend),
        "bytes_per_token": bytes_per_token,
        "bytes_vs_fp16": bytes_per_token / fp16_bytes,
        "passed": attn_error <= attn_bound and impl_error <= bounds.impl_bound(config.backend),
    }


def run_repro(config: ReproConfig, progress: Progress) -> dict:
    """Run the scenario; the report is JSON-ready, `passed` only if every check passed."""
    workload = make_workload(config.num_tokens, NUM_HEADS, NUM_KV_HEADS, config.head_size,
                             config.seed, MODEL_DTYPE)
    plan = config.rotation
    roundtrip_error = rotation_roundtrip_error(plan, workload.key)
    rotation = {"kind": plan.kind, "plan": plan.describe(), "block": plan.block,
                "blocks": plan.blocks, "roundtrip_rel_err": roundtrip_error,
                "roundtrip_bound": bounds.ROUNDTRIP_BOUND,
                "passed": roundtrip_error <= bounds.ROUNDTRIP_BOUND}

    # The reference every KV dtype is compared with: float64 attention on the original K/V.
    unquantized = reference.attend(workload.query, workload.key.astype(np.float64),
                                   workload.value.astype(np.float64),
                                   softmax_scale=config.softmax_scale)
    progress("float64 reference")
    results = [check_kv_dtype(config, kv_dtype, workload, unquantized, progress)
               for kv_dtype in config.kv_dtypes]

    return {"head_size": config.head_size, "backend": config.backend, "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS, "block_size": BLOCK_SIZE, "model_dtype": MODEL_DTYPE.name,
            "prompt_len": config.prompt_len, "decode_steps": config.decode_steps, "seed": config.seed,
            "rotation": rotation, "results": results,
            "passed": rotation["passed"] and all(result["passed"] for result in results)}
