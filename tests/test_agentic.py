"""The agentic workload (loadtest/agentic.py): tasks are the same in every process and never
the same as each other, their reference calls are in the one format the system prompt
teaches, a conversation fits the server's context; and the rule it exists for: no
prompt is sent twice in a bench run (modes, levels, windows, streams, warm-ups), nor in a
cold run's bursts, while the other workloads keep sending every mode the same sequence."""

from __future__ import annotations

import itertools
import json
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from specdec.client import GenerationResult
from specdec.paths import PROJECT_ROOT
from specdec.serving.settings import MAX_CONTEXT
from specdec.text.tokenizer import load_tokenizer

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
import agentic  # noqa: E402
import bench  # noqa: E402
import cold_start  # noqa: E402
from common import read_workload  # noqa: E402

CONTEXT = int(MAX_CONTEXT.default)  # the bench's servers' (the test servers' is smaller)
MAX_TOKENS = 128  # bench's answers


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(PROJECT_ROOT / "models" / "smollm2-135m-instruct"))


def test_a_task_is_the_same_in_another_process_with_another_hash_seed():
    indices = [0, 1, 7, 2**40 + 3, agentic.NUM_TASKS - 1]
    here = [agentic.task(i).turns for i in indices]
    code = f"import agentic, json; print(json.dumps([agentic.task(i).turns for i in {indices}]))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PROJECT_ROOT / "loadtest",
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == here
    assert agentic.TASKS[7] == agentic.task(7).turns == here[2]
    assert agentic.TASKS[2:4] == [agentic.task(2).turns, agentic.task(3).turns]


def test_tasks_never_repeat_and_tickets_are_one_to_one():
    indices = [*range(3000), *range(2**40, 2**40 + 500), agentic.NUM_TASKS - 1]
    first_turns = [agentic.TASKS[i][0] for i in indices]
    assert len(set(first_turns)) == len(indices)
    tickets = {agentic.ticket(i) for i in indices}
    assert len(tickets) == len(indices) and all(len(t) == 16 for t in tickets)
    assert all(agentic.ticket(i) in agentic.TASKS[i][0] for i in indices[:50])
    for bad in (-1, agentic.NUM_TASKS):
        with pytest.raises(IndexError):
            agentic.task(bad)
    assert len(agentic.TASKS) == agentic.NUM_TASKS


def test_calls_repeat_the_format_not_the_values():
    tasks = [agentic.task(i) for i in range(400)]
    assert Counter(t.kind for t in tasks).keys() == {"trip", "order", "meeting", "refund"}
    assert all(2 <= len(t.turns) <= 3 for t in tasks)
    for t in tasks:
        for turn in t.turns[1:]:
            assert turn.startswith("Tool result: {") and "\nNext: " in turn
        for call in t.calls:
            assert set(call) == {"tool", "arguments"} and call["tool"] in agentic.TOOLS
    # the values vary: every task's calls are its own, and most of its first calls
    assert len({json.dumps(t.calls) for t in tasks}) == len(tasks)
    assert len({json.dumps(t.calls[0]) for t in tasks}) > 0.8 * len(tasks)


def test_the_head_teaches_the_format_with_a_call_of_each_tool_that_parses():
    system, *examples = agentic.HEAD
    assert system == {"role": "system", "content": agentic.SYSTEM_PROMPT}
    assert all(f"- {name}:" in agentic.SYSTEM_PROMPT for name in agentic.TOOLS)
    assert [m["role"] for m in examples] == ["user", "assistant"] * (len(examples) // 2)
    calls = [json.loads(m["content"]) for m in examples if m["role"] == "assistant"]
    assert all(set(call) == {"tool", "arguments"} for call in calls)
    assert sorted(call["tool"] for call in calls) == sorted(agentic.TOOLS)
    # the examples' values are none of the tasks': a copied one shows in an answer
    words = set(re.findall(r"\w+", json.dumps(examples)))
    assert not words & {*agentic.CITIES, *agentic.FIRST_NAMES, *agentic.LAST_NAMES}
    assert agentic.call_text("get_weather", city="Lyon", unit="celsius") == (
        '{"tool": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}'
    )


def test_a_conversation_fits_the_context_even_with_answers_of_max_tokens(tokenizer):
    longest = 0
    for i in range(200):
        messages = list(agentic.HEAD)
        for turn in agentic.task(i).turns:
            messages.append({"role": "user", "content": turn})
            longest = max(longest, len(tokenizer.encode(tokenizer.apply_chat_template(messages))))
            messages.append({"role": "assistant", "content": " x" * MAX_TOKENS})
    assert longest + MAX_TOKENS <= CONTEXT, longest


def after_head(prompt: str) -> str:
    """A rendered agentic prompt past its head (which has tool results of its own)."""
    assert prompt.count(agentic.SYSTEM_PROMPT) == 1
    return prompt.split(agentic.HEAD[-1]["content"], 1)[1]


def scripted_answer(prompt: str) -> str:
    """A greedy server's stand-in: one prompt, one answer."""
    return agentic.call_text("lookup_order", order_id=f"Z{sum(map(ord, prompt)) % 10**6:06d}")


class FakeClient:
    """bench's StreamingClient without a server: every prompt recorded, answered at once."""

    sent: list[str] = []
    lock = threading.Lock()

    def __init__(self, url: str, model: str):
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc) -> None:
        pass

    salted: list[tuple[str | None, str]] = []  # (cache_salt, prompt) of the loads' requests

    def generate(self, prompt: str, on_chunk=None, **params) -> GenerationResult:
        with self.lock:
            self.sent.append(prompt)
            self.salted.append((params.get("cache_salt"), prompt))
        time.sleep(0.002)  # a request takes time: the streams take turns
        on_chunk("{")
        answer = scripted_answer(prompt)
        metrics = {"num_output_tokens": 8, "num_input_tokens": len(prompt)}
        return GenerationResult(answer, [answer], [0.001], metrics, elapsed=0.002)


def bench_prompts(monkeypatch, workload: str) -> list[str]:
    """Every prompt a bench run sends (warm-up, lead-ins, counted requests): two modes at
    1 and 3 streams, each in two windows of 0.15 s per level, on a fake client."""
    FakeClient.sent, FakeClient.salted = [], []
    monkeypatch.setattr(bench, "StreamingClient", FakeClient)
    monkeypatch.setattr(bench, "generate", lambda prompt, *a, **k: FakeClient.sent.append(prompt))
    config = bench.BenchConfig(["k0", "adaptive"], [1, 3], level_seconds=0.3)
    config.workloads = [workload]
    levels = bench.run_modes(config, "fake:8001", itertools.count())
    assert [(r.mode, r.concurrency) for r in levels] == [
        ("k0", 1),
        ("adaptive", 1),
        ("k0", 3),
        ("adaptive", 3),
    ]
    return FakeClient.sent


def test_no_prompt_is_sent_twice_in_a_bench_run_of_agentic(monkeypatch):
    sent = bench_prompts(monkeypatch, "agentic")
    assert len(sent) > 100  # many turns in every window
    assert len(set(sent)) == len(sent), [p for p, n in Counter(sent).items() if n > 1][:1]
    turns = [after_head(prompt) for prompt in sent]
    # conversations go on past their first turn, with the answers received
    assert sum("Tool result:" in turn for turn in turns) > len(sent) / 3
    assert any(scripted_answer(p) in q for p, q in itertools.pairwise(sent[:50]))


def test_the_other_workloads_still_send_every_mode_the_same_prompts(monkeypatch):
    """Negative control: multi-turn's modes walk one sequence, so its prompts repeat; but
    each mode and level sends them under a cache_salt of its own, so that the store and the
    prefix cache never hand a mode another mode's (or level's) answer to the same prompt.
    Agentic's prompts never repeat: its modes share the store, as real traffic does."""
    sent = bench_prompts(monkeypatch, "multi-turn")
    assert len(set(sent)) < len(sent)
    salted = FakeClient.salted
    assert {salt for salt, _ in salted} == {
        f"bench-{mode}-{streams}" for mode in ("k0", "adaptive") for streams in (1, 3)
    }
    assert all(salt is None for salt, _ in bench_prompts_salted(monkeypatch, "agentic"))


def bench_prompts_salted(monkeypatch, workload: str) -> list[tuple[str | None, str]]:
    bench_prompts(monkeypatch, workload)
    return FakeClient.salted


def test_the_bench_modes_of_agentic_walk_parts_of_their_own(tokenizer):
    """StreamPrompts with a load's ModeParts: modes part at once, a stream keeps its part
    across windows; without parts (a negative control) the modes send the same prompts."""
    workload, render = read_workload("agentic"), tokenizer.apply_chat_template
    counter = itertools.count(5)
    loads = [bench.StreamPrompts(workload, 0, 2, render, bench.ModeParts(counter)) for _ in "ab"]
    assert loads[0].next_prompt("k0") != loads[1].next_prompt("k0")  # stream 0 of two loads
    shared = bench.ModeParts(counter)
    a, b = (bench.StreamPrompts(workload, 0, 2, render, shared) for _ in range(2))
    assert a.next_prompt("k0") == b.next_prompt("k0")  # one load, one mode: one part
    assert a.next_prompt("adaptive") != b.next_prompt("k0-again")
    assert shared.parts == {"k0": 7, "adaptive": 8, "k0-again": 9}
    c, d = (bench.StreamPrompts(workload, 0, 1, render) for _ in range(2))
    assert c.next_prompt("k0") == d.next_prompt("adaptive")


def test_each_cold_burst_of_agentic_sends_tasks_of_its_own(monkeypatch, tmp_path):
    bursts: list[tuple[str, list[str]]] = []

    def fake_burst(config, workload, round_index, arm, prompts):
        bursts.append((workload, prompts))
        phases = config.phases
        return [
            cold_start.PhaseResult(
                workload, round_index, arm, p.name, p.streams, p.num_requests, 0, 64, 64.0,
                10.0, 1.0, 64.0, 1, 8001, 0.0, [64],
            )
            for p in phases
        ]  # fmt: skip

    monkeypatch.setattr(cold_start, "cold_burst", fake_burst)
    config = cold_start.ColdConfig(["agentic", "chat"], name="t", out_dir=tmp_path, rounds=2)
    cold_start.run(config)
    agentic_prompts = [p for name, prompts in bursts if name == "agentic" for p in prompts]
    assert len(agentic_prompts) == 6 * 36  # 2 rounds x 3 arms, 4 + 32 requests each
    assert len(set(agentic_prompts)) == len(agentic_prompts)
    turns = [after_head(p) for p in agentic_prompts]
    assert all("Ticket " in turn and "Tool result" not in turn for turn in turns)
    chat = [prompts for name, prompts in bursts if name == "chat"]
    assert len(chat) == 6 and all(prompts == chat[0] for prompts in chat)  # as before


def make_commands(target: str) -> list[list[str]]:
    """The bench.py arguments of each command `make -n target` prints."""
    printed = subprocess.run(
        ["make", "-n", target], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    ).stdout.replace("\\\n", " ")
    words = [shlex.split(line) for line in printed.splitlines() if "loadtest/bench.py" in line]
    return [line[line.index("loadtest/bench.py") + 1 :] for line in words]


def test_make_bench_agentic_runs_both_workloads_with_the_suffix_modes_in_two_precisions():
    configs = [bench.parse_args(argv) for argv in make_commands("bench-agentic")]
    assert [c.name for c in configs] == ["bench-agentic-float32", "bench-agentic-bfloat16"]
    for config, dtype in zip(configs, ("float32", "bfloat16"), strict=True):
        assert config.workloads == ["agentic", "multi-turn"] and config.concurrency == [1, 16]
        assert config.modes == ["k0", "adaptive", "adaptive-nosuffix", "suffix", "k0-again"]
        assert config.server_env == {"DTYPE": dtype, "PROPOSERS": "draft_model,ngram,suffix"}
    parser = bench.build_parser()
    for argv in make_commands("bench-agentic-cold"):
        cold = bench.cold_config(parser, parser.parse_args(argv))
        assert cold.workloads == ["agentic"] and "suffix" in cold.server_env["PROPOSERS"]
    assert all("agentic" in bench.parse_args(a).workloads for a in make_commands("bench"))
    for argv in make_commands("bench-cold"):
        assert "agentic" in bench.cold_config(parser, parser.parse_args(argv)).workloads
