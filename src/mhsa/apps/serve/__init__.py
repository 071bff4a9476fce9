"""Serving: continuous batching over a paged KV cache (engine.py) behind an
OpenAI-compatible HTTP server (`mhsa serve`)."""

from .engine import Engine, Request

__all__ = ["Engine", "Request"]
