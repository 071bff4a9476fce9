"""Score functions as values, for the flash custom op: a text naming each function and
its constants, and the tensors it reads, from which the op rebuilds it. Equal
functions give equal texts, so a traced graph never recompiles for the same one.

ALiBi, RelativeBias and Softcap (composed in any order) have a text; a ScoreMod holds
arbitrary Python and has none (the flash backend then traces the engine inline).
"""

from __future__ import annotations

import ast

from torch import Tensor

from ..scores import ALiBi, Compose, RelativeBias, ScoreFunction, Softcap


def score_spec(score: ScoreFunction | None) -> tuple[str, list[Tensor]] | None:
    """(text, tensors in order) of score; ("", []) for None; None when it has no text."""
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
        else:
            return None
    return ";".join(parts), tensors


def rebuild_score(text: str, tensors: list[Tensor]) -> ScoreFunction | None:
    """The score function score_spec described, reading `tensors` in order."""
    if not text:
        return None
    pending = iter(tensors)
    functions: list[ScoreFunction] = []
    for part in text.split(";"):
        name, _, args = part.partition("(")
        values = ast.literal_eval(f"({args[:-1]},)") if args[:-1] else ()
        if name == "ALiBi":
            functions.append(ALiBi(next(pending)))
        elif name == "RelativeBias":
            functions.append(RelativeBias(next(pending), *values))
        elif name == "Softcap":
            functions.append(Softcap(*values))
        else:
            raise ValueError(f"unknown score function {name!r} in {text!r}")
    return functions[0] if len(functions) == 1 else Compose(*functions)
