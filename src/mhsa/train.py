"""The one training loop for every model: progress, evaluation, atomic checkpoints, resume.

A model trains if it has `loss(*batch) -> scalar`; a task supplies batches:
    task.train_batch(generator) -> batch     random, drawn from `generator`
    task.eval_batches() -> list of batches   fixed
    task.tokens_per_batch() -> int           for the tokens/s figure
    task.metrics(model) -> dict              optional, e.g. test accuracy, at each eval

Checkpoints live in an output directory as `step-NNNNNN/` folders holding
`model.safetensors` (weights), `config.json` (what rebuilds the model) and
`trainer.pt` (optimizer, step, random states), with a `latest` symlink. A folder is
written under a temporary name and renamed, and `latest` is swapped by an atomic
rename, so a run killed at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


@dataclass
class TrainConfig:
    steps: int = 300
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int = 100
    seed: int = 0


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model: nn.Module, task) -> float:
    was_training = model.training
    model.eval()
    losses = [model.loss(*batch).item() for batch in task.eval_batches()]
    model.train(was_training)
    return sum(losses) / len(losses)


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def train(
    model: nn.Module,
    task,
    config: TrainConfig,
    out_dir: str | Path,
    *,
    model_info: dict,
    resume: bool = False,
    stop_after: int | None = None,
    log=print,
    context_parallel: str | None = None,
) -> dict:
    """Train `model` on `task` for config.steps steps, checkpointing into out_dir.

    model_info (JSON-able) goes into config.json to rebuild the model later.
    resume continues from out_dir's latest checkpoint exactly where it stopped.
    stop_after ends the run early after that many steps (as a kill would, but with a
    checkpoint written first).

    Under an initialised torch.distributed group every rank draws the same global
    batch. By default (data parallel) each trains on its share of the rows with
    DistributedDataParallel. With context_parallel (a layout of mhsa.distributed,
    e.g. "zigzag") each rank takes its shard of every sequence instead - batches are
    (tokens, targets) (B, T) and model.loss takes `positions` - attention runs as ring
    attention, and gradients are averaged over ranks after backward.
    """
    out_dir = Path(out_dir)
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed + 1)
    optimizer = _optimizer(model, config)
    step = 0
    history: list[dict] = []
    if resume:
        state = load_checkpoint(out_dir)
        model.load_state_dict(state["weights"])
        trainer = state["trainer"]
        optimizer.load_state_dict(trainer["optimizer"])
        generator.set_state(trainer["generator"])
        torch.set_rng_state(trainer["torch_rng"])
        step, history = trainer["step"], trainer["history"]
        log(f"resumed from {state['path']} at step {step}")
    model.train()
    compute_loss, rank, world = _data_parallel(model, context_parallel)
    start, tokens_done = time.perf_counter(), 0
    end = config.steps if stop_after is None else min(config.steps, step + stop_after)
    while step < end:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        # every rank draws the same global batch; data parallel: each takes its share of
        # the rows, context parallel: each its shard of every sequence (_SequenceShards)
        batch = task.train_batch(generator)
        loss = compute_loss(*(batch if context_parallel else _local_rows(batch, rank, world)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if context_parallel and world > 1:
            _average_gradients(model, world)
        nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        step += 1
        tokens_done += task.tokens_per_batch()
        elapsed = time.perf_counter() - start
        loss = _mean_over_ranks(loss.detach(), world)
        if rank:  # rank 0 alone reports, evaluates and writes checkpoints
            if step % config.checkpoint_every == 0 or step == end:
                dist.barrier()
            continue
        _progress(step, config.steps, loss.item(), tokens_done / elapsed, elapsed)
        if step % config.eval_every == 0 or step == config.steps:
            val = evaluate(model, task)
            record = {"step": step, "train_loss": loss.item(), "val_loss": val}
            if hasattr(task, "metrics"):
                model.eval()
                with torch.no_grad():
                    record.update(task.metrics(model))
                model.train()
            history.append(record)
            sys.stderr.write("\n")
            extra = "".join(f", {k} {v:.4f}" for k, v in record.items() if k not in
                            ("step", "train_loss", "val_loss"))  # fmt: skip
            log(f"step {step}: val loss {val:.4f}{extra}")
        if step % config.checkpoint_every == 0 or step == end:
            trainer = {
                "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state(), "step": step, "history": history,
                "train_config": asdict(config),
            }  # fmt: skip
            save_checkpoint(out_dir, step, model, model_info, trainer)
            if world > 1:
                dist.barrier()
    seconds = time.perf_counter() - start
    return {"step": step, "seconds": seconds, "history": history,
            "tokens_per_second": tokens_done / max(seconds, 1e-9)}  # fmt: skip


class _Loss(nn.Module):
    """model.loss as a forward, so that DistributedDataParallel sees the call."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch) -> Tensor:
        return self.model.loss(*batch)


def _data_parallel(model: nn.Module, context_parallel: str | None) -> tuple:
    """(loss function on the global batch's rows for this rank, rank, world size)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model.loss, 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if context_parallel:
        return _SequenceShards(model, context_parallel, rank, world), rank, world
    return DistributedDataParallel(_Loss(model)), rank, world


class _SequenceShards:
    """model.loss on this rank's shard of every sequence, attention as ring attention."""

    def __init__(self, model: nn.Module, layout: str, rank: int, world: int) -> None:
        self.model, self.layout, self.rank, self.world = model, layout, rank, world

    def __call__(self, tokens: Tensor, targets: Tensor) -> Tensor:
        from .distributed import context_parallel, shard

        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cut = {"rank": self.rank, "world_size": self.world, "layout": self.layout}
        tokens, targets = shard(tokens, dim=1, **cut), shard(targets, dim=1, **cut)
        with context_parallel(layout=self.layout):
            return self.model.loss(tokens, targets, positions=shard(positions, dim=0, **cut))


def _average_gradients(model: nn.Module, world: int) -> None:
    """Every rank's loss is the mean over an equal number of tokens: the global mean's
    gradient is the ranks' average."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world


def _local_rows(batch: tuple, rank: int, world: int) -> tuple:
    """This rank's contiguous share of a global batch: every tensor whose first dimension
    is the batch is cut along it, so the mean of the ranks' losses is the global loss."""
    if world == 1:
        return batch
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


def _mean_over_ranks(value: Tensor, world: int) -> Tensor:
    if world > 1:
        dist.all_reduce(value)
        value = value / world
    return value


def _progress(step: int, total: int, loss: float, tokens_per_s: float, elapsed: float) -> None:
    done = step / total
    bar = "#" * int(24 * done) + "-" * (24 - int(24 * done))
    eta = elapsed / max(step, 1) * (total - step)
    sys.stderr.write(f"\r[{bar}] step {step}/{total}  loss {loss:.4f}  "
                     f"{tokens_per_s / 1e3:.1f}k tok/s  eta {eta:4.0f}s ")  # fmt: skip
    sys.stderr.flush()


def save_checkpoint(out_dir: Path, step: int, model: nn.Module, info: dict, trainer: dict) -> Path:
    """Write step-NNNNNN/ atomically and point `latest` at it; drop older steps."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
    try:
        weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(_untied(weights), tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps({**info, "step": step}, indent=2))
        torch.save(trainer, tmp / "trainer.pt")
        for name in ("model.safetensors", "config.json", "trainer.pt"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    link = out_dir / f".latest-{os.getpid()}"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(final.name)
    os.replace(link, out_dir / "latest")
    for old in out_dir.glob("step-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _untied(weights: dict) -> dict:
    """safetensors refuses shared storage: store one copy of each tensor."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in weights.items():
        key = tensor.data_ptr()
        out[name] = tensor.clone() if key in seen else tensor
        seen.setdefault(key, name)
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, or an output folder (its `latest`)."""
    path = Path(path)
    if (path / "latest").exists():
        path = (path / "latest").resolve()
    if not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint: expected model.safetensors and config.json "
            "(or an output folder with a `latest` link), as `mhsa train` writes"
        )
    return path


def load_checkpoint(path: str | Path) -> dict:
    """{'path', 'info' (config.json), 'weights', 'trainer' (or None)}."""
    path = resolve_checkpoint(path)
    trainer_path = path / "trainer.pt"
    return {
        "path": path,
        "info": json.loads((path / "config.json").read_text()),
        "weights": load_file(path / "model.safetensors"),
        "trainer": torch.load(trainer_path, weights_only=True) if trainer_path.exists() else None,
    }
