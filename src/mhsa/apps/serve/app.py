"""The OpenAI-compatible HTTP API over one ServedModel, as a starlette app:

    POST /v1/chat/completions    messages -> the assistant's answer (stream: server-sent events)
    POST /v1/completions         prompt -> its continuation (stream: server-sent events)
    GET  /v1/models              the served model; GET /v1/models/{name} one model
    GET  /health                 200 while the server runs

A bad request gets a 4xx error in OpenAI's shape; a client that disconnects has its
requests cancelled, which frees their cache blocks. The Limits bound what one request may
ask (body size, prompts, the queue); the Access rules say who may ask (guard.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

try:
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as error:  # pragma: no cover - the serve extra is missing
    raise ImportError(
        f"mhsa serve needs starlette and uvicorn ({error}): pip install 'mhsa[serve]'"
    ) from error

from . import errors, responses
from .generation import Generation
from .guard import Gate, Guard
from .limits import Access, Limits
from .models import ServedModel
from .params import Job, parse_chat, parse_completion
from .text import PromptEncoder


def build_app(
    served: ServedModel,
    limits: Limits | None = None,
    access: Access | None = None,
    gate: Gate | None = None,
) -> Starlette:
    """The app; its lifespan starts the engine's thread and stops it at shutdown.
    limits and access: see mhsa.apps.serve.limits (None: the defaults); gate: closed,
    new requests get 503 (the server is shutting down)."""
    limits = limits or Limits()
    encoder = PromptEncoder(served.encode, served.stream, served.vocab_size)
    chat_encoder = None  # (renderings of a model that encodes them apart: bounded too)
    if served.render_chat is not None:
        chat_encoder = PromptEncoder(served.chat_encode, served.stream, served.vocab_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        served.engine.start()
        try:
            yield
        finally:
            served.engine.stop()

    async def health(request: Request) -> Response:
        stats = served.engine.stats()
        keys = ("running", "waiting", "used_blocks", "num_blocks")
        return JSONResponse(
            {
                "status": "ok",
                "model": served.name,
                **{key: stats[key] for key in keys},
                "cache": stats,
            }
        )

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [responses.model_card(served.name, served.created)]}
        )

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != served.name:
            raise errors.unknown_model(name, served.name)
        return JSONResponse(responses.model_card(served.name, served.created))

    async def chat(request: Request) -> Response:
        body = await _json(request, limits)
        job = await run_in_threadpool(parse_chat, body, served, limits, chat_encoder)
        return await _complete(request, job, served, limits)

    async def completions(request: Request) -> Response:
        body = await _json(request, limits)
        job = await run_in_threadpool(parse_completion, body, served, limits, encoder)
        return await _complete(request, job, served, limits)

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{name:path}", model),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers = {errors.APIError: _api_error, HTTPException: _http_error, Exception: _crash}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.add_middleware(Guard, access=access or Access(), gate=gate)
    return app


async def _json(request: Request, limits: Limits) -> dict[str, Any]:
    """The body's JSON object, read no further than limits.max_body_bytes (413 beyond:
    from Content-Length before a byte is read, else as the body arrives) and within
    limits.body_seconds (408); parsed in a worker thread, so a large body does not hold
    up the event loop."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise errors.body_too_large(limit, declared)
    chunks = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise errors.body_too_large(limit, None)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), limits.body_seconds)
    except asyncio.TimeoutError:
        raise errors.body_timeout(limits.body_seconds) from None
    return await run_in_threadpool(_parse_json, b"".join(chunks))


def _parse_json(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise errors.invalid_json(str(error)) from None
    except RecursionError:
        raise errors.invalid_json("it nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise errors.invalid_json(f"expected an object, got {type(body).__name__}")
    return body


async def _complete(request: Request, job: Job, served: ServedModel, limits: Limits) -> Response:
    queued = served.engine.queued
    if queued + len(job.prompts) > limits.max_queued:
        raise errors.queue_full(queued, limits.max_queued, limits.retry_after)
    generation = Generation(served, job, cache_namespace(request, job))
    reply = responses.Reply(job.kind, served.name)
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, generation))
    if job.stream:
        return StreamingResponse(
            _stream(generation, reply, job, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        texts = [[] for _ in generation.choices]
        async for choice, text in generation.events():
            texts[choice.index].append(text)
    finally:
        watcher.cancel()
        generation.cancel()
    choices = [("".join(t), c.finish) for t, c in zip(texts, generation.choices, strict=True)]
    return JSONResponse(reply.whole(choices, _usage(generation)))


async def _stream(
    generation: Generation, reply: responses.Reply, job: Job, watcher: asyncio.Future
) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion, ending with `data: [DONE]`."""
    usage = job.include_usage
    try:
        if job.kind == "chat":
            for choice in generation.choices:
                yield responses.sse(reply.chunk(choice.index, "", role=True, usage=usage))
        async for choice, text in generation.events():
            if text:
                yield responses.sse(reply.chunk(choice.index, text, usage=usage))
            if choice.finish is not None:
                yield responses.sse(reply.chunk(choice.index, None, choice.finish, usage=usage))
        if usage:
            yield responses.sse(reply.usage_chunk(_usage(generation)))
        yield responses.sse("[DONE]")
    except errors.APIError as error:  # the status line has gone: the error is an event
        yield responses.sse(error.body())
        yield responses.sse("[DONE]")
    finally:  # also when the client disconnects (starlette cancels this generator)
        watcher.cancel()
        generation.cancel()


def cache_namespace(request: Request, job: Job) -> bytes:
    """The request's namespace in the prefix cache: its bearer token (the client's API
    key: give each client a key of its own, --api-key repeated or --api-key-file; on an
    open server whatever the client sends) and the body's cache_salt. Requests share
    cached prompt blocks, and learn of them through usage.cached_tokens or a faster
    first token, only within one namespace."""
    token = request.headers.get("authorization", "")
    salt = job.cache_salt or ""
    return hashlib.sha256(f"{token}\0{salt}".encode("utf-8", "surrogatepass")).digest()


async def _cancel_on_disconnect(request: Request, generation: Generation) -> None:
    """Wait for the client to go, then cancel its requests."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


def _usage(generation: Generation) -> dict[str, Any]:
    return responses.usage(
        generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens
    )


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, errors.APIError)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    if error.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif error.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    else:
        message = str(error.detail)
    return await _api_error(request, errors.APIError(error.status_code, message))


async def _crash(request: Request, error: Exception) -> Response:
    """A bug: 500 in OpenAI's shape (starlette re-raises it after, for the log)."""
    failure = errors.APIError(500, f"The server failed: {error}", kind="server_error")
    return await _api_error(request, failure)
