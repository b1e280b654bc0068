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
# # 15 · The fused decode step: a layer in four matmul kernels
#
# **Goal.** Chapter 14's graphs took Python out of a decode step. What is left at small batches is a
# fixed cost: the *boundaries* between some 330 small kernels, which at a batch of one cost more
# than the reading of the weights. This chapter cuts that cost without changing a token. By the end
# of it you can:
#
# - explain why a kernel boundary costs more than a launch, and what the step's bound is;
# - fold each RMSNorm (and its residual add) into the matmul after it and SiLU × mul into the
#   gate/up matmul, so that a decoder layer runs in four matmul kernels;
# - write the small-batch matmul two ways: a GEMV that loads its weights before it waits for its
#   input (programmatic dependent launch on Hopper), and a tile kernel that splits the input of a
#   narrow weight between programs (split-K);
# - read a kernel timeline of one layer, recorded before and after, and the step against its bound.
#
# As in chapter 14, without a GPU the kernels run in the Triton interpreter on small shapes, and
# the figures measured on an H200 are shown as **recorded** figures.

# %% [markdown] tags=["zh"]
# # 15 · 融合的 decode 步：四个矩阵乘内核完成一层
#
# **目标：** 第 14 章的 CUDA Graph 把 Python 从 decode 步里拿掉了。小批次时剩下的是一笔固定开销：大约 330 个小内核之间的
# *边界*，批大小为 1 时，它们比读权重本身还贵。本章在不改变任何一个 token 的前提下削减这笔开销。读完本章，你将能够：
#
# - 解释为什么内核之间的边界比一次启动更贵，以及一步的上限是多少；
# - 把每个 RMSNorm（连同它的残差相加）折进它后面的矩阵乘，把 SiLU × mul 折进 gate/up 矩阵乘，让一个解码层只跑四个
#   矩阵乘内核；
# - 用两种方式写小批次的矩阵乘：先读权重、再等输入的 GEMV（Hopper 上的程序化依赖启动），以及把窄权重的输入维度分给
#   几个程序的 tile 内核（split-K）；
# - 读懂改动前后记录下来的一层的内核时间线，以及一步与它的上限之比。
#
# 和第 14 章一样，没有 GPU 时内核在 Triton 解释器里以小形状运行；在 H200 上测得的数字以**记录值**的形式展示。

# %%
# en: The kernels of this chapter are Triton: without a GPU they run in the interpreter, which must be chosen
# en: before Triton is first imported (chapter 11).
# zh: 本章的内核是 Triton 写的：没有 GPU 时它们在解释器里运行，而这必须在第一次导入 Triton 之前选定（第 11 章）。
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from nanovllm.layers.context import reset_context, set_prefill_context
from nanovllm.layers.layernorm import rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# %% default module
#| default_exp layers.fused_decode

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "a decoder layer in four matmul kernels == chapter 06's layer (3 tokens, then 1, float32)":
        "四个矩阵乘内核完成的解码层 == 第 06 章的层（先 3 个 token，再 1 个，float32）",
    "fused_decode={setting}: {count} decoder layers take the fused path":
        "fused_decode={setting}：{count} 个解码层走融合路径",
    "unfused": "不融合",
    "fused": "融合",
    "the last layer of a step, batch 1 (H200)": "一步中的最后一层，批大小 1（H200）",
    "across a step boundary, batch 1 (H200)": "跨过一个步边界，批大小 1（H200）",
    "last layer: {unfused:.1f} -> {fused:.1f} µs, {before} -> {after} kernels; GPU idle before the next step: "
    "{idle_unfused:.0f} and {idle_fused:.0f} µs":
        "最后一层：{unfused:.1f} -> {fused:.1f} µs，{before} -> {after} 个 kernel；下一步之前 GPU 空闲："
        "{idle_unfused:.0f} 和 {idle_fused:.0f} µs",
    "batch {batch}: graph {before:.3f} -> {after:.3f} ms ({share:.0%} of the bound), "
    "step {fast:.3f}-{slow:.3f} ms":
        "批大小 {batch}：graph {before:.3f} -> {after:.3f} ms（上限的 {share:.0%}），每步 {fast:.3f}-{slow:.3f} ms",
    "PDL hides {hidden:.1f} µs a boundary; {left:.1f} µs a kernel remain":
        "PDL 每个边界藏住 {hidden:.1f} µs；每个内核还剩 {left:.1f} µs",
    "batch {batch:>2}: {step:.3f} ms a step, {share:.0%} of the bound, {kernels} kernels":
        "批大小 {batch:>2}：每步 {step:.3f} ms，上限的 {share:.0%}，{kernels} 个 kernel",
    "Qwen3-8B, batch 1, {name}: {step:.3f} ms a step, {share:.1%} of the bound, {kernels} kernels":
        "Qwen3-8B，批大小 1，{name}：每步 {step:.3f} ms，上限的 {share:.1%}，{kernels} 个 kernel",
    "{rows:>2} rows: cuBLAS {cublas:.0f} µs, small_matmul {tile:.0f} µs, prefetch tile {prefetch:.0f} µs":
        "{rows:>2} 行：cuBLAS {cublas:.0f} µs，small_matmul {tile:.0f} µs，预取 tile {prefetch:.0f} µs",
    "{rows} rows (H100): row by row {by_row:.0f} µs, as one tile {one_tile:.0f} µs, cuBLAS {cublas:.0f} µs":
        "{rows} 行（H100）：一行一行 {by_row:.0f} µs，作为一个 tile {one_tile:.0f} µs，cuBLAS {cublas:.0f} µs",
    "batch {batch:>2} ({card}): {unfused:.3f} -> {fused:.3f} ms a step, {before} -> {after} kernels, "
    "{share:.1%} of the bound":
        "批大小 {batch:>2}（{card}）：每步 {unfused:.3f} -> {fused:.3f} ms，{before} -> {after} 个 kernel，"
        "上限的 {share:.1%}",
    "{card}, {date}: `{command}`": "{card}，{date}：`{command}`",
    "one token, {name}: {us} µs, {share:.0%} of the bound": "一个 token，{name}：{us} µs，占上限的 {share:.0%}",
    "cuBLAS": "cuBLAS",
    "GEMV, 8 / 4 columns, PDL": "GEMV，每个程序 8 / 4 列，PDL",
    "GEMV, 8 / 4 columns, no PDL": "GEMV，每个程序 8 / 4 列，不用 PDL",
    "GEMV, 8 / 8 columns, PDL": "GEMV，每个程序 8 / 8 列，PDL",
    "GEMV, 16 / 4 columns, PDL": "GEMV，每个程序 16 / 4 列，PDL",
    "{tokens:>2} tokens: cuBLAS {cublas} µs, GEMV {gemv} µs, tile kernel {tile} µs":
        "{tokens:>2} 个 token：cuBLAS {cublas} µs，GEMV {gemv} µs，tile 内核 {tile} µs",
    "{weight} at 4 rows (H100): cuBLAS {cublas} µs, tile kernel {tile} µs (split {split}), without split-K {plain} µs":
        "{weight}，4 行（H100）：cuBLAS {cublas} µs，tile 内核 {tile} µs（分 {split} 段），不用 split-K {plain} µs",
    "o_proj: {blocks} column blocks x split {split} = {programs} programs, {inputs} inputs each":
        "o_proj：{blocks} 个列块 x split {split} = {programs} 个程序，每个读 {inputs} 个输入",
})

# %% [markdown] tags=["en"]
# ## A decode layer in four matmul kernels
#
# With chapter 14's graphs and fused q/k/v kernel, a decode layer still runs about eleven kernels: the
# add + RMSNorm, the q/k/v matmul, the fused q/k/v kernel, attention, `o_proj`, the second
# add + RMSNorm, `gate_up_proj`, SiLU × mul and `down_proj`. At a batch of one, each matmul reads
# a few megabytes of weights and the others read a few kilobytes, so the step is mostly
# boundaries between kernels: every kernel waits for the one before it to finish, and a launch
# inside a graph still costs a microsecond or two before the first load.
#
# The norms and the activation need not be kernels of their own. An RMSNorm needs only its
# row: every program of the matmul after it can load the few rows of a small batch (16 at most,
# 2 KB each for Qwen3-0.6B), sum their squares and scale them as it feeds them to its tile, and
# the residual add happens in the same load. SiLU × mul needs a column of `gate` and the same
# column of `up`: a program that computes both columns can multiply them before it writes. So a
# layer becomes four matmul kernels plus attention's two:
#
# 1. add + RMSNorm + q/k/v matmul (program 0 also writes the new residual);
# 2. the fused q/k/v kernel, then attention (unchanged);
# 3. `o_proj` (then the all-reduce, with tensor parallelism);
# 4. add + RMSNorm + gate/up matmul + SiLU × mul;
# 5. `down_proj` (then the all-reduce).
#
# `small_matmul` is that kernel, in two forms. For one token (a decode step of one sequence, the
# case this section is for) and up to four it is a GEMV, a matrix times a vector: each program owns a few
# rows of the weight (8 for q/k/v and gate/up, 4 for `o_proj` and `down_proj`, so that every matmul
# has at least 256 programs for the H200's 132 SMs), loads its whole slice of them at once (16 KB
# for q/k/v), and only then reads the input rows, one after another, while the slice stays in
# registers. For more tokens, up to 16, it is a tile kernel: a tile of 16 rows (the smallest
# `tl.dot` tile) walks the input dimension, and where a weight has too few output columns to give
# every SM a share (`o_proj` and `down_proj`: 32 blocks of 32 columns), several programs split the
# input between them (*split-K*), each leaving its partial sum in a workspace, the last to finish
# adding them in a fixed order. The rounding follows chapter 06's
# functions exactly in both: the residual added in the model's dtype, the norm in float32 rounded
# to the model's dtype before the weight, the matmul accumulated in float32, `gate` and `up`
# rounded before SiLU as when they were a tensor. `FusedDecodeLayer` runs chapter 06's decoder
# layer with it; the decoder layer asks it through its `fused_forward` hook. The setting
# `fused_decode` (on by default on a GPU) hands every layer one that takes steps of up to four
# tokens (`GEMV_ROWS`), where the GEMV measured faster than cuBLAS; longer steps take the tile
# kernel only when asked (`FusedDecodeLayer(max_tokens=16)`), for the reason measured below.
#
# Why load the weights first? A kernel boundary costs more than a launch. Inside a graph, kernel
# *n + 1* starts only when every program of kernel *n* has finished and its writes are visible;
# then its programs issue their first loads, which take a microsecond to come back from memory.
# For a weight of 4 MB, which the H200 reads in 1 µs, that wait and the slow tail of the kernel
# before (its last programs running while most SMs sit idle) cost more than the reading. Yet the
# weights do not depend on the kernel before; only the input row does. Hopper has *programmatic
# dependent launch* for that: a kernel launched with it may start as soon as the kernel before
# calls `gdc_launch_dependents`, and waits at `gdc_wait` for that kernel's end (and its writes)
# only where it needs them. The GEMV calls the first as it starts, loads its weight slice, and
# waits just before it reads the input row: the weights of matmul *n + 1* stream in while
# matmul *n* finishes.

# %% [markdown] tags=["zh"]
# ## 四个矩阵乘内核完成一层 decode
#
# 有了第 14 章的 CUDA graph 和融合的 q/k/v 内核之后，一层 decode 仍要跑大约十一个内核：残差相加 + RMSNorm、q/k/v
# 矩阵乘、融合的 q/k/v 内核、注意力、`o_proj`、第二次残差相加 + RMSNorm、`gate_up_proj`、SiLU × mul 和
# `down_proj`。批大小为 1 时，每个矩阵乘读几 MB 权重，其余内核只读几 KB，所以一步的时间大多花在内核之间的边界上：
# 每个内核都要等前一个结束，而即使在 graph 里，一次启动在第一次读显存之前也要花一两微秒。
#
# 归一化和激活函数不必单独成为内核。RMSNorm 只需要它自己那一行：它后面那个矩阵乘的每个程序，都可以把小批次的那几行
# （最多 16 行，Qwen3-0.6B 每行 2 KB）读进来，求平方和，在送进自己的 tile 时顺手缩放；残差相加也在同一次读取中完成。
# SiLU × mul 需要 `gate` 的一列和 `up` 的同一列：一个同时算这两列的程序，可以在写出之前把它们乘起来。于是一层变成
# 四个矩阵乘内核，加上注意力的两个：
#
# 1. 残差相加 + RMSNorm + q/k/v 矩阵乘（0 号程序同时写出新的残差）；
# 2. 融合的 q/k/v 内核，然后是注意力（不变）；
# 3. `o_proj`（张量并行时接 all-reduce）；
# 4. 残差相加 + RMSNorm + gate/up 矩阵乘 + SiLU × mul；
# 5. `down_proj`（接 all-reduce）。
#
# `small_matmul` 就是这个内核，它有两种形式。一个 token（一个序列的 decode 步，也就是本节关心的情形）到四个 token
# 时它是 GEMV，即矩阵乘向量：每个程序负责权重的几行（q/k/v 和 gate/up 每个程序 8 行，`o_proj` 和 `down_proj` 4 行，
# 这样每个矩阵乘都至少有 256 个程序，分给 H200 的 132 个 SM），一次把自己那一段权重全部读入（q/k/v 是 16 KB），然后
# 才去读输入行，一行接一行，那段权重一直留在寄存器里。更多 token（最多 16 个）时它是 tile 内核：一个 16 行的 tile
# （`tl.dot` 最小的 tile）沿输入维度走下去；如果权重的输出列太少，不够让每个 SM 分到一份（`o_proj` 和 `down_proj`：
# 32 个 32 列的块），就由几个程序分担输入维度（*split-K*），各自把部分和留在工作区里，最后完成的那个按固定顺序把它们
# 加起来。两种形式的舍入都与
# 第 06 章的函数完全一致：残差在模型的数据类型中相加，归一化在 float32 中计算、乘权重之前舍入到模型的数据类型，矩阵乘
# 在 float32 中累加，`gate` 和 `up` 先舍入再做 SiLU，和它们还是张量时一样。`FusedDecodeLayer` 用它来运行第 06 章的
# 解码层；解码层通过自己的 `fused_forward` 钩子询问它。配置项 `fused_decode`（在 GPU 上默认打开）交给每一层一个只接手
# 不超过四个 token 的步（`GEMV_ROWS`）的融合层，因为那里 GEMV 测得比 cuBLAS 快；更长的步只有在明确要求时
# （`FusedDecodeLayer(max_tokens=16)`）才用 tile 内核，原因见下面的测量。
#
# 为什么先读权重？内核之间的边界比一次启动更贵。在 graph 里，第 *n + 1* 个内核要等第 *n* 个内核的所有程序都结束、
# 它写的数据都可见之后才开始；然后它的程序才发出第一批读取，数据从显存回来又要一微秒左右。对一个 4 MB 的权重来说
# （H200 读它只要 1 µs），这段等待，加上前一个内核慢吞吞的尾巴（最后几个程序还在跑，大多数 SM 已经闲着），比读权重
# 本身还贵。可是权重并不依赖前一个内核，只有输入行依赖它。Hopper 为此提供了*程序化依赖启动*（programmatic
# dependent launch）：用它启动的内核，在前一个内核调用 `gdc_launch_dependents` 之后就可以开始，只在真正需要的地方
# 用 `gdc_wait` 等前一个内核结束（并看到它写出的数据）。GEMV 一开始就调用前者，读入自己那段权重，直到要读输入行之前
# 才等待：第 *n* 个矩阵乘收尾的时候，第 *n + 1* 个矩阵乘的权重已经在源源不断地读进来了。

# %% fused decode
#| export layers.fused_decode
"""A decoder layer in four matmul kernels for a step of a few tokens: each RMSNorm (and its residual add) folded
into the matmul after it, SiLU x mul into the gate/up matmul."""
# zh: 为只有几个 token 的一步准备的、由四个矩阵乘法内核组成的解码器层：每个 RMSNorm（及其残差加法）并入
# zh: 它后面的矩阵乘法，SiLU 乘法并入 gate/up 矩阵乘法。

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import nn

from nanovllm.layers.triton_attention import programmatic_launch

# en: The rows of one tl.dot tile: a step of at most this many tokens takes the fused path.
# zh: 一个 tl.dot tile 的行数：不超过这么多 token 的一步走融合路径。
MAX_TOKENS = 16
# en: The most rows the GEMV takes. Each row costs it one more pass of multiply-adds over the slice it holds; with
# en: every row's input loaded as one tile (below), the step's 28 layers of matmuls measured faster than cuBLAS up
# en: to 4 rows (1.12-1.20x on an H100), as fast at 5 and slower at 8.
# zh: GEMV 最多处理的行数。每多一行，它就要对手里那段权重多做一遍乘加；所有行的输入作为一个 tile 一次读入之后
# zh: （见下文），一步 28 层的矩阵乘在不超过 4 行时测得比 cuBLAS 快（H100 上 1.12–1.20 倍），5 行一样快，8 行更慢。
GEMV_ROWS = 4
# en: The steps that the engine runs fused: up to GEMV_ROWS tokens, where the GEMV measured faster than cuBLAS
# en: (below). The tile kernel runs only when asked (a launch given to small_matmul): it measured slower.
# zh: 引擎融合运行的步：不超过 GEMV_ROWS 个 token 的步，那里 GEMV 测得比 cuBLAS 快（见下文）。tile 内核只在明确
# zh: 要求时运行（给 small_matmul 传入 launch）：它测得更慢。
FUSED_STEP_TOKENS = GEMV_ROWS


@triton.jit
def load_rows(x_ptr, residual_ptr, rows, ks, mask, stride_x, stride_r, ADD: tl.constexpr):
    """A [rows, ks] tile of the input, plus the residual when ADD, added in the model's dtype."""
    # zh: 输入的一个 [rows, ks] tile；ADD 时再加上残差，按模型的 dtype 相加。
    x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
    if ADD:
        # en: As torch adds two bfloat16 tensors: in float32, rounded once (spelled out, since the Triton
        # en: interpreter gets arithmetic on 16-bit floats wrong).
        # zh: 与 torch 把两个 bfloat16 张量相加的方式相同：在 float32 中相加，只舍入一次（显式写出来，因为 Triton
        # zh: 解释器算 16 位浮点运算会出错）。
        residual = tl.load(residual_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def store_result(acc, up, bias_ptr, out_ptr, rows, cols, col_mask, out_mask, N, stride_out, GLU: tl.constexpr,
                 BIAS: tl.constexpr):  # fmt: skip
    """The matmul's float32 sums (gate and up when GLU) plus the bias, activated when GLU, stored as the output."""
    # zh: 矩阵乘法的 float32 累加和（GLU 时为 gate 和 up）加上偏置，GLU 时再经过激活，作为输出存下。
    if BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GLU:
        # en: silu_and_mul on gate and up rounded to the model's dtype, as the tensor held them.
        # zh: silu_and_mul（第 06 章）作用在舍入到模型数据类型的 gate 和 up 上，和它们存在张量里时一样。
        gate = acc.to(dtype).to(tl.float32)
        activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        result = (activated * up.to(dtype).to(tl.float32)).to(dtype)
    else:
        result = acc.to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], result, mask=out_mask)


@triton.jit
def small_matmul_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, partial_ptr,
    arrivals_ptr, M, N, K, K_CHUNK, eps, stride_x, stride_r, stride_w, stride_out, stride_r_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
    ADD: tl.constexpr, GLU: tl.constexpr, BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # en: Program (p, s) computes output columns [p * BLOCK_N, (p + 1) * BLOCK_N) for all M (<= BLOCK_M) rows, over
    # en: the s-th of SPLIT slices of the input (split-K: a narrow weight still gives every SM a share to stream).
    # zh: 程序 (p, s) 为全部 M（<= BLOCK_M）行计算输出列 [p * BLOCK_N, (p + 1) * BLOCK_N)，只算输入的第 s 段
    # zh: （共 SPLIT 段；split-K：窄的权重也能让每个 SM 分到一份去读）。
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if NORM:
        # en: First pass over the rows: the sum of squares (program 0 also writes x + residual, the new residual).
        # zh: 第一遍扫描这些行：求平方和（0 号程序同时写出 x + residual，即新的残差）。
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (ks < K)[None, :]
            x = load_rows(x_ptr, residual_ptr, rows, ks, mask, stride_x, stride_r, ADD)
            if ADD and pid == 0 and split == 0:
                tl.store(residual_out_ptr + rows[:, None] * stride_r_out + ks[None, :], x, mask=mask)
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        inv_rms = tl.rsqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_CHUNK, (split + 1) * K_CHUNK, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = load_rows(x_ptr, residual_ptr, rows, ks, row_mask[:, None] & k_mask[None, :], stride_x, stride_r, ADD)
        if NORM:
            # en: rms_norm: float32, rounded to the model's dtype, then times the weight in that dtype.
            # zh: rms_norm（第 06 章）：在 float32 中计算，舍入到模型的数据类型，再在该类型中乘以权重。
            norm_weight = tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype)
            x = (norm_weight[None, :] * normed.to(tl.float32)).to(x.dtype)
        w_mask = col_mask[:, None] & k_mask[None, :]
        if UPCAST:
            x = x.to(tl.float32)
        w = tl.load(weight_ptr + cols[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w.to(tl.float32) if UPCAST else w), acc, input_precision=PRECISION)
        if GLU:
            # en: The up rows sit N rows below the gate rows in the merged gate_up weight.
            # zh: 在合并的 gate_up 权重里（第 16 章），up 的行在 gate 的行下方 N 行处。
            w = tl.load(weight_ptr + (N + cols)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
            up = tl.dot(x, tl.trans(w.to(tl.float32) if UPCAST else w), up, input_precision=PRECISION)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT == 1:
        store_result(acc, up, bias_ptr, out_ptr, rows, cols, col_mask, out_mask, N, stride_out, GLU, BIAS)
    else:
        # en: Each program leaves its partial sum in its own slice of the workspace; the last of the column block's
        # en: SPLIT programs to arrive adds them, in split order (the same sum whichever program comes last: the
        # en: result does not change from run to run), and resets the counter for the next launch.
        # zh: 每个程序把自己的部分和放进工作区里属于自己的那一片；同一列块的 SPLIT 个程序中最后到达的那个按段的顺序
        # zh: 把它们加起来（无论哪个程序最后到达，和都一样：结果不会一次一个样），并把计数器清零，留给下一次启动。
        partial = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(partial + split * BLOCK_M * N, acc, mask=out_mask)
        if tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for part in tl.static_range(SPLIT):
                # en: .cg: read from L2, where the other SMs' stores are, not from this SM's L1
                # zh: .cg：从 L2 读（其他 SM 的写入在那里），而不是从本 SM 的 L1 读。
                acc += tl.load(partial + part * BLOCK_M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(arrivals_ptr + pid, 0)
            store_result(acc, up, bias_ptr, out_ptr, rows, cols, col_mask, out_mask, N, stride_out, GLU, BIAS)


@triton.jit
def gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, N, eps,
    stride_w, stride_x, stride_r, stride_out, stride_ro,
    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    NORM: tl.constexpr, ADD: tl.constexpr, GLU: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # en: ROWS tokens: program p computes output columns [p * BLOCK_N, (p + 1) * BLOCK_N) of every row, its whole
    # en: slice of the weight loaded at once, before anything that an earlier kernel writes, then kept in registers
    # en: while the rows go by one after another: the weight is read once for all of them.
    # zh: ROWS 个 token：程序 p 计算每一行的输出列 [p * BLOCK_N, (p + 1) * BLOCK_N)；它那一段权重一次全部读入，
    # zh: 而且在读取任何由前面内核写出的数据之前，然后留在寄存器里，让各行依次用它：权重只为所有行读一次。
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, K_PAD)
    k_mask = ks < K
    w_mask = col_mask[:, None] & k_mask[None, :]
    if PDL:
        # en: Let the next kernel launch now: its own weight loads overlap this kernel's.
        # zh: 让下一个内核现在就启动：它读自己权重的访存与本内核的访存重叠。
        tl.extra.cuda.gdc_launch_dependents()
    # en: Held in the weight's own dtype (16K bfloat16 elements fill 64 registers a thread; float32 would take 128).
    # zh: 以权重自己的数据类型保存（16K 个 bfloat16 元素占每个线程 64 个寄存器；float32 要占 128 个）。
    w = tl.load(weight_ptr + cols[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    if GLU:
        w_up = tl.load(weight_ptr + (N + cols)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    if NORM:
        norm_weight = tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    if BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if GLU:
            bias_up = tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)
    if PDL:
        # en: Only now wait for the kernel before (and see what it wrote): the input rows come from it.
        # zh: 直到这里才等待前一个内核结束（并看到它写出的数据）：输入行来自它。
        tl.extra.cuda.gdc_wait()
    dtype = out_ptr.dtype.element_ty
    # en: Every row's input at once, one [ROWS_PAD, K_PAD] tile, added and normalized together: loaded row by row,
    # en: each row waited for its own load and norm, and its multiply-adds for the row before it to be stored.
    # zh: 所有行的输入一次读入，是一个 [ROWS_PAD, K_PAD] 的 tile，一起加上残差、一起做 norm：一行一行地读时，
    # zh: 每一行都要等自己的读取和 norm，它的乘加还要等上一行写回。
    rows = tl.arange(0, ROWS_PAD)
    row_mask = rows < ROWS
    tile_mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=tile_mask, other=0.0)
    if ADD:
        residual = tl.load(residual_ptr + rows[:, None] * stride_r + ks[None, :], mask=tile_mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(residual_out_ptr + rows[:, None] * stride_ro + ks[None, :], x, mask=tile_mask)
    if NORM:
        x32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, 1) / K + eps)
        x = (norm_weight[None, :] * (x32 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype)
    x_tile = x.to(tl.float32)
    results = tl.zeros([ROWS_PAD, BLOCK_N], dtype=tl.float32)
    for row in tl.static_range(ROWS):
        # en: The row's input: the one term of its column sum that is not zero (exact).
        # zh: 这一行的输入：按列求和时唯一不为零的那一项（精确）。
        x32 = tl.sum(tl.where(rows[:, None] == row, x_tile, 0.0), axis=0)
        acc = tl.sum(w.to(tl.float32) * x32[None, :], axis=1)
        if BIAS:
            acc += bias
        if GLU:
            up = tl.sum(w_up.to(tl.float32) * x32[None, :], axis=1)
            if BIAS:
                up += bias_up
            gate = acc.to(dtype).to(tl.float32)
            activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            result = (activated * up.to(dtype).to(tl.float32)).to(dtype)
        else:
            result = acc.to(dtype)
        # en: Kept (exactly: a 16-bit value in float32) until every row is done, then stored as one tile.
        # zh: 先留着（精确：16 位的值放进 float32），等所有行算完再作为一个 tile 写回。
        results = tl.where(rows[:, None] == row, result.to(tl.float32)[None, :], results)
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], results.to(dtype), mask=out_mask)


# en: The most weight elements one GEMV program holds in registers (16K: 32 KB of bf16, 128 per thread at 4 warps).
# zh: 一个 GEMV 程序放在寄存器里的权重元素上限（16K 个：32 KB 的 bf16，4 个 warp 时每个线程 128 个）。
GEMV_SLICE = 1 << 14


def gemv_block_n(columns: int, inputs: int, glu: bool, min_programs: int = 256) -> int:
    """Output columns per GEMV program: the widest of 8, 4, 2, 1 whose weight slice fits GEMV_SLICE and that still
    makes ``min_programs`` programs (256: two per SM of an H200; on Qwen3-0.6B that is 8 for q/k/v and gate/up, 4 for
    o_proj and down_proj, the launch measured fastest there), else the narrowest that fits; 0 when not even one
    column fits."""
    # zh: 每个 GEMV 程序负责的输出列数：在 8、4、2、1 中，取权重切片能放进 GEMV_SLICE、且仍能凑出 ``min_programs``
    # zh: 个程序的最宽者（256：H200 上每个 SM 两个；在 Qwen3-0.6B 上，q/k/v 和 gate/up 为 8，o_proj 和 down_proj 为 4，
    # zh: 那里测得这样启动最快），否则取放得下的最窄者；连一列都放不下时为 0。
    slice_width = triton.next_power_of_2(inputs) * (2 if glu else 1)
    fitting = [block for block in (8, 4, 2, 1) if block * slice_width <= GEMV_SLICE]
    return next((block for block in fitting if triton.cdiv(columns, block) >= min_programs),
                fitting[-1] if fitting else 0)  # fmt: skip


@dataclass(frozen=True)
class SmallMatmulLaunch:
    """How `small_matmul` splits the work: output columns per program, input elements per loop step, Triton's
    warps and pipeline stages (loads in flight while the tile before them is multiplied), and the programs that
    share a column block (split-K)."""
    # zh: `small_matmul` 怎样切分工作：每个程序的输出列数、每个循环步的输入元素数、Triton 的 warp 数和流水线级数
    # zh: （前一个 tile 做乘法时还在进行中的加载数），以及共享一个列块的程序数（split-K）。

    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # en: Split-K: how many programs share a column block, each over one slice of the input (not with glu: SiLU
    # en: needs the whole sum).
    # zh: split-K：一个列块由几个程序分担，每个程序只算输入的一段（glu 时不行：SiLU 要的是完整的和）。
    split: int = 1


def choose_launch(columns: int, inputs: int, glu: bool = False) -> SmallMatmulLaunch:
    """The launch for a weight of ``columns`` output columns and ``inputs`` input elements: tiles of 32 columns and
    128 inputs, five loads in flight, and the input split in 2, 4 or 8 (split-K) where the column blocks alone
    make fewer than 128 programs, so that a narrow weight (Qwen3-0.6B's o_proj and down_proj: 32 blocks) still
    gives every SM a share to stream; never with ``glu`` (SiLU needs the whole sum), nor into slices under 256
    inputs."""
    # zh: ``columns`` 个输出列、``inputs`` 个输入元素的权重所用的启动配置：32 列、128 个输入的 tile，同时进行五个加载；
    # zh: 只靠列块凑不满 128 个程序时，把输入切成 2、4 或 8 份（split-K），让窄的权重（Qwen3-0.6B 的 o_proj 和
    # zh: down_proj：32 个块）也能让每个 SM 分到一份来读；``glu`` 时从不切分（SiLU 需要完整的和），
    # zh: 也不切成少于 256 个输入的片。
    blocks = triton.cdiv(columns, 32)
    splits = [split for split in (1, 2, 4, 8) if split == 1 or (not glu and inputs // split >= 256)]
    split = next((split for split in splits if blocks * split >= 128), splits[-1])
    return SmallMatmulLaunch(block_n=32, block_k=128, num_stages=5, split=split)


# en: Split-K's workspace by (device, columns, launch): the partial sums [split, MAX_TOKENS, columns] in float32 and
# en: one arrival counter per column block. Made on a launch's first use (the engine's eager warm-up before each
# en: graph capture) and reused by every layer after it: their kernels run one after another, and the last
# en: program of each column block leaves its counter at zero.
# zh: split-K 的工作区，按（设备、列数、启动方式）存放：float32 的部分和 [split, MAX_TOKENS, 列数]，以及每个列块一个
# zh: 到达计数器。某种启动方式第一次使用时创建（引擎在每次捕获图之前的预热就是在 eager 模式下运行的），之后每一层
# zh: 都复用它：它们的内核一个接一个地运行，而每个列块的最后一个程序会把计数器清回零。
_split_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(device: torch.device, columns: int, launch: SmallMatmulLaunch) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial sums and arrival counters of a split-K launch over ``columns`` output columns on ``device``."""
    # zh: 在 ``device`` 上、覆盖 ``columns`` 个输出列的 split-K 启动所用的部分和与到达计数器。
    key = (device, columns, launch.block_n, launch.split)
    if key not in _split_workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"small_matmul: split-K workspace for {key} first asked for during a CUDA graph "
                               "capture; run the same launch once outside the capture first (its counters start at 0)")
        partial = torch.empty(launch.split, MAX_TOKENS, columns, dtype=torch.float32, device=device)
        arrivals = torch.zeros(triton.cdiv(columns, launch.block_n), dtype=torch.int32, device=device)
        _split_workspaces[key] = (partial, arrivals)
    return _split_workspaces[key]


def check_small_matmul(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor | None, glu: bool, launch: SmallMatmulLaunch | None) -> None:
    """Raise ValueError for what `small_matmul` cannot do."""
    # zh: `small_matmul` 做不到的情况抛出 ValueError。
    if x.shape[0] > MAX_TOKENS:
        raise ValueError(f"small_matmul takes at most {MAX_TOKENS} rows, not {x.shape[0]}")
    if residual is not None and norm_weight is None:
        raise ValueError("a residual is added only before a norm: pass norm_weight with it")
    if x.stride(1) != 1 or weight.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("small_matmul needs rows of contiguous elements")
    if launch is not None and launch.split > 1 and glu:
        raise ValueError("a glu launch cannot split the input (SiLU needs the whole sum): use split=1")


def small_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    glu: bool = False,
    launch: SmallMatmulLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(x, weight, bias)`` for at most MAX_TOKENS rows of ``x``, with what comes before and after it:

    - ``norm_weight``: the input is ``rms_norm(x + residual, norm_weight, eps)`` (``residual`` optional);
    - ``glu``: ``weight`` is the merged [gate | up] weight and the result is ``SiLU(gate) * up``.

    Returns (the result, the new residual: ``x + residual``, or ``x`` itself when there is no residual).
    Up to GEMV_ROWS rows take `gemv_kernel` when its weight slice fits; more rows, or a ``launch`` (how to split
    the work, default `choose_launch`), take the tile kernel.
    """
    # zh: 对 ``x`` 的至多 MAX_TOKENS 行计算 ``F.linear(x, weight, bias)``，连同它前后的操作：
    # zh:
    # zh: - ``norm_weight``：输入是 ``rms_norm(x + residual, norm_weight, eps)``（``residual`` 可选）；
    # zh: - ``glu``：``weight`` 是合并的 [gate | up] 权重，结果是 ``SiLU(gate) * up``。
    # zh:
    # zh: 返回（结果，新的残差：``x + residual``，没有残差时就是 ``x`` 本身）。
    # zh: 至多 GEMV_ROWS 行、且权重切片放得下时走 `gemv_kernel`；行数更多，或者给了 ``launch``
    # zh: （怎样切分工作，默认 `choose_launch`），走 tile 内核。
    check_small_matmul(x, weight, residual, norm_weight, glu, launch)
    tokens, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    # en: The Triton interpreter (3.7) gets tl.dot of 16-bit floats wrong too: there the tiles go up to float32 first,
    # en: which is exact, and float32 accumulates as the GPU's tensor cores do.
    # zh: Triton 解释器（3.7）算 16 位浮点的 tl.dot 会出错：在解释器里先把 tile 转成 float32（这种转换是精确的），
    # zh: 再像 GPU 的 Tensor Core 那样在 float32 中累加。
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    upcast = interpreted and x.dtype != torch.float32
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(tokens, k, dtype=x.dtype, device=x.device) if residual is not None else x
    # en: The interpreter runs the programs one after another: there the fewest (the widest slices) are the fastest.
    # zh: 解释器一个接一个地运行程序：在那里程序越少（每段越宽）越快。
    min_programs = 1 if interpreted else 256
    block_n = gemv_block_n(n, k, glu, min_programs) if tokens <= GEMV_ROWS and launch is None else 0
    if block_n and tokens:
        pdl = programmatic_launch(x.device)
        gemv_kernel[(triton.cdiv(n, block_n),)](
            x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
            bias if bias is not None else x, out, residual_out, n, eps, weight.stride(0), x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
            ROWS=tokens, ROWS_PAD=triton.next_power_of_2(tokens), K=k, K_PAD=triton.next_power_of_2(k),
            BLOCK_N=block_n, NORM=norm_weight is not None, ADD=residual is not None, GLU=glu,
            BIAS=bias is not None, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    elif tokens:
        launch = launch or choose_launch(n, k, glu)
        # en: Each split's slice of the input, whole tiles of block_k (the last one may run past k: masked).
        # zh: 每段输入的长度，取 block_k 的整数倍（最后一段可能超出 k：超出部分被屏蔽）。
        k_chunk = triton.cdiv(triton.cdiv(k, launch.split), launch.block_k) * launch.block_k
        partial, arrivals = split_workspace(x.device, n, launch) if launch.split > 1 else (out, out)
        small_matmul_kernel[(triton.cdiv(n, launch.block_n), launch.split)](
            x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
            bias if bias is not None else x, out, residual_out, partial, arrivals, tokens, n, k, k_chunk, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0),
            residual_out.stride(0),
            BLOCK_M=MAX_TOKENS, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT=launch.split,
            NORM=norm_weight is not None, ADD=residual is not None, GLU=glu, BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
        )  # fmt: skip
    return out, residual_out


def row_parallel(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RowParallelLinear.forward with the small matmul: this rank's partial sum, then the all-reduce."""
    # zh: 用小矩阵乘法实现的 RowParallelLinear.forward：先算本 rank 的部分和，再 all-reduce。
    y, _ = small_matmul(x, linear.weight, linear.bias if linear.tp_rank == 0 else None)
    if linear.tp_size > 1:
        dist.all_reduce(y)
    return y


class FusedDecodeLayer:
    """``Qwen3DecoderLayer.forward`` for a step of at most ``max_tokens`` tokens (1 to MAX_TOKENS), in
    four matmul kernels (plus attention's): the decoder layer calls it through its ``fused_forward`` hook."""
    # zh: 至多 ``max_tokens`` 个 token（1 到 MAX_TOKENS）的一步所用的 ``Qwen3DecoderLayer.forward``，
    # zh: 由四个矩阵乘法内核（外加注意力的）完成：解码器层通过它的 ``fused_forward`` 钩子调用它。

    def __init__(self, max_tokens: int = FUSED_STEP_TOKENS) -> None:
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be from 1 to {MAX_TOKENS}, not {max_tokens}")
        self.max_tokens = max_tokens

    def applies(self, hidden_states: torch.Tensor) -> bool:
        return hidden_states.shape[0] <= self.max_tokens

    def __call__(
        self, layer: nn.Module, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        qkv, residual = small_matmul(hidden_states, attention.qkv_proj.weight, attention.qkv_proj.bias,
                                     residual=residual, norm_weight=norm.weight, eps=norm.eps)
        hidden_states = row_parallel(attention.o_proj, attention.attend(positions, qkv))
        norm = layer.post_attention_layernorm
        activated, residual = small_matmul(hidden_states, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                           residual=residual, norm_weight=norm.weight, eps=norm.eps, glu=True)
        return row_parallel(mlp.down_proj, activated), residual


def fuse_decode_layers(model: nn.Module, max_tokens: int = FUSED_STEP_TOKENS) -> int:
    """Hand every decoder layer of ``model`` (those with a ``fused_forward`` hook and a dense gated MLP) the fused
    layer for steps of at most ``max_tokens`` tokens; returns how many got it. (A layer whose MLP is a router and
    experts keeps its own path.)"""
    # zh: 把用于至多 ``max_tokens`` 个 token 的步的融合层，交给 ``model`` 的每个解码器层（带 ``fused_forward`` 钩子、
    # zh: MLP 为稠密门控 MLP 的那些）；返回有多少层拿到了。（MLP 是路由器加专家的层保留自己的路径。）
    fused = FusedDecodeLayer(max_tokens)
    layers = [module for module in model.modules()
              if hasattr(module, "fused_forward") and hasattr(getattr(module, "mlp", None), "gate_up_proj")]
    for layer in layers:
        layer.fused_forward = fused
    return len(layers)

# %% [markdown] tags=["en"]
# ## Check it
#
# On a small layer with every weight drawn at random (so that a missing norm weight or a
# swapped gate and up would show), in float32: `small_matmul` against `F.linear` after chapter
# 06's `rms_norm` and `silu_and_mul`, then one whole decoder layer, fused against chapter 06's, for
# a step of 3 tokens. On a GPU the kernel is compiled; on a CPU it runs in the Triton interpreter.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 用一个所有权重都随机抽取的小层（这样漏乘归一化权重、或者把 gate 和 up 弄反，都能看出来），在 float32 下：先把
# `small_matmul` 与第 06 章的 `rms_norm`、`silu_and_mul` 加 `F.linear` 对照，再把整个解码层的融合版本与第 06 章的版本
# 对照，一步 3 个 token。在 GPU 上内核是编译运行的；在 CPU 上它在 Triton 解释器里运行。

# %%
import torch.nn.functional as F

from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.fused_decode import FusedDecodeLayer, SmallMatmulLaunch, small_matmul
from nanovllm.models.qwen3 import Qwen3DecoderLayer
from types import SimpleNamespace

torch.manual_seed(0)
x, residual = torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE)
norm_weight, weight = torch.rand(64, device=DEVICE) + 0.5, torch.randn(96, 64, device=DEVICE) / 8
bias = torch.randn(96, device=DEVICE)
normed, added = rms_norm(x, residual, norm_weight, 1e-6)
out, new_residual = small_matmul(x, weight, bias, residual=residual, norm_weight=norm_weight, eps=1e-6)
torch.testing.assert_close(out, F.linear(normed, weight, bias), rtol=1e-5, atol=1e-5)
assert torch.equal(new_residual, added)
activated, _ = small_matmul(x, weight, norm_weight=norm_weight, eps=1e-6, glu=True)
torch.testing.assert_close(activated, silu_and_mul(F.linear(rms_norm(x, None, norm_weight, 1e-6), weight)),
                           rtol=1e-5, atol=1e-5)
# en: Split-K: two programs per column block, each over half of the input, add up to the same result.
# zh: split-K：每个列块由两个程序分担，各算一半输入，加起来是同样的结果。
split_out, _ = small_matmul(x, weight, bias, launch=SmallMatmulLaunch(block_k=32, split=2))
torch.testing.assert_close(split_out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)

shapes = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, hidden_act="silu", rms_norm_eps=1e-6)
layer = Qwen3DecoderLayer(shapes, RotaryEmbedding(16, 16, 64, 10000.0),
                          {"qkv_bias": True, "o_bias": False, "qk_norm": True, "mlp_bias": False}).to(DEVICE)
for parameter in layer.parameters():
    parameter.data.uniform_(-0.3, 0.3) if parameter.dim() > 1 else parameter.data.uniform_(0.5, 1.5)
positions = torch.tensor([0, 1, 2], device=DEVICE)
# en: One sequence of 3 tokens, no KV cache.
# zh: 一个 3 个 token 的序列，没有 KV 缓存。
set_prefill_context([3], [3], device=DEVICE)
expected = layer(positions, x, residual)
torch.testing.assert_close(FusedDecodeLayer(3)(layer, positions, x, residual), expected, rtol=1e-5, atol=1e-5)
# en: Through the decoder layer's hook, as the engine calls it: the engine's layer takes steps of up to four tokens.
# zh: 经由解码层的钩子调用，与引擎的调用方式相同：引擎交给各层的融合层只接手不超过四个 token 的步。
layer.fused_forward = FusedDecodeLayer()
assert layer.fused_forward.applies(x[:1]) and layer.fused_forward.applies(x)
assert not layer.fused_forward.applies(torch.cat([x, x]))
set_prefill_context([1], [1], device=DEVICE)
one_token = (positions[:1], x[:1], residual[:1])
fused_one = layer(*one_token)
layer.fused_forward = None
torch.testing.assert_close(fused_one, layer(*one_token), rtol=1e-5, atol=1e-5)
reset_context()
print(say("a decoder layer in four matmul kernels == chapter 06's layer (3 tokens, then 1, float32)"))

# %% [markdown] tags=["en"]
# ## Wire it in: the runner hands the layers their fused path
#
# Chapter 14's `compile_ahead` leaves a hook, `fuse_layers`, between compiling the small ops and
# the warm-ups that precede the graph capture. Here it is filled: with the setting `fused_decode`
# (`"auto"`: on for CUDA) every decoder layer gets a `FusedDecodeLayer` for steps of up to four
# tokens. It runs before the warm-ups and the capture, so the graphs record the fused kernels.
# Triton is imported only when the setting is on, so that an engine on a CPU never imports it.

# %% [markdown] tags=["zh"]
# ## 接进去：执行器把融合路径交给各层
#
# 第 14 章的 `compile_ahead` 在编译小算子和图捕获之前的各项预热之间留了一个钩子 `fuse_layers`。这里把它填上：打开配置项
# `fused_decode` 时（`"auto"`：CUDA 上打开），每个解码层都得到一个只接手不超过四个 token 的步的 `FusedDecodeLayer`。
# 它在预热和捕获之前运行，所以图里录下的是融合后的内核。只有打开这个配置项时才导入 Triton，CPU 上的引擎从不导入它。

# %% setting: fused decode
#| export config
import os

from nanovllm.book.literate import add_fields, add_to_init
from nanovllm.config import Config


# en: Decode steps of up to four tokens run each decoder layer in fused Triton kernels: True, False, or "auto": on
# en: for CUDA, where they beat cuBLAS (on a CPU only the Triton interpreter can run them, which is for tests).
# zh: 不超过四个 token 的 decode 步，每个解码层用融合的 Triton 内核：True、False，或 "auto"：CUDA 上打开，那里它们跑赢
# zh: cuBLAS（在 CPU 上只有 Triton 解释器能运行它们，那是给测试用的）。
@add_fields(Config)
class _FusedDecode:
    fused_decode: bool | str = "auto"


@add_to_init(Config)
def _resolve_fused_decode(self) -> None:
    fused = self._resolve_switch("fused_decode", self.device == "cuda")
    if fused and self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("fused_decode=True on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                         "triton is first imported (slow; meant for tests), or leave fused_decode='auto'")

# %% runner fuses the layers
#| export engine.model_runner
from nanovllm.book.literate import add_to_class
from nanovllm.engine.model_runner import ModelRunner


@add_to_class(ModelRunner)
def fuse_layers(self) -> None:
    """With ``fused_decode``, hand every decoder layer its fused path for steps of up to four tokens."""
    # zh: 开启 ``fused_decode`` 时，把用于至多四个 token 的步的融合路径交给每个解码器层。
    if self.config.fused_decode:
        # en: Triton: imported only when asked, so that a CPU engine never imports it (and a chapter that sets
        # en: TRITON_INTERPRET=1 does so before Triton's first import).
        # zh: Triton 只在需要时才导入：CPU 上的引擎从不导入它（设置 TRITON_INTERPRET=1 的章节也能在 Triton 第一次
        # zh: 导入之前设置好）。
        from nanovllm.layers.fused_decode import fuse_decode_layers

        fuse_decode_layers(self.model)

# %%
from torch import nn

# en: Two decoder layers of the shapes above stand for a model; the runner's hook is called on a stand-in runner
# en: that has only what the hook reads (its settings and its model), with the setting off, then on.
# zh: 用上面那种形状的两个解码层代表一个模型；执行器的钩子在一个替身上调用，替身只有钩子要读的东西（配置和模型），
# zh: 先关闭配置项，再打开。
model = nn.ModuleList(Qwen3DecoderLayer(shapes, RotaryEmbedding(16, 16, 64, 10000.0), {
    "qkv_bias": True, "o_bias": False, "qk_norm": True, "mlp_bias": False}) for _ in range(2))
for setting in (False, True):
    ModelRunner.fuse_layers(SimpleNamespace(config=SimpleNamespace(fused_decode=setting), model=model))
    fused = sum(layer.fused_forward is not None for layer in model)
    print(say("fused_decode={setting}: {count} decoder layers take the fused path", setting=setting, count=fused))
    assert fused == (2 if setting else 0)

# %% [markdown] tags=["en"]
# ## What it measured: the GEMV and its early start
#
# Recorded on an H200 (2026-12-03, copy rate 4.22 TB/s) with
# `PYTHONPATH=$PWD python3 scripts/probes/decode_matmul_chain.py`: the 112 matmuls of a Qwen3-0.6B decode
# step (881 MB of bf16 weights, far beyond the 50 MB L2 cache), chained as the step chains them,
# replayed in one CUDA graph. cuBLAS computes the matmuls alone; the fused kernels also do the
# norms and SiLU × mul. The bound is the weights read once at the copy rate: 209 µs.
#
# | one token | µs | of the bound |
# |---|---:|---:|
# | cuBLAS (`F.linear`, matmuls only) | 873 | 24 % |
# | GEMV, 8 / 4 columns a program, early start (PDL), as shipped | 332 | 63 % |
# | the same GEMV without PDL | 569 | 37 % |
# | GEMV, 8 / 8 columns a program, PDL | 372 | 56 % |
# | GEMV, 16 / 4 columns a program, PDL | 368 | 57 % |
#
# With several tokens (recorded later the same day, same script; µs, the GEMV taking every row):
#
# | tokens | cuBLAS | GEMV | tile kernel |
# |---:|---:|---:|---:|
# | 2 | 858 | 452 | 1,284 |
# | 4 | 772 | 807 | 1,293 |
# | 8 | 688 | 1,582 | 1,304 |
# | 16 | 703 | 3,212 | 1,303 |
#
# The GEMV reads the weights once for all rows, but each row is one more pass of multiply-adds
# over the slice it holds: at 2 rows it still takes half of cuBLAS's time, from 4 on the arithmetic
# sets its pace, so at first it took at most two rows (the end of this chapter tells what let it
# take four). The tile kernel walks the input 128 elements at a time and keeps too few bytes in
# flight, so longer steps stay with cuBLAS.
#
# Then a sweep on an H100 changed the tile kernel (2026-12-05, copy rate 3.01 TB/s,
# `PYTHONPATH=$PWD python3 scripts/probes/splitk_sweep.py`: the same loop without the norm, each weight
# shape timed alone over its 28 layers, 42–48 launches each, at 1, 4, 8 and 16 rows). Tiles of 32
# columns, five loads in flight and split-K for the narrow weights were best at every row count,
# so `choose_launch` now gives those. Per 28 matmuls at 4 rows, µs:
#
# | weight | cuBLAS | tile kernel, best launch | best without split-K |
# |---|---:|---:|---:|
# | q/k/v (4096 × 1024) | 163 | 179 (split 2) | 182 |
# | `o_proj` (1024 × 2048) | 167 | 148 (split 4) | 205 |
# | gate/up (6144 × 1024) | 203 | 218 (split 2) | 220 |
# | `down_proj` (1024 × 3072) | 219 | 165 (split 4) | 255 |
#
# (The sweep times gate/up as a plain matmul; fused with SiLU × mul it cannot split, and takes
# 32-column blocks of gate and of up.) The whole chain with its norms and SiLU × mul went from 1,272
# to 1,007 µs at 4 rows (1,297 to 1,033 at 16), against 737–750 for cuBLAS's matmuls alone. So the
# tile kernel still loses. Its kernels, like cuBLAS's, average 40–55 % of the copy rate over their
# 2–8 MB: a kernel that short pays for its boundary (the launch, the first loads' latency, the tail
# of the kernel before, a few µs in all) about as much as for its reading. Letting the next kernel
# launch early (PDL) does not help a tile kernel that must wait before it loads anything: 1,083
# instead of 1,007 µs, and 2,152 instead of 1,272 with the old launches. The GEMV escapes the
# boundary because it loads its whole weight slice before it waits; a tile kernel would have to do
# the same with a tile of the weight in registers.
#
# The whole engine, when the GEMV took one token only, with `python -m nanovllm.bench --latency
# --fused-decode both` (chapter 19: prompts of 512 tokens, 1,024 generated, CUDA graphs, async
# scheduling, both settings in one invocation):
#
# | batch | ms per step, unfused | kernels | ms per step, fused | kernels | bound | of the bound |
# |---:|---:|---:|---:|---:|---:|---:|
# | 1 | 1.389 | 321 | 1.065 | 208 | 0.310 ms | 22.3 % → 29.1 % |
# | 4 | 1.467 | 322 | 1.466 | 321 | 0.394 ms | 26.8 % |
# | 16 | 1.779 | 322 | 1.781 | 321 | 0.729 ms | 40.9 % |
# | 64 | 3.311 | 294 | 3.313 | 293 | 2.068 ms | 62.4 % |
#
# A step of one sequence is 1.30× as fast; larger batches are unchanged (their steps are not
# fused). The rest of the one-token step is now the kernels around the matmuls: attention's two
# kernels (146 + 68 µs for some 117 MB of cached K/V, seven times their bound), the LM head (73 µs
# for 311 MB, at the bound already), the fused q/k/v kernel (47 µs), and at least 0.1 ms a step
# in which no kernel runs. The profiler's sum for the GEMVs (620 µs) overstates them: a
# kernel that starts early is timed from its start, while it still waits for the one before.

# %% [markdown] tags=["zh"]
# ## 测量结果：GEMV 和它的提前启动
#
# 2026-12-03 在 H200 上（拷贝速率 4.22 TB/s）用 `PYTHONPATH=$PWD python3 scripts/probes/decode_matmul_chain.py` 记录：
# Qwen3-0.6B 一个 decode 步的 112 个矩阵乘（881 MB 的 bf16 权重，远大于 50 MB 的 L2 缓存），像一步里那样首尾相接，
# 在一个 CUDA graph 里重放。cuBLAS 只算矩阵乘；融合内核还要做归一化和 SiLU × mul。上限是按拷贝速率把权重读一遍：
# 209 µs。
#
# | 一个 token | µs | 占上限 |
# |---|---:|---:|
# | cuBLAS（`F.linear`，只算矩阵乘） | 873 | 24 % |
# | GEMV，每个程序 8 / 4 列，提前启动（PDL），即现在的实现 | 332 | 63 % |
# | 同一个 GEMV，不用 PDL | 569 | 37 % |
# | GEMV，每个程序 8 / 8 列，PDL | 372 | 56 % |
# | GEMV，每个程序 16 / 4 列，PDL | 368 | 57 % |
#
# 多个 token 时（同一天稍晚用同一脚本记录；单位 µs，GEMV 接手每一行）：
#
# | token 数 | cuBLAS | GEMV | tile 内核 |
# |---:|---:|---:|---:|
# | 2 | 858 | 452 | 1,284 |
# | 4 | 772 | 807 | 1,293 |
# | 8 | 688 | 1,582 | 1,304 |
# | 16 | 703 | 3,212 | 1,303 |
#
# GEMV 为所有行只读一遍权重，但每多一行，就要对手里那段权重多做一遍乘加：2 行时它仍只用 cuBLAS 一半的时间，从 4 行起
# 决定速度的是算术，所以它起初最多接手两行（本章最后会讲到是什么让它能接手四行）。tile 内核每次只沿输入走
# 128 个元素，同时在途的字节太少，所以更长的步仍交给 cuBLAS。
#
# 后来在一块 H100 上做的一次扫描改变了 tile 内核（2026-12-05，拷贝速率 3.01 TB/s，
# `PYTHONPATH=$PWD python3 scripts/probes/splitk_sweep.py`：同样的循环，只是不带归一化；每种权重形状单独计时，
# 各跑它的 28 层，每种形状 42–48 种启动方式，行数取 1、4、8、16）。在每种行数下最好的都是：每块 32 列、
# 五批读取同时在途、窄权重用 split-K，所以 `choose_launch` 现在给出的就是这些。4 行时每 28 个矩阵乘的用时（µs）：
#
# | 权重 | cuBLAS | tile 内核，最佳启动方式 | 不用 split-K 的最佳 |
# |---|---:|---:|---:|
# | q/k/v（4096 × 1024） | 163 | 179（分 2 段） | 182 |
# | `o_proj`（1024 × 2048） | 167 | 148（分 4 段） | 205 |
# | gate/up（6144 × 1024） | 203 | 218（分 2 段） | 220 |
# | `down_proj`（1024 × 3072） | 219 | 165（分 4 段） | 255 |
#
# （扫描把 gate/up 当作普通矩阵乘来计时；与 SiLU × mul 融合后它不能分段，每个程序取 gate 和 up 各 32 列。）
# 带上归一化和 SiLU × mul 的整条链，4 行时从 1,272 µs 降到 1,007 µs（16 行时从 1,297 降到 1,033），而 cuBLAS 只算
# 矩阵乘就是 737–750 µs。所以 tile 内核还是输。它的内核和 cuBLAS 的一样，读自己那 2–8 MB 时平均只达到拷贝速率的
# 40–55 %：这么短的内核，为边界付出的代价（启动、第一批读取的延迟、前一个内核的尾巴，加起来几 µs）和读数据差不多。
# 让下一个内核提前启动（PDL）帮不了必须先
# 等待、才能读任何东西的 tile 内核：1,083 µs 而不是 1,007 µs；用旧的启动方式时是 2,152 而不是 1,272。GEMV 躲开了
# 这个边界，因为它在等待之前就读入了自己的整段权重；tile 内核要做到这一点，就得把一块权重也放进寄存器。
#
# GEMV 还只接手一个 token 时，整个引擎用 `python -m nanovllm.bench --latency
# --fused-decode both` 测量（第 19 章：提示词 512 个 token，生成 1,024 个，使用 CUDA graph 和异步调度，两种设置在
# 同一次调用中测量）：
#
# | 批大小 | 不融合：每步 ms | 内核数 | 融合：每步 ms | 内核数 | 上限 | 占上限 |
# |---:|---:|---:|---:|---:|---:|---:|
# | 1 | 1.389 | 321 | 1.065 | 208 | 0.310 ms | 22.3 % → 29.1 % |
# | 4 | 1.467 | 322 | 1.466 | 321 | 0.394 ms | 26.8 % |
# | 16 | 1.779 | 322 | 1.781 | 321 | 0.729 ms | 40.9 % |
# | 64 | 3.311 | 294 | 3.313 | 293 | 2.068 ms | 62.4 % |
#
# 单个序列的一步快了 1.30 倍；更大的批次不变（它们的步没有融合）。现在单 token 一步剩下的时间，在矩阵乘周围的那些
# 内核里：注意力的两个内核（146 + 68 µs，读约 117 MB 缓存的 K/V，是其上限的七倍），LM head（311 MB 用 73 µs，
# 已经到了上限），融合的 q/k/v 内核（47 µs），以及每步至少 0.1 ms 没有任何内核在跑的时间。性能分析器给 GEMV
# 算出的总和（620 µs）偏大：提前启动的内核从它开始时就计时，而那时它还在等前一个内核。

# %%
from nanovllm.book.recorded import recorded

# en: The runs this chapter records (notebooks/data/recorded/15_fused_decode.json): card, date, command, figures.
# zh: 本章记录的各次运行（notebooks/data/recorded/15_fused_decode.json）：卡、日期、命令、数字。
runs = recorded("15_fused_decode")
chain, sweep, fused_h200 = runs["matmul_chain"], runs["splitk_sweep"], runs["latency_fused"]
for run in (chain, sweep, fused_h200):
    print(say("{card}, {date}: `{command}`", card=run.card, date=run.date, command=run.command))
bound_us = chain.figures["bound_us"]
# en: One token: cuBLAS, the GEMV as shipped (8 / 4 columns a program, PDL), without PDL, and two other widths.
# zh: 一个 token：cuBLAS、现在的 GEMV（每个程序 8 / 4 列，PDL）、不用 PDL 的 GEMV，以及另外两种宽度。
ONE_TOKEN = ("cuBLAS", "GEMV, 8 / 4 columns, PDL", "GEMV, 8 / 4 columns, no PDL", "GEMV, 8 / 8 columns, PDL",
             "GEMV, 16 / 4 columns, PDL")
assert tuple(chain.figures["one_token_us"]) == ONE_TOKEN
for name, us in chain.figures["one_token_us"].items():
    print(say("one token, {name}: {us} µs, {share:.0%} of the bound", name=say(name), us=us, share=bound_us / us))
for tokens, times in chain.figures["tokens_us"].items():
    print(say("{tokens:>2} tokens: cuBLAS {cublas} µs, GEMV {gemv} µs, tile kernel {tile} µs", tokens=int(tokens),
              cublas=times["cuBLAS"], gemv=times["GEMV"], tile=times["tile kernel"]))
# en: The bound is 881 MB read once at 4.22 TB/s, and a 4 MB weight (o_proj's 1024 x 2048 in bf16) takes a microsecond.
# zh: 上限就是按 4.22 TB/s 把 881 MB 读一遍；一个 4 MB 的权重（bf16 的 o_proj，1024 x 2048）要一微秒。
copy_per_us = chain.figures["copy_tb_per_s"] * 1e6
assert round(chain.figures["weights_mb"] * 1e6 / copy_per_us) == bound_us == 209
assert round(1024 * 2048 * 2 / copy_per_us) == 1
assert [round(100 * bound_us / us) for us in chain.figures["one_token_us"].values()] == [24, 63, 37, 56, 57]
# en: The GEMV beats cuBLAS at one and two tokens only; the tile kernel never does.
# zh: GEMV 只在一个和两个 token 时胜过 cuBLAS；tile 内核从来没有。
assert [int(t) for t, times in chain.figures["tokens_us"].items() if times["GEMV"] < times["cuBLAS"]] == [2]
assert all(times["tile kernel"] > times["cuBLAS"] for times in chain.figures["tokens_us"].values())
for weight, times in sweep.figures["four_rows_us"].items():
    print(say("{weight} at 4 rows (H100): cuBLAS {cublas} µs, tile kernel {tile} µs (split {split}), "
              "without split-K {plain} µs", weight=weight, cublas=times["cuBLAS"], tile=times["tile kernel"],
              split=times["tile kernel split"], plain=times["without split-K"]))
# en: Split-K wins where a weight is narrow (o_proj, down_proj: split 4); the whole chain still loses to cuBLAS, and
# en: an early start slows the tile kernel down.
# zh: 权重窄的地方（o_proj、down_proj：分 4 段）split-K 占优；整条链仍然输给 cuBLAS，提前启动反而让 tile 内核更慢。
four_rows = sweep.figures["four_rows_us"]
split_wins = [w for w, t in four_rows.items() if t["tile kernel"] < min(t["cuBLAS"], t["without split-K"])]
assert split_wins == ["o_proj", "down_proj"]
chain_us, with_pdl = sweep.figures["chain_us"], sweep.figures["chain_us_with_pdl"]
assert min(row["new launches"] for row in chain_us.values()) > max(sweep.figures["cublas_chain_us"])
assert all(with_pdl[launches] > chain_us["4"][launches] for launches in ("new launches", "old launches"))
for batch, row in fused_h200.figures["steps"].items():
    print(say("batch {batch:>2} ({card}): {unfused:.3f} -> {fused:.3f} ms a step, {before} -> {after} kernels, "
              "{share:.1%} of the bound", batch=int(batch), card="H200", unfused=row["unfused_ms"],
              fused=row["fused_ms"], before=row["unfused_kernels"], after=row["fused_kernels"], share=row["of_bound"]))
    # en: the share the benchmark printed, from its unrounded times
    # zh: 基准测试打印的占比，由未舍入的时间算出
    assert abs(row["bound_ms"] / row["fused_ms"] - row["of_bound"]) < 0.001
# en: One token: 1.30x as fast, 22.3 % -> 29.1 % of the bound; the larger batches unchanged.
# zh: 一个 token：快 1.30 倍，从上限的 22.3 % 到 29.1 %；更大的批次不变。
one = fused_h200.figures["steps"]["1"]
assert round(one["unfused_ms"] / one["fused_ms"], 2) == 1.30
shares = [round(100 * one["bound_ms"] / one[f"{kind}_ms"], 1) for kind in ("unfused", "fused")]
assert shares == [22.3, 29.1]
assert all(abs(row["fused_ms"] - row["unfused_ms"]) < 0.01 for batch, row in fused_h200.figures["steps"].items()
           if batch != "1")

# %% [markdown] tags=["en"]
# ## The timeline: one layer, then the wait for the host
#
# The same benchmark keeps, in its JSON, the kernels around the middle step boundary of its
# profiled window (`boundary_timeline`: from the last layer's `norm_rotate_store_kernel` to the
# next step's first one), each box from the kernel's start to its end on the GPU's clock.
# Recorded on the H200 with `python -m nanovllm.bench --latency --fused-decode both --batches 1`;
# blue boxes are matmuls, orange attention, grey the small work between them.
#
# The first picture is the last layer of a step. Unfused, it is nine kernels in 35.2 µs: the
# cuBLAS matmuls (`o_proj` alone takes 10.2 µs for its 4 MB), most followed by a compiled add +
# RMSNorm or SiLU × mul, and between every two a gap of about 0.1 µs plus the time the next one
# takes to get going. Fused, the layer is six kernels in 20.3 µs, and the three GEMVs overlap:
# `gate_up_proj` starts 0.9 µs after `o_proj`, while `o_proj` is still running, and spends its
# first microseconds loading its weights.
#
# The second picture is the whole boundary, and it shows what the fused layer cannot fix. After
# the LM head (75 µs, at its bound) and the sampler, the GPU runs a few small kernels of the next
# step's inputs and then nothing for about 0.3 ms: it waits for the host to launch the next step.
# In this invocation the host spent 1.02 ms (unfused) and 1.10 ms (fused) launching each step,
# longer than the GPU needs for it, so the step took 1.319 and 1.176 ms: 1.12× where the first
# invocation, on another machine of the same kind, measured 1.30×. At batch 1 the host is now the
# wall; making the Python step cheaper is the next lever.

# %% [markdown] tags=["zh"]
# ## 时间线：一层，然后是等主机
#
# 同一个基准测试还会在它的 JSON 里保存分析窗口中间那个步边界前后的内核（`boundary_timeline`：从最后一层的
# `norm_rotate_store_kernel` 到下一步第一层的那一个），每个方框按 GPU 的时钟从内核开始画到结束。下面的数据是在
# H200 上用 `python -m nanovllm.bench --latency --fused-decode both --batches 1` 记录的；蓝色方框是矩阵乘，橙色是
# 注意力，灰色是它们之间的小活。
#
# 第一幅图是一步中的最后一层。不融合时它是九个内核，共 35.2 µs：cuBLAS 的矩阵乘（光是 `o_proj` 读它 4 MB 的权重
# 就用了 10.2 µs），多数后面跟一个编译好的残差相加 + RMSNorm 或 SiLU × mul；每两个之间有约 0.1 µs 的空隙，再加上
# 下一个内核启动起来所需的时间。融合之后这一层是六个内核，共 20.3 µs，而且三个 GEMV 是重叠的：`gate_up_proj`
# 在 `o_proj` 开始 0.9 µs 后就开始了，那时 `o_proj` 还在跑，它最初的几微秒用来读入自己的权重。
#
# 第二幅图是整个步边界，它显示了融合层解决不了的问题。LM head（75 µs，已经到了上限）和采样器之后，GPU 先跑了几个
# 为下一步准备输入的小内核，然后大约 0.3 ms 什么也不做：它在等主机启动下一步。这一次调用里，主机启动每一步花了
# 1.02 ms（不融合）和 1.10 ms（融合），比 GPU 算这一步还久，所以一步用了 1.319 和 1.176 ms：快了 1.12 倍，而第一次
# 调用（在另一台同型号的机器上）测得 1.30 倍。批大小为 1 时，主机现在成了瓶颈；下一步要做的是让 Python 的一步更便宜。

# %%
from html import escape
from itertools import pairwise

from IPython.display import SVG, display

# en: Recorded on the H200 by the command above (the run "timeline"): (kernel, start µs, end µs), names cut short.
# zh: 在 H200 上用上面的命令记录（运行 "timeline"）：（kernel，开始 µs，结束 µs），名字截短了。
timeline = runs["timeline"]
print(say("{card}, {date}: `{command}`", card=timeline.card, date=timeline.date, command=timeline.command))
BOUNDARY = {name: [tuple(kernel) for kernel in kernels]
            for name, kernels in timeline.figures["boundary_timeline"].items()}
KIND_COLORS = {"matmul": "#1f77b4", "attention": "#ff7f0e", "other": "#9e9e9e"}


def kernel_kind(name: str) -> str:
    """What a kernel of a decode step does, from its name: a matmul, attention, or the small work between."""
    # zh: 由名字判断 decode 步中一个内核做什么：矩阵乘法、注意力，或者两者之间的零碎工作。
    if name.startswith(("nvjet", "gemv_kernel", "small_matmul")):
        return "matmul"
    return "attention" if name.startswith(("decode_attention", "decode_reduce")) else "other"


def timeline_svg(lanes: dict[str, list[tuple[str, float, float]]], title: str, until: float, tick: int,
                 width: int = 720) -> str:
    """Kernels as boxes on one time axis from 0 to ``until`` µs, a lane per timeline: a gap is time in which the
    GPU ran nothing of the step, and kernels that ran at the same time get rows of their own in the lane."""
    # zh: 把内核画成一条从 0 到 ``until`` µs 的时间轴上的方框，每条时间线一道：空隙是 GPU 没有运行这一步任何
    # zh: 东西的时间，同时运行的内核在这一道里各占一行。
    left, right, top, row_height = 90, 20, 34, 14

    def rows_of(kernels: list[tuple[str, float, float]]) -> list[int]:
        # en: The end of the last kernel placed in each row: a kernel takes the first row already free.
        # zh: 每一行最后放入的那个 kernel 的结束时间：一个 kernel 放进第一个已经空出来的行。
        ends: list[float] = []
        rows = []
        for _, start, end in kernels:
            row = next((r for r, last in enumerate(ends) if last <= start), len(ends))
            ends[row:row + 1] = [end]
            rows.append(row)
        return rows

    placed = {label: rows_of(kernels) for label, kernels in lanes.items()}
    heights = {label: (max(rows) + 1) * row_height + 10 for label, rows in placed.items()}
    scale = (width - left - right) / until
    axis = top + sum(heights.values()) + 6
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{axis + 40}" font-family="sans-serif"'
             f' font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="18" font-size="13">{title}</text>']
    for t in range(0, int(until) + 1, tick):
        x = left + t * scale
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{axis}" stroke="#eee"/>'
                     f'<text x="{x:.1f}" y="{axis + 14}" text-anchor="middle">{t}</text>')
    parts.append(f'<text x="{width - right}" y="{axis + 30}" text-anchor="end">µs</text>')
    y = top
    for label, kernels in lanes.items():
        parts.append(f'<text x="{left - 8}" y="{y + row_height / 2 + 8:.1f}" text-anchor="end">{label}</text>')
        for (name, start, end), row in zip(kernels, placed[label], strict=True):
            if start >= until:
                continue
            parts.append(f'<rect x="{left + start * scale:.1f}" y="{y + 5 + row * row_height:.1f}" '
                         f'width="{max((min(end, until) - start) * scale, 1.0):.1f}" height="{row_height - 2}" '
                         f'fill="{KIND_COLORS[kernel_kind(name)]}" stroke="white" stroke-width="0.6">'
                         f'<title>{escape(name)}: {end - start:.2f} µs</title></rect>')
        y += heights[label]
    return "".join(parts) + "</svg>"


lanes = {say("unfused"): BOUNDARY["unfused"], say("fused"): BOUNDARY["fused"]}
display(SVG(timeline_svg(lanes, say("the last layer of a step, batch 1 (H200)"), until=45, tick=5)))
display(SVG(timeline_svg(lanes, say("across a step boundary, batch 1 (H200)"), until=520, tick=50)))


def last_layer(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The last layer's kernels: those before the LM head (the widest matmul, 384 columns), less the model's final
    norm and a copy."""
    # zh: 最后一层的内核：LM head（最宽的矩阵乘法，384 列）之前的那些，去掉模型最后的归一化和一次拷贝。
    head = next(k for k, (name, _, _) in enumerate(kernels) if "384x8" in name)
    return [kernel for kernel in kernels[:head] if not kernel[0].startswith("memcpy")][:-1]


unfused_layer, fused_layer = last_layer(BOUNDARY["unfused"]), last_layer(BOUNDARY["fused"])
gemvs = [kernel for kernel in fused_layer if kernel[0] == "gemv_kernel"]
# en: Nine kernels become six; each GEMV starts before the one ahead of it ends (the early start).
# zh: 九个 kernel 变成六个；每个 GEMV 都在前一个结束之前开始（提前启动）。
assert (len(unfused_layer), len(fused_layer), len(gemvs)) == (9, 6, 3)
assert all(after[1] < before[2] for before, after in pairwise(gemvs))
gaps = {name: max(b[1] - a[2] for a, b in pairwise(kernels)) for name, kernels in BOUNDARY.items()}
# en: And in both, the longest stretch without a kernel is the wait for the host's next launch.
# zh: 两者中最长的一段没有 kernel 的时间，都是在等主机启动下一步。
assert min(gaps.values()) > 200
print(say("last layer: {unfused:.1f} -> {fused:.1f} µs, {before} -> {after} kernels; GPU idle before the next "
          "step: {idle_unfused:.0f} and {idle_fused:.0f} µs", unfused=unfused_layer[-1][2], fused=fused_layer[-1][2],
          before=len(unfused_layer), after=len(fused_layer), idle_unfused=gaps["unfused"], idle_fused=gaps["fused"]))
# en: The text's figures: the last layer 35.2 µs unfused (o_proj 10.2 µs), 20.3 µs fused, gate_up_proj starting 0.9 µs
# en: after o_proj; the steps of this invocation 1.319 and 1.176 ms, 1.12x.
# zh: 正文里的数字：不融合时最后一层 35.2 µs（o_proj 10.2 µs），融合后 20.3 µs，gate_up_proj 在 o_proj 开始 0.9 µs 后
# zh: 开始；这次调用里每步 1.319 和 1.176 ms，快 1.12 倍。
o_proj = unfused_layer[3]
assert (round(unfused_layer[-1][2], 1), round(o_proj[2] - o_proj[1], 1)) == (35.2, 10.2)
assert round(fused_layer[-1][2], 1) == 20.3
assert round(gemvs[1][1] - gemvs[0][1], 1) == 0.9
step_ms = timeline.figures["step_ms"]
assert round(step_ms["unfused"] / step_ms["fused"], 2) == 1.12

# %% [markdown] tags=["en"]
# ## Attention starts early too, and the host stays the wall
#
# The GPU's part of a step can be measured without the host: `python -m nanovllm.bench --latency`
# also replays the decode graph of each batch fifty times back to back ("graph alone"). Recorded
# on the H200 (2026-12-03, `--batches 1 2 4 16 --output-len 512`, before and after in one call,
# twice), after chapter 18's one-copy step had already cut the host's work: the decode kernels of
# a few sequences now take 32-key tiles and start early (chapter 11), and so does the q/k/v
# kernel in steps of one or two tokens.
#
# | batch | graph alone, before | after | bound | wall per step, after | host launch, after |
# |---:|---:|---:|---:|---:|---:|
# | 1 | 0.656 ms | 0.581 ms | 0.301 ms | 0.686 / 0.918 ms | 0.496 / 0.811 ms |
# | 2 | 0.836 ms | 0.729 ms | 0.322 ms | 0.827 / 0.999 ms | 0.547 / 0.852 ms |
# | 4 | 1.300 ms | 1.268 ms | 0.364 ms | 1.374 / 1.377 ms | 0.776 / 1.148 ms |
#
# At batch 1 the model's part of a step is now 52 % of the bound, but the step as the engine runs
# it took 0.686 ms in one round and 0.918 ms in the next, because the host needed 0.50 ms to
# launch a step in one and 0.81 ms in the other: with asynchronous scheduling a step lasts as long
# as the slower of the two, and on this machine that is the Python that launches it. The LM head
# (75 µs) and the sampler run outside the graph, launched from Python one by one each step; the
# graph alone leaves them out.

# %% [markdown] tags=["zh"]
# ## 注意力也提前启动，而主机仍是瓶颈
#
# 一步里 GPU 的那部分可以撇开主机来测：`python -m nanovllm.bench --latency` 还会把每个批次的 decode graph 背靠背
# 重放五十次（“单独的 graph”）。下面是在 H200 上记录的（2026-12-03，`--batches 1 2 4 16 --output-len 512`，改动前后
# 在同一次调用里各测两轮），那时第 18 章的“一次拷贝”已经削减了主机的工作：少数几个序列的 decode 内核改用 32 键的
# tile 并提前启动（第 11 章），一个或两个 token 的步里 q/k/v 内核也提前启动。
#
# | 批大小 | 单独的 graph，改动前 | 改动后 | 上限 | 改动后每步实际用时 | 改动后主机启动用时 |
# |---:|---:|---:|---:|---:|---:|
# | 1 | 0.656 ms | 0.581 ms | 0.301 ms | 0.686 / 0.918 ms | 0.496 / 0.811 ms |
# | 2 | 0.836 ms | 0.729 ms | 0.322 ms | 0.827 / 0.999 ms | 0.547 / 0.852 ms |
# | 4 | 1.300 ms | 1.268 ms | 0.364 ms | 1.374 / 1.377 ms | 0.776 / 1.148 ms |
#
# 批大小为 1 时，模型那部分现在达到上限的 52 %，可引擎实际跑一步，一轮用了 0.686 ms，下一轮 0.918 ms，因为主机启动
# 一步在前一轮要 0.50 ms，在后一轮要 0.81 ms：异步调度下，一步的长短取决于两者中较慢的那个，而在这台机器上较慢的是
# 启动它的 Python。LM head（75 µs）和采样器在 graph 之外，每一步由 Python 逐个启动；单独的 graph 不包括它们。

# %%
early = runs["early_start"]
print(say("{card}, {date}: `{command}`", card=early.card, date=early.date, command=early.command))
EARLY_START_LINE = ("batch {batch}: graph {before:.3f} -> {after:.3f} ms ({share:.0%} of the bound), "
                    "step {fast:.3f}-{slow:.3f} ms")
# en: batch -> (graph alone before, after, bound, wall per step in the two rounds, ms)
# zh: 批大小 ->（改动前单独的 graph、改动后、上限、两轮的每步实际用时，单位 ms）
EARLY_START = {int(batch): (row["graph_before_ms"], row["graph_after_ms"], row["bound_ms"], tuple(row["wall_ms"]))
               for batch, row in early.figures.items()}
for batch, (before, after, bound, walls) in EARLY_START.items():
    # en: Every batch's graph got faster, and no step ran faster than its graph alone.
    # zh: 每个批次的 graph 都变快了，也没有哪一步比单独的 graph 还快。
    assert after < before and min(walls) > after > bound
    print(say(EARLY_START_LINE, batch=batch, before=before, after=after, share=bound / after,
              fast=min(walls), slow=max(walls)))
# en: At batch 1 the graph alone is 52 % of the bound; the host needed 0.50 and 0.81 ms to launch a step.
# zh: 批大小 1 时，单独的 graph 达到上限的 52 %；主机启动一步要 0.50 ms 和 0.81 ms。
assert round(100 * EARLY_START[1][2] / EARLY_START[1][1]) == 52
assert [round(ms, 2) for ms in early.figures["1"]["host_ms"]] == [0.50, 0.81]

# %% [markdown] tags=["en"]
# ## Where a step stands, and what stands in the way
#
# The latency benchmark again, as the engine runs by default (fused decode, PDL, asynchronous
# scheduling), on the H200 (2026-12-05, copy rate 4.25 TB/s, `python -m nanovllm.bench --latency`):
#
# | batch | ms per step | tok/s | bound | of the bound | kernels | graph alone | host launch |
# |---:|---:|---:|---:|---:|---:|---:|---:|
# | 1 | 0.719 | 1,391 | 0.308 ms | 42.9 % | 203 | 0.630 ms | 0.556 ms |
# | 4 | 1.394 | 2,869 | 0.392 ms | 28.1 % | 315 | 1.303 ms | 0.705 ms |
# | 16 | 1.752 | 9,135 | 0.725 ms | 41.4 % | 315 | 1.627 ms | 1.059 ms |
# | 64 | 3.303 | 19,375 | 2.057 ms | 62.3 % | 287 | 3.215 ms | 1.110 ms |
#
# One sequence went from 22 % of its bound unfused (1.389 ms, the table of 2026-12-03 above) to
# 43 %. Four and sixteen did not move: their steps were not fused, because no
# kernel we had then multiplied 4 to 16 rows faster than cuBLAS (four rows now do: see below). The same day's
# `scripts/probes/prefetch_tile_probe.py` timed the step's 28 layers of matmuls (with their norms and
# SiLU × mul; bound 207 µs) three ways. The third is the GEMV's trick on a tile: split-K so fine
# that a program's whole weight slice is one tile, loaded before the program waits for the
# kernel before it; eight launches were tried, and the best one is shown.
#
# | rows | cuBLAS (matmuls only) | tile kernel (`small_matmul`) | prefetch tile, best launch |
# |---:|---:|---:|---:|
# | 1 | 873 µs | 334 µs (the GEMV) | 564 µs |
# | 4 | 766 µs | 987 µs | 814 µs |
# | 8 | 686 µs | 986 µs | 840 µs |
# | 16 | 700 µs | 990 µs | 782 µs |
#
# Loading early helps a tile (it beats the tile kernel by a fifth) but not enough: from 4 rows on
# cuBLAS stays the fastest, at about 30 % of the copy rate, and those ~0.7 ms of matmuls are most
# of what keeps a step of 16 at 1.75 ms. What is left to try is what the fused engines do: fewer,
# longer kernels (a whole layer, or the whole step, in one persistent kernel that moves from
# matmul to matmul without a boundary), rather than faster short ones.
#
# And why does each row cost the GEMV so much, when it reads its weights only once? Not
# registers: `scripts/probes/gemv_rows_probe.py` (the same H200 and day) gave each program a half, a
# quarter or an eighth of the slice (more programs, fewer registers each), and every row more
# still cost 110–210 µs over the 28 layers; the narrower slices took off a fifth at most, and
# only from 3 rows on. What each row does wait for: its own input from L2, its own norm, and the
# store of the row before it. So the kernel now loads every row's input as one tile after its
# wait, adds and normalizes the rows together, and stores their results together at the end. The
# same probe timed it on an H100 (copy rate 3.02 TB/s, bound 291 µs), against cuBLAS, which took
# about 730 µs at every row count:
#
# | rows | GEMV, row by row | GEMV, rows as one tile | cuBLAS |
# |---:|---:|---:|---:|
# | 1 | 376 µs | 376 µs | 729 µs |
# | 2 | 492 µs | 484 µs | 728 µs |
# | 3 | 683 µs | 589 µs | 731 µs |
# | 4 | 832 µs | 654 µs | 734 µs |
# | 5 | 977 µs | 758 µs | 733 µs |
# | 8 | 1,579 µs | 1,165 µs | 735 µs |
#
# One tile takes a fifth off from 3 rows on and beats cuBLAS up to 4 rows (by 1.12× at 4); at 5 it
# ties, at 8 it loses. So the GEMV now takes steps of up to four tokens (`GEMV_ROWS = 4`), and four
# sequences decode fused. (Storing each row as soon as it is done measured the same; 8 warps were
# slower at every count; narrower slices took another 6 % off at 3 to 5 rows, not yet shipped.)
# The whole engine on the same kind of H100, fused and unfused in one invocation (`python -m
# nanovllm.bench --latency --batches 1 4 16 64 --fused-decode both`, copy rate 3.00 TB/s):
#
# | batch | ms per step, unfused | fused | kernels | of the bound, fused |
# |---:|---:|---:|---:|---:|
# | 1 | 1.270 | 0.803 (1.58×) | 315 → 202 | 54.3 % |
# | 4 | 1.437 | 1.190 (1.21×) | 315 → 202 | 46.5 % |
# | 16 | 2.013 | 2.010 | 315 → 314 | 51.0 % |
# | 64 | 3.975 | 3.973 | 287 → 286 | 73.2 % |
#
# A step of four sequences is now a fifth shorter; sixteen and more are past the GEMV's four rows
# and run as before. The same command on an H200 that evening (copy rate 4.22 TB/s) took batch 4
# from 1.442 to 1.095 ms a step (1.32×) and batch 1 from 1.305 to 0.957 ms; that machine's host
# needed 0.87 ms to launch a step, so at batch 1 the host set the pace (the graph alone took
# 0.628 ms).
#
# Where each kernel has real work, the boundaries matter less. On Qwen3-8B's shapes (36 layers,
# 15.1 GB of weights a step; `python -m nanovllm.bench --latency --preset qwen3-8b --batches 1
# --fused-decode both`, the H200 of the first table, later that day, copy rate 4.24 TB/s) one sequence's step
# took 4.745 ms unfused (439 kernels, 75.9 % of its 3.602 ms bound) and 4.044 ms fused (258
# kernels, 89.1 %): 1.17× in the same invocation, and past the 85 % we aimed for.

# %% [markdown] tags=["zh"]
# ## 一步现在在哪里，挡在前面的是什么
#
# 再跑一次延迟基准测试，引擎用默认设置（融合 decode、PDL、异步调度），在 H200 上（2026-12-05，拷贝速率
# 4.25 TB/s，`python -m nanovllm.bench --latency`）：
#
# | 批大小 | 每步 ms | tok/s | 上限 | 占上限 | 内核数 | 单独的 graph | 主机启动用时 |
# |---:|---:|---:|---:|---:|---:|---:|---:|
# | 1 | 0.719 | 1,391 | 0.308 ms | 42.9 % | 203 | 0.630 ms | 0.556 ms |
# | 4 | 1.394 | 2,869 | 0.392 ms | 28.1 % | 315 | 1.303 ms | 0.705 ms |
# | 16 | 1.752 | 9,135 | 0.725 ms | 41.4 % | 315 | 1.627 ms | 1.059 ms |
# | 64 | 3.303 | 19,375 | 2.057 ms | 62.3 % | 287 | 3.215 ms | 1.110 ms |
#
# 一个序列从不融合时上限的 22 %（1.389 ms，见上文 2026-12-03 的表格）提高到 43 %。四个和十六个序列没有变化：它们的
# 步没有融合，因为我们当时手里没有哪个内核算 4 到 16 行的矩阵乘比 cuBLAS 快（四行现在有了，见下文）。
# 同一天用 `scripts/probes/prefetch_tile_probe.py` 以三种方式给一步的 28 层矩阵乘（连同它们的 norm 和 SiLU × mul；
# 上限 207 µs）计时。第三种是把 GEMV 的办法用到
# tile 上：split-K 切得足够细，一个程序的整段权重正好是一个 tile，在等前一个内核之前就读进来；试了八种启动配置，
# 下表列出最好的那种。
#
# | 行数 | cuBLAS（只算矩阵乘） | tile 内核（`small_matmul`） | 预取 tile，最佳启动配置 |
# |---:|---:|---:|---:|
# | 1 | 873 µs | 334 µs（GEMV） | 564 µs |
# | 4 | 766 µs | 987 µs | 814 µs |
# | 8 | 686 µs | 986 µs | 840 µs |
# | 16 | 700 µs | 990 µs | 782 µs |
#
# 提前读入对 tile 有帮助（比 tile 内核快五分之一），但不够：从 4 行起 cuBLAS 仍然最快，约为拷贝速率的 30 %，而这
# 约 0.7 ms 的矩阵乘正是 16 个序列的一步停在 1.75 ms 的主要原因。剩下值得试的是那些融合引擎的做法：更少、更长的
# 内核（一整层，甚至整个一步，放进一个常驻内核，从一个矩阵乘走到下一个，中间没有内核边界），而不是更快的短内核。
#
# 那么，GEMV 明明只读一次权重，为什么每多一行都这么贵？不是寄存器的问题：`scripts/probes/gemv_rows_probe.py`
# （同一块 H200、同一天）让每个程序只拿一半、四分之一或八分之一的权重段（程序更多，每个用的寄存器更少），
# 每多一行在 28 层上仍然多花 110–210 µs；更窄的权重段最多省下五分之一，而且要从 3 行起才省得下来。每一行真正在等的
# 是：它自己从 L2 读入的输入、它自己的 norm，以及上一行的写回。所以内核现在等待之后把所有行的输入作为一个 tile
# 一次读入，一起加上残差、一起做 norm，最后把所有行的结果一起写回。同一个探针在一块 H100 上给它计了时（拷贝速率
# 3.02 TB/s，上限 291 µs），对照的 cuBLAS 不论几行都约 730 µs：
#
# | 行数 | GEMV，一行一行 | GEMV，所有行作为一个 tile | cuBLAS |
# |---:|---:|---:|---:|
# | 1 | 376 µs | 376 µs | 729 µs |
# | 2 | 492 µs | 484 µs | 728 µs |
# | 3 | 683 µs | 589 µs | 731 µs |
# | 4 | 832 µs | 654 µs | 734 µs |
# | 5 | 977 µs | 758 µs | 733 µs |
# | 8 | 1,579 µs | 1,165 µs | 735 µs |
#
# 作为一个 tile 读入，从 3 行起省下五分之一，不超过 4 行时胜过 cuBLAS（4 行时快 1.12 倍）；5 行打平，8 行落后。所以
# GEMV 现在接手不超过四个 token 的步（`GEMV_ROWS = 4`），四个序列的 decode 也是融合的。（每行算完立即写回，测得一样；
# 8 个 warp 在每种行数下都更慢；更窄的权重段在 3 到 5 行时又省下 6 %，还没有采用。）整个引擎在同一种 H100 上，
# 融合与不融合在同一次调用里（`python -m nanovllm.bench --latency --batches 1 4 16 64 --fused-decode both`，
# 拷贝速率 3.00 TB/s）：
#
# | 批大小 | 每步 ms，不融合 | 融合 | 内核数 | 融合后占上限 |
# |---:|---:|---:|---:|---:|
# | 1 | 1.270 | 0.803（1.58 倍） | 315 → 202 | 54.3 % |
# | 4 | 1.437 | 1.190（1.21 倍） | 315 → 202 | 46.5 % |
# | 16 | 2.013 | 2.010 | 315 → 314 | 51.0 % |
# | 64 | 3.975 | 3.973 | 287 → 286 | 73.2 % |
#
# 四个序列的一步现在短了五分之一；十六个及以上超出了 GEMV 的四行，照旧运行。同一条命令当天晚上在一块 H200 上
# （拷贝速率 4.22 TB/s）把批大小 4 的一步从 1.442 ms 降到 1.095 ms（1.32 倍），批大小 1 从 1.305 ms 降到
# 0.957 ms；那台机器的主机启动一步要 0.87 ms，所以批大小 1 时决定节奏的是主机（单独的 graph 只要 0.628 ms）。
#
# 每个内核都有足够多的活时，内核边界就没那么要紧了。在 Qwen3-8B 的形状上（36 层，一步读 15.1 GB 权重；
# `python -m nanovllm.bench --latency --preset qwen3-8b --batches 1 --fused-decode both`，同一天晚些时候、
# 第一张表的那块 H200，拷贝速率 4.24 TB/s），一个序列的一步不融合时用 4.745 ms（439 个内核，占 3.602 ms 上限的
# 75.9 %），融合后用 4.044 ms（258 个内核，89.1 %）：同一次运行里快 1.17 倍，也超过了我们定下的 85 %。

# %%
# en: The runs of 2026-12-05, on an H200 and an H100: the latency benchmark by default, the probes, the GEMV of four
# en: rows in the engine, and Qwen3-8B's shapes.
# zh: 2026-12-05 在 H200 和 H100 上的各次运行：默认设置下的延迟基准测试、几个探针、引擎里接手四行的 GEMV，以及
# zh: Qwen3-8B 的形状。
import itertools
import statistics

from nanovllm.layers.fused_decode import GEMV_ROWS

names = ("latency_default", "prefetch_tile", "gemv_rows_h200", "gemv_rows_h100", "four_rows_h100", "four_rows_h200",
         "qwen3_8b")
for name in names:
    print(say("{card}, {date}: `{command}`", card=runs[name].card, date=runs[name].date, command=runs[name].command))
default, h200_evening = runs["latency_default"].figures, runs["four_rows_h200"].figures
# en: batch -> (ms per step, bound ms, kernels); rows -> (cuBLAS, small_matmul, best prefetch tile), µs for the
# en: step's 28 layers of matmuls.
# zh: 批大小 ->（每步 ms、上限 ms、kernel 数）；行数 ->（cuBLAS、small_matmul、最佳预取 tile），单位是一步 28 层矩阵乘
# zh: 的 µs。
STEP = {int(batch): (row["ms"], row["bound_ms"], row["kernels"]) for batch, row in default["steps"].items()}
MATMULS = {int(rows): (us["cuBLAS"], us["small_matmul"], us["prefetch tile"])
           for rows, us in runs["prefetch_tile"].figures["rows_us"].items()}
# en: Qwen3-8B's shapes, one sequence: fused and unfused -> (ms per step, bound ms, kernels)
# zh: Qwen3-8B 的形状，一个序列：融合与不融合 ->（每步 ms、上限 ms、kernel 数）
EIGHT_B = {name: (row["ms"], row["bound_ms"], row["kernels"])
           for name, row in runs["qwen3_8b"].figures["steps"].items()}
# en: The GEMV row by row: rows -> (cuBLAS, the GEMV with 16K-element slices, its best narrower slice), µs.
# zh: 一行一行算的 GEMV：行数 ->（cuBLAS、权重段 16K 个元素的 GEMV、更窄权重段里最好的），单位 µs。
GEMV_ROWS_COST = {int(rows): (us["cuBLAS"], us["GEMV"], us["narrower slice"])
                  for rows, us in runs["gemv_rows_h200"].figures["rows_us"].items()}
# en: The GEMV again, on an H100: rows -> (row by row, rows loaded as one tile, cuBLAS), µs.
# zh: 再看 GEMV，在 H100 上：行数 ->（一行一行、所有行作为一个 tile 读入、cuBLAS），单位 µs。
ONE_TILE = {int(rows): (us["row by row"], us["one tile"], us["cuBLAS"])
            for rows, us in runs["gemv_rows_h100"].figures["rows_us"].items()}
# en: And the engine with it (H100): batch -> (ms a step unfused, fused, kernels unfused, fused, bound ms).
# zh: 以及用上它的引擎（H100）：批大小 ->（不融合每步 ms、融合每步 ms、不融合 kernel 数、融合 kernel 数、上限 ms）。
FOUR_ROWS = {int(batch): (row["unfused_ms"], row["fused_ms"], row["unfused_kernels"], row["fused_kernels"],
                          row["bound_ms"]) for batch, row in runs["four_rows_h100"].figures["steps"].items()}
for batch, (step_ms, bound_ms, kernels) in STEP.items():
    print(say("batch {batch:>2}: {step:.3f} ms a step, {share:.0%} of the bound, {kernels} kernels", batch=batch,
              step=step_ms, share=bound_ms / step_ms, kernels=kernels))
for name, (step_ms, bound_ms, kernels) in EIGHT_B.items():
    print(say("Qwen3-8B, batch 1, {name}: {step:.3f} ms a step, {share:.1%} of the bound, {kernels} kernels",
              name=say(name), step=step_ms, share=bound_ms / step_ms, kernels=kernels))
for rows, (cublas, tile, prefetch) in MATMULS.items():
    print(say("{rows:>2} rows: cuBLAS {cublas:.0f} µs, small_matmul {tile:.0f} µs, prefetch tile {prefetch:.0f} µs",
              rows=rows, cublas=cublas, tile=tile, prefetch=prefetch))
# en: One token is fused (fewer kernels) and the GEMV beats cuBLAS; from 4 rows cuBLAS is the fastest chain we have,
# en: and the steps it runs are the unfused ones.
# zh: 一个 token 的步是融合的（kernel 更少），GEMV 胜过 cuBLAS；从 4 行起 cuBLAS 是我们最快的一串矩阵乘，
# zh: 它跑的那些步也没有融合。
assert STEP[1][2] < STEP[4][2] and MATMULS[1][1] < min(MATMULS[1][0], MATMULS[1][2])
assert all(cublas < min(tile, prefetch) for rows, (cublas, tile, prefetch) in MATMULS.items() if rows >= 4)
# en: With 8B's larger matmuls the fused step is past 85 % of its bound.
# zh: 8B 的矩阵乘更大，融合后的一步超过了上限的 85 %。
assert EIGHT_B["fused"][1] / EIGHT_B["fused"][0] > 0.85 > EIGHT_B["unfused"][1] / EIGHT_B["unfused"][0]
# en: Every row more costs the GEMV 110-210 µs, and narrower slices take off a fifth at most.
# zh: GEMV 每多一行都要多花 110–210 µs，更窄的权重段最多省下五分之一。
assert all(110 < (GEMV_ROWS_COST[more][1] - GEMV_ROWS_COST[fewer][1]) / (more - fewer) < 210
           for fewer, more in itertools.pairwise(sorted(GEMV_ROWS_COST)))
assert all(narrow > 0.79 * wide for _, wide, narrow in GEMV_ROWS_COST.values())
for rows, (by_row, one_tile, cublas) in ONE_TILE.items():
    print(say("{rows} rows (H100): row by row {by_row:.0f} µs, as one tile {one_tile:.0f} µs, cuBLAS {cublas:.0f} µs",
              rows=rows, by_row=by_row, one_tile=one_tile, cublas=cublas))
# en: Rows loaded as one tile: never slower than row by row (within 2 %), faster than cuBLAS exactly up to GEMV_ROWS.
# zh: 所有行作为一个 tile 读入：从不比一行一行慢（误差 2 % 以内），恰好在不超过 GEMV_ROWS 行时比 cuBLAS 快。
assert all(one_tile < 1.02 * by_row for by_row, one_tile, _ in ONE_TILE.values())
assert [rows for rows, (_, one_tile, cublas) in ONE_TILE.items() if one_tile < cublas] == list(range(1, GEMV_ROWS + 1))
# en: cuBLAS at about 730 µs whatever the rows; one tile 1.12x as fast as cuBLAS at 4 rows.
# zh: 不论几行，cuBLAS 都约 730 µs；4 行时作为一个 tile 读入比 cuBLAS 快 1.12 倍。
assert round(statistics.mean(cublas for _, _, cublas in ONE_TILE.values()), -1) == 730
assert round(ONE_TILE[4][2] / ONE_TILE[4][1], 2) == 1.12
for batch, (unfused, fused, before, after, bound_ms) in FOUR_ROWS.items():
    print(say("batch {batch:>2} ({card}): {unfused:.3f} -> {fused:.3f} ms a step, {before} -> {after} kernels, "
              "{share:.1%} of the bound", batch=batch, card="H100", unfused=unfused, fused=fused, before=before,
              after=after, share=bound_ms / fused))
# en: The steps of up to GEMV_ROWS sequences are fused (a third fewer kernels) and faster; the longer ones are not.
# zh: 不超过 GEMV_ROWS 个序列的步是融合的（kernel 少三分之一），也更快；更长的步不是。
assert all((after < 0.7 * before and fused < 0.85 * unfused) == (batch <= GEMV_ROWS)
           for batch, (unfused, fused, before, after, _) in FOUR_ROWS.items())
# en: The text's figures: on the H100, 1.58x at batch 1 and 1.21x at 4; on the H200 that evening batch 4 1.32x; on
# en: Qwen3-8B's shapes 75.9 % and 89.1 % of the bound, 1.17x; one sequence by default from 22 % of its bound
# en: (unfused, 2026-12-03) to 43 %.
# zh: 正文里的数字：H100 上批大小 1 快 1.58 倍，批大小 4 快 1.21 倍；当天晚上的 H200 上批大小 4 快 1.32 倍；Qwen3-8B 的
# zh: 形状上分别达到上限的 75.9 % 和 89.1 %，快 1.17 倍；默认设置下一个序列从上限的 22 %（2026-12-03，不融合）到 43 %。
assert [round(FOUR_ROWS[batch][0] / FOUR_ROWS[batch][1], 2) for batch in (1, 4)] == [1.58, 1.21]
evening = h200_evening["steps_ms"]["4"]
assert round(evening["unfused"] / evening["fused"], 2) == 1.32
(unfused_ms, bound_8b, _), (fused_ms, _, _) = EIGHT_B["unfused"], EIGHT_B["fused"]
assert (round(100 * bound_8b / unfused_ms, 1), round(100 * bound_8b / fused_ms, 1)) == (75.9, 89.1)
assert round(unfused_ms / fused_ms, 2) == 1.17
one = fused_h200.figures["steps"]["1"]
assert round(100 * one["bound_ms"] / one["unfused_ms"]) == 22 and round(100 * default["steps"]["1"]["of_bound"]) == 43

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/fused_decode.py`: `small_matmul` (the GEMV for up to four tokens, started
#   early with PDL on Hopper; the tile kernel for up to 16, with split-K where a weight is narrow,
#   `choose_launch`), `FusedDecodeLayer` and `fuse_decode_layers`, with the config switch
#   `fused_decode` (`"auto"`: on for CUDA, steps of up to four tokens).
# - `ModelRunner.fuse_layers`: chapter 14's hook, filled, so that the graphs capture the fused layers.
# - `scripts/probes/decode_matmul_chain.py` times a step's 112 matmuls against cuBLAS;
#   `scripts/probes/splitk_sweep.py` sweeps the tile kernel's launches per weight shape.
#
# Chapter 16 splits the model across GPUs.
#
# ## Exercises
#
# 1. The 112 one-token GEMVs of a step took 569 µs without the early start and 332 µs with it.
#    How much of each kernel boundary did PDL hide? Had every matmul kept its weights' pace with
#    PDL (209 µs for all), what would the boundaries still cost per kernel?
# 2. Qwen3-0.6B's `o_proj` maps 2,048 inputs to 1,024 columns. In tiles of 32 columns, how many
#    column blocks does it have, which split does `choose_launch` pick, how many programs run, and
#    how many inputs does each read?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/fused_decode.py`：`small_matmul`（不超过四个 token 时是 GEMV，在 Hopper 上用 PDL 提前启动；最多
#   16 个 token 时是 tile 内核，权重窄时用 split-K，见 `choose_launch`）、`FusedDecodeLayer` 和 `fuse_decode_layers`，
#   以及配置开关 `fused_decode`（`"auto"`：CUDA 上打开，只接手不超过四个 token 的步）。
# - `ModelRunner.fuse_layers`：填上第 14 章留下的钩子，让图捕获融合后的层。
# - `scripts/probes/decode_matmul_chain.py` 把一步的 112 个矩阵乘与 cuBLAS 对比计时；
#   `scripts/probes/splitk_sweep.py` 按权重形状扫描 tile 内核的启动配置。
#
# 第 16 章把模型切分到多块 GPU 上。
#
# ## 练习
#
# 1. 一步里 112 个单 token 的 GEMV，不提前启动时用了 569 µs，提前启动时 332 µs。PDL 藏住了每个内核边界的多少时间？
#    如果每个矩阵乘都能按读权重的速度跑（全部 209 µs），那么用了 PDL 之后每个内核的边界还剩多少开销？
# 2. Qwen3-0.6B 的 `o_proj` 把 2,048 个输入映射到 1,024 列。按 32 列一个 tile，它有多少个列块？`choose_launch` 选多大的
#    split？一共跑多少个程序？每个程序读多少个输入？

# %%
# en: Exercise 1: (569 - 332) / 112 = 2.1 µs hidden per boundary; (332 - 209) / 112 = 1.1 µs still paid per kernel
# en: (the wait for the input row and the last programs' tail that no early start can hide).
# zh: 练习 1：每个边界藏住了 (569 - 332) / 112 = 2.1 µs；每个内核仍要付 (332 - 209) / 112 = 1.1 µs（等输入行，以及
# zh: 最后几个程序的尾巴，这些提前启动也藏不住）。
hidden_us, left_us = (569 - 332) / 112, (332 - 209) / 112
print(say("PDL hides {hidden:.1f} µs a boundary; {left:.1f} µs a kernel remain", hidden=hidden_us, left=left_us))
assert round(hidden_us, 1) == 2.1 and round(left_us, 1) == 1.1

# en: Exercise 2: 1,024 / 32 = 32 column blocks, too few for 132 SMs; split 4 makes 128 programs, each over
# en: 2,048 / 4 = 512 inputs (split 2 would leave 64 programs; 8 would go past 128 without need).
# zh: 练习 2：1,024 / 32 = 32 个列块，对 132 个 SM 来说太少；split 4 得到 128 个程序，每个读 2,048 / 4 = 512 个输入
# zh: （split 2 只有 64 个程序；8 则没有必要地超过了 128）。
from nanovllm.layers.fused_decode import choose_launch

launch = choose_launch(1024, 2048)
blocks = 1024 // launch.block_n
print(say("o_proj: {blocks} column blocks x split {split} = {programs} programs, {inputs} inputs each",
          blocks=blocks, split=launch.split, programs=blocks * launch.split, inputs=2048 // launch.split))
assert (blocks, launch.split, blocks * launch.split, 2048 // launch.split) == (32, 4, 128, 512)
