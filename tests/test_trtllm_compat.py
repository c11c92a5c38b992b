"""TensorRT-LLM's clients, unchanged: requests built and responses read the way its
inflight_batcher_llm/client/end_to_end_grpc_client.py does (every input [B, 1], outputs
requested by name, `as_numpy("text_output")[0].decode()`, `as_numpy(name)[0][0]`), against
the real server."""

from __future__ import annotations

import queue
import re
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from specdec.client import PERF_OUTPUTS, generate
from specdec.paths import PROJECT_ROOT

pytestmark = pytest.mark.server


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    CHAT.format("List three uses of copper."),
    CHAT.format("What is the capital of Italy?"),
    CHAT.format("Name two planets."),
]
TYPES = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}
TYPE_OF_INPUT = {"random_seed": ("UINT64", np.uint64)}  # where it is not TYPES' default
PERF = list(PERF_OUTPUTS)  # TensorRT-LLM's ten perf outputs
ALL_OUTPUTS = [
    "text_output",
    "cum_log_probs",
    "output_log_probs",
    "context_logits",
    "generation_logits",
    "batch_index",
    "sequence_index",
    *PERF,
    "num_input_tokens",
    "num_output_tokens",
]


def stacked_inputs(prompts: list[str], **params) -> list[grpcclient.InferInput]:
    """As its client's --batch-inputs: each prompt's [1, 1] inputs concatenated on axis 0."""
    tensors = [("text_input", "BYTES", np.array([[p.encode()] for p in prompts], np.object_))]
    for name, value in params.items():
        triton_type, dtype = TYPE_OF_INPUT.get(name, TYPES[type(value)])
        tensors.append((name, triton_type, np.full((len(prompts), 1), value, dtype=dtype)))
    inputs = []
    for name, triton_type, array in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def infer(url, prompts, outputs, model="ensemble", **params):
    """Sends one request on a stream and waits for its end (stop_stream); returns the
    results and errors in arrival order."""
    received = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer(
        model,
        stacked_inputs(prompts, **params),
        outputs=[grpcclient.InferRequestedOutput(name) for name in outputs],
    )
    client.stop_stream()
    client.close()
    return [received.get() for _ in range(received.qsize())]


def texts_by_index(responses, streaming: bool) -> dict[tuple[int, int], str]:
    """Reassembles as its client does: by batch_index and sequence_index (0 if absent)."""
    texts: dict[tuple[int, int], str] = {}
    for result, error in responses:
        assert error is None, error.message()
        batch_index = result.as_numpy("batch_index")
        batch_index = 0 if batch_index is None else batch_index[0][0]
        seq_index = result.as_numpy("sequence_index")
        seq_index = 0 if seq_index is None else seq_index[0][0]
        output = result.as_numpy("text_output")
        assert output.shape == (1,)  # 1-D: one element, the response's one sequence
        key = (int(batch_index), int(seq_index))
        if streaming:
            texts[key] = texts.get(key, "") + output[0].decode("utf-8")
        else:
            assert key not in texts, "one non-streamed response per sequence"
            texts[key] = output[0].decode("utf-8")
    return texts


def greedy_alone(url, prompt, max_tokens):
    result = generate(prompt, url=url, max_tokens=max_tokens, exclude_input_in_output=True)
    assert result.error is None, result.error
    return result.text


@pytest.mark.parametrize("streaming", [False, True])
def test_text_output_reads_as_its_clients_read_it(server, streaming):
    prompt = PROMPTS[1]
    # k = 0: one token per iteration, so a streamed answer comes in several responses. With
    # speculation the suffix store may already hold this very answer (greedy_alone's, from
    # the other case), and one verify then rightly commits all of it in one response.
    responses = infer(
        server.url, [prompt], ["text_output"], max_tokens=16, stream=streaming, num_draft_tokens=0
    )
    assert len(responses) >= (2 if streaming else 1)
    text = texts_by_index(responses, streaming)[(0, 0)]
    expected = greedy_alone(server.url, prompt, 16)
    # Non-streamed text starts with the prompt (exclude_input_in_output false); chunks do not.
    assert text == (expected if streaming else prompt + expected)


def test_perf_outputs_on_every_streamed_response(server):
    prompt = PROMPTS[0]
    responses = infer(
        server.url,
        [prompt],
        ["text_output", *PERF, "num_input_tokens", "num_output_tokens"],
        max_tokens=24,
        stream=True,
        return_perf_metrics=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    last_token_times = []
    for result, error in responses:
        assert error is None, error.message()
        values = {name: result.as_numpy(name)[0][0] for name in PERF}  # each [1, 1]
        assert result.as_numpy("arrival_time_ns").dtype == np.int64
        assert result.as_numpy("acceptance_rate").dtype == np.float32
        assert result.as_numpy("kv_cache_alloc_total_blocks").dtype == np.int32
        assert (
            0
            < values["arrival_time_ns"]
            <= values["first_scheduled_time_ns"]
            <= values["first_token_time_ns"]
            <= values["last_token_time_ns"]
        )
        last_token_times.append(values["last_token_time_ns"])
    assert last_token_times == sorted(last_token_times)
    final = responses[-1][0]
    num_input = int(final.as_numpy("num_input_tokens")[0][0])
    num_output = int(final.as_numpy("num_output_tokens")[0][0])
    assert num_output == 24
    # The target slot holds the prompt and every output token but the newest (never fed).
    assert final.as_numpy("kv_cache_alloc_total_blocks")[0][0] == num_input + num_output - 1
    assert final.as_numpy("kv_cache_reused_blocks")[0][0] == 0
    assert final.as_numpy("kv_cache_alloc_new_blocks")[0][0] == num_input + num_output - 1
    drafted = final.as_numpy("total_draft_tokens")[0][0]
    accepted = final.as_numpy("total_accepted_draft_tokens")[0][0]
    assert 0 <= accepted <= drafted
    rate = final.as_numpy("acceptance_rate")[0][0]
    assert rate == pytest.approx(accepted / drafted if drafted else 0.0)


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_every_declared_output_can_be_requested(server, model):
    responses = infer(
        server.url,
        [PROMPTS[2]],
        ALL_OUTPUTS,
        model=model,
        max_tokens=4,
        return_log_probs=True,
        return_perf_metrics=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    (result, error) = responses[-1]
    assert error is None, error
    shapes = {name: result.as_numpy(name).shape for name in ALL_OUTPUTS}
    assert shapes["text_output"] == (1,)
    assert shapes["cum_log_probs"] == (1, 1)
    assert shapes["output_log_probs"] == (1, 1, 4)
    assert shapes["context_logits"] == (1, 1, 1)  # documented zeros: not computed here
    assert shapes["generation_logits"] == (1, 1, 1, 1)
    others = set(ALL_OUTPUTS) - {
        "text_output",
        "cum_log_probs",
        "output_log_probs",
        "context_logits",
        "generation_logits",
    }
    assert all(shapes[name] == (1, 1) for name in others)


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_batch_of_three_prompts_reassembles_by_batch_index(server, model, streaming):
    responses = infer(
        server.url,
        PROMPTS,
        ["text_output", "batch_index"],
        model=model,
        max_tokens=20,
        stream=streaming,
        exclude_input_in_output=True,
    )
    texts = texts_by_index(responses, streaming)
    assert sorted(texts) == [(0, 0), (1, 0), (2, 0)]
    for i, prompt in enumerate(PROMPTS):
        assert texts[(i, 0)] == greedy_alone(server.url, prompt, 20), i
    if streaming:  # the prompts ran side by side: their chunks interleave
        order = [int(r.as_numpy("batch_index")[0][0]) for r, _ in responses]
        first_of_0, last_of_0 = order.index(0), len(order) - 1 - order[::-1].index(0)
        assert set(order[first_of_0:last_of_0]) - {0}, order


@pytest.mark.parametrize("streaming", [False, True])
def test_return_sequences_reassemble_by_sequence_index(server, streaming):
    prompt = PROMPTS[0]
    num_input = len(generate(prompt, url=server.url, max_tokens=1).text) and None  # warm
    responses = infer(
        server.url,
        [prompt],
        ["text_output", "sequence_index", "kv_cache_reused_blocks", "num_input_tokens"],
        max_tokens=32,
        stream=streaming,
        num_return_sequences=2,
        temperature=1.0,
        random_seed=7,
        exclude_input_in_output=True,
        return_perf_metrics=True,
        return_num_input_tokens=True,
    )
    texts = texts_by_index(responses, streaming)
    assert sorted(texts) == [(0, 0), (0, 1)]
    assert all(texts.values())
    assert texts[(0, 0)] != texts[(0, 1)]  # independent draws
    reused = {}
    for result, _ in responses:
        index = int(result.as_numpy("sequence_index")[0][0])
        reused[index] = int(result.as_numpy("kv_cache_reused_blocks")[0][0])
        num_input = int(result.as_numpy("num_input_tokens")[0][0])
    # The prompt was computed once: the second sequence copied all of it but the last token.
    assert reused == {0: 0, 1: num_input - 1}


def test_greedy_return_sequences_equal_the_single_greedy_text(server):
    """Greedy copies are the same sequence: equal only if the copied cache is right."""
    prompt = PROMPTS[2]
    responses = infer(
        server.url,
        [prompt, PROMPTS[1]],
        ["text_output", "batch_index", "sequence_index"],
        max_tokens=24,
        num_return_sequences=3,
        exclude_input_in_output=True,
    )
    texts = texts_by_index(responses, streaming=False)
    assert len(texts) == 6
    for batch_index, p in enumerate([prompt, PROMPTS[1]]):
        expected = greedy_alone(server.url, p, 24)
        assert [texts[(batch_index, s)] for s in range(3)] == [expected] * 3


def test_log_probs_do_not_depend_on_speculation(server):
    """Greedy float32: the target's log-probabilities of the emitted tokens, the same at
    k = 0 and k = 4 (a 5-token verify rounds a little differently from one-token steps)."""
    by_k = {}
    for k in (0, 4):
        result = generate(
            PROMPTS[0],
            url=server.url,
            max_tokens=32,
            num_draft_tokens=k,
            fixed_num_draft_tokens=True,
            return_log_probs=True,
            return_num_output_tokens=True,
            stream=True,
        )
        assert result.error is None, result.error
        assert len(result.output_log_probs) == result.metrics["num_output_tokens"] == 32
        assert result.metrics["cum_log_probs"] == pytest.approx(sum(result.output_log_probs))
        by_k[k] = (result.text, np.array(result.output_log_probs))
    assert by_k[0][0] == by_k[4][0]
    np.testing.assert_allclose(by_k[0][1], by_k[4][1], atol=1e-4)
    assert (by_k[0][1] <= 0).all() and by_k[0][1].min() < -1e-3  # not all certain


def test_sampled_log_probs_are_those_of_the_distribution_sampled_from(server):
    """top_k 1 leaves one token per position: each emitted token has probability 1."""
    result = generate(
        PROMPTS[1],
        url=server.url,
        max_tokens=12,
        temperature=0.7,
        top_k=1,
        seed=3,
        return_log_probs=True,
        return_num_output_tokens=True,
    )
    assert result.error is None, result.error
    assert len(result.output_log_probs) == result.metrics["num_output_tokens"] > 0
    np.testing.assert_allclose(result.output_log_probs, 0.0, atol=1e-6)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"beam_width": 2}, "beam_width"),
        ({"num_return_sequences": 0}, "num_return_sequences"),
        ({"num_return_sequences": 1000}, "num_return_sequences"),
        ({"return_context_logits": True}, "return_context_logits"),
        ({"return_generation_logits": True}, "return_generation_logits"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 2.0}, "min_p"),
        ({"length_penalty": 1.5}, "length_penalty"),
    ],
)
@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_bad_values_are_refused_by_name_and_the_server_stays_up(server, params, field, model):
    params = {"max_tokens": 8, **params}
    responses = infer(server.url, PROMPTS[:2], ["text_output"], model=model, **params)
    assert len(responses) == 1
    result, error = responses[0]
    assert result is None and error is not None
    assert field in error.message(), error.message()
    assert server.ready
    assert greedy_alone(server.url, PROMPTS[2], 4)


def test_the_stream_client_prints_every_sequence_with_its_log_probs(server):
    """clients/stream_client.py, as the README runs it: two sampled sequences of one prompt."""
    command = [
        sys.executable,
        str(PROJECT_ROOT / "clients" / "stream_client.py"),
        "--url",
        server.url,
        "--chat",
        "Name two planets.",
        "--max-tokens",
        "12",
        "--temperature",
        "1.0",
        "--seed",
        "5",
        "--num-return-sequences",
        "2",
        "--log-probs",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    headers = re.findall(
        r"^--- sequence (\d) \((\d+) tokens, cum_log_probs (-?[\d.]+)\)$", run.stdout, flags=re.M
    )
    assert [h[0] for h in headers] == ["0", "1"], run.stdout
    assert all(int(tokens) > 0 and float(value) < 0 for _, tokens, value in headers)


def test_penalties_sent_as_its_client_sends_them_apply_to_each_prompt(server):
    """repetition, presence and frequency penalties as [B, 1] FP32 beside three prompts (its
    client's --batch-inputs): each prompt's text is what it gets alone with the same
    penalties, and differs from its text without them."""
    penalties = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4)
    responses = infer(
        server.url,
        PROMPTS,
        ["text_output", "batch_index"],
        max_tokens=24,
        exclude_input_in_output=True,
        **penalties,
    )
    texts = texts_by_index(responses, streaming=False)
    for index, prompt in enumerate(PROMPTS):
        alone = generate(
            prompt, url=server.url, max_tokens=24, exclude_input_in_output=True, **penalties
        )
        assert alone.error is None and texts[index, 0] == alone.text
    assert any(texts[i, 0] != greedy_alone(server.url, p, 24) for i, p in enumerate(PROMPTS))
