"""Every option of every `mhsa` command says what it does and, where it has one, its
default (issue 15 D): walks the real argparse tree, so a new option without help fails."""

from __future__ import annotations

import argparse

from mhsa.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "mhsa"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _undocumented() -> list[str]:
    problems = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            text = action.help or ""
            if not text.strip():
                problems.append(f"{path} {name}: no help")
                continue
            default = action.default
            silent = default in (None, False, argparse.SUPPRESS) or action.choices is not None
            if not silent and str(default) not in text and "%(default)" not in text:
                problems.append(f"{path} {name}: help does not state the default {default!r}")
    return problems


def test_every_option_has_help_and_its_default():
    problems = _undocumented()
    assert not problems, "\n".join(problems)
