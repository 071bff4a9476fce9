"""mhsa.data.pack: greedy packing into batches of at most max_tokens, every sequence
exactly once, with offsets, positions and max_seqlen that describe the batch; the
batches feed mhsa.attention_varlen as they are."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import expect_error
from mhsa.core.varlen import cu_seqlens_from_position_ids, positions_from_cu_seqlens
from mhsa.data import PackedBatch, pack


def random_sequences(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (count,), generator=generator).tolist()
    return [torch.randint(0, 1000, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("max_tokens", [60, 97, 256])
def test_every_sequence_once_in_batches_that_fit(max_tokens):
    sequences = random_sequences(200)
    batches = pack(sequences, max_tokens)
    assert all(isinstance(b, PackedBatch) for b in batches)
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(len(sequences)))
    for batch in batches:
        assert batch.num_tokens <= max_tokens
        assert batch.indices == sorted(batch.indices)  # input order within a batch
        cu = batch.cu_seqlens
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == batch.num_tokens
        lengths = cu.diff().tolist()
        assert lengths == [sequences[i].numel() for i in batch.indices]
        assert batch.max_seqlen == max(lengths)
        for i, a, b in zip(batch.indices, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            assert torch.equal(batch.tokens[a:b], sequences[i])
        assert torch.equal(batch.position_ids, positions_from_cu_seqlens(cu))
        assert torch.equal(cu_seqlens_from_position_ids(batch.position_ids), cu)
    # first fit leaves at most one batch half full or less (two would have merged)
    assert sum(2 * b.num_tokens <= max_tokens for b in batches) <= 1


def test_first_fit_longest_first():
    batches = pack([[1] * 3, [2] * 6, [3] * 4, [4] * 2, [5] * 5], max_tokens=10)
    assert [b.indices for b in batches] == [[1, 2], [0, 3, 4]]
    assert batches[0].tokens.tolist() == [2] * 6 + [3] * 4


def test_lists_empty_sequences_and_no_sequences():
    batches = pack([[7, 8, 9], [], [1]], max_tokens=4)
    assert len(batches) == 1
    assert batches[0].cu_seqlens.tolist() == [0, 3, 3, 4]  # the empty one kept
    assert batches[0].position_ids.tolist() == [0, 1, 2, 0]
    assert pack([], max_tokens=4) == []


def test_bad_input():
    assert "sequence 1 has 5 tokens, more than max_tokens=4" in expect_error(
        lambda: pack([[1], [1] * 5], 4)
    )
    assert "max_tokens must be an int >= 1" in expect_error(lambda: pack([[1]], 0))
    assert "sequence 0 must be a 1-D sequence of integer" in expect_error(
        lambda: pack([torch.ones(2, 2, dtype=torch.long)], 8)
    )
    assert "sequence 0 must be a 1-D sequence of integer" in expect_error(
        lambda: pack([[0.5, 1.5]], 8)
    )


def test_a_packed_batch_feeds_attention_varlen():
    batch = pack(random_sequences(20, seed=1), max_tokens=300)[0]
    embed = torch.nn.Embedding(1000, 16, dtype=torch.float64)
    x = embed(batch.tokens).view(-1, 2, 8)  # (total, H, D)
    cu = batch.cu_seqlens
    out = mhsa.attention_varlen(x, x, x, cu, cu, batch.max_seqlen, batch.max_seqlen, causal=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = mhsa.attention(*(x[a:b].transpose(0, 1)[None],) * 3, causal=True)
        torch.testing.assert_close(out[a:b], alone[0].transpose(0, 1))
