"""Built-in datasets and tokenizers for the CLI tasks (nothing is downloaded), and
`pack`, which packs token sequences into batches without padding (mhsa.data.packing),
and `next_token_targets` for them.

Importing this package loads nothing heavy; `pack` and `PackedBatch` load on first use.
"""

from __future__ import annotations

import importlib

__all__ = ["PackedBatch", "next_token_targets", "pack"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(".packing", __name__), name)
    raise AttributeError(f"module 'mhsa.data' has no attribute {name!r}")
