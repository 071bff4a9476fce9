"""How the ranks of a torch.distributed group share a training step (mhsa.apps.train):
data parallel (each rank its rows of the global batch, DistributedDataParallel) or
context parallel (each rank its shard of every sequence, ring attention), and the
collectives that keep them agreeing (finite on every rank, the mean loss)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def finite_on_every_rank(loss: Tensor, grad_norm: Tensor, world: int) -> bool:
    """Whether the loss and gradients are finite on every rank (all ranks agree, so
    they stop or skip together instead of leaving one waiting in a collective)."""
    finite = (torch.isfinite(loss) & torch.isfinite(grad_norm)).to(torch.int32).view(1)
    if world > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


class _Loss(nn.Module):
    """model.loss as a forward, so that DistributedDataParallel sees the call."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch, **named) -> Tensor:
        return self.model.loss(*batch, **named)


def data_parallel(model: nn.Module, context_parallel: str | None) -> tuple:
    """(loss function on the global batch's rows for this rank, rank, world size)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model.loss, 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if context_parallel:
        return SequenceShards(model, context_parallel, rank, world), rank, world
    return DistributedDataParallel(_Loss(model)), rank, world


class SequenceShards:
    """model.loss on this rank's shard of every sequence, attention as ring attention."""

    def __init__(self, model: nn.Module, layout: str, rank: int, world: int) -> None:
        self.model, self.layout, self.rank, self.world = model, layout, rank, world

    def __call__(self, tokens: Tensor, targets: Tensor) -> Tensor:
        from ...distributed import context_parallel, shard

        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cut = {"rank": self.rank, "world_size": self.world, "layout": self.layout}
        tokens, targets = shard(tokens, dim=1, **cut), shard(targets, dim=1, **cut)
        with context_parallel(layout=self.layout):
            return self.model.loss(tokens, targets, positions=shard(positions, dim=0, **cut))


def average_gradients(model: nn.Module, world: int) -> None:
    """Every rank's loss is the mean over an equal number of tokens: the global mean's
    gradient is the ranks' average."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world


def local_rows(batch: tuple | dict, rank: int, world: int) -> tuple | dict:
    """This rank's contiguous share of a global batch: every tensor whose first dimension
    is the batch is cut along it, so the mean of the ranks' losses is the global loss.
    A dict batch (one packed row) is not cut: it trains in one process."""
    if world == 1:
        return batch
    if isinstance(batch, dict):
        raise ValueError(
            "a packed batch (one row of packed sequences) trains in one process; "
            "drop --pack or --nproc"
        )
    size = batch[0].shape[0]
    if size % world:
        raise ValueError(
            f"the batch size ({size}) must be divisible by the number of processes ({world}): "
            "change --batch-size or --nproc"
        )
    rows = slice(rank * size // world, (rank + 1) * size // world)
    return tuple(
        t[rows] if isinstance(t, Tensor) and t.dim() and t.shape[0] == size else t for t in batch
    )


def mean_over_ranks(value: Tensor, world: int) -> Tensor:
    if world > 1:
        dist.all_reduce(value)
        value = value / world
    return value
