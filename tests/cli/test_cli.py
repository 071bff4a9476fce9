"""The `mhsa` command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import assert_same_greedy
from mhsa.cli import main
from mhsa.cli.common import load_model
from mhsa.data.text import ByteTokenizer
from mhsa.models import GPT, GPTConfig


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "device: cpu" in out
    assert "sdpa" in out and "reference" in out and "usable" in out
    assert "logsumexp" in out  # sdpa's limit is explained


@pytest.mark.slow
def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "mhsa.cli", "info"], capture_output=True, text=True, check=True
    )
    assert "backends" in result.stdout


def test_a_reader_that_leaves_or_ctrl_c_ends_a_command_quietly(monkeypatch, capsys):
    """`mhsa info | head -1` once printed a BrokenPipeError traceback, and Ctrl-C a
    KeyboardInterrupt one: now exit 141 with nothing on stderr, and 130 with one line."""
    command = [sys.executable, "-m", "mhsa.cli", "info"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # gone before the command writes its first line
    assert process.wait(timeout=120) == 141
    assert process.stderr.read() == b""
    import mhsa.cli.info

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mhsa.cli.info, "info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err.strip() == "mhsa info: interrupted"


def test_bench_attention_json_small(capsys):
    import json

    from mhsa.benchmarks import attention

    args = ["bench", "attention", "--length", "128", "--repeat", "1", "--no-memory", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    cases = {(row["case"], row["backend"]) for row in result["timing"]}
    assert ("causal forward+backward", "flash") in cases
    assert all(row["seconds"] > 0 and row["vs_sdpa"] > 0 for row in result["timing"])
    assert "dtype" not in result and "device" not in result  # (the CPU in float32)
    # bfloat16 on the CPU was labelled float32 and judged against float32's targets
    assert main([*args, "--dtype", "bf16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "bfloat16" and "device" not in result
    assert all(row["target_vs_sdpa"] is None for row in result["timing"])
    assert "bfloat16 matmul" in attention.report(result)


def test_bench_scores_small(capsys):
    assert main(["bench", "scores", "--length", "128", "--repeat", "1", "--no-memory"]) == 0
    out = capsys.readouterr().out
    assert "L=S=128" in out and all(name in out for name in ("None", "alibi", "softcap"))


def test_versus_says_slower_when_it_is():
    from mhsa.benchmarks.timing import versus

    assert versus("flash", 1.0, 1.4) == "flash is 1.40x faster"
    assert versus("flash", 1.0, 0.35) == "flash is 2.86x slower"  # (was "0.35x faster")


@pytest.mark.slow
def test_memory_probe_runs_in_a_subprocess():
    from mhsa.benchmarks.memory import measure_in_subprocess

    row = measure_in_subprocess("flash", 256, heads=1, causal=True)
    assert "error" not in row and row["peak_bytes"] >= row["baseline_bytes"] > 0


def test_sparse_bench_cases_run_small():
    from mhsa.benchmarks import sparse

    bird = sparse.bigbird_case(256, repeat=1)
    assert set(bird["forward"]) == {"flash", "sdpa dense mask"}
    scaling = sparse.scaling_case(256, 512, repeat=1)
    assert scaling["length_ratio"] == 2 and scaling["ratio"] > 0
    dilated = sparse.dilated_case(256, repeat=1)
    assert set(dilated["forward"]) == {"flash", "flash, same-size window", "sdpa dense mask"}


def test_train_gpt_then_generate(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("for i in range(10):\n    print(i)\n" * 100)
    out = tmp_path / "run"
    args = [
        "train",
        "gpt",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--seq-len",
        "32",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "unigram baseline" in text and (out / "latest").exists()
    assert main(["generate", str(out), "--prompt", "for ", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("for ") and "tokens/s" in captured.err
    # once ignored --compile and still said it had compiled
    both = ["--compile", "--speculate", "prompt-lookup"]
    assert main(["generate", str(out), "--prompt", "for ", *both]) == 2
    assert "--speculate and --compile do not combine" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["diff", "moba"])
def test_train_gpt_with_another_attention_then_generate(tmp_path, capsys, attention):
    data = tmp_path / "data.txt"
    data.write_text("for i in range(10):\n    print(i)\n" * 100)
    out = tmp_path / "run"
    sizes = ["--layers", "1", "--d-model", "32", "--seq-len", "32", "--moba-block", "8"]
    args = ["train", "gpt", "--data", str(data), "--out", str(out), "--steps", "2", *sizes]
    assert main([*args, "--eval-every", "2", "--attention", attention]) == 0
    assert f"rotary positions, {attention} attention" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "for ", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("for ")


def test_attention_maps_match_the_modules_and_plot(tmp_path):
    import torch

    from mhsa.apps.viz import attention_maps, plot_maps

    model = GPT(
        GPTConfig(
            vocab_size=256, n_layer=2, n_head=3, d_model=24, max_len=32, position="alibi", window=6
        )
    )
    idx = torch.randint(0, 256, (1, 11))
    maps = attention_maps(model, idx)
    assert len(maps) == 2 and maps[0].shape == (1, 3, 11, 11)
    assert torch.allclose(maps[0].sum(-1), torch.ones(1, 3, 11), atol=1e-5)
    assert (maps[1][0, :, 8, :2] == 0).all()  # outside the window of 6
    # the first layer's map is what its module computes with need_weights
    block = model.blocks[0]
    x = block.attn_block.norm(model.tok_emb(idx))
    _, weights = block.self_attn(
        x,
        mask=__import__("mhsa").masks.SlidingWindow(5, 0),
        position=model.attn_position,
        need_weights=True,
        average_weights=False,
    )
    assert torch.allclose(maps[0], weights, atol=1e-6)
    plot_maps(maps, list("abcdefghijk"), str(tmp_path / "maps.png"))
    assert (tmp_path / "maps.png").stat().st_size > 1000


@pytest.mark.slow
def test_generate_bench_quick():
    from mhsa.benchmarks import generate

    result = generate.run(quick=True)
    rates = result["cache"]["tokens_per_s"]
    assert rates["mhsa, cache"] > 0 and rates["same greedy tokens as transformers"] is True
    assert rates["same greedy tokens as CTranslate2"] is True and rates["CTranslate2"] > 0
    text = generate.report(result)
    assert "CTranslate2, batch 8:" in text and "target >= 2.0x transformers" in text
    window = result["window"]["results"]
    assert window["sliding-window cache"]["cache_bytes"] < window["full cache"]["cache_bytes"]


def test_bad_checkpoint_path_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err


def tiny_train(out, *extra: str) -> list[str]:
    return [
        "train",
        "gpt",
        "--out",
        str(out),
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        *extra,
    ]


def test_generate_names_a_prompt_longer_than_learned_positions(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train(out, "--position", "learned")) == 0
    capsys.readouterr()
    long_prompt = ["generate", str(out), "--prompt", "x" * 21, "--max-new-tokens", "0"]
    assert main(long_prompt) == 2  # said "--max-new-tokens at most -5"
    assert "--prompt is 21 tokens, more than max_len 16" in capsys.readouterr().err


def test_train_refuses_a_folder_with_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    assert main(tiny_train(out)) == 2
    err = capsys.readouterr().err
    assert "mhsa train:" in err and "--resume" in err and "--overwrite" in err
    assert (out / "step-000002").is_dir()
    assert main(tiny_train(out, "--overwrite", "--steps", "4", "--eval-every", "4")) == 0
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000004"]


def test_a_resumed_train_summary_counts_only_its_own_steps(tmp_path, capsys):
    """--stop-after 1 then --resume of a 4-step run: the summary says 3 steps, not 4
    (issue 35: "600 steps in 1225 s" for a run of 500)."""
    out = tmp_path / "run"
    assert main(tiny_train(out, "--steps", "4", "--stop-after", "1")) == 0
    stopped = capsys.readouterr().out
    assert "\n1 steps in " in stopped
    assert "validation loss not evaluated yet; unigram" in stopped  # (was "nan nats/token")
    assert main(tiny_train(out, "--steps", "4", "--resume")) == 0
    assert "\n3 steps (2 to 4) in " in capsys.readouterr().out


def test_a_taken_folder_is_refused_before_the_data_and_model_load(tmp_path, capsys, monkeypatch):
    """A second run into the same --out is refused before the data is read (here a
    missing --data file, which would fail first otherwise) and before any model is built
    (issue 35); the repository ignores runs/, the commands' default output folders."""
    from pathlib import Path

    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    capsys.readouterr()

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("mhsa.models.GPT", no_model)
    monkeypatch.setattr("mhsa.models.vit.ViT", no_model)
    assert main(tiny_train(out, "--data", str(tmp_path / "missing.txt"))) == 2
    err = capsys.readouterr().err
    assert "already holds a checkpoint (step-000002)" in err and "missing.txt" not in err
    assert main(["train", "vit", "--out", str(out), "--data", str(tmp_path / "no-dir")]) == 2
    err = capsys.readouterr().err
    assert "already holds a checkpoint (step-000002)" in err and "no-dir" not in err
    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert "runs/" in ignored


@pytest.mark.slow
def test_train_resume_into_another_model_kind_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    args = ["train", "points", "--out", str(out), "--resume", "--per-class", "2", "--steps", "1"]
    assert main(args) == 2
    assert "holds a 'gpt' model, not 'points'" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--batch-size", "--steps", "--eval-every", "--keep"])
def test_train_counts_must_be_positive(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_train(tmp_path / "run", option, "0"))
    assert exit_info.value.code == 2
    assert f"argument {option}: must be a whole number >= 1, got 0" in capsys.readouterr().err


def test_ctrl_c_names_the_latest_checkpoint_and_exits_130(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("mhsa.apps.train.train", interrupted)
    assert main(tiny_train(out, "--resume", "--steps", "4")) == 130
    err = capsys.readouterr().err
    assert "interrupted; the latest checkpoint is" in err and "step-000002" in err
    assert "Traceback" not in err


def test_generate_options(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    base = ["generate", str(out), "--max-new-tokens", "3"]
    threads = torch.get_num_threads()
    assert main([*base, "--top-k", "0", "--top-p", "0.9", "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads  # restored after the command
    assert "warning" not in capsys.readouterr().err
    assert main(["generate", str(out), "--max-new-tokens", "20"]) == 0  # rotary, max_len 16
    assert "warning: the model was trained on 16 tokens" in capsys.readouterr().err
    greedy = [*base, "--temperature", "0"]
    assert main(greedy) == 0
    eager = capsys.readouterr().out
    assert main([*greedy, "--compile"]) == 0
    captured = capsys.readouterr()
    assert "compiled the decoding step in" in captured.err
    model, _ = load_model(str(out), {"gpt": (GPT, GPTConfig)})
    got, want = (ByteTokenizer().encode(text.rstrip("\n")) for text in (captured.out, eager))
    assert_same_greedy(
        got.tolist(), want.tolist(), lambda i: model(want[:i].view(1, -1))[0, -1].detach()
    )
    assert main([*base, "--prompt", ""]) == 2
    assert "mhsa generate: --prompt must not be empty" in capsys.readouterr().err
    assert main([*base, "--top-p", "0"]) == 2
    assert "mhsa generate: --top-p must be in (0, 1]" in capsys.readouterr().err
    for option, value in (("--top-k", "-1"), ("--max-new-tokens", "-5")):
        with pytest.raises(SystemExit):
            main(["generate", str(out), option, value])
        assert f"argument {option}: must be a whole number >= 0" in capsys.readouterr().err


def test_train_refuses_a_binary_data_file(tmp_path, capsys):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 20)
    assert main(tiny_train(tmp_path / "run", "--data", str(data))) == 2
    assert "are not UTF-8 text (a binary file?)" in capsys.readouterr().err


def test_damaged_or_mismatched_checkpoints_are_clear_errors(tmp_path, capsys):
    import json

    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    step = out / "step-000002"
    config_file = step / "config.json"
    config = json.loads(config_file.read_text())
    # a config that promises a 2e9-token vocabulary: refused from the file's header,
    # before any model of that size is built
    config["config"]["vocab_size"] = 2_000_000_000
    config_file.write_text(json.dumps(config))
    assert main(["generate", str(out), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: tensor 'tok_emb.weight' has shape (256, " in err
    assert "but its config.json implies (2000000000, " in err
    config["config"]["vocab_size"] = 256
    config["config"]["bogus"] = 1
    config_file.write_text(json.dumps(config))
    assert main(["generate", str(out), "--max-new-tokens", "1"]) == 2
    assert "config.json: not a valid config" in capsys.readouterr().err
    del config["config"]["bogus"]
    config_file.write_text(json.dumps(config))
    weights = step / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    assert main(["generate", str(out), "--max-new-tokens", "1"]) == 2
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().err
    assert main(tiny_train(out, "--resume", "--steps", "4")) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_a_gpt_run_into_another_kind_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "pts"
    args = [
        "train",
        "points",
        "--out",
        str(out),
        "--steps",
        "1",
        "--eval-every",
        "1",
        "--per-class",
        "2",
        "--layers",
        "1",
        "--d-model",
        "16",
    ]
    assert main(args) == 0
    assert main(tiny_train(out, "--resume")) == 2
    assert "holds a 'points' model, not 'gpt'" in capsys.readouterr().err


def test_a_checkpoint_of_another_kind_is_named(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    assert main(["classify", str(out), "x.png"]) == 2
    assert "holds a 'gpt' model; this command takes vit or ast or points" in capsys.readouterr().err
    assert main(["translate", str(out), "one"]) == 2
    assert "takes seq2seq checkpoints (mhsa train translate)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "-1"], "lr must be a finite number > 0 (--lr), got -1.0"),
        (["--lr", "nan"], "lr must be a finite number > 0 (--lr), got nan"),
        (["--dropout", "1.5"], "--dropout 1.5: must be in [0, 1)"),
    ],
)
def test_bad_training_values_are_one_line_errors(tmp_path, capsys, args, message):
    assert main(tiny_train(tmp_path / "run", *args)) == 2
    err = capsys.readouterr().err
    assert f"mhsa train: {message}" in err and "Traceback" not in err


def test_bad_text_arguments_are_one_line_errors(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    assert main(["generate", str(out), "--prompt", "\udcff"]) == 2  # how argv holds bad bytes
    assert "mhsa generate: --prompt is not valid text" in capsys.readouterr().err
    assert main(["viz", str(out), "--text", "", "--out", str(tmp_path / "m.png")]) == 2
    assert "mhsa viz: --text must be 1..16 bytes, got 0" in capsys.readouterr().err


def test_generate_speculate_gives_the_greedy_text(tmp_path, capsys):
    """--speculate prompt-lookup and draft:CHECKPOINT (the same tiny model as its own
    draft) continue a prompt as plain greedy decoding does; a bad value is one line."""
    out = tmp_path / "run"
    assert main(tiny_train(out)) == 0
    capsys.readouterr()
    base = ["generate", str(out), "--max-new-tokens", "10", "--temperature", "0"]
    base += ["--prompt", "for i in for i in "]
    assert main(base) == 0
    plain = capsys.readouterr().out
    model, _ = load_model(str(out), {"gpt": (GPT, GPTConfig)})
    want = ByteTokenizer().encode(plain.rstrip("\n"))
    for speculate in ("prompt-lookup", f"draft:{out}"):
        assert main([*base, "--speculate", speculate, "--draft-tokens", "3"]) == 0
        got = ByteTokenizer().encode(capsys.readouterr().out.rstrip("\n"))
        assert_same_greedy(
            got.tolist(), want.tolist(), lambda i: model(want[:i].view(1, -1))[0, -1].detach()
        )
    with pytest.raises(SystemExit):
        main([*base, "--speculate", "lookahead"])
    assert "must be 'prompt-lookup' or 'draft:PATH'" in capsys.readouterr().err
