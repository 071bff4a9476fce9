"""The continuous-batching engine (mhsa.apps.serve.engine) on tiny float64 models: every
request's greedy output equals running it alone, whatever joins or leaves; long prompts
are prefilled in chunks while others decode; admission waits for room in the pool;
prefix sharing, cancellation, stop tokens, the thread, and bad requests."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from mhsa.apps.serve import Engine
from mhsa.models.gpt import GPT, GPTConfig
from mhsa.models.llama import Llama, LlamaConfig

VOCAB = 64


def _llama():
    config = LlamaConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_len=512
    )
    return Llama(config)


def _gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, max_len=512, d_model=32, n_head=4, n_layer=2))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: a second thread only waits
    yield
    torch.set_num_threads(threads)


def _model(build):
    torch.manual_seed(0)
    return build().double().eval()


def _prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _alone(model, prompt, max_tokens):
    ids = torch.tensor([prompt])
    no_stop = [] if isinstance(model, Llama) else None  # (Llama's None is its config's)
    out = model.generate(ids, max_tokens, temperature=0, eos_token=no_stop)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["llama", "gpt"])
def test_outputs_equal_each_request_alone(build):
    model = _model(build)
    engine = Engine(
        model, context_length=512, num_blocks=64, block_size=16, max_batch=3, prefill_chunk=16
    )
    prompts = _prompts([5, 40, 17, 100, 3, 33, 64])
    counts = [10, 5, 20, 8, 12, 1, 16]
    outputs = engine.run(prompts, counts)
    for prompt, count, output in zip(prompts, counts, outputs, strict=True):
        assert output == _alone(model, prompt, count)
    assert engine.cache.used_blocks == 0 and engine.idle


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    engine = Engine(_model(_llama), context_length=512, num_blocks=64, prefill_chunk=16)
    short, long = _prompts([4, 100])
    running = engine.submit(short, 30)
    engine.step()  # short's prompt and first token
    waiting = engine.submit(long, 5)
    decoded_meanwhile = 0
    while waiting.first_token_at is None:
        before = len(running.output)
        engine.step()
        decoded_meanwhile += len(running.output) - before
    assert decoded_meanwhile == 7  # one token per step for its 7 chunks of 16
    while engine.step():
        pass
    assert engine.cache.used_blocks == 0


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["llama", "gpt"])
def test_a_short_prompt_behind_long_prefills_answers_before_their_chunks_run(build):
    """A 5-token prompt submitted while two long ones are being prefilled (one of them
    beside a decoding request) is prefilled in the next step, in a pass of its own
    before the long prompts' chunks of that step: its first token is handed out while
    their cache still lacks those chunks. A step of a decoding token and several prefill
    chunks of different lengths (not block multiples) answers every request as alone."""
    model = _model(build)
    engine = Engine(model, context_length=512, num_blocks=64, max_batch=4, prefill_chunk=16)
    decoding, first, second, short = _prompts([3, 90, 70, 5])
    running = engine.submit(decoding, 20)
    engine.step()
    longs = [engine.submit(first, 3), engine.submit(second, 4)]
    engine.step()
    seen = []

    def on_token(request, token):
        if token is not None and not seen:
            seen.append([engine.cache.length(r.seq) for r in longs])

    before = [engine.cache.length(r.seq) for r in longs]
    request = engine.submit(short, 6, on_token=on_token)
    engine.step()
    assert request.output and seen == [before]
    after = [engine.cache.length(r.seq) for r in longs]
    assert sum(after) - sum(before) == 16 - len(short)  # the rest of the step's budget
    while engine.step():
        pass
    for r in (running, *longs, request):
        assert r.finish_reason == "length" and r.output == _alone(model, r.prompt, r.max_tokens)
    assert engine.cache.used_blocks == 0


def test_admission_waits_for_room_in_the_pool():
    """Room for one request at a time: the second starts after the first ends."""
    model = _model(_llama)
    engine = Engine(model, context_length=64, num_blocks=3, block_size=16)
    prompts = _prompts([20, 30, 10])
    requests = [engine.submit(p, 18) for p in prompts]
    peak = 0
    while engine.step():
        peak = max(peak, engine.cache.used_blocks)
        assert sum(r.seq is not None and not r.done for r in requests) <= 1
    assert peak <= 3
    for request in requests:
        assert request.finish_reason == "length"
        assert request.output == _alone(model, request.prompt, 18)
    first, second = requests[:2]
    assert second.first_token_at > first.token_times[-1]


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["llama", "gpt"])
def test_preempted_requests_resume_with_the_outputs_they_would_have_had(build):
    """Optimistic admission runs all three at once in a pool too small for them: the
    newest are preempted when blocks run out, prefilled again from prompt + output
    later, and every output still equals the request run alone."""
    model = _model(build)
    engine = Engine(
        model, context_length=64, num_blocks=4, block_size=16, max_batch=3, admission="optimistic"
    )
    prompts = _prompts([20, 30, 10])
    requests = [engine.submit(p, 18) for p in prompts]
    peak = 0
    while engine.step():
        peak = max(peak, engine.cache.used_blocks)
    assert peak <= 4 and engine.cache.used_blocks == 0 and engine.idle
    assert sum(r.preemptions for r in requests) >= 1
    for request in requests:
        assert request.finish_reason == "length"
        assert request.output == _alone(model, request.prompt, 18)


def test_a_shared_system_prompt_is_computed_once():
    model = _model(_llama)
    engine = Engine(model, context_length=512, num_blocks=64, block_size=16)
    system = _prompts([40])[0]
    first = engine.submit(system + [1, 2, 3], 4)
    engine.step()  # first's prefill: its two full system blocks enter the prefix cache
    second = engine.submit(system + [4, 5], 4)
    while engine.step():
        pass
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert second.output == _alone(model, second.prompt, 4)


def test_cancel_frees_the_blocks_and_says_so():
    engine = Engine(_model(_llama), context_length=512, num_blocks=64)
    seen = []
    request = engine.submit(_prompts([50])[0], 100, on_token=lambda r, t: seen.append(t))
    for _ in range(3):
        engine.step()
    assert engine.cache.used_blocks > 0
    engine.cancel(request)
    engine.step()
    assert request.finish_reason == "cancelled" and seen[-1] is None
    assert len(seen) == 4  # three tokens, then the end
    assert engine.cache.used_blocks == 0


def test_a_stop_token_ends_the_request_without_being_output():
    model = _model(_llama)
    prompt = _prompts([12])[0]
    free_run = _alone(model, prompt, 6)
    engine = Engine(model, context_length=512, num_blocks=64, stop_ids=[free_run[3]])
    request = engine.submit(prompt, 6)
    while engine.step():
        pass
    assert request.finish_reason == "stop"
    assert request.output == free_run[: free_run.index(free_run[3])]


def test_the_thread_serves_requests_submitted_from_other_threads():
    model = _model(_gpt)
    engine = Engine(model, context_length=512, num_blocks=64, max_batch=4)
    engine.start()
    try:
        finished = threading.Event()
        prompts = _prompts([7, 30, 12, 50, 9])
        requests = []
        for prompt in prompts:
            requests.append(
                engine.submit(
                    prompt,
                    6,
                    on_token=lambda r, t: (
                        t is None
                        and all(q.done for q in requests)
                        and len(requests) == 5
                        and finished.set()
                    ),
                )
            )
        assert finished.wait(60)
    finally:
        engine.stop()
    for request in requests:
        assert request.output == _alone(model, request.prompt, 6)
    assert engine.cache.used_blocks == 0


def test_sampling_with_a_seed_repeats():
    engine = Engine(_model(_llama), context_length=512, num_blocks=64)
    prompt = _prompts([10])[0]
    runs = [engine.submit(prompt, 8, temperature=0.8, top_p=0.9, seed=3) for _ in range(2)]
    while engine.step():
        pass
    assert runs[0].output == runs[1].output and len(runs[0].output) == 8


@pytest.mark.parametrize(
    "prompt,max_tokens,options,message",
    [
        ([], 4, {}, "prompt is empty"),
        ([1, 2], 0, {}, "max_tokens must be"),
        ([1, 2], 4, {"temperature": -1.0}, "temperature must be >= 0"),
        ([1] * 60, 10, {}, "exceeds the context length 64"),
        ([1, VOCAB], 4, {}, "outside the vocabulary 0..63"),
    ],
)
def test_bad_requests_raise_clear_errors(prompt, max_tokens, options, message):
    engine = Engine(_model(_llama), context_length=64, num_blocks=64)
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, max_tokens, **options)


def test_a_request_larger_than_the_pool_is_refused():
    engine = Engine(_model(_llama), context_length=64, num_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="needs 3 cache blocks, the pool has 2"):
        engine.submit([1] * 40, 8)
    with pytest.raises(ValueError):  # a seed torch refuses: nothing is left queued either
        engine.submit([1, 2], 2, temperature=1.0, seed=2**64)
    assert engine.idle and engine.run([[1, 2]], 2)  # (a left request once failed the next steps)


def test_stats_report_the_peak_against_contiguous_caches():
    engine = Engine(_model(_llama), context_length=512, num_blocks=64, block_size=16)
    engine.run(_prompts([10, 70]), [6, 30])  # 16 and 100 tokens at their longest
    stats = engine.stats()
    # (2 layers x 16 slots x 2 kv heads x 8 dims, keys and values, float64)
    assert stats["block_bytes"] == 2 * 2 * 16 * 2 * 8 * 8
    assert (stats["used_blocks"], stats["peak_running"], stats["longest_request"]) == (0, 2, 100)
    # the long one's 99 cached tokens (its last token is never fed) after the short one
    # ended: 7 blocks
    assert stats["peak_used_blocks"] == 7
    assert stats["peak_bytes"] == 7 * stats["block_bytes"]
    assert stats["contiguous_bytes"] == 100 * stats["block_bytes"] // 16 * 2


def test_a_failed_step_ends_only_its_own_requests():
    """Two prompts admitted together, the first filling a step's prefill budget (20
    tokens, so the second's prefill is in a later step): a failure in the first one's
    prefill ends it, and the second is still served."""
    model = _model(_llama)
    engine = Engine(model, context_length=512, num_blocks=64, prefill_chunk=20)
    prefill = engine.runner.prefill

    def fail_once(chunk):
        engine.runner.prefill = prefill
        raise RuntimeError("a planted failure")

    engine.runner.prefill = fail_once
    first, second = (engine.submit(p, 4) for p in _prompts([20, 30]))
    engine.start()
    try:
        for _ in range(6000):
            if first.done and second.done:
                break
            threading.Event().wait(0.01)
    finally:
        engine.stop()
    assert first.finish_reason == "error"
    assert second.finish_reason == "length" and second.output == _alone(model, second.prompt, 4)
    assert engine.cache.used_blocks == 0


@pytest.mark.parametrize(("prefill_chunk", "block_size"), [(16, 16), (20, 16), (16, 12)])
def test_a_moba_gpt_answers_as_alone_under_any_chunking_and_cached(prefill_chunk, block_size):
    """MoBA chooses key blocks of moba_block positions within each call: the engine ends
    its prefill chunks on those blocks (and shares no prefix whose cached end is not
    one), so the answers equal generate's, cold and with the prefixes cached."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB, max_len=512, d_model=32, n_head=4, n_layer=2, attention="moba"
    )
    model = GPT(dataclasses.replace(config, moba_block=8, moba_top_k=1)).double().eval()
    with torch.no_grad():  # weights far from init: the block choice matters
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    engine = Engine(
        model,
        context_length=512,
        num_blocks=64,
        block_size=block_size,
        max_batch=3,
        prefill_chunk=prefill_chunk,
    )
    prompts = _prompts([45, 100, 37])
    for _ in range(2):  # the second time, their prefixes are cached (where shared)
        for prompt, output in zip(prompts, engine.run(prompts, [12] * 3), strict=True):
            assert output == _alone(model, prompt, 12)
    assert engine.cache.used_blocks == 0
