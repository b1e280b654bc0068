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
# # 08 · The model runner: batching inputs, sizing the KV cache
#
# **Goal.** The scheduler (chapter 04) hands over a list of sequences and says "prefill" or
# "decode"; the model (chapter 05) wants flat tensors and an attention context (chapter 06).
# The **model runner** sits between them. By the end of this chapter you can:
#
# - turn a step's sequences into `input_ids`, `positions` and the attention metadata, for a
#   prefill (possibly a chunk, possibly after a prefix-cache hit) and for a decode step;
# - size and allocate the paged KV cache, on a CPU from a memory budget and on a GPU from the
#   memory left after a warm-up forward, and hand each layer its view of it;
# - run the model and sample one token per sequence, only where a token is really wanted.

# %% [markdown] tags=["zh"]
# # 08 · 模型执行器：组装批次输入，确定 KV 缓存大小
#
# **目标：** 调度器（第 04 章）交来一组序列，并说明这是 "prefill" 还是 "decode"；模型（第 05 章）要的是扁平的
# 张量和一个注意力上下文（第 06 章）。**模型执行器**就夹在两者之间。读完本章，你将能够：
#
# - 把一步的序列变成 `input_ids`、`positions` 和注意力元数据，既能处理 prefill（可能是一个分块，也可能在前缀缓存
#   命中之后），也能处理 decode 步；
# - 确定分页 KV 缓存的大小并分配它：CPU 上按内存预算，GPU 上按预热前向之后剩余的显存；再把各层对应的视图交给每一层；
# - 运行模型并为每个序列采样一个 token——只在真正需要 token 的地方采样。

# %% [markdown] tags=["en"]
# ## The idea: one flat batch, described by a few small tensors
#
# There is no padding in a step. The tokens that every sequence computes now are laid end to
# end, and small tensors say where each sequence starts and where its KV goes:
#
# ```
# prefill step, block_size 4: seq A computes tokens 0..4 (new), seq B tokens 8..9 (8 cached)
#   input_ids      [a0 a1 a2 a3 a4 | b8 b9]
#   positions      [ 0  1  2  3  4 |  8  9]
#   cu_seqlens_q   [0, 5, 7]          (where each sequence's queries start in the flat batch)
#   cu_seqlens_k   [0, 5, 15]         (keys: cached + scheduled, i.e. 5 and 8 + 2)
#   slot_mapping   [A's slots 0..4 | B's slots 8..9]   slot = block_table[pos // 4] * 4 + pos % 4
#   block_tables   [[A's blocks], [B's blocks]]        only when some prefix is cached
#
# decode step: one token per sequence, the last one
#   input_ids [A_last, B_last]   positions [len(A)-1, len(B)-1]   context_lens [len(A), len(B)]
# ```
#
# For a chunk, the keys a query sees are the cached tokens plus the scheduled ones:
# `seqlen_k = num_cached_tokens + num_scheduled_tokens`, not the whole sequence — the rest of
# the prompt has not been computed yet. Only the scheduled tokens get a slot: the cached ones
# are already in the cache.

# %% [markdown] tags=["zh"]
# ## 思路：一个扁平批次，用几个小张量描述
#
# 一步之中没有填充（padding）。每个序列本步要计算的 token 首尾相接排成一行，再用几个小张量说明每个序列从哪里开始、
# 它的 KV 写到哪里：
#
# ```
# prefill 步，block_size 为 4：序列 A 计算第 0..4 个 token（全新），序列 B 计算第 8..9 个（前 8 个已缓存）
#   input_ids      [a0 a1 a2 a3 a4 | b8 b9]
#   positions      [ 0  1  2  3  4 |  8  9]
#   cu_seqlens_q   [0, 5, 7]          （每个序列的 query 在扁平批次中的起点）
#   cu_seqlens_k   [0, 5, 15]         （key：已缓存 + 本步计算，即 5 和 8 + 2）
#   slot_mapping   [A 的槽位 0..4 | B 的槽位 8..9]   slot = block_table[pos // 4] * 4 + pos % 4
#   block_tables   [[A 的块], [B 的块]]               只有存在已缓存前缀时才需要
#
# decode 步：每个序列一个 token，即最后一个
#   input_ids [A_last, B_last]   positions [len(A)-1, len(B)-1]   context_lens [len(A), len(B)]
# ```
#
# 对于分块，query 能看到的 key 是已缓存的 token 加上本步计算的 token：
# `seqlen_k = num_cached_tokens + num_scheduled_tokens`，而不是整个序列——提示词的其余部分还没算。
# 只有本步计算的 token 需要槽位：已缓存的 token 早就在缓存里了。

# %% default module
#| default_exp engine.model_runner

# %% [markdown] tags=["en"]
# ## Build it: the inputs of a step
#
# Chapter 06's `set_prefill_context` and `set_decode_context` turn per-sequence lengths and
# block tables into the context tensors (slots included). What is left for the runner is to
# read those lengths off the sequences, and to lay out `input_ids` and `positions`.

# %% [markdown] tags=["zh"]
# ## 动手：一步的输入
#
# 第 06 章的 `set_prefill_context` 和 `set_decode_context` 会把每个序列的长度和块表变成上下文张量（包括槽位）。
# 留给执行器的工作，是从序列上读出这些长度，并排好 `input_ids` 和 `positions`。

# %% prepare inputs
#| export
from __future__ import annotations

import torch

from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, sibling_samples
from nanovllm.layers.context import (
    get_context,
    host_to_device,
    reset_context,
    set_decode_context,
    set_prefill_context,
)


def prepare_prefill(
    seqs: list[Sequence], block_size: int, device: torch.device | str = "cpu", *, with_cache: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat input_ids and positions of a prefill step; installs the attention context.

    with_cache=False is the warm-up forward: no KV cache exists yet, so nothing is stored.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    seqlens_q: list[int] = []
    seqlens_k: list[int] = []
    for seq in seqs:
        start, count = seq.num_cached_tokens, seq.num_scheduled_tokens
        assert count >= 1, f"sequence {seq.seq_id} has no scheduled tokens in this prefill step"
        # en: A chunk sees its cached prefix plus itself, not the whole prompt.
        # zh: 一个分块能看到的是它的已缓存前缀加上它自己，而不是整个提示词。
        ids = seq.scheduled_token_ids
        assert ids[-1] != PENDING_TOKEN, f"sequence {seq.seq_id} is prefilled before its last token was computed"
        input_ids += ids
        positions += range(start, start + count)
        seqlens_q.append(count)
        seqlens_k.append(start + count)
    tables = [seq.block_table for seq in seqs] if with_cache else None
    set_prefill_context(seqlens_q, seqlens_k, tables, block_size, device)
    return _tensor(input_ids, device), _tensor(positions, device)


def prepare_decode(
    seqs: list[Sequence], block_size: int, device: torch.device | str = "cpu", previous: SampledTokens | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and positions of a decode step (one token per sequence); installs the context.

    A sequence whose last token is still pending takes it from ``previous``, the step that samples it.
    """
    for seq in seqs:
        assert seq.num_scheduled_tokens == 1 and seq.num_cached_tokens == len(seq) - 1, f"not ready to decode: {seq}"
    input_ids = [seq.last_token for seq in seqs]
    positions = [len(seq) - 1 for seq in seqs]
    set_decode_context([len(seq) for seq in seqs], [seq.block_table for seq in seqs], block_size, device)
    if PENDING_TOKEN in input_ids:
        assert previous is not None, "a sequence's last token is still pending: pass the step that samples it"
        return previous.input_ids_for(seqs, input_ids), _tensor(positions, device)
    return _tensor(input_ids, device), _tensor(positions, device)


def _tensor(values: list[int], device: torch.device | str) -> torch.Tensor:
    return host_to_device(values, torch.int64, device)

# %% [markdown] tags=["en"]
# ### See it
#
# The example of the drawing: A is new with 5 tokens, B has 10 tokens of which 8 are cached
# (two blocks found by the prefix cache) and computes the last 2. We fill in the block tables
# by hand, as the block manager would.

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# 上图中的例子：A 是新序列，5 个 token；B 有 10 个 token，其中 8 个已缓存（前缀缓存找到的两个块），本步计算最后 2 个。
# 我们像块管理器那样手工填写块表。

# %%
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.context import get_context, reset_context

a = Sequence([10, 11, 12, 13, 14], block_size=4)
a.block_table, a.num_scheduled_tokens = [7, 3], 5
b = Sequence(list(range(20, 30)), block_size=4)
b.block_table, b.num_cached_tokens, b.num_scheduled_tokens = [0, 1, 5], 8, 2

input_ids, positions = prepare_prefill([a, b], block_size=4)
ctx = get_context()
print("input_ids   ", input_ids.tolist())
print("positions   ", positions.tolist())
print("cu_seqlens_q", ctx.cu_seqlens_q.tolist(), " cu_seqlens_k", ctx.cu_seqlens_k.tolist())
print("slot_mapping", ctx.slot_mapping.tolist())
print("block_tables", ctx.block_tables.tolist())

# %%
assert input_ids.tolist() == [10, 11, 12, 13, 14, 28, 29]
assert positions.tolist() == [0, 1, 2, 3, 4, 8, 9]
assert ctx.cu_seqlens_q.tolist() == [0, 5, 7] and ctx.cu_seqlens_k.tolist() == [0, 5, 15]
# en: A's tokens 0..3 go to block 7 (slots 28..31), token 4 to block 3 (slot 12); B's 8, 9 to block 5.
# zh: A 的第 0..3 个 token 写入块 7（槽位 28..31），第 4 个写入块 3（槽位 12）；B 的第 8、9 个写入块 5。
assert ctx.slot_mapping.tolist() == [28, 29, 30, 31, 12, 20, 21]
assert ctx.block_tables.tolist() == [[7, 3, -1], [0, 1, 5]]

# en: Then both decode: A appended a token (now 6 long), B too (11 long).
# zh: 接着两者都进入 decode：A 追加了一个 token（现在长 6），B 也是（长 11）。
for seq, token in ((a, 15), (b, 30)):
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.append_token(token)
    seq.num_scheduled_tokens = 1
input_ids, positions = prepare_decode([a, b], block_size=4)
ctx = get_context()
print("decode:", input_ids.tolist(), positions.tolist(), ctx.context_lens.tolist(), ctx.slot_mapping.tolist())
assert input_ids.tolist() == [15, 30] and positions.tolist() == [5, 10]
assert ctx.context_lens.tolist() == [6, 11] and ctx.slot_mapping.tolist() == [13, 22]
reset_context()

# %% [markdown] tags=["en"]
# ## Build it: how many KV blocks?
#
# One block holds, for every layer, the keys and the values of `block_size` tokens:
#
# `block_bytes = 2 × layers × block_size × kv_heads × head_dim × dtype size`
#
# - **On a GPU** (nano-vllm's rule): run one warm-up forward of the largest step the scheduler
#   can make, so that the activations' peak is known, then give the KV cache what is left of
#   `total × gpu_memory_utilization`: `total × utilization − used − peak + current`, where
#   `used` is what the device reports in use (other processes included), `peak` the highest
#   allocation of the warm-up and `current` what torch holds now (the weights).
# - **On a CPU** memory is shared with everything else and there is no reliable "free", so the
#   budget is explicit: `kvcache_memory_gb`.
# - `num_kvcache_blocks > 0` overrides both (tests use it to force preemption with a tiny pool).
#
# Either way, there is no point in more blocks than `max_num_seqs` sequences of `max_model_len`
# tokens can ever use, so the count is capped there: a tiny model on a laptop does not reserve
# a gigabyte it can never fill.
#
# A pool the machine cannot hold (`num_kvcache_blocks=10**9`, say) is refused with an error that
# names the setting to change, not with the allocator's message about bytes. On a CPU the pool
# is also compared with the machine's memory first: Linux may grant a huge allocation that it
# cannot back, and the process would be killed later, when the blocks fill up.

# %% [markdown] tags=["zh"]
# ## 动手：需要多少个 KV 块？
#
# 一个块为每一层保存 `block_size` 个 token 的键和值：
#
# `block_bytes = 2 × 层数 × block_size × kv_heads × head_dim × 数据类型字节数`
#
# - **GPU 上**（nano-vllm 的规则）：先用调度器可能产生的最大一步做一次预热前向，得到激活值的峰值，再把
#   `total × gpu_memory_utilization` 剩下的部分交给 KV 缓存：`total × utilization − used − peak + current`。
#   其中 `used` 是设备报告的已用显存（包括其他进程），`peak` 是预热时的最高分配量，
#   `current` 是 torch 当前持有的量（即权重）。
# - **CPU 上**内存与其他一切共享，没有可靠的“空闲量”，所以预算是显式给出的：`kvcache_memory_gb`。
# - `num_kvcache_blocks > 0` 会覆盖以上两者（测试用它配出一个很小的块池来强制抢占）。
#
# 无论哪种情况，块数都不必超过 `max_num_seqs` 个长度为 `max_model_len` 的序列所能用到的数量，所以在那里封顶：
# 笔记本电脑上的小模型不会预留一块永远填不满的 1 GB 内存。
#
# 机器容纳不下的块池（比如 `num_kvcache_blocks=10**9`）会被拒绝，报错指明应当修改哪个配置项，而不是分配器那条
# 关于字节数的消息。在 CPU 上还会先把块池与机器的内存总量比较：Linux 可能答应一次它根本兑现不了的巨大分配，
# 进程要等到块被逐渐填满时才会被杀掉。

# %% kv cache sizing
#| export
import math
import os
from typing import Any

from nanovllm.config import Config
from nanovllm.models.qwen3 import head_dim_of


def kv_block_bytes(hf_config: Any, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block: keys and values of `block_size` tokens in every layer (one rank's heads)."""
    kv_heads = max(1, hf_config.num_key_value_heads // tensor_parallel_size)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim_of(hf_config) * element


def max_useful_blocks(config: Config) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens would fill."""
    per_seq = -(-config.max_model_len // config.kvcache_block_size)
    return per_seq * config.max_num_seqs


def num_kv_blocks(config: Config, block_bytes: int, *, available_bytes: float | None = None) -> int:
    """How many KV blocks to allocate (available_bytes: what the device can give the cache)."""
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    if available_bytes is None:
        available_bytes = config.kvcache_memory_gb * 2**30
    blocks = min(int(available_bytes // block_bytes), max_useful_blocks(config))
    if blocks < 1:
        raise ValueError(
            f"no room for a single KV block ({block_bytes / 2**20:.1f} MiB): {available_bytes / 2**20:.1f} MiB "
            f"available; raise kvcache_memory_gb / gpu_memory_utilization or lower kvcache_block_size"
        )
    return blocks


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, setting: str) -> torch.Tensor:
    """The KV cache tensor; a pool the device cannot hold is a ValueError naming ``setting``, the knob to lower."""
    nbytes = math.prod(shape) * dtype.itemsize
    what = f"the KV cache of {shape[2]} blocks needs {nbytes / 2**30:,.1f} GiB"
    fix = f"lower {setting}" + (" (or leave it at -1 to size the cache from memory)"
                                if setting == "num_kvcache_blocks" else "")
    if device.type == "cpu" and nbytes > _physical_memory():
        raise ValueError(f"{what}, more than this machine's {_physical_memory() / 2**30:,.1f} GiB of memory; {fix}")
    try:
        # en: Zeros on a GPU, not empty memory: FlashAttention 4 (chapter 06b) reads whole pages, and a NaN left in an
        # en: unwritten row of a sequence's last page would poison its output (0 x NaN). It costs milliseconds, once.
        # zh: GPU 上用零，而不是未初始化的内存：FlashAttention 4（第 06b 章）按整页读取，序列最后一页中未写入的行里
        # zh: 若残留 NaN，就会污染它的输出（0 × NaN）。这只花几毫秒，而且只做一次。
        return torch.zeros(shape, dtype=dtype, device=device) if device.type == "cuda" else \
            torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as error:  # torch.OutOfMemoryError on a GPU
        cause = str(error).partition("\n")[0]
        raise ValueError(f"{what}, more than {device} can allocate ({cause}); {fix}") from error


def _physical_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return math.inf

# %% [markdown] tags=["en"]
# ## Build it: the copy in copy-on-write
#
# Chapter 04b lets the samples of one prompt share its blocks. When one of them is about to
# write into a block that another still holds, the block manager gives it a fresh block and
# writes the pair *(source, destination)* into `seq.blocks_to_copy`; the runner moves the data.
# All of a step's copies, in every layer, keys and values alike, are **one** indexed read and
# **one** indexed write on the single KV tensor: dimension 2 is the block, so
# `kv_cache[:, :, dst] = kv_cache[:, :, src]` copies whole blocks across all layers at once. The
# runner does it at the very start of a step, before the forward, so it is queued ahead of the
# step's K/V stores and stays outside any CUDA graph (chapter 09); with tensor parallelism every
# rank does the same on its own heads (chapter 10).

# %% [markdown] tags=["zh"]
# ## 动手：写时复制中的“复制”
#
# 第 04b 章让同一个提示词的多个样本共享它的块。当其中一个样本要写入一个仍被别的样本持有的块时，块管理器给它一个新块，
# 并把 *(源块, 目标块)* 记进 `seq.blocks_to_copy`；搬数据的是执行器。一步中的所有拷贝，不论哪一层、K 还是 V，
# 都只是对那一个 KV 张量做**一次**按索引读取和**一次**按索引写入：第 2 维是块，所以
# `kv_cache[:, :, dst] = kv_cache[:, :, src]` 一次就把整块在所有层中拷贝过去。执行器在一步的最开头、前向计算
# 之前做这件事，因此它排在这一步写入 K/V 之前，也不在任何 CUDA Graph 之内（第 09 章）；张量并行时，每个 rank 对
# 自己的那部分头做同样的事（第 10 章）。

# %% copy blocks
#| export
def copy_kv_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """For each (source, destination) pair, give block destination the keys and values of block source, in
    every layer: one gather and one scatter for all of a step's copies. ``kv_cache``: [2, layers, blocks, ...]."""
    if not copies:
        return
    sources = host_to_device([source for source, _ in copies], torch.int64, kv_cache.device)
    destinations = host_to_device([destination for _, destination in copies], torch.int64, kv_cache.device)
    kv_cache[:, :, destinations] = kv_cache[:, :, sources]

# %% [markdown] tags=["en"]
# A check on a small KV tensor: blocks 5 and 6 receive blocks 1 and 2 in both layers, keys and
# values, and no other block changes.

# %% [markdown] tags=["zh"]
# 在一个小 KV 张量上检查：块 5、6 在两层中、K 和 V 都收到了块 1、2 的内容，其余块都没有变。

# %%
import torch

from nanovllm.engine.model_runner import copy_kv_blocks

kv = torch.randn(2, 2, 8, 4, 1, 3)  # [K/V, layers, blocks, block_size, kv_heads, head_dim]
before = kv.clone()
copy_kv_blocks(kv, [(1, 5), (2, 6)])
assert torch.equal(kv[:, :, 5], before[:, :, 1]) and torch.equal(kv[:, :, 6], before[:, :, 2])
untouched = [b for b in range(8) if b not in (5, 6)]
assert torch.equal(kv[:, :, untouched], before[:, :, untouched])
print("blocks 5, 6 now hold blocks 1, 2 in every layer; the other six are unchanged")

# %% [markdown] tags=["en"]
# ## Build it: a step's tokens, before and after they exist
#
# `run` returns the sampled tokens as a Python list, which means waiting for the GPU to finish
# the step. Chapter 11's asynchronous engine wants to hand the GPU the next step first, so the
# runner also offers `launch`: it queues the step and returns a `SampledTokens` at once. Its
# `on_device` tensor is usable straight away as the next decode step's input ids (the GPU runs
# the queued work in order, so the next step reads them after they are written), and the copy to
# the host is queued behind the sampler; `token_ids()` waits for that copy and no longer.

# %% [markdown] tags=["zh"]
# ## 动手：一步的 token，算出之前与之后
#
# `run` 以 Python 列表返回采样得到的 token，这意味着要等 GPU 算完这一步。第 11 章的异步引擎希望先把下一步交给
# GPU，所以执行器还提供 `launch`：它把这一步排进队列，立即返回一个 `SampledTokens`。其中的 `on_device` 张量马上就能
# 用作下一个 decode 步的输入 id（GPU 按顺序执行排队的工作，所以下一步读取它们时，它们已经写好了）；拷贝回主机的
# 操作排在采样器之后，`token_ids()` 只等这次拷贝完成，不多等。

# %% sampled tokens
#| export
from dataclasses import dataclass


@dataclass
class SampledTokens:
    """A step's sampled tokens: on the device once the step is queued, on the host once it is done."""

    seqs: list[Sequence]
    rows: list[int]  # the indices in seqs that were sampled (a partial prefill chunk is not)
    # en: [len(samples)] int64: the step's own tokens (one per row), then the first tokens of the
    # en: siblings it forks, in `sibling_samples` order (chapter 04b).
    # zh: [len(samples)] int64：这一步自己的 token（每行一个），然后是它分叉出的兄弟序列的首 token，
    # zh: 顺序同 `sibling_samples`（第 04b 章）。
    on_device: torch.Tensor
    on_host: torch.Tensor  # the same tokens; on a GPU, a pinned buffer that a queued copy fills
    # en: Whose token each row of on_device is: (request_id, sample_index), a key that a sibling forked
    # en: by this step will carry too.
    # zh: on_device 的每一行是谁的 token：(request_id, sample_index)；这一步分叉出的兄弟序列也带着同样的键。
    samples: list[tuple[int, int]]
    ready: torch.cuda.Event | None = None  # recorded after that copy; None on a CPU (nothing to wait for)

    @classmethod
    def start(
        cls, seqs: list[Sequence], rows: list[int], sampled: torch.Tensor, to_host: bool = True
    ) -> SampledTokens:
        """Queue the copy of ``sampled`` to the host and return without waiting for it (to_host=False: no copy)."""
        samples = [(seqs[i].request_id, seqs[i].sample_index) for i in rows]
        samples += [(seqs[i].request_id, k) for i, k in sibling_samples(seqs)]
        if sampled.device.type != "cuda" or not to_host:
            return cls(seqs, rows, sampled, sampled, samples)
        on_host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        on_host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, rows, sampled, on_host, samples, ready)

    def token_ids(self) -> list[int]:
        """One token per sequence (NOT_SAMPLED for a partial chunk), then the forked siblings' first tokens;
        waits until the step has run."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.on_host.tolist()
        tokens = [NOT_SAMPLED] * len(self.seqs)
        for i, token in zip(self.rows, values[: len(self.rows)], strict=True):
            tokens[i] = token
        return tokens + values[len(self.rows) :]

    def input_ids_for(self, seqs: list[Sequence], input_ids: list[int]) -> torch.Tensor:
        """The next decode step's input ids on the device: each PENDING_TOKEN replaced by this step's sample."""
        row_of = {sample: row for row, sample in enumerate(self.samples)}
        rows = []
        for seq, token in zip(seqs, input_ids, strict=True):
            key = (seq.request_id, seq.sample_index)
            assert token != PENDING_TOKEN or key in row_of, f"{seq}'s pending token is not one this step samples"
            rows.append(row_of[key] if token == PENDING_TOKEN else -1)
        device = self.on_device.device
        known = _tensor([max(token, 0) for token in input_ids], device)
        row = _tensor(rows, device)
        # en: Rows with a known token keep it; the others gather their sample (row -1 is clamped, then unused).
        # en: A sample marked NON_FINITE (chapter 07) is clamped to 0 too: an embedding lookup of -2 would
        # en: fail on the device, and the engine drops that sequence when it reads the mark (chapter 11).
        # zh: 已知 token 的行保留它；其余的行取来自己的采样结果（行号 -1 先被截到 0，随后不会被用到）。
        # zh: 标记为 NON_FINITE（第 07 章）的采样结果同样截到 0：在设备上查嵌入表时 -2 会出错，而引擎读到这个标记时
        # zh: 会丢弃那个序列（第 11 章）。
        return torch.where(row >= 0, self.on_device[row.clamp(min=0)].clamp(min=0), known)

# %% [markdown] tags=["en"]
# ## Build it: `ModelRunner`
#
# The runner builds the model (chapter 05's `build_model` picks the class from
# `config.json`'s `architectures`), points every attention layer at the chosen backend,
# allocates **one** KV tensor `[2, layers, blocks, block_size, kv_heads, head_dim]` and gives
# each layer its two views `kv_cache[0, i]` and `kv_cache[1, i]`: one allocation, no copies.
#
# `run` is one step: inputs, forward, logits (`compute_logits` keeps one row per sequence: the
# last computed token's), and sampling. A sequence whose prefill chunk does not reach the end
# of its prompt gets no token: its "next token" would be a prediction for a prompt position,
# which the scheduler throws away anyway. The runner returns `-1` for it instead of spending a
# sampling pass on it.
#
# Two hooks belong to chapter 09 and do nothing on a CPU: with `compile_small_ops` the model's
# small element-wise ops are compiled, and on a GPU with a capture-safe attention backend (Triton or
# FlashAttention 4) `self.graphs` holds
# the captured decode graphs, which `run` replays for decode steps instead of calling the model.
#
# The runner builds what the layers compute with once and hands it down: one attention backend
# object (`attention_backend(config.attention_backend)`, chapter 06) given to every `Attention`
# layer, and a `Sampler` whose fast path, on a GPU, is chapter 07's Triton kernels
# (`triton_temperature_sample`). On a GPU it also *warms up* everything that compiles on first
# use, so that no step of a real run pays for a compile: a prefill that reads a cached prefix
# (`warm_paged_prefill`), every variant of the attention backend's prefill kernel
# (`warm_up_attention`, chapter 06b's `warm_up_prefill`) and the sampler's two kernels
# (`warm_up_sampler`). They run in inference mode, like `run`: compiled functions check how their
# inputs were made and would compile again for tensors made outside it.

# %% [markdown] tags=["zh"]
# ## 动手：`ModelRunner`
#
# 执行器构建模型（第 05 章的 `build_model` 会按 `config.json` 中的 `architectures` 选择模型类），让每个注意力层
# 使用选定的后端，分配**一个** KV 张量 `[2, layers, blocks, block_size, kv_heads, head_dim]`，再把它的两个视图
# `kv_cache[0, i]` 和 `kv_cache[1, i]` 交给第 `i` 层：只分配一次，没有拷贝。
#
# `run` 就是一步：准备输入、前向计算、计算 logits（`compute_logits` 为每个序列保留一行：它最后一个被计算的 token），
# 然后采样。如果某个序列的 prefill 分块没有到达提示词末尾，它就得不到 token：它的“下一个 token”只是对提示词中某个
# 位置的预测，调度器反正会丢掉。执行器为它返回 `-1`，而不是为它做一次采样。
#
# 有两个挂钩属于第 09 章，在 CPU 上什么也不做：打开 `compile_small_ops` 时，模型中的逐元素小算子会被编译；在 GPU 上
# 使用可以安全捕获的注意力后端（Triton 或 FlashAttention 4）时，`self.graphs` 保存捕获好的 decode 图，`run` 在
# decode 步重放它们，而不是直接调用模型。
#
# 执行器把各层用来计算的东西构建一次，再交下去：一个注意力后端对象（`attention_backend(config.attention_backend)`，
# 第 06 章）交给每个 `Attention` 层；一个 `Sampler`，在 GPU 上它的快速路径是第 07 章的 Triton 内核
# （`triton_temperature_sample`）。在 GPU 上，它还会把所有
# 首次使用时才编译的东西*预热*一遍，这样真实运行中没有哪一步要为编译买单：一次读取已缓存前缀的 prefill
# （`warm_paged_prefill`）、注意力后端 prefill 内核的每个变体（`warm_up_attention`，即第 06b 章的
# `warm_up_prefill`），以及采样器的两个内核（`warm_up_sampler`）。它们和 `run` 一样在推理模式下运行：编译好的
# 函数会检查输入是怎样创建的，对推理模式之外创建的张量会重新编译。

# %% model runner
#| export
import importlib

from nanovllm.engine.cuda_graphs import capture_decode_graphs
from nanovllm.layers.attention import Attention, attention_backend
from nanovllm.layers.compiled_ops import compile_small_ops
from nanovllm.layers.linear import agree_min, share_from_rank0
from nanovllm.layers.sampler import Sampler, sampling_inputs, temperature_sample
from nanovllm.models.loader import build_model

NOT_SAMPLED = -1


class ModelRunner:
    """Runs the model on the scheduler's steps; owns the model, the KV cache and the sampler."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model = build_model(config.model, self.dtype, self.device, config.load_format, config.hf_config)
        # en: What the model's layers compute with is built once here and handed down: one attention backend
        # en: for every layer (chapter 06b's kernels are imported only when chosen), and on a GPU the
        # en: sampler's fast path as chapter 07's Triton kernels (imported only there).
        # zh: 模型各层用来计算的东西都在这里构建一次，再交下去：所有层共用一个注意力后端（只有被选中时才导入
        # zh: 第 06b 章的内核）；在 GPU 上，采样器的快速路径用第 07 章的 Triton 内核（只在那里导入）。
        self.attention = attention_backend(config.attention_backend)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.attention
        on_gpu = self.device.type == "cuda"
        kernels = importlib.import_module("nanovllm.layers.triton_sampler") if on_gpu else None
        self.sampler = Sampler(kernels.triton_temperature_sample if on_gpu else temperature_sample)
        if config.compile_small_ops:
            compile_small_ops(self.model)  # chapter 09; compiled during the warm-ups below
        self.stopped = False
        self.kv_cache = self.allocate_kv_cache()
        # en: The scheduler sizes its block pool from this.
        # zh: 调度器据此确定块池的大小。
        config.num_kvcache_blocks = self.kv_cache.shape[2]
        if self.device.type == "cuda":
            self.warm_paged_prefill()
            self.warm_up_attention()
            self.warm_up_sampler()
        # en: Chapter 09: decode graphs, captured once the KV cache exists (None: decode runs eagerly).
        # zh: 第 09 章：decode 图，在 KV 缓存分配之后捕获（None：decode 以 eager 方式运行）。
        self.graphs = capture_decode_graphs(self.model, config)

    # en: ---- the KV cache ---------------------------------------------------------
    # zh: ---- KV 缓存 ---------------------------------------------------------------
    def allocate_kv_cache(self) -> torch.Tensor:
        hf = self.config.hf_config
        block_bytes = kv_block_bytes(hf, self.block_size, self.dtype, self.config.tensor_parallel_size)
        available = self._cuda_budget() if self.device.type == "cuda" else None
        # en: With tensor parallelism every rank sized its own pool; they must all use the smallest.
        # zh: 张量并行时每个 rank 各自算出块池大小；所有 rank 必须采用其中最小的那个。
        blocks = agree_min(num_kv_blocks(self.config, block_bytes, available_bytes=available), self.device)
        kv_heads = max(1, hf.num_key_value_heads // self.config.tensor_parallel_size)
        shape = (2, len(self.attention_layers), blocks, self.block_size, kv_heads, head_dim_of(hf))
        setting = "num_kvcache_blocks" if self.config.num_kvcache_blocks > 0 else \
            "gpu_memory_utilization" if self.device.type == "cuda" else "kvcache_memory_gb"
        kv_cache = allocate_kv(shape, self.dtype, self.device, setting)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
        return kv_cache

    def _cuda_budget(self) -> float:
        """Bytes left for the KV cache after a warm-up forward of the largest possible step."""
        if self.config.num_kvcache_blocks > 0:
            return 0.0  # unused: the block count is given
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.warmup()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        return total * self.config.gpu_memory_utilization - (total - free) - peak + current

    # en: The warm-ups build their inputs inside inference mode, as run() does: a tensor made outside it
    # en: differs to torch.compile's guards, which would then compile again in the first real step.
    # zh: 各个预热和 run() 一样在推理模式内构造输入：在推理模式之外创建的张量，在 torch.compile 的守卫看来是
    # zh: 不同的，于是第一个真实的步会再编译一次。
    @torch.inference_mode()
    def warmup(self) -> None:
        """One forward of the biggest prefill the scheduler may send, with no KV cache."""
        config = self.config
        seq_len = min(config.max_model_len, config.max_num_batched_tokens)
        num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
        seqs = [Sequence([0] * seq_len, block_size=self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        input_ids, positions = prepare_prefill(seqs, self.block_size, self.device, with_cache=False)
        self.model.compute_logits(self.model(input_ids, positions))
        reset_context()

    @torch.inference_mode()
    def warm_paged_prefill(self) -> None:
        """One 1-token prefill after a 1-token cached prefix, through the whole model, so the path a chunked
        prefill or a prefix-cache hit takes (compiled ops at 1 token included) is compiled now, not in a step."""
        table = list(range(-(-2 // self.block_size)))
        if len(table) > self.kv_cache.shape[2]:
            return
        # en: The pool's first blocks are free; what this writes there is overwritten before anyone reads it.
        # zh: 池中最前面的块是空闲的；这里写入的内容在任何人读取之前都会被覆盖。
        seq = Sequence([0, 0], block_size=self.block_size)
        seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = table, 1, 1
        try:
            input_ids, positions = prepare_prefill([seq], self.block_size, self.device)
            self.model.compute_logits(self.model(input_ids, positions))
        finally:
            reset_context()

    @torch.inference_mode()
    def warm_up_attention(self) -> None:
        """Let the attention backend compile, now, every kernel variant a step may need (chapter 06b)."""
        warm_up = getattr(self.attention, "warm_up", None)
        if warm_up is not None and self.attention_layers:
            warm_up(self.attention_layers[0])  # every layer has the same shapes: one compiles them all

    @torch.inference_mode()
    def warm_up_sampler(self) -> None:
        """Run the sampler's fast path once, so that Triton compiles chapter 07's two kernels now: one variant
        each, for this model's vocabulary and logits dtype. It serves every later step, since the batch only sets
        the grid and the seed, new in every call, is not specialized on."""
        logits = torch.zeros(2, self.config.hf_config.vocab_size, dtype=self.dtype, device=self.device)
        self.sampler(logits, torch.tensor([0.0, 1.0], device=self.device))  # a greedy row and a sampled one

    # en: ---- one step -------------------------------------------------------------
    # zh: ---- 一步 ------------------------------------------------------------------
    @torch.inference_mode()
    def compute_logits(
        self, seqs: list[Sequence], is_prefill: bool, previous: SampledTokens | None = None
    ) -> torch.Tensor | None:
        """The forward of one step: one row of logits per sequence (None on tensor-parallel ranks other than 0).

        ``previous``: the step before, when it may still be running (pending tokens come from it).
        """
        if self.stopped:
            raise RuntimeError("this model runner was stopped (exit() was called)")
        # en: The engine refuses longer requests up front; the graphs' block-table buffer relies on it.
        # zh: 引擎会提前拒绝更长的请求；CUDA Graph 的块表缓冲区依赖这一点。
        assert all(len(s) <= self.config.max_model_len for s in seqs), "a sequence is longer than max_model_len"
        copies = [pair for seq in seqs for pair in seq.blocks_to_copy]
        if copies:
            # en: Copy-on-write (chapter 04b): before this step writes into the fresh blocks, give them the
            # en: shared blocks' K/V. Here, outside any CUDA graph, and queued ahead of the step's stores.
            # zh: 写时复制（第 04b 章）：在这一步写入新块之前，先把共享块的 K/V 拷贝进去。放在任何 CUDA Graph 之外，
            # zh: 排在这一步的写入之前。
            copy_kv_blocks(self.kv_cache, copies)
        try:
            if is_prefill:
                input_ids, positions = prepare_prefill(seqs, self.block_size, self.device)
            else:
                input_ids, positions = prepare_decode(seqs, self.block_size, self.device, previous)
            if not is_prefill and self.graphs is not None and self.graphs.covers(len(seqs)):
                hidden = self.graphs.replay(input_ids, positions, get_context())  # chapter 09
            else:
                hidden = self.model(input_ids, positions)
            return self.model.compute_logits(hidden)
        finally:
            reset_context()

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """Compute one step; return one sampled token per sequence (NOT_SAMPLED for a partial chunk)."""
        return self.launch(seqs, is_prefill).token_ids()

    @torch.inference_mode()
    def launch(
        self, seqs: list[Sequence], is_prefill: bool, previous: SampledTokens | None = None
    ) -> SampledTokens:
        """Queue one step on the device and return without waiting for it. ``previous``: see `compute_logits`.

        With tensor parallelism (chapter 10) rank 0 alone has logits and samples; every other rank receives
        its tokens on the device, so that each rank can feed a pending token to the next step by itself."""
        logits = self.compute_logits(seqs, is_prefill, previous)
        # en: Only rows whose whole sequence has been computed want a token. A request that forks
        # en: (chapter 04b) also draws its siblings' first tokens from its row, after the step's own rows.
        # zh: 只有整个序列都已算完的行才需要 token。要分叉的请求（第 04b 章）还要从它这一行为兄弟序列抽取第一个
        # zh: token，排在本步各行之后。
        rows = [i for i, seq in enumerate(seqs) if seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq)]
        forks = sibling_samples(seqs)
        sampled = None
        if logits is not None and rows:
            picks = rows + [i for i, _ in forks]
            wanted = [seqs[i] for i in picks]
            sample_indices = [seqs[i].sample_index for i in rows] + [j for _, j in forks]
            inputs = sampling_inputs(
                [s.sampling_params for s in wanted], [len(s) for s in wanted], logits.device, sample_indices
            )
            # en: All of the logits only when the picks are exactly rows 0..n-1: a forked sibling may take a row's
            # en: place when another row is a partial chunk (same count, other rows).
            # zh: 只有挑选的恰好是第 0..n-1 行时才直接用全部 logits：某行是不完整的分块时，分叉出的兄弟序列可能
            # zh: 顶替它的位置（行数相同，行却不同）。
            whole = picks == list(range(len(seqs)))
            sampled = self.sampler(logits if whole else logits[picks], **inputs)
        sampled = share_from_rank0(sampled, len(rows) + len(forks), self.device)
        # en: Only the rank that sampled needs the tokens on the host (the others never read them there).
        # zh: 只有做了采样的 rank 需要把 token 拷回主机（其他 rank 从不在主机上读它们）。
        return SampledTokens.start(seqs, rows, sampled, to_host=logits is not None)

    def exit(self) -> None:
        """Release the KV cache and refuse further steps (chapter 10's runner also stops its rank processes)."""
        self.stopped = True
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = torch.tensor([])


# %% [markdown] tags=["en"]
# ### See it: a runner on a tiny model
#
# A tiny Qwen3 with a CPU budget of 1 MiB for the KV cache: how many blocks that buys, the one
# KV tensor, and each layer's views into it.

# %% [markdown] tags=["zh"]
# ### 看它运行：小模型上的执行器
#
# 一个小 Qwen3，CPU 上给 KV 缓存 1 MiB 的预算：这能换来多少个块、那一个 KV 张量，以及每一层指向它的视图。

# %%
from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams
from nanovllm.book.tiny_models import build_tiny_model

tiny = build_tiny_model("qwen3")
config = Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, kvcache_memory_gb=1 / 1024)  # the CPU rule
block_bytes = kv_block_bytes(config.hf_config, 4, torch.float32)
runner = ModelRunner(config)
print(f"one block: {block_bytes} bytes -> {config.num_kvcache_blocks} blocks in 1 MiB")
print("KV cache:", tuple(runner.kv_cache.shape), "= [2, layers, blocks, block_size, kv_heads, head_dim]")
assert config.num_kvcache_blocks == 2**20 // block_bytes
for i, layer in enumerate(runner.attention_layers):
    # en: Views, not copies: layer i writes straight into the shared tensor.
    # zh: 是视图而不是拷贝：第 i 层直接写进共享的张量。
    assert layer.k_cache.data_ptr() == runner.kv_cache[0, i].data_ptr()
    assert layer.v_cache.data_ptr() == runner.kv_cache[1, i].data_ptr()

# %% [markdown] tags=["en"]
# ### Check it: two steps by hand, against `transformers`
#
# We play the scheduler: a 9-token prompt whose prefill is split into chunks of 5 and 4 tokens,
# then one decode step. The first chunk yields no token (`-1`); the second yields the first
# generated token, and the decode step the second. Both must be `transformers`' greedy choices.

# %% [markdown] tags=["zh"]
# ### 验证：手工执行两步，与 `transformers` 对比
#
# 我们扮演调度器：一个 9 个 token 的提示词，prefill 分成 5 个和 4 个 token 的两个分块，然后做一个 decode 步。
# 第一个分块不产生 token（`-1`）；第二个分块产生第一个生成的 token，decode 步产生第二个。
# 两者都必须等于 `transformers` 的贪心选择。

# %%
from transformers import AutoModelForCausalLM

prompt = [17, 4, 250, 33, 9, 88, 120, 5, 61]
seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=2), block_size=4)
seq.block_table = [6, 2, 9]  # what the block manager would hand out

seq.num_scheduled_tokens = 5
assert runner.run([seq], is_prefill=True) == [NOT_SAMPLED]  # a chunk that stops inside the prompt
seq.num_cached_tokens, seq.num_scheduled_tokens = 5, 4
(first,) = runner.run([seq], is_prefill=True)
seq.num_cached_tokens, seq.num_scheduled_tokens = 9, 0
seq.append_token(first)
seq.num_scheduled_tokens = 1  # decode: position 9 goes to block 2 (index 9 // 4), slot 9*4 + 1 = 37
(second,) = runner.run([seq], is_prefill=False)

hf = AutoModelForCausalLM.from_pretrained(tiny).eval()
ids = torch.tensor([prompt])
expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False)[0, len(prompt):].tolist()
print("runner:", [first, second], " transformers:", expected)
assert [first, second] == expected

# %% [markdown] tags=["en"]
# ## What we built
#
# - `prepare_prefill` / `prepare_decode`: a step's sequences → `input_ids`, `positions` and the
#   attention context; chunk-aware (`seqlen_k = num_cached + num_scheduled`), slots only for
#   the computed tokens, block tables only when a prefix is cached.
# - `kv_block_bytes`, `num_kv_blocks`: how big the paged KV cache is, from a CPU budget, the
#   GPU's free memory after a warm-up, or an explicit block count.
# - `ModelRunner`: the model, one KV tensor with per-layer views, and `run(seqs, is_prefill)`,
#   which samples only the rows that want a token.
#   Its forward half is a method of its own, `compute_logits` (chapter 10's ranks use it too);
#   `exit()` releases the KV cache. `launch` queues a step and returns `SampledTokens` at once:
#   tokens on the device (the next decode step's inputs) and a queued copy to the host.
#
# Chapter 11 puts the scheduler and the runner in one loop.
#
# ## Exercises
#
# 1. A decode step for sequences of lengths 6 and 11 with `block_size=4`: which positions do
#    the two input tokens have, and which blocks of their block tables do they write to?
# 2. SmolLM2 has 30 layers, 3 KV heads of dimension 64. How many bytes is one block of 256
#    tokens in float32? How many such blocks fit in 1 GiB?
# 3. Why would `run` be wrong if it sampled a token for every row of a chunked prefill and the
#    scheduler appended it?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `prepare_prefill` / `prepare_decode`：把一步的序列变成 `input_ids`、`positions` 和注意力上下文；能处理分块
#   （`seqlen_k = num_cached + num_scheduled`），只为本步计算的 token 分配槽位，只在存在已缓存前缀时才给出块表。
# - `kv_block_bytes`、`num_kv_blocks`：分页 KV 缓存有多大——来自 CPU 预算、预热后 GPU 的剩余显存，或者显式给出的块数。
# - `ModelRunner`：模型、一个带每层视图的 KV 张量，以及 `run(seqs, is_prefill)`——只为需要 token 的行采样。
#   它的前向部分 `compute_logits` 单独成为一个方法（第 10 章的各个 rank 也用它）；`exit()` 释放 KV 缓存。
#   `launch` 把一步排进队列并立即返回 `SampledTokens`：设备上的 token（下一个 decode 步的输入），以及一次已排队的
#   拷回主机的操作。
#
# 第 11 章把调度器和执行器放进同一个循环。
#
# ## 练习
#
# 1. `block_size=4`，对长度分别为 6 和 11 的两个序列做一个 decode 步：两个输入 token 的位置是多少？
#    它们写入各自块表中的哪一块？
# 2. SmolLM2 有 30 层、3 个维度为 64 的 KV 头。一个 256 token 的块在 float32 下占多少字节？1 GiB 能放多少个这样的块？
# 3. 如果 `run` 为分块 prefill 的每一行都采样一个 token，而调度器又把它追加上去，会出什么错？

# %%
# en: Exercise 1: positions 5 and 10 (the last token of each), blocks at index 5 // 4 = 1 and 10 // 4 = 2.
# zh: 练习 1：位置 5 和 10（各自的最后一个 token），写入块表下标 5 // 4 = 1 和 10 // 4 = 2 的块。
x, y = Sequence([1] * 6, block_size=4), Sequence([1] * 11, block_size=4)
x.block_table, y.block_table = [3, 8], [0, 1, 5]
for s in (x, y):
    s.num_cached_tokens, s.num_scheduled_tokens = len(s) - 1, 1
_, pos = prepare_decode([x, y], block_size=4)
assert pos.tolist() == [5, 10] and get_context().slot_mapping.tolist() == [8 * 4 + 1, 5 * 4 + 2]
reset_context()

# en: Exercise 2: 2 * 30 * 256 * 3 * 64 * 4 bytes = 11.25 MiB per block, 91 blocks per GiB.
# zh: 练习 2：每块 2 * 30 * 256 * 3 * 64 * 4 字节 = 11.25 MiB，每 GiB 可放 91 块。
smol = type("SmolLM2", (), {"num_key_value_heads": 3, "num_hidden_layers": 30, "head_dim": 64})()
assert kv_block_bytes(smol, 256, torch.float32) == 11.25 * 2**20 and 2**30 // (11.25 * 2**20) == 91

# en: Exercise 3: the token would predict a position *inside* the prompt, and appending it would
# en: put a made-up token in the middle of the prompt. The runner returns -1 and the scheduler
# en: discards it (chapter 04).
# zh: 练习 3：这个 token 预测的是提示词*内部*的某个位置，追加它就等于在提示词中间塞进一个编造的 token。
# zh: 执行器返回 -1，调度器丢弃它（第 04 章）。
partial = Sequence(prompt, SamplingParams(temperature=0), block_size=4)
partial.block_table, partial.num_scheduled_tokens = [0, 1, 3], 8
assert runner.run([partial], is_prefill=True) == [NOT_SAMPLED]
print("all exercise answers check out")
