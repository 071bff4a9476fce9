"""Attention maps as a PNG: a grid of heatmaps, one per layer and head."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from .files import write_atomically


def plot_maps(
    maps: list[Tensor],
    labels: list[str],
    path: str,
    title: str = "",
    key_labels: list[str] | None = None,
    layer_names: list[str] | None = None,
    overwrite: bool = True,
) -> None:
    """A grid of heatmaps, one row per layer and one column per head (batch item 0),
    written to path (atomically; the format its suffix names, png without one; an
    existing file only with overwrite).

    maps: (B, H, L, S) per layer; labels: the L queries' labels, and of the S keys
    too unless key_labels (cross-attention) is given; layer_names: the row titles
    (default "layer i")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("viz needs matplotlib: pip install matplotlib") from error
    key_labels = labels if key_labels is None else key_labels
    layers, heads = len(maps), maps[0].shape[1]
    size = 2.2
    fig, axes = plt.subplots(layers, heads, figsize=(heads * size, layers * size), squeeze=False)
    show_rows, show_keys = len(labels) <= 24, len(key_labels) <= 24
    for layer, probs in enumerate(maps):
        for head in range(heads):
            ax = axes[layer][head]
            ax.imshow(probs[0, head].float().cpu().numpy(), cmap="viridis", vmin=0.0, aspect="auto")
            ax.set_xticks([]), ax.set_yticks([])
            if show_keys and layer == layers - 1:
                ax.set_xticks(range(len(key_labels)), key_labels, rotation=90, fontsize=6)
            if show_rows and head == 0:
                ax.set_yticks(range(len(labels)), labels, fontsize=6)
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                name = f"layer {layer}" if layer_names is None else layer_names[layer]
                ax.set_ylabel(name, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    kind = Path(path).suffix.lstrip(".").lower() or "png"  # the suffix's format (png: none)
    try:
        save = lambda tmp: fig.savefig(tmp, dpi=100, format=kind)  # noqa: E731
        write_atomically(path, save, overwrite=overwrite)
    finally:
        plt.close(fig)
