"""conftest's --shard: N parts that partition the selected tests."""

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import parse_shard

SAMPLE = Path(__file__).with_name("test_rotation.py")


def collected(*options) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             *options, str(SAMPLE)], capture_output=True, text=True,
                            cwd=SAMPLE.parent.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_parts_partition_the_selection():
    everything = collected()
    parts = [collected("--shard", f"{k}/3") for k in range(3)]
    assert len(everything) > 3
    assert sorted(sum(parts, [])) == sorted(everything)
    assert all(abs(len(part) - len(everything) / 3) < 1 for part in parts)


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_bad_shards_are_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)
