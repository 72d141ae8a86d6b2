"""The README's example runs as written, and its commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_example_runs():
    example = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    out, query = namespace["out"], namespace["query"]
    assert out.shape == query.shape and out.dtype == query.dtype


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
