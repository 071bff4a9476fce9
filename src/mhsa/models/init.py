"""Weight initialisation shared by the models."""

from __future__ import annotations

from torch import nn


def normal_init(module: nn.Module, std: float = 0.02) -> None:
    """GPT/BERT initialisation: normal(0, std) linear and embedding weights, zero biases.
    Use as model.apply(normal_init)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
