"""gpu_band_report: a band.jsonl read back into failed checks, the switches a run
supports turning on and the launch configs that beat the defaults, from rows named as
gpu_band names them."""

from __future__ import annotations

import json

import torch

from mhsa.benchmarks import gpu_band_report as report
from mhsa.benchmarks.gpu_band import BACKWARD_DEFAULTS, _forward_calls
from mhsa.benchmarks.gpu_band_calls import _inputs


def _forward_rows(times: dict[str, float]) -> list[dict]:
    """sweep_forward rows for causal and dense under gpu_band's own config names: each
    plain config 2.0 ms (the default, (128, 64, 8, 3), 1.9), variants as `times` says
    by suffix (unnamed: 2.0)."""
    qkv = _inputs((1, 2, 16, 8), 2, torch.float32, "cpu")
    rows = []
    for case, causal in (("causal", True), ("dense", False)):
        for name in _forward_calls(qkv, None, causal):
            suffix = report.CONFIG.match(name)["rest"]
            ms = times.get(suffix, 1.9 if name == "(128, 64, 8, 3)" else 2.0)
            rows.append(dict(section="sweep_forward", case=case, dim=128, config=name, ms=ms))
    return rows


def test_a_switch_is_proposed_where_its_variant_wins_every_case_and_its_checks_pass():
    rows = _forward_rows({" ahead": 1.7, " tma": 1.88, " last first": 1.8})
    rows += [
        dict(section="sweep_backward", config=BACKWARD_DEFAULTS, ms=10.0),
        dict(section="sweep_backward", config=f"{BACKWARD_DEFAULTS}, last first", ms=9.5),
        dict(section="sweep_backward", config="dkv+dq (64, 128, 8, 3)", ms=10.5),
        dict(section="sweep_backward", config="dkv+dq (64, 128, 8, 2)", ms=11.0),
        dict(section="check_ahead", case="causal", dim=128, same_bits=True),
        dict(section="check_last_first", case="causal", dim=128, same_bits=True),
    ]
    lines = {line.split(":")[0]: line for line in report.proposals(rows)}
    assert lines["FORWARD_AHEAD"].startswith("FORWARD_AHEAD: turn on (causal D=128 fwd")
    assert "(128, 64, 8, 3) against (128, 64, 8, 3) 0.895x" in lines["FORWARD_AHEAD"]
    assert lines["USE_TMA"].startswith("USE_TMA: keep off")  # 1.88 / 1.9: 1% faster
    assert lines["LAST_FIRST"].startswith("LAST_FIRST: turn on")
    assert "causal backward dq and dkv, defaults, last first 0.950x" in lines["LAST_FIRST"]
    assert lines["DQ_IN_DKV"] == (
        "DQ_IN_DKV: keep off (causal backward dkv+dq (64, 128, 8, 3) 1.050x)"
    )
    assert lines["TILES_AHEAD"] == "TILES_AHEAD: not timed"
    rows.append(dict(section="check_last_first", case="window", dim=64, skipped="OutOfResources"))
    lines = {line.split(":")[0]: line for line in report.proposals(rows)}
    assert lines["LAST_FIRST"].startswith("LAST_FIRST: keep off, its checks failed")


def test_the_report_names_failed_checks_and_configs_that_beat_the_default(tmp_path):
    rows = [dict(section="header", gpu="NVIDIA H200", torch="2.11", matmul_tflops=780.0)]
    rows += _forward_rows({})
    rows[5]["ms"] = 1.5  # a plain config faster than the default
    rows += [
        dict(section="check", case="dense", dim=64, skipped="RuntimeError: PassManager"),
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
    path = tmp_path / "band.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"section": "cut')
    text = report.report(report.read_rows(path))
    assert text.startswith("# gpu_band: NVIDIA H200, torch 2.11, matmul 780 TFLOP/s")
    assert "- check dense D=64: RuntimeError: PassManager" in text
    assert "- check_ahead window torch.bfloat16 D=128: not the plain kernel's bits (0.5)" in text
    assert "FORWARD_AHEAD: keep off, its checks failed (check_ahead)" in text
    best = rows[5]["config"]
    assert f"- forward causal D=128: best {best} 1.500 ms, default (128, 64, 8, 3) 1.900 ms" in text
    assert "- alibi fwd: 1.20x plain (met: <= 1.3x)" in text
    assert "- alibi, ahead fwd+bwd: 1.40x plain (missed: <= 1.3x)" in text
    assert "- window 512 band backward: 1.000 ms (host 0.200 ms)" in text
    assert "- window 512 / causal, fwd+bwd: 0.38x (met: <= 0.5x)" in text
    assert (
        "- triton fwd: 3.000 ms (host 0.300 ms), 1.200x the time without isolate_nonfinite"
    ) in text
