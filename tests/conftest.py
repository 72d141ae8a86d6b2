"""Process-wide settings the tests need before any framework touches a GPU, and
`--shard K/N`: run the Kth of N interleaved parts of the selected tests, so that
N processes share one GPU's suite (each compiles the builds its part takes)."""

import os

import pytest

# JAX's GPU client takes 75% of the device's memory when it starts, whichever
# test first touches JAX; the CuPy and torch tests of the same run need theirs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only the Kth (0-based) of N interleaved parts of the selected tests")


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N) with 0 <= K < N; ValueError otherwise."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes K/N, two integers (e.g. 0/4), not {text!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"--shard {text}: K must be at least 0 and below N")
    return index, count


def pytest_collection_modifyitems(config, items):
    text = config.getoption("--shard")
    if text is None:
        return
    try:
        index, count = parse_shard(text)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    # Every Nth test: each part takes a share of every parametrised grid, so the parts
    # take about as long and compile different builds at the same time.
    kept = items[index::count]
    config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index])
    items[:] = kept
