"""Fixtures the GPU tests share."""

import pytest


@pytest.fixture
def torch_cuda():
    """torch, where it sees a CUDA device (the test is skipped otherwise)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    return torch
