"""Models built on mhsa.nn, one small file per family."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
