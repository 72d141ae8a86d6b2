"""tools/flashinfer_bundle.py: which files of FlashInfer's wheel the bundle keeps
(Python, data tables, templates and the sources its decode and page generators copy;
not the rest of its C++ sources, headers or third-party trees)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("flashinfer_bundle", ROOT / "tools" / "flashinfer_bundle.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.parametrize("name", [
    "flashinfer/__init__.py",
    "flashinfer/decode.py",
    "flashinfer/experimental/cake_nvfp4_per_token/support.py",
    "flashinfer/fused_moe/configs/table.json",
    "flashinfer/data/csrc/batch_decode_customize_config.jinja",
    "flashinfer/data/csrc/batch_decode.cu",
    "flashinfer/data/csrc/flashinfer_page_binding.cu",
    "flashinfer/py.typed",
    "flashinfer_python-0.7.4.dist-info/METADATA",
])
def test_keeps_what_import_and_the_decode_generators_read(name):
    assert tool.kept(name)


@pytest.mark.parametrize("name", [
    "flashinfer/data/csrc/batch_prefill.cu",
    "flashinfer/data/csrc/nv_internal/cpp/common/logger.cpp",
    "flashinfer/data/include/flashinfer/attention/decode.cuh",
    "flashinfer/data/cutlass/include/cute/tensor.hpp",
    "flashinfer/data/cccl/cub/cub/cub.cuh",
    "flashinfer/cake_ulysses_backend/csrc/kernel.cu",
    "other_package/__init__.py",
])
def test_leaves_out_other_sources_and_headers(name):
    assert not tool.kept(name)


def test_every_generator_source_is_kept():
    assert all(tool.kept(f"flashinfer/data/csrc/{source}") for source in tool.GENERATOR_SOURCES)
