"""LSH cluster attention against the reference with the mask its buckets imply."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import make_qkv, max_error
from mhsa.core.cluster import implied_counts, lsh_buckets


def reference_with_counts(q, k, v, counts):
    """softmax(scores + log n) v: a key met in n rounds counts n times."""
    bias = torch.log(counts.double())  # -inf where never met
    return mhsa.attention(q, k, v, bias=bias, backend="reference", return_lse=True)


@pytest.mark.parametrize(
    "heads, kv_heads, q_len, kv_len, hashes, causal",
    [
        (4, 4, 113, 113, 1, False),
        (4, 2, 113, 113, 3, True),
        (2, 1, 70, 203, 2, False),
        (2, 2, 203, 70, 2, True),
    ],
)
def test_matches_reference_on_implied_mask(heads, kv_heads, q_len, kv_len, hashes, causal):
    q, k, v = make_qkv(2, heads, kv_heads, q_len, kv_len, 16, requires_grad=True)
    options = {"num_buckets": 8, "chunk_size": 16, "num_hashes": hashes, "causal": causal}
    out, lse = mhsa.cluster_attention(q, k, v, return_lse=True, seed=3, **options)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    counts = implied_counts(q.detach(), k.detach(), seed=3, **options)
    assert counts.max() == hashes and 0 < (counts > 0).float().mean() < 0.9
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_with_counts(q64, k64, v64, counts)
    ref.backward(grad_out.double())
    assert max_error(out, ref) < 2e-5
    finite = torch.isfinite(ref_lse)
    assert (
        torch.equal(torch.isfinite(lse), finite) and max_error(lse[finite], ref_lse[finite]) < 1e-5
    )
    for got, want in ((q, q64), (k, k64), (v, v64)):
        assert torch.isfinite(got.grad).all() and max_error(got.grad, want.grad) < 1e-4


def test_similar_vectors_share_buckets():
    x = torch.randn(1, 1, 1, 32)
    near = x + 1e-3 * torch.randn(1, 1, 50, 32)
    assert (lsh_buckets(near, 16, seed=0) == lsh_buckets(x, 16, seed=0)).all()
    far = torch.randn(1, 1, 500, 32)
    assert lsh_buckets(far, 16, seed=0).unique().numel() == 16


def test_memory_is_linear_in_length():
    q, k, v = make_qkv(1, 2, 2, 512, 512, 16, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: sizes.append(t.numel()) or t, lambda t: t
    ):
        out = mhsa.cluster_attention(q, k, v, num_buckets=8, chunk_size=32, num_hashes=2)
    out.sum().backward()
    assert max(sizes) < 512 * 512  # per head: L * 2 * chunk, never L * S


def test_bad_arguments():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="num_buckets must be even"):
        mhsa.cluster_attention(q, k, v, num_buckets=5, chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        mhsa.cluster_attention(q, k, v, num_buckets=4, chunk_size=0)
