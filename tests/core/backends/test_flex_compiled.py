"""The flex backend's BlockMasks under torch.compile: what the GPU runs. Compiled
FlexAttention runs on the CPU too (forward only, without the lse), so these crashes of
`auto` on CUDA (Inductor could not lower the mask_mods of bigbird and packed
sequences) are caught here. And BlockMasks are built in O(blocks): a 131072 x 131072
call builds without a dense mask."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import max_error
from mhsa.core.backends import flex
from mhsa.core.backends.common import recompile_limit
from mhsa.core.masks import KeyPadding, Pattern, Segments, SelectedBlocks, SlidingWindow, bigbird

pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CU_SEQLENS = torch.tensor([0, 70, 71, 200, 300])
CASES = {
    "bigbird": (bigbird(32, seed=2), False, 300, 300),
    "packed sequences (varlen)": (Segments(CU_SEQLENS, causal=True), False, 300, 300),
    "causal window, L != S": (SlidingWindow(40, 0), True, 200, 300),
    "key padding per sequence": (
        KeyPadding(torch.tensor([[True] * 250 + [False] * 50, [True] * 300])),
        True,
        300,
        300,
    ),
    "selected blocks per sequence and head": (
        SelectedBlocks(
            torch.rand(2, 4, 10, 10, generator=torch.Generator().manual_seed(1)) < 0.4, 32
        ),
        False,
        300,
        300,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_flex_lowers_our_block_masks_and_equals_the_reference(case):
    pattern, causal, q_len, kv_len = CASES[case]
    torch.manual_seed(0)
    batch = pattern.batch_size or 1
    q = torch.randn(batch, 4, q_len, 32)
    k, v = torch.randn(2, batch, 2, kv_len, 32).unbind(0)
    block_mask = flex.block_mask_for(pattern, causal, (batch, 4, q_len, kv_len), q.device)
    with torch.no_grad(), recompile_limit():  # compiled on CPU: inference only
        out = flex._compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref = mhsa.attention(q, k, v, pattern, causal=causal, backend="reference")
    assert max_error(out, ref) < 1e-5


def test_block_masks_at_128k_are_built_from_blocks_never_the_grid(monkeypatch):
    """Causal, window and bigbird at L = S = 131072: torch's create_block_mask (which
    evaluates every (query, key) pair) and Pattern.dense are never called."""
    forbid = pytest.fail
    monkeypatch.setattr(Pattern, "dense", lambda *_, **__: forbid("Pattern.dense called"))
    monkeypatch.setattr(
        flex._flex_module(), "create_block_mask", lambda *_, **__: forbid("grid built")
    )
    length, blocks = 131072, 131072 // flex.BLOCK
    cases = ((None, True, blocks * (blocks + 1) // 2), (SlidingWindow(1024, 0), True, 9 * blocks))
    for mask, causal, most in (*cases, (bigbird(64), False, 16 * blocks)):
        block_mask = flex._build_block_mask(mask, causal, (1, 32, length, length), "cpu")
        assert block_mask.kv_indices.shape[-2:] == (blocks, blocks)
        visited = block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()
        assert visited <= most, (mask, visited)  # the empty blocks are not listed
