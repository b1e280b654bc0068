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
# # 21 · Serving: one engine loop, many clients
#
# **Goal.** So far the engine ran *offline*: `generate` receives every prompt up front and returns
# when the last one is done. A server is *online*: clients arrive whenever they like, each wants
# its tokens the moment they exist, and any of them may hang up half-way. Serving takes three
# chapters. This one builds the engine's side: by its end you will know how the engine reports
# every step's tokens and drops a request wherever it is, why exactly one loop drives the engine
# and why that loop gets a process of its own, and how text is cut into pieces without ever
# cutting a character in two. Chapter 22 puts an OpenAI-compatible HTTP server in front of it
# (`python -m nanovllm.serve`, `./dev serve`), and chapter 23 measures what a user of that
# server feels.

# %% [markdown] tags=["zh"]
# # 21 · 服务：一个引擎循环，许多客户端
#
# **目标：** 到目前为止，引擎都是*离线*运行的：`generate` 一开始就拿到所有提示词，最后一个完成时才返回。服务器是
# *在线*的：客户端随时到来，每个都希望 token 一产生就拿到，而且任何一个都可能中途挂断。服务分三章来讲。本章搭建
# 引擎这一侧：读完本章，你会知道引擎怎样报告每一步的 token、怎样不论请求在哪里都能丢弃它，为什么驱动引擎的循环
# 恰好只有一个、为什么它有自己的进程，以及文本怎样切成片段而绝不把一个字符切成两半。第 22 章在它前面放上一个兼容
# OpenAI 的 HTTP 服务器（`python -m nanovllm.serve`、`./dev serve`），第 23 章测量这个服务器的用户感受到的东西。

# %% [markdown] tags=["en"]
# ## From the offline loop to an online one
#
# Chapter 10's `generate` is a loop that owns its prompts: add them all, call `step()` until they
# are finished, return the texts. Chapter 20 already opened that loop: `add_request` queues a
# request at any time, and `step()` computes one step of whatever is queued, so a request added
# between two steps joins the running batch at the next one (continuous batching). A server is
# that loop turned inside out: it never ends, requests come from the network, and the results go
# back to the network, *step by step*.
#
# Two things are missing. `step()` reports a sequence only when it has **finished**; a streaming
# client wants every token as it comes. And a client that goes away must take its request with
# it; chapter 20's `Scheduler.abort` frees one sequence, but a server knows requests, not
# sequences (a request with `n = 3` has three). So the engine gains two methods:
#
# - `step_tokens()`: one `step`, reported token by token: for every sample that has tokens it has
#   not reported yet, a `NewTokens(request_id, sample_index, token_ids, finished)`. Each sequence
#   remembers how many of its completion tokens went out (`num_streamed_tokens`); a token still
#   computing on the GPU (chapter 18's pending token) is not reported until its value is known.
# - `abort_request(request_id, sample_index=None)`: drop a request, or one of its samples, wherever
#   it is (waiting, running, in flight, finished but not reported); its blocks are free at once.

# %% [markdown] tags=["zh"]
# ## 从离线循环到在线循环
#
# 第 10 章的 `generate` 是一个拥有自己提示词的循环：把它们全部加入，反复调用 `step()` 直到全部完成，返回文本。第 20 章
# 已经打开了这个循环：`add_request` 随时可以把一个请求排入队列，`step()` 计算队列中所有请求的一步，所以在两步之间加入的
# 请求会在下一步加入正在运行的批次（连续批处理）。服务器就是把这个循环里外翻转：它永不结束，请求来自网络，结果也要
# *一步一步地*送回网络。
#
# 还缺两样东西。`step()` 只在序列**结束**时才报告它；流式客户端却希望每个 token 一出来就拿到。而离开的客户端必须把它的
# 请求一起带走；第 20 章的 `Scheduler.abort` 释放的是一个序列，服务器知道的却是请求，不是序列（`n = 3` 的请求有三个
# 序列）。所以引擎增加两个方法：
#
# - `step_tokens()`：一次 `step`，按 token 报告：对于每个有尚未报告的 token 的样本，给出一个
#   `NewTokens(request_id, sample_index, token_ids, finished)`。每个序列记住它生成的 token 已经送出多少个
#   （`num_streamed_tokens`）；还在 GPU 上计算的 token（第 18 章的待定 token）在值确定之前不会报告。
# - `abort_request(request_id, sample_index=None)`：丢弃一个请求或它的一个样本，不论它在哪里（等待、运行、计算中、
#   已结束但未报告）；它的块立即释放。

# %% streamed tokens
#| export engine.sequence
from nanovllm.book.literate import add_to_init
from nanovllm.engine.sequence import Sequence


@add_to_init(Sequence)
def _init_streamed(self) -> None:
    # en: How many completion tokens `LLMEngine.step_tokens` has reported for this sequence so far.
    # zh: `LLMEngine.step_tokens` 至今为这个序列报告过多少个生成的 token。
    self.num_streamed_tokens = 0

# %% step tokens
#| export engine.llm_engine
from __future__ import annotations

from dataclasses import dataclass

from nanovllm.book.literate import add_to_class
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence


@dataclass(frozen=True)
class NewTokens:
    """What the last `LLMEngine.step_tokens` call added to one sample of a request: its new completion tokens,
    and whether the sample finished with them (then ``token_ids`` ends with its last token)."""
    # zh: 上一次 `LLMEngine.step_tokens` 调用给请求的一个样本添上的东西：它新生成的 token，以及样本是否随之结束（结束时
    # zh: ``token_ids`` 以它的最后一个 token 收尾）。

    request_id: int
    sample_index: int
    token_ids: list[int]
    finished: bool


@add_to_class(LLMEngine)
def _unreported_sequences(self) -> dict[int, Sequence]:
    """Every sequence that `step` has not reported yet, by seq_id: queued, running, in flight, or finished and
    waiting to be reported."""
    # zh: `step` 还没报告的每个序列，按 seq_id 索引：排队中的、运行中的、计算中的，或者已经结束、等待报告的。
    seqs = [*self.scheduler.waiting, *self.scheduler.running, *self.outbox.unreported]
    if self.in_flight is not None:
        seqs += self.in_flight.seqs
    return {seq.seq_id: seq for seq in seqs}


@add_to_class(LLMEngine)
def step_tokens(self) -> list[NewTokens]:
    """One `step`, reported token by token: every sample that has completion tokens it has not reported yet, with
    those tokens, finished or not. A server streams them; ``step()`` alone reports only finished sequences."""
    # zh: 一次 `step`，按 token 报告：每个有尚未报告的生成 token 的样本，连同这些 token，不论它是否已结束。
    # zh: 服务器把它们流式发出；单靠 ``step()`` 只报告已结束的序列。
    with self._one_call("step_tokens"):
        before = self._unreported_sequences()
    finished = self.step()[0]
    with self._one_call("step_tokens"):
        news = []
        for output in finished:
            seq_id, token_ids = output
            # en: A sample forked and finished within this very step was never seen: all its tokens are new.
            # zh: 在这一步之内分叉又结束的样本从未出现过：它的 token 全是新的。
            streamed = before[seq_id].num_streamed_tokens if seq_id in before else 0
            news.append(NewTokens(output.request_id, output.sample_index, token_ids[streamed:], True))
        for seq in self._unreported_sequences().values():
            known = _known_completion_tokens(seq)
            if known > seq.num_streamed_tokens:
                start = seq.num_prompt_tokens
                new_tokens = seq.token_ids[start + seq.num_streamed_tokens : start + known]
                # en: Only the last token may still be computing, and it is not among the known ones
                # zh: 只有最后一个 token 可能还在计算，而它不在已知的 token 之中
                assert min(new_tokens) >= 0, f"{seq} would stream a pending token"
                news.append(NewTokens(seq.request_id, seq.sample_index, new_tokens, False))
                seq.num_streamed_tokens = known
        return news


def _known_completion_tokens(seq: Sequence) -> int:
    """The completion tokens of ``seq`` whose values are known: all but the one still computing, if any."""
    # zh: ``seq`` 中值已经确定的生成 token 数：除了还在计算的那一个（如果有的话），其余都是。
    end = seq.num_tokens
    while end > seq.num_prompt_tokens and seq.token_ids[end - 1 - seq.first_token_index] == PENDING_TOKEN:
        end -= 1
    return end - seq.num_prompt_tokens


@add_to_class(LLMEngine)
def abort_request(self, request_id: int, sample_index: int | None = None) -> list[int]:
    """Drop a request of `add_request`, or only its sample ``sample_index``: out of the queues, its blocks freed
    now, never reported by `step`. Returns the seq_ids dropped (none once it was reported, or if it never was)."""
    # zh: 丢弃一个 `add_request` 的请求，或者只丢弃它的样本 ``sample_index``：把它移出各个队列，立即释放它的块，
    # zh: `step` 永远不会报告它。返回被丢弃的 seq_id（请求已经报告过，或者从未存在过时，返回空）。
    with self._one_call("abort_request"):
        dropped = []
        for seq in self._unreported_sequences().values():
            if seq.request_id == request_id and sample_index in (None, seq.sample_index):
                if not seq.is_finished:
                    self.scheduler.abort(seq)
                dropped.append(seq.seq_id)
        self.outbox.unreported = [seq for seq in self.outbox.unreported if seq.seq_id not in dropped]
        if sample_index is None:
            self.outbox.dropped.pop(request_id, None)
        return dropped

# %% [markdown] tags=["en"]
# ### See it: a step, token by token
#
# A tiny Qwen3 with random weights (chapter 06) is enough to see the mechanism: two requests, the
# first with three samples. Each line is one `step_tokens()` call: the prefill step gives every
# sample its first token (the first request forks into its three samples there, chapter 05), and
# each decode step one more.

# %% [markdown] tags=["zh"]
# ### 看它运行：一步一步、一个 token 一个 token
#
# 一个随机权重的小 Qwen3（第 06 章）就足以看清这个机制：两个请求，第一个有三个样本。每一行是一次 `step_tokens()` 调用：
# prefill 步给每个样本它的第一个 token（第一个请求在这里分叉成三个样本，第 05 章），之后每个 decode 步再多一个。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "req {request}.{sample} +{tokens}": "请求 {request}.{sample} +{tokens}",
    "req {request}.{sample} +{tokens} done": "请求 {request}.{sample} +{tokens} 完成",
    "blocks in use while it runs: {blocks}": "运行期间占用的块：{blocks}",
    "aborted seq {seqs}; blocks in use: {blocks}": "已中止序列 {seqs}；占用的块：{blocks}",
    "{characters} characters, {count} tokens: {ids}": "{characters} 个字符，{count} 个 token：{ids}",
    "each token decoded alone: {pieces}": "每个 token 单独解码的结果：{pieces}",
    "sent, token by token: {pieces}": "逐个 token 送出的片段：{pieces}",
    "with stop=['世界']: {cut!r}": "设置 stop=['世界'] 时：{cut!r}",
    "window: {path}": "解码窗口：{path}", "Rust (DecodeStream)": "Rust（DecodeStream）", "Python": "Python",
    "all exercise answers check out": "练习答案全部验证通过",
    "{date}, {card}: {command}": "{date}，{card}：{command}",
    "{streams} streams: a decode step {served} ms in the server, {offline} ms offline; "
    "served / offline tok/s {ratio}×":
        "{streams} 个流：一个 decode 步在服务器里 {served} ms，离线 {offline} ms；"
        "服务时每秒 token 数是离线时的 {ratio} 倍",
})

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

tiny = build_tiny_model("qwen3")
llm = LLM(tiny, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
prompts = [list(range(10, 30)), [5, 6, 7]]
params = [SamplingParams(temperature=0.8, seed=1, max_tokens=4, n=3), SamplingParams(temperature=0, max_tokens=3)]
ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
streamed: dict[tuple[int, int], list[int]] = {}
while not llm.is_finished():
    news = llm.step_tokens()
    print(" | ".join(say("req {request}.{sample} +{tokens} done" if n.finished else "req {request}.{sample} +{tokens}",
                         request=n.request_id, sample=n.sample_index, tokens=n.token_ids) for n in news))
    for n in news:
        streamed.setdefault((n.request_id, n.sample_index), []).extend(n.token_ids)

# %% [markdown] tags=["en"]
# ### Check it
#
# What went out piece by piece is exactly what `generate` returns for the same requests, every
# sample of it; and an aborted request's blocks are back in the free list before the next step.

# %% [markdown] tags=["zh"]
# ### 验证
#
# 一片一片送出的内容，与 `generate` 对同样请求返回的完全相同，每个样本都是；被中止的请求的块在下一步之前就已回到
# 空闲队列。

# %%
offline = llm.generate(prompts, params, use_tqdm=False)
assert [streamed[(ids[0], k)] for k in range(3)] == [o["token_ids"] for o in offline[0]["outputs"]]
assert streamed[(ids[1], 0)] == offline[1]["token_ids"]

bm = llm.scheduler.block_manager
# en: ignore_eos: an unseeded sample that drew the end-of-sequence token would finish (and be reported) before the abort
# zh: ignore_eos：没有种子的样本若抽到结束符，会在中止之前就结束（并被报告）
request = llm.add_request(list(range(10, 60)), SamplingParams(max_tokens=50, n=2, ignore_eos=True))
llm.step_tokens(), llm.step_tokens()
print(say("blocks in use while it runs: {blocks}", blocks=len(bm.used_block_ids)))
dropped = llm.abort_request(request)
print(say("aborted seq {seqs}; blocks in use: {blocks}", seqs=dropped, blocks=len(bm.used_block_ids)))
assert len(dropped) == 2 and not bm.used_block_ids and llm.is_finished()
# en: Nothing of it is ever reported
# zh: 关于它的任何内容都不会再被报告
assert llm.step_tokens() == []

# %% [markdown] tags=["en"]
# ## One driver, and a queue
#
# The HTTP side of the server is `asyncio`: one thread, the *event loop*, runs every connection,
# switching between them whenever one waits. The engine is the opposite: a step holds the CPU (or
# waits for the GPU) for milliseconds to seconds, and chapter 20 made every call take the
# engine's lock. A request handler that called `add_request` itself would wait for the step in
# progress, and with it the whole event loop: no other client would get a token meanwhile. And
# if every handler stepped the engine for its own request, the steps would no longer batch.
#
# So exactly one loop, the **driver**, owns the engine; nothing else calls it. It talks with the
# HTTP side only through messages, which is what lets it live in a thread or in another process:
#
# ```
#   HTTP side (EngineClient)                        EngineDriver (owns the LLMEngine)
#   submit(stream): ("add", key, prompt, params) -> between steps: add_request / abort_request
#   abort(stream):  ("abort", key, sample)  -----> step_tokens() -> NewTokens of every request
#   stream.events <- ("step", events, frames, stats): one message per step
# ```
#
# - `run(receive)` reads every waiting message between steps, so a new request joins the batch at
#   the very next step; when the engine is idle it sleeps in `receive(wait=True)`.
# - A thread of the driver says `("alive",)` every second, during a step too, so that the server
#   can tell a stopped engine from a busy one (chapter 22 turns the silence into 503s).
# - Each step's events leave in **one** message: `(key, kind, payload)` per request, where a key is
#   the number the HTTP side gave the request (the engine's request id does not exist until the
#   engine took it). One wake-up of the HTTP side per step, not one per token.
# - The driver answers each request first with "admitted" (or with the engine's refusal, a
#   `ValueError` that becomes a 400 *before* any byte of a response is sent), then with its tokens,
#   and last with "done" (or with the "error" that ended it).
# - A request the client gave up on is an "abort" message: `abort_request` frees its blocks at
#   the next step boundary.
# - A step that raises fails the requests in the engine with a 500 (chapter 20's rollback left the
#   engine consistent) and the server goes on; `NonFiniteLogitsError` fails only the requests it
#   names.
#
# The driver also keeps the figures of `/metrics` (`ServerStats`, sent along with every step) and
# installs the scheduler's observer, `SchedulerWatch`, which counts prefix-cache hits and
# preemptions and, while a live page is open, hands every event on to its recorder.

# %% [markdown] tags=["zh"]
# ## 一个驱动，加一个队列
#
# 服务器的 HTTP 一侧是 `asyncio`：一个线程（*事件循环*）运行所有连接，哪个在等待就切换到别的。引擎恰好相反：一步会占用
# CPU（或等待 GPU）几毫秒到几秒，而第 20 章让引擎的每个调用都要拿引擎的锁。如果请求处理函数自己调用 `add_request`，
# 它就要等正在进行的那一步，整个事件循环也跟着等：这期间其他客户端一个 token 都拿不到。而如果每个处理函数都为自己的
# 请求推进引擎，各步就不再成批了。
#
# 所以恰好有一个循环——**驱动**——拥有引擎；其他任何东西都不调用它。它与 HTTP 一侧只通过消息交谈，正因如此它既可以
# 住在一个线程里，也可以住在另一个进程里：
#
# ```
#   HTTP 一侧（EngineClient）                         EngineDriver（拥有 LLMEngine）
#   submit(stream)：("add", key, prompt, params) ->   两步之间：add_request / abort_request
#   abort(stream)： ("abort", key, sample)  ----->    step_tokens() -> 每个请求的 NewTokens
#   stream.events <- ("step", events, frames, stats)：每步一条消息
# ```
#
# - `run(receive)` 在两步之间读取所有等待中的消息，所以新请求在紧接着的下一步加入批次；引擎空闲时，它在
#   `receive(wait=True)` 里睡眠。
# - 驱动的一个线程每秒说一声 `("alive",)`，步进行中也照说，这样服务器就能分清引擎是停住了还是正忙（第 22 章把沉默
#   变成 503）。
# - 每一步的事件在**一条**消息里发出：每个请求一个 `(key, kind, payload)`，其中 key 是 HTTP 一侧给请求编的号（引擎的
#   请求 id 要等引擎接收了请求才存在）。每步唤醒 HTTP 一侧一次，而不是每个 token 一次。
# - 驱动对每个请求先回答 “admitted”（或者引擎的拒绝：一个 `ValueError`，在响应的任何字节发出*之前*变成 400），然后是
#   它的 token，最后是 “done”（或者是结束它的那个 “error”）。
# - 客户端放弃的请求是一条 “abort” 消息：`abort_request` 在下一个步边界释放它的块。
# - 抛出异常的一步会让引擎中的请求以 500 失败（第 20 章的回滚让引擎保持一致），服务器继续运行；
#   `NonFiniteLogitsError` 只让它点名的请求失败。
#
# 驱动还维护 `/metrics` 的数字（`ServerStats`，随每一步一起发出），并安装调度器的观察者 `SchedulerWatch`：它统计前缀缓存
# 命中和抢占，并在实时页面打开时把每个事件转交给页面的记录器。

# %% driver requests
#| export serve.driver
"""The engine's one driver: it owns the `LLMEngine`, takes requests between steps and hands each step's tokens
on in one batch. It runs wherever the server puts it: in a process of its own (`nanovllm.serve`) or in a thread."""
# zh: 引擎唯一的驱动：它拥有 `LLMEngine`，在两步之间接收请求，并把每一步的 token 合成一批转交出去。
# zh: 服务器把它放在哪里它就在哪里运行：在它自己的进程里（`nanovllm.serve`），或者在一个线程里。

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.outbox import NonFiniteLogitsError
from nanovllm.sampling_params import SamplingParams

_logger = logging.getLogger("nanovllm.serve")

# en: What the driver reads and sends. Requests are named by a `key` that the server chose, since the engine's
# en: request id exists only once the engine took the request. In: ("add", key, prompt, params), ("abort", key,
# en: sample_index or None), ("watch", on) for the live page, ("stop",). Out, once per step: ("step", events,
# en: frames, stats), where each event is (key, kind, payload) and kind is "admitted" (payload: the request id),
# en: "tokens" ((sample_index, token_ids, finished)), "error" (an `EngineError`) or "done" (nothing more will come);
# en: and ("alive", stepping) every HEARTBEAT_SECONDS from a thread of its own, during a step too.
# zh: 驱动读什么、发什么。请求用服务器选定的 `key` 命名，因为引擎的请求 id 要等引擎接收了请求才有。读入：
# zh: ("add", key, prompt, params)、("abort", key, sample_index 或 None)、实时页面的 ("watch", on)、("stop",)。发出，
# zh: 每步一次：("step", events, frames, stats)，其中每个事件是 (key, kind, payload)，kind 为 "admitted"（payload：
# zh: 请求 id）、"tokens"（(sample_index, token_ids, finished)）、"error"（一个 `EngineError`）或 "done"（不会再有了）；
# zh: 另外，一个单独的线程每 HEARTBEAT_SECONDS 发一条 ("alive", stepping)，步进行中也照发。
Message = tuple
# en: receive(wait): the next message, or None if none came (at once; within HEARTBEAT_SECONDS if wait). An idle driver
# en: thus sends an empty step message at least every HEARTBEAT_SECONDS: the server knows it is alive.
# zh: receive(wait)：下一条消息；没有消息到来时为 None（不等待；wait 为真时最多等 HEARTBEAT_SECONDS）。于是空闲的驱动
# zh: 至少每 HEARTBEAT_SECONDS 发出一条空的步消息：服务器由此知道它还活着。
Receive = Callable[[bool], Message | None]
HEARTBEAT_SECONDS = 1.0
# en: make_recorder(scheduler, publish): the live page's recorder, an observer that publishes frames.
# zh: make_recorder(scheduler, publish)：实时页面的记录器，一个发布帧的观察者。
Recorder = Callable[[Any, Callable[[dict], None]], Callable[[str, dict], None]]


@dataclass(frozen=True)
class EngineError:
    """Why the driver gave up on a request, with the HTTP status that says so."""
    # zh: 驱动为什么放弃一个请求，以及表明这一点的 HTTP 状态码。

    status: int
    message: str
    kind: str = "invalid_request_error"


SHUTTING_DOWN_ERROR = EngineError(503, "the server is shutting down", "service_unavailable")

# en: Functions that read counters of an engine feature off the engine, for /metrics (see ServerStats.engine_counters):
# en: later chapters append theirs.
# zh: 从引擎上读出某个引擎功能的计数器、供 /metrics 使用的函数（见 ServerStats.engine_counters）：后面的章节把自己的
# zh: 函数追加进来。
ENGINE_COUNTERS: list[Callable[[LLMEngine], dict[str, float]]] = []


@dataclass
class ServerStats:
    """What ``/metrics`` reports of the engine. The driver updates it after every step and sends a copy along."""
    # zh: ``/metrics`` 报告的引擎情况。驱动在每一步之后更新它，并随消息发出一份副本。

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # en: Prompt tokens of the requests scheduled so far
    # zh: 至今已调度的请求的提示词 token 数
    prefix_cache_queries: int = 0
    # en: Of those, tokens whose KV was found in the prefix cache
    # zh: 其中 KV 在前缀缓存中找到的 token 数
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # en: The engine's steps, by kind ("prefill", "decode"): how many, and their wall time in seconds.
    # zh: 引擎的各步，按种类（"prefill"、"decode"）统计：多少步，以及它们的墙钟时间（秒）。
    steps: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)
    # en: Counters of engine features that later chapters add, read by the functions in ENGINE_COUNTERS: metric
    # en: name, with one label in Prometheus' braces when it has one ('name{position="0"}') -> value.
    # zh: 后面的章节加上的引擎功能的计数器，由 ENGINE_COUNTERS 里的函数读出：指标名（有标签时用 Prometheus 的花括号
    # zh: 写一个标签，如 'name{position="0"}'）-> 数值。
    engine_counters: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs to know of the engine it cannot touch."""
    # zh: HTTP 一侧需要知道的、它碰不到的那个引擎的信息。

    model: str
    max_model_len: int
    num_kvcache_blocks: int
    kvcache_block_size: int
    eos_token_ids: tuple[int, ...]
    # en: The most sequences a step holds: a request's n can be no larger.
    # zh: 一步最多容纳的序列数：请求的 n 不能比它大。
    max_num_seqs: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        config = engine.config
        return cls(config.model, config.max_model_len, config.num_kvcache_blocks, config.kvcache_block_size,
                   tuple(config.eos_token_ids), config.max_num_seqs)


class SchedulerWatch:
    """The scheduler's observer while serving: counts prefix-cache hits and preemptions, and hands every event
    on to the live page's recorder while a page is open (``recorder``)."""
    # zh: 服务时调度器的观察者：统计前缀缓存命中和抢占，并在实时页面打开时把每个事件转交给页面的记录器（``recorder``）。

    def __init__(self, stats: ServerStats, block_size: int) -> None:
        self.stats, self.block_size = stats, block_size
        self.recorder: Callable[[str, dict], None] | None = None
        # en: What the last step scheduled
        # zh: 上一步调度的是什么
        self.is_prefill = False

    def __call__(self, event: str, payload: dict) -> None:
        if event == "schedule":
            seqs = {seq.seq_id: seq for seq in payload["seqs"]}
            for seq_id, blocks in payload["cache_hits"].items():
                # en: A request's first allocation (one that resumes after a preemption has completion tokens).
                # zh: 请求的第一次分配（被抢占后恢复的请求已经有生成的 token）。
                if seqs[seq_id].num_completion_tokens == 0:
                    self.stats.prefix_cache_hits += len(blocks) * self.block_size
            self.stats.num_preemptions += len(payload["preempted"])
            self.is_prefill = bool(payload["is_prefill"])
        if self.recorder is not None:
            self.recorder(event, payload)


def finish_reason(eos_token_ids: tuple[int, ...], params: SamplingParams, token_ids: list[int]) -> str:
    """OpenAI's finish reason of a sample that the engine finished: "stop" on an end-of-sequence token, else
    "length" (it reached max_tokens)."""
    # zh: 引擎结束的一个样本在 OpenAI 中的结束原因：遇到序列结束 token 时是 "stop"，
    # zh: 否则是 "length"（它达到了 max_tokens）。
    ended = not params.ignore_eos and bool(token_ids) and token_ids[-1] in eos_token_ids
    return "stop" if ended else "length"

# %% driver
#| export serve.driver
@dataclass
class _Request:
    """The driver's bookkeeping of one engine request."""
    # zh: 驱动对一个引擎请求的记账。

    key: int
    prompt_len: int
    samples_left: int
    # en: Its first token came
    # zh: 它的第一个 token 已经到来
    started: bool = False


class EngineDriver:
    """Owns the engine: nothing else calls it. `run` reads messages through ``receive`` between steps (and sleeps
    on it while the engine is idle), so that a new request joins the running batch at the next step; each step's
    events leave through ``send``, in one message. ``make_recorder(scheduler, publish)`` builds the live page's
    recorder when a page asks to watch."""
    # zh: 拥有引擎：其他任何东西都不调用它。`run` 在两步之间通过 ``receive`` 读取消息（引擎空闲时就在它上面睡眠），
    # zh: 这样新请求会在下一步加入正在运行的批次；每一步的事件通过 ``send`` 在一条消息里发出。有页面要求观看时，
    # zh: ``make_recorder(scheduler, publish)`` 构造实时页面的记录器。

    def __init__(self, engine: LLMEngine, send: Callable[[Message], None], make_recorder: Recorder | None = None,
                 ) -> None:  # fmt: skip
        self.engine, self.send, self.make_recorder = engine, send, make_recorder
        # en: By the engine's request id
        # zh: 按引擎的请求 id 索引
        self.requests: dict[int, _Request] = {}
        # en: The server's key -> the engine's request id
        # zh: 服务器的 key -> 引擎的请求 id
        self.request_ids: dict[int, int] = {}
        self.stats = ServerStats()
        self.watch = SchedulerWatch(self.stats, engine.config.kvcache_block_size)
        engine.set_observer(self.watch)
        # en: Of the current step, sent in one message
        # zh: 当前这一步的事件，用一条消息发出
        self.events: list[tuple] = []
        self.frames: list[dict] = []
        # en: The heartbeat's thread and the driver's both send: one message at a time.
        # zh: 心跳线程和驱动都要发消息：一次只发一条。
        self.sending = threading.Lock()
        # en: A step is running (the heartbeat says so)
        # zh: 正有一步在运行（心跳会说出来）
        self.stepping = False

    def run(self, receive: Receive) -> None:
        """Serve until a "stop" message, or until ``receive`` raises EOFError (the server is gone)."""
        # zh: 一直服务，直到收到 "stop" 消息，或者 ``receive`` 抛出 EOFError（服务器已经不在了）。
        stopped = threading.Event()
        beat = threading.Thread(target=self._beat, args=(stopped,), name="nanovllm-heartbeat", daemon=True)
        beat.start()
        try:
            while self._read(receive, wait=self.engine.is_finished()):
                if not self.engine.is_finished():
                    self._step()
                self._flush()
        except EOFError:
            return
        # en: A bug of the driver itself: fail what is left, loudly
        # zh: 驱动自身的 bug：让剩下的请求失败，并大声报错
        except BaseException:
            _logger.exception("the engine driver stopped")
            raise
        finally:
            for request in self.requests.values():
                self._event(request.key, "error", SHUTTING_DOWN_ERROR)
            self.requests.clear()
            self._refuse_the_rest(receive)
            stopped.set()
            # en: The heartbeat ends before the driver does: a daemon thread still running when the interpreter exits
            # en: is killed where it stands, which aborted the engine process ("terminate called without an active
            # en: exception") in about one exit in six. Bounded, in case it is stuck sending to a server that
            # en: does not read.
            # zh: 心跳先于驱动结束：解释器退出时仍在运行的守护线程会被就地杀掉，这曾让引擎进程大约每六次退出就有一次
            # zh: 中止（"terminate called without an active exception"）。等待有上限，以防它卡在向不读消息的服务器
            # zh: 发送上。
            beat.join(HEARTBEAT_SECONDS)
            self._flush()

    def _beat(self, stopped: threading.Event) -> None:
        """Say "alive" every HEARTBEAT_SECONDS, from a thread that does not wait for the step in progress: a step of a
        minute (a long prompt on a CPU) is not silence. The model's kernels let go of the GIL, and Python hands it
        over every few milliseconds anyway. A stopped process (SIGSTOP) or a dead one says nothing, and is noticed."""
        # zh: 每隔 HEARTBEAT_SECONDS 说一声 "alive"，由一个不等待进行中那一步的线程来说：一分钟长的一步（CPU 上的
        # zh: 长提示词）不算沉默。模型的内核会释放 GIL，而且 Python 每隔几毫秒也总会把它交出去。被停住的进程（SIGSTOP）
        # zh: 或死掉的进程什么也不说，于是会被察觉。
        while not stopped.wait(HEARTBEAT_SECONDS):
            self._send(("alive", self.stepping))

    def _send(self, message: Message) -> None:
        with self.sending:
            self.send(message)

    def _read(self, receive: Receive, wait: bool) -> bool:
        """Handle every message that came (waiting for one first if ``wait``); False once asked to stop."""
        # zh: 处理所有已到达的消息（``wait`` 时先等来一条）；被要求停止后返回 False。
        message = receive(wait)
        while message is not None:
            if message[0] == "stop":
                return False
            self._handle(message)
            message = receive(False)
        return True

    def _handle(self, message: Message) -> None:
        kind = message[0]
        if kind == "add":
            _, key, prompt, params = message
            try:
                request_id = self.engine.add_request(prompt, params)
            except (TypeError, ValueError) as error:
                self._event(key, "error", EngineError(400, str(error)))
                return
            self.requests[request_id] = _Request(key, len(prompt), params.n)
            self.request_ids[key] = request_id
            self.stats.prefix_cache_queries += len(prompt)
            self._event(key, "admitted", request_id)
        elif kind == "abort":
            _, key, sample_index = message
            request_id = self.request_ids.get(key)
            if request_id is None:
                # en: Finished, refused, or failed already
                # zh: 已经结束、被拒绝或已失败
                return
            dropped = self.engine.abort_request(request_id, sample_index)
            if self.watch.recorder is not None and dropped:
                self.watch.recorder("abort", {"seq_ids": dropped})
            request = self.requests[request_id]
            # en: A sample that finished before the abort came was counted when its last tokens left.
            # zh: 在中止消息到来之前已经结束的样本，在它最后的 token 发出时就已经计过了。
            request.samples_left = 0 if sample_index is None else request.samples_left - bool(dropped)
            if not request.samples_left:
                self._forget(request_id)
        elif kind == "watch":
            on = message[1] and self.make_recorder is not None
            self.watch.recorder = self.make_recorder(self.engine.scheduler, self._publish_frame) if on else None

    def _step(self) -> None:
        began, self.stepping = time.perf_counter(), True
        try:
            news = self.engine.step_tokens()
        except NonFiniteLogitsError as error:
            # en: The engine dropped these requests already; the others go on.
            # zh: 引擎已经丢弃了这些请求；其他请求继续。
            for request_id in error.request_ids:
                if request_id in self.requests:
                    self._fail(request_id, EngineError(500, str(error), "internal_server_error"))
            return
        except Exception as error:
            # en: The model raised in the middle of a step (the engine rolled it back): the requests in the engine
            # en: cannot be trusted to make progress, so they fail, and the server goes on with new ones.
            # zh: 模型在一步的中途抛出异常（引擎已经回滚了这一步）：不能指望引擎里的请求还能前进，所以它们失败，服务器
            # zh: 继续处理新的请求。
            _logger.exception("a step of the engine failed")
            failure = EngineError(500, f"the engine failed: {type(error).__name__}: {error}", "internal_server_error")
            for request_id in list(self.requests):
                self.engine.abort_request(request_id)
                self._fail(request_id, failure)
            return
        finally:
            self.stepping = False
        kind = "prefill" if self.watch.is_prefill else "decode"
        self.stats.steps[kind] = self.stats.steps.get(kind, 0) + 1
        self.stats.step_seconds[kind] = self.stats.step_seconds.get(kind, 0.0) + time.perf_counter() - began
        for new in news:
            request = self.requests.get(new.request_id)
            if request is None:
                # en: Aborted while its last step ran
                # zh: 在它的最后一步运行期间被中止了
                continue
            if not request.started:
                request.started = True
                self.stats.prompt_tokens += request.prompt_len
            self.stats.generation_tokens += len(new.token_ids)
            # en: A plain tuple: it crosses to the server's process once per token, so it is kept cheap to pickle.
            # zh: 一个普通的元组：每个 token 都要跨到服务器进程一次，所以让它便于 pickle。
            self._event(request.key, "tokens", (new.sample_index, new.token_ids, new.finished))
            if new.finished:
                request.samples_left -= 1
                if not request.samples_left:
                    self._forget(new.request_id)

    def _event(self, key: int, kind: str, payload: object) -> None:
        self.events.append((key, kind, payload))

    def _fail(self, request_id: int, error: EngineError) -> None:
        self._event(self.requests[request_id].key, "error", error)
        self._forget(request_id, done=False)

    def _forget(self, request_id: int, done: bool = True) -> None:
        request = self.requests.pop(request_id)
        del self.request_ids[request.key]
        if done:
            self._event(request.key, "done", None)

    def _publish_frame(self, frame: dict) -> None:
        """A frame of the live page's recorder: it leaves with the step's events. A frame that replaces the one
        before it (the recorder gives consecutive adds one index) replaces it here too: 256 requests that arrive
        together send one snapshot of the pool, not 256."""
        # zh: 实时页面记录器的一帧：它随这一步的事件一起发出。取代前一帧的帧（记录器给连续的几次 add 同一个编号）
        # zh: 在这里也取代前一帧：同时到达的 256 个请求只发出一份块池快照，而不是 256 份。
        if self.frames and self.frames[-1]["index"] == frame["index"]:
            self.frames[-1] = frame
        else:
            self.frames.append(frame)

    def _update_stats(self) -> None:
        now = self.engine.stats()
        self.stats.num_requests_running = now.requests_running
        self.stats.num_requests_waiting = now.requests_waiting
        self.stats.kv_cache_usage = now.kv_cache_usage
        for read in ENGINE_COUNTERS:
            self.stats.engine_counters.update(read(self.engine))

    def _flush(self) -> None:
        """Send the step's events, the live page's frames and the figures, in one message."""
        # zh: 把这一步的事件、实时页面的各帧和各项数字放在一条消息里发出。
        self._update_stats()
        events, self.events = self.events, []
        frames, self.frames = self.frames, []
        # en: A copy: in a thread, the HTTP side reads it while the driver goes on counting.
        # zh: 发一份副本：在线程里，驱动接着计数的时候，HTTP 一侧还在读它。
        stats = replace(self.stats, steps=dict(self.stats.steps), step_seconds=dict(self.stats.step_seconds),
                        engine_counters=dict(self.stats.engine_counters))
        self._send(("step", events, frames, stats))

    def _refuse_the_rest(self, receive: Receive) -> None:
        """Requests that arrived after the stop message are refused, so that no client waits forever."""
        # zh: 拒绝在停止消息之后到达的请求，好让没有客户端永远等下去。
        try:
            while (message := receive(False)) is not None:
                if message[0] == "add":
                    self._event(message[1], "error", SHUTTING_DOWN_ERROR)
        except (EOFError, OSError):
            pass

# %% [markdown] tags=["en"]
# ## The engine in a process of its own
#
# The first version of this server ran the driver as a thread of the server's own process. It was
# correct, and on the H200 it was slow: with 256 streams, a decode step took 12.2 ms inside the
# server against 4.9 ms offline, and the server gave 0.39× the offline engine's tokens per second
# (`scripts/gpu-ci.sh serve`, 2026-12-01; chapter 23 has the whole table). The reason is Python's
# global interpreter lock. Every step, the event loop does work for each new token (wake its
# stream, detokenize, build its JSON chunk, write it to the socket), 256 times over with 256
# streams; the engine's thread needs the same lock to prepare and launch the next step, so the two
# add up instead of overlapping, and the GPU waits.

# %% [markdown] tags=["zh"]
# ## 让引擎住进自己的进程
#
# 这个服务器的第一版把驱动作为服务器自己进程里的一个线程来运行。它是正确的，但在 H200 上很慢：256 个流时，服务器里的
# 一个 decode 步要 12.2 ms，离线只要 4.9 ms，服务器每秒给出的 token 只有离线引擎的 0.39 倍
# （`scripts/gpu-ci.sh serve`，2026-12-01；完整的表格见第 23 章）。原因是 Python 的全局解释器锁（GIL）。每一步，
# 事件循环都要为每个新 token 做些事（唤醒它的流、反分词、构造它的 JSON 分块、写进套接字），256 个流时每步要做
# 256 遍；引擎线程准备和启动下一步也需要这把锁，于是两者的时间相加而不是重叠，GPU 就在等待。

# %% recorded: the driver in a thread
from nanovllm.book.recorded import recorded

in_thread = recorded("21_serving")["driver in a thread"]
print(say("{date}, {card}: {command}", date=in_thread.date, card=in_thread.card, command=in_thread.command))
print(say("{streams} streams: a decode step {served} ms in the server, {offline} ms offline; "
          "served / offline tok/s {ratio}×", streams=in_thread.figures["streams"],
          served=in_thread.figures["server decode step ms"], offline=in_thread.figures["offline decode step ms"],
          ratio=in_thread.figures["served / offline tokens/s"]))
# en: The step itself took more than twice as long inside the server as offline.
# zh: 一步本身在服务器里的耗时是离线时的两倍多。
assert in_thread.figures["server decode step ms"] > 2 * in_thread.figures["offline decode step ms"]
assert in_thread.figures["served / offline tokens/s"] == 0.39

# %% [markdown] tags=["en"]
# So `python -m nanovllm.serve` runs the driver in a **process of its own**, as vLLM does since its
# version 1 (its `EngineCore`): the engine steps at its offline pace, whatever the HTTP side does.
#
# ```
#   server process (event loop: HTTP)              engine process (EngineDriver owns the LLMEngine)
#   EngineProcess.submit(stream) --- pipe ------>   between steps: add_request / abort_request
#        (key, prompt, params)                      step_tokens()  ->  one message per step:
#   streams[key].events  <---------- pipe -------   ("step", events, frames, stats)
# ```
#
# - Messages name a request by a `key` that the server chose; payloads are plain tuples, cheap to
#   pickle: the engine's side of the pipe costs it a few microseconds a token.
# - The server reads the pipe from its event loop (`loop.add_reader`): when it falls behind, several
#   steps wait in the pipe, and a stream's tokens from all of them leave in **one** chunk
#   (`Generation.events` merges them). The engine waits for the server only once a megabyte of
#   messages is waiting in the pipe; the server catches up by sending fewer, larger chunks, which
#   is also what vLLM's output collector does. The other way, the server never waits for the
#   engine: its messages leave through a writer thread, so a burst of long prompts cannot block
#   the event loop while the engine is in the middle of a step.
# - Ctrl-C reaches every process of a terminal's group; the engine process is started with it
#   ignored and stops when the server tells it to, after the open streams have ended. If the
#   server dies, Linux ends the engine process too (`die_with_parent`); elsewhere the end of the
#   pipe tells it.
# - `EngineThread` keeps the first design, the driver in a thread: for a notebook or a test that
#   holds an `LLMEngine` (and can, say, make its model fail on purpose). Both are `EngineClient`s:
#   the HTTP side cannot tell them apart.

# %% [markdown] tags=["zh"]
# 所以 `python -m nanovllm.serve` 把驱动放在**它自己的进程**里运行，vLLM 从第 1 版起也是这样做的（它的 `EngineCore`）：
# 不管 HTTP 一侧在做什么，引擎都按离线时的节奏推进。
#
# ```
#   服务器进程（事件循环：HTTP）                      引擎进程（EngineDriver 拥有 LLMEngine）
#   EngineProcess.submit(stream) --- 管道 ------>    两步之间：add_request / abort_request
#        (key, prompt, params)                       step_tokens()  ->  每步一条消息：
#   streams[key].events  <---------- 管道 -------    ("step", events, frames, stats)
# ```
#
# - 消息用服务器选定的 `key` 指代请求；载荷是普通的元组，pickle 的代价很小：管道在引擎一侧每个 token 只花几微秒。
# - 服务器在它的事件循环里读管道（`loop.add_reader`）：当它落后时，好几步的消息在管道里等着，一个流在这几步里的
#   token 会合成**一个**分块发出（由 `Generation.events` 合并）。只有当管道里积压了一兆字节的消息时，引擎才会等
#   服务器；服务器靠发出更少、更大的分块追上进度，vLLM 的输出收集器也是这样做的。反过来，服务器从不等引擎：它的
#   消息由一个写线程发出，所以一批长提示词不会在引擎一步做到一半时堵住事件循环。
# - Ctrl-C 会送到终端进程组里的每个进程；引擎进程启动时就忽略它，等服务器通知它才停止，那时打开的流都已结束。如果
#   服务器死了，Linux 会让引擎进程也随之结束（`die_with_parent`）；在其他系统上，管道的关闭会告诉它。
# - `EngineThread` 保留了第一种设计，即驱动作为一个线程：用于持有 `LLMEngine` 的 notebook 或测试（例如可以故意让它的
#   模型失败）。两者都是 `EngineClient`：HTTP 一侧分不出它们。

# %% engine client
#| export serve.client
"""The HTTP side's handle on the engine driver: requests go out as messages, and each step's events come back and
are spread over the requests' streams. The driver runs in a process of its own (`EngineProcess`, what
``python -m nanovllm.serve`` uses) or in a thread of this process (`EngineThread`)."""
# zh: HTTP 一侧操纵引擎驱动的接口：请求作为消息发出，每一步的事件传回来，再分发到各请求的流中。
# zh: 驱动在它自己的进程里运行（`EngineProcess`，``python -m nanovllm.serve`` 用的就是它），或者在本进程的
# zh: 一个线程里运行（`EngineThread`）。

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from nanovllm.engine.inputs import load_tokenizer
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.driver import (
    HEARTBEAT_SECONDS,
    SHUTTING_DOWN_ERROR,
    EngineDriver,
    EngineError,
    EngineInfo,
    Message,
    Recorder,
    ServerStats,
)


@dataclass(eq=False)
class RequestStream:
    """One engine request as the HTTP side sees it. Its events go into ``events`` (an asyncio.Queue of the event
    loop, shared by the streams of one HTTP request) as ``(stream, kind, payload)``: "admitted" (payload: the
    request id), "tokens" (``(sample_index, token_ids, finished)``) and "error" (an `EngineError`)."""
    # zh: HTTP 一侧眼中的一个引擎请求。它的事件以 ``(stream, kind, payload)`` 的形式放进 ``events``（事件循环的
    # zh: 一个 asyncio.Queue，由一个 HTTP 请求的各个流共用）："admitted"（载荷：请求 id）、"tokens"
    # zh: （``(sample_index, token_ids, finished)``）和 "error"（一个 `EngineError`）。

    prompt: list[int]
    params: SamplingParams
    events: asyncio.Queue
    # en: Which prompt of the HTTP request
    # zh: HTTP 请求中的第几个提示词
    index: int = 0
    # en: Set once the engine took it
    # zh: 引擎接收它之后才设置
    request_id: int | None = None
    # en: The name the driver knows it by
    # zh: 驱动用来称呼它的名字
    key: int = field(default=-1, init=False)


class EngineStartError(RuntimeError):
    """The engine could not start (a bad setting, a missing model...): the message says why."""
    # zh: 引擎无法启动（设置有误、模型缺失……）：消息里写明了原因。


class EngineClient:
    """The engine as the HTTP side sees it. Everything runs on the event loop's thread, except `stop`, which a
    signal handler may also call. Subclasses say where the driver runs (`_start`, `_post`, `join`, `alive`)."""
    # zh: HTTP 一侧眼中的引擎。一切都在事件循环的线程上运行，只有 `stop` 例外，信号处理函数也可能调用它。
    # zh: 子类决定驱动在哪里运行（`_start`、`_post`、`join`、`alive`）。

    def __init__(self, info: EngineInfo, tokenizer: Any) -> None:
        self.info, self.tokenizer = info, tokenizer
        # en: Refuse new requests while this many wait (--max-waiting)
        # zh: 等待的请求达到这个数时，拒绝新请求（--max-waiting）
        self.max_waiting: int | None = None
        # en: By key, until the driver says a request is done
        # zh: 按 key 索引，直到驱动说某个请求已经完成
        self.streams: dict[int, RequestStream] = {}
        self.keys = itertools.count()
        # en: The driver's, as of its last step
        # zh: 驱动的统计，截至它的上一步
        self.stats = ServerStats()
        # en: Responses that ended, by finish reason (the HTTP side's)
        # zh: 已结束的响应，按结束原因计数（HTTP 一侧的）
        self.requests_finished: dict[str, int] = {}
        self.submitted = self.admitted = 0
        # en: The live page's hub (see `dashboard`)
        # zh: 实时页面的 hub（见 `dashboard`）
        self.on_frame: Callable[[list[dict]], None] | None = None
        # en: Set by `stop`: new requests are refused
        # zh: 由 `stop` 设置：拒绝新请求
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        # en: When the driver's last message came (its steps, its heartbeats), and how long a silence means that its
        # en: process is stopped or gone (--engine-timeout); whether its last heartbeat was sent during a step
        # zh: 驱动上一条消息（它的步，或它的心跳）到达的时刻，以及沉默多久就说明它的进程停住了或没了
        # zh: （--engine-timeout）；它的上一次心跳是不是在一步进行中发出的
        self.heard = time.monotonic()
        self.stepping = False
        self.engine_timeout = 60.0
        # en: How long a stopping server waits for the driver to end its step and exit (--shutdown-timeout)
        # zh: 正在停止的服务器等驱动做完手上这一步并退出，最多等多久（--shutdown-timeout）
        self.shutdown_timeout = 10.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heard = time.monotonic()
        self._start()
        loop.call_later(HEARTBEAT_SECONDS, self._watch)

    @property
    def responsive(self) -> bool:
        return time.monotonic() - self.heard < self.engine_timeout

    def silence_error(self) -> EngineError:
        return EngineError(503, f"the engine has not answered for {time.monotonic() - self.heard:.0f} s "
                           f"(--engine-timeout {self.engine_timeout:g})", "service_unavailable")

    def _watch(self) -> None:
        """Each heartbeat: a driver silent for longer than ``engine_timeout`` (its process stopped or gone) fails the
        open requests with 503 instead of leaving them waiting forever; requests that come meanwhile are refused."""
        # zh: 每次心跳时检查：驱动沉默超过 ``engine_timeout``（它的进程停住或卡死了），就让打开的请求以 503 失败，
        # zh: 而不是让它们永远等下去；这期间到来的请求被拒绝。
        if self.stopping:
            return
        if not self.responsive and self.streams:
            self._fail_all(self.silence_error())
        self.loop.call_later(HEARTBEAT_SECONDS, self._watch)

    def submit(self, stream: RequestStream) -> None:
        stream.key = next(self.keys)
        self.streams[stream.key] = stream
        self.submitted += 1
        self._post(("add", stream.key, stream.prompt, stream.params))

    def abort(self, stream: RequestStream, sample_index: int | None = None) -> None:
        """The client is gone (or a stop string ended a sample): free the request's blocks at the next step."""
        # zh: 客户端已经离开（或者一个停止字符串结束了一个样本）：在下一步释放请求的块。
        self._post(("abort", stream.key, sample_index))

    def watch(self, on: bool) -> None:
        """Record the scheduler for the live page (on), or stop (off)."""
        # zh: 为实时页面记录调度器（on），或者停止记录（off）。
        self._post(("watch", on))

    def stop(self) -> None:
        """End the open requests now (with a 503 error event), then stop the driver. Safe in a signal handler: it
        only schedules the work on the event loop."""
        # zh: 立即结束打开的请求（发出一个 503 错误事件），然后停止驱动。可以在信号处理函数中安全调用：
        # zh: 它只是把工作排进事件循环。
        self.stopping = True
        self.loop.call_soon_threadsafe(self._stop_now)

    def _stop_now(self) -> None:
        # en: Not after the driver's step: that can take a minute, and uvicorn cuts the responses still open after
        # en: five seconds (a plain-text 500). The driver learns of the stop once its step ends.
        # zh: 不等驱动的这一步做完：那可能要一分钟，而 uvicorn 五秒后就会掐断还开着的响应（一个纯文本的 500）。驱动在
        # zh: 这一步结束后才知道要停。
        self._fail_all(SHUTTING_DOWN_ERROR)
        self._post(("stop",))

    @property
    def num_waiting(self) -> int:
        """Requests not computing yet: on their way to the driver, or in the engine without their first token."""
        # zh: 还没开始计算的请求：正在发往驱动的途中，或者已在引擎中但还没有第一个 token。
        return self.submitted - self.admitted + self.stats.num_requests_waiting

    def overloaded(self) -> bool:
        return self.max_waiting is not None and self.num_waiting >= self.max_waiting

    def receive(self, message: Message) -> None:
        """A message from the driver (on the event loop's thread): a step's, whose events go to their streams'
        queues, or a heartbeat."""
        # zh: 来自驱动的一条消息（在事件循环的线程上）：一步的消息，其中的事件送进各自流的队列；或者一次心跳。
        self.heard = time.monotonic()
        if message[0] == "alive":
            self.stepping = message[1]
            return
        _, events, frames, self.stats = message
        self.stepping = False
        streams = self.streams
        for key, kind, payload in events:
            stream = streams.get(key)
            if stream is None:
                continue
            if kind == "admitted":
                stream.request_id = payload
                self.admitted += 1
            elif kind == "error":
                del streams[key]
                # en: Refused: it will not wait any more
                # zh: 被拒绝：它不会再等待了
                self.admitted += stream.request_id is None
            elif kind == "done":
                del streams[key]
                continue
            stream.events.put_nowait((stream, kind, payload))
        if frames and self.on_frame is not None:
            self.on_frame(frames)

    def _fail_all(self, error: EngineError) -> None:
        """The driver is gone or silent: every open request ends with ``error``."""
        # zh: 驱动不在了或者沉默了：每个打开的请求都以 ``error`` 结束。
        for stream in self.streams.values():
            stream.events.put_nowait((stream, "error", error))
            self.admitted += stream.request_id is None
        self.streams.clear()

    def _start(self) -> None:
        raise NotImplementedError

    def _post(self, message: Message) -> None:
        raise NotImplementedError

    def join(self, timeout: float) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

# %% engine thread
#| export serve.client
class EngineThread(EngineClient):
    """The driver in a thread of this process, over an `LLMEngine` that stays the caller's (to `exit`)."""
    # zh: 在本进程的一个线程里运行的驱动，驱动的 `LLMEngine` 仍归调用者所有（由调用者 `exit`）。

    def __init__(self, engine: LLMEngine, make_recorder: Recorder | None = None) -> None:
        super().__init__(EngineInfo.of(engine), engine.tokenizer)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.driver = EngineDriver(engine, self._from_driver, make_recorder)
        self.thread = threading.Thread(target=self.driver.run, args=(self._receive,), name="nanovllm-engine-driver",
                                       daemon=True)  # fmt: skip

    def _start(self) -> None:
        self.thread.start()

    def _post(self, message: Message) -> None:
        self.inbox.put(message)

    # en: On the driver's thread
    # zh: 在驱动的线程上运行
    def _receive(self, wait: bool) -> Message | None:
        try:
            return self.inbox.get(timeout=HEARTBEAT_SECONDS) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return None

    # en: On the driver's thread
    # zh: 在驱动的线程上运行
    def _from_driver(self, message: Message) -> None:
        try:
            self.loop.call_soon_threadsafe(self.receive, message)
        # en: The event loop is closed: nobody is listening any more
        # zh: 事件循环已经关闭：没有人在听了
        except RuntimeError:
            pass

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

# %% engine process
#| export serve.client
def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent dies (PR_SET_PDEATHSIG; nothing elsewhere). Linux
    means the parent *thread*: start such a child from a thread that lives as long as the child should."""
    # zh: 请 Linux 在本进程的父进程死掉时给它发 SIGTERM（PR_SET_PDEATHSIG；在其他系统上什么也不做）。
    # zh: Linux 所说的父进程指的是父*线程*：要从一个与子进程寿命一样长的线程里启动这样的子进程。
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore Ctrl-C for the duration, so that a process started meanwhile inherits it ignored (dispositions
    survive exec). Only the main thread may change a signal's handler; elsewhere this does nothing."""
    # zh: 在这段时间里忽略 Ctrl-C，使期间启动的进程继承“忽略”这一设置（信号处置在 exec 之后依然保留）。
    # zh: 只有主线程能更改信号的处理函数；在别的线程里这什么也不做。
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def engine_process_main(model: str, settings: dict[str, Any], make_recorder: Recorder | None,
                        requests: Connection, outputs: Connection) -> None:  # fmt: skip
    """The engine process: build the engine, say so (or say why not), then drive it until the server says stop or
    is gone."""
    # zh: 引擎进程：构造引擎，告知已就绪（或者说明为什么不能），然后一直驱动它，直到服务器说停止或者服务器已经不在了。
    # en: Here: the server's process never builds an engine of its own
    # zh: 在这里导入：服务器进程自己从不构建引擎
    from nanovllm.llm import LLM

    # en: Ctrl-C in a terminal reaches the whole process group: the server decides when the engine stops. (Started
    # en: by `EngineProcess`, the process already ignores it; this covers one started from another thread.)
    # zh: 终端里的 Ctrl-C 会送到整个进程组：何时停止引擎由服务器决定。（由 `EngineProcess` 启动时，进程已经忽略它；
    # zh: 这一行照顾从别的线程启动的情况。）
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    try:
        engine = LLM(model, **settings)
    except Exception as error:
        # en: Not a setting the user can fix: show where it failed
        # zh: 不是用户能修正的设置问题：显示出错的位置
        if not isinstance(error, (TypeError, ValueError)):
            traceback.print_exc()
        outputs.send(("failed", str(error) if isinstance(error, (TypeError, ValueError))
                      else f"{type(error).__name__}: {error}"))
        return

    def send(message: Message) -> None:
        try:
            outputs.send(message)
        # en: The server is gone: the next read of the requests says so (EOFError)
        # zh: 服务器已经不在了：下一次读取请求时会知道（EOFError）
        except OSError:
            pass

    def receive(wait: bool) -> Message | None:
        return requests.recv() if requests.poll(HEARTBEAT_SECONDS if wait else 0) else None

    try:
        outputs.send(("ready", EngineInfo.of(engine)))
        EngineDriver(engine, send, make_recorder).run(receive)
    finally:
        engine.exit()


class EngineProcess(EngineClient):
    """The driver and its engine, ``LLM(model, **settings)``, in a process of their own (spawned: CUDA needs a
    fresh process). The constructor returns once the engine is ready, or raises `EngineStartError`."""
    # zh: 驱动和它的引擎 ``LLM(model, **settings)``，运行在它们自己的进程里（用 spawn 启动：CUDA 需要一个全新的进程）。
    # zh: 构造函数在引擎就绪后返回，或者抛出 `EngineStartError`。

    def __init__(self, model: str, settings: dict[str, Any], make_recorder: Recorder | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        requests_end, self.requests = context.Pipe(duplex=False)
        self.outputs, outputs_end = context.Pipe(duplex=False)
        # en: A larger pipe (Linux: 1 MiB instead of 64 KiB) lets the engine run further ahead of a busy server.
        # zh: 更大的管道（Linux 上 1 MiB，而不是 64 KiB）让引擎在服务器忙时能多跑出去一些。
        if hasattr(fcntl, "F_SETPIPE_SZ"):
            # en: A limit set lower by the system (pipe-max-size) keeps 64 KiB
            # zh: 系统设置的上限（pipe-max-size）更低时，保持 64 KiB
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.outputs.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
        self.process = context.Process(target=engine_process_main, name="nanovllm-engine",
                                       args=(model, settings, make_recorder, requests_end, outputs_end))
        # en: From its first instruction on: it imports torch before its own code runs
        # zh: 子进程从第一条指令起就忽略 Ctrl-C：它在自己的代码运行之前就会导入 torch
        with sigint_ignored():
            self.process.start()
        # en: Only the engine process holds its ends now: when it exits, reading `outputs` gives EOFError.
        # zh: 现在只有引擎进程持有它那两端：它一退出，读 `outputs` 就会得到 EOFError。
        requests_end.close()
        outputs_end.close()
        self.gone = False
        try:
            kind, detail = self.outputs.recv()
            if kind == "failed":
                raise EngineStartError(detail)
            try:
                tokenizer = load_tokenizer(model)
            except Exception as error:
                raise EngineStartError(f"the tokenizer of {model} did not load: {error}") from error
        except EOFError:
            self.process.join()
            raise EngineStartError(f"the engine process exited with status {self.process.exitcode}") from None
        # en: A refusal, a tokenizer that would not load, Ctrl-C while the model loads
        # zh: 拒绝、加载不了的分词器、加载模型时按下的 Ctrl-C
        except BaseException:
            self.process.kill()
            self.process.join()
            raise
        super().__init__(detail, tokenizer)
        # en: Set when the engine process ended without being told to; then ``on_death()`` is called
        # zh: 引擎进程没有接到指令就结束时设置；随后调用 ``on_death()``
        self.died = False
        self.on_death: Callable[[], None] | None = None
        # en: The server's messages leave through a thread of their own: a write to a full pipe (a burst of long
        # en: prompts while the engine is inside a step) then blocks that thread, never the event loop, which must
        # en: keep reading the engine's side, or both processes would wait for each other.
        # zh: 服务器的消息由一个专门的线程发出：写一个满了的管道（引擎正在一步之中时来了一批长提示词）只会阻塞这个线程，
        # zh: 而不会阻塞事件循环；事件循环必须继续读引擎那一侧，否则两个进程会互相等待。
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name="nanovllm-engine-writer", daemon=True)
        self.writer.start()

    def _start(self) -> None:
        self.loop.add_reader(self.outputs.fileno(), self._readable)

    def _readable(self) -> None:
        # en: At most a few messages per call, so that a fast engine cannot starve the event loop's other work.
        # zh: 每次最多处理几条消息，这样快速的引擎不会让事件循环的其他工作饿死。
        try:
            for _ in range(16):
                if not self.outputs.poll():
                    return
                self.receive(self.outputs.recv())
        except (EOFError, OSError):
            self.loop.remove_reader(self.outputs.fileno())
            self.gone, self.died = True, not self.stopping
            self._fail_all(SHUTTING_DOWN_ERROR if self.stopping else
                           EngineError(500, "the engine process stopped", "internal_server_error"))
            # en: Nothing can be served any more: the server stops, so that a supervisor restarts it.
            # zh: 已经无法再提供任何服务：服务器停下来，好让守护进程重启它。
            if self.died and self.on_death is not None:
                self.on_death()

    def _post(self, message: Message) -> None:
        self.outbox.put(message)

    # en: The writer thread
    # zh: 写线程
    def _write(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.requests.send(message)
            # en: The engine process is gone; `alive` says so
            # zh: 引擎进程已经不在了；`alive` 会反映这一点
            except OSError:
                return

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the engine process to end its step and exit; then make it exit."""
        # zh: 最多等 ``timeout`` 秒，让引擎进程做完它的这一步并退出；然后强制它退出。
        self.process.join(min(timeout, 1.0))
        if self.process.is_alive() and timeout > 1.0:
            what = "the engine's running step to end" if self.stepping else "the engine process to exit"
            print(f"nano-vllm: waiting for {what} (at most {timeout - 1:g} s more, --shutdown-timeout)",
                  file=sys.stderr, flush=True)
            self.process.join(timeout - 1.0)
        if self.process.is_alive():
            print("nano-vllm: the engine did not end in time: stopping its process", file=sys.stderr, flush=True)
            self.process.terminate()
            # en: A stopped process (SIGSTOP) takes SIGTERM only once it runs again
            # zh: 被停住（SIGSTOP）的进程，要等它重新运行才会收到 SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        """Stop the engine process from outside the event loop (the command line's last word)."""
        # zh: 从事件循环之外停止引擎进程（命令行程序的最后一句话）。
        if self.process.is_alive():
            self.stopping = True
            self._post(("stop",))
            self.join(self.shutdown_timeout)
        self.outbox.put(None)
        self.writer.join(5)
        self.requests.close()
        self.outputs.close()

    @property
    def alive(self) -> bool:
        return not self.gone and self.process.is_alive()

# %% [markdown] tags=["en"]
# ## Incremental detokenization, and its trap
#
# A stream sends text, and the engine makes token ids. The obvious way, decoding each new token on
# its own, is wrong twice. First, a byte-level vocabulary (SmolLM2's, Qwen's, GPT-2's) spells a
# character outside ASCII with several tokens, one or two bytes each: decoded alone, each piece is
# not valid UTF-8 and comes out as U+FFFD, the replacement character `�`. Second, decoding a
# token alone is not always the same text it makes in context (SentencePiece drops a token's
# leading space at the start of a decode). Here is the trap, with SmolLM2's own tokenizer and a
# real Chinese greeting:

# %% [markdown] tags=["zh"]
# ## 增量反分词，以及它的陷阱
#
# 流里发送的是文本，而引擎产生的是 token id。最直接的做法——把每个新 token 单独解码——错在两处。第一，字节级词表
# （SmolLM2、Qwen、GPT-2 的词表都是）用好几个 token 拼出一个 ASCII 以外的字符，每个 token 一两个字节：单独解码时，每一片
# 都不是合法的 UTF-8，于是变成 U+FFFD，也就是替换字符 `�`。第二，单独解码一个 token 得到的文本，并不总是它在上下文中
# 构成的文本（SentencePiece 在一次解码的开头会去掉 token 前面的空格）。下面就是这个陷阱，用 SmolLM2 自己的分词器和一句
# 真实的中文问候：

# %%
from transformers import AutoTokenizer

from nanovllm.book.smollm2 import smollm2_dir

smol = str(smollm2_dir())
tokenizer = AutoTokenizer.from_pretrained(smol)
greeting = "你好，世界 🙂"
greeting_ids = tokenizer.encode(greeting)
one_by_one = [tokenizer.decode([token]) for token in greeting_ids]
print(say("{characters} characters, {count} tokens: {ids}", characters=len(greeting), count=len(greeting_ids),
          ids=greeting_ids))
print(say("each token decoded alone: {pieces}", pieces=one_by_one))
assert "".join(one_by_one) != greeting and "\ufffd" in "".join(one_by_one)

# %% [markdown] tags=["en"]
# The fix is vLLM's: decode a short **window** of recent tokens, twice, without and with the new
# ones, and send the difference, but only once it no longer ends in `�` (the character is not
# complete yet: wait for its next byte). The window (`prefix_offset` to the end) slides forward
# each time text goes out, so a token costs the same at position 10 and at position 10,000. When
# the sample ends, one full decode gives the exact text a non-streamed request gets, so the joined
# stream equals it by construction, even if a sample ends in the middle of a character.
#
# The event loop runs this for every token of every stream, in the same interpreter as the engine
# (the GIL is shared), so its cost is paid on the step's path. Written in Python it is two
# `tokenizer.decode` calls a token, about 5.7 µs on this book's CPU; `tokenizers` ships the same
# window in Rust, `DecodeStream`, one call a token, about 1.7 µs. The class below uses it whenever
# `tokenizer.decode` is nothing more than the Rust decode (a fast tokenizer that does not clean up
# spaces), keeps the Python window for any other tokenizer, and the check below holds them to the
# same pieces.
#
# `stop` strings are matched on the text, not on tokens (a stop string may start in the middle of
# a token). The text stops *before* the first match, and the last `len(longest stop) - 1`
# characters are held back: they may be the start of a match that the next token completes, and a
# character that was sent cannot be taken back.

# %% [markdown] tags=["zh"]
# 解决办法来自 vLLM：对最近的一小段 token **窗口**解码两次，一次不含新 token、一次含新 token，把两者之差发出去——
# 但只在它不再以 `�` 结尾时才发（字符还不完整：等它的下一个字节）。每当有文本发出，窗口（从 `prefix_offset` 到末尾）
# 就向前滑动，所以第 10 个 token 和第 10,000 个 token 的开销一样。样本结束时，做一次完整解码，得到的正是非流式请求
# 拿到的文本，所以拼接起来的流天然与它相等，即使样本恰好结束在一个字符的中间。
#
# 事件循环对每个流的每个 token 都要做一遍这件事，而且和引擎在同一个解释器里（共用 GIL），所以这笔开销落在每一步的
# 路径上。用 Python 写，每个 token 要调用两次 `tokenizer.decode`，在本书的 CPU 上约 5.7 µs；`tokenizers` 自带了
# 用 Rust 实现的同一个窗口 `DecodeStream`，每个 token 调用一次，约 1.7 µs。下面的类只要 `tokenizer.decode` 就是
# Rust 解码本身（一个不清理空格的快速分词器），就用它；其他分词器仍用 Python 的窗口。后面的验证要求两者给出完全相同
# 的片段。
#
# `stop` 字符串在文本上匹配，而不是在 token 上（停止字符串可能从一个 token 的中间开始）。文本在第一个匹配*之前*结束，
# 最后 `len(最长的停止字符串) - 1` 个字符要扣住不发：它们可能是下一个 token 才补全的匹配的开头，而已经发出的字符
# 是收不回来的。

# %% detokenizer
#| export serve.detokenize
"""Incremental detokenization: the text of a stream of token ids, sent piece by piece."""
# zh: 增量反分词：一串 token id 的文本，一片一片地发出。

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one sample's token ids, as they arrive, into text deltas whose concatenation is exactly
    ``tokenizer.decode(all_ids, skip_special_tokens=True)``, the text a non-streamed request gets.

    A character that spans several tokens (a Chinese character or an emoji in a byte-level vocabulary) decodes
    to U+FFFD until its last byte arrives: such text is held back, never sent. Each new token is decoded within a
    short window of the tokens before it (from ``prefix_offset``), so a step costs the same at token 10 and at
    token 10,000. With a fast tokenizer the window is `tokenizers`' own ``DecodeStream``: one call into Rust a
    token instead of two full ``decode`` calls through Python. ``stop`` strings end the text before their first
    match; the last ``len(longest stop) - 1`` characters wait, since they may be the start of a match.
    """
    # zh: 把一个样本陆续到达的 token id 变成文本增量，它们拼接起来正好是
    # zh: ``tokenizer.decode(all_ids, skip_special_tokens=True)``，也就是非流式请求得到的文本。
    # zh:
    # zh: 横跨多个 token 的字符（字节级词表中的一个汉字或表情符号）在它的最后一个字节到达之前会解码成 U+FFFD：
    # zh: 这样的文本会被扣住，绝不发出。每个新 token 都在它前面一小段 token 的窗口内（从 ``prefix_offset`` 起）解码，
    # zh: 所以第 10 个 token 和第 10,000 个 token 的一步开销相同。用快速分词器时，这个窗口就是 `tokenizers` 自己的
    # zh: ``DecodeStream``：每个 token 调用一次 Rust，而不是通过 Python 做两次完整的 ``decode`` 调用。
    # zh: ``stop`` 字符串让文本在它的第一个匹配之前结束；最后 ``len(longest stop) - 1`` 个字符要等一等，
    # zh: 因为它们可能是一个匹配的开头。

    def __init__(self, tokenizer: Any, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        # en: Where the decoding window starts
        # zh: 解码窗口的起点
        self.prefix_offset = 0
        # en: Tokens before it are already text
        # zh: 它之前的 token 已经变成文本
        self.read_offset = 0
        # en: Every character decoded so far (sent or held back)
        # zh: 至今解码出的所有字符（已发出的或扣住的）
        self.text = ""
        # en: Characters of ``text`` already sent
        # zh: ``text`` 中已经发出的字符数
        self.sent = 0
        # en: A stop string matched: the text ends at ``len(text)``
        # zh: 匹配到了停止字符串：文本在 ``len(text)`` 处结束
        self.stopped = False
        # en: The same window, kept by the Rust tokenizer itself, where its decode is the whole of tokenizer.decode.
        # zh: 同样的窗口，由 Rust 分词器自己维护——前提是它的解码就是 tokenizer.decode 的全部。
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=True) if isinstance(self.backend, Tokenizer) and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Take the next token ids; return the text that can be sent now ("" while a character is incomplete)."""
        # zh: 接收接下来的 token id；返回现在可以发出的文本（字符还不完整时为 ""）。
        if self.stopped:
            return ""
        for token in token_ids:
            self.token_ids.append(token)
            piece = self._next_piece(token)
            if piece:
                self.text += piece
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                if self._find_stop():
                    break
        return self._release(len(self.text) - (0 if self.stopped else self.hold))

    def _next_piece(self, token: int) -> str:
        """The text that ``token``, the last of ``token_ids``, completes: "" while a character is incomplete."""
        # zh: ``token``（``token_ids`` 的最后一个）补全的文本：字符还不完整时为 ""。
        if self.stream is not None:
            try:
                return self.stream.step(self.backend, token) or ""
            except Exception:
                # en: A decoder that rewrote text already sent (DecodeStream refuses it): the window in Python from
                # en: here on; the offsets above followed the stream, so it starts where the stream stopped.
                # zh: 解码器改写了已经发出的文本（DecodeStream 拒绝这种情况）：从这里起改用 Python 里的窗口；
                # zh: 上面的偏移量一直跟着流走，所以它从流停下的地方接着做。
                self.stream = None
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset :])
        return after[len(before) :] if len(after) > len(before) and not after.endswith("\ufffd") else ""

    def finish(self) -> str:
        """The sample ended: the rest of its text, decoded once in full, so the whole equals the non-streamed text."""
        # zh: 样本结束了：它剩下的文本，做一次完整解码得到，因此整体等于非流式的文本。
        if not self.stopped:
            full = self._decode(self.token_ids)
            # en: The windows already gave exactly this prefix; the full decode adds what was held back, such as an
            # en: incomplete character that the sample ended on (decoded as U+FFFD, like the non-streamed text).
            # zh: 各个窗口给出的正是这段前缀；完整解码补上被扣住的部分，比如样本结束时残缺的字符
            # zh: （解码为 U+FFFD，与非流式的文本一样）。
            if full.startswith(self.text[: self.sent]):
                self.text = full
                self._find_stop()
        return self._release(len(self.text))

    def _find_stop(self) -> bool:
        """Cut ``text`` before the first stop string in it; True if one was found."""
        # zh: 把 ``text`` 截断在其中第一个停止字符串之前；找到了就返回 True。
        # en: A match may begin in the characters held back by the previous call, never before them.
        # zh: 匹配可能从上一次调用扣住的字符开始，但不会更早。
        start = max(0, self.sent - self.hold)
        matches = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if matches:
            self.text, self.stopped = self.text[: min(matches)], True
        return self.stopped

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

# %% [markdown] tags=["en"]
# ### Check it
#
# Fed one token at a time, the detokenizer never sends a `�`, sends nothing at all for the tokens
# that end in the middle of a character, and its pieces join to the full decode. A stop string that
# straddles tokens cuts the text before it.

# %% [markdown] tags=["zh"]
# ### 验证
#
# 一次喂一个 token，反分词器从不发出 `�`；对结束在字符中间的 token 什么也不发；发出的片段拼起来就是完整解码。横跨
# 多个 token 的停止字符串会把文本截断在它之前。

# %%
import random

from nanovllm.serve.detokenize import IncrementalDetokenizer

detokenizer = IncrementalDetokenizer(tokenizer)
pieces = [detokenizer.add([token]) for token in greeting_ids] + [detokenizer.finish()]
print(say("sent, token by token: {pieces}", pieces=pieces))
assert "\ufffd" not in "".join(pieces) and "".join(pieces) == greeting
# en: Tokens that only completed half a character
# zh: 只拼出半个字符的 token
assert pieces.count("") >= len(greeting_ids) - len(greeting)
# en: Which window ran depends on the installed tokenizers and transformers: say which, and check the result either
# en: way. On any ids, special ones included, the Python window's text is the full decode, and where the Rust window
# en: (DecodeStream) is there, its pieces are exactly the Python window's.
# zh: 用的是哪个窗口取决于安装的 tokenizers 和 transformers 版本：打印出来，两种情况都检查结果。对任意 id（包括特殊
# zh: token），Python 窗口拼出的文本就是完整解码；有 Rust 窗口（DecodeStream）时，它给出的片段与 Python 窗口完全相同。
print(say("window: {path}", path=say("Rust (DecodeStream)") if detokenizer.stream is not None else say("Python")))
rng = random.Random(0)
random_ids = [rng.randrange(len(tokenizer)) for _ in range(400)] + greeting_ids
in_rust, in_python = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
in_python.stream = None
python_pieces = [in_python.add([t]) for t in random_ids] + [in_python.finish()]
assert "".join(python_pieces) == in_python.text == tokenizer.decode(random_ids, skip_special_tokens=True)
if in_rust.stream is not None:
    assert [in_rust.add([t]) for t in random_ids] + [in_rust.finish()] == python_pieces

stopper = IncrementalDetokenizer(tokenizer, stop=["世界"])
cut = "".join(stopper.add([token]) for token in greeting_ids) + stopper.finish()
print(say("with stop=['世界']: {cut!r}", cut=cut))
assert cut == "你好，" and stopper.stopped

# %% [markdown] tags=["en"]
# ## What we built
#
# - `LLMEngine.step_tokens` and `abort_request`: an engine that reports every step's tokens and
#   drops a request wherever it is.
# - `nanovllm.serve.driver` and `nanovllm.serve.client`: one driver owns the engine, in a process
#   of its own (`EngineProcess`) or a thread (`EngineThread`); requests enter as messages, tokens
#   leave in one message per step, and a stream that fell behind catches up in larger chunks.
# - `nanovllm.serve.detokenize`: incremental detokenization that never splits a character, and
#   stop strings held back by their longest length − 1.
#
# Chapter 22 serves all this over HTTP.
#
# ## Exercises
#
# 1. A request asks for `stop=["\n\n", "END"]`. How many characters can the detokenizer hold back
#    at most, and why not more?
# 2. A request with `n = 3` and a 40-token prompt (blocks of 16 tokens) has just had its prefill
#    step; its client hangs up. How many blocks does `abort_request` free?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `LLMEngine.step_tokens` 和 `abort_request`：一个报告每一步 token 的引擎，以及不论请求在哪里都能丢弃它。
# - `nanovllm.serve.driver` 和 `nanovllm.serve.client`：一个驱动拥有引擎，住在它自己的进程里（`EngineProcess`）或者
#   一个线程里（`EngineThread`）；请求以消息进入，token 每步一条消息地发出，落后的流用更大的分块追上。
# - `nanovllm.serve.detokenize`：绝不拆开字符的增量反分词，以及按最长长度减一扣住尾巴的停止字符串。
#
# 第 22 章把这些通过 HTTP 提供出去。
#
# ## 练习
#
# 1. 一个请求要求 `stop=["\n\n", "END"]`。反分词器最多会扣住多少个字符？为什么不会更多？
# 2. 一个 `n = 3`、提示词 40 个 token（每块 16 个 token）的请求刚完成 prefill 步，它的客户端就挂断了。`abort_request`
#    释放多少个块？
#
# 下面的单元检查答案。

# %%
# en: Exercise 1: len("END") - 1 = 2 characters: a longer tail cannot be the start of a match that is still
# en: incomplete, since every stop string is at most 3 characters long.
# zh: 练习 1：len("END") - 1 = 2 个字符：更长的尾巴不可能是一个尚未完整的匹配的开头，因为每个停止字符串最多 3 个字符。
assert IncrementalDetokenizer(tokenizer, stop=["\n\n", "END"]).hold == 2

# en: Exercise 2: the prompt fills 3 blocks (16 + 16 + 8 tokens, the first token added makes 41); the three samples
# en: share them (reference count 3): aborting the request frees 3 blocks, not 9.
# zh: 练习 2：提示词占 3 个块（16 + 16 + 8 个 token，加上第一个 token 是 41 个）；三个样本共享它们（引用计数 3）：中止
# zh: 这个请求释放 3 个块，而不是 9 个。
request = llm.add_request(list(range(100, 140)), SamplingParams(max_tokens=8, n=3))
llm.step_tokens()
shared = sorted(bm.used_block_ids)
assert len(shared) == 3 and all(bm.blocks[b].ref_count == 3 for b in shared)
assert len(llm.abort_request(request)) == 3 and not bm.used_block_ids

llm.exit()
print(say("all exercise answers check out"))
