"""draft_model and target_model, called on their own: their calls run on the engines that
speculative_decoding holds (one process, one copy of the weights) and answer what the same
call answers in process."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from specdec.client import generate
from specdec.engines.calls import run_draft, run_target
from specdec.engines.llama import LlamaEngine
from specdec.engines.wire import (
    EngineBatch,
    EngineResult,
    decode_call,
    decode_result,
    encode_call,
    encode_result,
)
from specdec.harness import ManagedServer

NUM_SLOTS, MAX_CONTEXT = 4, 256


@pytest.fixture(scope="module")
def engine_server(target_dir):
    """A server of its own: the calls below write into its slots."""
    running = ManagedServer(
        "test-engine-models",
        {"NUM_SLOTS": str(NUM_SLOTS), "MAX_CONTEXT": str(MAX_CONTEXT), "DTYPE": "float32"},
    )
    yield running
    running.stop()


def batch(prompt: list[int], num_steps: int, slot: int) -> EngineBatch:
    """One greedy row feeding `prompt` into an empty slot."""
    return EngineBatch(
        input_ids=np.array(prompt, dtype=np.int64),
        input_lengths=np.array([len(prompt)], dtype=np.int32),
        slot_ids=np.array([slot], dtype=np.int32),
        cache_lengths=np.array([0], dtype=np.int32),
        num_steps=np.array([num_steps], dtype=np.int32),
        temperature=np.zeros(1, dtype=np.float32),
        top_k=np.zeros(1, dtype=np.int32),
        top_p=np.ones(1, dtype=np.float32),
        end_ids=np.array([-1], dtype=np.int32),
        min_tokens_left=np.zeros(1, dtype=np.int32),
        seeds=np.zeros(1, dtype=np.int64),
    )


def served(url: str, model: str, call: EngineBatch) -> EngineResult:
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, array in call.to_arrays().items():
        tensor = grpcclient.InferInput(name, list(array.shape), _triton_type(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer(model, inputs)
    client.close()
    return EngineResult(
        token_ids=result.as_numpy("token_ids"), hindsight_hits=result.as_numpy("hindsight_hits")
    )


def _triton_type(array: np.ndarray) -> str:
    return {np.int64: "INT64", np.int32: "INT32", np.float32: "FP32"}[array.dtype.type]


@pytest.mark.server
@pytest.mark.parametrize("model", ["target_model", "draft_model"])
def test_a_direct_engine_call_answers_what_the_engine_answers_in_process(
    engine_server, target_dir, model
):
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30]
    call = batch(prompt, num_steps=3 if model == "target_model" else 4, slot=NUM_SLOTS - 1)
    checkpoint = target_dir if model == "target_model" else target_dir.parent / "smollm2-135m-draft"
    engine = LlamaEngine.from_checkpoint(checkpoint, NUM_SLOTS, MAX_CONTEXT)
    expected = (run_target if model == "target_model" else run_draft)(engine, call)
    answer = served(engine_server.url, model, call)
    np.testing.assert_array_equal(answer.token_ids, expected.token_ids)
    assert (answer.token_ids >= 0).all()


@pytest.mark.server
def test_a_bad_engine_call_is_refused_and_the_server_serves_on(engine_server):
    bad = batch([1, 2, 3], num_steps=9, slot=0)  # more logits than tokens fed
    with pytest.raises(Exception, match="target engine: .*does not fit"):
        served(engine_server.url, "target_model", bad)
    later = generate("Hello", url=engine_server.url, model="speculative_decoding", max_tokens=4)
    assert later.error is None and later.text


def test_an_engine_call_round_trips_and_a_malformed_one_names_the_field():
    call = batch([5, 6, 7], num_steps=2, slot=1)
    role, decoded = decode_call(encode_call("draft", call))
    assert role == "draft"
    for name, array in call.to_arrays().items():
        np.testing.assert_array_equal(decoded.to_arrays()[name], array)
    result = EngineResult(token_ids=np.array([[4, -1]], dtype=np.int32))
    np.testing.assert_array_equal(decode_result(encode_result(result)).token_ids, result.token_ids)
    with pytest.raises(ValueError, match="engine_call: not an encoded engine call"):
        decode_call(b"not an engine call")
    with pytest.raises(ValueError, match="engine role 'verify'"):
        encode_call("verify", call)


def test_work_on_a_passing_thread_returns_or_raises_on_the_caller():
    import threading

    from specdec.engines.calls import on_a_passing_thread

    assert on_a_passing_thread(lambda: threading.current_thread().name) == "specdec-engine-work"
    with pytest.raises(ValueError, match="bad setting"):
        on_a_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad setting")))
