"""The endpoints: OpenAI's chat and text completions (streamed or not), models, tokenize,
detokenize, health and metrics.

A completion request is checked, turned into engine params, tokenized and measured against the
context (engine.prepare), put in the queue as token ids, and answered from the events the worker
sends back. Everything a client can get wrong (parameters, the chat template refusing the
messages, a prompt that is empty or longer than the context) is found before queueing and
answered with a plain 400, streamed or not; a stream then starts at once and sends SSE comments
while it waits for its turn.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ..engine import Finish, Piece
from ..errors import AirframeError
from ..tool_calls import CallStream, parse
from . import tools, translate
from .errors import ApiError, from_airframe, overloaded
from .metrics import CONTENT_TYPE
from .queue import END, Job
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)

ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
DISCONNECT_POLL_SECONDS = 0.1
# A stream that waits (in the queue, or for a slow token) sends an SSE comment this often, so that
# clients and proxies with read timeouts keep the connection.
KEEPALIVE_SECONDS = 5.0
KEEPALIVE = ": waiting\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer


class ClientGone(Exception):
    """The client closed its connection while its request waited or ran."""


def _state(request: Request):
    return request.app.state.airframe


def _authorized(request: Request) -> None:
    _state(request).check_key(request)


def _engine(request: Request):
    return _state(request).ready_engine()


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}
router = APIRouter(dependencies=[Depends(_authorized)], responses=_ERRORS)
health_router = APIRouter()


# ---- model name, prompt size, queue ----


def _served_name(state, requested: str | None) -> str:
    names = (state.model_id, *state.options.aliases)
    if requested in names:
        return requested
    if state.options.strict_model and requested is not None:
        raise ApiError(404, f"model {requested!r} is not served here; this server serves {', '.join(map(repr, names))}",
                       param="model", code="model_not_found")
    return state.model_id


def _prepare(engine, prompt, params, param: str, parse_special_in_content: bool, tool_list=None) -> list[int]:
    """The prompt's tokens, with everything engine.prepare checks (run before the first byte)."""
    try:
        return engine.prepare(prompt, params, parse_special_in_content, tools=tool_list)
    except AirframeError as e:
        raise from_airframe(e, param) from None


async def _next_event(job: Job, request: Request):
    """The job's next event, watching for the client to leave while waiting for it."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone() from None


def _raise_for(event, param: str):
    if isinstance(event, AirframeError):
        raise from_airframe(event, param)
    if isinstance(event, Exception):
        raise ApiError(500, f"generation failed: {type(event).__name__}: {event}", type="server_error", code="internal_error")
    if event is END:
        raise ApiError(503, "the request was dropped because the server is shutting down", type="server_overloaded")


def _submit(request: Request, prompt, params) -> Job:
    """Put a job in the queue (503 when it is full)."""
    queue = _state(request).queue
    if queue is None:
        raise overloaded("the server is shutting down")
    job = Job(prompt, params, asyncio.get_running_loop())
    try:
        queue.submit(job)
    except AirframeError as e:
        raise from_airframe(e) from None
    return job


async def _collect(request: Request, job: Job, param: str):
    """All the events of a job that is not streamed: the pieces and the Finish."""
    pieces = []
    while True:
        event = await _next_event(job, request)
        _raise_for(event, param)
        if isinstance(event, Piece):
            pieces.append(event)
        elif isinstance(event, Finish):
            return pieces, event


def _usage(finish: Finish) -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                 total_tokens=finish.prompt_tokens + finish.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=finish.cached_tokens))


def _reason(finish: Finish) -> str:
    return "length" if finish.reason == "length" else "stop"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream_response(job: Job, chunks) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # The background task runs even if the client left before the first chunk was sent.
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers,
                             background=BackgroundTask(job.cancel))


async def _events(job: Job):
    """The job's events up to its Finish, and None after every KEEPALIVE_SECONDS without one;
    cancels the job if the stream is dropped (the client left)."""
    try:
        while True:
            if not job.events.empty():
                event = job.events.get_nowait()  # no timer to set up when the engine is ahead
            else:
                try:
                    event = await asyncio.wait_for(job.events.get(), KEEPALIVE_SECONDS)
                except asyncio.TimeoutError:
                    yield None
                    continue
            if event is END:
                return
            yield event
            if isinstance(event, (Finish, Exception)):
                return
    finally:
        job.cancel()


def _error_chunk(event: Exception, param: str) -> str:
    if isinstance(event, AirframeError):
        error = from_airframe(event, param)
        return _sse({"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}})
    message = f"generation failed: {type(event).__name__}: {event}"
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": "internal_error"}})


# ---- chat completions ----


def _chat_chunk(meta: dict, delta: Delta, logprobs=None, finish_reason=None, usage_field: bool = False) -> dict:
    chunk = ChatCompletionChunk(**meta, choices=[ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)])
    body = chunk.model_dump(exclude=None if usage_field else {"usage"})
    body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
    return body


async def _chat_stream(state, job: Job, meta: dict, include_usage: bool, plan: tools.ToolPlan | None):
    yield _sse(_chat_chunk(meta, Delta(role="assistant", content=""), usage_field=include_usage))
    calls = CallStream(plan.fmt, plan.names) if plan is not None else None
    held = []  # logprobs of text held back while it may be a call
    async for event in _events(job):
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, Piece) and (event.text or event.logprobs):
            text = calls.push(event.text) if calls is not None else event.text
            held += event.logprobs or []
            if text or (held and calls is None):
                yield _sse(_chat_chunk(meta, Delta(content=text), _chunk_logprobs(state, held), usage_field=include_usage))
                held = []
        elif isinstance(event, Finish):
            reason = _reason(event)
            if calls is not None:
                rest, found = calls.finish()
                if rest or held:
                    yield _sse(_chat_chunk(meta, Delta(content=rest), _chunk_logprobs(state, held), usage_field=include_usage))
                if found:
                    reason = "tool_calls"
                    for delta in tools.tool_call_deltas(plan.calls(found)):
                        yield _sse(_chat_chunk(meta, Delta(tool_calls=delta), usage_field=include_usage))
            yield _sse(_chat_chunk(meta, Delta(), finish_reason=reason, usage_field=include_usage))
            if include_usage:
                yield _sse(ChatCompletionChunk(**meta, choices=[], usage=_usage(event)).model_dump())
        elif isinstance(event, Exception):
            yield _error_chunk(event, "messages")
    yield "data: [DONE]\n\n"


def _chunk_logprobs(state, items) -> ChoiceLogprobs | None:
    if not items:
        return None
    return ChoiceLogprobs(content=translate.chat_logprobs(items, state.engine.tokenizer.token_bytes))


def _chat_answer(meta: dict, pieces: list[Piece], finish: Finish, logprobs_on: bool, token_bytes,
                 plan: tools.ToolPlan | None) -> ChatCompletion:
    text = "".join(p.text for p in pieces)
    logprobs = None
    if logprobs_on:
        items = [lp for p in pieces for lp in (p.logprobs or [])]
        logprobs = ChoiceLogprobs(content=translate.chat_logprobs(items, token_bytes))
    message, reason = AssistantMessage(content=text), _reason(finish)
    if plan is not None:
        parsed = parse(text, plan.fmt, plan.names)
        if parsed.calls:
            message = AssistantMessage(content=parsed.content, tool_calls=tools.tool_calls_out(plan.calls(parsed.calls)))
            reason = "tool_calls"
    choice = ChatChoice(message=message, logprobs=logprobs, finish_reason=reason)
    return ChatCompletion(**meta, choices=[choice], usage=_usage(finish))


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request, engine=Depends(_engine)):
    state = _state(request)
    translate.check_chat(body)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": _served_name(state, body.model)}
    messages = translate.chat_messages(body.messages)
    plan = tools.plan(body, engine.template.tool_format)
    params = translate.chat_params(body, engine.config.vocab_size, engine.n_ctx, plan)
    ids = await run_in_threadpool(_prepare, engine, messages, params, "messages", body.parse_special_in_content,
                                  plan.tools if plan else None)
    job = _submit(request, ids, params)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream_response(job, _chat_stream(state, job, meta, include_usage, plan))
    try:
        pieces, finish = await _collect(request, job, "messages")
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return _chat_answer(meta, pieces, finish, params.logprobs is not None, engine.tokenizer.token_bytes, plan)


# ---- text completions ----


def _completion_chunk(meta: dict, text: str, logprobs=None, finish_reason=None, usage_field: bool = False) -> dict:
    chunk = Completion(**meta, choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)])
    return chunk.model_dump(exclude=None if usage_field else {"usage"})


async def _completion_stream(state, job: Job, meta: dict, include_usage: bool):
    offset = 0
    async for event in _events(job):
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, Piece) and (event.text or event.logprobs):
            logprobs = None
            if event.logprobs:
                logprobs = translate.legacy_logprobs(event.logprobs, state.engine.tokenizer.token_bytes, offset)
            offset += len(event.text)
            yield _sse(_completion_chunk(meta, event.text, logprobs, usage_field=include_usage))
        elif isinstance(event, Finish):
            yield _sse(_completion_chunk(meta, "", finish_reason=_reason(event), usage_field=include_usage))
            if include_usage:
                yield _sse(Completion(**meta, choices=[], usage=_usage(event)).model_dump())
        elif isinstance(event, Exception):
            yield _error_chunk(event, "prompt")
    yield "data: [DONE]\n\n"


def _completion_answer(meta: dict, pieces: list[Piece], finish: Finish, logprobs_on: bool, token_bytes) -> Completion:
    text = "".join(p.text for p in pieces)
    logprobs = None
    if logprobs_on:
        logprobs = translate.legacy_logprobs([lp for p in pieces for lp in (p.logprobs or [])], token_bytes)
    choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=_reason(finish))
    return Completion(**meta, choices=[choice], usage=_usage(finish))


@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request, engine=Depends(_engine)):
    state = _state(request)
    translate.check_completion(body)
    meta = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": _served_name(state, body.model)}
    prompt = translate.completion_prompt(body)
    params = translate.completion_params(body, engine.config.vocab_size, engine.n_ctx)
    ids = await run_in_threadpool(_prepare, engine, prompt, params, "prompt", False)
    job = _submit(request, ids, params)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream_response(job, _completion_stream(state, job, meta, include_usage))
    try:
        pieces, finish = await _collect(request, job, "prompt")
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return _completion_answer(meta, pieces, finish, params.logprobs is not None, engine.tokenizer.token_bytes)


# ---- models, tokenize, detokenize, health, metrics ----


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request, engine=Depends(_engine)):
    state = _state(request)
    names = (state.model_id, *state.options.aliases)
    cards = [ModelCard(id=name, created=state.started, context_length=engine.n_ctx, max_model_len=engine.n_ctx) for name in names]
    return ModelList(data=cards)


@router.get("/v1/models/{model}", response_model=ModelCard)
async def model(model: str, request: Request, engine=Depends(_engine)):
    state = _state(request)
    names = (state.model_id, *state.options.aliases)
    if model not in names:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {', '.join(map(repr, names))}",
                       param="model", code="model_not_found")
    return ModelCard(id=model, created=state.started, context_length=engine.n_ctx, max_model_len=engine.n_ctx)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request, engine=Depends(_engine)):
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise ApiError(400, f"give exactly one of 'prompt', 'content' or 'messages'; found {given or 'none'}", param="prompt")
    try:
        if body.messages is not None:
            messages = translate.chat_messages(body.messages)
            tokens = await run_in_threadpool(engine.tokenize_prompt, messages, body.parse_special_in_content,
                                             body.add_generation_prompt)
        else:
            prompt = body.prompt if body.prompt is not None else body.content
            tokens = await run_in_threadpool(engine.tokenize_prompt, prompt)
    except AirframeError as e:
        raise from_airframe(e, given[0]) from None
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.n_ctx)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request, engine=Depends(_engine)):
    vocab = engine.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is out of range; the vocabulary has ids [0, {vocab})", param="tokens")
    raw = b"".join(engine.tokenizer.token_bytes(t) for t in body.tokens)
    return DetokenizeResponse(content=raw.decode("utf-8", errors="replace"))


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    return PlainTextResponse(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@health_router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(request: Request):
    state = _state(request)
    if state.engine is not None:
        return Health(status="ok", model=state.model_id)
    status = "error" if state.load_error else "loading"
    body = Health(status=status, message=state.load_error or "the model is loading")
    return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "1"})
