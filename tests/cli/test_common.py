"""The option helpers the commands share (mhsa.cli.common)."""

from __future__ import annotations

import argparse

import pytest
import torch

from mhsa.cli.common import add_option, compile_option, positive_int, with_threads


def test_add_option_writes_the_default_into_the_help():
    parser = argparse.ArgumentParser()
    add_option(parser, "--steps", 600, "training steps", type=positive_int)
    add_option(parser, "--lr", 2e-3, "peak learning rate", type=float)
    steps, lr = parser._actions[-2:]
    assert (steps.default, steps.help, steps.type) == (
        600,
        "training steps (default 600)",
        positive_int,
    )
    assert lr.help == "peak learning rate (default 0.002)"
    assert parser.parse_args(["--steps", "3"]).steps == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "0"])


def test_compile_option_is_an_off_by_default_flag():
    parser = argparse.ArgumentParser()
    compile_option(parser, "compile the step")
    assert parser.parse_args([]).compile is False
    assert parser.parse_args(["--compile"]).compile is True


def test_with_threads_sets_the_count_while_running_and_restores_it():
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1
    seen = []

    @with_threads
    def run(args: argparse.Namespace) -> int:
        """A command."""
        seen.append(torch.get_num_threads())
        raise ValueError("bad argument")

    with pytest.raises(ValueError, match="bad argument"):
        run(argparse.Namespace(threads=wanted))
    assert seen == [wanted] and torch.get_num_threads() == before
    assert (run.__name__, run.__doc__) == ("run", "A command.")
