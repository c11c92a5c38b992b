"""Helpers shared by the model glue: parameters, paths, tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def resolve_path(value: str) -> str:
    """Relative checkpoint paths are relative to SPECDEC_HOME (default: the current dir)."""
    path = Path(value)
    if not path.is_absolute():
        path = Path(os.environ.get("SPECDEC_HOME", ".")) / path
    return str(path)


def read_inputs(request, names) -> dict[str, np.ndarray]:
    """The request's tensors among `names` that the client sent."""
    arrays = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def input_names(args: dict) -> list[str]:
    return [i["name"] for i in json.loads(args["model_config"])["input"]]
