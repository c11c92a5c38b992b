"""The engine a draft_model / target_model instance runs, chosen by its `engine` parameter.

- `torch`: specdec/llama.py on `device` ("cpu" or "cuda"): the reference, and the GPU
  fallback where TensorRT is not installed.
- `onnxruntime`: the exported graph (specdec/onnx_engine.py); exported from the checkpoint
  into `engine_dir` (default .run/engines/<checkpoint name>/onnx-float32) when missing or stale.
- `tensorrt`: a TensorRT plan of that graph (specdec/trt_engine.py), GPU only; built into
  `engine_dir` (default .run/engines/<checkpoint name>/tensorrt-float16) when missing.
"""

from __future__ import annotations

from pathlib import Path

ENGINES = ("torch", "onnxruntime", "tensorrt")


def create_engine(
    kind: str,
    checkpoint: str | Path,
    num_slots: int,
    max_length: int,
    device: str = "cpu",
    engine_dir: str | Path | None = None,
):
    """An engine with LlamaEngine's surface (forward, config, num_slots, max_length)."""
    if kind == "torch":
        from specdec.llama import LlamaEngine

        return LlamaEngine.from_checkpoint(checkpoint, num_slots, max_length, device)
    if kind == "onnxruntime":
        from specdec.onnx_engine import OnnxEngine

        return OnnxEngine.from_checkpoint(checkpoint, num_slots, max_length, engine_dir)
    if kind == "tensorrt":
        require_tensorrt()
        from specdec.trt_engine import TrtEngine

        return TrtEngine.from_checkpoint(checkpoint, num_slots, max_length, engine_dir)
    raise ValueError(f"engine {kind!r}: expected one of {', '.join(ENGINES)}")


def require_tensorrt() -> None:
    """Fails clearly where the tensorrt engine cannot run (the fallback is torch on CUDA)."""
    import importlib.util

    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("TensorRT's Python package (pip install tensorrt)")
    if missing:
        raise RuntimeError(
            f"engine tensorrt needs {' and '.join(missing)}; "
            "ENGINE=torch DEVICE=cuda runs on a GPU without TensorRT"
        )
