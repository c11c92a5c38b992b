"""TensorRT: optimization profiles (CPU), the float16 graph that TensorRT compiles (run by
onnxruntime on the CPU), and, with a GPU, plans and the CUDA torch engine."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from conftest import DRAFT, TARGET
from specdec.launch import PROJECT_ROOT
from specdec.llama import LlamaEngine
from specdec.onnx_engine import OnnxEngine, group_rows, pad_rows
from specdec.onnx_export import default_engine_dir, ensure_exported
from specdec.trt_engine import optimization_profiles, select_profile

ENGINES_ROOT = PROJECT_ROOT / ".run" / "engines"
HAS_GPU = torch.cuda.is_available()
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine")
needs_tensorrt = pytest.mark.skipif(
    not (HAS_GPU and HAS_TENSORRT), reason="needs a CUDA GPU and TensorRT's Python package"
)


@pytest.mark.parametrize("num_slots,max_context", [(64, 2048), (8, 512), (1, 17), (4, 8)])
def test_profile_shapes_are_ordered_and_consistent(num_slots, max_context):
    for profile in optimization_profiles(num_slots, max_context):
        shapes = profile.shapes(num_layers=3, kv_heads=2, head_dim=8)
        assert set(shapes) >= {"input_ids", "attention_mask", "past_key.2", "past_value.2"}
        for low, opt, high in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True))
        for i in range(3):  # the mask spans exactly the past and the new keys
            mask, ids, past = (
                shapes["attention_mask"][i],
                shapes["input_ids"][i],
                shapes["past_key.0"][i],
            )
            assert mask[1] == past[2] + ids[1]
        assert shapes["input_ids"][2][0] <= num_slots


def random_call(rng: random.Random, num_slots: int, max_context: int):
    """A call the BLS may send: rows on distinct slots that fit their slot."""
    rows = rng.randint(1, num_slots)
    lengths, cached, logits = [], [], []
    for _ in range(rows):
        length = rng.choice([1, 1, 2, 5, 9, 16, 17, rng.randint(1, max_context)])
        length = min(length, max_context)
        lengths.append(length)
        cached.append(rng.randint(0, max_context - length))
        logits.append(rng.randint(1, min(length, 9)))
    return lengths, cached, logits


@pytest.mark.parametrize("num_slots,max_context", [(64, 2048), (8, 512), (2, 40)])
def test_profiles_cover_every_padded_call_the_engine_makes(num_slots, max_context):
    profiles = optimization_profiles(num_slots, max_context)
    rng = random.Random(0)
    edges = [  # a whole-context prompt, a last position, every slot verifying 9 tokens
        ([max_context], [0], [1]),
        ([1], [max_context - 1], [1]),
        ([9] * num_slots, [max_context - 9] * num_slots, [9] * num_slots),
    ]
    for lengths, cached, logits in edges + [
        random_call(rng, num_slots, max_context) for _ in range(300)
    ]:
        tokens = [torch.zeros(n, dtype=torch.int64) for n in lengths]
        for rows in group_rows(lengths):
            call = pad_rows(rows, tokens, cached, logits)
            batch, new_tokens = call.input_ids.shape
            select_profile(
                profiles, batch, new_tokens, call.past_length, call.logit_positions.shape[1]
            )
    with pytest.raises(ValueError, match="no optimization profile"):
        select_profile(profiles, num_slots + 1, 1, 1, 1)


def test_float16_graph_stays_close_to_float32_torch():
    """The graph TensorRT compiles, in float16, run by onnxruntime's CPU kernels."""
    engine_dir = ensure_exported(
        DRAFT, default_engine_dir(DRAFT, ENGINES_ROOT, "float16"), "float16"
    )
    reference = LlamaEngine.from_checkpoint(DRAFT, 2, 64)
    candidate = OnnxEngine(engine_dir, 2, 64)
    assert candidate.k_cache.dtype == torch.float16
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(1))
    args = (prompt, [12, 8], [0, 1], [0, 0], [1, 1])
    worst, agree = 0.0, 0
    cached = [12, 8]
    for _ in range(17):
        expected, got = reference.forward(*args), candidate.forward(*args)
        finite = torch.isfinite(expected)
        worst = max(worst, (expected[finite] - got[finite]).abs().max().item())
        agree += int(torch.equal(expected.argmax(-1), got.argmax(-1)))
        args = (expected.argmax(-1), [1, 1], [0, 1], cached, [1, 1])
        cached = [c + 1 for c in cached]
    assert worst < 0.1, worst
    assert agree >= 16


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", [TARGET, DRAFT], ids=["target", "draft"])
def test_torch_engine_on_cuda_matches_cpu(checkpoint):
    engines = [
        LlamaEngine.from_checkpoint(checkpoint, 2, 128, device) for device in ("cpu", "cuda")
    ]
    prompt = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(2))
    args = (prompt, [20, 10], [0, 1], [0, 0], [1, 4])
    cached = [20, 10]
    for _ in range(32):
        cpu, cuda = (engine.forward(*args).cpu() for engine in engines)
        finite = torch.isfinite(cpu)
        assert (cpu[finite] - cuda[finite]).abs().max().item() < 1e-2
        tokens = cpu[[0, -1]].argmax(-1)  # each row's last position
        args = (tokens, [1, 1], [0, 1], cached, [1, 1])
        cached = [c + 1 for c in cached]


@needs_tensorrt
@pytest.mark.gpu
def test_tensorrt_plan_of_the_draft_follows_torch(tmp_path):
    from specdec.trt_engine import TrtEngine

    engine = TrtEngine.from_checkpoint(DRAFT, 4, 256, engine_dir=tmp_path / "plan")
    reference = LlamaEngine.from_checkpoint(DRAFT, 4, 256)
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3))
    args = (prompt, [30, 10], [0, 3], [0, 0], [1, 1])
    cached, agree = [30, 10], 0
    for _ in range(32):
        expected, got = reference.forward(*args), engine.forward(*args)
        finite = torch.isfinite(expected)
        assert (expected[finite] - got[finite]).abs().max().item() < 0.25
        agree += int(torch.equal(expected.argmax(-1), got.argmax(-1)))
        args = (expected.argmax(-1), [1, 1], [0, 3], cached, [1, 1])
        cached = [c + 1 for c in cached]
    assert agree >= 30


@pytest.mark.skipif(HAS_GPU and HAS_TENSORRT, reason="TensorRT can run here")
def test_tensorrt_engine_without_gpu_or_tensorrt_names_the_fallback():
    from specdec.engines import create_engine

    with pytest.raises(RuntimeError, match="ENGINE=torch DEVICE=cuda"):
        create_engine("tensorrt", DRAFT, 2, 64)
    with pytest.raises(ValueError, match="expected one of torch, onnxruntime, tensorrt"):
        create_engine("vllm", DRAFT, 2, 64)
