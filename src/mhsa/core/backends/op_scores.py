"""Score functions as values, for the custom ops (flash_op, triton_op): a text naming
each function and its constants, plus the tensors it reads, which receive gradients.
The ops rebuild the function from them; equal functions give equal texts, so a traced
graph never recompiles for the same one.

ALiBi, RelativeBias and Softcap (composed in any order) are named by their constants.
A ScoreMod holds arbitrary Python: it goes by its name, unique in this process, under
which the ops find it while it lives (a traced graph reads the name off the object and
guards on it), and its tensors are its tensors(). Where each of them is a variable of
its function's closure or a global it reads, the op hands the function its own tensor
arguments in their place (gradcheck perturbs what the function reads); otherwise (a
module's parameters, say) the function reads them itself, as eager does, and the
backward differentiates to those.
"""

from __future__ import annotations

import ast
import types
import weakref

from torch import Tensor

from ..scores import (
    ALiBi,
    Compose,
    RelativeBias,
    ScoreFunction,
    ScoreMod,
    Softcap,
    living_score_mod,
)


def score_spec(score: ScoreFunction | None) -> tuple[str, list[Tensor]] | None:
    """(text, tensors in order) of score; ("", []) for None; None for a function the
    ops do not know (one only the eager engines take, e.g. a view of another)."""
    if score is None:
        return "", []
    functions = score.functions if isinstance(score, Compose) else (score,)
    parts: list[str] = []
    tensors: list[Tensor] = []
    for f in functions:
        if type(f) is ALiBi:
            parts.append("ALiBi()")
            tensors.append(f.slopes)
        elif type(f) is RelativeBias:
            parts.append(f"RelativeBias({f.num_buckets}, {f.max_distance}, {f.bidirectional})")
            tensors.append(f.table)
        elif type(f) is Softcap:
            parts.append(f"Softcap({f.cap!r})")
        elif type(f) is ScoreMod:
            parts.append(f.name)
            tensors.extend(f.tensors())
        else:
            return None
    return ";".join(parts), tensors


# where each ScoreMod's function reads its tensors (_places), found once per ScoreMod
_PLACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _places(fn, tensors: tuple[Tensor, ...]) -> tuple[dict[int, int], dict[str, int]] | None:
    """Where fn reads each of tensors, as closure cells and globals; None unless all are."""
    if not isinstance(fn, types.FunctionType):
        return None
    index = {id(t): i for i, t in enumerate(tensors)}
    cells = {c: index[id(value)] for c, value in enumerate(_cell_values(fn)) if id(value) in index}
    names = {
        name: index[id(fn.__globals__[name])]
        for name in fn.__code__.co_names
        if id(fn.__globals__.get(name)) in index
    }
    found = set(cells.values()) | set(names.values())
    return (cells, names) if len(found) == len(tensors) else None


def _cell_values(fn: types.FunctionType) -> list:
    """The values of fn's closure variables (None for one not yet bound)."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            values.append(None)
    return values


def _rebuild_score_mod(text: str, tensors: list[Tensor]) -> ScoreMod:
    """The ScoreMod named text, reading tensors in place of its own where it can."""
    score = living_score_mod(text)
    if score is None:
        raise ValueError(
            f"the score function {text} is gone: a graph traced with a ScoreMod "
            "runs only while that ScoreMod lives"
        )
    if score not in _PLACES:
        _PLACES[score] = _places(score.fn, score.tensors())
    if _PLACES[score] is None:
        return score
    cells, names = _PLACES[score]
    fn = score.fn
    closure = tuple(
        types.CellType(tensors[cells[c]]) if c in cells else cell
        for c, cell in enumerate(fn.__closure__ or ())
    )
    scope = (
        {**fn.__globals__, **{n: tensors[i] for n, i in names.items()}} if names else fn.__globals__
    )
    rebuilt = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    rebuilt.__kwdefaults__ = fn.__kwdefaults__
    return ScoreMod(rebuilt, tensors)


def rebuild_score(text: str, tensors: list[Tensor]) -> ScoreFunction | None:
    """The score function score_spec described, reading `tensors` in order (a ScoreMod
    whose function reads its tensors itself: those)."""
    if not text:
        return None
    pending = iter(tensors)
    functions: list[ScoreFunction] = []
    for part in text.split(";"):
        name, _, args = part.partition("(")
        values = ast.literal_eval(f"({args[:-1]},)") if args[:-1] else ()
        if name == "ScoreMod":
            living = living_score_mod(part)
            count = 0 if living is None else len(living.tensors())
            functions.append(_rebuild_score_mod(part, [next(pending) for _ in range(count)]))
        elif name == "ALiBi":
            functions.append(ALiBi(next(pending)))
        elif name == "RelativeBias":
            functions.append(RelativeBias(next(pending), *values))
        elif name == "Softcap":
            functions.append(Softcap(*values))
        else:
            raise ValueError(f"unknown score function {name!r} in {text!r}")
    return functions[0] if len(functions) == 1 else Compose(*functions)


def differentiable_score(
    text: str, tensors: list[Tensor]
) -> tuple[ScoreFunction | None, list[Tensor | None]]:
    """(score function, one tensor to differentiate it to or None per tensor) for a
    backward: the function reads fresh leaves in place of `tensors`, or, where it reads
    its tensors itself, those that require grad (each once)."""
    score = rebuild_score(text, [t.detach().requires_grad_() for t in tensors])
    functions = () if score is None else score.functions if isinstance(score, Compose) else (score,)
    targets: list[Tensor | None] = []
    seen: set[int] = set()
    for t in (t for f in functions for t in f.tensors()):
        targets.append(t if t.requires_grad and id(t) not in seen else None)
        seen.add(id(t))
    if len(targets) != len(tensors):
        raise ValueError(
            f"{text} read {len(targets)} tensors, {len(tensors)} given: a "
            "ScoreMod's tensors changed after it was traced"
        )
    return score, targets
