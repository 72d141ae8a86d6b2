"""The warpgroup products of the prefill kernel's sm_90a build (kernels_cu/wgmma.cuh),
through tests/gpu/kernels/wgmma_check.cu (a test kernel, not shipped), against NumPy.

The operands are small integers (|x| <= 8) and 2^-k multiples that fp16 holds
exactly, and every product and partial sum is exact in fp32: the results must
match exactly. Swapping a descriptor's two strides must not, which pins which
stride is which.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcupy import backends

pytestmark = pytest.mark.gpu

if not backends.status("cuda").usable:
    pytest.skip(f"the CUDA backend is not usable here: {backends.status('cuda').detail}",
                allow_module_level=True)

import cupy  # noqa: E402

from kvcupy import jit  # noqa: E402

TEST_KERNELS = Path(__file__).parent / "kernels"

if cupy.cuda.Device().compute_capability != "90":
    pytest.skip("wgmma needs an sm_90 GPU", allow_module_level=True)


def operands(rng, shape):
    return (rng.integers(-8, 9, shape) / rng.choice([1.0, 2.0, 4.0], shape)).astype(np.float16)


def launch(name, a, b, swap):
    kernel = jit.get_function("wgmma_check", name, {}, arch="sm_90a", root=TEST_KERNELS)
    out = cupy.zeros((64, 64), cupy.float32)
    kernel((1,), (128,), (cupy.asarray(a.view(np.uint16)), cupy.asarray(b.view(np.uint16)), out, np.int32(swap)))
    return cupy.asnumpy(out)


def test_score_product_reads_query_and_key_rows_as_the_prefill_kernel_lays_them_out():
    rng = np.random.default_rng(0)
    query, keys = operands(rng, (64, 32)), operands(rng, (64, 32))
    expected = query.astype(np.float32) @ keys.astype(np.float32).T
    np.testing.assert_array_equal(launch("wgmma_scores", query, keys, swap=0), expected)
    assert not np.array_equal(launch("wgmma_scores", query, keys, swap=1), expected)


def test_output_product_takes_probabilities_from_registers_and_value_rows_mn_major():
    rng = np.random.default_rng(1)
    probabilities, values = operands(rng, (64, 64)), operands(rng, (64, 64))
    expected = probabilities.astype(np.float32) @ values.astype(np.float32)
    np.testing.assert_array_equal(launch("wgmma_values", probabilities, values, swap=0), expected)
    assert not np.array_equal(launch("wgmma_values", probabilities, values, swap=1), expected)
