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
# # 28 · A fleet: replicas behind a gateway
#
# **Goal.** Chapter 27 made each engine say what its prefix cache holds. This chapter runs several
# engines, **replicas** of one model, behind a **gateway** that picks a replica for each request,
# and starts the whole fleet with one command, `python -m nanovllm.serve.fleet`. We do not write
# a router: SGLang's gateway (`sglang-router`) routes by what it has seen of each replica's
# requests, and we choose it over vLLM's by what each asked of our server in a test. By the end
# you can say why a conversation's turns must come back to one replica, what the gateway sees to
# send them there, how the fleet starts, supervises and stops its processes, how replicas share a
# GPU, and what routing by cache content gained over taking turns on a measured multi-turn
# workload.

# %% [markdown] tags=["zh"]
# # 28 · 机群：网关后面的多个副本
#
# **目标：** 第 27 章让每个引擎说出它的前缀缓存里有什么。本章把同一个模型的几个引擎（**副本**）放到一个**网关**后面运
# 行，由网关为每个请求挑选副本，并用一条命令 `python -m nanovllm.serve.fleet` 启动整个机群。我们不自己写路由器：SGLang的
# 网关（`sglang-router`）按它见过的各副本的请求来分发，我们根据测试中各网关向我们的服务器要了什么，选它而不选 vLLM的。读
# 完本章，你能说出为什么一段对话的各轮必须回到同一个副本，网关看到什么才能把它们送回去，机群怎样启动、看护和停止它的进
# 程，多个副本怎样共用一块 GPU，以及在实测的多轮负载上，按缓存内容分发比轮流分发多得到了什么。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "{replicas} replicas on {gpus} GPUs: {plan}": "{gpus} 块 GPU 上的 {replicas} 个副本：{plan}",
    "the gateway lists the model as {models}": "网关列出的模型是 {models}",
    "user {user}, turn {turn}: replica {replica}, {hits} of {queries} prompt tokens cached":
        "用户 {user} 第 {turn} 轮：副本 {replica}，提示词 {queries} 个 token 中有 {hits} 个已缓存",
    "{policy:<11}  the replica of each turn, by user: {routes}; blocks found in a cache: {hits}":
        "{policy:<11}  各用户每一轮所在的副本：{routes}；在缓存中找到的块：{hits}",
    "the animation's claims hold on its {frames} frames": "动画所说的事在它的 {frames} 帧上全部成立",
    "replica {replica} killed; the next request: HTTP {status}, the same reply: {same}":
        "副本 {replica} 被杀掉；下一个请求：HTTP {status}，回复相同：{same}",
    "the fleet restarted it: {events}": "机群重启了它：{events}",
    "stopped in {seconds:.1f} s; processes left: {left}": "{seconds:.1f} s 内停下；剩下的进程：{left}",
    "{date}, {card}: {command}": "{date}，{card}：{command}",
    "  cache_aware against round_robin: hit rate {hits:.2f}x, TTFT p50 {ttft:.2f}x":
        "  cache_aware 对比 round_robin：命中率 {hits:.2f} 倍，TTFT p50 {ttft:.2f} 倍",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %% [markdown] tags=["en"]
# ## The idea: a conversation comes back to the replica that holds it
#
# A chat's second turn sends the whole conversation again: the first turn's prompt, the reply, a
# new question. On the replica that ran the first turn, chapter 03's prefix cache still holds the
# KV of most of it, and only the new tokens are computed. On any other replica the whole prompt is
# prefilled again, and the user waits for it. With one replica there is nothing to choose; with
# several, the choice decides whether the cache is used at all.
#
# ```
#                       ┌── replica 0:  user A's turns 1, 2, 3   (turns 2 and 3 hit the cache)
#   clients ─► gateway ─┤
#                       └── replica 1:  user B's turns 1, 2, 3
# ```
#
# A gateway can learn where a prefix is cached in two ways. It can remember the **text** of the
# requests it sent to each replica, in an approximate radix tree, and send a request to the
# replica whose past requests share the longest prefix with it, unless that replica is much
# busier than another. Or it can read the replicas' **KV events** (chapter 27), which tell exactly
# which blocks each cache holds, if it can turn a request into the same token ids and hashes.
# The first needs nothing from the replicas; the second is exact but needs them to tokenize for it.

# %% [markdown] tags=["zh"]
# ## 思路：对话要回到保存着它的那个副本
#
# 聊天的第二轮会把整个对话再发一遍：第一轮的提示词、回复，再加一个新问题。在跑过第一轮的那个副本上，第 03 章的前缀缓存还
# 保存着其中大部分的 KV，只需计算新的 token。换到别的副本上，整个提示词都要重新 prefill，用户就得等着。只有一个副本时无
# 从选择；有好几个时，选择决定了缓存到底能不能用上。
#
# ```
#                       ┌── 副本 0：用户 A 的第 1、2、3 轮   （第 2、3 轮命中缓存）
#   客户端 ─► 网关 ─────┤
#                       └── 副本 1：用户 B 的第 1、2、3 轮
# ```
#
# 网关有两种办法知道某个前缀缓存在哪里。它可以记住自己发给每个副本的请求的**文本**，存进一棵近似的基数树（radix tree），
# 把新请求发给过往请求与它共享最长前缀的那个副本，除非那个副本比别的忙得多。它也可以读副本的 **KV 事件**（第 27 章），事
# 件准确地说出每个缓存保存着哪些块，前提是网关能把请求变成同样的 token id 和哈希。前者不需要副本做任何事；后者是精确的，
# 但要副本替它做分词。

# %% [markdown] tags=["en"]
# ## Choosing the gateway, by what it asked of our server
#
# Two maintained gateways are on the package index, and both take a list of worker URLs and a
# `cache_aware` policy. We put each in front of two CPU replicas of SmolLM2 behind a proxy that
# logged every call (2026-12-06, sglang-router 0.3.2 and vllm-router 0.1.17):
#
# | | sglang-router | vllm-router |
# |---|---|---|
# | at startup | `/health`; the model's name from `/server_info` if there (else the model is "unknown") | `/health` |
# | before each request (`cache_aware`) | nothing | `/v1/completions/render` and `/tokenize` on every worker |
# | what `cache_aware` routes by | the request text, in an approximate radix tree | token ids (ours: none to get) |
# | KV events | none | `kv_aware`, tested against vLLM's hashing only |
# | 8 conversations × 3 turns, turns kept on one replica | 8 of 8 (round robin: 4) | 8 of 8 (round robin: 2) |
#
# Both kept every conversation together once requests overlapped. vLLM's asks two endpoints that
# we do not serve before every request, on every worker, and its event-driven policy credited
# none of our events in the test (its own documentation limits that path to vLLM's hashes). So the
# fleet uses **sglang-router**, which needs nothing we lack; our server only adds
# `/server_info`, so that the gateway's `/v1/models` names the model. Moving to vLLM's gateway
# later changes one command line: both take `--worker-urls`.

# %% [markdown] tags=["zh"]
# ## 选网关：看它向我们的服务器要了什么
#
# 包索引上有两个有人维护的网关，都接受一组 worker 的 URL 和 `cache_aware` 策略。我们把每个网关放在两个 SmolLM2 的 CPU副
# 本前面，中间隔一个记录每次调用的代理（2026-12-06，sglang-router 0.3.2 与 vllm-router 0.1.17）：
#
# | | sglang-router | vllm-router |
# |---|---|---|
# | 启动时 | `/health`；有 `/server_info` 就读出模型的名字（否则模型是 "unknown"） | `/health` |
# | 每个请求之前（`cache_aware`） | 什么也不要 | 在每个 worker 上调用 `/v1/completions/render` 和 `/tokenize` |
# | `cache_aware` 按什么分发 | 请求的文本，存在近似的基数树里 | token id（我们这里拿不到） |
# | KV 事件 | 不支持 | `kv_aware`，只对 vLLM 的哈希测试过 |
# | 8 段对话 × 3 轮，各轮留在同一个副本上的 | 8 段中 8 段（轮流：4） | 8 段中 8 段（轮流：2） |
#
# 请求一旦交叠，两者都把每段对话留在了一起。vLLM 的网关在每个请求之前都要向每个 worker 调用两个我们没有提供的接口，它由
# 事件驱动的策略在测试中也没有采信我们的任何事件（它自己的文档把这条路限定在 vLLM 的哈希上）。所以机群用
# **sglang-router**，它不需要任何我们没有的东西；我们的服务器只加上 `/server_info`，让网关的 `/v1/models` 说出模型的
# 名字。以后换成 vLLM 的网关只改一行命令：两者都接受 `--worker-urls`。

# %% server info
#| export serve.app
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.serve.app import api_of, server_routes


# en: Open like /health: a gateway reads it when a worker joins, before it sends any request.
# zh: 与 /health 一样无需密钥：网关在 worker 加入时、发出任何请求之前读取它。
@server_routes.get("/server_info")
async def server_info(request: Request) -> Response:
    """SGLang's server-info route, which its gateway asks each worker it adds: the model's id in the API."""
    # zh: SGLang 的服务器信息接口，它的网关每加入一个 worker 都会问一次：模型在 API 里的 id。
    name = api_of(request).model_name
    return JSONResponse({"model_path": name, "served_model_name": name})

# %% [markdown] tags=["en"]
# ## Build it: a replica, a process group of its own
#
# A replica is `python -m nanovllm.serve` on a port of its own, and the server starts its engine
# in a child process (chapter 22). The fleet starts each replica as the leader of a new **process
# group**, so that one signal to the group reaches the server and its engine together, and a
# Ctrl-C in the terminal reaches only the fleet, which then stops its children in order. A kill
# that the fleet cannot catch (SIGKILL, an out-of-memory kill) must not leave its replicas
# running with nobody to stop them: each child asks Linux for a SIGTERM when the fleet dies
# (chapter 21's `die_with_parent`), and a server that gets one stops its engine. A replica is
# ready when its `/health` answers 200; if its process exits first, waiting stops at once with
# its exit code, rather than at the timeout.

# %% [markdown] tags=["zh"]
# ## 动手：副本，自成一个进程组
#
# 一个副本就是在自己的端口上运行的 `python -m nanovllm.serve`，服务器在一个子进程里启动它的引擎（第 22 章）。机群把每个
# 副本作为一个新**进程组**的组长启动，这样发给进程组的一个信号能同时到达服务器和它的引擎；而终端里的 Ctrl-C 只到达机群本
# 身，由它按顺序停下各个子进程。机群捕获不到的杀法（SIGKILL、内存耗尽时被杀）不能让副本无人看管地继续运行：每个子进程都
# 请 Linux 在机群死掉时给它发 SIGTERM（第 21 章的 `die_with_parent`），收到 SIGTERM 的服务器会停下它的引擎。副本的
# `/health` 返回 200 时就算就绪；如果它的进程先退出了，等待会立即带着退出码结束，而不是等到超时。

# %% replica
#| default_exp serve.fleet
#| export
"""``python -m nanovllm.serve.fleet``: N engine servers behind SGLang's gateway, started and watched by one command."""
# zh: ``python -m nanovllm.serve.fleet``：网关后面的 N 个引擎服务器，由一条命令启动并看护。

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import nanovllm
from nanovllm.serve.client import die_with_parent
from nanovllm.serve.process import free_port


@dataclass
class Replica:
    """One engine server that the fleet started and keeps alive: where it listens, its GPU (None: the CPU, or every
    GPU the machine shows), its server options, its log, its process."""
    # zh: 机群启动并看护的一个引擎服务器：它监听的地址，它的 GPU（None：CPU，或者机器上的所有 GPU），服务器选项，
    # zh: 日志，进程。

    index: int
    host: str
    port: int
    options: list[str]
    log: Path
    gpu: int | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the server as the leader of a new process group (a signal to the group reaches its engine too), to
        get SIGTERM when the fleet dies."""
        # zh: 把服务器作为一个新进程组的组长启动（发给进程组的信号也会到达它的引擎），机群死掉时它会收到 SIGTERM。
        env = dict(os.environ)
        # en: The child imports the nanovllm that this process runs (a checkout may not be installed).
        # zh: 子进程导入的是本进程正在运行的 nanovllm（检出的代码可能没有安装）。
        root = str(Path(nanovllm.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        command = [sys.executable, "-m", "nanovllm.serve", *self.options, "--host", self.host, "--port",
                   str(self.port)]  # fmt: skip
        # en: Linux's parent-death signal goes by the thread that starts the child: the fleet starts and restarts its
        # en: children from one thread, the one that lives as long as the fleet.
        # zh: Linux 的父进程死亡信号看的是启动子进程的那个线程：机群始终在同一个线程里启动和重启子进程，它与机群同寿。
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=die_with_parent)  # fmt: skip

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float) -> None:
        """SIGTERM to the replica's group, SIGKILL to whatever is left of it after ``grace`` seconds."""
        # zh: 向副本的进程组发 SIGTERM，``grace`` 秒后对剩下的发 SIGKILL。
        if self.process is not None:
            stop_groups([self.process], grace)


def stop_groups(processes: list[subprocess.Popen], grace: float) -> None:
    """Stop each process and its whole group (each child of the fleet leads a group of its own): SIGTERM to every
    group, then SIGKILL to what is left after ``grace`` seconds in all (the servers' engine processes included)."""
    # zh: 停下每个进程及其整个进程组（机群的每个子进程各自领导一个进程组）：先向每个组发 SIGTERM，总共等 ``grace``
    # zh: 秒后，对剩下的（包括服务器的引擎进程）发 SIGKILL。
    deadline = time.monotonic() + grace
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()) if sig == signal.SIGTERM else None)


def wait_healthy(url: str, process: subprocess.Popen | None, timeout: float, what: str) -> None:
    """Poll ``url``/health until it answers 200; raise if ``process`` exits first or ``timeout`` seconds pass."""
    # zh: 轮询 ``url``/health，直到它返回 200；如果 ``process`` 先退出，或者过了 ``timeout`` 秒，就抛出异常。
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{what} was not healthy at {url}/health after {timeout:.0f} s")

# %% [markdown] tags=["en"]
# ## Build it: replicas that share a GPU
#
# With as many GPUs as replicas, each replica sees one (`CUDA_VISIBLE_DEVICES`). With fewer, the
# replicas take the GPUs in turn and share them, and the KV cache's sizing needs care: a replica
# sizes its cache from the *whole* GPU's memory when it starts (chapter 09: the total times
# `gpu_memory_utilization`, less what is in use, its neighbours' memory included). So the
# replicas start one after another, and the *k*-th of *m* on a GPU asks for *(k + 1) / m* of the
# utilization: the first takes half of 0.9, the second finds that half in use and takes the rest
# up to 0.9. On the CPU each replica simply sizes its own cache.

# %% [markdown] tags=["zh"]
# ## 动手：共用一块 GPU 的副本
#
# GPU 和副本一样多时，每个副本只看到一块（`CUDA_VISIBLE_DEVICES`）。GPU 不够时，副本轮流分到 GPU 并共用它们，这时 KV缓存
# 的大小要小心确定：副本启动时按*整块* GPU 的显存确定缓存大小（第 09 章：总量乘以 `gpu_memory_utilization`，减去已在使用
# 的部分，邻居占用的显存也算在内）。所以副本一个接一个地启动，一块 GPU 上 *m* 个副本中的第 *k* 个申请利用率的
#  *(k + 1) / m*：第一个拿走 0.9 的一半，第二个发现这一半已被占用，于是拿走剩下的部分，直到 0.9。在 CPU 上，每个副本各自
# 确定自己缓存的大小即可。

# %% gpu budgets
#| export
def gpu_budgets(replicas: int, gpus: int, utilization: float) -> list[tuple[int | None, float | None]]:
    """(GPU, --gpu-memory-utilization) of each replica, None where the server's own applies: one GPU each when there
    are enough; else the replicas take the GPUs in turn, and the k-th of m on one GPU asks for (k + 1) / m of
    ``utilization`` (they start in this order, each sizing its cache from the GPU's free memory)."""
    # zh: 每个副本的（GPU，--gpu-memory-utilization），None 表示用服务器自己的值：GPU 足够时每个副本一块；否则副本轮流
    # zh: 分到 GPU，一块 GPU 上 m 个副本中的第 k 个申请 ``utilization`` 的 (k + 1) / m（它们按这个顺序启动，每个都按
    # zh: GPU 的空闲显存确定自己缓存的大小）。
    if gpus == 0:
        return [(None, None)] * replicas
    if gpus >= replicas:
        return [(i, None) for i in range(replicas)]
    sharing = [len(range(g, replicas, gpus)) for g in range(gpus)]
    return [(i % gpus, round(utilization * (i // gpus + 1) / sharing[i % gpus], 3)) for i in range(replicas)]

# %%
for replicas, gpus in ((2, 0), (2, 2), (2, 1), (3, 2)):
    print(say("{replicas} replicas on {gpus} GPUs: {plan}", replicas=replicas, gpus=gpus,
              plan=gpu_budgets(replicas, gpus, 0.9)))
assert gpu_budgets(2, 1, 0.9) == [(0, 0.45), (0, 0.9)]
assert gpu_budgets(3, 2, 0.9) == [(0, 0.45), (1, 0.9), (0, 0.9)]

# %% [markdown] tags=["en"]
# ## Build it: the gateway's command line
#
# The gateway is SGLang's router, run as `python -m sglang_router.launch_router` with the
# replicas' URLs and the policy. Its defaults suit a data centre that replaces failed machines
# slowly: a health check every 60 s, and a worker taken out only after ten failed requests. A
# fleet that restarts a replica in seconds wants it sooner out of the rotation and sooner back:
# a health check every 2 s, one failure to take a worker out and one success to bring it back,
# and a circuit breaker that opens after two failed requests and tries again after 5 s. A
# request that fails on a dead worker is retried on another (the gateway's default, up to five
# times), so the clients see no error.

# %% [markdown] tags=["zh"]
# ## 动手：网关的命令行
#
# 网关是 SGLang 的路由器，以 `python -m sglang_router.launch_router` 运行，带上各副本的 URL 和策略。它的默认值适合一个慢
# 慢更换故障机器的数据中心：每 60 s 做一次健康检查，一个 worker 要连续失败十个请求才被摘下。一个几秒钟就能重启副本的机
# 群，希望坏掉的副本更快离开轮转、恢复后更快回来：每 2 s 检查一次健康，失败一次就摘下，成功一次就放回；熔断器在两个请求
# 失败后断开，5 s 后再试。落在坏 worker 上的请求会在另一个 worker 上重试（网关的默认行为，最多五次），所以客户端看不到错
# 误。

# %% gateway command
#| export
# en: The policies of sglang-router 0.3.2 that need nothing else (manual routing needs a header from the client).
# zh: sglang-router 0.3.2 里不需要额外东西的策略（manual 要客户端带一个请求头）。
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
GATEWAY_MODULE = "sglang_router.launch_router"


def gateway_command(workers: list[str], policy: str, host: str, port: int, metrics_port: int) -> list[str]:
    """The gateway's command line: its workers, its policy, where it listens (and its Prometheus metrics); a dead
    worker leaves the rotation after one failed health check (one every 2 s) or two failed requests, and comes
    back after one health check that passes."""
    # zh: 网关的命令行：它的 worker、策略、监听的地址（以及它的 Prometheus 指标）；坏掉的 worker 在一次健康检查失败
    # zh: （每 2 s 一次）或两个请求失败后离开轮转，一次健康检查通过后回来。
    return [sys.executable, "-m", GATEWAY_MODULE, "--worker-urls", *workers, "--policy", policy,
            "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", "2", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "5",
            "--log-level", "warn"]  # fmt: skip

# %% [markdown] tags=["en"]
# ## Build it: the fleet, started, supervised, stopped
#
# `Fleet` holds the replicas it starts, the servers that joined by URL (running elsewhere, on other
# machines), and the gateway. `start` brings the replicas up one after another (a replica whose port
# another process took before its server could bind it starts again on a fresh one:
# `start_replica`), checks the servers that joined, then `start_gateway` starts the gateway over all
# of them and waits until it lists every worker as healthy (it answers at once, and adds its workers
# in the background). `check`, called every second, is the supervisor: a replica that exited is
# restarted on its port (the gateway takes it out of the rotation meanwhile and back once it
# answers), the gateway's exit ends the fleet, and a replica that keeps dying ends it too rather
# than looping forever. `stop` sends SIGTERM to every group, the gateway's first, waits a few
# seconds for them all at once, then SIGKILLs what is left, so Ctrl-C ends the whole tree within
# seconds.

# %% [markdown] tags=["zh"]
# ## 动手：机群的启动、看护与停止
#
# `Fleet` 持有它启动的副本、通过 URL 加入的服务器（运行在别处，别的机器上），以及网关。`start` 一个接一个地启动副本
# （服务器绑定端口之前，端口被别的进程占了的副本，换一个新端口重新启动：`start_replica`），检查加入的服务器，然后由
# `start_gateway` 在它们之上启动网关，并等到网关把每个 worker 都列为健康（网关立即应答，worker 是在后台加入的）。
# 每秒调用一次的 `check` 就是看护者：退出了的副本在原端口上重启（网关在此期间把它摘出轮转，等它应答后再放回），网关
# 退出则机群结束，一直死掉的副本也会让机群结束，而不是无休止地循环。`stop` 向每个进程组发 SIGTERM（先发给网关），
# 一起等它们几秒，再对剩下的发 SIGKILL，所以 Ctrl-C 能在几秒内结束整棵进程树。

# %% fleet
#| export
import atexit
from dataclasses import field


@dataclass
class Fleet:
    """The replicas this command starts, the servers that joined by URL, and the gateway in front of them all."""
    # zh: 本命令启动的副本、通过 URL 加入的服务器，以及它们前面的网关。

    replicas: list[Replica]
    remote: list[str]
    policy: str
    host: str
    port: int
    metrics_port: int
    log_dir: Path
    startup_timeout: float = 600.0
    max_restarts: int = 10
    gateway: subprocess.Popen | None = None
    # en: What the supervisor did, in order (also printed to stderr).
    # zh: 看护者做过的事，按先后顺序（也打印到 stderr）。
    events: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the replicas one after another, each healthy before the next (`gpu_budgets` counts on that order),
        check the servers that joined by URL, then start the gateway over all of them and wait until it answers."""
        # zh: 一个接一个地启动副本，每个都健康了才启动下一个（`gpu_budgets` 依赖这个顺序），检查通过 URL 加入的服务器，
        # zh: 然后在它们之上启动网关，等到它应答。
        # en: Whatever happens to this process short of a kill (an error, a notebook's kernel shutting down), what it
        # en: started stops with it: each child leads a process group of its own, out of reach of a terminal's Ctrl-C.
        # zh: 只要本进程不是被强行杀掉（出错、notebook 的内核关闭），它启动的东西都随它一起停下：每个子进程各自领导一个
        # zh: 进程组，终端里的 Ctrl-C 够不着它们。
        atexit.register(self.stop)
        for replica in self.replicas:
            self.start_replica(replica)
        for url in self.remote:
            wait_healthy(url, None, self.startup_timeout, f"the server at {url}")
        self.start_gateway()

    def start_replica(self, replica: Replica, attempts: int = 3) -> None:
        """Start ``replica`` and wait until it is healthy. Its port was free when the fleet chose it, but its server
        binds it only once its engine is loaded, seconds later: if another process took the port meanwhile (the
        server's log says so), the replica gets a fresh port and starts again, ``attempts`` times in all."""
        # zh: 启动 ``replica`` 并等它健康。机群选它的端口时端口是空闲的，但服务器要等引擎加载完、几秒之后才绑定它：
        # zh: 如果这期间别的进程占了这个端口（服务器的日志会这样说），副本就换一个新端口重新启动，总共最多
        # zh: ``attempts`` 次。
        for attempt in range(1, attempts + 1):
            logged = replica.log.stat().st_size if replica.log.exists() else 0
            replica.start()
            try:
                wait_healthy(replica.url, replica.process, self.startup_timeout,
                             f"replica {replica.index} ({replica.log})")
                return
            except RuntimeError:
                with replica.log.open("rb") as log:
                    log.seek(logged)
                    port_taken = b"address already in use" in log.read()
                if attempt == attempts or not port_taken:
                    raise
            # en: Its engine process may outlive the server: the group goes first.
            # zh: 它的引擎进程可能比服务器活得久：先清掉整个进程组。
            replica.stop(0.5)
            taken, replica.port = replica.port, free_port(replica.host)
            self.events.append(f"replica {replica.index}: port {taken} was taken meanwhile; started again on port "
                               f"{replica.port}")
            print(f"fleet: {self.events[-1]}", file=sys.stderr, flush=True)

    def start_gateway(self) -> None:
        """Start the gateway over every replica and every server that joined, in a process group of its own (it gets
        SIGTERM when the fleet dies), and wait until it answers and lists them all as healthy. A second `Fleet` over
        the same running replicas, with another policy and port, starts only this."""
        # zh: 在所有副本和所有加入的服务器之上启动网关，让它自成一个进程组（机群死掉时它会收到 SIGTERM），并等到它应答、
        # zh: 把它们全部列为健康。在同样这些运行中的副本之上、换一种策略和端口的第二个 `Fleet`，只需调用这个方法。
        workers = [replica.url for replica in self.replicas] + self.remote
        command = gateway_command(workers, self.policy, self.host, self.port, self.metrics_port)
        with (self.log_dir / "gateway.log").open("ab") as log:
            self.gateway = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        wait_healthy(self.url, self.gateway, 60.0, f"the gateway ({self.log_dir / 'gateway.log'})")
        self.wait_for_workers(len(workers), 60.0)

    def wait_for_workers(self, count: int, timeout: float) -> None:
        """Wait until the gateway lists ``count`` healthy workers: it answers /health at once, and adds the workers
        in the background (asking each for its model); until then it would refuse requests."""
        # zh: 等到网关列出 ``count`` 个健康的 worker：它立即应答 /health，而 worker 是在后台加入的（向每个 worker 问它的
        # zh: 模型）；在那之前它会拒绝请求。
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                listed = httpx.get(f"{self.url}/workers", timeout=2.0).json()["workers"]
                if sum(1 for worker in listed if worker.get("is_healthy")) >= count:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"the gateway did not list {count} healthy workers after {timeout:.0f} s "
                           f"(see {self.log_dir / 'gateway.log'})")

    def check(self) -> None:
        """One round of supervision: restart each replica that exited; raise if the gateway exited, or a replica
        exited more than ``max_restarts`` times."""
        # zh: 看护一轮：重启每个已退出的副本；如果网关退出了，或者某个副本退出超过 ``max_restarts`` 次，就抛出异常。
        if self.gateway is not None and self.gateway.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {self.gateway.returncode} "
                               f"(see {self.log_dir / 'gateway.log'})")
        for replica in self.replicas:
            if replica.alive():
                continue
            if replica.restarts >= self.max_restarts:
                raise RuntimeError(f"replica {replica.index} exited {replica.restarts + 1} times (see {replica.log})")
            code = replica.process.returncode if replica.process is not None else None
            # en: Its engine process may outlive the server: the group goes first.
            # zh: 它的引擎进程可能比服务器活得久：先清掉整个进程组。
            replica.stop(0.5)
            replica.restarts += 1
            self.events.append(f"replica {replica.index} ({replica.url}) exited with code {code}; restarted")
            print(f"fleet: {self.events[-1]}", file=sys.stderr, flush=True)
            replica.start()

    def stop(self, grace: float = 5.0) -> None:
        """Stop the gateway, then every replica: SIGTERM to each group, SIGKILL to what is left after ``grace``
        seconds in all."""
        # zh: 先停网关，再停每个副本：向每个进程组发 SIGTERM，总共等 ``grace`` 秒后对剩下的发 SIGKILL。
        processes = [self.gateway] if self.gateway is not None else []
        processes += [replica.process for replica in self.replicas if replica.process is not None]
        stop_groups(processes, grace)

# %% [markdown] tags=["en"]
# ## Build it: one command
#
# `plan` turns settings into a `Fleet` without starting anything: it checks the servers' options
# once with the server's own parser (a typo fails here, not in N servers in turn), counts the
# GPUs, gives each replica a free port and its GPU budget, and picks a directory for the logs.
# `main` is the command: options it does not know go to every server, `--host` and `--port` are
# the gateway's, `--worker-url` adds a server started elsewhere. It starts the fleet, prints the
# gateway's URL, supervises until Ctrl-C or SIGTERM, and always stops what it started.

# %% [markdown] tags=["zh"]
# ## 动手：一条命令
#
# `plan` 把设置变成一个 `Fleet`，但什么也不启动：它用服务器自己的解析器把服务器选项检查一次（拼错的选项在这里就报错，而
# 不是让 N 个服务器轮流失败），数一数 GPU，给每个副本一个空闲端口和它的 GPU 预算，再选一个放日志的目录。`main` 就是这条
# 命令：它不认识的选项交给每个服务器，`--host` 和 `--port` 属于网关，`--worker-url` 加入一个在别处启动的服务器。它启动机
# 群，打印网关的 URL，一直看护到 Ctrl-C 或 SIGTERM，并且总会停下它启动的一切。

# %% fleet command
#| export
import argparse
import importlib.util
import tempfile
from collections.abc import Iterator
from types import FrameType


def plan(serve_options: list[str], replicas: int | None = None, *, policy: str = "cache_aware",
         host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None, worker_urls: list[str] = (),
         replica_host: str = "127.0.0.1", log_dir: Path | None = None, startup_timeout: float = 600.0) -> Fleet:
    """The fleet these settings describe, nothing started yet: ``replicas`` servers (default: one per GPU, else 2)
    running ``python -m nanovllm.serve`` with ``serve_options``. A ValueError names a setting that cannot work."""
    # zh: 这些设置所描述的机群，尚未启动任何东西：``replicas`` 个服务器（默认每块 GPU 一个，否则 2 个），运行带
    # zh: ``serve_options`` 的 ``python -m nanovllm.serve``。无法成立的设置会引发指名道姓的 ValueError。
    from nanovllm.serve.cli import build_parser as serve_parser

    served = serve_parser().parse_args(serve_options)
    gpus = 0 if served.device == "cpu" else gpu_count()
    replicas = replicas if replicas is not None else (gpus or 2)
    if replicas < 0 or (replicas == 0 and not worker_urls):
        raise ValueError(f"--replicas must be at least 1 (or 0 with --worker-url), got {replicas}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="nanovllm-fleet-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    members = []
    for index, (gpu, share) in enumerate(gpu_budgets(replicas, gpus, served.gpu_memory_utilization)):
        options = [*serve_options, *(["--gpu-memory-utilization", str(share)] if share is not None else [])]
        members.append(Replica(index, replica_host, free_port(replica_host), options,
                               log_dir / f"replica-{index}.log", gpu))  # fmt: skip
    return Fleet(members, list(worker_urls), policy, host, port, metrics_port or free_port(host), log_dir,
                 startup_timeout)  # fmt: skip


def gpu_count() -> int:
    """The CUDA devices this machine shows (0 without CUDA)."""
    # zh: 这台机器可见的 CUDA 设备数（没有 CUDA 时为 0）。
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.serve.fleet",
        description="N nano-vllm servers behind SGLang's gateway (sglang-router). Options not listed here go to "
                    "every server (see python -m nanovllm.serve --help).")  # fmt: skip
    parser.add_argument("--replicas", type=int, help="servers to start here (default: one per GPU, else 2)")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the gateway's routing policy")
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port (default 8000)")
    parser.add_argument("--metrics-port", type=int, help="the gateway's Prometheus port (default: a free one)")
    parser.add_argument("--worker-url", action="append", default=[], metavar="URL",
                        help="a server started elsewhere (python -m nanovllm.serve --host 0.0.0.0 ...) that the "
                             "gateway routes to as well; repeat it for more")  # fmt: skip
    parser.add_argument("--replica-host", default="127.0.0.1", help="the address of the servers started here")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    parser.add_argument("--log-dir", type=Path, help="the servers' and the gateway's logs (default: a new "
                                                     "temporary directory)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args, serve_options = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("sglang_router") is None:
        print("error: the gateway is not installed: pip install sglang-router==0.3.2", file=sys.stderr)
        return 2
    try:
        fleet = plan(serve_options, args.replicas, policy=args.policy, host=args.host, port=args.port,
                     metrics_port=args.metrics_port, worker_urls=args.worker_url, replica_host=args.replica_host,
                     log_dir=args.log_dir, startup_timeout=args.startup_timeout)  # fmt: skip
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with sigterm_as_interrupt():
        try:
            fleet.start()
            print(f"fleet: {len(fleet.replicas)} replicas here and {len(fleet.remote)} elsewhere behind {fleet.url} "
                  f"(policy {fleet.policy}; logs in {fleet.log_dir})", flush=True)
            while True:
                fleet.check()
                time.sleep(1.0)
        except KeyboardInterrupt:
            return 0
        except (RuntimeError, TimeoutError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        finally:
            fleet.stop()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM stops the fleet as Ctrl-C does (a KeyboardInterrupt in the main thread)."""
    # zh: 在块内，SIGTERM 像 Ctrl-C 一样停下机群（在主线程里引发 KeyboardInterrupt）。
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

# %% replicas' cache counters
#| export serve.fleet
import re

# en: vLLM's prefix-cache counters in a server's /metrics (chapter 22 serves them beside ours).
# zh: 服务器 /metrics 里 vLLM 的前缀缓存计数器（第 22 章把它们和我们自己的一起提供）。
CACHE_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)_total(?:\{[^}]*\})? (\S+)$", re.M)


def prefix_cache_tokens(urls: list[str]) -> dict[str, float]:
    """Prompt tokens looked up in, and found in, these servers' prefix caches, summed (vLLM's counters)."""
    # zh: 这些服务器的前缀缓存里查找过的、以及找到的提示词 token 数之和（vLLM 的计数器）。
    totals = {"hits": 0.0, "queries": 0.0}
    for url in urls:
        for name, value in CACHE_COUNTER.findall(httpx.get(f"{url}/metrics", timeout=30).text):
            totals[name] += float(value)
    return totals


# %% fleet entry point
#| export
# en: A notebook also runs this code as __main__; only a real `python -m nanovllm.serve.fleet` should act.
# zh: notebook 也会把这段代码当作 __main__ 运行；只有真正的 `python -m nanovllm.serve.fleet` 才应该执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())

# %% [markdown] tags=["en"]
# ## See it: two replicas of the tiny model, behind the gateway
#
# A fleet of two replicas of chapter 06's tiny Qwen3 on this CPU, in blocks of 16 tokens. Two
# users each send three turns, one request at a time: each turn's prompt is the conversation so
# far. The replicas' `vllm:prefix_cache_*` counters (chapter 22) tell which replica served each
# turn and how much of its prompt was cached. The gateway sends a user's first turn to the least
# loaded replica; from then on, its radix tree sends the later turns after it. Each replica also
# publishes its KV events (chapter 27), on Unix sockets in the fleet's log directory, for the
# animation below.

# %% [markdown] tags=["zh"]
# ## 看它运行：网关后面的两个小模型副本
#
# 在这台 CPU 上，由第 06 章的小 Qwen3 组成的两个副本的机群，块大小 16 个 token。两个用户各发三轮，一次一个请求：每一轮的
# 提示词都是到目前为止的对话。副本的 `vllm:prefix_cache_*` 计数器（第 22 章）告诉我们每一轮由哪个副本处理、提示词里有多
# 少已在缓存中。网关把用户的第一轮发给负载最轻的副本；此后，它的基数树让后面几轮都跟着去那里。每个副本还在机群日志目录
# 里的 Unix 套接字上发布它的 KV 事件（第 27 章），供下面的动画使用。

# %%
import json
import re
import time

import httpx

from nanovllm.book.tiny_models import build_tiny_model

tiny = build_tiny_model("qwen3")
fleet = plan(["--model", str(tiny), "--device", "cpu", "--kvcache-block-size", "16", "--max-model-len", "1024"],
             replicas=2, port=free_port("127.0.0.1"))
for replica in fleet.replicas:
    sockets = f"ipc://{fleet.log_dir}/replica-{replica.index}"
    events = {"enable_kv_cache_events": True, "endpoint": f"{sockets}-events", "replay_endpoint": f"{sockets}-replay"}
    replica.options += ["--kv-events-config", json.dumps(events)]
fleet.start()
models = httpx.get(f"{fleet.url}/v1/models", timeout=30).json()["data"]
print(say("the gateway lists the model as {models}", models=[model["id"] for model in models]))
assert [model["id"] for model in models] == [tiny.name]



def complete(prompt: str, url: str | None = None) -> dict:
    """One greedy completion of eight tokens through the gateway (the fleet's, unless ``url`` names another)."""
    # zh: 经由网关的一次贪心补全，生成八个 token（默认是机群的网关，``url`` 可以指定另一个）。
    body = {"model": tiny.name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(f"{url or fleet.url}/v1/completions", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()


served_by = {}
for user in (0, 1):
    text = f"user {user}: " + " ".join(f"fact {user}-{i} is {i * 7 % 13}." for i in range(30))
    for turn in (1, 2, 3):
        text += f"\nquestion {turn}: what is fact {user}-{turn}?\nanswer:"
        before = [prefix_cache_tokens([replica.url]) for replica in fleet.replicas]
        text += complete(text)["choices"][0]["text"]
        after = [prefix_cache_tokens([replica.url]) for replica in fleet.replicas]
        grew = [i for i in (0, 1) if after[i]["queries"] > before[i]["queries"]]
        replica = grew[0]
        hits, queries = (after[replica][name] - before[replica][name] for name in ("hits", "queries"))
        served_by[user, turn] = replica
        print(say("user {user}, turn {turn}: replica {replica}, {hits} of {queries} prompt tokens cached",
                  user=user, turn=turn, replica=replica, hits=int(hits), queries=int(queries)))
        assert len(grew) == 1 and (turn == 1 or hits >= 16 * 4)
# en: Each user's turns stayed on the replica of its first turn.
# zh: 每个用户的各轮都留在了它第一轮所在的副本上。
assert all(served_by[user, turn] == served_by[user, 1] for user in (0, 1) for turn in (2, 3))

# %% [markdown] tags=["en"]
# ### See it: what each replica caches, and where each turn goes
#
# One request at a time, as above, no replica is ever busier than the other. A gateway is for
# users who talk at once, so now three users, A, B and C, send each turn together: a round ends
# when all three have their replies, and the next round sends each conversation so far with a
# new question. The first turns go where the gateway's balancing puts them; the later turns
# should follow. Then the same workload, with new users D, E and F, goes through a second
# gateway over the same two replicas, `round_robin`, started by `start_gateway`.
#
# What each cache holds comes from the replicas themselves. After each round, a subscriber per
# replica asks for a replay of its KV events (chapter 27), so it knows every block the replica
# stored, with its parent. A conversation is a chain: its first block starts with "user A", and
# every later block hangs from it. A turn's replica is the one where the user's chain grew in
# that round, and the blocks the turn found in the cache are the chain up to the parent of the
# first block it stored; the replicas' `vllm:prefix_cache_hits_total` counters check that count.

# %% [markdown] tags=["zh"]
# ### 看它运行：每个副本缓存了什么，每一轮去了哪里
#
# 像上面那样一次一个请求，哪个副本都不会比另一个更忙。网关是为同时说话的用户准备的，所以现在三个用户 A、B、C 一起发出每
# 一轮：三人都拿到回复，这一轮才结束，下一轮再发出各自到目前为止的对话和一个新问题。第一轮去哪里由网关的负载均衡决定；
# 后面几轮应该跟着它。然后，同样的负载换成新用户 D、E、F，通过同样两个副本之上的第二个网关 `round_robin`，它由
# `start_gateway` 启动。
#
# 每个缓存里有什么，由副本自己说出来。每一轮之后，每个副本的订阅者都请求补发它的 KV 事件（第 27 章），于是知道副本存入的
# 每个块及其父块。一段对话就是一条链：它的第一块以“user A”开头，后面的每一块都挂在它下面。这个用户的链在这一轮里变长的那
# 个副本，就是这一轮请求去的副本；这一轮在缓存中找到的块，就是链上直到它存入的第一块的父块为止的那一段。副本的
# `vllm:prefix_cache_hits_total` 计数器会核对这个数。

# %%
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq
from transformers import AutoTokenizer

from nanovllm.engine.kv_events import BlockRemoved, BlockStored, KVEventBatch

tokenizer = AutoTokenizer.from_pretrained(tiny)
OWNER = re.compile(r"user (\w+):")


class CacheMirror:
    """What one replica's prefix cache holds, from its KV events (a replay after each round): each block's parent,
    and whose conversation each block belongs to (the first block of its chain names the user)."""
    # zh: 一个副本的前缀缓存里有什么，取自它的 KV 事件（每一轮之后补发一次）：每个块的父块，以及每个块属于谁的对话
    # zh: （它所在的链的第一块写着用户）。

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.replay = context.socket(zmq.DEALER)
        # en: A replica that stopped answering fails the cell in 30 s rather than hanging it.
        # zh: 不再应答的副本让这个单元在 30 s 后失败，而不是一直卡住。
        self.replay.setsockopt(zmq.RCVTIMEO, 30_000)
        self.replay.connect(address)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        # en: the blocks cached now, each with its parent; the user of every block ever stored
        # zh: 现在缓存着的块及其父块；存入过的每个块属于哪个用户
        self.parent: dict[int, int | None] = {}
        self.user: dict[int, str] = {}

    def catch_up(self) -> list[int]:
        """Apply every batch published since the last call; the blocks stored meanwhile, in order."""
        # zh: 应用上次调用以来发布的每一批；返回这期间存入的块，按先后顺序。
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        stored = []
        while True:
            _, _, seq, payload = self.replay.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return stored
            if number < self.next_seq:
                continue
            self.next_seq = number + 1
            for event in self.decoder.decode(payload).events:
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    if parent is None:
                        # en: A chain's first block names its user: "user A: fact A-0 ..."
                        # zh: 链的第一块写着它的用户："user A: fact A-0 ..."
                        head = OWNER.match(tokenizer.decode(event.token_ids[: event.block_size]))
                        self.user[event.block_hashes[0]] = head[1] if head else "?"
                    for block in event.block_hashes:
                        self.user.setdefault(block, self.user.get(parent))
                        self.parent[block], parent = parent, block
                        stored.append(block)
                elif isinstance(event, BlockRemoved):
                    for block in event.block_hashes:
                        self.parent.pop(block, None)
                else:
                    self.parent.clear()

    def chain(self, block: int | None) -> list[int]:
        """``block`` and the blocks before it in its chain, the first block first."""
        # zh: ``block`` 及其链上在它之前的块，第一块在前。
        blocks = []
        while block is not None:
            blocks.append(block)
            block = self.parent[block]
        return blocks[::-1]


def talk(url: str, policy: str, users: tuple[str, ...]) -> list[dict]:
    """Three rounds through the gateway at ``url``, every user sending its next turn at once; after each round the
    KV events say where each turn went, what it found and what it stored. A frame per turn, as plain data."""
    # zh: 经由 ``url`` 处的网关进行三轮，每一轮所有用户同时发出下一轮请求；每一轮之后由 KV 事件说出每一轮请求去了
    # zh: 哪里、找到了什么、存入了什么。每一轮请求一帧，都是普通数据。
    texts = {user: f"user {user}: " + " ".join(f"fact {user}-{i} is {i * 7 % 13}." for i in range(20))
             for user in users}  # fmt: skip
    shown: list[dict[str, list[int]]] = [{user: [] for user in users} for _ in mirrors]
    frames = []
    for turn in (1, 2, 3):
        for user in users:
            texts[user] += f"\nquestion {turn}: what is fact {user}-{turn}?\nanswer:"
        before = [prefix_cache_tokens([replica.url])["hits"] for replica in fleet.replicas]
        with ThreadPoolExecutor(len(users)) as pool:
            replies = list(pool.map(lambda user: complete(texts[user], url)["choices"][0]["text"], users))
        # en: prompt tokens found in each replica's cache this round, by its own counter
        # zh: 这一轮里每个副本在缓存中找到的提示词 token 数，按它自己的计数器
        counted = [prefix_cache_tokens([replica.url])["hits"] - before[r] for r, replica in enumerate(fleet.replicas)]
        stored = [mirror.catch_up() for mirror in mirrors]
        for user, reply in zip(users, replies, strict=True):
            texts[user] += reply
            went = [r for r, mirror in enumerate(mirrors) if any(mirror.user[b] == user for b in stored[r])]
            assert len(went) == 1, (policy, user, turn, went)
            mirror = mirrors[went[0]]
            new = [block for block in stored[went[0]] if mirror.user[block] == user]
            shown[went[0]][user] += new
            frames.append({
                "policy": policy, "turn": turn, "user": user, "replica": went[0], "counted": counted,
                "hits": mirror.chain(mirror.parent[new[0]]), "new": new,
                "caches": [{u: [b for b in blocks if b in m.parent] for u, blocks in rows.items()}
                           for m, rows in zip(mirrors, shown, strict=True)],
                "others": [sum(1 for b in m.parent if m.user[b] not in users) for m in mirrors],
            })  # fmt: skip
    return frames


context = zmq.Context()
mirrors = [CacheMirror(context, f"ipc://{fleet.log_dir}/replica-{replica.index}-replay") for replica in fleet.replicas]
for mirror in mirrors:
    mirror.catch_up()
recorded = talk(fleet.url, "cache_aware", ("A", "B", "C"))
# en: A second gateway, taking turns, over the same running replicas; it stops when the run does.
# zh: 同样这些运行中的副本之上的第二个网关，轮流分发；运行结束它就停下。
taking_turns = dataclasses.replace(fleet, policy="round_robin", port=free_port("127.0.0.1"),
                                   metrics_port=free_port("127.0.0.1"), gateway=None, events=[])
taking_turns.start_gateway()
try:
    recorded += talk(taking_turns.url, "round_robin", ("D", "E", "F"))
finally:
    stop_groups([taking_turns.gateway], 5.0)
    context.destroy(linger=0)
for policy in ("cache_aware", "round_robin"):
    turns = [frame for frame in recorded if frame["policy"] == policy]
    routes = "  ".join(f"{user}: {' '.join(str(f['replica']) for f in turns if f['user'] == user)}"
                       for user in dict.fromkeys(f["user"] for f in turns))
    print(say("{policy:<11}  the replica of each turn, by user: {routes}; blocks found in a cache: {hits}",
              policy=policy, routes=routes, hits=sum(len(f["hits"]) for f in turns)))

# %% [markdown] tags=["en"]
# Each frame is one turn: on the left, the gateway and the turn it routed; on the right, each
# replica's cache, a row per user, a square per block of 16 tokens, coloured by its user. An
# orange outline marks a block this turn found in the cache (a hit), a dark blue one a block it
# stored. Under `cache_aware` each user's row grows on one replica only, and each later turn
# finds its conversation there, up to the block that holds the start of the last reply: that
# block holds the tokens the model chose, and the reply's text, sent back in the next prompt,
# need not turn into the same tokens again (where it does not, that block is never found, and
# the next turn stores its own). Under `round_robin` the turns take the replicas in turn, whatever they hold: a turn
# that lands where its conversation is not is prefilled whole, and the user's blocks end up
# cached twice, once on each replica.

# %% [markdown] tags=["zh"]
# 每一帧是一轮请求：左边是网关和它刚分发的请求；右边是每个副本的缓存，每个用户一行，每个 16 个 token 的块一个方块，按它
# 的用户着色。橙色边框标出这一轮在缓存中找到的块（缓存命中），深蓝色边框标出它新存入的块。在 `cache_aware` 下，每个用户
# 的那一行只在一个副本上变长，后面每一轮都在那里找到自己的对话，直到装着上一次回复开头的那一块为止：那一块装的是模型选出
# 的 token，而回复的文本随下一个提示词发回来之后，不一定还会变成同样的 token（没有变成同样的 token 时，那一块再也不会被
# 找到，下一轮会存入它自己的一块）。在 `round_robin` 下，请求不管副本里有什么，轮流去各个副本：落到没有它的对话的副本上
# 的请求要完整地 prefill，用户的块最后缓存了两份，每个副本上一份。

# %%
import html

from IPython.display import HTML

from nanovllm.viz.player import lang_text, pick_lang, slides_html, svg_label

SIDE, STEP, ROWS_AT = 11, 14, 236


def squares(xs: list[int], y: int) -> str:
    """Squares of side ``SIDE`` on row ``y``, one at each of ``xs``, as one SVG path."""
    # zh: 第 ``y`` 行上、``xs`` 每个位置一个的边长为 ``SIDE`` 的方块，合成一条 SVG 路径。
    return "".join(f"M{x} {y}h{SIDE}v{SIDE}h-{SIDE}z" for x in xs)


def fleet_svg(frame: dict, width: int) -> str:
    """One turn: the gateway and the turn it routed (left), each replica's cached blocks (right), a row per user;
    an orange outline marks a hit of this turn, a dark blue one a block it stored (the player's colours)."""
    # zh: 一轮请求：网关和它刚分发的请求（左），每个副本缓存的块（右），每个用户一行；橙色边框标出这一轮的缓存命中，
    # zh: 深蓝色边框标出它新存入的块（与播放器的配色相同）。
    users = list(frame["caches"][0])
    panel = 30 + 16 * len(users)
    height = 2 * panel + 22
    mid = height // 2
    colour = {user: f"nvv-c{i + 1}" for i, user in enumerate(users)}
    turn_en, turn_zh = f"{frame['user']}, turn {frame['turn']}", f"{frame['user']}，第 {frame['turn']} 轮"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="nvv-svg" width="{width}" height="{height}">',
             f'<rect x="6" y="{mid - 38}" width="160" height="76" rx="6" fill="#eceff1" stroke="#90a4ae"/>',
             f'<text class="nvv-h nvv-mid" x="86" y="{mid - 18}">{svg_label("gateway", "网关", None)}</text>',
             f'<text class="nvv-mid" x="86" y="{mid - 2}">{frame["policy"]}</text>',
             f'<rect class="{colour[frame["user"]]}" x="22" y="{mid + 9}" width="128" height="20" rx="4"/>',
             f'<text class="nvv-mid" x="86" y="{mid + 23}">{svg_label(turn_en, turn_zh, None)}</text>']  # fmt: skip
    for r, (cache, others) in enumerate(zip(frame["caches"], frame["others"], strict=True)):
        top, chosen = 6 + r * (panel + 10), r == frame["replica"]
        edge = 'stroke="#37474f" stroke-width="2"' if chosen else 'stroke="#cfd8dc"'
        parts.append(f'<rect x="196" y="{top}" width="{width - 202}" height="{panel}" rx="6" fill="#fafafa" {edge}/>')
        name = svg_label(f"replica {r}", f"副本 {r}", None)
        parts.append(f'<text class="nvv-h" x="206" y="{top + 17}">{name}</text>')
        if others:
            note = svg_label(f"+ {others} blocks of earlier requests", f"另有 {others} 个较早请求的块", None)
            parts.append(f'<text class="nvv-dim" x="{width - 14}" y="{top + 17}" text-anchor="end">{note}</text>')
        if chosen:
            parts.append(f'<path d="M166 {mid}L194 {top + panel // 2}" stroke="#37474f" stroke-width="2" fill="none"/>'
                         f'<circle cx="194" cy="{top + panel // 2}" r="3" fill="#37474f"/>')
        for i, user in enumerate(users):
            y = top + 26 + 16 * i
            xs = {block: ROWS_AT + k * STEP for k, block in enumerate(cache[user])}
            parts.append(f'<text x="{ROWS_AT - 8}" y="{y + 10}" text-anchor="end">{user}</text>')
            parts.append(f'<path class="{colour[user]}" d="{squares(list(xs.values()), y)}"/>')
            if chosen and user == frame["user"]:
                for blocks, stroke in ((frame["hits"], "#ef6c00"), (frame["new"], "#0d47a1")):
                    path = squares([xs[block] for block in blocks if block in xs], y)
                    parts.append(f'<path d="{path}" fill="none" stroke="{stroke}" stroke-width="2.5"/>')
    return "".join(parts) + "</svg>"


def fleet_caption(frame: dict, earlier: int | None) -> str:
    """What the gateway did with one turn, and what the replica found, in both languages."""
    # zh: 网关怎样处理了这一轮请求，副本找到了什么，两种语言。
    user, turn, replica, hits, new = (frame[key] for key in ("user", "turn", "replica", "hits", "new"))
    en = (f"{frame['policy']}, round {turn}: the gateway sent user {user}'s turn to replica {replica}, which found "
          f"{len(hits)} of its blocks in the cache and stored {len(new)} new ones")
    zh = (f"{frame['policy']}，第 {turn} 轮：网关把用户 {user} 的这一轮发给副本 {replica}，副本在缓存中找到其中 "
          f"{len(hits)} 个块，新存入 {len(new)} 个")
    if earlier is not None and earlier != replica:
        en += f"; its turn {turn - 1} is cached on replica {earlier}"
        zh += f"；它第 {turn - 1} 轮的块缓存在副本 {earlier} 上"
    # en: As the player's own captions: in both languages, the Chinese line under the English one.
    # zh: 与播放器自己的说明一样：两种语言都显示时，中文一行在英文一行之下。
    en, zh = (f'<div lang="{lang}">{html.escape(text)}</div>' for lang, text in (("en", en), ("zh", zh)))
    return f'<div class="nvv-cap">{pick_lang(en, zh)}</div>'


def swatch(style: str) -> str:
    square = f'<rect x="2" y="2" width="{SIDE}" height="{SIDE}" {style}/>'
    return f'<svg width="15" height="15" style="vertical-align:-3px">{square}</svg>'


widest = max(len(blocks) for frame in recorded for cache in frame["caches"] for blocks in cache.values())
width = ROWS_AT + widest * STEP + 14
replica_of: dict[tuple[str, int], int] = {}
slides = []
for frame in recorded:
    replica_of[frame["user"], frame["turn"]] = frame["replica"]
    slides.append((fleet_caption(frame, replica_of.get((frame["user"], frame["turn"] - 1))), fleet_svg(frame, width)))
legend = ('<div class="nvv-legend">' + swatch('class="nvv-c1"') + lang_text("a cached block, coloured by its user",
          "已缓存的块，按用户着色", None) + " · " + swatch('fill="none" stroke="#ef6c00" stroke-width="2.5"')
          + lang_text("found in the cache by this turn (a hit)", "这一轮在缓存中找到的块（缓存命中）", None) + " · "
          + swatch('fill="none" stroke="#0d47a1" stroke-width="2.5"')
          + lang_text("stored by this turn", "这一轮新存入的块", None) + "</div>")  # fmt: skip
hint = lang_text("A square is a block of 16 tokens; a row, what the replica caches of one user's conversation.",
                 "一个方块是 16 个 token 的块；一行是副本缓存的某个用户的对话。", None)
HTML(slides_html(slides, start=0, player_id="fleet-caches", hint=hint, legend=legend))

# %% [markdown] tags=["en"]
# Check it: the animation's claims, on its recorded frames. The blocks that the events say each
# turn found are the replicas' own count. Under `cache_aware` every later turn went back to the
# replica of the user's first turn and found there every block of that turn's prompt, and each
# conversation is cached on one replica. Under `round_robin` some second turn went to the other
# replica and found nothing, some conversation is cached on both, and fewer blocks were found in
# all. (With three users and two replicas, taking turns must move someone's second turn: in a
# round of three, two turns land on one replica and one on the other, and the next round swaps
# them.)

# %% [markdown] tags=["zh"]
# 验证：在记录下的帧上检验动画所说的事。事件说每一轮找到的块数，就是副本自己的计数。在 `cache_aware` 下，后面每一轮都回
# 到了该用户第一轮所在的副本，并在那里找到了第一轮提示词的每一个块，每段对话只缓存在一个副本上。在 `round_robin` 下，有
# 的第二轮去了另一个副本，什么也没找到，有的对话在两个副本上都有缓存，找到的块总数也更少。（三个用户、两个副本时，轮流分
# 发必然让某个用户的第二轮换了副本：一轮三个请求，两个落在一个副本上、一个落在另一个上，下一轮两个副本的角色正好对调。）

# %%
aware, turns = ([frame for frame in recorded if frame["policy"] == policy] for policy in ("cache_aware", "round_robin"))
for frames in (aware, turns):
    for turn in (1, 2, 3):
        this_round = [frame for frame in frames if frame["turn"] == turn]
        for replica in (0, 1):
            found = sum(len(frame["hits"]) for frame in this_round if frame["replica"] == replica)
            assert 16 * found == this_round[0]["counted"][replica], (turn, replica, found, this_round[0]["counted"])
first = {frame["user"]: frame for frame in aware if frame["turn"] == 1}
for frame in aware[3:]:
    # en: The first turn stored its prompt's full blocks, then at most one that its 8 reply tokens filled.
    # zh: 第一轮存入了提示词的全部整块，然后至多一块由它回复的 8 个 token 填满。
    prompt_blocks = first[frame["user"]]["new"][:-1]
    assert frame["replica"] == first[frame["user"]]["replica"]
    assert frame["hits"][: len(prompt_blocks)] == prompt_blocks
assert all(sum(1 for cache in aware[-1]["caches"] if cache[user]) == 1 for user in first)
home = {frame["user"]: frame["replica"] for frame in turns if frame["turn"] == 1}
moved = [frame for frame in turns if frame["turn"] == 2 and frame["replica"] != home[frame["user"]]]
assert moved and not any(frame["hits"] for frame in moved)
assert any(all(cache[user] for cache in turns[-1]["caches"]) for user in home)
assert sum(len(frame["hits"]) for frame in aware) > sum(len(frame["hits"]) for frame in turns)
print(say("the animation's claims hold on its {frames} frames", frames=len(recorded)))

# %% [markdown] tags=["en"]
# ### When a replica dies
#
# Now a replica dies (SIGKILL, the way an out-of-memory kill ends it). The next request, which
# the gateway's tree would send there, is retried on the other replica and gets the same greedy
# reply; one round of the supervisor restarts the dead one. Then the fleet stops, and no process
# of it is left.

# %% [markdown] tags=["zh"]
# ### 副本死掉的时候
#
# 现在一个副本死掉了（SIGKILL，就像内存耗尽时被杀那样）。下一个请求本该被网关的树送到那里，它在另一个副本上重试，得到同
# 样的贪心回复；看护者的一轮检查就把死掉的副本重启了。然后机群停下，它的进程一个也不剩。

# %%
import contextlib
import os
import signal
from pathlib import Path

victim = fleet.replicas[served_by[0, 1]]
again = "user 0: " + " ".join(f"fact 0-{i} is {i * 7 % 13}." for i in range(30)) + "\nquestion 1: what is fact 0-1?"
expected = complete(again)["choices"][0]["text"]
os.kill(victim.process.pid, signal.SIGKILL)
victim.process.wait()
reply = httpx.post(f"{fleet.url}/v1/completions", json={"model": tiny.name, "prompt": again, "max_tokens": 8,
                                                        "temperature": 0.0, "ignore_eos": True}, timeout=120)
print(say("replica {replica} killed; the next request: HTTP {status}, the same reply: {same}", replica=victim.index,
          status=reply.status_code, same=reply.json()["choices"][0]["text"] == expected))
assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
fleet.check()
print(say("the fleet restarted it: {events}", events=fleet.events))
assert victim.alive() and victim.restarts == 1
wait_healthy(victim.url, victim.process, 120, "the restarted replica")
groups = [fleet.gateway.pid] + [replica.process.pid for replica in fleet.replicas]


def still_running(group: int) -> list[int]:
    """The processes of a process group that still run, from Linux's /proc (the servers' engine processes included;
    a process that has ended and waits to be reaped does not count)."""
    # zh: 一个进程组里仍在运行的进程，取自 Linux 的 /proc（包括服务器的引擎进程；已经结束、等着被回收的进程不算）。
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(process_group) == group and state != "Z":
                running.append(int(stat.parent.name))
    return running


began = time.monotonic()
fleet.stop()
# en: The engine processes die a moment after their servers: a few seconds at most.
# zh: 引擎进程比它们的服务器晚一点点才死：最多几秒。
while (left := [pid for group in groups for pid in still_running(group)]) and time.monotonic() < began + 10:
    time.sleep(0.1)
print(say("stopped in {seconds:.1f} s; processes left: {left}", seconds=time.monotonic() - began, left=left))
assert not left

# %% [markdown] tags=["en"]
# ## Measure it: many users, long contexts, several turns
#
# `python -m nanovllm.bench.fleet` measures what the routing is worth. Its workload: each user
# has a long document of its own (the shared context) and asks several questions in turn; a turn
# is sent when the reply to the one before has ended, and all users run at once. Every policy gets
# exactly the same prompts, since a turn appends a fixed reply rather than the model's: what is
# cached then depends on the routing alone. For each policy the benchmark starts a fleet of its
# own, runs the users through it, and reads the replicas' prefix-cache counters before and after:
# the **hit rate** is the share of prompt tokens found in a cache, beside the TTFT percentiles and
# the output throughput (chapter 23's `stream_one` times each streamed turn).

# %% [markdown] tags=["zh"]
# ## 测量：很多用户、很长的上下文、好几轮
#
# `python -m nanovllm.bench.fleet` 测量路由值多少。它的负载是：每个用户有一份自己的长文档（共享的上下文），轮流问几个问
# 题；上一轮的回复结束后才发下一轮，所有用户同时进行。每种策略拿到的提示词完全相同，因为每一轮追加的是固定的回复，而不是
# 模型的回复：这样缓存里有什么只取决于路由。对每种策略，基准测试都启动一个自己的机群，让用户们跑一遍，并在前后读取副本的
# 前缀缓存计数器：**命中率**是在缓存中找到的提示词 token 所占的比例，旁边是 TTFT 的各个分位数和输出吞吐（第 23 章的
#   `stream_one` 为每一轮流式请求计时）。

# %% bench fleet
#| export bench.fleet
"""``python -m nanovllm.bench.fleet``: a multi-turn workload through a fleet, under each gateway policy in turn."""
# zh: ``python -m nanovllm.bench.fleet``：让多轮负载依次在网关的每种策略下通过机群。

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from nanovllm.bench.serve import RequestResult, percentiles, stream_one
from nanovllm.serve.fleet import POLICIES, plan, prefix_cache_tokens
from nanovllm.serve.process import free_port

# en: The words of the users' documents and questions: plain English, so that a real model reads text, not noise.
# zh: 用户文档和问题所用的词：普通英文，这样真实的模型读到的是文字而不是噪声。
WORDS = ("the", "river", "market", "winter", "engine", "garden", "letter", "silver", "station", "morning", "island",
         "teacher", "window", "harbor", "village", "paper", "mountain", "summer", "bridge", "forest", "light",
         "story", "road", "music", "table", "stone", "field", "house", "ship", "city", "night", "voice")  # fmt: skip


def conversations(users: int, turns: int, context_words: int, seed: int) -> list[list[str]]:
    """Each user's prompts, turn by turn: a document of its own (the long shared context), then at each turn the
    conversation so far and a new question; a turn appends a fixed reply, so that every policy gets these prompts."""
    # zh: 每个用户逐轮的提示词：一份它自己的文档（很长的共享上下文），然后每一轮是到目前为止的对话加一个新问题；每一轮
    # zh: 追加一段固定的回复，这样每种策略拿到的都是这些提示词。
    rng = random.Random(seed)
    prompts = []
    for user in range(users):
        text = f"Document {user}: " + " ".join(rng.choice(WORDS) for _ in range(context_words))
        turns_of_user = []
        for turn in range(turns):
            text += f"\n\nQuestion {turn + 1}: what does the document say about the {rng.choice(WORDS)}?\nAnswer:"
            turns_of_user.append(text)
            text += " It says little about it."
        prompts.append(turns_of_user)
    return prompts

def workload_words(users: int, turns: int) -> list[str]:
    """Every word (as whitespace splits text) that `conversations` of at most ``users`` users and ``turns`` turns can
    write, and that the replies of a model reading them hold: the vocabulary a word tokenizer needs for them."""
    # zh: ``users`` 个用户、``turns`` 轮以内的 `conversations` 能写出的每个词（按空白切分），加上读它们的模型的回复
    # zh: 里有的词：一个按词切分的分词器为它们需要的词表。
    template = "Document : Question what does the document say about Answer: It says little about it."
    numbered = [f"{n}:" for n in range(max(users, turns) + 1)]
    return sorted({*template.split(), *WORDS, *(f"{word}?" for word in WORDS), *numbered})


def teach_words(tokenizer_file: Path, words: list[str]) -> None:
    """Give ``words`` ids of a chapter-23 word tokenizer (``tokenizer_file``): each word it lacks takes the lowest id
    still named t<id>, so the vocabulary keeps its size and its special tokens."""
    # zh: 让第 23 章按词切分的分词器（``tokenizer_file``）认识 ``words``：它缺的每个词占用仍叫 t<id> 的最小 id，
    # zh: 这样词表的大小和特殊 token 都不变。
    tokenizer = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    unnamed = iter(token for token in sorted(vocab, key=vocab.get) if re.fullmatch(r"t\d+", token))
    for word in words:
        if word not in vocab:
            vocab[word] = vocab.pop(next(unnamed))
    tokenizer_file.write_text(json.dumps(tokenizer), encoding="utf-8")


def qwen3_06b_fleet(users: int = 1024, turns: int = 64, path: str | None = None) -> Path:
    """Chapter 23's served benchmark model (Qwen3-0.6B's shapes, random weights) whose word tokenizer knows
    `workload_words`. Its own names (t0, t1, ...) make every English word <unk>: every user's document would be the
    same tokens, and every policy would find every prompt cached."""
    # zh: 第 23 章服务基准用的模型（Qwen3-0.6B 的形状，随机权重），但它按词切分的分词器认识 `workload_words`。
    # zh: 它原来的名字（t0、t1……）让每个英文单词都成了 <unk>：每个用户的文档都会是同样的 token，每种策略都会发现
    # zh: 每个提示词都已缓存。
    from nanovllm.bench.serve import qwen3_06b_served

    target = qwen3_06b_served(path or f"{tempfile.gettempdir()}/nanovllm-qwen3-0.6b-fleet")
    teach_words(target / "tokenizer.json", workload_words(users, turns))
    return target


async def run_users(url: str, model: str, prompts: list[list[str]], max_tokens: int) -> tuple[list[RequestResult],
                                                                                                float]:
    """Every user at once, each one's turns in order, streamed; the results and the wall time of the whole run."""
    # zh: 所有用户同时进行，每个用户的各轮按顺序、以流式发送；返回结果和整个运行的墙钟时间。
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as http:
        async def user(turns: list[str]) -> list[RequestResult]:
            results = []
            for prompt in turns:
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
                results.append(await stream_one(http, url, body))
            return results

        began = time.perf_counter()
        per_user = await asyncio.gather(*(user(turns) for turns in prompts))
        return [result for results in per_user for result in results], time.perf_counter() - began


def measure_policy(policy: str, replicas: int, serve_options: list[str], prompts: list[list[str]],
                   max_tokens: int) -> dict[str, Any]:
    """Start a fleet under ``policy``, run the users through it once, stop it: the policy's figures."""
    # zh: 在 ``policy`` 下启动一个机群，让用户们跑一遍，再停下它：这种策略的各项数字。
    fleet = plan(serve_options, replicas, policy=policy, port=free_port("127.0.0.1"))
    try:
        fleet.start()
        urls = [replica.url for replica in fleet.replicas]
        model = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]
        # en: Each replica's counters apart: how the gateway split the prompt tokens shows whether a policy crowded
        # en: one replica, which a slower TTFT alone does not say.
        # zh: 逐个副本读计数器：网关怎样分配 prompt token，能看出某种策略是否把请求挤到了一个副本上，光看更慢的 TTFT
        # zh: 看不出这一点。
        before = [prefix_cache_tokens([url]) for url in urls]
        results, seconds = asyncio.run(run_users(fleet.url, model, prompts, max_tokens))
        after = [prefix_cache_tokens([url]) for url in urls]
    finally:
        fleet.stop()
    done = [r for r in results if r.ok]
    queries = [end["queries"] - start["queries"] for start, end in zip(before, after, strict=True)]
    hits = sum(end["hits"] - start["hits"] for start, end in zip(before, after, strict=True))
    total = sum(queries)
    return {"policy": policy, "completed": len(done), "failed": len(results) - len(done),
            "errors": sorted({r.error for r in results if not r.ok})[:3], "seconds": seconds,
            "hit_rate": hits / total if total else 0.0,
            "replica_shares": [q / total if total else 0.0 for q in queries],
            "ttft_ms": percentiles([r.ttft * 1e3 for r in done]),
            "output_throughput": sum(r.output_tokens for r in done) / seconds}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench.fleet", description=__doc__.splitlines()[0],
                                     epilog="Options not listed here go to every server of the fleets.")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=["cache_aware", "round_robin"])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context-words", type=int, default=1000, help="words of each user's document")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each reply")
    parser.add_argument("--seed", type=int, default=0)
    args, serve_options = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if min(args.replicas, args.users, args.turns, args.context_words, args.max_tokens) < 1:
        print("error: --replicas, --users, --turns, --context-words and --max-tokens must be at least 1",
              file=sys.stderr)
        return 2
    prompts = conversations(args.users, args.turns, args.context_words, args.seed)
    rows = []
    for policy in args.policies:
        rows.append(row := measure_policy(policy, args.replicas, serve_options, prompts, args.max_tokens))
        print(f"{policy:12s} {row['completed']} turns ({row['failed']} failed) in {row['seconds']:.1f} s: prefix-cache "
              f"hit rate {row['hit_rate']:.1%}, TTFT p50 {row['ttft_ms']['p50']:,.0f} ms, p90 "
              f"{row['ttft_ms']['p90']:,.0f} ms, {row['output_throughput']:.1f} output tok/s; prompt tokens per "
              "replica " + " / ".join(f"{share:.0%}" for share in row["replica_shares"]), flush=True)
    if len(rows) >= 2 and rows[1]["hit_rate"] and rows[1]["ttft_ms"]["p50"]:
        first, second = rows[0], rows[1]
        print(f"{first['policy']} against {second['policy']}: hit rate {first['hit_rate'] / second['hit_rate']:.2f}x, "
              f"TTFT p50 {first['ttft_ms']['p50'] / second['ttft_ms']['p50']:.2f}x")
    return 0 if all(not row["failed"] for row in rows) else 1


if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())

# %% [markdown] tags=["en"]
# Recorded three times on this book's CPU machine (two cores, SmolLM2, two replicas sharing them;
# the command is below), four users of about 1,300 tokens of context each, three turns each.
# Routing by the request text found 1.61 to 2.00 times the cached tokens that taking turns found,
# in every run. Taking turns still finds some: a user's later turn lands now and then on the
# replica that ran an earlier one. The wait for the first token is another matter: both replicas
# share two cores, so a TTFT is mostly a prefill queued behind other users' prefills, and it
# depends on what else the machine runs. On a quiet machine the median fell to 0.73x; with the
# machine busy it was 0.31x in one run and 0.94x in another. The goal of 0.7x is not met reliably
# here; a GPU per replica, where a prefill no longer waits for the other replica's, was not run.

# %% [markdown] tags=["zh"]
# 在本书的 CPU 机器上记录了三次（两个核，SmolLM2，两个副本共用它们；命令见下），四个用户，每人约 1,300 个 token 的
# 上下文，各问三轮。每次运行中，按请求文本分发找到的已缓存 token 都是轮流分发的 1.61 到 2.00 倍。轮流分发也能找到一些：
# 用户后面的某一轮时不时会落到跑过它前面某一轮的副本上。等第一个 token 的时间则是另一回事：两个副本共用两个核，所以
# TTFT 主要是排在别的用户的 prefill 后面等待的时间，它取决于机器上还在跑什么。机器空闲时，中位数降到 0.73 倍；机器繁忙
# 时，一次是 0.31 倍，另一次是 0.94 倍。在这里，0.7 倍的目标并不能稳定达到；每个副本一块 GPU、prefill 不再等另一个
# 副本的情形，没有运行过。

# %% the fleet benchmark, as it ran
# en: The three runs quoted above, as `python -m nanovllm.bench.fleet` printed them (a CPU's runs: chapters record GPU
# en: runs in notebooks/data/recorded/, and this machine's figures here). Hit rate and TTFT p50 (ms) of each policy.
# zh: 上面引用的三次运行，照 `python -m nanovllm.bench.fleet` 打印的数字记下（这是 CPU 上的运行：各章把 GPU 的运行
# zh: 记录在 notebooks/data/recorded/ 里，这台机器的数字就记在这里）。每种策略的命中率与 TTFT p50（ms）。
fleet_runs = {
    "machine": "CPU, 2 cores (this book's CI machine)", "date": "2026-12-06",
    "command": "python -m nanovllm.bench.fleet --replicas 2 --users 4 --turns 3 --context-words 1000 --device cpu "
               "--kvcache-block-size 16 --max-model-len 4096",
    "runs": [
        {"machine busy": True, "cache_aware": (0.658, 4000), "round_robin": (0.329, 12786)},
        {"machine busy": True, "cache_aware": (0.658, 5850), "round_robin": (0.409, 6239)},
        {"machine busy": False, "cache_aware": (0.658, 2435), "round_robin": (0.409, 3328)},
    ],
}
print(say("{date}, {card}: {command}", date=fleet_runs["date"], card=fleet_runs["machine"],
          command=fleet_runs["command"]))
ratios = []
for run in fleet_runs["runs"]:
    (aware_hits, aware_ttft), (turns_hits, turns_ttft) = run["cache_aware"], run["round_robin"]
    ratios.append((aware_hits / turns_hits, aware_ttft / turns_ttft))
    print(say("  cache_aware against round_robin: hit rate {hits:.2f}x, TTFT p50 {ttft:.2f}x", hits=ratios[-1][0],
              ttft=ratios[-1][1]))
# en: The fleet's goals: at least 1.5x the hit rate of taking turns (met in every run), at most 0.7x its median TTFT
# en: (met once, 0.73x on the quiet machine): here cache_aware's median is never the slower one, no more.
# zh: 机群的目标：命中率至少是轮流分发的 1.5 倍（每次都达到），TTFT 中位数至多是它的 0.7 倍（只达到一次，机器空闲时为
# zh: 0.73 倍）：在这里只能说 cache_aware 的中位数从来不是较慢的那个。
assert all(hits >= 1.5 and ttft < 1.0 for hits, ttft in ratios)
assert [round(ttft, 2) for _, ttft in ratios] == [0.31, 0.94, 0.73]

# %% [markdown] tags=["en"]
# On an H100 the goals were missed (2026-12-07, `scripts/gpu-ci.sh fleet`: two replicas sharing
# the GPU, 31 users, four turns each, each user's document about 4,000 tokens). `cache_aware` found
# 1.43× the cached tokens of `round_robin`, and its median TTFT was 1.23× round_robin's, slower,
# though its p90 was lower (310 ms against 377 ms). Two things weigh against the gateway here.
# With two replicas, taking turns lands a later turn on a replica that ran an earlier one about
# every other time, so its hit rate is high already; more replicas, or more turns, leave it
# further behind. And a GPU prefills a few thousand tokens in milliseconds, so the median is
# probably decided by the opening burst, 31 cold first turns at once, and by how the gateway
# spread them, more than by the cache. The benchmark now prints each replica's share of the prompt
# tokens, so that the next run can say whether `cache_aware` crowded one replica; with only this
# run, the book cannot.

# %% [markdown] tags=["zh"]
# 在 H100 上，目标没有达到（2026-12-07，`scripts/gpu-ci.sh fleet`：两个副本共用这块 GPU，31 个用户，每人四轮，每个
# 用户的文档约 4,000 个 token）。`cache_aware` 找到的已缓存 token 是 `round_robin` 的 1.43 倍，而它的 TTFT 中位数是
# round_robin 的 1.23 倍，反而更慢，尽管它的 p90 更低（310 ms 对 377 ms）。这里有两件事对网关不利。只有两个副本时，
# 轮流分发让后面的一轮大约每两次就有一次落到跑过前面某轮的副本上，所以它的命中率本来就高；副本更多或轮数更多，它才
# 会被拉开。另外，GPU 做几千个 token 的 prefill 只要几毫秒，所以中位数多半取决于开头的那一波，31 个冷启动的第一轮
# 同时到达，以及网关怎样把它们分出去，而不怎么取决于缓存。基准测试现在会打印每个副本分到的 prompt token 份额，下一次
# 运行就能说清 `cache_aware` 有没有把请求挤到一个副本上；只凭这一次运行，本书说不清。

# %% recorded: the fleet on a GPU
from nanovllm.book.recorded import recorded

gpu_fleet = recorded("28_fleet")["two replicas on one GPU"]
print(say("{date}, {card}: {command}", date=gpu_fleet.date, card=gpu_fleet.card, command=gpu_fleet.command))
aware, turns = gpu_fleet.figures["cache_aware"], gpu_fleet.figures["round_robin"]
hits, ttft = aware["hit rate"] / turns["hit rate"], aware["TTFT p50 ms"] / turns["TTFT p50 ms"]
print(say("  cache_aware against round_robin: hit rate {hits:.2f}x, TTFT p50 {ttft:.2f}x", hits=hits, ttft=ttft))
# en: Both goals missed on this run (at least 1.5x the hit rate, at most 0.7x the median TTFT); the tail was shorter.
# zh: 这次运行两个目标都没达到（命中率至少 1.5 倍，TTFT 中位数至多 0.7 倍）；尾部更短。
assert (round(hits, 2), round(ttft, 2)) == (1.43, 1.23) and aware["TTFT p90 ms"] < turns["TTFT p90 ms"]

# %% [markdown] tags=["en"]
# ## Across machines
#
# A fleet may span machines: servers started elsewhere join by URL. On machine B, start a
# server that listens beyond the loopback (`--host 0.0.0.0`; with `--api-key` only if the gateway
# is given the same key); on machine A, start the fleet with its own replicas and B's URL:
#
# ```bash
# # machine B (say 10.0.0.2): one server per GPU, each on a port of its own
# CUDA_VISIBLE_DEVICES=0 python -m nanovllm.serve --model /models/Qwen3-0.6B --host 0.0.0.0 --port 8001
# # machine A: its own replicas, B's server, and the gateway for all of them
# python -m nanovllm.serve.fleet --model /models/Qwen3-0.6B --host 0.0.0.0 --port 8000 \
#     --worker-url http://10.0.0.2:8001
# ```
#
# Every server must run the same model under the same name, with the same block size. The fleet
# supervises only the replicas it started; a server that joined by URL is checked when the fleet
# starts, and afterwards the gateway's health checks take it out of the rotation while it does
# not answer. One model too big for one machine is a different matter: that is tensor parallelism
# across machines (chapter 17).

# %% [markdown] tags=["zh"]
# ## 跨机器
#
# 机群可以跨越多台机器：在别处启动的服务器通过 URL 加入。在机器 B 上启动一个不只监听回环地址的服务器（`--host 0.0.0.0`；
# 只有在网关也拿到同样的密钥时才加 `--api-key`）；在机器 A 上启动机群，带上它自己的副本和 B 的 URL：
#
# ```bash
# # 机器 B（比如 10.0.0.2）：每块 GPU 一个服务器，各用一个端口
# CUDA_VISIBLE_DEVICES=0 python -m nanovllm.serve --model /models/Qwen3-0.6B --host 0.0.0.0 --port 8001
# # 机器 A：它自己的副本、B 的服务器，以及为它们全体服务的网关
# python -m nanovllm.serve.fleet --model /models/Qwen3-0.6B --host 0.0.0.0 --port 8000 \
#     --worker-url http://10.0.0.2:8001
# ```
#
# 每个服务器都必须以同样的名字运行同一个模型，块大小也要相同。机群只看护它自己启动的副本；通过 URL 加入的服务器在机群启
# 动时检查一次，之后它不应答时，由网关的健康检查把它摘出轮转。一台机器装不下的单个模型是另一回事：那是跨机器的张量并行
# （第 17 章）。

# %% [markdown] tags=["en"]
# ## What we built
#
# - `/server_info` on the server (SGLang's route), so that the gateway names the model.
# - `nanovllm.serve.fleet`: `Replica` (a server in a process group of its own), `gpu_budgets`
#   (replicas sharing a GPU), `gateway_command` (sglang-router, tuned to drop a dead replica in
#   seconds), `Fleet` (start, supervise, stop the whole tree; `start_gateway` puts another gateway
#   over running replicas; every child dies with the fleet, even a SIGKILLed one) and
#   `python -m nanovllm.serve.fleet`, with `--worker-url` for servers on other machines.
# - An animation of the two replicas' caches, from their KV events: under `cache_aware` each
#   user's turns stay with its blocks, under `round_robin` they scatter.
# - `python -m nanovllm.bench.fleet`: a multi-turn workload run through one fleet per policy, its
#   hit rate from the replicas' counters; on this CPU, `cache_aware` found 1.61-2.00x the cached
#   tokens of `round_robin`, at 0.31-0.94x its median TTFT (0.73x on a quiet machine); on an H100
#   with two replicas sharing it, 1.43× the hit rate at 1.23× the median TTFT: both goals missed.
#
# The gateway routes by request text. Chapter 27's events would let a gateway route by what the
# caches hold for certain; vLLM's gateway reads them, once it can tokenize through a worker
# (`/tokenize`), which our server does not serve yet.
#
# ## Exercises
#
# 1. Three replicas share one GPU with `gpu_memory_utilization=0.9`. What does each replica ask
#    for, and why would 0.3 each leave the second and third without a KV cache?
# 2. A user's first turn went to replica 0, which then dies and is restarted. Where does the
#    user's second turn go, and what does the restarted replica's cache hold?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - 服务器上的 `/server_info`（SGLang 的接口），让网关说得出模型的名字。
# - `nanovllm.serve.fleet`：`Replica`（自成一个进程组的服务器）、`gpu_budgets`（共用 GPU 的副本）、`gateway_command`
#   （sglang-router，调成几秒内就摘下死掉的副本）、`Fleet`（启动、看护、停止整棵进程树；`start_gateway` 在运行中的副本
#   之上再放一个网关；每个子进程都随机群一起结束，机群被 SIGKILL 也一样），以及带 `--worker-url`（加入别的机器上的服务
#   器）的 `python -m nanovllm.serve.fleet`。
# - 两个副本的缓存的动画，取自它们的 KV 事件：在 `cache_aware` 下，每个用户的各轮都跟着它的块走；在 `round_robin` 下，
#   它们四处分散。
# - `python -m nanovllm.bench.fleet`：每种策略一个机群，让多轮负载通过它，命中率取自副本的计数器；在这台 CPU 上，
#   `cache_aware` 找到的已缓存 token 是 `round_robin` 的 1.61–2.00 倍，TTFT 中位数是它的 0.31–0.94 倍（机器空闲时
#   0.73 倍）；在两个副本共用的一块 H100 上，命中率 1.43 倍，TTFT 中位数却是 1.23 倍：两个目标都没达到。
#
# 网关按请求文本分发。第 27 章的事件能让网关确切地按缓存里有什么来分发；vLLM 的网关会读这些事件，前提是它能借 worker做分
# 词（`/tokenize`），而我们的服务器还没有提供这个接口。
#
# ## 练习
#
# 1. 三个副本以 `gpu_memory_utilization=0.9` 共用一块 GPU。每个副本申请多少？为什么每个都用 0.3 会让第二、第三个
#    副本没有 KV 缓存？
# 2. 某个用户的第一轮去了副本 0，之后副本 0 死掉并被重启。这个用户的第二轮会去哪里？重启后的副本的缓存里有什么？

# %%
# en: Exercise 1: 0.3, 0.6 and 0.9: each sizes its cache as utilization x total less what is in use on the whole GPU,
# en: so with 0.3 each the second would find 0.3 of the GPU taken already and have nothing left.
# zh: 练习 1：0.3、0.6 和 0.9：每个副本按“利用率 × 总量，减去整块 GPU 上已在使用的部分”确定缓存大小，所以如果每个都用
# zh: 0.3，第二个会发现 GPU 的 0.3 已被占用，什么也不剩。
assert [share for _, share in gpu_budgets(3, 1, 0.9)] == [0.3, 0.6, 0.9]
# en: Exercise 2: the gateway's tree still points at replica 0, which is back on the same port, so the turn goes there,
# en: unless replica 0 is much busier; but its cache starts empty: the turn is prefilled whole, once.
# zh: 练习 2：网关的树仍然指向副本 0，而它已在同一个端口上回来了，所以这一轮还去那里，除非副本 0 忙得多；但它的缓存
# zh: 从空开始：这一轮要完整地 prefill 一次。
print(say("all exercise answers check out"))
