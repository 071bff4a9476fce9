"""`mhsa classify CHECKPOINT FILE...`: labels and probabilities from a trained ViT (images),
AST (WAV files) or point-cloud transformer (.npy or x y z text files)."""

from __future__ import annotations

import argparse
import sys

from .common import add_option, load_model, positive_int, threads_option, with_threads
from .device import device_options, placement


def _model_and_reader(path: str):
    """(model in eval mode, checkpoint state, file -> the model's input batch of one)."""
    from ..data.classify import load_image
    from ..data.shapes import read_points
    from ..data.speech import clip_features
    from ..models.ast import AST, ASTConfig
    from ..models.points import PointCloudConfig, PointCloudTransformer
    from ..models.vit import ViT, ViTConfig

    model, state = load_model(
        path,
        {
            "vit": (ViT, ViTConfig),
            "ast": (AST, ASTConfig),
            "points": (PointCloudTransformer, PointCloudConfig),
        },
    )
    kind = state["info"]["model"]
    config = model.config

    def read(file):
        if kind == "vit":
            return (load_image(file, config.image_size, config.channels)[None],)
        if kind == "points":
            return (read_points(file)[None],)
        features = clip_features(file, config.n_mels)
        if features.shape[1] != config.frames:
            raise ValueError(f"{file}: {features.shape[1]} frames, the model takes {config.frames}")
        return (features[None],)

    return model, state, read


@with_threads
def classify(args: argparse.Namespace) -> int:
    """Print each file's most likely labels; a bad file is reported and the others go on."""
    import torch

    device, dtype = placement(args)
    model, state, read = _model_and_reader(args.checkpoint)
    model.to(device=device, dtype=dtype)
    classes = state["info"].get("classes") or [
        f"class {i}" for i in range(model.config.num_classes)
    ]
    failed = 0
    for path in args.files:
        try:
            inputs = read(path)
        except (FileNotFoundError, ValueError) as error:
            print(f"mhsa classify: {error}", file=sys.stderr)
            failed += 1
            continue
        inputs = [x.to(device, dtype if x.is_floating_point() else None) for x in inputs]
        with torch.no_grad():
            probs = torch.softmax(model(*inputs)[0].float().cpu(), dim=-1)
        values, indices = probs.topk(min(args.top, len(probs)))
        pairs = zip(values.tolist(), indices.tolist(), strict=True)
        ranked = ", ".join(f"{classes[i]} {p:.3f}" for p, i in pairs)
        print(f"{path}: {classes[indices[0]]} ({ranked})")
    if failed:
        print(f"mhsa classify: {failed} of {len(args.files)} files failed", file=sys.stderr)
    return 2 if failed else 0


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "classify", help="labels from a ViT, AST or point-cloud checkpoint"
    )
    parser.add_argument("checkpoint", help="output folder of `mhsa train vit|ast|points`")
    parser.add_argument(
        "files",
        nargs="+",
        help="images (vit), WAV files (ast), or .npy / x y z text point files (points)",
    )
    add_option(parser, "--top", 3, "how many labels to show per file", type=positive_int)
    device_options(parser)
    threads_option(parser)
    parser.set_defaults(run=classify)
