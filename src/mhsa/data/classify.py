"""Classification data for the encoders: a task over in-memory tensors, sklearn's
bundled digits, and folders of labelled images."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


class ClassificationTask:
    """Random training batches, fixed test batches, test accuracy as the metric.

    inputs may be a tensor (N, ...) or a list of tensors (padded per batch by
    `collate`, which returns the model's input arguments)."""

    def __init__(
        self,
        train: tuple,
        test: tuple,
        batch_size: int,
        *,
        augment: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        collate: Callable | None = None,
        items_per_sample: int = 1,
    ) -> None:
        self.train_x, self.train_y = train
        self.test_x, self.test_y = test
        if len(self.train_y) == 0:
            raise ValueError(
                f"no example is left to train on: all {len(self.test_y)} went to the test "
                "split (it takes at least one per class, or one voice in five); give more "
                "examples (more images per class, more --voices)"
            )
        self.batch_size, self.augment = batch_size, augment
        self.collate = collate or (lambda xs: (torch.stack(xs) if isinstance(xs, list) else xs,))
        self.items_per_sample = items_per_sample
        order = torch.arange(len(self.test_y)).split(max(batch_size, 256))
        self._eval = [(*self._inputs(self.test_x, idx), self.test_y[idx]) for idx in order]

    def _inputs(self, data, idx: Tensor) -> tuple:
        if isinstance(data, list):
            return self.collate([data[i] for i in idx.tolist()])
        return self.collate(data[idx])

    def train_batch(self, generator: torch.Generator) -> tuple:
        idx = torch.randint(0, len(self.train_y), (self.batch_size,), generator=generator)
        inputs = self._inputs(self.train_x, idx)
        if self.augment is not None:
            inputs = (self.augment(inputs[0], generator), *inputs[1:])
        return (*inputs, self.train_y[idx])

    def eval_batches(self) -> list[tuple]:
        return self._eval

    def tokens_per_batch(self) -> int:
        return self.batch_size * self.items_per_sample

    def metrics(self, model) -> dict:
        """Test accuracy; each batch's inputs go to the model's device."""
        device = next(model.parameters()).device
        correct = 0
        for *inputs, labels in self._eval:
            inputs = [x.to(device) if isinstance(x, Tensor) else x for x in inputs]
            correct += (model(*inputs).argmax(-1).cpu() == labels).sum().item()
        return {"test_acc": correct / len(self.test_y)}


def split(x, y: Tensor, test_fraction: float, seed: int) -> tuple[tuple, tuple]:
    """A shuffled split, stratified by label, fixed by the seed."""
    generator = torch.Generator().manual_seed(seed)
    test_idx = []
    for label in y.unique():
        members = (y == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        test_idx.append(members[: max(1, round(len(members) * test_fraction))])
    test = torch.cat(test_idx)
    mask = torch.ones(len(y), dtype=torch.bool)
    mask[test] = False
    train = mask.nonzero().flatten()

    def take(idx):
        return [x[i] for i in idx.tolist()] if isinstance(x, list) else x[idx]

    return (take(train), y[train]), (take(test), y[test])


def digits() -> tuple[Tensor, Tensor]:
    """scikit-learn's bundled 8x8 handwritten digits: images (1797, 1, 8, 8) in [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise SystemExit("the digits data needs scikit-learn: pip install scikit-learn") from error
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(data.target, dtype=torch.long)


def shift_augment(images: Tensor, generator: torch.Generator, max_shift: int = 1) -> Tensor:
    """Shift each image by up to max_shift pixels in each direction (zero fill)."""
    padded = torch.nn.functional.pad(images, (max_shift,) * 4)
    size = images.shape[-1]
    out = torch.empty_like(images)
    offsets = torch.randint(0, 2 * max_shift + 1, (len(images), 2), generator=generator)
    for i, (dy, dx) in enumerate(offsets.tolist()):
        out[i] = padded[i, :, dy : dy + size, dx : dx + size]
    return out


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
WIDE_GREY = ("I;16", "I;16B", "I;16L", "I")  # Pillow's 16-bit grey modes (and 32-bit "I")


def load_image(path: str | Path, size: int, channels: int) -> Tensor:
    """One image as (channels, size, size) in [0, 1], resized (needs Pillow)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as error:
        raise SystemExit("reading images needs Pillow: pip install pillow") from error
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such image")
    try:
        with Image.open(path) as opened:
            if opened.mode in WIDE_GREY:  # (convert("L") clips them at 255: almost all white)
                grey = np.asarray(opened, dtype=np.float32)
                if grey.size and not 0 <= grey.min() <= grey.max() <= 65535:
                    raise ValueError(f"{path}: 32-bit pixels beyond 0..65535: save 8 or 16 bits")
                grey = grey / 65535.0
                image = Image.fromarray(grey).resize((size, size))  # (mode F)
                array = torch.from_numpy(np.asarray(image, dtype=np.float32).copy())
                return array.clamp(0, 1).expand(channels, size, size).contiguous()
            if opened.mode == "F":
                raise ValueError(
                    f"{path}: float pixels (mode F) have no known range: save 8 or 16 bits"
                )
            image = opened.convert("L" if channels == 1 else "RGB").resize((size, size))
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path}: not a readable image ({error})") from error
    array = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()) / 255.0
    return array.view(size, size, channels).permute(2, 0, 1)


def image_folder(directory: str | Path, size: int, channels: int) -> tuple[Tensor, Tensor, list]:
    """Images under directory/<class name>/*.{png,jpg,jpeg}, resized to size x size."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--data {directory}: no such folder (one sub-folder per class)")
    classes = sorted(p.name for p in directory.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ValueError(f"--data {directory}: need one sub-folder per class (two or more)")
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((directory / name).iterdir()):
            if path.suffix.lower() in IMAGE_SUFFIXES:
                images.append(load_image(path, size, channels))
                labels.append(label)
    if not images:
        raise ValueError(f"--data {directory}: no .png/.jpg images found")
    return torch.stack(images), torch.tensor(labels), classes
