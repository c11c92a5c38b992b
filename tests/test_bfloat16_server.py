"""The bfloat16 contract, through the real server: every token of speculative output is plain
decoding's argmax at its prefix, except where plain decoding's two best logits lie within
TIE_MARGIN; and every answer ends where plain decoding would (the end token) or at 128 tokens.

A verify of k + 1 tokens and k + 1 one-token steps round differently in bfloat16, so where
the two best tokens are nearly tied the paths may pick differently; anywhere else a
divergence is a bug. The check is by token id at every position (token_divergences):
one-token steps of the same engine in this process, teacher-forced along each answer, so
after an excused tie it goes on checking from the answer's own prefix. The server answers
text only; here its loop also sends each sequence's token ids (a test-only wrapper of
speculative_decoding's responses, SPY_MODEL; requests go to that model directly, as the
ensemble's only other step is the same tokenizer), and the text must be their decode.
Every divergence is printed (pytest -s, or -rA shows it).
"""

from __future__ import annotations

import queue
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import tritonclient.grpc as grpcclient

import specdec.harness
from build.greedy_parity import (
    TIE_MARGIN,
    Divergence,
    SingleSteps,
    token_divergences,
)
from build.tie_margin import PROMPTS
from specdec.client import build_inputs, scrape_metrics
from specdec.engines.llama import LlamaEngine
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT
from specdec.server_config import ServerConfig
from specdec.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.server

NUM_TOKENS = 128
MAX_CONTEXT = 512
PLAIN = {"num_draft_tokens": 0}
DRAFTED = {"num_draft_tokens": 4, "fixed_num_draft_tokens": True, "proposer": "draft_model"}
LOOKED_UP = {"num_draft_tokens": 8, "fixed_num_draft_tokens": True, "proposer": "ngram"}
COUNTS = (
    "total_draft_tokens",
    "total_accepted_draft_tokens",
    "first_scheduled_time_ns",
    "last_token_time_ns",
)

# speculative_decoding as served, each response also carrying its sequence's prompt and
# output token ids so far (the loop's own lists; the end token is never among them).
SPY_MODEL = """
import numpy as np

from specdec.serving import bls_model
from specdec.serving.bls_model import TritonPythonModel

served_arrays = bls_model.response_arrays


def response_arrays(sequence, new_text, first_log_prob, requested=None):
    arrays = served_arrays(sequence, new_text, first_log_prob, requested)
    prompt = sequence.request.prompt_ids
    arrays["prompt_ids"] = np.array([prompt], dtype=np.int32)
    arrays["output_ids"] = np.array([sequence.token_ids[len(prompt):]], dtype=np.int32)
    return arrays


bls_model.response_arrays = response_arrays
__all__ = ["TritonPythonModel"]
"""
SPY_OUTPUTS = (
    '  { name: "prompt_ids" data_type: TYPE_INT32 dims: [ -1 ] },\n'
    '  { name: "output_ids" data_type: TYPE_INT32 dims: [ -1 ] },\n'
)


def spy_repository(folder: Path) -> Path:
    """The model repository with SPY_MODEL as speculative_decoding, its two outputs declared."""
    repository = folder / "model_repository"
    shutil.copytree(PROJECT_ROOT / "model_repository", repository)
    bls = repository / "speculative_decoding"
    (bls / "1" / "model.py").write_text(SPY_MODEL)
    config = (bls / "config.pbtxt").read_text()
    (bls / "config.pbtxt").write_text(
        re.sub(r"(?m)^output \[\n", "output [\n" + SPY_OUTPUTS, config)
    )
    return repository


@pytest.fixture(scope="module")
def bfloat16_server(target_dir, tmp_path_factory):
    repository = spy_repository(tmp_path_factory.mktemp("bfloat16"))

    class SpyConfig(ServerConfig):
        @classmethod
        def from_env(cls, env=None):
            config = super().from_env(env)
            config.source_repository = repository
            return config

    with pytest.MonkeyPatch.context() as patch:  # ManagedServer renders it at once
        patch.setattr(specdec.harness, "ServerConfig", SpyConfig)
        running = ManagedServer(
            "test-bfloat16",
            {"DTYPE": "bfloat16", "NUM_SLOTS": "8", "MAX_CONTEXT": str(MAX_CONTEXT)},
        )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return load_tokenizer(str(target_dir))


@pytest.fixture(scope="module")
def steps(target_dir) -> SingleSteps:
    """The server's target in this process, one token per call."""
    engine = LlamaEngine.from_checkpoint(target_dir, 1, MAX_CONTEXT, dtype=torch.bfloat16)
    return SingleSteps(engine)


@dataclass
class Answer:
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    metrics: dict[str, int] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        """By the end token: no stop words are sent, and the context has room, so an
        answer shorter than max_tokens ended with it."""
        return len(self.output_ids) < NUM_TOKENS


def ask(url: str, prompt: str, params: dict) -> Answer:
    """One non-streamed request to speculative_decoding (SPY_MODEL), on its own stream."""
    names = ["text_output", "prompt_ids", "output_ids", *COUNTS]
    inputs = build_inputs(
        prompt,
        max_tokens=NUM_TOKENS,
        exclude_input_in_output=True,
        return_perf_metrics=True,
        **params,
    )
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    answer = Answer()
    try:
        client.async_stream_infer(
            "speculative_decoding",
            inputs,
            outputs=[grpcclient.InferRequestedOutput(name) for name in names],
            enable_empty_final_response=True,
        )
        while True:
            result, error = responses.get(timeout=1800)  # one response, at the end
            assert error is None, error
            if result.as_numpy("output_ids") is not None:  # not the empty final response
                answer.text += result.as_numpy("text_output")[0].decode("utf-8")
                answer.prompt_ids = result.as_numpy("prompt_ids")[0].tolist()
                answer.output_ids = result.as_numpy("output_ids")[0].tolist()  # all so far
                answer.metrics = {n: int(result.as_numpy(n)[0][0]) for n in COUNTS}
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return answer
    finally:
        client.stop_stream()
        client.close()


def served(url: str, params: list[dict], concurrently: bool) -> list[Answer]:
    """The first len(params) prompts, each with its params: one after another, or all at
    once."""
    jobs = list(zip(PROMPTS, params, strict=False))
    if not concurrently:
        return [ask(url, prompt, p) for prompt, p in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: ask(url, *job), jobs))


def divergences(steps: SingleSteps, tokenizer, answer: Answer) -> list[Divergence]:
    assert answer.text == tokenizer.decode(answer.output_ids)  # the ids are what was served
    assert 0 < len(answer.output_ids) <= NUM_TOKENS
    return token_divergences(
        steps, answer.prompt_ids, answer.output_ids, tokenizer.eos_token_id, answer.ended
    )


def check(steps: SingleSteps, tokenizer, runs: dict[str, list[Answer]]) -> list[str]:
    """Every answer of every run against one-token steps, position by position (prompt by
    prompt, so the runs of one prompt share their steps): a report line per divergence;
    fails on one outside the margin."""
    report, outside = [], []
    for i in range(len(PROMPTS)):
        for label, answers in runs.items():
            if i >= len(answers):  # a run of the first prompts only
                continue
            for d in divergences(steps, tokenizer, answers[i]):
                line = (
                    f"{label}: prompt {i} ({PROMPTS[i][:30]!r}) position {d.position}: "
                    f"{d.token} where plain decoding's argmax is {d.expected}, gap {d.gap:.4f}"
                )
                report.append(line)
                if not d.near_tie():
                    outside.append(line)
    print("\n".join(report) or "no divergence")
    assert not outside, outside
    return report


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_bfloat16_speculation_diverges_only_at_near_ties(bfloat16_server, steps, tokenizer):
    url, metrics_url = bfloat16_server.url, bfloat16_server.metrics_url
    n = len(PROMPTS)
    plain = served(url, [PLAIN] * n, concurrently=False)
    # The draft alone on half the prompts (the batch below drafts on every other prompt):
    # the suite's slowest test, in emulated bfloat16 on a CPU without it.
    alone = served(url, [DRAFTED] * (n // 2), concurrently=False)
    before = scrape_metrics(metrics_url)
    batch = served(url, [DRAFTED if i % 2 else LOOKED_UP for i in range(n)], concurrently=True)
    after = scrape_metrics(metrics_url)

    # Speculation ran: plain proposed nothing; the drafted runs proposed, and had accepted.
    assert all(a.metrics["total_draft_tokens"] == 0 for a in plain)
    for answers in (alone, batch):
        assert all(a.metrics["total_draft_tokens"] > 0 for a in answers)
    assert sum(a.metrics["total_accepted_draft_tokens"] for a in alone) > 0
    for proposer in ("draft_model", "ngram"):
        accepted = f'specdec_proposer_accepted_draft_tokens_total{{proposer="{proposer}"}}'
        assert delta(before, after, accepted) > 0, proposer
    # The batch was one: all 8 held a slot at one moment, so every iteration then served them
    # together; and target passes outnumbered iterations (one each when served one by one).
    assert max(a.metrics["first_scheduled_time_ns"] for a in batch) < min(
        a.metrics["last_token_time_ns"] for a in batch
    )
    passes = delta(before, after, "specdec_target_passes_total")
    iterations = delta(before, after, "specdec_iterations_total")
    assert passes >= 2 * iterations
    print(
        f"alone: {sum(a.metrics['total_accepted_draft_tokens'] for a in alone)} of "
        f"{sum(a.metrics['total_draft_tokens'] for a in alone)} draft tokens accepted; "
        f"batch: {passes:.0f} target passes in {iterations:.0f} iterations; "
        f"ended by the end token: {[sum(a.ended for a in r) for r in (plain, alone, batch)]}"
    )
    # How the batch's answers (one sequence each) ended, as the server counted them.
    ended = sum(a.ended for a in batch)
    assert delta(before, after, 'specdec_sequences_total{outcome="end"}') == ended
    assert delta(before, after, 'specdec_sequences_total{outcome="length"}') == n - ended

    # Every position, and every end: the plain path is the one computed here, exactly.
    assert check(steps, tokenizer, {"plain (k = 0)": plain}) == []
    check(steps, tokenizer, {"draft model k = 4, alone": alone, "batch of 8": batch})


# -- negative controls: the check fails where it should ----------------------------------


def plain_decoding(steps: SingleSteps, prompt: list[int], output: list[int], count: int, end):
    """`output` continued by plain decoding (the reference's argmax) for up to `count`
    tokens, stopping at `end`: the tokens, and per new position the runner-up and the gap."""
    output, seconds, gaps = list(output), [], []
    for _ in range(count):
        top = steps.along(prompt, output, len(output) + 1)[-1].topk(2)
        seconds.append(int(top.indices[1]))
        gaps.append(float(top.values[0] - top.values[1]))
        output.append(int(top.indices[0]))
        if output[-1] == end:
            break
    return output, seconds, gaps


def test_the_check_fails_on_divergences_away_from_a_tie(steps, tokenizer):
    """Not vacuous: an answer that takes plain decoding's runner-up where the top two are
    far apart, goes on as plain decoding would from there, and does so again later: both
    are found (a check that stopped at the first divergence would miss the second)."""
    prompt, end = tokenizer.encode(PROMPTS[0]), tokenizer.eos_token_id
    ids, seconds, gaps = plain_decoding(steps, prompt, [], 24, end)
    first = next(i for i, gap in enumerate(gaps) if gap >= TIE_MARGIN and i >= 4)
    answer = ids[:first] + [seconds[first]]
    answer, seconds, gaps = plain_decoding(steps, prompt, answer, 24, end)
    second = next(i for i, gap in enumerate(gaps) if gap >= TIE_MARGIN and i >= 4)
    second += first + 1
    answer = answer[:second] + [seconds[second - first - 1]]
    found = token_divergences(steps, prompt, answer, end, ended=False)
    assert found == token_divergences(steps.engine, prompt, answer, end, ended=False)  # fresh
    assert [(d.position, d.token) for d in found] == [
        (first, answer[first]),
        (second, answer[second]),
    ]
    assert not any(d.near_tie() for d in found)


def test_the_check_fails_on_an_early_or_a_missed_end(steps, tokenizer):
    """An answer that ends with the end token where plain decoding goes on, and one that
    goes on where plain decoding ends."""
    end = tokenizer.eos_token_id
    prompt = tokenizer.encode(PROMPTS[7])  # the SQL: plain decoding ends at 59 tokens
    path, seconds, _ = plain_decoding(steps, prompt, [], NUM_TOKENS, end)
    assert path[-1] == end, "plain decoding of this prompt should end by itself"
    output = path[:-1]
    assert token_divergences(steps, prompt, output, end, ended=True) == []
    assert token_divergences(steps, prompt, output[:-1], end, ended=False) == []  # length

    early = token_divergences(steps, prompt, output[:-1], end, ended=True)
    assert [(d.position, d.token, d.expected) for d in early] == [
        (len(output) - 1, end, output[-1])
    ]
    missed = token_divergences(steps, prompt, output + [seconds[-1]], end, ended=False)
    assert [(d.position, d.token, d.expected) for d in missed] == [(len(output), seconds[-1], end)]
    assert not early[0].near_tie() and not missed[0].near_tie()
