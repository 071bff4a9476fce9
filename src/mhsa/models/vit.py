"""Vision Transformer: an image as a sequence of patches.

    image (B, C, H, W) -> non-overlapping patches, linearly embedded (B, N, d)
      -> prepend a learned [CLS] token, add learned positions
      -> n_layer pre-norm encoder blocks -> layer norm -> linear head on [CLS]

Position embeddings are interpolated (bicubic over the patch grid) when the image
size differs from the one the model was built for. Images of different sizes go in
one packed row (`packed`): each image's tokens attend only each other, as alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.masks import Segments
from ..nn import encoder_layers
from .config import EncoderClassifierConfig


@dataclass
class ViTConfig(EncoderClassifierConfig):
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be a multiple of "
                f"patch_size ({self.patch_size})"
            )


def vit_blocks(config: EncoderClassifierConfig) -> nn.ModuleList:
    """ViT's encoder blocks: pre-norm self-attention and a GELU feed-forward, each block
    initialised on its own (AST and the point-cloud model use them too)."""
    return encoder_layers(
        config.n_layer,
        config.d_model,
        config.n_head,
        dim_feedforward=config.feed_forward_width(),
        dropout=config.dropout,
        activation="gelu",
        norm_first=True,
    )


class ViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.patch_embed = nn.Conv2d(config.channels, d, config.patch_size, config.patch_size)
        grid = config.image_size // config.patch_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_emb = nn.Parameter(torch.randn(1, 1 + grid * grid, d) * 0.02)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = vit_blocks(config)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.num_classes)

    def positions(self, grid_h: int, grid_w: int) -> Tensor:
        """(1, 1 + grid_h * grid_w, d): the learned positions, resized to this grid."""
        grid = self.config.image_size // self.config.patch_size
        if (grid_h, grid_w) == (grid, grid):
            return self.pos_emb
        cls_pos, patch_pos = self.pos_emb[:, :1], self.pos_emb[:, 1:]
        patch_pos = patch_pos.reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
        patch_pos = F.interpolate(
            patch_pos, size=(grid_h, grid_w), mode="bicubic", align_corners=False
        )
        return torch.cat([cls_pos, patch_pos.flatten(2).transpose(1, 2)], dim=1)

    def embed(self, images: Tensor) -> Tensor:
        """images (B, C, H, W), H and W multiples of patch_size -> tokens (B, 1 + N, d):
        [CLS] and the N patches, with their positions."""
        if images.dim() != 4 or images.shape[1] != self.config.channels:
            raise ValueError(
                f"images must be (batch, {self.config.channels}, H, W), got {tuple(images.shape)}"
            )
        patch = self.config.patch_size
        if images.shape[2] % patch or images.shape[3] % patch:
            # the strided patch convolution would drop the last rows and columns silently
            raise ValueError(
                f"images' height and width must be multiples of patch_size {patch}, got "
                f"{tuple(images.shape[2:])}: resize or pad them"
            )
        patches = self.patch_embed(images)  # (B, d, H/p, W/p)
        grid_h, grid_w = patches.shape[2:]
        x = patches.flatten(2).transpose(1, 2)  # (B, N, d)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.positions(grid_h, grid_w)

    def encode(self, x: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """tokens (B, T, d) -> normed hidden states (B, T, d); with cu_seqlens (N+1,),
        x (1, T, d) packs N images' tokens, each image attending only itself."""
        mask = None if cu_seqlens is None else Segments(cu_seqlens)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.norm(x)

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C, H, W), H and W multiples of patch_size -> logits (B, classes)."""
        return self.head(self.encode(self.embed(images))[:, 0])

    def packed(self, images: Sequence[Tensor]) -> Tensor:
        """Images of different sizes, each (C, H_i, W_i), in one packed row -> logits
        (N, classes), each the logits of its image alone."""
        if not images:
            raise ValueError("images must hold at least one (C, H, W) image")
        tokens = [self.embed(image.unsqueeze(0))[0] for image in images]  # (1 + N_i, d)
        lengths = torch.tensor([0] + [t.shape[0] for t in tokens])
        cu = lengths.cumsum(0).to(torch.int32)
        hidden = self.encode(torch.cat(tokens).unsqueeze(0), cu)[0]
        return self.head(hidden[cu[:-1].long().to(hidden.device)])  # the [CLS] tokens

    def loss(self, images: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self(images), labels)
