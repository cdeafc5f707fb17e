"""The HTTP face of `jaxnn serve`: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`, and
`/health`, as a Starlette application over an `Engine`.

Starlette, not FastAPI: the API's error bodies and its checks are OpenAI's (`requests`), which FastAPI's own
validation (HTTP 422, its own body) would replace; Starlette gives the routing, streaming responses and disconnect
detection, and uvicorn runs it. HTTP handling never blocks the engine's worker: tokens cross from the worker thread
to the event loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jaxnn.errors import ChatTemplateError, ServerBusyError
from jaxnn.serve.engine import Engine, Request
from jaxnn.serve.requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    BadRequest,
    Sampling,
    chat_messages,
    check_body,
    completion_prompts,
    sampling,
)
from jaxnn.serve.text import Codec

log = logging.getLogger("jaxnn.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the API's default for /v1/completions; chat defaults to the rest of the context
RETRY_AFTER_S = 1


class Served:
    """What the routes share: the engine, the codec, the model's name and its end-of-text ids."""

    def __init__(self, engine: Engine, codec: Codec, name: str, end_ids: frozenset[int]):
        self.engine, self.codec, self.name, self.end_ids = engine, codec, name, end_ids
        self.created = int(time.time())


def create_app(served: Served) -> Any:
    """The Starlette application serving `served`; the engine stops when the application shuts down."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    async def shutdown() -> None:
        await asyncio.get_running_loop().run_in_executor(None, served.engine.stop)

    async def health(_request: Any) -> Any:
        return _json({"status": "ok", **served.engine.load()})

    async def models(_request: Any) -> Any:
        return _json(_models(served))

    async def completions(request: Any) -> Any:
        return await _handle(request, served, chat=False)

    async def chat_completions(request: Any) -> Any:
        return await _handle(request, served, chat=True)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

    async def http_error(request: Any, exc: Any) -> Any:
        return _error(request, BadRequest(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code))

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        await shutdown()

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def _error(request: Any, err: BadRequest) -> Any:
    log.warning("%s %s -> %d: %s", request.method, request.url.path, err.status, err)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status in (429, 503) else None
    return _json(err.body(), err.status, headers)


def _models(served: Served) -> dict:
    entry = {"id": served.name, "object": "model", "created": served.created, "owned_by": "jaxnn",
             "max_model_len": served.engine.context}  # fmt: skip
    return {"object": "list", "data": [entry]}


async def _handle(request: Any, served: Served, chat: bool) -> Any:
    try:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise BadRequest("the request body is not valid JSON") from None
        body = check_body(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        model = body.get("model")
        if model is not None and model != served.name:
            raise BadRequest(f"The model `{model}` does not exist (this server serves `{served.name}`)",
                             param="model", status=404, code="model_not_found")  # fmt: skip
        settings = sampling(body, "max_completion_tokens" if chat else "max_tokens")
        prompts = _prompt_ids(body, served, chat)
        jobs = [_job(ids, settings, served, chat) for ids in prompts]
    except BadRequest as err:
        return _error(request, err)
    reply = _Reply(served, chat, settings, [len(ids) for ids in prompts])
    if settings.stream:
        from starlette.responses import StreamingResponse

        return StreamingResponse(reply.events(jobs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        return _json(await _until_done_or_gone(request, reply.whole(jobs)))
    except BadRequest as err:
        return _error(request, err)


def _prompt_ids(body: dict, served: Served, chat: bool) -> list[list[int]]:
    if chat:
        try:
            return [served.codec.encode_chat(chat_messages(body))]
        except ChatTemplateError as err:
            raise BadRequest(str(err), param="messages") from None
    vocab = served.engine.vocab
    prompts = []
    for prompt in completion_prompts(body):
        ids = served.codec.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise BadRequest("prompt is empty", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise BadRequest(f"prompt holds token ids outside the model's vocabulary [0, {vocab})", param="prompt")
        prompts.append(ids)
    return prompts


def _job(ids: list[int], settings: Sampling, served: Served, chat: bool) -> _Job:
    context = served.engine.context
    default = context - len(ids) if chat else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = settings.max_tokens or min(default, context - len(ids))
    if len(ids) >= context or len(ids) + max_tokens > context:
        raise BadRequest(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the completion). Please "
            "reduce the length of the prompt or completion.",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    return _Job(ids, max_tokens, settings, served)


class _Job:
    """One prompt's generation: its engine request, and its text as it arrives, cut at a stop string."""

    def __init__(self, ids: list[int], max_tokens: int, settings: Sampling, served: Served):
        self.served, self.settings, self.ids = served, settings, ids
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_token(token: int | None, finish: str | None) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(self.queue.put_nowait, (token, finish))

        self.request = Request(
            ids, max_tokens, on_token,
            stop_ids=served.end_ids, temperature=settings.temperature, top_k=settings.top_k,
            top_p=settings.top_p, seed=settings.seed,
        )  # fmt: skip
        self.decoder = served.codec.decoder()
        self.text = ""
        self.sent = 0
        self.produced = 0
        self.finish: str | None = None

    async def deltas(self) -> AsyncIterator[str]:
        """The new text as it becomes final; `finish` is set once it ends. Leaving early cancels the request."""
        engine = self.served.engine
        try:
            engine.submit(self.request)
        except ServerBusyError as err:
            raise BadRequest(f"{err}; retry later", status=503, code="overloaded") from None
        try:
            while self.finish is None:
                token, finish = await self.queue.get()
                if finish is not None and finish.startswith("error"):
                    raise BadRequest(f"generation failed: {finish[len('error: ') :]}", status=500)
                self.produced += 1
                ended = finish == "stop" and token in self.served.end_ids
                self.text += self.decoder.add([] if ended else [token], final=finish is not None)
                self.finish = self._stopped_by_text() or finish
                delta = self._releasable()
                if delta:
                    yield delta
        finally:
            if self.finish is None or self.request.produced < self.request.max_tokens:
                engine.cancel(self.request)  # a stop string, a client gone, or an error: free the slot now

    def _stopped_by_text(self) -> str | None:
        """ "stop" when a stop string appeared (the text cut before it)."""
        cuts = [i for i in (self.text.find(s) for s in self.settings.stop) if i >= 0]
        if not cuts:
            return None
        self.text = self.text[: min(cuts)]
        return "stop"

    def _releasable(self) -> str:
        """Text that no stop string can still claim: all of it once finished, else all but a stop's length - 1."""
        hold = 0 if self.finish is not None else max((len(s) - 1 for s in self.settings.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta


class _Reply:
    """The response of one request in OpenAI's form: whole, or as server-sent events."""

    def __init__(self, served: Served, chat: bool, settings: Sampling, prompt_lengths: list[int]):
        self.served, self.chat, self.settings = served, chat, settings
        self.prompt_tokens = sum(prompt_lengths)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name}

    def _usage(self, jobs: list[_Job]) -> dict:
        completion = sum(j.produced for j in jobs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}  # fmt: skip

    def _choice(self, index: int, text: str | None, finish: str | None, first: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta = {"content": text}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    async def whole(self, jobs: list[_Job]) -> dict:
        async def run(job: _Job) -> None:
            async for _ in job.deltas():
                pass

        await asyncio.gather(*(run(j) for j in jobs))
        if self.chat:
            job = jobs[0]
            choices = [{"index": 0, "message": {"role": "assistant", "content": job.text}, "logprobs": None,
                        "finish_reason": job.finish}]  # fmt: skip
        else:
            choices = [
                {"index": i, "text": j.text, "logprobs": None, "finish_reason": j.finish} for i, j in enumerate(jobs)
            ]
        return {**self._head(False), "choices": choices, "usage": self._usage(jobs)}

    async def events(self, jobs: list[_Job]) -> AsyncIterator[str]:
        """Server-sent events as OpenAI streams them: one chunk per piece of text, each choice's last chunk with its
        finish_reason, the usage chunk if asked for, then `data: [DONE]`. An error ends the stream with an error
        event."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job: _Job) -> None:
            try:
                async for delta in job.deltas():
                    await merged.put((index, delta, None))
                await merged.put((index, "", job.finish))
            except BadRequest as err:
                await merged.put((index, err, "error"))

        tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
        try:
            if self.chat:
                yield _event({**self._head(True), "choices": [self._choice(0, "", None, first=True)]})
            for _ in range(len(jobs)):
                while True:
                    index, delta, finish = await merged.get()
                    if finish == "error":
                        yield _event(delta.body())
                        return
                    if finish is not None:
                        yield _event({**self._head(True), "choices": [self._choice(index, None, finish)]})
                        break
                    yield _event({**self._head(True), "choices": [self._choice(index, delta, None)]})
            if self.settings.include_usage:
                yield _event({**self._head(True), "choices": [], "usage": self._usage(jobs)})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _until_done_or_gone(request: Any, work: Any) -> Any:
    """Awaits `work`, or cancels it (and so frees its slots) when the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task not in done:
        task.cancel()
        raise BadRequest("the client disconnected", status=499)
    return task.result()
