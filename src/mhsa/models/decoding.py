"""Text generation for decoder-only language models (GPT, Llama), shared by them.

    model.generate(prompts, n)           left-pad prompts, prefill, decode n tokens
    greedy_search(decoder, caches, ...)  the most likely token at every step, to a stop
    compiled_decode_step(model, caches)  model.step compiled once per model
                                         (mhsa.models.compiled_step); on CUDA, captured
                                         in a graph (mhsa.models.graph_step)

The model is a Decoder (mhsa.models.decoder): prefill(tokens, caches, start=...) and
step(tokens, caches) give the last position's logits (B, V); make_caches(batch,
max_len) builds its caches. The tokens come from the one decoding loop,
mhsa.models.sampling.token_loop (each next token and stop from sample_and_stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core.checks import an_int, int_at_least, is_int_tensor
from .compiled_step import compile_seconds, compiled_decode_step, compiled_once, static_caches
from .decoder import Decoder
from .graph_step import graph_lease, static_step_problem
from .packing import mean_token_loss
from .sampling import GREEDY, Sampling, StopRule, check_sampling, sample, token_loop

if TYPE_CHECKING:
    from .speculative import Speculator

__all__ = [
    "CausalLMDecoding",
    "check_sampling",
    "check_token_ids",
    "compile_seconds",
    "compiled_decode_step",
    "compiled_once",
    "greedy_search",
    "sample",
    "static_caches",
]


@torch.no_grad()
def greedy_search(
    decoder: Decoder, caches: object, start: Tensor, eos: int, max_new_tokens: int
) -> list[list[int]]:
    """Most likely token at every step. start (B, T0) is prefilled into caches, then
    each row's best token is fed back -> B token lists (no prefix, no eos); a row stops
    at eos or after max_new_tokens."""
    check_search(start, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in range(start.shape[0])]
    logits = decoder.prefill(start, caches)
    stop = StopRule((eos,), max_new_tokens)
    for choice in token_loop(logits, GREEDY, stop, step=lambda t: decoder.step(t, caches)):
        best, stopped = choice.tokens.tolist(), choice.stopped.tolist()
        for row, output in enumerate(outputs):
            if not stopped[row]:  # (rows that ended before count as stopped)
                output.append(best[row])
    return outputs


def check_search(start: Tensor, max_new_tokens: int) -> None:
    """Raise ValueError for a search's start tokens or length that mean nothing."""
    if start.dim() != 2 or start.shape[1] == 0:
        raise ValueError(f"start must be (batch, prefix_len >= 1) tokens, got {tuple(start.shape)}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")


def _stop_tokens(eos_token: int | Sequence[int] | None, vocab_size: int) -> tuple[int, ...]:
    """The stop tokens, checked (the first fills finished rows); () for none."""
    if eos_token is None:
        return ()
    ids = [eos_token] if isinstance(eos_token, int) else list(eos_token)
    if not ids:
        raise TypeError(
            f"eos_token must be a token id, a non-empty list of them, or None; got {eos_token!r}"
        )
    for i in ids:
        int_at_least("eos_token", i, 0, " (a token id, or a list of them)")
    check_token_ids(torch.tensor(ids, dtype=torch.long), vocab_size, name="eos_token")
    return tuple(ids)


def _left_padded(prompts: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """1-D prompts -> (tokens (B, T) with each prompt at the right end of its row, zeros
    before it; start (B,) the index of each row's first prompt token)."""
    lengths = torch.tensor([p.numel() for p in prompts])
    width = int(lengths.max())
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, width - p.numel() :] = p.to(device)
    return tokens, (width - lengths).to(device)


def _until_stop(tokens: Tensor, stop: StopRule) -> Tensor:
    """tokens (N,) cut after the first stop token."""
    stopped = stop.stopped(tokens)
    if stopped is None:
        return tokens
    hits = stopped.nonzero()
    return tokens if hits.numel() == 0 else tokens[: int(hits[0]) + 1]


def check_token_ids(ids: Tensor, vocab_size: int, name: str = "idx") -> None:
    """Raise for token ids that are not integers in [0, vocab_size)."""
    if not is_int_tensor(ids):
        raise TypeError(f"{name} must hold integer token ids, got {ids.dtype}")
    if torch.compiler.is_compiling():
        return  # a value check would break the graph (eager calls check)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(
            f"{name} holds token id {bad}, outside this model's vocabulary 0..{vocab_size - 1}"
        )


class CausalLMDecoding:
    """The next-token loss, prefill and step of a decoder-only model (GPT, Llama) called
    as model(tokens, caches=..., start=..., last=True) -> logits (B, 1, V)."""

    # where a chunked prefill's calls may start (a multiple of this) for the answer to
    # equal one whole-prompt call: anywhere, unless the attention says otherwise (MoBA)
    prefill_alignment: int = 1
    # whether prompts of different lengths decode together in one left-padded batch;
    # generate decodes them one after another for a model that says no (MoBA)
    left_padding: bool = True
    # whether generate captures its decoding step in a CUDA graph by default on CUDA
    # (mhsa.models.graph_step): a model whose compiled step over StaticKVCaches is
    # known to give its eager tokens says so
    graph_decoding: bool = False

    def loss(self, idx: Tensor, targets: Tensor, **inputs: Tensor | None) -> Tensor:
        """Mean next-token cross-entropy of the logits for idx (B, T) against targets
        (B, T), skipping targets of -100. inputs: forward's keywords (positions where
        the model takes them; packing: cu_seqlens, position_ids, and a packed row's
        targets from mhsa.models.packing.next_token_targets)."""
        logits = self(idx, **inputs)
        return mean_token_loss(logits.flatten(0, 1), targets.flatten())

    def prefill(self, tokens: Tensor, caches: Any, *, start: Tensor | None = None) -> Tensor:
        """Decoder.prefill: tokens (B, T) -> logits (B, V) of the last position."""
        if caches is None:
            return self(tokens, start=start, last=True)[:, -1]
        if start is not None:
            for cache in caches:
                cache.set_padding(start)
        return self(tokens, caches=caches, last=True)[:, -1]

    def step(self, tokens: Tensor, caches: Any) -> Tensor:
        """Decoder.step: tokens (B, 1) -> logits (B, V)."""
        return self(tokens, caches=caches, last=True)[:, -1]

    def verify(self, tokens: Tensor, caches: Any) -> Tensor:
        """tokens (B, T) continuing caches -> logits (B, T, V) of every position (the
        last token and the drafts of speculative decoding)."""
        return self(tokens, caches=caches)

    def _speculative(self, idx, prompts, sampling, stop, speculate, draft_tokens, generator):
        """generate's speculative path (mhsa.models.speculative.speculative_decode)."""
        from .speculative import speculative_decode

        if len(prompts) != 1:
            raise ValueError(f"speculate decodes one prompt at a time, got {len(prompts)}")
        problem = self.paged_cache_problem()
        if problem is not None:
            raise ValueError(f"speculate decodes over a paged cache, and {problem}")
        max_len, prompt = self.position_limit(), prompts[0]
        if max_len is not None and prompt.numel() + stop.max_tokens > max_len:
            raise ValueError(
                f"prompt ({prompt.numel()}) + max_new_tokens ({stop.max_tokens}) exceeds "
                f"max_len {max_len} of this model's positions"
            )
        choices = speculative_decode(
            self,
            prompt.tolist(),
            sampling,
            stop,
            speculate,
            draft_tokens=draft_tokens,
            generator=generator,
        )
        new = torch.cat([choice.tokens for choice in choices]).to(prompt.device)
        out = torch.cat([prompt, new])
        return [out] if isinstance(idx, (list, tuple)) else out.unsqueeze(0)

    def position_limit(self) -> int | None:
        """The longest sequence the model can position (None: no limit)."""
        return None

    def paged_cache_problem(self) -> str | None:
        """Why the model cannot decode over a PagedKVCache (whose attention is causal,
        optionally within a sliding window), or None."""
        return None

    def default_stop_tokens(self) -> int | Sequence[int] | None:
        """The stop tokens generate() uses when it is given none."""
        return None

    def _new_tokens(self, logits, tokens, start, caches, step, sampling, stop, generator) -> Tensor:
        """generate's new tokens (B, N) from the prompt's logits (B, V), ended rows
        repeating the first stop token (mhsa.models.sampling.token_loop): each token fed
        to `step` (a compiled or captured one), else to model.step over caches, else
        appended to tokens and the whole recomputed."""

        def recompute(nxt: Tensor) -> Tensor:  # no cache: the whole sequence again
            nonlocal tokens
            tokens = torch.cat([tokens, nxt], dim=1)
            return self.prefill(tokens, None, start=start)

        if step is None:
            step = recompute if caches is None else lambda nxt: self.step(nxt, caches)
        new = [c.tokens for c in token_loop(logits, sampling, stop, step=step, generator=generator)]
        return torch.stack(new, dim=1) if new else tokens[:, :0]

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor | list[Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token: int | Sequence[int] | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        compile: bool = False,
        cuda_graph: bool | None = None,
        speculate: Speculator | None = None,
        draft_tokens: int = 4,
    ) -> Tensor | list[Tensor]:
        """Continue prompts: a (B, T) tensor, or a list of 1-D prompts of any lengths
        (decoded together, left-padded; one after another where the model says
        left_padding = False, as MoBA does). temperature 0 is greedy. eos_token: one stop
        token or several (None: the model's default_stop_tokens(); [] never stops early);
        after one a sequence stops growing, and decoding ends when all have stopped.
        The prompt plus the new tokens must fit the model's position_limit().
        compile: decode through one torch.compile'd step over StaticKVCaches (the prompt
        is prefilled eagerly); compile_seconds(model) then tells what compiling took.
        cuda_graph: decode through that compiled step captured in a CUDA graph, one
        replay per token, over caches of fixed slots kept for the model's next call of
        the same shape (mhsa.models.graph_step). None (the default): where it applies
        (the model on CUDA, one that declares graph_decoding, no sliding-window
        caches), falling back to plain decoding with a warning if capturing fails;
        True: raise where it cannot; False: never.
        speculate: a Speculator (mhsa.models.speculative: PromptLookup(), DraftModel(m))
        drafting up to draft_tokens tokens a step, verified in one forward pass (one
        prompt only): the same tokens as without it when greedy, the same distribution
        when sampling.
        Returns prompts + new tokens in the same form: a tensor (B, T + new) with the
        first stop token repeated after a sequence's end, or a list cut after each one's."""
        if isinstance(eos_token, Tensor):
            eos_token = eos_token.tolist()  # (a 0-d tensor: one id)
        if eos_token is not None and not isinstance(eos_token, (int, list, tuple)):
            raise TypeError(
                f"eos_token must be a token id, a list of them, or None; got {eos_token!r}"
            )
        requested_eos = eos_token
        eos_token = self.default_stop_tokens() if eos_token is None else eos_token
        if isinstance(eos_token, (list, tuple)) and len(eos_token) == 0:
            eos_token = None
        vocab_size, max_len = self.config.vocab_size, self.position_limit()
        an_int("max_new_tokens", max_new_tokens)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling = Sampling(temperature, top_k, top_p)
        if compile and not use_cache:
            raise ValueError("compile=True compiles the cached decoding step: keep use_cache=True")
        if cuda_graph is not None and not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be True, False or None, got {cuda_graph!r}")
        if cuda_graph and (not use_cache or speculate is not None):
            raise ValueError(
                "cuda_graph=True captures the cached one-token step: keep use_cache=True "
                "and speculate=None"
            )
        stop = StopRule(_stop_tokens(eos_token, vocab_size), max_new_tokens)
        as_list = isinstance(idx, (list, tuple))
        if not as_list and (not isinstance(idx, Tensor) or idx.dim() != 2):
            got = tuple(idx.shape) if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(
                f"idx must be a (B, T) tensor of prompts or a list of 1-D prompts, got {got}; "
                "one 1-D prompt goes in as prompt[None] or [prompt]"
            )
        prompts = list(idx) if as_list else list(idx.unbind(0))
        for prompt in prompts:
            if not isinstance(prompt, Tensor) or prompt.dim() != 1:
                got = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
                raise ValueError(
                    f"idx's prompts must be 1-D tensors, got {got}: pass lists as "
                    "[torch.tensor(p) for p in prompts], a (1, T) tensor as p[0]"
                )
        if not prompts or min(p.numel() for p in prompts) == 0:
            raise ValueError("generate needs at least one non-empty prompt")
        for prompt in prompts:
            check_token_ids(prompt, vocab_size, name="prompt")
        device = next(self.parameters()).device
        if not self.left_padding and len({p.numel() for p in prompts}) > 1:
            options = dict(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token=requested_eos,
                use_cache=use_cache,
                generator=generator,
                compile=compile,
                cuda_graph=cuda_graph,
                speculate=speculate,
                draft_tokens=draft_tokens,
            )
            return [self.generate([prompt], max_new_tokens, **options)[0] for prompt in prompts]
        if speculate is not None and max_new_tokens > 0:
            return self._speculative(
                idx, prompts, sampling, stop, speculate, draft_tokens, generator
            )
        tokens, start = _left_padded(prompts, device)
        width = tokens.shape[1]
        if max_len is not None and width + max_new_tokens > max_len:
            raise ValueError(
                f"prompt ({width}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_len {max_len} of this model's positions"
            )
        lease = None
        if use_cache and (max_new_tokens > 1 or cuda_graph):
            lease = graph_lease(self, len(prompts), width + max_new_tokens, cuda_graph)
        try:
            caches = lease.caches if lease is not None else None
            if caches is None and use_cache:
                caches = self.make_caches(len(prompts), width + max_new_tokens)
            problem = static_step_problem(self, caches) if compile and lease is None else None
            if problem is not None:
                raise ValueError(
                    f"compile=True decodes through one compiled step over static caches, "
                    f"and {problem}: decode without compile"
                )
            if caches is None and not bool(start.any()):
                start = None  # no row padded: no key padding (which MoBA refuses)
            logits = self.prefill(tokens, caches, start=start)
            step = None if lease is None else lease.begin(strict=cuda_graph is True)
            if step is None and compile:
                step = compiled_decode_step(self, caches)
            generated = self._new_tokens(
                logits, tokens, start, caches, step, sampling, stop, generator
            )
        finally:
            if lease is not None:
                lease.release()
        if not as_list:  # equal-length prompts: one tensor, the stop token repeated after the end
            return torch.cat([idx.to(device), generated], dim=1)
        return [
            torch.cat([p.to(device), _until_stop(g, stop)])
            for p, g in zip(prompts, generated, strict=True)
        ]
