"""Permutation-invariant attention on point clouds.

    points (B, N, 3) -> centred, turned into the cloud's principal axes (PCA), scaled
      to unit RMS radius -> per-point MLP on coordinates and radius (no positional
      encoding)
      -> n_layer pre-norm self-attention blocks (padding masked)   equivariant
      -> pooling: attention from a learned seed query, or masked mean / max  invariant
      -> linear head -> logits (B, classes)

Attention without positions treats the points as a set: permuting the input permutes
the per-point features and leaves the pooled output unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import MultiHeadAttention
from .config import EncoderClassifierConfig
from .vit import vit_blocks

POOLINGS = ("attention", "mean", "max")


@dataclass
class PointCloudConfig(EncoderClassifierConfig):
    ff_ratio = 2

    num_classes: int = 6
    d_model: int = 96
    n_layer: int = 3
    dropout: float = 0.0
    pooling: str = "attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")


class PointCloudTransformer(nn.Module):
    def __init__(self, config: PointCloudConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = nn.Sequential(nn.Linear(4, d), nn.GELU(), nn.Linear(d, d))
        self.blocks = vit_blocks(config)
        self.norm = nn.LayerNorm(d)
        self.seed = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pool_attn = MultiHeadAttention(d, config.n_head)
        self.head = nn.Linear(d, config.num_classes)

    def encode(self, points: Tensor, mask: Tensor | None = None) -> Tensor:
        """points (B, N, 3), mask (B, N) True = a real point -> features (B, N, d)."""
        if points.dim() != 3 or points.shape[-1] != 3:
            raise ValueError(f"points must be (batch, N, 3), got {tuple(points.shape)}")
        points = _canonical_pose(points, mask)  # invariant to shift, rotation and scale
        # coordinates and distance from the origin (rotation-invariant), per point
        x = self.embed(torch.cat([points, points.norm(dim=-1, keepdim=True)], dim=-1))
        for block in self.blocks:
            x = block(x, key_padding_mask=mask)
        return self.norm(x)

    def pool(self, features: Tensor, mask: Tensor | None) -> Tensor:
        """(B, N, d) -> (B, d), invariant to the order of the points."""
        kind = self.config.pooling
        if kind == "attention":
            seed = self.seed.expand(features.shape[0], -1, -1)
            return self.pool_attn(seed, features, key_padding_mask=mask)[:, 0]
        weights = (
            torch.ones(features.shape[:2], device=features.device)
            if mask is None
            else mask.to(features.dtype)
        )
        if kind == "mean":
            return (features * weights.unsqueeze(-1)).sum(1) / weights.sum(1, keepdim=True)
        return features.masked_fill(weights.unsqueeze(-1) == 0, -torch.inf).amax(dim=1)

    def forward(self, points: Tensor, mask: Tensor | None = None) -> Tensor:
        """points (B, N, 3), mask (B, N) -> logits (B, classes)."""
        return self.head(self.pool(self.encode(points, mask), mask))

    def loss(self, points: Tensor, mask: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self(points, mask), labels)


def _canonical_pose(points: Tensor, mask: Tensor | None) -> Tensor:
    """(B, N, 3) -> the same clouds centred, in the frame of their principal axes
    (largest variance first; each axis signed so the third moment is >= 0) and scaled
    to unit root-mean-square radius. Padding (mask False) is ignored and set to 0.

    Statistics are float64: eigenvectors of a nearly degenerate covariance (a cube,
    a sphere) swing with rounding, and must not depend on the order of the points."""
    weights = (
        torch.ones(points.shape[:2], dtype=torch.float64, device=points.device)
        if mask is None
        else mask.to(torch.float64)
    )
    weights = (weights / weights.sum(-1, keepdim=True).clamp(min=1)).unsqueeze(-1)  # (B, N, 1)
    x = points.to(torch.float64)
    x = (x - (x * weights).sum(1, keepdim=True)) * (weights > 0)
    covariance = (x * weights).transpose(1, 2) @ x  # (B, 3, 3)
    variance, axes = torch.linalg.eigh(covariance)  # ascending
    x = x @ axes.flip(-1)
    skew = (x.pow(3) * weights).sum(1, keepdim=True)
    x = x * torch.where(skew < 0, -1.0, 1.0)
    radius = variance.sum(-1).sqrt().clamp(min=1e-6).view(-1, 1, 1)
    return (x / radius).to(points.dtype)
