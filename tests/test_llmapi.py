"""TensorRT-LLM's LLM-API model (`tensorrt_llm`, and `tensorrt_llm_stream` decoupled) on the
real server: requests built as its clients build them, against the ensemble's answers.

Its tools/llmapi_client.py is not run itself (no network here to fetch it, and its code is
not ours to vendor): `llmapi_call` builds each request the way it does (1-D numpy tensors
through np_to_triton_dtype, `text_input` and `sampling_param_max_tokens`, a unary
async_infer with a request id, a callback and the `Streaming` request parameter, one result
awaited; a stop: an empty `text_input` and `stop` True under the same request id), and its
end_to_end_test.py --test-llmapi streams with the `streaming` input on a gRPC stream."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from specdec.client import generate

pytestmark = pytest.mark.server

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPT = CHAT.format("What is the capital of Italy?")
LONG_PROMPT = CHAT.format("Write a long story about a lighthouse keeper and the sea.")
# Asked by one test each: the suffix proposer stores earlier answers, and an answer proposed
# whole comes in one step.
BAKER_PROMPT = CHAT.format("Write a long story about a baker who moves to the mountains.")
PILOT_PROMPT = CHAT.format("Write a long story about a pilot who flies over the desert.")
GARDEN_PROMPT = CHAT.format("Describe a garden in spring, in many details.")


def prepare_tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def llmapi_inputs(prompt: str, max_tokens: int, **extra) -> list[grpcclient.InferInput]:
    """As its client's _prepare_inputs, plus 1-D extras (bool, int32, float32, str lists)."""
    inputs = [
        prepare_tensor("text_input", np.array([prompt], dtype=object)),
        prepare_tensor("sampling_param_max_tokens", np.array([max_tokens], dtype=np.int32)),
    ]
    for name, value in extra.items():
        if isinstance(value, list):
            array = np.array(value, dtype=object)
        elif isinstance(value, bool):
            array = np.array([value], dtype=bool)
        elif isinstance(value, int):
            array = np.array([value], dtype=np.int32)
        else:
            array = np.array([value], dtype=np.float32)
        inputs.append(prepare_tensor(name, array))
    return inputs


def stop_inputs() -> list[grpcclient.InferInput]:
    """As its client's prepare_stop_signals."""
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("stop", [1], "BOOL"),
    ]
    inputs[0].set_data_from_numpy(np.empty([1], dtype=np.bytes_))
    inputs[1].set_data_from_numpy(np.array([True], dtype="bool"))
    return inputs


def _callback(results: queue.Queue, result, error) -> None:
    results.put(error if error else result)


def llmapi_call(url, inputs, request_id="1", streaming=False, model="tensorrt_llm", timeout=300):
    """One unary call as its client makes it; the result or the InferenceServerException."""
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.async_infer(
            model,
            inputs,
            outputs=None,
            request_id=request_id,
            callback=partial(_callback, results),
            parameters={"Streaming": streaming},
        )
        return results.get(timeout=timeout)


def stream_call(url, inputs, request_id, model="tensorrt_llm_stream") -> list:
    """One request on a gRPC stream (end_to_end_test.py's async_stream_infer), to its end:
    its results and errors in order."""
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=partial(_callback, results))
        client.async_stream_infer(model, inputs, request_id=request_id)
        client.stop_stream()
    return [results.get() for _ in range(results.qsize())]


def text_of(result) -> str:
    assert not isinstance(result, InferenceServerException), result
    return result.as_numpy("text_output")[0].decode("utf-8")


def ensemble_text(url, prompt, max_tokens, **params) -> str:
    result = generate(
        prompt, url=url, max_tokens=max_tokens, exclude_input_in_output=True, **params
    )
    assert result.error is None, result.error
    return result.text


@pytest.mark.parametrize("streaming", [False, True])
def test_its_client_gets_the_ensembles_greedy_text(server, streaming):
    """The Streaming parameter of its client changes nothing on a unary call."""
    result = llmapi_call(server.url, llmapi_inputs(PROMPT, 16), streaming=streaming)
    assert result.as_numpy("text_output").shape == (1,)
    assert text_of(result) == ensemble_text(server.url, PROMPT, 16)


def test_without_max_tokens_it_answers_the_llm_apis_default_32(server):
    inputs = [prepare_tensor("text_input", np.array([LONG_PROMPT], dtype=object))]
    inputs.append(prepare_tensor("return_finish_reason", np.array([True])))
    result = llmapi_call(server.url, inputs)
    assert text_of(result) == ensemble_text(server.url, LONG_PROMPT, 32)
    assert result.as_numpy("finish_reason")[0] == b"length"


def generate_endpoint(server, body: dict, model: str = "tensorrt_llm") -> tuple[int, dict]:
    url = f"http://127.0.0.1:{server.config.http_port}/v2/models/{model}/generate"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_generate_endpoint_answers_with_its_outputs(server):
    """curl -X POST .../v2/models/tensorrt_llm/generate -d '{"text_input": ..., ...}'."""
    body = {
        "text_input": LONG_PROMPT,
        "sampling_param_max_tokens": 12,
        "return_finish_reason": True,
        "return_stop_reason": True,
        "sampling_param_return_perf_metrics": True,
    }
    status, answer = generate_endpoint(server, body)
    assert status == 200, answer
    assert answer["text_output"] == ensemble_text(server.url, LONG_PROMPT, 12)
    assert answer["finish_reason"] == "length" and answer["stop_reason"] == "None"
    total = answer["kv_cache_alloc_total_blocks"]
    assert total > 12 and answer["kv_cache_missed_block"] == answer["kv_cache_alloc_new_blocks"]
    assert answer["kv_cache_reused_block"] + answer["kv_cache_missed_block"] == total
    assert 0 <= answer["total_accepted_draft_tokens"] <= answer["total_draft_tokens"]
    drafted = answer["total_draft_tokens"]
    rate = answer["total_accepted_draft_tokens"] / drafted if drafted else 0.0
    assert answer["acceptance_rate"] == pytest.approx(rate)
    times = [answer[f"{t}_time_ns"] for t in ("arrival", "first_scheduled", "first_token")]
    assert 0 < times[0] <= times[1] <= times[2] <= answer["last_token_time_ns"]


def test_a_refusal_over_http_names_the_field(server):
    status, answer = generate_endpoint(
        server, {"text_input": PROMPT, "sampling_param_max_tokens": 0}
    )
    assert status == 400 and answer["error"].startswith("sampling_param_max_tokens:"), answer


def test_stop_words_end_the_answer_before_them(server):
    """The LLM API leaves the stop string out of the text and names it in stop_reason."""
    full = ensemble_text(server.url, LONG_PROMPT, 40)
    word = full.split()[len(full.split()) // 2]
    inputs = llmapi_inputs(
        LONG_PROMPT,
        40,
        sampling_param_stop=[word],
        return_finish_reason=True,
        return_stop_reason=True,
    )
    result = llmapi_call(server.url, inputs)
    assert text_of(result) == full[: full.index(word)]
    assert result.as_numpy("finish_reason")[0] == b"stop"
    assert result.as_numpy("stop_reason")[0].decode() == word


def test_cumulative_logprob_is_the_ensembles(server):
    inputs = llmapi_inputs(PROMPT, 10, return_cumulative_logprob=True)
    result = llmapi_call(server.url, inputs)
    reference = generate(PROMPT, url=server.url, max_tokens=10, return_log_probs=True)
    value = result.as_numpy("cumulative_logprob")
    assert value.shape == (1,) and value[0] < 0
    assert value[0] == pytest.approx(reference.metrics["cum_log_probs"], abs=1e-4)


def test_two_requests_run_in_the_loop_at_once(server):
    """Unary calls do not wait for each other: both are in the loop's batch at the same
    time (each one's span from its first scheduling to its last token overlaps the other's)."""
    spans = []

    def one(prompt: str) -> None:
        inputs = llmapi_inputs(prompt, 48, sampling_param_return_perf_metrics=True)
        result = llmapi_call(server.url, inputs, request_id=prompt[-20:])
        spans.append(
            (
                int(result.as_numpy("first_scheduled_time_ns")[0]),
                int(result.as_numpy("last_token_time_ns")[0]),
            )
        )

    threads = [threading.Thread(target=one, args=(p,)) for p in (BAKER_PROMPT, PILOT_PROMPT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(spans) == 2
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans


def start_long_request(url, request_id, results: list, model="tensorrt_llm"):
    def run():
        began = time.monotonic()
        results.append(llmapi_call(url, llmapi_inputs(LONG_PROMPT, 400), request_id, model=model))
        results.append(time.monotonic() - began)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def stop_until_found(url, request_id, model="tensorrt_llm") -> str:
    """Sends stop requests until one finds the request running; its message."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if model == "tensorrt_llm":
            answer = llmapi_call(url, stop_inputs(), request_id)
        else:  # decoupled: gRPC streams only
            (answer,) = stream_call(url, stop_inputs(), request_id, model)
        assert isinstance(answer, InferenceServerException)
        if model == "tensorrt_llm":  # a stream's error carries no status code
            assert answer.status() == "StatusCode.CANCELLED", answer.message()
        if "stopped" in answer.message():
            return answer.message()
        time.sleep(0.2)
    raise AssertionError("the request never ran")


@pytest.mark.parametrize("stop_model", ["tensorrt_llm", "tensorrt_llm_stream"])
def test_stop_ends_the_running_request_of_its_id(server, stop_model):
    """A stop ends the request at once with CANCELLED, sent to either model (they share the
    loop's keys); the id is free again afterwards."""
    results: list = []
    thread = start_long_request(server.url, "story-1", results)
    stop_until_found(server.url, "story-1", model=stop_model)
    thread.join(timeout=120)
    stopped, seconds = results
    assert isinstance(stopped, InferenceServerException), text_of(stopped)
    assert stopped.status() == "StatusCode.CANCELLED" and "stopped" in stopped.message()
    again = llmapi_call(server.url, llmapi_inputs(PROMPT, 8), "story-1")
    assert text_of(again) == ensemble_text(server.url, PROMPT, 8)
    assert seconds < 60  # 400 tokens take minutes here


def test_stop_of_an_unknown_id_or_none(server):
    """As TensorRT-LLM answers it: CANCELLED whether or not the id ran; without an id the
    stop names the field."""
    answer = llmapi_call(server.url, stop_inputs(), "no-such-request")
    assert answer.status() == "StatusCode.CANCELLED" and "no running request" in answer.message()
    answer = llmapi_call(server.url, stop_inputs(), request_id="")
    assert answer.status() == "StatusCode.INVALID_ARGUMENT" and answer.message().startswith("stop:")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"sampling_param_max_tokens": 0}, "sampling_param_max_tokens"),
        ({"sampling_param_top_p": 1.5}, "sampling_param_top_p"),
        ({"sampling_param_temperature": -1.0}, "sampling_param_temperature"),
        ({"sampling_param_best_of": 2}, "sampling_param_best_of"),
        ({"sampling_param_presence_penalty": float("nan")}, "sampling_param_presence_penalty"),
        ({"lora_name": ["adapter"]}, "lora_name"),
        ({"streaming": True}, "streaming"),
    ],
)
def test_bad_input_is_refused_by_name_while_others_go_on(server, extra, field):
    results: list = []
    good = threading.Thread(
        target=lambda: results.append(llmapi_call(server.url, llmapi_inputs(PROMPT, 24), "ok"))
    )
    good.start()
    inputs = llmapi_inputs(PROMPT, 8)
    if "sampling_param_max_tokens" in extra:
        inputs = inputs[:1]
    answer = llmapi_call(server.url, inputs + llmapi_inputs("", 1, **extra)[2:], "bad")
    good.join(timeout=300)
    assert isinstance(answer, InferenceServerException)
    assert answer.status() == "StatusCode.INVALID_ARGUMENT", answer
    assert answer.message().startswith(f"{field}:"), answer.message()
    assert text_of(results[0]) == ensemble_text(server.url, PROMPT, 24)


def test_a_missing_prompt_is_refused_by_name(server):
    inputs = [prepare_tensor("sampling_param_max_tokens", np.array([4], dtype=np.int32))]
    answer = llmapi_call(server.url, inputs)
    assert answer.status() == "StatusCode.INVALID_ARGUMENT" and answer.message().startswith(
        "text_input:"
    )


def test_the_decoupled_copy_streams_the_whole_text_so_far(server):
    """end_to_end_test.py --test-llmapi --streaming: the `streaming` input on a gRPC stream;
    each response carries the text so far, finish_reason comes with the last."""
    inputs = llmapi_inputs(GARDEN_PROMPT, 16, streaming=True, return_finish_reason=True)
    results = stream_call(server.url, inputs, "s1", "tensorrt_llm_stream")
    texts = [text_of(result) for result in results]
    reasons = [result.as_numpy("finish_reason")[0].decode() for result in results]
    assert len(set(texts)) >= 2, texts
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), texts
    assert texts[-1] == ensemble_text(server.url, GARDEN_PROMPT, 16)
    assert reasons[-1] == "length" and set(reasons[:-1]) == {"None"}


def test_a_cancelled_call_leaves_the_loop(server):
    """Its client's --stop-via-request-cancel: the cancelled call's request leaves the
    loop's batch (the loop counts it cancelled)."""
    from specdec.client import scrape_metrics

    key = 'specdec_requests_total{outcome="cancelled"}'
    before = scrape_metrics(server.metrics_url).get(key, 0.0)
    with grpcclient.InferenceServerClient(server.url) as client:
        future = client.async_infer(
            "tensorrt_llm",
            llmapi_inputs(LONG_PROMPT, 400),
            request_id="cancel-me",
            callback=lambda result, error: None,
            parameters={"Streaming": False},
        )
        time.sleep(3)
        future.cancel()
    deadline = time.monotonic() + 60
    while scrape_metrics(server.metrics_url).get(key, 0.0) == before:
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.5)
