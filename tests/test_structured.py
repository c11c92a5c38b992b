"""The structured workload (loadtest/structured.py): its requests and schemas read from the
prompt file, the check that sorts answers into valid, invalid and cut, the walks that hand
out each request's guide, the room max_tokens leaves, and what bench and the client make of
them. No server: the end-to-end run is `make bench-structured`."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from tritonclient.utils import deserialize_bytes_tensor

from specdec.client import GenerationResult, build_inputs
from specdec.paths import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from bench import (  # noqa: E402
    LevelResult,
    Request,
    StreamPrompts,
    parse_args,
    validity,
    validity_table,
)
from common import STRUCTURED, read_workload  # noqa: E402
from structured import (  # noqa: E402
    CUT,
    INVALID,
    MAX_TOKENS,
    VALID,
    Guide,
    Tally,
    check,
    distinct_guides,
    read_structured,
)
from walks import Workload, strided  # noqa: E402

ANSWERS = PROJECT_ROOT / "loadtest" / "structured_answers.jsonl"

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "kind": {"enum": ["food", "tool"]},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "items"],
    "additionalProperties": False,
}
VALID_ORDER = '{"order_id": "A-1", "items": [{"product": "mug", "quantity": 2, "kind": "tool"}]}'


@pytest.mark.parametrize(
    "text",
    [
        VALID_ORDER,
        '\n  {"order_id": "A-1", "items": []}\n',  # whitespace around, optional parts left out
    ],
)
def test_an_answer_its_schema_accepts_is_valid(text: str):
    assert check(text, ORDER, num_output_tokens=30, max_tokens=64) == VALID


@pytest.mark.parametrize(
    "text",
    [
        '{"order_id": "A-1"}',  # a required field missing
        '{"order_id": "A-1", "items": [{"product": "mug", "quantity": 0}]}',  # below minimum
        '{"order_id": "A-1", "items": [{"product": "mug", "quantity": 1.5}]}',  # not an integer
        '{"order_id": "A-1", "items": [{"product": "mug", "quantity": 1, "kind": "toy"}]}',
        '{"order_id": "A-1", "items": [], "note": "x"}',  # a property the schema does not have
        '{"order_id": "A-1", "items": [}',  # not JSON
        "",
        VALID_ORDER + VALID_ORDER,  # two values
    ],
)
def test_an_answer_its_schema_refuses_is_invalid(text: str):
    assert check(text, ORDER, num_output_tokens=30, max_tokens=64) == INVALID


def test_an_answer_that_reached_max_tokens_is_cut_whatever_its_text():
    """The end token is not counted: at max_tokens the server stopped before it."""
    assert check('{"order_id": "A-1", "items": [', ORDER, 64, 64) == CUT
    assert check(VALID_ORDER, ORDER, 64, 64) == CUT
    assert check(VALID_ORDER, ORDER, 63, 64) == VALID


def test_the_tally_counts_each_verdict_apart():
    tally = Tally()
    for verdict in (VALID, VALID, INVALID, CUT, VALID):
        tally.add(verdict)
    assert (tally.valid, tally.invalid, tally.cut) == (3, 1, 1)
    assert str(tally) == "valid 3/5 (invalid 1, cut 1)"
    with pytest.raises(ValueError):
        tally.add("maybe")


def lines() -> list[dict]:
    path = STRUCTURED["structured"]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_prompt_file_reads_as_requests_with_their_guides():
    requests, guides = read_structured(STRUCTURED["structured"])
    items = lines()
    assert 24 <= len(requests) == len(guides) == len(items) <= 40
    assert requests == [item["messages"] for item in items]
    for messages, guide, item in zip(requests, guides, items, strict=True):
        assert messages[-1]["role"] == "user" and messages[-1]["content"].strip()
        assert guide.guide_type == "json_schema"
        assert json.loads(guide.guide) == item["schema"] == guide.schema
    texts = [json.dumps(messages) for messages in requests]
    assert len(set(texts)) == len(texts)


def schema_features(schema: dict, found: set[str]) -> set[str]:
    """The shapes a schema uses, found anywhere in it."""
    if schema.get("type") == "object":
        found.add("object")
        properties = schema["properties"]
        if set(schema.get("required", [])) != set(properties):
            found.add("optional")
        for value in properties.values():
            if value.get("type") == "object":
                found.add("nested object")
            if value.get("type") == "array" and value["items"].get("type") == "object":
                found.add("array of objects")
            schema_features(value, found)
    if schema.get("type") == "array":
        schema_features(schema["items"], found)
    for case in schema.get("anyOf", []):
        found.add("anyOf")
        schema_features(case, found)
    found.update(name for name in ("enum", "const", "pattern") if name in schema)
    if schema.get("type") in ("integer", "number"):
        found.add(schema["type"])
    return found


def test_the_workload_has_extraction_and_tool_calls_of_every_shape():
    items = lines()
    kinds = {item["category"].split("-")[0] for item in items}
    assert kinds == {"extract", "tool"}
    found: set[str] = set()
    for item in items:
        schema_features(item["schema"], found)
    assert found >= {
        "object",
        "nested object",
        "array of objects",
        "optional",
        "enum",
        "const",
        "anyOf",
        "pattern",
        "integer",
        "number",
    }
    for item in items:  # a tool call: the tools listed in the system message, a call of one
        if item["category"].startswith("tool-"):
            system = item["messages"][0]
            assert system["role"] == "system"
            for case in item["schema"]["anyOf"]:
                assert case["required"] == ["name", "arguments"]
                assert f'"name": "{case["properties"]["name"]["const"]}"' in system["content"]


def test_a_tool_call_must_give_its_own_tools_arguments():
    (item,) = [i for i in lines() if i["messages"][-1]["content"].startswith("Remind me to water")]
    schema = item["schema"]
    reminder = {"text": "water the plants", "minutes_from_now": 45}
    assert (
        check(json.dumps({"name": "set_reminder", "arguments": reminder}), schema, 20, 64) == VALID
    )
    assert (
        check(json.dumps({"name": "send_email", "arguments": reminder}), schema, 20, 64) == INVALID
    )
    assert (
        check(json.dumps({"name": "set_alarm", "arguments": reminder}), schema, 20, 64) == INVALID
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"guide_type": "regex", "schema": {"type": "string"}}, "guide_type"),
        ({"guide_type": "json_schema", "schema": {"type": "integer", "minimum": "one"}}, "schema"),
    ],
)
def test_reading_refuses_what_cannot_be_checked(tmp_path: Path, line: dict, message: str):
    path = tmp_path / "prompts.jsonl"
    messages = [{"role": "user", "content": "Give a number."}]
    path.write_text(json.dumps({"category": "x", "messages": messages, **line}) + "\n")
    with pytest.raises(ValueError, match=message):
        read_structured(path)


def test_the_guide_travels_as_tensorrt_llms_two_text_inputs():
    guide = Guide("json_schema", ORDER)
    assert guide.inputs() == {
        "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": json.dumps(ORDER),
    }
    assert Guide("json", ORDER).inputs()["guided_decoding_guide"] == ""
    tensors = {t.name(): t for t in build_inputs("prompt", max_tokens=8, **guide.inputs())}
    for name, text in guide.inputs().items():
        assert tensors[name].shape() == [1, 1] and tensors[name].datatype() == "BYTES"
        (value,) = deserialize_bytes_tensor(tensors[name]._get_content())
        assert value.decode() == text


def test_max_tokens_leaves_room_for_every_measured_answer():
    """loadtest/structured_answers.jsonl: the target's greedy answers, each under its grammar
    (loadtest/structured_answers.py), one per request of the prompt file as it is now. Each
    ended by itself and is valid, and MAX_TOKENS leaves half as much again as the longest."""
    answers = [json.loads(line) for line in ANSWERS.read_text().splitlines() if line.strip()]
    requests, guides = read_structured(STRUCTURED["structured"])
    assert [answer["request"] for answer in answers] == [m[-1]["content"] for m in requests]
    for answer, guide in zip(answers, guides, strict=True):
        assert answer["ended"], answer["request"]
        tokens = answer["num_output_tokens"]
        assert check(answer["text"], guide.schema, tokens, MAX_TOKENS) == VALID, answer["text"]
    assert 1.5 * max(answer["num_output_tokens"] for answer in answers) <= MAX_TOKENS


def test_a_walk_hands_out_the_guide_of_the_request_it_sent():
    workload = read_workload("structured")
    requests, guides = read_structured(STRUCTURED["structured"])
    walk = workload.stream_walk(1, 3)
    for index in itertools.islice(strided(1, 3, len(requests)), 20):
        assert walk.next_request() == requests[index]
        assert walk.guide() == guides[index]
    assert read_workload("chat").stream_walk(0, 1).guide() is None
    multi_turn = read_workload("multi-turn").stream_walk(0, 1)
    multi_turn.next_request()
    assert multi_turn.guide() is None


def test_a_workload_takes_a_guide_for_each_request_or_none():
    messages = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    with pytest.raises(ValueError):
        Workload("w", requests=messages, guides=[Guide("json_schema", ORDER)])


def test_structured_requests_ask_for_at_least_its_max_tokens_the_others_as_asked():
    structured, chat = read_workload("structured"), read_workload("chat")
    assert structured.max_tokens(128) == MAX_TOKENS > 128
    assert structured.max_tokens(2 * MAX_TOKENS) == 2 * MAX_TOKENS
    assert chat.max_tokens(64) == 64


def test_the_warm_up_meets_every_guide_once():
    workload = read_workload("structured")
    warm = distinct_guides(workload.requests, workload.guides)
    kinds = {item["category"] for item in lines()}
    assert len(warm) == len(kinds)  # each category one schema
    assert len({json.dumps(guide.schema) for _, guide in warm}) == len(warm)
    assert distinct_guides(read_workload("chat").requests, ()) == []


def answered(text: str, tokens: int, guide: Guide | None, max_tokens: int = 64) -> Request:
    result = GenerationResult(text=text, metrics={"num_output_tokens": tokens})
    return Request(window=0, result=result, guide=guide, max_tokens=max_tokens)


def test_bench_counts_valid_invalid_and_cut_answers_of_guided_requests():
    guide = Guide("json_schema", ORDER)
    failed = answered("", 0, guide)
    failed.result.error = RuntimeError("refused")
    requests = [
        answered(VALID_ORDER, 30, guide),
        answered(VALID_ORDER, 31, guide),
        answered('{"order_id": 5, "items": []}', 12, guide),
        answered('{"order_id": "A-1", "items": [{"pro', 64, guide),
        failed,  # an error: no answer to check (num_errors counts it)
    ]
    assert validity(requests) == {"valid_outputs": 2, "invalid_outputs": 1, "cut_outputs": 1}
    free = [answered("Hello.", 3, None), answered("Hi", 64, None)]
    assert validity(free) == {"valid_outputs": None, "invalid_outputs": None, "cut_outputs": None}


def test_bench_walks_send_each_mode_the_same_guided_requests():
    workload = read_workload("structured")
    prompts = StreamPrompts(workload, 2, 4, render=lambda messages: json.dumps(messages))
    sent: dict[str, list[tuple[str, Guide | None]]] = {}
    for mode in ("k0", "adaptive", "k0", "k0-again", "adaptive", "k0-again") * 3:
        prompt = prompts.next_prompt(mode)
        sent.setdefault(mode, []).append((prompt, prompts.guide(mode)))
    assert sent["k0"] == sent["adaptive"] == sent["k0-again"]
    for prompt, guide in sent["k0"]:
        index = workload.requests.index(json.loads(prompt))
        assert guide == workload.guides[index]


def test_the_validity_table_lists_only_levels_with_guided_requests():
    def level(workload: str, counts: tuple[int, int, int] | None) -> LevelResult:
        names = ("valid_outputs", "invalid_outputs", "cut_outputs")
        fields = dict(zip(names, counts, strict=True)) if counts else {}
        return LevelResult(workload, "k0", 1, 10, 0, 100, 10.0, 10.0, [10.0], 0.0, 0.0,
                           1.0, 1.0, 0.1, 0.1, 0.01, 0.01, **fields)  # fmt: skip

    table = validity_table([level("structured", (9, 1, 0)), level("chat", None)])
    assert table.splitlines()[2:] == ["| structured | 1 | k0 | 9 | 1 | 0 |"]


def test_make_bench_structured_runs_the_workload_in_four_modes_at_two_levels():
    from test_agentic import make_commands

    (argv,) = make_commands("bench-structured")
    config = parse_args(argv)
    assert config.workloads == ["structured"] and config.concurrency == [1, 16]
    assert config.modes == ["k0", "k0-unguided", "adaptive", "k0-again"]
    assert read_workload("structured").max_tokens(config.max_tokens) == MAX_TOKENS


def test_an_unguided_mode_sends_the_prompts_without_their_guides():
    """k0-unguided: plain decoding's inputs, and no guide (what a guide costs, against k0)."""
    from common import mode_inputs, unguided

    assert mode_inputs("k0-unguided") == mode_inputs("k0")
    assert unguided("k0-unguided") and unguided("adaptive-sampled-unguided-si4")
    assert not unguided("k0") and not unguided("adaptive-penalized")


def test_bench_reads_the_grammar_proposers_tokens_from_the_servers_counters():
    """The tokens a grammar forced (the server's `grammar` proposer), beside the others'."""
    from common import counter_deltas

    def scrape(drafted: float, accepted: float) -> dict[str, float]:
        return {
            'specdec_proposer_draft_tokens_total{proposer="grammar"}': drafted,
            'specdec_proposer_accepted_draft_tokens_total{proposer="grammar"}': accepted,
            "specdec_iterations_total": drafted,
        }

    counted = counter_deltas(scrape(10, 10), scrape(50, 48))
    assert (counted["grammar_draft_tokens"], counted["grammar_accepted"]) == (40, 38)
    assert {"grammar_draft_tokens", "grammar_accepted"} <= set(LevelResult.__dataclass_fields__)
