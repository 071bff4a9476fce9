"""The training loop: checkpoints are complete and atomic; resume continues exactly."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import mhsa.apps.train as train_module
from mhsa.apps.train import (
    TrainConfig,
    TrainingDiverged,
    load_checkpoint,
    lr_at,
    resolve_checkpoint,
    train,
)
from mhsa.checkpoint import checkpoints_in, save_checkpoint
from mhsa.data.text import ByteTokenizer, TextTask
from mhsa.models import GPT, GPTConfig

TEXT = "def f(x):\n    return x * 2  # doubles\n" * 200


def run(
    out_dir,
    *,
    steps=8,
    resume=False,
    stop_after=None,
    overwrite=False,
    kind="gpt",
    nan_from=None,
    log=lambda *_: None,
    model_options=None,
    **options,
):
    """Train a tiny GPT (GPTConfig changed by model_options); nan_from=N makes the loss
    nan from the N-th training step on."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=256,
        n_layer=2,
        n_head=2,
        d_model=32,
        max_len=32,
        dropout=0.1,
        **(model_options or {}),
    )
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
    result = train(
        model,
        task,
        train_config,
        out_dir,
        model_info=info,
        resume=resume,
        overwrite=overwrite,
        stop_after=stop_after,
        log=log,
    )
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
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_training_lowers_the_validation_loss(tmp_path):
    """24 steps on the repetitive text take the validation loss below half of an
    untrained model's, ln(256) = 5.55 for uniform bytes (measured 2.22 at step 24,
    5.51 at step 1); a step that never updates the weights stays near 5.5."""
    _, result = run(tmp_path / "run", steps=24, lr=1e-2)
    last = result["history"][-1]["val_loss"]
    assert last < 0.5 * math.log(256), result["history"]


@pytest.mark.parametrize(
    "model_options",
    [
        {"attention": "diff"},
        {"attention": "moba", "moba_block": 8, "moba_top_k": 2},
        {"attention": "latent"},
    ],
    ids=["diff", "moba", "latent"],
)
def test_the_attention_variants_train(tmp_path, model_options):
    """`mhsa train gpt --attention diff|moba|latent` in small: the same 24 steps take the
    validation loss below half of ln(256) too, and the checkpoint names the variant."""
    _, result = run(tmp_path / "run", steps=24, lr=1e-2, model_options=model_options)
    assert result["history"][-1]["val_loss"] < 0.5 * math.log(256), result["history"]
    saved = load_checkpoint(tmp_path / "run")["info"]["config"]
    assert saved["attention"] == model_options["attention"]


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
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "trainer.pt",
    ]
    state = load_checkpoint(tmp_path / "run")
    info = json.loads((path / "config.json").read_text())
    assert info["step"] == 4 and info["model"] == "gpt"
    reloaded = GPT(GPTConfig(**state["info"]["config"]))
    reloaded.load_state_dict(state["weights"])
    idx = torch.randint(0, 256, (1, 10))
    model.eval(), reloaded.eval()
    assert torch.equal(model(idx), reloaded(idx))
    assert not list((tmp_path / "run").glob(".mhsa-partial-*"))  # no half-written folders


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run(tmp_path / "run", steps=4)
    import mhsa.checkpoint as checkpoint_module

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        run(tmp_path / "run", steps=8, resume=True)
    assert resolve_checkpoint(tmp_path / "run").name == "step-000004"
    assert not list((tmp_path / "run").glob(".mhsa-partial-*"))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        load_checkpoint(tmp_path)


def test_a_folder_with_a_checkpoint_is_refused_without_resume_or_overwrite(tmp_path):
    run(tmp_path / "run", steps=8)
    before = load_checkpoint(tmp_path / "run")["weights"]
    refusal = (
        r"already holds a checkpoint \(step-000008\): pass --resume to continue it, "
        "--overwrite to replace it, or choose another --out$"
    )
    with pytest.raises(ValueError, match=refusal):
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
    with pytest.raises(
        ValueError,
        match="holds a 'gpt' model, not 'points': --resume continues "
        "a run of the same model; choose another --out for a new one$",
    ):
        run(tmp_path / "run", steps=8, resume=True, kind="points")
    (resolve_checkpoint(tmp_path / "run") / "trainer.pt").unlink()
    with pytest.raises(ValueError, match="no trainer.pt.*cannot be resumed"):
        run(tmp_path / "run", steps=8, resume=True)


def test_resume_refuses_another_model_config_or_seed_and_says_a_new_schedule(tmp_path):
    """Non-GPT tasks rebuilt the model from the flags: a resume without --heads ran the
    checkpoint's weights as a 4-head model, silently; another --seed drew another split."""
    run(tmp_path / "run", steps=4)
    with pytest.raises(ValueError, match=r"another model .* 'rotary' \(checkpoint: 'learned'\)"):
        run(tmp_path / "run", steps=8, resume=True, model_options={"position": "rotary"})
    with pytest.raises(ValueError, match="seed 1, but the checkpoint's run used seed 0"):
        run(tmp_path / "run", steps=8, resume=True, seed=1)
    lines = []
    run(tmp_path / "run", steps=8, resume=True, log=lines.append)
    assert "resuming with steps 8 (the checkpoint's run: 4)" in lines


def test_validation_loss_is_the_mean_per_target_not_per_batch():
    """Batches of 256 and 103 test images counted alike (1.84 for 1.75); an MLM batch
    with no selected token counted as a loss of 0."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def loss(self, losses, targets):  # each batch: the mean of its targets' losses
            kept = targets != -100
            return losses[kept].mean() if kept.any() else losses.sum() * 0

    batches = [
        (torch.full((4,), 1.0), torch.tensor([1, 2, 3, 4])),
        (torch.full((4,), 3.0), torch.tensor([1, -100, -100, -100])),
        (torch.full((4,), 9.0), torch.full((4,), -100)),  # no target: weighs nothing
    ]
    task = SimpleNamespace(eval_batches=lambda: batches)
    assert train_module.evaluate(Model(), task) == pytest.approx((4 * 1.0 + 3.0) / 5)


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
    (out / ".mhsa-partial-killed").mkdir()
    (out / ".mhsa-partial-killed" / "model.safetensors").write_bytes(b"half")
    (out / ".mhsa-latest-99999").symlink_to("step-000004")
    (out / "latest").unlink()  # killed between the folder's rename and the link's
    users = [out / ".tmp-downloads", out / ".latest-readme"]  # a user's, not ours
    users[0].mkdir()
    (users[0] / "dataset.bin").write_bytes(b"data")
    users[1].symlink_to("step-000004")
    assert resolve_checkpoint(out).name == "step-000004"
    _, result = run(out, steps=8, resume=True)
    assert result["step"] == 8
    names = sorted(p.name for p in out.iterdir())
    assert names == [".latest-readme", ".tmp-downloads", "latest", "step-000008"]
    assert (users[0] / "dataset.bin").read_bytes() == b"data"


def test_a_step_moved_aside_comes_back_and_older_leftovers_go(tmp_path):
    """Killed between moving a step aside (to write it again) and renaming its new copy:
    cleaning once deleted the only copy. An older mhsa's .tmp-* partial folders (only
    checkpoint files) are cleaned; a .tmp-* folder holding anything else is a user's."""
    from mhsa.checkpoint import clean_leftovers

    run(tmp_path / "run", steps=4)
    out = tmp_path / "run"
    aside = out / ".mhsa-partial-old"
    aside.mkdir()
    os.replace(out / "step-000004", aside / "step-000004")
    older = out / ".tmp-k3x9_q2a"  # (tempfile's names)
    older.mkdir()
    (older / "model.safetensors").write_bytes(b"half")
    users = [out / ".tmp-mine", out / ".tmp-my-configs", out / ".tmp-abcd1234"]
    for folder, name in zip(users, ("notes.txt", "config.json", "config.json"), strict=True):
        folder.mkdir()  # (the two with a config.json alone were deleted)
        (folder / name).write_text("mine")
    clean_leftovers(out)
    assert resolve_checkpoint(out).name == "step-000004"
    kept = sorted(p.name for p in out.iterdir())
    assert kept == [".tmp-abcd1234", ".tmp-mine", ".tmp-my-configs", "latest", "step-000004"]


def test_a_users_folder_named_like_a_step_is_refused_not_replaced(tmp_path):
    """Its files were deleted when the run wrote that step."""
    out = tmp_path / "run"
    (out / "step-000002").mkdir(parents=True)
    (out / "step-000002" / "my-notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"step-000002 is not a checkpoint .* move it away"):
        run(out, steps=2)
    assert (out / "step-000002" / "my-notes.txt").read_text() == "mine"
    # a run's own checkpoint cut short while it was removed is still the runs' to replace
    (out / "step-000002" / "my-notes.txt").unlink()
    (out / "step-000002" / "trainer.pt").write_bytes(b"half")
    run(out, steps=2)
    assert (out / "step-000002" / "model.safetensors").is_file()
    # and a checkpoint a user put notes in is still a checkpoint: it resumes
    (out / "step-000002" / "notes.txt").write_text("lr too high?")
    run(out, steps=4, resume=True)
    assert step_names(out)[-1] == "step-000004"


def test_a_damaged_trainer_state_names_its_file(tmp_path):
    run(tmp_path / "run", steps=2)
    trainer = tmp_path / "run" / "step-000002" / "trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[:100])
    with pytest.raises(ValueError, match="trainer.pt cannot be read .* a damaged checkpoint"):
        run(tmp_path / "run", steps=3, resume=True)  # (a 27-line torch traceback once)


def test_a_latest_that_is_not_a_checkpoint_link_is_refused(tmp_path):
    """A file or folder named latest is the user's: a run once replaced it (or failed
    after its first step)."""
    for make in (lambda p: p.write_text("notes"), lambda p: p.mkdir()):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        make(out / "latest")
        with pytest.raises(ValueError, match="latest is not a checkpoint link"):
            run(out, steps=1)
        assert (out / "latest").exists() and not (out / "latest").is_symlink()


@pytest.mark.slow
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


class Line(torch.nn.Module):
    """y = gain * x @ weight.T + bias: one matrix (weight-decayed), a vector and a
    scalar (not), and a frozen matrix that the optimizer must leave out."""

    def __init__(self, inputs: int = 3) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, -1.0, inputs)[None])
        self.bias = torch.nn.Parameter(torch.tensor([0.25]))
        self.gain = torch.nn.Parameter(torch.tensor(1.5))
        self.frozen = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)

    def loss(self, x, y):
        return ((self.gain * (x @ self.weight.T) + self.bias - y) ** 2).mean()


class LineTask:
    """Targets of y = x . (1, 2, 3) - 1, 5 rows a batch (nan targets from the nan_from-th
    batch on); two metrics."""

    def __init__(self, nan_from: int | None = None) -> None:
        self.nan_from, self.batches = nan_from, 0
        g = torch.Generator().manual_seed(7)
        self.fixed = [self._batch(g) for _ in range(2)]
        self.metric_calls = []  # (model.training, grad enabled) at each metrics call

    def _batch(self, generator):
        x = torch.randn(5, 3, generator=generator)
        return x, x @ torch.tensor([[1.0], [2.0], [3.0]]) - 1.0

    def train_batch(self, generator):
        x, y = self._batch(generator)
        self.batches += 1
        poisoned = self.nan_from is not None and self.batches >= self.nan_from
        return x, y * float("nan") if poisoned else y

    def eval_batches(self):
        return self.fixed

    def tokens_per_batch(self):
        return 525

    def metrics(self, model):
        self.metric_calls.append((model.training, torch.is_grad_enabled()))
        return {"bias_error": abs(model.bias.item() + 1.0), "gain": model.gain.item()}


LINE = {
    "steps": 7,
    "lr": 0.3,
    "warmup": 2,
    "min_lr_ratio": 0.2,
    "weight_decay": 0.2,
    "grad_clip": 5.0,
    "eval_every": 3,
    "checkpoint_every": 3,
    "seed": 3,
}


def line_reference(config: TrainConfig):
    """config's run written out: AdamW with betas (0.9, 0.95), weight decay on the
    matrix only, lr_at(step) at every step, gradients scaled to a norm <= grad_clip
    (as clip_grad_norm_: by grad_clip / (norm + 1e-6)), batches drawn from a generator
    seeded with seed + 1; an evaluation after every eval_every-th and the last step.
    (model, the training losses, the history, how many steps were clipped)"""
    model, task = Line(), LineTask()
    generator = torch.Generator().manual_seed(config.seed + 1)
    groups = [
        {"params": [model.weight], "weight_decay": config.weight_decay},
        {"params": [model.bias, model.gain], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
    losses, history, clipped = [], [], 0
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss = model.loss(*task.train_batch(generator))
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in (model.weight, model.bias, model.gain)]
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads))
        clipped += norm > config.grad_clip
        with torch.no_grad():
            for g in grads:
                g *= min(1.0, config.grad_clip / (norm + 1e-6))
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            with torch.no_grad():
                val = sum(model.loss(*b).item() for b in task.fixed) / len(task.fixed)
            history.append(
                {
                    "step": step + 1,
                    "train_loss": loss.item(),
                    "val_loss": val,
                    "bias_error": abs(model.bias.item() + 1.0),
                    "gain": model.gain.item(),
                }
            )
    return model, losses, history, clipped


def train_line(out_dir, config, *, model=None, task=None, log=None, **kwargs):
    model, task, lines = model or Line(), task or LineTask(), []
    info = {"model": "line", "config": {}}
    result = train(model, task, config, out_dir, model_info=info, log=log or lines.append, **kwargs)
    return model, task, result, lines


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_run_equals_its_written_out_optimisation_and_reports_it(tmp_path, monkeypatch):
    """Weights, history, metrics, log lines, progress line and statistics of a 7-step run
    of a linear model, under a clock whose first step takes 0.5 s, every later one 1/16
    s, and each of the evaluations after steps 3 and 6 1/4 s (1.375 s in all); the
    rate leaves out the evaluations and, from step 2 on, the first step."""
    config = TrainConfig(**LINE)
    expected, losses, history, clipped = line_reference(config)
    assert 0 < clipped < 7  # the run clips some steps, not all
    ends = [100.5 + i / 16 + (i >= 3) / 4 + (i >= 6) / 4 for i in range(7)]  # exact in binary
    starts = [100.0] + [end + (s in (3, 6)) / 4 for s, end in enumerate(ends[:-1], 1)]
    # the run's start, then each step's start and end, then the run's end
    times = iter([100.0, *(t for pair in zip(starts, ends, strict=True) for t in pair), ends[-1]])
    monkeypatch.setattr(train_module, "time", SimpleNamespace(perf_counter=lambda: next(times)))
    screen = Terminal()  # the bar is redrawn on a terminal (a log gets plain lines)
    monkeypatch.setattr("sys.stderr", screen)
    model, task, result, lines = train_line(tmp_path / "run", config)
    for name, want in expected.named_parameters():
        torch.testing.assert_close(getattr(model, name), want, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(model.frozen, torch.ones(2, 2)) and model.training
    assert list(result) == ["step", "seconds", "history", "tokens_per_second", "steps_this_run"]
    assert result["step"] == 7 and result["seconds"] == 1.375 and result["steps_this_run"] == 7
    assert result["tokens_per_second"] == pytest.approx(16 * 525)  # steps 2..7, 1/16 s each
    assert [r["step"] for r in result["history"]] == [3, 6, 7]
    for got, want in zip(result["history"], history, strict=True):
        assert list(got) == ["step", "train_loss", "val_loss", "bias_error", "gain"]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert task.metric_calls == [(False, False)] * 3  # in eval mode, without autograd
    assert lines == [
        f"step {r['step']}: val loss {r['val_loss']:.4f}, bias_error {r['bias_error']:.4f}, "
        f"gain {r['gain']:.4f}"
        for r in result["history"]
    ]
    # the progress line: a 24-character bar, the step, its training loss, the steps'
    # tokens per second so far (the first step's own at step 1) and the time left at the
    # mean wall time per step so far; a line break after each evaluation
    err = screen.getvalue()
    shown = re.findall(r"\r\[([#-]{24})\] step (\d)/7  loss (\S+)  (\S+)k tok/s  eta +(\d+)s ", err)
    elapsed = [end - 100.0 for end in ends]
    assert [(bar, int(s), float(loss), rate, int(eta)) for bar, s, loss, rate, eta in shown] == [
        (
            "#" * (24 * s // 7) + "-" * (24 - 24 * s // 7),
            s,
            pytest.approx(x, abs=1e-4),
            "1.1" if s == 1 else "8.4",  # 525 tokens in 0.5 s, then in 1/16 s each
            round(t / s * (7 - s)),
        )
        for s, x, t in zip(range(1, 8), losses, elapsed, strict=True)
    ]
    assert shown[0][3:] == ("1.1", "3")  # 1050 tokens/s; 0.5 s per step, 6 steps left
    assert err.count("\n") == 3 and err.endswith("\n")
    # the checkpoint records the optimizer's two groups and the run's TrainConfig
    trainer = load_checkpoint(tmp_path / "run")["trainer"]
    groups = trainer["optimizer"]["param_groups"]
    assert [(g["params"], g["weight_decay"], g["betas"]) for g in groups] == [
        ([0], 0.2, (0.9, 0.95)),
        ([1, 2], 0.0, (0.9, 0.95)),
    ]
    shapes = [tuple(trainer["optimizer"]["state"][i]["exp_avg"].shape) for i in range(3)]
    assert shapes == [(1, 3), (1,), ()]  # weight decayed; bias and gain not; frozen left out
    assert trainer["train_config"] == asdict(config) and trainer["step"] == 7


def test_a_resumed_run_equals_a_straight_one_and_rotates_the_checkpoints_it_found(tmp_path):
    """A run stopped after step 4 and resumed ends with the straight run's weights and
    its whole history (step 3's record comes from the checkpoint); the resumed run owns
    the checkpoints it found (keep=2 rotates them out) and survives one of them being
    removed by hand meanwhile; a checkpoint of another shape is refused before loading."""
    config = TrainConfig(**LINE, keep=2)
    straight, _, full, _ = train_line(tmp_path / "straight", config)
    out = tmp_path / "split"
    _, _, first, _ = train_line(out, config, stop_after=4)
    assert first["step"] == 4 and [r["step"] for r in first["history"]] == [3]
    assert step_names(out) == ["step-000003", "step-000004"]
    lines = []

    def log(line):  # after the run listed its checkpoints: someone removes one
        lines.append(line)
        shutil.rmtree(out / "step-000003", ignore_errors=True)

    resumed, _, second, _ = train_line(out, config, resume=True, log=log)
    assert lines[0] == f"resumed from {out / 'step-000004'} at step 4"
    assert second["step"] == 7 and second["history"] == full["history"]
    for name, want in straight.named_parameters():
        assert torch.equal(getattr(resumed, name), want), name
    assert step_names(out) == ["step-000006", "step-000007"]
    refusal = r"step-000007/model.safetensors: tensor 'weight' has shape \(1, 3\), but its "
    with pytest.raises(ValueError, match=refusal + r"config.json implies \(1, 4\)"):
        train_line(out, TrainConfig(**{**LINE, "steps": 9}), model=Line(inputs=4), resume=True)


def test_a_resumed_run_reports_only_its_own_steps_and_time(tmp_path, monkeypatch):
    """Stopped after step 4 of 7 and resumed: the resumed run made 3 steps, its seconds and
    tokens/s are those 3 steps' (1/2 s each here), and its time left is at its own mean
    time per step (issue 35: the summary said 7 steps for a run of 3)."""
    config = TrainConfig(**LINE)
    out = tmp_path / "split"
    _, _, first, _ = train_line(out, config, stop_after=4)
    assert (first["step"], first["steps_this_run"]) == (4, 4)
    # the run's start, each step's start and end (1/2 s each), the run's end
    times = iter([100.0, 100.0, 100.5, 100.5, 101.0, 101.0, 101.5, 101.5])
    monkeypatch.setattr(train_module, "time", SimpleNamespace(perf_counter=lambda: next(times)))
    screen = Terminal()  # every step's line (a log gets one every few seconds)
    monkeypatch.setattr("sys.stderr", screen)
    _, _, second, _ = train_line(out, config, resume=True)
    assert (second["step"], second["steps_this_run"], second["seconds"]) == (7, 3, 1.5)
    assert second["tokens_per_second"] == pytest.approx(525 / 0.5)  # its steps after its first
    etas = re.findall(r"step (\d)/7 .*? eta +(\d+)s ", screen.getvalue())
    assert etas == [("5", "1"), ("6", "0"), ("7", "0")]  # 0.5 s per step: 1 s, 0.5 s, 0 s left


def test_skipped_steps_are_counted_in_a_row_and_the_messages_say_where_to_go_on(tmp_path):
    """With nonfinite="skip" the count of skipped steps starts again after a good step:
    nan from the 3rd batch on stops the run at the 10th skipped step in a row (step 12),
    each skipped step logged; "stop" stops at the first, naming the step."""
    config = TrainConfig(**{**LINE, "steps": 20}, nonfinite="skip")
    lines = []
    with pytest.raises(TrainingDiverged) as stopped:
        train_line(tmp_path / "skip", config, task=LineTask(nan_from=3), log=lines.append)
    assert [line for line in lines if "non-finite" in line] == [
        f"step {s}: non-finite loss or gradient, step skipped" for s in range(3, 12)
    ]
    assert str(stopped.value) == (
        "training diverged: non-finite loss (nan) or gradient 10 steps in a row; the last "
        f"good checkpoint is {tmp_path / 'skip' / 'step-000009'}. Resume it with a lower "
        "--lr (now 0.3), or pass --skip-nonfinite to skip such steps"
    )
    with pytest.raises(TrainingDiverged) as stopped:
        train_line(tmp_path / "stop", TrainConfig(**LINE), task=LineTask(nan_from=1))
    assert str(stopped.value) == (
        "training diverged: non-finite loss (nan) or gradient at step 1; no checkpoint was "
        "written. Resume it with a lower --lr (now 0.3), or pass --skip-nonfinite to skip "
        "such steps"
    )
    assert not (tmp_path / "stop").exists() or step_names(tmp_path / "stop") == []


def test_overwrite_replaces_an_old_checkpoint_of_the_same_step_and_keeps_them_until_then(
    tmp_path,
):
    out = tmp_path / "run"
    old, *_ = train_line(out, TrainConfig(**{**LINE, "steps": 3}))
    with pytest.raises(TrainingDiverged):  # diverges before its first checkpoint
        train_line(out, TrainConfig(**LINE), task=LineTask(nan_from=2), overwrite=True)
    assert step_names(out) == ["step-000003"]
    new, *_ = train_line(out, TrainConfig(**{**LINE, "lr": 0.1}), overwrite=True, stop_after=3)
    assert step_names(out) == ["step-000003"]
    weights = load_checkpoint(out)["weights"]["weight"]
    assert torch.equal(weights, new.weight.detach()) and not torch.equal(weights, old.weight)


def test_train_config_messages_name_the_option_and_the_value():
    for field, low in [
        ("steps", 1),
        ("eval_every", 1),
        ("checkpoint_every", 1),
        ("keep", 1),
        ("warmup", 0),
    ]:
        flag = "--" + field.replace("_", "-")
        TrainConfig(**{field: low})
        with pytest.raises(
            ValueError, match=re.escape(f"{field} must be an int >= {low} ({flag}), got {low - 1}")
        ):
            TrainConfig(**{field: low - 1})
    TrainConfig(lr=0.5)
    for lr in (0.0, -1e-3, math.nan, math.inf):
        with pytest.raises(
            ValueError, match=re.escape(f"lr must be a finite number > 0 (--lr), got {lr!r}")
        ):
            TrainConfig(lr=lr)
    # accepted once: a negative grad_clip trained uphill, min_lr_ratio -1 a negative lr
    for field, bad, words in (
        ("grad_clip", -1.0, "> 0 (inf: no clipping)"),
        ("grad_clip", 0.0, "> 0 (inf: no clipping)"),
        ("grad_clip", math.nan, "> 0 (inf: no clipping)"),
        ("weight_decay", math.nan, ">= 0 and finite"),
        ("weight_decay", -0.1, ">= 0 and finite"),
        ("min_lr_ratio", -1.0, "in [0, 1]"),
        ("min_lr_ratio", 1.5, "in [0, 1]"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{field} must be a number {words}")):
            TrainConfig(**{field: bad})
    TrainConfig(weight_decay=0, min_lr_ratio=1.0, grad_clip=0.5)
    TrainConfig(grad_clip=math.inf, seed=2**63 - 1)  # (no clipping; the largest seed)
    for seed in (-1, 2**63):  # (torch.Generator's overflow of seed + k, after the build)
        with pytest.raises(ValueError, match=r"seed must be .*\(--seed\)"):
            TrainConfig(seed=seed)
    TrainConfig(nonfinite="skip"), TrainConfig(nonfinite="stop")
    with pytest.raises(
        ValueError, match=re.escape("nonfinite must be 'stop' or 'skip', got 'Stop'")
    ):
        TrainConfig(nonfinite="Stop")


def test_lr_ends_at_its_minimum_with_one_step_after_the_warm_up():
    config = TrainConfig(steps=3, lr=1e-2, warmup=2, min_lr_ratio=0.25)
    assert [lr_at(s, config) for s in range(4)] == pytest.approx([5e-3, 1e-2, 1e-2, 2.5e-3])
    no_warmup = TrainConfig(steps=4, lr=1e-2, warmup=0, min_lr_ratio=0.25)
    assert lr_at(0, no_warmup) == pytest.approx(1e-2)
    assert lr_at(2, no_warmup) == pytest.approx(1e-2 * (0.25 + 0.75 * 0.5))


def test_a_compiled_training_run_trains_like_an_eager_one(tmp_path):
    """TrainConfig(compile=True) (`mhsa train ... --compile`): the loss's forward and
    backward through torch.compile (inductor); without dropout, whose random draws
    differ, 4 steps end at the eager run's weights within 1e-5."""
    models = []
    for compiled in (False, True):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_len=32)
        task = TextTask(ByteTokenizer().encode(TEXT), 32, batch_size=4, eval_batches=2)
        model = GPT(config)
        info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
        settings = TrainConfig(
            steps=4, eval_every=4, checkpoint_every=4, warmup=2, compile=compiled
        )
        train(model, task, settings, tmp_path / str(compiled), model_info=info, log=lambda *_: None)
        models.append(model)
    for (name, a), b in zip(
        models[0].state_dict().items(), models[1].state_dict().values(), strict=True
    ):
        assert (a - b).abs().max() <= 1e-5, name
