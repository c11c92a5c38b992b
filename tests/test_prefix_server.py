"""Prefix reuse across requests through the real server (float32, the `server` fixture, whose
prefix cache is on by default): a next turn and concurrent questions after one system text
start from cached or running sequences' caches, and each still gives exactly the reference
text (transformers' greedy generate on the same weights)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import hf_greedy_text
from live import scrape, start_bystander
from specdec.client import generate

pytestmark = pytest.mark.server

MIN_TOKENS = 64  # the committed prefix_min_tokens
HITS, REUSED = "specdec_prefix_hits_total", "specdec_prefix_reused_tokens_total"
SYSTEM = (
    "You are the archivist of a small museum of woodworking tools in a mountain village. "
    "Visitors ask short questions about the tools on display: planes, chisels, saws, "
    "drawknives, spokeshaves, augers and mallets. Answer in one or two plain sentences, "
    "say what the tool is for and how it was held, and do not invent dates or names that "
    "the labels in the museum do not give.\n\n"
)
QUESTIONS = ("a block plane", "a drawknife", "a spokeshave", "an auger")


def ask(server, prompt: str, max_tokens: int = 16, model="speculative_decoding", **params):
    result = generate(
        prompt,
        url=server.url,
        model=model,
        max_tokens=max_tokens,
        exclude_input_in_output=True,
        return_perf_metrics=True,
        **params,
    )
    assert result.error is None, result.error
    return result


def question(thing: str) -> str:
    return f"Question: what is {thing} for?\nAnswer:"


def test_a_next_turn_starts_from_the_first_and_gives_the_reference_text(server, hf_target):
    first_prompt = SYSTEM + question("a froe")
    first = ask(server, first_prompt)
    before = scrape(server.metrics_url)
    second_prompt = first_prompt + first.text + "\n" + question("a bench hook")
    second = ask(server, second_prompt)
    after = scrape(server.metrics_url)
    assert second.metrics["kv_cache_reused_blocks"] >= MIN_TOKENS
    assert after[HITS] - before[HITS] == 1
    assert after[REUSED] - before[REUSED] == second.metrics["kv_cache_reused_blocks"]
    assert second.text == hf_greedy_text(hf_target, second_prompt, 16)


def test_a_prompt_under_another_cache_salt_reuses_nothing_and_under_the_same_it_does(server):
    """Tenants apart: the same long prompt under another salt prefills in full; under the
    first salt again it starts from the cached prompt. The last goes through the ensemble,
    which must pass the salt on: the prompt starts unlike the other tests' (cached under the
    salt ""), so under "" it would find nothing."""
    prompt = "Salted. " + SYSTEM + question("a mortise chisel")
    first = ask(server, prompt, cache_salt="salt-test-tenant-a")
    before = scrape(server.metrics_url)
    other = ask(server, prompt, cache_salt="salt-test-tenant-b")
    between = scrape(server.metrics_url)
    same = ask(server, prompt, model="ensemble", cache_salt="salt-test-tenant-a")
    after = scrape(server.metrics_url)
    assert other.metrics["kv_cache_reused_blocks"] == 0
    assert between[HITS] == before[HITS]
    assert same.metrics["kv_cache_reused_blocks"] >= MIN_TOKENS
    assert after[HITS] - between[HITS] == 1
    assert first.text == other.text == same.text  # output never depends on the cache


def test_concurrent_questions_after_one_system_text_each_give_the_reference_text(server, hf_target):
    ask(server, SYSTEM + question("a marking gauge"))  # leaves the system text cached
    prompts = [SYSTEM + question(thing) for thing in QUESTIONS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: ask(server, p), prompts))
    for prompt, result in zip(prompts, results, strict=True):
        # Each adopted the cached slot or copied from the request that did (running).
        assert result.metrics["kv_cache_reused_blocks"] >= MIN_TOKENS
        assert result.text == hf_greedy_text(hf_target, prompt, 16)


def test_a_long_prompt_joins_in_chunks_and_both_texts_stay_exact(server, hf_target):
    """A prompt of about 600 tokens (over the committed prefill_chunk, 256) joins beside a
    running stream: it prefills in chunks between that stream's steps."""
    bystander_prompt = "Write a short story about a lighthouse keeper and a storm."
    bystander = start_bystander(server.url, bystander_prompt, 48)
    long_prompt = " ".join(f"Shelf {i} holds a plane, a chisel and a saw." for i in range(50))
    long_prompt += "\nQuestion: which shelf comes after shelf 49?\nAnswer:"
    result = ask(server, long_prompt)
    assert result.metrics["kv_cache_alloc_total_blocks"] > 512
    assert result.text == hf_greedy_text(hf_target, long_prompt, 16)
    alone = bystander.result(timeout=300)
    assert alone.error is None
    assert alone.text == hf_greedy_text(hf_target, bystander_prompt, 48)
