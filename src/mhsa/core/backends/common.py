"""Small helpers shared by backends."""

from __future__ import annotations

import torch
from torch import Tensor

from ..masks.causal import causal_mask


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing: a graph cannot branch on a
    tensor's values, so shortcuts that test them step aside."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


# torch.compile keeps at most recompile_limit (8) versions of a compiled function; past
# that it runs it uncompiled (fullgraph=True: raises). Our compiled functions see more:
# flex_attention one per input shape, the decoding step one per model and cache shape.
RECOMPILE_LIMIT = 256


def recompile_limit():
    """A context in which torch.compile keeps up to RECOMPILE_LIMIT versions of a function
    (recompile_limit, cache_size_limit before torch 2.6)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), RECOMPILE_LIMIT)})


def combined_mask(mask, causal: bool, q_len: int, kv_len: int, device: torch.device):
    """The user's mask (a bool tensor or a pattern, materialised) and the causal mask,
    and-ed: a bool tensor broadcastable to (B, H, L, S), or None when there is neither."""
    if mask is not None and not isinstance(mask, Tensor):
        mask = mask.dense(q_len, kv_len, device)
    if not causal:
        return mask
    tri = causal_mask(q_len, kv_len, device)
    return tri if mask is None else mask & tri
