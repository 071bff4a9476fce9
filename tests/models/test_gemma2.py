"""A Gemma-2-shaped check: transformers' Gemma2ForCausalLM with random weights against
the same blocks built from mhsa.nn (RMSNorm, MultiHeadAttention with Softcap,
GatedFeedForward), hidden states, softcapped logits and gradients, on the flash engine
and the reference backend.

Gemma 2 per layer: x += post_norm(attn(pre_norm(x))); x += post_ff_norm(ff(pre_ff_norm(x)))
with (1 + weight) RMSNorms in float32, GeGLU, rotary, GQA, scale
query_pre_attn_scalar^-0.5, attention logits capped at 50 and a causal window of W keys
(the query's own included) on even layers. Embeddings are scaled by sqrt(hidden);
the tied LM head's logits are capped at 30.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from helpers import max_error
from mhsa.core.masks import SlidingWindow
from mhsa.core.scores import Softcap
from mhsa.nn import GatedFeedForward, MultiHeadAttention, RMSNorm
from mhsa.nn.positional import RotaryEmbedding
from optional import needs

BATCH, LENGTH, WINDOW = 2, 40, 8
CONFIG = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # 4 x 24 != 64, as in the real models
    query_pre_attn_scalar=32,  # not head_dim: the scale is Gemma's own
    sliding_window=WINDOW,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    pad_token_id=0,
)
QK_GAIN = 20.0  # q and k projections scaled up so raw scores reach the cap's range
TOL = 1e-4


class Gemma2Block(nn.Module):
    """One Gemma 2 decoder layer from mhsa.nn parts: (B, L, hidden) -> (B, L, hidden)."""

    def __init__(self, config, window: int | None, backend: str) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.attn_norm, self.post_attn_norm, self.ff_norm, self.post_ff_norm = (
            RMSNorm(width, eps=eps, unit_offset=True) for _ in range(4)
        )
        self.attn = MultiHeadAttention(
            width,
            config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            bias=False,
            scale=config.query_pre_attn_scalar**-0.5,
            score=Softcap(config.attn_logit_softcapping),
            backend=backend,
        )
        self.ff = GatedFeedForward(width, config.intermediate_size, activation="gelu_tanh")
        # transformers' window W: key j seen by query i when i - W < j <= i
        self.mask = None if window is None else SlidingWindow(window - 1, 0)

    def forward(self, x: Tensor, rotary: RotaryEmbedding) -> Tensor:
        h = self.attn(self.attn_norm(x), mask=self.mask, causal=True, position=rotary)
        x = x + self.post_attn_norm(h)
        return x + self.post_ff_norm(self.ff(self.ff_norm(x)))


class Gemma2(nn.Module):
    """Embedding * sqrt(hidden), the blocks, a final RMSNorm and the tied, capped head."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_parameters["rope_theta"])
        windows = [WINDOW if kind == "sliding_attention" else None for kind in config.layer_types]
        self.blocks = nn.ModuleList(Gemma2Block(config, w, backend) for w in windows)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, unit_offset=True)
        self.final_cap = config.final_logit_softcapping
        self.hidden_size = config.hidden_size

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """ids (B, L) -> (hidden states (B, L, hidden), logits (B, L, vocab))."""
        normalizer = torch.tensor(self.hidden_size**0.5, dtype=self.embed.weight.dtype)
        x = self.embed(ids) * normalizer
        for block in self.blocks:
            x = block(x, self.rotary)
        x = self.norm(x)
        logits = x @ self.embed.weight.T
        return x, self.final_cap * torch.tanh(logits / self.final_cap)


def weight_pairs(ours: Gemma2, hf) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(ours, transformers') for every parameter of the model."""
    pairs = [
        (ours.embed.weight, hf.model.embed_tokens.weight),
        (ours.norm.weight, hf.model.norm.weight),
    ]
    for block, layer in zip(ours.blocks, hf.model.layers, strict=True):
        pairs += [
            (block.attn_norm.weight, layer.input_layernorm.weight),
            (block.post_attn_norm.weight, layer.post_attention_layernorm.weight),
            (block.ff_norm.weight, layer.pre_feedforward_layernorm.weight),
            (block.post_ff_norm.weight, layer.post_feedforward_layernorm.weight),
            (block.attn.q_proj.weight, layer.self_attn.q_proj.weight),
            (block.attn.k_proj.weight, layer.self_attn.k_proj.weight),
            (block.attn.v_proj.weight, layer.self_attn.v_proj.weight),
            (block.attn.out_proj.weight, layer.self_attn.o_proj.weight),
            (block.ff.gate.weight, layer.mlp.gate_proj.weight),
            (block.ff.up.weight, layer.mlp.up_proj.weight),
            (block.ff.down.weight, layer.mlp.down_proj.weight),
        ]
    return pairs


@pytest.fixture(scope="module")
def hf_model():
    return make_hf(needs("transformers"))


def make_hf(transformers):
    """A random-weight Gemma2ForCausalLM of CONFIG in float32 with eager attention."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:  # norms away from their zero init, bigger scores
            norms = (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
            )
            for norm in norms:
                norm.weight.normal_(0.0, 0.3)
            layer.self_attn.q_proj.weight.mul_(QK_GAIN)
            layer.self_attn.k_proj.weight.mul_(QK_GAIN)
        model.model.norm.weight.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    return model


def ours_from(hf, backend: str) -> Gemma2:
    ours = Gemma2(hf.config, backend).eval()
    with torch.no_grad():
        for mine, theirs in weight_pairs(ours, hf):
            mine.copy_(theirs)
    return ours


def input_ids() -> Tensor:
    """(B, L) random token ids, the same on every call."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, CONFIG["vocab_size"], (BATCH, LENGTH), generator=generator)


def test_layer_types_alternate_with_the_window(hf_model):
    kinds = hf_model.config.layer_types
    assert kinds == ["sliding_attention", "full_attention"] * 2
    assert [layer.self_attn.sliding_window for layer in hf_model.model.layers] == [WINDOW, None] * 2


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_hidden_states_logits_and_grads_equal_transformers(hf_model, backend):
    ours, ids = ours_from(hf_model, backend), input_ids()
    out = hf_model(input_ids=ids, output_hidden_states=True)
    hidden, logits = ours(ids)
    # the last hidden state is the Gemma2Model's output, after the final norm
    assert max_error(hidden, out.hidden_states[-1]) < TOL
    assert max_error(logits, out.logits) < TOL
    assert logits.abs().max() > 0.5 * CONFIG["final_logit_softcapping"]  # the final cap bites

    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    hf_model.zero_grad()
    (out.logits * weights).sum().div(ids.numel()).backward()
    (logits * weights).sum().div(ids.numel()).backward()
    for mine, theirs in weight_pairs(ours, hf_model):
        assert theirs.grad.abs().max() > 100 * TOL  # every weight gets a real gradient
        assert max_error(mine.grad, theirs.grad) < TOL


def raw_scores(ours: Gemma2, ids: Tensor) -> list[Tensor]:
    """Each layer's scaled scores q k^T * scale before the cap, (B, H, L, L) over the keys
    it may attend (others 0)."""
    found = []
    with torch.no_grad():
        x = ours.embed(ids) * ours.hidden_size**0.5
        for block in ours.blocks:
            attn, h = block.attn, block.attn_norm(x)
            q = attn._split(attn.q_proj(h), attn.num_heads)  # (B, H, L, D)
            k = attn._split(attn.k_proj(h), attn.num_kv_heads)  # (B, H_kv, L, D)
            q, k = ours.rotary.rotate(q, k)
            k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)
            allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
            if block.mask is not None:
                allowed &= block.mask.dense(LENGTH, LENGTH)
            found.append((q @ k.transpose(-1, -2) * attn.scale).masked_fill(~allowed, 0.0))
            x = block(x, ours.rotary)
    return found


def test_the_softcap_and_the_window_matter(hf_model):
    """The comparison above cannot pass vacuously: raw scores reach the cap's range, and
    leaving out the softcap or the window changes the hidden states far beyond TOL."""
    ids = input_ids()
    ours = ours_from(hf_model, "flash")
    cap = CONFIG["attn_logit_softcapping"]
    assert all(s.abs().max() > 0.5 * cap for s in raw_scores(ours, ids))
    with torch.no_grad():
        expected = hf_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        assert max_error(ours(ids)[0], expected) < TOL
        for block in ours.blocks:
            block.attn.score = None
        assert max_error(ours(ids)[0], expected) > 100 * TOL
        ours = ours_from(hf_model, "flash")
        for block in ours.blocks:
            block.mask = None
        assert max_error(ours(ids)[0], expected) > 100 * TOL
