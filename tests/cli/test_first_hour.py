"""A new user's first hour in a fresh clone (issue 47 item 12): every output path is
checked before any work starts, flag errors name the flags, a log gets plain lines, and
`generate` takes its checkpoint the way `train` names it."""

from __future__ import annotations

import io
from pathlib import Path

from mhsa.checkpoint import save_checkpoint
from mhsa.cli import main
from mhsa.models import GPT, GPTConfig

SIZES = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16"]


def tiny_train(out, *extra: str) -> list[str]:
    return ["train", "gpt", "--out", str(out), "--steps", "1", "--batch-size", "2"] + [
        *SIZES,
        *extra,
    ]


def tiny_gpt(out: Path) -> Path:
    """A random 1-layer GPT saved as a `mhsa train gpt` checkpoint in out."""
    config = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, max_len=32)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    save_checkpoint(out, 1, GPT(config), info, {})
    return out


def one_line_error(capsys, args: list[str], command: str) -> str:
    """The one line that main(args) writes to stderr when it refuses them (exit 2)."""
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"mhsa {command}: ")
    return captured.err.strip()


def no_work(monkeypatch, *targets: str) -> None:
    """Make each target (a dotted name) fail the test if it is called."""

    def refused(*args, **kwargs):
        raise AssertionError("work started before the output path was checked")

    for target in targets:
        monkeypatch.setattr(target, refused)


# ---------------------------------------------------------------- output paths


def test_train_refuses_an_out_that_is_a_file_before_any_work(tmp_path, capsys, monkeypatch):
    """`echo hi > todo.txt; mhsa train gpt --out todo.txt` trained, then died at the
    first checkpoint with a FileExistsError traceback; now it is one line before the data
    is read, and todo.txt keeps what it held."""
    todo = tmp_path / "todo.txt"
    todo.write_text("hi\n")
    no_work(monkeypatch, "mhsa.data.text.stdlib_corpus", "mhsa.apps.train.train")
    for out in (todo, todo / "run"):
        err = one_line_error(capsys, tiny_train(out), "train")
        assert f"--out {out}" in err and "todo.txt is a file, not a folder" in err
        assert "choose another --out" in err
    assert todo.read_text() == "hi\n"
    for model in ("bert", "vit", "points", "translate"):
        err = one_line_error(capsys, ["train", model, "--out", str(todo)], "train")
        assert "todo.txt is a file, not a folder" in err


def test_viz_refuses_a_folder_or_a_taken_file_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--html DIR gave an IsADirectoryError traceback after the model ran; an existing
    --out or --html file was silently replaced. Both are refused first; --overwrite
    replaces a file (never a folder)."""
    run = tiny_gpt(tmp_path / "run")
    folder = tmp_path / "pages"
    folder.mkdir()
    taken = tmp_path / "mine.png"
    taken.write_bytes(b"my picture")
    text = ["--text", "def f():"]
    with monkeypatch.context() as patch:
        no_work(patch, "mhsa.cli.common.load_model")
        err = one_line_error(capsys, ["viz", str(run), *text, "--html", str(folder)], "viz")
        assert f"--html {folder} is a folder" in err and "name a file" in err
        err = one_line_error(capsys, ["viz", str(run), *text, "--out", str(folder)], "viz")
        assert f"--out {folder} is a folder" in err
        args = ["viz", str(run), *text, "--out", str(taken), "--overwrite", "--html", str(folder)]
        err = one_line_error(capsys, args, "viz")
        assert "is a folder" in err
        err = one_line_error(capsys, ["viz", str(run), *text, "--out", str(taken)], "viz")
        assert f"--out {taken} exists" in err and "--overwrite" in err
        same = ["viz", str(run), *text, "--out", str(tmp_path / "a.png")]
        err = one_line_error(capsys, [*same, "--html", str(tmp_path / "a.png")], "viz")
        assert "--out and --html name the same file" in err
    assert taken.read_bytes() == b"my picture" and not list(folder.iterdir())
    assert main(["viz", str(run), *text, "--out", str(taken), "--overwrite"]) == 0
    assert taken.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_export_checks_its_out_before_loading_or_exporting(tmp_path, capsys, monkeypatch):
    taken = tmp_path / "model.onnx"
    taken.write_bytes(b"mine")
    folder = tmp_path / "folder.onnx"
    folder.mkdir()
    no_work(monkeypatch, "mhsa.cli.export.load_model", "mhsa.apps.export.exportable")
    base = ["export", "onnx", "--model", "minilm", "--out"]
    err = one_line_error(capsys, [*base, str(taken)], "export")
    assert f"--out {taken} exists: pass --overwrite to replace it" in err
    err = one_line_error(capsys, [*base, str(folder), "--overwrite"], "export")
    assert f"--out {folder} is a folder" in err
    err = one_line_error(capsys, [*base, str(taken / "x.onnx")], "export")
    assert "model.onnx is a file, not a folder" in err
    err = one_line_error(capsys, [*base, str(tmp_path / "model.txt")], "export")
    assert "--out" in err and ".onnx" in err
    assert taken.read_bytes() == b"mine"


# ---------------------------------------------------------------- progress in a log


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_training_progress_is_plain_lines_in_a_log_and_redrawn_on_a_terminal(
    tmp_path, capsys, monkeypatch
):
    """Piped to a file, the progress bar's \\r made one long line of every step; a log
    now gets whole lines (the first step, the last, and at most one every few seconds
    between), a terminal the bar redrawn in place."""
    import mhsa.apps.train as train_app

    assert main(tiny_train(tmp_path / "log", "--steps", "5", "--eval-every", "5")) == 0
    err = capsys.readouterr().err  # capsys's stderr is no terminal, as a pipe or file
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/5  loss ") and lines[-1].startswith("step 5/5  loss ")
    assert len(lines) < 5 and "tok/s" in lines[-1]
    monkeypatch.setattr(train_app, "LOG_EVERY_SECONDS", 0.0)
    assert main(tiny_train(tmp_path / "all", "--steps", "3", "--eval-every", "3")) == 0
    err = capsys.readouterr().err
    assert [line[:8] for line in err.splitlines() if line.startswith("step ")] == [
        "step 1/3",
        "step 2/3",
        "step 3/3",
    ]
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    assert main(tiny_train(tmp_path / "tty", "--steps", "2", "--eval-every", "2")) == 0
    drawn = screen.getvalue()
    assert drawn.count("\r[") == 2 and "step 2/2" in drawn and drawn.endswith("\n")
