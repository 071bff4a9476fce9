"""The `mhsa` command."""

from __future__ import annotations

import subprocess
import sys

from mhsa.cli import main


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "device: cpu" in out
    assert "sdpa" in out and "reference" in out and "usable" in out
    assert "logsumexp" in out  # sdpa's limit is explained


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "mhsa.cli", "info"], capture_output=True, text=True, check=True
    )
    assert "backends" in result.stdout
