"""The target's tokenizer, as every model and client of the project uses it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path


class TextTokenizer:
    def __init__(self, checkpoint: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        self.eos_token_id: int = self._tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def apply_chat_template(self, conversation: str | list[dict[str, str]]) -> str:
        """The model's prompt for one user message, or for a list of {"role", "content"}
        messages; ends with the assistant's turn opened."""
        if isinstance(conversation, str):
            conversation = [{"role": "user", "content": conversation}]
        prompt = self._tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(prompt, str)  # tokenize=False: the text, not its ids
        return prompt


@lru_cache(maxsize=4)
def load_tokenizer(checkpoint: str) -> TextTokenizer:
    return TextTokenizer(checkpoint)
