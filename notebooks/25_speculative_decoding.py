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
# # 25 · Speculative decoding: several tokens from one step
#
# **Goal.** Chapters 14 and 15 measured a decode step at batch 1 and found a fixed cost: the step reads
# every weight once whether it computes one token or five. This chapter spends that slack. A
# cheap **proposer** guesses the next *k* tokens (**draft tokens**), one forward of the model
# **verifies** all of them at once, and the engine keeps the drafts up to the first one the model
# disagrees with, plus one token of the model's own. With greedy decoding the output is exactly
# what the engine without speculation writes, and with sampling its distribution is the model's
# (a seeded request writes the same tokens); only the number of steps changes. By the end you
# can compute how many tokens a step yields from the **agreement rate** *α*, write the n-gram
# proposer (prompt lookup), and follow a sequence's block table as it grows by *k* draft slots
# and shrinks back to what the model accepted, without ever publishing a rejected token to the
# prefix cache. What it is worth, and when it is worth nothing, is measured in chapter 25b.

# %% [markdown] tags=["zh"]
# # 25 · 投机解码：一步得到多个 token
#
# **目标：** 第 14 章和第 15 章测过批大小为 1 时的 decode 步，发现它有固定开销：不管算一个 token 还是五个，一步都要把
# 每个权重读一遍。本章把这部分余量用起来。一个廉价的**提议器**（proposer）猜出接下来的 *k* 个 token（**草稿 token**，
# draft token），模型用一次前向计算把它们一并**验证**（verify），引擎保留草稿中模型第一次不同意之前的部分，再加上一个
# 模型自己给出的 token。贪心解码时，输出和不做投机的引擎写出的完全一样；采样时，输出的分布就是模型的分布（带种子的请求
# 写出同样的 token）；变的只是步数。读完本章，你能从**同意率** *α*（agreement rate）算出一步能产出多少 token，写出
# n-gram 提议器（prompt lookup），并跟着一个序列的块表走一遍：它先多出 *k* 个草稿槽位，再缩回到模型接受的部分，被拒绝
# 的 token 始终不会发布到前缀缓存。它值多少、什么时候一文不值，由第 25b 章来测。

# %%
import torch

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "agreement α": "同意率 α",
    "3.21 tokens per verify step with 4 drafts: agreement α = {alpha:.2f}; acceptance rate (E - 1) / k = {rate:.0%}":
        "每步 4 个草稿、每个验证步 3.21 个 token：同意率 α = {alpha:.2f}；接受率 (E - 1) / k = {rate:.0%}",
    "tokens per step for k = {ks}": "k = {ks} 时每步的 token 数",
    "drafts for {text!r}: {draft}": "{text!r} 的草稿：{draft}",
    "no earlier occurrence: {draft}": "找不到更早的出现：{draft}",
    "{when:<24} tokens {tokens}, cached {cached}, scheduled {scheduled}, blocks {blocks}, free {free}":
        "{when:<12} token {tokens}，已缓存 {cached}，本步调度 {scheduled}，块 {blocks}，空闲 {free}",
    "after the schedule": "调度之后",
    "drafts reserved": "预留草稿之后",
    "after acceptance": "接受之后",
    "resolved": "记录之后",
    "the model's tokens {target}: {kept} drafts kept, new token {new}":
        "模型给出的 token {target}：保留 {kept} 个草稿，新 token {new}",
    "published blocks: {published}": "已发布的块：{published}",
    "verify rows: {rows} (each sequence's last token and its drafts)":
        "验证的行数：{rows}（每个序列的最后一个 token 及其草稿）",
    "greedy tokens at every position: {tokens}": "每个位置上的贪心 token：{tokens}",
    "{name:<28} steps {steps:3d}, drafts {drafts:3d}, accepted {accepted:3d}, identical to plain decoding: {same}":
        "{name:<14} 步数 {steps:3d}，草稿 {drafts:3d}，接受 {accepted:3d}，与普通 decode 完全相同：{same}",
    "refused: {error}": "被拒绝：{error}",
    "{frames} frames; blocks given back after rejected drafts: {given_back}":
        "共 {frames} 帧；草稿被拒绝后交还的块（帧，块）：{given_back}",
    "preemption": "抢占", "chunked prefill": "分块 prefill", "n = 2, copy-on-write": "n = 2，写时复制",
    "ngram": "ngram", "replay": "重放", "replay, EOS": "重放，结束符", "first layer": "第一层",
    "the model itself": "模型自己",
    "speculative sampling gives p back: max |difference| {general:.1e} with a random q, {point:.1e} with a "
    "point mass; accepting every draft would give q, {tv:.2f} from p in total variation":
        "投机采样还原出 p：随机的 q 下最大 |差值| 为 {general:.1e}，q 只有一个取值时为 {point:.1e}；若接受每一个草稿，"
        "得到的是 q，与 p 的全变差距离为 {tv:.2f}",
    "sampling, seeded": "采样，带种子", "{case}, {proposer}: {steps} ->": "{case}，{proposer}：{steps} ->",
    "all exercise answers check out": "所有练习的答案都核对无误",
})

# %% [markdown] tags=["en"]
# ## The arithmetic: what a step is worth
#
# Say the proposer offers *k* drafts and the model agrees with each one with probability *α*,
# independently: *α* is the **agreement rate** of a draft. The step keeps draft *i* only if it
# kept drafts 1 … *i* − 1, and it always adds one token of the model's own (the correction at the
# first disagreement, or a **bonus token** after the last draft). So a step yields
#
# $$E = 1 + \alpha + \alpha^2 + \dots + \alpha^k = \frac{1 - \alpha^{k+1}}{1 - \alpha}$$
#
# tokens: 1 at *α* = 0, the token a plain decode step gives, and *k* + 1 as *α* → 1. The engine's
# counters measure another rate, the **acceptance rate**: drafts accepted ÷ drafts verified. A
# step stops accepting at the first disagreement, so it accepts *E* − 1 of its *k* drafts, and the
# acceptance rate, (*E* − 1) / *k*, stays well below *α*: chapter 25b's SmolLM2 run prints 56 %
# and 3.21 tokens per verify step with four drafts, which needs *α* ≈ 0.78 (the cell after the
# table solves for it).
#
# Speed is tokens per second, not per step. A verify step carries *k* + 1 query rows per sequence
# and waits for its tokens before the next step is scheduled, so it costs more than a decode step:
# 2.0 to 2.9 decode steps at small batches in chapter 25b's GPU measurements. The speed-up is *E*
# divided by that cost, and a wasted guess is not free: a verify step that keeps nothing gives one
# token for the price of two or three. At large batches each step is already full of work, the *k*
# extra rows per sequence are real work too, and speculation stops paying.

# %% [markdown] tags=["zh"]
# ## 算一笔账：一步值多少
#
# 假设提议器给出 *k* 个草稿，模型同意其中每一个的概率都是 *α*，彼此独立：*α* 就是一个草稿的**同意率**（agreement
# rate）。只有草稿 1 … *i* − 1 都保留了，这一步才会保留草稿 *i*；而且它总会再加上一个模型自己的 token（第一次不同意处
# 的更正，或者最后一个草稿之后的**附赠 token**，bonus token）。所以一步产出
#
# $$E = 1 + \alpha + \alpha^2 + \dots + \alpha^k = \frac{1 - \alpha^{k+1}}{1 - \alpha}$$
#
# 个 token：*α* = 0 时是 1，也就是普通 decode 步产出的那一个；*α* → 1 时趋近 *k* + 1。引擎的计数器测的是另一个比率，
# **接受率**（acceptance rate）：被接受的草稿数 ÷ 验证过的草稿数。一步在第一次不同意时就停止接受，所以 *k* 个草稿里只
# 接受 *E* − 1 个，接受率 (*E* − 1) / *k* 远低于 *α*：第 25b 章 SmolLM2 的运行在每步四个草稿时打印出接受率 56%、每个
# 验证步 3.21 个 token，要做到这一点，*α* 得在 0.78 左右（表格后面的单元把它解了出来）。
#
# 速度按每秒的 token 数算，而不是按每步。一个验证步为每个序列带上 *k* + 1 行查询，而且要等它的 token 出来才能调度下一
# 步，所以它比一个 decode 步贵：在第 25b 章 GPU 上的测量里，小批大小时它值 2.0 到 2.9 个 decode 步。加速比是 *E* 除以
# 这个代价；猜错也有代价：一个什么都没保留的验证步，花了两三步的代价，只换来一个 token。批大的时候，每一步本来就排满了
# 工作，每个序列多出的 *k* 行也是实打实的计算，投机就不再划算。

# %%
def tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens of one verify step: 1 + alpha + ... + alpha^k."""
    # zh: 一个验证步期望得到的 token 数：1 + alpha + ... + alpha^k。
    return sum(alpha**i for i in range(k + 1))


ks = (1, 2, 4, 8)
print(f"{say('agreement α'):>11} | " + say("tokens per step for k = {ks}", ks=", ".join(map(str, ks))))
for alpha in (0.0, 0.5, 0.7, 0.9):
    print(f"{alpha:>11.1f} | " + "  ".join(f"{tokens_per_step(alpha, k):5.2f}" for k in ks))
assert tokens_per_step(0.0, 4) == 1 and abs(tokens_per_step(0.8, 4) - (1 - 0.8**5) / 0.2) < 1e-12
# en: more drafts never hurt the expectation, but their returns shrink geometrically
# zh: 草稿越多，期望值不会变小，但收益按几何级数递减。
assert tokens_per_step(0.7, 8) - tokens_per_step(0.7, 4) < tokens_per_step(0.7, 4) - tokens_per_step(0.7, 0)


def agreement_for(tokens: float, k: int) -> float:
    """The agreement rate alpha at which a verify step of k drafts yields ``tokens`` on average (bisection)."""
    # zh: k 个草稿的验证步平均产出 ``tokens`` 个 token 时的同意率 alpha（二分法求得）。
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_step(middle, k) < tokens else (low, middle)
    return low


# en: Chapter 25b's SmolLM2 run: 3.21 tokens per verify step with 4 drafts, 56 % of the drafts accepted.
# zh: 第 25b 章 SmolLM2 的运行：每步 4 个草稿，每个验证步 3.21 个 token，56% 的草稿被接受。
alpha_run = agreement_for(3.21, 4)
print(say("3.21 tokens per verify step with 4 drafts: agreement α = {alpha:.2f}; acceptance rate (E - 1) / k = "
          "{rate:.0%}", alpha=alpha_run, rate=(3.21 - 1) / 4))
assert abs(alpha_run - 0.78) < 0.01 and abs((3.21 - 1) / 4 - 0.56) < 0.01

# %% [markdown] tags=["en"]
# ## Build it: a proposer that reads the request's own tokens
#
# The cheapest proposer needs no model at all. Text that an LLM writes often repeats what it has
# already seen: a summary quotes its source, code renames a variable it defined, an answer
# repeats the question. **Prompt lookup** (an *n*-gram proposer) takes the last *n* tokens of the
# sequence, finds an earlier place where the same *n* tokens occur, in the prompt or the output,
# and proposes the tokens that followed them there. It tries the longest *n* first (3 here),
# since a longer match is better evidence, and takes the first occurrence, whose continuation is
# the longest. When nothing matches it proposes nothing, and the step is a plain decode step.

# %% [markdown] tags=["zh"]
# ## 动手：只看请求自身 token 的提议器
#
# 最廉价的提议器根本不需要模型。LLM 写出的文本常常重复它已经见过的内容：摘要引用原文，代码沿用它定义过的变量名，回答复
# 述问题。**Prompt lookup**（一种 *n*-gram 提议器）取序列最后 *n* 个 token，在前面（提示词或输出里）找到这 *n* 个
# token 出现过的地方，把那里紧跟着的 token 作为草稿。它先试最长的 *n*（这里是 3），因为匹配越长证据越足；它取第一次出
# 现的位置，因为那里后面跟着的内容最长。什么都匹配不上时，它就不提议，这一步就是普通的 decode 步。

# %% ngram proposer
#| export engine.speculative
"""Speculative decoding: the proposers of the drafts a verify step checks, and the speculator that decides
how many drafts each sequence gets and counts what came of them."""
# zh: 投机解码：提议验证步所检查的草稿的提议器，以及决定每个序列得到多少草稿、并统计草稿结果的投机器。

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Prompt lookup: after the sequence's last n tokens, propose what followed their first earlier occurrence."""
    # zh: prompt lookup：在序列的最后 n 个 token 之后，提议它们更早第一次出现时后面跟着的内容。

    def __init__(self, num_speculative_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to ``num_speculative_tokens`` drafts (at most ``limit``) to follow ``token_ids``; [] if none match."""
        # zh: 跟在 ``token_ids`` 后面的至多 ``num_speculative_tokens`` 个草稿（不超过 ``limit``）；没有匹配时为 []。
        k = self.num_speculative_tokens if limit is None else min(self.num_speculative_tokens, limit)
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            if k <= 0:
                break
            # en: Every window of n tokens that ends before the last token: each has at least one follower.
            # zh: 每个在最后一个 token 之前结束的 n 个 token 的窗口：每个窗口后面至少跟着一个 token。
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = matches[0] + n
                return tokens[start : start + k].tolist()
        return []


# %% [markdown] tags=["en"]
# On words instead of token ids, so that you can read it: the sequence ends with "the block",
# which appeared before followed by "table grows by", and that is the proposal.

# %% [markdown] tags=["zh"]
# 为了方便阅读，用单词代替 token id：序列以 "the block" 结尾，这个词组前面出现过，后面跟着 "table grows by"，提议的草
# 稿就是它。

# %%
words = "the block table grows by k slots and then the block".split()
vocabulary = {word: i for i, word in enumerate(dict.fromkeys(words))}
spelled = {i: word for word, i in vocabulary.items()}
proposer = NgramProposer(num_speculative_tokens=3)
draft = proposer.propose([vocabulary[w] for w in words])
print(say("drafts for {text!r}: {draft}", text=" ".join(words), draft=[spelled[t] for t in draft]))
assert [spelled[t] for t in draft] == ["table", "grows", "by"]
fresh = proposer.propose([vocabulary[w] for w in "the block table grows".split()])
print(say("no earlier occurrence: {draft}", draft=fresh))
assert fresh == [] and proposer.propose([vocabulary[w] for w in words], limit=1) == [vocabulary["table"]]

# %% [markdown] tags=["en"]
# ### The other proposer: a smaller model
#
# Prompt lookup drafts only what the text has said before. A **draft model** drafts anything: a
# smaller model that shares the model's tokenizer continues each sequence greedily for k tokens,
# and the model verifies them as it verifies prompt lookup's. It needs its own KV cache, and an
# engine already is the thing that keeps one: `DraftModelProposer` runs the draft model in an
# `LLMEngine` of its own, with its own paged cache, block manager and prefix cache under the
# rules of chapters 02 to 04. Each proposal hands it the sequence as it stands; its prefix cache
# finds the blocks it filled before, so it computes only the tail since its last proposal (the
# tokens the model accepted, and the one it added) and the k drafts. A draft it wrote that the
# model rejected sits in a block that no prefix will ever match again: the cache is keyed by the
# tokens, so it cannot be served for a different continuation. Its drafts are greedy, hence
# deterministic: the acceptance rule of the section on sampling stays a comparison.
#
# Where no second checkpoint is at hand, `write_self_draft` makes one from the model itself: its
# first layers, its embedding, its final norm and its LM head, as a model directory (a "self
# draft": cheaper by the share of layers it drops, right as often as those first layers already
# know the next token). It teaches the mechanism; chapter 25b measures how little it is worth as a
# drafter. The settings are `speculative_method="draft"` and `speculative_model=DIRECTORY`; a
# vocabulary other than the model's is refused.

# %% [markdown] tags=["zh"]
# ### 另一种提议器：一个更小的模型
#
# Prompt lookup 只能提议文本前面说过的内容。**草稿模型**什么都能提议：一个与模型共用分词器的更小模型，对每个序列贪心地
# 续写 k 个 token，模型像验证 prompt lookup 的草稿那样验证它们。草稿模型需要自己的 KV 缓存，而维护 KV 缓存本来就是引擎
# 的活：`DraftModelProposer` 让草稿模型在一个独立的 `LLMEngine` 里运行，这个引擎有自己的分页缓存、块管理器和前缀缓存，
# 遵守第 02 到 04 章的规则。每次提议时，把序列当前的状态交给它；它的前缀缓存能找到它以前填满的块，所以它只需计算上次提
# 议以来新增的尾部（模型接受的 token，以及模型补上的那一个）和 k 个草稿。它写下、却被模型拒绝的草稿，留在一个任何前缀
# 都不会再匹配到的块里：缓存以 token 内容为键，这个块不可能被错用到另一种续写上。它的草稿是贪心生成的，因此是确定的：
# 采样那一节的接受规则仍然只是一次比较。
#
# 手头没有第二个检查点时，`write_self_draft` 用模型自己做一个：取它的前几层、嵌入层、最后的归一化和 LM head，写成一个
# 模型目录（“自草稿”：丢掉多少层，就省下多少计算；前几层已经知道下一个 token 时，它就猜得对）。它用来讲清机制；它作为
# 提议器有多不值钱，由第 25b 章来测。设置是 `speculative_method="draft"` 和 `speculative_model=目录`；词表与模型不同的
# 草稿模型会被拒绝。

# %% draft proposer
#| export engine.speculative
import json
import re
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from nanovllm.sampling_params import SamplingParams

# en: The draft engine's pool holds this many sequences of the longest length at once: drafts come only at small
# en: batches (chapter 25b, "When it pays").
# zh: 草稿引擎的块池能同时装下这么多个最长长度的序列：只有小批量时才会有草稿（见第 25b 章"什么时候划算"一节）。
DRAFT_POOL_SEQUENCES = 8


class DraftModelProposer:
    """A smaller model's greedy continuation as the drafts. The draft model runs in an engine of its own (its own
    paged KV cache, block manager and prefix cache, under the same rules as the model's); each proposal hands it
    the sequence as it stands, and its prefix cache spares it what it computed before."""
    # zh: 用一个更小模型的贪心续写作为草稿。草稿模型运行在它自己的引擎里（有它自己的分页 KV 缓存、块管理器和
    # zh: 前缀缓存，遵守与主模型相同的规则）；每次提议都把序列当前的样子交给它，而它的前缀缓存省去了它之前算过的部分。

    def __init__(self, engine: Any, num_speculative_tokens: int) -> None:
        """``engine``: an `LLMEngine` of the draft model, which the speculating engine makes
        (`draft_engine_settings`); this module need not know the engine's class."""
        # zh: ``engine``：草稿模型的一个 `LLMEngine`，由进行投机的引擎创建（`draft_engine_settings`）；
        # zh: 本模块不需要知道引擎的类。
        self.engine = engine
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to ``num_speculative_tokens`` drafts (at most ``limit``): the draft model's greedy tokens after
        ``token_ids``; [] where they would pass its longest sequence."""
        # zh: 至多 ``num_speculative_tokens`` 个草稿（不超过 ``limit``）：草稿模型在 ``token_ids`` 之后的贪心 token；
        # zh: 会超出它最长序列的地方为 []。
        return self.propose_many([token_ids], [limit])[0]

    def propose_many(self, token_lists: list[list[int]], limits: list[int | None]) -> list[list[int]]:
        """`propose` for several sequences, in one batch of the draft engine."""
        # zh: 对多个序列做 `propose`，在草稿引擎的一个批次里完成。
        wanted = [self.num_speculative_tokens if limit is None else min(self.num_speculative_tokens, limit)
                  for limit in limits]
        longest = self.engine.config.max_model_len
        asked = [i for i, (tokens, k) in enumerate(zip(token_lists, wanted, strict=True))
                 if k > 0 and len(tokens) + k <= longest]
        drafts: list[list[int]] = [[] for _ in token_lists]
        if asked:
            params = [SamplingParams(temperature=0, max_tokens=wanted[i], ignore_eos=True) for i in asked]
            outputs = self.engine.generate([list(token_lists[i]) for i in asked], params, use_tqdm=False)
            for i, output in zip(asked, outputs, strict=True):
                drafts[i] = output["token_ids"]
        return drafts

    def exit(self) -> None:
        self.engine.exit()


def draft_engine_settings(config: Any) -> dict[str, Any]:
    """The draft engine's settings, from the model's resolved `Config`: the same device, dtype, blocks and graphs;
    a pool of `DRAFT_POOL_SEQUENCES` sequences; synchronous steps (each proposal waits for its drafts anyway)."""
    # zh: 草稿引擎的设置，取自主模型已确定的 `Config`：相同的设备、dtype、块和图；一个容纳
    # zh: `DRAFT_POOL_SEQUENCES` 个序列的块池；同步的步（反正每次提议都要等它的草稿）。
    blocks_per_sequence = -(-config.max_model_len // config.kvcache_block_size)
    return {"device": config.device, "dtype": config.dtype, "kvcache_block_size": config.kvcache_block_size,
            "num_kvcache_blocks": DRAFT_POOL_SEQUENCES * blocks_per_sequence, "max_model_len": config.max_model_len,
            "enforce_eager": config.enforce_eager, "attention_backend": config.attention_backend,
            "async_scheduling": False}


def write_self_draft(model: str | Path, num_layers: int, path: str | Path) -> Path:
    """A draft model made of ``model``'s first ``num_layers`` decoder layers with its embedding, final norm and LM
    head, written as a model directory at ``path`` (config, tokenizer files, one safetensors file)."""
    # zh: 由 ``model`` 的前 ``num_layers`` 个解码器层及其嵌入、最后的归一化和 LM head 组成的草稿模型，
    # zh: 在 ``path`` 写成一个模型目录（config、分词器文件、一个 safetensors 文件）。
    source, target = Path(model), Path(path)
    config = json.loads((source / "config.json").read_text())
    layers = config["num_hidden_layers"]
    if not 1 <= num_layers < layers:
        raise ValueError(f"num_layers must be from 1 to {layers - 1} (the model has {layers} layers), not {num_layers}")
    target.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    kept: dict = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < num_layers:
                kept[name] = tensor
    save_file(kept, str(target / "model.safetensors"))
    # en: Everything else but the weights' index: tokenizer files, generation_config.json...
    # zh: 除了权重索引之外的其余文件：分词器文件、generation_config.json……
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copy2(file, target / file.name)
    return target

# %% [markdown] tags=["en"]
# ## Build it: draft slots in the block table
#
# A decode step computes each sequence's last token. A verify step computes the last token *and*
# its *k* drafts, so the drafts must have slots in the KV cache before the step runs. The
# scheduler has already picked the decode batch (and made room for one token per sequence,
# preempting if it had to). Two objects share what follows. The **speculator** owns everything
# about drafts that is not a block: the proposer, how many drafts each sequence may get, and what
# came of them. Its `propose` asks the proposer for each sequence's drafts within two limits:
#
# - the step's **token budget**: each draft is one more token the step computes;
# - `max_tokens`: a draft past the sequence's last allowed token could never be kept.
#
# The **scheduler** then gives the drafts slots: `reserve_drafts` appends each sequence's drafts
# to its tokens, as if they were real, and asks the block manager for the blocks they need. When
# the drafts would need a block that is not free, the sequence simply decodes without them:
# drafts never preempt anyone.
#
# Copy-on-write (chapter 05) needs nothing new: the only block a verify step writes that could
# be shared is the one holding the last token, and the schedule already gave the sequence its own
# copy; the drafts' further blocks are fresh.

# %% [markdown] tags=["zh"]
# ## 动手：块表里的草稿槽位
#
# decode 步计算每个序列的最后一个 token。验证步计算最后一个 token *以及*它的 *k* 个草稿，所以这一步运行之前，草稿
# 必须在 KV 缓存里有槽位。调度器已经选好了 decode 批次（并为每个序列的一个 token 腾出了位置，必要时会抢占）。
# 接下来的事由两个对象分担。**投机器**（speculator）负责草稿上一切与块无关的事：提议器、每个序列能拿几个草稿，以及这些
# 草稿最后保留了多少。它的 `propose` 在两条限制之内向提议器要每个序列的草稿：
#
# - 这一步的 **token 预算**：每个草稿都是这一步多算的一个 token；
# - `max_tokens`：超出序列最后一个允许位置的草稿永远不可能被保留。
#
# 然后由**调度器**给草稿分配槽位：`reserve_drafts` 把每个序列的草稿当作真实 token 追加到它的 token 后面，并向块管理器
# 要这些草稿需要的块。如果草稿需要的块没有空闲的，这个序列就不带草稿，照常 decode：草稿从不抢占任何序列。
#
# 写时复制（第 05 章）不需要任何改动：验证步写入的块中，唯一可能被共享的是放最后一个 token 的那个，而调度时已经给了这
# 个序列一份自己的副本；草稿用到的后续块都是新块。

# %% drafts in the block table
#| export engine.sequence
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.sequence import Sequence


@add_to_init(Sequence)
def _init_drafts(self) -> None:
    # en: How many of the sequence's last tokens are drafts that the step in progress verifies (0 outside it).
    # zh: 序列末尾有多少个 token 是正在进行的这一步要验证的草稿（这一步之外为 0）。
    self.num_draft_tokens = 0

# %% block manager trims
#| export engine.block_manager
from nanovllm.engine.block_manager import BlockManager


@add_to_class(BlockManager)
def trim(self, seq: Sequence) -> None:
    """Give back the blocks at the end of ``seq``'s table that hold none of its tokens (rejected draft slots)."""
    # zh: 交还 ``seq`` 块表末尾那些不装它任何 token 的块（被拒绝的草稿槽位）。
    while len(seq.block_table) > seq.num_blocks:
        # en: Drafts only ever got fresh blocks, held by this table alone and never published: the release frees them.
        # zh: 草稿只会拿到新块，只有这个块表持有，也从未发布：释放就把它们还回空闲队列。
        self.release(seq.block_table.pop())


# %% speculator
#| export engine.speculative
import weakref
from dataclasses import dataclass
from typing import Protocol

from nanovllm.engine.sequence import Sequence


class Proposer(Protocol):
    """Where drafts come from (`NgramProposer` is one), at most ``num_speculative_tokens`` a sequence. A proposer
    may also have ``propose_many(token_lists, limits)``, the drafts of several sequences at once (a draft model
    batches them), and ``exit()``, which releases what it holds."""
    # zh: 草稿从哪里来（`NgramProposer` 是其中一种），每个序列至多 ``num_speculative_tokens`` 个。提议器还可以有
    # zh: ``propose_many(token_lists, limits)``，一次给出多个序列的草稿（草稿模型会把它们合成一批），以及 ``exit()``，
    # zh: 释放它持有的东西。

    num_speculative_tokens: int

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]: ...


@dataclass
class DraftCounts:
    """What came of the drafts so far: draft tokens verified, draft tokens accepted (the acceptance rate is their
    ratio), sequences verified with drafts, one per sequence and step (1 + accepted / verifications is the mean
    tokens a verify step gives a sequence), and accepted drafts by their position among a step's drafts (0: the
    first draft), as far as any step drafted; and by position too, how many times a sequence had room for a draft
    there when the proposer was asked (what it proposed or not): kept over asked is how often a draft at that
    position came and was kept."""
    # zh: 到目前为止草稿的结果：验证过的草稿 token、被接受的草稿 token（接受率就是两者之比）、带草稿验证的序列数，
    # zh: 每个序列每步算一次（1 + accepted / verifications 就是一个验证步平均给一个序列的 token 数），以及按在一步
    # zh: 草稿中的位置统计的被接受草稿数（0：第一个草稿），统计到任何一步起草过的最远位置为止；还有同样按位置统计的、
    # zh: 向提议器要草稿时序列在那个位置有空位的次数（不管提议器给没给）：保留数除以要过的次数，就是那个位置上草稿
    # zh: 既来了又被保留的频率。

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    accepted_by_position: tuple[int, ...] = ()
    asked_by_position: tuple[int, ...] = ()


@dataclass
class Backoff:
    """The back-off rule's memory of one sequence: the recent mean of the tokens its verify steps gave (None before
    the first), the length it must reach before it gets drafts again, and how many times in a row it paused them."""
    # zh: 退避规则对一个序列的记忆：它最近几个验证步所得 token 数的平均值（第一个验证步之前为 None），它要再得到
    # zh: 草稿之前必须达到的长度，以及它连续暂停草稿的次数。

    recent_tokens_per_verify: float | None = None
    resume_at: int = 0
    pauses: int = 0


class Speculator:
    """Speculative decoding in one object: where drafts come from (the proposer), how many each sequence gets (the
    back-off rule, measured in chapter 25b), and what came of them (`counts`).

    The rule: at most ``max_verify_rows`` rows in a verify step (a row: a sequence's last token or one of its
    drafts), and no drafts at all when that leaves a sequence fewer than ``min_drafts``: fewer drafts as the batch
    grows, none past 5 sequences. And a verify step costs two or more decode steps: a sequence whose recent verify
    steps gave fewer than ``min_tokens_per_verify`` tokens gets no drafts for its next ``draft_pause_tokens``
    tokens, twice that if it pauses again without a good verify step in between, and so on up to
    ``max_draft_pause_tokens``: drafts that never pay cost less and less."""
    # zh: 把投机解码放进一个对象：草稿从哪里来（提议器），每个序列得到多少（退避规则，在第 25b 章实测），
    # zh: 以及草稿的结果（`counts`）。
    # zh:
    # zh: 规则：一个验证步至多 ``max_verify_rows`` 行（一行：一个序列的最后一个 token，或者它的一个草稿），如果这样
    # zh: 分给某个序列的草稿少于 ``min_drafts``，就完全不起草：批次越大草稿越少，超过 5 个序列就没有了。另外，一个验证步
    # zh: 的代价相当于两个或更多 decode 步：最近几个验证步所得 token 少于 ``min_tokens_per_verify`` 的序列，在接下来的
    # zh: ``draft_pause_tokens`` 个 token 内得不到草稿；如果中间没有一个好的验证步就再次暂停，暂停时间翻倍，依此类推，
    # zh: 直到 ``max_draft_pause_tokens``：从来不划算的草稿，代价越来越小。

    def __init__(self, proposer: Proposer, *, max_verify_rows: int = 16, min_drafts: int = 2,
                 min_tokens_per_verify: float = 2.0, draft_pause_tokens: int = 16,
                 max_draft_pause_tokens: int = 512) -> None:
        self.proposer = proposer
        self.max_verify_rows, self.min_drafts = max_verify_rows, min_drafts
        self.min_tokens_per_verify = min_tokens_per_verify
        self.draft_pause_tokens, self.max_draft_pause_tokens = draft_pause_tokens, max_draft_pause_tokens
        self.counts = DraftCounts()
        # en: Each sequence's memory lives as long as the sequence: a weak dictionary forgets one the engine let go.
        # zh: 每个序列的记忆与序列同生共死：弱引用字典会忘掉引擎已经放手的序列。
        self.backoff: weakref.WeakKeyDictionary[Sequence, Backoff] = weakref.WeakKeyDictionary()

    def drafts_per_sequence(self, batch: int) -> int:
        """How many drafts each sequence of a decode batch of ``batch`` may get: what `max_verify_rows` leaves
        it, or 0 when that is fewer than `min_drafts`."""
        # zh: ``batch`` 个序列的 decode 批次中每个序列可以得到多少草稿：`max_verify_rows` 留给它的数目，
        # zh: 如果少于 `min_drafts` 则为 0。
        drafts = self.max_verify_rows // max(1, batch) - 1
        return drafts if drafts >= self.min_drafts else 0

    def may_draft(self, seq: Sequence) -> bool:
        """False while ``seq`` pauses its drafts (its recent verify steps gave too few tokens)."""
        # zh: ``seq`` 暂停草稿期间（它最近的验证步所得 token 太少）为 False。
        backoff = self.backoff.get(seq)
        return backoff is None or len(seq) >= backoff.resume_at

    def wants_drafts(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of ``seqs`` may carry drafts (then it needs their last tokens to schedule)."""
        # zh: ``seqs`` 的 decode 步能否带草稿（能带时，它需要这些序列的最后一个 token 才能调度）。
        return self.drafts_per_sequence(len(seqs)) > 0 and any(self.may_draft(seq) for seq in seqs)

    def propose(self, seqs: list[Sequence], budget: int) -> list[list[int]]:
        """The drafts of each sequence of a scheduled decode step (none where the rule says so), ``budget`` tokens
        in all at most."""
        # zh: 调度好的 decode 步中每个序列的草稿（规则说没有的地方就没有），总共至多 ``budget`` 个 token。
        per_sequence = self.drafts_per_sequence(len(seqs))
        rooms = [0] * len(seqs)
        for index, seq in enumerate(seqs):
            # en: The sequence's last allowed token is a model token, never a kept draft.
            # zh: 序列最后一个允许的 token 由模型给出，绝不是保留下来的草稿。
            room = min(per_sequence, seq.sampling_params.max_tokens - seq.num_completion_tokens - 1)
            rooms[index] = room if room > 0 and self.may_draft(seq) else 0
        self.count_asked(rooms)
        drafts: list[list[int]] = [[] for _ in seqs]
        wanting = [index for index, room in enumerate(rooms) if room]
        # en: All at once where the budget covers every room (then each sequence gets what it would one at a time).
        # zh: 预算够所有序列的空间时一次要齐（这时每个序列得到的和一个一个要时一样）。
        propose_many = getattr(self.proposer, "propose_many", None)
        if propose_many is not None and wanting and sum(rooms) <= budget:
            batched = propose_many([seqs[i].token_ids for i in wanting], [rooms[i] for i in wanting])
            for index, draft in zip(wanting, batched, strict=True):
                drafts[index] = draft
            return drafts
        for index in wanting:
            room = min(rooms[index], budget)
            if room > 0:
                drafts[index] = self.proposer.propose(seqs[index].token_ids, room)
                budget -= len(drafts[index])
        return drafts

    def count_asked(self, rooms: list[int]) -> None:
        """Count, by position, the rooms for drafts that a step asks the proposer to fill (`DraftCounts`)."""
        # zh: 按位置统计一步请提议器填上的草稿空位（`DraftCounts`）。
        asked = list(self.counts.asked_by_position)
        asked += [0] * (max(rooms, default=0) - len(asked))
        for room in rooms:
            for position in range(room):
                asked[position] += 1
        self.counts.asked_by_position = tuple(asked)

    def record(self, seqs: list[Sequence], drafted: list[int], kept: list[int]) -> None:
        """What a verify step kept of each sequence's drafts: into the counters, and into each sequence's back-off
        memory (a sequence that drafted nothing in the step is not judged by it)."""
        # zh: 一个验证步保留了每个序列草稿中的多少：记入计数器，也记入每个序列的退避记忆
        # zh: （这一步里什么都没起草的序列不按这一步评判）。
        counts = self.counts
        for seq, num_drafts, num_kept in zip(seqs, drafted, kept, strict=True):
            counts.drafted += num_drafts
            counts.accepted += num_kept
            if not num_drafts:
                continue
            counts.verifications += 1
            positions = counts.accepted_by_position + (0,) * (num_drafts - len(counts.accepted_by_position))
            counts.accepted_by_position = tuple(count + (i < num_kept) for i, count in enumerate(positions))
            self._judge(seq, 1 + num_kept)

    def _judge(self, seq: Sequence, tokens: int) -> None:
        """Fold the tokens one verify step gave ``seq`` into its recent mean; pause its drafts if the mean falls
        below `min_tokens_per_verify` (twice as long as the pause before, when no good verify step came between)."""
        # zh: 把一个验证步给 ``seq`` 的 token 数并入它最近的平均值；平均值低于 `min_tokens_per_verify` 时暂停它的草稿
        # zh: （如果两次之间没有好的验证步，暂停时间是上一次的两倍）。
        backoff = self.backoff.setdefault(seq, Backoff())
        # en: A new sequence starts trusted: two verify steps that keep nothing pause it.
        # zh: 新序列一开始是被信任的：连续两个什么都没保留的验证步才让它暂停。
        recent = backoff.recent_tokens_per_verify
        recent = (2 * self.min_tokens_per_verify if recent is None else recent) / 2 + tokens / 2
        if tokens >= self.min_tokens_per_verify:
            backoff.pauses = 0
        if recent < self.min_tokens_per_verify:
            pause = min(self.draft_pause_tokens << backoff.pauses, self.max_draft_pause_tokens)
            backoff.resume_at = len(seq) + pause
            backoff.pauses += 1
            # en: Back on the line: after the pause, one good verify step keeps it drafting, one poor one pauses it
            # en: again.
            # zh: 回到及格线上：暂停之后，一个好的验证步让它继续拿草稿，一个差的验证步让它再次暂停。
            recent = self.min_tokens_per_verify
        backoff.recent_tokens_per_verify = recent

    def exit(self) -> None:
        """Release what the proposer holds (a draft model's engine)."""
        # zh: 释放提议器持有的东西（草稿模型的引擎）。
        release = getattr(self.proposer, "exit", None)
        if release is not None:
            release()


# %% scheduler reserves drafts
#| export engine.scheduler
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN


@add_to_class(Scheduler)
def budget_left(self, seqs: list[Sequence]) -> int:
    """How many more tokens a scheduled step of ``seqs`` may compute within `max_num_batched_tokens`."""
    # zh: 调度好的 ``seqs`` 的一步，在 `max_num_batched_tokens` 之内还能再计算多少个 token。
    return self.max_num_batched_tokens - sum(seq.num_scheduled_tokens for seq in seqs)


@add_to_class(Scheduler)
def reserve_drafts(self, seqs: list[Sequence], drafts: list[list[int]]) -> int:
    """Append each sequence's ``drafts`` to it, with the blocks their K/V needs; a sequence whose drafts would need
    a block that is not free decodes without them. Returns how many drafts the step now verifies."""
    # zh: 把每个序列的 ``drafts`` 追加给它，连同它们的 K/V 所需的块；草稿需要的块不空闲的序列不带草稿 decode。
    # zh: 返回这一步现在要验证多少个草稿。
    reserved = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        if not draft:
            continue
        assert seq.last_token != PENDING_TOKEN, f"drafts need the last token, still being computed: {seq}"
        for token_id in draft:
            seq.append_token(token_id)
        if not self.block_manager.can_append(seq):
            # en: No free block for the drafts: decode without them (drafts never preempt).
            # zh: 草稿没有空闲块可用：不带草稿照常 decode（草稿从不抢占）。
            seq.truncate(len(seq) - len(draft))
            continue
        self.block_manager.may_append(seq)
        seq.num_draft_tokens = len(draft)
        seq.num_scheduled_tokens += len(draft)
        reserved += len(draft)
    if reserved:
        self._notify("drafts", {"seqs": seqs})
    return reserved


# %% [markdown] tags=["en"]
# ## Build it: keep what the model agrees with, roll back the rest
#
# After the verify forward we know the model's token at each of the *k* + 1 positions (its greedy
# choice here; the section on sampling shows that a draw works the same way):
# `target[0]` after the last token, `target[i]` after draft *i*. Draft *i* is kept while it
# equals `target[i − 1]` and every earlier draft was kept. Then one more token is the model's
# own: `target[kept]`.
#
# The rollback is almost free, because of how the step is counted. `accept_drafts` cuts the
# sequence back to its accepted tokens and then leaves it exactly as a plain decode step would
# have found it *one token earlier*: the last kept token is "scheduled", everything before it
# cached. The scheduler's `advance` and `resolve` (chapter 18) then record `target[kept]` as that
# step's one sampled token, with everything they already do: the pending place, publishing the
# blocks whose tokens are all known, EOS and `max_tokens`. Two rules make it exact:
#
# - a kept draft that ends the sequence (an EOS, or the last token `max_tokens` allows) is not
#   kept as a draft: it becomes the new token, so that `resolve` finishes the sequence there;
# - `trim` hands back every block that now holds none of the sequence's tokens. The K/V of the
#   rejected positions inside the last kept block stays behind as garbage, which is harmless:
#   attention reads a sequence only up to its length, the next steps overwrite those slots, and
#   a block is published only once it is full of accepted tokens.

# %% [markdown] tags=["zh"]
# ## 动手：保留模型同意的部分，回滚其余部分
#
# 验证的前向计算完成后，我们就知道了模型在 *k* + 1 个位置上各自给出的 token（这里是贪心选出的；讲采样的那一节会说明，
# 换成抽样也是同样的道理）：`target[0]` 跟在最后一个 token 之后，`target[i]` 跟在草稿 *i* 之后。草稿 *i* 只要等于
# `target[i − 1]`，且前面的草稿都已保留，就保留下来。然后再加上一个模型自己的 token：`target[kept]`。
#
# 回滚几乎不费力，这得益于这一步的计数方式。`accept_drafts` 把序列截到被接受的 token 为止，再把它摆成普通 decode 步在
# *早一个 token* 时会看到的样子：最后一个保留的 token 是“本步调度”的，它之前的都已缓存。调度器的 `advance` 和
# `resolve`（第 18 章）再把 `target[kept]` 当作那一步唯一采样出的 token 记录下来，原有的工作照做不误：待定位置、发布
# token 全部已知的块、EOS 与 `max_tokens`。两条规则保证结果精确：
#
# - 保留下来的草稿如果会让序列结束（EOS，或 `max_tokens` 允许的最后一个 token），就不当作草稿保留，而是作为新 token，
#   这样 `resolve` 就在那里结束序列；
# - `trim` 交还所有不再存放该序列任何 token 的块。最后一个保留下来的块里，被拒绝位置上的 K/V 作为垃圾留在那里，但这无
#   害：注意力只读到序列长度为止，后面的步会覆盖这些槽位，而且一个块要写满被接受的 token 才会发布。

# %% scheduler accepts drafts
#| export engine.scheduler
@add_to_class(Scheduler)
def accept_drafts(self, seqs: list[Sequence], targets: list[list[int]]) -> tuple[list[int], list[int]]:
    """Keep each sequence's drafts up to the first that its ``targets`` (the model's token after the last token and
    after each draft) disagree with, and roll back the rest. Returns each sequence's one new token (the step is
    now a plain decode step of the last kept token, for `advance` and `resolve` to record) and how many drafts
    it kept."""
    # zh: 保留每个序列的草稿，直到第一个与它的 ``targets``（模型在最后一个 token 之后、以及每个草稿之后给出的 token）
    # zh: 不一致的草稿为止，其余的回滚。返回每个序列的一个新 token（这一步现在成了最后一个被保留 token 的普通
    # zh: decode 步，交给 `advance` 和 `resolve` 记录），以及它保留了多少个草稿。
    new_tokens, drafted, kept_drafts = [], [], []
    for seq, target in zip(seqs, targets, strict=True):
        assert len(target) == seq.num_scheduled_tokens, f"{len(target)} tokens to verify {seq}"
        start = len(seq) - seq.num_draft_tokens
        drafts = seq.token_ids[start - seq.first_token_index :]
        seq.truncate(start)
        for draft, token_id in zip(drafts, target, strict=False):
            if draft != token_id:
                break
            seq.append_token(token_id)
            if self._reached_end(seq, token_id, len(seq)):
                # en: An accepted draft that ends the sequence is its new token: resolve finishes it there.
                # zh: 会让序列结束的被接受草稿就是它的新 token：resolve 在那里结束序列。
                seq.truncate(len(seq) - 1)
                break
        kept = len(seq) - start
        seq.num_cached_tokens, seq.num_scheduled_tokens, seq.num_draft_tokens = len(seq) - 1, 1, 0
        self.block_manager.trim(seq)
        new_tokens.append(target[kept])
        drafted.append(len(drafts))
        kept_drafts.append(kept)
    self._notify("verified", {"seqs": seqs, "drafted": drafted, "kept": kept_drafts})
    return new_tokens, kept_drafts


@add_to_class(Scheduler)
def drop_drafts(self, seqs: list[Sequence]) -> None:
    """Undo `reserve_drafts` for a step that was never computed: the drafts and the blocks only they needed go."""
    # zh: 为一个从未被计算的步撤销 `reserve_drafts`：草稿以及只有它们需要的块都去掉。
    for seq in seqs:
        if seq.num_draft_tokens:
            seq.truncate(len(seq) - seq.num_draft_tokens)
            seq.num_scheduled_tokens -= seq.num_draft_tokens
            seq.num_draft_tokens = 0
            self.block_manager.trim(seq)

# %% [markdown] tags=["en"]
# One step by hand, with the model's tokens chosen by us: a prompt that repeats itself, blocks of 4
# tokens. The schedule gives the decode step its one token; a speculator with prompt lookup proposes
# three drafts, and `reserve_drafts` adds them and a block; the "model" agrees with the first draft
# only, so the step keeps one draft, adds its own token, and the block that held only rejected
# drafts goes back to the free list.

# %% [markdown] tags=["zh"]
# 手动走一步，模型给出的 token 由我们指定：一个自我重复的提示词，块大小为 4 个 token。调度给这个 decode 步分配一个
# token；用 prompt lookup 的投机器提议三个草稿，`reserve_drafts` 把它们连同一个新块加进来；“模型”只同意第一个草稿，于
# 是这一步保留一个草稿，再加上模型自己的 token，而只装着被拒绝草稿的那个块回到空闲队列。

# %%
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.speculative import Speculator
from nanovllm.sampling_params import SamplingParams


def show(when: str, seq: Sequence, scheduler: Scheduler) -> None:
    print(say("{when:<24} tokens {tokens}, cached {cached}, scheduled {scheduled}, blocks {blocks}, free {free}",
              when=say(when), tokens=seq.token_ids, cached=seq.num_cached_tokens, scheduled=seq.num_scheduled_tokens,
              blocks=seq.block_table, free=scheduler.block_manager.num_free_blocks))


scheduler = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
seq = Sequence([5, 6, 7, 8, 5, 6], SamplingParams(temperature=0, max_tokens=10), block_size=4)
scheduler.add(seq)
# en: the prefill, which samples 7
# zh: prefill，采样出 7。
seqs, _ = scheduler.schedule()
scheduler.postprocess(seqs, [7], True)
seqs, is_prefill = scheduler.schedule()
show("after the schedule", seq, scheduler)
speculator = Speculator(NgramProposer(num_speculative_tokens=3))
drafts = speculator.propose(seqs, scheduler.budget_left(seqs))
assert not is_prefill and drafts == [[8, 5, 6]] and scheduler.reserve_drafts(seqs, drafts) == 3
show("drafts reserved", seq, scheduler)
assert seq.token_ids == [5, 6, 7, 8, 5, 6, 7, 8, 5, 6] and len(seq.block_table) == 3
target = [8, 9, 4, 4]
new_tokens, kept = scheduler.accept_drafts(seqs, [target])
speculator.record(seqs, [3], kept)
print(say("the model's tokens {target}: {kept} drafts kept, new token {new}", target=target,
          kept=speculator.counts.accepted, new=new_tokens))
show("after acceptance", seq, scheduler)
assert new_tokens == [9] and kept == [1] and speculator.counts.accepted == 1
assert seq.token_ids == [5, 6, 7, 8, 5, 6, 7, 8] and len(seq.block_table) == 2
scheduler.postprocess(seqs, new_tokens, False)
show("resolved", seq, scheduler)
published = sorted(scheduler.block_manager.hash_to_block_id.values())
print(say("published blocks: {published}", published=published))
# en: the two full blocks hold accepted tokens only; the third block comes with the next decode step
# zh: 两个写满的块里只有被接受的 token；第三个块在下一个 decode 步才分配。
assert seq.token_ids[-1] == 9 and seq.num_cached_tokens == 8 and published == seq.block_table[:2]
assert scheduler.block_manager.num_free_blocks == 8 - 2

# %% [markdown] tags=["en"]
# ### Watch it: draft slots appear, then roll back
#
# The player (appendix A) replays the real scheduler with a fake model that repeats each prompt
# and breaks the pattern at every fifth index, so prompt lookup is right for a while and then
# wrong. Each step shows three frames: the schedule, the drafts (the block table grows by their
# slots, sometimes by a block), and what the model kept (the table shrinks back when drafts were
# rejected). Hover a block for its ref count and tokens.

# %% [markdown] tags=["zh"]
# ### 看它运行：草稿的槽位出现，然后回滚
#
# 播放器（附录 A）重放的是真实的调度器，只是模型换成了假的：这个模型重复每个提示词，并在下标为 5 的倍数处打破规律，所
# 以 prompt lookup 一会儿猜对、一会儿猜错。每一步有三帧：调度、草稿（块表随草稿的槽位变长，有时多出一个块），以及模型
# 保留了什么（草稿被拒绝时块表缩回去）。把鼠标移到块上，可以看到它的引用计数和 token。

# %% drafts animated
from IPython.display import display

from nanovllm.engine.speculative import NgramProposer, Speculator
from nanovllm.viz import FakeEngine, Player


def repeating_model(seq: Sequence, index: int) -> int:
    """The fake model's token at ``index`` of ``seq``: its prompt again and again, except 99 at every fifth index."""
    # zh: 假模型在 ``seq`` 下标 ``index`` 处的 token：一遍又一遍地重复它的提示词，只是每隔五个下标是 99。
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    return 99 if index % 5 == 0 else prompt[index % len(prompt)]


fake = FakeEngine(num_kvcache_blocks=12, kvcache_block_size=4)
fake.add([1, 2, 3], max_tokens=10)
fake.add([7, 8, 9, 10], max_tokens=10)
watched, lookup = fake.scheduler, Speculator(NgramProposer(num_speculative_tokens=4))
while not watched.is_finished():
    seqs, is_prefill = watched.schedule()
    if not is_prefill and watched.reserve_drafts(seqs, lookup.propose(seqs, watched.budget_left(seqs))):
        # en: row i of a sequence: the model's token after index start + i
        # zh: 序列的第 i 行：模型在下标 start + i 之后给出的 token
        targets = [[repeating_model(s, s.num_cached_tokens + i + 1) for i in range(s.num_scheduled_tokens)]
                   for s in seqs]
        tokens, _ = watched.accept_drafts(seqs, targets)
    else:
        tokens = [repeating_model(s, len(s)) for s in seqs]
    watched.postprocess(seqs, tokens, is_prefill)
rolling = fake.recording
display(Player(rolling))

frames = rolling["frames"]
given_back = [(i, v["freed"]) for i, f in enumerate(frames) if f["phase"] == "verified"
              for v in f["event"]["verified"] if v["freed"]]
# en: a block allocated only for drafts is free again in the frame that rejected them, and the pool ends whole
# zh: 只为草稿分配的块，在拒绝草稿的那一帧里重新空闲；块池最后是完整的。
assert given_back and all(set(blocks) <= set(frames[i]["free_list"]) for i, blocks in given_back)
assert sorted(frames[-1]["free_list"]) == list(range(12))
print(say("{frames} frames; blocks given back after rejected drafts: {given_back}", frames=len(frames),
          given_back=given_back))

# %% [markdown] tags=["en"]
# ## Build it: verify in one forward
#
# The verify step computes several query tokens per sequence: its last token and its drafts,
# each attending to the sequence's cached prefix and, causally, to the tokens before it. Chunked
# prefill (chapter 04) computes exactly that, but through the prefill path, which runs eagerly:
# at batch 1 on a GPU that costs tens of milliseconds of kernel launches, where a decode step
# replays a CUDA graph in one (chapter 14). So the verify step is written as a decode step
# instead. A sequence with *k* drafts becomes *k* + 1 decode rows that share its block table:
# row *i* holds the token at index start + *i* (start: the sequence's cached length), stores its
# K/V in that position's slot and sees the first start + *i* + 1 tokens. Each row is then exactly
# the decode step that would compute that position once the tokens before it were accepted, and
# since every layer stores the step's K/V before it attends, row *i* sees the drafts before it.
# The decode graphs of chapter 14 run it unchanged, its inputs written by chapter 18's
# `DecodeStaging.stage_rows` and sent in one copy: a batch of one sequence with four drafts
# replays the graph captured for 8 rows. (The rows read the shared prefix's K/V once each, *k* + 1
# times in all. With a short context that is little next to the weights a step reads; with a long
# one, the KV dominates a step's bytes, and *k* + 1 reads of it cost almost *k* + 1 decode steps.)
# Without a graph (on a CPU,
# or past the largest one) the same rows run eagerly through `prepare_verify`.
#
# Two things differ from a decode step. The LM head gives logits for every row, and every row is
# sampled through the runner's own sampler with its sequence's parameters, as the token of its
# index: the token a decode step would draw there (a non-finite row is marked exactly as
# chapter 08 marks it). The next section shows why sampling each row is all that speculative
# sampling needs here.

# %% [markdown] tags=["zh"]
# ## 动手：一次前向完成验证
#
# 验证步为每个序列计算多个查询 token：它的最后一个 token 和它的草稿，每个都关注序列已缓存的前缀，并按因果关系关注它前
# 面的 token。分块 prefill（第 04 章）算的正是这个，但它走的 prefill 路径是 eager 执行的：在 GPU 上批大小为 1 时，光启
# 动内核就要几十毫秒，而 decode 步只需重放一张 CUDA 图（第 14 章）。所以验证步改写成了 decode 步。带 *k* 个草稿的序列
# 变成共享同一个块表的 *k* + 1 个 decode 行：第 *i* 行放下标为 start + *i* 的 token（start：序列已缓存的长度），把它的
# K/V 存进这个位置的槽，看到前 start + *i* + 1 个 token。于是每一行恰好就是这样一个 decode 步：它前面的 token 都已被接
# 受，现在计算这个位置；又因为每一层都先存下这一步的 K/V 再做注意力，第 *i* 行能看到它前面的草稿。第 14 章的 decode 图
# 原样运行它，输入由第 18 章的 `DecodeStaging.stage_rows` 写好、一次拷贝送出：一个带四个草稿的序列，重放的是为 8 行捕
# 获的那张图。（这些行各自读一遍共享前缀的 K/V，一共 *k* + 1 遍。上下文短时，这比起一步要读的权重不算多；上下文长时，KV
# 占了一步读取的大部分字节，读 *k* + 1 遍就差不多等于 *k* + 1 个 decode 步。）没有图的时候（在 CPU 上，或超出最大的那
# 张图），同样的行经由 `prepare_verify` 以 eager 方式运行。
#
# 和 decode 步不同的地方有两处。LM head 为每一行都输出 logits；每一行都用执行器自己的采样器、按所属序列的参数，当作它
# 那个下标上的 token 来采样：抽出的正是 decode 步在那里会抽出的 token（非有限的行也像第 08 章那样做标记）。下一节说明，
# 为什么在这里对每一行采样，就是投机采样要做的全部。

# %% runner verifies
#| export engine.model_runner
from nanovllm.engine.cuda_graphs import DecodeStaging
from nanovllm.engine.model_runner import ModelRunner, _tensor
from nanovllm.layers.context import reset_context, set_decode_context
from nanovllm.layers.sampler import sampling_inputs


def verify_rows(seqs: list[Sequence]) -> tuple[list[Sequence], list[int], list[int]]:
    """The decode rows of a verify step: each row's sequence, token and position. A sequence with k drafts owns
    k + 1 rows that share its block table: row i holds the token at index start + i (start: its cached length)."""
    # zh: 验证步的 decode 行：每一行的序列、token 和位置。带 k 个草稿的序列拥有共用它的块表的 k + 1 行：
    # zh: 第 i 行装着下标为 start + i 的 token（start：它已缓存的长度）。
    row_seqs: list[Sequence] = []
    token_ids: list[int] = []
    positions: list[int] = []
    for seq in seqs:
        start, count = seq.num_cached_tokens, seq.num_scheduled_tokens
        assert start + count == len(seq), f"not ready to verify: {seq}"
        row_seqs += [seq] * count
        token_ids += seq.scheduled_token_ids
        positions += range(start, start + count)
    return row_seqs, token_ids, positions


def prepare_verify(
    seqs: list[Sequence], block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and positions of a verify step's rows (see `verify_rows`); installs the decode context, in which
    a row sees the tokens up to its own."""
    # zh: 验证步各行的 input_ids 和 positions（见 `verify_rows`）；装好 decode 上下文，其中每一行都能看到
    # zh: 直到它自己为止的 token。
    row_seqs, token_ids, positions = verify_rows(seqs)
    tables = [seq.block_table for seq in row_seqs]
    set_decode_context([position + 1 for position in positions], tables, block_size, device)
    return _tensor(token_ids, device), _tensor(positions, device)


@add_to_class(ModelRunner)
@torch.inference_mode()
def verify(self, seqs: list[Sequence]) -> list[list[int]]:
    """One forward over each sequence's scheduled tokens (its last token and its drafts) after its cached prefix;
    returns, per sequence, the model's token after each of them, sampled with the sequence's own parameters."""
    # zh: 在每个序列已缓存的前缀之后，对它调度的 token（它的最后一个 token 和它的草稿）做一次前向计算；
    # zh: 按序列返回模型在其中每一个之后给出的 token，用该序列自己的参数采样。
    return self.sample_verify(seqs, self.verify_logits(seqs))


@add_to_class(ModelRunner)
@torch.inference_mode()
def verify_logits(self, seqs: list[Sequence]) -> torch.Tensor:
    """A verify step's forward: the logits [rows, vocab] of each sequence's scheduled tokens, in `verify_rows`
    order."""
    # zh: 验证步的前向计算：每个序列调度的 token 的 logits [rows, vocab]，按 `verify_rows` 的顺序。
    if self.stopped:
        raise RuntimeError("this model runner was stopped (exit() was called)")
    self.copy_blocks(seqs)
    num_rows = sum(seq.num_scheduled_tokens for seq in seqs)
    if self.graphs is not None and self.graphs.covers(num_rows):
        # en: A decode step of num_rows rows, staged in one copy and replayed from its graph, as `replay_staged`
        # en: runs one.
        # zh: 一个 num_rows 行的 decode 步，像第 18 章那样一次拷贝送出输入，再从它的图重放。
        if self.staging is None:
            self.staging = DecodeStaging(self.graphs.buffers, self.block_size)
        self.staging.stage_rows(*verify_rows(seqs), self.graphs.bucket(num_rows))
        hidden_states = self.graphs.replay_loaded(num_rows)
    else:
        try:
            input_ids, positions = prepare_verify(seqs, self.block_size, self.device)
            hidden_states = self.model(input_ids, positions)
        finally:
            reset_context()
    # en: Every row is a position to sample: the LM head computes them all.
    # zh: 每一行都是要采样的位置：LM head 把它们全算出来。
    return self.model.compute_logits(hidden_states)


@add_to_class(ModelRunner)
def sample_verify(self, seqs: list[Sequence], logits: torch.Tensor) -> list[list[int]]:
    """Per sequence, the tokens that a verify step's ``logits`` (`verify_logits`) give after each of its scheduled
    tokens."""
    # zh: 按序列给出验证步的 ``logits``（`verify_logits`）在它每个调度的 token 之后给出的 token。
    # en: Row i of a sequence draws the token of index start + i (start: its first draft's index), with the
    # en: sequence's own parameters: what a decode step at that index would draw, seed included.
    # zh: 序列的第 i 行抽取下标为 start + i 的 token（start：它第一个草稿的下标），用序列自己的参数：
    # zh: 和在那个下标上的 decode 步抽取的一样，种子也一样（第 08 章）。
    counts = [seq.num_scheduled_tokens for seq in seqs]
    params, positions, samples = [], [], []
    for seq, count in zip(seqs, counts, strict=True):
        start = len(seq) - count + 1
        params += [seq.sampling_params] * count
        positions += range(start, start + count)
        samples += [seq.sample_index] * count
    tokens = self.sampler(logits, **sampling_inputs(params, positions, logits.device, samples)).tolist()
    rows, start = [], 0
    for count in counts:
        rows.append(tokens[start : start + count])
        start += count
    return rows


# %% [markdown] tags=["en"]
# On the tiny random Qwen3 of chapter 10: a plain engine decodes six tokens one step at a time;
# a second engine computes the same request's prefill, then verifies three drafts in one forward,
# the first two right (taken from the plain run) and the third wrong. The first three rows must be
# the plain run's next three tokens. The step is then undone, as a failed step would be.

# %% [markdown] tags=["zh"]
# 用第 10 章的随机小 Qwen3 试一试：一个普通引擎一步一个地 decode 出六个 token；另一个引擎先算同一个请求的 prefill，再
# 用一次前向验证三个草稿，前两个是对的（取自普通引擎的结果），第三个是错的。前三行必须就是普通引擎接下来的三个 token。
# 然后撤销这一步，就像撤销一个失败的步那样。

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM

tiny_qwen = str(build_tiny_model("qwen3"))
six = SamplingParams(temperature=0, max_tokens=6)
expected = LLM(tiny_qwen, device="cpu", kvcache_block_size=4, num_kvcache_blocks=16).generate(
    ["Small steps make"], six, use_tqdm=False)[0]["token_ids"]


llm = LLM(tiny_qwen, device="cpu", kvcache_block_size=4, num_kvcache_blocks=16)
llm.add_request("Small steps make", six)
# en: the prefill, which samples the first token
# zh: prefill，采样出第一个 token。
llm.step()
seqs, is_prefill = llm.scheduler.schedule()
# en: two right drafts (from the plain run), then a wrong one
# zh: 两个对的草稿（取自普通引擎的结果），然后一个错的
assert not is_prefill and llm.scheduler.reserve_drafts(seqs, [[expected[1], expected[2], expected[3] + 1]]) == 3
targets = llm.model_runner.verify(seqs)
print(say("verify rows: {rows} (each sequence's last token and its drafts)", rows=len(targets[0])))
print(say("greedy tokens at every position: {tokens}", tokens=targets[0]))
assert targets[0][:3] == expected[1:4]
llm.scheduler.drop_drafts(seqs)
llm.scheduler.rollback(seqs, is_prefill)
# en: back to the prompt and its first token, nothing scheduled
# zh: 回到提示词加第一个 token，没有调度任何东西。
assert len(seqs[0]) == len(llm.tokenizer("Small steps make")["input_ids"]) + 1 and not seqs[0].num_scheduled_tokens


# %% [markdown] tags=["en"]
# ## Sampling: why comparing is enough
#
# With a temperature, the model's token at a position is a draw from its distribution *p*, so
# "the model agrees" needs a meaning. **Speculative sampling** (Leviathan et al. and Chen et al.,
# 2023) gives one for any proposer that draws its draft *d* from a distribution *q*: accept *d*
# with probability min(1, *p*(*d*) / *q*(*d*)); on a rejection, draw from max(0, *p* − *q*),
# normalized; after the last accepted draft, draw the bonus token from *p*. The token that comes
# out is distributed exactly as *p*: the acceptance branch yields each *x* with probability
# min(*p*(*x*), *q*(*x*)), and the rejection branch, taken with probability 1 − Σ min(*p*, *q*) =
# Σ max(0, *p* − *q*), supplies exactly the missing mass *p* − min(*p*, *q*). The cell below checks
# that identity on a random *p* and *q*.
#
# Prompt lookup proposes deterministically: its *q* puts all its mass on *d*. The rule then reads:
# keep *d* with probability *p*(*d*), otherwise draw from *p* without *d*. That is exactly what
# drawing one token *x* from *p* and keeping the draft when *x* = *d* does. So the verify step
# samples every row with the sequence's own parameters (temperature, top-k, top-p), and
# `accept_drafts` compares, exactly as for greedy decoding, whose *p* is a point mass itself. One
# more property comes for free: a seeded request draws the token of index *i* from a generator
# seeded by (seed, *i*) (chapter 08), and a verify row draws the token of its own index, so a seeded
# request writes the same tokens with and without speculation. (A draft *model* that sampled its
# drafts would make *q* more than a point mass and need the general rule above; this book's draft
# model drafts greedily, so its drafts too are checked by the comparison.)

# %% [markdown] tags=["zh"]
# ## 采样：为什么比较一下就够了
#
# 有温度时，模型在一个位置上的 token 是从它的分布 *p* 中抽出来的，所以“模型同意”得先有个定义。**投机采样**（speculative
# sampling，Leviathan 等人与 Chen 等人，2023）给出了这个定义，适用于任何从分布 *q* 中抽取草稿 *d* 的提议器：以 min(1,
# *p*(*d*) / *q*(*d*)) 的概率接受 *d*；拒绝时，从归一化后的 max(0, *p* − *q*) 中抽取；在最后一个被接受的草稿之后，从
# *p* 中抽取附赠 token。这样得到的 token 恰好服从 *p*：接受分支以 min(*p*(*x*), *q*(*x*)) 的概率给出每个 *x*；走到拒绝
# 分支的概率是 1 − Σ min(*p*, *q*) = Σ max(0, *p* − *q*)，它补上的恰好是缺少的那部分概率 *p* − min(*p*, *q*)。下面的单
# 元在随机的 *p* 和 *q* 上检查这个等式。
#
# Prompt lookup 的提议是确定性的：它的 *q* 把全部概率放在 *d* 上。这时规则变成：以 *p*(*d*) 的概率保留 *d*，否则
# 从去掉 *d* 的 *p* 中抽取。这恰好就是从 *p* 中抽一个 token *x*、在 *x* = *d* 时保留草稿所做的事。所以验证步用
# 序列自己的参数（温度、top-k、top-p）对每一行采样，`accept_drafts` 做比较，和贪心解码时完全一样，而贪心解码的
# *p* 本身就把全部概率放在一个 token 上。还有一个性质是白送的：带种子的请求从以（种子，*i*）为种子的生成器中抽取
# 下标为 *i* 的 token（第 08 章），而验证步的每一行抽取的正是它自己那个下标的 token，所以带种子的请求不管投机与否
# 都写出同样的 token。（如果草稿*模型*的草稿是采样出来的，*q* 就不再把全部概率放在一个 token 上，需要的是上面那条
# 一般规则；本书的草稿模型是贪心地生成草稿的，所以它的草稿同样只需比较一下。）

# %%
def speculative_sample(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution of the token one round of speculative sampling emits, the draft drawn from q."""
    # zh: 草稿从 q 中抽取时，一轮投机采样输出的 token 的分布。
    accepted = torch.minimum(p, q)
    missing = (p - q).clamp(min=0)
    return accepted + (1 - accepted.sum()) * missing / missing.sum()


generator = torch.Generator().manual_seed(0)
p = (4 * torch.rand(8, generator=generator, dtype=torch.float64)).softmax(0)
q = (4 * torch.rand(8, generator=generator, dtype=torch.float64)).softmax(0)
point = torch.nn.functional.one_hot(torch.tensor(3), 8).double()
general, pointed = (speculative_sample(p, q) - p).abs().max(), (speculative_sample(p, point) - p).abs().max()
# en: the planted bug: accept every draft, and the output is distributed as q, not p
# zh: 埋下的错误：接受每一个草稿，输出的分布就是 q，而不是 p。
accept_all = 0.5 * (q - p).abs().sum()
print(say("speculative sampling gives p back: max |difference| {general:.1e} with a random q, {point:.1e} with a "
          "point mass; accepting every draft would give q, {tv:.2f} from p in total variation", general=general,
          point=pointed, tv=accept_all))
assert general < 1e-12 and pointed < 1e-12 and accept_all > 0.2

# %% [markdown] tags=["en"]
# ## The engine: a decode step with drafts is a verify step
#
# A speculating engine holds one `Speculator`, built with the engine from its settings, and
# chapter 18's `LLMEngine._launch` gains one branch. After the schedule, `_reserve_drafts` asks
# the speculator for a decode step's drafts and the scheduler for their slots; if any were
# reserved, `_verify` has the model runner verify instead of decoding, `accept_drafts` turns the
# verified step into the plain decode step that `advance` and `resolve` record, and the
# speculator records what was kept. The speculator never calls the scheduler, nor the scheduler
# the speculator: the engine hands each what the other gave. If the forward fails or Ctrl-C
# interrupts it, the drafts are dropped before chapter 20's `rollback`, so the same step can run
# again. `exit` releases the proposer's engine too, when it has one.
#
# The settings are `LLM(..., speculative_method="ngram", num_speculative_tokens=7)` (7 is the
# default once a method is chosen: one sequence's verify step then fills the decode graph of 8
# rows); they join chapter 09's `Config` here, with `add_fields` (appendix D), and a combination
# that cannot work is refused when the engine is built. A verify step is synchronous: its drafts
# come from the sequences' last tokens, which asynchronous scheduling (chapter 18) has not brought
# back yet when it schedules the next step. So chapter 18's `next_step_waits` hook says yes whenever
# the next decode step may carry drafts: the step in flight is collected alone, and the verify step
# runs to the end before the one after it is scheduled. Where the batch is too large to speculate
# (chapter 25b, "When it pays"), steps overlap as usual. Tensor parallelism is refused with a clear
# error: its ranks have no verify step yet.

# %% [markdown] tags=["zh"]
# ## 引擎：带草稿的 decode 步就是验证步
#
# 投机的引擎持有一个 `Speculator`，它随引擎一起按设置构建；第 18 章的 `LLMEngine._launch` 多了一个分支。调度之后，
# `_reserve_drafts` 向投机器要 decode 步的草稿，再向调度器要它们的槽位；如果预留到了草稿，`_verify` 就让模型执行器做验
# 证而不是 decode，`accept_drafts` 把验证过的这一步变成由 `advance` 和 `resolve` 记录的普通 decode 步，投机器再记下保
# 留了多少。投机器从不调用调度器，调度器也从不调用投机器：引擎把一方给出的东西交给另一方。如果前向计算失败或被 Ctrl-C
# 打断，草稿会在第 20 章的 `rollback` 之前丢掉，同一步因此可以再跑一次。如果提议器有自己的引擎，`exit` 也会把它释放。
#
# 设置是 `LLM(..., speculative_method="ngram", num_speculative_tokens=7)`（选定方法后默认为 7：一个序列的验证步正好填
# 满 8 行的 decode 图）；它们在这里用 `add_fields`（附录 D）加入第 09 章的 `Config`，不能同时使用的组合在构建引擎时就
# 会被拒绝。验证步是同步的：它的草稿来自各序列的最后一个 token，而异步调度（第 18 章）在调度下一步时，还没有把这些
# token 取回来。所以只要下一个 decode 步可能带草稿，第 18 章的钩子 `next_step_waits` 就回答“是”：先把正在计算的那一步
# 单独收回来，等验证步跑完，才调度再下一步。批大到不值得投机时（见第 25b 章“什么时候划算”一节），各步照常重叠。张量并行
# 会被拒绝，并给出明确的错误：它的各个 rank 还没有验证步。

# %% speculative settings
#| export config
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from nanovllm.book.literate import add_fields, add_to_class, add_to_init
from nanovllm.config import Config, _choice
from nanovllm.models.loader import read_model_dir
from nanovllm.utils.checks import check

# en: What speculative_method accepts besides None.
# zh: speculative_method 除 None 之外接受的值。
SPECULATIVE_METHODS = ("ngram", "draft")
# en: Drafts per step once a method is chosen: 7, so that one sequence's verify step, 8 rows, fills the decode graph
# en: it replays (two sequences fill the graph of 16). Measured on an H200 (the section "On a GPU, recorded"):
# en: batch 1 ran at 2.35x the plain engine with 7 drafts against 1.92x with 4, batch 2 at 1.48x against 1.26x.
# zh: 选了方法时每步的草稿数：7，这样一个序列的验证步有 8 行，正好填满它重放的那张 decode 图（两个序列填满 16 行的
# zh: 图）。在 H200 上测得（见“GPU 上的记录”）：批大小 1 时 7 个草稿跑出普通引擎的 2.35 倍，4 个草稿 1.92 倍；
# zh: 批大小 2 时 1.48 倍对 1.26 倍。
DEFAULT_SPECULATIVE_TOKENS = 7


# en: Speculative decoding: the proposer ("ngram", "draft" or None), drafts per step (None: 7 once a method is
# en: chosen), and for "draft" the smaller model's directory, which must share the model's tokenizer.
# zh: 投机解码：提议器（"ngram"、"draft" 或 None）、每步的草稿数（选了方法时 None 表示 7），以及 "draft" 用的那个更小
# zh: 模型的目录，它必须与模型共用分词器。
@add_fields(Config)
class _Speculation:
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None


@add_to_init(Config)
def _check_speculative_settings(self) -> None:
    self._check_speculation()


@add_to_class(Config)
def _check_speculation(self) -> None:
    """Refuse speculative settings that cannot work together; a method's default is DEFAULT_SPECULATIVE_TOKENS."""
    # zh: 拒绝无法配合使用的投机设置；每种方法的默认值是 DEFAULT_SPECULATIVE_TOKENS。
    method, drafts, draft_model = self.speculative_method, self.num_speculative_tokens, self.speculative_model
    if method is None:
        if drafts is not None:
            raise ValueError(f"num_speculative_tokens={drafts!r} needs a speculative_method (e.g. 'ngram')")
        if draft_model is not None:
            raise ValueError(f"speculative_model={draft_model!r} needs speculative_method='draft'")
        return
    _choice("speculative_method", method, SPECULATIVE_METHODS)
    self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS if drafts is None else check(
        "num_speculative_tokens", drafts, int, lambda n: 1 <= n <= 64, "in [1, 64]")
    if self.tensor_parallel_size > 1:
        raise ValueError("speculative decoding has no tensor-parallel verify step yet: use tensor_parallel_size=1")
    if method != "draft":
        if draft_model is not None:
            raise ValueError(f"speculative_model is read by speculative_method='draft', not {method!r}")
        return
    if draft_model is None:
        raise ValueError("speculative_method='draft' needs speculative_model: the directory of a smaller model "
                         "that shares this model's tokenizer")
    self.speculative_model = str(Path(draft_model).expanduser())
    vocab = read_model_dir(self.speculative_model).vocab_size
    if vocab != self.hf_config.vocab_size:
        raise ValueError(f"speculative_model {self.speculative_model} has a vocabulary of {vocab} tokens, this "
                         f"model {self.hf_config.vocab_size}: a draft model must share the model's tokenizer")
    mine, theirs = (AutoTokenizer.from_pretrained(path) for path in (self.model, self.speculative_model))
    if mine.get_vocab() != theirs.get_vocab() or _bpe_merges(mine) != _bpe_merges(theirs):
        raise ValueError(f"speculative_model {self.speculative_model} has a tokenizer of the same size with other "
                         "token ids or merges: a draft model must share the model's tokenizer")


def _bpe_merges(tokenizer: Any) -> list | None:
    """A fast tokenizer's BPE merges (None for a slow one, or another kind)."""
    # zh: 快速分词器的 BPE 合并规则（慢速分词器或其他类型的分词器返回 None）。
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else json.loads(backend.to_str())["model"].get("merges")


# %% engine verifies
#| export engine.llm_engine
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LaunchedStep, LLMEngine
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import (DraftModelProposer, NgramProposer, Proposer, Speculator,
                                         draft_engine_settings)
from nanovllm.utils.interrupts import interruptible


@add_to_init(LLMEngine)
def _init_speculator(self) -> None:
    # en: None without speculative_method. Assign its proposer another one to try it.
    # zh: 没有设置 speculative_method 时为 None。给它的 proposer 换一个赋值，就可以试别的提议器。
    method = self.config.speculative_method
    self.speculator = None if method is None else Speculator(build_proposer(self.config))


def build_proposer(config: Config) -> Proposer:
    """The proposer that ``config.speculative_method`` names; a draft model runs in an engine of its own."""
    # zh: ``config.speculative_method`` 指定的提议器；草稿模型运行在它自己的引擎里。
    drafts = config.num_speculative_tokens
    if config.speculative_method == "ngram":
        return NgramProposer(drafts)
    return DraftModelProposer(LLMEngine(config.speculative_model, **draft_engine_settings(config)), drafts)


@add_to_class(LLMEngine)
def next_step_waits(self) -> bool:
    """A decode step that may carry drafts waits for the step in flight: its proposer reads the last tokens."""
    # zh: 可能带草稿的 decode 步要等正在进行的那一步：它的提议器要读最后那些 token。
    return self.speculator is not None and self.speculator.wants_drafts(self.scheduler.running)


@add_to_class(LLMEngine)
def _launch(self, previous: LaunchedStep | None) -> LaunchedStep:
    """Schedule a step, hand it to the model runner and count it; a decode step that got drafts is a verify step,
    run to the end. Its tokens may still be computing otherwise."""
    # zh: 调度一步，交给模型执行器并计入账目；得到了草稿的 decode 步就是验证步，一直运行到结束。
    # zh: 否则它的 token 可能还在计算中。
    seqs, is_prefill = self.scheduler.schedule()
    # en: Drafts come from the last tokens: not in a prefill, nor while the step in flight (previous) computes them.
    # zh: 草稿来自最后的 token：prefill 步里没有，计算中的那一步（previous）还在算它们时也没有。
    verifying = not is_prefill and previous is None and self._reserve_drafts(seqs)
    num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
    tokens = self._verify(seqs) if verifying else self._compute(seqs, is_prefill, previous)
    counted, indices = self.scheduler.advance(seqs, is_prefill)
    return LaunchedStep(counted, is_prefill, num_tokens, indices, tokens)


@add_to_class(LLMEngine)
def _reserve_drafts(self, seqs: list[Sequence]) -> bool:
    """Give a scheduled decode step the speculator's drafts, in slots the scheduler reserves; whether it got any."""
    # zh: 把投机器的草稿交给调度好的 decode 步，放在调度器预留的槽位里；返回它是否得到了草稿。
    if self.speculator is None:
        return False
    drafts = self.speculator.propose(seqs, self.scheduler.budget_left(seqs))
    return self.scheduler.reserve_drafts(seqs, drafts) > 0


@add_to_class(LLMEngine)
def _verify(self, seqs: list[Sequence]) -> list[int]:
    """Run a decode step with drafts to the end and keep what the model agrees with (`accept_drafts`): each
    sequence's one new token, as a plain decode step has. If nothing comes of it (an error, Ctrl-C), the drafts go
    first, then `rollback` undoes the schedule, so the same step can run again."""
    # zh: 把带草稿的 decode 步运行到结束，保留模型同意的部分（`accept_drafts`）：每个序列一个新 token，
    # zh: 与普通 decode 步一样。如果这一步落空（出错、Ctrl-C），先去掉草稿，再由 `rollback` 撤销这次调度，
    # zh: 这样同一步可以再运行一次。
    try:
        # en: As in `_compute`: the one stretch where Ctrl-C gets through at once.
        # zh: 与 `_compute` 一样：Ctrl-C 能立刻生效的唯一一段。
        with interruptible():
            targets = self.model_runner.verify(seqs)
    except BaseException:
        self.scheduler.drop_drafts(seqs)
        self.scheduler.rollback(seqs, is_prefill=False)
        raise
    drafted = [seq.num_draft_tokens for seq in seqs]
    new_tokens, kept = self.scheduler.accept_drafts(seqs, targets)
    self.speculator.record(seqs, drafted, kept)
    return new_tokens


@add_to_class(LLMEngine)
def exit(self) -> None:
    """Release the model runner, and what the speculator's proposer holds (idempotent)."""
    # zh: 释放模型执行器，以及投机器的提议器持有的东西（可重复调用）。
    with self._one_call("exit"):
        self.model_runner.exit()
        if self.speculator is not None:
            self.speculator.exit()


# %% [markdown] tags=["en"]
# ## Try it: the same tokens in fewer steps
#
# Each engine below runs the same requests with and without speculation, and must produce
# the same tokens: with small blocks and a small cache, so that preemption happens; with chunked
# prefill; with `n = 2` samples of one prompt, whose forks share blocks until copy-on-write
# separates them; and with seeded sampling at temperature 0.8, which must give the same tokens
# too. After each run every block must be back on the free list.
#
# The tiny random Qwen3 of chapter 10 rarely repeats itself, so prompt lookup finds little to
# propose, and what it proposes is mostly rejected: the rejection path gets exercised, and the
# tokens must still be the same. To exercise acceptance as well, a second proposer replays what
# the plain run wrote, with every fifth position wrong on purpose: a proposer of known quality,
# so that runs of accepted drafts, a correction right after them and a bonus token after a fully
# accepted draft all occur. One more case makes the end of a sequence fall inside a draft: an
# end-of-sequence token chosen among the tokens the plain run wrote.

# %% [markdown] tags=["zh"]
# ## 试一试：更少的步数，同样的 token
#
# 下面每种情形都用同样的请求，分别在不投机和投机的引擎上各跑一遍，二者必须产出同样的 token：块小、缓存小，以便发生抢
# 占；分块 prefill；同一个提示词的 `n = 2` 个样本，它们分叉后共享块，直到写时复制把它们分开；以及温度 0.8、带种子的采
# 样，它也必须给出同样的 token。每次运行之后，每个块都必须回到空闲队列。
#
# 第 10 章的随机小 Qwen3 很少重复自己，所以 prompt lookup 找不到多少可提议的内容，提议的也大多被拒绝：这走的是拒绝的路
# 径，而 token 仍然必须相同。为了把接受的路径也走到，第二个提议器重放不投机那次运行写出的内容，并在下标为 5 的倍数的位
# 置上故意出错：这是一个质量已知的提议器，于是连续被接受的草稿、紧随其后的更正，以及草稿全部被接受后的附赠 token 都会
# 出现。还有一个情形让序列的结尾落在草稿里：从不投机那次运行写出的 token 中挑一个作为结束符。

# %%
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Small steps make small progress"]


class Replay:
    """Proposes what a plain run wrote after the same tokens, with every fifth position wrong on purpose."""
    # zh: 提议普通运行在同样的 token 之后写出的内容，并故意让每隔五个位置出错。

    def __init__(self, runs: list[list[int]], num_speculative_tokens: int = 4) -> None:
        self.runs, self.num_speculative_tokens = runs, num_speculative_tokens

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        k, n = min(self.num_speculative_tokens, limit or self.num_speculative_tokens), len(token_ids)
        for run in self.runs:
            if run[:n] == token_ids:
                return [token + 1 if (n + i) % 5 == 0 else token for i, token in enumerate(run[n : n + k])]
        return []


def run(settings: dict, params: SamplingParams, eos: set[int] = frozenset(), runs: list[list[int]] | None = None,
        **speculation: object) -> tuple[list[list[int]], int, LLM]:
    """The completions of ``prompts`` and the number of steps they took (runs: proposals replay these)."""
    # zh: ``prompts`` 的生成内容，以及它们用了多少步（runs：提议会重放这些）。
    llm = LLM(tiny_qwen, device="cpu", **settings, **speculation)
    llm.scheduler.eos_token_ids = frozenset(eos)
    # en: Rows for every sequence of these small batches (n = 2 makes six) to verify four drafts: the default
    # en: rule would turn the larger ones off (chapter 25b, "When it pays").
    # zh: 给这些小批里的每个序列（n = 2 时有六个）留出验证四个草稿的行：默认规则会关掉较大的批
    # zh: （第 25b 章“什么时候划算”一节）。
    if llm.speculator is not None:
        llm.speculator.max_verify_rows = 40
        if runs is not None:
            llm.speculator.proposer = Replay(runs)
    for prompt in prompts:
        llm.add_request(prompt, params)
    outputs, steps = {}, 0
    while not llm.is_finished():
        for output in llm.step()[0]:
            _, token_ids = output
            outputs[output.request_id, output.sample_index] = token_ids
        steps += 1
    # en: nothing leaked: every block is back on the free list
    # zh: 没有泄漏：每个块都回到了空闲队列。
    assert llm.scheduler.block_manager.num_free_blocks == llm.config.num_kvcache_blocks
    return [outputs[key] for key in sorted(outputs)], steps, llm


greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=False)
cases = {
    "preemption": ({"kvcache_block_size": 4, "num_kvcache_blocks": 14}, greedy),
    "chunked prefill": ({"kvcache_block_size": 4, "num_kvcache_blocks": 64, "max_num_batched_tokens": 6}, greedy),
    "n = 2, copy-on-write": ({"kvcache_block_size": 4, "num_kvcache_blocks": 64},
                             SamplingParams(temperature=0, max_tokens=20, n=2)),
    "sampling, seeded": ({"kvcache_block_size": 4, "num_kvcache_blocks": 64},
                         SamplingParams(temperature=0.8, seed=11, max_tokens=24)),
}
for name, (settings, params) in cases.items():
    plain, plain_steps, llm = run(settings, params)
    runs = [llm.tokenizer(prompt)["input_ids"] + plain[i * params.n] for i, prompt in enumerate(prompts)]
    eos = {plain[0][9]}
    ended, _, _ = run(settings, params, eos=eos)
    for proposer, kwargs in (("ngram", {}), ("replay", {"runs": runs}), ("replay, EOS", {"runs": runs, "eos": eos})):
        spec, spec_steps, llm = run(settings, params, speculative_method="ngram", **kwargs)
        expected, steps = (ended, None) if "eos" in kwargs else (plain, plain_steps)
        label = say("{case}, {proposer}: {steps} ->", case=say(name), proposer=say(proposer), steps=steps or "-")
        print(say("{name:<28} steps {steps:3d}, drafts {drafts:3d}, accepted {accepted:3d}, identical to plain "
                  "decoding: {same}", name=label, steps=spec_steps, drafts=llm.speculator.counts.drafted,
                  accepted=llm.speculator.counts.accepted, same=spec == expected))
        assert spec == expected
        if proposer == "replay":
            assert llm.speculator.counts.accepted > len(prompts) and spec_steps < plain_steps
    # en: the EOS run really ended early, inside an accepted stretch
    # zh: 带结束符的那次运行确实提前结束了，就在被接受的一段草稿之内。
    assert len(ended[0]) == 10 < len(plain[0])

# %% [markdown] tags=["en"]
# The draft model, on the same cases: a self draft of the tiny model's first layer (one of its
# two), and, as the other extreme, the model drafting for itself, whose every draft the model
# keeps. Both give the plain engine's tokens; what they change is the number of steps.

# %% [markdown] tags=["zh"]
# 再用同样的几种情形试草稿模型：一个是小模型第一层（它一共两层）做成的自草稿；另一个极端是模型给自己打草稿，这时每个草
# 稿都会被模型保留。两者给出的 token 都与普通引擎相同；它们改变的只是步数。

# %%
import tempfile

from nanovllm.engine.speculative import write_self_draft

self_draft = str(write_self_draft(tiny_qwen, 1, Path(tempfile.mkdtemp()) / "self-draft"))
for name, (settings, params) in cases.items():
    plain, plain_steps, _ = run(settings, params)
    for draft_name, draft_model in (("first layer", self_draft), ("the model itself", tiny_qwen)):
        spec, spec_steps, llm = run(settings, params, speculative_method="draft", speculative_model=draft_model)
        label = say("{case}, {proposer}: {steps} ->", case=say(name), proposer=say(draft_name), steps=plain_steps)
        print(say("{name:<28} steps {steps:3d}, drafts {drafts:3d}, accepted {accepted:3d}, identical to plain "
                  "decoding: {same}", name=label, steps=spec_steps, drafts=llm.speculator.counts.drafted,
                  accepted=llm.speculator.counts.accepted, same=spec == plain))
        assert spec == plain
        if draft_model == tiny_qwen and name != "sampling, seeded":
            # en: greedy drafts of the model itself are the model's greedy tokens: all kept
            # zh: 模型自己的贪心草稿就是模型的贪心 token：全部保留
            assert llm.speculator.counts.accepted == llm.speculator.counts.drafted > 0

# %% [markdown] tags=["en"]
# ## What it refuses
#
# Settings that cannot work together fail when the engine is built, with the fix in the message.

# %% [markdown] tags=["zh"]
# ## 它拒绝什么
#
# 不能一起工作的设置会在构建引擎时失败，错误信息里写着改法。

# %%
from nanovllm.config import DEFAULT_SPECULATIVE_TOKENS, Config
from nanovllm.engine.cuda_graphs import capture_sizes

refusals = {
    "unknown method": {"speculative_method": "medusa"},
    "drafts without a method": {"num_speculative_tokens": 4},
    "no drafts": {"speculative_method": "ngram", "num_speculative_tokens": 0},
    "tensor parallel": {"speculative_method": "ngram", "tensor_parallel_size": 2},
    "a draft method without a model": {"speculative_method": "draft"},
    "a draft model for prompt lookup": {"speculative_method": "ngram", "speculative_model": tiny_qwen},
    "another vocabulary": {"speculative_method": "draft",
                           "speculative_model": str(build_tiny_model("qwen3", vocab_size=300))},
}
for name, settings in refusals.items():
    try:
        Config.from_kwargs(tiny_qwen, device="cpu", **settings)
    except ValueError as error:
        print(say("refused: {error}", error=error))
    else:
        raise AssertionError(f"{name}: accepted {settings}")
# en: A method's default drafts: one sequence's verify step (its last token and the drafts) fills a decode graph.
# zh: 方法的默认草稿数：一个序列的验证步（最后一个 token 加上草稿）正好填满一张 decode 图。
default_drafts = Config.from_kwargs(tiny_qwen, device="cpu", speculative_method="ngram").num_speculative_tokens
assert default_drafts == DEFAULT_SPECULATIVE_TOKENS and 1 + default_drafts in capture_sizes(256)

# %% [markdown] tags=["en"]
# ## What we built
#
# - `engine.speculative.NgramProposer`: prompt lookup over the request's own tokens.
# - `engine.speculative.Speculator`: the proposer, the back-off rule (at most 16 verify rows, at
#   least two drafts a sequence, and a pause for a sequence whose verify steps give fewer than two
#   tokens, doubled while they keep failing) and the counters (`DraftCounts`), in one object.
# - `Sequence.num_draft_tokens`, `BlockManager.trim`, and the scheduler's `reserve_drafts`,
#   `accept_drafts` and `drop_drafts`: drafts get slots within the free list, and what the model
#   rejects goes back, block by block, before anything is published.
# - `ModelRunner.verify`: a decode step of one row per query token (the decode graphs replay it),
#   every row sampled as the token of its index with the sequence's parameters: with a
#   deterministic proposer, that is speculative sampling, and the output distribution (the tokens,
#   when seeded) is the model's.
# - `LLMEngine.speculator`, `_reserve_drafts` and `_verify`: a decode step with drafts is a verify
#   step, and `next_step_waits` lets it see the last tokens under asynchronous scheduling; the
#   settings `speculative_method` and `num_speculative_tokens`.
# - `engine.speculative.DraftModelProposer`: a smaller model's greedy drafts, from an engine of
#   its own (its paged cache, block manager and prefix cache), the step's sequences in one batch
#   (`propose_many`, which the speculator calls where the budget covers every sequence's room);
#   `write_self_draft` makes one of the model's first layers; the setting `speculative_model`.
# - The scheduler's "drafts" and "verified" events, which appendix A's player draws.
#
# What all this is worth is the next chapter's subject. Chapter 25b measures it on SmolLM2's real
# weights, with the benchmark `python -m nanovllm.bench --speculative` that set the back-off rule
# and the default of seven drafts; it measures the self draft, adds the `spec_decode` counters to
# the server's `/metrics`, and prints the GPU runs from their record. Not built yet: a draft model
# that samples its drafts (it would need the general rule of the section on sampling; greedy drafts
# do not), and a verify step under tensor parallelism.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `engine.speculative.NgramProposer`：在请求自己的 token 上做 prompt lookup。
# - `engine.speculative.Speculator`：把提议器、退避规则（验证步最多 16 行，每个序列至少两个草稿；验证步平均产出不到两
#   个 token 的序列暂停草稿，一直失败就加倍暂停）和计数器（`DraftCounts`）合在一个对象里。
# - `Sequence.num_draft_tokens`、`BlockManager.trim`，以及调度器的 `reserve_drafts`、`accept_drafts` 和 `drop_drafts`：
#   草稿在空闲队列允许的范围内拿到槽位，模型拒绝的部分在发布任何东西之前逐块退回。
# - `ModelRunner.verify`：每个查询 token 占一行的 decode 步（由 decode 图重放），每一行都按所属序列的参数、当作它那个
#   下标上的 token 来采样：提议器是确定性的时候，这就是投机采样，输出的分布（带种子时就是 token 本身）与模型一致。
# - `LLMEngine.speculator`、`_reserve_drafts` 和 `_verify`：带草稿的 decode 步就是验证步，`next_step_waits` 让它在异步
#   调度下也能看到最后的 token；设置项 `speculative_method` 和 `num_speculative_tokens`。
# - `engine.speculative.DraftModelProposer`：一个更小模型的贪心草稿，由它自己的引擎（自己的分页缓存、块管理器和前缀缓
#   存）生成，一步里的各个序列合成一批（`propose_many`；预算够所有序列的空间时，投机器就调用它）；`write_self_draft`
#   用模型的前几层做出一个草稿模型；设置项 `speculative_model`。
# - 调度器的 "drafts" 和 "verified" 事件（附录 A 的播放器把它们画出来）。
#
# 这一切值多少，是下一章的主题。第 25b 章在 SmolLM2 的真实权重上测量它，用的是定下退避规则和默认七个草稿的基准测试
# `python -m nanovllm.bench --speculative`；它还测量自草稿，给服务器的 `/metrics` 加上 `spec_decode` 计数器，并从记录
# 里打印各次 GPU 运行。还没有实现的：对草稿采样的草稿模型（它需要采样那一节的一般规则，贪心草稿不需要），以及张量并行下
# 的验证步。

# %% [markdown] tags=["en"]
# ## Exercises
#
# 1. With *k* = 4 drafts a step and an agreement rate *α* of 0.8, how many tokens does a verify step
#    yield on average? How many drafts would a step need to yield 4 tokens on average?
# 2. A sequence of 10 tokens (blocks of 4; the first 9 cached) gets 4 drafts, and the model keeps
#    only the first. How many blocks does the sequence hold after `accept_drafts`, and how many
#    of them does `resolve` publish?
# 3. On a GPU a verify step replays the smallest decode graph with at least one row per query
#    token (graphs of 1, 2, 4, 8 and 16 rows, then every 16). Which graph does one sequence with
#    4 drafts replay, and how many drafts could it carry in the same graph? And two sequences?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 练习
#
# 1. 每步 *k* = 4 个草稿、同意率 *α* 为 0.8 时，一个验证步平均产出多少个 token？要让一步平均产出 4 个 token，需要多少个
#    草稿？
# 2. 一个 10 个 token 的序列（块大小为 4，前 9 个已缓存）得到 4 个草稿，模型只保留第一个。`accept_drafts` 之后
#    这个序列持有几个块？`resolve` 会发布其中几个？
# 3. 在 GPU 上，验证步重放的是每个查询 token 至少一行的最小 decode 图（图有 1、2、4、8、16 行，之后每 16 行一个）。
#    一个带 4 个草稿的序列重放哪张图？同一张图里它最多能带几个草稿？两个序列呢？
#
# 下面的单元检查答案。

# %%
# en: Exercise 1: 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.36 tokens. The sum never reaches 1 / (1 - 0.8) = 5, and it
# en: first reaches 4 with k = 7 drafts (4.16).
# zh: 练习 1：1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.36 个 token。这个和永远到不了 1 / (1 - 0.8) = 5，
# zh: 到 k = 7 个草稿（4.16）时第一次达到 4。
assert abs(tokens_per_step(0.8, 4) - 3.3616) < 1e-9
assert min(k for k in range(1, 50) if tokens_per_step(0.8, k) >= 4) == 7

# en: Exercise 2: 10 + 1 kept = 11 tokens need 3 blocks (the fourth, for drafts only, is freed); resolve publishes
# en: the 2 blocks full of accepted tokens (tokens 0-7); the third holds 3 accepted tokens and the new one.
# zh: 练习 2：10 + 1 个保留的 = 11 个 token 需要 3 个块（只为草稿分配的第四个被释放）；resolve 发布 2 个写满被接受
# zh: token 的块（token 0-7）；第三个块放着 3 个被接受的 token 和新 token。
scheduler = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
seq = Sequence(list(range(9)), SamplingParams(temperature=0, max_tokens=20), block_size=4)
scheduler.add(seq)
seqs, _ = scheduler.schedule()
scheduler.postprocess(seqs, [9], True)


seqs, _ = scheduler.schedule()
assert len(seq) == 10 and seq.num_cached_tokens == 9
assert scheduler.reserve_drafts(seqs, [[2, 3, 4, 5]]) == 4 and len(seq.block_table) == 4
new_tokens, kept = scheduler.accept_drafts(seqs, [[2, 7, 7, 7, 7]])
scheduler.postprocess(seqs, new_tokens, False)
assert kept == [1]
assert len(seq.block_table) == 3 and len(scheduler.block_manager.hash_to_block_id) == 2

# en: Exercise 3: 1 + 4 = 5 rows replay the graph of 8, which has room for 7 drafts; two sequences with 4 drafts
# en: each are 10 rows, replaying the graph of 16: 7 drafts each as well. Whether the three more drafts cost nothing
# en: there depends on what runs outside the graph (the LM head, sampling, acceptance): `python -m nanovllm.bench
# en: --speculative --num-speculative-tokens 4 7` measures it, and chapter 25b's exercises read what it measured.
# zh: 练习 3：1 + 4 = 5 行，重放 8 行的图，这张图放得下 7 个草稿；两个各带 4 个草稿的序列是 10 行，重放 16 行的图：
# zh: 同样每个 7 个草稿。多出来的三个草稿在那里是否不花钱，要看图外面跑的东西（LM head、采样、接受）：
# zh: `python -m nanovllm.bench --speculative --num-speculative-tokens 4 7` 会测量它，第 25b 章的练习读的就是它测得的
# zh: 结果。
from nanovllm.engine.cuda_graphs import capture_sizes


def graph_rows(batch: int, drafts: int) -> int:
    """The rows of the decode graph that a verify step of ``batch`` sequences with ``drafts`` drafts each replays."""
    # zh: ``batch`` 个序列、每个带 ``drafts`` 个草稿的验证步所重放的 decode 图的行数。
    return min(size for size in capture_sizes(256) if size >= batch * (1 + drafts))


assert graph_rows(1, 4) == graph_rows(1, 7) == 8 < graph_rows(1, 8)
assert graph_rows(2, 4) == graph_rows(2, 7) == 16 < graph_rows(2, 8)
# en: The default fills the graph of one sequence.
# zh: 默认值正好填满一个序列的图。
assert graph_rows(1, DEFAULT_SPECULATIVE_TOKENS) == 1 + DEFAULT_SPECULATIVE_TOKENS
print(say("all exercise answers check out"))
