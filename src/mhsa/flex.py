"""FlexAttention's API on mhsa's engine, trainable on CPU with no compile step:

    from mhsa.flex import create_block_mask, flex_attention

with torch.nn.attention.flex_attention's arguments and semantics (q_idx and kv_idx
count from 0 in the query and the key). See mhsa.integrations.flex and docs/flex.md.
"""

from .integrations.flex import available, create_block_mask, flex_attention

__all__ = ["available", "create_block_mask", "flex_attention"]
