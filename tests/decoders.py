"""What the decoder tests (tests/cpu/test_decoder_torch.py, test_decoder_jax.py)
demand of a run.

Each run generates greedily three times: with the framework's own attention
over a float16 cache (the reference), then with kvcupy's PagedKVCache fed the
reference's tokens (teacher forcing: logits comparable at every step), then
with kvcupy generating on its own (examples/decoding.py).

Token-for-token equality is a fair demand only where every greedy choice of
the reference wins by more than the two attentions can differ. The model's
seeds (decoding.random_weights, decoding.prompts) were picked so that the
smallest gap between a step's best and second-best logit is 3% of that
step's logit spread (`decision_margin`); the auto cache differs from the
reference by ~1e-5 of the logits on the CPU and by at most the CUDA kernel's
2e-3 attention bound (tests/gpu/test_attention.py) on a GPU, so its tokens must
be the reference's.

Quantized caches: the logit error is what their rounding predicts (int8:
absmax / 254 per element, ~0.4%; fp8 e4m3: 3 mantissa bits; int4: 15 levels,
~16x int8), bounded here with a margin of 4-5x over the measured values
(int8 4.1e-3, fp8 1.8e-2, int4 6.5e-2 on the CPU). Top-1 agreement under
teacher forcing is bounded loosely; the free-running token agreement is only
reported (one early difference changes everything after it).
"""

from __future__ import annotations

import numpy as np
import pytest

from examples import decoding
from kvcupy import backends

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
KV_DTYPES = ["auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]

MIN_MARGIN = 0.02   # of the logit spread: well above either device's auto-cache difference
AUTO_LOGIT_ERROR = {"cpu": 1e-4, "cuda": 2e-3}
# kv_dtype -> (largest relative logit error, smallest top-1 agreement under teacher forcing)
QUANTIZED_BOUNDS = {"int8_per_token_head": (0.02, 0.9), "fp8_per_token_head": (0.08, 0.9),
                    "int4_per_token_head": (0.3, 0.75)}


def require_kvcupy_device(device: str) -> None:
    """Skip a GPU case where kvcupy's CUDA backend cannot run."""
    if device != "cpu" and not backends.status("cuda").usable:
        pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}")


def decision_margin(generation: decoding.Generation) -> float:
    """The smallest (best - second best logit) / logit spread over every greedy choice."""
    rows = np.concatenate([np.stack(r) for r in generation.logits])
    top = np.sort(rows, axis=1)[:, -2:]
    return float(np.min((top[:, 1] - top[:, 0]) / rows.std(axis=1)))


def check_run(run, framework: str, kv_dtype: str, device: str, record_property) -> None:
    reference, forced, free = run(kv_dtype, device)
    result = decoding.agreement(reference, forced, free)
    print(f"{framework} decoder, {kv_dtype} cache on {device}: {result}")
    for name in ("logit_error", "worst_step_error", "top1_agreement", "token_agreement"):
        record_property(name, getattr(result, name))
    case = f"{framework}, {kv_dtype}, {device}: {result}"
    assert len(free.tokens) == len(reference.tokens) == 4, "three prompts and one fork"
    if kv_dtype == "auto":
        margin = decision_margin(reference)
        assert margin >= MIN_MARGIN, f"the reference's closest choice wins by {margin:.3f} only"
        assert free.tokens == reference.tokens, case
        assert result.logit_error < AUTO_LOGIT_ERROR[device], case
        return
    max_error, min_top1 = QUANTIZED_BOUNDS[kv_dtype]
    assert result.logit_error < max_error, case
    assert result.top1_agreement >= min_top1, case
