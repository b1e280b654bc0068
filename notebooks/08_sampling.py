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
# # 08 · Sampling
#
# **Goal.** Turn one row of logits per sequence into one token per sequence, honoring each
# request's own settings: greedy when `temperature == 0`, otherwise a random draw at its
# temperature, restricted by `top_k` and `top_p`, and reproducible when the request carries a
# `seed` — reproducible *whatever else is in the batch*, which is the hard part in a server that
# batches strangers together.

# %% [markdown] tags=["zh"]
# # 08 · 采样
#
# **目标：** 把每个序列的一行 logits 变成每个序列的一个 token，并遵循每个请求自己的设置：`temperature == 0`
# 时贪心；否则按它的温度随机抽取，受 `top_k` 和 `top_p` 限制；请求带有 `seed` 时结果可复现——而且*无论批次里
# 还有什么别的请求*都可复现，这在把素不相识的请求拼成一批的服务器里正是难点。

# %% [markdown] tags=["en"]
# ## The idea: an exponential race
#
# To draw token `i` with probability `p_i`, give every token an independent clock
# `E_i ~ Exp(1)` and pick the token with the largest `p_i / E_i` — equivalently the smallest
# `E_i / p_i`. Now `E_i / p_i` is exponential with rate `p_i`, and of independent exponential
# clocks the one with rate `p_j` rings first with probability `p_j / Σ p_i = p_j`. So
#
# ```
# argmax_i  p_i / E_i   ~   Categorical(p)
# ```
#
# This is the Gumbel-max trick in disguise (`-log E` is Gumbel-distributed, and
# `argmax(log p_i - log E_i)` is the same argmax). nano-vllm uses it because it is one division
# and one `argmax` over the whole batch: no cumulative sums, no search. It also separates the
# *randomness* (the noise `E`) from the *distribution* (`p`), and that is what makes
# per-request seeds easy: each seeded row draws its noise from its own generator.
#
# **Temperature** divides the logits before the softmax. **top-k** keeps the `k` largest
# logits. **top-p** (nucleus) keeps the smallest set of most likely tokens whose probability
# reaches `p` — always at least one token. Masked tokens get probability 0, so they never win.

# %% [markdown] tags=["zh"]
# ## 思路：指数赛跑
#
# 要以概率 `p_i` 抽出 token `i`，给每个 token 一个独立的时钟 `E_i ~ Exp(1)`，选 `p_i / E_i` 最大的那个——
# 也就是 `E_i / p_i` 最小的那个。`E_i / p_i` 服从速率为 `p_i` 的指数分布，而在若干独立的指数时钟中，速率为
# `p_j` 的那个最先响起的概率是 `p_j / Σ p_i = p_j`。所以
#
# ```
# argmax_i  p_i / E_i   ~   Categorical(p)
# ```
#
# 这其实是换了个样子的 Gumbel-max 技巧（`-log E` 服从 Gumbel 分布，`argmax(log p_i - log E_i)` 是同一个
# argmax）。nano-vllm 采用它，是因为整个批次只需一次除法和一次 `argmax`：不用累积和，不用查找。它还把
# *随机性*（噪声 `E`）与*分布*（`p`）分开了，这让按请求设置种子变得容易：每个带种子的行从它自己的生成器中
# 抽取噪声。
#
# **温度**：softmax 之前，先把 logits 除以温度。**top-k** 保留最大的 `k` 个 logits。**top-p**（nucleus，
# 核采样）保留概率累计达到 `p` 的最小的一组最可能的 token——至少保留一个。被屏蔽的 token 概率为 0，永远不会胜出。

# %% [markdown] tags=["en"]
# ## Per-request seeds that ignore the batch
#
# A seeded request must produce the same tokens whether it runs alone or next to 50 others, at
# row 0 or row 17, before or after being preempted and recomputed. So its noise must depend on
# nothing but the request. We derive a fresh generator for every sampled token from
# `(seed, position)`, where `position` is the index of the token being drawn (the sequence's
# length at that moment). Keeping one live generator per request would work too, but its state
# would have to survive preemption and process boundaries (tensor parallelism); a function of
# `(seed, position)` has no state to lose.
# Unseeded rows share the global generator, as usual.

# %% [markdown] tags=["zh"]
# ## 与批次无关的逐请求随机种子
#
# 一个带种子的请求，无论单独运行还是与另外 50 个请求一起、位于第 0 行还是第 17 行、被抢占重算之前还是之后，
# 都必须生成相同的 token。所以它的噪声只能取决于请求本身。我们为每个要采样的 token 从 `(seed, position)` 派生
# 一个新的生成器，其中 `position` 是正在抽取的 token 的下标（即此刻序列的长度）。为每个请求保留一个持续使用的
# 生成器也行，但它的状态必须经受住抢占和进程边界（张量并行）；而 `(seed, position)` 的函数根本没有可丢失的
# 状态。不带种子的行照常共用全局生成器。

# %% default module
#| default_exp layers.sampler

# %% generators
#| export
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from nanovllm.sampling_params import SamplingParams
from nanovllm.layers.context import host_to_device

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_generator(
    seed: int, position: int, device: torch.device | str = "cpu", sample_index: int = 0
) -> torch.Generator:
    """A generator that depends only on (seed, position, sample_index): the noise of one token of one
    sample of a request (``sample_index`` tells apart the n samples of parallel sampling)."""
    # zh: 一个只取决于 (seed, position, sample_index) 的生成器：一个请求的一个样本中一个 token 的噪声
    # zh: （``sample_index`` 区分并行采样的 n 个样本）。
    # en: Hash the numbers so that nearby seeds, positions and samples give unrelated streams.
    # en: Sample 0 keeps the stream of a request with n = 1.
    # zh: 对这几个数做哈希，使相近的种子、位置和样本得到互不相关的随机流。样本 0 沿用 n = 1 时的随机流。
    stream = _splitmix64(seed)
    if sample_index:
        stream = _splitmix64(stream ^ _splitmix64(sample_index))
    # en: manual_seed wants < 2**63
    # zh: manual_seed 要求种子 < 2**63。
    mixed = _splitmix64(stream ^ position) >> 1
    generator = torch.Generator(device=device)
    generator.manual_seed(mixed)
    return generator

# %% [markdown] tags=["en"]
# ## Build it: masks and the sampler
#
# Most batches use none of top-k, top-p or seeds (the benchmark of chapter 19 uses only a
# temperature). For them `temperature_sample` is the whole sampler: it never reads a value back
# from the GPU, so the CPU can queue it right behind the forward pass (chapter 11 writes it as two
# Triton kernels for the GPU). `sampling_inputs` decides on the host which
# path a batch takes: it passes `None` for a feature no row uses. The general path reads back a
# few flags from the GPU to skip the filters no row asks for.
#
# **Logits that are not numbers.** A model whose weights hold NaN, or whose activations overflow
# in float16, produces logits with NaN or `+inf`; `argmax` then returns a meaningless column
# (often 0), and the engine would write token 0 forever without a word. Asking the GPU "is every
# logit finite?" would stall every step on the fast path, so the sampler answers in its output
# instead: a row whose maximum logit is not finite (a NaN propagates through the maximum, and a
# row of nothing but `-inf` has no token either) gets the impossible token id `NON_FINITE` (−2),
# computed on the device next to the real tokens. The host reads the tokens back anyway
# (chapter 09), so the mark costs no extra synchronization, and chapter 20's engine raises a
# clear error when it sees one. A single `-inf` among finite logits is a masked token, not an error.

# %% [markdown] tags=["zh"]
# ## 动手：掩码与采样器
#
# 大多数批次既不用 top-k、top-p，也不用种子（第 19 章的基准测试只用温度）。对它们来说，`temperature_sample` 就是
# 整个采样器：它从不把数据从 GPU 读回主机，所以 CPU 可以把它紧跟在前向计算之后排进队列（第 11 章为 GPU 把它写成两个
# Triton 内核）。走哪条路径由 `sampling_inputs` 在主机端决定：没有任何一行用到的功能，它就传
# `None`。通用路径会从 GPU 读回几个标志，以跳过没有任何一行需要的过滤。
#
# **不是数的 logits：** 权重里含有 NaN 的模型，或者激活值在 float16 中溢出的模型，会产生含 NaN 或 `+inf` 的
# logits；这时 `argmax` 返回的是一个毫无意义的列（常常是 0），引擎就会一声不响地一直写出 token 0。如果向 GPU
# 询问“所有 logits 都有限吗？”，快速路径上的每一步都会因此停下来等待，所以采样器改用它的输出来回答：最大 logit
# 不是有限值的行（NaN 会经由最大值传播开来；全是 `-inf` 的行也没有 token 可抽）得到一个不可能出现的 token id
# `NON_FINITE`（−2），它和真正的 token 一起在设备上算出。主机反正要把 token 读回来（第 09 章），所以这个标记
# 不需要额外的同步；第 20 章的引擎一看到它，就抛出清楚的错误。有限的 logits 中夹着一个 `-inf`，那是被屏蔽的
# token，不算错误。

# %% sampler
#| export
# en: The token id of a row whose logits are not numbers (above): no real token id is negative.
# zh: logits 不是数的那一行得到的 token id（见上文）：真正的 token id 不会是负数。
NON_FINITE = -2


def mark_non_finite(tokens: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``tokens`` [B], with NON_FINITE where a row's maximum logit (``row_max`` [B]) is NaN or +-inf."""
    # zh: ``tokens`` [B]；某行的最大 logit（``row_max`` [B]）是 NaN 或 +-inf 时，该行为 NON_FINITE。
    return torch.where(torch.isfinite(row_max), tokens, NON_FINITE)


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the logits >= the k-th largest (k <= 0 or k >= V: keep all)."""
    # zh: 每行保留 >= 第 k 大值的 logits（k <= 0 或 k >= V：全部保留）。
    vocab = logits.shape[-1]
    k = torch.where((top_ks <= 0) | (top_ks > vocab), vocab, top_ks).long()
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the smallest set of most likely tokens whose probability reaches p (at least one)."""
    # zh: 每行保留累计概率达到 p 的最小的一组最可能的 token（至少一个）。
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    # en: A token is kept if the tokens ranked before it have not reached p yet; the first always is.
    # zh: 如果排在某个 token 之前的那些 token 的概率之和尚未达到 p，就保留它；排第一的总会保留。
    before = probs.cumsum(dim=-1) - probs
    drop_sorted = before >= top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def exponential_noise(
    shape: tuple[int, int], generators: Sequence[torch.Generator | None] | None, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise; a row with a generator draws from it alone, the others from the global generator."""
    # zh: Exp(1) 噪声；带生成器的行只从它自己的生成器抽取，其余行从全局生成器抽取。
    noise = torch.empty(shape, device=device).exponential_()
    for row, generator in enumerate(generators or ()):
        if generator is not None:
            noise[row] = torch.empty(shape[1], device=device).exponential_(generator=generator)
    # en: Exp(1) can return 0; a tiny floor keeps p / E finite (and 0 / E = 0 for masked tokens).
    # zh: Exp(1) 可能返回 0；设一个很小的下限，保证 p / E 有限（被屏蔽的 token 仍有 0 / E = 0）。
    return noise.clamp_min_(1e-10)


def temperature_sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The common case, no top-k, top-p or seed in the batch: one token per row, without a host sync.

    It asks no question of the GPU (such as "is every row greedy?"), so it draws noise even for
    greedy rows.
    """
    # zh: 常见情形，批次里没有 top-k、top-p 或随机种子：每行一个 token，不做主机同步。
    # zh:
    # zh: 它不向 GPU 问任何问题（比如“是不是每一行都是贪心的？”），所以即使是贪心的行也会抽噪声。
    logits = logits.float()
    greedy = temperatures == 0
    row_max = logits.max(dim=-1, keepdim=True).values
    probs = ((logits - row_max) / torch.where(greedy, 1.0, temperatures.float())[:, None]).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_().clamp_min_(1e-10)
    tokens = torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1))
    return mark_non_finite(tokens, row_max[:, 0])


class Sampler(nn.Module):
    """One token per row of logits: greedy at temperature 0, else an exponential race over top-k/top-p."""
    # zh: 每行 logits 一个 token：温度为 0 时贪心，否则在 top-k/top-p 之上做指数赛跑。

    def __init__(self, sample_plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = temperature_sample) -> None:
        super().__init__()
        # en: The function for batches without top-k, top-p or seeds (on a GPU, chapter 11 gives the runner's
        # en: sampler its Triton kernels).
        # zh: 批次中没有 top-k、top-p 和种子时使用的函数（在 GPU 上，第 11 章让执行器的采样器改用 Triton 内核）。
        self.sample_plain = sample_plain

    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_ks: torch.Tensor | None = None,
        top_ps: torch.Tensor | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """logits [B, V]; temperatures [B] (0 = greedy); top_ks [B] int (<= 0: off); top_ps [B] (1.0: off);
        generators: B entries, a generator for each seeded row, None for the others. Returns [B] int64."""
        # zh: logits [B, V]；temperatures [B]（0 = 贪心）；top_ks [B] int（<= 0：关闭）；top_ps [B]（1.0：关闭）；
        # zh: generators：B 个元素，带随机种子的行是一个生成器，其余为 None。返回 [B] int64。
        if top_ks is None and top_ps is None and all(g is None for g in generators or ()):
            return self.sample_plain(logits, temperatures)
        logits = logits.float()
        row_max = logits.max(dim=-1, keepdim=True).values
        greedy_tokens = mark_non_finite(logits.argmax(dim=-1), row_max[:, 0])
        greedy = temperatures == 0
        if bool(greedy.all()):
            return greedy_tokens
        # en: Subtract each row's maximum first: every value is then <= 0, so even a tiny temperature
        # en: cannot overflow to inf (and softmax cannot turn into NaN); the distribution is unchanged.
        # zh: 先减去每行的最大值：所有值都 <= 0，即使温度极小也不会溢出成 inf（softmax 也不会变成 NaN）；分布不变。
        shifted = logits - row_max
        scaled = shifted / torch.where(greedy, 1.0, temperatures.float())[:, None]
        # en: Both filters sort the vocabulary: skip them when no row asks for them.
        # zh: 两种过滤都要对整个词表排序：没有任何一行需要时就跳过。
        vocab = logits.shape[-1]
        if top_ks is not None and bool(((top_ks > 0) & (top_ks < vocab)).any()):
            scaled = apply_top_k(scaled, top_ks.to(scaled.device))
        if top_ps is not None and bool((top_ps < 1.0).any()):
            scaled = apply_top_p(scaled, top_ps.to(scaled.device).float())
        probs = scaled.softmax(dim=-1)
        sampled = (probs / exponential_noise(tuple(probs.shape), generators, probs.device)).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, mark_non_finite(sampled, row_max[:, 0]))


def sampling_inputs(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    device: torch.device | str = "cpu",
    sample_indices: Sequence[int] | None = None,
) -> dict[str, object]:
    """The Sampler's keyword arguments for a batch: ``positions[i]`` is the index of the token row i draws,
    ``sample_indices[i]`` which of its request's n samples it is (default: all 0).

    top_ks, top_ps and generators are None when no row of the batch uses them: the sampler then
    takes its fast path, decided here on the host rather than by asking the GPU.
    """
    # zh: 一个批次的 Sampler 关键字参数：``positions[i]`` 是第 i 行所抽 token 的下标，
    # zh: ``sample_indices[i]`` 是它在所属请求的 n 个样本中是第几个（默认：全为 0）。
    # zh:
    # zh: 批次中没有任何一行用到 top_ks、top_ps 和 generators 时，它们为 None：采样器于是走快速路径，
    # zh: 这是在主机上决定的，而不是去问 GPU。
    sample_indices = sample_indices or [0] * len(params)
    seeded = any(p.seed is not None for p in params)
    return {
        "temperatures": host_to_device([p.temperature for p in params], torch.float32, device),
        "top_ks": host_to_device([p.top_k or 0 for p in params], torch.int64, device)
        if any((p.top_k or 0) > 0 for p in params) else None,
        "top_ps": host_to_device([p.top_p for p in params], torch.float32, device)
        if any(p.top_p < 1.0 for p in params) else None,
        "generators": [
            None if p.seed is None else seeded_generator(p.seed, position, device, sample)
            for p, position, sample in zip(params, positions, sample_indices, strict=True)
        ] if seeded else None,
    }  # fmt: skip

# %% [markdown] tags=["en"]
# ## See it: does the race sample the softmax?
#
# Six tokens with fixed logits, temperature 0.8, and 60,000 draws in one batch. We compare the
# observed counts with the expected ones, `N · softmax(logits / T)`, using Pearson's chi-square
# statistic. With 5 degrees of freedom it exceeds 20.5 only once in a thousand times when the
# sampler is right (the seed is fixed, so the cell always prints the same numbers).

# %% [markdown] tags=["zh"]
# ## 看它运行：赛跑采样得到的真是 softmax 分布吗？
#
# 六个 token，logits 固定，温度 0.8，在一个批次里抽 60,000 次。我们用 Pearson 卡方统计量比较观测次数与期望次数
# `N · softmax(logits / T)`。自由度为 5 时，如果采样器正确，该统计量超过 20.5 的概率只有千分之一（种子是固定的，
# 所以这个单元每次打印的数字都一样）。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "token": "token",
    "expected": "期望",
    "observed": "观测",
    "chi-square = {chi:.2f} (5 degrees of freedom; 99.9% quantile 20.5)":
        "卡方 = {chi:.2f}（5 个自由度；99.9% 分位数 20.5）",
    "probabilities": "概率",
    "{label:11s} tokens drawn: {drawn}": "{label:11s} 抽到的 token：{drawn}",
    "greedy rows 0 and 2: {tokens}": "第 0、2 行贪心：{tokens}",
    "rows with NaN, +inf, only -inf, one -inf: {marked}": "含 NaN、+inf、全为 -inf、含一个 -inf 的行：{marked}",
    "seed 42 alone: {alone}  in a batch of 3: {three}  in a batch of 5: {five}":
        "种子 42 单独：{alone}  在 3 个请求的批次中：{three}  在 5 个请求的批次中：{five}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
import torch

from nanovllm.layers.sampler import Sampler, sampling_inputs
from nanovllm.sampling_params import SamplingParams

torch.manual_seed(0)
sampler = Sampler()
base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N, T = 60_000, 0.8
tokens = sampler(base.repeat(N, 1), torch.full((N,), T))
observed = torch.bincount(tokens, minlength=6).double()
expected = N * (base / T).softmax(-1).double()
chi_square = ((observed - expected) ** 2 / expected).sum().item()
print(format(say("token"), "<10"), list(range(6)))
print(format(say("expected"), "<10"), [round(x) for x in expected.tolist()])
print(format(say("observed"), "<10"), [int(x) for x in observed.tolist()])
print(say("chi-square = {chi:.2f} (5 degrees of freedom; 99.9% quantile 20.5)", chi=chi_square))

# %% [markdown] tags=["en"]
# Now top-k and top-p on the same logits (probabilities at temperature 1 shown first), and
# greedy rows mixed into a sampled batch:

# %% [markdown] tags=["zh"]
# 再在同样的 logits 上看 top-k 和 top-p（先列出温度为 1 时的概率），以及混在采样批次中的贪心行：

# %%
probs = base.softmax(-1)
print(say("probabilities"), [f"{p:.3f}" for p in probs.tolist()])
draws = {}
for label, k, p in [("top_k=2", 2, 1.0), ("top_p=0.8", 0, 0.8), ("top_p=0.01", 0, 0.01)]:
    out = sampler(base.repeat(5000, 1), torch.ones(5000), torch.full((5000,), k), torch.full((5000,), p))
    draws[label] = sorted(set(out.tolist()))
    print(say("{label:11s} tokens drawn: {drawn}", label=label, drawn=draws[label]))
mixed = sampler(base.repeat(4, 1), torch.tensor([0.0, 1.0, 0.0, 1.0]))
print(say("greedy rows 0 and 2: {tokens}", tokens=mixed.tolist()))

# %% [markdown] tags=["en"]
# ## Check it
#
# The chi-square statistic is below the threshold; top-k=2 only ever draws tokens 0 and 1;
# top-p=0.8 draws exactly the smallest set reaching 0.8 (0.561 + 0.206 = 0.767 is not enough,
# adding 0.125 is: tokens 0, 1 and 2); a tiny top-p still keeps one token; greedy rows take the argmax;
# rows whose logits hold a NaN, a `+inf` or nothing but `-inf` get `NON_FINITE`, on both paths, while
# a single `-inf` is only a masked token.
#
# Then the point of the seeds: a request with `seed=42` yields the same five tokens alone, in a
# batch of three at row 1, and in a batch of five at row 4 next to different neighbours.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 卡方统计量低于阈值；top-k=2 只会抽到 token 0 和 1；top-p=0.8 恰好在达到 0.8 的最小集合里抽取
# （0.561 + 0.206 = 0.767 还不够，再加上 0.125 就够了：token 0、1 和 2）；很小的 top-p 也仍保留一个 token；
# 贪心行取 argmax；logits 中含有 NaN、`+inf` 或全是 `-inf` 的行，在两条路径上都得到 `NON_FINITE`，而单个
# `-inf` 只是一个被屏蔽的 token。
#
# 然后是种子的意义所在：一个 `seed=42` 的请求，单独运行、在三个请求的批次中位于第 1 行、在五个请求的批次中
# 位于第 4 行且邻居不同，生成的五个 token 都相同。

# %%
assert chi_square < 20.5
assert draws == {"top_k=2": [0, 1], "top_p=0.8": [0, 1, 2], "top_p=0.01": [0]}
assert mixed[0] == mixed[2] == 0

from nanovllm.layers.sampler import NON_FINITE

broken = base.repeat(4, 1)
broken[0, 3], broken[1, 5], broken[2], broken[3, 0] = float("nan"), float("inf"), float("-inf"), float("-inf")
# en: The fast path, then the general one (top-k).
# zh: 先走快速路径，再走通用路径（top-k）。
for top_k in (None, torch.full((4,), 3)):
    for temperature in (0.0, 1.0):
        marked = sampler(broken, torch.full((4,), temperature), top_k).tolist()
        assert marked[:3] == [NON_FINITE] * 3 and marked[3] >= 0, marked
print(say("rows with NaN, +inf, only -inf, one -inf: {marked}", marked=marked))


def run_steps(batch: list[SamplingParams], row: int, steps: int = 5, vocab: int = 50) -> list[int]:
    """Sample `steps` tokens for every row; return row `row`'s tokens. Logits vary per step and row."""
    # zh: 为每一行采样 `steps` 个 token；返回第 `row` 行的 token。logits 随步和行而变。
    out = []
    for step in range(steps):
        logits = torch.sin(torch.arange(vocab)[None, :] * (step + 1) * 0.37 + torch.arange(len(batch))[:, None])
        # en: the seeded request's own logits
        # zh: 带种子的那个请求自己的 logits。
        logits[row] = torch.sin(torch.arange(vocab) * (step + 1) * 0.37)
        positions = [10 + step] * len(batch)
        out.append(int(sampler(logits, **sampling_inputs(batch, positions))[row]))
    return out


seeded = SamplingParams(temperature=1.0, seed=42)
alone = run_steps([seeded], row=0)
in_three = run_steps([SamplingParams(temperature=0.7), seeded, SamplingParams(seed=7)], row=1)
in_five = run_steps([SamplingParams(top_k=3)] * 4 + [seeded], row=4)
print(say("seed 42 alone: {alone}  in a batch of 3: {three}  in a batch of 5: {five}",
          alone=alone, three=in_three, five=in_five))
assert alone == in_three == in_five
assert run_steps([SamplingParams(temperature=1.0, seed=43)], row=0) != alone

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/sampler.py`: `Sampler` (`sampler(logits, temperatures, top_ks, top_ps,
#   generators)`), `apply_top_k`, `apply_top_p`, `seeded_generator(seed, position)`, and
#   `sampling_inputs(params, positions)` that turns a batch's `SamplingParams` into the
#   sampler's arguments (`None` for a feature no row uses), and `temperature_sample`, the
#   sampler's path for batches without top-k, top-p or seeds, which never reads back from the GPU.
#
# Note on ties: `top_k` keeps every token whose logit equals the k-th largest, so exact ties can
# keep more than `k` tokens (as in vLLM's reference path).
#
# ## Exercises
#
# 1. Show numerically that `argmax(log p - log E)` picks the same token as `argmax(p / E)` for the
#    same noise.
# 2. With `top_k=3` and `top_p=0.5` on the six logits above, which tokens can be drawn?
# 3. Why must `position` (not a step counter of the engine) feed the seed?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/sampler.py`：`Sampler`（`sampler(logits, temperatures, top_ks, top_ps, generators)`）、
#   `apply_top_k`、`apply_top_p`、`seeded_generator(seed, position)`，以及把一个批次的 `SamplingParams` 变成
#   采样器参数的 `sampling_inputs(params, positions)`（没有任何一行用到的功能传 `None`），以及 `temperature_sample`：
#   批次中没有 top-k、top-p 和种子时采样器走的路径，它从不把数据从 GPU 读回主机。
#
# 关于并列：`top_k` 会保留所有 logit 等于第 k 大值的 token，所以恰好并列时可能保留多于 `k` 个 token
# （与 vLLM 的参考实现相同）。
#
# ## 练习
#
# 1. 用数值验证：对同一份噪声，`argmax(log p - log E)` 与 `argmax(p / E)` 选出同一个 token。
# 2. 在上面六个 logits 上同时使用 `top_k=3` 和 `top_p=0.5`，可能抽到哪些 token？
# 3. 为什么送入种子的必须是 `position`，而不是引擎的步数计数器？

# %%
# en: 1: log is increasing, and log(p / E) = log p - log E.
# zh: 1：log 是增函数，且 log(p / E) = log p - log E。
noise = torch.empty(1000, 6).exponential_()
assert torch.equal((probs / noise).argmax(-1), (probs.log() - noise.log()).argmax(-1))
# en: 2: top-k keeps tokens 0, 1, 2; renormalized, token 0 alone has 0.561 / 0.892 = 0.63 > 0.5: only token 0.
# zh: 2：top-k 保留 token 0、1、2；重新归一化后，仅 token 0 就有 0.561 / 0.892 = 0.63 > 0.5：只有 token 0。
both = sampler(base.repeat(2000, 1), torch.ones(2000), torch.full((2000,), 3), torch.full((2000,), 0.5))
assert set(both.tolist()) == {0}
# en: 3: a preempted sequence is recomputed and its steps renumbered, and a sequence's step count depends on
# en: chunking; its token positions do not, so (seed, position) gives the same draw every time.
# zh: 3：被抢占的序列会重算，步数随之改变，而且序列经历的步数还取决于分块方式；token 的位置则不会变，
# zh: 所以 (seed, position) 每次都给出相同的抽样。
weights = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])


def draw(key: int) -> int:
    """One token drawn with the noise of seed 7 and ``key``."""
    # zh: 用随机种子 7 和 ``key`` 的噪声抽出的一个 token。
    return int((weights / torch.empty(5).exponential_(generator=seeded_generator(7, key))).argmax())


# en: ten tokens of one request
# zh: 同一个请求的十个 token。
positions = range(10, 20)
# en: one token per step
# zh: 每步一个 token。
steps_alone = list(range(10))
# en: after 4 tokens, one step goes to the recompute
# zh: 生成 4 个 token 之后，有一步花在重算上。
steps_preempted = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]
# en: keyed by position: the same tokens
# zh: 以位置为键：得到相同的 token。
assert [draw(p) for p in positions] == [draw(p) for p in positions]
# en: keyed by step: other tokens
# zh: 以步数为键：得到不同的 token。
assert [draw(s) for s in steps_alone] != [draw(s) for s in steps_preempted]
print(say("all exercise answers check out"))
