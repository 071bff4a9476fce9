"""The base of every model's config dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ModelConfig:
    """A model's hyperparameters (subclasses are dataclasses of them). to_dict() gives
    the JSON-able fields a checkpoint keeps; Config(**that) rebuilds the config."""

    def to_dict(self) -> dict:
        return asdict(self)
