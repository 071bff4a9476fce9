"""ClassificationTask: an empty training split is one line saying what to give."""

from __future__ import annotations

import pytest
import torch

from mhsa.data.classify import ClassificationTask, split


def test_an_empty_training_split_is_a_clear_error():
    """One image per class all goes to the test split: the first training batch once
    raised torch's "random_ expects 'from' to be less than 'to'"."""
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    train, test = split(x, y, 0.2, seed=0)
    with pytest.raises(ValueError, match="no example is left to train on: all 2 went to the test"):
        ClassificationTask(train, test, batch_size=2)
    x, y = torch.randn(10, 3), torch.tensor([0, 1] * 5)
    task = ClassificationTask(*split(x, y, 0.2, seed=0), batch_size=2)
    assert len(task.train_batch(torch.Generator().manual_seed(0))[-1]) == 2


def test_16_bit_grey_images_keep_their_range(tmp_path):
    """Pillow's convert("L") clips 16-bit grey at 255: 99.6% of a ramp read as 1.0."""
    pil = pytest.importorskip("PIL.Image")
    import numpy as np

    from mhsa.data.classify import load_image

    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    pil.fromarray(ramp).save(tmp_path / "ramp.png")
    for channels in (1, 3):
        image = load_image(tmp_path / "ramp.png", 64, channels)
        assert image.shape == (channels, 64, 64)
        expected = torch.from_numpy(ramp.astype(np.float32) / 65535)
        assert (image - expected).abs().max() < 1e-3
    pil.fromarray(np.zeros((4, 4), dtype=np.float32)).save(tmp_path / "float.tiff")
    with pytest.raises(ValueError, match="mode F"):
        load_image(tmp_path / "float.tiff", 4, 1)
    pil.fromarray(np.full((4, 4), 70000, dtype=np.int32)).save(tmp_path / "wide.tiff")
    with pytest.raises(ValueError, match="32-bit pixels beyond 0..65535"):
        load_image(tmp_path / "wide.tiff", 4, 1)
