"""The option helpers the commands share (mhsa.cli.common)."""

from __future__ import annotations

import argparse
import io

import pytest
import torch

from mhsa.cli import build_parser
from mhsa.cli.common import (
    add_option,
    compile_option,
    positive_int,
    progress_bar,
    spare_core_threads,
    usable_cores,
    with_threads,
)


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


def test_spare_core_threads_leaves_a_core_free_between_1_and_8():
    assert [spare_core_threads(cores) for cores in (1, 2, 3, 4, 9, 64)] == [1, 1, 2, 3, 8, 8]
    assert spare_core_threads() == spare_core_threads(usable_cores())


def _leaves(parser: argparse.ArgumentParser, path: str = "mhsa"):
    """(command path, parser) of every command that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, f"{path} {name}")


# bench chat and ring start their own processes, each with its own thread count
NO_THREADS = {"mhsa info"}  # computes nothing


def test_every_compute_command_has_threads_and_says_its_default():
    """Issue 35: `mhsa train` had no --threads; chat and train took every core."""
    leaves = dict(_leaves(build_parser()))
    assert len(leaves) >= 24 and set(leaves) >= NO_THREADS
    for path, parser in leaves.items():
        threads = [a for a in parser._actions if "--threads" in a.option_strings]
        if path in NO_THREADS:
            assert not threads, path
            continue
        assert threads, f"{path} has no --threads"
        assert "default" in threads[0].help, path
    spare = spare_core_threads()
    for path in ("mhsa chat", *(p for p in leaves if p.startswith("mhsa train "))):
        (threads,) = [a for a in leaves[path]._actions if "--threads" in a.option_strings]
        assert threads.default == spare, path
        help_text = leaves[path].format_help()
        assert f"(default {spare} here: one fewer than the {usable_cores()} usable" in " ".join(
            help_text.split()
        ), path


def test_train_runs_with_its_threads_and_restores_them(tmp_path):
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1
    seen = []
    args = [
        "train",
        "gpt",
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "1",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--threads",
        str(wanted),
    ]
    parsed = build_parser().parse_args(args)
    train = parsed.train

    def record(namespace):
        seen.append(torch.get_num_threads())
        return train(namespace)

    parsed.train = record
    assert parsed.run(parsed) == 0
    assert seen == [wanted] and torch.get_num_threads() == before


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_in_place_on_a_terminal_and_stays_silent_elsewhere():
    screen = Terminal()
    show = progress_bar("reading weights", screen)
    for done in range(1, 4):
        show(done, 3)
    assert screen.getvalue() == (
        "\rreading weights [" + "#" * 8 + "-" * 16 + "] 1/3"
        "\rreading weights [" + "#" * 16 + "-" * 8 + "] 2/3"
        "\rreading weights [" + "#" * 24 + "] 3/3\n"
    )
    assert progress_bar("reading weights", io.StringIO()) is None  # a pipe or a log


def test_speculate_options_make_the_speculator():
    from mhsa.cli.common import speculate_options, speculator
    from mhsa.models.gpt import GPT, GPTConfig
    from mhsa.models.speculative import DraftModel, PromptLookup

    parser = argparse.ArgumentParser()
    speculate_options(parser, "a checkpoint")
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=32, max_len=16, d_model=16, n_head=2, n_layer=1))
    small = GPT(GPTConfig(vocab_size=32, max_len=16, d_model=8, n_head=2, n_layer=1))
    other = GPT(GPTConfig(vocab_size=40, max_len=16, d_model=8, n_head=2, n_layer=1))
    args = parser.parse_args([])
    assert args.draft_tokens == 4 and speculator(args, target, None) is None
    args = parser.parse_args(["--speculate", "prompt-lookup", "--draft-tokens", "2"])
    assert isinstance(speculator(args, target, None), PromptLookup) and args.draft_tokens == 2
    args = parser.parse_args(["--speculate", "draft:small"])
    made = speculator(args, target, {"small": small, "other": other}.get)
    assert isinstance(made, DraftModel) and made.model is small
    args = parser.parse_args(["--speculate", "draft:other"])
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        speculator(args, target, {"small": small, "other": other}.get)
    for bad in ("draft:", "lookup"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculate", bad])


def test_translate_length_penalty_is_a_finite_number_in_range(capsys):
    """-inf raised ZeroDivisionError, 1e308 OverflowError, nan printed nothing."""
    from mhsa.cli import main

    for bad, said in (
        ("-inf", "a finite number"),
        ("nan", "a finite number"),
        ("1e308", "-10..10"),
    ):
        with pytest.raises(SystemExit) as caught:
            main(["translate", "runs/none", "one", f"--length-penalty={bad}"])
        assert caught.value.code == 2 and said in capsys.readouterr().err
