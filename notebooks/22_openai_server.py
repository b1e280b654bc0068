# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] tags=["en"]
# # 22 · An OpenAI-compatible server
#
# **Goal.** Chapter 21 gave the engine one driver that any number of clients can share. This
# chapter puts HTTP in front of it. By its end you can run `python -m nanovllm.serve` (`./dev
# serve`), a server that the official `openai` client talks to unchanged, with tokens streamed as
# server-sent events; you will know what a client that disconnects frees, how the server says "too
# busy", and what keeps one careless client from hurting the others. Chapter 23 measures it;
# appendix C gives it a live page (`/dashboard`) that shows the KV cache of the running server
# with the player of appendix A.

# %% [markdown] tags=["zh"]
# # 22 · 兼容 OpenAI 的服务器
#
# **目标：** 第 21 章给引擎配了一个驱动，任意多个客户端都可以共用它。本章在它前面放上 HTTP。读完本章，你能运行
# `python -m nanovllm.serve`（`./dev serve`）：一个服务器，官方的 `openai` 客户端无需任何改动就能和它对话，token 以
# 服务器发送事件（server-sent events，SSE）的形式流式返回；你会知道断开连接的客户端会释放什么，服务器怎样说“太忙了”，
# 以及是什么让一个不讲理的客户端拖累不了别人。第 23 章测量它；附录 C 给它加上一个实时页面（`/dashboard`），用附录 A
# 的播放器展示运行中的服务器的 KV 缓存。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "serving {models} at {url}": "正在提供 {models} 服务，地址 {url}",
    "non-streamed: {text!r} {reason} {usage}": "非流式：{text!r} {reason} {usage}",
    "streamed: {pieces}": "流式：{pieces}",
    "{name:24} during the stream {during:8.3f}   after the client left {after:8.3f}":
        "{name:24} 流进行中 {during:8.3f}   客户端离开后 {after:8.3f}",
    "all exercise answers check out; the server exited with status {status}":
        "练习答案全部验证通过；服务器已退出，退出状态 {status}",
})

# %% [markdown] tags=["en"]
# ## The API: OpenAI's shapes
#
# The server speaks the OpenAI API so that the official `openai` client, and every tool built on
# it, works unchanged: `GET /v1/models`, `POST /v1/completions` (a prompt as text or token ids, or
# a list of prompts), `POST /v1/chat/completions` (messages through the tokenizer's chat template).
# Requests are checked by pydantic models, with strict types. Unknown fields are accepted and
# ignored, as vLLM does, and each name is logged once: a gateway in front of the server adds its
# own (SGLang's router adds its sampling fields to every request). Fields of the API that this
# server does not implement are accepted only at their neutral values (`logprobs`, penalties), or
# refused by name where ignoring them would change what the client gets (`response_format`,
# `tools`). `top_k`, `ignore_eos` and `return_token_ids` are extra fields, as vLLM accepts them.
#
# Every error has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and its HTTP
# status: 400 for a bad field (pydantic's and the engine's own checks: `max_tokens < 1`, `n` beyond
# `max_num_seqs`, a prompt longer than the model or the KV cache allows), 404 for a model this
# server does not serve, 503 with `Retry-After` when it is overloaded or shutting down, 500 when
# the engine failed. A streamed response is `data: {json}` events, then `data: [DONE]`; each choice
# ends with one `finish_reason`: `"stop"` (an end-of-sequence token or a stop string) or
# `"length"` (`max_tokens`). With `stream_options.include_usage`, a last event carries the token
# counts.

# %% [markdown] tags=["zh"]
# ## API：OpenAI 的格式
#
# 服务器讲 OpenAI 的 API，这样官方的 `openai` 客户端以及所有基于它的工具都无需改动就能使用：`GET /v1/models`、
# `POST /v1/completions`（提示词可以是文本或 token id，也可以是提示词列表）、`POST /v1/chat/completions`（消息经过分词器
# 的聊天模板）。请求由 pydantic 模型按严格的类型检查。未知字段照单全收、不予理会，和 vLLM 一样，每个字段名在日志里
# 记一次：服务器前面的网关会加上它自己的字段（SGLang 的路由器给每个请求都加上它的采样字段）。本服务器没有实现的 API
# 字段，有的只在取中性值时才接受（`logprobs`、各种惩罚项），有的则点名拒绝，因为不理会它们就会改变客户端拿到的结果
# （`response_format`、`tools`）。`top_k`、`ignore_eos` 和 `return_token_ids` 是额外字段，与 vLLM 的接受方式相同。
#
# 每个错误都是 OpenAI 的格式 `{"error": {"message", "type", "param", "code"}}`，并带有对应的 HTTP 状态码：字段错误是 400
# （pydantic 的检查和引擎自己的检查：`max_tokens < 1`、`n` 超过 `max_num_seqs`、提示词比模型或 KV 缓存允许的更长），
# 本服务器不提供的模型是 404，过载或正在关闭时是带 `Retry-After` 的 503，引擎出错是 500。流式响应是一串
# `data: {json}` 事件，最后是 `data: [DONE]`；每个选项以一个 `finish_reason` 结束：`"stop"`（结束符或停止字符串）或
# `"length"`（达到 `max_tokens`）。设置 `stream_options.include_usage` 时，最后一个事件带上 token 计数。

# %% openai shapes
#| export serve.protocol
"""The OpenAI API's shapes: request bodies (checked by pydantic), response bodies and errors."""
# zh: OpenAI API 的各种格式：请求体（由 pydantic 检查）、响应体和错误。

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm.sampling_params import SamplingParams


class ServerError(Exception):
    """An error the client gets in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``."""
    # zh: 客户端以 OpenAI 的格式收到的错误：``{"error": {"message", "type", "param", "code"}}``。

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check_text(text: str, what: str, param: str) -> None:
    """Refuse text that holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one) by name, as the engine refuses
    such a prompt: no tokenizer should meet it."""
    # zh: 指名拒绝含有孤立代理项的文本（JSON 的 ``"\\ud800"`` 解码出来就是一个），就像引擎拒绝这样的提示词一样：
    # zh: 不该让任何分词器碰到它。
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ServerError(400, f"{what} is not valid text: it holds a lone surrogate, {text[error.start]!r} at "
                          f"index {error.start}", param=param) from None


# en: OpenAI takes 4 stop strings; more than this is a way to make every token's check slow, not a stop list.
# zh: OpenAI 只接受 4 个停止字符串；比这更多就不是停止列表，而是让每个 token 的检查都变慢的手段。
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1024
# en: The most choices (prompts × n) one completion request may ask for: each gets its state (a sequence, a
# en: detokenizer) before any is computed, and a 4 MiB body holds a million one-character prompts.
# zh: 一个补全请求最多能要的选项数（提示词数 × n）：每个选项在计算之前就要有自己的状态（一个序列、一个反分词器），
# zh: 而 4 MiB 的请求体能装下一百万个单字符的提示词。
MAX_CHOICES = 4096
# en: OpenAI's (and vLLM's) fields that would change what the client gets, which this server does not implement:
# en: ignored, they would pass in silence; they are refused by name.
# zh: OpenAI（以及 vLLM）的这些字段会改变客户端拿到的结果，而本服务器没有实现：如果不理会，它们就会悄悄溜过去；所以
# zh: 点名拒绝。
NOT_IMPLEMENTED = frozenset({"response_format", "tools", "tool_choice", "functions", "function_call",
                             "parallel_tool_calls", "structured_outputs", "guided_json", "guided_regex",
                             "guided_choice", "guided_grammar", "top_logprobs", "prompt_logprobs"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are accepted and ignored, as vLLM does (`ignored_fields`);
    fields of the OpenAI API that this server does not implement are accepted only at their neutral values, or
    refused by name (NOT_IMPLEMENTED). Types are strict, as the engine's own API is: ``true`` is not a number of
    tokens, ``"yes"`` is not a boolean (an integer is still a float)."""
    # zh: 两个端点共有的字段。未知字段和 vLLM 一样照单全收、不予理会（`ignored_fields`）；本服务器没有实现的 OpenAI
    # zh: API 字段，要么只在取中性值时才接受，要么点名拒绝（NOT_IMPLEMENTED）。类型是严格的，和引擎自己的 API 一样：
    # zh: ``true`` 不是 token 数，``"yes"`` 不是布尔值（整数仍然可以当作浮点数）。

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # en: Extra body fields, as vLLM accepts them (the openai client sends them with ``extra_body``).
    # zh: 额外的请求体字段，与 vLLM 接受的一样（openai 客户端用 ``extra_body`` 发送它们）。
    top_k: int | None = None
    ignore_eos: bool = False
    # en: Each choice (each chunk) also carries its token ids, as vLLM's option does
    # zh: 每个选项（每个分块）还带上它的 token id，与 vLLM 的同名选项一样
    return_token_ids: bool = False
    # en: Accepted, but only where they change nothing.
    # zh: 可以接受，但只限于不改变任何东西的取值。
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def unsupported(self) -> dict[str, Any]:
        """Fields set to something this server cannot do: name -> value."""
        # zh: 设成了本服务器做不到的值的字段：名称 -> 值。
        neutral = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
                   "logprobs": (None, False)}
        return {name: getattr(self, name) for name, ok in neutral.items() if getattr(self, name) not in ok}

    def ignored_fields(self) -> list[str]:
        """The fields this server does not know, which it ignores; one that asks for what it does not do is refused by
        name."""
        # zh: 本服务器不认识、因而不予理会的字段；要求它做它做不到的事的字段，点名拒绝。
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in NOT_IMPLEMENTED and value is not None:
                raise ServerError(400, f"{name} is not supported by this server", param=name)
        return list(extra)

    def stop_strings(self) -> list[str]:
        """The stop strings, checked: each generated token is looked for in all of them, and the text waits for the
        longest one's length, so their number and length are bounded."""
        # zh: 检查过的停止字符串：每个生成的 token 都要在所有停止字符串里查找，文本还要按最长那个的长度扣住不发，
        # zh: 所以它们的个数和长度都有上限。
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ServerError(400, f"stop holds {len(stops)} strings, more than {MAX_STOP_STRINGS}", param="stop")
        for i, stop in enumerate(stops):
            if not stop:
                raise ServerError(400, "stop strings must not be empty", param="stop")
            if len(stop) > MAX_STOP_CHARS:
                raise ServerError(400, f"stop string {i} is {len(stop)} characters long, more than {MAX_STOP_CHARS}",
                                  param="stop")
            check_text(stop, f"stop string {i}", "stop")
        return stops

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (``max_tokens``: what to use when the request gives none)."""
        # zh: 引擎的采样参数（``max_tokens``：请求没有给出时使用的值）。
        for name, value in self.unsupported().items():
            raise ServerError(400, f"{name}={value!r} is not supported by this server", param=name)
        # en: vLLM's "no limit" values
        # zh: vLLM 表示“不限制”的取值
        top_k = None if self.top_k in (None, -1, 0) else self.top_k
        fields = {"temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p, "max_tokens": self.requested_max_tokens(),
                  "n": self.n, "seed": self.seed, "top_k": top_k, "ignore_eos": self.ignore_eos}
        if fields["max_tokens"] is None:
            fields["max_tokens"] = max_tokens
        try:
            return SamplingParams(**fields)
        except (TypeError, ValueError) as error:
            message, name = str(error), str(error).split(" ", 1)[0]
            # en: The engine says max_tokens; the client may have said max_completion_tokens.
            # zh: 引擎说的是 max_tokens；客户端说的可能是 max_completion_tokens。
            if name == "max_tokens":
                name, message = self.max_tokens_field(), message.replace("max_tokens", self.max_tokens_field(), 1)
            raise ServerError(400, message, param=name if name in fields or name == self.max_tokens_field()
                              else None) from None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The name of the field that gave the limit on generated tokens."""
        # zh: 给出生成 token 数上限的那个字段的名称。
        return "max_tokens"


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt (text or token ids), or a list of them."""
    # zh: ``POST /v1/completions``：一个提示词（文本或 token id），或者一组提示词。

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> dict[str, Any]:
        extra = {"echo": self.echo} if self.echo else {}
        if self.suffix:
            extra["suffix"] = self.suffix
        if self.best_of not in (None, 1, self.n):
            extra["best_of"] = self.best_of
        return {**super().unsupported(), **extra}

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a str or a list of token ids."""
        # zh: 各个提示词，每个是一个 str 或者一个 token id 列表。
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ServerError(400, "prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages, formatted by the tokenizer's chat template."""
    # zh: ``POST /v1/chat/completions``：消息，经分词器的聊天模板排成提示词。

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def now() -> int:
    return int(time.time())

# %% [markdown] tags=["en"]
# A `Generation` is the server's side of one HTTP request: one engine request per prompt, each
# with its `n` samples, and a `Choice` per sample (choice `i * n + k` is sample `k` of prompt `i`,
# as in OpenAI's API). `start()` submits the prompts and waits until the engine took them all, so
# that a refusal is still an ordinary error response; `events()` turns the driver's token events
# into text, choice by choice. When a stop string ends a sample, the sample is aborted in the
# engine: its blocks are not kept busy for text nobody will read.

# %% [markdown] tags=["zh"]
# `Generation` 是服务器这一侧的一次 HTTP 请求：每个提示词一个引擎请求，每个请求有它的 `n` 个样本，每个样本一个
# `Choice`（与 OpenAI 的 API 一样，选项 `i * n + k` 是提示词 `i` 的样本 `k`）。`start()` 提交各个提示词，并等到引擎
# 全部接收，这样拒绝仍然是一个普通的错误响应；`events()` 把驱动的 token 事件逐个选项地变成文本。当停止字符串
# 结束一个样本时，这个样本会在引擎中被中止：没人会读的文本不该占着它的块。

# %% generation
#| export serve.app
"""The HTTP side: FastAPI routes in the shape of OpenAI's API, over an `EngineClient`."""
# zh: HTTP 一侧：建在 `EngineClient` 之上、符合 OpenAI API 格式的 FastAPI 路由。

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from starlette.exceptions import HTTPException

from nanovllm.engine.inputs import prompt_token_ids
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.detokenize import IncrementalDetokenizer
from nanovllm.serve.client import EngineClient, EngineThread, RequestStream
from nanovllm.serve.driver import SHUTTING_DOWN_ERROR, EngineError, Recorder, finish_reason
from nanovllm.serve.guards import (
    ApiKey,
    BodyLimit,
    HostGuard,
    RequestLimit,
    check_api_key,
    default_max_body_bytes,
    max_prompt_chars,
)
from nanovllm.serve.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    ServerError,
    chat_chunk,
    check_text,
    completion_chunk,
    now,
    request_id,
    usage,
)

_logger = logging.getLogger("nanovllm.serve")


def from_engine(error: EngineError, param: str | None = None) -> ServerError:
    """The driver's `EngineError` as the client gets it, in OpenAI's shape."""
    # zh: 驱动的 `EngineError`，以 OpenAI 的格式交给客户端。
    return ServerError(error.status, error.message, error.kind, param=param)


SHUTTING_DOWN = from_engine(SHUTTING_DOWN_ERROR)


@dataclass
class Choice:
    """One choice of a response: a sample of one prompt, as its text grows."""
    # zh: 响应中的一个选项：一个提示词的一个样本，文本随生成不断增长。

    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    # en: Tokens whose ids a chunk carried already (``return_token_ids``)
    # zh: id 已经由某个分块带出的 token 数（``return_token_ids``）
    sent_tokens: int = 0
    # en: When its first and its latest tokens reached the server (time.monotonic()), for the latency histograms
    # zh: 它的第一个和最近一个 token 到达服务器的时刻（time.monotonic()），供延迟直方图使用
    first_token_at: float | None = None
    last_token_at: float | None = None

    def new_token_ids(self) -> list[int]:
        ids = self.detokenizer.token_ids[self.sent_tokens : self.num_tokens]
        self.sent_tokens = self.num_tokens
        return ids


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with n samples), and their choices.
    ``events()`` yields ``(choice, text, finished)`` as tokens arrive, until every choice has finished."""
    # zh: 一个 HTTP 请求的各个引擎请求（每个提示词一个，每个有 n 个样本），以及它们的选项。``events()`` 随着 token 的
    # zh: 到达产出 ``(choice, text, finished)``，直到每个选项都结束。

    def __init__(self, engine: EngineClient, prompts: list[list[int]], params: SamplingParams,
                 stops: list[str], latency: TokenLatency | None = None) -> None:
        self.engine, self.params, self.latency = engine, params, latency
        self.arrived = time.monotonic()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams = [RequestStream(prompt, params, self.queue, index=i) for i, prompt in enumerate(prompts)]
        self.choices = {(s.index, k): Choice(s.index * params.n + k, IncrementalDetokenizer(engine.tokenizer, stops))
                        for s in self.streams for k in range(params.n)}
        self.prompt_tokens = sum(len(p) for p in prompts)
        # en: Events that came while other prompts were still being admitted
        # zh: 其他提示词还在等待被接收时到来的事件
        self.early: list[tuple] = []

    @property
    def completion_tokens(self) -> int:
        return sum(choice.num_tokens for choice in self.choices.values())

    @property
    def done(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices.values())

    async def start(self) -> None:
        """Queue every prompt; return once the engine took them all, or raise the error that refused one."""
        # zh: 把每个提示词排进队列；引擎全部接收后返回，或者抛出拒绝了其中某一个的那个错误。
        engine = self.engine
        if engine.stopping or not engine.alive:
            raise SHUTTING_DOWN
        if not engine.responsive:
            raise from_engine(engine.silence_error())
        if engine.overloaded():
            raise ServerError(503, f"the server is overloaded: {engine.num_waiting} requests are waiting "
                                   f"(--max-waiting {engine.max_waiting}); retry later", "server_overloaded",
                              code="server_overloaded")
        for stream in self.streams:
            engine.submit(stream)
        waiting = len(self.streams)
        try:
            while waiting:
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout=5)
                except TimeoutError:
                    if engine.alive:
                        continue
                    raise SHUTTING_DOWN from None
                stream, kind, payload = event
                if kind == "admitted":
                    waiting -= 1
                elif kind == "error" and stream.request_id is None:
                    # en: The engine refused it: ``n`` beyond max_num_seqs, or a prompt too long for the model or
                    # en: the KV cache.
                    # zh: 引擎拒绝了它：``n`` 超过 max_num_seqs，或者提示词对模型或 KV 缓存来说太长。
                    param = ("n" if payload.message.startswith("n=") else "prompt") if payload.status == 400 else None
                    raise from_engine(payload, param=param)
                else:
                    self.early.append(event)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Free the engine's blocks of every choice still running (the client went away)."""
        # zh: 释放每个仍在运行的选项占用的引擎块（客户端已经离开）。
        if not self.done:
            for stream in self.streams:
                self.engine.abort(stream)

    async def events(self) -> AsyncIterator[tuple[Choice, str, bool]]:
        while not self.done:
            if not self.early:
                self.early.append(await self.queue.get())
            # en: Everything that came meanwhile too: a server that fell behind sends several steps' tokens of a
            # en: choice in one chunk, and catches up.
            # zh: 连同这期间到来的一切：落后的服务器把一个选项好几步的 token 放在一个分块里发出，从而追上进度。
            while not self.queue.empty():
                self.early.append(self.queue.get_nowait())
            events, self.early = self.early, []
            texts: dict[int, tuple[Choice, str]] = {}
            arrived = time.monotonic()
            for stream, kind, payload in events:
                if kind == "error":
                    raise from_engine(payload)
                if kind != "tokens":
                    continue
                sample_index, token_ids, finished = payload
                choice = self.choices[(stream.index, sample_index)]
                if choice.finish_reason is not None:
                    # en: Tokens computed after a stop string ended the sample
                    # zh: 停止字符串结束了样本之后才算出的 token
                    continue
                text = self._add(choice, stream, sample_index, token_ids, finished)
                if self.latency is not None:
                    self.latency.observe(choice, len(token_ids), arrived - self.arrived, arrived)
                texts[choice.index] = (choice, texts[choice.index][1] + text if choice.index in texts else text)
            for choice, text in texts.values():
                yield choice, text, choice.finish_reason is not None

    def _add(self, choice: Choice, stream: RequestStream, sample_index: int, token_ids: list[int],
             finished: bool) -> str:
        """A choice's new tokens: their text (held back near a possible stop string), and the end they made."""
        # zh: 一个选项的新 token：它们的文本（接近可能的停止字符串时扣住不发），以及它们造成的结束。
        detokenizer = choice.detokenizer
        text = detokenizer.add(token_ids)
        if detokenizer.stopped:
            choice.finish_reason = "stop"
            if not finished:
                self.engine.abort(stream, sample_index)
        elif finished:
            text += detokenizer.finish()
            choice.finish_reason = "stop" if detokenizer.stopped else \
                finish_reason(self.engine.info.eos_token_ids, self.params, detokenizer.token_ids)
        choice.num_tokens = len(detokenizer.token_ids)
        choice.text += text
        return text

# %% [markdown] tags=["en"]
# The routes sit at the module's top level, as in any FastAPI project, in two routers:
# `openai_routes` (completions, chat completions, models) and `server_routes` (health, metrics;
# appendix C adds its live page there). What they share (the engine's client, the model's limits,
# the thread that tokenizes) is one `Api` object, which a route finds at `request.app.state.api`. `create_app`
# puts an application together from them. Its *lifespan* starts the driver when the server
# starts and stops it when the server stops; `app.state.shutdown()` only queues work, so a signal
# handler may call it. `/metrics` is Prometheus text (`prometheus_client`), with vLLM's metric
# names under the `nanovllm:` prefix: `num_requests_running`, `num_requests_waiting`,
# `kv_cache_usage_perc` (blocks in use / all blocks), `prefix_cache_hit_rate`, and counters of
# prompt and generated tokens, preemptions and finished requests. The five that gateways and
# dashboards read are also given under vLLM's own prefix (`vllm:num_requests_waiting`, ...), and
# `TokenLatency` adds vLLM's histograms, observed where tokens reach the server: time to first
# token, the gap between tokens, and each request's time per output token. An engine feature that a later
# chapter adds brings its own counters: a function in `ENGINE_COUNTERS` that reads them off the
# engine, and their help lines in `ENGINE_COUNTER_HELP`.

# %% [markdown] tags=["zh"]
# 路由和任何 FastAPI 项目一样写在模块顶层，分在两个 router 里：`openai_routes`（completions、chat completions、
# models）和 `server_routes`（健康检查、指标；附录 C 把它的实时页面也加在这里）。它们共用的东西（引擎的客户端、
# 模型的各项上限、负责分词的线程）放在一个 `Api` 对象里，路由在 `request.app.state.api` 找到它。`create_app` 用这些
# 拼出一个应用。它的 *lifespan* 在服务器启动时启动驱动，在服务器停止时停止它；
# `app.state.shutdown()` 只是把工作放进队列，所以信号处理函数可以调用它。`/metrics` 是 Prometheus 文本格式
# （`prometheus_client`），指标名与 vLLM 相同，前缀为 `nanovllm:`：`num_requests_running`、`num_requests_waiting`、
# `kv_cache_usage_perc`（在用的块 / 全部块）、`prefix_cache_hit_rate`，以及提示词 token、生成 token、抢占和已完成
# 请求的计数器。网关和监控面板读的那五个，还以 vLLM 自己的前缀再给一遍（`vllm:num_requests_waiting` 等）；
# `TokenLatency` 加上 vLLM 的直方图，在 token 到达服务器的地方观测：首个 token 的时间、token 之间的间隔，以及每个
# 请求平均每个输出 token 的时间。后面章节加上的引擎功能会带来自己的计数器：`ENGINE_COUNTERS` 里一个从引擎上读出
# 它们的函数，以及 `ENGINE_COUNTER_HELP` 里它们的说明。

# %% app
#| export serve.app
def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


class StatsCollector(Collector):
    """``/metrics``: the driver's `ServerStats` (as of its last step), read at each scrape: vLLM's metric names
    under our prefix, and the five that gateways read under vLLM's own."""
    # zh: ``/metrics``：驱动的 `ServerStats`（截至它的上一步），每次抓取时读取：vLLM 的指标名加上我们的前缀，
    # zh: 网关读的那五个再用 vLLM 自己的前缀给一遍。

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Any:
        stats, labels = self.engine.stats, ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, number: float, prefix: str = "nanovllm") -> GaugeMetricFamily:
            metric = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            metric.add_metric(value, number)
            return metric

        def counter(name: str, doc: str, number: float, prefix: str = "nanovllm") -> CounterMetricFamily:
            metric = CounterMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            metric.add_metric(value, number)
            return metric

        hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
        # en: Under vLLM's names as well as ours: gateways (llm-d, NVIDIA Dynamo, SGLang's) and dashboards read those.
        # zh: 既用我们的名字，也用 vLLM 的名字：网关（llm-d、NVIDIA Dynamo、SGLang 的）和监控面板读的是后者。
        for prefix in ("nanovllm", "vllm"):
            yield gauge("num_requests_running", "Requests with sequences in the running queue.",
                        stats.num_requests_running, prefix)
            yield gauge("num_requests_waiting", "Requests with sequences in the waiting queue.",
                        stats.num_requests_waiting, prefix)
            yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).", stats.kv_cache_usage,
                        prefix)
            yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries, prefix)
            yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits, prefix)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens scheduled.",
                    hits / queries if queries else 0.0)
        yield counter("prompt_tokens", "Prompt tokens of the requests that started.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted (their KV freed, to be recomputed).",
                      stats.num_preemptions)
        steps = CounterMetricFamily("nanovllm:engine_steps", "Steps of the engine, by kind.", labels=[*labels, "kind"])
        seconds = CounterMetricFamily("nanovllm:engine_step_seconds", "Wall time of the engine's steps, by kind.",
                                      labels=[*labels, "kind"])
        for kind in sorted(stats.steps):
            steps.add_metric([*value, kind], stats.steps[kind])
            seconds.add_metric([*value, kind], stats.step_seconds[kind])
        yield steps
        yield seconds
        finished = CounterMetricFamily("nanovllm:request_success", "Requests finished, by reason.",
                                       labels=[*labels, "finished_reason"])
        for reason, count in sorted(self.engine.requests_finished.items()):
            finished.add_metric([*value, reason], count)
        yield finished
        yield from engine_counter_families(stats.engine_counters, labels, value)


# en: vLLM's buckets, in seconds: for the time to first token, and for the gaps between tokens.
# zh: vLLM 的分桶，单位秒：首个 token 的时间用一组，token 之间的间隔用另一组。
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)


class TokenLatency:
    """vLLM's latency histograms, observed where the tokens reach the server: the time to each choice's first token
    (from when the request was queued), the gap between tokens, and each finished choice's time per output token.
    Tokens that came in one chunk (several steps' worth, when the server fell behind) share their gap."""
    # zh: vLLM 的延迟直方图，在 token 到达服务器的地方观测：每个选项的首个 token 的时间（从请求排入队列时算起）、
    # zh: token 之间的间隔，以及每个结束的选项平均每个输出 token 的时间。一个分块里一起到达的 token（服务器落后时，
    # zh: 好几步的 token）平分它们的间隔。

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"vllm:{name}", doc, ["model_name"], registry=registry, buckets=buckets).labels(
                model_name)

        self.first_token = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.token_gap = histogram("inter_token_latency_seconds", "Time between tokens.", TOKEN_GAP_BUCKETS)
        self.per_token = histogram("request_time_per_output_token_seconds",
                                   "Time per output token of each finished request.", TOKEN_GAP_BUCKETS)

    def observe(self, choice: Choice, count: int, waited: float, now: float) -> None:
        """``count`` tokens of ``choice`` arrived ``now``, ``waited`` seconds after the request was queued."""
        # zh: ``choice`` 的 ``count`` 个 token 在 ``now`` 到达，这时离请求排入队列已过去 ``waited`` 秒。
        if choice.first_token_at is None:
            self.first_token.observe(waited)
            choice.first_token_at = now
        else:
            gap = (now - choice.last_token_at) / count
            for _ in range(count):
                self.token_gap.observe(gap)
        choice.last_token_at = now
        if choice.finish_reason is not None and choice.num_tokens > 1:
            self.per_token.observe((now - choice.first_token_at) / (choice.num_tokens - 1))


# en: The help line of each engine counter (ServerStats.engine_counters), by metric name: later chapters add theirs.
# zh: 每个引擎计数器（ServerStats.engine_counters）的说明，按指标名：后面的章节加上它们自己的。
ENGINE_COUNTER_HELP: dict[str, str] = {}
LABELED_NAME = re.compile(r'(\w+)\{(\w+)="([^"]*)"\}')


def engine_counter_families(counters: dict[str, float], labels: list[str], value: list[str]) -> list:
    """ServerStats.engine_counters as counter families, one per metric name, with its label when it has one."""
    # zh: 把 ServerStats.engine_counters 变成计数器指标族，每个指标名一个，有标签时带上它的标签。
    families: dict[str, CounterMetricFamily] = {}
    for key, number in sorted(counters.items()):
        labeled = LABELED_NAME.fullmatch(key)
        name, extra = (labeled[1], [(labeled[2], labeled[3])]) if labeled else (key, [])
        if name not in families:
            families[name] = CounterMetricFamily(f"nanovllm:{name}", ENGINE_COUNTER_HELP.get(name, name),
                                                 labels=[*labels, *(label for label, _ in extra)])
        families[name].add_metric([*value, *(text for _, text in extra)], number)
    return list(families.values())


_T = TypeVar("_T")


def live_page_hub(client: EngineClient) -> Any | None:
    """What feeds the server's live page (the KV cache, drawn as it changes) to the views that are open, or None:
    this server has no live page."""
    # zh: 把服务器的实时页面（随变化绘制的 KV 缓存）送给已打开的视图的东西，或者 None：本服务器没有实时页面。
    return None


def live_page_recorder() -> Recorder | None:
    """What the engine's driver attaches to the scheduler while a live page is open, or None: no live page."""
    # zh: 实时页面打开时，引擎的驱动挂到调度器上的东西，或者 None：没有实时页面。
    return None


class Api:
    """What the routes of one application share: the engine's client, the model's name and limits, the thread that
    tokenizes, the live page's hub and the metrics' registry. A route finds it at ``request.app.state.api``."""
    # zh: 一个应用的各个路由共享的东西：引擎的客户端、模型的名称和各项上限、做分词的线程、实时页面的中枢和指标的注册表。
    # zh: 路由在 ``request.app.state.api`` 找到它。

    # en: Unknown request fields logged (each once), at most
    # zh: 最多记录多少个未知的请求字段名（每个记一次）
    MAX_LOGGED = 256

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client, self.model_name = client, model_name
        # en: The unknown request fields logged so far
        # zh: 已经记进日志的未知请求字段
        self.ignored: set[str] = set()
        self.tokenizer, self.info = client.tokenizer, client.info
        self.max_chars = max_prompt_chars(self.tokenizer, self.info.max_model_len)
        # en: One thread tokenizes: a long prompt never holds up the event loop (/health, the other streams), and a
        # en: tokenizer is not meant to be called from several threads at once.
        # zh: 由一个线程负责分词：长提示词不会卡住事件循环（/health、其他流），而且分词器本来就不该被几个线程同时调用。
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-tokenizer")
        self.hub = live_page_hub(client)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(client, model_name))
        self.latency = TokenLatency(self.registry, model_name)

    async def off_loop(self, work: Callable[[], _T]) -> _T:
        """``work()`` on the tokenizer's thread, awaited."""
        # zh: 在分词器的线程上运行 ``work()``，并等待它完成。
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, work)

    def check_request(self, body: SamplingRequest) -> None:
        """What can be refused before anything is tokenized or built: the model's name, an ``n`` beyond the engine's
        limit (each of the n choices gets its state here, so an n of millions would stall the server), the stop
        strings."""
        # zh: 在分词或构造任何东西之前就能拒绝的内容：模型名称、超出引擎上限的 ``n``（n 个选项在这里各自建立状态，
        # zh: 所以上百万的 n 会让服务器停顿）、停止字符串。
        if body.model != self.model_name:
            raise ServerError(404, f"the model {body.model!r} does not exist; this server serves "
                              f"{self.model_name!r}", "not_found_error", param="model", code="model_not_found")
        if body.n > self.info.max_num_seqs:
            raise ServerError(400, f"n={body.n} is more than this server's max_num_seqs ({self.info.max_num_seqs}): "
                              "a request's samples are computed together", param="n")
        body.stop_strings()
        for name in body.ignored_fields():
            # en: Said once per name, and for at most MAX_LOGGED names: a client cannot make the log, or this set, grow
            # en: without end.
            # zh: 每个字段名只说一次，最多记 MAX_LOGGED 个名字：客户端没法让日志或这个集合无限地长下去。
            if name not in self.ignored and len(self.ignored) < self.MAX_LOGGED:
                self.ignored.add(name)
                _logger.warning("nano-vllm: ignoring the request field %r, which this server does not know (said "
                                "once per field name)", name[:100])

    def check_length(self, length: int, what: str, param: str) -> None:
        """Text too long to fit in max_model_len tokens, refused before a tokenizer spends seconds on it."""
        # zh: 长到放不进 max_model_len 个 token 的文本，在分词器为它花上几秒之前就被拒绝。
        if length > self.max_chars:
            raise ServerError(400, f"{what} is {length} characters long: more than {self.info.max_model_len} tokens "
                              f"(max_model_len) of this model can hold, at most {self.max_chars} characters",
                              param=param)

    def default_max_tokens(self, prompts: list[list[int]], chat: bool) -> int:
        """OpenAI's defaults: 16 for a completion; for a chat, whatever room the model and the KV cache leave."""
        # zh: OpenAI 的默认值：补全请求是 16；聊天请求则是模型和 KV 缓存剩下的全部空间。
        if not chat:
            return 16
        room = min(self.info.max_model_len, self.info.num_kvcache_blocks * self.info.kvcache_block_size + 1)
        return max(1, room - max(len(p) for p in prompts))

    async def generate(self, body: SamplingRequest, prompts: list[list[int]], chat: bool,
                       request: Request) -> Response:
        """Run the request's prompts: a stream of server-sent events, or one response once every choice ended."""
        # zh: 运行请求的提示词：返回一串服务器发送事件，或者在每个选项都结束后返回一个完整响应。
        stops = body.stop_strings()
        params = body.sampling_params(self.default_max_tokens(prompts, chat))
        generation = Generation(self.client, prompts, params, stops, self.latency)
        await generation.start()
        rid, created = request_id("chatcmpl" if chat else "cmpl"), now()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(self.stream_events(generation, rid, created, chat, include_usage,
                                                        body.return_token_ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.collect(generation, rid, created, chat, request, body.return_token_ids)

    async def stream_events(self, generation: Generation, rid: str, created: int, chat: bool, include_usage: bool,
                            token_ids: bool) -> AsyncIterator[str]:
        model_name, extra = self.model_name, {"usage": None} if include_usage else {}
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
                    self.count_finished(choice)
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

    async def collect(self, generation: Generation, rid: str, created: int, chat: bool, request: Request,
                      token_ids: bool) -> Response:
        async def run() -> None:
            async for choice, _text, finished in generation.events():
                if finished:
                    self.count_finished(choice)

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
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": self.model_name,
                             "choices": body,
                             "usage": usage(generation.prompt_tokens, generation.completion_tokens)})

    def count_finished(self, choice: Choice) -> None:
        finished = self.client.requests_finished
        finished[choice.finish_reason] = finished.get(choice.finish_reason, 0) + 1


def api_of(request: Request) -> Api:
    return request.app.state.api


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Starts the driver with the server and stops it, once, when the server stops; meanwhile
    ``app.state.shutdown()`` ends every open stream, from any thread or a signal handler."""
    # zh: 随服务器启动驱动，并在服务器停止时停止它，只停一次；这期间 ``app.state.shutdown()`` 会结束每个打开的流，
    # zh: 可以从任何线程或信号处理函数中调用。
    api = app.state.api
    client, loop = api.client, asyncio.get_running_loop()
    # en: The live page's open views end with the server (a server without a live page has none).
    # zh: 实时页面打开的视图随服务器一起结束（没有实时页面的服务器就没有这样的视图）。
    close_pages = api.hub.close_all if api.hub is not None else lambda: None

    # en: Safe in a signal handler: both calls only queue work
    # zh: 可以在信号处理函数中调用：两个调用都只是把工作排入队列
    def shutdown() -> None:
        client.stop()
        loop.call_soon_threadsafe(close_pages)

    app.state.shutdown = shutdown
    client.start(loop)
    try:
        yield
    finally:
        client.stop()
        close_pages()
        api.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(client.join, client.shutdown_timeout)


async def server_error(request: Request, error: ServerError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's validation error in OpenAI's shape: a 400 naming the first field at fault."""
    # zh: OpenAI 格式的 FastAPI 校验错误：一个 400，指出第一个出错的字段。
    first = error.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = f"{'.'.join(where) or 'body'}: {first.get('msg')}"
    param = where[0] if where else None
    return JSONResponse(ServerError(400, message, param=param).body(), status_code=400)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return JSONResponse(ServerError(error.status_code, str(error.detail), kind).body(), status_code=error.status_code)


ERROR_HANDLERS = {ServerError: server_error, RequestValidationError: invalid_request, HTTPException: http_error}
# en: OpenAI's routes, then the server's own (health, metrics, the live page).
# zh: OpenAI 的路由，然后是服务器自己的（健康检查、指标、实时页面）。
openai_routes, server_routes = APIRouter(), APIRouter()


@openai_routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    api = api_of(request)
    api.check_request(body)
    texts = body.prompts()
    if len(texts) * body.n > MAX_CHOICES:
        raise ServerError(400, f"{len(texts)} prompts x n={body.n} make {len(texts) * body.n} choices, more than "
                          f"one request may ask for ({MAX_CHOICES})", param="prompt")
    for i, prompt in enumerate(texts):
        if isinstance(prompt, str):
            api.check_length(len(prompt), f"prompt {i}" if len(texts) > 1 else "the prompt", "prompt")

    def tokenize() -> list[list[int]]:
        prompts = []
        for i, prompt in enumerate(texts):
            try:
                prompts.append(prompt_token_ids(prompt, api.tokenizer))
            except (TypeError, ValueError) as error:
                where = f"prompt {i}: " if len(texts) > 1 else ""
                raise ServerError(400, f"{where}{error}", param="prompt") from None
        return prompts

    return await api.generate(body, await api.off_loop(tokenize), False, request)


@openai_routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    api = api_of(request)
    api.check_request(body)
    if getattr(api.tokenizer, "chat_template", None) is None:
        raise ServerError(400, f"the model {api.model_name!r} has no chat template: use /v1/completions",
                          param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    for i, message in enumerate(messages):
        check_text(message["content"], f"messages[{i}]", "messages")
    api.check_length(sum(len(m["content"]) for m in messages), "the messages' text", "messages")

    def tokenize() -> list[int]:
        try:
            return list(api.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
        # en: The template's own checks (jinja raises what it likes)
        # zh: 模板自己的检查（jinja 想抛什么异常就抛什么）
        except Exception as error:
            raise ServerError(400, f"the chat template refused the messages: {error}", param="messages") from None

    return await api.generate(body, [await api.off_loop(tokenize)], True, request)


def model_card(api: Api) -> dict:
    return {"id": api.model_name, "object": "model", "created": now(), "owned_by": "nanovllm", "root": api.model_name,
            "max_model_len": api.info.max_model_len}


@openai_routes.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(api_of(request))]}


# en: `client.models.retrieve(id)`. An id may hold slashes ("Qwen/Qwen3-0.6B"): the path takes them.
# zh: `client.models.retrieve(id)`。id 里可以有斜杠（"Qwen/Qwen3-0.6B"）：路径参数把它们也收下。
@openai_routes.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    api = api_of(request)
    if model_id != api.model_name:
        raise ServerError(404, f"the model {model_id!r} does not exist; this server serves {api.model_name!r}",
                          "not_found_error", param="model", code="model_not_found")
    return model_card(api)


@server_routes.get("/health")
async def health(request: Request) -> Response:
    client = api_of(request).client
    if client.stopping or not client.alive:
        return JSONResponse(SHUTTING_DOWN.body(), status_code=503)
    if not client.responsive:
        return JSONResponse(from_engine(client.silence_error()).body(), status_code=503)
    return Response(status_code=200)


@server_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(api_of(request).registry), media_type=CONTENT_TYPE_LATEST)


def create_app(engine: LLMEngine | EngineClient, *, model_name: str, max_waiting: int | None = None,
               max_body_bytes: int | None = None, engine_timeout: float = 60.0, api_key: str | None = None,
               hosts: list[str] | None = None, docs: bool = False, limit_concurrency: int | None = None,
               shutdown_timeout: float = 10.0) -> FastAPI:
    """The server's application over ``engine``: an `EngineClient` (an `EngineProcess`, say), or an `LLMEngine`,
    which the application drives from a thread (`EngineThread`; the engine stays the caller's to `exit`). Its
    lifespan starts the driver and stops it, once: an application serves one run. ``app.state.shutdown()`` ends
    every open stream, from any thread or a signal handler. ``max_body_bytes``: see `BodyLimit` (default:
    `default_max_body_bytes`). ``engine_timeout``: seconds of the engine's silence after which ``/health`` and the
    requests waiting on it get 503. ``api_key``: see `ApiKey` (an empty one is refused); ``hosts``: the Host names
    answered (see `allowed_hosts`; default any); ``docs``: serve ``/docs`` and ``/openapi.json``;
    ``limit_concurrency``: see `RequestLimit`; ``shutdown_timeout``: seconds a stopping server waits for the
    engine's running step before it stops the engine's process."""
    # zh: 建在 ``engine`` 之上的服务器应用：``engine`` 是一个 `EngineClient`（比如 `EngineProcess`），
    # zh: 或者一个 `LLMEngine`，由应用在一个线程里驱动（`EngineThread`；引擎仍归调用者所有，由调用者 `exit`）。
    # zh: 应用的生命周期启动驱动并停止它，只停一次：一个应用只服务一次运行。``app.state.shutdown()`` 会结束每个打开的
    # zh: 流，可以从任何线程或信号处理函数中调用。``max_body_bytes``：见 `BodyLimit`（默认值：
    # zh: `default_max_body_bytes`）。``engine_timeout``：引擎沉默多少秒之后，``/health`` 和等待它的请求得到 503。
    # zh: ``api_key``：见 `ApiKey`（空的密钥会被拒绝）；``hosts``：应答的 Host 名称（见 `allowed_hosts`；默认任意）；
    # zh: ``docs``：提供 ``/docs`` 和 ``/openapi.json``；``limit_concurrency``：见 `RequestLimit`；
    # zh: ``shutdown_timeout``：正在停止的服务器等待引擎正在运行的那一步多少秒，然后停止引擎进程。
    check_api_key(api_key)
    client = engine if isinstance(engine, EngineClient) else EngineThread(engine, live_page_recorder())
    client.max_waiting, client.engine_timeout, client.shutdown_timeout = max_waiting, engine_timeout, shutdown_timeout
    app = FastAPI(title="nano-vllm", lifespan=lifespan, exception_handlers=ERROR_HANDLERS,
                  docs_url="/docs" if docs else None, redoc_url=None, openapi_url="/openapi.json" if docs else None)
    app.state.api = Api(client, model_name)
    # en: The last one added runs first: the Host, then the key, then the requests in flight, then the body's size.
    # zh: 最后加入的最先运行：先查 Host，再查密钥，然后是正在处理的请求数，最后查请求体的大小。
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes or default_max_body_bytes(client.info.max_model_len))
    if limit_concurrency is not None:
        app.add_middleware(RequestLimit, limit=limit_concurrency)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(HostGuard, hosts=hosts or ["*"])
    app.include_router(openai_routes)
    app.include_router(server_routes)
    return app

# %% [markdown] tags=["en"]
# ## Cancellation and backpressure
#
# **A client that leaves.** When the connection of a streamed response closes, Starlette cancels
# the response's generator; its `finally` calls `Generation.abort`, which sends an "abort" to the
# driver, and at the next step boundary `abort_request` frees the request's blocks (every sample,
# wherever it is). Nothing is computed for nobody: the batch shrinks at the next step. A
# non-streamed request is watched too (`request.is_disconnected()`, twice a second). The tests
# check it through `/metrics`: after a client hangs up mid-stream, `num_requests_running` is back
# to 0 and `kv_cache_usage_perc` to its idle value.
#
# **A server that is full.** Continuous batching admits as many requests as the KV cache holds;
# the others wait in the scheduler's queue, and a long queue is latency that grows without bound:
# every waiting client times out eventually, after having cost memory and work. `--max-waiting N`
# refuses new requests with 503 and `Retry-After: 1` while N requests are waiting (on their way
# to the driver, or in the scheduler's waiting queue), so that a load balancer or the client's
# retry logic (the `openai` client retries 503 by itself) sends the request elsewhere or later. Refusing early is
# cheap: nothing was tokenized into the engine, no block was taken.
#
# **Ctrl-C.** uvicorn catches SIGINT and SIGTERM; our `Server` first calls `app.state.shutdown()`:
# the driver stops, every open stream ends with an error event and `[DONE]`, the live pages close,
# and then uvicorn's own graceful shutdown finds no request left to wait for. The engine process
# exits (with tensor parallelism, its rank processes too), and the server ends with status 0
# within a few seconds. The tests also kill the server outright: its engine process follows it,
# and an engine process that dies fails the open streams with a 500, then the server exits with
# status 1 (see "an engine that is watched", below).

# %% [markdown] tags=["zh"]
# ## 取消与背压
#
# **离开的客户端。** 流式响应的连接关闭时，Starlette 会取消响应的生成器；生成器的 `finally` 调用 `Generation.abort`，
# 它给驱动发一条 “abort”，在下一个步边界，`abort_request` 释放这个请求的块（所有样本，不论在哪里）。没有东西白算：
# 下一步批次就缩小了。非流式请求同样被盯着（`request.is_disconnected()`，每秒两次）。测试通过 `/metrics` 检查这一点：
# 客户端在流的中途挂断之后，`num_requests_running` 回到 0，`kv_cache_usage_perc` 回到空闲时的值。
#
# **满载的服务器。** 连续批处理会接纳 KV 缓存装得下的所有请求；其余的在调度器的队列里等待，而长队列意味着无限增长的
# 延迟：每个等待的客户端最终都会超时，在此之前还白白占用了内存和计算。`--max-waiting N` 在有 N 个请求等待时（在送往驱动
# 的路上，或在调度器的等待队列中），用 503 和 `Retry-After: 1` 拒绝新请求，让负载均衡器或客户端的重试逻辑（`openai`
# 客户端会自动重试 503）把请求发往别处或稍后再发。尽早拒绝的代价很小：什么都没有送进引擎，一个块也没有占用。
#
# **Ctrl-C。** uvicorn 捕获 SIGINT 和 SIGTERM；我们的 `Server` 先调用 `app.state.shutdown()`：驱动停止，每个打开的流
# 以一个错误事件和 `[DONE]` 结束，实时页面关闭，然后 uvicorn 自己的优雅关闭发现没有请求需要等待。引擎进程退出（使用张量
# 并行时，它的 rank 进程也一起退出），服务器在几秒之内以状态 0 结束。测试还会直接杀死服务器：它的引擎进程随之退出；
# 而死掉的引擎进程会让打开的流以 500 失败，随后服务器以状态 1 退出（见下文“被看着的引擎”）。

# %% [markdown] tags=["en"]
# ## One careless client must not hurt the others
#
# Everything so far trusts the client to be reasonable. A public server cannot: one client that
# sends a 50 MB prompt, opens a thousand sockets and sends nothing, or trickles its body a byte a
# second, must cost the others nothing. vLLM's server sets the conventions we follow, in a module
# of its own, `nanovllm.serve.guards`.
#
# **Bounded bodies and prompts.** Tokenizing is the expensive part of reading a request: a 4 MB
# text takes this book's CPU some 20 s. So the body is limited before it is read (`--max-body-bytes`,
# by default 256 bytes per token of `max_model_len`, at least 4 MiB: 413 in OpenAI's shape, from
# the `Content-Length` header when there is one, else counted as the body arrives), and a prompt
# with more characters than `max_model_len` tokens could hold is refused without being tokenized.
# That bound is exact, not a guess: a token stands for at most its vocabulary entry (a byte-level
# entry has one character per byte), so `max_model_len` × the longest entry characters is the
# most a prompt that fits can have; a tokenizer with a Unicode normalizer (NFC merges at most four
# code points into one character) gets four times that. Tokenizing itself runs on a thread of its
# own, so `/health` and the other streams never wait for it. What costs per token is bounded as
# `n` is: at most 16 stop strings of at most 1,024 characters. Text with a lone surrogate (JSON
# can spell one, `"\ud800"`) is refused by name wherever it is: prompt, stop string, chat message.
#
# **Connections that end.** uvicorn closes a kept-alive connection that stays idle after a response
# (`--timeout-keep-alive`, 5 s), but it starts that timer only once a response is complete: a
# socket that never sends a request, or sends it a byte a second, would keep its file descriptor
# forever, and a thousand of them lock every client out. `ReadDeadline` is uvicorn's HTTP/1.1
# protocol with one more timer: a request's head and body must have arrived `--timeout-read`
# seconds (60) after its first byte, else the connection is closed. `--limit-concurrency N` bounds
# the API requests in flight (`RequestLimit`; a streamed one counts until its last event): one more
# gets 503 at once, while `/health`, `/metrics` and the live page always answer. uvicorn has an
# option of that name, but it counts open connections, and a burst of connections opened together
# all see the burst: every request of it was refused. And the server raises its limit of open
# files to what the system allows, as vLLM does.
#
# **An engine that is watched.** A process that is alive is not a process that works: stopped
# (SIGSTOP) or hung, the engine answered nothing while `/health` said 200 and every request waited
# forever. Now a thread of the driver says "alive" every second (chapter 21), during a step too:
# the model's kernels let go of Python's lock while they compute. Once the engine's process has
# been silent for `--engine-timeout` seconds (60), `/health` answers 503 and the requests waiting
# on it end with a 503; when it speaks again, all is as before. A step's length is no sign of
# death: a minute-long prefill on a CPU keeps `/health` at 200 (an earlier version judged the
# engine by the gaps between steps, and failed such a request). What the heartbeat cannot tell
# is a step that never ends while its process runs. Aborting a request takes effect at the next
# step boundary: a long prompt is computed in chunks of `max_num_batched_tokens` tokens, one step
# each, so that setting bounds how long an abandoned request keeps the engine busy. An
# engine process that dies ends the open streams with a 500, and then the server itself exits
# with status 1 and one line saying why, so that a supervisor (systemd, Kubernetes) restarts it,
# rather than answering "shutting down" forever.
#
# **Who may ask.** By default the server listens on 127.0.0.1, so other machines cannot reach it,
# and there it answers only the loopback names in the `Host` header: a web page that makes its own
# name resolve to 127.0.0.1 (DNS rebinding) is refused, and without CORS headers no other page can
# read its answers. `/docs` and `/openapi.json` are off (`--docs` turns them on). `--api-key KEY`
# (or `NANOVLLM_API_KEY`, which `ps` does not show) makes every `/v1/*` route and the live page
# ask for `Authorization: Bearer KEY` (401 otherwise; the page takes the key as a Basic password);
# `/health` and `/metrics` stay open, as in vLLM. What the defaults do not protect: any process
# of the same machine may use a server without a key; over plain HTTP the key travels in clear
# (put a TLS proxy in front of a server others reach); `/metrics` tells anyone the load; and
# nothing limits one key holder against the others (`--max-waiting` and `--limit-concurrency`
# bound the total, not each client). An empty key (`--api-key ""`, or `NANOVLLM_API_KEY=`) is
# refused at start: it would look like a key and turn authentication off.
#
# **A stop that does not wait for the step.** Ctrl-C or SIGTERM ends every open stream at once with
# the error event and `[DONE]` (a request not yet admitted gets a JSON 503), rather than waiting for
# the driver to fail them after its step: that can take a minute, and uvicorn cuts the responses
# still open after five seconds, with a plain-text 500. Then the server waits for the engine's
# process to end its step and exit, and says so, at most `--shutdown-timeout` seconds (10); then it
# stops the process. A second Ctrl-C while it waits is taken quietly.

# %% [markdown] tags=["zh"]
# ## 一个不讲理的客户端不能拖累别人
#
# 到目前为止，一切都假定客户端是讲理的。公开的服务器不能这样假定：一个客户端发来 50 MB 的提示词，或者打开一千个
# 套接字却什么也不发，或者一秒一个字节地慢慢发请求体，都不应让其他客户端付出任何代价。vLLM 的服务器定下了这些惯例，
# 我们照着做，代码放在单独的模块 `nanovllm.serve.guards` 里。
#
# **有上限的请求体和提示词。** 读请求时最贵的是分词：在本书的 CPU 上，4 MB 的文本要分词 20 秒左右。所以请求体在读之前
# 就有上限（`--max-body-bytes`，默认是 `max_model_len` 的每个 token 256 字节，至少 4 MiB；超过时返回 OpenAI 格式的
# 413：有 `Content-Length` 头时直接看它，没有时边收边数），而字符数超过 `max_model_len` 个 token 所能容纳的提示词，
# 不分词就直接拒绝。这个上限是严格的，不是估计：一个 token 最多代表它在词表里的那一项（字节级词表的一项，每个字节
# 对应一个字符），所以 `max_model_len` 乘以最长一项的字符数，就是放得下的提示词最多能有的字符数；分词器带 Unicode
# 规范化（NFC 最多把四个码位合成一个字符）时，再乘以四。分词本身在单独的线程里进行，所以 `/health` 和其他流
# 从不等它。每个 token 都要付出代价的东西，像 `n` 一样有上限：停止字符串最多 16 个，每个最多 1,024 个字符。含有
# 孤立代理项的文本（JSON 可以写出一个：`"\ud800"`）不论出现在哪里——提示词、停止字符串、聊天消息——都会被指名拒绝。
#
# **会结束的连接。** 响应之后一直空闲的长连接，uvicorn 会关闭（`--timeout-keep-alive`，5 秒），但这个计时器要等一个
# 响应完成才启动：一个从不发请求的套接字，或者一秒一个字节地发请求的套接字，会永远占着它的文件描述符，一千个这样的
# 连接就能把所有客户端挡在门外。`ReadDeadline` 就是 uvicorn 的 HTTP/1.1 协议再加一个计时器：请求的头和体必须在它的
# 第一个字节到达后 `--timeout-read` 秒（默认 60）之内收齐，否则关闭连接。`--limit-concurrency N` 限制正在处理的 API
# 请求数（`RequestLimit`；流式请求一直算到它的最后一个事件）：再多一个就立即得到 503，而 `/health`、`/metrics` 和实时
# 页面总会应答。uvicorn 也有一个同名选项，但它数的是打开的连接，一起打开的一批连接个个都看到整批的数目：这批请求
# 全被拒绝了。服务器还会像 vLLM 那样，把可打开文件数的上限提到系统允许的最大值。
#
# **被看着的引擎。** 进程活着不等于进程在干活：引擎被停住（SIGSTOP）或卡死时，它什么也不回答，`/health` 却照样说
# 200，每个请求都永远等下去。现在驱动有一个线程每秒说一声“还活着”（第 21 章），步进行中也照说：模型的内核在计算时会
# 放开 Python 的锁。引擎进程沉默满 `--engine-timeout` 秒（默认 60）之后，`/health` 回答 503，等着它的请求也以 503
# 结束；它重新开口，一切照旧。一步有多长并不说明引擎死了：CPU 上长达一分钟的 prefill 也让 `/health` 保持 200（之前的
# 版本按两步之间的间隔来判断引擎，这样的请求就失败了）。心跳分辨不出的是：进程还在运行，这一步却永远不结束。中止请求
# 在下一个步边界生效：长提示词按 `max_num_batched_tokens` 个 token 分块计算，每块一步，所以这个设置限制了一个被放弃的
# 请求让引擎白忙多久。引擎进程死掉时，打开的流以 500 结束，然后服务器自己以状态 1 退出，并用一行
# 日志说明原因，好让守护进程（systemd、Kubernetes）重启它，而不是永远回答“正在关闭”。
#
# **谁可以提问。** 服务器默认监听 127.0.0.1，别的机器连不上；在那里它只接受 `Host` 头为本机回环名称的请求：一个让
# 自己的域名解析到 127.0.0.1 的网页（DNS 重绑定）会被拒绝，而且没有 CORS 头，别的网页也读不到它的回答。`/docs` 和
# `/openapi.json` 默认关闭（`--docs` 打开它们）。`--api-key KEY`（或 `NANOVLLM_API_KEY`，`ps` 看不到它）让每个
# `/v1/*` 路由和实时页面都要求 `Authorization: Bearer KEY`（否则返回 401；实时页面也接受把密钥作为 Basic 认证的
# 密码）；`/health` 和 `/metrics` 与 vLLM 一样保持开放。默认设置**不**保护的：没有密钥时，同一台机器上的任何进程都能
# 使用服务器；在普通的 HTTP 上密钥以明文传送（别人能访问的服务器，前面要放一个 TLS 代理）；`/metrics` 把负载告诉
# 任何人；也没有什么能让持有密钥的客户端之间互相设限（`--max-waiting` 和 `--limit-concurrency` 限制的是总量，
# 而不是每个客户端）。空的密钥（`--api-key ""` 或 `NANOVLLM_API_KEY=`）在启动时就被拒绝：它看起来像个密钥，实际上却
# 关掉了认证。
#
# **停下时不等这一步。** Ctrl-C 或 SIGTERM 立即结束每个打开的流，以错误事件和 `[DONE]` 收尾（还没被引擎接收的请求
# 得到一个 JSON 格式的 503），而不是等驱动做完这一步再让它们失败：那可能要一分钟，而 uvicorn 五秒后就会掐断还开着的
# 响应，回一个纯文本的 500。然后服务器等引擎进程做完这一步并退出，并在日志里说明它在等什么，最多等 `--shutdown-timeout`
# 秒（默认 10），之后让这个进程停下。等待期间再按一次 Ctrl-C，也不会打出错误。

# %% guards
#| export serve.guards
"""What keeps one careless or hostile client from costing the others: bounded bodies and prompts, a deadline on
reading a request, a bound on requests in flight, an API key, and the Host names the server answers."""
# zh: 让一个粗心或恶意的客户端拖累不了其他客户端的东西：有上限的请求体和提示词、读取请求的期限、进行中请求数的上限、
# zh: API 密钥，以及服务器应答的 Host 名称。

from __future__ import annotations

import asyncio
import base64
import ipaddress
import secrets
from typing import Any

import h11
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.serve.protocol import ServerError


def default_max_body_bytes(max_model_len: int) -> int:
    """256 bytes per token of the model's length, at least 4 MiB: room for a full-length prompt of long tokens
    written as JSON escapes, or for a batch of ordinary prompts."""
    # zh: 模型长度的每个 token 对应 256 字节，至少 4 MiB：足以容纳一个以 JSON 转义写出、由长 token 组成的满长度提示词，
    # zh: 或者一批普通的提示词。
    return max(4 << 20, 256 * max_model_len)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a prompt of ``max_model_len`` tokens can have. A token stands for at most its vocabulary
    entry (a byte-level entry has one character per byte, and a byte is at most one character; a special token is
    its own text), and a Unicode normalizer (NFC, NFKC) merges at most four code points into one character. A
    tokenizer that drops characters (BERT's drops whitespace) would break the bound; the byte-level and
    SentencePiece tokenizers of generative models drop none."""
    # zh: ``max_model_len`` 个 token 的提示词最多能有多少个字符。一个 token 最多代表它在词表里的那一项（字节级词表的
    # zh: 一项每个字节对应一个字符，而一个字节最多构成一个字符；特殊 token 就是它自己的文本），而
    # zh: Unicode 归一化器（NFC、NFKC）最多把四个码位合成一个字符。会丢弃字符的分词器（BERT 的会丢弃空白）
    # zh: 会打破这个上限；生成式模型的字节级分词器和 SentencePiece 分词器一个字符也不丢。
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # en: A slow tokenizer's normalization is not known: assume there is one
    # zh: 慢速分词器的规范化方式无从得知：假定它有
    merges = 4 if backend is None or backend.normalizer is not None else 1
    return max_model_len * longest * merges


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before it is read whole. A ``Content-Length``
    over the limit is refused before a byte of the body is read (uvicorn then drops the rest as it arrives); a body
    without one (chunked) is counted as it arrives, and reading stops at the limit."""
    # zh: ASGI 中间件：超过 ``max_bytes`` 的请求体在被完整读入之前就得到 413。超出上限的 ``Content-Length`` 在请求体的
    # zh: 一个字节都还没读时就被拒绝（uvicorn 随后把陆续到达的其余部分丢掉）；没有 ``Content-Length`` 的
    # zh: 请求体（分块传输）边到达边计数，到达上限时停止读取。

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def error(self, size: str) -> ServerError:
        return ServerError(413, f"the request body is {size} bytes, more than this server takes ({self.max_bytes}, "
                           "--max-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = self.error(declared.decode())
            await JSONResponse(error.body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # en: FastAPI passes an HTTPException raised while it reads the body on to the app's error handler.
                # zh: FastAPI 读请求体时抛出的 HTTPException，会原样交给应用的错误处理函数。
                raise HTTPException(413, self.error(f"over {self.max_bytes}").message)
            return message

        await self.app(scope, counted, send)

class RequestLimit:
    """ASGI middleware: at most ``limit`` requests of the API (``/v1``) in flight, a streamed one until its last
    event; one more gets 503 in OpenAI's shape at once. It counts requests, not connections as uvicorn's own
    ``limit_concurrency`` does: a burst of connections opened together then gets the limit's worth served and the
    rest refused (uvicorn's refused all of them), and ``/health``, ``/metrics`` and the live page always answer."""
    # zh: ASGI 中间件：API（``/v1``）最多有 ``limit`` 个请求在进行中，流式请求一直算到它的最后一个事件；
    # zh: 再多一个就立即得到 OpenAI 格式的 503。它数的是请求，而不像 uvicorn 自己的 ``limit_concurrency`` 那样数连接：
    # zh: 一批同时打开的连接中，上限以内的得到服务，其余被拒绝（uvicorn 的做法会把它们全部拒绝），而 ``/health``、
    # zh: ``/metrics`` 和实时页面总会应答。

    def __init__(self, app: ASGIApp, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"--limit-concurrency must be a whole number of requests, at least 1, got {limit!r}")
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = ServerError(503, f"the server has {self.in_flight} requests in flight (--limit-concurrency "
                                f"{self.limit}); retry later", "server_overloaded", code="server_overloaded")
            await JSONResponse(error.body(), status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


# %% read deadline
#| export serve.guards
class ReadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on reading each request: its head and body must have arrived
    `timeout` seconds after its first byte (after the connection opened, for a connection's first request), or
    the connection is closed. uvicorn's keep-alive timer only starts once a response is complete, so without this a
    socket that never sends a whole request holds its file descriptor forever. `read_deadline` sets the timeout."""
    # zh: 给读取每个请求加上期限的 uvicorn HTTP/1.1 协议：请求的头部和请求体必须在它的第一个字节到达后
    # zh: `timeout` 秒内全部到达（对一个连接的第一个请求，从连接打开时算起），否则关闭连接。uvicorn 的
    # zh: keep-alive 计时器要等一个响应完成才启动，所以没有这个期限的话，一个从不发完整个请求的套接字会永远占着它的
    # zh: 文件描述符。`read_deadline` 设置这个超时。

    timeout: float = 60.0
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        # en: The first bytes of a next request on a kept-alive connection
        # zh: 长连接上下一个请求的第一批字节
        if self.deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        # en: Read whole (or the connection failed): what happens next is the response's business
        # zh: 已经读完（或者连接出错）：接下来是响应的事了
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.timeout, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


def read_deadline(seconds: float) -> type[ReadDeadline]:
    """The protocol class for uvicorn's ``http`` setting, with a deadline of ``seconds``."""
    # zh: 用于 uvicorn ``http`` 设置的协议类，期限为 ``seconds``。
    return type("ReadDeadline", (ReadDeadline,), {"timeout": seconds})

# %% who may ask
#| export serve.guards
class ApiKey:
    """ASGI middleware: every ``/v1`` route and the live page need ``Authorization: Bearer KEY``, or 401 in OpenAI's
    shape. The live page also takes HTTP Basic with the key as the password, which a browser asks for by itself.
    ``/health`` and ``/metrics`` stay open, as in vLLM: load balancers and Prometheus read them."""
    # zh: ASGI 中间件：每个 ``/v1`` 路由和实时页面都需要 ``Authorization: Bearer KEY``，否则返回 OpenAI 格式的 401。
    # zh: 实时页面也接受以密钥为密码的 HTTP Basic 认证，浏览器会自己弹出询问。``/health`` 和 ``/metrics`` 保持开放，
    # zh: 和 vLLM 一样：负载均衡器和 Prometheus 要读取它们。

    PROTECTED = ("/v1", "/dashboard")

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    def authorized(self, header: bytes) -> bool:
        scheme, _, credentials = header.partition(b" ")
        if scheme.lower() == b"bearer":
            given = credentials.strip()
        elif scheme.lower() == b"basic":
            try:
                given = base64.b64decode(credentials, validate=True).partition(b":")[2]
            except ValueError:
                return False
        else:
            return False
        # en: In constant time: how long a comparison takes says nothing of the key
        # zh: 用常数时间比较：比较花了多久，不会透露密钥的任何信息
        return secrets.compare_digest(given, self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.PROTECTED) or \
                self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
            await self.app(scope, receive, send)
            return
        error = ServerError(401, "this server needs an API key: send the header 'Authorization: Bearer KEY'",
                            code="invalid_api_key")
        challenge = 'Basic realm="nano-vllm"' if path.startswith("/dashboard") else "Bearer"
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": challenge})(scope, receive, send)


def check_api_key(key: str | None) -> None:
    """Refuse an empty key: it would look like a key and turn authentication off."""
    # zh: 拒绝空的密钥：它看起来像个密钥，实际上却会关掉认证。
    if key is not None and not key.strip():
        raise ValueError("the API key is empty: give one with --api-key KEY or the environment's NANOVLLM_API_KEY=KEY, "
                         "or set neither to serve without a key")


class HostGuard:
    """ASGI middleware: only the Host names in ``hosts`` are answered (``*`` any; ``*.example.com`` its subdomains),
    else 400 in OpenAI's shape. Starlette's `TrustedHostMiddleware` does the same check but answers in plain text,
    which an OpenAI client cannot read."""
    # zh: ASGI 中间件：只应答 ``hosts`` 中的 Host 名称（``*`` 表示任意；``*.example.com`` 表示它的子域名），
    # zh: 否则返回 OpenAI 格式的 400。Starlette 的 `TrustedHostMiddleware` 做同样的检查，但用纯文本应答，
    # zh: OpenAI 客户端读不懂。

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app, self.hosts = app, [host.lower() for host in hosts]

    def allowed(self, header: str) -> bool:
        if "*" in self.hosts:
            return True
        # en: Drop the port: "[::1]:8000" -> "[::1]", "localhost:8000" -> "localhost"
        # zh: 去掉端口："[::1]:8000" -> "[::1]"，"localhost:8000" -> "localhost"
        name = header.lower() if header.endswith("]") else header.lower().rsplit(":", 1)[0]
        return any(name == host or (host.startswith("*.") and name.endswith(host[1:])) for host in self.hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(Headers(scope=scope).get("host", "")):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # en: Refused before it is accepted (1008: policy violation)
            # zh: 在接受之前就拒绝（1008：违反策略）
            await send({"type": "websocket.close", "code": 1008})
            return
        error = ServerError(400, "this server does not answer to this Host header (--allowed-hosts)", param="Host")
        await JSONResponse(error.body(), status_code=400)(scope, receive, send)


def checked_host(name: str) -> str:
    """A name of --allowed-hosts as a Host header spells it: an IPv6 address in brackets; a port is refused (the
    guard compares names, whatever the port)."""
    # zh: --allowed-hosts 里的一个名字，写成 Host 头里的样子：IPv6 地址加上方括号；带端口的会被拒绝（守卫比较的是名字，
    # zh: 不管端口）。
    try:
        if ipaddress.ip_address(name).version == 6:
            return f"[{name}]"
    except ValueError:
        pass
    if ":" in name.removeprefix("[").split("]")[-1]:
        raise ValueError(f"--allowed-hosts takes names without a port, got {name!r}")
    return name


def allowed_hosts(host: str, given: list[str] | None) -> list[str]:
    """The Host headers the server answers (`HostGuard` checks them): ``given``, else, when it
    listens on a loopback address, the loopback names only. A web page that has its own name resolve to 127.0.0.1
    (DNS rebinding) sends its own name as Host, and is refused. Elsewhere, any host."""
    # zh: 服务器应答的 Host 头（由 `HostGuard` 检查）：``given``；没有给出时，如果服务器监听的是回环地址，
    # zh: 就只应答回环名称。一个让自己的域名解析到 127.0.0.1 的网页（DNS 重绑定）会把它自己的域名作为 Host 发来，
    # zh: 于是被拒绝。其他情况下应答任意 Host。
    if given:
        return [checked_host(name) for name in given]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return ["localhost", "127.0.0.1", "[::1]"] if loopback else ["*"]

# %% [markdown] tags=["en"]
# ## The command line, and a server in a child process
#
# `python -m nanovllm.serve` takes every engine setting of `Config` as an option of the same name
# (`max_num_seqs` is `--max-num-seqs`), generated from the dataclass, so that the two cannot drift
# apart; the HTTP options are its own. It loads the model first, then listens, then prints its URL
# (`--port 0` picks a free port, and the line says which). `ServerProcess` starts it as a child
# process for tests, this chapter and the benchmark: it waits for `/health`, stops it with SIGINT
# as Ctrl-C would, and makes sure it never outlives its parent (Linux's `PR_SET_PDEATHSIG`, plus an
# `atexit` hook), so a notebook that fails half-way leaves no server behind.

# %% [markdown] tags=["zh"]
# ## 命令行，以及子进程中的服务器
#
# `python -m nanovllm.serve` 把 `Config` 的每个引擎设置都作为同名选项（`max_num_seqs` 就是 `--max-num-seqs`），由数据类
# 生成，所以两者不会脱节；HTTP 的选项是它自己的。它先加载模型，再开始监听，然后打印 URL（`--port 0` 会挑一个空闲端口，
# 那一行会说明是哪个）。`ServerProcess` 为测试、本章和基准测试把它作为子进程启动：等待 `/health`，像 Ctrl-C 那样用
# SIGINT 停止它，并保证它绝不会比父进程活得更久（Linux 的 `PR_SET_PDEATHSIG`，再加一个 `atexit` 钩子），所以中途失败的
# notebook 不会留下服务器。

# %% command line
#| export serve.cli
"""The server's command line: engine options pass through to `LLM`, the HTTP ones go to uvicorn."""
# zh: 服务器的命令行：引擎选项传给 `LLM`，HTTP 选项交给 uvicorn。

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import socket
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from nanovllm.config import Config
from nanovllm.serve.app import create_app, live_page_recorder
from nanovllm.serve.client import EngineProcess, EngineStartError
from nanovllm.serve.guards import allowed_hosts, check_api_key, read_deadline

# en: Engine options the command line does not offer: what only a program can pass.
# zh: 命令行不提供的引擎选项：只有程序才能传入的那些。
HIDDEN_SETTINGS = ("load_format",)


def engine_options(parser: argparse.ArgumentParser) -> None:
    """One option per `Config` setting (``max_num_seqs`` -> ``--max-num-seqs``), typed as the field is."""
    # zh: 每个 `Config` 设置对应一个选项（``max_num_seqs`` -> ``--max-num-seqs``），类型与字段相同。
    group = parser.add_argument_group("engine", "passed to LLM(model, ...); defaults are the engine's")
    hints = typing.get_type_hints(Config)
    for f in fields(Config):
        if f.name not in Config.settings() or f.name in HIDDEN_SETTINGS:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        default = f.default if f.default is not MISSING else None
        said = f"default: {default}"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=said)
        # en: bool | str: True, False or "auto"
        # zh: bool | str：True、False 或 "auto"
        elif isinstance(kind, types.UnionType) and bool in typing.get_args(kind):
            group.add_argument(flag, choices=["auto", "on", "off"], default="auto", help="default: auto")
        # en: X | None (speculative_method, num_speculative_tokens): an X, or left out
        # zh: X | None（speculative_method、num_speculative_tokens）：一个 X，或者不给
        elif isinstance(kind, types.UnionType):
            value_type = next(arg for arg in typing.get_args(kind) if arg is not type(None))
            group.add_argument(flag, type=value_type, default=None, metavar=f.name.upper(), help="default: None")
        else:
            group.add_argument(flag, type=kind, default=default, metavar=f.name.upper(), help=said)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.serve",
        description="An OpenAI-compatible server over nano-vllm's engine. Without --model, SmolLM2-135M-Instruct.")
    parser.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the model's id in the API (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    parser.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="refuse new requests (503) while N requests wait (default: no limit)")
    parser.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                        help="refuse a request body over N bytes (413) before reading it whole (default: 256 per "
                             "token of --max-model-len, at least 4 MiB)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"), metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* and /dashboard (default: the environment's "
                             "NANOVLLM_API_KEY, else none)")
    parser.add_argument("--allowed-hosts", nargs="+", metavar="HOST",
                        help="answer only these Host headers (default: the loopback names when --host is a loopback "
                             "address, which keeps out DNS rebinding; else any)")
    parser.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (default: off)")
    parser.add_argument("--engine-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="answer 503 (/health, and the requests waiting on it) once the engine's process has sent "
                             "nothing, not even the heartbeat it sends every second during a step, for SECONDS "
                             "(default 60)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="on Ctrl-C or SIGTERM, wait at most SECONDS for the engine's running step to end, then "
                             "stop the engine's process (default 10)")
    parser.add_argument("--timeout-read", type=float, default=60.0, metavar="SECONDS",
                        help="close a connection whose request (head and body) has not arrived SECONDS after its "
                             "first byte, or after the connection opened (default 60)")
    parser.add_argument("--timeout-keep-alive", type=int, default=5, metavar="SECONDS",
                        help="close a kept-alive connection idle this long after a response (uvicorn's; default 5)")
    parser.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                        help="answer 503 to a new API request while N are in flight, streamed ones until their end "
                             "(/health, /metrics and the live page always answer; default: no limit)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    engine_options(parser)
    return parser


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` keyword arguments of the parsed command line."""
    # zh: 从解析后的命令行得到的 `LLM` 关键字参数。
    switch = {"auto": "auto", "on": True, "off": False}
    settings = {}
    for name in Config.settings():
        if name in HIDDEN_SETTINGS:
            continue
        value = getattr(args, name)
        settings[name] = switch.get(value, value) if isinstance(value, str) and value in switch else value
    return settings


class Server(uvicorn.Server):
    """uvicorn's server, told about the application's streams: a signal first ends them (the driver stops, the
    live pages close), then uvicorn shuts down, and the process exits with status 0 rather than re-raising it.
    It prints the URL once it listens (``--port 0`` picks a free port: the line says which)."""
    # zh: 知道应用中各个流的 uvicorn 服务器：收到信号时先结束这些流（驱动停止，实时页面关闭），然后 uvicorn 关闭，
    # zh: 进程以状态 0 退出，而不是把信号重新抛出。开始监听后它打印一次 URL（``--port 0`` 会选一个空闲端口：
    # zh: 这一行会说明是哪个）。

    def __init__(self, config: uvicorn.Config, name: str) -> None:
        super().__init__(config)
        self.name = name

    def stop_soon(self) -> None:
        """Shut down as after Ctrl-C (from the event loop's thread)."""
        # zh: 像按下 Ctrl-C 之后那样关闭（从事件循环的线程调用）。
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            # en: A second Ctrl-C while the server stops: uvicorn would force the exit and skip the lifespan's end, the
            # en: wait for the engine that --shutdown-timeout bounds anyway. The streams have ended already.
            # zh: 服务器正在停止时又按了一次 Ctrl-C：uvicorn 会强行退出，跳过 lifespan 的收尾，也就是等引擎的那一段，
            # zh: 而这段等待本来就有 --shutdown-timeout 限着。各个流已经结束了。
            print("nano-vllm: already stopping", file=sys.stderr, flush=True)
            return
        shutdown = getattr(self.config.app.state, "shutdown", None)
        if shutdown is not None:
            shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # en: The signal asked for this shutdown, which is done: uvicorn would raise it again.
            # zh: 这次关闭正是那个信号要求的，现在已经完成：否则 uvicorn 会再次抛出它。
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"nano-vllm: serving {self.name} at http://{host}:{port} "
                  f"(the KV cache, live: http://{host}:{port}/dashboard)", flush=True)


def raise_open_files_limit(target: int = 65536) -> None:
    """Every connection holds a file descriptor: allow up to ``target`` (as vLLM does), or what the system allows."""
    # zh: 每个连接占用一个文件描述符：把上限提高到 ``target``（vLLM 也这样做），或者系统允许的最大值。
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # en: Settings of the HTTP side are checked before the model loads.
    # zh: HTTP 一侧的设置在加载模型之前就检查。
    try:
        check_api_key(args.api_key)
        hosts = allowed_hosts(args.host, args.allowed_hosts)
        if args.limit_concurrency is not None and args.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be at least 1, got {args.limit_concurrency}")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError, smollm2_dir

    try:
        model = args.model or str(smollm2_dir())
        name = args.served_model_name or Path(model).name
        print(f"nano-vllm: loading {model}", file=sys.stderr, flush=True)
        # en: The engine gets a process of its own (see "The engine in a process of its own").
        # zh: 引擎有它自己的进程（见“让引擎住进自己的进程”）。
        engine = EngineProcess(model, engine_settings(args), live_page_recorder())
    except (EngineStartError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    try:
        app = create_app(engine, model_name=name, max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                         engine_timeout=args.engine_timeout, api_key=args.api_key, docs=args.docs,
                         hosts=hosts, limit_concurrency=args.limit_concurrency,
                         shutdown_timeout=args.shutdown_timeout)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=5, access_log=False, http=read_deadline(args.timeout_read),
                                timeout_keep_alive=args.timeout_keep_alive)
        raise_open_files_limit()
        server = Server(config, name)
        # en: A dead engine stops the server once the open streams have their error; status 1 tells a supervisor.
        # zh: 引擎死了，服务器就在打开的流收到错误之后停下；退出状态 1 告诉守护进程。
        engine.on_death = server.stop_soon
        server.run()
    finally:
        engine.close()
    if engine.died:
        code = engine.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        print(f"nano-vllm: error: the engine process died ({how}); the server stopped (exit status 1)",
              file=sys.stderr, flush=True)
        return 1
    return 0

# %% serve entry point
#| export serve.__main__
"""``python -m nanovllm.serve``: the OpenAI-compatible server (`nanovllm.serve.cli`)."""
# zh: ``python -m nanovllm.serve``：兼容 OpenAI 的服务器（`nanovllm.serve.cli`）。

import sys

from nanovllm.serve.cli import main

# en: A notebook also runs this code as __main__; only a real `python -m nanovllm.serve` should act.
# zh: notebook 同样以 __main__ 身份运行这段代码；只有真正的 `python -m nanovllm.serve` 才应执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())

# %% server process
#| export serve.process
"""A server in a child process, for the tests, the book and the benchmark: started on a free port, stopped with a
signal, and never left behind (it also dies with the process that started it)."""
# zh: 运行在子进程中的服务器，供测试、本书和基准测试使用：在空闲端口上启动，用信号停止，而且绝不会被遗留下来（启动它的
# zh: 进程死掉时它也随之结束）。

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import nanovllm
from nanovllm.serve.client import die_with_parent

URL_LINE = re.compile(r"serving .* at (http://\S+)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m nanovllm.serve ARGS`` (or ``command``) as a child process.

    Our server is started with ``--port 0`` and says where it listens; another ``command`` (a peer such as
    ``transformers serve``) is given ``port`` and polled at ``/health``. Output goes to ``log`` (a file). `stop`
    sends SIGINT, as Ctrl-C would, and kills the process only if it has not ended after ``timeout`` seconds.
    """
    # zh: 作为子进程运行的 ``python -m nanovllm.serve ARGS``（或者 ``command``）。
    # zh:
    # zh: 我们的服务器用 ``--port 0`` 启动，并说出它在哪里监听；其他 ``command``（作为对照组的服务器，
    # zh: 比如 ``transformers serve``）则被给定 ``port``，并轮询它的 ``/health``。输出写到 ``log``（一个文件）。
    # zh: `stop` 像 Ctrl-C 那样发送 SIGINT，只有在 ``timeout`` 秒后进程仍未结束时才杀掉它。

    def __init__(self, args: list[str] = (), *, command: list[str] | None = None, port: int | None = None,
                 ready_timeout: float = 180.0) -> None:
        self.ours = command is None
        # en: The same package, in the child
        # zh: 子进程里用的是同一个包
        root = str(Path(nanovllm.__file__).resolve().parent.parent)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.command = [sys.executable, "-m", "nanovllm.serve", *args, "--port", "0"] if self.ours else command
        self.url = None if self.ours else f"http://127.0.0.1:{port}"
        self.ready_timeout = ready_timeout
        descriptor, log = tempfile.mkstemp(prefix="nanovllm-server-", suffix=".log")
        # en: The child writes it through its own handle
        # zh: 子进程通过它自己的句柄写这个文件
        os.close(descriptor)
        self.log = Path(log)
        # en: The log's text once the server has stopped and the file is gone
        # zh: 服务器停止、文件删除之后，日志的文本
        self.final_output: str | None = None
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server exited with status {self.process.returncode}:\n{self.output()}")
            if self.url is None:
                found = URL_LINE.search(self.output())
                self.url = found[1] if found else None
            if self.url is not None and self.healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not ready after {self.ready_timeout} s:\n{self.output()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def output(self) -> str:
        if self.final_output is not None:
            return self.final_output
        return self.log.read_text(encoding="utf-8", errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int | None:
        """Ask the server to stop (Ctrl-C); wait; kill it if it would not. Returns its exit status."""
        # zh: 请服务器停止（Ctrl-C）；等待；它不肯停就杀掉它。返回它的退出状态。
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        atexit.unregister(self.stop)
        # en: The log outlives the process only in memory: a stopped server leaves no file behind.
        # zh: 日志只在内存中比进程活得久：停止的服务器不会留下文件。
        if self.final_output is None:
            self.final_output = self.output()
            self.log.unlink(missing_ok=True)
        return None if process is None else process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

# %% [markdown] tags=["en"]
# ## See it: a real server, the real client
#
# The chapter starts a server on SmolLM2-135M-Instruct, in a child process, and talks to it with
# the `openai` client. The last cell stops it; if the notebook fails before, the server dies with
# the kernel.

# %% [markdown] tags=["zh"]
# ## 看它运行：真实的服务器，真实的客户端
#
# 本章在子进程中启动一个运行 SmolLM2-135M-Instruct 的服务器，并用 `openai` 客户端和它对话。最后一个单元会停止它；
# 如果 notebook 在那之前失败，服务器会随内核一起退出。

# %%
import openai

from nanovllm.book.smollm2 import smollm2_dir
from nanovllm.llm import LLM
from nanovllm.serve.process import ServerProcess

smol = str(smollm2_dir())
server = ServerProcess(["--model", smol, "--served-model-name", "smollm2", "--max-model-len", "1024"]).start()
client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
print(say("serving {models} at {url}", models=[m.id for m in client.models.list()], url=server.url))

# %% [markdown] tags=["en"]
# A question in Chinese: SmolLM2 answers with characters that take several tokens each. The
# streamed pieces never hold a `�`, they join to the non-streamed answer, and both are exactly
# what `generate` makes offline from the same chat-formatted prompt.

# %% [markdown] tags=["zh"]
# 一个中文问题：SmolLM2 的回答里有每个要占好几个 token 的字符。流式的片段里从不出现 `�`，它们拼起来等于非流式的
# 回答，而两者都与 `generate` 在离线状态下对同一个套用了聊天模板的提示词生成的结果完全相同。

# %%
question = [{"role": "user", "content": "请用中文介绍一下北京。"}]
reply = client.chat.completions.create(model="smollm2", messages=question, max_tokens=16, temperature=0)
stream = client.chat.completions.create(model="smollm2", messages=question, max_tokens=16, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
chunks = list(stream)
pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
print(say("non-streamed: {text!r} {reason} {usage}", text=reply.choices[0].message.content,
          reason=reply.choices[0].finish_reason, usage=reply.usage))
print(say("streamed: {pieces}", pieces=pieces))

smol_llm = LLM(smol, max_model_len=1024)
chat_ids = smol_llm.tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
expected = smol_llm.generate([chat_ids], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
assert "".join(pieces) == reply.choices[0].message.content == expected["text"]
assert all("\ufffd" not in piece for piece in pieces) and any(ord(ch) > 0x2E80 for ch in expected["text"])
assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens == len(expected["token_ids"])

# %% [markdown] tags=["en"]
# A client that hangs up mid-stream: while its stream is open the request runs and holds blocks;
# once the connection is closed, `/metrics` shows the server idle again, blocks freed.

# %% [markdown] tags=["zh"]
# 一个在流的中途挂断的客户端：流打开时，请求在运行并占着块；连接一关闭，`/metrics` 就显示服务器重新空闲，块已释放。

# %%
import re
import time

import httpx


def gauges() -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^nanovllm:(\w+)\{[^}]*\} (\S+)$", text, re.M)}


body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 500, "stream": True,
        "ignore_eos": True}
with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as streaming:
    # en: Keep it: a line iterator that is dropped closes the connection
    # zh: 留着它：被丢弃的行迭代器会关闭连接
    lines = streaming.iter_lines()
    first = next(lines)
    during = gauges()
deadline = time.monotonic() + 30
while (after := gauges())["num_requests_running"] or after["kv_cache_usage_perc"]:
    assert time.monotonic() < deadline, after
    time.sleep(0.05)
for name in ("num_requests_running", "kv_cache_usage_perc", "generation_tokens_total"):
    print(say("{name:24} during the stream {during:8.3f}   after the client left {after:8.3f}", name=name,
              during=during[name], after=after[name]))
assert during["num_requests_running"] == 1 and during["kv_cache_usage_perc"] > 0
# en: It did not run to its end
# zh: 它没有运行到结束
assert after["generation_tokens_total"] < during["generation_tokens_total"] + 500

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm.serve.protocol` and `nanovllm.serve.app`: OpenAI's request and response shapes, a
#   `Generation` per HTTP request, and the application: routes in two routers over one `Api`,
#   streaming as server-sent events, errors in OpenAI's shape with their status, cancellation
#   that frees blocks, `--max-waiting` backpressure, Prometheus `/metrics`.
# - `nanovllm.serve.guards` and the options around it: bounded bodies, prompts and stop lists,
#   tokenizing off the event loop, a deadline on reading a request, an engine watched through its
#   heartbeat (and a server that exits when its engine dies), an API key and a `Host` allowlist.
# - Two hooks for a live page, `live_page_hub` and `live_page_recorder` (none here; appendix C
#   fills them).
# - `python -m nanovllm.serve` (`nanovllm.serve.cli`, `./dev serve`) with a clean Ctrl-C, and
#   `ServerProcess`, a server in a child process for notebooks, tests and benchmarks.
#
# ## Exercises
#
# 1. One completion request sends 3 prompts with `n = 4`. How many choices come back, and which
#    `index` does the third sample (sample 2) of the second prompt (prompt 1) have?
# 2. This chapter's server runs with `--max-model-len 1024` and no `--max-body-bytes`. How large
#    may a request's body be?
# 3. A client asks this server for the model `"gpt-4"`. Which HTTP status and which error `code`
#    does it get?
#
# The cell below checks the answers, the first and the last on the running server.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.serve.protocol` 和 `nanovllm.serve.app`：OpenAI 的请求与响应格式，每个 HTTP 请求一个 `Generation`，以及
#   应用本身：分在两个 router 里、共用一个 `Api` 的路由，以服务器发送事件流式输出，OpenAI 格式、带对应状态码的错误，
#   会释放块的取消，`--max-waiting` 背压，Prometheus 的 `/metrics`。
# - `nanovllm.serve.guards` 以及围绕它的选项：有上限的请求体、提示词和停止列表，不在事件循环上做的分词，读请求的
#   期限，靠心跳看着的引擎（引擎死了服务器就退出），API 密钥和 `Host` 白名单。
# - 留给实时页面的两个接缝：`live_page_hub` 和 `live_page_recorder`（这里没有实时页面；附录 C 填上它们）。
# - `python -m nanovllm.serve`（`nanovllm.serve.cli`、`./dev serve`），以及干净的 Ctrl-C；`ServerProcess`：在子进程中
#   运行的服务器，供 notebook、测试和基准测试使用。
#
# ## 练习
#
# 1. 一个 completion 请求发来 3 个提示词，`n = 4`。会返回多少个选项？第二个提示词（提示词 1）的第三个样本（样本 2）
#    的 `index` 是多少？
# 2. 本章的服务器以 `--max-model-len 1024` 运行，没有设置 `--max-body-bytes`。一个请求的请求体最大可以多大？
# 3. 一个客户端向这个服务器要模型 `"gpt-4"`。它得到哪个 HTTP 状态码、哪个错误 `code`？
#
# 下面的单元检查答案，第一题和最后一题在运行中的服务器上检查。

# %%
from nanovllm.serve.guards import default_max_body_bytes

# en: Exercise 1: 3 x 4 = 12 choices; choice i * n + k is sample k of prompt i: 1 * 4 + 2 = 6.
# zh: 练习 1：3 x 4 = 12 个选项；选项 i * n + k 是提示词 i 的样本 k：1 * 4 + 2 = 6。
three = ["One", "Two", "Three"]
answer = client.completions.create(model="smollm2", prompt=three, n=4, max_tokens=2, temperature=0)
assert len(answer.choices) == 12 and sorted(c.index for c in answer.choices) == list(range(12))
# en: With temperature 0 the four samples of a prompt agree: index 6 continues "Two", as index 4 does.
# zh: 温度为 0 时同一个提示词的四个样本相同：index 6 接着 "Two" 写，和 index 4 一样。
by_index = {c.index: c.text for c in answer.choices}
assert by_index[6] == by_index[4] == client.completions.create(model="smollm2", prompt="Two", max_tokens=2,
                                                                temperature=0).choices[0].text

# en: Exercise 2: 256 bytes per token of max_model_len is 256 KiB, less than the floor: 4 MiB.
# zh: 练习 2：按 max_model_len 每个 token 256 字节是 256 KiB，低于下限：4 MiB。
assert default_max_body_bytes(1024) == 4 * 2**20

# en: Exercise 3: 404, code "model_not_found", in OpenAI's shape (the client raises NotFoundError).
# zh: 练习 3：404，code 为 "model_not_found"，OpenAI 的格式（客户端抛出 NotFoundError）。
try:
    client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    raise AssertionError("a model this server does not serve was served")
except openai.NotFoundError as error:
    assert error.status_code == 404 and error.code == "model_not_found"

# en: The chapter's server stops as Ctrl-C would stop it, and no process is left.
# zh: 本章的服务器像被 Ctrl-C 停止那样停止，不留下任何进程。
status = server.stop()
assert status == 0 and server.process.poll() is not None, server.output()
smol_llm.exit()
print(say("all exercise answers check out; the server exited with status {status}", status=status))
