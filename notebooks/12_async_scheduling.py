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
# # 12 · Asynchronous scheduling: the host works while the GPU computes
#
# **Goal.** By the end of this chapter you can explain how the engine keeps the GPU busy while the
# host does its bookkeeping: step *n + 1* is scheduled and queued on the GPU before the tokens of
# step *n* are known. You will extend three classes: a `Sequence` counts a token before its value
# exists, the `Scheduler` records a step in two halves (`advance` when the step is queued,
# `resolve` when its tokens arrive), and the engine of chapter 11 keeps one step in flight.

# %% [markdown] tags=["zh"]
# # 12 · 异步调度：GPU 计算时主机也在干活
#
# **目标：** 读完本章，你能解释引擎如何在主机做记账工作时让 GPU 保持忙碌：第 *n* 步的 token 还没算出来，第 *n + 1*
# 步就已经调度好并排进 GPU 的队列。你将扩展三个类：`Sequence` 在一个 token 的值还不存在时就把它计入；`Scheduler`
# 分两半记录一步（这一步入队时 `advance`，它的 token 到达时 `resolve`）；第 11 章的引擎始终让一步处于计算中。

# %% [markdown] tags=["en"]
# ## Build it: a token that is still computing
#
# When step *n + 1* is scheduled, step *n*'s tokens are still on the GPU. The scheduler must
# still count them: a decode step computes the *last* token of each sequence, and the block
# manager must know how long each sequence is. So a sequence takes a **pending** token: its place
# is reserved (`append_pending_token`, the value `PENDING_TOKEN`), and `set_token` fills it in
# when the value arrives. The model runner feeds a pending token to the next step straight from
# the GPU, never reading it on the host. And since a step may be queued after a sequence's last
# token (the one that turns out to be an end-of-sequence token), `truncate` drops what was
# computed past the end.
#
# One more arrow of the state machine: a sequence can be preempted while its newest token is
# still computing; when that token arrives and ends the sequence, it finishes from WAITING
# (chapter 11's `abort` uses the same arrow).

# %% [markdown] tags=["zh"]
# ## 动手：仍在计算的 token
#
# 调度第 *n + 1* 步时，第 *n* 步的 token 还在 GPU 上。调度器仍然必须把它们计入：decode 步计算的是每个序列的*最后*
# 一个 token，块管理器也必须知道每个序列有多长。所以序列接收一个**待定** token：为它占好位置（`append_pending_token`，
# 值为 `PENDING_TOKEN`），等值到了再由 `set_token` 填入。模型执行器直接在 GPU 上把待定 token 喂给下一步，从不在主机上
# 读取它。又因为一步可能排在一个序列的最后一个 token（结果是结束符的那个）之后，`truncate` 会丢掉越过结尾算出的内容。
#
# 状态机还多一条箭头：一个序列可能在它最新的 token 还在计算时被抢占；等这个 token 到来并让序列结束时，序列从 WAITING
# 直接结束（第 11 章的 `abort` 也用这条箭头）。

# %% pending tokens
#| export engine.sequence
from nanovllm.book.literate import add_to_class
from nanovllm.engine.sequence import Sequence

# en: The value of a token that the GPU is still computing; never a real token id (those are >= 0).
# zh: GPU 尚在计算的 token 的值；绝不会是真实的 token id（真实 id 都 >= 0）。
PENDING_TOKEN = -1


@add_to_class(Sequence)
def append_pending_token(self) -> int:
    """Reserve the place of a token the GPU is still computing; returns its index."""
    self.token_ids.append(PENDING_TOKEN)
    self.num_tokens += 1
    return self.num_tokens - 1


@add_to_class(Sequence)
def set_token(self, index: int, token_id: int) -> None:
    """Fill in the pending token at ``index``."""
    offset = index - self.first_token_index
    assert self.token_ids[offset] == PENDING_TOKEN, f"sequence {self.seq_id}: token {index} is not pending"
    self.token_ids[offset] = token_id


@add_to_class(Sequence)
def truncate(self, num_tokens: int) -> None:
    """Forget every token from index ``num_tokens`` on (tokens computed after the sequence finished)."""
    assert max(self.num_prompt_tokens, self.first_token_index) <= num_tokens <= self.num_tokens
    del self.token_ids[num_tokens - self.first_token_index :]
    self.num_tokens = num_tokens
    self.num_cached_tokens = min(self.num_cached_tokens, num_tokens)

# %% [markdown] tags=["en"]
# ## Build it: the scheduler in two halves
#
# Chapter 04's `postprocess` does two things at once: it counts the step (cached tokens, a new
# token per sequence) and it records the step's tokens (append, publish, finish). The
# asynchronous engine needs them one step apart:
#
# - `advance(seqs, is_prefill)`, right after the step is queued: the counters move, each
#   sequence that samples reserves a pending token, the siblings of chapter 04b are forked, and
#   a sequence that reaches `max_tokens` with this token gives back its blocks now (whatever the
#   token turns out to be, it is the last), as it would in the synchronous engine, so that the
#   next schedule can use them. It returns the sequences and where each one's token goes.
# - `resolve(seqs, indices, token_ids)`, once the tokens are on the host: fill them in, publish
#   the blocks whose KV is written, finish sequences on EOS or `max_tokens`. A sequence that
#   finished in an earlier step (its token was computed past its end) or was aborted meanwhile is
#   skipped.
#
# `postprocess` becomes `advance` and `resolve` back to back, so the synchronous engine and every
# chapter before this one see no difference.

# %% [markdown] tags=["zh"]
# ## 动手：一分为二的调度器
#
# 第 04 章的 `postprocess` 同时做两件事：计入这一步（已缓存的 token、每个序列一个新 token），以及记录这一步的 token
# （追加、发布、结束）。异步引擎需要把二者隔开一步：
#
# - `advance(seqs, is_prefill)`，在这一步入队之后立刻调用：计数器前移，每个要采样的序列预留一个待定 token，
#   分叉出第 04b 章的兄弟序列；一个因这个 token 达到 `max_tokens` 的序列现在就归还它的块（不管这个 token 是什么，
#   它都是最后一个），和同步引擎里一样，好让下一次调度用上这些块。它返回这些序列，以及每个序列的 token 要填到哪里。
# - `resolve(seqs, indices, token_ids)`，在 token 到达主机之后调用：填入 token，发布 KV 已写入的块，遇到 EOS 或
#   `max_tokens` 时结束序列。在更早一步已经结束（它的 token 是越过结尾多算的）或在此期间被中止的序列会被跳过。
#
# `postprocess` 变成先后调用 `advance` 和 `resolve`，所以同步引擎和本章之前的各章都看不出区别。

# %% scheduler in two halves
#| export engine.scheduler
from nanovllm.book.literate import add_to_class
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus, sibling_samples


@add_to_class(Scheduler)
def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
    """Record a step's results: cache the computed tokens, publish full blocks, append each sampled token,
    finish sequences; returns the sequences that finished. ``token_ids`` has one token per sequence, then the
    first token of each sibling that the step's sequences fork (chapter 04b). It is `advance` and `resolve`
    back to back; the asynchronous engine calls them one step apart."""
    expected = len(seqs) + len(sibling_samples(seqs))
    assert len(token_ids) == expected, f"{len(token_ids)} tokens for {len(seqs)} sequences, expected {expected}"
    seqs, indices = self.advance(seqs, is_prefill)
    return self.resolve(seqs, indices, token_ids)


@add_to_class(Scheduler)
def advance(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[Sequence], list[int | None]]:
    """Count a computed step before its tokens are known.

    Returns the step's sequences followed by the siblings they fork, and where each one's new token goes:
    None for a partial prefill chunk (it samples nothing). A sequence that reaches ``max_tokens`` with this
    token leaves ``running`` and gives back its blocks now, so that the next schedule can use them.
    """
    assert all(seq.num_scheduled_tokens == 1 or (is_prefill and seq.num_scheduled_tokens) for seq in seqs)
    seqs = [*seqs, *self._fork_siblings(seqs)]
    indices: list[int | None] = []
    for seq in seqs:
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        # en: The model runner made the step's copy-on-write copies when it launched the step.
        # zh: 执行器在发起这一步时已经完成了写时复制的拷贝。
        seq.blocks_to_copy = []
        if seq.num_cached_tokens < len(seq):
            indices.append(None)  # a partial prefill chunk: no new token (the model runner passes -1)
            continue
        indices.append(seq.append_pending_token())
        if seq.num_completion_tokens >= seq.sampling_params.max_tokens:
            # en: Publish the blocks whose tokens are all known: the token this step computed (the last
            # en: cached one) may still be pending, and a hash needs its value.
            # zh: 发布那些 token 全部已知的块：这一步计算的 token（最后一个已缓存的）可能仍是待定的，而哈希需要它的值。
            if seq.token_ids[seq.num_cached_tokens - 1 - seq.first_token_index] == PENDING_TOKEN:
                seq.num_cached_tokens -= 1
            self.block_manager.publish_full_blocks(seq)
            self.block_manager.deallocate(seq)
            self.running.remove(seq)
    return seqs, indices


@add_to_class(Scheduler)
def resolve(self, seqs: list[Sequence], indices: list[int | None], token_ids: list[int]) -> list[Sequence]:
    """Fill in a step's sampled tokens (``indices`` from `advance`), publish, finish; returns the finished."""
    assert len(seqs) == len(indices) == len(token_ids), f"{len(token_ids)} tokens for {len(seqs)} sequences"
    finished: list[Sequence] = []
    for seq, index, token_id in zip(seqs, indices, token_ids, strict=True):
        if seq.is_finished:
            # en: It finished in an earlier step (this token was computed past its end), or it was
            # en: aborted while this step was in flight: nothing of it is recorded.
            # zh: 它在更早的一步中已经结束（这个 token 是越过结尾多算的），或者在这一步计算期间被中止了：
            # zh: 不记录它的任何东西。
            continue
        # en: The KV of the step's tokens is queued on the GPU ahead of any step that could read it:
        # en: full blocks can be published.
        # zh: 这一步的 token 的 KV 已排在 GPU 队列中、先于任何可能读取它的步骤：写满的块可以发布了。
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


@add_to_class(Scheduler)
def _finish(self, seq: Sequence, num_tokens: int | None = None) -> None:
    """End ``seq`` with its first ``num_tokens`` tokens (all of them when None)."""
    # en: Asynchronously, the sequence may already hold one more (pending) token, and may even sit in
    # en: `waiting` after a preemption: drop the token, leave whichever queue it is in.
    # zh: 异步时，序列可能已经多出一个（待定的）token，甚至可能因抢占而待在 `waiting` 里：丢掉那个
    # zh: token，并离开它所在的队列。
    seq.truncate(len(seq) if num_tokens is None else num_tokens)
    for queue in (self.running, self.waiting):
        if seq in queue:
            queue.remove(seq)
    seq.status = SequenceStatus.FINISHED
    if seq.block_table:
        self.block_manager.deallocate(seq)
