"""Triton locked, through the real server: gRPC over TLS (GRPC_SSL_CERT, GRPC_SSL_KEY) and the
inference key (TRITON_INFERENCE_KEY) beside the admin key (TRITON_ADMIN_KEY). One server of its
own for the module, with a certificate authority and a server certificate made here by the
openssl CLI; its greedy text must equal the plain session server's for the same prompt. What
is refused is refused with an error, within a timeout: no key, a wrong key, a plain-text
client, a client that trusts another authority."""

from __future__ import annotations

import json
import queue
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import tritonclient.grpc as grpcclient
from test_trtllm_compat import CHAT, stacked_inputs, texts_by_index
from tls import make_pki
from tritonclient.utils import InferenceServerException

from live import openai_api_process
from specdec.client import StreamingClient
from specdec.harness import ManagedServer
from specdec.triton_access import GRPC_HEADER_PREFIX, TritonAccess

pytestmark = pytest.mark.server

INFERENCE_KEY = secrets.token_hex(16)
ADMIN_KEY = secrets.token_hex(16)
PROMPT = CHAT.format("What is the capital of Italy?")
MAX_TOKENS = 16
REFUSAL_S = 15.0  # a refused client hears so within this (no hang)
RESTRICTED = "This protocol is restricted, expecting header"
MODEL = "smollm2-135m-instruct"  # the OpenAI API's name for the target checkpoint


# -- a certificate authority and the server's certificate (tests/tls.py) ---------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def locked(pki, target_dir):
    """The default models behind TLS and both keys (4 slots, float32, no start-up measurement:
    greedy text does not depend on it)."""
    running = ManagedServer(
        "test-security",
        {
            "NUM_SLOTS": "4",
            "MAX_CONTEXT": "512",
            "DTYPE": "float32",
            "CALIBRATION_SECONDS": "0",
            "TRITON_INFERENCE_KEY": INFERENCE_KEY,
            "TRITON_ADMIN_KEY": ADMIN_KEY,
            "GRPC_SSL_CERT": str(pki["cert"]),
            "GRPC_SSL_KEY": str(pki["key"]),
        },
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_text(server) -> str:
    """The plain session server's greedy text for PROMPT (no TLS, no key)."""
    with StreamingClient(server.url, access=TritonAccess()) as client:
        result = client.generate(PROMPT, max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    assert result.error is None and result.text, result.error
    return result.text


def tls_client(server: ManagedServer, pki: dict[str, Path]) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.url, ssl=True, root_certificates=str(pki["ca"]))


def generate(url: str, access: TritonAccess, **params):
    with StreamingClient(url, access=access) as client:
        return client.generate(
            PROMPT, timeout=REFUSAL_S, max_tokens=MAX_TOKENS, exclude_input_in_output=True, **params
        )


# -- gRPC --------------------------------------------------------------------------------------


def test_tls_and_the_key_give_the_plain_servers_greedy_text(locked, pki, plain_text):
    """specdec.client (the tools' client), one response at the end; TensorRT-LLM's call below
    streams."""
    result = generate(locked.url, TritonAccess(INFERENCE_KEY, str(pki["ca"])))
    assert result.error is None, result.error
    assert result.text == plain_text


def stream_once(client: grpcclient.InferenceServerClient, headers, **params) -> list:
    """One request on a fresh stream of `client`, as end_to_end_grpc_client.py sends it
    (start_stream, one async_stream_infer of [B, 1] inputs, stop_stream); the (result, error)
    pairs in arrival order. A stream refused as it opens reports why to the callback, and
    async_stream_infer raises that it is spent."""
    received: queue.Queue = queue.Queue()
    client.start_stream(
        callback=lambda result, error: received.put((result, error)),
        stream_timeout=300,
        headers=headers,
    )
    try:
        client.async_stream_infer(
            "ensemble",
            stacked_inputs([PROMPT], max_tokens=MAX_TOKENS, **params),
            outputs=[grpcclient.InferRequestedOutput("text_output")],
        )
    except InferenceServerException as spent:
        assert "no longer in valid state" in spent.message()
    client.stop_stream()
    return [received.get() for _ in range(received.qsize())]


@pytest.mark.parametrize(
    ("key", "header"),
    [
        (None, None),  # no key
        ("wrong-" + INFERENCE_KEY, None),
        # The key under the HTTP header's name: Triton's gRPC frontend wants the prefixed one.
        (None, {"inference-key": INFERENCE_KEY}),
    ],
    ids=["no-key", "wrong-key", "http-header-name"],
)
def test_inference_without_the_key_is_refused(locked, pki, key, header):
    client = tls_client(locked, pki)
    try:
        ((result, error),) = stream_once(client, header or TritonAccess(key).headers)
    finally:
        client.close()
    assert result is None and error is not None
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert f"{RESTRICTED} '{GRPC_HEADER_PREFIX}inference-key'" in error.message()
    # Our own client reports the same refusal as the request's error.
    refused = generate(locked.url, TritonAccess(key, str(pki["ca"])))
    assert refused.error is not None and RESTRICTED in refused.error.message()


def test_metadata_and_config_need_the_key_and_health_does_not(locked, pki):
    client = grpcclient.InferenceServerClient(
        locked.url, ssl=True, root_certificates=str(pki["ca"])
    )
    headers = TritonAccess(INFERENCE_KEY).headers
    try:
        assert client.is_server_ready() and client.is_model_ready("ensemble")  # no key
        for call in (client.get_model_metadata, client.get_model_config):
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                call("ensemble")
            assert call("ensemble", headers=headers)  # with it
    finally:
        client.close()


def test_the_admin_apis_take_their_own_key(locked, pki):
    """Two restriction groups at once: model control needs the admin key, not the inference
    key; with the admin key it reaches Triton, which refuses it (model control mode none)."""
    client = grpcclient.InferenceServerClient(
        locked.url, ssl=True, root_certificates=str(pki["ca"])
    )
    admin = {f"{GRPC_HEADER_PREFIX}admin-key": ADMIN_KEY}
    try:
        for headers in (None, TritonAccess(INFERENCE_KEY).headers):
            with pytest.raises(InferenceServerException, match=f"{RESTRICTED} '.*admin-key'"):
                client.unload_model("ensemble", headers=headers)
        with pytest.raises(InferenceServerException, match="(?i)not allowed|explicit"):
            client.unload_model("ensemble", headers=admin)
        assert client.is_model_ready("ensemble")
    finally:
        client.close()


def test_a_plain_text_client_is_refused_at_once(locked):
    """No TLS against the TLS port: an error within the timeout, for a unary call and for a
    stream as our clients open it, not a hang."""
    client = grpcclient.InferenceServerClient(locked.url)
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as refused:
        client.is_server_live(client_timeout=REFUSAL_S)
    client.close()
    assert time.monotonic() - start < REFUSAL_S / 2  # refused, not timed out
    assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
    result = generate(locked.url, TritonAccess(INFERENCE_KEY))  # the key, but plain text
    assert result.error is not None and result.error.status() == "StatusCode.UNAVAILABLE"
    assert time.monotonic() - start < REFUSAL_S


def test_a_client_that_trusts_another_authority_fails_clearly(locked, pki):
    start = time.monotonic()
    result = generate(locked.url, TritonAccess(INFERENCE_KEY, str(pki["other_ca"])))
    assert time.monotonic() - start < REFUSAL_S
    assert result.error is not None and result.error.status() == "StatusCode.UNAVAILABLE"
    assert "CERTIFICATE_VERIFY_FAILED" in result.error.message(), result.error.message()


# -- HTTP ----------------------------------------------------------------------------------


def http(server: ManagedServer, path: str, body: dict | None = None, headers=None):
    """(status, body) of an HTTP request to the server."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.config.http_port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers=headers or {},
    )
    try:
        with urllib.request.urlopen(request, timeout=REFUSAL_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_http_inference_needs_the_key_and_health_stays_open(locked):
    headers = TritonAccess(INFERENCE_KEY).http_headers
    assert http(locked, "/v2/health/ready") == (200, "")
    assert http(locked, "/v2/health/live") == (200, "")
    status, text = http(locked, "/v2/models/ensemble/config")
    assert status == 403 and "This API is restricted, expecting header 'inference-key'" in text
    status, text = http(locked, "/v2/models/ensemble/config", headers=headers)
    assert status == 200 and json.loads(text)["name"] == "ensemble"
    body = {
        "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [PROMPT]}]
    }
    status, text = http(locked, "/v2/models/ensemble/infer", body)
    assert status == 403 and "restricted" in text
    # With the key the request passes the lock; Triton's HTTP infer then refuses a decoupled
    # model itself (our clients stream on gRPC).
    status, text = http(locked, "/v2/models/ensemble/infer", body, headers=headers)
    assert status == 501 and "restricted" not in text and "decoupled" in text, text


# -- TensorRT-LLM's client contract, and the OpenAI API ---------------------------------------


def test_trtllm_clients_call_with_the_header(locked, pki, plain_text):
    """end_to_end_grpc_client.py has no option for TLS or a header: here its call
    (stream_once) plus `ssl=True, root_certificates=` and start_stream's `headers=`, read as it
    reads responses (by batch and sequence index). Without the header it is refused."""
    params = {"stream": True, "exclude_input_in_output": True}
    client = tls_client(locked, pki)
    try:
        responses = stream_once(client, TritonAccess(INFERENCE_KEY).headers, **params)
        assert len(responses) >= 2  # streamed: a response per iteration
        assert texts_by_index(responses, streaming=True) == {(0, 0): plain_text}
        ((result, error),) = stream_once(client, None, **params)
        assert result is None and RESTRICTED in error.message()
    finally:
        client.close()


def test_the_openai_api_reaches_the_locked_server(locked, pki, plain_text, tmp_path):
    """`python -m specdec.openai_api` with the CA and the key from the environment, as
    compose and Kubernetes give them: a completion with the plain server's greedy text."""
    env = {"GRPC_SSL_ROOT_CERT": str(pki["ca"]), "TRITON_INFERENCE_KEY": INFERENCE_KEY}
    with openai_api_process(locked, tmp_path / "api.log", env) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
    assert completion.choices[0].text == plain_text
