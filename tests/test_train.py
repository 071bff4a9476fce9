"""The training loop: checkpoints are complete and atomic; resume continues exactly."""

from __future__ import annotations

import json

import pytest
import torch

from mhsa.data.text import ByteTokenizer, TextTask
from mhsa.models import GPT, GPTConfig
from mhsa.train import TrainConfig, load_checkpoint, resolve_checkpoint, train

TEXT = "def f(x):\n    return x * 2  # doubles\n" * 200


def run(out_dir, *, steps=8, resume=False, stop_after=None):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_len=32, dropout=0.1)
    task = TextTask(ByteTokenizer().encode(TEXT), 32, batch_size=4, eval_batches=2)
    model = GPT(config)
    train_config = TrainConfig(steps=steps, eval_every=4, checkpoint_every=4, warmup=2)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    result = train(model, task, train_config, out_dir, model_info=info, resume=resume,
                   stop_after=stop_after, log=lambda *_: None)  # fmt: skip
    return model, result


def test_resume_reaches_the_same_loss_as_an_uninterrupted_run(tmp_path):
    straight, result = run(tmp_path / "straight")
    _, first = run(tmp_path / "split", stop_after=3)  # "killed" after step 3
    assert first["step"] == 3
    resumed, second = run(tmp_path / "split", resume=True)
    assert second["step"] == 8
    assert second["history"][-1]["val_loss"] == result["history"][-1]["val_loss"]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a, b), name


def test_checkpoint_layout_and_reload(tmp_path):
    model, _ = run(tmp_path / "run", steps=4)
    path = resolve_checkpoint(tmp_path / "run")
    assert path.name == "step-000004" and (tmp_path / "run" / "latest").is_symlink()
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors",
                                                      "trainer.pt"]  # fmt: skip
    state = load_checkpoint(tmp_path / "run")
    info = json.loads((path / "config.json").read_text())
    assert info["step"] == 4 and info["model"] == "gpt"
    reloaded = GPT(GPTConfig(**state["info"]["config"]))
    reloaded.load_state_dict(state["weights"])
    idx = torch.randint(0, 256, (1, 10))
    model.eval(), reloaded.eval()
    assert torch.equal(model(idx), reloaded(idx))
    assert not list((tmp_path / "run").glob(".tmp-*"))  # no half-written folders left


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run(tmp_path / "run", steps=4)
    import mhsa.train as train_module

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(train_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        run(tmp_path / "run", steps=8, resume=True)
    assert resolve_checkpoint(tmp_path / "run").name == "step-000004"
    assert not list((tmp_path / "run").glob(".tmp-*"))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        load_checkpoint(tmp_path)
