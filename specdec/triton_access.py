"""How a client of our own reaches Triton when Triton is locked: the inference key header and
gRPC TLS. One place for the names, read by specdec/client.py, the OpenAI API and the tools.

Environment (the server side reads the same names; docs/operations.md, Security):
- TRITON_INFERENCE_KEY: when set, Triton's inference, metadata, model-config and statistics
  APIs answer only requests that carry the key: on HTTP the header `inference-key: <value>`,
  on gRPC `triton-grpc-protocol-inference-key: <value>` (Triton's gRPC frontend prefixes every
  restriction's header name so); clients send it.
- GRPC_SSL_ROOT_CERT: a PEM file of the certificate authority that signed Triton's gRPC
  certificate; when set, clients connect with TLS and trust it.
- GRPC_SSL_CERT, GRPC_SSL_KEY: Triton's own certificate and key (the server side only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specdec.certificates import check_dates

INFERENCE_KEY_HEADER = "inference-key"  # the restriction's header name; HTTP sends it as is
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # gRPC: Triton expects this before the name
# A conversation's key: the gateway sends the gRPC streams that carry it to one replica, whose
# KV cache holds the conversation's prefix (specdec/gateway/config.py). Triton ignores it.
SESSION_HEADER = "session-id"


class AccessError(ValueError):
    """A credential setting that cannot work (a missing or unreadable file); names it."""


@dataclass(frozen=True)
class TritonAccess:
    """What a gRPC client of Triton needs beyond the address."""

    inference_key: str | None = field(default=None, repr=False)  # never in a log line
    root_cert: str | None = None  # a PEM file's path; None: plain text (h2c)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TritonAccess:
        env = dict(os.environ if env is None else env)
        root_cert = None
        if path := env.get("GRPC_SSL_ROOT_CERT"):
            # Readable, holding certificates, each within its dates: an expired authority
            # would fail every handshake with a message naming nothing.
            try:
                check_dates("GRPC_SSL_ROOT_CERT", path)
            except ValueError as error:
                raise AccessError(str(error)) from None
            root_cert = path
        return cls(inference_key=env.get("TRITON_INFERENCE_KEY") or None, root_cert=root_cert)

    @property
    def headers(self) -> dict[str, str] | None:
        """For tritonclient gRPC's `headers=` (infer, start_stream, stream_infer, ...)."""
        if not self.inference_key:
            return None
        return {GRPC_HEADER_PREFIX + INFERENCE_KEY_HEADER: self.inference_key}

    @property
    def http_headers(self) -> dict[str, str] | None:
        """For HTTP requests to Triton (tritonclient.http's `headers=`, urllib)."""
        return {INFERENCE_KEY_HEADER: self.inference_key} if self.inference_key else None

    @property
    def client_kwargs(self) -> dict:
        """For tritonclient's gRPC `InferenceServerClient(url, **client_kwargs)`, sync or aio
        (both read `root_certificates` from the path)."""
        if self.root_cert is None:
            return {}
        return {"ssl": True, "root_certificates": self.root_cert}
