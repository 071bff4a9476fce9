"""The one checked weight loader: a model's parameters from a file's named tensors.

Each model file keeps a `NameTable` per format it loads (as gguf-py keeps its tensor map):
rules that say which stored tensor holds each of our parameters, and how it is stored
(transposed, or several of our parameters fused in one tensor). Every loader goes through
`read_tensors` (names and shapes known up front, e.g. from a config) or `load_weights`
(the model's own parameters), which check every name and shape against what is stored
before a tensor is read, and raise one-line ValueErrors naming the file and the tensor:

    {file}: 1 tensor missing: 'h.0.ln_1.weight' (for blocks.0.attn_block.norm.weight); ...
    {file}: 1 unexpected tensor: 'h.0.ln_one.weight'; ...
    {file}: tensor 'wte.weight' has shape (50, 48), but the model implies (101, 48) ...

A table rule is a pair of name patterns, ours and the file's, where `{i}` stands for a
layer index, `{p}` for "weight" or "bias", `{e}` for an expert's index (and `{any}`, in
ignored names, for any one part between dots or slashes):

    ("layers.{i}.ff.up.{p}", "model.layers.{i}.mlp.up_proj.{p}")

A parameter may have several rules, one per layout a file may store it in (experts fused
in one tensor, or one tensor per expert, as transformers 5 writes DeepSeek-V3's); the
first rule whose tensors the file holds is used, the first rule when it holds none.

A source of named tensors (tensor_sources.py) is a state dict (`TensorDict`),
safetensors files (`SafetensorsFiles`) or the GGUF reader's own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .tensor_sources import SafetensorsFiles, TensorDict, TensorSource, Weights, as_source

__all__ = [  # the sources are re-exported: models import the loader's names from here
    "NameTable",
    "Rule",
    "SafetensorsFiles",
    "TensorDict",
    "TensorSource",
    "Weights",
    "as_source",
    "load_weights",
    "read_tensors",
]

# a layer, weight or bias, an expert, and (in ignored names) any one name part
PLACEHOLDERS = {"i": r"\d+", "p": r"weight|bias", "e": r"\d+", "any": r"[^./]+"}
SHOWN = 3  # names shown in a message, then "and N more"


def _pattern(text: str) -> re.Pattern:
    pieces = re.split(r"\{(\w+)\}", text)  # text, placeholder, text, ...
    regex = "".join(
        f"(?P<{piece}>{PLACEHOLDERS[piece]})" if odd else re.escape(piece)
        for odd, piece in ((i % 2, p) for i, p in enumerate(pieces))
    )
    return re.compile(regex)


@dataclass(frozen=True)
class Rule:
    """Which stored tensor (`theirs`) holds our parameter(s) `ours`.

    ours: one name pattern, or several when the file fuses them in one tensor (split in
    this order along dim 0 after any transpose: GPT-2's c_attn, CTranslate2's q|k|v).
    theirs: one name pattern; or, for one parameter of ours stacked over experts along
    dim 0, the pattern(s) of each expert's tensor(s) with `{e}` for its index: row e of
    ours is expert e's tensors concatenated along dim 0 (DeepSeek-V3's
    experts.{e}.gate_proj and experts.{e}.up_proj as experts_gate_up[e]); the number of
    experts is ours' dim 0.
    transpose: 2-D tensors are stored (in, out) (GPT-2's Conv1D); 1-D ones as they are.
    optional: the file may lack it; the parameters then keep their values.
    """

    ours: str | tuple[str, ...]
    theirs: str | tuple[str, ...]
    transpose: bool = False
    optional: bool = False

    def __post_init__(self) -> None:
        stacked = {"{e}" in piece for piece in self.pieces}
        if stacked == {True} and len(self.parts) == 1 and not self.transpose:
            return
        if stacked != {False} or len(self.pieces) > 1:
            raise ValueError(
                f"rule {self.ours!r} <- {self.theirs!r}: stored patterns with `{{e}}` "
                "stack one parameter of ours, untransposed; several need an `{e}` each"
            )

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.ours,) if isinstance(self.ours, str) else self.ours

    @property
    def pieces(self) -> tuple[str, ...]:
        """The stored name pattern(s)."""
        return (self.theirs,) if isinstance(self.theirs, str) else self.theirs

    @property
    def stacked(self) -> bool:
        """Whether ours is stacked from one tensor (or several) per expert."""
        return "{e}" in self.pieces[0]


def _fill(text: str, groups: dict[str, str]) -> str:
    """A stored name pattern with our name's placeholders filled in ({e} left)."""
    return text.format(**{"e": "{e}", **groups})


class NameTable:
    """A model's names <-> one format's, as rules (the first that matches wins; for a
    parameter with several, the first whose tensors the file holds).

    ignore: patterns of stored tensors that are not weights of ours (buffers, flags, a
    tied copy); not_stored: patterns of our parameters the format does not hold (they
    keep their values)."""

    def __init__(
        self,
        *rules: Rule | tuple[str | tuple[str, ...], str],
        ignore: Iterable[str] = (),
        not_stored: Iterable[str] = (),
        prefix: str = "",
    ) -> None:
        """prefix: stored names may carry it (e.g. "transformer."); it is dropped."""
        self.rules = [rule if isinstance(rule, Rule) else Rule(*rule) for rule in rules]
        self._ours = [[_pattern(part) for part in rule.parts] for rule in self.rules]
        self._theirs = [[_pattern(piece) for piece in rule.pieces] for rule in self.rules]
        self._ignore = [_pattern(text) for text in ignore]
        self._not_stored = [_pattern(text) for text in not_stored]
        self.prefix = prefix

    def find(self, param: str) -> tuple[Rule, str, tuple[str, ...]] | None:
        """(rule, stored name, every parameter that stored tensor fills) for our
        parameter `param` by the first rule that matches it, or None for a name no rule
        matches. A stacked rule's stored name is its first pattern, `{e}` left in."""
        found = next(self.layouts(param), None)
        return None if found is None else (found[0], found[1][0], found[2])

    def layouts(self, param: str) -> Iterator[tuple[Rule, tuple[str, ...], tuple[str, ...]]]:
        """(rule, its stored name pattern(s) for `param` ({e} left in a stacked
        rule's), every parameter they fill) by each rule that matches our parameter
        `param`, in the table's order: one per layout a file may store it in."""
        for rule, patterns in zip(self.rules, self._ours, strict=True):
            for pattern in patterns:
                match = pattern.fullmatch(param)
                if match:
                    groups = match.groupdict()
                    parts = tuple(part.format(**groups) for part in rule.parts)
                    yield rule, tuple(_fill(piece, groups) for piece in rule.pieces), parts
                    break

    def stored_name(self, param: str) -> str:
        """Our parameter name -> the name the file stores it under (its fused tensor's for
        a split one); KeyError for a name the table does not know."""
        found = self.find(param)
        if found is None:
            raise KeyError(f"no rule of this name table stores {param!r}")
        return found[1]

    def param_names(self, stored: str) -> tuple[str, ...] | None:
        """A stored tensor's name -> the names of our parameters it holds (several for a
        fused tensor), or None for a name the table does not know."""
        stored = stored.removeprefix(self.prefix)
        for rule, patterns in zip(self.rules, self._theirs, strict=True):
            for pattern in patterns:
                match = pattern.fullmatch(stored)
                if match:
                    return tuple(part.format(**match.groupdict()) for part in rule.parts)
        return None

    def ignores(self, stored: str) -> bool:
        stored = stored.removeprefix(self.prefix)
        return any(pattern.fullmatch(stored) for pattern in self._ignore)

    def stores(self, param: str) -> bool:
        return not any(pattern.fullmatch(param) for pattern in self._not_stored)


@dataclass
class _Entry:
    """The stored tensor(s) to read for some of our parameters: one tensor for one
    parameter or several (fused), or one tensor (or several) an expert for a stacked one."""

    stored: str  # the stored name (a stacked rule's first pattern, {e} left in)
    rule: Rule
    params: tuple[str, ...]
    names: tuple[str, ...]  # the stored tensors, in the table's terms
    raws: tuple[str, ...] = ()  # and in the file's (with the table's prefix if it has it)
    rows: tuple[int, ...] = ()  # each parameter's share of a fused tensor (dim 0)
    shape: tuple[int, ...] = ()  # a stacked parameter's shape


def _some(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def _for(entry: _Entry) -> str:
    """Which of our parameters a stored tensor holds, when its name does not say it."""
    return "" if entry.params == (entry.stored,) else f" (for {' + '.join(entry.params)})"


def _count(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _stored_shape(rule: Rule, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the file stores for parameters of these shapes under this rule (a
    stacked rule: each expert's tensor's, ours split evenly along dim 1)."""
    if rule.stacked:
        (shape,) = shapes
        return (shape[1] // len(rule.pieces), *shape[2:])
    shape = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]
    return shape[::-1] if rule.transpose and len(shape) == 2 else shape


def _entry(
    rule: Rule, pieces: tuple[str, ...], params: tuple[str, ...], shape: tuple[int, ...]
) -> _Entry:
    """The entry for our params by one rule; pieces: its stored pattern(s), filled in;
    shape: the first parameter's (a stacked one's dim 0 counts the experts)."""
    if not rule.stacked:
        return _Entry(pieces[0], rule, params, pieces)
    experts = shape[0] if shape else 0
    names = tuple(piece.format(e=e) for e in range(experts) for piece in pieces)
    return _Entry(pieces[0], rule, params, names)


def _entries(
    names: NameTable | None, expected: Mapping[str, tuple[int, ...]], held: set[str]
) -> dict[str, _Entry]:
    """{stored name: entry} for our parameters `expected` ({name: shape}; names None:
    stored as named), each by the first of its rules whose tensors the file holds
    (`held`, in the table's terms), else by its first rule."""
    entries: dict[str, _Entry] = {}
    for param, shape in expected.items():
        if names is None:
            entries[param] = _Entry(param, Rule(param, param), (param,), (param,))
            continue
        if not names.stores(param):
            continue
        options = [_entry(*found, tuple(shape)) for found in names.layouts(param)]
        if not options:
            raise ValueError(
                f"the name table has no rule for the parameter {param!r}: a "
                "bug in the model's table; please report it"
            )
        entry = next((o for o in options if any(n in held for n in o.names)), options[0])
        entries.setdefault(entry.stored, entry)
    return entries


def _plan(
    source: TensorSource,
    names: NameTable | None,
    expected: Mapping[str, tuple[int, ...]],
    *,
    expected_by: str,
    fix: str,
    ignore: Iterable[str] = (),
) -> list[_Entry]:
    """The stored tensors to read for `expected` ({our name: shape}), after checking that
    every one is there with the shape `expected` implies and nothing else is."""
    in_file = source.shapes()
    prefix = names.prefix if names else ""
    raw_names = {name.removeprefix(prefix): name for name in in_file}  # table name -> file's
    entries = _entries(names, expected, set(raw_names))
    shown_prefix = prefix if any(raw != name for name, raw in raw_names.items()) else ""
    missing = [
        f"{shown_prefix + name!r}{_for(e)}"
        for e in entries.values()
        if not (e.rule.optional and not any(n in raw_names for n in e.names))
        for name in e.names
        if name not in raw_names
    ]
    skip, covered = set(ignore), {name for e in entries.values() for name in e.names}
    unexpected = [
        repr(raw)
        for name, raw in raw_names.items()
        if name not in covered and raw not in skip and not (names and names.ignores(name))
    ]
    where = source.name
    if missing:
        also = f", and {len(unexpected)} unexpected: {_some(unexpected)}" if unexpected else ""
        raise ValueError(
            f"{where}: {_count(len(missing), 'tensor')} missing: {_some(missing)}{also}; {fix}"
        )
    if unexpected:
        raise ValueError(
            f"{where}: {_count(len(unexpected), 'unexpected tensor')}: "
            f"{_some(unexpected)} (no parameter of the model is stored under that "
            f"name); {fix}"
        )
    plan = [e for e in entries.values() if all(n in raw_names for n in e.names)]  # optional
    for entry in plan:
        entry.raws = tuple(raw_names[name] for name in entry.names)
        shapes = [tuple(expected[p]) for p in entry.params]
        entry.rows = tuple(shape[0] if shape else 1 for shape in shapes)
        if entry.rule.stacked:
            entry.shape = shapes[0]
            if len(entry.shape) < 2 or entry.shape[1] % len(entry.rule.pieces):
                raise ValueError(
                    f"{entry.params[0]} has shape {entry.shape}, which cannot be "
                    f"stacked from {len(entry.rule.pieces)} tensor(s) an expert "
                    f"({' and '.join(entry.rule.pieces)}): a bug in the model's table; "
                    "please report it"
                )
        want = _stored_shape(entry.rule, shapes)
        for raw in entry.raws:
            got = tuple(in_file[raw])
            if got != want:
                raise ValueError(
                    f"{where}: tensor {raw!r} has shape {got}, but {expected_by} "
                    f"implies {want}{_for(entry)}; {fix}"
                )
    return plan


def _read(
    source: TensorSource, entry: _Entry, dtype: torch.dtype | None, *, floats: bool, fix: str
) -> list[Tensor]:
    """The parameters an entry fills, in its order: the stored tensor as read (no copy)
    or split, or a stacked parameter's tensors stacked expert by expert in a new one;
    cast to dtype if given. floats: refuse an integer tensor (a quantised weight without
    its scale) before anything is stacked."""
    tensors = [source.read(raw) for raw in entry.raws]
    for raw, tensor in zip(entry.raws, tensors, strict=True):
        if floats and not tensor.is_floating_point():
            raise ValueError(
                f"{source.name}: tensor {raw!r} is stored as {tensor.dtype}, "
                f"not a float type: dequantise it first (no scale beside it?); "
                f"{fix}"
            )
    if entry.rule.stacked:  # (experts * pieces, rows / pieces, ...) -> (experts, rows, ...)
        stacked = torch.stack(tensors).view(entry.shape)
        return [stacked if dtype is None else stacked.to(dtype)]
    (tensor,) = tensors
    if entry.rule.transpose and tensor.dim() == 2:
        tensor = tensor.t()
    parts = list(tensor.split(entry.rows)) if len(entry.params) > 1 else [tensor]
    return [part if dtype is None else part.to(dtype) for part in parts]


def read_tensors(
    source: TensorSource,
    names: NameTable | None,
    expected: Mapping[str, tuple[int, ...]],
    *,
    dtype: torch.dtype | None = None,
    expected_by: str = "the model",
    fix: str = "check that the file was written for this model",
    ignore: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Tensor]:
    """{our name: tensor} for every name of `expected` ({our name: shape}) that the file
    stores (all but the table's optional ones), checked first (see the module docstring);
    names None: the file uses our names. Tensors are taken as read (no copy), cast to
    dtype if given. expected_by names what implies the shapes ("the metadata"); fix is
    what a message ends with; ignore: stored names to pass over besides the table's;
    progress(done, total) is called after each stored tensor is read."""
    plan = _plan(source, names, expected, expected_by=expected_by, fix=fix, ignore=ignore)
    out = {}
    for done, entry in enumerate(plan, start=1):
        parts = _read(source, entry, dtype, floats=False, fix=fix)
        out.update(zip(entry.params, parts, strict=True))
        if progress is not None:
            progress(done, len(plan))
    return out


def load_weights(
    model: nn.Module,
    source: TensorSource,
    names: NameTable,
    *,
    dtype: torch.dtype | None = None,
    assign: bool = False,
    expected_by: str = "the model",
    fix: str = "check that the file was written for this model",
    ignore: Iterable[str] = (),
) -> nn.Module:
    """Load `model`'s parameters and persistent buffers from `source` through `names`,
    every name and shape checked before a tensor is read; a stored integer tensor where
    the model has a float one is refused (a quantised weight without its scale).
    assign: take the tensors as they are (a model built on the meta device), cast to
    dtype if given; otherwise they are copied into the model's own. Returns model."""
    state = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in state.items()}
    plan = _plan(source, names, expected, expected_by=expected_by, fix=fix, ignore=ignore)
    loaded: dict[str, Tensor] = {}
    for entry in plan:
        floats = state[entry.params[0]].is_floating_point()
        parts = _read(source, entry, dtype, floats=floats, fix=fix)
        loaded.update(zip(entry.params, parts, strict=True))
    kept = set(state) - set(loaded)  # optional or not stored: keep their values
    if assign and kept:
        raise ValueError(
            f"{source.name}: no tensor for {_some(sorted(kept))}, which a model "
            "built on the meta device needs; load it without assign"
        )
    model.load_state_dict(loaded, strict=not kept, assign=assign)
    return model
