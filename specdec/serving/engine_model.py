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
from specdec.serving import settings
from specdec.serving.common import input_names, model_parameters, read_inputs, resolve_path


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        self.role = params["role"]
        self.run = {"draft": run_draft, "target": run_target}[self.role]
        # Its settings (specdec/serving/settings.py; a missing one is its default).
        checkpoint, engine_dir = {
            "draft": (settings.DRAFT_CHECKPOINT, settings.DRAFT_ENGINE_DIR),
            "target": (settings.TARGET_CHECKPOINT, settings.TARGET_ENGINE_DIR),
        }[self.role]
        folder = engine_dir.read(params)
        self.engine = create_engine(
            settings.ENGINE.read(params),
            resolve_path(checkpoint.read(params)),
            num_slots=settings.NUM_SLOTS.read(params),
            max_length=settings.MAX_CONTEXT.read(params),
            device=settings.DEVICE.read(params),
            engine_dir=resolve_path(folder) if folder else None,
            dtype=settings.DTYPE.read(params),
            cuda_graphs=settings.CUDA_GRAPHS.read(params),
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
