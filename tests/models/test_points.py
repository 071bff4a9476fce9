"""Point clouds: permutation invariance of the classifier, equivariance of the encoder."""

from __future__ import annotations

import pytest
import torch

from helpers import max_error
from mhsa.cli import main
from mhsa.data.shapes import SHAPES, collate, dataset, point_cloud
from mhsa.models.points import PointCloudConfig, PointCloudTransformer


@pytest.mark.parametrize("pooling", ["attention", "mean", "max"])
def test_permutation_invariant_output_and_equivariant_encoder(pooling):
    model = PointCloudTransformer(PointCloudConfig(d_model=32, n_layer=2, pooling=pooling)).eval()
    clouds, _ = dataset(2, seed=0)
    points, mask = collate(clouds[:4])
    perm = torch.randperm(points.shape[1])
    with torch.no_grad():
        logits = model(points, mask)
        permuted = model(points[:, perm], mask[:, perm])
        features = model.encode(points, mask)
        permuted_features = model.encode(points[:, perm], mask[:, perm])
    assert max_error(permuted, logits) < 1e-5
    real = mask[:, perm]
    assert max_error(permuted_features[real], features[:, perm][real]) < 1e-5


def test_output_is_invariant_to_rotation_shift_and_scale():
    model = PointCloudTransformer(PointCloudConfig(d_model=32, n_layer=2)).eval()
    g = torch.Generator().manual_seed(0)
    cloud = torch.randn(100, 3, generator=g) * torch.tensor([3.0, 2.0, 1.0])  # distinct axes
    cloud = cloud + 0.2 * cloud.square()  # and a non-zero third moment on each axis
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g))
    moved = 2.5 * cloud @ q.T + torch.tensor([1.0, -2.0, 0.5])
    with torch.no_grad():
        assert max_error(model(moved.unsqueeze(0)), model(cloud.unsqueeze(0))) < 1e-4


def test_padding_does_not_change_the_output():
    model = PointCloudTransformer(PointCloudConfig(d_model=32, n_layer=2)).eval()
    cloud = point_cloud("torus", torch.Generator().manual_seed(0))
    alone = model(cloud.unsqueeze(0))
    padded, mask = collate(
        [cloud, point_cloud("cube", torch.Generator().manual_seed(1), points=(200, 200))]
    )
    assert max_error(model(padded, mask)[0], alone[0]) < 1e-5


def test_shapes_are_what_they_say():
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        cloud = point_cloud(shape, g)
        assert cloud.shape[1] == 3 and 96 <= len(cloud) <= 160
        assert cloud.mean(0).abs().max() < 1e-5  # centred
    with pytest.raises(ValueError, match="unknown shape"):
        point_cloud("blob", g)


def test_train_points_end_to_end(tmp_path, capsys):
    args = [
        "train",
        "points",
        "--out",
        str(tmp_path / "pts"),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--per-class",
        "5",
        "--layers",
        "1",
        "--d-model",
        "16",
    ]
    assert main(args) == 0
    assert "test accuracy" in capsys.readouterr().out
    # classify a cube written as x y z text rows
    import numpy as np

    from mhsa.data.shapes import SHAPES, point_cloud

    cloud = point_cloud("cube", torch.Generator().manual_seed(3))
    np.savetxt(tmp_path / "cube.txt", cloud.numpy())
    assert main(["classify", str(tmp_path / "pts"), str(tmp_path / "cube.txt")]) == 0
    label = capsys.readouterr().out.split(": ")[1].split(" (")[0]
    assert label in SHAPES
    (tmp_path / "flat.txt").write_text("1 2\n3 4\n")
    assert main(["classify", str(tmp_path / "pts"), str(tmp_path / "flat.txt")]) == 2
    assert "expected N x 3 points" in capsys.readouterr().err
