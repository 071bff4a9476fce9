"""The static-shape decoding step that generate captures in a CUDA graph
(mhsa.models.graph_step), run uncaptured on the CPU: its greedy tokens are plain
decoding's, a reused one restarts cleanly, a full cache is a clear error, and generate's
path through it samples as without it. The capture itself: tests/cuda."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_greedy
from mhsa.cache import KVCache, SlidingWindowCache
from mhsa.models import GPT, GPTConfig, decoding
from mhsa.models.compiled_step import step_memo
from mhsa.models.gemma3 import Gemma3, Gemma3Config
from mhsa.models.graph_step import GraphLease, StaticDecodeStep, fixed_slots_problem
from mhsa.models.llama import Llama, LlamaConfig

VOCAB = 96


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48
        )
        return Llama(config).eval()
    position = "rotary" if kind == "gpt-rotary" else "learned"
    config = GPTConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, max_len=256, position=position
    )
    return GPT(config).eval()


KINDS = ["gpt", "gpt-rotary", "llama"]


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, width - p.numel() :] = p
    return tokens, torch.tensor([width - p.numel() for p in prompts])


def _static_greedy(model, caches, prompts, new: int, step=None) -> list[list[int]]:
    """Prefill caches, then `new` greedy tokens through a StaticDecodeStep (`step`
    restarted, when given)."""
    tokens, start = _left_padded(prompts)
    with torch.no_grad():
        logits = model.prefill(tokens, caches, start=start)
    if step is None:
        step = StaticDecodeStep(model, caches)
    else:
        step.restart()
    out = []
    for i in range(new):
        nxt = logits.argmax(dim=-1)
        out.append(nxt)
        if i < new - 1:
            logits = step(nxt.view(-1, 1))
    return torch.stack(out, dim=1).tolist()


def _assert_greedy_as_generate(model, prompts, got: list[list[int]]) -> None:
    want = model.generate(prompts, len(got[0]), temperature=0.0, eos_token=[], cuda_graph=False)
    for g, w, prompt in zip(got, want, prompts, strict=True):
        full, n = w.tolist(), prompt.numel()
        with torch.no_grad():
            assert_same_greedy(
                g, full[n:], lambda i, f=full, n=n: model(torch.tensor([f[: n + i]]))[0, -1]
            )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lengths", [(1,), (113,), (7, 13, 1)], ids=["1", "113", "7-13-1"])
def test_the_static_step_gives_generates_greedy_tokens(kind, lengths):
    model = _model(kind)
    torch.manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in lengths]
    new = 9
    caches = model.make_caches(len(prompts), max(lengths) + new + 5)  # spare slots
    got = _static_greedy(model, caches, prompts, new)
    _assert_greedy_as_generate(model, prompts, got)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_restarted_step_continues_the_caches_prefilled_anew(kind):
    model = _model(kind)
    torch.manual_seed(2)
    first = [torch.randint(0, VOCAB, (11,)), torch.randint(0, VOCAB, (4,))]
    second = [torch.randint(0, VOCAB, (3,)), torch.randint(0, VOCAB, (17,))]
    caches = model.make_caches(2, 40)
    step = StaticDecodeStep(model, caches)  # (on empty caches: restart sets its length)
    _static_greedy(model, caches, first, 6, step)  # then left mid-way
    for cache in caches:
        cache.reset()
    got = _static_greedy(model, caches, second, 8, step)
    _assert_greedy_as_generate(model, second, got)


def test_a_full_static_cache_is_a_clear_error_and_writes_nothing():
    model = _model("llama")
    caches = model.make_caches(1, 6)
    with torch.no_grad():
        logits = model.prefill(torch.randint(0, VOCAB, (1, 4)), caches)
    step = StaticDecodeStep(model, caches)
    for _ in range(2):  # slots 4 and 5
        logits = step(logits.argmax(-1).view(1, 1))
    before = caches[0].k.clone()
    with pytest.raises(ValueError, match="static cache is full: 6 of 6 slots"):
        step(logits.argmax(-1).view(1, 1))
    assert torch.equal(caches[0].k, before)
    with pytest.raises(ValueError, match=r"token must be \(batch, 1\)"):
        StaticDecodeStep(model, model.make_caches(1, 6))(torch.zeros(2, 1, dtype=torch.long))


def test_what_the_static_step_refuses():
    model = _model("llama")
    assert "SlidingWindowCache" in fixed_slots_problem([SlidingWindowCache(1, 2, 4, 8)])
    assert "non-empty list" in fixed_slots_problem([])
    uneven = [KVCache(1, 2, 8, 4), KVCache(1, 2, 9, 4)]
    assert "differ" in fixed_slots_problem(uneven)
    with pytest.raises(ValueError, match="compile=True"):
        StaticDecodeStep(model, model.make_caches(1, 8), capture=True)
    with pytest.raises(ValueError, match="CUDA device"):
        StaticDecodeStep(model, model.make_caches(1, 8), compile=True, capture=True)
    prompt = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="CUDA device"):
        model.generate(prompt, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="use_cache=True"):
        model.generate(prompt, 3, cuda_graph=True, use_cache=False)
    with pytest.raises(TypeError, match="cuda_graph"):
        model.generate(prompt, 3, cuda_graph="yes")


def test_which_models_capture_by_default():
    assert _model("llama").graph_decoding and _model("gpt").graph_decoding
    alibi = GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16, position="alibi"))
    assert not alibi.graph_decoding
    gemma = Gemma3(Gemma3Config(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16, d_ff=32))
    assert not gemma.graph_decoding


@pytest.fixture
def cpu_leases(monkeypatch):
    """generate's graph path on the CPU: leases of uncaptured eager steps, kept per
    model as on CUDA (the made leases are listed)."""
    made: list[GraphLease] = []

    def lease(model, batch, length, cuda_graph):
        if cuda_graph is False:
            return None
        held = made[-1] if made else None
        if held is not None and held.key == (batch, length) and held.take():
            for cache in held.caches:
                cache.reset()
            return held
        made.append(
            GraphLease(
                model,
                (batch, length),
                model.make_caches(batch, length),
                compile=False,
                capture=False,
            )
        )
        made[-1].take()
        return made[-1]

    monkeypatch.setattr(decoding, "graph_lease", lease)
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_generate_through_the_static_step_samples_as_without_it(kind, cpu_leases):
    model = _model(kind).double()  # (float64: the two paths' rounding cannot part them)
    torch.manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (5,)), torch.randint(0, VOCAB, (12,))]
    options = {"temperature": 0.9, "top_k": 40, "eos_token": [3, 5]}
    for _ in range(2):  # the second call reuses the lease's caches and step
        want = model.generate(prompts, 16, generator=torch.Generator().manual_seed(7), **options)
        got = model.generate(
            prompts, 16, generator=torch.Generator().manual_seed(7), cuda_graph=True, **options
        )
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        greedy = model.generate(prompts, 16, temperature=0.0, eos_token=[], cuda_graph=True)
        _assert_greedy_as_generate(
            model, prompts, [g[p.numel() :].tolist() for g, p in zip(greedy, prompts, strict=True)]
        )
    assert len(cpu_leases) == 1 and cpu_leases[0].step is not None
    assert not cpu_leases[0]._lock.locked()  # released after each call


def test_a_failed_capture_falls_back_to_plain_decoding_with_a_warning(monkeypatch):
    model = _model("gpt")

    def lease(model, batch, length, cuda_graph):  # a capture that cannot happen (CPU)
        if cuda_graph is False:
            return None
        made = GraphLease(model, (), model.make_caches(batch, length), capture=True)
        made.take()
        return made

    monkeypatch.setattr(decoding, "graph_lease", lease)
    prompt = torch.randint(0, VOCAB, (1, 6))
    want = model.generate(prompt, 8, temperature=0.0, cuda_graph=False)
    with pytest.warns(RuntimeWarning, match="decodes uncaptured"):
        got = model.generate(prompt, 8, temperature=0.0)
    assert torch.equal(got, want)
    assert step_memo(model).refused  # generate does not try this model again
    with pytest.raises(ValueError, match="CUDA device"):
        model.generate(prompt, 8, temperature=0.0, cuda_graph=True)


@pytest.mark.slow
def test_the_compiled_static_step_gives_generates_greedy_tokens():
    """The step that is captured on CUDA is the compiled one: uncaptured here."""
    model = _model("llama")
    torch.manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (9,)), torch.randint(0, VOCAB, (2,))]
    caches = model.make_caches(2, 30)
    tokens, start = _left_padded(prompts)
    with torch.no_grad():
        logits = model.prefill(tokens, caches, start=start)
    step = StaticDecodeStep(model, caches, compile=True)
    got = []
    for _ in range(10):
        got.append(logits.argmax(dim=-1))
        logits = step(got[-1].view(-1, 1))
    _assert_greedy_as_generate(model, prompts, torch.stack(got, dim=1).tolist())


def test_what_a_model_keeps_between_calls_lives_on_it_and_a_copy_starts_empty(tmp_path):
    """compiled_once keeps the compiled function in the model's StepMemo (no module
    dictionary); a deepcopy or a pickle of the model gets an empty memo, since compiled
    code and captured graphs belong to the original's weights."""
    import copy

    model = GPT(GPTConfig(vocab_size=VOCAB, max_len=32, d_model=32, n_layer=1, n_head=2))
    step = decoding.compiled_once(model, _double, lambda x: (x,))
    memo = step_memo(model)
    assert _double in memo.compiled and memo.compile_seconds is None
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    assert memo.compile_seconds is not None and memo is step_memo(model)
    memo.refused = "a planted capture failure"
    for twin in (copy.deepcopy(model), _pickled(model, tmp_path)):
        assert step_memo(twin).compiled == {} and step_memo(twin).refused is None
        assert torch.equal(twin.tok_emb.weight, model.tok_emb.weight)


def _double(x):
    return x * 2


def _pickled(model, tmp_path):
    torch.save(model, tmp_path / "model.pt")
    return torch.load(tmp_path / "model.pt", weights_only=False)
