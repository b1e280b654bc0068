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
# # 16 · Tensor parallelism: layers that split
#
# **Goal.** Make the linear and embedding layers of chapter 06 split across GPUs. Chapter 06
# wrote them in the form that tensor parallelism needs: each layer knows how its weight is cut
# across `tp_size` ranks, which slice rank `tp_rank` keeps, and how to load that slice from a full
# checkpoint tensor (`weight_loader`). This chapter adds what one process never needed: where the
# rank and size come from, and where the ranks must talk (an **all-reduce** or a **gather**).
# Chapter 17 then runs those ranks as processes (gloo on a CPU, NCCL on GPUs) behind the
# engine, and gets the same tokens as one process.
#
# The layers still run at world size 1 on every laptop: the rank and size come from
# `torch.distributed` when it is initialized, else they are 0 and 1, and no communication
# happens. This chapter *simulates* ranks in one process (a constructor argument picks the rank)
# and checks that the shards, put back together, compute exactly what the unsplit layer computes.

# %% [markdown] tags=["zh"]
# # 16 · 张量并行：切分的层
#
# **目标：** 让第 06 章的线性层和嵌入层能切分到多张 GPU 上。第 06 章写它们时已经采用了张量并行需要的形式：
# 每一层都知道自己的权重如何切分到 `tp_size` 个 rank 上、rank `tp_rank` 保留哪一片、如何从完整的检查点张量中
# 加载这一片（`weight_loader`）。本章补上单进程从来用不到的东西：rank 和进程数从哪里来，以及各 rank 必须在哪里
# 通信（**all-reduce** 或 **gather**）。第 17 章再让这些 rank 作为进程在引擎背后运行（CPU 上用 gloo，GPU 上用
# NCCL），得到与单进程相同的 token。
#
# 这些层在每台笔记本上仍以 world size 1 运行：`torch.distributed` 已初始化时从中读取 rank 和进程数，否则分别是
# 0 和 1，也不做任何通信。本章在一个进程里*模拟*多个 rank（用构造参数指定 rank），并检查各分片拼回去后，算出的
# 结果与不切分的层完全相同。

# %% [markdown] tags=["en"]
# ## The idea: cut columns, then rows, reduce once
#
# A linear layer computes `y = x Wᵀ` with `W` of shape `[out, in]`. Two ways to split it:
#
# - **Column parallel**: each rank keeps `out / tp` *output* rows of `W`. Every rank gets the
#   whole `x` and computes a slice of `y`. No communication, but `y` is scattered.
# - **Row parallel**: each rank keeps `in / tp` *input* columns of `W`. It needs only its slice
#   of `x` and produces a *partial sum* of the whole `y`: the ranks must **all-reduce** (add up).
#
# Put a column-parallel layer before a row-parallel one and the scattered `y` of the first is
# exactly the sliced `x` the second wants: attention (`qkv_proj` splits by heads, each rank
# attends with its own heads, `o_proj` reduces) and the MLP (`gate_up_proj`, then `down_proj`)
# each cost **one all-reduce**. The embedding splits the vocabulary: a rank looks up only the
# tokens it owns and the others contribute zeros, so an all-reduce completes the rows. The LM
# head splits the vocabulary too, and rank 0 **gathers** the logit slices because it samples.

# %% [markdown] tags=["zh"]
# ## 思路：先切列，再切行，只归约一次
#
# 线性层计算 `y = x Wᵀ`，其中 `W` 的形状是 `[out, in]`。有两种切法：
#
# - **列并行**：每个 rank 保留 `W` 的 `out / tp` 个*输出*行。每个 rank 拿到完整的 `x`，算出 `y` 的一片。
#   不需要通信，但 `y` 分散在各处。
# - **行并行**：每个 rank 保留 `W` 的 `in / tp` 个*输入*列。它只需要 `x` 的一片，算出的是整个 `y` 的
#   *部分和*：各 rank 必须做 **all-reduce**（相加）。
#
# 把列并行层放在行并行层前面，前者分散的 `y` 正好是后者需要的那片 `x`：注意力（`qkv_proj` 按头切分，
# 每个 rank 用自己的头做注意力，`o_proj` 做归约）和 MLP（`gate_up_proj` 之后接 `down_proj`）都只需要
# **一次 all-reduce**。嵌入层切分词表：每个 rank 只查找自己拥有的 token，其余 rank 贡献零，all-reduce
# 之后每一行就完整了。LM head 也切分词表，由于采样在 rank 0 上进行，rank 0 **gather**（收集）各片 logits。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "rank {rank}: qkv weight {shape} = q rows of heads {heads} + {kv} k head + {kv} v head":
        "rank {rank}：qkv 权重 {shape} = 头 {heads} 的 q 行 + {kv} 个 k 头 + {kv} 个 v 头",
    "rank {rank}: gate_up {gate_up}, down {down}, partial sum of y[0,0] = {partial:+.3f}":
        "rank {rank}：gate_up {gate_up}，down {down}，y[0,0] 的部分和 = {partial:+.3f}",
    "all-reduce of the partial sums = {total:+.3f}; max |error| vs unsplit MLP {error:.1e}":
        "部分和的 all-reduce = {total:+.3f}；与未切分的 MLP 相比，最大 |误差| {error:.1e}",
    "every layer kind reassembles exactly at tp = 1, 2, 4": "tp = 1、2、4 时，每种层都能精确拼回原样",
    "all exercise answers check out": "练习答案全部验证通过",
    # en: the drawing of a layer over the ranks
    # zh: 一层切分到各 rank 上的示意图
    "vocab rows": "词表行",
    "column: heads": "列并行：按头",
    "own heads + KV": "自己的头 + KV",
    "row: heads": "行并行：按头",
    "column": "列并行",
    "local": "本地",
    "row": "行并行",
    "rank 0 only": "只在 rank 0",
    "idle": "空闲",
    "dashed: the ranks communicate (sum partial results, or collect logit slices on rank 0); everything else is "
    "local, each rank with its own KV heads in its own KV cache":
        "虚线：rank 之间通信（把部分结果相加，或把 logits 的各片收集到 rank 0）；其余都在本地完成，"
        "每个 rank 在自己的 KV 缓存里存自己的 KV 头",
})

# %% tp drawing
#| hide
from IPython.display import SVG, display


def tp_layer_svg(tp: int = 2) -> str:
    """One decoder layer split over `tp` ranks: shards per rank, and the points where ranks talk."""
    # zh: 切分到 `tp` 个 rank 上的一个解码器层：每个 rank 的分片，以及各 rank 之间通信的位置。
    stages = [
        ("embed_tokens", "vocab rows", "all-reduce"),
        ("qkv_proj", "column: heads", None),
        ("attention", "own heads + KV", None),
        ("o_proj", "row: heads", "all-reduce"),
        ("gate_up_proj", "column", None),
        ("SiluAndMul", "local", None),
        ("down_proj", "row", "all-reduce"),
        ("lm_head", "vocab rows", "gather → rank 0"),
        ("sampler", "rank 0 only", None),
    ]
    colors = ["#e3f2fd", "#fff8e1", "#e8f5e9", "#fce4ec"]
    box_w, gap, top, rank_h = 104, 22, 40, 64
    width = 20 + len(stages) * (box_w + gap)
    height = top + tp * rank_h + 70
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif">',
        f'<title lang="en">One decoder layer split over {tp} ranks: each rank holds a shard of every stage, from '
        'embed_tokens to the sampler; the ranks all-reduce after embed_tokens, o_proj and down_proj, and gather '
        'the logits on rank 0.</title>'
        f'<title lang="zh">一个解码层切分到 {tp} 个 rank 上：从 embed_tokens 到采样器，每个 rank 持有每一级的一片；'
        'rank 之间在 embed_tokens、o_proj、down_proj 之后做 all-reduce，并把 logits 汇集到 rank 0。</title>',
        '<defs><marker id="tp-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#37474f"/></marker></defs>',
    ]
    for s, (name, how, talk) in enumerate(stages):
        x = 20 + s * (box_w + gap)
        parts.append(f'<text x="{x + box_w / 2}" y="24" text-anchor="middle" font-family="monospace" '
                     f'font-size="12">{name}</text>')
        for r in range(tp):
            y = top + r * rank_h
            idle = how == "rank 0 only" and r > 0
            fill, label = ("#eceff1", say("idle")) if idle else (colors[r % 4], say(how) if how == "rank 0 only" else
                                                                  f"{say(how)} {r + 1}/{tp}")
            parts.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="{rank_h - 16}" rx="6" '
                         f'fill="{fill}" stroke="#37474f"/>')
            parts.append(f'<text x="{x + box_w / 2}" y="{y + 20}" text-anchor="middle" font-size="11">'
                         f'rank {r}</text>')
            parts.append(f'<text x="{x + box_w / 2}" y="{y + 36}" text-anchor="middle" font-size="10" '
                         f'fill="#546e7a">{label}</text>')
            if s + 1 < len(stages):
                parts.append(f'<path d="M{x + box_w},{y + 24} L{x + box_w + gap - 2},{y + 24}" stroke="#37474f" '
                             'marker-end="url(#tp-arrow)"/>')
        if talk:
            y0, y1 = top - 6, top + tp * rank_h - 10
            parts.append(f'<rect x="{x - 4}" y="{y0}" width="{box_w + 8}" height="{y1 - y0}" rx="8" fill="none" '
                         'stroke="#d84315" stroke-width="2" stroke-dasharray="6 4"/>')
            parts.append(f'<text x="{x + box_w / 2}" y="{y1 + 20}" text-anchor="middle" font-size="12" '
                         f'fill="#d84315">{talk}</text>')
    parts.append(f'<text x="20" y="{height - 12}" font-size="11" fill="#546e7a">'
                 + say("dashed: the ranks communicate (sum partial results, or collect logit slices on rank 0); "
                       "everything else is local, each rank with its own KV heads in its own KV cache") + "</text>")
    parts.append("</svg>")
    return "".join(parts)


display(SVG(tp_layer_svg()))

# %% [markdown] tags=["en"]
# ## Build it: rank and size
#
# Chapter 06 wrote the layers with their shares already in them: every layer asks `tp_world()`
# for its rank and world size once, at construction, and keeps `1 / tp_size` of the matrix.
# Explicit arguments win (that is how this chapter and the tests simulate ranks); otherwise
# `tp_world` asks `process_world()`, which in chapter 06 said "rank 0 of 1". Now it asks
# `torch.distributed`, once a process group is up (chapter 17 starts one per rank).

# %% [markdown] tags=["zh"]
# ## 动手：rank 与进程数
#
# 第 06 章写这些层时就已经把“份”写进去了：每一层在构造时向 `tp_world()` 查询一次自己的 rank 和进程数
# （world size），只保留矩阵的 `1 / tp_size`。显式参数优先（本章和测试正是这样模拟多个 rank 的）；否则
# `tp_world` 去问 `process_world()`，它在第 06 章里总是回答“1 个中的第 0 个”。现在它去问 `torch.distributed`，
# 前提是进程组已经建立（第 17 章为每个 rank 建立一个）。

# %% default module
#| default_exp layers.linear

# %% tp world
#| export
import torch.distributed as dist

import nanovllm.layers.linear as linear
from nanovllm.book.literate import add_to_class


@add_to_class(linear)
def process_world() -> tuple[int, int]:
    """(rank, size) of this process in torch.distributed's group once one is initialized, else (0, 1)."""
    # zh: 初始化了 torch.distributed 的组之后，本进程在组中的 (rank, size)，否则为 (0, 1)。
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

# %% [markdown] tags=["en"]
# ## Build it: the shares of the linear layers
#
# What each rank keeps was settled in chapter 05. Its `weight_loader` receives the **full**
# checkpoint tensor and cuts out its rank's slice along its `tp_dim` (`load_rank_slice`: rows
# for a column-parallel layer, columns for a row-parallel one). Merged layers (`qkv_proj` holds
# q, k and v; `gate_up_proj` holds gate and up) load a part the same way (`load_part`), and every
# part is cut by rank: with GQA, q has more heads than k and v, so the three parts have
# different sizes, and rank `r` keeps q heads `r·H/tp …` together with exactly the KV heads they
# use. With one process each of these slices was the whole part.
#
# What chapter 06 left out is the talking. A row-parallel layer's output on one rank is only a
# *partial sum*: `forward_local` computes it (the bias on rank 0 alone, so that the sum has it
# once) and `forward` adds the ranks' partial sums with an all-reduce.

# %% [markdown] tags=["zh"]
# ## 动手：线性层的各份
#
# 每个 rank 保留什么，第 06 章已经定好了。它的 `weight_loader` 接收**完整**的检查点张量，由层自己沿它的
# `tp_dim` 切出本 rank 的那一片（`load_rank_slice`：列并行层切行，行并行层切列）。合并层（`qkv_proj` 包含
# q、k、v；`gate_up_proj` 包含 gate 和 up）用同样的方式加载每一部分（`load_part`），每部分都按 rank 切分：在
# GQA 中 q 的头比 k、v 多，三部分大小不同，rank `r` 保留从 `r·H/tp` 开始的 q 头，以及它们用到的那些 KV 头。
# 只有一个进程时，这些切片都是整个部分。
#
# 第 06 章没写的是通信。行并行层在一个 rank 上的输出只是*部分和*：`forward_local` 算出它（偏置只由 rank 0
# 加，这样求和后恰好有一份），`forward` 再用 all-reduce 把各 rank 的部分和加起来。

# %% linear layers
#| export
import torch
import torch.nn.functional as F

from nanovllm.layers.linear import RowParallelLinear


@add_to_class(RowParallelLinear)
def forward_local(self, x: torch.Tensor) -> torch.Tensor:
    """This rank's partial sum (the bias only on rank 0, so the reduced sum has it once)."""
    # zh: 本 rank 的部分和（偏置只在 rank 0 上加，这样归约后的和里只有一份偏置）。
    return F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)


@add_to_class(RowParallelLinear)
def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.forward_local(x)
    if self.tp_size > 1:
        dist.all_reduce(y)
    return y

# %% [markdown] tags=["en"]
# ## Build it: the vocabulary-parallel embedding and LM head
#
# The embedding keeps `vocab / tp` consecutive rows (chapter 06 set `vocab_start_idx` and
# `vocab_end_idx`). Its `forward_local`, also from chapter 06, maps the token ids that the rank
# owns to local rows, looks up everything (a foreign id is sent to row 0) and zeroes the foreign
# rows; with one rank it was a plain lookup. What is new here is the hook `sum_over_ranks`,
# which chapter 06 left returning its input: an all-reduce adds the one non-zero contribution
# per token.
#
# The LM head reuses the same split: each rank multiplies by its slice of the vocabulary
# (`forward_local`), and its hook `gather_slices` now has rank 0, which samples, **gather** the
# slices in rank order; the other ranks return `None`.

# %% [markdown] tags=["zh"]
# ## 动手：词表并行的嵌入层与 LM head
#
# 嵌入层保留 `vocab / tp` 个连续的行（第 06 章已设好 `vocab_start_idx` 和 `vocab_end_idx`）。它的 `forward_local`
# 同样来自第 06 章：把本 rank 拥有的 token id 映射成本地行号，全部查一遍（不属于自己的 id 被送到第 0 行），再把
# 不属于自己的行清零；只有一个 rank 时，它就是普通的查表。这里新加的是接缝 `sum_over_ranks`，第 06 章让它原样
# 返回输入：现在由 all-reduce 把每个 token 唯一的非零贡献加起来。
#
# LM head 沿用同样的切分：每个 rank 与自己那一片词表相乘（`forward_local`），它的接缝 `gather_slices` 现在让
# 负责采样的 rank 0 按 rank 顺序 **gather**（收集）各片结果；其他 rank 返回 `None`。

# %% embedding and lm head
#| export layers.embed_head
import torch
import torch.distributed as dist

from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding


@add_to_class(VocabParallelEmbedding)
def sum_over_ranks(self, y: torch.Tensor) -> torch.Tensor:
    """Each token's row, whole: the sum of what every rank looked up (all zeros but the owner's)."""
    # zh: 每个 token 完整的行：各 rank 查到的结果之和（除了拥有者之外全是零）。
    if self.tp_size > 1:
        dist.all_reduce(y)
    return y


@add_to_class(ParallelLMHead)
def gather_slices(self, logits: torch.Tensor) -> torch.Tensor | None:
    """The logits over the whole vocabulary on rank 0, its slices in rank order; None on the other ranks."""
    # zh: rank 0 上整个词表的 logits，各片按 rank 顺序拼接；其他 rank 上为 None。
    if self.tp_size == 1:
        return logits
    slices = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
    dist.gather(logits, slices, 0)
    return torch.cat(slices, -1) if self.tp_rank == 0 else None

# %% [markdown] tags=["en"]
# ## See it: two simulated ranks
#
# We load the same full weights into rank 0 and rank 1 of each layer kind and look at what each
# rank holds. Column-parallel shards are concatenated back, row-parallel partial sums are added:
# this is what the collectives do. Everything runs in one process: `forward_local` is the
# per-rank computation without the communication.

# %% [markdown] tags=["zh"]
# ## 看它运行：两个模拟的 rank
#
# 对每种层，把同一份完整权重加载到 rank 0 和 rank 1 上，看看各 rank 持有什么。列并行的分片拼接回去，行并行
# 的部分和相加：这正是集合通信做的事。所有计算都在一个进程里：`forward_local` 就是不含通信的单个 rank 的计算。


# %%
import torch
import torch.nn.functional as F

from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

torch.manual_seed(0)
TP, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 8, 4, 2, 2, 6
x = torch.randn(3, HIDDEN)

# en: qkv: q has 4 heads, k and v have 2 (GQA); each rank keeps 2 q heads and 1 k and 1 v head.
# zh: qkv：q 有 4 个头，k 和 v 各 2 个（GQA）；每个 rank 保留 2 个 q 头、1 个 k 头和 1 个 v 头。
wq = torch.arange(HEADS * HEAD_DIM * HIDDEN, dtype=torch.float32).view(-1, HIDDEN) / 100
wk, wv = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(KV_HEADS * HEAD_DIM, HIDDEN)
ranks = [QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp_rank=r, tp_size=TP) for r in range(TP)]
for layer in ranks:
    for name, w in zip("qkv", (wq, wk, wv), strict=True):
        layer.weight.weight_loader(layer.weight, w, name)
    print(say("rank {rank}: qkv weight {shape} = q rows of heads {heads} + {kv} k head + {kv} v head",
              rank=layer.tp_rank, shape=tuple(layer.weight.shape), kv=layer.num_kv_heads,
              heads=[int(layer.weight[i * HEAD_DIM, 0] * 100) // (HEAD_DIM * HIDDEN) for i in range(layer.num_heads)]))

# en: the MLP: gate_up (column) -> SiLU(gate) * up (local) -> down (row) -> add the partial sums.
# zh: MLP：gate_up（列并行）-> SiLU(gate) * up（本地）-> down（行并行）-> 把部分和相加。
from nanovllm.layers.activation import SiluAndMul

INTER = 12
w_gate, w_up, w_down = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER)
full_mlp = w_down @ (F.silu(w_gate @ x.T) * (w_up @ x.T))
partials = []
for r in range(TP):
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp_rank=r, tp_size=TP)
    gate_up.weight.weight_loader(gate_up.weight, w_gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, w_up, 1)
    down = RowParallelLinear(INTER, HIDDEN, tp_rank=r, tp_size=TP)
    down.weight.weight_loader(down.weight, w_down)
    partials.append(down.forward_local(SiluAndMul()(gate_up(x))))
    print(say("rank {rank}: gate_up {gate_up}, down {down}, partial sum of y[0,0] = {partial:+.3f}", rank=r,
              gate_up=tuple(gate_up.weight.shape), down=tuple(down.weight.shape), partial=partials[-1][0, 0].item()))
mlp_error = (sum(partials) - full_mlp.T).abs().max().item()
print(say("all-reduce of the partial sums = {total:+.3f}; max |error| vs unsplit MLP {error:.1e}",
          total=sum(partials)[0, 0].item(), error=mlp_error))

# %% [markdown] tags=["en"]
# ## Check it
#
# Each kind of layer, split over 2 and 4 simulated ranks, reassembles into the unsplit layer:
# column shards concatenate, row partial sums add (with the bias counted once), embedding
# contributions add, LM-head slices concatenate. The GQA grouping survives the split: rank `r`'s
# query head `h` uses its local KV head `h // (H / KVH)`, which is global KV head
# `r·KVH/tp + h // (H / KVH)` — the one the unsplit layer pairs it with.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 每种层切成 2 份和 4 份模拟 rank 后，都能拼回不切分的层：列并行的分片拼接，行并行的部分和相加（偏置只算一次），
# 嵌入层的贡献相加，LM head 的各片拼接。GQA 的分组在切分后依然成立：rank `r` 的查询头 `h` 使用本地 KV 头
# `h // (H / KVH)`，也就是全局 KV 头 `r·KVH/tp + h // (H / KVH)`——正是不切分时与它配对的那个。

# %%
def check_split(tp: int) -> None:
    w, b = torch.randn(8, HIDDEN), torch.randn(8)
    full = ReplicatedLinear(HIDDEN, 8, bias=True)
    full.weight.weight_loader(full.weight, w)
    full.bias.weight_loader(full.bias, b)
    expected = full(x)
    cols, rows = [], []
    for r in range(tp):
        col = ColumnParallelLinear(HIDDEN, 8, bias=True, tp_rank=r, tp_size=tp)
        col.weight.weight_loader(col.weight, w)
        col.bias.weight_loader(col.bias, b)
        cols.append(col(x))
        row = RowParallelLinear(HIDDEN, 8, bias=True, tp_rank=r, tp_size=tp)
        row.weight.weight_loader(row.weight, w)
        row.bias.weight_loader(row.bias, b)
        rows.append(row.forward_local(x[:, r * HIDDEN // tp : (r + 1) * HIDDEN // tp]))
    torch.testing.assert_close(torch.cat(cols, dim=-1), expected)
    torch.testing.assert_close(sum(rows), expected)

    table, tokens = torch.randn(8, HIDDEN), torch.tensor([0, 7, 3, 4, 4])
    embeds, heads = [], []
    for r in range(tp):
        emb = VocabParallelEmbedding(8, HIDDEN, tp_rank=r, tp_size=tp)
        emb.weight.weight_loader(emb.weight, table)
        embeds.append(emb.forward_local(tokens))
        head = ParallelLMHead(8, HIDDEN, tp_rank=r, tp_size=tp)
        head.weight.weight_loader(head.weight, table)
        heads.append(head.forward_local(x))
    torch.testing.assert_close(sum(embeds), table[tokens])
    torch.testing.assert_close(torch.cat(heads, dim=-1), x @ table.T)

    heads_total, kv_total, d = 8, 4, 2
    wqkv = torch.randn((heads_total + 2 * kv_total) * d, HIDDEN)
    q_full, k_full, _ = (x @ wqkv.T).split([heads_total * d, kv_total * d, kv_total * d], -1)
    group = heads_total // kv_total
    for r in range(tp):
        qkv = QKVParallelLinear(HIDDEN, d, heads_total, kv_total, tp_rank=r, tp_size=tp)
        # en: a merged checkpoint tensor: shard_id None
        # zh: 合并好的检查点张量：shard_id 为 None。
        qkv.weight.weight_loader(qkv.weight, wqkv)
        q, k, _ = qkv(x).split([qkv.num_heads * d, qkv.num_kv_heads * d, qkv.num_kv_heads * d], -1)
        for h in range(qkv.num_heads):
            global_h = r * qkv.num_heads + h
            torch.testing.assert_close(q[:, h * d : (h + 1) * d], q_full[:, global_h * d : (global_h + 1) * d])
            local_kv, global_kv = h // group, global_h // group
            assert global_kv == r * qkv.num_kv_heads + local_kv
            torch.testing.assert_close(k[:, local_kv * d : (local_kv + 1) * d],
                                       k_full[:, global_kv * d : (global_kv + 1) * d])


for tp in (1, 2, 4):
    check_split(tp)
assert mlp_error < 1e-4
print(say("every layer kind reassembles exactly at tp = 1, 2, 4"))

# %% [markdown] tags=["en"]
# The model of a single process uses exactly these classes with rank 0 of 1, and bad shapes are
# caught by name, for example 3 KV heads on 2 ranks, or a checkpoint tensor of the wrong size:

# %% [markdown] tags=["zh"]
# 单进程的模型使用的正是这些类（1 个中的第 0 个）；形状不对会被指名道姓地发现，例如 3 个 KV 头分到 2 个 rank
# 上，或者检查点张量尺寸不对：

# %%
single = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
assert (single.tp_rank, single.tp_size) == (0, 1)
for bad in (
    lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, 6, 3, tp_rank=0, tp_size=2),
    lambda: single.weight.weight_loader(single.weight, torch.randn(5, HIDDEN), "k"),
    lambda: single.weight.weight_loader(single.weight, wk, "x"),
):
    try:
        bad()
        raise AssertionError("accepted")
    except ValueError as error:
        print("ValueError:", error)

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/linear.py`: `process_world` asks `torch.distributed` for the rank and size,
#   and `RowParallelLinear` all-reduces its partial sums (`forward_local`, then `forward`).
# - `nanovllm/layers/embed_head.py`: `VocabParallelEmbedding.sum_over_ranks` (all-reduce) and
#   `ParallelLMHead.gather_slices` (gather on rank 0), the two hooks that chapter 06 left.
#
# Chapter 17 runs the ranks as processes.
#
# ## Exercises
#
# 1. Qwen3-0.6B has 16 query heads, 8 KV heads, head_dim 128, hidden 1024. How many rows does
#    rank 1's `qkv_proj` weight have at `tp_size=2`?
# 2. Why is the bias of a row-parallel layer added by rank 0 only?
# 3. A vocabulary of 151,936 tokens on 2 ranks: which rank looks up token 80,000, and at which
#    local row?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/linear.py`：`process_world` 向 `torch.distributed` 询问 rank 和进程数，`RowParallelLinear`
#   对部分和做 all-reduce（先 `forward_local`，再 `forward`）。
# - `nanovllm/layers/embed_head.py`：`VocabParallelEmbedding.sum_over_ranks`（all-reduce）和
#   `ParallelLMHead.gather_slices`（在 rank 0 上 gather），也就是第 06 章留下的两个接缝。
#
# 第 17 章让各 rank 作为进程运行。
#
# ## 练习
#
# 1. Qwen3-0.6B 有 16 个查询头、8 个 KV 头，head_dim 为 128，hidden 为 1024。`tp_size=2` 时，rank 1 的
#    `qkv_proj` 权重有多少行？
# 2. 为什么行并行层的偏置只由 rank 0 加上？
# 3. 词表有 151,936 个 token，分到 2 个 rank：token 80,000 由哪个 rank 查找？在本地第几行？

# %%
# en: 1: (16 + 2 * 8) * 128 / 2 = 2048 rows.
# zh: 1：(16 + 2 * 8) * 128 / 2 = 2048 行。
assert QKVParallelLinear(1024, 128, 16, 8, tp_rank=1, tp_size=2).weight.shape == (2048, 1024)
# en: 2: the all-reduce adds the ranks' outputs; a bias added on every rank would count tp_size times.
# zh: 2：all-reduce 把各 rank 的输出相加；如果每个 rank 都加偏置，就会被加 tp_size 次。
w2, b2, x2 = torch.randn(3, 4), torch.randn(3), torch.randn(5, 4)
halves = []
for r in range(2):
    half = RowParallelLinear(4, 3, bias=True, tp_rank=r, tp_size=2)
    half.weight.weight_loader(half.weight, w2)
    half.bias.weight_loader(half.bias, b2)
    halves.append((half, x2[:, 2 * r : 2 * r + 2]))
# en: what the all-reduce adds up
# zh: all-reduce 要相加的各部分。
reduced = sum(half.forward_local(xs) for half, xs in halves)
bias_everywhere = sum(torch.nn.functional.linear(xs, half.weight, half.bias) for half, xs in halves)
torch.testing.assert_close(reduced, torch.nn.functional.linear(x2, w2, b2))
# en: one bias too many
# zh: 偏置多加了一次。
torch.testing.assert_close(bias_everywhere - reduced, b2.expand(5, 3))
# en: 3: 151936 / 2 = 75968 rows per rank: rank 1, local row 80000 - 75968 = 4032.
# zh: 3：每个 rank 151936 / 2 = 75968 行：rank 1，本地第 80000 - 75968 = 4032 行。
owner = VocabParallelEmbedding(151936, 1, tp_rank=1, tp_size=2)
assert owner.vocab_start_idx <= 80000 < owner.vocab_end_idx and 80000 - owner.vocab_start_idx == 4032
print(say("all exercise answers check out"))
