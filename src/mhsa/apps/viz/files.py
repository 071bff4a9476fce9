"""A file written whole or not at all: into a temporary file beside it, then renamed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ...formats.permissions import as_if_created


def write_atomically(
    path: str | Path, write: Callable[[Path], None], *, overwrite: bool = True
) -> Path:
    """write(tmp) fills a temporary file in path's folder (made if missing), which then
    replaces path in one rename: a reader never sees half a file, and a failed write
    leaves path as it was. A folder at path is refused (ValueError), never replaced;
    without overwrite, so is a file that appeared there meanwhile (linked, not renamed:
    the check and the write are one step)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: name a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(
        prefix=f".tmp-{path.stem}-", suffix=path.suffix, dir=path.parent
    )
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        as_if_created(tmp)  # (mkstemp made it private)
        if overwrite:
            os.replace(tmp, path)
        else:
            _place_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _place_new(tmp: Path, path: Path) -> None:
    """tmp at path, where nothing may be: a hard link fails if something is there."""
    exists = ValueError(f"{path} exists now: pass --overwrite to replace it")
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise exists from None
    except OSError:  # a file system without hard links: check, then rename
        if path.exists():
            raise exists from None
        os.replace(tmp, path)
