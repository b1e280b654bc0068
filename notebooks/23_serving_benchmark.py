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
# # 23 · Measuring a server: TTFT, TPOT and ITL
#
# **Goal.** Chapter 22 built a server; this chapter measures it the way its users feel it. By its
# end you can run `python -m nanovllm.bench.serve` against any OpenAI-compatible server (ours,
# `transformers serve`, or one on a URL), read its time to first token, time per output token and
# inter-token latency, put the served engine next to the offline one on the same prompts, and say
# what streaming costs per token, measured through a real server. The H200 figures at the end
# show where the last lesson of chapter 21 came from: the engine in a process of its own.

# %% [markdown] tags=["zh"]
# # 23 · 测量服务器：TTFT、TPOT 与 ITL
#
# **目标：** 第 22 章搭好了一个服务器；本章按用户的感受去测量它。读完本章，你能对任何兼容 OpenAI 的服务器（我们的、
# `transformers serve`，或者某个 URL 上的）运行 `python -m nanovllm.bench.serve`，读懂它的首 token 时间、每个输出 token
# 的时间和 token 间延迟，把服务中的引擎和离线引擎放在同样的提示词上比较，并说出流式输出每个 token 的代价——通过一个
# 真实的服务器测出来。最后的 H200 数字说明了第 21 章最后那一课从何而来：让引擎住进自己的进程。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "TPOT mean": "TPOT 均值", "decode step": "decode 步", "4 streams": "4 个流", "1 stream": "1 个流",
    "serving {models} at {url}": "正在提供 {models} 服务，地址 {url}",
    "all exercise answers check out; the server exited with status {status}":
        "练习答案全部验证通过；服务器已退出，退出状态 {status}",
})

# %% [markdown] tags=["en"]
# ## The online benchmark
#
# Throughput alone (chapter 19) does not describe a server. Its users feel **TTFT**, the time to
# the first token (queueing, prefill, the first step), and the time between tokens: **ITL**, the
# gap between two successive chunks of one stream, and **TPOT**, a request's decode time per
# token, `(E2E latency - TTFT) / (output tokens - 1)`. `python -m nanovllm.bench.serve` measures
# them the way `vllm bench serve` does: it sends nano-vllm's workload (chapter 19's random
# prompts, as text) to an OpenAI-compatible server, streaming, all at once or at a Poisson
# `--request-rate`, at most `--max-concurrency` at a time, and reports request throughput, output
# tokens per second and the mean, p50, p90 and p99 of TTFT, TPOT, ITL and end-to-end latency. Any
# server works (`--url`); `--launch both` starts ours and then `transformers serve
# --continuous-batching` on the same model and prompts, and prints them side by side.

# %% [markdown] tags=["zh"]
# ## 在线基准测试
#
# 只看吞吐量（第 19 章）说明不了一个服务器。用户感受到的是 **TTFT**，即首个 token 的时间（排队、prefill、第一步），
# 以及 token 之间的时间：**ITL**，同一个流中相邻两个片段的间隔；**TPOT**，一个请求 decode 阶段平均每个 token 的时间，
# `(端到端延迟 - TTFT) / (输出 token 数 - 1)`。`python -m nanovllm.bench.serve` 按 `vllm bench serve` 的方式测量它们：
# 把 nano-vllm 的负载（第 19 章的随机提示词，以文本形式）流式地发给一个兼容 OpenAI 的服务器，一次全部发出，或按泊松
# 过程以 `--request-rate` 发出，同时最多 `--max-concurrency` 个；报告请求吞吐量、每秒输出 token 数，以及 TTFT、TPOT、
# ITL 和端到端延迟的均值、p50、p90、p99。任何服务器都可以（`--url`）；`--launch both` 先启动我们的服务器，再启动
# `transformers serve --continuous-batching`，用同一个模型和同样的提示词，把两者并排打印出来。

# %% bench serve client
#| export bench.serve
"""``python -m nanovllm.bench.serve``: online serving benchmark, in the conventions of ``vllm bench serve``."""
# zh: ``python -m nanovllm.bench.serve``：在线服务的基准测试，沿用 ``vllm bench serve`` 的约定。

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy

from nanovllm.bench.engine import PRESETS, Workload, make_workload, run_engine
from nanovllm.bench.models import qwen3_06b_random
from nanovllm.bench.report import report_header, write_report


@dataclass
class RequestResult:
    """What one streamed request measured: when its chunks came, and how many tokens it got."""
    # zh: 一个流式请求测到的东西：它的各个分片何时到达，以及它得到了多少个 token。

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    # en: Seconds from sending to the first text
    # zh: 从发送到第一段文本的秒数
    ttft: float = 0.0
    # en: Seconds from sending to the end of the stream
    # zh: 从发送到流结束的秒数
    latency: float = 0.0
    # en: Seconds between successive text chunks
    # zh: 相邻两个文本分块之间的秒数
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def stream_one(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    """Send one streamed completion and time its chunks (a chunk that carries text counts)."""
    # zh: 发送一个流式补全请求，并为它的分片计时（带文本的分片才算数）。
    result = RequestResult()
    began = last = time.perf_counter()
    chunks = 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - began
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - began
    # en: A server that reports no usage: one token a chunk
    # zh: 不报告 usage 的服务器：按每个分块一个 token 计
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    return result


async def run_load(url: str, model: str, prompts: list[str], output_lens: list[int], *, concurrency: int | None,
                   request_rate: float, seed: int, temperature: float, peer_fields: bool) -> tuple[list, float]:
    """Send every prompt (Poisson arrivals at ``request_rate``, or all at once), at most ``concurrency`` at a time;
    return the results and the wall time of the whole run."""
    # zh: 发送每个提示词（按 ``request_rate`` 泊松到达，或者一次全部发出），同时至多 ``concurrency`` 个；
    # zh: 返回结果以及整次运行的挂钟时间。
    limit = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30)
    limits = httpx.Limits(max_connections=concurrency or len(prompts), max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        async def one(prompt: str, max_tokens: int) -> RequestResult:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "stream": True, "stream_options": {"include_usage": True}}
            if not peer_fields:
                # en: Every request makes exactly max_tokens tokens
                # zh: 每个请求恰好生成 max_tokens 个 token
                body["ignore_eos"] = True
            async with limit:
                return await stream_one(http, url, body)

        began = time.perf_counter()
        tasks = []
        for prompt, max_tokens in zip(prompts, output_lens, strict=True):
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - began


def load_in_thread(*args: Any, **kwargs: Any) -> tuple[list, float]:
    """`run_load` from synchronous code, even where an event loop already runs (a notebook): in a thread of its
    own, with an event loop of its own."""
    # zh: 从同步代码里调用 `run_load`，即使那里已经有事件循环在运行（比如 notebook）：放在它自己的线程里，
    # zh: 用它自己的事件循环。
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(run_load(*args, **kwargs))).result()


def _load_share(share: int, start: Any, done: Any, args: tuple, options: dict[str, Any]) -> None:
    """One client process of `load_in_processes`: ready, then its share of the load once ``start`` is set."""
    # zh: `load_in_processes` 的一个客户端进程：先就绪，等 ``start`` 被设置后，发出它分到的那份负载。
    done.put(("ready", share))
    start.wait()
    results, _ = asyncio.run(run_load(*args, **options))
    # en: perf_counter is the system's monotonic clock on Linux
    # zh: 在 Linux 上 perf_counter 就是系统的单调时钟
    done.put((share, results, time.perf_counter()))


def split_concurrency(concurrency: int | None, processes: int) -> list[int | None]:
    """Each client process's share of ``concurrency`` (None: no limit): they add up to it exactly."""
    # zh: 每个客户端进程分到的 ``concurrency``（None：不限）：它们加起来正好等于它。
    if concurrency is None:
        return [None] * processes
    if processes > concurrency:
        raise ValueError(f"{processes} client processes for at most {concurrency} requests at once: some would "
                         f"send nothing; use at most {concurrency}")
    return [concurrency // processes + (k < concurrency % processes) for k in range(processes)]


def load_in_processes(processes: int, url: str, model: str, prompts: list[str], output_lens: list[int], *,
                      concurrency: int | None, request_rate: float, seed: int, **options: Any) -> tuple[list, float]:
    """`run_load` spread over ``processes`` client processes, each with every ``processes``-th prompt, its share of
    the concurrency and of the request rate (Poisson arrivals add up to Poisson arrivals). One Python client
    parsing a few hundred streams becomes the slowest part of a fast server: this measures the server instead.
    Results come back in prompt order; the time runs from the common start to the last stream's end."""
    # zh: 把 `run_load` 分散到 ``processes`` 个客户端进程上，每个进程拿每隔 ``processes`` 个的一个提示词，以及它分到的
    # zh: 并发数和请求速率（泊松到达加起来仍是泊松到达）。一个解析几百个流的 Python 客户端会成为快速服务器前面最慢的
    # zh: 一环：这样测到的才是服务器。结果按提示词顺序返回；时间从共同的起点算到最后一个流结束。
    shares_of_concurrency = split_concurrency(concurrency, processes)
    # en: A clean client, whatever this process holds (CUDA)
    # zh: 干净的客户端进程，不管本进程持有什么（CUDA）
    context = multiprocessing.get_context("spawn")
    start, done = context.Event(), context.Queue()
    workers = [context.Process(target=_load_share, daemon=True, args=(
        k, start, done, (url, model, prompts[k::processes], output_lens[k::processes]),
        {**options, "concurrency": shares_of_concurrency[k], "request_rate": request_rate / processes,
         "seed": seed + k}))
        for k in range(processes)]  # fmt: skip
    for worker in workers:
        worker.start()
    try:
        shares: dict[int, list] = {}
        began, ended, ready = 0.0, 0.0, 0
        while len(shares) < processes:
            try:
                message = done.get(timeout=1.0)
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    raise RuntimeError("a client process of the benchmark failed (its error is above)") from None
                continue
            if message[0] == "ready":
                ready += 1
                if ready == processes:
                    began = time.perf_counter()
                    start.set()
                continue
            share, results, finished = message
            shares[share], ended = results, max(ended, finished)
    finally:
        for worker in workers:
            if len(shares) == processes:
                # en: Done: it is on its way out
                # zh: 已完成：它正在退出
                worker.join(5)
            if worker.is_alive():
                # en: A run that failed: the others stop now, not one after another
                # zh: 有一次运行失败了：其余的现在就停下，而不是一个接一个地等
                worker.kill()
    results = [None] * len(prompts)
    for share, share_results in shares.items():
        results[share::processes] = share_results
    return results, ended - began


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of ``values`` (milliseconds in, milliseconds out; zeros when empty)."""
    # zh: ``values`` 的均值、p50、p90 和 p99（输入毫秒，输出毫秒；为空时全是零）。
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    # en: Linear interpolation, as vLLM's bench does
    # zh: 线性插值，与 vLLM 的 bench 一样
    p50, p90, p99 = numpy.percentile(values, [50, 90, 99]).tolist()
    return {"mean": statistics.fmean(values), "p50": p50, "p90": p90, "p99": p99}


def summarize(name: str, results: list[RequestResult], seconds: float) -> dict[str, Any]:
    """vLLM's serving metrics: throughputs over the whole run, and per-request TTFT, TPOT, ITL, E2E latency."""
    # zh: vLLM 的服务指标：整次运行的吞吐量，以及每个请求的 TTFT、TPOT、ITL、端到端延迟。
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in done if r.output_tokens > 1]
    return {
        "name": name, "completed": len(done), "failed": len(results) - len(done), "seconds": seconds,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "input_tokens": sum(r.prompt_tokens for r in done), "output_tokens": output,
        "request_throughput": len(done) / seconds, "output_throughput": output / seconds,
        "total_token_throughput": (output + sum(r.prompt_tokens for r in done)) / seconds,
        "ttft_ms": percentiles([r.ttft * 1e3 for r in done]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap * 1e3 for r in done for gap in r.itl]),
        "e2e_ms": percentiles([r.latency * 1e3 for r in done]),
    }


STEP_COUNTER = re.compile(r'^nanovllm:engine_(steps|step_seconds)_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', re.M)


def engine_steps(url: str) -> dict[str, dict[str, float]]:
    """Our server's own step counters (``nanovllm:engine_steps`` and ``engine_step_seconds``), by kind, from its
    ``/metrics``: ``{"decode": {"steps": ..., "step_seconds": ...}, ...}``; empty for a server that has none."""
    # zh: 我们的服务器自己的步计数器（``nanovllm:engine_steps`` 和 ``engine_step_seconds``），按种类，取自它的
    # zh: ``/metrics``：``{"decode": {"steps": ..., "step_seconds": ...}, ...}``；没有这些计数器的服务器为空。
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    found: dict[str, dict[str, float]] = {}
    for metric, kind, number in STEP_COUNTER.findall(text):
        found.setdefault(kind, {})[metric] = float(number)
    return found


def step_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """The steps the server ran between two `engine_steps` readings: how many, their seconds, their mean in ms."""
    # zh: 服务器在两次读取 `engine_steps` 之间运行的步：多少步、它们的秒数、以毫秒计的平均值。
    delta = {}
    for kind, counters in after.items():
        steps = counters.get("steps", 0.0) - before.get(kind, {}).get("steps", 0.0)
        seconds = counters.get("step_seconds", 0.0) - before.get(kind, {}).get("step_seconds", 0.0)
        delta[kind] = {"steps": steps, "seconds": seconds, "mean_ms": seconds / steps * 1e3 if steps else 0.0}
    return delta

# %% [markdown] tags=["en"]
# ### The model the GPU measurement serves
#
# On a GPU the measurement runs the nano-vllm workload on Qwen3-0.6B's shapes. Chapter 19's
# engine benchmark already builds that model with random weights (`qwen3_06b_random`: speed does
# not depend on the values of the weights), but its tokenizer is the tiny model's, 512 tokens for a
# vocabulary of 151,936 ids: a server could not turn most generated ids into text, and a stream
# would have no chunk to time. `qwen3_06b_served` keeps that model directory's config and weights
# (links to the same files) and writes a tokenizer from code, with no download: one word per id
# (`t12345`; the special tokens keep their ids), split at spaces. The random prompts' text therefore
# tokenizes back to exactly their ids, and every generated id arrives as a chunk of its own. The
# shapes stay Qwen3-0.6B's, vocabulary included; only the text differs from a real tokenizer's
# (a word per token instead of byte-level pieces), and detokenizing a word costs about what a
# byte-level token does.

# %% [markdown] tags=["zh"]
# ### GPU 测量所服务的模型
#
# 在 GPU 上，测量用 Qwen3-0.6B 的形状跑 nano-vllm 的负载。第 19 章的引擎基准测试已经构造了这个随机权重的模型
# （`qwen3_06b_random`：速度与权重的取值无关），但它的分词器是那个微型模型的，只有 512 个 token，而词表有 151,936
# 个 id：服务器无法把大多数生成的 id 变成文本，流里也就没有可以计时的片段。`qwen3_06b_served` 保留那个模型目录的配置和
# 权重（链接到同样的文件），再用代码写出一个分词器，不需要下载：每个 id 一个单词（`t12345`；特殊 token 保持原来的 id），
# 按空格切分。于是随机提示词的文本分词后恰好得到原来的 id，而每个生成的 id 都单独成为一个片段到达。形状仍是
# Qwen3-0.6B 的，词表也一样；与真实分词器不同的只有文本（每个 token 一个单词，而不是字节级的片段），而反分词一个单词的
# 开销与一个字节级 token 相当。

# %% bench serve model
#| export bench.serve
def word_tokenizer(directory: Path, vocab_size: int, specials: dict[int, str]) -> None:
    """Write into ``directory`` a tokenizer of exactly ``vocab_size`` ids, one word each: ``t{id}``, or the special
    token ``specials`` gives that id, or ``<unk>`` (the first free id: what any other word becomes). Text splits at
    spaces, so the text of any ids tokenizes back to the same ids."""
    # zh: 在 ``directory`` 中写一个恰好有 ``vocab_size`` 个 id 的分词器，每个 id 一个词：``t{id}``，或者
    # zh: ``specials`` 给这个 id 指定的特殊 token，或者 ``<unk>``（第一个空闲的 id：其他任何词都变成它）。文本按空格切
    # zh: 分，
    # zh: 所以任意 id 的文本分词后会得回同样的 id。
    from tokenizers import Tokenizer, models, pre_tokenizers

    unknown = next(i for i in range(vocab_size) if i not in specials)
    words = {**specials, unknown: "<unk>"}
    tokenizer = Tokenizer(models.WordLevel({words.get(i, f"t{i}"): i for i in range(vocab_size)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(specials.values()))
    tokenizer.save(str(directory / "tokenizer.json"))


def with_word_tokenizer(model: str | Path, target: str | Path) -> Path:
    """``target``: the model directory ``model`` (config, generation config and weights, linked, not copied) with a
    `word_tokenizer` as large as its vocabulary; the special tokens and their ids are those of ``model``'s tokenizer."""
    # zh: ``target``：模型目录 ``model``（config、generation config 和权重，链接而非复制），外加一个与它的词表一样大的
    # zh: `word_tokenizer`；特殊 token 及其 id 与 ``model`` 的分词器相同。
    model, target = Path(model), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (target / name).unlink(missing_ok=True)
        (target / name).symlink_to((model / name).resolve())
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    added = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    word_tokenizer(target, config["vocab_size"], {token["id"]: token["content"] for token in added})
    settings = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings |= {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
                 "model_max_length": config["max_position_embeddings"]}
    (target / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return target


def qwen3_06b_served(path: str | None = None) -> Path:
    """The benchmarks' Qwen3-0.6B-shaped model with random weights, with a `word_tokenizer` for all its 151,936 ids."""
    # zh: 各基准测试用的、形状与 Qwen3-0.6B 相同、权重随机的模型，带一个覆盖全部 151,936 个 id 的 `word_tokenizer`。
    return with_word_tokenizer(qwen3_06b_random(), path or f"{tempfile.gettempdir()}/nanovllm-qwen3-0.6b-served")


# %% [markdown] tags=["en"]
# Two comparisons need more than the client's clock. **Served against offline**: `--offline` runs
# `LLM.generate` after the servers are gone (the GPU is the engine's alone again), in the same
# invocation, on the same prompts tokenized as the server tokenizes them, the same output lengths
# (`ignore_eos`), the same temperature and the same engine options (those after `--`); with
# `--max-concurrency C`, at most `C` sequences at a time, as `C` streams keep the server busy.
# **Time between tokens against the engine's step**: our server counts its steps and their seconds
# by kind in `/metrics`; reading them before and after the load gives the mean decode step of
# that very run, next to the streams' ITL.

# %% [markdown] tags=["zh"]
# 有两项比较只靠客户端的时钟不够。**服务对比离线**：`--offline` 在服务器都退出之后（GPU 重新只归引擎使用），在同一次
# 调用里运行 `LLM.generate`：同样的提示词（按服务器的方式分词）、同样的输出长度（`ignore_eos`）、同样的温度、同样的
# 引擎选项（`--` 之后的那些）；有 `--max-concurrency C` 时，同时最多 `C` 个序列，就像 `C` 个流让服务器保持忙碌那样。
# **token 间隔对比引擎的一步**：我们的服务器在 `/metrics` 里按类型统计自己的步数和秒数；在负载前后各读一次，就得到
# 这次运行本身的 decode 步平均时间，与各个流的 ITL 放在一起。

# %% bench serve offline
#| export bench.serve
def run_offline(model: str, tokenizer: Any, prompts: list[str], output_lens: list[int], *, temperature: float,
                settings: dict[str, Any], concurrency: int | None) -> dict[str, Any]:
    """`LLM.generate` on the prompts a server got, tokenized as the server tokenizes them, with its engine
    ``settings``; with ``concurrency``, at most that many sequences at a time. Its figures, in `summarize`'s keys."""
    # zh: 对服务器收到的提示词运行 `LLM.generate`，按服务器的方式分词，使用它的引擎 ``settings``；给了
    # zh: ``concurrency`` 时，同时至多运行那么多个序列。它的数字，用 `summarize` 的键表示。
    from nanovllm.engine.inputs import prompt_token_ids

    ids = [prompt_token_ids(prompt, tokenizer) for prompt in prompts]
    config = dict(settings)
    if concurrency:
        config["max_num_seqs"] = min(config["max_num_seqs"], concurrency)
    breakdown: dict[str, float] = {}
    result = run_engine(model, Workload(ids, list(output_lens), temperature), breakdown=breakdown, **config)
    steps = breakdown.get("decode_steps", 0)
    return {"name": "offline LLM.generate", "seconds": result.seconds, "input_tokens": sum(map(len, ids)),
            "output_tokens": result.output_tokens, "output_throughput": result.tokens_per_s,
            "max_num_seqs": config["max_num_seqs"], "breakdown": breakdown,
            "decode_step_ms": breakdown.get("decode", 0.0) / steps * 1e3 if steps else 0.0}


def print_ratios(summaries: list[dict[str, Any]], offline: dict[str, Any] | None) -> dict[str, float]:
    """The serving goals' comparisons, as far as this run has their terms: our server's output tok/s against the offline
    engine's and against the peer's, and its p50 ITL against its own decode step (and the offline engine's)."""
    # zh: 服务目标的各项比较，只要这次运行具备比较的两项：我们服务器的输出 tok/s 对比离线引擎的和对照组的，
    # zh: 以及它的 p50 ITL 对比它自己的 decode 步（和离线引擎的）。
    ours = next((s for s in summaries if s["name"] == "nano-vllm"), None)
    peer = next((s for s in summaries if s["name"].startswith("transformers")), None)
    ratios: dict[str, float] = {}
    if ours and offline:
        ratios["served_over_offline"] = ours["output_throughput"] / offline["output_throughput"]
        same = "same prompts" if ours["input_tokens"] == offline["input_tokens"] else \
            f"PROMPTS DIFFER: {ours['input_tokens']} vs {offline['input_tokens']} input tokens"
        print(f"served / offline output tok/s: {ratios['served_over_offline']:.2f}x (nano-vllm server "
              f"{ours['output_throughput']:,.1f} tok/s, LLM.generate {offline['output_throughput']:,.1f} tok/s with "
              f"max_num_seqs={offline['max_num_seqs']}; {same}, one invocation)")
    if ours and peer:
        ratios["ours_over_transformers"] = ours["output_throughput"] / max(peer["output_throughput"], 1e-9)
        print(f"output tok/s, nano-vllm / {peer['name']}: {ratios['ours_over_transformers']:.2f}x "
              f"({ours['completed']} and {peer['completed']} requests, one invocation)")
    decode = (ours or {}).get("engine_steps", {}).get("decode", {})
    if decode.get("steps"):
        itl = ours["itl_ms"]["p50"]
        ratios["itl_p50_over_decode_step"] = itl / decode["mean_ms"]
        line = (f"p50 ITL / decode step: {ratios['itl_p50_over_decode_step']:.2f}x (p50 ITL {itl:.2f} ms; the "
                f"server's decode step {decode['mean_ms']:.2f} ms, mean of its {decode['steps']:.0f} decode steps "
                "in this run")
        if offline and offline["decode_step_ms"]:
            ratios["itl_p50_over_offline_decode_step"] = itl / offline["decode_step_ms"]
            line += (f"; LLM.generate's {offline['decode_step_ms']:.2f} ms: "
                     f"{ratios['itl_p50_over_offline_decode_step']:.2f}x")
        print(line + ")")
    return ratios


# %% bench serve main
#| export bench.serve
def print_table(summaries: list[dict[str, Any]]) -> None:
    """One column per server, vLLM's rows."""
    # zh: 每个服务器一列，行是 vLLM 的那些指标。
    names = [s["name"] for s in summaries]
    width = max(14, *(len(n) for n in names))
    rows = [("Successful requests", "completed", "{:.0f}"), ("Failed requests", "failed", "{:.0f}"),
            ("Benchmark duration (s)", "seconds", "{:.2f}"), ("Total input tokens", "input_tokens", "{:.0f}"),
            ("Total output tokens", "output_tokens", "{:.0f}"), ("Request throughput (req/s)", "request_throughput",
                                                                  "{:.2f}"),
            ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
            ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}")]
    print(f"{'':34}" + "".join(f"{n:>{width + 2}}" for n in names))
    for label, key, fmt in rows:
        print(f"{label:34}" + "".join(f"{fmt.format(s[key]):>{width + 2}}" for s in summaries))
    for metric, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        for stat in ("mean", "p50", "p90", "p99"):
            label = f"{stat.capitalize() if stat == 'mean' else stat.upper()} {title} (ms)"
            print(f"{label:34}" + "".join(f"{s[metric][stat]:>{width + 2}.1f}" for s in summaries))


def served_model(url: str) -> str:
    """The id of the model a server serves (its first one)."""
    # zh: 服务器所服务的模型的 id（它的第一个）。
    reply = httpx.get(f"{url}/v1/models", timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def warm_up(url: str, model: str) -> None:
    """One short request first, untimed: a server may load or compile on its first request."""
    # zh: 先发一个短请求，不计时：服务器可能在第一个请求时加载或编译。
    httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4}, timeout=600)


def transformers_command(model: str, port: int, device: str, dtype: str | None = None) -> list[str]:
    """``transformers serve --continuous-batching`` on ``model``, on 127.0.0.1:``port`` (in ``dtype``, e.g. the
    one our engine runs in, rather than the checkpoint's)."""
    # zh: 在 127.0.0.1:``port`` 上对 ``model`` 运行 ``transformers serve --continuous-batching``（使用 ``dtype``，
    # zh: 比如我们引擎运行时用的那个，而不是检查点的）。
    binary = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    # en: Without its console script (a package copied rather than installed), the same command through this Python.
    # zh: 没有它的控制台脚本时（包是拷贝来的而不是安装的），通过当前这个 Python 运行同样的命令。
    command = [binary] if binary else [sys.executable, "-m", "transformers.cli.transformers"]
    return [*command, "serve", model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
            "--device", device, *(["--dtype", dtype] if dtype else [])]


def serve_bench_parser() -> argparse.ArgumentParser:
    """The serving benchmark's command line."""
    # zh: 服务基准测试的命令行。
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.bench.serve",
        description="Serving benchmark (streaming): request throughput, output tok/s, TTFT, TPOT, ITL. "
                    "Arguments after -- go to our server (python -m nanovllm.serve).")
    parser.add_argument("--url", help="benchmark a running OpenAI-compatible server at this URL")
    parser.add_argument("--launch", choices=["ours", "transformers", "both"], default="ours",
                        help="without --url: start our server, transformers serve --continuous-batching, or both "
                             "one after the other on the same prompts (default: ours)")
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct; with --preset nano-vllm, "
                                        "Qwen3-0.6B's shapes with random weights, qwen3_06b_served)")
    parser.add_argument("--device", default="cpu", help="device of the launched servers (default cpu)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--input-len", type=int, nargs=2, metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("LOW", "HIGH"))
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests at once (default: all)")
    parser.add_argument("--client-processes", type=int, default=1, metavar="N",
                        help="send the load from N client processes (default 1): one Python client can be slower "
                             "than a fast server with hundreds of streams")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offline", action="store_true",
                        help="also time LLM.generate on the same prompts, output lengths and engine options, in this "
                             "process once the servers are gone, and print served / offline output tok/s (with "
                             "--max-concurrency C: at most C sequences at a time)")
    parser.add_argument("--peer-num-prompts", type=int, metavar="N",
                        help="transformers serve gets the first N prompts only (it is slow on a GPU); the ratio "
                             "compares output tok/s (default: all)")
    parser.add_argument("--out", help="also write the figures to this JSON file (rewritten after each stage)")
    return parser


@dataclass
class ServeRun:
    """One invocation's load and what it measured so far: its arguments, the prompts (text) and output lengths,
    the servers' summaries and the JSON report (rewritten after each stage)."""
    # zh: 一次调用的负载以及它到目前为止测到的东西：它的参数、提示词（文本）和输出长度、各服务器的汇总，
    # zh: 以及 JSON 报告（每个阶段之后重写）。

    args: argparse.Namespace
    prompts: list[str]
    workload: Workload
    summaries: list[dict[str, Any]]
    report: dict[str, Any]


def measure_server(run: ServeRun, name: str, url: str, peer: bool, model_id: str | None = None,
                   count: int | None = None) -> None:
    """Warm ``url``'s server up, send it the run's load and add its summary to the run's report."""
    # zh: 预热 ``url`` 的服务器，把这次运行的负载发给它，并把它的汇总加进这次运行的报告。
    args, prompts, workload, summaries, report = run.args, run.prompts, run.workload, run.summaries, run.report
    served = model_id or served_model(url)
    warm_up(url, served)
    before = {} if peer else engine_steps(url)
    load = partial(load_in_processes, args.client_processes) if args.client_processes > 1 else load_in_thread
    results, seconds = load(
        url, served, prompts[:count], workload.output_lens[:count], concurrency=args.max_concurrency,
        request_rate=args.request_rate, seed=args.seed, temperature=args.temperature, peer_fields=peer)
    summary = summarize(name, results, seconds)
    if not peer and (steps := step_delta(before, engine_steps(url))):
        # en: What the engine itself spent, in this run
        # zh: 引擎自己在这次运行中花掉的
        summary["engine_steps"] = steps
    summaries.append(summary)
    # en: A run cut short still leaves what it measured
    # zh: 提前中断的运行也会留下已经测得的结果
    write_report(report, args.out)


def launch_and_measure(run: ServeRun, model: str, server_argv: list[str], settings: dict[str, Any],
                       tokenizer: Any) -> None:
    """The servers the command asks for, one after the other (or the one at --url), then the offline engine."""
    # zh: 命令要求的各个服务器，一个接一个（或者 --url 指定的那一个），然后是离线引擎。
    from nanovllm.config import Config
    from nanovllm.serve.process import ServerProcess, free_port

    args, prompts, workload, report = run.args, run.prompts, run.workload, run.report
    if args.url:
        measure_server(run, args.url, args.url, peer=False)
    else:
        if args.launch in ("ours", "both"):
            with ServerProcess(server_argv) as server:
                measure_server(run, "nano-vllm", server.url, peer=False)
        # en: The server has exited: the device is the offline engine's alone
        # zh: 服务器已经退出：设备只归离线引擎使用
        if args.offline:
            report["offline"] = run_offline(model, tokenizer, prompts, workload.output_lens,
                                            temperature=args.temperature, settings=settings,
                                            concurrency=args.max_concurrency)
            write_report(report, args.out)
        if args.launch in ("transformers", "both"):
            # en: The peer runs in our engine's dtype (bfloat16 on a GPU), not the float32 the random model is saved in.
            # zh: 对手使用我们引擎的数据类型（GPU 上是 bfloat16），而不是随机模型保存时的 float32。
            dtype = Config.from_kwargs(model, device=settings["device"], dtype=settings["dtype"]).dtype
            count = args.peer_num_prompts
            name = "transformers" + (f" ({count} prompts)" if count and count < len(prompts) else "")
            port = free_port()
            # en: A peer that fails (it would not start, or broke under the load) is reported with its error, and the
            # en: run still reports ours: it exited with status 1 and no word of why.
            # zh: 对照组失败了（起不来，或者在负载下崩了），就连同它的错误一起报告，这次运行照样报告我们的结果：以前它
            # zh: 以状态 1 退出，一句原因也没有。
            try:
                with ServerProcess(command=transformers_command(model, port, args.device, dtype), port=port) as server:
                    # en: Its model id is the path it was given (transformers 5.17 lists the Hub cache at /v1/models).
                    # zh: 它的模型 id 就是传给它的路径（transformers 5.17 在 /v1/models 列出的是 Hub 缓存）。
                    measure_server(run, name, server.url, peer=True, model_id=model, count=count)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as error:
                report["peer_error"] = f"{type(error).__name__}: {error}"
                print(f"{name} (the peer) failed, and is left out: {report['peer_error'][-2000:]}", file=sys.stderr)
                write_report(report, args.out)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    server_args = args_list[args_list.index("--") + 1 :] if "--" in args_list else []
    args_list = args_list[: args_list.index("--")] if "--" in args_list else args_list
    parser = serve_bench_parser()
    args = parser.parse_args(args_list)
    if args.url and args.offline:
        parser.error("--offline compares with the server this command launches, not with --url")
    if args.client_processes < 1:
        parser.error(f"--client-processes must be at least 1, got {args.client_processes}")

    from transformers import AutoTokenizer

    from nanovllm.book.smollm2 import smollm2_dir
    from nanovllm.serve.cli import build_parser, engine_settings

    if args.model:
        model = args.model
    elif args.preset == "nano-vllm":
        model = str(qwen3_06b_served())
    elif args.preset == "cpu":
        model = str(smollm2_dir())
    else:
        parser.error(f"--preset {args.preset} has no model with weights to serve: give --model")
    # en: The engine options of our server, parsed as the server parses them: the offline engine gets the same.
    # zh: 我们服务器的引擎选项，按服务器的方式解析：离线引擎使用同样的选项。
    server_argv = ["--model", model, "--device", args.device, *server_args]
    settings = engine_settings(build_parser().parse_args(server_argv))
    tokenizer = AutoTokenizer.from_pretrained(model)
    preset = dict(PRESETS[args.preset])
    for key, value in (("num_seqs", args.num_prompts), ("input_len", args.input_len),
                       ("output_len", args.output_len)):
        if value is not None:
            preset[key] = tuple(value) if isinstance(value, list) else value
    workload = make_workload(**preset, vocab_size=len(tokenizer), seed=args.seed)
    # en: nano-vllm's random token ids, as text (what vLLM's random dataset sends): every server tokenizes it
    # en: the same way.
    # zh: nano-vllm 的随机 token id，转成文本发送（vLLM 的 random 数据集也这样做）：每个服务器都以同样的方式分词。
    prompts = [tokenizer.decode(ids) for ids in workload.prompts]
    print(f"workload: {workload.describe()} (sent as text)")
    report = report_header("python -m nanovllm.bench.serve", argv, args.device)
    summaries: list[dict[str, Any]] = []
    report |= {"model": model, "workload": workload.describe(), "max_concurrency": args.max_concurrency,
               "request_rate": args.request_rate, "server_args": server_args, "servers": summaries}

    run = ServeRun(args, prompts, workload, summaries, report)
    launch_and_measure(run, model, server_argv, settings, tokenizer)
    print_table(summaries)
    if "offline" in report:
        offline = report["offline"]
        print(f"{offline['name']}: {offline['output_tokens']} tokens in {offline['seconds']:.2f} s = "
              f"{offline['output_throughput']:,.1f} tok/s (max_num_seqs={offline['max_num_seqs']})")
    report["ratios"] = print_ratios(summaries, report.get("offline"))
    write_report(report, args.out)
    return 0


# en: A notebook also runs this code as __main__; only a real `python -m nanovllm.bench.serve` should act.
# zh: notebook 同样以 __main__ 身份运行这段代码；只有真正的 `python -m nanovllm.bench.serve` 才应执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())

# %% [markdown] tags=["en"]
# ### See it: streaming's cost, measured
#
# A server on SmolLM2-135M-Instruct in a child process, as in chapter 22; the last cell stops it.
# Four streams at once, then one alone, through the server. A stream's ITL is one engine step plus
# what serving adds: the message from the engine process, detokenization, JSON, HTTP. The driver
# times its own steps (`nanovllm:engine_step_seconds` in `/metrics`), so the engine's decode step
# is measured in the server, during the same run. On a shared CPU the figures are only
# indicative; the page shows them and asserts none of them.

# %% [markdown] tags=["zh"]
# ### 看它运行：测量流式输出的代价
#
# 和第 22 章一样，在子进程中启动一个运行 SmolLM2-135M-Instruct 的服务器；最后一个单元会停止它。通过服务器先同时跑
# 四个流，再单独跑一个。一个流的 ITL 等于引擎的一步，加上服务带来的开销：来自引擎进程的消息、反分词、JSON、HTTP。
# 驱动给自己的每一步计时（`/metrics` 里的 `nanovllm:engine_step_seconds`），所以引擎的 decode 步是在服务器里、同一次
# 运行中测得的。在共享的 CPU 上，这些数字只供参考；页面显示它们，但不对其中任何一个做断言。

# %%
import re

import httpx

from nanovllm.book.smollm2 import smollm2_dir
from nanovllm.serve.process import ServerProcess

server = ServerProcess(["--model", str(smollm2_dir()), "--served-model-name", "smollm2",
                        "--max-model-len", "1024"]).start()
print(say("serving {models} at {url}", models=[m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]],
          url=server.url))

# %%
from nanovllm.bench.serve import load_in_thread, summarize


def decode_steps() -> tuple[float, float]:
    """The server's decode steps so far: how many, and their seconds."""
    # zh: 服务器到目前为止的 decode 步：多少步，以及它们的秒数。
    text = httpx.get(f"{server.url}/metrics").text
    found = {m[1]: float(m[2]) for m in re.finditer(r'^nanovllm:(engine_\w+)\{kind="decode",[^}]*\} (\S+)$', text,
                                                    re.M)}
    return found.get("engine_steps_total", 0.0), found.get("engine_step_seconds_total", 0.0)


texts = ["Write a poem about the sea.", "Explain what a KV cache is.", "List three fruits.", "Say hello."]
print(f"{'':10} {'TTFT p50':>9} {'ITL p50':>9} {'ITL p90':>9} {say('TPOT mean'):>10} {say('decode step'):>12}   (ms)")
for name, batch in (("4 streams", texts), ("1 stream", texts[:1])):
    steps_before, seconds_before = decode_steps()
    results, seconds = load_in_thread(server.url, "smollm2", batch, [24] * len(batch), concurrency=None,
                                      request_rate=float("inf"), seed=0, temperature=0.0, peer_fields=False)
    steps_after, seconds_after = decode_steps()
    figures = summarize(name, results, seconds)
    step_ms = (seconds_after - seconds_before) / max(steps_after - steps_before, 1) * 1e3
    print(f"{say(name):10} {figures['ttft_ms']['p50']:9.1f} {figures['itl_ms']['p50']:9.1f} "
          f"{figures['itl_ms']['p90']:9.1f} {figures['tpot_ms']['mean']:10.1f} {step_ms:12.1f}")
    assert figures["completed"] == len(batch) and figures["output_tokens"] == 24 * len(batch)
    # en: 24 tokens: a prefill step, then at least 23 decode steps
    # zh: 24 个 token：一个 prefill 步，然后至少 23 个 decode 步
    assert steps_after - steps_before >= 23

# %% [markdown] tags=["en"]
# ### The benchmark on this book's CPU
#
# `python -m nanovllm.bench.serve --launch both --num-prompts 16 --input-len 32 128 --output-len 32
# 128` on SmolLM2 (float32), the same 16 prompts for both servers, sent at once, streaming, one
# invocation (2026-12-01, this book's 2-core CPU, `OMP_NUM_THREADS=1` for both servers; the
# prompts are 40-122 tokens once tokenized, the outputs 36-126 tokens, 1,412 in all, which both
# servers produced in full):
#
# | | nano-vllm | `transformers serve --continuous-batching` |
# |---|---:|---:|
# | output tokens/s | 44.4 | 45.1 |
# | requests/s | 0.50 | 0.51 |
# | TTFT p50 / p99 | 2.9 s / 2.9 s | 4.0 s / 4.0 s |
# | TPOT mean | 259 ms | 240 ms |
# | ITL p50 / p90 / p99 | 251 / 315 / 503 ms | 227 / 291 / 314 ms |
#
# On one CPU thread the two servers are equally fast (0.99×): a step of SmolLM2 in float32 is
# matrix products that both compute with the same PyTorch kernels, some 230 ms for 16 sequences,
# and serving adds little to it. Ours reaches the first token a second sooner. (An earlier run of
# the same command on this machine, with the driver still a thread of the server and other jobs
# sharing the two cores, measured 2.0× for ours, at half these speeds: on a shared CPU the ratio
# moves with the load, and the GPU is where the engine's design shows.) The cell above shows the
# other half of the story on the same CPU: a stream's p50 ITL is within a few percent of the
# server's own decode step, so what serving adds per token (the message, detokenization, JSON,
# HTTP) is small next to a CPU step.
#
# On a GPU the goals are three, on the nano-vllm workload and Qwen3-0.6B's shapes
# (`qwen3_06b_served`, above): (a) served output tokens per second at least 90 % of the offline
# engine's on the same prompts, in the same run; (b) at least 10× `transformers serve`; (c) at 16
# concurrent streams, a p50 ITL within 1.5× of the engine's own decode step. One command measures
# the three, `scripts/gpu-ci.sh serve`: it installs the serving wheels carried in `.whl-serve/`
# (`scripts/serve-wheels.sh` fetches them), builds the model, and runs `python -m
# nanovllm.bench.serve --preset nano-vllm --device cuda --offline` twice. The first run sends 64 of
# the workload's requests, at most 16 streams at a time, and gives (c): the streams' p50 ITL over
# the server's mean decode step in that run (the offline engine's decode step at 16 sequences is
# printed next to it). The second sends the 256 requests at once to our server, then runs
# `LLM.generate` on the same prompts in the same process, then `transformers serve
# --continuous-batching`, in bfloat16 like ours, on the first 128 prompts only (it is slow; the
# ratio compares output tokens per second, and the peer's column says how many requests it got):
# (a) and (b). Both runs write their figures to JSON (`serve-c16.json`, `serve-256.json`).
#
# **On the H200** (2026-12-01, the server as chapter 22 builds it, the engine in a process of its
# own; `scripts/gpu-ci.sh serve 256 --launch ours`, then `scripts/gpu-ci.sh serve c16`, one
# invocation per row):
#
# | | nano-vllm served | offline `LLM.generate` |
# |---|---:|---:|
# | 256 requests at once: output tokens/s | 22,261.2 | 23,561.0 |
# | 256 at once: TTFT p50, ITL p50 | 833 ms, 6.6 ms | |
# | 256 at once: mean decode step | 4.79 ms (the engine process's) | 4.94 ms |
# | 16 streams: output tokens/s | 6,382.1 | 7,330.9 (16 sequences) |
# | 16 streams: ITL p50, mean decode step | 1.75 ms, 1.62 ms (the engine process's) | 1.67 ms |
#
# (a) is met: served, the engine gives 0.94× its offline tokens per second with 256 requests at
# once. (c) is met: at 16 streams the p50 ITL is 1.08× the server's decode step and 1.05× the
# offline engine's. (b) was measured in an earlier invocation of the same day, with the same server
# (`--launch both`, one client process): 19,769.4 output tokens/s against `transformers serve`'s
# 391.8 on the first 128 prompts, 50.5×; the second invocation left the peer out to save GPU time.
#
# How we got there is the lesson of chapter 21's "engine in a process of its own" section, in
# three measurements of the 256-request run:
#
# | server | served tok/s | served / offline | server's decode step |
# |---|---:|---:|---:|
# | the driver in a thread of the server | 9,272.5 | 0.39× | 12.20 ms (offline 4.87) |
# | the engine in its own process, one client process | 19,769.4 | 0.85× | 4.71 ms (offline 4.89) |
# | the same, the load sent from 4 client processes | 22,261.2 | 0.94× | 4.79 ms (offline 4.94) |
#
# The first row is the GIL: the engine's step took 2.5× longer inside the server. With the engine
# in a process of its own its step is the offline one, and what was left was the benchmark's own
# client: one Python process reading 256 streams fell behind (its p50 ITL was 0.03 ms, chunks
# arriving in bursts from full socket buffers, and its TTFT 1.5 s). `--client-processes 4` spreads
# the streams over four client processes (`load_in_processes`); TTFT fell to 0.8 s. The last 6 %
# has not been profiled. The likely places: the prompts travel as text, so the server tokenizes
# 143k prompt tokens while the requests arrive, and the first prefill steps run with whichever
# requests have come so far.

# %% [markdown] tags=["zh"]
# ### 在本书的 CPU 上跑基准测试
#
# 在 SmolLM2（float32）上运行 `python -m nanovllm.bench.serve --launch both --num-prompts 16 --input-len 32 128
# --output-len 32 128`：两个服务器用同样的 16 个提示词，一次全部发出，流式输出，一次调用完成（2026-12-01，本书的
# 2 核 CPU，两个服务器都设置 `OMP_NUM_THREADS=1`；分词后提示词为 40-122 个 token，输出为 36-126 个 token，共 1,412 个，
# 两个服务器都完整生成了）：
#
# | | nano-vllm | `transformers serve --continuous-batching` |
# |---|---:|---:|
# | 每秒输出 token 数 | 44.4 | 45.1 |
# | 每秒请求数 | 0.50 | 0.51 |
# | TTFT p50 / p99 | 2.9 s / 2.9 s | 4.0 s / 4.0 s |
# | TPOT 均值 | 259 ms | 240 ms |
# | ITL p50 / p90 / p99 | 251 / 315 / 503 ms | 227 / 291 / 314 ms |
#
# 在一个 CPU 线程上，两个服务器一样快（0.99 倍）：SmolLM2 在 float32 下的一步就是矩阵乘法，两者用的是同样的 PyTorch
# 内核，16 个序列约 230 ms，服务在此之上增加的很少。我们的服务器早一秒给出第一个 token。（在同一台机器上，同一条命令
# 更早的一次运行——那时驱动还是服务器里的一个线程，而且有其他任务共用这两个核——测得我们是 2.0 倍，速度只有现在的
# 一半：在共享的 CPU 上，比值随负载变化，引擎设计的差别要在 GPU 上才显出来。）上面那个单元给出了另一半结论，也是
# 在同一台 CPU 上：一个流的 ITL p50 与服务器自己的 decode 步只差几个百分点，所以服务为每个 token 增加的开销（消息、
# 反分词、JSON、HTTP）与 CPU 上的一步相比很小。
#
# 在 GPU 上，目标有三个，用 nano-vllm 的负载和 Qwen3-0.6B 的形状（上面的 `qwen3_06b_served`）：
# (a) 服务时每秒输出 token 数至少达到离线引擎在同样提示词上、同一次运行中的 90%；(b) 至少是 `transformers serve` 的
# 10 倍；(c) 在 16 个并发流时，ITL 的 p50 不超过引擎自己 decode 步时间的 1.5 倍。一条命令测出这三项：
# `scripts/gpu-ci.sh serve`。它安装随代码带过去的 `.whl-serve/` 里的服务相关 wheel（由 `scripts/serve-wheels.sh`
# 下载），构造模型，然后运行两次 `python -m nanovllm.bench.serve --preset nano-vllm --device cuda --offline`。第一次
# 发送负载中的 64 个请求，同时最多 16 个流，给出 (c)：各个流的 ITL p50 除以服务器在这次运行中 decode 步的平均时间
# （旁边还打印离线引擎在 16 个序列时的 decode 步时间）。第二次把 256 个请求一次全部发给我们的服务器，接着在同一个
# 进程里对同样的提示词运行 `LLM.generate`，最后运行 `transformers serve --continuous-batching`（和我们一样用
# bfloat16），但只给它前 128 个提示词（它很慢；比值比较的是每秒输出 token 数，对手那一列的名字写明它收到了多少个
# 请求）：给出 (a) 和 (b)。两次运行都把数字写进 JSON（`serve-c16.json`、`serve-256.json`）。
#
# **在 H200 上**（2026-12-01，服务器就是第 22 章构造的这个，引擎在自己的进程里；先运行 `scripts/gpu-ci.sh serve 256
# --launch ours`，再运行 `scripts/gpu-ci.sh serve c16`，每一行来自同一次调用）：
#
# | | nano-vllm 服务 | 离线 `LLM.generate` |
# |---|---:|---:|
# | 256 个请求一次发出：每秒输出 token 数 | 22,261.2 | 23,561.0 |
# | 256 个一次发出：TTFT p50、ITL p50 | 833 ms、6.6 ms | |
# | 256 个一次发出：decode 步平均时间 | 4.79 ms（引擎进程的） | 4.94 ms |
# | 16 个流：每秒输出 token 数 | 6,382.1 | 7,330.9（16 个序列） |
# | 16 个流：ITL p50、decode 步平均时间 | 1.75 ms、1.62 ms（引擎进程的） | 1.67 ms |
#
# (a) 达到了：256 个请求一次发出时，服务中的引擎给出离线每秒 token 数的 0.94 倍。(c) 达到了：16 个流时 ITL 的 p50 是
# 服务器 decode 步的 1.08 倍，是离线引擎 decode 步的 1.05 倍。(b) 是在同一天更早的一次调用中测的，服务器相同
# （`--launch both`，一个客户端进程）：每秒输出 19,769.4 个 token，`transformers serve` 在前 128 个提示词上是 391.8 个，
# 50.5 倍；第二次调用为了节省 GPU 时间没有运行对手。
#
# 我们是怎样走到这一步的，正是第 21 章“让引擎住进自己的进程”一节的教训，用 256 个请求那次运行的三次测量来说明：
#
# | 服务器 | 服务时每秒 token 数 | 服务 / 离线 | 服务器的 decode 步 |
# |---|---:|---:|---:|
# | 驱动是服务器里的一个线程 | 9,272.5 | 0.39 倍 | 12.20 ms（离线 4.87） |
# | 引擎在自己的进程里，一个客户端进程 | 19,769.4 | 0.85 倍 | 4.71 ms（离线 4.89） |
# | 同上，负载从 4 个客户端进程发出 | 22,261.2 | 0.94 倍 | 4.79 ms（离线 4.94） |
#
# 第一行是 GIL 造成的：引擎的一步在服务器里要长 2.5 倍。引擎住进自己的进程之后，它的一步就是离线时的一步，剩下的是
# 基准测试自己的客户端：一个读 256 个流的 Python 进程跟不上了（它的 ITL p50 是 0.03 ms，分块从塞满的套接字缓冲区里
# 成批涌来，TTFT 是 1.5 s）。`--client-processes 4` 把这些流分给四个客户端进程（`load_in_processes`）；TTFT 降到
# 0.8 s。最后那 6% 还没有做性能分析。可能的地方：提示词以文本形式传送，所以服务器要在请求陆续到达的同时为 14.3 万个
# 提示词 token 分词；而最初几个 prefill 步只带着当时已经到达的请求运行。

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm.bench.serve` (`python -m nanovllm.bench.serve`): TTFT, TPOT, ITL and throughputs
#   against any OpenAI-compatible server, ours and `transformers serve` side by side, the offline
#   engine on the same prompts (`--offline`), the server's own decode step next to the ITL, and the
#   load sent from several client processes (`--client-processes`); `scripts/gpu-ci.sh serve` runs
#   it on Qwen3-0.6B's shapes on a GPU.
#
# ## Exercises
#
# 1. A 20-token stream has a TTFT of 100 ms and ends 480 ms after it was sent. What is its TPOT?
# 2. A stream of a single token has a TTFT of 50 ms. What does it add to the TPOT figures, and
#    why?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.bench.serve`（`python -m nanovllm.bench.serve`）：对任何兼容 OpenAI 的服务器测量 TTFT、TPOT、ITL
#   和吞吐量，把我们的服务器和 `transformers serve` 并排比较，在同样的提示词上对比离线引擎（`--offline`），并把服务器
#   自己的 decode 步时间放在 ITL 旁边，还能从多个客户端进程发出负载（`--client-processes`）；`scripts/gpu-ci.sh serve`
#   在 GPU 上用 Qwen3-0.6B 的形状运行它。
#
# ## 练习
#
# 1. 一个 20 个 token 的流，TTFT 是 100 ms，发出后 480 ms 结束。它的 TPOT 是多少？
# 2. 一个只有一个 token 的流，TTFT 是 50 ms。它给 TPOT 的统计带来什么？为什么？
#
# 下面的单元检查答案。

# %%
from nanovllm.bench.serve import RequestResult

# en: Exercise 1: (480 - 100) / (20 - 1) = 20 ms per token after the first.
# zh: 练习 1：(480 - 100) / (20 - 1) = 首个 token 之后每个 token 20 ms。
one = RequestResult(ok=True, output_tokens=20, ttft=0.100, latency=0.480)
assert abs(summarize("exercise", [one], 1.0)["tpot_ms"]["mean"] - 20.0) < 1e-9

# en: Exercise 2: nothing: TPOT divides the time after the first token by the tokens after it, and a one-token stream
# en: has none, so it counts in TTFT only.
# zh: 练习 2：什么也不带来：TPOT 是首个 token 之后的时间除以之后的 token 数，只有一个 token 的流没有“之后”，所以它只计入
# zh: TTFT。
single = RequestResult(ok=True, output_tokens=1, ttft=0.050, latency=0.050)
both = summarize("exercise", [one, single], 1.0)
assert both["tpot_ms"]["mean"] == summarize("exercise", [one], 1.0)["tpot_ms"]["mean"]
assert abs(both["ttft_ms"]["p50"] - 75.0) < 1e-9

# en: The chapter's server stops as Ctrl-C would stop it, and no process is left.
# zh: 本章的服务器像被 Ctrl-C 停止那样停止，不留下任何进程。
status = server.stop()
assert status == 0 and server.process.poll() is not None, server.output()
print(say("all exercise answers check out; the server exited with status {status}", status=status))
