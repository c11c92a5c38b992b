"""A distilled draft as a transformers model, for `generate(assistant_model=...)`.

The draft's head scores a subset of the vocabulary (`draft.head_token_ids`); transformers
expects full-vocabulary logits, so this wrapper scatters them, -inf elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.engines.llama import HEAD_TOKEN_IDS, read_safetensors


class ReducedHeadLlama(LlamaForCausalLM):
    def __init__(self, config: LlamaConfig, head_size: int) -> None:
        super().__init__(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, head_size, bias=False)
        self.register_buffer("head_token_ids", torch.zeros(head_size, dtype=torch.long))

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        head_logits = self.lm_head(hidden)  # (B, T, head size)
        logits = head_logits.new_full(
            (*head_logits.shape[:2], self.config.vocab_size), float("-inf")
        )
        logits[..., self.head_token_ids] = head_logits
        return CausalLMOutputWithPast(logits=logits, cache=out.cache)


def load_hf_draft(path: str | Path) -> LlamaForCausalLM:
    """A transformers model from a checkpoint directory: reduced head or plain."""
    path = Path(path)
    weights = read_safetensors(path)
    if HEAD_TOKEN_IDS not in weights:
        return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    config = LlamaConfig.from_pretrained(str(path))
    head_ids = weights.pop(HEAD_TOKEN_IDS).long()
    model = ReducedHeadLlama(config, len(head_ids))
    missing, unexpected = model.load_state_dict(
        {**{k: v.float() for k, v in weights.items()}, "head_token_ids": head_ids}, strict=False
    )
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
    return model.eval()
