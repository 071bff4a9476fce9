"""`mhsa bench SUITE`: each suite takes only its own options, and passes them on."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mhsa.benchmarks.placement import CPU, Placement
from mhsa.cli import build_parser, main


def _suites() -> dict[str, argparse.ArgumentParser]:
    bench = next(
        action.choices["bench"]
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    return next(
        action.choices
        for action in bench._actions
        if isinstance(action, argparse._SubParsersAction)
    )


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _other_options() -> list[tuple[str, str, list[str]]]:
    """(suite, another suite's option it lacks, that option with a valid value)."""
    suites = {name: _options(parser) for name, parser in _suites().items()}
    cases = {}
    for name, own in suites.items():
        for other in suites.values():
            for flag, action in other.items():
                if flag in own or (name, flag) in cases:
                    continue
                value = [] if action.nargs == 0 else [str((action.choices or ["1"])[-1])]
                cases[(name, flag)] = [flag, *value]
    return [(name, flag, argv) for (name, flag), argv in cases.items()]


def test_every_suite_has_its_own_options():
    suites = {name: set(_options(parser)) for name, parser in _suites().items()}
    assert set(suites) == {
        "attention",
        "sparse",
        "generate",
        "ring",
        "transcribe",
        "scores",
        "chat",
        "serve",
        "hf",
        "flex",
        "moba",
        "varlen",
    }
    assert {"--nproc", "--load", "--quantize", "--plot"} <= set().union(*suites.values())
    assert len(_other_options()) >= 40


@pytest.mark.parametrize(("suite", "flag", "argv"), _other_options())
def test_every_suite_rejects_another_suites_option(suite, flag, argv, capsys):
    """`mhsa bench ring --load chat` is argparse's error (exit 2), not silently ignored."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", suite, *argv])
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {' '.join(argv)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["ring", "--nproc", "4"],
        ["sparse", "--plot", "out.png", "--quick", "--json"],
        ["serve", "--load", "long-prompts", "--threads", "2", "--quantize", "int8"],
        ["scores", "--length", "16384", "--repeat", "2"],
        ["attention", "--long", "--heads", "4", "--head-dim", "32", "--no-memory"],
        ["transcribe", "--file", "a.wav", "--repeat", "1", "--threads", "2"],
        ["chat", "--quick", "--repeat", "1"],
        ["generate", "--threads", "1", "--repeat", "2"],
        ["flex", "--length", "512", "--heads", "4", "--repeat", "1", "--quick"],
    ],
)
def test_each_suites_own_options_parse(argv):
    args = build_parser().parse_args(["bench", *argv])
    assert args.suite == argv[0] and callable(args.run)


def test_bench_needs_a_suite(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: SUITE" in capsys.readouterr().err


def test_attention_quick_is_a_small_run_without_memory_cases(capsys, monkeypatch):
    """--quick reaches the benchmark (issue 35: it was ignored, and a "smoke run" took 6
    minutes and 3.4 GiB): L=S=512 and no memory case (each would start a process)."""

    def no_memory_case(*args, **kwargs):
        raise AssertionError("--quick measured a memory case")

    monkeypatch.setattr("mhsa.benchmarks.attention.measure_in_subprocess", no_memory_case)
    assert main(["bench", "attention", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {row["shape"] for row in result["timing"]} == {"B=1 H=8 L=S=512 D=64"}
    assert result["memory"] == []


def test_serve_passes_load_to_the_benchmark(capsys, monkeypatch):
    """--load reaches serve.run (issue 35: it never did, so `--load long-prompts` measured
    the chat load). The server is not started: the benchmark's run is replaced by one
    that records its arguments and fails as a server that did not start."""
    seen = []

    def no_server(**options):
        seen.append(options)
        raise RuntimeError("the server did not start")

    monkeypatch.setattr("mhsa.benchmarks.serve.run", no_server)
    argv = ["bench", "serve", "--load", "long-prompts", "--threads", "1", "--quantize", "int8"]
    with pytest.raises(SystemExit, match="the server did not start"):
        main(argv)
    assert seen == [
        {
            "model": None,
            "quick": False,
            "threads": 1,
            "quantize": "int8",
            "load": "long-prompts",
            "draft_tokens": 4,
            "clients": None,
            "serial_requests": None,
            "throughput_only": False,
        }
    ]
    seen.clear()
    with pytest.raises(SystemExit, match="the server did not start"):
        main([*argv, "--device", "cpu", "--dtype", "float32"])
    assert seen[0]["device"] == "cpu" and seen[0]["dtype"] == "float32"  # the servers' flags
    with pytest.raises(SystemExit, match="the server did not start"):
        main([*argv, "--clients", "64", "--serial-requests", "16", "--throughput-only"])
    assert (seen[1]["clients"], seen[1]["serial_requests"], seen[1]["throughput_only"]) == (
        64,
        16,
        True,
    )
    seen[1:] = []
    assert main([*argv, "--device", "cuda:7"]) == 2  # refused before any server starts
    assert len(seen) == 1 and "--device cuda:7" in capsys.readouterr().err


def test_every_suite_takes_threads_and_chat_and_ring_pass_them_on(capsys, monkeypatch):
    assert all("--threads" in _options(parser) for parser in _suites().values())
    seen = {}

    def record(name):
        def run(**kwargs):
            seen[name] = kwargs
            return {}

        return run

    monkeypatch.setattr("mhsa.benchmarks.chat.run", record("chat"))
    monkeypatch.setattr("mhsa.benchmarks.ring.run", record("ring"))
    for name in ("chat", "ring"):
        monkeypatch.setattr(f"mhsa.benchmarks.{name}.report", lambda result: "")
    assert main(["bench", "chat", "--threads", "1", "--json"]) == 0
    assert main(["bench", "ring", "--threads", "2", "--nproc", "2", "--json"]) == 0
    assert seen["chat"]["threads"] == 1 and seen["ring"] == {
        "nproc": 2,
        "repeat": 2,
        "quick": False,
        "threads": 2,
    }

    # the in-process suites run under --threads (flex once ran at torch's default)
    import torch

    for name in ("attention", "sparse", "scores", "moba", "hf", "flex", "varlen", "generate"):
        monkeypatch.setattr(
            f"mhsa.benchmarks.{name}.run", lambda **kwargs: {"threads": torch.get_num_threads()}
        )
        monkeypatch.setattr(f"mhsa.benchmarks.{name}.report", lambda result: "")
        want = 1 if torch.get_num_threads() > 1 else 2
        assert main(["bench", name, "--threads", str(want), "--json"]) == 0
        assert f'"threads": {want}' in capsys.readouterr().out, name


def test_hf_passes_its_options_to_the_benchmark(capsys, monkeypatch):
    seen = []

    def record(**options):
        seen.append(options)
        return {}

    monkeypatch.setattr("mhsa.benchmarks.hf.run", record)
    monkeypatch.setattr("mhsa.benchmarks.hf.report", lambda result: "report")
    assert main(["bench", "hf", "--quick", "--repeat", "3"]) == 0
    assert main(["bench", "hf", "--json"]) == 0
    assert main(["bench", "hf", "--device", "cpu", "--dtype", "bf16"]) == 0
    assert seen == [
        {"quick": True, "repeat": 3, "on": CPU},
        {"quick": False, "repeat": 2, "on": CPU},
        {"quick": False, "repeat": 2, "on": Placement("cpu", torch.bfloat16)},
    ]


def test_flex_passes_its_options_to_the_benchmark(capsys, monkeypatch):
    seen = []

    def record(**options):
        seen.append(options)
        return {"cases": []}

    monkeypatch.setattr("mhsa.benchmarks.flex.run", record)
    assert main(["bench", "flex", "--length", "512", "--heads", "4", "--repeat", "2"]) == 0
    assert main(["bench", "flex", "--quick", "--json"]) == 0
    assert main(["bench", "flex", "--quick", "--length", "1024", "--repeat", "2"]) == 0
    assert seen == [  # (None: run's own default, which --quick makes small)
        {"length": 512, "heads": 4, "repeat": 2, "quick": False, "on": CPU},
        {"length": None, "heads": 8, "repeat": None, "quick": True, "on": CPU},
        {"length": 1024, "heads": 8, "repeat": 2, "quick": True, "on": CPU},
    ]
    assert "mhsa.flex.flex_attention vs torch's flex_attention" in capsys.readouterr().out


def test_explicit_sizes_win_over_quick_and_serve_options_are_checked_first(monkeypatch, capsys):
    """bench moba --quick --length 2048 once ran L=1024; bench serve --quantize garbage
    and --draft-tokens 0 were found by the server it started, 30 s in."""
    from mhsa.benchmarks import moba

    seen = []
    monkeypatch.setattr(moba, "run", lambda **options: seen.append(options) or {"cases": []})
    monkeypatch.setattr(moba, "report", lambda result: "")
    assert main(["bench", "moba", "--quick", "--length", "2048", "--heads", "1", "--json"]) == 0
    assert (seen[0]["length"], seen[0]["block_size"], seen[0]["heads"]) == (2048, None, 1)
    monkeypatch.undo()  # (the real run checks --top-k before any timing)
    assert main(["bench", "moba", "--quick", "--top-k", "10"]) == 2
    assert "mhsa bench: --top-k must be an int in 1..8" in capsys.readouterr().err
    assert main(["bench", "serve", "--quick", "--clients", "0"]) == 2
    assert "mhsa bench: --clients must be an int >= 1, got 0" in capsys.readouterr().err
    for bad in (["--quantize", "garbage"], ["--draft-tokens", "0"]):
        with pytest.raises(SystemExit) as caught:
            main(["bench", "serve", *bad])
        assert caught.value.code == 2
