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
# # 07 · Sampling
#
# **Goal.** Turn one row of logits per sequence into one token per sequence, honoring each
# request's own settings: greedy when `temperature == 0`, otherwise a random draw at its
# temperature, restricted by `top_k` and `top_p`, and reproducible when the request carries a
# `seed` — reproducible *whatever else is in the batch*, which is the hard part in a server that
# batches strangers together.

# %% [markdown] tags=["zh"]
# # 07 · 采样
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
# Most batches use none of top-k, top-p or seeds (the benchmark of chapter 14 uses only a
# temperature). For them `temperature_sample` is the whole sampler: it never reads a value back
# from the GPU, so the CPU can queue it right behind the forward pass; on a GPU it runs as two
# Triton kernels (the last section of this chapter). `sampling_inputs` decides on the host which
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
# (chapter 08), so the mark costs no extra synchronization, and chapter 13's engine raises a
# clear error when it sees one. A single `-inf` among finite logits is a masked token, not an error.

# %% [markdown] tags=["zh"]
# ## 动手：掩码与采样器
#
# 大多数批次既不用 top-k、top-p，也不用种子（第 14 章的基准测试只用温度）。对它们来说，`temperature_sample` 就是
# 整个采样器：它从不把数据从 GPU 读回主机，所以 CPU 可以把它紧跟在前向计算之后排进队列；在 GPU 上它由两个 Triton
# 内核完成（见本章最后一节）。走哪条路径由 `sampling_inputs` 在主机端决定：没有任何一行用到的功能，它就传
# `None`。通用路径会从 GPU 读回几个标志，以跳过没有任何一行需要的过滤。
#
# **不是数的 logits：** 权重里含有 NaN 的模型，或者激活值在 float16 中溢出的模型，会产生含 NaN 或 `+inf` 的
# logits；这时 `argmax` 返回的是一个毫无意义的列（常常是 0），引擎就会一声不响地一直写出 token 0。如果向 GPU
# 询问“所有 logits 都有限吗？”，快速路径上的每一步都会因此停下来等待，所以采样器改用它的输出来回答：最大 logit
# 不是有限值的行（NaN 会经由最大值传播开来；全是 `-inf` 的行也没有 token 可抽）得到一个不可能出现的 token id
# `NON_FINITE`（−2），它和真正的 token 一起在设备上算出。主机反正要把 token 读回来（第 08 章），所以这个标记
# 不需要额外的同步；第 13 章的引擎一看到它，就抛出清楚的错误。有限的 logits 中夹着一个 `-inf`，那是被屏蔽的
# token，不算错误。

# %% sampler
#| export
# en: The token id of a row whose logits are not numbers (above): no real token id is negative.
# zh: logits 不是数的那一行得到的 token id（见上文）：真正的 token id 不会是负数。
NON_FINITE = -2


def mark_non_finite(tokens: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``tokens`` [B], with NON_FINITE where a row's maximum logit (``row_max`` [B]) is NaN or +-inf."""
    return torch.where(torch.isfinite(row_max), tokens, NON_FINITE)


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the logits >= the k-th largest (k <= 0 or k >= V: keep all)."""
    vocab = logits.shape[-1]
    k = torch.where((top_ks <= 0) | (top_ks > vocab), vocab, top_ks).long()
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the smallest set of most likely tokens whose probability reaches p (at least one)."""
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
    greedy rows. On a GPU, ``layers.triton_sampler.triton_temperature_sample`` takes its place.
    """
    logits = logits.float()
    greedy = temperatures == 0
    row_max = logits.max(dim=-1, keepdim=True).values
    probs = ((logits - row_max) / torch.where(greedy, 1.0, temperatures.float())[:, None]).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_().clamp_min_(1e-10)
    tokens = torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1))
    return mark_non_finite(tokens, row_max[:, 0])


class Sampler(nn.Module):
    """One token per row of logits: greedy at temperature 0, else an exponential race over top-k/top-p."""

    def __init__(self, sample_plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = temperature_sample) -> None:
        super().__init__()
        # en: The function for batches without top-k, top-p or seeds; on a GPU the model runner passes
        # en: the Triton one (layers.triton_sampler.triton_temperature_sample).
        # zh: 批次中没有 top-k、top-p 和种子时使用的函数；在 GPU 上，第 08 章的执行器传入 Triton 版本
        # zh: （layers.triton_sampler.triton_temperature_sample）。
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
# en: What this chapter prints, in Chinese for the Chinese site (chapter 00, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见第 00 章与 nanovllm.book.lang），中文网站打印中文。
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
    "chi-square = {chi:.2f} over {n} draws (5 degrees of freedom; 99.9% quantile 20.5)":
        "{n} 次抽样的卡方 = {chi:.2f}（5 个自由度；99.9% 分位数 20.5）",
    "{dtype!s:15s} greedy == torch.argmax: {tokens}": "{dtype!s:15s} 贪心 == torch.argmax：{tokens}",
    "two calls:": "两次调用：",
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
# ## On the GPU: the race in one pass
#
# On a GPU the sampler is the busiest code after the model itself: every decode step turns one
# row of 151,936 logits (Qwen3's vocabulary) per sequence into a token. `temperature_sample`
# makes several passes over that `[batch, vocab]` tensor (a maximum, the softmax's sums, the
# noise, an argmax), and even compiled by `torch.compile` each row reduction runs in a single
# thread block per row: a batch of 100 rows keeps 100 thread blocks busy on a GPU that runs
# thousands at once. In chapter 14's benchmark on an H200 the compiled version took 0.55 s of a
# 7.7 s run; the kernels below take 0.08 s of the same run (chapter 09 records both). Three
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
# bits, a server taking ten steps a second would likely repeat one within two hours).

# %% [markdown] tags=["zh"]
# ## 在 GPU 上：一遍扫完词表的指数赛跑采样
#
# 在 GPU 上，采样器是仅次于模型本身最繁忙的代码：每个 decode 步都要把每个序列的一行 151,936 个 logits（Qwen3
# 的词表大小）变成一个 token。`temperature_sample` 要把这个 `[batch, vocab]` 张量读好几遍（求最大值、softmax 的
# 求和、生成噪声、argmax）；即使用 `torch.compile` 编译，每个按行归约也只用一个线程块处理一行：100 行的批次只让
# 100 个线程块忙碌，而 GPU 能同时运行数千个。在 H200 上跑第 14 章的基准测试时，编译后的版本在 7.7 s 中占了
# 0.55 s；下面的内核在同样的运行中只占 0.08 s（两者都记录在第 09 章）。下面三点观察把它变成一遍完成、又能占满
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

# %% [markdown] tags=["en"]
# As in chapter 06b, Triton decides when a kernel is *decorated* whether it is compiled or
# interpreted, so without a CUDA device this cell sets `TRITON_INTERPRET=1` before the kernel
# module is imported. The interpreter runs the programs one after another in Python, a few
# milliseconds each, so the checks below use small shapes.

# %% [markdown] tags=["zh"]
# 和第 06b 章一样，Triton 在*装饰*内核时就决定它是编译还是解释执行，所以没有 CUDA 设备时，这个单元会在导入内核
# 模块之前设置 `TRITON_INTERPRET=1`。解释器在 Python 中一个接一个地运行各个程序，每个要几毫秒，所以下面的检查
# 都用很小的形状。

# %%
import os

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
print("device:", DEVICE, "| TRITON_INTERPRET =", os.environ.get("TRITON_INTERPRET", "0"))

# %% triton sampler imports
#| export layers.triton_sampler
"""The sampler's fast path on a GPU: the exponential race as two Triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.layers.sampler import NON_FINITE
from nanovllm.layers.triton_attention import check_triton_device

# %% [markdown] tags=["en"]
# ### Build it: the chunk kernel and the pick kernel
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
# ### 动手：分段内核与挑选内核
#
# 分段内核把自己的 `BLOCK` 列当作一个 `[4, BLOCK/4]` 的 tile 处理：tile 的第 `q` 行存放第 `q · BLOCK/4 + i` 列，
# 使用第 `i` 次 Philox 抽样所得四个数中的第 `q` 个。对 tile 做两次归约，先得到最高分，再得到取得这个分数的最小
# 列号。超出词表的列以 `−inf` 载入，永远不会胜出。某一段里只要有 NaN 或 `+inf` 的 logit，它报告的列就是 −1；
# 挑选内核对含有这种段的行，或最高分为 `−inf` 的行（整行都是 `−inf`），写入 `NON_FINITE`：与 torch 版本相同的
# 标记，代价只是趁 logits 还在寄存器里时，每列多做一次比较。

# %% race kernels
#| export layers.triton_sampler
# en: A new seed every call: do_not_specialize lets one compiled variant serve them all (see the wrapper).
# zh: 每次调用的种子都不同：do_not_specialize 让一个编译好的变体服务所有种子（见包装函数）。
@triton.jit(do_not_specialize=["seed"])
def race_chunk_kernel(
    logits_ptr, temperatures_ptr, chunk_score_ptr, chunk_column_ptr, seed, vocab, BLOCK: tl.constexpr
):
    # en: This program races columns [chunk * BLOCK, (chunk + 1) * BLOCK) of one row.
    # zh: 本程序让某一行的第 [chunk * BLOCK, (chunk + 1) * BLOCK) 列参加赛跑。
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
# ### The wrapper, and what Triton compiles
#
# `triton_temperature_sample` has the contract of `temperature_sample`, so chapter 08 can put it
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
# and one logits dtype therefore need exactly one variant of each kernel, which chapter 08's
# `compile_sampler_kernels` compiles before the first step.

# %% [markdown] tags=["zh"]
# ### 包装函数，以及 Triton 编译了什么
#
# `triton_temperature_sample` 的约定与 `temperature_sample` 完全相同，所以第 08 章可以在 GPU 上用它替换采样器的
# 快速路径。它抽取种子、分配 `[rows, chunks]` 的临时（分数，列）对，然后启动两个内核；它不从 GPU 读回任何东西。
#
# 参数每出现一个新的*变体*，Triton 就要重新编译一次内核：`constexpr` 取了新值、整数参数换了类型（小于 2³¹ 的
# `int` 以 int32 传入，大于等于 2³² 的以 int64 传入），或整数的值落入了新的类别（等于 1、能被 16 整除、或都不是）。
# 种子每次调用都不同，所以用 `do_not_specialize=["seed"]` 让它的类别不进入变体，并把种子限制在
# `[2³², 2³² + 2⁶²)` 之内，使它的类型总是 int64。对同一个模型，每次调用的 `vocab` 都相同，所以保留对它的特化
# （Qwen3 的 151,936 能被 16 整除，载入可以向量化）；批大小只决定网格。因此一个模型、一种 logits 数据类型，每个
# 内核恰好只需要一个变体，第 08 章的 `compile_sampler_kernels` 会在第一步之前把它编译好。

# %% triton sampler wrapper
#| export layers.triton_sampler
def triton_temperature_sample(
    logits: torch.Tensor, temperatures: torch.Tensor, block_size: int = 4096
) -> torch.Tensor:
    """``temperature_sample`` as two Triton kernels: logits [B, V] (float32, bfloat16 or float16), temperatures [B]
    (0 = greedy) -> [B] int64 on the logits' device, NON_FINITE for a row whose logits are not numbers. Nothing is
    read back from the GPU; the noise's seed comes from torch's CPU generator, so ``torch.manual_seed`` before a
    call makes it reproducible."""
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
    seed = 2**32 + int(torch.randint(2**62, ()))
    race_chunk_kernel[(batch, num_chunks)](
        logits, temperatures, chunk_score, chunk_column, seed, vocab, BLOCK=block_size
    )
    race_pick_kernel[(batch,)](
        chunk_score, chunk_column, tokens, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks),
        NON_FINITE=NON_FINITE,
    )
    return tokens

# %% [markdown] tags=["en"]
# ### Check it: the kernels sample the softmax, and greedy rows are torch's argmax
#
# The same six logits as above, now at temperature 2.5, with `block_size=4`: the vocabulary of
# 6 is two chunks, the second one half past the end. On a CPU the interpreter runs three
# programs per row, so the chi-square test uses 500 draws (60,000 on a GPU); the high
# temperature flattens the distribution enough that every token still expects more than 20.
# Then greedy rows on random float32 and bfloat16 logits of 1,000 columns in chunks of 256 (the
# last one partial), with planted ties; a batch that mixes greedy and sampled rows; and the
# seed: two calls draw different noise, and `torch.manual_seed` replays a call exactly. Last, the
# rows whose logits are not numbers get the torch path's mark.

# %% [markdown] tags=["zh"]
# ### 验证：内核采样得到的是 softmax 分布，贪心行与 torch 的 argmax 一致
#
# 仍用上面那六个 logits，这次温度为 2.5，`block_size=4`：大小为 6 的词表分成两段，第二段有一半超出末尾。在 CPU
# 上解释器每行要运行三个程序，所以卡方检验只抽 500 次（GPU 上抽 60,000 次）；较高的温度让分布足够平坦，每个
# token 的期望次数仍大于 20。然后是
# 贪心行：1,000 列的随机 float32 和 bfloat16 logits，每段 256 列（最后一段不满），并人为放入并列的最大值；一个
# 贪心行与采样行混合的批次；然后是种子：两次调用抽到的噪声不同，而 `torch.manual_seed` 能完全重现一次调用。最后，
# logits 不是数的行得到与 torch 版本相同的标记。

# %%
from nanovllm.layers.triton_sampler import triton_temperature_sample

torch.manual_seed(0)
N6, T6 = (60_000 if DEVICE == "cuda" else 500), 2.5
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

# en: The mark of logits that are not numbers, as on the torch path (row 0's NaN is in chunk 0, row 1's inf in chunk 1).
# zh: 与 torch 版本相同的“不是数”标记（第 0 行的 NaN 在第 0 段，第 1 行的 inf 在第 1 段）。
for temperature in (0.0, 1.0):
    marked = triton_temperature_sample(broken.to(DEVICE), torch.full((4,), temperature, device=DEVICE), block_size=4)
    assert marked[:3].tolist() == [NON_FINITE] * 3 and marked[3] >= 0, marked

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/layers/sampler.py`: `Sampler` (`sampler(logits, temperatures, top_ks, top_ps,
#   generators)`), `apply_top_k`, `apply_top_p`, `seeded_generator(seed, position)`, and
#   `sampling_inputs(params, positions)` that turns a batch's `SamplingParams` into the
#   sampler's arguments (`None` for a feature no row uses), and `temperature_sample`, the
#   sampler's path for batches without top-k, top-p or seeds, which never reads back from the GPU.
# - `nanovllm/layers/triton_sampler.py`: `triton_temperature_sample(logits, temperatures,
#   block_size=4096)`, the same contract as two Triton kernels, `race_chunk_kernel` (one program
#   per row and chunk of columns) and `race_pick_kernel` (one per row), with Philox noise from a
#   seed drawn on the host; chapter 08 puts it in the sampler's place on a GPU.
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
# 4. The chunk kernel scores `l − T · log E` rather than `l / T − log E`. Check that both pick the
#    same token for `T = 0.7` on random logits and noise, and that only the kernel's form stays
#    finite at `T = 1e-45`.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/layers/sampler.py`：`Sampler`（`sampler(logits, temperatures, top_ks, top_ps, generators)`）、
#   `apply_top_k`、`apply_top_p`、`seeded_generator(seed, position)`，以及把一个批次的 `SamplingParams` 变成
#   采样器参数的 `sampling_inputs(params, positions)`（没有任何一行用到的功能传 `None`），以及 `temperature_sample`：
#   批次中没有 top-k、top-p 和种子时采样器走的路径，它从不把数据从 GPU 读回主机。
# - `nanovllm/layers/triton_sampler.py`：`triton_temperature_sample(logits, temperatures, block_size=4096)`，
#   以两个 Triton 内核实现同样的约定：`race_chunk_kernel`（每行、每段列一个程序）和 `race_pick_kernel`（每行一个
#   程序），噪声来自 Philox，种子在主机端抽取；第 08 章在 GPU 上用它替换采样器的快速路径。
#
# 关于并列：`top_k` 会保留所有 logit 等于第 k 大值的 token，所以恰好并列时可能保留多于 `k` 个 token
# （与 vLLM 的参考实现相同）。
#
# ## 练习
#
# 1. 用数值验证：对同一份噪声，`argmax(log p - log E)` 与 `argmax(p / E)` 选出同一个 token。
# 2. 在上面六个 logits 上同时使用 `top_k=3` 和 `top_p=0.5`，可能抽到哪些 token？
# 3. 为什么送入种子的必须是 `position`，而不是引擎的步数计数器？
# 4. 分段内核的分数是 `l − T · log E`，而不是 `l / T − log E`。在随机的 logits 和噪声上验证：`T = 0.7` 时两者选出
#    同一个 token；`T = 1e-45` 时只有内核的写法保持有限。

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
# en: 4: multiplying every score of a row by the same T > 0 keeps their order; l - T log E has no division,
# en: so a tiny T leaves (nearly) the bare logits instead of pushing them to infinity.
# zh: 4：一行的所有分数乘以同一个 T > 0，顺序不变；l - T log E 里没有除法，所以极小的 T 留下的（几乎）就是
# zh: logits 本身，而不会把它们推向无穷大。
logits4, noise4 = torch.randn(1000, 50), torch.empty(1000, 50).exponential_()
assert torch.equal((logits4 / 0.7 - noise4.log()).argmax(-1), (logits4 - 0.7 * noise4.log()).argmax(-1))
assert torch.isinf(logits4 / 1e-45).any() and torch.isfinite(logits4 - 1e-45 * noise4.log()).all()
print(say("all exercise answers check out"))
