"""OpenAI's completions and chat completions, as specdec/openai_api/app.py serves them: request
models, errors, stop sequences and the response objects, with no server and no Triton here.

Request models forbid unknown fields: a field this server does not implement is refused by
name (HTTP 400) rather than silently ignored. Responses are OpenAI's objects, whole or as
server-sent chunks (`chat.completion.chunk`, `text_completion`).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.openai_api.tool_calls import ToolCallParser, overlap_with_start
from specdec.text.request import MAX_CACHE_SALT, OUTPUT_ONLY

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


class ApiError(Exception):
    """An error in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind  # the "type" of OpenAI's error
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


# -- requests ------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share. None: the default (OpenAI's, or the server's)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1, as OpenAI
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    # Over the output tokens only, as OpenAI counts them (docs/api.md)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id -> [-100, 100], added to its logit
    # extensions, as vLLM names them: over the prompt and the output; [0, 1]; never produced
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    bad_words: list[str] | None = None
    user: str | None = None  # the gateway keeps a user's requests on one replica
    num_draft_tokens: int | None = Field(None, ge=0)  # extension: 0 = no speculation
    stream_interval: int | None = Field(None, ge=1)  # extension: output tokens per chunk
    # vLLM's: the scope of cache reuse; with API keys, within the key's (auth.ApiKeys.cache_salt)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT)

    @property
    def stop_words(self) -> list[str]:
        words = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [word for word in words if word]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False  # only false
    logprobs: int | None = None  # only null


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# OpenAI's rule for function and schema names
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    """A call in an assistant message of the history (as an answer's tool_calls had it)."""

    id: str
    type: Literal["function"]
    function: CalledFunction
    index: int | None = None  # as a streamed delta had it; ignored


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message with tool_calls
    tool_calls: list[MessageToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call it answers

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class JsonSchemaSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None  # with type json_schema only


class FunctionSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any JSON object
    strict: bool | None = None  # the schema is enforced either way


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # only false
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI


def check_supported(body: _Sampling) -> None:
    """Fields that are declared (clients send them at their neutral value) but only accepted
    there."""
    if getattr(body, "echo", False):
        raise ApiError(400, "echo: not supported by this server (only false)", "echo")
    if getattr(body, "logprobs", None):
        raise ApiError(400, "logprobs: not supported by this server", "logprobs")
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and not body.prompt:
        raise ApiError(400, "prompt: no prompt given", "prompt")


def max_tokens_field(body: _Sampling) -> str:
    """The name the client gave the output limit (errors name it)."""
    return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"


def triton_params(
    body: _Sampling, max_tokens: int, cache_salt: str | None = None
) -> dict[str, int | float | str | list]:
    """The BLS's inputs (specdec.client.build_inputs) for one OpenAI request. `cache_salt`:
    what the API's keys make of the body's (never the body's own when keys are set)."""
    params: dict[str, int | float | str | list | None] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "num_return_sequences": body.n,
        "stream": body.stream,
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_p": body.min_p,
        "num_draft_tokens": body.num_draft_tokens,
        "stream_interval": body.stream_interval,
        "cache_salt": cache_salt,
    }
    if body.stop_words:
        params["stop_words"] = body.stop_words
    if body.presence_penalty or body.frequency_penalty:
        params["prompt_ignore_length"] = OUTPUT_ONLY
    if body.logit_bias:
        params["logit_bias_ids"] = list(body.logit_bias)
        params["logit_bias_values"] = list(body.logit_bias.values())
    if body.bad_words:
        # As vLLM: a word is never produced, with or without a space before it.
        params["bad_words"] = list(
            dict.fromkeys(w for word in body.bad_words for w in (word, " " + word.lstrip()))
        )
    return {name: value for name, value in params.items() if value is not None}


# -- errors --------------------------------------------------------------------------------
FIELD_NAMES = {
    info.alias or name
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        TextPart,
        StreamOptions,
        MessageToolCall,
        CalledFunction,
        ResponseFormat,
        JsonSchemaSpec,
        Tool,
        FunctionSpec,
        NamedToolChoice,
    )
    for name, info in model.model_fields.items()
}


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic's first error, as OpenAI words one: HTTP 400 naming the field. Of a union's
    errors (one per member) the one that reached deepest: for a tool_choice object that
    lacks its function's name, that name, not that the object is not "auto"."""

    def field_path(error: dict) -> list:
        return [part for part in error.get("loc", ()) if part != "body"]

    field_errors = [e for e in errors if field_path(e)[:1] == field_path(errors[0])[:1]]
    error = max(field_errors, key=lambda e: len(field_path(e)))  # the first of the deepest
    loc = field_path(error)
    if error.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {error.get('msg')}")
    unknown = error.get("type") == "extra_forbidden"  # its last part: the unknown name
    param = ""
    for i, part in enumerate(loc):  # field names and indices, not pydantic's union tags
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in FIELD_NAMES or (unknown and i == len(loc) - 1):
            param += f".{part}" if param else part
    if unknown:
        message = f"{param}: unknown field, not supported by this server"
    elif error.get("type") == "missing":
        message = f"{param}: required"
    else:
        message = f"{param or 'request body'}: {error.get('msg')}"
    return ApiError(400, message, param or None)


# Triton inputs whose OpenAI field has another name; text_input and max_tokens depend on the
# endpoint and on the field the client used.
OPENAI_NAME_OF_INPUT = {
    "num_return_sequences": "n",
    "stop_words": "stop",
    "random_seed": "seed",
    "logit_bias_ids": "logit_bias",
    "logit_bias_values": "logit_bias",
}
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
OVERLOADED = ("queue full", "server is shutting down")


def triton_error(
    message: str,
    triton_inputs: set[str],
    prompt_field: str,
    max_tokens_name: str,
    guide_field: str = "response_format",
) -> ApiError:
    """A Triton error as an OpenAI one: the BLS's InvalidInput ("<input>: <why>") becomes a
    400 naming the OpenAI field (the guide's: `tools` or `response_format`, what it was made
    from); a full queue or a stopping server 503; the rest 500."""
    message = re.sub(r"^\[request id: [^\]]*\] ", "", message.strip())
    match = re.match(r"(\w+): (.*)", message, re.DOTALL)
    if match and match.group(1) in triton_inputs:
        name, detail = match.groups()
        names = {
            **OPENAI_NAME_OF_INPUT,
            "text_input": prompt_field,
            "max_tokens": max_tokens_name,
            **dict.fromkeys(GUIDE_INPUTS, guide_field),
        }
        param = names.get(name, name)
        suffix = f" (Triton input {name})" if param != name else ""
        return ApiError(400, f"{param}: {detail}{suffix}", param)
    if message.startswith(OVERLOADED):
        return ApiError(503, message, kind="server_error", code="overloaded")
    return ApiError(500, message, kind="server_error")


# -- stop sequences ------------------------------------------------------------------------
class StopTrimmer:
    """Cuts a streamed text at the first stop sequence, which OpenAI leaves out of the
    output (the BLS stops there but keeps it). Holds back a tail that may be the start of a
    stop sequence until the next chunk shows whether it is."""

    def __init__(self, stop_words: list[str]) -> None:
        self.stop_words = stop_words
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` (after what is held back) that is safe to send."""
        if self.stopped:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(w) for w in self.stop_words) if i >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        hold = max((overlap_with_start(self.pending, w) for w in self.stop_words), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


# -- responses -----------------------------------------------------------------------------
@dataclass
class Choice:
    """One returned sequence. OpenAI's index: batch_index * n + sequence_index."""

    index: int
    batch_index: int
    trimmer: StopTrimmer
    text: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    role_sent: bool = False  # streamed chat: the first delta carries the role
    tool_calls: ToolCallParser | None = None  # chat with tools: reads the calls in the text

    def add(self, new_text: str) -> list[dict]:
        """The chat deltas the new text settles: {"content"}, or pieces of tool calls."""
        return self._deltas(self.trimmer.feed(new_text))

    def finish(self) -> list[dict]:
        """The deltas of what was held back (a possible stop sequence or tool call)."""
        deltas = self._deltas(self.trimmer.flush())
        if self.tool_calls is not None:
            deltas += self.tool_calls.finish()
        return deltas

    def _deltas(self, text: str) -> list[dict]:
        self.text += text
        if self.tool_calls is not None:
            return self.tool_calls.feed(text)
        return [{"content": text}] if text else []

    def finish_reason(self, max_tokens: int, max_context: int) -> str:
        """ "tool_calls" for an answer whose calls all closed before it stopped."""
        if self.trimmer.stopped:
            reason = "stop"
        elif self.num_output_tokens >= max_tokens:
            reason = "length"
        elif self.num_input_tokens + self.num_output_tokens > max_context:
            reason = "length"
        else:
            reason = "stop"  # the end token
        if reason == "stop" and self.tool_calls is not None and self.tool_calls.calls_complete:
            return "tool_calls"
        return reason

    def message(self) -> dict:
        """The whole chat answer: with tools, content is the text outside the calls (null
        when it is empty and there are calls)."""
        if self.tool_calls is None:
            return {"role": "assistant", "content": self.text}
        calls = [call.as_openai() for call in self.tool_calls.calls]
        content = self.tool_calls.content or (None if calls else "")
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


@dataclass
class ResponseBuilder:
    """OpenAI's response objects for one request."""

    chat: bool
    model: str
    include_usage: bool = False  # streamed: every chunk carries "usage" (null until the last)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {
            "id": prefix + self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: Choice, delta: dict, finish_reason: str | None = None) -> dict:
        """One chunk of a stream: a chat delta (Choice.add's), or its text for completions."""
        if self.chat:
            if not choice.role_sent:
                delta, choice.role_sent = {"role": "assistant", **delta}, True
            item = {"index": choice.index, "delta": delta}
        else:
            item = {"index": choice.index, "text": delta.get("content", "")}
        item.update(logprobs=None, finish_reason=finish_reason)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(kind, [item])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, choices: list[Choice]) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage(choices)}

    def whole(self, choices: list[Choice], max_tokens: int, max_context: int) -> dict:
        items = []
        for choice in choices:
            reason = choice.finish_reason(max_tokens, max_context)
            if self.chat:
                item = {"index": choice.index, "message": choice.message()}
            else:
                item = {"index": choice.index, "text": choice.text}
            items.append({**item, "logprobs": None, "finish_reason": reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, items), "usage": usage(choices)}


def usage(choices: list[Choice]) -> dict:
    """Prompt tokens once per prompt (its n sequences share it), output tokens of all."""
    num_prompt = sum({c.batch_index: c.num_input_tokens for c in choices}.values())
    num_output = sum(choice.num_output_tokens for choice in choices)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }
