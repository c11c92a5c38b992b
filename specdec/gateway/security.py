"""The gateway's security settings: client keys with a bound per key, Triton's own key on what
it forwards, and TLS on both sides. docs/scaling.md (Security) is the user's page.

Environment, checked at start (a bad value is refused with a message naming the variable;
no key is ever printed or logged):
- GATEWAY_KEYS_FILE: client keys, one per line (`#` comments and blank lines ignored). Set:
  a request without a listed key is refused (gRPC UNAUTHENTICATED, HTTP 401); health stays
  open. Unset: the key header passes through to the replicas unchanged.
- MAX_CONCURRENT_PER_KEY: requests (gRPC calls; a stream counts until it ends) one key may
  have in flight at the gateway; one more is refused (gRPC RESOURCE_EXHAUSTED, HTTP 429).
  Unset or 0: no bound. Needs GATEWAY_KEYS_FILE.
- TRITON_INFERENCE_KEY: the replicas' own key. With a keys file the gateway replaces the
  client's key with it (so client keys never reach Triton) and accepts it from our own
  services (the OpenAI API) without a bound.
- GATEWAY_SSL_CERT: a PEM file of the gateway's certificate and key: clients connect with
  TLS (gRPC and HTTP). Unset: h2c and plain HTTP.
- GRPC_SSL_CERT (the replicas serve gRPC over TLS; `serve` starts them with it): the gateway
  connects to their gRPC port with TLS and checks their certificate against
  GRPC_SSL_ROOT_CERT.

HAProxy does the work (specdec/gateway/config.py renders it): an acl on the key header from
the keys file, a stick table keyed by the key's SHA-256 whose reference count
(`sc0_trackers`) is the number of requests tracking that key right now (HTTP/2 streams on
one connection and across connections alike; it drops when a stream ends or is cancelled),
and a gRPC trailers-only reply (HTTP 200 with grpc-status) for a refusal. HAProxy before 3.2
resets a refused *stream* with RST_STREAM(CANCEL), which gRPC clients report as CANCELLED;
unary calls get the status (docs/scaling.md says more).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from specdec.certificates import check_dates, check_key_pair
from specdec.triton_access import GRPC_HEADER_PREFIX, INFERENCE_KEY_HEADER, TritonAccess

# The key's header is the one Triton reads (our clients send it so, specdec/triton_access.py).
GRPC_KEY_HEADER = GRPC_HEADER_PREFIX + INFERENCE_KEY_HEADER
GRPC_HEALTH = tuple(
    f"/inference.GRPCInferenceService/{rpc}" for rpc in ("ServerLive", "ServerReady", "ModelReady")
)
HTTP_HEALTH = "/v2/health/"
# HAProxy's config names the keys (Triton's in a header's log-format value): no spaces,
# quotes, `$`, `%` or backslashes. Random keys (hex, base64, URL-safe) fit.
KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{1,256}")
KEY_RULE = "a key is 1-256 of the characters A-Z a-z 0-9 . _ ~ + / = - (no spaces)"
KEY_TABLE = "keys_in_flight"  # the stick table both frontends track keys in
GRPC_UNAUTHENTICATED, GRPC_RESOURCE_EXHAUSTED = 16, 8


@dataclass(frozen=True)
class GatewaySecurity:
    """What the gateway checks and where it uses TLS; the default checks nothing."""

    keys: tuple[str, ...] = field(default=(), repr=False)  # empty: the header passes through
    max_concurrent_per_key: int = 0  # 0: no bound
    triton_key: str | None = field(default=None, repr=False)  # set on forwarded requests
    ssl_cert: Path | None = None  # the gateway's PEM (certificate and key)
    replica_ca: Path | None = None  # set: replicas' gRPC over TLS, checked against this CA

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> GatewaySecurity:
        env = dict(os.environ if env is None else env)
        access = TritonAccess.from_env(env)  # checks GRPC_SSL_ROOT_CERT
        keys = read_keys(env["GATEWAY_KEYS_FILE"]) if env.get("GATEWAY_KEYS_FILE") else ()
        limit = parse_limit(env.get("MAX_CONCURRENT_PER_KEY", ""))
        if limit and not keys:
            raise ValueError(
                "MAX_CONCURRENT_PER_KEY: needs GATEWAY_KEYS_FILE (a bound per key counts the "
                "keys the gateway checks; a client could change an unchecked one at will)"
            )
        if keys and access.inference_key and not KEY_PATTERN.fullmatch(access.inference_key):
            raise ValueError(f"TRITON_INFERENCE_KEY: {KEY_RULE}")
        replica_ca = None
        if env.get("GRPC_SSL_CERT"):  # the replicas serve gRPC over TLS
            if access.root_cert is None:
                raise ValueError(
                    "GRPC_SSL_ROOT_CERT: not set, and GRPC_SSL_CERT is: the gateway checks the "
                    "replicas' certificate against it"
                )
            replica_ca = Path(access.root_cert).absolute()
        cert = env.get("GATEWAY_SSL_CERT")
        return cls(
            keys=keys,
            max_concurrent_per_key=limit,
            triton_key=access.inference_key if keys else None,
            ssl_cert=read_certificate(cert) if cert else None,
            replica_ca=replica_ca,
        )

    def haproxy_env(self) -> dict[str, str]:
        """What HAProxy's environment needs: the config names Triton's key, never holds it."""
        return {"TRITON_INFERENCE_KEY": self.triton_key} if self.triton_key else {}


def describe(security: GatewaySecurity) -> str:
    """One line for the start-up output: what is checked, never a key."""
    parts = [f"TLS ({security.ssl_cert})" if security.ssl_cert else "no TLS (h2c)"]
    if security.keys:
        bound = security.max_concurrent_per_key or "no bound"
        parts.append(f"{len(security.keys)} client keys, per key in flight: {bound}")
    else:
        parts.append("no keys (the key header passes through)")
    if security.replica_ca:
        parts.append("replicas over TLS")
    return ", ".join(parts)


def read_keys(path: str) -> tuple[str, ...]:
    """The keys of GATEWAY_KEYS_FILE; errors name the file and line, never a key."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"GATEWAY_KEYS_FILE: cannot read {path}: {error}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"GATEWAY_KEYS_FILE: line {number} of {path}: {KEY_RULE}")
        keys.append(key)
    if not keys:
        raise ValueError(f"GATEWAY_KEYS_FILE: {path} holds no keys")
    return tuple(dict.fromkeys(keys))


def parse_limit(value: str) -> int:
    """MAX_CONCURRENT_PER_KEY: an integer >= 0; 0 and unset mean no bound."""
    try:
        limit = int(value or 0)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(
            f"MAX_CONCURRENT_PER_KEY: expected an integer >= 1 (0 or unset: no bound), "
            f"got {value!r}"
        )
    return limit


def read_certificate(path: str) -> Path:
    """GATEWAY_SSL_CERT's file: one PEM holding the certificate (chain) and its key."""
    try:
        pem = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"GATEWAY_SSL_CERT: cannot read {path}: {error}") from None
    if "BEGIN CERTIFICATE" not in pem or "PRIVATE KEY" not in pem:
        raise ValueError(
            f"GATEWAY_SSL_CERT: {path} must hold the certificate and its private key (PEM)"
        )
    check_dates("GATEWAY_SSL_CERT", path)
    check_key_pair("GATEWAY_SSL_CERT", path, "GATEWAY_SSL_CERT", path)
    return Path(path).absolute()


def key_rules(security: GatewaySecurity, keys_path: Path, grpc: bool) -> list[str]:
    """http-request rules of the gRPC or HTTP frontend: refuse a request without a listed
    key, bound each key's requests in flight, then forward Triton's key instead."""
    if not security.keys:
        return []  # the header passes through
    header = GRPC_KEY_HEADER if grpc else INFERENCE_KEY_HEADER
    health = f"path {' '.join(GRPC_HEALTH)}" if grpc else f"path_beg {HTTP_HEALTH}"
    lines = [
        f"acl health {health}",
        f"acl one_key req.fhdr_cnt({header}) eq 1",  # two of them: which one? refused
        f"acl client_key var(txn.key) -m str -f {keys_path}",
        f"http-request set-var(txn.key) req.fhdr({header})",
    ]
    known = "one_key client_key"
    if security.triton_key:  # our own services' key: accepted, not bounded
        lines.insert(3, 'acl triton_key var(txn.key) -m str "${TRITON_INFERENCE_KEY}"')
        known += " || one_key triton_key"
    missing = f"a known key in the {header} header is required"
    lines.append(f"{refusal(grpc, GRPC_UNAUTHENTICATED, missing)} unless health || {known}")
    if limit := security.max_concurrent_per_key:
        full = f"this key's limit of {limit} concurrent requests was reached"
        lines += [
            f"http-request track-sc0 var(txn.key),sha2(256) table {KEY_TABLE}"
            " if !health client_key",
            f"{refusal(grpc, GRPC_RESOURCE_EXHAUSTED, full)} if {{ sc0_trackers gt {limit} }}",
        ]
    lines += [f"http-request del-header {h}" for h in (INFERENCE_KEY_HEADER, GRPC_KEY_HEADER)]
    if security.triton_key:
        lines.append(f'http-request set-header {header} "${{TRITON_INFERENCE_KEY}}"')
    return lines


def refusal(grpc: bool, grpc_status: int, message: str) -> str:
    """A refusing `http-request return`: on gRPC trailers-only (HTTP 200, grpc-status in its
    headers; config.py adds the content type), on HTTP 401 / 429 with a JSON error as
    Triton's."""
    if grpc:
        return (
            f"http-request return status 200 hdr grpc-status {grpc_status}"
            f' hdr grpc-message "{message}"'
        )
    status = 401 if grpc_status == GRPC_UNAUTHENTICATED else 429
    body = '{\\"error\\":\\"' + message + '\\"}'
    return f'http-request return status {status} content-type application/json string "{body}"'
