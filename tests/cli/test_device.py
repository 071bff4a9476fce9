"""--device and --dtype (issue 45): one resolver says where each command computes and in
which dtype; a device or dtype that cannot be had is a one-line error naming the flag,
exit 2, before anything loads; `mhsa info` says each command's defaults. CUDA is only
pretended here (torch.cuda's answers monkeypatched): nothing is allocated on a GPU."""

from __future__ import annotations

import argparse

import pytest
import torch

from mhsa.cli import main
from mhsa.cli.device import (
    COMMANDS,
    default_dtype,
    defaults_here,
    describe,
    placement,
    resolve_device,
    resolve_dtype,
)

NO_CUDA = "torch sees no CUDA GPU"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    """A pretended machine with one bfloat16-capable GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Pretend H200")


def test_the_default_device_is_cuda_where_torch_sees_a_gpu_else_the_cpu(no_gpu, monkeypatch):
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(None) == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_the_default_dtype_is_bf16_on_cuda_and_float32_on_the_cpu(gpu, monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype(None, cpu, training=True) == torch.float32
    assert resolve_dtype(None, cuda) == torch.bfloat16
    assert resolve_dtype(None, cuda, training=True) == torch.bfloat16  # autocast's
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 and resolve_dtype("fp16", cuda) == (
        torch.float16
    )
    assert describe(cuda, torch.bfloat16, training=True) == (
        "cuda, bfloat16 autocast (float32 weights)"
    )
    assert describe(cpu, torch.float32, training=True) == "cpu, float32"
    # a GPU without bfloat16 (before Ampere): float16 for inference, float32 for training
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert default_dtype(cuda) == torch.float16
    assert default_dtype(cuda, training=True) == torch.float32


@pytest.mark.parametrize(
    ("device", "dtype", "training", "message"),
    [
        ("cuda", None, False, f"--device cuda: {NO_CUDA} (torch "),
        ("cuda:0", None, False, f"--device cuda:0: {NO_CUDA} (torch "),
        ("gpu", None, False, "--device gpu: not a device mhsa runs on; pass cpu, cuda or cuda:N"),
        ("mps", None, False, "--device mps: not a device mhsa runs on"),
        ("cpu", "int8", False, "--dtype int8: not a dtype; pass float32, bfloat16 or float16"),
        ("cpu", "float16", False, "--dtype float16: float16 is for CUDA; on the CPU use"),
        ("cpu", "fp16", True, "--dtype fp16: float16 training needs loss scaling"),
    ],
)
def test_what_cannot_be_had_is_one_line_naming_the_flag(no_gpu, device, dtype, training, message):
    args = argparse.Namespace(device=device, dtype=dtype)
    with pytest.raises(ValueError) as error:
        placement(args, training=training)
    text = str(error.value)
    assert text.startswith(message) and "\n" not in text, text
    if "cuda" in device:
        assert text.endswith("; use --device cpu") and torch.__version__ in text


def test_a_gpu_index_torch_does_not_see_and_bf16_on_an_old_gpu_are_refused(gpu, monkeypatch):
    with pytest.raises(ValueError, match=r"--device cuda:3: torch sees 1 CUDA GPU \(cuda:0\)"):
        resolve_device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (7, 0))
    with pytest.raises(ValueError, match="compute capability 7.0\\) has no bfloat16; use"):
        resolve_dtype("bfloat16", torch.device("cuda"))


# every command that takes --device, with arguments that would fail later (a missing
# checkpoint or file) if the device were not refused first
COMMAND_LINES = {
    "train": ["train", "gpt", "--out", "{tmp}/run"],
    "chat": ["chat", "--prompt", "hi", "--model", "{tmp}/missing.gguf"],
    "serve": ["serve", "--model", "{tmp}/missing.gguf", "--port", "0"],
    "generate": ["generate", "{tmp}/missing"],
    "translate": ["translate", "{tmp}/missing", "one"],
    "transcribe": ["transcribe", "{tmp}/missing.wav"],
    "embed": ["embed", "hello"],
    "classify": ["classify", "{tmp}/missing", "{tmp}/a.png"],
    "viz": ["viz", "{tmp}/missing", "--text", "hi"],
    "bench": ["bench", "attention", "--quick"],
}


def test_every_compute_command_is_in_the_table():
    assert set(COMMAND_LINES) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMAND_LINES)
def test_cuda_without_a_gpu_is_one_line_and_exit_2_before_anything_loads(
    command, tmp_path, capsys, no_gpu, monkeypatch
):
    def no_load(*args, **kwargs):
        raise AssertionError("something loaded before the device was refused")

    for loader in (
        "mhsa.apps.chat.load_chat_model",
        "mhsa.cli.common.load_model",
        "mhsa.apps.embed.SentenceEncoder",
        "mhsa.apps.transcribe.load_whisper",
        "mhsa.data.text.stdlib_corpus",
        "mhsa.benchmarks.attention.run",
    ):
        monkeypatch.setattr(loader, no_load)
    argv = [part.format(tmp=tmp_path) for part in COMMAND_LINES[command]]
    assert main([*argv, "--device", "cuda"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    if command in ("chat", "serve"):  # they say what they load first
        assert lines[0].startswith("loading "), lines
        lines = lines[1:]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"mhsa {command}: --device cuda: {NO_CUDA} (torch "), lines
    assert lines[0].endswith("; use --device cpu")


@pytest.mark.parametrize(
    "argv", [["embed", "hi", "--dtype", "half"], ["bench", "flex", "--dtype", "x"]]
)
def test_a_dtype_the_cpu_cannot_do_is_refused_the_same_way(argv, capsys, no_gpu, monkeypatch):
    monkeypatch.setattr("mhsa.apps.embed.SentenceEncoder", None)  # never reached
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mhsa {argv[0]}: --dtype {argv[argv.index('--dtype') + 1]}: ")
    assert "\n" not in err


def test_chat_refuses_the_cpus_int4_on_cuda_before_reading_weights(gpu, capsys, monkeypatch):
    from mhsa.apps.chat import load_chat_model

    with pytest.raises(ValueError, match="quantize='int4': its int8 and int4 matmuls run on"):
        load_chat_model("/nonexistent.gguf", quantize="int4", device="cuda")
    monkeypatch.setattr("mhsa.cli.chat.check_prompt_lengths", lambda args: None)
    assert main(["chat", "--prompt", "hi", "--quantize", "file", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("mhsa chat: --quantize file: its int8 and int4 matmuls run on")
    assert "--quantize none" in err[-1]


def test_info_says_each_commands_device_and_dtype(capsys, gpu):
    lines = defaults_here()
    rows = {line.split()[0]: line for line in lines}
    assert set(rows) == {*COMMANDS, "export"}
    assert rows["train"].endswith("cuda (Pretend H200), bfloat16 autocast (float32 weights)")
    assert "cuda (Pretend H200), bfloat16 (weights dequantised)" in rows["chat"]
    assert rows["embed"].endswith("cuda (Pretend H200), bfloat16")
    assert "ring and transcribe: their processes" in rows["bench"]
    assert rows["export"].startswith("export     cpu")


def test_info_prints_the_defaults_here(capsys, no_gpu):
    assert main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("commands (defaults here; --device cpu|cuda and --dtype change them):")
    shown = out[start + 1 : start + 2 + len(COMMANDS)]
    assert shown[0] == "  train      cpu, float32"
    assert "  generate   cpu, float32" in shown and shown[-1].startswith("  export     cpu")
