"""Attention backends, registered in `auto` preference order (fastest first)."""

from .reference import ReferenceBackend
from .registry import AttentionSpec, Backend, get, names, register, select, use_backend
from .sdpa import SdpaBackend

register(SdpaBackend())
register(ReferenceBackend())

__all__ = ["AttentionSpec", "Backend", "get", "names", "register", "select", "use_backend"]
