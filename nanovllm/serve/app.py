"""The HTTP side: FastAPI routes in the shape of OpenAI's API, over the engine driver."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from starlette.exceptions import HTTPException

from nanovllm.engine.llm_engine import LLMEngine, prompt_token_ids
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.dashboard import DashboardHub, page_html
from nanovllm.serve.detokenize import IncrementalDetokenizer
from nanovllm.serve.driver import EngineDriver, RequestStream, finish_reason
from nanovllm.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    ServerError,
    chat_chunk,
    completion_chunk,
    now,
    request_id,
    usage,
)

logger = logging.getLogger("nanovllm.serve")
SHUTTING_DOWN = ServerError(503, "the server is shutting down", "service_unavailable")


@dataclass
class Choice:
    """One choice of a response: a sample of one prompt, as its text grows."""

    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    sent_tokens: int = 0  # tokens whose ids a chunk carried already (``return_token_ids``)

    def new_token_ids(self) -> list[int]:
        ids = self.detokenizer.token_ids[self.sent_tokens : self.num_tokens]
        self.sent_tokens = self.num_tokens
        return ids


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with n samples), and their choices.
    ``events()`` yields ``(choice, text, finished)`` as tokens arrive, until every choice has finished."""

    def __init__(self, driver: EngineDriver, tokenizer: Any, prompts: list[list[int]], params: SamplingParams,
                 stops: list[str]) -> None:
        self.driver, self.params = driver, params
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams = [RequestStream(prompt, params, self.queue, index=i) for i, prompt in enumerate(prompts)]
        self.choices = {(s.index, k): Choice(s.index * params.n + k, IncrementalDetokenizer(tokenizer, stops))
                        for s in self.streams for k in range(params.n)}
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.early: list[tuple] = []  # events that came while other prompts were still being admitted

    @property
    def completion_tokens(self) -> int:
        return sum(choice.num_tokens for choice in self.choices.values())

    @property
    def done(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices.values())

    async def start(self) -> None:
        """Queue every prompt; return once the engine took them all, or raise the error that refused one."""
        driver = self.driver
        if driver.stopping or not driver.alive:
            raise SHUTTING_DOWN
        if driver.overloaded():
            raise ServerError(503, f"the server is overloaded: {driver.num_waiting} requests are waiting "
                                   f"(--max-waiting {driver.max_waiting}); retry later", "server_overloaded",
                              code="server_overloaded")
        for stream in self.streams:
            driver.submit(stream)
        waiting = len(self.streams)
        try:
            while waiting:
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout=5)
                except TimeoutError:
                    if driver.alive:
                        continue
                    raise SHUTTING_DOWN from None
                stream, kind, payload = event
                if kind == "admitted":
                    waiting -= 1
                elif kind == "error" and stream.request_id is None:
                    # The engine refused it: ``n`` beyond max_num_seqs, or a prompt too long for the model or
                    # the KV cache.
                    param = ("n" if payload.message.startswith("n=") else "prompt") if payload.status == 400 else None
                    raise ServerError(payload.status, payload.message, payload.kind, param=param)
                else:
                    self.early.append(event)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Free the engine's blocks of every choice still running (the client went away)."""
        if not self.done:
            for stream in self.streams:
                self.driver.abort(stream)

    async def events(self) -> AsyncIterator[tuple[Choice, str, bool]]:
        while not self.done:
            stream, kind, payload = self.early.pop(0) if self.early else await self.queue.get()
            if kind == "error":
                raise ServerError(payload.status, payload.message, payload.kind)
            if kind != "tokens":
                continue
            choice = self.choices[(stream.index, payload.sample_index)]
            if choice.finish_reason is not None:
                continue  # tokens computed after a stop string ended the sample
            detokenizer = choice.detokenizer
            text = detokenizer.add(payload.token_ids)
            if detokenizer.stopped:
                choice.finish_reason = "stop"
                if not payload.finished:
                    self.driver.abort(stream, payload.sample_index)
            elif payload.finished:
                text += detokenizer.finish()
                choice.finish_reason = "stop" if detokenizer.stopped else \
                    finish_reason(self.driver.engine, self.params, detokenizer.token_ids)
            choice.num_tokens = len(detokenizer.token_ids)
            choice.text += text
            yield choice, text, choice.finish_reason is not None


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


class StatsCollector(Collector):
    """``/metrics``: the driver's `ServerStats`, read at each scrape, with vLLM's metric names."""

    def __init__(self, driver: EngineDriver, model_name: str) -> None:
        self.driver, self.model_name = driver, model_name

    def collect(self) -> Any:
        stats, labels = self.driver.stats, ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, number: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(f"nanovllm:{name}", doc, labels=labels)
            metric.add_metric(value, number)
            return metric

        def counter(name: str, doc: str, number: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(f"nanovllm:{name}", doc, labels=labels)
            metric.add_metric(value, number)
            return metric

        yield gauge("num_requests_running", "Requests with sequences in the running queue.",
                    stats.num_requests_running)
        yield gauge("num_requests_waiting", "Requests with sequences in the waiting queue.",
                    stats.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).", stats.kv_cache_usage)
        hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens scheduled.",
                    hits / queries if queries else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield counter("prompt_tokens", "Prompt tokens of the requests that started.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted (their KV freed, to be recomputed).",
                      stats.num_preemptions)
        finished = CounterMetricFamily("nanovllm:request_success", "Requests finished, by reason.",
                                       labels=[*labels, "finished_reason"])
        for reason, count in sorted(stats.requests_finished.items()):
            finished.add_metric([*value, reason], count)
        yield finished


def create_app(engine: LLMEngine, *, model_name: str, max_waiting: int | None = None) -> FastAPI:
    """The server's application. Its lifespan starts the engine driver and stops it (the engine stays the
    caller's to `exit`). ``app.state.shutdown()`` ends every open stream, from any thread or a signal handler."""

    tokenizer = engine.tokenizer
    config = engine.config
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        driver = EngineDriver(engine, loop, max_waiting=max_waiting)
        hub = DashboardHub(driver)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatsCollector(driver, model_name))
        state.update(driver=driver, hub=hub, registry=registry)

        def shutdown() -> None:  # safe in a signal handler: both calls only queue work
            driver.stop()
            loop.call_soon_threadsafe(hub.close_all)

        app.state.shutdown = shutdown
        driver.start()
        try:
            yield
        finally:
            driver.stop()
            hub.close_all()
            await asyncio.to_thread(driver.thread.join, 60)

    app = FastAPI(title="nano-vllm", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ServerError)
    async def server_error(request: Request, error: ServerError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg')}"
        param = where[0] if where else None
        return JSONResponse(ServerError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(ServerError(error.status_code, str(error.detail), kind).body(),
                            status_code=error.status_code)

    def check_model(body: SamplingRequest) -> None:
        if body.model != model_name:
            raise ServerError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                              "not_found_error", param="model", code="model_not_found")

    def default_max_tokens(prompts: list[list[int]], chat: bool) -> int:
        """OpenAI's defaults: 16 for a completion; for a chat, whatever room the model and the KV cache leave."""
        if not chat:
            return 16
        room = min(config.max_model_len, config.num_kvcache_blocks * config.kvcache_block_size + 1)
        return max(1, room - max(len(p) for p in prompts))

    async def generate(body: SamplingRequest, prompts: list[list[int]], chat: bool, request: Request) -> Response:
        check_model(body)
        stops = body.stop_strings()
        params = body.sampling_params(default_max_tokens(prompts, chat))
        generation = Generation(state["driver"], tokenizer, prompts, params, stops)
        await generation.start()
        rid, created = request_id("chatcmpl" if chat else "cmpl"), now()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(stream_events(generation, rid, created, chat, include_usage,
                                                   body.return_token_ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(generation, rid, created, chat, request, body.return_token_ids)

    async def stream_events(generation: Generation, rid: str, created: int, chat: bool, include_usage: bool,
                            token_ids: bool) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}
        try:
            if chat:
                for choice in sorted(generation.choices.values(), key=lambda c: c.index):
                    yield sse({**chat_chunk(rid, model_name, created, choice.index,
                                            {"role": "assistant", "content": ""}, None), **extra})
            async for choice, text, finished in generation.events():
                if not text and not finished:
                    continue
                reason = choice.finish_reason if finished else None
                if chat:
                    chunk = chat_chunk(rid, model_name, created, choice.index, {"content": text} if text else {},
                                       reason)
                else:
                    chunk = completion_chunk(rid, model_name, created, choice.index, text, reason)
                if token_ids:
                    chunk["choices"][0]["token_ids"] = choice.new_token_ids()
                yield sse({**chunk, **extra})
                if finished:
                    count_finished(choice)
            if include_usage:
                kind = "chat.completion.chunk" if chat else "text_completion"
                yield sse({"id": rid, "object": kind, "created": created, "model": model_name, "choices": [],
                           "usage": usage(generation.prompt_tokens, generation.completion_tokens)})
            yield sse("[DONE]")
        except ServerError as error:
            yield sse(error.body())
            yield sse("[DONE]")
        finally:
            generation.abort()

    async def collect(generation: Generation, rid: str, created: int, chat: bool, request: Request,
                      token_ids: bool) -> Response:
        async def run() -> None:
            async for choice, _text, finished in generation.events():
                if finished:
                    count_finished(choice)

        task = asyncio.ensure_future(run())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    generation.abort()
                    return Response(status_code=499)
            task.result()
        finally:
            generation.abort()
        choices = sorted(generation.choices.values(), key=lambda c: c.index)
        if chat:
            body = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                     "finish_reason": c.finish_reason} for c in choices]
            kind = "chat.completion"
        else:
            body = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                    for c in choices]
            kind = "text_completion"
        if token_ids:
            for choice, item in zip(choices, body, strict=True):
                item["token_ids"] = choice.new_token_ids()
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name, "choices": body,
                             "usage": usage(generation.prompt_tokens, generation.completion_tokens)})

    def count_finished(choice: Choice) -> None:
        finished = state["driver"].stats.requests_finished
        finished[choice.finish_reason] = finished.get(choice.finish_reason, 0) + 1

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = []
        for i, prompt in enumerate(body.prompts()):
            try:
                prompts.append(prompt_token_ids(prompt, tokenizer))
            except (TypeError, ValueError) as error:
                where = f"prompt {i}: " if len(body.prompts()) > 1 else ""
                raise ServerError(400, f"{where}{error}", param="prompt") from None
        return await generate(body, prompts, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ServerError(400, f"the model {model_name!r} has no chat template: use /v1/completions",
                              param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        except Exception as error:  # the template's own checks (jinja raises what it likes)
            raise ServerError(400, f"the chat template refused the messages: {error}", param="messages") from None
        return await generate(body, [list(prompt)], True, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "nanovllm", "root": config.model,
                                            "max_model_len": config.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        driver = state["driver"]
        if driver.stopping or not driver.alive:
            return JSONResponse(SHUTTING_DOWN.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state["registry"]), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard")
    async def dashboard(lang: str = "en") -> HTMLResponse:
        if lang not in ("en", "zh"):
            raise ServerError(400, f"lang must be 'en' or 'zh', got {lang!r}", param="lang")
        return HTMLResponse(page_html(model_name, config.num_kvcache_blocks, config.kvcache_block_size, lang))

    @app.get("/dashboard/events")
    async def dashboard_events(lang: str = "en") -> StreamingResponse:
        if lang not in ("en", "zh"):
            raise ServerError(400, f"lang must be 'en' or 'zh', got {lang!r}", param="lang")
        return StreamingResponse(state["hub"].stream(lang), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
