"""Attention maps of a model's input: as a PNG grid of heatmaps, or as an interactive
HTML explorer (one self-contained file)."""

from .html import write_html
from .maps import attention_maps, capture
from .plot import plot_maps
from .quantize import dequantize_rows, quantize_rows
from .recording import Recording, record
from .sources import Source, chat_source, gpt_source, minilm_source, whisper_source

__all__ = [
    "Recording",
    "Source",
    "attention_maps",
    "capture",
    "chat_source",
    "dequantize_rows",
    "gpt_source",
    "minilm_source",
    "plot_maps",
    "quantize_rows",
    "record",
    "whisper_source",
    "write_html",
]
