"""RoPE frequencies (llama.rope_inv_freq) against transformers', with Llama 3 scaling."""

from __future__ import annotations

import pytest
import torch

from specdec.engines.llama import LlamaConfig, rope_inv_freq

LLAMA_32_1B = {  # the rope-relevant part of meta-llama/Llama-3.2-1B-Instruct's config.json
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def transformers_inv_freq(hf: dict) -> torch.Tensor:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = HFLlamaConfig(**hf)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        c = LlamaConfig.from_hf(hf)
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponents)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]


@pytest.mark.parametrize(
    "scaling",
    [
        LLAMA_32_1B["rope_scaling"],
        {**LLAMA_32_1B["rope_scaling"], "factor": 8.0},  # Llama 3.1 8B
        {"rope_type": "linear", "factor": 4.0},
        None,
    ],
    ids=["llama3.2", "llama3.1", "linear", "none"],
)
def test_inverse_frequencies_match_transformers(scaling):
    hf = {**LLAMA_32_1B, "rope_scaling": scaling}
    ours = rope_inv_freq(LlamaConfig.from_hf(hf))
    torch.testing.assert_close(ours, transformers_inv_freq(hf).float(), rtol=1e-6, atol=0)
    if scaling is not None:  # the scaling changes the frequencies it should
        assert not torch.allclose(
            ours, rope_inv_freq(LlamaConfig.from_hf({**hf, "rope_scaling": None}))
        )


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf({**LLAMA_32_1B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
