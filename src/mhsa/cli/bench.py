"""`mhsa bench SUITE`: the benchmarks, as ratios against peers measured in the same run.

Each suite is a sub-command with only its own options, so that another suite's option
is an error (argparse's, exit 2) rather than silently ignored. The suites that time
tensors or models in this process take --device and --dtype (mhsa.cli.device), and serve
hands them to the servers it starts; ring and transcribe measure processes on the CPU."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from .checks import flag_errors
from .common import QUANTIZE, add_option, positive_int, threads_option, with_threads
from .device import device_options, placement

if TYPE_CHECKING:
    from ..benchmarks.placement import Placement

CPU_ONLY = ("ring", "transcribe")  # suites without --device: CPU processes


def _same_names(args: argparse.Namespace, *names: str) -> dict:
    """The flags a suite's run() takes under the same names: {name: args.name}."""
    return {name: getattr(args, name) for name in names}


def _placed(args: argparse.Namespace, training: bool = False) -> Placement:
    """run()'s `on` of --device and --dtype, resolved before any work (a device or dtype
    that cannot be had: one line, exit 2)."""
    from ..benchmarks.placement import Placement

    return Placement(*placement(args, training=training))


def _show(args: argparse.Namespace, result, text: str) -> int:
    """Print the suite's table, or its result as JSON with --json."""
    import json

    print(json.dumps(result, indent=2, default=str) if args.json else text)
    return 0


@with_threads
def bench_attention(args: argparse.Namespace) -> int:
    """time of each backend against SDPA; peak memory of forward+backward"""
    from ..benchmarks import attention

    result = attention.run(
        length=args.length or (512 if args.quick else 4096),
        heads=args.heads,
        head_dim=args.head_dim,
        repeat=args.repeat or (1 if args.quick else 5),
        memory=not (args.no_memory or args.quick),
        long=args.long,
        on=_placed(args),
    )
    return _show(args, result, attention.report(result))


@with_threads
def bench_sparse(args: argparse.Namespace) -> int:
    """sliding windows, BigBird, dilated windows against SDPA's dense mask and FlexAttention"""
    from ..benchmarks import sparse

    result = sparse.run(repeat=args.repeat, quick=args.quick, on=_placed(args))
    text = sparse.report(result)
    if args.plot:
        sparse.plot(result, args.plot)
        text += f"\nplot written to {args.plot}"
    return _show(args, result, text)


@with_threads
def bench_generate(args: argparse.Namespace) -> int:
    """tokens/s of a GPT with a KV cache against transformers and CTranslate2"""
    from ..benchmarks import generate

    result = generate.run(repeat=args.repeat, quick=args.quick, on=_placed(args))
    return _show(args, result, generate.report(result))


@with_threads
def bench_scores(args: argparse.Namespace) -> int:
    """ALiBi and softcapping against no score function and FlexAttention"""
    from ..benchmarks import scores

    length = args.length or (1024 if args.quick else 4096)
    result = scores.run(
        length=length, repeat=args.repeat, memory=not args.no_memory, on=_placed(args)
    )
    return _show(args, result, scores.report(result))


@with_threads
def bench_moba(args: argparse.Namespace) -> int:
    """MoBA's block choice on the flash engine against dense causal attention"""
    from ..benchmarks import moba

    names = ("length", "block_size", "top_k", "heads", "repeat", "quick")
    with flag_errors({name: "--" + name.replace("_", "-") for name in names[:4]}):
        result = moba.run(**_same_names(args, *names), memory=not args.no_memory, on=_placed(args))
    return _show(args, result, moba.report(result))


@with_threads
def bench_hf(args: argparse.Namespace) -> int:
    """transformers models with attn_implementation="mhsa" against their sdpa and eager"""
    from ..benchmarks import hf

    result = hf.run(quick=args.quick, repeat=args.repeat, on=_placed(args))
    return _show(args, result, hf.report(result))


@with_threads
def bench_flex(args: argparse.Namespace) -> int:
    """mhsa.flex.flex_attention against torch's flex_attention, eager and compiled"""
    from ..benchmarks import flex

    result = flex.run(
        length=args.length,
        heads=args.heads,
        repeat=args.repeat,
        quick=args.quick,
        on=_placed(args),
    )
    return _show(args, result, flex.report(result))


def bench_ring(args: argparse.Namespace) -> int:
    """ring attention's memory per process and time against one process"""
    from ..benchmarks import ring

    result = ring.run(nproc=args.nproc, repeat=args.repeat, quick=args.quick, threads=args.threads)
    return _show(args, result, ring.report(result))


def bench_transcribe(args: argparse.Namespace) -> int:
    """Whisper tiny.en against CTranslate2"""
    from ..benchmarks import transcribe

    try:
        result = transcribe.run(
            args.file, repeat=args.repeat, threads=args.threads, quick=args.quick
        )
    except RuntimeError as error:  # ctranslate2 or the weights missing
        raise SystemExit(str(error)) from error
    return _show(args, result, transcribe.report(result))


@with_threads
def bench_chat(args: argparse.Namespace) -> int:
    """SmolLM2 prefill and decode against transformers and the weight-streaming bound"""
    from ..benchmarks import chat

    result = chat.run(
        prompt=128 if args.quick else 512,
        new=16 if args.quick else 128,
        repeat=1 if args.quick else args.repeat,
        threads=args.threads,
        on=_placed(args),
    )
    return _show(args, result, chat.report(result))


def bench_serve(args: argparse.Namespace) -> int:
    """the server under 16 (--clients) concurrent clients against one at a time; prompt
    lookup at batch 1"""
    from ..benchmarks import serve

    placement(args)  # a device or dtype that cannot be had: one line, before any server
    placed = {name: value for name, value in _same_names(args, "device", "dtype").items() if value}
    try:
        chosen = _same_names(
            args,
            *("model", "quick", "threads", "quantize", "load", "draft_tokens"),
            *("clients", "serial_requests", "throughput_only"),
        )
        # placed: the servers' own flags (mhsa serve --device --dtype)
        with flag_errors({"clients": "--clients", "serial_requests": "--serial-requests"}):
            result = serve.run(**chosen, **placed)
    except RuntimeError as error:  # the server did not start
        raise SystemExit(str(error)) from error
    return _show(args, result, serve.report(result))


@with_threads
def bench_varlen(args: argparse.Namespace) -> int:
    """a GPT training step on packed sequences against a padded batch; packed memory"""
    from ..benchmarks import varlen

    on = _placed(args, training=True)  # a training step: --dtype is autocast's
    result = varlen.run(repeat=args.repeat, quick=args.quick, on=on)
    return _show(args, result, varlen.report(result))


def _suite(
    suites, name: str, run: Callable, repeat: int | None, quick: str
) -> argparse.ArgumentParser:
    """A suite's sub-parser with the options every suite has: --json, --quick (quick says
    what it does) and, unless repeat is None, --repeat (best of N)."""
    what = run.__doc__
    parser = suites.add_parser(name, help=what, description=f"mhsa bench {name}: {what}.")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true", help=f"a small smoke run: {quick}")
    if repeat is not None:
        add_option(parser, "--repeat", repeat, "report the best of N runs", type=positive_int)
    if name not in CPU_ONLY:
        device_options(parser, what="the timed tensors and models", training=name == "varlen")
    parser.set_defaults(run=run)
    return parser


def _in_process_threads(parser: argparse.ArgumentParser) -> None:
    threads_option(
        parser,
        help="torch threads of the timings run in this process (default: torch's own, "
        "one per core; the memory cases' fresh processes keep theirs)",
    )


# each suite: its name, its runner (whose docstring says what it measures), --repeat's
# default (None: the suite adds its own) and what --quick does
SUITES = (
    ("attention", bench_attention, None, "L=S=512, best of 1, no memory cases (seconds)"),
    ("sparse", bench_sparse, 5, "every case at small sizes"),
    ("generate", bench_generate, 5, "short sequences, one run"),
    ("scores", bench_scores, 3, "L=S=1024"),
    ("moba", bench_moba, 1, "L=S=1024, blocks of 128, 2 heads"),
    ("hf", bench_hf, 2, "prefill L=128 and 512, 8 new tokens, the window case at L=2048"),
    ("flex", bench_flex, None, "L=S=256, one run"),
    ("ring", bench_ring, 2, "L=2048, one run"),
    ("transcribe", bench_transcribe, 5, "a short sentence, one run"),
    ("chat", bench_chat, 2, "128 prompt tokens, 16 new, one run"),
    ("serve", bench_serve, None, "a few short requests (instead of --load)"),
    ("varlen", bench_varlen, 3, "1024 tokens of lengths 4..256, memory at 4 x 128"),
)


def add_parser(commands) -> None:
    bench_parser = commands.add_parser(
        "bench",
        help="benchmarks: ratios against peers",
        description="Benchmarks, as ratios against peers measured in the same run. "
        "`mhsa bench SUITE --help` lists a suite's options.",
    )
    suites = bench_parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    parsers = {row[0]: _suite(suites, *row) for row in SUITES}

    attention = parsers["attention"]
    attention.add_argument(
        "--length", type=positive_int, help="L = S for timings (default 4096; 512 with --quick)"
    )
    attention.add_argument(
        "--repeat", type=positive_int, help="report the best of N runs (default 5; 1 with --quick)"
    )
    add_option(attention, "--heads", 8, "query heads", type=positive_int)
    add_option(attention, "--head-dim", 64, "D per head", type=positive_int)
    attention.add_argument("--no-memory", action="store_true", help="skip the memory cases")
    attention.add_argument(
        "--long",
        action="store_true",
        help="add the L=S=16384 memory cases (the reference needs ~12 GiB) and "
        "causal L=S=65536 (minutes)",
    )
    _in_process_threads(attention)

    sparse = parsers["sparse"]
    sparse.add_argument("--plot", metavar="FILE", help="write a PNG plot")
    _in_process_threads(sparse)

    generate = parsers["generate"]
    _in_process_threads(generate)

    scores = parsers["scores"]
    scores.add_argument(
        "--length", type=positive_int, help="L = S for timings (default 4096; 1024 with --quick)"
    )
    scores.add_argument("--no-memory", action="store_true", help="skip the memory cases")
    _in_process_threads(scores)

    moba = parsers["moba"]
    for flag, full, small, what in (
        ("--length", 32768, 1024, "L = S"),
        ("--block-size", 4096, 128, "positions per block"),
        ("--heads", 4, 2, "query heads"),
    ):  # an explicit value wins over --quick's
        moba.add_argument(
            flag, type=positive_int, help=f"{what} (default {full}; {small} with --quick)"
        )
    add_option(moba, "--top-k", 3, "earlier blocks each query block attends", type=positive_int)
    moba.add_argument("--no-memory", action="store_true", help="skip the memory cases")
    _in_process_threads(moba)

    _in_process_threads(parsers["hf"])
    flex = parsers["flex"]
    flex.add_argument("--length", type=positive_int, help="L = S (default 2048; 256 with --quick)")
    flex.add_argument(
        "--repeat", type=positive_int, help="report the best of N runs (default 3; 1 with --quick)"
    )
    add_option(flex, "--heads", 8, "query heads", type=positive_int)
    _in_process_threads(flex)

    ring = parsers["ring"]
    add_option(ring, "--nproc", 2, "processes", type=positive_int)
    threads_option(
        ring,
        help="cores the benchmark may use (default: all usable): the one-process baseline "
        "gets them all, each ring process an equal share",
    )

    transcribe = parsers["transcribe"]
    transcribe.add_argument("--file", help="a WAV file (default: espeak-ng speech)")
    threads_option(
        transcribe,
        help="threads of each engine's process (default: torch's own, one per core)",
    )

    chat = parsers["chat"]
    threads_option(
        chat,
        help="torch threads of every measured process and of the bound "
        "(default: torch's own, one per core)",
    )

    _in_process_threads(parsers["varlen"])

    serve = parsers["serve"]
    serve.add_argument(
        "--model", help="the model `mhsa serve` loads (default the packaged SmolLM2)"
    )
    threads_option(serve, help="torch threads of the server (default: the server's own)")
    serve.add_argument(
        "--load",
        default="chat",
        choices=["chat", "long-prompts"],
        help="chat (short prompts, longer answers; default) or long-prompts",
    )
    serve.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help="the server's --quantize (default: the file's own weights)",
    )
    serve.add_argument(
        "--draft-tokens",
        type=positive_int,
        default=4,
        help="--draft-tokens of the server with --speculate prompt-lookup (default 4)",
    )
    serve.add_argument(
        "--clients",
        type=int,
        help="concurrent clients, the server's --max-batch (default 16; the requests "
        "grow to 2 per client)",
    )
    serve.add_argument(
        "--serial-requests",
        type=int,
        help="how many of the requests the one-at-a-time run sends (default all)",
    )
    serve.add_argument(
        "--throughput-only",
        action="store_true",
        help="time the two loads only: no speculative decoding, no head of line",
    )
