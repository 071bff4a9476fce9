"""Reproducible greedy answers from `mhsa serve` on the default weights (the packaged
SmolLM2, its own int4 blocks), against a live server on 127.0.0.1 with the official
openai client: 16 prompts answered cold (each alone, nothing cached), again after a
prefix-cache hit (1 to 64 prompt tokens left to compute, so prefill calls of every
size), and all together in one batch give the same tokens. Before the int4 linears
ran their kernel for every row count and the paged attention kept every row's result
independent of the call's other rows, 3 of 8 chat prompts changed from the first token.

Also the prefix cache's namespaces: a prompt hits (usage.cached_tokens) only blocks
cached under the same API key and cache_salt."""

from __future__ import annotations

import pytest
from live_server import openai_client

from mhsa.apps.chat import SMOLLM2
from optional import needs_package_file

PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the "
    "steps out of habit, and wound the great clockwork that turned the lamp. Ships "
    "passing in the night never saw him, only the slow sweep of light across the water, "
    "and the harbour town below slept without thinking of the man who kept it safe. "
    "In winter the storms came in from the north and he stayed awake until dawn."
)
# prompt lengths: after a cached prefix of whole 16-token blocks, 1..16 tokens are left
LENGTHS = (17, 18, 20, 23, 28, 31, 32, 33, 40, 47, 48, 49, 55, 63, 64, 65)


@pytest.fixture(scope="module")
def smollm2():
    from mhsa.apps.chat import load_chat_model

    needs_package_file(*SMOLLM2)
    return load_chat_model()


@pytest.mark.slow
def test_cold_cached_and_batched_greedy_answers_are_identical(start_server, smollm2):
    from mhsa.apps.serve.models import ServedModel

    served = ServedModel.from_chat(smollm2, num_blocks=128, max_batch=16, max_wait=0.0)
    server = start_server(served=served)
    client = openai_client(server)
    ids = smollm2.tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    assert len(ids) >= max(LENGTHS)
    prompts = [ids[:n] for n in LENGTHS]

    def complete(prompt, salt: str):
        return client.completions.create(
            model=served.name,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            extra_body={"cache_salt": salt},
        )

    cold, cached = [], []
    for index, prompt in enumerate(prompts):  # each alone, in a namespace of its own
        answer = complete(prompt, f"alone-{index}")
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        cold.append(answer.choices[0].text)
    for index, prompt in enumerate(prompts):  # again: its whole blocks are cached
        answer = complete(prompt, f"alone-{index}")
        assert answer.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
        cached.append(answer.choices[0].text)
    together = complete(prompts, "batch")  # one request: 16 engine requests at once
    batched = [choice.text for choice in sorted(together.choices, key=lambda c: c.index)]
    assert len({text for text in cold}) > 1  # (not one answer for everything)
    assert cached == cold
    assert batched == cold


def test_the_prefix_cache_is_shared_only_within_a_key_and_salt(start_server):
    server = start_server()
    prompt = "a shared system prompt of more than sixteen bytes, then a question"

    def cached(api_key: str, salt: str | None = None) -> int:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        answer = openai_client(server, api_key).completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, **extra
        )
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") == 64  # her own prefix: 4 blocks of 16 bytes
    assert cached("bob") == 0  # another key sees nothing of hers
    assert cached("alice", "project-x") == 0  # a salt is a namespace of its own
    assert cached("alice", "project-x") == 64
    assert cached("bob", "project-x") == 0


def test_a_cache_salt_that_is_not_a_string_of_1_to_256_characters_gets_a_400(start_server):
    from live_server import request

    server = start_server()
    for salt, code, says in (
        (3, "invalid_type", "expected a string, but got an integer"),
        ("", "invalid_value", "1..256 characters, got 0"),
        ("x" * 257, "invalid_value", "1..256 characters, got 257"),
    ):
        status, answer, _ = request(
            server.port, "POST", "/v1/completions", {"prompt": "hi", "cache_salt": salt}
        )
        error = answer["error"]
        assert status == 400 and error["param"] == "cache_salt" and error["code"] == code
        assert says in error["message"]


@pytest.mark.slow
def test_speculative_serving_gives_the_same_greedy_answers(start_server, smollm2):
    """--speculate prompt-lookup on the default weights: each answer, batched or alone,
    equals the plain server's (drafts verified in one pass over the paged cache)."""
    from mhsa.apps.serve.models import ServedModel
    from mhsa.models.speculative import PromptLookup

    ids = smollm2.tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    prompts = [ids[:n] for n in LENGTHS[::2]] + [ids + ids[:20]]  # the last one copies
    answers = {}
    for name, options in (("plain", {}), ("lookup", {"speculator": PromptLookup()})):
        served = ServedModel.from_chat(smollm2, num_blocks=128, max_wait=0.0, **options)
        client = openai_client(start_server(served=served))
        together = client.completions.create(
            model=served.name, prompt=prompts, max_tokens=12, temperature=0
        )
        alone = [
            client.completions.create(model=served.name, prompt=p, max_tokens=12, temperature=0)
            for p in prompts[-2:]
        ]
        answers[name] = [c.text for c in sorted(together.choices, key=lambda c: c.index)] + [
            a.choices[0].text for a in alone
        ]
    assert answers["lookup"] == answers["plain"]
