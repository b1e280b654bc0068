"""The engine's one driver: a thread that owns the `LLMEngine`, takes requests from a queue and sends each
request's tokens back to the event loop, step by step."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanovllm.engine.llm_engine import LLMEngine, NewTokens, NonFiniteLogitsError
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm.serve")


@dataclass(eq=False)
class RequestStream:
    """One engine request as the HTTP side sees it. The driver puts ``(stream, kind, payload)`` events into
    ``events`` (an asyncio.Queue of the event loop, shared by the streams of one HTTP request): "admitted"
    (payload: the request id), "tokens" (a `NewTokens`) and "error" (an `EngineError`)."""

    prompt: list[int]
    params: SamplingParams
    events: asyncio.Queue
    index: int = 0  # which prompt of the HTTP request
    request_id: int | None = None  # set by the driver when the engine took it
    # The driver's bookkeeping: samples still running, and whether the first token came.
    samples_left: int = field(default=0, init=False)
    started: bool = field(default=False, init=False)


@dataclass(frozen=True)
class EngineError:
    """Why the driver gave up on a request, with the HTTP status that says so."""

    status: int
    message: str
    kind: str = "invalid_request_error"


@dataclass
class ServerStats:
    """What ``/metrics`` reports. The driver writes it after every step; readers only read."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of the requests scheduled so far
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found in the prefix cache
    num_preemptions: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason


class SchedulerWatch:
    """The scheduler's observer while serving: counts prefix-cache hits and preemptions, and hands every event
    on to the live page's recorder while a page is open (``recorder``)."""

    def __init__(self, stats: ServerStats, block_size: int) -> None:
        self.stats, self.block_size = stats, block_size
        self.recorder: Callable[[str, dict], None] | None = None

    def __call__(self, event: str, payload: dict) -> None:
        if event == "schedule":
            seqs = {seq.seq_id: seq for seq in payload["seqs"]}
            for seq_id, blocks in payload["cache_hits"].items():
                # A request's first allocation (one that resumes after a preemption has completion tokens).
                if seqs[seq_id].num_completion_tokens == 0:
                    self.stats.prefix_cache_hits += len(blocks) * self.block_size
            self.stats.num_preemptions += len(payload["preempted"])
        if self.recorder is not None:
            self.recorder(event, payload)


class EngineDriver:
    """Owns the engine: no other thread calls it. Requests enter through ``inbox`` (a thread-safe queue that even
    a signal handler may write to); each step's tokens leave in one batch, handed to the event loop ``loop``.

    The driver sleeps on the inbox while the engine is idle, and reads it between steps while it works, so a new
    request joins the running batch at the next step.
    """

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, *, max_waiting: int | None = None) -> None:
        self.engine, self.loop, self.max_waiting = engine, loop, max_waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, RequestStream] = {}  # the engine's requests, by request id (driver thread only)
        self.stats = ServerStats()
        self.watch = SchedulerWatch(self.stats, engine.config.kvcache_block_size)
        engine.scheduler.observer = self.watch
        self.submitted = self.admitted = 0  # each written by one thread: the loop's, the driver's
        self.outbox: list[tuple[Any, ...]] = []  # events of the current step, sent in one batch
        self.on_frame: Callable[[list[dict]], None] | None = None  # the live page's hub (see `dashboard`)
        self.frames: list[dict] = []
        self.stopping = False  # set by `stop`: new requests are refused
        self.error: BaseException | None = None  # what stopped the driver, if it was not asked to stop
        self.thread = threading.Thread(target=self._run, name="nanovllm-engine-driver", daemon=True)

    # ---- called from the event loop (or a signal handler) --------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, stream: RequestStream) -> None:
        self.submitted += 1
        self.inbox.put(("add", stream))

    def abort(self, stream: RequestStream, sample_index: int | None = None) -> None:
        """The client is gone (or a stop string ended a sample): free the request's blocks at the next step."""
        self.inbox.put(("abort", stream, sample_index))

    def stop(self) -> None:
        self.stopping = True
        self.inbox.put(("stop",))

    def call(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the driver thread, between two steps (it may use the engine)."""
        self.inbox.put(("call", function))

    @property
    def num_waiting(self) -> int:
        """Requests not computing yet: still in the inbox, or in the engine without their first token."""
        return self.submitted - self.admitted + self.stats.num_requests_waiting

    def overloaded(self) -> bool:
        return self.max_waiting is not None and self.num_waiting >= self.max_waiting

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # ---- the driver thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._read_inbox(wait=self.engine.is_finished()):
                if not self.engine.is_finished():
                    self._step()
                self._update_stats()
                self._flush()
        except BaseException as error:  # a bug of the driver itself: fail what is left, loudly
            logger.exception("the engine driver stopped")
            self.error = error
        finally:
            for stream in list(self.streams.values()):
                self._fail(stream, EngineError(503, "the server is shutting down", "service_unavailable"))
            self.streams.clear()
            self._drain_after_stop()
            self._flush()

    def _read_inbox(self, wait: bool) -> bool:
        """Handle every message in the inbox (waiting for one first if ``wait``); False once asked to stop."""
        try:
            message = self.inbox.get() if wait else self.inbox.get_nowait()
            while True:
                if message[0] == "stop":
                    return False
                self._handle(message)
                message = self.inbox.get_nowait()
        except queue.Empty:
            return True

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            stream = message[1]
            self.admitted += 1
            try:
                stream.request_id = self.engine.add_request(stream.prompt, stream.params)
            except (TypeError, ValueError) as error:
                self._send(stream, "error", EngineError(400, str(error)))
                return
            stream.samples_left = stream.params.n
            self.streams[stream.request_id] = stream
            self.stats.prefix_cache_queries += len(stream.prompt)
            self._send(stream, "admitted", stream.request_id)
        elif kind == "abort":
            stream, sample_index = message[1], message[2]
            if self.streams.get(stream.request_id) is not stream:
                return  # finished (or refused) already
            dropped = self.engine.abort_request(stream.request_id, sample_index)
            if self.watch.recorder is not None and dropped:
                self.watch.recorder("abort", {"seq_ids": dropped})
            stream.samples_left = 0 if sample_index is None else stream.samples_left - 1
            if not stream.samples_left:
                del self.streams[stream.request_id]
        elif kind == "call":
            message[1]()

    def _step(self) -> None:
        try:
            news = self.engine.step_tokens()
        except NonFiniteLogitsError as error:
            # The engine dropped these requests already; the others go on.
            for request_id in error.request_ids:
                if request_id in self.streams:
                    self._fail(self.streams.pop(request_id), EngineError(500, str(error), "internal_server_error"))
            return
        except Exception as error:
            # The model raised in the middle of a step (the engine rolled it back): the requests in the engine
            # cannot be trusted to make progress, so they fail, and the server goes on with new ones.
            logger.exception("a step of the engine failed")
            for stream in list(self.streams.values()):
                self.engine.abort_request(stream.request_id)
                self._fail(stream, EngineError(500, f"the engine failed: {type(error).__name__}: {error}",
                                               "internal_server_error"))
            self.streams.clear()
            return
        for new in news:
            stream = self.streams.get(new.request_id)
            if stream is None:
                continue  # aborted while its last step ran
            if not stream.started:
                stream.started = True
                self.stats.prompt_tokens += len(stream.prompt)
            self.stats.generation_tokens += len(new.token_ids)
            self._send(stream, "tokens", new)
            if new.finished:
                stream.samples_left -= 1
                if not stream.samples_left:
                    del self.streams[new.request_id]

    def _fail(self, stream: RequestStream, error: EngineError) -> None:
        self._send(stream, "error", error)

    def _send(self, stream: RequestStream, kind: str, payload: object) -> None:
        self.outbox.append((stream, kind, payload))

    def _update_stats(self) -> None:
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        self.stats.num_requests_running = len({seq.request_id for seq in scheduler.running})
        self.stats.num_requests_waiting = len({seq.request_id for seq in scheduler.waiting})
        self.stats.kv_cache_usage = len(bm.used_block_ids) / bm.num_blocks

    def _flush(self) -> None:
        """Hand the step's events (and the live page's frames) to the event loop, in one call."""
        events, self.outbox = self.outbox, []
        frames, self.frames = self.frames, []
        if events or frames:
            try:
                self.loop.call_soon_threadsafe(self._deliver, events, frames)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _deliver(self, events: list[tuple], frames: list[dict]) -> None:
        # On the event loop's thread.
        for stream, kind, payload in events:
            stream.events.put_nowait((stream, kind, payload))
        if frames and self.on_frame is not None:
            self.on_frame(frames)

    def _drain_after_stop(self) -> None:
        """Requests that arrived after the stop message are refused, so that no client waits forever."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                self._send(message[1], "error", EngineError(503, "the server is shutting down", "service_unavailable"))


def finish_reason(engine: LLMEngine, params: SamplingParams, token_ids: list[int]) -> str:
    """OpenAI's finish reason of a sample that the engine finished: "stop" on an end-of-sequence token, else
    "length" (it reached max_tokens)."""
    ended = not params.ignore_eos and bool(token_ids) and token_ids[-1] in engine.config.eos_token_ids
    return "stop" if ended else "length"


__all__ = ["EngineDriver", "EngineError", "NewTokens", "RequestStream", "SchedulerWatch", "ServerStats",
           "finish_reason"]
