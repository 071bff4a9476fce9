"""A built-in point-cloud dataset: surfaces of simple solids, randomly rotated, scaled
and jittered, with a varying number of points. Nothing is downloaded."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

SHAPES = ("sphere", "cube", "cylinder", "cone", "torus", "pyramid")


def _uniform(n: int, g: torch.Generator, low: float = 0.0, high: float = 1.0) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=g)


def _triangles(corners: Tensor, n: int, g: torch.Generator) -> Tensor:
    """n points uniform on triangles corners (T, 3, 3), chosen by area."""
    a, b, c = corners[:, 0], corners[:, 1], corners[:, 2]
    areas = torch.linalg.cross(b - a, c - a).norm(dim=-1)
    tri = torch.multinomial(areas, n, replacement=True, generator=g)
    u, v = _uniform(n, g).sqrt(), _uniform(n, g)
    return (1 - u)[:, None] * a[tri] + (u * (1 - v))[:, None] * b[tri] + (u * v)[:, None] * c[tri]


def _sample(shape: str, n: int, g: torch.Generator) -> Tensor:
    """n points (n, 3) on the surface of a canonical shape of radius about 1."""
    theta = _uniform(n, g, 0, 2 * math.pi)
    if shape == "sphere":
        p = torch.randn(n, 3, generator=g)
        return p / p.norm(dim=-1, keepdim=True)
    if shape == "cube":
        p = _uniform(3 * n, g, -1, 1).view(n, 3)
        axis = torch.randint(0, 3, (n,), generator=g)
        p[torch.arange(n), axis] = torch.where(_uniform(n, g) < 0.5, -1.0, 1.0)
        return p
    if shape == "cylinder":  # radius 1, height 2: the side has 2/3 of the area
        side = _uniform(n, g) < 2 / 3
        r = torch.where(side, torch.ones(n), _uniform(n, g).sqrt())
        z = torch.where(side, _uniform(n, g, -1, 1), torch.where(_uniform(n, g) < 0.5, -1.0, 1.0))
        return torch.stack([r * theta.cos(), r * theta.sin(), z], dim=-1)
    if shape == "cone":  # apex at z = 1, base of radius 1 at z = -1
        base = _uniform(n, g) < 1 / (1 + math.sqrt(5))
        t = torch.where(base, torch.ones(n), _uniform(n, g).sqrt())  # distance from apex
        r = torch.where(base, _uniform(n, g).sqrt(), t)
        z = torch.where(base, -torch.ones(n), 1 - 2 * t)
        return torch.stack([r * theta.cos(), r * theta.sin(), z], dim=-1)
    if shape == "torus":
        phi = _uniform(n, g, 0, 2 * math.pi)
        ring = 1 + 0.35 * phi.cos()
        return torch.stack([ring * theta.cos(), ring * theta.sin(), 0.35 * phi.sin()], dim=-1)
    if shape == "pyramid":
        base = torch.tensor([[-1, -1, -1], [1, -1, -1], [1, 1, -1], [-1, 1, -1]], dtype=torch.float)
        apex = torch.tensor([0.0, 0.0, 1.0])
        faces = [torch.stack([base[i], base[(i + 1) % 4], apex]) for i in range(4)]
        faces += [base[[0, 1, 2]], base[[0, 2, 3]]]
        return _triangles(torch.stack(faces), n, g)
    raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")


def _rotation(g: torch.Generator) -> Tensor:
    """A uniformly random 3-D rotation (QR of a Gaussian matrix, sign-fixed)."""
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def point_cloud(shape: str, g: torch.Generator, points: tuple[int, int] = (96, 160)) -> Tensor:
    """One randomly posed, scaled and jittered cloud (N, 3) of `shape`."""
    n = int(torch.randint(points[0], points[1] + 1, (), generator=g))
    cloud = _sample(shape, n, g) @ _rotation(g).T
    cloud = cloud * _uniform(1, g, 0.6, 1.4) + 0.02 * torch.randn(n, 3, generator=g)
    return cloud - cloud.mean(dim=0)


def dataset(per_class: int, seed: int) -> tuple[list[Tensor], Tensor]:
    """per_class clouds of each shape: (list of (N_i, 3) clouds, labels)."""
    g = torch.Generator().manual_seed(seed)
    clouds, labels = [], []
    for label, shape in enumerate(SHAPES):
        for _ in range(per_class):
            clouds.append(point_cloud(shape, g))
            labels.append(label)
    return clouds, torch.tensor(labels)


def collate(clouds: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Pad clouds to the largest: (points (B, N, 3), mask (B, N) True = real point)."""
    size = max(len(c) for c in clouds)
    points = torch.zeros(len(clouds), size, 3)
    mask = torch.zeros(len(clouds), size, dtype=torch.bool)
    for i, cloud in enumerate(clouds):
        points[i, : len(cloud)] = cloud
        mask[i, : len(cloud)] = True
    return points, mask


def read_points(path: str | Path) -> Tensor:
    """A point cloud (N, 3) from a .npy file or a text file of x y z rows, centred as the
    built-in clouds are."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such point file")
    try:
        array = np.load(path) if path.suffix == ".npy" else np.loadtxt(path, ndmin=2)
    except ValueError as error:
        raise ValueError(f"{path}: not a point file of x y z rows ({error})") from error
    if array.ndim != 2 or array.shape[1] != 3 or len(array) == 0:
        raise ValueError(f"{path}: expected N x 3 points (x y z per row), got {array.shape}")
    cloud = torch.as_tensor(array, dtype=torch.float32)
    if not cloud.isfinite().all():
        raise ValueError(f"{path}: the points hold nan or inf")
    return cloud - cloud.mean(dim=0)
