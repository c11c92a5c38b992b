"""Prometheus metrics of the loop, and cancellation that frees slots within an iteration."""

from __future__ import annotations

import time

import pytest

from conftest import hf_greedy_text
from live import scrape, start_bystander, start_victim, wait_for
from specdec.client import generate
from specdec.serving.metric_names import (
    ENGINE_CALLS,
    ENGINE_RESULT_BYTES,
    LOOP_PARTS,
    PASSES_BY_TOKENS,
)

pytestmark = pytest.mark.server

NUM_SLOTS = 32  # the `server` fixture's


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
    assert delta('specdec_requests_total{outcome="length"}') == 1
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


def test_invalid_requests_are_counted(server):
    before = scrape(server.metrics_url)
    generate("hi", url=server.url, max_tokens=-1)
    after = scrape(server.metrics_url)
    key = 'specdec_requests_total{outcome="invalid"}'
    assert after[key] - before.get(key, 0) == 1


def test_cancelled_stream_frees_its_slot_within_an_iteration(server):
    client, chunks = start_victim(server.url, "Write a long story about a lighthouse keeper.")
    wait_for(lambda: len(chunks) >= 5)  # mid-generation
    busy = scrape(server.metrics_url)
    assert busy["specdec_free_kv_slots"] == NUM_SLOTS - 1
    cancelled_before = busy.get('specdec_requests_total{outcome="cancelled"}', 0)
    client.stop_stream(cancel_requests=True)
    wait_for(
        lambda: (
            scrape(server.metrics_url)['specdec_requests_total{outcome="cancelled"}']
            > cancelled_before
        )
    )
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)
    freed = scrape(server.metrics_url)
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
