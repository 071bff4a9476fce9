"""attention() at the edges of what it accepts: masks and biases of fewer than two
dims, an empty batch, the backend checked on empty calls, per-head block selections."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import cpu_backends, golden, make_qkv, max_error
from mhsa import masks


@pytest.mark.parametrize("backend", ["auto", *cpu_backends()])
@pytest.mark.parametrize("shape", [(), (9,), (1, 9)])
def test_masks_and_biases_of_few_dims_broadcast_as_validated(backend, shape):
    """A (S,) or 0-D mask or bias broadcasts to (B, H, L, S) like any other shape that
    passes the checks; every backend gives the reference answer for it."""
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 4, 2, 5, 9, 8, dtype=torch.float64)
    mask = torch.rand(shape) > 0.3 if shape else torch.tensor(True)
    if shape:
        mask[..., 0] = True
    bias = torch.randn(shape, dtype=torch.float64)
    expected = golden(q, k, v, mask.expand(2, 4, 5, 9), bias=bias.expand(2, 4, 5, 9))
    out = mhsa.attention(q, k, v, mask, bias=bias, backend=backend)
    assert max_error(out, expected) < 1e-12


@pytest.mark.parametrize("backend", ["auto", *cpu_backends()])
def test_an_empty_batch_gives_empty_results(backend):
    q, k, v = make_qkv(0, 4, 2, 3, 5, 8, value_dim=6, requires_grad=True)
    lse_call = backend in ("auto", "flash", "reference")
    if lse_call:
        out, lse = mhsa.attention(q, k, v, return_lse=True, backend=backend)
        assert lse.shape == (0, 4, 3)
    else:
        out = mhsa.attention(q, k, v, backend=backend)
    assert out.shape == (0, 4, 3, 6)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert mhsa.attention_weights(q, k).shape == (0, 4, 3, 5)
    assert mhsa.attention_weights(q, k, heads=[1], backend="flash").shape == (0, 1, 3, 5)


@pytest.mark.parametrize(("q_len", "kv_len", "batch"), [(0, 5, 2), (5, 0, 2), (5, 5, 0)])
def test_empty_calls_check_the_backend_as_full_ones_do(q_len, kv_len, batch):
    q, k, v = make_qkv(batch, 4, 2, q_len, kv_len, 8)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        mhsa.attention(q, k, v, backend="no-such-backend")
    with pytest.raises(ValueError, match="sdpa.*logsumexp"):
        mhsa.attention(q, k, v, backend="sdpa", return_lse=True)


def _explicit_mask(selected: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """(..., n, n) block selection -> (..., L, L) element mask, written out: own block
    causal plus the selected strictly earlier blocks."""
    pos = torch.arange(length)
    q_block, k_block = pos.view(-1, 1) // block_size, pos.view(1, -1) // block_size
    own = (q_block == k_block) & (pos.view(1, -1) <= pos.view(-1, 1))
    chosen = selected[..., q_block, k_block] & (k_block < q_block)
    return own | chosen


def test_a_selection_per_sequence_applies_to_every_head_of_that_sequence():
    """SelectedBlocks((B, n, n)): the first dim is the batch, whatever the head count
    (B == H once let it pass as heads)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 2, 2, 8, 8, 4, dtype=torch.float64)
    selected = torch.zeros(2, 4, 4, dtype=torch.bool)
    selected[0, 2, 0] = selected[0, 3, 1] = True  # sequence 0 only
    pattern = masks.SelectedBlocks(selected, 2)
    explicit = _explicit_mask(selected, 2, 8).unsqueeze(1)  # (B, 1, L, S)
    assert torch.equal(pattern.dense(8, 8).expand(2, 2, 8, 8), explicit.expand(2, 2, 8, 8))
    for backend in ("reference", "flash"):
        out = mhsa.attention(q, k, v, pattern, backend=backend)
        assert max_error(out, golden(q, k, v, explicit)) < 1e-12, backend
    with pytest.raises(ValueError, match="batch size 2"):
        mhsa.attention(*make_qkv(3, 2, 2, 8, 8, 4), pattern)


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_attention_weights_of_some_heads_take_those_heads_of_a_per_head_pattern(backend):
    torch.manual_seed(0)
    q, k, _ = make_qkv(2, 4, 2, 8, 8, 8, dtype=torch.float64)
    selected = torch.rand(2, 4, 4, 4) > 0.5
    pattern = masks.SelectedBlocks(selected, 2)
    everything = mhsa.attention_weights(q, k, pattern, backend="reference")
    for heads in ([1], [3, 0]):
        got = mhsa.attention_weights(q, k, pattern, heads=heads, rows=[7, 2], backend=backend)
        assert got.shape == (2, len(heads), 2, 8)
        assert max_error(got, everything[:, heads][:, :, [7, 2]]) < 1e-12
    union = pattern | masks.SlidingWindow(1, 0)
    got = mhsa.attention_weights(q, k, union, heads=[2], backend=backend)
    assert max_error(got, mhsa.attention_weights(q, k, union, backend="reference")[:, [2]]) < 1e-12


def test_attention_weights_of_some_heads_narrow_a_per_head_bool_mask_pattern():
    torch.manual_seed(0)
    q, k, _ = make_qkv(1, 4, 2, 5, 5, 8, dtype=torch.float64)
    mask = torch.rand(1, 4, 5, 5) > 0.5
    pattern = masks.BoolMask(mask)
    for mask_of_heads in (pattern, pattern | masks.SlidingWindow(1, 1)):
        got = mhsa.attention_weights(q, k, mask_of_heads, heads=[0, 2])
        want = mhsa.attention_weights(q, k, mask_of_heads, backend="reference")[:, [0, 2]]
        assert got.shape == (1, 2, 5, 5) and max_error(got, want) < 1e-12


@pytest.mark.parametrize(("batch", "q_len", "kv_len"), [(0, 3, 3), (2, 0, 0), (1, 0, 4)])
def test_moba_cluster_and_latent_attention_take_empty_calls(batch, q_len, kv_len):
    """Each raised from a reshape of 0 elements (or a top_k check of 0 blocks) where
    attention answers an empty call with empty, graph-connected zeros."""
    from mhsa.core.cluster import cluster_attention
    from mhsa.core.moba import moba_attention
    from mhsa.nn import LatentAttention

    q = torch.randn(batch, 2, q_len, 8, requires_grad=True)
    k, v = torch.randn(batch, 2, kv_len, 8), torch.randn(batch, 2, kv_len, 8)
    for out in (
        moba_attention(q, k, v, 4, 1),
        cluster_attention(q, k, v, num_buckets=4, chunk_size=2),
    ):
        assert out.shape == (batch, 2, q_len, 8) and not out.any()
        out.sum().backward()
    layer = LatentAttention(
        16, 2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4
    )
    assert layer(torch.randn(batch, q_len, 16)).shape == (batch, q_len, 16)


def test_empty_lists_make_empty_patterns_and_bad_calls_name_their_argument():
    """KeyPadding([]) and Document([]) read torch.as_tensor([]), a float tensor, and
    were refused; a str rope scaling, a list reorder index, a 'gpu' device or a str lr
    failed deep inside (AttributeError, RuntimeError, TypeError naming nothing)."""
    from mhsa.apps.train import TrainConfig
    from mhsa.cache import KVCache
    from mhsa.models.llama4 import Llama4Config

    q, k, v = make_qkv(0, 2, 2, 3, 3, 8)
    assert mhsa.attention(q, k, v, masks.KeyPadding([])).shape == (0, 2, 3, 8)
    q, k, v = make_qkv(1, 2, 2, 0, 0, 8)
    assert mhsa.attention(q, k, v, masks.Document([])).shape == (1, 2, 0, 8)
    with pytest.raises(TypeError, match="rope scaling must be a dict"):
        Llama4Config(rope_scaling="linear")
    cache = KVCache(2, 1, 4, 2)
    for index in ([1, 0], torch.tensor([1.0, 0.0]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match="reorder index must be a 1-D integer tensor"):
            cache.reorder(index)
    with pytest.raises(ValueError, match=r"device must be cpu or cuda \(--device\)"):
        TrainConfig(device="gpu")
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0 \(--lr\)"):
        TrainConfig(lr="3e-4")
