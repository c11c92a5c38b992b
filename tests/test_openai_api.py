"""The OpenAI-compatible API (specdec/openai_api/app.py) against the real server, through the
official `openai` package and genai-perf's chat endpoint type."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request
from functools import cache
from pathlib import Path

import openai
import pytest

from live import openai_api_process, scrape, wait_for
from specdec.client import generate
from specdec.paths import PROJECT_ROOT
from specdec.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.server

MODEL = "smollm2-135m-instruct"  # the target checkpoint's folder name
NUM_SLOTS = 32  # the `server` fixture's
CANCELLED = 'specdec_requests_total{outcome="cancelled"}'


@pytest.fixture(scope="module")
def api(server, tmp_path_factory):
    with openai_api_process(server, tmp_path_factory.mktemp("openai_api") / "api.log") as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)


@cache
def bls_text(url: str, prompt: str, max_tokens: int) -> str:
    """Greedy text of the gRPC client: what the API must return for the same prompt."""
    result = generate(prompt, url=url, max_tokens=max_tokens, exclude_input_in_output=True)
    assert result.error is None, result.error
    return result.text


def chat_prompt(target_dir: Path, content: str) -> str:
    return load_tokenizer(str(target_dir)).apply_chat_template(content)


def test_models_names_the_served_target(client):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_greedy_equals_the_grpc_text_whole_and_streamed(server, client, target_dir):
    question = "What is the capital of Italy?"
    prompt = chat_prompt(target_dir, question)
    expected = bls_text(server.url, prompt, 16)
    messages = [{"role": "user", "content": question}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    assert whole.choices[0].message.content == expected
    num_prompt = len(load_tokenizer(str(target_dir)).encode(prompt))
    assert whole.usage.prompt_tokens == num_prompt
    num_output = whole.usage.completion_tokens
    assert whole.usage.total_tokens == num_prompt + num_output
    assert whole.choices[0].finish_reason == ("length" if num_output == 16 else "stop")

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected
    # Streamed as it came, not in one piece. With speculation one iteration may carry the
    # whole answer (the suffix store has seen this question before), so count pieces at k = 0,
    # where every iteration commits one token.
    plain = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"num_draft_tokens": 0},
    )
    pieces = [c.choices[0].delta.content for c in plain if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == expected
    assert len(pieces) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_greedy_whole_and_streamed(server, client):
    prompt = "The capital of France is"
    expected = bls_text(server.url, prompt, 12)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.completion_tokens <= 12
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_n_and_several_prompts_map_to_choice_indices(server, client):
    """Two prompts x n = 2, greedy: choice index = prompt * n + sequence, each the prompt's
    greedy text; usage counts each prompt once and every sequence."""
    prompts = ["The capital of France is", "Two plus two is"]
    whole = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=12, temperature=0
    )
    texts = {choice.index: choice.text for choice in whole.choices}
    expected = [bls_text(server.url, p, 12) for p in prompts]
    assert texts == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    tokenizer = load_tokenizer(str(PROJECT_ROOT / "models" / MODEL))
    assert whole.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)


def test_n_sampled_streams_reassemble_by_index(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    reasons = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert sorted(texts) == [0, 1] and all(texts.values())
    assert texts[0] != texts[1]  # independent draws
    assert set(reasons.values()) <= {"stop", "length"} and None not in reasons.values()
    assert 0 < usage.completion_tokens <= 24


def test_stop_sequences_are_left_out(server, client):
    prompt = "The capital of France is"
    expected = bls_text(server.url, prompt, 12)
    words = expected.split()
    assert len(words) >= 3, expected
    stop = " " + words[2]  # the third word and what follows are cut
    cut = expected[: expected.index(stop)]
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"extra_body": {"best_of": 2}}, "best_of"),  # not a field of this server
        ({"temperature": 5.0}, "temperature"),  # out of OpenAI's range
        ({"n": 1000}, "n"),  # the BLS's InvalidInput (num_return_sequences), passed through
        ({"presence_penalty": 2.5}, "presence_penalty"),  # out of OpenAI's range
        ({"logit_bias": {"999999": 5}}, "logit_bias"),  # the BLS's: outside the vocabulary
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"num_draft_tokens": 99}}, "num_draft_tokens"),  # likewise
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_fields_are_refused_with_400_naming_them(client, extra, param, stream):
    fields = {"max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as refused:  # streamed too: before any event
        client.completions.create(model=MODEL, prompt="Hello", stream=stream, **fields)
    error = refused.value
    assert error.status_code == 400 and error.param == param, error.body
    assert error.type == "invalid_request_error"
    assert error.body["message"].startswith(f"{param}:"), error.body


def test_unknown_model_is_404_and_the_api_keeps_serving(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_a_closed_stream_cancels_its_request_and_frees_its_slot(server, client):
    before = scrape(server.metrics_url)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        max_tokens=1000,
        temperature=0,
        stream=True,
    )
    for count, _chunk in enumerate(stream):
        if count == 4:  # mid-generation
            break
    busy = scrape(server.metrics_url)
    assert busy["specdec_free_kv_slots"] == NUM_SLOTS - 1
    stream.close()  # the client goes away: the connection closes
    wait_for(lambda: scrape(server.metrics_url).get(CANCELLED, 0) > before.get(CANCELLED, 0))
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)
    freed = scrape(server.metrics_url)
    # The BLS drops it at its next iteration once the cancellation reaches it; the HTTP hop
    # adds little (one iteration here; the bound leaves room for a loaded machine).
    assert freed["specdec_iterations_total"] - busy["specdec_iterations_total"] <= 5
    assert freed["specdec_emitted_tokens_total"] - before["specdec_emitted_tokens_total"] < 100


def test_a_client_that_stops_waiting_cancels_a_whole_request(server, api):
    before = scrape(server.metrics_url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}
    request = urllib.request.Request(
        f"{api}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises((socket.timeout, TimeoutError)):
        urllib.request.urlopen(request, timeout=2)  # gives up and closes the connection
    wait_for(lambda: scrape(server.metrics_url).get(CANCELLED, 0) > before.get(CANCELLED, 0))
    wait_for(lambda: scrape(server.metrics_url)["specdec_free_kv_slots"] == NUM_SLOTS)


def test_genai_perf_chat_endpoint(api, tmp_path):
    """genai-perf 0.0.16, --endpoint-type chat (streamed), a few short requests."""
    host_port = api.removeprefix("http://").removesuffix("/v1")
    subprocess.run(
        [
            str(PROJECT_ROOT / "loadtest" / "genai_perf.sh"),
            "-m",
            MODEL,
            "-u",
            host_port,
            "--concurrency",
            "1",
            "--request-count",
            "3",
            "--warmup-request-count",
            "0",
            "--synthetic-input-tokens-mean",
            "16",
            "--output-tokens-mean",
            "8",
            "--artifact-dir",
            str(tmp_path),
        ],
        env={**os.environ, "ENDPOINT_TYPE": "chat"},
        check=True,
        capture_output=True,
        timeout=600,  # the first run builds genai-perf's venv
        cwd=PROJECT_ROOT,
    )
    (summary,) = tmp_path.glob("*/profile_export_genai_perf.json")
    metrics = json.loads(summary.read_text())
    assert metrics["request_count"]["avg"] == 3
    assert metrics["time_to_first_token"]["avg"] > 0
    assert metrics["output_sequence_length"]["avg"] > 0
    (raw,) = tmp_path.glob("*/profile_export.json")
    requests = json.loads(raw.read_text())["experiments"][0]["requests"]
    assert len(requests) == 3
    for request in requests:
        sent = json.loads(request["request_inputs"]["payload"])
        assert sent["stream"] is True and sent["max_tokens"] == 8
        assert request["response_outputs"][-1]["response"].strip() == "data: [DONE]"


def served_counts(metrics_url: str) -> tuple[float, float]:
    """The server's requests (every outcome) and emitted tokens so far."""
    metrics = scrape(metrics_url)
    requests = sum(v for k, v in metrics.items() if k.startswith("specdec_requests_total{"))
    return requests, metrics.get("specdec_emitted_tokens_total", 0.0)


@pytest.mark.parametrize("endpoint_type", ["chat", "triton"])
def test_aiperf_counts_what_the_server_counts(server, api, tmp_path, endpoint_type):
    """AIPerf 0.13 (loadtest/aiperf.sh) in miniature, streamed, through the OpenAI API (chat)
    and Triton's HTTP generate extension on the ensemble (triton): its requests are the
    server's; its output tokens are the server's exactly where the answer reports usage
    (chat), and within one token per request where AIPerf counts by tokenizing the streamed
    text (triton: a token split across two chunks can be counted twice)."""
    num_requests = 3
    url = api.removeprefix("http://").removesuffix("/v1")
    if endpoint_type == "triton":
        url = f"127.0.0.1:{server.config.http_port}"
    before = served_counts(server.metrics_url)
    subprocess.run(
        [str(PROJECT_ROOT / "loadtest" / "aiperf.sh"), "-m", MODEL, "-u", url]
        + ["--concurrency", "1", "--request-count", str(num_requests)],
        env={
            **os.environ,
            "ENDPOINT_TYPE": endpoint_type,
            "INPUT_TOKENS": "16",
            "OUTPUT_TOKENS": "8",
            "ARTIFACT_DIR": str(tmp_path),
        },
        check=True,
        capture_output=True,
        timeout=900,  # the first run builds AIPerf's venv
        cwd=PROJECT_ROOT,
    )
    requests, tokens = (
        a - b for a, b in zip(served_counts(server.metrics_url), before, strict=True)
    )
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == num_requests == requests
    assert summary["error_summary"] == []
    records = [
        json.loads(line) for line in (tmp_path / "profile_export.jsonl").read_text().splitlines()
    ]
    assert len(records) == num_requests
    if endpoint_type == "chat":
        assert summary["usage_completion_tokens"]["sum"] == tokens
    else:
        assert abs(summary["total_osl"]["avg"] - tokens) <= num_requests, (
            summary["total_osl"],
            tokens,
        )
    assert 0 < tokens <= 8 * num_requests


def test_penalties_and_logit_bias_count_the_output_as_openai_does(client, target_dir, hf_target):
    """presence_penalty and frequency_penalty over the output only, logit_bias by token id:
    transformers' greedy text with the same processing, speculating (adaptive) or not."""
    from test_controls import MAX_TOKENS, hf_reference

    tokenizer = hf_target[0]
    question = "List the days of the week, twice."
    prompt_ids = tokenizer(chat_prompt(target_dir, question)).input_ids
    python = tokenizer(" Python", add_special_tokens=False).input_ids[0]
    controls = dict(presence_penalty=1.0, frequency_penalty=0.8, logit_bias={str(python): -5})
    reference = dict(
        presence_penalty=1.0,
        frequency_penalty=0.8,
        prompt_ignore_length=len(prompt_ids),
        logit_bias={python: -5.0},
    )
    tokens = hf_reference(hf_target, prompt_ids, reference, tokenizer.eos_token_id)
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    plain = hf_reference(hf_target, prompt_ids, {}, tokenizer.eos_token_id)
    assert tokens != plain
    messages = [{"role": "user", "content": question}]
    for extra in ({}, {"num_draft_tokens": 0}):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=extra,
            **controls,
        )
        assert answer.choices[0].message.content == expected, extra
