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
# # 11 · Paged attention in Triton
#
# **Goal.** The first chapter of the book's second part, *speed*: the core engine of chapters
# 00–10 runs on a GPU through plain torch, and the engine gets faster one chapter at a time from
# here. Write the three attention kernels of the engine in Triton and wrap them as
# `TritonBackend`, the backend that `attention_backend("triton")` builds:
#
# 1. **store**: scatter each new token's K and V into the paged cache through `slot_mapping`
#    (slot `-1` = padding, skipped);
# 2. **prefill**: variable-length causal attention, flash-attention style, that reads a cached
#    prefix (a prefix-cache hit, or the earlier chunks of a chunked prefill) through the block
#    table, with grouped-query attention (GQA);
# 3. **decode**: one query per sequence over its whole paged history, in two flavours, one
#    program per (sequence, KV head), and a **split-K** ("flash-decoding") variant that also cuts
#    the context into pieces and merges them with a small reduction kernel, plus the heuristic
#    that picks between them.
#
# Then the engine is wired to use them: `"auto"` picks these kernels on a GPU, and the runner
# compiles them before its first step.
#
# Every kernel is tested against `TorchBackend`, the reference of chapter 07. On a machine
# without a GPU the kernels run in the **Triton interpreter** (`TRITON_INTERPRET=1`, set before
# `triton` is imported): slow, but exact enough to check every index computation.

# %% [markdown] tags=["zh"]
# # 11 · 用 Triton 写分页注意力
#
# **目标：** 这是本书第二部分“速度”的第一章：第 00–10 章的核心引擎在 GPU 上用的是普通的 torch，从这里开始，引擎一章
# 一章地变快。用 Triton 写出引擎的三个注意力内核，并把它们包装成 `TritonBackend`，也就是
# `attention_backend("triton")` 构建的后端：
#
# 1. **存储**：按 `slot_mapping` 把每个新 token 的 K、V 分散写入分页缓存（槽位 `-1` 是填充，跳过）；
# 2. **prefill**：flash-attention 风格的变长因果注意力，通过块表读取已缓存的前缀（前缀缓存命中，或分块 prefill 中
#    之前的分块），支持分组查询注意力（GQA）；
# 3. **decode**：每个序列一个查询，关注它全部的分页历史。有两种写法：每个（序列，KV 头）一个程序；以及
#    **split-K**（“flash-decoding”）版本，它还把上下文切成几段，再用一个小的归约内核合并。另有一个启发式
#    规则在两者之间选择。
#
# 然后让引擎用上它们：在 GPU 上 `"auto"` 选用这些内核，执行器在第一步之前就把它们编译好。
#
# 每个内核都与第 07 章的参考实现 `TorchBackend` 对照测试。没有 GPU 的机器上，内核在 **Triton 解释器**里运行
# （`TRITON_INTERPRET=1`，必须在导入 `triton` 之前设置）：很慢，但足以检查每一处下标计算。

# %% [markdown] tags=["en"]
# ## The idea: tiles, an online softmax, and addresses from the block table
#
# A Triton program works on **tiles**: small 2-D blocks of a tensor that live in registers.
# Attention for a tile of queries walks over the keys tile by tile and keeps, per query row, a
# running maximum `m`, a running sum of exponentials `l` and a running weighted sum of values
# `acc` (the *online softmax*): when a new tile raises the maximum from `m` to `m'`, the old
# sums are rescaled by `exp(m - m')`. At the end `acc / l` is the softmax-weighted average, and
# the full `n_q × n_k` score matrix never exists in memory.
#
# ```
#            keys →  0 ............ prefix ........... n_k
# queries    tile0   [ all visible | diagonal ]
#  (rows)    tile1   [ all visible           | diag ]
#                     ^ unmasked loop          ^ masked loop (causal + bounds)
# ```
#
# The only paged part is *where a key row lives*. For key position `n` of sequence `i`:
# `row = block_tables[i][n // block_size] * block_size + n % block_size`, and the cache of one
# layer, viewed as `[num_slots, kv_heads, head_dim]`, holds it at `row`. The kernels compute
# this per row of each key tile, so a tile may straddle blocks and **any** block size works
# (16, 32, … 256, and smaller ones too).
#
# **GQA.** `num_heads / num_kv_heads = group` query heads share one KV head. Decode exploits it:
# one program loads a KV head's tiles once and serves all `group` query heads, as the rows of
# one small matrix product.

# %% [markdown] tags=["zh"]
# ## 思路：tile、在线 softmax，以及由块表算出的地址
#
# Triton 程序按 **tile** 工作：张量中放在寄存器里的小二维块。一个查询 tile 的注意力逐个 tile 地遍历键，
# 并为每一行查询维护三个量：当前最大值 `m`、指数和 `l`、值的加权和 `acc`（即*在线 softmax*）：当新 tile
# 把最大值从 `m` 提高到 `m'` 时，旧的和乘以 `exp(m - m')` 重新缩放。最后 `acc / l` 就是 softmax 加权平均，
# 完整的 `n_q × n_k` 分数矩阵从不出现在显存里。
#
# ```
#            键 →   0 ............ prefix ........... n_k
# 查询      tile0   [ 全部可见    | 对角部分 ]
#  （行）   tile1   [ 全部可见              | 对角 ]
#                     ^ 无掩码循环            ^ 有掩码循环（因果 + 越界）
# ```
#
# 唯一与分页有关的，是*某个键行存放在哪里*。序列 `i` 的键位置 `n`：
# `row = block_tables[i][n // block_size] * block_size + n % block_size`，把一层缓存看作
# `[num_slots, kv_heads, head_dim]` 时，它就在第 `row` 行。内核对键 tile 的每一行都这样计算，所以一个 tile
# 可以跨越多个块，**任何**块大小都能用（16、32、… 256，更小的也行）。
#
# **GQA：** `group = num_heads / num_kv_heads` 个查询头共用一个 KV 头。decode 利用了这一点：一个程序只加载
# 一次某个 KV 头的 tile，却为全部 `group` 个查询头服务，它们是同一个小矩阵乘法的不同行。

# %% [markdown] tags=["en"]
# ## Running without a GPU
#
# Triton decides at *decoration* time (`@triton.jit`) whether a kernel is compiled or
# interpreted, reading `TRITON_INTERPRET`. So the variable must be set before the kernel module
# is imported. This chapter sets it when there is no CUDA device; the module records what it
# saw in `INTERPRETED`, and `check_triton_device` refuses a CPU tensor unless the kernels really
# are interpreted (chapter 12's sampler kernels use the same two). The
# engine's `Config` will refuse `attention_backend="triton"` on a CPU without
# `TRITON_INTERPRET=1` before anything is loaded.

# %% [markdown] tags=["zh"]
# ## 没有 GPU 时怎么运行
#
# Triton 在*装饰*（`@triton.jit`）时读取 `TRITON_INTERPRET`，决定内核是编译还是解释执行。所以必须在导入内核
# 模块之前设置这个变量。没有 CUDA 设备时，本章会设置它；模块把它看到的结果记在 `INTERPRETED` 里，而
# `check_triton_device` 只有当内核确实以解释方式运行时才接受 CPU 上的张量（第 12 章采样器的内核也用这两样）。
# 引擎的 `Config` 将在加载任何东西之前，就拒绝没有 `TRITON_INTERPRET=1` 的 CPU 上的 `attention_backend="triton"`。

# %%
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
    "cache B's prefix": "缓存 B 的前缀",
    "prefill with a prefix": "带前缀的 prefill",
    "decode {i}": "decode {i}",
    "split-K (3 slices) vs plain decode: max |diff| {diff}": "split-K（3 段）对比普通 decode：最大 |diff| {diff}",
    "Triton backend == torch reference (prefill with a cached prefix, decode, split-K); caches identical":
        "Triton 后端 == torch 参考实现（带缓存前缀的 prefill、decode、split-K）；缓存完全相同",
    "attention backend: {backend}": "注意力后端：{backend}",
    "all exercise answers check out": "练习答案全部验证通过",
    "{card}, {date}: `{command}`": "{card}，{date}：`{command}`",
    "batch {batch:>2}:": "批大小 {batch:>2}：",
    "default": "默认",
    "32-key tiles": "32 键 tile",
    "early start": "提前启动",
    "32-key tiles + early start": "32 键 tile + 提前启动",
})

# %% default module
#| default_exp layers.triton_attention

# %% imports
#| export
from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from nanovllm.layers.attention import Attention
from nanovllm.layers.context import Context

# en: Whether the kernels below were decorated in interpreter mode (TRITON_INTERPRET=1 at import time).
# zh: 下面的内核在装饰时是否处于解释器模式（导入时 TRITON_INTERPRET=1）。
INTERPRETED: bool = bool(knobs.runtime.interpret)

# %% [markdown] tags=["en"]
# ## Build it: store K/V through the slot mapping
#
# One program per token: it reads the token's slot, stops if the slot is `-1`, and copies the
# `[kv_heads, head_dim]` tile of K and of V into that row of the cache. `k` and `v` usually are
# views into the fused QKV projection, so their token stride is passed in; the cache must be
# contiguous (`slot` rows of `kv_heads * head_dim` elements).

# %% [markdown] tags=["zh"]
# ## 动手：按槽位映射存储 K/V
#
# 每个 token 一个程序：读出 token 的槽位，若是 `-1` 就停下，否则把 K 和 V 各自的 `[kv_heads, head_dim]`
# tile 复制到缓存的那一行。`k`、`v` 通常是融合 QKV 投影的视图，所以要传入它们的 token 步长；缓存必须是连续的
# （每个槽位一行，`kv_heads * head_dim` 个元素）。

# %% [markdown] tags=["en"]
# With an 8-bit KV cache (`kv_cache_dtype="fp8"`, chapter 24 tells the whole story) the store also
# *quantizes*: each (token, KV head) row of K and of V is divided by its own scale, the row's
# largest magnitude over 448, rounded to float8 e4m3, and the scale is written beside the block.
# Three small helpers do it, shared with chapter 14's fused kernel. They divide exactly
# (`tl.div_rn`; Triton's `/` is an approximation on a GPU) and round on e4m3's grid themselves,
# so that the bytes are those of chapter 07's torch reference on every device (the Triton
# interpreter's own float8 conversion does not carry a rounding into the exponent). The values of
# a float8 cache are stored by dimension, `[kv_heads, d, block_size]` in each block, for the
# decode kernel's sake (chapter 24 shows why). With `FP8 = False` their lines are not compiled at
# all.

# %% [markdown] tags=["zh"]
# 使用 8 位 KV 缓存时（`kv_cache_dtype="fp8"`，完整的来龙去脉见第 24 章），存储还要做*量化*：K 和 V 中每个
# （token，KV 头）的一行都除以它自己的缩放因子（这一行的最大绝对值除以 448），舍入到 float8 e4m3，缩放因子写在块
# 旁边。由三个小辅助函数完成，第 14 章的融合内核也用它们。它们做精确除法（`tl.div_rn`；Triton 的 `/` 在 GPU 上是
# 近似的），并自己在 e4m3 的网格上舍入，这样在任何设备上写出的字节都与第 07 章的 torch 参考实现相同（Triton
# 解释器自带的 float8 转换在舍入进位时不会进到指数位）。float8 缓存的值按维度存放，每个块里是
# `[kv_heads, d, block_size]`，这是为了 decode 内核（原因见第 24 章）。`FP8 = False` 时，这些代码根本不会被编译。

# %% fp8 helpers
#| export
@triton.jit
def fp8_scale(amax):
    """The scale of rows whose largest magnitudes are ``amax``: amax / 448 (exact division), at least 2^-126."""
    # zh: 最大绝对值为 ``amax`` 的那些行的缩放因子：amax / 448（精确除法），至少为 2^-126。
    return tl.maximum(tl.div_rn(amax, 448.0), 1.1754943508222875e-38)


@triton.jit
def round_to_e4m3(x):
    """float32 ``x`` rounded to the nearest float8 e4m3 value (ties to even), saturated at ±448; still float32."""
    # zh: 把 float32 的 ``x`` 舍入到最近的 float8 e4m3 值（平局取偶），在 ±448 处饱和；结果仍是 float32。
    bits = x.to(tl.int32, bitcast=True)
    # en: e4m3 keeps 3 bits after the leading one: at x the step is 2^(exponent - 3), and 2^-9 below 2^-6
    # en: (subnormals); beyond 448 everything saturates, so the exponent is capped at 8.
    # zh: e4m3 在最高位之后保留 3 位：在 x 处步长为 2^(指数 - 3)，低于 2^-6（次正规数）时为 2^-9；超过 448 的
    # zh: 一律饱和，所以指数封顶为 8。
    exponent = ((bits >> 23) & 0xFF) - 127
    step = tl.minimum(tl.maximum(exponent, -6), 8) - 3
    # en: Adding and then subtracting 1.5 * 2^(step + 23) rounds |x| to a multiple of 2^step, ties to even: the
    # en: float32 addition itself does the rounding.
    # zh: 先加上再减去 1.5 * 2^(step + 23)，就把 |x| 舍入到 2^step 的整数倍（平局取偶）：舍入由 float32 加法本身完成。
    magic = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = tl.minimum((tl.abs(x) + magic) - magic, 448.0, propagate_nan=tl.PropagateNan.ALL)
    # en: x's sign bit back on: a negative value that rounds to 0 stays -0, as torch's conversion keeps it.
    # zh: 把 x 的符号位放回去：舍入为 0 的负数仍是 -0，与 torch 的转换一致。
    return (rounded.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, scale):
    """``x / scale`` as float8 e4m3 (x in any float dtype; scale float32, broadcastable)."""
    # zh: ``x / scale``，作为 float8 e4m3（x 可以是任何浮点 dtype；scale 为 float32，可广播）。
    return round_to_e4m3(tl.div_rn(x.to(tl.float32), scale)).to(tl.float8e4nv)

# %% store kernel
#| export
@triton.jit
def store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_s_b, stride_s_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    # en: This program stores token t; its slot is a row of the flat cache [num_slots, kv_heads, d].
    # zh: 本程序存储第 t 个 token；它的槽位是展平缓存 [num_slots, kv_heads, d] 的一行。
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # en: Slot -1 is a padded row (e.g. a CUDA-graph batch): nothing to store.
    # zh: 槽位 -1 是填充行（例如 CUDA Graph 的批次）：什么都不存。
    if slot < 0:
        return
    # en: A [BLOCK_H, BLOCK_D] grid of (head, dim) offsets, masked to the real [kv_heads, d].
    # zh: 一个 [BLOCK_H, BLOCK_D] 的（头，维度）偏移网格，用掩码截到真实的 [kv_heads, d]。
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    # en: Read token t's K and V tiles [kv_heads, d] (last dim contiguous, strides given).
    # zh: 读取第 t 个 token 的 K、V tile [kv_heads, d]（最后一维连续，其余步长由参数给出）。
    k = tl.load(k_ptr + t * stride_k_t + h * stride_k_h + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_v_t + h * stride_v_h + d, mask=mask, other=0.0)
    block, place = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    if FP8:
        # en: An 8-bit cache: each head's row is divided by its own scale, rounded to float8 e4m3,
        # en: and the scales go beside the block, [blocks, kv_heads, block_size].
        # zh: 8 位缓存（第 24 章）：每个头的这一行除以它自己的缩放因子，舍入到 float8 e4m3；缩放因子存在块旁边，
        # zh: 形状为 [blocks, kv_heads, block_size]。
        k_scale = fp8_scale(tl.max(tl.abs(k.to(tl.float32)), 1))
        v_scale = fp8_scale(tl.max(tl.abs(v.to(tl.float32)), 1))
        k, v = to_e4m3(k, k_scale[:, None]), to_e4m3(v, v_scale[:, None])
        heads = tl.arange(0, BLOCK_H)
        at = block * stride_s_b + heads * stride_s_h + place
        tl.store(k_scale_ptr + at, k_scale, mask=heads < NUM_KV_HEADS)
        tl.store(v_scale_ptr + at, v_scale, mask=heads < NUM_KV_HEADS)
    # en: Write them into row `slot` of the contiguous cache, converted to the cache's dtype.
    # zh: 写入连续缓存的第 `slot` 行，并转换为缓存的数据类型。
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if FP8:
        # en: A float8 cache keeps each block's values by dimension, [kv_heads, d, block_size].
        # zh: float8 缓存把每个块的值按维度存放，[kv_heads, d, block_size]（第 24 章）。
        dst = ((block * NUM_KV_HEADS + h) * HEAD_DIM + d) * BLOCK_SIZE + place
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

# %% [markdown] tags=["en"]
# The Python wrapper checks shapes, launches one program per token and returns nothing: the
# cache is updated in place.

# %% [markdown] tags=["zh"]
# Python 包装函数检查形状，每个 token 启动一个程序，不返回任何东西：缓存被原地更新。

# %% store wrapper
#| export
def check_triton_device(tensor: torch.Tensor) -> None:
    """Refuse a CPU tensor unless the kernels were decorated in interpreter mode."""
    # zh: 拒绝 CPU 张量，除非内核是在解释器模式下装饰的。
    if tensor.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before Triton is "
            "first imported"
        )


def _check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> bool:  # fmt: skip
    """Check the caches (and scales); True for an 8-bit cache, the one that comes with scales."""
    # zh: 检查各缓存（以及缩放因子）；8 位缓存（带缩放因子的那种）返回 True。
    fp8 = k_scales is not None
    if fp8 != (k_cache.element_size() == 1) or (k_scales is None) != (v_scales is None):
        raise ValueError("a float8 cache needs its k_scales and v_scales, and only a float8 cache has them")
    if k_cache.dim() != 4:
        raise ValueError(f"caches must be [num_blocks, block_size, kv_heads, d], got {tuple(k_cache.shape)}")
    blocks, block_size, kv_heads, head_dim = k_cache.shape
    # en: A float8 cache keeps each block's values by dimension.
    # zh: float8 缓存把每个块的值按维度存放（原因见第 24 章）。
    v_shape = (blocks, kv_heads, head_dim, block_size) if fp8 else (blocks, block_size, kv_heads, head_dim)
    if v_cache.shape != v_shape:
        raise ValueError(f"the value cache must be {v_shape} beside keys {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the Triton kernels need contiguous K/V caches (a per-layer view of the one KV tensor is)")
    check_triton_device(k_cache)
    if fp8 and not (k_scales.shape == v_scales.shape == (blocks, kv_heads, block_size)
                    and k_scales.dtype == v_scales.dtype == torch.float32 and k_scales.stride(-1) == 1):
        raise ValueError(f"scales must be float32 [blocks, kv_heads, block_size] = {(blocks, kv_heads, block_size)}, "
                         f"got {k_scales.dtype} {tuple(k_scales.shape)}, {v_scales.dtype} {tuple(v_scales.shape)}")
    return fp8


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write k, v [T, kv_heads, d] into rows ``slot_mapping`` [T] of the caches; slot -1 is skipped.
    With a float8 cache, each (token, head) row is quantized and its scale written to ``k_scales``/``v_scales``."""
    # zh: 把 k、v [T, kv_heads, d] 写进缓存中 ``slot_mapping`` [T] 指定的行；槽位 -1 跳过。
    # zh: float8 缓存中，每个（token，头）行都要量化，它的缩放因子写进 ``k_scales``/``v_scales``。
    fp8 = _check_cache(k_cache, v_cache, k_scales, v_scales)
    num_tokens, kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (kv_heads, head_dim) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"shape mismatch: k {k.shape}, v {v.shape}, cache {k_cache.shape}, slots {slot_mapping.shape}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    if num_tokens == 0:
        return
    # en: unused without FP8
    # zh: 不用 FP8 时用不到这两个参数。
    k_scales, v_scales = (k_scales, v_scales) if fp8 else (k_cache, v_cache)
    store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_scales.stride(0), k_scales.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], FP8=fp8,
    )  # fmt: skip


@triton.jit
def round_trip_kernel(
    x_ptr, out_ptr, stride_x_t, stride_x_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # en: Token t's rows [heads, d], quantized as the store quantizes them and back: what a float8 cache returns.
    # zh: 第 t 个 token 的各行 [heads, d]，像存储内核那样量化再还原：正是 float8 缓存读回的值。
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    x = tl.load(x_ptr + t * stride_x_t + h * stride_x_h + d, mask=mask, other=0.0).to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(x), 1))[:, None]
    back = round_to_e4m3(tl.div_rn(x, scale)) * scale
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # en: Rounded to bfloat16 here, ties to even as torch does: Triton's interpreter truncates when it converts.
        # zh: 在这里舍入到 bfloat16（就近，平局取偶，与 torch 相同）：Triton 解释器转换时是直接截断的。
        bits = back.to(tl.int32, bitcast=True)
        back = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    tl.store(out_ptr + (t * NUM_HEADS + h) * HEAD_DIM + d, back.to(out_ptr.dtype.element_ty), mask=mask)


def round_trip_kv(x: torch.Tensor) -> torch.Tensor:
    """What a float8 cache gives back for ``x`` [T, heads, d], in one pass: the same values as
    ``kv_quant.round_trip``, whose eight torch operations took 18x a copy's time on the H200."""
    # zh: 一遍算出 float8 缓存对 ``x`` [T, heads, d] 读回的值：与 ``kv_quant.round_trip`` 相同，
    # zh: 后者的八个 torch 操作在 H200 上要花一次拷贝 18 倍的时间。
    check_triton_device(x)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, heads, head_dim] with a contiguous last dimension, got {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, heads, head_dim = x.shape
    if tokens:
        round_trip_kernel[(tokens,)](
            x, out, x.stride(0), x.stride(1), NUM_HEADS=heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return out

# %% [markdown] tags=["en"]
# ## Build it: varlen causal prefill over a paged prefix
#
# The grid is `(query tiles, sequences, query heads)`. The program for query tile `m` of
# sequence `i` and head `h` loads its `BLOCK_M` queries once, then visits key tiles in two
# loops. Query `j` of the sequence sits at absolute position `prefix + j` (`prefix = n_k - n_q`,
# the cached tokens), so keys `0 … prefix + m·BLOCK_M − 1` are visible to *every* query of the
# tile: that first loop needs no mask at all. Only the last few tiles, around the diagonal,
# apply the causal mask `key ≤ query position` and the bound `key < n_k`.
#
# One tile step is its own `@triton.jit` function, called from both loops with a different
# `MASKED` constant (Triton inlines it and drops the mask code where `MASKED` is false).
#
# Keys come from one of two places:
# - `PAGED` (the context has block tables): from the cache, through the block table: the new
#   tokens' K/V were just stored there, the prefix was stored by earlier steps;
# - otherwise (no cached prefix, or the warm-up forward with an empty cache): straight from the
#   fresh `k`, `v`, row `cu_seqlens_q[i] + n`, exactly like `TorchBackend`.
#
# Softmax uses `exp2`: the scores are pre-multiplied by `scale · log2(e)`, and
# `2^(x·log2 e) = e^x`, so the result is the same and `exp2` is a single fast instruction.

# %% [markdown] tags=["zh"]
# ## 动手：读取分页前缀的变长因果 prefill
#
# 网格是（查询 tile，序列，查询头）。负责序列 `i`、头 `h` 的第 `m` 个查询 tile 的程序，先一次性加载它的
# `BLOCK_M` 个查询，再用两个循环遍历键 tile。序列中第 `j` 个查询位于绝对位置 `prefix + j`
# （`prefix = n_k - n_q`，即已缓存的 token 数），所以键 `0 … prefix + m·BLOCK_M − 1` 对 tile 中*每个*查询都
# 可见：第一个循环完全不需要掩码。只有对角线附近的最后几个 tile 需要因果掩码 `键 ≤ 查询位置` 和边界
# `键 < n_k`。
#
# 处理一个 tile 的步骤单独写成一个 `@triton.jit` 函数，两个循环都调用它，只是常量 `MASKED` 不同（Triton 会把它
# 内联，并在 `MASKED` 为假时去掉掩码代码）。
#
# 键有两个来源：
# - `PAGED`（上下文带有块表）：通过块表从缓存读取：新 token 的 K/V 刚刚存进去，前缀是之前的步骤存的；
# - 否则（没有已缓存前缀，或者缓存为空的预热前向）：直接读刚算出的 `k`、`v` 的第 `cu_seqlens_q[i] + n` 行，
#   与 `TorchBackend` 完全一致。
#
# softmax 使用 `exp2`：分数预先乘以 `scale · log2(e)`，而 `2^(x·log2 e) = e^x`，结果不变，`exp2` 却只是一条
# 快速指令。

# %% key rows
#| export
@triton.jit
def paged_places(block_table_ptr, n, n_valid, BLOCK_SIZE: tl.constexpr):
    """The cache block of each key position ``n`` [BLOCK_N] of one sequence, read through its block table, and the
    position's place in that block (its slot is ``block * BLOCK_SIZE + place``)."""
    # zh: 一个序列中每个键位置 ``n`` [BLOCK_N] 所在的缓存块（通过它的块表读出），以及该位置在块中的
    # zh: 位置（它的槽位是 ``block * BLOCK_SIZE + place``）。
    # en: Block id of each position (one small gather, cached).
    # zh: 每个位置所在块的编号（一次小的 gather，会命中缓存）。
    block = tl.load(block_table_ptr + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    return block, n % BLOCK_SIZE


@triton.jit
def tile_places(block_table_ptr, start_n, n, n_valid, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """``paged_places`` of a tile of keys ``n`` = ``start_n`` + [0, BLOCK_N), ``start_n`` a multiple of BLOCK_N."""
    # zh: 一个键 tile ``n`` = ``start_n`` + [0, BLOCK_N) 的 ``paged_places``，``start_n`` 是 BLOCK_N 的倍数。
    if BLOCK_SIZE >= BLOCK_N:
        # en: The whole tile lies in one block (both are powers of two): one block-table read, and consecutive
        # en: places, which Triton can load as wide vectors.
        # zh: 整个 tile 落在同一个块里（两者都是 2 的幂）：只读一次块表，位置连续，Triton 就能用宽向量加载。
        block = tl.load(block_table_ptr + start_n // BLOCK_SIZE).to(tl.int64)
        place = tl.multiple_of(start_n % BLOCK_SIZE, BLOCK_N) + tl.arange(0, BLOCK_N)
    else:
        block, place = paged_places(block_table_ptr, n, n_valid, BLOCK_SIZE)
    return block, place


@triton.jit
def row_scales(scale_ptr, block, place, n_valid, stride_s_b, MASKED: tl.constexpr):
    """An 8-bit cache's scales of the keys at ``place`` in ``block`` (``scale_ptr``: one KV head's
    [blocks, ., block_size]); MASKED: 0 for keys outside ``n_valid`` (else every key of the tile is read)."""
    # zh: 8 位缓存中 ``block`` 内 ``place`` 处那些键的缩放因子（``scale_ptr``：一个 KV 头的
    # zh: [blocks, ., block_size]）；MASKED：``n_valid`` 之外的键为 0（否则读取 tile 中的每个键）。
    if MASKED:
        scales = tl.load(scale_ptr + block * stride_s_b + place, mask=n_valid, other=0.0)
    else:
        scales = tl.load(scale_ptr + block * stride_s_b + place)
    return scales


@triton.jit
def key_tile(k_ptr, rows, offs_d, n_valid, d_mask, stride_k_t, WHOLE: tl.constexpr):
    """K^T [BLOCK_D, BLOCK_N] of rows ``rows`` of k or of the cache. WHOLE: loaded without masks (the caller drops
    the scores of keys outside ``n_valid``); else those keys and the dimensions outside ``d_mask`` read as 0."""
    # zh: k 或缓存中 ``rows`` 那些行的 K^T [BLOCK_D, BLOCK_N]。WHOLE：不带掩码加载（调用者丢掉 ``n_valid``
    # zh: 之外那些键的分数）；否则这些键以及 ``d_mask`` 之外的维度读为 0。
    k_ptrs = k_ptr + rows[None, :] * stride_k_t + offs_d[:, None]
    if WHOLE:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=n_valid[None, :] & d_mask[:, None], other=0.0)
    return k


@triton.jit
def value_tile(v_ptrs, n_valid, d_mask, WHOLE: tl.constexpr, MASKED: tl.constexpr):
    """V [BLOCK_N, BLOCK_D] at ``v_ptrs``. WHOLE: loaded without masks, and, in a MASKED tile, the keys outside
    ``n_valid`` zeroed in registers: their weight is 0, but 0 * NaN (an unwritten slot) would be NaN. Else masked
    loads, 0 outside ``n_valid`` and ``d_mask``."""
    # zh: ``v_ptrs`` 处的 V [BLOCK_N, BLOCK_D]。WHOLE：不带掩码加载，并且在 MASKED tile 中，把 ``n_valid``
    # zh: 之外的键在寄存器里清零：它们的权重是 0，但 0 * NaN（未写入的槽位）会是 NaN。否则用带掩码的加载，
    # zh: ``n_valid`` 和 ``d_mask`` 之外为 0。
    if WHOLE:
        v = tl.load(v_ptrs)
        if MASKED:
            v = tl.where(n_valid[:, None], v, 0.0)
    else:
        v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
    return v


@triton.jit
def online_softmax(scores, m_i, l_i):
    """One tile's step of the online softmax, from its base-2 ``scores`` [rows, BLOCK_N] (hidden keys at -inf):
    the tile's weights p, the factor alpha that rescales what earlier tiles summed, the new row maxima and sums."""
    # zh: 在线 softmax 中一个 tile 的一步，由它以 2 为底的 ``scores`` [rows, BLOCK_N]（被遮住的键为 -inf）算出：
    # zh: 这个 tile 的权重 p、重新缩放之前各 tile 累加结果的因子 alpha、新的行最大值和行和。
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

# %% prefill kernel
#| export
@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, q_pos, start_n, n_k, k_ptr, v_ptr, k_row0, block_table_ptr,
    stride_k_t, stride_v_t, stride_v_b, offs_d, d_mask, qk_scale, k_scale_ptr, v_scale_ptr, stride_s_b,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, WHOLE: tl.constexpr,
):  # fmt: skip
    # en: Key positions of this tile [BLOCK_N] and their rows in k/v (fresh) or in the cache (paged).
    # zh: 本 tile 的键位置 [BLOCK_N]，以及它们在 k/v（新算出的）或缓存（分页）中的行号。
    n = start_n + tl.arange(0, BLOCK_N)
    n_valid = n < n_k
    if PAGED:
        block, place = tile_places(block_table_ptr, start_n, n, n_valid, BLOCK_N, BLOCK_SIZE)
        rows = block * BLOCK_SIZE + place
    else:
        rows = (k_row0 + n).to(tl.int64)
    # en: K loaded transposed, [BLOCK_D, BLOCK_N]; out-of-range keys read as 0 (never NaN from unwritten slots).
    # en: WHOLE: a float8 tile inside one block loads without masks, as in decode (below); the causal mask then
    # en: drops the scores of keys past n_k.
    # zh: 以转置形式加载 K，[BLOCK_D, BLOCK_N]；越界的键读作 0（绝不会读到未写槽位里的 NaN）。
    # zh: WHOLE：落在一个块内的 float8 tile 不带掩码地加载，与下文的 decode 相同；越过 n_k 的键的分数随后被
    # zh: 因果掩码丢掉。
    k = key_tile(k_ptr, rows, offs_d, n_valid, d_mask, stride_k_t, WHOLE)
    # en: Scores [BLOCK_M, BLOCK_N] in base-2 units (qk_scale = scale * log2 e), fp32 accumulation.
    # zh: 分数 [BLOCK_M, BLOCK_N]，以 2 为底（qk_scale = scale * log2 e），fp32 累加。
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if FP8:
        # en: float8 keys: key n's scale multiplies its column of scores, not its d elements.
        # zh: float8 的键（第 24 章）：键 n 的缩放因子乘在它那一列分数上，而不是乘在它的 d 个元素上。
        s = s * row_scales(k_scale_ptr, block, place, n_valid, stride_s_b, True)[None, :]
    if MASKED:
        # en: Causal (key position <= query position) and bounds (key < n_k).
        # zh: 因果（键位置 <= 查询位置）与边界（键 < n_k）。
        visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
    # en: Online softmax: this tile's weights, the rescale factor for the old sums, new row maxima [BLOCK_M] and sums.
    # zh: 在线 softmax：本 tile 的权重，旧累加量的缩放因子，新的行最大值 [BLOCK_M] 与行和。
    p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
    # en: V tile [BLOCK_N, BLOCK_D]; acc [BLOCK_M, BLOCK_D] += p @ V after rescaling.
    # zh: V tile [BLOCK_N, BLOCK_D]；acc [BLOCK_M, BLOCK_D] 先缩放，再加上 p @ V。
    if FP8:
        # en: A float8 cache (always paged) keeps each block's values by dimension, [kv_heads, d, block_size].
        # zh: float8 缓存（总是分页的）把每个块的值按维度存放，[kv_heads, d, block_size]。
        v_ptrs = v_ptr + (block * stride_v_b + place)[:, None] + offs_d[None, :] * BLOCK_SIZE
    else:
        v_ptrs = v_ptr + rows[:, None] * stride_v_t + offs_d[None, :]
    v = value_tile(v_ptrs, n_valid, d_mask, WHOLE, MASKED)
    if FP8:
        # en: ... and value n's scale its column of weights: p @ (scale * v) = (p * scale) @ v.
        # zh: ……值 n 的缩放因子乘在它那一列权重上：p @ (scale * v) = (p * scale) @ v。
        p = p * row_scales(v_scale_ptr, block, place, n_valid, stride_s_b, True)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# en: the block-table width changes every step
# zh: 块表的宽度每一步都在变。
@triton.jit(do_not_specialize=["stride_bt"])
def prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_v_b, stride_o_t, stride_o_h,
    stride_bt, stride_s_b, stride_s_h, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    # en: Program (query tile m, sequence i, query head h); h reads KV head h // GROUP (GQA).
    # zh: 程序（查询 tile m，序列 i，查询头 h）；h 读取第 h // GROUP 个 KV 头（GQA）。
    m, i, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_h = h // GROUP
    # en: Sequence i: its n_q queries start at flat row q_start; it attends to n_k keys (prefix + new).
    # zh: 序列 i：它的 n_q 个查询从展平的第 q_start 行开始；它关注 n_k 个键（前缀 + 新 token）。
    q_start = tl.load(cu_q_ptr + i)
    n_q = tl.load(cu_q_ptr + i + 1) - q_start
    n_k = tl.load(cu_k_ptr + i + 1) - tl.load(cu_k_ptr + i)
    # en: The grid is sized for the longest sequence; shorter ones have idle tiles.
    # zh: 网格按最长的序列分配；较短的序列会有空闲的 tile。
    if m * BLOCK_M >= n_q:
        return
    prefix = n_k - n_q
    # en: This tile's queries [BLOCK_M] (index in the sequence, absolute position) and head dims [BLOCK_D].
    # zh: 本 tile 的查询 [BLOCK_M]（序列内下标与绝对位置）以及头维度 [BLOCK_D]。
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = prefix + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < n_q
    d_mask = offs_d < HEAD_DIM
    # en: Load Q [BLOCK_M, BLOCK_D] once; it stays in registers for the whole key loop.
    # zh: 一次性加载 Q [BLOCK_M, BLOCK_D]；整个键循环期间它都留在寄存器里。
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8 and q.dtype != tl.float32:
        # en: float8 K and V meet 16-bit queries in float16, as in decode (below): one conversion per pair.
        # zh: float8 的 K、V 与 16 位查询以 float16 相遇，与下文的 decode 相同：每两个值一条转换指令。
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    # en: Online-softmax state per query row: max m_i, sum l_i [BLOCK_M], weighted values acc [BLOCK_M, BLOCK_D].
    # zh: 每行查询的在线 softmax 状态：最大值 m_i、和 l_i [BLOCK_M]，加权值 acc [BLOCK_M, BLOCK_D]。
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # en: Where K/V rows come from: the cache of KV head kv_h (paged) or k/v rows from q_start on (fresh).
    # zh: K/V 行的来源：KV 头 kv_h 的缓存（分页），或从 q_start 起的 k/v 行（新算出的）。
    k_base = k_ptr + kv_h * stride_k_h
    v_base = v_ptr + kv_h * stride_v_h
    k_scale_base = k_scale_ptr + kv_h * stride_s_h
    v_scale_base = v_scale_ptr + kv_h * stride_s_h
    bt_row = block_tables_ptr + i * stride_bt
    # en: Float8 tiles inside one block load whole (as in decode, below): a mask per key would run along the
    # en: values' consecutive keys and split the wide loads.
    # zh: 落在一个块内的 float8 tile 整块加载（与下文的 decode 相同）：逐键的掩码会沿着值里连续的键方向，
    # zh: 把宽向量加载拆碎。
    WHOLE: tl.constexpr = FP8 and BLOCK_SIZE >= BLOCK_N and BLOCK_D == HEAD_DIM
    # en: Keys every query of the tile sees (below its first position), in whole tiles: no mask.
    # zh: tile 中所有查询都能看到的键（在第一个查询位置之前），按整 tile 计：无需掩码。
    full_end = (prefix + m * BLOCK_M) // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, q_pos, start_n, n_k, k_base, v_base, q_start, bt_row, stride_k_t, stride_v_t,
            stride_v_b, offs_d, d_mask, qk_scale, k_scale_base, v_scale_base, stride_s_b,
            BLOCK_N, BLOCK_SIZE, PAGED, False, DOT_PRECISION, FP8, WHOLE,
        )  # fmt: skip
    # en: The diagonal tiles, up to the last query's position (or n_k): causal mask + bounds.
    # zh: 对角线上的 tile，直到最后一个查询的位置（或 n_k）：因果掩码 + 边界。
    end = tl.minimum(n_k, prefix + (m + 1) * BLOCK_M)
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, q_pos, start_n, n_k, k_base, v_base, q_start, bt_row, stride_k_t, stride_v_t,
            stride_v_b, offs_d, d_mask, qk_scale, k_scale_base, v_scale_base, stride_s_b,
            BLOCK_N, BLOCK_SIZE, PAGED, True, DOT_PRECISION, FP8, WHOLE,
        )  # fmt: skip
    # en: Normalise (every real query sees key 0, so l_i > 0) and store [BLOCK_M, BLOCK_D] in q's dtype.
    # zh: 归一化（每个真实查询至少能看到键 0，所以 l_i > 0），以 q 的数据类型存储 [BLOCK_M, BLOCK_D]。
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_o_t + h * stride_o_h + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])

# %% [markdown] tags=["en"]
# The wrapper picks the key source and the launch configuration. Tile sizes matter on a GPU
# (`BLOCK_M = 128` queries × `BLOCK_N = 128` keys for `head_dim = 128` on an H200); in the
# interpreter small tiles keep each numpy step cheap. Large tiles also need room: three stages of
# 128-key tiles take 160-224 KB of shared memory a block, which an H200 or an A100 has and an
# RTX 4090 or 4070 (99 KB) has not, so there every grid takes the small tiles
# (`choose_prefill_launch`). For float32 inputs the dot products use IEEE precision: Triton's
# default on a GPU is TF32, which would not match the reference.

# %% [markdown] tags=["zh"]
# 包装函数选择键的来源和启动配置。tile 大小在 GPU 上很重要（H200 上 `head_dim = 128` 时用 `BLOCK_M = 128`
# 个查询 × `BLOCK_N = 128` 个键）；在解释器里，小 tile 让每一步 numpy 运算都很便宜。大 tile 还需要空间：三个 stage
# 的 128 键 tile 每个块要占 160–224 KB 共享内存，H200 和 A100 有这么多，RTX 4090 或 4070（99 KB）没有，所以在那里
# 每个网格都用小 tile（`choose_prefill_launch`）。对 float32 输入，点积使用 IEEE 精度：Triton 在 GPU 上默认用
# TF32，那样就与参考结果对不上了。

# %% prefill wrapper
#| export
def _dot_precision(dtype: torch.dtype) -> str:
    # en: tf32 only matters for float32 inputs
    # zh: tf32 只对 float32 输入有意义。
    return "ieee" if dtype == torch.float32 else "tf32"


# en: Shared memory that the large prefill launch, (128, 128, 8, 3), takes in its largest variant (16-bit, head_dim
# en: 128, fresh keys), as Triton compiles it for each generation of GPU (scripts/attention_sass.py
# en: --shared-memory): 224 KB on compute capability 9.0 and newer, 160 KB on 8.x. A block may use 227 KB of an
# en: H200 and 163 KB of an A100, but only 99 KB of an RTX 4090 or 4070 (8.9), where that launch would fail to
# en: start: there every grid takes the small tiles.
# zh: 大的 prefill 启动配置 (128, 128, 8, 3) 在它最大的变体（16 位、head_dim 128、新键）下所需的共享内存，按 Triton
# zh: 为每一代 GPU 编译的结果（scripts/attention_sass.py --shared-memory）：计算能力 9.0 及以上 224 KB，8.x 上
# zh: 160 KB。一个块在 H200 上最多能用 227 KB，在 A100 上 163 KB，但在 RTX 4090 或 4070（8.9）上只有 99 KB，在那里这个
# zh: 启动配置根本启动不了：所以那里的每个网格都用小 tile。
LARGE_PREFILL_SHARED_MEMORY = {8: 163_840, 9: 229_376}


def choose_prefill_launch(gpu: Any, head_dim: int, dtype: torch.dtype, programs_128: int) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) on a GPU with properties ``gpu`` (``major``, ``multi_processor_count``,
    ``shared_memory_per_block_optin``: torch.cuda.get_device_properties); ``programs_128``: grid size with 128-query
    tiles."""
    # zh: 在属性为 ``gpu``（``major``、``multi_processor_count``、``shared_memory_per_block_optin``：
    # zh: torch.cuda.get_device_properties）的 GPU 上的 (BLOCK_M, BLOCK_N, num_warps, num_stages)；
    # zh: ``programs_128``：用 128 个查询的 tile 时的网格大小。
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    # en: 8.x's figure for older GPUs too
    # zh: 更老的 GPU 也用 8.x 的数字。
    needs = LARGE_PREFILL_SHARED_MEMORY[9 if gpu.major >= 9 else 8]
    large_fits = getattr(gpu, "shared_memory_per_block_optin", 0) >= needs
    if programs_128 < 2 * gpu.multi_processor_count or not large_fits:
        # en: a small grid (smaller tiles keep more SMs busy), or too little shared memory
        # zh: 网格较小（较小的 tile 能让更多 SM 有活干），或共享内存不够。
        return 64, 64, 4, 3
    # en: the fastest of five configurations measured on an H200 (see "Measure it")
    # zh: 在 H200 上测过的五种配置中最快的一种（见“测量”一节）。
    return 128, 128, 8, 3


def _prefill_launch(device: torch.device, head_dim: int, dtype: torch.dtype, programs_128: int) -> tuple[int, ...]:
    if device.type != "cuda":
        # en: the interpreter: small tiles keep each numpy step cheap
        # zh: 解释器：小 tile 让每一步 numpy 计算都很便宜。
        return 16, 16, 4, 1
    return choose_prefill_launch(torch.cuda.get_device_properties(device), head_dim, dtype, programs_128)


def _check_prefill_inputs(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, context: Context) -> None:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_kv_heads ({kv_heads})")
    if context.block_tables is not None and k_cache.numel() == 0:
        raise ValueError("the context has block tables (a cached prefix) but the layer has no KV cache")
    if context.block_tables is None and context.max_seqlen_k != context.max_seqlen_q:
        raise ValueError("a cached prefix (seqlen_k > seqlen_q) needs block tables to read it from")


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context: Context,
    scale: float,
    launch: tuple[int, int, int, int] | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention: q [T, H, d] -> [T, H, d]; prefixes read through ``context.block_tables``.

    ``launch`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the default configuration (benchmarks).
    ``k_scales``/``v_scales``: a float8 cache's scales; the fresh k and v are used as given.
    """
    # zh: 变长因果注意力：q [T, H, d] -> [T, H, d]；前缀通过 ``context.block_tables`` 读取。
    # zh:
    # zh: ``launch`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) 覆盖默认配置（基准测试用）。
    # zh: ``k_scales``/``v_scales``：float8 缓存的缩放因子；新算出的 k 和 v 按原样使用。
    _check_prefill_inputs(q, k, k_cache, context)
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    paged = context.block_tables is not None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    fp8 = False
    if paged:
        fp8 = _check_cache(k_cache, v_cache, k_scales, v_scales)
        keys, values, block_tables, block_size = k_cache, v_cache, context.block_tables, k_cache.shape[1]
        # en: a slot row is one step of dim 1
        # zh: 相邻的槽位行在第 1 维上相差一步。
        stride_k_t, stride_k_h = k_cache.stride(1), k_cache.stride(2)
        # en: A float8 cache keeps its values by dimension, [blocks, kv_heads, d, block_size].
        # zh: float8 缓存把值按维度存放，[blocks, kv_heads, d, block_size]（第 24 章）。
        stride_v_t, stride_v_h = (0, v_cache.stride(1)) if fp8 else (stride_k_t, stride_k_h)
        stride_v_b = v_cache.stride(0)
    else:
        check_triton_device(q)
        # en: block table unused
        # zh: 用不到块表。
        keys, values, block_tables, block_size = k, v, context.cu_seqlens_q, 1
        stride_k_t, stride_k_h, stride_v_t, stride_v_h = k.stride(0), k.stride(1), v.stride(0), v.stride(1)
        # en: no blocks
        # zh: 没有块。
        stride_v_b = 0
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dimension")
    num_seqs = context.cu_seqlens_q.numel() - 1
    programs_128 = triton.cdiv(context.max_seqlen_q, 128) * num_seqs * heads
    bm, bn, num_warps, num_stages = launch or _prefill_launch(q.device, head_dim, q.dtype, programs_128)
    grid = (triton.cdiv(context.max_seqlen_q, bm), num_seqs, heads)
    # en: unused without FP8
    # zh: 不用 FP8 时用不到这两个参数。
    k_scales, v_scales = (k_scales, v_scales) if fp8 else (q, q)
    prefill_attention_kernel[grid](
        q, keys, values, out, context.cu_seqlens_q, context.cu_seqlens_k, block_tables, k_scales, v_scales,
        q.stride(0), q.stride(1), stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_v_b, out.stride(0),
        out.stride(1), block_tables.stride(0), k_scales.stride(0), k_scales.stride(1), scale * math.log2(math.e),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_SIZE=block_size, PAGED=paged, DOT_PRECISION=_dot_precision(q.dtype),
        FP8=fp8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out

# %% [markdown] tags=["en"]
# ### Compile before the first step
#
# Triton compiles a kernel the first time it is launched with a new *variant*: a new value of
# any `constexpr` (here `PAGED` and the four launch numbers), and a new class of any integer
# argument (equal to 1, divisible by 16, or neither), which it specializes on. A compile takes
# about a second, so a variant first met in the middle of a run stalls that step. The engine
# meets four: fresh or paged keys (`PAGED`, set by the first chunked prefill or prefix-cache hit)
# times a small or large grid (the two launch configurations). The block-table row stride is the
# table's width, which changes from step to step; `do_not_specialize=["stride_bt"]` keeps one
# variant for every width instead of a new one the first time a step's table is 1 or 16 blocks
# wide. `warm_up_prefill` launches all four once on a few tokens, so that the engine pays these
# compiles while it starts (the runner calls it when it is built), never inside a measured step.

# %% [markdown] tags=["zh"]
# ### 在第一步之前编译
#
# Triton 第一次以一个新的*变体*启动内核时会编译它：任何 `constexpr` 取了新值（这里是 `PAGED` 和四个启动参数），
# 或者某个整数参数落入了新的类别（等于 1、能被 16 整除、或都不是），Triton 会针对这些类别做特化。一次编译大约要
# 一秒，所以在运行中途第一次遇到某个变体，会让那一步停顿下来。引擎会遇到四个变体：键是新算出的还是分页读取的
# （`PAGED`，由第一次分块 prefill 或前缀缓存命中触发），乘以网格是小还是大（两种启动配置）。块表的行步长就是
# 块表的宽度，每一步都可能不同；`do_not_specialize=["stride_bt"]` 让所有宽度共用一个变体，而不是在某一步的块表
# 第一次恰好宽 1 块或 16 块时再编译一个。`warm_up_prefill` 用几个 token 把四个变体各启动一次，这样引擎在启动时
# （执行器构建时调用它）就付清了编译的代价，而不会在某个被计时的步里付。

# %% prefill warm-up
#| export
def prefill_launch_configs(device: torch.device, head_dim: int, dtype: torch.dtype) -> list[tuple[int, ...]]:
    """Every launch configuration ``_prefill_launch`` can pick for these shapes (small grid, large grid)."""
    # zh: ``_prefill_launch`` 对这些形状可能选用的每一种启动配置（小网格，大网格）。
    small = _prefill_launch(device, head_dim, dtype, programs_128=0)
    large = _prefill_launch(device, head_dim, dtype, programs_128=1 << 30)
    return list(dict.fromkeys([small, large]))


def warm_up_prefill(
    num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
    dtype: torch.dtype | None = None, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """Launch every prefill kernel variant the engine can need, once, on 2 tokens; returns the launch count.

    ``dtype``: the model's (default: the cache's; a float8 cache needs it, with its scales).
    The paged launches read (and only read) block 0 of the cache; their output is thrown away.
    """
    # zh: 把引擎可能用到的每一种 prefill 内核变体在 2 个 token 上各启动一次；返回启动次数。
    # zh:
    # zh: ``dtype``：模型的 dtype（默认：缓存的；float8 缓存需要给出它，连同缓存的缩放因子）。
    # zh: 分页的那几次启动读取（只读取）缓存的第 0 块；它们的输出被丢弃。
    fp8 = _check_cache(k_cache, v_cache, k_scales, v_scales)
    if fp8 and dtype is None:
        raise ValueError("a float8 cache holds no model dtype: pass dtype")
    device, dtype = k_cache.device, dtype or k_cache.dtype
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.zeros(2, num_kv_heads, head_dim, dtype=dtype, device=device)

    def lengths(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    # en: Two fresh tokens; then one token after a cached prefix of one, read through block 0.
    # zh: 两个新 token；然后是一个 token，前面有一个已缓存的前缀 token，经由块 0 读取。
    fresh = Context(True, lengths(0, 2), lengths(0, 2), 2, 2)
    paged = Context(True, lengths(0, 1), lengths(0, 2), 1, 2, block_tables=lengths(0).view(1, 1))
    launches = 0
    for context, queries in ((fresh, q), (paged, q[:1])):
        for launch in prefill_launch_configs(device, head_dim, dtype):
            prefill_attention(queries, k, k, k_cache, v_cache, context, scale, launch, k_scales, v_scales)
            launches += 1
    return launches

# %% [markdown] tags=["en"]
# ## Build it: paged decode, plain and split-K
#
# In decode each sequence has **one** query per head, so the work is a matrix-*vector* product
# per head: the kernel is bound by how fast it can *read* the KV cache, not by arithmetic. Two
# consequences shape it:
#
# - **GQA packing.** The program for (sequence `b`, KV head `g`) loads each K/V tile once and
#   multiplies it by the `group` query heads that share it, padded to 16 rows because
#   `tl.dot` needs at least 16 (the padding rows cost no memory traffic).
# - **Enough programs.** `batch × kv_heads` programs must keep every streaming multiprocessor
#   (SM) busy. With 1 sequence and 8 KV heads on a 132-SM H200 only 8 SMs would read memory.
#   **Split-K** gives each (sequence, KV head) `num_splits` programs, each over one contiguous
#   slice of the context; each writes a partial output normalised by its own sum, plus its
#   log-sum-exp `lse = m + log2(l)`. A reduction kernel then merges the slices: with
#   `w_s = 2^(lse_s − max lse)`, the answer is `Σ w_s · out_s / Σ w_s`. That is exactly the
#   online-softmax rescaling, done once at the end instead of tile by tile.
#
# One kernel serves both: with `SPLIT = False` it normalises and writes the final output.
# A context length of 0 (a padded row) gives an output of 0, like the reference.

# %% [markdown] tags=["zh"]
# ## 动手：分页 decode，普通版与 split-K 版
#
# decode 时每个序列每个头只有**一个**查询，所以每个头的计算是矩阵乘*向量*：内核的速度取决于*读取* KV 缓存
# 有多快，而不是算力。由此决定了它的两个设计：
#
# - **GQA 打包：** 负责（序列 `b`，KV 头 `g`）的程序每个 K/V tile 只加载一次，并用它乘上共享它的 `group` 个
#   查询头；行数补齐到 16，因为 `tl.dot` 至少需要 16 行（补齐的行不产生访存）。
# - **足够多的程序：** 要让每个流式多处理器（SM）都忙起来，需要 `batch × kv_heads` 个程序。1 个序列、8 个
#   KV 头，在有 132 个 SM 的 H200 上只有 8 个 SM 在读显存。**split-K** 给每个（序列，KV 头）分配
#   `num_splits` 个程序，每个负责上下文中连续的一段；每段写出用自己的和归一化的部分输出，以及它的
#   log-sum-exp `lse = m + log2(l)`。然后由归约内核合并各段：令 `w_s = 2^(lse_s − max lse)`，答案就是
#   `Σ w_s · out_s / Σ w_s`。这正是在线 softmax 的重新缩放，只是在最后做一次，而不是逐 tile 地做。
#
# 一个内核同时服务两种情况：`SPLIT = False` 时它直接归一化并写出最终输出。上下文长度为 0（填充行）时输出 0，
# 与参考实现一致。

# %% decode kernels
#| export
@triton.jit
def _decode_tile(
    acc, l_i, m_i, q, start_n, end, bt_row, k_base, v_base, k_scale_base, v_scale_base, offs_d,
    stride_c_t, stride_v_b, stride_s_b, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    # en: Key positions [BLOCK_N] of this tile: the cache block of each and its place in that block.
    # zh: 本 tile 的键位置 [BLOCK_N]：每个键所在的缓存块，以及它在块中的位置。
    n = start_n + tl.arange(0, BLOCK_N)
    n_valid = n < end
    block, place = tile_places(bt_row, start_n, n, n_valid, BLOCK_N, BLOCK_SIZE)
    rows = block * BLOCK_SIZE + place
    # en: Masked loads where a tile may end before its last key (MASKED), or head_dim is not a power of two. A
    # en: float8 tile inside one block loads whole instead: its values' mask would run along their consecutive
    # en: keys and split the wide loads; the keys past the end are then zeroed in registers (never NaN).
    # zh: 在 tile 可能在最后一个键之前结束时（MASKED），或 head_dim 不是 2 的幂时，用带掩码的加载。落在
    # zh: 一个块内的 float8 tile 则整块加载：它的值的掩码会沿着连续的键方向，把宽向量加载拆碎；越过末尾的键
    # zh: 随后在寄存器里置零（绝不会是 NaN）。
    d_mask = offs_d < HEAD_DIM
    WHOLE: tl.constexpr = BLOCK_D == HEAD_DIM and (not MASKED or (BLOCK_SIZE >= BLOCK_N and FP8))
    # en: K^T [BLOCK_D, BLOCK_N]; scores [GROUP_PAD, BLOCK_N] for all query heads of the group at once.
    # zh: K^T [BLOCK_D, BLOCK_N]；一次算出该组全部查询头的分数 [GROUP_PAD, BLOCK_N]。
    k = key_tile(k_base, rows, offs_d, n_valid, d_mask, stride_c_t, WHOLE)
    scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if FP8:
        # en: float8 K: each key's scale multiplies its column of scores.
        # zh: float8 的 K（第 24 章）：每个键的缩放因子乘在它那一列分数上。
        scores = scores * row_scales(k_scale_base, block, place, n_valid, stride_s_b, MASKED)[None, :]
    if MASKED:
        scores = tl.where(n_valid[None, :], scores, float("-inf"))
    # en: Online softmax update, as in prefill.
    # zh: 在线 softmax 更新，与 prefill 相同。
    p, alpha, m_new, l_i = online_softmax(scores, m_i, l_i)
    # en: V [BLOCK_N, BLOCK_D]; acc [GROUP_PAD, BLOCK_D] += p @ V. A float8 cache keeps each block's values by
    # en: dimension, [kv_heads, d, block_size], so that the keys of one dimension are consecutive.
    # zh: V [BLOCK_N, BLOCK_D]；acc [GROUP_PAD, BLOCK_D] += p @ V。float8 缓存把每个块的值按维度存放，
    # zh: [kv_heads, d, block_size]（第 24 章），这样同一维度上的各个键是连续的。
    if FP8:
        v_ptrs = v_base + (block * stride_v_b + place)[:, None] + offs_d[None, :] * BLOCK_SIZE
    else:
        v_ptrs = v_base + rows[:, None] * stride_c_t + offs_d[None, :]
    v = value_tile(v_ptrs, n_valid, d_mask, WHOLE, MASKED)
    if FP8:
        # en: ... and each value's scale its column of weights (l_i keeps the unscaled sum).
        # zh: ……每个值的缩放因子乘在它那一列权重上（l_i 保留未缩放的和）。
        p = p * row_scales(v_scale_base, block, place, n_valid, stride_s_b, MASKED)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# en: the block-table width changes every step
# zh: 块表的宽度每一步都在变。
@triton.jit(do_not_specialize=["stride_bt"])
def decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, o_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_b, stride_q_h, stride_c_t, stride_c_h, stride_v_b, stride_v_h, stride_bt, stride_o_b, stride_o_h,
    stride_o_s, stride_s_b, stride_s_h, qk_scale, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # en: Program (sequence b, KV head g, split s): query heads g*GROUP … g*GROUP + GROUP - 1.
    # zh: 程序（序列 b，KV 头 g，分段 s）：负责查询头 g*GROUP … g*GROUP + GROUP - 1。
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        # en: Started early (PDL, see decode_attention): let the next kernel start too.
        # zh: 提前启动（PDL，见 decode_attention）：也让下一个内核提前启动。
        tl.extra.cuda.gdc_launch_dependents()
    n_ctx = tl.load(context_lens_ptr + b)
    # en: This split's slice of the context, in whole BLOCK_N tiles: [start, end) (empty if start >= n_ctx).
    # zh: 本段负责的上下文切片，按整 BLOCK_N tile 划分：[start, end)（若 start >= n_ctx 则为空）。
    chunk = tl.cdiv(tl.cdiv(n_ctx, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(n_ctx, start + chunk)
    if PDL:
        # en: The context lengths and block tables come from the host, before the step; the queries and this
        # en: token's K/V from the kernel before: wait for it here.
        # zh: 上下文长度和块表由主机在这一步之前写好；查询以及本 token 的 K/V 来自前一个内核：在这里等它结束。
        tl.extra.cuda.gdc_wait()
    # en: The GROUP query heads of KV head g as rows [GROUP_PAD, BLOCK_D] (padding rows masked to 0).
    # zh: KV 头 g 的 GROUP 个查询头作为行 [GROUP_PAD, BLOCK_D]（补齐的行掩码为 0）。
    offs_g = tl.arange(0, GROUP_PAD)
    heads = g * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    qd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :], mask=qd_mask, other=0.0)
    if FP8 and q.dtype != tl.float32:
        # en: float8 K and V meet 16-bit queries in float16: every e4m3 value is exact in float16, and
        # en: e4m3 -> float16 is one hardware conversion per pair (to bfloat16 takes more; measured on the H200,
        # en: the float16 tiles made the float8 decode 10-14 % faster). q is clamped to float16's range first.
        # zh: float8 的 K、V（第 24 章）与 16 位查询以 float16 相遇：每个 e4m3 值在 float16 中都能精确表示，而且
        # zh: e4m3 -> float16 每两个值只需一条硬件转换指令（转成 bfloat16 要更多步；在 H200 上测得，float16 的 tile
        # zh: 让 float8 的 decode 快了 10–14 %）。q 先截到 float16 的范围之内。
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    # en: Online-softmax state per query head [GROUP_PAD] and acc [GROUP_PAD, BLOCK_D], fp32.
    # zh: 每个查询头的在线 softmax 状态 [GROUP_PAD] 与 acc [GROUP_PAD, BLOCK_D]，fp32。
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    k_base = k_cache_ptr + g * stride_c_h
    v_base = v_cache_ptr + g * stride_v_h
    k_scale_base = k_scale_ptr + g * stride_s_h
    v_scale_base = v_scale_ptr + g * stride_s_h
    # en: A float8 cache: whole tiles without masks first, then the slice's last, partial tile (if any) masked.
    # en: Measured on the H200, a 16-bit cache runs faster with every tile masked, in one loop that Triton
    # en: software-pipelines to the end: there the last tile's loads overlap the tile before.
    # zh: float8 缓存：先处理不带掩码的完整 tile，再对本段最后那个不满的 tile（如果有）做掩码。在 H200 上
    # zh: 测得，16 位缓存让每个 tile 都带掩码反而更快：只有一个循环，Triton 把它一直软件流水化到最后，
    # zh: 最后一个 tile 的加载也能与前一个 tile 重叠。
    if FP8:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for start_n in range(start, full_end, BLOCK_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, start_n, end, bt_row, k_base, v_base, k_scale_base, v_scale_base, offs_d,
                stride_c_t, stride_v_b, stride_s_b, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, False,
                DOT_PRECISION, FP8,
            )  # fmt: skip
        if full_end < end:
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, full_end, end, bt_row, k_base, v_base, k_scale_base, v_scale_base, offs_d,
                stride_c_t, stride_v_b, stride_s_b, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True,
                DOT_PRECISION, FP8,
            )  # fmt: skip
    else:
        for start_n in range(start, end, BLOCK_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, start_n, end, bt_row, k_base, v_base, k_scale_base, v_scale_base, offs_d,
                stride_c_t, stride_v_b, stride_s_b, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True,
                DOT_PRECISION, FP8,
            )  # fmt: skip
    # en: Normalised output of this slice [GROUP_PAD, BLOCK_D]; an empty slice (l_i = 0) gives 0, not NaN.
    # zh: 本段的归一化输出 [GROUP_PAD, BLOCK_D]；空段（l_i = 0）输出 0，而不是 NaN。
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    o_ptrs = o_ptr + b * stride_o_b + heads[:, None] * stride_o_h + s * stride_o_s + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=qd_mask)
    if SPLIT:
        # en: Its log-sum-exp (base 2) per head, -inf for an empty slice: lse [batch, heads, num_splits].
        # zh: 每个头的 log-sum-exp（以 2 为底），空段为 -inf：lse [batch, heads, num_splits]。
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + (b * tl.num_programs(1) * GROUP + heads) * num_splits + s, lse, mask=offs_g < GROUP)


@triton.jit
def decode_reduce_kernel(
    part_ptr, lse_ptr, o_ptr, num_splits,
    stride_p_b, stride_p_h, stride_p_s, stride_o_b, stride_o_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # en: Program (sequence b, query head h) merges that head's num_splits partial outputs.
    # zh: 程序（序列 b，查询头 h）合并这个头的 num_splits 个部分输出。
    b, h = tl.program_id(0), tl.program_id(1)
    if PDL:
        # en: Everything it reads comes from the split kernel: it only launches early, then waits.
        # zh: 它读的一切都来自分段内核：只是提前启动，然后等待。
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    # en: Weights w_s = 2^(lse_s - max lse) [SPLITS_PAD]; empty slices (lse = -inf) weigh 0.
    # zh: 权重 w_s = 2^(lse_s - max lse) [SPLITS_PAD]；空段（lse = -inf）权重为 0。
    lse = tl.load(lse_ptr + (b * NUM_HEADS + h) * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # en: all slices empty: avoid -inf - -inf = NaN
    # zh: 所有分段都为空：避免 -inf - -inf = NaN。
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    w = tl.exp2(lse - lse_max)
    total = tl.sum(w, 0)
    # en: Partial outputs [SPLITS_PAD, BLOCK_D], weighted sum over the splits -> [BLOCK_D].
    # zh: 部分输出 [SPLITS_PAD, BLOCK_D]，按段加权求和 -> [BLOCK_D]。
    parts = tl.load(part_ptr + b * stride_p_b + h * stride_p_h + offs_s[:, None] * stride_p_s + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(w[:, None] * parts, 0) / tl.maximum(total, 1e-30)
    # en: A padded row (context length 0) has no slice with weight: output 0.
    # zh: 填充行（上下文长度为 0）没有任何有权重的段：输出 0。
    out = tl.where(total > 0, out, 0.0)
    tl.store(o_ptr + b * stride_o_b + h * stride_o_h + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)

# %% [markdown] tags=["en"]
# **When does split-K win?** It adds work (a second kernel, partial outputs written and read
# back in float32), so it only pays when the plain grid leaves SMs idle *and* each slice is
# still long enough to amortise a program's start-up. The heuristic below states exactly that:
# split only when there are fewer programs than SMs, then use as many slices as fit four programs
# per SM (one more would start a partial extra wave), never slices shorter than `min_split_len` keys. It uses
# only host-side numbers (the batch size and the block table's width, which bounds every
# context), so it needs no GPU→CPU copy and a CUDA graph can capture the launch. The measured
# crossover is in chapter 13.

# %% [markdown] tags=["zh"]
# **split-K 什么时候更快？** 它增加了工作量（多一个内核，部分输出以 float32 写出再读回），所以只有当普通网格
# 让 SM 闲着、*并且*每段仍然足够长、能摊薄程序启动开销时才划算。下面的启发式规则说的正是这个：
# 只有程序数少于 SM 数时才切分，此时在每个 SM 不超过四个程序的前提下切得尽量多（再多一段就会多出一轮不满的
# 波次），但每段不短于 `min_split_len` 个键。
# 它只用主机端已知的数（批大小和块表宽度，后者是所有上下文长度的上界），所以不需要 GPU→CPU 拷贝，
# CUDA Graph 也能捕获这次启动。实测的分界点见第 13 章。

# %% [markdown] tags=["en"]
# **A few sequences: short tiles and an early start.** At batch 1 a step of Qwen3-0.6B runs
# attention in every one of its 28 layers over some 4 MB of cache, which the H200 reads in about
# a microsecond; the kernel takes several, because each program reads one or two tiles and then
# the grid waits for its slowest program, and because a kernel inside a graph starts only when
# the one ahead of it has ended. Two things help there. Shorter tiles (32 keys instead of 128)
# when a slice is only a few tiles long give four times the programs to read the same bytes. And
# Hopper GPUs have *programmatic dependent launch* (PDL): a kernel launched with it may start
# before the kernel ahead of it ends, once that kernel calls `gdc_launch_dependents`, and waits
# with `gdc_wait` where it first needs what that kernel wrote. Our decode kernels need the
# queries almost at once, so all they win is their launch, hidden behind the kernel ahead;
# chapter 14 builds kernels that do real work before they wait. Both apply only where they
# measured faster: 16 slices or more (one to four sequences here), a 16-bit cache.

# %% [markdown] tags=["zh"]
# **少数几个序列：短 tile，提前启动。** 批大小为 1 时，Qwen3-0.6B 的一步在 28 层的每一层都要对约 4 MB 的缓存做注意力，
# H200 读完这些只要一微秒左右；内核却要花好几微秒，因为每个程序只读一两个 tile，整个网格要等最慢的那个程序，而且在
# graph 里，一个内核要等前一个内核结束才开始。这里有两个办法。当每段只有几个 tile 长时，用更短的 tile（32 个键而不是
# 128 个），读同样多的字节就有四倍的程序。另外，Hopper GPU 有*程序化依赖启动*（programmatic dependent launch，
# PDL）：用它启动的内核，在前一个内核调用 `gdc_launch_dependents` 之后就可以开始，只在第一次需要前一个内核写出的
# 数据时用 `gdc_wait` 等待。我们的 decode 内核几乎一开始就需要查询，所以它们赢到的只是启动本身，藏在前一个内核
# 后面；第 14 章会写出在等待之前先做实事的内核。两者只用在测得更快的地方：16 段或更多（这里是一到四个序列）、
# 16 位缓存。

# %% decode wrapper
#| export
def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, num_sms: int, min_split_len: int = 128, max_splits: int = 32
) -> int:
    """How many context slices per (sequence, KV head): 1 = the plain kernel, > 1 = split-K."""
    # zh: 每个（序列，KV 头）切成多少段上下文：1 = 普通内核，> 1 = split-K。
    programs = batch * num_kv_heads
    # en: every SM already has a program: splitting only adds the reduction
    # zh: 每个 SM 都已分到一个程序：再分段只会多出归约的开销。
    if programs >= num_sms:
        return 1
    # en: at most four programs per SM: no partial extra wave
    # zh: 每个 SM 最多四个程序：不会多出一个跑不满的波次（wave）。
    wanted = 4 * num_sms // programs
    return max(1, min(wanted, max_context // min_split_len, max_splits))


# en: The decode launch on a GPU, (BLOCK_N keys per tile, warps, stages), by the bytes of a cached element.
# en: 16-bit: 128 keys per tile; on the engine benchmark's contexts (100-2,048 tokens, scripts/decode_sweep.py) it
# en: read the cache at 99% of the copy rate at batch 256, against 93% with 64 keys. float32 tiles are twice the
# en: bytes: they keep 64 keys, measured before. float8: 128 keys and 5 stages, with the values kept
# en: by dimension. Triton's pipeliner spends a stage on the block-table read that addresses a tile, so at 3
# en: stages it kept one buffer for K and one for V and loaded each tile only after the last one was used; at 5
# en: it keeps two, and the next tile loads while this one is used (scripts/attention_sass.py counts the
# en: buffers). At batch 256 that took 0.181 ms against 0.192 ms, at batch 32 0.038 ms against 0.045 ms; a 16-bit
# en: tile is twice the bytes, and there 3 stages stayed as fast or faster.
# zh: GPU 上 decode 的启动配置（每个 tile 的键数 BLOCK_N、warp 数、stage 数），按缓存中一个元素的字节数选择。
# zh: 16 位：每个 tile 128 个键；在引擎基准测试的上下文长度上（100–2,048 个 token，scripts/decode_sweep.py），
# zh: 批大小为 256 时它读取缓存的速度达到拷贝速率的 99%，而 64 个键时是 93%。float32 的 tile 字节数翻倍：仍用之前
# zh: 测过的 64 个键。float8（第 24 章）：128 个键、5 个 stage，值按维度存放。Triton 的流水线器要为定位 tile 的
# zh: 块表读取占用一个 stage，所以 3 个 stage 时 K 和 V 各只有一个缓冲区，每个 tile 都要等上一个用完才开始加载；
# zh: 5 个 stage 时各有两个，下一个 tile 在这个 tile 被使用时就在加载（scripts/attention_sass.py 会数缓冲区）。
# zh: 批大小为 256 时用时 0.181 ms，原来是 0.192 ms；批大小为 32 时 0.038 ms，原来是 0.045 ms。16 位的 tile
# zh: 字节数是两倍，在那里 3 个 stage 一样快或更快（完整的经过见第 24 章）。
DECODE_LAUNCH = {"float32": (64, 4, 3), "16-bit": (128, 4, 3), "fp8": (128, 4, 5)}
# en: Registers a thread of the float8 decode kernel (16-bit queries), capped with Triton's `maxnreg`: two
# en: buffers of K and V take 75 KB of shared memory, so an H200 SM holds 3 blocks of 4 warps, and 168 registers
# en: let 3 fit. (With one buffer, a cap of 128 let 4 fit; with two, 128 was slower than 168 at every batch
# en: measured, 32 to 256.)
# zh: float8 decode 内核（16 位查询）每个线程的寄存器数，用 Triton 的 `maxnreg` 设上限：K 和 V 各两个缓冲区占
# zh: 75 KB 共享内存，一个 H200 SM 能放 3 个 4-warp 的块，168 个寄存器正好让 3 个块都放得下。（只有一个缓冲区时，
# zh: 上限 128 能放下 4 个块；有两个缓冲区时，在测过的每个批大小（32 到 256）上，128 都比 168 慢。）
DECODE_MAX_REGISTERS = 168
# en: Decode of a few sequences over a 16-bit cache: when choose_num_splits gives MANY_SPLITS slices or more (one to
# en: four sequences of Qwen3-0.6B on an H200), each program's slice is a few tiles long, so shorter tiles of
# en: MANY_SPLITS_BLOCK_N keys give the cache more programs to read it with, and both kernels start early (PDL,
# en: programmatic_launch). Measured on the H200 with `python -m nanovllm.bench --latency` (its decode graph
# en: replayed alone, Qwen3-0.6B shapes, 512-768 tokens of context), milliseconds per step at batch 1 / 2 / 4:
# en: 0.652 / 0.823 / 1.276 as before, 0.631 / 0.788 / 1.256 with 32-key tiles, 0.580 / 0.720 / 1.256 with 32-key
# en: tiles and the early start of these kernels and of the fused q/k/v kernel. At batch 16 (4 slices) the
# en: same launch took 1.578 ms against 1.456, and the early start alone 1.499: larger batches keep the default.
# zh: 少数几个序列、16 位缓存时的 decode：choose_num_splits 给出 MANY_SPLITS 段或更多时（H200 上 Qwen3-0.6B 的一到四个
# zh: 序列），每个程序负责的那一段只有几个 tile 长，于是用每个 MANY_SPLITS_BLOCK_N 个键的更短 tile，让更多程序一起读
# zh: 缓存，两个内核也都提前启动（PDL，见 programmatic_launch）。在 H200 上用 `python -m nanovllm.bench --latency` 测量
# zh: （单独重放它的 decode graph，Qwen3-0.6B 的形状，上下文 512–768 个 token），批大小 1 / 2 / 4 时每步毫秒数：原来
# zh: 0.652 / 0.823 / 1.276，32 键 tile 时 0.631 / 0.788 / 1.256，32 键 tile 加上这两个内核和第 14 章的 q/k/v 内核
# zh: 提前启动时 0.580 / 0.720 / 1.256。批大小 16（4 段）时同样的启动用了 1.578 ms，原来 1.456，只提前启动也要 1.499：
# zh: 更大的批次保留默认配置。
MANY_SPLITS = 16
MANY_SPLITS_BLOCK_N = 32


@functools.cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` may start before the kernel ahead of them ends (programmatic dependent launch:
    Hopper and later, not in the interpreter)."""
    # zh: ``device`` 上的内核能否在它前面的内核结束之前启动（programmatic dependent launch：
    # zh: Hopper 及更新的 GPU，解释器中没有）。
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def decode_launch(device: torch.device, dtype: torch.dtype, fp8: bool = False) -> tuple[int, int, int]:
    """The default (BLOCK_N, num_warps, num_stages) of decode for queries of ``dtype`` over a cache (8-bit if fp8)."""
    # zh: decode 对 ``dtype`` 的查询、在缓存（fp8 时为 8 位）上的默认 (BLOCK_N, num_warps, num_stages)。
    if device.type != "cuda":
        # en: the interpreter: small tiles keep each numpy step cheap
        # zh: 解释器：小 tile 让每一步 numpy 计算都很便宜。
        return 16, 4, 1
    return DECODE_LAUNCH["fp8" if fp8 else "float32" if dtype == torch.float32 else "16-bit"]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        # en: interpreter: programs run one after another, never split by default
        # zh: 解释器：程序逐个依次运行，默认从不分段。
        return 1 << 20
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                         v_scales: torch.Tensor | None) -> bool:
    """Refuse what decode cannot run; returns whether the cache is float8."""
    # zh: 拒绝 decode 无法运行的情况；返回缓存是否为 float8。
    if k_cache.numel() == 0:
        raise ValueError("decode attention needs a KV cache, but the layer has none")
    fp8 = _check_cache(k_cache, v_cache, k_scales, v_scales)
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    if heads % kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kv_heads} KV heads of dim {k_cache.shape[3]}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dimension")
    return fp8


def _decode_kernel_launch(q: torch.Tensor, fp8: bool, num_splits: int,
                          launch: tuple[int, int, int] | None) -> tuple[int, int, int, bool, dict[str, int]]:
    """(BLOCK_N, num_warps, num_stages, early start, register cap) of the decode kernel: ``launch`` or the default."""
    # zh: decode 内核的 (BLOCK_N, num_warps, num_stages, 提前启动, 寄存器上限)：``launch`` 或默认值。
    bn, num_warps, num_stages = launch or decode_launch(q.device, q.dtype, fp8)
    # en: A few sequences over a 16-bit cache on a GPU: short tiles, and on Hopper an early start (MANY_SPLITS).
    # zh: GPU 上少数几个序列、16 位缓存：短 tile，在 Hopper 上再加提前启动（见 MANY_SPLITS）。
    few = q.device.type == "cuda" and not fp8 and q.dtype != torch.float32 and num_splits >= MANY_SPLITS
    if few and launch is None:
        bn = MANY_SPLITS_BLOCK_N
    pdl = few and programmatic_launch(q.device)
    capped = fp8 and q.device.type == "cuda" and q.dtype != torch.float32
    return bn, num_warps, num_stages, pdl, ({"maxnreg": DECODE_MAX_REGISTERS} if capped else {})


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context: Context,
    scale: float,
    num_splits: int | None = None,
    launch: tuple[int, int, int] | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, d] (one token per sequence) -> [B, H, d]; ``num_splits`` None = heuristic, 1 = plain kernel.

    ``launch`` = (BLOCK_N, num_warps, num_stages) overrides the default configuration (benchmarks).
    ``k_scales``/``v_scales``: a float8 cache's scales.
    """
    # zh: q [B, H, d]（每个序列一个 token）-> [B, H, d]；``num_splits`` 为 None = 启发式规则，1 = 普通内核。
    # zh:
    # zh: ``launch`` = (BLOCK_N, num_warps, num_stages) 覆盖默认配置（基准测试用）。
    # zh: ``k_scales``/``v_scales``：float8 缓存的缩放因子。
    fp8 = _check_decode_inputs(q, k_cache, v_cache, k_scales, v_scales)
    batch, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_tables = context.block_tables
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, kv_heads, max_context, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    bn, num_warps, num_stages, pdl, registers = _decode_kernel_launch(q, fp8, num_splits, launch)
    split = num_splits > 1
    # en: Split-K: partial outputs [B, H, S, d] and their log-sum-exp [B, H, S], both fp32.
    # zh: split-K：部分输出 [B, H, S, d] 及其 log-sum-exp [B, H, S]，都是 fp32。
    if split:
        part = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        dst, stride_s = part, part.stride(2)
    else:
        # en: lse is not written when SPLIT is False
        # zh: SPLIT 为 False 时不会写 lse。
        dst, lse, stride_s = out, out, 0
    # en: unused without FP8
    # zh: 不用 FP8 时用不到这两个参数。
    k_scales, v_scales = (k_scales, v_scales) if fp8 else (q, q)
    decode_attention_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context.context_lens, dst, lse, k_scales, v_scales,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1 if fp8 else 2), block_tables.stride(0), dst.stride(0), dst.stride(1), stride_s,
        k_scales.stride(0), k_scales.stride(1), scale * math.log2(math.e),
        num_splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=bn, BLOCK_SIZE=block_size, SPLIT=split,
        DOT_PRECISION=_dot_precision(q.dtype), FP8=fp8, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=pdl, **registers,
    )  # fmt: skip
    if split:
        decode_reduce_kernel[(batch, heads)](
            part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
            NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out

# %% [markdown] tags=["en"]
# **What the H200 measured.** `python -m nanovllm.bench --latency` also replays its decode graph
# alone. On Qwen3-0.6B's shapes with 512–768 tokens of context, the graph of one sequence took
# 0.652 ms a step with the default launch, 0.631 ms with 32-key tiles and 0.580 ms with the early
# start as well. At sixteen sequences (4 slices) the same launch took 1.578 ms against the default's
# 1.456 ms, so only the few sequences that split 16 ways or more get it.

# %% [markdown] tags=["zh"]
# **H200 上测得的结果：** `python -m nanovllm.bench --latency` 还会单独重放它的 decode graph。在 Qwen3-0.6B 的形状、
# 512–768 个 token 的上下文上，一个序列的 graph 每步用默认启动配置要 0.652 ms，改用 32 键的 tile 是 0.631 ms，再加上
# 提前启动是 0.580 ms。十六个序列（4 段）时，同样的启动配置用了 1.578 ms，默认配置只要 1.456 ms，所以只有切成 16 段或
# 更多的那几个序列才用它。

# %%
from nanovllm.book.recorded import recorded

few = recorded("11_triton_attention")["few_sequences"]
print(say("{card}, {date}: `{command}`", card=few.card, date=few.date, command=few.command))
# en: batch -> {decode launch: ms per step of the decode graph replayed alone}
# zh: 批大小 -> {decode 启动配置: 单独重放 decode graph 时每步的毫秒数}
steps = {int(batch): launches for batch, launches in few.figures["ms per step"].items()}
# en: The launches measured: the default, the 32-key tiles, the early start, and both (what ships).
# zh: 测过的启动配置：默认、32 键 tile、提前启动，以及两者一起（现在用的）。
LAUNCHES = ("default", "32-key tiles", "early start", "32-key tiles + early start")
assert all(launch in LAUNCHES for launches in steps.values() for launch in launches)
for batch, launches in steps.items():
    times = " | ".join(f"{say(launch)} {launches[launch]:.3f} ms" for launch in LAUNCHES if launch in launches)
    print(say("batch {batch:>2}:", batch=batch), times)
# en: The shipped launch is the fastest at one to four sequences, the default at sixteen; on a 132-SM H200 with 8 KV
# en: heads and a block table 4,096 tokens wide, choose_num_splits gives MANY_SPLITS slices or more exactly there.
# zh: 一到四个序列时，现在用的启动配置最快；十六个序列时默认配置最快。在有 132 个 SM 的 H200 上、8 个 KV 头、块表宽
# zh: 4,096 个 token 时，choose_num_splits 恰好在前者给出 MANY_SPLITS 段或更多。
shipped = LAUNCHES[-1]
assert all(launches[shipped] == min(launches.values()) for batch, launches in steps.items() if batch <= 4)
assert min(steps[16], key=steps[16].get) == "default"
assert [batch for batch in steps if choose_num_splits(batch, 8, 4096, 132) >= MANY_SPLITS] == [1, 2, 4]

# %% [markdown] tags=["en"]
# ## Build it: the backend, and choosing one
#
# `TritonBackend` is three one-line methods over the functions above; chapter 07's
# `attention_backend("triton")` builds one, and the model runner hands it to every layer.
# Which backend a run uses is the engine's `attention_backend` setting, resolved by `Config`
# (chapter 09): `"auto"` means Triton on a GPU and the torch reference on a CPU; `"triton"` on
# a CPU is accepted only when the kernels run in the interpreter.
#
# A third backend, `"flash-attn"`, is nano-vllm's choice: FlashAttention. Version 2, the one
# nano-vllm calls, ships no wheel for this machine (only sources that need a CUDA toolchain);
# version 4 (`pip install --pre flash-attn-4`, module `flash_attn.cute`) is Python on top of
# NVIDIA's CuTe DSL, compiled at the first call, for Hopper and newer GPUs. Its one entry point,
# `flash_attn_varlen_func`, covers our three cases: prefill without a cache (the step's packed K
# and V, `cu_seqlens_k`), prefill over a paged prefix (`page_table` is our block table; the keys'
# lengths go in `seqused_k`, since it refuses `cu_seqlens_k` with a page table), and decode (a
# batch of one query each against its pages, `seqused_k` = the context lengths). The store stays
# our kernel: `FlashAttnBackend` is a `TritonBackend` whose prefill, decode and warm-up call
# FlashAttention. Two things the H200 taught us: FlashAttention 4 loads whole pages when a page is
# exactly one key tile (block size 128 there), so the unwritten rows of a sequence's last page
# must hold finite numbers (zero times NaN is NaN): the engine's KV cache on a GPU starts as zeros (chapter 09);
# and it compiles a kernel per variant, so `warm_up` compiles both prefill variants before
# anything is timed. `Config` accepts the backend only on a CUDA GPU of compute capability 9 or
# more where `flash_attn.cute` can be imported, and says which of the three is missing; the
# GPU tests compare it with the torch reference (block sizes 16 to 256, a padded decode row,
# unused pages full of NaN) and run the engine on it with CUDA graphs, chunked prefill, prefix
# hits and forks. `"auto"` stays our Triton kernels: chapter 13's measurements say why. One case is
# left open: a request dropped because its logits were not finite (chapter 20) may leave NaN or
# infinities in blocks that go back to the free list, and under FlashAttention 4 a later sequence
# whose last page is such a block would read them; our kernels mask those rows.

# %% [markdown] tags=["zh"]
# ## 动手：后端，以及如何选择后端
#
# `TritonBackend` 的三个方法各只有一行，调用上面的函数；第 07 章的 `attention_backend("triton")` 构建它，
# 模型执行器再把它交给每一层。一次运行用哪个后端，由引擎的配置项 `attention_backend` 决定，并由 `Config`
# （第 09 章）解析：`"auto"` 在 GPU 上表示 Triton，在 CPU 上表示 torch 参考实现；在 CPU 上只有当内核以解释器
# 方式运行时才接受 `"triton"`。
#
# 第三个后端 `"flash-attn"` 是 nano-vllm 的选择：FlashAttention。nano-vllm 调用的第 2 版在这台机器上没有 wheel
# （只有需要 CUDA 工具链才能编译的源码）；第 4 版（`pip install --pre flash-attn-4`，模块 `flash_attn.cute`）是建立在
# NVIDIA CuTe DSL 之上的 Python 代码，第一次调用时编译，支持 Hopper 及更新的 GPU。它唯一的入口
# `flash_attn_varlen_func` 覆盖了我们的三种情形：没有缓存的 prefill（本步打包好的 K 和 V，`cu_seqlens_k`）、
# 读取分页前缀的 prefill（`page_table` 就是我们的块表；键的长度放进 `seqused_k`，因为有块表时它不接受
# `cu_seqlens_k`），以及 decode（一批查询，每个序列一个，对着各自的页计算，`seqused_k` 就是上下文长度）。存储仍用
# 我们自己的内核：`FlashAttnBackend` 是一个 `TritonBackend`，只是它的 prefill、decode 和预热改为调用
# FlashAttention。H200 教会了我们两件事：当一页恰好是一个键 tile 时（那里是块大小 128），FlashAttention 4 会整页
# 读取，所以序列最后一页中未写入的行必须是有限的数（0 × NaN 还是 NaN）：引擎在 GPU 上的 KV 缓存一开始就全是零
# （第 09 章）；另外，它为每个变体编译一个内核，所以 `warm_up` 在任何计时开始之前先编译好两个 prefill 变体。
# 只有在计算能力 9 或以上、能导入 `flash_attn.cute` 的 CUDA GPU 上，`Config` 才接受这个后端，并说明三个条件中缺了
# 哪一个；GPU 测试把它
# 与 torch 参考实现对照（块大小 16 到 256、一个填充的 decode 行、填满 NaN 的未用页），并让引擎在它上面带着
# CUDA Graph、分块 prefill、前缀命中和分叉运行。`"auto"` 仍然是我们的 Triton 内核：第 13 章的测量说明了原因。还有一种
# 情形没有处理：因 logits 不是有限值而被丢弃的请求（第 20 章）可能在归还空闲队列的块里留下 NaN 或无穷大；在
# FlashAttention 4 下，之后某个序列的最后一页若恰好是这样的块，就会读到它们；我们的内核会屏蔽这些行。

# %% backend
#| export
class TritonBackend:
    """Attention through the Triton kernels of this module (compiled on CUDA, interpreted on CPU)."""
    # zh: 通过本模块的 Triton 内核计算注意力（在 CUDA 上编译，在 CPU 上解释执行）。

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return round_trip_kv(x)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context: Context,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return prefill_attention(q, k, v, k_cache, v_cache, context, scale, None, k_scales, v_scales)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
        k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return decode_attention(q, k_cache, v_cache, context, scale, k_scales=k_scales, v_scales=v_scales)

    def warm_up(self, layer: Attention, dtype: torch.dtype | None = None) -> None:
        """Compile the prefill variants now (decode: when the runner captures its graphs, else in the first steps);
        ``dtype``: the model's (needed with a float8 cache)."""
        # zh: 现在就编译各 prefill 变体（decode：在执行器捕获它的图时编译，否则在最初几步里）；
        # zh: ``dtype``：模型的 dtype（float8 缓存需要它）。
        warm_up_prefill(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.k_cache, layer.v_cache,
                        layer.scale, dtype, layer.k_scales, layer.v_scales)  # fmt: skip


def _refuse_scales(k_scales: torch.Tensor | None) -> None:
    if k_scales is not None:
        raise ValueError("attention_backend='flash-attn' reads 16-bit pages only: kv_cache_dtype='fp8' needs 'triton'")


class FlashAttnBackend(TritonBackend):
    """Prefill and decode through FlashAttention 4 (package ``flash-attn-4``, module ``flash_attn.cute``) on a
    Hopper or newer GPU; the K/V store is TritonBackend's, this module's kernel. Verified on the H200."""
    # zh: 在 Hopper 或更新的 GPU 上通过 FlashAttention 4（包 ``flash-attn-4``，模块 ``flash_attn.cute``）做 prefill 和
    # zh: decode；K/V 的写入用 TritonBackend 的，也就是本模块的内核。已在 H200 上验证。

    def __init__(self) -> None:
        # en: Imported when the backend is built, not with this module: most machines do not have it.
        # zh: 构建后端时才导入，而不是随本模块一起导入：大多数机器上没有它。
        from flash_attn.cute import flash_attn_varlen_func

        self.attend = flash_attn_varlen_func

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context: Context,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _refuse_scales(k_scales)
        # en: no cached prefix: this step's own K and V, packed like q
        # zh: 没有已缓存前缀：只用本步自己的 K 和 V，与 q 一样紧凑排布。
        if context.block_tables is None:
            out, _ = self.attend(
                q, k, v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k,
                max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k, softmax_scale=scale, causal=True,
            )  # fmt: skip
            return out
        # en: A cached prefix: every key is read from the paged cache (the store above already wrote this step's).
        # en: FlashAttention takes the paged keys' lengths as seqused_k; it refuses cu_seqlens_k with a page table.
        # zh: 有已缓存的前缀：所有键都从分页缓存读取（上面的存储已经写入了本步的键）。FlashAttention 以 seqused_k
        # zh: 接收分页键的长度；有块表时它不接受 cu_seqlens_k。
        seqlens_k = (context.cu_seqlens_k[1:] - context.cu_seqlens_k[:-1]).to(torch.int32)
        out, _ = self.attend(
            q, k_cache, v_cache, cu_seqlens_q=context.cu_seqlens_q, seqused_k=seqlens_k,
            page_table=context.block_tables, max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
            softmax_scale=scale, causal=True,
        )  # fmt: skip
        return out

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
        k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        _refuse_scales(k_scales)
        # en: One query token per sequence: a batch of [B, 1, heads, d] against each sequence's pages.
        # zh: 每个序列一个查询 token：形状为 [B, 1, heads, d] 的一批，对着各自序列的页计算。
        out, _ = self.attend(
            q.unsqueeze(1), k_cache, v_cache, seqused_k=context.context_lens, page_table=context.block_tables,
            softmax_scale=scale, causal=True,
        )  # fmt: skip
        return out.squeeze(1)

    def warm_up(self, layer: Attention, dtype: torch.dtype | None = None) -> None:
        """Compile FlashAttention 4's prefill variants now (without and with a paged prefix), not in a timed step;
        it reads the first blocks of the cache and writes nothing. Decode compiles when the runner captures its
        graphs."""
        # zh: 现在就编译 FlashAttention 4 的 prefill 变体（不带和带分页前缀的），而不是在计时的某一步里编译；
        # zh: 它读取缓存的前几个块，什么都不写。decode 在执行器捕获它的图时编译。
        k_cache, v_cache = layer.k_cache, layer.v_cache
        q = torch.zeros(2, layer.num_heads, layer.head_dim, dtype=k_cache.dtype, device=k_cache.device)
        k = torch.zeros(2, layer.num_kv_heads, layer.head_dim, dtype=k_cache.dtype, device=k_cache.device)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=k_cache.device)
        self.prefill(q, k, k, k_cache, v_cache, Context(True, cu, cu, 2, 2), layer.scale)
        # en: three keys, whatever the block size: the first pages of the cache
        # zh: 三个键，不论块大小：用缓存最前面的几页。
        pages = -(-3 // k_cache.shape[1])
        prefix = Context(True, cu, cu + torch.tensor([0, 1], dtype=torch.int32, device=cu.device), 2, 3,
                         block_tables=torch.arange(pages, dtype=torch.int32, device=cu.device)[None])
        self.prefill(q, k, k, k_cache, v_cache, prefix, layer.scale)


# %% [markdown] tags=["en"]
# ## Wire it in: the engine chooses the kernels
#
# Chapter 09's `Config` knows one backend, and chapter 07's `attention_backend(name)` builds it.
# Both now learn the kernels. `resolve_attention_backend` takes the place of chapter 09's: the
# setting may name `"triton"` or `"flash-attn"`, and `"auto"` means the Triton kernels on a GPU
# and the torch reference on a CPU, where Triton runs only in its interpreter (for tests:
# `"triton"` on a CPU needs `TRITON_INTERPRET=1`). `attention_backend` builds the chosen kind,
# and imports this chapter's module only when a run asks for it, so a CPU run never imports
# Triton. The kernels' 8-bit path takes an 8-bit cache's scales, which each layer now has room
# for: `k_scales` and `v_scales`, None until chapter 24 allocates such a cache.

# %% [markdown] tags=["zh"]
# ## 接进去：引擎选用这些内核
#
# 第 09 章的 `Config` 只认识一个后端，第 07 章的 `attention_backend(name)` 负责构建它。现在两者都要认识这些内核。
# `resolve_attention_backend` 取代第 09 章的版本：配置项可以写 `"triton"` 或 `"flash-attn"`，`"auto"` 在 GPU 上
# 表示 Triton 内核，在 CPU 上表示 torch 参考实现，因为 Triton 在 CPU 上只能在解释器里运行（那是给测试用的：在 CPU 上
# 用 `"triton"` 需要设置 `TRITON_INTERPRET=1`）。`attention_backend` 构建选中的那一种，并且只在运行真的要求时才导入
# 本章的模块，所以 CPU 上的运行从不导入 Triton。内核的 8 位路径要用 8 位缓存的缩放因子，每一层现在为它们留了位置：
# `k_scales` 和 `v_scales`，在第 24 章分配这种缓存之前都是 None。

# %% choosing a backend
#| export config
import importlib.util
import os

import torch

import nanovllm.config as config_module
from nanovllm.book.literate import add_to_class
from nanovllm.config import _choice

# en: The kinds the attention_backend setting may name: the torch reference and the Triton and FlashAttention kernels.
# zh: 配置项 attention_backend 可以取的种类：torch 参考实现，以及 Triton 与 FlashAttention 的内核。
ATTENTION_BACKENDS = ("torch", "triton", "flash-attn")


@add_to_class(config_module)
def resolve_attention_backend(name: str, device: str, dtype: str) -> str:
    """The attention backend that the setting ``name`` asks for on ``device`` in ``dtype``: "auto" is the Triton
    kernels on a GPU and the torch reference on a CPU, where Triton runs only in its interpreter (for tests)."""
    # zh: 设置 ``name`` 在 ``device`` 上、以 ``dtype`` 所要的注意力后端："auto" 在 GPU 上是 Triton 内核，在 CPU 上
    # zh: 是 torch 参考实现，因为 CPU 上 Triton 只能在解释器中运行（供测试用）。
    name = _choice("attention_backend", name, ("auto", *ATTENTION_BACKENDS))
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    if name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (slow; meant for tests), or use attention_backend='torch'"
        )
    if name == "flash-attn":
        _check_flash_attn(device, dtype)
    return name


def _check_flash_attn(device: str, dtype: str) -> None:
    """Refuse attention_backend='flash-attn' where FlashAttention 4 cannot run."""
    # zh: 在 FlashAttention 4 无法运行的地方拒绝 attention_backend='flash-attn'。
    if device != "cuda":
        raise ValueError(f"attention_backend='flash-attn' needs a CUDA GPU, got device={device!r}")
    if dtype == "float32":
        raise ValueError("attention_backend='flash-attn' computes in 16 bits: use dtype='bfloat16' or 'float16' "
                         "(or attention_backend='triton' for float32)")
    if torch.cuda.get_device_capability()[0] < 9:
        raise ValueError(
            f"attention_backend='flash-attn' needs a Hopper or newer GPU (FlashAttention 4 has no paged KV before "
            f"compute capability 9.0); {torch.cuda.get_device_name()} is "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}: use attention_backend='triton'"
        )
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        raise ValueError(
            "attention_backend='flash-attn' needs FlashAttention 4: pip install --pre flash-attn-4 "
            "(module flash_attn.cute; the older flash-attn 2 package is not supported)"
        )


# %% building the chosen backend
#| export layers.attention
import importlib

import torch

import nanovllm.layers.attention as attention_module
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.layers.attention import Attention, AttentionBackend, TorchBackend


@add_to_init(Attention)
def _init_kv_scales(self) -> None:
    # en: An 8-bit cache's scales, one per token and KV head, [blocks, kv_heads, block_size]; None for a cache in
    # en: the model's dtype.
    # zh: 8 位缓存的缩放因子，每个 token 的每个 KV 头一个，形状 [blocks, kv_heads, block_size]；缓存使用模型的
    # zh: 数据类型时为 None。
    self.k_scales: torch.Tensor | None = None
    self.v_scales: torch.Tensor | None = None


@add_to_class(attention_module)
def attention_backend(name: str) -> AttentionBackend:
    """A backend of the kind ``name`` ("torch", "triton" or "flash-attn": Config checks it). The Triton kernels
    are imported only here, when asked for: a CPU run never imports Triton."""
    # zh: 种类为 ``name`` 的后端（"torch"、"triton" 或 "flash-attn"：由 Config 检查）。Triton 内核只在这里、
    # zh: 被要求时才导入：在 CPU 上运行永远不会导入 Triton。
    if name == "torch":
        return TorchBackend()
    kernels = importlib.import_module("nanovllm.layers.triton_attention")
    return {"triton": kernels.TritonBackend, "flash-attn": kernels.FlashAttnBackend}[name]()

# %% [markdown] tags=["en"]
# ## See it: the kernels against the reference
#
# The chapter-06 scenario again, now through the Triton backend: sequence B's first 8 tokens are
# cached by an earlier step, then one prefill step computes A and C from scratch and B's 3 new
# tokens against its cached prefix; then decode steps, plain and split-K. Every output is
# compared with `TorchBackend` on an identical copy of the cache. (On a CPU this runs in the
# interpreter, hence the tiny sizes.)

# %% [markdown] tags=["zh"]
# ## 看它运行：内核与参考实现对照
#
# 再走一遍第 07 章的场景，这次通过 Triton 后端：序列 B 的前 8 个 token 已被之前的步骤缓存，接着一个 prefill
# 步从头计算 A 和 C，并让 B 的 3 个新 token 关注它已缓存的前缀；然后是 decode 步，分别用普通版和 split-K 版。
# 每个输出都与在同样一份缓存副本上运行的 `TorchBackend` 比较。（在 CPU 上这是在解释器里运行的，所以尺寸很小。）

# %%
import time

from nanovllm.layers.attention import Attention
from nanovllm.layers.triton_attention import TritonBackend, decode_attention
from nanovllm.layers.context import reset_context, set_decode_context, set_prefill_context

torch.manual_seed(0)
H, KVH, D, BS, NUM_BLOCKS = 4, 2, 16, 16, 8
layers = {}
for backend in ("torch", "triton"):
    layer = Attention(H, D, scale=D**-0.5, num_kv_heads=KVH)
    if backend == "triton":
        layer.backend = TritonBackend()
    layer.k_cache = torch.zeros(NUM_BLOCKS, BS, KVH, D, device=DEVICE)
    layer.v_cache = torch.zeros(NUM_BLOCKS, BS, KVH, D, device=DEVICE)
    layers[backend] = layer

# en: prompt + decode tokens
# zh: 提示词 + decode 的 token 数。
lengths = {"A": 20, "B": 37, "C": 5}
tables = {"A": [3, 7], "B": [0, 1, 5], "C": [6]}
qkv = {n: (torch.randn(k, H, D, device=DEVICE), torch.randn(k, KVH, D, device=DEVICE),
           torch.randn(k, KVH, D, device=DEVICE)) for n, k in lengths.items()}


def step(parts: list[tuple[str, int, int]]) -> dict[str, float]:
    """Run one flat step on both backends; max |difference| of the outputs."""
    # zh: 在两个后端上各运行一个展平的步；返回输出之差的最大绝对值。
    q, k, v = (torch.cat([qkv[n][j][a:b] for n, a, b in parts]) for j in range(3))
    start = time.perf_counter()
    out_triton = layers["triton"](q, k, v)
    elapsed = time.perf_counter() - start
    out_torch = layers["torch"](q, k, v)
    return {"max_err": (out_triton - out_torch).abs().max().item(), "seconds": elapsed}


set_prefill_context([8], [8], [tables["B"]], BS, device=DEVICE)
print(format(say("cache B's prefix"), "<21"), step([("B", 0, 8)]))
set_prefill_context([17, 27, 3], [17, 35, 3], [tables[n] for n in "ABC"], BS, device=DEVICE)
report = {"prefill": step([("A", 0, 17), ("B", 8, 35), ("C", 0, 3)])}
print(f"{say('prefill with a prefix'):<21}", report["prefill"])
for i in range(2):
    ends = {"A": 18 + i, "B": 36 + i, "C": 4 + i}
    ctx = set_decode_context([ends[n] for n in "ABC"], [tables[n] for n in "ABC"], BS, device=DEVICE)
    report[f"decode {i}"] = step([(n, ends[n] - 1, ends[n]) for n in "ABC"])
    print(f"{say('decode {i}', i=i):<21}", report[f"decode {i}"])
q_last = torch.stack([qkv[n][0][ends[n] - 1] for n in "ABC"])
plain = decode_attention(q_last, layers["triton"].k_cache, layers["triton"].v_cache, ctx, D**-0.5, num_splits=1)
split = decode_attention(q_last, layers["triton"].k_cache, layers["triton"].v_cache, ctx, D**-0.5, num_splits=3)
report["split-K vs plain"] = {"max_err": (split - plain).abs().max().item()}
print(say("split-K (3 slices) vs plain decode: max |diff| {diff}", diff=f"{report['split-K vs plain']['max_err']:.1e}"))
reset_context()

# %% [markdown] tags=["en"]
# ## Check it

# %% [markdown] tags=["zh"]
# ## 验证

# %%
assert all(r["max_err"] < 1e-4 for r in report.values()), report
# en: store: bit-identical scatter
# zh: 存储：scatter 的结果逐位相同。
assert torch.equal(layers["triton"].k_cache, layers["torch"].k_cache)
assert torch.equal(layers["triton"].v_cache, layers["torch"].v_cache)
print(say("Triton backend == torch reference (prefill with a cached prefix, decode, split-K); caches identical"))

# %% [markdown] tags=["en"]
# ## Wire it in: the runner compiles ahead
#
# Triton compiles a kernel variant the first time a step launches it. So that no step of a real
# run pays for a compile, the runner now asks its backend to compile every prefill variant when it
# is built, once the KV cache exists (its `warm_up`: `warm_up_prefill` above; decode compiles when
# chapter 14 captures its graphs). These lines run at the end of the runner's constructor (appendix
# D's `add_to_init`), in inference mode like a step: compiled functions check how their inputs were
# made, and would compile again for tensors made outside it.

# %% [markdown] tags=["zh"]
# ## 接进去：执行器提前编译
#
# 一步第一次启动某个内核变体时，Triton 才编译它。为了让真实运行中没有哪一步要为编译买单，执行器现在在构建时、KV 缓存
# 就绪之后，就让它的后端把 prefill 的每个变体都编译好（后端的 `warm_up`，即上面的 `warm_up_prefill`；decode 内核在
# 第 14 章捕获 CUDA Graph 时编译）。这几行在执行器构造函数的末尾运行（附录 D 的 `add_to_init`），和一步一样在推理模式下
# 运行：编译好的函数会检查输入是怎样创建的，对推理模式之外创建的张量会重新编译。

# %% kernels compiled ahead
#| export engine.model_runner
import torch

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.model_runner import ModelRunner


@add_to_init(ModelRunner)
def _compile_attention_ahead(self) -> None:
    # en: On a GPU, every kernel variant of the attention backend is compiled now rather than in a step.
    # zh: 在 GPU 上，注意力后端的每个内核变体都现在编译，而不是在某一步里编译。
    if self.device.type == "cuda":
        self.compile_attention_kernels()


@add_to_class(ModelRunner)
@torch.inference_mode()
def compile_attention_kernels(self) -> None:
    """Let the attention backend compile, now, every kernel variant a step may need."""
    # zh: 让注意力后端现在就编译一步可能用到的每一种内核变体。
    warm_up = getattr(self.attention, "warm_up", None)
    if warm_up is not None and self.attention_layers:
        # en: every layer has the same shapes: one compiles them all
        # zh: 每层的形状都相同：编译一层就覆盖了所有层。
        warm_up(self.attention_layers[0], self.dtype)

# %%
# en: On this machine: the attention backend that "auto" gives the runner.
# zh: 在这台机器上："auto" 交给执行器的注意力后端。
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config

runner = ModelRunner(Config.from_kwargs(build_tiny_model("qwen3"), num_kvcache_blocks=8, kvcache_block_size=16))
print(say("attention backend: {backend}", backend=type(runner.attention).__name__))
assert type(runner.attention).__name__ == ("TritonBackend" if DEVICE == "cuda" else "TorchBackend")

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/triton_attention.py`: `store_kvcache`, `prefill_attention` (varlen,
#   causal, cached prefix read through the block table, GQA), `decode_attention` (plain or
#   split-K with `num_splits`, chosen by `choose_num_splits` when left out), the kernels behind
#   them, `TritonBackend` (what `attention_backend("triton")` builds), `FlashAttnBackend`
#   (`"flash-attn"`: FlashAttention 4, when it is installed, on Hopper or newer), and `INTERPRETED` /
#   `check_triton_device`, which chapter 12's sampler kernels share.
# - The engine uses them: `Config`'s `resolve_attention_backend` makes `"auto"` the kernels on a
#   GPU, `attention_backend` builds them, and on a GPU the runner compiles every prefill variant
#   before its first step (`compile_attention_kernels`).
#
# Chapter 12 writes the sampler in Triton; chapter 13 measures these kernels on a GPU: decode
# against the copy rate, prefill against SDPA's flash attention.
#
# ## Exercises
#
# 1. A decode batch has 8 sequences, the model 4 KV heads, the GPU 132 SMs, the block table is
#    64 blocks of 16 wide. How many slices does `choose_num_splits` choose?
# 2. Why does the prefill kernel need no mask at all for key tiles below `prefix + m·BLOCK_M`?
# 3. Split-K slice 0 has `lse = 3` and output `a`, slice 1 has `lse = 5` and output `b`
#    (base 2). What is the merged output?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/triton_attention.py`：`store_kvcache`、`prefill_attention`（变长、因果、通过块表读取已缓存
#   前缀、GQA）、`decode_attention`（普通版，或用 `num_splits` 指定的 split-K 版；不指定时由 `choose_num_splits`
#   选择），以及它们背后的内核；`TritonBackend`（`attention_backend("triton")` 构建的就是它）；
#   `FlashAttnBackend`（`"flash-attn"`：装有 FlashAttention 4 时，在 Hopper 或更新的 GPU 上可用）；还有采样器内核
#   共用的 `INTERPRETED` 与 `check_triton_device`（第 12 章采样器的内核也用它们）。
# - 引擎用上了它们：`Config` 的 `resolve_attention_backend` 让 `"auto"` 在 GPU 上选用这些内核，`attention_backend`
#   构建它们；在 GPU 上，执行器在第一步之前编译好 prefill 的每个变体（`compile_attention_kernels`）。
#
# 第 12 章用 Triton 写采样器；第 13 章在 GPU 上测量这些内核：decode 对比拷贝速度，prefill 对比 SDPA 的
# flash attention。
#
# ## 练习
#
# 1. 一个 decode 批次有 8 个序列，模型有 4 个 KV 头，GPU 有 132 个 SM，块表宽 64 块、每块 16 个 token。
#    `choose_num_splits` 会选几段？
# 2. 为什么 prefill 内核在 `prefix + m·BLOCK_M` 之前的键 tile 上完全不需要掩码？
# 3. split-K 的第 0 段 `lse = 3`、输出 `a`，第 1 段 `lse = 5`、输出 `b`（以 2 为底）。合并后的输出是什么？
#
# 下面的单元检查答案。

# %%
# en: 1: 32 programs < 132 SMs; 4 * 132 // 32 = 16 slices fit; 64 * 16 = 1024 keys allow 1024 // 128 = 8: so 8.
# zh: 1：32 个程序 < 132 个 SM；每 SM 四个程序可容纳 4 * 132 // 32 = 16 段；64 * 16 = 1024 个键只允许
# zh: 1024 // 128 = 8 段：所以是 8。
assert choose_num_splits(8, 4, 64 * 16, 132) == 8
# en: 2: query j of the tile sits at position prefix + m*BLOCK_M + j >= every such key, and those keys are < n_k.
# zh: 2：tile 中第 j 个查询位于 prefix + m*BLOCK_M + j，不小于所有这些键的位置，而且这些键都 < n_k。
for prefix, m, block_m in ((0, 0, 16), (5, 1, 16), (37, 3, 64)):
    first_query = prefix + m * block_m
    assert all(key <= first_query + j for key in range(first_query) for j in range(block_m))
# en: 3: weights 2^(3-5) = 1/4 and 2^0 = 1: (a/4 + b) / (5/4) = (a + 4b) / 5. Checked with the kernel itself:
# zh: 3：权重为 2^(3-5) = 1/4 与 2^0 = 1：(a/4 + b) / (5/4) = (a + 4b) / 5。用内核本身验证：
from nanovllm.layers.triton_attention import decode_reduce_kernel

a, b = torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE)
parts = torch.stack([a, b]).view(1, 1, 2, 16).contiguous()
lse = torch.tensor([3.0, 5.0], device=DEVICE).view(1, 1, 2)
merged = torch.empty(1, 1, 16, device=DEVICE)
decode_reduce_kernel[(1, 1)](parts, lse, merged, 2, *parts.stride()[:3], *merged.stride()[:2],
                             NUM_HEADS=1, HEAD_DIM=16, BLOCK_D=16, SPLITS_PAD=2, PDL=False)
torch.testing.assert_close(merged.view(16), (a + 4 * b) / 5)
print(say("all exercise answers check out"))
