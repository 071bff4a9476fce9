"""Training on packed rows: the tasks' batches (documents whole, targets never crossing a
boundary, the token budget kept), GPT and BERT through `mhsa train ... --pack`, Llama
through the training loop with the same packed task, and --pack refused where it
cannot run (several processes)."""

from __future__ import annotations

import torch

from helpers import max_error
from mhsa.apps.train import TrainConfig, evaluate, train
from mhsa.cli import main
from mhsa.data.packing import IGNORE
from mhsa.data.text import ByteTokenizer, MaskedLMTask, PackedTextTask, documents
from mhsa.models import GPT, GPTConfig, Llama, LlamaConfig

TEXT = "def f(x):\n    return x * 2\n\n\nclass A:\n    pass\n\n" * 60 + "x = 1\n" * 40


def stream() -> torch.Tensor:
    return ByteTokenizer().encode(TEXT)


def test_documents_split_at_blank_lines_and_at_max_len():
    tokens = torch.tensor([1, 10, 10, 2, 3, 4, 5, 10, 10, 10, 6])
    pieces = [p.tolist() for p in documents(tokens, 3)]
    assert pieces == [[1, 10, 10], [2, 3, 4], [5, 10, 10], [10, 6]]
    assert torch.equal(torch.cat(documents(tokens, 3)), tokens)
    assert documents(torch.tensor([7]), 4)[0].tolist() == [7]


def test_a_packed_text_batch_keeps_documents_whole_and_targets_inside():
    task = PackedTextTask.from_stream(stream(), 32, 4)
    docs = {tuple(d.tolist()) for d in task.train}
    for _ in range(5):
        batch = task.train_batch(torch.Generator().manual_seed(_))
        idx, targets, cu = batch["idx"][0], batch["targets"][0], batch["cu_seqlens"]
        assert idx.numel() == int(cu[-1]) <= 4 * 32 == task.max_tokens
        assert task.tokens_per_batch() == idx.numel()
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            assert tuple(idx[a:b].tolist()) in docs  # a whole document
            assert targets[b - 1] == IGNORE  # its last token predicts nothing
            assert torch.equal(targets[a : b - 1], idx[a + 1 : b])  # the rest: its own next


def test_the_packed_gpt_loss_is_the_mean_over_documents_alone():
    task = PackedTextTask.from_stream(stream(), 32, 4)
    batch = task.train_batch(torch.Generator().manual_seed(3))
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=32, max_len=32)).double()
    cu = batch["cu_seqlens"].tolist()
    total, count = 0.0, 0
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b - a > 1:
            idx = batch["idx"][:, a:b]
            total = total + model.loss(idx[:, :-1], idx[:, 1:]) * (b - a - 1)
            count += b - a - 1
    assert max_error(model.loss(**batch), total / count) < 1e-12


def test_masked_lm_packed_batches():
    task = MaskedLMTask(stream(), 32, 4, eval_batches=1, pack=True)
    batch = task.train_batch(torch.Generator().manual_seed(0))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "cu_seqlens"}
    lengths = batch["cu_seqlens"].diff()
    assert int(lengths.sum()) == batch["input_ids"].shape[1] <= 4 * 32
    assert ((lengths >= 8) & (lengths <= 32)).all()
    assert (batch["input_ids"] != MaskedLMTask.PAD).all()  # nothing padded
    assert task.tokens_per_batch() == int(lengths.sum())
    padded = MaskedLMTask(stream(), 32, 4, eval_batches=1)  # unchanged without pack
    assert len(padded.train_batch(torch.Generator().manual_seed(0))) == 3


def test_llama_trains_on_packed_rows(tmp_path):
    """Llama has no CLI training path: its loss takes the packed task's batches in the
    one training loop, and the validation loss goes down."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, n_layer=1, n_head=2, n_kv_head=1, d_model=32, d_ff=64)
    model = Llama(config)
    task = PackedTextTask.from_stream(stream(), 32, 4)
    before = evaluate(model, task)
    result = train(
        model,
        task,
        TrainConfig(steps=12, eval_every=12, checkpoint_every=12, warmup=2, lr=1e-2),
        tmp_path / "run",
        model_info={"model": "llama", "config": config.to_dict()},
        log=lambda *_: None,
    )
    assert result["history"][-1]["val_loss"] < before


def test_train_gpt_and_bert_with_pack(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    common = ["--data", str(data), "--steps", "2", "--eval-every", "2", "--layers", "1"]
    small = ["--d-model", "32", "--seq-len", "32", "--batch-size", "2", "--pack"]
    assert main(["train", "gpt", "--out", str(tmp_path / "gpt"), *common, *small]) == 0
    assert "in rows of 64 tokens" in capsys.readouterr().out
    assert main(["train", "bert", "--out", str(tmp_path / "bert"), *common, *small]) == 0
    assert "packed" in capsys.readouterr().out
    args = ["train", "gpt", "--out", str(tmp_path / "two"), *common, *small, "--nproc", "2"]
    assert main(args) == 2
    assert "--pack trains in one process" in capsys.readouterr().err
