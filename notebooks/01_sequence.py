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
# # 01 · A request's life
#
# **Goal.** By the end of this chapter you can follow one request through the engine by
# reading five counters and a list of block ids. You will build the two smallest objects of
# the engine: `SamplingParams`, which says *how* to generate, and `Sequence`, which remembers
# *what has happened so far*: the tokens, how many of them already have their KV in the cache,
# how many the current step computes, and which cache blocks hold them.
#
# Everything else in the book (the block manager, the scheduler, the model runner) reads and
# writes these fields, so it pays to know them well.

# %% [markdown] tags=["zh"]
# # 01 · 一个请求的一生
#
# **目标：** 读完本章，你只需看五个计数器和一串块编号，就能跟踪一个请求在引擎中的全过程。
# 本章构建引擎里最小的两个对象：`SamplingParams` 描述*怎样*生成；`Sequence` 记录*到目前为止发生了什么*：
# 有哪些 token、其中多少个的 KV 已在缓存里、当前这一步要计算多少个、它们存放在哪些缓存块中。
#
# 本书其余部分（块管理器、调度器、模型执行器）都要读写这些字段，先把它们弄熟，后文读起来会轻松得多。

# %% [markdown] tags=["en"]
# ## The idea: a request is a small state machine
#
# A request enters the engine as a **prompt** (a list of token ids) plus its sampling
# parameters. The scheduler keeps it in one of two queues, *waiting* and *running*, and each
# queue corresponds to a status:
#
# - **WAITING** — not (or no longer) computing; its prompt still has to be prefilled.
# - **RUNNING** — its KV is in the cache and each decode step appends one token.
# - **FINISHED** — it produced an end-of-sequence token or reached `max_tokens`.
#
# One arrow goes *backwards*: when the KV cache runs out of free blocks during decode, the
# scheduler **preempts** the newest running sequences. A preempted sequence gives back all its
# blocks and returns to WAITING; when it is scheduled again, its whole token list (prompt *and*
# what it generated so far) is prefilled again. This is *recompute* preemption, as in vLLM.

# %% [markdown] tags=["zh"]
# ## 思路：请求是一个小小的状态机
#
# 请求带着**提示词**（一串 token id）和采样参数进入引擎。调度器把它放进 *waiting*（等待）或
# *running*（运行）队列，每个队列对应一个状态：
#
# - **WAITING**：尚未（或不再）参与计算，提示词还要做 prefill（预填充）。
# - **RUNNING**：KV 已在缓存中，每个 decode（解码）步追加一个 token。
# - **FINISHED**：已生成结束符（EOS），或达到了 `max_tokens`。
#
# 有一条箭头是*反向*的：decode 时如果 KV 缓存没有空闲块，调度器会**抢占**最新加入的运行序列。
# 被抢占的序列归还所有块，回到 WAITING；再次被调度时，它的全部 token（提示词*加上*已生成的部分）
# 要重新 prefill。这就是 vLLM 中的*重算式*抢占。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "step": "步骤",
    "cached": "已缓存",
    "scheduled": "本步调度",
    "created": "创建",
    "prefill chunk 1": "prefill 分块 1",
    "prefill chunk 2": "prefill 分块 2",
    "  after step": "  这一步之后",
    "decode": "decode",
    "the worked example holds": "例子核对无误",
    "a mutable default, changed by one caller, changed for all: {shared}; ours: a fresh, frozen SamplingParams per "
    "sequence: {fresh}; the caller's prompt after generating: {prompt}":
        "可变的默认参数被一个调用者改动后，所有调用者都跟着变：{shared}；本书的做法：每个序列各用一个新建且冻结的 "
        "SamplingParams：{fresh}；生成结束后，调用者的提示词：{prompt}",
    "after a preemption at 3 generated tokens, the next prefill computes {plain} tokens; with prefix caching, {cached}":
        "生成 3 个 token 后被抢占，下一次 prefill 计算 {plain} 个 token；有前缀缓存时计算 {cached} 个",
    "all exercise answers check out": "练习答案全部验证通过",
    # en: the state machine
    # zh: 状态机
    "schedule (prefill)": "调度（prefill）",
    "EOS / max_tokens": "EOS / max_tokens",
    "preempt (free blocks, recompute later)": "抢占（释放块，之后重算）",
    "decode step: +1 token": "decode 步：+1 个 token",
    "prefill chunk": "prefill 分块",
})

# %% state machine drawing
#| hide
from IPython.display import SVG, display


def state_machine_svg() -> str:
    """Draw the three states and their transitions (labels are the code's own names)."""
    # zh: 画出三种状态以及它们之间的转换（标签用的是代码里的名字）。
    box = '<rect x="{x}" y="70" width="130" height="54" rx="12" fill="{fill}" stroke="#37474f" stroke-width="2"/>'
    label = '<text x="{x}" y="103" text-anchor="middle" font-family="monospace" font-size="16">{text}</text>'
    note = (
        '<text x="{x}" y="{y}" text-anchor="middle" font-family="sans-serif" font-size="13" '
        'fill="#37474f">{text}</text>'
    )
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="660" height="220" viewBox="0 0 660 220">',
        '<title lang="en">A sequence\'s states: WAITING becomes RUNNING when it is scheduled (prefill), RUNNING '
        'becomes FINISHED on EOS or max_tokens, and RUNNING goes back to WAITING when it is preempted (its blocks '
        'are freed, it is recomputed later).</title>'
        '<title lang="zh">序列的状态：被调度（prefill）时 WAITING 变为 RUNNING；遇到 EOS 或达到 max_tokens 时 RUNNING '
        '变为 FINISHED；被抢占时 RUNNING 回到 WAITING（它的块被释放，之后重算）。</title>',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#37474f"/></marker></defs>',
    ]
    for x, fill, text in [(20, "#fff8e1", "WAITING"), (265, "#e3f2fd", "RUNNING"), (510, "#e8f5e9", "FINISHED")]:
        parts += [box.format(x=x, fill=fill), label.format(x=x + 65, text=text)]
    arrows = [
        ("M150,90 L263,90", "schedule (prefill)", 207, 80),
        ("M395,97 L508,97", "EOS / max_tokens", 452, 87),
        ("M330,126 C330,190 85,190 85,127", "preempt (free blocks, recompute later)", 207, 205),
        ("M300,68 C280,10 380,10 360,68", "decode step: +1 token", 330, 22),
        ("M55,68 C35,10 135,10 115,68", "prefill chunk", 85, 22),
    ]
    for path, text, x, y in arrows:
        parts.append(f'<path d="{path}" fill="none" stroke="#37474f" stroke-width="2" marker-end="url(#arrow)"/>')
        parts.append(note.format(x=x, y=y, text=say(text)))
    parts.append("</svg>")
    return "".join(parts)


display(SVG(state_machine_svg()))

# %% [markdown] tags=["en"]
# ## Build it: the sampling parameters
#
# The first exported cell goes into `nanovllm/sampling_params.py`. The names and defaults
# follow nano-vllm (`temperature=1.0`, `max_tokens=64`, `ignore_eos=False`) so that its users
# feel at home; we add what nano-vllm lacks: `temperature=0` means **greedy** decoding, and
# `top_k`, `top_p` and a per-request `seed` (chapter 08 implements them).
#
# Parameters are checked when the object is built, not deep inside a GPU step: a wrong type
# raises `TypeError`, a wrong value raises `ValueError`, and both messages name the field. This
# is one of the three places where input enters the engine (the others are the prompt, below,
# and chapter 09's `Config`): each checks what it receives once, with one small helper, `check`,
# and the engine's inner parts trust what they are handed, as upstream's do. NumPy scalars
# (`np.int64(4)`, `np.float32(0.5)`, `np.True_`) count as the numbers they hold: `check` hands
# back the plain Python value, which is what the object stores.

# %% [markdown] tags=["zh"]
# ## 动手：采样参数
#
# 第一个导出单元会写进 `nanovllm/sampling_params.py`。字段名和默认值沿用 nano-vllm（`temperature=1.0`、
# `max_tokens=64`、`ignore_eos=False`），用过 nano-vllm 的人不会觉得陌生；我们补上 nano-vllm 缺少的部分：
# `temperature=0` 表示**贪心**解码，另有 `top_k`、`top_p` 和按请求设置的 `seed`（由第 08 章实现）。
#
# 参数在对象创建时就检查，而不是等到 GPU 计算的深处才出错：类型不对抛出 `TypeError`，取值不对抛出
# `ValueError`，两种错误信息都会指明是哪个字段。输入进入引擎的地方有三处，这是其中之一（另外两处是下面的
# 提示词和第 09 章的 `Config`）：每一处都用同一个小工具 `check` 把收到的东西检查一次；引擎内部各部分则直接
# 信任传进来的数据，上游也是这样做的。NumPy 标量（`np.int64(4)`、`np.float32(0.5)`、`np.True_`）
# 当作它们所表示的数来处理：`check` 返回对应的普通 Python 值，对象里存的就是这个值。

# %% default module
#| default_exp engine.sequence

# %% check
#| export utils.checks
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np


def check(name: str, value: Any, kind: type, ok: Callable[[Any], bool] | None = None, rule: str = "") -> Any:
    """``value`` as a plain ``kind`` if it is one and ``ok`` holds, else a TypeError or ValueError that names
    ``name`` and states ``rule``. A ``float`` field takes any finite number; ``object`` leaves the test to ``ok``.
    NumPy scalars count as the numbers they hold (``np.int64(4)`` is an int, ``np.True_`` a bool) and come
    back as plain Python values, which pickle and print as users expect."""
    # zh: ``value`` 是一个普通的 ``kind`` 且 ``ok`` 成立时，原样返回它；否则抛出 TypeError 或 ValueError，
    # zh: 写明 ``name``，并说出 ``rule``。``float`` 字段接受任何有限的数；``object`` 把检查交给 ``ok``。
    # zh: NumPy 标量按它所装的数来算（``np.int64(4)`` 是 int，``np.True_`` 是 bool），返回时变成普通的 Python 值，
    # zh: pickle 和打印都会如用户所料。
    # en: bool is a subclass of int, but `max_tokens=True` is surely a mistake.
    # zh: bool 是 int 的子类，但 `max_tokens=True` 一定是写错了。
    is_bool = isinstance(value, (bool, np.bool_))
    if kind is float:
        valid, what, plain = isinstance(value, numbers.Real) and not is_bool, "a number", float
    elif kind is int:
        valid, what, plain = isinstance(value, numbers.Integral) and not is_bool, "an int", int
    elif kind is bool:
        valid, what, plain = is_bool, "a bool", bool
    else:
        valid, what, plain = isinstance(value, kind), f"a {kind.__name__}", None
    if not valid:
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if plain is not None:
        try:
            value = plain(value)
        # en: For example float(10**400).
        # zh: 例如 float(10**400)。
        except OverflowError:
            raise ValueError(f"{name} must be finite, got {value!r}") from None
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if ok is not None and not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return value

# %% sampling params
#| export sampling_params
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanovllm.utils.checks import check


@dataclass(frozen=True)
class SamplingParams:
    """How to generate the continuation of one prompt.

    temperature: 0 means greedy (always the most likely token); larger is more random.
    max_tokens: how many tokens to generate at most (at least 1).
    ignore_eos: keep generating after an end-of-sequence token (used by benchmarks).
    top_k: keep only the k most likely tokens (None: no limit).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: no limit).
    seed: makes sampling of this request reproducible, whatever else is in the batch.
    n: how many completions to sample for the prompt (parallel sampling): the
    prompt is computed once and its n samples share its KV blocks until they diverge.
    """
    # zh: 如何为一个提示词生成后续内容。
    # zh:
    # zh: temperature：0 表示贪心解码（总是取概率最大的 token）；越大越随机。
    # zh: max_tokens：最多生成多少个 token（至少 1 个）。
    # zh: ignore_eos：遇到序列结束 token 之后继续生成（基准测试用）。
    # zh: top_k：只保留概率最大的 k 个 token（None：不限）。
    # zh: top_p：保留累计概率达到 top_p 的最小 token 集合（1.0：不限）。
    # zh: seed：让这个请求的采样可复现，不管批次里还有别的什么。
    # zh: n：为这个提示词采样多少个生成内容（并行采样）：提示词只计算一次，
    # zh: 它的 n 个样本共享它的 KV 块，直到它们分道扬镳。

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        self._check("temperature", float, lambda t: t >= 0, ">= 0 (0 means greedy)")
        self._check("max_tokens", int, lambda n: n >= 1, ">= 1")
        self._check("ignore_eos", bool)
        if self.top_k is not None:
            # en: The sampler clamps k to the vocabulary; the bound keeps k a 64-bit integer on the GPU.
            # zh: 采样器会把 k 截到词表大小；这个上界保证 k 在 GPU 上是一个 64 位整数。
            self._check("top_k", int, lambda k: 1 <= k < 2**63, "in [1, 2**63) or None (no limit)")
        self._check("top_p", float, lambda p: 0 < p <= 1, "in (0, 1]")
        if self.seed is not None:
            self._check("seed", int, lambda seed: 0 <= seed < 2**63, "in [0, 2**63)")
        self._check("n", int, lambda n: n >= 1, ">= 1 (completions per prompt)")

    def _check(self, name: str, kind: type, ok: Callable[[Any], bool] | None = None, rule: str = "") -> None:
        # en: Keep the plain value `check` hands back (np.int64(4) becomes 4); the dataclass is frozen.
        # zh: 存下 `check` 返回的普通 Python 值（np.int64(4) 变成 4）；这个 dataclass 是冻结的。
        object.__setattr__(self, name, check(name, getattr(self, name), kind, ok, rule))

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken (temperature 0)."""
        # zh: 总是取概率最大的 token（温度为 0）时为 True。
        return self.temperature == 0

# %% [markdown] tags=["en"]
# A quick look: the defaults, a greedy request, and a mistake caught at once.

# %% [markdown] tags=["zh"]
# 先看一眼：默认值、一个贪心请求，以及一个当场报出的错误。

# %%
from nanovllm.sampling_params import SamplingParams

print(SamplingParams())
print(SamplingParams(temperature=0, max_tokens=8).greedy)
try:
    SamplingParams(max_tokens=0)
except ValueError as error:
    print("ValueError:", error)

# %% [markdown] tags=["en"]
# ## Build it: the sequence
#
# A `Sequence` is one request inside the engine. Its status can only move along the arrows of
# the drawing above; the `status` setter enforces that, so a scheduler bug that, say, revives a
# finished sequence fails loudly instead of corrupting the cache. Its `seq_id` comes from one
# counter shared by every sequence, so ids follow the order in which requests were made, which
# is how the engine of chapter 10 returns its outputs in prompt order.

# %% [markdown] tags=["zh"]
# ## 动手：序列
#
# `Sequence` 是请求在引擎内部的表示。状态只能沿着上图的箭头变化，由 `status` 的 setter 把关：调度器如果出了错
# （比如把已结束的序列又拉回来），会立刻报错，而不是悄悄弄坏缓存。`seq_id` 取自所有序列共用的一个计数器，
# 所以编号的先后就是请求创建的先后；第 10 章的引擎正是靠它按提示词的顺序返回输出。

# %% sequence status
#| export
from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Set
from enum import Enum, auto
from itertools import count
from typing import ClassVar

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()

# %% [markdown] tags=["en"]
# ### The counters
#
# Five counters and a block table tell how far a sequence has got. Picture its tokens on a line:
#
# ```
# token index:   0 ........................................ num_tokens-1
#                |-- num_prompt_tokens --|-- completion tokens --|
#                |-- num_cached_tokens --|-- num_scheduled_tokens --|   (this step)
# ```
#
# - `num_tokens`: prompt plus generated tokens so far.
# - `num_prompt_tokens`: fixed at creation.
# - `num_completion_tokens`: tokens generated so far (`num_tokens - num_prompt_tokens`).
# - `num_cached_tokens`: tokens whose K and V vectors are already in the paged cache (computed
#   by an earlier step, or found by prefix caching in chapter 03).
# - `num_scheduled_tokens`: tokens the *current* step computes; set by the scheduler.
# - `block_table`: ids of the cache blocks holding the KV, in order; block `i` holds tokens
#   `i*block_size … (i+1)*block_size - 1`.
#
# During decode, `num_cached_tokens == num_tokens - 1`: every token but the last has its KV in
# the cache, and the step computes the last one (feeding it to the model produces both its KV
# and the logits of the next token).

# %% [markdown] tags=["zh"]
# ### 计数器
#
# 五个计数器加一张块表，刻画了序列当前的进度。把它的 token 排成一行：
#
# ```
# token 下标：   0 ........................................ num_tokens-1
#                |-- num_prompt_tokens --|-- 生成的 token --|
#                |-- num_cached_tokens --|-- num_scheduled_tokens --|   （本步）
# ```
#
# - `num_tokens`：提示词加上目前已生成的 token 数。
# - `num_prompt_tokens`：创建时确定，之后不变。
# - `num_completion_tokens`：目前已生成的 token 数（`num_tokens - num_prompt_tokens`）。
# - `num_cached_tokens`：K、V 向量已经在分页缓存中的 token 数（由之前的步骤算出，或由第 03 章的前缀缓存命中）。
# - `num_scheduled_tokens`：*当前*这一步要计算的 token 数，由调度器设置。
# - `block_table`（块表）：按顺序存放 KV 的缓存块编号；第 `i` 块存放第 `i*block_size … (i+1)*block_size - 1` 个 token。
#
# decode 阶段有 `num_cached_tokens == num_tokens - 1`：除最后一个 token 外，其余 token 的 KV 都已在缓存中；
# 这一步计算的正是最后一个 token（把它送入模型，既得到它的 KV，也得到下一个 token 的 logits）。

# %% sequence
#| export
class Sequence:
    """One request inside the engine: its tokens, its progress and its cache blocks.

    ``block_size`` is passed explicitly: a sequence never falls back on a default of its own
    (upstream nano-vllm's class-level default broke its tensor-parallel path).
    """
    # zh: 引擎里的一个请求：它的 token、它的进度以及它的缓存块。
    # zh:
    # zh: ``block_size`` 显式传入：序列从不退回到自己的默认值
    # zh: （上游 nano-vllm 的类级默认值弄坏了它的张量并行路径）。

    _ids = count()
    # en: Which status may follow which: WAITING -> RUNNING (scheduled), RUNNING -> WAITING
    # en: (preempted), RUNNING -> FINISHED; staying put is allowed.
    # zh: 每个状态之后允许出现哪些状态：WAITING -> RUNNING（被调度）、RUNNING -> WAITING（被抢占）、
    # zh: RUNNING -> FINISHED；保持不变也允许。
    ALLOWED_TRANSITIONS: ClassVar[dict[SequenceStatus, frozenset[SequenceStatus]]] = {
        SequenceStatus.WAITING: frozenset({SequenceStatus.WAITING, SequenceStatus.RUNNING}),
        SequenceStatus.RUNNING: frozenset({SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED}),
        SequenceStatus.FINISHED: frozenset({SequenceStatus.FINISHED}),
    }

    def __init__(self, token_ids: Iterable[int], sampling_params: SamplingParams | None = None, *, block_size: int):
        self.seq_id = next(Sequence._ids)
        self._status = SequenceStatus.WAITING
        self.token_ids = checked_token_ids(token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.block_size = block_size
        self.sampling_params: SamplingParams | None = sampling_params or SamplingParams()

    # en: ---- status -------------------------------------------------------------
    # zh: ---- 状态 ---------------------------------------------------------------
    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, new: SequenceStatus) -> None:
        if new not in self.ALLOWED_TRANSITIONS[self._status]:
            raise RuntimeError(f"sequence {self.seq_id}: illegal status change {self._status.name} -> {new.name}")
        self._status = new

    @property
    def is_finished(self) -> bool:
        return self._status is SequenceStatus.FINISHED

    # en: ---- tokens -------------------------------------------------------------
    # zh: ---- token --------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def scheduled_token_ids(self) -> list[int]:
        """The tokens this step computes: ``num_scheduled_tokens`` of them after the cached ones."""
        # zh: 这一步计算的 token：缓存的 token 之后的 ``num_scheduled_tokens`` 个。
        return self.token_ids[self.num_cached_tokens : self.num_cached_tokens + self.num_scheduled_tokens]

    def append_token(self, token_id: int) -> None:
        """Record a generated token (its KV is computed by the next step, not this one)."""
        # zh: 记下一个生成的 token（它的 KV 由下一步计算，不是这一步）。
        self.token_ids.append(_token_id(token_id, self.num_tokens))
        self.num_tokens += 1

    # en: ---- blocks -------------------------------------------------------------
    # zh: ---- 块 -----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold all tokens: ceil(num_tokens / block_size)."""
        # zh: 装下所有 token 所需的块数：ceil(num_tokens / block_size)。
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_cached_blocks(self) -> int:
        """Blocks completely filled with cached KV."""
        # zh: 完全写满了缓存 KV 的块数。
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last block (1 … block_size)."""
        # zh: 最后一块里的 token 数（1 … block_size）。
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """The token ids that block ``i`` of this sequence holds (the last one may be partial)."""
        # zh: 这个序列的第 ``i`` 块装着的 token id（最后一块可能没写满）。
        assert 0 <= i < self.num_blocks, f"block {i} of a sequence of {self.num_blocks} blocks"
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self._status.name}, tokens={self.num_tokens} "
                f"(prompt {self.num_prompt_tokens}), cached={self.num_cached_tokens}, "
                f"scheduled={self.num_scheduled_tokens}, blocks={self.block_table})")


def checked_token_ids(token_ids: Iterable[int]) -> list[int]:
    """A prompt's token ids as a list of ints, or a TypeError / ValueError that says what is wrong."""
    # zh: 提示词的 token id，作为一个 int 列表；出错时抛出 TypeError / ValueError，说明哪里不对。
    # en: Lists, tuples, NumPy arrays and 1-D tensors are fine; text and unordered
    # en: collections are mistakes.
    # zh: 列表、元组、NumPy 数组和一维张量都可以；字符串和无序集合则是写错了。
    if isinstance(token_ids, (str, bytes, bytearray, memoryview, Mapping, Set)) or not isinstance(token_ids, Iterable):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    token_ids = [_token_id(token, i) for i, token in enumerate(token_ids)]
    if not token_ids:
        raise ValueError("token_ids is empty: a prompt needs at least one token")
    return token_ids


def _token_id(value: object, position: int) -> int:
    # en: operator.index accepts Python and NumPy integers but not floats or strings.
    # zh: operator.index 接受 Python 和 NumPy 的整数，但不接受浮点数或字符串。
    if isinstance(value, bool):
        raise TypeError(f"token id at position {position} is a bool, not an int")
    try:
        token = operator.index(value)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(f"token id at position {position} must be an int, got {kind} {value!r}") from None
    if token < 0:
        raise ValueError(f"token id at position {position} is negative ({token})")
    return token

# %% [markdown] tags=["en"]
# ### Two Python lessons in upstream's constructor
#
# The first article stops at two lines of upstream's `Sequence.__init__`, and both deserve a cell.
#
# - `def __init__(self, token_ids, sampling_params = SamplingParams())`. Python evaluates a default
#   once, when `def` runs, so every sequence built without parameters receives the *same* object.
#   Upstream gets away with it: it copies three numbers out of the object and nobody changes it.
#   Had one caller changed it, every later default would have changed too. Ours keeps the whole
#   object, so its default is `None`, replaced by a new `SamplingParams()` in each call, and the
#   dataclass is frozen besides.
# - `self.token_ids = copy(token_ids)`. A shallow copy, a new list holding the same ints, is
#   enough: ints never change, and the list is what the sequence appends to. Without it, every
#   generated token would also grow the caller's prompt. `checked_token_ids` builds a new list too.

# %% [markdown] tags=["zh"]
# ### 上游构造函数里的两个 Python 知识点
#
# 第一篇文章专门讲了上游 `Sequence.__init__` 里的两行代码，两处都值得写一个单元来验证。
#
# - `def __init__(self, token_ids, sampling_params = SamplingParams())`。Python 只在执行 `def` 时对默认值求值一次，
#   所以不传参数构建的每个序列拿到的都是*同一个*对象。上游没出问题，是因为它只从这个对象里抄出三个数，而且没人改动它；
#   一旦某个调用者改了它，之后所有用默认值的序列都会跟着变。本书保存的是整个对象，所以默认值写成 `None`，每次调用时
#   再换成一个新的 `SamplingParams()`，而且这个 dataclass 本身是冻结的。
# - `self.token_ids = copy(token_ids)`。浅拷贝（一个新列表，装着同样的 int）就够了：int 不会变，而序列要往列表里
#   追加 token。不拷贝的话，每生成一个 token，调用者的提示词也会跟着变长。`checked_token_ids` 同样构建了一个新列表。

# %% two Python lessons
from dataclasses import FrozenInstanceError, dataclass


@dataclass
class MutableParams:
    """Like upstream's SamplingParams: a plain dataclass, whose fields can be assigned."""
    # zh: 与上游的 SamplingParams 一样：一个普通的 dataclass，字段可以赋值。

    max_tokens: int = 64


def upstream_style(params: MutableParams = MutableParams()) -> MutableParams:  # noqa: B008 (the pitfall itself)
    return params


first_call, second_call = upstream_style(), upstream_style()
# en: One caller changes "its" parameters ...
# zh: 一个调用者修改“自己的”参数……
first_call.max_tokens = 1
# en: ... and every caller had the same object: the default was built once, when `def` ran.
# zh: ……而所有调用者拿到的是同一个对象：默认值只在执行 `def` 时构建了一次。
shared = first_call is second_call and upstream_style().max_tokens == 1

one, two = Sequence([1, 2], block_size=4), Sequence([3], block_size=4)
fresh = one.sampling_params is not two.sampling_params and one.sampling_params == SamplingParams()
try:
    one.sampling_params.max_tokens = 1  # type: ignore[misc]
    raise AssertionError("SamplingParams must be frozen")
except FrozenInstanceError:
    pass

prompt = [5, 6, 7]
generating = Sequence(prompt, block_size=4)
generating.append_token(8)
print(say("a mutable default, changed by one caller, changed for all: {shared}; ours: a fresh, frozen SamplingParams "
          "per sequence: {fresh}; the caller's prompt after generating: {prompt}", shared=shared, fresh=fresh,
          prompt=prompt))
assert shared and fresh
assert prompt == [5, 6, 7] and generating.token_ids == [5, 6, 7, 8]
# en: Ids follow the order in which the sequences were made.
# zh: 编号的先后就是序列创建的先后。
assert one.seq_id < two.seq_id < generating.seq_id

# %% [markdown] tags=["en"]
# ## See it: the counters through a chunked prefill and three decode steps
#
# We play the scheduler by hand. A prompt of 10 tokens, blocks of 4 tokens, and a step budget
# of 6 tokens: the prompt does not fit one step, so its prefill is **chunked** into 6 + 4
# tokens. After each step, the engine's postprocess does what `finish_step` does here: the
# computed tokens become cached, and the sampled token is appended **only if the whole prompt
# has been computed**. After a partial chunk the last logits only predict a position inside
# the prompt, so the model runner (chapter 09) samples nothing for it (it passes `-1`) and
# postprocess ignores the value; our `finish_step` ignores its `sampled_token` the same way.
#
# Watch the status column too. A sequence whose prompt is only partly computed is still
# **WAITING**: the scheduler keeps it at the head of the waiting queue, holding its blocks, and
# sets it RUNNING in the step that schedules its **last** chunk (chapter 04). The drawing above
# says the same: "prefill chunk" loops on WAITING. The test suite runs this very example
# through chapter 04's scheduler and fails if the two chapters ever disagree.

# %% [markdown] tags=["zh"]
# ## 看它运行：分块 prefill 与三个 decode 步中的计数器
#
# 我们手动扮演调度器。提示词有 10 个 token，每块 4 个 token，每步预算 6 个 token：提示词一步放不下，
# 所以 prefill 拆成 6 + 4 个 token 两个**分块**。每一步之后，引擎的 postprocess（后处理）做的事和这里的
# `finish_step` 一样：算过的 token 变为已缓存；**只有整个提示词都算完时**，才把采样得到的 token 追加上去。
# 分块未完成时，最后一行 logits 只是对提示词内部某个位置的预测，所以模型执行器（第 09 章）不为它采样（传入 `-1`），
# 后处理也忽略这个值；这里的 `finish_step` 同样忽略它的 `sampled_token`。
#
# 也留意状态这一列。提示词只算了一部分的序列仍处于 **WAITING**：调度器让它带着自己的块留在等待队列队头，直到调度
# 它的**最后一个**分块的那一步，才把它设为 RUNNING（第 04 章）。上面的状态图也是这么画的：“prefill chunk”是 WAITING
# 上的自环。测试套件会把这个例子原样交给第 04 章的调度器去跑，两章的说法一旦不一致，测试就会失败。

# %%
from nanovllm.engine.sequence import Sequence, SequenceStatus


def finish_step(seq: Sequence, sampled_token: int) -> bool:
    """What the scheduler's postprocess does with one sequence after a step."""
    # zh: 一步之后，调度器的后处理对一个序列做什么。
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.num_scheduled_tokens = 0
    if seq.num_cached_tokens < seq.num_tokens:
        # en: Partial prefill chunk: nothing to append, the value is ignored.
        # zh: 只算了部分提示词的 prefill 分块：没有 token 可追加，传入的值被忽略。
        return False
    seq.append_token(sampled_token)
    return True


def row(step: str, seq: Sequence) -> tuple:
    return (step, seq.status.name, seq.num_tokens, seq.num_cached_tokens, seq.num_scheduled_tokens,
            seq.num_blocks, seq.last_block_num_tokens)


seq = Sequence(list(range(100, 110)), SamplingParams(temperature=0, max_tokens=8), block_size=4)
trace = [row("created", seq)]

# en: Chunk 1: tokens 0..5; the prompt is not done, so it stays WAITING.
# zh: 分块 1：token 0..5；提示词还没算完，所以它仍是 WAITING。
seq.num_scheduled_tokens = 6
trace.append(row("prefill chunk 1", seq))
assert finish_step(seq, sampled_token=999) is False
trace.append(row("  after step", seq))

# en: Its last chunk is scheduled: from this step on it runs.
# zh: 轮到最后一个分块：从这一步起，序列处于运行状态。
seq.status = SequenceStatus.RUNNING
# en: Chunk 2: tokens 6..9.
# zh: 分块 2：token 6..9。
seq.num_scheduled_tokens = 4
assert seq.scheduled_token_ids == [106, 107, 108, 109]
trace.append(row("prefill chunk 2", seq))
assert finish_step(seq, sampled_token=7) is True
trace.append(row("  after step", seq))

for sampled in (8, 9, 10):
    # en: Decode: compute the last token.
    # zh: decode：计算最后一个 token。
    seq.num_scheduled_tokens = 1
    trace.append(row("decode", seq))
    finish_step(seq, sampled)
    trace.append(row("  after step", seq))

header = (say("step"), "status", "num_tokens", say("cached"), say("scheduled"), "num_blocks", "last_block")
print(f"{header[0]:<16}" + "".join(f"{h:>11}" for h in header[1:]))
for r in trace:
    print(f"{say(r[0]):<16}" + "".join(f"{v!s:>11}" for v in r[1:]))

# %% [markdown] tags=["en"]
# ## Check it
#
# The trace above is asserted, not just printed. Read the last rows: after the third decode
# step the sequence holds 14 tokens. Its 13th token (index 12) was appended after the second
# decode step, when `num_tokens` became 13 and `13 % 4 == 1`: that is the moment a **new block**
# is needed, because the *next* step writes that token's KV into block 3. Chapter 02 allocates
# a block exactly at `len(seq) % block_size == 1`, which is correct, not an off-by-one.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 上面的轨迹不只是打印出来，而是用断言检查过的。看最后几行：第三个 decode 步之后序列有 14 个 token。
# 第 13 个 token（下标 12）是在第二个 decode 步之后追加的，那时 `num_tokens` 变成 13，且 `13 % 4 == 1`：
# 正是这一刻需要一个**新块**，因为*下一步*要把这个 token 的 KV 写进第 3 块。第 02 章恰好在
# `len(seq) % block_size == 1` 时分配新块，这是对的，不是差一错误。

# %%
expected = [
    ("created", "WAITING", 10, 0, 0, 3, 2),
    ("prefill chunk 1", "WAITING", 10, 0, 6, 3, 2),
    ("  after step", "WAITING", 10, 6, 0, 3, 2),
    ("prefill chunk 2", "RUNNING", 10, 6, 4, 3, 2),
    ("  after step", "RUNNING", 11, 10, 0, 3, 3),
    ("decode", "RUNNING", 11, 10, 1, 3, 3),
    ("  after step", "RUNNING", 12, 11, 0, 3, 4),
    ("decode", "RUNNING", 12, 11, 1, 3, 4),
    ("  after step", "RUNNING", 13, 12, 0, 4, 1),
    ("decode", "RUNNING", 13, 12, 1, 4, 1),
    ("  after step", "RUNNING", 14, 13, 0, 4, 2),
]
assert trace == expected
# en: The 999 passed after chunk 1 was ignored.
# zh: 分块 1 之后传入的 999 被忽略了。
assert seq.completion_token_ids == [7, 8, 9, 10]
assert seq.block(3) == [9, 10] and seq.last_token == 10
print(say("the worked example holds"))

# %% [markdown] tags=["en"]
# The status only moves along the drawn arrows, and bad input is refused with a clear message:

# %% [markdown] tags=["zh"]
# 状态只能沿着图中的箭头变化；错误的输入一律拒绝，并给出清楚的报错信息：

# %%
# en: Preempted: back to waiting.
# zh: 被抢占：回到等待状态。
seq.status = SequenceStatus.WAITING
seq.status = SequenceStatus.RUNNING
seq.status = SequenceStatus.FINISHED
try:
    seq.status = SequenceStatus.RUNNING
    raise AssertionError("a finished sequence must not run again")
except RuntimeError as error:
    print("RuntimeError:", error)

for bad_call in (
    lambda: Sequence([], block_size=4),
    lambda: Sequence("hello", block_size=4),
    lambda: Sequence([1, 2.5], block_size=4),
    lambda: Sequence([1, -2], block_size=4),
    lambda: SamplingParams(temperature=-0.5),
    lambda: SamplingParams(max_tokens="8"),
):
    try:
        bad_call()
        raise AssertionError("bad input was accepted")
    except (TypeError, ValueError) as error:
        print(f"{type(error).__name__}: {error!s}")

# %% [markdown] tags=["en"]
# ## What we built
#
# - `SamplingParams`: validated generation settings; `temperature=0` is greedy.
# - `Sequence`: tokens, the five counters, the block table and its arithmetic
#   (`num_blocks`, `block(i)`, `last_block_num_tokens`), and a guarded status.
#
# That is upstream's `Sequence`, checked. Later chapters add to this class where their story
# needs it: chapter 05 the fields of parallel sampling (`fork`), chapter 17 the slim form in
# which a sequence travels to the other ranks, chapter 18 the tokens that the GPU is still
# computing.
#
# Next, chapter 02 gives the block table something to point at: a pool of KV blocks.
#
# ## Exercises
#
# 1. A prompt of 37 tokens with `block_size=16`: how many blocks does it need, and how many
#    tokens sit in the last one? After how many generated tokens is the next block needed?
# 2. A sequence with a 10-token prompt is preempted after it generated 3 tokens: its blocks are
#    freed and `num_cached_tokens` goes back to 0. How many tokens does its next prefill
#    compute, and how many generated tokens does it hold after that step? (Come back after
#    chapter 03: prefix caching changes the first answer.)
# 3. A prompt of 10 tokens and a budget of 3 tokens per step: how many steps until the first
#    generated token is appended?
#
# The cell below checks the answers; try first, then read it.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `SamplingParams`：经过校验的生成设置；`temperature=0` 即贪心解码。
# - `Sequence`：token、五个计数器、块表及其算术（`num_blocks`、`block(i)`、`last_block_num_tokens`），
#   以及受保护的状态。
#
# 这就是上游的 `Sequence`，外加检查。后面几章会按需给这个类添加字段和方法：第 05 章添加并行采样的字段
# （`fork`），第 17 章添加序列传给其他 rank 时的精简形式，第 18 章添加 GPU 仍在计算的 token。
#
# 下一章（第 02 章）构建块表所指向的对象：KV 块池。
#
# ## 练习
#
# 1. 提示词 37 个 token，`block_size=16`：需要几个块？最后一块里有几个 token？生成多少个 token 后需要下一个块？
# 2. 一个序列的提示词有 10 个 token，生成 3 个 token 后被抢占：块全部释放，`num_cached_tokens` 回到 0。
#    它下一次 prefill 要计算多少个 token？那一步之后它有多少个生成的 token？（读完第 03 章再回来看：前缀缓存会改变
#    第一个答案。）
# 3. 提示词 10 个 token，每步预算 3 个 token：需要几步才能追加第一个生成的 token？
#
# 下面的单元会检查答案；先自己想，再看它。

# %%
# en: Exercise 1: 37 tokens -> 3 blocks, 5 tokens in the last; 16 - 5 = 11 more tokens fill it,
# en: so the 12th generated token (num_tokens = 49, 49 % 16 == 1) needs block 4.
# zh: 练习 1：37 个 token -> 3 块，最后一块 5 个；再有 16 - 5 = 11 个 token 填满它，
# zh: 所以第 12 个生成的 token（num_tokens = 49，49 % 16 == 1）需要第 4 块。
exercise = Sequence(list(range(37)), block_size=16)
assert (exercise.num_blocks, exercise.last_block_num_tokens) == (3, 5)
for generated in range(1, 13):  # noqa: B007 (read after the loop)
    exercise.append_token(0)
    if exercise.num_tokens % 16 == 1:
        break
assert generated == 12 and exercise.num_blocks == 4

# en: Exercise 2, played through the real block manager and scheduler (appendix A's FakeEngine drives them
# en: with a fake model): all 13 tokens, the prompt and the 3 generated ones, whose KV went with the blocks;
# en: the step samples the 4th generated token. With prefix caching (chapter 03) the freed full blocks are
# en: still cached, as long as nothing reused them: tokens 0-11 are hits and only token 12 is computed.
# zh: 练习 2，交给真正的块管理器和调度器来跑（附录 A 的 FakeEngine 用一个假模型驱动它们）：全部 13 个 token，即提示词
# zh: 加上已生成的 3 个，它们的 KV 随块一起没了；这一步采样出第 4 个生成的 token。有前缀缓存时（第 03 章），写满的块
# zh: 即使释放了，只要没被别人重新使用，就仍在缓存中：token 0-11 命中，只需计算 token 12。
from nanovllm.viz import FakeEngine

recomputed = {}
for prefix_caching in (False, True):
    engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4, enable_prefix_caching=prefix_caching)
    preempted = engine.add(list(range(10)), max_tokens=8)
    while preempted.num_completion_tokens < 3:
        engine.step()
    assert engine.preempt_newest() is preempted
    assert (preempted.status, preempted.num_cached_tokens, preempted.block_table) == (SequenceStatus.WAITING, 0, [])
    batch, is_prefill = engine.scheduler.schedule()
    assert batch == [preempted] and is_prefill
    recomputed[prefix_caching] = preempted.num_scheduled_tokens
    engine.scheduler.postprocess(batch, [4], is_prefill)
    assert preempted.num_cached_tokens == 13 and preempted.num_completion_tokens == 4
print(say("after a preemption at 3 generated tokens, the next prefill computes {plain} tokens; with prefix caching, "
          "{cached}", plain=recomputed[False], cached=recomputed[True]))
assert recomputed == {False: 13, True: 1}

# en: Exercise 3: chunks of 3 + 3 + 3 + 1 tokens: four steps.
# zh: 练习 3：分块为 3 + 3 + 3 + 1 个 token：共四步。
chunked, steps = Sequence(list(range(10)), block_size=16), 0
while chunked.num_completion_tokens == 0:
    chunked.num_scheduled_tokens = min(3, chunked.num_tokens - chunked.num_cached_tokens)
    finish_step(chunked, sampled_token=1)
    steps += 1
assert steps == 4
print(say("all exercise answers check out"))
