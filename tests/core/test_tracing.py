"""Importing mhsa does not import torch._dynamo (seconds of start-up for `mhsa --help`),
and the mark that replaces torch's decorator at import time is the one torch sets."""

from __future__ import annotations

import subprocess
import sys

import torch

from mhsa.core.tracing import constant_when_traced


def test_the_mark_is_the_one_torch_sets():
    def ours():
        return 1

    def torchs():
        return 1

    assert constant_when_traced(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) and vars(ours)


def test_a_fresh_interpreter_importing_mhsa_and_its_command_has_no_dynamo():
    code = (
        "import sys\n"
        "import mhsa\n"
        "mhsa.attention, mhsa.backends()  # every public name loaded\n"
        "from mhsa.cli import build_parser\n"
        "build_parser().format_help()\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert ran.stdout.strip() == "[]", ran.stdout


def test_a_compiled_call_still_takes_the_constant_path():
    """The marked functions run once while tracing: one graph, equal to eager."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    from mhsa import attention

    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), attention(q, k, v, causal=True))
