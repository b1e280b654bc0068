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
# # 17b · Tensor parallelism across machines
#
# **Goal.** Chapter 17's ranks live on one machine: they meet at a store on `127.0.0.1` and take
# their calls through pipes. This chapter lets the ranks of one group live on several machines,
# **nodes**, with one rendezvous address and port that every node is told and one command to run
# on each other node. By the end you can say what crosses the network and what does not, why a
# remote rank's calls travel on a TCP connection rather than through the process group, how a
# node that never comes or a rank that dies ends every process with an error that names it, and
# how to run it on two machines.

# %% [markdown] tags=["zh"]
# # 17b · 跨机器的张量并行
#
# **目标：** 第 17 章的各个 rank 都在一台机器上：它们在 `127.0.0.1` 上的 store 会合，经管道接收调用。本章让一个进程组
# 的 rank 分布在几台机器（**节点**）上：每个节点都被告知同一个会合地址和端口，在其他每个节点上运行一条命令。读完本章，
# 你能说出什么要经过网络、什么不用，为什么远程 rank 的调用走 TCP 连接而不是经进程组转发，一个始终没来的节点或一个死掉
# 的 rank 怎样以指明它的错误结束所有进程，以及怎样在两台机器上运行它。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "  rank {rank}/{size} pid {pid} {backend}, started by {parent}":
        "  rank {rank}/{size} pid {pid} {backend}，由{parent}启动",
    "this driver's forkserver": "本驱动进程的 forkserver",
    "the agent of node 1": "节点 1 的代理进程",
    "two nodes give the tokens of one process; node 1's agent exited with {code}":
        "两个节点给出与单进程相同的 token；节点 1 的代理进程以 {code} 退出",
})

# %% the tiny model and its tokens on one process
# en: Chapter 17's tiny Qwen3, its settings and prompts, and the greedy tokens of one process: what two nodes must give.
# zh: 第 17 章的小 Qwen3、它的设置和提示词，以及单进程给出的贪心 token：两个节点必须给出同样的结果。
import os
from multiprocessing.connection import Connection

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

tiny = build_tiny_model("qwen3")
settings = {"device": "cpu", "kvcache_block_size": 4, "num_kvcache_blocks": 12, "max_num_batched_tokens": 16}
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Write clear code"]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
with LLM(str(tiny), **settings) as llm_tp1:
    out_tp1 = llm_tp1.generate(prompts, greedy, use_tqdm=False)

# %% [markdown] tags=["en"]
# ## The idea: one group, two machines
#
# A model that needs more GPUs than one machine has needs ranks on two machines (**nodes**) in
# one group. Chapter 17 assumed one machine in two places only: the rendezvous store sat on
# a free port of `127.0.0.1`, and the control channel was a pipe, which cannot leave the machine.
#
# ```
#  node 0: your machine                                   node 1
#  driver (LLM, scheduler)                                node agent: python -m nanovllm.engine.tp_node
#    store on master_addr:master_port  ◄── reads the control port ── agent
#    control port (any free one)       ◄── link "node 1" ─────────── agent
#                                      ◄── connection "rank 2" ───── rank 2 ┐ children of the agent
#                                      ◄── connection "rank 3" ───── rank 3 ┘
#    ├─ pipe ─ rank 0
#    └─ pipe ─ rank 1          ranks 0-3: one gloo/NCCL group, across the network
# ```
#
# - **The store listens on `master_port`**, which every node is told, instead of a free port.
#   In it the driver publishes a second port, its **control port** (any free one), with a random
#   token that turns away stray connections.
# - **A remote rank's control channel is a TCP connection.** A pipe is a socket pair, and
#   `multiprocessing.connection.Connection` wraps a TCP socket just as well: the same
#   `send_bytes`/`recv_bytes`, and `wait` watches both. So `post`, `collect`, the `Replier` and
#   every fault rule of chapter 17 stay as they are. A remote rank that dies shows up as its connection
#   closing (TCP keep-alive probes catch a machine that vanished within about half a minute); one
#   that hangs meets `rank_timeout_s`. The driver cannot signal a process on another machine, so
#   `RemoteRank` stands in for it: its sentinel is its connection, and `stop_ranks` leaves it to
#   its node.
# - **Why not relay the calls through the process group** (rank 0 broadcasting each call with
#   `broadcast_object_list`)? For the reason chapter 17 gave at its start: a collective is
#   one-way and blocking. A rank that failed could not say so, and a dead peer would hang it.
# - **A node agent on every other node** (`nanovllm.engine.tp_node`) dials in a link, receives
#   node 0's `Config` (so every rank runs the same model path, block size and dtype: nothing to
#   keep in step by hand), and spawns its ranks, which dial in their own connections and then run
#   `rank_main` like any rank. When the link closes (an exit, an error, or the driver's death),
#   the agent gives its ranks `EXIT_GRACE_S` to leave and then terminates them. Each rank watches
#   its parent, the agent, as ranks on node 0 watch the driver.
# - **Node 0 waits for the others first**, up to `join_timeout_s`, and only then spawns its own
#   ranks; a node that does not come is a `TPTimeoutError` that names it and the command to run,
#   with every process stopped.
# - Ranks are numbered node by node: with *n* = `tensor_parallel_size / nnodes` ranks per node,
#   node *k* runs ranks *kn* to *kn + n − 1*, rank *r* on GPU *r mod n* of its node. They agree on
#   the KV block count with `agree_min`, as before.
#
# Like torch.distributed's store and gloo/NCCL themselves, none of these ports is authenticated:
# run them on a private network.

# %% [markdown] tags=["zh"]
# ## 思路：一个进程组，两台机器
#
# 一台机器的 GPU 放不下的模型，需要两台机器（**节点**）上的 rank 组成一个进程组。第 17 章只在两处假定了一台机器：
# 会合点存储开在 `127.0.0.1` 的空闲端口上；控制通道是管道，而管道出不了这台机器。
#
# ```
#  节点 0：你的机器                                       节点 1
#  驱动进程（LLM、调度器）                                节点代理进程：python -m nanovllm.engine.tp_node
#    store 在 master_addr:master_port  ◄── 读取控制端口 ───────────── 代理进程
#    控制端口（任一空闲端口）          ◄── 连接 "node 1" ──────────── 代理进程
#                                      ◄── 连接 "rank 2" ──────────── rank 2 ┐ 代理进程的子进程
#                                      ◄── 连接 "rank 3" ──────────── rank 3 ┘
#    ├─ 管道 ─ rank 0
#    └─ 管道 ─ rank 1          rank 0-3：一个跨网络的 gloo/NCCL 进程组
# ```
#
# - **store 监听 `master_port`**，每个节点都被告知这个端口，而不再是一个空闲端口。驱动进程在 store 里公布第二个端口，
#   即它的**控制端口**（任一空闲端口），外加一个随机令牌，用来拒绝无关的连接。
# - **远程 rank 的控制通道是一条 TCP 连接。** 管道就是一对套接字，而 `multiprocessing.connection.Connection`
#   同样能包装 TCP 套接字：一样的 `send_bytes`/`recv_bytes`，`wait` 也能同时等待两者。所以 `post`、`collect`、
#   `Replier` 以及第 17 章的每条故障规则都原样不变。远程 rank 死掉，表现为它的连接被关闭（机器整个消失时，TCP
#   keep-alive 探测大约半分钟内就能发现）；卡住的 rank 会撞上 `rank_timeout_s`。驱动进程无法向另一台机器上的进程
#   发信号，所以由 `RemoteRank` 代表它：它的哨兵就是它的连接，`stop_ranks` 把它交给它所在的节点去停。
# - **为什么不经进程组转发调用**（由 rank 0 用 `broadcast_object_list` 广播每次调用）？理由与第 17 章开头所说的
#   相同：集合通信单向且阻塞。出错的 rank 没法说出来，对端死掉会让它挂住。
# - **其他每个节点上都有一个节点代理进程**（`nanovllm.engine.tp_node`）：它拨入一条连接，收到节点 0 的 `Config`
#   （于是每个 rank 用的模型路径、块大小和数据类型都相同：没有什么需要手工保持一致），再启动本节点的 rank；这些 rank
#   各自拨入自己的连接，然后像任何 rank 一样运行 `rank_main`。这条连接一关闭（正常退出、出错，或者驱动进程死掉），
#   代理进程就给它的 rank `EXIT_GRACE_S` 秒自行退出，然后终止它们。每个 rank 盯着自己的父进程，也就是代理进程，
#   正如节点 0 上的 rank 盯着驱动进程。
# - **节点 0 先等其他节点**，最多等 `join_timeout_s` 秒，然后才启动自己的 rank；没有按时到来的节点会引发
#   `TPTimeoutError`，错误写明是哪个节点以及要运行的命令，所有进程都已停止。
# - rank 按节点依次编号：每个节点有 *n* = `tensor_parallel_size / nnodes` 个 rank，节点 *k* 运行 rank *kn* 到
#   *kn + n − 1*，rank *r* 使用本节点的第 *r mod n* 块 GPU。它们照旧用 `agree_min` 商定 KV 块数。
#
# 与 torch.distributed 的 store 以及 gloo/NCCL 本身一样，这些端口都没有身份验证：请只在私有网络中使用。

# %% [markdown] tags=["en"]
# ## Build it: the settings
#
# The settings: `nnodes` machines, node 0's `master_addr` and `master_port` (the store), and how
# long node 0 waits for the others. They are checked before anything starts.

# %% [markdown] tags=["zh"]
# ## 动手：设置项
#
# 设置项：`nnodes` 台机器，节点 0 的 `master_addr` 与 `master_port`（store 所在），以及节点 0 等待其他节点的时长。
# 它们在任何东西启动之前就接受检查。

# %% setting: nodes
#| export config
import torch

from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.config import Config


# en: Tensor parallelism across machines: how many nodes share the ranks, where node 0's rendezvous store listens
# en: (port 0: any free port, one node only), and how long node 0 waits for the other nodes to join.
# zh: 跨机器的张量并行：多少个节点分担各 rank，节点 0 的会合点存储在哪里监听（端口 0：任一空闲端口，只限单节点），
# zh: 以及节点 0 等待其他节点加入的时长。
@add_fields(Config)
class _Nodes:
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    join_timeout_s: float = 300.0


@add_to_init(Config)
def _check_nodes(self) -> None:
    self._check("nnodes", int, lambda n: n >= 1, ">= 1")
    self._check("master_addr", str, lambda host: bool(host.strip()), "a host name or an IP address")
    self._check("master_port", int, lambda port: 0 <= port <= 65535, "in [0, 65535]")
    self._check("join_timeout_s", float, lambda x: x > 0, "> 0")
    ranks, nodes = self.tensor_parallel_size, self.nnodes
    if ranks % nodes:
        raise ValueError(f"tensor_parallel_size={ranks} is not divisible by nnodes={nodes}: every node runs the "
                         "same number of ranks")
    if nodes > 1 and self.master_port == 0:
        raise ValueError(f"nnodes={nodes} needs master_port (e.g. 29500): the other nodes must know where node 0's "
                         "rendezvous store listens")
    per_node = ranks // nodes
    if self.device == "cuda" and per_node > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={ranks} over nnodes={nodes} needs {per_node} GPU(s) per node, "
                         f"but only {torch.cuda.device_count()} are visible here")

# %% [markdown] tags=["en"]
# ## Build it: node 0 waits for the others
#
# The driver's side: `RemoteRank`, and `_join_nodes`, which `TPRunner` calls before it spawns
# this node's ranks. Every connection opens with one line of plain text, the token and who is
# calling (`node 1`, `rank 3`), which is checked before anything from it is unpickled.

# %% [markdown] tags=["zh"]
# ## 动手：节点 0 等齐其他节点
#
# 驱动进程这一侧：`RemoteRank`，以及 `TPRunner` 在启动本节点 rank 之前调用的 `_join_nodes`。每条连接都以一行纯文本
# 开头：令牌，加上来者是谁（`node 1`、`rank 3`）；先检查这一行，然后才会反序列化来自这条连接的任何东西。

# %% nodes join
#| export engine.tp_runtime
import contextlib
import hmac
import secrets
import socket
from dataclasses import dataclass

import torch.distributed as dist

from nanovllm.book.literate import add_to_class
from nanovllm.engine.tp_runtime import TPRunner, TPTimeoutError, TPWorkerError, _send, process_state

# en: The store key under which node 0 publishes its control port and token.
# zh: 节点 0 在 store 里公布其控制端口与令牌时使用的键。
CONTROL_KEY = "nanovllm/control"


def as_connection(sock: socket.socket) -> Connection:
    """A connected TCP socket as a `Connection`, like a pipe's end: no Nagle delay, and keep-alive probes so that
    a peer whose machine vanished reads as a closed connection within about half a minute."""
    # zh: 把一个已连接的 TCP 套接字包装成 `Connection`，用起来就像管道的一端：关掉 Nagle 延迟，并打开 keep-alive
    # zh: 探测，这样对端机器消失后，大约半分钟内读到的就是一条已关闭的连接。
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return Connection(sock.detach())


def dial(host: str, port: int, token: str, who: str, timeout_s: float) -> Connection:
    """Connect to node 0's control port and say who is calling: ``who`` is "node K" or "rank R"."""
    # zh: 连接节点 0 的控制端口，并报上来者是谁：``who`` 是 "node K" 或 "rank R"。
    conn = as_connection(socket.create_connection((host, port), timeout=timeout_s))
    conn.send_bytes(f"{token} {who} {os.getpid()}".encode())
    return conn


@dataclass
class RemoteRank:
    """A rank whose process runs on another node. It stands where a rank's process stands in `TPRunner`: its
    connection is its sentinel, and `is_alive()` is False, since only its node can signal it: `stop_ranks`
    closes the node's link, and the node's agent stops it."""
    # zh: 进程运行在另一个节点上的 rank。在 `TPRunner` 里它占着 rank 进程的位置：它的连接就是它的哨兵；
    # zh: `is_alive()` 为 False，因为只有它所在的节点能向它发信号：`stop_ranks` 关闭通向该节点的连接，
    # zh: 由该节点的代理进程停掉它。

    node: int
    pid: int
    conn: Connection
    exitcode = "unknown to node 0"

    @property
    def sentinel(self) -> Connection:
        return self.conn

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for on this machine."""
        # zh: 在这台机器上没有什么可等的。


@add_to_class(TPRunner)
def _state(self, rank: int) -> str:
    """The kernel's word for a rank's process state ("stopped", ...), or the node it runs on."""
    # zh: 内核对某个 rank 进程状态的称呼（"stopped"……），或者它所在的节点。
    proc = self._procs[rank]
    return f"on node {proc.node}" if isinstance(proc, RemoteRank) else process_state(proc.pid)


@add_to_class(TPRunner)
def _join_nodes(self, store: dist.TCPStore) -> list[RemoteRank]:
    """Wait for every other node's agent and ranks to dial in, within ``join_timeout_s``; their ranks, in order."""
    # zh: 在 ``join_timeout_s`` 之内，等其他每个节点的代理进程和 rank 拨进来；按顺序返回这些 rank。
    here = self.world_size // self.config.nnodes
    token, nodes, remote = secrets.token_hex(16), {}, {}
    with socket.create_server(("", 0)) as server:
        store.set(CONTROL_KEY, f"{server.getsockname()[1]} {token}")
        # en: only the runner holds the store: a traceback that keeps this frame must not keep its port taken
        # zh: 只有执行器持有 store：留住这一帧的调用栈不能让它的端口一直被占着。
        del store
        deadline = time.monotonic() + self.config.join_timeout_s
        try:
            while len(nodes) < self.config.nnodes - 1 or len(remote) < self.world_size - here:
                ready = wait([server, *nodes.values()], max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TPTimeoutError(self._not_joined(nodes, remote))
                for node, link in nodes.items():
                    if link in ready:
                        raise TPWorkerError(f"tensor-parallel node {node}'s agent left before its ranks joined")
                sock, _ = server.accept()
                self._greet(as_connection(sock), token, nodes, remote, deadline)
        except BaseException:
            for handle in remote.values():
                handle.conn.close()
            raise
    return [remote[rank] for rank in sorted(remote)]


@add_to_class(TPRunner)
def _greet(self, conn: Connection, token: str, nodes: dict, remote: dict, deadline: float) -> None:
    """Read a caller's first line; file it as a node's link or a rank's connection, or turn it away."""
    # zh: 读取来者的第一行；把它登记为某个节点的连接或某个 rank 的连接，或者拒之门外。
    here, nnodes, said = self.world_size // self.config.nnodes, self.config.nnodes, []
    # en: a caller that says nothing for 5 s is not one of ours
    # zh: 5 秒内一言不发的来者不是我们的。
    with contextlib.suppress(OSError, EOFError, UnicodeDecodeError):
        if conn.poll(min(5.0, max(0.0, deadline - time.monotonic()))):
            said = conn.recv_bytes(200).decode().split()
    if len(said) != 4 or not hmac.compare_digest(said[0].encode(), token.encode()) or not said[2].isdigit():
        conn.close()
        return
    kind, number, pid = said[1], int(said[2]), said[3]
    if kind == "rank" and number < self.world_size and number // here in nodes and number not in remote:
        remote[number] = RemoteRank(number // here, int(pid), conn)
        return
    refusal = (f"node_rank {number} is out of range: this engine runs nnodes={nnodes}, so the other nodes are 1 to "
               f"{nnodes - 1}" if not 0 < number < nnodes else
               f"node {number} has already joined: is another agent running with --node-rank {number}?"
               if number in nodes else None)
    if kind != "node" or refusal:
        with contextlib.suppress(OSError):
            _send(conn, ("refused", refusal or f"unexpected caller {kind} {number}"))
        conn.close()
        return
    _send(conn, ("ok", self.config, range(number * here, (number + 1) * here)))
    nodes[number] = conn
    self._links.append(conn)


@add_to_class(TPRunner)
def _not_joined(self, nodes: dict, remote: dict) -> str:
    """Which nodes or ranks did not join in time, and what to run on them."""
    # zh: 哪些节点或 rank 没有按时加入，以及要在它们上面运行什么。
    here, config = self.world_size // self.config.nnodes, self.config
    missing = [f"node {node}" for node in range(1, config.nnodes) if node not in nodes]
    missing += [f"rank {rank}" for rank in range(here, self.world_size)
                if rank // here in nodes and rank not in remote]
    return (f"tensor-parallel {', '.join(missing)} did not join within join_timeout_s={config.join_timeout_s:g} s; "
            f"on node K, run `python -m nanovllm.engine.tp_node --master-addr {config.master_addr} --master-port "
            f"{config.master_port} --node-rank K`. Every process this engine started has been stopped.")

# %% [markdown] tags=["en"]
# ## Build it: the node agent
#
# The agent: `run_node` serves one node until node 0 is done with it; `main` is its command line.

# %% [markdown] tags=["zh"]
# ## 动手：节点代理进程
#
# 代理进程：`run_node` 为一个节点服务，直到节点 0 用完它；`main` 是它的命令行。

# %% node agent
#| export engine.tp_node
import argparse
import multiprocessing as mp
import pickle
import socket
import sys
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.tp_runtime import CONTROL_KEY, stop_ranks, dial, rank_main


def remote_rank_main(rank: int, config: Config, control: tuple[str, int, str]) -> None:
    """A rank on a node other than 0: dial node 0's control port, then live as every rank does."""
    # zh: 节点 0 以外某个节点上的 rank：拨通节点 0 的控制端口，然后像每个 rank 一样生活。
    host, port, token = control
    conn = dial(host, port, token, f"rank {rank}", config.join_timeout_s)
    rank_main(rank, config.tensor_parallel_size, config, config.master_port, conn)


def reach_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """Node 0's rendezvous store, waiting quietly (up to ``timeout_s``) for node 0 to open it."""
    # zh: 节点 0 的会合点存储；安静地等待（最多 ``timeout_s`` 秒）节点 0 把它打开。
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s: start node 0's engine "
                                   f"(nnodes=..., master_port={port}) or check the address and the firewall") from None
            time.sleep(0.5)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def run_node(master_addr: str, master_port: int, node_rank: int, timeout_s: float = 300.0) -> int:
    """Run node ``node_rank``'s ranks for the engine on node 0 until node 0 closes the link; 0 if they all ended
    well. Raises ValueError when node 0 refuses this node."""
    # zh: 为节点 0 上的引擎运行节点 ``node_rank`` 的各 rank，直到节点 0 关闭连接；全部正常结束时返回 0。
    # zh: 节点 0 拒绝本节点时抛出 ValueError。
    if node_rank < 1:
        raise ValueError(f"--node-rank {node_rank}: node 0 is the engine's own machine (LLM(..., nnodes=N) or "
                         "nanovllm.serve runs there); the other nodes are 1, 2, ...")
    port, token = reach_store(master_addr, master_port, timeout_s).get(CONTROL_KEY).decode().split()
    try:
        link = dial(master_addr, int(port), token, f"node {node_rank}", timeout_s)
    except ConnectionRefusedError:
        raise ConnectionError(f"node 0 at {master_addr} no longer takes nodes (its control port {port} is closed): "
                              "it timed out waiting (join_timeout_s), or it has stopped") from None
    answer, *given = pickle.loads(link.recv_bytes())
    if answer == "refused":
        raise ValueError(f"node 0 refused this node: {given[0]}")
    config, ranks = given
    context = mp.get_context("spawn")
    procs = [context.Process(target=remote_rank_main, args=(rank, config, (master_addr, int(port), token)),
                             name=f"nanovllm-tp-rank{rank}", daemon=True) for rank in ranks]
    for proc in procs:
        proc.start()
    print(f"node {node_rank}: ranks {list(ranks)} (pids {[p.pid for p in procs]}) joined {master_addr}:{master_port}",
          file=sys.stderr, flush=True)
    graceful = True
    try:
        # en: nothing arrives on the link: it closes when node 0 is done, or gone
        # zh: 这条连接上不会有任何消息：节点 0 用完或者不在了，它就会关闭。
        wait([link])
    except KeyboardInterrupt:
        graceful = False
    finally:
        stop_ranks(procs, [], [link], [], {"graceful": graceful})
    return 0 if graceful and all(proc.exitcode == 0 for proc in procs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.engine.tp_node",
        description="Run this machine's tensor-parallel ranks for an engine on node 0, started there with "
                    "tensor_parallel_size, nnodes, master_addr and master_port. Node 0 sends the settings.")
    parser.add_argument("--master-addr", required=True, help="node 0's address, as node 0's master_addr")
    parser.add_argument("--master-port", required=True, type=int, help="node 0's master_port")
    parser.add_argument("--node-rank", required=True, type=int, help="this machine's number: 1 to nnodes - 1")
    parser.add_argument("--join-timeout-s", type=float, default=300.0,
                        help="seconds to wait for node 0 (default 300)")
    args = parser.parse_args(argv)
    if not 0 < args.master_port < 65536:
        parser.error(f"--master-port {args.master_port} is not a port (1 to 65535)")
    try:
        return run_node(args.master_addr, args.master_port, args.node_rank, args.join_timeout_s)
    except (ValueError, TimeoutError, ConnectionError, dist.DistError) as error:
        print(f"tp_node: {error}", file=sys.stderr)
        return 2


# en: A notebook also runs this code as __main__; only a real `python -m nanovllm.engine.tp_node` should act.
# zh: 笔记本也会把这段代码当作 __main__ 运行；只有真正的 `python -m nanovllm.engine.tp_node` 才应该执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    raise SystemExit(main())

# %% [markdown] tags=["en"]
# ## See it: two nodes on one machine
#
# Two "nodes" on this CPU over gloo: node 1's agent is a subprocess, started first (it waits for
# node 0), then the engine with `nnodes=2`. The ranks' parents show who started which (rank 0 is
# forked by chapter 17's forkserver, a child of this process); the tokens are TP=1's.

# %% [markdown] tags=["zh"]
# ## 看它运行：一台机器上的两个节点
#
# 在这台 CPU 上用 gloo 模拟两个“节点”：节点 1 的代理进程是一个子进程，先启动（它会等节点 0），然后以 `nnodes=2`
# 启动引擎。各 rank 的父进程表明是谁启动了谁（rank 0 由第 17 章的 forkserver fork 出来，它是本进程的子进程）；
# 得到的 token 与 TP=1 的相同。

# %%
import socket
import subprocess
import sys


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as file:
        return int(file.read().rsplit(")", 1)[1].split()[1])


with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    master_port = probe.getsockname()[1]
node1 = subprocess.Popen([sys.executable, "-m", "nanovllm.engine.tp_node", "--master-addr", "127.0.0.1",
                          "--master-port", str(master_port), "--node-rank", "1"], stderr=subprocess.PIPE, text=True)
with LLM(str(tiny), tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=master_port,
         **settings) as two_nodes:
    for info in two_nodes.model_runner.call("world"):
        parent = say("the agent of node 1") if info["parent"] == node1.pid else say("this driver's forkserver")
        print(say("  rank {rank}/{size} pid {pid} {backend}, started by {parent}", rank=info["rank"],
                  size=info["size"], pid=info["pid"], backend=info["backend"], parent=parent))
    # en: rank 0 is forked by chapter 17's forkserver, a child of this process; rank 1 by node 1's agent
    # zh: rank 0 由第 17 章的 forkserver（本进程的子进程）fork 出来；rank 1 由节点 1 的代理进程启动。
    server, agent = [info["parent"] for info in two_nodes.model_runner.call("world")]
    assert agent == node1.pid and parent_of(server) == os.getpid()
    out_nodes = two_nodes.generate(prompts, greedy, use_tqdm=False)
assert [o["token_ids"] for o in out_nodes] == [o["token_ids"] for o in out_tp1]
assert node1.wait(timeout=30) == 0
print(node1.stderr.read().strip())
print(say("two nodes give the tokens of one process; node 1's agent exited with {code}", code=node1.returncode))

# %% [markdown] tags=["en"]
# ## What we built
#
# - `Config`'s `nnodes`, `master_addr`, `master_port` and `join_timeout_s`, checked before
#   anything starts; the rendezvous store on `master_port`.
# - `RemoteRank`, a rank reached by a TCP connection wrapped as a `Connection`;
#   `TPRunner._join_nodes`, which waits for every other node before this node's ranks start.
# - `nanovllm/engine/tp_node.py`, the agent that runs another node's ranks:
#   `python -m nanovllm.engine.tp_node --master-addr A --master-port P --node-rank K`.
#
# On two machines with GPUs, run the agent on node 1 first, then the engine on node 0 with
# `tensor_parallel_size`, `nnodes`, `master_addr` and `master_port` (the Guide's GPU page has the
# NCCL settings). Two nodes were run here only on one CPU, over gloo.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `Config` 的 `nnodes`、`master_addr`、`master_port` 与 `join_timeout_s`，在任何东西启动之前检查；开在
#   `master_port` 上的会合点 store。
# - `RemoteRank`：经一条包装成 `Connection` 的 TCP 连接通信的 rank；`TPRunner._join_nodes`：在本节点的 rank 启动之前
#   等齐其他每个节点。
# - `nanovllm/engine/tp_node.py`：运行另一个节点上各 rank 的代理进程：
#   `python -m nanovllm.engine.tp_node --master-addr A --master-port P --node-rank K`。
#
# 在两台有 GPU 的机器上，先在节点 1 上运行代理进程，再在节点 0 上以 `tensor_parallel_size`、`nnodes`、`master_addr`
# 和 `master_port` 启动引擎（NCCL 的设置见指南的 GPU 页面）。这里的两个节点只在一台 CPU 上用 gloo 运行过。
