"""Paged attention's plans and choices: which backends serve paged keys, a decoding
step's plan (checked once, kept per kind of layer, never stale), the fused layout a
short call keeps, and the registry's and use_backend's say over the paged choice."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import max_error, paged_call, paged_case, paged_golden
from mhsa.core.backends import AttentionSpec, get, names
from mhsa.core.masks import SlidingWindow


def test_each_backend_says_whether_it_serves_paged_keys():
    spec = AttentionSpec.example(paged=True, causal=True)
    grads = AttentionSpec.example(paged=True, causal=True, needs_grad=True)
    assert get("reference").supports(spec) is None and get("reference").supports(grads) is None
    assert get("flash").supports(spec) is None
    assert "inference" in get("flash").supports(grads)
    # triton: its paged kernel (interpreted here), for inference
    assert "inference" in get("triton").supports(grads)
    for name in names():
        backend = get(name)
        if name not in ("reference", "flash", "triton"):  # why not, each in its own words
            assert backend.available() or backend.supports(spec)
    assert "paged" in get("sdpa").supports(spec)
    assert get("sdpa").supports(AttentionSpec.example()) is None  # (unpaged: unchanged)


def test_a_block_table_changed_in_place_is_checked_again():
    """attention(block_table=) checks the table at each call: a table changed in place or
    another table with the same values is checked again. A PagedStep keeps the table it
    checked (its own copy): changing the caller's table after changes none of its
    answers, and a step made from the changed table refuses it."""
    q, k_pool, v_pool, table, _, _ = paged_case([5, 9], 4)
    lengths = [5, 9]
    first = paged_call(q, k_pool, v_pool, table, lengths)
    assert torch.equal(paged_call(q, k_pool, v_pool, table, lengths), first)
    step = _step(table, lengths, k_pool)
    table[1, 0] = k_pool.shape[0]  # a block holding keys that is no block
    with pytest.raises(ValueError, match="block_table's blocks"):
        paged_call(q, k_pool, v_pool, table, lengths)
    with pytest.raises(ValueError, match="block_table's blocks"):
        paged_call(q, k_pool, v_pool, table.clone(), lengths)
    assert torch.equal(mhsa.paged_attention(q, k_pool, v_pool, step), first)
    with pytest.raises(ValueError, match="block_table's blocks"):
        _step(table, lengths, k_pool)


def _step(table, lengths, k_pool) -> mhsa.PagedStep:
    return mhsa.PagedStep(table, lengths, num_blocks=k_pool.shape[0], block_size=k_pool.shape[1])


@torch.no_grad()
def test_the_layers_of_a_step_reuse_one_checked_plan_and_nothing_stale(monkeypatch):
    """A step checks and plans each kind of call once: the later calls of a kind (other
    layers: their own q and pools, the same shapes and options) skip the checks; a call
    of another kind (another scale, a forced backend) is checked and planned for itself,
    and every answer equals the checked one."""
    from mhsa.core.paged_step import PagedStep

    q, k_pool, v_pool, table, keys, values = paged_case([5, 9], 4)
    lengths = [5, 9]
    step = _step(table, lengths, k_pool)
    checks = []
    check = PagedStep.check
    monkeypatch.setattr(PagedStep, "check", lambda *args: checks.append(1) or check(*args))
    want = paged_golden(q, keys, values, lengths)
    for _ in range(3):  # the second and third reuse the first's plan
        assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
    assert len(checks) == 1 and len(step.plans) == 1
    other_q = torch.randn_like(q)  # another layer: its own q and pools, the same shapes
    other_k, other_v = torch.randn_like(k_pool), torch.randn_like(v_pool)
    other_keys, other_values = (gathered(pool, table, lengths) for pool in (other_k, other_v))
    other_want = paged_golden(other_q, other_keys, other_values, lengths)
    out = mhsa.paged_attention(other_q, other_k, other_v, step)
    assert max_error(out, other_want) < 1e-12 and len(checks) == 1
    half = paged_golden(q, keys, values, lengths, scale=0.5)
    assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step, scale=0.5), half) < 1e-12
    assert len(checks) == 2 and len(step.plans) == 2
    with pytest.raises(ValueError, match="forward_paged|paged keys"), mhsa.use_backend("sdpa"):
        mhsa.paged_attention(q, k_pool, v_pool, step)
    with pytest.raises(ValueError, match="seq_lens"):  # a step's lengths are checked once
        _step(table, [5, table.shape[1] * 4 + 1], k_pool)
    with pytest.raises(ValueError, match="made for"):  # pools of other blocks: not its own
        mhsa.paged_attention(q, k_pool[:-1], v_pool[:-1], step)
    with pytest.raises(ValueError, match="PagedStep 2"):  # q of other sequences
        mhsa.paged_attention(q[:1], k_pool, v_pool, step)
    with pytest.raises(TypeError, match="step must be an mhsa.PagedStep"):
        mhsa.paged_attention(q, k_pool, v_pool, table)


def gathered(pool, table, lengths):
    """Each sequence's keys (1, H_kv, len, D) of pool, gathered by hand."""
    size = pool.shape[1]
    return [
        torch.stack([pool[table[n, j // size], j % size] for j in range(length)], 1)[None]
        for n, length in enumerate(lengths)
    ]


@torch.no_grad()
def test_a_step_plans_each_kind_of_layer_for_itself():
    """One step serves layers of several kinds (windowed and global, as Gemma alternates
    them; another scale; other head counts): each kind gets its own plan, and each
    layer's answer is its own, called in any order."""
    lengths = [9, 40, 23]
    q, k_pool, v_pool, table, keys, values = paged_case(lengths, 5, q_len=2, value_dim=7)
    q8 = torch.randn(3, 8, 2, 7, dtype=torch.float64)
    step = _step(table, lengths, k_pool)
    kinds = [
        (q, {}, paged_golden(q, keys, values, lengths)),
        (q, {"mask": SlidingWindow(6, 0)}, paged_golden(q, keys, values, lengths, window=6)),
        (q, {"mask": SlidingWindow(0, 0)}, paged_golden(q, keys, values, lengths, window=0)),
        (q, {"scale": 0.3}, paged_golden(q, keys, values, lengths, scale=0.3)),
        (q8, {}, paged_golden(q8, keys, values, lengths)),
    ]
    for _ in range(2):
        for queries, options, want in kinds + kinds[::-1]:
            out = mhsa.paged_attention(queries, k_pool, v_pool, step, backend="flash", **options)
            assert max_error(out, want) < 1e-12
    assert len(step.plans) == len(kinds)


@torch.no_grad()
@pytest.mark.parametrize("lengths", [[9, 5, 2], [2, 9, 5]], ids=["longest first", "unsorted"])
def test_a_short_calls_kept_layout_never_keeps_the_pages(lengths):
    """The flash engine's layout (positions, masks), made once per step and kind of
    call, reads no page: the layers of one step, each with other pools, read their own
    keys; a call with the same lengths and shapes but other pages (another table, the
    same table changed in place) reads its own."""
    # D == D_v: the fused kernel (unwritten slots hold nan, as _paged makes them)
    first, second = (paged_case(lengths, 4, q_len=2, value_dim=7, num_blocks=12) for _ in "ab")
    for q, k_pool, v_pool, table, keys, values in (first, second, first):
        want = paged_golden(q, keys, values, lengths)
        assert (
            max_error(paged_call(q, k_pool, v_pool, table, lengths, backend="flash"), want) < 1e-12
        )
    q, k_pool, v_pool, table, keys, values = second
    step = _step(table, lengths, k_pool)
    for _ in range(2):  # layers of one step: their own pools, the same table
        for pools, (layer_keys, layer_values) in (
            ((k_pool, v_pool), (keys, values)),
            ((v_pool, k_pool), (values, keys)),
        ):
            want = paged_golden(q, layer_keys, layer_values, lengths)
            out = mhsa.paged_attention(q, *pools, step, backend="flash")
            assert max_error(out, want) < 1e-12
    assert len(step.plans) == 1 and step.plans[next(iter(step.plans))].prepared is not None
    other = torch.randperm(k_pool.shape[0])  # the same table's ids moved in place
    moved_k, moved_v = torch.empty_like(k_pool), torch.empty_like(v_pool)
    moved_k[other], moved_v[other] = k_pool, v_pool
    table[table >= 0] = other[table[table >= 0]]
    want = paged_golden(q, keys, values, lengths)
    assert max_error(paged_call(q, moved_k, moved_v, table, lengths, backend="flash"), want) < 1e-12
    moved = _step(table, lengths, k_pool)
    assert max_error(mhsa.paged_attention(q, moved_k, moved_v, moved), want) < 1e-12


def test_the_registry_refuses_paged_keys_for_backends_without_forward_paged():
    from mhsa.core.backends.registry import PAGED_REASON, reason_unusable, serves_paged

    spec = AttentionSpec.example(paged=True, causal=True)
    for name in names():
        backend = get(name)
        assert serves_paged(backend) == (name in ("reference", "flash", "triton"))
        if not serves_paged(backend):
            assert reason_unusable(backend, spec) == PAGED_REASON


def test_the_paged_choice_follows_use_backend_and_the_registry(monkeypatch):
    """select answers a paged spec from the registry as it is now (nothing kept between
    calls); a step plans a call under a forced backend as another kind, with that
    backend, and goes back to its own plan outside it."""
    from mhsa.core.backends import registry

    spec = AttentionSpec.example(paged=True, causal=True)
    assert registry.select(spec, "auto").name == "flash"
    with mhsa.use_backend("reference"):
        assert registry.select(spec, "auto").name == "reference"
    assert registry.select(spec, "auto").name == "flash"
    q, k_pool, v_pool, table, keys, values = paged_case([5, 9], 4)
    step, want = _step(table, [5, 9], k_pool), paged_golden(q, keys, values, [5, 9])
    with torch.no_grad():
        assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
        with mhsa.use_backend("reference"):
            assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
        assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
    chosen = [plan.backend.name for plan in step.plans.values()]
    assert chosen == ["flash", "reference"]
    others = {name: b for name, b in registry._BACKENDS.items() if name != "flash"}
    monkeypatch.setattr(registry, "_BACKENDS", others)  # (the order stays the registry's)
    assert registry.select(spec, "auto").name == "reference"
