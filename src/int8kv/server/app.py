"""The HTTP side: OpenAI's completions and chat completions (plain and streamed), models, health, metrics, and
vLLM's /tokenize and /detokenize.

Handlers run on uvicorn's event loop and never touch the engine: they read the body, hand parsing and
tokenizing to one worker thread (`Service.off_loop`: a 7.6 MB body takes the loop no longer than reading it,
so /health answers meanwhile), check, hand the request to the engine thread (`EngineLoop.add`) and turn its
updates into text. Encoding runs on that one worker only (a transformers tokenizer must not encode from two
threads at once); decoding of streamed text happens on the loop (decode takes no tokenizer state).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..engine import LLM, Guide, SamplingParams, chat
from ..engine.sampler import TokenLogprob
from ..errors import InvalidEngineConfig, InvalidRequest, KvPoolExhausted
from . import tools
from .engine_loop import EngineLoop, QueueFull, ServerStopping, Sink
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    completion_body,
    error_body,
    new_id,
    usage,
)
from .text import CONTEXT, TextStream, token_texts
from .tools import PARSERS

requests_log = logging.getLogger("int8kv.server.requests")
T = TypeVar("T", bound=BaseModel)
# A text prompt is tokenized by prefixes of 4x, 16x, ... the context in characters (cut at a space) until one
# is known to exceed the context: a prefix has at most this many tokens more than the same text inside the
# whole prompt (a word-level or BPE tokenizer cut at a space: none; the slack covers tokenizers that merge
# across spaces). So a prompt far beyond the context is refused after tokenizing a small prefix of it, not the
# whole text, which for a multi-megabyte prompt would hold the server for tens of seconds.
PREFIX_SLACK = 8


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 1024  # the most new tokens one request may ask for
    max_body_bytes: int = 8 << 20  # the largest request body read (larger: 413 before it is parsed)
    max_queue: int = 256  # requests that may wait for a running slot before new ones get 429
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for running requests before ending them
    max_model_len: int | None = None  # prompt + new tokens per request (None: the model's positions)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers, self.param = status, message, kind, headers, param
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), self.status,
                            headers=self.headers)


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


OPEN_PATHS = ("/health", "/metrics")  # what probes and scrapers reach without the API key


def check_api_key(key: str) -> str:
    """``key`` if it can guard the server, else InvalidEngineConfig: an empty or blank key would read as "no key"
    and serve every route to anyone, and one with control characters or spaces at its ends cannot be sent in a
    header (clients and proxies trim them), so no request could match it. Never echoes the key."""
    if not isinstance(key, str) or not key.strip():
        raise InvalidEngineConfig("the API key is empty or blank: give a key, or leave --api-key and "
                                  "$INT8KV_API_KEY unset to serve without one")
    if key != key.strip() or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise InvalidEngineConfig("the API key has spaces at its ends or control characters, which an HTTP "
                                  "header cannot carry")
    return key


class ApiKey:
    """ASGI middleware: with a key, every route but /health and /metrics (probes and scrapers) needs
    `Authorization: Bearer <key>` (401 in OpenAI's shape otherwise): /v1/*, /tokenize, /detokenize, the API
    docs (/docs, /redoc, /openapi.json) and any path that is not a route, so a route added later is guarded
    too. The scheme is matched in any case (RFC 7235), the key exactly and in constant time."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, check_api_key(key).encode()

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return hmac.compare_digest(token.lstrip(b" "), self.key) and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not self.authorized(given):
                refused = ApiError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                                   headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
                return await refused.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_body(data: bytes, model: type[T]) -> T:
    """A request body as `model`: strict JSON (no NaN or Infinity), then strict validation; ApiError(400)."""
    try:
        obj = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"JSON decode error: {e}") from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        problems, params = [], []
        for err in e.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            if err.get("type") == "extra_forbidden":
                problems.append(f"{where} is not supported by this server")
            else:
                problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
            params.append(where or None)
        raise ApiError(400, "; ".join(problems) or "invalid request", param=params[0] if params else None) from None


def encode_bounded(tokenizer: Any, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`, or ApiError(400) as soon as a prefix of it is known to exceed `limit` tokens."""
    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=add_special_tokens)["input_ids"])

    size = 4 * limit + 64
    while size < len(text):
        cut = text.rfind(" ", 0, size)
        head = encode(text[: cut if cut > 0 else size])
        if len(head) > limit + PREFIX_SLACK:
            raise ApiError(400, f"the prompt exceeds the model's {limit} positions: its first "
                                f"{cut if cut > 0 else size:,} characters are already {len(head):,} tokens",
                           param="prompt")
        size *= 4
    return encode(text)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], limit: int | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The token ids of `messages` (and `tools`) through the tokenizer's chat template, ready for the assistant's
    turn (as `apply_chat_template(..., tokenize=True)` gives them), bounded by `limit` tokens like a text prompt."""
    text = chat_text(tokenizer, messages, tools=tools)
    return encode_bounded(tokenizer, text, limit or 1 << 62, add_special_tokens=False)


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
              tools: list[dict[str, Any]] | None = None) -> str:
    """`int8kv.engine.chat.chat_text`, its refusals as 400s."""
    try:
        return chat.chat_text(tokenizer, messages, add_generation_prompt, tools)
    except InvalidRequest as e:
        raise ApiError(400, str(e)) from None


LOGPROB_FLOOR = -9999.0  # JSON has no -inf (a masked token's log-probability); vLLM reports this value too


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob], before: list[int]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for tokens that follow `before`."""
    ids, tops = [e.token_id for e in entries], [[t for t, _ in e.top] for e in entries]
    texts, alts = token_texts(tokenizer, ids, before, tops)

    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    return {"content": [
        {**item(text, e.logprob), "top_logprobs": [item(a, lp) for a, (_, lp) in zip(alt, e.top, strict=True)]}
        for text, alt, e in zip(texts, alts, entries, strict=True)
    ]}


def completion_logprobs(tokenizer: Any, ids: list[int], entries: list[TokenLogprob | None], before: list[int],
                        offset: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset) for tokens
    `ids` that follow `before`; `offset` is where the first one starts in the returned text. A position without
    an entry (the first prompt token: nothing predicts it) has null."""
    texts, alts = token_texts(tokenizer, ids, before, [[t for t, _ in e.top] if e else [] for e in entries])
    offsets, tops = [], []
    for text, alt, e in zip(texts, alts, entries, strict=True):
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] | None = None
        if e is not None:
            top = {}
            for a, (_, lp) in zip(alt, e.top, strict=True):
                top.setdefault(a, _lp(lp))  # two ids with one text: the likelier one's value (they come sorted)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [_lp(e.logprob) if e else None for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


class ToolCalls:
    """How a chat request's tools shape its answers (server/tools.py): `active` when its output is read as calls."""

    def __init__(self, body: ChatCompletionRequest, parser: str | None) -> None:
        self.mode, self.named, self.parser = body.tool_mode(), body.named_tool(), parser
        self.active = self.mode in ("named", "required") or (self.mode == "auto" and parser is not None)

    def streamable(self, text: str) -> int:
        """How much of a choice's text so far can be streamed as content now (auto: up to where a call could
        start; a grammar-held answer is all calls: nothing)."""
        return tools.streamable(text, self.parser) if self.mode == "auto" else 0

    def read(self, text: str, reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, calls, finish reason) of a finished choice's text: "tool_calls" when it made calls."""
        if self.mode == "auto":
            content, found = tools.parse(text, self.parser)
        else:  # a grammar-held answer is all calls, once whole
            content, found = None, (tools.guided_calls(text, self.mode, self.named) if reason == "stop" else None)
        return (content, found, "tool_calls") if found else (text, None, reason)


class Service:
    """What the handlers share: the engine thread, the tokenizer worker, the limits and the served model's name."""

    def __init__(self, llm: LLM, model_name: str, limits: Limits, tool_parser: str | None = None) -> None:
        """`tool_parser`: how "auto" tool choice reads calls from the output (tools.PARSERS); None: "auto" is
        refused."""
        if tool_parser is not None and tool_parser not in PARSERS:
            raise InvalidEngineConfig(f"tool_parser must be one of {PARSERS}, got {tool_parser!r}")
        self.tool_parser = tool_parser
        if llm.tokenizer is None:
            raise InvalidRequest("the server needs a model with a tokenizer")
        max_len = limits.max_model_len or llm.max_positions
        if not 1 <= max_len <= llm.max_positions:
            raise InvalidEngineConfig(f"max_model_len {max_len} must lie in [1, {llm.max_positions}] (the model's "
                                      "max_position_embeddings)")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.limits = limits
        self.max_model_len = max_len
        self.metrics = Metrics(model_name)
        self.engine = EngineLoop(llm, self.metrics, limits.max_queue)
        self.stopping = False
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="int8kv-tokenizer")

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def parse(self, raw: Request, model: type[T]) -> T:
        body = await self.off_loop(parse_body, await raw.body(), model)
        self.check_model(body.model)
        return body

    def begin_shutdown(self) -> None:
        """SIGTERM: no new requests; after the shutdown timeout, end every running one (its stream gets a last
        chunk with finish_reason "abort" and [DONE], so nothing needs cancelling)."""
        self.stopping = True
        asyncio.get_running_loop().call_later(self.limits.shutdown_timeout, self.engine.end_all)

    # -- request checks ----------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name not in (None, self.model_name):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", param="model")

    def encode(self, prompt: str | list[int]) -> list[int]:
        """(worker thread) A prompt's ids; a token list longer than the context is refused without a look."""
        if isinstance(prompt, str):
            return encode_bounded(self.tokenizer, prompt, self.max_model_len)
        if len(prompt) > self.max_model_len:
            raise ApiError(400, f"the prompt's {len(prompt):,} tokens exceed the model's {self.max_model_len} "
                                "positions", param="prompt")
        return prompt

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return chat_prompt_ids(self.tokenizer, [m.template_dict() for m in body.messages], self.max_model_len, tools)

    def guide(self, body: Any) -> Guide | None:
        """(worker thread) The request's structured output or the grammar of its tool choice, compiled now, so a
        bad schema is a 400 before anything is queued and the engine finds it compiled."""
        mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else "none"
        if mode == "auto" and self.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                                "--tool-call-parser; \"required\" or a named function work without them",
                           param="tool_choice")
        asked = body.guide()
        held = tools.guide(body.tools, mode, body.named_tool(), body.parallel_tool_calls) if mode != "none" else None
        if asked is not None and held is not None:
            raise ApiError(400, f"tool_choice {mode!r} holds the output to its calls; it cannot also follow "
                                "response_format or structured outputs", param="tool_choice")
        guide = asked or held
        if guide is not None:
            try:
                self.llm.grammars.compile(guide)
            except InvalidRequest as e:
                raise ApiError(400, str(e), param="response_format" if asked else "tools") from None
        return guide

    def params(self, body: Any, max_tokens: int | None, prompts: list[list[int]], logprobs: int | None,
               guide: Guide | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice (choice j of a seeded request uses seed + j), after checking every
        prompt + max_tokens against the context."""
        limit, context = self.limits.max_tokens, self.max_model_len
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionRequest) else min(limit, context - longest)
            max_tokens = max(max_tokens, 1)
        elif max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} is more than this server allows ({limit})",
                           param="max_tokens")
        if longest + max_tokens > context:
            raise ApiError(400, f"{longest} prompt + {max_tokens} new tokens exceed the model's {context} positions"
                                + (" (--max-model-len)" if context < self.llm.max_positions else ""), param="prompt")
        fields = body.sampling_fields()
        if fields["logit_bias"] and max(fields["logit_bias"]) >= self.llm.vocab_size:
            raise ApiError(400, f"logit_bias: token id {max(fields['logit_bias'])} is not in [0, "
                                f"{self.llm.vocab_size}) (the vocabulary)", param="logit_bias")
        try:
            return [SamplingParams(max_tokens=max(max_tokens, 1), temperature=body.temperature, top_p=body.top_p,
                                   ignore_eos=body.ignore_eos, logprobs=logprobs, guide=guide, **fields,
                                   seed=None if body.seed is None else body.seed + j) for j in range(body.n)]
        except InvalidRequest as e:
            raise ApiError(400, str(e)) from None

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], sink: Sink) -> list[int]:
        """Queue every prompt's n choices (`params`); returns their request ids, prompt-major. Each prompt's
        choices are one forked group (its prompt prefilled once, the choices copy-on-write forks of its blocks),
        split into groups of at most max_num_seqs choices, the most the engine runs at once (a later group of
        the same prompt still reuses its full blocks through the prefix cache)."""
        self.check_open()
        total = len(prompts) * len(params)
        most = self.limits.max_queue + self.llm.scheduler.max_num_seqs
        if total > most:  # could never be queued: not a "retry later"
            raise ApiError(400, f"this request asks for {total} completions (prompts x n); the server holds "
                                f"at most {most} at once", param="n")
        seats = self.llm.scheduler.max_num_seqs
        groups = [(ids, params[j : j + seats], sink) for ids in prompts for j in range(0, len(params), seats)]
        return await self.on_engine(self.engine.add(groups))

    async def prompt_logprobs(self, ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability (LLM.prompt_logprobs), computed on the engine thread between steps."""
        self.check_open()
        # Scoring holds every block of every block table (LLM.score: can_add); more than the whole pool never fits.
        if self.llm.cache.allocator.peak_blocks([len(ids)]) > self.llm.cache.num_blocks:
            raise ApiError(400, f"the prompt's {len(ids)} tokens do not fit in the whole KV cache pool")
        try:
            return await asyncio.wrap_future(self.engine.call(lambda llm: llm.prompt_logprobs(ids, k)))
        except KvPoolExhausted:  # it fits the pool, but not what the running requests leave free
            raise ApiError(503, "the pool has no room to score the prompt now; retry later", "server_error",
                           headers={"Retry-After": "1"}) from None
        except InvalidRequest as e:
            raise ApiError(400, f"invalid request: {e}") from None

    def check_open(self) -> None:
        if self.stopping:
            raise ApiError(503, "the server is shutting down", "server_error")

    @staticmethod
    async def on_engine(future: concurrent.futures.Future) -> Any:
        try:
            return await asyncio.wrap_future(future)
        except InvalidRequest as e:
            raise ApiError(400, f"invalid request: {e}") from None
        except KvPoolExhausted as e:
            raise ApiError(400, f"the request does not fit in the whole KV cache pool: {e}") from None
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except ServerStopping as e:
            raise ApiError(503, str(e), "server_error") from None


class Run:
    """One HTTP request's choices in flight: their text streams, log-probabilities, and what is still running."""

    def __init__(self, service: Service, request_ids: list[int] | None, sink: Sink, stop: list[str],
                 prompts: list[list[int]], n: int, request_id: str) -> None:
        """`request_ids`: the engine's ids of the choices, prompt-major; None when nothing is generated (echo
        with max_tokens 0: every choice is complete, finish_reason "length")."""
        self.service = service
        self.sink = sink
        self.request_id = request_id
        self.started = time.perf_counter()
        self.index = {rid: i for i, rid in enumerate(request_ids or [])}
        self.prompts = prompts  # per prompt (choice i belongs to prompt i // n)
        self.n = n
        choices = len(prompts) * n
        self.texts = [TextStream(service.tokenizer, stop) for _ in range(choices)]
        self.reasons: list[str | None] = [None if request_ids else "length"] * choices
        self.completion_tokens = [0] * choices
        self.cached = [0] * choices
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(choices)]
        self.live = set(request_ids or [])

    async def next(self) -> tuple[int, str, str | None]:
        """The next (choice index, new text, finish reason or None); ApiError(500) if the engine failed it.
        Updates of a choice already ended (a stop string found while its next tokens were on their way) are
        dropped, so each choice ends once."""
        while True:
            update = await self.sink.updates.get()
            if update.request_id in self.live:
                break
        i = self.index[update.request_id]
        if update.finish_reason == "error":
            self.live.discard(update.request_id)
            raise ApiError(500, f"generation failed: {update.error}", "server_error")
        text = self.texts[i]
        delta = text.feed(update.new_token_ids, update.finished)
        self.completion_tokens[i] = max(self.completion_tokens[i], update.num_output_tokens)
        self.cached[i] = max(self.cached[i], update.num_cached_tokens)
        self.logprobs[i] += update.new_logprobs or []
        reason = update.finish_reason if update.finished else None
        if text.stopped:  # in this update's tokens, whether or not the engine also ended the request here
            if not update.finished:
                self.service.engine.abort([update.request_id], finished=True)
            reason = "stop"
        if reason is not None:
            self.live.discard(update.request_id)
            self.reasons[i] = reason
        return i, delta, reason

    def abort_rest(self) -> None:
        if self.live:
            self.service.engine.abort(sorted(self.live))
            self.live.clear()

    def usage(self) -> dict[str, Any]:
        # Each prompt counts once in usage, however many choices share it; its first choice holds its hits.
        firsts = range(0, len(self.texts), self.n)
        return usage(sum(len(p) for p in self.prompts), sum(self.completion_tokens),
                     sum(self.cached[i] for i in firsts))

    def log(self) -> None:
        use = self.usage()
        reasons = ",".join(r or "abort" for r in self.reasons)
        requests_log.info("%s: %d prompt tokens (%d cached), %d completion tokens, finish %s, %.3f s",
                          self.request_id, use["prompt_tokens"], use["prompt_tokens_details"]["cached_tokens"],
                          use["completion_tokens"], reasons, time.perf_counter() - self.started)


def build_app(llm: LLM, model_name: str, limits: Limits | None = None, api_key: str | None = None,
              tool_parser: str | None = None) -> FastAPI:
    if api_key is not None:  # "" is refused, never read as "no key" (before the engine is touched)
        check_api_key(api_key)
    service = Service(llm, model_name, limits or Limits(), tool_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        try:
            yield
        finally:
            service.stopping = True
            await asyncio.to_thread(service.engine.stop)
            service.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="int8kv", lifespan=lifespan)
    app.state.service = service
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(BodyLimit, limit=service.limits.max_body_bytes)  # outermost: counts every body

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

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
                                            "owned_by": "int8kv", "max_model_len": service.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        body = await service.parse(raw, TokenizeRequest)

        def run() -> dict:
            if body.messages is not None:
                text = chat_text(service.tokenizer, [m.template_dict() for m in body.messages],
                                 body.add_generation_prompt)
                special = bool(body.add_special_tokens)
            else:
                text, special = body.prompt, body.add_special_tokens is not False
            ids = list(service.tokenizer(text, add_special_tokens=special)["input_ids"])
            strs = service.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids, "token_strs": strs}

        return await service.off_loop(run)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        body = await service.parse(raw, DetokenizeRequest)
        bad = [t for t in body.tokens if not 0 <= t < llm.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is not in [0, {llm.vocab_size}) (the vocabulary)", param="tokens")
        return {"prompt": await service.off_loop(service.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        body = await service.parse(raw, CompletionRequest)
        texts = body.prompts()
        if not texts:
            raise ApiError(400, "prompt is empty", param="prompt")
        prompts = [await service.off_loop(service.encode, p) for p in texts]
        return await respond(body, raw, prompts, body.max_tokens, chat=False, logprobs=body.logprobs,
                             echo=texts if body.echo else None)

    async def echo_of(text: str | list[int], ids: list[int], k: int | None) -> tuple[str, dict | None]:
        """The echoed prompt: its text and, with logprobs, its tokens' log-probabilities."""
        if not isinstance(text, str):
            text = await service.off_loop(lambda: service.tokenizer.decode(ids))
        if k is None or not ids:
            return text, None
        entries = await service.prompt_logprobs(ids, k)
        return text, await service.off_loop(completion_logprobs, service.tokenizer, ids, entries, [], 0)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        body = await service.parse(raw, ChatCompletionRequest)
        prompts = [await service.off_loop(service.encode_chat, body)]
        return await respond(body, raw, prompts, body.requested_max_tokens(), chat=True,
                             logprobs=body.num_logprobs(), echo=None)

    async def respond(body: Any, raw: Request, prompts: list[list[int]], max_tokens: int | None, chat: bool,
                      logprobs: int | None, echo: list[str | list[int]] | None) -> Response:
        """`echo`: the prompts as given, to echo before the output (completions only)."""
        if any(not p for p in prompts):
            raise ApiError(400, "prompt is empty", param="prompt")
        guide = await service.off_loop(service.guide, body)
        params = service.params(body, max_tokens, prompts, logprobs, guide)  # every check before any work
        echoed = None if echo is None else [await echo_of(t, ids, logprobs) for t, ids in zip(echo, prompts,
                                                                                               strict=True)]
        request_id = new_id("chatcmpl" if chat else "cmpl")
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        ids = None if max_tokens == 0 else await service.submit(prompts, params, sink)  # 0: echo only
        run = Run(service, ids, sink, body.stop_strings(), prompts, body.n, request_id)
        calls = ToolCalls(body, service.tool_parser) if chat else None
        if body.stream:
            return StreamingResponse(stream(run, chat, logprobs, echoed, body.include_usage(), calls),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(run, raw, chat, logprobs, echoed, calls)

    def choice_logprobs(run: Run, i: int, start: int, chat: bool, offset: int) -> dict:
        """Choice i's logprobs object for its output tokens from `start` on."""
        entries = run.logprobs[i][start:]
        prompt = run.prompts[i // run.n]
        out = [e.token_id for e in run.logprobs[i]]
        before = (prompt + out[:start])[-CONTEXT:]
        if chat:
            return chat_logprobs(service.tokenizer, entries, before)
        return completion_logprobs(service.tokenizer, out[start:], entries, before, offset)

    def choice(i: int, text: str | None, reason: str | None, chat: bool, chunk: bool, logprobs: dict | None = None,
               calls: list[dict] | None = None) -> dict:
        if not chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if chunk:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def joined(head: dict | None, tail: dict) -> dict:
        return tail if head is None else {k: head[k] + tail[k] for k in tail}

    async def collect(run: Run, raw: Request, chat: bool, logprobs: int | None,
                      echo: list[tuple[str, dict | None]] | None, calls: ToolCalls | None) -> Response:
        try:
            while run.live:
                try:
                    await asyncio.wait_for(run.next(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        return Response(status_code=499)
            choices = []
            for i, t in enumerate(run.texts):
                head, head_lp = echo[i // run.n] if echo else ("", None)
                lp = None
                if logprobs is not None:
                    lp = joined(head_lp, await service.off_loop(choice_logprobs, run, i, 0, chat, len(head)))
                text, reason, found = head + t.text, run.reasons[i], None
                if calls is not None and calls.active:
                    text, found, reason = calls.read(text, reason)
                choices.append(choice(i, text, reason, chat, False, lp, found))
            return JSONResponse(completion_body(run.request_id, model_name, choices, run.usage(), chat))
        finally:
            run.abort_rest()
            run.log()

    async def stream(run: Run, chat: bool, logprobs: int | None, echo: list[tuple[str, dict | None]] | None,
                     include_usage: bool, calls: ToolCalls | None) -> AsyncIterator[str]:
        def event(choices: list[dict], use: dict | None = None) -> str:
            body = completion_body(run.request_id, model_name, choices, use, chat, chunk=True)
            return f"data: {json.dumps(body)}\n\n"

        sent_logprobs = [0] * len(run.texts)
        offsets = [0] * len(run.texts)
        sent_text = [0] * len(run.texts)  # characters of each choice's text streamed (tool calls: content only)

        def pending(i: int) -> dict | None:  # log-probabilities of choice i's tokens not sent yet
            if logprobs is None or sent_logprobs[i] == len(run.logprobs[i]):
                return None
            lp = choice_logprobs(run, i, sent_logprobs[i], chat, offsets[i])
            sent_logprobs[i] = len(run.logprobs[i])
            if not chat:  # offsets advance by the tokens' texts, as in the whole object
                offsets[i] += sum(map(len, lp["tokens"]))
            return lp

        try:
            if chat:
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(run.texts))])
            for i in range(len(run.texts)) if echo else ():
                head, head_lp = echo[i // run.n]
                offsets[i] = len(head)
                yield event([choice(i, head, None, chat, True, head_lp)])
            for i, reason in enumerate(run.reasons if not run.index else ()):  # echo only: nothing runs
                yield event([choice(i, "", reason, chat, True)])
            while run.live:
                try:
                    i, delta, reason = await run.next()
                except ApiError as e:
                    yield f"data: {json.dumps(error_body(e.message, e.kind))}\n\n"
                    break
                lp = pending(i)
                if calls is not None and calls.active:  # calls are read from the whole text (module tools)
                    text = run.texts[i].text
                    ready = calls.streamable(text) if reason is None else sent_text[i]
                    if ready > sent_text[i] or lp is not None:
                        yield event([choice(i, text[sent_text[i]:ready], None, chat, True, lp)])
                        sent_text[i] = max(ready, sent_text[i])
                    if reason is not None:
                        content, found, reason = calls.read(text, reason)
                        rest = (content or "")[sent_text[i]:] if found else text[sent_text[i]:]
                        if rest or found:
                            yield event([choice(i, rest, None, chat, True, None, found)])
                        yield event([choice(i, "", reason, chat, True)])
                    continue
                if delta or lp is not None:
                    yield event([choice(i, delta, None, chat, True, lp)])
                if reason is not None:
                    yield event([choice(i, "", reason, chat, True)])
            else:
                if include_usage:
                    yield event([], run.usage())
            yield "data: [DONE]\n\n"
        finally:  # also when the client goes away mid-stream: its requests leave the engine now
            run.abort_rest()
            run.log()

    return app
