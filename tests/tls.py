"""Certificates made at run time with the openssl CLI (`.ci/run` installs it), for the tests of
TLS and of the certificate checks: P-256 keys, valid from now for a day or two unless dated."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
# `openssl ca` is the one command of OpenSSL 3.0 that sets both dates of a certificate.
DATED_CA_CONFIG = """[ ca ]
default_ca = dated
[ dated ]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = any_name
unique_subject = no
[ any_name ]
commonName = supplied
"""


def require_openssl() -> None:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is missing (apt-get install openssl; .ci/run installs it)")


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate authority valid for 2 days: <name>.crt and <name>.key."""
    openssl(
        folder,
        *("req", "-x509", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.crt"),
        *("-days", "2", "-subj", f"/CN=specdec test {name}"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    return folder / f"{name}.crt", folder / f"{name}.key"


def make_server_certificate(folder: Path, ca: str, name: str = "server") -> tuple[Path, Path]:
    """<name>.crt for 127.0.0.1 and localhost, signed by the CA <ca>.crt / <ca>.key, and
    <name>.key."""
    (folder / f"{name}.ext").write_text(
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\n"
        "extendedKeyUsage = serverAuth\n"
    )
    openssl(
        folder,
        *(
            "req",
            *EC_KEY,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            "/CN=127.0.0.1",
        ),
    )
    openssl(
        folder,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key"),
        *("-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext"),
    )
    return folder / f"{name}.crt", folder / f"{name}.key"


def make_pki(folder: Path) -> dict[str, Path]:
    """What the TLS tests share: a CA ("ca"), a server certificate for 127.0.0.1 signed by it
    ("cert", "key"), and another CA that signed nothing of ours ("other_ca", "other_key")."""
    require_openssl()
    ca, _ = make_ca(folder, "ca")
    other_ca, other_key = make_ca(folder, "other-ca")
    cert, key = make_server_certificate(folder, "ca")
    return {"ca": ca, "other_ca": other_ca, "other_key": other_key, "cert": cert, "key": key}


def make_dated_certificate(folder: Path, name: str, start: str, end: str) -> tuple[Path, Path]:
    """A self-signed <name>.crt valid from `start` to `end` (openssl's YYYYMMDDHHMMSSZ), e.g.
    one that expired in 2020 or one not valid before 2099, and <name>.key."""
    dated = folder / f"dated-{name}"
    dated.mkdir()
    (dated / "ca.cnf").write_text(DATED_CA_CONFIG)
    (dated / "index.txt").write_text("")
    (dated / "serial").write_text("01\n")
    key, csr, cert = folder / f"{name}.key", dated / f"{name}.csr", folder / f"{name}.crt"
    openssl(dated, "req", "-new", *EC_KEY, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=x")
    openssl(
        dated,
        *("ca", "-batch", "-config", "ca.cnf", "-selfsign", "-keyfile", str(key), "-in", str(csr)),
        *("-startdate", start, "-enddate", end, "-notext", "-out", str(cert)),
    )
    return cert, key
