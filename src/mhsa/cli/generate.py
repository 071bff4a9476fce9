"""`mhsa generate CHECKPOINT`: sample text from a GPT checkpoint."""

from __future__ import annotations

import argparse
import sys

from .checks import SAMPLING_FLAGS, check_draft, flag_errors
from .common import (
    add_option,
    compile_option,
    load_model,
    non_negative_int,
    seed_int,
    speculate_options,
    speculator,
    threads_option,
    with_threads,
)
from .device import device_options, placement


@with_threads
def generate(args: argparse.Namespace) -> int:
    """Sample a continuation from a trained checkpoint, with the KV cache."""
    import time

    import torch

    from ..data.text import ByteTokenizer
    from ..models import GPT, GPTConfig
    from ..models.sampling import Sampling

    checkpoint = _checkpoint(args)
    check_draft(args)
    with flag_errors(SAMPLING_FLAGS):  # every flag is checked before the model loads
        Sampling(args.temperature, args.top_k or None, args.top_p)
    device, dtype = placement(args)
    tokenizer = ByteTokenizer()
    try:
        prompt = tokenizer.encode(args.prompt)
    except UnicodeEncodeError:
        raise ValueError("--prompt is not valid text (undecodable bytes); pass UTF-8") from None
    if prompt.numel() == 0:
        raise ValueError("--prompt must not be empty")

    def load_gpt(path: str):
        return load_model(path, {"gpt": (GPT, GPTConfig)})[0].to(device=device, dtype=dtype)

    model = load_gpt(checkpoint)
    room = model.config.max_len - prompt.numel()
    if args.max_new_tokens > room:
        if model.config.position in ("learned", "sinusoidal") and room < 0:
            raise ValueError(
                f"--prompt is {prompt.numel()} tokens, more than max_len "
                f"{model.config.max_len} of this model's positions: shorten it"
            )
        if model.config.position in ("learned", "sinusoidal"):
            raise ValueError(
                f"--max-new-tokens at most {room} for this prompt (max_len {model.config.max_len})"
            )
        print(
            f"mhsa generate: warning: the model was trained on {model.config.max_len} "
            f"tokens; past that ({model.config.position} positions) its text degrades",
            file=sys.stderr,
        )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(
        [prompt],
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        generator=generator,
        compile=args.compile,
        speculate=speculator(args, model, load_gpt),
        draft_tokens=args.draft_tokens,
    )[0]
    seconds = time.perf_counter() - start
    if args.compile:
        from ..models.decoding import compile_seconds

        print(
            f"[compiled the decoding step in {compile_seconds(model) or 0:.1f} s "
            "(torch.compile; inductor keeps the compiled code on disk), included below]",
            file=sys.stderr,
        )
    print(tokenizer.decode(out))
    new = out.numel() - prompt.numel()
    print(f"[{new} tokens in {seconds:.2f} s: {new / seconds:.1f} tokens/s]", file=sys.stderr)
    return 0


def _checkpoint(args: argparse.Namespace) -> str:
    """The checkpoint, given as the first argument or as --checkpoint / --out (train's
    name for the folder it writes)."""
    given = {path for path in (args.checkpoint, args.checkpoint_option) if path is not None}
    if len(given) > 1:
        raise ValueError(
            f"two checkpoints: {args.checkpoint} (the first argument) and "
            f"{args.checkpoint_option} (--checkpoint or --out): pass one"
        )
    if not given:
        raise ValueError(
            "pass the checkpoint: the folder `mhsa train gpt --out` wrote, e.g. "
            "mhsa generate runs/gpt"
        )
    return given.pop()


def add_parser(commands) -> None:
    gen = commands.add_parser("generate", help="sample text from a GPT checkpoint")
    gen.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="output folder of `mhsa train gpt` (its --out), or a step folder",
    )
    gen.add_argument(
        "--checkpoint",
        "--out",
        dest="checkpoint_option",
        metavar="CHECKPOINT",
        default=None,
        help="the checkpoint as an option, named as train's --out (default: the first argument)",
    )
    gen.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    add_option(gen, "--max-new-tokens", 100, "tokens to add", type=non_negative_int)
    add_option(gen, "--temperature", 0.8, "sampling temperature, 0 for greedy", type=float)
    add_option(
        gen, "--top-k", 40, "sample among the k likeliest tokens, 0 for all", type=non_negative_int
    )
    gen.add_argument(
        "--top-p",
        type=float,
        help="sample among the likeliest tokens whose probability reaches p, "
        "in (0, 1] (default: no limit)",
    )
    add_option(gen, "--seed", 0, "random seed", type=seed_int)
    compile_option(gen, "decode through one torch.compile'd step (compiling takes a while)")
    device_options(gen)
    speculate_options(gen, "another `mhsa train gpt` checkpoint")
    threads_option(
        gen,
        default=1,
        help="torch threads (default 1: one token at a time of a "
        "small model gains little from more, and loses much when cores are busy)",
    )
    gen.set_defaults(run=generate)
