"""`mhsa serve` says what is wrong before it loads the model (6 to 43 s for real
weights): a missing starlette or uvicorn, with its one-line install hint, and options
it cannot use (an unreadable --api-key-file). The loader is replaced by a spy that
fails the test if it is called."""

from __future__ import annotations

import sys

import pytest

import mhsa.cli.serve as serve_command
from mhsa.cli import main
from optional import needs


@pytest.fixture
def loader(monkeypatch) -> list:
    """The calls to the model loader (a spy that refuses to load)."""
    calls = []

    def load_served(*args, **kwargs):
        calls.append(args)
        raise ValueError("the model loader was called")

    monkeypatch.setattr(serve_command, "load_served", load_served)
    return calls


@pytest.mark.parametrize("module", ["uvicorn", "starlette"])
def test_a_missing_serve_extra_is_reported_before_the_model_loads(
    monkeypatch, capsys, loader, module
):
    needs("starlette"), needs("uvicorn")
    import mhsa.apps.serve.server  # noqa: F401 - imported already, as after other tests

    monkeypatch.setitem(sys.modules, module, None)  # what an absent package imports as
    assert main(["serve", "--port", "0"]) == 2
    assert loader == []
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("loading ") and len(lines) == 2, lines
    assert lines[1].startswith("mhsa serve needs starlette and uvicorn (")
    assert module in lines[1] and lines[1].endswith("pip install 'mhsa[serve]'")


def test_a_bad_api_key_file_is_reported_before_the_model_loads(tmp_path, capsys, loader):
    missing = tmp_path / "keys.txt"
    assert main(["serve", "--port", "0", "--api-key-file", str(missing)]) == 2
    assert loader == []
    assert f"--api-key-file {missing}" in capsys.readouterr().err
