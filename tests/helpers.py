"""Shared test helpers: inputs in the library's layout and the float64 golden answer
(written here from the formula, independent of the library's own math)."""

from __future__ import annotations

import io
import math
import re
import tokenize
from pathlib import Path

import torch
from torch import Tensor

import mhsa
from mhsa.core.masks import SlidingWindow


def make_qkv(
    batch: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    q_len: int = 7,
    kv_len: int | None = None,
    head_dim: int = 16,
    value_dim: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    noncontiguous: bool = False,
    requires_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v).

    noncontiguous=True returns views with permuted strides (made as (B, L, H, D)).
    """
    num_kv_heads = num_kv_heads or num_heads
    kv_len = q_len if kv_len is None else kv_len
    value_dim = value_dim or head_dim

    def rand(heads: int, length: int, dim: int) -> Tensor:
        if noncontiguous:
            t = torch.randn(batch, length, heads, dim, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, heads, length, dim, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return (
        rand(num_heads, q_len, head_dim),
        rand(num_kv_heads, kv_len, head_dim),
        rand(num_kv_heads, kv_len, value_dim),
    )


def golden_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask=None,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    modify=None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), lse (B, H, L)) in float64, written out from the formula and
    sharing no code with mhsa: softmax(modify(q k^T * scale) + bias) v over the allowed
    keys (mask True, causal aligned bottom-right), rows with no allowed key 0 and lse
    -inf. modify(scores (B, H, L, S), i (L, 1), j (1, S)) gets global positions, query
    i at row + S - L; sinks (H,) are logits of one more key without a value.
    A pattern mask is materialised with its own .dense (the mask's definition).
    Differentiable (rows with no allowed key get zero gradients)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]  # query head h reads key head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bhld,bhsd->bhls", q, k) * scale
    if modify is not None:
        i = torch.arange(kv_len - q_len, kv_len).view(-1, 1)
        scores = modify(scores, i, torch.arange(kv_len).view(1, -1))
    if bias is not None:
        scores = scores + bias.double()
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        rows = torch.arange(q_len).view(-1, 1)
        allowed = torch.arange(kv_len).view(1, -1) <= rows + (kv_len - q_len)
    if mask is not None:
        dense = mask if isinstance(mask, Tensor) else mask.dense(q_len, kv_len, q.device)
        allowed = allowed & dense.to(q.device)
    scores = torch.where(allowed, scores, torch.tensor(-torch.inf, dtype=torch.float64))
    if sinks is not None:
        column = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)  # no value
    top = scores.detach().amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    alive = total > 0
    probs = weights / torch.where(alive, total, torch.ones_like(total))
    lse = torch.where(
        alive,
        top + torch.log(torch.where(alive, total, torch.ones_like(total))),
        torch.full_like(total, -torch.inf),
    )
    return torch.einsum("bhls,bhsd->bhld", probs, v), lse.squeeze(-1)


def golden(q: Tensor, k: Tensor, v: Tensor, mask=None, **kwargs) -> Tensor:
    """The float64 golden output on the same inputs (see golden_attention)."""
    return golden_attention(q.detach(), k.detach(), v.detach(), mask, **kwargs)[0]


def naive_same_dtype(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """Attention entirely in q's dtype (no float32 statistics), for low-precision bounds."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        q_len, kv_len = scores.shape[-2:]
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        scores = scores.masked_fill(~allowed, -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


def reference_with_grads(q, k, v, mask, bias, causal, grad_out, grad_lse=None, scale=None):
    """(out, lse, [dq, dk, dv, dbias]) of the golden formula in float64, for the loss
    sum(out * grad_out) (+ sum(lse * grad_lse) over finite lse)."""
    tensors = [t.detach().double().requires_grad_() for t in (q, k, v)]
    bias64 = None if bias is None else bias.detach().double().requires_grad_()
    out, lse = golden_attention(*tensors, mask, bias=bias64, causal=causal, scale=scale)
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * grad_lse.double()).sum()
    loss.backward()
    return out, lse, [t.grad for t in tensors] + [None if bias64 is None else bias64.grad]


def assert_matches_reference(out, lse, inputs, ref_out, ref_lse, ref_grads) -> None:
    """A kernel's float32 out (2e-5), lse (1e-5, -inf exactly where the reference's is)
    and gradients of inputs (q, k, v, bias; 1e-4, finite) against the float64 reference."""
    assert max_error(out, ref_out) < 2e-5
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert max_error(lse[finite], ref_lse[finite]) < 1e-5
    for got, want in zip(inputs, ref_grads, strict=True):
        if want is not None:
            assert torch.isfinite(got.grad).all()
            assert max_error(got.grad, want) < 1e-4


def assert_matches_golden(out, lse, grads, ref_out, ref_lse, ref_grads, names) -> None:
    """float32 out and lse within 2e-5 of the float64 golden (lse -inf exactly where
    the golden's is), and each named gradient finite and within 1e-4 of its largest
    value (at least 1)."""
    assert max_error(out, ref_out) < 2e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert max_error(lse[finite], ref_lse[finite]) < 2e-5
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert torch.isfinite(got).all(), name
        assert max_error(got, want) < 1e-4 * max(1.0, want.abs().max().item()), name


def expect_error(call) -> str | None:
    """The message of the ValueError or TypeError call() raises, or None."""
    try:
        call()
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def assert_2x_3x_rule(q, k, v, out, grad_out, ref_out, ref_grads) -> None:
    """Low-precision rule: out (causal) and q/k/v's .grad are within 2x (forward) and
    3x (gradients) of the error that attention entirely in their dtype makes against
    the same float64 answer (ref_out, ref_grads)."""
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = naive_same_dtype(qn, kn, vn, causal=True)
    naive.backward(grad_out)
    assert max_error(out, ref_out) <= 2 * max_error(naive, ref_out)
    for got, naive_t, want in zip((q, k, v), (qn, kn, vn), ref_grads[:3], strict=True):
        assert max_error(got.grad, want) <= 3 * max_error(naive_t.grad, want)


def max_error(actual: Tensor, expected: Tensor) -> float:
    """Largest absolute difference in float64 (0 for empty tensors)."""
    if actual.numel() == 0:
        return 0.0
    return (actual.detach().double() - expected.detach().double()).abs().max().item()


def cpu_backends() -> list[str]:
    """The backends that serve a typical call here (on CPU): for tests over all of them."""
    from mhsa.core.backends import AttentionSpec, get, local_names

    spec = AttentionSpec.example()
    # triton serves CPU tensors only in its (slow) interpreter: test_triton.py covers it
    return [
        n
        for n in local_names()
        if n != "triton" and get(n).available() is None and get(n).supports(spec) is None
    ]


def assert_same_greedy(got: list[int], want: list[int], logits_at) -> None:
    """Greedy tokens of two float paths that differ only in rounding (layouts, a
    compiled graph) agree, but for a near-tie: where they first part, the reference's
    two best logits there (logits_at(i): its logits choosing want[i]) must be within
    1e-4, or the paths really differ. (Which way a tie falls depends on the CPU's
    summation order, so no test may assert it.)"""
    first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
    if first is None:
        assert len(got) == len(want), (got, want)
        return
    best, second = logits_at(first).topk(2).values.tolist()
    assert best - second < 1e-4, f"greedy tokens part at {first} without a tie: {got} {want}"


SOURCE = Path(__file__).resolve().parent.parent / "src" / "mhsa"


def source_code() -> dict[str, str]:
    """Each module under src/mhsa (its path relative to it) -> its code without comments
    and strings, for tests that check where an idea is written."""

    def code_of(path: Path) -> str:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        kept = [tok.string for tok in tokens if tok.type not in (tokenize.COMMENT, tokenize.STRING)]
        return " ".join(kept)

    return {str(path.relative_to(SOURCE)): code_of(path) for path in SOURCE.rglob("*.py")}


# a docs block another test runs: <!-- skip: next "runs with NAME: TEST FILE" -->
SKIP = re.compile(r'^<!-- skip: next "runs with (\w+): (tests/\S+\.py)" -->$', re.M)


def skipped_block(page: Path, name: str) -> str:
    """The python block after the page's `runs with NAME` skip directive, for the test
    that runs it where Sybil cannot."""
    text = page.read_text()
    marker = next(m for m in SKIP.finditer(text) if m.group(1) == name)
    start = text.index("```python\n", marker.end()) + len("```python\n")
    return text[start : text.index("\n```", start)]


# paged keys: a batch of sequences in a shuffled block pool, and the answer each one
# gets alone (tests/core/kernels/test_paged_attention.py, test_paged_plans.py)
def paged_case(
    lengths,
    block_size,
    num_heads=4,
    num_kv_heads=2,
    q_len=1,
    head_dim=7,
    value_dim=5,
    dtype=torch.float64,
    num_blocks=None,
):
    """Random q (N, H, T, D), pools whose unused blocks hold NaN, a shuffled block
    table padded with -1, and each sequence's keys and values (1, H_kv, len, D) gathered
    by hand."""
    counts = [math.ceil(n / block_size) for n in lengths]
    num_blocks = num_blocks or sum(counts) + 3
    k_pool = torch.full((num_blocks, block_size, num_kv_heads, head_dim), torch.nan, dtype=dtype)
    v_pool = torch.full((num_blocks, block_size, num_kv_heads, value_dim), torch.nan, dtype=dtype)
    table = torch.full((len(lengths), max(counts) + 1), -1, dtype=torch.long)
    ids, keys, values = torch.randperm(num_blocks).tolist(), [], []
    for n, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        blocks, ids = ids[:count], ids[count:]
        table[n, :count] = torch.tensor(blocks, dtype=torch.long)
        k = torch.randn(1, num_kv_heads, length, head_dim, dtype=dtype)
        v = torch.randn(1, num_kv_heads, length, value_dim, dtype=dtype)
        for j in range(length):  # slots past a sequence's length stay NaN
            k_pool[blocks[j // block_size], j % block_size] = k[0, :, j]
            v_pool[blocks[j // block_size], j % block_size] = v[0, :, j]
        keys.append(k)
        values.append(v)
    q = torch.randn(len(lengths), num_heads, q_len, head_dim, dtype=dtype)
    return q, k_pool, v_pool, table, keys, values


def paged_golden(q, keys, values, lengths, window=None, modify=None, scale=None):
    """Each sequence alone: dense causal attention over its keys (float64)."""
    outs = []
    for n, length in enumerate(lengths):
        q_len = q.shape[2]
        mask = None
        if window is not None:
            rows = torch.arange(length - q_len, length).view(-1, 1)
            mask = torch.arange(length).view(1, -1) >= rows - window
        outs.append(
            golden_attention(
                q[n : n + 1], keys[n], values[n], mask, causal=True, modify=modify, scale=scale
            )[0]
        )
    return torch.cat(outs)


def paged_call(q, k_pool, v_pool, table, lengths, window=None, **options):
    """mhsa.attention over the pages, causal, within SlidingWindow(window, 0) if given."""
    mask = None if window is None else SlidingWindow(window, 0)
    options = {"causal": True, **options}
    return mhsa.attention(q, k_pool, v_pool, mask, block_table=table, seq_lens=lengths, **options)


def tiny_hf_gpt2(**sizes):
    """transformers' GPT2LMHeadModel with random weights (seed 0), in eval mode, no
    dropout and no bos/eos: 101 tokens, 64 positions, width 48, 2 layers of 4 heads
    unless `sizes` (GPT2Config's names) say otherwise."""
    from optional import needs

    transformers = needs("transformers")
    options = dict(vocab_size=101, n_positions=64, n_embd=48, n_layer=2, n_head=4)
    options.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    options.update(bos_token_id=None, eos_token_id=None, **sizes)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**options)).eval()
