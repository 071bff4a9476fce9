"""Text generation for decoder-only language models (GPT, Llama), shared by them.

    generate(model, prompts, n)   left-pad prompts, prefill, decode n tokens
    sample(logits)                greedy, or temperature / top-k / top-p sampling

The model is called as model(tokens (B, T), caches=..., last=True) to continue what
its caches hold, or model(tokens, start=..., last=True) to recompute left-padded
sequences from scratch (last: logits of the last position only), and
builds its caches with model.make_caches(batch, max_len); both return logits (B, T, V).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..cache import StaticKVCache

# per model: its compiled functions (by the function compiled), and how long the first
# call took (compiling)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILE_SECONDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: Tensor | list[Tensor],
    max_new_tokens: int,
    *,
    vocab_size: int,
    max_len: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token: int | Sequence[int] | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    compile: bool = False,
) -> Tensor | list[Tensor]:
    """Continue prompts: a (B, T) tensor, or a list of 1-D prompts of any lengths
    (decoded together, left-padded). temperature 0 is greedy. eos_token: one stop token
    or several; after one a sequence stops growing, and decoding ends when all have
    stopped. max_len: the longest sequence the model can position (None: no limit).
    compile: decode through one torch.compile'd step over StaticKVCaches (the prompt
    is prefilled eagerly); compile_seconds(model) then tells what compiling took.
    Returns prompts + new tokens in the same form: a tensor (B, T + new) with the
    first stop token repeated after a sequence's end, or a list cut after each one's."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decoding step: keep use_cache=True")
    stops = _stop_tokens(eos_token, vocab_size)
    as_list = isinstance(idx, (list, tuple))
    prompts = list(idx) if as_list else list(idx.unbind(0))
    if not prompts or min(p.numel() for p in prompts) == 0:
        raise ValueError("generate needs at least one non-empty prompt")
    for prompt in prompts:
        check_token_ids(prompt, vocab_size, name="prompt")
    lengths = torch.tensor([p.numel() for p in prompts])
    width = int(lengths.max())
    device = next(model.parameters()).device
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, width - p.numel() :] = p.to(device)
    start = (width - lengths).to(device)
    if max_len is not None and width + max_new_tokens > max_len:
        raise ValueError(f"prompt ({width}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_len {max_len} of this model's positions")  # fmt: skip
    caches = model.make_caches(len(prompts), width + max_new_tokens) if use_cache else None
    if caches is not None:
        for cache in caches:
            cache.set_padding(start)
        logits = model(tokens, caches=caches, last=True)[:, -1]
    else:
        logits = model(tokens, start=start, last=True)[:, -1]
    step = compiled_decode_step(model, caches) if compile else None
    new = []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                     generator=generator)  # fmt: skip
        if stops is not None:
            nxt = torch.where(done, torch.full_like(nxt, int(stops[0])), nxt)
            done |= torch.isin(nxt, stops.to(device))
        new.append(nxt)
        if stops is not None and bool(done.all()):
            break
        if step is not None:
            logits = step(nxt.view(-1, 1))[:, -1]
        elif caches is not None:
            logits = model(nxt.view(-1, 1), caches=caches, last=True)[:, -1]
        else:
            tokens = torch.cat([tokens, nxt.view(-1, 1)], dim=1)
            logits = model(tokens, start=start, last=True)[:, -1]
    generated = torch.stack(new, dim=1) if new else tokens[:, :0]
    if not as_list:  # equal-length prompts: one tensor, the stop token repeated after the end
        return torch.cat([idx.to(device), generated], dim=1)
    return [torch.cat([p.to(device), _until_stop(g, stops)])
            for p, g in zip(prompts, generated, strict=True)]  # fmt: skip


def compiled_decode_step(model: nn.Module, caches: list) -> Callable[[Tensor], Tensor]:
    """token (B, 1) -> logits (B, 1, V): model's decoding step compiled once per model
    (fullgraph; inductor's caches keep the compiled code on disk between runs), over
    StaticKVCaches that continue `caches`."""
    static = static_caches(caches)
    return compiled_once(model, _decode_step, lambda token: (model, token, static))


def static_caches(caches: list) -> list[StaticKVCache]:
    """StaticKVCaches continuing KVCaches, their slot axis dynamic (one compiled graph
    for every cache length; heads and widths stay fixed)."""
    static = [StaticKVCache(cache) for cache in caches]
    for cache in static:
        torch._dynamo.mark_dynamic(cache.k, 2)
        torch._dynamo.mark_dynamic(cache.v, 2)
    return static


def compiled_once(model: nn.Module, function: Callable, arguments: Callable) -> Callable:
    """x -> function(*arguments(x)), through torch.compile(function) made once per model
    (fullgraph); the first call's seconds (compiling included) go to compile_seconds."""
    made = _COMPILED.setdefault(model, {})
    first = function not in made
    if first:
        made[function] = torch.compile(function, fullgraph=True, dynamic=False)
    compiled = made[function]

    def call(x: Tensor) -> Tensor:
        nonlocal first
        started = time.perf_counter()
        result = compiled(*arguments(x))
        if first:
            _COMPILE_SECONDS[model], first = time.perf_counter() - started, False
        return result

    return call


def _decode_step(model: nn.Module, token: Tensor, caches: list) -> Tensor:
    return model(token, caches=caches, last=True)


def compile_seconds(model: nn.Module) -> float | None:
    """Seconds the first compiled decoding step of model took (compiling included), or
    None before generate(..., compile=True)."""
    return _COMPILE_SECONDS.get(model)


def _stop_tokens(eos_token: int | Sequence[int] | None, vocab_size: int) -> Tensor | None:
    """The stop tokens as a 1-D tensor (the first fills finished rows), or None."""
    if eos_token is None:
        return None
    ids = [eos_token] if isinstance(eos_token, int) else list(eos_token)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise TypeError(f"eos_token must be a token id, a non-empty list of them, or None; "
                        f"got {eos_token!r}")  # fmt: skip
    stops = torch.tensor(ids, dtype=torch.long)
    check_token_ids(stops, vocab_size, name="eos_token")
    return stops


def _until_stop(tokens: Tensor, stops: Tensor | None) -> Tensor:
    if stops is None:
        return tokens
    hits = torch.isin(tokens, stops.to(tokens.device)).nonzero()
    return tokens if hits.numel() == 0 else tokens[: int(hits[0]) + 1]


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
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the first
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError for sampling settings that select nothing or mean nothing."""
    if not temperature >= 0:  # also catches nan
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1, or None for no limit; got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], or None for no limit; got {top_p!r}")


def check_token_ids(ids: Tensor, vocab_size: int, name: str = "idx") -> None:
    """Raise for token ids that are not integers in [0, vocab_size)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got {ids.dtype}")
    if torch.compiler.is_compiling():
        return  # a value check would break the graph (eager calls check)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(
            f"{name} holds token id {bad}, outside this model's vocabulary 0..{vocab_size - 1}"
        )
