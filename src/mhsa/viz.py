"""Attention maps: every layer's and head's probabilities for one input, as heatmaps.

The maps are recomputed on demand (MultiHeadAttention.attention_map, through
mhsa.attention_weights) from each attention layer's inputs; the forward pass itself
stores no weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .nn import MultiHeadAttention


@torch.no_grad()
def attention_maps(model: nn.Module, *inputs, **kwargs) -> list[Tensor]:
    """Run model(*inputs, **kwargs); return each MultiHeadAttention's probabilities
    (B, H, L, S), in the order the layers ran."""
    maps: list[Tensor] = []

    def capture(module, args, kw):
        maps.append(module.attention_map(*args, **kw))

    hooks = [
        m.register_forward_pre_hook(capture, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, MultiHeadAttention)
    ]
    was_training = model.training
    model.eval()
    try:
        model(*inputs, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return maps


def plot_maps(maps: list[Tensor], labels: list[str], path: str, title: str = "") -> None:
    """A grid of heatmaps, one row per layer and one column per head (batch item 0)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("viz needs matplotlib: pip install matplotlib") from error
    layers, heads = len(maps), maps[0].shape[1]
    size = 2.2
    fig, axes = plt.subplots(layers, heads, figsize=(heads * size, layers * size), squeeze=False)
    show_labels = len(labels) <= 24
    for layer, probs in enumerate(maps):
        for head in range(heads):
            ax = axes[layer][head]
            ax.imshow(probs[0, head].float().cpu().numpy(), cmap="viridis", vmin=0.0)
            ax.set_xticks([]), ax.set_yticks([])
            if show_labels and layer == layers - 1:
                ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
            if show_labels and head == 0:
                ax.set_yticks(range(len(labels)), labels, fontsize=6)
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
