"""The torch engine's padded decode steps (specdec/engines/llama.py, DecodeSteps): on the CPU
the padded step runs without graphs and must give eager mode's logits and cache writes; on a
CUDA GPU (marked gpu, skipped elsewhere) the captured graphs are replayed and compared with
eager logits for the same inputs."""

from __future__ import annotations

import pytest
import torch

from build.greedy_parity import TIE_MARGIN
from conftest import TARGET
from specdec.engines.llama import DecodeSteps, LlamaEngine, keys_bucket, rows_bucket

HAS_GPU = torch.cuda.is_available()
MAX_LENGTH = 200
PROMPT_LENGTHS = {5: 12, 1: 140, 6: 3, 7: 40, 0: 25, 2: 9, 3: 60, 4: 77}  # slot -> positions


def test_buckets():
    assert [rows_bucket(n, 64) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert rows_bucket(5, 6) == 6  # never more rows than slots
    assert [keys_bucket(n, 4096) for n in (1, 128, 129, 1000)] == [128, 128, 256, 1024]
    assert keys_bucket(150, 200) == 200  # never past max_length


def prefilled(device: str = "cpu", dtype=torch.float32, **options) -> LlamaEngine:
    """The target with every slot holding a prompt of its own length (PROMPT_LENGTHS)."""
    engine = LlamaEngine.from_checkpoint(TARGET, 8, MAX_LENGTH, device, dtype, **options)
    generator = torch.Generator().manual_seed(4)
    slots = list(PROMPT_LENGTHS)
    lengths = [PROMPT_LENGTHS[s] for s in slots]
    tokens = torch.randint(0, engine.config.vocab_size, (sum(lengths),), generator=generator)
    engine.forward(tokens, lengths, slots, [0] * len(slots), [1] * len(slots))
    return engine


@pytest.fixture(scope="module")
def engine() -> LlamaEngine:
    return prefilled()


STEPS = {  # slots of one decode step: padded or not, in place or over a copy of the slots
    "one row (a copy of its slot)": [1],
    "two rows out of slot order (a copy)": [7, 0],
    "three rows padded to four (in place)": [5, 1, 6],
    "every slot (in place, no padding)": [3, 0, 7, 1, 2, 6, 4, 5],
}


def padded_against_eager(engine: LlamaEngine, padded: DecodeSteps, slots, cache_lengths, tokens):
    """One decode step run eagerly, then (the cache restored) padded: (eager logits, padded
    logits, whether everything written below max_length is the same). The cache is left as
    the padded step wrote it."""
    args = (tokens, [1] * len(slots), slots, cache_lengths, [1] * len(slots))
    before = (engine.k_cache.clone(), engine.v_cache.clone())
    engine.decode_steps = None
    eager = engine.forward(*args)
    eager_cache = (engine.k_cache.clone(), engine.v_cache.clone())
    engine.k_cache.copy_(before[0]), engine.v_cache.copy_(before[1])
    engine.decode_steps = padded
    try:
        got = engine.forward(*args)
    finally:
        engine.decode_steps = None
    same_writes = all(
        torch.allclose(cache[:, :, :, :MAX_LENGTH], expected[:, :, :, :MAX_LENGTH], atol=1e-4)
        for cache, expected in zip((engine.k_cache, engine.v_cache), eager_cache, strict=True)
    )
    return eager, got, same_writes


@pytest.fixture
def restored(engine):
    """The module's engine, its cache put back after the test."""
    saved = (engine.k_cache.clone(), engine.v_cache.clone())
    yield engine
    engine.k_cache.copy_(saved[0]), engine.v_cache.copy_(saved[1])


@pytest.mark.parametrize("slots", list(STEPS.values()), ids=list(STEPS))
def test_padded_step_gives_eager_logits_and_cache_writes(restored, slots):
    """Three steps of the same rows (each row fed its own argmax): the padded step's logits
    and everything it writes below max_length equal eager mode's (padding rows write only
    the spare position past max_length)."""
    engine, padded = restored, DecodeSteps(restored, capture=False)
    cache_lengths = [PROMPT_LENGTHS[s] for s in slots]
    tokens = torch.tensor([11, 22, 33, 44, 55, 66, 77, 88][: len(slots)])
    for _ in range(3):
        eager, got, same_writes = padded_against_eager(engine, padded, slots, cache_lengths, tokens)
        assert got.shape == eager.shape == (len(slots), engine.config.vocab_size)
        assert torch.allclose(got, eager, atol=1e-4), (got - eager).abs().max()
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        assert same_writes
        tokens = eager.argmax(-1)
        cache_lengths = [n + 1 for n in cache_lengths]
    assert len(padded.steps) == 1, "the three steps share one padded shape"


@pytest.mark.parametrize("fault", ["mask one key short", "padding writes position 0"])
def test_a_wrong_mask_or_padding_write_is_caught(restored, monkeypatch, fault):
    """Negative controls: a padded step whose rows do not see their own new key, or whose
    padding row writes a real position of a slot outside the step, fails the comparison."""
    engine, padded = restored, DecodeSteps(restored, capture=False)
    slots = [5, 1, 6]  # padded to 4 rows: one padding row, in slot 0
    real_step = engine._padded_decode

    def faulty(step):
        if fault == "mask one key short":
            step.inputs[3, :3] -= 1
        else:
            step.inputs[1, 3:] = 0
        return real_step(step)

    monkeypatch.setattr(engine, "_padded_decode", faulty)
    cache_lengths = [PROMPT_LENGTHS[s] for s in slots]
    eager, got, same_writes = padded_against_eager(
        engine, padded, slots, cache_lengths, torch.tensor([1, 2, 3])
    )
    if fault == "mask one key short":
        assert not torch.allclose(got, eager, atol=1e-3)
    else:
        assert torch.allclose(got, eager, atol=1e-4) and not same_writes


def test_only_one_token_steps_take_the_padded_path(engine):
    padded = DecodeSteps(engine, capture=False)
    assert padded.fits([1, 1], [1, 1])
    assert not padded.fits([2, 1], [1, 1])  # a verify
    assert not padded.fits([1, 1], [2, 1])
    assert not padded.fits([1] * 9, [1] * 9)  # more rows than slots


def test_cuda_graphs_need_cuda_and_the_torch_engine():
    from specdec.engines.select import create_engine

    with pytest.raises(ValueError, match="cuda_graphs runs on CUDA only"):
        LlamaEngine.from_checkpoint(TARGET, 1, 16, "cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs applies to the torch engine"):
        create_engine("onnxruntime", TARGET, 1, 16, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine: CUDA graphs need one")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_graph_logits_equal_eager_logits(dtype):
    """The same decode steps on two CUDA engines with the same cache, one eager, one
    replaying CUDA graphs: close logits and the same argmax at every step (in bfloat16 where
    the eager top two are not a near tie: padded shapes may pick other kernels, which round
    differently), for padded and unpadded, in-place and copied rows; each shape was
    captured once and replayed after. A wrong mask, slot or position moves logits by whole
    units."""
    eager, graphs = prefilled("cuda", dtype), prefilled("cuda", dtype, cuda_graphs=True)
    assert graphs.decode_steps is not None and graphs.decode_steps.capture
    tolerance, tie = (1e-3, 0.0) if dtype == torch.float32 else (1.0, TIE_MARGIN)
    for slots in STEPS.values():
        cache_lengths = [PROMPT_LENGTHS[s] for s in slots]
        tokens = torch.arange(100, 100 + len(slots))
        for _ in range(4):
            args = (tokens, [1] * len(slots), slots, cache_lengths, [1] * len(slots))
            expected, got = eager.forward(*args), graphs.forward(*args)
            assert got.is_cuda and got.shape == expected.shape
            assert (got - expected).abs().max().item() < tolerance
            top2 = expected.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > tie
            assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
            tokens = expected.argmax(-1).cpu()
            cache_lengths = [n + 1 for n in cache_lengths]
    steps = graphs.decode_steps.steps
    assert len(steps) == len(STEPS) and all(s.graph is not None for s in steps.values())
