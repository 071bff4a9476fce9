"""attention() and attention_weights(): dispatch, empty inputs, weights, gradcheck, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mhsa
from helpers import cpu_backends, golden, make_qkv, max_error
from mhsa.core.attention import attention_and_weights
from mhsa.core.backends import AttentionSpec, select

spec = AttentionSpec.example


def test_auto_prefers_sdpa_where_its_fused_kernels_apply_else_flash():
    big = {"q_len": 1024, "kv_len": 1024}
    assert select(spec(**big), "auto").name == "sdpa"
    assert select(spec(causal=True, **big), "auto").name == "sdpa"
    assert select(spec(return_lse=True, **big), "auto").name == "flash"
    assert select(spec(has_mask=True, **big), "auto").name == "flash"
    assert select(spec(causal=True, q_len=1000, kv_len=1024), "auto").name == "flash"
    assert select(spec(dropout_p=0.1, **big), "auto").name == "flash"
    # small score matrices: materialising the mask is free, one sdpa call is fastest
    assert select(spec(has_mask=True, q_len=128, kv_len=128), "auto").name == "sdpa"
    assert select(spec(return_lse=True), "auto").name == "flash"


def test_named_backend_that_cannot_serve_raises_with_reason():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="sdpa.*logsumexp"):
        mhsa.attention(q, k, v, backend="sdpa", return_lse=True)


def test_unknown_backend_names_the_choices():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="reference"):
        mhsa.attention(q, k, v, backend="nope")
    with pytest.raises(ValueError, match="nope"), mhsa.use_backend("nope"):
        pass


def test_use_backend_forces_and_restores():
    with mhsa.use_backend("reference"):
        assert select(spec(), "auto").name == "reference"
        assert select(spec(), "sdpa").name == "reference"
    assert select(spec(), "auto").name == "sdpa"
    assert mhsa.backends() == ["sdpa", "flash", "flex", "triton", "reference", "ring"]


def test_empty_query_gives_empty_output():
    q, k, v = make_qkv(2, 4, 2, 0, 5, 8, value_dim=3)
    out, lse = mhsa.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 4, 0, 3) and lse.shape == (2, 4, 0)


def test_empty_keys_give_zeros():
    q, k, v = make_qkv(2, 4, 2, 5, 0, 8, value_dim=3)
    out, lse = mhsa.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 4, 5, 3) and (out == 0).all() and torch.isneginf(lse).all()
    assert (mhsa.attention_weights(q, k) == 0).all()


@pytest.mark.parametrize(("q_len", "kv_len"), [(0, 5), (5, 0), (0, 0)])
def test_empty_inputs_stay_in_the_graph_with_zero_gradients(q_len, kv_len):
    q, k, v = make_qkv(2, 4, 2, q_len, kv_len, 8, requires_grad=True)
    with torch.no_grad():
        q.fill_(float("nan"))  # nothing to attend: not even nan may leak
    out = mhsa.attention(q, k, v)
    assert out.requires_grad and not out.isnan().any()
    out.sum().backward()
    for tensor in (q, k, v):
        assert tensor.grad is not None and tensor.grad.shape == tensor.shape
        assert (tensor.grad == 0).all()


def test_attention_weights_match_the_formula():
    q, k, _ = make_qkv(2, 4, 2, 7, 9, 16)
    mask = torch.rand(2, 1, 7, 9) > 0.2
    mask[..., 0] = True
    bias = torch.randn(4, 7, 9)
    probs = mhsa.attention_weights(q, k, mask, bias=bias, causal=True)
    kk = k.repeat_interleave(2, dim=1)
    allowed = mask & torch.ones(7, 9, dtype=torch.bool).tril(2)
    scores = (q @ kk.transpose(-1, -2)) / 4 + bias
    expected = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1)
    assert probs.shape == (2, 4, 7, 9)
    assert max_error(probs, expected) < 1e-6
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 7))


def test_lse_matches_logsumexp_of_scores():
    q, k, v = make_qkv(1, 4, 1, 5, 6, 8)
    _, lse = mhsa.attention(q, k, v, return_lse=True)
    scores = q @ k.transpose(-1, -2) * 8**-0.5
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-6)


@pytest.mark.slow
def test_gradcheck_reference_with_mask_bias_gqa_and_dead_row():
    q, k, v = make_qkv(1, 4, 2, 5, 6, 3, value_dim=2, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 4, 5, 6) > 0.3
    mask[:, :, 1] = False
    bias = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        out, lse = mhsa.attention(
            q, k, v, mask, bias=bias, causal=True, backend="reference", return_lse=True
        )
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, bias))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    head_dim=st.integers(1, 33),
    causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "full", "key_padding", "per_head"]),
    seed=st.integers(0, 2**16),
)
def test_every_backend_matches_reference_on_random_calls(
    batch, kv_heads, group, q_len, kv_len, head_dim, causal, mask_kind, seed
):
    torch.manual_seed(seed)
    heads = kv_heads * group
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim)
    shapes = {
        "none": None,
        "full": (batch, heads, q_len, kv_len),
        "key_padding": (batch, 1, 1, kv_len),
        "per_head": (heads, 1, kv_len),
    }[mask_kind]
    mask = None if shapes is None else torch.rand(shapes) > 0.4
    expected = golden(q, k, v, mask, causal=causal)
    for backend in cpu_backends():
        out = mhsa.attention(q, k, v, mask, causal=causal, backend=backend)
        assert torch.isfinite(out).all()
        assert max_error(out, expected) < 1e-5, backend
    # a row sums to 1, or is all zero exactly when it has no allowed key
    probs = mhsa.attention_weights(q, k, mask, causal=causal)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(kv_len - q_len)
    if mask is not None:
        allowed = allowed & mask
    has_key = allowed.expand(batch, heads, q_len, kv_len).any(-1)
    row_sums = probs.sum(-1)
    assert torch.allclose(row_sums[has_key], torch.ones(()), atol=1e-5)
    assert (row_sums[~has_key] == 0).all()


@pytest.mark.parametrize("backend", ["auto", *cpu_backends()])
def test_a_custom_scale_is_used(backend):
    """scale=0.1 (far from 1/sqrt(16) = 0.25) against the golden formula at 0.1; the
    weights too."""
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16)
    out = mhsa.attention(q, k, v, causal=True, scale=0.1, backend=backend)
    assert max_error(out, golden(q, k, v, causal=True, scale=0.1)) < 1e-5
    assert max_error(out, golden(q, k, v, causal=True)) > 1e-2
    weights = mhsa.attention_weights(q, k, scale=0.1)
    expected = torch.softmax(
        q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.1, dim=-1
    )
    assert max_error(weights, expected) < 1e-6


def test_attention_weights_of_selected_heads_use_the_custom_scale():
    """The flash path normalises by its own lse: computed at the caller's scale too."""
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 9, 8)
    full = mhsa.attention_weights(q, k, scale=0.1, causal=True)
    part = mhsa.attention_weights(q, k, scale=0.1, causal=True, heads=[1, 3], rows=[0, 5])
    assert max_error(part, full[:, [1, 3]][:, :, [0, 5]]) < 1e-6
    assert torch.allclose(part.sum(-1), torch.ones(1, 2, 2))


def _eye_values(k: torch.Tensor) -> torch.Tensor:
    """v = identity per key head: the golden output with these values is the weights."""
    batch, kv_heads, kv_len, _ = k.shape
    return torch.eye(kv_len, dtype=k.dtype).expand(batch, kv_heads, kv_len, kv_len)


def _mask_and_bias() -> dict:
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
    mask[:, :, 2] = False  # a row with no allowed key: weights and output 0
    return {"mask": mask, "bias": torch.randn(4, 5, 7, generator=gen)}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"causal": True}, {"scale": 0.1}, {"causal": True, "scale": 2.0}, _mask_and_bias()],
    ids=["defaults", "causal", "scale", "causal-scale", "mask-bias"],
)
def test_attention_and_weights_match_the_golden_formula(kwargs):
    """GQA (4 heads over 2), L=5 != S=7 (causal aligned bottom-right), a custom scale,
    mask and bias: out and probs against the float64 golden formula (probs are its
    output for identity values)."""
    q, k, v = make_qkv(2, 4, 2, 5, 7, 8, value_dim=3)
    out, probs = attention_and_weights(q, k, v, **kwargs)
    assert out.shape == (2, 4, 5, 3) and probs.shape == (2, 4, 5, 7)
    assert out.dtype == probs.dtype == torch.float32
    assert max_error(out, golden(q, k, v, **kwargs)) < 1e-5
    assert max_error(probs, golden(q, k, _eye_values(k), **kwargs)) < 1e-6
    # the same answer as attention() and attention_weights() give
    assert max_error(out, mhsa.attention(q, k, v, **kwargs, backend="reference")) < 1e-6
    assert max_error(probs, mhsa.attention_weights(q, k, **kwargs)) < 1e-6


def test_attention_and_weights_return_the_input_dtype():
    q, k, v = make_qkv(1, 2, 1, 4, 6, 8, dtype=torch.bfloat16)
    out, probs = attention_and_weights(q, k, v, causal=True)
    assert out.dtype == probs.dtype == torch.bfloat16
    assert max_error(out, golden(q, k, v, causal=True)) < 2e-2
    assert max_error(probs, golden(q, k, _eye_values(k), causal=True)) < 1e-2


def test_attention_and_weights_dropout_drops_the_output_not_the_weights():
    """With identity values the output is the dropped weights: each entry 0 or
    weight / (1 - p), both seen; the weights are before dropout. The draw follows
    torch's seed (the reference backend's draw), and p=0 draws nothing."""
    q, k, _ = make_qkv(2, 4, 2, 5, 7, 8)
    v = _eye_values(k)
    torch.manual_seed(5)
    out, probs = attention_and_weights(q, k, v, causal=True, dropout_p=0.5)
    expected = golden(q, k, v, causal=True)
    assert max_error(probs, expected) < 1e-6
    kept = out != 0
    assert kept.any() and (~kept & (expected > 0)).any()
    assert max_error(out[kept], expected[kept] / 0.5) < 1e-5
    torch.manual_seed(5)
    same = mhsa.attention(q, k, v, causal=True, dropout_p=0.5, backend="reference")
    assert torch.equal(out, same)
    # no dropout: the exact weights, and torch's generator is left alone
    torch.manual_seed(5)
    out, _ = attention_and_weights(q, k, v, causal=True, dropout_p=0.0)
    assert max_error(out, expected) < 1e-6
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mask": torch.ones(5, 7, dtype=torch.uint8)}, TypeError, "dtype torch.bool"),
        ({"mask": torch.ones(1, 1, 1, 5, 7, dtype=torch.bool)}, ValueError, "does not broadcast"),
        ({"bias": torch.ones(5, 7, dtype=torch.int64)}, TypeError, "bias must be a floating"),
        ({"bias": torch.ones(3, 5, 7)}, ValueError, r"bias of shape \(3, 5, 7\) does not"),
        ({"causal": 1}, TypeError, "causal must be True or False, got int"),
        ({"scale": -1.0}, ValueError, "scale must be finite and > 0, got -1.0"),
        ({"scale": "0.1"}, TypeError, "scale must be a float or None, got str"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    ],
)
def test_attention_and_weights_reject_bad_arguments(kwargs, error, match):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 8)
    with pytest.raises(error, match=match):
        attention_and_weights(q, k, v, **kwargs)


@pytest.mark.parametrize(
    ("selection", "chosen"),
    [
        ({}, "reference"),
        ({"heads": [1, 2]}, "flash"),
        ({"rows": [0, 3]}, "flash"),
        ({"heads": [0, 1, 2, 3], "rows": [0, 1, 2, 3, 4]}, "flash"),
    ],
)
def test_attention_weights_auto_is_reference_for_all_rows_else_flash(selection, chosen):
    """As documented: the very numbers of the backend "auto" stands for (the two differ
    in the last bits: flash normalises by its own forward's lse)."""
    q, k, _ = make_qkv(2, 4, 2, 5, 7, 8)
    got = mhsa.attention_weights(q, k, causal=True, **selection)
    assert torch.equal(got, mhsa.attention_weights(q, k, causal=True, backend=chosen, **selection))
    full = golden(q, k, _eye_values(k), causal=True)
    heads, rows = selection.get("heads", range(4)), selection.get("rows", range(5))
    assert max_error(got, full[:, list(heads)][:, :, list(rows)]) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"heads": [[0]]}, TypeError, r"^heads must be a 1-D sequence of ints, got \[\[0\]\]$"),
        ({"heads": [0.5]}, TypeError, r"^heads must be a 1-D sequence of ints"),
        ({"heads": [4]}, ValueError, r"^heads must lie in \[0, 4\), got \[4\]$"),
        ({"rows": [True]}, TypeError, r"^rows must be a 1-D sequence of ints"),
        ({"rows": [0, -1]}, ValueError, r"^rows must lie in \[0, 5\), got \[0, -1\]$"),
        (
            {"backend": "sdpa"},
            ValueError,
            r"^attention_weights backend must be 'auto', "
            r"'reference', 'flash' or 'triton', got 'sdpa'$",
        ),
        ({"bias": torch.ones(5, 7, dtype=torch.int64)}, TypeError, "bias must be a floating"),
        ({"bias": torch.ones(3, 5, 7)}, ValueError, r"bias of shape \(3, 5, 7\) does not"),
        ({"mask": torch.ones(5, 7, dtype=torch.uint8)}, TypeError, "dtype torch.bool"),
        ({"scale": 0.0}, ValueError, "scale must be finite and > 0, got 0.0"),
        ({"causal": None}, TypeError, "causal must be True or False, got NoneType"),
        # a pattern made for other lengths (ceil(5/2), ceil(7/2)) = (3, 4) blocks
        (
            {"mask": mhsa.core.masks.BlockSparse(torch.ones(4, 4, dtype=torch.bool), 2)},
            ValueError,
            r"layout has shape \(4, 4\) but L=5, S=7",
        ),
        (
            {
                "mask": mhsa.core.masks.BlockSparse(torch.ones(4, 4, dtype=torch.bool), 2),
                "rows": [1],
            },
            ValueError,
            r"layout has shape \(4, 4\) but L=5, S=7",
        ),
    ],
)
def test_attention_weights_reject_bad_arguments_naming_them(kwargs, error, match):
    q, k, _ = make_qkv(2, 4, 2, 5, 7, 8)
    with pytest.raises(error, match=match):
        mhsa.attention_weights(q, k, **kwargs)


@pytest.mark.parametrize("selection", [{}, {"heads": [3, 0], "rows": [4, 1]}])
def test_attention_weights_statistics_dtype(selection):
    """float64 inputs are computed in float64 (to 1e-12 of the golden formula); bfloat16
    ones in float32, the result rounded once to bfloat16 (within one bfloat16 step,
    far below the error of bfloat16 scores: scale 1 makes the scores large)."""
    q, k, _ = make_qkv(2, 4, 2, 5, 7, 64, dtype=torch.float64)
    heads, rows = selection.get("heads", range(4)), selection.get("rows", range(5))
    got = mhsa.attention_weights(q, k, causal=True, scale=1.0, **selection)
    want = golden(q, k, _eye_values(k), causal=True, scale=1.0)[:, list(heads)][:, :, list(rows)]
    assert got.dtype == torch.float64 and max_error(got, want) < 1e-12
    q, k = q.bfloat16(), k.bfloat16()
    got = mhsa.attention_weights(q, k, causal=True, scale=1.0, **selection)
    want = golden(q, k, _eye_values(k), causal=True, scale=1.0)[:, list(heads)][:, :, list(rows)]
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-30).all()


def test_attention_weights_with_the_triton_backend_selects_heads_and_rows():
    from mhsa.core.kernels.triton import triton_attention_weights

    """Triton's CPU interpreter on a tiny call: per-head mask, bias, causal, custom
    scale, float16 in and out."""
    q, k, _ = make_qkv(2, 4, 2, 5, 7, 8, dtype=torch.float16)
    mask = torch.rand(2, 4, 5, 7) > 0.3
    bias = torch.randn(4, 5, 7, dtype=torch.float16)
    options = {"bias": bias, "causal": True, "scale": 0.5}
    got = mhsa.attention_weights(q, k, mask, heads=[3, 0], rows=[4, 1], backend="triton", **options)
    want = golden(q, k, _eye_values(k), mask, **options)[:, [3, 0]][:, :, [4, 1]]
    assert got.shape == (2, 2, 2, 7) and got.dtype == torch.float16
    assert max_error(got, want) < 2e-3
    # in float32: the kernel's own numbers (query heads 3, 0 read key heads 1, 0)
    q, k, bias = q.float(), k.float(), bias.float()
    got = mhsa.attention_weights(
        q, k, mask, bias=bias, causal=True, scale=0.5, heads=[3, 0], rows=[4, 1], backend="triton"
    )
    kernel = triton_attention_weights(
        q[:, [3, 0]], k[:, [1, 0]], mask[:, [3, 0]], bias=bias[[3, 0]], causal=True, scale=0.5
    )
    assert torch.equal(got, kernel[:, :, [4, 1]])


@pytest.mark.parametrize(("q_len", "kv_len"), [(5, 7), (0, 7), (5, 0)])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": 3}, TypeError, r"^backend must be a str, got int$"),
        (
            {"mask": torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)},
            ValueError,
            r"^mask of shape \(1, 1, 1, 1, 1\) does not broadcast",
        ),
        ({"mask": torch.ones(1, dtype=torch.int32)}, TypeError, "mask must have dtype torch.bool"),
        ({"bias": torch.ones(1, dtype=torch.int32)}, TypeError, "bias must be a floating point"),
        ({"bias": torch.ones(3, 1, 1)}, ValueError, r"^bias of shape \(3, 1, 1\) does not"),
        ({"scale": float("nan")}, ValueError, "scale must be finite and > 0, got nan"),
        ({"causal": "yes"}, TypeError, "causal must be True or False, got str"),
        ({"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    ],
)
def test_attention_rejects_bad_arguments_also_for_empty_inputs(kwargs, error, match, q_len, kv_len):
    """An empty query or key set returns early, but after the same checks."""
    q, k, v = make_qkv(2, 4, 2, q_len, kv_len, 8)
    with pytest.raises(error, match=match):
        mhsa.attention(q, k, v, **kwargs)


def test_attention_weights_keep_their_index_tensors_on_q_device():
    """Rows, keys and heads are indexed on q's device: the meta device stands in for an
    accelerator (a CPU index tensor next to it is an error, as it would be on a GPU)."""
    q, k = torch.empty(2, 4, 5, 8, device="meta"), torch.empty(2, 2, 7, 8, device="meta")
    mask = torch.ones(4, 5, 7, dtype=torch.bool, device="meta")
    probs = mhsa.attention_weights(q, k, mask, causal=True)
    assert probs.device.type == "meta" and probs.shape == (2, 4, 5, 7)


def test_attention_describes_the_call_to_the_dispatcher(monkeypatch):
    """The spec select() decides on is the call itself: shapes, dtype, device and the
    options (each flag seen both ways), for auto and for a named backend."""
    seen = []

    def spy(spec, backend):
        seen.append((spec, backend))
        return select(spec, backend)

    monkeypatch.setattr(mhsa.core.attention, "select", spy)
    q, k, v = make_qkv(2, 6, 3, 5, 7, 8, value_dim=3)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mhsa.attention(q, k, v, mask, causal=True, dropout_p=0.25)
    mhsa.attention(q, k, v, bias=torch.zeros(5, 7), backend="flash", return_lse=True)
    shape = dict(
        batch=2,
        num_heads=6,
        num_kv_heads=3,
        q_len=5,
        kv_len=7,
        head_dim=8,
        value_dim=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert seen == [
        (
            AttentionSpec(
                **shape,
                has_mask=True,
                has_bias=False,
                causal=True,
                dropout_p=0.25,
                return_lse=False,
            ),
            "auto",
        ),
        (
            AttentionSpec(
                **shape, has_mask=False, has_bias=True, causal=False, dropout_p=0.0, return_lse=True
            ),
            "flash",
        ),
    ]


@pytest.mark.parametrize(
    ("dtype", "lse_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_empty_inputs_keep_the_dtypes(dtype, lse_dtype):
    """out in q's dtype, lse in the statistics dtype, as for non-empty calls."""
    for q_len, kv_len in [(0, 5), (5, 0)]:
        q, k, v = make_qkv(1, 2, 1, q_len, kv_len, 8, dtype=dtype)
        out, lse = mhsa.attention(q, k, v, return_lse=True)
        assert out.dtype == dtype and lse.dtype == lse_dtype
    out, lse = mhsa.attention(*make_qkv(1, 2, 1, 3, 5, 8, dtype=dtype), return_lse=True)
    assert out.dtype == dtype and lse.dtype == lse_dtype


@pytest.mark.parametrize("backend", ["auto", "reference", "flash", "sdpa"])
def test_one_causal_query_attends_every_key(backend):
    """A decoding step: one query aligned bottom-right sees all S keys, so causal
    changes nothing (the call is dispatched unmasked) and the lse is the full one."""
    q, k, v = make_qkv(2, 4, 2, 1, 9, 8)
    want, want_lse = mhsa.attention(q, k, v, backend="reference", return_lse=True)
    kwargs = {} if backend == "sdpa" else {"return_lse": True}
    got = mhsa.attention(q, k, v, causal=True, backend=backend, **kwargs)
    out = got[0] if kwargs else got
    assert max_error(out, want) < 1e-6
    if kwargs:
        assert max_error(got[1], want_lse) < 1e-6
