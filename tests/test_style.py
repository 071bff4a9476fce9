"""One formatter and one linter over the whole tree: `ruff format --check` and
`ruff check` pass, and no line opts out of the formatter one at a time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["src", "tests", "tools"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TREES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_passes(command):
    result = ruff(*command)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_line_skips_the_formatter():
    marker = re.compile(r"#\s*fmt:\s*skip")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if marker.search(line)
    ]
    assert not found, "remove the fmt-skip markers here and let ruff format: " + ", ".join(found)
