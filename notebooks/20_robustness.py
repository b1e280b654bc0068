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
# # 20 · An engine users cannot break
#
# **Goal.** Chapter 10's engine computes the right tokens for a careful caller. Real callers are
# not careful: they pass NumPy arrays and tensors, share one engine between threads, interrupt a
# cell in JupyterLab in the middle of a step, queue requests with `add_request` and then call
# `generate`, and load checkpoints whose weights hold NaN. By the end of this chapter the engine
# answers each of these with the right tokens or a clear error, and keeps serving everything
# else. Every rule below is the answer to a way a user broke the engine; each changes a few
# methods of the classes built in chapters 04, 10 and 12.

# %% [markdown] tags=["zh"]
# # 20 · 用户弄不坏的引擎
#
# **目标：** 第 10 章的引擎对细心的调用者给出正确的 token。真实的调用者并不细心：他们传入 NumPy 数组和张量，在多个
# 线程之间共用一个引擎，在 JupyterLab 里一步算到一半时中断单元，先用 `add_request` 排队请求、再调用 `generate`，
# 还会加载权重里有 NaN 的检查点。读完本章，引擎对每一种情况要么给出正确的 token，要么给出清楚的报错，并继续为其他
# 请求服务。下面每条规则都是对某种把引擎弄坏的用法的回应；每条只改动第 04、10、18 章所建的类中的几个方法。

# %% [markdown] tags=["en"]
# ## Prompts of every shape, and a tokenizer that exists
#
# A prompt is text, or token ids: a list, a tuple, or a 1-D integer NumPy array or torch tensor
# (what a tokenizer called with `return_tensors` gives, one row of it). A 2-D array is refused
# rather than read as one long prompt, and so is an array of floats or booleans. Text must be
# valid Unicode: a lone surrogate (what `errors="surrogateescape"` leaves of undecodable bytes)
# is refused by name instead of reaching the tokenizer, whose message does not say which prompt
# or character is wrong; an empty string is refused too. The tokenizer itself is checked when
# the engine starts: a model directory with none of the files a vocabulary is read from
# (`tokenizer.json`, `tokenizer.model`, `vocab.json`, `vocab.txt`) is refused, since
# `transformers` would quietly build a tokenizer that knows a single token, and every text
# prompt would come out empty.
#
# Chapter 10's `inputs` module left two hooks for this: `prompt_token_ids` asks `checked_prompt`
# for the prompt as text or token ids, which took the prompt as given and, filled here, refuses
# what is neither; `load_tokenizer` asks `check_tokenizer_files`, which refused nothing and now
# refuses a directory without a vocabulary. Both are module-level functions: the book's
# `add_to_class` also takes a module.

# %% [markdown] tags=["zh"]
# ## 各种形状的提示词，以及确实存在的分词器
#
# 提示词可以是文本，也可以是 token id：列表、元组，或者一维的整数 NumPy 数组、torch 张量（分词器在指定
# `return_tensors` 时给出的结果中的一行）。二维数组会被拒绝，而不是被当作一个很长的提示词；浮点数或布尔值的数组
# 也会被拒绝。文本必须是合法的 Unicode：孤立的代理码元（`errors="surrogateescape"` 处理无法解码的字节后留下的
# 东西）会被指名拒绝，而不是交给分词器，因为分词器的报错不会说明是哪个提示词、哪个字符出了问题；空字符串也会被
# 拒绝。分词器本身在引擎启动时检查：如果模型目录里没有任何一个可以读出词表的文件（`tokenizer.json`、
# `tokenizer.model`、`vocab.json`、`vocab.txt`），目录就会被拒绝，因为 `transformers` 会悄悄地构造一个只认识
# 一个 token 的分词器，每个文本提示词都会变成空的。
#
# 第 10 章的 `inputs` 模块为此留了两个接缝：`prompt_token_ids` 通过 `checked_prompt` 取得文本或 token id 形式的
# 提示词，这个接缝原本照单全收，在这里填上之后，两者都不是的东西会被拒绝；`load_tokenizer` 会询问
# `check_tokenizer_files`，它原本不拒绝任何目录，现在会拒绝没有词表的目录。两者都是模块级函数：本书的 `add_to_class`
# 也接受一个模块。

# %% prompts of every shape
#| export engine.inputs
from collections.abc import Sequence as ListLike
from pathlib import Path

import numpy as np
import torch

import nanovllm.engine.inputs as inputs
from nanovllm.book.literate import add_to_class

inputs.Prompt = str | list[int] | np.ndarray | torch.Tensor
# en: What transformers reads a vocabulary from: a fast tokenizer, SentencePiece, BPE, WordPiece.
# zh: transformers 从这些文件读取词表：快速分词器、SentencePiece、BPE、WordPiece。
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@add_to_class(inputs)
def check_tokenizer_files(model: str) -> None:
    """Refuse a model directory that holds no tokenizer files: transformers would quietly build a tokenizer that
    knows a single token, and every text prompt would come out empty."""
    # zh: 拒绝没有分词器文件的模型目录：否则 transformers 会悄悄构造一个只认识一个 token 的分词器，
    # zh: 每个文本提示词都会变成空的。
    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model directory {model!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "tokenizer files of the checkpoint into it"
        )


@add_to_class(inputs)
def checked_prompt(prompt: object) -> str | list[int] | ListLike[int]:
    """The prompt as text or as token ids: a str (not empty, valid text), a list or a tuple, or the ids of a 1-D
    integer NumPy array or torch tensor; anything else is refused by name."""
    # zh: 文本或 token id 形式的提示词：str（非空、合法的文本）、列表或元组，或者一维整数 NumPy 数组或 torch 张量中的
    # zh: id；其他任何东西都会被指名拒绝。
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is an empty string")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"prompt is not valid text: it holds a lone surrogate, {prompt[error.start]!r} at index "
                f"{error.start} (bytes decoded with errors='surrogateescape'? decode them with errors='replace')"
            ) from None
        return prompt
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        return _array_token_ids(prompt)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        # en: Bytes iterate as small ints, which would pass for token ids: the text was not decoded.
        # zh: 字节串逐个迭代出来是小整数，会被当成 token id：这是没有解码的文本。
        raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}: "
                        "decode bytes to a str first (for example data.decode('utf-8'))")
    if isinstance(prompt, ListLike):
        return prompt
    raise TypeError(f"a prompt must be a str or a list of token ids (or a 1-D integer array), "
                    f"got {type(prompt).__name__}")


def _array_token_ids(array: np.ndarray | torch.Tensor) -> list[int]:
    kind = "NumPy array" if isinstance(array, np.ndarray) else "torch tensor"
    if array.ndim != 1:
        raise ValueError(f"a {kind} prompt must be 1-D, the token ids of one prompt; got shape "
                         f"{tuple(array.shape)} (a batch is a list of prompts)")
    dtype = array.dtype
    if isinstance(array, np.ndarray):
        integer = dtype.kind in "iu"
    else:
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if not integer:
        raise TypeError(f"a {kind} prompt must hold integer token ids, got dtype {dtype}")
    return array.tolist()

# %% [markdown] tags=["en"]
# ## A step that fails, and a call that is interrupted
#
# A step can fail after the scheduler has planned it: the model raises (out of memory, a
# broken kernel) or the user presses Ctrl-C while the runner computes. Nothing was computed, so
# the scheduler's plan must be undone, or the next step would find sequences that claim KV they
# never got. `Scheduler.rollback` undoes `schedule()`: the prefills it completed go back to the
# head of `waiting` (keeping their blocks), every scheduled count returns to zero; decode's new
# blocks and preemptions stay, since they left the queues consistent. The engine's `_compute`
# (the part of `_launch` that hands the step to the runner) left a hook around the runner's
# work in chapter 18, `_undone_on_failure`: filled here, it calls `rollback` whenever the runner
# raises, and re-raises.
#
# A `generate` call that is interrupted (an error, Ctrl-C) takes its own unfinished requests with
# it: `Scheduler.abort` takes a sequence out of its queue, frees its blocks and marks it
# FINISHED (an aborted request ends wherever it is), so a later call does not compute it for
# nobody. With asynchronous scheduling the step in flight is settled first
# (`_settle_in_flight`): recorded if it completed, else its sequences are aborted too.

# %% [markdown] tags=["zh"]
# ## 失败的一步，被中断的调用
#
# 一步可能在调度器规划好之后失败：模型抛出异常（显存不足、内核出错），或者用户在执行器计算时按下 Ctrl-C。什么也
# 没算出来，所以调度器的规划必须撤销，否则下一步会遇到声称拥有 KV、其实从未得到过的序列。`Scheduler.rollback`
# 撤销 `schedule()`：它完成的 prefill 回到 `waiting` 队头（保留它们的块），每个调度计数归零；decode 新分配的块和
# 抢占则保留，因为它们让队列保持一致。引擎的 `_compute`（`_launch` 中把这一步交给执行器的那部分）在第 18 章
# 给执行器的工作外面留了一个接缝 `_undone_on_failure`：在这里填上之后，执行器一抛出异常它就调用 `rollback`，
# 然后重新抛出。
#
# 被中断的 `generate` 调用（出错或 Ctrl-C）会带走它自己尚未完成的请求：`Scheduler.abort` 把序列移出它的队列、
# 释放它的块，并把它标为 FINISHED（被中止的请求在哪里都可以结束），这样之后的调用就不会白白计算它。异步调度时，
# 先处理计算中的那一步（`_settle_in_flight`）：如果它已算完就记下，否则把它的序列也中止。

# %% scheduler undo and abort
#| export engine.scheduler
from nanovllm.book.literate import add_to_class
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus


@add_to_class(Scheduler)
def rollback(self, seqs: list[Sequence], is_prefill: bool) -> None:
    """Undo ``schedule()`` for a step that was never computed (the model raised), so it can run again.

    Prefill moved the sequences it completes to ``running``; they go back to the head of
    ``waiting`` in their order, keeping their blocks. Decode's new blocks and preemptions stay:
    they left the queues consistent.
    """
    # zh: 为一个从未算出来的步（模型抛出了异常）撤销 ``schedule()``，让它可以再跑一次。
    # zh:
    # zh: prefill 把它完成的序列移进了 ``running``；它们按原来的顺序回到 ``waiting`` 的队头，保留各自的块。
    # zh: decode 新分配的块和抢占则保留：它们让队列保持一致。
    for seq in seqs:
        seq.num_scheduled_tokens = 0
    if is_prefill:
        moved = [seq for seq in seqs if seq.status is SequenceStatus.RUNNING]
        for seq in moved:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
        self.waiting.extendleft(reversed(moved))


@add_to_class(Scheduler)
def abort(self, seq: Sequence) -> None:
    """Drop an unfinished request: out of its queue, its blocks freed, FINISHED (the caller gave up on it)."""
    # zh: 丢弃一个未完成的请求：把它移出所在的队列，释放它的块，标为 FINISHED（调用者已经放弃了它）。
    for queue in (self.waiting, self.running):
        if seq in queue:
            queue.remove(seq)
    seq.num_scheduled_tokens = 0
    if seq.block_table:
        self.block_manager.deallocate(seq)
    seq.status = SequenceStatus.FINISHED

# %% [markdown] tags=["en"]
# ## Ctrl-C at any moment, and observers that raise
#
# `rollback` covers a step whose *model* is interrupted. But a step is mostly bookkeeping:
# `schedule` moves sequences between queues and hands out blocks, `advance` counts the step and
# forks samples, `resolve` writes the tokens, publishes blocks and frees finished sequences, and
# the engine files what finished. A `KeyboardInterrupt` can land on any line of that, and
# Python raises it wherever it lands: between taking a block off the free list and writing it
# into a block table, say. One such half-done step leaks blocks, loses queued requests or leaves
# a pending token behind, and every later call fails. Random Ctrl-Cs hit these windows rarely,
# which is why they went unnoticed; the test below hits every one.
#
# **What a step promises.** An interrupted call leaves the engine as if the interrupted step had
# not started, or had finished: no block leaked, no queued request lost or changed, the next call
# correct. The call raises `KeyboardInterrupt` (a Ctrl-C is never swallowed), and an interrupted
# `generate` takes its own requests with it, as before.
#
# **How.** Each call of the engine holds Ctrl-C back (`deferred_interrupt`, chapter 17, which
# nests) and lets it through in exactly two kinds of place, where nothing is half-changed:
#
# - while the model runner computes a step that is not counted yet (`interruptible`): an
#   interrupt there is undone by `rollback`, and this is where a long step spends its time;
# - between two steps of `generate` (`interruption_point`): the books are whole, and the call
#   drops its own requests as any interrupted call does. `step()` takes one just before it hands
#   its outputs over, which otherwise stay in `unreported` for the next call.
#
# `interruptible` opens a gate (`Gate`) that chapter 17's hooks ask: `_let_through`, when a
# Ctrl-C arrives, delivers it through an open gate and closes it behind it; a nested
# `deferred_interrupt` closes the gate until it ends (`enter_nested`, `exit_nested`).
#
# Everywhere else, a Ctrl-C waits until the step is whole: at most one step's bookkeeping, a
# fraction of a millisecond, or, with asynchronous scheduling, until the tokens of the step in
# flight arrive. Deferring is the simpler half: the alternative, undoing every line of
# `schedule`, `advance` and `resolve`, would need an undo for each of them. With tensor
# parallelism the driver also reads and files each rank's reply as one (a reply read but not
# filed was lost, and the next call waited for it until `rank_timeout_s`), and writes the
# sampling params of a step together with the step.
#
# **Callbacks are the other half.** The engine calls code it does not own: the scheduler's
# observer (the visualizations of appendix A) and the progress bar. Neither may cut a step in
# half. The scheduler calls its observer last in `add`, `schedule` and `resolve`, through
# `_notify`; inside an engine, `_notify` keeps what the observer raises in `observer_errors`,
# and the engine raises it once the step is whole: from `generate` (which then drops its
# requests), from `step` (what finished waits for the next call), from `add_request` (which
# then queues nothing). A bare scheduler, as in chapter 04 and the tests, still raises at once.
# The progress bar writes through `BarStream`, which falls silent after its first failed write
# (`python run.py 2>&1 | head` closes stderr): a bar is a courtesy, and must not fail a call, nor
# leave tqdm's global lock held (tqdm does when its stream raises while it draws).

# %% [markdown] tags=["zh"]
# ## 随时按下的 Ctrl-C，以及抛出异常的观察者
#
# `rollback` 处理的是*模型*计算被打断的一步。可是一步的大部分是记账：`schedule` 在队列之间挪动序列、分发块，
# `advance` 记下这一步并分叉出样本，`resolve` 写入 token、发布块、释放结束的序列，引擎再把结束的请求归档。
# `KeyboardInterrupt` 可能落在其中任何一行，而 Python 在哪里收到它就在哪里抛出：比如刚从空闲队列取下一个块、
# 还没写进块表的时候。这样一个做了一半的步就会泄漏块、丢失排队的请求或留下待定 token，之后的每次调用都会失败。
# 随机按下的 Ctrl-C 很少正好落进这些窗口，所以一直没人发现；下面的测试会逐一命中每一个。
#
# **一步的承诺。** 被中断的调用让引擎处于这样的状态：仿佛被中断的那一步还没开始，或者已经完成——没有泄漏的块，
# 排队的请求既没丢也没被改动，下一次调用结果正确。调用会抛出 `KeyboardInterrupt`（Ctrl-C 绝不会被吞掉）；被中断的
# `generate` 和以前一样带走它自己的请求。
#
# **做法。** 引擎的每个调用都把 Ctrl-C 压住（第 17 章的 `deferred_interrupt`，它可以嵌套），只在两类地方放它
# 通过，那里没有任何改到一半的东西：
#
# - 模型执行器计算一个尚未记账的步时（`interruptible`）：在这里打断由 `rollback` 撤销，而一个长步的时间也
#   正花在这里；
# - `generate` 的两步之间（`interruption_point`）：账目是完整的，调用像任何被中断的调用一样丢掉它自己的请求。
#   `step()` 在交出结果之前也设了一个，否则这些结果会留在 `unreported` 里，交给下一次调用。
#
# `interruptible` 打开一道闸门（`Gate`），第 17 章的接缝会询问它：Ctrl-C 到来时，`_let_through` 让它穿过打开的闸门，
# 并随即在它身后关上；嵌套的 `deferred_interrupt` 在结束之前关着闸门（`enter_nested`、`exit_nested`）。
#
# 在其他任何地方，Ctrl-C 都要等这一步完整：最多是一步的记账，不到一毫秒；异步调度时，则要等到计算中那一步的
# token 到达。推迟是较简单的那一半：另一种做法是撤销 `schedule`、`advance` 和 `resolve` 的每一行，那就要为每一行
# 各写一个撤销。张量并行时，驱动进程还会把每个 rank 回复的读出和归档合为一体（读出但没有归档的回复会丢失，
# 下一次调用便会一直等它，直到 `rank_timeout_s`），并把一步的采样参数和这一步一起写出。
#
# **回调是另一半。** 引擎会调用不属于它的代码：调度器的观察者（附录 A 的可视化）和进度条。二者都不能把一步截成
# 两半。调度器在 `add`、`schedule` 和 `resolve` 的最后通过 `_notify` 调用观察者；在引擎里，`_notify` 把观察者
# 抛出的异常存进 `observer_errors`，等这一步完整后由引擎抛出：在 `generate` 中抛出（随后丢掉它的请求），在
# `step` 中抛出（已结束的序列留给下一次调用），在 `add_request` 中抛出（随后什么也不排队）。单独使用的调度器，
# 比如第 04 章和测试中的，仍然立即抛出。进度条通过 `BarStream` 输出，第一次写入失败后它就不再作声
# （`python run.py 2>&1 | head` 会关掉 stderr）：进度条只是一种礼貌，不能让调用失败，也不能让 tqdm 的全局锁一直
# 被占着（它绘制时如果输出流抛出异常，tqdm 就会这样）。

# %% letting ctrl-c through
#| export utils.interrupts
import signal
import threading

import nanovllm.utils.interrupts as interrupts
from nanovllm.book.literate import add_to_class
from nanovllm.utils.interrupts import Deferral, _deliver, _held, _hold, _replaced


class Gate:
    """Whether Ctrl-C goes through at once although a `deferred_interrupt` block holds it back (`interruptible`)."""
    # zh: 即使有 `deferred_interrupt` 块把 Ctrl-C 压住，它是否仍能立即通过（`interruptible`）。

    open = False


@add_to_class(interrupts)
def _let_through() -> None:
    """Deliver the Ctrl-C just held back when the gate is open (`interruptible`)."""
    # zh: 闸门打开时（`interruptible`），递送刚被压住的那个 Ctrl-C。
    if Gate.open:
        # en: the gate lets one interrupt through and closes behind it
        # zh: 闸门放过一个中断，随即在它身后关上。
        Gate.open = False
        _deliver(_replaced[-1])


@add_to_class(Deferral)
def enter_nested(self, main: bool) -> None:
    """Inside `interruptible`, a nested block holds Ctrl-C back again, until it ends."""
    # zh: 在 `interruptible` 内部，嵌套的块会再次压住 Ctrl-C，直到它结束。
    self.reopen = main and Gate.open
    if self.reopen:
        Gate.open = False


@add_to_class(Deferral)
def exit_nested(self) -> None:
    """A nested block that closed the gate opens it again: what it held back goes through now, as the enclosing
    block lets it."""
    # zh: 关上了闸门的嵌套块结束时把闸门重新打开：它压住的东西此刻通过，只要外层的块允许。
    if self.reopen:
        Gate.open = True
        if _held:
            _let_through()


class Passage:
    """The context manager of `interruptible`."""
    # zh: `interruptible` 的上下文管理器。

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.active = main and signal.getsignal(signal.SIGINT) is _hold and not Gate.open
        if self.active:
            _deliver(_replaced[-1])
            Gate.open = True

    def __exit__(self, *exc_info: object) -> None:
        if self.active:
            Gate.open = False


def interruptible() -> Passage:
    """Inside `deferred_interrupt`: let Ctrl-C through at once for the duration of a ``with`` block, first
    delivering one that was held back. For work whose interruption the caller undoes (the engine: the model
    computing a step)."""
    # zh: 在 `deferred_interrupt` 内部：在一个 ``with`` 块期间让 Ctrl-C 立即通过，并先递送之前被压住的那一个。
    # zh: 用于被打断后由调用者撤销的工作（在引擎中：模型计算一步）。
    return Passage()


def interruption_point() -> None:
    """Inside `deferred_interrupt`: deliver now a Ctrl-C that was held back, where the caller can take it."""
    # zh: 在 `deferred_interrupt` 内部：就在此处递送被压住的 Ctrl-C，调用者在这里接得住它。
    with interruptible():
        pass

# %% observers wait
#| export engine.scheduler
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.scheduler import Scheduler


@add_to_init(Scheduler)
def _init_observer_errors(self) -> None:
    # en: Where an engine collects what the observer raises; None (a bare scheduler): raise it at once.
    # zh: 引擎在这里收集观察者抛出的异常；为 None 时（单独使用的调度器）立即抛出。
    self.observer_errors: list[BaseException] | None = None


@add_to_class(Scheduler)
def _notify(self, event: str, data: dict) -> None:
    """Call the observer. A scheduler inside an engine keeps what it raises in ``observer_errors``, and the engine
    raises it once the step is whole: an observer must not cut a step in half."""
    # zh: 调用观察者。引擎中的调度器把观察者抛出的异常存进 ``observer_errors``，等这一步完整后由引擎抛出：
    # zh: 观察者不能把一步截成两半。
    if self.observer is not None:
        try:
            self.observer(event, data)
        # en: even a KeyboardInterrupt the observer raises itself
        # zh: 包括观察者自己抛出的 KeyboardInterrupt。
        except BaseException as error:
            if self.observer_errors is None:
                raise
            self.observer_errors.append(error)

# %% step that fails
#| export engine.llm_engine
import contextlib
from collections.abc import Collection, Iterator

from nanovllm.book.literate import add_to_class
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.interrupts import interruptible


@add_to_class(LLMEngine)
@contextlib.contextmanager
def _undone_on_failure(self, seqs: list[Sequence], is_prefill: bool) -> Iterator[None]:
    """Around the model computing a scheduled step (`_compute`): if nothing comes of it (an error, Ctrl-C, out of
    memory), the schedule is undone, so the engine stays consistent and the same step can simply run again."""
    # zh: 包在模型计算已调度的一步（`_compute`）外面：如果什么也没算出来（出错、Ctrl-C、显存不足），就撤销这次调度，
    # zh: 这样引擎保持一致，同一步可以直接再跑一次。
    try:
        # en: The one stretch of a step where Ctrl-C gets through at once: what undoes it is `rollback`.
        # zh: 一步之中 Ctrl-C 能立刻生效的唯一一段：撤销它的正是 `rollback`。
        with interruptible():
            yield
    except BaseException:
        self.scheduler.rollback(seqs, is_prefill)
        raise


@add_to_class(LLMEngine)
def _settle_in_flight(self, dropping: Collection[int] = ()) -> None:
    """After an interruption: record the step in flight if it completed, else drop its sequences. What it
    finished waits for `step` to report it, except the requests in ``dropping`` (the interrupted call's)."""
    # zh: 中断之后：计算中的那一步如果已经算完就记下，否则丢弃它的序列。它结束的请求等 `step` 来报告，
    # zh: ``dropping`` 中的请求（被中断的那次调用的）除外。
    step, self.in_flight = self.in_flight, None
    if step is None:
        return
    try:
        finished = self._collect(step)[0]
        self.outbox.unreported += [seq for seq in finished if seq.request_id not in dropping]
    except Exception:
        for seq in step.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)

# %% [markdown] tags=["en"]
# ## One call at a time, and `generate` beside `add_request`
#
# Three rules of the engine as a whole, each one the answer to a way a user broke it:
#
# - **One call at a time.** The engine's state (queues, block tables, the step in flight) is
#   changed by every `generate`, `add_request`, `step` and `exit`, so they run under one lock:
#   calls from several threads run one after another, each `generate` with its own batch, and
#   all of them return what they would return alone. To batch the requests of several threads
#   together, let each thread `add_request` and one thread drive `step`: an `add_request` then
#   waits for the step in progress, and its request joins the next one. A call from *inside*
#   another call on the same thread (an observer of the scheduler that calls `generate`, say)
#   would find the engine in the middle of a step and would wait for itself forever; it raises
#   `EngineBusyError` instead.
# - **`generate` and `add_request` together.** `generate` returns its own outputs, in prompt
#   order. Requests queued earlier with `add_request` are not set aside: they share its steps
#   (that is continuous batching), and those that finish meanwhile wait in the engine
#   (`unreported`) until `step` reports them, as it reports any finished request; the others keep
#   their place and their blocks when `generate` returns. Nothing is computed for nobody, and
#   nothing is lost: loop on `step` until `is_finished()`, as before.
# - **Logits that are not numbers.** Chapter 08's sampler marks a row whose logits hold NaN or
#   infinities with `NON_FINITE`. The engine looks for the mark in the tokens it reads anyway,
#   so the check adds no wait for the GPU to any step (a `bool(torch.isfinite(logits).all())`
#   per step would stall asynchronous scheduling at every step). When it sees one, it drops that
#   request (all its samples, their blocks freed), finds the likely cause (it reads the weights,
#   once, and names the first tensor that holds NaN or inf; if none does, the activations
#   overflowed the dtype) and raises `NonFiniteLogitsError`, a `ValueError`: `generate` raises it
#   for its own prompts, naming them, and `step` for requests of `add_request`. The other
#   requests go on.
#
# What the engine owes its callers between calls gets an object of its own, an `Outbox`: the
# finished requests that `step` has not reported (`unreported`), the requests dropped for logits
# that are not numbers, with their cause, and what an observer raised in the middle of a step.
# The constructor builds one, with the lock. `_one_call`, the hook that chapter 10's
# `add_request` and `exit` already run their bodies in, becomes the lock, and the new `generate`
# and `step` take it too; `_undo_if_observer_raised`, chapter 10's other hook in `add_request`,
# takes a request back when an observer raised while it was queued. `_drain` sorts what a step
# finished into the current `generate` call's and the others'; and chapter 18's `_collect`,
# which stops at a row that is not a number, now hands such a step to `_collect_non_finite`,
# which records the other rows and drops that request.

# %% [markdown] tags=["zh"]
# ## 一次一个调用，以及与 `add_request` 并用的 `generate`
#
# 引擎整体上的三条规则，每一条都是对某种把引擎弄坏的用法的回应：
#
# - **一次一个调用。** 引擎的状态（各个队列、块表、计算中的那一步）会被每次 `generate`、`add_request`、`step` 和
#   `exit` 改变，所以它们在同一把锁下运行：来自多个线程的调用依次执行，每次 `generate` 都有自己的批次，所有调用的
#   返回值都与单独调用时相同。若想把多个线程的请求合成一批，就让每个线程调用 `add_request`，由一个线程驱动 `step`：
#   这时 `add_request` 会等正在进行的那一步结束，它的请求加入下一步。在同一线程上、从另一个调用*内部*发起的调用
#   （比如调度器的观察者调用了 `generate`）会发现引擎正处在一步的中间，并且会永远等待它自己；这种情况会抛出
#   `EngineBusyError`。
# - **`generate` 与 `add_request` 并用。** `generate` 按提示词顺序返回它自己的输出。之前用 `add_request` 排队的请求
#   不会被搁置：它们与这次调用共享各个步（这就是连续批处理），其间结束的请求留在引擎里（`unreported`），直到 `step`
#   报告它们，就像报告任何结束的请求一样；其余请求在 `generate` 返回时保留各自的位置和块。没有东西白算，也没有东西
#   丢失：像以前一样循环调用 `step` 直到 `is_finished()` 即可。
# - **不是数的 logits。** 第 08 章的采样器会用 `NON_FINITE` 标记 logits 含 NaN 或无穷大的行。引擎在它反正要读回的
#   token 里寻找这个标记，所以这项检查不会让任何一步多等 GPU（每步做一次 `bool(torch.isfinite(logits).all())` 会让
#   异步调度在每一步都停顿）。一旦看到标记，引擎就丢弃那个请求（它的所有样本，释放它们的块），找出最可能的原因（读一次
#   权重，指出第一个含 NaN 或 inf 的张量；如果没有，就是激活值溢出了数据类型的范围），然后抛出 `NonFiniteLogitsError`
#   （一种 `ValueError`）：属于 `generate` 自己提示词的由 `generate` 抛出并指明是哪些提示词，`add_request` 的请求则由
#   `step` 抛出。其他请求照常进行。
#
# 引擎在两次调用之间欠调用者的东西，有了自己的对象 `Outbox`：`step` 还没报告的已结束请求（`unreported`）、因 logits
# 不是数而被丢弃的请求及其原因，以及观察者在一步中间抛出的异常。构造函数建好一个 `Outbox`，还有那把锁。
# 第 10 章的 `add_request` 和 `exit` 本来就在接缝 `_one_call` 里执行它们的主体，
# 现在它变成这把锁，新的 `generate` 和 `step` 也获取它；`add_request` 里第 10 章的另一个接缝
# `_undo_if_observer_raised` 在请求排队时观察者抛出异常的情况下把请求收回。`_drain` 把一步中结束的序列分成当前
# `generate` 调用的和其他的；第 18 章的 `_collect` 遇到不是数的行就停下，现在它把这样的一步交给
# `_collect_non_finite`：记录其他行，丢弃那个请求。

# %% one call at a time
#| export engine.llm_engine
import contextlib
import threading
from collections.abc import Iterator

import torch

from nanovllm.book.literate import add_to_class
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.utils.interrupts import deferred_interrupt


class EngineBusyError(RuntimeError):
    """A call into the engine from inside another call of the same engine, on the same thread."""
    # zh: 在同一线程上，从同一个引擎的另一个调用内部发起的对它的调用。


def non_finite_cause(model: torch.nn.Module | None, dtype: str) -> str:
    """Why a model's logits are NaN or infinite: weights that are (named), else an overflow in ``dtype``.

    It reads every weight, once, and only after the sampler marked a row: never on the fast path.
    """
    # zh: 模型的 logits 为什么是 NaN 或无穷大：权重本身就是（指出是哪个），否则就是 ``dtype`` 中的溢出。
    # zh:
    # zh: 它把每个权重读一遍，只读一次，而且只在采样器标记了某一行之后才读：绝不在快速路径上。
    # en: tensor parallelism: the weights live in the ranks
    # zh: 张量并行：权重在各 rank 进程里。
    if model is None:
        return f"NaN or inf in the weights, or activations that overflow {dtype}"
    tensors = [*model.named_parameters(), *model.named_buffers()]
    broken = [name for name, tensor in tensors if not bool(torch.isfinite(tensor).all())]
    if broken:
        more = f" and {len(broken) - 1} more tensors" if len(broken) > 1 else ""
        return f"the weights hold NaN or inf ({broken[0]}{more}): the checkpoint is damaged"
    unwritten = "or the attention read KV that no step wrote (a bug of the engine)"
    if dtype == "float32":
        return f"the weights are finite: the activations overflowed float32, {unwritten}"
    better = "'bfloat16' (float32's range) or 'float32'" if dtype == "float16" else "'float32'"
    return f"the weights are finite: the activations likely overflowed {dtype} (try dtype={better}), {unwritten}"


@add_to_class(LLMEngine)
@contextlib.contextmanager
def _one_call(self, name: str) -> Iterator[None]:
    """Run the body of `LLMEngine` method ``name`` under the engine's lock. A call from another thread waits until
    the call in progress returns; a call from inside another call on the same thread (an observer, a callback)
    would find the engine in the middle of a step, and raises EngineBusyError instead of waiting for itself."""
    # zh: 在引擎的锁下执行 `LLMEngine` 方法 ``name`` 的主体。来自另一个线程的调用会等正在进行的调用返回；
    # zh: 在同一线程上从另一个调用内部发起的调用（观察者、回调）会发现引擎正处在一步的中间，于是抛出 EngineBusyError，
    # zh: 而不是等待它自己。
    # en: The lock is reentrant, and whether a call is in progress is asked once it is held. A signal handler
    # en: that calls the engine while this thread's call is between taking the lock and marking itself begun
    # en: then finds no call begun and runs whole, before it; one that lands later finds the mark and raises.
    # en: (Asked before taking a plain lock, a handler landing between the two waited for its own thread forever.)
    # zh: 锁是可重入的，“是否有调用正在进行”要在拿到锁之后再问。信号处理函数如果在本线程的调用拿到锁、但还没标记
    # zh: 自己开始之间调用引擎，它看到的是没有调用开始，于是完整地先跑完；落在之后的则看到标记，抛出异常。
    # zh: （若在拿一把普通锁之前就问，落在这两步之间的处理函数会永远等待它自己的线程。）
    with self._lock:
        if self._in_call:
            raise EngineBusyError(
                f"{name}() was called from inside another call of this engine on the same thread (an observer, a "
                "callback or a signal handler?), in the middle of a step; call it once that call has returned"
            )
        # en: Ctrl-C waits until the engine's books are whole (`interruptible` lets it through where that is
        # en: safe). The lock is taken first: waiting for another thread's call stays interruptible.
        # zh: Ctrl-C 要等到引擎的账目完整时才生效（`interruptible` 在安全的地方放它通过）。先拿锁：
        # zh: 等待另一个线程的调用时仍然可以被打断。
        with deferred_interrupt():
            self._in_call = True
            try:
                yield
            finally:
                self._in_call = False

# %% outbox
#| export engine.outbox
"""What the engine owes its callers between calls."""
# zh: 引擎在两次调用之间欠调用者的东西。

from __future__ import annotations

from collections.abc import Collection

from nanovllm.engine.sequence import Sequence


class NonFiniteLogitsError(ValueError):
    """The model's logits were NaN or infinite for some requests, which were dropped (``request_ids``)."""
    # zh: 模型对某些请求给出的 logits 是 NaN 或无穷大，这些请求已被丢弃（``request_ids``）。

    def __init__(self, message: str, request_ids: list[int]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class Outbox:
    """What the engine owes its callers between calls: finished sequences that `step` has not reported yet (a
    `generate` call's steps finish the requests of `add_request` too), requests dropped for non-finite logits that
    nobody was told about yet, with the likely cause, and what the scheduler's observer raised, which waits until
    the step is whole (the scheduler's `_notify` appends to ``observer_errors``)."""
    # zh: 引擎在两次调用之间欠调用者的东西：`step` 还没报告的已结束序列（`generate` 调用的各步也会让 `add_request` 的
    # zh: 请求结束）；因 logits 不是有限值而被丢弃、还没告诉任何人的请求，以及可能的原因；还有调度器的观察者抛出的异常，
    # zh: 它要等到这一步完整（调度器的 `_notify` 把它追加到 ``observer_errors``）。

    def __init__(self) -> None:
        self.unreported: list[Sequence] = []
        self.dropped: dict[int, str] = {}
        self.observer_errors: list[BaseException] = []

    def has_news(self) -> bool:
        """Whether `step` has something to report that no step computes."""
        # zh: `step` 是否有无需计算任何一步就能报告的东西。
        return bool(self.unreported or self.dropped)

    def raise_observer_error(self) -> None:
        """Raise the first error that an observer raised, now that the step is whole."""
        # zh: 这一步已经完整，现在抛出观察者抛出的第一个异常。
        if self.observer_errors:
            error = self.observer_errors[0]
            self.observer_errors.clear()
            raise error

    def drop(self, requests: Collection[int], cause: str) -> None:
        """Requests dropped for non-finite logits: the error names them, and their samples are not reported."""
        # zh: 因 logits 不是有限值而被丢弃的请求：报错会指出它们，它们的样本不会被报告。
        self.unreported = [seq for seq in self.unreported if seq.request_id not in requests]
        self.dropped.update(dict.fromkeys(requests, cause))

    def take_dropped(self, among: Collection[int] | None = None) -> NonFiniteLogitsError | None:
        """The error for the dropped requests (those in ``among``, or all), which are then forgotten."""
        # zh: 被丢弃请求（``among`` 中的那些，或者全部）的报错；之后就忘掉这些请求。
        ids = sorted(request for request in self.dropped if among is None or request in among)
        if not ids:
            return None
        causes = sorted({self.dropped.pop(request) for request in ids})
        some = f"requests {', '.join(map(str, ids))} were" if len(ids) > 1 else f"request {ids[0]} was"
        return NonFiniteLogitsError(
            f"the model's logits are NaN or infinite ({'; '.join(causes)}); {some} dropped, and the engine goes on "
            "serving other requests", ids)

    def forget(self, requests: Collection[int]) -> None:
        """A `generate` call that ends in an error takes its requests' news with it, and its error comes first."""
        # zh: 以异常结束的 `generate` 调用带走它的请求的消息，而且它自己的异常优先。
        for request in requests:
            self.dropped.pop(request, None)
        self.observer_errors.clear()

# %% the engine's rules
#| export engine.llm_engine
import sys
import time
from collections.abc import Collection
from collections.abc import Sequence as ListLike
from typing import Any, Self

from tqdm.auto import tqdm

from nanovllm.book.literate import add_to_init
from nanovllm.engine.inputs import Prompt
from nanovllm.engine.llm_engine import LaunchedStep, LLMEngine
from nanovllm.engine.outbox import NonFiniteLogitsError, Outbox
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import NON_FINITE
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.interrupts import interruption_point


@add_to_init(LLMEngine)
def _init_call_rules(self) -> None:
    # en: What the engine owes its callers between calls; the lock of one call at a time.
    # zh: 引擎在两次调用之间欠调用者的东西；“一次一个调用”的锁。
    self.outbox = Outbox()
    self._lock = threading.RLock()
    self._in_call = False
    # en: What the scheduler's observer raises waits in the outbox until the step is whole (see `_notify`).
    # zh: 调度器的观察者抛出的异常先存进 outbox，等这一步完整了再抛出（见 `_notify`）。
    self.scheduler.observer_errors = self.outbox.observer_errors


@add_to_class(LLMEngine)
def _undo_if_observer_raised(self, seqs: list[Sequence]) -> None:
    """An `add_request` whose queuing an observer of the scheduler interrupted fails whole: its sequences are taken
    back, and what the observer raised is raised."""
    # zh: 如果调度器的观察者打断了 `add_request` 的排队，这次 `add_request` 就整个失败：收回它的序列，
    # zh: 再抛出观察者抛出的异常。
    if self.outbox.observer_errors:
        for seq in seqs:
            self.scheduler.abort(seq)
        self.outbox.raise_observer_error()



class StepOutput(tuple):
    """A finished sequence as `step` reports it. It unpacks as nano-vllm's ``(seq_id, token_ids)`` pair, and says
    whose sample it is: ``request_id`` (what `add_request` returned) and ``sample_index`` (0 to n - 1). The samples
    of a request with ``n > 1`` finish under seq_ids of their own, so the pair alone cannot say."""
    # zh: `step` 所报告的一个已结束序列。它可以像 nano-vllm 的 ``(seq_id, token_ids)`` 二元组那样解包，
    # zh: 还指明它是谁的样本：``request_id``（`add_request` 的返回值）和 ``sample_index``（0 到 n - 1）。
    # zh: ``n > 1`` 的请求的各个样本以各自的 seq_id 结束，所以光靠这个二元组说不清。

    request_id: int
    sample_index: int

    def __new__(cls, seq_id: int, token_ids: list[int], request_id: int, sample_index: int = 0) -> Self:
        output = super().__new__(cls, (seq_id, token_ids))
        output.request_id, output.sample_index = request_id, sample_index
        return output

    def __getnewargs__(self) -> tuple[int, list[int], int, int]:
        return (*self, self.request_id, self.sample_index)

    def __repr__(self) -> str:
        return (f"StepOutput(seq_id={self[0]}, token_ids={self[1]}, request_id={self.request_id}, "
                f"sample_index={self.sample_index})")


@add_to_class(LLMEngine)
def step(self) -> tuple[list[StepOutput], int, bool]:
    """One step: (the finished sequences, tokens computed, was it a prefill). Each finished sequence is a
    `StepOutput`: a ``(seq_id, completion ids)`` pair that names its request and sample index.

    With async scheduling, the step it launches is not the one it reports: it queues step n + 1
    on the GPU, then collects step n (the first call collects nothing: ``([], 0, is_prefill)``).
    It also reports the requests of `add_request` that a `generate` call finished, and raises
    NonFiniteLogitsError once for requests dropped because their logits were not finite (the others go on).
    """
    # zh: 执行一步：返回（已结束的序列，计算的 token 数，是否为 prefill）。每个已结束的序列都是一个 `StepOutput`：
    # zh: 一个 ``(seq_id, completion ids)`` 二元组，并指明所属的请求和样本下标。
    # zh:
    # zh: 异步调度时，它发起的那一步并不是它报告的那一步：它先把第 n + 1 步排进 GPU 队列，再收取第 n 步（第一次调用什么
    # zh: 也收不到：``([], 0, is_prefill)``）。它也报告由某次 `generate` 调用结束的 `add_request` 请求；
    # zh: 对因 logits 不是有限值而被丢弃的请求，它抛出一次 NonFiniteLogitsError（其他请求照常进行）。
    reported: list[Sequence] = []
    try:
        with self._one_call("step"):
            num_tokens, is_prefill = 0, False
            if not (self.scheduler.is_finished() and self.in_flight is None):
                finished, num_tokens, is_prefill = self._step()
                self.outbox.unreported += finished
            # en: Whatever is raised from here on, what finished stays in the outbox, for the next call.
            # zh: 从这里起无论抛出什么，已结束的序列都留在 outbox 里，交给下一次调用。
            self.outbox.raise_observer_error()
            interruption_point()
            error = self.outbox.take_dropped()
            if error is not None:
                raise error
            reported, self.outbox.unreported = self.outbox.unreported, []
            outputs = [StepOutput(seq.seq_id, seq.completion_token_ids, seq.request_id, seq.sample_index)
                       for seq in reported]
    except KeyboardInterrupt:
        # en: A Ctrl-C that arrived in the last instants of the call is delivered as it ends: what the call
        # en: was about to report waits for the next one rather than being lost with the return value.
        # zh: 在调用最后一刻到来的 Ctrl-C 会在调用结束时递送：这次调用本要报告的东西留给下一次，
        # zh: 而不是随返回值一起丢失。
        if reported:
            with self._lock:
                self.outbox.unreported[:0] = reported
        raise
    return outputs, num_tokens, is_prefill


@add_to_class(LLMEngine)
def _left_to_report(self) -> bool:
    """Whether `step` still has news that no step computes: requests of `add_request` that a `generate` call
    finished, or dropped (the outbox)."""
    # zh: `step` 是否还有无需计算任何一步的消息要报告：被某次 `generate` 调用结束或丢弃的
    # zh: `add_request` 请求（在 outbox 里）。
    return self.outbox.has_news()


@add_to_class(LLMEngine)
def generate(
    self,
    prompts: list[Prompt],
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
    use_tqdm: bool = True,
) -> list[dict[str, Any]]:
    """Generate a continuation of every prompt; outputs come back in prompt order.

    A prompt is a str, a list of token ids or a 1-D integer NumPy array / torch tensor. Requests queued
    earlier with `add_request` are not set aside: they share this call's steps (continuous batching), and
    those that finish meanwhile wait in the engine for `step` to report them; the others keep their place
    and their blocks when it returns. Raises NonFiniteLogitsError, naming the prompts, when the model's
    logits for one of them are NaN or infinite.
    """
    # zh: 为每个提示词生成后续内容；输出按提示词的顺序返回。
    # zh:
    # zh: 提示词可以是 str、token id 列表，或者一维整数 NumPy 数组 / torch 张量。之前用 `add_request` 排队的
    # zh: 请求不会被搁置：它们与这次调用共享各个步（连续批处理），其间结束的请求留在引擎里，等 `step` 来报告；
    # zh: 其余请求在它返回时保留各自的位置和块。某个提示词的 logits 是 NaN 或无穷大时，抛出 NonFiniteLogitsError 并指
    # zh: 明是哪些提示词。
    with self._one_call("generate"):
        params = params_per_prompt(prompts, sampling_params)
        requests = self._queue_requests(prompts, params)
        # en: Completions by request id, then by sample index (a request with n > 1 has n of them).
        # zh: 按请求 id、再按样本序号存放的生成结果（n > 1 的请求有 n 个）。
        outputs: dict[int, dict[int, list[int]]] = {seqs[0].seq_id: {} for seqs in requests}
        try:
            self._drain(requests, outputs, sum(p.n for p in params), use_tqdm)
        except BaseException:
            self._abandon(outputs)
            raise
        return [self._result(outputs[seqs[0].seq_id]) for seqs in requests]


def params_per_prompt(
    prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
) -> list[SamplingParams]:
    """`generate`'s arguments checked: one SamplingParams per prompt (the default, or one shared by all)."""
    # zh: 检查过的 `generate` 参数：每个提示词一个 SamplingParams（默认值，或者所有提示词共用的那一个）。
    if isinstance(prompts, str) or not isinstance(prompts, ListLike):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(prompts)
    if isinstance(sampling_params, str) or not isinstance(sampling_params, ListLike):
        kind = type(sampling_params).__name__
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {kind}")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
    return list(sampling_params)


@add_to_class(LLMEngine)
def _queue_requests(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[list[Sequence]]:
    """Make every request's sequences, then queue them all: a bad request raises before anything is queued."""
    # zh: 先为每个请求建好序列，再把它们全部排队：坏请求在任何东西排队之前就会抛出异常。
    requests = []
    for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        # en: nothing is queued yet: Ctrl-C may stop a long tokenization here
        # zh: 此时还没有任何请求入队：Ctrl-C 可以在这里打断耗时的分词。
        interruption_point()
        try:
            requests.append(self.make_sequences(prompt, request_params))
        except (TypeError, ValueError) as error:
            raise type(error)(f"prompt {index}: {error}") from error
    for seqs in requests:
        for seq in seqs:
            self.scheduler.add(seq)
    return requests


@add_to_class(LLMEngine)
def _drain(self, requests: list[list[Sequence]], outputs: dict[int, dict[int, list[int]]], total: int,
           use_tqdm: bool) -> None:
    """Step until the ``total`` samples of ``requests`` finished, their completions in ``outputs``; then leave the
    engine idle."""
    # zh: 一步步运行，直到 ``requests`` 的 ``total`` 个样本全部结束，生成内容存进 ``outputs``；然后让引擎空闲下来。
    done, prefill_rate, decode_rate = 0, 0.0, 0.0
    bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm, file=BarStream(sys.stderr))
    try:
        while done < total:
            # en: Between steps the engine's books are whole: a Ctrl-C held back during the last step,
            # en: or what an observer raised, is raised here.
            # zh: 两步之间引擎的账目是完整的：上一步中被压下的 Ctrl-C，或观察者抛出的异常，在这里抛出。
            interruption_point()
            self.outbox.raise_observer_error()
            start = time.perf_counter()
            finished, num_tokens, is_prefill = self._step()
            if self.outbox.dropped:
                self._raise_dropped(requests)
            rate = num_tokens / max(time.perf_counter() - start, 1e-9)
            prefill_rate, decode_rate = (rate, decode_rate) if is_prefill else (prefill_rate, rate)
            bar.set_postfix(prefill=f"{prefill_rate:.0f} tok/s", decode=f"{decode_rate:.0f} tok/s")
            for seq in finished:
                if seq.request_id in outputs:
                    outputs[seq.request_id][seq.sample_index] = seq.completion_token_ids
                else:
                    # en: a request of add_request: step() reports it
                    # zh: add_request 提交的请求：由 step() 报告。
                    self.outbox.unreported.append(seq)
            mine = sum(seq.request_id in outputs for seq in finished)
            bar.update(mine)
            done += mine
        if self.in_flight is not None and self.scheduler.is_finished():
            # en: A last step computed tokens past the end of sequences that have finished: record it
            # en: (it changes nothing) so that the engine is idle when generate returns.
            # zh: 最后一步为已经结束的序列多算了 token：把它记下（不改变任何东西），
            # zh: 这样 generate 返回时引擎是空闲的。
            step, self.in_flight = self.in_flight, None
            self._collect(step)
        self.outbox.raise_observer_error()
    finally:
        bar.close()


@add_to_class(LLMEngine)
def _abandon(self, outputs: dict[int, dict[int, list[int]]]) -> None:
    """An interrupted `generate` takes its unfinished requests with it (forked samples included): their blocks are
    freed, and a later call does not compute them for nobody."""
    # zh: 被中断的 `generate` 带走它尚未完成的请求（包括分叉出的样本）：释放它们的块，之后的调用也不会白白计算它们。
    self._settle_in_flight(outputs)
    for seq in [*self.scheduler.waiting, *self.scheduler.running]:
        if seq.request_id in outputs:
            self.scheduler.abort(seq)
    self.outbox.forget(outputs)


class BarStream:
    """Where `generate`'s progress bar writes: stderr, until writing to it fails once (a closed pipe, as in
    ``python run.py 2>&1 | head``); from then on the bar is silent. A progress bar is a courtesy: it must not take
    a call down, nor leave tqdm's lock held (tqdm does, when the stream raises while it draws)."""
    # zh: `generate` 的进度条写往的地方：stderr，直到某一次写入失败（管道被关闭，比如 ``python run.py 2>&1 | head``）；
    # zh: 从那以后进度条就不再作声。进度条只是一种礼貌：它不能让调用失败，也不能让 tqdm 的锁一直被占着
    # zh: （绘制时如果输出流抛出异常，tqdm 就会这样）。

    def __init__(self, stream: Any) -> None:
        self.stream, self.broken = stream, False

    def write(self, text: str) -> int:
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def _guarded(self, operation: Any, *args: Any) -> None:
        if not self.broken:
            try:
                operation(*args)
            # en: a broken pipe; a closed file
            # zh: 管道断开；文件已关闭。
            except (OSError, ValueError):
                self.broken = True

    # en: encoding, fileno, isatty: what tqdm asks a stream
    # zh: encoding、fileno、isatty：tqdm 会向流查询这些属性。
    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@add_to_class(LLMEngine)
def _collect_non_finite(self, step: LaunchedStep, token_ids: list[int]) -> tuple[list[Sequence], int, bool]:
    """Record the rows of a step whose logits are numbers, then drop the requests of the rows whose logits are not
    (see `_collect` for the result)."""
    # zh: 记录一步中 logits 是有限值的那些行，再丢弃 logits 不是有限值的那些行所属的请求（返回值见 `_collect`）。
    seqs, indices = step.seqs, step.indices
    broken = [seq for seq, token in zip(seqs, token_ids, strict=True) if token == NON_FINITE]
    kept = [i for i, token in enumerate(token_ids) if token != NON_FINITE]
    kept_tokens = [token_ids[i] for i in kept]
    finished = self.scheduler.resolve([seqs[i] for i in kept], [indices[i] for i in kept], kept_tokens)
    self._drop(broken)
    return finished, step.num_tokens, step.is_prefill


@add_to_class(LLMEngine)
def _drop(self, broken: list[Sequence]) -> None:
    """Drop the requests whose logits were not finite, all of their samples; the error is raised by the
    `generate` call they belong to, else by the next `step`."""
    # zh: 丢弃 logits 不是有限值的请求，连同它们的所有样本；报错由它们所属的 `generate` 调用抛出，
    # zh: 否则由下一次 `step` 抛出。
    requests = {seq.request_id for seq in broken if not seq.is_finished}
    if not requests:
        # en: dropped already, in an earlier step
        # zh: 在更早的一步中已经丢弃了。
        return
    cause = non_finite_cause(getattr(self.model_runner, "model", None), self.config.dtype)
    for seq in [*self.scheduler.waiting, *self.scheduler.running, *broken]:
        if seq.request_id in requests:
            self.scheduler.abort(seq)
    self.outbox.drop(requests, cause)


@add_to_class(LLMEngine)
def _raise_dropped(self, requests: list[list[Sequence]]) -> None:
    """Raise NonFiniteLogitsError, naming the prompts, if requests of this generate call were dropped."""
    # zh: 如果这次 generate 调用的请求被丢弃了，就抛出 NonFiniteLogitsError，并指明是哪些提示词。
    ids = {seqs[0].seq_id: index for index, seqs in enumerate(requests)}
    error = self.outbox.take_dropped(ids)
    if error is not None:
        prompts = ", ".join(str(ids[request]) for request in error.request_ids)
        alone = len(ids) == len(error.request_ids)
        others = "" if alone else " (generate raised: its other prompts were dropped too)"
        raise NonFiniteLogitsError(f"prompt {prompts}: {error}{others}", error.request_ids)


# %% [markdown] tags=["en"]
# ## See it: the rules at work
#
# Chapter 10's tiny Qwen3 and prompts again, first run alone for reference tokens. Then bad
# requests, each refused before anything is queued, while the engine carries on:

# %% [markdown] tags=["zh"]
# ## 看它运行：这些规则的作用
#
# 再次用第 10 章的小 Qwen3 和提示词，先单独运行一遍，得到作为参照的 token。然后是各种坏请求：每一个都在任何东西
# 排队之前就被拒绝，而引擎继续工作：

# %%
import numpy as np

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

tiny_qwen = build_tiny_model("qwen3")
llm = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=16)
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Write clear code"]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
outputs = llm.generate(prompts, greedy, use_tqdm=False)

# %% [markdown] tags=["en"]
# Bad requests are refused before anything is queued, and the engine carries on:

# %% [markdown] tags=["zh"]
# 坏请求在任何东西入队之前就被拒绝，引擎照常工作：

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "empty prompt": "空提示词",
    "id outside vocab": "词表之外的 id",
    "over max_model_len": "超过 max_model_len",
    "never fits the pool": "块池永远放不下",
    "params mismatch": "采样参数个数不符",
    "a 2-D array": "二维数组",
    "lone surrogate": "孤立的代理字符",
    "three threads, one engine: every call got its own tokens": "三个线程，一个引擎：每次调用都拿到了自己的 token",
    "generate returned its prompt; step() then reported request {queued}, computed alongside":
        "generate 返回了它自己提示词的结果；随后 step() 报告了一同计算的请求 {queued}",
    "request {other}, queued beside it, finished with the tokens it gets alone":
        "与它一同排队的请求 {other} 照常完成，token 与单独运行时相同",
    "one generate call runs {lines} lines of bookkeeping ({distinct} distinct); a SIGINT at {count} of them, "
    "each time: the call raised KeyboardInterrupt, the queued requests finished with their own tokens, "
    "every block came back":
        "一次 generate 调用执行 {lines} 行记账代码（其中 {distinct} 行各不相同）；在其中 {count} 行各发一次 SIGINT，"
        "每一次：调用抛出 KeyboardInterrupt，排队的请求都以自己的 token 完成，所有块都已归还",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
refusals = {
    "empty prompt": lambda: llm.generate(["fine", ""], greedy),
    "id outside vocab": lambda: llm.generate([[1, 2, 10**6]], greedy),
    "over max_model_len": lambda: llm.generate([[1] * 510], greedy),
    "never fits the pool": lambda: llm.generate([[1] * 30], SamplingParams(max_tokens=30)),
    "params mismatch": lambda: llm.generate(["a", "b"], [greedy]),
    "a 2-D array": lambda: llm.generate([np.array([[1, 2], [3, 4]])], greedy),
    "lone surrogate": lambda: llm.generate(["caf\udce9"], greedy),
}
for what, call in refusals.items():
    try:
        call()
        raise AssertionError(f"{what} was accepted")
    except (TypeError, ValueError) as error:
        print(f"{say(what):>19}: {type(error).__name__}: {error}")
assert llm.is_finished() and len(llm.generate(["still serving"], greedy, use_tqdm=False)[0]["token_ids"]) == 12

# %% [markdown] tags=["en"]
# The three rules at work. Token ids may come as an array; three threads share the engine; a
# request queued with `add_request` shares `generate`'s steps and `step` reports it afterwards;
# and a NaN planted in one row of the embedding table makes the logits of the one request that
# uses that token NaN: that request is dropped, with the tensor named, and a request queued
# beside it finishes unharmed.

# %% [markdown] tags=["zh"]
# 三条规则的实际效果。token id 可以用数组给出；三个线程共享同一个引擎；用 `add_request` 加入的请求与 `generate`
# 共享步骤，之后由 `step` 报告；在嵌入表的某一行放进一个 NaN，只有用到那个 token 的请求的 logits 会变成 NaN：
# 那个请求被丢弃，报错指出是哪个张量，而与它一同排队的请求照常完成，不受影响。

# %%
import threading

import torch

from nanovllm.engine.outbox import NonFiniteLogitsError

as_arrays = llm.generate([np.array(outputs[0]["token_ids"]), torch.tensor(outputs[1]["token_ids"])], greedy,
                         use_tqdm=False)
assert as_arrays == llm.generate([outputs[0]["token_ids"], outputs[1]["token_ids"]], greedy, use_tqdm=False)

answers = {}
threads = [threading.Thread(target=lambda i=i: answers.update({i: llm.generate([prompts[i]], greedy, use_tqdm=False)}))
           for i in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert [answers[i][0] for i in range(3)] == outputs
print(say("three threads, one engine: every call got its own tokens"))

queued = llm.add_request(prompts[0], greedy)
mine = llm.generate([prompts[1]], greedy, use_tqdm=False)
reported = {}
while not llm.is_finished():
    reported.update(dict(llm.step()[0]))
assert mine == [outputs[1]] and reported == {queued: outputs[0]["token_ids"]}
print(say("generate returned its prompt; step() then reported request {queued}, computed alongside", queued=queued))

# en: A token that neither prompt 2 nor its completion uses: its embedding row becomes NaN.
# zh: 选一个提示词 2 及其生成结果都用不到的 token：把它在嵌入表中的那一行变成 NaN。
used = set(llm.tokenizer.encode(prompts[2])) | set(outputs[2]["token_ids"])
poison = max(set(range(llm.config.hf_config.vocab_size)) - used)
embedding = llm.model_runner.model.model.embed_tokens.weight
saved = embedding[poison].clone()
with torch.no_grad():
    embedding[poison] = float("nan")
other = llm.add_request(prompts[2], greedy)
try:
    llm.generate([[poison, 5, 6]], greedy, use_tqdm=False)
    raise AssertionError("NaN logits went unnoticed")
except NonFiniteLogitsError as error:
    print(f"{type(error).__name__}: {error}")
reported = {}
while not llm.is_finished():
    reported.update(dict(llm.step()[0]))
with torch.no_grad():
    embedding[poison] = saved
assert reported == {other: outputs[2]["token_ids"]}
print(say("request {other}, queued beside it, finished with the tokens it gets alone", other=other))

# %% [markdown] tags=["en"]
# Last, Ctrl-C, aimed rather than random. `SignalAtLine` is a tracer (Python's `sys.settrace`)
# that counts the lines the engine's bookkeeping runs and, at line *k*, sends this process a
# real SIGINT: Python runs the handler at the next bytecode, exactly where a Ctrl-C pressed at
# that moment would land. One `generate` call is counted first; then, for a spread of lines
# across the whole call, the same call is interrupted there, beside two requests queued with
# `add_request`. After each interrupt the call must have raised, the queued requests must finish
# with the tokens they get alone, and every block must come back to the pool. (The tests do this
# for every line, with asynchronous scheduling and tensor parallelism too; before this chapter's
# deferral, about one such interrupt in three broke the engine.)

# %% [markdown] tags=["zh"]
# 最后是 Ctrl-C，这次不靠运气，而是瞄准。`SignalAtLine` 是一个追踪函数（Python 的 `sys.settrace`），它数着引擎
# 记账代码执行的行，在第 *k* 行给本进程发一个真正的 SIGINT：Python 在下一条字节码处运行信号处理函数，正是那一刻
# 按下 Ctrl-C 时它会落下的地方。先数一次 `generate` 调用的行数；然后在遍布整个调用的一组行上，把同一个调用在
# 那里打断，旁边还有两个用 `add_request` 排队的请求。每次打断之后，调用必须抛出异常，排队的请求必须以单独运行
# 时的 token 结束，每个块都必须回到块池。（测试对每一行都这样做，也覆盖异步调度和张量并行；在本章的推迟机制
# 出现之前，大约每三次这样的打断就有一次弄坏引擎。）

# %% signal at a line
#| export book.faults
from __future__ import annotations

import signal
import sys
from collections.abc import Collection
from types import FrameType
from typing import Any


class SignalAtLine:
    """A tracer that sends this process a real SIGINT when code of ``files`` runs its ``at``-th line (from 1;
    None only counts). ``lines``: the lines counted; ``points``: each line of code, with the count at which it
    first ran. Use it as a context manager on the main thread."""
    # zh: 一个追踪函数：数着 ``files`` 中代码执行的行，在第 ``at`` 行（从 1 数起；为 None 时只计数）
    # zh: 给本进程发一个真正的 SIGINT。``lines``：数过的行数；``points``：每一行代码，以及它第一次执行时的计数。
    # zh: 在主线程上把它当作上下文管理器使用。

    def __init__(self, files: Collection[str], at: int | None = None) -> None:
        self.files, self.at = frozenset(files), at
        self.lines, self.fired = 0, False
        self.points: dict[tuple[str, int], int] = {}

    def __enter__(self) -> SignalAtLine:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._line if not self.fired and frame.f_code.co_filename in self.files else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and not self.fired:
            self.lines += 1
            self.points.setdefault((frame.f_code.co_filename, frame.f_lineno), self.lines)
            if self.lines == self.at:
                self.fired = True
                signal.raise_signal(signal.SIGINT)
        return self._line

# %%
import nanovllm.engine.block_manager
import nanovllm.engine.llm_engine
import nanovllm.engine.prefix_cache
import nanovllm.engine.scheduler
import nanovllm.engine.sequence
from nanovllm.book.faults import SignalAtLine

bookkeeping = {module.__file__ for module in (nanovllm.engine.block_manager, nanovllm.engine.llm_engine,
                                              nanovllm.engine.prefix_cache, nanovllm.engine.scheduler,
                                              nanovllm.engine.sequence)}
short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
alone = [llm.generate([prompt], short, use_tqdm=False)[0]["token_ids"] for prompt in prompts[:2]]


def interrupted(at: int | None) -> tuple[bool, SignalAtLine]:
    """generate(prompts[2]) with a SIGINT at bookkeeping line ``at``, beside two queued requests; check after."""
    # zh: 在两个已排队的请求旁边运行 generate(prompts[2])，在记账代码的第 ``at`` 行发出 SIGINT；之后检查结果。
    queued = [llm.add_request(prompt, short) for prompt in prompts[:2]]
    tracer = SignalAtLine(bookkeeping, at)
    try:
        with tracer:
            llm.generate([prompts[2]], short, use_tqdm=False)
        raised = False
    except KeyboardInterrupt:
        raised = True
    finished = {}
    while not llm.is_finished():
        finished.update((output.request_id, output[1]) for output in llm.step()[0])
    assert raised == tracer.fired, f"the SIGINT at line {at} was lost"
    assert finished == dict(zip(queued, alone, strict=True)), f"queued requests changed by a SIGINT at line {at}"
    assert llm.scheduler.block_manager.num_free_blocks == llm.config.num_kvcache_blocks, "blocks leaked"
    return raised, tracer


census = interrupted(None)[1]
points = sorted(census.points.values())
for at in points[:: max(1, len(points) // 60)]:
    interrupted(at)
print(say("one generate call runs {lines} lines of bookkeeping ({distinct} distinct); a SIGINT at {count} of them, "
          "each time: the call raised KeyboardInterrupt, the queued requests finished with their own tokens, "
          "every block came back",
          lines=census.lines, distinct=len(points), count=len(points[:: max(1, len(points) // 60)])))


# %% [markdown] tags=["en"]
# ## What we built
#
# - Prompts of every shape (`checked_prompt`, a 1-D integer array or tensor), refused clearly
#   when they are not token ids or valid text; a model directory without tokenizer files refused.
# - `Scheduler.rollback` and `Scheduler.abort`: a step that failed is undone; an interrupted
#   `generate` takes its requests with it, and the step in flight is settled.
# - Ctrl-C at any moment: each call holds it back (`deferred_interrupt`) and lets it through
#   only where nothing is half-changed (`interruptible`, `interruption_point`); observers'
#   errors wait until the step is whole (`_notify`, `observer_errors`); a progress bar that
#   cannot write falls silent (`BarStream`); `step` reports `StepOutput` pairs that name their
#   request and sample.
# - One call at a time (`_one_call`, `EngineBusyError`), `generate` beside
#   `add_request` (the `Outbox`, reported by `step`), and requests whose logits are not numbers
#   dropped with their likely cause (`NonFiniteLogitsError`), the others going on.
#
# Next, chapter 21 serves the engine: one loop, many clients.
#
# ## Exercises
#
# 1. An observer of the scheduler (chapter 04) calls `llm.step()` from inside `generate`. What
#    happens, and why not simply wait for the lock?
# 2. A request queued with `add_request` finishes during a `generate` call. Which call returns
#    its tokens, and what does `is_finished()` say right after `generate` returns?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - 各种形状的提示词（`checked_prompt`，一维整数数组或张量）；不是 token id 或不是合法文本时给出清楚的拒绝；
#   没有分词器文件的模型目录会被拒绝。
# - `Scheduler.rollback` 与 `Scheduler.abort`：失败的一步被撤销；被中断的 `generate` 带走它的请求，计算中的那一步
#   也会被妥善处理。
# - 随时按下的 Ctrl-C：每个调用都把它压住（`deferred_interrupt`），只在没有改到一半的地方放它通过
#   （`interruptible`、`interruption_point`）；观察者的异常等这一步完整后再抛出（`_notify`、`observer_errors`）；
#   写不出去的进度条不再作声（`BarStream`）；`step` 报告的 `StepOutput` 二元组指明所属请求和样本。
# - 一次一个调用（`_one_call`、`EngineBusyError`）；与 `add_request` 并用的 `generate`（`Outbox`，由
#   `step` 报告）；logits 不是数的请求连同可能的原因一起被丢弃（`NonFiniteLogitsError`），其他请求照常进行。
#
# 下一章（第 21 章）用这个引擎提供服务：一个循环，许多客户端。
#
# ## 练习
#
# 1. 调度器的一个观察者（第 04 章）在 `generate` 内部调用 `llm.step()`。会发生什么？为什么不干脆等那把锁？
# 2. 一个用 `add_request` 排队的请求在一次 `generate` 调用中结束。哪个调用返回它的 token？`generate` 刚返回时，
#    `is_finished()` 是什么？
#
# 下面的单元检查答案。

# %%
from nanovllm.engine.llm_engine import EngineBusyError

# en: Exercise 1: EngineBusyError. The lock is held by generate on this very thread, in the middle of a
# en: step: waiting for it would wait for itself forever.
# zh: 练习 1：EngineBusyError。锁正被同一线程上的 generate 持有，而且正处在一步的中间：等它就是永远等自己。
caught = []


def meddle(event: str, data: dict) -> None:
    if event == "schedule" and not caught:
        try:
            llm.step()
        except EngineBusyError as error:
            caught.append(error)


llm.scheduler.observer = meddle
assert llm.generate([prompts[0]], greedy, use_tqdm=False) == [outputs[0]] and len(caught) == 1
llm.scheduler.observer = None

# en: Exercise 2: a later step() call returns it; right after generate, is_finished() is False, since a
# en: finished request is still waiting to be reported.
# zh: 练习 2：之后的一次 step() 调用返回它；generate 刚返回时 is_finished() 为 False，
# zh: 因为还有一个已结束的请求等着被报告。
queued = llm.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
llm.generate([prompts[2]], greedy, use_tqdm=False)
assert not llm.is_finished() and llm.outbox.unreported[0].request_id == queued
assert llm.step()[0] == [(queued, outputs[1]["token_ids"][:2])] and llm.is_finished()
print(say("all exercise answers check out"))
