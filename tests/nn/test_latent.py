"""LatentAttention (multi-head latent attention): both forms against a float64 formula
written here, absorbed decoding equal to the expanded form, the latent cache in the
contiguous, static and paged caches equal to full recomputation, its bytes per token,
DeepSeek-V3's routing against transformers' router, and bad sizes rejected."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from helpers import cpu_backends, max_error
from mhsa.cache import KVCache, PagedKVCache, StaticKVCache
from mhsa.core.masks import SlidingWindow
from mhsa.nn import LatentAttention
from mhsa.nn.moe import route
from mhsa.nn.positional import RotaryEmbedding
from optional import needs

E, H, RANK, ROPE, NOPE, V = 40, 4, 24, 8, 10, 12  # nothing a power of two but ROPE


def make(dtype=torch.float32, **options) -> LatentAttention:
    options = {"q_lora_rank": 20, "rope_interleave": True, **options}
    torch.manual_seed(0)
    module = LatentAttention(
        E,
        H,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V,
        dtype=dtype,
        **options,
    )
    with torch.no_grad():  # norms away from 1, so that applying them is tested
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module.eval()


def golden(m: LatentAttention, x: Tensor, base: float = 10000.0) -> Tensor:
    """The module's output in float64, written from the formula: per-head keys and
    values expanded from the latent, rotate-half rotary at positions 0..L-1 on the
    (de-interleaved) rotary channels, causal softmax."""
    w = {name: p.detach().double() for name, p in m.named_parameters()}
    x = x.double()
    batch, length, _ = x.shape

    def rms(t: Tensor, weight: Tensor) -> Tensor:
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6) * weight

    if m.q_proj is not None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms(x @ w["q_a_proj.weight"].T, w["q_a_norm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(batch, length, H, NOPE + ROPE).transpose(1, 2)
    kv = x @ w["kv_a_proj.weight"].T
    latent, k_rope = rms(kv[..., :RANK], w["kv_norm.weight"]), kv[..., RANK:]
    up = (latent @ w["kv_b_proj.weight"].T).view(batch, length, H, NOPE + V).transpose(1, 2)
    inv = base ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angle = torch.arange(length, dtype=torch.float64)[:, None] * inv  # (L, ROPE / 2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)

    def rotate(t: Tensor) -> Tensor:
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)  # interleaved pairs
        half = torch.cat((-t[..., ROPE // 2 :], t[..., : ROPE // 2]), dim=-1)
        return t * cos + half * sin

    k = torch.cat((up[..., :NOPE], rotate(k_rope)[:, None].expand(-1, H, -1, -1)), dim=-1)
    q = torch.cat((q[..., :NOPE], rotate(q[..., NOPE:])), dim=-1)
    scores = q @ k.transpose(-1, -2) * (NOPE + ROPE) ** -0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, -torch.inf).softmax(-1)
    out = (probs @ up[..., NOPE:]).transpose(1, 2).reshape(batch, length, H * V)
    return out @ w["out_proj.weight"].T


@pytest.mark.parametrize("q_lora_rank", [None, 20])
@pytest.mark.parametrize("length", [1, 13])
def test_both_forms_match_the_formula(q_lora_rank, length):
    """float32 within 1e-5 of the float64 formula; float64 within 1e-6 of it (the
    library rotates in float32 whatever the dtype), and its two forms within 1e-12."""
    rotary = RotaryEmbedding(ROPE)
    for dtype, tol, same in ((torch.float32, 1e-5, 1e-5), (torch.float64, 1e-6, 1e-12)):
        m = make(dtype, q_lora_rank=q_lora_rank)
        x = torch.randn(2, length, E, dtype=dtype)
        want = golden(m, x)
        expanded = m(x, causal=True, position=rotary, absorbed=False)
        absorbed = m(x, causal=True, position=rotary, absorbed=True)
        assert max_error(expanded, want) < tol
        assert max_error(absorbed, want) < tol
        assert max_error(absorbed, expanded) < same


@pytest.mark.parametrize("backend", cpu_backends())
def test_absorbed_equals_expanded_on_every_backend(backend):
    m = make(backend=backend, rope_interleave=False)
    x = torch.randn(3, 29, E)
    padding = torch.ones(3, 29, dtype=torch.bool)
    padding[1, :5] = False  # left padding
    for mask in (None, SlidingWindow(6, 0)):
        call = {"mask": mask, "key_padding_mask": padding, "causal": True}
        call["position"] = RotaryEmbedding(ROPE)
        expanded = m(x, absorbed=False, **call)
        assert max_error(m(x, absorbed=True, **call), expanded) < 1e-5


def _decode(m, x, cache_at, prefill: int) -> Tensor:
    """Prefill x[:, :prefill], then one token per step; cache_at(step) gives the cache."""
    rotary = RotaryEmbedding(ROPE)
    outs = [m(x[:, :prefill], causal=True, position=rotary, cache=cache_at(0))]
    for t in range(prefill, x.shape[1]):
        outs.append(m(x[:, t : t + 1], causal=True, position=rotary, cache=cache_at(t)))
    return torch.cat(outs, dim=1)


@torch.no_grad()
def test_cached_decoding_equals_full_recompute():
    m = make()
    x = torch.randn(2, 12, E)
    full = m(x, causal=True, position=RotaryEmbedding(ROPE))
    cache = KVCache(2, 1, 16, m.cache_width, 0)
    assert max_error(_decode(m, x, lambda t: cache, 7), full) < 1e-5
    # static: after a KVCache's prefill, every step sees all max_len slots
    prefilled = KVCache(2, 1, 16, m.cache_width, 0)
    static = []

    def static_at(t: int):
        if t == 0:
            return prefilled
        if not static:
            static.append(StaticKVCache(prefilled))
        return static[0]

    assert max_error(_decode(m, x, static_at, 7), full) < 1e-5
    # paged: blocks of 4 tokens, the two sequences' pages interleaved in the pool
    pool = PagedKVCache(1, 1, m.cache_width, num_blocks=12, block_size=4, value_dim=0)
    ids = [pool.add_sequence(list(range(7 + b))) for b in range(2)]
    paged = _decode(m, x, lambda t: pool.batch(ids, 7 if t == 0 else 1)[0], 7)
    assert max_error(paged, full) < 1e-5


def test_left_padded_decoding_matches_each_sequence_alone():
    m = make()
    rotary = RotaryEmbedding(ROPE)
    x = torch.randn(2, 9, E)
    cache = KVCache(2, 1, 9, m.cache_width, 0)
    cache.set_padding(torch.tensor([0, 3]))
    with torch.no_grad():
        batched = _decode(m, x, lambda t: cache, 6)
        alone = m(x[1:, 3:], causal=True, position=rotary)
    assert max_error(batched[1, 3:], alone[0]) < 1e-5


def test_cache_bytes_per_token_match_the_formula():
    m = make()
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache(3, 1, 10, m.cache_width, 0, dtype=dtype)
        held = (cache.k.nbytes + cache.v.nbytes) / (3 * 10)
        assert held == m.cache_bytes_per_token(dtype) == (RANK + ROPE) * dtype.itemsize
    with torch.device("meta"):  # DeepSeek-V3's sizes: 576 values per token and layer
        v3 = LatentAttention(
            7168,
            128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            q_lora_rank=1536,
            dtype=torch.bfloat16,
        )
    assert v3.cache_width == 576
    assert (
        v3.cache_bytes_per_token() == 576 * 2
    )  # against 128 * (192 + 128) * 2 for its heads' k and v


def test_gradients_flow_in_both_forms():
    m = make(torch.float64)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    grads = []
    for absorbed in (False, True):
        m.zero_grad()
        m(
            x, causal=True, position=RotaryEmbedding(ROPE), absorbed=absorbed
        ).square().sum().backward()
        grads.append(m.kv_b_proj.weight.grad.clone())
    assert max_error(grads[0], grads[1]) < 1e-10


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("kv_lora_rank", 0),
        ("qk_rope_head_dim", -8),
        ("qk_rope_head_dim", 7),
        ("qk_nope_head_dim", 0),
        ("v_head_dim", 0),
        ("q_lora_rank", 0),
        ("num_heads", 0),
        ("scale", -1.0),
    ],
)
def test_bad_sizes_are_rejected(name, value):
    sizes = {
        "embed_dim": E,
        "num_heads": H,
        "kv_lora_rank": RANK,
        "qk_rope_head_dim": ROPE,
        "qk_nope_head_dim": NOPE,
        "v_head_dim": V,
        name: value,
    }
    embed, heads = sizes.pop("embed_dim"), sizes.pop("num_heads")
    with pytest.raises(ValueError, match=name) as error:
        LatentAttention(embed, heads, **sizes)
    assert "\n" not in str(error.value)


def test_bad_calls_are_rejected():
    m = make()
    x = torch.randn(1, 4, E)
    with pytest.raises(ValueError, match="self-attention"):
        m(x, torch.randn(1, 4, E))
    with pytest.raises(ValueError, match="query must be"):
        m(torch.randn(1, 4, E + 1))
    pool = PagedKVCache(1, 1, m.cache_width, num_blocks=4, block_size=4, value_dim=0)
    layer = pool.batch([pool.add_sequence([1, 2, 3, 4])], 4)[0]
    with pytest.raises(ValueError, match="absorbed"), torch.no_grad():
        m(x, causal=True, cache=layer, absorbed=False)


def test_routing_matches_transformers():
    transformers = needs("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=12,
        num_experts_per_tok=4,
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    torch.manual_seed(1)
    for norm in (True, False):
        config.norm_topk_prob = norm
        router = DeepseekV3TopkRouter(config)
        with torch.no_grad():
            router.weight.normal_()
            router.e_score_correction_bias.normal_(0, 0.3)
        x = torch.randn(64, 16)
        _, want_weights, want_index = router(x)
        weights, index = route(
            x,
            router.weight,
            router.e_score_correction_bias,
            top_k=4,
            n_group=3,
            topk_group=2,
            norm_topk_prob=norm,
            routed_scaling_factor=2.5,
        )
        order, want_order = index.argsort(-1), want_index.argsort(-1)
        assert torch.equal(index.gather(1, order), want_index.gather(1, want_order))
        assert max_error(weights.gather(1, order), want_weights.gather(1, want_order)) < 1e-6


def test_a_gpt_takes_it_in_place_of_multi_head_attention():
    """How the small GPT can use latent attention (GPT itself is unchanged here): each
    block's self_attn replaced, rotary positions of qk_rope_head_dim, latent caches."""
    from mhsa.models import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=4, d_model=32, position="rotary"))
    for block in gpt.blocks:
        block.self_attn = LatentAttention(
            32, 4, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8
        )
    gpt.attn_position = RotaryEmbedding(4)
    width = gpt.blocks[0].self_attn.cache_width
    gpt.make_caches = lambda batch, max_len: [
        KVCache(batch, 1, max_len, width, 0) for _ in gpt.blocks
    ]
    idx = torch.randint(0, 50, (2, 16))
    gpt.loss(idx[:, :-1], idx[:, 1:]).backward()
    assert all(p.grad is not None for p in gpt.blocks[0].self_attn.parameters())
    gpt.eval()
    prompts = [idx[0, :3], idx[1, :7]]
    cached = gpt.generate(prompts, 6, temperature=0.0)
    again = gpt.generate(prompts, 6, temperature=0.0, use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(cached, again, strict=True))
