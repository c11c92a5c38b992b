"""`make bench-overhead`'s parts without a server: the tiny checkpoint (build/tiny_checkpoint.py)
loads in the project's engine and in transformers, and as its own draft has every proposal
accepted and no early end; bench's mode variants (-sampled, -si<N>), the per-call bytes from
two metric scrapes, and the baselines and tables it prints (loadtest/bench.py, common.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from build.tiny_checkpoint import TinyConfig, shaped_like
from build.tiny_checkpoint import run as build_tiny
from specdec.engines.calls import LocalEngines
from specdec.engines.llama import LlamaEngine
from specdec.engines.select import create_engine
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.paths import PROJECT_ROOT
from specdec.text.request import GenerationRequest
from specdec.text.tokenizer import load_tokenizer

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from bench import LevelResult, baseline, parse_args, parts_table, ratio_table  # noqa: E402
from common import deltas, loop_counters, mode_inputs, per_call  # noqa: E402

VOCAB = 49152
END_ID = 2  # <|im_end|>: the target's eos, where the server ends a request
PROMPT = "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, target_dir) -> Path:
    return build_tiny(TinyConfig(out=tmp_path_factory.mktemp("tiny") / "ckpt"))


def test_tiny_checkpoint_is_deterministic_and_tiny(tiny, tmp_path):
    again = build_tiny(TinyConfig(out=tmp_path / "again"))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    other_seed = build_tiny(TinyConfig(out=tmp_path / "seed1", seed=1))
    assert (other_seed / "model.safetensors").read_bytes() != (
        tiny / "model.safetensors"
    ).read_bytes()
    # embedding and head of 49152 x 64 float32, and a layer
    assert (tiny / "model.safetensors").stat().st_size < 26_000_000


def test_shape_of_gives_random_weights_in_the_targets_shape(target_dir, tmp_path):
    """--shape-of: the target's layer count and sizes (to time its shape on a GPU without
    carrying its weights), random weights, its tokenizer."""
    config = shaped_like(TinyConfig(out=tmp_path / "shaped"), target_dir)
    real = LlamaEngine.from_checkpoint(target_dir, 1, 16).config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (
        real.num_layers,
        real.hidden_size,
        real.intermediate_size,
    )
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (
        real.num_heads,
        real.num_kv_heads,
        VOCAB,
    )


def test_tiny_checkpoint_loads_in_the_engine_with_the_targets_vocabulary(tiny, target_dir):
    """The engine's logits span the target's 49,152 tokens and match transformers' on the
    same directory; the tokenizer is the target's; the end token's logit is 0 and never the
    argmax."""
    engine = create_engine("torch", tiny, num_slots=2, max_length=64, dtype="float32")
    assert (engine.config.vocab_size, engine.config.num_layers) == (VOCAB, 1)
    tokenizer = load_tokenizer(str(tiny))
    ids = tokenizer.encode(PROMPT)
    assert ids == load_tokenizer(str(target_dir)).encode(PROMPT)
    assert tokenizer.eos_token_id == END_ID
    logits = engine.forward(torch.tensor(ids), [len(ids)], [0], [0], [len(ids)])
    assert logits.shape == (len(ids), VOCAB) and bool(torch.isfinite(logits).all())
    assert bool((logits[:, END_ID] == 0).all())
    assert bool((logits.argmax(-1) != END_ID).all()) and float(logits.std()) > 0.05

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=1e-4)


def run_k4(target_dir: Path, draft_dir: Path, num_tokens: int = 40) -> list:
    """Two greedy and two sampled (temperature 0.8) rows at k = 4 through the loop, with
    the engines in process; their sequences."""
    tokenizer = load_tokenizer(str(target_dir))
    target = LlamaEngine.from_checkpoint(target_dir, 4, 256)
    draft = LlamaEngine.from_checkpoint(draft_dir, 4, 256)
    config = SchedulerConfig(4, 256, max_draft_tokens=4, default_draft_tokens=None, max_queue=8)
    scheduler = SpeculativeScheduler(LocalEngines(draft, target), config, tokenizer.decode)
    ids = tokenizer.encode(PROMPT)
    k4 = dict(num_draft_tokens=4, fixed_num_draft_tokens=True, proposers=("draft_model",))
    sequences = [
        scheduler.submit(
            GenerationRequest(None, ids, num_tokens, end_id=END_ID, seed=i, temperature=t, **k4)
        )
        for i, t in enumerate((0.0, 0.0, 0.8, 0.8))
    ]
    for _ in range(4 * num_tokens):
        if not scheduler.has_work:
            return sequences
        scheduler.step()
    raise AssertionError("the loop did not finish")


def test_tiny_checkpoint_as_its_own_draft_has_every_proposal_accepted(tiny, tmp_path):
    """Target and draft from the same directory, k = 4 fixed: greedy rows accept every
    proposal, and so do sampled rows at temperature 0.8 (equal distributions: min(1, p/q) = 1);
    every row runs to max_tokens (no early end token). Negative control: a draft of another
    seed has its greedy proposals rejected (a tied head would copy the last token whatever
    the weights, and any draft would agree)."""
    sequences = run_k4(tiny, tiny)
    for sequence in sequences:
        output = sequence.token_ids[len(sequence.request.prompt_ids) :]
        assert sequence.finish_reason == "length" and len(output) == 40
        assert len(set(output)) > 10  # not one token repeated
        assert sequence.stats.num_draft_tokens >= 28  # 8 iterations of 5 tokens, 4 drafted
        assert sequence.stats.num_accepted_draft_tokens == sequence.stats.num_draft_tokens
    sampled = [s.token_ids for s in sequences[2:]]
    assert sampled[0] != sampled[1]  # two seeds, two samples
    other = build_tiny(TinyConfig(out=tmp_path / "seed1", seed=1))
    for sequence in run_k4(tiny, other)[:2]:
        stats = sequence.stats
        assert stats.num_draft_tokens > 0
        assert stats.num_accepted_draft_tokens < stats.num_draft_tokens / 2


def test_mode_variants_name_their_inputs():
    k4 = {"num_draft_tokens": 4, "fixed_num_draft_tokens": True, "proposer": "draft_model"}
    assert mode_inputs("k4") == k4
    assert mode_inputs("k4-sampled") == {**k4, "temperature": 0.8}
    assert mode_inputs("k4-sampled-si16") == {**k4, "temperature": 0.8, "stream_interval": 16}
    assert mode_inputs("k0-si16") == {"num_draft_tokens": 0, "stream_interval": 16}
    assert mode_inputs("k0-again-sampled") == {"num_draft_tokens": 0, "temperature": 0.8}
    assert mode_inputs("k0-si1") == {"num_draft_tokens": 0}  # 1 is the default: not sent
    for bad in ("k3", "k4-si0", "k4-si", "k4-si16-sampled", "k4-sampled-sampled", "k4-si-4"):
        with pytest.raises(KeyError):
            mode_inputs(bad)
    config = parse_args(["--modes", "k0,k4-sampled-si16,k0-again", "--concurrency", "1,256"])
    assert config.modes == ["k0", "k4-sampled-si16", "k0-again"]
    assert config.concurrency == [1, 256]
    with pytest.raises(SystemExit):
        parse_args(["--modes", "k0,k4-si0"])


def scrape(draft_calls: float, draft_bytes: float, target_calls: float, target_bytes: float):
    """A scrape_metrics result with the engine counters (the loop's as well)."""
    return {
        "specdec_emitted_tokens_total": 10 * target_calls,
        "specdec_iterations_total": target_calls,
        'specdec_engine_calls_total{call="draft"}': draft_calls,
        'specdec_engine_calls_total{call="target"}': target_calls,
        'specdec_engine_result_bytes_total{call="draft"}': draft_bytes,
        'specdec_engine_result_bytes_total{call="target"}': target_bytes,
    }


def test_bytes_per_engine_call_come_from_two_scrapes():
    before = loop_counters(scrape(3, 3_000, 5, 50_000))
    after = loop_counters(scrape(13, 1_003_000, 25, 250_000))
    report = per_call(deltas(before, after))
    assert report == {
        "draft_calls_per_iteration": 0.5,  # 10 draft calls in 20 iterations
        "draft_bytes_per_call": 100_000.0,
        "target_calls_per_iteration": 1.0,
        "target_bytes_per_call": 10_000.0,
    }
    # k = 0: no draft call in the windows; bytes per call has no value, calls are counted.
    idle = per_call(deltas(before, loop_counters(scrape(3, 3_000, 25, 250_000))))
    assert idle["draft_calls_per_iteration"] == 0.0 and idle["draft_bytes_per_call"] is None
    # A server without the counters: n/a, not zeros.
    old = {k: v for k, v in scrape(3, 3_000, 5, 50_000).items() if "engine" not in k}
    missing = per_call(deltas(loop_counters(old), loop_counters(old)))
    assert set(missing.values()) == {None}
    # Counters that appear between the scrapes count from 0.
    appeared = per_call(deltas(loop_counters(old), after))
    assert appeared["target_bytes_per_call"] == 10_000.0


def level(mode: str, concurrency: int, tokens_per_s: float, **kw) -> LevelResult:
    return LevelResult(
        "chat", mode, concurrency, 1, 0, 1, 1.0, tokens_per_s, [tokens_per_s], 0.0, 0.0,
        *[0.0] * 6, **kw,
    )  # fmt: skip


def test_variants_are_compared_with_k0_of_the_same_variant():
    modes = ["k0", "k4", "k0-sampled-si16", "k4-sampled-si16", "k4-sampled", "k0-again"]
    assert baseline("k4-sampled-si16", modes) == "k0-sampled-si16"
    assert baseline("k4-sampled", modes) == "k0"  # no k0-sampled in the run
    assert baseline("k0-again", modes) == "k0"
    assert baseline("k0-sampled-si16", modes) == "k0"
    assert baseline("k0", modes) is None and baseline("k4", ["k4"]) is None
    rates = {"k0": 100.0, "k4": 150.0, "k0-sampled-si16": 50.0, "k4-sampled-si16": 100.0}
    rates |= {"k4-sampled": 20.0, "k0-again": 90.0}
    table = ratio_table([level(m, 16, r) for m, r in rates.items()], modes)
    header, _, row = (
        [c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
    )
    assert dict(zip(header[-5:], row[-5:], strict=True)) == {
        "k4/k0": "1.50x",
        "k0-sampled-si16/k0": "0.50x",
        "k4-sampled-si16/k0-sampled-si16": "2.00x",
        "k4-sampled/k0": "0.20x",
        "k0-again/k0": "0.90x",
    }
    assert len(header) == 2 + len(modes) + 5  # k0 has no ratio column


def test_parts_table_says_n_a_without_counters_and_dash_without_calls():
    counted = level(
        "k4-sampled", 64, 10.0, iterations_per_s=2.0, draft_calls_per_iteration=1.0,
        draft_bytes_per_call=25_165_824.0, target_calls_per_iteration=1.0,
        target_bytes_per_call=2_048.0,
    )  # fmt: skip
    k0 = level(
        "k0", 64, 10.0, draft_calls_per_iteration=0.0, target_calls_per_iteration=1.0,
        target_bytes_per_call=96.0,
    )  # fmt: skip
    old_server = level("k0", 1, 10.0)
    lines = parts_table([counted, k0, old_server]).splitlines()
    assert lines[2].endswith("| n/a | n/a |")  # 1 stream first
    assert lines[3].endswith("| 25.17 MB | 2.0 kB |")
    assert lines[4].endswith("| - | 96 B |")  # k0 made no draft call
