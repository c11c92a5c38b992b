"""The agentic workload (loadtest/agentic.py): tasks are the same in every process and never
the same as each other, their reference calls are in the one format the system prompt
teaches, a conversation fits the server's context."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from specdec.paths import PROJECT_ROOT
from specdec.serving.settings import MAX_CONTEXT
from specdec.text.tokenizer import load_tokenizer

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
import agentic  # noqa: E402

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
