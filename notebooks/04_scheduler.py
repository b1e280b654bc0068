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
# # 04 · The scheduler
#
# **Goal.** By the end of this chapter you can predict, for any set of requests, what each step
# of the engine computes: which sequences, how many tokens of each, whether it is a prefill or a
# decode step, and who gets preempted when the cache runs out. You will build the `Scheduler`:
# two queues, a prefill-first policy with a token budget and chunked prefill, decode with
# preemption, and the postprocess that turns a step's sampled tokens into progress.
#
# The engine loop (chapter 11) is three lines, and this chapter owns two of them:
#
# ```python
# seqs, is_prefill = scheduler.schedule()
# token_ids = model_runner.run(seqs, is_prefill)   # chapter 08
# scheduler.postprocess(seqs, token_ids, is_prefill)
# ```

# %% [markdown] tags=["zh"]
# # 04 · 调度器
#
# **目标。** 读完本章，对任意一组请求，你都能预测引擎每一步计算什么：哪些序列、各算多少个 token、是 prefill 步还是
# decode 步，以及缓存不够时谁会被抢占。本章构建 `Scheduler`（调度器）：两个队列、带 token 预算和分块 prefill 的
# prefill 优先策略、带抢占的 decode，以及把一步的采样结果变成进度的后处理。
#
# 引擎主循环（第 11 章）只有三行，其中两行属于本章：
#
# ```python
# seqs, is_prefill = scheduler.schedule()
# token_ids = model_runner.run(seqs, is_prefill)   # 第 08 章
# scheduler.postprocess(seqs, token_ids, is_prefill)
# ```

# %% [markdown] tags=["en"]
# ## The idea: two queues and one decision per step
#
# ```
#            add                 prefill (budget, blocks)                 EOS / max_tokens
#   request ─────► waiting ───────────────────────────────► running ───────────────────────► finished
#                  ▲  head                                     │ tail
#                  └────────── preempt: free all blocks ◄──────┘  (newest first, recompute later)
# ```
#
# Every step is **either all-prefill or all-decode**, and prefill comes first:
#
# - **Prefill.** Take sequences from the head of `waiting` while the step has room: at most
#   `max_num_seqs` sequences and `max_num_batched_tokens` tokens (the **token budget**), and the
#   block manager can give the head sequence its blocks (cache hits lower both costs). If the
#   head's remaining prompt does not fit the budget left, it gets a **chunk**: as many tokens as
#   fit. That sequence is then the last one of the step, keeps its blocks and stays at the head
#   of `waiting`; the next step continues it. A chunk yields no new token: its last logits
#   predict a position *inside* the prompt, so the model runner (chapter 08) does not sample
#   them (it returns `-1`) and postprocess appends nothing.
# - **Decode**, when nothing could be prefilled: every running sequence (up to `max_num_seqs`)
#   computes its last token. If one needs a new block and none is free, the scheduler
#   **preempts** from the *tail* of `running`, the newest sequence first, until a block is free,
#   down to the sequence itself. A preempted sequence gives back all its blocks, returns to
#   WAITING at the *head* of `waiting` and is prefilled again later (**recompute**); prefix
#   caching may find many of its old blocks still intact.
# - **Postprocess** marks the computed tokens as cached, publishes full blocks (chapter 03),
#   appends each sampled token whose prompt is complete, and finishes sequences that sampled an
#   end-of-sequence token (unless `ignore_eos`) or reached `max_tokens`.
#
# One more rule, at the door: a request whose KV could **never** fit the whole cache is refused
# by `add`. Upstream nano-vllm accepts it and then crashes or loops forever: alone in the cache,
# the sequence needs a block, no victim is left, it preempts itself, is prefilled again, and
# runs out at the same point again. The sequence writes KV for its prompt and for every sampled
# token but the last, so it needs at most `ceil((prompt + max_tokens - 1) / block_size)` blocks;
# `add` requires that many to exist. (A weaker check, "the prompt plus one token fits", would
# let exactly the looping requests through.)

# %% [markdown] tags=["zh"]
# ## 思路：两个队列，每步一个决定
#
# ```
#          add（加入）            prefill（预算、块）                     EOS / max_tokens
#   请求 ─────────► waiting ───────────────────────────────► running ───────────────────────► finished
#                  ▲ 队头                                      │ 队尾
#                  └────────── 抢占：释放所有块 ◄──────────────┘  （最新的先被抢占，之后重算）
# ```
#
# 每一步**要么全是 prefill，要么全是 decode**，而且 prefill 优先：
#
# - **Prefill。** 只要这一步还有余量，就从 `waiting` 队头取序列：最多 `max_num_seqs` 个序列、
#   `max_num_batched_tokens` 个 token（即 **token 预算**），并且块管理器能给队头序列分配块（缓存命中会同时降低
#   这两种开销）。如果队头序列剩余的提示词超出剩余预算，它就得到一个**分块**：预算能容纳多少 token 就算多少。
#   这个序列于是成为本步的最后一个，保留它的块，并留在 `waiting` 队头；下一步接着算。分块不产生新 token：它最后一行
#   logits 预测的是提示词*内部*的某个位置，所以模型执行器（第 08 章）不对它采样（返回 `-1`），后处理也不追加任何东西。
# - **Decode**，当没有任何序列可以 prefill 时：每个运行中的序列（最多 `max_num_seqs` 个）计算它的最后一个 token。
#   如果某个序列需要新块而没有空闲块，调度器就从 `running` 的*队尾*开始**抢占**——最新的序列先被抢占——直到腾出
#   一个块，最坏情况下抢占它自己。被抢占的序列归还所有块，回到 WAITING，排在 `waiting` 的*队头*，之后重新
#   prefill（**重算**）；前缀缓存可能发现它的许多旧块仍然完好。
# - **后处理**把算过的 token 记为已缓存，发布写满的块（第 03 章），为提示词已算完的序列追加采样得到的 token，
#   并结束那些采样到结束符（除非 `ignore_eos`）或达到 `max_tokens` 的序列。
#
# 还有一条规则，在门口执行：KV **永远**放不进整个缓存的请求会被 `add` 拒绝。上游 nano-vllm 会接受它，
# 然后崩溃或陷入死循环：缓存里只剩它一个序列时，它需要新块，却没有可抢占的对象，只能抢占自己，重新 prefill，
# 又在同一个地方用完缓存。序列要为提示词和除最后一个以外的每个采样 token 写 KV，所以它最多需要
# `ceil((prompt + max_tokens - 1) / block_size)` 个块；`add` 要求缓存至少有这么多块。（更弱的检查
# “提示词加一个 token 放得下”恰好会把那些会死循环的请求放进来。）

# %% [markdown] tags=["en"]
# ## Build it: admission
#
# `max_kv_tokens` is the rule above in one line. The configuration is checked too: every
# number must be a positive int, and the end-of-sequence ids a collection of token ids.

# %% [markdown] tags=["zh"]
# ## 动手：准入检查
#
# `max_kv_tokens` 用一行代码表达上面的规则。配置也要检查：每个数都必须是正整数，结束符 id 必须是一组 token id。

# %% default module
#| default_exp engine.scheduler

# %% admission
#| export
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from nanovllm.engine.block_manager import BlockManager, positive_int
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus

# en: The observer hook: called as observer(event, data) with event in "add", "schedule", "postprocess".
# zh: 观察者钩子：以 observer(event, data) 的形式调用，event 为 "add"、"schedule" 或 "postprocess"。
Observer = Callable[[str, dict], None]


def max_kv_tokens(seq: Sequence) -> int:
    """The most tokens whose KV ``seq`` will ever hold: the prompt and all sampled tokens but the last."""
    return seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1


def _token_ids(name: str, values: Iterable[int]) -> frozenset[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a collection of token ids, got {type(values).__name__} {values!r}")
    ids = frozenset(values)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{name} must hold non-negative int token ids, got {token!r}")
    return ids

# %% [markdown] tags=["en"]
# ## Build it: the scheduler
#
# One class, read it top to bottom:
#
# - `__init__` builds the block manager and the two queues. `observer` is `None` by default; when
#   set (the visualizations of the appendix do), it is called after `add`, `schedule` and
#   `postprocess` with plain data. When it is `None` nothing at all is collected for it.
# - `add` refuses what can never run and queues the rest.
# - `schedule` tries a prefill step and falls back to a decode step. Note how little the chunk
#   needs: a sequence that still holds blocks at the head of `waiting` is a chunked prefill in
#   progress, so it is not allocated again, and `num_cached_tokens` says where it stopped.
# - `_preempt` is recompute preemption: free everything, back to the head of `waiting`.
# - `postprocess` is chapter 01's `finish_step`, plus publishing and finishing.

# %% [markdown] tags=["zh"]
# ## 动手：调度器
#
# 只有一个类，从上往下读：
#
# - `__init__` 构造块管理器和两个队列。`observer` 默认为 `None`；设置之后（附录中的可视化会设置它），它会在 `add`、
#   `schedule` 和 `postprocess` 之后以普通数据为参数被调用。为 `None` 时，不会为它收集任何东西。
# - `add` 拒绝永远无法运行的请求，其余的排入队列。
# - `schedule` 先尝试 prefill 步，不行再做 decode 步。注意分块需要的东西多么少：`waiting` 队头的序列如果还持有块，
#   那就是一个进行中的分块 prefill，所以不必再分配，`num_cached_tokens` 记录了它停在哪里。
# - `_preempt` 是重算式抢占：释放一切，回到 `waiting` 队头。
# - `postprocess` 就是第 01 章的 `finish_step`，再加上发布和结束处理。

# %% scheduler
#| export
class Scheduler:
    """Decides what each step computes: prefill first, a token budget, chunked prefill, preemption."""

    def __init__(
        self,
        *,
        num_kvcache_blocks: int,
        kvcache_block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Iterable[int] = (),
        enable_prefix_caching: bool = True,
    ) -> None:
        self.max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.eos_token_ids = _token_ids("eos_token_ids", eos_token_ids)
        positive_int("num_kvcache_blocks", num_kvcache_blocks)
        positive_int("kvcache_block_size", kvcache_block_size)
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.observer: Observer | None = None
        self._live_ids: set[int] = set()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def rollback(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Undo ``schedule()`` for a step that was never computed (the model raised), so it can run again.

        Prefill moved the sequences it completes to ``running``; they go back to the head of
        ``waiting`` in their order, keeping their blocks. Decode's new blocks and preemptions stay:
        they left the queues consistent.
        """
        for seq in seqs:
            seq.num_scheduled_tokens = 0
        if is_prefill:
            moved = [seq for seq in seqs if seq.status is SequenceStatus.RUNNING]
            for seq in moved:
                self.running.remove(seq)
                seq.status = SequenceStatus.WAITING
            self.waiting.extendleft(reversed(moved))

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request: out of its queue, its blocks freed (the caller gave up on it)."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        if seq.status is SequenceStatus.RUNNING:
            seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        if seq.block_table:
            self.block_manager.deallocate(seq)
        self._live_ids.discard(seq.seq_id)

    # en: ---- admission -----------------------------------------------------------
    # zh: ---- 准入 -----------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError when ``seq`` could never run: its KV cannot fit the cache even alone, or its
        request asks for more samples (``n``, decoded side by side) than a step may hold."""
        if seq.sampling_params is None:
            raise ValueError(f"sequence {seq.seq_id} has no sampling parameters (a worker's slim copy?)")
        bm, params = self.block_manager, seq.sampling_params
        blocks = -(-max_kv_tokens(seq) // bm.block_size)
        if blocks > bm.num_blocks:
            raise ValueError(
                f"request {seq.seq_id} can never fit the KV cache: its {seq.num_prompt_tokens} prompt tokens and "
                f"max_tokens={params.max_tokens} need up to {blocks} blocks of {bm.block_size} tokens, "
                f"but the cache has {bm.num_blocks}; shorten the prompt, lower max_tokens or enlarge the cache"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"request {seq.seq_id} asks for n={params.n} samples, but a step holds at most "
                f"max_num_seqs={self.max_num_seqs} sequences and the samples decode side by side; "
                f"raise max_num_seqs or lower n"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new request; refuse one that could never fit the KV cache, even alone."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"expected a Sequence, got {type(seq).__name__}")
        bm = self.block_manager
        if seq.block_size != bm.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has block_size={seq.block_size} but the KV cache uses {bm.block_size}"
            )
        if seq.seq_id in self._live_ids:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_cached_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a new request (status {seq.status.name}, holds blocks)")
        self.check_fits(seq)
        self.waiting.append(seq)
        self._live_ids.add(seq.seq_id)
        if self.observer is not None:
            self.observer("add", {"seq": seq})

    # en: ---- one step ------------------------------------------------------------
    # zh: ---- 一步 -----------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick this step's sequences and set their ``num_scheduled_tokens``; True if it is a prefill step."""
        if self.is_finished():
            raise RuntimeError("nothing to schedule: no waiting or running sequence")
        seqs, cache_hits = self._schedule_prefill()
        is_prefill, preempted = bool(seqs), []
        if not is_prefill:
            seqs, preempted = self._schedule_decode()
        if not seqs:
            raise RuntimeError("the scheduler could not schedule anything (a bug: add() admits only what fits)")
        if self.observer is not None:
            self.observer(
                "schedule",
                {"seqs": list(seqs), "is_prefill": is_prefill, "preempted": preempted, "cache_hits": cache_hits},
            )
        return seqs, is_prefill

    def _schedule_prefill(self) -> tuple[list[Sequence], dict[int, list[int]]]:
        scheduled: list[Sequence] = []
        cache_hits: dict[int, list[int]] = {}
        budget = self.max_num_batched_tokens
        while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:
                # en: New or preempted: it needs its blocks (a chunk in progress already has them).
                # zh: 新来的或被抢占过的：它需要分配块（进行中的分块 prefill 已经有块了）。
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if self.observer is not None and seq.num_cached_tokens:
                    cache_hits[seq.seq_id] = seq.block_table[: seq.num_cached_blocks]
            remaining = len(seq) - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(remaining, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:
                break  # a chunk: the budget is spent, and seq stays at the head of waiting
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled, cache_hits

    def _schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        while self.running and len(scheduled) < limit:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                # en: Out of blocks: preempt the newest running sequence, or seq itself if it is the last.
                # zh: 块用完了：抢占最新的运行序列；如果只剩它自己，就抢占它自己。
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, preempted

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # en: ---- after the step ------------------------------------------------------
    # zh: ---- 一步之后 -------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        """Record a step's results: cache the computed tokens, append samples, finish sequences.

        Returns the sequences that finished. It is `advance` and `resolve` back to back; chapter 11's
        asynchronous engine calls them one step apart.
        """
        # en: One token per sequence, plus the first token of each sibling forked in this step (chapter 04b).
        # zh: 每个序列一个 token，外加本步分叉出的每个兄弟序列的第一个 token（第 04b 章）。
        expected = len(seqs) + sum(seq.pending_forks for seq in seqs if seq.num_samples)
        if len(token_ids) != expected:
            raise ValueError(f"got {len(token_ids)} sampled tokens for {len(seqs)} scheduled sequences "
                             f"({expected} expected)")
        seqs, indices = self.advance(seqs, is_prefill)
        return self.resolve(seqs, indices, token_ids)

    def advance(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[Sequence], list[int | None]]:
        """Count a computed step before its tokens are known.

        Returns the step's sequences followed by the siblings forked in this step, and where each
        one's new token goes: None for a partial prefill chunk (it samples nothing). A request with
        ``n > 1`` forks when its prompt's first token is sampled (chapter 04b); the model runner
        sampled the siblings' first tokens after the step's own, in the same order. A sequence that
        reaches ``max_tokens`` with this token ends with it, whatever it is: it leaves ``running``
        and gives back its blocks now, as it would in a synchronous engine, so that the next
        schedule can use them.
        """
        kind = "prefill" if is_prefill else "decode"
        for seq in seqs:
            if seq.num_scheduled_tokens < 1 or (not is_prefill and seq.num_scheduled_tokens != 1):
                raise ValueError(f"sequence {seq.seq_id} was not scheduled in this {kind} step")
        indices: list[int | None] = []
        forked: list[Sequence] = []
        for seq in seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            # en: The model runner made the step's copy-on-write copies when it launched the step.
            # zh: 运行器在发起这一步时已经完成了写时复制的拷贝。
            seq.blocks_to_copy = []
            if seq.num_cached_tokens < len(seq):
                indices.append(None)  # a partial prefill chunk: no new token (the model runner passes -1)
                continue
            indices.append(seq.append_pending_token())
            forked += self._fork(seq)
        sampled = [seq for seq, index in zip(seqs, indices, strict=True) if index is not None] + forked
        for seq in sampled:
            if seq.num_completion_tokens >= seq.sampling_params.max_tokens:
                # en: Publish the blocks whose tokens are all known: asynchronously, the token this step
                # en: computed (the last cached one) may still be pending, and a hash needs its value.
                # zh: 发布那些 token 全部已知的块：异步时，这一步计算的 token（最后一个已缓存的）可能仍是待定的，
                # zh: 而哈希需要它的值。
                if seq.token_ids[seq.num_cached_tokens - 1] == PENDING_TOKEN:
                    seq.num_cached_tokens -= 1
                self.block_manager.publish_full_blocks(seq)
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
        return seqs + forked, indices + [len(child) - 1 for child in forked]

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """A request with n > 1 becomes n sequences when its first token is sampled (chapter 04b): the
        siblings share every block of ``seq``, and each takes its own first token from the same logits."""
        siblings = []
        for sample_index in range(1, seq.pending_forks + 1):
            child = seq.fork(sample_index)
            self.block_manager.fork(seq, child)
            self.running.append(child)
            self._live_ids.add(child.seq_id)
            siblings.append(child)
        seq.pending_forks = 0
        return siblings

    def resolve(self, seqs: list[Sequence], indices: list[int | None], token_ids: list[int]) -> list[Sequence]:
        """Fill in a step's sampled tokens (``indices`` from `advance`), publish, finish; returns the finished."""
        if not len(seqs) == len(indices) == len(token_ids):
            raise ValueError(f"got {len(token_ids)} tokens and {len(indices)} indices for {len(seqs)} sequences")
        finished: list[Sequence] = []
        for seq, index, token_id in zip(seqs, indices, token_ids, strict=True):
            if seq.is_finished:
                continue  # it finished in an earlier step: this token was computed past its end
            # en: The KV of the step's tokens is written (or, asynchronously, queued on the GPU ahead of
            # en: any step that could read it): full blocks can be published.
            # zh: 这一步的 token 的 KV 已写入（异步时则是已排在 GPU 队列中、先于任何可能读取它的步骤）：
            # zh: 写满的块可以发布了。
            self.block_manager.publish_full_blocks(seq)
            if index is None:
                continue
            seq.set_token(index, token_id)
            params = seq.sampling_params
            completion_tokens = index + 1 - seq.num_prompt_tokens
            if (not params.ignore_eos and token_id in self.eos_token_ids) or completion_tokens >= params.max_tokens:
                self._finish(seq, num_tokens=index + 1)
                finished.append(seq)
        if self.observer is not None:
            self.observer("postprocess", {"seqs": list(seqs), "token_ids": list(token_ids), "finished": finished})
        return finished

    def _finish(self, seq: Sequence, num_tokens: int) -> None:
        # en: Asynchronously, the sequence may already hold one more (pending) token, and may even sit in
        # en: `waiting` after a preemption: drop the token, leave whichever queue it is in.
        # zh: 异步时，序列可能已经多出一个（待定的）token，甚至可能因抢占而待在 `waiting` 里：丢掉那个
        # zh: token，并离开它所在的队列。
        seq.truncate(num_tokens)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if seq.block_table:
            self.block_manager.deallocate(seq)
        self._live_ids.discard(seq.seq_id)

# %% [markdown] tags=["en"]
# ## See it: three requests, a small cache, every mechanism at once
#
# A stand-in for the model: `fake_model` returns, for each scheduled sequence, a token computed
# from the tokens up to the last one this step computes, the way a real model's greedy choice
# depends only on its input. Three requests share a 4-token system prompt; A's prompt is long.
# The cache has 7 blocks of 4 tokens, a step may take 3 sequences and 12 tokens. We attach an
# observer that just records, and print one row per step: `A:12+2` means A had 12 tokens
# cached and this step computes 2 more.

# %% [markdown] tags=["zh"]
# ## 看它运行：三个请求、一个小缓存，所有机制同时登场
#
# 用 `fake_model` 代替模型：对每个被调度的序列，它根据直到本步计算的最后一个 token 为止的所有 token 算出一个 token，
# 正如真实模型的贪心选择只取决于它的输入。三个请求共享一个 4 个 token 的系统提示词；A 的提示词很长。缓存有 7 个块、
# 每块 4 个 token，每步最多 3 个序列、12 个 token。我们挂上一个只做记录的观察者，每步打印一行：`A:12+2` 表示 A
# 已缓存 12 个 token，本步再算 2 个。

# %%
import xxhash

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def fake_model(seqs: list[Sequence], is_prefill: bool) -> list[int]:
    """A deterministic 'next token' from the tokens up to the last one each sequence computes."""
    out = []
    for seq in seqs:
        context = seq.token_ids[: seq.num_cached_tokens + seq.num_scheduled_tokens]
        out.append(xxhash.xxh64(str(context).encode()).intdigest() % 50)
    return out


def run(sched: Scheduler, names: dict[int, str], show: bool = True) -> list[dict]:
    """Drive the scheduler to the end; return one record per step."""
    events: list[tuple[str, dict]] = []
    sched.observer = lambda event, data: events.append((event, data))
    steps = []
    while not sched.is_finished():
        seqs, is_prefill = sched.schedule()
        planned = [(names[s.seq_id], s.num_cached_tokens, s.num_scheduled_tokens) for s in seqs]
        sched.postprocess(seqs, fake_model(seqs, is_prefill), is_prefill)
        schedule_event, post_event = events[-2][1], events[-1][1]
        steps.append({
            "kind": "prefill" if is_prefill else "decode",
            "planned": planned,
            "preempted": [names[s.seq_id] for s in schedule_event["preempted"]],
            "hits": {names[i]: blocks for i, blocks in schedule_event["cache_hits"].items()},
            "finished": [names[s.seq_id] for s in post_event["finished"]],
            "waiting": [names[s.seq_id] for s in sched.waiting],
            "running": [names[s.seq_id] for s in sched.running],
            "free": sched.block_manager.num_free_blocks,
        })
        if show:
            r = steps[-1]
            planned_text = " ".join(f"{n}:{c}+{k}" for n, c, k in planned)
            print(f"{len(steps):>4} {r['kind']:<8} {planned_text:<24} {','.join(r['preempted']) or '-':<9} "
                  f"{r['hits'] or '-'!s:<20} {','.join(r['finished']) or '-':<8} {r['waiting']!s:<16} "
                  f"{r['running']!s:<16} {r['free']}")
    sched.observer = None
    return steps


sched = Scheduler(num_kvcache_blocks=7, kvcache_block_size=4, max_num_seqs=3, max_num_batched_tokens=12)
params = SamplingParams(max_tokens=6, ignore_eos=True)
system = [31, 32, 33, 34]
prompts = {"A": [*system, *range(1, 11)], "B": [*system, 11, 12], "C": [*system, 13, 14, 15]}
seqs = {name: Sequence(p, params, block_size=4) for name, p in prompts.items()}
names = {seq.seq_id: name for name, seq in seqs.items()}
for seq in seqs.values():
    sched.add(seq)
print(f"{'step':>4} {'kind':<8} {'scheduled':<24} {'preempted':<9} {'cache hits':<20} {'finished':<8} "
      f"{'waiting':<16} {'running':<16} free")
steps = run(sched, names)

# %% [markdown] tags=["en"]
# Step by step:
#
# - **Step 1.** A's 14-token prompt does not fit the 12-token budget: a **chunk** of 12. A stays
#   at the head of `waiting` and gets no token (postprocess ignores what our fake model returns
#   for it). Its three full blocks are
#   published.
# - **Step 2.** A's last 2 prompt tokens, then B and C, which find the system prompt's block in
#   the cache (`hits`) and compute only their own tokens. All three start running.
# - **Steps 3 and 4.** Decode steps. Step 4 takes the last free block.
# - **Step 5.** A needs a new block and none is free: C, the newest, is **preempted** (blocks
#   freed, back to `waiting`); A and B go on. No prefill happens while the cache is full: C
#   cannot be allocated until A and B finish at step 7.
# - **Step 8.** C is prefilled again: its 10 tokens, minus the system-prompt block found in the
#   cache. Its own old blocks were overwritten in the meantime, so they are recomputed.

# %% [markdown] tags=["zh"]
# 逐步来看：
#
# - **第 1 步。** A 的 14 个 token 的提示词超出 12 个 token 的预算：先算一个 12 个 token 的**分块**。A 留在
#   `waiting` 队头，没有得到 token（后处理忽略我们的假模型为它返回的值）。它的三个写满的块被发布。
# - **第 2 步。** A 剩下的 2 个提示词 token，然后是 B 和 C：它们在缓存中找到系统提示词的块（`hits`），
#   只计算自己的 token。三个序列都开始运行。
# - **第 3、4 步。** decode 步。第 4 步用掉了最后一个空闲块。
# - **第 5 步。** A 需要新块，却没有空闲块：最新的 C 被**抢占**（块被释放，回到 `waiting`）；A 和 B 继续。
#   缓存满着的时候不会有 prefill：直到 A 和 B 在第 7 步结束，C 才能分配到块。
# - **第 8 步。** C 重新 prefill：它的 10 个 token，减去在缓存中找到的系统提示词块。它自己的旧块在此期间已被
#   覆盖，所以要重算。

# %% [markdown] tags=["en"]
# ### Animated: a chunked prefill, then a preemption storm
#
# Two recordings of this scheduler with a fake model (the player comes from appendix A). First,
# a 20-token prompt with a budget of 8 tokens per step: chunks of 8 + 8 + 4, the sequence
# waiting at the head of the queue between chunks. Second, four requests in a pool of six
# 4-token blocks: decode keeps needing blocks, the newest running sequence is preempted again
# and again, and still every request finishes.

# %% [markdown] tags=["zh"]
# ### 动画：分块预填充，然后是一场抢占风暴
#
# 下面是本调度器配合假模型录下的两段过程（播放器来自附录 A）。第一段：20 个 token 的提示词，每步预算 8 个 token，
# 分块为 8 + 8 + 4，分块之间，序列在等待队列队首等候。第二段：4 个请求挤在 6 个块（每块 4 个 token）的块池里：
# decode 不断需要新块，最新的运行序列一次又一次被抢占，但所有请求最终都完成了。

# %% animations
from IPython.display import display

from nanovllm.viz import FakeEngine, Player

chunky = FakeEngine(num_kvcache_blocks=10, kvcache_block_size=4, max_num_batched_tokens=8)
chunky.add(list(range(50, 70)), max_tokens=2)
chunky.run()
display(Player(chunky.recording))
chunks = [f["event"]["scheduled"][0]["num_tokens"] for f in chunky.recording["frames"]
          if f["phase"] == "schedule" and f["event"]["is_prefill"]]
assert chunks == [8, 8, 4]

storm = FakeEngine(num_kvcache_blocks=6, kvcache_block_size=4)
for i in range(4):
    storm.add([100 * (i + 1) + t for t in range(6)], max_tokens=8)
storm.run()
display(Player(storm.recording))
storm_frames = storm.recording["frames"]
preemptions = [s for f in storm_frames if f["phase"] == "schedule" for s in f["event"]["preempted"]]
assert len(preemptions) >= 2 and all(s["status"] == "FINISHED" for s in storm_frames[-1]["seqs"])
print(f"chunks {chunks}; storm: {len(preemptions)} preemptions, all 4 requests finished")

# %% [markdown] tags=["en"]
# ## Check it
#
# The story above, asserted. Then the strongest check of all: **scheduling is invisible in the
# output.** Chunking, sharing and preemption change *when* tokens are computed, never *which*
# tokens come out. Each request run alone, in a cache so large that nothing is ever chunked,
# shared or preempted, must produce exactly the same completion.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 先用断言检查上面的叙述。然后是最有力的检查：**调度对输出不可见。** 分块、共享和抢占改变的是 token *何时*被计算，
# 而不是产出*哪些* token。每个请求单独运行、缓存大到不会发生任何分块、共享或抢占时，生成的内容必须完全相同。

# %%
assert steps[0]["planned"] == [("A", 0, 12)] and steps[0]["waiting"][0] == "A"
assert steps[1]["planned"] == [("A", 12, 2), ("B", 4, 2), ("C", 4, 3)]
assert steps[1]["hits"] == {"B": [0], "C": [0]}
assert all(all(k == 1 for _, _, k in s["planned"]) for s in steps if s["kind"] == "decode")
preemptions = [(i + 1, s["preempted"]) for i, s in enumerate(steps) if s["preempted"]]
assert preemptions == [(5, ["C"])] and steps[4]["waiting"] == ["C"]
assert steps[7]["kind"] == "prefill" and steps[7]["planned"] == [("C", 4, 6)] and steps[7]["hits"] == {"C": [0]}
for s in steps:
    assert sum(k for _, _, k in s["planned"]) <= 12 and len(s["planned"]) <= 3
assert all(seq.status is SequenceStatus.FINISHED and seq.num_completion_tokens == 6 for seq in seqs.values())
assert sched.block_manager.num_free_blocks == 7 and sched.is_finished()


def alone(prompt: list[int], params: SamplingParams) -> list[int]:
    solo = Scheduler(num_kvcache_blocks=64, kvcache_block_size=4, max_num_seqs=1, max_num_batched_tokens=1024)
    seq = Sequence(prompt, params, block_size=4)
    solo.add(seq)
    run(solo, {seq.seq_id: "solo"}, show=False)
    return seq.completion_token_ids


for name, seq in seqs.items():
    assert seq.completion_token_ids == alone(prompts[name], params), name
print("the trace holds, and every completion equals the request's solo run")

# %% [markdown] tags=["en"]
# The same on a busier workload, with end-of-sequence tokens this time: 12 requests with shared
# prefixes, a cache of 12 blocks of 2 tokens, a budget of 5 tokens. Preemptions and chunks are
# frequent, and still every completion matches its solo run, every request finishes, and the
# cache ends empty.

# %% [markdown] tags=["zh"]
# 在更繁忙的工作负载上再验证一次，这次带上结束符：12 个有共享前缀的请求，12 个块、每块 2 个 token 的缓存，每步预算
# 5 个 token。抢占和分块频繁发生，但每个生成结果仍与单独运行时一致，每个请求都会结束，缓存最后全部空闲。

# %%
import random

rng = random.Random(4)
busy = Scheduler(num_kvcache_blocks=12, kvcache_block_size=2, max_num_seqs=4, max_num_batched_tokens=5,
                 eos_token_ids=[7])
busy_prompts, busy_params, busy_seqs = {}, {}, {}
for i in range(12):
    name = f"r{i}"
    busy_prompts[name] = [1, 2, 3][: rng.randint(0, 3)] + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
    busy_params[name] = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5)
    busy_seqs[name] = Sequence(busy_prompts[name], busy_params[name], block_size=2)
    busy.add(busy_seqs[name])
busy_steps = run(busy, {s.seq_id: n for n, s in busy_seqs.items()}, show=False)
num_preempted = sum(len(s["preempted"]) for s in busy_steps)
num_chunks = sum(1 for s in busy_steps if s["kind"] == "prefill" and s["waiting"][:1] == [s["planned"][-1][0]])
print(f"{len(busy_steps)} steps, {num_preempted} preemptions, {num_chunks} chunked prefill steps")
assert num_preempted > 0 and num_chunks > 0 and busy.block_manager.num_free_blocks == 12
for name, seq in busy_seqs.items():
    assert seq.is_finished and seq.completion_token_ids == alone(busy_prompts[name], busy_params[name]), name

# %% [markdown] tags=["en"]
# ### At the door
#
# A request that could never fit, a sequence built for another block size, and bad
# configuration values are refused with a message that says what is wrong. The scheduler keeps
# serving everything it accepted.

# %% [markdown] tags=["zh"]
# ### 在门口
#
# 永远放不下的请求、按另一种块大小构造的序列、错误的配置值，都会被拒绝，错误信息说明问题所在。调度器继续为已接受的
# 请求服务。

# %%
door = Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
fits = Sequence(list(range(10)), SamplingParams(max_tokens=7), block_size=4)  # 10 + 7 - 1 = 16 tokens: 4 blocks
door.add(fits)
for bad_call in (
    lambda: door.add(Sequence(list(range(10)), SamplingParams(max_tokens=8), block_size=4)),  # 17 tokens
    lambda: door.add(Sequence(list(range(40)), SamplingParams(max_tokens=1), block_size=4)),
    lambda: door.add(Sequence([1, 2], block_size=8)),
    lambda: door.add(fits),
    lambda: door.add([1, 2, 3]),
    lambda: Scheduler(num_kvcache_blocks=0, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=8),
    lambda: Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=-1, max_num_batched_tokens=8),
    lambda: Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=0),
    lambda: Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                      eos_token_ids=2),
):
    try:
        bad_call()
        raise AssertionError("bad input was accepted")
    except (TypeError, ValueError) as error:
        print(f"{type(error).__name__}: {error}")
run(door, {fits.seq_id: "fits"}, show=False)
assert fits.is_finished and fits.num_completion_tokens == 7

# %% [markdown] tags=["en"]
# ## What we built
#
# - `max_kv_tokens(seq)`: the most KV a request will ever need; `add` refuses what the whole
#   cache could not hold.
# - `Scheduler`: `waiting` and `running` queues; `schedule` (prefill first under a token budget
#   and a sequence cap, at most one chunk per step, the last one; otherwise decode with
#   preemption from the newest); `postprocess` (cache, publish, append unless a chunk, finish on
#   EOS or `max_tokens`), made of two halves that chapter 11's asynchronous engine calls one step
#   apart: `advance` (count the step, reserve each new token) and `resolve` (fill in the tokens,
#   publish, finish); `is_finished`; and the optional `observer(event, data)` hook.
#
# The model runner (chapter 08) reads what `schedule` leaves on each sequence:
# `block_table`, `num_cached_tokens`, `num_scheduled_tokens` and `scheduled_token_ids`. The
# test suite adds property tests over random workloads and the provenance fuzz of chapter 03.
#
# ## Exercises
#
# 1. `block_size=8`, a prompt of 30 tokens, `max_tokens=10`. What is the smallest cache, in
#    blocks, that `add` accepts?
# 2. A single 20-token prompt, a budget of 8 tokens. In which step is its first token appended,
#    and how many steps ran before it without appending anything?
# 3. Why preempt the *newest* running sequence rather than the oldest? Think of what each has
#    already been given.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `max_kv_tokens(seq)`：一个请求最多需要多少 KV；`add` 拒绝整个缓存都装不下的请求。
# - `Scheduler`：`waiting` 和 `running` 两个队列；`schedule`（在 token 预算和序列数上限之内 prefill 优先，每步最多一个
#   分块且它是最后一个；否则 decode，从最新的序列开始抢占）；`postprocess`（记为已缓存、发布、除分块外追加 token、
#   遇到 EOS 或 `max_tokens` 时结束），它由两半组成，第 11 章的异步引擎把它们相隔一步调用：
#   `advance`（计入这一步，为每个新 token 占位）和 `resolve`（填入 token、发布、结束序列）；`is_finished`；
#   以及可选的 `observer(event, data)` 钩子。
#
# 模型执行器（第 08 章）读取 `schedule` 留在每个序列上的信息：`block_table`、`num_cached_tokens`、
# `num_scheduled_tokens` 和 `scheduled_token_ids`。测试套件还包括随机工作负载上的性质测试，以及第 03 章的溯源模糊测试。
#
# ## 练习
#
# 1. `block_size=8`，提示词 30 个 token，`max_tokens=10`。`add` 能接受的最小缓存是多少个块？
# 2. 一个 20 个 token 的提示词，预算 8 个 token。第一个 token 在第几步追加？在它之前有几步什么也没追加？
# 3. 为什么抢占*最新*的运行序列，而不是最旧的？想想每个序列已经得到了什么。

# %%
# en: Exercise 1: 30 + 10 - 1 = 39 tokens -> ceil(39 / 8) = 5 blocks.
# zh: 练习 1：30 + 10 - 1 = 39 个 token -> ceil(39 / 8) = 5 块。
for blocks, accepted in ((4, False), (5, True)):
    s = Scheduler(num_kvcache_blocks=blocks, kvcache_block_size=8, max_num_seqs=1, max_num_batched_tokens=64)
    try:
        s.add(Sequence(list(range(30)), SamplingParams(max_tokens=10), block_size=8))
        assert accepted
    except ValueError:
        assert not accepted

# en: Exercise 2: chunks of 8 + 8 + 4: the token is appended after step 3; the two steps before it appended nothing.
# zh: 练习 2：分块为 8 + 8 + 4：第 3 步之后追加 token；之前的两步什么也没追加。
s = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
seq = Sequence(list(range(20)), SamplingParams(max_tokens=2), block_size=4)
s.add(seq)
step = 0
while seq.num_completion_tokens == 0:
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [99] * len(batch), is_prefill)
    step += 1
assert step == 3 and seq.completion_token_ids == [99]

# en: Exercise 3: the newest sequence has had the fewest steps, so recomputing it wastes the least
# en: work, and the oldest requests, which users have waited longest for, keep going.
# zh: 练习 3：最新的序列经历的步数最少，重算它浪费的工作最少；而用户等得最久的最旧请求得以继续。
assert preemptions[0][1] == ["C"] and names[max(names)] == "C"
print("all exercise answers check out")
