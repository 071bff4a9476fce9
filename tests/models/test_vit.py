"""ViT: shapes, position interpolation, training end to end on a tiny config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mhsa.cli import main
from mhsa.models.vit import ViT, ViTConfig
from optional import needs


def test_forward_shapes_and_cls_readout():
    model = ViT(ViTConfig(image_size=8, patch_size=2, num_classes=10, d_model=32, n_layer=2))
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert model.pos_emb.shape == (1, 17, 32)  # [CLS] + 4 x 4 patches


def test_positions_interpolate_for_other_image_sizes():
    model = ViT(ViTConfig(image_size=8, patch_size=2, d_model=16, n_layer=1, n_head=2)).eval()
    assert model(torch.randn(2, 1, 12, 16)).shape == (2, 10)
    assert torch.equal(model.positions(4, 4), model.pos_emb)
    resized = model.positions(6, 8)
    assert resized.shape == (1, 49, 16) and torch.equal(resized[:, 0], model.pos_emb[:, 0])


def test_interpolated_positions_equal_bicubic_resize_of_the_grid():
    """A 4 x 4 grid resized to 6 rows x 8 columns: patch (r, c) of the wider image gets
    the bicubic resize's value at row r, column c (rows are the image's height)."""
    model = ViT(ViTConfig(image_size=8, patch_size=2, d_model=16, n_layer=1, n_head=2))
    grid = model.pos_emb[0, 1:].detach().reshape(4, 4, 16).permute(2, 0, 1)  # (d, rows, cols)
    resized = F.interpolate(grid[None], size=(6, 8), mode="bicubic", align_corners=False)[0]
    got = model.positions(6, 8)[0, 1:].detach().reshape(6, 8, 16)  # row-major patches
    for r, c in ((0, 0), (0, 7), (5, 0), (2, 5), (5, 7)):
        assert torch.allclose(got[r, c], resized[:, r, c], atol=1e-6)


def test_bad_images_are_clear_errors():
    model = ViT(ViTConfig(d_model=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"images must be \(batch, 1, H, W\)"):
        model(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"multiples of patch_size 2, got \(9, 9\)"):
        model(torch.randn(1, 1, 9, 9))  # the strided convolution would drop a row and column
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ViTConfig(image_size=9, patch_size=2)


def test_train_vit_end_to_end(tmp_path, capsys):
    needs("sklearn")  # the built-in digits
    args = [
        "train",
        "vit",
        "--out",
        str(tmp_path / "vit"),
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sklearn digits" in out and "test accuracy" in out
    assert (tmp_path / "vit" / "latest" / "model.safetensors").exists()
    # classify: a digit saved as a PNG, and a file that is not an image
    from PIL import Image

    from mhsa.data.classify import digits

    images, _ = digits()
    pixels = (images[0, 0] * 255).round().byte().numpy()
    Image.fromarray(pixels, mode="L").save(tmp_path / "digit.png")
    (tmp_path / "notes.txt").write_text("not an image")
    files = [str(tmp_path / "digit.png"), str(tmp_path / "notes.txt")]
    assert main(["classify", str(tmp_path / "vit"), *files, "--top", "2"]) == 2
    captured = capsys.readouterr()
    line = captured.out.strip()
    assert line.startswith(f"{files[0]}: ") and line.count(" 0.") + line.count(" 1.0") == 2
    assert (
        "notes.txt: not a readable image" in captured.err and "1 of 2 files failed" in captured.err
    )


def test_train_vit_names_a_missing_or_classless_data_folder(tmp_path, capsys):
    """A missing folder was a bare SystemExit (exit 1, no "mhsa train:", no word that
    the folder is missing)."""
    base = ["train", "vit", "--out", str(tmp_path / "run"), "--steps", "1"]
    assert main([*base, "--data", str(tmp_path / "nodir")]) == 2
    assert "mhsa train: --data" in capsys.readouterr().err
    (tmp_path / "one" / "cats").mkdir(parents=True)
    assert main([*base, "--data", str(tmp_path / "one")]) == 2
    assert "need one sub-folder per class (two or more)" in capsys.readouterr().err
