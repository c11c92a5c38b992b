"""The torch engine's padded call programs (specdec/engines/graphs.py), which CUDA graphs
capture: on the CPU they run without graphs (capture=False) and must give eager mode's
tokens, hindsight hits, logits and cache writes for every call shape; their sampling must
choose choose_tokens' tokens bit for bit; a call makes one upload and one download and never
reads the device otherwise; the loop decodes with them as it does eagerly. On a CUDA GPU
(marked gpu, skipped elsewhere) the captured graphs are compared with eager calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DRAFT, TARGET
from specdec.engines import calls as calls_module
from specdec.engines import graphs as graphs_module
from specdec.engines.calls import LocalEngines, run_draft, run_target
from specdec.engines.engine import MAX_BATCHED_QUERY
from specdec.engines.graphs import (
    TRANSFERS,
    CallGraphs,
    graph_pool_bytes_estimate,
    keys_bucket,
    rows_bucket,
)
from specdec.engines.llama import LlamaEngine
from specdec.engines.sampling import Filters, RowSampling, choose_tokens, choose_tokens_dense
from specdec.engines.wire import EngineBatch, hindsight_lengths

HAS_GPU = torch.cuda.is_available()
MAX_LENGTH = 200
PROMPT_LENGTHS = {5: 12, 1: 140, 6: 3, 7: 40, 0: 25, 2: 9, 3: 60, 4: 77}  # slot -> positions
END_ID = 2


def test_buckets():
    assert [rows_bucket(n, 64) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert rows_bucket(5, 6) == 6  # never more rows than slots
    assert [keys_bucket(n, 4096) for n in (1, 128, 129, 1000)] == [128, 128, 256, 1024]
    assert keys_bucket(150, 200) == 200  # never past max_length


def prefilled(checkpoint, device: str = "cpu", dtype=torch.float32, **options) -> LlamaEngine:
    """An engine with every slot holding a random prompt of its own length (PROMPT_LENGTHS)."""
    engine = LlamaEngine.from_checkpoint(checkpoint, 8, MAX_LENGTH, device, dtype, **options)
    generator = torch.Generator().manual_seed(4)
    slots = list(PROMPT_LENGTHS)
    lengths = [PROMPT_LENGTHS[s] for s in slots]
    tokens = torch.randint(0, engine.config.vocab_size, (sum(lengths),), generator=generator)
    engine.forward(tokens, lengths, slots, [0] * len(slots), [1] * len(slots))
    return engine


@pytest.fixture(scope="module")
def target() -> LlamaEngine:
    return prefilled(TARGET)


@pytest.fixture(scope="module")
def draft() -> LlamaEngine:
    return prefilled(DRAFT)  # two layers and a reduced head (full_vocabulary)


def make_batch(rows: list[tuple], seed: int = 0, fed: dict | None = None) -> EngineBatch:
    """One call's batch: rows (slot, new tokens, num_steps, sampling) after each slot's
    prompt; sampling is {} (greedy) or temperature / top_k / top_p / min_tokens_left.
    fed: slot -> the row's tokens (else random)."""
    generator = np.random.default_rng(seed)
    tokens = [(fed or {}).get(slot, generator.integers(3, 49152, n)) for slot, n, _, _ in rows]

    def column(name: str, default, dtype) -> np.ndarray:
        return np.array([r[3].get(name, default) for r in rows], dtype=dtype)

    return EngineBatch(
        input_ids=np.concatenate(tokens).astype(np.int64),
        input_lengths=np.array([n for _, n, _, _ in rows], dtype=np.int32),
        slot_ids=np.array([slot for slot, *_ in rows], dtype=np.int32),
        cache_lengths=np.array([PROMPT_LENGTHS[slot] for slot, *_ in rows], dtype=np.int32),
        num_steps=np.array([steps for _, _, steps, _ in rows], dtype=np.int32),
        temperature=column("temperature", 0.0, np.float32),
        top_k=column("top_k", 0, np.int32),
        top_p=column("top_p", 1.0, np.float32),
        end_ids=np.full(len(rows), END_ID, dtype=np.int32),
        min_tokens_left=column("min_tokens_left", 0, np.int32),
        seeds=np.arange(len(rows), dtype=np.int64) + 1000 * seed,
    )


SAMPLED = dict(temperature=0.8)
TOP_K = dict(temperature=1.0, top_k=5)
TOP_P = dict(temperature=0.7, top_p=0.9)
NO_END = dict(min_tokens_left=3)  # greedy, the end token blocked for its first 3 steps

# (slot, new tokens, num_steps, sampling) per row: widths 1-5 and 9, padded (3 rows -> 4)
# and unpadded rows, in place (at least half the slots) and over a copy of the rows' slots,
# short prompts (keys 128) and long ones (keys 200), greedy and sampled rows in one call.
VERIFIES = {
    "one row of 9 (a copy, keys 200)": [(1, 9, 9, {})],
    "two rows of 1 and 5 (a copy)": [(7, 1, 1, {}), (0, 5, 5, {})],
    "three of 2, 3, 9 padded to four (in place)": [(5, 2, 2, {}), (1, 3, 1, {}), (6, 9, 9, {})],
    "every slot, widths 1-5 and 9 (in place)": [
        (3, 4, 4, {}),
        (0, 1, 1, {}),
        (7, 5, 5, SAMPLED),
        (1, 9, 9, {}),
        (2, 2, 2, TOP_K),
        (6, 3, 3, TOP_P),
        (4, 1, 1, NO_END),
        (5, 2, 2, {}),
    ],
}
DRAFTS = {  # k = 1, 4, 8; fed 1-2 tokens; a catching-up greedy row (hindsight) among them
    "k = 1, fed 1-2 (a copy)": [(1, 1, 1, {}), (4, 2, 1, {})],
    "k = 4, padded, steps 4, 2, 0": [(5, 2, 4, SAMPLED), (1, 1, 2, {}), (6, 2, 0, {})],
    "k = 8, every slot": [
        (3, 1, 8, {}),
        (0, 2, 8, TOP_K),
        (7, 1, 5, TOP_P),
        (1, 2, 8, NO_END),
        (2, 1, 1, {}),
        (6, 1, 8, SAMPLED),
        (4, 2, 3, {}),
        (5, 1, 8, {}),
    ],
    "a catching-up row (fed 7) with k = 4": [(0, 7, 4, {}), (6, 1, 4, {}), (2, 2, 4, SAMPLED)],
}


def greedy_continuation(engine: LlamaEngine, slot: int, length: int) -> np.ndarray:
    """The engine's own greedy tokens after the slot's prompt (the cache put back): fed to
    a catching-up row, most hindsight guesses are hits."""
    saved = (engine.k_cache.clone(), engine.v_cache.clone())
    tokens, cached = [int(engine.config.vocab_size // 3)], PROMPT_LENGTHS[slot]
    for _ in range(length - 1):
        logits = engine.forward(torch.tensor(tokens[-1:]), [1], [slot], [cached], [1])
        tokens.append(int(logits.argmax()))
        cached += 1
    engine.k_cache.copy_(saved[0]), engine.v_cache.copy_(saved[1])
    return np.array(tokens)


class Recorded:
    """The logits each forward of a call returned (eager: forward; padded: padded_logits)."""

    def __init__(self, engine: LlamaEngine, monkeypatch, method: str) -> None:
        self.logits: list[torch.Tensor] = []
        real = getattr(engine, method)

        def recording(*args, **kwargs):
            logits = real(*args, **kwargs)
            self.logits.append(logits.clone())
            return logits

        monkeypatch.setattr(engine, method, recording)


def padded_against_eager(engine: LlamaEngine, batch: EngineBatch, role: str, monkeypatch):
    """The call run eagerly, then (the cache restored) as a padded program: (eager result,
    padded result, eager logits, padded logits, whether everything written below
    max_length is the same). The cache is put back."""
    run = run_target if role == "target" else run_draft
    before = (engine.k_cache.clone(), engine.v_cache.clone())
    engine.call_graphs = None
    with monkeypatch.context() as patch:
        eager_logits = Recorded(engine, patch, "forward")
        eager = run(engine, batch)
    eager_cache = (engine.k_cache.clone(), engine.v_cache.clone())
    engine.k_cache.copy_(before[0]), engine.v_cache.copy_(before[1])
    engine.call_graphs = CallGraphs(engine, capture=False)
    try:
        with monkeypatch.context() as patch:
            padded_logits = Recorded(engine, patch, "padded_logits")
            padded = run(engine, batch)
    finally:
        engine.call_graphs = None
    same_writes = all(
        torch.allclose(cache[:, :, :, :MAX_LENGTH], expected[:, :, :, :MAX_LENGTH], atol=1e-4)
        for cache, expected in zip((engine.k_cache, engine.v_cache), eager_cache, strict=True)
    )
    engine.k_cache.copy_(before[0]), engine.v_cache.copy_(before[1])
    return eager, padded, eager_logits.logits, padded_logits.logits, same_writes


def verify_logits(batch: EngineBatch, padded: torch.Tensor) -> torch.Tensor:
    """The padded verify's logits of each row's last num_steps tokens, in eager's order."""
    width = int(batch.input_lengths.max())
    picks = [
        r * width + s
        for r, steps in enumerate(batch.num_steps)
        for s in range(int(steps))  # column s of a row holds its s-th returned position
    ]
    return padded[picks]


@pytest.mark.parametrize("rows", list(VERIFIES.values()), ids=list(VERIFIES))
def test_padded_verify_gives_eager_tokens_logits_and_writes(target, rows, monkeypatch):
    batch = make_batch(rows)
    eager, padded, eager_logits, padded_logits, same_writes = padded_against_eager(
        target, batch, "target", monkeypatch
    )
    assert np.array_equal(padded.token_ids, eager.token_ids), (padded.token_ids, eager)
    (expected,), (got,) = eager_logits, padded_logits
    got = verify_logits(batch, got)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    assert same_writes


def draft_logits(batch: EngineBatch, eager: list, padded: list) -> list[tuple]:
    """(eager, padded) logits of each forward of a draft call: the first at each row's last
    fed token, then each step's at the rows that have it."""
    hindsight = hindsight_lengths(batch.input_lengths, batch.temperature)
    rows = np.arange(len(batch.slot_ids))
    last = rows
    if hindsight.any():  # the padded program's logits at every position
        last = rows * int(batch.input_lengths.max()) + batch.input_lengths - 1
    pairs = [(eager[0][np.cumsum(hindsight + 1) - 1], padded[0][last])]
    for step in range(1, len(eager)):
        pairs.append((eager[step], padded[step][: len(rows)][batch.num_steps > step]))
    return pairs


@pytest.mark.parametrize("rows", list(DRAFTS.values()), ids=list(DRAFTS))
def test_padded_draft_gives_eager_tokens_hindsight_and_writes(draft, rows, monkeypatch):
    catching_up = {slot: greedy_continuation(draft, slot, n) for slot, n, *_ in rows if n > 2}
    batch = make_batch(rows, fed=catching_up)
    # one program for every row, so its logits line up with the eager call's (the split of
    # catching-up rows into a program of their own: the test below)
    monkeypatch.setattr(calls_module, "DRAFT_NARROW_WIDTH", MAX_BATCHED_QUERY)
    eager, padded, eager_logits, padded_logits, same_writes = padded_against_eager(
        draft, batch, "draft", monkeypatch
    )
    assert np.array_equal(padded.token_ids, eager.token_ids), (padded.token_ids, eager)
    assert np.array_equal(padded.hindsight_hits, eager.hindsight_hits)
    if catching_up:
        assert padded.hindsight_hits[0] > 0  # some guesses were hits: the check has teeth
    assert len(padded_logits) == max(batch.num_steps.max(), 1)  # one program, k forwards
    assert len(eager_logits) == batch.num_steps.max()
    for expected, got in draft_logits(batch, eager_logits, padded_logits):
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    assert same_writes


def test_catching_up_draft_rows_get_a_program_of_their_own(draft, monkeypatch):
    """A draft call of rows feeding 1 and 2 tokens and one catching up on 7: two padded
    programs, 2 and 7 tokens wide, and the eager call's tokens and hindsight hits."""
    rows = [(0, 1, 4, {}), (1, 7, 4, {}), (2, 2, 4, SAMPLED), (3, 2, 0, {})]
    batch = make_batch(rows, fed={1: greedy_continuation(draft, 1, 7)})
    widths: list[int] = []
    real_run = CallGraphs.run

    def counting(self, role, part):
        widths.append(int(part.input_lengths.max()))
        return real_run(self, role, part)

    monkeypatch.setattr(CallGraphs, "run", counting)
    eager, padded, *_, same_writes = padded_against_eager(draft, batch, "draft", monkeypatch)
    assert widths == [2, 7]
    assert np.array_equal(padded.token_ids, eager.token_ids)
    assert np.array_equal(padded.hindsight_hits, eager.hindsight_hits)
    assert padded.hindsight_hits[1] > 0 and same_writes


@pytest.mark.parametrize("fault", ["mask one key short", "padding writes a real position"])
def test_a_wrong_mask_or_padding_write_is_caught(target, monkeypatch, fault):
    """Negative controls: a padded call whose tokens do not see their own new key, or whose
    padding tokens write real positions, fails the comparison."""
    batch = make_batch(VERIFIES["three of 2, 3, 9 padded to four (in place)"])
    if fault == "mask one key short":
        real_limits = target.key_limits
        monkeypatch.setattr(target, "key_limits", lambda positions: real_limits(positions) - 1)
    else:
        real_positions = CallGraphs._positions

        def writing_real(self, fields, width):
            positions = real_positions(self, fields, width)
            return torch.where(positions >= MAX_LENGTH, positions - MAX_LENGTH, positions)

        monkeypatch.setattr(CallGraphs, "_positions", writing_real)
    _, _, (expected,), (got,), same_writes = padded_against_eager(
        target, batch, "target", monkeypatch
    )
    got = verify_logits(batch, got)
    if fault == "mask one key short":
        assert not torch.allclose(got, expected, atol=1e-3)
    else:
        assert not same_writes


# -- sampling inside a graph ----------------------------------------------------------------

GREEDY_ROW = (0.0, 0, 1.0, False)  # (temperature, top_k, top_p, end blocked)
SAMPLINGS = {  # rows of one call; the end token (END_ID) is each row's argmax
    "greedy": [GREEDY_ROW, (0.0, 0, 1.0, True)],
    "sampled": [(0.7, 0, 1.0, False), (3.0, 0, 1.0, True)],
    "top-k": [(3.0, 3, 1.0, False), (3.0, 0, 1.0, False), (5.0, 40, 1.0, True)],
    "top-p": [(2.0, 0, 0.5, False), (2.0, 0, 1.0, False), (1.0, 0, 0.95, True)],
    "everything, greedy rows between": [
        GREEDY_ROW,
        (4.0, 7, 0.8, True),
        (0.0, 5, 0.5, True),
        (1.5, 0, 0.9, False),
        (2.5, 100, 1.0, False),
    ],
}


def sampling_call(rows: list[tuple], positions: int, vocab_size: int = 1000):
    """Logits (rows * positions, V; V not a multiple of the noise's block) whose argmax is
    the end token, a head that scores a subset (-inf elsewhere), and each row's
    parameters repeated over `positions` positions."""
    generator = torch.Generator().manual_seed(len(rows))
    num = len(rows) * positions
    logits = torch.randn(num, vocab_size, generator=generator) * 3
    logits[:, END_ID] = logits.max(dim=-1).values + 0.5
    logits[:, -100:] = float("-inf")
    column = lambda i, dtype: torch.tensor([r[i] for r in rows], dtype=dtype)  # noqa: E731
    sampling = RowSampling(
        temperature=column(0, torch.float32),
        top_k=column(1, torch.int64),
        top_p=column(2, torch.float32),
        end_id=torch.full((len(rows),), END_ID),
        block_end=column(3, torch.bool),
    )
    repeat = torch.arange(len(rows)).repeat_interleave(positions)
    return logits, sampling.select(repeat), torch.arange(num) // positions + 7, torch.arange(num)


def host_filters(sampling: RowSampling, vocab_size: int) -> Filters | None:
    """What graphs.call_filters decides from a batch's arrays."""
    sampled = sampling.temperature > 0
    if not sampled.any():
        return None
    largest = int(sampling.top_k[sampled].max())
    size = 0 if largest <= 0 else min(1 << (largest - 1).bit_length(), vocab_size)
    return Filters(size, bool((sampling.top_p[sampled] < 1).any()))


@pytest.mark.parametrize("rows", list(SAMPLINGS.values()), ids=list(SAMPLINGS))
def test_dense_sampling_chooses_choose_tokens_tokens(rows):
    """The graph's sampling (every row scored both ways, all the noise made, filters fixed
    by the host) gives choose_tokens' tokens bit for bit, for the whole call and for a part
    of its rows (the draft's later steps), over 64 positions per row."""
    logits, sampling, seeds, positions = sampling_call(rows, 64)
    filters = host_filters(sampling, logits.shape[1])
    expected, _ = choose_tokens(logits, sampling, seeds, positions)
    got = choose_tokens_dense(logits, sampling, seeds, positions, filters)
    assert torch.equal(got, expected)
    part = torch.arange(0, logits.shape[0], 3)
    expected, _ = choose_tokens(logits[part], sampling.select(part), seeds[part], positions[part])
    assert torch.equal(got[part], expected)
    blocked = sampling.block_end.clone()
    assert not (got[blocked] == END_ID).any()
    if not (sampling.temperature > 0).any():  # greedy: the end token where it is not blocked
        assert (got[~blocked] == END_ID).all()


def test_dense_sampling_with_wrong_filters_differs():
    """Negative controls: top-k or top-p left out of the graph's filters changes tokens."""
    for rows in (SAMPLINGS["top-k"], SAMPLINGS["top-p"]):
        logits, sampling, seeds, positions = sampling_call(rows, 64)
        expected, _ = choose_tokens(logits, sampling, seeds, positions)
        got = choose_tokens_dense(logits, sampling, seeds, positions, Filters(0, False))
        assert not torch.equal(got, expected)


# -- one upload, one download, no device reads -------------------------------------------

DEVICE_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero"}


class DeviceReads(TorchDispatchMode):
    """Records the ops that read a tensor's values to the host (.item(), bool(), .tolist()
    go through _local_scalar_dense) or whose output size depends on them (nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in DEVICE_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_padded_call_copies_once_each_way_and_never_reads_the_device(target, draft, role):
    """One padded target call and one padded draft call at k = 4 (greedy and sampled rows,
    top-k, top-p): one upload, one download, no op that reads device values."""
    engine, run = (target, run_target) if role == "target" else (draft, run_draft)
    rows = DRAFTS["k = 4, padded, steps 4, 2, 0"] + [(2, 1, 4, TOP_K), (4, 2, 3, TOP_P)]
    batch = make_batch(
        rows if role == "draft" else VERIFIES["every slot, widths 1-5 and 9 (in place)"]
    )
    saved = (engine.k_cache.clone(), engine.v_cache.clone())
    engine.call_graphs = CallGraphs(engine, capture=False)
    run(engine, batch)  # prepared: the program's buffers exist
    TRANSFERS.uploads = TRANSFERS.downloads = 0
    try:
        with DeviceReads() as spy:
            run(engine, batch)
    finally:
        engine.call_graphs = None
        engine.k_cache.copy_(saved[0]), engine.v_cache.copy_(saved[1])
    assert (TRANSFERS.uploads, TRANSFERS.downloads) == (1, 1)
    assert spy.reads == []


def test_the_device_read_spy_sees_a_read_in_the_padded_call(draft, monkeypatch):
    """Negative control: the padded draft call with the eager sampling planted in its
    program (nonzero, bool()) is caught."""

    def eager_sampling(logits, sampling, seeds, positions, filters):
        return choose_tokens(logits, sampling, seeds, positions)[0]

    monkeypatch.setattr(graphs_module, "choose_tokens_dense", eager_sampling)
    saved = (draft.k_cache.clone(), draft.v_cache.clone())
    draft.call_graphs = CallGraphs(draft, capture=False)
    try:
        with DeviceReads() as spy:
            run_draft(draft, make_batch(DRAFTS["k = 4, padded, steps 4, 2, 0"]))
    finally:
        draft.call_graphs = None
        draft.k_cache.copy_(saved[0]), draft.v_cache.copy_(saved[1])
    assert any("nonzero" in r for r in spy.reads)
    assert any("is_nonzero" in r or "_local_scalar_dense" in r for r in spy.reads)  # bool()


# -- splitting a call; the loop ------------------------------------------------------------


def count_padded_rows(monkeypatch) -> list[int]:
    """The rows of each padded program run from now on (CallGraphs.run spied on)."""
    padded_rows: list[int] = []
    real_run = CallGraphs.run

    def counting(self, role, part):
        padded_rows.append(len(part.slot_ids))
        return real_run(self, role, part)

    monkeypatch.setattr(CallGraphs, "run", counting)
    return padded_rows


def test_prefill_and_log_prob_rows_run_eagerly_beside_the_padded_rows(target, monkeypatch):
    """A verify with a prefill row (more than MAX_BATCHED_QUERY tokens) and a row asking for
    log-probabilities: those run eagerly, the others padded, merged in row order: the
    eager call's tokens and log-probabilities."""
    rows = [(5, 3, 3, {}), (2, 20, 1, {}), (6, 2, 2, SAMPLED), (0, 4, 4, {})]
    batch = make_batch(rows)
    batch.return_log_probs = np.array([False, False, False, True])
    padded_rows = count_padded_rows(monkeypatch)
    eager, padded, *_, same_writes = padded_against_eager(target, batch, "target", monkeypatch)
    assert padded_rows == [2]
    assert np.array_equal(padded.token_ids, eager.token_ids)
    assert np.allclose(padded.log_probs, eager.log_probs, atol=1e-4) and eager.log_probs[3].any()
    assert same_writes


def test_rows_with_logit_controls_run_eagerly_beside_the_padded_rows(target, monkeypatch):
    """A verify whose second row has logit controls (a repetition penalty, min_p, a banned
    token): it runs eagerly (its processing depends on its history), the others padded, merged
    in row order: the eager call's tokens."""
    batch = make_batch([(5, 3, 3, {}), (6, 2, 2, SAMPLED), (0, 4, 4, {})])
    batch.repetition_penalty = np.array([1.0, 1.5, 1.0], dtype=np.float32)
    batch.presence_penalty = batch.frequency_penalty = np.zeros(3, dtype=np.float32)
    batch.occurrence_start = np.zeros(3, dtype=np.int32)
    batch.min_p = np.array([0.0, 0.1, 0.0], dtype=np.float32)
    batch.history_rows = np.array([1, 1], dtype=np.int32)
    batch.history_ids = np.array([7, 9], dtype=np.int32)
    batch.bias_rows, batch.bias_ids = np.array([1], dtype=np.int32), np.array([3], np.int32)
    batch.bias_values = np.array([-np.inf], dtype=np.float32)
    padded_rows = count_padded_rows(monkeypatch)
    eager, padded, *_, same_writes = padded_against_eager(target, batch, "target", monkeypatch)
    assert padded_rows == [2]
    assert np.array_equal(padded.token_ids, eager.token_ids) and same_writes


def loop_outputs(target: LlamaEngine, draft: LlamaEngine) -> list[tuple[list[int], int]]:
    """Three requests (model draft k = 4, prompt lookup k = 8; greedy and one sampled)
    decoded by the loop over the engines, no Triton between: each one's tokens and
    how many draft tokens were accepted (the draft's proposals show only there)."""
    from specdec.loop.config import SchedulerConfig
    from specdec.loop.scheduler import SpeculativeScheduler
    from specdec.text.request import GenerationRequest
    from specdec.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(TARGET))
    config = SchedulerConfig(4, MAX_LENGTH, max_draft_tokens=8, default_draft_tokens=None)
    scheduler = SpeculativeScheduler(LocalEngines(draft, target), config, tokenizer.decode)
    fixed = dict(fixed_num_draft_tokens=True)  # adaptive k would follow the timings
    sampled = dict(temperature=1.0, top_k=3, seed=5)
    prompts = [
        ("What is 17 times 23?", dict(proposers=("draft_model",), num_draft_tokens=4, **fixed)),
        ("Repeat: the quick brown fox.", dict(proposers=("ngram",), num_draft_tokens=8, **fixed)),
        (
            "Name three rivers.",
            dict(proposers=("draft_model",), num_draft_tokens=4, **fixed, **sampled),
        ),
    ]
    groups = []
    for text, options in prompts:
        ids = tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        request = GenerationRequest(
            prompt=None, prompt_ids=ids, max_tokens=16, end_id=tokenizer.eos_token_id, **options
        )
        groups += scheduler.submit_all([request])
    while scheduler.has_work:
        scheduler.step()
    return [
        (s.token_ids[len(s.request.prompt_ids) :], s.stats.num_accepted_draft_tokens)
        for s in groups
    ]


def test_the_loop_decodes_the_same_with_padded_programs():
    """The loop over the real target and draft (float32), eager and then with both engines'
    padded programs forced on the CPU (capture=False): the same tokens, greedy and sampled,
    and the same proposals accepted; both roles ran padded programs (prefill rows eagerly
    beside them)."""
    target = LlamaEngine.from_checkpoint(TARGET, 4, MAX_LENGTH)
    draft = LlamaEngine.from_checkpoint(DRAFT, 4, MAX_LENGTH)
    eager = loop_outputs(target, draft)
    assert sum(accepted for _, accepted in eager) > 0
    target.call_graphs = CallGraphs(target, capture=False)
    draft.call_graphs = CallGraphs(draft, capture=False)
    assert loop_outputs(target, draft) == eager
    assert target.call_graphs.programs and draft.call_graphs.programs


# -- settings, memory, CUDA ----------------------------------------------------------------


def test_cuda_graphs_need_cuda_and_the_torch_engine():
    from specdec.engines.select import create_engine

    with pytest.raises(ValueError, match="cuda_graphs runs on CUDA only"):
        LlamaEngine.from_checkpoint(TARGET, 1, 16, "cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs applies to the torch engine"):
        create_engine("onnxruntime", TARGET, 1, 16, cuda_graphs=True)


@pytest.mark.parametrize(
    ("requested", "kind", "device", "expected"),
    [
        (None, "torch", "cuda", True),  # auto: on where the torch engine runs on CUDA
        (None, "torch", "cuda:1", True),
        (None, "torch", "cpu", False),
        (None, "tensorrt", "cuda", False),
        (None, "onnxruntime", "cpu", False),
        (False, "torch", "cuda", False),
        (True, "torch", "cuda", True),
    ],
)
def test_cuda_graphs_auto_resolves_by_engine_and_device(requested, kind, device, expected):
    from specdec.engines.select import resolve_cuda_graphs
    from specdec.serving import settings

    assert settings.CUDA_GRAPHS.read({}) is None  # the default is auto
    assert resolve_cuda_graphs(requested, kind, device) is expected


def test_the_pool_estimate_grows_with_the_largest_call(target):
    config = target.config
    small = graph_pool_bytes_estimate(config, 8, 5, torch.float32, 200)
    assert small > 8 * 5 * config.vocab_size * 4  # at least the logits
    assert graph_pool_bytes_estimate(config, 64, 5, torch.float32, 200) > 7 * small
    assert graph_pool_bytes_estimate(config, 8, 9, torch.float32, 200) > small
    assert CallGraphs(target, capture=False).pool_bytes() == 0
    assert target.graph_pool_bytes() == 0  # no graphs
    assert graphs_module.SPARE_POSITIONS >= 9  # the widest row a test pads


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine: CUDA graphs need one")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_graph_calls_equal_eager_calls(dtype):
    """Every verify and draft call above on two CUDA engines with the same cache, one eager,
    one replaying CUDA graphs (each shape captured on its first call, replayed on its
    second): the same tokens (float32) or the same tokens where no near tie decides
    (bfloat16: compared in float32 only), the same hindsight hits, and a pool that holds
    what the captures reserved, within the estimate."""
    for checkpoint, calls, run in ((TARGET, VERIFIES, run_target), (DRAFT, DRAFTS, run_draft)):
        eager = prefilled(checkpoint, "cuda", dtype)
        graphs = prefilled(checkpoint, "cuda", dtype, cuda_graphs=True)
        assert graphs.call_graphs is not None and graphs.call_graphs.capture
        for rows in calls.values():
            batch = make_batch(rows)
            expected = run(eager, batch)
            for _ in range(2):  # captured, then replayed
                got = run(graphs, batch)
                if dtype == torch.float32:
                    assert np.array_equal(got.token_ids, expected.token_ids)
                    assert np.array_equal(got.hindsight_hits, expected.hindsight_hits)
        programs = graphs.call_graphs.programs
        assert programs and all(p.graph is not None for p in programs.values())
        estimate = graph_pool_bytes_estimate(graphs.config, 8, 9, dtype, MAX_LENGTH)
        assert 0 < graphs.graph_pool_bytes() < 4 * estimate
