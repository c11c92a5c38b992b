"""The tool-call format's parser (specdec/openai_api/tool_calls.py), whole and streamed: the
deltas of any split of the text add up to the whole answer."""

from __future__ import annotations

import itertools
import json

import pytest

from specdec.openai_api.tool_calls import ToolCallParser, call_text

WEATHER = call_text("get_weather", '{"city": "Paris"}')
TRICKY_ARGUMENTS = '{"code": "}</tool_call>{\\"", "nested": {"list": [1, {"a": "]"}]}, "n": -1.5e3}'


def parse(chunks: list[str]) -> tuple[str, list[dict], list[dict]]:
    """Content, calls and every delta of the text fed in these chunks, then finished."""
    ids = (f"call_{i}" for i in itertools.count())
    parser = ToolCallParser(new_id=lambda: next(ids))
    deltas = [delta for chunk in chunks for delta in parser.feed(chunk)] + parser.finish()
    calls = [call.as_openai() | {"complete": call.complete} for call in parser.calls]
    return parser.content, calls, deltas


def fold(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client makes of streamed deltas, as openai's stream helpers do: content joined,
    calls assembled by index (id, type and name from the first delta of each)."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if piece["index"] == len(calls):
                assert set(piece) == {"index", "id", "type", "function"}, piece
                assert piece["function"]["arguments"] == ""
                calls.append(
                    {"id": piece["id"], "type": piece["type"], "function": {**piece["function"]}}
                )
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {
                    "arguments"
                }
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return content, calls


def call(index: int, name: str, arguments: str, complete: bool = True) -> dict:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{index}", "type": "function", "function": function, "complete": complete}


ANSWERS = [
    ("Just text, no call.", "Just text, no call.", []),
    ("  spaced out \n", "spaced out", []),  # content is stripped
    (WEATHER, "", [call(0, "get_weather", '{"city": "Paris"}')]),
    (
        "Let me check.\n" + WEATHER + "\nDone.",
        "Let me check.\n\nDone.",
        [call(0, "get_weather", '{"city": "Paris"}')],
    ),
    (
        WEATHER + "\n" + call_text("get_time", "{}"),
        "",
        [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_time", "{}")],
    ),
    (call_text("run", TRICKY_ARGUMENTS), "", [call(0, "run", TRICKY_ARGUMENTS)]),
    # Any whitespace in the header; a name with an escape
    ('<tool_call>{ "name" :"a\\"b",\n"arguments":{}}</tool_call>', "", [call(0, 'a"b', "{}")]),
    # Cut in the arguments (max_tokens, a stop sequence): the call stays, incomplete
    (
        '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2',
        "",
        [call(0, "f", '{"x": [1, 2', False)],
    ),
    # Cut after the arguments, before the block closed
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool', "", [call(0, "f", "{}", False)]),
    # Cut in the header: no call yet, the text is content as written
    ('ok <tool_call>\n{"na', 'ok <tool_call>\n{"na', []),
    ("a <tool_ca", "a <tool_ca", []),
    # A block with no call in it stays text
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("x < y <tool> </tool_call>", "x < y <tool> </tool_call>", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_whole_answers(text, content, calls):
    parsed_content, parsed_calls, deltas = parse([text])
    assert (parsed_content, parsed_calls) == (content, calls)
    assert fold(deltas) == (
        content,
        [{k: v for k, v in c.items() if k != "complete"} for c in calls],
    )


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_every_split_gives_the_whole_answer(text, content, calls):
    """In two pieces at every boundary, in three at every pair, and one character at a
    time: the parser's answer and the client's fold of the deltas equal the whole's."""
    whole = parse([text])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    if len(text) < 80:
        pairs = itertools.combinations(range(len(text) + 1), 2)
        splits += [[text[:i], text[i:j], text[j:]] for i, j in pairs]
    splits.append(list(text))
    for chunks in splits:
        streamed = parse(chunks)
        assert streamed[:2] == whole[:2], chunks
        assert fold(streamed[2]) == fold(whole[2]), chunks


def test_streamed_deltas_are_openais_pieces():
    """A call's first delta carries index, id, type and name with arguments ""; the
    arguments follow as pieces (no text is sent before the parser knows it is text)."""
    parser = ToolCallParser(new_id=lambda: "call_x")
    assert parser.feed("Checking") == [{"content": "Checking"}]
    assert parser.feed(" now.\n<tool") == [{"content": " now."}]  # "\n<tool" held back
    first = {"index": 0, "id": "call_x", "type": "function"}
    assert parser.feed('_call>\n{"name": "get_weather", "arguments": {"ci') == [
        {"tool_calls": [{**first, "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
    ]
    assert parser.feed('ty": "Rome"}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}
    ]
    assert parser.finish() == []
    assert parser.calls_complete and json.loads(parser.calls[0].arguments) == {"city": "Rome"}


def test_calls_complete_needs_every_block_closed():
    parser = ToolCallParser()
    parser.feed(WEATHER)
    assert parser.calls_complete
    parser.feed('<tool_call>\n{"name": "g", "arguments": {')
    assert not parser.calls_complete
    assert not ToolCallParser().calls_complete  # no call at all


def test_call_text_is_what_the_parser_reads():
    text = call_text("lookup", '{"q": "x"}')
    assert text == '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    _, calls, _ = parse([text])
    assert calls == [call(0, "lookup", '{"q": "x"}')]
