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
# # 19 · Measuring the engine: the benchmark
#
# **Goal.** The engine is built; now it is measured the way nano-vllm measures itself, against a
# fair peer. By the end of this chapter you can generate nano-vllm's benchmark workload draw for
# draw, measure Hugging Face `transformers` on it fairly, compute the workload's physical bound on
# a GPU, and run `python -m nanovllm.bench`, which reports the engine's throughput next to the
# peer's (or next to one GPU, with tensor parallelism) in one invocation.

# %% [markdown] tags=["zh"]
# # 19 · 测量引擎：基准测试
#
# **目标：** 引擎已经建好；现在用 nano-vllm 测量自己的方式，对照一个公平的参照来测量它。读完本章，你能逐次抽样地
# 复现 nano-vllm 的基准负载，公平地测量 Hugging Face `transformers` 在它上面的表现，算出这个负载在 GPU 上的物理上限，
# 并运行 `python -m nanovllm.bench`：它在一次调用中报告引擎的吞吐量，旁边是参照组的（或者，用张量并行时，是单 GPU 的）。

# %% [markdown] tags=["en"]
# The examples below run on a tiny Llama with random weights (chapter 06's `build_tiny_model`),
# in a temporary directory that the last cell removes.

# %% [markdown] tags=["zh"]
# 下面的例子在一个随机权重的小 Llama（第 06 章的 `build_tiny_model`）上运行，放在一个临时目录里，最后一个单元会删除它。

# %%
import json
import tempfile
from pathlib import Path

import torch

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config

workdir = Path(tempfile.mkdtemp(prefix="nanovllm-ch14-"))
tiny = build_tiny_model("llama")
config = Config.from_kwargs(tiny, device="cpu")

# %% [markdown] tags=["en"]
# ## Build it: the benchmark
#
# nano-vllm's `bench.py` is the yardstick every re-implementation quotes: 256 sequences, prompt
# and output lengths uniform in [100, 1024], random token ids, `ignore_eos=True` (so every
# sequence produces exactly its `max_tokens`), and the figure is **output tokens per second**
# over the whole run. `make_workload` reproduces it, draw for draw: with the same seed it makes
# the same prompts as nano-vllm's script, because it calls a `random.Random(seed)` in the same
# order as nano-vllm calls the seeded global `random`. Token ids are capped below the model's
# vocabulary, so a tiny model can run the workload too.
#
# Two presets: `nano-vllm` (the workload above, for a GPU) and `cpu` (16 sequences, lengths in
# [32, 256]: a couple of minutes with SmolLM2 on a laptop).

# %% [markdown] tags=["zh"]
# ## 动手：基准测试
#
# nano-vllm 的 `bench.py` 是各种重写版本都会引用的标尺：256 个序列，提示词和输出长度都在 [100, 1024] 中均匀分布，
# token id 随机，`ignore_eos=True`（于是每个序列恰好生成它的 `max_tokens` 个 token），指标是整个运行期间的
# **每秒输出 token 数**。`make_workload` 逐次复现了它的随机抽取：种子相同时，生成的提示词与 nano-vllm 脚本的
# 完全一样，因为它调用 `random.Random(seed)` 的顺序与 nano-vllm 调用设定了种子的全局 `random` 的顺序一致。
# token id 的上限会压到模型词表之内，所以小模型也能跑这个负载。
#
# 两种预设：`nano-vllm`（上面的负载，用于 GPU）和 `cpu`（16 个序列，长度在 [32, 256] 之间：在笔记本电脑上用
# SmolLM2 跑几分钟）。

# %% bench phrases
#| exporti bench.engine
#| hide
from nanovllm.book.lang import Phrases

# en: What the benchmark prints, in Chinese when the book reads in Chinese (nanovllm.book.lang); English otherwise.
# zh: 基准测试打印的文字的中文：本书以中文阅读时打印中文（nanovllm.book.lang），否则打印英文。
_say_bench = Phrases({
    "{name}: the median of {count} runs, taking turns: {rate:,.1f} tok/s ({rates})":
        "{name}：轮流跑了 {count} 次，取中位数：{rate:,.1f} tok/s（{rates}）",
    "copy rate, measured: {before:.2f} TB/s before the runs, {after:.2f} after; the bound uses the higher":
        "实测拷贝速率：运行前 {before:.2f} TB/s，运行后 {after:.2f} TB/s；上限按较高的那个算",
    "{seqs} sequences, prompts {low}-{high} tokens ({total} in all), outputs {out_low}-{out_high} tokens "
    "({out_total} in all)":
        "{seqs} 个序列，提示词 {low}-{high} 个 token（共 {total} 个），输出 {out_low}-{out_high} 个 token"
        "（共 {out_total} 个）",
    "{name}: {tokens} tokens in {seconds:.2f} s = {rate:,.1f} tok/s":
        "{name}：{seconds:.2f} s 生成 {tokens} 个 token = {rate:,.1f} tok/s",
    "transformers generate (batches of {size})": "transformers generate（每批 {size} 个）",
    "nano-vllm (this book), TP={tp}": "nano-vllm（本书），TP={tp}",
    "{name}, attention {backend}": "{name}，注意力后端 {backend}",
    "{name}, kv cache {kv}": "{name}，KV 缓存 {kv}",
    "KV cache: {blocks:,} blocks x {block_size} tokens = {tokens:,} tokens, {dtype}, {block_mib:.2f} MiB a block, "
    "{gib:.2f} GiB{per_rank}":
        "KV 缓存：{blocks:,} 块 x {block_size} 个 token = {tokens:,} 个 token，{dtype}，每块 {block_mib:.2f} MiB，"
        "共 {gib:.2f} GiB{per_rank}",
    " per rank": "（每个 rank）",
    "  in LLMEngine.step: prefill {prefill:.2f} s in {prefill_steps} steps, decode {decode:.2f} s in {decode_steps} "
    "steps; outside it (generate's loop): {outside:.2f} s":
        "  LLMEngine.step 之内：prefill {prefill:.2f} s，{prefill_steps} 步；decode {decode:.2f} s，{decode_steps} 步；"
        "之外（generate 的循环）：{outside:.2f} s",
    "engine / transformers: {ratio:.2f}x": "引擎 / transformers：{ratio:.2f}x",
    "{faster} / {slower}: {ratio:.2f}x (same workload, same invocation)":
        "{faster} / {slower}：{ratio:.2f}x（同一负载，同一次调用）",
    "bound": "上限",
    "bound (kv cache {kv})": "上限（KV 缓存 {kv}）",
    "{bound}: decode reads {tb:.2f} TB at {bandwidth:.2f} TB/s (copy, measured) + prefill {pflop:.3f} PFLOP at "
    "{tflops:.0f} TFLOP/s (bf16 matmul, measured) = {seconds:.2f} s -> {rate:,.0f} tok/s":
        "{bound}：decode 以 {bandwidth:.2f} TB/s（拷贝，实测）读取 {tb:.2f} TB + prefill 以 {tflops:.0f} TFLOP/s"
        "（bf16 矩阵乘法，实测）计算 {pflop:.3f} PFLOP = {seconds:.2f} s -> {rate:,.0f} tok/s",
    "{name}: {fraction:.1%} of the bound{gpus}{kv}": "{name}：达到上限的 {fraction:.1%}{gpus}{kv}",
    " of {gpus} GPUs": "（{gpus} 块 GPU 的上限）",
    " (kv cache {kv})": "（KV 缓存 {kv}）",
    "model: {model} on {device} ({dtype})": "模型：{model}，在 {device} 上（{dtype}）",
    "workload: {workload}": "负载：{workload}",
    "transformers peer skipped: {why}": "跳过 transformers 对照组：{why}",
    "the model has no weights (load_format='dummy')": "模型没有权重（load_format='dummy'）",
    "--tensor-parallel-size {tp}: the TP=1 engine is the peer": "--tensor-parallel-size {tp}：TP=1 的引擎就是对照组",
})

# %% bench workload
#| export bench.engine
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from nanovllm.sampling_params import SamplingParams

PRESETS: dict[str, dict] = {
    "nano-vllm": {"num_seqs": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    # en: The same workload on a Qwen3-8B-shaped model (the tensor-parallel goal): it fits one H200.
    # zh: 同样的负载，换成 Qwen3-8B 形状的模型（第 17 章的第二个目标）：一块 H200 放得下。
    "qwen3-8b": {"num_seqs": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    "cpu": {"num_seqs": 16, "input_len": (32, 256), "output_len": (32, 256)},
}


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and the number of tokens each one must produce (ignore_eos)."""
    # zh: 以 token id 表示的提示词，以及每个提示词必须生成的 token 数（ignore_eos）。

    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float = 0.6

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=self.temperature, max_tokens=n, ignore_eos=True) for n in self.output_lens]

    def describe(self) -> str:
        ins, outs = [len(p) for p in self.prompts], self.output_lens
        return _say_bench("{seqs} sequences, prompts {low}-{high} tokens ({total} in all), outputs "
                          "{out_low}-{out_high} tokens ({out_total} in all)", seqs=len(ins), low=min(ins),
                          high=max(ins), total=sum(ins), out_low=min(outs), out_high=max(outs), out_total=sum(outs))


def make_workload(
    num_seqs: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    *,
    vocab_size: int = 10_001,
    seed: int = 0,
    temperature: float = 0.6,
) -> Workload:
    """nano-vllm's benchmark workload: lengths uniform in the closed ranges, random token ids."""
    # zh: nano-vllm 的基准测试负载：长度在闭区间内均匀分布，token id 随机。
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    for name, (low, high) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, got {(low, high)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    # en: nano-vllm draws token ids in [0, 10000]; a smaller vocabulary caps them.
    # zh: nano-vllm 在 [0, 10000] 中抽取 token id；词表更小时以词表为上限。
    max_id = min(10_000, vocab_size - 1)
    prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(*input_len))] for _ in range(num_seqs)]
    output_lens = [rng.randint(*output_len) for _ in range(num_seqs)]
    return Workload(prompts, output_lens, temperature)

# %% [markdown] tags=["en"]
# ### The clock
#
# Both sides are timed with one clock, `Stopwatch`, which joins chapter 13's report helpers in
# `nanovllm.bench.report`. A GPU runs behind the host: the host queues kernels and moves on, so a
# clock that did not wait for the device's queued work before it starts and before it stops
# would time the queueing, not the work.

# %% [markdown] tags=["zh"]
# ### 计时器
#
# 两边用同一个计时器 `Stopwatch` 计时，它和第 13 章的报告函数一起放在 `nanovllm.bench.report` 里。GPU 的进度
# 落后于主机：主机把内核排进队列就继续往下走，所以计时器如果不在开始和停止之前都先等设备上排队的工作做完，
# 量到的就只是排队的时间，而不是工作本身。

# %% stopwatch
#| export bench.report
from __future__ import annotations

import time

import torch


class Stopwatch:
    """Wall-clock seconds of a ``with`` block, up to the end of the work it queued on ``device`` ("cuda", "cpu").

    A GPU runs behind the host: a clock that did not wait for it at both ends would time the queueing.
    """
    # zh: 一个 ``with`` 块的挂钟秒数，一直算到它排进 ``device``（"cuda"、"cpu"）队列的工作做完为止。
    # zh:
    # zh: GPU 跑在主机后面：两头都不等它的时钟，量到的只是排队的时间。

    def __init__(self, device: str) -> None:
        self.synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self.synchronize()
        self.started = time.perf_counter()
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: object) -> None:
        # en: A `with` block that raised has no time, and its device may not be able to wait.
        # zh: 抛出异常的 with 代码块不计时，而且它的设备可能已经无法等待（同步）。
        if error_type is None:
            self.synchronize()
            self.seconds = time.perf_counter() - self.started


# %% copy rates
#| export bench.report
import statistics
from dataclasses import dataclass


def measured_copy_rate(device: str) -> float:
    """Bytes per second of a large copy on ``device`` (bytes read + bytes written), measured now."""
    # zh: 在 ``device`` 上一次大拷贝的每秒字节数（读取的字节 + 写入的字节），现在测量。
    if device == "cuda":
        # en: It uses Triton's timer: imported only on a GPU.
        # zh: 用到 Triton 的计时器：只在 GPU 上导入。
        from nanovllm.bench.attention import copy_bandwidth

        return copy_bandwidth()
    source = torch.empty(1 << 28, dtype=torch.uint8)
    target = torch.empty_like(source)
    # en: Touch the pages before timing.
    # zh: 计时之前先把内存页都触碰一遍。
    target.copy_(source)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - began)
    return 2 * source.numel() / statistics.median(times)


@dataclass
class CopyRates:
    """The copy rate that bounds a benchmark, measured before its runs and after them. A card's rate moves from run to
    run (2.59 and 3.02 TB/s on one H100 within the hour, 3.8 to 4.3 on one H200): a share of the bound is quoted
    against the higher of the two, the stricter bound, and both are printed."""
    # zh: 给基准测试定上限的拷贝速率，在运行之前和之后各测一次。同一张卡的速率每次运行都会变（一块 H100 一小时之内
    # zh: 测出 2.59 和 3.02 TB/s，一块 H200 测出 3.8 到 4.3）：占上限的比例按两者中较高的那个（更严的上限）来算，
    # zh: 两个都打印出来。

    device: str
    before: float
    after: float | None = None

    @classmethod
    def before_runs(cls, device: str) -> CopyRates:
        return cls(device, measured_copy_rate(device))

    def after_runs(self) -> float:
        """Measure the rate again, now that the runs are done; the rate the bounds use."""
        # zh: 运行结束后再测一次速率；返回上限要用的速率。
        self.after = measured_copy_rate(self.device)
        return self.bound_rate

    @property
    def bound_rate(self) -> float:
        return max(self.before, self.after or 0.0)

    def report(self) -> dict[str, float | None]:
        return {"before": self.before, "after": self.after, "bound_rate": self.bound_rate}


# %% [markdown] tags=["en"]
# ### The peer: `transformers.generate`, measured fairly
#
# `generate` runs *static* batches: every row of a batch is padded to the longest prompt and
# decodes until the batch's longest request is done. Measuring it fairly takes three rules:
#
# 1. **Force the lengths.** `min_new_tokens == max_new_tokens`, so that an early EOS cannot make
#    `transformers` look faster (our engine runs with `ignore_eos=True`).
# 2. **Group by length.** Requests are sorted by requested output length (then prompt length)
#    and cut into batches of `batch_size`; each batch generates its longest request's count.
#    Sorting keeps the surplus small — this is the best a user of `generate` can do without
#    continuous batching, and on our H200 the sorted batches of 64 measured faster than one batch
#    of 256 (`--peer-batch-size` sets the size).
# 3. **Count only what was asked for.** The surplus tokens of the shorter requests in a batch
#    are the price of static batching: they take time but are not counted. The figure is
#    `workload.num_output_tokens / seconds`, the same numerator the engine gets.
#
# Both sides run the same model directory, device and dtype, with one untimed warm-up call.

# %% [markdown] tags=["zh"]
# ### 对照组：公平地测量 `transformers.generate`
#
# `generate` 运行的是*静态*批次：同一批次的每一行都要填充（padding）到最长的提示词，并一直解码到批次里最长的
# 请求结束。要公平地测量它，需要三条规则：
#
# 1. **强制长度：** 令 `min_new_tokens == max_new_tokens`，以免提前出现的 EOS 让 `transformers` 显得更快
#    （我们的引擎用 `ignore_eos=True` 运行）。
# 2. **按长度分组：** 请求按要求的输出长度（其次按提示词长度）排序，再切成大小为 `batch_size` 的批次；
#    每个批次生成其中最长请求所需的 token 数。排序让多余的 token 尽量少——这是 `generate` 的用户在没有连续批处理
#    （continuous batching）时能做到的最好情况；在我们的 H200 上，排好序的 64 个一批也确实比 256 个一批更快
#    （批大小由 `--peer-batch-size` 设定）。
# 3. **只计要求的 token：** 同一批次中较短请求多生成的 token 是静态批处理的代价：它们花了时间，但不计入。
#    指标是 `workload.num_output_tokens / 秒数`，分子与引擎一侧相同。
#
# 两边使用同一个模型目录、设备和数据类型，并各有一次不计时的预热调用。

# %% bench peer
#| export bench.engine
import time

import torch

from nanovllm.bench.report import Stopwatch


@dataclass(frozen=True)
class BenchResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def __str__(self) -> str:
        return _say_bench("{name}: {tokens} tokens in {seconds:.2f} s = {rate:,.1f} tok/s", name=self.name,
                          tokens=self.output_tokens, seconds=self.seconds, rate=self.tokens_per_s)


def peer_batches(workload: Workload, batch_size: int) -> list[list[int]]:
    """Request indices, sorted by (output length, prompt length) and cut into batches."""
    # zh: 请求的下标，按（输出长度，提示词长度）排序，再切成批次。
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(workload.prompts)), key=lambda i: (workload.output_lens[i], len(workload.prompts[i])))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def run_transformers(model: str, workload: Workload, *, device: str, dtype: torch.dtype,
                     batch_size: int = 64) -> BenchResult:
    """Time Hugging Face `generate` on the workload: sorted batches (peer_batches), left-padded, every
    row forced to its batch's longest output length."""
    # zh: 在负载上为 Hugging Face 的 `generate` 计时：排好序的批次（peer_batches），左侧填充，每一行都被强制
    # zh: 生成到它所在批次最长的输出长度。
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    pad = hf.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    sampling = {"do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0} \
        if workload.temperature > 0 else {"do_sample": False}

    def generate(rows: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(map(len, rows))
        # en: Left padding: every row's last prompt token sits in the same column.
        # zh: 左侧填充：每一行提示词的最后一个 token 都位于同一列。
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=pad, **sampling)
        if out.shape[1] - width != new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, {new_tokens} were forced")
        return out

    with torch.inference_mode():
        # en: A warm-up call, untimed.
        # zh: 预热调用，不计时。
        generate([workload.prompts[0][:8]], 2)
        with Stopwatch(device) as clock:
            for batch in peer_batches(workload, batch_size):
                generate([workload.prompts[i] for i in batch], max(workload.output_lens[i] for i in batch))
    return BenchResult(_say_bench("transformers generate (batches of {size})", size=batch_size), clock.seconds,
                       workload.num_output_tokens)

# %% [markdown] tags=["en"]
# ### The physical bound of the workload
#
# How fast *could* any engine run this workload on this GPU? Decode is memory-bound: every
# decode step must read all the weights the step uses (every layer's, and the LM head's) and
# the KV of every running sequence. Even with the best possible batching (all sequences decode
# together, so the weights are read once per step, `max(output) - 1` steps), sequence `i` with
# prompt `p` and output `o` reads, over its `o - 1` decode steps, the KV of `p + 1, …, p + o - 1`
# tokens. Prefill is compute-bound: `2 × parameters` FLOPs per prompt token plus the causal
# attention. The bound is the time to move those bytes at the copy bandwidth plus the time to do
# those FLOPs at the matmul rate, both measured in the same run:
#
# `bound = output tokens / (decode bytes / bandwidth + prefill FLOPs / FLOP rate)`
#
# No engine reaches it (kernels do not stream at copy speed, and a real schedule decodes fewer
# sequences at once), which is what makes "our fraction of it" an honest yardstick.

# %% [markdown] tags=["zh"]
# ### 负载的物理上限
#
# 在这块 GPU 上，任何引擎跑这个负载*最快*能有多快？decode 受显存带宽限制：每个 decode 步都必须读取这一步用到的全部
# 权重（每一层的，加上 LM head 的），以及每个运行中序列的 KV。即使批处理做到最好（所有序列一起 decode，于是每步只读
# 一遍权重，共 `max(output) - 1` 步），提示词长 `p`、输出长 `o` 的序列 `i` 在它的 `o - 1` 个 decode 步里也要读取
# `p + 1, …, p + o - 1` 个 token 的 KV。prefill 受算力限制：每个提示词 token 需要 `2 × 参数量` 次浮点运算，再加上
# 因果注意力。上限等于以拷贝带宽搬运这些字节的时间，加上以矩阵乘速率完成这些运算的时间，两者都在同一次运行中测得：
#
# `上限 = 输出 token 数 / (decode 字节数 / 带宽 + prefill 运算量 / 运算速率)`
#
# 没有引擎能达到它（内核的流式读取达不到拷贝速度，真实的调度也不会让所有序列同时 decode），正因如此，
# “我们达到了它的几成”才是一把诚实的尺子。

# %% bench bound
#| export bench.engine
from collections.abc import Callable
from typing import Any

# en: How many parameters layer `index`'s MLP has, when it is not the dense gated MLP: a model with other MLPs adds
# en: its rule (a mixture of experts does); a rule answers None for the layers it does not know.
# zh: 第 `index` 层的 MLP 不是稠密的门控 MLP 时，它有多少参数：MLP 不同的模型加上自己的规则（混合专家模型就会）；
# zh: 规则对它不认识的层返回 None。
MLP_RULES: list[Callable[[Any, int], int | None]] = []


def mlp_params(hf_config: Any, index: int) -> int:
    """Parameters of layer ``index``'s MLP: a rule's answer, else gate, up and down of intermediate_size."""
    # zh: 第 ``index`` 层 MLP 的参数量：有规则时用规则的答案，否则是 intermediate_size 的 gate、up 和 down。
    for rule in MLP_RULES:
        params = rule(hf_config, index)
        if params is not None:
            return params
    return 3 * hf_config.hidden_size * hf_config.intermediate_size


def layer_params(hf_config: Any, index: int = 0) -> int:
    """Parameters of decoder layer ``index`` (projections, MLP, norms; biases ignored)."""
    # zh: 第 ``index`` 个解码器层的参数量（各投影、MLP、归一化；忽略偏置）。
    hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return attention + mlp_params(hf_config, index) + 2 * hidden + 2 * head_dim


def layers_params(hf_config: Any) -> int:
    """Parameters of all the decoder layers."""
    # zh: 所有解码器层的参数量。
    return sum(layer_params(hf_config, index) for index in range(hf_config.num_hidden_layers))


def model_params(hf_config: Any) -> int:
    """All parameters: layers, embedding, LM head (once if tied), final norm."""
    # zh: 全部参数量：各层、嵌入、LM head（绑定时只算一次）、最后的归一化。
    embed = hf_config.vocab_size * hf_config.hidden_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return layers_params(hf_config) + embed * (1 if tied else 2) + hf_config.hidden_size


@dataclass(frozen=True)
class Bound:
    decode_bytes: float
    prefill_flops: float
    seconds: float
    tokens_per_s: float


def kv_token_bytes(hf_config: Any, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's keys and values in every layer: ``dtype_bytes`` per element, or with an 8-bit cache
    (kv_cache_dtype="fp8") one byte per element plus one float32 scale per KV head."""
    # zh: 一个 token 在每一层中的键和值的字节数：每个元素 ``dtype_bytes`` 字节；8 位缓存
    # zh: （kv_cache_dtype="fp8"）则是每个元素一个字节，再加每个 KV 头一个 float32 缩放因子。
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    row = head_dim + 4 if kv_cache_dtype == "fp8" else head_dim * dtype_bytes
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * row


def weight_bytes_per_step(hf_config: Any, dtype_bytes: int) -> int:
    """Weights a decode step reads: every layer and the LM head (the embedding reads one row per token)."""
    # zh: 一个 decode 步读取的权重：每一层和 LM head（嵌入每个 token 只读一行）。
    return (layers_params(hf_config) + hf_config.vocab_size * hf_config.hidden_size) * dtype_bytes


def workload_bound(
    workload: Workload, hf_config: Any, dtype_bytes: int, bandwidth: float, flops: float, kv_cache_dtype: str = "auto"
) -> Bound:
    """The fastest this workload can run: decode bytes at `bandwidth` B/s plus prefill FLOPs at `flops` FLOP/s
    (``kv_cache_dtype``: the KV cache the decode steps read, as `kv_token_bytes` counts it)."""
    # zh: 这个负载最快能跑多快：decode 的字节数按 `bandwidth` B/s，加上 prefill 的 FLOP 数按 `flops` FLOP/s
    # zh: （``kv_cache_dtype``：decode 步读取的 KV 缓存，按 `kv_token_bytes` 的方式计算）。
    layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    step_bytes = weight_bytes_per_step(hf_config, dtype_bytes)
    token_bytes = kv_token_bytes(hf_config, dtype_bytes, kv_cache_dtype)
    steps = max(workload.output_lens) - 1
    # en: Sequence i reads the KV of p+1 ... p+o-1 tokens: (o-1) * p + (o-1) * o / 2.
    # zh: 序列 i 读取 p+1 ... p+o-1 个 token 的 KV：(o-1) * p + (o-1) * o / 2。
    kv_tokens = sum((o - 1) * len(p) + (o - 1) * o // 2 for p, o in zip(workload.prompts, workload.output_lens,
                                                                         strict=True))
    decode_bytes = steps * step_bytes + kv_tokens * token_bytes
    prompt_tokens = sum(len(p) for p in workload.prompts)
    causal_pairs = sum(len(p) * (len(p) + 1) // 2 for p in workload.prompts)
    prefill_flops = 2 * model_params(hf_config) * prompt_tokens + 4 * layers * heads * head_dim * causal_pairs
    seconds = decode_bytes / bandwidth + prefill_flops / flops
    return Bound(decode_bytes, prefill_flops, seconds, workload.num_output_tokens / seconds)


# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "Qwen3-0.6B: {params:.3f} B parameters": "Qwen3-0.6B：{params:.3f} B 参数",
    "nano-vllm workload: decode reads {tb:.1f} TB, prefill {pflop:.2f} PFLOP -> at most {rate:,.0f} output tok/s "
    "on an H200":
        "nano-vllm 负载：decode 读取 {tb:.1f} TB，prefill {pflop:.2f} PFLOP -> 在 H200 上最多 {rate:,.0f} 输出 tok/s",
    "peer batch: {batch} (prompt, output)": "对照组批次：{batch}（提示词，输出）",
    "benchmark checks hold": "基准测试的检查成立",
    "qwen3-8b preset: {params:.2f} B parameters, {files} weight files":
        "qwen3-8b 预设：{params:.2f} B 参数，{files} 个权重文件",
    "Qwen3-0.6B: a decode step reads {gb:.2f} GB of weights": "Qwen3-0.6B：一个 decode 步读取 {gb:.2f} GB 权重",
    "prefill tokens": "prefill token",
    "peak blocks": "峰值占用块数",
    "one request, n=4": "一个请求，n=4",
    "4 identical requests": "4 个相同的请求",
    "the same prompt, later": "稍后再发同一提示词",
    "all exercise answers check out": "练习答案全部验证通过",
    "{date}, {card}: {command}": "{date}，{card}：{command}",
    "  its rates: {copy} TB/s copy, {flops} TFLOP/s bf16; its bound: {bound:,} tok/s":
        "  它测得的速率：拷贝 {copy} TB/s，bf16 {flops} TFLOP/s；它的上限：{bound:,} tok/s",
    "forked: n = 4": "分叉：n = 4",
    "independent: 4 requests per prompt": "独立：每个提示词 4 个请求",
    "forked / independent": "分叉 / 独立",
    "{when}: {running} requests running, {waiting} waiting, {used} of {blocks} KV blocks in use":
        "{when}：{running} 个请求在运行，{waiting} 个在等待，KV 块用了 {used}/{blocks} 个",
    "before the first step": "第一步之前",
    "after the first step": "第一步之后",
})

# %%
from types import SimpleNamespace

from nanovllm.bench.engine import layer_params, model_params, workload_bound

# en: Qwen3-0.6B's shapes: about 0.6 billion parameters (the name says so).
# zh: Qwen3-0.6B 的形状：约 6 亿参数（名字就是这么来的）。
qwen3_06b = SimpleNamespace(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
print(say("Qwen3-0.6B: {params:.3f} B parameters", params=model_params(qwen3_06b) / 1e9))
assert 0.59e9 < model_params(qwen3_06b) < 0.61e9
# en: A one-sequence check by hand: prompt 3, output 3 -> 2 decode steps reading the KV of 4 and 5 tokens.
# zh: 手算一个单序列的例子：提示词 3、输出 3 -> 2 个 decode 步，分别读取 4 个和 5 个 token 的 KV。
one = make_workload(1, (3, 3), (3, 3))
b = workload_bound(one, qwen3_06b, 2, bandwidth=1.0, flops=float("inf"))
kv_token = 2 * 28 * 8 * 128 * 2
assert b.decode_bytes == 2 * (28 * layer_params(qwen3_06b) + 151936 * 1024) * 2 + (4 + 5) * kv_token
# en: The nano-vllm workload on an H200, at the copy rate and bf16 matmul rate that a recorded run of the benchmark
# en: measured. The rates vary from run to run, so each run holds its engine to the bound of its own rates.
# zh: nano-vllm 负载在 H200 上的上限，用的是记录下来的一次基准测试运行测得的拷贝速率和 bf16 矩阵乘法速率。
# zh: 这些速率每次运行都不一样，所以每次运行都用它自己测得的速率算出的上限来衡量引擎。
from nanovllm.book.recorded import recorded

gpu_runs = recorded("19_benchmark")
rates = gpu_runs["bound"]
h200 = workload_bound(make_workload(), qwen3_06b, 2, bandwidth=rates.figures["copy TB/s"] * 1e12,
                      flops=rates.figures["bf16 TFLOP/s"] * 1e12)
print(say("{date}, {card}: {command}", date=rates.date, card=rates.card, command=rates.command))
print(say("  its rates: {copy} TB/s copy, {flops} TFLOP/s bf16; its bound: {bound:,} tok/s",
          copy=rates.figures["copy TB/s"], flops=rates.figures["bf16 TFLOP/s"], bound=rates.figures["bound tokens/s"]))
print(say("nano-vllm workload: decode reads {tb:.1f} TB, prefill {pflop:.2f} PFLOP -> at most {rate:,.0f} output tok/s "
          "on an H200", tb=h200.decode_bytes / 1e12, pflop=h200.prefill_flops / 1e15, rate=h200.tokens_per_s))
# en: That run printed its bound from the rates it measured; the rates as it printed them give it within 0.1 %.
# zh: 那次运行用它测得的速率打印了上限；按它打印出来的（四舍五入后的）速率计算，结果与之相差不到 0.1%。
assert abs(h200.tokens_per_s / rates.figures["bound tokens/s"] - 1) < 0.001

# %% [markdown] tags=["en"]
# ### Our side, and the command
#
# The engine side is three lines of the public API. `python -m nanovllm.bench` prints the
# workload, each side's figure and their ratio, measured in the same run. On a GPU it also
# measures the copy bandwidth and the bf16 matmul rate and prints the bound above and our
# fraction of it. With `--preset nano-vllm` and no `--model`, it builds Qwen3-0.6B's shapes with
# random bf16 weights (chapter 06's `build_tiny_model` with overrides) in a temporary folder:
# no checkpoint is needed, and the speed of a model depends on its shapes, not on its weights.
# `--no-peer` skips `transformers` (a few minutes on this workload).
#
# **Tensor parallelism.** `--tensor-parallel-size N` (chapter 17) measures the engine on N GPUs
# and then, in the same invocation and on the same workload, on one GPU, and prints both and
# their ratio (`--no-tp1` skips the second run); the one-GPU engine is then the peer, and the
# N-GPU figure is held to N times one GPU's bound. `--preset qwen3-8b` runs the same workload on
# a Qwen3-8B-shaped model whose 16 GB of bf16 weights are drawn directly on each GPU
# (`load_format="dummy"`, chapter 06) instead of being written to disk and read back; it has no
# `transformers` peer, since there are no weights to give it.
#
# **An 8-bit KV cache.** `--kv-cache-dtype both` (the same as `auto fp8`) runs the engine once with
# the model's dtype in the KV cache and once with float8 e4m3 (chapter 24), in one invocation, and
# prints their ratio. Each run is held to its own bound: with `fp8` the decode steps read one byte
# per cached element plus a 4-byte scale per token and KV head (`kv_token_bytes`), so the bound
# itself moves.
#
# **Runs that take turns.** Two runs one after the other can differ by run order alone: a card
# warms up, or slows down, over an invocation. `--rounds N` runs the engines N times, taking turns
# (A, B, A, B, ...), and compares their medians.

# %% [markdown] tags=["zh"]
# ### 我们这一侧，以及命令行
#
# 引擎一侧就是公开 API 的三行代码。`python -m nanovllm.bench` 打印负载、两侧各自的数字，以及同一次运行中测得的比值。
# 在 GPU 上，它还会测量拷贝带宽和 bf16 矩阵乘速率，打印上面的上限以及我们达到了它的几成。使用 `--preset nano-vllm`
# 且不给 `--model` 时，它会在临时目录里按 Qwen3-0.6B 的形状构建一个随机 bf16 权重的模型（第 06 章的
# `build_tiny_model` 加上覆盖参数）：不需要任何检查点，模型的速度取决于形状，而不取决于权重。`--no-peer` 跳过
# `transformers`（在这个负载上要跑几分钟）。
#
# **张量并行。** `--tensor-parallel-size N`（第 17 章）先用 N 块 GPU 测引擎，再在同一次调用中、用同样的负载用一块
# GPU 测，打印两者及其比值（`--no-tp1` 跳过第二次运行）；这时单 GPU 的引擎就是对照组，而 N 块 GPU 的数字对照的是
# 单 GPU 上限的 N 倍。`--preset qwen3-8b` 在 Qwen3-8B 形状的模型上跑同样的负载，它 16 GB 的 bf16 权重直接在每块 GPU
# 上生成（`load_format="dummy"`，第 06 章），而不是先写到磁盘再读回来；它没有 `transformers` 对照组，因为根本没有
# 权重可以交给它。
#
# **8 位 KV 缓存。** `--kv-cache-dtype both`（等同于 `auto fp8`）在一次调用中把引擎跑两遍：一遍 KV 缓存用模型的
# 数据类型，一遍用 float8 e4m3（第 24 章），并打印两者的比值。每次运行都对照它自己的上限：用 `fp8` 时，decode 步
# 每个缓存元素只读一个字节，外加每个 token、每个 KV 头一个 4 字节的缩放因子（`kv_token_bytes`），所以上限本身也
# 移动了。
#
# **轮流跑。** 先后跑的两次运行，可能只因为先后顺序就有差别：一张卡在一次调用中会变热，或者变慢。`--rounds N` 让各个
# 引擎轮流跑 N 遍（A、B、A、B……），比较的是它们的中位数。

# %% bench models, 8B
#| export bench.models
from pathlib import Path
from typing import Any

QWEN3_8B_SHAPES: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}


def weightless_model_dir(target: Path, config_class: Any, shapes: dict[str, Any], architecture: str) -> Path:
    """A model directory at ``target`` with ``shapes`` (a ``config_class`` config, bfloat16) and no weights, to run
    with ``load_format="dummy"``: the weights are drawn on each GPU instead of written to disk and read back."""
    # zh: 在 ``target`` 建一个具有 ``shapes``（一个 ``config_class`` config，bfloat16）、没有权重的模型目录，
    # zh: 用 ``load_format="dummy"`` 运行：权重在每块 GPU 上抽取，而不是写到磁盘再读回来。
    import shutil

    from transformers import Qwen3Config

    from nanovllm.book.tiny_models import build_tiny_model

    # en: The tiny model's tokenizer and EOS ids: the prompts are token ids anyway.
    # zh: 只借用小模型的分词器和 EOS id：反正提示词本来就是 token id。
    tiny = build_tiny_model("qwen3")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, target / name)
    ids = Qwen3Config.from_pretrained(tiny)
    config = config_class(**shapes, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id, bos_token_id=None,
                          architectures=[architecture])
    config.dtype = "bfloat16"
    config.save_pretrained(target)
    return target


def qwen3_8b_shapes(path: str | None = None) -> Path:
    """A model directory with Qwen3-8B's shapes and no weights (16 GB in bf16, drawn on the GPU)."""
    # zh: 一个形状与 Qwen3-8B 相同、没有权重的模型目录（bf16 下 16 GB，在 GPU 上抽取）。
    import tempfile

    from transformers import Qwen3Config

    target = Path(path or f"{tempfile.gettempdir()}/nanovllm-qwen3-8b-shapes")
    return weightless_model_dir(target, Qwen3Config, QWEN3_8B_SHAPES, "Qwen3ForCausalLM")

# %% bench engine
#| export bench.engine
import argparse
import gc
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from nanovllm.bench.models import qwen3_06b_random, qwen3_8b_shapes
from nanovllm.bench.report import CopyRates, report_header, write_report
from nanovllm.engine.model_runner import kv_block_bytes, kv_cache_torch_dtype


def matmul_flops(n: int = 8192) -> float:
    """bf16 matmul FLOP/s on an n x n x n product, measured now."""
    # zh: n x n x n 乘积上 bf16 矩阵乘法的 FLOP/s，现在测量。
    from nanovllm.bench.attention import time_ms

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (time_ms(lambda: a @ b) * 1e-3)


@contextmanager
def watch_calls(obj: Any, method: str, record: Callable[[float, Any], None]) -> Iterator[None]:
    """While inside, each call of ``obj.method`` also hands ``record`` its wall seconds and what it returned (None
    when it raised): the benchmarks' one way to look into the engine's steps and launches without changing them."""
    # zh: 在块内，每次调用 ``obj.method`` 时，还把它的挂钟秒数和返回值（抛出异常时为 None）交给 ``record``：
    # zh: 这是各基准测试窥看引擎的步和启动、而又不改变它们的唯一方式。
    inner = getattr(obj, method)

    def watched(*args: Any, **kwargs: Any) -> Any:
        began, result = time.perf_counter(), None
        try:
            result = inner(*args, **kwargs)
            return result
        finally:
            record(time.perf_counter() - began, result)

    # en: An instance attribute in front of the class's method; on the way out, what stood there before (another
    # en: watcher's, when they nest) or nothing.
    # zh: 一个挡在类方法前面的实例属性；离开时恢复原来的样子（嵌套时是外层观察者的那个），原来没有就删掉。
    own = vars(obj).get(method)
    setattr(obj, method, watched)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, method)
        else:
            setattr(obj, method, own)


def run_engine(model: str, workload: Workload, *, breakdown: dict | None = None, **config: object) -> BenchResult:
    """Time `LLM.generate` on the workload (config: `LLM` keyword arguments).

    breakdown: a dict that receives the seconds and steps of the engine's steps, per kind (prefill, decode).
    """
    # zh: 在负载上为 `LLM.generate` 计时（config：`LLM` 的关键字参数）。
    # zh:
    # zh: breakdown：一个字典，按种类（prefill、decode）接收引擎各步的秒数和步数。
    from nanovllm.llm import LLM

    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    config.setdefault("max_model_len", max(4096, longest))
    llm = LLM(model, **config)
    device = llm.config.device
    # en: A warm-up call, untimed.
    # zh: 预热调用，不计时。
    llm.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)
    watching = nullcontext()
    if breakdown is not None:
        breakdown["kv_cache"] = kv_cache_line(llm.config)

        def add_step(seconds: float, step: tuple[list, int, bool] | None) -> None:
            # en: A step returns once the step it reports has run on the GPU (with async scheduling, after
            # en: queueing the next one), so its wall time is that step's, GPU included.
            # zh: 一步在它所报告的那一步于 GPU 上算完之后才返回（异步调度时，是在把下一步排进队列之后），
            # zh: 所以它的墙钟时间就是那一步的时间，包括 GPU 的时间。
            if step is not None:
                _, num_tokens, is_prefill = step
                kind = "prefill" if is_prefill else "decode"
                breakdown[kind] = breakdown.get(kind, 0.0) + seconds
                breakdown[kind + "_steps"] = breakdown.get(kind + "_steps", 0) + (num_tokens > 0)

        # en: generate() calls _step(), the step() that reports finished sequences rather than pairs.
        # zh: generate() 调用的是 _step()，即返回已结束序列本身（而非二元组）的 step()。
        watching = watch_calls(llm, "_step", add_step)
    try:
        with watching, Stopwatch(device) as clock:
            outputs = llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
    finally:
        # en: Free the KV cache (most of the GPU) for whatever runs next, such as the transformers peer.
        # zh: 释放 KV 缓存（占了 GPU 的大部分），留给接下来运行的东西，比如 transformers 对照组。
        tp = llm.config.tensor_parallel_size
        llm.exit()
        del llm
        # en: The graphs' memory pool goes with the last reference to the runner.
        # zh: CUDA graph 的显存池随模型执行器的最后一个引用一起释放。
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    made = [len(o["token_ids"]) for o in outputs]
    if made != workload.output_lens:
        raise RuntimeError("the engine did not produce the requested number of tokens for every sequence")
    return BenchResult(_say_bench("nano-vllm (this book), TP={tp}", tp=tp), clock.seconds, workload.num_output_tokens)


def kv_cache_line(config: Any) -> str:
    """The engine's `kv_cache_summary`, in the reading language: the KV pool its runner sized."""
    # zh: 引擎的 `kv_cache_summary`，用阅读语言表示：执行器确定下来的 KV 块池。
    dtype, block_size, blocks = kv_cache_torch_dtype(config), config.kvcache_block_size, config.num_kvcache_blocks
    block = kv_block_bytes(config.hf_config, block_size, dtype, config.tensor_parallel_size)
    return _say_bench("KV cache: {blocks:,} blocks x {block_size} tokens = {tokens:,} tokens, {dtype}, "
                      "{block_mib:.2f} MiB a block, {gib:.2f} GiB{per_rank}", blocks=blocks, block_size=block_size,
                      tokens=blocks * block_size, dtype=str(dtype).removeprefix("torch."), block_mib=block / 2**20,
                      gib=blocks * block / 2**30,
                      per_rank=_say_bench(" per rank") if config.tensor_parallel_size > 1 else "")


def print_breakdown(result: BenchResult, breakdown: dict[str, Any]) -> None:
    """Where an engine run's time went: prefill and decode steps, and generate's loop outside them; its KV pool."""
    # zh: 一次引擎运行的时间花在了哪里：prefill 步和 decode 步，以及 generate 在它们之外的循环；还有它的 KV 块池。
    if "kv_cache" in breakdown:
        print(f"  {breakdown['kv_cache']}")
    outside = result.seconds - breakdown.get("prefill", 0.0) - breakdown.get("decode", 0.0)
    print(_say_bench("  in LLMEngine.step: prefill {prefill:.2f} s in {prefill_steps} steps, decode {decode:.2f} s in "
                     "{decode_steps} steps; outside it (generate's loop): {outside:.2f} s",
                     prefill=breakdown.get("prefill", 0), prefill_steps=breakdown.get("prefill_steps", 0),
                     decode=breakdown.get("decode", 0), decode_steps=breakdown.get("decode_steps", 0), outside=outside))


# en: The other benchmarks of the same command: a flag, and the module whose main() runs it with the other arguments
# en: (later chapters add theirs).
# zh: 同一条命令的其他基准测试：一个开关，以及用其余参数运行它的 main() 所在的模块（后面的章节会加上它们自己的）。
OTHER_BENCHMARKS: dict[str, str] = {"--latency": "nanovllm.bench.latency"}


def build_parser() -> argparse.ArgumentParser:
    """The throughput benchmark's command line (the other benchmarks of OTHER_BENCHMARKS have their own)."""
    # zh: 吞吐量基准测试的命令行（OTHER_BENCHMARKS 中的其他基准测试各有自己的命令行）。
    others = ", ".join(f"python -m nanovllm.bench {flag} [--help]" for flag in OTHER_BENCHMARKS)
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench", description="Throughput: engine vs transformers.",
                                     epilog=f"Other benchmarks: {others} (--latency: decode-step latency at batches "
                                     "1, 4, 16 and 64, against each step's bound)")
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: nano-vllm on CUDA, cpu otherwise")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--input-len", type=int, nargs=2, metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("LOW", "HIGH"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--peer-batch-size", type=int, help="transformers batch size (default: 64, all on CPU)")
    parser.add_argument("--no-engine", action="store_true", help="measure transformers only")
    parser.add_argument("--no-peer", action="store_true", help="measure the engine only")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--compile-small-ops", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                        help="overlap scheduling with the GPU (auto: on for CUDA)")
    parser.add_argument("--parallel-sampling", type=int, metavar="N",
                        help="instead: the first 64 prompts with N forked samples vs N independent requests each")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="N > 1: the engine on N GPUs, and on one GPU in the same invocation, with their ratio")
    parser.add_argument("--no-tp1", action="store_true", help="with --tensor-parallel-size N: skip the TP=1 run")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="run the engines N times, taking turns, and compare their medians (default 1)")
    parser.add_argument("--attention-backend", nargs="+", default=["auto"], metavar="NAME",
                        help="auto, torch, triton or flash-attn; several: one engine run each, in this invocation, "
                             "with their ratios to the first")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8", "both"],
                        metavar="DTYPE", help="auto or fp8; several, or both (= auto fp8): one engine run "
                        "each, in this invocation, each held to its own bound, with their ratios to the first")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    return parser


@dataclass
class BenchSetup:
    """What a throughput run resolved from its command line: the model, its config, the KV cache dtypes to
    compare and the workload."""
    # zh: 一次吞吐量运行从命令行中确定下来的东西：模型、它的 config、要比较的 KV 缓存 dtype，以及负载。

    model: str
    config: Any
    load_format: str
    kv_dtypes: list[str]
    workload: Workload


def resolve_setup(args: argparse.Namespace) -> BenchSetup:
    """The model, config and workload of ``args``; refuses (ValueError) what this machine or the flags cannot run,
    before any run."""
    # zh: ``args`` 的模型、config 和负载；在任何运行之前，拒绝（ValueError）这台机器或这些选项无法运行的东西。
    from nanovllm.book.smollm2 import smollm2_dir
    from nanovllm.config import Config

    if args.model:
        model = args.model
    elif args.preset == "nano-vllm":
        model = str(qwen3_06b_random())
    elif args.preset == "qwen3-8b":
        model = str(qwen3_8b_shapes())
    else:
        model = str(smollm2_dir())
    load_format = "dummy" if args.preset == "qwen3-8b" and not args.model else "auto"
    config = Config.from_kwargs(model, device=args.device, dtype=args.dtype, load_format=load_format,
                                tensor_parallel_size=args.tensor_parallel_size)
    kv_dtypes = list(dict.fromkeys(kv for name in args.kv_cache_dtype
                                   for kv in (("auto", "fp8") if name == "both" else (name,))))
    # en: Refuse a backend this machine cannot run before any run.
    # zh: 在任何一次运行之前，就拒绝这台机器跑不了的注意力后端。
    for backend in args.attention_backend:
        # en: And a KV cache dtype it cannot run.
        # zh: 以及它跑不了的 KV 缓存数据类型。
        for kv in kv_dtypes:
            Config.from_kwargs(model, device=args.device, dtype=args.dtype, attention_backend=backend,
                               load_format=load_format, kv_cache_dtype=kv)
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if len(args.attention_backend) > 1 and args.tensor_parallel_size > 1:
        raise ValueError("compare attention backends or tensor-parallel sizes, not both in one invocation")
    compares_tp = args.tensor_parallel_size > 1 and not args.no_tp1
    if len(kv_dtypes) > 1 and (len(args.attention_backend) > 1 or compares_tp):
        raise ValueError("compare KV cache dtypes on their own: one attention backend, and --no-tp1 with "
                         "--tensor-parallel-size")
    preset = dict(PRESETS[args.preset or ("nano-vllm" if config.device == "cuda" else "cpu")])
    for key in ("num_seqs", "input_len", "output_len"):
        if getattr(args, key) is not None:
            preset[key] = tuple(getattr(args, key)) if key != "num_seqs" else args.num_seqs
    workload = make_workload(**preset, vocab_size=config.hf_config.vocab_size, seed=args.seed)
    return BenchSetup(model, config, load_format, kv_dtypes, workload)


def run_engines(args: argparse.Namespace, setup: BenchSetup,
                report: dict[str, Any]) -> tuple[dict[str, BenchResult], dict[str, str]]:
    """The engine runs the flags ask for, each printed with where its time went (breakdowns into ``report``); the
    runs by name, and the KV cache dtype of each (its own bound)."""
    # zh: 按选项要求运行引擎，每次运行都打印时间花在了哪里（明细写进 ``report``）；返回按名字排列的各次运行，
    # zh: 以及每次运行的 KV 缓存 dtype（它自己的上限）。
    config, kv_dtypes, results, kv_of = setup.config, setup.kv_dtypes, {}, {}
    tp = args.tensor_parallel_size
    switch = {"auto": "auto", "on": True, "off": False}
    settings = {"device": config.device, "dtype": config.dtype, "enforce_eager": args.enforce_eager,
                "compile_small_ops": switch[args.compile_small_ops], "load_format": setup.load_format,
                "async_scheduling": switch[args.async_scheduling]}
    # en: The N-GPU engine first: its ranks leave the GPUs empty for the one-process engine after it.
    # zh: 先跑 N 块 GPU 的引擎：它的各个 rank 退出后，GPU 就空出来留给之后的单进程引擎。
    # en: Several attention backends (or KV cache dtypes): one run each, on one GPU, the first being the one the
    # en: others are compared to.
    # zh: 多个注意力后端（或多种 KV 缓存数据类型）：每个跑一次，都在一块 GPU 上；第一个是其余各项的比较对象。
    first = args.attention_backend[0]
    runs = [(tp, first, kv_dtypes[0]), (1, first, kv_dtypes[0])] if tp > 1 and not args.no_tp1 else \
        [(tp, name, kv_dtypes[0]) for name in args.attention_backend] + [(tp, first, kv) for kv in kv_dtypes[1:]]
    # en: With --rounds N the runs take turns N times: a card that warms up or slows down over the invocation then
    # en: weighs on every run alike, and each is held to its median.
    # zh: 给了 --rounds N 时，各次运行轮流跑 N 遍：一张卡在这次调用中变热或变慢，对每次运行的影响都一样，每次运行都按
    # zh: 它的中位数来算。
    rounds: dict[str, list[BenchResult]] = {}
    for i, (size, backend, kv) in [*enumerate(runs)] * args.rounds:
        key = "engine" if i == 0 else "engine_tp1" if size != tp else f"engine_{backend}" \
            if kv == kv_dtypes[0] else f"engine_kv_{kv}"
        breakdown: dict[str, Any] = {}
        results[key] = run_engine(setup.model, setup.workload, tensor_parallel_size=size, attention_backend=backend,
                                  kv_cache_dtype=kv, breakdown=breakdown, **settings)
        if len(args.attention_backend) > 1:
            results[key] = replace(results[key], name=_say_bench("{name}, attention {backend}", name=results[key].name,
                                                                 backend=backend))
        if len(kv_dtypes) > 1:
            results[key] = replace(results[key], name=_say_bench("{name}, kv cache {kv}", name=results[key].name,
                                                                 kv=kv))
        kv_of[key] = kv
        rounds.setdefault(key, []).append(results[key])
        print(results[key])
        print_breakdown(results[key], breakdown)
        suffix = f"_{backend}" if key.startswith("engine_") and size == tp and kv == kv_dtypes[0] else \
            f"_kv_{kv}" if kv != kv_dtypes[0] else ""
        report[f"breakdown_tp{size}{suffix}"] = breakdown
    for key, measured in rounds.items() if args.rounds > 1 else ():
        results[key] = sorted(measured, key=lambda result: result.tokens_per_s)[len(measured) // 2]
        report[f"rounds_{key}"] = [result.tokens_per_s for result in measured]
        print(_say_bench("{name}: the median of {count} runs, taking turns: {rate:,.1f} tok/s ({rates})",
                         name=results[key].name, count=len(measured), rate=results[key].tokens_per_s,
                         rates=", ".join(f"{result.tokens_per_s:,.1f}" for result in measured)))
    return results, kv_of


def print_ratios(args: argparse.Namespace, setup: BenchSetup, results: dict[str, BenchResult],
                 report: dict[str, Any]) -> None:
    """Each comparison the invocation made, as a ratio of two runs measured in it."""
    # zh: 这次调用所做的每一项比较，表示为其中测得的两次运行之比。
    tp, first, kv_dtypes = args.tensor_parallel_size, args.attention_backend[0], setup.kv_dtypes
    if "engine" in results and "peer" in results:
        report["ratio"] = results["engine"].tokens_per_s / results["peer"].tokens_per_s
        print(_say_bench("engine / transformers: {ratio:.2f}x", ratio=report["ratio"]))
    if "engine" in results and "engine_tp1" in results:
        report["ratio_tp"] = results["engine"].tokens_per_s / results["engine_tp1"].tokens_per_s
        print(_say_bench("{faster} / {slower}: {ratio:.2f}x (same workload, same invocation)", faster=f"TP={tp}",
                         slower="TP=1", ratio=report["ratio_tp"]))
    for backend in args.attention_backend[1:]:
        if f"engine_{backend}" in results:
            ratio = results[f"engine_{backend}"].tokens_per_s / results["engine"].tokens_per_s
            report[f"ratio_{backend}"] = ratio
            print(_say_bench("{faster} / {slower}: {ratio:.2f}x (same workload, same invocation)",
                             faster=f"attention_backend={backend}", slower=first, ratio=ratio))
    for kv in kv_dtypes[1:]:
        if f"engine_kv_{kv}" in results:
            ratio = results[f"engine_kv_{kv}"].tokens_per_s / results["engine"].tokens_per_s
            report[f"ratio_kv_{kv}"] = ratio
            print(_say_bench("{faster} / {slower}: {ratio:.2f}x (same workload, same invocation)",
                             faster=f"kv_cache_dtype={kv}", slower=kv_dtypes[0], ratio=ratio))


def print_bounds(args: argparse.Namespace, setup: BenchSetup, results: dict[str, BenchResult], kv_of: dict[str, str],
                 report: dict[str, Any], rates: CopyRates) -> None:
    """On a GPU: the workload's bound from the copy rate (``rates``: measured before the runs, and now again; the
    higher) and the matmul rate measured now, and each run's share of the bound of its KV cache dtype (``kv_of``)."""
    # zh: 在 GPU 上：由拷贝速率（``rates``：运行前测过一次，现在再测一次，取较高者）和现在测得的矩阵乘法速率算出负载的
    # zh: 上限，以及每次运行占其 KV 缓存 dtype（``kv_of``）所对应上限的比例。
    config, workload, kv_dtypes, tp = setup.config, setup.workload, setup.kv_dtypes, args.tensor_parallel_size
    bandwidth, flops = rates.after_runs(), matmul_flops()
    report["copy_rate"] = rates.report()
    print(_say_bench("copy rate, measured: {before:.2f} TB/s before the runs, {after:.2f} after; the bound uses the "
                     "higher", before=rates.before / 1e12, after=rates.after / 1e12))
    bounds = {}
    for kv in dict.fromkeys([*kv_dtypes, *(kv_of[key] for key in results)]):
        # en: Each KV cache dtype has its own bound: an 8-bit cache reads half the KV bytes.
        # zh: 每种 KV 缓存数据类型都有自己的上限：8 位缓存读取的 KV 字节只有一半（第 24 章）。
        bound = bounds[kv] = workload_bound(workload, config.hf_config, config.torch_dtype.itemsize, bandwidth,
                                            flops, kv_cache_dtype=kv)
        name = _say_bench("bound (kv cache {kv})", kv=kv) if len(kv_dtypes) > 1 else _say_bench("bound")
        print(_say_bench("{bound}: decode reads {tb:.2f} TB at {bandwidth:.2f} TB/s (copy, measured) + prefill "
                         "{pflop:.3f} PFLOP at {tflops:.0f} TFLOP/s (bf16 matmul, measured) = {seconds:.2f} s -> "
                         "{rate:,.0f} tok/s", bound=name, tb=bound.decode_bytes / 1e12, bandwidth=bandwidth / 1e12,
                         pflop=bound.prefill_flops / 1e15, tflops=flops / 1e12, seconds=bound.seconds,
                         rate=bound.tokens_per_s))
        report["bound" if kv == kv_dtypes[0] else f"bound_kv_{kv}"] = {
            "tokens_per_s": bound.tokens_per_s, "decode_bytes": bound.decode_bytes, "bandwidth": bandwidth,
            "matmul_flops": flops}
    for key, result in results.items():
        # en: N GPUs read N times as fast: an engine on N GPUs is held to N times one GPU's bound.
        # zh: N 块 GPU 的读取速度是 N 倍：用 N 块 GPU 的引擎，对照的是单 GPU 上限的 N 倍。
        gpus = tp if key == "engine" else 1
        fraction = result.tokens_per_s / (gpus * bounds[kv_of[key]].tokens_per_s)
        print(_say_bench("{name}: {fraction:.1%} of the bound{gpus}{kv}", name=result.name, fraction=fraction,
                         gpus=_say_bench(" of {gpus} GPUs", gpus=gpus) if gpus > 1 else "",
                         kv=_say_bench(" (kv cache {kv})", kv=kv_of[key]) if len(kv_dtypes) > 1 else ""))
        report[key]["fraction_of_bound"] = fraction


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for flag, module in OTHER_BENCHMARKS.items():
        if flag in argv:
            return importlib.import_module(module).main([arg for arg in argv if arg != flag])
    args = build_parser().parse_args(argv)
    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError

    try:
        setup = resolve_setup(args)
    except (TypeError, ValueError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model, config, workload = setup.model, setup.config, setup.workload
    print(_say_bench("model: {model} on {device} ({dtype})", model=model, device=config.device, dtype=config.dtype))
    print(_say_bench("workload: {workload}", workload=workload.describe()))
    report = report_header("python -m nanovllm.bench", argv, config.device)
    report |= {"model": model, "workload": workload.describe()}
    if args.parallel_sampling:
        from nanovllm.bench.parallel_sampling import compare_parallel_sampling, parallel_sampling_report

        runs = compare_parallel_sampling(model, workload.prompts[:64], workload.output_lens[:64],
                                         args.parallel_sampling, device=config.device, dtype=config.dtype)
        report["parallel_sampling"] = parallel_sampling_report(runs)
        write_report(report, args.out)
        return 0
    # en: The copy rate that bounds the runs is measured before them and after them (`print_bounds`).
    # zh: 给这些运行定上限的拷贝速率，在运行之前和之后各测一次（`print_bounds`）。
    rates = CopyRates.before_runs(config.device) if config.device == "cuda" else None
    results, kv_of = ({}, {}) if args.no_engine else run_engines(args, setup, report)
    # en: The KV cache dtype of each run: its own bound (transformers keeps the model's dtype).
    # zh: 每次运行的 KV 缓存数据类型，决定它自己的上限（transformers 保持模型的数据类型）。
    kv_of["peer"] = "auto"
    tp = args.tensor_parallel_size
    peer_skipped = _say_bench("the model has no weights (load_format='dummy')") if setup.load_format == "dummy" else \
        _say_bench("--tensor-parallel-size {tp}: the TP=1 engine is the peer", tp=tp) if tp > 1 else None
    if not args.no_peer and peer_skipped:
        print(_say_bench("transformers peer skipped: {why}", why=peer_skipped))
    elif not args.no_peer:
        batch_size = args.peer_batch_size or (64 if config.device == "cuda" else len(workload.prompts))
        results["peer"] = run_transformers(model, workload, device=config.device, dtype=config.torch_dtype,
                                           batch_size=batch_size)
        print(results["peer"])
    for key, result in results.items():
        report[key] = {"name": result.name, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s}
    print_ratios(args, setup, results, report)
    if rates is not None:
        print_bounds(args, setup, results, kv_of, report, rates)
    write_report(report, args.out)
    return 0


# %% bench entry point
#| export bench.__main__
"""``python -m nanovllm.bench``: the engine's throughput benchmark (`nanovllm.bench.engine`)."""
# zh: ``python -m nanovllm.bench``：引擎的吞吐量基准测试（`nanovllm.bench.engine`）。

import sys

from nanovllm.bench.engine import main

# en: A notebook also runs this code as __main__; only a real `python -m nanovllm.bench` should act.
# zh: notebook 同样以 __main__ 身份运行这段代码；只有真正的 `python -m nanovllm.bench` 才应执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())

# %% [markdown] tags=["en"]
# ### See it
#
# A miniature workload on the tiny Llama: the workload is reproducible, and the peer's batches
# group similar lengths. Timings on a shared CPU are only indicative; the page shows them but
# never asserts them.

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# 在小 Llama 上跑一个迷你负载：负载可以复现，对照组的批次把长度相近的请求放在一起。共享 CPU 上的计时只供参考；
# 页面会显示它们，但从不对它们做断言。

# %%
from nanovllm.bench.engine import make_workload, peer_batches, run_transformers

mini = make_workload(6, (4, 24), (2, 12), vocab_size=config.hf_config.vocab_size, seed=1)
print(mini.describe())
for batch in peer_batches(mini, batch_size=3):
    print(say("peer batch: {batch} (prompt, output)",
              batch=[(len(mini.prompts[i]), mini.output_lens[i]) for i in batch]))
print(run_transformers(str(tiny), mini, device="cpu", dtype=torch.float32, batch_size=3))

# %% [markdown] tags=["en"]
# ### Check it

# %% [markdown] tags=["zh"]
# ### 验证

# %%
import random

# en: Same seed, same workload.
# zh: 种子相同，负载就相同。
assert make_workload(6, (4, 24), (2, 12), vocab_size=512, seed=1) == mini
assert make_workload(6, (4, 24), (2, 12), vocab_size=512, seed=2) != mini
assert all(4 <= len(p) <= 24 for p in mini.prompts) and all(2 <= n <= 12 for n in mini.output_lens)
# en: Token ids stay inside the vocabulary.
# zh: token id 不会超出词表。
assert max(max(p) for p in mini.prompts) < 512
assert all(sp.ignore_eos and sp.max_tokens == n for sp, n in zip(mini.sampling_params(), mini.output_lens, strict=True))

# en: Draw for draw, the workload of nano-vllm's bench.py (written here with the global `random`).
# zh: 逐次抽取都与 nano-vllm 的 bench.py 一致（这里用全局 `random` 把它的写法重写一遍）。
random.seed(0)
theirs = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
their_lens = [random.randint(100, 1024) for _ in range(256)]
# en: Qwen3's vocabulary size.
# zh: Qwen3 的词表大小。
ours = make_workload(vocab_size=151_936)
assert ours.prompts == theirs and ours.output_lens == their_lens

batches = peer_batches(mini, batch_size=3)
assert sorted(i for b in batches for i in b) == list(range(6))
longest = [max(mini.output_lens[i] for i in b) for b in batches]
# en: Batches go from short to long outputs.
# zh: 批次按输出长度从短到长排列。
assert longest == sorted(longest)
print(say("benchmark checks hold"))

# %% [markdown] tags=["en"]
# The tensor-parallel comparison, in miniature: two gloo ranks on this CPU against one process,
# through the command line's code path. The figures of a shared CPU say nothing about GPUs
# (chapter 17 has those); what is checked is that one invocation measures both and reports
# their ratio, and that the 8B preset's directory holds Qwen3-8B's shapes and no weights.

# %% [markdown] tags=["zh"]
# 张量并行的对比，缩小版：这台 CPU 上的两个 gloo rank 对一个进程，走的是命令行的同一条代码路径。共享 CPU 上的数字
# 说明不了 GPU 上的情况（那些在第 17 章）；这里检查的是：一次调用就测出两者并报告比值，以及 8B 预设的目录里是
# Qwen3-8B 的形状、没有权重。

# %%
import contextlib
import io

from nanovllm.bench.engine import main as bench
from nanovllm.bench.engine import model_params
from nanovllm.bench.models import qwen3_8b_shapes
from nanovllm.book.tiny_models import build_tiny_model

printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    status = bench(["--model", str(build_tiny_model("qwen3")), "--device", "cpu", "--num-seqs", "4", "--input-len",
                    "8", "16", "--output-len", "4", "8", "--tensor-parallel-size", "2",
                    "--out", str(workdir / "tp.json")])
print(printed.getvalue())
tp_report = json.loads((workdir / "tp.json").read_text())
assert status == 0 and {"engine", "engine_tp1", "ratio_tp"} <= set(tp_report)
assert tp_report["ratio_tp"] == tp_report["engine"]["tokens_per_s"] / tp_report["engine_tp1"]["tokens_per_s"]
eight = Config.from_kwargs(qwen3_8b_shapes(str(workdir / "qwen3-8b")), device="cpu", load_format="dummy")
print(say("qwen3-8b preset: {params:.2f} B parameters, {files} weight files",
          params=model_params(eight.hf_config) / 1e9, files=len(list(Path(eight.model).glob("*.safetensors")))))
assert 8.0e9 < model_params(eight.hf_config) < 8.4e9

# %% [markdown] tags=["en"]
# ## Build it: what the engine says about itself
#
# A benchmark, a server's gauges and its live page all want to know the same few things between
# steps: how many requests run and wait, and how much of the KV pool is in use. They could read
# them off the scheduler's queues and the block manager's pool, and each would then depend on how
# those are built. `LLMEngine.stats()` answers instead, as one small record, `EngineStats`, and
# `set_observer` attaches the scheduler's observer (chapter 04) through the engine: what watches
# the engine from outside goes through these two doors.

# %% [markdown] tags=["zh"]
# ## 动手：引擎说说它自己
#
# 基准测试、服务器的指标和它的实时页面，在两步之间想知道的是同样几件事：有多少请求在运行、有多少在等待，KV 块池
# 用了多少。它们本可以从调度器的队列和块管理器的块池里读出来，可那样一来，每一个都要依赖这些部件的内部构造。
# 现在由 `LLMEngine.stats()` 回答，给出一条小记录 `EngineStats`；`set_observer` 则通过引擎挂上调度器的观察者
# （第 04 章）：从外面观察引擎的东西，都走这两扇门。

# %% engine stats
#| export engine.llm_engine
from dataclasses import dataclass

from nanovllm.book.literate import add_to_class
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.scheduler import Observer


@dataclass(frozen=True)
class EngineStats:
    """What an engine says about itself between steps: its requests (each counted once, however many samples it
    has), and the blocks of its KV pool in use."""
    # zh: 引擎在两步之间对自己的描述：它的请求（每个只算一次，不管它有多少个样本），以及它的 KV 块池中
    # zh: 正在使用的块。

    requests_running: int
    requests_waiting: int
    kv_blocks_used: int
    kv_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV pool in use, 0 to 1."""
        # zh: KV 块池中正在使用的比例，0 到 1。
        return self.kv_blocks_used / self.kv_blocks


@add_to_class(LLMEngine)
def stats(self) -> EngineStats:
    """The engine's requests and its KV pool, now."""
    # zh: 引擎此刻的请求和它的 KV 块池。
    scheduler, pool = self.scheduler, self.scheduler.block_manager
    return EngineStats(requests_running=len({seq.request_id for seq in scheduler.running}),
                       requests_waiting=len({seq.request_id for seq in scheduler.waiting}),
                       kv_blocks_used=pool.num_blocks - pool.num_free_blocks, kv_blocks=pool.num_blocks)


@add_to_class(LLMEngine)
def set_observer(self, observer: Observer | None) -> Observer | None:
    """Attach ``observer`` to the scheduler's events (chapter 04), or detach with None; returns the one before."""
    # zh: 把 ``observer`` 挂到调度器的事件上（第 04 章），传 None 则卸下；返回之前的那个。
    previous, self.scheduler.observer = self.scheduler.observer, observer
    return previous

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

tiny_engine = LLM(str(build_tiny_model("qwen3")), device="cpu", kvcache_block_size=4, num_kvcache_blocks=16)
tiny_engine.add_request("Small steps make", SamplingParams(temperature=0, max_tokens=4, n=2))
tiny_engine.add_request("Write clear code", SamplingParams(temperature=0, max_tokens=4))
events: list[str] = []
tiny_engine.set_observer(lambda event, data: events.append(event))
before = tiny_engine.stats()
tiny_engine.step()
during = tiny_engine.stats()
for when, stats in (("before the first step", before), ("after the first step", during)):
    print(say("{when}: {running} requests running, {waiting} waiting, {used} of {blocks} KV blocks in use",
              when=say(when), running=stats.requests_running, waiting=stats.requests_waiting,
              used=stats.kv_blocks_used, blocks=stats.kv_blocks))
# en: Two requests wait (the forked one counts once); after the prefill both run, in blocks of the pool.
# zh: 两个请求在等待（分叉的那个只算一次）；prefill 之后两个都在运行，占着块池里的块。
assert (before.requests_waiting, before.requests_running, before.kv_blocks_used) == (2, 0, 0)
assert (during.requests_waiting, during.requests_running) == (0, 2) and 0 < during.kv_cache_usage < 1
assert "schedule" in events and tiny_engine.set_observer(None) is not None
tiny_engine.exit()

# %% [markdown] tags=["en"]
# ## Parallel sampling, measured: what sharing saves
#
# Chapter 05 forks a request's n samples from one prefill and lets them share their blocks until
# one writes. What does that save? Three ways to get four completions of one prompt, on the tiny
# Qwen3 on the CPU:
#
# - **one request with `n=4`**: one prefill, then a fork;
# - **four identical prompts in one `generate` call**: four sequences that share *nothing*. Their
#   prefills run in the same step, and a block is findable by prefix caching only after its K/V
#   has been written (chapter 03), so none of them can hit another's blocks;
# - **the same prompt again, later**: its full blocks are found in the prefix cache, but only
#   *full* blocks, and only after they were published.
#
# A small function watches the scheduler through its observer hook: tokens computed in prefill
# steps, and the most blocks in use at once, timed with the `Stopwatch` above. It is the same
# function the GPU benchmark below uses, so it lives in a module, `nanovllm.bench.parallel_sampling`.

# %% [markdown] tags=["zh"]
# ## 并行采样，测一测：共享省下了什么
#
# 第 05 章让一个请求的 n 个样本从同一次 prefill 分叉出来，共享它们的块，直到有样本要写入。这能省下什么？在 CPU 上
# 用小 Qwen3 得到同一个提示词的四个生成结果，有三种办法：
#
# - **一个 `n=4` 的请求**：一次 prefill，然后分叉；
# - **在一次 `generate` 调用里发送四个相同的提示词**：四个*什么也不共享*的序列。它们的 prefill 在同一步里运行，
#   而一个块只有在它的 K/V 写入之后才能被前缀缓存找到（第 03 章），所以谁也命中不了别人的块；
# - **稍后再发一次同一个提示词**：它的写满的块能在前缀缓存里找到，但只有*写满的*块才行，而且要在它们发布之后。
#
# 一个小函数通过调度器的观察者钩子记录两样东西：prefill 步计算的 token 数，以及同一时刻最多用了多少个块。
# 计时用的是上面的 `Stopwatch`。下面的 GPU 基准测试用的也是这个函数，所以它放在一个模块里：
# `nanovllm.bench.parallel_sampling`。


# %% sampling run
#| export bench.parallel_sampling
"""Parallel sampling against independent requests: blocks in use, prefill tokens and speed."""
# zh: 并行采样对比独立请求：占用的块、prefill 的 token 数和速度。

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanovllm.bench.report import Stopwatch
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


@dataclass
class SamplingRun:
    """What one `generate` call cost: time, tokens produced, tokens prefilled, most blocks in use at once."""
    # zh: 一次 `generate` 调用的代价：时间、生成的 token 数、prefill 的 token 数、同时占用的最多块数。

    name: str
    seconds: float
    output_tokens: int
    prefill_tokens: int
    peak_blocks: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def __str__(self) -> str:
        return (f"{self.name}: {self.output_tokens} tokens in {self.seconds:.2f} s = {self.tokens_per_s:,.1f} tok/s, "
                f"{self.prefill_tokens} prefill tokens, at most {self.peak_blocks} blocks in use")


def measure_generate(llm: LLM, prompts: list[Any], params: list[SamplingParams], name: str) -> SamplingRun:
    """Run ``llm.generate`` once, watching the scheduler (its observer hook): the tokens computed by
    prefill steps, and after each schedule, when a step's blocks are all allocated, the blocks in use."""
    # zh: 运行一次 ``llm.generate``，同时观察调度器（通过它的观察者钩子）：prefill 步计算的 token，
    # zh: 以及每次调度之后、一步的块全部分配好时正在使用的块。
    seen = {"prefill": 0, "peak": 0}

    def watch(event: str, data: dict) -> None:
        if event == "schedule":
            if data["is_prefill"]:
                seen["prefill"] += sum(seq.num_scheduled_tokens for seq in data["seqs"])
            seen["peak"] = max(seen["peak"], llm.stats().kv_blocks_used)

    previous = llm.set_observer(watch)
    try:
        with Stopwatch(llm.config.device) as clock:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.set_observer(previous)
    made = sum(len(sample["token_ids"]) for output in outputs for sample in output.get("outputs", [output]))
    return SamplingRun(name, clock.seconds, made, seen["prefill"], seen["peak"])


# %%
import random

from nanovllm.bench.parallel_sampling import measure_generate
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

tiny_qwen = str(build_tiny_model("qwen3"))
rng = random.Random(0)
# en: 7 full blocks of 4 and a partial one (2 tokens).
# zh: 7 个写满的块（每块 4 个 token），再加一个未写满的块（2 个 token）。
prompt = [rng.randrange(3, 512) for _ in range(30)]
sample = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


def engine() -> LLM:
    """A fresh engine each time, so that no run finds another's blocks in the prefix cache by accident."""
    # zh: 每次都用一个新引擎，这样任何一次运行都不会碰巧在前缀缓存里找到另一次运行的块。
    return LLM(tiny_qwen, device="cpu", kvcache_block_size=4, num_kvcache_blocks=64)


forked = measure_generate(engine(), [prompt], [SamplingParams(**{**sample.__dict__, "n": 4})], "one request, n=4")
separate_engine = engine()
separate = measure_generate(separate_engine, [prompt] * 4, [sample] * 4, "4 identical requests")
later = measure_generate(separate_engine, [prompt], [sample], "the same prompt, later")
print(f"{'':<24} {say('prefill tokens'):>14} {say('peak blocks'):>12}")
for run in (forked, separate, later):
    print(f"{say(run.name):<24} {run.prefill_tokens:>14} {run.peak_blocks:>12}")

# en: No sharing among the four.
# zh: 四个请求之间没有共享。
assert forked.prefill_tokens == 30 and separate.prefill_tokens == 4 * 30
# en: Seven full blocks found in the cache, two tokens computed.
# zh: 在缓存中找到七个写满的块，只需计算两个 token。
assert later.prefill_tokens == 30 - 7 * 4
# en: Explained below.
# zh: 原因见下文。
assert forked.peak_blocks == 7 + 4 * 3 and separate.peak_blocks == 4 * 10
assert forked.output_tokens == separate.output_tokens == 32


# %% [markdown] tags=["en"]
# The request with `n=4` prefilled its 30 tokens once; the four identical requests prefilled
# them four times, because they arrived together and nothing was published yet. The same prompt
# sent later found its seven full blocks and computed only its last two tokens (a prompt's last
# token is always computed: its logits are needed). And at the peak, the fork held 7 shared
# blocks plus 3 private blocks per sample (a copy of block 7, then two new ones); the four
# separate requests held 10 blocks each.

# %% [markdown] tags=["zh"]
# `n=4` 的请求只 prefill 了一次它的 30 个 token；四个相同的请求 prefill 了四次，因为它们同时到达，而那时还什么都
# 没有发布。稍后再发的同一个提示词找到了它的七个写满的块，只计算了最后两个 token（提示词的最后一个 token 总要计算：
# 需要它的 logits）。峰值时，分叉的做法持有 7 个共享块，外加每个样本 3 个私有块（块 7 的一份副本，再加两个新块）；
# 四个独立请求则各持有 10 个块。


# %% [markdown] tags=["en"]
# ## The benchmark: n = 4 against four independent requests, on a GPU
#
# The same comparison at scale: the first 64 prompts of nano-vllm's benchmark workload (above:
# random prompts of 100 to 1,024 tokens, Qwen3-0.6B shapes, bf16), each asked for n = 4
# samples with its workload output length, against the same 64 prompts as 256 independent
# requests (`fork_samples=False`), in one run:
#
# ```bash
# python3 -m nanovllm.bench --preset nano-vllm --parallel-sampling 4
# ```
#
# Each side gets a fresh engine, so that neither finds the other's blocks in the prefix cache.

# %% [markdown] tags=["zh"]
# ## 基准测试：在 GPU 上比较 n = 4 和四个独立请求
#
# 同样的比较，放大规模：取 nano-vllm 基准负载（见上文：随机提示词，长度 100 到 1,024 个 token，Qwen3-0.6B 的
# 形状，bf16）的前 64 个提示词，每个要 n = 4 个样本、输出长度按负载里的设定；对照组是把这 64 个提示词当作 256 个
# 独立请求（`fork_samples=False`）。两者在同一次运行中测量：
#
# ```bash
# python3 -m nanovllm.bench --preset nano-vllm --parallel-sampling 4
# ```
#
# 两边各用一个新引擎，谁也不会在前缀缓存里找到对方的块。

# %% [markdown] tags=["en"]
# Recorded on one H200 on 2026-12-01 (the command above, blocks of 256 tokens, asynchronous
# scheduling and CUDA graphs on; the 64 prompts hold 34,428 tokens):
#
# | | output tok/s | prefill tokens | peak blocks in use |
# |---|---|---|---|
# | forked: n = 4 | 26,615 | 34,428 | 554 |
# | independent: 4 requests per prompt | 23,336 | 137,712 | 800 |
# | forked / independent | 1.14× | 0.25× | 0.69× |
#
# Each prompt is prefilled once instead of four times, and decode loses nothing: the same
# 133,288 tokens came out in 12% less time, the prefill saved being most of the difference. The blocks
# saved are fewer than one might hope, 31% at the peak, because blocks of 256 tokens are large
# next to these prompts (540 tokens on average: two full blocks and a partial one). The partial
# block is copied at the first decode step for all samples but the last, and every sample then
# grows its own blocks for up to 1,024 output tokens. With small blocks, or long shared prompts
# and short answers, sharing saves nearly all of the prompt's blocks, as chapter 05's
# exercises compute.

# %% [markdown] tags=["zh"]
# 2026-12-01 在一块 H200 上记录（上面的命令，每块 256 个 token，打开异步调度和 CUDA Graph；这 64 个提示词共
# 34,428 个 token）：
#
# | | 输出 tok/s | prefill token 数 | 峰值占用块数 |
# |---|---|---|---|
# | 分叉：n = 4 | 26,615 | 34,428 | 554 |
# | 独立：每个提示词 4 个请求 | 23,336 | 137,712 | 800 |
# | 分叉 / 独立 | 1.14× | 0.25× | 0.69× |
#
# 每个提示词只 prefill 一次而不是四次，decode 也没有变慢：同样的 133,288 个 token 少用了 12% 的时间，差别主要来自
# 省下的 prefill。省下的块没有想象的多，峰值时只少了 31%：对这些提示词（平均 540 个 token：两个写满的块加一个未写满的
# 块）来说，256 个 token 的块太大了。未写满的那块在第一个 decode 步被复制给除最后一个之外的所有样本，之后每个样本还要为
# 最多 1,024 个输出 token 各自增加块。块小的时候，或者共享的提示词很长而回答很短时，共享几乎能省下提示词的全部块，
# 第 05 章的练习算过这一点。

# %% recorded: four samples against four requests
sampling = gpu_runs["parallel sampling"]
print(say("{date}, {card}: {command}", date=sampling.date, card=sampling.card, command=sampling.command))
forked, independent = sampling.figures["forked"], sampling.figures["independent"]
columns = {"tokens/s": 10, "prefill tokens": 15, "peak blocks": 12}
print(f"{'':<38} {'tok/s':>10} {say('prefill tokens'):>15} {say('peak blocks'):>12}")
for label, row in (("forked: n = 4", forked), ("independent: 4 requests per prompt", independent)):
    print(f"{say(label):<38} " + " ".join(f"{row[key]:>{width},}" for key, width in columns.items()))
ratios = [round(forked[key] / independent[key], 2) for key in columns]
print(f"{say('forked / independent'):<38} "
      + " ".join(f"{ratio:>{width - 1}.2f}x" for ratio, width in zip(ratios, columns.values(), strict=True)))
assert ratios == [1.14, 0.25, 0.69]
# en: The same output tokens in 12 % less time; 31 % fewer blocks at the peak; prompts of 540 tokens on average.
# zh: 同样多的输出 token 少用 12% 的时间；峰值时少 31% 的块；提示词平均 540 个 token。
assert round(100 * (1 - independent["tokens/s"] / forked["tokens/s"])) == 12
assert round(100 * (1 - forked["peak blocks"] / independent["peak blocks"])) == 31
assert round(sampling.figures["prompt tokens"] / sampling.figures["prompts"], -1) == 540
assert forked["prefill tokens"] == sampling.figures["prompt tokens"] == independent["prefill tokens"] / 4

# %% report phrases
#| exporti bench.parallel_sampling
#| hide
from nanovllm.book.lang import Phrases

# en: The report's words in Chinese, printed when the book reads in Chinese (nanovllm.book.lang); English otherwise.
# zh: 报告中文字的中文版本：本书以中文阅读时打印（nanovllm.book.lang），否则打印英文。
_say = Phrases({
    "forked: n={n}": "分叉：n={n}",
    "independent: {n} requests per prompt": "独立：每个提示词 {n} 个请求",
    "prefill tokens": "prefill token",
    "peak blocks": "峰值占用块数",
    "forked / independent": "分叉 / 独立",
})


# %% compare
#| export bench.parallel_sampling
def compare_parallel_sampling(
    model: str, prompts: list[list[int]], output_lens: list[int], n: int, **config: Any
) -> list[SamplingRun]:
    """Each prompt with ``n`` forked samples, then as ``n`` independent requests (``fork_samples=False``): one
    fresh engine each, the same sampled lengths (``ignore_eos``). ``config``: `LLM` keyword arguments."""
    # zh: 每个提示词先带 ``n`` 个分叉的样本运行，再作为 ``n`` 个独立请求运行（``fork_samples=False``）：各用一个
    # zh: 新引擎，采样长度相同（``ignore_eos``）。``config``：`LLM` 的关键字参数。
    if n < 2:
        raise ValueError(f"n must be >= 2 to compare sharing with independent requests, got {n}")
    longest = max(len(p) + m for p, m in zip(prompts, output_lens, strict=True))
    config.setdefault("max_model_len", max(4096, longest))
    config.setdefault("max_num_seqs", max(512, n))
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, n=n) for m in output_lens]
    runs = []
    names = {True: _say("forked: n={n}", n=n), False: _say("independent: {n} requests per prompt", n=n)}
    for fork, name in names.items():
        llm = LLM(model, fork_samples=fork, **config)
        try:
            # en: Warm-up on a prompt unrelated to the workload (nothing it publishes can be hit).
            # zh: 用一个与负载无关的提示词预热（它发布的块不会被命中）。
            llm.generate([list(range(3, 11))], SamplingParams(max_tokens=2, n=2), use_tqdm=False)
            runs.append(measure_generate(llm, prompts, params, name))
        finally:
            llm.exit()
            if llm.config.device == "cuda":
                torch.cuda.empty_cache()
    return runs


def parallel_sampling_report(runs: list[SamplingRun]) -> dict[str, Any]:
    """Print the runs side by side (and their ratios); return them as JSON-ready data."""
    # zh: 把各次运行并排打印出来（以及它们的比值）；以可转成 JSON 的数据返回它们。
    forked, independent = runs
    print(f"{'':<38} {'tok/s':>10} {_say('prefill tokens'):>15} {_say('peak blocks'):>12}")
    for run in runs:
        print(f"{run.name:<38} {run.tokens_per_s:>10,.0f} {run.prefill_tokens:>15,} {run.peak_blocks:>12,}")
    ratios = {
        "tokens_per_s": forked.tokens_per_s / independent.tokens_per_s,
        "prefill_tokens": forked.prefill_tokens / independent.prefill_tokens,
        "peak_blocks": forked.peak_blocks / independent.peak_blocks,
    }
    print(f"{_say('forked / independent'):<38} {ratios['tokens_per_s']:>9.2f}x {ratios['prefill_tokens']:>14.2f}x "
          f"{ratios['peak_blocks']:>11.2f}x")
    return {"runs": [run.__dict__ | {"tokens_per_s": run.tokens_per_s} for run in runs], "ratios": ratios}


# %% [markdown] tags=["en"]
# On the CPU, the same function on the tiny model and a handful of prompts (what CI runs; the
# speed of a tiny model on a CPU says nothing, the counts do):

# %% [markdown] tags=["zh"]
# 在 CPU 上，用同一个函数、小模型和几个提示词跑一遍（CI 运行的就是这个；小模型在 CPU 上的速度说明不了什么，
# 计数才有意义）：

# %%
from nanovllm.bench.parallel_sampling import compare_parallel_sampling, parallel_sampling_report

few = [[rng.randrange(3, 512) for _ in range(rng.randint(10, 40))] for _ in range(4)]
runs = compare_parallel_sampling(tiny_qwen, few, [6, 9, 4, 7], 4, device="cpu", kvcache_block_size=4,
                                 num_kvcache_blocks=256)
summary = parallel_sampling_report(runs)
# en: Each prompt prefilled once instead of four times.
# zh: 每个提示词只 prefill 一次，而不是四次。
assert summary["ratios"]["prefill_tokens"] == 0.25
assert summary["ratios"]["peak_blocks"] < 1 and runs[0].output_tokens == runs[1].output_tokens == 4 * 26


# %% [markdown] tags=["en"]
# ## Latency: one step at a time
#
# Throughput at 256 sequences hides what one reader or a chat with a handful of streams feels:
# how long one decode step takes when the batch is small. Then every step reads all the weights
# for very little work, and what was noise at 256 sequences, a few hundred kernel launches,
# becomes most of the step. `python -m nanovllm.bench --latency` measures that: for each batch
# (1, 4, 16 and 64 sequences on a GPU), prompts of 512 random tokens generating 1,024 each, it
# times every decode step as the engine runs it (CUDA graphs, async scheduling), and prints per
# batch the wall time of a step, its tokens per second, and the step's **bound**: the bytes a
# step must read (every weight once, plus each sequence's KV cache at its current length) at the
# copy rate measured in the same run. A card's copy rate moves from run to run (by a sixth within
# the hour on one card), so every benchmark that prints a share of the bound measures it
# before its runs and after them, prints both, and holds the runs to the higher, stricter bound
# (`CopyRates`). On a GPU, `torch.profiler` records a window of steps in the
# middle of the run: how many kernels a step launches and how much of its wall time the GPU spent
# inside them. What is left, between the kernels, is the step's fixed cost.
#
# On a CPU the same command runs SmolLM2 with smaller defaults (batches 1 and 4, 128-token
# prompts, 64 tokens each), and says that its figures, and its bound (the CPU's copy rate), are
# the CPU's.

# %% [markdown] tags=["zh"]
# ## 延迟：一步一步地看
#
# 256 个序列时的吞吐量，掩盖了单个读者或只有几路流的对话所感受到的东西：批很小时，一个 decode 步要花多长时间。
# 这时每一步都为很少的计算把全部权重读一遍，而在 256 个序列时无足轻重的那几百次内核启动，成了一步的大头。
# `python -m nanovllm.bench --latency` 测的就是这个：对每个批大小（GPU 上为 1、4、16 和 64 个序列），提示词为
# 512 个随机 token，各生成 1,024 个，按引擎实际运行的方式（CUDA graph、异步调度）给每个 decode 步计时，并为每个
# 批大小打印一步的墙钟时间、每秒 token 数，以及这一步的**上限**：一步必须读取的字节数（每个权重读一次，加上每个
# 序列当前长度的 KV 缓存），按同一次运行中测得的拷贝速率计算。同一张卡的拷贝速率每次运行都会变（同一张卡一小时之内
# 能差六分之一），所以每个打印“占上限比例”的基准测试都在运行之前和之后各测一次，两个都打印出来，并按
# 较高的那个（更严的上限）来算（`CopyRates`）。在 GPU 上，`torch.profiler` 会记录运行中段的一段
# 步：一步启动多少个内核，以及一步的墙钟时间里 GPU 有多少花在内核内部。剩下的、内核之间的那部分，就是
# 一步的固定开销。
#
# 在 CPU 上，同一条命令用 SmolLM2 和更小的默认值运行（批大小 1 和 4，提示词 128 个 token，各生成 64 个），并说明
# 它的数字和上限（CPU 的拷贝速率）都是 CPU 上的。

# %% bench latency
#| export bench.latency
"""``python -m nanovllm.bench --latency``: how long one decode step takes at small batches, against its bound."""
# zh: ``python -m nanovllm.bench --latency``：小批次下一个 decode 步要多长时间，对照它的上限。

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from nanovllm.bench.engine import kv_token_bytes, make_workload, watch_calls, weight_bytes_per_step
from nanovllm.bench.models import qwen3_06b_random, qwen3_8b_shapes
from nanovllm.bench.report import CopyRates, report_header, write_report
from nanovllm.engine.model_runner import SampledTokens
from nanovllm.sampling_params import SamplingParams

# en: (batches, prompt tokens, generated tokens): on a GPU, the batches the latency goals name; on a CPU, a few
# en: minutes' worth.
# zh: （批大小，提示词 token 数，生成 token 数）：GPU 上用延迟目标所说的那几个批大小，CPU 上用几分钟能跑完的规模。
LATENCY_DEFAULTS = {"cuda": ((1, 4, 16, 64), 512, 1024), "cpu": ((1, 4), 128, 64)}


@dataclass(frozen=True)
class StepLatency:
    """One batch's decode steps: wall time, bound, and (on a GPU) what the profiler saw in a window of them."""
    # zh: 一个批次的 decode 步：挂钟时间、上限，以及（在 GPU 上）profiler 在其中一个窗口里看到的东西。

    batch: int
    # en: Decode steps timed.
    # zh: 计时的 decode 步数。
    steps: int
    # en: Wall time of a step as the engine runs it, mean over the timed steps.
    # zh: 引擎实际运行时一步的墙钟时间，取计时各步的平均值。
    ms_per_step: float
    # en: Host time to schedule, prepare and launch a step (LLMEngine._launch), mean; on a CPU
    # en: the launch computes the step itself.
    # zh: 主机上调度、准备并启动一步所花的时间（LLMEngine._launch），取平均值；
    # zh: 在 CPU 上，启动本身就完成了这一步的计算。
    host_launch_ms: float
    # en: Host time per step: its wall time less the time it waited for a step's tokens to come back from the GPU
    # en: (SampledTokens.token_ids), mean. On a CPU nothing is waited for: the whole step is host time.
    # zh: 每步的主机时间：一步的墙钟时间减去等待某一步的 token 从 GPU 传回的时间（SampledTokens.token_ids），取平均值。
    # zh: 在 CPU 上没有什么要等：整步都是主机时间。
    host_ms: float
    # en: Bytes the step must read (weights + KV at the steps' mean length) at the copy rate.
    # zh: 以拷贝速率读完一步必须读取的字节（权重 + 按各步平均长度计的 KV）所需的时间。
    bound_ms: float
    # en: GPU kernels a step launches (profiled window; None on a CPU).
    # zh: 一步启动的 GPU kernel 数（取自分析窗口；在 CPU 上为 None）。
    kernels_per_step: float | None
    # en: Time in which at least one of those kernels ran, per step (kernels that start early overlap the one
    # en: before them: their overlap counts once).
    # zh: 每步中至少有一个这样的 kernel 在运行的时间（提前启动的 kernel 与前一个重叠：重叠部分只算一次）。
    gpu_ms_per_step: float | None
    # en: The decode graph alone (the model's layers, without the LM head and the sampler), replayed back to back
    # en: on the inputs of a step, milliseconds per replay: the GPU's share of the step with no host in the way.
    # en: None on a CPU or when no graph covers the batch.
    # zh: 单独的 decode graph（模型各层，不含 LM head 与采样器）在某一步的输入上背靠背重放，每次重放的毫秒数：
    # zh: 没有主机拖后腿时 GPU 在一步里占的时间。在 CPU 上或没有 graph 覆盖该批次时为 None。
    graph_ms: float | None = None
    # en: The kernels by name, the costliest first: (name, launches per step, microseconds per step).
    # zh: 按名字归并的 kernel，耗时最多的在前：（名字，每步启动次数，每步微秒数）。
    top_kernels: list[tuple[str, float, float]] | None = None
    # en: The kernels across the middle step boundary of the profiled window, on the GPU's clock (see
    # en: step_boundary_timeline): (name, start, end) in microseconds. None on a CPU or where not found.
    # zh: 分析窗口中间那个步边界前后的 kernel，按 GPU 的时钟（见 step_boundary_timeline）：（名字，开始，结束），单位
    # zh: 微秒。在 CPU 上或找不到时为 None。
    boundary_timeline: list[tuple[str, float, float]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.ms_per_step * 1e-3)

    @property
    def fraction_of_bound(self) -> float:
        return self.bound_ms / self.ms_per_step


def model_kernels(profile: Any) -> list[Any]:
    """The GPU kernels a torch.profiler run recorded, in the order the GPU started them. Copies and memsets are not
    kernels of the model: they are left out."""
    # zh: 一次 torch.profiler 运行记录下的 GPU 内核，按 GPU 启动它们的顺序。拷贝和 memset 不是模型的内核：
    # zh: 把它们排除在外。
    return sorted((event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA
                   and not event.name.startswith(("Memcpy", "Memset"))), key=lambda event: event.time_range.start)


def count_kernels(profile: Any, steps: int, top: int = 12) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(kernels per step, GPU milliseconds inside them per step, the ``top`` kernels by time) from a torch.profiler
    run over ``steps`` steps (`model_kernels`)."""
    # zh: 由一次覆盖 ``steps`` 步的 torch.profiler 运行（`model_kernels`）得出：（每步的内核数，每步在内核中的
    # zh: GPU 毫秒数，按时间排前 ``top`` 的内核）。
    kernels = model_kernels(profile)
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        count_and_time = by_name.setdefault(event.name[:100], [0, 0.0])
        count_and_time[0] += 1
        count_and_time[1] += event.device_time
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return (len(kernels) / steps, busy_microseconds(kernels) / 1e3 / steps,
            [(name, count / steps, micros / steps) for name, (count, micros) in ranked])


def busy_microseconds(kernels: list[Any]) -> float:
    """Microseconds in which at least one of ``kernels`` (sorted by start) ran: the length of the union of their
    intervals. Summing their durations would count twice the time in which a kernel that starts early (chapter
    14's programmatic dependent launch) waits beside the kernel before it."""
    # zh: ``kernels``（按开始时间排序）中至少有一个在运行的微秒数：它们区间并集的长度。把它们的时长加起来，
    # zh: 会把提前启动的内核（第 14 章的 programmatic dependent launch）在前一个内核旁边等待的时间算两次。
    busy, end = 0.0, float("-inf")
    for event in kernels:
        start, stop = event.time_range.start, event.time_range.end
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy


def graph_replay_ms(llm: Any, batch: int, replays: int = 50) -> float | None:
    """Milliseconds per replay of the decode graph that runs ``batch`` sequences, replayed ``replays`` times back
    to back on what its buffers hold (the last step's inputs: each replay recomputes that step and writes the same
    K/V into the same slots, so the engine's state does not change). None without such a graph."""
    # zh: 运行 ``batch`` 个序列的 decode 图每次重放的毫秒数：在它的缓冲区当前的内容上连续重放 ``replays`` 次
    # zh: （最后一步的输入：每次重放都重算那一步，把同样的 K/V 写进同样的槽位，所以引擎的状态不变）。
    # zh: 没有这样的图时为 None。
    graphs = getattr(llm.model_runner, "graphs", None)
    if graphs is None or not graphs.covers(batch):
        return None
    torch.cuda.synchronize()
    graphs.replay_loaded(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graphs.replay_loaded(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


# en: The kernel that opens a layer's attention on a GPU (the fused q/k norm, RoPE and store), once a layer:
# en: it marks where each layer is in a profile.
# zh: GPU 上每层注意力开头的那个 kernel（第 14 章融合的 q/k 归一化、RoPE 与写入），每层一次：在性能分析记录里，
# zh: 靠它找到每一层的位置。
LAYER_MARK = "norm_rotate_store_kernel"


def step_boundary_timeline(profile: Any, steps: int) -> list[tuple[str, float, float]] | None:
    """The kernels around the middle step boundary of a profiled window of ``steps`` decode steps, as the GPU ran
    them: from the last layer's LAYER_MARK of one step to the first layer's of the next, so the last layer, the
    final norm, the LM head, the sampler, any time the GPU waited for the host's next launch, and the next step's
    first layer up to its attention. (name, start, end) in microseconds from the first kernel's start."""
    # zh: 在一个被 profile 的、含 ``steps`` 个 decode 步的窗口中，中间那个步边界附近的内核，按 GPU 运行它们的样子：
    # zh: 从一步最后一层的 LAYER_MARK 到下一步第一层的 LAYER_MARK，于是包括最后一层、最后的归一化、LM head、
    # zh: 采样器、GPU 等待主机下一次启动的任何时间，以及下一步第一层直到它的注意力为止。
    # zh: (name, start, end)，单位是从第一个内核开始算起的微秒。
    kernels = model_kernels(profile)
    marks = [i for i, event in enumerate(kernels) if event.name.startswith(LAYER_MARK)]
    if steps < 2 or not marks or len(marks) % steps:
        return None
    boundary = steps // 2 * (len(marks) // steps)
    first, last = marks[boundary - 1], marks[boundary]
    origin = kernels[first].time_range.start
    return [(event.name[:100], event.time_range.start - origin, event.time_range.end - origin)
            for event in kernels[first:last + 1]]


@contextmanager
def timed_launches(llm: Any) -> Iterator[tuple[list[float], list[float]]]:
    """While inside: the seconds of each host launch of ``llm`` (its `_launch`), and of each wait for a step's tokens
    (`SampledTokens.token_ids`: the host waits for the GPU, then reads them)."""
    # zh: 在块内：``llm`` 每次主机启动（它的 `_launch`）的秒数，以及每次等待某一步 token 的秒数
    # zh: （`SampledTokens.token_ids`：主机等 GPU 算完，再读出它们）。
    launch_seconds: list[float] = []
    wait_seconds: list[float] = []
    with watch_calls(llm, "_launch", lambda seconds, _: launch_seconds.append(seconds)), \
            watch_calls(SampledTokens, "token_ids", lambda seconds, _: wait_seconds.append(seconds)):
        yield launch_seconds, wait_seconds


def measure_batch(llm: Any, batch: int, input_len: int, output_len: int, bandwidth: float, *, seed: int = 0,
                  warmup_steps: int = 8, profile_steps: int = 16) -> StepLatency:
    """Run ``batch`` prompts of ``input_len`` tokens to ``output_len`` tokens each through ``llm``, timing every
    decode step after the first ``warmup_steps``; on a GPU, profile ``profile_steps`` of them in the middle
    (left out of the timing, since the profiler slows the host)."""
    # zh: 让 ``batch`` 个 ``input_len`` 个 token 的提示词通过 ``llm`` 各运行到 ``output_len`` 个 token，为最初
    # zh: ``warmup_steps`` 步之后的每个 decode 步计时；在 GPU 上，对中间的 ``profile_steps`` 步做 profile
    # zh: （不计入计时，因为 profiler 会拖慢主机）。
    config = llm.config
    workload = make_workload(batch, (input_len, input_len), (output_len, output_len),
                             vocab_size=config.hf_config.vocab_size, seed=seed)
    for prompt, params in zip(workload.prompts, workload.sampling_params(), strict=True):
        llm.add_request(prompt, params)
    profiled = config.device == "cuda" and output_len > warmup_steps + 2 * profile_steps
    profile_from = (output_len - profile_steps) // 2
    # en: After the profiled window the pipeline of async scheduling restarts: its first steps are not timed either.
    # zh: 分析窗口之后，异步调度的流水线要重新启动：紧接着的几步同样不计时。
    untimed = set(range(profile_from, profile_from + profile_steps + 3)) if profiled else set()
    decode_step, step_seconds, host_seconds, contexts, launches = 0, [], [], [], []
    kernels, timeline, graph_ms = None, None, None
    with timed_launches(llm) as (launch_seconds, wait_seconds):
        while not llm.is_finished():
            if profiled and decode_step == profile_from:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
                    for _ in range(profile_steps):
                        llm.step()
                    torch.cuda.synchronize()
                kernels = count_kernels(profiler, profile_steps)
                timeline = step_boundary_timeline(profiler, profile_steps)
                graph_ms = graph_replay_ms(llm, batch)
                decode_step += profile_steps
                continue
            launched_before, waited_before = len(launch_seconds), len(wait_seconds)
            began = time.perf_counter()
            _, num_tokens, is_prefill = llm.step()
            elapsed = time.perf_counter() - began
            if is_prefill or num_tokens == 0:
                continue
            decode_step += 1
            if decode_step > warmup_steps and decode_step not in untimed:
                step_seconds.append(elapsed)
                host_seconds.append(elapsed - sum(wait_seconds[waited_before:]))
                # en: Decode step k reads the KV of the prompt and of the k tokens generated before it.
                # zh: 第 k 个 decode 步读取提示词和此前已生成的 k 个 token 的 KV。
                contexts.append(input_len + decode_step)
                launches += launch_seconds[launched_before:]
    if not step_seconds:
        raise ValueError(f"no decode step was timed: --output-len {output_len} leaves none after {warmup_steps} "
                         "warm-up steps")
    mean_context = sum(contexts) / len(contexts)
    dtype_bytes = config.torch_dtype.itemsize
    step_bytes = weight_bytes_per_step(config.hf_config, dtype_bytes) \
        + batch * mean_context * kv_token_bytes(config.hf_config, dtype_bytes, config.kv_cache_dtype)
    return StepLatency(batch=batch, steps=len(step_seconds), ms_per_step=1e3 * sum(step_seconds) / len(step_seconds),
                       host_launch_ms=1e3 * sum(launches) / max(1, len(launches)),
                       host_ms=1e3 * sum(host_seconds) / len(host_seconds), bound_ms=1e3 * step_bytes / bandwidth,
                       kernels_per_step=kernels[0] if kernels else None,
                       gpu_ms_per_step=kernels[1] if kernels else None, graph_ms=graph_ms,
                       top_kernels=kernels[2] if kernels else None, boundary_timeline=timeline)


def format_row(row: StepLatency) -> str:
    kernels = _say_latency("{kernels:6.0f} kernels, GPU busy {busy:6.3f} ms", kernels=row.kernels_per_step,
                           busy=row.gpu_ms_per_step) \
        if row.kernels_per_step is not None else _say_latency("kernels: not counted on a CPU")
    if row.graph_ms is not None:
        kernels += _say_latency(", graph alone {ms:6.3f} ms", ms=row.graph_ms)
    return _say_latency("batch {batch:3d}: {ms:7.3f} ms/step, {rate:9,.0f} tok/s, bound {bound:6.3f} ms "
                        "({fraction:6.1%}), host {host:6.3f} ms (launch {launch:6.3f}), {kernels}", batch=row.batch,
                        ms=row.ms_per_step, rate=row.tokens_per_s, bound=row.bound_ms, fraction=row.fraction_of_bound,
                        host=row.host_ms, launch=row.host_launch_ms, kernels=kernels)


def where_it_runs(device: str) -> str:
    """The device the figures come from, as the benchmark's first line says it."""
    # zh: 这些数字来自哪个设备，按基准测试第一行的说法。
    return _say_latency("on {gpu}", gpu=torch.cuda.get_device_name()) if device == "cuda" else \
        _say_latency("on this CPU (the figures and the bound are the CPU's)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench --latency",
                                     description="Decode-step latency at small batches, against the step's bound.")
    parser.add_argument("--model", help="model directory (default: Qwen3-0.6B's shapes on a GPU, SmolLM2 on a CPU)")
    parser.add_argument("--preset", choices=["nano-vllm", "qwen3-8b", "cpu"],
                        help="the model of the throughput benchmark's preset: nano-vllm is Qwen3-0.6B's shapes")
    parser.add_argument("--batches", type=int, nargs="+", help="default: 1 4 16 64 on a GPU, 1 4 on a CPU")
    parser.add_argument("--input-len", type=int, help="prompt tokens (default: 512 on a GPU, 128 on a CPU)")
    parser.add_argument("--output-len", type=int, help="tokens generated (default: 1024 on a GPU, 64 on a CPU)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--fused-decode", choices=["auto", "on", "off", "both"], default="auto",
                        help="the fused decode layer; both: off, then on, in this invocation, with "
                        "their ratio per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError, smollm2_dir
    from nanovllm.config import Config

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    batches, input_len, output_len = LATENCY_DEFAULTS[device]
    batches, input_len, output_len = args.batches or batches, args.input_len or input_len, args.output_len or output_len
    fused_settings = {"auto": ["auto"], "on": [True], "off": [False], "both": [False, True]}[args.fused_decode]
    try:
        if min(batches) < 1 or input_len < 1 or output_len < 10:
            raise ValueError("batches and --input-len must be at least 1, --output-len at least 10 (the first 8 decode "
                             "steps warm up, untimed)")
        preset = args.preset or ("nano-vllm" if device == "cuda" else "cpu")
        model = args.model or str(qwen3_06b_random() if preset == "nano-vllm" else
                                  qwen3_8b_shapes() if preset == "qwen3-8b" else smollm2_dir())
        settings = {"device": device, "load_format": "dummy" if preset == "qwen3-8b" and not args.model else "auto",
                    "kv_cache_dtype": args.kv_cache_dtype, "enforce_eager": args.enforce_eager,
                    "max_model_len": max(4096, input_len + output_len), "max_num_seqs": max(batches)}
        # en: Refuse what this machine cannot run before any run.
        # zh: 在任何一次运行之前，就拒绝这台机器跑不了的设置。
        for fused in fused_settings:
            config = Config.from_kwargs(model, fused_decode=fused, **settings)
    except (TypeError, ValueError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(_say_latency("model: {model} {where} ({dtype}, kv cache {kv}); prompts of {input_len} tokens, {output_len} "
                       "generated each", model=model, where=where_it_runs(device), dtype=config.dtype,
                       kv=config.kv_cache_dtype, input_len=input_len, output_len=output_len))
    report = report_header("python -m nanovllm.bench --latency", argv, device)
    report |= {"model": model, "input_len": input_len, "output_len": output_len, "rows": []}
    rates = CopyRates.before_runs(device)
    print(_say_latency("copy rate, measured before the runs: {rate:.2f} TB/s; weights a step reads: {mb:,.1f} MB",
                       rate=rates.before / 1e12,
                       mb=weight_bytes_per_step(config.hf_config, config.torch_dtype.itemsize) / 1e6))
    for fused in fused_settings:
        rows = measure_setting(model, batches, input_len, output_len, rates.before, seed=args.seed,
                               fused_decode=fused, **settings)
        report["rows"] += rows
    report |= {"bandwidth": bound_at_the_higher_rate(report["rows"], rates), "copy_rate": rates.report()}
    if len(fused_settings) > 1:
        report["ratio_fused"] = fused_ratios(report["rows"], batches)
    write_report(report, args.out)
    return 0


def bound_at_the_higher_rate(rows: list[dict[str, Any]], rates: CopyRates) -> float:
    """Measure the copy rate again after the runs; when it came out higher, hold the rows (measured against the rate
    before them) to the stricter bound, and print their shares again. Returns the rate the rows are held to."""
    # zh: 运行结束后再测一次拷贝速率；如果它更高，就让这些行（按运行前的速率算的）改按更严的上限来算，并重新打印它们
    # zh: 占上限的比例。返回这些行所按的速率。
    rate = rates.after_runs()
    print(_say_latency("copy rate after the runs: {after:.2f} TB/s (before: {before:.2f})", after=rates.after / 1e12,
                       before=rates.before / 1e12))
    if rate > rates.before:
        for row in rows:
            row["bound_ms"] *= rates.before / rate
            row["fraction_of_bound"] = row["bound_ms"] / row["ms_per_step"]
        shares = ", ".join(f"{row['batch']}: {row['fraction_of_bound']:.1%}" for row in rows)
        print(_say_latency("held to the bound at {rate:.2f} TB/s, batch: share = {shares}", rate=rate / 1e12,
                           shares=shares))
    return rate


def fused_ratios(rows: list[dict[str, Any]], batches: list[int]) -> dict[int, float]:
    """Per batch, how many times as fast the fused decode layer ran as the unfused one (rows of both), printed."""
    # zh: 每个批大小下，融合 decode 层比不融合的快多少倍（两者的行），打印出来。
    ratios = {}
    for batch in batches:
        off, on = (next(row for row in rows if row["batch"] == batch and row["fused_decode"] is fused)
                   for fused in (False, True))
        ratio = ratios[batch] = off["ms_per_step"] / on["ms_per_step"]
        print(_say_latency("batch {batch:3d}: fused decode layer {ratio:.2f}x as fast ({off:.3f} -> {on:.3f} ms/step, "
                           "same invocation)", batch=batch, ratio=ratio, off=off["ms_per_step"], on=on["ms_per_step"]))
    return ratios


def measure_setting(model: str, batches: list[int], input_len: int, output_len: int, bandwidth: float, *,
                    seed: int, **config: Any) -> list[dict[str, Any]]:
    """One engine (config: `LLM` keyword arguments), each batch measured in turn: the report's rows."""
    # zh: 一个引擎（config：`LLM` 的关键字参数），依次测量每个批次：报告中的各行。
    from nanovllm.llm import LLM

    llm = LLM(model, **config)
    rows = []
    try:
        # en: A warm-up call, untimed.
        # zh: 预热调用，不计时。
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        print(f"fused_decode={llm.config.fused_decode}:")
        for batch in batches:
            row = measure_batch(llm, batch, input_len, output_len, bandwidth, seed=seed + batch)
            print(format_row(row))
            for name, launches, micros in (row.top_kernels or [])[:8] if batch == batches[0] else []:
                print(f"    {micros:8.1f} us/step {launches:5.1f}x  {name}")
            rows.append(asdict(row) | {"fused_decode": llm.config.fused_decode, "tokens_per_s": row.tokens_per_s,
                                       "fraction_of_bound": row.fraction_of_bound})
    finally:
        llm.exit()
    return rows


# %% latency phrases
#| exporti bench.latency
#| hide
from nanovllm.book.lang import Phrases

# en: What the latency benchmark prints, in Chinese when the book reads in Chinese (nanovllm.book.lang).
# zh: 延迟基准测试打印的文字的中文：本书以中文阅读时打印中文（nanovllm.book.lang）。
_say_latency = Phrases({
    "{kernels:6.0f} kernels, GPU busy {busy:6.3f} ms": "{kernels:6.0f} 个内核，GPU 忙 {busy:6.3f} ms",
    "kernels: not counted on a CPU": "内核：CPU 上不统计",
    ", graph alone {ms:6.3f} ms": "，单独重放图 {ms:6.3f} ms",
    "batch {batch:3d}: {ms:7.3f} ms/step, {rate:9,.0f} tok/s, bound {bound:6.3f} ms ({fraction:6.1%}), host "
    "{host:6.3f} ms (launch {launch:6.3f}), {kernels}":
        "批大小 {batch:3d}：每步 {ms:7.3f} ms，{rate:9,.0f} tok/s，上限 {bound:6.3f} ms（{fraction:6.1%}），"
        "主机 {host:6.3f} ms（启动 {launch:6.3f}），{kernels}",
    "on {gpu}": "在 {gpu} 上",
    "on this CPU (the figures and the bound are the CPU's)": "在这台 CPU 上（数字和上限都是 CPU 的）",
    "model: {model} {where} ({dtype}, kv cache {kv}); prompts of {input_len} tokens, {output_len} generated each":
        "模型：{model}，{where}，{dtype}，KV 缓存 {kv}；提示词 {input_len} 个 token，每个生成 {output_len} 个",
    "copy rate, measured before the runs: {rate:.2f} TB/s; weights a step reads: {mb:,.1f} MB":
        "运行前实测的拷贝速率：{rate:.2f} TB/s；一步读取的权重：{mb:,.1f} MB",
    "copy rate after the runs: {after:.2f} TB/s (before: {before:.2f})":
        "运行后的拷贝速率：{after:.2f} TB/s（运行前：{before:.2f}）",
    "held to the bound at {rate:.2f} TB/s, batch: share = {shares}":
        "按 {rate:.2f} TB/s 的上限来算，批大小：比例 = {shares}",
    "batch {batch:3d}: fused decode layer {ratio:.2f}x as fast ({off:.3f} -> {on:.3f} ms/step, same invocation)":
        "批大小 {batch:3d}：融合 decode 层快 {ratio:.2f} 倍（每步 {off:.3f} -> {on:.3f} ms，同一次调用）",
})

# %% [markdown] tags=["en"]
# ### See it
#
# On the tiny Qwen3, two batches of 16-token prompts generating 24 tokens each: 23 decode steps,
# the first 8 of which warm up untimed. What is checked is the arithmetic, not the timings: the
# weights a step reads are the model's parameters once (the tied embedding counted as the LM
# head, the final norm aside), which for Qwen3-0.6B is 1.19 GB, and each row's
# bound and fraction follow from the bytes and the copy rate the same run measured.

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# 在小 Qwen3 上跑两个批大小，提示词 16 个 token，各生成 24 个：共 23 个 decode 步，其中前 8 步用于预热、不计时。
# 这里检查的是算术，而不是计时：一步读取的权重就是模型参数各读一次（共享的词嵌入算作 LM head，最后的归一化层
# 除外），对 Qwen3-0.6B 来说就是 1.19 GB；每一行的上限和比例都由同一次运行测得的字节数和拷贝速率推出。

# %%
from nanovllm.bench.engine import kv_token_bytes, weight_bytes_per_step

tiny_qwen3 = build_tiny_model("qwen3")
latency_status = bench(["--latency", "--model", str(tiny_qwen3), "--device", "cpu", "--batches", "1", "2",
                        "--input-len", "16", "--output-len", "24", "--out", str(workdir / "latency.json")])
latency = json.loads((workdir / "latency.json").read_text())
assert latency_status == 0 and [row["batch"] for row in latency["rows"]] == [1, 2]
tiny_config = Config.from_kwargs(tiny_qwen3, device="cpu").hf_config
for row in latency["rows"]:
    # en: Decode steps after the prefill's token, less the warm-up.
    # zh: prefill 产出的那个 token 之后的 decode 步，减去预热的步数。
    assert row["steps"] == 24 - 1 - 8
    # en: Decode step k (9 to 23 are timed) reads the KV of the 16 prompt tokens and the k generated before it.
    # zh: 第 k 个 decode 步（计时的是第 9 到 23 步）读取 16 个提示词 token 与此前生成的 k 个 token 的 KV。
    step_bytes = weight_bytes_per_step(tiny_config, 4) + row["batch"] * (16 + 16) * kv_token_bytes(tiny_config, 4)
    assert abs(row["bound_ms"] - 1e3 * step_bytes / latency["bandwidth"]) < 1e-9 * row["bound_ms"]
    assert abs(row["fraction_of_bound"] - row["bound_ms"] / row["ms_per_step"]) < 1e-12
    assert abs(row["tokens_per_s"] - row["batch"] / (row["ms_per_step"] * 1e-3)) < 1e-6 * row["tokens_per_s"]
    # en: Counted only on a GPU.
    # zh: 只在 GPU 上统计。
    assert row["kernels_per_step"] is None and row["graph_ms"] is None
# en: GPU busy time is the union of the kernels' intervals: a kernel that starts early (PDL, chapter 15) and waits
# en: beside the one before it adds only what sticks out. Three kernels, the second starting 3 µs early:
# zh: GPU 忙碌时间是各 kernel 时间区间的并集：提前启动（PDL，第 15 章）、在前一个 kernel 旁边等待的 kernel，只算它
# zh: 多出来的那一段。三个 kernel，第二个提前 3 µs 启动：
from types import SimpleNamespace

from nanovllm.bench.latency import busy_microseconds

kernel_times = [SimpleNamespace(time_range=SimpleNamespace(start=a, end=b)) for a, b in [(0, 10), (7, 15), (20, 22)]]
assert busy_microseconds(kernel_times) == 15 + 2
# en: A decode step reads every weight but the final norm's.
# zh: 一个 decode 步读取除最后的归一化层之外的全部权重。
assert weight_bytes_per_step(qwen3_06b, 2) == 2 * (model_params(qwen3_06b) - 1024)
print(say("Qwen3-0.6B: a decode step reads {gb:.2f} GB of weights", gb=weight_bytes_per_step(qwen3_06b, 2) / 1e9))

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm.bench.engine` (`python -m nanovllm.bench`): nano-vllm's workload, draw for draw;
#   a fair `transformers` peer; the workload's physical bound; the engine's side, with tensor
#   parallelism or other attention backends compared in the same invocation.
# - `nanovllm.bench.models` gains Qwen3-8B's shapes, a directory without weights for
#   `load_format="dummy"`.
# - `nanovllm.bench.latency` (`python -m nanovllm.bench --latency`): one decode step at batches
#   1, 4, 16 and 64 against its bound, with the kernels it launches and the GPU time inside them.
# - `LLMEngine.stats()` (`EngineStats`: requests running and waiting, KV blocks in use) and
#   `set_observer`, through which benchmarks and the server watch the engine.
#
# ## Exercises
#
# 1. A batch of the peer holds requests wanting 100, 120 and 300 tokens. How many tokens does
#    `generate` produce for it, and how many count?
# 2. With `vocab_size=50`, what is the largest token id `make_workload` can draw?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.bench.engine`（`python -m nanovllm.bench`）：逐次抽样复现的 nano-vllm 基准负载；一个公平的
#   `transformers` 参照组；负载的物理上限；引擎一侧的测量，可在同一次调用中比较张量并行或不同的注意力后端。
# - `nanovllm.bench.models` 多了 Qwen3-8B 的形状：一个没有权重的目录，配合 `load_format="dummy"` 使用。
# - `nanovllm.bench.latency`（`python -m nanovllm.bench --latency`）：批大小为 1、4、16 和 64 时一个 decode 步
#   对照其上限的耗时，以及它启动的内核数和 GPU 花在其中的时间。
# - `LLMEngine.stats()`（`EngineStats`：运行中和等待中的请求数、在用的 KV 块数）和 `set_observer`：基准测试和服务器
#   通过它们观察引擎。
#
# ## 练习
#
# 1. 参照组的一个批次里有三个请求，分别要 100、120 和 300 个 token。`generate` 为这个批次生成多少个 token？其中多少个
#    计入结果？
# 2. `vocab_size=50` 时，`make_workload` 能抽到的最大 token id 是多少？
#
# 下面的单元检查答案。

# %%
import shutil

from nanovllm.bench.engine import Workload

# en: Exercise 1: 3 rows x 300 tokens = 900 generated; 100 + 120 + 300 = 520 counted.
# zh: 练习 1：3 行 × 300 个 token = 生成 900 个；计入 100 + 120 + 300 = 520 个。
three = Workload([[1], [1], [1]], [100, 120, 300])
(batch,) = peer_batches(three, batch_size=3)
assert len(batch) * max(three.output_lens[i] for i in batch) == 900 and three.num_output_tokens == 520

# en: Exercise 2: ids are drawn in [0, min(10000, vocab_size - 1)], so 49.
# zh: 练习 2：id 在 [0, min(10000, vocab_size - 1)] 中抽取，所以是 49。
assert max(max(p) for p in make_workload(64, (50, 50), (1, 1), vocab_size=50).prompts) == 49

# en: Remove the chapter's temporary model directories.
# zh: 删除本章的临时模型目录。
shutil.rmtree(workdir)
print(say("all exercise answers check out"))
