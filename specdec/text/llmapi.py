"""TensorRT-LLM's LLM-API request schema (its Triton model `tensorrt_llm` under
triton_backend/all_models/llmapi) as the ensemble's inputs, and its outputs from the loop's.

That model takes 1-D tensors of one prompt: `text_input`, `sampling_param_*`, `streaming`,
`return_finish_reason`, ... and `stop`, which ends a running request by its request id. Here
each is translated to the ensemble input it means (shaped [1, n], as the BLS takes them), so
the one parser (specdec/text/request.py) checks both schemas; its refusals name the
ensemble's field, and `llmapi_message` names the LLM-API one instead. Pure: no Triton.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from specdec.text.request import InvalidInput

# LLM-API input -> the ensemble input it is (same dtype; 1-D becomes [1, n]).
RENAMED_INPUTS: dict[str, str] = {
    "text_input": "text_input",
    "sampling_param_max_tokens": "max_tokens",
    "sampling_param_temperature": "temperature",
    "sampling_param_top_k": "top_k",
    "sampling_param_top_p": "top_p",
    "sampling_param_seed": "seed",
    "sampling_param_frequency_penalty": "frequency_penalty",
    "sampling_param_presence_penalty": "presence_penalty",
    "sampling_param_stop": "stop_words",
    "sampling_param_return_perf_metrics": "return_perf_metrics",
}
ENSEMBLE_TO_LLMAPI = {ensemble: llmapi for llmapi, ensemble in RENAMED_INPUTS.items()}
# The LLM-API's SamplingParams default: a request without sampling_param_max_tokens gets 32.
DEFAULT_MAX_TOKENS = 32
# Declared so that its clients' requests reach us, and refused by name when they are sent:
# no images, no LoRA adapters here.
REFUSED_INPUTS = ("image_url", "lora_id", "lora_name", "lora_path", "lora_ckpt_source")
# Output flags: each adds its output to the response.
OUTPUT_FLAGS = {
    "return_finish_reason": "finish_reason",
    "return_stop_reason": "stop_reason",
    "return_cumulative_logprob": "cumulative_logprob",
}
TIME_OUTPUTS = tuple(
    f"{t}_time_ns" for t in ("arrival", "first_scheduled", "first_token", "last_token")
)
KV_OUTPUTS = ("reused_block", "missed_block", "alloc_new_blocks", "alloc_total_blocks", "hit_rate")
DRAFT_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
PERF_OUTPUTS = (*(f"kv_cache_{name}" for name in KV_OUTPUTS), *TIME_OUTPUTS, *DRAFT_OUTPUTS)
# The loop's finish reasons (specdec/loop/sequence.py) in the LLM API's words.
FINISH_REASONS = {"end": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}


@dataclass
class LLMAPIRequest:
    """One LLM-API request as the loop's: `inputs` for the BLS, and what the answer needs."""

    inputs: dict[str, np.ndarray]  # ensemble names, [1, n]
    prompt: str
    stop_words: list[str]
    include_prompt: bool  # sampling_param_exclude_input_from_output false
    streaming: bool
    outputs: tuple[str, ...]  # LLM-API outputs beside text_output

    @property
    def wants_perf(self) -> bool:
        return PERF_OUTPUTS[0] in self.outputs

    @property
    def wants_log_prob(self) -> bool:
        return "cumulative_logprob" in self.outputs


def _flag(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    if name not in inputs:
        return False
    array = np.asarray(inputs[name])
    if array.dtype != np.bool_ or array.size != 1:
        raise InvalidInput(name, f"expected one BOOL, got {array.dtype} {list(array.shape)}")
    return bool(array.reshape(-1)[0])


def _texts(array: np.ndarray) -> list[str]:
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array]


def is_stop(inputs: Mapping[str, np.ndarray]) -> bool:
    """A `stop` request: it ends the running requests of its request id."""
    return _flag(inputs, "stop")


def parse_llmapi(inputs: Mapping[str, np.ndarray]) -> LLMAPIRequest:
    """The ensemble inputs of an LLM-API request (names and shapes only: the loop's parser
    checks the values); raises InvalidInput for what only this schema has."""
    for name in REFUSED_INPUTS:
        if name in inputs:
            raise InvalidInput(name, "not supported by this server")
    if "sampling_param_best_of" in inputs:
        best_of = np.asarray(inputs["sampling_param_best_of"]).reshape(-1)
        if best_of.size != 1 or int(best_of[0]) != 1:
            raise InvalidInput("sampling_param_best_of", f"only 1 is supported, got {best_of}")
    converted = {
        RENAMED_INPUTS[name]: np.asarray(value).reshape(1, -1)
        for name, value in inputs.items()
        if name in RENAMED_INPUTS
    }
    converted.setdefault("max_tokens", np.array([[DEFAULT_MAX_TOKENS]], dtype=np.int32))
    # The text is the answer alone; the prompt, if asked for, is put before it here.
    converted["exclude_input_in_output"] = np.array([[True]])
    outputs = tuple(output for flag, output in OUTPUT_FLAGS.items() if _flag(inputs, flag))
    if "cumulative_logprob" in outputs:
        converted["return_log_probs"] = np.array([[True]])
    if "return_perf_metrics" in converted:
        _flag(inputs, "sampling_param_return_perf_metrics")  # checked here, named as sent
        if converted["return_perf_metrics"].reshape(-1)[0]:
            outputs += PERF_OUTPUTS
    texts = _texts(np.asarray(inputs.get("text_input", np.zeros(0, np.object_))).reshape(-1))
    stop_words = _texts(np.asarray(converted.get("stop_words", np.zeros(0))).reshape(-1))
    exclude = "sampling_param_exclude_input_from_output"
    return LLMAPIRequest(
        inputs=converted,
        prompt=texts[0] if texts else "",
        stop_words=[word for word in stop_words if word],
        include_prompt=exclude in inputs and not _flag(inputs, exclude),
        streaming=_flag(inputs, "streaming"),
        outputs=outputs,
    )


def llmapi_message(message: str) -> str:
    """A refusal of the loop's parser, naming the LLM-API field where it named an ensemble
    input this schema renames (`max_tokens: ...` -> `sampling_param_max_tokens: ...`)."""
    field, separator, rest = message.partition(": ")
    if separator and field in ENSEMBLE_TO_LLMAPI:
        return f"{ENSEMBLE_TO_LLMAPI[field]}: {rest}"
    return message


def loop_error_kind(message: str, loop_model: str) -> str:
    """What a BLS error was, from its message (Triton 2.51 hands a BLS caller every error as
    INTERNAL): "cancelled" (a cancelled or stopped request), "unavailable" (a full queue, a
    server shutting down), "invalid" (a refusal, which starts with the field it names), or
    "internal" (the loop's own errors start with its model name)."""
    if message in ("request cancelled", "request stopped"):
        return "cancelled"
    if message.startswith("queue full") or message == "server is shutting down":
        return "unavailable"
    field, separator, _ = message.partition(": ")
    if separator and field != loop_model and field.replace("_", "").isalpha():
        return "invalid"
    return "internal"


def cut_at_stop(text: str, stop_words: Iterable[str]) -> tuple[str, str | None]:
    """The answer before the stop word that ended it, and that word (None: no stop word in
    it). The loop ends a sequence once its text contains a stop word and keeps the word (the
    ensemble's contract); the LLM API leaves it out. The word that ended it is the one whose
    end comes first."""
    found = [(text.find(w) + len(w), text.find(w), w) for w in stop_words if w and w in text]
    if not found:
        return text, None
    _, start, word = min(found)
    return text[:start], word


def finish_reason(loop_reason: str) -> str:
    return FINISH_REASONS.get(loop_reason, loop_reason)


def _one(value, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)  # [1]: the LLM-API model's outputs are 1-D


def perf_outputs(loop: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The LLM-API perf outputs from the BLS's (specdec/serving/responses.py PERF_OUTPUTS):
    a block is one cache position here; reused = copied from another sequence's cache."""

    def value(name: str):
        return np.asarray(loop[name]).reshape(-1)[0]

    total, reused = int(value("kv_cache_alloc_total_blocks")), int(value("kv_cache_reused_blocks"))
    arrays = {name: _one(value(name), np.int64) for name in TIME_OUTPUTS}
    arrays |= {
        "kv_cache_reused_block": _one(reused, np.int32),
        "kv_cache_missed_block": _one(total - reused, np.int32),
        "kv_cache_alloc_new_blocks": _one(total - reused, np.int32),
        "kv_cache_alloc_total_blocks": _one(total, np.int32),
        "kv_cache_hit_rate": _one(reused / total if total else 0.0, np.float32),
        "acceptance_rate": _one(value("acceptance_rate"), np.float32),
        "total_accepted_draft_tokens": _one(value("total_accepted_draft_tokens"), np.int32),
        "total_draft_tokens": _one(value("total_draft_tokens"), np.int32),
    }
    return arrays


def answer_arrays(
    request: LLMAPIRequest,
    text: str,
    loop: Mapping[str, np.ndarray],
    final: bool,
) -> dict[str, np.ndarray]:
    """The LLM-API outputs of a response: `text` is the answer so far (streamed responses
    carry it all, as the LLM API's do), `loop` the BLS's latest outputs, `final` whether the
    answer ended. A finished answer loses the stop word that ended it."""
    reason: str | None = None  # as the LLM API's: None until the answer ended
    stop_reason: str | None = None
    if final:
        reason = finish_reason(_text(loop.get("finish_reason")))
        if reason == "stop":
            text, stop_reason = cut_at_stop(text, request.stop_words)
    if request.include_prompt:
        text = request.prompt + text
    arrays = {"text_output": _one(text.encode("utf-8"), np.object_)}
    if "finish_reason" in request.outputs:
        arrays["finish_reason"] = _one(str(reason).encode(), np.object_)
    if "stop_reason" in request.outputs:
        arrays["stop_reason"] = _one(str(stop_reason).encode("utf-8"), np.object_)
    if request.wants_log_prob and "cum_log_probs" in loop:
        arrays["cumulative_logprob"] = np.asarray(loop["cum_log_probs"], np.float32).reshape(1)
    if request.wants_perf and "kv_cache_alloc_total_blocks" in loop:
        arrays.update(perf_outputs(loop))
    return arrays


def _text(array: np.ndarray | None) -> str:
    if array is None or np.asarray(array).size == 0:
        return ""
    return _texts(np.asarray(array).reshape(-1))[0]
