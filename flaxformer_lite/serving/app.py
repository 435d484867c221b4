"""The HTTP face of a `Translator`: an ASGI app (Starlette), served by uvicorn in `serve.py`.

  POST /translate  {"text": [...], "beam_size", "nbest", ...}  -> {"translations": [...]}
                   with "stream": true (greedy): server-sent events, one per decoded piece
  GET  /health     200 {"status": "ok", ...}, 503 once the engine failed or is draining
  GET  /metrics    Prometheus text format (`serving/metrics.py`)

Every failure is a JSON body {"error": "<one line>"} with its status: 400 bad JSON or
fields, 413 a body or request over the limits, 503 (with Retry-After) when the queue is
full, 504 past the request timeout, 500 if the engine failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from flaxformer_lite.serving.metrics import Metrics
from flaxformer_lite.serving.service import RequestError, Translator, wait_all

MAX_BODY_BYTES = 1 << 20


def make_app(translator: Translator, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The app; stopping it (lifespan shutdown, after uvicorn drained the requests in
    flight) drains and stops the engine."""
    metrics = Metrics()

    async def translate(request: Request) -> Response:
        start = time.perf_counter()
        try:
            body = await _json_body(request, max_body_bytes)
            settings = translator.check(body)
            if settings.stream:
                return _stream(translator, settings, metrics, start)
            answer = await translator.translate(body)
            metrics.observe(200, time.perf_counter() - start, len(settings.lines))
            return JSONResponse(answer)
        except RequestError as e:
            metrics.observe(e.status, time.perf_counter() - start)
            headers = {"Retry-After": f"{e.retry_after:g}"} if e.retry_after else None
            return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)
        except ClientDisconnect:
            metrics.observe(499, time.perf_counter() - start)
            return Response(status_code=499)

    async def health(request: Request) -> Response:
        engine = translator.engine
        body = {"status": "ok", **engine.gauges()}
        if engine.error or engine.stopping:
            body["status"] = engine.error or "draining"
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def prometheus(request: Request) -> Response:
        engine = translator.engine
        text = metrics.render(engine.gauges(), dict(engine.stats))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(translator.engine.stop)

    routes = [
        Route("/translate", translate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _json_body(request: Request, limit: int):
    """The decoded JSON body, or RequestError 413 (too large) / 400 (not JSON)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body is {declared} bytes, over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError(400, "the body is not UTF-8 text; send JSON in UTF-8") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the body is not valid JSON ({e.msg}, char {e.pos})") from None


def _stream(translator: Translator, settings, metrics: Metrics, start: float) -> Response:
    """Server-sent events: {"line", "text"} per new piece of a line (text since the last
    event), {"line", "done": true, "text", "score"} when a line ends, then "event: end"."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    pieces: dict[int, list[int]] = {}

    def on_tokens(i: int):
        def push(ids: list[int]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (i, ids))

        return push

    errors, jobs = translator.jobs(settings, on_tokens)
    translator.submit(jobs)  # RequestError (503) is raised before the response starts
    decode = translator.vocab.target.decode

    async def produce():
        waiter = asyncio.ensure_future(wait_all(jobs, translator.limits.timeout))
        while not (waiter.done() and events.empty()):
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            i, ids = getter.result()
            before = decode(pieces.get(i, []))
            pieces[i] = pieces.get(i, []) + ids
            text = decode(pieces[i])[len(before) :]
            if text:
                yield _event({"line": i, "text": text})
        try:
            results = waiter.result()
        except RequestError as e:
            yield _event({"error": str(e)}, "error")
            metrics.observe(e.status, time.perf_counter() - start)
            return
        for i in range(len(settings.lines)):
            line = translator.line(i, errors, results)
            yield _event({"line": i, "done": True, **_best(line)})
        yield "event: end\ndata: {}\n\n"
        metrics.observe(200, time.perf_counter() - start, len(settings.lines))

    return StreamingResponse(produce(), media_type="text/event-stream")


def _best(line: dict) -> dict:
    if "error" in line:
        return line
    return line["hypotheses"][0]


def _event(data: dict, name: str | None = None) -> str:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"
