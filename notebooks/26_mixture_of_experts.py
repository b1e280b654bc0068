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
# # 26 · Mixture of experts: where each token goes
#
# **Goal.** Run Qwen3-MoE models (Qwen3-30B-A3B is the one people ask for) token-exact with
# `transformers`. In a mixture-of-experts (MoE) layer the MLP is many small MLPs, the
# **experts**, and a **router** picks a few of them for each token. By the end of this chapter you
# can say what a router computes and why its top-k weights are renormalized, you will have seen
# which experts each token of a prompt picks, you will know why sorting tokens by expert turns
# many small matmuls into one, and you can compute a decode step's bound when it reads only the
# experts that the batch chose. Nothing before this chapter knows about experts: the model of
# chapter 06 hands each layer its MLP, and this chapter hands some layers a different one.

# %% [markdown] tags=["zh"]
# # 26 · 混合专家：每个 token 去了哪里
#
# **目标：** 让 Qwen3-MoE 模型（大家问得最多的是 Qwen3-30B-A3B）与 `transformers` 逐 token 一致地运行。在混合专家
# （mixture of experts，MoE）层里，MLP 是许多个小 MLP，即**专家**（expert），由一个**路由器**（router）为每个 token
# 挑出其中几个。读完本章，你能说出路由器算的是什么、为什么它的 top-k 权重要重新归一化；你会看到一个提示词的每个
# token 选了哪些专家；你会知道为什么按专家给 token 排序能把许多个小矩阵乘法变成一个；你还能算出一个 decode 步在只读
# 批次选中的专家时的上限。本章之前的内容都不知道专家的存在：第 06 章的模型把 MLP 交给每一层，本章交给其中一些层
# 另一种 MLP。

# %%
# en: The fused MoE kernel at the end of this chapter is Triton: without a GPU it runs in the interpreter, which must
# en: be chosen before Triton is first imported (chapter 11).
# zh: 本章最后的融合 MoE 内核是 Triton 写的：没有 GPU 时它在解释器里运行，而这必须在第一次导入 Triton 之前选定
# zh: （第 11 章）。
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "{name}: {card}, {date}, {command}": "{name}：{card}，{date}，{command}",
    "layer {layer}: {kind}": "第 {layer} 层：{kind}",
    "experts": "专家", "dense MLP": "稠密 MLP",
    "token {token!r:>10} -> experts {experts}, weights {weights}":
        "token {token!r:>10} -> 专家 {experts}，权重 {weights}",
    "greedy tokens match transformers: {same}": "贪心解码的 token 与 transformers 完全一致：{same}",
    "{case}: {same}": "{case}：{same}",
    "chunked prefill": "分块 prefill", "prefix hits": "前缀缓存命中", "preemption": "抢占", "n = 2": "n = 2",
    "every expert, weighted: max |difference| {gap:.1e}": "每个专家都算、再加权：最大 |差值| {gap:.1e}",
    "tokens in the step": "步中的 token 数", "experts touched (of {experts})": "用到的专家（共 {experts} 个）",
    "uniform routing": "均匀路由",
    "parameters: {counted:,} counted, {built:,} built": "参数：算出 {counted:,} 个，构建了 {built:,} 个",
    "sorted by expert: {order}": "按专家排序后：{order}",
    "fused kernels against the loop: max |difference| {gap:.1e}": "融合内核对比循环：最大 |差值| {gap:.1e}",
    "tiles of {tile} rows: experts {experts}": "每个 tile {tile} 行：专家 {experts}",
    "Qwen3-30B-A3B, batch {batch:>3}: reads {read:5.1f} GB of {dense:5.1f} GB ({share:5.1%}), "
    "bound {ms:5.2f} ms":
        "Qwen3-30B-A3B，批大小 {batch:>3}：读 {read:5.1f} GB（共 {dense:5.1f} GB，占 {share:5.1%}），上限 {ms:5.2f} ms",
    "all exercise answers check out": "练习答案全部验证通过",
    "{tokens:>3} tokens, {touched:>3} experts: loop {loop:>7.0f} us, every expert {every:>6.0f} us, fused "
    "{fused:>5.0f} us = {share:.0%} of the bound":
        "{tokens:>3} 个 token，{touched:>3} 个专家：循环 {loop:>7.0f} us，每个专家都算 {every:>6.0f} us，融合 "
        "{fused:>5.0f} us = 上限的 {share:.0%}",
    "sort, batch of {tokens:>2}: align_by_expert {torch:.0f} us, one program {one:.0f} us ({ratio:.1f}x)":
        "排序，批大小 {tokens:>2}：align_by_expert {torch:.0f} us，单程序 {one:.0f} us（{ratio:.1f} 倍）",
    "{name}: {rate:,.0f} tok/s, {share:.0%} of the router-aware bound":
        "{name}：{rate:,.0f} tok/s，按路由器算的上限的 {share:.0%}",
    "H100, 8 layers, every expert": "H100，8 层，每个专家都算", "H100, 8 layers, fused": "H100，8 层，融合",
    "H100, 48 layers, fused": "H100，48 层，融合", "H200, 8 layers, fused": "H200，8 层，融合",
    "H200, 48 layers, fused": "H200，48 层，融合",
})

# %% [markdown] tags=["en"]
# ## The idea: a router, and experts that most tokens skip
#
# A dense decoder layer sends every token through the same MLP. A **sparse** layer of Qwen3-MoE
# has `num_experts` MLPs of width `moe_intermediate_size` (Qwen3-30B-A3B: 128 experts of width
# 768, where a dense MLP of the same model would be 6,144 wide). For each token:
#
# 1. the router, one linear layer `hidden_size → num_experts`, gives a logit per expert;
# 2. a softmax (in float32) turns them into probabilities, and `topk` keeps the `k =
#    num_experts_per_tok` largest (8 for Qwen3-30B-A3B);
# 3. with `norm_topk_prob`, the k kept probabilities are divided by their sum, so that they add
#    up to 1 (without it, a token whose top k hold 60 % of the mass would come out at 60 % of its
#    size);
# 4. the token goes through its k experts, and the layer's output is their outputs, weighted.
#
# The model's parameters count all the experts (30B), but a token computes with only k of them
# (the "A3B": about 3B active). The config says which layers are sparse: layer `i` is, unless it
# is in `mlp_only_layers`, when `(i + 1) % decoder_sparse_step == 0` (every layer, with the usual
# step of 1). Attention, the norms, the embedding and the LM head are those of Qwen3.
#
# For the engine this changes one thing and raises one question. The thing: the MLP of a layer,
# which chapter 06's `Qwen3DecoderLayer` takes as an argument (`mlp`), and `Qwen3Model.make_layer`
# builds layer by layer. The question: a decode step no longer reads "every weight once". It
# reads the experts the batch's tokens chose, and the router decides that while the step runs.

# %% [markdown] tags=["zh"]
# ## 思路：一个路由器，以及大多数 token 都跳过的专家
#
# 稠密的解码层让每个 token 走同一个 MLP。Qwen3-MoE 的**稀疏**层有 `num_experts` 个宽度为 `moe_intermediate_size`
# 的 MLP（Qwen3-30B-A3B：128 个宽 768 的专家，而同一个模型的稠密 MLP 宽 6,144）。对每个 token：
#
# 1. 路由器是一个线性层 `hidden_size → num_experts`，给每个专家一个 logit；
# 2. softmax（在 float32 中计算）把它们变成概率，`topk` 保留最大的 `k = num_experts_per_tok` 个（Qwen3-30B-A3B 为 8）；
# 3. 若设置了 `norm_topk_prob`，保留下来的 k 个概率除以它们的和，使其加起来为 1（不这样做的话，一个 top k 只占
#    60% 概率质量的 token，输出就只有它应有大小的 60%）；
# 4. token 经过它的 k 个专家，这一层的输出是这些专家输出的加权和。
#
# 模型的参数量把所有专家都算在内（30B），但一个 token 只用其中 k 个计算（"A3B"：大约 3B 个激活参数）。哪些层是
# 稀疏层由配置决定：第 `i` 层若不在 `mlp_only_layers` 里，且 `(i + 1) % decoder_sparse_step == 0`，就是稀疏层
# （通常的步长为 1，即每一层）。注意力、各个归一化、嵌入层和 LM head 都与 Qwen3 相同。
#
# 对引擎来说，这改变了一件事，也带来一个问题。改变的是一层的 MLP：第 06 章的 `Qwen3DecoderLayer` 把它当作参数
# （`mlp`）接收，`Qwen3Model.make_layer` 逐层构建。问题是：一个 decode 步不再是"每个权重读一次"。它读的是批次里的
# token 选中的那些专家，而这由路由器在这一步运行时才决定。

# %% [markdown] tags=["en"]
# ## Build it: the sparse block
#
# `SparseMoeBlock` holds the router (`gate`, a `ReplicatedLinear`: every tensor-parallel rank
# routes every token the same way) and the experts, each chapter 06's `Qwen3MLP` of the expert
# width. Keeping each expert a module of its own has a pleasant consequence: a checkpoint's
# `mlp.experts.7.gate_proj.weight` lands in `mlp.experts.7.gate_up_proj` through the same
# `packed_modules_mapping` as a dense model's, so the loader needs nothing new.
#
# `route` is steps 1 to 3 above, in the order and the dtypes `transformers` uses (logits in the
# model's dtype, softmax and renormalization in float32, weights back to the model's dtype), since
# the point is the same tokens. `chosen_experts` is step 4 the way `transformers` computes it:
# for each expert that at least one token chose, gather its tokens, run the expert on them, scale
# each row by its weight and add it into the output. With tensor parallelism each expert's width
# is split like a dense MLP's (gate/up by columns, down by rows), so a rank's output is a partial
# sum: the block adds the experts' partial sums locally (`forward_local`) and all-reduces once.
#
# That loop asks the host how many tokens each expert got, a different shape every step, and a
# CUDA graph records fixed shapes. So while a graph is captured, `every_expert` runs instead:
# every expert on every token, each row weighted by the router (zero where the token did not
# choose the expert). Same sums, a fixed shape, and `num_experts / k` times the arithmetic of the
# chosen experts: a correct stand-in until a fused kernel computes only the chosen experts inside
# the graph (below, "one matmul of many", says how). The check below holds the two paths to each
# other.

# %% [markdown] tags=["zh"]
# ## 动手：稀疏块
#
# `SparseMoeBlock` 持有路由器（`gate`，一个 `ReplicatedLinear`：张量并行的每个 rank 都以同样的方式路由每个 token）
# 和各个专家，每个专家都是第 06 章的 `Qwen3MLP`，宽度为专家宽度。让每个专家各自成为一个模块有个好处：检查点里的
# `mlp.experts.7.gate_proj.weight` 通过与稠密模型相同的 `packed_modules_mapping` 落进 `mlp.experts.7.gate_up_proj`，
# 加载器不需要任何新东西。
#
# `route` 就是上面的第 1 到 3 步，顺序和数据类型都与 `transformers` 相同（logits 用模型的数据类型，softmax 和重新
# 归一化用 float32，权重再转回模型的数据类型），因为我们要的是同样的 token。`chosen_experts` 是按 `transformers` 的
# 算法做第 4 步：对至少被一个 token 选中的每个专家，取出它的 token，用这个专家计算它们，每一行乘以自己的权重，
# 再加到输出里。张量并行时，每个专家的宽度像稠密 MLP 一样切分（gate/up 按列，down 按行），所以一个 rank 的输出是
# 部分和：这个块先在本地把各专家的部分和加起来（`forward_local`），最后只做一次 all-reduce。
#
# 这个循环要问主机每个专家分到了多少个 token，每一步的形状都不同，而 CUDA Graph 记录的是固定的形状。所以在捕获图
# 的时候，运行的是 `every_expert`：每个专家都对每个 token 计算，每一行按路由器的权重加权（token 没有选中这个专家的
# 地方权重为零）。和相同，形状固定，算术量是只算选中专家的 `num_experts / k` 倍：在融合内核能在图里只计算选中的
# 专家之前，它是一个正确的替身（下面的"把许多个矩阵乘法变成一个"讲怎么做）。下面的检查让两条路径互相核对。

# %% moe block
#| export models.qwen3_moe
"""Qwen3-MoE: decoder layers whose MLP is a router and experts (a mixture of experts)."""
# zh: Qwen3-MoE：MLP 由路由器和专家组成（混合专家）的解码器层。

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanovllm.layers.context import get_context
from nanovllm.layers.linear import ReplicatedLinear, tp_world
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: a router picks ``top_k`` of ``num_experts`` experts per token; the output is
    the chosen experts' outputs, weighted by the router."""
    # zh: 稀疏层的 MLP：路由器为每个 token 从 ``num_experts`` 个专家中挑出 ``top_k`` 个；输出是被选中专家的输出，
    # zh: 按路由器给的权重加权。

    # en: The experts in two grouped Triton kernels, once `fuse_moe_layers` hands the block them.
    # zh: 两个分组的 Triton 内核完成所有专家的计算，由 `fuse_moe_layers` 交给这个块。
    fused_experts = None
    # en: Set while a model is built (the MoE benchmark does): each block then counts in `touched`, on the device, the
    # en: experts that each decode step's tokens chose, inside CUDA graphs too: row b holds the experts and the steps
    # en: of the steps with b tokens (steps of more than COUNTED_ROWS tokens in the last row).
    # zh: 在构建模型时打开（MoE 基准测试会这样做）：每个块就在设备上把每个 decode 步的 token 选中的专家数累加到
    # zh: `touched` 里，在 CUDA Graph 里也一样：第 b 行是有 b 个 token 的那些步的专家数和步数（超过 COUNTED_ROWS
    # zh: 个 token 的步记在最后一行）。
    count_touched = False
    COUNTED_ROWS = 1024

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be from 1 to num_experts ({num_experts}), not {top_k}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = nn.ModuleList(Qwen3MLP(hidden_size, expert_size, hidden_act) for _ in range(num_experts))
        self.tp_size = tp_world()[1]
        if self.count_touched:
            self.register_buffer("touched", torch.zeros(self.COUNTED_ROWS + 1, 2, dtype=torch.long), persistent=False)
        else:
            self.touched = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in x's dtype, the chosen experts [T, top_k]), largest weight first."""
        # zh: （x 的 dtype 下的权重 [T, top_k]，被选中的专家 [T, top_k]），权重最大的排在最前。
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if self.touched is not None:
            self.count_step(chosen)
        if self.fused_experts is not None:
            out = self.fused_experts(x, weights, chosen)
        # en: A CUDA graph records fixed shapes: while one is captured, every expert runs on every token.
        # zh: CUDA Graph 记录的是固定的形状：捕获图的时候，每个专家都对每个 token 计算。
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self.every_expert(x, weights, chosen)
        else:
            out = self.chosen_experts(x, weights, chosen)
        if self.tp_size > 1:
            # en: each rank holds a slice of every expert's width: its sum is partial
            # zh: 每个 rank 持有每个专家宽度的一片：它算出的和是部分和
            dist.all_reduce(out)
        return out

    def count_step(self, chosen: torch.Tensor) -> None:
        """Add to `touched`, in the row of the step's token count, the number of experts a decode step's tokens chose
        and one step: on the device, no host read, so that a replayed graph counts too; a graph's padding rows
        (context length 0) choose nothing."""
        # zh: 在 `touched` 中这一步 token 数对应的那一行上，加上一个 decode 步的 token 所选专家的个数，再加一步：
        # zh: 在设备上完成，不从主机读，这样重放的图也会计数；图的填充行（上下文长度 0）什么都不选。
        context = get_context()
        if context.is_prefill or context.context_lens is None:
            return
        real = context.context_lens[: chosen.shape[0]] > 0
        hit = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=chosen.device)
        hit.index_fill_(0, torch.where(real[:, None], chosen, self.num_experts).flatten(), True)
        tokens = real.sum().clamp(max=self.COUNTED_ROWS).view(1)
        experts_and_step = torch.stack([hit[: self.num_experts].sum(), torch.ones_like(tokens[0])])
        self.touched.index_add_(0, tokens, experts_and_step[None])

    def expert_rows(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` on rows ``x``: this rank's partial sum (no all-reduce)."""
        # zh: 专家 ``index`` 作用于行 ``x``：本 rank 的部分和（不做 all-reduce）。
        expert = self.experts[index]
        return expert.down_proj.forward_local(expert.act_fn(expert.gate_up_proj(x)))

    def chosen_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each chosen expert on its own tokens, weighted, added up (as transformers computes it)."""
        # zh: 每个被选中的专家作用于它自己的 token，加权后相加（与 transformers 的算法相同）。
        out = torch.zeros_like(x)
        for index in chosen.unique().tolist():
            rows, slots = torch.where(chosen == index)
            out.index_add_(0, rows, (self.expert_rows(index, x[rows]) * weights[rows, slots, None]).to(out.dtype))
        return out

    def every_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The same sums in fixed shapes: every expert on every token, weighted 0 where the token did not choose it."""
        # zh: 同样的和，但形状固定：每个专家作用于每个 token，token 没选它的地方权重为 0。
        out = torch.zeros_like(x)
        for index in range(self.num_experts):
            weight = (weights * (chosen == index)).sum(dim=-1, keepdim=True)
            out += (self.expert_rows(index, x) * weight).to(out.dtype)
        return out

# %% [markdown] tags=["en"]
# ## Build it: the model
#
# `Qwen3MoeModel` overrides one method of chapter 06's model, `make_layer`: a sparse layer gets a
# `SparseMoeBlock`, the others the dense MLP. `Qwen3MoeForCausalLM` is Qwen3's causal LM with
# that model under its LM head, and the registry learns the architecture's name, so that a
# directory whose `config.json` says `Qwen3MoeForCausalLM` loads like any other. The tiny models
# of chapter 06 gain a `qwen3_moe` kind: 8 experts of width 32, two per token, in both layers.

# %% [markdown] tags=["zh"]
# ## 动手：模型
#
# `Qwen3MoeModel` 只覆盖第 06 章模型的一个方法 `make_layer`：稀疏层得到一个 `SparseMoeBlock`，其余层得到稠密 MLP。
# `Qwen3MoeForCausalLM` 就是 Qwen3 的因果语言模型，只是 LM head 下面换成了这个模型；注册表记下这个架构的名字，
# 于是 `config.json` 写着 `Qwen3MoeForCausalLM` 的目录能像其他模型一样加载。第 06 章的小模型多了一种
# `qwen3_moe`：8 个宽 32 的专家，每个 token 选两个，两层都是稀疏层。

# %% moe model
#| export models.qwen3_moe
def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether layer ``index`` has experts: not in mlp_only_layers, and on the decoder_sparse_step grid."""
    # zh: 第 ``index`` 层是否有专家：不在 mlp_only_layers 中，并且落在 decoder_sparse_step 的网格上。
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (index + 1) % step == 0)


class Qwen3MoeModel(Qwen3Model):
    """Qwen3 whose sparse layers have a router and experts instead of the dense MLP."""
    # zh: 稀疏层用路由器和专家代替稠密 MLP 的 Qwen3。

    def make_layer(self, config: Any, rotary_emb: RotaryEmbedding, switches: dict[str, bool], index: int) -> nn.Module:
        mlp = None
        if is_sparse_layer(config, index):
            mlp = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act)
        return Qwen3DecoderLayer(config, rotary_emb, switches, mlp)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B...): Qwen3 with sparse layers."""
    # zh: Qwen3-MoE（Qwen3-30B-A3B、Qwen3-235B-A22B……）：带稀疏层的 Qwen3。

    model_class = Qwen3MoeModel

# %% moe registry
#| export models.registry
from nanovllm.models.registry import MODEL_REGISTRY

MODEL_REGISTRY["Qwen3MoeForCausalLM"] = "nanovllm.models.qwen3_moe"

# %% tiny moe
#| export book.tiny_models
from nanovllm.book.tiny_models import _COMMON, TINY_MODELS

# en: Both layers sparse: 8 experts of width 32, two per token, their weights renormalized.
# zh: 两层都是稀疏层：8 个宽 32 的专家，每个 token 选两个，权重重新归一化。
TINY_MODELS["qwen3_moe"] = {
    **_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "tie_word_embeddings": False, "moe_intermediate_size": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}

# %% [markdown] tags=["en"]
# ### See it: where the tokens of a prompt go
#
# The tiny MoE model, then the router of its first layer on one prompt: each token's two
# experts, largest weight first. A hook on the block records what it receives; the router's
# choice is a function of that.

# %% [markdown] tags=["zh"]
# ### 看它运行：一个提示词的 token 都去了哪里
#
# 先建小的 MoE 模型，再看它第一层的路由器在一个提示词上的选择：每个 token 的两个专家，权重大的在前。块上的一个钩子
# （hook）记录它收到的输入；路由器的选择由这个输入决定。

# %%
import torch

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.models.qwen3_moe import SparseMoeBlock
from nanovllm.sampling_params import SamplingParams

tiny_moe = str(build_tiny_model("qwen3_moe"))
llm = LLM(tiny_moe, device="cpu", kvcache_block_size=4, num_kvcache_blocks=96)
model = llm.model_runner.model
for index, layer in enumerate(model.model.layers):
    print(say("layer {layer}: {kind}", layer=index, kind=say("experts") if isinstance(layer.mlp, SparseMoeBlock)
              else say("dense MLP")))

block = model.model.layers[0].mlp
seen: list[torch.Tensor] = []
hook = block.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].detach().clone()))
prompt = "The capital of France is Paris."
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
hook.remove()
weights, chosen = block.route(seen[0])
for token, experts, shares in zip(llm.tokenizer.encode(prompt), chosen.tolist(), weights.tolist(), strict=True):
    print(say("token {token!r:>10} -> experts {experts}, weights {weights}", token=llm.tokenizer.decode([token]),
              experts=experts, weights=[round(w, 2) for w in shares]))
assert torch.allclose(weights.sum(-1), torch.ones(len(weights)))

# %% [markdown] tags=["en"]
# ### Check it: the same tokens as `transformers`
#
# Greedy decoding on the tiny MoE model, against `transformers` running the same directory, on
# prompts that take the engine through its usual paths: whole prompts, chunked prefill (a budget
# of 16 tokens a step), prefix-cache hits (prompts that share their first blocks), preemption (a
# pool too small for all of them at once) and two samples of one prompt forked after the prefill.
# Then the graph's path against the eager one, on the hidden states recorded above.

# %% [markdown] tags=["zh"]
# ### 验证：与 `transformers` 相同的 token
#
# 在小 MoE 模型上做贪心解码，与在同一个目录上运行的 `transformers` 比较；提示词覆盖引擎平常走的路径：整段提示词、
# 分块 prefill（每步预算 16 个 token）、前缀缓存命中（前几个块相同的提示词）、抢占（块池小到装不下所有请求）、以及
# 一个提示词在 prefill 之后分叉出的两个样本。然后用上面记录的隐藏状态，让图里的路径与 eager 路径互相核对。

# %%
from transformers import AutoModelForCausalLM

hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
shared = list(range(30, 62))
prompts = [[5, 6, 7, 8, 9], [*shared, 3, 4], [*shared, 9, 10, 11], list(range(100, 140))]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def reference(prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


expected = [reference(p) for p in prompts]
same = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
print(say("greedy tokens match transformers: {same}", same=same))
assert same
cases = {
    "chunked prefill": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "prefix hits": dict(),
    "preemption": dict(num_kvcache_blocks=20),
}
for case, settings in cases.items():
    engine = LLM(tiny_moe, device="cpu", kvcache_block_size=4, **{"num_kvcache_blocks": 96, **settings})
    if case == "prefix hits":
        # en: the shared prefix is computed once, then found in the cache
        # zh: 共享的前缀只算一次，之后在缓存里找到
        engine.generate(prompts[1:2], greedy, use_tqdm=False)
    outputs = [o["token_ids"] for o in engine.generate(prompts, greedy, use_tqdm=False)]
    print(say("{case}: {same}", case=say(case), same=outputs == expected))
    assert outputs == expected
    engine.exit()
forked = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2), use_tqdm=False)
assert [o["token_ids"] for o in forked[0]["outputs"]] == [expected[0]] * 2
print(say("{case}: {same}", case=say("n = 2"), same=True))

weights, chosen = block.route(seen[0])
gap = (block.every_expert(seen[0], weights, chosen) - block.chosen_experts(seen[0], weights, chosen)).abs().max()
print(say("every expert, weighted: max |difference| {gap:.1e}", gap=gap.item()))
assert gap < 1e-5

# %% [markdown] tags=["en"]
# ## How much of the weights a step reads
#
# A dense model's decode step reads every weight once, whatever the batch (chapter 19's bound).
# A sparse layer's step reads the router, and then only the experts that at least one token of
# the batch chose. One token reads k experts; a batch of B tokens reads the union of their
# choices. If the router spread tokens uniformly, an expert would be missed by all B tokens with
# probability (1 − k/E)^B, so a step would touch E · (1 − (1 − k/E)^B) experts on average. Below,
# the tiny model's first layer on batches of 1, 4 and 16 decode tokens (the prompts of the check
# above and more), next to that formula. (A trained router is not uniform; a random one is close
# to it.)

# %% [markdown] tags=["zh"]
# ## 一步读多少权重
#
# 稠密模型的 decode 步不管批次多大，都把每个权重读一次（第 19 章的上限）。稀疏层的一步先读路由器，然后只读批次里
# 至少被一个 token 选中的专家。一个 token 读 k 个专家；B 个 token 的批次读它们所选专家的并集。如果路由器把 token
# 均匀地分出去，一个专家被 B 个 token 全部错过的概率是 (1 − k/E)^B，于是一步平均用到 E · (1 − (1 − k/E)^B) 个专家。
# 下面是小模型的第一层在 1、4、16 个 decode token 的批次上的情况（提示词取自上面的检查，再加一些），旁边是这个公式。
# （训练过的路由器并不均匀；随机的路由器接近均匀。）

# %% [markdown] tags=["en"]
# The benchmark of chapter 19 counts a model's parameters layer by layer (`mlp_params`), and a
# model whose MLPs differ adds a rule for its layers (`MLP_RULES`). A sparse layer's rule counts
# the router and every expert: all a step can read, the dense-style bound. The check holds the
# count to the parameters the engine actually built.

# %% [markdown] tags=["zh"]
# 第 19 章的基准测试逐层计算模型的参数量（`mlp_params`），MLP 不同的模型为自己的层加一条规则（`MLP_RULES`）。稀疏层
# 的规则算上路由器和每一个专家：一步最多能读到的全部权重，也就是按稠密方式算的上限。下面的检查让这个数与引擎实际
# 构建出的参数量相符。

# %% moe params
#| export bench.engine
from nanovllm.bench.engine import MLP_RULES
from nanovllm.models.qwen3_moe import is_sparse_layer


def experts_params(hf_config: Any) -> int:
    """Parameters of one sparse layer's experts: gate, up and down of moe_intermediate_size, each expert."""
    # zh: 一个稀疏层中专家的参数量：每个专家都有 moe_intermediate_size 的 gate、up 和 down。
    return hf_config.num_experts * 3 * hf_config.hidden_size * hf_config.moe_intermediate_size


def expert_mlp_params(hf_config: Any, index: int) -> int | None:
    """A sparse layer's MLP: the router and every expert."""
    # zh: 稀疏层的 MLP：路由器和每一个专家。
    if not getattr(hf_config, "num_experts", 0) or not is_sparse_layer(hf_config, index):
        return None
    return hf_config.hidden_size * hf_config.num_experts + experts_params(hf_config)


MLP_RULES.append(expert_mlp_params)

# %%
from nanovllm.bench.engine import model_params

built = sum(param.numel() for param in model.parameters())
print(say("parameters: {counted:,} counted, {built:,} built", counted=model_params(llm.config.hf_config), built=built))
assert model_params(llm.config.hf_config) == built


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a step of ``tokens`` tokens touches on average when each token picks ``top_k`` of ``num_experts``
    uniformly."""
    # zh: 每个 token 从 ``num_experts`` 个专家中均匀地挑 ``top_k`` 个时，一个 ``tokens`` 个 token 的步平均触及的专家数。
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


touched: list[int] = []
hook = block.register_forward_hook(lambda module, inputs, output: touched.append(
    len(module.route(inputs[0])[1].unique())) if inputs[0].shape[0] == width else None)
print(f"{say('tokens in the step'):>12} {say('experts touched (of {experts})', experts=8):>24} "
      f"{say('uniform routing'):>14}")
for width in (1, 4, 16):
    touched.clear()
    batch = [list(range(10 + 7 * i, 22 + 7 * i)) for i in range(width)]
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    mean = sum(touched) / len(touched)
    print(f"{width:>12} {mean:>24.2f} {expected_experts(8, 2, width):>14.2f}")
    assert 2 <= mean <= 8
hook.remove()

# %% [markdown] tags=["en"]
# ### See it: the router, step by step
#
# The same layer over a few steps of a small batch, played like the block tables of the earlier
# chapters (appendix A's player): each row is a token of the step (a prefill step has every prompt
# token; a decode step one per sequence), each column an expert, and a cell is coloured by the
# router's weight when the token chose that expert. The last row marks the experts the step
# touched: the weights it must read. Watch the prefill touch every expert, then the decode steps
# of four sequences touch fewer, and the share fall as sequences finish.

# %% [markdown] tags=["zh"]
# ### 看它运行：一步一步的路由
#
# 同一层在一个小批次的几步里的样子，用前面各章播放块表的方式播放（附录 A 的播放器）：每一行是这一步的一个 token
# （prefill 步包含所有提示词 token；decode 步每个序列一个），每一列是一个专家，token 选中某个专家时，格子的颜色深浅
# 表示路由器给的权重。最后一行标出这一步用到的专家：它必须读取的权重。可以看到 prefill 用到了每个专家，之后四个
# 序列的 decode 步用到的少一些，序列陆续结束时比例也随之下降。

# %%
from IPython.display import HTML

from nanovllm.layers.context import get_context
from nanovllm.viz.player import lang_text, slides_html

steps: list[tuple[bool, list[list[int]], list[list[float]]]] = []


def record_routing(module: SparseMoeBlock, inputs: tuple, output: torch.Tensor) -> None:
    weights, chosen = module.route(inputs[0])
    steps.append((get_context().is_prefill, chosen.tolist(), weights.tolist()))


def routing_svg(chosen: list[list[int]], weights: list[list[float]], num_experts: int) -> str:
    """One step of one layer: a row per token, a column per expert, the chosen cells shaded by their weight."""
    # zh: 一层的一步：每个 token 一行，每个专家一列，被选中的格子按权重着色。
    cell, left, top = 22, 64, 22
    rows = len(chosen)
    width, height = left + num_experts * cell + 10, top + (rows + 1) * cell + 14
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><title>{lang_text("tokens by experts", "token 与专家", None)}</title>']
    parts.append(f'<text x="{left - 6}" y="{top - 6}" text-anchor="end">{lang_text("expert", "专家", None)}</text>')
    for expert in range(num_experts):
        parts.append(f'<text x="{left + expert * cell + cell / 2}" y="{top - 6}" text-anchor="middle">{expert}</text>')
    touched = {expert for row in chosen for expert in row}
    for r, (experts, shares) in enumerate(zip(chosen, weights, strict=True)):
        y = top + r * cell
        parts.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">{r}</text>')
        share = dict(zip(experts, shares, strict=True))
        for expert in range(num_experts):
            fill = f"rgba(21,101,192,{0.2 + 0.8 * share[expert]:.2f})" if expert in share else "#fafafa"
            parts.append(f'<rect x="{left + expert * cell}" y="{y}" width="{cell - 2}" height="{cell - 2}" '
                         f'fill="{fill}" stroke="#cfd8dc"/>')
    y = top + rows * cell + 6
    read = lang_text("read", "读取", None)
    parts.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">{read}</text>')
    for expert in range(num_experts):
        fill = "#ef6c00" if expert in touched else "#eceff1"
        parts.append(f'<rect x="{left + expert * cell}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{fill}"/>')
    parts.append("</svg>")
    return "".join(parts)


hook = block.register_forward_hook(record_routing)
batch = [[10, 11, 12, 13, 14], [40, 41, 42], [70, 71, 72, 73], [100, 101]]
lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 4, 2)]
llm.generate(batch, lengths, use_tqdm=False)
hook.remove()
slides = []
for index, (prefill, chosen_rows, weight_rows) in enumerate(steps):
    touched = len({expert for row in chosen_rows for expert in row})
    kind_en, kind_zh = ("prefill", "prefill") if prefill else ("decode", "decode")
    caption = lang_text(
        f"step {index + 1}, {kind_en}: {len(chosen_rows)} token{'s' if len(chosen_rows) > 1 else ''} chose {touched} "
        f"of {block.num_experts} experts; "
        f"the step reads {touched / block.num_experts:.0%} of this layer's expert weights",
        f"第 {index + 1} 步，{kind_zh}：{len(chosen_rows)} 个 token 选中了 {block.num_experts} 个专家中的 "
        f"{touched} 个；这一步读取这一层专家权重的 {touched / block.num_experts:.0%}", None)
    slides.append((f'<div class="nvv-cap">{caption}</div>', routing_svg(chosen_rows, weight_rows, block.num_experts)))
decode_tokens = [len(rows) for prefill, rows, _ in steps if not prefill]
assert steps[0][0] and decode_tokens == sorted(decode_tokens, reverse=True) and decode_tokens[0] == 4
HTML(slides_html(slides, start=0, player_id="moe-routing"))

# %% [markdown] tags=["en"]
# On Qwen3-30B-A3B's shapes (48 layers, hidden 2,048, 32 query and 4 KV heads of 128, 128 experts
# of width 768, 8 per token, a vocabulary of 151,936, bfloat16) an expert is 9.4 MB and a layer's
# experts 1.2 GB. The step's bound then counts the attention weights, the LM head, the router and
# the experts touched (KV left out here; at batch 1 it is small): at batch 1 a step reads about a
# tenth of the weights, at 64 tokens almost all of them, since 128 · (1 − (120/128)^64) ≈ 126.
# Batching buys less than in a dense model before the bound becomes "all the weights" again. The
# benchmark below counts, instead of this estimate, the experts the router actually chose in each
# step.

# %% [markdown] tags=["zh"]
# 按 Qwen3-30B-A3B 的形状（48 层，hidden 2,048，32 个查询头和 4 个 KV 头、每头 128，128 个宽 768 的专家、每个 token
# 选 8 个，词表 151,936，bfloat16），一个专家 9.4 MB，一层的专家共 1.2 GB。一步的上限于是算上注意力权重、LM head、
# 路由器和用到的专家（这里不算 KV；批大小为 1 时它很小）：批大小为 1 时一步只读大约十分之一的权重，64 个 token 时
# 几乎全部都要读，因为 128 · (1 − (120/128)^64) ≈ 126。在上限重新变成"全部权重"之前，组批带来的好处比稠密模型少。
# 下面的基准测试不用这个估计，而是数出每一步路由器实际选中的专家。

# %%
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, WIDTH, VOCAB = 2048, 48, 32, 4, 128, 128, 8, 768, 151936
BYTES, COPY_RATE = 2, 4.3e12
expert_bytes = 3 * HIDDEN * WIDTH * BYTES
attention_bytes = (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN) * BYTES
fixed_bytes = LAYERS * (attention_bytes + EXPERTS * HIDDEN * BYTES) + VOCAB * HIDDEN * BYTES
dense_bytes = fixed_bytes + LAYERS * EXPERTS * expert_bytes
reads = {}
for batch in (1, 8, 64, 256):
    reads[batch] = fixed_bytes + LAYERS * expected_experts(EXPERTS, TOP_K, batch) * expert_bytes
    print(say("Qwen3-30B-A3B, batch {batch:>3}: reads {read:5.1f} GB of {dense:5.1f} GB ({share:5.1%}), "
              "bound {ms:5.2f} ms", batch=batch, read=reads[batch] / 1e9, dense=dense_bytes / 1e9,
              share=reads[batch] / dense_bytes, ms=reads[batch] / COPY_RATE * 1e3))
assert abs(expert_bytes / 1e6 - 9.4) < 0.1 and reads[1] < 0.11 * dense_bytes and reads[64] > 0.97 * dense_bytes

# %% [markdown] tags=["en"]
# ### The benchmark: tokens per second against both bounds
#
# `python -m nanovllm.bench --moe` runs a workload on a MoE model and holds its tokens per
# second to two bounds: the dense-style one (every expert read in every decode step, what
# chapter 19's bound now counts for a sparse layer) and the router-aware one, which counts the
# experts the decode steps really chose. The count is the blocks' own: built with
# `SparseMoeBlock.count_touched` set, each block adds, on the device, the experts that each
# decode step's tokens chose (graph padding rows left out), so a replayed CUDA graph counts too,
# and by the step's token count, so that the benchmark also prints the share read as the batch
# drains. The bound lets every sequence decode at once, so each of its steps reads the share the
# run measured at that step's token count: a run whose cache held fewer sequences at a time read
# a smaller share per step, and its mean would make the bound optimistic (as on an 80 GB card,
# where the whole model leaves room for 182 of the 256 sequences).
# On a GPU it defaults to Qwen3-30B-A3B's shapes with random weights drawn on the GPU
# (`qwen3_moe_30b_shapes`, `load_format="dummy"`: no 60 GB checkpoint is written) and chapter
# 19's nano-vllm workload; on a CPU, to the tiny MoE model and a few short requests, and there the
# bound counts only the decode bytes, at this machine's copy rate. The GPU's figures are recorded
# at the end of the chapter.

# %% [markdown] tags=["zh"]
# ### 基准测试：每秒 token 数对比两个上限
#
# `python -m nanovllm.bench --moe` 在一个 MoE 模型上跑一个负载，把它的每秒 token 数和两个上限比较：按稠密方式算的
# 上限（每个 decode 步都读每一个专家，也就是第 19 章的上限现在为稀疏层算的数），以及按路由器算的上限，它只算
# decode 步真正选中的专家。这个数由块自己来数：在设置了 `SparseMoeBlock.count_touched` 时构建的模型里，每个块
# 都在设备上累加每个 decode 步的 token 选中的专家数（不算图的填充行），所以重放的 CUDA Graph 也会计数；计数按这一
# 步的 token 数分开记，所以基准测试还能打印批次逐渐变小时每步读取的比例。上限让所有序列一起 decode，所以它的每一步
# 读取的是这次运行在该步 token 数下测得的比例：缓存同时装不下那么多序列的运行，每步读的比例更小，用它的平均值会让
# 上限偏乐观（80 GB 的卡就是这样：整个模型只给 256 个序列中的 182 个留下空间）。在 GPU
# 上它默认使用 Qwen3-30B-A3B 的形状、在 GPU 上直接生成随机权重（`qwen3_moe_30b_shapes`，`load_format="dummy"`：
# 不用写出 60 GB 的检查点），以及第 19 章的 nano-vllm 负载；在 CPU 上默认使用小 MoE 模型和几个短请求，这时上限
# 只算 decode 的字节数，按这台机器的拷贝速率计算。GPU 上的数字记录在本章末尾。

# %% moe preset
#| export bench.models
from pathlib import Path
from typing import Any

from nanovllm.bench.models import weightless_model_dir

QWEN3_MOE_30B_SHAPES: dict[str, Any] = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
}


def qwen3_moe_30b_shapes(path: str | None = None, **overrides: Any) -> Path:
    """A model directory with Qwen3-30B-A3B's shapes (``overrides``, e.g. fewer layers) and no weights, to run with
    ``load_format="dummy"``: the 61 GB of bfloat16 weights are drawn on the GPU instead of written to disk."""
    # zh: 一个形状与 Qwen3-30B-A3B 相同（``overrides``，比如更少的层）、没有权重的模型目录，用 ``load_format="dummy"``
    # zh: 运行：61 GB 的 bfloat16 权重在 GPU 上抽取，而不是写到磁盘上。
    import tempfile

    from transformers import Qwen3MoeConfig

    shapes = {**QWEN3_MOE_30B_SHAPES, **overrides}
    target = Path(path or f"{tempfile.gettempdir()}/nanovllm-qwen3-30b-a3b-shapes-{shapes['num_hidden_layers']}")
    return weightless_model_dir(target, Qwen3MoeConfig, shapes, "Qwen3MoeForCausalLM")

# %% bench moe flag
#| export bench.engine
from nanovllm.bench.engine import OTHER_BENCHMARKS

OTHER_BENCHMARKS["--moe"] = "nanovllm.bench.moe"

# %% bench moe
#| export bench.moe
"""``python -m nanovllm.bench --moe``: a mixture-of-experts model's tokens per second against the dense-style bound
and the router-aware one (the experts its decode steps chose)."""
# zh: ``python -m nanovllm.bench --moe``：混合专家模型的每秒 token 数，对照稠密式的上限和考虑路由器的上限
# zh: （按它的 decode 步所选的专家计算）。

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import AutoConfig

from nanovllm.bench.engine import (Workload, experts_params, make_workload, matmul_flops, watch_calls,
                                   weight_bytes_per_step, workload_bound)
from nanovllm.bench.report import CopyRates
from nanovllm.bench.models import qwen3_moe_30b_shapes
from nanovllm.bench.report import Stopwatch, report_header, write_report
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock, is_sparse_layer
from nanovllm.sampling_params import SamplingParams

# en: (requests, prompt lengths, output lengths): chapter 19's nano-vllm workload on a GPU, a few short ones on a CPU.
# zh: （请求数，提示词长度，输出长度）：GPU 上用第 19 章的 nano-vllm 负载，CPU 上用几个短请求。
MOE_WORKLOADS = {"cuda": (256, (100, 1024), (100, 1024)), "cpu": (8, (16, 48), (8, 24))}


@dataclass
class ExpertReads:
    """What a run's decode steps read of the experts: the experts they touched, summed over steps and layers, and
    by the steps' token counts the share of the experts a step read (``by_tokens``, as the batch drains)."""
    # zh: 一次运行的 decode 步读取了专家的哪些部分：它们触及的专家数，按步和层求和；以及按步的 token 数统计的
    # zh: 一步所读专家的比例（``by_tokens``，随着批次逐渐排空）。

    decode_steps: int
    touched: int
    sparse_layers: int
    num_experts: int
    by_tokens: dict[int, float]

    @property
    def share(self) -> float:
        """The share of the sparse layers' expert weights an average decode step read."""
        # zh: 一个平均的 decode 步读取的稀疏层专家权重的比例。
        return self.touched / max(1, self.decode_steps * self.sparse_layers * self.num_experts)

    def share_at(self, tokens: int) -> float:
        """The share a decode step of ``tokens`` tokens read: as measured at that count, else at the nearest count
        the run had (the larger on a tie); the run's mean when nothing was counted by tokens."""
        # zh: ``tokens`` 个 token 的 decode 步读取的比例：按在这个 token 数下测得的值，否则按这次运行里最接近的 token 数
        # zh: （相等时取较大者）；没有按 token 数统计时，取这次运行的平均值。
        if not self.by_tokens:
            return self.share
        return self.by_tokens[min(self.by_tokens, key=lambda count: (abs(count - tokens), -count))]


def expert_reads(blocks: list[SparseMoeBlock], decode_steps: int) -> ExpertReads:
    """The blocks' counts (`SparseMoeBlock.touched`) as a run's `ExpertReads`."""
    # zh: 把各块的计数（`SparseMoeBlock.touched`）变成一次运行的 `ExpertReads`。
    counts = sum(block.touched.cpu() for block in blocks)
    num_experts = blocks[0].num_experts
    by_tokens = {tokens: experts / (steps * num_experts) for tokens, (experts, steps) in enumerate(counts.tolist())
                 if steps}
    return ExpertReads(decode_steps, int(counts[:, 0].sum()), len(blocks), num_experts, by_tokens)


@contextmanager
def counting_experts(fused: bool = True) -> Iterator[None]:
    """Models built inside count the experts their decode steps touch (`SparseMoeBlock.count_touched`); with
    ``fused=False`` their experts run as the loop on a GPU too (the fused kernels, built with `fused_moe`, are the
    GPU's default: `Qwen3MoeForCausalLM.fused_experts_on_gpu`)."""
    # zh: 在块内构建的模型会统计它们的 decode 步触及的专家（`SparseMoeBlock.count_touched`）；``fused=False`` 时，
    # zh: 它们的专家在 GPU 上也按循环运行（用 `fused_moe` 构建的融合内核是 GPU 上的默认：
    # zh: `Qwen3MoeForCausalLM.fused_experts_on_gpu`）。
    was_fused = getattr(Qwen3MoeForCausalLM, "fused_experts_on_gpu", True)
    SparseMoeBlock.count_touched, Qwen3MoeForCausalLM.fused_experts_on_gpu = True, fused
    try:
        yield
    finally:
        SparseMoeBlock.count_touched, Qwen3MoeForCausalLM.fused_experts_on_gpu = False, was_fused


def run_counted(model: str, workload: Workload, fused: bool = True, **config: Any) -> tuple[float, ExpertReads, Any]:
    """Time `LLM.generate` on the workload (after an untimed warm-up) with the experts counted, through the fused
    kernels on a GPU unless ``fused`` is False: (seconds, the experts read, the engine's config)."""
    # zh: 在负载上为 `LLM.generate` 计时（先做一次不计时的预热），同时统计专家；除非 ``fused`` 为 False，在 GPU 上
    # zh: 走融合内核：（秒数，读取的专家，引擎的 config）。
    from nanovllm.llm import LLM

    with counting_experts(fused):
        llm = LLM(model, **config)
    try:
        if llm.config.tensor_parallel_size > 1:
            raise ValueError("the experts are counted in the model of this process: tensor_parallel_size must be 1")
        llm.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)
        blocks = [module for module in llm.model_runner.model.modules() if isinstance(module, SparseMoeBlock)]
        if not blocks:
            raise ValueError(f"{model} has no sparse layers: python -m nanovllm.bench --moe measures a mixture of "
                             "experts")
        for block in blocks:
            block.touched.zero_()
        decode_steps = 0

        def count_step(_: float, step: tuple[list, int, bool] | None) -> None:
            nonlocal decode_steps
            decode_steps += step is not None and step[1] > 0 and not step[2]

        with watch_calls(llm, "_step", count_step), Stopwatch(llm.config.device) as clock:
            llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        return clock.seconds, expert_reads(blocks, decode_steps), llm.config
    finally:
        llm.exit()


def router_aware_bound(workload: Workload, hf_config: Any, dtype_bytes: int, reads: ExpertReads, bandwidth: float,
                       flops: float, decode_steps: int | None = None) -> tuple[Any, float]:
    """(The dense-style bound, the router-aware tokens per second): the same bound with each decode step reading
    the measured share of the sparse layers' experts instead of all of them. The bound lets every sequence decode
    at once (as many steps as the longest output), each step reading the share the run measured at its token
    count: a run whose KV cache held fewer sequences at a time read less per step, in more steps, and its mean
    share would make the bound optimistic. ``decode_steps``: the steps such a run needed, each reading the run's
    mean share."""
    # zh: （稠密式的上限，考虑路由器的每秒 token 数）：同样的上限，只是每个 decode 步读取测得比例的稀疏层专家，
    # zh: 而不是全部。这个上限让每个序列同时 decode（步数等于最长的输出），每一步读取这次运行在该 token 数下
    # zh: 测得的比例：KV 缓存同时容纳的序列较少的运行，每步读得更少、步数更多，用它的平均比例会让上限过于乐观。
    # zh: ``decode_steps``：这样一次运行所需的步数，每一步都读取这次运行的平均比例。
    dense = workload_bound(workload, hf_config, dtype_bytes, bandwidth, flops)
    sparse_layers = sum(is_sparse_layer(hf_config, index) for index in range(hf_config.num_hidden_layers))
    all_experts = sparse_layers * experts_params(hf_config) * dtype_bytes
    weights_per_step = weight_bytes_per_step(hf_config, dtype_bytes)
    steps = max(workload.output_lens) - 1
    kv_bytes = dense.decode_bytes - steps * weights_per_step
    if decode_steps is None:
        # en: All at once, step i carries the sequences that still have more than i tokens to decode.
        # zh: 全部一起 decode 时，第 i 步带着还有超过 i 个 token 要 decode 的那些序列。
        tokens = [sum(length - 1 > i for length in workload.output_lens) for i in range(steps)]
        shares = [reads.share_at(count) for count in tokens]
    else:
        shares = [reads.share] * decode_steps
    weight_reads = sum(weights_per_step - all_experts * (1 - share) for share in shares)
    seconds = (weight_reads + kv_bytes) / bandwidth + dense.prefill_flops / flops
    return dense, workload.num_output_tokens / seconds


def print_bounds(workload: Workload, config: Any, reads: ExpertReads, tokens_per_s: float, bandwidth: float,
                 flops: float) -> dict[str, float]:
    """Print the run against the dense-style bound, the router-aware one and, where the KV cache held fewer
    sequences than the workload has, the router-aware one at the steps the run needed; returns them for the report."""
    # zh: 打印这次运行对照稠密式上限、考虑路由器的上限，以及在 KV 缓存容纳的序列比负载少时，按这次运行所需步数
    # zh: 计算的考虑路由器的上限；把它们返回给报告。
    hf_config, dtype_bytes = config.hf_config, config.torch_dtype.itemsize
    dense, router = router_aware_bound(workload, hf_config, dtype_bytes, reads, bandwidth, flops)
    at_steps = router_aware_bound(workload, hf_config, dtype_bytes, reads, bandwidth, flops, reads.decode_steps)[1]
    print(f"dense-style bound: {dense.tokens_per_s:,.0f} tok/s ({tokens_per_s / dense.tokens_per_s:.1%} of it); "
          f"router-aware bound: {router:,.0f} tok/s ({tokens_per_s / router:.1%} of it), at "
          f"{bandwidth / 1e12:.2f} TB/s (copy, measured)")
    steps = max(workload.output_lens) - 1
    if reads.decode_steps > steps:
        print(f"at most {max(reads.by_tokens)} sequences decoded at once (the KV cache or max_num_seqs held the rest "
              f"back): {reads.decode_steps} decode steps where the bound counts {steps}; the router-aware bound at the "
              f"steps this run needed: {at_steps:,.0f} tok/s ({tokens_per_s / at_steps:.1%} of it)")
    return {"dense_bound_tokens_per_s": dense.tokens_per_s, "router_bound_tokens_per_s": router,
            "router_bound_at_run_steps_tokens_per_s": at_steps}


def draining(reads: ExpertReads) -> str:
    """The share of the experts read as the batch drains: at most ten token counts, from the largest down."""
    # zh: 随着批次逐渐排空所读专家的比例：至多十个 token 数，从最大的往下。
    counts = sorted(reads.by_tokens, reverse=True)
    shown = sorted({counts[round(i * (len(counts) - 1) / 9)] for i in range(10)}, reverse=True) if counts else []
    return ", ".join(f"{tokens} -> {reads.by_tokens[tokens]:.0%}" for tokens in shown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench --moe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Qwen3-MoE directory (default: Qwen3-30B-A3B's shapes on a GPU, the tiny "
                        "MoE model on a CPU)")
    parser.add_argument("--layers", type=int, help="with the default GPU model: this many of its 48 layers")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--experts", choices=["fused", "loop"], default="fused",
                        help="on a GPU: the experts in the fused kernels (the engine's default) or as the loop (every "
                        "expert on every token inside CUDA graphs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from nanovllm.book.tiny_models import build_tiny_model

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    num_seqs, input_len, output_len = MOE_WORKLOADS[device]
    settings: dict[str, Any] = {"device": device, "enforce_eager": args.enforce_eager}
    if args.model:
        model = args.model
    elif device == "cuda":
        model = str(qwen3_moe_30b_shapes(**({"num_hidden_layers": args.layers} if args.layers else {})))
        settings["load_format"] = "dummy"
    else:
        model = str(build_tiny_model("qwen3_moe"))
        settings |= {"kvcache_block_size": 16, "num_kvcache_blocks": 128}
    try:
        vocab_size = AutoConfig.from_pretrained(model).vocab_size
        workload = make_workload(args.num_seqs or num_seqs, input_len, output_len, vocab_size=vocab_size,
                                 seed=args.seed)
        # en: Measured before the run and after it: the bound uses the higher rate (chapter 19's `CopyRates`).
        # zh: 在运行之前和之后各测一次：上限按较高的速率算（第 19 章的 `CopyRates`）。
        rates = CopyRates.before_runs(device)
        seconds, reads, config = run_counted(model, workload, fused=args.experts == "fused",
                                             max_model_len=max(4096, sum(input_len + output_len)), **settings)
    except (TypeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokens_per_s = workload.num_output_tokens / seconds
    bandwidth = rates.after_runs()
    # en: On a CPU the bound counts the decode bytes only (no matmul rate is measured there).
    # zh: 在 CPU 上上限只算 decode 的字节（那里不测矩阵乘法的速率）。
    flops = matmul_flops() if device == "cuda" else float("inf")
    where = torch.cuda.get_device_name() if device == "cuda" else "this CPU (the figures and the bound are the CPU's)"
    print(f"model: {model} on {where}, experts: {args.experts if device == 'cuda' else 'loop'}; workload: "
          f"{workload.describe()}")
    print(f"engine: {workload.num_output_tokens} tokens in {seconds:.2f} s = {tokens_per_s:,.1f} tok/s")
    print(f"experts read: {reads.share:.1%} of the sparse layers' expert weights in an average decode step "
          f"({reads.touched} experts over {reads.decode_steps} steps and {reads.sparse_layers} layers)")
    print(f"as the batch drains, tokens in a step -> experts read: {draining(reads)}")
    report = report_header("python -m nanovllm.bench --moe", argv, device)
    report |= {"model": model, "experts": args.experts, "workload": workload.describe(), "tokens_per_s": tokens_per_s,
               "seconds": seconds, "expert_reads": asdict(reads) | {"share": reads.share}, "bandwidth": bandwidth,
               "copy_rate": rates.report()}
    print(f"copy rate, measured: {rates.before / 1e12:.2f} TB/s before the run, {rates.after / 1e12:.2f} after; "
          "the bound uses the higher")
    report |= print_bounds(workload, config, reads, tokens_per_s, bandwidth, flops)
    write_report(report, args.out)
    return 0


if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())

# %% [markdown] tags=["en"]
# ## One matmul of many: sort the tokens by expert
#
# The loop of `chosen_experts` launches three matmuls per chosen expert: with 128 experts and a
# batch that touches all of them, 384 small matmuls per layer, each too small to keep a GPU busy,
# and a host that must learn each expert's token count before it can launch anything. The fused
# MoE kernels of vLLM and SGLang start from one rearrangement: list the (token, expert) pairs,
# sort them by expert, and pad each expert's run to a multiple of the kernel's tile height
# (`block_m`). Then every tile of rows belongs to one expert, and a single grouped matmul, whose
# program for tile t reads the weights of expert `tile_expert[t]`, computes every expert at once.
# `align_by_expert` does the sort without a loop and without asking the host anything: the
# output has room for the worst case, `T · k + num_experts · (block_m − 1)` rows, so its shapes
# depend on the number of tokens alone, which is what a CUDA graph needs; the rows it does not
# use hold the pair count `T · k` (no pair), and the tiles past the last run name expert
# `num_experts` (no expert). The same sort gives the bound above for free: the experts with a
# non-empty run are the ones the step must read.
#
# At a decode step of a few tokens, that sort costs more than it should: `align_by_expert` is a
# dozen small torch operations (a histogram, cumulative sums, a radix sort, gathers, a scatter, a
# search), some fifteen kernels a layer. For up to 128 pairs (16 tokens of top-8),
# `align_in_one_program` finds the same rows and tile experts in one Triton program after a fill:
# a one-hot tile of [pairs, experts] gives each expert's count (summed down its column) and each
# pair's rank among its expert's pairs (a running sum down the column, so the order is the stable
# sort's); the runs' starts then place every pair, and comparing the runs' ends with each tile's
# first row answers the search. The tile lives in registers, so it stops at 128 pairs;
# `sort_by_expert` picks one or the other by the pair count, which the shapes fix, so a CUDA
# graph captures either.
#
# `fused_moe` then runs two Triton kernels over those tiles. The first gathers each pair's token,
# multiplies it by its expert's merged gate/up weight and applies SiLU × mul in registers,
# writing one row per pair; the second multiplies those rows by the expert's down weight and
# scales each by its router weight. Each token's k rows are then added up. The stacked weights
# come from `fuse_moe_layers`, which stacks each block's experts once and leaves every expert's
# parameters as views into the stacks, so no weight is held twice. On a GPU the model does this
# as it is built (`Qwen3MoeForCausalLM.fused_experts_on_gpu`, on by default): the loaders then
# copy each checkpoint tensor into its view, and every CUDA graph captures the two kernels
# instead of every expert on every token. Here on a CPU the chapter hands a loaded model the
# kernels itself, to run them in the Triton interpreter.

# %% [markdown] tags=["zh"]
# ## 把许多个矩阵乘法变成一个：按专家给 token 排序
#
# `chosen_experts` 的循环对每个选中的专家启动三个矩阵乘法：有 128 个专家、而批次用到了全部专家时，每层就是 384 个
# 小矩阵乘法，每个都小到喂不饱 GPU；而且主机得先知道每个专家分到多少 token，才能启动任何东西。vLLM 和 SGLang 的
# 融合 MoE 内核都从同一个重排开始：列出（token，专家）对，按专家排序，再把每个专家的那一段补齐到内核 tile 高度
# （`block_m`）的整数倍。这样每个 tile 的行都属于同一个专家，一个分组矩阵乘法（第 t 个 tile 的程序读取专家
# `tile_expert[t]` 的权重）就能一次算完所有专家。`align_by_expert` 做这个排序时既不用循环，也不问主机任何事：
# 输出按最坏情况留足空间，`T · k + num_experts · (block_m − 1)` 行，所以它的形状只取决于 token 数，这正是 CUDA
# Graph 需要的；没用到的行填的是对数 `T · k`（表示没有这一对），最后一段之后的 tile 标为专家 `num_experts`
# （表示没有专家）。同一次排序还顺带给出了上面的上限：段不为空的专家，正是这一步必须读取的专家。
#
# 在只有几个 token 的 decode 步里，这次排序花得太多了：`align_by_expert` 是十几个小的 torch 操作（直方图、累加和、
# 基数排序、gather、scatter、查找），每层大约十五个内核。对不超过 128 对（16 个 token，每个选 8 个专家）的情况，
# `align_in_one_program` 在一次填充之后用一个 Triton 程序得到同样的行和 tile 专家：一个 [对数, 专家数] 的独热 tile
# 给出每个专家的对数（按列求和），以及每一对在它的专家的各对中的名次（沿列的累加和，所以顺序就是稳定排序的顺序）；
# 各段的起点再把每一对放到位，把各段的终点与每个 tile 的第一行比较，就完成了查找。这个 tile 放在寄存器里，所以
# 最多 128 对；`sort_by_expert` 按对数（由形状决定）选用其中一个，所以 CUDA 图捕获哪一个都可以。
#
# 然后 `fused_moe` 在这些 tile 上运行两个 Triton 内核。第一个取出每一对的 token，乘以它的专家合并后的 gate/up
# 权重，在寄存器里做 SiLU × mul，每一对写一行；第二个把这些行乘以专家的 down 权重，再按路由器权重缩放。最后把每个
# token 的 k 行加起来。堆叠好的权重来自 `fuse_moe_layers`：它把每个块的专家堆叠一次，并让每个专家的参数成为
# 堆叠张量的视图，所以没有哪个权重存了两份。在 GPU 上，模型在构建时就这样做
# （`Qwen3MoeForCausalLM.fused_experts_on_gpu`，默认打开）：加载器随后把检查点里的每个张量拷进它的视图，每个 CUDA
# 图捕获的也是这两个内核，而不是让每个专家处理每个 token。这里在 CPU 上，本章自己把内核交给一个加载好的模型，在
# Triton 解释器里运行它们。

# %% fused moe
#| export layers.fused_moe
"""The experts of a sparse layer in two Triton kernels: tokens sorted by expert and padded to the tile, one grouped
matmul for gate/up with SiLU x mul, one for down with the router's weights applied."""
# zh: 用两个 Triton 内核计算稀疏层的专家：token 按专家排序并填充到 tile 的大小，一次分组矩阵乘法计算 gate/up
# zh: 并做 SiLU 乘法，一次计算 down 并乘上路由器的权重。

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def align_by_expert(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``chosen`` [T, top_k], flattened (pair p is token p // top_k, slot p % top_k),
    sorted by expert, each expert's run padded to a multiple of ``block_m`` rows with the pair count T * top_k:
    (pair per row [rows], expert per tile of block_m rows [rows // block_m], num_experts past the last run).
    Every shape depends on T alone, never on the routing, so a CUDA graph can capture it."""
    # zh: ``chosen`` [T, top_k] 的（token，槽）对，展平（第 p 对是 token p // top_k、槽 p % top_k），按专家排序，
    # zh: 每个专家的那一段用对数 T * top_k 填充到 ``block_m`` 行的倍数：（每行的对 [rows]，每个 block_m 行的 tile
    # zh: 的专家 [rows // block_m]，最后一段之后的 num_experts）。每个形状都只取决于 T，从不取决于路由，
    # zh: 所以 CUDA Graph 能捕获它。
    pairs = chosen.flatten()
    count = pairs.numel()
    per_expert = torch.zeros(num_experts, dtype=torch.long, device=pairs.device)
    per_expert.scatter_add_(0, pairs, torch.ones_like(pairs))
    padded = (per_expert + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(pairs, stable=True)
    by_expert = pairs[order]
    # en: Where each pair goes: its expert's first padded row, plus its rank among that expert's pairs.
    # zh: 每一对放到哪里：它的专家那一段的第一行，加上它在这个专家的各对里的名次。
    rank = torch.arange(count, device=pairs.device) - (torch.cumsum(per_expert, 0) - per_expert)[by_expert]
    max_rows = triton.cdiv(count + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((max_rows,), count, dtype=torch.long, device=pairs.device)
    rows[(ends - padded)[by_expert] + rank] = order
    tile_starts = torch.arange(0, max_rows, block_m, device=pairs.device)
    return rows, torch.searchsorted(ends, tile_starts, right=True)


# en: The most pairs the one-program sort takes (16 tokens of top-8): its [pairs, experts] tile lives in registers.
# en: On an H100 it took a third of align_by_expert's time at 8 pairs, half at 128, and more at 256.
# zh: 单程序排序最多处理的对数（16 个 token，每个选 8 个专家）：它的 [对数, 专家数] tile 放在寄存器里。在 H100 上，
# zh: 8 对时它只用 align_by_expert 三分之一的时间，128 对时用一半，256 对时反而更慢。
ONE_PROGRAM_PAIRS = 128


@triton.jit
def align_kernel(chosen_ptr, rows_ptr, tile_expert_ptr, count, num_tiles, NUM_EXPERTS: tl.constexpr,
                 BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    pair = tl.arange(0, PAIRS)
    valid = pair < count
    # en: Padding pairs go to bin NUM_EXPERTS, which no run includes.
    # zh: 补齐用的对放进第 NUM_EXPERTS 个桶，任何一段都不包含它。
    expert = tl.load(chosen_ptr + pair, mask=valid, other=NUM_EXPERTS).to(tl.int32)
    bins = tl.arange(0, EXPERTS)
    # en: One-hot [pairs, experts]: summed down, each expert's count; summed down to a pair, its rank.
    # zh: 独热矩阵 [对数, 专家数]：按列求和得到每个专家的对数；累加到某一对为止，得到它的名次。
    hit = (expert[:, None] == bins[None, :]).to(tl.int32)
    per_expert = tl.where(bins < NUM_EXPERTS, tl.sum(hit, axis=0), 0)
    padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    # en: A pair's rank among its expert's pairs: how many come before it, the stable sort's order.
    # zh: 一对在它的专家的各对中的名次：排在它前面的有几对，也就是稳定排序的顺序。
    rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1
    start = tl.sum(hit * (ends - padded)[None, :], axis=1)
    tl.store(rows_ptr + start + rank, pair.to(tl.int64), mask=valid)
    # en: searchsorted(ends, tile * BLOCK_M, right=True): the experts whose run ends at or before the tile.
    # zh: searchsorted(ends, tile * BLOCK_M, right=True)：在这个 tile 之前（含）结束的专家有几个。
    tile = tl.arange(0, TILES)
    ended = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & (bins[None, :] < NUM_EXPERTS)
    tl.store(tile_expert_ptr + tile, tl.sum(ended.to(tl.int64), axis=1), mask=tile < num_tiles)


def align_in_one_program(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s (rows, tile experts) from a fill and one Triton program, for at most ONE_PROGRAM_PAIRS
    (token, slot) pairs: a decode step's few tokens, where align_by_expert's small kernels cost more than the sort."""
    # zh: 由一次填充和一个 Triton 程序得到 `align_by_expert` 的（行，tile 的专家），适用于至多 ONE_PROGRAM_PAIRS 个
    # zh: （token，槽）对：decode 步那寥寥几个 token，这时 align_by_expert 的小内核比排序本身还贵。
    pairs = chosen.numel()
    if pairs > ONE_PROGRAM_PAIRS:
        raise ValueError(f"one program sorts at most {ONE_PROGRAM_PAIRS} pairs, not {pairs}")
    max_rows = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((max_rows,), pairs, dtype=torch.long, device=chosen.device)
    tiles = max_rows // block_m
    tile_expert = torch.empty(tiles, dtype=torch.long, device=chosen.device)
    align_kernel[(1,)](chosen.reshape(-1), rows, tile_expert, pairs, tiles, NUM_EXPERTS=num_experts, BLOCK_M=block_m,
                       PAIRS=triton.next_power_of_2(max(pairs, 1)), EXPERTS=triton.next_power_of_2(num_experts + 1),
                       TILES=triton.next_power_of_2(tiles), num_warps=8)  # fmt: skip
    return rows, tile_expert


def sort_by_expert(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s result, from one program when there are at most ONE_PROGRAM_PAIRS pairs."""
    # zh: `align_by_expert` 的结果；对数至多 ONE_PROGRAM_PAIRS 时由一个程序得出。
    if chosen.numel() <= ONE_PROGRAM_PAIRS:
        return align_in_one_program(chosen, num_experts, block_m)
    return align_by_expert(chosen, num_experts, block_m)


@triton.jit
def grouped_expert_kernel(
    a_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, weights_ptr, num_pairs, N, K, top_k,
    stride_a, stride_we, stride_wn, stride_out,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr, GLU: tl.constexpr, WEIGHTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # en: Program (tile t, column block c): the BLOCK_M rows of tile t, all of one expert, times that expert's
    # en: weight, output columns [c * BLOCK_N, (c + 1) * BLOCK_N).
    # zh: 程序（tile t，列块 c）：tile t 的 BLOCK_M 行（都属于同一个专家）乘以这个专家的权重，输出第
    # zh: [c * BLOCK_N, (c + 1) * BLOCK_N) 列。
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < NUM_EXPERTS:
        pairs = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        # en: The first matmul reads the tokens' hidden states, the second the pairs' own rows.
        # zh: 第一个矩阵乘法读 token 的隐藏状态，第二个读每一对自己的那一行。
        a_rows = pairs // top_k if GATHER else pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)
            w_mask = col_mask[:, None] & k_mask[None, :]
            w = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
            if GLU:
                # en: The up rows sit N rows below the gate rows in the merged gate_up weight.
                # zh: 在合并的 gate_up 权重里，up 的行在 gate 的行下方 N 行处。
                w = tl.load(w_base + (N + cols)[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
                if UPCAST:
                    w = w.to(tl.float32)
                up = tl.dot(a, tl.trans(w), up, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        # en: Rounded to the model's dtype where the unfused layers hold a tensor of it.
        # zh: 在不融合的各层持有该数据类型张量的地方，舍入到模型的数据类型。
        result = acc.to(dtype).to(tl.float32)
        if GLU:
            result = (result * tl.sigmoid(result)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        if WEIGHTED:
            weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            result = result * weight[:, None]
        tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], result.to(dtype),
                 mask=valid[:, None] & col_mask[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
              block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """The experts' output for tokens ``x`` [T, H]: ``w13`` [E, 2I, H] the experts' merged gate/up weights,
    ``w2`` [E, H, I] their down weights, ``weights`` and ``chosen`` [T, top_k] the router's (`SparseMoeBlock.route`).
    Two grouped matmuls over the pairs sorted by expert, then each token's top_k rows added up."""
    # zh: token ``x`` [T, H] 的专家输出：``w13`` [E, 2I, H] 是各专家合并的 gate/up 权重，``w2`` [E, H, I] 是它们的
    # zh: down 权重，``weights`` 和 ``chosen`` [T, top_k] 来自路由器（`SparseMoeBlock.route`）。在按专家排序的各对上
    # zh: 做两次分组矩阵乘法，然后把每个 token 的 top_k 行相加。
    tokens, hidden = x.shape
    num_experts, width = w13.shape[0], w13.shape[1] // 2
    top_k = chosen.shape[1]
    if w2.shape != (num_experts, hidden, width) or w13.shape[2] != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit tokens of {hidden} and "
                         f"{num_experts} experts of width {width}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe needs rows of contiguous elements")
    pairs = tokens * top_k
    rows, tile_expert = sort_by_expert(chosen, num_experts, block_m)
    # en: The Triton interpreter gets tl.dot of 16-bit floats wrong: there the tiles go up to float32 first.
    # zh: Triton 解释器算 16 位浮点的 tl.dot 会出错：在那里 tile 先升到 float32。
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and x.dtype != torch.float32
    # en: float32 stays float32 (tf32 would round it where the loop does not); 16-bit tiles ignore the setting.
    # zh: float32 保持 float32（tf32 会在循环不舍入的地方舍入）；16 位的 tile 不受这个设置影响。
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    flat_weights = weights.reshape(pairs).contiguous()

    def grouped(a: torch.Tensor, w: torch.Tensor, columns: int, inputs: int, first: bool) -> torch.Tensor:
        # en: The first matmul gathers the tokens and applies SiLU x mul; the second weights each pair's row.
        # zh: 第一个矩阵乘法取出 token 并做 SiLU x mul；第二个给每一对的那一行乘上权重。
        out = torch.empty(pairs, columns, dtype=x.dtype, device=x.device)
        grouped_expert_kernel[(tile_expert.numel(), triton.cdiv(columns, block_n))](
            a, w, out, rows, tile_expert, flat_weights, pairs, columns, inputs, top_k,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATHER=first, GLU=first,
            WEIGHTED=not first, UPCAST=upcast, PRECISION=precision,
        )  # fmt: skip
        return out

    activated = grouped(x, w13, width, hidden, first=True)
    return grouped(activated, w2, hidden, width, first=False).view(tokens, top_k, hidden).sum(dim=1)

# %% fuse moe layers
#| export models.qwen3_moe
from nanovllm.book.literate import add_to_class


class FusedExperts:
    """A sparse block's experts as `fused_moe` runs them: the experts' weights stacked, [E, 2I, H] and [E, H, I]."""
    # zh: `fused_moe` 运行时所用的稀疏块专家：各专家的权重堆叠起来，[E, 2I, H] 和 [E, H, I]。

    def __init__(self, block: SparseMoeBlock) -> None:
        # en: Triton: imported only when the fused path is asked for (a CPU engine never imports it).
        # zh: Triton 只在需要融合路径时才导入（CPU 上的引擎从不导入它）。
        from nanovllm.layers.fused_moe import fused_moe

        self.fused_moe = fused_moe
        experts = block.experts
        self.w13 = torch.stack([expert.gate_up_proj.weight.data for expert in experts])
        self.w2 = torch.stack([expert.down_proj.weight.data for expert in experts])
        # en: Each expert's parameters become views into the stacks: the weights are held once.
        # zh: 每个专家的参数变成堆叠张量的视图：权重只存一份。
        for index, expert in enumerate(experts):
            expert.gate_up_proj.weight.data = self.w13[index]
            expert.down_proj.weight.data = self.w2[index]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return self.fused_moe(x, self.w13, self.w2, weights, chosen)


def fuse_moe_layers(model: nn.Module) -> int:
    """Hand every sparse block of ``model`` its experts as two grouped kernels (`fused_moe`); returns how many."""
    # zh: 把 ``model`` 的每个稀疏块的专家交给两个分组内核（`fused_moe`）；返回有多少个。
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)]
    for block in blocks:
        block.fused_experts = FusedExperts(block)
    return len(blocks)


# en: On a GPU the engine runs the fused kernels: the model stacks its experts as it is built, before the weights
# en: are loaded (the loaders copy into the stacks' views) and before any CUDA graph is captured. The MoE
# en: benchmark turns this off (`--experts loop`) to compare.
# zh: 在 GPU 上，引擎使用融合内核：模型在构建时就把专家堆叠起来，早于加载权重（加载器把权重拷进堆叠张量的视图），
# zh: 也早于捕获任何 CUDA 图。MoE 基准测试可以关掉它（`--experts loop`）来作比较。
Qwen3MoeForCausalLM.fused_experts_on_gpu: bool = True


@add_to_class(Qwen3MoeForCausalLM)
def __init__(self, config: Any) -> None:
    Qwen3ForCausalLM.__init__(self, config)
    if self.fused_experts_on_gpu and next(self.parameters()).is_cuda:
        fuse_moe_layers(self)

# %% [markdown] tags=["en"]
# ### See it: the sort, and the kernels against the loop
#
# The first layer's pairs for the prompt above, sorted by expert in tiles of 4 rows (`·` is an
# unused row), and the same from the one-program sort; then both kernels (in the Triton
# interpreter on a CPU) against the loop on the same hidden states; then the engine with every
# sparse block fused, against `transformers`.

# %% [markdown] tags=["zh"]
# ### 看它运行：排序，以及内核对比循环
#
# 上面那个提示词在第一层的各对，按专家排序、每个 tile 4 行（`·` 表示没用到的行），单程序排序给出同样的结果；
# 然后在同样的隐藏状态上，让两个内核（在 CPU 上用 Triton 解释器运行）与循环比较；最后让所有稀疏块都融合的引擎与
# `transformers` 比较。

# %%
import copy

from nanovllm.layers.fused_moe import align_by_expert, align_in_one_program, fused_moe
from nanovllm.models.qwen3_moe import FusedExperts, fuse_moe_layers

x = seen[0]
weights, chosen = block.route(x)
rows, tile_expert = align_by_expert(chosen, block.num_experts, block_m=4)
pairs = chosen.numel()
used = [chosen.flatten()[row].item() if row < pairs else "·" for row in rows.tolist()]
print(say("sorted by expert: {order}", order=" ".join(map(str, used))))
print(say("tiles of {tile} rows: experts {experts}", tile=4, experts=tile_expert.tolist()))
assert len(rows) == (pairs + block.num_experts * 3 + 3) // 4 * 4
assert set(tile_expert.tolist()) - {block.num_experts} == set(chosen.unique().tolist())

# en: The kernels run where Triton runs: compiled on a GPU, in the interpreter on a CPU. A copy of the block goes
# en: there, so that stacking its experts leaves the CPU engine's block alone.
# zh: 内核在 Triton 运行的地方运行：GPU 上编译执行，CPU 上在解释器里执行。块的一个副本放到那里，这样堆叠它的专家
# zh: 不会动到 CPU 引擎里的那个块。
kernel_device = "cuda" if torch.cuda.is_available() else "cpu"
kernel_block, kernel_x = copy.deepcopy(block).to(kernel_device), x.to(kernel_device)
# en: The one-program sort finds the same rows and tiles.
# zh: 单程序排序得到同样的行和 tile。
one_program = align_in_one_program(chosen.to(kernel_device), block.num_experts, block_m=4)
assert torch.equal(one_program[0].cpu(), rows) and torch.equal(one_program[1].cpu(), tile_expert)
fused = FusedExperts(kernel_block)
looped = kernel_block.chosen_experts(kernel_x, weights.to(kernel_device), chosen.to(kernel_device))
gap = (fused_moe(kernel_x, fused.w13, fused.w2, weights.to(kernel_device), chosen.to(kernel_device)) - looped)
print(say("fused kernels against the loop: max |difference| {gap:.1e}", gap=gap.abs().max().item()))
assert gap.abs().max() < 1e-5
if kernel_device == "cpu":
    assert fuse_moe_layers(model) == 2
    fused_llm = llm
else:
    # en: On a GPU the engine builds its sparse blocks fused; float32, as transformers runs here.
    # zh: 在 GPU 上，引擎构建的稀疏块本来就是融合的；用 float32，和这里运行的 transformers 一样。
    fused_llm = LLM(tiny_moe, device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64)
    assert all(module.fused_experts is not None for module in fused_llm.model_runner.model.modules()
               if isinstance(module, SparseMoeBlock))
# en: two of the prompts: every interpreted program costs milliseconds
# zh: 只用其中两个提示词：解释执行的每个程序都要花几毫秒
outputs = [o["token_ids"] for o in fused_llm.generate(prompts[:2], greedy, use_tqdm=False)]
print(say("greedy tokens match transformers: {same}", same=outputs == expected[:2]))
assert outputs == expected[:2]
if fused_llm is not llm:
    fused_llm.exit()

# %% [markdown] tags=["en"]
# ## On a GPU, recorded: the loop, the kernels and the bound
#
# The measurements below were taken on one H100 (80 GB; 3.00 TB/s copy rate measured in each run),
# Qwen3-30B-A3B's shapes with random weights, bfloat16, by `scripts/gpu-ci.sh moe`'s commands.
# First one sparse layer on its own (`scripts/probes/moe_probe.py`, each path replayed from a CUDA graph,
# the bound being the bytes of the experts the router touched): the loop launches three matmuls
# per chosen expert and asks the host for each expert's tokens, and every expert on every token
# (what a graph captures without the kernels) reads and multiplies all 128 experts. The fused
# kernels read what the router chose, at three quarters of the copy rate from 64 tokens on; at one
# token each expert's tiles are too few to keep the GPU's memory system busy.
#
# Then the engine on chapter 19's nano-vllm workload (256 requests), `python -m nanovllm.bench
# --moe`: on 8 of the 48 layers the fused kernels run at 92 % of the router-aware bound, 4.6 times
# the graphed every-expert path (2026-12-05). On all 48 layers (2026-12-06, 3.02 TB/s) the weights
# (61 GB) leave the 80 GB card room for about 182 sequences' KV at a time, so the run needs 1,852
# decode steps where the bound, which assumes all 256 decode together, counts 1,023. It ran at
# 2,251 tok/s: 60 % of the router-aware bound of 3,734 tok/s, and 77 % of the same bound counted at
# the steps the run needed (the benchmark prints this second figure whenever the cache held fewer
# sequences than the workload has). Most of the gap is steps the card cannot avoid, not time per
# step. The smaller batches also read fewer experts: 77.5 % of them in an average decode step, all of
# them from 102 sequences up, 71 % at 20.
#
# A 141 GB H200 holds the whole batch (2026-12-05, 4.20 TB/s copy rate measured in the run): all 48
# layers ran at 4,368 tok/s, 94 % of the router-aware bound, in the 1,023 decode steps the bound
# counts; 8 layers at 24,000 tok/s, 94 % as well. The router-aware bound is only 3 % above the
# dense-style one on this workload: an average decode step touched 94 % of the experts, all of
# them while 111 or more sequences decoded together, 82 % at 28 and 6 % at the last one.
#
# The sort alone (`scripts/probes/moe_align_probe.py`, 128 experts, top-8, each replayed from a CUDA
# graph): `align_by_expert` takes 47 µs at one token and 52 at 16, the one-program sort 16 and 26:
# 3.0 times as fast at one token, about 1.5 ms a step over 48 layers, and 2.0 times at 16
# tokens. At 32 tokens (256 pairs) its tile no longer fits the registers and it is the slower, hence
# its limit of 128 pairs. The H200 runs above sort through it in every step of up to 16 tokens; the
# engine's one-token step on its own is not timed yet.

# %% [markdown] tags=["zh"]
# ## GPU 上的记录：循环、内核与上限
#
# 下面的测量来自一张 H100（80 GB；每次运行都测一遍拷贝速率，为 3.00 TB/s），用 Qwen3-30B-A3B 的形状和随机权重，
# bfloat16，命令是 `scripts/gpu-ci.sh moe` 里的那些。先看单独的一个稀疏层（`scripts/probes/moe_probe.py`，每条路径都从
# CUDA 图重放，上限是路由器用到的那些专家的字节数）：循环为每个选中的专家启动三个矩阵乘法，还要向主机询问每个专家
# 分到的 token；让每个专家处理每个 token（没有融合内核时图里捕获的就是它）则要读取并计算全部 128 个专家。融合内核
# 只读路由器选中的专家，从 64 个 token 起达到拷贝速率的四分之三；只有一个 token 时，每个专家的 tile 太少，喂不饱
# GPU 的显存系统。
#
# 然后是引擎在第 19 章 nano-vllm 工作负载（256 个请求）上的表现，`python -m nanovllm.bench --moe`：在 48 层中的
# 8 层上，融合内核达到按路由器算的上限的 92%，是图里"每个专家处理每个 token"路径的 4.6 倍（2026-12-05）。在全部
# 48 层上（2026-12-06，3.02 TB/s），权重（61 GB）只给 80 GB 的卡留下同时装约 182 个序列 KV 的空间，所以这次运行需要
# 1,852 个 decode 步，而上限假设 256 个序列一起 decode，只算 1,023 步。它跑出 2,251 tok/s：是按路由器算的上限
# 3,734 tok/s 的 60%；按这次运行实际需要的步数来算同一个上限，则是 77%（缓存同时装下的序列少于工作负载的序列数时，
# 基准测试会打印这第二个数）。差距主要来自这张卡躲不开的步数，而不是每一步的时间。批次小了，读到的专家也少：平均每个
# decode 步读 77.5% 的专家，102 个序列以上时全部读到，20 个时 71%。
#
# 141 GB 的 H200 能装下整个批次（2026-12-05，运行中测得的拷贝速率为 4.20 TB/s）：全部 48 层达到 4,368 tok/s，
# 是按路由器算的上限的 94%，用的正是上限所算的 1,023 个 decode 步；8 层达到 24,000 tok/s，也是 94%。在这个工作负载上，
# 按路由器算的上限只比按稠密方式算的高 3%：平均每个 decode 步用到 94% 的专家，111 个以上的序列一起 decode 时全部
# 用到，28 个时 82%，只剩最后一个序列时 6%。
#
# 单看排序（`scripts/probes/moe_align_probe.py`，128 个专家，每个 token 选 8 个，都从 CUDA 图重放）：`align_by_expert`
# 在一个 token 时用 47 µs，16 个 token 时用 52 µs；单程序排序分别用 16 和 26 µs：一个 token 时快 3.0 倍，48 层合计每步
# 约省 1.5 ms；16 个 token 时快 2.0 倍。到 32 个 token（256 对）时它的 tile 放不进寄存器，反而更慢，所以它最多处理
# 128 对。上面 H200 上的运行在每个不超过 16 个 token 的步里都用它排序；引擎单独一个 token 的步还没有单独计时。

# %%
from nanovllm.book.recorded import recorded
from nanovllm.layers.fused_moe import ONE_PROGRAM_PAIRS

gpu_runs = recorded("26_mixture_of_experts")
for run in gpu_runs.values():
    print(say("{name}: {card}, {date}, {command}", name=run.name, card=run.card, date=run.date, command=run.command))
# en: One layer, H100: (tokens, experts the router touched, microseconds: the loop, every expert, fused_moe).
# zh: 一层，H100：（token 数，路由器用到的专家数，微秒：循环、每个专家、fused_moe）。
layer = gpu_runs["one layer"].figures
copy_rate, expert_bytes = layer["copy TB/s"] * 1e12, 3 * 2048 * 768 * 2
for tokens, touched, loop_us, every_us, fused_us in layer["rows"]:
    bound_us = touched * expert_bytes / copy_rate * 1e6
    print(say("{tokens:>3} tokens, {touched:>3} experts: loop {loop:>7.0f} us, every expert {every:>6.0f} us, fused "
              "{fused:>5.0f} us = {share:.0%} of the bound", tokens=tokens, touched=touched, loop=loop_us,
              every=every_us, fused=fused_us, share=bound_us / fused_us))
    assert fused_us < every_us / 6 and fused_us < loop_us / 20
# en: Three quarters of the copy rate from 64 tokens on.
# zh: 从 64 个 token 起达到拷贝速率的四分之三。
assert all(touched * expert_bytes / copy_rate * 1e6 / fused_us > 0.7
           for tokens, touched, _, _, fused_us in layer["rows"] if tokens >= 64)
# en: Tokens per second and the router-aware bound: on the H100 8 layers both ways and 48 fused, then the H200's runs.
# zh: 每秒 token 数与按路由器算的上限：H100 上 8 层两种方式、48 层融合，然后是 H200 上的运行。
h100, h200 = gpu_runs["engine, H100"].figures, gpu_runs["engine, H200"].figures
whole = gpu_runs["engine, H100, 48 layers"].figures
engine_runs = {name: (run["tok/s"], run["router-aware bound tok/s"]) for name, run in (
    ("H100, 8 layers, every expert", h100["8 layers, every expert"]),
    ("H100, 8 layers, fused", h100["8 layers, fused"]), ("H100, 48 layers, fused", whole),
    ("H200, 8 layers, fused", h200["8 layers, fused"]), ("H200, 48 layers, fused", h200["48 layers, fused"]))}
for name, (tokens_per_s, router_bound) in engine_runs.items():
    print(say("{name}: {rate:,.0f} tok/s, {share:.0%} of the router-aware bound", name=say(name), rate=tokens_per_s,
              share=tokens_per_s / router_bound))
assert engine_runs["H100, 8 layers, fused"][0] > 4 * engine_runs["H100, 8 layers, every expert"][0]
assert round(engine_runs["H100, 8 layers, fused"][0] / engine_runs["H100, 8 layers, fused"][1], 2) == 0.92
assert round(engine_runs["H100, 8 layers, fused"][0] / engine_runs["H100, 8 layers, every expert"][0], 1) == 4.6
# en: The 80 GB card held 182 of the 256 sequences at a time: more steps than the bound counts, fewer experts a step.
# zh: 80 GB 的卡一次只装得下 256 个序列中的 182 个：步数多于上限所算的，每步读到的专家也更少。
assert whole["decode steps"] > whole["decode steps of the bound"] and whole["sequences at a time"] < 256
assert round(whole["tok/s"] / whole["router-aware bound tok/s"], 2) == 0.60
assert round(whole["tok/s"] / whole["router-aware bound at the run's steps tok/s"], 2) == 0.77
assert whole["experts a decode step read"]["mean"] < h200["experts a decode step read"]["mean"]
# en: Where the batch fits, the whole model keeps the pace of 8 layers: the goal set for it was 70 % of the bound.
# zh: 批次装得下时，整个模型和 8 层跑得一样贴近上限：为它设定的目标是上限的 70%。
h200_shares = [rate / bound for name, (rate, bound) in engine_runs.items() if name.startswith("H200")]
assert min(h200_shares) > 0.9 and all(round(share, 2) == 0.94 for share in h200_shares)
# en: The sort alone, H100: (tokens of top-8, microseconds: align_by_expert, align_in_one_program).
# zh: 单看排序，H100：（每个选 8 个专家的 token 数，微秒：align_by_expert、align_in_one_program）。
sorts = [tuple(row) for row in gpu_runs["sort"].figures["rows"]]
for tokens, torch_us, one_us in sorts:
    print(say("sort, batch of {tokens:>2}: align_by_expert {torch:.0f} us, one program {one:.0f} us ({ratio:.1f}x)",
              tokens=tokens, torch=torch_us, one=one_us, ratio=torch_us / one_us))
# en: Faster wherever sort_by_expert picks it, slower past its limit; at one token, 48 layers save about 1.5 ms a step.
# zh: 在 sort_by_expert 选用它的地方都更快，超过上限就更慢；一个 token 时，48 层每步约省 1.5 ms。
assert all(one_us < torch_us / 1.9 for tokens, torch_us, one_us in sorts if tokens * 8 <= ONE_PROGRAM_PAIRS)
assert all(one_us > torch_us for tokens, torch_us, one_us in sorts if tokens * 8 > ONE_PROGRAM_PAIRS)
assert round(48 * (sorts[0][1] - sorts[0][2]) / 1000, 1) == 1.5

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm.models.qwen3_moe`: `SparseMoeBlock` (router with top-k and `norm_topk_prob`, experts
#   as `Qwen3MLP`s, the chosen-experts loop and its fixed-shape twin for CUDA graphs, one
#   all-reduce under tensor parallelism), `is_sparse_layer`, `Qwen3MoeModel` and
#   `Qwen3MoeForCausalLM`, registered under `Qwen3MoeForCausalLM`; token-exact with
#   `transformers` on the tiny `qwen3_moe` model through chunked prefill, prefix hits, preemption
#   and forks.
# - Chapter 06's model gained the two seams this needed: `Qwen3DecoderLayer(..., mlp=...)` and
#   `Qwen3Model.make_layer`; the tiny models write a MoE's experts as checkpoints do (one tensor
#   per expert).
# - The arithmetic of a step's reads with a router, the benchmark's parameter count for sparse
#   layers (`expert_mlp_params` in `MLP_RULES`), and the router played step by step (appendix A's
#   player around ready-made frames, `slides_html`).
# - `nanovllm.layers.fused_moe`: `align_by_expert` (the pairs sorted by expert in tiles, in shapes
#   that depend on the token count alone), the same sort in one Triton program for up to 128 pairs
#   (`align_in_one_program`, picked by `sort_by_expert`), and `fused_moe` (two grouped Triton kernels: gate/up
#   with SiLU × mul, down with the router's weights); `fuse_moe_layers` and `FusedExperts` hand
#   them to a model's sparse blocks, the experts' weights stacked and held once. Checked here in
#   the Triton interpreter, token-exact in the engine.
# - `python -m nanovllm.bench --moe` (`nanovllm.bench.moe`): a run held to the dense-style bound and
#   to the router-aware one, from the experts its decode steps chose, counted on the device by the
#   blocks themselves (`SparseMoeBlock.count_touched`); on a GPU, Qwen3-30B-A3B's shapes with
#   random weights (`qwen3_moe_30b_shapes`).
#
# On a GPU the fused kernels are the engine's default (recorded above on an H100 and an H200: the
# whole model at 94 % of the router-aware bound where its batch fits). Not yet: the engine's
# one-token step with the one-program sort timed on its own, and the rest of the small-token
# overhead (the router's small kernels).
#
# ## Exercises
#
# 1. A 6-layer Qwen3-MoE config has `decoder_sparse_step = 2` and `mlp_only_layers = [3]`. Which
#    layers have experts?
# 2. With uniform routing, 128 experts and 8 per token, how many experts does a step of 16 tokens
#    touch on average?
# 3. Turn `norm_topk_prob` off in the tiny model's first layer. What do a token's weights add up
#    to, and why is that a problem for the layer's output?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.models.qwen3_moe`：`SparseMoeBlock`（带 top-k 和 `norm_topk_prob` 的路由器，作为 `Qwen3MLP` 的专家，
#   只算选中专家的循环以及它供 CUDA Graph 用的固定形状版本，张量并行时只做一次 all-reduce），`is_sparse_layer`，
#   `Qwen3MoeModel` 与 `Qwen3MoeForCausalLM`，以 `Qwen3MoeForCausalLM` 之名注册；在小的 `qwen3_moe` 模型上与
#   `transformers` 逐 token 一致，包括分块 prefill、前缀缓存命中、抢占和分叉。
# - 第 06 章的模型为此多了两个接缝：`Qwen3DecoderLayer(..., mlp=...)` 与 `Qwen3Model.make_layer`；小模型按检查点的
#   方式写出 MoE 的专家（每个专家一个张量）。
# - 带路由器时一步读取量的算术，基准测试对稀疏层参数的计数（`MLP_RULES` 里的 `expert_mlp_params`），以及一步一步
#   播放的路由过程（附录 A 的播放器，套在现成的帧外面：`slides_html`）。
# - `nanovllm.layers.fused_moe`：`align_by_expert`（把各对按专家排序、分成 tile，形状只取决于 token 数），不超过
#   128 对时在一个 Triton 程序里做的同一排序（`align_in_one_program`，由 `sort_by_expert` 选用），以及
#   `fused_moe`（两个分组的 Triton 内核：gate/up 加 SiLU × mul，down 加路由器权重）；`fuse_moe_layers` 和
#   `FusedExperts` 把它们交给模型的稀疏块，专家权重堆叠起来、只存一份。这里在 Triton 解释器里检查过，在引擎里逐 token
#   一致。
# - `python -m nanovllm.bench --moe`（`nanovllm.bench.moe`）：把一次运行与按稠密方式算的上限、以及按路由器算的上限
#   比较；后者来自这次运行的 decode 步实际选中的专家，由各个块自己在设备上计数（`SparseMoeBlock.count_touched`）；
#   在 GPU 上默认使用 Qwen3-30B-A3B 的形状和随机权重（`qwen3_moe_30b_shapes`）。
#
# 在 GPU 上，融合内核是引擎的默认路径（上面有在 H100 和 H200 上的记录：批次装得下时，整个模型达到按路由器算的
# 上限的 94%）。还没有做的：单独测量用上单程序排序之后引擎一个 token 的步，以及 token 很少时其余的额外开销（路由器的
# 小内核）。
#
# ## 练习
#
# 1. 一个 6 层的 Qwen3-MoE 配置里 `decoder_sparse_step = 2`、`mlp_only_layers = [3]`。哪些层有专家？
# 2. 均匀路由、128 个专家、每个 token 选 8 个时，一步 16 个 token 平均用到多少个专家？
# 3. 在小模型的第一层关掉 `norm_topk_prob`。一个 token 的权重加起来是多少？为什么这对这一层的输出是个问题？

# %%
from types import SimpleNamespace

from nanovllm.models.qwen3_moe import is_sparse_layer

# en: Exercise 1: (i + 1) % 2 == 0 gives layers 1, 3 and 5; mlp_only_layers takes 3 out: layers 1 and 5.
# zh: 练习 1：(i + 1) % 2 == 0 得到第 1、3、5 层；mlp_only_layers 去掉第 3 层：第 1 层和第 5 层。
six = SimpleNamespace(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3])
assert [i for i in range(6) if is_sparse_layer(six, i)] == [1, 5]

# en: Exercise 2: 128 * (1 - (120/128) ** 16), about 82.4 of the 128.
# zh: 练习 2：128 * (1 - (120/128) ** 16)，大约是 128 个中的 82.4 个。
assert abs(expected_experts(128, 8, 16) - 82.4) < 0.05

# en: Exercise 3: to the probability mass of its top k, less than 1: the layer's output shrinks by that factor,
# en: differently for every token, and the model was trained with weights that add up to 1.
# zh: 练习 3：加起来是它的 top k 的概率质量，小于 1：这一层的输出按这个比例缩小，每个 token 缩小得不一样，而模型
# zh: 是在权重加起来为 1 的情况下训练的。
block.norm_topk_prob = False
raw, _ = block.route(seen[0])
block.norm_topk_prob = True
assert (raw.sum(-1) < 1).all() and torch.allclose(block.route(seen[0])[0].sum(-1), torch.ones(len(raw)))
llm.exit()
print(say("all exercise answers check out"))
