"""The speculative-decoding part of `mhsa bench serve`: the same greedy chat requests,
one at a time (batch 1), sent alternately to a plain `mhsa serve` and to one with
`--speculate prompt-lookup`, on two tasks:

- copy: "rewrite this paragraph" (the answer repeats much of the prompt: prompt lookup's
  case);
- chat: free-form questions (little to copy: the drafts mostly fall, the cost shows).

Reported per task: each server's output tokens/s (end to end, prefill included), their
ratio, and how many answers are identical (greedy: all should be).
"""

from __future__ import annotations

import http.client
import json
import time

PARAGRAPHS = [
    "The river had always been the centre of the town. In spring it rose over its banks "
    "and the people moved their boats up to the road, and in summer the children swam in "
    "the shallow places under the bridge while their parents sat in the shade and talked "
    "about the price of bread and the weather that was coming.",
    "Our team met on Monday to review the plan for the new library system. We agreed that "
    "the catalogue should be searchable by title, author and subject, that loans should be "
    "renewed online, and that the old cards should be scanned before the end of the year so "
    "that nothing in the archive is lost.",
    "A good cup of tea needs fresh water, a warm pot and patience. Boil the water, pour a "
    "little into the pot to warm it, then add one spoon of leaves for each person and one "
    "for the pot. Let it stand for four minutes before you pour, and add milk only if you "
    "like it that way.",
    "The station was quiet after the last train had gone. A cleaner pushed a broom along "
    "the platform, the lights above the timetable flickered, and somewhere beyond the "
    "tracks a dog barked twice and then stopped, as if it had remembered that everyone was "
    "asleep.",
]
QUESTIONS = [
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain why the sky is blue to a ten year old.",
    "Give me three ideas for a birthday party for my grandmother.",
    "What are the benefits of learning a second language?",
]


def tasks(quick: bool) -> dict[str, list[str]]:
    """The user messages of each task (half of them with quick)."""
    count = 2 if quick else 4
    copy = [f"Rewrite this paragraph in your own words:\n\n{p}" for p in PARAGRAPHS[:count]]
    return {"copy": copy, "chat": QUESTIONS[:count]}


def _chat(port: int, model: str, message: str, max_tokens: int) -> tuple[str, int, float]:
    """One greedy chat completion: its text, completion tokens and seconds."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    try:
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    seconds = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {answer!r}")
    text = answer["choices"][0]["message"]["content"]
    return text, answer["usage"]["completion_tokens"], seconds


def compare(ports: dict[str, int], model: str, quick: bool, max_tokens: int = 128) -> dict:
    """Each task's requests, alternately to the "plain" and "speculative" servers."""
    results = {}
    for task, messages in tasks(quick).items():
        totals = {side: {"tokens": 0, "seconds": 0.0} for side in ports}
        identical = 0
        for message in messages:
            texts = {}
            for side, port in ports.items():
                text, tokens, seconds = _chat(port, model, message, max_tokens)
                texts[side] = text
                totals[side]["tokens"] += tokens
                totals[side]["seconds"] += seconds
            identical += texts["plain"] == texts["speculative"]
        rates = {side: t["tokens"] / t["seconds"] for side, t in totals.items()}
        results[task] = {
            "requests": len(messages),
            "tokens_per_second": rates,
            "speedup": rates["speculative"] / rates["plain"],
            "identical": identical,
        }
    return results


def report(result: dict, draft_tokens: int) -> list[str]:
    lines = [
        f"speculative decoding (--speculate prompt-lookup --draft-tokens {draft_tokens}), "
        "one request at a time, greedy chat, each request alternately to both servers:",
        f"{'task':<28}{'plain':>10}{'prompt lookup':>15}{'ratio':>8}{'identical':>11}",
    ]
    for task, label in (("copy", "rewrite a paragraph"), ("chat", "free-form chat")):
        r = result[task]
        rates = r["tokens_per_second"]
        lines.append(
            f"{label:<28}{rates['plain']:>10.1f}{rates['speculative']:>15.1f}"
            f"{r['speedup']:>7.2f}x{r['identical']:>6}/{r['requests']}"
        )
    return lines
