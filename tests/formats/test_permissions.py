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


def test_a_file_that_appears_while_a_page_is_made_is_kept_without_overwrite(tmp_path):
    """mhsa viz checks --out before loading the model; a file made there meanwhile was
    replaced without --overwrite. The check and the write are now one step."""
    path = tmp_path / "maps.png"

    def write_while_someone_saves_there(tmp):
        tmp.write_text("ours")
        path.write_text("the user's")

    with pytest.raises(ValueError, match="maps.png exists now: pass --overwrite"):
        write_atomically(path, write_while_someone_saves_there, overwrite=False)
    assert path.read_text() == "the user's" and list(tmp_path.iterdir()) == [path]
    write_atomically(path, lambda tmp: tmp.write_text("ours"))  # overwrite, as before
    assert path.read_text() == "ours"
    fresh = write_atomically(tmp_path / "new.png", lambda tmp: tmp.write_text("n"), overwrite=False)
    assert fresh.read_text() == "n" and len(list(tmp_path.iterdir())) == 2
