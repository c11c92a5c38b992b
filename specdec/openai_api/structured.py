"""Structured output for chat: OpenAI's `response_format` and `tools` as the BLS's guided
decoding inputs (TensorRT-LLM's `guided_decoding_guide_type` / `guided_decoding_guide`,
compiled by xgrammar), and the conversation with its tools and tool calls as the chat
template's messages (docs/openai.md, Structured output and Tools).

    response_format json_object       -> json_schema     {"type": "object"} (the guide type
                                                          json is any JSON value: an array too)
    response_format json_schema       -> json_schema     (its schema; strict or not)
    tools, tool_choice "auto"         -> structural_tag  (free text, never "<tool_response";
                                                          after "<tool_call>", a call whose
                                                          arguments follow its function's
                                                          parameters)
    tools, tool_choice "required"     -> structural_tag  (one or more calls, nothing else)
    tools, tool_choice {function}     -> structural_tag  (one call of that function)
    tools, tool_choice "none"         -> nothing         (and no tools in the prompt)

The calls' text is specdec/openai_api/tool_calls.py's format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specdec.openai_api.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
)
from specdec.openai_api.tool_calls import CALL_END, CALL_OPEN, call_begin, call_text

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# At most this many whitespace characters in a row inside a call's arguments: a small model
# under a grammar can otherwise loop on whitespace that every JSON grammar allows.
MAX_ARGUMENTS_WHITESPACE = 1
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Results come from the tools, never from the model: free text must not start one (a small
# model that has seen results in its history writes one of its own instead of a call).
FORGED_RESULT = TOOL_RESPONSE_OPEN.removesuffix(">")


@dataclass(frozen=True)
class Guide:
    """The BLS's guided decoding inputs: a guide type, and its text."""

    type: str
    text: str

    def triton_params(self) -> dict[str, str]:
        return {"guided_decoding_guide_type": self.type, "guided_decoding_guide": self.text}


def tool_choice(body: ChatCompletionRequest) -> str | NamedToolChoice:
    """The tool choice in force: "none" without tools, else the request's ("auto" if none)."""
    if not body.tools:
        return "none"
    return body.tool_choice or "auto"


def check_structured(body: ChatCompletionRequest) -> None:
    """What pydantic's field types cannot say, refused naming the field."""
    _check_response_format(body)
    _check_tools(body)
    _check_messages(body.messages)


def _check_response_format(body: ChatCompletionRequest) -> None:
    response_format = body.response_format
    if response_format is None:
        return
    if response_format.type == "json_schema" and response_format.json_schema is None:
        message = "response_format.json_schema: required with type json_schema"
        raise ApiError(400, message, "response_format.json_schema")
    if response_format.type != "json_schema" and response_format.json_schema is not None:
        message = (
            f"response_format.json_schema: only with type json_schema, not {response_format.type}"
        )
        raise ApiError(400, message, "response_format.json_schema")
    if response_format.type != "text" and tool_choice(body) != "none":
        message = (
            "response_format: a structured response_format and tools cannot be combined "
            '(unless tool_choice is "none")'
        )
        raise ApiError(400, message, "response_format")


def _check_tools(body: ChatCompletionRequest) -> None:
    if body.tool_choice is not None and not body.tools:
        raise ApiError(400, "tool_choice: only allowed when tools are given", "tool_choice")
    names = [tool.function.name for tool in body.tools or []]
    for index, name in enumerate(names):
        if name in names[:index]:
            param = f"tools[{index}].function.name"
            raise ApiError(400, f"{param}: {name!r} is given twice", param)
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        param = "tool_choice.function.name"
        raise ApiError(400, f"{param}: no tool is named {choice.function.name!r}", param)


def _check_messages(messages: list[ChatMessage]) -> None:
    """Roles and their fields as OpenAI's; a tool message answers a call of the assistant
    message before it (an agent loop resends its history: a wrong id is its bug)."""
    call_ids: set[str] = set()  # of the last assistant message, while tool messages follow
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.tool_calls is not None and message.role != "assistant":
            raise ApiError(
                400, f"{where}.tool_calls: only in assistant messages", f"{where}.tool_calls"
            )
        if (message.tool_call_id is None) != (message.role != "tool"):
            detail = (
                "required in tool messages" if message.role == "tool" else "only in tool messages"
            )
            raise ApiError(400, f"{where}.tool_call_id: {detail}", f"{where}.tool_call_id")
        if message.content is None and not message.tool_calls:
            raise ApiError(400, f"{where}.content: required", f"{where}.content")
        if message.role == "tool" and message.tool_call_id not in call_ids:
            detail = "does not answer a tool call of the assistant message before it"
            param = f"{where}.tool_call_id"
            raise ApiError(400, f"{param}: {message.tool_call_id!r} {detail}", param)
        if message.role != "tool":
            call_ids = {call.id for call in message.tool_calls or []}


# -- guides -------------------------------------------------------------------------------
def guide(body: ChatCompletionRequest) -> Guide | None:
    """What the answer must follow; None: free text."""
    choice = tool_choice(body)
    if choice != "none":
        assert body.tools  # tool_choice() says "none" without
        one_call = body.parallel_tool_calls is False
        return Guide(
            "structural_tag", json.dumps(_tools_structural_tag(body.tools, choice, one_call))
        )
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    spec = response_format.json_schema
    schema = ANY_OBJECT if spec is None or spec.schema_ is None else spec.schema_
    return Guide("json_schema", json.dumps(schema))


def _tools_structural_tag(tools: list[Tool], choice: str | NamedToolChoice, one_call: bool) -> dict:
    """xgrammar's structural tag (xgrammar.structural_tag) for the tool choice; one_call:
    parallel_tool_calls false."""
    if isinstance(choice, NamedToolChoice):
        (named,) = [tool for tool in tools if tool.function.name == choice.function.name]
        return {"type": "structural_tag", "format": _call_tag(named)}
    tags = [_call_tag(tool) for tool in tools]
    calls: dict[str, Any]
    if choice == "required":  # calls only, one per line
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n"}
        calls["at_least_one"] = True
    else:  # auto: free text; once it writes the trigger, a whole call
        calls = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags}
        calls["excludes"] = [FORGED_RESULT]
    calls["stop_after_first"] = one_call
    return {"type": "structural_tag", "format": calls}


def _call_tag(tool: Tool) -> dict:
    arguments = {
        "type": "json_schema",
        "json_schema": tool.function.parameters or ANY_OBJECT,
        "max_whitespace_cnt": MAX_ARGUMENTS_WHITESPACE,
    }
    return {
        "type": "tag",
        "begin": call_begin(tool.function.name),
        "content": arguments,
        "end": CALL_END,
    }


# -- the prompt ---------------------------------------------------------------------------
def template_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The chat template's {"role", "content"} messages: developer as system, assistant
    tool calls and tool results as text in the format, the tools (unless tool_choice is
    "none") described in the system message."""
    messages = [_template_message(message) for message in body.messages]
    choice = tool_choice(body)
    if choice == "none":
        return messages
    assert body.tools  # tool_choice() says "none" without
    tools_text = tools_prompt(body.tools, choice)
    if messages[0]["role"] == "system":
        system = messages[0]["content"]
        messages[0] = {
            "role": "system",
            "content": f"{system}\n\n{tools_text}" if system else tools_text,
        }
    else:
        messages.insert(0, {"role": "system", "content": tools_text})
    return messages


def _template_message(message: ChatMessage) -> dict[str, str]:
    if message.role == "tool":
        return {
            "role": "tool",
            "content": f"{TOOL_RESPONSE_OPEN}\n{message.text}\n{TOOL_RESPONSE_CLOSE}",
        }
    if message.role == "developer":
        return {"role": "system", "content": message.text}
    calls = [
        call_text(call.function.name, call.function.arguments) for call in message.tool_calls or []
    ]
    return {"role": message.role, "content": "\n".join(filter(None, [message.text, *calls]))}


def tools_prompt(tools: list[Tool], choice: str | NamedToolChoice) -> str:
    """The tools and how to call them, for the system message."""
    definitions = "\n".join(
        json.dumps({"type": "function", "function": tool.function.model_dump(exclude_none=True)})
        for tool in tools
    )
    if isinstance(choice, NamedToolChoice):
        rule = f"Answer with a call of the function {choice.function.name}."
    elif choice == "required":
        rule = "Answer with one or more function calls."
    else:
        rule = "Call a function when it helps to answer; otherwise answer in text."
    example = call_text("<function name>", "<arguments as a JSON object>")
    return (
        "You can call functions. Their definitions, one per line:\n"
        f"<tools>\n{definitions}\n</tools>\n"
        f"{rule} Write each call as:\n{example}\n"
        f"A call's result comes back in {TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE}."
    )
