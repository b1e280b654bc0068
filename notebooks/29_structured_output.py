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
# # 29 · Structured output: a grammar picks the allowed tokens
#
# **Goal.** A program that reads a model's output wants JSON that parses, fits a schema and holds
# only the fields it expects; a classifier wants one of three labels; a form wants a date. Asking
# the model nicely is not enough for a small model, and not always for a large one. **Structured
# output** (constrained decoding) makes it a guarantee: before each token is sampled, a **grammar**
# says which tokens may come next, and the logit of every other token becomes −∞. This chapter
# builds it into the engine as vLLM has it: a request carries
# `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`, a **matcher** per
# sequence follows the tokens the sequence writes, and each step's **bitmask** (one bit per token
# of the vocabulary) masks the logits on their device just before the sampler. By the end you can
# compute such a mask by hand for a tiny grammar, check it bit for bit against **llguidance**, the
# library the engine uses, and watch SmolLM2 on a CPU write JSON that validates against a schema,
# where without the mask it writes a sentence. This chapter is the engine's side; the server's,
# OpenAI's `response_format` and tool calls, is chapter 29b's.

# %% [markdown] tags=["zh"]
# # 29 · 结构化输出：由语法挑出允许的 token
#
# **目标：** 读取模型输出的程序想要能解析的 JSON，符合某个 schema，只含它预期的字段；分类器想要三个标签之一；表单
# 想要一个日期。对小模型，好言相求是不够的；对大模型，也不总是够。**结构化输出**（structured output，也叫约束解码）
# 把它变成保证：每个 token 采样之前，由一个**语法**（grammar）说出接下来允许哪些 token，其余每个 token 的 logit 都
# 变成 −∞。本章像 vLLM 那样把它做进引擎：请求带上
# `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`，每个序列有一个**匹配器**（matcher）
# 跟着它写出的 token 走，每一步的**位掩码**（bitmask，词表里每个 token 占一位）在采样器之前、在 logits 所在的设备上
# 盖住 logits。读完本章，你能为一个很小的语法手算出这样的掩码，逐位对照引擎所用的库 **llguidance** 算出的掩码，并
# 看到 SmolLM2 在 CPU 上写出符合 schema 的 JSON——不加掩码时，它写的是一句话。本章做引擎这一侧；服务器那一侧，
# 即 OpenAI 的 `response_format` 和工具调用，在第 29b 章。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "step {step}: after {written!r:<7} {allowed} allowed: {shown}; unmasked {free!r}, masked {chosen!r}":
        "第 {step} 步：在 {written!r:<7} 之后允许 {allowed} 个：{shown}；不加掩码 {free!r}，加掩码 {chosen!r}",
    "the tiny model spelled {text!r} under the mask": "小模型在掩码下拼出了 {text!r}",
    "step 0's bitmask: {words} int32 words, non-zero: {nonzero}":
        "第 0 步的位掩码：{words} 个 int32 字，非零的：{nonzero}",
    "unpacked again: the same {count} tokens: {same}": "再解开：同样的 {count} 个 token：{same}",
    "step {step}: after {written!r:<7} llguidance's bitmask equals ours: {same}":
        "第 {step} 步：在 {written!r:<7} 之后 llguidance 的位掩码与我们的相同：{same}",
    "after {written!r}: by prefix {ours}, llguidance {theirs}; the tokenizer writes {word!r} as {tokens}":
        "在 {written!r} 之后：按前缀 {ours}，llguidance {theirs}；分词器把 {word!r} 写成 {tokens}",
    "refused: {error}": "被拒绝：{error}",
    "a schema nested {depth} deep refused in {ms:.1f} ms": "嵌套 {depth} 层的 schema 在 {ms:.1f} 毫秒内被拒绝",
    "{kind:<6} {text!r:<36} {tokens:>2} tokens, the matcher accepts it: {accepted}":
        "{kind:<6} {text!r:<36} {tokens:>2} 个 token，匹配器接受它：{accepted}",
    "{forced} of {total} tokens had exactly one allowed token": "{total} 个 token 中有 {forced} 个只允许唯一的 token",
    "unconstrained: {text!r}": "不加约束：{text!r}",
    "  parses and fits the schema: {valid}": "  能解析并符合 schema：{valid}",
    "constrained:   {text!r}": "加了约束：{text!r}",
    "sample {index} (seed 7, temperature 0.8): {text!r}, fits the schema: {valid}":
        "第 {index} 个样本（种子 7，温度 0.8）：{text!r}，符合 schema：{valid}",
    "unconstrained greedy outputs unchanged beside a constrained request: {same}":
        "与一个受约束的请求同批时，不加约束的贪心输出不变：{same}",
    "a pool of {blocks} blocks: {preempted} preemptions, the same {count} outputs: {same}":
        "{blocks} 个块的池：{preempted} 次抢占，同样的 {count} 个输出：{same}",
    "batch {batch}: a step {free:.1f} ms free, {constrained:.1f} ms with the schema, Grammars.fill {mask:.2f} ms of "
    "it": "批大小 {batch}：一步自由运行 {free:.1f} 毫秒，带 schema {constrained:.1f} 毫秒，其中 Grammars.fill 占 "
          "{mask:.2f} 毫秒",
    "prompt lookup proposed {proposed} drafts: the grammars refused {cut} (cut before verification), "
    "{verified} were verified, {kept} kept":
        "提示词查找提出了 {proposed} 个草稿：语法拒绝了 {cut} 个（在验证之前截掉），验证了 {verified} 个，"
        "保留了 {kept} 个",
    "the same outputs with and without speculation (greedy, and seeded with n = 2): {same}":
        "做投机与不做投机的输出相同（贪心的，以及带种子、n = 2 的）：{same}",
    "{name}: {card}, {date}: {command}": "{name}：{card}，{date}：{command}",
    "batch {batch:3d}: {ratio:.2f}x the free run; a step {free_ms:.2f} -> {constrained_ms:.2f} ms, "
    "{mask_ms:.2f} ms of it in the masks":
        "批大小 {batch:3d}：自由运行的 {ratio:.2f} 倍；一步 {free_ms:.2f} -> {constrained_ms:.2f} 毫秒，"
        "其中 {mask_ms:.2f} 毫秒在掩码上",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %% [markdown] tags=["en"]
# ## The idea: a mask between the logits and the sampler
#
# A grammar stands for a set of strings: the JSON documents a schema accepts, the matches of a
# regular expression, three words. Generation writes a string one token at a time, so what a step
# must know is: **which tokens keep the text written so far the start of some string of the
# grammar?** Those are allowed, every other token is masked out. Once the text is a whole string of
# the grammar, the end-of-sequence token is allowed too; once nothing else can follow, it is the
# only one.
#
# ```
#   logits of one row     [  2.1   -0.3    5.7    0.9   ...   1.2 ]   one per token of the vocabulary
#   its bitmask row       [   1      0      0      1    ...    0  ]   one bit per token, 32 in an int32 word
#   masked logits         [  2.1   -inf   -inf    0.9   ...  -inf ]   -> chapter 08's sampler, unchanged
#                              ^
#                              the sequence's matcher: the grammar's state after the tokens it wrote
# ```
#
# Three pieces, each where it belongs:
#
# - A **matcher** per sequence holds the grammar's state after the tokens the sequence wrote. It
#   lives on the host beside the `Sequence`: it is a parser stepping through text, not tensors.
# - Each step, the matcher of each constrained row fills that row of a **bitmask**: ⌈V/32⌉ int32
#   words, bit *j* of word *w* for token 32*w* + *j*. For SmolLM2's 49,152 tokens a row is 1,536
#   words, 6 KiB, and the whole bitmask crosses to the device in one copy.
# - On the device the bitmask is unpacked to one bool per token and masks the logits; the sampler
#   then samples as it always does, greedy or not. Masking before the sampler keeps sampling exact:
#   the distribution is the model's, renormalized over the allowed tokens.
#
# Finding which tokens keep the text a prefix is the hard part: a vocabulary has tens of thousands
# of tokens, and a JSON schema's grammar many states. vLLM, SGLang and TensorRT-LLM use XGrammar by
# default, and vLLM also offers llguidance (its "guidance" backend). We compared the two on our
# tokenizers (compile times, masks token by token, hostile schemas) and chose **llguidance**, on
# evidence: its compile time is bounded by limits it checks itself (a schema nested 500 deep is
# refused in a millisecond, where XGrammar compiled for 17 s, and a compile cannot be stopped);
# its masks were right where XGrammar's were wrong (strings with a `maxLength`, special tokens
# inside strings); and it refuses the schema features it does not implement (`uniqueItems`, an
# unknown `format`) where XGrammar silently ignores them, letting the output break the schema. It
# has no dependencies, and one wheel serves every Python.

# %% [markdown] tags=["zh"]
# ## 思路：在 logits 和采样器之间加一层掩码
#
# 一个语法代表一组字符串：某个 schema 接受的 JSON 文档、某个正则表达式的匹配、三个单词。生成是一次一个 token 地写出
# 一个字符串，所以一步要知道的是：**哪些 token 能让已经写出的文本仍是语法中某个字符串的开头？**这些 token 允许，其余
# 每个 token 都被掩掉。一旦文本已经是语法里一个完整的字符串，end-of-sequence token 也就允许了；一旦后面什么都不能
# 再接，它就是唯一允许的 token。
#
# ```
#   一行的 logits          [  2.1   -0.3    5.7    0.9   ...   1.2 ]   词表里每个 token 一个
#   这一行的位掩码          [   1      0      0      1    ...    0  ]   每个 token 一位，一个 int32 字装 32 位
#   掩码之后的 logits      [  2.1   -inf   -inf    0.9   ...  -inf ]   -> 第 08 章的采样器，原样不动
#                              ^
#                              这个序列的匹配器：它写过的 token 之后，语法所处的状态
# ```
#
# 三个部件，各在各的位置：
#
# - 每个序列一个**匹配器**，保存序列写过的 token 之后语法所处的状态。它和 `Sequence` 一起放在主机上：它是一个在文本上
#   一步步走的解析器，不是张量。
# - 每一步，每个受约束行的匹配器填写**位掩码**（bitmask）中的这一行：⌈V/32⌉ 个 int32 字，第 *w* 个字的第 *j* 位对应
#   token 32*w* + *j*。SmolLM2 有 49,152 个 token，一行是 1,536 个字，6 KiB；整个位掩码一次拷贝送到设备上。
# - 在设备上，位掩码被解开成每个 token 一个布尔值，盖住 logits；然后采样器照常采样，贪心与否都一样。在采样器之前加
#   掩码，采样仍然是精确的：分布就是模型的分布，只在允许的 token 上重新归一化。
#
# 难的是找出哪些 token 能让文本仍是前缀：一个词表有几万个 token，一个 JSON schema 的语法有许多状态。vLLM、SGLang 和
# TensorRT-LLM 默认用 XGrammar，vLLM 也提供 llguidance（它的 "guidance" 后端）。我们在自己的分词器上比较了两者
# （编译时间、逐 token 的掩码、恶意的 schema），凭证据选了 **llguidance**：它的编译时间受它自己检查的限额约束（嵌套
# 500 层的 schema 在一毫秒内被拒绝，而 XGrammar 编译了 17 秒，编译一旦开始就停不下来）；在 XGrammar 出错的地方它的
# 掩码是对的（带 `maxLength` 的字符串、字符串里的特殊 token）；它不实现的 schema 特性（`uniqueItems`、未知的
# `format`）它会拒绝，而 XGrammar 悄悄地忽略它们，让输出违反 schema 也不报错。它没有依赖，一个 wheel 适用于所有 Python
# 版本。

# %%
import json
import textwrap
import time

import torch
from transformers import AutoModelForCausalLM

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config
from nanovllm.engine.inputs import load_tokenizer

tiny = build_tiny_model("qwen3")
tokenizer = load_tokenizer(str(tiny))
settings = Config(str(tiny), device="cpu")
VOCAB, EOS = settings.hf_config.vocab_size, settings.eos_token_ids
# en: Each token's text; the special tokens (<|im_start|>, ...) are never part of what a grammar spells.
# zh: 每个 token 的文本；特殊 token（<|im_start|> 等）从来不是语法所拼写内容的一部分。
texts = [tokenizer.decode([token]) for token in range(VOCAB)]
special = set(tokenizer.all_special_ids)

# %% [markdown] tags=["en"]
# ## By hand first: a grammar of three words
#
# The smallest grammar worth the name: the output must be `red`, `green` or `blue`. Its allowed
# tokens need no library. A token is allowed if the text written so far, followed by the token's
# text, is the start of one of the words; the end-of-sequence tokens are allowed once the text is a
# whole word. The tiny model's tokenizer (chapter 06) is a byte-level BPE of 512 tokens, few enough
# to try every one of them at every step.

# %% [markdown] tags=["zh"]
# ## 先手算：三个单词的语法
#
# 称得上语法的最小例子：输出必须是 `red`、`green` 或 `blue`。它允许的 token 不需要任何库就能算出：已经写出的文本
# 接上一个 token 的文本之后，如果还是其中某个单词的开头，这个 token 就允许；文本一旦是一个完整的单词，
# end-of-sequence token 也就允许了。小模型的分词器（第 06 章）是 512 个 token 的字节级 BPE，少到每一步都能把每个
# token 试一遍。

# %%
WORDS = ["red", "green", "blue"]


def allowed_by_hand(words: list[str], written: str) -> list[int]:
    """The tokens after which the text is still the start of one of ``words``; the end-of-sequence tokens too, once
    the text is one of them."""
    # zh: 接上之后文本仍是 ``words`` 中某个单词开头的那些 token；文本已经是其中一个单词时，再加上
    # zh: end-of-sequence token。
    keep = [token for token, text in enumerate(texts)
            if token not in special and text and any(word.startswith(written + text) for word in words)]
    return keep + (list(EOS) if written in words else [])


# %% [markdown] tags=["en"]
# Now the tiny model (its random weights, loaded by `transformers`) writes under this rule, greedily:
# at each step its logits for the forbidden tokens become −∞, and the most likely of the allowed
# tokens wins. The trace shows what it would have written without the mask.

# %% [markdown] tags=["zh"]
# 现在让小模型（它的随机权重，由 `transformers` 加载）按这条规则贪心地写：每一步，被禁止的 token 的 logits 变成 −∞，
# 允许的 token 里最可能的那个胜出。轨迹里也列出了不加掩码时它会写什么。

# %%
model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
prompt = tokenizer.encode("Question: What is the color of the sky? Answer:")
written, ids, steps_by_hand = "", list(prompt), []
with torch.no_grad():
    for step in range(8):
        allowed = allowed_by_hand(WORDS, written)
        logits = model(torch.tensor([ids])).logits[0, -1]
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[allowed] = True
        chosen = int(logits.masked_fill(~keep, float("-inf")).argmax())
        steps_by_hand.append((written, allowed))
        shown = sorted(texts[token] for token in allowed)
        print(say("step {step}: after {written!r:<7} {allowed} allowed: {shown}; unmasked {free!r}, masked {chosen!r}",
                  step=step, written=written, allowed=len(allowed), shown=shown, free=texts[int(logits.argmax())],
                  chosen=texts[chosen]))
        if chosen in EOS:
            break
        written += texts[chosen]
        ids.append(chosen)
print(say("the tiny model spelled {text!r} under the mask", text=written))
assert written in WORDS and len(steps_by_hand) >= 3

# %% [markdown] tags=["en"]
# Left alone, the random model writes whatever its logits favor (the "unmasked" column); under the
# mask it can only spell a word, picking among the allowed tokens the one its logits like best.
# Note the first step: `b`, `bl`, `g`, `gr`, `r` and `re` are all allowed. A grammar constrains the
# *text*, and one text has many tokenizations.

# %% [markdown] tags=["zh"]
# 放任不管时，这个随机模型写的是它的 logits 偏爱的东西（“不加掩码”那一栏）；在掩码之下它只能拼出一个单词，在允许的
# token 里挑它的 logits 最喜欢的那个。注意第一步：`b`、`bl`、`g`、`gr`、`r` 和 `re` 都允许。语法约束的是*文本*，而
# 同一段文本有许多种分词方式。

# %% [markdown] tags=["en"]
# ## Build it: a bitmask, and the mask it makes
#
# A list of allowed tokens is the wrong shape for a GPU: its length changes from row to row and
# from step to step. A bitmask has one shape, [rows, ⌈V/32⌉] int32, whatever is allowed. The new
# module `nanovllm.engine.grammars` starts with four small functions. `pack_tokens` writes a row by
# hand; `allowed_tokens` unpacks rows back to one bool per token with two tensor operations (a
# shift by 0 to 31, then `& 1`); `apply_bitmask` sets −∞ where a bit is 0, on the logits' own
# device. llguidance ships a helper for that last step, but it is compiled with `torch.compile`
# (15 s at its first call on a CPU here, and importing it costs 1.7 s); the plain version is three
# lines that run anywhere. `fill_bitmask` lets llguidance write a row: it hands over the row's
# address, and llguidance writes the words there.

# %% [markdown] tags=["zh"]
# ## 动手：位掩码，以及由它得到的掩码
#
# 允许的 token 列表对 GPU 来说形状不对：它的长度每行不同、每步也不同。位掩码只有一种形状：[行数, ⌈V/32⌉] 的 int32，
# 不管允许的是什么。新模块 `nanovllm.engine.grammars` 从四个小函数开始。`pack_tokens` 手工写出一行；`allowed_tokens`
# 用两个张量运算（先右移 0 到 31 位，再 `& 1`）把各行解开成每个 token 一个布尔值；`apply_bitmask` 在 logits 所在的
# 设备上把位为 0 的地方设成 −∞。llguidance 为最后这一步提供了辅助函数，但它用 `torch.compile` 编译（在这里的 CPU 上
# 第一次调用要 15 秒，光是导入它就要 1.7 秒）；朴素的写法只有三行，在哪里都能运行。`fill_bitmask` 让 llguidance 写
# 一行：把这一行的地址交给它，它把那些字写进去。

# %% default module
#| default_exp engine.grammars

# %% bitmasks
#| export
"""Structured output: the grammars of constrained requests, turned into token masks by llguidance (chapter 29)."""
# zh: 结构化输出：受约束请求的语法，由 llguidance 变成 token 掩码（第 29 章）。

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance import LLMatcher


def bitmask_words(vocab_size: int) -> int:
    """The int32 words of one bitmask row over ``vocab_size`` tokens: a bit per token."""
    # zh: ``vocab_size`` 个 token 的位掩码一行有几个 int32 字：每个 token 一位。
    return (vocab_size + 31) // 32


def pack_tokens(tokens: Iterable[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row, [words] int32, that allows exactly ``tokens``: bit j of word w stands for token 32 w + j."""
    # zh: 恰好允许 ``tokens`` 的一行位掩码，[字数] 的 int32：第 w 个字的第 j 位代表 token 32 w + j。
    words = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
    for token in tokens:
        words[token // 32] |= np.uint32(1 << (token % 32))
    return torch.from_numpy(words.view(np.int32))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., vocab_size] bools from bitmask rows [..., words] int32: whether each token is allowed."""
    # zh: 由位掩码各行 [..., 字数]（int32）得到 [..., vocab_size] 的布尔值：每个 token 是否允许。
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[..., None] >> bits) & 1).flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, each logit of row ``rows[i]`` whose token ``bitmask[i]`` forbids. The bitmask goes to
    the logits' device, where the work is done."""
    # zh: 就地把第 ``rows[i]`` 行里 ``bitmask[i]`` 禁止的 token 的 logit 设成 -inf。位掩码被送到 logits 所在的设备，
    # zh: 在那里完成这件事。
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def forbid(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, each logit of ``logits`` [n, vocab] whose token row i of ``bitmask`` [n, words] (int32,
    on the logits' device) forbids: `apply_bitmask` on every row, in three kernels whatever n, with nothing read back
    to the host, so that a CUDA graph can capture it."""
    # zh: 就地把 ``logits`` [n, vocab] 第 i 行里、``bitmask`` [n, 字数]（int32，在 logits 所在设备上）第 i 行禁止的
    # zh: token 的 logit 设成 -inf：等于对每一行做 `apply_bitmask`，不论 n 多大都是三个 kernel，不往主机读回任何东西，
    # zh: 所以 CUDA Graph 能捕获它。
    # en: Each byte of a word picks its eight flags from a table (little-endian, as CPUs and GPUs store an int32: byte
    # en: k of word w holds the bits of tokens 32 w + 8 k to 32 w + 8 k + 7).
    # zh: 每个字的每个字节从一张表里取出它的八个标志（小端序，CPU 和 GPU 都这样存 int32：第 w 个字的第 k 个字节存放
    # zh: token 32 w + 8 k 到 32 w + 8 k + 7 的位）。
    forbidden = _forbidden_bits(logits.device)[bitmask.view(torch.uint8).int()]
    logits.masked_fill_(forbidden.flatten(1)[:, : logits.shape[1]], float("-inf"))


@functools.cache
def _forbidden_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bools: whether bit j of the byte value b is clear (its token forbidden)."""
    # zh: [256, 8] 的布尔表：字节值 b 的第 j 位是否为 0（对应的 token 被禁止）。
    return ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).eq(0).to(device)


def fill_bitmask(matcher: LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Let ``matcher`` write the tokens it allows next into row ``row`` of ``bitmask`` (int32, on the host)."""
    # zh: 让 ``matcher`` 把它下一步允许的 token 写进 ``bitmask``（int32，在主机上）的第 ``row`` 行。
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


# %% [markdown] tags=["en"]
# Step 0's allowed tokens, packed: of the 16 words of a row, the few that hold an allowed token are
# not zero. Unpacked again they give back the same tokens, and masking the logits through the
# bitmask is the `masked_fill` of the trace above.

# %% [markdown] tags=["zh"]
# 把第 0 步允许的 token 打包：一行的 16 个字里，只有装着允许 token 的那几个字不为零。再解开，得到的还是那些 token；
# 经由位掩码盖住 logits，和上面轨迹里的 `masked_fill` 是同一回事。

# %%
first = pack_tokens(steps_by_hand[0][1], VOCAB)
nonzero = {word: f"{int(value) & 0xFFFFFFFF:#010x}" for word, value in enumerate(first.tolist()) if value}
print(say("step 0's bitmask: {words} int32 words, non-zero: {nonzero}", words=len(first), nonzero=nonzero))
back = allowed_tokens(first, VOCAB).nonzero().flatten().tolist()
print(say("unpacked again: the same {count} tokens: {same}", count=len(back), same=back == steps_by_hand[0][1]))
with torch.no_grad():
    row = model(torch.tensor([prompt])).logits[0, -1:].clone()
by_fill = row[0].masked_fill(~allowed_tokens(first, VOCAB), float("-inf"))
apply_bitmask(row, first[None], [0])
assert back == sorted(steps_by_hand[0][1]) and torch.equal(row[0], by_fill) and len(first) == VOCAB // 32

# %% [markdown] tags=["en"]
# ## The same mask from llguidance
#
# llguidance compiles a grammar into a matcher against a tokenizer. `llguidance.hf.from_tokenizer`
# reads the tokenizer's vocabulary, with the model's vocabulary size (so that padding ids, which
# no text spells, are never allowed) and every end-of-sequence id the model declares;
# `grammar_from("choice", ...)` turns the three words into llguidance's grammar format; an
# `LLMatcher` follows tokens (`consume_token`) and writes the next mask. Along the tokens the tiny
# model wrote, its bitmask equals ours, bit for bit:

# %% [markdown] tags=["zh"]
# ## llguidance 给出同样的掩码
#
# llguidance 针对一个分词器把语法编译成匹配器。`llguidance.hf.from_tokenizer` 读入分词器的词表，同时给它模型的词表
# 大小（这样没有文本能拼出的填充 id 永远不会被允许）和模型声明的每一个 end-of-sequence id；`grammar_from("choice",
# ...)` 把三个单词变成 llguidance 的语法格式；一个 `LLMatcher` 跟着 token 走（`consume_token`），并写出下一步的掩码。
# 沿着小模型写出的那些 token，它的位掩码和我们的逐位相同：

# %%
import llguidance.hf
from llguidance import LLMatcher, grammar_from

lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=list(EOS))


def llguidance_masks(words: list[str], tokens: list[int]) -> list[torch.Tensor]:
    """llguidance's bitmask row before each of ``tokens``, for the grammar "one of ``words``"."""
    # zh: 对语法“``words`` 之一”，llguidance 在 ``tokens`` 的每一个之前给出的那一行位掩码。
    matcher = LLMatcher(lltok, grammar_from("choice", json.dumps(words)), log_level=0)
    rows = []
    for token in tokens:
        bitmask = torch.empty(1, VOCAB // 32, dtype=torch.int32)
        fill_bitmask(matcher, bitmask, 0)
        rows.append(bitmask[0])
        assert matcher.consume_token(token)
    return rows


spelled = [*ids[len(prompt):], EOS[0]]
for step, ((before, allowed), theirs) in enumerate(zip(steps_by_hand, llguidance_masks(WORDS, spelled),
                                                        strict=True)):
    same = torch.equal(theirs, pack_tokens(allowed, VOCAB))
    print(say("step {step}: after {written!r:<7} llguidance's bitmask equals ours: {same}", step=step,
              written=before, same=same))
    assert same

# %% [markdown] tags=["en"]
# Not always, though. For the words Paris, Rome and London, after `L` the prefix rule allows `o`
# and `on`, and llguidance only `on`:

# %% [markdown] tags=["zh"]
# 不过并不总是这样。对 Paris、Rome、London 这三个词，在 `L` 之后，前缀规则允许 `o` 和 `on`，llguidance 只允许 `on`：

# %%
CITIES = ["Paris", "Rome", "London"]
london = tokenizer.encode("London")
theirs = allowed_tokens(llguidance_masks(CITIES, london[:2])[1], VOCAB).nonzero().flatten().tolist()
ours = allowed_by_hand(CITIES, "L")
print(say("after {written!r}: by prefix {ours}, llguidance {theirs}; the tokenizer writes {word!r} as {tokens}",
          written="L", ours=[texts[t] for t in ours], theirs=[texts[t] for t in theirs], word="London",
          tokens=[texts[t] for t in london]))
assert set(theirs) < set(ours) and [texts[t] for t in set(ours) - set(theirs)] == ["o"]

# %% [markdown] tags=["en"]
# Both are right about the text: `Lo` is the start of `London`. But this tokenizer writes `London`
# as `L`, `on`, `d`, `on`, never with `o` and then `n`, so a model trained on its output has
# (almost) never seen `o` followed by `n` where `on` would do, and what it predicts after such a
# token is anyone's guess. Where it can tell, llguidance allows only the **canonical**
# tokenization, the one the tokenizer itself would write, which keeps the model on paths it knows.
# It is the kind of thing a hand-written mask gets subtly wrong and a library gets right; the other
# is speed: a JSON schema's grammar over 49,152 tokens, in about 14 µs a token (the median we measured).

# %% [markdown] tags=["zh"]
# 就文本而言两者都对：`Lo` 是 `London` 的开头。但这个分词器把 `London` 写成 `L`、`on`、`d`、`on`，从不写成 `o` 再接
# `n`；所以一个在它的输出上训练的模型，（几乎）从没见过本该是 `on` 的地方出现 `o` 再跟 `n`，在这样的 token 之后它会
# 预测什么，谁也说不准。只要能判断，llguidance 就只允许**规范分词**（canonical tokenization），也就是分词器自己
# 会写出的那一种，让模型走在它熟悉的路上。手写的掩码容易在这种地方出细微的错，而库能做对；另一件是速度：一个
# JSON schema 的语法，面对 49,152 个 token，每个 token 大约 14 微秒（我们测得的中位数）。

# %% [markdown] tags=["en"]
# ## Build it: what a request asks for
#
# vLLM's name for the constraint is `StructuredOutputsParams`, a field of `SamplingParams` since
# vLLM 0.12 (the older `guided_json`, `guided_regex`, ... were removed then). We take it field for
# field, with exactly one constraint set:
#
# | field | the output must be |
# |---|---|
# | `json` | a JSON document that validates against this JSON schema (a dict, or its JSON text) |
# | `regex` | a match of this regular expression |
# | `choice` | one of these strings |
# | `grammar` | a sentence of this grammar (Lark, or llama.cpp's GBNF) |
# | `json_object=True` | any JSON object |
#
# `disable_any_whitespace=True` leaves out the blanks that JSON allows between its tokens: a small
# model free to write blanks may write nothing else (the tiny model below does).
#
# The object checks itself when it is made, through llguidance: no constraint or two, a schema
# llguidance cannot compile, or a feature it does not implement are refused with the reason, before
# anything is queued. The check is bounded: llguidance stops at limits of its own
# (`LLParserLimits`: lexer fuel, lexer states, grammar size), so a hostile schema costs
# milliseconds. Chapter 01's `SamplingParams` takes the field through `add_fields` (appendix D),
# with one more rule: `ignore_eos=True` is refused for a constrained request. A grammar that is
# complete ends the request with the end-of-sequence token, the only token it then allows, and
# `ignore_eos` would skip past it.

# %% [markdown] tags=["zh"]
# ## 动手：请求要的是什么
#
# vLLM 给这种约束起的名字是 `StructuredOutputsParams`，从 vLLM 0.12 起它是 `SamplingParams` 的一个字段（旧的
# `guided_json`、`guided_regex` 等在那时被移除）。我们逐字段照搬，恰好设置其中一个约束：
#
# | 字段 | 输出必须是 |
# |---|---|
# | `json` | 符合这个 JSON schema 的 JSON 文档（给一个 dict，或它的 JSON 文本） |
# | `regex` | 这个正则表达式的一个匹配 |
# | `choice` | 这些字符串之一 |
# | `grammar` | 这个语法（Lark，或 llama.cpp 的 GBNF）的一个句子 |
# | `json_object=True` | 任意一个 JSON 对象 |
#
# `disable_any_whitespace=True` 去掉 JSON 在各个记号之间允许出现的空白：一个可以随意写空白的小模型，可能除了空白什么
# 都不写（下面的小模型就是这样）。
#
# 这个对象在创建时就借助 llguidance 检查自己：没有约束或有两个约束、llguidance 编译不了的 schema、它不实现的特性，都会
# 连同原因一起被拒绝，那时什么都还没有排进队列。检查的开销有上限：llguidance 在它自己的限额（`LLParserLimits`：词法
# 分析的燃料、词法状态数、语法大小）处停下，所以一个恶意的 schema 只花几毫秒。第 01 章的 `SamplingParams` 通过
# `add_fields`（附录 D）接受这个字段，并多了一条规则：受约束的请求不接受 `ignore_eos=True`。语法完整时，请求以
# end-of-sequence token 结束，那时它是语法唯一允许的 token，而 `ignore_eos` 会跳过它。

# %% structured outputs
#| export sampling_params
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.checks import check

if TYPE_CHECKING:
    from llguidance import LLParserLimits

# en: The constraints a request may set, by vLLM's names: exactly one of them.
# zh: 请求可以设置的约束，用 vLLM 的名字：恰好设置其中一个。
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def grammar_limits() -> LLParserLimits:
    """What compiling a grammar, and computing one mask, may cost: llguidance's limits (lexer fuel, lexer states,
    grammar size), at its defaults. A schema past them is refused in milliseconds, not compiled for seconds."""
    # zh: 编译一个语法、计算一次掩码最多能花多少：llguidance 的限额（词法分析的燃料、词法状态数、语法大小），取它的
    # zh: 默认值。超出的 schema 在几毫秒内被拒绝，而不是编译好几秒。
    # en: llguidance is imported where it is used: an engine that constrains nothing never loads it.
    # zh: llguidance 在用到它的地方才导入：不做任何约束的引擎从不加载它。
    from llguidance import LLParserLimits

    return LLParserLimits()


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON schema
    (``json``, a dict or its JSON text), a regular expression (``regex``), one of some strings (``choice``), a
    grammar in Lark or GBNF form (``grammar``), or any JSON object (``json_object=True``).
    ``disable_any_whitespace``: JSON without the blanks JSON allows between its tokens. Checked when it is made: a
    constraint that llguidance cannot compile, or does not support, is refused with the reason."""
    # zh: 请求的输出必须匹配的东西（vLLM 的 ``StructuredOutputsParams``）：恰好是下列之一：一个 JSON schema（``json``，
    # zh: dict 或它的 JSON 文本）、一个正则表达式（``regex``）、几个字符串之一（``choice``）、Lark 或 GBNF 形式的语法
    # zh: （``grammar``），或任意 JSON 对象（``json_object=True``）。``disable_any_whitespace``：JSON 里不出现它在
    # zh: 各个记号之间允许的空白。创建时检查：llguidance 编译不了或不支持的约束会连同原因一起被拒绝。

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # en: llguidance's grammar for the constraint: derived, and checked, when the object is made.
    # zh: 这个约束在 llguidance 中的语法：在对象创建时推导出来，并经过检查。
    llguidance_grammar: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one constraint ({', '.join(CONSTRAINTS)}), "
                             f"got {' and '.join(given) or 'none'}")
        check("disable_any_whitespace", self.disable_any_whitespace, bool)
        object.__setattr__(self, "llguidance_grammar", self._compile())

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        # zh: 设置的是哪种约束："json"、"regex"、"choice"、"grammar" 或 "json_object"。
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What compiled grammars are cached by: the kind, the constraint's exact text (a dict as ``json.dumps``
        writes it, its keys in their order: a schema's properties come out in that order) and the blanks rule."""
        # zh: 已编译语法的缓存键：约束的种类、约束的原文（dict 按 ``json.dumps`` 写出的样子，键保持原来的顺序：schema
        # zh: 的各个属性按这个顺序输出），以及空白规则。
        value = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value), self.disable_any_whitespace

    def _compile(self) -> str:
        """llguidance's grammar for the constraint, once llguidance has checked it within `grammar_limits`; a
        ValueError names the constraint and the problem, a TypeError a value of the wrong type."""
        # zh: 这个约束在 llguidance 中的语法，在 llguidance 于 `grammar_limits` 之内检查过之后返回；ValueError 指出是
        # zh: 哪个约束、什么问题，TypeError 指出类型不对的值。
        from llguidance import LLMatcher, grammar_from

        kind, value = self.kind, getattr(self, self.kind)
        if kind == "choice":
            check("choice", value, list, lambda v: v and all(isinstance(s, str) for s in v),
                  "a non-empty list of strings")
        elif kind == "json":
            check("json", value, object, lambda v: isinstance(v, (str, dict)), "a JSON schema: a dict or its text")
        else:
            check(kind, value, bool if kind == "json_object" else str)
        blanks = {"whitespace_flexible": not self.disable_any_whitespace}
        try:
            if kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=blanks)
            elif kind == "json":
                grammar = LLMatcher.grammar_from_json_schema(self.key[1], defaults=blanks)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(value)
            else:
                # en: "choice" reads the strings as a JSON list; "grammar" takes Lark, or GBNF.
                # zh: "choice" 把那些字符串当作一个 JSON 列表来读；"grammar" 接受 Lark 或 GBNF。
                grammar = grammar_from(kind, self.key[1])
        # en: RecursionError: a dict nested past Python's recursion limit, which json.dumps cannot write.
        # zh: RecursionError：嵌套深度超过 Python 递归上限、json.dumps 写不出来的 dict。
        except (ValueError, RecursionError) as error:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {error}") from None
        problem = LLMatcher.validate_grammar(grammar, None, limits=grammar_limits())
        if problem:
            raise ValueError(f"structured_outputs.{kind} is refused: {problem}")
        return grammar


# en: Structured output (chapter 29): what the completion must match, or None.
# zh: 结构化输出（第 29 章）：生成内容必须匹配的东西，或 None。
@add_fields(SamplingParams)
class _StructuredOutputs:
    structured_outputs: StructuredOutputsParams | None = None


@add_to_init(SamplingParams)
def _check_structured_outputs(self) -> None:
    # en: A constrained request ends where its grammar does, with the end-of-sequence token that the grammar then
    # en: allows alone: ignore_eos would skip past it.
    # zh: 受约束的请求在它的语法结束处结束，以那时语法唯一允许的 end-of-sequence token 收尾：ignore_eos 会跳过它。
    if self.structured_outputs is not None:
        self._check("structured_outputs", StructuredOutputsParams)
        if self.ignore_eos:
            raise ValueError("ignore_eos=True cannot be combined with structured_outputs: a constrained request "
                             "ends where its grammar does, with the end-of-sequence token that the grammar then "
                             "allows")


# %% [markdown] tags=["en"]
# What it refuses, and how fast. The regex error comes with llguidance's caret under the problem;
# the schema nested 500 deep is refused by llguidance's parser in about a millisecond.

# %% [markdown] tags=["zh"]
# 它拒绝什么、拒绝得多快。正则表达式的错误带着 llguidance 指向问题所在的脱字符；嵌套 500 层的 schema 被 llguidance 的
# 解析器在大约一毫秒内拒绝。

# %%
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


def nested(depth: int) -> str:
    """The JSON text of a schema of objects nested ``depth`` deep."""
    # zh: 对象嵌套 ``depth`` 层的 schema 的 JSON 文本。
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def print_refusal(error: Exception, lines: int = 1) -> None:
    """The first ``lines`` lines of an error's message, the first one wrapped to fit the page."""
    # zh: 错误信息的前 ``lines`` 行，第一行折行以适合页面宽度。
    first, *rest = str(error).splitlines()
    print("\n  ".join(textwrap.wrap(say("refused: {error}", error=first), 112)))
    print("".join(f"{line}\n" for line in rest[: lines - 1]), end="")


for bad in ({}, {"regex": "[0-9]+", "choice": ["yes", "no"]}, {"json": {"type": "array", "uniqueItems": True}},
            {"json": {"type": "string", "format": "color"}}, {"regex": "[0-9]+(?=px)"}):
    try:
        StructuredOutputsParams(**bad)
    except ValueError as error:
        print_refusal(error)
    else:
        raise AssertionError(f"{bad} was accepted")
try:
    StructuredOutputsParams(regex="(yes|no")
except ValueError as error:
    print_refusal(error, lines=4)
yes_no = StructuredOutputsParams(choice=["yes", "no"])
for refused in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"ignore_eos": True, "structured_outputs": yes_no}):
    try:
        SamplingParams(**refused)
    except (TypeError, ValueError) as error:
        print_refusal(error)
    else:
        raise AssertionError(f"{refused} was accepted")
start = time.perf_counter()
try:
    StructuredOutputsParams(json=nested(500))
except ValueError as error:
    elapsed = (time.perf_counter() - start) * 1e3
    print(say("a schema nested {depth} deep refused in {ms:.1f} ms", depth=500, ms=elapsed))
    assert "recursion" in str(error) and elapsed < 1000

# %% [markdown] tags=["en"]
# ## Build it: one object owns the grammars
#
# Like chapter 25's `Speculator`, structured output is one object, `Grammars`, which the engine
# calls from one place. It lives beside the sampler, in the model runner, because the logits are
# there. It holds:
#
# - llguidance's view of the tokenizer, built at the first constrained request (0.4 s for
#   SmolLM2's 49,152 tokens; llguidance itself is imported where it is first used, so an engine
#   that constrains nothing never loads it);
# - the compiled grammars, by the constraint's kind and exact text (a dict schema as `json.dumps`
#   writes it, in its key order: the schema's properties come out in that order, and sorting the
#   keys would change the output). A compiled grammar is a matcher before any token, whose first
#   mask is computed when it is compiled (llguidance builds some of its tables lazily); a new
#   sequence copies it (`deep_copy`, about 10 µs);
# - one matcher per sequence, in a weak dictionary keyed by the `Sequence`, as the speculator
#   keeps its back-off memory: it goes when the engine lets go of the sequence.
#
# `mask` is the whole protocol. For each constrained row that samples a token, the sequence's
# matcher first reads the tokens the sequence gained since its last mask, then fills its row of the
# bitmask, and `apply_bitmask` masks the step's logits in one go. The matcher thus **advances
# lazily**: the scheduler records tokens as it always has, and each matcher catches up just before
# its mask is needed. That keeps the rest of the engine as it was:
#
# - **n > 1**: a forked sample is a `Sequence` of its own, so it gets a matcher of its own.
#   Chapter 05 forks a request when its first token is sampled, when the parent's matcher has read
#   nothing yet, so a copy of the compiled matcher is exactly the parent's matcher at the fork; the
#   sibling then reads its own first token, which was drawn from its parent's masked row.
# - **Preemption**: a preempted sequence keeps its tokens and its matcher. Its recompute adds no
#   token, so the matcher has nothing to replay, and its next mask is the one it would have had.
# - **A grammar that fails**: llguidance may stop at its limits in the middle of a request, or be
#   handed a token it refuses. The sequence then gets only its end-of-sequence tokens, so that it
#   ends at its next token, and the log says why.
# - **Speculative decoding**: a verify step's rows are masked by `mask_drafts`, row *i* by the
#   grammar after the first *i* drafts, and the matcher gives the drafts back (`rollback`); it reads
#   the ones the engine kept at its next mask, as it reads any token. `cut_drafts` cuts a proposal at
#   its first draft the grammar refuses (see "Masks meet the rest of the engine").

# %% [markdown] tags=["zh"]
# ## 动手：由一个对象掌管所有语法
#
# 和第 25 章的 `Speculator` 一样，结构化输出是一个对象 `Grammars`，引擎只在一个地方调用它。它和采样器一起住在模型执行器
# 里，因为 logits 在那里。它持有：
#
# - llguidance 眼中的分词器，在第一个受约束的请求到来时构建（SmolLM2 的 49,152 个 token 要 0.4 秒；llguidance 本身
#   在第一次用到的地方才导入，所以不做任何约束的引擎从不加载它）；
# - 已编译的语法，按约束的种类和原文存放（dict 形式的 schema 按 `json.dumps` 写出的样子，保持键的原有顺序：schema 的
#   各个属性按这个顺序输出，把键排序就会改变输出）。已编译的语法就是还没读任何 token 的匹配器，编译时就算好它的第一个
#   掩码（llguidance 有些表是惰性构建的）；新序列复制它（`deep_copy`，大约 10 微秒）；
# - 每个序列一个匹配器，放在以 `Sequence` 为键的弱引用字典里，和投机器存放退避记忆的方式一样：引擎放下这个序列时，
#   它也随之消失。
#
# `mask` 就是整个协议。对每个要采样 token 的受约束行，序列的匹配器先读入序列自上次掩码以来新增的 token，再填写位掩码
# 中自己的那一行，然后 `apply_bitmask` 一次盖住这一步的 logits。于是匹配器是**惰性前进**的：调度器照旧记录 token，每个
# 匹配器在需要它的掩码之前才赶上来。这让引擎的其余部分保持原样：
#
# - **n > 1**：分叉出来的样本是一个独立的 `Sequence`，所以有它自己的匹配器。第 05 章在请求的第一个 token 被采样时
#   分叉，那时父序列的匹配器还什么都没读，所以已编译匹配器的一份拷贝恰好就是分叉时父序列的匹配器；之后兄弟序列读入
#   自己的第一个 token，而那个 token 是从父序列那一行加了掩码的 logits 里抽出来的。
# - **抢占**：被抢占的序列保留它的 token 和它的匹配器。重算不会添加 token，所以匹配器没有什么需要重放的，它的下一个
#   掩码就是本来会有的那一个。
# - **语法失败**：llguidance 可能在请求中途碰到它的限额而停下，或者收到一个它拒绝的 token。这时这个序列只剩下它的
#   end-of-sequence token 可选，于是在下一个 token 处结束，日志里写明原因。
# - **投机解码**：验证步的各行由 `mask_drafts` 加掩码，第 *i* 行用读过前 *i* 个草稿之后的语法，然后匹配器把草稿退回去
#   （`rollback`）；引擎保留下的草稿，它在下一次掩码时读入，和读入任何 token 一样。`cut_drafts` 把提议截到语法拒绝的
#   第一个草稿为止（见“掩码遇上引擎的其余部分”）。

# %% grammars
#| export
import copy
import json
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanovllm.config import Config
from nanovllm.engine.inputs import load_tokenizer
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from nanovllm.sampling_params import StructuredOutputsParams, grammar_limits

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

    from nanovllm.engine.model_runner import SampledTokens

_logger = logging.getLogger("nanovllm.grammars")
# en: Compiled grammars kept at once, the oldest forgotten first: each is a matcher that new sequences copy.
# zh: 同时保留的已编译语法数，最早的最先被忘掉：每个都是新序列复制的那个匹配器。
MAX_GRAMMARS = 256


def llguidance_tokenizer(tokenizer: PreTrainedTokenizerBase, n_vocab: int, eos_token_ids: list[int]) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (what `llguidance.hf.from_tokenizer` builds), with one
    repair: a byte-level vocabulary (a ByteLevel pre-tokenizer, where the token `Ċ` stands for a newline) is declared
    so by a plain ByteLevel decoder. Some conversions give such a vocabulary a sentencepiece-style decoder that tries
    byte fallback first (transformers 5.17's GGUF loader, for SmolLM2), and llguidance then reads `Ċ` as its own
    UTF-8 bytes: every grammar that needs a newline fails."""
    # zh: llguidance 眼中的 Hugging Face 快速分词器（即 `llguidance.hf.from_tokenizer` 构建的那个），外加一处修补：
    # zh: 字节级的词表（ByteLevel 预分词器，token `Ċ` 代表换行）由一个单纯的 ByteLevel 解码器声明出来。有些转换给这样
    # zh: 的词表配上先尝试字节回退的 sentencepiece 式解码器（transformers 5.17 的 GGUF 加载器，对 SmolLM2 就是这样），
    # zh: llguidance 于是把 `Ċ` 读成它自己的 UTF-8 字节：每个需要换行的语法都会失败。
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json(tokenizer), n_vocab=n_vocab, eos_token=eos_token_ids)


def tokenizer_json(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text of ``tokenizer``'s fast tokenizer (its tokenizer.json) as `llguidance_tokenizer` reads it: no padding,
    no truncation, and a byte-level vocabulary's decoder repaired."""
    # zh: ``tokenizer`` 的快速分词器的文本（即它的 tokenizer.json），按 `llguidance_tokenizer` 读它的样子：
    # zh: 不填充、不截断，字节级词表的解码器已修补。
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    byte_level = [step for step in _steps(spec.get("decoder")) if step["type"] == "ByteLevel"]
    if byte_level and any(step["type"] == "ByteLevel" for step in _steps(spec.get("pre_tokenizer"))):
        spec["decoder"] = byte_level[0]
    return json.dumps(spec)


def _steps(component: dict | None) -> list[dict]:
    """A tokenizer component's steps (a `Sequence` of decoders or pre-tokenizers, or the component alone)."""
    # zh: 分词器某个组件的各个步骤（解码器或预分词器的 `Sequence`，或组件本身）。
    if component is None:
        return []
    return component.get("decoders") or component.get("pretokenizers") or [component]


@dataclass
class SequenceGrammar:
    """One sequence's matcher, how many of its completion tokens it has read, and why it failed (None while it
    has not): from then on the sequence may only end."""
    # zh: 一个序列的匹配器、它已读入多少个生成 token，以及它失败的原因（没有失败时为 None）：失败之后，这个序列
    # zh: 只能结束。

    matcher: LLMatcher | None
    consumed: int = 0
    error: str | None = None


class Grammars:
    """Structured output in one object, beside the sampler: llguidance's view of the tokenizer, the compiled
    grammars, and a matcher for each constrained sequence, which masks its row of the logits before each token
    (`mask`)."""
    # zh: 结构化输出集中在一个对象里，和采样器放在一起：llguidance 眼中的分词器、已编译的语法，以及每个受约束序列的
    # zh: 匹配器，它在每个 token 之前盖住这个序列那一行的 logits（`mask`）。

    def __init__(self, config: Config) -> None:
        self.config = config
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = list(config.eos_token_ids)
        # en: What a sequence whose grammar failed may still write: its end-of-sequence tokens.
        # zh: 语法已经失败的序列还能写的东西：它的 end-of-sequence token。
        self.end_of_sequence = pack_tokens(self.eos_token_ids, self.vocab_size)
        # en: llguidance's view of the tokenizer, built at the first constrained request.
        # zh: llguidance 眼中的分词器，在第一个受约束的请求到来时构建。
        self._tokenizer: LLTokenizer | None = None
        self.compiled: dict[tuple[str, str, bool], LLMatcher] = {}
        # en: Each sequence's matcher lives as long as the sequence: a weak dictionary forgets one the engine let go.
        # zh: 每个序列的匹配器与序列同生共死：弱引用字典会忘掉引擎已经放下的序列。
        self.matchers: weakref.WeakKeyDictionary[Sequence, SequenceGrammar] = weakref.WeakKeyDictionary()
        # en: Drafts from the first one a grammar refused on, none of which can be kept: cut before a verify step
        # en: (`cut_drafts`), or left unmasked in one (`mask_drafts`).
        # zh: 从语法拒绝的第一个草稿起的草稿数，它们一个也不可能被保留：要么在验证步之前被截掉（`cut_drafts`），要么在
        # zh: 验证步里不加掩码（`mask_drafts`）。
        self.refused_drafts = 0

    @property
    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer: the model's vocabulary size (padding ids are never allowed)
        and every end-of-sequence id the model declares. Built at first use."""
        # zh: llguidance 眼中的模型分词器：带着模型的词表大小（填充 id 永远不被允许）和模型声明的每一个
        # zh: end-of-sequence id。第一次用到时才构建。
        if self._tokenizer is None:
            self._tokenizer = llguidance_tokenizer(load_tokenizer(self.config.model), self.vocab_size,
                                                   self.eos_token_ids)
        return self._tokenizer

    def compile(self, constraint: StructuredOutputsParams) -> LLMatcher:
        """The matcher of ``constraint`` before any token, compiled against the tokenizer once for each kind and
        exact text (`StructuredOutputsParams.key`), its first mask computed; a ValueError says what failed."""
        # zh: ``constraint`` 在读任何 token 之前的匹配器：针对分词器，每种约束的每段原文只编译一次
        # zh: （`StructuredOutputsParams.key`），并算好第一个掩码；失败时 ValueError 说明是什么失败了。
        matcher = self.compiled.get(constraint.key)
        if matcher is None:
            from llguidance import LLMatcher

            matcher = LLMatcher(self.tokenizer, constraint.llguidance_grammar, limits=grammar_limits(), log_level=0)
            fill_bitmask(matcher, torch.empty(1, bitmask_words(self.vocab_size), dtype=torch.int32), 0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs.{constraint.kind} cannot be compiled: {matcher.get_error()}")
            if len(self.compiled) >= MAX_GRAMMARS:
                del self.compiled[next(iter(self.compiled))]
            self.compiled[constraint.key] = matcher
        return matcher

    @staticmethod
    def constrained(seqs: list[Sequence]) -> bool:
        """Whether a step holds a constrained sequence (a rank that samples nothing has no sampling params)."""
        # zh: 这一步里是否有受约束的序列（不采样的 rank 没有采样参数）。
        return any(s.sampling_params is not None and s.sampling_params.structured_outputs is not None for s in seqs)

    def mask(self, seqs: list[Sequence], logits: torch.Tensor | None, previous: SampledTokens | None = None) -> None:
        """Mask, in place, the logits (one row per sequence of the step) of each constrained sequence that samples a
        token: -inf for every token its grammar forbids. Each matcher first reads the tokens its sequence gained
        since its last mask; one that the step in flight (``previous``) still computes is waited for."""
        # zh: 就地盖住这一步中每个要采样 token 的受约束序列的 logits（每个序列一行）：它的语法禁止的每个 token 都设成
        # zh: -inf。每个匹配器先读入它的序列自上次掩码以来新增的 token；正在计算的那一步（``previous``）还在算的 token
        # zh: 要等它算完。
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.structured_outputs is not None
                and seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq)]
        if logits is None or not rows:
            return
        bitmask = self.allow_all(len(rows), logits)
        self.fill([seqs[i] for i in rows], bitmask, previous)
        apply_bitmask(logits, bitmask, rows)

    def fill(self, seqs: list[Sequence], bitmask: torch.Tensor, previous: SampledTokens | None = None) -> None:
        """Write into row i of ``bitmask`` (int32, on the host) the tokens ``seqs[i]`` may sample next: those its
        grammar allows once its matcher has read the tokens its sequence gained since its last mask (`follow`), or
        every token for an unconstrained sequence (or one whose logits were not numbers: the engine drops it). A
        token that the step in flight (``previous``) still computes is waited for."""
        # zh: 把 ``seqs[i]`` 下一步可以采样的 token 写进 ``bitmask``（int32，在主机上）的第 i 行：它的匹配器读入序列
        # zh: 自上次掩码以来新增的 token（`follow`）之后，语法允许的那些；不受约束的序列（或 logits 不是数的序列：
        # zh: 引擎会丢掉它）则是所有 token。正在计算的那一步（``previous``）还在算的 token 要等它算完。
        constrained = [seq.sampling_params.structured_outputs is not None for seq in seqs]
        pending = self.pending_tokens(seqs, constrained, previous)
        for row, (seq, held) in enumerate(zip(seqs, constrained, strict=True)):
            state = self.follow(seq, pending) if held else None
            # en: One row after another: llguidance's parallel fill (`fill_next_token_bitmask_par`) saved little
            # en: on two cores and took longer on sixteen (1.65x the serial time at 256 rows;
            # en: scripts/probes/fill_bitmask_par.py).
            # zh: 一行接一行地填：llguidance 的并行填充（`fill_next_token_bitmask_par`）在两个核上省不了多少，
            # zh: 在十六个核上反而更慢（256 行时是串行时间的 1.65 倍；scripts/probes/fill_bitmask_par.py）。
            if state is None:
                bitmask[row] = -1
            else:
                self.fill_row(seq, state, bitmask, row)

    @staticmethod
    def pending_tokens(seqs: list[Sequence], constrained: list[bool], previous: SampledTokens | None
                       ) -> dict[tuple[int, int], int]:
        """The tokens of the step in flight (``previous``), by request and sample, waited for if a constrained
        sequence's last token is one of them; otherwise none."""
        # zh: 正在计算的那一步（``previous``）的 token，按请求和样本索引；只有受约束序列的最后一个 token 是其中之一时
        # zh: 才等它们，否则为空。
        waits = any(held and seq.last_token == PENDING_TOKEN for seq, held in zip(seqs, constrained, strict=True))
        if previous is None or not waits:
            return {}
        # en: A constrained step's one wait: its masks need the tokens of the step in flight.
        # zh: 受约束的一步唯一的等待：它的掩码需要正在计算的那一步的 token。
        previous.token_ids()
        return dict(zip(previous.samples, previous.on_host.tolist(), strict=True))

    def host_bitmasks(self, rows: int, copies: int, pinned: bool) -> list[torch.Tensor]:
        """``copies`` bitmasks of ``rows`` rows on the host, each allowing every token, where the host fills a step's
        masks before they travel to the device (`MaskedSamplingGraphs`); ``pinned``: in pinned memory."""
        # zh: 主机上 ``copies`` 份 ``rows`` 行的位掩码，每份都允许所有 token：主机在这里填好一步的掩码，再送到设备上
        # zh: （`MaskedSamplingGraphs`）；``pinned``：放在锁页内存里。
        words = bitmask_words(self.vocab_size)
        return [torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pinned) for _ in range(copies)]

    def allow_all(self, rows: int, logits: torch.Tensor) -> torch.Tensor:
        """``rows`` bitmask rows on the host that allow every token, for the masks of ``logits``."""
        # zh: 主机上 ``rows`` 行允许所有 token 的位掩码，用来给 ``logits`` 加掩码。
        # en: On a GPU, in pinned memory: its copy to the device then waits for nothing queued before it.
        # zh: 在 GPU 上放在锁页内存里：这样它拷到设备上时，不必等排在它前面的工作。
        return torch.full((rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32, pin_memory=logits.is_cuda)

    def fill_row(self, seq: Sequence, state: SequenceGrammar, bitmask: torch.Tensor, row: int) -> bool:
        """Write into row ``row`` of ``bitmask`` the tokens ``seq``'s grammar allows next, or only its end-of-sequence
        tokens once the grammar has failed (now or before); whether it still holds."""
        # zh: 把 ``seq`` 的语法接下来允许的 token 写进 ``bitmask`` 的第 ``row`` 行；语法（此刻或之前）已经失败时，
        # zh: 只写它的 end-of-sequence token。返回语法是否仍然成立。
        if state.error is None:
            fill_bitmask(state.matcher, bitmask, row)
            if state.matcher.is_error():
                self.fail(seq, state, state.matcher.get_error())
        if state.error is not None:
            bitmask[row] = self.end_of_sequence
        return state.error is None

    def mask_drafts(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Mask, in place, a verify step's logits (`ModelRunner.verify`: each sequence's rows in turn, one for its
        last token and one for each draft): row i of a constrained sequence by its grammar after its committed tokens
        and first i drafts (`fill_verify_rows`). Rows after a draft the grammar refuses (or an end-of-sequence draft)
        stay unmasked: the engine never keeps their tokens, since the row of that draft cannot sample it. The
        matchers end where they began; they read the drafts the engine keeps at the next mask."""
        # zh: 就地盖住一个验证步的 logits（`ModelRunner.verify`：依次是每个序列的各行，一行给它的最后一个 token，
        # zh: 每个草稿一行）：受约束序列的第 i 行，由它的语法在读过序列已确定的 token 和前 i 个草稿之后来盖。语法拒绝的
        # zh: 草稿（或 end-of-sequence 草稿）之后的行不加掩码：引擎从不保留那些行的 token，因为那个草稿所在的行采样
        # zh: 不出它。匹配器最后回到开始的地方，即读过已确定 token 之后的状态；引擎保留下的草稿，它们在下一次掩码时
        # zh: 读入。
        spans, first = [], 0
        for seq in seqs:
            if seq.sampling_params.structured_outputs is not None:
                spans.append((seq, first))
            first += seq.num_scheduled_tokens
        if not spans:
            return
        rows = [start + i for seq, start in spans for i in range(seq.num_scheduled_tokens)]
        bitmask = self.allow_all(len(rows), logits)
        self.fill_verify_rows([seq for seq, _ in spans], bitmask)
        apply_bitmask(logits, bitmask, rows)

    def fill_verify_rows(self, seqs: list[Sequence], bitmask: torch.Tensor) -> None:
        """The constrained ``seqs``' rows of a verify step's ``bitmask``, one sequence's after another."""
        # zh: 一个验证步的 ``bitmask`` 中受约束的 ``seqs`` 的各行，一个序列接一个序列。
        row = 0
        for seq in seqs:
            self.fill_draft_rows(seq, bitmask[row : row + seq.num_scheduled_tokens])
            row += seq.num_scheduled_tokens

    def cut_drafts(self, seqs: list[Sequence], drafts: list[list[int]]) -> list[list[int]]:
        """Each sequence's ``drafts`` (a speculator's proposal, before the scheduler reserves their slots) up to the
        first that its grammar refuses; all of them for a sequence whose grammar failed; a plain sequence's as they
        are. The engine could keep neither a refused draft nor any after it, so a verify row spent on one is wasted.
        The matchers do not move (`validate_tokens`)."""
        # zh: 每个序列的 ``drafts``（投机器提出的草稿，调度器为它们预留槽位之前）截到它的语法拒绝的第一个为止；语法已经
        # zh: 失败的序列，草稿全部去掉；普通序列的草稿原样保留。引擎既不可能保留被拒绝的草稿，也不可能保留它之后的任何
        # zh: 草稿，所以花在它们身上的验证行都是浪费。匹配器不动（`validate_tokens`）。
        cut = []
        for seq, draft in zip(seqs, drafts, strict=True):
            if draft and seq.sampling_params.structured_outputs is not None:
                state = self.follow(seq, {})
                valid = 0 if state is None or state.error is not None else state.matcher.validate_tokens(draft)
                self.refused_drafts += len(draft) - valid
                draft = draft[:valid]
            cut.append(draft)
        return cut

    def fill_draft_rows(self, seq: Sequence, bitmask: torch.Tensor) -> None:
        """Fill ``seq``'s rows of a verify step's ``bitmask`` (see `mask_drafts`): row 0 as `mask` would, then, for
        each draft the grammar takes, the row after it; the matcher takes the drafts one by one and gives them back
        (`rollback`) at the end."""
        # zh: 填好 ``seq`` 在验证步 ``bitmask`` 里的各行（见 `mask_drafts`）：第 0 行和 `mask` 填的一样，之后语法每接受
        # zh: 一个草稿，就填它后面的那一行；匹配器逐个读入草稿，最后把它们退回去（`rollback`）。
        # en: A verify step's last token is never pending (drafts are proposed from it), so no step is waited for.
        # zh: 验证步的最后一个 token 从不是待定的（草稿就是从它提出的），所以不必等任何一步。
        state = self.follow(seq, {})
        if state is None:
            return
        if not self.fill_row(seq, state, bitmask, 0):
            bitmask[:] = self.end_of_sequence
            return
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
        taken = 0
        for draft in drafts:
            # en: An end-of-sequence draft ends the sequence if kept, and a refused one is never kept: the rows after
            # en: either never count. (try_consume_tokens takes no end-of-sequence token: the check must come first.)
            # zh: end-of-sequence 草稿一旦被保留，序列就在那里结束；被拒绝的草稿从不会被保留：两者之后的行都不算数。
            # zh: （try_consume_tokens 不接受 end-of-sequence token：必须先做这个检查。）
            if draft in self.eos_token_ids or state.matcher.try_consume_tokens([draft]) != 1:
                self.refused_drafts += 0 if draft in self.eos_token_ids else len(drafts) - taken
                break
            taken += 1
            fill_bitmask(state.matcher, bitmask, taken)
        if taken:
            state.matcher.rollback(taken)

    def follow(self, seq: Sequence, pending: dict[tuple[int, int], int]) -> SequenceGrammar | None:
        """``seq``'s matcher, once it has read the completion tokens ``seq`` gained since its last mask (a pending one
        from ``pending``, by request and sample), drafts not included; None if one of them is the sampler's mark of
        logits that are not numbers (the engine drops the sequence)."""
        # zh: ``seq`` 的匹配器，在它读入 ``seq`` 自上次掩码以来新增的生成 token（不含草稿）之后返回（待定的 token
        # zh: 按请求和样本从 ``pending`` 里取）；如果其中有采样器对“logits 不是数”的标记，返回 None（引擎会丢弃这个
        # zh: 序列）。
        state = self.state_of(seq)
        tokens = self.unread_tokens(seq, state, pending)
        if tokens is None:
            return None
        for token in tokens:
            if state.error is None and not state.matcher.consume_token(token):
                self.fail(seq, state, state.matcher.get_error() or f"token {token} does not fit the grammar")
            state.consumed += 1
        return state

    def state_of(self, seq: Sequence) -> SequenceGrammar:
        """``seq``'s matcher and progress, started at its first mask (`start`)."""
        # zh: ``seq`` 的匹配器和进度，在它第一次加掩码时开始（`start`）。
        state = self.matchers.get(seq)
        if state is None:
            state = self.matchers[seq] = self.start(seq)
        return state

    @staticmethod
    def unread_tokens(seq: Sequence, state: SequenceGrammar, pending: dict[tuple[int, int], int]) -> list[int] | None:
        """The completion tokens ``seq`` gained since its matcher last read (`follow`), drafts not included, a pending
        one taken from ``pending``; None if one of them is the sampler's mark of logits that are not numbers."""
        # zh: ``seq`` 自匹配器上次读入以来新增的生成 token（`follow`），不含草稿，待定的那个从 ``pending`` 里取；
        # zh: 如果其中有采样器对“logits 不是数”的标记，返回 None。
        first = seq.num_prompt_tokens + state.consumed - seq.first_token_index
        tokens = seq.token_ids[first : len(seq.token_ids) - seq.num_draft_tokens]
        if PENDING_TOKEN in tokens:
            tokens = [pending[(seq.request_id, seq.sample_index)] if token == PENDING_TOKEN else token
                      for token in tokens]
        return None if tokens and min(tokens) < 0 else tokens

    def start(self, seq: Sequence) -> SequenceGrammar:
        """A new sequence's matcher: a copy of its constraint's compiled matcher. A sibling forked for n > 1 gets one
        too: it forks when its request's first token is sampled, when its parent's matcher has read nothing yet."""
        # zh: 新序列的匹配器：它的约束的已编译匹配器的一份拷贝。为 n > 1 分叉出来的兄弟序列也这样得到：它在请求的
        # zh: 第一个 token 被采样时分叉，那时父序列的匹配器还什么都没读。
        if not self.eos_token_ids:
            raise ValueError(f"structured output ends a request with an end-of-sequence token, and "
                             f"{self.config.model} declares none (eos_token_id in generation_config.json or "
                             "config.json)")
        state = SequenceGrammar(None)
        try:
            state.matcher = self.compile(seq.sampling_params.structured_outputs).deep_copy()
        except ValueError as error:
            self.fail(seq, state, str(error))
        return state

    def fail(self, seq: Sequence, state: SequenceGrammar, error: str) -> None:
        """Record why ``seq``'s grammar failed, and log it: from its next mask on, the sequence may only end."""
        # zh: 记下 ``seq`` 的语法失败的原因，并写进日志：从下一个掩码起，这个序列只能结束。
        state.error = error
        _logger.warning("request %d, sample %d: structured output failed after %d tokens, so the request ends here: "
                        "%s", seq.request_id, seq.sample_index, seq.num_completion_tokens, error)



# %% [markdown] tags=["en"]
# ## Build it: the runner masks
#
# The one place where the engine meets the grammars is where a step's logits become tokens: the
# runner's `launch` (chapter 18). A decode step whose rows all sample plainly samples inside a
# captured graph (`SamplingGraphs`); with a constrained row it still does, from a second set of
# graphs, `MaskedSamplingGraphs`, which read one more input: a bitmask of fixed address on the
# device, [rows, words] int32, turned into -inf between the LM head and the sampler (`forbid`: three
# kernels, nothing read back). An unconstrained row of such a step allows every token. Every other
# step with a constrained row (a prefill, a row with top-k, top-p, a seed or a fork, a batch larger
# than every graph, a CPU) samples eagerly, and `Grammars.mask` masks its logits before the sampler.
# Both paths write the rows with `Grammars.fill`, one row after another, while the step's forward
# runs. (`launch` is written again whole, 17 lines, rather than given a hook in chapter 18 that
# would name grammars eleven chapters early; the graph path's new work is in two new members,
# `graph_draw` and, for a constrained step, `masked_draw`.) Every rank's runner gets its `Grammars`
# with the runner (`add_to_init`): the sampling rank is the one that uses it.

# %% [markdown] tags=["zh"]
# ## 动手：执行器加掩码
#
# 引擎与语法相遇的唯一地方，是一步的 logits 变成 token 的地方：执行器的 `launch`（第 18 章）。各行都只做普通采样的
# decode 步在捕获好的图里采样（`SamplingGraphs`）；有受约束的行时仍然如此，只是换成第二组图 `MaskedSamplingGraphs`，
# 它们多读一个输入：设备上一个地址固定的位掩码，[rows, 字数] 的 int32，在 LM head 和采样器之间变成 -inf（`forbid`：
# 三个 kernel，不往回读任何东西）。这样一步里不受约束的行允许所有 token。其他带受约束行的步（prefill，带 top-k、
# top-p、种子或分叉的行，比所有图都大的批，CPU）以 eager 方式采样，由 `Grammars.mask` 在采样器之前盖住它的 logits。
# 两条路径都用 `Grammars.fill` 一行接一行地写各行，同时这一步的前向计算在运行。（这里把 `launch` 整个
# 重写了一遍，17 行，而不是在第 18 章埋一个钩子，那样会早十一章就提到语法；图路径新增的工作放在两个新成员里：
# `graph_draw`，以及有受约束序列时的 `masked_draw`。）每个 rank 的执行器在构建时得到自己的 `Grammars`
# （`add_to_init`）：用到它的是负责采样的那个 rank。

# %% masked sampling graphs
#| export
from nanovllm.engine.cuda_graphs import SamplingGraphs


class MaskedSamplingGraphs(SamplingGraphs):
    """Chapter 18's sampling graphs with a bitmask between the LM head and the sampler (`forbid`), for decode steps
    that hold a constrained sequence and whose rows sample plainly. A step's bitmask travels in one copy: the host
    fills rows of a pinned buffer (`host_rows`), `send` queues their copy on a stream of its own, and `sample`
    replays the bucket's graph once that copy is done. ``hosts``: the host's buffers, [rows, words] int32 each, at
    least as many rows as the largest bucket (`Grammars.host_bitmasks`)."""
    # zh: 第 18 章的采样图，在 LM head 和采样器之间多了一个位掩码（`forbid`），给那些带受约束序列、各行都只做普通
    # zh: 采样的 decode 步用。一步的位掩码一次拷贝送出：主机填好锁页缓冲区里的各行（`host_rows`），`send` 在一条
    # zh: 自己的流上排入它们的拷贝，`sample` 等这次拷贝完成后重放该档位的图。``hosts``：主机上的缓冲区，每份都是
    # zh: [行数, 字数] 的 int32，行数不少于最大的档位（`Grammars.host_bitmasks`）。

    def __init__(self, plain: SamplingGraphs, hosts: list[torch.Tensor]) -> None:
        super().__init__(plain.model, plain.graphs, plain.sample_plain)
        # en: One Philox key for both kinds of graph: each step moves it on, whichever draws.
        # zh: 两种图共用一个 Philox 密钥：每一步都让它前进，不管是哪一种来抽取。
        self.seed = plain.seed
        rows, device, words = self.graphs.sizes[-1], self.graphs.device, hosts[0].shape[1]
        assert all(host.shape[0] >= rows for host in hosts), "a host buffer has fewer rows than the largest bucket"
        on_gpu = device.type == "cuda"
        # en: [rows, words] int32, what the graphs read; a padding row keeps what it held (its token is never used).
        # zh: [rows, 字数] 的 int32，图读的就是它；填充行保持原样（它的 token 从不被使用）。
        self.bitmask = torch.full((rows, words), -1, dtype=torch.int32, device=device)
        # en: The host's side, pinned, in two copies taken in turn: under asynchronous scheduling the host fills step
        # en: n + 1's rows while step n's copy may still be queued, so it never writes into the copy in flight; before
        # en: it takes a copy again, it waits for that copy's last transfer (`sent`), which in practice is long done.
        # zh: 主机这边，锁页内存，两份轮流用：异步调度下，主机填第 n + 1 步的各行时，第 n 步的拷贝可能还在队列里，
        # zh: 所以它从不写正在传输的那一份；再次用到一份之前，先等那一份上次的传输结束（`sent`），实际上早就结束了。
        self.hosts = hosts
        self.sent = [torch.cuda.Event() if on_gpu else None for _ in hosts]
        self.turn = 0
        # en: The copies run on a stream of their own, beside the model's forward; each waits for `read`, recorded
        # en: after the last replay, which read the device's bitmask. None on a CPU, where a copy is made when called.
        # zh: 拷贝在自己的一条流上运行，与模型的前向计算并行；每次拷贝先等 `read`，它在上一次重放之后记录，那次重放读过
        # zh: 设备上的位掩码。在 CPU 上为 None，拷贝在调用时就完成。
        self.copier = torch.cuda.Stream(device) if on_gpu else None
        self.read = torch.cuda.Event() if on_gpu else None

    def draw(self, size: int) -> None:
        """What a replay of the ``size`` bucket does: chapter 18's draw, with the bitmask's first ``size`` rows
        applied to the logits before the race."""
        # zh: 重放 ``size`` 档位的图做的事：第 18 章的 draw，只是在竞赛之前先把位掩码的前 ``size`` 行盖到 logits 上。
        logits = self.model.compute_logits(self.graphs.outputs[:size])
        forbid(logits, self.bitmask[:size])
        self.tokens[:size] = self.sample_plain(logits, self.temperatures[:size], seed=self.seed)
        self.seed += 1

    def host_rows(self, n: int) -> torch.Tensor:
        """The host's next copy, rows [n, words], for the step about to be sampled to fill (then `send`)."""
        # zh: 主机的下一份缓冲区的前 n 行 [n, 字数]，由即将采样的那一步来填（然后 `send`）。
        self.turn = (self.turn + 1) % len(self.hosts)
        if self.sent[self.turn] is not None:
            self.sent[self.turn].synchronize()
        return self.hosts[self.turn][:n]

    def send(self, n: int) -> None:
        """Queue the copy of the ``n`` rows just filled to the device's bitmask, after the last replay has read it;
        the next work on the current stream (the replay) waits for the copy."""
        # zh: 把刚填好的 ``n`` 行排队拷到设备上的位掩码里，排在上一次读它的重放之后；当前流上接下来的工作（重放）等这次
        # zh: 拷贝完成。
        rows, sent = self.hosts[self.turn][:n], self.sent[self.turn]
        if sent is None:
            self.bitmask[:n].copy_(rows)
            return
        self.copier.wait_event(self.read)
        with torch.cuda.stream(self.copier):
            self.bitmask[:n].copy_(rows, non_blocking=True)
            sent.record()
        torch.cuda.current_stream().wait_event(sent)

    def sample(self, temperatures: list[float]) -> torch.Tensor:
        """Chapter 18's `sample` under the bitmask rows just sent; then `read` marks the end of this replay."""
        # zh: 在刚送出的位掩码各行之下做第 18 章的 `sample`；然后用 `read` 标出这次重放的结束。
        tokens = super().sample(temperatures)
        if self.read is not None:
            self.read.record()
        return tokens


# %% runner masks
#| export engine.model_runner
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.cuda_graphs import plain_temperatures
from nanovllm.engine.grammars import Grammars, MaskedSamplingGraphs
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, sibling_samples
from nanovllm.layers.linear import share_from_rank0


@add_to_init(ModelRunner)
def _init_grammars(self) -> None:
    # en: Structured output (chapter 29): the matchers of constrained sequences, which mask their logits.
    # zh: 结构化输出（第 29 章）：受约束序列的匹配器，它们盖住这些序列的 logits。
    self.grammars = Grammars(self.config)
    # en: The sampling graphs with a bitmask, captured at the first constrained step that can use them (`graph_draw`).
    # zh: 带位掩码的采样图，在第一个能用上它们的受约束步才捕获（`graph_draw`）。
    self.masked_sampling: MaskedSamplingGraphs | None = None


@add_to_class(ModelRunner)
@torch.inference_mode()
def launch(self, seqs: list[Sequence], is_prefill: bool, previous: SampledTokens | None = None) -> SampledTokens:
    """Queue one step on the device and return without waiting for it. ``previous``: see `compute_logits`. A
    decode step that a graph covers and whose rows all sample plainly samples inside the captured step
    (`graph_draw`), constrained or not; any other step with a constrained sequence samples eagerly, after
    `Grammars.mask`."""
    # zh: 把一步排进设备的队列，不等它完成就返回。``previous``：见 `compute_logits`。图能覆盖、各行都只做普通采样的
    # zh: decode 步，不论是否受约束，都在捕获好的那一步里采样（`graph_draw`）；其他带受约束序列的步在
    # zh: `Grammars.mask` 之后以 eager 方式采样。
    assert not is_prefill or PENDING_TOKEN not in (s.last_token for s in seqs), "a prefill before its last token"
    if not is_prefill and self.sampling_graphs is not None and self.graphs is not None \
            and self.graphs.covers(len(seqs)):
        temperatures = plain_temperatures(seqs)
        if temperatures is not None:
            pending = self.begin_step(seqs, previous)
            # en: The model's graph writes the hidden states that the sampling graph reads (graphs.outputs); it is
            # en: queued first, so that its forward runs while the host waits and fills a constrained step's bitmask.
            # zh: 模型的图写出采样图要读的隐藏状态（graphs.outputs）；它先排进队列，这样主机为受约束的一步等待、填写
            # zh: 位掩码时，它的前向计算同时在跑。
            self.replay_staged(seqs, previous if pending else None)
            return self.graph_draw(seqs, temperatures, previous)
    logits = self.compute_logits(seqs, is_prefill, previous)
    if self.grammars.constrained(seqs):
        self.grammars.mask(seqs, logits, previous)
    rows, sampled = self.sample(seqs, logits)
    sampled = share_from_rank0(sampled, len(rows) + len(sibling_samples(seqs)), self.device)
    # en: Only the rank that sampled needs the tokens on the host (the others never read them there).
    # zh: 只有负责采样的 rank 需要把 token 拿到主机上（其他 rank 从不在主机上读它们）。
    return SampledTokens.start(seqs, rows, sampled, to_host=logits is not None)


@add_to_class(ModelRunner)
def graph_draw(
    self, seqs: list[Sequence], temperatures: list[float], previous: SampledTokens | None
) -> SampledTokens:
    """The tokens of a decode step just replayed whose rows sample plainly (row i at ``temperatures[i]``), from one
    more replay: chapter 18's sampling graphs, or, with a constrained sequence, the masked ones (`masked_draw`)."""
    # zh: 一个 decode 步的 token：它的模型图刚刚重放，各行都只做普通采样，第 i 行的温度是 ``temperatures[i]``，由再一次
    # zh: 重放抽出：第 18 章的采样图；若有受约束的序列，则是带掩码的那些（`masked_draw`）。
    if not self.grammars.constrained(seqs):
        return SampledTokens.start(seqs, list(range(len(seqs))), self.sampling_graphs.sample(temperatures))
    if self.masked_sampling is None:
        # en: Captured at the first constrained step rather than at start: an engine that never sees a constraint
        # en: pays neither the capture (one graph per bucket, largest first, as chapter 14 captures) nor the memory.
        # en: They share the graphs' pool, since no two replays ever overlap; here, after this step's forward was
        # en: queued (the capture waits for it, once) and before any replay of theirs, so no step reads their tokens.
        # zh: 在第一个受约束的步才捕获，而不是在启动时：从来没遇到约束的引擎既不付捕获的时间（每个档位一个图，
        # zh: 从大到小，和第 14 章的捕获一样），也不付内存。它们共用图的内存池，因为任何两次重放都不会重叠；捕获发生在
        # zh: 这一步的前向计算排进队列之后（捕获要等它一次），在它们的任何重放之前，所以没有哪一步在读它们的 token。
        on_gpu = self.graphs.device.type == "cuda"
        hosts = self.grammars.host_bitmasks(self.graphs.sizes[-1], copies=2, pinned=on_gpu)
        self.masked_sampling = MaskedSamplingGraphs(self.sampling_graphs, hosts)
        self.masked_sampling.capture()
    return self.masked_draw(seqs, temperatures, previous)


@add_to_class(ModelRunner)
def masked_draw(
    self, seqs: list[Sequence], temperatures: list[float], previous: SampledTokens | None
) -> SampledTokens:
    """`graph_draw` with a constrained sequence: the host fills the step's bitmask (`Grammars.fill`, which waits for
    ``previous`` when a constrained row's token is still pending), sends it, and the masked graph samples."""
    # zh: 有受约束序列时的 `graph_draw`：主机填好这一步的位掩码（`Grammars.fill`；受约束行的 token 还待定时，它会等
    # zh: ``previous``），送出去，再由带掩码的图采样。
    self.grammars.fill(seqs, self.masked_sampling.host_rows(len(seqs)), previous)
    self.masked_sampling.send(len(seqs))
    return SampledTokens.start(seqs, list(range(len(seqs))), self.masked_sampling.sample(temperatures))


# %% [markdown] tags=["en"]
# A verify step (chapter 25) samples too: one row for each sequence's last token and one for each of
# its drafts. Its rows are masked the same way, between the LM head and the sampler, by
# `Grammars.mask_drafts`: row *i* of a constrained sequence by its grammar after its first *i*
# drafts (why that is enough: "Masks meet the rest of the engine", below). Chapter 25's `verify` is
# its forward (`verify_logits`) then its sampling (`sample_verify`); it is written again here, three
# lines, with the mask between them (a hook in chapter 25 would name grammars four chapters early).

# %% [markdown] tags=["zh"]
# 验证步（第 25 章）也采样：每个序列的最后一个 token 一行，它的每个草稿各一行。它的各行也以同样的方式加掩码，位置在 LM
# head 和采样器之间，由 `Grammars.mask_drafts` 来做：受约束序列的第 *i* 行，由它读过前 *i* 个草稿之后的语法来盖（为什么
# 这样就够了，见下文“掩码遇上引擎的其余部分”）。第 25 章的 `verify` 先做前向计算（`verify_logits`），再采样
# （`sample_verify`）；这里把它重写一遍，三行，掩码放在两者之间（在第 25 章埋一个钩子，会早四章就提到语法）。

# %% runner masks drafts
#| export engine.model_runner
@add_to_class(ModelRunner)
@torch.inference_mode()
def verify(self, seqs: list[Sequence]) -> list[list[int]]:
    """One forward over each sequence's scheduled tokens (its last token and its drafts) after its cached prefix;
    returns, per sequence, the model's token after each of them, sampled with the sequence's own parameters and,
    for a constrained sequence, under its grammar after the drafts before it (`Grammars.mask_drafts`)."""
    # zh: 在每个序列已缓存的前缀之后，对它调度的 token（它的最后一个 token 和它的草稿）做一次前向计算；按序列返回模型
    # zh: 在其中每一个之后给出的 token，用该序列自己的参数采样；受约束的序列还要服从它读过前面那些草稿之后的语法
    # zh: （`Grammars.mask_drafts`）。
    logits = self.verify_logits(seqs)
    if self.grammars.constrained(seqs):
        self.grammars.mask_drafts(seqs, logits)
    return self.sample_verify(seqs, logits)


# %% [markdown] tags=["en"]
# The engine can do better than mask a draft the grammar refuses: not verify it at all. A refused
# draft is never kept, nor is any draft after it, so `Grammars.cut_drafts` cuts each constrained
# sequence's proposal at its first refused draft (`validate_tokens` checks them without moving the
# matcher) before the scheduler reserves their slots; a sequence left with no drafts decodes plainly.
# That changes one line of chapter 25's `LLMEngine._reserve_drafts`, written again here (9 lines).

# %% [markdown] tags=["zh"]
# 对语法拒绝的草稿，引擎可以做得比加掩码更好：根本不验证它。被拒绝的草稿永远不会被保留，它之后的草稿也不会，所以
# `Grammars.cut_drafts` 在调度器为草稿预留槽位之前，把每个受约束序列的提议截到语法拒绝的第一个草稿为止
# （`validate_tokens` 检查它们，不移动匹配器）；一个草稿都不剩的序列就做普通的 decode。这改动了第 25 章
# `LLMEngine._reserve_drafts` 的一行，这里把它重写了一遍（9 行）。

# %% engine cuts drafts
#| export engine.llm_engine
from nanovllm.engine.llm_engine import LLMEngine


@add_to_class(LLMEngine)
def _reserve_drafts(self, seqs: list[Sequence]) -> bool:
    """Give a scheduled decode step the speculator's drafts, in slots the scheduler reserves; whether it got any.
    Drafts a constrained sequence's grammar refuses are cut first (`Grammars.cut_drafts`)."""
    # zh: 把投机器的草稿交给一个已调度的 decode 步，放进调度器预留的槽位；返回是否拿到了草稿。受约束序列的语法拒绝的
    # zh: 草稿先被截掉（`Grammars.cut_drafts`）。
    if self.speculator is None:
        return False
    drafts = self.speculator.propose(seqs, self.scheduler.budget_left(seqs))
    # en: A speculating engine runs in one process (chapter 25 refuses tensor parallelism): its runner is at hand.
    # zh: 做投机的引擎只在一个进程里运行（第 25 章拒绝张量并行）：它的执行器就在手边。
    grammars = self.model_runner.grammars
    if grammars.constrained(seqs):
        drafts = grammars.cut_drafts(seqs, drafts)
    return self.scheduler.reserve_drafts(seqs, drafts) > 0


# %% [markdown] tags=["en"]
# ## Try it: the tiny model under four constraints
#
# An engine built now has its grammars. The tiny model's weights are random, so whatever it writes
# is noise, but under a constraint it is noise of the right shape: a date, one of two words, a JSON
# object with the schema's two fields. For each output a fresh matcher replays the tokens and must
# accept them all; an output that ended with an end-of-sequence token is a whole sentence of the
# grammar, and `max_tokens` may cut one short (then the matcher has accepted a prefix). With
# flexible blanks the tiny model writes blanks until `max_tokens` ends it; without them
# (`disable_any_whitespace=True`) it writes the object.

# %% [markdown] tags=["zh"]
# ## 试一试：小模型和四种约束
#
# 现在构建的引擎已经带着它的语法了。小模型的权重是随机的，所以它写的都是噪声，但在约束之下，这些噪声有正确的形状：一个
# 日期、两个单词之一、一个带着 schema 那两个字段的 JSON 对象。对每个输出，用一个全新的匹配器重放它的 token，它必须全部
# 接受；以 end-of-sequence token 结束的输出是语法里一个完整的句子，而 `max_tokens` 可能把句子截断（那时匹配器接受的是
# 一个前缀）。允许随意空白时，小模型一直写空白，直到 `max_tokens` 让它停下；不允许空白（`disable_any_whitespace=True`）
# 时，它写出了那个对象。

# %%
from nanovllm import LLM

llm = LLM(str(tiny), device="cpu")
grammars = llm.model_runner.grammars
SHAPE = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["color", "size"], "additionalProperties": False}
constraints = {"regex": StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
               "choice": StructuredOutputsParams(choice=["yes", "no"]),
               "json": StructuredOutputsParams(json=SHAPE),
               "json.": StructuredOutputsParams(json=SHAPE, disable_any_whitespace=True)}


def accepted(constraint: StructuredOutputsParams, tokens: list[int]) -> bool:
    """Whether a fresh matcher of ``constraint`` accepts ``tokens``, and, if they end with an end-of-sequence token,
    whether the text before it is whole."""
    # zh: ``constraint`` 的一个全新匹配器是否接受 ``tokens``；如果它们以 end-of-sequence token 结尾，之前的文本
    # zh: 是否完整。
    matcher = grammars.compile(constraint).deep_copy()
    return all(matcher.consume_token(token) for token in tokens) and (tokens[-1] not in EOS or matcher.is_stopped())


outputs = llm.generate([prompt] * len(constraints), [SamplingParams(temperature=0, max_tokens=24, structured_outputs=c)
                                                     for c in constraints.values()], use_tqdm=False)
for (kind, constraint), output in zip(constraints.items(), outputs, strict=True):
    ok = accepted(constraint, output["token_ids"])
    print(say("{kind:<6} {text!r:<36} {tokens:>2} tokens, the matcher accepts it: {accepted}", kind=kind,
              text=output["text"], tokens=len(output["token_ids"]), accepted=ok))
    assert ok
shaped = json.loads(outputs[-1]["text"])
assert outputs[-1]["token_ids"][-1] in EOS and set(shaped) == {"color", "size"} and shaped["color"] in WORDS
assert outputs[1]["text"] in ("yes", "no") and len(outputs[2]["token_ids"]) == 24

# %% [markdown] tags=["en"]
# ## See it: the grammar at each token
#
# The player below replays the compact JSON object token by token. Each frame draws one bitmask
# row of the tiny model's 512 tokens as it is: 16 int32 words of 32 bits, a word a row. Green
# squares are the tokens the grammar allows, the dark one is the token the model wrote (hover a
# square for its token). Most steps allow exactly one token: the schema fixes `{"color":"` and
# `","size":` character for character, and the model chooses only the color and the size.
# Such forced tokens need not be sampled one step at a time: llguidance lists them ahead
# (`compute_ff_tokens`), and an engine may append them all and compute them in one step, as a
# prefill computes a prompt (SGLang calls it jump-forward decoding).

# %% [markdown] tags=["zh"]
# ## 看它运行：每个 token 处的语法
#
# 下面的播放器逐个 token 重放那个紧凑的 JSON 对象。每一帧把小模型 512 个 token 的一行位掩码按原样画出来：16 个 32 位的
# int32 字，一个字一行。绿色方格是语法允许的 token，深色那个是模型写下的 token（鼠标移到方格上可以看到它是哪个
# token）。大多数步只允许一个 token：schema 把 `{"color":"` 和 `","size":` 一个字符一个字符地定死了，模型只选颜色和
# 大小。这样的强制 token 不必一步一个地采样：llguidance 可以提前把它们列出来（`compute_ff_tokens`），引擎可以把它们
# 一起接上，像 prefill 计算提示词那样在一步里算完（SGLang 称之为 jump-forward decoding）。

# %%
from html import escape

from IPython.display import HTML

from nanovllm.viz.player import lang_text, slides_html


def bitmask_svg(allowed: list[int], chosen: int, cell: int = 13) -> str:
    """A bitmask row of the tiny model's vocabulary as a grid: a row of squares per int32 word, a column per bit."""
    # zh: 把小模型词表上的一行位掩码画成网格：每个 int32 字一行方格，每一位一列。
    left, top, words = 40, 18, VOCAB // 32
    width, height = left + 32 * cell + 6, top + words * cell + 6
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="9"><rect x="{left}" y="{top}" width="{32 * cell}" height="{words * cell}" fill="#eceff1"/>',
             f'<text x="{left - 4}" y="{top - 5}" text-anchor="end">{lang_text("word", "字")}</text>']
    for bit in range(0, 32, 4):
        parts.append(f'<text x="{left + bit * cell + cell / 2}" y="{top - 5}" text-anchor="middle">{bit}</text>')
    for word in range(words):
        parts.append(f'<text x="{left - 4}" y="{top + word * cell + cell - 3}" text-anchor="end">{word}</text>')
    for token in allowed:
        fill = "#1b5e20" if token == chosen else "#66bb6a"
        x, y = left + token % 32 * cell, top + token // 32 * cell
        parts.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{fill}">'
                     f"<title>{token}: {escape(repr(texts[token]))}</title></rect>")
    return "".join(parts) + "</svg>"


compact = outputs[-1]["token_ids"]
matcher = grammars.compile(constraints["json."]).deep_copy()
slides, written, forced = [], "", 0
for step, token in enumerate(compact):
    row = torch.empty(1, VOCAB // 32, dtype=torch.int32)
    fill_bitmask(matcher, row, 0)
    allowed = allowed_tokens(row[0], VOCAB).nonzero().flatten().tolist()
    assert token in allowed and matcher.consume_token(token)
    forced += len(allowed) == 1
    shown = "⟨eos⟩" if token in EOS else texts[token]
    caption = lang_text(f"token {step + 1}: after {written!r}, {len(allowed)} of {VOCAB} tokens allowed; "
                        f"the model wrote {shown!r}",
                        f"第 {step + 1} 个 token：在 {written!r} 之后，{VOCAB} 个 token 中允许 {len(allowed)} 个；"
                        f"模型写下 {shown!r}")
    slides.append((f'<div class="nvv-cap">{caption}</div>', bitmask_svg(allowed, token)))
    written += "" if token in EOS else texts[token]
print(say("{forced} of {total} tokens had exactly one allowed token", forced=forced, total=len(compact)))
assert forced >= len(compact) // 2
HTML(slides_html(slides, start=0, player_id="grammar-mask"))

# %% [markdown] tags=["en"]
# ## On a real model
#
# SmolLM2-135M-Instruct (the demo's model) is asked for a software engineer as JSON with a name and
# an age. Without a constraint it answers in a sentence, which no JSON parser takes. With the
# schema it writes an object that parses and validates (checked with the `jsonschema` package,
# which implements the standard independently of llguidance): the mask does not make the
# model smarter, but what it writes now has the shape the program needs. The blanks are flexible
# here: SmolLM2, unlike the random tiny model, uses them as a JSON printer would.

# %% [markdown] tags=["zh"]
# ## 在真实模型上
#
# 让 SmolLM2-135M-Instruct（演示用的模型）用 JSON 描述一位软件工程师，带名字和年龄。不加约束时，它用一句话回答，没有
# 哪个 JSON 解析器接受它。加上 schema，它写出的对象能解析，也通过校验（用 `jsonschema` 包检查，它独立于 llguidance
# 实现了这个标准）：掩码并没有让模型更聪明，但它写出的东西现在有了程序需要的形状。这里空白是可以随意写的：
# SmolLM2 不同于随机的小模型，它像 JSON 打印程序那样使用空白。

# %%
import jsonschema

from nanovllm.book.smollm2 import smollm2_dir

smol = LLM(str(smollm2_dir()), device="cpu", max_model_len=512)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
request = [{"role": "user", "content": "Describe a software engineer named Ada as JSON with name and age."}]
question = smol.tokenizer.apply_chat_template(request, tokenize=False, add_generation_prompt=True)


def fits(text: str) -> bool:
    """Whether ``text`` parses as JSON and validates against PERSON."""
    # zh: ``text`` 能否解析为 JSON 并通过 PERSON 的校验。
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


person = StructuredOutputsParams(json=PERSON)
free, shaped = smol.generate([question] * 2, [SamplingParams(temperature=0, max_tokens=40),
                                             SamplingParams(temperature=0, max_tokens=60, structured_outputs=person)],
                             use_tqdm=False)
print(say("unconstrained: {text!r}", text=free["text"]))
print(say("  parses and fits the schema: {valid}", valid=fits(free["text"])))
print(say("constrained:   {text!r}", text=shaped["text"]))
print(say("  parses and fits the schema: {valid}", valid=fits(shaped["text"])))
assert not fits(free["text"]) and fits(shaped["text"])

# %% [markdown] tags=["en"]
# Sampled, three samples of one request (n = 3, chapter 05): each has its own matcher from the fork
# on, and each fits the schema.

# %% [markdown] tags=["zh"]
# 采样时，一个请求的三个样本（n = 3，第 05 章）：从分叉起各有各的匹配器，每一个都符合 schema。

# %%
samples = smol.generate([question], SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=60,
                                                   structured_outputs=person), use_tqdm=False)[0]["outputs"]
for index, sample in enumerate(samples):
    print(say("sample {index} (seed 7, temperature 0.8): {text!r}, fits the schema: {valid}", index=index,
              text=sample["text"], valid=fits(sample["text"])))
assert len(samples) == 3 and all(fits(sample["text"]) for sample in samples)
smol.exit()

# %% [markdown] tags=["en"]
# ## Masks meet the rest of the engine
#
# **Asynchronous scheduling** (chapter 18) queues step *n* + 1 before step *n*'s tokens reach the
# host. The mask of step *n* + 1 needs token *n*: the matcher must read it first. The forward of
# step *n* + 1 does not need the mask, only its sampler does, so vLLM (since its pull request 26866)
# launches the forward without waiting, builds the bitmask on the CPU while the GPU runs it, and
# samples with it afterwards. `launch` above has that order. It replays step *n* + 1's model graph
# first; then `Grammars.fill` waits for step *n*'s tokens (the wait that collecting step *n* makes
# anyway), lets the matchers read them and fills the step's rows of a pinned host buffer while the
# GPU runs the forward. One copy, on a stream of its own, takes the rows to the device beside the
# forward; the masked sampling graph waits for that copy alone. Two host buffers take turns, so the
# host never writes into one whose copy may still be queued. (Measured below: the eager LM head,
# unpacking and sampler after the wait cost a third of the speed, hence the captured step. Chapter
# 29c lets the sampling wait later still.)
#
# **Speculative decoding** (chapter 25) verifies *k* drafts in one step: row *i* of a sequence
# samples the token after its *i*-th draft, and the engine keeps the drafts up to the first row
# whose token differs. So row *i* must be masked by the grammar after the committed tokens and
# drafts 1 to *i*: `Grammars.mask_drafts` fills row 0 as `mask` would, then lets the matcher take
# the drafts one at a time (`try_consume_tokens`), filling the row after each, and at the end gives
# them all back (`rollback`), as the scheduler rolls the block table back. The matcher never keeps a
# draft: after the step it reads the tokens the engine kept, at its next mask, like any other token.
# A draft the grammar refuses needs no row after it masked: its own row is masked, so it samples some
# other token, and the engine stops accepting there; rows after it may hold anything. The same holds
# after an end-of-sequence draft, which ends the sequence if kept (and which `try_consume_tokens`
# does not take: it is checked first). Each row samples what a decode step at that index would
# sample, seed included (chapter 25), and a decode step would sample it under the same mask, so
# greedy and seeded outputs are those without speculation, token for token: the cell below checks
# it.
#
# A refused draft, and every draft after it, is a verify row spent on nothing. `cut_drafts` spares
# them: before the scheduler reserves the drafts' slots, it asks each matcher how many of its
# sequence's drafts the grammar takes (`validate_tokens`, which checks them without moving the
# matcher) and cuts the rest. On the tiny model, whose prompts are no JSON, prompt lookup proposes
# almost nothing a grammar takes, and most drafts go before they cost a row; a sequence left with none
# decodes plainly. (llguidance can also fill all of a sequence's draft rows in one call, in parallel
# across sequences: `fill_next_token_bitmask_par_with_draft_tokens`. One loop per sequence is
# clearer here and has not been measured against it.)
#
# **Tensor parallelism**: the sampler runs on rank 0, which rebuilds the step's sequences from
# their slim copies in each call (chapter 17), so a matcher kept beside a sequence object would go
# with it after one step. Rank 0 therefore keeps the object of each constrained sequence from call
# to call and brings it up to date from each slim state (`RankWorker._sequences`, below); its
# matcher lives as long as the object, which goes when the driver says the sequence finished (the
# `gone` ids of chapter 17's sampling params). A slim copy carries only the tokens whose KV is not
# cached yet: during decode, the last one, which is the one token its matcher has not read; after
# a preemption, every token not in the prefix cache, of which the matcher skips those it has read.
# (A verify step would need more, the drafts it kept, but speculation does not run under tensor
# parallelism.)
#
# **Compiling** a schema takes about a millisecond here and is bounded by llguidance's limits, so it
# runs on the caller's thread when the `StructuredOutputsParams` is made, and against the tokenizer
# when the first sequence needs it. The server (chapter 29b) compiles off its event loop.

# %% [markdown] tags=["zh"]
# ## 掩码遇上引擎的其余部分
#
# **异步调度**（第 18 章）在第 *n* 步的 token 回到主机之前，就把第 *n* + 1 步排进队列。第 *n* + 1 步的掩码需要第 *n* 个
# token：匹配器得先读入它。第 *n* + 1 步的前向计算并不需要掩码，只有它的采样器需要，所以 vLLM（自它的第 26866 号拉取
# 请求起）不等待就启动前向计算，在 GPU 运行前向的同时在 CPU 上构建位掩码，之后再用它采样。上面的 `launch` 就是这个
# 顺序。它先重放第 *n* + 1 步的模型图；然后 `Grammars.fill` 等待第 *n* 步的 token（收取第 *n* 步时本来就要等这一下），
# 让匹配器读入它们，并在 GPU 运行前向计算的同时，填好锁页主机缓冲区里这一步的各行。一次拷贝在它自己的一条流上，与前向
# 计算并行地把这些行送到设备上；带掩码的采样图只等这一次拷贝。两份主机缓冲区轮流用，主机从不写一份拷贝可能还在排队的
# 缓冲区。（下文测得：等待之后的 eager LM head、解开位掩码和 eager 采样器吃掉了三分之一的速度，所以放进捕获的那一步。
# 第 29c 章让采样等得更晚。）
#
# **投机解码**（第 25 章）在一步里验证 *k* 个草稿：序列的第 *i* 行采样它第 *i* 个草稿之后的 token，引擎保留草稿，直到
# 第一个 token 不一致的行为止。所以第 *i* 行必须用读过已确定的 token 和草稿 1 到 *i* 之后的语法来盖：
# `Grammars.mask_drafts` 像 `mask` 那样填好第 0 行，然后让匹配器逐个读入草稿（`try_consume_tokens`），每读一个就填
# 它后面的那一行，最后把它们全部退回去（`rollback`），就像调度器回滚块表那样。匹配器从不保留草稿：这一步之后，它在下一次
# 掩码时读入引擎保留的 token，和读入其他 token 一样。语法拒绝的草稿，它之后的行不必加掩码：它自己那一行加了掩码，采样
# 出的是别的 token，引擎就在那里停止接受；它之后的行里是什么都行。end-of-sequence 草稿之后也一样，它一旦被保留，序列
# 就结束了（`try_consume_tokens` 不接受它：要先检查）。每一行采样的，正是在那个下标上的 decode 步会采样的 token，种子
# 也一样（第 25 章），而 decode 步也会在同样的掩码下采样它，所以贪心和带种子的输出与不做投机时逐 token 相同：下面的
# 单元格检查了这一点。
#
# 被拒绝的草稿，以及它之后的每个草稿，都是白白花掉的验证行。`cut_drafts` 省下它们：在调度器为草稿预留槽位之前，它问
# 每个匹配器语法接受它的序列的多少个草稿（`validate_tokens`，检查时不移动匹配器），把其余的截掉。在小模型上，提示词
# 不是 JSON，提示词查找提出的草稿几乎没有语法接受的，大部分草稿还没花掉一行就被截掉了；一个草稿都不剩的序列就做普通的
# decode。（llguidance 也能用一次调用填好一个序列所有草稿的行，并在各序列之间并行：
# `fill_next_token_bitmask_par_with_draft_tokens`。这里每个序列一个循环更清楚，还没有和它比较过速度。）
#
# **张量并行**：采样器在 rank 0 上运行，而 rank 0 在每次调用中从精简的拷贝重建这一步的序列（第 17 章），所以放在序列
# 对象旁边的匹配器，一步之后就会随对象一起消失。因此 rank 0 在多次调用之间保留每个受约束序列的对象，并用每一步的精简
# 状态更新它（下面的 `RankWorker._sequences`）；它的匹配器和这个对象活得一样久，驱动进程说这个序列结束时（第 17 章
# 采样参数里的 `gone` id），对象就被丢掉。精简的拷贝只带着 KV 还没缓存的 token：decode 时只有最后一个，正好是匹配器
# 还没读过的那一个；抢占之后，是不在前缀缓存里的所有 token，匹配器跳过其中已经读过的。（验证步还需要更多，即它保留
# 下来的草稿，但投机解码不在张量并行下运行。）
#
# **编译**一个 schema 在这里大约一毫秒，并受 llguidance 的限额约束，所以它在调用者的线程上运行：创建
# `StructuredOutputsParams` 时编译成语法，第一个序列需要它时再针对分词器编译。服务器（第 29b 章）在事件循环之外编译。

# %%
lookup = [[10, 20, 30, 10, 20, 30], [7, 7, 7, 7], [3, 4, 3, 4]]
lookup_params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=constraints["json."]),
                 SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraints["regex"]),
                 SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, structured_outputs=constraints["json."])]
verified = {"drafts": 0, "kept": 0}


def count_verified(event: str, data: dict) -> None:
    """Count the drafts that verify steps checked and kept (the scheduler's "verified" event)."""
    # zh: 统计验证步检查过的和保留下的草稿数（调度器的 "verified" 事件）。
    if event == "verified":
        verified["drafts"] += sum(data["drafted"])
        verified["kept"] += sum(data["kept"])


without = llm.generate(lookup, lookup_params, use_tqdm=False)
with LLM(str(tiny), device="cpu", speculative_method="ngram", num_speculative_tokens=4) as speculating:
    speculating.set_observer(count_verified)
    with_drafts = speculating.generate(lookup, lookup_params, use_tqdm=False)
    cut = speculating.model_runner.grammars.refused_drafts
print(say("prompt lookup proposed {proposed} drafts: the grammars refused {cut} (cut before verification), "
          "{verified} were verified, {kept} kept", proposed=cut + verified["drafts"], cut=cut,
          verified=verified["drafts"], kept=verified["kept"]))
print(say("the same outputs with and without speculation (greedy, and seeded with n = 2): {same}",
          same=with_drafts == without))
assert with_drafts == without and cut > 0 and verified["kept"] > 0
assert accepted(constraints["json."], with_drafts[0]["token_ids"])


# %% [markdown] tags=["en"]
# Under tensor parallelism, rank 0's `_sequences` (chapter 17) is written again (16 lines): it also
# keeps each constrained sequence's object, so that the matcher that `Grammars` keeps beside it
# survives the step. `tests/beyond/test_29_structured_output.py` checks that two ranks write the
# outputs of one, greedy and seeded, forks and preemption included.

# %% [markdown] tags=["zh"]
# 在张量并行下，rank 0 的 `_sequences`（第 17 章）重写了一遍（16 行）：它还保留每个受约束序列的对象，让 `Grammars`
# 放在它旁边的匹配器活过这一步。`tests/beyond/test_29_structured_output.py` 检查了两个 rank 写出的输出与一个 rank 的
# 相同，贪心的和带种子的都是，分叉和抢占也包括在内。

# %% rank 0 keeps constrained sequences
#| export engine.tp_runtime
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_runtime import RankWorker, step_sequences
from nanovllm.sampling_params import SamplingParams


@add_to_init(RankWorker)
def _init_kept_sequences(self) -> None:
    # en: Rank 0: each running constrained sequence, the same object from call to call (its matcher goes with it).
    # zh: rank 0：每个正在运行的受约束序列，各次调用之间是同一个对象（它的匹配器跟着它）。
    self.kept: dict[int, Sequence] = {}


@add_to_class(RankWorker)
def _sequences(
    self, states: list[tuple], params: tuple[dict[int, SamplingParams], list[int]] | None
) -> list[Sequence]:
    """The step's sequences, rebuilt from their slim states; on rank 0 with their sampling params, and each
    constrained one as the object kept from earlier calls, brought up to date, so that its grammar's matcher
    (`Grammars.matchers`, keyed weakly by the sequence) follows it until it finishes."""
    # zh: 这一步的序列，由它们的精简状态重建；在 rank 0 上还带着它们的采样参数，每个受约束的序列则是之前的调用里保留下来
    # zh: 的那个对象，已更新到最新，这样它的语法的匹配器（`Grammars.matchers`，以序列为弱引用键）一直跟着它，直到结束。
    seqs = step_sequences(states)
    if params is not None:
        new, gone = params
        self.params.update(new)
        for seq_id in gone:
            self.params.pop(seq_id, None)
            self.kept.pop(seq_id, None)
        for i, state in enumerate(states):
            sampling_params = self.params[seqs[i].seq_id]
            if sampling_params.structured_outputs is not None:
                seqs[i] = self.kept.setdefault(seqs[i].seq_id, seqs[i])
                seqs[i].__setstate__(state)
                # en: A slim copy has no drafts: speculation does not run under tensor parallelism.
                # zh: 精简的拷贝没有草稿：投机解码不在张量并行下运行。
                seqs[i].num_draft_tokens = 0
            seqs[i].sampling_params = sampling_params
    return seqs


# %% [markdown] tags=["en"]
# ## Check it
#
# A constrained request changes nothing for the others in its batch: the tiny model's greedy
# outputs for three plain prompts are the same alone and beside a constrained request (the
# constrained step samples eagerly, and the mask touches only its own row).

# %% [markdown] tags=["zh"]
# ## 验证
#
# 受约束的请求不会改变同一批里的其他请求：小模型对三个普通提示词的贪心输出，单独运行和与一个受约束的请求同批运行时
# 完全相同（受约束的一步以 eager 方式采样，掩码只碰它自己那一行）。

# %%
plain = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
alone = [output["token_ids"] for output in llm.generate(plain, greedy, use_tqdm=False)]
mixed = llm.generate([*plain, prompt], [greedy] * 3 + [SamplingParams(temperature=0, max_tokens=12,
                                                                      structured_outputs=constraints["json."])],
                     use_tqdm=False)
same = [output["token_ids"] for output in mixed[:3]] == alone
print(say("unconstrained greedy outputs unchanged beside a constrained request: {same}", same=same))
assert same and accepted(constraints["json."], mixed[3]["token_ids"])

# %% [markdown] tags=["en"]
# Preemption keeps the matchers: six constrained requests in a pool of ten blocks of four tokens
# preempt one another many times, and write exactly what they write in a pool that holds them all.

# %% [markdown] tags=["zh"]
# 抢占保留匹配器：六个受约束的请求挤在十个四 token 的块组成的池里，互相抢占了许多次，写出的内容和在一个装得下它们全部
# 的池里完全一样。

# %%
six = [[5 + i, 20, 30, 40] for i in range(6)]
shaped_params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraints["json."])
roomy = llm.generate(six, shaped_params, use_tqdm=False)
cramped = LLM(str(tiny), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_model_len=64)
preemptions: list = []
cramped.set_observer(lambda event, data: preemptions.extend(data["preempted"]) if event == "schedule" else None)
squeezed = cramped.generate(six, shaped_params, use_tqdm=False)
same = [o["token_ids"] for o in squeezed] == [o["token_ids"] for o in roomy]
print(say("a pool of {blocks} blocks: {preempted} preemptions, the same {count} outputs: {same}", blocks=10,
          preempted=len(preemptions), count=len(six), same=same))
assert preemptions and same and all(accepted(constraints["json."], o["token_ids"]) for o in squeezed)
cramped.exit()

# %% [markdown] tags=["en"]
# ## What it costs
#
# A constrained step does three things a free one does not: each matcher reads the tokens its
# sequence gained, writes its bitmask on the host (llguidance walks its grammar over the
# vocabulary's token tree), and the bitmask is copied to the device and applied to the logits.
# Under asynchronous scheduling the masks also wait for the step in flight: a mask needs the token
# that step is still computing. `python -m nanovllm.bench --structured` measures the
# sum: the same prompts in one engine, with and without a JSON schema, the runs taking turns, at
# the batches asked for (`--batches 1 16 256` on a GPU). The schema asks for a roster of at
# least 64 people, more tokens than any run writes, so a constrained request never ends early and
# both runs of a batch compute the same tokens; the free run ignores the end-of-sequence token
# for the same reason. It also prints the time the engine spent in `Grammars.fill` per step.
#
# On this CPU the forward pass of even the tiny model dwarfs the masks; the figures that matter
# (a goal of at most 10 % slower at batch 1 and 5 % at 256 sequences) come from a GPU, where a
# step of Qwen3-0.6B takes about a millisecond.

# %% [markdown] tags=["zh"]
# ## 它的代价
#
# 受约束的一步比自由的一步多做三件事：每个匹配器读入它的序列新得到的 token，在主机上写出它的位掩码（llguidance 沿着
# 词表的 token 树走一遍它的语法），位掩码被拷到设备上、盖到 logits 上。在异步调度下，掩码还要等正在执行的那一步：
# 掩码需要那一步还在算的 token。`python -m nanovllm.bench --structured` 测的是这些的总和：
# 同一个引擎里的同一批提示词，带和不带一个 JSON schema，两种运行轮流进行，批大小按要求给出（GPU 上是
# `--batches 1 16 256`）。schema 要的是一份至少 64 个人的名单，比任何一次运行写出的 token 都多，所以受约束的请求
# 不会提前结束，同一批的两种运行算出同样多的 token；出于同样的原因，自由运行忽略序列结束 token。它还打印引擎每一步花在
# `Grammars.fill` 里的时间。
#
# 在这台 CPU 上，哪怕是小模型的前向计算也远远盖过掩码；真正要看的数字（目标：批大小 1 时最多慢 10%，256 个序列时
# 最多慢 5%）来自 GPU，那里 Qwen3-0.6B 的一步大约一毫秒。

# %% bench structured flag
#| export bench.engine
from nanovllm.bench.engine import OTHER_BENCHMARKS

OTHER_BENCHMARKS["--structured"] = "nanovllm.bench.structured"

# %% bench structured
#| export bench.structured
"""``python -m nanovllm.bench --structured``: the same requests with and without a JSON schema, in one engine."""
# zh: ``python -m nanovllm.bench --structured``：同一个引擎里的同一批请求，带和不带 JSON schema。

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanovllm.bench.engine import watch_calls
from nanovllm.bench.models import qwen3_06b_random
from nanovllm.bench.report import report_header, write_report
from nanovllm.bench.speculative import timed_run
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

# en: A roster of at least 64 people: more tokens than a run asks for, so that a constrained request never ends before
# en: max_tokens and both runs of a batch compute the same number of tokens.
# zh: 一份至少 64 个人的名单：比一次运行要的 token 多，所以受约束的请求不会在 max_tokens 之前结束，同一批的两种运行
# zh: 算出同样多的 token。
ROSTER_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 64,
    "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"enum": ["Lagos", "Lima", "Osaka", "Oslo", "Paris"]}},
    },
}  # fmt: skip
RUNS = ("free", "constrained")


def roster_prompts(count: int) -> list[str]:
    """``count`` different prompts that ask for a roster as JSON."""
    # zh: ``count`` 个不同的提示词，都要一份 JSON 格式的名单。
    return [f"List the members of club {i} as a JSON array: each one's name, age and city." for i in range(count)]


def timed_generate(llm: Any, prompts: list[str], params: SamplingParams,
                   watched: tuple[str, ...] = ("fill",)) -> dict[str, Any]:
    """One timed `generate`: its tokens a second, the steps that computed tokens, and the seconds spent in the
    ``watched`` methods of the runner's grammars (`Grammars.fill`: the host's mask work, and any wait there for the
    step in flight; a watched call inside another counted once)."""
    # zh: 一次计时的 `generate`：每秒 token 数、算出了 token 的步数，以及花在执行器的 grammars 的 ``watched`` 这些方法里
    # zh: 的秒数（`Grammars.fill`：主机做掩码的工作，以及在那里等正在执行的那一步的时间；被观察的调用里面的被观察调用
    # zh: 只算一次）。
    spans: list[tuple[float, float]] = []
    with contextlib.ExitStack() as stack:
        for method in watched:
            stack.enter_context(watch_calls(llm.model_runner.grammars, method, lambda seconds, _: spans.append(
                ((end := time.perf_counter()) - seconds, end))))
        run = timed_run(llm, prompts, [params] * len(prompts))
    return run | {"tokens": sum(map(len, run["outputs"])), "mask_seconds": covered_seconds(spans)}


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """The seconds that the union of the (start, end) ``spans`` covers."""
    # zh: (开始, 结束) 这些 ``spans`` 的并集覆盖的秒数。
    total, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        total, reached = total + max(0.0, end - max(start, reached)), max(reached, end)
    return total


def compare(model: str, batches: list[int], max_tokens: int, repeats: int = 3, watched: tuple[str, ...] = ("fill",),
            **settings: Any) -> list[dict[str, Any]]:
    """A row per batch size, from one engine built with ``settings``: ``repeats`` rounds in which a free run and a
    constrained run of the same greedy requests take turns (so that the order of the runs cannot make a ratio); the
    medians (tokens a second, ms a step), and the constrained runs' mask time a step (``watched``: `timed_generate`)."""
    # zh: 每个批大小一行，来自按 ``settings`` 建的同一个引擎：``repeats`` 轮，每轮同样的贪心请求先自由运行、再受约束
    # zh: 运行，轮流进行（运行的先后就造不出一个比值）；给出中位数（每秒 token 数、每步毫秒数），以及受约束运行每步的
    # zh: 掩码时间（花在 ``watched`` 这些方法里，见 `timed_generate`）。
    from nanovllm.llm import LLM

    llm = LLM(model, **settings)
    roster = StructuredOutputsParams(json=ROSTER_SCHEMA)
    params = {"free": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              "constrained": SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=roster)}
    rows = []
    try:
        # en: A warm-up, untimed: it compiles the schema (the engine keeps it) and warms both paths.
        # zh: 预热，不计时：它编译 schema（引擎会留着它），并让两条路径都热起来。
        for warm_up in params.values():
            llm.generate(roster_prompts(1), dataclasses.replace(warm_up, max_tokens=8), use_tqdm=False)
        for batch in batches:
            prompts = roster_prompts(batch)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
            for _ in range(repeats):
                for name in RUNS:
                    runs[name].append(timed_generate(llm, prompts, params[name], watched))
            free, constrained = (statistics.median(run["tok_s"] for run in runs[name]) for name in RUNS)
            step_ms = {name: statistics.median(1e3 * run["seconds"] / max(1, run["steps"]) for run in runs[name])
                       for name in RUNS}
            mask_ms = statistics.median(1e3 * run["mask_seconds"] / max(1, run["steps"]) for run in runs["constrained"])
            rows.append({
                "batch": batch, "free_tok_s": free, "constrained_tok_s": constrained, "ratio": constrained / free,
                "step_ms": step_ms, "mask_ms_per_step": mask_ms, "steps": runs["constrained"][0]["steps"],
                "tokens": {name: runs[name][0]["tokens"] for name in RUNS}, "repeats": repeats,
            })  # fmt: skip
    finally:
        llm.exit()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def print_row(row: dict[str, Any]) -> None:
    print(f"batch {row['batch']:4d}: {row['free_tok_s']:9.1f} tok/s free, {row['constrained_tok_s']:9.1f} with the "
          f"schema ({row['ratio']:.3f}x); a step {row['step_ms']['free']:.3f} / {row['step_ms']['constrained']:.3f} "
          f"ms, Grammars.fill {row['mask_ms_per_step']:.3f} ms of it; tokens {row['tokens']['free']} / "
          f"{row['tokens']['constrained']}")


def add_options(parser: argparse.ArgumentParser, cpu_model: str) -> None:
    """The benchmark's options: --model (``cpu_model`` names its default on a CPU), --batches, --max-tokens, --repeats,
    --device and --out."""
    # zh: 基准测试的选项：--model（``cpu_model`` 说明它在 CPU 上的默认值）、--batches、--max-tokens、--repeats、--device
    # zh: 和 --out。
    parser.add_argument("--model", help="default: Qwen3-0.6B's shapes with random weights on CUDA (the tiny model's "
                        f"byte-level tokenizer, which can spell JSON), {cpu_model} on a CPU")
    parser.add_argument("--batches", type=int, nargs="+", help="default: 1 16 256 on CUDA, 1 4 on a CPU")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of runs taking turns; medians are reported")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", help="also write the figures to this JSON file")


def complete_options(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     cpu_model: Callable[[], Path | str]) -> dict[str, Any]:
    """Check the counts of ``args`` (`add_options`), then fill in, by device, ``args.cuda``, the batches and the model
    (``cpu_model`` gives a CPU's); returns the settings of each engine that `compare` builds."""
    # zh: 检查 ``args``（`add_options`）里的各个数，再按设备补上 ``args.cuda``、批大小和模型（CPU 上的模型由
    # zh: ``cpu_model`` 给出）；返回 `compare` 构建的每个引擎的设置。
    args.cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.batches = args.batches or ([1, 16, 256] if args.cuda else [1, 4])
    if min(args.batches) < 1 or args.max_tokens < 1 or args.repeats < 1:
        parser.error("--batches, --max-tokens and --repeats must be at least 1")
    if args.model is None:
        args.model = str(qwen3_06b_random() if args.cuda else cpu_model())
    return {"device": args.device, "max_num_seqs": max(256, max(args.batches)), "max_model_len": args.max_tokens + 256}


def main(argv: list[str] | None = None) -> int:
    from nanovllm.book.smollm2 import smollm2_dir

    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench --structured",
                                     description="The same greedy requests with and without a JSON schema, in one "
                                     "engine, the runs taking turns.")
    add_options(parser, cpu_model="SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    settings = complete_options(parser, args, smollm2_dir)
    print(f"model: {args.model}; {args.max_tokens} tokens a request, {args.repeats} rounds")
    rows = compare(args.model, args.batches, args.max_tokens, args.repeats, **settings)
    for row in rows:
        print_row(row)
    report = report_header("python -m nanovllm.bench --structured", argv, "cuda" if args.cuda else "cpu")
    write_report(report | {"model": args.model, "rows": rows}, args.out)
    return 0

# %% [markdown] tags=["en"]
# The tiny model on this CPU, at one and four sequences, 32 tokens each, the medians of three
# rounds: a step's time with and without the schema, and how much of it the masks took. Both runs
# of a batch compute the same tokens. (Times on a shared CPU say little; the GPU's figures are the
# ones that decide.)

# %% [markdown] tags=["zh"]
# 这台 CPU 上的小模型，1 个和 4 个序列，每个 32 个 token，取三轮的中位数：带和不带 schema 时一步的时间，以及其中
# 掩码占了多少。同一批的两种运行算出同样多的 token。（在共用的 CPU 上，时间说明不了多少；起决定作用的是 GPU 上的
# 数字。）

# %%
from nanovllm.bench.structured import compare as compare_structured

for row in compare_structured(str(tiny), [1, 4], max_tokens=32, repeats=3, device="cpu", max_model_len=256):
    print(say("batch {batch}: a step {free:.1f} ms free, {constrained:.1f} ms with the schema, Grammars.fill "
              "{mask:.2f} ms of it", batch=row["batch"], free=row["step_ms"]["free"],
              constrained=row["step_ms"]["constrained"], mask=row["mask_ms_per_step"]))
    assert row["tokens"] == {"free": 32 * row["batch"], "constrained": 32 * row["batch"]}
    assert 0 < row["mask_ms_per_step"] < row["step_ms"]["constrained"]

# %% [markdown] tags=["en"]
# On an H100 the chapter's first version, which sampled every constrained step eagerly after
# `Grammars.mask`, cost about a third of the speed: 0.60× the free run at one sequence, 0.67× at
# 16 and 0.66× at 256 (Qwen3-0.6B's shapes, 256 tokens a request; the first recorded run below).
# Its time in `Grammars.mask` was about one free step at every batch, mostly the wait for the step
# in flight, whose token the masks need. The forward pass had been queued before that wait, so it
# overlapped; what came after did not: each matcher read its token and filled its row, the bitmask
# was copied and unpacked, and the masked logits went through the eager sampler instead of the
# captured one. That was an extra 0.56 ms a step at one sequence and 2.0 ms at 256.
#
# The captured path built above moves all of that beside the forward pass: the rows are filled
# while it runs, copied on a stream of their own, and applied inside the captured sampler. Run in
# the same call on the same machine (the second recorded run), it gives 0.98× the free run at one
# sequence and at 16, and 0.85× at 256: the goal at one sequence (0.90×) is met, the one at 256
# (0.95×) is not. At 256 the fill itself is the wall: 2.6 ms of host time a step, one row after
# another, which with the rest of the host's work outlasts the GPU's 3.8 ms step, so a constrained
# step takes 4.5 ms. Filling on every core does not help: llguidance's parallel fill took 1.65×
# the serial time for 256 rows on that machine's 16 cores (`scripts/probes/fill_bitmask_par.py`).
# A repeat on main once the captured path had landed, on another H100 machine that day (the third
# recorded run), gave 0.99×, 0.98× and 0.86×. What could help at 256: fewer masks to fill, by
# writing the tokens a grammar forces (a key, its quotes, its colon) without sampling them, as
# jump-forward decoding does; or less of the host's other work a step. Chapter 29c tries a third
# way: the rows filled side by side, by worker processes that hold the matchers.

# %% [markdown] tags=["zh"]
# 在 H100 上，本章的第一个版本（每个受约束的步都在 `Grammars.mask` 之后以 eager 方式采样）要吃掉大约三分之一的速度：
# 1 个序列时是自由运行的 0.60 倍，16 个时 0.67 倍，256 个时 0.66 倍（Qwen3-0.6B 的形状，每个请求 256 个 token；
# 下面记录的第一次运行）。在每个批大小下，它花在 `Grammars.mask` 里的时间都约等于自由运行的一步，其中大部分是在等
# 正在执行的那一步，掩码需要它算出的 token。前向计算在这次等待之前就已排进队列，所以是重叠的；等待之后的事却不重叠：
# 每个匹配器读入自己的 token 并填好自己那一行，位掩码被复制、解开，加了掩码的 logits 走的是 eager 采样器，而不是
# 捕获好的那个。这就是 1 个序列时每步多出的 0.56 毫秒、256 个时多出的 2.0 毫秒。
#
# 上面构建的捕获路径把这些都挪到前向计算旁边：各行在前向计算运行时填好，在自己的一条流上拷贝过去，在捕获好的采样器
# 里生效。在同一次调用里、同一台机器上运行（下面记录的第二次运行），1 个序列和 16 个序列时都是自由运行的 0.98 倍，
# 256 个时 0.85 倍：1 个序列的目标（0.90 倍）达到了，256 个的目标（0.95 倍）没有。256 个序列时，填写本身就是那堵墙：
# 每步 2.6 毫秒的主机时间，一行接一行，加上主机其余的工作，比 GPU 的 3.8 毫秒一步还长，所以受约束的一步要 4.5 毫秒。
# 用上所有的核也没有用：在那台机器的 16 个核上，llguidance 的并行填充填 256 行要花串行时间的 1.65 倍
# （`scripts/probes/fill_bitmask_par.py`）。捕获路径合入 main 之后，当天在另一台 H100 机器上重跑了一次（下面记录的
# 第三次运行），得到 0.99、0.98 和 0.86 倍。256 个序列时可能有用的是：要填的掩码更少，即像 jump-forward 解码那样，
# 把语法强制的 token（一个键、它的引号、它的冒号）直接写出而不采样；或者减少主机每步其余的工作。第 29c 章试了第三条路：
# 由持有匹配器的工作进程并排填写各行。

# %%
from nanovllm.book.recorded import recorded

# en: What this chapter's GPU runs printed (notebooks/data/recorded/29_structured_output.json), each with its card, date
# en: and command; each row: batch, tok/s free and constrained, ms a step free and constrained, ms a step in the masks
# en: (Grammars.mask, eager; Grammars.fill, captured).
# zh: 本章 GPU 运行打印出的数字（notebooks/data/recorded/29_structured_output.json），各自带着卡、日期和命令；每一行：
# zh: 批大小、自由与受约束的 tok/s、自由与受约束时每步的毫秒数、每步花在掩码上的毫秒数（eager 时是 Grammars.mask，
# zh: 捕获时是 Grammars.fill）。
runs = recorded("29_structured_output")
ratios = {}
for name in ("eager mask, H100", "masked sampling graphs, H100", "masked sampling graphs again, H100"):
    gpu_run = runs[name]
    print(say("{name}: {card}, {date}: {command}", name=name, card=gpu_run.card, date=gpu_run.date,
              command=gpu_run.command))
    for batch, free, constrained, free_ms, constrained_ms, mask_ms in gpu_run.figures["rows"]:
        print(say("batch {batch:3d}: {ratio:.2f}x the free run; a step {free_ms:.2f} -> {constrained_ms:.2f} ms, "
                  "{mask_ms:.2f} ms of it in the masks", batch=batch, ratio=constrained / free, free_ms=free_ms,
                  constrained_ms=constrained_ms, mask_ms=mask_ms))
    ratios[name] = {row[0]: round(row[2] / row[1], 2) for row in gpu_run.figures["rows"]}
eager = {row[0]: row for row in runs["eager mask, H100"].figures["rows"]}
captured = {row[0]: row for row in runs["masked sampling graphs, H100"].figures["rows"]}
# en: The prose's figures: eager 0.60x, 0.67x, 0.66x, its mask within 10 % of a free step, 0.56 and 2.0 ms more a step;
# en: captured 0.98x, 0.98x, 0.85x (the goal met at one sequence, missed at 256), at 256 a fill of 2.6 ms a step, a
# en: free step of 3.8 ms and a constrained one of 4.5 ms; the repeat 0.99x, 0.98x, 0.86x.
# zh: 正文里的数字：eager 是 0.60、0.67、0.66 倍，掩码的时间与自由运行的一步相差不到 10%，每步多出 0.56 和 2.0 毫秒；
# zh: 捕获后是 0.98、0.98、0.85 倍（1 个序列时达到目标，256 个时没有），256 个序列时每步填写 2.6 毫秒，自由的一步
# zh: 3.8 毫秒，受约束的一步 4.5 毫秒；重跑的那次是 0.99、0.98、0.86 倍。
assert ratios["eager mask, H100"] == {1: 0.60, 16: 0.67, 256: 0.66}
assert all(abs(mask_ms / free_ms - 1) < 0.1 for _, _, _, free_ms, _, mask_ms in eager.values())
assert (round(eager[1][4] - eager[1][3], 2), round(eager[256][4] - eager[256][3], 1)) == (0.56, 2.0)
assert ratios["masked sampling graphs, H100"] == {1: 0.98, 16: 0.98, 256: 0.85}
assert captured[1][2] / captured[1][1] >= 0.90 and captured[256][2] / captured[256][1] < 0.95
assert [round(captured[256][i], 1) for i in (5, 3, 4)] == [2.6, 3.8, 4.5]
assert ratios["masked sampling graphs again, H100"] == {1: 0.99, 16: 0.98, 256: 0.86}
# en: The parallel fill against the serial one at 256 rows: 1.65x its time.
# zh: 256 行时，并行填充与串行填充相比：时间是后者的 1.65 倍。
fill_rows = {rows: (serial, parallel) for rows, serial, parallel in runs["parallel fill, H100 machine"].figures["rows"]}
assert round(fill_rows[256][1] / fill_rows[256][0], 2) == 1.65

# %% [markdown] tags=["en"]
# ## What we built
#
# - `StructuredOutputsParams` (`nanovllm.sampling_params`), vLLM's names: exactly one of `json`,
#   `regex`, `choice`, `grammar`, `json_object`, and `disable_any_whitespace`; compiled to
#   llguidance's grammar and checked when it is made, within `grammar_limits()`: a bad or hostile
#   constraint is refused with the reason, in milliseconds. `SamplingParams.structured_outputs`
#   (chapter 01, through `add_fields`), which refuses `ignore_eos=True`.
# - `nanovllm.engine.grammars`: bitmasks (`pack_tokens`, `allowed_tokens`, `apply_bitmask` in plain
#   torch on the logits' device, `fill_bitmask` for llguidance), and `Grammars`, one object beside
#   the sampler: llguidance's tokenizer (`llguidance_tokenizer`, which keeps a byte-level
#   vocabulary byte-level whatever decoder a conversion gave it), the compiled grammars by kind and
#   exact text, and a matcher per sequence that reads its new tokens lazily, before each mask.
#   Forks, preemption and asynchronous steps need nothing more; a failed grammar ends its request
#   with the reason in the log.
# - Chapter 18's `ModelRunner.launch`: a constrained decode step whose rows sample plainly samples
#   inside the captured step, from `MaskedSamplingGraphs` (captured at the first constrained step,
#   a bitmask of fixed address unpacked by `forbid`, its rows filled by `Grammars.fill` while the
#   forward runs and sent in one copy beside it); any other constrained step samples
#   eagerly, after `Grammars.mask`.
# - Checked: masks by hand equal llguidance's (and where they differ, llguidance keeps the canonical
#   tokenization); SmolLM2 writes JSON that validates, which it does not unconstrained; n = 3 samples
#   each valid; preemption changes no output; unconstrained requests are untouched.
# - Chapter 25's `ModelRunner.verify` and `LLMEngine._reserve_drafts`, written again: a verify
#   step's rows are masked draft by draft (`Grammars.mask_drafts`), and drafts the grammar refuses
#   are cut before they are verified (`Grammars.cut_drafts`); with prompt lookup, greedy and seeded
#   constrained outputs are those without speculation.
#
# Measured on an H100: the captured constrained step at 0.98× the free run at one sequence, 0.85×
# at 256. Under tensor parallelism, rank 0 keeps each constrained sequence's object from step to step
# (`RankWorker._sequences`, written again). Chapter 29b adds the server's side, 29c a faster fill at
# 256 sequences; constrained speculation is not yet measured on a GPU.
#
# ## Exercises
#
# 1. SmolLM2's vocabulary has 49,152 tokens. How many int32 words does one bitmask row hold, and
#    how many bytes does a step of 64 constrained sequences copy to the GPU?
# 2. A request with `choice=["yes", "no"]` runs on the tiny model. How many tokens does its
#    completion hold, and what is the last one?
# 3. After `L` in `London`, llguidance allows `on` but not `o`. What would change if a model wrote
#    `L`, `o`, `n`, `d`, `o`, `n` and a program decoded the text and encoded it again?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `StructuredOutputsParams`（`nanovllm.sampling_params`），用 vLLM 的名字：`json`、`regex`、`choice`、`grammar`、
#   `json_object` 恰好设一个，外加 `disable_any_whitespace`；创建时编译成 llguidance 的语法并在 `grammar_limits()` 之内
#   检查：错误的或恶意的约束在几毫秒内连同原因一起被拒绝。`SamplingParams.structured_outputs`（第 01 章，经由
#   `add_fields`），它拒绝 `ignore_eos=True`。
# - `nanovllm.engine.grammars`：位掩码（`pack_tokens`、`allowed_tokens`、在 logits 所在设备上用朴素 torch 实现的
#   `apply_bitmask`、给 llguidance 用的 `fill_bitmask`），以及 `Grammars`，和采样器放在一起的一个对象：llguidance 的
#   分词器（`llguidance_tokenizer`：不管转换给了什么解码器，字节级的词表都保持字节级）、按种类和原文存放的已编译
#   语法，以及每个序列一个匹配器，它在每次掩码之前惰性地读入新 token。分叉、抢占和异步的步都不需要别的东西；失败的
#   语法让它的请求结束，原因写在日志里。
# - 第 18 章的 `ModelRunner.launch`：各行都只做普通采样的受约束 decode 步，在捕获的那一步里由 `MaskedSamplingGraphs`
#   采样（在第一个受约束的步才捕获；地址固定的位掩码由 `forbid` 解开，各行由 `Grammars.fill` 在前向计算运行时填好，
#   与前向计算并行地一次拷贝送出）；其他受约束的步在 `Grammars.mask` 之后以 eager 方式采样。
# - 验证过的：手算的掩码等于 llguidance 的（两者不同的地方，llguidance 保留规范分词）；SmolLM2 写出能通过校验的 JSON，
#   不加约束时则不能；n = 3 的每个样本都有效；抢占不改变任何输出；不受约束的请求不受影响。
# - 重写的第 25 章 `ModelRunner.verify` 和 `LLMEngine._reserve_drafts`：验证步的各行逐个草稿地加掩码
#   （`Grammars.mask_drafts`），语法拒绝的草稿在验证之前就被截掉（`Grammars.cut_drafts`）；用提示词查找时，贪心和带
#   种子的受约束输出与不做投机时相同。
#
# 在 H100 上测过的：捕获的受约束步，1 个序列时是自由运行的 0.98 倍，256 个时 0.85 倍。张量并行下，rank 0 在各步之间
# 保留每个受约束序列的对象（重写的 `RankWorker._sequences`）。服务器那一侧见第 29b 章，
# 256 个序列时更快的填写见第 29c 章；受约束的投机解码还没有在 GPU 上测过。
#
# ## 练习
#
# 1. SmolLM2 的词表有 49,152 个 token。位掩码的一行有多少个 int32 字？一步有 64 个受约束的序列时，要往 GPU 拷贝多少
#    字节？
# 2. 一个 `choice=["yes", "no"]` 的请求在小模型上运行。它的生成内容有几个 token，最后一个是什么？
# 3. 在 `London` 的 `L` 之后，llguidance 允许 `on` 而不允许 `o`。如果一个模型写出 `L`、`o`、`n`、`d`、`o`、`n`，而
#    一个程序把文本解码出来再重新编码，会有什么变化？

# %%
# en: Exercise 1: ceil(49,152 / 32) = 1,536 words, 6 KiB a row; 64 rows are 393,216 bytes, 384 KiB, in one copy.
# zh: 练习 1：ceil(49,152 / 32) = 1,536 个字，一行 6 KiB；64 行是 393,216 字节，即 384 KiB，一次拷贝完成。
smol_vocab = Config(str(smollm2_dir()), device="cpu").hf_config.vocab_size
assert bitmask_words(smol_vocab) == 1536 and 64 * bitmask_words(smol_vocab) * 4 == 393_216

# en: Exercise 2: three: the word's two tokens (y, es or n, o), then an end-of-sequence token, the only one the
# en: grammar allows once the word is whole.
# zh: 练习 2：三个：这个单词的两个 token（y、es 或 n、o），然后是一个 end-of-sequence token，单词完整之后语法只允许它。
answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraints["choice"]),
                      use_tqdm=False)[0]["token_ids"]
assert len(answer) == 3 and answer[-1] in EOS and [texts[t] for t in answer[:2]] in (["y", "es"], ["n", "o"])

# en: Exercise 3: the text is London either way, and encoding it again gives L, on, d, on: four tokens, not six. The
# en: tokens the program counted and the ones the model wrote no longer agree (a prefix cache keyed by tokens would
# en: miss), and the model wrote two pairs it has seldom seen.
# zh: 练习 3：两种写法的文本都是 London，重新编码得到 L、on、d、on：四个 token，不是六个。程序数的 token 和模型写的
# zh: token 对不上了（按 token 建键的前缀缓存会落空），而且模型写了两对它很少见过的组合。
o, n, d = (tokenizer.convert_tokens_to_ids(piece) for piece in ("o", "n", "d"))
six_pieces = [london[0], o, n, d, o, n]
assert tokenizer.decode(six_pieces) == "London" and tokenizer.encode("London") == london and len(london) == 4
llm.exit()
print(say("all exercise answers check out"))
