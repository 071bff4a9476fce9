"""Score functions and sinks under ring attention (mhsa.distributed): outputs and the
gradients of q, k, v, sinks and the score functions' tensors against single-process
mhsa.attention on the whole sequence, in real gloo groups of 1 to 3 CPU processes.
One spawned group per world size runs every case."""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import mhsa
from helpers import expect_error
from mhsa.core.masks import KeyPadding, SlidingWindow
from mhsa.core.scores import ALiBi, RelativeBias, ScoreMod, Softcap
from mhsa.distributed import context_parallel, ring_attention, run_local, shard, unshard
from mhsa.nn.positional import alibi_slopes

TOLERANCE = 1e-5  # out, dq, dk, dv: absolute
# gradients of replicated tensors sum over every (query, key) pair, relative to their
# largest entry: one process in float32 is off by up to 9.2e-6 already (the long
# relative bias case's table)
PARAM_TOLERANCE = 3e-5


class Case(NamedTuple):
    layout: str
    causal: bool
    score: str | None  # a name of _make_score
    sinks: bool = False
    window: tuple[int, int] | None = None
    padding: bool = False
    heads: int = 2
    kv_heads: int = 2
    chunk: int = 3  # positions per layout chunk
    dispatch: bool = False  # through mhsa.attention inside context_parallel
    frozen: bool = False  # the score's tensors need no gradient (fused backward)


CASES = {
    "alibi causal zigzag": Case("zigzag", True, "alibi", heads=4),
    "alibi full contiguous, gqa": Case("contiguous", False, "alibi", heads=4),
    "relative bias causal contiguous": Case("contiguous", True, "relative", chunk=4),
    "relative bias full zigzag, mqa": Case("zigzag", False, "relative", kv_heads=1, chunk=4),
    "frozen alibi causal contiguous": Case("contiguous", True, "alibi", frozen=True),
    "softcap causal zigzag": Case("zigzag", True, "softcap"),
    "sinks causal contiguous, key padding": Case("contiguous", True, None, True, padding=True),
    "sinks full zigzag": Case("zigzag", False, None, True, heads=4),
    "alibi then softcap, sinks, causal window": Case("zigzag", True, "alibi+softcap", True, (5, 0)),
    "score_mod, key padding": Case("contiguous", False, "score_mod", padding=True),
    "alibi, sinks through context_parallel": Case("zigzag", True, "alibi", True, dispatch=True),
}
# several pieces per shard (blocks.MIN_PIECE = 128): block offsets within a shard
LONG_CASES = {
    "long alibi causal zigzag": Case("zigzag", True, "alibi", chunk=256),
    "long relative bias, sinks, contiguous": Case("contiguous", False, "relative", True, chunk=256),
}


def _make_score(name: str | None, tensors: dict[str, torch.Tensor], causal: bool):
    """The score function `name` reading `tensors` (see _score_tensors)."""
    if name is None:
        return None
    if name == "alibi":
        return ALiBi(tensors["slopes"])
    if name == "alibi+softcap":
        return [ALiBi(tensors["slopes"]), Softcap(2.0)]
    if name == "relative":
        return RelativeBias(
            tensors["table"], num_buckets=8, max_distance=12, bidirectional=not causal
        )
    if name == "softcap":
        return Softcap(2.0)
    key_bias, head_scale = tensors["key_bias"], tensors["head_scale"]

    def fn(score, batch, head, q_idx, kv_idx):  # reads absolute key positions
        return score + key_bias[kv_idx] * head_scale[head] - 0.1 * (q_idx - kv_idx).abs()

    return ScoreMod(fn)


def _score_tensors(name: str | None, heads: int, length: int, gen) -> dict[str, torch.Tensor]:
    if name in ("alibi", "alibi+softcap"):
        return {"slopes": alibi_slopes(heads) * (1 + torch.rand(heads, generator=gen))}
    if name == "relative":
        return {"table": torch.randn(8, heads, generator=gen)}
    if name == "score_mod":
        return {
            "key_bias": torch.randn(length, generator=gen),
            "head_scale": torch.rand(heads, generator=gen),
        }
    return {}


def _leaves(tensors: dict, dtype: torch.dtype, grad: bool) -> dict:
    return {name: t.to(dtype, copy=True).requires_grad_(grad) for name, t in tensors.items()}


def _check_case(rank: int, world: int, case: Case) -> dict[str, float]:
    """Max abs errors of out and every gradient against one process in float64; the
    replicated tensors' gradients (this rank's share) are summed over the ranks first,
    and their errors are relative to the largest entry (when above 1)."""
    gen = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
    batch, head_dim = 2, 8
    length = case.chunk * world * (2 if case.layout == "zigzag" else 1)
    q = torch.randn(batch, case.heads, length, head_dim, generator=gen)
    k = torch.randn(batch, case.kv_heads, length, head_dim, generator=gen)
    v = torch.randn(batch, case.kv_heads, length, head_dim, generator=gen)
    grad = torch.randn(batch, case.heads, length, head_dim, generator=gen)
    keys = torch.rand(batch, length, generator=gen) > 0.3
    keys[1] = False  # a sequence with no real key: output 0 (sinks or not)
    tensors = _score_tensors(case.score, case.heads, length, gen)
    if case.sinks:
        tensors["sinks"] = torch.randn(case.heads, generator=gen)
    mask = SlidingWindow(*case.window) if case.window else None
    full_mask = mask
    if case.padding:
        full_mask = KeyPadding(keys) if mask is None else mask & KeyPadding(keys)

    # the golden answer: one process on the whole sequence, in float64
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    whole_tensors = _leaves(tensors, torch.float64, grad=not case.frozen)
    expected = mhsa.attention(
        *whole,
        full_mask,
        causal=case.causal,
        score=_make_score(case.score, whole_tensors, case.causal),
        sinks=whole_tensors.get("sinks"),
    )
    (expected * grad.double()).sum().backward()

    cut = {"rank": rank, "world_size": world, "layout": case.layout}
    local = [shard(t, **cut).requires_grad_() for t in (q, k, v)]
    local_tensors = _leaves(tensors, torch.float32, grad=not case.frozen)
    call = {
        "causal": case.causal,
        "mask": mask,
        "sinks": local_tensors.get("sinks"),
        "score": _make_score(case.score, local_tensors, case.causal),
    }
    if case.dispatch:
        with context_parallel(layout=case.layout):
            out = mhsa.attention(*local, **call)
    else:
        padding = shard(keys, dim=1, **cut) if case.padding else None
        out = ring_attention(*local, layout=case.layout, key_padding_mask=padding, **call)
    (out * shard(grad, **cut)).sum().backward()

    errors = {"out": (unshard(out.detach(), world, case.layout) - expected).abs().max()}
    for name, mine, full in zip(("dq", "dk", "dv"), local, whole, strict=True):
        errors[name] = (unshard(mine.grad, world, case.layout) - full.grad).abs().max()
    for name, t in local_tensors.items() if not case.frozen else ():
        dist.all_reduce(t.grad)  # each rank holds its queries' share
        full = whole_tensors[name].grad
        # sums over every (query, key) pair (ALiBi's of |i - j| up to L): relative error
        errors[f"d{name}"] = (t.grad - full).abs().max() / full.abs().max().clamp(min=1)
    return {name: error.item() for name, error in errors.items()}


def _error_checks(rank: int, world: int) -> dict[str, str | None]:
    """Bad score or sinks arguments: each must raise on every rank, not hang."""
    q, k, v = (torch.randn(1, 2, 4, 4) for _ in range(3))
    return {
        "slopes of 3 heads": expect_error(
            lambda: ring_attention(q, k, v, score=ALiBi(torch.ones(3)))
        ),
        "sinks of 3 heads": expect_error(lambda: ring_attention(q, k, v, sinks=torch.zeros(3))),
        "not a score function": expect_error(lambda: ring_attention(q, k, v, score="alibi")),
        "score on rank 1 only": expect_error(
            lambda: ring_attention(q, k, v, score=ALiBi(torch.ones(2)) if rank else None)
        ),
        "sinks on rank 0 only": expect_error(
            lambda: ring_attention(q, k, v, sinks=None if rank else torch.zeros(2))
        ),
    }


def _gradcheck() -> bool:
    """gradcheck of the autograd Function in float64 with learned ALiBi slopes, softcap
    and sinks (one rank; the zigzag layout still merges two chunks)."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)

    def fn(q, k, v, slopes, sinks):
        return ring_attention(
            q, k, v, causal=True, layout="zigzag", sinks=sinks, score=[ALiBi(slopes), Softcap(3.0)]
        )

    inputs = (leaf(1, 2, 6, 4), leaf(1, 1, 6, 4), leaf(1, 1, 6, 4), leaf(2), leaf(2))
    return torch.autograd.gradcheck(fn, inputs)


def _worker(rank: int, world: int) -> dict:
    if world == 1:
        return {"gradcheck": _gradcheck()}
    cases = dict(CASES, **(LONG_CASES if world == 2 else {}))
    result = {"max": {name: _check_case(rank, world, case) for name, case in cases.items()}}
    result["errors"] = _error_checks(rank, world)
    return result


def _tolerance(name: str) -> float:
    return TOLERANCE if name in ("out", "dq", "dk", "dv") else PARAM_TOLERANCE


@functools.cache
def _results(world: int) -> list[dict]:
    return run_local(_worker, world, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 3))
def test_scores_and_sinks_match_single_process(world):
    for rank, result in enumerate(_results(world)):
        for name, errors in result["max"].items():
            bad = {k: e for k, e in errors.items() if not e <= _tolerance(k)}
            assert not bad, f"world {world}, rank {rank}, {name}: {bad}"
    assert set(LONG_CASES) <= set(_results(2)[0]["max"])


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 3))
def test_bad_score_or_sinks_raise_on_every_rank(world):
    expected = {
        "slopes of 3 heads": "ALiBi slopes have 3 heads",
        "sinks of 3 heads": "sinks must have shape (H,)",
        "not a score function": "score must be an mhsa.core.scores function",
        "score on rank 1 only": "the same score on every rank",
        "sinks on rank 0 only": "the same sinks on every rank",
    }
    for rank, result in enumerate(_results(world)):
        for name, text in expected.items():
            message = result["errors"][name]
            assert message is not None and text in message, (rank, name, message)


@pytest.mark.slow
def test_gradcheck_float64_with_scores_and_sinks():
    assert _results(1)[0]["gradcheck"]


def test_ring_backend_serves_scores_and_sinks():
    from mhsa.core.backends.registry import AttentionSpec, get

    spec = AttentionSpec.example(causal=True, has_score=True, has_sinks=True)
    with context_parallel():
        assert get("ring").supports(spec) is None
