"""mhsa: multi-head self-attention and its whole family, on PyTorch.

The package's layers, top to bottom: cli, benchmarks -> apps (chat, embed, transcribe,
export, train, serve, viz) -> integrations -> models -> nn, cache -> distributed -> core
(attention, patterns, scores, engines) -> formats, data and small support modules.

`import mhsa` imports nothing heavy: the names below load (with torch) on first use, so
that the `mhsa` command can say what it does before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:
    from . import distributed, nn
    from .cache import DecoderCache, KVCache, MemoryCache, PagedKVCache
    from .core import masks, scores
    from .core.attention import attention, attention_weights
    from .core.backends import names as backends
    from .core.backends import use_backend
    from .core.cluster import cluster_attention
    from .core.moba import moba_attention
    from .core.paged import paged_attention
    from .core.paged_step import PagedStep
    from .core.varlen import attention_varlen
    from .nn import positional

# name -> (module, attribute in it; None: the module itself)
_EXPORTS = {
    "DecoderCache": (".cache", "DecoderCache"),
    "KVCache": (".cache", "KVCache"),
    "MemoryCache": (".cache", "MemoryCache"),
    "PagedKVCache": (".cache", "PagedKVCache"),
    "PagedStep": (".core.paged_step", "PagedStep"),
    "attention": (".core.attention", "attention"),
    "attention_weights": (".core.attention", "attention_weights"),
    "attention_varlen": (".core.varlen", "attention_varlen"),
    "cluster_attention": (".core.cluster", "cluster_attention"),
    "moba_attention": (".core.moba", "moba_attention"),
    "paged_attention": (".core.paged", "paged_attention"),
    "backends": (".core.backends", "names"),
    "use_backend": (".core.backends", "use_backend"),
    "distributed": (".distributed", None),
    "masks": (".core.masks", None),
    "nn": (".nn", None),
    "positional": (".nn.positional", None),
    "scores": (".core.scores", None),
}


def __getattr__(name: str):
    """Load a public name on first use (and the ring backend with it, which
    mhsa.distributed registers, so that every backend is known)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mhsa' has no attribute {name!r}")
    importlib.import_module(".distributed", __name__)
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "__version__",
    "DecoderCache",
    "KVCache",
    "MemoryCache",
    "PagedKVCache",
    "PagedStep",
    "attention",
    "attention_weights",
    "attention_varlen",
    "cluster_attention",
    "moba_attention",
    "paged_attention",
    "backends",
    "distributed",
    "masks",
    "nn",
    "positional",
    "scores",
    "use_backend",
]
