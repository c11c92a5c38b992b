"""Settings of speculative_decoding from the environment (specdec/serving/settings.py,
specdec/server_config.py): STREAM_INTERVAL and RESPONSE_THREAD become config parameters, the
access settings (keys, TLS files) become tritonserver options, and a bad value stops the server
before it starts, with a message naming the variable."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tls import make_pki

from specdec.paths import PROJECT_ROOT
from specdec.server_config import (
    ServerConfig,
    access_arguments,
    access_summary,
    render_repository,
)
from specdec.serving.settings import (
    EXAMPLE_KEY,
    decide_response_thread,
    parse_calibration_seconds,
    parse_certificate_file,
    parse_header_key,
    parse_private_key_file,
    parse_response_thread,
    parse_stream_interval,
    usable_cores,
)


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("4", 4), (" 16 ", 16)])
def test_stream_interval_values(value, expected):
    assert parse_stream_interval("STREAM_INTERVAL", value) == expected


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "four", "", "4 tokens"])
def test_a_bad_stream_interval_names_the_setting(value):
    with pytest.raises(ValueError, match=r"^STREAM_INTERVAL: expected an integer >= 1"):
        parse_stream_interval("STREAM_INTERVAL", value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", None), ("AUTO", None), ("true", True), ("1", True), ("false", False), ("no", False)],
)
def test_response_thread_values(value, expected):
    assert parse_response_thread("RESPONSE_THREAD", value) is expected


@pytest.mark.parametrize("value", ["maybe", "2", "on", ""])
def test_a_bad_response_thread_names_the_setting(value):
    with pytest.raises(ValueError, match=r"^RESPONSE_THREAD: expected auto, true or false"):
        parse_response_thread("RESPONSE_THREAD", value)


def test_auto_turns_the_response_thread_on_from_four_usable_cores():
    assert decide_response_thread(None, 2) == (
        False,
        "response_thread auto: off (2 usable cores < 4)",
    )
    assert decide_response_thread(None, 3)[0] is False
    assert decide_response_thread(None, 4) == (
        True,
        "response_thread auto: on (4 usable cores >= 4)",
    )
    # A setting wins over the core count either way.
    assert decide_response_thread(True, 2) == (True, "response_thread true (set)")
    assert decide_response_thread(False, 16) == (False, "response_thread false (set)")


def test_usable_cores_follow_the_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("5", 5.0), (" 2.5 ", 2.5)])
def test_calibration_seconds_values(value, expected):
    assert parse_calibration_seconds("CALIBRATION_SECONDS", value) == expected


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon", ""])
def test_a_bad_calibration_budget_names_the_setting(value):
    with pytest.raises(ValueError, match=r"^CALIBRATION_SECONDS: expected seconds >= 0"):
        parse_calibration_seconds("CALIBRATION_SECONDS", value)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"STREAM_INTERVAL": "0"}, "STREAM_INTERVAL"),
        ({"STREAM_INTERVAL": "x"}, "STREAM_INTERVAL"),
        ({"RESPONSE_THREAD": "sometimes"}, "RESPONSE_THREAD"),
        ({"CALIBRATION_SECONDS": "-1"}, "CALIBRATION_SECONDS"),
        ({"CALIBRATION_SECONDS": "soon"}, "CALIBRATION_SECONDS"),
        ({"CALIBRATION_SECONDS": "nan"}, "CALIBRATION_SECONDS"),
    ],
)
def test_server_config_refuses_a_bad_setting_naming_it(env, named):
    with pytest.raises(ValueError, match=f"^{named}: "):
        ServerConfig.from_env(env)


def test_settings_become_the_bls_parameters(tmp_path):
    config = ServerConfig.from_env(
        {"STREAM_INTERVAL": "4", "RESPONSE_THREAD": "auto", "RUN_DIR": str(tmp_path)}
    )
    text = (render_repository(config) / "speculative_decoding" / "config.pbtxt").read_text()

    def parameter(key: str) -> str:
        pattern = r'key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
        match = re.search(pattern, text)
        assert match, key
        return match.group(1)

    assert parameter("stream_interval") == "4"
    assert parameter("response_thread") == "auto"
    # The committed defaults: one response per iteration, the thread decided by the cores.
    committed = PROJECT_ROOT / "model_repository" / "speculative_decoding" / "config.pbtxt"
    text = committed.read_text()
    assert parameter("stream_interval") == "1" and parameter("response_thread") == "auto"


def assert_launch_refused(tmp_path: Path, settings: dict[str, str], message: str) -> None:
    """`make serve`'s command with `settings` exits at once with `message` and starts no
    server: nothing is rendered into its RUN_DIR."""
    env = {**os.environ, **settings, "RUN_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "specdec.launch"],
        env=env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert message in done.stderr
    assert "tritonserver on" not in done.stdout
    assert not (tmp_path / "model_repository").exists()


def test_the_launcher_refuses_to_start_with_a_bad_stream_interval(tmp_path):
    """`make serve`'s command exits at once, naming the setting, and starts no server."""
    assert_launch_refused(
        tmp_path, {"STREAM_INTERVAL": "0"}, "STREAM_INTERVAL: expected an integer >= 1, got '0'"
    )


# -- access: the keys and TLS files (TRITON_INFERENCE_KEY, TRITON_ADMIN_KEY, GRPC_SSL_*) ------


def pem(label: str, body: bytes = b"\x30\x82" + bytes(range(64))) -> str:
    """A PEM block; the base64 body need not be a real certificate for these checks."""
    text = base64.encodebytes(body).decode()
    return f"-----BEGIN {label}-----\n{text}-----END {label}-----\n"


@pytest.fixture
def tls_files(tmp_path) -> dict[str, Path]:
    """Real certificates where their dates and key are read (made with openssl), PEM blocks
    of any body where only the labels are."""
    (tmp_path / "made").mkdir()
    made = make_pki(tmp_path / "made")
    ca, cert, key = made["ca"], made["cert"], made["key"]
    files = {
        "cert": cert.read_text(),
        "chain": cert.read_text() + ca.read_text(),
        "key": key.read_text(),
        "rsa_key": pem("RSA PRIVATE KEY"),
        "encrypted_key": pem("ENCRYPTED PRIVATE KEY"),
        "text": "not a certificate\n",
        "bad_base64": "-----BEGIN CERTIFICATE-----\n#not*base64#\n-----END CERTIFICATE-----\n",
    }
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text(text)
    paths["folder"] = tmp_path
    paths["missing"] = tmp_path / "missing.pem"
    return paths


@pytest.mark.parametrize("value", ["k3y-0f_letters.and~digits", "a" * 64, "x:y=z"])
def test_header_key_values(value):
    assert parse_header_key("TRITON_INFERENCE_KEY", value) == value


@pytest.mark.parametrize("value", ["two words", "tab\tkey", "ключ", "new\nline", ""])
def test_a_bad_header_key_names_the_setting_and_never_shows_the_value(value):
    with pytest.raises(ValueError, match=r"^TRITON_INFERENCE_KEY: expected printable") as error:
        parse_header_key("TRITON_INFERENCE_KEY", value)
    assert not value or value not in str(error.value)


def test_the_committed_example_key_is_refused():
    """deploy/kubernetes/base/secret.yaml's placeholder: a pod that was not given a key of its
    own does not start with a public one."""
    with pytest.raises(ValueError, match=r"^TRITON_INFERENCE_KEY: still the committed example"):
        ServerConfig.from_env({"TRITON_INFERENCE_KEY": EXAMPLE_KEY})


def test_certificate_and_key_files_are_accepted(tls_files):
    assert parse_certificate_file("GRPC_SSL_CERT", str(tls_files["cert"])) == tls_files["cert"]
    assert parse_certificate_file("GRPC_SSL_CERT", str(tls_files["chain"])) == tls_files["chain"]
    for name in ("key", "rsa_key"):
        assert parse_private_key_file("GRPC_SSL_KEY", str(tls_files[name])) == tls_files[name]


@pytest.mark.parametrize(
    ("variable", "file", "message"),
    [
        ("GRPC_SSL_CERT", "missing", "cannot read .*missing.pem: No such file"),
        ("GRPC_SSL_CERT", "folder", "cannot read .*: Is a directory"),
        ("GRPC_SSL_CERT", "text", "text.pem is not a PEM file"),
        ("GRPC_SSL_CERT", "bad_base64", "a CERTIFICATE block that is not base64"),
        ("GRPC_SSL_CERT", "key", "key.pem holds no PEM certificate"),
        ("GRPC_SSL_KEY", "missing", "cannot read .*missing.pem"),
        ("GRPC_SSL_KEY", "text", "is not a PEM file"),
        ("GRPC_SSL_KEY", "cert", "cert.pem holds no PEM private key"),
        ("GRPC_SSL_KEY", "encrypted_key", "is encrypted; tritonserver needs it unencrypted"),
    ],
)
def test_a_bad_tls_file_is_refused_naming_the_variable(tls_files, variable, file, message):
    other = {"GRPC_SSL_CERT": "cert", "GRPC_SSL_KEY": "key"}
    env = {name: str(tls_files[default]) for name, default in other.items()}
    env[variable] = str(tls_files[file])
    with pytest.raises(ValueError, match=f"^{variable}: .*{message}"):
        ServerConfig.from_env(env)


@pytest.mark.parametrize(("given", "missing"), [("GRPC_SSL_CERT", "KEY"), ("GRPC_SSL_KEY", "CERT")])
def test_tls_needs_both_files(tls_files, given, missing):
    path = tls_files["cert" if given == "GRPC_SSL_CERT" else "key"]
    with pytest.raises(ValueError, match=f"^GRPC_SSL_{missing}: not set, and {given} is"):
        ServerConfig.from_env({given: str(path)})


def option_values(arguments: list[str], option: str) -> list[str]:
    return [a.split("=", 1)[1] for a in arguments if a.startswith(option + "=")]


def test_access_arguments_lock_what_is_set_and_nothing_else(tls_files):
    assert access_arguments(ServerConfig.from_env({})) == []
    config = ServerConfig.from_env(
        {
            "TRITON_INFERENCE_KEY": "infer:ence=key",
            "TRITON_ADMIN_KEY": "admin-secret",
            "GRPC_SSL_CERT": str(tls_files["cert"]),
            "GRPC_SSL_KEY": str(tls_files["key"]),
        }
    )
    arguments = access_arguments(config)
    for option in ("--http-restricted-api", "--grpc-restricted-protocol"):
        groups = {}
        for value in option_values(arguments, option):
            apis, restriction = value.split(":", 1)  # Triton splits at the first ':' and '='
            header, key = restriction.split("=", 1)
            groups[header] = (set(apis.split(",")), key)
        assert groups == {
            "inference-key": (
                {"inference", "metadata", "model-config", "statistics"},
                "infer:ence=key",
            ),
            "admin-key": (
                {"model-repository", "shared-memory", "trace", "logging"},
                "admin-secret",
            ),
        }
        # Health stays open (probes, the gateway's checks, the BLS's own readiness check).
        assert not any("health" in apis for apis, _ in groups.values())
    assert option_values(arguments, "--grpc-use-ssl") == ["true"]
    assert option_values(arguments, "--grpc-server-cert") == [str(tls_files["cert"])]
    assert option_values(arguments, "--grpc-server-key") == [str(tls_files["key"])]
    assert "infer:ence=key" not in repr(config) and "admin-secret" not in repr(config)
    assert access_summary(config) == (
        "gRPC TLS, inference needs the inference-key header, admin APIs need the admin-key header"
    )


def test_the_launcher_refuses_a_missing_certificate_before_the_server_starts(tmp_path):
    files = {"GRPC_SSL_CERT": tmp_path / "server.crt", "GRPC_SSL_KEY": tmp_path / "server.key"}
    assert_launch_refused(
        tmp_path,
        {name: str(path) for name, path in files.items()},
        f"GRPC_SSL_CERT: cannot read {files['GRPC_SSL_CERT']}",
    )
