"""The README's examples run as written, and its commands are the ones CI runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, re.S)


def run_example(framework: str) -> dict:
    """Run the README example that starts by importing `framework`; its variables."""
    example = next(block for block in EXAMPLES if block.startswith(f"import {framework}"))
    namespace = {}
    exec(compile(example, f"README.md ({framework} example)", "exec"), namespace)
    return namespace


def test_readme_example_runs():
    namespace = run_example("numpy")
    out, query = namespace["out"], namespace["query"]
    assert out.shape == query.shape and out.dtype == query.dtype


def test_readme_torch_example_answers_in_torch():
    torch = pytest.importorskip("torch")
    namespace = run_example("torch")
    out, query = namespace["out"], namespace["query"]
    assert isinstance(out, torch.Tensor) and out.device == query.device
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.isfinite(out).all()


def test_readme_jax_example_answers_in_jax():
    jax = pytest.importorskip("jax")
    namespace = run_example("jax")
    out, query = namespace["out"], namespace["query"]
    assert isinstance(out, jax.Array)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert bool(jax.numpy.isfinite(out).all())


def test_readme_links_the_format_document():
    assert "(docs/format.md)" in README and (ROOT / "docs" / "format.md").is_file()


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


# Words of a lab report, not of documentation: the loan of a machine, a run's
# number, a date of work, an issue number, a folder of a measuring harness.
LAB_REPORT = re.compile(r"\bsessions?\b|\blent\b|\bdevice calls?\b|\$OUT\b|\brun\d+\b"
                        r"|\b20\d\d-\d\d-\d\d\b|(?<![\w&])#\d+\b", re.I)


@pytest.mark.parametrize("document", ["README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_documents_describe_the_product_not_its_history(document):
    found = [(number, line.strip()) for number, line in
             enumerate((ROOT / document).read_text().splitlines(), 1) if LAB_REPORT.search(line)]
    assert not found, f"{document}: {found[:5]}"


def test_readme_stays_short():
    assert len(README.splitlines()) <= 250
