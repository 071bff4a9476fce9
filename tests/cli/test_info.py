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


def test_info_lists_each_integration_and_whether_it_can_be_used(capsys):
    from mhsa.cli.info import INTEGRATIONS

    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("integrations (mhsa.integrations):")
    listed = {line.split()[0]: line for line in lines[start + 1 : start + 1 + len(INTEGRATIONS)]}
    assert set(listed) == set(INTEGRATIONS)
    for name, line in listed.items():
        module = __import__(f"mhsa.integrations.{name}", fromlist=["available"])
        usable, why = module.available()
        assert line.split()[1] == ("usable:" if usable else "unusable"), line
        assert why in line or usable
