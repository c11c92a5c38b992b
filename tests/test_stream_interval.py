"""stream_interval: a streamed sequence answers once that many output tokens have gathered
since its last response; its first text and its final response go at once, and the chunks
still join to the non-streamed text (specdec/serving/responses.py StreamHold, the BLS's
_respond). First the hold alone, then through a real server whose STREAM_INTERVAL is 4.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from live import is_final, scrape, wait_for
from specdec.client import build_inputs, generate, requested_outputs
from specdec.harness import ManagedServer
from specdec.serving.responses import StreamHold

PROMPT = "Count from one to forty, separated by commas:"
NUM_TOKENS = 24
SERVER_INTERVAL = 4  # the server fixture's STREAM_INTERVAL


# -- the hold alone ------------------------------------------------------------------------
def feed(hold: StreamHold, steps: list[tuple[int, str]], interval: int) -> list[tuple[int, str]]:
    """(output tokens after the step, its new text) per iteration, the last one final:
    (output tokens, text) of each response sent."""
    sent = []
    for i, (num_tokens, text) in enumerate(steps):
        final = i == len(steps) - 1
        out = hold.take(7, text, num_tokens, interval, final)
        if out is not None:
            sent.append((num_tokens, out))
    return sent


def test_one_token_per_iteration_answers_every_interval_tokens():
    steps = [(n, f"t{n} ") for n in range(1, 11)]  # 10 iterations, one token each
    sent = feed(StreamHold(), steps, interval=4)
    assert [n for n, _ in sent] == [1, 5, 9, 10]  # the first at once, the final at once
    assert sent[1][1] == "t2 t3 t4 t5 "
    assert "".join(text for _, text in sent) == "".join(text for _, text in steps)


def test_the_first_text_goes_at_once_even_when_it_comes_late():
    # Token 1 is half a UTF-8 character: no text yet; token 2 completes it.
    steps = [(1, ""), (2, "é"), (3, "a"), (5, "bc"), (6, "d"), (7, "e"), (8, "")]
    sent = feed(StreamHold(), steps, interval=4)
    assert sent == [(2, "é"), (6, "abcd"), (8, "e")]


def test_speculative_steps_count_tokens_not_iterations():
    # Several tokens per iteration: a response once 4 tokens have come since the last one.
    steps = [(3, "abc"), (5, "de"), (7, "fg"), (8, "h"), (12, "ijkl"), (13, "m")]
    sent = feed(StreamHold(), steps, interval=4)
    assert sent == [(3, "abc"), (7, "defg"), (12, "hijkl"), (13, "m")]


def test_a_final_response_carries_what_was_held_even_with_no_new_text():
    hold = StreamHold()
    assert hold.take(1, "a", 1, 8, False) == "a"
    assert hold.take(1, "b", 2, 8, False) is None
    assert hold.take(2, "x", 1, 8, False) == "x"  # sequences are held apart
    assert hold.take(1, "", 2, 8, True) == "b"  # e.g. the end token: no text of its own
    assert hold.take(2, "y", 3, 8, True) == "y"


def test_interval_one_answers_every_iteration_with_text():
    steps = [(1, "a"), (2, ""), (3, "b"), (4, "c")]
    sent = feed(StreamHold(), steps, interval=1)
    assert sent == [(1, "a"), (3, "b"), (4, "c")]


# -- through the server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def interval_server(target_dir):
    running = ManagedServer(
        "test-stream-interval",
        {"STREAM_INTERVAL": str(SERVER_INTERVAL), "NUM_SLOTS": "4", "MAX_CONTEXT": "512"},
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_text(interval_server) -> str:
    """The non-streamed answer: what every stream's chunks must join to."""
    result = generate(
        PROMPT,
        url=interval_server.url,
        model="speculative_decoding",
        max_tokens=NUM_TOKENS,
        num_draft_tokens=0,
        exclude_input_in_output=True,
    )
    assert result.error is None and result.text
    return result.text


@dataclass
class Streamed:
    chunks: list[str] = field(default_factory=list)  # each response's text
    num_tokens: list[int] = field(default_factory=list)  # num_output_tokens on each response
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def stream(url: str, model: str, **params) -> Streamed:
    """One streamed request of PROMPT on its own stream, every response recorded."""
    params = {"stream": True, "return_num_output_tokens": True, **params}
    responses: list = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    try:
        client.async_stream_infer(
            model,
            build_inputs(PROMPT, **params),
            outputs=requested_outputs(**params),
            enable_empty_final_response=True,
        )
        wait_for(lambda: any(is_final(r, e) for r, e in responses), timeout=300)
    finally:
        client.stop_stream()
        client.close()
    streamed = Streamed()
    for result, error in responses:
        if error is not None:
            streamed.error = error.message()
        elif result.as_numpy("text_output") is not None:  # not the empty final one
            streamed.chunks.append(result.as_numpy("text_output")[0].decode())
            streamed.num_tokens.append(int(result.as_numpy("num_output_tokens")[0][0]))
    return streamed


@pytest.mark.server
def test_an_interval_of_four_sends_a_response_per_four_tokens(interval_server, plain_text):
    streamed = stream(
        interval_server.url,
        "speculative_decoding",
        max_tokens=NUM_TOKENS,
        num_draft_tokens=0,  # one token per iteration: the counts are exact
        stream_interval=4,
    )
    assert streamed.error is None
    assert streamed.text == plain_text
    counts = streamed.num_tokens
    num_output = counts[-1]  # the final response's count: every token
    assert num_output > 8  # a long enough answer for the counts below to mean something
    assert counts[0] == 1 and streamed.chunks[0]  # the first token alone, at once
    gaps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    assert all(gap >= 4 for gap in gaps[:-1]), counts  # then every 4 tokens (or more)
    assert gaps[-1] >= 1  # the final one at once, however few tokens it adds
    assert len(counts) <= math.ceil(num_output / 4) + 1, counts


@pytest.mark.server
def test_the_servers_interval_is_the_default_and_a_request_overrides_it(
    interval_server, plain_text
):
    # Through the ensemble, which must pass stream_interval on; adaptive speculation.
    default = stream(interval_server.url, "ensemble", max_tokens=NUM_TOKENS)
    assert default.error is None
    assert default.text == plain_text
    gaps = [b - a for a, b in zip(default.num_tokens, default.num_tokens[1:], strict=False)]
    assert all(gap >= SERVER_INTERVAL for gap in gaps[:-1]), default.num_tokens
    assert len(default.num_tokens) <= math.ceil(default.num_tokens[-1] / SERVER_INTERVAL) + 1

    # The control: an interval of 1, one token per iteration, answers at every token.
    each = stream(
        interval_server.url,
        "ensemble",
        max_tokens=NUM_TOKENS,
        num_draft_tokens=0,
        stream_interval=1,
    )
    assert each.error is None
    assert each.text == plain_text
    assert each.num_tokens == list(range(1, each.num_tokens[-1] + 1))


def send_raw(url: str, model: str, value: np.ndarray) -> str | None:
    """A streamed request whose stream_interval is `value` as given: its error message."""
    inputs = build_inputs(PROMPT, max_tokens=4, stream=True)
    tensor = grpcclient.InferInput(
        "stream_interval", list(value.shape), np_to_triton_dtype(value.dtype)
    )
    tensor.set_data_from_numpy(value)
    inputs.append(tensor)
    responses: list = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        wait_for(lambda: any(is_final(r, e) for r, e in responses), timeout=60)
    finally:
        client.stop_stream()
        client.close()
    errors = [e.message() for _, e in responses if e is not None]
    return errors[0] if errors else None


@pytest.mark.server
def test_a_bad_stream_interval_is_refused_by_name_while_a_good_request_completes(
    interval_server, plain_text
):
    url = interval_server.url
    good: list[Streamed] = []
    runner = threading.Thread(
        target=lambda: good.append(
            stream(url, "speculative_decoding", max_tokens=NUM_TOKENS, num_draft_tokens=0)
        )
    )
    before = scrape(interval_server.metrics_url)
    runner.start()
    wait_for(lambda: scrape(interval_server.metrics_url)["specdec_running_batch_size"] >= 1)
    # Values the BLS refuses (INVALID_ARG), and dtypes Triton refuses before it.
    refused_by_the_bls = [
        ("speculative_decoding", np.array([[0]], dtype=np.int32)),
        ("speculative_decoding", np.array([[-3]], dtype=np.int32)),
        ("ensemble", np.array([[0]], dtype=np.int32)),
    ]
    for model, value in refused_by_the_bls:
        message = send_raw(url, model, value)
        # (the ensemble puts "in ensemble 'ensemble', " before the BLS's message)
        assert message is not None and "stream_interval: must be >= 1" in message, message
    for value in (np.array([[2.0]], dtype=np.float32), np.array([[b"4"]], dtype=np.object_)):
        message = send_raw(url, "speculative_decoding", value)
        assert message is not None and "stream_interval" in message, message
    runner.join(timeout=300)
    assert good and good[0].error is None
    assert good[0].text == plain_text  # the request beside them went on, exactly
    after = scrape(interval_server.metrics_url)
    invalid = 'specdec_requests_total{outcome="invalid"}'
    assert after.get(invalid, 0) - before.get(invalid, 0) == len(refused_by_the_bls)
