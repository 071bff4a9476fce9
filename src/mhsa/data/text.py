"""Text for language modelling: the Python standard library's own source files (present
on every machine that runs Python) or any text file, as bytes."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from torch import Tensor


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, nothing unknown."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, tokens: Tensor | list[int]) -> str:
        values = tokens.tolist() if isinstance(tokens, Tensor) else tokens
        return bytes(values).decode("utf-8", errors="replace")


def stdlib_corpus(limit_bytes: int | None = None) -> str:
    """The top-level .py files of this interpreter's standard library, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if limit_bytes is not None and size >= limit_bytes:
            break
    if not parts:
        raise RuntimeError(f"no .py files found under {root}; pass --data FILE instead")
    return "\n".join(parts)


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    undecodable = text.count("\ufffd") + text.count("\x00")
    if undecodable > len(text) // 100:  # more than 1%: not UTF-8 text
        raise ValueError(
            f"--data {path}: {undecodable} of {len(text)} characters are not UTF-8 text "
            "(a binary file?); give a UTF-8 text file"
        )
    if len(text) < 1000:
        raise ValueError(f"--data {path}: only {len(text)} characters; give at least 1000")
    return text


class TextTask:
    """Next-token prediction on one token stream, split 90/10 into train/validation.

    Batches are random windows of `seq_len + 1` tokens; validation uses fixed windows.
    """

    def __init__(self, tokens: Tensor, seq_len: int, batch_size: int, eval_batches: int = 8):
        split = int(len(tokens) * 0.9)
        self.train, self.val = tokens[:split], tokens[split:]
        if len(self.val) <= seq_len + 1:
            raise ValueError(f"text too short for seq_len {seq_len}: give more text")
        self.seq_len, self.batch_size = seq_len, batch_size
        generator = torch.Generator().manual_seed(1234)
        self._eval = [self._windows(self.val, generator) for _ in range(eval_batches)]

    def _windows(self, data: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        starts = torch.randint(
            0, len(data) - self.seq_len - 1, (self.batch_size,), generator=generator
        )
        rows = torch.stack([data[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def train_batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return self._windows(self.train, generator)

    def eval_batches(self) -> list[tuple[Tensor, Tensor]]:
        return self._eval

    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def unigram_loss(self, vocab_size: int) -> float:
        """Validation cross-entropy (nats/token) of train-set token frequencies."""
        counts = torch.bincount(self.train, minlength=vocab_size).double() + 1.0
        log_probs = torch.log(counts / counts.sum())
        return -log_probs[self.val].mean().item()


def describe_loss(loss: float) -> str:
    return f"{loss:.4f} nats/token ({loss / math.log(2):.3f} bits)"


class MaskedLMTask:
    """Masked-language-model batches from one byte stream (BERT's recipe).

    Each sequence is a window of random length (seq_len / 4 .. seq_len) padded to
    seq_len; 15% of its real tokens are selected: 80% become [MASK], 10% a random
    byte, 10% stay. Labels hold the original token at selected positions, -100 elsewhere.
    With pack, the windows are drawn until the next would pass batch_size * seq_len
    tokens and packed into one row without padding (mhsa.data.pack): a batch is then a
    dict for model.loss(**batch) (input_ids and labels (1, total), attention_mask None,
    cu_seqlens).
    """

    PAD, MASK = 256, 257
    VOCAB = 258

    def __init__(
        self,
        tokens: Tensor,
        seq_len: int,
        batch_size: int,
        eval_batches: int = 8,
        *,
        pack: bool = False,
    ):
        split = int(len(tokens) * 0.9)
        self.train, self.val = tokens[:split], tokens[split:]
        if len(self.val) <= seq_len:
            raise ValueError(f"text too short for seq_len {seq_len}: give more text")
        self.seq_len, self.batch_size, self.pack = seq_len, batch_size, pack
        self._tokens = batch_size * seq_len
        generator = torch.Generator().manual_seed(1234)
        self._eval = [self._batch(self.val, generator) for _ in range(eval_batches)]

    def _batch(self, data: Tensor, g: torch.Generator) -> tuple | dict:
        if self.pack:
            return self._packed(data, g)
        n, length = self.batch_size, self.seq_len
        lengths = torch.randint(length // 4, length + 1, (n,), generator=g)
        starts = torch.randint(0, len(data) - length, (n,), generator=g)
        ids = torch.full((n, length), self.PAD, dtype=torch.long)
        for i, (s, k) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            ids[i, :k] = data[s : s + k]
        real = ids != self.PAD
        inputs, labels = self._masked(ids, real, g)
        return inputs, real, labels

    def _packed(self, data: Tensor, g: torch.Generator) -> dict:
        from .packing import pack

        budget, length = self.batch_size * self.seq_len, self.seq_len
        windows, total = [], 0
        while True:
            k = int(torch.randint(length // 4, length + 1, (1,), generator=g))
            if windows and total + k > budget:
                break
            s = int(torch.randint(0, len(data) - length, (1,), generator=g))
            windows.append(data[s : s + k])
            total += k
        (batch,) = pack(windows, budget)  # they fit: one row
        ids = batch.tokens.view(1, -1)
        inputs, labels = self._masked(ids, torch.ones_like(ids, dtype=torch.bool), g)
        self._tokens = batch.num_tokens
        return {
            "input_ids": inputs,
            "attention_mask": None,
            "labels": labels,
            "cu_seqlens": batch.cu_seqlens,
        }

    def _masked(self, ids: Tensor, real: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """(inputs, labels): 15% of the real tokens selected, 80/10/10."""
        selected = (torch.rand(ids.shape, generator=g) < 0.15) & real
        labels = torch.where(selected, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=g)
        inputs = torch.where(selected & (roll < 0.8), torch.full_like(ids, self.MASK), ids)
        random_bytes = torch.randint(0, 256, ids.shape, generator=g)
        inputs = torch.where(selected & (roll >= 0.8) & (roll < 0.9), random_bytes, inputs)
        return inputs, labels

    def train_batch(self, generator: torch.Generator) -> tuple | dict:
        return self._batch(self.train, generator)

    def eval_batches(self) -> list:
        return self._eval

    def tokens_per_batch(self) -> int:
        """Tokens of a padded batch, or of the last packed one (every one real)."""
        return self._tokens


def documents(tokens: Tensor, max_len: int, separator: tuple[int, ...] = (10, 10)) -> list[Tensor]:
    """The token stream cut into documents after each `separator` (a blank line, in
    bytes), each at most max_len tokens (longer ones cut into pieces): Python source
    split this way has a long-tailed length distribution, as real corpora do."""
    n = len(separator)
    windows = tokens.unfold(0, n, 1) if len(tokens) >= n else tokens.new_zeros(0, n)
    ends = ((windows == torch.tensor(separator)).all(1).nonzero().flatten() + n).tolist()
    pieces, start = [], 0
    for end in [*ends, len(tokens)]:
        if end - n < start and end < len(tokens):  # overlaps the separator just cut at
            continue
        for cut in range(start, end, max_len):
            pieces.append(tokens[cut : min(end, cut + max_len)])
        start = end
    return [p for p in pieces if len(p)]


class PackedTextTask:
    """Next-token prediction on documents of their own lengths, packed without padding
    (mhsa.data.pack): each batch is one row of whole documents, drawn at random until
    the next would pass `max_tokens`. A batch is a dict for model.loss(**batch): idx
    (1, total), targets (1, total) (each token's successor in its document, -100 at a
    document's last token: no loss crosses a boundary) and cu_seqlens.

    documents: the train and validation documents (each at most max_tokens tokens)."""

    def __init__(
        self,
        train: list[Tensor],
        val: list[Tensor],
        max_tokens: int,
        eval_batches: int = 8,
    ) -> None:
        if not train or not val:
            raise ValueError("need train and validation documents: give more text")
        self.train, self.val, self.max_tokens = train, val, max_tokens
        self._tokens = 0
        generator = torch.Generator().manual_seed(1234)
        self._eval = [self._batch(val, generator) for _ in range(eval_batches)]

    @classmethod
    def from_stream(cls, tokens: Tensor, seq_len: int, batch_size: int) -> PackedTextTask:
        """Documents of at most seq_len tokens cut from one stream (split 90/10 into
        train/validation) in batches of batch_size * seq_len tokens."""
        split = int(len(tokens) * 0.9)
        return cls(
            documents(tokens[:split], seq_len),
            documents(tokens[split:], seq_len),
            batch_size * seq_len,
        )

    def _batch(self, docs: list[Tensor], generator: torch.Generator) -> dict:
        from .packing import next_token_targets, pack

        chosen, total = [], 0
        while True:
            doc = docs[int(torch.randint(len(docs), (1,), generator=generator))]
            if total + len(doc) > self.max_tokens:
                break
            chosen.append(doc)
            total += len(doc)
        if not chosen:  # a document as long as the budget, alone
            chosen = [doc[: self.max_tokens]]
        (batch,) = pack(chosen, self.max_tokens)  # they fit: one row
        self._tokens = batch.num_tokens
        return {
            "idx": batch.tokens.view(1, -1),
            "targets": next_token_targets(batch.tokens, batch.cu_seqlens).view(1, -1),
            "cu_seqlens": batch.cu_seqlens,
        }

    def train_batch(self, generator: torch.Generator) -> dict:
        return self._batch(self.train, generator)

    def eval_batches(self) -> list[dict]:
        return self._eval

    def tokens_per_batch(self) -> int:
        """The last training batch's tokens (every one real)."""
        return self._tokens
