"""Prometheus metrics of the loop, and cancellation that frees slots within an iteration."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from conftest import hf_greedy_text
from live import scrape, start_bystander, start_victim, wait_for
from specdec.client import StreamingClient, generate
from specdec.serving.metric_names import (
    ENGINE_CALLS,
    ENGINE_RESULT_BYTES,
    LOOP_PARTS,
    PASSES_BY_TOKENS,
    REQUEST_OUTCOMES,
    REQUESTS,
    SEQUENCE_OUTCOMES,
    SEQUENCES,
    request_outcome,
)

pytestmark = pytest.mark.server

NUM_SLOTS = 32  # the `server` fixture's
# A chat turn (SmolLM2's template) whose sampled answers end after a word or run on: with
# random_seed 7 its three answers took 1, 8 and over 24 tokens.
SHORT_ANSWER = (
    "<|im_start|>user\nIs the sky blue? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
)


def ended(before: dict, after: dict, family: str) -> dict[str, float]:
    """The family's increase by outcome, outcomes that did not move left out."""
    outcomes = REQUEST_OUTCOMES if family == REQUESTS else SEQUENCE_OUTCOMES
    counts = {o: after.get(f'{family}{{outcome="{o}"}}', 0) for o in outcomes}
    counts = {o: n - before.get(f'{family}{{outcome="{o}"}}', 0) for o, n in counts.items()}
    return {o: n for o, n in counts.items() if n}


def test_metrics_count_what_the_loop_did(server):
    before = scrape(server.metrics_url)
    started = time.monotonic()
    result = generate(
        "Count from one to twenty:",
        url=server.url,
        max_tokens=24,
        num_draft_tokens=3,
        fixed_num_draft_tokens=True,
        return_perf_metrics=True,
        return_num_output_tokens=True,
    )
    wall = time.monotonic() - started
    after = scrape(server.metrics_url)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    # The loop's time by part: the step did the work, and the parts fit in the request's time.
    loop = {p: delta(f'specdec_loop_seconds_total{{part="{p}"}}') for p in LOOP_PARTS}
    assert loop["draft"] > 0 and loop["target"] > 0 and loop["respond"] > 0
    assert sum(loop.values()) < wall

    assert delta("specdec_draft_tokens_total") == result.metrics["total_draft_tokens"]
    assert (
        delta("specdec_accepted_draft_tokens_total")
        == (result.metrics["total_accepted_draft_tokens"])
    )
    assert delta("specdec_emitted_tokens_total") == result.metrics["num_output_tokens"]
    assert ended(before, after, REQUESTS) == ended(before, after, SEQUENCES) == {"length": 1}
    # Target passes counted by the tokens each emitted: they add up to the passes and to
    # the tokens emitted.
    by_tokens = {n: delta(f'{PASSES_BY_TOKENS}{{tokens="{n}"}}') for n in range(8 + 2)}  # k <= 8
    assert sum(by_tokens.values()) == delta("specdec_target_passes_total") > 0
    assert sum(n * passes for n, passes in by_tokens.items()) == result.metrics["num_output_tokens"]
    # Engine calls: one target call per iteration; the draft model's where it proposed (it
    # may also be called to catch up without proposing).
    calls = {c: delta(f'{ENGINE_CALLS}{{call="{c}"}}') for c in ("draft", "target")}
    result_bytes = {c: delta(f'{ENGINE_RESULT_BYTES}{{call="{c}"}}') for c in ("draft", "target")}
    assert calls["target"] == delta("specdec_iterations_total") > 0
    assert result_bytes["target"] > 0
    drafted = delta('specdec_proposer_draft_tokens_total{proposer="draft_model"}') > 0
    assert calls["draft"] > 0 or not drafted
    assert (calls["draft"] > 0) == (result_bytes["draft"] > 0)
    assert after["specdec_free_kv_slots"] == NUM_SLOTS
    assert after["specdec_queued_requests"] == 0
    for name in (
        "specdec_running_batch_size",
        "specdec_current_num_draft_tokens",
        "specdec_iterations_total",
    ):
        assert name in after


def test_requests_and_their_sequences_are_counted_apart(server):
    """num_return_sequences=3: one request, three sequences, each counted once; the request
    under its sequences' most truncating reason. A refused request: one, and no sequence."""
    max_tokens = 24
    before = scrape(server.metrics_url)
    with StreamingClient(server.url) as client:
        results = client.generate_all(
            SHORT_ANSWER,
            max_tokens=max_tokens,
            num_return_sequences=3,
            temperature=1.0,
            random_seed=7,
            return_num_output_tokens=True,
        )
    after = scrape(server.metrics_url)
    assert sorted(results) == [(0, 0), (0, 1), (0, 2)]
    assert all(r.error is None for r in results.values())
    # No stop words, a short prompt: a sequence ends by its end token or at max_tokens.
    reasons = [
        "length" if r.metrics["num_output_tokens"] == max_tokens else "end"
        for r in results.values()
    ]
    # Seeded sampling is deterministic: this draw mixes reasons, so the rule is exercised.
    assert set(reasons) == {"end", "length"}, f"{reasons}: pick a seed whose answers mix"
    assert ended(before, after, SEQUENCES) == Counter(reasons)
    # One answer cut at max_tokens: the request counts as cut (request_outcome's rule).
    assert ended(before, after, REQUESTS) == {request_outcome(reasons): 1} == {"length": 1}

    before = scrape(server.metrics_url)
    refused = generate("hi", url=server.url, max_tokens=-1, num_return_sequences=3)
    after = scrape(server.metrics_url)
    assert refused.error is not None and "max_tokens" in str(refused.error)
    assert ended(before, after, REQUESTS) == {"invalid": 1}
    assert ended(before, after, SEQUENCES) == {}


def test_cancelled_stream_frees_its_slot_within_an_iteration(server):
    client, chunks = start_victim(server.url, "Write a long story about a lighthouse keeper.")
    wait_for(lambda: len(chunks) >= 5)  # mid-generation
    busy = scrape(server.metrics_url)
    assert busy["specdec_free_kv_slots"] == NUM_SLOTS - 1
    cancelled_before = busy.get(f'{REQUESTS}{{outcome="cancelled"}}', 0)
    client.stop_stream(cancel_requests=True)
    wait_for(
        lambda: (
            scrape(server.metrics_url).get(f'{REQUESTS}{{outcome="cancelled"}}', 0)
            > cancelled_before
        )
    )
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)
    freed = scrape(server.metrics_url)
    # One request of one sequence, cancelled: counted once as each.
    assert ended(busy, freed, REQUESTS) == ended(busy, freed, SEQUENCES) == {"cancelled": 1}
    # The loop saw the cancellation at its next iteration boundary and stopped: the scrape
    # before cancelling can trail the loop by an iteration or two, no more.
    assert freed["specdec_iterations_total"] - busy["specdec_iterations_total"] <= 3
    assert freed["specdec_running_batch_size"] <= 1


def test_cancellations_leave_other_requests_exact(server, hf_target):
    prompt = "The capital of France is"
    expected = hf_greedy_text(hf_target, prompt, 60)
    bystander = start_bystander(server.url, prompt, 60)
    victims = [start_victim(server.url, f"Tell me story number {i}.") for i in range(4)]
    for client, chunks in victims:
        wait_for(lambda chunks=chunks: len(chunks) >= 2)
        client.stop_stream(cancel_requests=True)
    assert bystander.result().text == expected
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)
    assert (
        generate(prompt, url=server.url, max_tokens=60, exclude_input_in_output=True).text
        == expected
    )
