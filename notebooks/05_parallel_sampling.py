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
# # 05 · One prompt, n answers: parallel sampling and copy-on-write
#
# **Goal.** By the end of this chapter you can ask the engine for several completions of one
# prompt, `SamplingParams(n=4)`, and explain what happens to memory: the prompt is computed
# **once**, its blocks are **shared** by the n samples (reference count n), and a sample that is
# about to write into a block somebody else still holds gets a private copy first:
# **copy-on-write**, the trick a forked Unix process plays with its parent's pages. You will see
# the fork, the reference counts, the copy and the frees step by step, measure what sharing saves
# against n identical prompts sent as separate requests, and check that sharing changes no token.
#
# nano-vllm has none of this; vLLM has it. The second article that this book answers walks
# through nano-vllm's scheduler and block manager with the vLLM paper's figures, and it tells this
# story with the paper's figure; so do we.

# %% [markdown] tags=["zh"]
# # 05 · 一个提示词，n 个回答：并行采样与写时复制
#
# **目标：** 读完本章，你可以向引擎要同一个提示词的多个生成结果（`SamplingParams(n=4)`），并说清楚显存里发生了
# 什么：提示词只计算**一次**，它的块由 n 个样本**共享**（引用计数为 n）；某个样本要往一个仍被别人持有的块里写入时，
# 先得到一份私有副本——这就是**写时复制**（copy-on-write），和 Unix 里 fork 出来的子进程对待父进程内存页的办法一样。
# 你会一步步看到分叉、引用计数、拷贝和释放，测量共享比“把 n 个相同提示词当作独立请求发送”省下了多少，并验证共享
# 不会改变任何一个 token。
#
# nano-vllm 没有这些，vLLM 有。本书所回应的第二篇文章借用 vLLM 论文的插图讲解 nano-vllm 的调度器和块管理器，
# 其中也用论文的插图讲了并行采样；我们照着这个例子讲一遍。

# %% [markdown] tags=["en"]
# ## The idea: fork, share, copy on the first write
#
# The article's example, after the vLLM paper: the prompt *"Four score and seven years ago our"*
# (7 tokens; blocks of 4 tokens) and two samples, A1 and A2.
#
# 1. **Prefill once.** The prompt's K and V go into two blocks: block 0 is full (*Four score and
#    seven*), block 1 holds three tokens (*years ago our*) and has one free slot.
# 2. **Fork.** The prefill's logits give each sample its own first token: A1 draws *fathers*,
#    A2 draws *mothers*. The request becomes two sequences whose block tables both read `[0, 1]`:
#    each block's reference count is 2, *the partly filled block 1 included*.
# 3. **Copy on write.** The next step writes the K and V of *fathers* (A1) and *mothers* (A2)
#    into slot 3 of block 1. Block 1 is shared, so A1 may not write there: the block manager gives
#    A1 a fresh block, records *copy block 1 into it*, and drops block 1's count to 1. The runner
#    copies the three tokens' K and V before the step runs; then A1 writes *fathers* into its copy.
# 4. **The last holder writes in place.** A2 is now block 1's only holder: it writes *mothers*
#    there, no copy needed.
# 5. **Free.** When a sample finishes it releases its references; the prompt's blocks return to
#    the free list when the last sample lets go.
#
# Only the block being written is ever copied: block 0 stays shared until the end. With n
# samples, the prompt costs its blocks once plus at most n − 1 copies of its last, partial block.
#
# **When does the fork happen?** When the prompt's first token is sampled: the model runner draws
# n tokens from the prompt's one logits row (each sample with its own random stream), and the
# scheduler's `postprocess` turns the request into n sequences. Until then there is only one
# sequence, so a chunked prefill, a prefix-cache hit or a preemption during prefill work exactly
# as before.

# %% [markdown] tags=["zh"]
# ## 思路：分叉、共享、首次写入时复制
#
# 文章里的例子取自 vLLM 论文：提示词 *"Four score and seven years ago our"*（7 个 token，每块 4 个 token），两个样本
# A1 和 A2。
#
# 1. **只 prefill 一次。** 提示词的 K、V 写进两个块：块 0 写满了（*Four score and seven*），块 1 存了三个 token
#    （*years ago our*），还剩一个空槽位。
# 2. **分叉。** prefill 得到的 logits 为每个样本各自抽出第一个 token：A1 抽到 *fathers*，A2 抽到 *mothers*。
#    这个请求变成两个序列，它们的块表都是 `[0, 1]`：每个块的引用计数都是 2，*连只写了一部分的块 1 也不例外*。
# 3. **写时复制。** 下一步要把 *fathers*（A1）和 *mothers*（A2）的 K、V 写进块 1 的第 3 个槽位。块 1 是共享的，
#    A1 不能往里写：块管理器给 A1 一个新块，记下“把块 1 拷贝进去”，并把块 1 的计数减到 1。执行器在这一步运行之前
#    拷贝那三个 token 的 K、V，然后 A1 把 *fathers* 写进自己的副本。
# 4. **最后一个持有者原地写入。** 现在 A2 是块 1 唯一的持有者：它直接把 *mothers* 写在那里，不需要拷贝。
# 5. **释放。** 样本结束时释放自己的引用；最后一个样本释放引用后，提示词的块回到空闲队列。
#
# 被拷贝的永远只是正要写入的那个块：块 0 一直共享到最后。n 个样本时，提示词的开销是它的块各一份，外加最后那个
# 未写满的块最多 n − 1 份副本。
#
# **分叉发生在什么时候？** 在提示词的第一个 token 被采样的时候：执行器从提示词那唯一一行 logits 里抽出 n 个
# token（每个样本用自己的随机数流），调度器的 `postprocess` 把这个请求变成 n 个序列。在此之前只有一个序列，所以分块
# prefill、前缀缓存命中、prefill 期间的抢占都和以前完全一样。

# %% [markdown] tags=["en"]
# ## Build it: the sequence's share
#
# Three decisions shape the code:
#
# - **The fork is a scheduler event, not a runner event.** The runner samples `n` tokens from the
#   prompt's one logits row: the step's own token, then the first token of each sibling, in one
#   order that `sibling_samples(seqs)` defines and every user of it follows. The scheduler's
#   postprocess then creates the siblings, each with its first token. From then on they are
#   ordinary sequences: they decode, get preempted and finish on their own.
# - **The copy is decided at schedule time, in the block manager.** `may_append` already runs for
#   every sequence before a decode step; it now also asks whether the block this step writes
#   into is shared. If so it takes a fresh block, swaps it into this sequence's table, releases
#   the shared one and records `(source, destination)` in `seq.blocks_to_copy`. Because the
#   decision is part of `schedule()`, chapter 18's asynchronous engine sees it like any other
#   allocation, and a tensor-parallel rank receives it with the sequence (chapter 17).
# - **The copy is one batched operation, done by the runner before the step's forward**
#   (chapter 09's `copy_kv_blocks`): all pairs of all sequences of a step become one indexed
#   read and one indexed write on the KV tensor, every layer at once, queued ahead of the step's
#   K/V stores and outside the CUDA graph that replays the forward (chapter 14).
#
# First the sequence. Chapter 01's constructor gains four fields, added at its end with
# `add_to_init` (appendix D):
# `request_id` names the request, the `seq_id` of its first sequence; `sample_index` says which
# of its n samples a sequence is (0 for the first; it picks the random stream, chapter 08);
# `pending_forks` counts the siblings still to fork, `n - 1` until the first token is sampled;
# `blocks_to_copy` holds the step's copy-on-write pairs. `fork` makes a sibling: the same tokens
# and progress, a new `seq_id`, no blocks of its own yet (the block manager shares the parent's),
# no forks of its own.

# %% [markdown] tags=["zh"]
# ## 动手：序列负责的部分
#
# 代码结构取决于三个设计决定：
#
# - **分叉是调度器的事，不是执行器的事。** 执行器从提示词唯一的一行 logits 中采样 `n` 个 token：先是这一步自己的
#   token，再是每个兄弟序列的首 token，顺序由 `sibling_samples(seqs)` 规定，所有使用方都遵循这个顺序。随后调度器的
#   后处理创建这些兄弟序列，各自带着自己的首 token。从此它们就是普通的序列：各自 decode、被抢占、结束。
# - **复制在调度时由块管理器决定。** 每个 decode 步之前，`may_append` 本来就会为每个序列运行一次；现在它还要判断
#   这一步要写入的块是否被共享。如果是，就取一个新块，换进这个序列的块表，释放共享块，并把 `(源块, 目标块)` 记入
#   `seq.blocks_to_copy`。由于这个决定是 `schedule()` 的一部分，第 18 章的异步引擎会像看待其他分配一样看到它，
#   张量并行的各个 rank 也会随序列一起收到它（第 17 章）。
# - **复制是一次批量操作，由执行器在这一步的前向计算之前完成**（第 09 章的 `copy_kv_blocks`）：一步里所有序列的所有
#   块对合并成对 KV 张量的一次索引读和一次索引写，一次处理所有层，排在这一步写入 K/V 之前，并且在重放前向计算的
#   CUDA Graph 之外（第 14 章）。
#
# 先看序列。第 01 章的构造函数增加四个字段，用 `add_to_init`（附录 D）加在它的末尾：
# `request_id` 指明所属请求，即它第一个序列的 `seq_id`；
# `sample_index` 表示这是 n 个样本中的第几个（第一个为 0；它决定随机数流，见第 08 章）；`pending_forks` 是还要分叉出的
# 兄弟序列个数，在首 token 采样之前为 `n - 1`；`blocks_to_copy` 记录这一步的写时复制块对。`fork` 生成一个兄弟序列：
# 相同的 token 和进度、新的 `seq_id`，还没有自己的块（块管理器让它共享父序列的块），自己也不再分叉。

# %% sequence forks
#| export engine.sequence
import copy

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.sequence import Sequence


@add_to_init(Sequence)
def _init_forks(self) -> None:
    # en: Parallel sampling: the request, which of its samples this is, siblings still to fork,
    # en: and the copy-on-write copies (source block, destination block) the next step must make.
    # zh: 并行采样：所属请求、这是第几个样本、还要分叉出的兄弟序列个数，以及下一步必须完成的写时复制
    # zh: （源块，目标块）。
    self.request_id = self.seq_id
    self.sample_index = 0
    self.pending_forks = self.sampling_params.n - 1
    self.blocks_to_copy: list[tuple[int, int]] = []


@add_to_class(Sequence)
def fork(self, sample_index: int) -> Sequence:
    """A sibling for sample ``sample_index`` of the same request: the same tokens and progress, a new seq_id,
    no blocks yet (the block manager's ``fork`` shares the parent's), no forks of its own."""
    # zh: 同一请求第 ``sample_index`` 个样本的兄弟序列：token 和进度相同，seq_id 是新的，
    # zh: 还没有块（块管理器的 ``fork`` 让它共享父序列的块），自己也没有分叉。
    child = copy.copy(self)
    child.seq_id = next(Sequence._ids)
    child.token_ids = list(self.token_ids)
    child.block_table = []
    child.sample_index = sample_index
    child.pending_forks = 0
    child.blocks_to_copy = []
    return child


def sibling_samples(seqs: list[Sequence]) -> list[tuple[int, int]]:
    """The siblings whose first tokens a step samples, in the order the model runner returns them after the
    step's own tokens: ``(i, k)`` for sample ``k`` of the request of ``seqs[i]``, a sequence whose prompt the
    step completes. The one definition of that order: the runner samples by it, the scheduler forks by it."""
    # zh: 一步要为哪些兄弟序列采样第一个 token，顺序与模型执行器在这一步自身的 token 之后返回它们的顺序相同：
    # zh: ``(i, k)`` 表示 ``seqs[i]`` 所属请求的第 ``k`` 个样本，``seqs[i]`` 是这一步完成了提示词的序列。
    # zh: 这个顺序只在这里定义：执行器按它采样，调度器按它分叉。
    done = [i for i, seq in enumerate(seqs) if seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq)]
    return [(i, k) for i in done for k in range(1, seqs[i].pending_forks + 1)]

# %% [markdown] tags=["en"]
# ## Build it: the block manager's share
#
# `fork(parent, child)` gives the child the parent's table and one more reference to each block.
# Copy-on-write fills three hooks that chapter 02 left empty. `_shared_write_block` finds the block
# that the step writes into (the one holding token `num_cached_tokens`) when another table holds
# it too; `_blocks_to_unshare` then counts one more free block for the copy, so that `can_append`
# says no when the copy cannot be made, and `_unshare_write_block`, which `may_append` calls
# before it adds the step's new block, makes it. `forget_copies` drops the planned copies: the
# scheduler calls it once a step has run (the runner made them before the step wrote its K/V),
# and `deallocate` calls it too (a sequence that gives back its blocks has nothing to copy into).

# %% [markdown] tags=["zh"]
# ## 动手：块管理器负责的部分
#
# `fork(parent, child)` 让子序列得到父序列的块表，并给每个块再加一个引用。写时复制填上第 02 章留空的三个接缝。当这一步
# 要写入的块（存放第 `num_cached_tokens` 个 token 的块）也被别的块表持有时，`_shared_write_block` 找到它；于是
# `_blocks_to_unshare` 为复制多算一个空闲块，这样复制做不了时 `can_append` 会说不行；`_unshare_write_block` 完成复制，
# `may_append` 先调用它，再为这一步加上新块。`forget_copies` 丢掉计划中的复制：一步运行完之后调度器调用它（执行器
# 在这一步写入 K/V 之前已经完成了复制），`deallocate` 也调用它（归还了块的序列没有可以复制进去的地方）。

# %% block manager forks
#| export engine.block_manager
from nanovllm.book.literate import add_to_class
from nanovllm.engine.block_manager import BlockManager


@add_to_class(BlockManager)
def fork(self, parent: Sequence, child: Sequence) -> None:
    """Let ``child`` (a fork of ``parent``) share every block of ``parent``: one more reference each."""
    # zh: 让 ``child``（``parent`` 分叉出的序列）共享 ``parent`` 的每一个块：每块多一个引用。
    child.block_table = list(parent.block_table)
    for block_id in child.block_table:
        self.hold(block_id)


@add_to_class(BlockManager)
def _shared_write_block(self, seq: Sequence) -> int | None:
    """Index in ``seq``'s table of the block its next step writes into, if another table holds it too."""
    # zh: ``seq`` 的下一步要写入的块在它块表中的下标，前提是另一个块表也持有这个块。
    i = seq.num_cached_tokens // self.block_size
    if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
        return i
    return None


@add_to_class(BlockManager)
def _blocks_to_unshare(self, seq: Sequence) -> int:
    """One free block for the copy when the block that ``seq``'s step writes into is shared, else none."""
    # zh: ``seq`` 这一步要写入的块是共享的时，为副本准备一个空闲块；否则不需要。
    return int(self._shared_write_block(seq) is not None)


@add_to_class(BlockManager)
def _unshare_write_block(self, seq: Sequence) -> None:
    """Copy-on-write: give ``seq`` a private copy of a shared block that its step would write into."""
    # zh: 写时复制：``seq`` 这一步要写入一个共享的块时，给它一份私有副本。
    i = self._shared_write_block(seq)
    if i is not None:
        # en: A fresh block replaces the shared one in this table only; the runner copies the K/V
        # en: into it before the step writes. The other holders keep the original.
        # zh: 只在这个块表里用新块替换共享块；执行器在这一步写入之前把 K/V 复制进去。其他持有者保留原块。
        source, seq.block_table[i] = seq.block_table[i], self.take_free_block()
        self.release(source)
        seq.blocks_to_copy.append((source, seq.block_table[i]))


@add_to_class(BlockManager)
def forget_copies(self, seq: Sequence) -> None:
    """Drop the copies planned for ``seq``: the runner made them before its step wrote, or ``seq`` gave back its
    blocks and has nothing to copy into."""
    # zh: 丢掉为 ``seq`` 计划的复制：要么执行器在它这一步写入之前已经复制好了，要么 ``seq`` 已交还它的块，
    # zh: 没有可复制的目标。
    seq.blocks_to_copy = []

# %% [markdown] tags=["en"]
# ## Build it: the scheduler's share
#
# Now a step may sample more tokens than it has sequences: after the step's own tokens come the
# first tokens of the siblings, in `sibling_samples` order. Chapter 04's `postprocess` asks the
# hook `_fork_siblings` for them *before* it records the step, and records each with its own
# token. Filled here, the hook forks them, so that each sibling starts as an exact copy of its
# parent in the middle of the step (the same counters, the same shared blocks) and is then
# recorded like any sequence of the step. The parent no longer has forks pending, and the
# siblings join the tail of `running`.
#
# The rest of the story lives where its box is built: chapter 08 gives each sample its own
# random stream (`sample_index`), chapter 09's runner samples by `sibling_samples` and makes the
# copies, chapter 10's engine groups the samples of a request (and `fork_samples=False` runs them
# as independent requests instead), chapter 18 makes the fork asynchronous.

# %% [markdown] tags=["zh"]
# ## 动手：调度器负责的部分
#
# 现在一步采样的 token 可能比它的序列还多：这一步自己的 token 之后，按 `sibling_samples` 的顺序跟着兄弟序列的首
# token。第 04 章的 `postprocess` 在记录这一步*之前*先向接缝 `_fork_siblings` 要这些兄弟序列，并让每个序列带着自己的
# token 被记录。在这里填上之后，这个接缝会分叉出它们，于是每个兄弟序列一开始都是父序列在这一步中途的精确副本（同样的
# 计数器、同样的共享块），然后像这一步的任何序列一样被记录。父序列不再有待分叉的兄弟，兄弟序列排到 `running` 的队尾。
#
# 其余改动分散在构建相应部件的各章里：第 08 章给每个样本自己的随机数流（`sample_index`），第 09 章的执行器按
# `sibling_samples` 采样并完成复制，第 10 章的引擎把一个请求的各个样本归在一起（`fork_samples=False` 则把它们当作独立
# 请求运行），第 18 章让分叉异步进行。

# %% scheduler forks
#| export engine.scheduler
from nanovllm.book.literate import add_to_class
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import sibling_samples


@add_to_class(Scheduler)
def _fork_siblings(self, seqs: list[Sequence]) -> list[Sequence]:
    """The siblings that a step's sequences fork, in `sibling_samples` order: each a copy of its parent in the
    middle of the step, sharing the parent's blocks, at the tail of ``running``. The parents fork no more."""
    # zh: 这一步的序列分叉出的兄弟序列，按 `sibling_samples` 的顺序：每个都是父序列在这一步中途的副本，
    # zh: 共享父序列的块，排在 ``running`` 的队尾。父序列不再分叉。
    siblings = []
    for i, sample_index in sibling_samples(seqs):
        child = seqs[i].fork(sample_index)
        self.block_manager.fork(seqs[i], child)
        self.running.append(child)
        siblings.append(child)
    for i, _ in sibling_samples(seqs):
        seqs[i].pending_forks = 0
    return siblings

# %% [markdown] tags=["en"]
# ## See it: the article's example, step by step
#
# The real scheduler and block manager, a word per token, blocks of 4, and a KV cache that we
# model as *which word's K/V sits in each slot*: a copy copies the words, a step writes its
# tokens' words. We play the model: the first tokens are the article's, the rest are fixed.

# %% [markdown] tags=["zh"]
# ## 看它运行：文章里的例子，一步一步来
#
# 用真实的调度器和块管理器，一个单词一个 token，每块 4 个 token；KV 缓存则简化成“每个槽位里存的是哪个词的 K/V”：
# 拷贝就是拷贝这些词，一步计算就是把这一步的 token 写进去。模型由我们扮演：第一个 token 用文章里的，其余的固定。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "after the prefill and the fork": "prefill 并分叉之后",
    "the first decode step, as scheduled (before it runs)": "第一个 decode 步，刚调度完（还没运行）",
    "after it ran: A1 wrote into its copy, A2 in place": "运行之后：A1 写进了它的副本，A2 原地写入",
    "{block}(ref {count})": "{block}（引用 {count}）",
    "  {name}: table [{blocks}]  copies {copies}": "  {name}：块表 [{blocks}]  拷贝 {copies}",
    "    block {block}: {words}": "    块 {block}：{words}",
    "free blocks after each remaining step: {free}": "之后每一步结束时的空闲块数：{free}",
    "forks: {forks}; copies: {copies}": "分叉：{forks}；拷贝：{copies}",
    "sample {i}: {tokens}": "样本 {i}：{tokens}",
    "forked samples == independent requests, token for token": "分叉的样本 == 独立的请求，逐个 token 相同",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

WORDS = "Four score and seven years ago our fathers mothers brought forth".split()
ID = {word: i for i, word in enumerate(WORDS)}
BLOCK_SIZE = 4


class WordCache:
    """The KV cache as words: slot -> the word whose K and V were written there."""
    # zh: 用词语表示的 KV 缓存：槽位 -> 在那里写下 K 和 V 的那个词。

    def __init__(self) -> None:
        self.slots: dict[int, str] = {}

    def run_step(self, seqs: list[Sequence]) -> None:
        """What the runner does for a step: the copies first, then every scheduled token's write."""
        # zh: 执行器为一步所做的事：先做复制，再写入每个被调度的 token。
        for seq in seqs:
            for source, destination in seq.blocks_to_copy:
                for offset in range(BLOCK_SIZE):
                    word = self.slots.get(source * BLOCK_SIZE + offset)
                    if word is not None:
                        self.slots[destination * BLOCK_SIZE + offset] = word
        for seq in seqs:
            for pos in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens):
                block = seq.block_table[pos // BLOCK_SIZE]
                self.slots[block * BLOCK_SIZE + pos % BLOCK_SIZE] = WORDS[seq.token_ids[pos]]

    def block(self, block_id: int) -> str:
        words = [self.slots.get(block_id * BLOCK_SIZE + i, "_") for i in range(BLOCK_SIZE)]
        return " ".join(words)


def show(title: str, sched: Scheduler, samples: dict[str, Sequence], cache: WordCache) -> None:
    bm = sched.block_manager
    print(title)
    for name, seq in samples.items():
        blocks = ", ".join(say("{block}(ref {count})", block=b, count=bm.blocks[b].ref_count) for b in seq.block_table)
        print(say("  {name}: table [{blocks}]  copies {copies}", name=name, blocks=blocks,
                  copies=seq.blocks_to_copy or "-"))
    used = sorted({b for seq in samples.values() for b in seq.block_table})
    for b in used:
        print(say("    block {block}: {words}", block=b, words=cache.block(b)))


sched = Scheduler(num_kvcache_blocks=6, kvcache_block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=32)
prompt = [ID[w] for w in "Four score and seven years ago our".split()]
a1 = Sequence(prompt, SamplingParams(n=2, max_tokens=3, ignore_eos=True), block_size=BLOCK_SIZE)
sched.add(a1)
cache = WordCache()

# en: The prefill: one sequence, the whole prompt.
# zh: prefill：一个序列，整个提示词。
seqs, is_prefill = sched.schedule()
cache.run_step(seqs)
# en: Two samples from one logits row.
# zh: 从同一行 logits 采样出两个样本。
sched.postprocess(seqs, [ID["fathers"], ID["mothers"]], is_prefill)
a2 = next(s for s in sched.running if s.request_id == a1.seq_id and s is not a1)
samples = {"A1": a1, "A2": a2}
show(say("after the prefill and the fork"), sched, samples, cache)
assert a1.block_table == a2.block_table == [0, 1]
assert [sched.block_manager.blocks[b].ref_count for b in (0, 1)] == [2, 2]
assert (a1.token_ids[-1], a2.token_ids[-1]) == (ID["fathers"], ID["mothers"])

# en: The first decode step: both write slot 3 of block 1.
# zh: 第一个 decode 步：两者都要写块 1 的槽位 3。
seqs, is_prefill = sched.schedule()
show("\n" + say("the first decode step, as scheduled (before it runs)"), sched, samples, cache)
assert a1.blocks_to_copy == [(1, 2)] and a1.block_table == [0, 2]
assert a2.blocks_to_copy == [] and a2.block_table == [0, 1]
assert [sched.block_manager.blocks[b].ref_count for b in (0, 1, 2)] == [2, 1, 1]
cache.run_step(seqs)
sched.postprocess(seqs, [ID["brought"], ID["brought"]], is_prefill)
show("\n" + say("after it ran: A1 wrote into its copy, A2 in place"), sched, samples, cache)
assert cache.block(2) == "years ago our fathers" and cache.block(1) == "years ago our mothers"

# %% [markdown] tags=["en"]
# Read the three pictures from the top. After the fork both tables are `[0, 1]` and both
# blocks count 2 references; block 1 has a free slot (`_`). The decode step is *scheduled*
# before it runs: A1, first in the running queue, found block 1 shared, so its table now points
# at block 2, a fresh block, with the copy `(1, 2)` waiting for the runner, and block 1 counts 1.
# A2, block 1's only holder, keeps it. After the step ran, block 2 holds *years ago our fathers*
# (three copied tokens plus A1's own) and block 1 *years ago our mothers*. Block 0 was never
# copied. Now the two samples run to their end; the blocks come back as each lets go.

# %% [markdown] tags=["zh"]
# 从上往下读这三张图。分叉之后两张块表都是 `[0, 1]`，两个块的引用计数都是 2；块 1 还有一个空槽位（`_`）。decode
# 步在运行之前先被*调度*：A1 排在运行队列最前面，发现块 1 是共享的，于是它的块表改指向一个新块——块 2，拷贝
# `(1, 2)` 等着执行器去做，块 1 的计数变成 1。A2 是块 1 唯一的持有者，保留它。这一步跑完后，块 2 存着
# *years ago our fathers*（三个拷贝来的 token 加上 A1 自己的），块 1 存着 *years ago our mothers*。块 0 从未被
# 拷贝。接下来两个样本各自跑到结束；每个样本结束、释放引用后，块陆续回到空闲队列。

# %%
free_after = []
while not sched.is_finished():
    seqs, is_prefill = sched.schedule()
    cache.run_step(seqs)
    finished = sched.postprocess(seqs, [ID["forth"]] * len(seqs), is_prefill)
    free_after.append(sched.block_manager.num_free_blocks)
print(say("free blocks after each remaining step: {free}", free=free_after))
print("A1:", " ".join(WORDS[t] for t in a1.token_ids))
print("A2:", " ".join(WORDS[t] for t in a2.token_ids))
assert free_after[-1] == 6 and all(s.is_finished and not s.block_table for s in (a1, a2))
assert sched.block_manager.blocks[0].ref_count == 0

# %% [markdown] tags=["en"]
# ### The same, animated
#
# The player (appendix A) replays a recording of the real scheduler with a fake model: the
# article's 7-token prompt with `n=2`, and a second request with `n=3` whose prompt ends exactly
# on a block boundary (8 tokens). Press *step* and watch: the fork (both tables point at the same
# blocks, reference count 2 or 3), the copy-on-write at the first decode step (the copied block
# and its source are outlined, and the caption says which sample copied what), the in-place
# write of the last holder, and the frees. The second request never copies: its first decode
# step writes into new blocks. In JupyterLab, the live panel of appendix A can do the same with
# requests you type (its *samples* box sets n).

# %% [markdown] tags=["zh"]
# ### 同样的过程，动画版
#
# 播放器（附录 A）回放真实调度器配合假模型录下的过程：文章里那个 7 个 token 的提示词，`n=2`；另一个请求 `n=3`，
# 它的提示词恰好在块边界上结束（8 个 token）。点击*单步*，依次看到：分叉（两张块表指向同样的块，引用计数为 2 或 3）、
# 第一个 decode 步的写时复制（被拷贝的块和它的源块加了轮廓，说明文字写明哪个样本拷贝了什么）、最后一个持有者的
# 原地写入，以及释放。第二个请求从不拷贝：它的第一个 decode 步写进的是新块。在 JupyterLab 里，附录 A 的实时面板
# 可以用你输入的请求做同样的事（*样本数*输入框设置 n）。

# %% fork animated
from IPython.display import display

from nanovllm.viz import FakeEngine, Player

fake = FakeEngine(num_kvcache_blocks=12, kvcache_block_size=4)
article = fake.add(prompt, max_tokens=3, n=2)
boundary = fake.add(list(range(40, 48)), max_tokens=2, n=3)
fake.run()
forking = fake.recording
display(Player(forking))

frames = forking["frames"]
forks = {e["seq"]: e["into"] for f in frames if f["phase"] == "postprocess" for e in f["event"]["forked"]}
copies = [c for f in frames if f["phase"] == "schedule" for c in f["event"]["copies"]]
assert len(forks[article.seq_id]) == 2 and len(forks[boundary.seq_id]) == 3
# en: One copy, for the article's prompt.
# zh: 只有一次拷贝，属于文章例子里的那个提示词。
assert len(copies) == 1 and copies[0]["seq"] in forks[article.seq_id]
assert sorted(frames[-1]["free_list"]) == list(range(12))
print(say("forks: {forks}; copies: {copies}", forks=forks, copies=copies))

# %% [markdown] tags=["en"]
# ## Check it: sharing changes no token
#
# Sharing is an optimization, so it must be invisible in the output. We check it on the whole
# engine, `LLM` (chapter 10 builds it; here it is only a caller), with a tiny Qwen3 (chapter 06)
# on the CPU. `Config(fork_samples=False)` switches sharing off: a request with `n=4` then
# becomes four independent sequences, each computing the prompt itself, but each sample keeps
# its own random stream (`sample_index` picks it, and with a `seed` the stream depends only on
# the seed, the sample and the position). So the same seeded request must give exactly the same
# four completions either way. To make a missed or misdirected copy visible, we fill the KV cache
# with NaN before running: a sample that reads a slot nobody wrote for it gets NaN logits and a
# different token. (The test suite runs this under chunked prefill, preemption, asynchronous
# scheduling and two tensor-parallel ranks, and checks that it *fails* when the runner's copy is
# switched off.) What sharing saves, in prefill tokens, blocks and speed, chapter 19 measures, on
# this tiny model and on a GPU.

# %% [markdown] tags=["zh"]
# ## 验证：共享不改变任何 token
#
# 共享只是一种优化，所以在输出上必须看不出来。我们在整个引擎 `LLM` 上检查（第 10 章才构建它，这里只是调用它），
# 在 CPU 上用一个小 Qwen3（第 06 章）。`Config(fork_samples=False)` 把共享关掉：这时一个 `n=4` 的请求变成四个
# 独立的序列，各自计算提示词，但每个样本仍保留自己的随机数流（由 `sample_index` 选定；设置了 `seed` 时，随机数流只
# 取决于种子、样本序号和位置）。所以同一个带种子的请求，两种方式下都必须给出完全相同的四个结果。为了让漏掉或拷错的
# 拷贝显形，运行前先把 KV 缓存填满 NaN：读到一个不是为它写入的槽位的样本会得到 NaN 的 logits，从而得到不同的 token。
# （测试套件还在分块 prefill、抢占、异步调度和两个张量并行 rank 下运行这项检查，并确认关掉执行器的拷贝后它会*失败*。）
# 共享省下了多少 prefill token、多少块、多少时间，由第 19 章在这个小模型上和 GPU 上测量。

# %%
import random

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM

tiny_qwen = str(build_tiny_model("qwen3"))
rng = random.Random(0)
# en: 7 full blocks of 4 and a partial one (2 tokens).
# zh: 7 个写满的块（每块 4 个 token），再加一个未写满的块（2 个 token）。
prompt = [rng.randrange(3, 512) for _ in range(30)]
seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4, seed=2026)
completions = {}
for fork in (True, False):
    llm = LLM(tiny_qwen, device="cpu", kvcache_block_size=4, num_kvcache_blocks=64, fork_samples=fork)
    llm.model_runner.kv_cache.fill_(float("nan"))
    output = llm.generate([prompt], seeded, use_tqdm=False)[0]
    completions[fork] = [s["token_ids"] for s in output["outputs"]]
    # en: Every block came back.
    # zh: 所有块都已归还。
    assert llm.scheduler.block_manager.num_free_blocks == 64
for i, tokens in enumerate(completions[True]):
    print(say("sample {i}: {tokens}", i=i, tokens=tokens))
assert completions[True] == completions[False]
# en: Four streams, not one sample four times.
# zh: 四个独立的样本，而不是同一个样本重复四次。
assert len({tuple(t) for t in completions[True]}) > 1
print(say("forked samples == independent requests, token for token"))

# %% [markdown] tags=["en"]
# ## The other user of copy-on-write: beam search
#
# Beam search keeps the k most likely sequences (beams) and, at every step, extends each by its
# likeliest tokens and keeps the k best of all those extensions. A beam with two extensions among
# the k best splits into two beams; a beam with none is dropped. In memory that is exactly this chapter's
# machinery, used at *every* step instead of once: a beam that continues in two ways **forks**
# (its block table is shared, reference counts go up), the next write into the shared last block
# **copies** it, and a dropped beam **releases** its references, so blocks that only it held
# return to the free list. vLLM implemented beam search this way. We do not build it (the
# engine's API samples; it does not search), but the exercises below fork in the middle of a
# decode to show that nothing else is needed on the memory side.

# %% [markdown] tags=["zh"]
# ## 写时复制的另一个用武之地：束搜索
#
# 束搜索（beam search）保留 k 个最可能的序列（束），每一步把每个束按它最可能的几个 token 延伸，再从所有延伸中留下
# 最好的 k 个。若一个束有两种延伸同时入选，它就分裂成两个束；没有延伸入选的束被丢弃。在显存管理上，这恰好就是本章的
# 机制，只不过每一步都要用到，而不只是一次：以两种方式延续的束会**分叉**（共享块表，引用计数增加），下一次写入共享的
# 最后一块时**复制**它；被丢弃的束**释放**自己的引用，只被它持有的块回到空闲队列。vLLM 当年就是这样实现束搜索的。
# 我们不实现它（引擎的接口是采样，不是搜索），但下面的练习在 decode 中途分叉，说明在显存这一侧不需要别的东西。

# %% [markdown] tags=["en"]
# ## What we built
#
# - `SamplingParams(n=...)`: several samples of one prompt; `generate` returns nano-vllm's
#   `{"text", "token_ids"}` (the first sample) plus `"outputs"`, every sample's
#   `{"text", "token_ids"}` in sample order, when `n > 1`.
# - The fork: the prompt is prefilled once (chunked, with cache hits, as usual); the runner draws
#   the n first tokens from its one logits row, each sample from its own random stream; the
#   scheduler's `postprocess` creates the n − 1 siblings, which share every block (reference count n,
#   the partial last block included).
# - Copy-on-write, decided at schedule time by `BlockManager.may_append`, made by the runner as
#   one batched copy before the forward (`copy_kv_blocks`), outside CUDA graphs, on every
#   tensor-parallel rank; the last holder writes in place.
# - `fork_samples=False`, which runs the samples as independent requests (chapter 19 measures the
#   two against each other: `python -m nanovllm.bench --parallel-sampling N`).
# - Tests: unit tests of each step above, the property tests and the provenance fuzz of the
#   scheduler extended to forks (no step ever writes into a block whose reference count is above
#   1; every slot read holds the K/V of the same prefix), and token-for-token parity of forked and
#   independent samples.
#
# Next, chapter 06 builds the model that computes those K and V vectors.
#
# ## Exercises
#
# 1. A 1,000-token prompt, blocks of 16 tokens, n = 4. How many blocks do the prompt's samples
#    hold once the first decode step is scheduled, forked and as four independent requests? How
#    many blocks does sharing save?
# 2. For which prompt lengths does a sample need no copy at its first decode step (blocks of 4,
#    n = 2)? And which of the n samples never needs one?
# 3. Beam search forks in the middle of a decode. Fork a sequence that has already generated a
#    few tokens, with `Sequence.fork` and `BlockManager.fork`: which block is copied at the next
#    step, and what are the reference counts before and after the copy?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `SamplingParams(n=...)`：同一个提示词的多个样本；`n > 1` 时，`generate` 返回 nano-vllm 的
#   `{"text", "token_ids"}`（第一个样本），外加 `"outputs"`：按样本顺序排列的每个样本的 `{"text", "token_ids"}`。
# - 分叉：提示词只 prefill 一次（照常分块、照常命中缓存）；执行器从它那一行 logits 里抽出 n 个首 token，每个样本
#   用自己的随机数流；调度器的 `postprocess` 创建 n − 1 个兄弟序列，它们共享每一个块（引用计数为 n，连未写满的最后一块
#   也算在内）。
# - 写时复制：由 `BlockManager.may_append` 在调度时决定，由执行器在前向计算之前用一次批量拷贝完成
#   （`copy_kv_blocks`），不在 CUDA Graph 之内，每个张量并行 rank 都做；最后一个持有者原地写入。
# - `fork_samples=False`：把样本当作独立请求运行（第 19 章用 `python -m nanovllm.bench --parallel-sampling N`
#   比较这两种做法）。
# - 测试：上面每一步的单元测试；调度器的性质测试和溯源模糊测试扩展到了分叉（任何一步都不会写入引用计数大于 1 的
#   块；读到的每个槽位存的都是同一前缀的 K/V）；以及分叉样本与独立样本逐 token 一致。
#
# 下一章（第 06 章）构建计算这些 K、V 向量的模型。
#
# ## 练习
#
# 1. 一个 1,000 个 token 的提示词，每块 16 个 token，n = 4。第一个 decode 步调度完成时，分叉的做法和四个独立请求
#    的做法，这些样本分别持有多少个块？共享省下了多少个块？
# 2. 每块 4 个 token、n = 2 时，提示词长度为多少时样本在第一个 decode 步不需要拷贝？n 个样本中哪一个永远不需要拷贝？
# 3. 束搜索会在 decode 中途分叉。用 `Sequence.fork` 和 `BlockManager.fork` 把一个已经生成了几个 token 的序列分叉：
#    下一步会拷贝哪个块？拷贝前后的引用计数各是多少？
#
# 下面的单元检查答案。

# %%
def first_decode_blocks(prompt_len: int, n: int, fork: bool, block_size: int = 16) -> tuple[int, dict[int, int]]:
    """Blocks held by the samples once the first decode step is scheduled, and the copies each sample makes
    then, by sample index (of a fork; independent requests are all sample 0, so only forks are asked)."""
    # zh: 第一个 decode 步调度之后，各样本持有的块，以及各样本那时要做的复制，按样本下标排列
    # zh: （指分叉出的样本；独立请求都是样本 0，所以只问分叉的）。
    sched = Scheduler(num_kvcache_blocks=1024, kvcache_block_size=block_size, max_num_seqs=n,
                      max_num_batched_tokens=n * prompt_len)
    params = SamplingParams(n=n if fork else 1, max_tokens=4, ignore_eos=True)
    for _ in range(1 if fork else n):
        sched.add(Sequence(range(prompt_len), params, block_size=block_size))
    seqs, is_prefill = sched.schedule()
    sched.postprocess(seqs, [1] * (len(seqs) + sum(s.pending_forks for s in seqs)), is_prefill)
    decode, _ = sched.schedule()
    held = sched.block_manager.num_blocks - sched.block_manager.num_free_blocks
    return held, {s.sample_index: len(s.blocks_to_copy) for s in decode}


# en: Exercise 1: 62 full blocks + a partial one (8 tokens). Forked: the 62 stay shared and the partial
# en: block is written by all four: three copies, the last writes in place -> 62 + 4 = 66 blocks.
# en: Independent: 4 x 63 = 252. Sharing saves 186 blocks.
# zh: 练习 1：62 个写满的块加一个未写满的块（8 个 token）。分叉：62 个写满的块保持共享，四个样本都要写那个未写满的块：
# zh: 三份拷贝，最后一个原地写入 -> 62 + 4 = 66 块。独立请求：4 x 63 = 252 块。共享省下 186 块。
forked_blocks, copies = first_decode_blocks(1000, 4, fork=True)
independent_blocks, _ = first_decode_blocks(1000, 4, fork=False)
assert (forked_blocks, sum(copies.values()), independent_blocks) == (66, 3, 252)

# en: Exercise 2: when the prompt fills its last block exactly (a multiple of 4), the first decode writes
# en: into a new block for each sample: no copy. And the last holder of a shared block never copies: the
# en: siblings join the tail of `running` in sample order and decode takes it oldest first, so samples
# en: 0 … n-2 each copy and drop their reference, and sample n-1 finds the block its own. Later steps write
# en: into blocks each sample allocated itself.
# zh: 练习 2：提示词恰好写满最后一块时（4 的倍数），第一个 decode 步为每个样本各写一个新块：不需要拷贝。共享块的
# zh: 最后一个持有者永远不需要拷贝：兄弟序列按样本顺序排到 `running` 队尾，decode 从最旧的开始取，于是样本 0 … n-2
# zh: 各拷贝一次并放掉自己的引用，样本 n-1 拿到时这个块已只归它所有。之后各步写入的都是每个样本自己分配的块。
copies_by_length = {length: first_decode_blocks(length, 2, fork=True, block_size=4)[1] for length in range(1, 13)}
assert [length for length, copies in copies_by_length.items() if sum(copies.values()) == 0] == [4, 8, 12]
assert all(copies[1] == 0 for copies in copies_by_length.values())
assert first_decode_blocks(7, 4, fork=True, block_size=4)[1] == {0: 1, 1: 1, 2: 1, 3: 0}

# en: Exercise 3: a sequence 6 tokens long (5 with KV) forks: both hold blocks [0, 1], ref 2 each. The next
# en: step writes position 5, in block 1: the first to be scheduled copies block 1 into a fresh block 2,
# en: the other writes in place. After the copy block 0 is still shared (ref 2: full, never written again),
# en: and blocks 1 and 2 have one holder each.
# zh: 练习 3：一个长 6 个 token（其中 5 个已有 KV）的序列分叉：两者都持有块 [0, 1]，引用计数各为 2。下一步写第 5 个
# zh: 位置，在块 1 中：先被调度的那个把块 1 拷贝到新块 2，另一个原地写入。拷贝之后块 0 仍然共享（引用计数 2：它已
# zh: 写满，不会再被写入），块 1 和块 2 各只有一个持有者。
beams = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
beam = Sequence([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), block_size=4)
beams.add(beam)
for token in (4, 5, 6):
    seqs, is_prefill = beams.schedule()
    beams.postprocess(seqs, [token], is_prefill)
other = beam.fork(1)
beams.block_manager.fork(beam, other)
beams.running.append(other)
assert beam.block_table == other.block_table == [0, 1]
assert [beams.block_manager.blocks[b].ref_count for b in (0, 1)] == [2, 2]
decode, _ = beams.schedule()
assert beam.blocks_to_copy == [(1, 2)] and other.blocks_to_copy == [] and other.block_table == [0, 1]
assert beam.block_table == [0, 2]
assert [beams.block_manager.blocks[b].ref_count for b in (0, 1, 2)] == [2, 1, 1]
print(say("all exercise answers check out"))
