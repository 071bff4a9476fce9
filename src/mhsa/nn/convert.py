"""Copying torch.nn Transformer modules' weights and options into ours."""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import nn

from .feedforward import FeedForward, Residual


def torch_layer_options(layer: nn.Module) -> dict:
    """Constructor options that reproduce a torch Transformer*Layer."""
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        activation = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        activation = "gelu"
    else:
        raise ValueError(f"only relu and gelu activations can be copied, got {act}")
    return {
        "dim_feedforward": layer.linear1.out_features,
        "dropout": layer.dropout.p,
        "activation": activation,
        "norm_first": layer.norm_first,
        "layer_norm_eps": layer.norm1.eps,
        "bias": layer.linear1.bias is not None,
    }


def copy_feed_forward(ff: FeedForward, layer: nn.Module) -> None:
    ff.linear1.load_state_dict(layer.linear1.state_dict())
    ff.linear2.load_state_dict(layer.linear2.state_dict())


def copy_norms(blocks: tuple[Residual, ...], norms: tuple[nn.LayerNorm, ...]) -> None:
    for block, norm in zip(blocks, norms, strict=True):
        block.norm.load_state_dict(norm.state_dict())


def stack_from(cls, layers: list[nn.Module], norm: nn.Module | None):
    stack = cls(layers[0], 0, copy.deepcopy(norm))
    stack.layers = nn.ModuleList(layers)
    return stack
