"""What several commands share: loading a checkpoint, the training options."""

from __future__ import annotations

import argparse


def load_model(path: str, kind: str, model_cls, config_cls) -> tuple:
    """(model in eval mode, checkpoint state) of a `mhsa train <kind>` checkpoint."""
    from ..train import load_checkpoint

    state = load_checkpoint(path)
    if state["info"].get("model") != kind:
        raise ValueError(
            f"{state['path']} holds a {state['info'].get('model')!r} model, not {kind}"
        )
    model = model_cls(config_cls(**state["info"]["config"]))
    model.load_state_dict(state["weights"])
    return model.eval(), state


def common_train_options(
    parser: argparse.ArgumentParser, steps: int, out: str, eval_every: int = 100
) -> None:
    parser.add_argument("--out", default=out, help=f"checkpoint folder (default {out})")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--stop-after", type=int, help="stop after N steps (checkpointed)")
    parser.add_argument("--eval-every", type=int, default=eval_every)
    parser.add_argument("--seed", type=int, default=0)


def size_options(
    parser: argparse.ArgumentParser, *, batch_size: int, layers: int, heads: int, d_model: int,
    lr: float,
) -> None:  # fmt: skip
    """The model-size and optimisation options every `mhsa train` command has."""
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--lr", type=float, default=lr)
