"""The text side: tokenizer, incremental detokenizer, request validation."""
