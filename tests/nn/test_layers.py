"""Transformer layers and stacks: equivalence with torch.nn in eval mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import max_error
from mhsa.nn import (
    FeedForward,
    GatedFeedForward,
    MultiHeadAttention,
    RMSNorm,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    encoder_layers,
    from_torch_masks,
)

D_MODEL, HEADS, FF = 32, 4, 48


def randomize(module: nn.Module) -> nn.Module:
    """Perturb every parameter so norms and biases are not at their defaults."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module.eval()


def padding_mask(batch: int, length: int) -> torch.Tensor:
    """torch convention: True = padding."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, length - 3 :] = True
    return mask


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    theirs = randomize(
        nn.TransformerEncoderLayer(
            D_MODEL,
            HEADS,
            FF,
            dropout=0.1,
            activation=activation,
            batch_first=True,
            norm_first=norm_first,
        )
    )
    ours = TransformerEncoderLayer.from_torch(theirs).eval()
    x = torch.randn(2, 10, D_MODEL)
    padding = padding_mask(2, 10)
    causal = nn.Transformer.generate_square_subsequent_mask(10).isinf()
    mask, kpm, _ = from_torch_masks(causal, padding)
    expected = theirs(x, src_mask=causal, src_key_padding_mask=padding)
    assert max_error(ours(x, mask=mask, key_padding_mask=kpm), expected) < 1e-5
    assert max_error(ours(x, causal=True, key_padding_mask=kpm), expected) < 1e-5


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    theirs = randomize(
        nn.TransformerDecoderLayer(D_MODEL, HEADS, FF, batch_first=True, norm_first=norm_first)
    )
    ours = TransformerDecoderLayer.from_torch(theirs).eval()
    tgt, memory = torch.randn(2, 7, D_MODEL), torch.randn(2, 11, D_MODEL)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(7).isinf()
    memory_padding = padding_mask(2, 11)
    expected = theirs(tgt, memory, tgt_mask=tgt_mask, memory_key_padding_mask=memory_padding)
    _, memory_kpm, _ = from_torch_masks(None, memory_padding)
    out = ours(tgt, memory, causal=True, memory_key_padding_mask=memory_kpm)
    assert max_error(out, expected) < 1e-5


def test_stacks_and_transformer_match_torch():
    theirs = randomize(
        nn.Transformer(
            D_MODEL,
            HEADS,
            num_encoder_layers=2,
            num_decoder_layers=3,
            dim_feedforward=FF,
            batch_first=True,
        )
    )
    ours = Transformer.from_torch(theirs).eval()
    assert len(ours.encoder.layers) == 2 and len(ours.decoder.layers) == 3
    src, tgt = torch.randn(2, 9, D_MODEL), torch.randn(2, 6, D_MODEL)
    src_padding = padding_mask(2, 9)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(6).isinf()
    expected = theirs(
        src,
        tgt,
        tgt_mask=tgt_mask,
        src_key_padding_mask=src_padding,
        memory_key_padding_mask=src_padding,
    )
    _, kpm, _ = from_torch_masks(None, src_padding)
    out = ours(src, tgt, tgt_causal=True, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
    assert out.shape == (2, 6, D_MODEL)
    assert max_error(out, expected) < 1e-5

    encoder = TransformerEncoder.from_torch(theirs.encoder).eval()
    assert max_error(encoder(src), theirs.encoder(src)) < 1e-5
    decoder = TransformerDecoder.from_torch(theirs.decoder).eval()
    memory = torch.randn(2, 9, D_MODEL)
    assert max_error(decoder(tgt, memory), theirs.decoder(tgt, memory)) < 1e-5


def test_torch_float_masks_reach_every_attention_as_biases():
    """torch's layers take float (additive) masks; ours had no bias= to take what
    from_torch_masks makes of them (a float mask could only be dropped: 0.41 off)."""
    theirs = randomize(
        nn.Transformer(D_MODEL, HEADS, 1, 2, dim_feedforward=FF, batch_first=True)
    ).eval()
    ours = Transformer.from_torch(theirs)
    src, tgt = torch.randn(2, 9, D_MODEL), torch.randn(2, 6, D_MODEL)
    src_mask = -torch.rand(9, 9) * 3
    tgt_mask = -torch.rand(6, 6) * 3
    memory_mask = -torch.rand(6, 9) * 3
    src_padding = torch.zeros(2, 9).index_fill_(1, torch.tensor([8]), -torch.inf)
    expected = theirs(
        src,
        tgt,
        src_mask=src_mask,
        tgt_mask=tgt_mask,
        memory_mask=memory_mask,
        src_key_padding_mask=src_padding,
        memory_key_padding_mask=src_padding,
    )
    _, _, src_bias = from_torch_masks(src_mask, src_padding)
    _, _, memory_bias = from_torch_masks(memory_mask, src_padding)
    _, _, tgt_bias = from_torch_masks(tgt_mask)
    out = ours(src, tgt, src_bias=src_bias, tgt_bias=tgt_bias, memory_bias=memory_bias)
    assert max_error(out, expected) < 1e-5


def test_stack_builds_independent_copies():
    layer = TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FF)
    encoder = TransformerEncoder(layer, 3, nn.LayerNorm(D_MODEL))
    assert len(encoder.layers) == 3
    assert (
        encoder.layers[0].self_attn.q_proj.weight is not encoder.layers[1].self_attn.q_proj.weight
    )
    model = Transformer(
        D_MODEL,
        HEADS,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=FF,
        num_kv_heads=2,
        norm_first=True,
    )
    out = model(torch.randn(2, 5, D_MODEL), torch.randn(2, 4, D_MODEL), tgt_causal=True)
    assert out.shape == (2, 4, D_MODEL)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_encoder_layers_are_initialised_each_on_its_own():
    torch.manual_seed(0)
    layers = encoder_layers(3, D_MODEL, HEADS, dim_feedforward=FF, norm_first=True)
    torch.manual_seed(0)
    one_by_one = [
        TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FF, norm_first=True)
        for _ in range(3)
    ]
    assert isinstance(layers, nn.ModuleList) and len(layers) == 3
    for ours, expected in zip(layers, one_by_one, strict=True):
        assert ours.attn_block.norm_first
        for a, b in zip(ours.state_dict().values(), expected.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(layers[0].self_attn.q_proj.weight, layers[1].self_attn.q_proj.weight)


def test_feed_forward_and_bad_activation():
    ff = FeedForward(8, 16, activation="gelu")
    x = torch.randn(3, 8)
    expected = ff.linear2(torch.nn.functional.gelu(ff.linear1(x)))
    assert torch.allclose(ff(x), expected)
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(8, 16, activation="swish")


def test_gated_feed_forward():
    ff = GatedFeedForward(8, 16, activation="silu")
    x = torch.randn(3, 8)
    expected = ff.down(torch.nn.functional.silu(ff.gate(x)) * ff.up(x))
    assert ff.gate.bias is None and torch.allclose(ff(x), expected)
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedFeedForward(8, 16, activation="swish")


def test_rms_norm_matches_torch_and_gemma_offset():
    x = torch.randn(2, 5, 8)
    norm = randomize(RMSNorm(8, eps=1e-5))
    expected = torch.nn.functional.rms_norm(x, (8,), norm.weight, eps=1e-5)
    assert max_error(norm(x), expected) < 1e-6
    plain = torch.nn.functional.rms_norm(x, (8,), eps=1e-6)
    gemma = RMSNorm(8, unit_offset=True)  # scales by 1 + weight, weight starting at 0
    assert torch.equal(gemma.weight, torch.zeros(8)) and max_error(gemma(x), plain) < 1e-6
    with torch.no_grad():
        gemma.weight.fill_(0.5)
    half = gemma.half()  # computed in float32, returned in the input's dtype
    assert half(x.half()).dtype == torch.float16
    assert max_error(half(x.half()), 1.5 * plain) < 1e-2
    with pytest.raises(ValueError, match="last axis is 6"):
        norm(torch.randn(2, 6))
    for bad in (0, True, 8.0):
        with pytest.raises(ValueError, match=rf"^dim must be an int >= 1, got {bad!r}$"):
            RMSNorm(bad)


def test_training_mode_applies_dropout():
    layer = TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FF, dropout=0.5).train()
    x = torch.randn(2, 6, D_MODEL)
    assert max_error(layer(x), layer(x)) > 1e-3
    layer.eval()
    assert max_error(layer(x), layer(x)) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_from_torch_keeps_the_source_dtype(dtype):
    theirs = randomize(
        nn.Transformer(D_MODEL, HEADS, 1, 1, dim_feedforward=FF, batch_first=True)
    ).to(dtype)
    ours = Transformer.from_torch(theirs).eval()
    assert {p.dtype for p in ours.parameters()} == {dtype}
    src, tgt = torch.randn(2, 5, D_MODEL, dtype=dtype), torch.randn(2, 4, D_MODEL, dtype=dtype)
    bound = 1e-12 if dtype == torch.float64 else 0.1
    assert max_error(ours(src, tgt), theirs(src, tgt)) < bound


def test_from_torch_keeps_the_mode_and_refuses_another_class():
    """Copies were always in training mode (dropout on under an eval source), and an
    encoder layer copied a decoder layer, dropping its cross-attention."""
    source = nn.Transformer(D_MODEL, HEADS, 1, 1, dim_feedforward=FF, batch_first=True)
    for training in (False, True):
        source.train(training)
        copies = (
            Transformer.from_torch(source),
            TransformerEncoder.from_torch(source.encoder),
            TransformerDecoderLayer.from_torch(source.decoder.layers[0]),
            MultiHeadAttention.from_torch(source.encoder.layers[0].self_attn),
        )
        assert all(m.training is training for c in copies for m in c.modules())
    refused = (
        (
            TransformerEncoderLayer,
            source.decoder.layers[0],
            "copies a torch.nn.TransformerEncoderLayer",
        ),
        (TransformerDecoderLayer, source.encoder.layers[0], "got TransformerEncoderLayer"),
        (TransformerEncoder, source.decoder, "copies a torch.nn.TransformerEncoder, got"),
        (Transformer, source.encoder, "must be a torch.nn.Transformer, got TransformerEncoder"),
    )
    for ours, theirs, message in refused:
        with pytest.raises(TypeError, match=message):
            ours.from_torch(theirs)


def test_from_torch_copies_layers_without_biases():
    """torch's bias=False drops the layer norms' biases too; so does ours."""
    theirs = randomize(nn.Transformer(D_MODEL, HEADS, 1, 2, FF, batch_first=True, bias=False))
    ours = Transformer.from_torch(theirs).eval()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    built = Transformer(D_MODEL, HEADS, num_encoder_layers=1, num_decoder_layers=2, bias=False)
    assert sorted(n for n, _ in built.named_parameters() if "norm" in n and "bias" in n) == []
    src, tgt = torch.randn(2, 5, D_MODEL), torch.randn(2, 4, D_MODEL)
    assert max_error(ours(src, tgt), theirs(src, tgt)) < 1e-5


def test_from_torch_masks_splits_a_per_head_attn_mask():
    theirs = randomize(nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True))
    ours = TransformerEncoderLayer.from_torch(theirs).eval()
    x = torch.randn(2, 6, D_MODEL)
    per_head = torch.rand(2 * HEADS, 6, 6) > 0.6  # torch: True = masked
    per_head[:, :, 0] = False
    mask, _, _ = from_torch_masks(per_head, num_heads=HEADS)
    assert mask.shape == (2, HEADS, 6, 6)
    assert max_error(ours(x, mask=mask), theirs(x, src_mask=per_head)) < 1e-5
    with pytest.raises(ValueError, match="pass num_heads="):
        from_torch_masks(per_head)
    with pytest.raises(ValueError, match="num_heads"):
        from_torch_masks(per_head, num_heads=3)


def test_a_negative_layer_count_is_refused():
    """range(-3) is empty: a stack of -3 layers was built with none."""
    from mhsa.nn import encoder_layers

    layer = TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FF)
    with pytest.raises(ValueError, match="num_layers must be an int >= 0, got -3"):
        TransformerEncoder(layer, -3)
    with pytest.raises(ValueError, match="num_layers must be an int >= 0, got -2"):
        encoder_layers(-2, D_MODEL, HEADS)
    assert len(TransformerEncoder(layer, 0).layers) == 0  # (as torch's: the identity)
