"""Every model config checks its fields' types as annotated, its sizes and its norm's
eps (models.config.ModelConfig.__post_init__), before the model is built."""

from __future__ import annotations

import math

import pytest

from mhsa.models import GPTConfig
from mhsa.models.ast import ASTConfig
from mhsa.models.bert import BertConfig
from mhsa.models.gemma3 import Gemma3Config
from mhsa.models.llama import LlamaConfig
from mhsa.models.points import PointCloudConfig
from mhsa.models.seq2seq import Seq2SeqConfig
from mhsa.models.vit import ViTConfig
from mhsa.models.whisper import WhisperConfig

# each was accepted: "false" built a bias, -1 layers a model of none, eps nan nan logits,
# an eos id outside the vocabulary a translation that never stopped
BAD = [
    (LlamaConfig, {"attention_bias": "false"}, "attention_bias must be True or False"),
    (GPTConfig, {"bias": "False"}, "bias must be True or False"),
    (Gemma3Config, {"tie_embeddings": "no"}, "tie_embeddings must be True or False"),
    (GPTConfig, {"norm_eps": math.nan}, "norm_eps must be a finite number > 0"),
    (LlamaConfig, {"norm_eps": math.inf}, "norm_eps must be a finite number > 0"),
    (BertConfig, {"norm_eps": -1.0}, "norm_eps must be a finite number > 0"),
    (BertConfig, {"n_layer": -1}, "n_layer must be an int >= 1"),
    (BertConfig, {"type_vocab_size": 0}, "type_vocab_size must be an int >= 1"),
    (BertConfig, {"pad_token_id": -1}, "pad_token_id must be a token id"),
    (ViTConfig, {"n_layer": -1}, "n_layer must be an int >= 1"),
    (ViTConfig, {"patch_size": 0}, "patch_size must be an int >= 1"),
    (ASTConfig, {"num_classes": 0}, "num_classes must be an int >= 1"),
    (PointCloudConfig, {"d_model": 2.0}, "d_model must be an int"),
    (PointCloudConfig, {"dropout": 2.0}, "dropout"),
    (WhisperConfig, {"eot_id": "50256"}, "eot_id must be an int"),
]
SEQ2SEQ = {"src_vocab": 11, "tgt_vocab": 11}
BAD += [
    (Seq2SeqConfig, {**SEQ2SEQ, "n_encoder_layer": -1}, "n_encoder_layer must be an int >= 1"),
    (Seq2SeqConfig, {**SEQ2SEQ, "eos_id": 99}, "eos_id must be a token id"),
    (Seq2SeqConfig, {**SEQ2SEQ, "bos_id": 1.0}, "bos_id must be an int"),
    (Seq2SeqConfig, {**SEQ2SEQ, "share_embeddings": "yes"}, "share_embeddings must be True"),
]


@pytest.mark.parametrize(("config", "fields", "message"), BAD, ids=[m for *_, m in BAD])
def test_bad_fields_are_refused_by_name(config, fields, message):
    with pytest.raises(ValueError, match=message) as error:
        config(**fields)
    assert "\n" not in str(error.value)


def test_the_defaults_and_optional_fields_serve():
    for config in (GPTConfig, LlamaConfig, Gemma3Config, BertConfig, ViTConfig, ASTConfig):
        config()
    PointCloudConfig(), WhisperConfig(), Seq2SeqConfig(**SEQ2SEQ)
    LlamaConfig(n_kv_head=None, rope_scaling=None), GPTConfig(dropout=0)  # (an int float)
