"""Attention backends; `auto` picks the usable one with the highest preference.

The `ring` backend is mhsa.distributed's: it registers itself there."""

from .flash import FlashBackend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .registry import AttentionSpec, Backend, get, names, register, select, use_backend
from .sdpa import SdpaBackend
from .triton import TritonBackend

register(SdpaBackend())
register(FlashBackend())
register(FlexBackend())  # CUDA only
register(TritonBackend())  # CUDA, or TRITON_INTERPRET=1 (tests)
register(ReferenceBackend())

__all__ = [
    "AttentionSpec",
    "Backend",
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
