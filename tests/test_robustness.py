"""Bad input and cancellation through the real server: the server keeps serving, exactly.

Every malformed request gets an error that names its field, and a greedy request running
beside them completes with its exact text. Fifty streams cancelled at random points leave
every KV slot free, memory where it was, and outputs exact.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from conftest import hf_greedy_text
from live import is_final, scrape, start_bystander, start_victim, wait_for
from specdec.client import generate
from specdec.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.server

NUM_SLOTS, MAX_CONTEXT = 32, 1024  # the `server` fixture's
MAX_DRAFT_TOKENS = 8  # model_repository/speculative_decoding
BYSTANDER = "The capital of France is"
REFUSAL_BOUND_S = 20.0  # a hang detector, not a timing: a refusal never waits for generation


def scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


GOOD = {"text_input": scalar(b"Name a colour.", np.object_), "max_tokens": scalar(4, np.int32)}


def without(name: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != name}


def context_prompt(tokenizer, num_tokens: int) -> bytes:
    """A prompt of exactly `num_tokens` tokens."""
    text = "a" + " a" * (num_tokens - 1)
    assert len(tokenizer.encode(text)) == num_tokens
    return text.encode()


def bad_inputs(tokenizer) -> list[tuple[str, dict]]:
    """(field the error must name, tensors) for every kind of bad input."""
    over_context = context_prompt(tokenizer, MAX_CONTEXT + 1)
    return [
        ("text_input", without("text_input")),
        ("max_tokens", without("max_tokens")),
        ("no_such_input", {**GOOD, "no_such_input": scalar(1, np.int32)}),
        ("max_tokens", {**GOOD, "max_tokens": scalar(4.0, np.float32)}),  # wrong dtype
        ("temperature", {**GOOD, "temperature": scalar(1, np.int32)}),
        ("text_input", {**GOOD, "text_input": scalar(7, np.int32)}),
        ("max_tokens", {**GOOD, "max_tokens": np.array([[4, 4]], dtype=np.int32)}),  # shape
        ("text_input", {**GOOD, "text_input": np.array([[[b"x"]]], dtype=np.object_)}),
        ("text_input", {**GOOD, "text_input": scalar(b"", np.object_)}),
        ("text_input", {**GOOD, "text_input": scalar(b"\xff\xfe caf\xc3", np.object_)}),
        ("text_input", {**GOOD, "text_input": scalar(over_context, np.object_)}),
        ("max_tokens", {**GOOD, "max_tokens": scalar(0, np.int32)}),
        ("max_tokens", {**GOOD, "max_tokens": scalar(-1, np.int32)}),
        ("max_tokens", {**GOOD, "max_tokens": scalar(MAX_CONTEXT + 1, np.int32)}),
        ("temperature", {**GOOD, "temperature": scalar(-0.5, np.float32)}),
        ("temperature", {**GOOD, "temperature": scalar(np.nan, np.float32)}),
        ("temperature", {**GOOD, "temperature": scalar(np.inf, np.float32)}),
        ("top_p", {**GOOD, "top_p": scalar(0.0, np.float32)}),
        ("top_p", {**GOOD, "top_p": scalar(-0.3, np.float32)}),
        ("top_p", {**GOOD, "top_p": scalar(1.5, np.float32)}),
        ("top_k", {**GOOD, "top_k": scalar(-2, np.int32)}),
        ("num_draft_tokens", {**GOOD, "num_draft_tokens": scalar(-1, np.int32)}),
        (
            "num_draft_tokens",
            {**GOOD, "num_draft_tokens": scalar(MAX_DRAFT_TOKENS + 1, np.int32)},
        ),
        ("proposer", {**GOOD, "proposer": scalar(b"eagle", np.object_)}),
        ("stop_words", {**GOOD, "stop_words": np.array([[[b"a"]]], dtype=np.object_)}),
        ("stop_words", {**GOOD, "stop_words": np.array([[1, 2]], dtype=np.int32)}),
    ]


def send(url: str, model: str, tensors: dict[str, np.ndarray]):
    """One request with these exact tensors on its own stream: (error message or None, text)."""
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    responses = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        wait_for(lambda: any(is_final(r, e) for r, e in responses), timeout=REFUSAL_BOUND_S)
    finally:
        client.stop_stream()
        client.close()
    errors = [e for _, e in responses if e is not None]
    text = b"".join(
        r.as_numpy("text_output").reshape(-1)[0]
        for r, e in responses
        if e is None and r.as_numpy("text_output") is not None
    )
    return (errors[0].message() if errors else None), text.decode()


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return load_tokenizer(target_dir)


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_every_bad_input_is_refused_by_name_and_the_batch_goes_on(
    server, hf_target, tokenizer, model
):
    expected = hf_greedy_text(hf_target, BYSTANDER, 96)
    bystander = start_bystander(server.url, BYSTANDER, 96, model)
    wait_for(lambda: scrape(server.metrics_url)["specdec_running_batch_size"] >= 1)
    for field, tensors in bad_inputs(tokenizer):
        message, _ = send(server.url, model, tensors)
        assert message is not None, f"{field}: accepted"
        assert field in message, f"{field}: {message}"
    assert bystander.result().error is None
    assert bystander.result().text == expected


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_a_prompt_at_the_context_length_is_served(server, tokenizer, model):
    prompt = context_prompt(tokenizer, MAX_CONTEXT)
    tensors = {**GOOD, "text_input": scalar(prompt, np.object_)}
    tensors["exclude_input_in_output"] = scalar(True, np.bool_)
    message, text = send(server.url, model, tensors)
    assert message is None
    assert text  # one token fits: the slot holds the prompt, the new token needs no cache


def process_memory_settled(server) -> int:
    """Resident bytes once freed memory has been handed back (allocators lag a little)."""
    time.sleep(1.0)
    return server.memory_bytes()


def test_fifty_random_cancellations_free_everything(server, hf_target):
    expected = hf_greedy_text(hf_target, BYSTANDER, 40)
    rng = random.Random(7)

    def cancel_wave(count: int) -> None:
        victims = [
            start_victim(server.url, f"Tell me a long story, number {i}.") for i in range(count)
        ]
        for client, chunks in victims:
            point = rng.randint(1, 12)  # chunks to wait for before cancelling
            wait_for(lambda chunks=chunks, point=point: len(chunks) >= point)
            client.stop_stream(cancel_requests=True)
            client.close()

    cancel_wave(10)  # warm-up: slots and allocator pools the waves below reuse
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)
    before_memory = process_memory_settled(server)
    cancelled_key = 'specdec_requests_total{outcome="cancelled"}'
    before = scrape(server.metrics_url).get(cancelled_key, 0)
    for _ in range(5):
        cancel_wave(10)
    wait_for(lambda: scrape(server.metrics_url)[cancelled_key] - before >= 50)
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)
    after = scrape(server.metrics_url)
    assert after[cancelled_key] - before == 50
    assert after["specdec_running_batch_size"] == 0
    assert after["specdec_queued_requests"] == 0
    after_memory = process_memory_settled(server)
    assert after_memory < before_memory * 1.05, (before_memory, after_memory)
    result = generate(BYSTANDER, url=server.url, max_tokens=40, exclude_input_in_output=True)
    assert result.text == expected
