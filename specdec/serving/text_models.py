"""Glue of preprocessing (tokenize); the BLS detokenizes (specdec.text.detokenizer)."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.serving.common import model_parameters, read_inputs, resolve_path
from specdec.serving.settings import TARGET_CHECKPOINT
from specdec.text.tokenizer import load_tokenizer


def _error_response(message: str, code=None):
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class Preprocessing:
    def initialize(self, args: dict) -> None:
        checkpoint = TARGET_CHECKPOINT.read(model_parameters(args))
        self.tokenizer = load_tokenizer(resolve_path(checkpoint))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids, lengths = self._tokenize(
                    read_inputs(request, ["text_input"]).get("text_input")
                )
            except ValueError as error:
                responses.append(_error_response(str(error)))
                continue
            tensors = [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("input_lengths", lengths)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def _tokenize(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """(B, 1) prompts -> (B, L) int32 ids, padded with 0, and (B, 1) int32 lengths."""
        if texts is None or texts.size == 0:
            raise ValueError("text_input: required")
        if texts.ndim != 2 or texts.shape[1] != 1:
            raise ValueError(f"text_input: one prompt per row, got shape {list(texts.shape)}")
        rows = []
        for index, raw in enumerate(texts.reshape(-1)):
            try:
                rows.append(self.tokenizer.encode(raw.decode("utf-8")))
            except UnicodeDecodeError:
                where = f" (batch_index {index})" if len(texts) > 1 else ""
                raise ValueError(f"text_input: not valid UTF-8{where}") from None
        ids = np.zeros((len(rows), max(1, *(len(r) for r in rows))), dtype=np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        return ids, np.array([[len(r)] for r in rows], dtype=np.int32)
