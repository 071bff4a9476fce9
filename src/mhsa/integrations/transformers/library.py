"""The installed transformers, checked once for what the integration needs: its
AttentionInterface, its AttentionMaskInterface, and mask functions that take the query
offset (transformers 5; tested with 5.24)."""

from __future__ import annotations

import inspect
from types import ModuleType

FIX = "install a transformers with both interfaces: pip install -U 'transformers>=5'"


def missing() -> str | None:
    """Why transformers cannot run attn_implementation="mhsa" here, or None if it can."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    version = getattr(transformers, "__version__", "?")
    for name in ("AttentionInterface", "AttentionMaskInterface"):
        if not hasattr(transformers, name):
            return f"transformers {version} has no {name}; {FIX}"
    from transformers import masking_utils

    wanted = {"batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function"}
    given = set(inspect.signature(masking_utils.sdpa_mask).parameters)
    if not wanted <= given:
        return (
            f"transformers {version} builds masks with other arguments "
            f"({', '.join(sorted(wanted - given))} missing from its sdpa_mask); {FIX}"
        )
    return None


def masking_utils() -> ModuleType:
    """transformers.masking_utils, or ImportError saying why it cannot serve."""
    problem = missing()
    if problem is not None:
        raise ImportError(f"mhsa.integrations.transformers: {problem}")
    from transformers import masking_utils

    return masking_utils
