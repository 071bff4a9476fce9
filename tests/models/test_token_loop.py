"""The one decoding loop (mhsa.models.sampling.token_loop): its choices, the rows that
end before the others, its end, speculative passes, and what a sequence outputs."""

from __future__ import annotations

import pytest
import torch

from mhsa.models.sampling import (
    GREEDY,
    Choice,
    Sampling,
    StopRule,
    accept_draft,
    output_tokens,
    sample_and_stop,
    token_loop,
)


def scripted(rows: list[list[int]], vocab: int = 8):
    """A step whose t-th call returns logits peaking at rows[t] (one token per row), and
    the tokens it was fed."""
    fed: list[list[int]] = []

    def step(tokens):
        assert tokens.shape == (len(rows[0]), 1)
        fed.append(tokens.view(-1).tolist())
        return torch.nn.functional.one_hot(torch.tensor(rows[len(fed)]), vocab).float()

    first = torch.nn.functional.one_hot(torch.tensor(rows[0]), vocab).float()
    return first, step, fed


def stepping_through(logits: list, sampling: Sampling, stop: StopRule, seed: int):
    """token_loop over the given logits, one a step, sampled with a generator of seed."""
    calls = iter(logits[1:])
    generator = torch.Generator().manual_seed(seed)
    return token_loop(logits[0], sampling, stop, step=lambda _: next(calls), generator=generator)


def test_rows_that_end_repeat_the_first_stop_token_until_all_have_ended():
    first, step, fed = scripted([[1, 2, 3], [7, 2, 4], [5, 6, 0], [4, 7, 4], [1, 1, 1]])
    stop = StopRule((7, 0), max_tokens=10)
    choices = list(token_loop(first, GREEDY, stop, step=step))
    assert [c.tokens.tolist() for c in choices] == [[1, 2, 3], [7, 2, 4], [7, 6, 0], [7, 7, 7]]
    assert [c.stopped.tolist() for c in choices] == [
        [False, False, False],
        [True, False, False],
        [True, False, True],
        [True, True, True],
    ]
    assert fed == [[1, 2, 3], [7, 2, 4], [7, 6, 0]]  # ended rows fed the fill; none after
    assert choices[-1].ends_all() and not choices[-1].last
    assert [c.ends(1) for c in choices] == [False, False, False, True]


def test_the_loop_ends_when_every_row_has_stopped_or_at_max_tokens():
    first, step, fed = scripted([[1, 2], [7, 3], [5, 7], [4, 4]])
    choices = list(token_loop(first, GREEDY, StopRule((7,), max_tokens=10), step=step))
    assert [c.tokens.tolist() for c in choices] == [[1, 2], [7, 3], [7, 7]]
    assert choices[-1].ends_all() and not choices[-1].last
    assert fed == [[1, 2], [7, 3]]
    first, step, fed = scripted([[1, 2], [3, 3], [5, 5]])
    choices = list(token_loop(first, GREEDY, StopRule((7,), max_tokens=2), step=step))
    assert len(choices) == 2 and choices[-1].last and choices[-1].ends_all()
    assert list(token_loop(first, GREEDY, StopRule((7,), max_tokens=0), step=step)) == []


def test_one_row_ends_at_its_stop_token_and_without_stop_tokens_at_max_tokens():
    first, step, _ = scripted([[1], [7], [2]])
    assert [int(c.tokens) for c in token_loop(first, GREEDY, StopRule((7,), 5), step=step)] == [
        1,
        7,
    ]
    first, step, _ = scripted([[1], [7], [2]])
    choices = list(token_loop(first, GREEDY, StopRule((), 3), step=step))
    assert [int(c.tokens) for c in choices] == [1, 7, 2] and choices[-1].stopped is None


def test_each_choice_is_sample_and_stops_with_the_same_generator():
    torch.manual_seed(0)
    logits = [torch.randn(3, 50) for _ in range(6)]
    sampling, stop = Sampling(0.8, top_k=20), StopRule((), max_tokens=6)
    got = stepping_through(logits, sampling, stop, seed=3)
    generator = torch.Generator().manual_seed(3)
    for n, choice in enumerate(got):
        want = sample_and_stop(logits[n], sampling, stop, generated=n, generator=generator)
        assert torch.equal(choice.tokens, want.tokens) and choice.last == want.last
    assert n == 5


def test_verify_takes_accept_drafts_choices_and_no_drafts_equal_plain_steps():
    torch.manual_seed(1)
    logits = [torch.randn(1, 30) for _ in range(8)]
    sampling, stop = Sampling(1.0), StopRule((), max_tokens=8)
    plain = stepping_through(logits, sampling, stop, seed=5)
    seen = []

    def verify(taken, generated):
        seen.append((len(taken), generated))
        return logits[generated], [], None

    drafted = token_loop(
        logits[0], sampling, stop, verify=verify, generator=torch.Generator().manual_seed(5)
    )
    assert [int(c.tokens) for c in plain] == [int(c.tokens) for c in drafted]
    assert seen == [(1, n) for n in range(1, 8)]


def test_drafts_that_stand_come_as_one_choice_each():
    # greedy: the target's argmax at each position is 3, 4, then 6 after the drafts
    rows = torch.nn.functional.one_hot(torch.tensor([3, 4, 6]), 10).float()
    calls = []

    def verify(taken, generated):
        calls.append(([int(c.tokens) for c in taken], generated))
        return rows, [3, 4], None

    first = torch.nn.functional.one_hot(torch.tensor([2]), 10).float()
    choices = list(token_loop(first, GREEDY, StopRule((), 4), verify=verify))
    assert [int(c.tokens) for c in choices] == [2, 3, 4, 6]
    assert calls == [([2], 1)] and choices[-1].last
    want = accept_draft(rows, [3, 4], GREEDY, StopRule((), 4), generated=1)
    assert [int(c.tokens) for c in want] == [3, 4, 6]


def test_token_loop_takes_exactly_one_way_on():
    logits = torch.zeros(1, 4)
    with pytest.raises(TypeError, match="exactly one of step= and verify="):
        next(token_loop(logits, GREEDY, StopRule((), 2)))
    with pytest.raises(TypeError, match="exactly one of step= and verify="):
        next(token_loop(logits, GREEDY, StopRule((), 2), step=abs, verify=abs))


def test_output_tokens_and_the_finish_reason():
    def choice(token: int, stopped: bool, last: bool = False) -> Choice:
        return Choice(torch.tensor([token]), torch.tensor([stopped]), last)

    assert list(output_tokens([choice(1, False), choice(7, True), choice(2, False)])) == [1]
    assert list(output_tokens([choice(1, False), choice(2, False, last=True)])) == [1, 2]
    assert [choice(7, True, last=True).finish_reason(), choice(1, False).finish_reason()] == [
        "stop",
        None,
    ]
    assert choice(2, False, last=True).finish_reason() == "length"
    assert Choice(torch.tensor([2]), None, False).finish_reason() is None


def test_samplings_fields_are_samples_keywords():
    """sample_and_stop passes a Sampling's fields to sample() by name (vars)."""
    import dataclasses
    import inspect

    from mhsa.models.sampling import Sampling, sample

    keywords = inspect.signature(sample).parameters
    assert all(field.name in keywords for field in dataclasses.fields(Sampling))
    assert vars(Sampling(0.5, 3, 0.9)) == {"temperature": 0.5, "top_k": 3, "top_p": 0.9}
