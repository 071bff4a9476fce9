"""Positions in packed batches: they restart at each sequence, from cu_seqlens or from
transformers-style position_ids; when both are given they must agree; rotary at
those positions equals rotary on each sequence alone; the known failure modes of
packing (an all-ones 2-D mask, position_ids restarts without cu_seqlens) are an error
or isolated, never a silent leak."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import expect_error, max_error
from mhsa.core.varlen import (
    attention_varlen,
    cu_seqlens_from_position_ids,
    packed_segments,
    positions_from_cu_seqlens,
)
from mhsa.nn.positional import RotaryEmbedding

CU = torch.tensor([0, 3, 3, 4, 8], dtype=torch.int32)  # lengths 3, 0, 1, 4
POSITIONS = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])


def test_positions_restart_at_each_sequence():
    assert torch.equal(positions_from_cu_seqlens(CU), POSITIONS)
    assert torch.equal(positions_from_cu_seqlens(CU.long()), POSITIONS)
    assert positions_from_cu_seqlens(torch.zeros(1, dtype=torch.int32)).shape == (0,)


def test_cu_seqlens_from_position_ids():
    cu = cu_seqlens_from_position_ids(POSITIONS)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 4, 8]  # the empty sequence cannot show in position_ids
    assert cu_seqlens_from_position_ids(POSITIONS.view(1, -1)).tolist() == [0, 3, 4, 8]
    rows = torch.tensor([[0, 1, 2, 0], [0, 1, 0, 1]])  # each row starts a sequence
    assert cu_seqlens_from_position_ids(rows).tolist() == [0, 3, 4, 6, 8]
    with pytest.raises(ValueError, match="got 3 at token 3"):  # no run from row to row
        cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(ValueError, match="got 1 at token 3"):
        cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0], [1, 2, 0]]))
    assert cu_seqlens_from_position_ids(torch.zeros(0, dtype=torch.long)).tolist() == [0]


@pytest.mark.parametrize(
    "position_ids,fragment",
    [
        (torch.tensor([0, 1, 3]), "got 3 at token 2"),
        (torch.tensor([1, 2, 3]), "got 1 at token 0"),
        (torch.tensor([0.0, 1.0]), "position_ids must be an integer tensor"),
        ([0, 1, 2], "position_ids must be an integer tensor"),
    ],
)
def test_bad_position_ids(position_ids, fragment):
    message = expect_error(lambda: cu_seqlens_from_position_ids(position_ids))
    assert message is not None and fragment in message, message


def test_cu_seqlens_and_position_ids_must_agree():
    cu, positions = packed_segments(cu_seqlens=CU)
    assert torch.equal(cu, CU) and torch.equal(positions, POSITIONS)
    cu, positions = packed_segments(position_ids=POSITIONS)
    assert cu.tolist() == [0, 3, 4, 8] and torch.equal(positions, POSITIONS)
    # both, agreeing (the empty sequence of cu_seqlens is no disagreement): cu_seqlens
    cu, _ = packed_segments(cu_seqlens=CU, position_ids=POSITIONS)
    assert torch.equal(cu, CU)
    message = expect_error(
        lambda: packed_segments(cu_seqlens=CU, position_ids=torch.arange(8))  # one sequence
    )
    assert "describe different sequences" in message
    assert "give cu_seqlens or position_ids" in expect_error(lambda: packed_segments())


def test_an_all_ones_mask_with_packing_keeps_the_sequences_apart():
    """transformers' flash path turns packing detection off when a 2-D all-ones mask
    comes with restarting position_ids, and sequences attend across; here the mask
    changes nothing, and a mask with padding inside a pack is refused."""
    ones = torch.ones(1, 8, dtype=torch.long)
    cu, positions = packed_segments(position_ids=POSITIONS.view(1, -1), attention_mask=ones)
    assert cu.tolist() == [0, 3, 4, 8] and torch.equal(positions, POSITIONS)
    padded = ones.clone()
    padded[0, 5] = 0
    message = expect_error(lambda: packed_segments(position_ids=POSITIONS, attention_mask=padded))
    assert "padded tokens inside a packed batch" in message
    message = expect_error(lambda: packed_segments(cu_seqlens=CU, attention_mask=ones[:, :5]))
    assert "attention_mask has 5 entries" in message


def test_position_ids_alone_isolate_the_sequences():
    """Restarting position_ids without cu_seqlens: the sequences they describe attend
    only within themselves (resetting positions alone isolates nothing elsewhere)."""
    q, k, v = (torch.randn(8, 2, 8, dtype=torch.float64) for _ in range(3))
    cu, _ = packed_segments(position_ids=POSITIONS)
    out = attention_varlen(q, k, v, cu, cu, 4, 4, causal=True)
    for s in range(3):
        a, b = int(cu[s]), int(cu[s + 1])
        alone = mhsa.attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        assert max_error(out[a:b], alone[0].transpose(0, 1)) < 1e-12


def test_rotary_at_positions_from_cu_seqlens_equals_each_sequence_alone():
    rotary = RotaryEmbedding(8)
    q, k, v = (torch.randn(8, 2, 8, dtype=torch.float64) for _ in range(3))
    positions = positions_from_cu_seqlens(CU)
    rotated_q = rotary(q.transpose(0, 1), positions=positions).transpose(0, 1)
    rotated_k = rotary(k.transpose(0, 1), positions=positions).transpose(0, 1)
    out = attention_varlen(rotated_q, rotated_k, v, CU, CU, 4, 4, causal=True)
    for s in range(4):
        a, b = int(CU[s]), int(CU[s + 1])
        if a == b:
            continue
        q_s, k_s, v_s = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        alone = mhsa.attention(rotary(q_s), rotary(k_s), v_s, causal=True)  # from 0
        assert max_error(out[a:b], alone[0].transpose(0, 1)) < 1e-12
