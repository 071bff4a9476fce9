"""FlexAttention's API on mhsa's engine, trainable on CPU with no compile step:

    from mhsa.flex import create_block_mask, flex_attention

with torch.nn.attention.flex_attention's arguments and semantics (q_idx and kv_idx
count from 0 in the query and the key). See mhsa.integrations.flex and docs/flex.md.
"""

from .integrations.flex import available, create_block_mask, flex_attention

__all__ = ["available", "create_block_mask", "flex_attention"]
# torch's own helpers (BlockMask, and_masks, ...) are served too, so that only the import
# line of FlexAttention code changes; imported when first asked for
_FROM_TORCH = {"AuxOutput", "AuxRequest", "BlockMask", "and_masks", "noop_mask", "or_masks"}


def __getattr__(name: str):
    if name in _FROM_TORCH:
        from torch.nn.attention import flex_attention as torch_flex

        return getattr(torch_flex, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
