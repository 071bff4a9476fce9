"""Checkpoints of `mhsa train`: written atomically, found again, never lost.

An output folder holds `step-NNNNNN/` folders (`model.safetensors` weights,
`config.json` to rebuild the model, `trainer.pt` optimizer and random states) and a
`latest` link. A folder is written under a temporary `.mhsa-partial-*` name and renamed,
and `latest` is swapped by an atomic rename, so a run killed at any moment leaves every
complete checkpoint intact. Nothing here deletes a checkpoint, nor anything a user put
in the folder: only those names of its own. Which checkpoints a run may remove is the
training loop's decision (mhsa.apps.train).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .formats.permissions import as_if_created
from .formats.weights import SafetensorsFiles, read_tensors

_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_FILES = ("model.safetensors", "config.json", "trainer.pt")
PARTIAL, NEXT_LATEST = ".mhsa-partial-", ".mhsa-latest-"  # our temporary names, no one else's


def is_checkpoint(path: Path) -> bool:
    return (path / "model.safetensors").is_file() and (path / "config.json").is_file()


def checkpoints_in(out_dir: str | Path) -> list[Path]:
    """The complete step folders of an output folder, oldest step first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [
        (int(match[1]), path)
        for path in out_dir.iterdir()
        if (match := _STEP_FOLDER.match(path.name)) and is_checkpoint(path)
    ]
    return [path for _, path in sorted(found)]


def clean_leftovers(out_dir: str | Path) -> None:
    """Remove the temporary folders and links that a killed run left behind: the
    PARTIAL and NEXT_LATEST names save_checkpoint uses, and an older mhsa's `.tmp-*`
    folders that hold nothing but checkpoint files. A step moved aside to be written
    again, whose new copy never arrived, is put back first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    ours = [*out_dir.glob(f"{PARTIAL}*"), *filter(_older_partial, out_dir.glob(".tmp-*"))]
    for path in ours:
        if path.is_dir() and not path.is_symlink():
            for moved in path.iterdir():
                if _STEP_FOLDER.match(moved.name) and not (out_dir / moved.name).exists():
                    os.rename(moved, out_dir / moved.name)
            shutil.rmtree(path, ignore_errors=True)
    for path in out_dir.glob(f"{NEXT_LATEST}*"):
        if path.is_symlink():
            path.unlink(missing_ok=True)


_OLDER_TMP = re.compile(r"^\.tmp-[a-z0-9_]{8}$")  # tempfile.mkdtemp(prefix=".tmp-")'s names


def _older_partial(path: Path) -> bool:
    """A `.tmp-*` folder an older mhsa wrote (tempfile's name): the checkpoint files in
    the order it wrote them, cut short or not, or one complete step moved aside, and
    nothing else (a config.json alone, say, is a user's)."""
    if not _OLDER_TMP.match(path.name) or not path.is_dir() or path.is_symlink():
        return False
    names = [entry.name for entry in path.iterdir()]
    if len(names) == 1 and _STEP_FOLDER.match(names[0]):
        return is_checkpoint(path / names[0])
    return bool(names) and sorted(names) == sorted(_FILES[: len(names)])


def check_latest_is_ours(out_dir: str | Path) -> None:
    """ValueError when `latest` in out_dir is something a run did not make (a file or a
    folder, not a link): a run would replace it."""
    latest = Path(out_dir) / "latest"
    if latest.exists() and not latest.is_symlink():
        raise ValueError(
            f"{latest} is not a checkpoint link (a run points 'latest' at its newest "
            "step): move it away or choose another --out"
        )


def check_steps_are_ours(out_dir: str | Path) -> None:
    """ValueError when out_dir holds a `step-N` name that a run did not write: a file, or
    a folder that is no checkpoint and holds more than checkpoint files (a checkpoint
    cut short while it was removed holds some of them): a run writing that step would
    replace it."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    for path in out_dir.iterdir():  # (a checkpoint a user added notes to is still one)
        if _STEP_FOLDER.match(path.name) and not (is_checkpoint(path) or _ours(path)):
            raise ValueError(
                f"{path} is not a checkpoint (a run writes its steps under such names): "
                "move it away or choose another --out"
            )


def _ours(step: Path) -> bool:
    """A step folder holding checkpoint files alone (all, some or none of them)."""
    if not step.is_dir() or step.is_symlink():
        return False
    return all(entry.name in _FILES for entry in step.iterdir())


def save_checkpoint(out_dir: Path, step: int, model: nn.Module, info: dict, trainer: dict) -> Path:
    """Write step-NNNNNN/ atomically and point `latest` at it. Raises ValueError, and
    writes nothing, if a weight is not finite."""
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    bad = [name for name, w in weights.items() if w.is_floating_point() and not w.isfinite().all()]
    if bad:
        raise ValueError(f"not writing a checkpoint at step {step}: {bad[0]} holds nan or inf")
    out_dir.mkdir(parents=True, exist_ok=True)
    check_latest_is_ours(out_dir)
    final = out_dir / f"step-{step:06d}"
    if final.exists() and not (is_checkpoint(final) or _ours(final)):  # (a user's: its
        check_steps_are_ours(out_dir)  # files were deleted with it)
    tmp = Path(tempfile.mkdtemp(prefix=PARTIAL, dir=out_dir))
    try:
        save_file(_untied(weights), tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps({**info, "step": step}, indent=2))
        torch.save(trainer, tmp / "trainer.pt")
        for name in _FILES:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
            as_if_created(tmp / name)
        as_if_created(tmp)  # (mkdtemp made it private)
        if final.exists():  # the same step again: move the old one aside, never rmtree first
            old = Path(tempfile.mkdtemp(prefix=PARTIAL, dir=out_dir))
            os.replace(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    link = out_dir / f"{NEXT_LATEST}{os.getpid()}"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(final.name)
    os.replace(link, out_dir / "latest")
    return final


def _untied(weights: dict) -> dict:
    """safetensors refuses shared storage: store one copy of each tensor."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in weights.items():
        key = tensor.data_ptr()
        out[name] = tensor.clone() if key in seen else tensor
        seen.setdefault(key, name)
    return out


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint `latest` points at, else the newest complete step folder (a run
    killed between a folder's rename and the link's), else None."""
    out_dir = Path(out_dir)
    link = out_dir / "latest"
    if link.exists() and is_checkpoint(link.resolve()):
        return link.resolve()
    found = checkpoints_in(out_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, or an output folder (its latest checkpoint)."""
    path = Path(path)
    if not is_checkpoint(path):
        path = latest_checkpoint(path) or path
    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a checkpoint: expected model.safetensors and config.json "
            "(or an output folder with a `latest` link), as `mhsa train` writes"
        )
    return path


def load_checkpoint(
    path: str | Path, *, weights: bool = True, trainer: bool = True, expected: dict | None = None
) -> dict:
    """{'path', 'info' (config.json), 'weights', 'trainer' (or None)}; weights and
    trainer only when asked. expected ({name: shape}) is checked against the file's
    header before any tensor is read."""
    path = resolve_checkpoint(path)
    try:
        info = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({error})") from error
    if not isinstance(info, dict):
        raise ValueError(f"{path / 'config.json'}: expected a JSON object")
    trainer_path = path / "trainer.pt"
    return {
        "path": path,
        "info": info,
        "weights": read_weights(path / "model.safetensors", expected) if weights else None,
        "trainer": _read_trainer(trainer_path) if trainer and trainer_path.exists() else None,
    }


def _read_trainer(path: Path) -> dict:
    """trainer.pt, or a ValueError naming it (a damaged file is no traceback)."""
    try:
        return torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise ValueError(
            f"{path} cannot be read ({str(error).splitlines()[0]}): a damaged checkpoint; "
            "resume from another step folder, or start a new run"
        ) from None


def read_weights(file: Path, expected: dict | None = None) -> dict:
    """The tensors of a safetensors file; with expected ({name: shape}) every name and
    shape is checked from the header first (formats.weights.read_tensors). ValueError
    naming the file otherwise."""
    source = SafetensorsFiles(file)
    if expected is None:
        expected = source.shapes()
    fix = "it was written for another model (its config.json does not fit), or damaged"
    return read_tensors(source, None, expected, expected_by="its config.json", fix=fix)
