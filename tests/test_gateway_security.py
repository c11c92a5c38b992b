"""The gateway's security (specdec/gateway/security.py; docs/scaling.md, Security) in front
of a real replica that wants Triton's own key and serves gRPC over TLS, through the real
HAProxy.

- With no keys file the key header passes through: Triton's key streams, no key is refused;
  the gateway reaches the replica over TLS, and not when it checks it against another CA.
- With a keys file, limit and certificate: clients connect over TLS; an unknown key gets
  UNAUTHENTICATED and a known one reaches the locked replica only because the gateway puts
  Triton's key in its place; a key with MAX_CONCURRENT_PER_KEY streams open (on one HTTP/2
  connection or several) gets RESOURCE_EXHAUSTED while other keys go on, and the bound comes
  back when a stream ends or is cancelled.
- Bad settings are refused before anything starts, naming the variable and never a key.
"""

from __future__ import annotations

import queue
import re
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tls import make_pki
from tritonclient.utils import InferenceServerException

from specdec.client import GenerationResult, StreamingClient, build_inputs, scrape_metrics
from specdec.gateway.config import (
    GatewayConfig,
    Replica,
    check_config,
    haproxy_binary,
    render_compose_config,
    render_config,
)
from specdec.gateway.security import GRPC_KEY_HEADER, GatewaySecurity
from specdec.gateway.serve import Gateway, compose_command, openai_env, serve
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT
from specdec.processes import free_port
from specdec.triton_access import INFERENCE_KEY_HEADER, TritonAccess

needs_haproxy = pytest.mark.skipif(
    haproxy_binary() is None,
    reason="haproxy not installed: apt-get install haproxy (.ci/run installs it)",
)
SMALL = {"NUM_SLOTS": "8", "MAX_CONTEXT": "512", "DTYPE": "float32"}  # as test_gateway's
TRITON_KEY = "triton-key-of-the-tests"
CLIENT_KEYS = ("alice-key-0123", "bob-key-4567")
LIMIT = 2
PROMPT = "<|im_start|>user\nName one use of copper.<|im_end|>\n<|im_start|>assistant\n"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
METADATA = "/inference.GRPCInferenceService/ModelMetadata"


def haproxy_version() -> tuple[int, ...]:
    out = subprocess.run([str(haproxy_binary()), "-v"], capture_output=True, text=True).stdout
    return tuple(int(n) for n in re.search(r"version (\d+)\.(\d+)", out).groups())


def refused_stream(status: str) -> set[str]:
    """What a client whose stream the gateway refused sees. HAProxy before 3.2 resets such a
    stream with RST_STREAM(CANCEL) after the trailers-only answer (the client had not ended
    its side), and gRPC clients then report CANCELLED instead of the answer's status
    (haproxy/haproxy#1219, fixed upstream by e87397bc7: NO_ERROR). Unary calls are exact."""
    return {status} if haproxy_version() >= (3, 2) else {"StatusCode.CANCELLED"}


def finished(server: ManagedServer) -> float:
    values = scrape_metrics(server.metrics_url)
    return sum(v for k, v in values.items() if k.startswith("specdec_requests_total"))


def attempt(url: str, access: TritonAccess, max_tokens: int = 8) -> GenerationResult:
    """One streamed request whose failure is a result. When the stream broke before the
    request went out, tritonclient raises a generic error and the stream's own lands in the
    callback."""
    with StreamingClient(url, "ensemble", access) as client:
        try:
            return client.generate(
                PROMPT, max_tokens=max_tokens, stream=True, exclude_input_in_output=True
            )
        except InferenceServerException:
            _, error = client.responses.get(timeout=10)
            return GenerationResult(error=error)


def metadata_status(url: str, key: str | None, root_cert: str | None = None) -> str:
    """A unary call (model metadata, locked at Triton): 'OK' or the gRPC status."""
    access = TritonAccess(inference_key=key, root_cert=root_cert)
    client = grpcclient.InferenceServerClient(url, **access.client_kwargs)
    try:
        client.get_model_metadata("ensemble", headers=access.headers)
        return "OK"
    except InferenceServerException as error:
        return f"{error.status()}: {error.message()}"
    finally:
        client.close()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, str]:
    """A CA; a certificate for 127.0.0.1 signed by it, which the replica serves gRPC with
    and the gateway its clients; another CA that signed nothing of theirs."""
    d = tmp_path_factory.mktemp("tls")
    paths = make_pki(d)
    paths["gateway"] = d / "gateway.pem"  # HAProxy's: the certificate and its key in one file
    paths["gateway"].write_text(paths["cert"].read_text() + paths["key"].read_text())
    return {role: str(path) for role, path in paths.items()}


@pytest.fixture(scope="module")
def locked(target_dir, certificates):
    """A replica that wants Triton's key and serves gRPC over TLS."""
    env = {**SMALL, "TRITON_INFERENCE_KEY": TRITON_KEY}
    env |= {"GRPC_SSL_CERT": certificates["cert"], "GRPC_SSL_KEY": certificates["key"]}
    server = ManagedServer("test-gateway-locked", env)
    yield server
    server.stop()


def new_gateway(
    server: ManagedServer,
    name: str,
    env: dict[str, str],
    render: Callable[[GatewayConfig], str] = render_config,
) -> Gateway:
    """HAProxy in front of `server`, with the security settings of `env`."""
    c = server.config
    config = GatewayConfig(
        [Replica("locked", "127.0.0.1", c.grpc_port, c.http_port)],
        grpc_port=free_port(),
        http_port=free_port(),
        stats_port=free_port(),
        run_dir=PROJECT_ROOT / ".run" / name,
        security=GatewaySecurity.from_env(env),
    )
    gateway = Gateway(config, render=render)
    gateway.wait_for_state("locked", "UP")
    return gateway


def replica_tls(certificates, ca: str = "ca") -> dict[str, str]:
    """The replica serves gRPC over TLS: the gateway checks it against this CA."""
    return {"GRPC_SSL_CERT": certificates["cert"], "GRPC_SSL_ROOT_CERT": certificates[ca]}


@pytest.fixture(scope="module")
def passthrough(locked, certificates):
    """No keys file: h2c from clients, the key header through untouched."""
    gateway = new_gateway(locked, "test-gateway-passthrough", replica_tls(certificates))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def every_setting(certificates, tmp_path_factory) -> dict[str, str]:
    """Client keys, a bound per key, Triton's key, TLS from clients and to the replica."""
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text("# the test's clients\n\n" + "".join(f"  {k}\n" for k in CLIENT_KEYS))
    return {
        "GATEWAY_KEYS_FILE": str(keys_file),
        "MAX_CONCURRENT_PER_KEY": str(LIMIT),
        "TRITON_INFERENCE_KEY": TRITON_KEY,
        "GATEWAY_SSL_CERT": certificates["gateway"],
        **replica_tls(certificates),
    }


@pytest.fixture(scope="module")
def secured(locked, every_setting):
    """Client keys, a bound per key, TLS from clients."""
    gateway = new_gateway(locked, "test-gateway-secured", every_setting)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def reference(locked, certificates) -> str:
    """The greedy text, straight from the locked replica with Triton's key."""
    result = attempt(locked.url, TritonAccess(TRITON_KEY, certificates["ca"]))
    assert result.error is None and result.text
    return result.text


@needs_haproxy
@pytest.mark.server
def test_the_key_header_passes_through_to_a_locked_replica(locked, passthrough, reference):
    through = attempt(passthrough.url, TritonAccess(TRITON_KEY))  # TLS to the replica
    assert (through.error, through.text) == (None, reference)
    before = finished(locked)
    for key in (None, "not-the-key"):
        refused = attempt(passthrough.url, TritonAccess(key))  # straight to Triton: UNAVAILABLE
        assert refused.error is not None and not refused.text
        assert refused.error.status() in refused_stream("StatusCode.UNAVAILABLE")
        # Unary: Triton's own refusal reaches the client whole through the gateway.
        assert "expecting header 'triton-grpc-protocol-inference-key'" in metadata_status(
            passthrough.url, key
        )
    assert metadata_status(passthrough.url, TRITON_KEY) == "OK"
    assert finished(locked) == before  # refused at Triton's door, never at the model
    # HTTP: the header Triton reads there (inference-key) passes through as well.
    assert http_status(passthrough, "/v2/models/ensemble", TRITON_KEY) == 200
    assert http_status(passthrough, "/v2/models/ensemble", None) != 200


@needs_haproxy
@pytest.mark.server
def test_the_gateway_checks_the_replicas_certificate(locked, certificates):
    """The negative control of re-encryption: a CA that did not sign the replica's."""
    env = replica_tls(certificates, ca="other_ca")
    gateway = new_gateway(locked, "test-gateway-wrong-ca", env)
    try:
        status = metadata_status(gateway.url, TRITON_KEY)
        assert status.startswith("StatusCode.UNAVAILABLE"), status
    finally:
        gateway.stop()


@needs_haproxy
@pytest.mark.server
def test_unknown_keys_are_refused_and_known_ones_reach_triton_as_its_key(
    locked, secured, certificates, reference
):
    ca = certificates["ca"]
    before = finished(locked)
    for key in (None, "not-a-client-key", CLIENT_KEYS[0] + "x"):
        status = metadata_status(secured.url, key, ca)
        assert status.startswith("StatusCode.UNAUTHENTICATED: a known key in the"), status
        assert key is None or key not in status
        refused = attempt(secured.url, TritonAccess(inference_key=key, root_cert=ca))
        assert refused.error is not None and refused.error.status() in refused_stream(
            "StatusCode.UNAUTHENTICATED"
        )
    assert finished(locked) == before  # none reached the replica
    # The header twice, another key and a listed one last: which counts? Neither; refused.
    credentials = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    with grpc.secure_channel(secured.url, credentials) as channel:
        metadata = [(GRPC_KEY_HEADER, "not-a-client-key"), (GRPC_KEY_HEADER, CLIENT_KEYS[0])]
        with pytest.raises(grpc.RpcError) as twice:
            channel.unary_unary(METADATA)(b"", metadata=metadata, timeout=10)
    assert twice.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(InferenceServerException) as plain:  # no TLS: no gRPC
        grpcclient.InferenceServerClient(secured.url).is_server_ready()
    assert plain.value.status() == "StatusCode.UNAVAILABLE"
    for key in CLIENT_KEYS:  # the locked replica takes them: the gateway sent Triton's key
        assert metadata_status(secured.url, key, ca) == "OK"
        result = attempt(secured.url, TritonAccess(inference_key=key, root_cert=ca))
        assert (result.error, result.text) == (None, reference)
    assert metadata_status(secured.url, TRITON_KEY, ca) == "OK"  # our own services' key
    health = grpcclient.InferenceServerClient(secured.url, ssl=True, root_certificates=ca)
    assert health.is_server_ready() and health.is_model_ready("ensemble")  # no key: open
    # Triton's key is in HAProxy's environment, not its config; the client keys' copy is
    # the owner's alone; HAProxy's output holds no key.
    assert TRITON_KEY not in secured.config_path.read_text()
    assert secured.config.keys_path.stat().st_mode & 0o777 == 0o600
    output = secured.log_path.read_text()
    assert not any(key in output for key in (TRITON_KEY, *CLIENT_KEYS))


def http_status(gateway: Gateway, path: str, key: str | None, ca: str | None = None) -> int:
    """GET on the gateway's HTTP port (HTTPS when `ca` is given): the status code."""
    scheme = "https" if ca else "http"
    url = f"{scheme}://127.0.0.1:{gateway.config.http_port}{path}"
    request = urllib.request.Request(url, headers={INFERENCE_KEY_HEADER: key} if key else {})
    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        return urllib.request.urlopen(request, context=context, timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code


@needs_haproxy
@pytest.mark.server
def test_http_needs_a_key_too_over_tls(secured, certificates):
    ca = certificates["ca"]
    assert http_status(secured, "/v2/health/ready", None, ca) == 200
    assert http_status(secured, "/v2/models/ensemble", None, ca) == 401
    assert http_status(secured, "/v2/models/ensemble", "not-a-client-key", ca) == 401
    assert http_status(secured, "/v2/models/ensemble", CLIENT_KEYS[1], ca) == 200  # Triton's


class HeldStream:
    """An open ModelStreamInfer call that has sent no request yet: the gateway counts it
    from its headers until it ends."""

    def __init__(self, channel: grpc.Channel, key: str):
        self.done = threading.Event()
        # Connected first, and waiting for readiness: on a fresh channel a call that meets
        # a connection still being made would otherwise fail at once (UNAVAILABLE), and the
        # gateway would never see it.
        grpc.channel_ready_future(channel).result(timeout=30)
        self.call = channel.stream_stream(STREAM)(
            self._nothing(), metadata=[(GRPC_KEY_HEADER, key)], wait_for_ready=True
        )

    def state(self) -> str:
        """'open', or how the call ended (for a failing wait's message)."""
        return f"ended {self.call.code()}" if self.call.done() else "open"

    def _nothing(self):
        self.done.wait()
        return
        yield  # a generator that sends nothing

    def end(self) -> None:
        """The client's side ends; the server then ends the call."""
        self.done.set()
        for _ in self.call:
            pass

    def cancel(self) -> None:
        self.call.cancel()
        self.done.set()


@needs_haproxy
@pytest.mark.server
def test_each_key_has_at_most_max_concurrent_streams(locked, secured, certificates, reference):
    ca = certificates["ca"]
    alice, bob = CLIENT_KEYS
    credentials = grpc.ssl_channel_credentials(Path(certificates["ca"]).read_bytes())
    own_connection = [("grpc.use_local_subchannel_pool", 1)]  # not shared with other channels
    one, two = (grpc.secure_channel(secured.url, credentials, own_connection) for _ in range(2))
    full = (
        f"StatusCode.RESOURCE_EXHAUSTED: this key's limit of {LIMIT} concurrent requests"
        " was reached"
    )
    held: list[HeldStream] = []
    try:
        held += [HeldStream(one, alice), HeldStream(one, alice)]  # two streams, one connection
        wait_for_status(lambda: metadata_status(secured.url, alice, ca), full, held)
        refused = attempt(secured.url, TritonAccess(inference_key=alice, root_cert=ca))
        assert refused.error is not None
        assert refused.error.status() in refused_stream("StatusCode.RESOURCE_EXHAUSTED")
        other = attempt(secured.url, TritonAccess(inference_key=bob, root_cert=ca))  # goes on
        assert (other.error, other.text) == (None, reference)
        assert metadata_status(secured.url, TRITON_KEY, ca) == "OK"  # not bounded
        assert http_status(secured, "/v2/models/ensemble", alice, ca) == 429  # one table

        held[1].cancel()  # cancelled: the bound comes back
        wait_for_status(lambda: metadata_status(secured.url, alice, ca), "OK", held)
        held.append(HeldStream(two, alice))  # one stream on each of two connections
        wait_for_status(lambda: metadata_status(secured.url, alice, ca), full, held)
        held[0].end()  # ended by the client, then by Triton
        wait_for_status(lambda: metadata_status(secured.url, alice, ca), "OK", held)

        # A stream that generates gives its place back as well when it is cancelled.
        client = grpcclient.InferenceServerClient(secured.url, ssl=True, root_certificates=ca)
        chunks: queue.Queue = queue.Queue()
        client.start_stream(
            lambda result, error: chunks.put(error), headers=TritonAccess(alice).headers
        )
        client.async_stream_infer("ensemble", build_inputs(PROMPT, max_tokens=16, stream=True))
        assert chunks.get(timeout=60) is None  # the first chunk came: it runs
        wait_for_status(lambda: metadata_status(secured.url, alice, ca), full, held)
        client.stop_stream(cancel_requests=True)
        client.close()
        wait_for_status(lambda: metadata_status(secured.url, alice, ca), "OK", held)
    finally:
        for stream in held:
            stream.cancel()
        one.close()
        two.close()


def wait_for_status(
    call, expected: str, held: list[HeldStream] | None = None, timeout: float = 30.0
) -> None:
    """The gateway sees a stream's end a moment after the client does. A failure says what
    became of the held streams."""
    deadline = time.monotonic() + timeout
    while (status := call()) != expected:
        streams = [stream.state() for stream in held or []]
        assert time.monotonic() < deadline, (
            f"{status!r}, not {expected!r}, after {timeout} s; held streams: {streams}"
        )
        time.sleep(0.1)


@needs_haproxy
def test_the_compose_gateway_renders_every_setting(every_setting, tmp_path):
    """`python -m specdec.gateway compose` (docker-compose.yml's gateway) with every setting:
    the keys file owner-only, TLS both ways, the key rules; Triton's key reaches HAProxy
    through its environment only, and HAProxy accepts the file with that environment."""
    # Returned only once HAProxy has accepted the file with this environment (haproxy -c).
    argv, haproxy_env = compose_command({**every_setting, "RUN_DIR": str(tmp_path)})
    config_path = tmp_path / "gateway" / "haproxy.cfg"
    assert argv == [haproxy_binary(), "-db", "-f", str(config_path)]
    text = config_path.read_text()
    assert text.count(f"ssl crt {every_setting['GATEWAY_SSL_CERT']} alpn") == 2  # gRPC, HTTP
    assert text.count(f"ca-file {every_setting['GRPC_SSL_ROOT_CERT']} ") == 8  # 4 services x2
    keys_path = tmp_path / "gateway" / "keys.lst"
    assert text.count(f"acl client_key var(txn.key) -m str -f {keys_path}") == 2
    assert f"sc0_trackers gt {LIMIT}" in text and "backend keys_in_flight" in text
    assert keys_path.read_text().split() == list(CLIENT_KEYS)
    assert keys_path.stat().st_mode & 0o777 == 0o600
    assert TRITON_KEY not in text and haproxy_env["TRITON_INFERENCE_KEY"] == TRITON_KEY
    with pytest.raises(ValueError):  # the file only names the key: without it, no valid rule
        check_config(config_path, {k: v for k, v in haproxy_env.items() if "TRITON" not in k})


@needs_haproxy
@pytest.mark.server
def test_the_compose_rendering_checks_keys_in_front_of_a_locked_replica(
    locked, every_setting, certificates, reference
):
    """The compose gateway's rules through the real HAProxy (its server lines carry Docker's
    resolvers; an IP address needs none): TLS, keys and Triton's key as with `serve`."""
    gateway = new_gateway(locked, "test-gateway-compose", every_setting, render_compose_config)
    ca = certificates["ca"]
    try:
        assert "resolvers docker" in gateway.config_path.read_text()
        status = metadata_status(gateway.url, "not-a-client-key", ca)
        assert status.startswith("StatusCode.UNAUTHENTICATED: a known key in the"), status
        assert http_status(gateway, "/v2/models/ensemble", None, ca) == 401
        result = attempt(gateway.url, TritonAccess(inference_key=CLIENT_KEYS[1], root_cert=ca))
        assert (result.error, result.text) == (None, reference)  # over TLS, with Triton's key
    finally:
        gateway.stop()


@pytest.mark.parametrize(
    ("settings", "variable"),
    [
        ({"GATEWAY_KEYS_FILE": "/nonexistent/keys.txt"}, "GATEWAY_KEYS_FILE"),
        ({"GATEWAY_KEYS_FILE": "{empty}"}, "GATEWAY_KEYS_FILE"),
        ({"GATEWAY_KEYS_FILE": "{spaced}"}, "GATEWAY_KEYS_FILE"),
        (
            {"GATEWAY_KEYS_FILE": "{keys}", "MAX_CONCURRENT_PER_KEY": "two"},
            "MAX_CONCURRENT_PER_KEY",
        ),
        ({"GATEWAY_KEYS_FILE": "{keys}", "MAX_CONCURRENT_PER_KEY": "-1"}, "MAX_CONCURRENT_PER_KEY"),
        ({"MAX_CONCURRENT_PER_KEY": "4"}, "MAX_CONCURRENT_PER_KEY"),  # without keys
        ({"GATEWAY_KEYS_FILE": "{keys}", "TRITON_INFERENCE_KEY": "a b"}, "TRITON_INFERENCE_KEY"),
        ({"GATEWAY_SSL_CERT": "{keys}"}, "GATEWAY_SSL_CERT"),  # no certificate in it
        ({"GRPC_SSL_CERT": "/some/cert.pem"}, "GRPC_SSL_ROOT_CERT"),  # replicas' CA missing
    ],
)
def test_bad_settings_are_refused_at_start_naming_the_variable(
    settings, variable, tmp_path, capsys
):
    files = {
        "{empty}": "# only a comment\n\n",
        "{spaced}": "a-fine-key\nsecret with spaces\n",
        "{keys}": "secret-key-1\n",
    }
    for name, text in files.items():
        (tmp_path / name.strip("{}")).write_text(text)
    env = {k: str(tmp_path / v.strip("{}")) if v in files else v for k, v in settings.items()}
    with pytest.raises(ValueError, match=f"^{variable}: ") as refused:
        GatewaySecurity.from_env(env)
    assert "secret" not in str(refused.value)  # the keys file's contents are never shown
    if haproxy_binary() is not None:  # `python -m specdec.gateway serve`: nothing starts
        assert serve(2, {**env, "RUN_DIR": str(tmp_path / "run")}) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gateway: {variable}: ") and "secret" not in err
        assert not (tmp_path / "run").exists()


def test_without_a_keys_file_the_gateway_checks_nothing():
    """Triton's key alone is for the replicas: the client's header passes through."""
    security = GatewaySecurity.from_env({"TRITON_INFERENCE_KEY": "ignored-without-keys"})
    assert security == GatewaySecurity() and security.haproxy_env() == {}


def test_the_openai_api_that_serve_starts_calls_the_gateway_as_a_client(tmp_path, certificates):
    """`serve --openai`: TLS to the gateway only when the gateway serves it, and Triton's
    key, which the gateway accepts, when it checks keys."""
    env = {"GRPC_SSL_ROOT_CERT": "/ca.pem", "TRITON_INFERENCE_KEY": "k"}
    assert openai_env(env, GatewaySecurity()) == {"TRITON_INFERENCE_KEY": "k"}
    tls = GatewaySecurity.from_env({"GATEWAY_SSL_CERT": certificates["gateway"]})
    assert openai_env(env, tls) == env
    with pytest.raises(ValueError, match="^GRPC_SSL_ROOT_CERT: "):
        openai_env({"TRITON_INFERENCE_KEY": "k"}, tls)
    keys = tmp_path / "keys.txt"
    keys.write_text("a-client-key\n")
    with pytest.raises(ValueError, match="^TRITON_INFERENCE_KEY: "):  # the gateway refuses it
        openai_env({}, GatewaySecurity.from_env({"GATEWAY_KEYS_FILE": str(keys)}))
