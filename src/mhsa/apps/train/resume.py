"""What a resumed training run checks first: the checkpoint holds a resumable run of the
same model, continued with the same model config and seed."""

from __future__ import annotations

import json


def check_resumable(state: dict, want: str | None) -> None:
    """Raise unless the checkpoint (load_checkpoint's state) holds a `want` model and its
    trainer state."""
    kind = state["info"].get("model")
    if kind != want:
        raise ValueError(
            f"{state['path']} holds a {kind!r} model, not {want!r}: --resume continues a run "
            "of the same model; choose another --out for a new one"
        )
    if state["trainer"] is None:
        raise ValueError(
            f"{state['path']} has no trainer.pt (optimizer and random states), so it cannot "
            "be resumed; start a new run with another --out"
        )


def check_same_run(state: dict, model_info: dict, config, log) -> None:
    """A resumed run continues the checkpoint's model and data: a model config that
    differs (the same weights would run as another model, or fail to load) or another
    seed (it draws the data split: test examples would be trained on) is refused; a
    changed schedule (steps, lr) is said."""
    saved = state["info"].get("config") or {}
    now = json.loads(json.dumps(model_info.get("config") or {}))  # (tuples as saved: lists)
    changed = [key for key in now if key in saved and saved[key] != now[key]]
    differ = [f"{key} {now[key]!r} (checkpoint: {saved[key]!r})" for key in changed]
    if differ:
        raise ValueError(
            f"{state['path']} holds another model than this run's: {', '.join(differ)}; "
            "--resume continues the checkpoint's model: give its sizes"
        )
    before = state["trainer"].get("train_config") or {}
    if before.get("seed", config.seed) != config.seed:
        raise ValueError(
            f"seed {config.seed}, but the checkpoint's run used seed {before['seed']}, which "
            "drew its batches (and for some tasks the validation split): resume with that seed"
        )
    for key in ("steps", "lr"):
        if before.get(key, getattr(config, key)) != getattr(config, key):
            log(f"resuming with {key} {getattr(config, key)} (the checkpoint's run: {before[key]})")
