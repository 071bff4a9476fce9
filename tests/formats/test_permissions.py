"""What we write through a private temporary file or folder lands with the permissions a
plain open() or mkdir() gives: 0666 and 0777 less the umask."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from mhsa.apps.viz.files import write_atomically
from mhsa.checkpoint import save_checkpoint
from mhsa.formats.permissions import current_umask


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def test_the_umask_is_read_as_set(umask):
    assert current_umask() == umask


def test_checkpoints_and_pages_get_the_modes_open_and_mkdir_give(tmp_path, umask):
    folder = save_checkpoint(tmp_path / "run", 1, torch.nn.Linear(2, 2), {"model": "x"}, {})
    assert _mode(folder) == 0o777 & ~umask
    for name in ("model.safetensors", "config.json", "trainer.pt"):
        assert _mode(folder / name) == 0o666 & ~umask, name
    page = write_atomically(tmp_path / "page.html", lambda tmp: tmp.write_text("<p>hi</p>"))
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert _mode(page) == _mode(plain) == 0o666 & ~umask
