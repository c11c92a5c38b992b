"""What each response of speculative_decoding carries: TensorRT-LLM's outputs, by name.

Names, types and shapes are those of TensorRT-LLM's inflight_batcher_llm ensemble, as its
postprocessing and tensorrt_llm models answer them (one response = one sequence):

| output | dtype | shape | value |
|---|---|---|---|
| text_output | BYTES | (1,) | one element: this response's text (1-D, as its postprocessing) |
| batch_index | INT32 | (1, 1) | the prompt's row in the request |
| sequence_index | INT32 | (1, 1) | which of the prompt's num_return_sequences |
| cum_log_probs | FP32 | (1, 1) | sum of output_log_probs so far (return_log_probs) |
| output_log_probs | FP32 | (1, 1, n) | this response's new tokens (return_log_probs) |
| context_logits | FP32 | (1, 1, 1) | zeros: not computed here (return_context_logits is refused) |
| generation_logits | FP32 | (1, 1, 1, 1) | zeros: likewise (return_generation_logits) |
| kv_cache_alloc_total_blocks | INT32 | (1, 1) | target cache positions held (block = 1 token) |
| kv_cache_reused_blocks | INT32 | (1, 1) | of those, reused from another sequence's cache |
| kv_cache_alloc_new_blocks | INT32 | (1, 1) | total - reused |
| arrival_time_ns, ... | INT64 | (1, 1) | Unix time, ns; 0 until it happened |
| acceptance_rate | FP32 | (1, 1) | accepted / proposed draft tokens, whole sequence so far |
| total_accepted_draft_tokens, total_draft_tokens | INT32 | (1, 1) | |
| num_input_tokens, num_output_tokens | INT32 | (1, 1) | ours (return_num_*_tokens) |
| finish_reason | BYTES | (1,) | ours: why the sequence ended (end, stop, length); "" before |

The four times: arrival_time_ns, first_scheduled_time_ns (got a slot), first_token_time_ns,
last_token_time_ns. The perf outputs come with return_perf_metrics, on every response (as
TensorRT-LLM sends them). Only outputs the client requested are built.

When a streamed response goes out (StreamHold, the request's stream_interval): its first text
at once, then each time stream_interval output tokens have gathered since its last response,
and its final response at once; the text between waits, so no response is built for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for hints: clients import the output names without the loop
    from specdec.loop.sequence import SequenceState

PERF_OUTPUTS = (
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)
LOG_PROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
LOGITS_OUTPUTS = ("context_logits", "generation_logits")
INDEX_OUTPUTS = ("batch_index", "sequence_index")
OUTPUT_NAMES = (
    "text_output",
    *LOG_PROB_OUTPUTS,
    *LOGITS_OUTPUTS,
    *INDEX_OUTPUTS,
    *PERF_OUTPUTS,
    "num_input_tokens",
    "num_output_tokens",
    "finish_reason",
)


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)  # (1, 1): a batch of one, one value


def response_text(sequence: SequenceState, new_text: str) -> str:
    """A non-streamed text starts with the prompt unless exclude_input_in_output; streamed
    chunks carry only new text."""
    request = sequence.request
    if request.stream or request.exclude_input_in_output:
        return new_text
    return (request.prompt or "") + new_text


def perf_arrays(sequence: SequenceState) -> dict[str, np.ndarray]:
    stats, times = sequence.stats, sequence.times
    total, reused = sequence.num_cache_positions, sequence.num_copied_positions
    return {
        "kv_cache_alloc_new_blocks": _scalar(total - reused, np.int32),
        "kv_cache_reused_blocks": _scalar(reused, np.int32),
        "kv_cache_alloc_total_blocks": _scalar(total, np.int32),
        "arrival_time_ns": _scalar(times.arrival_ns, np.int64),
        "first_scheduled_time_ns": _scalar(times.first_scheduled_ns, np.int64),
        "first_token_time_ns": _scalar(times.first_token_ns, np.int64),
        "last_token_time_ns": _scalar(times.last_token_ns, np.int64),
        "acceptance_rate": _scalar(stats.acceptance_rate, np.float32),
        "total_accepted_draft_tokens": _scalar(stats.num_accepted_draft_tokens, np.int32),
        "total_draft_tokens": _scalar(stats.num_draft_tokens, np.int32),
    }


def response_arrays(
    sequence: SequenceState, new_text: str, first_log_prob: int, requested: set[str] | None = None
) -> dict[str, np.ndarray]:
    """The output arrays of one response of `sequence`: `new_text` is what it adds, and
    output_log_probs holds the output tokens from `first_log_prob` on (those not yet sent).
    `requested`: the names the client asked for (None: all)."""
    request = sequence.request
    wanted = set(OUTPUT_NAMES) if requested is None else set(requested)
    text = response_text(sequence, new_text).encode("utf-8")
    arrays: dict[str, np.ndarray] = {"text_output": np.array([text], dtype=np.object_)}
    arrays["batch_index"] = _scalar(request.batch_index, np.int32)
    arrays["sequence_index"] = _scalar(sequence.sequence_index, np.int32)
    if request.return_log_probs:
        new = sequence.output_log_probs[first_log_prob:]
        arrays["cum_log_probs"] = _scalar(sum(sequence.output_log_probs), np.float32)
        arrays["output_log_probs"] = np.array([[new]], dtype=np.float32).reshape(1, 1, -1)
    if wanted & set(LOGITS_OUTPUTS):
        arrays["context_logits"] = np.zeros((1, 1, 1), dtype=np.float32)
        arrays["generation_logits"] = np.zeros((1, 1, 1, 1), dtype=np.float32)
    if request.return_perf_metrics:
        arrays.update(perf_arrays(sequence))
    if request.return_num_input_tokens:
        arrays["num_input_tokens"] = _scalar(len(request.prompt_ids), np.int32)
    if request.return_num_output_tokens:
        arrays["num_output_tokens"] = _scalar(sequence.num_output_tokens, np.int32)
    if "finish_reason" in wanted:
        reason = (sequence.finish_reason or "").encode()
        arrays["finish_reason"] = np.array([reason], dtype=np.object_)
    return {name: array for name, array in arrays.items() if name in wanted}


class StreamHold:
    """The streamed text of a request's sequences held back by stream_interval (keyed by
    sequence id). Concatenated, what take() returns is the text the loop produced."""

    def __init__(self) -> None:
        self._held: dict[int, str] = {}  # text not sent yet
        self._sent_at: dict[int, int] = {}  # output tokens at the last response

    def take(
        self, key: int, text: str, num_output_tokens: int, interval: int, finished: bool
    ) -> str | None:
        """The text of the response to send now (`text` after what was held), or None: hold
        it. A response goes out when the sequence finished, when it is the first to carry
        text, or when `interval` output tokens have come since the last one."""
        held = self._held.pop(key, "") + text
        if finished:
            self._sent_at.pop(key, None)
            return held
        if not held:
            return None
        last = self._sent_at.get(key)
        if last is None or num_output_tokens - last >= interval:
            self._sent_at[key] = num_output_tokens
            return held
        self._held[key] = held
        return None
