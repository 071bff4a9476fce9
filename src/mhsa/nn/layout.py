"""A decoding layout for float linear layers: each weight stored transposed, (in, out).

Decoding one sequence multiplies a single row by every weight matrix, which streams
the weights from memory. For one row, torch's CPU x @ W^T with W (out, in) takes a
matrix-vector path that reads the weights at about 2/3 of the rate of x @ W_t with
W_t (in, out) contiguous (SmolLM2's 540 MB of float32 weights, 2 threads on an AMD
EPYC: 36.4 ms against 27.8 ms per pass in `mhsa bench chat`). With several rows
(batch decoding, a prefill) the two layouts measured within about 15% of each other,
either way round, so this is a choice for decoding, made after loading:

    transpose_linears(model)          every float32 nn.Linear -> TransposedLinear, in place
    TransposedEmbedding.from_embedding(e)   a tied embedding whose output head
                                            (x @ e.weight.T) then reads the fast layout
    fuse_linears([q, k, v])           one layer for several that share their input
                                      (fewer, larger matmuls: per-call overhead counts
                                      when a step is ~200 small matrix-vector products)

Both keep `weight` as an (out, in) view of the transposed storage, so code that reads
`module.weight` sees the same numbers; no weight is copied twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantized import Int4Linear, Int8Linear, replace_linears


class TransposedLinear(nn.Module):
    """y = x @ W_t + b with W_t (in, out) contiguous: nn.Linear's function, the
    transposed storage. `weight` is the (out, in) view."""

    def __init__(self, weight_t: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.weight_t = nn.Parameter(weight_t.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransposedLinear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach().T.contiguous(), bias)

    @property
    def weight(self) -> Tensor:
        return self.weight_t.T

    @property
    def input_dtype(self) -> torch.dtype:
        return self.weight_t.dtype

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out)."""
        out = torch.matmul(x, self.weight_t)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


class TransposedEmbedding(nn.Module):
    """An embedding table stored transposed, (dim, num), for a model whose output head
    is the embedding (tied): lookups gather its columns, and `weight` is the (num, dim)
    view, so x @ weight.T multiplies by the contiguous (dim, num) storage."""

    def __init__(self, weight_t: Tensor) -> None:
        super().__init__()
        self.embedding_dim, self.num_embeddings = weight_t.shape
        self.weight_t = nn.Parameter(weight_t.contiguous(), requires_grad=False)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> TransposedEmbedding:
        return cls(embedding.weight.detach().T.contiguous())

    @property
    def weight(self) -> Tensor:
        return self.weight_t.T

    def forward(self, idx: Tensor) -> Tensor:
        """idx (...) token ids -> (..., dim)."""
        return F.embedding(idx, self.weight)


def decoding_layout(
    model: nn.Module, embedding: str | None, part: nn.Module | None = None
) -> nn.Module:
    """Every float32 nn.Linear of `part` (default: all of model) transposed, and model's
    tied embedding (the attribute named `embedding`, whose weight is the output head;
    None when the head is a layer of its own) too, in place; returns model.
    fuse_linears takes either layout."""
    transpose_linears(model if part is None else part)
    if embedding is None:
        return model
    table = getattr(model, embedding)
    if isinstance(table, nn.Embedding) and table.weight.dtype == torch.float32:
        setattr(model, embedding, TransposedEmbedding.from_embedding(table))
    return model


def transpose_linears(model: nn.Module) -> nn.Module:
    """Replace every float32 nn.Linear of model by a TransposedLinear, in place; returns
    model. For inference: the weights stop requiring gradients. (bfloat16 one-row
    matmuls read the usual layout faster: 16 ms against 338 ms for SmolLM2's weights.)"""

    def transposed(_: str, linear: nn.Linear) -> nn.Module | None:
        if linear.weight.dtype != torch.float32:
            return None
        return TransposedLinear.from_linear(linear)

    return replace_linears(model, transposed)


def fuse_linears(layers: Sequence[nn.Module]) -> nn.Module:
    """One layer whose output is the outputs of `layers` (all of one kind: nn.Linear,
    TransposedLinear, Int4Linear or Int8Linear, with one input width) side by side;
    split it with .split([l.out_features for l in layers], dim=-1). Missing biases
    are zeros."""
    kinds = {type(layer) for layer in layers}
    widths = {layer.in_features for layer in layers}
    if len(kinds) != 1 or len(widths) != 1:
        names = sorted(k.__name__ for k in kinds)
        raise ValueError(
            f"fuse_linears needs layers of one kind and one input width, got "
            f"{names} with inputs {sorted(widths)}"
        )
    kind = kinds.pop()
    bias = None
    if any(layer.bias is not None for layer in layers):
        some = next(layer.bias for layer in layers if layer.bias is not None)
        bias = torch.cat(
            [
                some.new_zeros(layer.out_features) if layer.bias is None else layer.bias.detach()
                for layer in layers
            ]
        )

    def cat(name: str, dim: int = 0) -> Tensor:
        return torch.cat([getattr(layer, name).detach() for layer in layers], dim=dim)

    if kind is nn.Linear:
        weight = cat("weight")
        fused = nn.Linear(
            weight.shape[1],
            weight.shape[0],
            bias=bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            fused.weight.copy_(weight)
            if bias is not None:
                fused.bias.copy_(bias)
        return fused
    if kind is TransposedLinear:
        return TransposedLinear(cat("weight_t", dim=1), bias)
    if kind is Int4Linear:
        return Int4Linear(cat("q"), cat("scale"), cat("zero"), bias, dtype=layers[0].input_dtype)
    if kind is Int8Linear:
        return Int8Linear(cat("q"), cat("scale"), bias, dtype=layers[0].input_dtype)
    raise TypeError(f"fuse_linears cannot fuse {kind.__name__} layers")


__all__ = [
    "TransposedEmbedding",
    "TransposedLinear",
    "decoding_layout",
    "fuse_linears",
    "transpose_linears",
]
