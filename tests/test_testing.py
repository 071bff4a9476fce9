"""mhsa.testing.assert_no_cross_document_leak: it passes for attention_varlen (with
float inputs, token ids, a thousand short documents, dropout under a fixed seed) and
fails for functions that leak, in the forward pass or only in the backward."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import expect_error
from mhsa.testing import assert_no_cross_document_leak

LENGTHS = [5, 1, 0, 40, 17]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def qkv_batch(lengths=LENGTHS, dtype=torch.float32):
    total = sum(lengths)
    return {
        "q": torch.randn(total, 4, 8, dtype=dtype),
        "k": torch.randn(total, 2, 8, dtype=dtype),
        "v": torch.randn(total, 2, 8, dtype=dtype),
        "cu_seqlens": offsets(lengths),
    }


def varlen(batch, **kwargs):
    cu = batch["cu_seqlens"]
    longest = int(cu.diff().max())
    return mhsa.attention_varlen(
        batch["q"], batch["k"], batch["v"], cu, cu, longest, longest, **kwargs
    )


def whole_row(batch):
    """Plain causal attention over the whole packed row: documents see their elders."""
    q, k, v = (batch[n].transpose(0, 1).unsqueeze(0) for n in ("q", "k", "v"))
    return mhsa.attention(q, k, v, causal=True)[0].transpose(0, 1)


@pytest.mark.parametrize("backend", ["flash", "reference", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_does_not_leak(backend, causal):
    assert_no_cross_document_leak(
        lambda b: varlen(b, causal=causal, backend=backend), qkv_batch(), documents=range(5)
    )


def test_plain_attention_over_the_packed_row_leaks():
    with pytest.raises(AssertionError, match="crosses document boundaries"):
        assert_no_cross_document_leak(whole_row, qkv_batch())


class MixInBackward(torch.autograd.Function):
    """The identity, whose backward adds every token's gradient to every token."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + grad.sum(dim=0, keepdim=True)


def test_a_leak_in_the_backward_only_is_caught():
    batch = qkv_batch()
    with pytest.raises(AssertionError, match="gradient"):
        assert_no_cross_document_leak(
            lambda b: varlen({**b, "q": MixInBackward.apply(b["q"])}), batch
        )


class TinyModel(torch.nn.Module):
    """Token ids (1, total) -> logits (1, total, vocab), attention within documents."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 50)
        self.leak = leak

    def forward(self, batch):
        x = self.embed(batch["input_ids"][0]).view(-1, 2, 8)
        if self.leak:
            y = whole_row({"q": x, "k": x, "v": x})
        else:
            y = varlen({"q": x, "k": x, "v": x, "cu_seqlens": batch["cu_seqlens"]}, causal=True)
        return self.out(y.reshape(-1, 16)).unsqueeze(0)


def test_token_ids_are_perturbed_with_other_ids():
    ids = torch.randint(0, 50, (1, sum(LENGTHS)))
    batch = {"input_ids": ids, "cu_seqlens": offsets(LENGTHS), "position_ids": ids * 0}
    assert_no_cross_document_leak(TinyModel(), batch, token_dim=1)
    with pytest.raises(AssertionError, match="changed .* output values"):
        assert_no_cross_document_leak(TinyModel(leak=True), batch, token_dim=1)


def test_a_thousand_short_documents():
    lengths = [(i * 37) % 9 for i in range(1000)]  # 0..8 tokens, some empty
    assert_no_cross_document_leak(
        lambda b: varlen(b, causal=True), qkv_batch(lengths), documents=[0, 1, 500, 998, 999]
    )


def test_dropout_under_a_fixed_seed():
    def fixed_dropout(batch):
        torch.manual_seed(7)
        return varlen(batch, dropout_p=0.2, backend="flash")

    assert_no_cross_document_leak(fixed_dropout, qkv_batch())


def test_bad_batches():
    assert "batch['cu_seqlens'] must be an int32 or int64" in expect_error(
        lambda: assert_no_cross_document_leak(whole_row, {"q": torch.ones(3)})
    )
    batch = {"cu_seqlens": offsets([2, 3]), "x": torch.ones(4, 2)}
    assert "no tensor with 5 tokens along token_dim=0" in expect_error(
        lambda: assert_no_cross_document_leak(whole_row, batch)
    )
    batch = {"cu_seqlens": offsets([2, 3]), "ids": torch.zeros(5, dtype=torch.long)}
    assert "all equal" in expect_error(lambda: assert_no_cross_document_leak(whole_row, batch))
