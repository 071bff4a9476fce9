"""A file written whole or not at all: into a temporary file beside it, then renamed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ...formats.permissions import as_if_created


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> Path:
    """write(tmp) fills a temporary file in path's folder (made if missing), which then
    replaces path in one rename: a reader never sees half a file, and a failed write
    leaves path as it was. A folder at path is refused (ValueError), never replaced."""
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
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
