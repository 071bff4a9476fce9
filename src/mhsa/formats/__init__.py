"""Readers for other libraries' weight files, into name -> torch tensor dicts."""

from .ctranslate2 import ctranslate2_header, read_ctranslate2

__all__ = ["ctranslate2_header", "read_ctranslate2"]
