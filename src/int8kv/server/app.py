"""The HTTP side: OpenAI's completions and chat completions (plain and streamed), models, health, metrics.

Handlers run on uvicorn's event loop and never touch the engine: they tokenize, check, hand the request to the
engine thread (`EngineLoop.add`) and turn its updates into text. All tokenizer calls happen on this one loop
(the engine thread only sees token ids), so the tokenizer is never used from two threads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine import LLM, SamplingParams
from ..engine.chat import chat_prompt_ids as engine_chat_prompt_ids
from ..errors import InvalidRequest, KvPoolExhausted
from .engine_loop import EngineLoop, QueueFull, ServerStopping, Sink
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_body,
    error_body,
    new_id,
    usage,
)
from .text import TextStream


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 1024  # the most new tokens one request may ask for
    max_body_bytes: int = 8 << 20  # the largest request body read (larger: 413 before it is parsed)
    max_queue: int = 256  # requests that may wait for a running slot before new ones get 429
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for running requests before aborting them


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers, self.param = status, message, kind, headers, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param), self.status, headers=self.headers)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before anything parses or stores it, whether
    its Content-Length says so or its chunks add up to more."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = ApiError(413, f"the request body is larger than this server reads ({self.limit:,} bytes)")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_big
            return message

        try:
            await self.app(scope, counted, send)
        except ApiError as e:
            if e is not too_big:
                raise
            await too_big.response()(scope, receive, send)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """`int8kv.engine.chat.chat_prompt_ids`, its refusals as 400s."""
    try:
        return engine_chat_prompt_ids(tokenizer, messages)
    except InvalidRequest as e:
        raise ApiError(400, str(e)) from None


class Service:
    """What the handlers share: the engine thread, the tokenizer, the limits and the served model's name."""

    def __init__(self, llm: LLM, model_name: str, limits: Limits) -> None:
        if llm.tokenizer is None:
            raise InvalidRequest("the server needs a model with a tokenizer")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.limits = limits
        self.metrics = Metrics()
        self.engine = EngineLoop(llm, self.metrics, limits.max_queue)
        self.stopping = False

    # -- request checks ----------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name not in (None, self.model_name):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", param="model")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return prompt

    def params(self, body: Any, max_tokens: int | None, prompt_len: int) -> list[SamplingParams]:
        """One SamplingParams per choice (choice j of a seeded request uses seed + j)."""
        limit = self.limits.max_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionRequest) else min(limit, self.llm.max_positions - prompt_len)
            max_tokens = max(max_tokens, 1)
        elif max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} is more than this server allows ({limit})",
                           param="max_tokens")
        try:
            return [SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                   ignore_eos=body.ignore_eos,
                                   seed=None if body.seed is None else body.seed + j) for j in range(body.n)]
        except InvalidRequest as e:
            raise ApiError(400, str(e)) from None

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], sink: Sink) -> list[int]:
        """Queue every prompt's n choices (`params`); returns their request ids, prompt-major. Each prompt's
        choices are one forked group (its prompt prefilled once, the choices copy-on-write forks of its blocks),
        split into groups of at most max_num_seqs choices, the most the engine runs at once (a later group of
        the same prompt still reuses its full blocks through the prefix cache)."""
        if self.stopping:
            raise ApiError(503, "the server is shutting down", "server_error")
        total = len(prompts) * len(params)
        most = self.limits.max_queue + self.llm.scheduler.max_num_seqs
        if total > most:  # could never be queued: not a "retry later"
            raise ApiError(400, f"this request asks for {total} completions (prompts x n); the server holds "
                                f"at most {most} at once", param="n")
        seats = self.llm.scheduler.max_num_seqs
        groups = [(ids, params[j : j + seats], sink) for ids in prompts for j in range(0, len(params), seats)]
        try:
            return await asyncio.wrap_future(self.engine.add(groups))
        except InvalidRequest as e:
            raise ApiError(400, f"invalid request: {e}") from None
        except KvPoolExhausted as e:
            raise ApiError(400, f"the request does not fit in the whole KV cache pool: {e}") from None
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except ServerStopping as e:
            raise ApiError(503, str(e), "server_error") from None


class Run:
    """One HTTP request's choices in flight: their text streams, and what is still running."""

    def __init__(self, service: Service, request_ids: list[int], sink: Sink, stop: list[str], num_prompt: list[int],
                 n: int) -> None:
        self.service = service
        self.sink = sink
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.texts = [TextStream(service.tokenizer, stop) for _ in request_ids]
        self.reasons: list[str | None] = [None] * len(request_ids)
        self.completion_tokens = [0] * len(request_ids)
        # Each prompt counts once in usage, however many choices share it.
        self.prompt_tokens = sum(num_prompt[i] for i in range(0, len(request_ids), n))
        self.live = set(request_ids)

    async def next(self) -> tuple[int, str, str | None]:
        """The next (choice index, new text, finish reason or None); ApiError(500) if the engine failed it."""
        update = await self.sink.updates.get()
        i = self.index[update.request_id]
        text = self.texts[i]
        if update.finish_reason == "error":
            self.live.discard(update.request_id)
            raise ApiError(500, f"generation failed: {update.error}", "server_error")
        delta = text.feed(update.new_token_ids, update.finished)
        self.completion_tokens[i] = max(self.completion_tokens[i], update.num_output_tokens)
        reason = update.finish_reason if update.finished else None
        if text.stopped and not update.finished:
            self.service.engine.abort([update.request_id])
            reason = "stop"
        if reason is not None:
            self.live.discard(update.request_id)
            self.reasons[i] = reason
        return i, delta, reason

    def abort_rest(self) -> None:
        if self.live:
            self.service.engine.abort(sorted(self.live))
            self.live.clear()

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(self.completion_tokens))


def build_app(llm: LLM, model_name: str, limits: Limits | None = None) -> FastAPI:
    service = Service(llm, model_name, limits or Limits())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        try:
            yield
        finally:
            service.stopping = True
            await asyncio.to_thread(service.engine.stop)

    app = FastAPI(title="int8kv", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimit, limit=service.limits.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return JSONResponse(error_body("; ".join(problems) or "invalid request", param=param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug: say so in OpenAI's shape
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    @app.get("/health")
    async def health() -> Response:
        if service.stopping:
            return JSONResponse({"status": "stopping"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "int8kv", "max_model_len": llm.max_positions}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        service.check_model(body.model)
        prompts = [service.encode(p) for p in body.prompts()]
        return await respond(body, raw, prompts, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        service.check_model(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompts = [chat_prompt_ids(service.tokenizer, messages)]
        return await respond(body, raw, prompts, body.requested_max_tokens(), chat=True)

    async def respond(body: Any, raw: Request, prompts: list[list[int]], max_tokens: int | None,
                      chat: bool) -> Response:
        if not prompts:
            raise ApiError(400, "prompt is empty", param="prompt")
        params = service.params(body, max_tokens, max(len(p) for p in prompts))
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        ids = await service.submit(prompts, params, sink)
        run = Run(service, ids, sink, body.stop_strings(), [len(p) for p in prompts for _ in params], body.n)
        request_id = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            return StreamingResponse(stream(run, request_id, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(run, raw, request_id, chat)

    def choice(i: int, text: str, reason: str | None, chat: bool, chunk: bool) -> dict:
        if not chat:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
        if chunk:
            return {"index": i, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}
        return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}

    async def collect(run: Run, raw: Request, request_id: str, chat: bool) -> Response:
        try:
            while run.live:
                try:
                    await asyncio.wait_for(run.next(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        return Response(status_code=499)
            choices = [choice(i, t.text, run.reasons[i], chat, False) for i, t in enumerate(run.texts)]
            return JSONResponse(completion_body(request_id, model_name, choices, run.usage(), chat))
        finally:
            run.abort_rest()

    async def stream(run: Run, request_id: str, chat: bool) -> AsyncIterator[str]:
        def event(choices: list[dict], use: dict | None = None) -> str:
            body = completion_body(request_id, model_name, choices, use, chat, chunk=True)
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(run.texts))])
            while run.live:
                try:
                    i, delta, reason = await run.next()
                except ApiError as e:
                    yield f"data: {json.dumps(error_body(e.message, e.kind))}\n\n"
                    break
                if delta:
                    yield event([choice(i, delta, None, chat, True)])
                if reason is not None:
                    yield event([choice(i, "", reason, chat, True)])
            else:
                yield event([], run.usage())
            yield "data: [DONE]\n\n"
        finally:  # also when the client goes away mid-stream: its requests leave the engine now
            run.abort_rest()

    return app
