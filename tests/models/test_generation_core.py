"""One generation core: every decoding loop drives the Decoder interface
(mhsa.models.decoder) and takes its next token and stop decision from the one
sample_and_stop (mhsa.models.sampling); GPT, Llama and the decoders of Whisper and
Seq2Seq implement the interface, and their prefill + step equal the full forward."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mhsa.models import GPT, GPTConfig, Llama, LlamaConfig, Seq2Seq, Seq2SeqConfig
from mhsa.models.decoder import CacheLayout, Decoder
from mhsa.models.sampling import (
    GREEDY,
    Sampling,
    StopRule,
    sample_and_stop,
    sample_and_stop_rows,
)
from mhsa.models.seq2seq import Seq2SeqDecoder
from mhsa.models.whisper import Whisper, WhisperConfig, WhisperTextDecoder

SOURCE = Path(__file__).resolve().parents[2] / "src" / "mhsa"
# each decoding loop, and what it must call for its tokens and stops
LOOPS = {
    "models/decoding.py": "token_loop(",  # generate, greedy_search
    "models/speculative.py": "token_loop(",  # speculative_decode (generate's, chat's)
    "apps/chat.py": "token_loop(",  # ChatModel.reply, compiled
    "apps/serve/runner.py": "sample_and_stop_rows(",  # the server: each row its own rule
    "models/beam_search.py": "StopRule(",  # ranks by log-prob: no sampling to share
    "apps/serve/engine.py": "runner.run(",  # applies the runner's choices
}
# the only callers of the per-token decision: the one token loop and the server's runner
DECIDERS = ["apps/serve/runner.py", "models/sampling.py"]
# where a drafting model may choose its draft tokens itself (they are only proposals)
DRAFTERS = {"models/speculative.py": "DraftModel"}
# what only models/sampling.py may do: choose tokens, test stop tokens
OWN_CHOICES = re.compile(r"multinomial\(|\.argmax\(|torch\.isin\(|in self\.stop_ids|== eos")


def test_sampling_and_stopping_are_defined_once():
    definitions = re.compile(
        r"^(def (sample|sample_and_stop|check_sampling)\(|class StopRule\b)", re.MULTILINE
    )
    found = {}
    for path in SOURCE.rglob("*.py"):
        for match in definitions.finditer(path.read_text()):
            found.setdefault(match[1], []).append(str(path.relative_to(SOURCE)))
    assert found and all(files == ["models/sampling.py"] for files in found.values()), found


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_every_decoding_loop_uses_the_one_decision(loop):
    text = (SOURCE / loop).read_text()
    assert LOOPS[loop] in text
    if loop in DRAFTERS:  # a draft model's own choices are proposals, not tokens
        text = text[: text.index(f"class {DRAFTERS[loop]}")]
    assert not OWN_CHOICES.findall(text)


def test_one_token_loop_asks_for_every_decision():
    """Only the token loop (models/sampling.py) and the server's batched runner ask
    sample_and_stop or accept_draft for a token: every other loop drives token_loop."""
    call = re.compile(r"^(?!\s*def ).*\b(sample_and_stop|accept_draft)\(", re.MULTILINE)
    callers = sorted(
        str(path.relative_to(SOURCE))
        for path in SOURCE.rglob("*.py")
        if call.search(path.read_text())
    )
    assert callers == DECIDERS


def test_the_engine_asks_the_model_for_its_cache_layout():
    engine = (SOURCE / "apps" / "serve" / "engine.py").read_text()
    assert "hasattr" not in engine and "model.cache_layout" in engine


def test_sample_and_stop_decides_tokens_stops_and_the_length():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    choice = sample_and_stop(logits, GREEDY, StopRule([0], max_tokens=3), generated=1)
    assert choice.tokens.tolist() == [1, 0] and choice.stopped.tolist() == [False, True]
    assert not choice.last
    assert sample_and_stop(logits, GREEDY, StopRule([0], 3), generated=2).last
    free = sample_and_stop(logits, GREEDY, StopRule(), generated=100)
    assert free.stopped is None and not free.last
    generator = torch.Generator().manual_seed(0)
    hot = sample_and_stop(
        logits.repeat(500, 1),
        Sampling(temperature=1.0, top_k=1),
        StopRule(),
        generated=0,
        generator=generator,
    )
    assert hot.tokens.view(500, 2).eq(torch.tensor([1, 0])).all()  # top_k 1 is greedy
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        Sampling(temperature=-1.0)


def test_sample_and_stop_rows_gives_each_rows_own_decision():
    """The server's batched decision equals sample_and_stop row by row (greedy rows drawn
    together, sampled ones with their own generators), with tokens on the host."""
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    hot = Sampling(temperature=0.8, top_p=0.9)
    rules = [
        (GREEDY, StopRule([int(logits[0].argmax())], 9), 0),  # stops at once
        (hot, StopRule([3], 4), 3),  # its last allowed token
        (GREEDY, StopRule(), 2),
        (hot, StopRule([1, 2], 9), 0),
        (GREEDY, StopRule([7], 9), 5),
    ]
    seeded = [(*rule, torch.Generator().manual_seed(row)) for row, rule in enumerate(rules)]
    got = sample_and_stop_rows(logits, seeded)
    for row, ((sampling, stop, made), choice) in enumerate(zip(rules, got, strict=True)):
        want = sample_and_stop(
            logits[row : row + 1],
            sampling,
            stop,
            generated=made,
            generator=torch.Generator().manual_seed(row),
        )
        assert choice.tokens.device.type == "cpu" and torch.equal(choice.tokens, want.tokens)
        assert choice.finish_reason() == want.finish_reason(), row
    assert [c.finish_reason() for c in got][:2] == ["stop", "length"]
    assert sample_and_stop_rows(logits[:0], []) == []


def _decoders():
    torch.manual_seed(0)
    gpt = (
        GPT(GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_len=32))
        .double()
        .eval()
    )
    yield (
        "gpt",
        gpt,
        lambda tokens: gpt(tokens)[:, -1],
        CacheLayout(2, 2, 8, torch.float64, torch.device("cpu")),
    )
    llama = (
        Llama(
            LlamaConfig(
                vocab_size=40, n_layer=3, n_head=4, n_kv_head=1, d_model=32, head_dim=16, d_ff=48
            )
        )
        .double()
        .eval()
    )
    yield (
        "llama",
        llama,
        lambda tokens: llama(tokens)[:, -1],
        CacheLayout(3, 1, 16, torch.float64, torch.device("cpu")),
    )
    config = WhisperConfig(
        n_mels=8,
        n_audio_ctx=6,
        vocab_size=40,
        n_text_ctx=16,
        d_model=16,
        n_head=2,
        n_encoder_layer=1,
        n_decoder_layer=2,
        eot_id=30,
        prompt=(31, 32),
    )
    whisper = Whisper(config).double().eval()
    memory = whisper.encode(torch.randn(2, 8, 12, dtype=torch.float64))
    yield (
        "whisper",
        WhisperTextDecoder(whisper, memory),
        lambda tokens: whisper.logits(tokens, memory)[:, -1],
        CacheLayout(2, 2, 8, torch.float64, torch.device("cpu")),
    )
    seq2seq = (
        Seq2Seq(
            Seq2SeqConfig(
                src_vocab=40,
                tgt_vocab=40,
                d_model=16,
                n_head=2,
                n_encoder_layer=1,
                n_decoder_layer=2,
                dropout=0.0,
                max_len=16,
            )
        )
        .double()
        .eval()
    )
    source, padding = seq2seq.encode(torch.tensor([[5, 6, 7, 2], [4, 9, 2, 0]]))
    yield (
        "seq2seq",
        Seq2SeqDecoder(seq2seq, source, padding),
        lambda tokens: seq2seq.run_decoder(tokens, source, padding)[:, -1],
        CacheLayout(2, 2, 8, torch.float64, torch.device("cpu")),
    )


@pytest.mark.parametrize(
    "name, decoder, full, layout", list(_decoders()), ids=["gpt", "llama", "whisper", "seq2seq"]
)
@torch.no_grad()
def test_prefill_then_steps_equal_the_full_forward(name, decoder, full, layout):
    assert isinstance(decoder, Decoder) and decoder.cache_layout == layout
    tokens = torch.randint(3, 30, (2, 9), generator=torch.Generator().manual_seed(1))
    caches = decoder.make_caches(2, 9)
    got = [decoder.prefill(tokens[:, :5], caches)]
    got += [decoder.step(tokens[:, i : i + 1], caches) for i in range(5, 9)]
    for i, logits in enumerate(got, start=5):
        assert logits.shape == (2, 40)
        want = full(tokens[:, :i])
        if name == "whisper":  # its logits come with the suppressed tokens at -inf
            want = decoder.model.suppress(want, first=i == 5)
        torch.testing.assert_close(logits, want)
    torch.testing.assert_close(
        decoder.prefill(tokens, None),
        full(tokens) if name != "whisper" else decoder.model.suppress(full(tokens), first=True),
    )
