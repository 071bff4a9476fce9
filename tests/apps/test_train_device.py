"""The training loop's device, autocast and throughput (issue 45), on the CPU: MFU as
nanoGPT counts it (6 N + attention per token) against a matmul measured at start, in
the progress lines and the summary; bfloat16 autocast keeps float32 weights; the
trainer state is written on the CPU, so a run resumes on any device."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
import torch

from mhsa.apps.train import TrainConfig, load_checkpoint, train
from mhsa.apps.train.throughput import (
    MatmulRate,
    autocast,
    flops_per_token,
    matmul_params,
    measure_matmul,
    to_device,
)
from mhsa.cli import main
from mhsa.data.text import ByteTokenizer, TextTask
from mhsa.models import GPT, GPTConfig

TEXT = "def f(x):\n    return x * 2  # doubles\n" * 200


def tiny_gpt(position: str = "learned") -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=256, n_layer=2, n_head=2, d_model=32, max_len=32, position=position
    )
    return GPT(config)


def test_flops_per_token_is_nanogpts_count():
    """N leaves out the position table (a lookup) but keeps the token embedding, which
    is also the output head (tied); attention adds 12 x layers x width x context."""
    model = tiny_gpt("learned")
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(model) == total - 32 * 32  # the (max_len, d_model) table
    assert flops_per_token(model, 32) == 6 * (total - 32 * 32) + 12 * 2 * 32 * 32
    rotary = tiny_gpt("rotary")
    assert matmul_params(rotary) == sum(p.numel() for p in rotary.parameters())


def test_tied_heads_of_every_model_count_as_matmuls():
    """Only GPT's tok_emb was added back: BERT's MLM head, Seq2Seq's output and a tied
    Llama head were left out of N."""
    from mhsa.models import Bert, BertConfig, Llama, LlamaConfig
    from mhsa.models.seq2seq import Seq2Seq, Seq2SeqConfig

    bert = Bert(BertConfig(vocab_size=40, d_model=16, n_layer=1, n_head=2, d_ff=32, max_len=8))
    lookups = (8 + 2) * 16  # positions and token types
    assert matmul_params(bert) == sum(p.numel() for p in bert.parameters()) - lookups
    tied = LlamaConfig(vocab_size=40, n_layer=1, n_head=2, d_model=16, d_ff=32, tie_embeddings=True)
    llama = Llama(tied)
    assert matmul_params(llama) == sum(p.numel() for p in llama.parameters())
    untied = Llama(dataclasses.replace(tied, tie_embeddings=False))  # its embedding: a lookup
    assert matmul_params(untied) == sum(p.numel() for p in untied.parameters()) - 40 * 16
    seq2seq = Seq2Seq(Seq2SeqConfig(src_vocab=30, tgt_vocab=30, d_model=16, n_head=2))
    source_table = (
        seq2seq.src_embed.weight.numel() if seq2seq.src_embed is not seq2seq.tgt_embed else 0
    )
    total = sum(p.numel() for p in seq2seq.parameters())
    assert matmul_params(seq2seq) == total - source_table


def test_mfu_is_tokens_times_flops_over_the_measured_rate():
    rate = MatmulRate(2e12, "cuda:0", "bfloat16", 8192)
    assert rate.mfu(1000.0, 6e8) == pytest.approx(0.3)
    assert rate.describe() == "the bfloat16 matmul measured at start, 2.0 TFLOP/s on cuda:0"
    group = MatmulRate(2e12, "cuda:0", "bfloat16", 8192, processes=2)  # data parallel
    assert group.mfu(1000.0, 6e8) == pytest.approx(0.15)
    assert group.describe().endswith("on cuda:0, times 2 processes")
    measured = measure_matmul("cpu", torch.float32, size=64, repeat=1)
    assert measured.device == "cpu" and measured.dtype == "float32" and measured.size == 64
    assert measured.flops_per_second > 0
    assert measure_matmul("cpu", "float32", size=64, repeat=1) is measured  # once a process


def test_to_device_moves_every_tensor_of_a_batch_and_keeps_its_shape():
    batch = ({"idx": torch.ones(2)}, [torch.zeros(1), 3], "text")
    moved = to_device(batch, "cpu")
    assert type(moved) is tuple and moved[0]["idx"] is batch[0]["idx"]
    assert moved[1][1] == 3 and moved[2] == "text" and isinstance(moved[1], list)
    with autocast("cpu", "float32"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("cpu", torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")


def run(out, config: TrainConfig, **options) -> tuple[GPT, dict]:
    model = tiny_gpt()
    task = TextTask(ByteTokenizer().encode(TEXT), 32, batch_size=4, eval_batches=2)
    info = {"model": "gpt", "config": model.config.to_dict(), "tokenizer": "bytes"}
    result = train(model, task, config, out, model_info=info, log=lambda *_: None, **options)
    return model, result


def test_a_run_with_flops_reports_mfu_in_its_lines_and_result(tmp_path, monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    model, result = run(
        tmp_path / "run",
        TrainConfig(steps=3, eval_every=3, checkpoint_every=3, warmup=1),
        flops_per_token=flops_per_token(tiny_gpt(), 32),
    )
    lines = [line for line in log.getvalue().splitlines() if line.startswith("step ")]
    assert re.fullmatch(r"step 1/3  loss \S+  \S+k tok/s  MFU \S+%  eta +\d+s", lines[0]), lines
    rate = result["matmul"]
    assert (rate.device, rate.dtype) == ("cpu", "float32")
    expected = result["tokens_per_second"] * flops_per_token(model, 32) / rate.flops_per_second
    assert result["mfu"] == pytest.approx(expected)


def test_bfloat16_autocast_trains_float32_weights_and_writes_a_cpu_trainer_state(tmp_path):
    config = TrainConfig(steps=2, eval_every=2, checkpoint_every=2, warmup=1, dtype="bfloat16")
    model, result = run(tmp_path / "run", config)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in result["history"])
    assert "mfu" not in result  # without flops_per_token: the keys as before
    trainer = load_checkpoint(tmp_path / "run")["trainer"]
    assert trainer["cuda_rng"] is None and trainer["train_config"]["dtype"] == "bfloat16"
    states = trainer["optimizer"]["state"].values()
    assert all(t.device.type == "cpu" for s in states for t in s.values() if torch.is_tensor(t))


def test_train_config_checks_device_and_dtype():
    with pytest.raises(ValueError, match=r"dtype must be 'float32' or 'bfloat16' \(--dtype\)"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match=r"device must be cpu or cuda \(--device\)"):
        TrainConfig(device="meta")


def test_the_command_prints_its_device_tokens_per_second_and_mfu(tmp_path, capsys):
    argv = ["train", "gpt", "--out", str(tmp_path / "run"), "--steps", "2", "--eval-every", "2"]
    argv += ["--batch-size", "2", "--layers", "1", "--heads", "2", "--d-model", "16"]
    assert main([*argv, "--seq-len", "16", "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "device: cpu, float32" in out
    summary = out[-1]
    assert re.match(
        r"2 steps in \d+ s \(\S+k tokens/s, MFU \S+% of the float32 matmul measured at "
        r"start, \S+ [GT]FLOP/s on cpu\); checkpoint: ",
        summary,
    ), summary


def test_nproc_with_cuda_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    argv = ["train", "gpt", "--out", str(tmp_path / "run"), "--nproc", "2"]
    assert main(argv) == 2  # cuda by default where torch sees a GPU
    err = capsys.readouterr().err.strip()
    assert err.startswith("mhsa train: --nproc 2 runs CPU processes (gloo)") and "torchrun" in err


def test_the_step_clock_leaves_out_the_first_step_and_what_falls_between_steps():
    """A first step of 10 s (a compile) and two of 1 s with an evaluation of 5 s between
    them: 100 tokens each, so 100 tokens/s once the second step is done (the first
    step's own 10 before)."""
    from mhsa.apps.train.throughput import StepClock

    clock, now = StepClock(), 0.0
    for seconds, pause in ((10.0, 0.0), (1.0, 5.0), (1.0, 0.0)):
        clock.start(now)
        now += seconds
        clock.stop(100, now)
        if clock.seconds == 10.0:
            assert clock.tokens_per_second() == 10.0
        now += pause  # an evaluation or a checkpoint
    assert clock.tokens_per_second() == 100.0
