"""Checks any user can run on their own models.

`assert_no_cross_document_leak(model_fn, batch)`: in a packed batch (several
documents one after another, mhsa.attention_varlen's layout) nothing may cross from
one document to another: perturbing one document's inputs must leave every other
document's outputs, and the gradients that reach their inputs, exactly unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from .core.masks.segments import check_cu_seqlens

# batch entries that describe the packing rather than the documents' content
LAYOUT_KEYS = ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "position_ids")


def assert_no_cross_document_leak(
    model_fn: Callable[[dict], Tensor],
    batch: Mapping[str, object],
    *,
    documents: Sequence[int] | None = None,
    inputs: Sequence[str] | None = None,
    token_dim: int = 0,
    seed: int = 0,
) -> None:
    """Raise AssertionError if anything of one document reaches another.

    Args:
        model_fn: batch (a dict) -> a tensor whose token_dim is the packed token axis
            (total tokens), e.g. logits (total, vocab) or (1, total, vocab).
        batch: a mapping with "cu_seqlens" (B+1,) offsets of the documents and the
            model's inputs; a tensor input with `total` entries along token_dim is
            perturbed (cu_seqlens and position_ids are left as they are).
        documents: which documents to perturb, one at a time (default: the first, a
            middle one and the last non-empty ones).
        inputs: the names of the entries to perturb (default: every tensor entry with
            total tokens along token_dim, except the layout's).
        token_dim: the token axis of the perturbed inputs and of the output.
        seed: for the perturbation (float inputs get Gaussian noise; integer ones, token
            ids, are replaced by other ids from the batch).

    For each perturbed document d, the outputs of the other documents must be equal
    bit for bit; for float inputs, the gradient of a random weighting of the other
    documents' outputs must be exactly zero on d's inputs, and the gradient of all
    outputs must not change on the other documents' inputs. Call it with dropout off
    or with a fixed seed inside model_fn.
    """
    cu = check_cu_seqlens("batch['cu_seqlens']", batch.get("cu_seqlens"))
    total = int(cu[-1])
    names = _perturbed_names(batch, inputs, total, token_dim)
    lengths = cu.diff()
    nonempty = lengths.nonzero().flatten().tolist()
    if not nonempty:
        raise ValueError("batch['cu_seqlens'] describes no token: nothing to perturb")
    if documents is None:
        documents = sorted({nonempty[0], nonempty[len(nonempty) // 2], nonempty[-1]})
    generator = torch.Generator().manual_seed(seed)
    for d in documents:
        if not 0 <= d < lengths.numel():
            raise ValueError(f"documents must be in 0..{lengths.numel() - 1}, got {d}")
        inside = torch.zeros(total, dtype=torch.bool)
        inside[int(cu[d]) : int(cu[d + 1])] = True
        if not inside.any():
            continue
        changed = {
            name: _perturb(batch[name], inside, token_dim, generator)  # type: ignore[arg-type]
            for name in names
        }
        _check_document(model_fn, dict(batch), changed, inside, token_dim, d)


def _check_document(model_fn, batch, changed, inside, token_dim, d) -> None:
    """The checks of one perturbed document d (inside: its tokens)."""
    floats = [name for name, t in changed.items() if t.is_floating_point()]
    before, grads_before = _run(model_fn, batch, floats, inside, token_dim)
    after, grads_after = _run(model_fn, {**batch, **changed}, floats, inside, token_dim)
    others = ~inside
    moved = _rows(before, others, token_dim) != _rows(after, others, token_dim)
    if moved.any():
        raise AssertionError(
            f"perturbing document {d} changed {int(moved.sum())} output values of other "
            "documents: information crosses document boundaries"
        )
    for name, (to_d, all_before), (_, all_after) in zip(
        floats, grads_before, grads_after, strict=True
    ):
        if (_rows(to_d, inside, token_dim) != 0).any():
            raise AssertionError(
                f"the other documents' outputs have a gradient on document {d}'s {name}: "
                "information crosses document boundaries"
            )
        if (_rows(all_before, others, token_dim) != _rows(all_after, others, token_dim)).any():
            raise AssertionError(
                f"perturbing document {d} changed the gradient on other documents' {name}: "
                "information crosses document boundaries in the backward pass"
            )


def _run(model_fn, batch, floats, inside, token_dim):
    """(output, [(grad of the others' weighted outputs, grad of all weighted outputs)]
    for each float input). The output weights are the same in every run."""
    leaves = {name: batch[name].detach().clone().requires_grad_() for name in floats}
    with torch.enable_grad() if floats else torch.no_grad():
        out = model_fn({**batch, **leaves})
    if not isinstance(out, Tensor):
        raise TypeError(f"model_fn must return a tensor, got {type(out).__name__}")
    if not floats:
        return out.detach(), []
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
    keep = (~inside).to(out.device).view(_axis_shape(out, token_dim))
    tensors = list(leaves.values())
    others = torch.autograd.grad(
        (out * weights * keep).sum(), tensors, retain_graph=True, allow_unused=True
    )
    every = torch.autograd.grad((out * weights).sum(), tensors, allow_unused=True)
    zeros = [torch.zeros_like(t) for t in leaves.values()]
    pairs = [
        (a if a is not None else z, b if b is not None else z)
        for a, b, z in zip(others, every, zeros, strict=True)
    ]
    return out.detach(), pairs


def _axis_shape(t: Tensor, dim: int) -> list[int]:
    shape = [1] * t.dim()
    shape[dim] = t.shape[dim]
    return shape


def _rows(t: Tensor, which: Tensor, token_dim: int) -> Tensor:
    return t.index_select(token_dim, which.nonzero().flatten().to(t.device))


def _perturbed_names(batch, inputs, total: int, token_dim: int) -> list[str]:
    if inputs is not None:
        for name in inputs:
            if not isinstance(batch.get(name), Tensor):
                raise ValueError(f"inputs names {name!r}, which is not a tensor in the batch")
        names = list(inputs)
    else:
        names = [
            name
            for name, value in batch.items()
            if name not in LAYOUT_KEYS
            and isinstance(value, Tensor)
            and value.dim() > token_dim
            and value.shape[token_dim] == total
        ]
    for name in names:
        t = batch[name]
        if t.dim() <= token_dim or t.shape[token_dim] != total:
            raise ValueError(
                f"batch[{name!r}] has shape {tuple(t.shape)}, not {total} tokens along "
                f"token_dim={token_dim}"
            )
    if not names:
        raise ValueError(
            f"the batch has no tensor with {total} tokens along token_dim={token_dim} to perturb"
        )
    return names


def _perturb(t: Tensor, inside: Tensor, token_dim: int, generator: torch.Generator) -> Tensor:
    """t with its rows at `inside` (along token_dim) changed."""
    mask = inside.to(t.device).view(_axis_shape(t, token_dim)).expand(t.shape)
    if t.is_floating_point():
        noise = torch.randn(t.shape, generator=generator).to(t)
        return torch.where(mask, t + noise, t)
    ids = t.unique()
    if ids.numel() < 2:
        raise ValueError("the batch's token ids are all equal: no other id to perturb them with")
    # every id of the document becomes the next larger id in the batch (cyclically)
    position = torch.searchsorted(ids, t)
    shifted = ids[(position + 1) % ids.numel()]
    return torch.where(mask, shifted, t)
