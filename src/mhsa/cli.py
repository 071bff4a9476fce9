"""The `mhsa` command."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import __version__
from .backends import AttentionSpec, get, names, select

# Typical calls (float32, GQA 8/2) that show what each backend can and cannot serve.
_PROBES = {
    "causal": {"causal": True},
    "mask+bias": {"has_mask": True, "has_bias": True},
    "dropout": {"dropout_p": 0.1},
    "return_lse": {"return_lse": True},
}


def _probe_spec(device: torch.device, **changes) -> AttentionSpec:
    fields = dict(
        batch=1,
        num_heads=8,
        num_kv_heads=2,
        q_len=128,
        kv_len=128,
        head_dim=64,
        value_dim=64,
        dtype=torch.float32,
        device=device,
        has_mask=False,
        has_bias=False,
        causal=False,
        dropout_p=0.0,
        return_lse=False,
    )
    fields.update(changes)
    return AttentionSpec(**fields)


def info(_: argparse.Namespace) -> int:
    """Print versions, the device, and each backend's status."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"mhsa {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    if device.type == "cuda":
        print(f"device: cuda ({torch.cuda.get_device_name()})")
    else:
        print(f"device: cpu ({torch.get_num_threads()} threads)")
    print("backends:")
    for name in names():
        backend = get(name)
        reason = backend.available()
        if reason is not None:
            print(f"  {name:<10} unusable here: {reason}")
            continue
        print(f"  {name:<10} usable")
        for probe, changes in _PROBES.items():
            limit = backend.supports(_probe_spec(device, **changes))
            if limit is not None:
                print(f"  {'':<10} not for {probe}: {limit}")
    print("auto picks (B=1, H=8, H_kv=2, L=S=128, D=64, float32):")
    for probe, changes in {"plain": {}, **_PROBES}.items():
        chosen = select(_probe_spec(device, **changes), "auto").name
        print(f"  {probe:<12} {chosen}")
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run a benchmark suite; print its table, or JSON with --json."""
    import json

    from .benchmarks import attention, sparse

    if args.suite == "attention":
        result = attention.run(
            length=args.length, heads=args.heads, head_dim=args.head_dim, repeat=args.repeat,
            memory=not args.no_memory, long=args.long,
        )  # fmt: skip
        text = attention.report(result)
    else:
        result = sparse.run(repeat=args.repeat, quick=args.quick)
        text = sparse.report(result)
        if args.plot:
            sparse.plot(result, args.plot)
            text += f"\nplot written to {args.plot}"
    print(json.dumps(result, indent=2, default=str) if args.json else text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhsa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mhsa {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, device and attention backends").set_defaults(
        run=info
    )
    bench_parser = commands.add_parser("bench", help="benchmarks: ratios against peers")
    bench_parser.add_argument("suite", choices=["attention", "sparse"], help="which benchmark")
    bench_parser.add_argument("--json", action="store_true", help="print JSON")
    bench_parser.add_argument("--length", type=int, default=4096, help="L = S for timings")
    bench_parser.add_argument("--heads", type=int, default=8)
    bench_parser.add_argument("--head-dim", type=int, default=64)
    bench_parser.add_argument("--repeat", type=int, default=5, help="best of N runs")
    bench_parser.add_argument("--plot", metavar="FILE", help="sparse: write a PNG plot")
    bench_parser.add_argument("--quick", action="store_true", help="sparse: small smoke run")
    bench_parser.add_argument("--no-memory", action="store_true", help="skip memory cases")
    bench_parser.add_argument(
        "--long", action="store_true", help="add causal L=S=65536 memory (minutes)"
    )
    bench_parser.set_defaults(run=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
