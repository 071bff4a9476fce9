"""Data-parallel training in real processes (gloo, CPU): two ranks with half a batch
each train exactly like one process with the whole batch, and a run resumes with a
different number of processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mhsa.apps.train import TrainConfig, load_checkpoint, train
from mhsa.cli import main
from mhsa.data.text import ByteTokenizer, TextTask
from mhsa.launch import run_local
from mhsa.models import GPT, GPTConfig

pytestmark = pytest.mark.slow  # real models, servers, browsers or several processes

TEXT = "def f(x):\n    return x * 2  # doubles\n" * 200


def run(
    out_dir: str,
    steps: int = 4,
    stop_after: int | None = None,
    resume: bool = False,
    context_parallel: str | None = None,
    position: str = "learned",
):
    """A tiny GPT trained for `steps` steps, loss recorded at every step (rank 0)."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=256, n_layer=2, n_head=2, d_model=32, max_len=32, dropout=0.0, position=position
    )
    task = TextTask(ByteTokenizer().encode(TEXT), 32, batch_size=4, eval_batches=1)
    train_config = TrainConfig(steps=steps, eval_every=1, checkpoint_every=1, warmup=2)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    train(
        GPT(config),
        task,
        train_config,
        out_dir,
        model_info=info,
        resume=resume,
        stop_after=stop_after,
        log=lambda *_: None,
        context_parallel=context_parallel,
    )


def as_rank(rank: int, world_size: int, *args) -> None:
    run(*args)


def losses(out_dir) -> list[tuple[float, float]]:
    history = load_checkpoint(out_dir)["trainer"]["history"]
    return [(record["train_loss"], record["val_loss"]) for record in history]


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (train_a, val_a), (train_b, val_b) in zip(a, b, strict=True):
        assert abs(train_a - train_b) <= 1e-5 and abs(val_a - val_b) <= 1e-5


def test_two_ranks_train_like_one_process_with_the_same_global_batch(tmp_path):
    run(str(tmp_path / "one"))
    run_local(as_rank, 2, str(tmp_path / "two"))
    assert_same(losses(tmp_path / "two"), losses(tmp_path / "one"))
    assert len(losses(tmp_path / "one")) == 4


def _matmul_rate(rank: int, world_size: int, out_dir: str) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, max_len=16)
    task = TextTask(ByteTokenizer().encode(TEXT), 16, batch_size=4, eval_batches=1)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    result = train(
        GPT(config),
        task,
        TrainConfig(steps=2, eval_every=2, checkpoint_every=2),
        out_dir,
        model_info=info,
        log=lambda *_: None,
        flops_per_token=1e6,
    )
    rate = result["matmul"]
    (Path(out_dir) / f"rate-{rank}.txt").write_text(f"{rate.processes} {rate.describe()}")


def test_mfu_under_data_parallel_counts_every_process_rate(tmp_path):
    """Rank 0 counts the group's tokens/s: its MFU was against one process's rate (over
    100% seen with 2 ranks)."""
    run_local(_matmul_rate, 2, str(tmp_path))
    processes, words = (tmp_path / "rate-0.txt").read_text().split(" ", 1)
    assert processes == "2" and words.endswith(", times 2 processes")


def test_resume_with_a_different_number_of_processes(tmp_path):
    run(str(tmp_path / "straight"))
    run_local(as_rank, 2, str(tmp_path / "split"), 4, 2)  # two ranks, "killed" after step 2
    assert load_checkpoint(tmp_path / "split")["trainer"]["step"] == 2
    run(str(tmp_path / "split"), resume=True)  # finished by one process
    assert_same(losses(tmp_path / "split"), losses(tmp_path / "straight"))


@pytest.mark.parametrize("position", ["rotary", "learned"])
def test_context_parallel_ranks_train_like_one_process(tmp_path, position):
    """Each of 2 ranks holds half of every sequence (zigzag); attention is ring attention."""
    run(str(tmp_path / "one"), position=position)
    run_local(as_rank, 2, str(tmp_path / "cp"), 4, None, False, "zigzag", position)
    assert_same(losses(tmp_path / "cp"), losses(tmp_path / "one"))


def test_cli_data_parallel_checks_the_batch_split(tmp_path, capsys):
    args = [
        "train",
        "gpt",
        "--out",
        str(tmp_path / "g"),
        "--steps",
        "1",
        "--nproc",
        "2",
        "--batch-size",
        "3",
    ]
    assert main(args) == 2
    assert "divisible by --nproc" in capsys.readouterr().err
    ring = ["--batch-size", "2", "--seq-len", "16", "--context-parallel", "--dropout", "0.3"]
    assert main([*args[:-2], *ring]) == 2  # said before any process starts
    assert capsys.readouterr().err.strip().endswith("pass --dropout 0 (got 0.3)")


def test_a_bad_argument_found_inside_the_processes_is_one_line(tmp_path, capsys):
    """A missing --data is found by each rank: once a 40-line traceback of run_local's
    RuntimeError, exit 1; now the line the command says without --nproc, exit 2."""
    missing = str(tmp_path / "no-such-file.txt")
    args = ["train", "gpt", "--data", missing, "--out", str(tmp_path / "g"), "--steps", "1"]
    assert main([*args, "--nproc", "2", "--batch-size", "2", "--seq-len", "16"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mhsa train: --data {missing}: no such file"
    )


def test_each_rank_gets_an_equal_share_of_the_rows():
    from mhsa.apps.train.parallel import local_rows

    batch = (torch.arange(12).view(6, 2), torch.arange(6), "not a tensor")
    shares = [local_rows(batch, rank, 3) for rank in range(3)]
    assert all(len(share[1]) == 2 and share[2] == "not a tensor" for share in shares)
    assert torch.equal(torch.cat([share[0] for share in shares]), batch[0])
