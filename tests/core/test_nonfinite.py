"""A masked-out key or value never affects the output, finite or not (issue 15, item 4).

Seeded fuzz: nan / +inf / -inf put into keys and values that some or all queries are
masked from, for every backend, against the float64 golden formula on the same
inputs with those entries set to 0. Rows that attend a non-finite key are left
out (their output is non-finite by the formula); every other row, its lse and the
gradients of a loss over those rows must match. Unwritten and padded cache slots
are covered through KVCache, and ring attention through a real gloo group.
"""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import golden_attention, max_error
from mhsa.cache import KVCache
from mhsa.core.attention import attention_and_weights
from mhsa.core.backends import get
from mhsa.core.masks import KeyPadding, SlidingWindow
from mhsa.distributed import context_parallel, run_local, shard, unshard
from optional import needs

BACKENDS = ["reference", "sdpa", "flash", "auto"]
CASES = 80  # per backend
BAD_VALUES = (float("nan"), float("inf"), -float("inf"))


def _case(gen: torch.Generator):
    """Random shapes, a random kind of mask, and non-finite entries at random keys."""

    def rand_int(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    batch, kv_heads, group = rand_int(1, 2), rand_int(1, 2), rand_int(1, 2)
    q_len, kv_len, dim = rand_int(1, 40), rand_int(1, 60), rand_int(1, 3) * 8
    q = torch.randn(batch, kv_heads * group, q_len, dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    kind = ["causal", "tensor", "padding", "window", "bias"][rand_int(0, 4)]
    rows = torch.arange(q_len).view(-1, 1) + kv_len - q_len
    cols = torch.arange(kv_len).view(1, -1)
    mask, bias, causal = None, None, kind == "causal"
    allowed = cols <= rows if causal else torch.ones(q_len, kv_len, dtype=torch.bool)
    if kind == "tensor":
        mask = torch.rand(batch, 1, q_len, kv_len, generator=gen) > 0.4
        allowed = mask
    elif kind == "padding":
        lengths = [rand_int(0, kv_len) for _ in range(batch)]
        mask = KeyPadding(lengths)
        allowed = (cols < torch.tensor(lengths).view(-1, 1, 1, 1)).expand(-1, 1, q_len, -1)
    elif kind == "window":
        mask = SlidingWindow(rand_int(0, 6), rand_int(0, 6))
        allowed = mask.dense(q_len, kv_len, torch.device("cpu"))
    elif kind == "bias":  # -inf entries of a bias mask as well
        bias = torch.randn(1, kv_heads * group, q_len, kv_len, generator=gen)
        hidden = torch.rand(bias.shape, generator=gen) > 0.6
        bias = bias.masked_fill(hidden, -torch.inf)
        allowed = ~hidden
    for _ in range(rand_int(1, 3)):
        target = k if rand_int(0, 1) else v
        index = [rand_int(0, n - 1) for n in target.shape]
        target[tuple(index)] = BAD_VALUES[rand_int(0, 2)]
    return q, k, v, mask, bias, causal, allowed


def _clean_rows(k, v, allowed, num_heads):
    """(B, H, L) rows that attend no key holding a non-finite entry."""
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, H_kv, S)
    bad = bad.repeat_interleave(num_heads // k.shape[1], 1).unsqueeze(2)  # (B, H, 1, S)
    return ~(allowed & bad).any(-1)


def _zeroed(t):
    return torch.where(torch.isfinite(t), t, torch.zeros(()))


def _check(backend: str, q, k, v, mask, bias, causal, allowed):
    scale = q.shape[-1] ** -0.5
    allowed = allowed.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    clean = _clean_rows(k, v, allowed, q.shape[1])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if backend == "weights":  # what modules run for need_weights=True
        out, lse = attention_and_weights(*leaves, mask, bias=bias, causal=causal)[0], None
    else:
        with_lse = backend != "sdpa"  # sdpa does not return the logsumexp
        result = mhsa.attention(
            *leaves, mask, bias=bias, causal=causal, backend=backend, return_lse=with_lse
        )
        out, lse = result if with_lse else (result, None)
    expected = [t.clone().double().requires_grad_() for t in (q, _zeroed(k), _zeroed(v))]
    want_out, want_lse = golden_attention(*expected, allowed, bias=bias, scale=scale)
    assert torch.isfinite(out[clean]).all(), "a masked non-finite key leaked"
    assert max_error(out[clean], want_out[clean]) < 1e-5
    if lse is not None:
        assert torch.equal(torch.isneginf(lse[clean]), torch.isneginf(want_lse[clean]))
        alive = clean & ~torch.isneginf(want_lse)
        assert max_error(lse[alive], want_lse[alive]) < 1e-5
    if allowed.all() and not clean.all():
        return  # nothing is masked: the rows that attend a nan key make every grad nan
    weight = torch.randn(out.shape) * clean.unsqueeze(-1)
    (out * weight).sum().backward()
    (want_out * weight.double()).sum().backward()
    for name, got, want in zip("qkv", leaves, expected, strict=True):
        assert torch.isfinite(got.grad).all(), f"d{name} holds a non-finite entry"
        error = max_error(got.grad, want.grad)
        assert error < 1e-4, f"d{name} differs by {error}"


def _check_cases(backend: str, seed: int, count: int) -> None:
    """_check on `count` random cases of _case, the failing one named."""
    gen = torch.Generator().manual_seed(seed)
    for number in range(count):
        case = _case(gen)
        try:
            _check(backend, *case)
        except AssertionError as error:
            raise AssertionError(f"case {number}: {error}") from error


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_nonfinite_keys_and_values_never_leak(backend):
    _check_cases(backend, seed=15, count=CASES)


def test_masked_nonfinite_keys_and_values_never_leak_into_returned_weights_calls():
    """attention_and_weights (need_weights=True) once multiplied 0 by a masked nan."""
    _check_cases("weights", seed=17, count=40)


@pytest.mark.slow
def test_masked_nonfinite_triton_interpreter():
    needs("triton")
    assert get("triton").available() is None
    _check_cases("triton", seed=16, count=12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwritten_and_padded_cache_slots_are_ignored(backend):
    """Decode steps over a left-padded KVCache whose padding slots and unwritten tail
    hold nan/inf give the same outputs as over a cache that never held them."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, dim, prompt = 3, 2, 8, 6
    start = torch.tensor([0, 2, 5])
    outputs = []
    for poison in (None, float("nan"), float("inf")):
        cache = KVCache(batch, heads, 16, dim)
        if poison is not None:
            cache.k.fill_(poison)
            cache.v.fill_(-poison)
        cache.set_padding(start)
        steps = torch.randn(
            batch, heads, prompt + 4, dim, generator=torch.Generator().manual_seed(5)
        )
        k_all, v_all = cache.update(steps[:, :, :prompt], steps[:, :, :prompt] * 2)
        if poison is not None:  # the padding slots are garbage too
            for b, s in enumerate(start.tolist()):
                cache.k[b, :, :s] = poison
                cache.v[b, :, :s] = poison
        step_outputs = []
        for t in range(prompt, prompt + 4):
            k_all, v_all = cache.update(steps[:, :, t : t + 1], steps[:, :, t : t + 1] * 2)
            mask = cache.key_padding().view(batch, 1, 1, -1)
            q = torch.randn(batch, heads, 1, dim, generator=gen)
            step_outputs.append(mhsa.attention(q, k_all, v_all, mask, backend=backend))
        outputs.append(torch.cat(step_outputs, dim=2))
        gen.manual_seed(3)
    assert torch.isfinite(outputs[0]).all()
    for poisoned in outputs[1:]:
        assert torch.equal(poisoned, outputs[0])


def _ring_worker(rank: int, world: int) -> float:
    """Max error of ring attention (context_parallel) against one process, with nan in
    padded keys and values."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 8 * world, 8, generator=gen) for _ in range(3))
    lengths = [5 * world, 3]
    for b, length in enumerate(lengths):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("inf")
    mask = KeyPadding(lengths)
    expected = mhsa.attention(q, _zeroed(k), _zeroed(v), mask, causal=True, backend="reference")
    local = [shard(t, rank, world, "zigzag") for t in (q, k, v)]
    with context_parallel(layout="zigzag"):
        out = mhsa.attention(*local, mask, causal=True)
    return (unshard(out, world, "zigzag") - expected).abs().max().item()


@pytest.mark.slow
def test_ring_attention_ignores_masked_nonfinite_keys():
    errors = run_local(_ring_worker, 2, timeout=120)
    assert max(errors) < 1e-5, errors


def test_isolate_nonfinite_false_skips_the_check_and_nothing_else():
    """Without the check a masked nan reaches the rows of its tile, as the backend's
    own product makes it (0 * nan); with it (the default) it does not."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    v[:, :, 5] = torch.nan  # the last key's value: masked from every row but the last
    kept = mhsa.attention(q, k, v, causal=True, backend="reference")
    raw = mhsa.attention(q, k, v, causal=True, backend="reference", isolate_nonfinite=False)
    assert torch.isfinite(kept[:, :, :5]).all()
    assert torch.isnan(raw[:, :, :5]).all()  # the reference's p @ v: 0 * nan
    assert torch.equal(kept[:, :, 5].isnan(), raw[:, :, 5].isnan())
    with pytest.raises(TypeError, match="isolate_nonfinite must be True or False"):
        mhsa.attention(q, k, v, isolate_nonfinite=None)
