"""Ring attention (mhsa.distributed) against single-process mhsa.attention on the whole
sequence, in real gloo groups of 1 to 4 CPU processes. One spawned group per world
size runs every case; the checks that need no group run in this process."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import mhsa
from helpers import expect_error
from mhsa.core.masks import BlockSparse, Causal, KeyPadding, SlidingWindow
from mhsa.distributed import blocks, ring_attention, run_local, shard, transfer, unshard
from mhsa.distributed import ring as ring_module

WORLD_SIZES = (1, 2, 3, 4)
TOLERANCE = 1e-5

# name: (layout, causal, window, key padding, heads, kv_heads, value_dim, chunk)
CASES = {
    "full": ("contiguous", False, None, False, 4, 4, 8, 3),
    "full, unfused kernel (D_v != D)": ("zigzag", False, None, False, 2, 2, 6, 3),
    "causal contiguous": ("contiguous", True, None, False, 4, 4, 8, 3),
    "causal zigzag": ("zigzag", True, None, False, 4, 4, 8, 3),
    "window contiguous": ("contiguous", False, (4, 2), False, 2, 2, 8, 3),
    "window zigzag": ("zigzag", False, (4, 2), False, 2, 2, 8, 3),
    "narrow window contiguous (skips ranks)": ("contiguous", False, (2, 1), False, 2, 2, 8, 3),
    "left window, key padding (skips ranks)": ("contiguous", False, (2, 0), True, 2, 2, 8, 3),
    "narrow causal window zigzag (skips ranks)": ("zigzag", True, (2, 0), False, 2, 2, 8, 3),
    "causal window zigzag": ("zigzag", True, (5, 0), False, 2, 2, 8, 3),
    "key padding": ("contiguous", False, None, True, 2, 2, 8, 3),
    "key padding, causal zigzag": ("zigzag", True, None, True, 2, 2, 8, 3),
    "gqa causal zigzag": ("zigzag", True, None, False, 4, 2, 8, 3),
    "mqa window contiguous": ("contiguous", False, (4, 2), True, 4, 1, 8, 3),
}
# longer chunks: several tiles per chunk, aligned (150 | 300) and not (263 is prime)
LONG_CASES = {
    "long window zigzag": ("zigzag", False, (200, 37), False, 2, 1, 8, 300),
    "long causal window, unaligned tiles": ("zigzag", True, (300, 0), True, 2, 2, 8, 263),
}


def _check_case(rank: int, world: int, spec: tuple) -> dict[str, float]:
    """Max abs errors of out, dq, dk, dv against mhsa.attention on the whole sequence."""
    layout, causal, window, padding, heads, kv_heads, value_dim, chunk = spec
    gen = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
    batch, head_dim = 2, 8
    length = chunk * world * (2 if layout == "zigzag" else 1)
    q = torch.randn(batch, heads, length, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, value_dim, generator=gen)
    grad = torch.randn(batch, heads, length, value_dim, generator=gen)
    keys = torch.rand(batch, length, generator=gen) > 0.3
    keys[1] = False  # a sequence with no real key: output 0, gradients 0
    mask = SlidingWindow(*window) if window else None
    full_mask = mask
    if padding:
        full_mask = KeyPadding(keys) if mask is None else mask & KeyPadding(keys)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = mhsa.attention(*leaves, full_mask, causal=causal)
    (expected * grad).sum().backward()

    local = [shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    out = ring_attention(
        *local,
        causal=causal,
        mask=mask,
        layout=layout,
        key_padding_mask=shard(keys, rank, world, layout, dim=1) if padding else None,
    )
    (out * shard(grad, rank, world, layout)).sum().backward()
    pairs = {"out": (out.detach(), expected)}
    for name, mine, full in zip(("dq", "dk", "dv"), local, leaves, strict=True):
        pairs[name] = (mine.grad, full.grad)
    return {
        name: (unshard(mine, world, layout) - full).abs().max().item()
        for name, (mine, full) in pairs.items()
    }


def _error_checks(rank: int, world: int) -> dict[str, str | None]:
    """Bad calls: each must raise on every rank, not hang."""

    def qkv(length: int, heads: int = 2):
        return [torch.randn(1, heads, length, 4) for _ in range(3)]

    return {
        "uneven": expect_error(lambda: ring_attention(*qkv(6 if rank == 0 else 4))),
        "bad layout": expect_error(lambda: ring_attention(*qkv(4), layout="zig-zag")),
        "bad layout on one rank": expect_error(
            lambda: ring_attention(*qkv(4), layout="zigzag" if rank else "ring")
        ),
        "odd zigzag": expect_error(lambda: ring_attention(*qkv(5), layout="zigzag")),
        "heads differ": expect_error(lambda: ring_attention(*qkv(4, 2 if rank else 4))),
        "dropout": expect_error(lambda: ring_attention(*qkv(4), dropout_p=0.1)),
        "masks differ": expect_error(
            lambda: ring_attention(*qkv(4), mask=SlidingWindow(2 + rank, 0))
        ),
        # the same repr, different content: compared by content, no deadlock
        "block layouts differ": expect_error(
            lambda: ring_attention(
                *qkv(4), mask=BlockSparse(torch.eye(2 * world, dtype=torch.bool) | (rank > 0), 2)
            )
        ),
    }


def _gradcheck(rank: int, world: int) -> bool:
    """torch.autograd.gradcheck of the autograd Function in float64 (one rank: the
    zigzag layout still splits the shard into two chunks and merges them)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(1, 1, 6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
        for _ in range(2)
    )

    def fn(q, k, v):
        return ring_attention(q, k, v, causal=True, mask=SlidingWindow(3, 1), layout="zigzag")

    return torch.autograd.gradcheck(fn, (q, k, v))


def _count_work(rank: int, world: int, layout: str, **kwargs) -> tuple[int, int]:
    """(ring transfers, blocks computed) by this rank in one forward."""
    counts = [0, 0]
    shift, forward = transfer.Ring.shift, ring_module.flash_forward

    def counting_shift(*args, **kw):
        counts[0] += 1
        return shift(*args, **kw)

    def counting_forward(*args, **kw):
        counts[1] += 1
        return forward(*args, **kw)

    transfer.Ring.shift, ring_module.flash_forward = counting_shift, counting_forward
    try:
        ring_attention(*(torch.randn(1, 1, 6, 4) for _ in range(3)), layout=layout, **kwargs)
    finally:
        transfer.Ring.shift, ring_module.flash_forward = shift, forward
    return counts[0], counts[1]


def _worker(rank: int, world: int) -> dict:
    result = {"errors": {}, "max": {}}
    result["work"] = {
        "causal contiguous": _count_work(rank, world, "contiguous", causal=True),
        "causal zigzag": _count_work(rank, world, "zigzag", causal=True),
        "left window": _count_work(rank, world, "contiguous", mask=SlidingWindow(2, 0)),
    }
    cases = dict(CASES, **(LONG_CASES if world == 2 else {}))
    for name, spec in cases.items():
        result["max"][name] = _check_case(rank, world, spec)
    if world >= 2:
        result["errors"] = _error_checks(rank, world)
    if world == 1:
        result["gradcheck"] = _gradcheck(rank, world)
    return result


@functools.cache
def _results(world: int) -> list[dict]:
    return run_local(_worker, world, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_single_process(world):
    results = _results(world)
    for name in CASES:
        for rank, result in enumerate(results):
            errors = result["max"][name]
            bad = {k: e for k, e in errors.items() if not e <= TOLERANCE}
            assert not bad, f"world {world}, rank {rank}, {name}: {bad}"


@pytest.mark.slow
def test_long_chunks_with_several_tiles():
    for result in _results(2):
        for name in LONG_CASES:
            errors = result["max"][name]
            assert max(errors.values()) <= TOLERANCE, (name, errors)


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 4))
def test_empty_blocks_and_out_of_reach_ranks_are_skipped(world):
    for rank, result in enumerate(_results(world)):
        work = result["work"]
        # contiguous causal: every shard travels, rank r computes only shards 0..r
        assert work["causal contiguous"] == (world - 1, rank + 1)
        # zigzag causal: per source rank 2 of its 4 chunk pairs (3 for its own shard)
        assert work["causal zigzag"] == (world - 1, 2 * world + 1)
        # window reaching back less than one shard: one transfer; rank 0 has no left
        # neighbour in reach (its wrapped-around predecessor holds the sequence's end)
        assert work["left window"] == (1, 1 if rank == 0 else 2)


@pytest.mark.slow
def test_gradcheck_float64():
    assert _results(1)[0]["gradcheck"]


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 3))
def test_bad_calls_raise_on_every_rank(world):
    expected = {
        "uneven": "uneven shard sizes",
        "bad layout": "layout must be one of",
        "bad layout on one rank": "on rank 0: layout must be one of",
        "odd zigzag": "even shard length",
        "heads differ": "q shapes differ across ranks",
        "dropout": "dropout is not supported",
        "masks differ": "the same mask on every rank",
        "block layouts differ": "the same mask on every rank (compared by content)",
    }
    for rank, result in enumerate(_results(world)):
        for name, text in expected.items():
            message = result["errors"][name]
            assert message is not None and text in message, (rank, name, message)


def _sleep(rank: int, world: int) -> None:
    time.sleep(60)


@pytest.mark.slow
def test_run_local_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_local(_sleep, 1, timeout=3)
    assert time.monotonic() - start < 30


def _tensor(rank: int, world: int) -> torch.Tensor:
    return torch.full((3, 5), float(rank))


@pytest.mark.slow
def test_run_local_returns_tensors_by_value():
    for _ in range(3):
        results = run_local(_tensor, 2, timeout=60)
        assert [r.tolist() for r in results] == [[[0.0] * 5] * 3, [[1.0] * 5] * 3]


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("bad argument on rank 1")
    torch.distributed.barrier()  # rank 0 then fails only because rank 1 left


@pytest.mark.slow
def test_run_local_reports_the_rank_that_failed_first():
    with pytest.raises(RuntimeError, match="rank 1 failed first") as info:
        run_local(_fail_on_rank_1, 2, timeout=60)
    assert "ValueError: bad argument on rank 1" in str(info.value)


@pytest.mark.slow
def test_ring_benchmark_quick():
    from mhsa.benchmarks import ring

    rows = ring.run(nproc=2, quick=True)
    assert [row["mode"] for row in rows] == ["single", "ring"]
    assert rows[1]["shard_len"] == rows[0]["length"] // 2
    assert rows[1]["memory_ratio"] > 0 and rows[1]["time_ratio"] > 0
    assert "ring, 2 ranks, zigzag" in ring.report(rows)
    # 3 ranks: 2048 is no multiple of 6 (it was refused naming no flag): rounded up
    rows = ring.run(nproc=3, quick=True)
    assert rows[1]["length"] == 2052 and rows[1]["shard_len"] == 684


# no process group needed ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.arange(2 * 3 * 24 * 2).view(2, 3, 24, 2)
    shards = [shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, 24 // world, 2) for s in shards)
    assert torch.equal(unshard(shards, world, layout), x)
    positions = torch.arange(24).view(1, 24)
    pieces = [shard(positions, r, world, layout, dim=1) for r in range(world)]
    assert torch.equal(unshard(pieces, world, layout, dim=1), positions)


def test_zigzag_holds_chunk_r_and_its_mirror():
    positions = torch.arange(8)
    assert shard(positions, 0, 2, "zigzag", dim=0).tolist() == [0, 1, 6, 7]
    assert shard(positions, 1, 2, "zigzag", dim=0).tolist() == [2, 3, 4, 5]


def test_shard_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        shard(torch.zeros(1, 1, 6, 2), 0, 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(torch.zeros(1, 1, 6, 2), 0, 2, "striped")
    with pytest.raises(ValueError, match="rank must be in"):
        shard(torch.zeros(1, 1, 6, 2), 2, 2)


def test_ring_attention_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(*(torch.randn(1, 1, 4, 4) for _ in range(3)))


def _schedule(world, layout, pattern, chunk=8):
    total = chunk * world * (2 if layout == "zigzag" else 1)
    return blocks.visit_order(world, layout, pattern.block_layout(total, total, chunk), 1)


def test_sliding_window_visits_only_ranks_in_reach():
    # chunk 8: a left reach of 8 needs the previous rank only; right 8 the next one too
    assert _schedule(8, "contiguous", SlidingWindow(8, 0)) == [0, 7]
    assert _schedule(8, "contiguous", SlidingWindow(8, 8)) == [0, 7, 1]
    assert _schedule(8, "contiguous", SlidingWindow(9, 3)) == [0, 7, 6, 1]
    # zigzag: chunk r needs chunk r-1 (rank r-1), chunk 2P-1-r needs 2P-2-r (rank r+1)
    assert _schedule(4, "zigzag", SlidingWindow(8, 0)) == [0, 3, 1]
    # causal alone needs every rank
    assert _schedule(4, "zigzag", Causal()) == [0, 3, 2, 1]


@pytest.mark.parametrize("q_start, k_start, block", [(16, 8, 8), (10, 30, 8), (0, 40, 5)])
def test_block_mask_is_the_global_pattern_seen_from_the_block(q_start, k_start, block):
    total, chunk = 64, 12
    pattern = Causal() & SlidingWindow(9, 2)

    def kinds(bq, bk):
        return pattern.block_layout(total, total, bq, bk)

    keys = torch.rand(2, chunk) > 0.3
    local = blocks.BlockMask(pattern, q_start, k_start, total, keys, block, kinds)
    expected = pattern.dense(total, total)[q_start : q_start + chunk, k_start : k_start + chunk]
    expected = expected & keys.view(2, 1, 1, chunk)
    dense = local.dense(chunk, chunk)
    assert torch.equal(dense.expand_as(expected), expected)
    layout = local.block_layout(chunk, chunk, block)
    for qi, row in enumerate(layout.tolist()):
        for kj, kind in enumerate(row):
            tile = dense[..., qi * block : (qi + 1) * block, kj * block : (kj + 1) * block]
            if kind == 0:
                assert not tile.any()
            elif kind == 2:
                assert tile.all()
