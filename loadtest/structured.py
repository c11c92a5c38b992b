"""The `structured` workload: JSON extraction and tool calls, each request with a JSON schema
that the server's guided decoding must follow (xgrammar; TensorRT-LLM's request inputs
`guided_decoding_guide_type` and `guided_decoding_guide`), and the check of each answer.

loadtest/prompts_structured.jsonl holds one request a line:

    {"category": "tool-weather", "messages": [{"role": ..., "content": ...}, ...],
     "guide_type": "json_schema", "schema": {...}}

Extraction requests (`extract-*`) ask for fields pulled out of a short text: a flat contact
record with optional fields, an order with a list of items (integers, numbers), an event
(a date pattern, an enum, an optional integer), a name with a nested address, a review (an
integer range, an enum, a list of strings). Tool calls (`tool-*`) list two tools in the
system message; the answer is a call {"name": ..., "arguments": {...}} of either, whose
schema is an anyOf over the tools, each tool's name a const.

An answer is valid when it parses as JSON that its schema accepts; cut when it ended
without the end token, at max_tokens (the server does not count the end token: a request
that stopped at max_tokens never sent it); otherwise invalid. Under a correct grammar every
answer that is not cut is valid: an invalid one is a bug on the server's path, speculation
included. MAX_TOKENS leaves room for every answer (how it was measured: docs/benchmarks.md,
the method).

Pure: no server, no model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

Message = dict[str, str]  # {"role", "content"} (as walks.Message)
# The guide types a request may carry whose answers this module checks: json_schema (the
# grammar is the schema) and json (any JSON; the schema is only checked afterwards).
CHECKED_GUIDE_TYPES = ("json_schema", "json")
# Room for every answer: the longest of the target's greedy answers under their grammars took
# 163 tokens (loadtest/structured_answers.py; docs/benchmarks.md, the method).
MAX_TOKENS = 256
VALID, INVALID, CUT = "valid", "invalid", "cut"


@dataclass(frozen=True)
class Guide:
    """A request's guided decoding, and the schema its answer is checked against."""

    guide_type: str  # TensorRT-LLM's guided_decoding_guide_type
    schema: dict[str, Any]

    @property
    def guide(self) -> str:
        """guided_decoding_guide: the schema's text (json: none, any JSON goes)."""
        return json.dumps(self.schema) if self.guide_type == "json_schema" else ""

    def inputs(self) -> dict[str, str]:
        """The request inputs that ask the server for this guide."""
        return {"guided_decoding_guide_type": self.guide_type, "guided_decoding_guide": self.guide}


def guide_inputs(guide: Guide | None) -> dict[str, str]:
    """A request's guide inputs; none for a request without a guide."""
    return {} if guide is None else guide.inputs()


def read_structured(path: Path) -> tuple[list[list[Message]], list[Guide]]:
    """The requests of a JSONL file of {"category", "messages", "guide_type", "schema"}
    lines: each request's messages, and its guide. Raises ValueError for a guide type this
    module cannot check, or a schema that is not a valid JSON schema."""
    requests, guides = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if item["guide_type"] not in CHECKED_GUIDE_TYPES:
            raise ValueError(f"{path}:{number}: guide_type {item['guide_type']!r}")
        try:
            jsonschema.Draft202012Validator.check_schema(item["schema"])
        except jsonschema.SchemaError as error:
            raise ValueError(f"{path}:{number}: schema: {error.message}") from None
        requests.append(item["messages"])
        guides.append(Guide(item["guide_type"], item["schema"]))
    return requests, guides


def distinct_guides(
    requests: list[list[Message]], guides: Sequence[Guide]
) -> list[tuple[list[Message], Guide]]:
    """The first request of each distinct guide, with it (a warm-up's: a server compiles a
    grammar the first time it meets it); none for requests without guides."""
    if not guides:
        return []
    first: dict[tuple[str, str], tuple[list[Message], Guide]] = {}
    for messages, guide in zip(requests, guides, strict=True):
        first.setdefault((guide.guide_type, json.dumps(guide.schema)), (messages, guide))
    return list(first.values())


def check(text: str, schema: dict[str, Any], num_output_tokens: int, max_tokens: int) -> str:
    """VALID, INVALID or CUT: an answer of `num_output_tokens` tokens (the end token not
    counted) to a request of `max_tokens`, checked against `schema`."""
    if num_output_tokens >= max_tokens:
        return CUT
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return INVALID
    return VALID if jsonschema.Draft202012Validator(schema).is_valid(value) else INVALID


@dataclass
class Tally:
    """How many answers were valid, invalid and cut."""

    valid: int = 0
    invalid: int = 0
    cut: int = 0

    def add(self, verdict: str) -> None:
        if verdict not in (VALID, INVALID, CUT):
            raise ValueError(verdict)
        setattr(self, verdict, getattr(self, verdict) + 1)

    def __str__(self) -> str:
        total = self.valid + self.invalid + self.cut
        return f"valid {self.valid}/{total} (invalid {self.invalid}, cut {self.cut})"
