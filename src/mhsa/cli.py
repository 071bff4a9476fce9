"""The `mhsa` command."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import __version__
from .backends import AttentionSpec, get, names


def _probe_spec(device: torch.device) -> AttentionSpec:
    """A typical call (float32, causal, GQA) to report which backends can serve."""
    return AttentionSpec(
        batch=1, num_heads=8, num_kv_heads=2, q_len=128, kv_len=128, head_dim=64,
        value_dim=64, dtype=torch.float32, device=device, has_mask=False, has_bias=False,
        causal=True, dropout_p=0.0, return_lse=False,
    )


def info(_: argparse.Namespace) -> int:
    """Print versions, the device, and each backend's status."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"mhsa {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    if device.type == "cuda":
        print(f"device: cuda ({torch.cuda.get_device_name()})")
    else:
        print(f"device: cpu ({torch.get_num_threads()} threads)")
    print("backends (auto preference order):")
    spec = _probe_spec(device)
    for name in names():
        backend = get(name)
        reason = backend.available()
        status = "usable" if reason is None else f"unusable: {reason}"
        limits = backend.supports(spec) if reason is None else None
        print(f"  {name:<10} {status}" + (f" (not for this call: {limits})" if limits else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhsa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mhsa {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, device and attention backends").set_defaults(
        run=info
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
