"""A bounded cache of what a backend builds per attention pattern and call shape
(FlexAttention BlockMasks, Triton tile lists), so a model that calls the same
pattern in every layer and step builds it once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class PatternCache:
    """Values keyed by (pattern's cache_key, extra key parts); the oldest is dropped
    beyond `size`. Each entry keeps its pattern alive, so an id() inside a key (patterns
    holding tensors) is never reused while the entry exists."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[object, object]] = {}

    def get(self, pattern, extra: tuple, build: Callable[[], T]) -> T:
        key = (None if pattern is None else pattern.cache_key(), *extra)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
            entry = self._entries[key] = (pattern, build())
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
