"""The onnxruntime engine against the torch engine: logits, padding, and greedy text served.

Exports are cached under .run/engines (the folder the server's on-demand export uses), so
the suite exports each model once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import DRAFT, TARGET
from specdec.engines.llama import LlamaEngine
from specdec.engines.onnx_engine import OnnxEngine, group_rows, pad_rows
from specdec.engines.onnx_export import (
    default_engine_dir,
    dynamic_axes,
    ensure_exported,
    input_names,
    is_current,
    output_names,
)
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT

ENGINES_ROOT = PROJECT_ROOT / ".run" / "engines"
MAX_ABS_DIFF = 1e-3  # fp32, the bound
NUM_SLOTS, MAX_LENGTH = 4, 160


def max_difference(torch_logits: torch.Tensor, onnx_logits: torch.Tensor) -> float:
    """Max |difference| over finite logits; -inf (outside a draft's head) must agree."""
    finite = torch.isfinite(torch_logits)
    assert torch.equal(finite, torch.isfinite(onnx_logits))
    return (torch_logits[finite] - onnx_logits[finite]).abs().max().item()


def run_parity(checkpoint) -> dict[str, float]:
    """Prefill 3 rows (one long), 64 greedy decode steps, then a verify pass of 8 tokens
    after a rollback of 3 positions; both engines see the same tokens."""
    engine_dir = ensure_exported(checkpoint, default_engine_dir(checkpoint, ENGINES_ROOT))
    engines = [
        LlamaEngine.from_checkpoint(checkpoint, NUM_SLOTS, MAX_LENGTH),
        OnnxEngine(engine_dir, NUM_SLOTS, MAX_LENGTH),
    ]
    generator = torch.Generator().manual_seed(0)
    lengths, slots = [21, 9, 5], [2, 0, 3]
    prompt = torch.randint(0, 49152, (sum(lengths),), generator=generator)

    def both(*args) -> tuple[torch.Tensor, float]:
        reference, candidate = (engine.forward(*args) for engine in engines)
        return reference, max_difference(reference, candidate)

    logits, prefill = both(prompt, lengths, slots, [0, 0, 0], [1, 2, 1])
    logits = logits[[0, 2, 3]]
    cached, decode = list(lengths), 0.0
    for _ in range(64):
        logits, difference = both(logits.argmax(-1), [1, 1, 1], slots, cached, [1, 1, 1])
        decode = max(decode, difference)
        cached = [c + 1 for c in cached]
    proposals = torch.randint(0, 49152, (24,), generator=generator)
    rolled_back = [c - 3 for c in cached]
    _, verify = both(proposals, [8, 8, 8], slots, rolled_back, [8, 8, 8])
    return {"prefill": prefill, "decode_64": decode, "verify_8": verify}


@pytest.mark.parametrize("checkpoint", [TARGET, DRAFT], ids=["target", "draft"])
def test_onnxruntime_logits_match_torch(target_dir, checkpoint):
    differences = run_parity(checkpoint)
    print(f"{checkpoint.name}: max |logit difference| {differences}")
    assert max(differences.values()) <= MAX_ABS_DIFF, differences


def test_export_is_cached_and_declares_dynamic_axes(target_dir):
    import onnx

    engine_dir = ensure_exported(DRAFT, default_engine_dir(DRAFT, ENGINES_ROOT))
    assert is_current(engine_dir, DRAFT)
    graph = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input] == input_names(2)
    assert [o.name for o in graph.output] == output_names(2)
    declared = {
        value.name: {
            axis: dim.dim_param
            for axis, dim in enumerate(value.type.tensor_type.shape.dim)
            if dim.dim_param
        }
        for value in [*graph.input, *graph.output]
    }
    assert declared == dynamic_axes(2)
    assert not is_current(engine_dir, TARGET)  # another checkpoint's weights


def test_rows_are_grouped_and_padded():
    lengths = [1, 40, 3]
    assert group_rows(lengths) == [[0, 2], [1]]
    tokens = [torch.tensor([7]), torch.arange(40), torch.tensor([4, 5, 6])]
    call = pad_rows([0, 2], tokens, [10, 0, 0], [1, 1, 2])
    assert call.input_ids.tolist() == [[7, 0, 0], [4, 5, 6]]
    assert call.position_ids.tolist() == [[10, 11, 12], [0, 1, 2]]
    assert call.past_length == 10
    assert call.attention_mask.tolist() == [[1] * 10 + [1, 0, 0], [0] * 10 + [1, 1, 1]]
    assert call.logit_positions.tolist() == [[0, 0], [1, 2]]
    alone = pad_rows([1], tokens, [0, 0, 0], [1, 1, 1])
    assert alone.past_length == 1  # a masked position: no tensor is empty
    assert alone.attention_mask[0, 0].item() == 0


PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nList three uses of copper.<|im_end|>\n<|im_start|>assistant\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which",
]


def greedy_texts(url: str, k: int) -> list[str]:
    from specdec.client import generate

    params = dict(
        max_tokens=24, num_draft_tokens=k, fixed_num_draft_tokens=True, exclude_input_in_output=True
    )
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(p, url=url, **params), PROMPTS))
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.text for r in results]


@pytest.mark.server
def test_onnxruntime_server_greedy_equals_torch_server(server, tmp_path):
    ensure_exported(TARGET, default_engine_dir(TARGET, ENGINES_ROOT))  # the suite's cache
    draft_dir = tmp_path / "draft-onnx"  # empty: the draft_model instance exports it on demand
    env = {
        "ENGINE": "onnxruntime",
        "DRAFT_ENGINE_DIR": str(draft_dir),
        "NUM_SLOTS": "4",
        "MAX_CONTEXT": "256",
    }
    with ManagedServer("test-onnxruntime", env) as onnx_server:
        assert is_current(draft_dir, DRAFT)
        for k in (0, 4):
            assert greedy_texts(onnx_server.url, k) == greedy_texts(server.url, k)
