"""The continuous-batching scheduler (mhsa.apps.serve.scheduler) without a model or a tensor:
admission when the pool is full, chunked prefill under a token budget (a short prompt
is not held behind a long one's prefill, decodes are never held back, the long one
still finishes), cancellation, preemption when blocks run out and the preempted
request's resumption. A pool of block counts stands for the PagedKVCache, and a loop
that writes each plan's chunks into it stands for the Runner. Every loop over steps is
bounded (_steps): a scheduler that never ends its requests (one that does not free a
finished request's blocks, say) fails the test that runs it instead of hanging."""

from __future__ import annotations

import ast
import math
import random
import sys
from collections.abc import Iterator
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
    for chunk in [*plan.decoding, *plan.prefills]:
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


def _steps(limit: int = 500) -> Iterator[int]:
    """range(limit) for a loop over scheduling steps that must break out before its end:
    past it, the test fails (the scheduler does not finish its requests) and says so."""
    yield from range(limit)
    raise AssertionError(f"still not done after {limit} steps: the scheduler did not finish")


def _serve(scheduler: Scheduler, requests: list[Request], steps: int = 1000) -> list[Plan]:
    for request in requests:
        scheduler.add(request)
    plans = []
    for _ in _steps(steps):
        plan = scheduler.schedule()
        if plan.empty and scheduler.idle:
            assert not scheduler.pool.lengths, "the ended requests' blocks were not freed"
            return plans
        plans.append(plan)
        _run(scheduler, plan)
    raise AssertionError("unreachable")


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
    """Room for one large request at a time ("reserve"): each needs 3 of the 4 blocks at
    its longest, so the second is admitted only after the first ends. The third (1 block)
    fits beside the first now and beside the second's reservation, so it runs at once."""
    pool = _Pool(num_blocks=4, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8)
    requests = [_request(0, 5, 6), _request(1, 7, 4), _request(2, 2, 2)]  # 3, 3, 1 blocks
    running_at_once = []
    for request in requests:
        scheduler.add(request)
    for _ in _steps():
        if scheduler.idle:
            break
        plan = scheduler.schedule()
        running_at_once.append([r.id for r in scheduler.running])
        assert not plan.preempted
        _run(scheduler, plan)
    # the third (1 block) joins the first: 3 + 1 blocks fit; never the first and second
    assert [0, 1] not in running_at_once and running_at_once[0] == [0, 2]
    last_of_first = max(i for i, ids in enumerate(running_at_once) if 0 in ids)
    assert running_at_once[last_of_first + 1] == [1]  # the second, as soon as it fits
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
    for _ in _steps():
        if long.output:
            break
        plans.append(scheduler.schedule())
        _run(scheduler, plans[-1], fed)
    assert len(plans) == 7  # 100 tokens in chunks of 16
    for plan in plans:  # each step: short's one token, one chunk of long's prompt
        assert [chunk.request for chunk in plan.decoding] == [short]
        assert [chunk.request for chunk in plan.prefills] == [long]
        assert plan.prefills[0].samples == (plan is plans[-1])
    assert [len(chunk) for chunk in fed[1]] == [16] * 6 + [4]
    assert sum(fed[1], []) == long.prompt
    assert fed[0] == [short.prompt] + [[token] for token in short.output[:7]]


def _prefills(plan: Plan) -> list[tuple[int, int, bool]]:
    """(request id, tokens, samples) of each prefill chunk of plan, in its order."""
    return [(c.request.id, len(c.tokens), c.samples) for c in plan.prefills]


def test_a_short_prompt_behind_a_long_prefill_is_prefilled_in_the_next_step():
    """The step after a 4-token prompt comes, its chunk runs first, beside a chunk of the
    100-token prompt being prefilled (16 tokens between them); then the long prompt
    goes on in chunks while the short one decodes, and both answer as alone."""
    pool = _Pool(num_blocks=64, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=16)
    long, short = _request(0, 100, 3), _request(1, 4, 5)
    scheduler.add(long)
    plan = scheduler.schedule()
    assert _prefills(plan) == [(0, 16, False)]
    _run(scheduler, plan)
    scheduler.add(short)
    plan = scheduler.schedule()
    # long, the oldest, gets half the budget first; short all it needs; long the rest
    assert _prefills(plan) == [(1, 4, True), (0, 12, False)]
    _run(scheduler, plan)
    assert len(short.output) == 1
    plans = _serve(scheduler, [])
    assert all(sum(n for _, n, _ in _prefills(p)) <= 16 for p in plans)
    assert [c.request for c in plans[0].decoding] == [short]
    assert _prefills(plans[0]) == [(0, 16, False)]  # the whole budget again
    for request in (long, short):
        assert request.finish_reason == "length" and request.output == _alone(request)


def test_a_short_prompt_behind_four_long_ones_runs_at_once():
    """Two 100-token prompts run, two more wait for blocks (max_wait 0: they hold a
    reservation at once); a 4-token prompt fits now and beside the next long one, so it
    is admitted and prefilled in the next step, ahead of the long chunks; the longs
    still all finish, the waiting ones as blocks free up."""
    pool = _Pool(num_blocks=60, block_size=4)  # 26 blocks a long request: room for two
    scheduler = Scheduler(pool, max_batch=8, prefill_chunk=16)
    longs = [_request(i, 100, 4) for i in range(4)]
    for request in longs:
        scheduler.add(request)
    _run(scheduler, scheduler.schedule())
    assert scheduler.running == longs[:2] and list(scheduler.waiting) == longs[2:]
    short = _request(4, 4, 4)
    scheduler.add(short)
    plan = scheduler.schedule()
    assert scheduler.running == [*longs[:2], short]
    # short first, then the rest of the 16 to the long one with the least left
    assert _prefills(plan) == [(4, 4, True), (0, 12, False)]
    _run(scheduler, plan)
    assert len(short.output) == 1
    _serve(scheduler, [])
    for request in (*longs, short):
        assert request.finish_reason == "length" and request.output == _alone(request)
    assert pool.free_blocks == 60


def test_each_step_keeps_the_prefill_budget_and_decodes_every_decoding_request():
    """Twenty requests of random sizes arriving over time, five at a time: each step
    feeds every decoding request one token, at most one chunk a request, and
    prefill_chunk tokens of prefill at most (exactly that many, or all there is)."""
    rng = random.Random(0)
    pool = _Pool(num_blocks=200, block_size=4)
    scheduler = Scheduler(pool, max_batch=5, prefill_chunk=16)
    requests = [_request(i, rng.randint(1, 80), rng.randint(1, 12)) for i in range(20)]
    arrivals = {i * 3: [request] for i, request in enumerate(requests)}
    for step in _steps():
        for request in arrivals.get(step, []):
            scheduler.add(request)
        if scheduler.idle and step > max(arrivals):
            break
        decoding = [r for r in scheduler.running if r.decoding]
        plan = scheduler.schedule()
        assert [c.request for c in plan.decoding] == decoding
        assert all(len(c.tokens) == 1 for c in plan.decoding)
        assert len(plan.requests) == len(set(plan.requests))
        prefill = sum(len(c.tokens) for c in plan.prefills)
        waiting = sum(r.context_length - r.computed for r in scheduler.running if not r.decoding)
        assert prefill == min(16, prefill + waiting)
        _run(scheduler, plan)
    for request in requests:
        assert request.finish_reason == "length" and request.output == _alone(request)
    assert pool.free_blocks == 200


def test_a_long_prefill_goes_on_under_a_stream_of_short_prompts():
    """A 16-token prompt every step would take the whole budget if shortest first were
    all: the oldest prefilling request's equal share (16 over the number prefilling,
    at most 8) keeps the 200-token prompt going at 2 tokens a step or more."""
    pool = _Pool(num_blocks=400, block_size=4)
    scheduler = Scheduler(pool, max_batch=8, prefill_chunk=16)
    long = _request(0, 200, 2)
    scheduler.add(long)
    shorts = []
    for step in _steps(150):
        if long.output:
            break
        shorts.append(_request(step + 1, 16, 2))
        scheduler.add(shorts[-1])
        before = long.computed
        plan = scheduler.schedule()
        prefilling = len(scheduler.running) - len(plan.decoding)
        assert long.computed - before >= min(200 - before, math.ceil(16 / prefilling))
        _run(scheduler, plan)
    _serve(scheduler, [])
    for request in (long, *shorts):
        assert request.finish_reason == "length" and request.output == _alone(request)


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
    for _ in _steps(100):
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
    # prefill chunks: later's 2-token prompt shares the first step's 8 tokens, first
    assert [len(chunk) for chunk in resumed[:2]] == [6, context - 6]
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


def test_a_request_passes_one_that_has_waited_max_wait_only_if_both_fit():
    """Admission by fit: a small request passes a large one that waits for room; once the
    large one has waited max_wait it holds a reservation: a request passes it only if
    they fit in the pool together, so it takes none of the blocks the large one waits
    for, and the large one runs as soon as the request that was running ends."""
    pool = _Pool(num_blocks=6, block_size=4)
    clock = _Clock()
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8, max_wait=5.0, clock=clock)
    first, large = _request(0, 5, 7), _request(1, 12, 8)  # 3 and 5 blocks
    scheduler.add(first)
    scheduler.add(large)
    _run(scheduler, scheduler.schedule())
    assert scheduler.running == [first] and list(scheduler.waiting) == [large]
    small = _request(2, 4, 4)  # 2 blocks: fits beside first
    scheduler.add(small)
    _run(scheduler, scheduler.schedule())
    assert scheduler.running == [first, small] and list(scheduler.waiting) == [large]
    for _ in _steps():
        if small not in scheduler.running:
            break
        _run(scheduler, scheduler.schedule())
    clock.now = 5.0  # large has waited max_wait
    wide, narrow = _request(3, 4, 4), _request(4, 2, 2)  # 2 blocks (2 + 5 > 6), 1 (1 + 5)
    scheduler.add(wide)
    scheduler.add(narrow)
    plan = scheduler.schedule()
    assert scheduler.running == [first, narrow]  # wide fits now, but not beside large
    assert list(scheduler.waiting) == [large, wide]
    running_at_once = []
    for _ in _steps():
        _run(scheduler, plan)
        if scheduler.idle:
            break
        plan = scheduler.schedule()
        running_at_once.append([r.id for r in scheduler.running])
    ended = next(i for i, ids in enumerate(running_at_once) if 0 not in ids)
    assert 1 in running_at_once[ended]  # large, in the step after first ended
    assert all(3 not in ids for ids in running_at_once[:ended])
    for request in (first, large, small, wide, narrow):
        assert request.finish_reason == "length" and request.output == _alone(request)
    assert pool.free_blocks == 6


def test_with_max_wait_0_a_request_passes_a_waiting_one_only_if_both_fit():
    """max_wait 0 (the default): a request that does not fit holds a reservation at once;
    of two 1-block requests behind it, the first fits beside it (1 + 4 of 5 blocks) and
    runs beside the first request, the second would not (1 + 1 + 4) and waits."""
    pool = _Pool(num_blocks=5, block_size=4)
    scheduler = Scheduler(pool, max_batch=4, prefill_chunk=8)
    for request in (_request(0, 5, 6), _request(1, 7, 9), _request(2, 2, 2), _request(3, 2, 2)):
        scheduler.add(request)  # 3, 4, 1 and 1 blocks
    scheduler.schedule()
    assert [r.id for r in scheduler.running] == [0, 2]
    assert [r.id for r in scheduler.waiting] == [1, 3]


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


@pytest.mark.parametrize(("block_size", "shared"), [(8, True), (6, False)])
def test_with_chunk_multiple_prefill_chunks_end_on_its_multiples(block_size, shared):
    """MoBA's answer depends on where its prefill calls start: with chunk_multiple 4 every
    chunk but a prompt's last ends at a multiple of 4, under budget shares that are not
    (3 prompts sharing 10 tokens), and past the budget where a share is too small; the
    prefix cache is shared only when its blocks are whole multiples of 4."""
    scheduler = Scheduler(
        _Pool(num_blocks=200, block_size=block_size),
        max_batch=4,
        prefill_chunk=10,
        chunk_multiple=4,
    )
    assert scheduler.share_prefixes == shared
    fed = {}
    requests = [_request(0, 37, 3), _request(1, 23, 4), _request(2, 2, 5)]
    for request in requests:
        scheduler.add(request)
    for _ in _steps(300):
        plan = scheduler.schedule()
        if plan.empty and scheduler.idle:
            break
        _run(scheduler, plan, fed)
    for request in requests:
        assert request.output == _alone(request)
        prompt_chunks = [len(c) for c in fed[request.id]][: -request.max_tokens + 1 or None]
        ends = [sum(prompt_chunks[: i + 1]) for i in range(len(prompt_chunks))]
        assert ends[-1] == len(request.prompt)
        assert all(end % 4 == 0 for end in ends[:-1]), (request.id, prompt_chunks)
    with pytest.raises(ValueError, match="chunk_multiple must be an int >= 1"):
        Scheduler(_Pool(4), max_batch=1, prefill_chunk=4, chunk_multiple=0)
