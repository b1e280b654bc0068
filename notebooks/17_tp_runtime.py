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
# # 17 · Tensor parallelism: ranks that talk
#
# **Goal.** Chapter 16 split the layers and checked the shards in one process. Now every rank
# becomes a real process that holds only its shards and its part of the KV cache, and the
# collectives of chapter 16 (`dist.all_reduce`, `dist.gather`) really cross process boundaries:
# **gloo** over local TCP sockets between CPU processes (any laptop), **NCCL** between GPUs (rank
# `r` on `cuda:r`). By the end of this chapter, `LLM(model, tensor_parallel_size=2)` gives the
# same greedy tokens as one process, we have measured how close the logits are, and the ranks
# survive Ctrl-C, stalls and crashes with a clear error.
#
# ## The idea: a driver, N ranks, two kinds of wires
#
# ```
#                 driver process (your Python: LLM, tokenizer, Scheduler)
#                   │  call = (name, args): pickled once, written to every rank's pipe
#        ┌──────────┴──────────┐            reply = ("ok", result) or ("error", traceback)
#        ▼                     ▼
#   rank 0 process        rank 1 process      each: ModelRunner with its shards + its KV heads
#   embed ─ all-reduce ─ embed                 ┐
#   o_proj ─ all-reduce ─ o_proj               │ collectives inside the forward
#   down_proj ─ all-reduce ─ down_proj         │ (gloo on CPU, NCCL on GPUs)
#   lm_head ◄── gather ── lm_head              ┘
#   sampler (rank 0 only) → token ids → driver
# ```
#
# Two kinds of wires, with different jobs. The **control channel** carries *what to do*: the
# scheduler's sequences for this step (a decode step ships one token per sequence, thanks to
# the slim pickling built below) and, back, the sampled token ids or an error. The **data plane**
# carries activations, inside the forward pass, between ranks only.
#
# **Where rank 0 lives.** Upstream nano-vllm runs rank 0 inside your process and spawns the
# others. We spawn *every* rank and keep your process as a pure **driver**, as vLLM's own
# multi-process executor does. Three reasons: (1) the driver never sits inside a collective, so
# when a rank dies or raises it always notices and can stop the rest (with NCCL, a collective
# whose peer is gone simply hangs); (2) your process never initializes `torch.distributed`,
# whose default group is one per process: two engines in one process, or a TP=1 engine next to a
# TP=2 one (this chapter compares them), just work; (3) a crash in a rank cannot take your
# Python session with it. The price is one extra process and one more hop for rank 0's tokens,
# tens of microseconds against a forward pass.
#
# **The control channel.** Three candidates:
#
# - **`SharedMemory` + `Event`s** (upstream): a fixed buffer (1 MiB) that a large batch
#   overflows; a fixed name (`"nanovllm"`) on which two engines collide; one-way, so a rank's
#   error never reaches the driver; and the segment outlives a crash in `/dev/shm`.
# - **`broadcast_object_list`** over a gloo group: no size limit, and a free port avoids
#   collisions; but it is one more *collective*: one-way and blocking, so a rank that failed
#   cannot say so, and a driver waiting in it hangs with everyone else.
# - **one `multiprocessing` Pipe per rank** (ours): no size limit (a length-prefixed stream),
#   nothing named at all, two-way (each rank replies to each call), and the OS closes the pipes
#   when a process ends.
#
# A pipe is a socket pair: nothing in `/dev/shm`, no name to collide on, messages of any size
# (the length is sent first), and it is two-way, so every call gets a reply: the rank-0 tokens,
# or a rank's error with its traceback. The driver waits on the pipes *and* on the processes'
# sentinels with `multiprocessing.connection.wait`, so a rank that dies without a word is
# noticed too. Writing a few kilobytes to a local socket costs microseconds; the shared-memory
# buffer saves little of that and brings every trap of the list.
#
# The rendezvous (how ranks find each other for gloo/NCCL) is a `TCPStore` that the driver
# opens on **port 0**: the OS picks a free port and the store holds it from that moment, so
# there is no fixed port to collide on and no race between "find a free port" and "bind it".

# %% [markdown] tags=["zh"]
# # 17 · 张量并行：相互通信的 rank
#
# **目标：** 第 16 章在一个进程里切分了各层并检查了分片。现在，每个 rank 都成为一个真正的进程，只持有自己的分片和
# 自己那部分 KV 缓存；第 16 章的集合通信（`dist.all_reduce`、`dist.gather`）真正跨越了进程边界：CPU 进程之间用
# **gloo**（走本机 TCP 套接字，任何笔记本都行），GPU 之间用 **NCCL**（rank `r` 使用 `cuda:r`）。读完本章，
# `LLM(model, tensor_parallel_size=2)` 会给出与单进程完全相同的贪心 token，我们还量出了 logits 有多接近，而且各 rank
# 能挺过 Ctrl-C、停滞和崩溃，并给出清楚的错误。
#
# ## 思路：一个驱动进程、N 个 rank、两种连线
#
# ```
#                 驱动进程（你的 Python：LLM、分词器、调度器）
#                   │  调用 = (名字, 参数)：只序列化一次，写进每个 rank 的管道
#        ┌──────────┴──────────┐            回复 = ("ok", 结果) 或 ("error", 调用栈)
#        ▼                     ▼
#   rank 0 进程            rank 1 进程         各自：带本 rank 分片和本 rank KV 头的 ModelRunner
#   embed ─ all-reduce ─ embed                 ┐
#   o_proj ─ all-reduce ─ o_proj               │ 前向计算中的集合通信
#   down_proj ─ all-reduce ─ down_proj         │ （CPU 上用 gloo，GPU 上用 NCCL）
#   lm_head ◄── gather ── lm_head              ┘
#   采样器（只在 rank 0）→ token id → 驱动进程
# ```
#
# 两种连线，各司其职。**控制通道**传递“做什么”：调度器本步的序列（得益于下面构建的精简序列化，decode 步每个序列
# 只传一个 token），以及回传的采样 token id 或错误。**数据面**在前向计算内部传递激活值，只在各 rank 之间流动。
#
# **rank 0 放在哪里：** 上游 nano-vllm 把 rank 0 放在你的进程里，只为其他 rank 创建子进程。我们为*每个* rank
# 都创建子进程，让你的进程只做**驱动**，vLLM 自己的多进程执行器也是这样做的。理由有三：（1）驱动进程从不卡在
# 集合通信里，所以任何 rank 崩溃或抛出异常，它都一定能察觉并停掉其余 rank（用 NCCL 时，对端已经消失的集合通信会
# 一直挂起）；（2）你的进程从不初始化 `torch.distributed`，而它的默认进程组每个进程只能有一个：同一进程里的两个
# 引擎，或者 TP=1 引擎与 TP=2 引擎并存（本章就要比较它们），都能正常工作；（3）rank 崩溃不会连带你的 Python 会话。
# 代价是多一个进程，以及 rank 0 的 token 多走一跳：相对一次前向计算，只是几十微秒。
#
# **控制通道：** 三个候选：
#
# - **`SharedMemory` + `Event`**（上游）：固定大小的缓冲区（1 MiB），大批次会把它撑爆；固定的名字
#   （`"nanovllm"`），两个引擎会在上面冲突；单向，所以 rank 的错误永远到不了驱动进程；崩溃之后，共享内存段还留在
#   `/dev/shm` 里。
# - 在 gloo 进程组上用 **`broadcast_object_list`**：没有大小上限，用空闲端口也能避免冲突；但它又是一个*集合通信*：
#   单向且阻塞，出错的 rank 没法告诉别人，在其中等待的驱动进程会和大家一起挂住。
# - **每个 rank 一条 `multiprocessing` 管道**（我们的选择）：没有大小上限（带长度前缀的字节流），没有任何命名的东西，
#   双向（每次调用每个 rank 都会回复），进程结束时操作系统自动关闭管道。
#
# 管道就是一对套接字：不占 `/dev/shm`，没有会冲突的名字，消息多大都行（先发送长度），而且是双向的，所以每次调用都有
# 回复：rank 0 的 token，或者某个 rank 的错误及其调用栈。驱动进程用 `multiprocessing.connection.wait` 同时等待
# 管道*和*各进程的哨兵（sentinel），所以一声不吭就退出的 rank 也会被发现。往本机套接字写几 KB 只要几微秒；
# 共享内存缓冲区省不了多少，却带来了上面列出的所有陷阱。
#
# 会合点（rank 之间为 gloo/NCCL 互相找到对方的地方）是驱动进程在 **0 号端口**上打开的一个 `TCPStore`：
# 操作系统挑一个空闲端口，从那一刻起就由它占住。所以没有会冲突的固定端口，也不存在“先找空闲端口、再去绑定”之间的竞争。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "pickled decode sequence: {size} bytes for {tokens} tokens":
        "pickle 后的 decode 序列：{tokens} 个 token 只占 {size} 字节",
    "two ranks up in {seconds:.1f} s; KV pool: {blocks} blocks":
        "两个 rank 在 {seconds:.1f} 秒内启动；KV 池：{blocks} 个块",
    "a second engine's ranks up in {seconds:.1f} s, forked by the same server (pid {server})":
        "第二个引擎的两个 rank 在 {seconds:.1f} 秒内启动，由同一个服务进程（pid {server}）fork 出来",
    "  rank {rank}/{size} pid {pid} {backend} on {device}, KV cache {shape}":
        "  rank {rank}/{size} pid {pid} {backend}，在 {device} 上，KV 缓存 {shape}",
    "rank {rank}: {name} {shape} (full: {full})": "rank {rank}：{name} {shape}（完整：{full}）",
    "{step:>7}: logits {shape}, scale {scale:.1f}, max |TP=1 - TP=2| = {gap:.1e}, "
    "smallest top-1/top-2 margin {margin:.3f}":
        "{step:>7}：logits {shape}，尺度 {scale:.1f}，max |TP=1 - TP=2| = {gap:.1e}，"
        "top-1 与 top-2 的最小差距 {margin:.3f}",
    "events in the TP=2 run: {seen}; generate took {tp2:.2f} s (TP=2) vs {tp1:.2f} s (TP=1)":
        "TP=2 运行中的事件：{seen}；generate 用时 {tp2:.2f} 秒（TP=2），对比 {tp1:.2f} 秒（TP=1）",
    "reported and cleaned up {seconds:.2f} s after the call": "调用后 {seconds:.2f} 秒报告了错误并清理完毕",
    "a later call: {error}": "之后的调用：{error}",
    "KeyboardInterrupt after {seconds:.2f} s; ranks alive: {alive}, engine idle: {idle}":
        "{seconds:.2f} 秒后 KeyboardInterrupt；rank 仍存活：{alive}，引擎空闲：{idle}",
    "and it serves again, with the same tokens": "之后它照常服务，token 不变",
    "after {seconds:.1f} s:": "{seconds:.1f} 秒后：",
    "NCCL ranks: {ranks}": "NCCL rank：{ranks}",
    "TP=2 over NCCL gives the same greedy tokens as one GPU": "NCCL 上的 TP=2 给出与单块 GPU 相同的贪心 token",
    "{count} CUDA device(s): the NCCL run needs two (the tests have it, marked gpu)":
        "{count} 个 CUDA 设备：NCCL 运行需要两个（测试套件有这项检查，标记为 gpu）",
    "objects + params every step": "每步发对象和参数",
    "tuples, params once": "发元组，参数只发一次",
    "{name}: driver {pack:.2f} ms, rank {unpack:.2f} ms, {size:.1f} KiB":
        "{name}：驱动进程 {pack:.2f} ms，rank {unpack:.2f} ms，{size:.1f} KiB",
    "nothing": "无",
    "step() {calls}: collected {kind} ({tokens} tokens), finished {finished}":
        "第 {calls} 次 step()：收取 {kind}（{tokens} 个 token），完成 {finished}",
    "{calls} calls of step(); the tokens equal TP = 1's": "调用了 {calls} 次 step()；token 与 TP = 1 的相同",
    "graphs captured: {graphs}, async scheduling: {asynchronous}": "已捕获的图：{graphs}，异步调度：{asynchronous}",
    "{count} CUDA device(s): graphs on every rank need two (the tests have it, marked gpu)":
        "{count} 个 CUDA 设备：在每个 rank 上捕获图需要两个（测试套件有这项检查，标记为 gpu）",
    "ranks {pids} are gone": "rank {pids} 都已退出",
    "decode message of a {length}-token sequence: {size} bytes, 1 token, {ids} block ids":
        "{length} 个 token 的序列的 decode 消息：{size} 字节，1 个 token，{ids} 个块编号",
    "all exercise answers check out": "练习答案全部验证通过",
    "{date}, {card}: {command}": "{date}，{card}：{command}",
    "  {size}: {rate:,} tok/s, a decode step {ms} ms": "  {size}：{rate:,} tok/s，一个 decode 步 {ms} ms",
    "median per decode step, ms": "每个 decode 步的中位数，ms",
    "one process, graphs": "单进程，CUDA Graph",
    "one process, eager": "单进程，eager",
    "one rank behind the channel": "控制通道之后的一个 rank",
    "device time of a step": "一步的设备时间",
    "host time to queue the step": "主机把这一步排进队列的时间",
    "driver: pickling the step": "驱动进程：序列化这一步",
    "rank: unpickling it": "rank：反序列化它",
    "rank: idle between two steps": "rank：两步之间的空闲",
    "tokens/s, whole run": "tokens/s，整个运行",
})

# %% [markdown] tags=["en"]
# ## Build it: what the ranks must agree on
#
# Two small functions join the layers' module. `agree_min` is the first collective of a rank's
# life: each rank sizes its KV pool from its own free memory (on GPUs the numbers differ, since
# other processes may use some of a GPU), but the scheduler has **one** block pool and its block
# ids index every rank's cache, so all ranks must take the smallest count. Upstream nano-vllm
# skips this; a rank with fewer blocks then writes past its cache. `share_from_rank0` gives every
# rank rank 0's sampled tokens on its device, without a host waiting for them; chapter 18's
# asynchronous engine needs that.
#
# Before any process starts, `Config` must refuse a rank count that does not divide the heads,
# the KV heads, the MLP width or the vocabulary: every rank needs an equal share. Chapter 09's
# `check_tensor_parallel_size` refused any count but 1; this one takes its place.

# %% [markdown] tags=["zh"]
# ## 动手：各 rank 必须达成一致的事
#
# 层的模块里新增两个小函数。`agree_min` 是 rank 一生中的第一次集合通信：每个 rank 按自己的空闲显存确定 KV 块池
# 的大小（GPU 上这些数字会不同，因为别的进程可能占用了某块 GPU 的一部分显存），但调度器只有**一个**块池，它的块号
# 要用来索引每个 rank 的缓存，所以所有 rank 必须取其中最小的块数。上游 nano-vllm 没有这一步；块数较少的 rank
# 就会写到缓存外面去。`share_from_rank0` 让每个 rank 在自己的设备上得到 rank 0 采样出的 token，不需要任何主机等待；
# 第 18 章的异步引擎需要它。
#
# 在任何进程启动之前，`Config` 必须拒绝不能整除注意力头数、KV 头数、MLP 宽度或词表大小的 rank 数：每个 rank 都要
# 分到同样多的一份。第 09 章的 `check_tensor_parallel_size` 拒绝 1 以外的一切 rank 数；这里的版本取代它。

# %% rank agreement
#| export layers.linear
import torch
import torch.distributed as dist


def agree_min(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest `value` over the tensor-parallel ranks (the value itself in one process)."""
    # zh: `value` 在各张量并行 rank 上的最小值（单个进程时就是这个值本身）。
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    # en: NCCL reduces only GPU tensors, gloo only CPU tensors: the tensor lives on the rank's device.
    # zh: NCCL 只能归约 GPU 张量，gloo 只能归约 CPU 张量：所以张量放在本 rank 的设备上。
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def share_from_rank0(values: torch.Tensor | None, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank 0's `count` int64 values on every rank (rank 0 passes them, the others None); no host wait."""
    # zh: 在每个 rank 上得到 rank 0 的 `count` 个 int64 值（rank 0 传入它们，其他 rank 传 None）；主机不等待。
    if values is None:
        values = torch.empty(count, dtype=torch.int64, device=device)
    if count and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # en: Queued on the device like the forward: the host of no rank waits for it.
        # zh: 和前向计算一样排进设备队列：没有哪个 rank 的主机要等它。
        dist.broadcast(values, src=0)
    return values

# %% rank count
#| export config
import nanovllm.config as config_module
from nanovllm.book.literate import add_to_class

# en: The model's dimensions that tensor parallelism splits (a mixture of experts also splits each expert's width).
# zh: 张量并行要切分的模型维度（混合专家模型还要切分每个专家的宽度）。
TP_DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "moe_intermediate_size")


@add_to_class(config_module)
def check_tensor_parallel_size(hf_config: object, tp_size: int) -> None:
    """Refuse a tensor-parallel size that does not split every sharded dimension of the model evenly."""
    # zh: 拒绝不能把模型每个切分维度都均分的张量并行大小。
    for name in TP_DIVIDED:
        value = getattr(hf_config, name, None)
        if name == "num_key_value_heads" and value is None:
            value = getattr(hf_config, "num_attention_heads", None)
        if isinstance(value, int) and value % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide {name}={value}: every rank needs an equal "
                f"share; use a divisor of {value}"
            )

# %% [markdown] tags=["en"]
# The runner's share: chapter 09's hook `agreed_block_count` now takes the smallest count over the ranks.

# %% [markdown] tags=["zh"]
# 执行器的部分：第 09 章的接缝 `agreed_block_count` 现在取所有 rank 中最小的块数。

# %% runner agrees on the pool
#| export engine.model_runner
from nanovllm.book.literate import add_to_class
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.layers.linear import agree_min


@add_to_class(ModelRunner)
def agreed_block_count(self, count: int) -> int:
    """The smallest block count over the ranks, since the scheduler's one pool indexes every rank's cache."""
    # zh: 各 rank 块数中的最小值，因为调度器的那一个块池要索引每个 rank 的缓存。
    return agree_min(count, self.device)

# %% [markdown] tags=["en"]
# ## Build it: a sequence on the wire
#
# Rank 0's scheduler lives in the driver; every step's sequences cross the control channel to
# every rank. Pickling a whole sequence each step would cost time that grows with its length, so
# `Sequence` now pickles *slim*: only the tokens whose KV is not cached yet travel (for a decode
# step, just the last token), with the counters and the block table. The block size travels too:
# a rank must never guess it from a default. That is upstream's bug: its `Sequence.block_size` is
# a class attribute that `LLMEngine` sets in the driver process, which a rank process, importing
# the module afresh, never sets, so a model configured with another block size computes wrong
# slots on every rank but 0.
#
# A slim copy does not hold the tokens before its first uncached one, so it remembers where its
# `token_ids` start (`first_token_index`), and `scheduled_token_ids` counts from there. The
# sampling parameters stay behind: only rank 0 samples, and it receives them once per sequence.
# `copy.copy` and `copy.deepcopy` still make whole copies.

# %% [markdown] tags=["zh"]
# ## 动手：线路上的序列
#
# rank 0 的调度器在驱动进程里；每一步的序列都要经控制通道发给每个 rank。如果每步都序列化整个序列，耗时会随序列长度
# 增长；所以 `Sequence` 现在采用*精简*序列化：只传送 KV 尚未缓存的 token（decode 步只传最后一个 token），外加计数器和
# 块表。块大小也一起传送：rank 绝不能从某个默认值去猜它。上游的 bug 正在于此：它的 `Sequence.block_size` 是由
# `LLMEngine` 在驱动进程里设置的类属性，而 rank 进程重新导入模块时从不设置它，于是换了块大小的模型在除 0 以外的每个
# rank 上都会算错槽位。
#
# 精简副本不含第一个未缓存 token 之前的 token，所以它记住自己的 `token_ids` 从哪里开始（`first_token_index`），
# `scheduled_token_ids` 也从那里算起。采样参数不随序列传送：只有 rank 0 采样，每个序列的参数只发给它一次。
# `copy.copy` 和 `copy.deepcopy` 仍然做完整拷贝。

# %% sequence on the wire
#| export engine.sequence
import copy
import operator

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.sequence import Sequence

# en: What a sequence ships to a rank process, followed by its uncached tokens.
# zh: 序列传送给 rank 进程的字段，后面再跟上它尚未缓存的 token。
SHIPPED_FIELDS = ("seq_id", "_status", "block_size", "num_tokens", "num_prompt_tokens", "num_cached_tokens",
                  "num_scheduled_tokens", "block_table", "request_id", "sample_index", "pending_forks",
                  "blocks_to_copy")
_shipped = operator.attrgetter(*SHIPPED_FIELDS)


@add_to_init(Sequence)
def _init_first_token_index(self) -> None:
    # en: Index of token_ids[0] in the whole sequence: 0, except in a slim copy that a rank unpickled.
    # zh: token_ids[0] 在整个序列中的下标：除了 rank 反序列化得到的精简副本，都是 0。
    self.first_token_index = 0


@add_to_class(Sequence)
@property
def scheduled_token_ids(self) -> list[int]:
    """The tokens this step computes: ``num_scheduled_tokens`` of them after the cached ones."""
    # zh: 这一步计算的 token：缓存的 token 之后的 ``num_scheduled_tokens`` 个。
    start = self.num_cached_tokens - self.first_token_index
    return self.token_ids[start : start + self.num_scheduled_tokens]


@add_to_class(Sequence)
def __getstate__(self) -> tuple:
    # en: Only tokens whose KV is not cached yet travel: during decode that is the
    # en: last token alone, whatever the length of the sequence.
    # zh: 只传送 KV 尚未缓存的 token：decode 时只有最后一个 token，与序列长度无关。
    return (*_shipped(self), self.token_ids[self.num_cached_tokens - self.first_token_index :])


@add_to_class(Sequence)
def __setstate__(self, state: tuple) -> None:
    *fields, self.token_ids = state
    self.__dict__.update(zip(SHIPPED_FIELDS, fields, strict=True))
    self.first_token_index = self.num_cached_tokens
    # en: Sampling happens on rank 0 only, which receives the parameters separately.
    # zh: 只有 rank 0 做采样，它另外收到采样参数。
    self.sampling_params = None


@add_to_class(Sequence)
def __copy__(self) -> Sequence:
    # en: copy.copy and copy.deepcopy would otherwise go through the slim pickling state.
    # zh: 否则 copy.copy 和 copy.deepcopy 会走精简的序列化状态。
    clone = Sequence.__new__(Sequence)
    clone.__dict__.update(self.__dict__)
    clone.token_ids = list(self.token_ids)
    clone.block_table = list(self.block_table)
    clone.blocks_to_copy = list(self.blocks_to_copy)
    return clone


@add_to_class(Sequence)
def __deepcopy__(self, memo: dict) -> Sequence:
    return copy.copy(self)

# %%
import pickle

long_seq = Sequence(list(range(5000)), block_size=16)
long_seq.block_table = list(range(313))
# en: decoding: everything but the last token is cached
# zh: decode 中：除最后一个 token 外都已缓存。
long_seq.num_cached_tokens = 4999
long_seq.num_scheduled_tokens = 1
wire = pickle.dumps(long_seq)
worker_copy = pickle.loads(wire)
print(say("pickled decode sequence: {size} bytes for {tokens} tokens", size=len(wire), tokens=len(long_seq)))
assert worker_copy.token_ids == [4999] and worker_copy.scheduled_token_ids == [4999]
assert worker_copy.block_size == 16 and worker_copy.block_table == long_seq.block_table
assert worker_copy.num_tokens == 5000 and worker_copy.sampling_params is None
assert len(pickle.dumps(long_seq)) < len(pickle.dumps(long_seq.token_ids)) / 5
assert copy.deepcopy(long_seq).token_ids == long_seq.token_ids

# %% [markdown] tags=["en"]
# ## Build it: one rank's life
#
# A rank process starts, joins the group (`init_rank`), builds its `ModelRunner` — the same class
# as chapter 09: the layers read their rank from `torch.distributed`, load their slices, and the
# KV pool is sized with `agree_min` — and replies with its block count. Then it loops: read a
# call from its pipe, run it, reply. The calls a driver may make are the methods of
# `RankWorker`, by name; nothing else is reachable.
#
# Three details carry the upstream traps:
#
# - **Block size travels with the sequences.** A slim `Sequence` (built above) carries its
#   `block_size` in the pickle: there is no class default to fall back on. (Every sequence is
#   made with `Config.kvcache_block_size`, and the scheduler asserts it once, in `add`.)
# - **Sampling parameters go to rank 0 only**: slim pickling drops them (the other ranks never
#   sample), so the driver appends them to rank 0's message.
# - **On an error, report and leave at once.** The rank sends its traceback, then `os._exit(1)`:
#   no clean-up that could block, since its peers may be waiting in a collective for it. A thread
#   watches the driver: if the driver dies, the rank exits too (no orphans, even when stuck in a
#   collective). `NANOVLLM_TP_FAULT="rank:call"` is a test hook that makes one rank raise on its
#   n-th call (0: during start-up), so that this path is tested, not hoped for.
#
# Four more serve speed and robustness (the section "Making it pay" below says why):
#
# - **A step arrives as plain tuples.** The driver ships each sequence's slim state, exactly what
#   `Sequence.__getstate__` returns (the one place that decides what travels: chapter 05's
#   copy-on-write pairs and fork counts come along by themselves), but as tuples, which pickle
#   faster than objects (measured: 2.7× on the driver, 1.5× on a rank); `step_sequences` rebuilds
#   the slim `Sequence`s. Sampling
#   parameters reach rank 0 once per sequence, not at every step.
# - **Replies come from a thread, in call order.** Rank 0's reply to a step is its tokens, which
#   means waiting for the device; a `Replier` thread does that waiting (`reply_value`), so the
#   main thread is already receiving the next call. The other ranks reply at once. Chapter 18's
#   asynchronous engine relies on it: there, the driver queues step *n + 1* on every rank before
#   it collects step *n*, and each rank keeps its last steps' samples to feed the pending tokens
#   of the next one.
# - **Ctrl-C is the driver's business.** A terminal sends Ctrl-C (SIGINT) to every process of
#   the group; the ranks ignore it, so that an interrupted `generate` leaves them serving.

# %% [markdown] tags=["zh"]
# ## 动手：一个 rank 的一生
#
# rank 进程启动后加入进程组（`init_rank`），构建自己的 `ModelRunner`——与第 09 章是同一个类：各层从
# `torch.distributed` 读到自己的 rank 并加载自己那一片，KV 块池的大小经过 `agree_min` 确定——然后回复自己的块数。
# 接着进入循环：从管道读一个调用，执行，回复。驱动进程能调用的就是 `RankWorker` 的那几个方法（按名字），别的都碰不到。
#
# 上游的几个陷阱落在三个细节上：
#
# - **块大小随序列一起传递。** 精简的 `Sequence`（上面构建的）在序列化数据里带着 `block_size`：根本没有可以退回的
#   类默认值。（每个序列都用 `Config.kvcache_block_size` 创建，调度器只在 `add` 里断言一次。）
# - **采样参数只发给 rank 0**：精简序列化会丢掉它们（其他 rank 从不采样），所以驱动进程把它们附在发给
#   rank 0 的消息后面。
# - **出错时，报告后立刻离开。** rank 先发出自己的调用栈，然后 `os._exit(1)`：不做任何可能阻塞的清理，因为对端
#   也许正在某个集合通信里等它。另有一个线程盯着驱动进程：驱动进程一死，rank 也随之退出（即使卡在集合通信里也不会
#   变成孤儿进程）。`NANOVLLM_TP_FAULT="rank:call"` 是一个测试钩子，让某个 rank 在第 n 次调用时抛出异常
#   （0 表示在启动阶段），这样这条路径是被测试过的，而不是靠运气。
#
# 另外几处是为了速度和稳健（下文“让它划算”一节说明原因）：
#
# - **一步以普通元组的形式到达。** 驱动进程为每个序列发送它的精简状态，正是 `Sequence.__getstate__` 返回的内容
#   （决定传什么的唯一地方：第 05 章的写时复制块对、分叉计数都会自动跟过来），只不过是元组，序列化起来比对象快
#   （实测：驱动进程上 2.7 倍，rank 上 1.5 倍）；`step_sequences` 再把精简的 `Sequence` 重建出来。采样参数每个序列
#   只发给 rank 0 一次，而不是每步都发。
# - **回复由一个线程按调用顺序发出。** rank 0 对一步的回复就是它的 token，也就意味着要等设备算完；这件事由
#   `Replier` 线程去等（`reply_value`），于是主线程已经在接收下一次调用了。其他 rank 立即回复。第 18 章的异步引擎
#   依赖这一点：在那里，驱动进程先把第 *n + 1* 步排给每个 rank，再收取第 *n* 步；每个 rank 保存最近几步的采样结果，
#   用来填入下一步的待定 token。
# - **Ctrl-C 是驱动进程的事。** 终端会把 Ctrl-C（SIGINT）发给进程组里的每个进程；各 rank 忽略它，这样被打断的
#   `generate` 不会连累它们，它们照常服务。

# %% rank side
#| export engine.tp_runtime
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.linear import tp_world
from nanovllm.sampling_params import SamplingParams

# en: Test hook: "rank:call" makes that rank raise on its call-th call after start-up (0: during start-up).
# zh: 测试钩子："rank:call" 让该 rank 在启动后的第 call 次调用时抛出异常（0 表示在启动阶段）。
FAULT_ENV = "NANOVLLM_TP_FAULT"
STORE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class RankFailure:
    """What a rank reports when it fails: where, what, its traceback, and when (to find the first)."""
    # zh: rank 失败时报告的内容：在哪里、是什么、它的调用栈，以及什么时候（用来找出第一个）。

    rank: int
    call: str
    error: str
    traceback: str
    when: float


def parse_fault(value: str | None, world_size: int) -> tuple[int, int] | None:
    """Read the NANOVLLM_TP_FAULT test hook: "rank:call" -> (rank, call), or None when unset."""
    # zh: 读取测试钩子 NANOVLLM_TP_FAULT："rank:call" -> (rank, call)，未设置时为 None。
    if not value:
        return None
    try:
        rank, call = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f'{FAULT_ENV} must look like "rank:call" (two integers), got {value!r}') from None
    if not 0 <= rank < world_size or call < 0:
        raise ValueError(f"{FAULT_ENV}={value!r}: need 0 <= rank < {world_size} and call >= 0")
    return rank, call


def backend_for(device: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    # zh: GPU 之间用 NCCL，CPU 进程之间用 gloo。
    return "nccl" if device == "cuda" else "gloo"


def init_rank(
    rank: int, world_size: int, device: str, store_port: int, store_host: str = "127.0.0.1", nnodes: int = 1
) -> None:
    """Join the driver's rendezvous store and initialize torch.distributed for this rank. Ranks are numbered
    node by node (``nnodes`` machines, one by default), so rank r of a node that runs k ranks takes GPU r % k."""
    # zh: 加入驱动进程的会合点存储，并为本 rank 初始化 torch.distributed。rank 按节点依次编号（共 ``nnodes`` 台机器，
    # zh: 默认一台），所以在运行 k 个 rank 的节点上，rank r 使用该节点的第 r % k 块 GPU。
    here = world_size // nnodes
    if device == "cuda":
        # en: NVLink SHARP (NVLS) is off unless the user asked for it: it needs fabric setup many hosts lack.
        # zh: 除非用户明确要求，否则关闭 NVLink SHARP（NVLS）：它需要很多机器上没有的 fabric 配置。
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank % here)
    else:
        # en: Ranks share the CPU: each takes its share of the cores instead of all of them.
        # zh: 各 rank 共用 CPU：每个只取自己那份核数，而不是全部。
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // here))
    store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size)


def step_states(seqs: list[Sequence]) -> list[tuple]:
    """What a step ships of each sequence: its slim state, as `Sequence.__getstate__` defines it (the one
    place that says what travels), as plain tuples, without the pickle protocol's per-object work."""
    # zh: 一步为每个序列传送的内容：它的精简状态，由 `Sequence.__getstate__` 定义（规定什么要传送的唯一地方），
    # zh: 以普通元组的形式，省掉 pickle 协议对每个对象的开销。
    return [seq.__getstate__() for seq in seqs]


def step_sequences(states: list[tuple]) -> list[Sequence]:
    """The rank's slim copies of a step's sequences, rebuilt from `step_states`."""
    # zh: rank 上一步各序列的精简副本，由 `step_states` 重建。
    seqs = []
    for state in states:
        seq = Sequence.__new__(Sequence)
        seq.__setstate__(state)
        seqs.append(seq)
    return seqs


class RankWorker:
    """One rank's side of the control channel: the calls a driver may make, by name."""
    # zh: 控制通道在一个 rank 这一侧：驱动进程可以按名字发起的调用。

    CALLS = ("run", "logits", "world", "shard", "kv_cache_shape", "echo")

    def __init__(self, config: Config) -> None:
        self.runner = ModelRunner(config)
        self.rank = tp_world()[0]
        # en: set by rank_main before each call; the driver numbers its calls the same way
        # zh: 由 rank_main 在每次调用前设置；驱动进程也用同样的方式给调用编号。
        self.call_no = 0
        # en: rank 0: each running sequence's, sent once
        # zh: rank 0 持有：每个运行中序列的采样参数，只发送一次。
        self.params: dict[int, SamplingParams] = {}

    def run(
        self, states: list[tuple], is_prefill: bool, params: tuple[dict[int, SamplingParams], list[int]] | None = None
    ) -> list[int] | None:
        """One step; rank 0 (which receives the sampling params) returns its tokens, the others None.

        ``states``: the step's sequences (`step_states`). ``params`` (rank 0 only): the sampling params of
        new sequences, and the ids of finished ones to forget.
        """
        # zh: 一步；rank 0（它收到采样参数）返回它的 token，其他 rank 返回 None。
        # zh:
        # zh: ``states``：这一步的序列（`step_states`）。``params``（只有 rank 0）：新序列的采样参数，
        # zh: 以及要忘掉的已结束序列的 id。
        return self.runner.run(self._sequences(states, params), is_prefill)

    def _sequences(
        self, states: list[tuple], params: tuple[dict[int, SamplingParams], list[int]] | None
    ) -> list[Sequence]:
        """The step's sequences, rebuilt from their slim states; on rank 0 with their sampling params."""
        # zh: 这一步的序列，由它们的精简状态重建；在 rank 0 上还带着它们的采样参数。
        seqs = step_sequences(states)
        if params is not None:
            new, gone = params
            self.params.update(new)
            for seq_id in gone:
                self.params.pop(seq_id, None)
            for seq in seqs:
                seq.sampling_params = self.params[seq.seq_id]
        return seqs

    def logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor | None:
        """The step's logits on rank 0 (float32, CPU), None elsewhere; nothing is sampled."""
        # zh: rank 0 上这一步的 logits（float32，CPU），其他 rank 上为 None；不做采样。
        logits = self.runner.compute_logits(seqs, is_prefill)
        return None if logits is None else logits.float().cpu()

    def world(self) -> dict[str, Any]:
        return {"rank": dist.get_rank(), "size": dist.get_world_size(), "backend": dist.get_backend(),
                # en: cuda:<rank> on GPUs; the parent is the driver, or the agent of the rank's node
                # zh: GPU 上是 cuda:<rank>；父进程是驱动进程，或者是该 rank 所在节点的代理进程。
                "pid": os.getpid(), "parent": os.getppid(), "device": str(self.runner.kv_cache.device),
                "graphs": self.runner.graphs is not None, "params_held": len(self.params)}

    def shard(self, name: str) -> torch.Tensor:
        """This rank's slice of a parameter, by its name in the model."""
        # zh: 本 rank 持有的某个参数的那一片，按它在模型中的名字查找。
        return self.runner.model.get_parameter(name).detach().cpu().clone()

    def kv_cache_shape(self) -> tuple[int, ...]:
        return tuple(self.runner.kv_cache.shape)

    def echo(self, payload: bytes) -> tuple[int, int]:
        """Length and CRC-32 of what arrived: checks that a large message crosses the channel intact."""
        # zh: 收到的内容的长度和 CRC-32：检查一条大消息完好无损地穿过了通道。
        return len(payload), zlib.crc32(payload)


def _exit_with_parent() -> None:
    """Exit when the driver dies, even while this rank is stuck in a collective."""
    # zh: 驱动进程死掉时退出，即使本 rank 正卡在一次集合通信里。
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="nanovllm-watch-driver", daemon=True).start()


def _send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def reply_value(result: Any) -> Any:
    """What a call's reply carries: its result, as it is."""
    # zh: 一次调用的回复所携带的东西：它的结果，原样不变。
    return result


class Replier:
    """A rank's replies, sent in call order by a thread: waiting for a step's tokens never keeps the main
    thread from receiving and queueing the next step."""
    # zh: 一个 rank 的回复，由一个线程按调用顺序发出：等待一步的 token 时，主线程照样能接收并排队下一步。

    def __init__(self, conn: Connection, fail: Callable[[BaseException, str], None]) -> None:
        self.conn, self.fail = conn, fail
        self.device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
        # en: one writer at a time: this thread, or the main thread's error report
        # zh: 一次只有一个写入者：这个线程，或主线程的错误报告。
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="nanovllm-replies", daemon=True).start()

    def put(self, where: str, result: Any) -> None:
        self.queue.put((where, result))

    def send(self, message: tuple) -> None:
        with self.lock:
            _send(self.conn, message)

    def _loop(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # en: a new thread starts on device 0, not on this rank's
            # zh: 新线程默认在设备 0 上，而不是本 rank 的设备上。
            torch.cuda.set_device(self.device)
        while True:
            where, result = self.queue.get()
            try:
                self.send(("ok", reply_value(result)))
            except BaseException as error:
                self.fail(error, where)


def rank_main(
    rank: int, world_size: int, config: Config, store_port: int, conn: Connection,
    environ: dict[str, str] | None = None,
) -> None:
    """The body of one rank process: start up, then answer calls until "exit" (or the driver is gone). ``environ``:
    the driver's environment, which replaces this process's (None: keep it)."""
    # zh: 一个 rank 进程的主体：启动，然后应答各个调用，直到 "exit"（或者驱动进程不在了）。``environ``：驱动进程的
    # zh: 环境变量，用来替换本进程的（None：保留本进程的）。
    if environ is not None:
        # en: The forkserver (`rank_processes`) forked this process with the environment it started with: take the
        # en: driver's, as a fresh interpreter would have it (a fault hook, NCCL's settings, CUDA_VISIBLE_DEVICES).
        # zh: forkserver（`rank_processes`）fork 出本进程时，给的是它自己启动时的环境变量：换成驱动进程的，和全新
        # zh: 解释器拿到的一样（故障钩子、NCCL 的设置、CUDA_VISIBLE_DEVICES）。
        os.environ.clear()
        os.environ.update(environ)
    # en: Ctrl-C in a terminal reaches every process of the group; it is the driver's to handle.
    # zh: 终端里的 Ctrl-C 会发给进程组里的每个进程；处理它是驱动进程的事。
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    call, count = "start-up", 0
    send_lock = threading.Lock()

    def fail(error: BaseException, where: str) -> None:
        failure = RankFailure(rank, where, f"{type(error).__name__}: {error}", traceback.format_exc(), time.time())
        # en: Report and leave at once; no clean-up that could block: the peers may wait for us in a collective.
        # zh: 报告后立即离开；不做任何可能阻塞的清理：对端也许正在某个集合通信里等我们。
        with contextlib.suppress(Exception):
            if send_lock.acquire(timeout=1.0):
                _send(conn, ("error", failure))
        os._exit(1)

    try:
        fault = parse_fault(os.environ.get(FAULT_ENV), world_size)
        if fault == (rank, 0):
            raise RuntimeError(f"injected fault: {FAULT_ENV}={rank}:0 makes rank {rank} fail during start-up")
        init_rank(rank, world_size, config.device, store_port, config.master_addr, config.nnodes)
        worker = RankWorker(config)
        replier = Replier(conn, fail)
        send_lock = replier.lock
        replier.send(("ok", config.num_kvcache_blocks))
        while True:
            try:
                call, extra = pickle.loads(conn.recv_bytes())
                if call == "exit":
                    return
                args = pickle.loads(conn.recv_bytes())
            except EOFError:
                # en: the driver closed its end: nothing left to do
                # zh: 驱动进程关闭了它那一端：没有别的事可做了。
                return
            count += 1
            if fault == (rank, count):
                raise RuntimeError(f"injected fault: {FAULT_ENV}={rank}:{count} makes rank {rank} fail on call {count}")
            if call not in RankWorker.CALLS:
                raise ValueError(f"unknown call {call!r}; a rank answers {', '.join(RankWorker.CALLS)}")
            if extra is not None:
                args = (*args, pickle.loads(extra))
            worker.call_no = count
            replier.put(f"{call} (call {count})", getattr(worker, call)(*args))
    except BaseException as error:
        fail(error, f"{call} (call {count})" if count else call)
    # en: reached on a normal return only (os._exit skips it)
    # zh: 只有正常返回时才会走到这里（os._exit 会跳过它）。
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

# %% [markdown] tags=["en"]
# ## Build it: the driver
#
# `TPRunner` has the interface of chapter 09's `ModelRunner` — `run(seqs, is_prefill)` returns
# one token per sequence, `config.num_kvcache_blocks` is set when it is built, `exit()` — so the
# engine (chapter 10) uses one or the other, and nothing else changes. (Chapter 18 gives both the
# `launch` of asynchronous scheduling.)
#
# - A call has two halves. `post(name, *args)` pickles the arguments **once**, writes them to
#   every rank and returns the call's number; `collect(number)` waits for every rank's reply to
#   it. Each rank answers its calls in order, so the k-th reply of a rank is the answer to call
#   k, and a reply may be read long after it arrived. `call` is the two back to back;
#   chapter 18 posts a step and collects it one step later.
# - While waiting, `collect` also watches each process's sentinel. The first failure starts a
#   short grace period (the other ranks' reports follow: with gloo, a peer's disappearance makes
#   their collectives fail), then every rank is stopped and `TPWorkerError` names the *first*
#   failure (by the rank's own clock; a rank that vanished without a word comes first) with its
#   traceback. The runner is then closed: any later call says why — an error, or `exit()` when that
#   is what happened.
# - A rank that neither answers nor dies (stopped by SIGSTOP or a debugger, stuck in a loop) is
#   caught by a deadline: `rank_timeout_s` (a `Config` setting, 120 s by default) after a call
#   was written. `collect` then names the rank that holds the others up — a stopped process if
#   there is one (the kernel says so in `/proc`), else a rank other than 0 that did not answer (its
#   reply needs only its host, while rank 0's waits for the device, which waits for every peer) —
#   stops every rank and raises `TPTimeoutError`.
# - Ctrl-C may arrive at any moment. Writing a message or reading one is done under
#   `deferred_interrupt`, which holds the signal back until the message is whole, so the pipes
#   never carry half a message; waiting can be interrupted. Nothing else needs undoing: the ranks
#   compute the interrupted step anyway, and its reply is read, and dropped, before the next one.
#   (Its handler, `_hold`, keeps the signal; three hooks that do nothing here, `_let_through`,
#   `enter_nested` and `exit_nested`, let chapter 20 open a way through for the model's work.)
# - Stopping is one function, `stop_ranks`, registered with `weakref.finalize`: it runs on
#   `exit()`, when the runner is garbage-collected, and at interpreter exit, whichever comes
#   first, exactly once. A normal stop asks the ranks to leave and waits for them; after an
#   error it terminates them at once (one may be stuck in a collective), then kills what is left.
# - Ranks come from multiprocessing's **forkserver**: a fresh interpreter, started from the driver
#   once, imports the engine (torch, transformers: about 2.5 s of CPU) and then forks each rank. A
#   rank gets no copy of the driver's threads or CUDA state (forking a process that has touched
#   CUDA is undefined; the server never touches it), and an engine's start costs a fork per rank,
#   not an interpreter's imports per rank. The server keeps the environment it was started with, so
#   each rank takes the driver's as it is at the engine's start.

# %% [markdown] tags=["zh"]
# ## 动手：驱动端
#
# `TPRunner` 的接口与第 09 章的 `ModelRunner` 相同——`run(seqs, is_prefill)` 为每个序列返回一个 token，构建时设置
# `config.num_kvcache_blocks`，还有 `exit()`——所以引擎（第 10 章）用这个或那个都行，别的什么都不用改。（第 18 章给
# 二者都加上异步调度所用的 `launch`。）
#
# - 一次调用分两半。`post(name, *args)` 只把参数序列化**一次**，写给每个 rank，并返回这次调用的编号；
#   `collect(编号)` 等待每个 rank 对它的回复。每个 rank 按顺序回答调用，所以某个 rank 的第 k 个回复就是对第 k 次
#   调用的回答，回复到达之后可以过很久再读。`call` 就是二者紧接着调用；
#   第 18 章发出一步，隔一步再收取。
# - 等待期间，`collect` 还盯着每个进程的哨兵。第一个失败出现后，会再给一小段宽限时间（其他 rank 的报告随后就到：
#   用 gloo 时，对端消失会让它们的集合通信失败），然后停掉所有 rank，并抛出 `TPWorkerError`，指明*最早*的那个失败
#   （按出错 rank 自己的时钟；一声不吭就消失的 rank 排在最前）及其调用栈。此后执行器即告关闭：之后的任何调用都会
#   说明原因——出了错，或者确实调用了 `exit()`。
# - 既不回答也没有退出的 rank（被 SIGSTOP 或调试器暂停、卡在某个循环里）由一个期限抓住：调用写出后
#   `rank_timeout_s` 秒（`Config` 的一个设置，默认 120 s）。这时 `collect` 会指出拖住大家的那个 rank——如果有被暂停
#   的进程，就是它（内核在 `/proc` 里写着）；否则就是某个没有回答的非 0 号 rank（它的回复只需要它自己的主机，而
#   rank 0 的回复要等设备，设备又要等所有对端）——然后停掉所有 rank，抛出 `TPTimeoutError`。
# - Ctrl-C 随时可能到来。写一条消息或读一条消息都在 `deferred_interrupt` 之下进行，它把信号压到消息完整为止，
#   所以管道里绝不会出现半条消息；等待则可以被打断。别的都不需要撤销：被打断的那一步各 rank 照样会算完，它的回复
#   会在下一次调用之前被读出并丢弃。（它的处理函数 `_hold` 把信号留住；三个在这里什么也不做的接缝 `_let_through`、
#   `enter_nested` 和 `exit_nested`，让第 20 章为模型的计算开一条通路。）
# - 停止只由一个函数 `stop_ranks` 负责，它通过 `weakref.finalize` 注册：调用 `exit()` 时、执行器被垃圾回收时、
#   解释器退出时，以最先发生者为准，恰好运行一次。正常停止时请各 rank 自行退出并等待它们；出错后则立即终止它们
#   （某个 rank 可能卡在集合通信里），剩下的再强制杀掉。
# - rank 来自 multiprocessing 的 **forkserver**：驱动进程只启动一次的一个全新解释器，先导入引擎（torch、
#   transformers：约 2.5 s 的 CPU），再为每个 rank fork 一次。rank 不会复制驱动进程的线程或 CUDA 状态（对已经用过
#   CUDA 的进程做 fork，行为是未定义的；这个服务进程从不碰 CUDA），一次引擎启动的代价是每个 rank 一次 fork，而不是
#   每个 rank 一个解释器的导入。服务进程保留的是它启动时的环境变量，所以每个 rank 都换成驱动进程在引擎启动那一刻的
#   环境变量。

# %% setting: rank timeout
#| export config
from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.config import Config


# en: Tensor parallelism: seconds to wait for a rank's reply to a call before naming the stalled rank and stopping
# en: them all.
# zh: 张量并行：等待某个 rank 回复一次调用的秒数，超时就指出停滞的 rank 并停掉所有 rank。
@add_fields(Config)
class _RankTimeout:
    rank_timeout_s: float = 120.0


@add_to_init(Config)
def _check_rank_timeout(self) -> None:
    self._check("rank_timeout_s", float, lambda x: x > 0, "> 0")

# %% holding ctrl-c
#| export utils.interrupts
from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

# en: The handler that the outermost open `deferred_interrupt` block replaced, and the Ctrl-Cs it
# en: held back. Only the main thread receives signals, so only it touches these.
# zh: 最外层尚未结束的 `deferred_interrupt` 块替换掉的处理函数，以及它压下的 Ctrl-C。
# zh: 只有主线程会收到信号，所以也只有主线程会碰这两个列表。
_replaced: list[Any] = []
_held: list[FrameType | None] = []


def _hold(signum: int, frame: FrameType | None) -> None:
    _held.append(frame)
    _let_through()


def _let_through() -> None:
    """Deliver the Ctrl-C just held back, if a block has opened the way for it: none has, here."""
    # zh: 如果某个块已经为刚才被压下的 Ctrl-C 让开了路，就送达它：这里没有。


def deferred_interrupt() -> Deferral:
    """Hold back Ctrl-C (SIGINT) for the duration of a ``with`` block, then deliver it. A block inside a block
    that already holds it back changes nothing: the outermost one delivers."""
    # zh: 在 ``with`` 块期间压下 Ctrl-C（SIGINT），结束后再送达。嵌在一个已经压下它的块里面的块什么也不改变：
    # zh: 由最外层的块送达。
    return Deferral()


class Deferral:
    """The context manager of `deferred_interrupt`. A class, not a generator: a generator-based one that an
    exception leaves suspended runs its ``finally`` whenever it is garbage-collected, long after its block."""
    # zh: `deferred_interrupt` 的上下文管理器。用类而不用生成器：基于生成器的上下文管理器如果被异常挂起，
    # zh: 它的 ``finally`` 会在被垃圾回收时才运行，那时早已离开它的块了。

    def __enter__(self) -> None:
        # en: Signals reach the main thread only; and an enclosing block may hold them already.
        # zh: 信号只会送到主线程；外层的块也可能已经压住了它们。
        main = threading.current_thread() is threading.main_thread()
        self.outermost = main and signal.getsignal(signal.SIGINT) is not _hold
        if self.outermost:
            # en: left from an earlier block, whose exit raised another Ctrl-C instead
            # zh: 之前某个块遗留下来的：那个块退出时改为抛出了另一个 Ctrl-C。
            _held.clear()
            # en: The entry is recorded before the handler goes in (the mirror of `__exit__`): a signal handler that
            # en: lands in between and calls the engine finds the old handler with an entry, or _hold with one,
            # en: never _hold without one.
            # zh: 先记下条目，再装上处理函数（与 `__exit__` 的顺序相反）：夹在两者之间落下、又调用引擎的信号处理函数，
            # zh: 看到的要么是带着条目的旧处理函数，要么是带着条目的 _hold，绝不会是没有条目的 _hold。
            depth = len(_replaced)
            try:
                _replaced.append(signal.getsignal(signal.SIGINT))
                signal.signal(signal.SIGINT, _hold)
            # en: A Ctrl-C that the old handler raised before _hold was in: the block never began, so its entry goes.
            # zh: 在 _hold 装上之前、由旧处理函数抛出的 Ctrl-C：这个块根本没开始，所以它的条目要撤掉。
            except BaseException:
                del _replaced[depth:]
                raise
        else:
            self.enter_nested(main)

    def __exit__(self, *exc_info: object) -> None:
        if self.outermost:
            # en: The handler goes back before it leaves the list: a signal handler that runs in between (one that
            # en: calls the engine) finds either _hold with its entry, or the old handler back, never _hold without one.
            # zh: 先把处理函数放回去，再把它移出列表：在这两步之间运行的信号处理函数（比如一个会调用引擎的）看到的要么是
            # zh: 带着记录的 _hold，要么是已放回的旧处理函数，绝不会是没有记录的 _hold。
            handler = _replaced[-1]
            signal.signal(signal.SIGINT, handler)
            _replaced.pop()
            _deliver(handler)
        else:
            self.exit_nested()

    def enter_nested(self, main: bool) -> None:
        """A block inside one that holds Ctrl-C already (or off the main thread, which signals never reach): nothing
        to do, the outermost block holds and delivers."""
        # zh: 嵌在一个已经压下 Ctrl-C 的块里的块（或者不在主线程上，信号永远到不了那里）：什么都不用做，
        # zh: 由最外层的块压下并送达。

    def exit_nested(self) -> None:
        """The end of a nested block: nothing to do, as on entering."""
        # zh: 嵌套块的结束：什么都不用做，与进入时一样。


def _deliver(handler: Any) -> None:
    """Deliver the Ctrl-C held back, if there is one, to the handler that would have received it."""
    # zh: 如果有被压下的 Ctrl-C，就把它送达本该收到它的处理函数。
    if not _held:
        return
    frame = _held[-1]
    _held.clear()
    if callable(handler):
        # en: Python's default handler raises KeyboardInterrupt here
        # zh: Python 的默认处理函数在这里抛出 KeyboardInterrupt。
        handler(signal.SIGINT, frame)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)

# %% driver side
#| export engine.tp_runtime
import weakref
from multiprocessing.process import BaseProcess

from nanovllm.utils.interrupts import deferred_interrupt

# en: after a first failure, how long to wait for the other ranks' reports
# zh: 第一次失败之后，等待其他 rank 报告的时长。
ERROR_GRACE_S = 2.0
# en: how long a normal exit waits for the ranks to leave on their own
# zh: 正常退出时，等各 rank 自行退出的时长。
EXIT_GRACE_S = 10.0


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank failed, died or stalled; every rank has been stopped. The message says which."""
    # zh: 一个张量并行 rank 失败、死掉或停滞了；所有 rank 都已停止。消息写明是哪一个。


class TPTimeoutError(TPWorkerError, TimeoutError):
    """A rank did not answer a call within `Config.rank_timeout_s`; every rank has been stopped."""
    # zh: 一个 rank 没有在 `Config.rank_timeout_s` 之内应答调用；所有 rank 都已停止。


def process_state(pid: int) -> str:
    """The kernel's word for a process's state ("stopped", "sleeping", ...), from /proc; "" where unknown."""
    # zh: 内核对进程状态的称呼（"stopped"、"sleeping"……），读自 /proc；不知道时为 ""。
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            code = file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    names = {"R": "running", "S": "sleeping", "D": "in an uninterruptible wait", "T": "stopped",
             "t": "stopped by a debugger", "Z": "a zombie"}
    return names.get(code, code)


def process_gone(pid: int) -> bool:
    """True once no process has this pid (a rank that was stopped and reaped)."""
    # zh: 一旦没有任何进程使用这个 pid（一个已停止并被回收的 rank），就为 True。
    try:
        # en: signal 0: only asks whether the process exists
        # zh: 信号 0：只询问该进程是否存在。
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def rank_processes() -> BaseContext:
    """How ranks start: multiprocessing's forkserver, which imports this module once and forks each rank."""
    # zh: rank 怎样启动：multiprocessing 的 forkserver，它只导入本模块一次，再为每个 rank fork 一次。
    context = mp.get_context("forkserver")
    # en: Heard only before the server starts (at the first engine's start); later calls change nothing.
    # zh: 只在服务进程启动之前（第一个引擎启动时）起作用；之后再调用不会改变什么。
    context.set_forkserver_preload(["nanovllm.engine.tp_runtime"])
    return context


def open_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    """The rendezvous store, held by the driver; the ranks reach it at host:port (port 0: any free one)."""
    # zh: 会合点存储，由驱动进程持有；各 rank 通过 host:port 找到它（端口为 0 时任取一个空闲端口）。
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False)
    except dist.DistNetworkError as error:
        reason = str(error).splitlines()[0]
        raise RuntimeError(f"cannot open the rendezvous store on port {port} (master_port) for {host} "
                           f"(master_addr): {reason}. Is the port taken, or {host} not this machine?") from None


class TPRunner:
    """Tensor-parallel ranks as processes, driven from this one; the same interface as `ModelRunner`."""
    # zh: 作为进程的各张量并行 rank，由本进程驱动；接口与 `ModelRunner` 相同。

    def __init__(self, config: Config) -> None:
        self.world_size = config.tensor_parallel_size
        # en: a malformed hook fails here, not in a rank
        # zh: 格式错误的钩子在这里就报错，而不是在某个 rank 里。
        parse_fault(os.environ.get(FAULT_ENV), self.world_size)
        self.config = config
        self.block_size = config.kvcache_block_size
        self.timeout_s = config.rank_timeout_s
        # en: why the ranks were stopped, once they are
        # zh: 各 rank 被停止的原因（停止之后才有值）。
        self.failure: str | None = None
        # en: Calls are numbered from 1 (0 is the start-up reply). Each rank answers its calls in order,
        # en: so reply k of a rank is the answer to call k: replies can be read later than they arrive.
        # zh: 调用从 1 开始编号（0 是启动时的回复）。每个 rank 按顺序回答调用，所以某个 rank 的第 k 个回复
        # zh: 就是对第 k 次调用的回答：回复可以晚于它到达的时间再读。
        self._sent: dict[int, tuple[str, float]] = {0: ("start-up", time.monotonic())}
        self._next_reply = [0] * self.world_size
        self._results: dict[tuple[int, int], Any] = {}
        # en: sequences whose sampling params rank 0 holds
        # zh: rank 0 已持有其采样参数的序列。
        self._params_sent: dict[int, Sequence] = {}
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        # en: with several machines, a link to each other node's agent (chapter 17b)
        # zh: 有多台机器时，通向其他每个节点代理进程的连接（见第 17b 章）。
        self._links: list[Connection] = []
        self._stop = {"graceful": True}
        # en: Port 0 (master_port's default): the OS picks a free port and the store holds it from now on.
        # zh: 0 号端口（master_port 的默认值）：操作系统挑一个空闲端口，从此由 store 占住。
        store = open_store(config.master_addr, config.master_port, self.world_size)
        self._finalizer = weakref.finalize(
            self, stop_ranks, self._procs, self._conns, self._links, [store], self._stop)
        context = rank_processes()
        try:
            # en: The other nodes' ranks dial in first, so that this node's ranks find every peer at once.
            # zh: 其他节点的 rank 先拨进来，这样本节点的 rank 一启动就能找到所有对端。
            remote = self._join_nodes(store) if config.nnodes > 1 else []
            for rank in range(self.world_size - len(remote)):
                ours, theirs = context.Pipe()
                proc = context.Process(target=rank_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                                       args=(rank, self.world_size, config, store.port, theirs, dict(os.environ)))
                proc.start()
                # en: the rank holds the other end now
                # zh: 另一端现在由该 rank 持有。
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            self._procs += remote
            self._conns += [handle.conn for handle in remote]
            # en: No timeout here: loading a large model and capturing its graphs may take minutes.
            # zh: 这里不设超时：加载大模型并捕获它的图可能要好几分钟。
            blocks = self.collect(0, timeout_s=None)
        # en: a failed rank (already stopped), or e.g. Ctrl-C while the ranks start
        # zh: 某个 rank 失败了（已被停止），或者比如在各 rank 启动期间按下了 Ctrl-C。
        except BaseException as error:
            # en: The traceback keeps this frame: it must not keep the store, whose port a second try may need.
            # zh: 调用栈会留住这一帧：它不能留住 store，因为再试一次可能还要用那个端口。
            store = None
            self._shut(self.failure or f"{type(error).__name__} during start-up", graceful=False)
            raise
        if len(set(blocks)) != 1:
            self._shut(f"ranks disagree on the KV block count: {blocks}", graceful=False)
            raise RuntimeError(f"ranks disagree on the KV block count: {blocks}")
        config.num_kvcache_blocks = blocks[0]

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    @property
    def alive(self) -> bool:
        """True until exit() or a failure stopped the ranks."""
        # zh: 在 exit() 或某次失败停止各 rank 之前为 True。
        return self._finalizer.alive

    # en: ---- sending and receiving ---------------------------------------------------------
    # zh: ---- 发送与接收 --------------------------------------------------------------------
    def post(self, name: str, *args: Any, rank0_extra: bytes | None = None) -> int:
        """Write call `name(*args)` to every rank without waiting; returns the call's number for `collect`."""
        # zh: 把调用 `name(*args)` 写给每个 rank，不等待；返回这次调用的编号，供 `collect` 使用。
        self._check_alive()
        if name not in RankWorker.CALLS:
            raise ValueError(f"unknown call {name!r}; a rank answers {', '.join(RankWorker.CALLS)}")
        payload = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        with deferred_interrupt():
            call = max(self._sent) + 1
            self._sent[call] = (name, time.monotonic())
            for rank, conn in enumerate(self._conns):
                try:
                    _send(conn, (name, rank0_extra if rank == 0 else None))
                    conn.send_bytes(payload)
                except OSError:
                    # en: a rank is gone: collect reports it
                    # zh: 某个 rank 已经退出：由 collect 报告。
                    break
        return call

    def collect(self, call: int, timeout_s: float | None = -1.0) -> list[Any]:
        """Wait for every rank's reply to `call`; on a failure or a stall, stop every rank and raise.

        timeout_s: -1 (the default) is `Config.rank_timeout_s`, counted from when the call was written;
        None waits for as long as it takes. Replies to earlier calls that nobody collected are dropped.
        """
        # zh: 等待每个 rank 对 `call` 的回复；失败或停滞时，停止每个 rank 并抛出异常。
        # zh:
        # zh: timeout_s：-1（默认）表示 `Config.rank_timeout_s`，从写出调用时开始计时；
        # zh: None 表示要等多久就等多久。之前的调用没人收取的回复会被丢弃。
        self._check_alive()
        timeout_s = self.timeout_s if timeout_s == -1.0 else timeout_s
        deadline = None if timeout_s is None else self._sent[call][1] + timeout_s
        failures: list[RankFailure] = []
        grace = False
        while True:
            pending = [r for r in range(self.world_size) if self._next_reply[r] <= call]
            if not pending:
                break
            owners = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            limit = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(owners), limit)
            if not ready:
                if failures:
                    # en: the grace period after a failure is over
                    # zh: 失败之后的宽限期已过。
                    break
                self._stalled(call, pending)
            for rank in sorted({owners[obj] for obj in ready}):
                self._read_one(rank, call, failures)
            if failures and not grace:
                grace, deadline = True, time.monotonic() + ERROR_GRACE_S
        if failures:
            self._fail(failures)
        for key in [key for key in self._results if key[1] < call]:
            del self._results[key]
        for old in [number for number in self._sent if number < call]:
            del self._sent[old]
        return [self._results.pop((rank, call)) for rank in range(self.world_size)]

    def _read_one(self, rank: int, call: int, failures: list[RankFailure]) -> None:
        """Read one reply of `rank` (or notice that it died) and file it under its call number."""
        # zh: 读取 `rank` 的一条回复（或者发现它死了），按调用编号归档。
        # en: Read and filed as one: a Ctrl-C delivered in between would drop a reply that has left the pipe.
        # zh: 读出和归档是一体的：若在两者之间递送 Ctrl-C，一个已经离开管道的回复就会丢失。
        with deferred_interrupt():
            message = self._receive(rank)
            if message is None:
                failures.append(self._silent_exit(rank, self._sent.get(call, ("?", 0))[0]))
                # en: nothing more will come from it
                # zh: 它不会再发来任何东西。
                self._next_reply[rank] = call + 1
            elif message[0] == "ok":
                self._results[(rank, self._next_reply[rank])] = message[1]
                self._next_reply[rank] += 1
            else:
                failures.append(message[1])
                self._next_reply[rank] = call + 1

    def call(self, name: str, *args: Any, rank0_extra: bytes | None = None) -> list[Any]:
        """Run `name(*args)` on every rank; return each rank's result, in rank order."""
        # zh: 在每个 rank 上运行 `name(*args)`；按 rank 顺序返回每个 rank 的结果。
        return self.collect(self.post(name, *args, rank0_extra=rank0_extra))

    # en: ---- the model runner's interface ----------------------------------------------------
    # zh: ---- 模型执行器的接口 ----------------------------------------------------------------
    def _params_update(self, seqs: list[Sequence]) -> tuple[dict[int, SamplingParams], list[int]]:
        """For rank 0: the sampling params of sequences it has not seen, and the ids of those it may forget."""
        # zh: 给 rank 0 的：它还没见过的序列的采样参数，以及它可以忘掉的序列的 id。
        gone = [seq_id for seq_id, seq in self._params_sent.items() if seq.is_finished]
        for seq_id in gone:
            del self._params_sent[seq_id]
        new = {seq.seq_id: seq.sampling_params for seq in seqs if seq.seq_id not in self._params_sent}
        self._params_sent.update((seq.seq_id, seq) for seq in seqs)
        return new, gone

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One step on every rank; rank 0's sampled tokens."""
        # zh: 在每个 rank 上运行一步；返回 rank 0 采样出的 token。
        # en: What rank 0 is told about and the call that tells it go together, whenever Ctrl-C comes.
        # zh: 记下要告诉 rank 0 的东西，和真正告诉它的那次调用，二者同进同退，无论 Ctrl-C 何时到来。
        with deferred_interrupt():
            params = pickle.dumps(self._params_update(seqs), protocol=pickle.HIGHEST_PROTOCOL)
            call = self.post("run", step_states(seqs), is_prefill, rank0_extra=params)
        return self.collect(call)[0]

    def compute_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """The step's gathered logits, from rank 0 (nothing is sampled)."""
        # zh: 这一步收集起来的 logits，来自 rank 0（不做采样）。
        return self.call("logits", seqs, is_prefill)[0]

    def exit(self) -> None:
        """Stop the rank processes (at most once; also runs at garbage collection and interpreter exit)."""
        # zh: 停止各 rank 进程（至多一次；垃圾回收和解释器退出时也会运行）。
        if self.alive:
            self.failure = None
        self._finalizer()

    # en: ---- failures ----------------------------------------------------------------------
    # zh: ---- 失败处理 ----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.alive:
            reason = f"after an error: {self.failure}" if self.failure else "(exit() was called)"
            raise RuntimeError(f"the tensor-parallel ranks are stopped {reason}")

    def _shut(self, reason: str | None, graceful: bool) -> None:
        self.failure = reason
        self._stop["graceful"] = graceful
        self._finalizer()

    def _receive(self, rank: int) -> tuple | None:
        conn = self._conns[rank]
        try:
            return pickle.loads(conn.recv_bytes()) if conn.poll() else None
        except (EOFError, OSError):
            return None

    def _silent_exit(self, rank: int, call: str) -> RankFailure:
        proc = self._procs[rank]
        proc.join(1.0)
        error = f"the process exited (code {proc.exitcode}) without a reply"
        if call == "start-up":
            # en: The usual cause: spawn re-imports the driver's script, which starts an engine again.
            # zh: 常见原因：spawn 会重新导入驱动进程的脚本，而脚本又启动了一个引擎。
            error += ('; if the engine is created by a script, put that code under `if __name__ == "__main__":` '
                      "(each rank process imports the main module)")
        return RankFailure(rank, call, error, "", time.time())

    def _state(self, rank: int) -> str:
        """The kernel's word for a rank's process state ("stopped", ...), "" where unknown."""
        # zh: 内核对某个 rank 进程状态的称呼（"stopped"……），不知道时为 ""。
        return process_state(self._procs[rank].pid)

    def _stalled(self, call: int, pending: list[int]) -> None:
        """No reply within the timeout: name the rank that holds the others up, stop every rank, raise."""
        # zh: 超时没有回复：写明拖住其他 rank 的那个 rank，停止每个 rank，抛出异常。
        name = self._sent[call][0]
        states = {rank: self._state(rank) for rank in pending}
        # en: A stopped process is the culprit. Otherwise a rank other than 0 that did not answer: its reply
        # en: needs only its host, while rank 0's waits for the device, which waits for every peer.
        # zh: 被暂停的进程就是罪魁。否则就是没有回答的非 0 号 rank：它的回复只需要它自己的主机，而 rank 0 的回复
        # zh: 要等设备，设备又要等所有对端。
        stopped = [rank for rank in pending if states[rank].startswith("stopped")]
        culprit = (stopped or [rank for rank in pending if rank != 0] or pending)[0]
        state = states[culprit] or "state unknown"
        reason = (f"rank {culprit} (pid {self._procs[culprit].pid}, {state}) did not answer call {call} ({name}) "
                  f"within rank_timeout_s={self.timeout_s:g} s")
        self._shut(reason, graceful=False)
        others = [f"rank {r}: {'answered' if r not in pending else 'no answer'}"
                  f"{', ' + states[r] if states.get(r) else ''}" for r in range(self.world_size)]
        raise TPTimeoutError(f"tensor-parallel {reason}; all {self.world_size} rank processes have been stopped "
                             f"({'; '.join(others)}). Raise rank_timeout_s if a step really takes that long.")

    def _fail(self, failures: list[RankFailure]) -> None:
        # en: A rank that vanished without a word comes first: its peers' errors are what its absence did to them.
        # zh: 一声不吭就消失的 rank 排在最前：对端的错误只是它的消失造成的后果。
        failures.sort(key=lambda failure: (bool(failure.traceback), failure.when))
        first = failures[0]
        self._shut(f"rank {first.rank} failed during {first.call}: {first.error}", graceful=False)
        lines = [f"tensor-parallel {self.failure}; all {self.world_size} rank processes have been stopped"]
        lines += [f"  then rank {f.rank}: {f.error}" for f in failures[1:]]
        if first.traceback:
            lines += ["", f"traceback of rank {first.rank}:", first.traceback.rstrip()]
        raise TPWorkerError("\n".join(lines))


def stop_ranks(
    procs: list[BaseProcess], conns: list[Connection], links: list[Connection], store: list, stop: dict[str, bool]
) -> None:
    """Stop every rank process and close every pipe: ask (normal exit) or terminate (after an error). Closing a
    link to another node tells its agent to stop that node's ranks."""
    # zh: 停止每个 rank 进程并关闭每根管道：先请求（正常退出），出错之后则直接终止。关闭通向另一个节点的连接，
    # zh: 就是告诉该节点的代理进程停掉那里的 rank。
    if stop["graceful"]:
        for proc, conn in zip(procs, conns, strict=False):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    _send(conn, ("exit", None))
        deadline = time.monotonic() + EXIT_GRACE_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            with contextlib.suppress(OSError):
                # en: a stopped process acts on SIGTERM only once it runs
                # zh: 被暂停的进程要恢复运行后才会响应 SIGTERM。
                os.kill(proc.pid, signal.SIGCONT)
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in (*conns, *links):
        conn.close()
    store.clear()

# %% [markdown] tags=["en"]
# ## Wire it in: the engine starts the ranks
#
# Chapter 10's engine asks `start_runner` for its runner, which builds a `ModelRunner` in the
# engine's own process. It now builds a `TPRunner` when `tensor_parallel_size > 1`: both size the
# KV pool and report its block count in `config.num_kvcache_blocks`, so the rest of the engine is
# the same either way.

# %% [markdown] tags=["zh"]
# ## 接进去：引擎启动各个 rank
#
# 第 10 章的引擎向 `start_runner` 要执行器，它在引擎自己的进程里构建一个 `ModelRunner`。现在，当
# `tensor_parallel_size > 1` 时它改为构建 `TPRunner`：两者都会确定 KV 块池的大小，并把块数写进
# `config.num_kvcache_blocks`，所以无论哪种，引擎的其余部分都一样。

# %% engine starts the ranks
#| export engine.llm_engine
import nanovllm.engine.llm_engine as llm_engine
from nanovllm.book.literate import add_to_class
from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.tp_runtime import TPRunner


@add_to_class(llm_engine)
def start_runner(config: Config) -> ModelRunner | TPRunner:
    """The model runner of an engine with these settings: one in this process, or, with tensor_parallel_size > 1,
    one per rank, each in a process of its own. Both size the KV pool and report its block count in
    ``config.num_kvcache_blocks``."""
    # zh: 按这些设置构建的引擎的模型执行器：在本进程里的一个；或者 tensor_parallel_size > 1 时，每个 rank 一个，
    # zh: 各在自己的进程里。两者都确定 KV 块池的大小，并把块数写进 ``config.num_kvcache_blocks``。
    return TPRunner(config) if config.tensor_parallel_size > 1 else ModelRunner(config)

# %% [markdown] tags=["en"]
# ## See it: two CPU ranks next to one process
#
# The tiny Qwen3 of chapter 06 (4 query heads, 2 KV heads, MLP width 128, vocabulary 512: all
# even) with 4-token blocks, a pool of only 12 blocks and a budget of 16 tokens per step, so that
# a short run has chunked prefill *and* preemption. We start it twice: in this process
# (`tensor_parallel_size=1`) and as two gloo ranks. The first ranks of a process also start the
# forkserver, which imports torch and the engine once: most of their start-up. Each rank is a fork
# of that server (its parent in `/proc`, not this process), and so are a second engine's ranks,
# which are up in a fraction of the time.

# %% [markdown] tags=["zh"]
# ## 看它运行：两个 CPU rank 与单进程并排
#
# 用第 06 章的小 Qwen3（4 个查询头、2 个 KV 头、MLP 宽度 128、词表 512：都是偶数），块大小 4 个 token，块池只有
# 12 个块，每步预算 16 个 token，这样一次短短的运行就既有分块 prefill，*又*有抢占。我们把它启动两次：一次在本进程里
# （`tensor_parallel_size=1`），一次作为两个 gloo rank。一个进程里第一次启动 rank 时，还会启动 forkserver，它只导入一次
# torch 和引擎：这是启动时间的大头。每个 rank 都是这个服务进程 fork 出来的（`/proc` 里它的父进程是服务进程，不是本
# 进程），第二个引擎的 rank 也一样，启动只要一小部分时间。

# %%
import os
import textwrap
import time

import torch
from safetensors import safe_open

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_runtime import FAULT_ENV, TPWorkerError
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.book.tiny_models import build_tiny_model

tiny = build_tiny_model("qwen3")
settings = {"device": "cpu", "kvcache_block_size": 4, "num_kvcache_blocks": 12, "max_num_batched_tokens": 16}
started = time.perf_counter()
llm_tp2 = LLM(str(tiny), tensor_parallel_size=2, **settings)
startup_s = time.perf_counter() - started
llm_tp1 = LLM(str(tiny), **settings)
ranks = llm_tp2.model_runner
print(say("two ranks up in {seconds:.1f} s; KV pool: {blocks} blocks", seconds=startup_s,
          blocks=llm_tp2.config.num_kvcache_blocks))
for info, shape in zip(ranks.call("world"), ranks.call("kv_cache_shape"), strict=True):
    print(say("  rank {rank}/{size} pid {pid} {backend} on {device}, KV cache {shape}", **info, shape=shape))


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as file:
        return int(file.read().rsplit(")", 1)[1].split()[1])


# en: the ranks' one parent: the forkserver, not this process
# zh: 各 rank 唯一的父进程：forkserver，而不是本进程。
(server,) = {parent_of(pid) for pid in ranks.pids}
assert server != os.getpid() and parent_of(server) == os.getpid()
started = time.perf_counter()
with LLM(str(tiny), tensor_parallel_size=2, **settings) as again:
    again_s = time.perf_counter() - started
    assert {parent_of(pid) for pid in again.model_runner.pids} == {server}
print(say("a second engine's ranks up in {seconds:.1f} s, forked by the same server (pid {server})",
          seconds=again_s, server=server))

# %% [markdown] tags=["en"]
# Each rank loaded its slices from the full checkpoint. Rank `r`'s `qkv_proj` holds q heads
# `2r, 2r+1` and KV head `r`, stacked; concatenating the ranks' q parts gives back the
# checkpoint's `q_proj`:

# %% [markdown] tags=["zh"]
# 每个 rank 都从完整的检查点里加载了自己的那几片。rank `r` 的 `qkv_proj` 依次叠放着第 `2r`、`2r+1` 个 q 头
# 和第 `r` 个 KV 头；把各 rank 的 q 部分拼起来，就得到检查点里的 `q_proj`：

# %%
name = "model.layers.0.self_attn.qkv_proj.weight"
shards = ranks.call("shard", name)
with safe_open(str(tiny / "model.safetensors"), "pt") as checkpoint:
    q, k, v = (checkpoint.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv")
head_dim = llm_tp2.config.hf_config.head_dim
# en: per rank: 2 of 4 q heads, 1 of 2 KV heads
# zh: 每个 rank：4 个 q 头中的 2 个，2 个 KV 头中的 1 个。
q_rows, kv_rows = 2 * head_dim, 1 * head_dim
for rank, shard in enumerate(shards):
    print(say("rank {rank}: {name} {shape} (full: {full})", rank=rank, name=name, shape=tuple(shard.shape),
              full=tuple(torch.cat([q, k, v]).shape)))
    assert torch.equal(shard[:q_rows], q[rank * q_rows : (rank + 1) * q_rows])
    assert torch.equal(shard[q_rows : q_rows + kv_rows], k[rank * kv_rows : (rank + 1) * kv_rows])
    assert torch.equal(shard[q_rows + kv_rows :], v[rank * kv_rows : (rank + 1) * kv_rows])
assert torch.equal(torch.cat([shard[:q_rows] for shard in shards]), q)

# %% [markdown] tags=["en"]
# ### The logits: how close is close?
#
# The same two steps, a prefill of two prompts and then a decode, on both runners, comparing the
# logits. They are not bit-identical, and should not be: each rank's `o_proj` and `down_proj`
# produce a partial sum over half of the inputs, and the all-reduce adds the halves, a different
# order of floating-point additions than one matmul over all inputs. In float32 the difference is
# a few ulps of the logits' size, far below the gap between the top two tokens.

# %% [markdown] tags=["zh"]
# ### logits：接近到什么程度？
#
# 在两个执行器上执行同样的两步：先对两个提示词做 prefill，再做一次 decode，然后比较 logits。它们并不逐位相同，
# 也不应该相同：每个 rank 的 `o_proj` 和 `down_proj` 只对一半输入求出部分和，再由 all-reduce 把两半相加，
# 浮点加法的顺序与一次覆盖全部输入的矩阵乘法不同。在 float32 下，差异只有 logits 量级的几个 ulp，
# 远小于排名前两位的 token 之间的差距。

# %%
def two_steps(runner: object) -> list[torch.Tensor]:
    """Logits of a prefill of two prompts, then of one decode step (greedy token appended)."""
    # zh: 两个提示词的 prefill 的 logits，然后是一个 decode 步的 logits（追加贪心 token 之后）。
    seqs = [Sequence([17, 4, 250, 33, 9, 88, 120, 5, 61], block_size=4), Sequence([7, 7, 300, 2, 41], block_size=4)]
    seqs[0].block_table, seqs[1].block_table = [0, 1, 2], [3, 4]
    for seq in seqs:
        seq.num_scheduled_tokens = len(seq)
    prefill = runner.compute_logits(seqs, True)
    for seq, row in zip(seqs, prefill, strict=True):
        seq.num_cached_tokens = len(seq)
        seq.append_token(int(row.argmax()))
        seq.num_scheduled_tokens = 1
    return [prefill, runner.compute_logits(seqs, False)]


LOGIT_TOLERANCE = 1e-4
for step, one, two in zip(("prefill", "decode"), two_steps(llm_tp1.model_runner), two_steps(ranks), strict=True):
    gap = (one - two).abs().max().item()
    top2 = one.topk(2).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    print(say("{step:>7}: logits {shape}, scale {scale:.1f}, max |TP=1 - TP=2| = {gap:.1e}, "
              "smallest top-1/top-2 margin {margin:.3f}",
              step=step, shape=tuple(one.shape), scale=one.abs().max().item(), gap=gap, margin=margin))
    assert gap < LOGIT_TOLERANCE and torch.equal(one.argmax(-1), two.argmax(-1))

# %% [markdown] tags=["en"]
# ### The engine: chunks, preemption, and the same tokens
#
# Now the whole engine, three prompts, greedy. The scheduler runs in this process in both cases;
# with TP=2 every step crosses the control channel to both ranks.

# %% [markdown] tags=["zh"]
# ### 引擎：分块、抢占，以及相同的 token
#
# 现在运行整个引擎：三个提示词，贪心解码。两种情况下调度器都运行在本进程里；TP=2 时，每一步都经控制通道发给两个 rank。

# %%
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Write clear code"]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
seen = {"partial prefill": 0, "preemption": 0}


def watch(event: str, data: dict) -> None:
    if event == "schedule":
        seen["partial prefill"] += data["is_prefill"] and any(
            s.num_cached_tokens + s.num_scheduled_tokens < len(s) for s in data["seqs"])
        seen["preemption"] += len(data["preempted"])


llm_tp2.scheduler.observer = watch
started = time.perf_counter()
out_tp2 = llm_tp2.generate(prompts, greedy, use_tqdm=False)
tp2_s = time.perf_counter() - started
started = time.perf_counter()
out_tp1 = llm_tp1.generate(prompts, greedy, use_tqdm=False)
tp1_s = time.perf_counter() - started
for prompt, one, two in zip(prompts, out_tp1, out_tp2, strict=True):
    print(f"{prompt!r:42} TP=1 {one['token_ids']}\n{'':42} TP=2 {two['token_ids']}")
print(say("events in the TP=2 run: {seen}; generate took {tp2:.2f} s (TP=2) vs {tp1:.2f} s (TP=1)",
          seen=seen, tp2=tp2_s, tp1=tp1_s))
assert [o["token_ids"] for o in out_tp2] == [o["token_ids"] for o in out_tp1]
assert seen["partial prefill"] and seen["preemption"]

# %% [markdown] tags=["en"]
# On a tiny model TP=2 is usually slower (the timings above are from a shared CPU and vary):
# every layer's all-reduce is a round trip through local sockets, and each step also crosses
# the control channel, while the matmuls it splits take microseconds. Tensor parallelism pays
# off when one rank's matmuls are big enough to hide the communication — real models, on GPUs
# linked by NVLink.
#
# ### When a rank fails
#
# The test hook makes rank 1 raise on its third call. This second engine starts while the first
# is still running: its store has its own port and nothing else is named, so the two do not
# collide. The driver reports rank 1's error (with its traceback), stops both ranks, and the
# processes are gone.

# %% [markdown] tags=["zh"]
# 在小模型上，TP=2 通常更慢（上面的计时来自共享 CPU，会有波动）：每一层的 all-reduce 都要经本机套接字往返
# 一次，每一步还要过一次控制通道，而被它切分的矩阵乘法只需要几微秒。只有当单个 rank 上的矩阵乘法大到足以掩盖
# 通信开销时，张量并行才划算——真实的模型，跑在用 NVLink 互连的 GPU 上。
#
# ### 当某个 rank 出错
#
# 测试钩子让 rank 1 在第三次调用时抛出异常。第二个引擎是在第一个仍在运行时启动的：它的 store 有自己的端口，
# 别的东西都没有命名，所以两者不会冲突。驱动进程报告 rank 1 的错误（附带其调用栈），停掉两个 rank，进程都消失了。

# %%
from nanovllm.engine.tp_runtime import process_gone

os.environ[FAULT_ENV] = "1:3"
try:
    faulty = LLM(str(tiny), tensor_parallel_size=2, **settings)
    faulty_pids = faulty.model_runner.pids
    started = time.perf_counter()
    faulty.generate(prompts, greedy, use_tqdm=False)
    raise AssertionError("the injected fault did not surface")
except TPWorkerError as error:
    print("\n".join(str(error).splitlines()[:3]), "\n  ...")
    print(say("reported and cleaned up {seconds:.2f} s after the call", seconds=time.perf_counter() - started))
finally:
    del os.environ[FAULT_ENV]
assert all(process_gone(pid) for pid in faulty_pids) and not faulty.model_runner.alive
try:
    faulty.generate(prompts, greedy, use_tqdm=False)
except RuntimeError as error:
    print(say("a later call: {error}", error=error))
# en: The first engine never noticed.
# zh: 第一个引擎完全没有受到影响。
assert llm_tp2.generate(prompts[:1], greedy, use_tqdm=False)[0]["token_ids"] == out_tp1[0]["token_ids"]

# %% [markdown] tags=["en"]
# ### Ctrl-C, and a rank that stalls
#
# Ctrl-C in the middle of `generate` must not cost the ranks: the one-process engine survives it
# and serves again, so the TP engine must too. Below, a timer sends SIGINT to this process (what
# Jupyter's "interrupt" button and a terminal's Ctrl-C do) while a long `generate` runs. The
# driver stops where it is; the ranks, which ignore SIGINT, finish the step they were given; the
# next call reads and drops that step's reply first, and the engine gives the same tokens as
# before.

# %% [markdown] tags=["zh"]
# ### Ctrl-C，以及一个停滞的 rank
#
# 在 `generate` 中途按下 Ctrl-C，不该让各个 rank 付出代价：单进程引擎挨了这一下之后照样服务，张量并行的引擎也必须
# 如此。下面用一个定时器在一个很长的 `generate` 运行期间向本进程发送 SIGINT（Jupyter 的“中断”按钮和终端里的 Ctrl-C
# 做的就是这件事）。驱动进程停在当下；各 rank 忽略 SIGINT，把手上那一步算完；下一次调用先把那一步的回复读出来丢掉，
# 引擎给出的 token 与之前完全相同。

# %%
import signal
import threading
from contextlib import suppress

from nanovllm.engine.tp_runtime import TPTimeoutError

many = [[3 + (5 * i + j) % 300 for j in range(8)] for i in range(6)]
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
started = time.perf_counter()
try:
    # en: until Ctrl-C arrives
    # zh: 直到 Ctrl-C 到来。
    for _ in range(500):
        llm_tp2.generate(many, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    raise AssertionError("Ctrl-C never arrived")
except KeyboardInterrupt:
    print(say("KeyboardInterrupt after {seconds:.2f} s; ranks alive: {alive}, engine idle: {idle}",
              seconds=time.perf_counter() - started, alive=ranks.alive, idle=llm_tp2.is_finished()))
assert ranks.alive and llm_tp2.is_finished() and all(not process_gone(pid) for pid in ranks.pids)
assert [o["token_ids"] for o in llm_tp2.generate(prompts, greedy, use_tqdm=False)] == [o["token_ids"] for o in out_tp1]
print(say("and it serves again, with the same tokens"))

# %% [markdown] tags=["en"]
# A rank that stops answering without dying is the other trap: a debugger, SIGSTOP, a host that
# hangs. Before this chapter's fix the driver waited forever. With `rank_timeout_s=2`, the
# engine gives up two seconds after the step was sent, names the rank and its state, and stops
# every process:

# %% [markdown] tags=["zh"]
# 另一个陷阱是不回答却也没有退出的 rank：调试器、SIGSTOP、卡死的主机。在本章修好之前，驱动进程会一直等下去。
# 设置 `rank_timeout_s=2` 后，引擎在这一步发出两秒后放弃，指出是哪个 rank、处于什么状态，并停掉所有进程：

# %%
stalling = LLM(str(tiny), tensor_parallel_size=2, rank_timeout_s=2.0, **settings)
stalling_pids = stalling.model_runner.pids
os.kill(stalling_pids[1], signal.SIGSTOP)
started = time.perf_counter()
try:
    stalling.generate(prompts, greedy, use_tqdm=False)
    raise AssertionError("the stalled rank went unnoticed")
except TPTimeoutError as error:
    print(say("after {seconds:.1f} s:", seconds=time.perf_counter() - started),
          "\n".join(textwrap.wrap(str(error), 100)))
    assert str(error).startswith(f"tensor-parallel rank 1 (pid {stalling_pids[1]}, stopped) did not answer")
finally:
    with suppress(ProcessLookupError):
        os.kill(stalling_pids[1], signal.SIGCONT)
assert all(process_gone(pid) for pid in stalling_pids) and not stalling.model_runner.alive

# %% [markdown] tags=["en"]
# ### On GPUs: NCCL
#
# With two GPUs the same comparison runs with NCCL, rank `r` on `cuda:r` (float32 here, like the
# CPU run). Without them, the cell says so.

# %% [markdown] tags=["zh"]
# ### 在 GPU 上：NCCL
#
# 有两块 GPU 时，同样的比较改用 NCCL，rank `r` 运行在 `cuda:r` 上（这里用 float32，与 CPU 上的运行一致）。没有的话，
# 这个单元会说明这一点。

# %%
gpu_ref_tokens = None
if torch.cuda.device_count() >= 2:
    gpu_settings = {**settings, "device": "cuda", "dtype": "float32", "max_num_seqs": 8}
    with LLM(str(tiny), tensor_parallel_size=2, **gpu_settings) as gpu_tp2:
        gpu_out = gpu_tp2.generate(prompts, greedy, use_tqdm=False)
        print(say("NCCL ranks: {ranks}",
                  ranks=[info["backend"] + " " + info["device"] for info in gpu_tp2.model_runner.call("world")]))
    with LLM(str(tiny), **gpu_settings) as gpu_tp1:
        gpu_ref = gpu_tp1.generate(prompts, greedy, use_tqdm=False)
    gpu_ref_tokens = [o["token_ids"] for o in gpu_ref]
    assert [o["token_ids"] for o in gpu_out] == gpu_ref_tokens
    print(say("TP=2 over NCCL gives the same greedy tokens as one GPU"))
else:
    print(say("{count} CUDA device(s): the NCCL run needs two (the tests have it, marked gpu)",
              count=torch.cuda.device_count()))

# %% [markdown] tags=["en"]
# ## Making it pay
#
# Tensor parallelism exists for models that do not fit one GPU, but it should also make a model
# that does fit *faster*: two GPUs read the weights and the KV cache twice as fast. The first
# version of this chapter did the opposite: on two H200s, the nano-vllm benchmark (chapter 19)
# ran at 3,319 tok/s with TP = 2 against 20,843 with one GPU, a decode step taking 39 ms instead
# of 5.4. `scripts/profile_tp.py` times a decode step on both sides of the control channel: in
# the driver, queueing the call (pickling and writing it) and waiting for the tokens; in each
# rank, the wait for the driver's message, unpickling it, queueing the step (collectives
# included), the wait for the tokens; on a GPU, CUDA events time each rank's device work. On one
# H200 (256 sequences of the benchmark, 64 tokens each, synchronous steps so that each step's
# times are its own; medians per decode step):
#
# | | one process, graphs | one process, eager | one rank behind the channel |
# |---|---|---|---|
# | device time of a step | 7.4 ms | 22.9 ms | 8.0 ms |
# | host time to queue the step | 1.0 ms | 22.2 ms | 1.6 ms |
# | driver: pickling the step (256 `Sequence`s + their sampling params) | — | — | 1.24 ms |
# | rank: unpickling it | — | — | 0.80 ms |
# | rank: idle between two steps | — | — | 3.4 ms |
# | tokens/s, whole run | 14,119 | 6,101 | 10,474 |
#
# Two findings. **Eager decode is launch-bound**: queueing the kernels of 28 layers one by one
# takes the host 22 ms, three times what the GPU needs to run them; that, not NCCL, is where most
# of TP = 2's 39 ms went, since graphs were off for TP. **The channel costs milliseconds**, not
# microseconds, for a batch of 256: pickling objects is slow in Python, and while the driver
# pickles and the rank unpickles, synchronously, the GPU waits. The cell below prints both recorded
# runs and checks these findings against them.

# %% [markdown] tags=["zh"]
# ## 让它划算
#
# 张量并行是为单块 GPU 放不下的模型准备的，但对放得下的模型，它也应该让模型*更快*：两块 GPU 读权重和 KV 缓存的
# 速度是一块的两倍。本章的第一版恰恰相反：在两块 H200 上，nano-vllm 基准负载（第 19 章）TP = 2 时跑出 3,319 tok/s，
# 单 GPU 却有 20,843，一个 decode 步要 39 ms 而不是 5.4 ms。`scripts/profile_tp.py` 在控制通道
# 两侧为一个 decode 步计时：在驱动进程中，计把调用发出去（序列化并写入管道）和等待 token 的时间；在每个 rank 中，
# 计等待驱动进程消息、反序列化、把这一步排进队列（含集合通信）和等待 token 的时间；在 GPU 上，用 CUDA 事件给每个
# rank 的设备工作计时。在一块 H200 上（基准负载的 256 个序列，每个 64 个 token，同步执行，好让每一步的时间只属于
# 它自己；取每个 decode 步的中位数）：
#
# | | 单进程，CUDA Graph | 单进程，eager | 控制通道之后的一个 rank |
# |---|---|---|---|
# | 一步的设备时间 | 7.4 ms | 22.9 ms | 8.0 ms |
# | 主机把这一步排进队列的时间 | 1.0 ms | 22.2 ms | 1.6 ms |
# | 驱动进程：序列化这一步（256 个 `Sequence` 及其采样参数） | — | — | 1.24 ms |
# | rank：反序列化它 | — | — | 0.80 ms |
# | rank：两步之间的空闲 | — | — | 3.4 ms |
# | tokens/s，整个运行 | 14,119 | 6,101 | 10,474 |
#
# 两个发现。**eager 的 decode 受限于内核启动**：把 28 层的内核一个个排进队列，主机要花 22 ms，是 GPU 执行它们所需
# 时间的三倍；TP = 2 的 39 ms 大部分就耗在这里，而不是 NCCL 上，因为张量并行时 CUDA Graph 是关着的。**控制通道的
# 开销是毫秒级**，而不是微秒级（批大小 256 时）：在 Python 里序列化对象很慢，而驱动进程序列化、rank 反序列化的时候，
# 在同步执行下，GPU 只能等着。下面的单元打印记录下来的这两次运行，并用它们核对这些发现。

# %% recorded: the first version and its profile
from nanovllm.book.recorded import recorded

runs = recorded("17_tp_runtime")
first, profile = runs["first version"], runs["step profile"]
print(say("{date}, {card}: {command}", date=first.date, card=first.card, command=first.command))
for size, figures in first.figures.items():
    print(say("  {size}: {rate:,} tok/s, a decode step {ms} ms", size=size, rate=figures["tokens/s"],
              ms=figures["decode step ms"]))
print(say("{date}, {card}: {command}", date=profile.date, card=profile.card, command=profile.command))
columns = {"tp1": "one process, graphs", "tp1-eager": "one process, eager",
           "tp1-channel": "one rank behind the channel"}
rows = {"device ms": "device time of a step", "queue ms": "host time to queue the step",
        "pickle ms": "driver: pickling the step", "unpickle ms": "rank: unpickling it",
        "rank idle ms": "rank: idle between two steps", "tokens/s": "tokens/s, whole run"}
print(format(say("median per decode step, ms"), "<30") + "".join(format(say(name), ">29") for name in columns.values()))
for key, label in rows.items():
    cells = [profile.figures[setting].get(key) for setting in columns]
    shown = ["-" if cell is None else f"{cell:,.0f}" if key == "tokens/s" else f"{cell:.2f}" for cell in cells]
    print(format(say(label), "<30") + "".join(f"{cell:>29}" for cell in shown))
graphs, eager, channel = (profile.figures[setting] for setting in columns)
# en: Eager decode is launch-bound: queueing a step takes the host 22 ms, three times the GPU's work (graphed)...
# zh: eager 的 decode 受限于内核启动：主机把一步排进队列要 22 ms，是 GPU 工作时间（用图时）的三倍……
assert round(eager["queue ms"]) == 22 and round(eager["queue ms"] / graphs["device ms"]) == 3
# en: ...and that is most of the 39 ms that a decode step took under TP = 2 without graphs.
# zh: ……这就是张量并行不用图时，一个 decode 步那 39 ms 中的大部分。
assert first.figures["TP=2"]["decode step ms"] == 39 and eager["queue ms"] > 39 / 2
# en: The channel costs milliseconds, not microseconds: pickling and unpickling a step of 256 sequences.
# zh: 控制通道的开销是毫秒级，而不是微秒级：序列化、反序列化一个有 256 个序列的步。
assert channel["pickle ms"] + channel["unpickle ms"] > 1

# %% [markdown] tags=["en"]
# Three changes follow:
#
# 1. **Graphs on every rank** (chapter 14): each rank captures the same sizes in the same order,
#    its NCCL all-reduces inside the graphs. Queueing a step is a replay again.
# 2. **Asynchronous scheduling with TP** (chapter 18): the driver queues step *n + 1* on the
#    ranks before it waits for step *n*'s tokens. The ranks need step *n*'s samples as the
#    inputs of step *n + 1*, and only rank 0 samples; so rank 0 broadcasts them on the device
#    (`share_from_rank0`), every rank keeps them under the step's call number, and the next
#    message names that call. Each rank fills in its pending tokens itself, exactly as one GPU
#    does with chapter 18's `SampledTokens`; no token value travels through any host.
# 3. **A lighter message**: tuples instead of objects (`step_states`), and sampling parameters
#    once per sequence instead of at every step.
#
# The cell below measures the message of such a step on this machine, old and new, and checks
# that the new one rebuilds the same sequences.

# %% [markdown] tags=["zh"]
# 于是有三处改动：
#
# 1. **每个 rank 都用 CUDA Graph**（第 14 章）：每个 rank 按同样的顺序捕获同样的档位，它的 NCCL all-reduce 就在图里。
#    把一步排进队列重新变成一次重放。
# 2. **张量并行下的异步调度**（第 18 章）：驱动进程先把第 *n + 1* 步排给各 rank，再等第 *n* 步的 token。各 rank
#    需要第 *n* 步的采样结果作为第 *n + 1* 步的输入，而只有 rank 0 采样；所以 rank 0 在设备上广播它们
#    （`share_from_rank0`），每个 rank 按这一步的调用编号存下来，下一条消息指明是哪次调用。每个 rank 自己填入待定的
#    token，和单 GPU 用第 18 章的 `SampledTokens` 做的完全一样；没有哪个 token 的值要经过任何主机。
# 3. **更轻的消息**：用元组代替对象（`step_states`），采样参数每个序列只发一次，而不是每步都发。
#
# 下面的单元在这台机器上测量这样一步的消息，新旧各一次，并检查新消息重建出的序列与原来的相同。

# %%
import pickle
import random

from nanovllm.engine.tp_runtime import step_sequences, step_states


def decode_batch(count: int = 256, block_size: int = 256) -> list[Sequence]:
    """A decode step of the benchmark's shape: contexts of 100 to 2,048 tokens, one new token each."""
    # zh: 与基准测试形状相同的 decode 步：上下文为 100 到 2,048 个 token，每个序列一个新 token。
    rng, batch = random.Random(0), []
    for i in range(count):
        n = rng.randint(100, 2048)
        tokens = [rng.randint(0, 10_000) for _ in range(n)]
        seq = Sequence(tokens, SamplingParams(temperature=0.6), block_size=block_size)
        seq.block_table = list(range(8 * i, 8 * i + -(-n // block_size)))
        seq.num_cached_tokens, seq.num_scheduled_tokens = n - 1, 1
        batch.append(seq)
    return batch


def best_ms(work: object, repeat: int = 30) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return 1e3 * min(times)


batch = decode_batch()
old_message = pickle.dumps((batch, False), protocol=pickle.HIGHEST_PROTOCOL)
old_params = pickle.dumps([seq.sampling_params for seq in batch], protocol=pickle.HIGHEST_PROTOCOL)
new_message = pickle.dumps((step_states(batch), False), protocol=pickle.HIGHEST_PROTOCOL)
costs = {
    "objects + params every step": (
        best_ms(lambda: (pickle.dumps((batch, False), protocol=5), pickle.dumps([s.sampling_params for s in batch]))),
        best_ms(lambda: (pickle.loads(old_message), pickle.loads(old_params))), len(old_message) + len(old_params)),
    "tuples, params once": (
        best_ms(lambda: pickle.dumps((step_states(batch), False), protocol=5)),
        best_ms(lambda: step_sequences(pickle.loads(new_message)[0])), len(new_message)),
}
for name, (pack, unpack, size) in costs.items():
    print(say("{name}: driver {pack:.2f} ms, rank {unpack:.2f} ms, {size:.1f} KiB", name=format(say(name), "<28"),
              pack=pack, unpack=unpack, size=size / 1024))
rebuilt = step_sequences(pickle.loads(new_message)[0])
for seq, shipped in zip(batch, rebuilt, strict=True):
    assert (shipped.seq_id, shipped.block_table, shipped.token_ids, len(shipped)) == (
        seq.seq_id, seq.block_table, [seq.last_token], len(seq))
    assert shipped.num_cached_tokens == seq.num_cached_tokens and shipped.block_size == seq.block_size

# %% [markdown] tags=["en"]
# ### See it: an asynchronous TP engine, step by step
#
# The same two gloo ranks, now with asynchronous scheduling (`LLMEngine` reads the setting at
# every step). Each `step()` queues one step on both ranks and collects the one before; the
# decode steps' inputs are pending tokens that each rank took from its own copy of rank 0's
# samples. The tokens equal the synchronous run's, TP = 1's.

# %% [markdown] tags=["zh"]
# ### 看它运行：逐步执行的异步张量并行引擎
#
# 还是那两个 gloo rank，现在打开异步调度（`LLMEngine` 每一步都会读这个设置）。每次 `step()` 把一步排给两个 rank，
# 并收取前一步；decode 步的输入是待定的 token，由每个 rank 从自己保存的 rank 0 采样结果里取出。得到的 token 与同步
# 运行、与 TP = 1 的结果完全相同。

# %%
llm_tp2.config.async_scheduling = True
ids = [llm_tp2.add_request(prompt, greedy) for prompt in prompts]
tokens_of, calls = {}, 0
while not llm_tp2.is_finished():
    finished, num_tokens, is_prefill = llm_tp2.step()
    calls += 1
    if calls <= 4:
        kind = ("prefill" if is_prefill else "decode") if num_tokens else say("nothing")
        print(say("step() {calls}: collected {kind} ({tokens} tokens), finished {finished}", calls=calls, kind=kind,
                  tokens=num_tokens, finished=[i for i, _ in finished]))
    tokens_of.update(finished)
llm_tp2.config.async_scheduling = False
assert [tokens_of[i] for i in ids] == [o["token_ids"] for o in out_tp1]
print(say("{calls} calls of step(); the tokens equal TP = 1's", calls=calls))

# %% [markdown] tags=["en"]
# On two GPUs, the graphs and the asynchronous steps are what the engine does by default; this
# cell checks that both ranks captured their graphs. The speed itself is measured by
# `python3 -m nanovllm.bench --tensor-parallel-size 2` (chapter 19), which runs the engine on two
# GPUs and on one in the same invocation and prints their ratio.

# %% [markdown] tags=["zh"]
# 在两块 GPU 上，CUDA Graph 和异步执行都是引擎的默认行为；这个单元检查两个 rank 都捕获了自己的图。速度本身由
# `python3 -m nanovllm.bench --tensor-parallel-size 2`（第 19 章）测量：它在同一次调用中分别用两块 GPU 和一块 GPU
# 运行引擎，并打印二者之比。

# %%
if torch.cuda.device_count() >= 2:
    with LLM(str(tiny), tensor_parallel_size=2, **gpu_settings) as gpu_tp2:
        worlds = gpu_tp2.model_runner.call("world")
        print(say("graphs captured: {graphs}, async scheduling: {asynchronous}", graphs=[w["graphs"] for w in worlds],
                  asynchronous=gpu_tp2.config.async_scheduling))
        assert all(w["graphs"] for w in worlds) and gpu_tp2.config.async_scheduling
        assert [o["token_ids"] for o in gpu_tp2.generate(prompts, greedy, use_tqdm=False)] == gpu_ref_tokens
else:
    print(say("{count} CUDA device(s): graphs on every rank need two (the tests have it, marked gpu)",
              count=torch.cuda.device_count()))

# %% [markdown] tags=["en"]
# ### Shutting down
#
# `LLM.exit()` stops the ranks; `with LLM(...) as llm:` calls it at the end of the block; and if
# neither happens, the runner's finalizer stops them when the engine is garbage-collected or the
# interpreter exits.

# %% [markdown] tags=["zh"]
# ### 关闭
#
# `LLM.exit()` 会停掉各 rank；`with LLM(...) as llm:` 在代码块结束时调用它；如果两者都没发生，执行器的终结器
# （finalizer）会在引擎被垃圾回收或解释器退出时停掉它们。

# %%
pids = ranks.pids
llm_tp2.exit()
llm_tp1.exit()
assert all(process_gone(pid) for pid in pids) and not ranks.alive
print(say("ranks {pids} are gone", pids=pids))

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/linear.py` gains `agree_min` (the KV block count all ranks can afford) and
#   `share_from_rank0` (rank 0's samples on every rank's device).
# - `nanovllm/engine/tp_runtime.py`: `TPRunner` (the driver: one process per rank, each forked by
#   the forkserver of `rank_processes`, a pipe per rank as the control channel,
#   `run`/`compute_logits`/`call`/`exit`, `TPWorkerError` naming the first failure), `rank_main`
#   and `RankWorker` (one rank's loop and its calls),
#   `init_rank` (gloo on CPU, NCCL on GPUs, rendezvous on a store the driver holds on a free port),
#   and the `NANOVLLM_TP_FAULT` test hook.
# - The engine's `start_runner` builds `TPRunner` when `tensor_parallel_size > 1`, and `Config` checks
#   that the ranks divide the model; TP=2 gives the same
#   greedy tokens as TP=1, with logits within 1e-4 in float32.
# - Making it pay: decode graphs on every rank (chapter 14), asynchronous scheduling with TP
#   (`share_from_rank0` broadcasts rank 0's samples; each rank keeps them by call number; the
#   `Replier` thread answers in order), a lighter step message (`step_states`, sampling params
#   once); `post`/`collect` (chapter 18 adds `launch` and `TPStep`); Ctrl-C that leaves the ranks serving
#   (`deferred_interrupt`, ranks ignore SIGINT); `rank_timeout_s` and `TPTimeoutError` naming a
#   stalled rank; `scripts/profile_tp.py`, which times a step on both sides of the channel.
#
# ## Exercises
#
# 1. Which values of `tensor_parallel_size` from 1 to 8 does the tiny Qwen3 of this chapter
#    accept (4 heads, 2 KV heads, MLP width 128, vocabulary 512)?
# 2. A decode step ships each sequence to every rank. Which part of a sequence's message still
#    grows with its length, and which does not?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/linear.py` 增加了 `agree_min`（所有 rank 都放得下的 KV 块数）和 `share_from_rank0`（把 rank 0
#   的采样结果放到每个 rank 的设备上）。
# - `nanovllm/engine/tp_runtime.py`：`TPRunner`（驱动端：每个 rank 一个进程，都由 `rank_processes` 的 forkserver
#   fork 出来，每个 rank 一条管道作为控制通道，提供 `run`/`compute_logits`/`call`/`exit`，用 `TPWorkerError` 指明
#   最早的失败），`rank_main` 与 `RankWorker`（一个 rank 的循环及其可被调用的方法），`init_rank`（CPU 上用 gloo，
#   GPU 上用 NCCL，会合点是驱动进程在空闲端口上持有的 store），以及测试钩子 `NANOVLLM_TP_FAULT`。
# - 引擎的 `start_runner` 在 `tensor_parallel_size > 1` 时构建 `TPRunner`，`Config` 检查 rank 数能否整除模型的
#   各个维度；TP=2 给出与 TP=1 相同的贪心 token，
#   float32 下 logits 相差不超过 1e-4。
# - 让它划算：每个 rank 都用 decode CUDA Graph（第 14 章）；张量并行下的异步调度（`share_from_rank0` 广播 rank 0 的
#   采样结果，每个 rank 按调用编号保存，`Replier` 线程按顺序回复）；更轻的单步消息（`step_states`，采样参数只发
#   一次）；`post`/`collect`（第 18 章加上 `launch` 与 `TPStep`）；不会连累各 rank 的 Ctrl-C（`deferred_interrupt`，
#   rank 忽略 SIGINT）；
#   `rank_timeout_s` 与指出停滞 rank 的 `TPTimeoutError`；以及在控制通道两侧为一步计时的 `scripts/profile_tp.py`。
#
# ## 练习
#
# 1. 本章的小 Qwen3（4 个头、2 个 KV 头、MLP 宽度 128、词表 512）接受 1 到 8 中的哪些 `tensor_parallel_size`？
# 2. decode 步要把每个序列发给每个 rank。序列消息中哪一部分仍随序列长度增长，哪一部分不会？

# %%
# en: 1: only 1 and 2: 4 would leave each rank half a KV head, 3 a third of the heads.
# zh: 1：只有 1 和 2：取 4 时每个 rank 只分到半个 KV 头，取 3 时头数除不尽。
from nanovllm.config import check_tensor_parallel_size


def accepted(tp: int) -> bool:
    try:
        check_tensor_parallel_size(llm_tp1.config.hf_config, tp)
    except ValueError:
        return False
    return True


assert [tp for tp in range(1, 9) if accepted(tp)] == [1, 2]
# en: 2: the block table grows (one id per block); the tokens do not: only the last one travels.
# zh: 2：块表会增长（每个块一个 id）；token 不会：只传最后一个。
import pickle

for length in (12, 400):
    seq = Sequence(list(range(length)), block_size=4)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = list(range(-(-length // 4))), length - 1, 1
    slim = pickle.loads(pickle.dumps(seq))
    assert slim.token_ids == [length - 1] and slim.block_table == seq.block_table and slim.block_size == 4
    print(say("decode message of a {length}-token sequence: {size} bytes, 1 token, {ids} block ids",
              length=length, size=len(pickle.dumps(seq)), ids=len(slim.block_table)))
print(say("all exercise answers check out"))
