"""timm's vision transformers on mhsa (the cases are in timm_cases.py).

timm needs torchvision, whose PyPI wheels do not load beside the CPU build of torch the
project pins. The cases therefore run in an interpreter that has timm: this one when it
can import timm, else MHSA_TIMM_PYTHON (.ci/run makes one, with torch 2.14.1 and
torchvision 0.29.1, and sets it). Where neither exists the test says so and skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import skipped_block
from mhsa.integrations import timm as timm_integration

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("timm_cases.py")


def timm_python() -> str | None:
    has_timm, _ = timm_integration.available()
    return os.environ.get("MHSA_TIMM_PYTHON") or (sys.executable if has_timm else None)


def run_with_timm(*args: str) -> subprocess.CompletedProcess:
    python = timm_python()
    if python is None:
        _, why = timm_integration.available()
        pytest.skip(f"{why}; set MHSA_TIMM_PYTHON to an interpreter that has timm")
    return subprocess.run(
        [python, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


@pytest.mark.slow
def test_timm_cases_pass_where_timm_is():
    ran = run_with_timm("-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES))
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    assert " passed" in ran.stdout and "skipped" not in ran.stdout, ran.stdout[-2000:]


@pytest.mark.slow
def test_the_readme_timm_example_runs_where_timm_is():
    example = skipped_block(ROOT / "README.md", "timm")
    ran = run_with_timm("-c", example)
    assert ran.returncode == 0, ran.stderr[-3000:]


def test_without_timm_the_layer_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(timm_integration, "available", lambda: (False, "no timm here"))
    with pytest.raises(ImportError, match="needs timm: no timm here"):
        timm_integration.convert(object())
