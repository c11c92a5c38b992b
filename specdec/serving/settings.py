"""Settings of speculative_decoding that its config.pbtxt parameters carry and environment
variables set (specdec/server_config.py): parsed and checked here, in one place, so that a
bad value is refused before the server starts (server_config) and again when the model loads
(a config.pbtxt written by hand). Every error names the setting. Pure: no Triton import.
"""

from __future__ import annotations

import os

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


def parse_stream_interval(name: str, value: str) -> int:
    """The server's default stream_interval: output tokens a streamed sequence gathers
    between two responses (1: one response per iteration that added text)."""
    try:
        interval = int(value.strip())
    except ValueError:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}") from None
    if interval < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return interval


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


# Environment variables checked before the server starts: variable -> its parser.
ENV_CHECKS = {
    "STREAM_INTERVAL": parse_stream_interval,
    "RESPONSE_THREAD": parse_response_thread,
    "CUDA_GRAPHS": parse_bool,
    "CALIBRATION_SECONDS": parse_calibration_seconds,
}
