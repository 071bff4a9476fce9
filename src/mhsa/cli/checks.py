"""What the commands check before they start work, naming what the user typed: output
paths (check_output), the size options' relations (check_model_flags), and a config's
or model's own checks with its field names turned into flags (flag_errors,
build_model). Nothing here imports torch."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path


def check_output(
    flag: str, path: str | Path, *, folder: bool = False, overwrite: bool = False
) -> None:
    """Refuse (ValueError naming flag and the fix) an output path that a command could not
    write, before it does any work: for a file (folder=False) a folder, or an existing
    file unless overwrite (--overwrite); for a folder (train's --out) a file; for both a
    path under a file, or in a folder this user may not write. Nothing is created."""
    if not str(path).strip():  # (Path("") is the current folder: an unset $RUN, say)
        raise ValueError(f"{flag} is empty: name the path to write")
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise ValueError(
            f"{flag} {path} is a file, not a folder (the command writes a folder there): "
            f"choose another {flag}"
        )
    if not folder and path.is_dir():
        raise ValueError(
            f"{flag} {path} is a folder: name a file to write, e.g. {path / 'NAME'}, "
            f"or choose another {flag}"
        )
    if not folder and path.exists() and not overwrite:
        raise ValueError(
            f"{flag} {path} exists: pass --overwrite to replace it, or choose another {flag}"
        )
    where = path.absolute() if path.is_dir() else path.absolute().parent
    while not where.exists():  # the nearest folder that exists (the root does)
        where = where.parent
    if not where.is_dir():
        raise ValueError(f"{flag} {path}: {where} is a file, not a folder: choose another {flag}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {where} is not writable: choose another {flag}")


def check_draft(args: argparse.Namespace) -> None:
    """Refuse --speculate with --compile (speculative decoding verifies drafts over a
    paged cache, no compiled step) and --speculate draft:PATH where nothing is at PATH,
    before any model loads."""
    if args.speculate is not None and getattr(args, "compile", False):
        raise ValueError("--speculate and --compile do not combine: pass one of them")
    path = (args.speculate or "").removeprefix("draft:")
    if args.speculate not in (None, "prompt-lookup") and not os.path.exists(path):
        raise ValueError(f"--speculate {args.speculate}: nothing at {path}; pass a draft model")


# config field names -> the flags that set them, for the config checks that reach the user
# (see flag_errors); a command whose field is set by another flag passes its own table
FLAGS = {
    "n_layer": "--layers",
    "n_head": "--heads",
    "num_heads": "--heads",
    "n_kv_head": "--kv-heads",
    "d_model": "--d-model",
    "embed_dim": "--d-model",  # (mhsa.nn's modules name it so, as torch.nn does)
    "max_len": "--seq-len",
    "dropout": "--dropout",
    "window": "--window",
    "position": "--position",
    "attention": "--attention",
    "moba_block": "--moba-block",
    "moba_top_k": "--moba-top-k",
    "patch_size": "--patch-size",
    "image_size": "--image-size",
    "pooling": "--pooling",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "max_new_tokens": "--max-new-tokens",
}
SAMPLING_FLAGS = {name: FLAGS[name] for name in ("temperature", "top_k", "top_p")}
WEIGHT_FLAGS = {"quantize": "--quantize", "dtype": "--dtype"}  # a chat model's (chat_weights)


def name_flags(message: str, flags: dict[str, str]) -> str:
    """message (a config check's) with each field of flags named by its flag: `d_model
    (64)` and `attention='diff'` become `--d-model 64` and `--attention diff`; a field
    with an underscore wherever it stands, a plain word only where it names the field
    (before "must" or a value); "None" (no value) becomes "left out"."""
    for name, flag in flags.items():
        message = re.sub(rf"\b{name}=(['\"]?)([^'\",;)\s]*)\1", rf"{flag} \2", message)
        message = re.sub(rf"\b{name} \(([^)]*)\)", rf"{flag} \1", message)
        word = rf"\b{name}\b" if "_" in name else rf"(?:^|(?<=, )){name}\b(?= must| \d| ')"
        message = re.sub(word, flag, message)
    message = message.replace(", or None for no limit", " (leave it out for no limit)")
    message = re.sub(r" or (be )?None\b", r" or \1left out", message)
    return re.sub(r"(--[a-z-]+) None\b", r"\1 left out", message)


@contextlib.contextmanager
def flag_errors(flags: dict[str, str] = FLAGS) -> Iterator[None]:
    """A ValueError raised inside (a config's or a model's check) leaves with its fields
    named by their flags (see name_flags): the user reads what they typed."""
    try:
        yield
    except ValueError as error:
        raise ValueError(name_flags(str(error), flags)) from error


def build_model(model_cls, config_cls, flags: dict[str, str] = FLAGS, **fields) -> tuple:
    """(config, model) of config_cls(**fields) and model_cls(config), a check of either
    named by its flags (flag_errors)."""
    with flag_errors(flags):
        config = config_cls(**fields)
        return config, model_cls(config)


def _nearest(value: int, fits: Callable[[int], bool], step: int = 1) -> str | None:
    """The nearest multiples of step below and above value that fit, in words ("4 or
    8", "8" where none fits below), or None where none fits up to 8 x value."""
    below = [v for v in range(value - value % step, 0, -step) if v != value and fits(v)][:1]
    start = value + step - value % step
    above = [v for v in range(start, 8 * value + 2 * step, step) if fits(v)][:1]
    return " or ".join(str(v) for v in below + above) or None


def check_model_flags(args: argparse.Namespace) -> None:
    """The size options' relations, checked before any data loads: --d-model divisible by
    --heads (for a GPT with --position rotary into heads of an even width, with
    --attention diff into two halves each), --heads by --kv-heads, --dropout in [0, 1).
    ValueError naming the flags, their values and values that fit."""
    heads, width = args.heads, args.d_model
    kv = getattr(args, "kv_heads", None)
    dropout = getattr(args, "dropout", None)
    if dropout is not None and not 0 <= dropout < 1:
        raise ValueError(f"--dropout {dropout}: must be in [0, 1), e.g. 0.1 (drops 1 value in 10)")
    why = []
    if getattr(args, "position", None) == "rotary" and args.attention != "latent":
        why.append("--position rotary needs heads of an even width")
    if getattr(args, "attention", None) == "diff":
        why.append("--attention diff splits each head in two")
    step = 2 ** len(why)  # a head's width is a multiple of this
    if width % (heads * step):
        need = f"a multiple of {step} x it ({'; '.join(why)})" if why else "divisible by it"
        picks = [
            ("--heads", _nearest(heads, lambda h: width % (h * step) == 0 and h % (kv or 1) == 0)),
            ("--d-model", _nearest(width, lambda d: True, heads * step)),
        ]
        pick = ", or ".join(f"{flag} {values}" for flag, values in picks if values)
        raise ValueError(f"--heads {heads}: --d-model ({width}) must be {need}; pick {pick}")
    if kv is not None and heads % kv:
        raise ValueError(
            f"--kv-heads {kv}: --heads ({heads}) must be divisible by it; pick --kv-heads "
            f"{_nearest(kv, lambda k: heads % k == 0)}, or leave it out (one per head)"
        )
