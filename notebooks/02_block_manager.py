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
# # 02 · Paged KV memory
#
# **Goal.** By the end of this chapter you can say, for any sequence at any step, which cache
# blocks hold its keys and values, how many block tables hold each block, and which blocks are
# free. You will build the `BlockManager`: a fixed pool of KV **blocks**, a **free list**, a
# **used set**, a **reference count** per block, and the operations the scheduler (chapter 04)
# calls: allocate a prompt's blocks, add a block during decode when the last one is full, and
# give everything back when a sequence finishes or is preempted.
#
# The block manager does bookkeeping only. The KV tensors themselves live in the model runner
# (chapter 09); a block id is just an index into them.

# %% [markdown] tags=["zh"]
# # 02 · 分页 KV 显存
#
# **目标：** 读完本章，对任意一个序列、任意一步，你都能说出它的键和值存放在哪些缓存块中、每个块被多少个块表持有、
# 哪些块是空闲的。本章构建 `BlockManager`（块管理器）：一个固定大小的 KV **块**池、一个**空闲队列**（free list）、一个
# **已用集合**、每块一个**引用计数**，以及调度器（第 04 章）要调用的操作：为提示词分配块、decode 时在最后一块
# 写满后再添一块、序列结束或被抢占时归还全部块。
#
# 块管理器只做记账。KV 张量本身在模型执行器里（第 09 章）；块编号只是指向这些张量的下标。

# %% [markdown] tags=["en"]
# ## First: why may we cache K and V at all?
#
# Attention needs the K and V vectors of every earlier token, so the engine keeps them in a
# **KV cache** instead of recomputing them at every step. That this is *exact*, not an
# approximation, follows from the **causal mask**. In an attention layer, token `i`'s key and
# value are projections of token `i`'s own input, and with a causal mask token `i` attends to
# tokens `0 … i` only. Appending tokens therefore changes nothing at positions `0 … i`: not
# their outputs, hence not the next layer's inputs there, hence not the keys and values of any
# layer. Compute them once, keep them, and a decode step only has to compute the new token.
#
# With **bidirectional** attention (BERT-style encoders), every position attends to every
# other. A new token enters the softmax of every earlier position, their outputs change, and
# from the second layer on so do their keys and values: a cache would serve stale ones.
#
# The cell checks both halves on two random attention layers with residual connections:
# 7 tokens, then the same 7 with an 8th appended, under each mask; and, with the causal mask,
# the 8th token computed from the 7 tokens' cached K and V against its full recomputation.

# %% [markdown] tags=["zh"]
# ## 先问一句：K 和 V 凭什么可以缓存？
#
# 注意力需要此前每个 token 的 K 和 V 向量，所以引擎把它们保存在 **KV 缓存**里，而不是每一步都重新计算。
# 这样做并非近似，而是*精确*的，这要归功于**因果掩码**。在注意力层里，第 `i` 个 token 的键和值只是它自己的输入
# 经过投影得到的；有了因果掩码，第 `i` 个 token 只关注第 `0 … i` 个 token。因此在后面追加 token，不会改变
# 位置 `0 … i` 上的任何东西：它们的输出不变，下一层在这些位置的输入也就不变，于是每一层的键和值都不变。
# 算一次、存起来，decode 步就只需计算新 token。
#
# 换成**双向**注意力（BERT 一类的编码器），每个位置都关注所有位置。新 token 会进入此前每个位置的 softmax，
# 它们的输出随之改变，从第二层起它们的键和值也跟着变：这时缓存给出的就是过时的 K、V。
#
# 下面的单元在两个带残差连接的随机注意力层上验证这两点：先算 7 个 token，再算追加了第 8 个 token 的同一序列，
# 两种掩码各做一遍；并且在因果掩码下，用前 7 个 token 缓存的 K、V 算出第 8 个 token，与完整重算的结果比较。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "layer 0 K,V kept": "第 0 层 K,V 不变",
    "layer 1 K,V kept": "第 1 层 K,V 不变",
    "outputs 0-6 kept": "输出 0-6 不变",
    "causal mask": "因果掩码",
    "bidirectional": "双向注意力",
    "causal: token 8 from the cached K,V equals its full recomputation: {exact}":
        "因果掩码：用缓存的 K、V 算出的第 8 个 token 等于完整重算的结果：{exact}",
    "contiguous, 20 slots reserved per request:": "连续分配，每个请求预留 20 个槽位：",
    "paged, blocks of 4 slots:": "分页，每块 4 个槽位：",
    "-> {n} requests fit": "-> 放得下 {n} 个请求",
    "keys each of 4 tokens may attend to: causal mask {causal}; keys before it only {before}; the first token's "
    "weights then: {weights}":
        "4 个 token 各自可以关注的键：因果掩码 {causal}；只看它之前的键 {before}；此时第一个 token 的权重：{weights}",
    "free {name}": "释放 {name}",
    "free={free}": "空闲队列={free}",
    "free list: {free}": "空闲队列：{free}",
    "block table: after the prompt {prompt}, after 'fathers' {fathers}, once 'brought' has a place {brought}":
        "块表：提示词之后 {prompt}，'fathers' 之后 {fathers}，'brought' 有了位置之后 {brought}",
    "ref counts: {counts}": "引用计数：{counts}",
    "the second sequence found {found} of its {prompt} prompt tokens in the cache":
        "第二个序列的 {prompt} 个提示词 token 中，有 {found} 个命中缓存",
    "blocks {ids}: ref count 2 at step {hit}, 1 after A finished at step {done}":
        "块 {ids}：第 {hit} 步时引用计数为 2，A 在第 {done} 步完成后为 1",
    "trace and invariants hold": "轨迹与不变量均成立",
    "contiguous": "连续分配",
    "paged": "分页",
    "paged + F": "分页 + F",
    "served": "接纳",
    "refused": "拒绝",
    "F needs 12 adjacent slots: {free} free, in holes of {holes}: {verdict}":
        "F 需要 12 个相邻槽位：空闲 {free} 个，分散在大小为 {holes} 的空洞里：{verdict}",
    "F takes blocks {table}: {verdict}": "F 拿到块 {table}：{verdict}",
    "block_size={size:>2}: at most {worst} empty slots per sequence (bound: {bound})":
        "block_size={size:>2}：每个序列最多 {worst} 个空槽位（上界：{bound}）",
    "block_size={size}: grew at {grew} of 40 steps, modulo rule agrees: {agrees}":
        "block_size={size}：40 步中有 {grew} 步加了块，与取模规则一致：{agrees}",
    "all exercise answers check out": "练习答案全部验证通过",
    # en: the paging figure
    # zh: 分页示意图
    "Logical KV blocks": "逻辑 KV 块",
    "Block table": "块表",
    "Physical KV blocks": "物理 KV 块",
    "Block {block}": "块 {block}",
    "logical": "逻辑",
    "physical": "物理",
    "# filled": "已填",
    "orange: {token}, whose KV the next step writes": "橙色：{token}，下一步写入它的 KV",
})

# %% why a KV cache is exact
import torch

torch.manual_seed(0)
dim = 16
# en: Two random attention layers, each with query, key and value projections (no training needed).
# zh: 两个随机的注意力层，各有查询、键、值三个投影（不需要训练）。
layers = [[torch.randn(dim, dim, dtype=torch.float64) / dim**0.5 for _ in range(3)] for _ in range(2)]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = q @ k.T / dim**0.5
    if causal:
        # en: The last query sits at the last key; query j may look at keys up to its own position.
        # zh: 最后一个查询对应最后一个键；查询 j 只能看到不超过它自己位置的键。
        later = torch.ones(len(q), len(k), dtype=torch.bool).triu(len(k) - len(q) + 1)
        scores = scores.masked_fill(later, float("-inf"))
    return scores.softmax(dim=-1) @ v


def forward(x: torch.Tensor, causal: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """All tokens at once: every layer's (keys, values), and the last layer's output."""
    # zh: 一次算完所有 token：每层的（键，值），以及最后一层的输出。
    kv = []
    for w_q, w_k, w_v in layers:
        k, v = x @ w_k, x @ w_v
        kv.append((k, v))
        # en: With the residual: the next layer's input.
        # zh: 加上残差：这就是下一层的输入。
        x = x + attend(x @ w_q, k, v, causal)
    return kv, x


def decode(x_new: torch.Tensor, cached: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One new token through the layers, reading the earlier tokens' K and V from the cache."""
    # zh: 让一个新 token 走过各层，从缓存里读取之前那些 token 的 K 和 V。
    for (w_q, w_k, w_v), (k_old, v_old) in zip(layers, cached, strict=True):
        k, v = torch.cat([k_old, x_new @ w_k]), torch.cat([v_old, x_new @ w_v])
        x_new = x_new + attend(x_new @ w_q, k, v, causal=True)
    return x_new


# en: The embeddings of 8 tokens.
# zh: 8 个 token 的嵌入向量。
tokens = torch.randn(8, dim, dtype=torch.float64)
kept = {}
for mask, causal in (("causal mask", True), ("bidirectional", False)):
    kv7, out7 = forward(tokens[:7], causal)
    kv8, out8 = forward(tokens, causal)
    kept[mask] = [all(torch.allclose(new[:7], old) for new, old in zip(kv8[i], kv7[i], strict=True))
                  for i in range(2)] + [torch.allclose(out8[:7], out7)]
    if causal:
        decode_exact = torch.allclose(decode(tokens[7:], kv7), out8[7:])
print(f"{'':<16}{say('layer 0 K,V kept'):>18}{say('layer 1 K,V kept'):>18}{say('outputs 0-6 kept'):>18}")
for mask, row in kept.items():
    print(f"{say(mask):<16}" + "".join(f"{value!s:>18}" for value in row))
print(say("causal: token 8 from the cached K,V equals its full recomputation: {exact}", exact=decode_exact))
assert kept["causal mask"] == [True, True, True] and decode_exact
assert kept["bidirectional"] == [True, False, False]

# %% [markdown] tags=["en"]
# Under the causal mask nothing earlier moves, and decoding from the cache is exact. Under the
# bidirectional mask, layer 0's keys and values survive (they are projections of the
# embeddings), but the outputs move and so do layer 1's keys and values. Every model this book
# runs is a causal decoder, which is why the rest of the book may keep K and V for good.

# %% [markdown] tags=["zh"]
# 因果掩码下，前面的一切都不动，从缓存 decode 是精确的。双向掩码下，第 0 层的键和值保持不变（它们只是嵌入的投影），
# 但输出变了，第 1 层的键和值也跟着变了。本书运行的模型都是因果解码器，所以后面各章可以放心地把 K 和 V 一直存着。

# %% [markdown] tags=["en"]
# The second article derives the cache from the causal mask too, and overstates two things on the
# way: it says that under bidirectional attention the cache 彻底失效 (becomes wholly invalid), and
# it gives the range [1, i−1]. What is true, and checked: under bidirectional attention, appending
# a token leaves layer 0's keys and values where they were (the table above); it is every layer
# after the first whose cached keys and values go stale. That still rules a cache out for a real
# model, whose dozens of layers all but one go stale, but not "wholly". And under the causal mask
# token `i` attends to itself as well as to the tokens before it: `0 … i` here, [1, i] counting from
# 1 as the article does. Keys before `i` only, [1, i−1], would leave the first token nothing to
# attend to: its softmax has no term and comes out NaN.

# %% [markdown] tags=["zh"]
# 第二篇文章同样从因果掩码推出 KV 缓存成立，但途中有两处说得过头：它说双向注意力下缓存“彻底失效”，还给出了区间
# [1, i−1]。实际情况如下（都经过验证）：双向注意力下，追加一个 token 后，第 0 层的键和值保持原样（见上表），
# 过时的是第一层之后每一层缓存的键和值。对真实模型来说这依然意味着不能用缓存（几十层里只有一层没有过时），但谈不上
# “彻底”。而因果掩码下，第 `i` 个 token 除了关注它之前的 token，也关注它自己：这里是 `0 … i`，按文章从 1 数起则是
# [1, i]。如果只看 `i` 之前的键，即 [1, i−1]，第一个 token 就没有任何可以关注的对象：它的 softmax 一项也没有，
# 算出来是 NaN。

# %%
# en: True where a query may not look: keys after it (the causal mask), or keys after it and its own.
# zh: 为 True 的位置表示查询不能看：它之后的键（因果掩码），或者它之后的键再加上它自己。
causal_hidden = torch.ones(4, 4, dtype=torch.bool).triu(1)
before_only_hidden = torch.ones(4, 4, dtype=torch.bool).triu(0)
seen = {name: [int((~row).sum()) for row in hidden] for name, hidden in
        (("causal", causal_hidden), ("before", before_only_hidden))}
scores = tokens[:4] @ tokens[:4].T
before_only_weights = scores.masked_fill(before_only_hidden, float("-inf")).softmax(dim=-1)
print(say("keys each of 4 tokens may attend to: causal mask {causal}; keys before it only {before}; the first token's "
          "weights then: {weights}", causal=seen["causal"], before=seen["before"],
          weights=before_only_weights[0].tolist()))
assert seen == {"causal": [1, 2, 3, 4], "before": [0, 1, 2, 3]}
assert before_only_weights[0].isnan().all() and not before_only_weights[1:].isnan().any()

# %% [markdown] tags=["en"]
# ## The idea: why pages?
#
# The KV cache lives on the GPU, and each sequence's part of it grows by one token per decode
# step. How should that memory be handed out to requests?
#
# The naive answer gives each request one contiguous region big enough for its longest possible
# length (prompt + `max_tokens`). Nobody knows in advance when a request will stop, so most of
# that region stays empty: memory is *reserved* but not *used*, and fewer requests fit at once.
# Operating systems met the same problem with RAM and answered it with **paging**: cut memory
# into fixed-size pages, give a process pages as it needs them, and keep a page table that maps
# its logical pages to physical ones, wherever they are.
#
# vLLM's *PagedAttention* does the same with the KV cache. A **block** holds the KV of
# `block_size` consecutive tokens. A sequence's **block table** lists its blocks in order, so
# token `i` lives in block `block_table[i // block_size]` at offset `i % block_size`. A sequence
# grabs a new block only when its last one is full, so at most `block_size - 1` slots per
# sequence are wasted, whatever `max_tokens` says. And because a block table is only a list of
# ids, two sequences can point at the *same* block: identical prompt prefixes can share their KV
# (chapter 03). A block's **reference count** says how many block tables hold it; a block
# returns to the free list when its count drops to zero.
#
# Paging also ends **external fragmentation**. Contiguous regions that come and go leave holes
# between them, and a request may find enough free memory in total but no single hole large
# enough for it; to a block table, any free block will do. What is left is **internal
# fragmentation**, the unused tail of each sequence's last block. "Check it" below shows both.
#
# The drawing below is computed, not typed: three requests in a cache of 48 token slots.

# %% [markdown] tags=["zh"]
# ## 思路：为什么要分页？
#
# KV 缓存放在 GPU 上，每个序列占用的那部分每经过一个 decode 步就多一个 token。这块显存该怎样分给各个请求？
#
# 最朴素的做法是给每个请求一段连续空间，大小足够容纳它可能达到的最大长度（提示词 + `max_tokens`）。可是谁也无法
# 预知请求何时结束，这段空间大多空着：显存被*预留*了却没有被*使用*，能同时容纳的请求也就少了。操作系统管理内存时
# 遇到过同样的问题，答案是**分页**：把内存切成固定大小的页，进程需要时再给它分页，并用页表把逻辑页映射到物理页，
# 物理页在哪里都行。
#
# vLLM 的 *PagedAttention* 对 KV 缓存做了同样的事。一个**块**存放 `block_size` 个连续 token 的 KV。序列的
# **块表**按顺序列出它的块，于是第 `i` 个 token 位于块 `block_table[i // block_size]` 的第 `i % block_size`
# 个槽位。序列只在最后一块写满时才申请新块，所以不管 `max_tokens` 多大，每个序列最多浪费 `block_size - 1` 个槽位。
# 又因为块表只是一串编号，两个序列可以指向*同一个*块：相同的提示词前缀可以共享 KV（第 03 章）。块的**引用计数**
# 表示有多少个块表持有它；计数降到零时，块回到空闲队列。
#
# 分页还消除了**外部碎片**。连续区域反复分配又释放，彼此之间会留下空洞：一个请求可能发现空闲显存的总量足够，却没有
# 哪一个空洞单独放得下它；而对块表来说，任何一个空闲块都行。剩下的只有**内部碎片**，即每个序列最后一块没用上的
# 尾部。后面的“验证”一节会把两者都展示出来。
#
# 下图是算出来的，不是手画的：一个有 48 个 token 槽位的缓存，三个请求。

# %% paging picture
#| hide
def contiguous_picture(requests: dict[str, tuple[int, int]], num_slots: int) -> tuple[str, int]:
    """Each request reserves prompt + max_tokens slots up front; '.' is reserved but empty."""
    # zh: 每个请求事先预留“提示词 + max_tokens”个槽位；'.' 表示已预留但还空着。
    row, admitted = "", 0
    for name, (used, reserved) in requests.items():
        if len(row) + reserved > num_slots:
            break
        row += name * used + "." * (reserved - used) + "|"
        admitted += 1
    return row + " " * (num_slots + admitted - len(row)), admitted


def paged_picture(requests: dict[str, tuple[int, int]], num_slots: int, block_size: int) -> tuple[str, int]:
    """Each request takes ceil(used / block_size) blocks; only its last block may be partly empty."""
    # zh: 每个请求占用 ceil(used / block_size) 个块；只有它的最后一块可能没写满。
    cells, admitted = [], 0
    for name, (used, _reserved) in requests.items():
        blocks = -(-used // block_size)
        if (len(cells) + blocks) * block_size > num_slots:
            break
        for b in range(blocks):
            filled = min(block_size, used - b * block_size)
            cells.append("[" + name * filled + "." * (block_size - filled) + "]")
        admitted += 1
    return "".join(cells), admitted


# en: name: (tokens so far, prompt + max_tokens)
# zh: 名字：（目前的 token 数，提示词 + max_tokens）
paging_requests = {"A": (7, 20), "B": (5, 20), "C": (9, 20)}
contiguous_row, contiguous_admitted = contiguous_picture(paging_requests, 48)
paged_row, paged_admitted = paged_picture(paging_requests, 48, block_size=4)
for label, row, admitted in ((say("contiguous, 20 slots reserved per request:"), contiguous_row, contiguous_admitted),
                             (say("paged, blocks of 4 slots:"), paged_row, paged_admitted)):
    print(f"{label:<42} {row}  {say('-> {n} requests fit', n=admitted)}")
assert (contiguous_admitted, paged_admitted) == (2, 3)

# %% [markdown] tags=["en"]
# ## Build it: a block
#
# A `Block` is two fields: its id, the index of its slots in the model runner's KV tensor, and
# `ref_count`, the number of block tables that hold it. Upstream's `Block` also carries a `hash`
# and the block's `token_ids`; they belong to prefix caching, and chapter 03 adds them.

# %% [markdown] tags=["zh"]
# ## 动手：块
#
# `Block` 只有两个字段：它的编号，即它的槽位在模型执行器的 KV 张量中的下标；以及 `ref_count`，持有它的块表个数。
# 上游的 `Block` 还带着 `hash` 和块中的 `token_ids`；它们属于前缀缓存，由第 03 章加上。

# %% default module
#| default_exp engine.block_manager

# %% block
#| export
from __future__ import annotations

from collections import deque

from nanovllm.engine.sequence import Sequence


class Block:
    """Bookkeeping for one block of the paged KV cache (the KV tensors live in the model runner)."""
    # zh: 分页 KV 缓存中一个块的账目（KV 张量本身放在模型执行器里）。

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count})"

# %% [markdown] tags=["en"]
# ## Build it: the pool
#
# `BlockPool` knows blocks, not sequences. It starts with every block in the **free list**, a
# `deque` of block ids, and an empty **used set**. Each block is always in exactly one of the
# two: used blocks have `ref_count >= 1`, free blocks `ref_count == 0`. Two operations change
# that: `take_free_block` (head of the free list → used, count 1) and `release` (one reference
# less; at 0 the block joins the tail of the free list).
#
# Why a queue and not a set for the free blocks? Its *order* is a policy. A freed block keeps
# its KV, so prefix caching (chapter 03) can still revive it; the queue decides which of those
# cached contents are overwritten first.
#
# The pool also remembers `enable_prefix_caching`, for the cache that chapter 03 gives it; every
# pool of this chapter has it off.
#
# The pool trusts its arguments: the engine builds it from a `Config` that has checked them
# (chapter 09), so inside the engine a broken invariant is a plain `assert`, as upstream writes
# it, and what a user types is checked once, where it enters.

# %% [markdown] tags=["zh"]
# ## 动手：块池
#
# `BlockPool`（块池）只认识块，不认识序列。一开始所有块都在**空闲队列**（一个存放块编号的 `deque`）里，**已用集合**
# 为空。每个块总是恰好属于两者之一：已用块的 `ref_count >= 1`，空闲块的 `ref_count == 0`。改变这一状态的操作只有
# 两个：`take_free_block`（空闲队列队头的块 → 已用，计数为 1）和 `release`（去掉一个引用；降到 0 时排到空闲队列队尾）。
#
# 空闲块为什么用队列而不是集合？因为它的*顺序*本身就是一种策略。释放的块保留着 KV，前缀缓存（第 03 章）仍能让它
# 复活；这个队列决定了哪些缓存内容先被覆盖。
#
# 块池还记着 `enable_prefix_caching`，供第 03 章加入的缓存使用；本章的块池一律把它关掉。
#
# 块池不检查传入的参数：引擎构建它时用的 `Config`（第 09 章）已经检查过了。所以在引擎内部，不变量只用普通的
# `assert` 检查（上游也是这么写的）；用户输入只在进入引擎的地方检查一次。

# %% block pool
#| export
class BlockPool:
    """The blocks of the paged KV cache, a free list, a used set and reference counts.

    Invariant: every block is in exactly one of ``free_block_ids`` (``ref_count == 0``) and
    ``used_block_ids`` (``ref_count >= 1``).
    """
    # zh: 分页 KV 缓存的所有块，以及空闲队列、已用集合和引用计数。
    # zh:
    # zh: 不变量：每个块恰好属于 ``free_block_ids``（``ref_count == 0``）与
    # zh: ``used_block_ids``（``ref_count >= 1``）之一。

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # en: Whether blocks are kept for reuse by their contents (the prefix cache).
        # zh: 是否按内容保留块以便复用（即前缀缓存）。
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def take_free_block(self) -> int:
        """Take the block at the head of the free list, for new contents."""
        # zh: 取出空闲队列队头的块，用来装新内容。
        block = self.blocks[self.free_block_ids.popleft()]
        self._forget_old_contents(block)
        block.ref_count = 1
        self.used_block_ids.add(block.block_id)
        return block.block_id

    def _forget_old_contents(self, block: Block) -> None:
        """The block is about to get new contents. Here it remembers none (chapter 03's prefix cache does)."""
        # zh: 这个块即将装入新内容。这里它什么都不记（第 03 章的前缀缓存会记）。

    def release(self, block_id: int) -> None:
        """Drop a reference; at zero the block joins the tail of the free list."""
        # zh: 减少一个引用；减到 0 时，块排到空闲队列的队尾。
        block = self.blocks[block_id]
        assert block.ref_count >= 1, f"block {block_id} released more often than it was held"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)

# %% [markdown] tags=["en"]
# ## Build it: block tables
#
# `BlockManager` adds sequences to the pool. Five methods, called by the scheduler:
#
# - `can_allocate(seq)` / `allocate(seq)` give a sequence that has no blocks yet the
#   `ceil(len(seq) / block_size)` blocks its tokens need. (Chapter 03 lets the leading blocks be
#   **cache hits**, blocks that already hold the KV of exactly this prefix.)
# - `deallocate(seq)` releases the table **backwards**, so the blocks join the free list's tail
#   last block first, *first* block last. New blocks come from the head, so the first blocks of
#   a prompt, the ones most likely to be shared (a system prompt!), are overwritten last.
# - `can_append(seq)` / `may_append(seq)` run before each decode step. The step computes the
#   sequence's *last* token: the one the previous step sampled and postprocess appended. Its KV
#   goes to slot `len(seq) - 1`, so the table must cover `len(seq)` tokens: one more block is
#   needed exactly when `len(seq) > len(block_table) * block_size`. For a block size above 1
#   that is the famous `len(seq) % block_size == 1`, which looks like an off-by-one and is not:
#   the token that *just* overflowed the last block is the one whose KV this step writes.
#   (With `block_size == 1` the modulo test would never fire, although every step needs a
#   block; comparing lengths has no such corner.)
#
# That is upstream's `block_manager.py` without its hashing, which chapter 03 adds. Four hooks
# stay empty here, each filled by the chapter that needs it: `_forget_old_contents` (chapter 03's
# cache unpublishes a block before it is overwritten), and `_blocks_to_unshare`,
# `_unshare_write_block` and `forget_copies` (chapter 05's copy-on-write, once forked
# samples share blocks; the scheduler calls `forget_copies` after each step, chapter 04).

# %% [markdown] tags=["zh"]
# ## 动手：块表
#
# `BlockManager` 在块池之上为序列管理块表。它有五个方法，都由调度器调用：
#
# - `can_allocate(seq)` / `allocate(seq)` 给还没有块的序列分配 `ceil(len(seq) / block_size)` 个块，正好装下
#   它的 token。（第 03 章允许开头几块是**缓存命中**：这些块里存的恰好就是这段前缀的 KV。）
# - `deallocate(seq)` **倒着**释放块表，于是这些块按“最后一块最先、*第一*块最后”的顺序排到空闲队列队尾。新块从队头取，
#   所以提示词最前面的块——最可能被共享的那些（比如系统提示词！）——最后才被覆盖。
# - `can_append(seq)` / `may_append(seq)` 在每个 decode 步之前调用。这一步计算的是序列的*最后*一个 token：上一步采样、
#   由后处理追加上去的那个。它的 KV 写入槽位 `len(seq) - 1`，所以块表必须覆盖 `len(seq)` 个 token：恰好在
#   `len(seq) > len(block_table) * block_size` 时需要再加一块。块大小大于 1 时，这就是著名的
#   `len(seq) % block_size == 1`，看起来像差一错误，其实不是：*刚刚*溢出最后一块的那个 token，正是这一步要写入 KV 的
#   token。（`block_size == 1` 时，取模判断永远不成立，可实际上每一步都需要新块；比较长度就没有这个死角。）
#
# 这就是去掉哈希之后的上游 `block_manager.py`；哈希由第 03 章加上。这里有四个接缝暂时是空的，各由需要它的那一章
# 填上：`_forget_old_contents`（第 03 章的缓存在块被覆盖之前取消发布它），以及 `_blocks_to_unshare`、
# `_unshare_write_block` 和 `forget_copies`（第 05 章的写时复制：分叉出的样本会共享块；调度器在每一步之后调用
# `forget_copies`，见第 04 章）。

# %% block manager
#| export
class BlockManager(BlockPool):
    """Gives sequences their block tables: allocate, grow during decode, free."""
    # zh: 给序列分配块表：分配，decode 期间扩展，释放。

    def can_allocate(self, seq: Sequence) -> bool:
        """True when the free list can supply every block ``seq`` needs."""
        # zh: 空闲队列能提供 ``seq`` 所需的每一个块时为 True。
        return seq.num_blocks <= len(self.free_block_ids)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` the blocks for all its tokens."""
        # zh: 给 ``seq`` 分配装下它全部 token 的块。
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        assert self.can_allocate(seq), "ask can_allocate first"
        seq.block_table = [self.take_free_block() for _ in range(seq.num_blocks)]

    def deallocate(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks, last block first; its KV must be recomputed if it runs again."""
        # zh: 释放 ``seq`` 的所有块，从最后一块开始；如果它再次运行，它的 KV 必须重算。
        for block_id in reversed(seq.block_table):
            self.release(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0
        self.forget_copies(seq)

    def _blocks_to_append(self, seq: Sequence) -> int:
        assert seq.block_table, f"sequence {seq.seq_id} holds no blocks: allocate it before decoding"
        # en: In decode, the token appended last has no KV yet: a new block is needed exactly when it
        # en: starts one, which is upstream's `len(seq) % block_size == 1` when block_size > 1.
        # zh: decode 时，最后追加的那个 token 还没有 KV：它恰好是某块的第一个 token 时才需要新块；
        # zh: block_size > 1 时，这就是上游的 `len(seq) % block_size == 1`。
        return seq.num_blocks - len(seq.block_table) + self._blocks_to_unshare(seq)

    def _blocks_to_unshare(self, seq: Sequence) -> int:
        """Blocks that ``seq`` shares with another table and its step writes into, each to be copied first: none
        here, where every table is its own (chapter 05's forked samples share theirs)."""
        # zh: ``seq`` 与别的块表共享、而它这一步又要写入的块，每一个都得先复制：这里没有，
        # zh: 因为每个块表都只属于自己（第 05 章分叉出的样本会共享块）。
        return 0

    def can_append(self, seq: Sequence) -> bool:
        """True when the blocks for ``seq``'s next decode step are available."""
        # zh: ``seq`` 下一个 decode 步所需的块都有时为 True。
        return self._blocks_to_append(seq) <= len(self.free_block_ids)

    def may_append(self, seq: Sequence) -> None:
        """Make ``seq``'s block table cover all its tokens before a decode step (0 or 1 new block)."""
        # zh: 在 decode 步之前，让 ``seq`` 的块表覆盖它的所有 token（新增 0 个或 1 个块）。
        assert self.can_append(seq), "ask can_append first"
        self._unshare_write_block(seq)
        # en: What can_append counted, less the copy just made: the blocks its tokens still lack.
        # zh: 即 can_append 算过的块数减去刚做的复制：它的 token 还缺的块。
        seq.block_table += [self.take_free_block() for _ in range(seq.num_blocks - len(seq.block_table))]

    def _unshare_write_block(self, seq: Sequence) -> None:
        """Give ``seq`` its own copy of a shared block that its step writes into (see `_blocks_to_unshare`)."""
        # zh: ``seq`` 这一步要写入一个共享的块时，给它一份自己的副本（见 `_blocks_to_unshare`）。

    def forget_copies(self, seq: Sequence) -> None:
        """Drop the copies that `_unshare_write_block` planned for ``seq``: made by the step that ran, or moot once
        its blocks are gone. None was planned, here."""
        # zh: 丢掉 `_unshare_write_block` 为 ``seq`` 计划的复制：要么已由刚运行的那一步完成，要么它的块已经释放，
        # zh: 复制也就无从谈起。这里没有计划任何复制。

# %% [markdown] tags=["en"]
# ## See it: two sequences in a pool of eight blocks
#
# We play the scheduler and the model by hand, with two helpers that do what chapter 04's
# scheduler does around a step: `prefill` allocates and computes the whole prompt, `decode`
# makes room for the last token and computes it. Both then mark the computed tokens as cached,
# publish full blocks for chapter 03's prefix cache (nothing happens while it is off), and append
# the sampled token, exactly like `finish_step` in chapter 01.
# Prefix caching is off for now, so that only paging is at work. The map shows, for each
# block, which sequence holds it (`.` is free).

# %% [markdown] tags=["zh"]
# ## 看它运行：两个序列，一个八块的池子
#
# 我们手动扮演调度器和模型，用两个小工具完成第 04 章的调度器在一步前后所做的事：`prefill` 分配块并计算整个提示词，
# `decode` 为最后一个 token 腾出位置并计算它。二者随后都把算过的 token 记为已缓存、为第 03 章的前缀缓存发布写满的块
# （前缀缓存关闭时什么也不发生），并追加采样得到的 token，和第 01 章的 `finish_step` 完全一样。这里先关闭前缀缓存，
# 只看分页本身。块图标出每个块归哪个序列持有（`.` 表示空闲）。

# %%
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence


def prefill(bm: BlockManager, seq: Sequence, sampled: int) -> int:
    """Allocate and compute the whole prompt; return how many tokens were found in the cache."""
    # zh: 分配并计算整个提示词；返回在缓存中找到了多少个 token。
    bm.allocate(seq)
    found = seq.num_cached_tokens
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
    # en: The model wrote their KV.
    # zh: 模型写入了它们的 KV。
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.num_scheduled_tokens = 0
    bm.publish_full_blocks(seq)
    seq.append_token(sampled)
    return found


def decode(bm: BlockManager, seq: Sequence, sampled: int) -> None:
    bm.may_append(seq)
    seq.num_scheduled_tokens = 1
    seq.num_cached_tokens += 1
    seq.num_scheduled_tokens = 0
    bm.publish_full_blocks(seq)
    seq.append_token(sampled)


def pool_map(bm: BlockManager, named: dict[str, Sequence]) -> str:
    owners = [""] * bm.num_blocks
    for name, seq in named.items():
        for block_id in seq.block_table:
            owners[block_id] += name
    return " ".join(f"{i}:{o or '.'}" for i, o in enumerate(owners))


bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
# en: 10 tokens -> 3 blocks
# zh: 10 个 token -> 3 块
a = Sequence(list(range(100, 110)), block_size=4)
# en: 5 tokens -> 2 blocks
# zh: 5 个 token -> 2 块
b = Sequence(list(range(200, 205)), block_size=4)
named = {"A": a, "B": b}
rows = []


def record(event: str) -> None:
    rows.append((event, len(a), list(a.block_table), len(b), list(b.block_table), list(bm.free_block_ids)))
    print(f"{event:<22} len(A)={len(a):<3} len(B)={len(b):<3} {pool_map(bm, named)}   "
          f"{say('free={free}', free=list(bm.free_block_ids))}")


prefill(bm, a, sampled=1)
record("prefill A")
prefill(bm, b, sampled=2)
record("prefill B")
for token in (3, 4, 5):
    decode(bm, a, sampled=token)
    record(f"decode A (+{token})")
bm.deallocate(a)
record(say("free {name}", name="A"))

# %% [markdown] tags=["en"]
# Read the trace from the top. After its prefill, A has 11 tokens in 3 blocks (12 slots). The
# first decode step computes A's 11th token (slot 10) and appends the 12th; the second computes
# the 12th (slot 11, the last slot of block 2) and appends the 13th. Now `len(A) == 13` and
# `13 % 4 == 1`: the third decode step must write slot 12, so `may_append` takes block 5 from
# the head of the free list. Freeing A releases its table backwards, so the free list ends with
# `5, 2, 1, 0`: block 0, A's first block, would be overwritten last.

# %% [markdown] tags=["zh"]
# 从上往下读这段轨迹。prefill 之后，A 有 11 个 token，占 3 个块（12 个槽位）。第一个 decode 步计算 A 的第 11 个
# token（槽位 10）并追加第 12 个；第二步计算第 12 个（槽位 11，即块 2 的最后一个槽位）并追加第 13 个。此时
# `len(A) == 13`，`13 % 4 == 1`：第三个 decode 步要写槽位 12，于是 `may_append` 从空闲队列队头取走块 5。
# 释放 A 时倒着释放块表，所以空闲队列以 `5, 2, 1, 0` 结尾：A 的第一块（块 0）最后才会被覆盖。

# %% [markdown] tags=["en"]
# ### The vLLM paper's figure, on the real block manager
#
# The vLLM paper draws paging with one request, and the second article (a walk through
# nano-vllm's scheduler and block manager with the paper's figures) reuses the drawing: the
# prompt *"Four score and seven years ago our"*, 7 tokens, in blocks of 4. Its logical blocks 0
# and 1 live in physical blocks 7 and 1: the block table maps one to the other, and nothing asks
# the physical blocks to be adjacent or in order. Then:
#
# - the next token, *fathers*, goes into the last free slot of physical block 1: no new block;
# - the token after it, *brought*, finds logical block 1 full, so it needs a new block
#   (physical block 3 in the figure).
#
# Our block manager hands out blocks from the head of the free list, so to get blocks 7, 1 and
# 3 we set the free list up the way earlier requests could have left it: other requests hold all
# eight blocks, then give them back in the order 7, 1, 3, 0, 2, 4, 5, 6. A released block joins
# the tail of the free list, so that is the order in which they are handed out again. One word
# is one token here (a real tokenizer cuts the sentence differently). The drawing is computed
# from the block table after *brought* got its block.
#
# The block manager that the article quotes is upstream's from before chunked prefill, older than
# the one this book maps; appendix B's section "The code the second article quotes" lists the
# five places where it differs (its `can_allocate` among them) and what this book does instead.

# %% [markdown] tags=["zh"]
# ### vLLM 论文里的那张图，用真正的块管理器重现
#
# vLLM 论文用一个请求来画分页，第二篇文章（借用论文插图讲解 nano-vllm 的调度器和块管理器）也沿用了这张图：提示词
# *"Four score and seven years ago our"*，7 个 token，每块 4 个 token。它的逻辑块 0 和 1 放在物理块 7 和 1 里：
# 块表把前者映射到后者，物理块既不必相邻，也不必按顺序。接下来：
#
# - 下一个 token *fathers* 写进物理块 1 最后一个空槽位：不需要新块；
# - 再下一个 token *brought* 发现逻辑块 1 已经写满，所以需要一个新块（图中是物理块 3）。
#
# 我们的块管理器从空闲队列队头分配块，所以为了拿到块 7、1、3，我们把空闲队列布置成先前的请求可能留下的样子：
# 别的请求占着全部八个块，然后按 7、1、3、0、2、4、5、6 的顺序归还。释放的块排到空闲队列队尾，所以这也就是它们
# 再被分配出去的顺序。这里一个词就是一个 token（真正的分词器切分这句话的方式不同）。下图根据 *brought* 拿到
# 新块之后的块表算出。
#
# 文章引用的块管理器是分块 prefill 之前的上游代码，比本书对照的版本更早；附录 B 的“第二篇文章引用的代码”一节列出了
# 两者不同的五处（其中包括 `can_allocate`），以及本书的做法。

# %% the vLLM paper's figure
words = "Four score and seven years ago our fathers brought".split()
# en: One word, one token id.
# zh: 一个词对应一个 token id。
vocab = {word: i for i, word in enumerate(words)}
paper = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
# en: Other requests hold every block ...
# zh: 其他请求占着所有的块……
held_by_others = [paper.take_free_block() for _ in range(8)]
# en: ... and give them back in this order.
# zh: ……再按这个顺序归还。
for block_id in (7, 1, 3, 0, 2, 4, 5, 6):
    paper.release(block_id)
print(say("free list: {free}", free=list(paper.free_block_ids)))

request = Sequence([vocab[word] for word in words[:7]], block_size=4)
# en: The prompt's KV; the prefill samples "fathers".
# zh: 提示词的 KV；prefill 采样出 "fathers"。
prefill(paper, request, sampled=vocab["fathers"])
table_after_prompt = list(request.block_table)
fathers_position = len(request) - 1
# en: The step that writes the KV of "fathers".
# zh: 写入 "fathers" 的 KV 的那一步。
decode(paper, request, sampled=vocab["brought"])
table_after_fathers = list(request.block_table)
fathers_slot = request.block_table[fathers_position // 4] * 4 + fathers_position % 4
# en: The next step must write the KV of "brought": it needs a block.
# zh: 下一步要写入 "brought" 的 KV：它需要一个块。
paper.may_append(request)
print(say("block table: after the prompt {prompt}, after 'fathers' {fathers}, once 'brought' has a place {brought}",
          prompt=table_after_prompt, fathers=table_after_fathers, brought=request.block_table))

# %%
# en: The figure's three facts: logical blocks 0 and 1 in physical blocks 7 and 1; "fathers" fills the
# en: last slot of block 1; "brought" needs a new block.
# zh: 图中的三个事实：逻辑块 0 和 1 在物理块 7 和 1 里；"fathers" 填满块 1 的最后一个槽位；"brought" 需要新块。
assert table_after_prompt == [7, 1]
assert table_after_fathers == [7, 1] and fathers_slot == 1 * 4 + 3
assert request.block_table == [7, 1, 3] and paper.free_block_ids[0] == 0

# %% paging figure
#| hide
from html import escape

from IPython.display import SVG, display


def paging_figure_svg(seq: Sequence, bm: BlockManager, names: list[str]) -> str:
    """Logical blocks, the block table and the physical blocks of one sequence, computed from its block table."""
    # zh: 一个序列的逻辑块、块表和物理块，由它的块表算出。
    size, cell, row = bm.block_size, 62, 34
    logical_x, table_x, physical_x, top = 70, 360, 660, 56
    # en: Where each token lives: logical block, physical block, offset.
    # zh: 每个 token 所在的位置：逻辑块、物理块、块内偏移。
    placed = [(i // size, seq.block_table[i // size], i % size, names[token]) for i, token in enumerate(seq.token_ids)]
    # en: Its KV is written by the next step.
    # zh: 它的 KV 由下一步写入。
    newest = names[seq.token_ids[-1]]
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="920" height="340" viewBox="0 0 920 340" '
        'font-family="sans-serif" font-size="12">',
        '<title lang="en">The vLLM paper\'s paging figure, from our block manager: the prompt "Four score and seven '
        'years ago our" and the next tokens "fathers" and "brought", in blocks of 4 tokens. Logical block 0 is '
        'physical block 7, logical block 1 is physical block 1, whose last slot "fathers" fills, and logical '
        'block 2, started by "brought", is the new physical block 3.</title>'
        '<title lang="zh">vLLM 论文中的分页示意图，由我们的块管理器算出：提示词 "Four score and seven years ago our" '
        '及其后的 token "fathers" 和 "brought"，每块 4 个 token。逻辑块 0 是物理块 7；逻辑块 1 是物理块 1，'
        '"fathers" 填满了它的最后一个槽位；由 "brought" 开始的逻辑块 2 是新分配的物理块 3。</title>',
        '<defs><marker id="paging-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#78909c"/></marker></defs>',
        f'<text x="{logical_x}" y="30" font-weight="bold">{say("Logical KV blocks")}</text>',
        f'<text x="{table_x}" y="30" font-weight="bold">{say("Block table")}</text>',
        f'<text x="{physical_x}" y="30" font-weight="bold">{say("Physical KV blocks")}</text>',
    ]

    def block_row(x: float, y: float, label: str, tokens: dict[int, str]) -> None:
        parts.append(f'<text x="{x - 8}" y="{y + 21}" text-anchor="end">{label}</text>')
        for offset in range(size):
            word = tokens.get(offset)
            fill = "#ffe0b2" if word == newest else "#e3f2fd" if word else "#fafafa"
            parts.append(f'<rect x="{x + offset * cell}" y="{y}" width="{cell}" height="28" fill="{fill}" '
                         'stroke="#546e7a"/>')
            if word:
                parts.append(f'<text x="{x + offset * cell + cell / 2}" y="{y + 18}" text-anchor="middle">'
                             f"{escape(word)}</text>")

    for logical, physical in enumerate(seq.block_table):
        tokens = {offset: word for lb, _, offset, word in placed if lb == logical}
        y = top + logical * row
        block_row(logical_x, y, say("Block {block}", block=logical), tokens)
        parts.append(f'<text x="{table_x + 20}" y="{y + 18}" text-anchor="middle">{logical}</text>'
                     f'<text x="{table_x + 80}" y="{y + 18}" text-anchor="middle" font-weight="bold">{physical}</text>'
                     f'<text x="{table_x + 150}" y="{y + 18}" text-anchor="middle">{len(tokens)}</text>')
        parts.append(f'<path d="M{table_x + 180},{y + 14} L{physical_x - 60},{top + physical * row + 14}" '
                     'stroke="#78909c" stroke-width="1.2" fill="none" marker-end="url(#paging-arrow)"/>')
    for dx, heading in ((20, say("logical")), (80, say("physical")), (150, say("# filled"))):
        parts.append(f'<text x="{table_x + dx}" y="{top - 8}" text-anchor="middle" fill="#546e7a">{heading}</text>')
    for physical in range(bm.num_blocks):
        tokens = {offset: word for _, pb, offset, word in placed if pb == physical}
        block_row(physical_x, top + physical * row, say("Block {block}", block=physical), tokens)
    parts.append(f'<text x="{logical_x - 50}" y="{top + len(seq.block_table) * row + 24}" fill="#546e7a">'
                 f'{say("orange: {token}, whose KV the next step writes", token=escape(newest))}</text>')
    parts.append("</svg>")
    return "".join(parts)


display(SVG(paging_figure_svg(request, paper, words)))

# %% [markdown] tags=["en"]
# ### Sharing, in one picture
#
# With prefix caching on (the default), a block whose KV was written is published, and a later
# sequence whose prompt starts with the same tokens *holds* it instead of computing it again.
# Its reference count then says how many block tables point at it. Chapter 03 explains how
# blocks are found; here we only look at the bookkeeping.

# %% [markdown] tags=["zh"]
# ### 共享，一图看懂
#
# 开启前缀缓存（默认开启）时，KV 已写入的块会被发布；之后提示词以相同 token 开头的序列会*持有*这个块，而不是重新
# 计算。此时块的引用计数表示有多少个块表指向它。怎样找到这些块留到第 03 章再讲；这里只看记账。

# %%
shared = BlockManager(num_blocks=8, block_size=4)
# en: Two full blocks.
# zh: 两个写满的块。
system_prompt = list(range(300, 308))
first = Sequence([*system_prompt, 1, 2, 3], block_size=4)
second = Sequence([*system_prompt, 7, 8], block_size=4)
prefill(shared, first, sampled=9)
found = prefill(shared, second, sampled=9)
print(pool_map(shared, {"1": first, "2": second}))
print(say("ref counts: {counts}", counts={i: shared.blocks[i].ref_count for i in sorted(shared.used_block_ids)}))
print(say("the second sequence found {found} of its {prompt} prompt tokens in the cache",
          found=found, prompt=second.num_prompt_tokens))

# %% [markdown] tags=["en"]
# ### The same, animated
#
# The player below (built in appendix A) replays a recording of the real scheduler with a fake
# model: request A, then request B one step later with the same first 8 tokens. Press *step*
# and watch the two shared blocks: their reference count goes to **2** when B's prefill holds
# them, and back to **1** when A finishes and releases its table. Hover a block for its id,
# reference count, hash and owners.

# %% [markdown] tags=["zh"]
# ### 同样的过程，动画版
#
# 下面的播放器（在附录 A 中构建）回放真实调度器配合假模型录下的过程：先来请求 A，一步之后来请求 B，
# 它的前 8 个 token 与 A 相同。点击*单步*，留意两个共享块：B 的 prefill 持有它们时，引用计数变为 **2**；
# A 完成并释放块表后，又回到 **1**。把鼠标移到块上，可以看到块编号、引用计数、哈希和持有者。

# %% sharing animated
from IPython.display import display

from nanovllm.viz import FakeEngine, Player

engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
seq_a = engine.add([*system_prompt, 1, 2], max_tokens=3)
engine.step()
seq_b = engine.add([*system_prompt, 7, 8, 9], max_tokens=5)
engine.run()
sharing = engine.recording
display(Player(sharing))

frames = sharing["frames"]
hit = next(f for f in frames if f["phase"] == "schedule" and f["event"]["cache_hits"])
shared_ids = hit["event"]["cache_hits"][0]["blocks"]
a_done = next(f for f in frames if f["phase"] == "postprocess" and seq_a.seq_id in f["event"]["finished"])
assert len(shared_ids) == 2
assert [hit["blocks"][i]["ref_count"] for i in shared_ids] == [2, 2]
assert [a_done["blocks"][i]["ref_count"] for i in shared_ids] == [1, 1]
print(say("blocks {ids}: ref count 2 at step {hit}, 1 after A finished at step {done}",
          ids=shared_ids, hit=hit["step"], done=a_done["step"]))

# %% [markdown] tags=["en"]
# ## Check it
#
# First the claims of the trace. Then the invariants the whole engine relies on, checked by a
# small function we reuse below: free and used partition the pool, and every block's reference
# count equals the number of block tables that hold it.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 先检查轨迹中的结论。再检查整个引擎所依赖的不变量（用一个下面还会复用的小函数）：空闲队列和已用集合划分了整个池子，
# 每个块的引用计数等于持有它的块表个数。

# %%
from collections import Counter


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free list"
    assert set(free).isdisjoint(bm.used_block_ids), "a block is both free and used"
    assert set(free) | bm.used_block_ids == set(range(bm.num_blocks)), "a block is neither free nor used"
    holders = Counter(block_id for seq in seqs for block_id in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], f"{block}: held by {holders[block.block_id]} tables"
    for seq in seqs:
        assert len(seq.block_table) in (0, seq.num_blocks)


# en: The trace: A got block 5 exactly when len(A) reached 13, and was freed backwards.
# zh: 轨迹：A 恰好在 len(A) 达到 13 时拿到块 5，释放时倒序归还。
assert rows[0][2] == [0, 1, 2] and rows[1][4] == [3, 4]
assert [len(r[2]) for r in rows[1:5]] == [3, 3, 3, 4] and rows[4][1] == 14
assert rows[-1][5] == [6, 7, 5, 2, 1, 0]
check_invariants(bm, [a, b])
# en: Sharing: the system prompt's two blocks are held by both tables.
# zh: 共享：系统提示词的两个块同时被两个块表持有。
assert second.block_table[:2] == first.block_table[:2] and found == 8
assert [shared.blocks[i].ref_count for i in first.block_table] == [2, 2, 1]
check_invariants(shared, [first, second])
shared.deallocate(first)
check_invariants(shared, [second])
assert [shared.blocks[i].ref_count for i in second.block_table] == [1, 1, 1]
print(say("trace and invariants hold"))

# %% [markdown] tags=["en"]
# ### Paging's two promises about waste
#
# The idea section made two claims. The first is about **external fragmentation**: with
# contiguous regions, memory that is free in total can still be unusable, because it is split
# into holes that are each too small for the next request. Below, five requests hold 12, 8, 12,
# 8 and 8 slots of a 48-slot cache; B and D finish, leaving 16 free slots; then F needs 12. The
# contiguous allocator (first fit) finds no hole of 12 and refuses; the block pool, with the
# same 48 slots as 12 blocks of 4, gives F three blocks wherever they are. Each character is a
# slot; in the paged rows `[....]` is one block.
#
# The second is about **internal fragmentation**: a sequence wastes only the unused tail of its
# last block, fewer than `block_size` slots, whatever its `max_tokens`. We check it after every
# step of 50 random sequences, for four block sizes.

# %% [markdown] tags=["zh"]
# ### 关于浪费，分页的两点保证
#
# “思路”一节给出了两个论断。第一个关于**外部碎片**：按连续区域分配时，空闲显存的总量也许够用，却可能被切成一个个
# 小空洞，每个都放不下下一个请求。下面五个请求在 48 个槽位的缓存里分别占用 12、8、12、8、8 个槽位；B 和 D 结束后
# 空出 16 个槽位；接着 F 需要 12 个。连续分配器（首次适配）找不到 12 个槽位的空洞，只能拒绝；块池用同样的 48 个
# 槽位（12 个块，每块 4 个），不论空闲块在哪里，取三个给 F 即可。每个字符是一个槽位；分页那几行里，`[....]` 是一个块。
#
# 第二个关于**内部碎片**：无论 `max_tokens` 多大，一个序列浪费的只是最后一块没用上的尾部，少于 `block_size`
# 个槽位。我们对 50 个随机序列、四种块大小，在每一步之后都检查一遍。

# %% external fragmentation
class ContiguousAllocator:
    """Each request gets one run of adjacent slots, the first run that is long enough."""
    # zh: 每个请求得到一段相邻的槽位：第一段足够长的。

    def __init__(self, num_slots: int) -> None:
        self.slots = ["."] * num_slots

    def holes(self) -> list[int]:
        """The lengths of the runs of free slots."""
        # zh: 各段空闲槽位的长度。
        runs = "".join(slot if slot == "." else " " for slot in self.slots).split()
        return [len(run) for run in runs]

    def allocate(self, name: str, size: int) -> bool:
        run = 0
        for i, slot in enumerate(self.slots):
            run = run + 1 if slot == "." else 0
            if run == size:
                self.slots[i - size + 1 : i + 1] = [name] * size
                return True
        return False

    def free(self, name: str) -> None:
        self.slots = ["." if slot == name else slot for slot in self.slots]


def paged_slots(bm: BlockManager, named: dict[str, Sequence]) -> str:
    """The block pool slot by slot: each block's owner once per token it holds, '.' for empty slots."""
    # zh: 逐个槽位看块池：每个块的所有者，它装着几个 token 就写几次；'.' 表示空槽位。
    cells = ["." * bm.block_size] * bm.num_blocks
    for name, seq in named.items():
        for i, block_id in enumerate(seq.block_table):
            used = min(bm.block_size, len(seq) - i * bm.block_size)
            cells[block_id] = name * used + "." * (bm.block_size - used)
    return "".join(f"[{cell}]" for cell in cells)


requests = {"A": 12, "B": 8, "C": 12, "D": 8, "E": 8}
contiguous = ContiguousAllocator(48)
paged = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
holders = {name: Sequence(list(range(size)), block_size=4) for name, size in requests.items()}
for name, size in requests.items():
    assert contiguous.allocate(name, size)
    paged.allocate(holders[name])
for name in ("B", "D"):
    contiguous.free(name)
    paged.deallocate(holders.pop(name))
free_slots, holes = contiguous.slots.count("."), contiguous.holes()
contiguous_served = contiguous.allocate("F", 12)
print(f"{say('contiguous'):<12} {''.join(contiguous.slots)}")
print(f"{'':<12} " + say("F needs 12 adjacent slots: {free} free, in holes of {holes}: {verdict}",
                         free=free_slots, holes=holes, verdict=say("served" if contiguous_served else "refused")))
print(f"{say('paged'):<12} {paged_slots(paged, holders)}")
holders["F"] = Sequence(list(range(12)), block_size=4)
paged_served = paged.can_allocate(holders["F"])
paged.allocate(holders["F"])
print(f"{say('paged + F'):<12} {paged_slots(paged, holders)}")
print(f"{'':<12} " + say("F takes blocks {table}: {verdict}", table=holders["F"].block_table,
                         verdict=say("served" if paged_served else "refused")))

# en: Claim 1: enough free slots in total, no hole large enough, refused; the pool serves F
# en: from blocks that are not adjacent.
# zh: 论断 1：空闲槽位总数足够，却没有足够大的空洞，于是被拒绝；块池则用互不相邻的块接纳了 F。
assert free_slots >= 12 > max(holes) and not contiguous_served
table = holders["F"].block_table
# en: Not one run of adjacent blocks.
# zh: 不是一段连续相邻的块。
assert paged_served and max(table) - min(table) >= len(table)

# %%
import random

rng = random.Random(2)
for block_size in (1, 2, 4, 16):
    pool = BlockManager(num_blocks=128, block_size=block_size, enable_prefix_caching=False)
    worst = 0
    for _ in range(50):
        seq = Sequence([rng.randrange(100) for _ in range(rng.randint(1, 40))], block_size=block_size)
        prefill(pool, seq, sampled=0)
        for step in range(rng.randint(1, 41)):
            if step:
                decode(pool, seq, sampled=0)
            # en: Slots held minus slots whose KV is written: the unused tail of the last block.
            # zh: 持有的槽位减去已写入 KV 的槽位：最后一块没用上的尾部。
            waste = len(seq.block_table) * block_size - seq.num_cached_tokens
            assert 0 <= waste < block_size, (block_size, waste)
            worst = max(worst, waste)
        pool.deallocate(seq)
    print(say("block_size={size:>2}: at most {worst} empty slots per sequence (bound: {bound})",
              size=block_size, worst=worst, bound=block_size - 1))
    # en: Claim 2, and the bound is tight: some step leaves a whole block but one slot empty.
    # zh: 论断 2，而且这个上界是紧的：某一步会让最后一块只用了一个槽位。
    assert worst == block_size - 1

# %% [markdown] tags=["en"]
# The decode rule, over block sizes 1 to 6 and 40 decode steps each: a block is added exactly
# when the table no longer covers `len(seq)`, which is `len(seq) % block_size == 1` for every
# block size but 1. The last line shows the corner the modulo test misses.

# %% [markdown] tags=["zh"]
# decode 的加块规则，对块大小 1 到 6、各 40 个 decode 步做检查：恰好在块表不再覆盖 `len(seq)` 时加一块；除了块大小
# 为 1 的情形，这等价于 `len(seq) % block_size == 1`。最后一行显示了取模判断遗漏的死角。

# %%
for block_size in range(1, 7):
    pool = BlockManager(num_blocks=64, block_size=block_size, enable_prefix_caching=False)
    seq = Sequence([5, 6, 7], block_size=block_size)
    prefill(pool, seq, sampled=0)
    grew, modulo_says = [], []
    for _ in range(40):
        before = len(seq.block_table)
        modulo_says.append(len(seq) % block_size == 1)
        decode(pool, seq, sampled=0)
        grew.append(len(seq.block_table) > before)
    if block_size > 1:
        assert grew == modulo_says
    else:
        assert all(grew) and not any(modulo_says)
    print(say("block_size={size}: grew at {grew} of 40 steps, modulo rule agrees: {agrees}",
              size=block_size, grew=sum(grew), agrees=grew == modulo_says))

# %% [markdown] tags=["en"]
# Running out, and misuse. `can_append` says no when the pool is exhausted (the scheduler then
# preempts, chapter 04). A call that breaks the manager's contract, say allocating twice, is a
# bug in the caller, not bad input: it fails an `assert` that says which rule was broken.

# %% [markdown] tags=["zh"]
# 块用完的情形，以及误用。池子耗尽时 `can_append` 返回 False（调度器随后会抢占，见第 04 章）。违反块管理器约定的调用，
# 比如分配两次，是调用方的 bug，而不是错误的输入：这种调用会触发 `assert`，报错信息指明违反了哪条规则。

# %%
tiny = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=False)
full = Sequence([1, 2, 3, 4], block_size=2)
# en: len 5: the next decode needs a third block.
# zh: 长度为 5：下一次 decode 需要第三个块。
prefill(tiny, full, sampled=5)
assert tiny.num_free_blocks == 0 and not tiny.can_append(full)
assert not tiny.can_allocate(Sequence([1], block_size=2))

for misuse in (
    lambda: tiny.allocate(full),
    lambda: tiny.may_append(full),
    lambda: tiny.may_append(Sequence([1], block_size=2)),
):
    try:
        misuse()
    except AssertionError as error:
        print(f"AssertionError: {error}")
    else:
        raise AssertionError("a broken contract went unnoticed")

# %% [markdown] tags=["en"]
# ## What we built
#
# - `Block`: id and reference count.
# - `BlockPool`: the blocks, a free list (a queue: its order decides what is overwritten first)
#   and a used set; `take_free_block`, `release`.
# - `BlockManager`: block tables for sequences. `can_allocate`/`allocate`, `deallocate`
#   (backwards), `can_append`/`may_append` (one more block exactly when the table stops
#   covering `len(seq)`).
#
# Chapter 03 adds prefix caching to these classes (a block's hash and tokens, `hold`, cache hits
# in `allocate`, `publish_full_blocks`), and chapter 05 copy-on-write (`fork`, and a private
# copy in `may_append`).
#
# Next, chapter 03 opens the prefix cache: how a prompt's blocks are found, and the one line
# that separates a correct cache from one that silently reuses the wrong KV.
#
# ## Exercises
#
# 1. `block_size=16`, a prompt of 100 tokens and `max_tokens=60`. How many blocks can the
#    sequence hold at most? (Careful: the KV of the very last sampled token is never computed.)
# 2. A pool of 8 blocks of 4 tokens: A (9 tokens) and then B (6 tokens) are allocated, then A is
#    freed. Which blocks does the next sequence of 8 tokens get, and why not A's first block?
# 3. A pool of 8 blocks of 4 tokens, sequences of 10, 3 and 7 tokens, just allocated (before
#    their prefill step runs). How many slots are allocated but empty?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `Block`：编号和引用计数。
# - `BlockPool`：所有块、一个空闲队列（它的顺序决定哪些内容先被覆盖）和一个已用集合；`take_free_block`、`release`。
# - `BlockManager`：序列的块表。`can_allocate`/`allocate`、`deallocate`（倒序释放）、
#   `can_append`/`may_append`（恰好在块表不再覆盖 `len(seq)` 时多加一块）。
#
# 第 03 章给这些类加上前缀缓存（块的哈希值和 token、`hold`、`allocate` 中的缓存命中、`publish_full_blocks`），
# 第 05 章加上写时复制（`fork`，以及 `may_append` 中的私有副本）。
#
# 下一章（第 03 章）讲前缀缓存：怎样找到提示词的块，以及区分“正确的缓存”和“悄悄复用错误 KV 的缓存”的那一行代码。
#
# ## 练习
#
# 1. `block_size=16`，提示词 100 个 token，`max_tokens=60`。这个序列最多会持有几个块？（注意：最后一个采样得到的
#    token 的 KV 永远不会被计算。）
# 2. 8 个块、每块 4 个 token 的池子：先给 A（9 个 token）、再给 B（6 个 token）分配块，然后释放 A。下一个 8 个 token
#    的序列得到哪些块？为什么不是 A 的第一块？
# 3. 8 个块、每块 4 个 token 的池子，长度为 10、3、7 的三个序列刚分配好块（prefill 尚未运行）。
#    有多少个槽位已分配却空着？
#
# 下面的单元检查答案。

# %%
# en: Exercise 1: KV is written for 100 + 60 - 1 = 159 tokens -> ceil(159 / 16) = 10 blocks.
# zh: 练习 1：需要写 KV 的 token 有 100 + 60 - 1 = 159 个 -> ceil(159 / 16) = 10 块。
pool = BlockManager(num_blocks=16, block_size=16, enable_prefix_caching=False)
seq = Sequence(list(range(100)), block_size=16)
prefill(pool, seq, sampled=0)
while seq.num_completion_tokens < 60:
    decode(pool, seq, sampled=0)
assert len(seq.block_table) == 10

# en: Exercise 2: A takes 0, 1, 2 and B 3, 4; freeing A backwards leaves the free list 5, 6, 7, 2, 1, 0,
# en: so the new sequence gets 5 and 6. A's first block, the one most likely to be shared, goes last.
# zh: 练习 2：A 取 0、1、2，B 取 3、4；倒序释放 A 后空闲队列为 5、6、7、2、1、0，所以新序列得到 5 和 6。
# zh: A 的第一块——最可能被共享的那块——最后才会被再次使用。
pool = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
seq_a, seq_b, seq_c = (Sequence(list(range(n)), block_size=4) for n in (9, 6, 8))
pool.allocate(seq_a)
pool.allocate(seq_b)
pool.deallocate(seq_a)
pool.allocate(seq_c)
assert seq_c.block_table == [5, 6] and list(pool.free_block_ids) == [7, 2, 1, 0]

# en: Exercise 3: 10 -> 3 blocks (2 empty slots), 3 -> 1 block (1 empty), 7 -> 2 blocks (1 empty): 4.
# zh: 练习 3：10 -> 3 块（空 2 个槽位），3 -> 1 块（空 1 个），7 -> 2 块（空 1 个）：共 4 个。
pool = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
seqs = [Sequence(list(range(n)), block_size=4) for n in (10, 3, 7)]
for s in seqs:
    pool.allocate(s)
assert sum(len(s.block_table) * 4 - len(s) for s in seqs) == 4
print(say("all exercise answers check out"))
