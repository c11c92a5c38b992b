"""Glue of preprocessing (tokenize); the BLS detokenizes (specdec.detokenizer)."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.serving.common import model_parameters, read_inputs, resolve_path
from specdec.tokenizer import load_tokenizer


def _error_response(message: str, code=None):
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class Preprocessing:
    def initialize(self, args: dict) -> None:
        self.tokenizer = load_tokenizer(resolve_path(model_parameters(args)["checkpoint"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = read_inputs(request, ["text_input"]).get("text_input")
            if texts is None or texts.size != 1:
                responses.append(_error_response("text_input: required, one prompt per request"))
                continue
            try:
                prompt = texts.reshape(-1)[0].decode("utf-8")
            except UnicodeDecodeError:
                responses.append(_error_response("text_input: not valid UTF-8"))
                continue
            ids = np.array([self.tokenizer.encode(prompt)], dtype=np.int32)  # (1, n)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("input_ids", ids)])
            )
        return responses
