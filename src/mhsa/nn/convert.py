"""Copying torch.nn Transformer modules' weights and options into ours."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention
from .feedforward import Residual


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


def layer_from_torch(cls: type[nn.Module], layer: nn.Module) -> nn.Module:
    """A new `cls` layer with the options, self-attention and feed-forward weights of a
    torch Transformer*Layer, in its dtype and on its device; the caller copies the rest
    (norms, cross-attention)."""
    ours = cls(layer.self_attn.embed_dim, layer.self_attn.num_heads, **torch_layer_options(layer))
    weight = layer.linear1.weight
    ours = ours.to(device=weight.device, dtype=weight.dtype)
    ours.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
    ours.feed_forward.linear1.load_state_dict(layer.linear1.state_dict())
    ours.feed_forward.linear2.load_state_dict(layer.linear2.state_dict())
    return ours


def copy_norms(blocks: tuple[Residual, ...], norms: tuple[nn.LayerNorm, ...]) -> None:
    for block, norm in zip(blocks, norms, strict=True):
        block.norm.load_state_dict(norm.state_dict())
