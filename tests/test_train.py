"""The training loop: checkpoints are complete and atomic; resume continues exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mhsa.checkpoint import checkpoints_in, save_checkpoint
from mhsa.data.text import ByteTokenizer, TextTask
from mhsa.models import GPT, GPTConfig
from mhsa.train import (
    TrainConfig,
    TrainingDiverged,
    load_checkpoint,
    lr_at,
    resolve_checkpoint,
    train,
)

TEXT = "def f(x):\n    return x * 2  # doubles\n" * 200


def run(out_dir, *, steps=8, resume=False, stop_after=None, overwrite=False, kind="gpt",
        nan_from=None, log=lambda *_: None, **options):  # fmt: skip
    """Train a tiny GPT; nan_from=N makes the loss nan from the N-th training step on."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_len=32, dropout=0.1)
    task = TextTask(ByteTokenizer().encode(TEXT), 32, batch_size=4, eval_batches=2)
    model = GPT(config)
    if nan_from is not None:
        calls, loss = [0], model.loss

        def poisoned(*batch):
            calls[0] += model.training
            return loss(*batch) * (float("nan") if calls[0] >= nan_from else 1.0)

        model.loss = poisoned
    train_config = TrainConfig(steps=steps, eval_every=4, checkpoint_every=4, warmup=2, **options)
    info = {"model": kind, "config": config.to_dict(), "tokenizer": "bytes"}
    result = train(model, task, train_config, out_dir, model_info=info, resume=resume,
                   overwrite=overwrite, stop_after=stop_after, log=log)  # fmt: skip
    return model, result


def step_names(out_dir) -> list[str]:
    return [path.name for path in checkpoints_in(out_dir)]


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


def test_training_lowers_the_validation_loss(tmp_path):
    """24 steps on the repetitive text take the validation loss below half of an
    untrained model's, ln(256) = 5.55 for uniform bytes (measured 2.22 at step 24,
    5.51 at step 1); a step that never updates the weights stays near 5.5."""
    _, result = run(tmp_path / "run", steps=24, lr=1e-2)
    last = result["history"][-1]["val_loss"]
    assert last < 0.5 * math.log(256), result["history"]


def test_lr_warm_up_and_cosine_end_points():
    config = TrainConfig(steps=110, lr=1e-3, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(1e-4)  # (step + 1) / warmup
    assert lr_at(9, config) == pytest.approx(1e-3)
    assert lr_at(10, config) == pytest.approx(1e-3)  # the cosine starts at the peak
    assert lr_at(60, config) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way
    assert lr_at(110, config) == pytest.approx(1e-4)  # ends at lr * min_lr_ratio
    assert lr_at(500, config) == pytest.approx(1e-4)


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
    import mhsa.checkpoint as checkpoint_module

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        run(tmp_path / "run", steps=8, resume=True)
    assert resolve_checkpoint(tmp_path / "run").name == "step-000004"
    assert not list((tmp_path / "run").glob(".tmp-*"))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        load_checkpoint(tmp_path)


def test_a_folder_with_a_checkpoint_is_refused_without_resume_or_overwrite(tmp_path):
    run(tmp_path / "run", steps=8)
    before = load_checkpoint(tmp_path / "run")["weights"]
    with pytest.raises(ValueError, match="already holds a checkpoint.*--resume.*--overwrite"):
        run(tmp_path / "run", steps=4)
    assert step_names(tmp_path / "run") == ["step-000008"]
    after = load_checkpoint(tmp_path / "run")["weights"]
    assert all(torch.equal(before[name], after[name]) for name in before)
    with pytest.raises(ValueError, match="exclude each other"):
        run(tmp_path / "run", resume=True, overwrite=True)


def test_overwrite_replaces_the_old_checkpoints_after_its_own_first(tmp_path):
    run(tmp_path / "run", steps=8)
    run(tmp_path / "run", steps=4, overwrite=True)
    assert step_names(tmp_path / "run") == ["step-000004"]
    assert resolve_checkpoint(tmp_path / "run").name == "step-000004"


def test_keep_keeps_the_runs_latest_checkpoints(tmp_path):
    run(tmp_path / "run", steps=12, keep=2)
    assert step_names(tmp_path / "run") == ["step-000008", "step-000012"]
    with pytest.raises(ValueError, match=r"keep must be an int >= 1 \(--keep\)"):
        TrainConfig(keep=0)


@pytest.mark.parametrize("field", ["steps", "eval_every", "checkpoint_every"])
def test_train_config_rejects_non_positive_counts(field):
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1"):
        TrainConfig(**{field: 0})
    with pytest.raises(ValueError, match="nonfinite must be"):
        TrainConfig(nonfinite="ignore")


def test_resume_checks_the_model_kind_and_the_trainer_state(tmp_path):
    run(tmp_path / "run", steps=4)
    with pytest.raises(ValueError, match="holds a 'gpt' model, not 'points'"):
        run(tmp_path / "run", steps=8, resume=True, kind="points")
    (resolve_checkpoint(tmp_path / "run") / "trainer.pt").unlink()
    with pytest.raises(ValueError, match="no trainer.pt.*cannot be resumed"):
        run(tmp_path / "run", steps=8, resume=True)


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged, match="step 7.*last good checkpoint is .*step-000004"):
        run(tmp_path / "run", steps=12, nan_from=7)
    assert step_names(tmp_path / "run") == ["step-000004"]
    weights = load_checkpoint(tmp_path / "run")["weights"]
    assert all(w.isfinite().all() for w in weights.values())


def test_skip_nonfinite_skips_steps_and_writes_finite_weights(tmp_path):
    lines = []
    model, result = run(tmp_path / "run", steps=8, nan_from=7, nonfinite="skip", log=lines.append)
    assert result["step"] == 8 and sum("step skipped" in line for line in lines) == 2
    assert all(p.isfinite().all() for p in model.parameters())
    with pytest.raises(TrainingDiverged, match="10 steps in a row"):
        run(tmp_path / "again", steps=20, nan_from=1, nonfinite="skip")
    assert step_names(tmp_path / "again") == ["step-000008"]  # the untouched initial weights


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="weight holds nan or inf"):
        save_checkpoint(tmp_path, 1, model, {"model": "x"}, {})
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_a_killed_run_are_cleaned_and_its_checkpoint_resumes(tmp_path):
    run(tmp_path / "run", steps=4)
    out = tmp_path / "run"
    (out / ".tmp-killed").mkdir()
    (out / ".tmp-killed" / "model.safetensors").write_bytes(b"half")
    (out / ".latest-99999").symlink_to("step-000004")
    (out / "latest").unlink()  # killed between the folder's rename and the link's
    assert resolve_checkpoint(out).name == "step-000004"
    _, result = run(out, steps=8, resume=True)
    assert result["step"] == 8
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step-000008"]


def test_every_step_uses_lr_at_and_a_nan_gradient_stops_the_run(tmp_path, monkeypatch):
    """The optimizer sees lr_at(step) at every step (warm-up, then cosine); a finite
    loss whose gradient is nan stops the run like a nan loss."""
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    run(tmp_path / "lr", steps=8)
    config = TrainConfig(steps=8, eval_every=4, checkpoint_every=4, warmup=2)
    assert seen == pytest.approx([lr_at(s, config) for s in range(8)])

    def nan_gradient(module, grad_input, grad_output):
        return tuple(None if g is None else g * float("nan") for g in grad_input)

    original = GPT.__init__

    def poisoned_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.ln_f.register_full_backward_hook(nan_gradient)

    monkeypatch.setattr(GPT, "__init__", poisoned_init)
    with pytest.raises(TrainingDiverged):
        run(tmp_path / "nan-grad", steps=1)  # the first step must not be taken
