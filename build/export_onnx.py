"""Exports Llama-family checkpoints to ONNX with the engines' KV-cache interface.

    python -m build.export_onnx models/smollm2-135m-instruct models/smollm2-135m-draft
    python -m build.export_onnx path/to/model.gguf --out .run/engines/mine/onnx-float32
    python -m build.export_onnx CHECKPOINT --dtype float16     # the graph TensorRT compiles

A checkpoint is a Hugging Face directory (config.json + safetensors: Llama, Qwen2, Mistral,
SmolLM) or a GGUF file, dequantized once into .run/checkpoints/<name>. Each export goes to
--out (one checkpoint) or .run/engines/<checkpoint folder name>/onnx-<dtype>, where the
onnxruntime engine looks for it; an export already current for the weights is kept.
The graph's interface is in specdec/engines/onnx_export.py.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.engines.onnx_export import DTYPES, default_engine_dir, ensure_exported, is_current
from specdec.paths import PROJECT_ROOT


@dataclass
class ExportConfig:
    checkpoints: list[Path]
    out: Path | None
    engines_root: Path
    dtype: str
    force: bool


def hf_directory(checkpoint: Path, work_root: Path) -> Path:
    """The Hugging Face directory of a checkpoint; a GGUF file is converted once."""
    if checkpoint.is_dir():
        return checkpoint
    if checkpoint.suffix != ".gguf":
        raise ValueError(f"{checkpoint}: expected a Hugging Face directory or a .gguf file")
    from build.checkpoint import convert_gguf

    out_dir = work_root / checkpoint.stem
    if not (out_dir / "config.json").exists():
        convert_gguf(checkpoint, out_dir)
    return out_dir


def run(config: ExportConfig) -> list[Path]:
    if config.out is not None and len(config.checkpoints) != 1:
        raise ValueError("--out names the folder of one checkpoint")
    written = []
    for checkpoint in config.checkpoints:
        source = hf_directory(checkpoint, PROJECT_ROOT / ".run" / "checkpoints")
        out_dir = config.out or default_engine_dir(source, config.engines_root, config.dtype)
        if config.force and (out_dir / "engine.json").exists():
            (out_dir / "engine.json").unlink()
        fresh = not is_current(out_dir, source, config.dtype)
        start = time.time()
        ensure_exported(source, out_dir, config.dtype)
        note = f"exported in {time.time() - start:.0f} s" if fresh else "current, kept"
        print(f"{checkpoint} -> {out_dir} ({note})", flush=True)
        written.append(out_dir)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", type=Path, help="HF directories or .gguf")
    parser.add_argument("--out", type=Path, help="output folder (one checkpoint only)")
    parser.add_argument("--engines-root", type=Path, default=PROJECT_ROOT / ".run" / "engines")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--force", action="store_true", help="export even if current")
    args = parser.parse_args()
    run(
        ExportConfig(
            checkpoints=args.checkpoints,
            out=args.out,
            engines_root=args.engines_root,
            dtype=args.dtype,
            force=args.force,
        )
    )


if __name__ == "__main__":
    main()
