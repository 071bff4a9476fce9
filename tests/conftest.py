"""Shared fixtures. Triton runs in its CPU interpreter in every test file: the switch is
read when triton is first imported, so it is set here, once, before any test module
is imported (never in a test file, where it would depend on collection order)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
