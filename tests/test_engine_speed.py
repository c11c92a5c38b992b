"""build/engine_speed.py, the engine's forward timed in process: every shape in every
precision, in a short run on the small draft checkpoint; a malformed shape refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specdec.paths import PROJECT_ROOT


def test_engine_speed_times_each_shape_in_each_precision(tmp_path: Path):
    out = tmp_path / "engine.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build.engine_speed",
            "--checkpoint",
            str(PROJECT_ROOT / "models" / "smollm2-135m-draft"),
            "--shapes",
            "1x1,2x3",
            "--cached",
            "16",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        timeout=300,
        cwd=PROJECT_ROOT,
        check=True,
    )
    report = json.loads(out.read_text())
    assert set(report["dtypes"]) == {"bfloat16", "float32"}
    for results in report["dtypes"].values():
        assert [(r["rows"], r["tokens"]) for r in results] == [(1, 1), (2, 3)]
        assert all(r["median_ms"] > 0 for r in results)
    refused = subprocess.run(
        [sys.executable, "-m", "build.engine_speed", "--shapes", "4"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--shapes" in refused.stderr
