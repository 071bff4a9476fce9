"""The attention explorer's recording (mhsa.viz): uint8 rows, the heads asked for,
summaries and rollout, compared with mhsa.attention_weights."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import mhsa
from mhsa.checkpoint import save_checkpoint
from mhsa.models import GPT, GPTConfig
from mhsa.viz import dequantize_rows, gpt_source, quantize_rows, record
from mhsa.viz.html import ASSETS
from mhsa.viz.quantize import spread_rows
from mhsa.viz.recording import parse_heads, select_heads

ROOT = Path(__file__).resolve().parents[1]
TEXT = "attention is all you need"


# ---------------------------------------------------------------- helpers


def make_gpt(out: Path, *, layers: int = 2, heads: int = 3, d_model: int = 24,
             max_len: int = 64, sharpen: float = 8.0) -> GPT:  # fmt: skip
    """A random GPT saved as a `mhsa train gpt` checkpoint in out; its queries scaled by
    `sharpen` so that its heads look at a few keys, not evenly at all."""
    config = GPTConfig(vocab_size=256, n_layer=layers, n_head=heads, d_model=d_model,
                       max_len=max_len)  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.self_attn.q_proj.weight.mul_(sharpen)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    save_checkpoint(out, 1, model, info, {})
    return model


def layer_inputs(modules: list, run) -> list[tuple[tuple, dict]]:
    """Each module's (args, kwargs) when run() calls it (a plain forward-pre-hook)."""
    seen: list[tuple[tuple, dict]] = []
    hooks = [m.register_forward_pre_hook(lambda _, a, kw: seen.append((a, kw)), with_kwargs=True)
             for m in modules]  # fmt: skip
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = x.shape
    return x.view(batch, length, heads, width // heads).transpose(1, 2)


def weights_by_hand(module, x: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """(1, H, L, L) by mhsa.attention_weights from the module's own projections of x
    (no positions inside attention: learned GPT positions, BERT)."""
    with torch.no_grad():
        q = split_heads(module.q_proj(x), module.num_heads)
        k = split_heads(module.k_proj(x), module.num_kv_heads)
        return mhsa.attention_weights(q, k, causal=causal)


def exact_maps(modules: list, inputs: list, *, causal: bool) -> list[torch.Tensor]:
    """Every layer's (H, L, L) weights_by_hand from the inputs layer_inputs saw."""
    pairs = zip(modules, inputs, strict=True)
    return [weights_by_hand(m, args[0], causal=causal)[0] for m, (args, _) in pairs]


def rollout_of(maps: list[torch.Tensor]) -> torch.Tensor:
    """Attention rollout: (A + I) / 2 of the head-averaged maps, rows renormalised,
    chained from the first layer."""
    length = maps[0].shape[-1]
    rollout = torch.eye(length)
    for layer_map in maps:
        step = 0.5 * layer_map.mean(0) + 0.5 * torch.eye(length)
        rollout = (step / step.sum(-1, keepdim=True)) @ rollout
    return rollout


# ---------------------------------------------------------------- recording, no browser


def test_quantize_rows_is_within_half_a_level():
    probs = torch.softmax(torch.randn(3, 5, 40) * 3, dim=-1)
    probs[1, 2] = 0.0  # a row with no allowed key
    values, scales = quantize_rows(probs)
    assert values.dtype == torch.uint8 and scales.shape == (3, 5)
    assert (values.amax(-1)[probs.amax(-1) > 0] == 255).all() and scales[1, 2] == 0
    error = (dequantize_rows(values, scales) - probs).abs()
    assert (error <= probs.amax(-1, keepdim=True) / 510 + 1e-7).all()


def test_spread_rows_keeps_first_and_last():
    assert spread_rows(5, 10) == [0, 1, 2, 3, 4]
    rows = spread_rows(512, 256)
    assert len(rows) == 256 and rows[0] == 0 and rows[-1] == 511 and rows == sorted(set(rows))
    assert spread_rows(7, 1) == [6]


def test_heads_option():
    assert parse_heads(None) is None
    assert parse_heads("0, 2:1") == [(None, 0), (2, 1)]
    assert select_heads(parse_heads("1,0:0"), 2, 3) == [(0, 0), (0, 1), (1, 1)]
    with pytest.raises(ValueError, match="head 3 is out of range; the model has 3 heads"):
        select_heads(parse_heads("3"), 2, 3)
    with pytest.raises(ValueError, match="layer 2 is out of range"):
        select_heads(parse_heads("2:0"), 2, 3)
    with pytest.raises(ValueError, match="LAYER:HEAD pairs"):
        parse_heads("1-2")


@pytest.mark.parametrize("chunk_floats", [1 << 22, 40])  # all rows at once; 4 rows a block
def test_record_equals_attention_weights(tmp_path, monkeypatch, chunk_floats):
    import mhsa.viz.recording as recorder

    monkeypatch.setattr(recorder, "CHUNK_FLOATS", chunk_floats)
    model = make_gpt(tmp_path / "run")
    source = gpt_source(model, TEXT)
    rec = record(source, heads="1,0:2", max_rows=9)
    length = len(TEXT)
    assert rec.stored == [(0, 1), (0, 2), (1, 1)] and len(rec.rows) == 9
    modules = [block.self_attn for block in model.blocks]
    inputs = layer_inputs(modules, source.run)
    exact = exact_maps(modules, inputs, causal=True)
    for slot, (layer, head) in enumerate(rec.stored):
        want = exact[layer][head, rec.rows]
        got = dequantize_rows(rec.maps[slot], rec.map_scales[slot])
        assert (got - want).abs().max() <= want.max() / 510 + 1e-6
    # summaries from the exact maps: entropy in bits, distance, offset of the argmax
    probs = exact[1][2]
    entropy = torch.special.entr(probs).sum(-1).mean() / math.log(2)
    assert rec.stats["entropy"][1][2] == pytest.approx(float(entropy), rel=1e-4)
    gap = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).abs()
    distance = (probs * gap).sum(-1).mean()
    assert rec.stats["distance"][1][2] == pytest.approx(float(distance), rel=1e-4)
    assert rec.stats["first"][0][0] == pytest.approx(float(exact[0][0][:, 0].mean()), rel=1e-4)
    offsets = torch.arange(length) - probs.argmax(-1)
    top = torch.bincount(offsets).argmax()
    assert rec.stats["offset"][1][2] == int(top)
    assert rec.stats["offset_share"][1][2] == pytest.approx(float((offsets == top).float().mean()))
    assert rec.stats["shown"][0][0] is None  # every key is shown
    want = rollout_of(exact)[rec.rows]
    got = dequantize_rows(rec.rollout, rec.rollout_scales)
    assert (got - want).abs().max() <= want.max() / 510 + 1e-6
    assert rec.thumbs.shape == (2, 3, length, length)  # under 48 cells: one per token


def test_assets_ship_in_the_wheel():
    """Every file the page inlines matches the package data a wheel ships."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"\[tool\.setuptools\.package-data\]\s*mhsa = \[([^\]]*)\]", text)
    patterns = re.findall(r'"([^"]+)"', listed[1])
    for name in ASSETS:
        path = Path("viz/assets") / name
        assert (ROOT / "src/mhsa" / path).is_file()
        assert any(path.match(pattern) for pattern in patterns), f"{path} is not package data"
