"""build/engine_speed.py, the engine's forward timed in process: every shape in every
precision, in a short run on the small draft checkpoint; a malformed shape refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from build.engine_speed import spread_slots
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
            "1x1,2x3,3x1@7",
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
        shapes = [(r["rows"], r["tokens"], r["span"]) for r in results]
        assert shapes == [(1, 1, 1), (2, 3, 2), (3, 1, 7)]
        assert all(r["median_ms"] > 0 for r in results)
    for malformed in ("4", "16x1@8"):  # no tokens; fewer slots than rows
        refused = subprocess.run(
            [sys.executable, "-m", "build.engine_speed", "--shapes", malformed],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
        )
        assert refused.returncode == 2 and "--shapes" in refused.stderr, malformed


def test_spread_slots_are_distinct_and_span_the_range():
    assert spread_slots(1, 1) == [0]
    assert spread_slots(16, 16) == list(range(16))
    slots = spread_slots(16, 32)
    assert len(set(slots)) == 16 and slots[0] == 0 and slots[-1] == 31
