"""Starting torch.distributed process groups: N local CPU processes (gloo), or the
group that torchrun describes in the environment (NCCL on GPUs)."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (a socket bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_torchrun_group(quiet: bool = True) -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...);
    with quiet, ranks other than 0 print nothing from then on. False when not launched
    by torchrun with more than one process."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return dist.is_initialized()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if quiet and dist.get_rank() > 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the process
    return True


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 120.0,
    threads: int | None = 1,
    quiet: bool = False,
) -> list[Any]:
    """Run fn(rank, world_size, *args) in world_size spawned CPU processes that form a
    gloo process group (the default group); return each rank's result, in rank order.

    fn must be importable (a module-level function) and its result picklable (tensors
    come back by value). A child that raises fails the call with a RuntimeError
    (RankFailed) that quotes the exception of the rank that failed first (the others
    usually fail only because it left the group); one still running after `timeout`
    seconds is killed and TimeoutError raised (None: no limit, e.g. for training).
    threads sets torch's thread count in each child (None keeps the default). quiet
    silences the output of every rank but 0.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    context = mp.spawn(
        _local_worker,
        args=(world_size, port, fn, args, results, threads, timeout, quiet),
        nprocs=world_size,
        join=False,
    )
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    collected: dict[int, Any] = {}
    failures: list[tuple] = []  # (time, rank, traceback, exception type, message)
    finished = False

    def drain() -> None:
        while not results.empty():
            rank, ok, payload = results.get()
            if ok:
                collected[rank] = pickle.loads(payload)
            else:
                failures.append((payload[0], rank, *payload[1:]))

    try:
        while not finished:
            try:
                finished = context.join(timeout=0.05)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
                time.sleep(0.2)  # let the other ranks' reports arrive
                drain()
                raise _failure(failures, error) from None
            drain()
            if not finished and time.monotonic() > deadline:
                raise TimeoutError(
                    f"run_local: {world_size} processes still running after {timeout} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [collected.get(rank) for rank in range(world_size)]


class RankFailed(RuntimeError):
    """A process of run_local failed. Its message quotes the first failing rank's
    traceback; `kind` and `message` are that rank's exception type name and text (None
    when no rank reported one), so a caller can say a bad argument in one line."""

    def __init__(self, report: str, kind: str | None = None, message: str | None = None):
        super().__init__(report)
        self.kind, self.message = kind, message


def _failure(failures: list[tuple], error: Exception) -> RankFailed:
    """The first failing rank's traceback, then one line for each other failure."""
    if not failures:
        return RankFailed(f"run_local: a process failed: {error}")
    failures.sort()
    _, rank, text, kind, message = failures[0]
    others = "".join(f"\n  then rank {f[1]}: {f[2].strip().splitlines()[-1]}" for f in failures[1:])
    report = f"run_local: rank {rank} failed first:\n{text.rstrip()}{others}"
    return RankFailed(report, kind, message)


def _local_worker(rank, world_size, port, fn, args, results, threads, timeout, quiet) -> None:
    if threads:
        torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=None if timeout is None else timedelta(seconds=timeout),
    )
    try:
        with _silenced(quiet and rank > 0):
            value = fn(rank, world_size, *args)
        # plain pickle sends tensors by value; the queue's own pickler would share their
        # memory with this process, which is gone by the time the parent reads them
        results.put((rank, True, pickle.dumps(value)))
        # every rank done before any tears the group down: a peer still using it
        # when another destroys it can abort (seen once: SIGABRT in test_ddp's resume)
        dist.barrier()
    except BaseException as error:
        report = (time.time(), traceback.format_exc(), type(error).__name__, str(error))
        results.put((rank, False, report))
        raise
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
