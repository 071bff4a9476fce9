"""`mhsa info` gives each backend's true reason once: a backend that refuses every call
here for one reason says so on one line, not once per kind of call."""

from __future__ import annotations

from mhsa.cli import main


def test_a_backend_refused_for_one_reason_says_it_once(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ring = [line for line in lines if "context_parallel" in line]
    assert len(ring) == 1 and ring[0].split()[:4] == ["ring", "not", "used", "here:"], ring
    if not any(line.split()[:2] == ["flex", "usable"] for line in lines):  # not on CUDA
        flex = [line for line in lines if "FlexAttention has no backward" in line]
        assert len(flex) == 1 and flex[0].split()[0] == "flex", flex
    assert not any("not for return_lse: used on CUDA only" in line for line in lines)
