"""Engine precision (DTYPE): which dtype each engine computes in, and the torch engine in
bfloat16 against itself in float32. No server: the bfloat16 contract through the server is
tests/test_bfloat16_server.py."""

from __future__ import annotations

import pytest
import torch

from build.greedy_parity import (
    MARGINS,
    MEASURED_PRECISION_MOVE,
    MEASURED_VERIFY_MOVE,
    PRECISION_MARGIN,
    TIE_MARGIN,
    SingleSteps,
    bfloat16_kind,
    gap_moves,
    greedy_top2,
    precision_moves,
    token_divergences,
    verify_chunks,
)
from build.tie_margin import PROMPTS
from conftest import DRAFT
from specdec.engines.llama import LlamaEngine
from specdec.engines.select import create_engine, engine_dtype, resolve_dtype
from specdec.server_config import ServerConfig, render_repository
from specdec.serving.settings import BLS_MODEL

CPU_WITH_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
CPU_WITH_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_tile amx_bf16 amx_int8\n"
CPU_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
# A flag's name elsewhere in the text is not a flag.
CPU_NAME_ONLY = "model name\t: avx512_bf16 lookalike\nflags\t\t: fpu avx2\n"


def resolve_on(cpuinfo: str, requested: str = "auto", device: str = "cpu") -> str:
    return resolve_dtype(requested, device, cpuinfo=lambda: cpuinfo, cuda_bf16=lambda: False)


@pytest.mark.parametrize(
    "cpuinfo,expected",
    [
        (CPU_WITH_BF16, "bfloat16"),
        (CPU_WITH_AMX, "bfloat16"),
        (CPU_WITHOUT, "float32"),
        (CPU_NAME_ONLY, "float32"),
        ("", "float32"),  # no /proc/cpuinfo
    ],
)
def test_auto_on_the_cpu_follows_its_bfloat16_flags(cpuinfo, expected):
    assert resolve_on(cpuinfo) == expected


def test_margins_follow_how_the_cpu_computes_bfloat16():
    """Native bfloat16 kernels move a near tie further than emulated ones, AMX's less than
    avx512_bf16's; each kind's margins lie between its largest measured move and twice it."""
    assert bfloat16_kind(CPU_WITH_BF16) == "native"
    assert bfloat16_kind(CPU_WITH_AMX) == bfloat16_kind(CPU_WITH_BF16 + CPU_WITH_AMX) == "amx"
    assert bfloat16_kind(CPU_WITHOUT) == bfloat16_kind("") == bfloat16_kind(CPU_NAME_ONLY)
    assert bfloat16_kind(CPU_WITHOUT) == "emulated"
    for margins in MARGINS.values():
        assert margins.verify_move <= margins.tie <= 2 * margins.verify_move
        assert margins.precision_move <= margins.precision <= 2 * margins.precision_move
    assert MARGINS["native"].verify_move > MARGINS["emulated"].verify_move


def test_auto_on_cuda_prefers_bfloat16_then_float16():
    for has_bf16, expected in ((True, "bfloat16"), (False, "float16")):
        chosen = resolve_dtype("auto", "cuda:1", cpuinfo=lambda: "", cuda_bf16=lambda b=has_bf16: b)
        assert chosen == expected


def test_explicit_dtypes_pass_through():
    assert resolve_on(CPU_WITHOUT, "bfloat16") == "bfloat16"  # asked for: slow, not wrong
    assert resolve_on(CPU_WITH_BF16, "float32") == "float32"
    assert resolve_on(CPU_WITHOUT, "float16", device="cuda") == "float16"


def test_unknown_dtype_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"DTYPE 'fp8'.*float32, bfloat16, float16, auto"):
        resolve_on(CPU_WITH_BF16, "fp8")
    with pytest.raises(ValueError, match="DTYPE 'half'"):
        engine_dtype("onnxruntime", "half")


def test_float16_on_the_cpu_is_refused():
    with pytest.raises(RuntimeError, match="float16 runs on CUDA only"):
        resolve_on(CPU_WITH_BF16, "float16")
    with pytest.raises(ValueError, match="CUDA only"):  # refused before reading weights
        LlamaEngine(None, {}, 1, 8, dtype=torch.float16)


def test_onnxruntime_computes_in_float32_only():
    assert engine_dtype("onnxruntime", "auto", cpuinfo=lambda: CPU_WITH_BF16) == "float32"
    assert engine_dtype("onnxruntime", "float32") == "float32"
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(RuntimeError, match=f"onnxruntime computes in float32.*DTYPE={dtype}"):
            engine_dtype("onnxruntime", dtype)


def test_tensorrt_computes_in_float16_or_bfloat16_only():
    # The device parameter is the torch engine's: plans always run on the GPU.
    pick = dict(cpuinfo=lambda: CPU_WITH_BF16, cuda_bf16=lambda: False)
    assert engine_dtype("tensorrt", "auto", "cpu", **pick) == "float16"
    assert engine_dtype("tensorrt", "bfloat16", "cpu", **pick) == "bfloat16"
    with pytest.raises(RuntimeError, match="tensorrt computes in float16 or bfloat16"):
        engine_dtype("tensorrt", "float32", **pick)


def test_create_engine_refuses_before_loading_anything():
    with pytest.raises(RuntimeError, match="DTYPE=bfloat16 needs ENGINE=torch"):
        create_engine("onnxruntime", "no-such-checkpoint", 1, 8, dtype="bfloat16")
    with pytest.raises(ValueError, match="DTYPE 'double'"):
        create_engine("torch", "no-such-checkpoint", 1, 8, dtype="double")


def test_dtype_reaches_the_engines_and_defaults_to_float32(tmp_path):
    def rendered(env: dict[str, str]) -> str:
        config = ServerConfig.from_env({**env, "RUN_DIR": str(tmp_path)})
        return (render_repository(config) / BLS_MODEL / "config.pbtxt").read_text()

    line = 'key: "dtype" value: {{ string_value: "{}" }}'
    # what test servers get: exactness needs float32
    assert line.format("float32") in rendered({})
    assert line.format("auto") in rendered({"DTYPE": "auto"})


# The real target: bfloat16 against float32.


@pytest.fixture(scope="module")
def engines(target_dir) -> dict[torch.dtype, LlamaEngine]:
    return {
        dtype: LlamaEngine.from_checkpoint(target_dir, num_slots=2, max_length=128, dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }


def test_bfloat16_cache_takes_half_the_memory(engines):
    float32, bfloat16 = engines[torch.float32], engines[torch.bfloat16]
    for name in ("k_cache", "v_cache"):
        full, half = getattr(float32, name), getattr(bfloat16, name)
        assert half.dtype == torch.bfloat16 and half.shape == full.shape
        assert half.nbytes * 2 == full.nbytes
    assert bfloat16.layers[0]["qkv"].dtype == bfloat16.lm_head.dtype == torch.bfloat16


def test_bfloat16_head_recomputes_its_top_logits_in_float32(engines):
    engine = engines[torch.bfloat16]
    h = torch.randn(4, engine.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = engine.head_logits(h)
    exact = h @ engine.lm_head.float().T  # the same weights, float32 all through
    rounded = (h.to(torch.bfloat16) @ engine.lm_head.T).float()  # what the head computes
    top = rounded.topk(engine.rescored_logits, dim=-1).indices  # the ones recomputed
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), atol=1e-4)
    assert torch.equal(logits.argmax(dim=-1), exact.argmax(dim=-1))
    # Without it the top logits sit on bfloat16's grid.
    assert not torch.equal(logits.gather(1, top), rounded.gather(1, top))


# The prompt and positions where build/tie_margin.py measured its largest moves (the list
# prompt, position 43): a live measurement there reaches the committed figures.
LIVE_PROMPT = PROMPTS[6]
LIVE_TOKENS = 48


@pytest.fixture(scope="module")
def live_prompt(target_dir) -> list[int]:
    from specdec.text.tokenizer import load_tokenizer

    return load_tokenizer(str(target_dir)).encode(LIVE_PROMPT)


def assert_margin(margin: float, measured: float, live: float) -> None:
    """A margin is at least the largest move and at most twice it: the committed figure's,
    and this host's live one."""
    assert measured <= margin <= 2 * measured
    assert live <= margin <= 2 * live, f"live largest move {live:.4f}, margin {margin}"


def test_tie_margin_holds_for_a_live_verify_measurement(engines, live_prompt):
    """TIE_MARGIN against verifies of 5 and 9 tokens at every alignment, teacher-forced
    along bfloat16 plain decoding (LIVE_TOKENS of the worst measured prompt)."""
    engine = engines[torch.bfloat16]
    path = greedy_top2(engine, live_prompt, LIVE_TOKENS, None)
    moves = [
        m.move
        for width in (5, 9)
        for offset in range(width)
        for m in gap_moves(engine, [live_prompt], [path[0]], [path], [width], [offset])[0]
    ]
    assert len(moves) == 14 * (LIVE_TOKENS - 1)
    assert_margin(TIE_MARGIN, MEASURED_VERIFY_MOVE, max(moves))


def test_verify_chunks_feed_every_token_but_the_last_once():
    for width in (1, 5, 9):
        for offset in range(width):
            chunks = verify_chunks(12, width, offset)
            assert chunks[0][0] == 0 and chunks[-1][1] == 11  # the last token is never fed
            assert all(a == b for (_, a), (b, _) in zip(chunks, chunks[1:], strict=False))
            assert chunks[0][1] == (offset or width) and all(b - a <= width for a, b in chunks)


def test_a_verify_of_one_token_is_a_single_step(engines, live_prompt):
    """The measurement's own control: width 1 is the reference path itself, move 0."""
    engine = engines[torch.bfloat16]
    path = greedy_top2(engine, live_prompt, 12, None)
    moves = gap_moves(engine, [live_prompt], [path[0]], [path], [1], [0])[0]
    assert len(moves) == 11 and all(m.move == 0 and not m.flipped for m in moves)


@pytest.fixture(scope="module")
def float32_path(engines, live_prompt) -> tuple[list[int], list[int], list[float]]:
    """float32 plain greedy decoding, LIVE_TOKENS through the end token: per position the
    argmax, the runner-up and their gap."""
    return greedy_top2(engines[torch.float32], live_prompt, LIVE_TOKENS, None)


def disagreements(engine, prompt, path) -> list[tuple[int, float]]:
    """Where `engine`'s one-token steps, teacher-forced along float32's greedy path, pick
    another token: (position, float32's top-2 gap there)."""
    ids, _, float32_gaps = path
    found = token_divergences(engine, prompt, ids, None, ended=False)
    return [(d.position, float32_gaps[d.position]) for d in found]


def test_bfloat16_leaves_float32_greedy_only_at_near_ties(engines, live_prompt, float32_path):
    """Every position: bfloat16's argmax is float32's, or float32's two best were within
    PRECISION_MARGIN; and the margin holds for this live measurement."""
    steps = SingleSteps(engines[torch.bfloat16])
    moves = precision_moves(steps, live_prompt, float32_path)
    assert len(moves) == LIVE_TOKENS
    assert_margin(PRECISION_MARGIN, MEASURED_PRECISION_MOVE, max(m.move for m in moves))
    found = disagreements(steps, live_prompt, float32_path)  # the same steps, not recomputed
    assert all(gap < PRECISION_MARGIN for _, gap in found), found


def test_the_precision_check_fails_for_an_engine_that_computes_something_else(
    engines, live_prompt, float32_path
):
    """Not vacuous: the same check of a bfloat16 engine that lost one layer's MLP (its down
    matrix zero, as a weight that failed to load) finds tokens where float32's top two
    were far apart. (Scaling that matrix by 1.06 or 1.5 moves only near ties.)"""
    engine = engines[torch.bfloat16]
    down = engine.layers[15]["down"]
    saved = down.clone()
    down.zero_()
    try:
        found = disagreements(engine, live_prompt, float32_path)
    finally:
        down.copy_(saved)
    assert any(gap >= PRECISION_MARGIN for _, gap in found), found


def test_reduced_draft_head_works_in_bfloat16():
    draft = LlamaEngine.from_checkpoint(DRAFT, num_slots=1, max_length=32, dtype=torch.bfloat16)
    logits = draft.forward(torch.arange(100, 110), [10], [0], [0], [2])
    assert logits.dtype == torch.float32 and logits.shape == (2, 49152)
    scored = torch.isfinite(logits[0])
    assert int(scored.sum()) == draft.head_token_ids.numel()  # the rest: probability 0
    assert bool(scored[logits.argmax(dim=-1)].all())
