"""build/gpu_run.py on the CPU: its pure parts (model shapes, the k = 4 / k = 0 ratio, the
served figures and the issue's targets) and its dry run, the same steps at toy sizes."""

from __future__ import annotations

import json

import pytest

import build.gpu_run as gpu_run
from build.gpu_run import (
    RunConfig,
    iteration_ratios,
    level_figures,
    llama_3_1_8b,
    llama_3_2_1b,
    memory_needed,
    parameter_count,
    ratio_targets,
    served_targets,
)

STEPS = ("engines", "served", "gpu_check")


def test_the_8b_and_1b_shapes_have_their_parameter_counts():
    assert parameter_count(llama_3_1_8b()) == pytest.approx(8.03e9, rel=0.005)
    assert parameter_count(llama_3_2_1b()) == pytest.approx(1.236e9, rel=0.005)
    assert llama_3_2_1b().tie_word_embeddings and not llama_3_1_8b().tie_word_embeddings
    assert llama_3_2_1b().num_heads * llama_3_2_1b().head_dim == 2048


def test_memory_needed_covers_the_weights_and_grows_with_the_rows():
    weights = 2 * parameter_count(llama_3_1_8b())
    one, many = (memory_needed(llama_3_1_8b(), rows) for rows in (1, 128))
    assert weights < one < many
    # 128 rows of 1,040 positions at 128 KB per position (bfloat16): about 17 GB of cache
    assert many - one > 16e9


TIMINGS = {
    "graphed": {
        "target": {"1": {"decode_ms": 4.0, "verify_ms": 5.0}, "64": {"decode_ms": 5.0}},
        "draft": {"1": {"draft_ms": 2.0}, "64": {"skipped": "budget"}},
    },
    "eager": {"target": {"1": {"decode_ms": 20.0, "verify_ms": 22.0}}, "draft": {}},
}


def test_iteration_ratio_is_draft_call_plus_verify_over_decode():
    ratios = iteration_ratios(TIMINGS)
    assert ratios["graphed"]["1"] == {"k4_ms": 7.0, "k0_ms": 4.0, "ratio": 1.75}
    assert ratios["graphed"]["64"] == {"k4_ms": None, "k0_ms": 5.0, "ratio": None}
    assert ratios["eager"]["1"]["ratio"] is None  # no draft figure
    assert ratio_targets(ratios) == {
        "graphed 1 rows <= 1.9x": True,
        "graphed 64 rows <= 2.5x": None,
    }
    worse = iteration_ratios({"graphed": {**TIMINGS["graphed"], "draft": {"1": {"draft_ms": 4.0}}}})
    assert ratio_targets(worse)["graphed 1 rows <= 1.9x"] is False  # (4 + 5) / 4 = 2.25


def bench_level(mode: str, per_s: float, draft: float, target: float, tokens_s: float) -> dict:
    parts = {"cancel_check": 0.1, "draft": draft, "target": target, "schedule": 0.2}
    return {
        "mode": mode,
        "tokens_per_s": tokens_s,
        "iterations_per_s": per_s,
        "tokens_per_iteration": tokens_s / per_s,
        "num_errors": 0,
        **{f"{part}_ms_per_iteration": ms for part, ms in parts.items()},
        "respond_ms_per_iteration": 0.5,
        "outbox_ms_per_iteration": 0.4,
    }


def test_host_work_is_the_iteration_less_the_engine_calls():
    figures = level_figures(bench_level("k4-si16", 100.0, 3.0, 4.5, 5000.0))
    assert figures["iteration_ms"] == 10.0
    assert figures["host_work_ms"] == 2.5
    assert figures["ms_per_iteration"]["target"] == 4.5
    assert (
        level_figures({**bench_level("k0", 1, 0, 0, 0), "iterations_per_s": 0.0})["host_work_ms"]
        is None
    )


def test_served_targets():
    pairs = {
        "135m": {
            "modes": {
                "k0-si16": level_figures(bench_level("k0-si16", 500.0, 0.0, 0.5, 30000.0)),
                "k4-si16": level_figures(bench_level("k4-si16", 100.0, 3.0, 2.5, 9000.0)),
            }
        },
        "tiny": {"error": "the server did not start"},
    }
    assert served_targets(pairs) == {
        "135m k0-si16 host work <= 2.0 ms": True,  # 2.0 - 0.5 = 1.5
        "135m k4-si16 host work <= 4.0 ms": False,  # 10 - 5.5 = 4.5
        "tiny k0-si16 >= 8000 tok/s": None,
    }


def test_engines_step_at_toy_sizes(tmp_path):
    """The in-process step's code on the CPU: every configuration timed or skipped with a
    reason, and the ratios derived from what was timed."""
    config = RunConfig(out=tmp_path / "r.json").dry()
    seen: list[dict] = []
    result = gpu_run.engines_step(
        config, lambda figures: seen.append(json.loads(json.dumps(figures)))
    )
    assert len(seen) == len(config.rows) * 2 * 2  # rows x modes x roles
    eager, graphed = result["timings"]["eager"], result["timings"]["graphed"]
    for rows in ("1", "2"):
        assert eager["target"][rows]["decode_ms"] > 0 and eager["target"][rows]["verify_ms"] > 0
        assert eager["draft"][rows]["draft_ms"] > 0
        assert "CUDA only" in graphed["target"][rows]["skipped"]
        assert result["ratios"]["eager"][rows]["ratio"] > 0
    assert result["models"]["target"]["num_layers"] == 2


@pytest.mark.server
def test_dry_run_writes_every_steps_outcome(tmp_path, target_dir):
    """The whole run at toy sizes on the CPU (a real server for the tiny pair, a short
    level): the report has each step's outcome, duration and figures."""
    out = tmp_path / "gpu_run.json"
    config = gpu_run.parse_args(
        [
            "--dry-run",
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "work"),
            "--tokenizer",
            str(target_dir),
        ]
    )
    gpu_run.run(config)
    report = json.loads(out.read_text())
    assert list(report["steps"]) == list(STEPS)
    for name in STEPS:
        outcome = report["steps"][name]
        assert outcome["ok"] is True, outcome.get("error")
        assert outcome["seconds"] >= 0 and outcome["budget_s"] > 0
        assert "running" not in outcome
    served = report["steps"]["served"]
    assert "skipped" in served["pairs"]["135m"]
    modes = served["pairs"]["tiny"]["modes"]
    assert set(modes) == {"k0-si16", "k0-again-si16"}
    assert modes["k0-si16"]["tokens_per_s"] > 0 and modes["k0-si16"]["host_work_ms"] is not None
    assert set(served["targets"]) == {
        "135m k0-si16 host work <= 2.0 ms",
        "135m k4-si16 host work <= 4.0 ms",
        "tiny k0-si16 >= 8000 tok/s",
    }
    check = report["steps"]["gpu_check"]["report"]
    assert "tie_margin" in check["steps"] and check["passed"] is None  # gpu_check's dry run
    assert report["config"]["dry_run"] is True
