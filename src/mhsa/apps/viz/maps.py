"""Attention maps: every layer's and head's probabilities for one input.

The maps are recomputed on demand (MultiHeadAttention.attention_map, through
mhsa.attention_weights) from each attention layer's inputs; the forward pass itself
stores no weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ...nn import MultiHeadAttention
from ...nn.attention_base import AttentionModule

# on_call(index of the module in `modules`, the module, its positional args, its kwargs)
OnCall = Callable[[int, MultiHeadAttention, tuple, dict], None]


def mapped_attention(model: nn.Module) -> list[MultiHeadAttention]:
    """model's attention modules, in module order, each of which can recompute its
    probabilities (attention_map); ValueError for a model whose attention has no such
    map (differential, latent or MoBA attention: the standard map would misstate it)."""
    modules = [m for m in model.modules() if isinstance(m, AttentionModule)]
    unmapped = sorted({type(m).__name__ for m in modules if not m.returns_weights})
    if unmapped:
        raise ValueError(
            f"this model's attention ({', '.join(unmapped)}) has no single probability map "
            "to draw: attention maps are shown for standard multi-head attention"
        )
    if not modules:
        raise ValueError("this model has no attention layers to draw")
    return modules


@torch.no_grad()
def capture(modules: Sequence[MultiHeadAttention], run: Callable[[], object], on_call: OnCall):
    """Call run() with a forward-pre-hook on each module that hands its inputs to
    on_call (which may recompute the module's attention_map from them); the hooks
    are removed and each module's training mode restored afterwards. Returns run()'s
    result."""
    hooks = []
    modes = [m.training for m in modules]
    for index, module in enumerate(modules):

        def hook(module, args, kwargs, index=index):
            on_call(index, module, args, kwargs)

        hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        module.eval()
    try:
        return run()
    finally:
        for hook, module, mode in zip(hooks, modules, modes, strict=True):
            hook.remove()
            module.train(mode)


@torch.no_grad()
def attention_maps(model: nn.Module, *inputs, **kwargs) -> list[Tensor]:
    """Run model(*inputs, **kwargs); return each MultiHeadAttention's probabilities
    (B, H, L, S), in the order the layers ran."""
    maps: list[Tensor] = []
    modules = mapped_attention(model)
    was_training = model.training
    model.eval()
    try:
        capture(
            modules,
            lambda: model(*inputs, **kwargs),
            lambda _, module, args, kw: maps.append(module.attention_map(*args, **kw)),
        )
    finally:
        model.train(was_training)
    return maps
