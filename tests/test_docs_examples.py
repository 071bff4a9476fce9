"""Every code block of README.md and docs/ is checked, so no example can rot.

- ```python blocks run (Sybil parses them): a page's blocks in order, in one namespace,
  as a reader would paste them, in a fresh working directory. A block that needs what
  this interpreter cannot have follows `<!-- skip: next "runs with NAME: TEST FILE" -->`,
  and that test file runs it (timm: tests/integrations/test_timm.py).
- ```bash blocks are shell commands, not run here (they install, train or start
  servers): every `mhsa ...` command in them must parse with the command's own parser.
- ```text blocks are what a command printed; nothing to run.
A block with any other language, or none, fails the suite.
"""

from __future__ import annotations

import re
import shlex
import unittest
from pathlib import Path

import pytest
import torch
from sybil.document import Document
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

from helpers import SKIP
from mhsa.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
LANGUAGES = {"python", "bash", "text"}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced_blocks(page: Path) -> list[tuple[int, str, list[str]]]:
    """(line of the opening fence, language, lines) of each fenced block of a page."""
    blocks, open_block = [], None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if open_block is None and match:
            open_block = (number, match.group(1), [])
        elif open_block is not None and line.rstrip() == "```":
            blocks.append(open_block)
            open_block = None
        elif open_block is not None:
            open_block[2].append(line)
    assert open_block is None, f"{page_id(page)}:{open_block[0]}: a code block never closes"
    return blocks


def python_examples(page: Path) -> list:
    """The page's python blocks and skip directives, in order, as Sybil runs them."""
    return list(Document.parse(str(page), PythonCodeBlockParser(), SkipParser()))


PYTHON_PAGES = [page for page in PAGES if any(b[1] == "python" for b in fenced_blocks(page))]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=page_id)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    examples = python_examples(page)
    assert examples, f"{page_id(page)} has python blocks but Sybil found none"
    try:
        for example in examples:
            try:
                example.evaluate()
            except unittest.SkipTest as skip:  # a block that another test runs
                runner = re.fullmatch(r"runs with \w+: (tests/\S+\.py)", str(skip))
                assert runner and (ROOT / runner.group(1)).exists(), (
                    f"skip without a runner: {skip}"
                )
            except Exception as error:
                where = f"{page_id(page)}:{example.line}"
                raise AssertionError(f"{where}: the example fails: {error!r}") from error
    finally:
        torch._dynamo.reset()  # what a page traced stays out of later tests


def test_sybil_runs_every_python_block():
    """The parser Sybil runs sees each ```python block the pages have (the count is the
    suite's number of executed examples)."""
    fenced = sum(lang == "python" for page in PAGES for _, lang, _ in fenced_blocks(page))
    skips = sum(len(SKIP.findall(page.read_text())) for page in PAGES)
    parsed = sum(len(python_examples(page)) for page in PAGES)
    assert parsed == fenced + skips and fenced >= 10, (parsed, fenced, skips)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_says_what_it_is(page):
    for line, language, _ in fenced_blocks(page):
        assert language in LANGUAGES, (
            f"{page_id(page)}:{line}: a code block marked {language!r}; mark it python "
            f"(it runs as a test), bash (its mhsa commands are parsed) or text (output)"
        )


def mhsa_commands(lines: list[str]) -> list[list[str]]:
    """The argument lists of the `mhsa` commands in a shell block (continued lines
    joined; commands split at &&, ||, ; and |; a `$ ` prompt and a .venv/bin/ dropped)."""
    text = "\n".join(line.removeprefix("$ ") for line in lines).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part, comments=True)
            if words and words[0].removeprefix(".venv/bin/") == "mhsa":
                commands.append(words[1:])
    return commands


BASH_COMMANDS = [
    pytest.param(argv, id=f"{page_id(page)}:{line}:{' '.join(argv[:2])}")
    for page in PAGES
    for line, language, lines in fenced_blocks(page)
    if language == "bash"
    for argv in mhsa_commands(lines)
]


@pytest.mark.parametrize("argv", BASH_COMMANDS)
def test_shell_blocks_mhsa_commands_parse(argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as error:
        raise AssertionError(f"`mhsa {' '.join(argv)}` does not parse") from error


def test_shell_blocks_have_mhsa_commands():
    assert len(BASH_COMMANDS) >= 10
