"""Attention backends; `auto` picks the usable one with the highest preference."""

from .flash import FlashBackend
from .reference import ReferenceBackend
from .registry import AttentionSpec, Backend, get, names, register, select, use_backend
from .sdpa import SdpaBackend

register(SdpaBackend())
register(FlashBackend())
register(ReferenceBackend())

__all__ = ["AttentionSpec", "Backend", "get", "names", "register", "select", "use_backend"]
