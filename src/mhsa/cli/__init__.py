"""The `mhsa` command: one module per command, each adding its parser to `main`'s."""

from __future__ import annotations

import argparse
import sys

from ..version import __version__
from . import (
    bench,
    chat,
    classify,
    embed,
    export,
    generate,
    info,
    serve,
    train,
    transcribe,
    translate,
    viz,
)

COMMANDS = (
    info,
    chat,
    serve,
    train,
    generate,
    translate,
    transcribe,
    embed,
    classify,
    export,
    viz,
    bench,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhsa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mhsa {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as error:  # bad paths and arguments: no traceback
        print(f"mhsa {args.command}: {error}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
