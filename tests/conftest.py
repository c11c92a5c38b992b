"""Shared fixtures: the real models, and real Triton servers started once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT

MODELS = PROJECT_ROOT / "models"
TARGET = MODELS / "smollm2-135m-instruct"
DRAFT = MODELS / "smollm2-135m-draft"


@pytest.fixture(scope="session")
def target_dir() -> Path:
    if not (TARGET / "config.json").exists():
        pytest.fail("models missing: run `make models` (make test does)")
    return TARGET


@pytest.fixture(scope="session")
def server(target_dir):
    """The default repository: 4-layer draft, torch engine, default k; the suffix proposer
    runs beside the default proposers (it is not among them), so that its cases, and every
    adaptive request's choice among all three, run here."""
    running = ManagedServer(
        "test-default",
        {"NUM_SLOTS": "32", "MAX_CONTEXT": "1024", "PROPOSERS": "draft_model,ngram,suffix,grammar"},
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def self_draft_server(target_dir):
    """Draft = target: every proposal is accepted. 8 slots and a queue of 4: overload.
    Responses go out on the response thread here (RESPONSE_THREAD), inline on the others."""
    running = ManagedServer(
        "test-self-draft",
        {
            "DRAFT_CHECKPOINT": str(target_dir),
            "NUM_SLOTS": "8",
            "MAX_CONTEXT": "512",
            "MAX_QUEUE": "4",
            "RESPONSE_THREAD": "true",
        },
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def hf_target(target_dir):
    """The reference: Hugging Face transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.eval()
    return tokenizer, model


def hf_greedy_text(hf_target, prompt: str, max_new_tokens: int) -> str:
    import torch

    tokenizer, model = hf_target
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- strict skips (CI: .ci/run sets SPECDEC_STRICT_SKIPS=1) ----------------------------------
# A skipped test is not coverage. Under SPECDEC_STRICT_SKIPS=1 only tests marked `gpu` may
# skip (CI has no GPU); any other skip turns into a failure that names the skip's reason, and
# the summary lists them all.
STRICT_SKIPS = os.environ.get("SPECDEC_STRICT_SKIPS") == "1"
ALLOWED_SKIP_MARKERS = ("gpu",)
_strict_skip_failures: list[tuple[str, str]] = []  # (test id, the skip's reason)


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    allowed = any(item.get_closest_marker(name) for name in ALLOWED_SKIP_MARKERS)
    if STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail") and not allowed:
        reason = _skip_reason(report)
        _strict_skip_failures.append((item.nodeid, reason))
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, and SPECDEC_STRICT_SKIPS=1 lets only tests marked "
            f"{' or '.join(ALLOWED_SKIP_MARKERS)} skip: {reason}"
        )
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A whole module skipped at import (a module-level pytest.skip or importorskip) has no
    test to carry a marker: under strict skips it fails the collection."""
    report = yield
    if STRICT_SKIPS and report.skipped:
        reason = _skip_reason(report)
        _strict_skip_failures.append((collector.nodeid, reason))
        report.outcome = "failed"
        report.longrepr = f"skipped at collection, and SPECDEC_STRICT_SKIPS=1: {reason}"
    return report


def pytest_terminal_summary(terminalreporter) -> None:
    if _strict_skip_failures:
        terminalreporter.section("skips outside the allow-list (SPECDEC_STRICT_SKIPS=1)", red=True)
        for nodeid, reason in _strict_skip_failures:
            terminalreporter.line(f"{nodeid}: {reason}")
