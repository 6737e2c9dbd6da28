"""`kvcodec serve`: an OpenAI-compatible HTTP server over the engine, with Prometheus metrics.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as
server-sent events), GET /v1/models, GET /metrics (Prometheus text format), GET /health.
Responses carry an extra `kvcodec` object per request (ttft_s, matched/restored/prefilled tokens,
fetch_error) so that clients can see what prefix reuse did.
"""

from __future__ import annotations

import click


def create_app(engine, model_name: str = "kvcodec"):  # noqa: ANN001, ANN201
    """The FastAPI app serving `engine` (started on app startup, stopped on shutdown)."""
    import asyncio
    import contextlib
    import json
    import time
    import uuid

    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.concurrency import run_in_threadpool

    from kvcodec.engine import SamplingParams
    from kvcodec.errors import KVCodecError

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kvcodec", lifespan=lifespan)

    def _params(body: dict) -> tuple[SamplingParams, list[str]]:
        try:
            mt = body.get("max_tokens", body.get("max_completion_tokens"))
            max_tokens = int(mt) if mt is not None else 16
            temperature = float(body.get("temperature", 0.0) if body.get("temperature") is not None else 0.0)
            top_p = float(body.get("top_p", 1.0) if body.get("top_p") is not None else 1.0)
            seed = body.get("seed")
            seed = int(seed) if seed is not None else None
        except (TypeError, ValueError) as e:
            raise HTTPException(400, f"bad sampling parameter: {e}") from e
        if max_tokens < 1:
            raise HTTPException(400, "max_tokens must be >= 1")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed), list(stop)

    async def _submit(prompt_ids: list[int], params: SamplingParams, reuse: bool):  # noqa: ANN202
        """Queue the request; its tokens arrive on the returned asyncio queue."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_token(req, tok):  # noqa: ANN001
            loop.call_soon_threadsafe(q.put_nowait, ("tok", tok))

        def on_finish(req):  # noqa: ANN001
            loop.call_soon_threadsafe(q.put_nowait, ("end", None))

        try:
            req = await run_in_threadpool(
                engine.submit, prompt_ids, params, reuse=reuse, on_token=on_token, on_finish=on_finish
            )
        except KVCodecError as e:
            raise HTTPException(400, str(e)) from e
        return req, q

    async def _run(req, q, stop: list[str]):  # noqa: ANN001, ANN202
        """Yield (delta_text, finish_reason_or_None, request) as tokens arrive."""
        sent = ""
        ids: list[int] = []
        try:
            while True:
                kind, tok = await q.get()
                if kind == "end":
                    text = engine.decode_text(ids)
                    delta = text[len(sent) :] if text.startswith(sent) else ""
                    yield delta, req.finish_reason or "stop", req
                    return
                ids.append(tok)
                text = engine.decode_text(ids)
                if text.endswith("\ufffd"):
                    continue  # an incomplete multi-byte character: wait for the next token
                hit = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
                if hit >= 0:
                    engine.abort(req)
                    yield text[len(sent) : hit], "stop", req
                    return
                delta = text[len(sent) :] if text.startswith(sent) else ""
                sent = text
                if delta:
                    yield delta, None, req
        finally:
            if not req.finished:
                engine.abort(req)

    def _info(req) -> dict:  # noqa: ANN001
        return {
            "ttft_s": req.ttft,
            "tpot_s": req.tpot,
            "matched_tokens": req.matched_tokens,
            "restored_tokens": req.restored_tokens,
            "prefilled_tokens": req.prefilled_tokens,
            "fetch_error": req.fetch_error,
            "fetch_s": req.fetch_s,
            "bytes_fetched": int(req.fetch_stats.get("bytes_fetched", 0) or 0),
        }

    async def _handle(body: dict, chat: bool):  # noqa: ANN202
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise HTTPException(400, "messages must be a non-empty list")
            prompt_ids = engine.chat_ids([{"role": m.get("role", "user"), "content": m.get("content", "")} for m in msgs])
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = engine.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_ids = prompt
            else:
                raise HTTPException(400, "prompt must be a string or a list of token ids")
        if not prompt_ids:
            raise HTTPException(400, "empty prompt")
        params, stop = _params(body)
        reuse = bool(body.get("kvcodec_reuse", True))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        model = body.get("model") or model_name

        if body.get("stream"):
            req, q = await _submit(prompt_ids, params, reuse)
            gen = _run(req, q, stop)

            async def sse():  # noqa: ANN202
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [first]})
                async for delta, finish, req in gen:
                    if chat:
                        choice = {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish}
                        o = "chat.completion.chunk"
                    else:
                        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
                        o = "text_completion"
                    chunk = {"id": rid, "object": o, "created": created, "model": model, "choices": [choice]}
                    if finish is not None:
                        n = len(req.output_ids)
                        chunk["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}
                        chunk["kvcodec"] = _info(req)
                    yield _sse(chunk)
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        req, q = await _submit(prompt_ids, params, reuse)
        text, finish = "", "stop"
        async for delta, fin, r in _run(req, q, stop):
            text += delta
            finish, req = fin or finish, r
        n = len(req.output_ids)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n},
                "kvcodec": _info(req),
            }
        )

    def _sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def _body(request) -> dict:  # noqa: ANN001
        try:
            body = await request.json()
        except Exception as e:
            raise HTTPException(400, f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise HTTPException(400, "body must be a JSON object")
        return body

    async def completions(request):  # noqa: ANN001, ANN202
        return await _handle(await _body(request), chat=False)

    async def chat_completions(request):  # noqa: ANN001, ANN202
        return await _handle(await _body(request), chat=True)

    # annotations are strings under `from __future__ import annotations`; give FastAPI the class
    for fn, path in ((completions, "/v1/completions"), (chat_completions, "/v1/chat/completions")):
        fn.__annotations__["request"] = Request
        app.post(path)(fn)

    @app.get("/v1/models")
    async def models():  # noqa: ANN202
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "kvcodec"}]}

    @app.get("/metrics")
    async def metrics():  # noqa: ANN202
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():  # noqa: ANN202
        return {"status": "ok", "model": model_name, "queue": engine.scheduler.counts()}

    return app


@click.command("serve")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help="Model name (kvcodec.models).")
@click.option("--store", "store_url", default=None, help="KV store URL (file://, memory://, redis://); default: a temp file:// dir.")
@click.option("--quant", default="int8", show_default=True, help="Codec quantization of stored KV (int8, exact, ...).")
@click.option("--chunk-tokens", default=256, show_default=True, type=int)
@click.option("--policy", type=click.Choice(["fetch-aware", "blocking"]), default="fetch-aware", show_default=True)
@click.option("--max-batch", default=8, show_default=True, type=int)
@click.option("--no-reuse", is_flag=True, help="Never fetch stored prefixes.")
@click.option("--no-store", is_flag=True, help="Never store prompt KV after prefill.")
@click.option("--store-min-tokens", default=None, type=int, help="Store prompts of at least this many tokens.")
@click.option("--fetch-deadline", default=None, type=float, help="Seconds a fetch may take before the rest is recomputed.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda if available).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--nvdec-pool", "nvdec_pool", default=0, show_default=True, type=int,
              help="CUDA: restore fetched chunks in this many NVDEC worker processes (7 on an H100/H200). "
                   "Keeps decoding off the serving process, whose request loop an in-process decoder slows "
                   "(benchmarks/results/interference-h200-v2.md). 0: one decoder in this process.")
def command(
    model_name: str,
    store_url: str | None,
    quant: str,
    chunk_tokens: int,
    policy: str,
    max_batch: int,
    no_reuse: bool,
    no_store: bool,
    store_min_tokens: int | None,
    fetch_deadline: float | None,
    device: str | None,
    host: str,
    port: int,
    nvdec_pool: int,
) -> None:
    """Serve a model over an OpenAI-compatible API with remote KV prefix reuse."""
    import tempfile

    import uvicorn

    from kvcodec.config import CodecConfig
    from kvcodec.engine import Engine, StorePolicy

    if store_url is None:
        store_url = "file://" + tempfile.mkdtemp(prefix="kvcodec-store-")
    click.echo(f"kvcodec serve: model {model_name}, store {store_url}, policy {policy}", err=True)
    pool, cache_options = None, {}
    if nvdec_pool > 0:
        import torch

        from kvcodec.video.nvdec_pool import NvdecPool, PoolCodec

        if not (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
            raise click.BadParameter("--nvdec-pool needs a CUDA device", param_hint="--nvdec-pool")
        pool = NvdecPool(workers=nvdec_pool, device=device)
        cache_options = {"codec": PoolCodec(pool), "decode_workers": nvdec_pool}
        click.echo(f"kvcodec serve: fetched chunks restored by {nvdec_pool} NVDEC worker processes", err=True)
    engine = Engine(
        model_name,
        store_url=store_url,
        codec_config=CodecConfig(quant=quant, chunk_tokens=chunk_tokens),
        reuse=not no_reuse,
        store_policy=StorePolicy(enabled=not no_store, min_tokens=store_min_tokens),
        policy=policy,
        max_batch=max_batch,
        fetch_deadline_s=fetch_deadline,
        device=device,
        prefix_cache_options=cache_options,
    )
    try:
        uvicorn.run(create_app(engine, model_name), host=host, port=port, log_level="info")
    finally:
        engine.close()
        if pool is not None:
            pool.close()
