"""Readers for other libraries' weight files, into name -> torch tensor dicts.

GGUF needs the gguf package (tokenizers and jinja2 for its tokenizer and chat template);
they are imported when a file is read, so importing this package needs none of them.
"""

from .chat_template import render_chat
from .ctranslate2 import ctranslate2_header, read_ctranslate2
from .gguf import GGUFModel, RawTensor, gguf_metadata, read_gguf, read_gguf_tokenizer
from .gguf_tokenizer import GGUFTokenizer, StreamDecoder

__all__ = [
    "GGUFModel",
    "GGUFTokenizer",
    "RawTensor",
    "StreamDecoder",
    "ctranslate2_header",
    "gguf_metadata",
    "read_ctranslate2",
    "read_gguf",
    "read_gguf_tokenizer",
    "render_chat",
]
