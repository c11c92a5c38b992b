"""End to end through the real Triton server: exactness, batching, streaming, overload."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import hf_greedy_text
from specdec.client import PERF_OUTPUTS, generate, scrape_metrics
from specdec.loop.proposers.suffix import DEFAULT_STORE_BYTES

pytestmark = pytest.mark.server

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nList three uses of copper.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a village at the edge of the forest,",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "<|im_start|>user\nÉcris une phrase sur la mer.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM orders",
]
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def references(hf_target):
    return [hf_greedy_text(hf_target, p, NUM_TOKENS) for p in PROMPTS]


def run_concurrently(url, model, jobs):
    """jobs: list of (prompt, params) -> results, each on its own gRPC stream."""

    def one(job):
        prompt, params = job
        return generate(prompt, url=url, model=model, **params)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_greedy_equals_transformers_generate(server, references, k):
    params = dict(
        max_tokens=NUM_TOKENS,
        num_draft_tokens=k,
        fixed_num_draft_tokens=True,
        exclude_input_in_output=True,
    )
    results = run_concurrently(server.url, "ensemble", [(p, params) for p in PROMPTS])
    for prompt, result, expected in zip(PROMPTS, results, references, strict=True):
        assert result.error is None, result.error
        assert result.text == expected, prompt


@pytest.mark.parametrize(
    "speculation",
    [
        {"proposer": "ngram", "num_draft_tokens": 8, "fixed_num_draft_tokens": True},
        {"proposer": "ngram"},  # k chosen per row
        {},  # the server's choice of proposer and k
        # the store holds the answers to these prompts by now: long proposals, all checked
        {"proposer": "suffix", "num_draft_tokens": 8, "fixed_num_draft_tokens": True},
        {"proposer": ["suffix", "draft_model"]},
    ],
)
def test_prompt_lookup_greedy_equals_transformers_generate(server, references, speculation):
    params = dict(max_tokens=NUM_TOKENS, exclude_input_in_output=True, **speculation)
    results = run_concurrently(server.url, "ensemble", [(p, params) for p in PROMPTS])
    for prompt, result, expected in zip(PROMPTS, results, references, strict=True):
        assert result.error is None, result.error
        assert result.text == expected, prompt


def test_the_suffix_store_is_fed_bounded_and_counted_on_metrics(server, references):
    """Every answer feeds the store (its size gauges), and suffix proposals are counted by
    proposer like the others'; a request alone, proposed its own earlier answer by the store,
    still writes exactly the target's greedy text."""
    params = dict(
        max_tokens=NUM_TOKENS,
        proposer="suffix",
        num_draft_tokens=8,
        fixed_num_draft_tokens=True,
        exclude_input_in_output=True,
    )
    run_concurrently(server.url, "ensemble", [(p, params) for p in PROMPTS])
    alone = generate(PROMPTS[0], url=server.url, return_perf_metrics=True, **params)
    assert alone.error is None, alone.error
    assert alone.text == references[0]
    # The store holds this prompt's answer by now: most of its proposals are accepted.
    assert alone.metrics["acceptance_rate"] > 0.5, alone.metrics
    metrics = scrape_metrics(server.metrics_url)
    assert metrics['specdec_proposer_draft_tokens_total{proposer="suffix"}'] > 0
    assert metrics['specdec_proposer_accepted_draft_tokens_total{proposer="suffix"}'] > 0
    assert 0 < metrics["specdec_suffix_store_bytes"] <= DEFAULT_STORE_BYTES
    assert metrics["specdec_suffix_store_tokens"] >= len(PROMPTS) * NUM_TOKENS
    assert metrics["specdec_suffix_store_evictions_total"] == 0  # far below its bound


def test_sixteen_concurrent_requests_give_their_solo_text(server):
    jobs = [
        (
            PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
            dict(max_tokens=12 + 3 * i, exclude_input_in_output=True),
        )
        for i in range(16)
    ]
    together = run_concurrently(server.url, "ensemble", jobs)
    for (prompt, params), result in zip(jobs, together, strict=True):
        alone = generate(prompt, url=server.url, **params)
        assert result.error is None and alone.error is None
        assert result.text == alone.text


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_streamed_chunks_join_to_the_non_streamed_text(server, model):
    prompt = PROMPTS[2]
    common = dict(
        max_tokens=40,
        num_draft_tokens=3,
        fixed_num_draft_tokens=True,
        exclude_input_in_output=True,
    )
    streamed = generate(prompt, url=server.url, model=model, stream=True, **common)
    whole = generate(prompt, url=server.url, model=model, stream=False, **common)
    assert streamed.error is None and whole.error is None
    assert len(streamed.chunks) > 1 and len(whole.chunks) == 1
    assert streamed.text == whole.text


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_non_streamed_output_starts_with_the_prompt(server, model):
    prompt = PROMPTS[0]
    full = generate(prompt, url=server.url, model=model, max_tokens=8)
    new = generate(prompt, url=server.url, model=model, max_tokens=8, exclude_input_in_output=True)
    assert full.text == prompt + new.text


@pytest.mark.parametrize(("k", "temperature"), [(1, 0.0), (4, 0.0), (4, 0.9)])
def test_self_draft_accepts_everything(self_draft_server, k, temperature):
    """The target as its own draft: greedy proposals are its argmax, sampled ones its own
    draws (the same noise), so every proposal is accepted."""
    num_passes = 6
    result = generate(
        PROMPTS[3],
        url=self_draft_server.url,
        temperature=temperature,
        seed=5,
        max_tokens=num_passes * (k + 1),
        num_draft_tokens=k,
        fixed_num_draft_tokens=True,
        end_id=-1,
        return_perf_metrics=True,
        return_num_output_tokens=True,
    )
    assert result.error is None, result.error
    metrics = result.metrics
    assert metrics["acceptance_rate"] == 1.0
    assert metrics["total_draft_tokens"] == num_passes * k
    assert metrics["total_accepted_draft_tokens"] == num_passes * k
    assert metrics["num_output_tokens"] == num_passes * (k + 1)  # k + 1 tokens per pass


def test_perf_metrics_cover_the_whole_request(server):
    result = generate(
        PROMPTS[5],
        url=server.url,
        max_tokens=30,
        num_draft_tokens=4,
        fixed_num_draft_tokens=True,
        stream=True,
        return_perf_metrics=True,
    )
    metrics = result.metrics
    assert set(metrics) == set(PERF_OUTPUTS)  # TensorRT-LLM's ten, and only those asked for
    assert metrics["total_draft_tokens"] >= 4 * 5  # several passes, not the last one only
    assert metrics["acceptance_rate"] == pytest.approx(
        metrics["total_accepted_draft_tokens"] / metrics["total_draft_tokens"]
    )


SEEDED = dict(max_tokens=32, temperature=0.9, top_p=0.95, exclude_input_in_output=True)
DRAFTERS = {
    "off": dict(num_draft_tokens=0),
    "draft k=1": dict(proposer="draft_model", num_draft_tokens=1, fixed_num_draft_tokens=True),
    "draft k=4": dict(proposer="draft_model", num_draft_tokens=4, fixed_num_draft_tokens=True),
    "lookup k=8": dict(proposer="ngram", num_draft_tokens=8, fixed_num_draft_tokens=True),
    "suffix k=8": dict(proposer="suffix", num_draft_tokens=8, fixed_num_draft_tokens=True),
    "adaptive": {},
}


def test_seeded_sampling_does_not_depend_on_the_drafter(server):
    """A seeded sampled request gets the same text with speculation off, at k = 1 and 4
    from the draft model, from prompt lookup and adaptively, alone and in a batch of other
    requests (float32: token for token); another seed gets other text."""
    texts: dict[tuple[str, bool], str] = {}
    for name, drafting in DRAFTERS.items():
        alone = generate(PROMPTS[3], url=server.url, seed=1234, **SEEDED, **drafting)
        assert alone.error is None, alone.error
        texts[name, False] = alone.text
        others = [(p, dict(SEEDED, seed=7 + i)) for i, p in enumerate(PROMPTS[:5])]
        batch = run_concurrently(
            server.url, "ensemble", [(PROMPTS[3], dict(SEEDED, seed=1234, **drafting)), *others]
        )
        assert all(r.error is None for r in batch)
        texts[name, True] = batch[0].text
    assert len(set(texts.values())) == 1, texts
    other = generate(PROMPTS[3], url=server.url, seed=99, **SEEDED)
    assert other.text != texts["off", False]


def test_model_control_is_refused(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException, match="(?i)not allowed|explicit"):
        client.unload_model("ensemble")
    assert client.is_model_ready("ensemble")


def test_overload_is_refused_at_once_and_queued_requests_complete(self_draft_server):
    # 8 slots and a queue of 4: of 20 requests sent at once, 8 run, 4 wait, 8 are refused.
    jobs = [
        (f"Count to {i}:", dict(max_tokens=24, num_draft_tokens=2, fixed_num_draft_tokens=True))
        for i in range(20)
    ]
    results = run_concurrently(self_draft_server.url, "speculative_decoding", jobs)
    refused = [r for r in results if r.error is not None]
    served = [r for r in results if r.error is None]
    assert refused, "nothing was refused"
    for result in refused:
        assert "queue full" in result.error.message()
        assert not result.chunks
    assert len(served) >= 12
    assert all(r.text for r in served)


# The ensemble's logit controls (TensorRT-LLM's inputs, specdec/engines/controls.py) and what
# transformers does with the same processing (tests/test_controls.py holds the reference).
CONTROL_PROMPT = (
    "<|im_start|>user\nList the days of the week, twice.<|im_end|>\n<|im_start|>assistant\n"
)
SERVED_CONTROLS = {  # plain decoding answers "Here's a Python function that uses ..."
    "repetition": dict(repetition_penalty=1.3),
    "presence-frequency": dict(presence_penalty=0.8, frequency_penalty=0.5),
    "embedding-bias": dict(embedding_bias_words=[" Python"], embedding_bias_weights=[-6.0]),
    "bad-words": dict(bad_words=[" function that"]),
}


def served_speculation(*proposers: str) -> list[dict]:
    """Fixed k: the draft model at 1, 4 and 8 (if listed), each other proposer at 8."""
    ks = [(k, "draft_model") for k in (1, 4, 8) if "draft_model" in proposers]
    ks += [(8, proposer) for proposer in proposers if proposer != "draft_model"]
    return [dict(num_draft_tokens=k, fixed_num_draft_tokens=True, proposer=p) for k, p in ks]


def test_each_control_through_the_ensemble_equals_transformers_at_every_k(server, hf_target):
    """Every control at k = 0, 1, 4 and 8 (the draft model) and with prompt lookup and the
    suffix store at k = 8, all at once beside rows without controls: transformers' text with
    the same processing. A bias on a token outside the vocabulary is refused by name while
    the others run."""
    from test_controls import MAX_TOKENS, hf_reference

    tokenizer = hf_target[0]
    prompt_ids = tokenizer(CONTROL_PROMPT).input_ids
    python = tokenizer(" Python", add_special_tokens=False).input_ids
    function_that = tokenizer(" function that", add_special_tokens=False).input_ids
    speculation = [dict(num_draft_tokens=0)] + served_speculation("draft_model", "ngram", "suffix")
    common = dict(max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    jobs = [
        (CONTROL_PROMPT, {**common, **inputs, **how})
        for inputs in SERVED_CONTROLS.values()
        for how in speculation
    ]
    jobs += [(CONTROL_PROMPT, {**common, **speculation[3]})] * 2  # no controls
    bad = dict(logit_bias_ids=[10**6], logit_bias_values=[1.0])
    jobs.append((CONTROL_PROMPT, {**common, **bad}))
    results = run_concurrently(server.url, "ensemble", jobs)
    assert results[-1].error is not None and "logit_bias_ids" in str(results[-1].error)
    results = results[:-1]
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    references = {
        "repetition": {"repetition_penalty": 1.3},
        "presence-frequency": {"presence_penalty": 0.8, "frequency_penalty": 0.5},
        "embedding-bias": {"logit_bias": {python[0]: -6.0}},
        "bad-words": {"bad_words_ids": [function_that]},
    }
    plain = tokenizer.decode(
        hf_reference(hf_target, prompt_ids, {}, tokenizer.eos_token_id), skip_special_tokens=True
    )
    assert [r.text for r in results[-2:]] == [plain, plain]
    for i, name in enumerate(SERVED_CONTROLS):
        tokens = hf_reference(hf_target, prompt_ids, references[name], tokenizer.eos_token_id)
        expected = tokenizer.decode(tokens, skip_special_tokens=True)
        assert expected != plain, name
        texts = [r.text for r in results[i * len(speculation) : (i + 1) * len(speculation)]]
        assert texts == [expected] * len(speculation), name


def test_guided_output_through_the_ensemble_equals_transformers_at_every_k(
    server, target_dir, hf_target
):
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide: a JSON schema at
    k = 0, 1, 4 and 8 (the draft model), with prompt lookup, the suffix store and the grammar
    itself at k = 8 and adaptively, beside a row without a guide: transformers' text under
    xgrammar's processor, valid under the schema. A bad schema is refused by name while the
    others run."""
    from jsonschema import validate
    from test_guided import CASES, MAX_TOKENS, PERSON, hf_guided

    from specdec.engines.grammar import Grammars

    tokenizer = hf_target[0]
    guide, question = CASES["json_schema"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    speculation = [dict(num_draft_tokens=0), {}] + served_speculation(
        "draft_model", "ngram", "suffix", "grammar"
    )
    guided = dict(guided_decoding_guide_type=guide.type, guided_decoding_guide=guide.text)
    common = dict(max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    jobs = [(prompt, {**common, **guided, **how}) for how in speculation]
    jobs.append((prompt, {**common, **speculation[3]}))  # no guide
    jobs.append((prompt, {**common, **guided, "guided_decoding_guide": '{"type": "objec'}))
    results = run_concurrently(server.url, "ensemble", jobs)
    assert results[-1].error is not None and "guided_decoding_guide" in str(results[-1].error)
    results = results[:-1]
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    grammars = Grammars.for_tokenizer(str(target_dir), 49_152)
    prompt_ids = tokenizer(prompt).input_ids
    expected = tokenizer.decode(
        hf_guided(hf_target, grammars, prompt_ids, guide), skip_special_tokens=True
    )
    plain = tokenizer.decode(
        hf_guided(hf_target, grammars, prompt_ids, None), skip_special_tokens=True
    )
    assert results[-1].text == plain != expected
    assert [r.text for r in results[:-1]] == [expected] * len(speculation)
    validate(json.loads(expected), PERSON)
