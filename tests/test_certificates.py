"""A certificate that has expired, is not valid yet or does not match its key is refused at
start with a message naming the setting and the problem (specdec/certificates.py): Triton's
(GRPC_SSL_CERT / GRPC_SSL_KEY, through the launcher), the clients' authority
(GRPC_SSL_ROOT_CERT) and the gateway's (GATEWAY_SSL_CERT). Real certificates, made with
openssl at run time; openssl's own reading of the dates is the reference."""

from __future__ import annotations

import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from test_settings import assert_launch_refused
from tls import make_dated_certificate, make_pki

from specdec.certificates import certificate_ders, check_dates, check_key_pair, validity
from specdec.gateway.security import GatewaySecurity
from specdec.server_config import ServerConfig
from specdec.triton_access import AccessError, TritonAccess

EXPIRED = ("20200101000000Z", "20200102000000Z")
FUTURE = ("20990101000000Z", "20991231000000Z")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("certificates")
    made = make_pki(folder)
    ca, cert, key, other_key = made["ca"], made["cert"], made["key"], made["other_key"]
    expired, expired_key = make_dated_certificate(folder, "expired", *EXPIRED)
    future, _ = make_dated_certificate(folder, "future", *FUTURE)
    chain = folder / "chain.crt"  # the server's certificate, then an expired one
    chain.write_text(cert.read_text() + expired.read_text())
    gateway = folder / "gateway.pem"  # certificate and key in one file
    gateway.write_text(cert.read_text() + key.read_text())
    mismatched = folder / "mismatched.pem"
    mismatched.write_text(cert.read_text() + other_key.read_text())
    expired_pem = folder / "expired.pem"
    expired_pem.write_text(expired.read_text() + expired_key.read_text())
    return {
        "ca": ca, "cert": cert, "key": key, "other_key": other_key, "expired": expired,
        "expired_key": expired_key, "future": future, "chain": chain, "gateway": gateway,
        "mismatched": mismatched, "expired_pem": expired_pem,
    }  # fmt: skip


def openssl_dates(path: Path) -> tuple[datetime, datetime]:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(path), "-noout", "-startdate", "-enddate",
         "-dateopt", "iso_8601"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    start, end = (line.split("=", 1)[1].strip() for line in out.splitlines())
    return tuple(
        datetime.strptime(text, "%Y-%m-%d %H:%M:%SZ").replace(tzinfo=timezone.utc)
        for text in (start, end)
    )  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["cert", "ca", "expired", "future"])
def test_the_dates_are_those_openssl_reads(pki, name):
    """UTCTime (2020, now) and GeneralizedTime (2099) alike."""
    (der,) = certificate_ders(pki[name].read_bytes())
    dates = validity(der)
    assert (dates.not_before, dates.not_after) == openssl_dates(pki[name])


def test_a_current_certificate_passes_and_one_out_of_its_dates_is_refused(pki):
    check_dates("GRPC_SSL_CERT", pki["cert"])
    check_dates("GRPC_SSL_ROOT_CERT", pki["ca"])
    with pytest.raises(ValueError) as expired:
        check_dates("GRPC_SSL_CERT", pki["expired"])
    assert str(expired.value) == (
        f"GRPC_SSL_CERT: {pki['expired']}: the certificate expired on 2020-01-02 00:00:00 UTC"
    )
    with pytest.raises(ValueError) as future:
        check_dates("GRPC_SSL_CERT", pki["future"])
    assert str(future.value) == (
        f"GRPC_SSL_CERT: {pki['future']}: the certificate is not valid before"
        " 2099-01-01 00:00:00 UTC"
    )
    with pytest.raises(ValueError, match=r"certificate 2 of 2 expired on 2020-01-02"):
        check_dates("GRPC_SSL_CERT", pki["chain"])
    # The server's own certificate, two days on: expired too.
    later = datetime.now(timezone.utc) + timedelta(days=3)
    with pytest.raises(ValueError, match=r"^GRPC_SSL_CERT: .*the certificate expired on "):
        check_dates("GRPC_SSL_CERT", pki["cert"], now=later)


def test_a_key_that_is_not_the_certificates_is_refused_naming_it(pki):
    check_key_pair("GRPC_SSL_CERT", pki["cert"], "GRPC_SSL_KEY", pki["key"])
    with pytest.raises(ValueError) as refused:
        check_key_pair("GRPC_SSL_CERT", pki["cert"], "GRPC_SSL_KEY", pki["other_key"])
    assert str(refused.value) == (
        f"GRPC_SSL_KEY: the private key in {pki['other_key']} does not match the certificate"
        f" in {pki['cert']} (GRPC_SSL_CERT)"
    )


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"cert": "expired", "key": "expired_key"}, "GRPC_SSL_CERT: .* expired on 2020-01-02"),
        ({"cert": "future", "key": "key"}, "GRPC_SSL_CERT: .* not valid before 2099-01-01"),
        ({"cert": "cert", "key": "other_key"}, "GRPC_SSL_KEY: the private key in .* does not"),
    ],
)
def test_tritons_certificate_is_checked_before_it_starts(pki, files, message):
    env = {"GRPC_SSL_CERT": str(pki[files["cert"]]), "GRPC_SSL_KEY": str(pki[files["key"]])}
    with pytest.raises(ValueError, match=f"^{message}"):
        ServerConfig.from_env(env)
    good = {"GRPC_SSL_CERT": str(pki["cert"]), "GRPC_SSL_KEY": str(pki["key"])}
    assert ServerConfig.from_env(good).grpc_ssl_cert == pki["cert"].absolute()


def test_the_launcher_refuses_an_expired_certificate_before_the_server_starts(pki, tmp_path):
    """`make serve`'s command: one line naming the setting and the date, no server."""
    settings = {"GRPC_SSL_CERT": str(pki["expired"]), "GRPC_SSL_KEY": str(pki["expired_key"])}
    assert_launch_refused(
        tmp_path,
        settings,
        f"GRPC_SSL_CERT: {pki['expired']}: the certificate expired on 2020-01-02 00:00:00 UTC",
    )


def test_clients_refuse_an_authority_out_of_its_dates(pki):
    """The OpenAI API, the bench and the gateway read GRPC_SSL_ROOT_CERT through this."""
    assert TritonAccess.from_env({"GRPC_SSL_ROOT_CERT": str(pki["ca"])}).root_cert == str(pki["ca"])
    with pytest.raises(AccessError, match=r"^GRPC_SSL_ROOT_CERT: .* expired on 2020-01-02"):
        TritonAccess.from_env({"GRPC_SSL_ROOT_CERT": str(pki["expired"])})


@pytest.mark.parametrize(
    ("file", "message"),
    [
        ("expired_pem", r"GATEWAY_SSL_CERT: .*: the certificate expired on 2020-01-02"),
        ("mismatched", r"GATEWAY_SSL_CERT: the private key in .* does not match"),
    ],
)
def test_the_gateways_certificate_is_checked(pki, file, message):
    assert GatewaySecurity.from_env({"GATEWAY_SSL_CERT": str(pki["gateway"])}).ssl_cert
    with pytest.raises(ValueError, match=f"^{message}"):
        GatewaySecurity.from_env({"GATEWAY_SSL_CERT": str(pki[file])})
