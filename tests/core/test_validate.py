"""Every bad input gets a ValueError/TypeError that names the argument."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import make_qkv


def call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = make_qkv(2, 4, 2, 5, 6, 8)
    return mhsa.attention(
        dq if q is None else q, dk if k is None else k, dv if v is None else v, **kwargs
    )


def test_wrong_rank():
    with pytest.raises(ValueError, match=r"q must be 4-D .*unsqueeze"):
        call(q=torch.randn(2, 5, 8))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        call(k=[[1.0]])


def test_batch_mismatch():
    with pytest.raises(ValueError, match="batch size differs"):
        call(k=torch.randn(3, 2, 6, 8), v=torch.randn(3, 2, 6, 8))


def test_head_dim_mismatch():
    with pytest.raises(ValueError, match="head_dim differs: q has 8, k has 7"):
        call(k=torch.randn(2, 2, 6, 7))


def test_kv_length_mismatch():
    with pytest.raises(ValueError, match="k and v must have the same length"):
        call(v=torch.randn(2, 2, 5, 8))


def test_heads_not_divisible():
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple .*\(3\)"):
        call(k=torch.randn(2, 3, 6, 8), v=torch.randn(2, 3, 6, 8))


def test_dtype_mismatch():
    with pytest.raises(TypeError, match="share one dtype"):
        call(k=torch.randn(2, 2, 6, 8, dtype=torch.float64))


def test_integer_inputs():
    with pytest.raises(TypeError, match="q must be a floating point"):
        call(q=torch.ones(2, 4, 5, 8, dtype=torch.long))


def test_device_mismatch():
    meta = torch.empty(2, 2, 6, 8, device="meta")
    with pytest.raises(ValueError, match="one device"):
        call(k=meta, v=meta)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.float32])
def test_non_bool_mask(dtype):
    with pytest.raises(TypeError, match=r"mask must have dtype torch.bool \(True = may attend\)"):
        call(mask=torch.ones(5, 6, dtype=dtype))


def test_mask_does_not_broadcast():
    with pytest.raises(ValueError, match=r"mask of shape \(5, 5\) does not broadcast"):
        call(mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        call(mask=torch.ones(1, 2, 4, 5, 6, dtype=torch.bool))


def test_bias_does_not_broadcast():
    with pytest.raises(ValueError, match=r"bias of shape \(3, 5, 6\) does not broadcast"):
        call(bias=torch.zeros(3, 5, 6))


def test_non_float_bias():
    with pytest.raises(TypeError, match="bias must be a floating point"):
        call(bias=torch.zeros(5, 6, dtype=torch.bool))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        call(dropout_p=p)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        call(scale=scale)


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match="causal must be True or False"):
        call(causal=torch.ones(5, 6, dtype=torch.bool))


def test_attention_weights_validates_too():
    q, k, _ = make_qkv()
    with pytest.raises(TypeError, match="mask must have dtype torch.bool"):
        mhsa.attention_weights(q, k, torch.ones(7, 7, dtype=torch.int32))
