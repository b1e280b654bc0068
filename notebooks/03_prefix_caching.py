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
# # 03 · Prefix caching
#
# **Goal.** By the end of this chapter you can tell, for a new prompt, which of its blocks the
# engine will not compute because their KV is already in the cache, and you can explain the
# four rules that keep that reuse *correct*. You will build the `PrefixCache` that chapter 02's
# `BlockManager` consults: chained block hashes, lookups that compare tokens, publication
# after the KV is written, and the careful removal of stale entries. Then you will break it on
# purpose and watch a cache hit hand a request somebody else's KV.

# %% [markdown] tags=["zh"]
# # 03 · 前缀缓存
#
# **目标。** 读完本章，给定一个新提示词，你能说出它的哪些块不必计算（因为 KV 已在缓存中），并能解释保证这种复用
# *正确*的四条规则。本章构建第 02 章的 `BlockManager` 要查询的 `PrefixCache`（前缀缓存）：链式块哈希、比较 token 的
# 查找、KV 写入之后才发布，以及小心地删除过期条目。然后我们故意把它弄坏，亲眼看到一次缓存命中把别人的 KV 交给了请求。

# %% [markdown] tags=["en"]
# ## The idea: name a block by everything before it
#
# Many requests start the same way: a chat template, a system prompt, a few-shot preamble.
# Their KV is identical, so computing it again is waste. The KV of token `i` depends on token
# `i` *and on every token before it* (attention looks back), so a block can be reused only by
# a prompt that agrees with it **on the whole prefix up to the block's end**, not just on the
# block's own tokens.
#
# So each full block gets a **chained hash**: the hash of its parent's hash and its own token
# ids. Two blocks have the same chained hash exactly when (barring a 64-bit collision) their
# whole prefixes are equal:
#
# ```
# prompt:  [ t0  t1  t2  t3 ][ t4  t5  t6  t7 ][ t8  t9 ]
# hash:    h0 = H(-, t0..t3)  h1 = H(h0, t4..t7)  (partial: no hash)
# ```
#
# The cache is one dictionary, `hash_to_block_id`. Four rules keep it honest:
#
# 1. **Only full blocks are published, and only after their KV is written.** A block is
#    published in postprocess, after the step that filled it. Published at allocation, a block
#    whose tokens a chunked prefill has not computed yet could be "hit" by another request.
# 2. **A hit compares tokens.** The dictionary maps a hash to a block; the block keeps the tokens
#    it was published with, and a lookup checks them (a hash collision must not become wrong KV).
# 3. **At least one prompt token is computed.** The model must run on the prompt's last token
#    to produce the logits of the first new token. So only blocks that end *before* the last
#    prompt token can be hits; a fully cached prompt still computes its last block.
# 4. **When a block is overwritten, its entry goes — but only its own.** A freed block keeps its
#    hash ("freed but still cached") and a hit revives it. When the free list hands it out for
#    new contents, the entry that still points at it must be deleted; an entry for the same hash
#    that now points at *another* block must stay. The second half of this chapter shows what
#    goes wrong otherwise.

# %% [markdown] tags=["zh"]
# ## 思路：用块之前的一切来给块命名
#
# 许多请求的开头都一样：聊天模板、系统提示词、少样本示例。它们的 KV 完全相同，重新计算就是浪费。第 `i` 个 token 的
# KV 取决于第 `i` 个 token *以及它之前的每一个 token*（注意力会往前看），所以一个块只能被这样的提示词复用：它与
# 该块**直到块末尾的整段前缀**都一致，而不仅仅是块内的 token 一致。
#
# 因此每个写满的块都有一个**链式哈希**：对父块的哈希值和自身 token id 一起求哈希。两个块的链式哈希相同，当且仅当
# （排除 64 位哈希碰撞）它们的整段前缀相同：
#
# ```
# 提示词： [ t0  t1  t2  t3 ][ t4  t5  t6  t7 ][ t8  t9 ]
# 哈希：   h0 = H(-, t0..t3)  h1 = H(h0, t4..t7)  （未写满：没有哈希）
# ```
#
# 缓存就是一个字典 `hash_to_block_id`。四条规则保证它可靠：
#
# 1. **只发布写满的块，而且要在它的 KV 写入之后。** 块在填满它的那一步之后、由后处理发布。如果在分配时就发布，
#    一个分块 prefill 尚未算到的块就可能被别的请求“命中”。
# 2. **命中时比较 token。** 字典把哈希映射到块；块保存着发布时的 token，查找时会核对（哈希碰撞绝不能变成错误的 KV）。
# 3. **至少计算一个提示词 token。** 模型必须在提示词的最后一个 token 上运行，才能得到第一个新 token 的 logits。
#    所以只有在提示词最后一个 token *之前*结束的块才能命中；即使整个提示词都已缓存，也要计算它的最后一块。
# 4. **块被覆盖时删除它的条目——但只删它自己的。** 释放的块保留哈希值（“已释放但仍在缓存中”），命中会让它复活。
#    当空闲链表把它分出去装新内容时，仍指向它的那个条目必须删除；而同一哈希值、但现在指向*另一个*块的条目必须保留。
#    本章后半部分展示不这样做会出什么错。

# %% [markdown] tags=["en"]
# ## Build it: the hash
#
# xxHash64 is fast and well distributed; the parent hash goes in as 8 bytes, the token ids as
# 64-bit integers. The first block has no parent. `-1` (`NO_HASH`) can never be a hash: the
# digest is an unsigned 64-bit number.

# %% [markdown] tags=["zh"]
# ## 动手：哈希
#
# xxHash64 速度快、分布均匀；父块哈希以 8 字节输入，token id 以 64 位整数输入。第一块没有父块。`-1`（`NO_HASH`）
# 永远不会是哈希值：摘要是一个无符号 64 位整数。

# %% default module
#| default_exp engine.prefix_cache

# %% block hash
#| export
from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import xxhash

from nanovllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.engine.block_manager import Block

NO_HASH = -1


def block_hash(token_ids: list[int], parent: int = NO_HASH) -> int:
    """Chained hash of a full block: xxh64 over the parent block's hash and this block's token ids."""
    h = xxhash.xxh64()
    if parent != NO_HASH:
        h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()

# %% [markdown] tags=["en"]
# ## Build it: the cache
#
# `PrefixCache` shares the list of blocks with the block manager and owns the dictionary.
# Three methods, one per rule-bearing moment:
#
# - `match(seq)`, at allocation: walk the prompt's blocks from the start, hashing as we go, and
#   stop at the first miss (the hit blocks must form a prefix: `num_cached_tokens` is a count
#   from the start). Rules 2 and 3 live here.
# - `publish(seq)`, in postprocess: every block that is now full *and* whose KV is written gets
#   its hash and tokens, and the dictionary points at it. Rule 1 lives here. Published blocks of
#   a sequence always form a prefix of its table, so we find where to start by walking back from
#   the last full block.
# - `forget(block)`, right before the block manager overwrites a block. Rule 4 lives here, in
#   the `if`: delete the entry **only if it still points at this block**.

# %% [markdown] tags=["zh"]
# ## 动手：缓存
#
# `PrefixCache` 与块管理器共享同一个块列表，字典归它自己所有。三个方法，各对应一个需要遵守规则的时刻：
#
# - `match(seq)`，在分配时调用：从头遍历提示词的块，边走边求哈希，遇到第一个未命中就停（命中的块必须构成前缀：
#   `num_cached_tokens` 是从头数起的个数）。规则 2 和 3 在这里。
# - `publish(seq)`，在后处理中调用：每个已写满*且* KV 已写入的块都得到它的哈希值和 token，字典指向它。规则 1 在这里。
#   一个序列已发布的块总是构成块表的前缀，所以从最后一个写满的块往回走，就能找到从哪里开始发布。
# - `forget(block)`，在块管理器覆盖某个块之前调用。规则 4 就在那个 `if` 里：**只有当条目仍然指向这个块时**才删除它。

# %% prefix cache
#| export
class PrefixCache:
    """Published full blocks by chained hash, so that a new prompt can reuse their KV."""

    def __init__(self, blocks: list[Block], block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.hash_to_block_id: dict[int, int] = {}

    def match(self, seq: Sequence) -> list[int]:
        """Ids of the blocks holding the KV of ``seq``'s leading full blocks (stops at the first miss)."""
        hits: list[int] = []
        parent = NO_HASH
        # en: Only blocks that end before the last token: that token must be computed to get logits.
        # zh: 只看在最后一个 token 之前结束的块：最后一个 token 必须计算，才能得到 logits。
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = seq.block(i)
            h = block_hash(token_ids, parent)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
            parent = h
        return hits

    def publish(self, seq: Sequence) -> None:
        """Publish ``seq``'s full blocks whose KV has been written (call after each step)."""
        num_full = seq.num_cached_tokens // self.block_size
        start = num_full
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash == NO_HASH:
            start -= 1
        parent = self.blocks[seq.block_table[start - 1]].hash if start > 0 else NO_HASH
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = seq.block(i)
            block.hash = block_hash(block.token_ids, parent)
            # en: If another block already holds the same prefix, the newest one wins; forget() copes.
            # zh: 若已有另一个块存着同样的前缀，以最新的为准；forget() 能正确处理这种情况。
            self.hash_to_block_id[block.hash] = block.block_id
            parent = block.hash

    def forget(self, block: Block) -> None:
        """``block`` is about to be overwritten: remove its entry, if the entry is still its own."""
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
