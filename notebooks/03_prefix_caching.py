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
# **目标：** 读完本章，给定一个新提示词，你能说出它的哪些块不必计算（因为 KV 已在缓存中），并能解释保证这种复用
# *正确*的四条规则。本章构建第 02 章的 `BlockManager` 要查询的 `PrefixCache`（前缀缓存）：链式块哈希、比较 token 的
# 查找、KV 写入之后才发布（即把块登记到前缀缓存），以及小心地删除过期条目。然后我们故意把它弄坏，亲眼看到一次缓存
# 命中把别人的 KV 交给了请求。

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
# ## 思路：用块及其之前的全部 token 标识一个块
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
# 4. **块被覆盖时删除它的条目——但只删它自己的。** 释放的块保留哈希值（“已释放但仍在缓存中”），命中会让它复活
#    （把它从空闲队列取回、直接复用，不必重算）。当空闲队列把它分出去装新内容时，仍指向它的那个条目必须删除；
#    而同一哈希值、但现在指向*另一个*块的条目必须保留。本章后半部分展示不这样做会出什么错。

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
    # zh: 写满的块的链式哈希：对父块的哈希与本块的 token id 做 xxh64。
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
# `PrefixCache` 与块管理器共享同一个块列表，字典归它自己所有。三个方法分别在三个时刻执行相应的规则：
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
    # zh: 已发布的写满的块，按链式哈希登记，让新的提示词可以复用它们的 KV。

    def __init__(self, blocks: list[Block], block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.hash_to_block_id: dict[int, int] = {}

    def match(self, seq: Sequence) -> list[int]:
        """Ids of the blocks holding the KV of ``seq``'s leading full blocks (stops at the first miss)."""
        # zh: 装着 ``seq`` 开头那些写满的块的 KV 的块 id（遇到第一个未命中就停下）。
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
            # en: If another block already holds the same prefix, the newest one wins; forget() copes.
            # zh: 若已有另一个块存着同样的前缀，以最新的为准；forget() 能正确处理这种情况。
            self.hash_to_block_id[block.hash] = block.block_id
            parent = block.hash

    def forget(self, block: Block) -> None:
        """``block`` is about to be overwritten: remove its entry, if the entry is still its own."""
        # zh: ``block`` 即将被覆盖：删除它的条目，前提是这个条目仍然指向它自己。
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]

# %% [markdown] tags=["en"]
# ## Build it: the block manager consults the cache
#
# Chapter 02's classes now learn about the cache; each change below extends the class that
# chapter 02 built (the book's `add_to_class`, appendix D), and the package's
# `engine/block_manager.py` holds the result as one class each:
#
# - A `Block` gains its `hash` (`NO_HASH` until published) and the `token_ids` it was published
#   with, and `reset()`, which forgets both before the block is given new contents.
# - The pool owns the `PrefixCache` (or none, with `enable_prefix_caching=False`).
#   `take_free_block` now asks the cache to `forget` the block before resetting it (chapter 02's
#   hook `_forget_old_contents`): rule 4 at the one place where contents are overwritten. `hold`
#   is new: one more reference to a block whose contents we reuse; a block whose count was 0 is
#   *revived*, which takes it out of the free list (otherwise the free list could hand it to
#   somebody else while it is in use).
# - `allocate` asks the cache for hits first: they are *held* instead of taken, and
#   `num_cached_tokens` tells the scheduler how many tokens need no computing. `can_allocate`
#   counts only the blocks that must come from the free list: a hit on a block that another
#   sequence uses costs no free block; a hit on a *free* block consumes that very block.
# - `publish_full_blocks(seq)`, called by the scheduler's postprocess after each step, hands the
#   blocks that the step just *filled* to the cache (rule 1).

# %% [markdown] tags=["zh"]
# ## 动手：块管理器查询缓存
#
# 第 02 章的类现在要认识这个缓存；下面的每处改动都在扩展第 02 章构建的类（即本书的 `add_to_class`，见附录 D），
# 包中的 `engine/block_manager.py` 把结果保存为每个类一个整体：
#
# - `Block` 增加 `hash`（发布之前为 `NO_HASH`）和发布时的 `token_ids`，以及 `reset()`：在块装入新内容之前忘掉这两者。
# - 块池拥有 `PrefixCache`（`enable_prefix_caching=False` 时没有）。`take_free_block` 现在先让缓存 `forget` 这个块，
#   再重置它（第 02 章的接缝 `_forget_old_contents`）：规则 4 落在覆盖内容的唯一位置。`hold` 是新方法：给一个要复用
#   其内容的块再加一个引用；计数原为 0 的块被*复活*，也就是把它移出空闲队列（否则空闲队列可能在它还被使用时把它交给
#   别人）。
# - `allocate` 先向缓存要命中的块：这些块被*持有*而不是新取，`num_cached_tokens` 告诉调度器有多少个 token 不必计算。
#   `can_allocate` 只计算必须从空闲队列取的块：命中另一个序列正在使用的块不占空闲块；命中一个*空闲*块则恰好消耗这个块。
# - `publish_full_blocks(seq)` 由调度器的后处理在每一步之后调用，把这一步刚*写满*的块交给缓存（规则 1）。

# %% block learns its hash
#| export engine.block_manager
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.block_manager import Block, BlockManager, BlockPool
from nanovllm.engine.prefix_cache import NO_HASH, PrefixCache
from nanovllm.engine.sequence import Sequence


@add_to_init(Block)
def _init_hash(self) -> None:
    # en: The prefix-cache key of a full block whose KV is written; NO_HASH until then.
    # zh: 一个 KV 已写入的写满的块的前缀缓存键；在此之前为 NO_HASH。
    self.hash = NO_HASH
    self.token_ids: list[int] = []


@add_to_class(Block)
def reset(self) -> None:
    """Forget the old contents: the block is about to hold new tokens."""
    # zh: 忘掉旧内容：这个块即将装入新的 token。
    self.hash = NO_HASH
    self.token_ids = []


@add_to_class(Block)
def __repr__(self) -> str:
    published = f", hash={self.hash:#018x}" if self.hash != NO_HASH else ""
    return f"Block({self.block_id}, ref_count={self.ref_count}{published})"

# %% pool owns the cache
#| export engine.block_manager
# en: A subclass may swap in another cache (to try a broken one, for example).
# zh: 子类可以换上另一种缓存（比如为了试一个有缺陷的缓存）。
BlockPool.prefix_cache_class = PrefixCache


@add_to_init(BlockPool)
def _init_prefix_cache(self) -> None:
    self.prefix_cache: PrefixCache | None = (
        self.prefix_cache_class(self.blocks, self.block_size) if self.enable_prefix_caching else None
    )


@add_to_class(BlockPool)
@property
def hash_to_block_id(self) -> dict[int, int]:
    """Published blocks by hash (read it, do not write it; empty when prefix caching is off)."""
    # zh: 按哈希登记的已发布块（只读，不要写；前缀缓存关闭时为空）。
    return self.prefix_cache.hash_to_block_id if self.prefix_cache is not None else {}


@add_to_class(BlockPool)
def _forget_old_contents(self, block: Block) -> None:
    """The block is about to get new contents: unpublish the old ones (rule 4), then forget them."""
    # zh: 这个块即将装入新内容：先撤销旧内容的发布（规则 4），再忘掉它们。
    if self.prefix_cache is not None:
        self.prefix_cache.forget(block)
    block.reset()


@add_to_class(BlockPool)
def hold(self, block_id: int) -> None:
    """Add a reference to a block whose contents we reuse, reviving it if it was free."""
    # zh: 给一个内容被复用的块增加一个引用；如果它在空闲队列里，就把它复活。
    block = self.blocks[block_id]
    if block.ref_count == 0:
        # en: Freed but still cached: this exact block leaves the free list.
        # zh: 已释放但仍在缓存中：正是这个块离开空闲队列。
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
    block.ref_count += 1

# %% allocate with hits
#| export engine.block_manager
@add_to_class(BlockManager)
def _cache_hits(self, seq: Sequence) -> list[int]:
    return self.prefix_cache.match(seq) if self.prefix_cache is not None else []


@add_to_class(BlockManager)
def _free_blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
    shared = sum(1 for block_id in hits if self.blocks[block_id].ref_count > 0)
    return seq.num_blocks - shared


@add_to_class(BlockManager)
def can_allocate(self, seq: Sequence) -> bool:
    """True when the free list can supply every block ``seq`` needs (after cache hits)."""
    # zh: （算上缓存命中之后）空闲队列能提供 ``seq`` 所需的每一个块时为 True。
    return self._free_blocks_needed(seq, self._cache_hits(seq)) <= len(self.free_block_ids)


@add_to_class(BlockManager)
def allocate(self, seq: Sequence) -> None:
    """Give ``seq`` its blocks; set ``num_cached_tokens`` to the tokens found in the cache."""
    # zh: 给 ``seq`` 分配块；把 ``num_cached_tokens`` 设为在缓存中找到的 token 数。
    assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
    hits = self._cache_hits(seq)
    assert self._free_blocks_needed(seq, hits) <= len(self.free_block_ids), "ask can_allocate first"
    # en: Hits first: a hit on a free block must be revived before the misses draw from the free list.
    # zh: 先处理命中：命中的空闲块必须先复活，未命中的部分才能从空闲队列取块。
    for block_id in hits:
        self.hold(block_id)
    seq.block_table = hits + [self.take_free_block() for _ in range(seq.num_blocks - len(hits))]
    seq.num_cached_tokens = len(hits) * self.block_size


@add_to_class(BlockManager)
def publish_full_blocks(self, seq: Sequence) -> None:
    """After a step wrote their KV, make ``seq``'s newly full blocks findable by prefix caching."""
    # zh: 一步写入了 KV 之后，让 ``seq`` 新写满的块能被前缀缓存找到。
    if self.prefix_cache is not None:
        self.prefix_cache.publish(seq)

# %% [markdown] tags=["en"]
# ## See it: a shared system prompt, with a KV cache that remembers who wrote what
#
# To *see* whether a hit is correct we need more than block ids. `ProvenanceKV` stands in for
# the model's KV cache: whenever a step computes token `pos` of a sequence, it writes into that
# token's slot (`block_table[pos // block_size] * block_size + pos % block_size`) a record of
# *what the real KV would depend on*: the tokens up to and including `pos`, and `pos` itself.
# `wrong_reads(seq)` lists the cached positions of `seq` whose slot holds anything else. A
# correct cache never produces one.
#
# `run_prompt` does a prefill the way the scheduler will: allocate (cache hits fill
# `num_cached_tokens`), check what the hits point at, compute (write) the remaining tokens,
# and publish in "postprocess". `finish` frees the sequence.

# %% [markdown] tags=["zh"]
# ## 看它运行：共享的系统提示词，以及一个记得“谁写了什么”的 KV 缓存
#
# 要*看清*一次命中是否正确，光有块编号还不够。`ProvenanceKV` 替代模型的 KV 缓存：每当某一步计算序列的第 `pos` 个
# token，它就在这个 token 的槽位（`block_table[pos // block_size] * block_size + pos % block_size`）里记下
# *真实 KV 所依赖的东西*：直到 `pos`（含）为止的 token，以及 `pos` 本身。`wrong_reads(seq)` 列出 `seq` 的已缓存位置中
# 槽位内容不符的那些。正确的缓存永远不会产生这样的位置。
#
# `run_prompt` 按调度器将来的方式做一次 prefill：分配块（缓存命中会填写 `num_cached_tokens`），
# 检查命中的块里存的是什么，计算（写入）其余 token，并在“后处理”中发布。`finish` 释放序列。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "  !! seq {seq}: cached positions {bad} hold KV written for another prefix":
        "  !! 序列 {seq}：已缓存的位置 {bad} 存的是为另一个前缀写入的 KV",
    "free={free}": "空闲队列={free}",
    "{name} prefilled, hits {hits}": "{name} prefill 完毕，命中 {hits}",
    "A and B finished": "A 和 B 完成",
    "prompt == system, hits {hits}": "提示词 == 系统提示词，命中 {hits}",
    "shared-prefix claims hold": "共享前缀的论断成立",
    "published after the 6-token chunk: blocks {published}; the second request hits {hits}":
        "6 个 token 的分块之后发布了块 {published}；第二个请求命中 {hits}",
    "a colliding entry with other tokens is not a hit": "token 不同的碰撞条目不算命中",
    "blocks {ids}: free but cached after C, revived by D's hit at step {step}":
        "块 {ids}：C 之后空闲但仍被缓存，在第 {step} 步被 D 的命中复活",
    "  C's position {pos} reads KV written for the prefix {written}, not {own}":
        "  C 的位置 {pos} 读到的是为前缀 {written} 写入的 KV，而不是 {own}",
    "broken (entry kept):": "有缺陷的版本（保留条目）：",
    "  C's cache hits: {hits}, wrong positions: {wrong}": "  C 的缓存命中：{hits}，出错的位置：{wrong}",
    "ours (entry removed only if it is the block's own):": "本书的版本（条目属于该块时才删除）：",
    "delete by hash alone:": "只按哈希删除：",
    "ours:": "本书：",
    "pool (blocks of 4)": "块池（每块 4 个）",
    "caching off": "关闭缓存",
    "forward free": "正序释放",
    "backward free": "倒序释放",
    "experiment claims hold": "实验的论断成立",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.prefix_cache import NO_HASH, PrefixCache, block_hash
from nanovllm.engine.sequence import Sequence


class ProvenanceKV:
    """Stands in for the KV cache: each slot remembers the prefix and position that wrote it."""
    # zh: 代替 KV 缓存：每个槽位都记得是哪段前缀、哪个位置写了它。

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[tuple[int, ...], int]] = {}

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, seq: Sequence, num_tokens: int) -> None:
        for pos in range(seq.num_cached_tokens, seq.num_cached_tokens + num_tokens):
            self.slots[self.slot(seq, pos)] = (tuple(seq.token_ids[: pos + 1]), pos)

    def wrong_reads(self, seq: Sequence) -> list[int]:
        expected = [(tuple(seq.token_ids[: pos + 1]), pos) for pos in range(seq.num_cached_tokens)]
        return [pos for pos, want in enumerate(expected) if self.slots.get(self.slot(seq, pos)) != want]


def run_prompt(bm: BlockManager, kv: ProvenanceKV, seq: Sequence, chunk: int | None = None) -> list[int]:
    """Prefill ``seq`` (or its first ``chunk`` uncached tokens); return the cache hits' block ids."""
    # zh: prefill ``seq``（或者它前 ``chunk`` 个未缓存的 token）；返回缓存命中的块 id。
    bm.allocate(seq)
    hits = seq.block_table[: seq.num_cached_tokens // bm.block_size]
    bad = kv.wrong_reads(seq)
    if bad:
        print(say("  !! seq {seq}: cached positions {bad} hold KV written for another prefix", seq=seq.seq_id, bad=bad))
    todo = len(seq) - seq.num_cached_tokens if chunk is None else chunk
    kv.write(seq, todo)
    seq.num_cached_tokens += todo
    # en: Postprocess: only now is the KV there.
    # zh: 后处理：直到这时 KV 才真正写好。
    bm.publish_full_blocks(seq)
    return hits


def finish(bm: BlockManager, *seqs: Sequence) -> None:
    for seq in seqs:
        bm.deallocate(seq)


def short(h: int) -> str:
    return "-" if h == NO_HASH else f"{h:016x}"[:6]


def show(bm: BlockManager, label: str) -> None:
    blocks = " ".join(f"{b.block_id}:r{b.ref_count}/{short(b.hash)}" for b in bm.blocks)
    print(f"{label:<34} {blocks}   {say('free={free}', free=list(bm.free_block_ids))}")


bm = BlockManager(num_blocks=8, block_size=4)
kv = ProvenanceKV(block_size=4)
# en: Two full blocks.
# zh: 两个写满的块。
system = [11, 12, 13, 14, 15, 16, 17, 18]
a = Sequence([*system, 1, 2, 3], block_size=4)
b = Sequence([*system, 4, 5], block_size=4)
hits_a = run_prompt(bm, kv, a)
a_table, a_hashes = list(a.block_table), [bm.blocks[i].hash for i in a.block_table]
show(bm, say("{name} prefilled, hits {hits}", name="A", hits=hits_a))
hits_b = run_prompt(bm, kv, b)
show(bm, say("{name} prefilled, hits {hits}", name="B", hits=hits_b))
finish(bm, a, b)
show(bm, say("A and B finished"))
c = Sequence([*system, 6], block_size=4)
hits_c = run_prompt(bm, kv, c)
show(bm, say("{name} prefilled, hits {hits}", name="C", hits=hits_c))
exact = Sequence(list(system), block_size=4)
hits_exact = run_prompt(bm, kv, exact)
show(bm, say("prompt == system, hits {hits}", hits=hits_exact))

# %% [markdown] tags=["en"]
# Each block shows `id:r<ref count>/<first hex digits of its hash>`. A published blocks 0
# and 1 (full, KV written) but not block 2, which holds 3 tokens. B found both system-prompt
# blocks: their counts went to 2 and B computed only its own 2 tokens. After both finished,
# the blocks are free *and still hashed*; C revived exactly blocks 0 and 1, which left the
# free list. The last prompt *is* the system prompt: all 8 tokens are cached, yet only block 0
# is a hit, because its last token must be computed to get logits (rule 3). Its second block
# is therefore a fresh block with the *same* hash as block 1: after its publication the
# dictionary points at the newer block. No `!!` line appeared: no hit read foreign KV.

# %% [markdown] tags=["zh"]
# 每个块显示为 `编号:r<引用计数>/<哈希值的前几位十六进制>`。A 发布了块 0 和块 1（写满且 KV 已写入），没有发布只有
# 3 个 token 的块 2。B 找到了系统提示词的两个块：它们的计数变为 2，B 只计算了自己的 2 个 token。两者结束后，这些块
# 是空闲的，*但仍带着哈希值*；C 正好复活了块 0 和块 1，它们离开了空闲队列。最后一个提示词*就是*系统提示词本身：8 个
# token 都在缓存里，却只有块 0 命中，因为它的最后一个 token 必须计算才能得到 logits（规则 3）。于是它的第二块是一个
# 新块，哈希值与块 1 *相同*：发布之后，字典指向这个较新的块。没有出现 `!!` 行：没有任何命中读到别人的 KV。

# %%
assert hits_a == [] and hits_b == a_table[:2] == [0, 1]
# en: The partial block was not published.
# zh: 未写满的块没有被发布。
assert a_hashes[2] == NO_HASH and NO_HASH not in a_hashes[:2]
assert hits_c == [0, 1] and c.block_table[:2] == [0, 1]
assert hits_exact == [0] and exact.num_cached_tokens == 8
second_block = exact.block_table[1]
assert second_block != 1 and bm.blocks[second_block].hash == bm.blocks[1].hash
assert bm.hash_to_block_id[bm.blocks[1].hash] == second_block
assert all(not kv.wrong_reads(s) for s in (a, b, c, exact))
print(say("shared-prefix claims hold"))

# %% [markdown] tags=["en"]
# ### A miss ends the match
#
# `match` stops at the first block that misses, even where a later block of the prompt holds the
# very tokens of a published block: the hit blocks must form a prefix, since `num_cached_tokens`
# counts from the start, and a block's hash names everything before it. A prompt that shares the
# system prompt's first block, changes one token of its second, and then repeats a published
# third block finds only the first.

# %% [markdown] tags=["zh"]
# ### 一次未命中就结束匹配
#
# `match` 在第一个未命中的块处停下，哪怕提示词后面某个块的 token 与某个已发布的块完全相同：命中的块必须构成前缀，
# 因为 `num_cached_tokens` 从头开始计数，而一个块的哈希代表它之前的全部内容。一个提示词与系统提示词共享第一块、
# 改动第二块中的一个 token、再重复一个已发布的第三块，它只能找到第一块。

# %%
miss_bm = BlockManager(num_blocks=12, block_size=4)
miss_kv = ProvenanceKV(block_size=4)
published = Sequence([*system, 21, 22, 23, 24, 25], block_size=4)
run_prompt(miss_bm, miss_kv, published)
third = miss_bm.blocks[published.block_table[2]]
# en: the system prompt's second block with one token changed, then the published third block's very tokens
# zh: 系统提示词的第二块改动一个 token，然后是与已发布的第三块完全相同的 token
changed = Sequence([*system[:4], 15, 16, 17, 99, 21, 22, 23, 24, 26], block_size=4)
hits_changed = run_prompt(miss_bm, miss_kv, changed)
print(say("{name} prefilled, hits {hits}", name="D", hits=hits_changed))
assert third.token_ids == changed.block(2) and third.hash != NO_HASH
assert hits_changed == [published.block_table[0]]
assert not miss_kv.wrong_reads(changed)

# %% [markdown] tags=["en"]
# ### Rule 1: publish after the write
#
# A 12-token prompt prefilled in a chunk of 6 tokens: after the chunk, block 0 is complete and
# published, block 1 is half written and must *not* be findable yet. A second request with the
# same prompt arriving now reuses block 0 only. Had the blocks been published at allocation,
# it would also have "hit" block 1 and read its last two slots (positions 6 and 7), which
# nobody had written yet.
#
# So a hash of −1 (`NO_HASH`) means *not published yet*, not *not full*: after the chunk, blocks
# 1 and 2 each hold four of the prompt's tokens, and both are still −1 (block 2 has no KV at all).
# The second article reads −1 as 未填满 (not full), which was true of the code it quotes: that
# code hashed every full block of a prompt at allocation, before its KV was written (appendix B,
# section "The code the second article quotes").

# %% [markdown] tags=["zh"]
# ### 规则 1：写入之后再发布
#
# 一个 12 个 token 的提示词，先做一个 6 个 token 的 prefill 分块：这个分块算完后，块 0 已完整并发布，块 1 只写了一半，
# 此时*绝不能*被找到。这时到来的另一个相同提示词的请求只复用块 0。如果在分配时就发布这些块，它还会“命中”块 1，
# 读到其中最后两个槽位（位置 6 和 7）——那里还没有人写过。
#
# 所以哈希为 −1（`NO_HASH`）的意思是*尚未发布*，而不是*未填满*：这个分块之后，块 1 和块 2 各装着提示词的 4 个
# token，哈希却都还是 −1（块 2 连一个 token 的 KV 都还没有）。第二篇文章把 −1 解读为“未填满”，这对它所引用的代码
# 是成立的：那份代码在分配时就给提示词的每个写满的块求哈希，那时 KV 还没有写入（见附录 B 的“第二篇文章引用的代码”
# 一节）。

# %%
bm = BlockManager(num_blocks=8, block_size=4)
kv = ProvenanceKV(block_size=4)
prompt = list(range(40, 52))
first = Sequence(prompt, block_size=4)
bm.allocate(first)
# en: Allocation publishes nothing.
# zh: 分配时不发布任何块。
assert bm.hash_to_block_id == {}
kv.write(first, 6)
first.num_cached_tokens += 6
bm.publish_full_blocks(first)
published = sorted(bm.hash_to_block_id.values())
# en: Blocks 1 and 2 are full of the prompt's tokens, yet unpublished: -1 means "not published yet".
# zh: 块 1 和块 2 装满了提示词的 token，却都没有发布：-1 的意思是“尚未发布”。
assert [len(first.block(i)) for i in (1, 2)] == [4, 4]
assert [bm.blocks[block_id].hash for block_id in first.block_table[1:]] == [NO_HASH, NO_HASH]
second = Sequence(prompt, block_size=4)
hits = run_prompt(bm, kv, second)
print(say("published after the 6-token chunk: blocks {published}; the second request hits {hits}",
          published=published, hits=hits))
assert published == [first.block_table[0]] and hits == [first.block_table[0]] and not kv.wrong_reads(second)

# %% [markdown] tags=["en"]
# ### Rule 2: a hit compares tokens
#
# We fake a hash collision by pointing the hash of a new prompt's first block at a block that
# holds other tokens. The lookup finds the entry, compares tokens, and refuses.

# %% [markdown] tags=["zh"]
# ### 规则 2：命中时比较 token
#
# 我们伪造一次哈希碰撞：把一个新提示词第一块的哈希值指向一个存着别的 token 的块。查找找到了条目，比较 token 后拒绝命中。

# %%
probe = Sequence([7, 7, 7, 7, 8], block_size=4)
bm.prefix_cache.hash_to_block_id[block_hash([7, 7, 7, 7])] = first.block_table[0]
assert bm.blocks[first.block_table[0]].token_ids == [40, 41, 42, 43]
assert bm.prefix_cache.match(probe) == []
del bm.prefix_cache.hash_to_block_id[block_hash([7, 7, 7, 7])]
print(say("a colliding entry with other tokens is not a hit"))

# %% [markdown] tags=["en"]
# ### A revival, animated
#
# Request C runs alone and finishes: its blocks go back to the free list, but its two full
# blocks keep their hashes — **free but cached** (drawn dashed). Request D then arrives with the
# same first 8 tokens, and its cache hits take *those very blocks* back out of the free list.
# Step through the player (appendix A builds it) and hover the blocks.

# %% [markdown] tags=["zh"]
# ### 复活，动画版
#
# 请求 C 单独运行并完成：它的块回到空闲队列，但两个写满的块保留着哈希——**空闲但仍被缓存**（画成虚线）。
# 随后请求 D 到达，前 8 个 token 与 C 相同，它的缓存命中把*正是这两个块*从空闲队列中取了回来。
# 单步播放下面的播放器（由附录 A 构建），把鼠标移到块上看看。

# %% revival animated
from IPython.display import display

from nanovllm.viz import FakeEngine, Player

engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
seq_c = engine.add([*range(60, 68), 1], max_tokens=1)
engine.run()
seq_d = engine.add([*range(60, 68), 2, 3], max_tokens=2)
engine.run()
reviving = engine.recording
display(Player(reviving))

frames = reviving["frames"]
c_done = next(f for f in frames if f["phase"] == "postprocess" and seq_c.seq_id in f["event"]["finished"])
revived = next(f for f in frames if f["phase"] == "schedule" and f["event"]["cache_hits"])
hit_ids = revived["event"]["cache_hits"][0]["blocks"]
assert len(hit_ids) == 2
assert all(c_done["blocks"][i]["state"] == "cached" and i in c_done["free_list"] for i in hit_ids)
assert all(revived["blocks"][i]["state"] == "used" and revived["blocks"][i]["ref_count"] == 1 for i in hit_ids)
print(say("blocks {ids}: free but cached after C, revived by D's hit at step {step}", ids=hit_ids,
          step=revived["step"]))

# %% [markdown] tags=["en"]
# ## The stale-entry trap
#
# Rule 4 is one `if` in `forget`. For its first ten months (June 2025 to April 2026) upstream
# nano-vllm had no such check: when a free block was reused, its old hash entry stayed in the
# dictionary. Upstream added the check on 2026-04-26, in commit `f64d821` ("fix chunked prefill
# bugs and refactor"), inside its `_allocate_block`. The two articles this book answers stand on
# either side of that commit. The second one, the walk through the scheduler and the block
# manager with the vLLM paper's figures, quotes upstream from before chunked prefill (appendix B
# dates it: `main` between 2025-08-31 and 2026-04-13), and its `_allocate_block` is the version
# with the stale-entry bug: it resets the block and moves it
# from the free list to the used set, and leaves the block's old entry in `hash_to_block_id`.
# The line-by-line annotation of `sequence.py` and `scheduler.py` reads upstream after the fix,
# whose `_allocate_block` has the same `if` as our `forget`. The trap keeps its section either
# way: the check is easy to lose in a rewrite, and only a workload that reuses blocks notices it
# is gone. The token comparison of rule 2 does not save us, because it compares only the block's
# *own* tokens. Here is the recipe for a false hit, three requests in a pool of 3 blocks of 2
# tokens:
#
# 1. A = `[1 2 | 3 4 | 9]` publishes block 0 = `(-, 1 2)` and block 1 = `(1 2, 3 4)`; A finishes.
#    The free list is now `2, 1, 0` (backwards).
# 2. B = `[7 7 | 3 4]` takes blocks 2 and 1. Block 1 now holds the KV of `3 4` *after `7 7`*
#    and is published under B's hash, with tokens `3 4`. If A's entry for block 1 survived…
# 3. C = `[1 2 | 3 4 | 5]` looks up `(1 2, 3 4)`, finds block 1, compares tokens: `3 4` equals
#    `3 4`. Hit. C now attends to keys and values computed for a different prefix, and nothing
#    crashes: the output is just silently wrong.
#
# We define the broken variant here, in the chapter only (it is not part of the package), and
# run the recipe with both.

# %% [markdown] tags=["zh"]
# ## 过期条目的陷阱
#
# 规则 4 就是 `forget` 里的一个 `if`。上游 nano-vllm 在最初的十个月里（2025 年 6 月到 2026 年 4 月）没有这个检查：
# 空闲块被重新使用时，它的旧哈希条目仍留在字典里。上游在 2026-04-26 的提交 `f64d821`（“fix chunked prefill bugs and
# refactor”）中，在 `_allocate_block` 里加上了同样的检查。本书所回应的两篇文章恰好分处这个提交的两侧。第二篇文章
# 借用 vLLM 论文的插图讲解调度器和块管理器，它引用的是分块 prefill 出现之前的上游代码（附录 B 考证了它的年代：
# 2025-08-31 到 2026-04-13 之间的 `main` 分支），其中的 `_allocate_block`
# 正是带着过期条目缺陷的版本：它重置块，把块从空闲队列移进已用集合，却把块的旧条目留在 `hash_to_block_id` 里。
# 逐行注解 `sequence.py` 和 `scheduler.py` 的那篇文章读的是修复之后的上游，那里的 `_allocate_block` 有和我们的
# `forget` 相同的 `if`。无论读的是哪个版本，这个陷阱在本书里都值得专门一节：重写代码时很容易把这个检查弄丢，
# 而只有会复用块的负载才能发现它不见了。规则 2 的 token 比较救不了我们，因为它只比较块*自己*的 token。
# 下面一步步复现一次错误命中，用的是一个 3 个块、每块 2 个 token 的池子和三个请求：
#
# 1. A = `[1 2 | 3 4 | 9]` 发布块 0 = `(-, 1 2)` 和块 1 = `(1 2, 3 4)`；A 结束。空闲队列变为 `2, 1, 0`（倒序）。
# 2. B = `[7 7 | 3 4]` 取走块 2 和块 1。块 1 现在存的是*跟在 `7 7` 之后*的 `3 4` 的 KV，并以 B 的哈希值发布，
#    token 为 `3 4`。如果 A 关于块 1 的条目还活着……
# 3. C = `[1 2 | 3 4 | 5]` 查找 `(1 2, 3 4)`，找到块 1，比较 token：`3 4` 等于 `3 4`。命中。C 的注意力于是用上了
#    为另一段前缀计算的键和值，而且什么都不会崩溃：输出只是悄悄地错了。
#
# 我们在本章里定义这个有缺陷的变体（它不属于包），并用两个版本分别把这三个请求跑一遍。

# %%
class ForgetfulPrefixCache(PrefixCache):
    """Upstream's bug until 2026-04-26: an overwritten block's old entry stays in the dictionary."""
    # zh: 上游在 2026-04-26 之前的 bug：被覆盖的块的旧条目留在字典里。

    def forget(self, block) -> None:
        pass


class ForgetfulBlockManager(BlockManager):
    prefix_cache_class = ForgetfulPrefixCache


def stale_recipe(manager_class: type[BlockManager]) -> tuple[list[int], list[int]]:
    bm = manager_class(num_blocks=3, block_size=2)
    kv = ProvenanceKV(block_size=2)
    a, b, c = (Sequence(t, block_size=2) for t in ([1, 2, 3, 4, 9], [7, 7, 3, 4], [1, 2, 3, 4, 5]))
    run_prompt(bm, kv, a)
    finish(bm, a)
    run_prompt(bm, kv, b)
    finish(bm, b)
    hits = run_prompt(bm, kv, c)
    wrong = kv.wrong_reads(c)
    if wrong:
        written_for = kv.slots[kv.slot(c, wrong[0])][0]
        print(say("  C's position {pos} reads KV written for the prefix {written}, not {own}",
                  pos=wrong[0], written=written_for, own=tuple(c.token_ids[:3])))
    return hits, wrong


print(say("broken (entry kept):"))
broken_hits, broken_wrong = stale_recipe(ForgetfulBlockManager)
print(say("  C's cache hits: {hits}, wrong positions: {wrong}", hits=broken_hits, wrong=broken_wrong))
print(say("ours (entry removed only if it is the block's own):"))
good_hits, good_wrong = stale_recipe(BlockManager)
print(say("  C's cache hits: {hits}, wrong positions: {wrong}", hits=good_hits, wrong=good_wrong))
assert broken_hits == [0, 1] and broken_wrong == [2, 3]
assert good_hits == [0] and good_wrong == []

# %% [markdown] tags=["en"]
# Why "only if it still points at this block", and not simply "delete the entry for this
# block's hash"? Because two blocks can carry the same hash: we saw it above, when a prompt
# equal to the system prompt recomputed its last block. The dictionary points at the newer one.
# When the *older* block is reused, deleting by hash alone would drop the entry of the newer
# block, which still holds perfectly good KV: no wrong output, but a lost hit.

# %% [markdown] tags=["zh"]
# 为什么是“只有当条目仍指向这个块时才删”，而不是简单地“删掉这个块的哈希值对应的条目”？因为两个块可能带着同一个哈希值：
# 上面已经见过，一个与系统提示词完全相同的提示词重新计算了它的最后一块。字典指向较新的那个块。当*较旧*的块被重新使用时，
# 只按哈希值删除，会删掉较新块的条目，而那个块的 KV 完全正确：输出不会错，但白白丢了一次命中。

# %%
class OverEagerPrefixCache(PrefixCache):
    """Deletes by hash alone: may drop the entry of another block with the same contents."""
    # zh: 只按哈希删除：可能删掉另一个内容相同的块的条目。

    def forget(self, block) -> None:
        self.hash_to_block_id.pop(block.hash, None)


class OverEagerBlockManager(BlockManager):
    prefix_cache_class = OverEagerPrefixCache


def duplicate_recipe(manager_class: type[BlockManager]) -> list[int]:
    bm = manager_class(num_blocks=4, block_size=2)
    kv = ProvenanceKV(block_size=2)
    a, b = Sequence([1, 2, 3, 4], block_size=2), Sequence([1, 2, 3, 4], block_size=2)
    run_prompt(bm, kv, a)
    # en: Hits block 0 only (rule 3); its block for "3 4" duplicates A's block 1.
    # zh: 只命中块 0（规则 3）；它存放 "3 4" 的块与 A 的块 1 重复。
    run_prompt(bm, kv, b)
    finish(bm, a, b)
    # en: Reuses blocks 3 and 1.
    # zh: 复用块 3 和块 1。
    run_prompt(bm, kv, other := Sequence([8, 8, 8, 8], block_size=2))
    finish(bm, other)
    hits = run_prompt(bm, kv, c := Sequence([1, 2, 3, 4, 5], block_size=2))
    assert not kv.wrong_reads(c)
    return hits


print(format(say("delete by hash alone:"), "<21"), duplicate_recipe(OverEagerBlockManager))
print(format(say("ours:"), "<21"), duplicate_recipe(BlockManager))
assert duplicate_recipe(OverEagerBlockManager) == [0] and duplicate_recipe(BlockManager) == [0, 2]

# %% [markdown] tags=["en"]
# Chapter 04's test suite runs this kind of provenance check on ten thousand random workloads
# through the real scheduler, and proves it would catch the broken variant.
#
# ## An experiment: how often does a system prompt hit?
#
# Twelve chat requests share a 16-token system prompt and each adds a 6-token question; between
# two chats, an unrelated 24-token document request comes in. Requests run one after the other
# and generate 6 tokens each. We count the fraction of chat prompt tokens found in the cache,
# for several pool sizes, three ways: prefix caching off; on, but freeing blocks *forwards*; and
# on, freeing backwards as our `deallocate` does.

# %% [markdown] tags=["zh"]
# 第 04 章的测试套件会通过真正的调度器，在一万个随机工作负载上做这种溯源检查，并证明它能抓住这个有缺陷的变体。
#
# ## 实验：系统提示词的命中率有多高？
#
# 十二个聊天请求共享一个 16 个 token 的系统提示词，各自再加一个 6 个 token 的问题；两次聊天之间插入一个无关的、
# 24 个 token 的文档请求。请求依次执行，每个生成 6 个 token。我们统计聊天提示词 token 中在缓存里找到的比例，对几种池子
# 大小各比较三种做法：关闭前缀缓存；开启但*正序*释放块；开启并像我们的 `deallocate` 那样倒序释放。

# %%
import random


class ForwardFreeBlockManager(BlockManager):
    """Frees a table first block first: a system prompt's blocks are overwritten soonest."""
    # zh: 按从第一块到最后一块的顺序释放块表：系统提示词的块最先被覆盖。

    def deallocate(self, seq: Sequence) -> None:
        for block_id in seq.block_table:
            self.release(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0


def serve_one_by_one(bm: BlockManager, prompts: list[list[int]], new_tokens: int) -> list[int]:
    """Run each prompt alone: prefill, decode, free. Return the cached tokens each one found."""
    # zh: 让每个提示词单独运行：prefill、decode、释放。返回每个提示词找到的缓存 token 数。
    found = []
    for prompt in prompts:
        seq = Sequence(prompt, block_size=bm.block_size)
        bm.allocate(seq)
        found.append(seq.num_cached_tokens)
        seq.num_cached_tokens = len(seq)
        bm.publish_full_blocks(seq)
        seq.append_token(0)
        for _ in range(new_tokens - 1):
            bm.may_append(seq)
            seq.num_cached_tokens += 1
            bm.publish_full_blocks(seq)
            seq.append_token(0)
        bm.deallocate(seq)
    return found


rng = random.Random(0)
system_prompt = list(range(1000, 1016))
workload = []
for _ in range(12):
    workload.append(("chat", system_prompt + [rng.randrange(100) for _ in range(6)]))
    workload.append(("document", [rng.randrange(100, 900) for _ in range(24)]))
is_chat = [kind == "chat" for kind, _ in workload]
chat_tokens = sum(len(p) for kind, p in workload if kind == "chat")

print(f"{say('pool (blocks of 4)'):>18} {say('caching off'):>12} {say('forward free'):>13} {say('backward free'):>14}")
table = {}
for pool in (8, 10, 12, 14, 16, 24):
    rates = []
    for make in (
        lambda n: BlockManager(n, 4, enable_prefix_caching=False),
        lambda n: ForwardFreeBlockManager(n, 4),
        lambda n: BlockManager(n, 4),
    ):
        found = serve_one_by_one(make(pool), [p for _, p in workload], new_tokens=6)
        rates.append(sum(f for f, chat in zip(found, is_chat, strict=True) if chat) / chat_tokens)
    table[pool] = rates
    print(f"{pool:>18} {rates[0]:>12.0%} {rates[1]:>13.0%} {rates[2]:>14.0%}")

# %% [markdown] tags=["en"]
# With caching off nothing is ever found. The best possible rate is 11 of 12 chats finding all
# 16 system-prompt tokens of their 22: 67%. Freeing backwards reaches it with 12 blocks; freeing
# forwards needs 16, because the document request, which takes 8 blocks from the head of the
# free list, eats the system prompt first. In between, backward freeing keeps part of the
# prompt (its first blocks), which is all a chained prefix can use anyway.

# %% [markdown] tags=["zh"]
# 关闭缓存时什么也找不到。理论上限是 12 个聊天中有 11 个在 22 个提示词 token 里找到全部 16 个系统提示词 token：67%。
# 倒序释放在 12 个块时就达到上限；正序释放需要 16 个块，因为文档请求从空闲队列队头取 8 个块，最先吃掉的就是系统提示词。
# 介于两者之间时，倒序释放保住了提示词的一部分（它的前几块）——而链式前缀本来也只能用上前几块。

# %%
best = 11 * 16 / chat_tokens
assert all(rates[0] == 0 for rates in table.values())
assert all(rates[2] >= rates[1] for rates in table.values())
assert table[12][2] == best and table[12][1] == 0 and table[16][1] == best
assert 0 < table[10][2] < best
print(say("experiment claims hold"))

# %% [markdown] tags=["en"]
# ## What we built
#
# - `block_hash(token_ids, parent)`: the chained xxHash64 of a full block.
# - `PrefixCache`: `hash_to_block_id`; `match` (leading hits, token comparison, never the block
#   holding the prompt's last token), `publish` (after the KV is written) and `forget` (delete an
#   entry only if it is the block's own).
#
# The block manager of chapter 02 calls `match` in `allocate`, `forget` when it overwrites a
# block, and `publish` from `publish_full_blocks`, which the scheduler's postprocess calls.
#
# ## Exercises
#
# 1. Why a *chained* hash? Give two prompts whose second blocks have equal tokens but must not
#    share KV, and check that their second-block hashes differ.
# 2. Add one condition to `match` that would *also* have stopped the false hit of the
#    stale-entry recipe, even with the forgetful cache. (It is a good second line of defence.)
# 3. `block_size=4`, and a 12-token prompt whose every block is already cached. How many tokens
#    does its prefill compute?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `block_hash(token_ids, parent)`：一个写满的块的链式 xxHash64。
# - `PrefixCache`：`hash_to_block_id`；`match`（开头连续的命中、比较 token、永远不命中包含提示词最后一个 token 的块）、
#   `publish`（KV 写入之后）和 `forget`（只删除属于这个块自己的条目）。
#
# 第 02 章的块管理器在 `allocate` 中调用 `match`，在覆盖一个块之前调用 `forget`，在 `publish_full_blocks`
# （由调度器的后处理调用）中调用 `publish`。
#
# ## 练习
#
# 1. 为什么要用*链式*哈希？举出两个提示词，它们第二块的 token 相同却不能共享 KV，并验证它们第二块的哈希值不同。
# 2. 给 `match` 加一个条件，使得即使用的是“健忘”的缓存，也能挡住上面过期条目场景中的那次错误命中。
#    （这是很好的第二道防线。）
# 3. `block_size=4`，一个 12 个 token 的提示词，它的每一块都已在缓存中。它的 prefill 要计算多少个 token？

# %%
# en: Exercise 1: [1 2 | 3 4] and [5 6 | 3 4]: the same second block, different prefixes.
# zh: 练习 1：[1 2 | 3 4] 和 [5 6 | 3 4]：第二块相同，前缀不同。
assert block_hash([3, 4], block_hash([1, 2])) != block_hash([3, 4], block_hash([5, 6]))


# en: Exercise 2: a hit must also carry the hash we looked up (a stale entry points at a block
# en: whose hash has changed).
# zh: 练习 2：命中的块还必须带着我们查找的那个哈希值（过期条目指向的块，哈希值已经变了）。
class DoubleCheckingPrefixCache(ForgetfulPrefixCache):
    def match(self, seq: Sequence) -> list[int]:
        hits, parent = [], NO_HASH
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = seq.block(i)
            h = block_hash(token_ids, parent)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].hash != h or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
            parent = h
        return hits


class DoubleCheckingBlockManager(BlockManager):
    prefix_cache_class = DoubleCheckingPrefixCache


assert stale_recipe(DoubleCheckingBlockManager) == ([0], [])

# en: Exercise 3: the last block holds the last prompt token, so it is computed: 4 tokens.
# zh: 练习 3：最后一块包含提示词的最后一个 token，所以要计算：4 个 token。
bm = BlockManager(num_blocks=8, block_size=4)
kv = ProvenanceKV(block_size=4)
run_prompt(bm, kv, Sequence(list(range(12)), block_size=4))
again = Sequence(list(range(12)), block_size=4)
bm.allocate(again)
assert len(again) - again.num_cached_tokens == 4
print(say("all exercise answers check out"))
