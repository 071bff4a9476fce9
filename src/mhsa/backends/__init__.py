"""Attention backends; `auto` picks the usable one with the highest preference."""

from .flash import FlashBackend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .registry import AttentionSpec, Backend, get, names, register, select, use_backend
from .ring import RingBackend, context_parallel
from .sdpa import SdpaBackend
from .triton import TritonBackend

register(SdpaBackend())
register(FlashBackend())
register(FlexBackend())  # CUDA only
register(TritonBackend())  # CUDA, or TRITON_INTERPRET=1 (tests)
register(ReferenceBackend())
register(RingBackend())  # serves only inside context_parallel(...)

__all__ = [
    "AttentionSpec",
    "Backend",
    "context_parallel",
    "get",
    "local_names",
    "names",
    "register",
    "select",
    "use_backend",
]


def local_names() -> list[str]:
    """The backends that compute attention in this process (all but `ring`)."""
    return [name for name in names() if name != "ring"]
