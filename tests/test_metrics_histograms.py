"""The latency histograms on the real server's /metrics, against what the requests saw: the
client's own clock, the tokens it received, and the times and counts the server returned with
them (return_perf_metrics). Concurrent streams with different k and stream_interval."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from live import scrape
from specdec.client import GenerationResult, StreamingClient, wait_until_idle
from specdec.serving.metric_names import (
    END_TO_END_LATENCY,
    HISTOGRAMS,
    INPUT_TOKENS,
    INTER_TOKEN_LATENCY,
    OUTPUT_TOKENS,
    QUEUE_TIME,
    TIME_TO_FIRST_TOKEN,
    le_label,
)
from specdec.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.server

PROMPTS = [
    "Count from one to ten:",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is two plus two?",  # no chat template: the target's end token comes first
    "List the days of the week:",
    "Spell the word speculative backwards.",
]
# Per request: max_tokens, num_draft_tokens (None: adaptive), stream_interval.
SHAPES = [(16, 0, 1), (24, 3, 1), (20, None, 4), (12, 2, 1), (18, 4, 3), (10, None, 1)]
# The client's clock against the server's: a streamed response reaches the client after the
# server built it (gRPC, the response thread if any), and a request reaches the BLS after the
# client sent it (tokenizing included). Per request, on a busy 2-core host:
CLIENT_SLACK_S = 0.5


def send(url: str, prompt: str, shape: tuple[int, int | None, int]) -> GenerationResult:
    max_tokens, k, interval = shape
    params: dict = {"max_tokens": max_tokens, "stream": True, "stream_interval": interval}
    if k is not None:
        params |= {"num_draft_tokens": k, "fixed_num_draft_tokens": True}
    with StreamingClient(url, model="speculative_decoding") as client:
        result = client.generate(
            prompt,
            return_perf_metrics=True,
            return_num_input_tokens=True,
            return_num_output_tokens=True,
            return_log_probs=True,  # one per output token: the tokens the client received
            exclude_input_in_output=True,
            **params,
        )
    assert result.error is None, result.error
    return result


def histogram(values: dict, name: str) -> tuple[dict[str, float], float, float]:
    """A histogram's series in a scrape: {le: cumulative count}, sum, count."""
    family = next(f for f in HISTOGRAMS if f.name == name)
    les = [le_label(b) for b in (*family.buckets, float("inf"))]
    buckets = {le: values.get(f'{name}_bucket{{le="{le}"}}', 0.0) for le in les}
    return buckets, values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0)


def increase(before: dict, after: dict, name: str) -> tuple[dict[str, float], float, float]:
    (b0, s0, c0), (b1, s1, c1) = histogram(before, name), histogram(after, name)
    return {le: b1[le] - b0[le] for le in b1}, s1 - s0, c1 - c0


def expected_buckets(name: str, values: list[float]) -> dict[str, float]:
    """The cumulative bucket counts `values` make, by Prometheus's rule (value <= le)."""
    family = next(f for f in HISTOGRAMS if f.name == name)
    bounds = (*family.buckets, float("inf"))
    return {le_label(b): float(sum(v <= b for v in values)) for b in bounds}


def test_histograms_match_what_the_requests_saw(server, target_dir):
    wait_until_idle(server.metrics_url)  # nothing else runs, so every change is ours
    before = scrape(server.metrics_url)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(send, [server.url] * len(PROMPTS), PROMPTS, SHAPES))
    after = scrape(server.metrics_url)
    n = len(results)
    m = [r.metrics for r in results]

    # Every series of every histogram is there, cumulative: non-decreasing in le, +Inf = count.
    for family in HISTOGRAMS:
        buckets, _, count = histogram(after, family.name)
        assert all(f'{family.name}_bucket{{le="{le}"}}' in after for le in buckets), family.name
        counts = list(buckets.values())
        assert counts == sorted(counts) and counts[-1] == count > 0, family.name

    # Tokens: what the client received (a log-prob per token) and what the server counted.
    received = [len(r.output_log_probs) for r in results]
    assert received == [int(x["num_output_tokens"]) for x in m]
    buckets, total, count = increase(before, after, OUTPUT_TOKENS)
    assert count == n and total == sum(received)
    assert buckets == expected_buckets(OUTPUT_TOKENS, received)
    tokenizer = load_tokenizer(str(target_dir))
    prompt_tokens = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert prompt_tokens == [int(x["num_input_tokens"]) for x in m]
    buckets, total, count = increase(before, after, INPUT_TOKENS)
    assert count == n and total == sum(prompt_tokens)
    assert buckets == expected_buckets(INPUT_TOKENS, prompt_tokens)

    # A sequence whose end token came first emitted nothing: it has no first token, so it
    # observes no time to first token, queue time or inter-token latency.
    assert received[PROMPTS.index("What is two plus two?")] == 0
    emitted = [i for i, t in enumerate(received) if t > 0]
    assert len(emitted) == n - 1

    # Time to first token and queue time: exactly the server's own times of each request...
    ttft = [(m[i]["first_token_time_ns"] - m[i]["arrival_time_ns"]) * 1e-9 for i in emitted]
    queued = [(m[i]["first_scheduled_time_ns"] - m[i]["arrival_time_ns"]) * 1e-9 for i in emitted]
    for name, values in ((TIME_TO_FIRST_TOKEN, ttft), (QUEUE_TIME, queued)):
        buckets, total, count = increase(before, after, name)
        assert count == len(emitted) and total == pytest.approx(sum(values), abs=1e-6), name
        assert buckets == expected_buckets(name, values), name
    # ... and about the client's: its first chunk came after the server's first token, and
    # not much later (the interval-4 and -3 streams waited for their chunk to fill).
    spans = [(m[i]["last_token_time_ns"] - m[i]["first_token_time_ns"]) * 1e-9 for i in emitted]
    for server_s, i, span in zip(ttft, emitted, spans, strict=True):
        client_s = results[i].time_to_first_token
        fill = (SHAPES[i][2] - 1) * span / max(received[i] - 1, 1)
        assert server_s <= client_s + 0.01  # the server's clock runs on the same host
        assert client_s - server_s < CLIENT_SLACK_S + fill

    # Inter-token latency: one per token after each first, summing to last - first token.
    buckets, total, count = increase(before, after, INTER_TOKEN_LATENCY)
    assert count == sum(received[i] - 1 for i in emitted)
    assert total == pytest.approx(sum(spans), abs=1e-6)
    client_spans = [results[i].chunk_times[-1] - results[i].chunk_times[0] for i in emitted]
    assert abs(total - sum(client_spans)) < n * CLIENT_SLACK_S
    assert buckets[le_label(float("inf"))] == count

    # End to end, every sequence: after its last token (or its first scheduling, where it
    # emitted none), before the client had its final response.
    buckets, total, count = increase(before, after, END_TO_END_LATENCY)
    last = [
        (max(x["last_token_time_ns"], x["first_scheduled_time_ns"]) - x["arrival_time_ns"]) * 1e-9
        for x in m
    ]
    elapsed = [r.elapsed for r in results]
    assert count == n
    assert sum(last) <= total <= sum(elapsed) + 0.01 * n
    assert sum(elapsed) - total < n * CLIENT_SLACK_S
    assert buckets[le_label(float("inf"))] == n
