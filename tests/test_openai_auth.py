"""Access control of the OpenAI-compatible API: API keys and the per-key limit
(specdec/openai_api/auth.py, the KeyGate in specdec/openai_api/app.py), Triton's inference key and
TLS settings passed through to every gRPC call, and start-up refusals of settings that
cannot work. The pure logic and the glue run without a server; the rest against the real
one through the `openai` package."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from tls import make_ca, require_openssl
from tritonclient.utils import deserialize_bytes_tensor

from live import openai_api_process, scrape, wait_for
from specdec.openai_api import app as openai_api
from specdec.openai_api import auth as openai_auth
from specdec.openai_api.auth import ApiKeys, InFlight, SettingError, bearer_token
from specdec.processes import free_port
from specdec.triton_access import SESSION_HEADER, TritonAccess
from test_openai_api import MODEL

KEY_A = "sk-test-a-7f3c9e21"  # OPENAI_API_KEYS
KEY_B = "sk-test-b-0d4a6b58"  # OPENAI_API_KEYS_FILE
WRONG_KEY = "sk-test-wrong-55e1"
SALT_SECRET = "salt-secret-3b9f0c7e2a41"  # OPENAI_CACHE_SALT_SECRET
ACCESS_VARS = (
    "OPENAI_API_KEYS",
    "OPENAI_API_KEYS_FILE",
    "MAX_CONCURRENT_PER_KEY",
    "OPENAI_CACHE_SALT_SECRET",
    "TRITON_INFERENCE_KEY",
    "GRPC_SSL_ROOT_CERT",
)


# -- settings ------------------------------------------------------------------------------
def test_keys_are_the_union_of_the_list_and_the_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team A\nfile-1\n\n  file-2  \n#file-3\n")
    env = {"OPENAI_API_KEYS": " list-1 ,list-2", "OPENAI_API_KEYS_FILE": str(path)}
    assert openai_auth.keys_from_env(env) == ["list-1", "list-2", "file-1", "file-2"]
    assert openai_auth.keys_from_env({}) == []
    empty = {"OPENAI_API_KEYS": "", "OPENAI_API_KEYS_FILE": ""}  # as unset: compose's ${VAR:-}
    assert openai_auth.keys_from_env(empty) == []
    both = ApiKeys.from_env({"OPENAI_API_KEYS": "file-1", "OPENAI_API_KEYS_FILE": str(path)})
    assert len(both.digests) == 2  # one key in both places counts once
    assert not ApiKeys.from_env({}).required


@pytest.mark.parametrize("listed", ["sk-visible,,b", "sk-visible,", " ", " , "])
def test_an_empty_key_in_the_list_is_refused(listed):
    with pytest.raises(SettingError, match="^OPENAI_API_KEYS: ") as refused:
        openai_auth.keys_from_env({"OPENAI_API_KEYS": listed})
    assert "sk-visible" not in str(refused.value)


@pytest.mark.parametrize("content", [None, "", "\n# only a comment\n  \n", "dir"])
def test_a_key_file_that_is_missing_unreadable_or_empty_is_refused(tmp_path, content):
    path = tmp_path / "keys"
    if content == "dir":
        path.mkdir()  # unreadable as a file
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SettingError) as refused:
        openai_auth.keys_from_env({"OPENAI_API_KEYS_FILE": str(path)})
    message = str(refused.value)
    assert message.startswith("OPENAI_API_KEYS_FILE: ") and str(path) in message


@pytest.mark.parametrize(
    ("text", "num_keys", "expected"),
    [(None, 1, None), ("", 1, None), ("0", 1, None), ("0", 0, None), ("1", 2, 1), (" 8", 1, 8)],
)
def test_max_concurrent_per_key(text, num_keys, expected):
    env = {} if text is None else {"MAX_CONCURRENT_PER_KEY": text}
    assert openai_auth.max_concurrent_from_env(env, num_keys) == expected


@pytest.mark.parametrize("text", ["-1", "x", "1.5", "²", "+2"])
def test_a_bad_max_concurrent_per_key_is_refused(text):
    with pytest.raises(SettingError, match="^MAX_CONCURRENT_PER_KEY: "):
        openai_auth.max_concurrent_from_env({"MAX_CONCURRENT_PER_KEY": text}, 1)


@pytest.mark.parametrize(("name", "text"), [("OPENAI_PORT", "abc"), ("GRPC_PORT", "0")])
def test_a_bad_port_is_refused_naming_it(name, text):
    with pytest.raises(SettingError, match=f"^{name}: expected a port number"):
        openai_api.ApiConfig.from_env({name: text})
    assert openai_api.ApiConfig.from_env({}).triton_url == "127.0.0.1:8001"


def test_max_concurrent_per_key_needs_keys():
    with pytest.raises(SettingError, match="MAX_CONCURRENT_PER_KEY.*needs OPENAI_API_KEYS"):
        ApiKeys.from_env({"MAX_CONCURRENT_PER_KEY": "2"})


@pytest.mark.parametrize("secret", ["short-secret", "sk-0123456789"])
def test_a_short_cache_salt_secret_is_refused_unseen(secret):
    with pytest.raises(SettingError, match="^OPENAI_CACHE_SALT_SECRET: at least 16") as refused:
        ApiKeys.from_env({"OPENAI_API_KEYS": KEY_A, "OPENAI_CACHE_SALT_SECRET": secret})
    assert secret not in str(refused.value)


# -- cache salts ---------------------------------------------------------------------------
def test_each_keys_cache_salt_is_a_keyed_hash_that_a_body_salt_only_splits():
    env = {"OPENAI_API_KEYS": f"{KEY_A},{KEY_B}", "OPENAI_CACHE_SALT_SECRET": SALT_SECRET}
    keys = ApiKeys.from_env(env)
    a, b = keys.match(KEY_A.encode()), keys.match(KEY_B.encode())
    salt_a, salt_b = keys.cache_salt(a, None), keys.cache_salt(b, None)
    expected = hmac.new(SALT_SECRET.encode(), hashlib.sha256(KEY_A.encode()).digest(), "sha256")
    assert salt_a == expected.hexdigest() and len(salt_a) == 64  # as auth.py documents it
    assert salt_a != salt_b and KEY_A not in salt_a
    assert keys.cache_salt(a, "") == salt_a  # an empty body salt is none
    split = keys.cache_salt(a, "project-1")
    assert split not in (salt_a, keys.cache_salt(b, "project-1"), keys.cache_salt(a, "project-2"))
    assert keys.cache_salt(a, salt_b) != salt_b  # naming another key's salt does not join it
    assert ApiKeys.from_env(env).cache_salt(a, None) == salt_a  # the set secret: stable
    unset = {"OPENAI_API_KEYS": KEY_A, "OPENAI_CACHE_SALT_SECRET": ""}
    assert ApiKeys.from_env(unset).cache_salt(a, None) != ApiKeys.from_env(unset).cache_salt(
        a, None
    )  # random at each start
    with pytest.raises(ValueError, match="without a key"):
        keys.cache_salt(None, "project-1")


def test_an_open_api_passes_the_body_salt_as_given():
    keys = ApiKeys.from_env({})
    assert keys.cache_salt(None, "tenant-7") == "tenant-7"
    assert keys.cache_salt(None, None) is None


# -- matching ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        (b"Bearer sk-1", b"sk-1"),
        (b"bearer  sk-1 ", b"sk-1"),
        (b"Bearer ", None),
        (b"Basic dXNlcjpwYXNz", None),
        (b"sk-1", None),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_a_key_matches_only_itself_and_every_check_compares_every_key(monkeypatch):
    keys = ApiKeys.from_env({"OPENAI_API_KEYS": "sk-one,sk-two,sk-three"})
    compare, num_compares = hmac.compare_digest, []

    def counting_compare(a: bytes, b: bytes) -> bool:
        num_compares.append(1)
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting_compare)
    found = [keys.match(key) for key in (b"sk-one", b"sk-two", b"sk-three")]
    assert None not in found and len(set(found)) == 3  # each its own key
    for other in (b"sk-on", b"sk-one ", b"SK-ONE", b"", b"sk-twosk-three"):
        assert keys.match(other) is None
    assert len(num_compares) == 3 * 8  # no early exit: every check compares all three


def test_in_flight_bounds_each_key_apart():
    in_flight = InFlight(max_per_key=2)
    assert in_flight.take(b"a") and in_flight.take(b"a")
    assert not in_flight.take(b"a")  # at the bound, and the refusal counts nothing
    assert in_flight.take(b"b")  # another key goes on
    in_flight.give(b"a")
    assert in_flight.take(b"a") and not in_flight.take(b"a")
    in_flight.give(b"a")
    in_flight.give(b"a")
    assert dict(in_flight.counts) == {b"b": 1}  # a key with nothing in flight is dropped
    unlimited = InFlight(max_per_key=None)
    assert all(unlimited.take(b"a") for _ in range(100))


def test_nothing_logged_names_a_key():
    keys = ApiKeys.from_env({"OPENAI_API_KEYS": f"{KEY_A},{KEY_B}", "MAX_CONCURRENT_PER_KEY": "3"})
    assert keys.describe() == "2 API key(s), at most 3 request(s) in flight per key"
    assert "open" in ApiKeys.from_env({}).describe()


# -- the gate, without a server ------------------------------------------------------------
def gate_env(**extra: str) -> dict[str, str]:
    return {"OPENAI_API_KEYS": f"{KEY_A},{KEY_B}", "MAX_CONCURRENT_PER_KEY": "1", **extra}


class Sent:
    """An ASGI `send` that keeps the status of the response."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.body = b""

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


def http_scope(path: str, key: str | None) -> dict:
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    return {"type": "http", "method": "POST", "path": path, "headers": headers}


def test_the_gate_holds_a_key_slot_until_the_response_ends_on_every_path():
    """An inner app that stands for the API: it waits on an event (a stream held open) or
    fails. A key's second request is 429 while its first is held, another key's goes on, and
    the slot comes back after a response, a cancellation (a client gone) or an exception."""
    held, reached = asyncio.Event(), []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        if scope["path"] == "/hold":
            await held.wait()
        if scope["path"] == "/fail":
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = openai_api.KeyGate(inner, ApiKeys.from_env(gate_env()))

    async def call(path: str, key: str | None) -> int | None:
        sent = Sent()
        await gate(http_scope(path, key), None, sent)
        return sent.status

    async def scenario() -> None:
        first = asyncio.ensure_future(call("/hold", KEY_A))
        await asyncio.sleep(0)  # it takes A's slot and waits
        assert await call("/v1/completions", KEY_A) == 429
        assert await call("/v1/completions", KEY_B) == 200
        held.set()
        assert await first == 200
        assert await call("/v1/completions", KEY_A) == 200  # given back
        held.clear()
        cancelled = asyncio.ensure_future(call("/hold", KEY_A))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(RuntimeError):
            await call("/fail", KEY_A)
        assert await call("/v1/completions", KEY_A) == 200
        assert await call("/v1/completions", None) == 401
        assert await call("/v1/completions", WRONG_KEY) == 401
        assert await call("/health", None) == 200

    asyncio.run(scenario())
    assert reached.count("/v1/completions") == 3  # B, then A twice: the refused went no further
    assert dict(gate.in_flight.counts) == {}


class FakeTriton:
    """Stands in for tritonclient's grpcaio.InferenceServerClient: records how it was built
    and the headers of every call; the BLS answers "hi" in one response."""

    built: list[tuple[str, dict]] = []
    headers: list[tuple[str, object]] = []
    sent: list[dict] = []  # each stream's inputs by name

    def __init__(self, url: str, **kwargs) -> None:
        FakeTriton.built.append((url, kwargs))

    async def is_model_ready(self, model_name: str, headers=None) -> bool:
        FakeTriton.headers.append(("is_model_ready", headers))
        return True

    async def get_model_config(self, model_name: str, as_json: bool = False, headers=None):
        FakeTriton.headers.append(("get_model_config", headers))
        parameters = {"max_context": "64", "checkpoint": "models/" + MODEL}
        return {
            "config": {
                "parameters": {k: {"string_value": v} for k, v in parameters.items()},
                "input": [{"name": "text_input"}, {"name": "max_tokens"}],
            }
        }

    def stream_infer(self, inputs_iterator, headers=None):
        FakeTriton.headers.append(("stream_infer", headers))
        return FakeCall(inputs_iterator)

    async def close(self) -> None:
        pass


class FakeCall:
    """One stream: reads its request as gRPC would, keeping its inputs in FakeTriton.sent."""

    def __init__(self, requests) -> None:
        self.requests = requests

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        async for request in self.requests:
            FakeTriton.sent.append({tensor.name(): tensor for tensor in request["inputs"]})
        outputs = {
            "batch_index": np.array([[0]]),
            "sequence_index": np.array([[0]]),
            "num_input_tokens": np.array([[1]]),
            "num_output_tokens": np.array([[1]]),
            "text_output": np.array([b"hi"]),
        }
        yield type("Result", (), {"as_numpy": lambda _self, name: outputs[name]})(), None

    def cancel(self) -> None:
        pass


def test_triton_access_reaches_every_grpc_call(monkeypatch, tmp_path):
    """TRITON_INFERENCE_KEY goes as a header on each call the API makes to Triton, and
    GRPC_SSL_ROOT_CERT into the client; the API's own keys stay with the API."""
    require_openssl()
    pem, _ = make_ca(tmp_path, "ca")  # a real one: its dates are checked
    monkeypatch.setattr(openai_api.grpcaio, "InferenceServerClient", FakeTriton)
    monkeypatch.setattr(openai_api, "load_tokenizer", lambda path: None)
    FakeTriton.built, FakeTriton.headers = [], []
    env = gate_env(TRITON_INFERENCE_KEY="triton-secret", GRPC_SSL_ROOT_CERT=str(pem))
    app = openai_api.create_app(openai_api.ApiConfig.from_env({**env, "GRPC_PORT": "8123"}))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        answer = http.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_B}"}
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "hi"
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 401
    assert FakeTriton.built == [("127.0.0.1:8123", {"ssl": True, "root_certificates": str(pem)})]
    calls = [name for name, _ in FakeTriton.headers]
    assert {"is_model_ready", "get_model_config", "stream_infer"} <= set(calls)
    assert calls.count("stream_infer") == 1  # not the refused one
    expected = TritonAccess.from_env(env).headers
    assert expected and "triton-secret" in expected.values()
    assert [h for _, h in FakeTriton.headers if h != expected] == []


def test_a_requests_user_goes_to_triton_as_its_session_key(monkeypatch):
    """OpenAI's `user` field keys the conversation: the gateway keeps the streams that carry
    it on one replica (specdec/gateway/config.py); without one, no session header."""
    monkeypatch.setattr(openai_api.grpcaio, "InferenceServerClient", FakeTriton)
    monkeypatch.setattr(openai_api, "load_tokenizer", lambda path: None)
    FakeTriton.built, FakeTriton.headers = [], []
    env = {"TRITON_INFERENCE_KEY": "triton-secret", "GRPC_PORT": "8123"}
    app = openai_api.create_app(openai_api.ApiConfig.from_env(env))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with TestClient(app) as http:
        assert http.post("/v1/completions", json={**body, "user": "conv-7"}).status_code == 200
        assert http.post("/v1/completions", json=body).status_code == 200
    sent = [h for name, h in FakeTriton.headers if name == "stream_infer"]
    key = TritonAccess.from_env(env).headers
    assert sent == [{**key, SESSION_HEADER: "conv-7"}, key]


def sent_salts() -> list[str | None]:
    """The cache_salt each stream carried (None: no such input)."""
    salts = []
    for inputs in FakeTriton.sent:
        tensor = inputs.get("cache_salt")  # its bytes as tritonclient serialized them
        values = None if tensor is None else deserialize_bytes_tensor(tensor._get_content())
        salts.append(None if values is None else values[0].decode())
    return salts


def test_each_key_reaches_triton_with_its_own_cache_salt(monkeypatch):
    """Keyed: the salt Triton gets is the key's (a body salt splits it further), never the
    body's own; open: the body's, or none."""
    monkeypatch.setattr(openai_api.grpcaio, "InferenceServerClient", FakeTriton)
    monkeypatch.setattr(openai_api, "load_tokenizer", lambda path: None)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    calls = [(KEY_A, {}), (KEY_B, {}), (KEY_A, {}), (KEY_A, {"cache_salt": "project-1"})]
    config = openai_api.ApiConfig.from_env(gate_env(OPENAI_CACHE_SALT_SECRET=SALT_SECRET))
    FakeTriton.sent = []
    with TestClient(openai_api.create_app(config)) as http:
        for key, extra in calls:
            auth = {"Authorization": f"Bearer {key}"}
            assert http.post("/v1/completions", json=body | extra, headers=auth).status_code == 200
    keys = config.keys
    expected = [keys.cache_salt(keys.match(k.encode()), e.get("cache_salt")) for k, e in calls]
    assert sent_salts() == expected and len(set(expected)) == 3
    assert "project-1" not in sent_salts()

    FakeTriton.sent = []
    with TestClient(openai_api.create_app(openai_api.ApiConfig.from_env({}))) as http:
        for extra in ({"cache_salt": "tenant-7"}, {}):
            assert http.post("/v1/completions", json=body | extra).status_code == 200
    assert sent_salts() == ["tenant-7", None]


# -- start-up refusals (a subprocess; nothing listens on its GRPC_PORT) --------------------
def start_api_alone(env: dict[str, str]) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in ACCESS_VARS}
    env = {**clean, "OPENAI_PORT": str(free_port()), "GRPC_PORT": str(free_port()), **env}
    return subprocess.Popen(
        [sys.executable, "-m", "specdec.openai_api"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"OPENAI_API_KEYS_FILE": "/nonexistent/keys"}, ["OPENAI_API_KEYS_FILE", "/nonexistent"]),
        ({"OPENAI_API_KEYS_FILE": "EMPTY"}, ["OPENAI_API_KEYS_FILE", "EMPTY"]),
        ({"OPENAI_API_KEYS": f"{KEY_A},,b"}, ["OPENAI_API_KEYS"]),
        ({"OPENAI_API_KEYS": "  "}, ["OPENAI_API_KEYS"]),
        ({"OPENAI_API_KEYS": KEY_A, "MAX_CONCURRENT_PER_KEY": "-1"}, ["MAX_CONCURRENT_PER_KEY"]),
        ({"MAX_CONCURRENT_PER_KEY": "2"}, ["MAX_CONCURRENT_PER_KEY", "OPENAI_API_KEYS"]),
        ({"GRPC_SSL_ROOT_CERT": "/nonexistent/ca.pem"}, ["GRPC_SSL_ROOT_CERT", "/nonexistent"]),
        ({"OPENAI_CACHE_SALT_SECRET": "short"}, ["OPENAI_CACHE_SALT_SECRET"]),
    ],
    ids=[
        "missing-file",
        "empty-file",
        "empty-key",
        "blank-key",
        "bad-max",
        "max-no-key",
        "cert",
        "short-salt-secret",
    ],
)
def test_a_setting_that_cannot_work_stops_the_start(tmp_path, env, names):
    if env.get("OPENAI_API_KEYS_FILE") == "EMPTY":
        env = {"OPENAI_API_KEYS_FILE": str(tmp_path / "keys")}
        (tmp_path / "keys").write_text("# no key yet\n")
        names = ["OPENAI_API_KEYS_FILE", str(tmp_path / "keys")]
    began = time.monotonic()
    process = start_api_alone(env)
    stdout, stderr = process.communicate(timeout=60)  # waiting for Triton would hang here
    assert process.returncode != 0, stdout + stderr
    assert time.monotonic() - began < 30
    (line,) = stderr.strip().splitlines()
    assert all(name in line for name in names), line
    assert KEY_A not in stdout + stderr


def test_good_settings_start_and_log_no_key(tmp_path):
    """The control: the same command with settings that work keeps running (waiting for
    Triton), and its log counts the keys without naming one."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY_B}\n")
    process = start_api_alone(
        {
            "OPENAI_API_KEYS": KEY_A,
            "OPENAI_API_KEYS_FILE": str(keys_file),
            "MAX_CONCURRENT_PER_KEY": "1",
        }
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline(), process.stdout.readline()]  # before uvicorn runs
        assert lines[1] == "openai_api: 2 API key(s), at most 1 request(s) in flight per key\n"
        time.sleep(1.0)
        assert process.poll() is None  # waits for Triton
    finally:
        process.terminate()  # waiting for Triton, it stops at once (tests/test_signals.py)
        stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert KEY_A not in "".join(lines) + stdout + stderr
    assert KEY_B not in "".join(lines) + stdout + stderr


# -- against the real server ---------------------------------------------------------------
def num_finished(metrics_url: str) -> float:
    return sum(v for k, v in scrape(metrics_url).items() if k.startswith("specdec_requests_total"))


@pytest.fixture(scope="module")
def keyed_api(server, tmp_path_factory):
    """One API process: KEY_A from OPENAI_API_KEYS, KEY_B from a key file, one request in
    flight per key. Yields its base URL and its log's path."""
    folder = tmp_path_factory.mktemp("openai_auth")
    (folder / "keys").write_text(f"# the test's second key\n{KEY_B}\n")
    env = {
        "OPENAI_API_KEYS": KEY_A,
        "OPENAI_API_KEYS_FILE": str(folder / "keys"),
        "MAX_CONCURRENT_PER_KEY": "1",
    }
    with openai_api_process(server, folder / "api.log", env) as base_url:
        yield base_url, folder / "api.log"


def client_for(keyed_api, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=keyed_api[0], api_key=key, max_retries=0, timeout=120)


def complete(client: openai.OpenAI) -> bool:
    """A short completion; True once it is served (a refusal raises)."""
    response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    return response.usage.completion_tokens > 0


@pytest.mark.server
def test_the_right_key_gets_a_completion_and_others_get_401(server, keyed_api):
    assert complete(client_for(keyed_api, KEY_A)) and complete(client_for(keyed_api, KEY_B))
    before = num_finished(server.metrics_url)
    with pytest.raises(openai.AuthenticationError) as wrong:
        complete(client_for(keyed_api, WRONG_KEY))
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    assert wrong.value.body["message"].startswith("Incorrect API key provided")
    assert WRONG_KEY not in str(wrong.value.body)
    request = urllib.request.Request(
        f"{keyed_api[0]}/completions",
        data=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(request, timeout=30)
    assert no_key.value.code == 401
    error = json.loads(no_key.value.read())["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("You didn't provide an API key")
    with pytest.raises(openai.AuthenticationError):
        client_for(keyed_api, WRONG_KEY).models.list()
    health = urllib.request.urlopen(keyed_api[0].removesuffix("/v1") + "/health", timeout=30)
    assert health.status == 200
    assert num_finished(server.metrics_url) == before  # nothing reached Triton
    log = keyed_api[1].read_text()
    assert "401" in log and not any(key in log for key in (KEY_A, KEY_B, WRONG_KEY))


@pytest.mark.server
def test_one_request_in_flight_per_key(server, keyed_api):
    """A's stream held open: A's next requests are 429 (and go no further), B's is served
    meanwhile; once A's stream is closed, A is served again."""
    client_a, client_b = client_for(keyed_api, KEY_A), client_for(keyed_api, KEY_B)
    # Long enough not to end by itself during the test; closing it cancels it in the BLS.
    # 32 tokens a chunk: a response per token would slow B's request ~3x on 2 cores.
    held = client_a.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"stream_interval": 32},
    )
    chunks = iter(held)
    next(chunks)
    before = num_finished(server.metrics_url)
    with pytest.raises(openai.RateLimitError) as refused:
        complete(client_a)
    assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
    assert num_finished(server.metrics_url) == before  # A's held stream has not ended either
    assert complete(client_b)
    with pytest.raises(openai.RateLimitError):  # A's stream still holds A's slot
        complete(client_a)
    held.close()

    def a_served() -> bool:
        try:
            return complete(client_a)
        except openai.RateLimitError:
            return False

    wait_for(a_served, timeout=30)


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_request_gives_its_slot_back(keyed_api, stream):
    """400s from the API's own checks and from the BLS (before the stream's headers): the
    key's next request is served, not 429."""
    client_a = client_for(keyed_api, KEY_A)
    for fields in ({"extra_body": {"best_of": 2}}, {"n": 1000}):
        with pytest.raises(openai.BadRequestError):
            client_a.completions.create(
                model=MODEL, prompt="Hi", max_tokens=2, stream=stream, **fields
            )
        assert complete(client_a)
