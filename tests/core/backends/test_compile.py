"""torch.compile over our models: whole graphs (no graph breaks), compiled outputs and
gradients equal to eager, one graph for many sequence lengths under dynamic shapes,
and a forced backend that is part of the graph's guards."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import mhsa
from helpers import max_error
from mhsa.core.scores import ALiBi, RelativeBias, ScoreMod, Softcap
from mhsa.models.bert import Bert, BertConfig
from mhsa.models.gpt import GPT, GPTConfig
from mhsa.models.llama import Llama, LlamaConfig
from mhsa.models.vit import ViT, ViTConfig


def _gpt():
    model = GPT(GPTConfig(vocab_size=64, max_len=1024, d_model=32, n_head=4, n_layer=2))
    return model, (torch.randint(0, 64, (2, 24)),)


def _llama():
    config = LlamaConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48)
    return Llama(config), (torch.randint(0, 64, (2, 24)),)


def _vit():
    return ViT(ViTConfig(dropout=0.0)), (torch.randn(2, 1, 8, 8),)


def _bert():
    config = BertConfig(
        vocab_size=64,
        d_model=32,
        n_layer=2,
        n_head=4,
        d_ff=64,
        max_len=64,
        dropout=0.0,
    )
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[1, 15:] = 0  # the second sentence is 15 tokens, padded
    return Bert(config), (torch.randint(1, 64, (2, 24)), padding)


def _scored_gpt(position: str):
    def build():
        config = GPTConfig(
            vocab_size=64, max_len=1024, d_model=32, n_head=4, n_layer=2, position=position
        )
        return GPT(config), (torch.randint(0, 64, (2, 24)),)

    return build


class _ScoredAttention(nn.Module):
    """Causal self-attention whose scores a ScoreMod scales per head, with learned sinks.
    closure=True: the function closes over the temperature tensor itself (the op hands it
    the op's argument instead); False: over the module (it reads the parameter itself)."""

    def __init__(self, closure: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.temperature = nn.Parameter(torch.rand(4) + 0.5)
        self.sinks = nn.Parameter(torch.randn(4))
        temperature = self.temperature
        if closure:
            self.score = ScoreMod(lambda s, b, h, qi, ki: s * temperature[h] - 0.1 * (qi - ki))
        else:
            self.score = ScoreMod(lambda s, b, h, qi, ki: s * self.temperature[h])

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 4).permute(2, 0, 3, 1, 4)
        out = mhsa.attention(q, k, v, causal=True, score=self.score, sinks=self.sinks)
        return out.transpose(1, 2).flatten(2)


def _scored_attention(closure: bool):
    def build():
        return _ScoredAttention(closure), (torch.randn(2, 24, 16),)

    return build


MODELS = {"gpt": _gpt, "llama": _llama, "vit": _vit, "bert": _bert}
CASES = [(m, b) for m in MODELS for b in ("auto", "flash", "sdpa")]
# score functions inside the flash op (ALiBi, T5's relative bias: a learned table)
MODELS |= {"gpt-alibi": _scored_gpt("alibi"), "gpt-t5": _scored_gpt("t5")}
CASES += [(m, b) for m in ("gpt-alibi", "gpt-t5") for b in ("auto", "flash")]
# a ScoreMod and sinks, learned, inside the flash op too
MODELS |= {"score-mod": _scored_attention(True), "score-mod-module": _scored_attention(False)}
CASES += [(m, b) for m in ("score-mod", "score-mod-module") for b in ("auto", "flash")]


def _build(name: str):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    return model.eval(), inputs


@pytest.mark.parametrize("name,backend", CASES)
def test_the_whole_forward_is_one_graph(name, backend):
    model, inputs = _build(name)
    torch._dynamo.reset()
    with mhsa.use_backend(backend):
        explained = torch._dynamo.explain(model)(*inputs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


def _outputs_and_grads(model, inputs):
    for p in model.parameters():
        p.grad = None
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    (out.float().square().mean()).backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.slow
@pytest.mark.parametrize("name,backend", CASES)
def test_compiled_forward_and_gradients_equal_eager(name, backend):
    """Through dynamo and AOTAutograd (aot_eager): the graphs a compiler would get."""
    model, inputs = _build(name)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with mhsa.use_backend(backend):
        want, want_grads = _outputs_and_grads(model, inputs)
        got, got_grads = _outputs_and_grads(compiled, inputs)
    assert max_error(got, want) <= 1e-5
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        assert max_error(g, w) <= 1e-5


def test_inductor_training_step_equals_eager():
    model, inputs = _build("gpt")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    want, want_grads = _outputs_and_grads(model, inputs)
    got, got_grads = _outputs_and_grads(compiled, inputs)
    assert max_error(got, want) <= 1e-5
    for g, w in zip(got_grads, want_grads, strict=True):
        assert max_error(g, w) <= 1e-5


@pytest.mark.parametrize("backend", ["auto", "flash", "sdpa"])
def test_one_graph_serves_lengths_128_to_1024(backend):
    model, _ = _build("gpt")
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    with mhsa.use_backend(backend), torch.no_grad():
        for length in (128, 200, 256, 512, 777, 1024):
            compiled(torch.randint(0, 64, (1, length)))
    assert counter.frame_count <= 2


@pytest.mark.parametrize("backend", ["auto", "flash", "sdpa"])
def test_bare_attention_compiles_with_every_size_symbolic(backend):
    """dynamic=True on mhsa.attention itself: batch, heads, lengths and widths all come
    from the inputs, so all start symbolic (and dropout_p with them); heads and widths
    are specialised, lengths stay dynamic, and the outputs equal the float64 reference
    (grouped heads, bottom-right causal, and a square call)."""
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(mhsa.attention, backend=counter, dynamic=True, fullgraph=True)
    with mhsa.use_backend(backend):
        for q_len, kv_len in ((16, 19), (24, 27), (33, 70), (40, 40)):
            q = torch.randn(2, 4, q_len, 8)
            k, v = torch.randn(2, 2, kv_len, 8), torch.randn(2, 2, kv_len, 8)
            got = compiled(q, k, v, causal=True)
            want = mhsa.attention(
                q.double(), k.double(), v.double(), causal=True, backend="reference"
            )
            assert max_error(got, want) <= 1e-5
    assert counter.frame_count <= 3


def test_a_forced_backend_is_guarded():
    model, inputs = _build("gpt")
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        with mhsa.use_backend("sdpa"):
            compiled(*inputs)
            compiled(*inputs)
        assert counter.frame_count == 1
        with mhsa.use_backend("reference"):
            compiled(*inputs)
    assert counter.frame_count == 2


def _op_inputs(dtype=torch.float64, padded=True):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.randn(4, 9, 9, dtype=dtype, requires_grad=True)
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[1, ..., 6:] = False
    return q, k, v, mask, bias


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern,causal,dropout",
    [("", True, 0.0), ("SlidingWindow(2, 1)", False, 0.0), ("", True, 0.3)],
)
def test_the_flash_op_passes_opcheck_and_gradcheck(pattern, causal, dropout):
    """With dropout the seed input fixes the dropped entries, forward and backward."""
    from mhsa.core.backends.flash_op import flash_attention_op

    q, k, v, mask, bias = _op_inputs()
    seed = torch.tensor(1234)
    args = (q, k, v, mask, bias, pattern, causal, 0.3, dropout, seed, "", [], None)
    torch.library.opcheck(flash_attention_op, args)

    def out_and_lse(q, k, v, bias):
        return flash_attention_op(
            q, k, v, mask, bias, pattern, causal, 0.3, dropout, seed, "", [], None
        )

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v, bias))


def test_the_flash_op_equals_the_reference_with_patterns_padding_and_bias():
    from mhsa.core.backends.flash_op import traced_flash_attention
    from mhsa.core.masks import KeyPadding, SlidingWindow

    q, k, v, _, bias = _op_inputs(padded=False)
    for mask, causal in ((SlidingWindow(3, 0), False), (KeyPadding([9, 5]), True), (None, True)):
        got, _ = traced_flash_attention(q, k, v, mask, bias, causal, 0.3, 0.0)
        want = mhsa.attention(
            q, k, v, mask, bias=bias, causal=causal, scale=0.3, backend="reference"
        )
        assert max_error(got, want) <= 1e-12


def _score_mod(heads: int) -> list[ScoreMod]:
    weight = torch.rand(heads, dtype=torch.float64, requires_grad=True) + 0.5
    return [ScoreMod(lambda s, b, h, qi, ki: s * weight[h] + 0.01 * (qi - ki))]


SCORES = {
    "alibi": lambda h: [ALiBi(torch.rand(h, dtype=torch.float64, requires_grad=True))],
    "t5 then softcap": lambda h: [
        RelativeBias(torch.randn(8, h, dtype=torch.float64, requires_grad=True), 8, 16, False),
        Softcap(2.0),
    ],
    "score_mod": _score_mod,  # a closure over its tensor: the op's argument replaces it
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("causal", [True, False])
def test_the_flash_op_takes_score_functions_and_sinks(name, causal):
    """Score functions reach the op as text + tensors; gradients reach those tensors
    and the sinks, and outputs equal the reference."""
    from mhsa.core.backends.flash_op import flash_attention_op, traced_flash_attention
    from mhsa.core.backends.op_scores import score_spec
    from mhsa.core.scores import Compose

    q, k, v, _, bias = _op_inputs(padded=False)
    score = Compose(*SCORES[name](4))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    text, tensors = score_spec(score)
    assert len(tensors) == 1
    seed = torch.tensor(0)
    args = (q, k, v, None, bias, "", causal, 0.3, 0.0, seed, text, tensors, sinks)
    torch.library.opcheck(flash_attention_op, args)

    def out_and_lse(q, k, v, bias, table, sinks):
        return flash_attention_op(
            q, k, v, None, bias, "", causal, 0.3, 0.0, seed, text, [table], sinks
        )

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v, bias, tensors[0], sinks))
    got, _ = traced_flash_attention(q, k, v, None, bias, causal, 0.3, 0.0, score, sinks)
    want = mhsa.attention(
        q, k, v, bias=bias, causal=causal, scale=0.3, score=score, sinks=sinks, backend="reference"
    )
    assert max_error(got, want) <= 1e-12


@pytest.mark.parametrize(
    "score",
    [
        lambda: ScoreMod(lambda s, b, h, q_idx, kv_idx: torch.tanh(s)),
        lambda: [Softcap(5.0), ALiBi(torch.tensor([0.5, 0.25]))],
    ],
    ids=["score_mod without tensors", "softcap then alibi"],
)
def test_compiled_gradients_through_scores_that_need_autograd(score):
    """Their input gradient comes from autograd inside the op's backward, which once
    ran with autograd off ("element 0 of tensors does not require grad")."""
    score = score()
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return mhsa.attention(q, k, v, score=score, causal=True, backend="flash")

    eager = torch.autograd.grad(f(q, k, v).sum(), (q, k, v))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for got, want in zip(
        torch.autograd.grad(compiled(q, k, v).sum(), (q, k, v)), eager, strict=True
    ):
        assert max_error(got, want) < 1e-6


def test_a_score_mod_compiles_for_growing_keys():
    """Decoding: the first call tried the ScoreMod, the second (a symbolic length) once
    failed ("assume_constant_result argument conversion failed"), and every new length
    tried it again eagerly."""
    table = torch.randn(2)
    score = ScoreMod(lambda s, b, h, q_idx, kv_idx: s + table[h])
    graphs = CompileCounter()
    f = torch.compile(
        lambda q, k, v: mhsa.attention(q, k, v, score=score, causal=True),
        backend=graphs,
        fullgraph=True,
    )
    for kv_len in (8, 9, 10):
        q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, kv_len, 8)
        assert max_error(f(q, k, k), mhsa.attention(q, k, k, score=score, causal=True)) < 1e-6
    assert graphs.frame_count <= 2
    assert len(score._checked) <= 2


def test_patterns_holding_positions_compile_in_one_graph():
    """Their length checks read the tensors they hold once, when made: a check on the
    values per call broke fullgraph ("data-dependent branching")."""
    from mhsa import masks

    q, k, v = (torch.randn(2, 2, 20, 8) for _ in range(3))
    for pattern in (
        masks.KeyPadding([12, 20]),
        masks.GlobalTokens([0, 3]),
        masks.longformer(2, [0]),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda q, k, v, p=pattern: mhsa.attention(q, k, v, p), fullgraph=True, backend="eager"
        )
        assert torch.equal(compiled(q, k, v), mhsa.attention(q, k, v, pattern))
    with pytest.raises(ValueError, match="a length 21 exceeds S = 20"):
        mhsa.attention(q, k, v, masks.KeyPadding([12, 21]))
    with pytest.raises(ValueError, match="global token index 20 is out of range for 20 keys"):
        mhsa.attention(q, k, v, masks.GlobalTokens([0, 20]))


def test_a_score_mod_is_named_while_it_lives():
    """The same ScoreMod gives the same text (no recompile); the op rebuilds it from the
    text while it lives, reading the op's tensors, and says so once it is gone."""
    from mhsa.core.backends.op_scores import rebuild_score, score_spec

    weight = torch.ones(4)
    score = ScoreMod(lambda s, b, h, qi, ki: s * weight[h])
    text = score.name
    assert score.name == text != ScoreMod(score.fn).name != copy.deepcopy(score).name
    assert score_spec(score) == (text, [weight])
    rebuilt = rebuild_score(text, [torch.full((4,), 3.0)])
    scores, head = torch.ones(1, 4, 1, 1), torch.arange(4).view(1, 4, 1, 1)
    assert torch.equal(rebuilt(scores, 0, head, 0, 0), torch.full((1, 4, 1, 1), 3.0))
    del score, rebuilt
    gc.collect()
    with pytest.raises(ValueError, match="is gone"):
        rebuild_score(text, [weight])


def test_a_score_mod_is_checked_while_compiling():
    """The probe that rejects a function that is not elementwise runs eagerly while a
    graph is traced, so a bad ScoreMod fails under compile as it does in eager."""
    bad = ScoreMod(lambda s, b, h, qi, ki: s - s.amax(-1, keepdim=True))
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: mhsa.attention(q, k, v, score=bad), backend="eager", fullgraph=True
    )
    with mhsa.use_backend("flash"), pytest.raises(Exception, match="is not elementwise"):
        compiled(q, k, v)
