"""The OpenAI-compatible HTTP API in front of the BLS (docs/openai.md).

    python -m specdec.openai_api        # `make serve` starts it next to Triton

- `app.py`: the service: /v1/models, /v1/completions, /v1/chat/completions, whole or streamed
  as server-sent events, each request one gRPC stream to `speculative_decoding`;
- `protocol.py`: OpenAI's request and response formats, validated and built;
- `auth.py`: who may call it: API keys and a bound on requests in flight per key.
"""
