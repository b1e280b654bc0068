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
# # 12 · The sampler in Triton
#
# **Goal.** Chapter 08's sampler on a GPU, in one pass: write `temperature_sample` as two Triton
# kernels that draw their noise from a counter, fill the GPU even at a small batch, and keep the
# torch path's contract to the token (greedy rows are `torch.argmax`, ties go to the lowest
# column, a row whose logits are not numbers gets `NON_FINITE`). Then give the runner's sampler
# the kernels on a GPU, compiled before the first step. As in chapter 11, without a GPU the
# kernels run in the Triton interpreter, on small shapes.

# %% [markdown] tags=["zh"]
# # 12 · 用 Triton 写采样器
#
# **目标：** 让第 08 章的采样器在 GPU 上一遍完成：把 `temperature_sample` 写成两个 Triton 内核，它们的噪声来自计数器，
# 即使批次很小也能占满 GPU，而且逐个 token 地遵守 torch 版本的约定（贪心行就是 `torch.argmax`，并列时取最小的列，
# logits 不是数的行得到 `NON_FINITE`）。然后在 GPU 上让执行器的采样器改用这些内核，并在第一步之前编译好。和第 11 章
# 一样，没有 GPU 时内核在 Triton 解释器里以小形状运行。

# %%
# en: Triton chooses between compiling and interpreting when a kernel is decorated: without a GPU, the interpreter
# en: must be chosen before Triton is first imported (chapter 11).
# zh: Triton 在装饰内核时决定编译还是解释执行：没有 GPU 时，必须在第一次导入 Triton 之前选定解释器（第 11 章）。
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
print("device:", DEVICE, "| TRITON_INTERPRET =", os.environ.get("TRITON_INTERPRET", "0"))

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang). Like everything
# en: this chapter imports from nanovllm, imported after TRITON_INTERPRET is set: the engine's modules import
# en: Triton, which must see it first.
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。和本章从 nanovllm 导入的一切
# zh: 一样，在设置 TRITON_INTERPRET 之后才导入：引擎的模块会导入 Triton，而 Triton 必须先看到它。
from nanovllm.book.lang import Phrases

say = Phrases({
    "expected": "期望",
    "observed": "观测",
    "chi-square = {chi:.2f} over {n} draws (5 degrees of freedom; 99.9% quantile 20.5)":
        "{n} 次抽样的卡方 = {chi:.2f}（5 个自由度；99.9% 分位数 20.5）",
    "{dtype!s:15s} greedy == torch.argmax: {tokens}": "{dtype!s:15s} 贪心 == torch.argmax：{tokens}",
    "two calls:": "两次调用：",
    "sampler's fast path: {path}": "采样器的快速路径：{path}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %% default module
#| default_exp layers.triton_sampler

# %% [markdown] tags=["en"]
# ## The idea: the race in one pass
#
# On a GPU the sampler is the busiest code after the model itself: every decode step turns one
# row of 151,936 logits (Qwen3's vocabulary) per sequence into a token. Chapter 08's `temperature_sample`
# makes several passes over that `[batch, vocab]` tensor (a maximum, the softmax's sums, the
# noise, an argmax), and even compiled by `torch.compile` each row reduction runs in a single
# thread block per row: a batch of 100 rows keeps 100 thread blocks busy on a GPU that runs
# thousands at once. In chapter 19's benchmark on an H200 the compiled version took 0.55 s of a
# 7.7 s run; the kernels below take 0.08 s of the same run (chapter 14 records both). Three
# observations turn it into one pass that fills the GPU.
#
# **1. No softmax.** With `p_i = exp(l_i / T) / Z`,
#
# ```
# argmax_i  p_i / E_i  =  argmax_i (l_i / T − log Z − log E_i)  =  argmax_i (l_i / T − log E_i)
# ```
#
# because `log` is increasing and the log-sum-exp `log Z` is the same for the whole row: no
# maximum, no sum, nothing that must see the whole row first. Multiplying by `T > 0` moves no
# argmax either, so the kernel scores `l_i − T · log E_i`. That has no division, so not even a
# temperature of 1e-45 can overflow (the torch path subtracts each row's maximum for the same
# reason). A greedy row (`T = 0`) scores the bare logits: an exact argmax.
#
# **2. Noise from a counter.** `E = −log(1 − U)` is Exp(1) when `U` is uniform. Triton's
# `tl.randint4x(seed, counter)` is Philox, a *counter-based* generator: its output is a ten-round
# cipher of `counter` under the key `seed`. It carries no state from one number to the next, so
# every program computes its own numbers without talking to the others, and distinct counters
# give numbers that behave as independent draws. One evaluation yields four 32-bit numbers,
# which serve four columns; the counter `(row · chunks + chunk) · BLOCK/4 + i` numbers the groups
# of four columns of the call, so every (row, column) gets its own draw and shares its counter
# with nobody. Why `1 − U` rather than `U`: the noise that decides the race is a *small* `E` (it
# makes its token win), and a small `E` means `U` near 0, where a float made of 32 random bits is
# finely spaced (steps of 2⁻³¹), while near 1 its values are 2⁻²⁴ apart. Below `U = 1/128` the
# kernel takes `−log(1 − U)` from its series `U + U²/2 + U³/3 + U⁴/4`, which keeps the digits
# that computing `1 − U` in float32 would round away (and that a fast approximate `log` may blur
# next to 1).
#
# **3. Split the row.** The vocabulary is cut into chunks of `BLOCK` columns (4,096 by default:
# 38 chunks for Qwen3). Program `(row, chunk)` scores its chunk and writes the chunk's best score
# and its column; a batch of 100 rows runs 3,800 such programs, enough to fill every SM. A
# second, tiny kernel, one program per row, reads the row's 38 pairs and keeps the best.
#
# ```
#           chunk 0      chunk 1           chunk 37
# row 0   [ 4096 cols  | 4096 cols  | ... | 384 cols ]  → 38 (score, column) → pick → token
# row 1   [ ...                                      ]  → 38 (score, column) → pick → token
#           race_chunk_kernel: grid (rows, chunks)          race_pick_kernel: grid (rows,)
# ```
#
# **Ties** go to the lowest column, as with `torch.argmax`: the chunk kernel keeps the lowest
# column holding its best score, and the pick kernel's `tl.argmax` prefers the lower chunk.
#
# **The seed** of each call is drawn on the host from torch's CPU generator: no round trip to the
# GPU, and `torch.manual_seed(s)` before a call replays its noise. It is the Philox key, so every
# call gets a fresh stream; with a 62-bit key no step repeats an earlier step's noise (with 31
# bits, a server taking ten steps a second would likely repeat one within two hours). A caller
# that cannot hand the kernel a new number at each launch passes the key in a one-element tensor
# instead, and `SEED_IN_MEMORY` makes the kernel read it when it runs: chapter 18 replays the
# sampler from a CUDA graph, whose kernels keep the arguments they were captured with.

# %% [markdown] tags=["zh"]
# ## 思路：一遍扫完词表的指数赛跑
#
# 在 GPU 上，采样器是仅次于模型本身最繁忙的代码：每个 decode 步都要把每个序列的一行 151,936 个 logits（Qwen3
# 的词表大小）变成一个 token。`temperature_sample` 要把这个 `[batch, vocab]` 张量读好几遍（求最大值、softmax 的
# 求和、生成噪声、argmax）；即使用 `torch.compile` 编译，每个按行归约也只用一个线程块处理一行：100 行的批次只让
# 100 个线程块忙碌，而 GPU 能同时运行数千个。在 H200 上跑第 19 章的基准测试时，编译后的版本在 7.7 s 中占了
# 0.55 s；下面的内核在同样的运行中只占 0.08 s（两者都记录在第 14 章）。下面三点观察把它变成一遍完成、又能占满
# GPU 的计算。
#
# **1. 不需要 softmax：** 设 `p_i = exp(l_i / T) / Z`，则
#
# ```
# argmax_i  p_i / E_i  =  argmax_i (l_i / T − log Z − log E_i)  =  argmax_i (l_i / T − log E_i)
# ```
#
# 因为 `log` 是增函数，而 log-sum-exp `log Z` 对整行都一样：不求最大值，不求和，没有任何一步必须先看完整行。
# 乘以 `T > 0` 也不改变 argmax，所以内核的分数是 `l_i − T · log E_i`。其中没有除法，因此哪怕温度是 1e-45 也不会
# 溢出（torch 版本出于同样的原因先减去每行的最大值）。贪心行（`T = 0`）的分数就是 logits 本身：精确的 argmax。
#
# **2. 由计数器产生噪声：** 若 `U` 服从均匀分布，则 `E = −log(1 − U)` 服从 Exp(1)。Triton 的
# `tl.randint4x(seed, counter)` 就是 Philox，一种*基于计数器*的生成器：它的输出是以 `seed` 为密钥、对 `counter`
# 做十轮加密的结果。它不在前后两个数之间保留任何状态，所以每个程序各自计算自己的随机数，不必与其他程序打交道；
# 不同的计数器给出的数，表现得就像相互独立的抽样。算一次得到四个 32 位的数，供四列使用；计数器
# `(row · chunks + chunk) · BLOCK/4 + i` 为这次调用中每组四列编号，所以每个（行，列）都有自己的一次抽样，
# 计数器不与任何人共用。为什么用 `1 − U` 而不是 `U`：决定赛跑胜负的是*小*的 `E`（它让对应的 token 胜出），
# 而 `E` 小意味着 `U` 接近 0，由 32 个随机位构成的浮点数在那里非常密（间隔 2⁻³¹），在 1 附近却相隔 2⁻²⁴。
# 当 `U < 1/128` 时，内核用级数 `U + U²/2 + U³/3 + U⁴/4` 计算 `−log(1 − U)`，保住了在 float32 中计算 `1 − U`
# 时会被舍入掉的那些位（快速的近似 `log` 在 1 附近也可能把它们弄模糊）。
#
# **3. 把一行切开：** 词表被切成若干段（chunk），每段 `BLOCK` 列（默认 4,096：Qwen3 共 38 段）。程序
# `(row, chunk)` 为自己那一段打分，写下这一段的最高分和它所在的列；100 行的批次会启动 3,800 个这样的程序，足以
# 占满所有 SM。第二个很小的内核每行一个程序，读出该行的 38 对结果，留下最好的那个。
#
# ```
#           第 0 段      第 1 段           第 37 段
# 第 0 行 [ 4096 列    | 4096 列    | ... | 384 列   ]  → 38 个（分数，列）→ 挑选 → token
# 第 1 行 [ ...                                      ]  → 38 个（分数，列）→ 挑选 → token
#           race_chunk_kernel：网格 (rows, chunks)          race_pick_kernel：网格 (rows,)
# ```
#
# **并列**时取最小的列，与 `torch.argmax` 一致：分段内核保留取得最高分的最小列号，挑选内核的 `tl.argmax`
# 也优先选编号较小的段。
#
# **种子**：每次调用的种子都在主机端从 torch 的 CPU 生成器中抽取：不用与 GPU 往返，而且在调用前执行
# `torch.manual_seed(s)` 就能重现这次调用的噪声。种子就是 Philox 的密钥，所以每次调用都得到一条新的随机流；
# 密钥有 62 位，任何一步都不会重复先前某一步的噪声（如果只有 31 位，每秒十步的服务器很可能在两小时内就重复一次）。
# 调用者如果无法在每次启动时交给内核一个新数，就把密钥放进一个单元素张量传入，`SEED_IN_MEMORY` 让内核在运行时才去
# 读它：第 18 章从 CUDA Graph 重放采样器，而图里的内核保留的是捕获时的参数。

# %% triton sampler imports
#| export layers.triton_sampler
"""The sampler's fast path on a GPU: the exponential race as two Triton kernels."""
# zh: GPU 上采样器的快速路径：用两个 Triton 内核实现的指数赛跑。

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.layers.sampler import NON_FINITE
from nanovllm.layers.triton_attention import check_triton_device

# %% [markdown] tags=["en"]
# ## Build it: the chunk kernel and the pick kernel
#
# The chunk kernel works on its `BLOCK` columns as a `[4, BLOCK/4]` tile: row `q` of the tile
# holds the columns `q · BLOCK/4 + i` and takes the `q`-th of the four numbers of Philox draw
# `i`. Two reductions over the tile give its best score, then the lowest column holding that
# score. Columns past the vocabulary load as `−inf` and never win. A chunk that holds a NaN or a
# `+inf` logit reports column −1 instead, and the pick kernel writes `NON_FINITE` for a row with
# such a chunk, or whose best score is `−inf` (a row of nothing but `−inf`): the torch path's
# mark, at the price of a comparison per column that the kernel makes while the logits are
# already in registers.

# %% [markdown] tags=["zh"]
# ## 动手：分段内核与挑选内核
#
# 分段内核把自己的 `BLOCK` 列当作一个 `[4, BLOCK/4]` 的 tile 处理：tile 的第 `q` 行存放第 `q · BLOCK/4 + i` 列，
# 使用第 `i` 次 Philox 抽样所得四个数中的第 `q` 个。对 tile 做两次归约，先得到最高分，再得到取得这个分数的最小
# 列号。超出词表的列以 `−inf` 载入，永远不会胜出。某一段里只要有 NaN 或 `+inf` 的 logit，它报告的列就是 −1；
# 挑选内核对含有这种段的行，或最高分为 `−inf` 的行（整行都是 `−inf`），写入 `NON_FINITE`：与 torch 版本相同的
# 标记，代价只是趁 logits 还在寄存器里时，每列多做一次比较。

# %% race kernels
#| export layers.triton_sampler
# en: A new seed every call: do_not_specialize lets one compiled variant serve them all (see the wrapper).
# en: SEED_IN_MEMORY: seed is a pointer to the key, read when the kernel runs (see the wrapper's seed argument).
# zh: 每次调用的种子都不同：do_not_specialize 让一个编译好的变体服务所有种子（见包装函数）。
# zh: SEED_IN_MEMORY：seed 是指向密钥的指针，内核运行时才读取（见包装函数的 seed 参数）。
@triton.jit(do_not_specialize=["seed"])
def race_chunk_kernel(
    logits_ptr, temperatures_ptr, chunk_score_ptr, chunk_column_ptr, seed, vocab, BLOCK: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
):
    # en: This program races columns [chunk * BLOCK, (chunk + 1) * BLOCK) of one row.
    # zh: 本程序让某一行的第 [chunk * BLOCK, (chunk + 1) * BLOCK) 列参加赛跑。
    if SEED_IN_MEMORY:
        seed = tl.load(seed)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    QUARTER: tl.constexpr = BLOCK // 4
    # en: One Philox counter per group of four columns, unique within the call; each yields four 32-bit numbers.
    # zh: 每组四列一个 Philox 计数器，在本次调用内唯一；每个计数器产生四个 32 位的数。
    i = tl.arange(0, QUARTER)
    r0, r1, r2, r3 = tl.randint4x(seed, (row * num_chunks + chunk) * QUARTER + i)
    # en: The chunk as a [4, QUARTER] tile: row q holds columns q * QUARTER + i and the q-th number of draw i.
    # zh: 把这一段看作 [4, QUARTER] 的 tile：第 q 行存放第 q * QUARTER + i 列，以及第 i 次抽样的第 q 个数。
    q = tl.arange(0, 4)[:, None]
    bits = tl.where(q == 0, r0[None, :], tl.where(q == 1, r1[None, :], tl.where(q == 2, r2[None, :], r3[None, :])))
    cols = chunk * BLOCK + q * QUARTER + i[None, :]
    # en: E = -log(1 - U) ~ Exp(1). U is finely spaced near 0, where E is small; there the series keeps E exact.
    # zh: E = -log(1 - U) ~ Exp(1)。U 在 0 附近很密，那里 E 很小；在那里用级数计算，E 才精确。
    u = tl.uint_to_uniform_float(bits)
    noise = tl.where(u < 0.0078125, u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25))), -tl.log(1.0 - u))
    # en: The torch path's floor: U = 0 exactly would give E = 0 and log E = -inf.
    # zh: 与 torch 版本相同的下限：U 恰好为 0 时 E = 0，log E = -inf。
    noise = tl.maximum(noise, 1e-10)
    x = tl.load(logits_ptr + row * vocab + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    # en: T * (l / T - log E): the race without a softmax or a division; T = 0 (greedy) scores the bare logits.
    # zh: T * (l / T - log E)：不用 softmax、也不用除法的赛跑；T = 0（贪心）时分数就是 logits 本身。
    t = tl.load(temperatures_ptr + row)
    score = tl.where(t > 0, x - t * tl.log(noise), x)
    # en: A NaN logit leaves no meaningful winner (below); as -inf it keeps the reductions well defined.
    # zh: NaN 的 logit 让胜者失去意义（见下文）；把它当作 -inf，归约的结果才有明确定义。
    nan = x != x
    score = tl.where(nan, float("-inf"), score)
    # en: The best score of the tile, then the lowest column holding it (torch.argmax's choice on a tie).
    # en: Not tl.reshape to one row and one tl.max: compiled, reshape may reorder the elements (on the
    # en: H200 it returned wrong columns), and the column order is what the tie rule needs.
    # zh: 先求 tile 中的最高分，再求取得它的最小列号（并列时 torch.argmax 的选择）。不用 tl.reshape 展平成一行再做
    # zh: 一次 tl.max：编译后 reshape 可能打乱元素的顺序（在 H200 上它返回了错误的列），而并列规则依赖列的顺序。
    best = tl.max(tl.max(score, axis=1), axis=0)
    at = tl.min(tl.min(tl.where(score == best, cols, 2147483647), axis=1), axis=0)
    # en: A NaN or +inf logit leaves no meaningful winner: column -1 tells the pick kernel.
    # zh: 出现 NaN 或 +inf 的 logit 时不存在有意义的胜者：用列号 -1 告诉挑选内核。
    broken = tl.max(tl.max((nan | (x == float("inf"))).to(tl.int32), axis=1), axis=0)
    at = tl.where(broken > 0, -1, at)
    tl.store(chunk_score_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_column_ptr + row * num_chunks + chunk, at)


@triton.jit
def race_pick_kernel(
    chunk_score_ptr, chunk_column_ptr, token_ptr, num_chunks, CHUNKS: tl.constexpr, NON_FINITE: tl.constexpr
):
    # en: One program per row: the best of the row's chunk winners; tl.argmax prefers the lower chunk on a tie.
    # zh: 每行一个程序：在该行各段的胜者中挑出最好的；并列时 tl.argmax 选编号较小的段。
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    scores = tl.load(chunk_score_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    columns = tl.load(chunk_column_ptr + row * num_chunks + c, mask=c < num_chunks, other=0)
    token = tl.load(chunk_column_ptr + row * num_chunks + tl.argmax(scores, axis=0)).to(tl.int64)
    # en: A chunk saw NaN or +inf (column -1), or every logit is -inf: no token can be drawn.
    # zh: 某一段见到了 NaN 或 +inf（列号 -1），或者所有 logit 都是 -inf：抽不出任何 token。
    broken = (tl.min(columns, axis=0) < 0) | (tl.max(scores, axis=0) == float("-inf"))
    tl.store(token_ptr + row, tl.where(broken, NON_FINITE, token))

# %% [markdown] tags=["en"]
# ## Build it: the wrapper, and what Triton compiles
#
# `triton_temperature_sample` has the contract of `temperature_sample`, so chapter 09 can put it
# in the sampler's place on a GPU. It draws the seed, allocates the `[rows, chunks]` scratch
# pairs and launches both kernels; it reads nothing back from the GPU.
#
# Triton compiles a kernel again for each new *variant* of its arguments: a new value of a
# `constexpr`, a new type of an integer argument (an `int` below 2³¹ is passed as int32, one of
# 2³² or more as int64), and a new class of an integer's value (equal to 1, divisible by 16, or
# neither). The seed changes with every call, so `do_not_specialize=["seed"]` keeps its class out
# of the variant, and the seed is kept in `[2³², 2³² + 2⁶²)` so that its type is always int64.
# `vocab` is the same in every call for a model, so it stays specialized (Qwen3's 151,936 is
# divisible by 16, which lets the loads be vectorized); the batch only sets the grid. One model
# and one logits dtype therefore need exactly one variant of each kernel, which chapter 09's
# `compile_sampler_kernels` compiles before the first step.

# %% [markdown] tags=["zh"]
# ## 动手：包装函数，以及 Triton 编译了什么
#
# `triton_temperature_sample` 的约定与 `temperature_sample` 完全相同，所以第 09 章可以在 GPU 上用它替换采样器的
# 快速路径。它抽取种子、分配 `[rows, chunks]` 的临时（分数，列）对，然后启动两个内核；它不从 GPU 读回任何东西。
#
# 参数每出现一个新的*变体*，Triton 就要重新编译一次内核：`constexpr` 取了新值、整数参数换了类型（小于 2³¹ 的
# `int` 以 int32 传入，大于等于 2³² 的以 int64 传入），或整数的值落入了新的类别（等于 1、能被 16 整除、或都不是）。
# 种子每次调用都不同，所以用 `do_not_specialize=["seed"]` 让它的类别不进入变体，并把种子限制在
# `[2³², 2³² + 2⁶²)` 之内，使它的类型总是 int64。对同一个模型，每次调用的 `vocab` 都相同，所以保留对它的特化
# （Qwen3 的 151,936 能被 16 整除，载入可以向量化）；批大小只决定网格。因此一个模型、一种 logits 数据类型，每个
# 内核恰好只需要一个变体，第 09 章的 `compile_sampler_kernels` 会在第一步之前把它编译好。

# %% triton sampler wrapper
#| export layers.triton_sampler
def triton_temperature_sample(
    logits: torch.Tensor, temperatures: torch.Tensor, block_size: int = 4096, seed: torch.Tensor | None = None
) -> torch.Tensor:
    """``temperature_sample`` as two Triton kernels: logits [B, V] (float32, bfloat16 or float16), temperatures [B]
    (0 = greedy) -> [B] int64 on the logits' device, NON_FINITE for a row whose logits are not numbers. Nothing is
    read back from the GPU; the noise's seed comes from torch's CPU generator, so ``torch.manual_seed`` before a
    call makes it reproducible. ``seed``: a one-element int64 tensor on the logits' device instead, holding the
    Philox key; the kernel reads it when it runs, not when it is launched."""
    # zh: 用两个 Triton 内核实现的 ``temperature_sample``：logits [B, V]（float32、bfloat16 或 float16），
    # zh: temperatures [B]（0 = 贪心）-> logits 所在设备上的 [B] int64，logits 不是数的行为 NON_FINITE。不从 GPU
    # zh: 读回任何东西；噪声的随机种子来自 torch 的 CPU 生成器，所以调用前先 ``torch.manual_seed`` 就能让结果可复现。
    # zh: ``seed``：改用 logits 所在设备上一个元素的 int64 张量，里面存放 Philox 密钥；内核在运行时才读它，而不是在
    # zh: 启动时。
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if tuple(temperatures.shape) != (batch,):
        raise ValueError(f"temperatures must have shape ({batch},), got {tuple(temperatures.shape)}")
    if vocab == 0:
        raise ValueError("logits have no columns: an empty vocabulary has no token to sample")
    if block_size < 4 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 4, got {block_size}")
    num_chunks = triton.cdiv(vocab, block_size)
    if num_chunks > 65535:
        raise ValueError(f"{vocab} columns in blocks of {block_size} are more than 65535 chunks (the grid's limit)")
    check_triton_device(logits)
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()
    # en: The kernel finds row r at r * vocab elements: only an unusual layout is copied.
    # zh: 内核在第 r * vocab 个元素处找到第 r 行：只有布局不寻常时才会复制。
    logits = logits.contiguous()
    temperatures = temperatures.to(device=logits.device, dtype=torch.float32).contiguous()
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return tokens
    chunk_score = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_column = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    # en: Drawn on the host from torch's CPU generator: no GPU sync, and torch.manual_seed replays it.
    # en: In [2**32, 2**32 + 2**62) Triton always passes it as int64 (one variant), a 62-bit Philox key.
    # zh: 在主机端从 torch 的 CPU 生成器中抽取：不必与 GPU 同步，torch.manual_seed 也能重现它。
    # zh: 落在 [2**32, 2**32 + 2**62) 内，Triton 总是以 int64 传入（只有一个变体），作为 62 位的 Philox 密钥。
    if seed is None:
        seed = 2**32 + int(torch.randint(2**62, ()))
    elif seed.shape != (1,) or seed.dtype != torch.int64 or seed.device != logits.device:
        raise ValueError(f"seed must be one int64 on {logits.device}, got {seed.dtype} {tuple(seed.shape)} on "
                         f"{seed.device}")
    race_chunk_kernel[(batch, num_chunks)](
        logits, temperatures, chunk_score, chunk_column, seed, vocab, BLOCK=block_size,
        SEED_IN_MEMORY=isinstance(seed, torch.Tensor),
    )
    race_pick_kernel[(batch,)](
        chunk_score, chunk_column, tokens, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks),
        NON_FINITE=NON_FINITE,
    )
    return tokens

# %% [markdown] tags=["en"]
# ## Check it: the kernels sample the softmax, and greedy rows are torch's argmax
#
# Chapter 08's six logits, now at temperature 2.5, with `block_size=4`: the vocabulary of
# 6 is two chunks, the second one half past the end. On a CPU the interpreter runs three
# programs per row, so the chi-square test uses 250 draws (60,000 on a GPU); the high
# temperature flattens the distribution enough that every token still expects more than 10.
# Then greedy rows on random float32 and bfloat16 logits of 1,000 columns in chunks of 256 (the
# last one partial), with planted ties; a batch that mixes greedy and sampled rows; and the
# seed: two calls draw different noise, and `torch.manual_seed` replays a call exactly. Last, the
# rows whose logits are not numbers get the torch path's mark.

# %% [markdown] tags=["zh"]
# ## 验证：内核采样得到的是 softmax 分布，贪心行与 torch 的 argmax 一致
#
# 仍用第 08 章那六个 logits，这次温度为 2.5，`block_size=4`：大小为 6 的词表分成两段，第二段有一半超出末尾。在 CPU
# 上解释器每行要运行三个程序，所以卡方检验只抽 250 次（GPU 上抽 60,000 次）；较高的温度让分布足够平坦，每个
# token 的期望次数仍大于 10。然后是
# 贪心行：1,000 列的随机 float32 和 bfloat16 logits，每段 256 列（最后一段不满），并人为放入并列的最大值；一个
# 贪心行与采样行混合的批次；然后是种子：两次调用抽到的噪声不同，而 `torch.manual_seed` 能完全重现一次调用。最后，
# logits 不是数的行得到与 torch 版本相同的标记。

# %%
from nanovllm.layers.triton_sampler import triton_temperature_sample

# en: Chapter 08's six logits, and four rows whose logits are not all numbers: a NaN, a +inf, nothing but -inf,
# en: and a single -inf (a masked token, not an error).
# zh: 第 08 章的六个 logits，以及四行并非全是数的 logits：含 NaN、含 +inf、全是 -inf，以及只含一个 -inf（那是被屏蔽的
# zh: token，不算错误）。
base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
broken = base.repeat(4, 1)
broken[0, 3], broken[1, 5], broken[2], broken[3, 0] = float("nan"), float("inf"), float("-inf"), float("-inf")
torch.manual_seed(0)
# en: 250 draws still catch a broken kernel: one that ignores the temperature would give a chi-square of about 80,
# en: one that loses the second chunk (tokens 4 and 5) about 45, both far above 20.5.
# zh: 250 次抽样仍足以抓住有错的内核：忽略温度的内核卡方约为 80，丢掉第二段（token 4 和 5）的约为 45，都远超 20.5。
N6, T6 = (60_000 if DEVICE == "cuda" else 250), 2.5
kernel_tokens = triton_temperature_sample(
    base.repeat(N6, 1).to(DEVICE), torch.full((N6,), T6, device=DEVICE), block_size=4
)
observed6 = torch.bincount(kernel_tokens.cpu(), minlength=6).double()
expected6 = N6 * (base / T6).softmax(-1).double()
chi_square6 = ((observed6 - expected6) ** 2 / expected6).sum().item()
print(format(say("expected"), "<10"), [round(x) for x in expected6.tolist()])
print(format(say("observed"), "<10"), [int(x) for x in observed6.tolist()])
print(say("chi-square = {chi:.2f} over {n} draws (5 degrees of freedom; 99.9% quantile 20.5)", chi=chi_square6, n=N6))
assert chi_square6 < 20.5

wide = torch.randn(8, 1000)
# en: Planted ties, row 3 across chunks 0 and 3, row 5 inside chunk 1: the first column must win.
# zh: 人为放入的并列，第 3 行跨第 0 段和第 3 段，第 5 行在第 1 段内部：必须是靠前的那一列胜出。
wide[3, [10, 900]] = 10.0
wide[5, [300, 301]] = 10.0
for dtype in (torch.float32, torch.bfloat16):
    logits_d = wide.to(DEVICE, dtype)
    greedy_tokens = triton_temperature_sample(logits_d, torch.zeros(8, device=DEVICE), block_size=256)
    assert torch.equal(greedy_tokens.cpu(), logits_d.float().argmax(-1).cpu()), dtype
    print(say("{dtype!s:15s} greedy == torch.argmax: {tokens}", dtype=dtype, tokens=greedy_tokens.tolist()))
mixed_t = torch.tensor([0.0, 1.0] * 4, device=DEVICE)
mixed_tokens = triton_temperature_sample(wide.to(DEVICE), mixed_t, block_size=256)
assert torch.equal(mixed_tokens[::2].cpu(), wide[::2].argmax(-1))

# en: Every token equally likely, so the tokens drawn show the noise itself.
# zh: 所有 token 的概率相同，所以抽到的 token 反映的就是噪声本身。
flat = torch.zeros(16, 64, device=DEVICE)
ones = torch.ones(16, device=DEVICE)
torch.manual_seed(7)
first = triton_temperature_sample(flat, ones, block_size=32)
second = triton_temperature_sample(flat, ones, block_size=32)
torch.manual_seed(7)
replay = triton_temperature_sample(flat, ones, block_size=32)
print(say("two calls:"), first.tolist(), second.tolist(), sep="\n  ")
assert torch.equal(first, replay) and not torch.equal(first, second)
# en: A seed kept on the device: the kernel reads the key that the tensor holds when it runs.
# zh: 存放在设备上的种子：内核读取的是它运行时张量里存放的密钥。
key = torch.tensor([2**40 + 7], device=DEVICE)
from_memory = triton_temperature_sample(flat, ones, block_size=32, seed=key)
assert torch.equal(from_memory, triton_temperature_sample(flat, ones, block_size=32, seed=key.clone()))
key += 1
assert not torch.equal(from_memory, triton_temperature_sample(flat, ones, block_size=32, seed=key))

# en: The mark of logits that are not numbers, as on the torch path (row 0's NaN is in chunk 0, row 1's inf in chunk 1).
# zh: 与 torch 版本相同的“不是数”标记（第 0 行的 NaN 在第 0 段，第 1 行的 inf 在第 1 段）。
for temperature in (0.0, 1.0):
    marked = triton_temperature_sample(broken.to(DEVICE), torch.full((4,), temperature, device=DEVICE), block_size=4)
    assert marked[:3].tolist() == [NON_FINITE] * 3 and marked[3] >= 0, marked

# %% [markdown] tags=["en"]
# ## Wire it in: the runner samples with the race kernels
#
# Chapter 09's runner builds a `Sampler` whose fast path is `temperature_sample`. On a GPU it now
# takes the race kernels instead, and compiles them when it is built (`compile_sampler_kernels`:
# one variant each, for the model's vocabulary and logits dtype), like chapter 11's attention
# kernels; these lines too run at the end of the runner's constructor.

# %% [markdown] tags=["zh"]
# ## 接进去：执行器用赛跑内核采样
#
# 第 09 章的执行器构建的 `Sampler`，快速路径是 `temperature_sample`。现在在 GPU 上它改用赛跑内核，并在构建时就把它们
# 编译好（`compile_sampler_kernels`：针对模型的词表大小和 logits 的数据类型，每个内核一个变体），和第 11 章的注意力内核
# 一样；这几行同样在执行器构造函数的末尾运行。

# %% runner samples with the kernels
#| export engine.model_runner
import torch

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.model_runner import ModelRunner


@add_to_init(ModelRunner)
def _sample_with_the_race_kernels(self) -> None:
    # en: On a GPU, the sampler's fast path is the race kernels, compiled now rather than in a step (imported only
    # en: here: a CPU run never imports Triton).
    # zh: 在 GPU 上，采样器的快速路径换成赛跑内核，并且现在就编译，而不是在某一步里编译（只在这里导入：CPU 上的运行
    # zh: 从不导入 Triton）。
    if self.device.type == "cuda":
        from nanovllm.layers.triton_sampler import triton_temperature_sample

        self.sampler.sample_plain = triton_temperature_sample
        self.compile_sampler_kernels()


@add_to_class(ModelRunner)
@torch.inference_mode()
def compile_sampler_kernels(self) -> None:
    """Run the sampler's fast path once, so that Triton compiles the sampler's two kernels now: one variant
    each, for this model's vocabulary and logits dtype. It serves every later step, since the batch only sets
    the grid and the seed, new in every call, is not specialized on."""
    # zh: 把采样器的快速路径运行一次，让 Triton 现在就编译采样器的两个内核：各一个变体，针对这个模型的词表和
    # zh: logits 的 dtype。它服务之后的每一步，因为批次只决定网格，而每次调用都不同的随机种子不参与特化。
    logits = torch.zeros(2, self.config.hf_config.vocab_size, dtype=self.dtype, device=self.device)
    # en: a greedy row and a sampled one
    # zh: 一行贪心，一行采样。
    self.sampler(logits, torch.tensor([0.0, 1.0], device=self.device))

# %%
# en: On this machine: what the runner's sampler runs for a batch without top-k, top-p or seeds.
# zh: 在这台机器上：批次中没有 top-k、top-p 和种子时，执行器的采样器运行的是什么。
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config

runner = ModelRunner(Config.from_kwargs(build_tiny_model("qwen3"), num_kvcache_blocks=8, kvcache_block_size=16))
print(say("sampler's fast path: {path}", path=runner.sampler.sample_plain.__name__))
fast_path = "triton_temperature_sample" if DEVICE == "cuda" else "temperature_sample"
assert runner.sampler.sample_plain.__name__ == fast_path

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/triton_sampler.py`: `triton_temperature_sample(logits, temperatures,
#   block_size=4096)`, chapter 08's `temperature_sample` as two Triton kernels, `race_chunk_kernel`
#   (one program per row and chunk of columns) and `race_pick_kernel` (one per row), with Philox
#   noise from a seed drawn on the host.
# - On a GPU the runner's sampler takes them as its fast path, compiled when the runner is built
#   (`compile_sampler_kernels`).
#
# ## Exercises
#
# 1. The chunk kernel scores `l − T · log E` rather than `l / T − log E`. Check that both pick the
#    same token for `T = 0.7` on random logits and noise, and that only the kernel's form stays
#    finite at `T = 1e-45`.
# 2. A batch of 100 rows of Qwen3's 151,936 logits, in chunks of 4,096 columns: how many programs
#    does the chunk kernel run, and how many pairs does each pick program read?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/triton_sampler.py`：`triton_temperature_sample(logits, temperatures, block_size=4096)`，
#   把第 08 章的 `temperature_sample` 写成两个 Triton 内核：`race_chunk_kernel`（每行、每段列一个程序）和
#   `race_pick_kernel`（每行一个程序），噪声来自 Philox，种子在主机端抽取。
# - 在 GPU 上，执行器的采样器用它们作为快速路径，并在执行器构建时编译好（`compile_sampler_kernels`）。
#
# ## 练习
#
# 1. 分段内核的分数是 `l − T · log E`，而不是 `l / T − log E`。在随机的 logits 和噪声上验证：`T = 0.7` 时两者选出
#    同一个 token；`T = 1e-45` 时只有内核的写法保持有限。
# 2. 一个 100 行的批次，每行是 Qwen3 的 151,936 个 logits，每段 4,096 列：分段内核要运行多少个程序？每个挑选程序要读
#    多少对结果？

# %%
# en: 1: multiplying every score of a row by the same T > 0 keeps their order; l - T log E has no division,
# en: so a tiny T leaves (nearly) the bare logits instead of pushing them to infinity.
# zh: 1：一行的所有分数乘以同一个 T > 0，顺序不变；l - T log E 里没有除法，所以极小的 T 留下的（几乎）就是
# zh: logits 本身，而不会把它们推向无穷大。
logits4, noise4 = torch.randn(1000, 50), torch.empty(1000, 50).exponential_()
assert torch.equal((logits4 / 0.7 - noise4.log()).argmax(-1), (logits4 - 0.7 * noise4.log()).argmax(-1))
assert torch.isinf(logits4 / 1e-45).any() and torch.isfinite(logits4 - 1e-45 * noise4.log()).all()
# en: 2: 38 chunks a row (151,936 / 4,096 = 37.1, rounded up), 38 * 100 = 3,800 programs; each pick reads 38 pairs.
# zh: 2：每行 38 段（151,936 / 4,096 = 37.1，向上取整），38 * 100 = 3,800 个程序；每个挑选程序读 38 对结果。
import triton

assert triton.cdiv(151_936, 4_096) == 38 and 38 * 100 == 3_800
print(say("all exercise answers check out"))
