"""attn_implementation="mhsa": transformers models on mhsa's engine.

    from mhsa.integrations import transformers as mhsa_hf
    mhsa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mhsa")
    model.set_attn_implementation("mhsa")                # or switch a loaded model
    model(ids, mhsa_pattern=SlidingWindow(512, 0))       # a pattern for one forward
    mhsa_hf.set_pattern(model, bigbird(64), layers=[0])  # or per layer (and generate())

`register()` installs two functions in transformers: `attention_forward` in its
AttentionInterface (the attention call) and `build_mask` in its AttentionMaskInterface,
which lowers the model's masks (causal, sliding window, chunked, padding, packed) to mhsa
patterns without an L x S tensor. Without the second, transformers would pass no mask
at all to an implementation it does not know. Queries are aligned bottom-right, which is
where transformers' caches put them (DynamicCache and its sliding-window layers).
"""

from __future__ import annotations

from . import library
from .attention import attention_forward
from .layers import attention_modules, set_pattern
from .masks import LoweredMask, build_mask

NAME = "mhsa"

__all__ = [
    "NAME",
    "LoweredMask",
    "attention_forward",
    "attention_modules",
    "available",
    "build_mask",
    "register",
    "set_pattern",
]


def available() -> tuple[bool, str]:
    """(whether attn_implementation="mhsa" can be used here, why or why not)."""
    problem = library.missing()
    if problem is not None:
        return False, problem
    import transformers

    return (
        True,
        f'transformers {transformers.__version__}: register(), then attn_implementation="mhsa"',
    )


def register() -> None:
    """Make attn_implementation="mhsa" known to transformers (for every model, from now
    on in this process). Idempotent. ImportError when transformers lacks the interfaces."""
    library.masking_utils()  # raises with the reason
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, build_mask)
