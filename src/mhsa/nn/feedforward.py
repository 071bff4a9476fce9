"""The feed-forward sublayers and the residual wrapper every transformer layer uses.

FeedForward: linear2(activation(linear1(x))). GatedFeedForward (GLU variants: GeGLU in
Gemma, SwiGLU in Llama): down(activation(gate(x)) * up(x)).

Post-norm (the original paper, the default): x = norm(x + sublayer(x)).
Pre-norm (norm_first=True): x = x + sublayer(norm(x)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layout import fuse_linears

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "silu": F.silu,
}


class FeedForward(nn.Module):
    """Position-wise feed-forward: linear2(dropout(activation(linear1(x))))."""

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        *,
        dropout: float = 0.0,
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> (..., d_model)."""
        return self.linear2(self.dropout(ACTIVATIONS[self.activation](self.linear1(x))))


class GatedFeedForward(nn.Module):
    """Gated feed-forward (Shazeer's GLU variants): down(activation(gate(x)) * up(x)).

    activation "gelu_tanh" is GeGLU as in Gemma; "silu" is SwiGLU as in Llama.
    """

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        *,
        activation: str = "gelu_tanh",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.gate = nn.Linear(d_model, dim_feedforward, **factory)
        self.up = nn.Linear(d_model, dim_feedforward, **factory)
        self.down = nn.Linear(dim_feedforward, d_model, **factory)
        self.gate_up = None  # see fuse_projections

    def fuse_projections(self) -> bool:
        """For inference: gate and up in one matmul (their weights side by side); the
        module then holds gate_up instead of gate and up. Layers of different kinds stay
        apart; returns whether they fused."""
        if self.gate_up is None and type(self.gate) is type(self.up):
            self.gate_up = fuse_linears([self.gate, self.up])
            self.gate = self.up = None
        return self.gate_up is not None

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> (..., d_model)."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(ACTIVATIONS[self.activation](gate) * up)


class Residual(nn.Module):
    """One sublayer wrapped in dropout, a residual connection and a layer norm (with a
    bias unless bias=False, as in torch.nn.Transformer*Layer)."""

    def __init__(
        self, d_model: int, dropout: float, eps: float, norm_first: bool, bias: bool = True
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


__all__ = ["ACTIVATIONS", "FeedForward", "GatedFeedForward", "Residual"]
