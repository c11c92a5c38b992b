"""An OpenAI-compatible HTTP API over the BLS: /v1/models, /v1/completions and
/v1/chat/completions, whole or streamed as server-sent events (docs/openai.md).

    python -m specdec.openai_api        # `make serve` starts it next to Triton

Environment: OPENAI_HOST (127.0.0.1), OPENAI_PORT (9000), TRITON_HOST (127.0.0.1), GRPC_PORT
(Triton's, 8001), OPENAI_MODEL_NAME (default: the target checkpoint's folder name); API keys
and the per-key limit as specdec/openai_api/auth.py reads them; Triton's inference key and TLS
root certificate as specdec/triton_access.py reads them. A setting that cannot work stops
the start with one line naming it, before any contact with Triton.

Each request is one gRPC stream (tritonclient's asyncio API) to `speculative_decoding`
itself, not the ensemble: an ensemble step never hears of a cancellation, the BLS does. A
client that goes away cancels its stream, and the BLS frees the slots at its next iteration.
The tokenizer (for the chat template) and the context length come from the BLS's config, so
they are those of the target that Triton serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator, Awaitable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import tritonclient.grpc.aio as grpcaio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specdec.client import build_inputs, requested_outputs
from specdec.openai_api.auth import (
    MISSING_KEY_MESSAGE,
    WRONG_KEY_MESSAGE,
    ApiKeys,
    InFlight,
    SettingError,
    bearer_token,
    rate_limit_message,
)
from specdec.openai_api.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    ResponseBuilder,
    StopTrimmer,
    check_supported,
    max_tokens_field,
    triton_error,
    triton_params,
    validation_error,
)
from specdec.openai_api.structured import (
    check_structured,
    guide,
    template_messages,
    tool_choice,
)
from specdec.openai_api.tool_calls import ToolCallParser
from specdec.paths import PROJECT_ROOT
from specdec.serving.settings import MAX_CONTEXT, TARGET_CHECKPOINT
from specdec.text.tokenizer import TextTokenizer, load_tokenizer
from specdec.triton_access import SESSION_HEADER, AccessError, TritonAccess

T = TypeVar("T")


@dataclass
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 9000
    triton_url: str = "127.0.0.1:8001"
    model_name: str | None = None  # None: the target checkpoint's folder name
    bls_model: str = "speculative_decoding"
    keys: ApiKeys = field(default_factory=ApiKeys)  # no key: open
    access: TritonAccess = field(default_factory=TritonAccess)  # how to reach a locked Triton

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ApiConfig:
        """Raises SettingError or AccessError (naming the variable) for a setting that
        cannot work."""
        env = dict(os.environ if env is None else env)
        port, grpc_port = (_port(env, name, default) for name, default in PORTS)
        return cls(
            host=env.get("OPENAI_HOST", "127.0.0.1"),
            port=port,
            triton_url=f"{env.get('TRITON_HOST', '127.0.0.1')}:{grpc_port}",
            model_name=env.get("OPENAI_MODEL_NAME") or None,
            keys=ApiKeys.from_env(env),
            access=TritonAccess.from_env(env),
        )


PORTS = (("OPENAI_PORT", 9000), ("GRPC_PORT", 8001))  # its own, and Triton's gRPC
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _port(env: dict[str, str], name: str, default: int) -> int:
    try:
        port = int(env.get(name) or default)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise SettingError(f"{name}: expected a port number (1-65535), got {env[name]!r}")
    return port


class Backend:
    """The Triton side: one gRPC channel, and what the BLS's config says it serves."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.headers = config.access.headers  # on every call: Triton's inference key
        self.client: grpcaio.InferenceServerClient | None = None
        self.tokenizer: TextTokenizer | None = None
        self.model_name = ""
        self.max_context = 0
        self.triton_inputs: set[str] = set()
        self.created = int(time.time())

    async def start(self, poll_s: float = 1.0) -> None:
        """Waits for the BLS to be ready (Triton may still be loading), then reads its config."""
        await self.wait_ready(poll_s)
        assert self.client is not None  # made by wait_ready
        response = await self.client.get_model_config(
            self.config.bls_model, as_json=True, headers=self.headers
        )
        config = response["config"]
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.max_context = MAX_CONTEXT.read(parameters)  # missing: the declared default
        self.triton_inputs = {tensor["name"] for tensor in config["input"]}
        checkpoint = Path(TARGET_CHECKPOINT.read(parameters))
        if not checkpoint.is_absolute():  # as the BLS resolves it
            checkpoint = Path(os.environ.get("SPECDEC_HOME", PROJECT_ROOT)) / checkpoint
        self.tokenizer = await asyncio.to_thread(load_tokenizer, str(checkpoint))
        self.model_name = self.config.model_name or checkpoint.name.removesuffix(".gguf")
        print(f"openai_api: serving {self.model_name} from {self.config.triton_url}", flush=True)

    async def wait_ready(self, poll_s: float = 1.0) -> None:
        access = self.config.access
        self.client = grpcaio.InferenceServerClient(self.config.triton_url, **access.client_kwargs)
        while not await self.ready():
            await asyncio.sleep(poll_s)

    async def ready(self) -> bool:
        if self.client is None:  # not started
            return False
        try:
            return await self.client.is_model_ready(self.config.bls_model, headers=self.headers)
        except Exception:  # not listening yet: InferenceServerException
            return False

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            message = f"The model `{model}` does not exist (this server has `{self.model_name}`)"
            raise ApiError(404, message, "model", code="model_not_found")


class Generation:
    """One OpenAI request: one gRPC stream to the BLS, and the choices its responses fill."""

    def __init__(
        self,
        backend: Backend,
        body: CompletionRequest | ChatCompletionRequest,
        key_digest: bytes | None = None,  # the caller's API key, as KeyGate matched it
    ) -> None:
        check_supported(body)
        chat_body = body if isinstance(body, ChatCompletionRequest) else None
        chat = chat_body is not None
        if chat_body is not None:
            check_structured(chat_body)
        backend.check_model(body.model)
        prompts, self.max_tokens = _prompts_and_limit(backend, body)
        self.body, self.max_context, self.n = body, backend.max_context, body.n
        with_tools = chat_body is not None and tool_choice(chat_body) != "none"
        self.error_names = (
            backend.triton_inputs,
            "messages" if chat else "prompt",
            max_tokens_field(body),
            "tools" if with_tools else "response_format",  # what the guide came from
        )
        self.choices = [
            Choice(
                b * body.n + s,
                b,
                StopTrimmer(body.stop_words),
                tool_calls=ToolCallParser() if with_tools else None,
            )
            for b in range(len(prompts))
            for s in range(body.n)
        ]
        self.builder = ResponseBuilder(chat, backend.model_name, body.stream and body.include_usage)
        cache_salt = backend.config.keys.cache_salt(key_digest, body.cache_salt)
        params = triton_params(body, self.max_tokens, cache_salt)
        guided = guide(chat_body) if chat_body is not None else None
        if guided is not None:
            params.update(guided.triton_params())
        inputs, outputs = build_inputs(prompts, **params), requested_outputs(**params)

        async def one_request():
            yield {"model_name": backend.config.bls_model, "inputs": inputs, "outputs": outputs}

        # The request iterator ends after one request (half-close); Triton still sends every
        # response, then ends the stream.
        assert backend.client is not None  # started by the app's lifespan
        # `user` keys a conversation: behind the gateway its requests go to one replica,
        # whose KV cache holds their shared prefix (docs/scaling.md, Sessions).
        headers = dict(backend.headers or {})
        if body.user:
            headers[SESSION_HEADER] = body.user
        self.call = backend.client.stream_infer(one_request(), headers=headers or None)

    async def results(self) -> AsyncGenerator[grpcaio.InferResult, None]:
        """The BLS's responses; an error ends them as an ApiError. Leaving early (a client
        gone, an error) cancels the stream."""
        try:
            async for result, error in self.call:
                if error is not None:
                    raise triton_error(error.message(), *self.error_names)
                yield result
        except grpc.aio.AioRpcError as error:
            message = f"Triton unavailable: {error.details()}"
            raise ApiError(503, message, kind="server_error") from error
        finally:
            self.call.cancel()  # no-op once the stream has ended

    def apply(self, result: grpcaio.InferResult) -> tuple[Choice, list[dict]]:
        """Adds one response to its choice; returns the choice and the deltas it may send."""
        batch_index = int(result.as_numpy("batch_index")[0][0])
        sequence_index = int(result.as_numpy("sequence_index")[0][0])
        choice = self.choices[batch_index * self.n + sequence_index]
        choice.num_input_tokens = int(result.as_numpy("num_input_tokens")[0][0])
        choice.num_output_tokens = int(result.as_numpy("num_output_tokens")[0][0])
        return choice, choice.add(result.as_numpy("text_output")[0].decode("utf-8"))

    def finish_reason(self, choice: Choice) -> str:
        return choice.finish_reason(self.max_tokens, self.max_context)

    async def whole(self) -> dict:
        async for result in self.results():
            self.apply(result)
        for choice in self.choices:
            choice.finish()
        return self.builder.whole(self.choices, self.max_tokens, self.max_context)

    async def events(
        self,
        results: AsyncGenerator[grpcaio.InferResult, None],
        first: grpcaio.InferResult | None,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events from the first response on: text chunks as they come, each
        choice's finish_reason once the stream has ended, usage if asked, then [DONE]."""
        try:
            result = first
            while result is not None:
                choice, deltas = self.apply(result)
                for delta in deltas:
                    yield _sse(self.builder.chunk(choice, delta))
                result = await anext(results, None)
            for choice in self.choices:
                *deltas, last = choice.finish() or [{}]
                for delta in deltas:
                    yield _sse(self.builder.chunk(choice, delta))
                yield _sse(self.builder.chunk(choice, last, self.finish_reason(choice)))
            if self.builder.include_usage:
                yield _sse(self.builder.usage_chunk(self.choices))
        except ApiError as error:  # after the headers went out: an error event
            yield _sse(error.body())
        finally:
            await results.aclose()  # a client gone: cancels the stream
        yield "data: [DONE]\n\n"


def _prompts_and_limit(
    backend: Backend, body: CompletionRequest | ChatCompletionRequest
) -> tuple[list[str], int]:
    """The BLS's prompts (chat: the target's template applied) and max_tokens."""
    if isinstance(body, ChatCompletionRequest):
        messages = template_messages(body)
        limit = body.max_completion_tokens or body.max_tokens or backend.max_context
        assert backend.tokenizer is not None  # started by the app's lifespan
        return [backend.tokenizer.apply_chat_template(messages)], limit
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    return prompts, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class Interrupted(Exception):
    pass


class ClientGone(Interrupted):
    pass


async def unless(work: Awaitable[T], interruption: Awaitable[object]) -> T:
    """Awaits `work`; when `interruption` ends first, cancels it and raises Interrupted."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(interruption)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise Interrupted
    return task.result()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelled if the client disconnects first: uvicorn does not cancel a
    handler whose client has gone (a streamed response notices by itself)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        return await unless(work, disconnected())
    except Interrupted:
        raise ClientGone from None


async def serve(generation: Generation, request: Request) -> Response:
    if not generation.body.stream:
        return JSONResponse(await unless_disconnected(request, generation.whole()))
    # Wait for the first response before the headers: the BLS's validation errors arrive as
    # HTTP 400, not as an event of a 200 stream.
    results = generation.results()
    first = await unless_disconnected(request, anext(results, None))
    return _ClosingStream(generation.events(results, first), media_type="text/event-stream")


class _ClosingStream(StreamingResponse):
    """Closes its generator however the response ends: a disconnect that lands while it waits
    on a send would otherwise leave the stream open until garbage collection."""

    def __init__(self, content: AsyncGenerator[str, None], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._content = content  # body_iterator, typed as a generator

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()


class KeyGate:
    """ASGI middleware: with keys configured, every path but /health needs `Authorization:
    Bearer <a configured key>` (else 401), and a key's requests in flight are bounded (beyond:
    429). A refused request goes no further. The slot is taken before the app sees the request
    and given back once its response has ended, whatever ended it (the whole body or the
    last event sent, a client gone, an exception)."""

    OPEN_PATHS = ("/health",)
    KEY_STATE = "api_key_digest"  # where the app finds the matched key: request.state

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys
        self.in_flight = InFlight(keys.max_concurrent)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.required or scope["path"] in self.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = bearer_token(dict(scope["headers"]).get(b"authorization"))
        key = None if presented is None else self.keys.match(presented)
        if key is None:
            message = MISSING_KEY_MESSAGE if presented is None else WRONG_KEY_MESSAGE
            error = ApiError(401, message, code="invalid_api_key")
        elif self.in_flight.take(key):
            scope.setdefault("state", {})[self.KEY_STATE] = key  # the request's cache salt
            try:
                await self.app(scope, receive, send)
            finally:
                self.in_flight.give(key)
            return
        else:
            assert self.keys.max_concurrent is not None  # take() refuses only under a limit
            message = rate_limit_message(self.keys.max_concurrent)
            error = ApiError(429, message, kind="requests", code="rate_limit_exceeded")
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def create_app(config: ApiConfig) -> FastAPI:
    backend = Backend(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await backend.start()
        yield
        await backend.close()

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(KeyGate, keys=config.keys)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        return await api_error(_request, validation_error(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return await api_error(_request, ApiError(error.status_code, str(error.detail)))

    @app.exception_handler(ClientGone)
    async def gone(_request: Request, _error: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await backend.ready() else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict:
        backend.check_model(model)
        return _model_card(backend)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(Generation(backend, body, _key_digest(request)), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve(Generation(backend, body, _key_digest(request)), request)

    return app


def _key_digest(request: Request) -> bytes | None:
    """The key KeyGate matched for this request; None on an open API."""
    return getattr(request.state, KeyGate.KEY_STATE, None)


def _model_card(backend: Backend) -> dict:
    return {
        "id": backend.model_name,
        "object": "model",
        "created": backend.created,
        "owned_by": "specdec",
        "max_model_len": backend.max_context,
    }


def run(config: ApiConfig) -> None:
    print(f"openai_api on http://{config.host}:{config.port}/v1 (Triton {config.triton_url})")
    print(f"openai_api: {config.keys.describe()}")
    sys.stdout.flush()
    # Streams still open at shutdown are cut after 8 s (which cancels their generations):
    # under `make serve` Triton ends each one sooner with an error that goes out as an
    # event (its drain; at the latest the launcher ends Triton 7 s after the signal).
    uvicorn_config = uvicorn.Config(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=8,
    )
    # uvicorn passes a SIGINT on (KeyboardInterrupt) once it has shut down, as for SIGTERM.
    with suppress(KeyboardInterrupt):
        asyncio.run(serve_when_ready(config, uvicorn.Server(uvicorn_config)))


async def serve_when_ready(config: ApiConfig, server: uvicorn.Server) -> None:
    """Serves once Triton is ready; SIGINT or SIGTERM before then ends it at once. (uvicorn
    hears a signal during the application's start-up, which waits for Triton, only when the
    start-up has returned: a Triton that was gone kept this process waiting forever.)"""
    probe = Backend(config)
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, signalled.set)
    try:
        await unless(probe.wait_ready(), signalled.wait())
    except Interrupted:
        return
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            signal.signal(signum, handler)  # asyncio would leave SIGINT a KeyboardInterrupt
        await probe.close()
    await server.serve()  # its own start-up now finds Triton ready


def main() -> None:
    try:
        config = ApiConfig.from_env()
    except (SettingError, AccessError) as error:
        sys.exit(f"openai_api: {error}")  # exit status 1, the one line on stderr
    run(config)


if __name__ == "__main__":
    main()
