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
# # 07 · Paged attention, the reference backend
#
# **Goal.** Build the attention layer of the engine: it writes each new token's key and value
# into the **paged KV cache** and computes attention over a sequence's whole history by reading
# the cache through the sequence's **block table**. One batch mixes sequences of different
# lengths, some with a cached prefix (a prefix-cache hit, or a later chunk of a chunked
# prefill), so every tensor is *flat* and a small **context** object says where each sequence
# starts and ends.
#
# This chapter writes the *plain-torch reference backend*: short, readable, runs everywhere,
# and it defines what "correct" means. The Triton kernels that come later plug into the same
# interface and are tested against it.

# %% [markdown] tags=["zh"]
# # 07 · 分页注意力：参考后端
#
# **目标：** 构建引擎的注意力层：它把每个新 token 的键（K）和值（V）写入**分页 KV 缓存**，并通过序列的
# **块表**读取缓存，对序列的全部历史计算注意力。一个批次里混着长度不同的序列，其中一些带有已缓存的前缀
# （前缀缓存命中，或分块 prefill 中靠后的分块），所以所有张量都是*展平*的，由一个小小的**上下文**（context）对象
# 说明每个序列从哪里开始、到哪里结束。
#
# 本章编写*纯 torch 参考后端*：简短、易读、处处可运行，并且由它定义什么叫“正确”。后面的 Triton 内核接入
# 同一个接口，并以它为标准进行测试。

# %% [markdown] tags=["en"]
# ## The idea: flat batches, slots and block tables
#
# The model sees one flat list of tokens per step, `T` of them, from all sequences together.
# For attention it needs to know, per sequence `i`:
#
# ```
# prefill step, 3 sequences (q = tokens computed now, k = tokens attended to)
#   seq 0: cached 0, new 5      q: ■■■■■          k: ■■■■■
#   seq 1: cached 8, new 3      q:         ■■■    k: □□□□□□□□■■■   (□ = read from the cache)
#   seq 2: cached 0, new 2      q: ■■             k: ■■
#   cu_seqlens_q = [0, 5, 8, 10]      cu_seqlens_k = [0, 5, 16, 18]
# ```
#
# - `cu_seqlens_q` / `cu_seqlens_k`: cumulative query and key lengths. Sequence `i`'s queries
#   are the **last** `seqlen_q` positions of its `seqlen_k` keys, so query `j` sits at absolute
#   position `seqlen_k - seqlen_q + j` and may look at keys `0 … that position` (causal).
# - `slot_mapping[t]`: where token `t` of the flat batch writes its K and V. The cache of one
#   layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; slot `s` is row
#   `s // block_size`, offset `s % block_size`. A slot of `-1` means "write nothing" (padding).
# - `block_tables[i]`: the block ids of sequence `i`, padded with `-1`; position `p` lives in
#   block `block_tables[i][p // block_size]` at offset `p % block_size`.
# - `context_lens[i]` (decode): how many tokens sequence `i` attends to, the new one included.
#
# In a prefill without any cached prefix `block_tables` is left out and attention reads the
# fresh `k`, `v` directly (they are in the cache too, but there is no need to read them back).

# %% [markdown] tags=["zh"]
# ## 思路：展平的批次、槽位与块表
#
# 每一步，模型看到的是来自所有序列的一串展平的 token，共 `T` 个。做注意力时，它需要知道每个序列 `i` 的：
#
# ```
# prefill 步，3 个序列（q = 本步计算的 token，k = 被关注的 token）
#   序列 0：已缓存 0，新 5      q: ■■■■■          k: ■■■■■
#   序列 1：已缓存 8，新 3      q:         ■■■    k: □□□□□□□□■■■   （□ = 从缓存读取）
#   序列 2：已缓存 0，新 2      q: ■■             k: ■■
#   cu_seqlens_q = [0, 5, 8, 10]      cu_seqlens_k = [0, 5, 16, 18]
# ```
#
# - `cu_seqlens_q` / `cu_seqlens_k`：查询与键长度的累积和。序列 `i` 的查询是它 `seqlen_k` 个键中**最后**
#   `seqlen_q` 个位置，所以第 `j` 个查询位于绝对位置 `seqlen_k - seqlen_q + j`，只能看到 `0 … 该位置`
#   的键（因果）。
# - `slot_mapping[t]`（槽位映射）：展平批次中第 `t` 个 token 把 K、V 写到哪里。一层的缓存形状是
#   `[num_blocks, block_size, num_kv_heads, head_dim]`；槽位 `s` 对应第 `s // block_size` 块、偏移
#   `s % block_size`。槽位 `-1` 表示“什么也不写”（填充行）。
# - `block_tables[i]`：序列 `i` 的块编号，用 `-1` 填充；位置 `p` 在块 `block_tables[i][p // block_size]`
#   的偏移 `p % block_size` 处。
# - `context_lens[i]`（decode）：序列 `i` 要关注的 token 数，包括新 token。
#
# 没有任何已缓存前缀的 prefill 不传 `block_tables`，注意力直接使用刚算出的 `k`、`v`（它们也已写进缓存，
# 但没必要再读回来）。

# %% [markdown] tags=["en"]
# ## Build it: the context
#
# The model runner (chapter 09) fills the context before each forward and every attention
# layer reads it, so it lives at module level, as in nano-vllm. The model runner of chapter 09
# fills it, but the module lives here because attention is the code that reads it.
#
# One change from nano-vllm: the context belongs to a *thread*, not to the process. A step
# sets the context and then reads it, always on one thread; two engines driven from two threads
# of one process would otherwise overwrite each other's context in the middle of a forward, and
# compute silently wrong tokens. A `threading.local` gives each thread its own.

# %% [markdown] tags=["zh"]
# ## 动手：上下文
#
# 模型执行器（第 09 章）在每次前向计算之前填好上下文，每个注意力层都读取它，所以像 nano-vllm 一样把它放在
# 模块一级。填写它的是第 09 章的模型执行器，但这个模块放在本章，因为读取它的正是注意力。
#
# 与 nano-vllm 有一处不同：上下文属于*线程*，而不属于进程。一步总是在同一个线程里先设置上下文再读取它；
# 否则，同一进程中由两个线程分别驱动的两个引擎会在前向计算中途互相覆盖上下文，悄无声息地算出错误的 token。
# `threading.local` 让每个线程都有自己的一份。

# %% default module
#| default_exp layers.attention

# %% context
#| export layers.context
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch


@dataclass
class Context:
    """Attention metadata of the current step."""
    # zh: 当前这一步的注意力元数据。

    is_prefill: bool = False
    # en: [num_seqs + 1] int32
    # zh: 形状 [num_seqs + 1]，int32。
    cu_seqlens_q: torch.Tensor | None = None
    # en: [num_seqs + 1] int32
    # zh: 形状 [num_seqs + 1]，int32。
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # en: [T] int32/int64, -1 = do not store
    # zh: 形状 [T]，int32/int64，-1 表示不写入。
    slot_mapping: torch.Tensor | None = None
    # en: [num_seqs] int32, decode only
    # zh: 形状 [num_seqs]，int32，仅 decode 使用。
    context_lens: torch.Tensor | None = None
    # en: [num_seqs, max_blocks] int32, -1 padded
    # zh: 形状 [num_seqs, max_blocks]，int32，用 -1 填充。
    block_tables: torch.Tensor | None = None


class _StepContext(threading.local):
    """The context of the step this thread is computing: each thread sees its own."""
    # zh: 本线程正在计算的那一步的上下文：每个线程看到它自己的。

    def __init__(self) -> None:
        self.context = Context()


_STEP = _StepContext()


def get_context() -> Context:
    """The context of the step being computed (on this thread)."""
    # zh: 正在计算的那一步的上下文（在本线程上）。
    return _STEP.context


def set_context(
    is_prefill: bool,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    slot_mapping: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
) -> Context:
    """Install the metadata of the next forward pass on this thread (nano-vllm's signature)."""
    # zh: 在本线程上装好下一次前向计算的元数据（签名与 nano-vllm 相同）。
    _STEP.context = Context(
        is_prefill, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slot_mapping, context_lens, block_tables
    )
    return _STEP.context


def reset_context() -> None:
    """Forget the metadata (a step is over)."""
    # zh: 忘掉元数据（一步结束了）。
    _STEP.context = Context()

# %% [markdown] tags=["en"]
# Building the context by hand is error-prone, so two helpers compute it from plain lists: the
# model runner does the same from `Sequence` objects, and tests and chapters use these directly.
# Slots follow from the block table: position `p` of a sequence goes to slot
# `block_table[p // block_size] * block_size + p % block_size`.

# %% [markdown] tags=["zh"]
# 手工构造上下文容易出错，所以用两个辅助函数从普通列表算出它：模型执行器对 `Sequence` 对象做同样的事，
# 测试和章节则直接使用它们。槽位由块表推出：序列的位置 `p` 写到槽位
# `block_table[p // block_size] * block_size + p % block_size`。

# %% [markdown] tags=["en"]
# The lists become tensors on the device through `host_to_device`. A plain
# `torch.tensor(values, device="cuda")` copies from ordinary (pageable) host memory, and PyTorch
# then waits until the GPU has finished *all* the work queued before the copy. That costs little
# while the engine waits for every step anyway, but chapter 18 prepares step *n + 1* while the GPU
# still computes step *n*, and one such wait would undo it. From page-locked ("pinned") memory the
# copy can simply be queued behind that work, and the host moves on.

# %% [markdown] tags=["zh"]
# 这些列表通过 `host_to_device` 变成设备上的张量。普通的 `torch.tensor(values, device="cuda")` 从普通（可分页）
# 主机内存拷贝，PyTorch 随后会一直等到 GPU 完成拷贝之前排队的*全部*工作。引擎本来就等每一步算完时，这点代价
# 不大；但第 18 章要在 GPU 还在计算第 *n* 步时准备第 *n + 1* 步，一次这样的等待就会前功尽弃。从锁页（pinned）
# 内存拷贝时，这次拷贝只需排在那些工作之后，主机可以继续做别的事。

# %% context helpers
#| export layers.context
def host_to_device(values: list, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``values`` as a tensor on ``device``; to a GPU through pinned memory, without waiting for queued work."""
    # zh: 把 ``values`` 变成 ``device`` 上的张量；去 GPU 时经过锁页内存，不等待已排队的工作。
    if device is not None and torch.device(device).type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The KV-cache slot of token ``position`` of a sequence whose blocks are ``block_table``."""
    # zh: 块为 ``block_table`` 的序列中，位置为 ``position`` 的 token 的 KV 缓存槽位。
    block_index = position // block_size
    assert 0 <= block_index < len(block_table), f"position {position} needs block {block_index}: {block_table}"
    return block_table[block_index] * block_size + position % block_size


def _block_table_tensor(block_tables: list[list[int]], device: torch.device | str | None) -> torch.Tensor:
    width = max(1, max(len(table) for table in block_tables))
    rows = [list(table) + [-1] * (width - len(table)) for table in block_tables]
    return host_to_device(rows, torch.int32, device)


def set_prefill_context(
    seqlens_q: list[int],
    seqlens_k: list[int],
    block_tables: list[list[int]] | None = None,
    block_size: int = 16,
    device: torch.device | str | None = None,
) -> Context:
    """Set the context of a prefill step from per-sequence lengths and block tables.

    seqlens_q[i]: tokens sequence i computes now; seqlens_k[i]: its cached prefix plus those.
    block_tables=None means "no KV cache" (a warm-up forward): nothing is stored.
    """
    # zh: 由各序列的长度和块表设置 prefill 步的上下文。
    # zh:
    # zh: seqlens_q[i]：序列 i 这次计算的 token 数；seqlens_k[i]：它已缓存的前缀加上这些 token。
    # zh: block_tables=None 表示“没有 KV 缓存”（预热前向）：什么都不存。
    assert seqlens_q and all(1 <= q <= k for q, k in zip(seqlens_q, seqlens_k, strict=True)), (seqlens_q, seqlens_k)
    slot_mapping = tables = None
    if block_tables is not None:
        slots = [
            slot_of(table, position, block_size)
            for q, k, table in zip(seqlens_q, seqlens_k, block_tables, strict=True)
            for position in range(k - q, k)
        ]
        slot_mapping = host_to_device(slots, torch.int64, device)
        # en: Only a cached prefix needs the block tables: without one, attention reads the fresh k, v.
        # zh: 只有存在已缓存前缀时才需要块表：没有前缀时，注意力直接读取新算出的 k、v。
        if any(k > q for q, k in zip(seqlens_q, seqlens_k, strict=True)):
            tables = _block_table_tensor(block_tables, device)
    else:
        assert seqlens_q == seqlens_k, "a cached prefix (seqlen_k > seqlen_q) needs block tables to read it from"

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return host_to_device([0, *itertools.accumulate(lengths)], torch.int32, device)

    return set_context(
        True, cumulative(seqlens_q), cumulative(seqlens_k), max(seqlens_q), max(seqlens_k), slot_mapping, None, tables
    )


def set_decode_context(
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int = 16,
    device: torch.device | str | None = None,
) -> Context:
    """Set the context of a decode step: one new token per sequence, at position context_len - 1."""
    # zh: 设置 decode 步的上下文：每个序列一个新 token，位置是 context_len - 1。
    slots = [slot_of(table, n - 1, block_size) for n, table in zip(context_lens, block_tables, strict=True)]
    return set_context(
        False,
        slot_mapping=host_to_device(slots, torch.int64, device),
        context_lens=host_to_device(context_lens, torch.int32, device),
        block_tables=_block_table_tensor(block_tables, device),
    )

# %% [markdown] tags=["en"]
# The context also tells the LM head of chapter 06 which rows to turn into logits. During a
# prefill only the **last** token of each sequence samples the next token, so the head keeps rows
# `cu_seqlens_q[1:] - 1` of the hidden states before the vocabulary-sized matmul and skips most
# of the largest matmul of a prefill step. A decode step samples from every row, as does a
# forward without a context (chapter 06's comparisons with `transformers`).

# %% [markdown] tags=["zh"]
# 上下文还告诉第 06 章的 LM head 哪些行要算成 logits。prefill 时只有每个序列的**最后一个** token 用来采样下一个
# token，所以 head 在与词表等大的矩阵乘法之前，只保留隐藏状态的第 `cu_seqlens_q[1:] - 1` 行，省掉 prefill 步中
# 最大的那次矩阵乘法的大部分。decode 步的每一行都要采样，没有上下文的前向计算（第 06 章与 `transformers` 的对照）
# 也是如此。

# %% sampled rows
#| export layers.embed_head
import torch

from nanovllm.book.literate import add_to_class
from nanovllm.layers.context import get_context
from nanovllm.layers.embed_head import ParallelLMHead


@add_to_class(ParallelLMHead)
def sampled_rows(self, x: torch.Tensor) -> torch.Tensor:
    """The rows of the hidden states ``x`` that a token is sampled from: during a prefill, each sequence's last."""
    # zh: 隐藏状态 ``x`` 里要从中采样 token 的那些行：prefill 时，是每个序列的最后一行。
    context = get_context()
    if context.is_prefill and context.cu_seqlens_q is not None:
        return x[context.cu_seqlens_q[1:].long() - 1].contiguous()
    return x

# %% [markdown] tags=["en"]
# ## Build it: the backend interface
#
# An attention **backend** is three functions: store the new K/V into the cache, prefill
# attention, decode attention. Each `Attention` layer holds a `backend` object (this chapter's
# torch reference until told otherwise). The model runner (chapter 09) builds one backend, the
# kind the `attention_backend` setting names, with `attention_backend(name)`, and hands that
# object to every layer: no registry to fill by importing modules. Here there is one kind, this
# chapter's torch reference; chapter 11 adds its Triton kernels to the choice.

# %% [markdown] tags=["zh"]
# ## 动手：后端接口
#
# 一个注意力**后端**由三个函数组成：把新的 K/V 存进缓存、prefill 注意力、decode 注意力。每个 `Attention`
# 层持有一个 `backend` 对象（在被告知用别的之前，是本章的 torch 参考实现）。模型执行器（第 09 章）用
# `attention_backend(name)` 按配置项 `attention_backend` 构建一个后端，再把这个对象交给每一层：不需要靠导入模块
# 来填充注册表。这里只有一种后端，即本章的 torch 参考实现；第 11 章把它的 Triton 内核加进可选项。

# %% backend interface
#| export
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from nanovllm.layers.context import Context, get_context


class AttentionBackend(Protocol):
    """What an attention implementation provides (shapes in the comments of `TorchBackend`)."""
    # zh: 注意力实现要提供的东西（形状写在 `TorchBackend` 的注释里）。

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...  # fmt: skip

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        context: Context, scale: float,
    ) -> torch.Tensor: ...  # fmt: skip

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
    ) -> torch.Tensor: ...  # fmt: skip


def attention_backend(name: str) -> AttentionBackend:
    """A backend of the kind ``name``, which Config has checked: here, "torch", the reference below."""
    # zh: 种类为 ``name`` 的后端，Config 已经检查过它：这里是 "torch"，即下面的参考实现。
    return TorchBackend()

# %% [markdown] tags=["en"]
# ## Build it: the plain-torch backend
#
# **Store.** A scatter: row `slot_mapping[t]` of the flattened cache receives token `t`. The
# cache is viewed, never reshaped: if it were not contiguous, `reshape` would silently write into
# a copy, while `view` fails loudly.
#
# **Read through a block table.** `gather_paged` turns positions `0 … n-1` into slots and
# indexes the flattened cache: the paged KV of one sequence becomes a dense `[n, kv_heads, d]`.
#
# **Attend.** `F.scaled_dot_product_attention` with `enable_gqa=True` handles grouped-query
# attention (each KV head serves `num_heads / num_kv_heads` query heads). Prefill runs one
# sequence at a time with a causal mask shifted by the cached prefix; decode, too, runs one
# sequence at a time, reading exactly its own context, so nothing is padded or masked. A
# reference can afford the Python loop; the Triton kernels (chapter 11) do a batch in one launch.

# %% [markdown] tags=["zh"]
# ## 动手：纯 torch 后端
#
# **存储：** 一次 scatter：展平后的缓存的第 `slot_mapping[t]` 行接收第 `t` 个 token。对缓存只用 `view`，
# 不用 `reshape`：如果缓存不连续，`reshape` 会悄悄写进一份拷贝，而 `view` 会直接报错。
#
# **通过块表读取：** `gather_paged` 把位置 `0 … n-1` 换算成槽位，再索引展平的缓存：一个序列的分页 KV
# 就变成了稠密的 `[n, kv_heads, d]`。
#
# **计算注意力：** `F.scaled_dot_product_attention` 配合 `enable_gqa=True` 处理分组查询注意力（GQA，每个
# KV 头服务 `num_heads / num_kv_heads` 个查询头）。prefill 逐个序列计算，因果掩码按已缓存前缀的长度平移；
# decode 也逐个序列计算，每个序列只读取自己的上下文，所以既没有填充也不需要掩码。参考实现负担得起这个 Python
# 循环；Triton 内核（第 11 章）则一次启动处理整个批次。

# %% torch backend
#| export
def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, d] -> [num_slots, kv_heads, d], as a view."""
    # zh: [num_blocks, block_size, kv_heads, d] -> [num_slots, kv_heads, d]，作为视图。
    return cache.view(-1, *cache.shape[2:])


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, read through its block table."""
    # zh: 通过块表读出一个序列的前 ``length`` 个 token。
    # en: Whole blocks first (one index per block, not per token), then cut to the length.
    # zh: 先按整块取（每块一次索引，而不是每个 token 一次），再截到所需长度。
    num_blocks = -(-length // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n_q, H, d] are the last n_q positions of k, v [n_k, KVH, d]; returns [n_q, H, d]."""
    # zh: q [n_q, H, d] 是 k、v [n_k, KVH, d] 的最后 n_q 个位置；返回 [n_q, H, d]。
    n_q, n_k = q.shape[0], k.shape[0]
    if n_q == n_k:
        mask, causal = None, True
    elif n_q == 1:
        # en: a decode query is the last position: it sees every key
        # zh: decode 的查询位于最后一个位置：它能看到所有键。
        mask, causal = None, False
    else:
        # en: query j sits at absolute position n_k - n_q + j and sees keys 0 … that position.
        # zh: 第 j 个查询位于绝对位置 n_k - n_q + j，能看到 0 … 该位置的键。
        rows = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
        mask, causal = torch.arange(n_k, device=q.device)[None, :] <= rows, False
    # en: [1, heads, n, d]: with a batch dimension SDPA takes its fused CPU kernel; 3-D inputs with
    # en: GQA fall back to a path about 8x slower.
    # zh: 形状 [1, heads, n, d]：带上批次维度，SDPA 才会走 CPU 上的融合内核；带 GQA 的三维输入会退回到
    # zh: 慢约 8 倍的路径。
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


class TorchBackend:
    """The reference backend: readable, runs on any device, defines correctness."""
    # zh: 参考后端：易读，能在任何设备上运行，正确与否以它为准。

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:  # fmt: skip
        # en: k, v: [T, kv_heads, d]; slot -1 marks padded rows that must not be stored.
        # zh: k、v：[T, kv_heads, d]；槽位 -1 标记不应写入的填充行。
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        flat_cache(k_cache)[slots] = k[keep].to(k_cache.dtype)
        flat_cache(v_cache)[slots] = v[keep].to(v_cache.dtype)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        context: Context, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        paged = context.block_tables is not None
        assert not paged or k_cache.numel(), "the context has block tables (a cached prefix) but no KV cache"
        cu_q, cu_k = context.cu_seqlens_q.tolist(), context.cu_seqlens_k.tolist()
        out = torch.empty_like(q)
        for i in range(len(cu_q) - 1):
            q_start, q_end = cu_q[i], cu_q[i + 1]
            n_k = cu_k[i + 1] - cu_k[i]
            if paged:
                keys = gather_paged(k_cache, context.block_tables[i], n_k)
                values = gather_paged(v_cache, context.block_tables[i], n_k)
            # en: no cached prefix: set_prefill_context made sure of it
            # zh: 没有已缓存前缀：set_prefill_context 已经确保了这一点。
            else:
                keys, values = k[q_start:q_end], v[q_start:q_end]
            out[q_start:q_end] = causal_attention(q[q_start:q_end], keys.to(q.dtype), values.to(q.dtype), scale)
        return out

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        # en: q: [B, H, d], one new token per sequence; its KV is already in the cache.
        # zh: q：[B, H, d]，每个序列一个新 token；它的 KV 已经在缓存里了。
        assert k_cache.numel(), "decode attention needs a KV cache"
        # en: One sequence at a time, like prefill: each reads exactly its context_len keys, so no
        # en: padding is read and nothing needs masking (on a CPU this also beats one padded call).
        # zh: 和 prefill 一样逐个序列计算：每个序列只读取恰好 context_len 个键，不读填充，也就无需掩码
        # zh: （在 CPU 上这也比一次带填充的批量调用更快）。
        out = torch.zeros_like(q)
        for i, n_k in enumerate(context.context_lens.tolist()):
            if n_k == 0:
                # en: A padded row (context_len 0, e.g. from a CUDA graph batch) attends to nothing: output 0.
                # zh: 填充行（context_len 为 0，例如 CUDA Graph 的批次）什么都不关注：输出 0。
                continue
            keys = gather_paged(k_cache, context.block_tables[i], n_k).to(q.dtype)
            values = gather_paged(v_cache, context.block_tables[i], n_k).to(q.dtype)
            out[i] = causal_attention(q[i : i + 1], keys, values, scale)[0]
        return out


# %% [markdown] tags=["en"]
# ## Build it: the layer
#
# Chapter 06's `Attention` saw one sequence and kept nothing. The engine's layer holds no
# weights either, but it now has a KV cache: `k_cache` and `v_cache` start empty, and the model
# runner replaces them with this layer's views of the one big KV tensor. Its `forward` compares
# with chapter 06's line by line: instead of attending over the fresh `k`, `v` as one sequence,
# it stores them through the context's slot mapping and hands the flat batch to its backend,
# whose prefill reads each sequence's cached prefix through its block table and whose decode
# reads a whole context per sequence. With an empty cache (the warm-up forward that measures
# memory) nothing is stored and prefill attends over the fresh `k`, `v`.

# %% [markdown] tags=["zh"]
# ## 动手：注意力层
#
# 第 06 章的 `Attention` 只看一个序列，也什么都不保存。引擎的这一层同样没有权重，但现在有了 KV 缓存：`k_cache`
# 和 `v_cache` 一开始是空的，模型执行器会把它们换成那个大 KV 张量中属于本层的视图。它的 `forward` 可以与第 06 章的
# 逐行对照：不再把新算出的 `k`、`v` 当作一个序列来计算注意力，而是按上下文中的槽位映射把它们存进缓存，再把展平的
# 批次交给后端：后端的 prefill 通过块表读取每个序列已缓存的前缀，decode 则为每个序列读取整段上下文。缓存为空时
# （用于测量显存的预热前向），什么都不存，prefill 直接对新算出的 `k`、`v` 计算注意力。

# %% attention layer
#| export
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.layers.attention import Attention


@add_to_init(Attention)
def _init_kv_cache(self) -> None:
    self.k_cache = self.v_cache = torch.tensor([])
    # en: The torch reference until the model runner hands every layer the configured backend.
    # zh: 在模型执行器把配置的后端交给每一层之前，用的是 torch 参考实现。
    self.backend: AttentionBackend = TorchBackend()


@add_to_class(Attention)
def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False) -> torch.Tensor:
    """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].

    ``kv_stored``: the caller already wrote k and v into the cache (the fused q/k/v kernel)."""
    # zh: q [T, num_heads, head_dim]，k 和 v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]。
    # zh:
    # zh: ``kv_stored``：调用者已经把 k 和 v 写进了缓存（融合的 q/k/v 内核）。
    context = get_context()
    if not kv_stored and self.k_cache.numel() and context.slot_mapping is not None:
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
    if context.is_prefill:
        return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, context, self.scale)
    return self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale)

# %% [markdown] tags=["en"]
# ## See it: a batch with a cached prefix, then decode
#
# Three sequences, blocks of 4 tokens, 2 query heads sharing 1 KV head. We first prefill
# sequence B's first 8 tokens (as if an earlier request had cached them), then run one prefill
# step in which A and C start from scratch and B computes only its 3 new tokens, reading its
# prefix through its block table. Then two decode steps. A dense attention over the whole
# history, computed from scratch, must give the same outputs.

# %% [markdown] tags=["zh"]
# ## 看它运行：带已缓存前缀的批次，然后 decode
#
# 三个序列，每块 4 个 token，2 个查询头共用 1 个 KV 头。先对序列 B 的前 8 个 token 做 prefill（好像之前的
# 请求已经把它们缓存了），然后跑一个 prefill 步：A 和 C 从头开始，B 只计算它的 3 个新 token，并通过块表读取
# 前缀。接着做两个 decode 步。对整个历史从头计算的稠密注意力必须给出相同的结果。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "prefill max |error| vs dense: {errors}": "prefill 与稠密注意力相比的最大 |误差|：{errors}",
    "decode {step}: slots {slots}, max |error| {errors}": "decode {step}：槽位 {slots}，最大 |误差| {errors}",
    "paged attention matches dense attention; every key sits in its slot":
        "分页注意力与稠密注意力一致；每个键都在它的槽位里",
    "a padded row stores nothing and returns zeros": "填充行什么也不写入，返回全零",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
import torch

from nanovllm.layers.attention import Attention
from nanovllm.layers.context import get_context, reset_context, set_decode_context, set_prefill_context

torch.manual_seed(0)
H, KVH, D, BS, NUM_BLOCKS = 2, 1, 8, 4, 12
attn = Attention(H, D, scale=D**-0.5, num_kv_heads=KVH)
attn.k_cache = torch.zeros(NUM_BLOCKS, BS, KVH, D)
attn.v_cache = torch.zeros(NUM_BLOCKS, BS, KVH, D)

# en: The whole story of each sequence, in tokens: 5 + 2, 11 + 2, 2 + 2 (prefill + decode).
# zh: 每个序列的完整历史（token 数）：5 + 2、11 + 2、2 + 2（prefill + decode）。
lengths = {"A": 7, "B": 13, "C": 4}
tables = {"A": [3, 7], "B": [0, 1, 5, 9], "C": [11]}
qkv = {name: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)) for name, n in lengths.items()}


def dense(name: str, upto: int) -> torch.Tensor:
    """Reference: softmax(q k^T) v over the first `upto` tokens, with an explicit causal mask."""
    # zh: 参考实现：在前 `upto` 个 token 上算 softmax(q k^T) v，使用显式的因果掩码。
    q, k, v = (t[:upto] for t in qkv[name])
    k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    scores = scores.masked_fill(torch.ones(upto, upto).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run(step: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
    """One step: (name, first position, last position + 1) per sequence, flat like the engine."""
    # zh: 一步：每个序列一个（名字，第一个位置，最后一个位置 + 1），像引擎一样展平。
    q = torch.cat([qkv[name][0][a:b] for name, a, b in step])
    k = torch.cat([qkv[name][1][a:b] for name, a, b in step])
    v = torch.cat([qkv[name][2][a:b] for name, a, b in step])
    out = attn(q, k, v)
    sizes = [b - a for _, a, b in step]
    return {name: o for (name, _, _), o in zip(step, out.split(sizes), strict=True)}


# en: an earlier request caches B's first 8 tokens
# zh: 先前的一个请求缓存了 B 的前 8 个 token。
set_prefill_context([8], [8], [tables["B"]], BS)
run([("B", 0, 8)])
ctx = set_prefill_context([5, 3, 2], [5, 11, 2], [tables[n] for n in "ABC"], BS)
print("cu_seqlens_q", ctx.cu_seqlens_q.tolist(), "cu_seqlens_k", ctx.cu_seqlens_k.tolist())
print("slot_mapping", ctx.slot_mapping.tolist())
print("block_tables", ctx.block_tables.tolist())
outs = run([("A", 0, 5), ("B", 8, 11), ("C", 0, 2)])
errors = {n: (outs[n] - dense(n, e)[s:e]).abs().max().item() for n, s, e in [("A", 0, 5), ("B", 8, 11), ("C", 0, 2)]}
print(say("prefill max |error| vs dense: {errors}", errors={n: f"{x:.1e}" for n, x in errors.items()}))
for step in range(2):
    ends = {"A": 6 + step, "B": 12 + step, "C": 3 + step}
    ctx = set_decode_context([ends[n] for n in "ABC"], [tables[n] for n in "ABC"], BS)
    outs = run([(n, ends[n] - 1, ends[n]) for n in "ABC"])
    step_errors = {n: (outs[n] - dense(n, ends[n])[-1:]).abs().max().item() for n in "ABC"}
    print(say("decode {step}: slots {slots}, max |error| {errors}", step=step, slots=ctx.slot_mapping.tolist(),
              errors={n: f"{x:.1e}" for n, x in step_errors.items()}))
    errors.update({f"{n}{step}": x for n, x in step_errors.items()})
reset_context()

# %% [markdown] tags=["en"]
# ## Check it
#
# Every output above matches the dense reference, the cached prefix included. And the cache now
# holds each token's key exactly at the slot its block table names: for example B's token 9
# sits in block `tables["B"][9 // 4] = 5` at offset 1.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 上面每个输出都与稠密参考一致，包括读取已缓存前缀的那个序列。而且缓存中每个 token 的键恰好位于其块表所指的
# 槽位：例如 B 中下标为 9 的 token（第 10 个）位于块 `tables["B"][9 // 4] = 5` 的偏移 1 处。

# %%
assert max(errors.values()) < 1e-5, errors
for name, n in lengths.items():
    # en: the last decode token was stored too, but check all but it for brevity
    # zh: 最后一个 decode token 也已写入，但为简洁起见，只检查它之前的位置。
    for position in range(n - 1):
        block = tables[name][position // BS]
        assert torch.equal(attn.k_cache[block, position % BS], qkv[name][1][position])
assert torch.equal(attn.k_cache[5, 1], qkv["B"][1][9])
print(say("paged attention matches dense attention; every key sits in its slot"))

# %% [markdown] tags=["en"]
# Padding rows, as CUDA graphs produce them (chapter 14), must be harmless: slot `-1` stores
# nothing and a context length of 0 yields zeros, not NaN.

# %% [markdown] tags=["zh"]
# CUDA Graph（第 14 章）产生的填充行必须无害：槽位 `-1` 不写入任何东西，上下文长度为 0 时输出零而不是 NaN。

# %%
from nanovllm.layers.context import set_context

before = attn.k_cache.clone()
set_context(False, slot_mapping=torch.tensor([-1]), context_lens=torch.tensor([0], dtype=torch.int32),
            block_tables=torch.tensor([[-1]], dtype=torch.int32))
padded = attn(torch.randn(1, H, D), torch.randn(1, KVH, D), torch.randn(1, KVH, D))
reset_context()
assert torch.equal(attn.k_cache, before) and torch.equal(padded, torch.zeros_like(padded))
print(say("a padded row stores nothing and returns zeros"))

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/context.py`: `Context`, `set_context`, `get_context`, `reset_context`, and
#   `set_prefill_context` / `set_decode_context` to build one from lengths and block tables.
# - `nanovllm/layers/attention.py`: chapter 06's `Attention` with a paged KV cache and a
#   `backend` object that `attention_backend(name)` builds, and `TorchBackend`: store via
#   `slot_mapping` (−1 skipped), varlen causal prefill reading cached prefixes through block
#   tables, paged decode (one sequence at a time, each reading exactly its context), GQA.
# - `nanovllm/layers/embed_head.py`: `ParallelLMHead.sampled_rows`, the last token of each
#   sequence during a prefill.
#
# ## Exercises
#
# 1. A sequence has 21 tokens with `block_size=8` and block table `[4, 2, 9]`. Which slot holds
#    token 20?
# 2. In a prefill step a sequence has `seqlen_q=3`, `seqlen_k=10`. Which key positions may its
#    second query (j = 1) attend to?
# 3. Why does decode not need `cu_seqlens_q`?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/context.py`：`Context`、`set_context`、`get_context`、`reset_context`，以及根据长度和
#   块表构造上下文的 `set_prefill_context` / `set_decode_context`。
# - `nanovllm/layers/attention.py`：带分页 KV 缓存的第 06 章 `Attention`、由
#   `attention_backend(name)` 构建的 `backend` 对象，以及 `TorchBackend`：按 `slot_mapping` 存储（跳过 −1）、
#   通过块表读取已缓存前缀的变长因果 prefill、逐个序列的分页 decode（每个序列只读取自己的上下文），以及 GQA。
# - `nanovllm/layers/embed_head.py`：`ParallelLMHead.sampled_rows`，prefill 时每个序列只取最后一个 token。
#
# ## 练习
#
# 1. 一个序列有 21 个 token，`block_size=8`，块表为 `[4, 2, 9]`。下标为 20 的 token（即最后一个）在哪个槽位？
# 2. 某个 prefill 步中，一个序列 `seqlen_q=3`、`seqlen_k=10`。它的第二个查询（j = 1）能关注哪些键位置？
# 3. 为什么 decode 不需要 `cu_seqlens_q`？
#
# 下面的单元检查答案。

# %%
# en: 1: token 20 is in block index 20 // 8 = 2, i.e. block 9, offset 4: slot 9 * 8 + 4 = 76.
# zh: 1：下标为 20 的 token 在块表下标 20 // 8 = 2 处，即块 9，偏移 4：槽位 9 * 8 + 4 = 76。
ctx = set_decode_context([21], [[4, 2, 9]], block_size=8)
assert ctx.slot_mapping.tolist() == [76]
# en: 2: query j = 1 sits at position 10 - 3 + 1 = 8: keys 0 … 8.
# zh: 2：查询 j = 1 位于位置 10 - 3 + 1 = 8：可关注键 0 … 8。
q1, k1 = torch.randn(3, 1, 4), torch.randn(10, 1, 4)
v1 = torch.zeros(10, 1, 4)
# en: only key 9 carries a value: a query that cannot see it outputs exactly 0
# zh: 只有键 9 带有值：看不到它的查询输出恰好为 0。
v1[9] = 1.0
from nanovllm.layers.attention import causal_attention

o1 = causal_attention(q1, k1, v1, scale=0.5)
assert torch.equal(o1[1], torch.zeros(1, 4)) and o1[2].abs().sum() > 0
# en: 3: every decode sequence has exactly one query, so query i is row i.
# zh: 3：decode 时每个序列恰好一个查询，所以第 i 个查询就是第 i 行。
# en: the decode context has no cu_seqlens_q
# zh: decode 的上下文没有 cu_seqlens_q。
assert ctx.cu_seqlens_q is None and ctx.context_lens.tolist() == [21]
reset_context()
print(say("all exercise answers check out"))
