"""The HTTP application of `hexq serve` (FastAPI on uvicorn): OpenAI-compatible completions and chat completions,
streamed as server-sent events or not, the model list, health and Prometheus metrics.

Safety. `Guard`, a plain ASGI middleware in front of everything, refuses a request without the API key (when the
server has one; /health stays open for liveness probes), a body past `max_body_bytes` (by its Content-Length, or
counted as it arrives), and counts every answer by endpoint and status. Bodies are parsed here (not by FastAPI) so
that every malformed request - bad JSON, a wrong type, an unknown field, a prompt past the context - gets one 400
line in the OpenAI error shape, and an unexpected failure a 500 line without a traceback; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hexq.base.errors import HexqError
from hexq.runtime.sampling import Sampling
from hexq.serve.api import (
    ChatRequest,
    CompletionRequest,
    chat_chunk,
    completion_chunk,
    error_body,
    new_id,
    now,
    usage,
)
from hexq.serve.metrics import CONTENT_TYPE, Metrics
from hexq.serve.worker import Job, QueueFull, Worker

log = logging.getLogger("hexq.serve")
OPEN_PATHS = ("/health",)
UNION_TAGS = ("str", "int", "float", "bool", "dict", "list")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            503: "server_overloaded", 500: "server_error"}.get(status, "invalid_request_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


class Guard:
    """API key, body size and request counting in front of the app (see the module docstring)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics) -> None:
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status = {"code": 500}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            received = 0

            async def limited_receive():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body_bytes:
                        raise ApiError(413, f"the request body is past the limit of {self.max_body_bytes} bytes "
                                            "(--max-body)")
                return message

            try:
                await self.app(scope, limited_receive, counted_send)
            except ApiError as exc:
                await error_response(exc.status, exc.message)(scope, receive, counted_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _refusal(self, scope) -> Response | None:
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return error_response(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                      "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, f"Content-Length {length[:32]!r} is not a number")
            if int(length) > self.max_body_bytes:
                return error_response(413, f"the request body ({length} bytes) is past the limit of "
                                           f"{self.max_body_bytes} bytes (--max-body)")
        return None


def create_app(runtime, *, model_name: str, api_key: str | None = None, max_queue: int = 64,
               max_body_bytes: int = 1 << 20, chat_template: str | None = None,
               startup_rss: int | None = None):
    """The ASGI application serving `runtime` (a hexq.runtime.engine.Runtime) under `model_name`; returns
    (the app, its worker) - close the worker when the server stops."""
    tokenizer = runtime.tokenizer
    template = chat_template or getattr(tokenizer, "chat_template", None)
    tokenizer_lock = threading.Lock()  # the worker decodes while requests are tokenized
    worker = Worker(runtime, max_queue, tokenizer_lock=tokenizer_lock)
    metrics = Metrics(runtime, worker, startup_rss)
    worker.observer = metrics.observe
    app = FastAPI(title="hexq", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        message = {404: "no such endpoint", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}")

    async def parse(request: Request, model):
        body = await request.body()
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            # a union's member is named in the location ("prompt.list[int]"): the field is what the client knows
            where = ".".join(str(part) for part in first["loc"] if str(part) not in UNION_TAGS and "[" not in
                             str(part)) or "body"
            raise ApiError(400, f"{where}: {first['msg']}", "invalid_value", where) from None
        unsupported = parsed.unsupported()
        if unsupported:
            raise ApiError(400, f"not supported by hexq serve: {', '.join(unsupported)}", "unsupported",
                           unsupported[0])
        if parsed.model is not None and parsed.model != model_name:
            raise ApiError(404, f"model {parsed.model!r} is not served here; this server serves {model_name!r}",
                           "model_not_found", "model")
        return parsed

    def encode(text: str, chat: bool = False) -> list[int]:
        """A prompt's ids as `hexq run` makes them; a rendered chat template's without added special tokens (the
        template writes its own)."""
        with tokenizer_lock:
            return tokenizer(text, add_special_tokens=False).input_ids if chat else runtime.encode(text)

    def start(request_body, ids: list[int], max_tokens: int) -> Job:
        try:
            runtime.check_length(len(ids), max_tokens)
        except HexqError as exc:
            raise ApiError(400, str(exc), "context_length_exceeded", "max_tokens") from None
        seed = request_body.seed if request_body.seed is not None else secrets.randbits(63)
        sampling = Sampling(request_body.temperature, request_body.top_p, max(request_body.top_k, 0), seed)
        job = Job(ids, max_tokens, sampling, tuple(request_body.stop or ()), asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", "queue_full") from None
        return job

    async def collect(job: Job, request: Request) -> tuple[str, str, int] | None:
        """(text, finish reason, completion tokens) of a non-streamed job; None when the client left (the job is
        cancelled)."""
        gone = asyncio.create_task(_disconnected(request))
        pieces: list[str] = []
        try:
            while True:
                getter = asyncio.create_task(job.events.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    job.cancelled.set()
                    return None
                event = getter.result()
                if event[0] == "text":
                    pieces.append(event[1])
                elif event[0] == "done":
                    return "".join(pieces), event[1], event[2]
                else:
                    raise ApiError(500, event[1])
        finally:
            gone.cancel()
            job.cancelled.set()  # a no-op once the job is done

    def stream(job: Job, chunk, include_usage: bool, first: dict | None = None) -> StreamingResponse:
        """The job as server-sent events: `first` (if any), a chunk(text, finish reason) per piece, the last one
        with the finish reason, with include_usage a chunk of no choices and the usage, then [DONE]."""

        async def events():
            try:
                if first is not None:
                    yield _sse(first)
                while True:
                    event = await job.events.get()
                    if event[0] == "text":
                        yield _sse(chunk(event[1], None))
                    elif event[0] == "done":
                        yield _sse(chunk("", event[1]))
                        if include_usage:
                            counts = usage(len(job.ids), event[2], job.reused)
                            yield _sse(chunk("", None) | {"choices": [], "usage": counts})
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield _sse(error_body(event[1], "server_error"))
                        return
            finally:  # the client went away (the stream is cancelled) or it ended: stop generating
                job.cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = runtime.model.config.vocab_size
            if any(not 0 <= token < vocab for token in prompt):
                raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", "invalid_value", "prompt")
            ids = list(prompt)
        else:
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise ApiError(400, "prompt: give one prompt per request (a string, or a list of one)",
                                   "invalid_value", "prompt")
                prompt = prompt[0]
            ids = encode(prompt)
        job = start(body, ids, body.max_tokens)
        request_id, created = new_id("cmpl"), now()

        def chunk(text, finish):
            return completion_chunk(request_id, created, model_name, text, finish)

        if body.stream:
            return stream(job, chunk, body.include_usage)
        result = await collect(job, request)
        if result is None:
            return Response(status_code=499)
        text, finish, completion_tokens = result
        return chunk(text, finish) | {"usage": usage(len(ids), completion_tokens, job.reused)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        if template is None:
            raise ApiError(400, "this artifact's tokenizer has no chat template: use /v1/completions, or start "
                                "hexq serve with --chat-template FILE", "no_chat_template")
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            with tokenizer_lock:
                text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (e.g. raise_exception on an unexpected role)
            raise ApiError(400, f"the chat template refused the messages: {str(exc).splitlines()[0][:200]}",
                           "invalid_value", "messages") from None
        ids = encode(text, chat=True)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, runtime.plan.context - len(ids))
        job = start(body, ids, max_tokens)
        request_id, created = new_id("chatcmpl"), now()

        def chunk(text, finish):
            return chat_chunk(request_id, created, model_name, {"content": text}, finish)

        if body.stream:
            first = chat_chunk(request_id, created, model_name, {"role": "assistant", "content": ""}, None)
            return stream(job, chunk, body.include_usage, first)
        result = await collect(job, request)
        if result is None:
            return Response(status_code=499)
        text, finish, completion_tokens = result
        message = {"role": "assistant", "content": text}
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage(len(ids), completion_tokens, job.reused)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hexq",
                                            "max_model_len": runtime.plan.context}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    return Guard(app, api_key, max_body_bytes, metrics), worker


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read before: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def serve(runtime, host: str, port: int, **options) -> None:
    """Run the server until interrupted (uvicorn, one process, one event loop)."""
    import uvicorn

    app, worker = create_app(runtime, **options)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        worker.close()
