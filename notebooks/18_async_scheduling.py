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
# # 18 · Asynchronous scheduling: the host works while the GPU computes
#
# **Goal.** By the end of this chapter you can explain how the engine keeps the GPU busy while the
# host does its bookkeeping: step *n + 1* is scheduled and queued on the GPU before the tokens of
# step *n* are known. You will extend the classes of earlier chapters, each with its share: a
# `Sequence` counts a token before its value exists, the `Scheduler` records a step in two halves
# (`advance` when the step is queued, `resolve` when its tokens arrive), the `ModelRunner` queues
# a step without waiting for it (`launch`), the tensor-parallel ranks keep their last steps'
# samples, and the engine of chapter 10 keeps one step in flight.

# %% [markdown] tags=["zh"]
# # 18 · 异步调度：GPU 计算时主机也在干活
#
# **目标：** 读完本章，你能解释引擎如何在主机做记账工作时让 GPU 保持忙碌：第 *n* 步的 token 还没算出来，第 *n + 1*
# 步就已经调度好并排进 GPU 的队列。你将扩展前面各章的类，每个类承担自己的一份：`Sequence` 在一个 token 的值还不
# 存在时就把它计入；`Scheduler` 分两半记录一步（这一步入队时 `advance`，它的 token 到达时 `resolve`）；
# `ModelRunner` 把一步排进队列而不等待它（`launch`）；张量并行的各个 rank 保存最近几步的采样结果；第 10 章的引擎
# 始终让一步处于计算中。

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
# (chapter 20's `abort` uses the same arrow).

# %% [markdown] tags=["zh"]
# ## 动手：仍在计算的 token
#
# 调度第 *n + 1* 步时，第 *n* 步的 token 还在 GPU 上。调度器仍然必须把它们计入：decode 步计算的是每个序列的*最后*
# 一个 token，块管理器也必须知道每个序列有多长。所以序列接收一个**待定** token：为它占好位置（`append_pending_token`，
# 值为 `PENDING_TOKEN`），等值到了再由 `set_token` 填入。模型执行器直接在 GPU 上把待定 token 喂给下一步，从不在主机上
# 读取它。又因为一步可能排在一个序列的最后一个 token（结果是结束符的那个）之后，`truncate` 会丢掉越过结尾算出的内容。
#
# 状态机还多一条箭头：一个序列可能在它最新的 token 还在计算时被抢占；等这个 token 到来并让序列结束时，序列从 WAITING
# 直接结束（第 20 章的 `abort` 也用这条箭头）。

# %% pending tokens
#| export engine.sequence
from __future__ import annotations

from nanovllm.book.literate import add_to_class
from nanovllm.engine.sequence import Sequence

# en: The value of a token that the GPU is still computing; never a real token id (those are >= 0).
# zh: GPU 尚在计算的 token 的值；绝不会是真实的 token id（真实 id 都 >= 0）。
PENDING_TOKEN = -1


@add_to_class(Sequence)
def append_pending_token(self) -> int:
    """Reserve the place of a token the GPU is still computing; returns its index."""
    # zh: 为 GPU 仍在计算的 token 预留位置；返回它的下标。
    self.token_ids.append(PENDING_TOKEN)
    self.num_tokens += 1
    return self.num_tokens - 1


@add_to_class(Sequence)
def set_token(self, index: int, token_id: int) -> None:
    """Fill in the pending token at ``index``."""
    # zh: 填入下标 ``index`` 处的待定 token。
    offset = index - self.first_token_index
    assert self.token_ids[offset] == PENDING_TOKEN, f"sequence {self.seq_id}: token {index} is not pending"
    self.token_ids[offset] = token_id


@add_to_class(Sequence)
def truncate(self, num_tokens: int) -> None:
    """Forget every token from index ``num_tokens`` on (tokens computed after the sequence finished)."""
    # zh: 忘掉下标 ``num_tokens`` 起的每个 token（序列结束之后算出的 token）。
    assert max(self.num_prompt_tokens, self.first_token_index) <= num_tokens <= self.num_tokens
    del self.token_ids[num_tokens - self.first_token_index :]
    self.num_tokens = num_tokens
    self.num_cached_tokens = min(self.num_cached_tokens, num_tokens)

# %% a sequence can end while it waits
#| export engine.sequence
from typing import ClassVar

from nanovllm.engine.sequence import SequenceStatus

# en: A token still computing can end a sequence that was preempted meanwhile, so FINISHED may now
# en: follow WAITING too (abort uses the same arrow).
# zh: 仍在计算的 token 可能让一个在此期间被抢占的序列结束，所以 WAITING 之后现在也可以是 FINISHED
# zh: （第 20 章的 abort 也用这条箭头）。
Sequence.ALLOWED_TRANSITIONS: ClassVar[dict[SequenceStatus, frozenset[SequenceStatus]]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED}),
    SequenceStatus.RUNNING: frozenset({SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED}),
    SequenceStatus.FINISHED: frozenset({SequenceStatus.FINISHED}),
}

# %% [markdown] tags=["en"]
# ## Build it: the scheduler in two halves
#
# Chapter 04's `postprocess` does two things at once: it counts the step (cached tokens, a new
# token per sequence) and it records the step's tokens (append, publish, finish). The
# asynchronous engine needs them one step apart:
#
# - `advance(seqs, is_prefill)`, right after the step is queued: the counters move, each
#   sequence that samples reserves a pending token, the siblings of chapter 05 are forked, and
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
#   分叉出第 05 章的兄弟序列；一个因这个 token 达到 `max_tokens` 的序列现在就归还它的块（不管这个 token 是什么，
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
    first token of each sibling that the step's sequences fork. It is `advance` and `resolve`
    back to back; the asynchronous engine calls them one step apart."""
    # zh: 记下一步的结果：缓存算好的 token，发布写满的块，给每个序列追加采样出的 token，结束该结束的序列；
    # zh: 返回结束了的序列。``token_ids`` 里每个序列一个 token，然后是这一步的序列分叉出的每个兄弟序列的
    # zh: 第一个 token。它就是接连调用 `advance` 和 `resolve`；异步引擎把两者相隔一步调用。
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
    # zh: 在一步的 token 还未知时就把这一步计入账目。
    # zh:
    # zh: 返回这一步的序列，后面跟着它们分叉出的兄弟序列，以及每个序列的新 token 放在哪里：
    # zh: prefill 的部分分块为 None（它什么都不采样）。因这个 token 达到 ``max_tokens`` 的序列离开 ``running``，
    # zh: 现在就交还它的块，好让下一次调度能用上。
    assert all(seq.num_scheduled_tokens == 1 or (is_prefill and seq.num_scheduled_tokens) for seq in seqs)
    seqs = [*seqs, *self._fork_siblings(seqs)]
    indices: list[int | None] = []
    for seq in seqs:
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        # en: The model runner made the step's copy-on-write copies when it launched the step.
        # zh: 执行器在发起这一步时已经完成了写时复制的拷贝。
        self.block_manager.forget_copies(seq)
        if seq.num_cached_tokens < len(seq):
            # en: a partial prefill chunk: no new token (the model runner passes -1)
            # zh: 不完整的 prefill 分块：没有新 token（执行器传回 -1）。
            indices.append(None)
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
    # zh: 填入一步采样出的 token（``indices`` 来自 `advance`），发布，结束；返回结束了的序列。
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
        if self._reached_end(seq, token_id, index + 1):
            self._finish(seq, num_tokens=index + 1)
            # en: What it publishes holds no token still computing (a step collected out of turn would leave one)
            # zh: 它发布的内容里没有还在计算的 token（漏收了某一步，就会留下一个）
            assert PENDING_TOKEN not in seq.completion_token_ids, f"{seq} finished with a pending token"
            finished.append(seq)
    self._notify("postprocess", {"seqs": list(seqs), "token_ids": list(token_ids), "finished": finished})
    return finished


@add_to_class(Scheduler)
def _finish(self, seq: Sequence, num_tokens: int | None = None) -> None:
    """End ``seq`` with its first ``num_tokens`` tokens (all of them when None)."""
    # zh: 用前 ``num_tokens`` 个 token 结束 ``seq``（为 None 时用全部 token）。
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

# %% [markdown] tags=["en"]
# ## Build it: a step's tokens, before and after they exist
#
# Chapter 09's `run` returns the sampled tokens as a Python list, which means waiting for the GPU
# to finish the step. The asynchronous engine wants to hand the GPU the next step first, so the
# runner now also offers `launch`: it queues the step and returns a `SampledTokens` at once. Its
# `on_device` tensor is usable straight away as the next decode step's input ids (the GPU runs
# the queued work in order, so the next step reads them after they are written), and the copy to
# the host is queued behind the sampler; `token_ids()` waits for that copy and no longer.

# %% [markdown] tags=["zh"]
# ## 动手：一步的 token，算出之前与之后
#
# 第 09 章的 `run` 以 Python 列表返回采样得到的 token，这意味着要等 GPU 算完这一步。异步引擎希望先把下一步交给
# GPU，所以执行器现在还提供 `launch`：它把这一步排进队列，立即返回一个 `SampledTokens`。其中的 `on_device` 张量马上就能
# 用作下一个 decode 步的输入 id（GPU 按顺序执行排队的工作，所以下一步读取它们时，它们已经写好了）；拷贝回主机的
# 操作排在采样器之后，`token_ids()` 只等这次拷贝完成，不多等。

# %% sampled tokens
#| export engine.model_runner
from dataclasses import dataclass

import torch

from nanovllm.engine.model_runner import NOT_SAMPLED, _tensor
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, sibling_samples


@dataclass
class SampledTokens:
    """A step's sampled tokens: on the device once the step is queued, on the host once it is done."""
    # zh: 一步采样出的 token：这一步排进队列后在设备上，这一步完成后在主机上。

    seqs: list[Sequence]
    # en: the indices in seqs that were sampled (a partial prefill chunk is not)
    # zh: seqs 中做了采样的下标（不完整的 prefill 分块不采样）。
    rows: list[int]
    # en: [len(samples)] int64: the step's own tokens (one per row), then the first tokens of the
    # en: siblings it forks, in `sibling_samples` order.
    # zh: [len(samples)] int64：这一步自己的 token（每行一个），然后是它分叉出的兄弟序列的首 token，
    # zh: 顺序同 `sibling_samples`（第 05 章）。
    on_device: torch.Tensor
    # en: the same tokens; on a GPU, a pinned buffer that a queued copy fills
    # zh: 同样的 token；在 GPU 上是一块锁页缓冲区，由排在队列中的拷贝填充。
    on_host: torch.Tensor
    # en: Whose token each row of on_device is: (request_id, sample_index), a key that a sibling forked
    # en: by this step will carry too.
    # zh: on_device 的每一行是谁的 token：(request_id, sample_index)；这一步分叉出的兄弟序列也带着同样的键。
    samples: list[tuple[int, int]]
    # en: recorded after that copy; None on a CPU (nothing to wait for)
    # zh: 在那次拷贝之后记录；在 CPU 上为 None（没有需要等待的）。
    ready: torch.cuda.Event | None = None

    @classmethod
    def start(
        cls, seqs: list[Sequence], rows: list[int], sampled: torch.Tensor, to_host: bool = True
    ) -> SampledTokens:
        """Queue the copy of ``sampled`` to the host and return without waiting for it (to_host=False: no copy)."""
        # zh: 把 ``sampled`` 到主机的拷贝排进队列，不等它就返回（to_host=False：不拷贝）。
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
        # zh: 每个序列一个 token（部分分块为 NOT_SAMPLED），然后是分叉出的兄弟序列的第一个 token；
        # zh: 会等到这一步运行完。
        if self.ready is not None:
            self.ready.synchronize()
        values = self.on_host.tolist()
        tokens = [NOT_SAMPLED] * len(self.seqs)
        for i, token in zip(self.rows, values[: len(self.rows)], strict=True):
            tokens[i] = token
        return tokens + values[len(self.rows) :]

    def input_ids_for(self, seqs: list[Sequence], input_ids: torch.Tensor) -> torch.Tensor:
        """A decode step's input ids on the device: ``input_ids`` (one per sequence, from `prepare_decode`)
        with each pending token replaced by this step's sample of it."""
        # zh: 设备上一个 decode 步的输入 id：``input_ids``（每个序列一个，来自 `prepare_decode`），
        # zh: 其中每个待定 token 换成这一步对它的采样结果。
        row_of = {sample: row for row, sample in enumerate(self.samples)}
        rows = []
        for seq in seqs:
            pending, key = seq.last_token == PENDING_TOKEN, (seq.request_id, seq.sample_index)
            assert not pending or key in row_of, f"{seq}'s pending token is not one this step samples"
            rows.append(row_of[key] if pending else -1)
        row = _tensor(rows, self.on_device.device)
        # en: Rows with a known token keep it; the others gather their sample (row -1 is clamped, then unused).
        # en: A sample marked NON_FINITE is clamped to 0 too: an embedding lookup of -2 would
        # en: fail on the device, and the engine drops that sequence when it reads the mark.
        # zh: 已知 token 的行保留它；其余的行取来自己的采样结果（行号 -1 先被截到 0，随后不会被用到）。
        # zh: 标记为 NON_FINITE（第 08 章）的采样结果同样截到 0：在设备上查嵌入表时 -2 会出错，而引擎读到这个标记时
        # zh: 会丢弃那个序列（第 20 章）。
        return torch.where(row >= 0, self.on_device[row.clamp(min=0)].clamp(min=0), input_ids.clamp(min=0))

    def write_pending(self, seqs: list[Sequence], input_ids: torch.Tensor) -> None:
        """`input_ids_for`, written in place into ``input_ids`` (a decode step's ids on the device)."""
        # zh: `input_ids_for`，就地写进 ``input_ids``（设备上一个 decode 步的 id）。
        keys = [(seq.request_id, seq.sample_index) for seq in seqs]
        if self.samples[: len(seqs)] == keys and all(seq.last_token == PENDING_TOKEN for seq in seqs):
            # en: The usual decode step: the same sequences in the same order, every token pending. One clamped copy
            # en: does what input_ids_for does with six operations (the clamp: a NON_FINITE mark, as there).
            # zh: 最常见的 decode 步：同样的序列、同样的顺序、每个 token 都待定。一次带截断的拷贝就完成了 input_ids_for
            # zh: 用六个操作做的事（截断的原因同那里：NON_FINITE 标记）。
            torch.clamp(self.on_device[: len(seqs)], min=0, out=input_ids)
        else:
            input_ids.copy_(self.input_ids_for(seqs, input_ids))

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "nothing": "无",
    "{kind:<7} of {tokens:2d} tokens": "{kind}，共 {tokens:2d} 个 token",
    "call {call:2d}: queued {queued:<7}, collected {collected}, finished {finished}":
        "第 {call:2d} 次调用：排入 {queued}，收取 {collected}，完成 {finished}",
    "{calls} calls for {steps} steps; the tokens equal the synchronous run's":
        "{steps} 步用了 {calls} 次调用；token 与同步运行的相同",
    "all exercise answers check out": "练习答案全部验证通过",
    "one copy of {sent} of the buffers' {total} bytes; the same bytes as load: {same}":
        "一次拷贝，送出缓冲区 {total} 字节中的 {sent} 字节；与 load 的字节相同：{same}",
    "{date}, {card}: {command}": "{date}，{card}：{command}",
    "before": "改动前",
    "after": "改动后",
    "  {when}, batch {batch}: host launch {launch:.2f} ms, step {step:.2f} ms, {share:.1%} of its bound":
        "  {when}，批大小 {batch}：主机发起 {launch:.2f} ms，一步 {step:.2f} ms，占上限的 {share:.1%}",
    "  the workload: {synchronous:.2f} s synchronous, {asynchronous:.2f} s asynchronous":
        "  整个负载：同步 {synchronous:.2f} s，异步 {asynchronous:.2f} s",
    "plain batch: {temperatures}": "普通批次：{temperatures}",
    "on a CPU, sample_in_graph=True is refused: {refused}": "在 CPU 上，sample_in_graph=True 被拒绝：{refused}",
    "  batch {batch:2d}: host {off:.3f} -> {on:.3f} ms, step {step_off:.3f} -> {step_on:.3f} ms, "
    "GPU busy {busy:.3f} ms":
        "  批大小 {batch:2d}：主机 {off:.3f} -> {on:.3f} ms，一步 {step_off:.3f} -> {step_on:.3f} ms，"
        "GPU 忙 {busy:.3f} ms",
    "  batch {batch:2d}: step {off:.3f} -> {on:.3f} ms ({ratio:.2f}x), "
    "host {host_off:.3f} -> {host_on:.3f} ms, kernels {kernels_off} -> {kernels_on}":
        "  批大小 {batch:2d}：一步 {off:.3f} -> {on:.3f} ms（{ratio:.2f} 倍），"
        "主机 {host_off:.3f} -> {host_on:.3f} ms，kernel {kernels_off} -> {kernels_on} 个",
})

# %% [markdown] tags=["en"]
# ## Build it: one copy per step, because the host is now the wall
#
# Once the GPU no longer waits for the host's bookkeeping, what is left of the host's step is
# *launching* it, and at batch 1 that became the wall: chapter 15's fused decode step took barely
# longer than the host needed to schedule, prepare and launch it (`python -m nanovllm.bench
# --latency` prints both; the run recorded below has them), so the GPU spent part of every step
# waiting for the host. A profile of the host (the script `scripts/profile_host_step.py`) showed
# where: each decode step that replays a graph built five small tensors on the host and copied
# each to the GPU (`prepare_decode`), gathered its pending tokens with six more operations
# (`input_ids_for`), and then copied all of it into the graph's buffers with ten more
# (`DecodeBuffers.load`). Every torch operation costs the host microseconds to dispatch, however
# small its work.
#
# `DecodeStaging` does the same work with two operations. It keeps two pinned host copies of the
# graph's buffers, laid out exactly like them (chapter 14's `carve`), writes a step's inputs into
# one of them straight from the sequences with numpy, and sends the prefix that the step's
# bucket needs in **one** copy. Two copies in turn, because the copy is queued, not made: the
# host must not rewrite a buffer that the GPU has yet to read, so before it writes one it waits
# on the event recorded after that buffer's last copy (two steps ago, long done). The pending
# tokens then take one clamped device-to-device copy (`write_pending`) in the usual case: the
# same sequences in the same order as the step that samples them.
#
# Recorded on an H200 (2026-12-03, `python -m nanovllm.bench --latency`, Qwen3-0.6B's shapes, one
# run before this change and one after): at batch 1 the host's launch fell from 1.02 to 0.68 ms
# and the step from 1.11 to 0.82 ms, 27.9 % → 37.6 % of its bound. The host is still the wall
# there: what is left is the graph launch itself (one call for some 200 kernels), the LM head's
# cuBLAS call, the sampler's two Triton launches and the scheduler's Python.

# %% [markdown] tags=["zh"]
# ## 动手：每步一次拷贝，因为现在主机成了瓶颈
#
# GPU 不再等主机记账之后，主机在一步里剩下的工作就是*发起*这一步；在批大小 1 时，这成了瓶颈：第 15 章融合后的
# decode 步，只比主机调度、准备并发起它的时间略长一点（`python -m nanovllm.bench --latency` 两个数都打印；见下面
# 记录的那次运行），所以每一步里 GPU 都有一段时间在等主机。对主机的剖析（脚本 `scripts/profile_host_step.py`）
# 指出了时间去向：每个重放图的 decode 步要在主机上建五个小张量，逐个拷贝到 GPU（`prepare_decode`），再用六个操作
# 取来待定 token（`input_ids_for`），然后再用十个操作把这一切拷进图的缓冲区（`DecodeBuffers.load`）。不管工作多小，
# 每个 torch 操作都要花主机若干微秒去分派。
#
# `DecodeStaging` 用两个操作完成同样的事。它保存图缓冲区的两份锁页主机副本，排布与缓冲区完全相同（第 14 章的
# `carve`），用 numpy 直接从序列把一步的输入写进其中一份，再用**一次**拷贝把这一步的档位所需的前缀送过去。两份轮流
# 使用，因为拷贝只是排进了队列，并没有立即发生：GPU 还没读走的缓冲区，主机不能改写，所以主机在写一份之前，先等待
# 这份上一次拷贝之后记录的事件（那是两步之前的事，早已完成）。待定 token 随后在通常情况下只需一次带截断的设备内拷贝
# （`write_pending`）：序列与采样它们的那一步相同、顺序也相同。
#
# 2026-12-03 在 H200 上记录（`python -m nanovllm.bench --latency`，Qwen3-0.6B 的形状，改动前后各跑一次）：批大小 1
# 时，主机发起一步的时间从 1.02 ms 降到 0.68 ms，一步从 1.11 ms 降到 0.82 ms，占上限的比例从 27.9 % 升到 37.6 %。
# 在那里主机仍是瓶颈：剩下的是图的发起本身（一次调用，约 200 个内核）、LM head 调用 cuBLAS、采样器的两次 Triton
# 启动，以及调度器的 Python 代码。

# %% recorded: one copy per step
from nanovllm.book.recorded import recorded

runs = recorded("18_async_scheduling")
staging = runs["decode staging"]
print(say("{date}, {card}: {command}", date=staging.date, card=staging.card, command=staging.command))
before, after = staging.figures["before"], staging.figures["after"]
for when, figures in (("before", before), ("after", after)):
    print(say("  {when}, batch {batch}: host launch {launch:.2f} ms, step {step:.2f} ms, {share:.1%} of its bound",
              when=say(when), batch=staging.figures["batch"], launch=figures["host launch ms"],
              step=figures["step ms"], share=figures["share of bound"]))
# en: The step fell with the host's launch, to less than the old launch took: before, the GPU waited for the host.
# zh: 一步的时间随主机发起的时间一起下降，降到比原来发起一步的时间还短：改动之前，GPU 确实在等主机。
assert after["host launch ms"] < before["host launch ms"] and after["step ms"] < before["host launch ms"]
assert (round(100 * before["share of bound"], 1), round(100 * after["share of bound"], 1)) == (27.9, 37.6)

# %% decode staging
#| export engine.cuda_graphs
import torch

from nanovllm.engine.cuda_graphs import DecodeBuffers
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.context import slot_of


class DecodeStaging:
    """A decode step's graph inputs, written on the host straight from the sequences and sent in one copy."""
    # zh: decode 步的图输入，在主机上直接由各序列写出，一次拷贝发送过去。

    def __init__(self, buffers: DecodeBuffers, block_size: int, copies: int = 2) -> None:
        self.buffers, self.block_size = buffers, block_size
        rows, on_gpu = buffers.input_ids.shape[0], buffers.storage.device.type == "cuda"
        self.hosts = [DecodeBuffers.allocate(rows, buffers.max_blocks, "cpu", pin_memory=on_gpu) for _ in range(copies)]
        # en: numpy views of each host copy: writing through numpy costs the host far less than torch operations.
        # zh: 每份主机副本的 numpy 视图：通过 numpy 写入，主机的开销远小于 torch 操作。
        self.arrays = [{name: getattr(host, name).numpy() for name, *_ in DecodeBuffers.LAYOUT}
                       for host in self.hosts]
        # en: Recorded after each host copy's last transfer; None on a CPU, where a copy is made when it is called.
        # zh: 在每份主机副本最近一次传输之后记录；CPU 上为 None，因为拷贝在调用时就已完成。
        self.sent = [torch.cuda.Event() if on_gpu else None for _ in range(copies)]
        self.turn = 0

    def stage(self, seqs: list[Sequence], graph_batch: int) -> None:
        """Write a decode step into rows [0, n) and padding rows up to graph_batch (what `DecodeBuffers.load`
        writes from `prepare_decode`), then queue one copy of them to the buffers."""
        # zh: 把一个 decode 步写进第 [0, n) 行，并把直到 graph_batch 的行写成填充行（就是 `DecodeBuffers.load`
        # zh: 从 `prepare_decode` 写入的内容），然后把它们到缓冲区的一次拷贝排进队列。
        # en: One pass over the batch for the positions and the check (this runs every decode step).
        # zh: 位置和检查在同一遍里完成（每个 decode 步都要跑这里）。
        positions = []
        for seq in seqs:
            position = len(seq) - 1
            assert seq.num_scheduled_tokens == 1 and seq.num_cached_tokens == position, f"not ready to decode: {seq}"
            positions.append(position)
        self.stage_rows(seqs, [seq.last_token for seq in seqs], positions, graph_batch)

    def stage_rows(self, seqs: list[Sequence], token_ids: list[int], positions: list[int], graph_batch: int) -> None:
        """Write rows [0, n), row i computing ``token_ids[i]`` at ``positions[i]`` of ``seqs[i]`` (and seeing the
        tokens up to it), and padding rows up to graph_batch; then queue one copy of them to the buffers."""
        # zh: 写第 [0, n) 行，第 i 行在 ``seqs[i]`` 的位置 ``positions[i]`` 计算 ``token_ids[i]``（并看到它之前的
        # zh: token），并把直到 graph_batch 的行写成填充行；然后把它们到缓冲区的一次拷贝排进队列。
        n, rows = len(seqs), self.buffers.input_ids.shape[0]
        assert 1 <= n <= graph_batch <= rows, f"need 1 <= batch ({n}) <= graph batch ({graph_batch}) <= rows ({rows})"
        turn, self.turn = self.turn, (self.turn + 1) % len(self.hosts)
        if self.sent[turn] is not None:
            self.sent[turn].synchronize()
        host = self.arrays[turn]
        host["input_ids"][:n] = token_ids
        host["positions"][:n] = positions
        host["context_lens"][:n] = positions
        host["context_lens"][:n] += 1
        tables = host["block_tables"]
        tables[:graph_batch] = -1
        for i, (seq, position) in enumerate(zip(seqs, positions, strict=True)):
            tables[i, : len(seq.block_table)] = seq.block_table
            host["slot_mapping"][i] = slot_of(seq.block_table, position, self.block_size)
        # en: Padding rows, as `DecodeBuffers.load` writes them: token 0 at position 0, storing nothing, attending
        # en: to nothing.
        # zh: 填充行，同第 14 章：位置 0 上的 token 0，什么都不存，什么都不关注。
        for name, _, wide, padding in DecodeBuffers.LAYOUT:
            if not wide:
                host[name][n:graph_batch] = padding
        size = self.buffers.prefix_bytes(graph_batch)
        self.buffers.storage[:size].copy_(self.hosts[turn].storage[:size], non_blocking=True)
        if self.sent[turn] is not None:
            self.sent[turn].record()

# %% [markdown] tags=["en"]
# ### See it: the same buffers, from one copy
#
# Chapter 14's hand-made step of three sequences (block size 4, bucket of 4), once through
# `prepare_decode` and `load`, once through `DecodeStaging`: the buffers hold the same bytes, and
# the step's copy is the prefix that a bucket of 4 needs, not the whole buffer.

# %% [markdown] tags=["zh"]
# ### 看它运行：同样的缓冲区，一次拷贝得来
#
# 第 14 章那个手工构造的三序列步（块大小 4，档位 4），一次经过 `prepare_decode` 和 `load`，一次经过
# `DecodeStaging`：两份缓冲区的字节完全相同，而这一步拷贝的只是档位 4 所需的前缀，不是整个缓冲区。

# %%
from nanovllm.engine.cuda_graphs import DecodeBuffers
from nanovllm.engine.model_runner import prepare_decode
from nanovllm.layers.context import get_context, reset_context
from nanovllm.sampling_params import SamplingParams


def decoding(tokens: list[int], block_table: list[int]) -> Sequence:
    """A sequence of ``tokens`` whose last token is the one this decode step computes."""
    # zh: 一个由 ``tokens`` 组成的序列，它的最后一个 token 就是这个 decode 步要计算的。
    seq = Sequence(tokens, SamplingParams(), block_size=4)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = block_table, len(tokens) - 1, 1
    return seq


step = [decoding(list(range(10, 16)), [3, 8]), decoding(list(range(20, 31)), [0, 1, 5]), decoding([7, 8, 9], [2])]
loaded = DecodeBuffers.allocate(rows=8, max_blocks=4, device="cpu")
loaded.load(*prepare_decode(step, block_size=4), get_context(), graph_batch=4)
reset_context()
staged = DecodeBuffers.allocate(rows=8, max_blocks=4, device="cpu")
DecodeStaging(staged, block_size=4).stage(step, graph_batch=4)
print(say("one copy of {sent} of the buffers' {total} bytes; the same bytes as load: {same}",
          sent=staged.prefix_bytes(4), total=staged.storage.numel(), same=torch.equal(loaded.storage, staged.storage)))
assert torch.equal(loaded.storage, staged.storage)
assert staged.slot_mapping[:4].tolist() == [8 * 4 + 1, 5 * 4 + 2, 2 * 4 + 2, -1]

# %% [markdown] tags=["en"]
# ## Build it: the sampler inside the captured step
#
# With its inputs in one copy, a decode step that a graph covers still launched from the host,
# after the graph: the LM head (a cuBLAS call), the sampler's input (a tensor of temperatures
# built from Python and copied over), the sampler's two Triton kernels (chapter 12), then the copy
# of the tokens to the host. All but the last can be captured as well. `SamplingGraphs` captures,
# for each bucket of the model's graphs, the LM head over the graph's output rows and the race
# kernels over a buffer of temperatures, writing the tokens into a buffer of its own. A step whose
# rows all sample plainly (no top-k, top-p, seed or fork; `plain_temperatures` tells) replays it
# right after the model's graph: the host launches two graphs and one copy, nothing else.
#
# A kernel that runs from a graph runs with the arguments it was captured with, so a seed drawn
# on the host at capture would give every step the same noise. The key lives on the device
# instead, in a one-element tensor that the kernel reads when it runs (chapter 12's
# `SEED_IN_MEMORY`), and the graph itself adds one to it after each draw: every replay races with
# a new key. The temperatures must be in their buffer before the replay; they are copied only when
# they change (a request joins or leaves the batch), which for a steady batch is never. Rows with
# top-k, top-p or a seed keep the eager sampler, which needs the host: its filters sort the
# vocabulary only when some row asks for them, and a seeded row's generator is a host object.
#
# Every replay writes its tokens into the same buffer. That is safe because whatever reads a
# step's tokens is queued behind that step and before the next sampling replay: the copy to the
# host, and the next step's `write_pending`. The setting `sample_in_graph` ("auto": on with CUDA
# graphs and one rank) turns it on; under tensor parallelism the LM head gathers its slices to
# rank 0 (chapter 16), and that gather stays out of these graphs.

# %% [markdown] tags=["zh"]
# ## 动手：把采样器放进捕获的一步
#
# 输入已经一次拷贝就位，但一个图能覆盖的 decode 步，在图之后仍要从主机发起：LM head（一次 cuBLAS 调用）、采样器的
# 输入（用 Python 构建、再拷贝过去的温度张量）、采样器的两个 Triton 内核（第 12 章），最后是把 token 拷回主机。除了
# 最后一项，这些都可以一并捕获。`SamplingGraphs` 为模型的图的每个档位捕获一个图：对图的输出行做 LM head，再对一个
# 温度缓冲区运行赛跑内核，把 token 写进它自己的缓冲区。如果一步的所有行都是普通采样（没有 top-k、top-p、种子或分叉；
# 由 `plain_temperatures` 判断），就在模型的图之后紧接着重放它：主机只发起两个图和一次拷贝，别的什么都不做。
#
# 从图里运行的内核，用的是捕获时的参数，所以在捕获时从主机抽取的种子会让每一步都得到同样的噪声。于是密钥改放在设备
# 上的一个单元素张量里，内核在运行时才读取它（第 12 章的 `SEED_IN_MEMORY`），并由图自己在每次抽样之后把它加一：每次
# 重放都用新的密钥赛跑。温度必须在重放之前就在缓冲区里；只有它们变化时（有请求加入或离开批次）才拷贝，批次稳定时
# 一次也不拷。带 top-k、top-p 或种子的行仍走 eager 的采样器，它离不开主机：只有某行需要时，它的过滤才对词表排序，
# 而带种子的行所用的生成器是主机上的对象。
#
# 每次重放都把 token 写进同一个缓冲区。这是安全的，因为读取一步 token 的操作都排在这一步之后、下一次采样重放之前：
# 拷回主机的那次拷贝，以及下一步的 `write_pending`。设置项 `sample_in_graph`（"auto"：有 CUDA Graph 且只有一个 rank
# 时打开）控制它；张量并行时，LM head 要把各个分片收集到 rank 0（第 16 章），这次收集留在这些图之外。

# %% sampling graphs
#| export engine.cuda_graphs
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.engine.cuda_graphs import CudaGraphRunner
from nanovllm.engine.sequence import Sequence


def plain_temperatures(seqs: list[Sequence]) -> list[float] | None:
    """The temperature of each row of a decode step when every row samples plainly (no top-k, top-p, seed or sibling
    to fork: what the sampler's fast path draws), else None."""
    # zh: 如果一个 decode 步的每一行都是普通采样（没有 top-k、top-p、种子或要分叉的兄弟：采样器快速路径所抽的那种），
    # zh: 返回每一行的温度，否则返回 None。
    temperatures = []
    for seq in seqs:
        params = seq.sampling_params
        if (params.top_k or 0) > 0 or params.top_p < 1.0 or params.seed is not None or seq.pending_forks:
            return None
        temperatures.append(params.temperature)
    return temperatures


class SamplingGraphs:
    """The LM head and the plain sampler captured for each bucket of the model's decode graphs: a decode step whose
    rows all sample plainly takes its tokens from one more replay, with no kernel launched from the host."""
    # zh: 为模型每个 decode 图的档位捕获 LM head 和普通采样器：所有行都是普通采样的 decode 步，再多重放一次就得到它的
    # zh: token，不用从主机启动任何内核。

    def __init__(self, model: nn.Module, graphs: CudaGraphRunner, sample_plain: Callable[..., torch.Tensor]) -> None:
        # en: sample_plain: chapter 12's race kernels, which take the key as a tensor (seed=).
        # zh: sample_plain：第 12 章的赛跑内核，它接受以张量形式传入的密钥（seed=）。
        self.model, self.graphs, self.sample_plain = model, graphs, sample_plain
        rows, device = graphs.sizes[-1], graphs.device
        # en: [rows] float32, row i's temperature; `staged`: the values the buffer holds, as the host last wrote them.
        # zh: [rows] float32，第 i 行的温度；`staged`：缓冲区里现有的值，即主机上次写入的那些。
        self.temperatures = torch.zeros(rows, dtype=torch.float32, device=device)
        self.staged: list[float] = []
        # en: The Philox key, drawn once from torch's CPU generator; every replay reads it, then adds one.
        # zh: Philox 密钥，从 torch 的 CPU 生成器抽取一次；每次重放都读取它，然后加一。
        self.seed = torch.tensor([2**32 + int(torch.randint(2**62, ()))], device=device)
        # en: [rows] int64: the step's tokens (NON_FINITE for a row whose logits are not numbers).
        # zh: [rows] int64：这一步的 token（logits 不是数的行为 NON_FINITE）。
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.by_size: dict[int, torch.cuda.CUDAGraph] = {}

    def draw(self, size: int) -> None:
        """What a replay of the ``size`` bucket does: the LM head over the model graph's first ``size`` output rows,
        the race, the key's increment."""
        # zh: 重放 ``size`` 档位时做的事：对模型图前 ``size`` 个输出行做 LM head，赛跑，密钥加一。
        logits = self.model.compute_logits(self.graphs.outputs[:size])
        self.tokens[:size] = self.sample_plain(logits, self.temperatures[:size], seed=self.seed)
        self.seed += 1

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size of the model's graphs, largest first, into their memory pool."""
        # zh: 按从大到小的顺序捕获模型的图的每个档位，放进它们的内存池。
        for size in reversed(self.graphs.sizes):
            # en: A warm-up outside the recording compiles the kernels' variant that reads the key from memory.
            # zh: 录制之外的一次预热，编译出从内存读取密钥的那个内核变体。
            self.draw(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.graphs.pool):
                self.draw(size)
            self.by_size[size] = graph
        torch.cuda.synchronize()

    def sample(self, temperatures: list[float]) -> torch.Tensor:
        """The tokens [n] of the decode step whose model graph (of n = len(temperatures) rows) was just replayed,
        row i drawn at temperatures[i]: a view of this object's buffer, which the next call overwrites."""
        # zh: 刚刚重放了模型图（n = len(temperatures) 行）的那个 decode 步的 token [n]，第 i 行以 temperatures[i]
        # zh: 抽取：它是本对象缓冲区的一个视图，下一次调用会覆盖它。
        n = len(temperatures)
        if temperatures != self.staged:
            # en: From pageable memory: the driver stages the values before the call returns, so the list may go.
            # zh: 从可分页内存拷贝：调用返回前驱动已把这些值暂存好，所以这个列表可以随即释放。
            self.temperatures[:n].copy_(torch.tensor(temperatures, dtype=torch.float32), non_blocking=True)
            self.staged = temperatures
        self.by_size[self.graphs.bucket(n)].replay()
        return self.tokens[:n]

# %% setting: sample in graph
#| export config
from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.config import Config


# en: Sample plain decode rows inside captured graphs (SamplingGraphs): True, False, or "auto": on for CUDA with one
# en: rank and graphs allowed.
# zh: 在捕获的图里为普通的 decode 行采样（SamplingGraphs）：True、False，或 "auto"：CUDA、单个 rank 且允许使用图时打开。
@add_fields(Config)
class _SampleInGraph:
    sample_in_graph: bool | str = "auto"


@add_to_init(Config)
def _resolve_sample_in_graph(self) -> None:
    one_rank_graphs = self.device == "cuda" and self.tensor_parallel_size == 1 and not self.enforce_eager
    if self._resolve_switch("sample_in_graph", one_rank_graphs) and not one_rank_graphs:
        raise ValueError("sample_in_graph=True needs CUDA graphs on one rank (device 'cuda', "
                         "tensor_parallel_size=1, enforce_eager=False)")

# %% [markdown] tags=["en"]
# ### Check it: which steps sample in the graph
#
# A plain batch gives its temperatures (greedy rows too: temperature 0 is the race without noise);
# one row with top-p, or a seed, sends the whole step to the eager sampler. On a GPU the tests
# compare the engine's greedy tokens with and without `sample_in_graph` and check that two replays
# draw different noise; a CPU has no graphs, and the setting refuses to be forced on there.

# %% [markdown] tags=["zh"]
# ### 验证：哪些步在图里采样
#
# 普通的批次给出它的温度（贪心行也算：温度 0 就是不加噪声的赛跑）；只要有一行带 top-p 或种子，整步就交给 eager 的
# 采样器。在 GPU 上，测试比较开启与关闭 `sample_in_graph` 时引擎的贪心 token，并检查两次重放抽到的噪声不同；CPU 上
# 没有图，在那里强行打开这个设置会被拒绝。

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import plain_temperatures


def decoding_with(params: SamplingParams) -> Sequence:
    """A sequence of three tokens whose last one this decode step computes, with these sampling parameters."""
    # zh: 一个三个 token 的序列，这个 decode 步计算它的最后一个 token，带着这些采样参数。
    seq = Sequence([1, 2, 3], params, block_size=4)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = [0], 2, 1
    return seq


plain = [decoding_with(SamplingParams(temperature=0.0)), decoding_with(SamplingParams(temperature=0.7))]
print(say("plain batch: {temperatures}", temperatures=plain_temperatures(plain)))
assert plain_temperatures(plain) == [0.0, 0.7]
for odd in (SamplingParams(top_p=0.9), SamplingParams(top_k=20), SamplingParams(seed=1)):
    assert plain_temperatures([*plain, decoding_with(odd)]) is None
try:
    Config.from_kwargs(build_tiny_model("qwen3"), device="cpu", sample_in_graph=True)
    refused = False
except ValueError as error:
    refused = "needs CUDA graphs on one rank" in str(error)
print(say("on a CPU, sample_in_graph=True is refused: {refused}", refused=refused))
assert refused

# %% [markdown] tags=["en"]
# Recorded on an H100 (2026-12-06, `scripts/probes/sample_in_graph_ab.py`: the latency benchmark's
# rows with the setting off and on, in turns, two runs of each). The host's time per step, its
# wall time less its wait for the GPU, halved at every batch: 0.527 → 0.256 ms at batch 1, 0.734 →
# 0.369 ms at batch 16. The step did not get faster: 0.798 and 0.804 ms at batch 1, because the
# GPU was busy 0.796 ms of it. The host had already been hidden behind the GPU by asynchronous
# scheduling; now it is hidden with room to spare, and what is left to shorten is the GPU's own
# work: the decode graph, and the LM head that reads 311 MB of weights every step.

# %% [markdown] tags=["zh"]
# 在 H100 上记录（2026-12-06，`scripts/probes/sample_in_graph_ab.py`：延迟基准测试的各行，这个设置关与开轮流进行，
# 各跑两次）。主机每步的时间（一步的墙钟时间减去等 GPU 的时间）在每个批大小下都减半了：批大小 1 时从 0.527 ms 降到
# 0.256 ms，批大小 16 时从 0.734 ms 降到 0.369 ms。一步并没有变快：批大小 1 时分别是 0.798 ms 和 0.804 ms，因为其中
# 0.796 ms GPU 都在忙。异步调度早已把主机藏在 GPU 后面；现在藏得绰绰有余，剩下要缩短的是 GPU 自己的工作：decode 图，
# 以及每步都要读 311 MB 权重的 LM head。

# %% recorded: sampling in the graph
graph_sampling = runs["sampling in the graph"]
print(say("{date}, {card}: {command}", date=graph_sampling.date, card=graph_sampling.card,
          command=graph_sampling.command))
figures = graph_sampling.figures
for i, batch in enumerate(figures["batches"]):
    print(say("  batch {batch:2d}: host {off:.3f} -> {on:.3f} ms, step {step_off:.3f} -> {step_on:.3f} ms, "
              "GPU busy {busy:.3f} ms", batch=batch, off=figures["host ms, off"][i], on=figures["host ms, on"][i],
              step_off=figures["step ms, off"][i], step_on=figures["step ms, on"][i],
              busy=figures["GPU busy ms, on"][i]))
    # en: The host's time at least halved; the step within 1 % of the GPU's busy time or of the step before.
    # zh: 主机的时间至少减半；一步与 GPU 的忙碌时间、或与改动前的一步相差不到 1 %。
    assert figures["host ms, on"][i] <= 0.56 * figures["host ms, off"][i]
    assert abs(figures["step ms, on"][i] / figures["step ms, off"][i] - 1) < 0.01
assert figures["host ms, on"][0] < 0.3 and figures["GPU busy ms, on"][0] / figures["step ms, on"][0] > 0.98

# %% [markdown] tags=["en"]
# A road not taken: persistent inputs. vLLM's Model Runner V2 keeps each request's block table in
# a row on the device that lives as long as the request, and builds a step's inputs from those rows
# with small kernels. We built the same here (a state whose rows a captured gather turns into the
# graph's buffers; the host uploads only what changed) and measured it on an H100 against this
# chapter's staging, in turns. It lost at every batch size: 0.97x the staging's step rate at batch
# 1, 0.99x at 64. The gather added twelve kernels to every step, and the host's time did not fall,
# because since sampling moved into the graph the host is not what a step waits for: at batch 1
# the GPU was busy 0.793 ms of a 0.802 ms step. The host's side alone shrank from 27.0 µs to
# 20.2 µs. Seven microseconds saved where the host is already hidden do not pay for twelve kernels
# where it is not, so the staging stays. Persistent rows become worth trying again when the host
# shows in a step once more, for instance when verify steps are prepared while a step runs.

# %% [markdown] tags=["zh"]
# 一条没有走的路：持久化的输入。vLLM 的 Model Runner V2 把每个请求的块表放在设备上的一行里，这一行与请求同生共死，
# 一步的输入由小 kernel 从这些行里构建出来。我们在这里也做了同样的东西（一份状态，由一次捕获的 gather 把它的各行变成
# 图的缓冲区；主机只上传变化了的部分），并在 H100 上与本章的暂存轮流对比测量。它在每个批大小下都输了：批大小 1 时
# 每秒步数是暂存的 0.97 倍，批大小 64 时是 0.99 倍。gather 给每一步多加了十二个 kernel，而主机的时间没有下降，因为
# 自从采样进了图，一步等的就不是主机了：批大小 1 时，0.802 ms 的一步里 GPU 忙了 0.793 ms。单看主机这一侧，时间从
# 27.0 µs 缩到 20.2 µs。在主机本已被藏住的地方省下七微秒，抵不上在没被藏住的地方多出的十二个 kernel，所以暂存留下。
# 等主机再次在一步里露出来，比如验证步要在一步运行时就准备好的时候，持久化的行才值得再试。

# %% recorded: persistent inputs, rejected
persistent = runs["persistent inputs, rejected"]
print(say("{date}, {card}: {command}", date=persistent.date, card=persistent.card, command=persistent.command))
figures = persistent.figures
step_rates = [off / on for off, on in zip(figures["step ms, off"], figures["step ms, on"], strict=True)]
for i, batch in enumerate(figures["batches"]):
    print(say("  batch {batch:2d}: step {off:.3f} -> {on:.3f} ms ({ratio:.2f}x), "
              "host {host_off:.3f} -> {host_on:.3f} ms, kernels {kernels_off} -> {kernels_on}", batch=batch,
              off=figures["step ms, off"][i], on=figures["step ms, on"][i], ratio=step_rates[i],
              host_off=figures["host ms, off"][i],
              host_on=figures["host ms, on"][i], kernels_off=figures["kernels, off"][i],
              kernels_on=figures["kernels, on"][i]))
# en: Slower at every batch, with twelve more kernels a step, against a step that the GPU's work already fills.
# zh: 每个批大小下都更慢，每步多十二个 kernel，而这一步本来就被 GPU 的工作填满了。
assert [round(rate, 2) for rate in step_rates] == [0.97, 0.98, 0.98, 0.99]
assert all(on - off == 12 for off, on in zip(figures["kernels, off"], figures["kernels, on"], strict=True))
assert figures["GPU busy ms, off"][0] / figures["step ms, off"][0] > 0.98
staging = figures["host staging us, batch 1"]
assert staging["DecodeState.send"] < staging["DecodeStaging.stage"] < staging["DecodeState.send"] + 7.0


# %% [markdown] tags=["en"]
# The runner's share. `launch` does what `run` did, without waiting: the forward, the sampling
# of the rows that want a token (`sample`, chapter 09), and `SampledTokens.start`. With tensor
# parallelism (chapter 17) rank 0 alone has logits and samples; `share_from_rank0` broadcasts its
# tokens on the device, so that every rank holds the step's samples and can feed a pending token
# to the next step by itself. `compute_logits`, rewritten once more, takes `previous`, the step
# whose samples are this step's pending tokens. A decode step that a graph covers takes the staged
# path, `replay_staged`: it stages its inputs in one copy, writes its pending tokens from
# `previous` on the device and replays the graph. Every other decode step builds its inputs as
# before, then gathers its pending tokens from `previous`, on the device too. A prefill never
# starts before its last token is known (the engine never schedules one; `launch` asserts it).
# `run` is `launch` followed by `token_ids()`.

# %% [markdown] tags=["zh"]
# 执行器的部分。`launch` 做 `run` 做过的事，只是不等待：前向计算、为需要 token 的行采样（`sample`，第 09 章），以及
# `SampledTokens.start`。在张量并行下（第 17 章），只有 rank 0 有 logits 并做采样；`share_from_rank0` 在设备上广播
# 它的 token，于是每个 rank 都持有这一步的采样结果，能自己把待定 token 喂给下一步。再次重写的 `compute_logits` 接收
# `previous`，即这一步的待定 token 所来自的那一步。能被某个图覆盖的 decode 步走暂存路径 `replay_staged`：用一次拷贝
# 暂存它的输入，在设备上从 `previous` 写入待定 token，再重放图。其他 decode 步照旧构建输入，然后同样在设备上从
# `previous` 取来待定 token。prefill 在它的最后一个 token 已知之前绝不会开始（引擎从不这样调度；`launch` 断言这一点）。
# `run` 就是 `launch` 之后紧跟 `token_ids()`。

# %% runner launches
#| export engine.model_runner
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.cuda_graphs import DecodeStaging, SamplingGraphs, plain_temperatures
from nanovllm.engine.model_runner import ModelRunner, prepare_decode, prepare_prefill
from nanovllm.layers.context import reset_context
from nanovllm.layers.linear import share_from_rank0


@add_to_init(ModelRunner)
def _init_staging(self) -> None:
    # en: Built at the first decode step that replays a graph, over the graphs' buffers.
    # zh: 在第一个重放图的 decode 步建立，覆盖图的缓冲区。
    self.staging: DecodeStaging | None = None
    # en: The sampler captured after the model's graphs, for decode steps whose rows all sample plainly.
    # zh: 在模型的图之后捕获的采样器，供所有行都是普通采样的 decode 步使用。
    self.sampling_graphs: SamplingGraphs | None = None
    if self.config.sample_in_graph and self.graphs is not None:
        self.sampling_graphs = SamplingGraphs(self.model, self.graphs, self.sampler.sample_plain)
        self.sampling_graphs.capture()


@add_to_class(ModelRunner)
@torch.inference_mode()
def compute_logits(
    self, seqs: list[Sequence], is_prefill: bool, previous: SampledTokens | None = None
) -> torch.Tensor | None:
    """The forward of one step: one row of logits per sequence, its last computed token's. ``previous``: the step
    still computing this step's last tokens (its `SampledTokens`), None when every last token is known."""
    # zh: 一步的前向计算：每个序列一行 logits，取自它最后计算的那个 token。``previous``：仍在计算这一步最后那些
    # zh: token 的那一步（它的 `SampledTokens`），每个最后的 token 都已知时为 None。
    pending = self.begin_step(seqs, previous)
    if not is_prefill and self.graphs is not None and self.graphs.covers(len(seqs)):
        return self.model.compute_logits(self.replay_staged(seqs, previous if pending else None))
    prepare = prepare_prefill if is_prefill else prepare_decode
    try:
        input_ids, positions = prepare(seqs, self.block_size, self.device)
        if pending:
            input_ids = previous.input_ids_for(seqs, input_ids)
        return self.model.compute_logits(self.model(input_ids, positions))
    finally:
        reset_context()


@add_to_class(ModelRunner)
def begin_step(self, seqs: list[Sequence], previous: SampledTokens | None) -> bool:
    """Refuse a step that this runner cannot run, and make the step's copy-on-write copies; whether a last token of
    ``seqs`` is still pending (then ``previous`` samples it)."""
    # zh: 拒绝这个执行器无法运行的一步，并完成这一步的写时复制拷贝；返回 ``seqs`` 中是否还有最后的 token 处于待定状态
    # zh: （这时由 ``previous`` 采样它）。
    if self.stopped:
        raise RuntimeError("this model runner was stopped (exit() was called)")
    assert all(len(s) <= self.config.max_model_len for s in seqs), "a sequence is longer than max_model_len"
    pending = any(seq.last_token == PENDING_TOKEN for seq in seqs)
    assert not pending or previous is not None, "a last token is still pending: pass the step that samples it"
    self.copy_blocks(seqs)
    return pending


@add_to_class(ModelRunner)
def replay_staged(self, seqs: list[Sequence], previous: SampledTokens | None) -> torch.Tensor:
    """Hidden states of a decode step that a graph covers: its inputs staged in one copy, the pending tokens written
    from ``previous`` on the device, then the graph replayed (what `CudaGraphRunner.replay` did with some twenty
    torch operations, in two)."""
    # zh: 一个图能覆盖的 decode 步的隐藏状态：它的输入一次拷贝就位，待定 token 在设备上从 ``previous`` 写入，
    # zh: 然后重放图（`CudaGraphRunner.replay` 用二十来个 torch 操作做的事，这里用两个）。
    if self.staging is None:
        self.staging = DecodeStaging(self.graphs.buffers, self.block_size)
    self.staging.stage(seqs, self.graphs.bucket(len(seqs)))
    if previous is not None:
        previous.write_pending(seqs, self.graphs.buffers.input_ids[: len(seqs)])
    return self.graphs.replay_loaded(len(seqs))


@add_to_class(ModelRunner)
@torch.inference_mode()
def launch(self, seqs: list[Sequence], is_prefill: bool, previous: SampledTokens | None = None) -> SampledTokens:
    """Queue one step on the device and return without waiting for it. ``previous``: see `compute_logits`. A
    decode step that a graph covers and whose rows all sample plainly samples inside the captured step
    (`SamplingGraphs`)."""
    # zh: 把一步排进设备的队列，不等它就返回。``previous``：见 `compute_logits`。图能覆盖、且所有行都是普通采样的
    # zh: decode 步，在捕获的一步里完成采样（`SamplingGraphs`）。
    assert not is_prefill or PENDING_TOKEN not in (s.last_token for s in seqs), "a prefill before its last token"
    if not is_prefill and self.sampling_graphs is not None and self.graphs is not None \
            and self.graphs.covers(len(seqs)):
        temperatures = plain_temperatures(seqs)
        if temperatures is not None:
            pending = self.begin_step(seqs, previous)
            # en: The model's graph writes the hidden states that the sampling graph reads (graphs.outputs).
            # zh: 模型的图写出隐藏状态，采样的图读取它们（graphs.outputs）。
            self.replay_staged(seqs, previous if pending else None)
            return SampledTokens.start(seqs, list(range(len(seqs))), self.sampling_graphs.sample(temperatures))
    logits = self.compute_logits(seqs, is_prefill, previous)
    rows, sampled = self.sample(seqs, logits)
    sampled = share_from_rank0(sampled, len(rows) + len(sibling_samples(seqs)), self.device)
    # en: Only the rank that sampled needs the tokens on the host (the others never read them there).
    # zh: 只有做了采样的 rank 需要把 token 拷回主机（其他 rank 从不在主机上读它们）。
    return SampledTokens.start(seqs, rows, sampled, to_host=logits is not None)


@add_to_class(ModelRunner)
def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
    """Compute one step: one sampled token per sequence (NOT_SAMPLED for a partial prefill chunk), then the
    first token of each sibling the step forks."""
    # zh: 计算一步：每个序列采样一个 token（prefill 的部分分块为 NOT_SAMPLED），然后是这一步分叉出的
    # zh: 每个兄弟序列的第一个 token。
    return self.launch(seqs, is_prefill).token_ids()

# %% [markdown] tags=["en"]
# ## Build it: ranks that keep the last steps
#
# With tensor parallelism (chapter 17) the driver queues step *n + 1* on every rank before it
# collects step *n*. A pending token has no value the driver could send, so each rank takes it
# from its own copy of rank 0's samples: `launch` broadcast them on the device, and each rank
# keeps the samples of its last few steps (`recent`, by call number). A step names the call
# whose samples are its pending tokens (`previous`), and a `TPStep` (the driver's handle of a
# queued step, in place of `SampledTokens`) collects rank 0's tokens when the engine asks for
# them. The rank's reply to a call, sent by its reply thread, waits for the device there, never
# in the loop that receives the next call.

# %% [markdown] tags=["zh"]
# ## 动手：记住最近几步的 rank
#
# 在张量并行下（第 17 章），驱动进程在收取第 *n* 步之前就把第 *n + 1* 步排进每个 rank 的队列。待定 token 没有可以
# 由驱动进程发送的值，所以每个 rank 从自己那份 rank 0 的采样结果里取它：`launch` 已在设备上广播了这些结果，每个
# rank 按调用编号保存最近几步的采样结果（`recent`）。一步会指明它的待定 token 来自哪一次调用（`previous`）；
# `TPStep`（驱动进程手中代表一个已入队步骤的句柄，取代 `SampledTokens`）在引擎需要时收取 rank 0 的 token。rank 对
# 一次调用的回复由它的回复线程发送，等待设备的事发生在那里，绝不发生在接收下一次调用的循环里。

# %% ranks keep recent steps
#| export engine.tp_runtime
import pickle
from dataclasses import dataclass
from typing import Any

import nanovllm.engine.tp_runtime as tp_runtime
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_runtime import RankWorker, TPRunner, step_states
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.interrupts import deferred_interrupt

# en: Recent steps whose samples a later step may take its pending tokens from.
# zh: 后面的步骤可能从中取待定 token 的最近几步。
RankWorker.KEEP_STEPS = 8


@add_to_init(RankWorker)
def _init_recent(self) -> None:
    # en: The sampled tokens of the last KEEP_STEPS steps, by call number.
    # zh: 最近 KEEP_STEPS 步采样出的 token，按调用编号存放。
    self.recent: dict[int, SampledTokens] = {}


@add_to_class(RankWorker)
def run(
    self,
    states: list[tuple],
    is_prefill: bool,
    previous: int | None = None,
    params: tuple[dict[int, SamplingParams], list[int]] | None = None,
) -> SampledTokens | None:
    """Queue one step; rank 0 (which receives the sampling params) returns its tokens, the others None.

    ``states``: the step's sequences (`step_states`). ``previous``: the call of the step whose samples are
    this step's pending tokens, or None. ``params`` (rank 0 only): the sampling params of new sequences, and
    the ids of finished ones to forget.
    """
    # zh: 把一步排进队列；rank 0（它收到采样参数）返回它的 token，其他 rank 返回 None。
    # zh:
    # zh: ``states``：这一步的序列（`step_states`）。``previous``：其采样结果是这一步待定 token 的那一步的调用，
    # zh: 或者 None。``params``（只有 rank 0）：新序列的采样参数，以及要忘掉的已结束序列的 id。
    seqs = self._sequences(states, params)
    before = None if previous is None else self._samples_of(previous)
    step = self.runner.launch(seqs, is_prefill, before)
    # en: Every rank keeps the step's samples (rank 0's, broadcast): a later step may need them.
    # zh: 每个 rank 都留着这一步的采样结果（rank 0 广播来的）：之后的某一步可能要用。
    self.recent[self.call_no] = step
    self.recent.pop(self.call_no - self.KEEP_STEPS, None)
    return step if self.rank == 0 else None


@add_to_class(RankWorker)
def _samples_of(self, call: int) -> SampledTokens:
    """The samples of an earlier step."""
    # zh: 之前某一步的采样结果。
    samples = self.recent.get(call)
    if samples is None:
        raise RuntimeError(f"call {self.call_no} takes its pending tokens from call {call}, which this rank "
                           f"no longer holds")
    return samples


@add_to_class(tp_runtime)
def reply_value(result: Any) -> Any:
    """What a call's reply carries: its result, and for a queued step its tokens (waiting for the device)."""
    # zh: 一次调用的回复所携带的东西：它的结果；对于排进队列的步，还有它的 token（等待设备算出）。
    return result.token_ids() if isinstance(result, SampledTokens) else result


@dataclass
class TPStep:
    """A step queued on every rank (`TPRunner.launch`); `token_ids()` waits for rank 0's tokens.

    It stands where `SampledTokens` stands in the engine: the engine passes it back as the
    ``previous`` of the next step, and the ranks take the pending tokens from their own copy of its samples.
    """
    # zh: 排进每个 rank 队列的一步（`TPRunner.launch`）；`token_ids()` 等待 rank 0 的 token。
    # zh:
    # zh: 它在引擎里的位置就是 `SampledTokens` 的位置：引擎把它作为下一步的 ``previous`` 传回来，
    # zh: 各 rank 从自己那份采样结果的副本里取出待定 token。

    runner: TPRunner
    call: int
    tokens: list[int] | None = None

    def token_ids(self) -> list[int]:
        if self.tokens is None:
            self.tokens = self.runner.collect(self.call)[0]
        return self.tokens


@add_to_class(TPRunner)
def launch(self, seqs: list[Sequence], is_prefill: bool, previous: TPStep | None = None) -> TPStep:
    """Queue one step on every rank and return at once; ``previous``: the step whose samples are this step's
    pending tokens. Every rank has them: nothing waits for rank 0."""
    # zh: 把一步排进每个 rank 的队列，立即返回；``previous``：其采样结果是这一步待定 token 的那一步。
    # zh: 每个 rank 都有这些结果：没有什么要等 rank 0。
    before = None if previous is None else previous.call
    # en: as in the synchronous run: the params and their call go together
    # zh: 与第 17 章的 run 一样：采样参数和携带它们的那次调用同进同退。
    with deferred_interrupt():
        params = pickle.dumps(self._params_update(seqs), protocol=pickle.HIGHEST_PROTOCOL)
        call = self.post("run", step_states(seqs), is_prefill, before, rank0_extra=params)
    return TPStep(self, call)


@add_to_class(TPRunner)
def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
    """One step on every rank; rank 0's sampled tokens."""
    # zh: 在每个 rank 上运行一步；返回 rank 0 采样出的 token。
    return self.launch(seqs, is_prefill).token_ids()

# %% [markdown] tags=["en"]
# ## Build it: the engine keeps one step in flight
#
# On the H200 the host needs time of its own at every decode step of the benchmark: scheduling,
# building the inputs, reading the tokens back, postprocessing. One after the other, the GPU idles
# for that time at every step: the whole workload took 7.01 s that way, against 6.19 s once
# `step()` changes its order (vLLM calls this *async scheduling*; both measured in one process by
# `scripts/profile_engine.py`, chapter 14): it first schedules step *n + 1* and queues it on the
# GPU, and only then waits for step *n*'s tokens and records them, while the GPU is already
# computing *n + 1*.
#
# ```
# host:  schedule n+1 | queue n+1 | wait n | resolve n | schedule n+2 | queue n+2 | wait n+1 | ...
# GPU:   ...... step n ......... | .............. step n+1 ............. | ...... step n+2 ...
# ```
#
# Three pieces make it work, two of them built above:
#
# - **The scheduler needs counts, not values.** `Scheduler.advance` counts a step as soon as it
#   is queued: every sequence gets a *pending* token, its length grows, and the next schedule
#   allocates blocks as usual. `Scheduler.resolve` fills in the values later and applies EOS.
# - **The next inputs stay on the GPU.** The pending tokens are the previous step's samples:
#   `ModelRunner.launch` returns them as `SampledTokens`, whose `input_ids_for` gathers them on
#   the device; no token value has to travel through the host first.
# - **No copy waits for the GPU.** Every host-to-device copy goes through pinned memory
#   (chapter 07's `host_to_device`), because an ordinary one would wait for the queued step.
#
# The engine's share is small. Chapter 10's `_step` becomes `_launch` (schedule, hand the step to
# the runner with `_compute`, `advance`; the result is a `LaunchedStep`) followed by `_collect`
# (wait for the tokens, `resolve`). The synchronous engine calls them back to back; the
# asynchronous one launches step *n + 1*, then collects step *n*, which waited in `in_flight`. A
# call of `step()` therefore reports the step before the one it queued (the first reports
# nothing), and the engine is finished only when nothing is in flight either.
#
# Four places leave hooks for later chapters. `_compute` wraps the runner's work in
# `_undone_on_failure`, which chapter 20 fills to undo a step that fails. `_step` asks
# `next_step_waits` whether the next step needs the tokens in flight before it can be scheduled (no,
# here; chapter 25's verify steps do). And a step in which the sampler marked a row whose logits are
# not numbers (`NON_FINITE`, chapter 08) goes to `_collect_non_finite`, which stops the engine here;
# chapter 20 fills it to record the other rows and drop only that request. Chapter 20 also fills
# `is_finished`'s `_left_to_report`: what a `generate` call finished for `add_request`, or dropped,
# that `step` has not reported yet.
#
# The price is small too. A sequence that ends on EOS in step *n* was already scheduled in step
# *n + 1*: that token is computed for nothing and dropped (`Sequence.truncate`), and if the
# sequence was preempted in the meantime it finishes straight from `waiting` (the arrow added
# above). The tokens are the same as the synchronous engine's: the test suite compares both under
# every scheduling regime, with sequences ending on EOS mid-batch.
#
# `async_scheduling="auto"` turns it on for CUDA, with one rank or several. On a CPU there is
# nothing to overlap with (PyTorch runs CPU ops as they are called); it can still be turned on,
# which is how the tests check it there. The run recorded below is what it bought on the H200 with
# one GPU; chapter 17 carries it over to several ranks.

# %% [markdown] tags=["zh"]
# ## 动手：引擎让一步始终在计算中
#
# 在 H200 上，基准负载的每个 decode 步，主机自己也要花一段时间：调度、构造输入、把 token 读回来、后处理。两者
# 一前一后，GPU 每一步都要空等这段时间：这样跑完整个负载要 7.01 s，而让 `step()` 换了顺序之后只要 6.19 s（vLLM
# 称之为*异步调度*；两者由 `scripts/profile_engine.py` 在同一个进程中测得，见第 14 章）：先调度第 *n + 1* 步并把它
# 排进 GPU 队列，然后才等待第 *n* 步的 token 并记录它们，而这时 GPU 已经在计算第 *n + 1* 步了。
#
# ```
# 主机：调度 n+1 | 排队 n+1 | 等待 n | 解析 n | 调度 n+2 | 排队 n+2 | 等待 n+1 | ...
# GPU： ...... 第 n 步 ...... | ........... 第 n+1 步 ........... | ...... 第 n+2 步 ...
# ```
#
# 有三处设计让它成为可能，其中两处上面已经建好：
#
# - **调度器需要的是数量，而不是值。** `Scheduler.advance` 在一步排进队列后立即把它计入：每个序列得到一个*待定*
#   token，长度随之增加，下一次调度照常分配块。`Scheduler.resolve` 稍后填入 token 的值，并处理 EOS。
# - **下一步的输入留在 GPU 上。** 待定 token 就是上一步的采样结果：`ModelRunner.launch` 把它们作为 `SampledTokens`
#   返回，它的 `input_ids_for` 在设备上把它们取过来；没有哪个 token 的值需要先经过主机。
# - **没有拷贝会等待 GPU。** 每次从主机到设备的拷贝都经过锁页内存（第 07 章的 `host_to_device`），因为普通的
#   拷贝会等待排在前面的那一步。
#
# 引擎的部分很小。第 10 章的 `_step` 变成 `_launch`（调度、用 `_compute` 把这一步交给执行器、`advance`，结果是一个
# `LaunchedStep`）加上 `_collect`（等待 token、`resolve`）。同步引擎紧接着调用二者；异步引擎则先发起第 *n + 1* 步，
# 再收取一直等在 `in_flight` 里的第 *n* 步。所以每次调用 `step()` 报告的是它排队的那一步的前一步（第一次什么也
# 不报告），而且只有当没有任何一步在计算中时，引擎才算结束。
#
# 有四处为后面的章节留了接缝。`_compute` 把执行器的工作包在 `_undone_on_failure` 里，第 20 章填上它，撤销失败的一步。
# `_step` 询问 `next_step_waits`：下一步是否要等计算中那一步的 token 才能调度（这里总是"否"；第 25 章的验证步要等）。
# 采样器标记了 logits 不是数的行（`NON_FINITE`，第 08 章）的那一步交给 `_collect_non_finite`：在这里它让引擎停下；第 20
# 章填上它，记录其他行，只丢弃那个请求。第 20 章还会填上 `is_finished` 里的 `_left_to_report`：`generate` 调用为
# `add_request` 完成或丢弃、而 `step` 还没报告的东西。
#
# 代价也很小。一个在第 *n* 步遇到 EOS 的序列，已经被调度进了第 *n + 1* 步：那个 token 白算了，会被丢掉
# （`Sequence.truncate`）；如果这个序列在此期间被抢占，它就直接从 `waiting` 结束（上面新增的那条箭头）。生成的
# token 与同步引擎完全相同：测试套件在每种调度情形下比较二者，其中包括批次中途遇到 EOS 结束的序列。
#
# `async_scheduling="auto"` 在 CUDA 上打开，不论是一个 rank 还是多个。CPU 上没有什么可以重叠的（PyTorch 在调用时
# 就执行 CPU 上的运算）；不过仍然可以手动打开，测试就是这样在 CPU 上检查它的。下面记录的运行就是它在一块 H200 上
# 带来的收益；第 17 章把它推广到多个 rank。

# %% recorded: one step in flight
overlap = runs["async scheduling"]
print(say("{date}, {card}: {command}", date=overlap.date, card=overlap.card, command=overlap.command))
print(say("  the workload: {synchronous:.2f} s synchronous, {asynchronous:.2f} s asynchronous",
          synchronous=overlap.figures["synchronous s"], asynchronous=overlap.figures["asynchronous s"]))
assert overlap.figures["asynchronous s"] < overlap.figures["synchronous s"]

# %% setting: async scheduling
#| export config
from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.config import Config


# en: Queue step n + 1 before step n is collected: True, False, or "auto": on for CUDA, with one rank or several
# en: (under tensor parallelism every rank takes the pending tokens from its copy of the previous step's samples).
# zh: 在收取第 n 步之前就把第 n + 1 步排进队列：True、False，或 "auto"：CUDA 上打开，不论一个 rank 还是多个
# zh: （张量并行时，每个 rank 从自己保存的上一步采样结果中取出待定 token）。
@add_fields(Config)
class _AsyncScheduling:
    async_scheduling: bool | str = "auto"


@add_to_init(Config)
def _resolve_async_scheduling(self) -> None:
    self._resolve_switch("async_scheduling", self.device == "cuda")

# %% engine in flight
#| export engine.llm_engine
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.model_runner import SampledTokens
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_runtime import TPStep
from nanovllm.layers.sampler import NON_FINITE


@dataclass
class LaunchedStep:
    """A step the scheduler has counted (`advance`) whose tokens may still be on their way."""
    # zh: 调度器已经计入账目（`advance`）、但 token 可能还在路上的一步。

    seqs: list[Sequence]
    is_prefill: bool
    # en: tokens computed
    # zh: 计算的 token 数。
    num_tokens: int
    # en: where each sequence's new token goes (`Scheduler.advance`)
    # zh: 每个序列的新 token 放在哪里（`Scheduler.advance`）。
    indices: list[int | None]
    # en: a list when the step already ran to the end (synchronous)
    # zh: 这一步已经跑完时（同步）是一个列表。
    tokens: SampledTokens | TPStep | list[int]


@add_to_init(LLMEngine)
def _init_in_flight(self) -> None:
    # en: With asynchronous scheduling, the step the GPU may still be computing.
    # zh: 异步调度时，GPU 可能仍在计算的那一步。
    self.in_flight: LaunchedStep | None = None


@add_to_class(LLMEngine)
def next_step_waits(self) -> bool:
    """Whether the next step needs the tokens of the step in flight before it is scheduled (never here; a step whose
    schedule reads the last tokens, such as chapter 25's verify step, does)."""
    # zh: 下一步在被调度之前是否需要正在进行的那一步的 token（这里从不需要；调度时要读最后那些 token 的步，
    # zh: 比如第 25 章的验证步，才需要）。
    return False


@add_to_class(LLMEngine)
def _step(self) -> tuple[list[Sequence], int, bool]:
    """One step: the sequences it finished, the tokens it computed, whether it was a prefill. Asynchronously,
    the step it launches is not the one it reports: it queues step n + 1, then collects step n."""
    # zh: 一步：它结束的序列、它计算的 token 数、它是否为 prefill。异步时，它启动的那一步不是它报告的那一步：
    # zh: 它把第 n + 1 步排进队列，再收取第 n 步。
    waits = self.config.async_scheduling and self.next_step_waits()
    if not self.config.async_scheduling or (waits and self.in_flight is None):
        return self._collect(self._launch(previous=None))
    # en: Schedule and queue the next step before waiting for the one in flight: while the host
    # en: waits for (and then bookkeeps) step n, the GPU already computes step n + 1. A step that
    # en: waits is not queued: the one in flight is collected alone, and the next call runs it.
    # zh: 先调度并排队下一步，再等待计算中的那一步：主机等待（然后记账）第 n 步时，GPU 已经在算第 n + 1 步了。
    # zh: 需要等待的那一步不排队：先单独收取计算中的那一步，下一次调用再运行它。
    launched = None
    if not waits and (self.in_flight is None or not self.scheduler.is_finished()):
        launched = self._launch(previous=self.in_flight)
    done, self.in_flight = self.in_flight, launched
    if done is None:
        return [], 0, launched.is_prefill
    return self._collect(done)


@add_to_class(LLMEngine)
def _launch(self, previous: LaunchedStep | None) -> LaunchedStep:
    """Schedule a step, hand it to the model runner and count it; its tokens may still be computing."""
    # zh: 调度一步，交给模型执行器并计入账目；它的 token 可能还在计算中。
    seqs, is_prefill = self.scheduler.schedule()
    num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
    tokens = self._compute(seqs, is_prefill, previous)
    counted, indices = self.scheduler.advance(seqs, is_prefill)
    return LaunchedStep(counted, is_prefill, num_tokens, indices, tokens)


@add_to_class(LLMEngine)
def _compute(
    self, seqs: list[Sequence], is_prefill: bool, previous: LaunchedStep | None
) -> SampledTokens | TPStep | list[int]:
    """Hand a scheduled step to the model runner: queued behind ``previous`` (asynchronous), or run to the end."""
    # zh: 把调度好的一步交给模型执行器：排在 ``previous`` 后面（异步），或者一直运行到结束。
    with self._undone_on_failure(seqs, is_prefill):
        if self.config.async_scheduling:
            return self.model_runner.launch(seqs, is_prefill, None if previous is None else previous.tokens)
        return self.model_runner.run(seqs, is_prefill)


@add_to_class(LLMEngine)
@contextlib.contextmanager
def _undone_on_failure(self, seqs: list[Sequence], is_prefill: bool) -> Iterator[None]:
    """Around the model computing a scheduled step: what undoes the schedule if nothing comes of it (an error,
    Ctrl-C). Here nothing: the error goes through as it is."""
    # zh: 包在模型计算调度好的一步的外面：一旦这一步落空（出错、Ctrl-C），用来撤销这次调度的东西。
    # zh: 这里什么都没有：错误原样穿过。
    yield


@add_to_class(LLMEngine)
def _collect(self, step: LaunchedStep) -> tuple[list[Sequence], int, bool]:
    """Wait for a launched step's tokens and let the scheduler record them (see `_step` for the result)."""
    # zh: 等待已启动的一步的 token，让调度器记下它们（结果见 `_step`）。
    token_ids = step.tokens if isinstance(step.tokens, list) else step.tokens.token_ids()
    # en: The sampler marks a row whose logits are not numbers. Looking for the mark in
    # en: the tokens the host has read anyway costs no wait for the GPU on any step.
    # zh: 采样器会标记 logits 不是数的行（第 08 章）。在主机反正要读回的 token 里找这个标记，
    # zh: 任何一步都不必因此等待 GPU。
    if NON_FINITE in token_ids:
        return self._collect_non_finite(step, token_ids)
    return self.scheduler.resolve(step.seqs, step.indices, token_ids), step.num_tokens, step.is_prefill


@add_to_class(LLMEngine)
def _collect_non_finite(self, step: LaunchedStep, token_ids: list[int]) -> tuple[list[Sequence], int, bool]:
    """A step in which the sampler marked rows whose logits are not numbers (`NON_FINITE`): no token can be
    recorded for them, and here the engine stops."""
    # zh: 采样器把某些行标记为 logits 不是数（`NON_FINITE`）的一步：无法为这些行记下 token，引擎在这里停下。
    raise RuntimeError("the model's logits are NaN or infinite; this engine cannot record the step")


@add_to_class(LLMEngine)
def is_finished(self) -> bool:
    """True when no request is queued or computing, and `step` has nothing left to report."""
    # zh: 没有请求在排队或计算、`step` 也没有剩下要报告的东西时为 True。
    return self.scheduler.is_finished() and self.in_flight is None and not self._left_to_report()


@add_to_class(LLMEngine)
def _left_to_report(self) -> bool:
    """Whether `step` still has news that no step computes: here, never (a hook)."""
    # zh: `step` 是否还有不由任何一步计算出的消息要报告：这里从来没有（这是一个钩子）。
    return False

# %% [markdown] tags=["en"]
# ## See it: one step ahead
#
# On a CPU the order is still visible. The same tiny Qwen3 and prompts as chapter 10, first
# synchronously, then with `async_scheduling=True`: each call of `step()` queues one step and
# reports the one before, and the tokens are the synchronous run's.

# %% [markdown] tags=["zh"]
# ## 看它运行：提前一步
#
# 在 CPU 上这个顺序依然看得见。和第 10 章一样的小 Qwen3 和提示词，先同步运行，再用 `async_scheduling=True`：
# 每次调用 `step()` 都会排队一步、报告前一步，而得到的 token 与同步运行的结果相同。

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

tiny_qwen = build_tiny_model("qwen3")
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Write clear code"]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
sync_llm = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=16)
outputs = sync_llm.generate(prompts, greedy, use_tqdm=False)

# %%
async_llm = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10,
                max_num_batched_tokens=16, async_scheduling=True)
queued = []
async_llm.scheduler.observer = lambda event, data: queued.append(data) if event == "schedule" else None
ids = [async_llm.add_request(prompt, greedy) for prompt in prompts]
tokens_of, calls = {}, 0
while not async_llm.is_finished():
    seen = len(queued)
    finished, num_tokens, is_prefill = async_llm.step()
    calls += 1
    launched = ("prefill" if queued[-1]["is_prefill"] else "decode") if len(queued) > seen else say("nothing")
    collected = (say("{kind:<7} of {tokens:2d} tokens", kind="prefill" if is_prefill else "decode", tokens=num_tokens)
                 if num_tokens else say("nothing"))
    if calls <= 6 or async_llm.is_finished():
        print(say("call {call:2d}: queued {queued:<7}, collected {collected}, finished {finished}", call=calls,
                  queued=launched, collected=collected, finished=[i for i, _ in finished]))
    tokens_of.update(finished)
assert [tokens_of[i] for i in ids] == [o["token_ids"] for o in outputs]
# en: one call more than steps: the first collects nothing
# zh: 调用比步数多一次：第一次调用什么也不收取。
assert calls == len(queued) + 1
print(say("{calls} calls for {steps} steps; the tokens equal the synchronous run's", calls=calls, steps=len(queued)))


# %% [markdown] tags=["en"]
# ## What we built
#
# - `Sequence`: `append_pending_token`, `set_token`, `truncate`, and the WAITING → FINISHED arrow.
# - `Scheduler`: `advance` and `resolve`, the two halves of `postprocess`.
# - `ModelRunner.launch` and `SampledTokens`: a step queued on the device, its tokens usable there
#   at once by the next step, and on the host once they arrive; `run` is `launch` and wait.
# - `DecodeStaging`: a decode step's graph inputs in one copy; `SamplingGraphs`: the LM head and
#   the plain sampler captured after the model's graphs, with its key on the device
#   (`sample_in_graph`).
# - Tensor parallelism: every rank keeps its last steps' samples (`RankWorker.recent`), and the
#   driver holds a `TPStep` in place of `SampledTokens`.
# - `LLMEngine`: `_launch` and `_collect`, and one step `in_flight` when `async_scheduling` is on.
#
# Next, chapter 19 measures the engine against `transformers` and against its bound.
#
# ## Exercises
#
# 1. A sequence of a 3-token prompt (`max_tokens=4`) has decoded one token; its next decode step
#    is launched while that token is still pending, and then the pending token turns out to be an
#    end-of-sequence token. What does `resolve` do with the token that the later step computed, and
#    how long is the sequence in the end?
# 2. With `async_scheduling=True`, one request with `max_tokens=3` runs alone. How many steps are
#    launched, how many calls of `step()` are needed until `is_finished()`, and which call reports
#    the request?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `Sequence`：`append_pending_token`、`set_token`、`truncate`，以及 WAITING → FINISHED 这条箭头。
# - `Scheduler`：`advance` 与 `resolve`，即 `postprocess` 的两半。
# - `ModelRunner.launch` 与 `SampledTokens`：排进设备队列的一步，它的 token 在设备上立即可供下一步使用，到达主机后
#   也可在主机上读取；`run` 就是 `launch` 之后等待。
# - `DecodeStaging`：用一次拷贝送出 decode 步的图输入；`SamplingGraphs`：在模型的图之后捕获的 LM head 和普通采样器，
#   密钥放在设备上（`sample_in_graph`）。
# - 张量并行：每个 rank 保存最近几步的采样结果（`RankWorker.recent`），驱动进程手中拿的是 `TPStep` 而不是
#   `SampledTokens`。
# - `LLMEngine`：`_launch` 与 `_collect`，以及打开 `async_scheduling` 时始终处于计算中的一步（`in_flight`）。
#
# 下一章（第 19 章）对照 `transformers` 和上限测量这个引擎。
#
# ## 练习
#
# 1. 一个提示词为 3 个 token 的序列（`max_tokens=4`）已经 decode 出一个 token；它的下一个 decode 步在那个 token 仍
#    待定时就已发起，随后这个待定 token 被证明是结束符。`resolve` 怎样处理后一步算出的 token？序列最后有多长？
# 2. 打开 `async_scheduling=True`，一个 `max_tokens=3` 的请求单独运行。一共发起几步？要调用几次 `step()` 才
#    `is_finished()`？哪一次调用报告了这个请求？
#
# 下面的单元检查答案。

# %%
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence

# en: Exercise 1: the later step's token is dropped (the sequence is already finished when it resolves), and the
# en: pending place it took is cut off: the sequence ends with the EOS, prompt + 2 tokens.
# zh: 练习 1：后一步的 token 被丢弃（它被解析时序列已经结束），它占的待定位置也被截掉：
# zh: 序列以结束符收尾，共提示词 + 2 个 token。
EOS = 7
sched = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                  eos_token_ids=[EOS])
seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4), block_size=4)
sched.add(seq)
# en: the prefill, counted: one pending token
# zh: prefill，已计入：一个待定 token。
prefill = sched.advance(*sched.schedule())
# en: ... which turns out to be 5
# zh: ……结果是 5。
sched.resolve(*prefill, [5])
# en: decode: token 5 computed, a new pending token
# zh: decode：计算 token 5，又产生一个新的待定 token。
first = sched.advance(*sched.schedule())
# en: launched before the first decode's token is known
# zh: 在第一个 decode 的 token 揭晓之前就已发起。
second = sched.advance(*sched.schedule())
# en: EOS: finished, the later token cut off
# zh: EOS：序列结束，后面那个 token 被截掉。
assert sched.resolve(*first, [EOS]) == [seq] and seq.is_finished
assert sched.resolve(*second, [9]) == [] and seq.token_ids == [1, 2, 3, 5, EOS]

# en: Exercise 2: three steps (the prefill samples the first token, two decode steps the others); four calls,
# en: since the first call only queues; the fourth reports the request.
# zh: 练习 2：三步（prefill 采样出第一个 token，两个 decode 步采样其余的）；四次调用，因为第一次只排队；
# zh: 第四次报告这个请求。
alone = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, async_scheduling=True)
request = alone.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
reports = []
while not alone.is_finished():
    reports.append(alone.step()[0])
assert len(reports) == 4 and reports[-1][0][0] == request and not any(reports[:-1])
print(say("all exercise answers check out"))
