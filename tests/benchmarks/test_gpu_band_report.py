"""gpu_band_report: a band.jsonl read back into failed checks, the switches a run
supports turning on and the launch configs that beat the defaults, from rows named as
gpu_band names them."""

from __future__ import annotations

import json

import torch

from mhsa.benchmarks import gpu_band_report as report
from mhsa.benchmarks.gpu_band import (
    ATOMIC_DQ,
    BACKWARD_DEFAULTS,
    BACKWARD_LAST_FIRST,
    _forward_calls,
)
from mhsa.benchmarks.gpu_band_calls import _inputs
from mhsa.core.kernels.triton.band_launch import CONFIGS


def _forward_rows(times: dict[str, float], dense: dict[str, float] | None = None) -> list[dict]:
    """sweep_forward rows for causal and dense under gpu_band's own config names: each
    plain config 2.0 ms (the default, (128, 64, 8, 3), 1.9), variants as `times` says by
    suffix (dense: as `dense` says where given; unnamed: 2.0)."""
    qkv = _inputs((1, 2, 16, 8), 2, torch.float32, "cpu")
    rows = []
    for case, causal in (("causal", True), ("dense", False)):
        chosen = times if case == "causal" or dense is None else dense
        for name in _forward_calls(qkv, None, causal):
            suffix = report.CONFIG.match(name)["rest"]
            ms = chosen.get(suffix, 1.9 if name == "(128, 64, 8, 3)" else 2.0)
            rows.append(dict(section="sweep_forward", case=case, dim=128, config=name, ms=ms))
    return rows


def test_a_switch_is_proposed_where_its_variant_wins_at_the_defaults_and_its_checks_pass():
    variants = {" ahead": 1.7, " tma": 1.88, " last first": 1.8}
    # dense's query blocks are all alike: last first gains nothing there, and is not
    # judged there; a faster variant at another config does not count
    rows = _forward_rows(variants, dense={**variants, " last first": 1.9})
    rows.append(
        dict(section="sweep_forward", case="causal", dim=128, ms=1.0, config="(128, 64, 8, 4) tma")
    )
    atomic_default = f"{ATOMIC_DQ} {CONFIGS[ATOMIC_DQ][(True, 128)]}"
    rows += [
        dict(section="sweep_backward", config=BACKWARD_DEFAULTS, ms=10.0),
        dict(section="sweep_backward", config=BACKWARD_LAST_FIRST, ms=9.5),
        dict(section="sweep_backward", config=atomic_default, ms=10.5),
        dict(section="sweep_backward", config=f"{ATOMIC_DQ} (32, 128, 8, 3)", ms=5.0),
        dict(section="check_ahead", case="causal", dim=128, same_bits=True),
        dict(section="check_last_first", case="causal", dim=128, same_bits=True),
        dict(section="check_dq_last_first", case="causal", dim=128, same_bits=True),
        dict(section="check_dq_atomic", case="causal", dim=128, max_differences=[0.01] * 3),
    ]
    lines = {line.split(":")[0]: line for line in report.proposals(rows)}
    assert lines["FORWARD_AHEAD"] == (
        "FORWARD_AHEAD: turn on (causal D=128 fwd (128, 64, 8, 3) 0.895x, "
        "dense D=128 fwd (128, 64, 8, 3) 0.895x)"
    )
    assert lines["USE_TMA"].startswith("USE_TMA: keep off, check_tma did not run; causal")
    assert "causal D=128 fwd (128, 64, 8, 3) 0.989x" in lines["USE_TMA"]
    assert lines["LAST_FIRST"] == (
        "LAST_FIRST: turn on (causal D=128 fwd (128, 64, 8, 3) 0.947x, "
        "causal backward dq and dkv, defaults, last first 0.950x)"
    )
    assert lines["DQ_IN_DKV"] == (f"DQ_IN_DKV: keep off (causal backward {atomic_default} 1.050x)")
    assert lines["TILES_AHEAD"] == "TILES_AHEAD: not timed"
    rows.append(dict(section="check_last_first", case="window", dim=64, skipped="OutOfResources"))
    lines = {line.split(":")[0]: line for line in report.proposals(rows)}
    assert lines["LAST_FIRST"].startswith("LAST_FIRST: keep off, check_last_first failed; ")
    rows = [row for row in rows if row["section"] != "check_dq_last_first"]
    rows = [row for row in rows if row.get("skipped") is None]
    lines = {line.split(":")[0]: line for line in report.proposals(rows)}
    assert lines["LAST_FIRST"].startswith("LAST_FIRST: keep off, check_dq_last_first did not run")


def test_the_report_names_failed_checks_and_configs_that_beat_the_default(tmp_path):
    rows = [dict(section="header", gpu="NVIDIA H200", torch="2.11", matmul_tflops=780.0)]
    rows += _forward_rows({})
    rows[5]["ms"] = 1.5  # a plain config faster than the default
    rows += [
        dict(section="check", case="dense", dim=64, skipped="RuntimeError: PassManager"),
        dict(
            section="check",
            case="causal",
            dtype="torch.bfloat16",
            dim=128,
            max_errors=[0.002, 0.003, 0.08, 0.002],
        ),
        dict(
            section="check",
            case="causal",
            dtype="torch.float32",
            dim=64,
            max_errors=[6e-6, 6e-6, 6e-6, 6e-6],
        ),
        dict(
            section="check_ahead",
            case="window",
            dtype="torch.bfloat16",
            dim=128,
            same_bits=False,
            max_difference=0.5,
        ),
        dict(section="scores", score="alibi", backward=False, vs_plain=1.2, ms=1.0),
        dict(section="scores", score="alibi, ahead", backward=True, vs_plain=1.4, ms=1.0),
        dict(section="hf_shape", what="causal band forward", ms=1.0, host_ms=0.1),
        dict(section="hf_shape", what="causal band backward", ms=3.0, host_ms=0.2),
        dict(section="hf_shape", what="window 512 band forward", ms=0.5, host_ms=0.1),
        dict(section="hf_shape", what="window 512 band backward", ms=1.0, host_ms=0.2),
        dict(section="dispatch", what="triton", backward=False, ms=3.0, host_ms=0.3),
        dict(
            section="dispatch",
            what="triton, isolate_nonfinite=False",
            backward=False,
            ms=2.5,
            host_ms=0.1,
        ),
    ]
    # a later invocation's header, its matmul timed while other work shared the GPU
    rows.append(dict(section="header", gpu="NVIDIA H200", torch="2.11", matmul_tflops=500.0))
    path = tmp_path / "band.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"section": "cut')
    text = report.report(report.read_rows(path))
    assert text.startswith("# gpu_band: NVIDIA H200, torch 2.11, matmul 780 TFLOP/s")
    assert "- check dense D=64: RuntimeError: PassManager" in text
    assert "- check causal torch.bfloat16 D=128: max error 0.08 > 0.05 (out, dq" in text
    assert "torch.float32 D=64" not in text
    assert "- check_ahead window torch.bfloat16 D=128: not the plain kernel's bits (0.5)" in text
    assert "FORWARD_AHEAD: keep off, check_ahead failed; causal D=128" in text
    best = rows[5]["config"]
    assert f"- forward causal D=128: best {best} 1.500 ms, default (128, 64, 8, 3) 1.900 ms" in text
    assert "- alibi fwd: 1.20x plain (met: <= 1.3x)" in text
    assert "- alibi, ahead fwd+bwd: 1.40x plain (missed: <= 1.3x)" in text
    assert "- window 512 band backward: 1.000 ms (host 0.200 ms)" in text
    assert "- window 512 / causal, fwd+bwd: 0.38x (met: <= 0.5x)" in text
    assert (
        "- triton fwd: 3.000 ms (host 0.300 ms), 1.200x the time without isolate_nonfinite"
    ) in text
