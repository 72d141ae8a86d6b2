"""The snippets of the README's "Using kvcupy from torch / JAX" run as written, on the
CPU here and (marked gpu) on a CUDA device."""

import re
from pathlib import Path

import numpy as np
import pytest

from kvcupy import backends

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
SECTION = README.split("## Using kvcupy from torch / JAX\n", 1)[1].split("\n## ", 1)[0]
SNIPPETS = re.findall(r"```python\n(.*?)```", SECTION, re.S)


def run(*markers: str) -> dict:
    """Run, in one namespace, the section's snippets whose first line holds each marker."""
    namespace = {}
    for marker in markers:
        snippet = next(s for s in SNIPPETS if marker in s.splitlines()[0])
        exec(compile(snippet, f"README.md ({marker})", "exec"), namespace)
    return namespace


def needs_cuda(torch) -> None:
    if not backends.status("cuda").usable or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device that torch and kvcupy can use")


def check_engine_cache(torch, namespace: dict) -> None:
    assert namespace["key_cache"].any() and namespace["k_scale"].any(), "the write landed in torch's tensors"
    out, query = namespace["out"], namespace["query"]
    assert out.device == query.device and out.dtype == query.dtype and bool(torch.isfinite(out).all())


def test_the_section_has_its_snippets():
    assert len(SNIPPETS) == 4, "engine cache, streams, JAX functional write, decoders"


def test_torch_engine_cache_is_written_in_place():
    torch = pytest.importorskip("torch")
    check_engine_cache(torch, run("the engine's own cache"))


@pytest.mark.gpu
def test_torch_engine_cache_and_streams_on_a_gpu():
    torch = pytest.importorskip("torch")
    needs_cuda(torch)
    namespace = run("the engine's own cache", "continues the example above")
    assert namespace["device"] == "cuda"
    namespace["stream"].synchronize()
    check_engine_cache(torch, namespace)
    assert namespace["logits"].shape == (1, 1000) and bool(torch.isfinite(namespace["logits"]).all())


def test_jax_cache_is_written_functionally():
    jax = pytest.importorskip("jax")
    namespace = run("written functionally")
    out, query, cache = namespace["out"], namespace["query"], namespace["cache"]
    assert isinstance(out, jax.Array) and out.shape == query.shape and out.dtype == query.dtype
    assert bool(jax.numpy.isfinite(out).all())
    assert np.asarray(cache.key_cache)[:3].any(), "the returned cache holds the tokens"


def test_decoder_snippet_reports_agreement(capsys):
    pytest.importorskip("torch")
    run("from a checkout")
    assert "logit error" in capsys.readouterr().out
