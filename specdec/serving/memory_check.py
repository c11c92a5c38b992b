"""The memory check of a server's settings, run before tritonserver starts: the engines'
weights, KV caches, CUDA graphs and work space (specdec/engines/memory.py counts them)
against the free memory of their device.

    python -m specdec.serving.memory_check [--replicas N] [--max-draft-tokens K]

reads the settings from the environment as the launcher does (a setting that is unset is
its default; specdec/serving/settings.py) and exits 2 with one line on stderr when they do
not fit, naming NUM_SLOTS, MAX_CONTEXT, the bytes needed and available and the largest
NUM_SLOTS that fits; 0 and silent when they do. The launcher and the gateway run it as a
child (server_config.memory_fits): it imports torch and may ask CUDA for its free memory,
which a supervisor would otherwise carry for the server's whole life. Pure: no Triton.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdec.engines.memory import (
    MemoryPlan,
    MemoryRefused,
    available_memory,
    check_engines_fit,
    memory_device,
)
from specdec.serving import settings

DEFAULT_MAX_DRAFT_TOKENS = 8  # speculative_decoding's max_num_draft_tokens when not given
EXIT_REFUSED = 2


def setting_value(setting: settings.Setting, env: Mapping[str, str]) -> Any:
    """A setting's value in `env`, its default where unset."""
    text = setting.from_env(env)
    return setting.parse(setting.variable, setting.default if text is None else text)


def project_root(env: Mapping[str, str]) -> Path:
    """Where relative checkpoint paths start: SPECDEC_HOME, else this project's root."""
    return Path(env.get("SPECDEC_HOME") or Path(__file__).resolve().parents[2])


def check_environment(
    env: Mapping[str, str],
    replicas: int = 1,
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
    available: int | None = None,
) -> MemoryPlan:
    """check_engines_fit for the settings in `env`, `replicas` servers on one device:
    raises MemoryRefused (one line) when they do not fit. Both engines are counted
    whatever PROPOSERS says: the draft_model loads either way. available: bytes free
    (None: the device's, or the test hook memory.AVAILABLE_BYTES_VARIABLE in `env`)."""
    root = project_root(env)
    checkpoints = [
        root / setting_value(s, env)
        for s in (settings.TARGET_CHECKPOINT, settings.DRAFT_CHECKPOINT)
    ]
    engine, device = setting_value(settings.ENGINE, env), setting_value(settings.DEVICE, env)
    if available is None:
        available = available_memory(memory_device(engine, device), env)
    return check_engines_fit(
        checkpoints[0],
        checkpoints[1],
        engine=engine,
        device=device,
        dtype=setting_value(settings.DTYPE, env),
        cuda_graphs=setting_value(settings.CUDA_GRAPHS, env),
        num_slots=setting_value(settings.NUM_SLOTS, env),
        max_context=setting_value(settings.MAX_CONTEXT, env),
        max_draft_tokens=max_draft_tokens,
        replicas=replicas,
        available=available,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Refuses settings whose engines do not fit.")
    parser.add_argument("--replicas", type=int, default=1, help="servers on this device")
    parser.add_argument("--max-draft-tokens", type=int, default=DEFAULT_MAX_DRAFT_TOKENS)
    args = parser.parse_args()
    try:
        check_environment(os.environ, args.replicas, args.max_draft_tokens)
    except (MemoryRefused, ValueError, RuntimeError, OSError) as error:
        print(f"specdec memory check: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)


if __name__ == "__main__":
    main()
