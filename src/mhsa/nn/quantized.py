"""Weight-only quantised linear layers on PyTorch's own CPU kernels: 4-bit weights in
groups of 32 (torch's packed int4 format, run by `_weight_int4pack_mm_for_cpu`) and
8-bit weights with one scale per output channel (`_weight_int8pack_mm`). Only the weights
are compressed, so a decoding step streams 4 or 8 bits per weight from memory instead
of 32. torch's CPU kernels are vectorised for bfloat16 activations only (float32 ones
run 10-12x slower, measured on an AVX2 EPYC), so activations go through them in
bfloat16, whatever the number of rows. Every row's result is then independent of
the other rows of the call: a prompt token gives the same numbers prefilled alone,
in a long prompt, after a cached prefix or as a verified draft (a float matmul of
the dequantised weight would not: BLAS rounds differently by row count). On a 2-core
AVX2 machine the kernel was also no slower than the float path at 128 rows.

    Int4Linear.from_blocks(q, scale, zero)   a GGUF Q4_0 / Q4_1 weight as it is
    Int4Linear.from_float(weight)            min/max 4-bit groups of 32 (like Q4_1)
    Int8Linear.from_float(weight)            symmetric int8 per output channel
    quantize_linears(model, "int8" | "int4") replaces the nn.Linear layers in place
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUP = 32


class Int4Linear(nn.Module):
    """y = x @ W^T + b with W (N, K) stored as 4-bit q in groups of 32 along K:
    W = scale * (q - 8) + zero, one (scale, zero) per group."""

    def __init__(
        self,
        q: Tensor,
        scale: Tensor,
        zero: Tensor,
        bias: Tensor | None = None,
        *,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        _hold_input_dtype(self, dtype)
        # the kernel takes a multiple of 16 rows: extra rows of weight 0 (q 8, scale and
        # zero 0), their outputs dropped in forward
        extra = -self.out_features % 16
        padded = torch.cat([q, q.new_full((extra, q.shape[1]), 8)]) if extra else q
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded.to(torch.int32), 1)
        scales_and_zeros = F.pad(torch.stack([scale, zero], dim=-1), (0, 0, 0, 0, 0, extra))
        scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)  # the kernel's format
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        # the same weights, one byte each, for the float path
        self.register_buffer("q", q.to(torch.uint8))
        self.register_buffer("scale", scale.float())
        self.register_buffer("zero", zero.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_blocks(
        cls,
        q: Tensor,
        scale: Tensor,
        zero: Tensor,
        bias: Tensor | None = None,
        *,
        dtype: torch.dtype = torch.float32,
    ):
        """q (N, K) integers 0..15, scale and zero (N, K/32); dtype: the activations'."""
        rows, cols = q.shape
        if cols % GROUP or q.min() < 0 or q.max() > 15:
            raise ValueError(
                f"Int4Linear needs (N, K) values in 0..15 with K a multiple of "
                f"{GROUP}, got {tuple(q.shape)} in {int(q.min())}..{int(q.max())}"
            )
        if scale.shape != (rows, cols // GROUP) or zero.shape != scale.shape:
            raise ValueError(
                f"scale and zero must be (N, K/{GROUP}) = {(rows, cols // GROUP)}, "
                f"got {tuple(scale.shape)} and {tuple(zero.shape)}"
            )
        return cls(q, scale, zero, bias, dtype=dtype)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int4Linear:
        """Each group of 32 mapped onto 16 levels between its min and max; the layer
        takes activations in weight's dtype."""
        rows, cols = weight.shape
        if cols % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {cols}")
        groups = weight.detach().float().view(rows, -1, GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        q = q.view(rows, cols).int()
        return cls.from_blocks(q, scale, low + 8 * scale, bias, dtype=weight.dtype)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.input_like.dtype

    def weight_float(self) -> Tensor:
        """The (N, K) float32 weights."""
        groups = self.q.float().view(self.out_features, -1, GROUP).sub_(8)
        groups = groups.mul_(self.scale.unsqueeze(-1)).add_(self.zero.unsqueeze(-1))
        return groups.view(self.out_features, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(torch.bfloat16).contiguous(),
            self.packed,
            GROUP,
            self.scales_and_zeros.to(torch.bfloat16),  # (a no-op unless module.to() cast it)
        ).to(x.dtype)
        out = out[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int8Linear(nn.Module):
    """y = x @ W^T + b with W (N, K) = scale[n] * q[n, k], q int8."""

    def __init__(
        self,
        q: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        _hold_input_dtype(self, dtype)
        self.register_buffer("q", q)
        # the kernel reads a multiple of 16 columns: zero columns (and zero inputs) past
        # K, added per call where K needs them (rare: small layers)
        self.extra_columns = -self.in_features % 16
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # the kernel's
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """Symmetric int8 per output channel; the layer takes activations in weight's
        dtype."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale, bias, dtype=weight.dtype)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.input_like.dtype

    def weight_float(self) -> Tensor:
        """The (N, K) float32 weights."""
        return self.q.float() * self.scale.float().unsqueeze(1)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        q = self.q
        if self.extra_columns:
            flat, q = F.pad(flat, (0, self.extra_columns)), F.pad(q, (0, self.extra_columns))
        out = torch.ops.aten._weight_int8pack_mm(
            flat.contiguous(), q, self.scale_bf16.to(torch.bfloat16)
        ).to(x.dtype)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def _hold_input_dtype(layer: nn.Module, dtype: torch.dtype) -> None:
    """The activations' dtype as an empty buffer, so that it follows layer.to(dtype) as
    the float weight it replaces would (the weights themselves stay as they are)."""
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating point dtype, got {dtype}")
    layer.register_buffer("input_like", torch.empty(0, dtype=dtype), persistent=False)


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None]):
    """Replace every nn.Linear of model by make(its name, it) where that is not None,
    in place; returns model."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                replacement = make(f"{name}.{child_name}" if name else child_name, child)
                if replacement is not None:
                    setattr(module, child_name, replacement)
    return model


def quantize_linears(model: nn.Module, mode: str, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every nn.Linear of model (but those whose name is in skip, and those
    marked read_whole: a layer whose weight a step reads whole, as latent attention's
    kv_b_proj) by an Int8Linear or Int4Linear made from its weight, in place; returns
    model."""
    if mode not in ("int8", "int4"):
        raise ValueError(f"mode must be 'int8' or 'int4', got {mode!r}")
    make = Int8Linear.from_float if mode == "int8" else Int4Linear.from_float

    def quantized(name: str, linear: nn.Linear) -> nn.Module | None:
        bias = None if linear.bias is None else linear.bias.detach()
        if name in skip or getattr(linear, "read_whole", False):
            return None
        return make(linear.weight, bias)

    return replace_linears(model, quantized)


def dense_weight(layer: nn.Module) -> Tensor:
    """The (out, in) weight of a linear layer: nn.Linear's, a transposed layout's, or a
    quantised one's dequantised to its activations' dtype."""
    if isinstance(layer, Int4Linear | Int8Linear):
        return layer.weight_float().to(layer.input_dtype)
    return layer.weight
