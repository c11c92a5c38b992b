"""Certificate checks at start-up: a certificate that has expired, is not valid yet, or does
not match its private key is refused with a message that names the setting and the problem,
before a server or a gateway starts (rather than as a failed handshake at each client, whose
message names neither). Standard library only: the validity dates come from a small walk of
each certificate's DER encoding, the key pair from `ssl.SSLContext.load_cert_chain`.

Used for GRPC_SSL_CERT / GRPC_SSL_KEY (specdec/server_config.py), GRPC_SSL_ROOT_CERT
(specdec/triton_access.py) and GATEWAY_SSL_CERT (specdec/gateway/security.py).
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specdec.serving.settings import PEM_BLOCK

_SEQUENCE, _CONTEXT_0, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0xA0, 0x17, 0x18


@dataclass(frozen=True)
class Validity:
    not_before: datetime
    not_after: datetime


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """The DER element at `at`: (tag, start of its contents, end of its contents)."""
    tag, length = der[at], der[at + 1]
    start = at + 2
    if length & 0x80:  # long form: the next (length & 0x7F) bytes hold the length
        count = length & 0x7F
        length = int.from_bytes(der[start : start + count], "big")
        start += count
    end = start + length
    if end > len(der):
        raise ValueError("truncated DER")
    return tag, start, end


def _time(der: bytes, at: int) -> tuple[datetime, int]:
    tag, start, end = _element(der, at)
    text = der[start:end].decode("ascii")
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: 50-99 are 19xx
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"a validity time with DER tag {tag:#x}")
    return datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=timezone.utc), end


def validity(der: bytes) -> Validity:
    """notBefore and notAfter of an X.509 certificate (DER): Certificate ::= SEQUENCE {
    tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber, signature, issuer,
    validity SEQUENCE { notBefore, notAfter }, ... }, ... }."""
    tag, start, _ = _element(der, 0)
    if tag != _SEQUENCE:
        raise ValueError("not a DER certificate")
    tag, at, _ = _element(der, start)  # tbsCertificate: step into it
    if tag != _SEQUENCE:
        raise ValueError("not a DER certificate")
    if der[at] == _CONTEXT_0:  # the version
        at = _element(der, at)[2]
    for _ in range(3):  # serialNumber, signature, issuer
        at = _element(der, at)[2]
    tag, at, _ = _element(der, at)
    if tag != _SEQUENCE:
        raise ValueError("no validity in the certificate")
    not_before, at = _time(der, at)
    not_after, _ = _time(der, at)
    return Validity(not_before, not_after)


def certificate_ders(pem: bytes) -> list[bytes]:
    """The DER encodings of the CERTIFICATE blocks of a PEM text, in order (a body that is
    not base64: binascii.Error, a ValueError)."""
    return [
        base64.b64decode(b"".join(body.split()), validate=True)
        for label, body in PEM_BLOCK.findall(pem)
        if label == b"CERTIFICATE"
    ]


def check_dates(name: str, path: str | Path, now: datetime | None = None) -> None:
    """Every certificate in the PEM file `path` is valid at `now` (default: the current
    time); otherwise ValueError naming the setting, the file, which certificate and when (or
    that the file cannot be read or holds none)."""
    now = now or datetime.now(timezone.utc)
    try:
        pem = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{name}: cannot read {path}: {error}") from None
    try:
        ders = certificate_ders(pem)
    except ValueError:
        raise ValueError(f"{name}: {path}: a CERTIFICATE block that is not base64") from None
    if not ders:
        raise ValueError(f"{name}: {path} holds no PEM certificate")
    for number, der in enumerate(ders, 1):
        which = "the certificate" if len(ders) == 1 else f"certificate {number} of {len(ders)}"
        try:
            dates = validity(der)
        except (ValueError, IndexError, UnicodeDecodeError):
            raise ValueError(f"{name}: {path}: {which} cannot be read (not X.509 DER)") from None
        if now > dates.not_after:
            raise ValueError(f"{name}: {path}: {which} expired on {_when(dates.not_after)}")
        if now < dates.not_before:
            start = _when(dates.not_before)
            raise ValueError(f"{name}: {path}: {which} is not valid before {start}")


def check_key_pair(cert_name: str, cert: str | Path, key_name: str, key: str | Path) -> None:
    """The private key in `key` belongs to the certificate in `cert` (one file may hold both);
    otherwise ValueError naming both settings."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error):
            raise ValueError(
                f"{key_name}: the private key in {key} does not match the certificate in {cert}"
                f" ({cert_name})"
            ) from None
        raise ValueError(f"{cert_name}, {key_name}: {cert}, {key}: {error.reason}") from None


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
