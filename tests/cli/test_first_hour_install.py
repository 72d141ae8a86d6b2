"""A new user's set-up: the README's two commands run in order, and the CPU backend
never writes into the installed package (pip leaves such files behind on uninstall,
and the folder they keep shadows the next, editable, install)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numba
import pytest

import kvcupy
from kvcupy import jit
from kvcupy.backends import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(kvcupy.__file__).resolve().parent


def readme_setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [c for c in re.findall(r"```sh\n(.*?)\n```", setup, re.S) if c.startswith("python3 -m venv")]


def test_ci_runs_both_readme_commands_in_order_in_one_fresh_clone():
    """One CI step clones the repository and runs the install-and-repro command, then the
    install-and-test command, in that clone: the order a new user follows."""
    commands = readme_setup_commands()
    assert len(commands) == 2 and "repro" in commands[0] and "pytest" in commands[1], commands
    ci = (ROOT / ".ci" / "run").read_text()
    step = re.search(r'git clone -q "\$root" "(?P<clone>[^"]+)"\n\(\n(?P<body>.*?)\n\)', ci, re.S)
    assert step, "no CI step runs commands in a fresh clone"
    lines = [line.strip() for line in step["body"].splitlines()]
    assert lines == [f'cd "{step["clone"]}"', *commands], lines


def test_cpu_kernels_are_cached_under_kvcupys_cache_root():
    if os.environ.get("NUMBA_CACHE_DIR"):
        pytest.skip("NUMBA_CACHE_DIR is set: Numba's own setting takes precedence")
    expected = Path(jit.cache_dir()) / f"numba-{numba.__version__}"
    assert cpu_kernels.CACHE_DIR == str(expected)
    cached = [f for f in vars(cpu_kernels).values() if getattr(f, "_cache", None) is not None
              and hasattr(f._cache, "_impl")]
    assert len(cached) >= 30   # every kernel and helper of cpu_kernels
    for function in cached:
        where = Path(function._cache._impl.locator.get_cache_path())
        assert expected in where.parents, (function.py_func.__name__, where)


def test_numba_setting_of_the_process_is_left_as_it_was():
    """kvcupy points Numba at its folder only while defining its own kernels."""
    assert numba.config.CACHE_DIR == os.environ.get("NUMBA_CACHE_DIR", "")


def test_an_unwritable_cache_folder_means_no_disk_cache(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    monkeypatch.setattr(cpu_kernels, "cache_dir", lambda: blocker)   # a folder cannot go inside a file
    assert cpu_kernels._writable_cache_dir() is None
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba"))
    assert cpu_kernels._writable_cache_dir() == str(tmp_path / "numba")


def files_under(folder: Path) -> dict[str, int]:
    """Every file but the sources and Python's bytecode, with its modification time."""
    return {str(path): path.stat().st_mtime_ns for path in folder.rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc")}


def test_running_the_cpu_backend_writes_nothing_into_the_package(tmp_path):
    """A fresh cache folder makes Numba compile and save a kernel: it lands there,
    and nothing appears or changes under the package folder."""
    before = files_under(PACKAGE)
    env = {**os.environ, "KVCUPY_CACHE_DIR": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    script = ("import numpy as np, kvcupy as kc; "
              "kc.rotate(np.ones((4, 64), np.float32), kc.rotation_plan(64))")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path)
    assert list((tmp_path / f"numba-{numba.__version__}").rglob("cpu_kernels.rotate_rows-*.nbi"))
    assert files_under(PACKAGE) == before
