"""Settings of speculative_decoding that its config.pbtxt parameters carry and environment
variables set (specdec/server_config.py): parsed and checked here, in one place, so that a
bad value is refused before the server starts (server_config) and again when the model loads
(a config.pbtxt written by hand). Every error names the setting. Pure: no Triton import.

The keys and TLS files that lock Triton's own endpoints (TRITON_INFERENCE_KEY,
TRITON_ADMIN_KEY, GRPC_SSL_CERT, GRPC_SSL_KEY) are checked here too, before tritonserver
runs; an error about a key never repeats its value.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from pathlib import Path

# response_thread "auto" turns the outbox's thread on from this many usable cores: on 2 cores
# the server's work on the responses competes with the engine's threads (docs/benchmarks.md).
RESPONSE_THREAD_MIN_CORES = 4
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")


def parse_bool(name: str, value: str) -> bool:
    """A true/false setting."""
    text = value.strip().lower()
    if text not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return text in TRUE_WORDS


def parse_count(name: str, value: str, minimum: int) -> int:
    """An integer setting of at least `minimum`."""
    try:
        count = int(value.strip())
    except ValueError:
        count = minimum - 1
    if count < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return count


def parse_stream_interval(name: str, value: str) -> int:
    """The server's default stream_interval: output tokens a streamed sequence gathers
    between two responses (1: one response per iteration that added text)."""
    return parse_count(name, value, 1)


def parse_calibration_seconds(name: str, value: str) -> float:
    """The start-up cost measurement's budget in seconds (specdec/loop/calibration.py);
    0 turns it off."""
    try:
        seconds = float(value.strip())
    except ValueError:
        raise ValueError(f"{name}: expected seconds >= 0, got {value!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{name}: expected seconds >= 0, got {value!r}")
    return seconds


def parse_prefix_cache(name: str, value: str) -> bool:
    """prefix_cache: on (the default) or off: whether prompts reuse cached or running
    sequences' caches (specdec/loop/prefix_cache.py)."""
    text = value.strip().lower()
    if text not in ("on", "off") + TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name}: expected on or off, got {value!r}")
    return text == "on" or text in TRUE_WORDS


def parse_prefix_min_tokens(name: str, value: str) -> int:
    """The shortest prefix worth reusing, in tokens."""
    return parse_count(name, value, 1)


def parse_prefill_chunk(name: str, value: str) -> int | None:
    """Prompt tokens prefilled per step for prompts that join in chunks; 0: none do (every
    prompt prefills whole in its first step)."""
    return parse_count(name, value, 0) or None


def parse_response_thread(name: str, value: str) -> bool | None:
    """response_thread: true, false, or auto (None: decided by the usable cores)."""
    if value.strip().lower() == "auto":
        return None
    try:
        return parse_bool(name, value)
    except ValueError:
        raise ValueError(f"{name}: expected auto, true or false, got {value!r}") from None


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


def decide_response_thread(setting: bool | None, cores: int) -> tuple[bool, str]:
    """Whether the outbox sends on its own thread, and why (for the start-up log)."""
    if setting is not None:
        return setting, f"response_thread {str(setting).lower()} (set)"
    threaded = cores >= RESPONSE_THREAD_MIN_CORES
    comparison = ">=" if threaded else "<"
    return threaded, (
        f"response_thread auto: {'on' if threaded else 'off'} "
        f"({cores} usable cores {comparison} {RESPONSE_THREAD_MIN_CORES})"
    )


# -- access: the keys and TLS files of Triton's own endpoints (docs/operations.md, Security) --

# The value a committed example Secret carries (deploy/kubernetes/base/secret.yaml): refused,
# so a deployment that was not given a key of its own does not start with a public one.
EXAMPLE_KEY = "replace-with-a-random-key"
PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)
PRIVATE_KEY_LABELS = (b"PRIVATE KEY", b"RSA PRIVATE KEY", b"EC PRIVATE KEY")


def parse_header_key(name: str, value: str) -> str:
    """A key Triton compares with a request header (`inference-key`, `admin-key`): printable
    ASCII without spaces, as HTTP and gRPC headers carry it. Errors never repeat the value."""
    if not all("!" <= c <= "~" for c in value) or not value:
        raise ValueError(f"{name}: expected printable ASCII without spaces (value not shown)")
    if value == EXAMPLE_KEY:
        raise ValueError(f"{name}: still the committed example value; set a random key")
    return value


def pem_labels(name: str, path: str) -> list[bytes]:
    """The labels of the PEM blocks in a file (CERTIFICATE, PRIVATE KEY, ...), each block's
    base64 body checked; an unreadable file or one without a PEM block names the setting."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{name}: cannot read {path}: {error.strerror or error}") from None
    labels = []
    for label, body in PEM_BLOCK.findall(data):
        try:
            base64.b64decode(b"".join(body.split()), validate=True)
        except binascii.Error:
            message = f"{name}: {path}: a {label.decode()} block that is not base64"
            raise ValueError(message) from None
        labels.append(label)
    if not labels:
        raise ValueError(f"{name}: {path} is not a PEM file")
    return labels


def parse_certificate_file(name: str, value: str) -> Path:
    """A PEM file with a certificate (Triton's gRPC certificate and its chain)."""
    if b"CERTIFICATE" not in pem_labels(name, value):
        raise ValueError(f"{name}: {value} holds no PEM certificate")
    return Path(value)


def parse_private_key_file(name: str, value: str) -> Path:
    """A PEM file with an unencrypted private key (tritonserver takes no passphrase)."""
    labels = pem_labels(name, value)
    if b"ENCRYPTED PRIVATE KEY" in labels:
        raise ValueError(f"{name}: {value} is encrypted; tritonserver needs it unencrypted")
    if not any(label in PRIVATE_KEY_LABELS for label in labels):
        raise ValueError(f"{name}: {value} holds no PEM private key")
    return Path(value)


# Environment variables checked before the server starts: variable -> its parser.
ENV_CHECKS = {
    "STREAM_INTERVAL": parse_stream_interval,
    "RESPONSE_THREAD": parse_response_thread,
    "CUDA_GRAPHS": parse_bool,
    "CALIBRATION_SECONDS": parse_calibration_seconds,
    "PREFIX_CACHE": parse_prefix_cache,
    "PREFIX_MIN_TOKENS": parse_prefix_min_tokens,
    "PREFILL_CHUNK": parse_prefill_chunk,
    "TRITON_INFERENCE_KEY": parse_header_key,
    "TRITON_ADMIN_KEY": parse_header_key,
    "GRPC_SSL_CERT": parse_certificate_file,
    "GRPC_SSL_KEY": parse_private_key_file,
}
