"""build/graph_engine_bytes.py: the bytes GraphEngine's own forward writes per call, counted
on the meta device, must match the shapes (one padded gather, the append, no logits copy, no
host copy), and a copy to the host must show up when there is one."""

from __future__ import annotations

from build.graph_engine_bytes import MeteredEngine, count_call
from specdec.engines.llama import LlamaConfig

CONFIG = LlamaConfig(
    vocab_size=1000,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
PER_POSITION = 2 * 3 * 2 * 8 * 4  # keys and values, 3 layers, 2 heads of 8, float32


def test_a_call_writes_one_padded_gather_and_its_append():
    counted = count_call(CONFIG, rows=4, k=2, context=16, spread=False, dtype="float32")
    past, new = 4 * 16 * PER_POSITION, 4 * 3 * PER_POSITION
    index_bytes = 256  # the few int64 indices the engine makes on its device
    assert past <= counted["gather"] <= past + index_bytes  # every row's past, once
    assert 2 * new <= counted["append"] <= 2 * new + index_bytes  # packed, then into the slots
    assert counted["logits"] == counted["to_host"] == 0  # the graph's output itself
    assert counted["in_place_read"] == past
    spread = count_call(CONFIG, rows=4, k=2, context=16, spread=True, dtype="float32")
    assert spread["gather"] == counted["gather"]  # padded to the longest row
    assert spread["in_place_read"] == (4 + 8 + 12 + 16) * PER_POSITION


def test_a_copy_to_the_host_is_counted(monkeypatch):
    """Negative control: an engine that copies its logits to the host, as the TensorRT
    engine did, shows them in the to-host column."""

    def to_host(self, logits):
        return logits.cpu()

    monkeypatch.setattr(MeteredEngine, "_full_vocabulary", to_host)
    counted = count_call(CONFIG, 4, 0, 16, False, "float32")
    assert counted["to_host"] == 4 * CONFIG.vocab_size * 4
