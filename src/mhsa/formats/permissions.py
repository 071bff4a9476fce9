"""Files and folders made through tempfile (private: 0600 and 0700) and then renamed
into place get the permissions that open() or mkdir() would have given them: 0666 and
0777 less the umask, so that a checkpoint or a page can be read by whoever could read
the folder it lands in."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def current_umask() -> int:
    """The process's umask: read from /proc where Linux shows it, else set and restored
    at once (the only way elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def as_if_created(path: Path) -> None:
    """Give path (a file or a folder) the mode a plain open() or mkdir() would have."""
    full = 0o777 if path.is_dir() else 0o666
    os.chmod(path, full & ~current_umask() & (stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO))
