"""Glue of draft_model and target_model: one engine call per request, on the engines that
speculative_decoding holds.

The engines live in the BLS's process (specdec/serving/bls_model.py: one process and one
CUDA context for both, no Triton round trip per loop call). These models keep the engine
calls callable on their own, as before, without a second copy of the weights: each request's
wire tensors (specdec/engines/wire.py) go to the BLS as one encoded `engine_call`, run there
between the loop's own calls, and come back as `engine_result`. The call addresses slots
of the caches the loop serves from: it is for tools and tests, not for clients.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.engines.wire import EngineBatch, decode_result, encode_call
from specdec.serving.common import input_names, model_parameters, read_inputs


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        self.role = params["role"]
        self.engines_model = params["engines_model_name"]
        self.inputs = input_names(args)

    def _call(self, batch: EngineBatch) -> dict[str, np.ndarray]:
        data = np.array([[encode_call(self.role, batch)]], dtype=np.object_)
        responses = pb_utils.InferenceRequest(
            model_name=self.engines_model,
            inputs=[pb_utils.Tensor("engine_call", data)],
            requested_output_names=["engine_result"],
        ).exec(decoupled=True)
        for response in responses:
            if response.has_error():
                raise RuntimeError(response.error().message())
            tensor = pb_utils.get_output_tensor_by_name(response, "engine_result")
            if tensor is not None:
                return decode_result(tensor.as_numpy().reshape(-1)[0]).to_arrays()
        raise RuntimeError(f"{self.engines_model} answered no engine_result")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                batch = EngineBatch.from_arrays(read_inputs(request, self.inputs))
                tensors = [
                    pb_utils.Tensor(name, np.ascontiguousarray(array))
                    for name, array in self._call(batch).items()
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as error:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"{self.role} engine: {error}")
                    )
                )
        return responses
