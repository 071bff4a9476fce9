"""The tokenizer a GGUF file describes, built with the `tokenizers` package.

A GGUF has no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`), the BPE
merges, a type per token (1 normal, 3 control, 4 user-defined...), the special token ids and
the name of the pre-tokenizer its merges were learned with (`tokenizer.ggml.pre`). This file
supports byte-level BPE (`tokenizer.ggml.model` "gpt2", used by Llama 3, Qwen, SmolLM, GPT-2
and most recent models); SentencePiece files ("llama") raise a clear error.

    tokenizer = read_gguf_tokenizer("model.gguf")   # in formats.gguf
    ids = tokenizer.encode("Hello!")
    tokenizer.decode(ids)
    stream = tokenizer.stream()            # text as tokens arrive, whole characters only
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    prompt = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

# How each pre-tokenizer kind splits text before BPE, from llama.cpp's llama-vocab.cpp (the
# regexes its converter pairs with each `tokenizer.ggml.pre`). "gpt2" is GPT-2's own regex,
# which tokenizers' ByteLevel applies; "digits" splits every digit off first, then GPT-2's.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, str] = {
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "exaone": "digits",
    "minerva-7b": "digits",
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "dbrx": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3,
    "midm-2.0": _LLAMA3,
    "lfm2": _LLAMA3,
    "qwen2": _QWEN2,
    "stablelm2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
}
# Llama 3's kind (tiktoken's rule, "ignore_merges" in its tokenizer.json): a piece that is
# itself a token is that token, whatever the merges; and BOS is added unless the file says not.
WHOLE_PIECES = frozenset(
    {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
)
CONTROL, USER_DEFINED = 3, 4
INSTALL_HINT = "pip install tokenizers jinja2 (or pip install 'mhsa[chat]')"


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the other bytes (controls, space...) for the characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(f"GGUF tokenizers need the tokenizers package: {INSTALL_HINT}") from error
    return tokenizers


def check_special_ids(metadata: dict[str, Any], source: str = "GGUF") -> None:
    """Every special token id the metadata names (each tokenizer.ggml.*_token_id: bos, eos,
    unknown, seperator, padding, eot, eom, fim_*...) is a token of its vocabulary, so that a
    damaged id fails at load in one line, not at the first chat or decoding step."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return  # (no vocabulary: GGUFTokenizer says so)
    for key, value in metadata.items():
        if not (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise ValueError(
                f"{source}: {key} is {value!r}, not a token of the vocabulary of {len(tokens)} "
                f"tokens (ids 0..{len(tokens) - 1}): a damaged GGUF file"
            )


class GGUFTokenizer:
    """Byte-level BPE from GGUF metadata: `encode`, `decode`, `stream`, `render_chat`.

    Control tokens (`<|im_start|>`...) are special: written in the text they become their one
    id, and decode(skip_special_tokens=True) drops them. `bos_token_id`, `eos_token_id`,
    `pad_token_id` are ids or None; `end_token_ids` the ids that end a reply (EOS, and the
    end of turn and of message where the file names them); `add_bos_token` says whether
    `encode` prepends BOS.
    """

    def __init__(self, metadata: dict[str, Any], source: str = "GGUF") -> None:
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{source}: tokenizer kind {kind!r} (tokenizer.ggml.model) is not supported, only "
                "byte-level BPE 'gpt2'; use a GGUF of a model with a byte-level BPE vocabulary"
            )
        pre = metadata.get("tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"{source}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))}); add its split regex to "
                "PRE_TOKENIZERS"
            )
        if "tokenizer.ggml.tokens" not in metadata:
            raise ValueError(
                f"{source}: no tokenizer.ggml.tokens (the vocabulary): a damaged GGUF file; "
                "download or convert it again"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges: list[str] = list(metadata.get("tokenizer.ggml.merges") or [])
        if len(types) != len(tokens):
            raise ValueError(
                f"{source}: {len(tokens)} tokens but {len(types)} token types: a damaged GGUF file"
            )
        check_special_ids(metadata, source)
        self.source, self.pre_tokenizer = source, pre
        self.tokens, self.token_types = tokens, types
        self.bos_token_id = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id = metadata.get("tokenizer.ggml.eos_token_id")
        self.pad_token_id = metadata.get("tokenizer.ggml.padding_token_id")
        self.unk_token_id = metadata.get("tokenizer.ggml.unknown_token_id")
        ends = ("eos", "eot", "eom")  # llama.cpp ends a generation at any of them
        named = (metadata.get(f"tokenizer.ggml.{end}_token_id") for end in ends)
        self.end_token_ids = tuple(sorted({i for i in named if i is not None}))
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", pre in WHOLE_PIECES))
        self.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self._to_byte = {char: byte for byte, char in byte_alphabet().items()}
        self.special_ids = frozenset(i for i, kind in enumerate(types) if kind == CONTROL)
        self._backend = self._build(tokens, types, merges, pre)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], source: str = "GGUF") -> GGUFTokenizer:
        """The tokenizer of a file whose metadata (gguf_metadata(path)) is `metadata`."""
        return cls(metadata, source)

    def _spelled(self, token: str) -> bool:
        """Whether `token` is written in the byte alphabet, as every BPE entry of a byte-level
        vocabulary is. Control and user-defined tokens may be written otherwise
        (DeepSeek's "<｜User｜>"): they match the raw text, as transformers' added tokens."""
        return all(char in self._to_byte for char in token)

    def _build(self, tokens: list[str], types: list[int], merges: list[str], pre: str):
        tk = _tokenizers()
        alphabet = byte_alphabet()
        vocab = {}
        for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
            spelled = (
                token
                if kind in (CONTROL, USER_DEFINED) or self._spelled(token)
                else "".join(alphabet[b] for b in token.encode("utf-8"))
            )
            vocab.setdefault(spelled, index)
        pairs = self._merge_pairs(merges, vocab)
        model = tk.models.BPE(vocab, pairs, ignore_merges=pre in WHOLE_PIECES)
        backend = tk.Tokenizer(model)
        split = PRE_TOKENIZERS[pre]
        gpt2_regex = split in ("gpt2", "digits")  # else our Split has cut the text already
        byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex)
        if split == "gpt2":
            backend.pre_tokenizer = byte_level
        elif split == "digits":
            backend.pre_tokenizer = tk.pre_tokenizers.Sequence(
                [tk.pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            isolate = tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated")
            backend.pre_tokenizer = tk.pre_tokenizers.Sequence([isolate, byte_level])
        backend.decoder = tk.decoders.ByteLevel()  # (a saved tokenizer.json decodes too)
        specials = [tokens[i] for i in sorted(self.special_ids)]
        backend.add_special_tokens(
            [tk.AddedToken(t, special=True, normalized=False) for t in specials]
        )
        user = [token for token, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED]
        backend.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t in user])
        return backend

    def _merge_pairs(self, merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
        """The merges as (left, right) pairs, each side and their join a token: tokenizers
        panics (a BaseException, not an Exception) on a merge that breaks this."""
        pairs = []
        for rank, merge in enumerate(merges):
            left, space, right = merge.partition(" ")
            if not (space and left in vocab and right in vocab and left + right in vocab):
                raise ValueError(
                    f"{self.source}: merge {rank} ({merge!r}, tokenizer.ggml.merges) is not two "
                    "tokens of the vocabulary, separated by one space, whose join is a token: "
                    "a damaged GGUF file; download or convert it again"
                )
            pairs.append((left, right))
        return pairs

    def __len__(self) -> int:
        return len(self.tokens)

    def token(self, token_id: int) -> str:
        """The text of one special token, or a token's byte-alphabet spelling."""
        return self.tokens[token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their ids. With
        add_special_tokens, BOS/EOS are added where the file's add_bos/eos_token say so."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}; decode bytes first")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids: their bytes (token_bytes) joined, so decode and stream
        agree; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        skip = self.special_ids if skip_special_tokens else ()
        data = b"".join(self.token_bytes(i) for i in map(int, ids) if i not in skip)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text in UTF-8)."""
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is out of range [0, {len(self.tokens)})")
        token = self.tokens[token_id]
        written = self.token_types[token_id] in (CONTROL, USER_DEFINED)  # as their text
        if written or not self._spelled(token):
            return token.encode("utf-8")
        return bytes(self._to_byte[char] for char in token)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """An incremental decoder for text generated one token at a time."""
        return StreamDecoder(self, skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt the file's chat template (tokenizer.chat_template) makes of `messages`,
        rendered as transformers' apply_chat_template(tokenize=False) renders it."""
        from .chat_template import render_chat

        if not self.chat_template:
            raise ValueError(
                f"{self.source}: the file has no tokenizer.chat_template; pass messages through "
                "mhsa.formats.chat_template.render_chat with a template of your own"
            )
        names = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        tokens = {key: self.tokens[i] for key, i in names.items() if i is not None}
        return render_chat(
            self.chat_template, messages, add_generation_prompt, **{**tokens, **variables}
        )


class StreamDecoder:
    """Text of a growing token sequence, piece by piece: `push(id)` returns the text that
    token completes (possibly "" while a multi-byte character is still cut), `flush()` the
    rest at the end. The pieces join to decode(ids), so a chat can print them as they come."""

    def __init__(self, tokenizer: GGUFTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by one more token."""
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """What is left at the end (U+FFFD for a character the tokens left unfinished)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
