"""Patterns per layer: which modules of a transformers model attend, and setting theirs."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from torch import nn

from mhsa.core.masks import Pattern
from mhsa.core.masks.base import pattern_or_none

from .attention import PATTERN_ATTRIBUTE, is_cross_attention

_CALLS_INTERFACE: dict[type, bool] = {}


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that call transformers' attention interface (each layer's
    self-attention, and cross-attention where the model has it), in model order: the
    order `set_pattern`'s layers count in."""
    return [module for module in model.modules() if _calls_interface(type(module))]


def _calls_interface(cls: type) -> bool:
    # transformers' own test of the same thing (_can_set_attn_implementation) reads the
    # source too: an attention module is one whose forward asks ALL_ATTENTION_FUNCTIONS
    if cls not in _CALLS_INTERFACE:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _CALLS_INTERFACE[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _CALLS_INTERFACE[cls]


def set_pattern(
    model: nn.Module, pattern: Pattern | None, layers: Iterable[int] | None = None
) -> list[nn.Module]:
    """Give attention layers an mhsa pattern that narrows what the model's own mask
    allows (causality and padding stay); None clears it. Returns the modules set.

    layers: indices into attention_modules(model) (negative ones count from the end),
    default every self-attention module (cross-attention attends to another sequence,
    where a pattern's positions mean nothing). Each chosen module must run with
    attn_implementation="mhsa" (a composite model's parts may run others).
    """
    pattern_or_none("pattern", pattern)
    if layers is not None and not isinstance(layers, Iterable):
        raise TypeError(
            f"layers must be a list of attention module indices (or None: all), got "
            f"{type(layers).__name__}; pass layers=[{layers!r}] for one"
        )
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no module that calls AttentionInterface")
    crossing = _cross_attention_ids(model)
    if layers is None:
        chosen = [i for i, module in enumerate(modules) if id(module) not in crossing]
    else:
        chosen = list(layers)
    for index in chosen:
        if not isinstance(index, int) or not -len(modules) <= index < len(modules):
            raise ValueError(
                f"layers must hold ints in [-{len(modules)}, {len(modules)}) (the model has "
                f"{len(modules)} attention modules), got {index!r}"
            )
    selected = [modules[index] for index in chosen]
    for module in selected:
        _check_settable(model, module, pattern, id(module) in crossing)
    for module in selected:
        setattr(module, PATTERN_ATTRIBUTE, pattern)
    return selected


# where transformers models keep their cross-attention (a path part of the module)
CROSS_ATTENTION_NAMES = frozenset(
    {"encoder_attn", "crossattention", "EncDecAttention", "cross_attn", "cross_attention"}
)


def _cross_attention_ids(model: nn.Module) -> set[int]:
    """ids of model's cross-attention modules: by their own attributes, or by where
    the model keeps them (Moonshine's encoder_attn says nothing of itself)."""
    return {
        id(module)
        for name, module in model.named_modules()
        if is_cross_attention(module) or CROSS_ATTENTION_NAMES & set(name.split("."))
    }


def _check_settable(
    model: nn.Module, module: nn.Module, pattern: Pattern | None, crossing: bool
) -> None:
    """The module runs on mhsa (its own config's choice: a composite model's vision
    tower may run another), and, for a pattern, attends to its own sequence."""
    config = getattr(module, "config", None) or getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    name = type(module).__name__
    if implementation != "mhsa":
        raise ValueError(
            f"{name} runs attn_implementation={implementation!r}, which would ignore the "
            "pattern; call register() and model.set_attn_implementation('mhsa') first"
        )
    if pattern is not None and crossing:
        raise ValueError(
            f"{name} is cross-attention (to another sequence), where a pattern's positions "
            "mean nothing; choose self-attention layers"
        )
