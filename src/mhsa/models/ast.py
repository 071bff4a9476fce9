"""Audio Spectrogram Transformer: a log-mel spectrogram as a sequence of patches.

spectrogram (B, mels, frames) -> overlapping 2-D patches (a strided convolution)
  -> prepend [CLS], add learned positions -> pre-norm encoder -> head on [CLS]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import EncoderClassifierConfig
from .vit import vit_blocks


@dataclass
class ASTConfig(EncoderClassifierConfig):
    n_mels: int = 64
    frames: int = 101
    patch: int = 16
    stride: int = 10  # < patch: patches overlap, as in AST
    d_model: int = 96

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stride < 1:
            raise ValueError(f"stride must be at least 1, got {self.stride}")
        if not 1 <= self.patch <= min(self.n_mels, self.frames):
            raise ValueError(
                f"patch ({self.patch}) must be between 1 and n_mels ({self.n_mels}) and "
                f"frames ({self.frames}): a patch must fit in the spectrogram"
            )

    def grid(self) -> tuple[int, int]:
        return (
            (self.n_mels - self.patch) // self.stride + 1,
            (self.frames - self.patch) // self.stride + 1,
        )


class AST(nn.Module):
    def __init__(self, config: ASTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.patch_embed = nn.Conv2d(1, d, config.patch, config.stride)
        rows, cols = config.grid()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_emb = nn.Parameter(torch.randn(1, 1 + rows * cols, d) * 0.02)
        self.blocks = vit_blocks(config)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.num_classes)

    def forward(self, spectrogram: Tensor) -> Tensor:
        """spectrogram (B, n_mels, frames), normalised log-mel -> logits (B, classes)."""
        expected = (self.config.n_mels, self.config.frames)
        if spectrogram.dim() != 3 or tuple(spectrogram.shape[1:]) != expected:
            raise ValueError(
                f"spectrogram must be (batch, {expected[0]}, {expected[1]}), "
                f"got {tuple(spectrogram.shape)}"
            )
        x = self.patch_embed(spectrogram.unsqueeze(1)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))

    def loss(self, spectrogram: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self(spectrogram), labels)
