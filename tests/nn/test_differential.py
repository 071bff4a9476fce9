"""DiffAttention: equal to the paper's formula written out in float64 (the timm oracle
is in tests/integrations/timm_cases.py), masks, caches and errors."""

from __future__ import annotations

import math

import pytest
import torch

from mhsa.cache import KVCache
from mhsa.core.masks import SlidingWindow
from mhsa.nn import DiffAttention
from mhsa.nn.differential import depth_lambda_init


def formula(module: DiffAttention, x, allowed=None):
    """The Differential Transformer's attention written out (no mhsa code but the module's
    weights): two softmax maps over paired heads, subtracted, sub-norm, scale, proj."""
    batch, length, width = x.shape
    heads, d = module.num_heads, width // module.num_heads // 2
    q, k, v = torch.nn.functional.linear(x, module.qkv.weight, module.qkv.bias).chunk(3, -1)
    q = q.reshape(batch, length, 2 * heads, d).transpose(1, 2)
    k = k.reshape(batch, length, 2 * heads, d).transpose(1, 2)
    v = v.reshape(batch, length, heads, 2 * d).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    maps = scores.softmax(-1).view(batch, heads, 2, length, length)
    lam = (
        torch.exp((module.lambda_q1 * module.lambda_k1).sum())
        - torch.exp((module.lambda_q2 * module.lambda_k2).sum())
        + module.lambda_init
    )
    out = (maps[:, :, 0] - lam * maps[:, :, 1]) @ v
    out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + 1e-5) * module.sub_norm.weight
    out = (out * (1 - module.lambda_init)).transpose(1, 2).reshape(batch, length, width)
    return torch.nn.functional.linear(out, module.proj.weight, module.proj.bias)


def module64(**options) -> DiffAttention:
    torch.manual_seed(0)
    module = DiffAttention(48, 3, qkv_bias=True, **options).double()
    with torch.no_grad():
        module.sub_norm.weight.uniform_(0.5, 1.5)
    return module


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 13])
def test_equals_the_formula_forward_and_backward(causal, length):
    ours = module64(depth=3)
    theirs = module64(depth=3)
    x = torch.randn(2, length, 48, dtype=torch.float64)
    allowed = torch.ones(length, length).tril().bool() if causal else None
    torch.testing.assert_close(ours(x, causal=causal), formula(theirs, x, allowed))
    ours(x, causal=causal).square().sum().backward()
    formula(theirs, x, allowed).square().sum().backward()
    # (mhsa.nn.RMSNorm, the sub-norm, computes in float32 whatever the input dtype)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_pattern_and_key_padding_mask_as_a_dense_mask():
    module = module64()
    x = torch.randn(2, 11, 48, dtype=torch.float64)
    padding = torch.ones(2, 11, dtype=torch.bool)
    padding[1, 8:] = False
    window = SlidingWindow(3, 0)
    allowed = window.dense(11, 11) & padding[:, None, None, :]
    got = module(x, mask=window, key_padding_mask=padding)
    torch.testing.assert_close(got, formula(module, x, allowed))


def test_cached_decoding_equals_full_recompute():
    module = module64()
    x = torch.randn(2, 10, 48, dtype=torch.float64)
    cache = KVCache(2, 6, 10, 8, dtype=torch.float64)  # 2H heads of E / H / 2
    steps = [module(x[:, :4], causal=True, cache=cache)]
    steps += [module(x[:, t : t + 1], causal=True, cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), module(x, causal=True))


def test_lambda_init_follows_depth():
    assert DiffAttention(16, 2).lambda_init == pytest.approx(0.2)
    assert DiffAttention(16, 2, depth=5).lambda_init == pytest.approx(depth_lambda_init(5))
    assert depth_lambda_init(5) == pytest.approx(0.8 - 0.6 * math.exp(-1.5))
    assert DiffAttention(16, 2, lambda_init=0.5).lambda_init == 0.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lambda_init": float("nan")}, "lambda_init must be a finite number"),
        ({"lambda_init": float("inf")}, "lambda_init must be a finite number"),
        ({"embed_dim": 18}, r"embed_dim \(18\) must be a multiple of 2 \* num_heads"),
        ({"num_heads": 0}, "num_heads must be an int >= 1"),
        ({"depth": -1}, "depth must be an int >= 0"),
        ({"dropout": 1.0}, "dropout must be in"),
    ],
)
def test_bad_sizes_are_one_line_errors(options, message):
    arguments = {"embed_dim": 16, "num_heads": 2, **options}
    with pytest.raises(ValueError, match=message) as error:
        DiffAttention(arguments.pop("embed_dim"), arguments.pop("num_heads"), **arguments)
    assert "\n" not in str(error.value)


def test_wrong_input_width_names_it():
    with pytest.raises(ValueError, match=r"x must be \(batch, length, 16\)"):
        DiffAttention(16, 2)(torch.randn(1, 3, 8))
