"""The workloads that exercise prefix reuse (issue 31): shared-prefix (one system text of about
1,000 tokens before every question) and multi-turn (each request resends the conversation
with the answers the stream received). Checked with the model's tokenizer and scripted
answers: the prefixes the server could reuse are there, token for token; bench's modes walk
the same sequence however its windows cut it; the locustfile's users build the same
prompts. The last test sends them to the real server and reads the reuse it reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.paths import PROJECT_ROOT
from specdec.text.tokenizer import load_tokenizer

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from bench import StreamPrompts  # noqa: E402
from common import (  # noqa: E402
    CONVERSATIONS,
    SYSTEM_PROMPTS,
    WORKLOADS,
    load_prompts,
    read_conversations,
    read_workload,
)
from walks import ConversationWalk, Message, strided  # noqa: E402

MIN_TOKENS = 64  # the server's PREFIX_MIN_TOKENS: a shorter common prefix is not reused


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(PROJECT_ROOT / "models" / "smollm2-135m-instruct"))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def scripted_answer(prompt: str) -> str:
    """A greedy server's stand-in: the same prompt always gets the same answer, of a few
    dozen tokens, with the whitespace and characters real answers bring."""
    n = sum(map(ord, prompt)) % 997
    return f"\n Answer {n}: first, check the figures.\n\n- Step one costs {n / 7:.2f}; café ok. "


def test_the_system_text_is_about_1000_tokens(tokenizer):
    system = SYSTEM_PROMPTS[WORKLOADS["shared-prefix"]].read_text()
    assert 900 <= len(tokenizer.encode(system)) <= 1100


def test_every_shared_prefix_prompt_starts_with_the_same_900_tokens(tokenizer):
    prompts = [tokenizer.encode(p) for p in load_prompts(WORKLOADS["shared-prefix"])]
    assert len(prompts) >= 24
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert shared >= 900
    assert all(len(p) - shared < 60 for p in prompts)  # then a short question
    # Negative control: chat's prompts share only the template's default system turn.
    chat = [tokenizer.encode(p) for p in load_prompts(WORKLOADS["chat"])]
    assert min(common_prefix(chat[0], p) for p in chat[1:]) < MIN_TOKENS


def test_conversations_have_four_turns_and_a_first_prompt_past_the_reuse_minimum(tokenizer):
    lines = CONVERSATIONS["multi-turn"].read_text().splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    assert len(items) >= 12 and all(set(item) == {"category", "turns"} for item in items)
    conversations = read_conversations(CONVERSATIONS["multi-turn"])
    assert all(len(turns) == 4 for turns in conversations)
    assert len({turns[0] for turns in conversations}) == len(conversations)
    # A first turn alone fills the reuse minimum (with a margin for the last token, which the
    # answer's first token may merge into), whatever the answer.
    for turns in conversations:
        first = tokenizer.apply_chat_template([{"role": "user", "content": turns[0]}])
        assert len(tokenizer.encode(first)) >= MIN_TOKENS + 4, turns[0][:60]


def walk_prompts(walk, render, num_requests: int, answer=scripted_answer) -> list[tuple]:
    """(prompt, answer) for each of a walk's requests, answered by `answer`."""
    sent = []
    for _ in range(num_requests):
        prompt = render(walk.next_request())
        reply = answer(prompt)
        walk.answered(reply)
        sent.append((prompt, reply))
    return sent


def test_a_multi_turn_stream_resends_each_turn_with_its_answer(tokenizer):
    workload = read_workload("multi-turn")
    conversations = workload.conversations
    walk = workload.stream_walk(1, 3)  # stream 1 of 3: conversations 1, 4, 7, ...
    sent = walk_prompts(walk, tokenizer.apply_chat_template, 12)
    for n, (prompt, _) in enumerate(sent):
        conversation, turn = conversations[1 + 3 * (n // 4)], n % 4
        assert prompt.endswith(
            f"<|im_start|>user\n{conversation[turn]}<|im_end|>\n<|im_start|>assistant\n"
        )
        if turn == 0:  # a conversation opens with its first turn alone
            assert prompt == tokenizer.apply_chat_template(conversation[0])
            continue
        before, answer = sent[n - 1]
        assert prompt.startswith(before + answer)
        previous = tokenizer.encode(before + answer)
        tokens = tokenizer.encode(prompt)
        assert tokens[: len(previous)] == previous  # token for token
        assert len(previous) >= MIN_TOKENS
    # Negative control: across a conversation's end nothing is shared past the default system.
    assert common_prefix(tokenizer.encode(sent[3][0]), tokenizer.encode(sent[4][0])) < MIN_TOKENS


def test_a_failed_turn_opens_the_next_conversation():
    conversations = [["a1", "a2", "a3"], ["b1", "b2", "b3"]]
    walk = ConversationWalk(conversations, strided(0, 1, 2))
    assert walk.next_request() == [{"role": "user", "content": "a1"}]
    walk.answered("A1")
    assert walk.next_request()[-1] == {"role": "user", "content": "a2"}
    walk.answered(None)  # failed: no answer to keep
    assert walk.next_request() == [{"role": "user", "content": "b1"}]
    walk.answered("B1")
    assert walk.next_request() == [
        {"role": "user", "content": "b1"},
        {"role": "assistant", "content": "B1"},
        {"role": "user", "content": "b2"},
    ]


def mode_sequences(workload, render, cuts, answer) -> dict[str, list[str]]:
    """bench's prompts for one stream (1 of 3), the modes taking turns in windows of the
    given lengths (as timing cuts them), each request answered by answer(mode, prompt)."""
    prompts = StreamPrompts(workload, 1, 3, render)
    sent: dict[str, list[str]] = {}
    for mode, length in cuts:
        for _ in range(length):
            prompt = prompts.next_prompt(mode)
            prompts.answered(mode, answer(mode, prompt))
            sent.setdefault(mode, []).append(prompt)
    return {mode: prompts[:9] for mode, prompts in sent.items()}


# Windows in mirrored order, each cut after a different number of requests.
CUTS = [("k0", 2), ("adaptive", 5), ("k0-again", 3), ("k0-again", 6), ("adaptive", 4), ("k0", 7)]


@pytest.mark.parametrize("name", ["multi-turn", "shared-prefix", "chat"])
def test_every_bench_mode_walks_the_same_prompt_sequence(name, tokenizer):
    workload = read_workload(name)
    render = tokenizer.apply_chat_template
    sequences = mode_sequences(workload, render, CUTS, lambda mode, p: scripted_answer(p))
    assert sequences["k0"] == sequences["adaptive"] == sequences["k0-again"]
    expected = walk_prompts(workload.stream_walk(1, 3), render, 9)
    assert sequences["k0"] == [prompt for prompt, _ in expected]


def test_multi_turn_modes_part_where_their_answers_differ(tokenizer):
    """Negative control: answers that depend on the mode (sampled) give each mode its own
    history; the user turns still come in the same order."""
    workload = read_workload("multi-turn")
    sequences = mode_sequences(
        workload, tokenizer.apply_chat_template, CUTS, lambda mode, p: f"{mode} says {len(p)}"
    )
    assert sequences["k0"][0] == sequences["adaptive"][0]  # a first turn: no answer in it
    assert sequences["k0"][1] != sequences["adaptive"][1]
    last_turn = [[p.rsplit("<|im_start|>user\n", 1)[1] for p in s] for s in sequences.values()]
    assert last_turn[0] == last_turn[1] == last_turn[2]


# Runs the locustfile's users in a process of their own (importing Locust monkey-patches the
# process for gevent): GrpcUser's task with a scripted pool, OpenAIUser's request bodies.
LOCUST_USERS = """
import argparse, json, sys, types
sys.argv = ["locust"]
sys.path.insert(0, "loadtest")
sys.path.insert(0, "tests")
import locustfile
from grpc_streams import StreamResult
from test_prefix_workloads import scripted_answer

parser = argparse.ArgumentParser()
locustfile.add_arguments(parser)
out = {}
for workload in ("shared-prefix", "multi-turn"):
    options = parser.parse_args(["--workload", workload])
    env = types.SimpleNamespace(parsed_options=options)
    grpc_user = types.SimpleNamespace(environment=env)
    locustfile.StreamingUser.setup(grpc_user)
    sent = []

    def generate(prompt, timeout, on_chunk, **params):
        sent.append(prompt)
        return StreamResult(text=scripted_answer(prompt))

    grpc_user.pool = types.SimpleNamespace(generate=generate)
    grpc_user.render = locustfile.chat_format
    grpc_user.next_request = lambda: {"mode": "k0"}
    grpc_user.params = lambda mode: {"max_tokens": 8}
    grpc_user.finish = lambda record, result, guide, max_tokens: None
    for _ in range(10):
        locustfile.GrpcUser.generate(grpc_user)
    openai_user = types.SimpleNamespace(environment=env, host="h", models={"h": "m"})
    locustfile.StreamingUser.setup(openai_user)
    openai_user.params = lambda mode: {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0}
    bodies = []
    for _ in range(10):
        path, body = locustfile.OpenAIUser.body(openai_user, "k0")
        bodies.append(body["messages"])
        openai_user.walk.answered(scripted_answer(locustfile.chat_format(body["messages"])))
    out[workload] = {"grpc": sent, "openai": bodies}
print(json.dumps(out))
"""


def test_locust_users_build_the_same_prompts_and_histories(tokenizer):
    result = subprocess.run(
        [sys.executable, "-c", LOCUST_USERS],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.splitlines()[-1])
    render = tokenizer.apply_chat_template
    shared = set(load_prompts(WORKLOADS["shared-prefix"]))
    for user in ("grpc", "openai"):
        sent = out["shared-prefix"][user]
        prompts = sent if user == "grpc" else [render(m) for m in sent]
        assert len(prompts) == 10 and set(prompts) <= shared
    conversations = {turns[0]: turns for turns in read_workload("multi-turn").conversations}
    for user in ("grpc", "openai"):
        sent = out["multi-turn"][user]
        check_histories([m if user == "openai" else None for m in sent], sent, conversations)


def check_histories(messages: list, sent: list, conversations: dict) -> None:
    """Each request is its conversation's next turn after the history and its scripted
    answers; gRPC's prompts (`messages` None) rendered as the tokenizer's template would."""
    render = load_tokenizer(
        str(PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    ).apply_chat_template
    openers = {render(turns[0]): turns for turns in conversations.values()}
    expected: list[Message] = []
    turns: list[str] = []
    for request, prompt in zip(messages, sent, strict=True):
        if not turns:  # a new conversation: known by its first turn
            opened = conversations[request[0]["content"]] if request else openers[prompt]
            turns, expected = list(opened), []
        expected = [*expected, {"role": "user", "content": turns.pop(0)}]
        rendered = render(expected)
        if request is None:
            assert prompt == rendered
        else:
            assert request == expected
        expected = [*expected, {"role": "assistant", "content": scripted_answer(rendered)}]
    assert len(sent) == 10 and len(turns) == 2  # 4 + 4 + 2 turns


@pytest.mark.server
def test_the_server_reuses_what_the_workloads_share(server):
    """Through the real server (prefix cache on): a second shared-prefix question reuses the
    system text, a multi-turn stream's second turn its first turn and answer."""
    from common import chat_template
    from specdec.client import generate

    render = chat_template()

    def ask(messages: list[Message]):
        result = generate(
            render(messages),
            server.url,
            max_tokens=8,
            exclude_input_in_output=True,
            return_perf_metrics=True,
        )
        assert result.error is None, result.error
        return result

    questions = read_workload("shared-prefix").stream_walk(0, 1)
    ask(questions.next_request())
    assert ask(questions.next_request()).metrics["kv_cache_reused_blocks"] >= 900
    turns = read_workload("multi-turn").stream_walk(0, 1)
    turns.answered(ask(turns.next_request()).text)
    assert ask(turns.next_request()).metrics["kv_cache_reused_blocks"] >= MIN_TOKENS


def make_target_args(target: str) -> list[str]:
    """The arguments the Makefile's `target` passes to bench.py, its variables' defaults in."""
    import re
    import shlex

    text = (PROJECT_ROOT / "Makefile").read_text().replace("\\\n", " ")
    defaults = dict(re.findall(r"^(\w+) \?= (.*)$", text, re.M))
    recipe = re.search(rf"^{target}:.*\n\t(.*)$", text, re.M)
    assert recipe is not None, target
    command = re.sub(r"\$\((\w+)\)", lambda m: defaults.get(m[1], m[0]), recipe[1])
    words = shlex.split(command)
    return words[words.index("loadtest/bench.py") + 1 :]


def test_make_bench_prefix_compares_reuse_on_and_off_on_each_workload():
    from bench import parse_args

    config = parse_args(make_target_args("bench-prefix"))
    assert {"shared-prefix", "multi-turn"} <= set(config.workloads)
    assert config.modes == ["k0", "adaptive", "k0-again"] and config.concurrency == [1, 16]
    second = config.second
    assert second.env == {"PREFIX_CACHE": "off"} and second.each_workload
    assert (second.concurrency, second.rounds) == (16, 2)
    assert parse_args(["--env-b", "PREFIX_CACHE=off"]).second.each_workload is False


def level(workload: str, mode: str, tokens_per_s: float, ttft: float):
    from bench import LevelResult

    return LevelResult(
        workload, mode, 16, 10, 0, 100, 10.0, tokens_per_s, [tokens_per_s], 0.0, 0.0,
        1.0, 2.0, ttft, 2 * ttft, 0.1, 0.2,
    )  # fmt: skip


def test_the_second_server_on_each_workload_reports_each_with_its_noise_floor(capsys):
    from bench import BenchConfig, SecondServer, is_second, report, second_label

    second = SecondServer({"PREFIX_CACHE": "off"}, 16, each_workload=True, label="on vs off")
    assert second_label(second, "multi-turn") == "env-b:multi-turn"
    levels = [level("multi-turn", m, 50.0, 0.5) for m in ("k0", "adaptive")]
    for name, off in (("shared-prefix", 20.0), ("multi-turn", 25.0)):
        label = second_label(second, name)
        levels += [level(label, "k0", 40.0, 0.3), level(label, "k0-again", 38.0, 0.3)]
        levels.append(level(label, "k0-b", off, 1.5))
    assert [is_second(r, second) for r in levels] == [False] * 2 + [True] * 6
    config = BenchConfig(["k0", "adaptive"], [16], workloads=["multi-turn"], second=second)
    report(levels, config, {"noise_floor": 0.95})
    printed = capsys.readouterr().out
    assert "| multi-turn | 16 | 50.0 | 50.0 | 1.00x |" in printed  # the modes' table alone
    assert "(env-b:shared-prefix), on vs off: 2.00x (40.0 / 20.0 tok/s); ttft p50   0.30 s /" in (
        printed
    )
    assert "(env-b:multi-turn), on vs off: 1.60x" in printed and "k0-again / k0 0.95x" in printed
    # The first workload alone (before --b-workloads): one line, as before.
    first = SecondServer({"PREFIX_CACHE": "off"}, 16, label="on vs off")
    assert second_label(first, "chat") == "env-b"
    old = [level("env-b", "k0", 30.0, 0.2), level("env-b", "k0-b", 20.0, 0.2)]
    report(old, BenchConfig(["k0"], [], second=first), {"noise_floor": None})
    assert "k = 0 at 16 streams, on vs off: 1.50x (30.0 / 20.0 tok/s)" in capsys.readouterr().out
