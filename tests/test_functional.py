"""attention() and attention_weights(): dispatch, empty inputs, weights, gradcheck, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mhsa
from helpers import cpu_backends, golden, make_qkv, max_error
from mhsa.backends import AttentionSpec, select

spec = AttentionSpec.example


def test_auto_prefers_sdpa_where_its_fused_kernels_apply_else_flash():
    big = {"q_len": 1024, "kv_len": 1024}
    assert select(spec(**big), "auto").name == "sdpa"
    assert select(spec(causal=True, **big), "auto").name == "sdpa"
    assert select(spec(return_lse=True, **big), "auto").name == "flash"
    assert select(spec(has_mask=True, **big), "auto").name == "flash"
    assert select(spec(causal=True, q_len=1000, kv_len=1024), "auto").name == "flash"
    assert select(spec(dropout_p=0.1, **big), "auto").name == "flash"
    # small score matrices: materialising the mask is free, one sdpa call is fastest
    assert select(spec(has_mask=True, q_len=128, kv_len=128), "auto").name == "sdpa"
    assert select(spec(return_lse=True), "auto").name == "flash"


def test_named_backend_that_cannot_serve_raises_with_reason():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="sdpa.*logsumexp"):
        mhsa.attention(q, k, v, backend="sdpa", return_lse=True)


def test_unknown_backend_names_the_choices():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="reference"):
        mhsa.attention(q, k, v, backend="nope")
    with pytest.raises(ValueError, match="nope"), mhsa.use_backend("nope"):
        pass


def test_use_backend_forces_and_restores():
    with mhsa.use_backend("reference"):
        assert select(spec(), "auto").name == "reference"
        assert select(spec(), "sdpa").name == "reference"
    assert select(spec(), "auto").name == "sdpa"
    assert mhsa.backends() == ["sdpa", "flash", "flex", "triton", "reference", "ring"]


def test_empty_query_gives_empty_output():
    q, k, v = make_qkv(2, 4, 2, 0, 5, 8, value_dim=3)
    out, lse = mhsa.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 4, 0, 3) and lse.shape == (2, 4, 0)


def test_empty_keys_give_zeros():
    q, k, v = make_qkv(2, 4, 2, 5, 0, 8, value_dim=3)
    out, lse = mhsa.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 4, 5, 3) and (out == 0).all() and torch.isneginf(lse).all()
    assert (mhsa.attention_weights(q, k) == 0).all()


@pytest.mark.parametrize(("q_len", "kv_len"), [(0, 5), (5, 0), (0, 0)])
def test_empty_inputs_stay_in_the_graph_with_zero_gradients(q_len, kv_len):
    q, k, v = make_qkv(2, 4, 2, q_len, kv_len, 8, requires_grad=True)
    with torch.no_grad():
        q.fill_(float("nan"))  # nothing to attend: not even nan may leak
    out = mhsa.attention(q, k, v)
    assert out.requires_grad and not out.isnan().any()
    out.sum().backward()
    for tensor in (q, k, v):
        assert tensor.grad is not None and tensor.grad.shape == tensor.shape
        assert (tensor.grad == 0).all()


def test_attention_weights_match_the_formula():
    q, k, _ = make_qkv(2, 4, 2, 7, 9, 16)
    mask = torch.rand(2, 1, 7, 9) > 0.2
    mask[..., 0] = True
    bias = torch.randn(4, 7, 9)
    probs = mhsa.attention_weights(q, k, mask, bias=bias, causal=True)
    kk = k.repeat_interleave(2, dim=1)
    allowed = mask & torch.ones(7, 9, dtype=torch.bool).tril(2)
    scores = (q @ kk.transpose(-1, -2)) / 4 + bias
    expected = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1)
    assert probs.shape == (2, 4, 7, 9)
    assert max_error(probs, expected) < 1e-6
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 7))


def test_lse_matches_logsumexp_of_scores():
    q, k, v = make_qkv(1, 4, 1, 5, 6, 8)
    _, lse = mhsa.attention(q, k, v, return_lse=True)
    scores = q @ k.transpose(-1, -2) * 8**-0.5
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-6)


def test_gradcheck_reference_with_mask_bias_gqa_and_dead_row():
    q, k, v = make_qkv(1, 4, 2, 5, 6, 3, value_dim=2, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 4, 5, 6) > 0.3
    mask[:, :, 1] = False
    bias = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        out, lse = mhsa.attention(
            q, k, v, mask, bias=bias, causal=True, backend="reference", return_lse=True
        )
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, bias))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    head_dim=st.integers(1, 33),
    causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "full", "key_padding", "per_head"]),
    seed=st.integers(0, 2**16),
)
def test_every_backend_matches_reference_on_random_calls(
    batch, kv_heads, group, q_len, kv_len, head_dim, causal, mask_kind, seed
):
    torch.manual_seed(seed)
    heads = kv_heads * group
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim)
    shapes = {
        "none": None,
        "full": (batch, heads, q_len, kv_len),
        "key_padding": (batch, 1, 1, kv_len),
        "per_head": (heads, 1, kv_len),
    }[mask_kind]
    mask = None if shapes is None else torch.rand(shapes) > 0.4
    expected = golden(q, k, v, mask, causal=causal)
    for backend in cpu_backends():
        out = mhsa.attention(q, k, v, mask, causal=causal, backend=backend)
        assert torch.isfinite(out).all()
        assert max_error(out, expected) < 1e-5, backend
    # a row sums to 1, or is all zero exactly when it has no allowed key
    probs = mhsa.attention_weights(q, k, mask, causal=causal)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(kv_len - q_len)
    if mask is not None:
        allowed = allowed & mask
    has_key = allowed.expand(batch, heads, q_len, kv_len).any(-1)
    row_sums = probs.sum(-1)
    assert torch.allclose(row_sums[has_key], torch.ones(()), atol=1e-5)
    assert (row_sums[~has_key] == 0).all()


@pytest.mark.parametrize("backend", ["auto", *cpu_backends()])
def test_a_custom_scale_is_used(backend):
    """scale=0.1 (far from 1/sqrt(16) = 0.25) against the golden formula at 0.1; the
    weights too."""
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16)
    out = mhsa.attention(q, k, v, causal=True, scale=0.1, backend=backend)
    assert max_error(out, golden(q, k, v, causal=True, scale=0.1)) < 1e-5
    assert max_error(out, golden(q, k, v, causal=True)) > 1e-2
    weights = mhsa.attention_weights(q, k, scale=0.1)
    expected = torch.softmax(q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)
                             * 0.1, dim=-1)  # fmt: skip
    assert max_error(weights, expected) < 1e-6


def test_attention_weights_of_selected_heads_use_the_custom_scale():
    """The flash path normalises by its own lse: computed at the caller's scale too."""
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 9, 8)
    full = mhsa.attention_weights(q, k, scale=0.1, causal=True)
    part = mhsa.attention_weights(q, k, scale=0.1, causal=True, heads=[1, 3], rows=[0, 5])
    assert max_error(part, full[:, [1, 3]][:, :, [0, 5]]) < 1e-6
    assert torch.allclose(part.sum(-1), torch.ones(1, 2, 2))
