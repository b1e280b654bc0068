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
# # 25b · Speculation, measured: when drafts pay
#
# **Goal.** Chapter 25 built speculative decoding and checked that it changes nothing but the
# number of steps. This chapter measures what fewer steps buy, and when they buy nothing: a verify
# step costs more than a decode step, so a draft the model rejects is paid for. By the end you can
# run `python -m nanovllm.bench --speculative` and read its rows (steps, acceptance rate, tokens
# per verify step, tok/s), tell from what a verify step costs in decode steps whether speculation
# pays, explain each number of the back-off rule in chapter 25's `Speculator` by the measurement
# that set it, say why a draft model made of the model's own first layers drafts poorly, and read
# the `spec_decode` counters that a speculating server adds to `/metrics`.

# %% [markdown] tags=["zh"]
# # 25b · 投机解码实测：草稿什么时候划算
#
# **目标：** 第 25 章实现了投机解码，并检查了它除了步数什么都不改变。本章测量少掉的这些步能换来什么，以及什么时候什么
# 也换不来：一个验证步比一个 decode 步贵，所以模型拒绝的草稿是要付代价的。读完本章，你能运行
# `python -m nanovllm.bench --speculative` 并读懂它打印的每一行（步数、接受率、每个验证步的 token 数、tok/s），能从一个
# 验证步值几个 decode 步判断投机是否划算，能用定下每个数字的那次测量解释第 25 章 `Speculator` 里退避规则的各个数字，
# 能说出为什么用模型自己的前几层做成的草稿模型猜不准，还能读懂投机的服务器在 `/metrics` 里加上的 `spec_decode` 计数器。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "SmolLM2, {prompts} prompts that quote a passage, {tokens} tokens each: {plain} steps without speculation, "
    "{spec} with it ({ratio:.2f}x fewer); acceptance rate {rate:.0%}, {mean:.2f} tokens per verify step; "
    "identical outputs: {same} of {prompts}":
        "SmolLM2，{prompts} 个引用一段文字的提示词，每个 {tokens} 个 token：不投机 {plain} 步，投机 {spec} 步（步数为"
        "原来的 1/{ratio:.2f}）；接受率 {rate:.0%}，每个验证步 {mean:.2f} 个 token；输出完全相同的：{same} 个，共 "
        "{prompts} 个",
    "on this CPU: {plain:.1f} tok/s without, {spec:.1f} tok/s with speculation ({ratio:.2f}x)":
        "本机 CPU 上：不投机 {plain:.1f} tok/s，投机 {spec:.1f} tok/s（{ratio:.2f} 倍）",
    "what /metrics adds for a speculating engine:\n{lines}": "投机引擎在 /metrics 里多出的内容：\n{lines}",
    "batch {batch:2d}: {ratio:.2f}x; a verify step cost {cost:.1f} decode steps and gave {tokens:.2f} tokens; the "
    "rule gives each sequence {drafts} drafts":
        "批大小 {batch:2d}：{ratio:.2f} 倍；一个验证步值 {cost:.1f} 个 decode 步，产出 {tokens:.2f} 个 token；"
        "规则给每个序列 {drafts} 个草稿",
    "{card}, {date}: {command}": "{card}，{date}：{command}",
    "{name}: {card}, {date}, {command}": "{name}：{card}，{date}，{command}",
    "batch 1: {ratios} the plain engine ({low:,}-{high:,} tok/s plain), {tokens} tokens per verify step; the "
    "eager verify step before: {eager} tok/s against {sync:,}, {wall} ms a step, {gpu} ms of it kernels; the "
    "graphed one: {verify} ms against {decode} ms for a decode step":
        "批大小 1：普通引擎的 {ratios}（普通引擎 {low:,}-{high:,} tok/s），每个验证步 {tokens} 个 token；之前的 eager "
        "验证步：{eager} tok/s 对 {sync:,}，一步 {wall} ms，其中内核 {gpu} ms；图化之后：验证步 {verify} ms，decode 步 "
        "{decode} ms",
    "batch 1: {plain:,} -> {spec:,} tok/s, {ratio:.2f}x, {steps} steps for {tokens} tokens, {kept:.0%} of the "
    "drafts kept; a verify step cost {cost:.1f} decode steps":
        "批大小 1：{plain:,} -> {spec:,} tok/s，{ratio:.2f} 倍，{tokens} 个 token 用了 {steps} 步，{kept:.0%} 的草稿被"
        "保留；一个验证步值 {cost:.1f} 个 decode 步",
    "self draft of {layers} layers, none of its drafts kept: {fixed:.2f}x with a fixed pause (H100), "
    "{doubling:.2f}x with a doubling one (H200: {proposals} proposals in {tokens} tokens, {ms} ms, {plain} ms "
    "for the plain engine)":
        "{layers} 层的自草稿，一个草稿也没被保留：固定暂停时 {fixed:.2f} 倍（H100），加倍暂停时 {doubling:.2f} 倍"
        "（H200：{tokens} 个 token 里提议 {proposals} 次，共 {ms} ms，普通引擎生成它们要 {plain} ms）",
    "batch": "批大小", "plain": "普通", "{k} drafts": "{k} 个草稿",
    "batch 1, 7 drafts: {tokens} tokens per verify step; the host took {host} ms to launch a step":
        "批大小 1、7 个草稿：每个验证步 {tokens} 个 token；主机启动一步要 {host} ms",
    "the first rule, 64 rows: batch 16 at {ratio}x in {steps} steps (256 without); chapter 19's 256 "
    "sequences: {ratios}":
        "第一版规则，64 行：批大小 16 时 {ratio} 倍，{steps} 步（不投机 256 步）；第 19 章的 256 个序列：{ratios}",
    "drafts a sequence by batch {batches}: {fresh} for a fresh engine (each position kept half the time, "
    "{tokens:.1f} tokens a verify step with 7 drafts); {after} once 40 asks kept nothing":
        "按批大小 {batches}，每个序列的草稿数：新引擎 {fresh}（每个位置按一半被保留计，7 个草稿的验证步给 "
        "{tokens:.1f} 个 token）；40 次询问一个也没保留之后 {after}",
    "all exercise answers check out": "所有练习的答案都核对无误",
})

# %% [markdown] tags=["en"]
# ## Measure it: SmolLM2's real weights on a passage it quotes
#
# Random weights loop; real text does not, so the acceptance rate that matters is measured on a
# real model. SmolLM2-135M (chapter 10) gets prompts that quote a passage of chapter 25 and ask
# it to go on; a model continuing a quotation copies, and prompt lookup finds what it copies. The
# step counts say how many forwards speculation saves; what that buys depends on what a verify
# step costs, 2.0 to 2.9 decode steps at small batches on a GPU (below). The CPU's wall time is
# printed too, and a CPU pays for every extra row.

# %% [markdown] tags=["zh"]
# ## 测一测：SmolLM2 的真实权重引用一段文字
#
# 随机权重会陷入循环，真实的文本不会，所以真正有意义的接受率要在真实模型上测。给 SmolLM2-135M（第 10 章）的提示词引用了
# 第 25 章的一段文字，让它接着写；续写引文的模型会照抄，而 prompt lookup 能找到它抄的内容。步数说明投机省下了多少次前向
# 计算；这能换来多少速度，取决于一个验证步的代价：在 GPU 上小批大小时值 2.0 到 2.9 个 decode 步（见下文）。本机 CPU 上的
# 耗时也一并打印出来，而在 CPU 上，多出的每一行都要付出代价。

# %% [markdown] tags=["en"]
# The measurement is a benchmark of the package, `python -m nanovllm.bench --speculative`: the
# same requests through one engine built with prompt lookup, whose runs take turns: one with its
# speculator detached (then it is the plain engine, scheduling asynchronously), then one with
# drafts, and again, `--repeats` rounds, so that neither side always runs first on a GPU that is
# still warming up. Per batch size it prints the medians' tok/s, the ratio, the acceptance rate,
# the mean tokens a verify step gives, and how many outputs are identical. On a GPU it also runs
# chapter 19's 256-sequence workload (`--workloads nano-vllm`), to check that speculation costs
# nothing where the rule turns it off.

# %% [markdown] tags=["zh"]
# 测量用的是包里的一个基准测试 `python -m nanovllm.bench --speculative`：同一批请求交给同一个带 prompt lookup 的引擎，
# 它的各次运行轮流进行：先拆下投机器跑一次（这时它就是普通引擎，异步调度），再带草稿跑一次，如此重复 `--repeats` 轮，
# 这样在还在预热的 GPU 上，哪一边都不会总是先跑。对每个批大小，它打印中位数的 tok/s、二者之比、接受率、每个验证步平均
# 产出的 token 数，以及有多少输出完全相同。在 GPU 上它还会跑第 19 章那个 256 个序列的负载（`--workloads nano-vllm`），
# 确认在规则关掉投机的地方，投机不带来任何代价。

# %% bench speculative flag
#| export bench.engine
from nanovllm.bench.engine import OTHER_BENCHMARKS

OTHER_BENCHMARKS["--speculative"] = "nanovllm.bench.speculative"

# %% bench speculative
#| export bench.speculative
"""``python -m nanovllm.bench --speculative``: the engine with and without prompt lookup, on the same requests."""
# zh: ``python -m nanovllm.bench --speculative``：在同样的请求上，带和不带 prompt lookup 的引擎。

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
from typing import Any

import torch

from nanovllm.bench.engine import PRESETS, make_workload, watch_calls
from nanovllm.bench.models import qwen3_06b_random
from nanovllm.bench.report import Stopwatch, report_header, write_report
from nanovllm.config import DEFAULT_SPECULATIVE_TOKENS
from nanovllm.engine.speculative import DraftCounts, StepCosts
from nanovllm.sampling_params import SamplingParams

PASSAGE = (
    "A decode step computes each sequence's last token. A verify step computes the last token and its k drafts, "
    "so the drafts must have slots in the KV cache before the step runs. The scheduler has already picked the "
    "decode batch and made room for one token per sequence, preempting if it had to."
)


def quoting_prompts(count: int) -> list[str]:
    """Prompts that quote PASSAGE and ask for it again, cut at different places: a model continuing a quotation
    copies, and prompt lookup finds what it copies."""
    # zh: 引用 PASSAGE 并要求再写一遍的提示词，在不同的地方截断：续写引文的模型会照抄，而 prompt lookup
    # zh: 能找到它照抄的内容。
    head = (f"Here is a paragraph from a book about inference engines.\n\n{PASSAGE}\n\nThe same paragraph, copied "
            "word for word:\n\n")
    return [head + PASSAGE[: 40 + 50 * i % 200] for i in range(count)]


BUDGETS = ("measured", "fixed")


def timed_run(llm: Any, prompts: list, params: list[SamplingParams]) -> dict[str, Any]:
    """One timed `generate` of ``prompts`` on ``llm`` as it is set up now: the token ids, the seconds, the steps that
    computed tokens, and the speculator's counters, new for this run."""
    # zh: 在 ``llm`` 当前的设置下计时运行一次 ``prompts`` 的 `generate`：token id、秒数、计算了 token 的步数，以及
    # zh: 投机器在这次运行中新的计数器。
    steps: list[bool] = []
    counts = DraftCounts()
    if llm.speculator is not None:
        llm.speculator.counts = counts
    # en: A step that computed tokens counts (the first asynchronous call only queues one).
    # zh: 计算了 token 的一步才算（异步调度的第一次调用只是排队）。
    counting = watch_calls(llm, "_step", lambda _, step: steps.append(step is not None and step[1] > 0))
    with counting, Stopwatch(llm.config.device) as clock:
        outputs = [output["token_ids"] for output in llm.generate(prompts, params, use_tqdm=False)]
    return {"outputs": outputs, "seconds": clock.seconds, "steps": sum(steps), "counts": counts,
            "tok_s": sum(map(len, outputs)) / clock.seconds}


def compare(model: str, prompts: list, params: list[SamplingParams], num_speculative_tokens: int | list[int],
            verify_rows: int | None = None, draft_model: str | None = None, budgets: tuple[str, ...] = ("measured",),
            repeats: int = 1, **settings: Any) -> list[dict[str, Any]]:
    """Rows of the benchmark, from one engine built with prompt lookup (or ``draft_model``'s drafts) and
    ``settings``: its runs take turns, ``repeats`` rounds of a run without drafts (its speculator detached: the plain
    engine, scheduling asynchronously), then one run for each number of drafts and each budget ("measured": the
    step costs the engine measured when it started; "fixed": chapter 25's rule), so that the order of the runs
    cannot make a ratio. Each row: the medians, and the first round's steps, counters and outputs."""
    # zh: 基准测试的若干行，来自同一个带 prompt lookup（或 ``draft_model`` 的草稿）、用 ``settings`` 构建的引擎：它的
    # zh: 各次运行轮流进行，共 ``repeats`` 轮，每轮先跑一次不带草稿的（拆下投机器：就是普通引擎，异步调度），再对每种
    # zh: 草稿数、每种预算各跑一次（"measured"：引擎启动时测得的每步代价；"fixed"：第 25 章的规则），这样运行的先后
    # zh: 顺序造不出一个比值。每一行：中位数，以及第一轮的步数、计数器和输出。
    from nanovllm.llm import LLM

    drafts = [num_speculative_tokens] if isinstance(num_speculative_tokens, int) else list(num_speculative_tokens)
    method = {"speculative_method": "draft", "speculative_model": draft_model} if draft_model else \
        {"speculative_method": "ngram"}
    llm = LLM(model, num_speculative_tokens=max(drafts), **method, **settings)
    speculator = llm.speculator
    measured_costs = (speculator.costs, speculator.draft_costs)
    if speculator.costs is not None:
        print_costs(speculator.costs)
    if verify_rows is not None:
        speculator.max_verify_rows = verify_rows
    variants = [(k, budget) for k in drafts for budget in budgets]
    runs: dict[tuple[int, str] | None, list[dict[str, Any]]] = {key: [] for key in [None, *variants]}
    try:
        # en: A warm-up request, untimed and not counted.
        # zh: 一个预热请求，不计时也不计数。
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for _ in range(repeats):
            llm.speculator = None
            runs[None].append(timed_run(llm, prompts, params))
            llm.speculator = speculator
            for k, budget in variants:
                speculator.proposer.num_speculative_tokens = k
                speculator.costs, speculator.draft_costs = measured_costs if budget == "measured" else (None, None)
                runs[k, budget].append(timed_run(llm, prompts, params))
    finally:
        llm.exit()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    plain = runs[None]
    # en: Only greedy or seeded requests must come out the same; unseeded sampling differs from run to run anyway.
    # zh: 只有贪心或带种子的请求必须得到相同的输出；不带种子的采样每次运行本来就不同。
    comparable = all(p.temperature == 0 or p.seed is not None for p in params)
    plain_tok_s = statistics.median(run["tok_s"] for run in plain)
    rows = []
    for (k, budget), spec in ((key, runs[key]) for key in variants):
        counts, spec_tok_s = spec[0]["counts"], statistics.median(run["tok_s"] for run in spec)
        same = sum(a == b for a, b in zip(plain[0]["outputs"], spec[0]["outputs"], strict=True)) if comparable \
            else None
        rows.append({
            "batch": len(prompts), "plain_tok_s": plain_tok_s, "speculative_tok_s": spec_tok_s,
            "ratio": spec_tok_s / plain_tok_s, "plain_steps": plain[0]["steps"], "speculative_steps": spec[0]["steps"],
            "acceptance": counts.accepted / counts.drafted if counts.drafted else None,
            "tokens_per_verify": 1 + counts.accepted / counts.verifications if counts.verifications else None,
            "drafted": counts.drafted, "identical": same, "num_speculative_tokens": k, "budget": budget,
            "step_costs": dataclasses.asdict(measured_costs[0]) if measured_costs[0] else None, "repeats": repeats,
            "proposer": "the draft model" if draft_model else "prompt lookup"})  # fmt: skip
    return rows


def print_costs(costs: StepCosts) -> None:
    """The step costs an engine measured when it started, in milliseconds, by rows."""
    # zh: 引擎启动时测得的每步代价，按行数列出，单位毫秒。
    print("step costs measured at start, ms (rows: decode step / verify step): " + ", ".join(
        f"{rows}: {decode * 1e3:.3f} / {verify * 1e3:.3f}"
        for rows, decode, verify in zip(costs.sizes, costs.decode_seconds, costs.verify_seconds, strict=True)))


def print_row(row: dict[str, Any]) -> None:
    rate = "no drafts" if row["acceptance"] is None else (
        f"acceptance {row['acceptance']:.0%}, {row['tokens_per_verify']:.2f} tokens per verify")
    drafts = row["num_speculative_tokens"]
    print(f"batch {row['batch']:4d}, {drafts} draft{'s' * (drafts != 1)}: {row['plain_tok_s']:9.1f} tok/s plain, "
          f"{row['speculative_tok_s']:9.1f} with {row['proposer']} ({row['ratio']:.2f}x)"
          + (", chapter 25's fixed rule" if row["budget"] == "fixed" else "") + f"; steps {row['plain_steps']} "
          f"-> {row['speculative_steps']}; {rate}; "
          + ("outputs sampled without a seed, not compared" if row["identical"] is None else
             f"identical outputs {row['identical']}/{row['batch']}"))


def workload_cases(name: str, args: argparse.Namespace) -> tuple[str, list[tuple[list, list[SamplingParams]]]]:
    """The model and the (prompts, params) of each row of one workload."""
    # zh: 一种负载每一行的模型以及 (prompts, params)。
    if name == "nano-vllm":
        workload = make_workload(**PRESETS["nano-vllm"])
        return str(qwen3_06b_random()), [(workload.prompts, workload.sampling_params())]
    from nanovllm.book.smollm2 import smollm2_dir

    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    return args.model or str(smollm2_dir()), [(quoting_prompts(batch), [greedy] * batch) for batch in args.batches]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench --speculative",
                                     description="The engine with and without prompt lookup, on the same requests.")
    parser.add_argument("--workloads", nargs="+", choices=["quoting", "nano-vllm"],
                        help="quoting: prompts that quote a passage (greedy), one row per --batches; nano-vllm: "
                        "the nano-vllm benchmark's 256 random prompts (temperature 0.6) on Qwen3-0.6B's shapes; "
                        "default: both on CUDA, quoting on a CPU")
    parser.add_argument("--model", help="the quoting workload's model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens each quoting request generates")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[DEFAULT_SPECULATIVE_TOKENS],
                        help="drafts a step; with several numbers, one speculating engine each against the same "
                        "plain run")
    parser.add_argument("--draft-model", help="drafts from this smaller model (speculative_method='draft') instead of "
                        "prompt lookup; it must share the model's tokenizer")
    parser.add_argument("--verify-rows", type=int, help="override Speculator.max_verify_rows (chapter 25's fixed rule)")
    parser.add_argument("--budget", choices=[*BUDGETS, "both"], default="measured",
                        help="drafts a step from the step costs measured when the engine starts (measured; on a CPU "
                        "there are none, and chapter 25's fixed rule decides), from that fixed rule, or both in turns")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of runs taking turns; medians are reported")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    workloads = args.workloads or (["quoting", "nano-vllm"] if cuda else ["quoting"])
    report = report_header("python -m nanovllm.bench --speculative", argv, "cuda" if cuda else "cpu") | {"rows": []}
    settings = dict(repeats=args.repeats, device=args.device, max_model_len=4096)
    budgets = BUDGETS if args.budget == "both" else (args.budget,)
    for name in workloads:
        model, cases = workload_cases(name, args)
        print(f"{name} workload on {model}:")
        for prompts, params in cases:
            for row in compare(model, prompts, params, args.num_speculative_tokens, args.verify_rows, args.draft_model,
                               budgets, **settings):
                print_row(row)
                report["rows"].append({"workload": name, "model": model} | row)
    write_report(report, args.out)
    return 0


# %%
from nanovllm.bench.speculative import compare, quoting_prompts
from nanovllm.book.smollm2 import smollm2_dir

greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
[row] = compare(str(smollm2_dir()), quoting_prompts(3), [greedy] * 3, num_speculative_tokens=4, device="cpu",
                kvcache_block_size=16, num_kvcache_blocks=64)
print(say("SmolLM2, {prompts} prompts that quote a passage, {tokens} tokens each: {plain} steps without speculation, "
          "{spec} with it ({ratio:.2f}x fewer); acceptance rate {rate:.0%}, {mean:.2f} tokens per verify step; "
          "identical outputs: {same} of {prompts}", prompts=row["batch"], tokens=greedy.max_tokens,
          plain=row["plain_steps"], spec=row["speculative_steps"], ratio=row["plain_steps"] / row["speculative_steps"],
          rate=row["acceptance"], mean=row["tokens_per_verify"], same=row["identical"]))
print(say("on this CPU: {plain:.1f} tok/s without, {spec:.1f} tok/s with speculation ({ratio:.2f}x)",
          plain=row["plain_tok_s"], spec=row["speculative_tok_s"], ratio=row["ratio"]))
assert row["identical"] == row["batch"] and row["tokens_per_verify"] > 2
assert row["speculative_steps"] < row["plain_steps"]

# %% [markdown] tags=["en"]
# ## When it pays: the back-off rule, measured
#
# A decode step of *b* sequences costs some time *T*(*b*) and gives *b* tokens. A verify step with
# *k* drafts each costs about *T*(*b*(*k* + 1)), plus what the host does while the GPU waits (a
# verify step is synchronous), and gives *b* · *E* tokens, *E* being the mean tokens a verify step
# gives a sequence. Speculation pays while the verify step costs fewer than *E* decode steps. On
# the GPU's side, timed on one H200 with Qwen3-0.6B's shapes and the decode graph replayed alone
# (as chapter 15 times it), *T* jumped between 2 and 4 rows, where the matmuls then left chapter
# 15's fused GEMV for cuBLAS, grew slowly up to 16 rows, then about linearly, so rows are cheap
# only while the batch is small.
#
# The benchmark settled the rest (the table below, recorded on one H200 with SmolLM2 quoting a
# passage). A first rule allowed 64 rows: the 16-sequence batch verified three drafts each and ran
# at 0.88× the plain engine, although its steps fell from 256 to 135. At batch 1 the steps fell
# from 256 to 95 for only 1.12× the throughput: a verify step costs about 2.4 pipelined decode steps
# there. Its five rows replay the graph of 8, whose matmuls then ran through cuBLAS (chapter 15's
# fused GEMV took at most two rows at the time; it takes four since) and took far more GPU time
# than one row, and a verify step is synchronous besides. Hence the rule of
# chapter 25's `Speculator`: at most 16 rows, no drafts when that leaves a sequence fewer than two (so
# none past 5 sequences), and a sequence whose recent verify steps gave fewer than two tokens
# pauses its drafts for 16 tokens, then 32, 64 and so on up to 512 while no verify step gives two
# (a draft model that never agreed ran at 0.56× with fixed pauses: see the next section). (Batch 2 lost
# 6 % in this run, its verify step costing 2.9 decode steps against 2.4 at batch 1; whether that is
# noise or a cost of its 16-row graph is not yet known, and the rule still speculates there.) An
# engine in which no sequence may draft schedules asynchronously as before: on chapter 19's
# 256-sequence workload the speculating engine ran at 0.99× and 1.01× the plain one in two runs,
# as the same harness measured with drafts switched off altogether (0.99×).

# %% [markdown] tags=["zh"]
# ## 什么时候划算：退避规则，实测得来
#
# 一个有 *b* 个序列的 decode 步花费时间 *T*(*b*)，产出 *b* 个 token。每个序列带 *k* 个草稿的验证步大约花费
# *T*(*b*(*k* + 1))，再加上 GPU 等待期间主机做的事（验证步是同步的），产出 *b* · *E* 个 token，*E* 是一个验证步
# 平均为一个序列产出的 token 数。只要验证步的花费少于 *E* 个 decode 步，投机就划算。GPU 这一侧，在一块 H200 上用
# Qwen3-0.6B 的形状单独重放 decode 图（计时方法同第 15 章）：*T* 在 2 行到 4 行之间陡增（当时矩阵乘法在这里从
# 第 15 章融合的 GEMV 换成 cuBLAS），16 行以内增长很慢，之后大致线性增长。所以只有批小的时候，多出来的行才便宜。
#
# 剩下的由基准测试来定（见下表，在一块 H200 上用 SmolLM2 引用一段文字时记录）。第一版规则允许 64 行：16 个序列的批每个序
# 列验证三个草稿，步数虽然从 256 降到了 135，速度却只有普通引擎的 0.88 倍。批大小为 1 时，步数从 256 降到 95，吞吐量却只
# 提高到 1.12 倍：在这里，一个验证步要花掉约 2.4 个流水线化的 decode 步。它的五行重放的是 8 行的图，当时图里的矩阵乘法
# 走 cuBLAS（第 15 章融合的 GEMV 那时最多只接两行，后来能接四行），GPU 时间远多于一行；何况验证步还是同步的。于是有了第
# 25 章 `Speculator` 的规则：最多 16 行；按这个上限分到每个序列的草稿如果不到两个，就干脆不给（所以超过 5 个序列就没有草
# 稿）；一个序列最近的验证步如果平均产出不到两个 token，就在接下来的 16 个 token 里暂停草稿，之后只要还没有哪个验证步产
# 出两个 token，暂停就依次延长到 32、64……最长 512 个 token（一个从来猜不对的草稿模型，在固定长度的暂停下只跑出 0.56 倍：
# 见下一节）。（这次测量中批大小为 2 时慢了 6%，它的验证步值 2.9 个 decode 步，而批大小为 1 时是 2.4 个；这是噪声，还是
# 那张 16 行的图带来的代价，目前还不清楚，规则在那里仍然投机。）没有哪个序列能拿草稿时，引擎照旧异步调度：在第 19 章
# 256 个序列的负载上，投机的引擎两次运行分别跑出普通引擎的 0.99 倍和 1.01 倍，和同一套测量在完全关掉草稿时的结果一样
# （0.99 倍）。

# %%
from nanovllm.book.recorded import recorded
from nanovllm.engine.speculative import NgramProposer, Speculator

# en: What this chapter's GPU runs printed (notebooks/data/recorded/25b_speculation_measured.json), each with its card,
# en: date and command. The table that set the rule: 16 rows and no minimum of drafts (at 16 sequences that left
# en: none); each row: batch, plain tok/s, speculative tok/s, steps with speculation (256 without), tokens per verify
# en: step.
# zh: 本章各次 GPU 运行打印出的数字（notebooks/data/recorded/25b_speculation_measured.json），每次都带着卡、日期和
# zh: 命令。定下规则的那张表：16 行、不设草稿下限（16 个序列时一个草稿也分不到）；每一行：批大小、普通 tok/s、
# zh: 投机 tok/s、投机时的步数（不投机为 256）、每个验证步的 token 数。
gpu_runs = recorded("25b_speculation_measured")
table = gpu_runs["back-off table"]
print(say("{card}, {date}: {command}", card=table.card, date=table.date, command=table.command))
backoff_rows = [tuple(row) for row in table.figures["rows"]]
rule = Speculator(NgramProposer(num_speculative_tokens=7))
for batch, plain, spec, steps, per_verify in backoff_rows:
    # en: what a verify step cost, in decode steps: how many fewer steps, over how much faster
    # zh: 一个验证步值多少个 decode 步：步数少了多少倍，除以快了多少倍。
    cost = (256 / steps) / (spec / plain)
    print(say("batch {batch:2d}: {ratio:.2f}x; a verify step cost {cost:.1f} decode steps and gave {tokens:.2f} "
              "tokens; the rule gives each sequence {drafts} drafts", batch=batch, ratio=spec / plain, cost=cost,
              tokens=per_verify, drafts=min(4, rule.drafts_per_sequence(batch))))
# en: Batch 1: a verify step cost more than two decode steps, which is why a sequence must average two tokens a step.
# zh: 批大小为 1：一个验证步的代价超过两个 decode 步，所以一个序列平均每步要产出两个 token。
costs = {batch: (256 / steps) / (spec / plain) for batch, plain, spec, steps, _ in backoff_rows}
assert costs[1] > rule.min_tokens_per_verify and table.figures["steps without speculation"] == 256
# en: The prose's figures: batch 1 at 1.12x in 95 steps, a verify step worth 2.4 decode steps there and 2.9 at batch 2,
# en: which lost 6 %.
# zh: 正文里的数字：批大小 1 时 1.12 倍、95 步，那里一个验证步值 2.4 个 decode 步，批大小 2 时值 2.9 个，后者慢了 6%。
assert round(backoff_rows[0][2] / backoff_rows[0][1], 2) == 1.12 and backoff_rows[0][3] == 95
assert (round(costs[1], 1), round(costs[2], 1)) == (2.4, 2.9)
assert round(1 - backoff_rows[1][2] / backoff_rows[1][1], 2) == 0.06
# en: The same day's other calls of the benchmark: the first rule (64 rows) lost at 16 sequences though its steps fell,
# en: and where no sequence may draft (chapter 19's 256 sequences) the engine keeps the plain one's speed.
# zh: 同一天基准测试的其他几次调用：第一版规则（64 行）在 16 个序列时步数少了，速度却变慢；没有序列能拿草稿的地方
# zh: （第 19 章的 256 个序列），引擎保持普通引擎的速度。
same_day = gpu_runs["bench, 2026-12-04"].figures
first_rule, invocations = same_day["first rule, 64 rows"], same_day["three invocations"]
at_256 = [*invocations["nano-vllm workload ratios"], invocations["nano-vllm workload ratio, drafts switched off"]]
print(say("the first rule, 64 rows: batch 16 at {ratio}x in {steps} steps (256 without); chapter 19's 256 "
          "sequences: {ratios}", ratio=first_rule["ratio"], steps=first_rule["speculative steps"],
          ratios=", ".join(f"{ratio:.2f}x" for ratio in at_256)))
assert first_rule["ratio"] < 1 and first_rule["speculative steps"] < first_rule["plain steps"] == 256
assert all(0.99 <= ratio <= 1.01 for ratio in at_256)
# en: The rule speculates at the batches that gained and not at 8, which lost with one draft per sequence.
# zh: 规则在有收益的批大小上投机，在 8 上不投机：那里每个序列一个草稿，结果变慢了。
assert rule.drafts_per_sequence(1) >= 4 and rule.drafts_per_sequence(4) == 3 and rule.drafts_per_sequence(8) == 0

# %% [markdown] tags=["en"]
# ## The draft model, measured: a self draft
#
# Chapter 25's `write_self_draft` makes a draft model of the model's own first layers, with its
# embedding, its final norm and its LM head: cheaper by the share of layers it drops, right as
# often as those first layers already know the next token. Do not expect much of it: layers
# trained to feed more layers guess the last layer's answer poorly. On SmolLM2 (30 layers, greedy,
# 64 tokens of a quoting prompt and of a story prompt, measured on this book's CPU machine), a self
# draft of its first 24 layers saw 16 and 10 % of its drafts kept, one of its first 8 layers 2 and
# 1 %; the back-off rule of the section before then pauses it.
#
# On an H100 (2026-12-05, `scripts/gpu-ci.sh speculative`, SmolLM2 quoting a passage, one
# sequence) the 8-layer self draft had none of its drafts kept and ran at 0.56× the plain engine:
# each time its pause of 16 tokens ended, the draft engine caught up and drafted for a verify step
# that kept nothing. The pause now doubles while the drafts keep failing: on an H200 (2026-12-05,
# the same command) the same draft proposed six times in 256 tokens, none kept, and ran at 0.73×.
# Those six proposals cost some 48 ms, about 8 ms each (a whole `generate` call of the draft
# engine: catching up on the tokens of the pause, then four drafts), against 126 ms for the plain
# engine's 256 tokens. Engines that speculate with a model ship one trained for the job.

# %% [markdown] tags=["zh"]
# ## 草稿模型实测：自草稿
#
# 第 25 章的 `write_self_draft` 用模型自己的前几层，加上它的嵌入层、最后的归一化和 LM head，做成一个草稿模型：丢掉多少
# 层，就省下多少计算；前几层已经知道下一个 token 时，它就猜得对。别对它期望太高：这些层训练出来是为了给后面的层提供输入
# 的，猜不准最后一层的答案。在 SmolLM2 上（30 层，贪心解码，一个引用型提示词和一个故事型提示词各生成 64 个 token，在本
# 书的 CPU 机器上测量），取前 24 层的自草稿，草稿保留了 16% 和 10%，取前 8 层的只有 2% 和 1%；接着，上一节的退避规则就
# 会让它暂停。
#
# 在一块 H100 上（2026-12-05，`scripts/gpu-ci.sh speculative`，SmolLM2 引用一段文字，一个序列），前 8 层的自草稿一个草
# 稿也没保留下来，只跑出普通引擎的 0.56 倍：每当 16 个 token 的暂停结束，草稿引擎就得先补算，再为一个什么也保留不了的验
# 证步提议草稿。现在，草稿一直失败，暂停就会加倍：在一块 H200 上（2026-12-05，同一条命令），同一个草稿模型在 256 个
# token 里提议了六次，一个草稿也没保留，跑出 0.73 倍。这六次提议大约花了 48 ms，每次约 8 ms（草稿引擎完整的一次
# `generate` 调用：先补算暂停期间的 token，再生成四个草稿），而普通引擎生成这 256 个 token 一共只要 126 ms。真正用模型
# 做投机的引擎，用的都是专门为此训练的草稿模型。

# %%
# en: The self draft's two GPU runs (2026-12-05): fixed pauses on an H100, doubling ones on an H200.
# zh: 自草稿的两次 GPU 运行（2026-12-05）：H100 上是固定暂停，H200 上是加倍暂停。
h200 = gpu_runs["gpu-ci speculative, H200"].figures
self_draft_h200 = h200["self draft"]
self_draft_h100 = gpu_runs["gpu-ci speculative, H100"].figures["self draft"]
print(say("self draft of {layers} layers, none of its drafts kept: {fixed:.2f}x with a fixed pause (H100), "
          "{doubling:.2f}x with a doubling one (H200: {proposals} proposals in {tokens} tokens, {ms} ms, {plain} ms "
          "for the plain engine)", layers=self_draft_h200["layers"], fixed=self_draft_h100["ratio"],
          doubling=self_draft_h200["ratio"], proposals=self_draft_h200["proposals"], tokens=self_draft_h200["tokens"],
          ms=self_draft_h200["proposals ms"], plain=self_draft_h200["plain engine ms"]))
assert self_draft_h100["drafts kept"] == self_draft_h200["drafts kept"] == 0
assert self_draft_h100["ratio"] < self_draft_h200["ratio"] < 1
assert self_draft_h200["proposals ms"] / self_draft_h200["proposals"] == 8

# %% [markdown] tags=["en"]
# ## A draft budget from measured costs
#
# The rule of "When it pays" is one machine's measurement frozen into constants: 16 rows, at
# least two drafts, hence none past 5 sequences. It was right on that H200 in that week; on
# another card, another model, or after chapter 15 made a step of four rows cheaper, it is simply
# old. The question it answers is always the same: does a verify step with *k* drafts give more
# tokens a second than the plain decode step it replaces? Both sides can be measured where the
# engine runs, so the engine measures them once when it starts, and asks the question again at
# every step.
#
# - `StepCosts`: for some sizes of the decode graphs (the powers of two, and the largest), the
#   seconds of a decode step of that many sequences, queued back to back as asynchronous
#   scheduling queues them, and of a verify step of that many rows, run to the end as the engine
#   runs one. `ModelRunner.step_costs` measures them through the runner's own `launch` and
#   `verify`, on sequences that attend to 512 tokens, before the first request; without graphs (a
#   CPU) it returns None and chapter 25's fixed rule stays.
# - `Speculator.expected_tokens(k)`: the tokens a verify step is expected to give a sequence that
#   may get *k* drafts. Its own token, plus, for each position *i* < *k*, the share of the times a
#   sequence had room for a draft at *i* that a draft came and was kept there (`DraftCounts` now
#   counts the rooms the speculator asks its proposer to fill, `asked_by_position`). A position
#   nobody asked about yet counts as kept half the time, with the weight of two asks, so a fresh
#   engine tries its drafts, and two asks that keep nothing bring the estimate down to a quarter.
# - `Speculator.drafts_per_sequence(b)`: the *k* that gives the most tokens a second, *b* ·
#   *E*(*k*) over the verify step's cost (plus, with a draft model, *k* of the draft's decode
#   steps), against *b* over a decode step's cost; 0 when the plain step wins.
#
# The prompts decide the rest: prompt lookup on text that never repeats proposes nothing, the
# shares fall, and the budget goes to 0 at every batch, where the engine schedules asynchronously
# again.

# %% [markdown] tags=["zh"]
# ## 按实测代价定草稿预算
#
# “什么时候划算”一节的规则，是一台机器上的测量结果冻结成的常数：16 行，至少两个草稿，所以超过 5 个序列就没有草稿。它在那
# 一周的那块 H200 上是对的；换一块卡、换一个模型，或者在第 15 章让四行的一步变便宜之后，它就只是过时了。它回答的问题始终
# 是同一个：带 *k* 个草稿的验证步，每秒给出的 token 是否比它所替代的普通 decode 步多？这两边都可以在引擎运行的地方测
# 出来，所以引擎在启动时测一次，然后在每一步都重新问一遍这个问题。
#
# - `StepCosts`：对 decode 图的若干个大小（2 的幂，以及最大的那个），分别记下这么多序列的一个 decode 步（像异步调度那样
#   一步接一步排队）和这么多行的一个验证步（像引擎那样一直跑到结束）的秒数。`ModelRunner.step_costs` 通过运行器自己的
#   `launch` 和 `verify` 来测，用的序列都看 512 个 token，在第一个请求之前测；没有图时（CPU）它返回 None，第 25 章的固定
#   规则保持不变。
# - `Speculator.expected_tokens(k)`：一个最多可得 *k* 个草稿的序列，一个验证步预计给它的 token 数。它自己的 token，加上
#   对每个位置 *i* < *k*，序列在 *i* 有草稿空位的那些次数里，草稿既来了又被保留的比例（`DraftCounts` 现在统计投机器请
#   提议器填的空位，即 `asked_by_position`）。还没有人问过的位置，按一半被保留计，权重相当于问过两次，所以新启动的引擎
#   会先试试草稿，两次什么都没保留的询问就把估计降到四分之一。
# - `Speculator.drafts_per_sequence(b)`：让每秒 token 数最多的那个 *k*，即 *b* · *E*(*k*) 除以验证步的代价（用草稿模型
#   时再加上草稿模型的 *k* 个 decode 步），与 *b* 除以一个 decode 步的代价相比；普通的一步更好时为 0。
#
# 剩下的由提示词决定：在从不重复的文本上，提示词查找什么也提议不出来，各个比例随之下降，预算在每个批大小上都变成 0，这时
# 引擎又异步调度了。

# %% step costs
#| export engine.speculative
import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """What a step costs on this machine, measured once when the engine starts (`ModelRunner.step_costs`): for some
    sizes of the decode graphs, the seconds of a decode step of that many sequences, queued back to back as
    asynchronous scheduling queues them, and of a verify step of that many rows, run to the end as the engine runs
    one. Between two measured sizes a cost is interpolated."""
    # zh: 这台机器上一步的代价，在引擎启动时测一次（`ModelRunner.step_costs`）：对 decode 图的若干个大小，分别记下
    # zh: 这么多序列的一个 decode 步（像异步调度那样一步接一步排队）和这么多行的一个验证步（像引擎那样一直跑到
    # zh: 结束）的秒数。两个测过的大小之间的代价用插值求出。

    sizes: tuple[int, ...]
    decode_seconds: tuple[float, ...]
    verify_seconds: tuple[float, ...]

    def covers(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is within the measured sizes (a larger one would run without a graph)."""
        # zh: ``rows`` 行的一步是否在测过的大小之内（更大的一步不会用图来跑）。
        return 1 <= rows <= self.sizes[-1]

    def decode(self, batch: int) -> float:
        return self._at(self.decode_seconds, batch)

    def verify(self, rows: int) -> float:
        return self._at(self.verify_seconds, rows)

    def _at(self, seconds: tuple[float, ...], rows: int) -> float:
        assert self.covers(rows), f"no cost measured for {rows} rows (sizes {self.sizes})"
        right = bisect.bisect_left(self.sizes, rows)
        if self.sizes[right] == rows or right == 0:
            return seconds[right]
        left = right - 1
        share = (rows - self.sizes[left]) / (self.sizes[right] - self.sizes[left])
        return seconds[left] + share * (seconds[right] - seconds[left])


# %% runner measures its steps
#| export engine.model_runner
import time
from collections.abc import Callable
from typing import Any

import torch

from nanovllm.book.literate import add_to_class
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import StepCosts
from nanovllm.sampling_params import SamplingParams


@add_to_class(ModelRunner)
@torch.inference_mode()
def step_costs(self, context_len: int = 512, repeats: int = 8) -> StepCosts | None:
    """Time a decode step and a verify step at the powers of two among the decode graphs' sizes, and at the largest
    (None without graphs: a CPU has no fixed cost worth a table). Every row attends to ``context_len`` tokens
    through the same blocks: run it before the first request, while the cache holds nothing to keep."""
    # zh: 在 decode 图大小中的 2 的幂和最大的那个上，为一个 decode 步和一个验证步计时（没有图时为 None：CPU 上没有
    # zh: 值得列表的固定代价）。每一行都通过同一组块看 ``context_len`` 个 token：要在第一个请求之前运行，那时缓存里
    # zh: 没有需要保留的东西。
    if self.graphs is None:
        return None
    length = max(2, min(context_len, self.config.max_model_len, self.kv_cache.shape[2] * self.block_size))
    table = list(range(-(-length // self.block_size)))
    sizes = [s for s in self.graphs.sizes if s & (s - 1) == 0 or s == self.graphs.sizes[-1]]
    decode, verify = [], []
    for size in sizes:
        seqs = [Sequence([0] * length, SamplingParams(temperature=0.0), block_size=self.block_size)
                for _ in range(size)]
        for seq in seqs:
            seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = table, length - 1, 1
        # en: Decode steps queue without waiting, as asynchronous scheduling queues them, and only the last is waited
        # en: for; a verify step waits for its tokens (one row a sequence here: its cost goes by its rows).
        # zh: decode 步不等待地排队，就像异步调度那样，只等最后一个；验证步要等它的 token（这里每个序列一行：
        # zh: 它的代价按行数算）。
        decode.append(seconds_per_call(lambda s=seqs: self.launch(s, False), repeats, SampledTokens.token_ids))
        verify.append(seconds_per_call(lambda s=seqs: self.verify(s), repeats))
    return StepCosts(tuple(sizes), tuple(decode), tuple(verify))


def seconds_per_call(call: Callable[[], Any], repeats: int, wait: Callable[[Any], Any] | None = None) -> float:
    """The mean seconds of ``call`` over ``repeats`` calls after one untimed call, waiting (``wait``) only on the
    last call's result."""
    # zh: 在一次不计时的调用之后，``call`` 在 ``repeats`` 次调用上的平均秒数，只等待（``wait``）最后一次调用的结果。
    for timed in (False, True):
        start = time.perf_counter()
        for _ in range(repeats if timed else 1):
            result = call()
        if wait is not None:
            wait(result)
    return (time.perf_counter() - start) / repeats


# %% a budget from the costs
#| export engine.speculative
from nanovllm.book.literate import add_to_class, add_to_init

# en: Before any draft at a position, a draft there counts as kept half the time, with the weight of PRIOR_WEIGHT asks:
# en: two asks that keep nothing bring the estimate to a quarter.
# zh: 一个位置上还没有任何草稿时，那里的草稿按一半被保留计，权重相当于问过 PRIOR_WEIGHT 次：两次什么都没保留的询问
# zh: 就把估计降到四分之一。
PRIOR_KEPT, PRIOR_WEIGHT = 0.5, 2


@add_to_init(Speculator)
def _init_costs(self) -> None:
    # en: The measured costs of the model's steps and, with a draft model, of the draft's: None until the engine
    # en: measures them (and on a CPU), which keeps chapter 25's fixed rule.
    # zh: 测得的模型各步的代价；用草稿模型时还有草稿模型的：引擎测出来之前（以及在 CPU 上）为 None，那时用第 25 章的
    # zh: 固定规则。
    self.costs: StepCosts | None = None
    self.draft_costs: StepCosts | None = None


@add_to_class(Speculator)
def expected_tokens(self, drafts: int) -> float:
    """The tokens a verify step is expected to give a sequence that may get ``drafts`` drafts: its own token, plus,
    for each position, the share of the asks for a draft there that got one kept (`DraftCounts`)."""
    # zh: 一个最多可得 ``drafts`` 个草稿的序列，一个验证步预计给它的 token 数：它自己的 token，加上每个位置上，
    # zh: 在那里要草稿的询问中得到并保留了草稿的比例（`DraftCounts`）。
    asked, kept = self.counts.asked_by_position, self.counts.accepted_by_position
    tokens = 1.0
    for position in range(drafts):
        asks = asked[position] if position < len(asked) else 0
        keeps = kept[position] if position < len(kept) else 0
        tokens += (keeps + PRIOR_KEPT * PRIOR_WEIGHT) / (asks + PRIOR_WEIGHT)
    return tokens


@add_to_class(Speculator)
def drafts_per_sequence(self, batch: int) -> int:
    """How many drafts each sequence of a decode batch of ``batch`` may get: the number whose verify step is
    expected to give the most tokens a second by the measured costs (`expected_tokens` over the verify step's cost
    and the draft model's steps), 0 when a plain decode step gives more. Without costs, chapter 25's fixed rule."""
    # zh: 一个 ``batch`` 个序列的 decode 批次里，每个序列最多得到几个草稿：按测得的代价，验证步预计每秒给出 token
    # zh: 最多的那个数目（`expected_tokens` 除以验证步和草稿模型各步的代价）；普通 decode 步给得更多时为 0。
    # zh: 没有代价时，用第 25 章的固定规则。
    if self.costs is None:
        drafts = self.max_verify_rows // max(1, batch) - 1
        return drafts if drafts >= self.min_drafts else 0
    best, best_rate = 0, 1 / self.costs.decode(batch)
    for drafts in range(1, self.proposer.num_speculative_tokens + 1):
        if not self.costs.covers(batch * (drafts + 1)):
            break
        seconds = self.costs.verify(batch * (drafts + 1))
        if self.draft_costs is not None:
            seconds += drafts * self.draft_costs.decode(batch)
        if (rate := self.expected_tokens(drafts) / seconds) > best_rate:
            best, best_rate = drafts, rate
    return best


# %% engine measures its steps
#| export engine.llm_engine
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.speculative import DraftModelProposer


@add_to_init(LLMEngine)
def _measure_step_costs(self) -> None:
    # en: The draft budget's costs, measured on this machine before the first request (none without graphs).
    # zh: 草稿预算用的代价，在第一个请求之前在这台机器上测出（没有图时没有）。
    if self.speculator is not None:
        self.speculator.costs = self.model_runner.step_costs()
        proposer = self.speculator.proposer
        if self.speculator.costs is not None and isinstance(proposer, DraftModelProposer):
            self.speculator.draft_costs = proposer.engine.model_runner.step_costs()

# %% [markdown] tags=["en"]
# The budget on a table shaped like a GPU's at small batches, made up for the lesson (not measured:
# a decode step of any size up to 64 sequences takes 1 ms, a verify step 1 ms plus 5 % per row past
# the first, then nothing more is measured), for an engine that has drafted nothing yet, then after
# its proposer was asked 40 times at every position and kept nothing. On this CPU the engine
# measures no costs, and chapter 25's rule decides.

# %% [markdown] tags=["zh"]
# 在一张为讲解而编造的表上看预算（不是测量结果，只是形状像 GPU 在小批量时的样子：64 个序列以内，任何大小的 decode 步都是
# 1 ms，验证步是 1 ms 再加上第一行之后每行 5%，更大的没有测），先看一个还没起草过的引擎，再看它的提议器在每个位置都被问
# 过 40 次、一个也没保留之后。在这台 CPU 上，引擎测不出代价，由第 25 章的规则决定。

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.speculative import StepCosts
from nanovllm.llm import LLM

sizes = (1, 2, 4, 8, 16, 32, 64)
made_up = StepCosts(sizes, (1e-3,) * len(sizes), tuple(1e-3 * (1 + 0.05 * (s - 1)) for s in sizes))
budget = Speculator(NgramProposer(num_speculative_tokens=7))
budget.costs = made_up
batches = (1, 4, 8, 16, 32, 64)
fresh = [budget.drafts_per_sequence(b) for b in batches]
budget.count_asked([7] * 40)
after = [budget.drafts_per_sequence(b) for b in batches]
print(say("drafts a sequence by batch {batches}: {fresh} for a fresh engine (each position kept half the time, "
          "{tokens:.1f} tokens a verify step with 7 drafts); {after} once 40 asks kept nothing",
          batches=batches, fresh=fresh, tokens=1 + 7 * 0.5, after=after))
# en: Fresh: all seven drafts while 8 rows a sequence still cost little (up to 8 sequences); from 16 on, no number of
# en: drafts makes a verify step worth its rows.
# zh: 新引擎：只要每个序列 8 行还便宜（8 个序列以内），七个草稿全要；从 16 个序列起，多少个草稿都抵不上验证步的行数。
assert fresh == [7, 7, 7, 0, 0, 0]
# en: Nothing kept: a position now counts as kept once in 42 asks (the prior's one in two), and no verify step pays.
# zh: 什么都没保留：每个位置被保留的估计降到 42 次询问里一次（先验的两次里一次也算在内），没有哪个验证步值得做。
assert budget.expected_tokens(1) == (0 + 0.5 * 2) / (40 + 2) + 1 and after == [0] * len(batches)
on_cpu = LLM(str(build_tiny_model("qwen3")), device="cpu", speculative_method="ngram")
assert on_cpu.speculator.costs is None and on_cpu.speculator.drafts_per_sequence(4) == 3
on_cpu.exit()

# %% [markdown] tags=["en"]
# ## Serving it: the counters of `/metrics`
#
# `python -m nanovllm.serve --speculative-method ngram --num-speculative-tokens 4` serves with
# speculation; a streamed chunk may carry several tokens. Its `/metrics` gains the counters vLLM
# exports under the same names: verify steps (one per sequence and step with drafts), draft
# tokens, accepted tokens, and accepted tokens by their position among a step's drafts, whose
# falling counts show how quickly a run of right guesses ends. Chapter 21 left a place for them:
# a function in `ENGINE_COUNTERS` reads them off the engine after every step.

# %% [markdown] tags=["zh"]
# ## 在服务中使用：`/metrics` 的计数器
#
# `python -m nanovllm.serve --speculative-method ngram --num-speculative-tokens 4` 以投机解码提供服务；流式返回的一个
# 数据块可能带好几个 token。它的 `/metrics` 多了几个计数器，名字与 vLLM 导出的相同：验证步数（每个序列在每个带草稿的步
# 里算一次）、草稿 token 数、被接受的 token 数，以及按草稿在一步中的位置分别统计的被接受 token 数：这些数逐位置递减，
# 说明一串猜对的草稿多快就会断掉。第 21 章给它们留了位置：`ENGINE_COUNTERS` 里的一个函数在每步之后从引擎上读出它们。

# %% speculation counters
#| export serve.driver
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.serve.driver import ENGINE_COUNTERS


def speculation_counters(engine: LLMEngine) -> dict[str, float]:
    """A speculating engine's counters for /metrics, with vLLM's names (none without speculation)."""
    # zh: 进行投机的引擎供 /metrics 使用的计数器，采用 vLLM 的名字（不投机时没有）。
    if engine.speculator is None:
        return {}
    counts = engine.speculator.counts
    counters = {"spec_decode_num_drafts": counts.verifications,
                "spec_decode_num_draft_tokens": counts.drafted,
                "spec_decode_num_accepted_tokens": counts.accepted}
    for position, count in enumerate(counts.accepted_by_position):
        counters[f'spec_decode_num_accepted_tokens_per_pos{{position="{position}"}}'] = count
    return counters


ENGINE_COUNTERS.append(speculation_counters)

# %% speculation counter help
#| export serve.app
from nanovllm.serve.app import ENGINE_COUNTER_HELP

ENGINE_COUNTER_HELP.update({
    "spec_decode_num_drafts": "Verify steps, one per sequence and step with drafts.",
    "spec_decode_num_draft_tokens": "Draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted, by their position among a step's drafts.",
})

# %%
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.serve.app import engine_counter_families


class Replay:
    """Proposes what a plain run wrote after the same tokens, with every fifth position wrong on purpose."""
    # zh: 提议普通运行在同样的 token 之后写出的内容，并故意让每隔五个位置出错。

    def __init__(self, runs: list[list[int]], num_speculative_tokens: int = 4) -> None:
        self.runs, self.num_speculative_tokens = runs, num_speculative_tokens

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        k, n = min(self.num_speculative_tokens, limit or self.num_speculative_tokens), len(token_ids)
        for run in self.runs:
            if run[:n] == token_ids:
                return [token + 1 if (n + i) % 5 == 0 else token for i, token in enumerate(run[n : n + k])]
        return []


# en: Chapter 25's tiny Qwen3, seeded sampling: a plain run, then the same requests with its tokens replayed as
# en: drafts (the tiny random model rarely agrees with prompt lookup, and the counters would stay near zero).
# zh: 第 25 章的小 Qwen3，带种子的采样：先普通地跑一遍，再把这次运行的 token 当作草稿重放，跑同样的请求（随机的
# zh: 小模型很少与 prompt lookup 一致，计数器会几乎一直是零）。
tiny_qwen = str(build_tiny_model("qwen3"))
settings = {"device": "cpu", "kvcache_block_size": 4, "num_kvcache_blocks": 64}
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Small steps make small progress"]
params = SamplingParams(temperature=0.8, seed=11, max_tokens=24)
with LLM(tiny_qwen, **settings) as plain_llm:
    plain = [output["token_ids"] for output in plain_llm.generate(prompts, params, use_tqdm=False)]
    runs = [plain_llm.tokenizer(prompt)["input_ids"] + tokens for prompt, tokens in zip(prompts, plain, strict=True)]
served = LLM(tiny_qwen, speculative_method="ngram", **settings)
served.speculator.proposer = Replay(runs)
assert [output["token_ids"] for output in served.generate(prompts, params, use_tqdm=False)] == plain
counters = speculation_counters(served)
lines = []
for family in engine_counter_families(counters, ["model_name"], ["tiny"]):
    for sample in family.samples:
        labels = ",".join(f'{name}="{text}"' for name, text in sample.labels.items())
        lines.append(f"  {sample.name}{{{labels}}} {sample.value:g}")
print(say("what /metrics adds for a speculating engine:\n{lines}", lines="\n".join(lines)))
by_position = served.speculator.counts.accepted_by_position
# en: every accepted draft is counted at its position, and a later position is reached only through the earlier ones
# zh: 每个被接受的草稿都按位置计了数，而且只有经过前面的位置才能到达后面的位置。
assert sum(by_position) == counters["spec_decode_num_accepted_tokens"] > 0
assert list(by_position) == sorted(by_position, reverse=True)

# %% [markdown] tags=["en"]
# ## On a GPU, recorded
#
# One H200, SmolLM2 in bfloat16. `scripts/profile_verify.py` (Qwen3-0.6B's shapes, four drafts every
# step, 2026-12-04) measures a verify step at 1.54 ms against 0.93 ms for a synchronous decode step,
# most of it the GPU's. In bfloat16 some outputs part from the plain engine's after a few dozen
# tokens: a step's rounding depends on how many rows it has, since cuBLAS picks its kernel by shape,
# and a near tie can go the other way; in float32, on the CPU as chapter 25 asserts and on the GPU
# in the tests, the output is identical. On 2026-12-05 (`scripts/gpu-ci.sh speculative`) prompt
# lookup gave 1.33× at batch 1, a verify step costing 2.0 pipelined decode steps (its matmuls at 5
# to 8 rows were cuBLAS's); batch 16, past the rule's five sequences, drafted nothing (1.01×), and
# the 256-sequence workload ran at 1.00×.
#
# Once more on an H200 that evening, after chapter 15's GEMV had learned to take four rows
# (`python -m nanovllm.bench --speculative --workloads quoting --batches 1 2 4
# --num-speculative-tokens 3 4 7 --repeats 3`: one plain run against three speculating engines):
#
# | batch | plain | 3 drafts | 4 drafts | 7 drafts |
# |---:|---:|---:|---:|---:|
# | 1 | 1,260 tok/s | 1.94× (147 steps) | 1.92× (95 steps) | 2.35× (78 steps) |
# | 2 | 3,217 tok/s | 1.05× | 1.26× | 1.48× |
# | 4 | 5,706 tok/s | 1.00× | 1.03× | 1.13× |
#
# Three drafts make a verify step of 4 rows, which the fused GEMV takes: they gained as much as
# four drafts, whose 5 rows are cuBLAS's. Seven drafts fill the graph of 8 that four already
# replay and gave 5.05 tokens a verify step: 2.35×, past the 2× chapter 25 aimed for, so 7 is now
# the default. One caution: the plain engine ran slower on this machine than in the runs above
# (1,260 against 1,703–1,838 tok/s at batch 1), because its host took 0.87 ms to launch a step
# (chapter 15's latency benchmark, the same hour); fewer steps also save host time, so a faster
# host would show a smaller ratio. Batch 1's output was identical, batches 2 and 4 kept 1 of 2
# and 2 of 4 identical (the bfloat16 near ties above).
#
# The cell below prints these runs from the chapter's record and checks the figures quoted here.

# %% [markdown] tags=["zh"]
# ## GPU 上的记录
#
# 一块 H200，bfloat16 的 SmolLM2。`scripts/profile_verify.py`（Qwen3-0.6B 的形状，每步四个草稿，2026-12-04）测得一个验证
# 步 1.54 毫秒，同步的 decode 步 0.93 毫秒，其中大部分是 GPU 的时间。在 bfloat16 下，有些输出到几十个 token 之后就与普通
# 引擎的输出不同了：一步的舍入取决于它有几行，因为 cuBLAS 按形状挑选内核，两个几乎并列的 token 就可能倒向另一边；在
# float32 下，不论是第 25 章断言过的 CPU，还是测试里的 GPU，输出都完全相同。2026-12-05（`scripts/gpu-ci.sh
# speculative`）批大小为 1 时 prompt lookup 是 1.33 倍，一个验证步值 2.0 个流水线化的 decode 步（它 5 到 8 行的矩阵乘法
# 走的是 cuBLAS）；批大小 16 超过了规则允许的五个序列，没有草稿（1.01 倍）；256 个序列的负载是 1.00 倍。
#
# 当天晚上又在一块 H200 上跑了一次，那时第 15 章的 GEMV 已经能接手四行（`python -m nanovllm.bench --speculative
# --workloads quoting --batches 1 2 4 --num-speculative-tokens 3 4 7 --repeats 3`：一次普通运行，对照三个投机的引
# 擎）：
#
# | 批大小 | 普通 | 3 个草稿 | 4 个草稿 | 7 个草稿 |
# |---:|---:|---:|---:|---:|
# | 1 | 1,260 tok/s | 1.94 倍（147 步） | 1.92 倍（95 步） | 2.35 倍（78 步） |
# | 2 | 3,217 tok/s | 1.05 倍 | 1.26 倍 | 1.48 倍 |
# | 4 | 5,706 tok/s | 1.00 倍 | 1.03 倍 | 1.13 倍 |
#
# 三个草稿组成 4 行的验证步，正好由融合的 GEMV 接手：收益和四个草稿一样，而四个草稿的 5 行走的是 cuBLAS。七个草稿填满了
# 四个草稿本来就在重放的那张 8 行的图，每个验证步产出 5.05 个 token：2.35 倍，超过了第 25 章定下的 2 倍，所以现在默认是
# 7。有一点要当心：这台机器上的普通引擎比上面几次都慢（批大小 1 时 1,260 tok/s，上面是 1,703–1,838），因为它的主机启动一
# 步要 0.87 ms（同一小时测的第 15 章延迟基准测试）；步数减少也省下了主机的时间，所以主机更快时，倍数会小一些。批大小 1
# 的输出完全相同，批大小 2 和 4 分别是 2 个里 1 个、4 个里 2 个相同（即上面说的 bfloat16 下几乎并列的情形）。
#
# 下面的单元从本章的记录里打印这些运行，并核对这里引用的数字。

# %%
# en: The GPU runs this chapter quotes, from its record: what ran, where, when.
# zh: 本章引用的各次 GPU 运行，取自本章的记录：跑的是什么、在哪里、什么时候。
for run in gpu_runs.values():
    print(say("{name}: {card}, {date}, {command}", name=run.name, card=run.card, date=run.date, command=run.command))

# en: 2026-12-04: the graphed verify step in three invocations, and before it the eager one, host-bound.
# zh: 2026-12-04：三次调用里的图化验证步，以及在它之前受主机限制的 eager 验证步。
eager, profile = gpu_runs["gpu-ci speculative, 2026-12-04"].figures, gpu_runs["profile_verify"].figures
print(say("batch 1: {ratios} the plain engine ({low:,}-{high:,} tok/s plain), {tokens} tokens per verify step; the "
          "eager verify step before: {eager} tok/s against {sync:,}, {wall} ms a step, {gpu} ms of it kernels; the "
          "graphed one: {verify} ms against {decode} ms for a decode step",
          ratios=", ".join(f"{ratio:.2f}x" for ratio in invocations["batch 1 ratios"]),
          low=invocations["batch 1 plain tok/s, lowest and highest"][0],
          high=invocations["batch 1 plain tok/s, lowest and highest"][1],
          tokens=invocations["batch 1 tokens per verify step"],
          eager=eager["synchronous engine with prompt lookup tok/s"], sync=eager["synchronous engine tok/s"],
          wall=profile["eager verify step"]["wall ms"], gpu=profile["eager verify step"]["GPU kernels ms"],
          verify=profile["graphed verify step"]["verify step ms"],
          decode=profile["graphed verify step"]["synchronous decode step ms"]))
# en: Faster than plain decoding in every invocation; the eager verify step was the host's (its kernels a few percent of
# en: it), the graphed one costs under two decode steps.
# zh: 每次调用都比普通 decode 快；eager 的验证步耗在主机上（内核只占几个百分点），图化之后不到两个 decode 步。
eager_step, graphed_step = profile["eager verify step"], profile["graphed verify step"]
assert min(invocations["batch 1 ratios"]) > 1 and eager_step["GPU kernels ms"] < 0.05 * eager_step["wall ms"]
assert graphed_step["verify step ms"] < 2 * graphed_step["synchronous decode step ms"]

# en: 2026-12-05: prompt lookup at batch 1, and what its verify step cost.
# zh: 2026-12-05：批大小 1 时的 prompt lookup，以及它的验证步的代价。
lookup = h200["prompt lookup"]["batch 1"]
speedup = lookup["speculative tok/s"] / lookup["plain tok/s"]
verify_cost = (lookup["tokens"] / lookup["steps"]) / speedup
print(say("batch 1: {plain:,} -> {spec:,} tok/s, {ratio:.2f}x, {steps} steps for {tokens} tokens, {kept:.0%} of the "
          "drafts kept; a verify step cost {cost:.1f} decode steps", plain=lookup["plain tok/s"],
          spec=lookup["speculative tok/s"], ratio=speedup, steps=lookup["steps"], tokens=lookup["tokens"],
          kept=lookup["acceptance"], cost=verify_cost))
assert round(speedup, 2) == 1.33 and lookup["identical"] and h200["prompt lookup"]["batch 16"]["drafted"] == 0
# en: A verify step costs 2.0 to 2.9 decode steps at small batches: this run's batch 1, and batch 2 in the table.
# zh: 小批大小时一个验证步值 2.0 到 2.9 个 decode 步：这次运行的批大小 1，以及表中的批大小 2。
assert (round(verify_cost, 1), round(costs[2], 1)) == (2.0, 2.9)

# en: That evening: 3, 4 and 7 drafts against one plain run, and the host's launch of a step in the same hour.
# zh: 当天晚上：3、4、7 个草稿对照同一次普通运行，以及同一小时里主机启动一步的耗时。
evening = gpu_runs["drafts 3 4 7"].figures
evening_plain = {int(batch): tok_s for batch, tok_s in evening["plain tok/s"].items()}
ratios = {int(batch): {int(drafts): ratio for drafts, ratio in row.items()} for batch, row in evening["ratios"].items()}
print(f"{say('batch'):>6} {say('plain'):>14} " + " ".join(f"{say('{k} drafts', k=k):>10}" for k in (3, 4, 7)))
for batch, row in ratios.items():
    print(f"{batch:>6} {evening_plain[batch]:>8,} tok/s " + " ".join(f"{ratio:>9.2f}x" for ratio in row.values()))
host = gpu_runs["latency, that evening"].figures["host launch ms"]
print(say("batch 1, 7 drafts: {tokens} tokens per verify step; the host took {host} ms to launch a step",
          tokens=evening["batch 1 tokens per verify step, 7 drafts"], host=host))
assert round(ratios[1][7], 2) == 2.35 > 2 and evening["batch 1 steps"] == {"3": 147, "4": 95, "7": 78}
# en: The plain engine ran slower that evening than in the runs before (1,703 to 1,838 tok/s at batch 1).
# zh: 那天晚上普通引擎比之前几次都慢（之前批大小 1 时是 1,703 到 1,838 tok/s）。
assert evening_plain[1] < lookup["plain tok/s"] == 1703 < invocations["batch 1 plain tok/s, lowest and highest"][1]

# %% [markdown] tags=["en"]
# ## What we built
#
# - `bench.speculative`, run as `python -m nanovllm.bench --speculative` (the flag joins chapter
#   19's `OTHER_BENCHMARKS`): the same requests through one engine whose runs take turns without
#   and with speculation, and per batch their tok/s (medians), steps, acceptance rate, tokens per
#   verify step and identical outputs; `--num-speculative-tokens` sets several numbers of drafts
#   against the same plain runs, `--budget` the measured budget, chapter 25's fixed rule or both,
#   `--draft-model` drafts with a smaller model, `--verify-rows` tries another row limit.
# - The draft budget from measured costs: `StepCosts`, measured by `ModelRunner.step_costs` when a
#   speculating engine starts on a GPU, and `Speculator.drafts_per_sequence` replaced by the
#   number of drafts that gives the most tokens a second (`expected_tokens`, from `DraftCounts`'s
#   record by position); on a CPU, chapter 25's fixed rule.
# - `speculation_counters` in chapter 21's `ENGINE_COUNTERS`, with its help in `ENGINE_COUNTER_HELP`:
#   the `spec_decode` counters of the server's `/metrics`, under vLLM's names.
# - The measurements behind chapter 25's defaults: a verify step costs 2.0 to 2.9 decode steps at
#   small batches, so a sequence must average two tokens a verify step or pause its drafts (longer
#   each time), no sequence drafts past 5 in a batch, and 7 drafts fill the graph of 8 rows that 4
#   already replay.
#
# Not built yet, and where it goes next: matmuls of 5 to 16 rows that read the weights once, as
# the GEMV now does for up to four (then a verify step of 8 rows would cost about a decode step),
# and the draft model measured on a GPU with one trained for the job (a self draft only teaches).

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `bench.speculative`，以 `python -m nanovllm.bench --speculative` 运行（这个参数加入了第 19 章的
#   `OTHER_BENCHMARKS`）：同一批请求交给同一个引擎，不带和带投机的运行轮流进行，对每个批大小给出 tok/s（中位数）、
#   步数、接受率、每个验证步的 token 数，以及完全相同的输出有几个；`--num-speculative-tokens` 让几种草稿数对照同样的
#   普通运行，`--budget` 选实测预算、第 25 章的固定规则或两者都跑，`--draft-model` 用一个更小的模型起草，
#   `--verify-rows` 试别的行数上限。
# - 按实测代价定的草稿预算：`StepCosts` 由 `ModelRunner.step_costs` 在投机的引擎于 GPU 上启动时测出，
#   `Speculator.drafts_per_sequence` 换成了每秒给出 token 最多的草稿数（`expected_tokens`，依据 `DraftCounts` 按位置
#   的记录）；在 CPU 上仍是第 25 章的固定规则。
# - 第 21 章 `ENGINE_COUNTERS` 里的 `speculation_counters`，说明文字在 `ENGINE_COUNTER_HELP` 里：服务器 `/metrics`
#   里的 `spec_decode` 计数器，名字与 vLLM 的相同。
# - 第 25 章各个默认值背后的测量：小批大小时一个验证步值 2.0 到 2.9 个 decode 步，所以一个序列每个验证步平均得产出两个
#   token，否则就暂停草稿（一次比一次久）；一批超过 5 个序列就没有草稿；7 个草稿正好填满 4 个草稿本来就在重放的那张
#   8 行的图。
#
# 还没有实现、接下来要做的：让 5 到 16 行的矩阵乘法也像现在的 GEMV 处理不超过四行那样只读一遍权重（那样一个 8 行的验证
# 步代价约等于一个 decode 步），以及在 GPU 上用专门训练过的草稿模型来测量（自草稿只用于教学）。

# %% [markdown] tags=["en"]
# ## Exercises
#
# 1. In the back-off table, batch 1 ran at 1.12× the plain engine in 95 steps, where the plain
#    engine took 256. What did a verify step cost, in decode steps? How many tokens did a step give
#    on average, and how does that, over the cost, make the 1.12×?
# 2. The rule's defaults are at most 16 verify rows and at least two drafts a sequence. How many
#    drafts does each sequence get at batches 3, 5 and 6? A new sequence whose drafts are never
#    kept: after how many verify steps does it first pause its drafts, and for how many tokens are
#    its first three pauses?
# 3. In the evening run of 3, 4 and 7 drafts, which number of drafts gained most at every batch?
#    Why does a sequence with seven drafts cost the GPU hardly more than one with four?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 练习
#
# 1. 在退避表里，批大小 1 用 95 步跑出普通引擎的 1.12 倍，普通引擎用了 256 步。一个验证步值几个 decode 步？平均每步产出
#    多少个 token？它除以这个代价，怎样得到 1.12 倍？
# 2. 规则的默认值是验证步最多 16 行、每个序列至少两个草稿。批大小为 3、5、6 时，每个序列各得到几个草稿？一个新序列的草稿
#    从来没被保留：它在第几个验证步之后第一次暂停草稿？它的前三次暂停各有多少个 token？
# 3. 在当天晚上 3、4、7 个草稿的那次运行里，哪种草稿数在每个批大小上收益都最大？为什么带七个草稿的序列在 GPU 上几乎
#    不比带四个的更贵？
#
# 下面的单元检查答案。

# %%
# en: Exercise 1: (256 / 95) / 1.12 = 2.4 decode steps a verify step; a step gave 256 / 95 = 2.69 tokens, and 2.69
# en: tokens for the price of 2.4 decode steps is 1.12 times the plain engine's one token a step.
# zh: 练习 1：(256 / 95) / 1.12 = 2.4，一个验证步值 2.4 个 decode 步；平均每步产出 256 / 95 = 2.69 个 token，花 2.4 个
# zh: decode 步的代价换来 2.69 个 token，就是普通引擎每步一个 token 的 1.12 倍。
batch_1 = backoff_rows[0]
per_step = 256 / batch_1[3]
assert batch_1[0] == 1 and round(per_step, 2) == 2.69 and round(per_step / costs[1], 2) == 1.12

# en: Exercise 2: 16 // 3 - 1 = 4 drafts, 16 // 5 - 1 = 2, and 16 // 6 - 1 = 1, fewer than two: none. A new sequence
# en: starts trusted (a recent mean of 4 tokens): its first empty verify step brings the mean to 2.5, the second to
# en: 1.75, under two: it pauses for 16 tokens, and each empty verify step after a pause doubles it, 32, then 64.
# zh: 练习 2：16 // 3 - 1 = 4 个草稿，16 // 5 - 1 = 2 个，16 // 6 - 1 = 1 个，不到两个：一个也不给。新序列一开始是被信任
# zh: 的（最近的平均值算作 4 个 token）：第一个什么都没保留的验证步把平均值拉到 2.5，第二个拉到 1.75，低于两个：暂停 16
# zh: 个 token；暂停之后每个什么都没保留的验证步让暂停加倍，32，然后 64。
from nanovllm.engine.sequence import Sequence

fresh = Speculator(NgramProposer(num_speculative_tokens=7))
assert [fresh.drafts_per_sequence(batch) for batch in (3, 5, 6)] == [4, 2, 0]
seq = Sequence([1, 2, 3], SamplingParams(temperature=0, max_tokens=600), block_size=4)
pauses = []
for _ in range(4):
    fresh.record([seq], [4], [0])
    pauses.append(0 if fresh.may_draft(seq) else fresh.backoff[seq].resume_at - len(seq))
assert pauses == [0, 16, 32, 64]

# en: Exercise 3: 7 drafts, at batches 1, 2 and 4, and the default is that number. One sequence with 4 drafts is 5
# en: rows, which replay the decode graph of 8 rows, as 7 drafts do: the GPU runs the same graph, and what grows is
# en: the work outside it (the LM head, sampling, acceptance).
# zh: 练习 3：7 个草稿，在批大小 1、2、4 上都是，默认值就是这个数。带 4 个草稿的序列是 5 行，重放的是 8 行的 decode 图，
# zh: 7 个草稿也是：GPU 跑的是同一张图，多出来的只是图外面的工作（LM head、采样、接受）。
from nanovllm.config import DEFAULT_SPECULATIVE_TOKENS
from nanovllm.engine.cuda_graphs import capture_sizes

assert all(max(row, key=row.get) == DEFAULT_SPECULATIVE_TOKENS == 7 for row in ratios.values())
assert [min(size for size in capture_sizes(256) if size >= 1 + drafts) for drafts in (4, 7)] == [8, 8]
print(say("all exercise answers check out"))
