"""The one training loop for every model: progress, evaluation, atomic checkpoints, resume.

A model trains if it has `loss(*batch) -> scalar` (or `loss(**batch)` for a batch that
is a dict, e.g. a packed row with its cu_seqlens); a task supplies batches:
    task.train_batch(generator) -> batch     random, drawn from `generator`
    task.eval_batches() -> list of batches   fixed
    task.tokens_per_batch() -> int           for the tokens/s figure
    task.metrics(model) -> dict              optional, e.g. test accuracy, at each eval

Checkpoints (mhsa.checkpoint) are written atomically into an output folder. A run
never deletes a checkpoint it did not write: it refuses a folder that holds one
unless asked to resume it or to overwrite it (and then removes the old ones only once
its own first checkpoint is written), and it keeps its own last `keep`. A non-finite
loss or gradient stops the run (or skips the step, with nonfinite="skip"), so no
checkpoint ever holds nan or inf weights.

On a GPU (TrainConfig.device "cuda"): the model and each batch move there, the loss is
computed under bfloat16 autocast (TrainConfig.dtype; weights and AdamW's state stay
float32) and AdamW runs fused. A resumed run restores the CUDA random state too; its
continuation is bit-for-bit where the kernels are deterministic (see docs/training.md).
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...checkpoint import (
    check_latest_is_ours,
    check_steps_are_ours,
    checkpoints_in,
    clean_leftovers,
    latest_checkpoint,
    load_checkpoint,
    read_weights,
    resolve_checkpoint,
    save_checkpoint,
)
from ...core.checks import int_at_least
from ...data.packing import IGNORE
from .parallel import (
    average_gradients,
    data_parallel,
    finite_on_every_rank,
    local_rows,
    mean_over_ranks,
)
from .resume import check_resumable, check_same_run
from .throughput import MatmulRate, StepClock, autocast, measure_matmul, to_device

__all__ = [
    "TrainConfig",
    "TrainingDiverged",
    "check_out_dir",
    "check_resumable",
    "evaluate",
    "load_checkpoint",
    "lr_at",
    "resolve_checkpoint",
    "save_checkpoint",
    "train",
]

MAX_SKIPPED_IN_A_ROW = 10  # nonfinite="skip" still stops when nothing finite comes back
LOG_EVERY_SECONDS = 10.0  # progress lines in a log or pipe: at most one per this (see _Progress)


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
    keep: int = 1  # how many of its own latest checkpoints a run keeps
    nonfinite: str = "stop"  # on a nan/inf loss or gradient: "stop", or "skip" the step
    compile: bool = False  # the loss (forward and backward) through torch.compile
    device: str = "cpu"  # where the model and batches go ("cuda": the current GPU)
    dtype: str = "float32"  # the loss under autocast to this ("bfloat16"); float32: none

    def __post_init__(self) -> None:
        for name in ("steps", "eval_every", "checkpoint_every", "keep", "warmup"):
            flag = "--" + name.replace("_", "-")
            int_at_least(name, getattr(self, name), 0 if name == "warmup" else 1, f" ({flag})")
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float):
            raise ValueError(f"lr must be a finite number > 0 (--lr), got {self.lr!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0 (--lr), got {self.lr!r}")
        bounds = {  # (a negative grad_clip flipped every gradient: the model trained uphill)
            "grad_clip": (lambda v: v > 0, "> 0 (inf: no clipping)"),
            "weight_decay": (lambda v: 0 <= v < math.inf, ">= 0 and finite"),
            "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        }
        for name, (fits, words) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not fits(value):
                raise ValueError(f"{name} must be a number {words}, got {value!r}")
        int_at_least("seed", self.seed, 0, " (--seed)")
        if self.seed >= 2**63:  # (torch's seeds end at 2**64 - 1; tasks derive seed + k)
            raise ValueError(f"seed must be below 2**63 (--seed), got {self.seed}")
        if self.nonfinite not in ("stop", "skip"):
            raise ValueError(f"nonfinite must be 'stop' or 'skip', got {self.nonfinite!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16' (--dtype), got {self.dtype!r}")
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):  # ("gpu": torch's list of every device type)
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda (--device), got {self.device!r}")


class TrainingDiverged(RuntimeError):
    """The loss or a gradient became nan or inf; the message names the last good
    checkpoint."""


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model: nn.Module, task, dtype: torch.dtype | str = torch.float32) -> float:
    """The mean loss per target over task's eval batches (each batch's mean loss weighted
    by its targets: task.eval_weight(batch), else targets_counted), each batch moved to
    the model's device and computed under autocast to dtype (float32: none); nan when
    the batches hold no target."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    weight = getattr(task, "eval_weight", targets_counted)
    total = counted = 0.0
    with autocast(device, dtype):
        for batch in task.eval_batches():
            count = weight(batch)
            if count:  # (a batch without targets has loss 0 by convention: it weighs 0)
                total += count * call_loss(model.loss, to_device(batch, device)).item()
                counted += count
    model.train(was_training)
    return total / counted if counted else math.nan


def targets_counted(batch: tuple | dict) -> int:
    """The targets a batch's loss averages over: its "targets" or "labels" (a dict
    batch) or its last tensor (a tuple one), IGNORE (-100) entries left out."""
    targets = batch.get("targets", batch.get("labels")) if isinstance(batch, dict) else batch[-1]
    return int((targets != IGNORE).sum())


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only; fused (one kernel for all) on CUDA."""
    fused = {"fused": True} if torch.device(config.device).type == "cuda" else {}
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), **fused)


def train(
    model: nn.Module,
    task,
    config: TrainConfig,
    out_dir: str | Path,
    *,
    model_info: dict,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
    log=print,
    context_parallel: str | None = None,
    flops_per_token: float | None = None,
) -> dict:
    """Train `model` on `task` for config.steps steps, checkpointing into out_dir.

    model_info (JSON-able) goes into config.json to rebuild the model later.
    resume continues from out_dir's latest checkpoint exactly where it stopped;
    without it, an out_dir that holds a checkpoint is refused unless overwrite is set.
    stop_after ends the run early after that many steps (as a kill would, but with a
    checkpoint written first).

    Under an initialised torch.distributed group every rank draws the same global
    batch. By default (data parallel) each trains on its share of the rows with
    DistributedDataParallel. With context_parallel (a layout of mhsa.distributed,
    e.g. "zigzag") each rank takes its shard of every sequence instead - batches are
    (tokens, targets) (B, T) and model.loss takes `positions` - attention runs as ring
    attention, and gradients are averaged over ranks after backward.

    The model moves to config.device, each batch too; the loss runs under autocast to
    config.dtype. flops_per_token (mhsa.apps.train.throughput.flops_per_token): a matmul in
    config.dtype is timed on the device first, and the progress and result give the
    model flops utilisation against it.

    Returns {"step": the last step, "seconds": this run's time, "history": every
    evaluation (a resumed run's too), "tokens_per_second": this run's,
    "steps_this_run": the steps this run made (step minus where it resumed)}; with
    flops_per_token also "mfu" (this run's) and "matmul" (the MatmulRate).
    """
    out_dir = Path(out_dir)
    device = _device(config.device)
    model.to(device)
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed + 1)
    optimizer = _optimizer(model, config)
    step = 0
    history: list[dict] = []
    owned, replaced = _checkpoints_to_manage(out_dir, resume, overwrite)
    if resume:
        state = load_checkpoint(out_dir, weights=False)
        check_resumable(state, model_info.get("model"))
        check_same_run(state, model_info, config, log)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        model.load_state_dict(read_weights(state["path"] / "model.safetensors", shapes))
        trainer = state["trainer"]
        optimizer.load_state_dict(trainer["optimizer"])
        generator.set_state(trainer["generator"])
        torch.set_rng_state(trainer["torch_rng"])
        if device.type == "cuda" and trainer.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(trainer["cuda_rng"], device)
        step, history = trainer["step"], trainer["history"]
        log(f"resumed from {state['path']} at step {step}")
    model.train()
    compute_loss, rank, world = data_parallel(model, context_parallel)
    if config.compile:
        compute_loss = torch.compile(compute_loss)
    rate = None
    if flops_per_token is not None:  # (the tokens/s counted are the whole group's)
        rate = replace(measure_matmul(device, config.dtype), processes=world)
    start, skipped, first_step, clock = time.perf_counter(), 0, step, StepClock()
    end = config.steps if stop_after is None else min(config.steps, step + stop_after)
    progress = _Progress(first_step, config.steps, end, rate, flops_per_token)
    while step < end:
        clock.start(time.perf_counter())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        # every rank draws the same global batch; data parallel: each takes its share of
        # the rows, context parallel: each its shard of every sequence (SequenceShards)
        batch = to_device(task.train_batch(generator), device)
        with autocast(device, config.dtype):
            loss = call_loss(
                compute_loss, batch if context_parallel else local_rows(batch, rank, world)
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if context_parallel and world > 1:
            average_gradients(model, world)
        norm = nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        if finite_on_every_rank(loss.detach(), norm, world):
            skipped = 0
            optimizer.step()
        else:
            skipped += 1
            if config.nonfinite == "stop" or skipped >= MAX_SKIPPED_IN_A_ROW:
                raise TrainingDiverged(_divergence_message(out_dir, step, loss, config, skipped))
            log(f"step {step + 1}: non-finite loss or gradient, step skipped")
        step += 1
        loss = mean_over_ranks(loss.detach(), world)
        if device.type == "cuda":  # the step's kernels, the optimizer's included, are done
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        clock.stop(task.tokens_per_batch(), now)
        elapsed = now - start
        if rank:  # rank 0 alone reports, evaluates and writes checkpoints
            if step % config.checkpoint_every == 0 or step == end:
                dist.barrier()
            continue
        progress.step(step, loss.item(), clock.tokens_per_second(), elapsed)
        if step % config.eval_every == 0 or step == config.steps:
            val = evaluate(model, task, config.dtype)
            record = {"step": step, "train_loss": loss.item(), "val_loss": val}
            if hasattr(task, "metrics"):
                model.eval()
                with torch.no_grad():  # no autocast: a metric may decode into caches
                    record.update(task.metrics(model))
                model.train()
            history.append(record)
            progress.end_line()
            extra = "".join(
                f", {k} {v:.4f}"
                for k, v in record.items()
                if k not in ("step", "train_loss", "val_loss")
            )
            log(f"step {step}: val loss {val:.4f}{extra}")
        if step % config.checkpoint_every == 0 or step == end:
            trainer = {
                "optimizer": to_device(optimizer.state_dict(), "cpu"),  # resumable anywhere
                "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                "step": step,
                "history": history,
                "train_config": asdict(config),
            }
            written = save_checkpoint(out_dir, step, model, model_info, trainer)
            owned = [p for p in owned if p != written] + [written]
            for old in owned[: -config.keep] + [p for p in replaced if p != written]:
                shutil.rmtree(old, ignore_errors=True)
            owned, replaced = owned[-config.keep :], []
            if world > 1:
                dist.barrier()
    progress.end_line()
    seconds = time.perf_counter() - start
    result = {
        "step": step,
        "seconds": seconds,
        "history": history,
        "tokens_per_second": clock.tokens_per_second(),  # (StepClock: the steps' own rate)
        "steps_this_run": step - first_step,  # seconds and tokens/s are this run's too
    }
    if rate is not None:
        result["mfu"] = rate.mfu(result["tokens_per_second"], flops_per_token)
        result["matmul"] = rate
    return result


def _device(name: str) -> torch.device:
    """config.device as a torch.device; "cuda" is the current GPU (a torchrun rank's own)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_out_dir(out_dir: str | Path, resume: bool, overwrite: bool) -> None:
    """Refuse (ValueError) an out_dir that is a file, or that holds a checkpoint unless
    resuming it or overwriting it; cheap, so a command checks it before loading data and
    model."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: choose one")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():  # a file is never replaced
        raise ValueError(
            f"--out {out_dir} is a file, not a folder (a run writes a folder of "
            "checkpoints there): choose another --out"
        )
    check_latest_is_ours(out_dir)
    check_steps_are_ours(out_dir)
    existing = checkpoints_in(out_dir)
    if existing and not (resume or overwrite):
        raise ValueError(
            f"{out_dir} already holds a checkpoint ({existing[-1].name}): pass --resume to "
            "continue it, --overwrite to replace it, or choose another --out"
        )


def _checkpoints_to_manage(out_dir: Path, resume: bool, overwrite: bool) -> tuple[list, list]:
    """(this run's own checkpoints, old ones to remove after its first write). Refuses an
    out_dir that holds a checkpoint, unless resuming it or overwriting it."""
    check_out_dir(out_dir, resume, overwrite)
    clean_leftovers(out_dir)
    existing = checkpoints_in(out_dir)
    return (existing, []) if resume else ([], existing)


def _divergence_message(out_dir: Path, step: int, loss: Tensor, config, skipped: int) -> str:
    good = latest_checkpoint(out_dir)
    where = f"the last good checkpoint is {good}" if good else "no checkpoint was written"
    what = f"{skipped} steps in a row" if skipped > 1 else f"at step {step + 1}"
    return (
        f"training diverged: non-finite loss ({loss.item():g}) or gradient {what}; {where}. "
        f"Resume it with a lower --lr (now {config.lr:g}), or pass --skip-nonfinite to "
        "skip such steps"
    )


def call_loss(loss_fn, batch: tuple | dict) -> Tensor:
    """loss_fn(*batch), or loss_fn(**batch) for a dict batch (named inputs)."""
    return loss_fn(**batch) if isinstance(batch, dict) else loss_fn(*batch)


class _Progress:
    """A run's progress on stderr: on a terminal one line redrawn in place at every step;
    elsewhere (a pipe, a log file) whole lines, never a carriage return: the first step,
    the last, and between them one at most every LOG_EVERY_SECONDS. With a matmul rate
    and the flops per token, each line gives the model flops utilisation so far."""

    def __init__(
        self,
        first_step: int,
        total: int,
        end: int,
        rate: MatmulRate | None = None,
        flops_per_token: float | None = None,
    ) -> None:
        self.first_step, self.total, self.end = first_step, total, end
        self.rate, self.flops_per_token = rate, flops_per_token
        self.stream = sys.stderr  # now, not at import: a caller may have replaced it
        self.terminal = self.stream.isatty()
        self.logged_at: float | None = None  # elapsed seconds at the last logged line
        self.drawn = False  # a terminal's line is drawn and not yet ended

    def step(self, step: int, loss: float, tokens_per_s: float, elapsed: float) -> None:
        """Report step; the time left is at this run's mean time per step (a resumed
        run's elapsed time covers only the steps after first_step)."""
        eta = elapsed / max(step - self.first_step, 1) * (self.total - step)
        mfu = ""
        if self.rate is not None:
            mfu = f"MFU {self.rate.mfu(tokens_per_s, self.flops_per_token):.1%}  "
        line = (
            f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s / 1e3:.1f}k tok/s  "
            f"{mfu}eta {eta:4.0f}s"
        )
        if self.terminal:
            filled = int(24 * step / self.total)
            self.stream.write(f"\r[{'#' * filled}{'-' * (24 - filled)}] {line} ")
            self.drawn = True
        elif (
            self.logged_at is None
            or step == self.end
            or elapsed - self.logged_at >= LOG_EVERY_SECONDS
        ):
            self.logged_at = elapsed
            self.stream.write(line + "\n")
        self.stream.flush()

    def end_line(self) -> None:
        """End the redrawn line (a terminal's), if one is drawn, before another line is
        written or the run ends."""
        if self.drawn:
            self.drawn = False
            self.stream.write("\n")
            self.stream.flush()
