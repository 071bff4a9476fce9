"""The `mhsa` command starts without torch: building the parser imports none of it, and
chat and serve say what they load before torch is imported (torch's import is most of
a start-up second)."""

from __future__ import annotations

import subprocess
import sys

import pytest

WATCH_TORCH = """
import importlib.abc, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            print("[torch imported]", file=sys.stderr, flush=True)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Watch())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_importing_mhsa_and_building_the_parser_imports_no_torch():
    ran = run_python(
        "import sys\n"
        "import mhsa\n"
        "from mhsa.cli import build_parser\n"
        "build_parser().format_help()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]", ran.stdout


@pytest.mark.parametrize("command", [["chat", "--prompt", "hi"], ["serve"]])
def test_chat_and_serve_say_what_they_load_before_torch_is_imported(tmp_path, command):
    missing = tmp_path / "missing.gguf"
    argv = [*command, "--model", str(missing)]
    ran = run_python(WATCH_TORCH + f"from mhsa.cli import main\nsys.exit(main({argv!r}))\n")
    lines = ran.stderr.splitlines()
    assert ran.returncode == 2, ran.stderr  # the missing file, after the first line
    assert lines[0] == f"loading {missing} ...", lines
    assert "[torch imported]" in lines[1:], lines
