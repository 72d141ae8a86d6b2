"""Rotation plans: Hadamard matrices, exact inverses, presets, the CPU transform."""

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcupy as kc
from kvcupy import reference
from kvcupy.rotation import hadamard_matrix, kron_factors, sylvester

ROOT = Path(__file__).resolve().parents[2]
EVEN_HEAD_SIZES = range(32, 257, 2)
KRON_HEAD_SIZES = [d for d in EVEN_HEAD_SIZES if kron_factors(d)]


@pytest.mark.parametrize("order", [1, 2, 4, 8, 12, 16, 20, 28, 32, 256])
def test_hadamard_matrix_is_hadamard(order):
    h = hadamard_matrix(order)
    assert set(np.unique(h)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(h @ h.T, order * np.eye(order))


def test_sylvester_recursion():
    h2 = sylvester(2)
    np.testing.assert_array_equal(h2, [[1, 1], [1, -1]])
    np.testing.assert_array_equal(sylvester(8), np.block([[sylvester(4), sylvester(4)],
                                                          [sylvester(4), -sylvester(4)]]))


def test_checked_in_tables_match_their_generator():
    generated = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_hadamard_tables.py")],
                               check=True, capture_output=True, text=True).stdout
    assert generated == (ROOT / "kvcupy" / "_hadamard_tables.py").read_text()


@pytest.mark.parametrize("head_size", [96, 80, 192, 128, 130, 254])
def test_blockdiag_plan_shape(head_size):
    plan = kc.rotation_plan(head_size)
    block = head_size & -head_size
    assert (plan.block, plan.blocks, plan.norm) == (block, head_size // block, block)
    matrix = plan.matrix()
    for j in range(plan.blocks):   # one H_b per block, nothing across blocks
        rows = slice(j * block, (j + 1) * block)
        np.testing.assert_array_equal(matrix[rows, rows], sylvester(block))
        assert np.count_nonzero(matrix[rows]) == block * block


def test_describe_names_the_split():
    assert kc.rotation_plan(96).describe().startswith("96 = 32 x 3")
    assert kc.rotation_plan(96, "kron").describe().startswith("96 = 12 x 8")


@pytest.mark.parametrize("head_size", KRON_HEAD_SIZES)
def test_kron_plan_is_full_hadamard(head_size):
    plan = kc.rotation_plan(head_size, "kron")
    h = plan.matrix()
    np.testing.assert_array_equal(h @ h.T, head_size * np.eye(head_size))
    assert plan.norm == head_size and len(plan.signs) == head_size


def test_kron_rejects_head_sizes_without_factorisation():
    with pytest.raises(ValueError, match="head_size=72"):
        kc.rotation_plan(72, "kron")


def test_vllm_preset_uses_shipped_signs():
    plan = kc.rotation_plan(96, preset="vllm")
    assert plan.signs[:8] == (1, -1, 1, 1, -1, -1, -1, -1)
    assert plan.signs[:32] * 3 == plan.signs     # the same s in every block
    assert plan.rounds_to_input_dtype
    with pytest.raises(ValueError, match="preset='vllm'"):
        kc.rotation_plan(96, "kron", preset="vllm")


def test_kvcupy_signs_are_fixed():
    # A cache's bytes depend on these: they must never change between releases.
    assert "".join("+" if s > 0 else "-" for s in kc.rotation_plan(64).signs[:32]) == "----++-++++++-+--+++++++--+--+++"
    signs = np.array(kc.rotation_plan(256).signs)
    assert abs(signs.sum()) < 48    # balanced, as random signs are


ROUND_TRIP_CASES = [(d, kind) for d in EVEN_HEAD_SIZES for kind in ("blockdiag", "kron", "none")
                    if kind != "kron" or kron_factors(d)]


@pytest.mark.parametrize("head_size,kind", ROUND_TRIP_CASES)
def test_float32_round_trip_within_1e6(head_size, kind):
    plan = kc.rotation_plan(head_size, kind)
    x = np.random.default_rng(head_size).standard_normal((64, head_size)).astype(np.float32)
    back = kc.rotate(kc.rotate(x, plan), plan, inverse=True)
    error = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert back.dtype == np.float32
    assert error <= 1e-6, f"{kind} d={head_size}: round trip {error:.2e}"


@pytest.mark.parametrize("head_size,kind", [(d, kind) for d in (64, 80, 96, 112, 128, 160, 192, 256)
                                             for kind in ("blockdiag", "kron")
                                             if kind != "kron" or kron_factors(d)])
def test_cpu_rotation_matches_oracle(head_size, kind):
    plan = kc.rotation_plan(head_size, kind)
    x = np.random.default_rng(1).standard_normal((3, 5, head_size)).astype(np.float32)
    expected = reference.rotate(x, plan)
    np.testing.assert_allclose(kc.rotate(x, plan), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    np.testing.assert_allclose(kc.rotate(x, plan, inverse=True), reference.rotate(x, plan, inverse=True),
                               rtol=0, atol=1e-6 * np.abs(x).max())


@settings(max_examples=30, deadline=None)
@given(head_size=st.sampled_from([32, 48, 96, 160, 200]),
       data=st.data())
def test_oracle_rotation_preserves_dot_products(head_size, data):
    """q'.k' = norm * (q.k): why attention divides the softmax scale by the norm."""
    kind = data.draw(st.sampled_from(["blockdiag", "kron"] if kron_factors(head_size) else ["blockdiag"]))
    plan = kc.rotation_plan(head_size, kind)
    values = st.floats(-100, 100, allow_nan=False, width=32)
    q = np.array(data.draw(st.lists(values, min_size=head_size, max_size=head_size)))
    k = np.array(data.draw(st.lists(values, min_size=head_size, max_size=head_size)))
    rotated = reference.rotate(q, plan) @ reference.rotate(k, plan)
    assert rotated == pytest.approx(plan.norm * (q @ k), abs=1e-6 * plan.norm * (1 + np.abs(q) @ np.abs(k)))
    np.testing.assert_allclose(reference.rotate(reference.rotate(q, plan), plan, inverse=True), q,
                               atol=1e-9 * (1 + np.abs(q).max()))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_rotate_keeps_the_input_dtype(dtype):
    plan = kc.rotation_plan(96)
    x = np.random.default_rng(0).standard_normal((4, 96)).astype(dtype)
    y = kc.rotate(x, plan)
    assert y.dtype == np.dtype(dtype)
    expected = reference.rotate(x, plan).astype(dtype).astype(np.float64)
    # Both sides round the same float32 value to the input dtype; they may differ
    # by one unit of that dtype where the float32 values straddle a rounding tie.
    unit = float(ml_dtypes.finfo(dtype).eps) * np.abs(expected).max()
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=0, atol=unit)
