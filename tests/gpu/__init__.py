"""Tests that need a GPU (CUDA): the kernels against the oracle, graphs, the
framework handoff on the device. Without one they skip; the long-context file
also holds its CPU cases (unmarked)."""
