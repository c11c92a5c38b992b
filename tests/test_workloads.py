"""The load tools' workloads (loadtest/common.WORKLOADS): every prompt file parses and is big
enough, the rewrite set is what docs/benchmarks.md says it is and fits the model's context,
no prompt is in two workloads, and the locustfile's --workload sends the workload named
(multi-turn's conversations too, and agentic's tasks, a different one to each user, and
structured's requests with their guides, its answers reported as valid, invalid or cut; the
prefix workloads' own checks: tests/test_prefix_workloads.py, agentic's:
tests/test_agentic.py, structured's: tests/test_structured.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from specdec.paths import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from common import (  # noqa: E402
    CONVERSATIONS,
    STRUCTURED,
    WORKLOAD_NAMES,
    WORKLOADS,
    load_prompts,
    prompt_messages,
    read_conversations,
    read_prompts,
)
from structured import MAX_TOKENS, read_structured  # noqa: E402

# docs/benchmarks.md: the rewrite workload's categories, eight prompts each.
REWRITE_CATEGORIES = ("style", "simplify", "restructure", "summarise", "perspective", "shorten")
MAX_REWRITE_TOKENS = 400  # chat-formatted; leaves the answer room in a 512-token context


def lines_of(workload: str) -> list[dict]:
    path = WORKLOADS[workload]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_every_workload_parses_and_has_40_distinct_prompts(workload: str):
    items = lines_of(workload)
    assert len(items) >= 40
    assert all(set(item) == {"category", "prompt"} for item in items)
    assert all(isinstance(item["prompt"], str) and item["prompt"].strip() for item in items)
    prompts = read_prompts(WORKLOADS[workload])
    assert prompts == [item["prompt"] for item in items]
    assert len(set(prompts)) == len(prompts)


def test_no_prompt_is_in_two_workloads():
    seen: dict[str, str] = {}
    for workload in WORKLOADS:
        for prompt in read_prompts(WORKLOADS[workload]):
            text = " ".join(prompt.split()).lower()
            assert seen.setdefault(text, workload) == workload, (workload, seen[text])


def test_rewrite_prompts_give_an_input_text_and_fall_into_the_documented_categories():
    items = lines_of("rewrite")
    assert Counter(item["category"] for item in items) == dict.fromkeys(REWRITE_CATEGORIES, 8)
    for item in items:
        instruction, _, text = item["prompt"].partition("\n\n")
        assert instruction and len(text.split()) >= 50, item["prompt"][:80]
        assert len(item["prompt"]) < 1500


def test_rewrite_prompts_fit_the_context_chat_formatted():
    from specdec.text.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    lengths = [len(tokenizer.encode(p)) for p in load_prompts(WORKLOADS["rewrite"])]
    assert max(lengths) < MAX_REWRITE_TOKENS, max(lengths)
    assert min(lengths) > 100  # an input text, not a question alone


# Imports the locustfile in a process of its own (importing Locust monkey-patches the
# process for gevent), parses its options and sets up a user as both user classes do.
LOCUST_PROBE = """
import argparse, json, sys, types
sys.argv = ["locust"]
sys.path.insert(0, "loadtest")
import locustfile

parser = argparse.ArgumentParser()
locustfile.add_arguments(parser)
chosen = {}
for argv in ([], *(["--workload", name] for name in sorted(locustfile.WORKLOAD_NAMES))):
    options = parser.parse_args(argv)
    users = [types.SimpleNamespace(environment=types.SimpleNamespace(parsed_options=options))
             for _ in range(4)]
    for user in users:
        locustfile.StreamingUser.setup(user)
    walk = users[0].walk
    items = walk.conversations if hasattr(walk, "conversations") else walk.requests
    if len(items) > 10**6:  # generated without end (agentic): what four users send first
        items = {"count": len(items), "first": [user.walk.next_request() for user in users]}
    chosen[options.workload if argv else "default"] = items
try:
    parser.parse_args(["--workload", "nonesuch"])
    chosen["refused"] = False
except SystemExit:
    chosen["refused"] = True
print(json.dumps(chosen))
"""


def run_probe(code: str) -> dict:
    """What a probe of the locustfile prints last, as JSON (run in a process of its own)."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_locustfile_workload_option_selects_the_workloads_prompts():
    chosen = run_probe(LOCUST_PROBE)
    assert chosen.pop("refused") is True
    assert chosen.pop("default") == prompt_messages(WORKLOADS["chat"])
    assert set(chosen) == set(WORKLOAD_NAMES)
    for workload, items in chosen.items():
        if workload == "agentic":
            check_agentic_users(items)
        elif workload in CONVERSATIONS:
            assert items == read_conversations(CONVERSATIONS[workload]), workload
        elif workload in STRUCTURED:
            assert items == read_structured(STRUCTURED[workload])[0], workload
        else:
            assert items == prompt_messages(WORKLOADS[workload]), workload
            user_texts = [messages[-1]["content"] for messages in items]
            assert user_texts == read_prompts(WORKLOADS[workload]), workload


def check_agentic_users(items: dict) -> None:
    """Four Locust users on agentic: each opens a task of its own (a random one of them
    all) after the head that defines the tools and shows them called."""
    import agentic

    assert items["count"] == agentic.NUM_TASKS
    first = items["first"]
    assert all(request[:-1] == agentic.HEAD for request in first)
    assert all(request[-1]["content"].startswith("Ticket ") for request in first)
    assert len({request[-1]["content"] for request in first}) == 4


# A Locust user on structured, as the probe above sets one up: the inputs of its next request,
# and the entries it fires for answers that are valid, invalid and cut.
LOCUST_STRUCTURED_PROBE = """
import argparse, json, sys, types
sys.argv = ["locust"]
sys.path.insert(0, "loadtest")
import locustfile
from grpc_streams import StreamResult
from locust import events

parser = argparse.ArgumentParser()
locustfile.add_arguments(parser)

options = parser.parse_args(["--workload", "structured"])

class Probe(locustfile.StreamingUser):
    environment = types.SimpleNamespace(parsed_options=options)

user = Probe()
user.setup()
messages = user.walk.next_request()
guide = user.walk.guide()
params = user.params("k0")
fired = []
events.request.add_listener(
    lambda name, exception, **kw: fired.append([name, exception and str(exception)])
)
answers = {"valid": ('{"name": "set_reminder", "arguments": {"text": "tea", '
                     '"minutes_from_now": 5}}', 20),
           "invalid": ('{"name": "set_reminder"}', 8),
           "cut": ('{"name": "set_re', params["max_tokens"])}
contents = [request[-1]["content"] for request in user.workload.requests]
reminders = user.workload.guides[contents.index("Remind me to water the plants in 45 minutes.")]
records = {}
for verdict, (text, tokens) in answers.items():
    record = {"window": -1}
    result = StreamResult(text=text, metrics={"num_output_tokens": tokens}, chunk_ns=[1, 2])
    user.finish(record, result, reminders, params["max_tokens"])
    records[verdict] = record.get("validity")
sent = []  # GrpcUser's task on a scripted pool: what it sends, and what it checks against
finished = []
user.pool = types.SimpleNamespace(
    generate=lambda prompt, timeout, on_chunk, **params: sent.append(params) or StreamResult()
)
user.render = locustfile.chat_format
user.next_request = lambda: {"mode": "k0"}
user.finish = lambda record, result, guide, max_tokens: finished.append([guide.schema, max_tokens])
locustfile.GrpcUser.generate(user)
print(json.dumps({
    "grpc_sent": sent[0],
    "grpc_schema": user.walk.guide().schema,
    "grpc_finished": finished[0],
    "messages": messages,
    "schema": guide.schema,
    "max_tokens": params["max_tokens"],
    "validity": records,
    "entries": [entry for entry in fired if entry[0] == "structured_output"],
    "response_format": locustfile.response_format(guide),
}))
"""


def test_a_locust_user_on_structured_sends_the_guide_and_reports_each_answers_validity():
    probe = run_probe(LOCUST_STRUCTURED_PROBE)
    requests, guides = read_structured(STRUCTURED["structured"])
    assert probe["schema"] == guides[requests.index(probe["messages"])].schema
    assert probe["max_tokens"] == MAX_TOKENS  # --max-tokens 128 by default: raised
    assert probe["validity"] == {"valid": "valid", "invalid": "invalid", "cut": "cut"}
    assert probe["entries"] == [
        ["structured_output", None],
        ["structured_output", "invalid under its schema"],
        ["structured_output", "cut by max_tokens"],
    ]
    sent = probe["grpc_sent"]
    assert json.loads(sent["guided_decoding_guide"]) == probe["grpc_schema"]
    assert sent["guided_decoding_guide_type"] == "json_schema"
    assert sent["max_tokens"] == MAX_TOKENS
    assert probe["grpc_finished"] == [probe["grpc_schema"], MAX_TOKENS]  # checked against it
    assert probe["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": probe["schema"]},
    }
