"""The timm cases, run by tests/integrations/test_timm.py in an interpreter that has
timm (this file's name keeps pytest from collecting it elsewhere): a converted model
equals timm's own (fused SDPA and manual paths), trains alike, and takes mhsa patterns
and score functions."""

from __future__ import annotations

import copy

import pytest
import torch

from mhsa.integrations import timm as timm_integration


def tiny_vit(**options):
    import timm

    config = dict(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5, **options
    )
    return timm.models.vision_transformer.VisionTransformer(**config).eval()


def set_fused(model, fused: bool) -> None:
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "manual"])
@pytest.mark.parametrize(
    "options", [{}, {"qk_norm": True, "qkv_bias": True}], ids=["plain", "qk_norm"]
)
def test_a_converted_vit_equals_timms_own(fused, options):
    theirs = tiny_vit(**options)
    set_fused(theirs, fused)
    ours = timm_integration.convert(copy.deepcopy(theirs))
    assert sum(isinstance(m, timm_integration.TimmAttention) for m in ours.modules()) == 2
    images = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=1e-5)


def test_gradients_equal_timms_own():
    theirs = tiny_vit().train()
    set_fused(theirs, False)
    ours = timm_integration.convert(copy.deepcopy(theirs)).train()
    images = torch.randn(2, 3, 32, 32)
    theirs(images).square().sum().backward()
    ours(images).square().sum().backward()
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_attn_mask_bool_and_float_as_timm_takes_them():
    from timm.layers import Attention

    theirs = Attention(48, num_heads=3, qkv_bias=True).eval()
    ours = timm_integration.TimmAttention(theirs)
    x = torch.randn(2, 7, 48)
    allowed = torch.rand(2, 1, 7, 7) > 0.3
    allowed[..., 0] = True  # every row sees a key
    additive = torch.randn(2, 3, 7, 7)
    for mask in (allowed, additive):
        torch.testing.assert_close(ours(x, attn_mask=mask), theirs(x, attn_mask=mask))
    torch.testing.assert_close(ours(x, is_causal=True), theirs(x, is_causal=True))


def test_a_windowed_vit_equals_timm_given_the_same_window_as_a_mask():
    """A pattern timm has no code for: each token sees tokens within 4 of it, [CLS]
    included (the pattern holds for the whole sequence of 1 + 16 tokens)."""
    from mhsa.core.masks import SlidingWindow

    theirs = tiny_vit()
    set_fused(theirs, False)
    window = SlidingWindow(4, 4)
    ours = timm_integration.convert(copy.deepcopy(theirs), pattern=window)
    images = torch.randn(2, 3, 32, 32)
    tokens = 1 + (32 // 8) ** 2
    positions = torch.arange(tokens)
    dense = (positions.view(-1, 1) - positions.view(1, -1)).abs() <= 4
    torch.testing.assert_close(ours(images), theirs.forward(images, attn_mask=dense))
    assert not torch.allclose(ours(images), theirs(images))  # the window changed something


def test_score_functions_reach_timm_models():
    from mhsa.core.scores import ALiBi

    theirs = tiny_vit()
    ours = timm_integration.convert(copy.deepcopy(theirs), score=ALiBi(torch.full((3,), 0.5)))
    images = torch.randn(2, 3, 32, 32)
    assert not torch.allclose(ours(images), theirs(images))
    assert torch.isfinite(ours(images)).all()


def test_unsupported_layers_and_arguments_are_clear_errors():
    import timm
    from timm.layers import Attention

    with pytest.raises(ValueError, match="has no timm.layers.Attention"):
        timm_integration.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="pattern must be an mhsa.masks pattern"):
        timm_integration.TimmAttention(Attention(48, num_heads=3), pattern="window")
    eva = timm.create_model("eva02_tiny_patch14_224", pretrained=False)
    with pytest.raises(ValueError, match="EvaAttention"):
        timm_integration.convert(eva)
    vit = tiny_vit()  # a bad backend or score is refused before any layer is replaced
    for options, error in (({"backend": "sdpa "}, ValueError), ({"score": "alibi"}, TypeError)):
        with pytest.raises(error, match="backend must be|score must be"):
            timm_integration.convert(vit, **options)
    assert not any(isinstance(m, timm_integration.TimmAttention) for m in vit.modules())
    hybrid = tiny_vit()  # BotNet's BottleneckAttn beside it was left as timm's, silently
    hybrid.head = timm.layers.bottleneck_attn.BottleneckAttn(48, 48, feat_size=(2, 2))
    with pytest.raises(ValueError, match="BottleneckAttn"):
        timm_integration.convert(hybrid)
    with pytest.raises(TypeError, match="attn_mask must be bool .* or float"):
        timm_integration.convert(tiny_vit()).blocks[0].attn(
            torch.randn(1, 5, 48), attn_mask=torch.ones(1, 1, 5, 5, dtype=torch.long)
        )


def test_a_model_in_eval_mode_stays_in_eval_mode():
    """convert() of an eval-mode ViT with attn_drop: the new layers were in training
    mode and dropped attention weights at inference (0.08 off, two calls differing)."""
    vit = tiny_vit(attn_drop_rate=0.5)  # (eval)
    x = torch.randn(2, 3, 32, 32)
    want = vit(x)
    converted = timm_integration.convert(copy.deepcopy(vit))
    assert not any(m.training for m in converted.modules())
    torch.testing.assert_close(converted(x), want, atol=1e-5, rtol=1e-5)


def timm_diff_attention(**options):
    from timm.layers.diff_attention import DiffAttention as TimmDiffAttention

    torch.manual_seed(0)
    theirs = TimmDiffAttention(48, num_heads=3, **options)
    with torch.no_grad():  # timm starts the sub-norm at ones; any weight must carry over
        theirs.sub_norm.weight.uniform_(0.5, 1.5)
    return theirs


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "manual"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("options", [{}, {"qkv_bias": True, "depth": 5}], ids=["plain", "bias"])
def test_diff_attention_equals_timms_forward_and_backward(fused, causal, options):
    """mhsa.nn.DiffAttention with timm's weights: outputs and every weight's gradient
    within 1e-5 of timm's DiffAttention (float32)."""
    from mhsa.nn import DiffAttention

    theirs = timm_diff_attention(**options)
    theirs.fused_attn = fused
    ours = DiffAttention.from_timm(copy.deepcopy(theirs))
    assert ours.lambda_init == theirs.lambda_init
    x = torch.randn(2, 13, 48)
    got, want = ours(x, causal=causal), theirs(x, is_causal=causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_diff_attention_takes_timms_bool_mask():
    from mhsa.nn import DiffAttention

    theirs = timm_diff_attention()
    ours = DiffAttention.from_timm(copy.deepcopy(theirs))
    x = torch.randn(2, 9, 48)
    allowed = torch.rand(2, 1, 9, 9) > 0.3
    allowed[..., 0] = True
    torch.testing.assert_close(ours(x, mask=allowed), theirs(x, attn_mask=allowed))


def test_diff_attention_from_timm_refuses_what_it_cannot_copy():
    from mhsa.nn import DiffAttention

    cases = ({"qk_norm": True}, "q_norm"), ({"dual_lambda": True}, "dual_lambda")
    cases += (({"proj_drop": 0.5}, "proj_drop=0.5"),)  # (it was dropped silently)
    for options, name in cases:
        with pytest.raises(ValueError, match=name):
            DiffAttention.from_timm(timm_diff_attention(**options))
    evaluating = timm_diff_attention(attn_drop=0.3).eval()  # (the copy trained: dropout)
    assert not DiffAttention.from_timm(evaluating).training
