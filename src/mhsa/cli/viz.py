"""`mhsa viz CHECKPOINT --text TEXT`: attention maps of a GPT checkpoint as a PNG."""

from __future__ import annotations

import argparse

from .common import load_model


def viz(args: argparse.Namespace) -> int:
    """Attention maps of a GPT checkpoint for one text, every layer and head, as a PNG."""
    from ..data.text import ByteTokenizer
    from ..models import GPT, GPTConfig
    from ..viz import attention_maps, plot_maps

    model, state = load_model(args.checkpoint, {"gpt": (GPT, GPTConfig)})
    tokens = ByteTokenizer().encode(args.text)
    if not 0 < tokens.numel() <= model.config.max_len:
        raise ValueError(f"--text must be 1..{model.config.max_len} bytes, got {tokens.numel()}")
    maps = attention_maps(model, tokens.view(1, -1))
    labels = [repr(chr(t))[1:-1] if t < 128 else "?" for t in tokens.tolist()]
    plot_maps(maps, labels, args.out, title=f"{state['path']}: {args.text!r}")
    print(f"{len(maps)} layers x {maps[0].shape[1]} heads written to {args.out}")
    return 0


def add_parser(commands) -> None:
    viz_parser = commands.add_parser("viz", help="attention maps of a checkpoint, as a PNG")
    viz_parser.add_argument(
        "checkpoint", help="output folder of `mhsa train gpt`, or a step folder"
    )
    viz_parser.add_argument("--text", required=True, help="the text whose attention is drawn")
    viz_parser.add_argument(
        "--out", default="maps.png", help="the PNG file to write (default maps.png)"
    )
    viz_parser.set_defaults(run=viz)
