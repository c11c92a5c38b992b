"""Glue of draft_model and target_model: one engine call per request, no batching by Triton.

The `engine` parameter picks torch, onnxruntime or tensorrt, `dtype` its precision
(float32, bfloat16, float16 or auto; specdec/engines/select.py), `cuda_graphs` whether the
torch engine on CUDA replays its decode steps as CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.engines.calls import run_draft, run_target
from specdec.engines.select import create_engine
from specdec.engines.wire import EngineBatch
from specdec.serving.common import input_names, model_parameters, read_inputs, resolve_path
from specdec.serving.settings import parse_bool


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        self.role = params["role"]
        self.run = {"draft": run_draft, "target": run_target}[self.role]
        self.engine = create_engine(
            params.get("engine", "torch"),
            resolve_path(params["checkpoint"]),
            num_slots=int(params["num_slots"]),
            max_length=int(params["max_context"]),
            device=params.get("device", "cpu"),
            engine_dir=resolve_path(params["engine_dir"]) if params.get("engine_dir") else None,
            dtype=params.get("dtype", "float32"),
            cuda_graphs=parse_bool("cuda_graphs", params.get("cuda_graphs", "false")),
        )
        self.inputs = input_names(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                batch = EngineBatch.from_arrays(read_inputs(request, self.inputs))
                result = self.run(self.engine, batch)
                tensors = [
                    pb_utils.Tensor(name, np.ascontiguousarray(array))
                    for name, array in result.to_arrays().items()
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as error:  # the caller (the BLS) ends the affected requests
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"{self.role} engine: {error}")
                    )
                )
        return responses
