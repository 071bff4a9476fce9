"""mhsa: multi-head self-attention and its whole family, on PyTorch.

The package's layers, top to bottom: cli, benchmarks -> apps (chat, embed, transcribe,
export, train, serve, viz) -> models -> nn, cache -> distributed -> core (attention,
patterns, scores, engines) -> formats, data and small support modules.
"""

from . import distributed, nn  # distributed registers the ring backend
from .cache import DecoderCache, KVCache, MemoryCache, PagedKVCache
from .core import masks, scores
from .core.attention import attention, attention_weights
from .core.backends import names as backends
from .core.backends import use_backend
from .core.cluster import cluster_attention
from .nn import positional
from .version import __version__

__all__ = [
    "__version__",
    "DecoderCache",
    "KVCache",
    "MemoryCache",
    "PagedKVCache",
    "attention",
    "attention_weights",
    "cluster_attention",
    "backends",
    "distributed",
    "masks",
    "nn",
    "positional",
    "scores",
    "use_backend",
]
