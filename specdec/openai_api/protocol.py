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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content
        if not isinstance(text, str):
            text = "".join(part.text for part in text)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # only false


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
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
}


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic's first error, as OpenAI words one: HTTP 400 naming the field."""
    error = errors[0]
    loc = [part for part in error.get("loc", ()) if part != "body"]
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
OVERLOADED = ("queue full", "server is shutting down")


def triton_error(
    message: str, triton_inputs: set[str], prompt_field: str, max_tokens_name: str
) -> ApiError:
    """A Triton error as an OpenAI one: the BLS's InvalidInput ("<input>: <why>") becomes a
    400 naming the OpenAI field; a full queue or a stopping server 503; the rest 500."""
    message = re.sub(r"^\[request id: [^\]]*\] ", "", message.strip())
    match = re.match(r"(\w+): (.*)", message, re.DOTALL)
    if match and match.group(1) in triton_inputs:
        name, detail = match.groups()
        names = {**OPENAI_NAME_OF_INPUT, "text_input": prompt_field, "max_tokens": max_tokens_name}
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
        hold = max((self._overlap(w) for w in self.stop_words), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _overlap(self, word: str) -> int:
        """Length of the longest end of `pending` that begins `word`."""
        for size in range(min(len(word) - 1, len(self.pending)), 0, -1):
            if word.startswith(self.pending[-size:]):
                return size
        return 0


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

    def add(self, new_text: str) -> str:
        out = self.trimmer.feed(new_text)
        self.text += out
        return out

    def finish(self) -> str:
        out = self.trimmer.flush()
        self.text += out
        return out

    def finish_reason(self, max_tokens: int, max_context: int) -> str:
        if self.trimmer.stopped:
            return "stop"
        if self.num_output_tokens >= max_tokens:
            return "length"
        if self.num_input_tokens + self.num_output_tokens > max_context:
            return "length"
        return "stop"  # the end token


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

    def chunk(self, choice: Choice, text: str, finish_reason: str | None = None) -> dict:
        if self.chat:
            delta: dict = {} if finish_reason and not text else {"content": text}
            if not choice.role_sent:
                delta, choice.role_sent = {"role": "assistant", **delta}, True
            item = {"index": choice.index, "delta": delta}
        else:
            item = {"index": choice.index, "text": text}
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
                item = {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": choice.text},
                }
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
