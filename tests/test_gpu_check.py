"""build/gpu_check.py where no GPU is needed: its arguments, its report, its comparison."""

from __future__ import annotations

import json

from build.gpu_check import agreement, parse_args, run


def test_dry_run_writes_a_report_without_starting_a_server(tmp_path):
    out = tmp_path / "gpu_check.json"
    config = parse_args(["--dry-run", "--out", str(out), "--num-prompts", "3"])
    assert config.num_prompts == 3 and config.dry_run and not config.skip_tensorrt
    run(config)
    report = json.loads(out.read_text())
    assert report["config"]["num_prompts"] == "3"
    assert set(report["steps"]) == {"cpu", "cuda", "tensorrt"}
    assert all(s["skipped"] == "dry run" for s in report["steps"].values())
    assert report["passed"] is None
    assert "cuda_available" in report["environment"]


def test_agreement_names_the_prompts_that_differ():
    assert agreement(["a", "b", "c"], ["a", "x", "c"]) == {
        "equal": 2,
        "total": 3,
        "differing_prompts": [1],
    }
