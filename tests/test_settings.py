"""Settings of speculative_decoding from the environment (specdec/serving/settings.py,
specdec/server_config.py): STREAM_INTERVAL and RESPONSE_THREAD become config parameters, and a
bad value stops the server before it starts, with a message naming the variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from specdec.paths import PROJECT_ROOT
from specdec.server_config import ServerConfig, render_repository
from specdec.serving.settings import (
    decide_response_thread,
    parse_calibration_seconds,
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


def test_the_launcher_refuses_to_start_with_a_bad_stream_interval(tmp_path):
    """`make serve`'s command exits at once, naming the setting, and starts no server."""
    env = {**os.environ, "STREAM_INTERVAL": "0", "RUN_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "specdec.launch"],
        env=env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "STREAM_INTERVAL: expected an integer >= 1, got '0'" in done.stderr
    assert "tritonserver on" not in done.stdout
    assert not (tmp_path / "model_repository").exists()  # nothing was rendered
