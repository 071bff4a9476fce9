"""`mhsa classify CHECKPOINT FILE...`: labels and probabilities from a trained ViT (images),
AST (WAV files) or point-cloud transformer (.npy or x y z text files)."""

from __future__ import annotations

import argparse
import sys

import torch

from .common import positive_int

KINDS = ("vit", "ast", "points")


def _model_and_reader(state: dict):
    """(model in eval mode, file -> the model's input batch of one) for a checkpoint."""
    from ..data.classify import load_image
    from ..data.shapes import read_points
    from ..data.speech import clip_features
    from ..models.ast import AST, ASTConfig
    from ..models.points import PointCloudConfig, PointCloudTransformer
    from ..models.vit import ViT, ViTConfig

    kind, config = state["info"].get("model"), state["info"]["config"]
    if kind == "vit":
        model, config = ViT(ViTConfig(**config)), ViTConfig(**config)

        def read(path):
            return (load_image(path, config.image_size, config.channels)[None],)
    elif kind == "ast":
        model, config = AST(ASTConfig(**config)), ASTConfig(**config)

        def read(path):
            features = clip_features(path, config.n_mels)
            if features.shape[1] != config.frames:
                raise ValueError(f"{path}: {features.shape[1]} frames, the model takes "
                                 f"{config.frames}")  # fmt: skip
            return (features[None],)
    elif kind == "points":
        model = PointCloudTransformer(PointCloudConfig(**config))

        def read(path):
            return (read_points(path)[None],)
    else:
        raise ValueError(
            f"{state['path']} holds a {kind!r} model; classify takes {', '.join(KINDS)} "
            "checkpoints (mhsa train vit|ast|points)"
        )
    model.load_state_dict(state["weights"])
    return model.eval(), read


def classify(args: argparse.Namespace) -> int:
    """Print each file's most likely labels; a bad file is reported and the others go on."""
    from ..train import load_checkpoint

    state = load_checkpoint(args.checkpoint)
    model, read = _model_and_reader(state)
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
        with torch.no_grad():
            probs = torch.softmax(model(*inputs)[0].float(), dim=-1)
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
    parser.add_argument("files", nargs="+",
                        help="images (vit), WAV files (ast), or .npy / x y z text point files "
                             "(points)")  # fmt: skip
    parser.add_argument("--top", type=positive_int, default=3,
                        help="how many labels to show per file (default 3)")  # fmt: skip
    parser.set_defaults(run=classify)
