"""The OpenAI-compatible HTTP app over an Engine, with Prometheus metrics and a health check.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as
server-sent events), GET /v1/models, GET /metrics (Prometheus text format), GET /health (503 when
the engine is stalled or its loop died). Every request field is checked before the engine sees it
(400 with an OpenAI-style error naming the field). Responses carry an extra `kvcodec` object
(ttft_s, matched/restored/prefilled tokens, fetch_error, ...) saying what prefix reuse did.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvcodec.engine.validate import check_context, check_token_ids
from kvcodec.errors import KVCodecError
from kvcodec.server import responses
from kvcodec.server.schema import BadRequestError, GenerationRequest, parse_chat, parse_completion, prompt_chars
from kvcodec.server.streaming import deltas, submit

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away
MAX_BODY_BYTES = 32 << 20  # a request body larger than this is refused (413) before it is parsed
MAX_PROMPT_CHARS = 8 << 20  # and a prompt longer than this, or than the context can hold, before tokenizing


def create_app(engine: Any, model_name: str = "kvcodec", *, close_on_shutdown: bool = False) -> FastAPI:
    """The app serving `engine`: started on app startup; on shutdown its unfinished requests end
    ('abort') and, with close_on_shutdown, it is closed (queued stores dropped)."""
    app = FastAPI(title="kvcodec", lifespan=_lifespan(engine, close_on_shutdown))
    app.state.engine, app.state.model_name = engine, model_name
    app.add_exception_handler(BadRequestError, _bad_request)
    app.add_exception_handler(KVCodecError, _bad_request)
    app.add_exception_handler(HTTPException, _http_error)  # 404, 405: OpenAI's error shape too
    app.add_exception_handler(ClientDisconnect, _client_gone)  # left before its body was read: no answer, no error
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    return app


def _lifespan(engine: Any, close: bool):  # noqa: ANN202
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.stop, abort=True)
            if close:
                await run_in_threadpool(engine.close, wait_for_store=False)

    return lifespan


UNFINISHED = {  # finish reasons of a request the engine did not answer: status, message
    "error": (500, "the engine failed on this request"),
    "abort": (503, "the server stopped before the answer was complete"),
}


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status", 400)
    return JSONResponse(responses.error(str(exc), getattr(exc, "param", None)), status_code=status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = responses.error(f"{request.method} {request.url.path}: {exc.detail}", kind=kind)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED)


async def _json(request: Request) -> Any:
    """The body as JSON; an oversize body (by its Content-Length, or as it arrives) is refused
    before it is read whole or parsed."""
    length = request.headers.get("content-length")
    if length is not None and not (length.isascii() and length.isdigit()):
        raise BadRequestError(f"Content-Length is not a number of bytes: {length[:40]!r}", "body")
    if length is not None and int(length) > MAX_BODY_BYTES:
        raise BadRequestError(f"the body is over {MAX_BODY_BYTES} bytes", "body", status=413)
    body, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise BadRequestError(f"the body is over {MAX_BODY_BYTES} bytes", "body", status=413)
        body.append(piece)
    try:
        return json.loads(b"".join(body))
    except Exception as e:
        raise BadRequestError(f"the body is not JSON: {e}", "body") from None


def _check_size(engine: Any, g: GenerationRequest) -> None:
    """Refuse, before tokenizing, a prompt too long to fit the model's context in any tokenization
    (more characters than the context times the longest token's) or over MAX_PROMPT_CHARS."""
    chars = prompt_chars(g)
    limit = min(MAX_PROMPT_CHARS, prompt_char_limit(engine))
    if chars > limit:
        field = "messages" if g.chat else "prompt"
        raise BadRequestError(f"{field} holds {chars} characters; at most {limit} fit this model's context", field)
    if not g.chat and not isinstance(g.prompt, str):
        context = getattr(engine, "max_context", None)
        if context is not None and len(g.prompt) >= context:
            raise BadRequestError(
                f"prompt of {len(g.prompt)} tokens does not fit the model's context of {context} tokens", "prompt"
            )


def _check_ids(engine: Any, g: GenerationRequest, ids: list[int]) -> None:
    """The prompt's tokens against the vocabulary and the context, the error naming the field
    (the engine checks the same again when the request is queued)."""
    field = "messages" if g.chat else "prompt"
    runner = getattr(engine, "runner", None)
    try:
        check_token_ids(ids, getattr(runner, "vocab_size", None))
    except KVCodecError as e:
        raise BadRequestError(str(e), field) from None
    context = getattr(engine, "max_context", None)
    try:
        check_context(len(ids), g.params.max_new_tokens, context)
    except KVCodecError as e:
        too_long = context is not None and len(ids) >= context
        raise BadRequestError(str(e), field if too_long or not ids else "max_tokens") from None


def prompt_char_limit(engine: Any) -> int:
    context, tokens = getattr(engine, "max_context", None), getattr(engine, "tokens", None)
    if context is None or tokens is None:
        return MAX_PROMPT_CHARS
    return int(context) * tokens.max_token_chars()


async def completions(request: Request) -> Response:
    arrival = time.perf_counter()  # TTFT counts from here: reading, checking and tokenizing included
    return await _generate(request, parse_completion(await _json(request)), arrival)


async def chat_completions(request: Request) -> Response:
    arrival = time.perf_counter()
    return await _generate(request, parse_chat(await _json(request)), arrival)


def _prompt_ids(engine: Any, g: GenerationRequest) -> list[int]:
    """The prompt's token ids; a text the tokenizer refuses (chat text holding a special token) is a 400 naming the field."""
    try:
        if g.chat:
            return engine.chat_ids([{"role": role, "content": content} for role, content in g.messages])
        return engine.encode(g.prompt) if isinstance(g.prompt, str) else list(g.prompt)
    except KVCodecError as e:
        raise BadRequestError(str(e), "messages" if g.chat else "prompt") from None


async def _generate(request: Request, g: GenerationRequest, arrival: float) -> Response:
    engine = request.app.state.engine
    _check_size(engine, g)
    ids = await run_in_threadpool(_prompt_ids, engine, g)
    g = g.fitted(len(ids), getattr(engine, "max_context", None))
    _check_ids(engine, g, ids)
    env = responses.Envelope.new(g.chat, request.app.state.model_name, len(ids))  # the model that answers
    req, q = await submit(engine, ids, g.params, g.reuse, arrival)  # a refused request: KVCodecError -> 400
    if g.stream:
        return StreamingResponse(_events(engine, env, req, q, g.stop), media_type="text/event-stream")
    text, finish, tokens = "", None, None
    async for d in deltas(engine, req, q, g.stop, gone=request.is_disconnected):
        text, finish, tokens = text + d.text, d.finish_reason, d.tokens
    if finish is None:  # the client went away; the request was aborted
        return Response(status_code=CLIENT_CLOSED)
    if finish in UNFINISHED:  # not an answer: a client reading the status alone must not take it for one
        status, why = UNFINISHED[finish]
        body = responses.error(f"{why}: {req.error}" if req.error else why, kind="server_error")
        return JSONResponse({**body, "kvcodec": responses.kvcodec_info(req)}, status_code=status)
    return JSONResponse(responses.completion(env, req, text, finish, tokens))


async def _events(engine: Any, env: responses.Envelope, req: Any, q: Any, stop: tuple[str, ...]) -> AsyncIterator[str]:
    if env.chat:
        yield responses.sse(responses.role_chunk(env))
    async for d in deltas(engine, req, q, stop):
        yield responses.sse(responses.chunk(env, req, d.text, d.finish_reason, d.tokens))
        if d.finish_reason in UNFINISHED:  # the status was sent 200 with the first event: say it in the stream
            _, why = UNFINISHED[d.finish_reason]
            yield responses.sse(responses.error(f"{why}: {req.error}" if req.error else why, kind="server_error"))
    yield responses.sse("[DONE]")


async def models(request: Request) -> dict[str, Any]:
    name = request.app.state.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "kvcodec"}]}


async def metrics(request: Request) -> Response:
    return Response(request.app.state.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> JSONResponse:
    h = request.app.state.engine.health()
    status = "ok" if h["ok"] else ("stalled" if h["alive"] else "dead")
    body = {
        "status": status,
        "model": request.app.state.model_name,
        "queue": h["queue"],
        "stalled_s": round(h["stalled_s"], 3),
    }
    return JSONResponse(body, status_code=200 if h["ok"] else 503)
