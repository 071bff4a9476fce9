"""The next token and whether a sequence ends: the one decision every decoding loop
makes (generate, chat, greedy and beam search, the server's runner), and the one loop
that asks it token by token.

    Sampling(temperature, top_k, top_p)      how a token is chosen (temperature 0: greedy)
    StopRule(stop_tokens, max_tokens)        when a sequence ends
    sample_and_stop(logits, sampling, stop, generated=n)   -> Choice(tokens, stopped, last)
    accept_draft(logits, draft, sampling, stop, generated=n) -> [Choice, ...]  the same
                                             decision for drafted tokens (speculative decoding)
    token_loop(logits, sampling, stop, step=... | verify=...)  -> Choice, Choice, ...
                                             the decoding loop of generate, greedy_search,
                                             speculative decoding and chat
    output_tokens(choices)                   one sequence's tokens to output, to its end
    sample(logits, temperature=..., ...)     the token choice alone
    probabilities(logits, sampling)          the distribution sample() draws from
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checks import int_at_least


@dataclass(frozen=True)
class Sampling:
    """Greedy at temperature 0, else sampled from the softmax at that temperature,
    restricted to the top_k tokens and/or the smallest set whose probability reaches
    top_p (None: no restriction)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)


class StopRule:
    """A sequence ends when its next token is one of stop_tokens (whether that token
    is output is the caller's choice) or when that token is its max_tokens-th new one
    (None: no limit). The first stop token is the one that fills ended rows."""

    def __init__(self, stop_tokens: Sequence[int] = (), max_tokens: int | None = None) -> None:
        self.stop_tokens = tuple(stop_tokens)
        self.max_tokens = max_tokens
        self._on: dict[torch.device, Tensor] = {}  # the stop tokens, per device

    def stopped(self, tokens: Tensor) -> Tensor | None:
        """tokens (...) -> bool (...), True at stop tokens; None when the rule has none."""
        if not self.stop_tokens:
            return None
        if tokens.device not in self._on:  # made once per device
            self._on[tokens.device] = torch.tensor(self.stop_tokens, device=tokens.device)
        return torch.isin(tokens, self._on[tokens.device])

    def ends(self, token: int) -> bool:
        """Whether one token (a Python int) is a stop token."""
        return token in self.stop_tokens

    def is_last(self, generated: int) -> bool:
        """Whether the next token, after `generated` new ones, is the last allowed."""
        return self.max_tokens is not None and generated + 1 >= self.max_tokens

    def __repr__(self) -> str:
        return f"StopRule(stop_tokens={self.stop_tokens}, max_tokens={self.max_tokens})"


@dataclass
class Choice:
    """One decoding step's decision for B sequences: tokens (B,); stopped (B,) bool,
    True where the token is a stop token (None when the rule has none); last: the
    tokens are the max_tokens-th, so every sequence ends after them."""

    tokens: Tensor
    stopped: Tensor | None
    last: bool

    def stops(self, row: int = 0) -> bool:
        """Whether row's token is a stop token (output no further)."""
        return self.stopped is not None and bool(self.stopped[row])

    def ends(self, row: int = 0) -> bool:
        """Whether row's sequence ends with this token: a stop token, or the last allowed."""
        return self.last or self.stops(row)

    def finish_reason(self, row: int = 0) -> str | None:
        """How row's sequence ends with this token: "stop" (a stop token, not output),
        "length" (the last allowed token, output), or None (it goes on)."""
        if self.stops(row):
            return "stop"
        return "length" if self.last else None

    def ends_all(self) -> bool:
        """Whether every row's sequence has ended: the last allowed token, or a stop
        token in every row (token_loop marks the rows that ended before as stopped)."""
        return self.last or (self.stopped is not None and bool(self.stopped.all()))


def sample_and_stop(
    logits: Tensor,
    sampling: Sampling,
    stop: StopRule,
    *,
    generated: int,
    generator: torch.Generator | None = None,
) -> Choice:
    """The next tokens from logits (B, V) and whether they end their sequences, each
    of which has `generated` new tokens before this one."""
    tokens = sample(logits, **vars(sampling), generator=generator)  # its fields: sample's
    return Choice(tokens, stop.stopped(tokens), stop.is_last(generated))


def sample_and_stop_rows(
    logits: Tensor, rules: Sequence[tuple[Sampling, StopRule, int, torch.Generator | None]]
) -> list[Choice]:
    """sample_and_stop for each row of logits (B, V) under its own rule (sampling, stop
    rule, tokens generated before, generator): the greedy rows in one draw, every row's
    token brought to the host in one copy and tested for a stop there, so that a batched
    decoding step on a GPU waits for the device once, not several times a row. Each
    Choice holds its one row, on the CPU."""
    greedy = [row for row, (sampling, *_) in enumerate(rules) if sampling.temperature == 0]
    drawn: dict[int, Tensor] = {}
    if greedy:
        rows = logits if len(greedy) == len(rules) else logits[greedy]
        drawn.update(zip(greedy, sample(rows, **vars(GREEDY)).split(1), strict=True))
    for row, (sampling, _, _, generator) in enumerate(rules):
        if row not in drawn:
            drawn[row] = sample(logits[row : row + 1], **vars(sampling), generator=generator)
    tokens = torch.cat([drawn[row] for row in range(len(rules))]).cpu() if rules else None
    return [
        Choice(tokens[row : row + 1], stop.stopped(tokens[row : row + 1]), stop.is_last(made))
        for row, (_, stop, made, _) in enumerate(rules)
    ]


def accept_draft(
    logits: Tensor,
    draft: Sequence[int],
    sampling: Sampling,
    stop: StopRule,
    *,
    generated: int,
    generator: torch.Generator | None = None,
    draft_probs: Tensor | None = None,
) -> list[Choice]:
    """sample_and_stop for one sequence given k drafted tokens (speculative decoding):
    logits (k + 1, V) are the target's at the position before each draft token and after
    the last. Returns one Choice per token taken, in order: the drafts that stand, then
    one the target chose; it ends early at a token that stops or is the max_tokens-th.

    Greedy: drafts stand while each is the target's argmax, then the argmax follows, so
    the tokens are exactly plain greedy decoding's. Sampling: draft x at row i stands
    with probability min(1, p(x) / q(x)), p = probabilities(logits[i], sampling), q =
    draft_probs[i] (None: drafts chosen deterministically, q one-hot at x); the first
    that falls is replaced by a draw from max(0, p - q), normalised; if all stand one is
    drawn from the last row. The tokens are then distributed as sampling from the target
    alone (Leviathan et al., 2023)."""
    k = len(draft)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(
            f"logits must be (k + 1, V) = ({k + 1}, V) for {k} draft tokens, "
            f"got {tuple(logits.shape)}"
        )
    if k == 0:  # no drafts: the plain decision
        return [sample_and_stop(logits, sampling, stop, generated=generated, generator=generator)]
    taken: list[int] = []
    final: Choice | None = None
    if sampling.temperature == 0:
        best = logits.argmax(dim=-1).tolist()
        while len(taken) < k and best[len(taken)] == draft[len(taken)]:
            taken.append(draft[len(taken)])
    else:
        p = probabilities(logits, sampling)
        for i, token in enumerate(draft):
            q = None if draft_probs is None else draft_probs[i].to(p)
            q_x = 1.0 if q is None else float(q[token])
            if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(
                p[i, token]
            ):
                taken.append(token)
                continue
            residual = p[i].clone()
            if q is None:
                residual[token] = 0.0
            else:
                residual = (residual - q).clamp_(min=0.0)
            if not float(residual.sum()) > 0:  # (p == q: a rejection cannot happen)
                residual = p[i]
            drawn = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            final = Choice(drawn, stop.stopped(drawn), stop.is_last(generated + i))
            break
    if final is None:
        row = len(taken)
        final = sample_and_stop(
            logits[row : row + 1],
            sampling,
            stop,
            generated=generated + row,
            generator=generator,
        )
    choices = []
    for i, token in enumerate(taken):
        tokens = torch.tensor([token], device=logits.device)
        choice = Choice(tokens, stop.stopped(tokens), stop.is_last(generated + i))
        choices.append(choice)
        if choice.ends():
            return choices
    return [*choices, final]


# verify(taken, generated) -> (logits (k + 1, V), draft (k tokens), draft_probs (k, V) or None)
Verify = Callable[[list[Choice], int], tuple[Tensor, list[int], Tensor | None]]


def token_loop(
    logits: Tensor,
    sampling: Sampling,
    stop: StopRule,
    *,
    step: Callable[[Tensor], Tensor] | None = None,
    verify: Verify | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[Choice]:
    """The decoding loop: from logits (B, V) of each sequence's last prompt position,
    one Choice per new token (tokens (B,)), each from sample_and_stop (or accept_draft),
    ending with the first choice after which every sequence has ended
    (Choice.ends_all: the max_tokens-th token, or a stop token in every row; nothing at
    all for max_tokens 0). A row that ended before a choice holds the first stop token
    there and counts as stopped.

    The next logits come from one of (keyword, exactly one given):
    step(tokens (B, 1)) -> logits (B, V): the chosen tokens fed back (a model's step
        over its caches, a compiled or captured step, a recompute);
    verify(taken, generated) -> (logits (k + 1, V), draft, draft_probs): one sequence
        (B = 1) continued by the choices taken since the last call (`generated` new
        tokens in all) and k >= 0 drafted tokens, in one forward pass (speculative
        decoding); accept_draft keeps the drafts that stand and adds the model's own
        next token, one Choice each."""
    if (step is None) == (verify is None):
        raise TypeError("token_loop takes exactly one of step= and verify=")
    if stop.max_tokens == 0:
        return
    rows, generated, done = logits.shape[0], 0, None
    taken = [sample_and_stop(logits, sampling, stop, generated=0, generator=generator)]
    while True:
        for choice in taken:
            if rows > 1 and choice.stopped is not None:  # (one row ends the loop itself)
                if done is not None:  # ended rows repeat the first stop token
                    tokens = torch.where(done, stop.stop_tokens[0], choice.tokens)
                    choice = Choice(tokens, done | choice.stopped, choice.last)
                done = choice.stopped
            yield choice
            generated += 1
            if choice.ends_all():
                return
        if verify is None:
            logits = step(choice.tokens.view(-1, 1))
            choice = sample_and_stop(
                logits, sampling, stop, generated=generated, generator=generator
            )
            taken = [choice]
        else:
            logits, draft, draft_probs = verify(taken, generated)
            taken = accept_draft(
                logits,
                draft,
                sampling,
                stop,
                generated=generated,
                generator=generator,
                draft_probs=draft_probs,
            )


def output_tokens(choices: Iterable[Choice]) -> Iterator[int]:
    """One sequence's tokens to output, from its Choices (row 0), to its end: a stop
    token ends it unseen, the last allowed token is output."""
    for choice in choices:
        if choice.stops():
            return
        yield int(choice.tokens[0])
        if choice.last:
            return


def probabilities(logits: Tensor, sampling: Sampling) -> Tensor:
    """(..., V) float32 probabilities that sample() draws from at sampling's temperature
    (> 0), top_k and top_p."""
    if sampling.temperature == 0:
        raise ValueError("greedy decoding (temperature 0) draws from no distribution")
    return _filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)


def _filtered_probs(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> Tensor:
    shape = logits.shape
    logits = logits.reshape(-1, shape[-1]).float()
    # shifted by the row's maximum first, so that a tiny temperature sends the others to
    # -inf, never the largest to inf (inf - inf is nan in the softmax); a temperature
    # below float32's smallest normal number would be 0 here
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:  # (1.0 keeps every token: float32 sums reach it early)
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop[:, 0] = False  # the most likely token stays, however small top_p is
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -torch.inf)
    return torch.softmax(logits, dim=-1).view(shape)


def sample(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens (B,) from logits (B, V): greedy at temperature 0, else sampled
    from the softmax at that temperature, restricted to the top_k tokens and/or the
    smallest set whose probability reaches top_p."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = _filtered_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError for sampling settings that select nothing or mean nothing."""
    if not temperature >= 0:  # also catches nan
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None:
        int_at_least("top_k", top_k, 1, ", or None for no limit")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], or None for no limit; got {top_p!r}")


GREEDY = Sampling(temperature=0.0)
