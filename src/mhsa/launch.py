"""Starting torch.distributed process groups: N local processes (gloo on CPU, NCCL
on GPUs), or joining the group that torchrun describes in the environment."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def join_torchrun_group() -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...).
    False when not launched by torchrun with more than one process."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return dist.is_initialized()
    dist.init_process_group(default_backend())
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return True


def spawn(fn: Callable, nproc: int, *args, quiet_workers: bool = True) -> None:
    """Run fn(*args) in nproc new local processes joined in one process group (gloo on
    CPU). Workers other than rank 0 print nothing when quiet_workers. Raises if a
    worker fails."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    mp.spawn(_worker, args=(fn, nproc, free_port(), args, quiet_workers), nprocs=nproc)


def _worker(rank: int, fn: Callable, nproc: int, port: int, args: tuple, quiet: bool) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc
    )
    # share the cores instead of each process taking all of them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        with _silenced(quiet and rank > 0):
            fn(*args)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _silenced(active: bool):
    if not active:
        yield
        return
    with open(os.devnull, "w") as devnull:
        old = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = devnull
        try:
            yield
        finally:
            sys.stdout, sys.stderr = old
