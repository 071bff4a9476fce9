"""The continuous-batching scheduler (mhsa.apps.serve.scheduler) without a model or a tensor:
admission when the pool is full, chunked prefill, cancellation, preemption when blocks
run out and the preempted request's resumption. A pool of block counts stands for the
PagedKVCache, and a loop that writes each plan's chunks into it stands for the Runner."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import pytest

from mhsa.apps.serve import scheduler as scheduler_module
from mhsa.apps.serve.scheduler import Plan, Request, Scheduler


class _Pool:
    """A BlockPool of counts: each sequence's length and blocks, no prefix cache.
    write() takes the blocks a chunk needs, as PagedKVCache.batch does, and refuses
    to overfill the pool."""

    def __init__(self, num_blocks: int, block_size: int = 4) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.lengths: dict[int, int] = {}
        self.blocks: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self._next = 0

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.blocks.values())

    def add_sequence(self, tokens, *, salt: bytes = b"") -> int:
        seq, self._next = self._next, self._next + 1
        self.lengths[seq], self.blocks[seq], self.tokens[seq] = 0, 0, list(tokens)
        return seq

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def block_table(self, seq: int) -> list[int]:
        return [seq] * self.blocks[seq]  # (only its length matters here)

    def blocks_needed(self, seq: int, new_tokens: int) -> int:
        return math.ceil((self.lengths[seq] + new_tokens) / self.block_size) - self.blocks[seq]

    def free(self, seq: int) -> None:
        del self.lengths[seq], self.blocks[seq], self.tokens[seq]

    def write(self, seq: int, new_tokens: int) -> None:
        needed = self.blocks_needed(seq, new_tokens)
        assert needed <= self.free_blocks, "the plan overfills the pool"
        self.blocks[seq] += needed
        self.lengths[seq] += new_tokens


def _next_token(context: list[int]) -> int:
    """The stand-in model: the next token follows from the whole context."""
    return (sum(context) * 7 + len(context)) % 50


def _run(scheduler: Scheduler, plan: Plan, fed: dict | None = None) -> None:
    """The runner's part: write each chunk into the pool, give each chunk that ends
    its request's context the next token, end requests at max_tokens."""
    pool = scheduler.pool
    for chunk in [*plan.decode, *([plan.prefill] if plan.prefill else [])]:
        request = chunk.request
        pool.write(request.seq, len(chunk.tokens))
        if fed is not None:
            fed.setdefault(request.id, []).append(list(chunk.tokens))
        if chunk.samples:
            request.output.append(_next_token(request.prompt + request.output))
            if len(request.output) == request.max_tokens:
                scheduler.finish(request, "length")


def _request(id_: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(id_, [(id_ * 13 + i) % 50 for i in range(prompt_len)], max_tokens)


def _alone(request: Request) -> list[int]:
    context = list(request.prompt)
    for _ in range(request.max_tokens):
        context.append(_next_token(context))
    return context[len(request.prompt) :]


def _serve(scheduler: Scheduler, requests: list[Request], steps: int = 1000) -> list[Plan]:
    for request in requests:
        scheduler.add(request)
    plans = []
    for _ in range(steps):
        plan = scheduler.schedule()
        if plan.empty and scheduler.idle:
            return plans
        plans.append(plan)
        _run(scheduler, plan)
    raise AssertionError("the scheduler did not finish its requests")


def test_the_scheduler_module_imports_only_the_standard_library():
    """No torch (so no tensor), nor any part of mhsa that holds one."""
    tree = ast.parse(Path(scheduler_module.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert imported and not relative
    assert all(name.split(".")[0] in sys.stdlib_module_names for name in imported), imported


def test_admission_waits_while_the_pool_is_spoken_for():
    """Room for one request at a time ("reserve"): each needs 3 of the 4 blocks at its
    longest, so the second is admitted only after the first ends."""
    pool = _Pool(num_blocks=4, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8)
    requests = [_request(0, 5, 6), _request(1, 7, 4), _request(2, 2, 2)]  # 3, 3, 1 blocks
    running_at_once = []
    for request in requests:
        scheduler.add(request)
    while not scheduler.idle:
        plan = scheduler.schedule()
        running_at_once.append([r.id for r in scheduler.running])
        assert not plan.preempted
        _run(scheduler, plan)
    # the third (1 block) joins the second: 3 + 1 blocks fit; never the first and second
    assert [0, 1] not in running_at_once and [1, 2] in running_at_once
    assert running_at_once[0] == [0] and running_at_once.index([1, 2]) > 0
    for request in requests:
        assert request.finish_reason == "length" and request.output == _alone(request)
    assert pool.free_blocks == 4


def test_admission_stops_at_max_batch():
    pool = _Pool(num_blocks=100)
    scheduler = Scheduler(pool, max_batch=2, prefill_chunk=16)
    requests = [_request(i, 3, 5) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    scheduler.schedule()
    assert [r.id for r in scheduler.running] == [0, 1]
    assert [r.id for r in scheduler.waiting] == [2, 3, 4]


def test_a_long_prompt_is_prefilled_in_chunks_while_another_decodes():
    pool = _Pool(num_blocks=64, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=16)
    short, long = _request(0, 4, 30), _request(1, 100, 3)
    scheduler.add(short)
    fed: dict[int, list[list[int]]] = {}
    _run(scheduler, scheduler.schedule(), fed)  # short's prompt and first token
    scheduler.add(long)
    plans = []
    while not long.output:
        plans.append(scheduler.schedule())
        _run(scheduler, plans[-1], fed)
    assert len(plans) == 7  # 100 tokens in chunks of 16
    for plan in plans:  # each step: short's one token, one chunk of long's prompt
        assert [chunk.request for chunk in plan.decode] == [short]
        assert plan.prefill.request is long
        assert plan.prefill.samples == (plan is plans[-1])
    assert [len(chunk) for chunk in fed[1]] == [16] * 6 + [4]
    assert sum(fed[1], []) == long.prompt
    assert fed[0] == [short.prompt] + [[token] for token in short.output[:7]]


def test_cancellation_ends_running_and_waiting_requests_and_frees_their_blocks():
    pool = _Pool(num_blocks=8, block_size=4)
    scheduler = Scheduler(pool, max_batch=1, prefill_chunk=16)
    running, waiting = _request(0, 6, 10), _request(1, 3, 4)
    scheduler.add(running)
    scheduler.add(waiting)
    _run(scheduler, scheduler.schedule())
    assert pool.free_blocks < 8 and scheduler.running == [running]
    scheduler.cancel(running)
    scheduler.cancel(waiting)
    plan = scheduler.schedule()
    assert plan.ended == [running, waiting] and plan.empty
    assert running.finish_reason == waiting.finish_reason == "cancelled"
    assert scheduler.idle and pool.free_blocks == 8 and not pool.lengths
    scheduler.cancel(running)  # an ended request stays as it ended
    assert scheduler.schedule().ended == [] and not scheduler.finish(running, "error")


def test_preemption_when_blocks_run_out_and_resumption_from_prompt_and_output():
    """ "optimistic" admits both requests at once; as they decode the pool runs out,
    the newer one is preempted (its blocks given back), waits at the head of the
    queue (before a request that came later), and is prefilled again from its prompt
    and the tokens it had generated, then decodes on."""
    pool = _Pool(num_blocks=6, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8, admission="optimistic")
    old, new = _request(0, 6, 12), _request(1, 5, 10)  # 18 and 15 tokens: 5 + 4 blocks
    later = _request(2, 2, 2)
    scheduler.add(old)
    scheduler.add(new)
    fed: dict[int, list[list[int]]] = {}
    generated, admitted = None, []
    for _ in range(100):
        plan = scheduler.schedule()
        if generated is not None:
            admitted.append([r.id for r in scheduler.running])
        if plan.preempted:
            assert plan.preempted == [new] and generated is None
            assert new.seq is None and new.computed == 0 and new.preemptions == 1
            assert list(scheduler.waiting) == [new] and scheduler.running == [old]
            generated, mark = list(new.output), len(fed[1])
            scheduler.add(later)
        if plan.empty and scheduler.idle:
            break
        _run(scheduler, plan, fed)
    assert generated  # it had decoded before it was preempted
    resumed = fed[1][mark:]
    context = len(new.prompt) + len(generated)
    assert [len(chunk) for chunk in resumed[:2]] == [8, context - 8]  # prefill chunks
    assert sum(resumed[:2], []) == new.prompt + generated
    assert all(len(chunk) == 1 for chunk in resumed[2:])  # then decoding
    with_later = next(ids for ids in admitted if 2 in ids)  # admitted in order, new first
    assert with_later.index(1) < with_later.index(2) and fed[2][0] == later.prompt
    for request in (old, new, later):
        assert request.finish_reason == "length" and request.output == _alone(request)
    assert pool.free_blocks == 6 and not pool.lengths


def test_reserve_admission_never_preempts_the_same_load():
    pool = _Pool(num_blocks=6, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8)
    requests = [_request(0, 6, 12), _request(1, 5, 10), _request(2, 2, 2)]
    plans = _serve(scheduler, requests)
    assert not any(plan.preempted for plan in plans)
    assert all(r.output == _alone(r) and r.preemptions == 0 for r in requests)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_batch": 0, "prefill_chunk": 4}, "max_batch must be an int >= 1, got 0"),
        ({"max_batch": 1, "prefill_chunk": True}, "prefill_chunk must be an int >= 1"),
        ({"max_batch": 1, "prefill_chunk": 4, "admission": "greedy"}, "admission must be one of"),
    ],
)
def test_bad_settings_say_what_to_fix(options, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(_Pool(4), **options)


def test_a_request_larger_than_the_pool_is_refused():
    scheduler = Scheduler(_Pool(num_blocks=2, block_size=16), max_batch=1, prefill_chunk=4)
    with pytest.raises(ValueError, match="needs 3 cache blocks, the pool has 2"):
        scheduler.add(_request(0, 40, 8))
    assert scheduler.idle


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_small_request_passes_one_that_does_not_fit_until_that_one_has_waited_max_wait():
    """Admission by fit: a 1-block request passes a 3-block one that waits for room, but
    once the 3-block one has waited max_wait nothing passes it, and it runs next."""
    pool = _Pool(num_blocks=4, block_size=4)
    clock = _Clock()
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8, max_wait=5.0, clock=clock)
    first, large = _request(0, 5, 6), _request(1, 7, 4)  # 3 blocks each
    scheduler.add(first)
    scheduler.add(large)
    scheduler.schedule()
    assert scheduler.running == [first] and list(scheduler.waiting) == [large]
    small = _request(2, 2, 2)  # 1 block: fits beside first
    scheduler.add(small)
    _run(scheduler, scheduler.schedule())
    assert scheduler.running == [first, small] and list(scheduler.waiting) == [large]
    while small in scheduler.running:
        _run(scheduler, scheduler.schedule())
    clock.now = 5.0  # large has waited max_wait: another small one no longer passes it
    later = _request(3, 2, 2)
    scheduler.add(later)
    admitted = []
    while not scheduler.idle:
        plan = scheduler.schedule()
        admitted.extend(r.id for r in scheduler.running if r.id not in admitted)
        _run(scheduler, plan)
    assert admitted.index(1) < admitted.index(3)
    for request in (first, large, small, later):
        assert request.finish_reason == "length" and request.output == _alone(request)
    assert pool.free_blocks == 4


def test_first_come_first_served_when_max_wait_is_0():
    pool = _Pool(num_blocks=4, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8)  # (max_wait 0: the default)
    for request in (_request(0, 5, 6), _request(1, 7, 4), _request(2, 2, 2)):
        scheduler.add(request)
    scheduler.schedule()
    assert [r.id for r in scheduler.running] == [0]
    assert [r.id for r in scheduler.waiting] == [1, 2]


def test_no_request_holds_more_than_max_share_of_the_pool():
    scheduler = Scheduler(_Pool(num_blocks=8, block_size=4), max_batch=2, prefill_chunk=4)
    scheduler.add(_request(0, 20, 12))  # 8 blocks: the whole pool
    shared = Scheduler(
        _Pool(num_blocks=8, block_size=4), max_batch=2, prefill_chunk=4, max_share=0.5
    )
    with pytest.raises(ValueError, match="needs 8 cache blocks, the pool has 4 a request may"):
        shared.add(_request(0, 20, 12))
    shared.add(_request(1, 10, 6))  # 4 blocks
    assert len(shared.waiting) == 1


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_share": 0}, "max_share must be in"),
        ({"max_share": 1.5}, "max_share must be in"),
        ({"max_wait": -1}, "max_wait must be a number of seconds >= 0"),
    ],
)
def test_bad_share_or_wait_say_what_to_fix(options, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(_Pool(4), max_batch=1, prefill_chunk=4, **options)
