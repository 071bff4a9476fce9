"""`mhsa info`: versions, the device, and what each attention backend can serve."""

from __future__ import annotations

import argparse
import importlib
import platform

from ..version import __version__
from .device import defaults_here

# Typical calls (float32, GQA 8/2) that show what each backend can and cannot serve.
_PROBES = {
    "causal": {"causal": True},
    "pattern": {"has_mask": True},
    "mask+bias": {"has_mask": True, "has_bias": True},
    "dropout": {"dropout_p": 0.1},
    "pattern+dropout": {"has_mask": True, "dropout_p": 0.1},
    "return_lse": {"return_lse": True},
    "paged": {"paged": True, "causal": True},  # keys in a PagedKVCache's blocks
    "paged+grad": {"paged": True, "causal": True, "needs_grad": True},
}

# mhsa inside other libraries: module of mhsa.integrations -> how it is used
INTEGRATIONS = {
    "transformers": 'register(), then attn_implementation="mhsa"',
    "timm": "convert(model): timm's Attention layers on mhsa.attention",
    "flex": "mhsa.flex: FlexAttention's flex_attention and create_block_mask, CPU backward",
}


def info(_: argparse.Namespace) -> int:
    """Print versions, the device, and each backend's status."""
    import torch

    from .. import distributed  # noqa: F401  (registers the ring backend)
    from ..core.backends import AttentionSpec, get, names, select

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
        limits = {
            probe: backend.supports(AttentionSpec.example(device=device, **changes))
            for probe, changes in {"plain": {}, **_PROBES}.items()
        }
        if len(set(limits.values())) == 1 and limits["plain"] is not None:
            print(f"  {name:<10} not used here: {limits['plain']}")  # one reason for every call
            continue
        print(f"  {name:<10} usable")
        for probe, limit in limits.items():
            if limit is not None:
                print(f"  {'':<10} not for {probe}: {limit}")
    print(f"auto picks on {device.type} (B=1, H=8, H_kv=2, L=S=1024, D=64, float32):")
    for probe, changes in {"plain": {}, **_PROBES}.items():
        chosen = select(AttentionSpec.example(device=device, **changes), "auto").name
        print(f"  {probe:<16} {chosen}")
    if device.type != "cuda":
        print("preference table on CUDA (what auto would pick there; bf16):")
        for probe, changes in {"plain": {}, **_PROBES}.items():
            spec = AttentionSpec.example(
                device=torch.device("cuda"), dtype=torch.bfloat16, **changes
            )
            ranked = sorted(
                (get(n).preference(spec), n) for n in names() if get(n).supports(spec) is None
            )
            print(f"  {probe:<16} " + " > ".join(f"{n} ({p:g})" for p, n in ranked[::-1]))
    print("commands (defaults here; --device cpu|cuda and --dtype change them):")
    for line in defaults_here():
        print(f"  {line}")
    print("integrations (mhsa.integrations):")
    for name, use in INTEGRATIONS.items():
        usable, why = importlib.import_module(f"mhsa.integrations.{name}").available()
        print(f"  {name:<12} {'usable: ' + use if usable else 'unusable here: ' + why}")
    return 0


def add_parser(commands) -> None:
    description = (
        "Show the versions of mhsa, Python and torch, the device, and for each attention "
        "backend whether it runs here and which calls it cannot serve (with the reason), "
        "then which backend `auto` picks for typical calls, and which integrations "
        "(transformers, timm, FlexAttention's API) can be used here, and which device "
        "and dtype each command computes on by default."
    )
    parser = commands.add_parser(
        "info", help="versions, device and attention backends", description=description
    )
    parser.set_defaults(run=info)
