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
# # 06 · The model: Qwen3 and Llama, and loading their weights
#
# **Goal.** Build the network the engine runs — Qwen3 (plus its two close relatives, Qwen2 and
# Llama) — from small layers, load a Hugging Face checkpoint directory into it, and show that
# it computes the same logits as `transformers`, both for a whole prompt at once and
# token by token through the paged KV cache of chapter 06.
#
# Our model differs from the `transformers` one in what matters for serving: it takes one
# **flat** list of tokens from many sequences (`input_ids [T]`, `positions [T]`), its attention
# reads and writes the paged cache (from chapter 07 on), its projections are fused (q/k/v in one matmul, gate/up in
# one) and split-able across GPUs (chapter 16), and the LM head computes logits only where a
# token will be sampled.

# %% [markdown] tags=["zh"]
# # 06 · 模型：Qwen3 与 Llama，以及加载权重
#
# **目标：** 用一些小层搭出引擎要运行的网络——Qwen3（以及它的两个近亲 Qwen2 和 Llama）——把 Hugging Face
# 检查点目录加载进来，并证明它算出的 logits 与 `transformers` 相同：无论是一次性处理整个提示词，还是通过
# 第 07 章的分页 KV 缓存逐个 token 地计算。
#
# 我们的模型与 `transformers` 的不同之处都与推理服务有关：它接收来自多个序列的一串**展平**的 token
# （`input_ids [T]`、`positions [T]`）；注意力读写分页缓存（从第 07 章起）；投影是融合的（q/k/v 一次矩阵乘法，
# gate/up 一次），并且可以切分到多张 GPU 上（第 16 章）；LM head 只在要采样的位置计算 logits。

# %% [markdown] tags=["en"]
# ## The idea: one decoder layer
#
# ```
# x ──► RMSNorm ──► qkv_proj ─► q,k,v ─► (q_norm, k_norm: Qwen3) ─► RoPE ─► paged attention ─► o_proj ──┐
# │                                                                                                   (+)◄┘
# └──────────────── residual ─────────────────────────────────────────────────────────────────────────┘ │
#   ──► RMSNorm ──► gate_up_proj ──► SiLU(gate) · up ──► down_proj ──► (+ residual) ──► next layer
# ```
#
# A model is an embedding, `num_hidden_layers` such layers, a final RMSNorm and the LM head.
# The three architectures differ only in small switches: Qwen3 normalizes each head of q and k
# (`q_norm`, `k_norm`); Qwen2 has biases on q, k, v; Llama has neither but may have biases
# everywhere (`attention_bias`, `mlp_bias`), and small Llamas such as SmolLM2 **tie** the LM
# head to the embedding (one matrix serves both).
#
# **RMSNorm with a fused residual.** Every norm but the first is preceded by "add the residual".
# `RMSNorm(x, residual)` does both and returns the normalized sum *and* the sum, which becomes
# the next residual. The sum is taken in the model's dtype and the normalization in float32,
# exactly as `transformers` does, so the two agree bit for bit in float32 and closely in bf16.
#
# **RoPE.** Rotary position embedding rotates pairs of q and k coordinates by an angle
# proportional to the token's position. We use the NeoX layout (`transformers`' `rotate_half`:
# coordinate `i` pairs with `i + d/2`), and precompute `cos` and `sin` for every position once.
#
# Each of these small layers keeps its maths in a plain function (`rms_norm`, `silu_and_mul`,
# `rotary`) and calls it through a class attribute `op`. That is the one hook chapter 14 needs:
# on a GPU the model runner hands every such layer a `torch.compile`d version of the same
# function, so the maths is written once and `forward` is never replaced.

# %% [markdown] tags=["zh"]
# ## 思路：一个解码层
#
# ```
# x ──► RMSNorm ──► qkv_proj ─► q,k,v ─► （q_norm、k_norm：Qwen3）─► RoPE ─► 分页注意力 ─► o_proj ──┐
# │                                                                                              (+)◄┘
# └──────────────── 残差 ───────────────────────────────────────────────────────────────────────┘ │
#   ──► RMSNorm ──► gate_up_proj ──► SiLU(gate) · up ──► down_proj ──► （+ 残差）──► 下一层
# ```
#
# 一个模型由嵌入层、`num_hidden_layers` 个这样的层、最后的 RMSNorm 和 LM head 组成。三种架构只在几个小开关上
# 不同：Qwen3 对 q 和 k 的每个头做归一化（`q_norm`、`k_norm`）；Qwen2 在 q、k、v 上有偏置；Llama 两者都没有，
# 但可能处处带偏置（`attention_bias`、`mlp_bias`），而 SmolLM2 这样的小 Llama 会把 LM head 与嵌入层
# **绑定**（tie，一个矩阵两用）。
#
# **带融合残差的 RMSNorm：** 除第一个以外，每个归一化之前都要“加上残差”。`RMSNorm(x, residual)` 把两件事
# 一起做，返回归一化后的和*以及*和本身，后者成为下一个残差。求和在模型的数据类型下进行，归一化在 float32 下
# 进行，与 `transformers` 完全一致，因此两者在 float32 下逐位相同，在 bf16 下也非常接近。
#
# **RoPE：** 旋转位置编码把 q 和 k 的坐标两两配对，按与 token 位置成正比的角度旋转。我们采用 NeoX 布局
# （即 `transformers` 的 `rotate_half`：第 `i` 个坐标与第 `i + d/2` 个配对），并为每个位置一次性预先算好
# `cos` 和 `sin`。
#
# 这几个小层都把自己的数学写在一个普通函数里（`rms_norm`、`silu_and_mul`、`rotary`），并通过类属性 `op` 调用它。
# 这正是第 14 章需要的唯一挂钩：在 GPU 上，模型执行器把同一个函数经 `torch.compile` 编译后的版本交给每个这样的层，
# 所以数学只写一遍，`forward` 也从不被替换。

# %% default module
#| default_exp models.qwen3

# %% rmsnorm
#| export layers.layernorm
from __future__ import annotations

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) * weight; with ``residual``, first x = x + residual and return (normed, x)."""
    # zh: x / rms(x) * weight；给了 ``residual`` 时，先算 x = x + residual，再返回 (normed, x)。
    if residual is not None:
        # en: Add in the model's dtype, as transformers does, so the residual stream matches it exactly.
        # zh: 与 transformers 一样在模型的数据类型下相加，使残差流与它完全一致。
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


class RMSNorm(nn.Module):
    """``rms_norm`` with a learned weight."""
    # zh: 带可学习权重的 ``rms_norm``。

    # en: The maths; on a GPU compile_small_ops hands each norm a compiled version of it.
    # zh: 数学本身；在 GPU 上，第 14 章把它编译后的版本交给每个归一化层。
    op = staticmethod(rms_norm)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.op(x, residual, self.weight, self.eps)

# %% activation
#| export layers.activation
import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] -> SiLU(gate) * up: the SwiGLU of the MLP, after one fused gate_up matmul."""
    # zh: [gate | up] -> SiLU(gate) * up：MLP 的 SwiGLU，接在一次融合的 gate_up 矩阵乘法之后。
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    # en: as in RMSNorm: compile_small_ops may hand it a compiled version
    # zh: 与 RMSNorm 一样：第 14 章可能把它换成编译后的版本。
    op = staticmethod(silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)

# %% [markdown] tags=["en"]
# ### RoPE and its scaled variants
#
# The rotation frequencies are `inv_freq[i] = base^(-2i/d)`. Models trained for long contexts
# rescale them, and their `config.json` says how in `rope_scaling` (or, in `transformers` 5,
# `rope_parameters`). We support `default` (no scaling), `linear` (all frequencies divided by
# `factor`) and `llama3` (low frequencies divided by `factor`, high ones kept, a smooth blend in
# between — Llama 3.1/3.2). Any other type (`yarn`, `dynamic`, `longrope`, ...) raises a
# `ValueError` that names it, instead of silently computing the wrong positions.

# %% [markdown] tags=["zh"]
# ### RoPE 及其缩放变体
#
# 旋转频率为 `inv_freq[i] = base^(-2i/d)`。为长上下文训练的模型会重新缩放这些频率，具体做法写在
# `config.json` 的 `rope_scaling`（`transformers` 5 中为 `rope_parameters`）里。我们支持 `default`（不缩放）、
# `linear`（所有频率除以 `factor`）和 `llama3`（低频除以 `factor`，高频保持，中间平滑过渡——Llama 3.1/3.2）。
# 其他类型（`yarn`、`dynamic`、`longrope` 等）会抛出指明类型的 `ValueError`，而不是悄悄算错位置。

# %% rope
#| export layers.rotary_embedding
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The rotation frequencies, rescaled as the checkpoint's rope_scaling says (float32)."""
    # zh: 旋转频率，按检查点的 rope_scaling 重新缩放（float32）。
    # en: The same expression as transformers, so that both produce the same float32 values.
    # zh: 与 transformers 使用相同的表达式，使两者得到相同的 float32 数值。
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    try:
        factor = float(rope_scaling["factor"])
        if rope_type == "linear":
            return inv_freq / factor
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old_context = float(rope_scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise ValueError(f"rope scaling {rope_type!r} needs the key {missing.args[0]!r}, got {rope_scaling}") from None
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first 2 * cos.shape[-1] coordinates of x [T, heads, d]."""
    # zh: 对 x [T, heads, d] 的前 2 * cos.shape[-1] 个坐标做 NeoX 式旋转。
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def rotary(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by their positions, with cos and sin read from the precomputed table."""
    # zh: 按位置旋转 q 和 k，cos 和 sin 从预先算好的表里读取。
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions; cos and sin are precomputed for every position."""
    # zh: 按位置旋转 q 和 k；每个位置的 cos 和 sin 都预先算好。

    # en: as in RMSNorm: compile_small_ops may hand it a compiled version
    # zh: 与 RMSNorm 一样：第 14 章可能把它换成编译后的版本。
    op = staticmethod(rotary)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        assert rotary_dim <= head_size and rotary_dim % 2 == 0
        self.head_size, self.rotary_dim = head_size, rotary_dim
        inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling)
        freqs = torch.arange(max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # en: Not persistent: it is computed, never loaded from a checkpoint.
        # zh: 不持久化：它是算出来的，从不从检查点加载。
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(self.cos_sin_cache, positions, q, k)


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """A rotary embedding (a model builds one and shares it across its layers)."""
    # zh: 一个旋转位置编码（模型构建一个，在各层之间共享）。
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling)


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) from an HF config: transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    # zh: 从 HF config 读出 (base, scaling)：transformers 5 的 rope_parameters，或较早的 rope_theta/rope_scaling。
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params
    scaling = getattr(config, "rope_scaling", None)
    return float(getattr(config, "rope_theta", 10000.0)), scaling

# %% [markdown] tags=["en"]
# ## Build it: the linear and embedding layers
#
# The model's matmuls are written in the shape that chapter 16 needs to split them across GPUs,
# so that the model never has to be written twice. Each layer takes the whole layer's sizes,
# asks `tp_world()` which rank of how many it is, and keeps its rank's share; its checkpoint
# tensors arrive through a `weight_loader(param, loaded_weight, shard_id=None)` attached to each
# parameter, which the loader below calls with the **full** tensor. Two of them are *fused*:
# `qkv_proj` holds the q, k and v projections in one matrix (`QKVParallelLinear`) and
# `gate_up_proj` the MLP's gate and up (`MergedColumnParallelLinear`), so the loader passes a
# `shard_id` (`"q"`, `"k"`, `"v"`, or 0 and 1) and the layer copies the tensor to its part's rows.
#
# In this chapter there is one process: `tp_world()` asks `process_world()`, which says rank 0
# of 1, so every "share" is the whole matrix and every division by `tp_size` divides by 1. The
# embedding looks up each token and the LM head multiplies by the whole vocabulary; the places
# where ranks will have to talk are two small hooks that, for now, return what they are given
# (`sum_over_ranks`, `gather_slices`). Chapter 16 teaches `process_world` to ask
# `torch.distributed`, fills the hooks, and gives the row-parallel layer its all-reduce. The LM
# head's other hook, `sampled_rows`, is for chapter 07: it will keep only the rows a token is
# sampled from.

# %% [markdown] tags=["zh"]
# ## 动手：线性层与嵌入层
#
# 模型中的矩阵乘法一开始就按第 16 章把它们切到多张 GPU 上所需的形状来写，这样模型不必写两遍。每一层接收整个层的
# 尺寸，问 `tp_world()` 自己是几个 rank 中的第几个，然后只保留本 rank 的那一份；它的检查点张量通过挂在每个参数上的
# `weight_loader(param, loaded_weight, shard_id=None)` 进来，下面的加载器用**完整**的张量调用它。其中两个是
# *融合*的：`qkv_proj` 把 q、k、v 三个投影放在一个矩阵里（`QKVParallelLinear`），`gate_up_proj` 放的是 MLP 的
# gate 和 up（`MergedColumnParallelLinear`），所以加载器会传入 `shard_id`（`"q"`、`"k"`、`"v"`，或 0 和 1），
# 层再把张量复制到这一部分的行上。
#
# 本章只有一个进程：`tp_world()` 去问 `process_world()`，得到“1 个中的第 0 个”，所以每一“份”都是整个矩阵，每次
# 除以 `tp_size` 都是除以 1。嵌入层查找每个 token，LM head 与整个词表相乘；将来各 rank 必须通信的地方是两个小接缝，
# 目前它们原样返回收到的东西（`sum_over_ranks`、`gather_slices`）。第 16 章让 `process_world` 去问
# `torch.distributed`，填上这两个接缝，并给行并行层加上 all-reduce。LM head 的另一个接缝 `sampled_rows` 留给
# 第 07 章：它将只保留要采样的那些行。

# %% linear layers
#| export layers.linear
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# en: Which part of a fused layer a checkpoint tensor is: "q"/"k"/"v", 0/1 for gate/up, None for all of it.
# zh: 检查点张量是融合层的哪一部分："q"/"k"/"v"，gate/up 为 0/1，None 表示整个矩阵。
ShardId = str | int | None


def process_world() -> tuple[int, int]:
    """(rank, size) of this process among the processes that split the model: one process holds all of it."""
    # zh: 本进程在切分模型的各进程中的 (rank, size)：只有一个进程时，它持有整个模型。
    return 0, 1


def tp_world(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group: explicit values (tests simulate ranks so), else this process's."""
    # zh: 张量并行组的 (rank, size)：显式给出的值（测试用它模拟各 rank），否则取本进程的。
    rank, size = process_world()
    tp_rank, tp_size = rank if tp_rank is None else tp_rank, size if tp_size is None else tp_size
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    return tp_rank, tp_size


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division, or a ValueError naming what does not split evenly across the ranks."""
    # zh: 整除；除不尽时抛出 ValueError，写明哪个量无法在各 rank 之间均分。
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def copy_checked(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a (sliced) checkpoint tensor into a parameter, refusing a shape mismatch by name."""
    # zh: 把（切过片的）检查点张量复制进参数；形状不符时拒绝，并写明名字。
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """A linear layer whose weight is (possibly) one shard of a larger matrix."""
    # zh: 一个线性层，它的权重（可能）是一个更大矩阵的一个分片。

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_dim: int | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_world(tp_rank, tp_size)
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def load_rank_slice(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy into `param`, one rank's share, this rank's slice of the whole checkpoint tensor along `tp_dim`."""
        # zh: 把整个检查点张量沿 `tp_dim` 属于本 rank 的那一片，复制进 `param`（一个 rank 的那一份）。
        shard = param.shape[self.tp_dim]
        copy_checked(param, loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""
    # zh: 每个 rank 都持有完整的权重。

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        copy_checked(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Each rank holds output_size / tp_size output rows; its output is that slice of y."""
    # zh: 每个 rank 持有 output_size / tp_size 个输出行；它的输出就是 y 的那一片。

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = tp_world(tp_rank, tp_size)
        super().__init__(input_size, divide(output_size, size, "output size"), bias, 0, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        self.load_rank_slice(param, loaded_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers in one matrix (gate_up_proj = [gate; up]), each part split by rank."""
    # zh: 几个列并行层放在一个矩阵里（gate_up_proj = [gate; up]），每一部分都按 rank 切分。

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        _, size = tp_world(tp_rank, tp_size)
        for part in self.output_sizes:
            divide(part, size, "merged part size")
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        # en: a checkpoint that already stores the merged matrix
        # zh: 检查点里存的已经是合并后的矩阵。
        if shard_id is None:
            for index, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.load_part(param, part, index)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}")
        self.load_part(param, loaded_weight, shard_id)

    def load_part(self, param: nn.Parameter, loaded_weight: torch.Tensor, index: int, name: str = "") -> None:
        """Part `index`, whole in `loaded_weight`: this rank's rows of it go to that part's rows of `param`."""
        # zh: 第 `index` 部分完整地放在 `loaded_weight` 里：其中属于本 rank 的行写到 `param` 中该部分的行。
        rows = self.output_sizes[index]
        if loaded_weight.shape[0] != rows:
            raise ValueError(f"{name or f'part {index}'} should have {rows} rows, "
                             f"got shape {tuple(loaded_weight.shape)}")
        # en: Every part is split by rank, so on each rank the parts before this one take their sizes / tp_size rows.
        # zh: 每一部分都按 rank 切分，所以在每个 rank 上，它前面的各部分占去它们大小的 1/tp_size 行。
        offset, size = sum(self.output_sizes[:index]) // self.tp_size, rows // self.tp_size
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matrix, split by heads; GQA-aware (fewer k/v heads than q heads)."""
    # zh: q、k、v 投影放在一个矩阵里，按头切分；考虑了 GQA（k/v 头比 q 头少）。

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = tp_world(tp_rank, tp_size)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, size, "number of attention heads")
        self.num_kv_heads = divide(total_num_kv_heads, size, "number of key/value heads")
        # en: Three parts, each split by rank at head boundaries: a rank keeps its q heads and the k/v heads they use.
        # zh: 三部分各自按 rank 在头的边界处切分：每个 rank 保留自己的 q 头，以及这些头用到的 k/v 头。
        kv_rows = total_num_kv_heads * head_size
        super().__init__(hidden_size, [total_num_heads * head_size, kv_rows, kv_rows], bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        # en: a checkpoint that already stores [q; k; v] for all heads
        # zh: 检查点里已经存着所有头的 [q; k; v]。
        if shard_id is None:
            super().weight_loader(param, loaded_weight)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        self.load_part(param, loaded_weight, "qkv".index(shard_id), f"{shard_id} projection")


class RowParallelLinear(LinearBase):
    """Each rank holds input_size / tp_size input columns and produces a partial sum: all-reduce."""
    # zh: 每个 rank 持有 input_size / tp_size 个输入列，算出一个部分和：all-reduce。

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        _, size = tp_world(tp_rank, tp_size)
        super().__init__(divide(input_size, size, "input size"), output_size, bias, 1, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        # en: the bias is not split: it is added once, by rank 0
        # zh: 偏置不切分：只由 rank 0 加一次。
        if param.dim() == 1:
            copy_checked(param, loaded_weight)
            return
        self.load_rank_slice(param, loaded_weight)

# %% embedding and lm head
#| export layers.embed_head
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ShardId, copy_checked, divide, tp_world


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split across ranks."""
    # zh: token 嵌入，它的行（词表）切分到各 rank 上。

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int | None = None, tp_size: int | None = None
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_world(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        shard = param.shape[0]
        if loaded_weight.shape[0] != shard * self.tp_size:
            raise ValueError(f"embedding should have {shard * self.tp_size} rows (the vocabulary), "
                             f"got shape {tuple(loaded_weight.shape)}")
        copy_checked(param, loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """Rows for the tokens this rank owns, zeros for the others."""
        # zh: 本 rank 拥有的 token 取对应的行，其余 token 取零。
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        owned = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = F.embedding(owned * (x - self.vocab_start_idx), self.weight)
        return owned.unsqueeze(-1) * y

    def sum_over_ranks(self, y: torch.Tensor) -> torch.Tensor:
        """Each token's row, whole: the sum of what every rank looked up (with one rank, what it looked up)."""
        # zh: 每个 token 完整的行：各 rank 查到的结果之和（只有一个 rank 时，就是它查到的）。
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum_over_ranks(self.forward_local(x))


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the vocabulary; slices gathered on rank 0 (others get None)."""
    # zh: 隐藏状态 -> 词表上的 logits；各片在 rank 0 上收集（其他 rank 得到 None）。

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        if bias:
            raise ValueError("ParallelLMHead has no bias (no supported model uses one)")
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)

    def sampled_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of the hidden states ``x`` that a token is sampled from: all of them, until the engine's
        batches say which (a prefill samples only from each sequence's last token)."""
        # zh: 隐藏状态 ``x`` 里要从中采样 token 的那些行：在引擎的批次说明是哪些之前，全部都是
        # zh: （prefill 只从每个序列的最后一个 token 采样）。
        return x

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits, for the rows that need them."""
        # zh: 本 rank 的那一片 logits，只算需要它们的行。
        return F.linear(self.sampled_rows(x), self.weight)

    def gather_slices(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The logits over the whole vocabulary from every rank's slice, on rank 0 (with one rank, its own)."""
        # zh: 由各 rank 的片拼成的整个词表上的 logits，放在 rank 0 上（只有一个 rank 时，就是它自己的）。
        return logits

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.gather_slices(self.forward_local(x))

# %% [markdown] tags=["en"]
# ## Build it: attention, first cut
#
# The attention layer receives q, k and v already split into heads and returns one output per
# query head. Its first cut sees **one sequence** and no cache: every token attends to itself and
# the tokens before it (`is_causal=True`), and `enable_gqa=True` lets each KV head serve
# `num_heads / num_kv_heads` query heads, so grouped-query attention needs no copies of k and v.
# That is enough to compare the model with `transformers` on a whole prompt. Chapter 07 gives
# the same layer its paged KV cache and the flat batches of many sequences that the engine runs.

# %% [markdown] tags=["zh"]
# ## 动手：注意力，第一版
#
# 注意力层接收已经按头拆开的 q、k、v，为每个查询头返回一份输出。它的第一版只看**一个序列**，也没有缓存：每个
# token 关注它自己和它之前的 token（`is_causal=True`），`enable_gqa=True` 让每个 KV 头服务 `num_heads / num_kv_heads`
# 个查询头，所以分组查询注意力不需要复制 k 和 v。这足以拿整个提示词把模型与 `transformers` 对照。第 07 章再给同一个
# 层加上分页 KV 缓存，以及引擎运行的、由多个序列展平而成的批次。

# %% attention
#| export layers.attention
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Scaled dot-product attention of a layer's heads (grouped-query: several query heads share a KV head)."""
    # zh: 一层各个头的缩放点积注意力（分组查询：几个查询头共用一个 KV 头）。

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] of one sequence -> [T, num_heads,
        head_dim]: each token attends to itself and the tokens before it."""
        # zh: 一个序列的 q [T, num_heads, head_dim]、k 和 v [T, num_kv_heads, head_dim] -> [T, num_heads,
        # zh: head_dim]：每个 token 关注它自己和它之前的 token。
        # en: [1, heads, T, d], the layout SDPA expects
        # zh: [1, heads, T, d]：SDPA 期望的布局。
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)

# %% [markdown] tags=["en"]
# ## Build it: the model
#
# One set of classes covers the three architectures; the switches come from the architecture
# (a class attribute) and the config. Everything else follows nano-vllm: `qkv_proj` and
# `gate_up_proj` are the fused layers built above (chapter 16 splits them across GPUs), and
# `packed_modules_mapping` tells the loader that a checkpoint's `q_proj` is the `"q"` part of
# our `qkv_proj`, and so on. The forward signature is the engine's:
# `model(input_ids [T], positions [T]) -> hidden [T, hidden_size]`, then
# `model.compute_logits(hidden)`. Two small seams let a model with other layers reuse the rest:
# `Qwen3Model.make_layer` builds layer `index`, and a `Qwen3DecoderLayer` takes the MLP it is
# handed (chapter 26's mixture of experts uses both).

# %% [markdown] tags=["zh"]
# ## 动手：模型
#
# 一套类覆盖三种架构；开关来自架构（类属性）和配置。其余部分沿用 nano-vllm：`qkv_proj` 和 `gate_up_proj`
# 是上面构建的融合层（第 16 章把它们切到多张 GPU 上），`packed_modules_mapping` 告诉加载器：检查点里的 `q_proj` 是我们
# `qkv_proj` 的 `"q"` 部分，依此类推。前向签名就是引擎使用的：
# `model(input_ids [T], positions [T]) -> hidden [T, hidden_size]`，然后 `model.compute_logits(hidden)`。
# 两个小小的接缝让层不同的模型复用其余部分：`Qwen3Model.make_layer` 构建第 `index` 层，`Qwen3DecoderLayer` 使用
# 交给它的 MLP（第 26 章的混合专家模型两者都用）。

# %% qwen3 layers
#| export
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, divide, tp_world
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_settings


class Qwen3Attention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k RMSNorm, RoPE, paged attention, output projection."""
    # zh: 融合的 q/k/v 投影、可选的逐头 q/k RMSNorm、RoPE、分页注意力、输出投影。

    # en: On a GPU: one kernel that norms and rotates q and k and writes k and v into the KV cache.
    # zh: 第 14 章，在 GPU 上：一个内核完成 q、k 的归一化与旋转，并把 k、v 写入 KV 缓存。
    fused_input = None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_emb: RotaryEmbedding,
        rms_norm_eps: float = 1e-6,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        _, tp_size = tp_world()
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden_states)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """From the q/k/v projection ``qkv`` to the heads' output [T, heads * head_dim], before ``o_proj``."""
        # zh: 从 q/k/v 投影 ``qkv`` 到各头的输出 [T, heads * head_dim]，在 ``o_proj`` 之前。
        if self.fused_input is not None:
            q, k, v = self.fused_input(self, positions, qkv)
            return self.attn(q, k, v, kv_stored=True).flatten(1, -1)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.norm_and_rotate(positions, q, k)
        return self.attn(q, k, v).flatten(1, -1)

    def norm_and_rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (Qwen3 only), then RoPE."""
        # zh: 对 q 和 k 逐头做 RMSNorm（只有 Qwen3），然后做 RoPE。
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary_emb(positions, q, k)


class Qwen3MLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)), with gate and up fused into one matmul."""
    # zh: down(SiLU(gate(x)) * up(x))，gate 和 up 融合成一次矩阵乘法。

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        assert hidden_act == "silu", "the loader's check_supported refuses the others"
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    # en: On a GPU: the whole layer in a few fused kernels when a step has only a few tokens.
    # zh: 第 14 章，在 GPU 上：一步只有几个 token 时，整层由几个融合内核完成。
    fused_forward = None

    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, switches: dict[str, bool], mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim_of(config),
            rotary_emb=rotary_emb,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=switches["qkv_bias"],
            o_bias=switches["o_bias"],
            qk_norm=switches["qk_norm"],
        )
        # en: The dense MLP, unless the model hands the layer another one (a mixture of experts does).
        # zh: 稠密的 MLP，除非模型给这一层另一个（混合专家模型就会）。
        if mlp is None:
            mlp = Qwen3MLP(config.hidden_size, config.intermediate_size, config.hidden_act, switches["mlp_bias"])
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_forward is not None and self.fused_forward.applies(hidden_states):
            return self.fused_forward(self, positions, hidden_states, residual)
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Model(nn.Module):
    def __init__(self, config: Any, switches: dict[str, bool]) -> None:
        super().__init__()
        base, scaling = rope_settings(config)
        head_dim = head_dim_of(config)
        # en: One rotary table for all layers: its cos/sin cache can be tens of MB for long-context models.
        # zh: 所有层共用一张旋转表：对长上下文模型，它的 cos/sin 缓存可达数十 MB。
        rotary_emb = get_rope(head_dim, head_dim, config.max_position_embeddings, base, scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [self.make_layer(config, rotary_emb, switches, index) for index in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_layer(self, config: Any, rotary_emb: RotaryEmbedding, switches: dict[str, bool], index: int) -> nn.Module:
        """Decoder layer ``index``: the same for every layer here; a model whose layers differ overrides it."""
        # zh: 第 ``index`` 个解码器层：这里每层都一样；各层不同的模型会重写它。
        return Qwen3DecoderLayer(config, rotary_emb, switches)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

# %% [markdown] tags=["en"]
# The three top-level classes differ only in `switches`. Tied embeddings make `lm_head.weight`
# the *same* parameter as `embed_tokens.weight`, so loading one loads both.

# %% [markdown] tags=["zh"]
# 三个顶层类只在 `switches` 上不同。绑定嵌入让 `lm_head.weight` 与 `embed_tokens.weight` 成为*同一个*参数，
# 加载其中一个就等于加载了两个。

# %% causal lm
#| export
class Qwen3ForCausalLM(nn.Module):
    """Qwen3: per-head q/k RMSNorm; biases on q/k/v/o when config.attention_bias."""
    # zh: Qwen3：逐头的 q/k RMSNorm；config.attention_bias 为真时 q/k/v/o 带偏置。

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # en: The model under the LM head; a variant with other layers names its own.
    # zh: LM head 下面的模型；层不同的变体指定它自己的。
    model_class: ClassVar[type[nn.Module]] = Qwen3Model

    @classmethod
    def switches(cls, config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qk_norm": True, "qkv_bias": bias, "o_bias": bias, "mlp_bias": False}

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.model = self.model_class(config, self.switches(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    """Qwen2 / Qwen2.5: biases on q, k, v (not o), no q/k norm."""
    # zh: Qwen2 / Qwen2.5：q、k、v 带偏置（o 不带），没有 q/k 归一化。

    @classmethod
    def switches(cls, config: Any) -> dict[str, bool]:
        return {"qk_norm": False, "qkv_bias": True, "o_bias": False, "mlp_bias": False}

# %% llama
#| export models.llama
from __future__ import annotations

from typing import Any

from nanovllm.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    """Llama (and SmolLM2): no q/k norm; attention_bias on q/k/v/o, mlp_bias on the MLP."""
    # zh: Llama（以及 SmolLM2）：没有 q/k 归一化；attention_bias 作用于 q/k/v/o，mlp_bias 作用于 MLP。

    @classmethod
    def switches(cls, config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        return {"qk_norm": False, "qkv_bias": bias, "o_bias": bias, "mlp_bias": mlp_bias}

# %% registry
#| export models.registry
from __future__ import annotations

import importlib
from collections.abc import Sequence

from torch import nn

# en: The names Hugging Face writes in config.json's "architectures", each with the module that defines the class of
# en: that name. The module is imported when a model is built, not before: reading a model directory's config, as
# en: the engine's settings do, imports no model.
# zh: Hugging Face 写在 config.json 的 "architectures" 中的名字，以及定义同名类的模块。模块在构建模型时才导入：
# zh: 读取模型目录的配置（引擎的设置会这样做）不导入任何模型。
MODEL_REGISTRY: dict[str, str] = {
    "Qwen3ForCausalLM": "nanovllm.models.qwen3",
    "Qwen2ForCausalLM": "nanovllm.models.qwen3",
    "LlamaForCausalLM": "nanovllm.models.llama",
}


def supported_architecture(architectures: Sequence[str] | str) -> str:
    """The first of a checkpoint's architectures that we implement, or a ValueError naming what is supported."""
    # zh: 检查点的 architectures 中我们实现了的第一个；都没有时抛出 ValueError，写明支持哪些。
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        if name in MODEL_REGISTRY:
            return name
    raise ValueError(f"unsupported model architecture {names}; supported: {', '.join(MODEL_REGISTRY)}")


def get_model_class(architectures: Sequence[str] | str) -> type[nn.Module]:
    """The class for a checkpoint's architectures list, or a ValueError naming what is supported."""
    # zh: 检查点 architectures 列表对应的类；没有时抛出 ValueError，写明支持哪些。
    name = supported_architecture(architectures)
    return getattr(importlib.import_module(MODEL_REGISTRY[name]), name)

# %% [markdown] tags=["en"]
# ## Build it: the loader
#
# A Hugging Face model directory holds `config.json` and one or more `*.safetensors` files of
# named tensors (`model.layers.0.self_attn.q_proj.weight`, ...). The loader reads every tensor
# and hands it to the `weight_loader` of the parameter it belongs to; names that the model
# fused are rewritten first (`q_proj` → `qkv_proj`, shard `"q"`). Because a silently missing
# tensor leaves random memory in the model, the loader keeps a ledger: at the end every
# parameter — every *shard* of a fused one — must have been loaded exactly once, and a tensor
# with no home is an error too. Each error names the tensor and the file.
#
# Two tolerated exceptions: with tied embeddings an `lm_head.weight` in the file is skipped (the
# embedding is the head, as in `transformers`), and old checkpoints' `rotary_emb.inv_freq`
# buffers are ignored (we compute them).

# %% [markdown] tags=["zh"]
# ## 动手：加载器
#
# Hugging Face 模型目录包含 `config.json` 和一个或多个 `*.safetensors` 文件，里面是带名字的张量
# （`model.layers.0.self_attn.q_proj.weight` 等）。加载器读取每个张量，把它交给所属参数的 `weight_loader`；
# 被模型融合的名字先改写（`q_proj` → `qkv_proj`，分片 `"q"`）。由于悄悄缺失的张量会让模型里留着随机内存，
# 加载器会记账：最后，每个参数——融合参数的每个*分片*——都必须恰好加载一次，找不到归属的张量同样是错误。
# 每条错误信息都会指明张量和文件。
#
# 两个可以容忍的例外：绑定嵌入时，文件里的 `lm_head.weight` 被跳过（嵌入层就是 head，与 `transformers`
# 一致）；旧检查点中的 `rotary_emb.inv_freq` 缓冲区被忽略（我们自己计算）。

# %% loader
#| export models.loader
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, PretrainedConfig

from nanovllm.models.registry import get_model_class, supported_architecture
from nanovllm.utils.checks import check

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# en: The numbers of config.json that size the model; a model may add head_dim.
# zh: config.json 中决定模型尺寸的数；模型还可以另给 head_dim。
MODEL_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings")


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file or tensor at fault."""
    # zh: 模型目录无法加载；消息写明出问题的文件或张量。


def read_model_dir(model: str | os.PathLike, require_weights: bool = True) -> PretrainedConfig:
    """The one reader of a model directory's config.json: its transformers config, checked so that each way a
    directory can be broken gets its own message (require_weights: it must hold *.safetensors files)."""
    # zh: 模型目录的 config.json 唯一的读取者：返回它的 transformers config，并做检查，让目录坏掉的每一种方式
    # zh: 都有自己的消息（require_weights：目录里必须有 *.safetensors 文件）。
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path to a model directory, got {type(model).__name__} {model!r}")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} {'is not a directory' if path.exists() else 'does not exist'}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {path} has no config.json: not a Hugging Face model directory")
    try:
        # en: for clear messages; transformers parses it again
        # zh: 先自己读一遍，以便给出清楚的错误信息；transformers 还会再解析一次。
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from None
    # en: The sizes it gives, before transformers reads them: some config classes divide by the head count as they
    # en: load, and `num_attention_heads: 0` would surface as a ZeroDivisionError.
    # zh: 在 transformers 读取之前先检查其中给出的尺寸：有些配置类在加载时就会用头数做除法，
    # zh: `num_attention_heads: 0` 会变成一个 ZeroDivisionError。
    for name in (*MODEL_SIZES, "head_dim"):
        if isinstance(fields, dict) and fields.get(name) is not None:
            check(f"{config_file}: {name}", fields[name], int, lambda size: size >= 1, ">= 1")
    try:
        hf_config = AutoConfig.from_pretrained(path)
    # en: transformers raises ValueError, KeyError, OSError... for a bad config
    # zh: 配置有问题时，transformers 会抛出 ValueError、KeyError、OSError 等异常。
    except Exception as error:
        raise ModelLoadError(f"{config_file} cannot be read by transformers: {error}") from error
    check_model_config(hf_config, config_file)
    if require_weights and not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model directory {path} has no *.safetensors files")
    return hf_config


def check_model_config(hf_config: PretrainedConfig, config_file: Path) -> None:
    """Refuse, naming the field and the file, a config that no model of ours can be built from."""
    # zh: 拒绝一个我们的任何模型都无法据以构建的 config，写明字段和文件。
    missing = [name for name in MODEL_SIZES if getattr(hf_config, name, None) is None]
    if missing:
        raise ModelLoadError(f"{config_file} lacks {', '.join(missing)}: not a decoder-only language model config")
    if not isinstance(getattr(hf_config, "architectures", None), list):
        raise ModelLoadError(f"{config_file} has no 'architectures' list naming the model class")
    # en: a ValueError naming the supported architectures
    # zh: 架构不受支持时抛出 ValueError，并列出支持的架构。
    supported_architecture(hf_config.architectures)
    head_dim = getattr(hf_config, "head_dim", None)
    for name in MODEL_SIZES + (("head_dim",) if head_dim is not None else ()):
        check(f"{config_file}: {name}", getattr(hf_config, name), int, lambda size: size >= 1, ">= 1")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % kv_heads or (head_dim is None and hf_config.hidden_size % heads):
        raise ModelLoadError(f"{config_file}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                             f"({kv_heads}) and, without a head_dim, divide hidden_size ({hf_config.hidden_size})")
    check(f"{config_file}: rms_norm_eps", getattr(hf_config, "rms_norm_eps", None), float, lambda e: e > 0, "> 0")
    try:
        check_supported(hf_config)
    except ValueError as error:
        raise ModelLoadError(f"{config_file}: {error}") from None


def check_supported(config: Any) -> None:
    """Refuse, by name, the config features this engine does not implement."""
    # zh: 按名字拒绝这个引擎没有实现的 config 特性。
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    partial = getattr(config, "partial_rotary_factor", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", 1.0
    )
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")


def _target(model: nn.Module, name: str) -> tuple[str, str | int | None]:
    """(parameter name, shard id) of a checkpoint tensor name, following packed_modules_mapping."""
    # zh: 按 packed_modules_mapping，由检查点张量名得出 (参数名, 分片 id)。
    parts = name.split(".")
    mapping = getattr(model, "packed_modules_mapping", {})
    for i, part in enumerate(parts):
        if part in mapping:
            fused, shard_id = mapping[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None


def _expected_loads(model: nn.Module) -> dict[tuple[str, str | int | None], str]:
    """Every (parameter, shard) that must be loaded, with the checkpoint name it comes from."""
    # zh: 每一个必须加载的 (参数, 分片)，以及它来自的检查点名字。
    mapping = getattr(model, "packed_modules_mapping", {})
    expected = {}
    # en: tied parameters are listed once
    # zh: 绑定的参数只列出一次。
    for param_name, _ in model.named_parameters():
        parts = param_name.split(".")
        fused_at = [(i, source, shard) for i, p in enumerate(parts) for source, (fused, shard) in mapping.items()
                    if p == fused]
        if not fused_at:
            expected[(param_name, None)] = param_name
        for i, source, shard in fused_at:
            expected[(param_name, shard)] = ".".join([*parts[:i], source, *parts[i + 1 :]])
    return expected


def load_model(model: nn.Module, path: str | Path) -> None:
    """Load every ``*.safetensors`` file of ``path`` into ``model``, checking that nothing is missing or extra."""
    # zh: 把 ``path`` 下的每个 ``*.safetensors`` 文件加载进 ``model``，检查既没有缺少也没有多余。
    files = sorted(Path(path).glob("*.safetensors"))
    expected = _expected_loads(model)
    loaded: dict[tuple[str, str | int | None], str] = {}
    tied = getattr(model, "tie_word_embeddings", False)
    for file in files:
        try:
            handle = safe_open(str(file), "pt", "cpu")
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {error}") from None
        with handle:
            for name in handle.keys():
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                param_name, shard_id = _target(model, name)
                key = (param_name, shard_id)
                if key not in expected:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {file.name}: the model has no such parameter")
                if key in loaded:
                    raise ModelLoadError(f"tensor {name!r} appears twice ({loaded[key]} and {file.name})")
                param = model.get_parameter(param_name)
                tensor = handle.get_tensor(name).to(param.dtype)
                weight_loader = getattr(param, "weight_loader", None)
                try:
                    if weight_loader is None:
                        if param.shape != tensor.shape:
                            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
                        param.data.copy_(tensor)
                    else:
                        weight_loader(param, tensor, shard_id)
                except ValueError as error:
                    raise ModelLoadError(f"tensor {name!r} in {file.name}: {error}") from None
                loaded[key] = file.name
    missing = [source for key, source in expected.items() if key not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint in {path} is missing {len(missing)} tensor(s): {shown}")


LOAD_FORMATS = ("auto", "dummy")


class DefaultFloatDtype(TorchFunctionMode):
    """Within the block, on this thread only, a floating-point tensor created without a dtype (``torch.empty``,
    ``zeros``, ``ones``, ``rand``, ``randn``: what layers build their parameters with) gets ``dtype``.

    Upstream calls ``torch.set_default_dtype``, which is process-wide: two engines built at once on two
    threads would each build with whichever dtype was set last, and the process would keep it. A torch
    function mode, like ``with torch.device(...)``, belongs to the thread that enters it.
    """
    # zh: 在这个块里，只在本线程上，不指定 dtype 创建的浮点张量（``torch.empty``、``zeros``、``ones``、``rand``、
    # zh: ``randn``：各层用它们构建参数）得到 ``dtype``。
    # zh:
    # zh: 上游调用 ``torch.set_default_dtype``，它作用于整个进程：在两个线程上同时构建的两个引擎，
    # zh: 都会用最后设置的那个 dtype 来构建，进程也会一直保留它。torch 的函数模式就像
    # zh: ``with torch.device(...)`` 一样，属于进入它的那个线程。

    FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn})

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in self.FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def build_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", load_format: str = "auto",
    hf_config: PretrainedConfig | None = None,
) -> nn.Module:
    """Build the model class of a model directory in ``dtype`` on ``device`` and load its weights.

    hf_config: the directory's config when the caller has read it already (the engine's `Config` has).
    load_format="dummy": no weights are read; seeded random values are drawn where the model lives (benchmarks).
    """
    # zh: 按模型目录构建模型类，放在 ``device`` 上，使用 ``dtype``，并加载它的权重。
    # zh:
    # zh: hf_config：调用者已经读过的目录 config（引擎的 `Config` 就读过）。
    # zh: load_format="dummy"：不读任何权重；在模型所在的设备上抽取带种子的随机值（基准测试用）。
    assert load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}"
    config = hf_config if hf_config is not None else read_model_dir(path, require_weights=load_format != "dummy")
    model_class = get_model_class(config.architectures)
    with DefaultFloatDtype(dtype), torch.device(device):
        model = model_class(config)
    if load_format == "dummy":
        init_random_weights(model)
    else:
        load_model(model, path)
    return model.eval()


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter with seeded random values, in place, on its device and in its dtype: norms near 1,
    matrices scaled by 1/sqrt(fan-in) so activations stay near unit scale (speed does not depend on values)."""
    # zh: 就地用带种子的随机值填充每个参数，保持它的设备和 dtype：归一化层的权重接近 1，
    # zh: 矩阵按 1/sqrt(fan-in) 缩放，让激活值保持在单位尺度附近（速度与数值无关）。
    for index, (name, param) in enumerate(model.named_parameters()):
        generator = torch.Generator(device=param.device).manual_seed(seed + index)
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.1, generator=generator)
        elif param.dim() == 1:
            param.normal_(0.0, 0.1, generator=generator)
        else:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)

# %% [markdown] tags=["en"]
# ## Build it: tiny models to test with
#
# No model hub is reachable from where this book is built, and real checkpoints are too big for
# a laptop's test run. So we *make* small ones: a real Hugging Face directory with
# `config.json`, `generation_config.json` (its EOS ids), `model.safetensors` with random weights
# from a fixed seed, and a byte-level BPE tokenizer trained with `tokenizers` on a short English
# text that ships with the code (`tokenizer.json`, `tokenizer_config.json` with a chat
# template). `transformers` loads them like any other model, which makes it our reference.
#
# The weights are drawn with a scale that keeps activations near 1 and logits spread out
# (standard deviation a few units), so that greedy decoding has clear winners: near-ties would
# make "same tokens as `transformers`" depend on rounding. Directories are cached under
# `~/.cache/nanovllm/` by a hash of everything that goes into them, so the second call is free.

# %% [markdown] tags=["zh"]
# ## 动手：用于测试的小模型
#
# 构建本书的环境访问不到模型仓库，真实检查点对笔记本上的测试来说也太大。所以我们*自己造*小模型：一个真正的
# Hugging Face 目录，包含 `config.json`、`generation_config.json`（其中的 EOS id）、以固定种子生成随机权重的
# `model.safetensors`，以及用 `tokenizers` 在随代码附带的一小段英文上训练的字节级 BPE 分词器（`tokenizer.json`、
# 带聊天模板的 `tokenizer_config.json`）。`transformers` 像加载其他模型一样加载它们，于是它成了我们的参考。
#
# 权重的尺度让激活值保持在 1 附近、logits 足够分散（标准差有几个单位），使贪心解码有明确的胜者：如果分数
# 几乎相等，“与 `transformers` 生成相同 token”就会取决于舍入误差。目录按其全部内容的哈希缓存在
# `~/.cache/nanovllm/` 下，第二次调用几乎不花时间。

# %% tiny models
#| export book.tiny_models
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_TEXT = """\
The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital of Italy is Rome.
A language model reads a prompt and writes one token at a time. Each new token depends on every token before it.
To serve many users at once, an inference engine keeps the keys and values of past tokens in a cache.
The cache is cut into blocks of equal size, and each sequence keeps a table of the blocks it uses.
When two prompts start with the same words, the engine can share the blocks that hold them.
The scheduler decides which sequences run in each step. It prefers new prompts, then decodes the others.
If memory runs out, the newest sequence gives back its blocks and waits to be computed again.
Once upon a time there was a small robot who liked to count. It counted one, two, three, four, five.
Every morning the robot walked to the river and counted the stones, the birds and the clouds.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Tell me a story about the sea. The sea is wide and deep, and the waves sing a slow song at night.
Numbers are useful: 1 2 3 4 5 6 7 8 9 10. Two plus two is four. Ten minus three is seven.
Question: What is the color of the sky? Answer: The sky is blue on a clear day.
Question: Where do fish live? Answer: Fish live in water, in rivers, lakes and the sea.
Write clear code, test it well, and explain why it works. Small steps make big programs possible.
"""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VOCAB_SIZE = 512
_COMMON = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
TINY_MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False},
    "qwen2": {**_COMMON, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False},
    "llama": {**_COMMON, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True},
}
# en: bump when the files written here change
# zh: 这里写出的文件有变化时，把版本号加一。
_FORMAT_VERSION = 1


class CacheNotWritableError(OSError):
    """The model cache cannot be written; the message names the directory and NANOVLLM_CACHE."""
    # zh: 模型缓存无法写入；消息写明目录和 NANOVLLM_CACHE。


def cache_root() -> Path:
    """Where built and converted models are cached: $NANOVLLM_CACHE, else $XDG_CACHE_HOME/nanovllm, else
    ~/.cache/nanovllm."""
    # zh: 构建和转换出的模型缓存在哪里：$NANOVLLM_CACHE，否则 $XDG_CACHE_HOME/nanovllm，否则
    # zh: ~/.cache/nanovllm。
    if os.environ.get("NANOVLLM_CACHE"):
        return Path(os.environ["NANOVLLM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "nanovllm"


def writable_dir(directory: Path) -> Path:
    """``directory``, created if needed, or a CacheNotWritableError that says how to move the cache."""
    # zh: 返回 ``directory``（需要时创建它），否则抛出 CacheNotWritableError，说明怎样把缓存移到别处。
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission on {directory}")
    except OSError as error:
        raise CacheNotWritableError(
            f"cannot write the model cache at {directory} ({error}); set NANOVLLM_CACHE to a writable directory"
        ) from None
    return directory


def _config_class(kind: str) -> Any:
    """transformers' config class of a model type ("qwen3", "llama"...: the kinds are model types)."""
    # zh: 某种模型类型（"qwen3"、"llama"……：这些种类就是模型类型）在 transformers 中的 config 类。
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[kind]


def _train_tokenizer(directory: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_TEXT.splitlines(), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": _COMMON["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return ids


def checkpoint_layout(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` renamed and split as ``model.save_pretrained`` writes it (transformers 5's weight conversions
    reverted; unchanged where there are none)."""
    # zh: 把 ``state`` 按 ``model.save_pretrained`` 写出的样子改名、拆分（撤销 transformers 5 的权重转换；
    # zh: 没有转换的地方保持不变）。
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)


def _random_weights(config: Any, seed: int) -> dict[str, torch.Tensor]:
    """Weights for every tensor transformers expects, drawn from a seeded generator (float32)."""
    # zh: transformers 期望的每个张量的权重，由带种子的生成器抽取（float32）。
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        state = {name: torch.empty(t.shape) for name, t in model.state_dict().items()}
    # en: The tensors as a checkpoint names them: transformers may hold some fused in memory (a mixture of experts'
    # en: experts, one tensor each) and writes them apart, one per expert, as real checkpoints do.
    # zh: 按检查点里的名字排列的张量：transformers 在内存里可能把一些张量合在一起（混合专家模型的各个专家合成
    # zh: 一个张量），写入时再按专家分开，和真实的检查点一样。
    shapes = {name: tuple(t.shape) for name, t in checkpoint_layout(model, state).items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            # en: not all ones: a misplaced norm weight shows
            # zh: 不全是 1：放错位置的归一化权重会显露出来。
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            weights[name] = 0.1 * noise
        elif "embed_tokens" in name or name == "lm_head.weight":
            # en: logits with a standard deviation of about 4
            # zh: 使 logits 的标准差约为 4。
            weights[name] = noise * (4.0 / shape[1] ** 0.5)
        else:
            # en: keeps activations near unit scale
            # zh: 使激活值保持在单位量级附近。
            weights[name] = noise / shape[1] ** 0.5
    return weights


def _write(directory: Path, kind: str, seed: int, overrides: dict[str, Any], key: str) -> None:
    from transformers import GenerationConfig

    ids = _train_tokenizer(directory)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    settings = {**TINY_MODELS[kind], "eos_token_id": eos[0], "pad_token_id": eos[1], "bos_token_id": None}
    settings.update(overrides)
    config = _config_class(kind)(**settings)
    config.dtype = "float32"
    config.save_pretrained(directory)
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1], bos_token_id=None).save_pretrained(directory)
    save_file(_random_weights(config, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / ".nanovllm-tiny").write_text(key, encoding="utf-8")


def build_tiny_model(kind: str = "qwen3", path: str | Path | None = None, seed: int = 0, **overrides: Any) -> Path:
    """A deterministic tiny HF model directory ("qwen3", "qwen2" or "llama"); config overrides as keywords.

    With ``path``, write there (skipped if it already holds this exact model); otherwise use a
    content-addressed directory under ``cache_root()``. Returns the directory.
    """
    # zh: 一个确定性的小型 HF 模型目录（"qwen3"、"qwen2" 或 "llama"）；config 的覆盖项以关键字参数给出。
    # zh:
    # zh: 给了 ``path`` 就写到那里（如果那里已经是这个模型，就跳过）；否则使用 ``cache_root()`` 下
    # zh: 一个按内容寻址的目录。返回这个目录。
    if kind not in TINY_MODELS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {sorted(TINY_MODELS)}")
    import transformers

    recipe = json.dumps(
        [_FORMAT_VERSION, kind, seed, overrides, TINY_MODELS[kind], TINY_TEXT, transformers.__version__],
        sort_keys=True, default=str,
    )  # fmt: skip
    key = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    directory = Path(path) if path is not None else cache_root() / f"tiny-{kind}-{key}"
    marker = directory / ".nanovllm-tiny"
    if marker.is_file() and marker.read_text(encoding="utf-8") == key:
        return directory
    if path is not None:
        directory.mkdir(parents=True, exist_ok=True)
        _write(directory, kind, seed, overrides, key)
        return directory
    # en: Build next to the target and rename: a concurrent or interrupted build never leaves half a model.
    # zh: 在目标旁边构建再改名：并发或中断的构建绝不会留下半个模型。
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=writable_dir(directory.parent)))
    try:
        _write(staging, kind, seed, overrides, key)
        try:
            staging.rename(directory)
        # en: another process finished first
        # zh: 另一个进程先完成了构建。
        except OSError:
            if not marker.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory

# %% [markdown] tags=["en"]
# ## See it: a tiny Qwen3, ours and `transformers`'
#
# We build the tiny Qwen3 directory, load it twice — into `transformers` and into our model —
# and look at what our model holds: the fused parameters, and one rotary table shared by all
# layers.

# %% [markdown] tags=["zh"]
# ## 看它运行：一个小 Qwen3，我们的和 `transformers` 的
#
# 构建小 Qwen3 目录，加载两次——一次进 `transformers`，一次进我们的模型——再看看我们的模型里有什么：
# 融合后的参数，以及所有层共用的一张旋转表。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases, display_width

say = Phrases({
    "{n} tokens, logits std {std:.2f}, max |ours - transformers| = {error:.1e}":
        "{n} 个 token，logits 标准差 {std:.2f}，最大 |我们的 - transformers| = {error:.1e}",
    "ours:": "我们的：",
    "transformers:": "transformers：",
    "max |logit error| per step: {errors}": "每步最大 |logit 误差|：{errors}",
    "{kind}: max |error| {error:.1e}": "{kind}：最大 |误差| {error:.1e}",
    "ours == transformers for Qwen3, Llama (tied) and Qwen2":
        "在 Qwen3、Llama（绑定嵌入）和 Qwen2 上，我们的结果 == transformers",
    "dummy weights: logits {shape} of scale {scale:.2f}, all finite":
        "假权重：logits {shape}，尺度 {scale:.2f}，全部有限",
    "tiny Qwen3: {total:,} parameters; tied: {tied:,}": "小 Qwen3：{total:,} 个参数；绑定嵌入时：{tied:,}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm.layers.context import reset_context, set_decode_context, set_prefill_context
from nanovllm.models.loader import build_model
from nanovllm.book.tiny_models import build_tiny_model

qwen_dir = build_tiny_model("qwen3")
print(sorted(p.name for p in qwen_dir.iterdir()))
config = json.loads((qwen_dir / "config.json").read_text())
print({k: config[k] for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "vocab_size")})

tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
hf_model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
model = build_model(qwen_dir, dtype=torch.float32)
for name, param in list(model.named_parameters())[:8]:
    print(f"{name:45s} {tuple(param.shape)}")
layers = model.model.layers
assert all(layer.self_attn.rotary_emb is layers[0].self_attn.rotary_emb for layer in layers)

# %% [markdown] tags=["en"]
# **One prefill, no cache.** The whole prompt as one sequence, `positions = 0 … n-1`, no KV
# cache (the warm-up path of chapter 07). The LM head would keep only the last row during a
# prefill, so to compare *every* position we reset the context before `compute_logits`.

# %% [markdown] tags=["zh"]
# **一次 prefill，不用缓存：** 整个提示词作为一个序列，`positions = 0 … n-1`，不用 KV 缓存（第 07 章的预热路径）。
# prefill 时 LM head 只保留最后一行，为了比较*每个*位置，我们在 `compute_logits` 之前重置上下文。

# %%
prompt = "The capital of France is Paris, and the capital of Italy is"
ids = torch.tensor(tokenizer(prompt).input_ids)
with torch.inference_mode():
    reference = hf_model(ids[None]).logits[0]
    set_prefill_context([len(ids)], [len(ids)])
    hidden = model(ids, torch.arange(len(ids)))
    reset_context()
    logits = model.compute_logits(hidden)
prefill_error = (logits - reference).abs().max().item()
print(say("{n} tokens, logits std {std:.2f}, max |ours - transformers| = {error:.1e}",
          n=len(ids), std=reference.std(), error=prefill_error))

# %% [markdown] tags=["en"]
# **Through the paged cache.** A look ahead at the engine's way, with the paged attention that
# chapter 07 gives the first cut above: we give every attention layer a KV cache
# (what the model runner of chapter 09 does), prefill the prompt in **two chunks** — the second
# chunk reads the first one's KV through the block table — then decode greedily, one token per
# step. Each step's logits must match `transformers` run on the whole text so far.

# %% [markdown] tags=["zh"]
# **经过分页缓存：** 提前看看引擎的方式，用的是第 07 章给上面第一版加上的分页注意力：给每个注意力层一个 KV 缓存
# （第 09 章的模型执行器做的事），把提示词分成**两个分块**做 prefill——第二个分块通过块表读取第一个分块的 KV——
# 然后贪心解码，每步一个 token。每一步的 logits 都必须与 `transformers` 对到目前为止的完整文本的计算结果一致。

# %%
from nanovllm.layers.attention import Attention


def attach_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
    """Give each attention layer its own paged K and V cache (the model runner's job, chapter 09)."""
    # zh: 给每个注意力层分配它自己的分页 K 和 V 缓存（这是模型执行器的工作，见第 09 章）。
    for module in model.modules():
        if isinstance(module, Attention):
            shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
            module.k_cache, module.v_cache = torch.zeros(shape), torch.zeros(shape)


BLOCK_SIZE = 4
attach_kv_cache(model, num_blocks=16, block_size=BLOCK_SIZE)
# en: any free blocks, in any order
# zh: 任意空闲块，任意顺序。
block_table = [9, 2, 7, 4, 11, 0, 5, 13]
tokens = ids.tolist()
step_errors = []
with torch.inference_mode():
    split = 5
    # en: chunk 1: tokens 0..4
    # zh: 分块 1：token 0..4。
    set_prefill_context([split], [split], [block_table], BLOCK_SIZE)
    model.compute_logits(model(ids[:split], torch.arange(split)))
    # en: chunk 2 reads chunk 1
    # zh: 分块 2 读取分块 1 的 KV。
    set_prefill_context([len(ids) - split], [len(ids)], [block_table], BLOCK_SIZE)
    logits = model.compute_logits(model(ids[split:], torch.arange(split, len(ids))))
    for _ in range(6):
        expected = hf_model(torch.tensor([tokens])).logits[0, -1]
        step_errors.append((logits[-1] - expected).abs().max().item())
        tokens.append(int(logits[-1].argmax()))
        set_decode_context([len(tokens)], [block_table], BLOCK_SIZE)
        logits = model.compute_logits(model(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1])))
    reset_context()
    hf_tokens = hf_model.generate(ids[None], max_new_tokens=6, do_sample=False)[0].tolist()
width = max(display_width(say(label)) for label in ("ours:", "transformers:"))
print(format(say("ours:"), f"<{width}"), tokenizer.decode(tokens[len(ids):]))
print(format(say("transformers:"), f"<{width}"), tokenizer.decode(hf_tokens[len(ids):]))
print(say("max |logit error| per step: {errors}", errors=[f"{e:.1e}" for e in step_errors]))

# %% [markdown] tags=["en"]
# ## Check it
#
# Our model matches `transformers` within `1e-4` (float32) on every logit, with and without the
# paged cache, and greedy decoding yields the same tokens. The same holds for the tiny Llama
# with tied embeddings and for Qwen2 with its q/k/v biases.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 无论是否使用分页缓存，我们的模型的每个 logit 都与 `transformers` 相差不到 `1e-4`（float32），贪心解码得到
# 相同的 token。绑定嵌入的小 Llama 和带 q/k/v 偏置的 Qwen2 同样如此。

# %%
assert prefill_error < 1e-4 and max(step_errors) < 1e-4
assert tokens == hf_tokens
for kind in ("llama", "qwen2"):
    directory = build_tiny_model(kind)
    ours, theirs = build_model(directory), AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.inference_mode():
        set_prefill_context([len(ids)], [len(ids)])
        hidden = ours(ids, torch.arange(len(ids)))
        reset_context()
        error = (ours.compute_logits(hidden) - theirs(ids[None]).logits[0]).abs().max().item()
    print(say("{kind}: max |error| {error:.1e}", kind=kind, error=error))
    assert error < 1e-4
llama = build_model(build_tiny_model("llama"))
# en: tied: one matrix
# zh: 绑定：同一个矩阵。
assert llama.lm_head.weight is llama.model.embed_tokens.weight
print(say("ours == transformers for Qwen3, Llama (tied) and Qwen2"))

# %% [markdown] tags=["en"]
# The loader refuses a broken checkpoint with a message that names the problem. We copy the
# tiny model and damage it in three ways, then name an architecture we do not support, then
# write sizes no model can have. `read_model_dir` is the only function that reads
# `config.json`: the engine's `Config` (chapter 09) calls it once, and its result travels from
# there, to the model runner and to every tensor-parallel rank, so that a nonsense number is
# refused here, by name, and not as a "negative dimension" deep inside `torch`.

# %% [markdown] tags=["zh"]
# 加载器会拒绝损坏的检查点，并在错误信息中指明问题所在。我们复制一份小模型，用三种方式把它弄坏，再写上一个不支持的架构，
# 最后写入任何模型都不可能有的尺寸。`read_model_dir` 是唯一读取 `config.json` 的函数：引擎的 `Config`（第 09 章）
# 调用它一次，它的结果从那里传下去，交给模型执行器和每个张量并行 rank。这样，荒谬的数值在这里就会被点名拒绝，
# 而不是在 `torch` 深处变成一句 “negative dimension”。

# %%
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from nanovllm.models.loader import ModelLoadError

scratch = Path(tempfile.mkdtemp())
broken = shutil.copytree(qwen_dir, scratch / "broken")
weights = load_file(broken / "model.safetensors")


def damage(change: dict) -> None:
    save_file(change, str(broken / "model.safetensors"))
    try:
        build_model(broken)
        raise AssertionError("a broken checkpoint was accepted")
    except ModelLoadError as error:
        print("ModelLoadError:", error)


damage({k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"})
damage({**weights, "model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})
damage({**weights, "model.norm.weight": torch.ones(63)})
config["architectures"] = ["MambaForCausalLM"]
(broken / "config.json").write_text(json.dumps(config))
try:
    build_model(broken)
    raise AssertionError("an unsupported architecture was accepted")
except ValueError as error:
    print("ValueError:", error)
    # en: not one of the weight errors above
    # zh: 不是上面那些权重错误之一。
    assert "MambaForCausalLM" in str(error), error
for field, value in (("hidden_size", -64), ("num_attention_heads", 0)):
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"], field: value}))
    try:
        build_model(broken)
        raise AssertionError(f"{field}={value} was accepted")
    except ValueError as error:
        print("ValueError:", error)
        assert f"config.json: {field} must be >= 1" in str(error), error
shutil.rmtree(scratch)

# %% [markdown] tags=["en"]
# ### Random weights without a checkpoint
#
# Speed does not depend on the values of the weights, and a benchmark of a large shape (chapter
# 19 measures a Qwen3-8B-shaped model) should not have to write and read 16 GB of random numbers
# first. `build_model(..., load_format="dummy")` (vLLM's name for the same thing) reads only
# `config.json` and fills each parameter where it already lives, on the GPU and in bf16 if that
# is where the model is built. With tensor parallelism (chapter 16) each rank fills its own
# shards, so the shards are not slices of one model: the tokens are meaningless, only the speed
# is real.

# %% [markdown] tags=["zh"]
# ### 不用检查点的随机权重
#
# 速度与权重的数值无关，而对一个大尺寸模型做基准测试（第 19 章测的是 Qwen3-8B 形状的模型）时，不该先写出再读回
# 16 GB 的随机数。`build_model(..., load_format="dummy")`（vLLM 对同一件事的叫法）只读 `config.json`，然后在每个
# 参数所在的地方直接填上随机值：模型建在 GPU 上、用 bf16，就在 GPU 上、用 bf16 填。用张量并行（第 16 章）时，
# 每个 rank 只填自己的分片，所以这些分片拼不回同一个模型：生成的 token 没有意义，只有速度是真实的。

# %%
dummy = build_model(qwen_dir, load_format="dummy")
again = build_model(qwen_dir, load_format="dummy")
for (name, param), (_, same) in zip(dummy.named_parameters(), again.named_parameters(), strict=True):
    # en: seeded: the same every time
    # zh: 设了随机种子：每次都相同。
    assert torch.equal(param, same) and torch.isfinite(param).all(), name
assert abs(dummy.model.norm.weight.mean().item() - 1.0) < 0.1
with torch.inference_mode():
    # en: no KV cache: a plain forward of three tokens
    # zh: 没有 KV 缓存：对三个 token 做一次普通的前向计算。
    set_prefill_context([3], [3])
    logits = dummy.compute_logits(dummy(torch.tensor([1, 2, 3]), torch.arange(3)))
    reset_context()
print(say("dummy weights: logits {shape} of scale {scale:.2f}, all finite", shape=tuple(logits.shape),
          scale=logits.std().item()))
assert torch.isfinite(logits).all()

# %% [markdown] tags=["en"]
# ## What we built
#
# - `layers/layernorm.py` (`RMSNorm` with a fused residual add), `layers/activation.py`
#   (`SiluAndMul`), `layers/rotary_embedding.py` (`get_rope`, NeoX layout; `default`, `linear`
#   and `llama3` scaling).
# - `layers/linear.py` and `layers/embed_head.py`: the fused linear layers (`QKVParallelLinear`,
#   `MergedColumnParallelLinear`, ...), the embedding and the LM head, each loading its share of a
#   checkpoint tensor (the whole of it, in one process) through a `weight_loader`.
# - `layers/attention.py`: `Attention`, first cut: one sequence, causal, grouped-query, no cache.
# - `models/qwen3.py` (`Qwen3ForCausalLM`, `Qwen2ForCausalLM`), `models/llama.py`
#   (`LlamaForCausalLM`), `models/registry.py` (`get_model_class` from `architectures`; it names
#   each class by its module, imported only when a model is built).
# - `models/loader.py`: `read_model_dir` (the one reader of `config.json`, which refuses a config
#   we cannot build by naming the field and the file), `load_model` (fused and tied weights, a ledger of
#   missing and unexpected tensors), `build_model` (and `load_format="dummy"`: seeded random weights
#   drawn where the model lives, for benchmarks).
# - `book/tiny_models.py`: `build_tiny_model("qwen3" | "qwen2" | "llama")`, cached real HF
#   directories that `transformers` loads.
#
# ## Exercises
#
# 1. How many parameters does the tiny Qwen3 have, and how many would it have with tied
#    embeddings?
# 2. Our model's `qkv_proj.weight` of layer 0 stacks three checkpoint tensors. Which rows hold
#    `k_proj`?
# 3. Why does `RotaryEmbedding` not care whether a position belongs to a prompt or to a generated
#    token?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `layers/layernorm.py`（带融合残差加法的 `RMSNorm`）、`layers/activation.py`（`SiluAndMul`）、
#   `layers/rotary_embedding.py`（`get_rope`，NeoX 布局；支持 `default`、`linear` 和 `llama3` 缩放）。
# - `layers/linear.py` 和 `layers/embed_head.py`：融合的线性层（`QKVParallelLinear`、`MergedColumnParallelLinear`
#   等）、嵌入层和 LM head，每一层都通过 `weight_loader` 加载检查点张量中属于自己的那一份（单进程时是整个张量）。
# - `layers/attention.py`：`Attention` 的第一版：一个序列、因果、分组查询、没有缓存。
# - `models/qwen3.py`（`Qwen3ForCausalLM`、`Qwen2ForCausalLM`）、`models/llama.py`（`LlamaForCausalLM`）、
#   `models/registry.py`（根据 `architectures` 选类的 `get_model_class`；它用模块来指明每个类，只在构建模型时才导入）。
# - `models/loader.py`：`read_model_dir`（`config.json` 的唯一读取者；我们无法构建的配置会被拒绝，
#   报错时指明字段和文件）、`load_model`（融合权重与绑定权重，记账发现缺失和多余的张量）、
#   `build_model`（以及 `load_format="dummy"`：在模型所在之处直接生成带种子的随机权重，供基准测试使用）。
# - `book/tiny_models.py`：`build_tiny_model("qwen3" | "qwen2" | "llama")`，带缓存的、`transformers`
#   可以加载的真实 HF 目录。
#
# ## 练习
#
# 1. 小 Qwen3 有多少参数？如果绑定嵌入，会有多少？
# 2. 我们模型第 0 层的 `qkv_proj.weight` 叠放了三个检查点张量。哪些行是 `k_proj`？
# 3. 为什么 `RotaryEmbedding` 不关心一个位置属于提示词还是生成的 token？

# %%
# en: 1: count the unique parameters; tying removes one vocab x hidden matrix.
# zh: 1：统计不重复的参数；绑定嵌入省掉一个 vocab x hidden 的矩阵。
total = sum(p.numel() for p in model.parameters())
assert total == sum(t.numel() for t in load_file(qwen_dir / "model.safetensors").values())
print(say("tiny Qwen3: {total:,} parameters; tied: {tied:,}", total=total, tied=total - 512 * 64))
lm_head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
# en: not tied yet
# zh: 还没有绑定。
assert lm_head.shape == embedding.shape == (512, 64) and lm_head.data_ptr() != embedding.data_ptr()
# en: 2: rows [q_size, q_size + kv_size) = [4 * 16, 4 * 16 + 2 * 16) = [64, 96).
# zh: 2：第 [q_size, q_size + kv_size) 行 = [4 * 16, 4 * 16 + 2 * 16) = [64, 96)。
k_proj = load_file(qwen_dir / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"]
assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[64:96], k_proj)
# en: 3: RoPE depends only on the position number; where the token came from does not matter,
# en: which is why a decode step only needs `positions = [len(seq) - 1]`.
# zh: 3：RoPE 只取决于位置编号，与 token 的来历无关；所以 decode 步只需要 `positions = [len(seq) - 1]`。
rope = model.model.layers[0].self_attn.rotary_emb
q_all, k_all = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
q_rot, k_rot = rope(torch.arange(10), q_all, k_all)
# en: token 7 alone, as a decode step sees it
# zh: 单独计算 token 7，就像 decode 步看到的那样。
q_one, k_one = rope(torch.tensor([7]), q_all[7:8], k_all[7:8])
assert torch.equal(q_one, q_rot[7:8]) and torch.equal(k_one, k_rot[7:8])
print(say("all exercise answers check out"))
