"""Attention maps of a model's input: as a PNG grid of heatmaps, or as an interactive
HTML explorer (one self-contained file)."""

from .maps import attention_maps, capture
from .plot import plot_maps

__all__ = ["attention_maps", "capture", "plot_maps"]
