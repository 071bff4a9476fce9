"""`mhsa bench SUITE`: the benchmarks, as ratios against peers measured in the same run."""

from __future__ import annotations

import argparse

from .common import add_option, positive_int, threads_option


def bench(args: argparse.Namespace) -> int:
    """Run a benchmark suite; print its table, or JSON with --json."""
    import json

    from ..benchmarks import attention, generate, sparse

    if args.suite == "attention":
        result = attention.run(
            length=args.length,
            heads=args.heads,
            head_dim=args.head_dim,
            repeat=args.repeat,
            memory=not args.no_memory,
            long=args.long,
        )
        text = attention.report(result)
    elif args.suite == "generate":
        result = generate.run(repeat=args.repeat, quick=args.quick)
        text = generate.report(result)
    elif args.suite == "transcribe":
        from ..benchmarks import transcribe as transcribe_bench

        try:
            result = transcribe_bench.run(args.file, repeat=args.repeat, quick=args.quick)
        except RuntimeError as error:  # ctranslate2 or the weights missing
            raise SystemExit(str(error)) from error
        text = transcribe_bench.report(result)
    elif args.suite == "scores":
        from ..benchmarks import scores

        length = 1024 if args.quick else args.length
        result = scores.run(length=length, repeat=min(args.repeat, 3), memory=not args.no_memory)
        text = scores.report(result)
    elif args.suite == "chat":
        from ..benchmarks import chat

        result = chat.run(
            prompt=128 if args.quick else 512,
            new=16 if args.quick else 128,
            repeat=1 if args.quick else min(args.repeat, 2),
        )
        text = chat.report(result)
    elif args.suite == "serve":
        from ..benchmarks import serve

        try:
            result = serve.run(
                model=args.model, quick=args.quick, threads=args.threads, quantize=args.quantize
            )
        except RuntimeError as error:  # the server did not start
            raise SystemExit(str(error)) from error
        text = serve.report(result)
    elif args.suite == "ring":
        from ..benchmarks import ring

        result = ring.run(nproc=args.nproc, repeat=min(args.repeat, 2), quick=args.quick)
        text = ring.report(result)
    else:
        result = sparse.run(repeat=args.repeat, quick=args.quick)
        text = sparse.report(result)
        if args.plot:
            sparse.plot(result, args.plot)
            text += f"\nplot written to {args.plot}"
    print(json.dumps(result, indent=2, default=str) if args.json else text)
    return 0


def add_parser(commands) -> None:
    bench_parser = commands.add_parser("bench", help="benchmarks: ratios against peers")
    bench_parser.add_argument(
        "suite",
        choices=[
            "attention",
            "sparse",
            "generate",
            "ring",
            "transcribe",
            "scores",
            "chat",
            "serve",
        ],
        help="which benchmark",
    )
    bench_parser.add_argument("--file", help="transcribe: a WAV file (default: espeak-ng speech)")
    add_option(bench_parser, "--nproc", 2, "ring: processes", type=positive_int)
    bench_parser.add_argument(
        "--model", help="serve: the model `mhsa serve` loads (default the packaged SmolLM2)"
    )
    threads_option(bench_parser, help="serve: torch threads of the server")
    bench_parser.add_argument(
        "--load",
        default="chat",
        choices=["chat", "long-prompts"],
        help="serve: chat (short prompts, longer answers; default) or long-prompts",
    )
    bench_parser.add_argument(
        "--quantize", help="serve: the server's --quantize (default: the file's own weights)"
    )
    bench_parser.add_argument("--json", action="store_true", help="print JSON")
    add_option(
        bench_parser, "--length", 4096, "attention, scores: L = S for timings", type=positive_int
    )
    add_option(bench_parser, "--heads", 8, "attention: query heads", type=positive_int)
    add_option(bench_parser, "--head-dim", 64, "attention: D per head", type=positive_int)
    add_option(bench_parser, "--repeat", 5, "report the best of N runs", type=positive_int)
    bench_parser.add_argument("--plot", metavar="FILE", help="sparse: write a PNG plot")
    bench_parser.add_argument("--quick", action="store_true", help="small smoke run")
    bench_parser.add_argument("--no-memory", action="store_true", help="skip memory cases")
    bench_parser.add_argument(
        "--long",
        action="store_true",
        help="attention: add the L=S=16384 memory cases (the reference needs ~12 GiB) and "
        "causal L=S=65536 (minutes)",
    )
    bench_parser.set_defaults(run=bench)
