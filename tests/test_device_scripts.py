"""The prepared device runs (tools/gpu_*.sh) call what exists. Each script runs here with
a stub `python` first on PATH that records its arguments and does nothing; then every
recorded `python -m mhsa...` call must parse under its module's own argument parser,
and every test path a pytest call names must exist. A misspelled option or a renamed
section would otherwise be found only on the GPU, at the cost of a device call."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "tools").glob("gpu_*.sh"))
# one write per call (the scripts start some in the background): arguments ended by
# the unit separator, calls by the record separator
STUB = '#!/bin/sh\ncall=$(printf "%s\\037" "$@")\nprintf "%s\\036" "$call" >> "$CALLS"\n'


class _Parsed(Exception):
    """Raised in place of running a module once its arguments parsed."""


def recorded_calls(script: Path, tmp_path: Path) -> list[list[str]]:
    """The argument lists `python` gets while script runs with the stub."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python").write_text(STUB)
    (stubs / "python").chmod(0o755)
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "CALLS": str(calls),
    }
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [record.split("\037")[:-1] for record in calls.read_text().split("\036") if record]


def parse_only(monkeypatch, module: str, args: list[str]) -> None:
    """Parse args as `python -m module args` would, running nothing; a bad argument
    fails the test with argparse's message."""
    try:
        if module == "mhsa.cli":
            from mhsa.cli import build_parser

            parsed, extras = build_parser().parse_known_args(args)
            assert not extras, f"mhsa {' '.join(args)}: unrecognised {extras}"
            return
        parse = argparse.ArgumentParser.parse_args

        def parse_then_stop(self, argv=None, namespace=None):
            raise _Parsed(parse(self, argv, namespace))

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed):
            importlib.import_module(module).main(args)
    except SystemExit as error:
        pytest.fail(f"python -m {module} {' '.join(args)}: argparse refused it ({error})")
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_call_of_a_prepared_device_run_parses(script, tmp_path, monkeypatch):
    calls = recorded_calls(script, tmp_path)
    assert calls, f"{script.name} called no python"
    for call in calls:
        assert call[0] == "-m", call
        module, args = call[1], call[2:]
        if module == "pytest":
            named = [arg for arg in args if arg.startswith("tests/")]
            assert named and all((ROOT / arg).exists() for arg in named), call
        else:
            assert module.startswith("mhsa."), call
            parse_only(monkeypatch, module, args)


def test_a_misspelled_option_is_caught(tmp_path, monkeypatch):
    """The check itself: a script calling an option gpu_band does not have fails it."""
    script = tmp_path / "gpu_bad.sh"
    script.write_text("python -m mhsa.benchmarks.gpu_band --out $OUT --onyl checks\n")
    (tmp_path / "run").mkdir()
    calls = recorded_calls(script, tmp_path / "run")
    assert calls == [
        [
            "-m",
            "mhsa.benchmarks.gpu_band",
            "--out",
            str(tmp_path / "run" / "out"),
            "--onyl",
            "checks",
        ]
    ]
    with pytest.raises(pytest.fail.Exception, match="argparse refused it"):
        parse_only(monkeypatch, calls[0][1], calls[0][2:])
