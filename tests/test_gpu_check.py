"""build/gpu_check.py where no GPU is needed: its arguments, its report, and its tie-aware
comparison of greedy text with the CPU reference (a server and a tokenizer scripted)."""

from __future__ import annotations

import contextlib
import json
import types

import pytest

import build.gpu_check as gpu_check
from build.gpu_check import parity, parse_args, run, serve, step
from build.greedy_parity import TIE_MARGIN


def test_dry_run_writes_a_report_without_starting_a_server(tmp_path):
    out = tmp_path / "gpu_check.json"
    config = parse_args(["--dry-run", "--out", str(out), "--num-prompts", "3"])
    assert config.num_prompts == 3 and config.dry_run and not config.skip_tensorrt
    run(config)
    report = json.loads(out.read_text())
    assert report["config"]["num_prompts"] == "3"
    assert set(report["steps"]) == {"cpu", "engines", "tie_margin", "cuda", "tensorrt"}
    assert all(s["skipped"] == "dry run" for s in report["steps"].values())
    assert report["passed"] is None
    assert "cuda_available" in report["environment"]


def test_runs_cover_k0_and_adaptive_at_each_stream_level(tmp_path):
    config = parse_args(["--dry-run", "--out", str(tmp_path / "r.json"), "--streams", "1,16"])
    assert config.runs() == [
        ("k0", 1),
        ("k4", 1),
        ("adaptive", 1),
        ("k0", 16),
        ("adaptive", 16),
    ]
    assert config.dtype == "auto" and config.tie_margin == TIE_MARGIN


WORDS = ["a", " b", " c", " d", " e", " f"]
TOKENIZER = types.SimpleNamespace(decode=lambda ids: "".join(WORDS[i] for i in ids), eos_token_id=5)
# The CPU reference: 3 prompts, each "a b c d" then the end token; the top-2 gap at token 2
# is a near tie (0.05) in the first two, far from one (3.0) in the third.
PATHS = [([0, 1, 2, 3, 5], [4.0, 2.0, 0.05, 1.0, 1.0])] * 2 + [
    ([0, 1, 2, 3, 5], [4.0, 2.0, 3.0, 1.0, 1.0])
]
REFERENCE = (TOKENIZER, PATHS)


def test_parity_tolerates_a_near_tie_and_not_a_real_divergence():
    texts = ["a b c d", "a b e f", "a b e f"]  # equal; parts at a near tie; parts far from one
    result = parity(REFERENCE, texts, margin=0.25)
    assert (result["equal"], result["total"]) == (1, 3)
    assert result["near_ties"] == [{"prompt": 1, "token": 2, "gap": 0.05}]
    assert result["divergences"] == [{"prompt": 2, "token": 2, "gap": 3.0}]


def scripted_server(monkeypatch, texts_by_mode: dict[str, list[str]]) -> None:
    """ManagedServer and the client scripted: each mode answers its texts at 10 tokens/s."""

    @contextlib.contextmanager
    def server(name, env, timeout):
        yield types.SimpleNamespace(url="scripted")

    def measure(url, prompts, k, max_tokens, streams):
        mode = {0: "k0", 4: "k4", None: "adaptive"}[k]
        return {"texts": texts_by_mode[mode], "output_tokens": 10, "tokens_per_s": 10.0}

    monkeypatch.setattr("specdec.harness.ManagedServer", server)
    monkeypatch.setattr(gpu_check, "measure", measure)


@pytest.mark.parametrize("far", [False, True])
def test_a_step_fails_on_a_real_divergence_only(monkeypatch, tmp_path, far):
    """The GPU's greedy text parting from the CPU's at a near tie passes (two kernels may
    round a tie either way); parting where the CPU's top two were far apart fails the step,
    with every run's figures still in the report."""
    same = ["a b c d"] * 3
    tie = ["a b c d", "a b e f", "a b c d"]
    wrong = ["a b c d", "a b c d", "a b e f"]
    scripted_server(monkeypatch, {"k0": same, "k4": wrong if far else tie, "adaptive": same})
    config = parse_args(["--out", str(tmp_path / "r.json"), "--streams", "1,16"])
    report = {"steps": {}}
    step(report, "cuda", lambda: serve("scripted", {}, config, ["p"] * 3, REFERENCE))
    outcome = report["steps"]["cuda"]
    assert outcome["ok"] is (not far)
    assert set(outcome["runs"]) == {"k0@1", "k4@1", "adaptive@1", "k0@16", "adaptive@16"}
    assert outcome["runs"]["k4@1"]["parity"]["near_ties" if not far else "divergences"]
    assert outcome["adaptive_over_k0"] == {1: 1.0, 16: 1.0}
    if far:
        assert "away from a near tie" in outcome["error"]


def test_first_departures_name_the_position_and_the_references_gap_there():
    reference = [([3, 4, 5], [9, 9, 9], [2.0, 0.1, 1.0]), ([3, 4, 2], [9, 9, 9], [2.0, 0.5, 1.0])]
    outputs = [[3, 7, 5], [3, 4, 2]]  # leaves at position 1; equal
    assert gpu_check.first_departures(reference, outputs) == [
        {"prompt": 0, "position": 1, "gap": 0.1}
    ]
    ended_early = [[3, 4, 5], [3, 4]]  # a path that ends early departs at its end
    assert gpu_check.first_departures(reference, ended_early) == []
    assert gpu_check.first_departures(reference, [[3, 4, 5], [3, 2]])[0]["position"] == 1


def test_tie_margin_step_runs_on_the_cpu(tmp_path, target_dir):
    """The GPU step's code on the CPU, on a tiny random checkpoint: the bfloat16 path against
    the float32 reference, every figure present and consistent with the departures."""
    from build.greedy_parity import greedy_top2
    from build.tiny_checkpoint import TinyConfig
    from build.tiny_checkpoint import run as write_checkpoint
    from specdec.engines.llama import LlamaEngine

    tiny = write_checkpoint(TinyConfig(out=tmp_path / "tiny", tokenizer_from=target_dir))
    config = parse_args(["--out", str(tmp_path / "r.json"), "--target", str(tiny)])
    config.max_tokens = 12
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    float32 = LlamaEngine.from_checkpoint(tiny, 1, 32)
    reference = [greedy_top2(float32, ids, config.max_tokens, None) for ids in prompts]
    result = gpu_check.tie_margin_step(config, prompts, reference, None, device="cpu")
    greedy = result["greedy"]
    assert greedy["equal"] + len(greedy["departures"]) == 2
    gaps = [d["gap"] for d in greedy["departures"]]
    assert greedy["max_gap_at_departure"] == (max(gaps) if gaps else None)
    assert result["verify"]["positions"] == 2 * (config.max_tokens - 1) * (5 + 1)
    assert result["precision"]["positions"] == 2 * config.max_tokens
    assert result["tie_margin"]["committed"] == config.tie_margin
