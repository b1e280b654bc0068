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
# # 27 · KV events for a gateway
#
# **Goal.** One engine serves as many users as one GPU holds. More users need more engines,
# **replicas** of the same model, and something in front of them that picks one for each request:
# a **gateway**. Chapter 03's prefix cache makes a conversation's next turn cheap, but only on the
# replica that computed the turns before: each replica's cache is its own. A gateway that is to
# send a request where its prefix is cached must know what each cache holds. This chapter makes
# the engine say so, as vLLM does: every change of the prefix cache becomes a **KV
# event** (a block stored, a block removed, the cache cleared), published on a ZMQ socket in
# vLLM's wire format, so that the gateways built for vLLM can read ours. By the end you can say
# which changes of `hash_to_block_id` become which event, why a subscriber that applies the events
# in order holds exactly the cache's keys after every step, what travels on the wire byte for
# byte, and how a subscriber that missed some batches gets them again. What follows, still being
# written, runs replicas behind a gateway.

# %% [markdown] tags=["zh"]
# # 27 · 给网关的 KV 事件
#
# **目标：** 一个引擎能服务的用户数，受限于一块 GPU 装得下多少。更多的用户需要更多的引擎，即同一个模型的多个
# **副本**（replica），前面还要有一个为每个请求挑选副本的东西：**网关**（gateway）。第 03 章的前缀缓存让对话的下一轮
# 变得便宜，但只在算过前面几轮的那个副本上才如此：每个副本的缓存只属于它自己。网关要把请求发到缓存着它的前缀的
# 地方，就得知道每个缓存里有什么。本章让引擎像 vLLM 那样把这件事说出来：前缀缓存的每次变化都成为一个
# **KV 事件**（KV event）——存入了一个块、移除了一个块、缓存被清空——按 vLLM 的线上格式（wire format）发布在一个 ZMQ
# 套接字上，这样为 vLLM 写的网关也能读懂我们的引擎。读完本章，你能说出 `hash_to_block_id` 的哪种变化成为哪种事件，
# 为什么按顺序应用这些事件的订阅者（subscriber）在每一步之后恰好持有缓存的全部键，线上逐字节传的是什么，以及错过了
# 几批事件的订阅者怎样把它们重新拿到。接下来的部分（还在写）把多个副本放到网关后面运行。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "stored {hashes} after {parent}: tokens {tokens}": "存入 {hashes}，接在 {parent} 之后：token {tokens}",
    "removed {hashes}": "移除 {hashes}", "all blocks cleared": "所有块已清空",
    "hash_to_block_id {keys}": "hash_to_block_id {keys}",
    "step {step:>2} {kind:<7} batch {seq}: {event}": "第 {step:>2} 步 {kind:<7} 第 {seq} 批：{event}",
    "after each of the {steps} steps the subscriber held the cache's keys ({keys} at the end): {same}":
        "{steps} 步中的每一步之后，订阅者持有的都正是缓存的键（最后有 {keys} 个）：{same}",
    "every stored hash is the chained hash of its tokens: {same}": "每个存入的哈希都是它那些 token 的链式哈希：{same}",
    "frames: topic {topic}, sequence number {seq}, payload of {size} bytes":
        "帧：主题 {topic}，序号 {seq}，载荷 {size} 字节",
    "the payload as msgpack: {value}": "载荷按 msgpack 解开：{value}",
    "replay from batch {start}: batches {seqs}, then sequence number {end} with an empty payload: {same}":
        "从第 {start} 批起补发：第 {seqs} 批，然后是序号 {end} 和空的载荷：{same}",
    "refused: {refusal}": "被拒绝：{refusal}", "reset": "重置",
    "events off: no log, no publisher: {off}": "事件关闭：没有日志，也没有发布者：{off}",
    "the server published {batches} batches for one completion:": "服务器为一次补全发布了 {batches} 批：",
    "  batch {seq}: {event}": "  第 {seq} 批：{event}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %% [markdown] tags=["en"]
# ## The idea: tell the gateway what each cache holds
#
# Two replicas of one model, behind a gateway. A user's first turn went to replica A, which
# prefilled the system prompt and the turn and published their full blocks; the second turn
# repeats all of that and adds a few tokens. Sent to A, it finds the blocks and computes only the
# new tokens; sent to B, it computes everything again, and B's cache now holds a second copy.
#
# ```
#                     gateway ── "turn 2 of conversation 7" ──> ?
#                    /       \
#   replica A: hash_to_block_id = {h0, h1, h2}        replica B: hash_to_block_id = {h5}
#              (conversation 7, turn 1)                          (another user)
# ```
#
# A gateway can learn what each cache holds in two ways. It can **guess**: remember the text of
# the requests it sent to each replica in a tree of prefixes, and pick the replica with the
# longest match (SGLang's and vLLM's routers do this, with an "approximate radix tree"). The guess
# knows nothing of what a replica evicted to make room, or of two replicas that both computed a
# prefix. Or it can **be told**: each replica says what it stores and what it removes, and the
# gateway keeps, for each replica, the set of block hashes it holds. That is what vLLM's **KV
# events** are for, and what NVIDIA Dynamo's KV router and llm-d's precise prefix scorer read.
#
# For our engine, "what the cache holds" has an exact meaning: the keys of the prefix cache's
# `hash_to_block_id` (chapter 03). Everything a gateway needs follows from three rules, one for
# each way that dictionary changes:
#
# | `hash_to_block_id` | event |
# |---|---|
# | gains a key: `publish` hashes a block to a new hash | `BlockStored`: hash, parent's hash, tokens, block size |
# | loses a key: `forget` deletes the entry of a block about to get other tokens | `BlockRemoved`: the hash |
# | is emptied (a reset) | `AllBlocksCleared` |
#
# Then the **invariant** of this chapter: a subscriber that starts empty and applies the events in
# order holds, after every step, exactly the keys of `hash_to_block_id`. Two details make it
# exact. A block published with a hash that another block already holds (two prompts computed
# the same prefix in one step) changes the dictionary's value, not its keys: no event. And chapter
# 03's `forget` deletes an entry only if it still points at the block being reused: the one it
# does not delete was never a key of its own, so no event either.
#
# A block's **parent** is the block before it in its prompt, whose hash chapter 03 chained into
# its own. The parent and the tokens are there for gateways that compute their own keys: llm-d's
# indexer hashes the tokens of each block, chained through the parents, with its own hash
# function, so our `xxh64` hashes may stay ours as long as the parents and the block size are
# right.

# %% [markdown] tags=["zh"]
# ## 思路：告诉网关每个缓存里有什么
#
# 同一个模型的两个副本，放在一个网关后面。一个用户的第一轮去了副本 A，A 对系统提示词和这一轮做了 prefill，并发布了
# 它们写满的块；第二轮把这些全部重复一遍，再加上几个 token。发给 A，它能找到这些块，只计算新 token；发给 B，就得全部
# 重算，而且 B 的缓存里从此多了一份拷贝。
#
# ```
#                     网关 ── "第 7 个对话的第 2 轮" ──> ?
#                    /       \
#   副本 A：hash_to_block_id = {h0, h1, h2}        副本 B：hash_to_block_id = {h5}
#           （第 7 个对话，第 1 轮）                        （另一个用户）
# ```
#
# 网关有两种办法得知每个缓存里有什么。它可以**猜**：把发给每个副本的请求文本记在一棵前缀树里，挑匹配最长的那个
# 副本（SGLang 和 vLLM 的路由器就这样做，用的是一棵“近似基数树”）。这种猜测不知道副本为了腾地方逐出了什么，也不知道
# 两个副本都算过同一个前缀。它也可以**被告知**：每个副本说出自己存入了什么、移除了什么，网关为每个副本维护它持有的
# 块哈希集合。这正是 vLLM 的 **KV 事件**的用途，NVIDIA Dynamo 的 KV 路由器和 llm-d 的精确前缀打分器读的就是它。
#
# 对我们的引擎，“缓存里有什么”有确切的含义：前缀缓存中 `hash_to_block_id` 的键（第 03 章）。网关需要的一切都来自
# 三条规则，这个字典每种变化方式各一条：
#
# | `hash_to_block_id` | 事件 |
# |---|---|
# | 多了一个键：`publish` 给一个块算出新的哈希 | `BlockStored`：哈希、父块的哈希、它的 token、块大小 |
# | 少了一个键：`forget` 删掉即将装入别的 token 的块的条目 | `BlockRemoved`：哈希 |
# | 被清空（重置） | `AllBlocksCleared` |
#
# 于是有了本章的**不变量**：从空集合开始、按顺序应用这些事件的订阅者，在每一步之后持有的恰好是 `hash_to_block_id`
# 的全部键。有两个细节让它精确成立。一个块发布时，若它的哈希已被另一个块占着（两个提示词在同一步算了同一个前缀），
# 字典变的是值，不是键：没有事件。第 03 章的 `forget` 只在条目仍指向被复用的块时才删除它：它不删的那个块从来就不是
# 某个键的所有者，所以也没有事件。
#
# 一个块的**父块**是提示词里它前面的那个块，第 03 章把父块的哈希链进了它自己的哈希。父块和 token 是给自己计算键的
# 网关用的：llm-d 的索引器用它自己的哈希函数，沿着父块链对每个块的 token 求哈希，所以只要父块和块大小正确，我们的
# `xxh64` 哈希就可以保持是我们自己的。

# %% [markdown] tags=["en"]
# ## The wire format
#
# vLLM publishes the events on a ZMQ **PUB** socket. Each message is three frames:
#
# 1. the topic (`kv-events` in the configuration below), which a SUB socket filters on;
# 2. a **sequence number**, 8 bytes, big-endian: 0, 1, 2, ..., one per batch, so that a subscriber
#    sees a gap when it missed one;
# 3. the payload: one `KVEventBatch` in msgpack.
#
# A batch is a msgpack array, `[ts, events, data_parallel_rank]`: the time it was made, the
# events of one engine step, and the data-parallel rank (0: our engine is one rank). Each event is
# a msgpack map whose `"type"` says its kind, with the fields in this order:
#
# | `type` | fields |
# |---|---|
# | `BlockStored` | `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name` |
# | `BlockRemoved` | `block_hashes`, `medium` |
# | `AllBlocksCleared` | (none) |
#
# One `BlockStored` may carry a run of blocks of one chain: `parent_block_hash` is the parent of
# the first, each next block's parent is the one before it, and `token_ids` holds all their tokens,
# `block_size` each. `lora_id`, `medium` and `lora_name` have no default in vLLM's structs, so
# they are always sent: `None`, `"GPU"` (vLLM's name for the engine's own KV pool, whatever the
# device) and `None`. Later fields of vLLM's structs have defaults and are left out when they hold
# them (msgspec's `omit_defaults`), as they would be for ours.
#
# This is the format of vLLM 0.26. Until vLLM's pull request 42892 (June 2026) each event was a
# positional array, `["BlockRemoved", [hash], "GPU"]`; every field vLLM added broke the subscribers
# that counted positions, so events became maps. The batch around them is still an array. A
# gateway built for the older format reads neither vLLM 0.26 nor us; exercise 3 writes it.
#
# A second socket, a ZMQ **ROUTER** on `replay_endpoint`, serves subscribers that missed batches
# (the PUB socket drops what a slow subscriber cannot take, and a subscriber that connects late
# missed everything before). The subscriber sends the first sequence number it lacks, 8 bytes
# big-endian; the publisher answers with every batch from there that its buffer still holds
# (`buffer_steps` of them), each as `[topic, sequence number, payload]`, then ends with an empty
# topic, the sequence number −1 and an empty payload.

# %% [markdown] tags=["zh"]
# ## 线上格式
#
# vLLM 把事件发布在一个 ZMQ **PUB** 套接字上。每条消息有三帧：
#
# 1. 主题（topic，下面的配置里是 `kv-events`），SUB 套接字按它过滤；
# 2. **序号**（sequence number），8 字节，大端序：0、1、2……每批一个，订阅者漏了某一批就能看出缺口；
# 3. 载荷：一个 msgpack 编码的 `KVEventBatch`。
#
# 一批是一个 msgpack 数组 `[ts, events, data_parallel_rank]`：它产生的时刻、引擎一步里的事件，以及数据并行的 rank
# （0：我们的引擎只有一个 rank）。每个事件是一个 msgpack 映射，`"type"` 说明它的种类，字段依次为：
#
# | `type` | 字段 |
# |---|---|
# | `BlockStored` | `block_hashes`、`parent_block_hash`、`token_ids`、`block_size`、`lora_id`、`medium`、`lora_name` |
# | `BlockRemoved` | `block_hashes`、`medium` |
# | `AllBlocksCleared` | （无） |
#
# 一个 `BlockStored` 可以带同一条链上连续的若干块：`parent_block_hash` 是第一块的父块，之后每一块的父块就是它前面
# 那一块，`token_ids` 装着它们全部的 token，每块 `block_size` 个。`lora_id`、`medium` 和 `lora_name` 在 vLLM 的结构
# 里没有默认值，所以总是要发：`None`、`"GPU"`（vLLM 对引擎自己的 KV 池的叫法，不论设备是什么）和 `None`。vLLM 结构里
# 更靠后的字段都有默认值，取默认值时就不发（msgspec 的 `omit_defaults`），我们的也一样。
#
# 这是 vLLM 0.26 的格式。在 vLLM 的第 42892 号拉取请求（2026 年 6 月）之前，每个事件是一个按位置排列的数组，
# `["BlockRemoved", [hash], "GPU"]`；vLLM 每加一个字段，按位置数字段的订阅者就坏一次，所以事件改成了映射。包着它们的
# 那一批仍然是数组。为旧格式写的网关既读不懂 vLLM 0.26，也读不懂我们；练习 3 会写出旧格式。
#
# 第二个套接字是 `replay_endpoint` 上的 ZMQ **ROUTER**，为错过了某些批次的订阅者服务（PUB 套接字会丢掉慢的订阅者
# 接不住的消息，晚连上的订阅者则错过了之前的一切）。订阅者发来它缺的第一个序号，8 字节大端序；发布者回答缓冲区里
# 从那里起还留着的每一批（最多 `buffer_steps` 批），每批是 `[主题, 序号, 载荷]`，最后以空主题、序号 −1 和空载荷结束。

# %% [markdown] tags=["en"]
# ## Build it: the setting
#
# vLLM turns the events on with one setting, `--kv-events-config`, a JSON object of its
# `KVEventsConfig`; we take the same object, field for field, as the engine setting
# `kv_events_config`. Chapter 22's command line makes every setting an option, so
# `python -m nanovllm.serve --kv-events-config '{...}'` works with nothing more, and the JSON
# reaches the engine's process with the other settings. The check runs where every setting is
# checked, before the model loads: a key vLLM does not know, a value of the wrong type, an address
# that is not ZMQ's, or a publisher other than `"zmq"` (or vLLM's `"null"`, which means none) is
# refused with its name. After the check the setting is a `KVEventsConfig`, or `None` when the
# events are off. Events need the prefix cache: they are its changes.

# %% [markdown] tags=["zh"]
# ## 动手：配置项
#
# vLLM 用一个配置项打开这些事件：`--kv-events-config`，它的值是 `KVEventsConfig` 的一个 JSON 对象；我们逐字段接受
# 同样的对象，作为引擎配置项 `kv_events_config`。第 22 章的命令行把每个配置项都变成一个选项，所以
# `python -m nanovllm.serve --kv-events-config '{...}'` 无需再做什么就能用，这段 JSON 会和其他配置项一起到达引擎的进程。
# 检查放在所有配置项受检查的地方，在模型加载之前：vLLM 不认识的键、类型不对的值、不是 ZMQ 地址的地址，或者
# `"zmq"`（以及 vLLM 表示“不发布”的 `"null"`）以外的发布方式，都会被拒绝，并指出它的名字。检查之后，这个配置项是
# 一个 `KVEventsConfig`；事件关闭时为 `None`。事件需要前缀缓存：它们就是前缀缓存的变化。

# %% setting: kv events config
#| export config
import difflib
import json
import re
from dataclasses import asdict, dataclass, fields, replace

from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.config import Config, _choice
from nanovllm.utils.checks import check

# en: A ZMQ address: tcp://HOST:PORT (HOST "*" binds every interface), ipc://PATH or inproc://NAME.
# zh: ZMQ 地址：tcp://HOST:PORT（HOST 为 "*" 时绑定所有网卡）、ipc://PATH 或 inproc://NAME。
ZMQ_ADDRESS = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[\w.-]+):(\*|\d+)|ipc://\S+|inproc://\S+")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``, field for field: whether the engine publishes KV events, and where."""
    # zh: vLLM 的 ``KVEventsConfig``，逐字段相同：引擎是否发布 KV 事件，发布到哪里。

    enable_kv_cache_events: bool = False
    # en: "zmq", or "null" for none; None: "zmq" when the events are enabled
    # zh: "zmq"，或表示不发布的 "null"；None：事件打开时为 "zmq"
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    # en: batches kept for replay
    # zh: 为补发保留的批数
    buffer_steps: int = 10_000
    # en: ZMQ's high-water mark: messages a subscriber may fall behind before the PUB socket drops the next ones
    # zh: ZMQ 的高水位线：订阅者最多可以落后多少条消息，超过之后 PUB 套接字丢弃后面的消息
    hwm: int = 100_000
    # en: batches that may wait for the publisher's thread
    # zh: 最多可以有多少批在等发布者的线程
    max_queue_size: int = 100_000
    topic: str = ""


def kv_events_settings(value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
    """The ``kv_events_config`` setting (a JSON object as vLLM's ``--kv-events-config`` takes it, a dict or a
    `KVEventsConfig`), checked: None when it turns the events off. A key that vLLM's config does not have, a value
    of the wrong type or an address that is not ZMQ's is refused, and the message names it."""
    # zh: 检查过的 ``kv_events_config`` 配置项（vLLM 的 ``--kv-events-config`` 所接受的 JSON 对象、一个 dict 或
    # zh: `KVEventsConfig`）：它关闭事件时为 None。vLLM 的配置里没有的键、类型不对的值、不是 ZMQ 地址的地址都会被拒绝，
    # zh: 并在消息里指出是哪一个。
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv_events_config is not valid JSON ({error}): {value!r}") from None
    if isinstance(value, KVEventsConfig):
        value = asdict(value)
    if not isinstance(value, dict):
        raise TypeError(f"kv_events_config must be a JSON object like vLLM's KVEventsConfig, got "
                        f"{type(value).__name__} {value!r}")
    names = [f.name for f in fields(KVEventsConfig)]
    for key in value:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"kv_events_config: unknown key {key!r}{hint}; vLLM's KVEventsConfig has "
                             f"{', '.join(names)}")
    settings = KVEventsConfig(**value)
    enabled = check("kv_events_config.enable_kv_cache_events", settings.enable_kv_cache_events, bool)
    publisher = settings.publisher if settings.publisher is not None else "zmq" if enabled else "null"
    _choice("kv_events_config.publisher", publisher, ("zmq", "null"))
    _check_addresses(settings)
    for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        check(f"kv_events_config.{name}", getattr(settings, name), int, lambda n, least=least: n >= least,
              f">= {least}")
    check("kv_events_config.topic", settings.topic, str)
    return replace(settings, publisher="zmq") if enabled and publisher == "zmq" else None


def _check_addresses(settings: KVEventsConfig) -> None:
    """Refuse an endpoint that is not a ZMQ address, and a replay endpoint that is the events' own."""
    # zh: 拒绝不是 ZMQ 地址的端点，以及与事件端点相同的补发端点。
    rule = "a ZMQ address such as 'tcp://*:5557' (tcp://HOST:PORT, ipc://PATH or inproc://NAME)"
    check("kv_events_config.endpoint", settings.endpoint, str, ZMQ_ADDRESS.fullmatch, rule)
    if settings.replay_endpoint is not None:
        check("kv_events_config.replay_endpoint", settings.replay_endpoint, str, ZMQ_ADDRESS.fullmatch, rule)
        if settings.replay_endpoint == settings.endpoint:
            raise ValueError(f"kv_events_config: replay_endpoint must differ from endpoint, both are "
                             f"{settings.endpoint!r}")


# en: KV events (chapter 27): vLLM's KVEventsConfig, as a JSON string, a dict or a KVEventsConfig; a
# en: KVEventsConfig once checked, None when the events are off.
# zh: KV 事件（第 27 章）：vLLM 的 KVEventsConfig，可以是 JSON 字符串、dict 或 KVEventsConfig；检查之后是一个
# zh: KVEventsConfig，事件关闭时为 None。
@add_fields(Config)
class _KVEvents:
    kv_events_config: str | dict | KVEventsConfig | None = None


@add_to_init(Config)
def _check_kv_events(self) -> None:
    self.kv_events_config = kv_events_settings(self.kv_events_config)
    if self.kv_events_config is not None and not self.enable_prefix_caching:
        raise ValueError("kv_events_config publishes the prefix cache's changes: it needs "
                         "enable_prefix_caching=True")

# %% [markdown] tags=["en"]
# ## Build it: the events and the log
#
# The chapter's module, `nanovllm.engine.kv_events`, starts with the wire format as msgspec
# structs, written from the table above. `array_like=True` makes the batch an array,
# `tag=True` makes each event a map whose `"type"` is its class's name, and `omit_defaults=True`
# leaves out a field that holds its default (the batch's `data_parallel_rank` when it is `None`).
#
# A `KVEventLog` collects one step's events. The prefix cache calls it (next section): `stored`
# for a new key, `removed` for a deleted one, `cleared` for a reset. `stored` extends the event
# before it when the new block's parent is that event's last block, so that a prompt's blocks,
# published in one step, travel as one `BlockStored`, as vLLM sends a request's new blocks.
# `end_step` hands the step's events to a **sink**, a function that takes a list of events: the
# publisher's, in the engine, or whatever a test wants.

# %% [markdown] tags=["zh"]
# ## 动手：事件与日志
#
# 本章的模块 `nanovllm.engine.kv_events` 从线上格式开始，按上面的表格写成 msgspec 的结构。`array_like=True` 让一批
# 成为数组，`tag=True` 让每个事件成为一个映射，其中 `"type"` 是它的类名，`omit_defaults=True` 在字段取默认值时不发
# 它（比如一批的 `data_parallel_rank` 为 `None` 时）。
#
# `KVEventLog` 收集一步的事件。前缀缓存调用它（见下一节）：新键调用 `stored`，删掉的键调用 `removed`，重置调用
# `cleared`。新块的父块若是前一个事件的最后一块，`stored` 就延长那个事件，这样一个提示词在一步里发布的那些块就作为
# 一个 `BlockStored` 发出，和 vLLM 发送一个请求的新块一样。`end_step` 把这一步的事件交给一个**接收函数**（sink），它
# 接受一个事件列表：在引擎里是发布者的那个函数，在测试里是测试想要的任何函数。

# %% default module
#| default_exp engine.kv_events

# %% kv events
#| export
"""KV events: the prefix cache's changes, told to a gateway in vLLM's wire format over ZMQ (chapter 27)."""
# zh: KV 事件：前缀缓存的变化，按 vLLM 的线上格式经 ZMQ 告诉网关（第 27 章）。

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

# en: The format follows vLLM 0.26 (vllm/distributed/kv_events.py): since vLLM's pull request 42892 an event is a
# en: msgpack map tagged "type", the batch around the events an array. The storage tier of every block: "GPU" is
# en: vLLM's name for the engine's own KV pool, on any device.
# zh: 格式遵循 vLLM 0.26（vllm/distributed/kv_events.py）：自 vLLM 的第 42892 号拉取请求起，事件是带 "type" 标签的
# zh: msgpack 映射，包着事件的一批是数组。每个块的存储层级："GPU" 是 vLLM 对引擎自己的 KV 池的叫法，设备是什么都一样。
MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One publication: when it was made, the events, and the data-parallel rank of the engine (0 here). On the
    wire a msgpack array, ``[ts, events, data_parallel_rank]``."""
    # zh: 一次发布：产生的时刻、其中的事件，以及引擎的数据并行 rank（这里是 0）。线上是一个 msgpack 数组，
    # zh: ``[ts, events, data_parallel_rank]``。

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    """A change of the prefix cache. On the wire a msgpack map whose "type" is the class's name."""
    # zh: 前缀缓存的一次变化。线上是一个 msgpack 映射，其中 "type" 是类名。


class BlockStored(KVCacheEvent):
    """Blocks that became findable: a run of one chain whose first block follows ``parent_block_hash`` (None: it
    starts a prompt), with all their tokens, ``block_size`` a block. vLLM gives the last three no default: they are
    always sent."""
    # zh: 变得可以被找到的块：同一条链上连续的一段，第一块接在 ``parent_block_hash`` 之后（None：它是提示词的开头），
    # zh: 带着它们全部的 token，每块 ``block_size`` 个。vLLM 没给最后三个字段默认值：它们总是要发。

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks that are no longer findable: evicted, or reused for other tokens."""
    # zh: 不再能被找到的块：被逐出了，或者被复用来装别的 token。

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache forgot every block (a reset)."""
    # zh: 前缀缓存忘掉了所有的块（一次重置）。


class KVEventBatch(EventBatch):
    """A batch as a subscriber decodes it: events of the three kinds."""
    # zh: 订阅者解码出来的一批：由这三种事件组成。

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventLog:
    """The prefix cache's changes since the last step ended, as KV events: a key that ``hash_to_block_id`` gains is
    a BlockStored, a key it loses a BlockRemoved, the index emptied AllBlocksCleared. A subscriber that applies them
    in order holds the index's keys. `end_step` hands a step's events to ``sink``, in one list."""
    # zh: 自上一步结束以来前缀缓存的变化，以 KV 事件表示：``hash_to_block_id`` 多出的键是一个 BlockStored，少掉的键是
    # zh: 一个 BlockRemoved，索引被清空是 AllBlocksCleared。按顺序应用它们的订阅者持有索引的全部键。
    # zh: `end_step` 把一步的事件放在一个列表里交给 ``sink``。

    def __init__(self, block_size: int, sink: Callable[[list[KVCacheEvent]], None]) -> None:
        self.block_size, self.sink = block_size, sink
        self.pending: list[KVCacheEvent] = []

    def stored(self, block_hash: int, parent: int | None, token_ids: list[int]) -> None:
        """A new key, ``block_hash``, of a block that holds ``token_ids`` and follows ``parent`` (None: it starts a
        prompt). The next block of a chain extends the event before it: one event for a prompt's run of blocks."""
        # zh: 一个新键 ``block_hash``：它的块装着 ``token_ids``，接在 ``parent`` 之后（None：它是提示词的开头）。
        # zh: 链上的下一块延长它前面的那个事件：一个提示词的一段连续的块只用一个事件。
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids += token_ids
            return
        self.pending.append(BlockStored(block_hashes=[block_hash], parent_block_hash=parent,
                                        token_ids=list(token_ids), block_size=self.block_size, lora_id=None,
                                        medium=MEDIUM, lora_name=None))

    def removed(self, block_hash: int) -> None:
        """A key deleted: its block is about to hold other tokens."""
        # zh: 一个键被删除：它的块即将装入别的 token。
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM))

    def cleared(self) -> None:
        """Every key deleted at once."""
        # zh: 所有的键一次全部删除。
        self.pending.append(AllBlocksCleared())

    def end_step(self) -> None:
        """Hand the events since the last call to the sink, in one list (nothing when there are none)."""
        # zh: 把上次调用以来的事件放在一个列表里交给接收函数（没有事件就什么也不做）。
        if self.pending:
            events, self.pending = self.pending, []
            self.sink(events)

# %% [markdown] tags=["en"]
# ## Build it: the cache says what changed
#
# Chapter 03's `PrefixCache` changes `hash_to_block_id` in exactly two places, and this chapter
# gives both a line that tells the log, when there is one (`events`, `None` until someone listens;
# then the cost of events that nobody wants is one comparison per new key):
#
# - `publish`, which hashes the newly full blocks of a sequence and enters each one. Before the
#   entry, it asks whether the hash is already a key: only a new one is a `BlockStored`, with the
#   parent it was chained to. The loop is chapter 03's, line for line; what it gains is the two
#   lines under the comment "a new key".
# - `forget`, which deletes a block's entry only if the entry is still the block's own: the
#   deletion, and only it, is a `BlockRemoved`.
#
# Both methods are chapter 03's whole, retyped here, because the line each one needs sits inside
# it: a hook planted in chapter 03 for a chapter twenty-four chapters later would name a concept
# nobody has met there. And a reset gets a method of its own, `clear`: the index emptied, and
# `AllBlocksCleared`. Blocks keep their hashes, which only `forget` compares with the index: a
# block whose key is gone is just not found, and its reuse removes nothing.

# %% [markdown] tags=["zh"]
# ## 动手：缓存说出变了什么
#
# 第 03 章的 `PrefixCache` 恰好在两个地方修改 `hash_to_block_id`，本章给这两处各加一行，在有日志时告诉它（`events`，
# 在有人监听之前为 `None`；于是没人要的事件只花每个新键一次比较）：
#
# - `publish` 给一个序列新写满的块求哈希，并把每一块登记进去。登记之前，它先问这个哈希是否已经是键：只有新的
#   才是一个 `BlockStored`，带着它链接到的父块。循环与第 03 章逐行相同；多出来的只是注释“a new key”下面那两行。
# - `forget` 只在条目仍属于这个块时才删除它：这次删除，且只有它，是一个 `BlockRemoved`。
#
# 这两个方法都是把第 03 章的整个方法重写一遍，因为各自需要的那一行就在方法中间：在第 03 章为二十四章之后的一章埋下
# 一个钩子，就得在那里提到一个还没人见过的概念。重置另有一个方法 `clear`：清空索引，并发出 `AllBlocksCleared`。
# 块保留自己的哈希，只有 `forget` 会拿它和索引比较：键已经没了的块只是找不到而已，复用它时什么也不移除。

# %%
# en: Chapter 02's block, which `forget` takes. (The package's prefix cache names it for type checkers only: the
# en: block manager's module imports the prefix cache's.)
# zh: `forget` 接受的第 02 章的块。（包里的前缀缓存只为类型检查器写出这个名字：块管理器的模块导入了前缀缓存的模块。）
from nanovllm.engine.block_manager import Block

# %% the cache records its changes
#| export engine.prefix_cache
from typing import TYPE_CHECKING

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.prefix_cache import NO_HASH, PrefixCache, block_hash
from nanovllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.engine.kv_events import KVEventLog


@add_to_init(PrefixCache)
def _init_events(self) -> None:
    # en: KV events (chapter 27): the log that publish, forget and clear tell their changes; None: nobody listens.
    # zh: KV 事件（第 27 章）：publish、forget 和 clear 把它们做的修改告诉这个日志；None：没有人在听。
    self.events: KVEventLog | None = None


@add_to_class(PrefixCache)
def publish(self, seq: Sequence) -> None:
    """Publish ``seq``'s full blocks whose KV has been written (call after each step)."""
    # zh: 发布 ``seq`` 中 KV 已经写入的写满的块（每一步之后调用）。
    num_full = seq.num_cached_tokens // self.block_size
    start = num_full
    while start > 0 and self.blocks[seq.block_table[start - 1]].hash == NO_HASH:
        start -= 1
    parent = self.blocks[seq.block_table[start - 1]].hash if start > 0 else NO_HASH
    for i in range(start, num_full):
        block = self.blocks[seq.block_table[i]]
        block.token_ids = seq.block(i)
        block.hash = block_hash(block.token_ids, parent)
        # en: A new key (not one that another block holds already) is a KV event.
        # zh: 新的键（不是另一个块已经占着的键）是一个 KV 事件。
        if self.events is not None and block.hash not in self.hash_to_block_id:
            self.events.stored(block.hash, None if parent == NO_HASH else parent, block.token_ids)
        # en: If another block already holds the same prefix, the newest one wins; forget() copes.
        # zh: 若已有另一个块存着同样的前缀，以最新的为准；forget() 能正确处理这种情况。
        self.hash_to_block_id[block.hash] = block.block_id
        parent = block.hash


@add_to_class(PrefixCache)
def forget(self, block: Block) -> None:
    """``block`` is about to be overwritten: remove its entry, if the entry is still its own."""
    # zh: ``block`` 即将被覆盖：删除它的条目，前提是这个条目仍然指向它自己。
    if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id:
        del self.hash_to_block_id[block.hash]
        if self.events is not None:
            self.events.removed(block.hash)


@add_to_class(PrefixCache)
def clear(self) -> None:
    """Forget every published block at once (a reset): later prompts find none of them."""
    # zh: 一次忘掉所有已发布的块（重置）：之后的提示词一个也找不到。
    self.hash_to_block_id.clear()
    if self.events is not None:
        self.events.cleared()

# %% [markdown] tags=["en"]
# ### See it: one sequence, a block reused
#
# A block manager of four blocks of four tokens, with a log whose sink prints each step's events
# beside the index's keys. A sequence of ten tokens computes them all in one step: its two full
# blocks are published. A second sequence then needs four fresh blocks: the free list hands it
# the two that hold the first sequence's tokens, and their keys go. (Hashes are shown by their
# first four hex digits.)

# %% [markdown] tags=["zh"]
# ### 看它运行：一个序列，一个被复用的块
#
# 一个有四块、每块四个 token 的块管理器，配一个日志，它的接收函数把每一步的事件和索引的键并排打印出来。一个十个
# token 的序列在一步里把它们全部算完：它的两个写满的块被发布。接着第二个序列需要四个新块：空闲队列交给它的有两块
# 正装着第一个序列的 token，它们的键就没了。（哈希只显示前四位十六进制数字。）

# %%
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.kv_events import BlockRemoved, BlockStored
from nanovllm.sampling_params import SamplingParams


def short(block_hash: int) -> str:
    """A hash, by its first four hex digits."""
    # zh: 一个哈希，只显示前四位十六进制数字。
    return f"{block_hash:016x}"[:4]


def describe(event: object) -> str:
    """One event, in a line of the reader's language."""
    # zh: 一个事件，用读者的语言写成一行。
    if isinstance(event, BlockStored):
        parent = "-" if event.parent_block_hash is None else short(event.parent_block_hash)
        return say("stored {hashes} after {parent}: tokens {tokens}",
                   hashes=" ".join(map(short, event.block_hashes)), parent=parent, tokens=event.token_ids)
    if isinstance(event, BlockRemoved):
        return say("removed {hashes}", hashes=" ".join(map(short, event.block_hashes)))
    return say("all blocks cleared")


manager = BlockManager(num_blocks=4, block_size=4)
cache = manager.prefix_cache


def show(events: list) -> None:
    for event in events:
        print(describe(event))
    print(say("hash_to_block_id {keys}", keys=sorted(map(short, cache.hash_to_block_id))))


cache.events = KVEventLog(block_size=4, sink=show)
first = Sequence(list(range(1, 11)), SamplingParams(max_tokens=1), block_size=4)
manager.allocate(first)
# en: The step computed all ten tokens: the scheduler's postprocess publishes what is full, and the step ends.
# zh: 这一步算完了全部十个 token：调度器的 postprocess 发布写满的块，这一步结束。
first.num_cached_tokens = 10
manager.publish_full_blocks(first)
cache.events.end_step()
manager.deallocate(first)
second = Sequence(list(range(21, 37)), SamplingParams(max_tokens=1), block_size=4)
manager.allocate(second)
cache.events.end_step()
assert [b.ref_count for b in manager.blocks] == [1, 1, 1, 1] and not cache.hash_to_block_id

# %% [markdown] tags=["en"]
# The first sequence's blocks were freed but kept their keys (a later prompt could still hit
# them); only when the free list handed them out for other tokens did `forget` delete the keys,
# and the log say so. That is the whole life of a key: stored when its block is published,
# removed when its block is reused.

# %% [markdown] tags=["zh"]
# 第一个序列的块被释放了，但键还在（之后的提示词仍可能命中它们）；直到空闲队列把它们交出去装别的 token，`forget`
# 才删掉这些键，日志也才说出来。这就是一个键的一生：它的块被发布时存入，它的块被复用时移除。

# %% [markdown] tags=["en"]
# ## Build it: the publisher
#
# `ZmqEventPublisher` puts the batches on the wire. The rule that shapes it: **the engine never
# waits for a subscriber.** A gateway that stops reading must not slow a step down, so the engine's
# thread only wraps the step's events in a `KVEventBatch`, gives it the next sequence number and
# puts it in a queue, without waiting (`put_nowait`). A thread of the publisher's own owns both
# sockets (a ZMQ socket belongs to one thread at a time): it encodes each batch, sends its three
# frames, keeps it in the replay buffer, and between batches answers replay requests (after
# sending what was queued before the request: a replay reaches as far as the engine has). The PUB
# socket itself never blocks: with `hwm` messages queued for a subscriber that does not read, ZMQ
# drops the next ones for it, and the gap in the sequence numbers tells the subscriber to ask
# for a replay. If the queue to the thread is ever full (`max_queue_size`), the batch is dropped
# and counted, and its sequence number is missing on the wire too: a subscriber sees the gap, and
# a replay that cannot fill it.
#
# Where the sockets go follows vLLM: a PUB endpoint with a wildcard host (`*`, `::`) or of
# `ipc://` or `inproc://` is **bound**, any other is **connected** to (a collector that binds),
# and the ROUTER is always bound. An address that cannot be bound (a port taken, a malformed
# host) stops the engine at its start, naming the setting. Bound on `*`, the events reach anyone
# who can reach the port, and they carry the token ids of every prompt: keep the port where only
# the gateway reaches it (a firewall, `ipc://` on one machine, or the other way round: the gateway
# binds, and the engine connects to it).

# %% [markdown] tags=["zh"]
# ## 动手：发布者
#
# `ZmqEventPublisher` 把一批批事件放到线上。决定它形状的规则是：**引擎从不等订阅者**。一个不再读的网关不能拖慢任何
# 一步，所以引擎的线程只是把这一步的事件装进一个 `KVEventBatch`，给它下一个序号，放进一个队列，而且不等待
# （`put_nowait`）。发布者自己的一个线程拥有两个套接字（一个 ZMQ 套接字同一时刻只属于一个线程）：它编码每一批，发出
# 三帧，把它留在补发缓冲区里，并在两批之间回答补发请求（先发出请求到来之前已经排队的批次：补发总能补到引擎已经走到的
# 地方）。PUB 套接字本身从不阻塞：给一个不读的订阅者排了 `hwm` 条
# 消息之后，ZMQ 就丢掉给它的后续消息，序号上的缺口告诉订阅者去请求补发。如果通往线程的队列满了（`max_queue_size`），
# 这一批就被丢弃并计数，它的序号在线上也缺失：订阅者看得到缺口，补发也补不上它。
#
# 套接字放在哪里遵循 vLLM：主机是通配符（`*`、`::`）或者是 `ipc://`、`inproc://` 的 PUB 端点会被**绑定**（bind），
# 其他的则去**连接**（connect）一个自己绑定了地址的收集者；ROUTER 总是绑定。绑定不了的地址（端口被占、主机写错）会让
# 引擎在启动时就停下，并指出是哪个配置项。绑定在 `*` 上时，任何能访问这个端口的人都能收到这些事件，而事件里带着每个
# 提示词的 token id：请让这个端口只有网关能访问（用防火墙，单机时用 `ipc://`，或者反过来：网关绑定地址，引擎去连接它）。

# %% publisher
#| export
import logging
import queue
import threading
import time
from collections import deque

import zmq

from nanovllm.config import KVEventsConfig

_logger = logging.getLogger("nanovllm.kv_events")


class ZmqEventPublisher:
    """Publishes KV event batches as vLLM does. On the PUB socket each batch is three frames: the topic, the batch's
    sequence number (8 bytes, big-endian) and the msgpack payload. On the ROUTER socket (``replay_endpoint``) a
    subscriber sends the first sequence number it lacks (8 bytes, big-endian) and gets every batch from there that
    the buffer holds, as ``[topic, number, payload]``, then ``[b"", -1, b""]``. A thread of its own owns the
    sockets: the engine only queues a batch, and never waits."""
    # zh: 像 vLLM 那样发布 KV 事件批次。在 PUB 套接字上每一批是三帧：主题、这一批的序号（8 字节，大端序）和
    # zh: msgpack 载荷。在 ROUTER 套接字（``replay_endpoint``）上，订阅者发来它缺的第一个序号（8 字节，大端序），
    # zh: 得到缓冲区里从那里起的每一批，每批为 ``[主题, 序号, 载荷]``，然后是 ``[b"", -1, b""]``。套接字归它自己的
    # zh: 一个线程所有：引擎只是把一批放进队列，从不等待。

    # en: The sequence number that ends a replay.
    # zh: 补发结束时的序号。
    END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
    # en: How long a closed PUB socket may take to deliver the batches it holds, in milliseconds.
    # zh: 关闭后的 PUB 套接字送出手里的批次最多可以用多久，单位毫秒。
    LINGER_MS = 1000

    def __init__(self, config: KVEventsConfig) -> None:
        self.config, self.topic = config, config.topic.encode()
        # en: (sequence number, batch) for the thread; None: stop
        # zh: 交给线程的（序号，批次）；None：停止
        self.queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(config.max_queue_size)
        self.next_seq = 0
        # en: batches dropped because the queue was full: their sequence numbers never appear on the wire
        # zh: 因队列已满而丢弃的批次：它们的序号永远不会出现在线上
        self.dropped = 0
        self.closed = False
        # en: (sequence number, payload) of the last buffer_steps batches, for replay
        # zh: 最近 buffer_steps 批的（序号，载荷），供补发用
        self.sent: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self.encoder = msgspec.msgpack.Encoder()
        self.context = zmq.Context()
        try:
            self.pub = self._socket(zmq.PUB, "endpoint", config.endpoint)
            replay = config.replay_endpoint
            self.replay = None if replay is None else self._socket(zmq.ROUTER, "replay_endpoint", replay)
        except ValueError:
            self.context.destroy(linger=0)
            raise
        self.thread = threading.Thread(target=self._run, name="nanovllm-kv-events", daemon=True)
        self.thread.start()

    def _socket(self, kind: int, name: str, address: str) -> zmq.Socket:
        """A socket of ``kind`` on ``address`` (the setting ``name``), bound or connected as vLLM does it: a PUB
        binds an address with a wildcard host or of ipc/inproc and connects to any other, a ROUTER binds."""
        # zh: ``address``（配置项 ``name``）上一个 ``kind`` 类型的套接字，按 vLLM 的做法绑定或连接：主机是通配符，
        # zh: 或者是 ipc/inproc 地址时 PUB 绑定，否则去连接；ROUTER 总是绑定。
        socket = self.context.socket(kind)
        # en: Closed, the PUB socket still has a second to deliver what it holds; the ROUTER drops its replies.
        # zh: 关闭之后，PUB 套接字还有一秒钟把手里的消息送出去；ROUTER 则丢掉它的回复。
        socket.setsockopt(zmq.LINGER, self.LINGER_MS if kind == zmq.PUB else 0)
        if kind == zmq.PUB:
            socket.setsockopt(zmq.SNDHWM, self.config.hwm)
        binds = kind == zmq.ROUTER or "*" in address or "::" in address or address.startswith(("ipc:", "inproc:"))
        try:
            socket.bind(address) if binds else socket.connect(address)
        except zmq.ZMQError as error:
            socket.close()
            how = "bind" if binds else "connect to"
            raise ValueError(f"kv_events_config.{name}: cannot {how} {address!r}: {error}") from None
        return socket

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch, with the next sequence number (the sink of the scheduler's log).
        Never waits: a batch that finds the queue full is dropped, and its number is missing on the wire."""
        # zh: 把一步的事件作为一批、带着下一个序号放进队列（调度器日志的接收函数）。从不等待：遇到队列已满的批次
        # zh: 被丢弃，它的序号在线上也就缺失了。
        if self.closed:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self.queue.put_nowait((seq, KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                _logger.warning("KV events: %d batches wait for the publisher's thread (max_queue_size); batch %d "
                                "and the next ones that find the queue full are dropped", self.queue.maxsize, seq)

    def _run(self) -> None:
        """The thread: send the queued batches, answer replay requests in between, until `close`."""
        # zh: 线程：发出排队的批次，其间回答补发请求，直到 `close`。
        try:
            while self._send_queued(wait=0.02):
                if self.replay is not None and self.replay.poll(0):
                    # en: The batches queued before the request came go out first: a replay reaches as far as the
                    # en: engine did.
                    # zh: 请求到来之前已经排队的批次先发出：补发总能补到引擎已经走到的地方。
                    if not self._send_queued(wait=0):
                        return
                    self._answer_replay()
        finally:
            self.pub.close()
            if self.replay is not None:
                self.replay.close()

    def _send_queued(self, wait: float) -> bool:
        """Send every queued batch, waiting up to ``wait`` seconds for the first; False once `close` said stop."""
        # zh: 发出排队的每一批，第一批最多等 ``wait`` 秒；`close` 要求停止之后返回 False。
        try:
            item = self.queue.get(timeout=wait)
            while item is not None:
                seq, batch = item
                self._send(seq.to_bytes(8, "big"), self.encoder.encode(batch))
                item = self.queue.get_nowait()
            return False
        except queue.Empty:
            return True

    def _send(self, seq: bytes, payload: bytes) -> None:
        """Put one batch on the PUB socket (which drops it for a subscriber already ``hwm`` messages behind)."""
        # zh: 把一批放到 PUB 套接字上（对已经落后 ``hwm`` 条消息的订阅者，它会丢掉这一批）。
        try:
            self.pub.send_multipart([self.topic, seq, payload])
        except zmq.ZMQError as error:
            _logger.warning("KV events: batch %d was not sent: %s", int.from_bytes(seq, "big"), error)
        self.sent.append((seq, payload))

    def _answer_replay(self) -> None:
        """Answer one replay request, ``[identity, b"", first]`` as a REQ socket sends it: every buffered batch from
        ``first`` on, then the end marker. A ``first`` that is not 8 bytes gets the end marker alone."""
        # zh: 回答一个补发请求，即 REQ 套接字发来的 ``[identity, b"", first]``：缓冲区里从 ``first`` 起的每一批，
        # zh: 然后是结束标记。``first`` 不是 8 个字节时只回结束标记。
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or frames[1]:
            _logger.warning("KV events: a replay request of %d frames is not [identity, b'', first]", len(frames))
            return
        client, _, start = frames
        if len(start) == 8:
            first = int.from_bytes(start, "big")
            for seq, payload in self.sent:
                if int.from_bytes(seq, "big") >= first:
                    self.replay.send_multipart([client, b"", self.topic, seq, payload])
        self.replay.send_multipart([client, b"", b"", self.END_OF_REPLAY, b""])

    def close(self) -> None:
        """Send the batches already queued, stop the thread and close the sockets (idempotent)."""
        # zh: 发出已经排队的批次，停止线程，关闭套接字（可重复调用）。
        if self.closed:
            return
        self.closed = True
        try:
            self.queue.put(None, timeout=5)
        except queue.Full:
            pass
        self.thread.join(timeout=5)
        # en: The thread closed the sockets; a thread that is stuck has its sockets closed under it.
        # zh: 线程已经关闭了套接字；卡住的线程，它的套接字就在它底下被关掉。
        if self.thread.is_alive():
            self.context.destroy(linger=0)
        else:
            self.context.term()

# %% [markdown] tags=["en"]
# ## Build it: the step ends, the events leave
#
# A gateway wants the changes one engine step at a time, as vLLM sends them: one batch per step
# that changed the cache. The scheduler ends every step the same way, whatever drove it (chapter
# 10's loop, chapter 18's asynchronous one, chapter 25's verify step): `resolve` records the
# step's tokens, publishes the full blocks, and announces `"postprocess"` to its observer through
# `_notify`. Everything the step did to the cache happened before that announcement: its
# schedule's allocations (which `forget`) and its publications. So `_notify`, retyped from
# chapter 20 with two more lines, ends the log's step there. (The observer slot itself stays the
# server's and the live page's: chapter 21 puts its own observer in it.)
#
# `record_kv_events(sink)` gives the prefix cache a log whose steps go to `sink`; a test can give
# the scheduler a sink of its own. The engine's sink is the publisher's `publish`:
# `publish_kv_events` starts the publisher, once (a second call finds it started), when
# `kv_events_config` asks for it, and the engine's `exit` (retyped from chapter 25 with two more
# lines) closes it after the batches already queued have left. `reset_prefix_cache`, vLLM's name,
# empties the cache and ends the log's step at once: subscribers hear `AllBlocksCleared` without
# waiting for the next step.

# %% [markdown] tags=["zh"]
# ## 动手：一步结束，事件出发
#
# 网关要按引擎的一步一步拿到这些变化，就像 vLLM 发送的那样：每个改了缓存的步发一批。调度器结束每一步的方式都一样，
# 不管是谁在驱动它（第 10 章的循环、第 18 章的异步循环、第 25 章的验证步）：`resolve` 记下这一步的 token，发布写满的块，
# 然后经 `_notify` 向它的观察者宣布 `"postprocess"`。这一步对缓存所做的一切都发生在这次宣布之前：它的调度所做的
# 分配（会调用 `forget`）以及它的发布。所以从第 20 章重写过来、多了两行的 `_notify` 就在那里结束日志的这一步。（观察者
# 的位置本身仍归服务器和实时页面：第 21 章在那里放了它自己的观察者。）
#
# `record_kv_events(sink)` 给前缀缓存一个日志，日志的每一步都交给 `sink`；测试可以给调度器一个它自己的接收函数。
# 引擎的接收函数是发布者的 `publish`：`kv_events_config` 要求时，`publish_kv_events` 启动发布者，而且只启动一次（第二次
# 调用发现它已经启动了）；引擎的 `exit`（从第 25 章重写过来，多了两行）在已经排队的批次都发出去之后关闭它。
# `reset_prefix_cache`（vLLM 的叫法）清空缓存并立刻结束日志的这一步：订阅者不必等到下一步就能听到 `AllBlocksCleared`。

# %% the scheduler ends a step
#| export engine.scheduler
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from nanovllm.config import KVEventsConfig
    from nanovllm.engine.kv_events import KVCacheEvent, KVEventLog, ZmqEventPublisher


@add_to_init(Scheduler)
def _init_kv_events(self) -> None:
    # en: KV events (chapter 27): the prefix cache's log, ended with each step, and the engine's publisher; None when
    # en: nobody listens.
    # zh: KV 事件（第 27 章）：前缀缓存的日志，每一步结束时结一次，以及引擎的发布者；没人在听时为 None。
    self.kv_events: KVEventLog | None = None
    self.kv_event_publisher: ZmqEventPublisher | None = None


@add_to_class(Scheduler)
def record_kv_events(self, sink: Callable[[list[KVCacheEvent]], None]) -> None:
    """Record the prefix cache's changes as KV events, and hand each step's to ``sink`` in one list when the step
    ends ("postprocess"). Without prefix caching there is nothing to record."""
    # zh: 把前缀缓存的变化记成 KV 事件，每一步结束时（"postprocess"）把这一步的事件放在一个列表里交给 ``sink``。
    # zh: 没有前缀缓存就没有可记的东西。
    # en: Imported here, as in publish_kv_events: an engine without KV events never imports msgspec or pyzmq.
    # zh: 在这里才导入，publish_kv_events 也一样：不用 KV 事件的引擎从不导入 msgspec 和 pyzmq。
    from nanovllm.engine.kv_events import KVEventLog

    cache = self.block_manager.prefix_cache
    if cache is not None:
        self.kv_events = cache.events = KVEventLog(cache.block_size, sink)


@add_to_class(Scheduler)
def publish_kv_events(self, settings: KVEventsConfig) -> ZmqEventPublisher:
    """Publish the prefix cache's changes over ZMQ as ``settings`` say, one batch per step; returns the publisher
    (the one already started, on a second call)."""
    # zh: 按 ``settings`` 经 ZMQ 发布前缀缓存的变化，每步一批；返回发布者（第二次调用时返回已经启动的那个）。
    from nanovllm.engine.kv_events import ZmqEventPublisher

    if self.kv_event_publisher is None:
        self.kv_event_publisher = ZmqEventPublisher(settings)
        self.record_kv_events(self.kv_event_publisher.publish)
    return self.kv_event_publisher


@add_to_class(Scheduler)
def _notify(self, event: str, data: dict) -> None:
    """Call the observer. A scheduler inside an engine keeps what it raises in ``observer_errors``, and the engine
    raises it once the step is whole: an observer must not cut a step in half. A step ends with "postprocess":
    the KV events of the step leave then, in one batch."""
    # zh: 调用观察者。引擎中的调度器把观察者抛出的异常存进 ``observer_errors``，等这一步完整后由引擎抛出：
    # zh: 观察者不能把一步截成两半。一步以 "postprocess" 结束：这一步的 KV 事件就在这时作为一批发出。
    if event == "postprocess" and self.kv_events is not None:
        self.kv_events.end_step()
    if self.observer is not None:
        try:
            self.observer(event, data)
        # en: even a KeyboardInterrupt the observer raises itself
        # zh: 包括观察者自己抛出的 KeyboardInterrupt。
        except BaseException as error:
            if self.observer_errors is None:
                raise
            self.observer_errors.append(error)

# %% the engine publishes
#| export engine.llm_engine
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.llm_engine import LLMEngine


@add_to_init(LLMEngine)
def _init_kv_event_publisher(self) -> None:
    # en: KV events (kv_events_config, chapter 27): the scheduler publishes the prefix cache's changes, a batch per
    # en: step. An endpoint that cannot be bound stops the engine: what it started exits first.
    # zh: KV 事件（kv_events_config，第 27 章）：调度器发布前缀缓存的变化，每步一批。绑定不了的端点让引擎停下：
    # zh: 它已经启动的东西先退出。
    if self.config.kv_events_config is not None:
        try:
            self.scheduler.publish_kv_events(self.config.kv_events_config)
        except BaseException:
            self.exit()
            raise


@add_to_class(LLMEngine)
def exit(self) -> None:
    """Release the model runner, what the speculator's proposer holds, and the KV event publisher, once the
    batches it holds have left (idempotent)."""
    # zh: 释放模型执行器、投机器的提议器持有的东西，以及 KV 事件的发布者（等它手里的批次发出之后）（可重复调用）。
    with self._one_call("exit"):
        if self.scheduler.kv_event_publisher is not None:
            self.scheduler.kv_event_publisher.close()
        self.model_runner.exit()
        if self.speculator is not None:
            self.speculator.exit()


@add_to_class(LLMEngine)
def reset_prefix_cache(self) -> None:
    """Forget every block the prefix cache holds (vLLM's ``reset_prefix_cache``): later prompts find no hits,
    and the subscribers of KV events hear AllBlocksCleared at once. Running requests keep their blocks."""
    # zh: 忘掉前缀缓存持有的所有块（vLLM 的 ``reset_prefix_cache``）：之后的提示词一个也命中不了，KV 事件的订阅者立刻
    # zh: 听到 AllBlocksCleared。正在运行的请求保留它们的块。
    with self._one_call("reset_prefix_cache"):
        cache = self.scheduler.block_manager.prefix_cache
        if cache is not None:
            cache.clear()
        if self.scheduler.kv_events is not None:
            self.scheduler.kv_events.end_step()

# %% [markdown] tags=["en"]
# ## See it: a subscriber follows an engine
#
# A tiny Qwen3 on the CPU, with blocks of four tokens and a pool of eight blocks, so that a third
# prompt must reuse the blocks of the first two. The events go to free ports of this machine.
#
# The subscriber below is a gateway's side of one replica, in a few lines: a SUB socket for the
# batches as they come, and a DEALER socket for replays (a REQ socket, which vLLM's example
# subscriber uses, takes one reply per request, and a replay is many; a DEALER sends the empty
# frame that a REQ would put in front, and takes every reply). It keeps `next_seq`, the first
# sequence number it has not applied, and `keys`, the hashes it believes the cache holds. A batch
# with a larger number than `next_seq` means it missed some: it asks for a replay from `next_seq`.
# That happens at once here: a SUB socket receives nothing until its subscription has reached the
# publisher, a few milliseconds after it connects, and the engine's first step is faster than
# that.
#
# Three requests run one after the other: a prompt of ten tokens; a prompt that shares its first
# eight; a prompt of 24 other tokens. After each engine step, the subscriber reads every batch the
# engine published so far, and its keys are compared with the engine's `hash_to_block_id`. Then
# `reset_prefix_cache` empties the cache.

# %% [markdown] tags=["zh"]
# ## 看它运行：订阅者跟着一个引擎
#
# 一个在 CPU 上运行的小 Qwen3，块大小为四个 token，块池只有八块，这样第三个提示词就必须复用前两个用过的块。事件发往
# 本机的空闲端口。
#
# 下面的订阅者用寥寥几行写出网关这一侧对一个副本做的事：一个 SUB 套接字接收随时到来的批次，一个 DEALER 套接字用于补发
# （vLLM 的示例订阅者用的 REQ 套接字每个请求只收一个回复，而一次补发有许多个回复；DEALER 发出 REQ 本会放在前面的那个
# 空帧，并且收下所有回复）。它记着 `next_seq`，即它还没应用的第一个序号，以及 `keys`，即它认为缓存里有的那些哈希。
# 序号比 `next_seq` 大的批次说明它漏掉了一些：它请求从 `next_seq` 开始补发。这里一开始就会发生：SUB 套接字在它的订阅
# 到达发布者之前什么也收不到，这要在连接之后几毫秒，而引擎的第一步比这还快。
#
# 三个请求依次运行：一个十个 token 的提示词；一个与它共享前八个 token 的提示词；一个由另外 24 个 token 组成的提示词。
# 引擎每走一步，订阅者就读完引擎到此为止发布的所有批次，再拿它的键和引擎的 `hash_to_block_id` 比较。最后
# `reset_prefix_cache` 清空缓存。

# %%
import msgspec
import zmq

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.kv_events import KVEventBatch
from nanovllm.llm import LLM
from nanovllm.serve.process import free_port


class Subscriber:
    """A gateway's side of one replica's KV events: batches from the PUB socket as they come, the ones it missed
    from the replay socket; ``keys`` is what it believes the cache holds."""
    # zh: 网关这一侧对一个副本的 KV 事件所做的事：从 PUB 套接字接收随时到来的批次，从补发套接字拿回漏掉的批次；
    # zh: ``keys`` 是它认为缓存里有的东西。

    def __init__(self, context: zmq.Context, events_port: int, replay_port: int, topic: bytes) -> None:
        self.live = context.socket(zmq.SUB)
        self.live.connect(f"tcp://127.0.0.1:{events_port}")
        self.live.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay = context.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq, self.keys = 0, set()
        # en: every payload applied, by sequence number; the batches applied since the last catch_up
        # zh: 应用过的每个载荷，按序号存放；上次 catch_up 以来应用的批次
        self.payloads: dict[int, bytes] = {}
        self.news: list[tuple[int, KVEventBatch]] = []

    def apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.keys.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.keys.difference_update(event.block_hashes)
            else:
                self.keys.clear()
        self.payloads[seq], self.next_seq = payload, seq + 1
        self.news.append((seq, batch))

    def ask_replay(self) -> None:
        """Apply every batch from ``next_seq`` on that the publisher still holds, up to its end marker."""
        # zh: 应用发布者手里从 ``next_seq`` 起还留着的每一批，直到它的结束标记。
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            _, _, seq, payload = self.replay.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return
            if number >= self.next_seq:
                self.apply(number, payload)

    def catch_up(self, until: int) -> list[tuple[int, KVEventBatch]]:
        """Apply every batch numbered below ``until``, live ones as they come and a replay for a gap; returns the
        batches applied since the last call."""
        # zh: 应用序号小于 ``until`` 的每一批：随时到来的直接应用，遇到缺口就请求补发；返回上次调用以来应用的批次。
        while self.next_seq < until:
            if not self.live.poll(200):
                self.ask_replay()
                continue
            _, seq, payload = self.live.recv_multipart()
            number = int.from_bytes(seq, "big")
            if number > self.next_seq:
                self.ask_replay()
            if number == self.next_seq:
                self.apply(number, payload)
        news, self.news = self.news, []
        return news


tiny = str(build_tiny_model("qwen3"))
events_port, replay_port = free_port(), free_port()
kv_events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                    "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events", "buffer_steps": 10000}
llm = LLM(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=8, max_model_len=64,
          kv_events_config=kv_events_config)
publisher = llm.scheduler.kv_event_publisher
context = zmq.Context()
subscriber = Subscriber(context, events_port, replay_port, b"kv-events")


def print_news(step: int, kind: str) -> None:
    for seq, batch in subscriber.catch_up(publisher.next_seq):
        for event in batch.events:
            print(say("step {step:>2} {kind:<7} batch {seq}: {event}", step=step, kind=kind, seq=seq,
                      event=describe(event)))


steps, held = 0, []
for prompt, max_tokens in (([*range(1, 11)], 6), ([*range(1, 9), 21, 22, 23], 2), ([*range(40, 64)], 4)):
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while not llm.is_finished():
        is_prefill = llm.step()[2]
        steps += 1
        print_news(steps, "prefill" if is_prefill else "decode")
        held.append(subscriber.keys == set(llm.scheduler.block_manager.hash_to_block_id))
llm.reset_prefix_cache()
print_news(steps, say("reset"))
held.append(subscriber.keys == set(llm.scheduler.block_manager.hash_to_block_id))
print(say("after each of the {steps} steps the subscriber held the cache's keys ({keys} at the end): {same}",
          steps=steps, keys=len(subscriber.keys), same=all(held)))

# %% [markdown] tags=["en"]
# Read the trace from the top. The first prompt's prefill publishes its two full blocks in one
# `BlockStored` (the parent `-`: they start a prompt); its decode steps fill a third block, stored
# after the second. The second prompt finds the first two blocks in the cache (no event: no key is
# new) and publishes only its own third block, after the same parent as the first prompt's third:
# two branches of one tree. The third prompt needs seven blocks; the free list hands out the
# blocks of the first two prompts, and each reuse removes a key. The reset clears what is left.
#
# ## Check it
#
# The invariant held after every step: it is the `True` above. Three more checks a subscriber can
# make on its own: each `BlockStored` is what it says (the tokens, chained from the parent, give
# the hashes, `block_size` tokens a block); the frames are as the wire format says; and a replay
# from batch 0 returns, byte for byte, the batches it received live.

# %% [markdown] tags=["zh"]
# 从上往下读这段轨迹。第一个提示词的 prefill 用一个 `BlockStored` 发布了它的两个写满的块（父块为 `-`：它们是提示词的
# 开头）；它的 decode 步又写满了第三块，接在第二块之后存入。第二个提示词在缓存里找到了前两块（没有事件：没有新键），
# 只发布它自己的第三块，父块与第一个提示词的第三块相同：同一棵树上的两个分支。第三个提示词需要七块；空闲队列交出了
# 前两个提示词用过的块，每复用一块就移除一个键。重置清空了剩下的部分。
#
# ## 验证
#
# 不变量在每一步之后都成立：就是上面那个 `True`。订阅者还可以自己做三项检查：每个 `BlockStored` 名副其实（这些 token
# 从父块开始链接，得出的正是这些哈希，每块 `block_size` 个 token）；各帧符合线上格式；从第 0 批开始的补发逐字节地返回
# 它实时收到的那些批次。

# %%
def chained(event: BlockStored) -> bool:
    """Whether the event's tokens, hashed block by block from its parent, give its hashes."""
    # zh: 这个事件的 token 从它的父块开始逐块求哈希，得到的是否正是它的那些哈希。
    size, parent = event.block_size, NO_HASH if event.parent_block_hash is None else event.parent_block_hash
    if len(event.token_ids) != size * len(event.block_hashes):
        return False
    for i, expected in enumerate(event.block_hashes):
        parent = block_hash(event.token_ids[i * size : (i + 1) * size], parent)
        if parent != expected:
            return False
    return True


stored = [event for payload in subscriber.payloads.values()
          for event in msgspec.msgpack.decode(payload, type=KVEventBatch).events if isinstance(event, BlockStored)]
print(say("every stored hash is the chained hash of its tokens: {same}", same=all(map(chained, stored))))
assert all(held) and stored and all(map(chained, stored))

# en: One message as it travels: three frames, the payload a msgpack array whose events are maps (ts varies).
# zh: 一条消息在线上的样子：三帧，载荷是一个 msgpack 数组，其中的事件是映射（ts 每次都不同）。
replay = context.socket(zmq.DEALER)
replay.connect(f"tcp://127.0.0.1:{replay_port}")
replay.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = []
while True:
    _, topic, seq, payload = replay.recv_multipart()
    replayed.append((int.from_bytes(seq, "big", signed=True), topic, seq, payload))
    if replayed[-1][0] == -1:
        break
_, topic, seq, payload = replayed[0]
print(say("frames: topic {topic}, sequence number {seq}, payload of {size} bytes", topic=topic, seq=seq.hex(" "),
          size=len(payload)))
raw = msgspec.msgpack.decode(payload)
print(say("the payload as msgpack: {value}", value=["ts", *raw[1:]]))
assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0 and raw[1][0]["type"] == "BlockStored"
*batches, end = replayed
same = ([(n, p) for n, _, _, p in batches] == sorted(subscriber.payloads.items())
        and end[1:] == (b"", publisher.END_OF_REPLAY, b""))
print(say("replay from batch {start}: batches {seqs}, then sequence number {end} with an empty payload: {same}",
          start=0, seqs=f"0-{batches[-1][0]}", end=end[0], same=same))
assert same

# %% [markdown] tags=["en"]
# A setting that cannot work stops the engine before anything starts, and says which key is
# wrong: a misspelled key (with the key it probably meant), an address without its `tcp://`, a
# publisher vLLM does not have, and a port that the engine above already holds. Without the
# setting, the prefix cache has no log and nothing is published: the events cost nothing.

# %% [markdown] tags=["zh"]
# 无法工作的配置会在一切启动之前让引擎停下，并指出哪个键错了：拼错的键（附上它多半想写的那个键）、缺了 `tcp://`
# 的地址、vLLM 没有的发布方式，以及上面那个引擎已经占着的端口。不设这个配置项时，前缀缓存没有日志，也不发布任何东西：
# 事件不花任何代价。

# %%
from nanovllm.config import Config

for wrong in ({"enable_kv_cache_events": True, "endpiont": "tcp://*:5557"},
              {"enable_kv_cache_events": True, "endpoint": "localhost:5557"},
              {"enable_kv_cache_events": True, "publisher": "kafka"}):
    try:
        Config(tiny, device="cpu", kv_events_config=wrong)
    except (TypeError, ValueError) as refused:
        print(say("refused: {refusal}", refusal=refused))
try:
    LLM(tiny, device="cpu", kv_events_config={**kv_events_config, "replay_endpoint": None})
except ValueError as refused:
    print(say("refused: {refusal}", refusal=refused))
    assert "kv_events_config.endpoint: cannot bind" in str(refused)
plain = LLM(tiny, device="cpu")
off = (plain.scheduler.kv_events is None and plain.scheduler.kv_event_publisher is None
       and plain.scheduler.block_manager.prefix_cache.events is None)
print(say("events off: no log, no publisher: {off}", off=off))
assert off
plain.exit()

# %% [markdown] tags=["en"]
# ### Live from a server
#
# The same setting on the command line of chapter 22's server: `python -m nanovllm.serve
# --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
# "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 10000}'`,
# here with free ports. The engine runs in the server's engine process (chapter 21), and so does
# the publisher: the settings travel there with the others, and the events leave from there. One
# completion, then a replay from batch 0 asks for everything the server published.

# %% [markdown] tags=["zh"]
# ### 来自服务器的实况
#
# 同一个配置项，用在第 22 章服务器的命令行上：`python -m nanovllm.serve --kv-events-config '{"enable_kv_cache_events":
# true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events",
# "buffer_steps": 10000}'`，这里用的是空闲端口。引擎运行在服务器的引擎进程里（第 21 章），发布者也在那里：配置项和其他
# 配置项一起到达那里，事件也从那里发出。做一次补全，然后从第 0 批开始请求补发，拿到服务器发布过的一切。

# %%
import json
import urllib.request

from nanovllm.serve.process import ServerProcess

ports = free_port(), free_port()
served = {**kv_events_config, "endpoint": f"tcp://*:{ports[0]}", "replay_endpoint": f"tcp://*:{ports[1]}"}
command = ["--model", tiny, "--served-model-name", "tiny", "--device", "cpu", "--kvcache-block-size", "4",
           "--num-kvcache-blocks", "64", "--max-model-len", "128", "--kv-events-config", json.dumps(served)]
with ServerProcess(command) as server:
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    request = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        completion = json.load(reply)
    watcher = Subscriber(context, *ports, b"kv-events")
    watcher.ask_replay()
print(say("the server published {batches} batches for one completion:", batches=len(watcher.news)))
for seq, batch in watcher.news:
    for event in batch.events:
        print(say("  batch {seq}: {event}", seq=seq, event=describe(event)))
assert watcher.news and all(chained(e) for _, b in watcher.news for e in b.events if isinstance(e, BlockStored))

# %% [markdown] tags=["en"]
# ## What we built
#
# - `kv_events_config` (`Config`, chapter 09), vLLM's `KVEventsConfig` field for field, given as
#   JSON, a dict or a `KVEventsConfig`: `python -m nanovllm.serve --kv-events-config '{...}'` takes
#   it with nothing more. Checked before the model loads: unknown keys, wrong types, addresses
#   that are not ZMQ's and publishers other than `"zmq"` and `"null"` are refused by name.
# - `nanovllm.engine.kv_events`: the wire format of vLLM 0.26 as msgspec structs (`KVEventBatch`,
#   an array; `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, maps tagged `"type"`);
#   `KVEventLog`, a step's events, a chain's blocks in one `BlockStored`; `ZmqEventPublisher`, a
#   PUB socket (three frames: topic, 8-byte sequence number, payload) and a ROUTER socket for
#   replays, owned by a thread, so that the engine never waits for a subscriber.
# - Chapter 03's `PrefixCache`: `publish` and `forget` tell the log of each key they add or
#   delete, and `clear` empties the index. Chapter 04's `Scheduler`: `record_kv_events`,
#   `publish_kv_events`, and `_notify` ends the log's step at `"postprocess"`. Chapter 10's
#   `LLMEngine`: the publisher started with the engine and closed by `exit`, and
#   `reset_prefix_cache`.
# - The invariant, checked here after every step through the wire: a subscriber that applies the
#   events in order holds exactly the keys of `hash_to_block_id`. The tests check it on random
#   workloads with preemption, forks, speculation and asynchronous steps, decode the payloads with
#   structs written from vLLM's, and run the server with the flag.
#
# ## Exercises
#
# 1. Two requests with the same prompt of eight tokens are prefilled in the same step (block size
#    4). How many hashes do the `BlockStored` events of that step carry? Later the block of one
#    of them is reused: which one's reuse sends `BlockRemoved`?
# 2. A subscriber connects after the engine published batches 0 to 5, and its first live batch is
#    number 6. What does it send to the replay socket, and how does it know that the replay is
#    complete?
# 3. Before vLLM's pull request 42892, events were positional arrays. Write the payload of a
#    batch `[ts, [BlockRemoved([h], "GPU")], 0]` in that encoding: what is the event, as msgpack
#    sees it?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `kv_events_config`（`Config`，第 09 章）：逐字段等同于 vLLM 的 `KVEventsConfig`，可以写成 JSON、dict 或
#   `KVEventsConfig`；`python -m nanovllm.serve --kv-events-config '{...}'` 无需再做什么就能接受它。在模型加载之前检查：
#   未知的键、错误的类型、不是 ZMQ 地址的地址，以及 `"zmq"` 和 `"null"` 以外的发布方式，都会被指名拒绝。
# - `nanovllm.engine.kv_events`：vLLM 0.26 的线上格式，写成 msgspec 结构（`KVEventBatch` 是数组；`BlockStored`、
#   `BlockRemoved`、`AllBlocksCleared` 是带 `"type"` 标签的映射）；`KVEventLog` 收集一步的事件，一条链上的块放进一个
#   `BlockStored`；`ZmqEventPublisher` 有一个 PUB 套接字（三帧：主题、8 字节序号、载荷）和一个用于补发的 ROUTER
#   套接字，由一个线程拥有，所以引擎从不等订阅者。
# - 第 03 章的 `PrefixCache`：`publish` 和 `forget` 把它们增删的每个键告诉日志，`clear` 清空索引。第 04 章的
#   `Scheduler`：`record_kv_events`、`publish_kv_events`，以及在 `"postprocess"` 时结束日志这一步的 `_notify`。
#   第 10 章的 `LLMEngine`：随引擎启动、由 `exit` 关闭的发布者，以及 `reset_prefix_cache`。
# - 不变量，本章在每一步之后经过线上检查过：按顺序应用事件的订阅者恰好持有 `hash_to_block_id` 的全部键。测试在带抢占、
#   分叉、投机解码和异步步的随机负载上检查它，用按 vLLM 的结构写出的结构解码载荷，并带着这个选项运行服务器。
#
# ## 练习
#
# 1. 两个提示词相同（八个 token）的请求在同一步里做 prefill（块大小 4）。这一步的 `BlockStored` 事件一共带几个哈希？
#    之后其中一个请求的块被复用：谁的块被复用时会发出 `BlockRemoved`？
# 2. 一个订阅者在引擎发布了第 0 到第 5 批之后才连上，它收到的第一个实时批次是第 6 批。它向补发套接字发送什么？它怎么
#    知道补发已经完整？
# 3. 在 vLLM 的第 42892 号拉取请求之前，事件是按位置排列的数组。用那种编码写出一批 `[ts, [BlockRemoved([h], "GPU")], 0]`
#    的载荷：在 msgpack 看来，这个事件是什么？

# %%
# en: Exercise 1: two hashes, once: the first request's publish enters them, the second's finds them and only moves
# en: the entries to its own blocks (the newest wins). So the reuse of the second request's blocks sends
# en: BlockRemoved; the first's blocks own no entry any more, and their reuse sends nothing.
# zh: 练习 1：两个哈希，只出现一次：第一个请求的 publish 登记了它们，第二个的 publish 发现它们已经在了，只把条目改指向
# zh: 自己的块（以最新的为准）。所以是第二个请求的块被复用时发出 BlockRemoved；第一个请求的块已经不拥有任何条目，
# zh: 复用它们什么也不发。
twins = LLM(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=8, max_model_len=64)
seen: list = []
twins.scheduler.record_kv_events(seen.extend)
for _ in range(2):
    twins.add_request([*range(1, 9)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
twins.step()
stored_once = [h for e in seen if isinstance(e, BlockStored) for h in e.block_hashes]
# en: The entries point at the second request's blocks: the first took blocks 0 and 1 of the free list, it 2 and 3.
# zh: 条目指向第二个请求的块：第一个请求从空闲队列拿走了第 0、1 块，第二个拿走了第 2、3 块。
owners = set(twins.scheduler.block_manager.hash_to_block_id.values())
# en: A prompt of 32 tokens takes all eight blocks: two removals, when blocks 3 and 2 are reused.
# zh: 一个 32 个 token 的提示词拿走全部八块：两次移除，发生在第 3、2 块被复用时。
twins.add_request([*range(30, 62)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
twins.step()
removed = [h for e in seen if isinstance(e, BlockRemoved) for h in e.block_hashes]
assert len(stored_once) == 2 and owners == {2, 3} and sorted(removed) == sorted(stored_once)
twins.exit()

# en: Exercise 2: the 8 bytes of 0, big-endian (the first number it lacks); the replay ends with sequence number -1
# en: and an empty payload.
# zh: 练习 2：大端序的 8 字节 0（它缺的第一个序号）；补发以序号 -1 和空载荷结束。
late = Subscriber(context, events_port, replay_port, b"kv-events")
late.ask_replay()
assert late.next_seq == publisher.next_seq and late.keys == subscriber.keys

# en: Exercise 3: the tag becomes the array's first element: ["BlockRemoved", [h], "GPU"].
# zh: 练习 3：标签成了数组的第一个元素：["BlockRemoved", [h], "GPU"]。
class OldBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


h = stored[0].block_hashes[0]
old = msgspec.msgpack.encode([1.0, [OldBlockRemoved([h], "GPU")], 0])
assert msgspec.msgpack.decode(old)[1][0] == ["BlockRemoved", [h], "GPU"]
assert msgspec.msgpack.decode(msgspec.msgpack.encode(BlockRemoved([h], "GPU"))) == {
    "type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}
llm.exit()
context.destroy(linger=0)
print(say("all exercise answers check out"))

# %% [markdown] tags=["en"]
# ## Next: replicas behind a gateway
#
# *A placeholder: the gateway part follows this one and is still being written.* It runs several
# engines as replicas behind an existing gateway that routes by cache content, shows what the
# gateway sees of each replica (request text, or these events), and measures what routing by cache
# content gains over taking turns.

# %% [markdown] tags=["zh"]
# ## 接下来：网关后面的多个副本
#
# *占位*：网关的部分跟在这一部分之后，还在写。它把几个引擎作为副本放在一个按缓存内容分发请求的现成网关后面运行，展示
# 网关对每个副本看到了什么（请求的文本，或者这些事件），并测量按缓存内容分发比轮流分发多得到了什么。
