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
# # 09 · The model runner: batching inputs, sizing the KV cache
#
# **Goal.** The scheduler (chapter 04) hands over a list of sequences and says "prefill" or
# "decode"; the model (chapter 06) wants flat tensors and an attention context (chapter 07).
# The **model runner** sits between them. By the end of this chapter you can:
#
# - turn a step's sequences into `input_ids`, `positions` and the attention metadata, for a
#   prefill (possibly a chunk, possibly after a prefix-cache hit) and for a decode step;
# - size and allocate the paged KV cache, on a CPU from a memory budget and on a GPU from the
#   memory left after a warm-up forward, and hand each layer its view of it;
# - run the model and sample one token per sequence, only where a token is really wanted.

# %% [markdown] tags=["zh"]
# # 09 · 模型执行器：组装批次输入，确定 KV 缓存大小
#
# **目标：** 调度器（第 04 章）交来一组序列，并说明这是 "prefill" 还是 "decode"；模型（第 06 章）要的是扁平的
# 张量和一个注意力上下文（第 07 章）。**模型执行器**就夹在两者之间。读完本章，你将能够：
#
# - 把一步的序列变成 `input_ids`、`positions` 和注意力元数据，既能处理 prefill（可能是一个分块，也可能在前缀缓存
#   命中之后），也能处理 decode 步；
# - 确定分页 KV 缓存的大小并分配它：CPU 上按内存预算，GPU 上按预热前向之后剩余的显存；再把各层对应的视图交给每一层；
# - 运行模型并为每个序列采样一个 token——只在真正需要 token 的地方采样。

# %% [markdown] tags=["en"]
# ## The idea: one flat batch, described by a few small tensors
#
# There is no padding in a step. The tokens that every sequence computes now are laid end to
# end, and small tensors say where each sequence starts and where its KV goes:
#
# ```
# prefill step, block_size 4: seq A computes tokens 0..4 (new), seq B tokens 8..9 (8 cached)
#   input_ids      [a0 a1 a2 a3 a4 | b8 b9]
#   positions      [ 0  1  2  3  4 |  8  9]
#   cu_seqlens_q   [0, 5, 7]          (where each sequence's queries start in the flat batch)
#   cu_seqlens_k   [0, 5, 15]         (keys: cached + scheduled, i.e. 5 and 8 + 2)
#   slot_mapping   [A's slots 0..4 | B's slots 8..9]   slot = block_table[pos // 4] * 4 + pos % 4
#   block_tables   [[A's blocks], [B's blocks]]        only when some prefix is cached
#
# decode step: one token per sequence, the last one
#   input_ids [A_last, B_last]   positions [len(A)-1, len(B)-1]   context_lens [len(A), len(B)]
# ```
#
# For a chunk, the keys a query sees are the cached tokens plus the scheduled ones:
# `seqlen_k = num_cached_tokens + num_scheduled_tokens`, not the whole sequence — the rest of
# the prompt has not been computed yet. Only the scheduled tokens get a slot: the cached ones
# are already in the cache.

# %% [markdown] tags=["zh"]
# ## 思路：一个扁平批次，用几个小张量描述
#
# 一步之中没有填充（padding）。每个序列本步要计算的 token 首尾相接排成一行，再用几个小张量说明每个序列从哪里开始、
# 它的 KV 写到哪里：
#
# ```
# prefill 步，block_size 为 4：序列 A 计算第 0..4 个 token（全新），序列 B 计算第 8..9 个（前 8 个已缓存）
#   input_ids      [a0 a1 a2 a3 a4 | b8 b9]
#   positions      [ 0  1  2  3  4 |  8  9]
#   cu_seqlens_q   [0, 5, 7]          （每个序列的 query 在扁平批次中的起点）
#   cu_seqlens_k   [0, 5, 15]         （key：已缓存 + 本步计算，即 5 和 8 + 2）
#   slot_mapping   [A 的槽位 0..4 | B 的槽位 8..9]   slot = block_table[pos // 4] * 4 + pos % 4
#   block_tables   [[A 的块], [B 的块]]               只有存在已缓存前缀时才需要
#
# decode 步：每个序列一个 token，即最后一个
#   input_ids [A_last, B_last]   positions [len(A)-1, len(B)-1]   context_lens [len(A), len(B)]
# ```
#
# 对于分块，query 能看到的 key 是已缓存的 token 加上本步计算的 token：
# `seqlen_k = num_cached_tokens + num_scheduled_tokens`，而不是整个序列——提示词的其余部分还没算。
# 只有本步计算的 token 需要槽位：已缓存的 token 早就在缓存里了。

# %% default module
#| default_exp engine.model_runner

# %% [markdown] tags=["en"]
# ## Build it: the engine's settings, `Config`
#
# The runner is the first part of the engine that reads its settings, so they are built here:
# `LLM(model, **settings)` (chapter 10) turns its keyword arguments into one `Config`, and every
# part reads what it needs from it. The fields and defaults of nano-vllm come first, then what
# running on a CPU needs; a few belong to later chapters (graphs, ranks), and the table says
# which. The settings of what a later chapter builds arrive with it (appendix D's `add_fields`):
# the compiled small ops in chapter 14, the fused decode step in 15, the ranks' deadline in 17,
# asynchronous scheduling in 18, the 8-bit KV cache in 24 and speculative decoding in 25.
#
# | field | default | meaning |
# |---|---|---|
# | `model` | — | a Hugging Face model directory (config.json + safetensors) |
# | `max_num_batched_tokens` | 16384 | token budget of one step |
# | `max_num_seqs` | 512 | sequences in one step at most |
# | `max_model_len` | 4096 | prompt + completion of one sequence at most (≤ `max_position_embeddings`) |
# | `gpu_memory_utilization` | 0.9 | share of the GPU's memory the engine may fill (CUDA) |
# | `tensor_parallel_size` | 1 | ranks (1 until chapter 17 starts them) |
# | `enforce_eager` | False | no CUDA graphs (chapter 14) |
# | `kvcache_block_size` | 256 | tokens per KV block |
# | `num_kvcache_blocks` | -1 | KV blocks; -1 sizes the pool from memory |
# | `device` | "auto" | "cpu", "cuda", or "auto" (CUDA when available) |
# | `dtype` | "auto" | "float32", "bfloat16", "float16"; auto: see below |
# | `attention_backend` | "auto" | "torch" (chapter 07's reference; chapter 11 adds its kernels) |
# | `enable_prefix_caching` | True | reuse the KV of shared prompt prefixes (chapter 03) |
# | `kvcache_memory_gb` | 1.0 | KV pool size on CPU when `num_kvcache_blocks` is -1 |
# | `fork_samples` | True | `n > 1`: prefill once, then fork (chapter 05); False: n independent requests |
# | `load_format` | "auto" | "auto": the directory's safetensors; "dummy": seeded random weights (benchmarks, ch. 06) |
#
# **`"auto"` values.** `device`: CUDA when torch sees a GPU, else CPU. `dtype`: float32 on CPU
# (CPUs have no fast half-precision matmul, and float32 makes parity with `transformers` exact);
# on CUDA the checkpoint's own type when it is bfloat16 or float16, else bfloat16.
# `attention_backend`: the torch reference, the one backend so far (chapter 11's Triton kernels
# become the default on a GPU). `tensor_parallel_size` must be 1 here: this engine runs in one
# process, and chapter 17 starts the ranks that let it be more.
#
# **Block size rule.** nano-vllm demands a multiple of 256 because flash-attn's paged kernels
# want it. Our kernels only need a power of two (Triton's `tl.arange` ranges must have a
# power-of-two length), and the torch reference takes anything; small blocks are how the book
# shows the mechanisms. So the rule here is: **a power of two, from 1 to 1024**.
#
# After validation, the `"auto"` values are resolved in place, so that the rest of the engine
# reads `config.device == "cpu"` rather than repeating the rules, and three fields are derived
# from the model directory: `hf_config`, `eos_token_ids` (every end-of-sequence id the model
# declares, in `generation_config.json` or `config.json`), and the capped `max_model_len`. Those
# files are input too: an unreadable `generation_config.json`, or an end-of-sequence id that is
# not a token of the vocabulary, is refused with the file and the field named, never used.

# %% [markdown] tags=["zh"]
# ## 动手：引擎的设置 `Config`
#
# 执行器是引擎中第一个读取设置的部件，所以设置在这里构建：`LLM(model, **settings)`（第 10 章）把它的关键字参数变成
# 一个 `Config`，各部件从中读取自己需要的东西。先是 nano-vllm 的字段与默认值，然后是在 CPU 上运行所需的字段；其中
# 有几个属于后面的章节（CUDA Graph、rank），表中注明了是哪一章。后面章节所构建的东西，其设置随那一章一起加入（附录 D
# 的 `add_fields`）：第 14 章的编译小算子、第 15 章的融合 decode 步、第 17 章 rank 的回复期限、第 18 章的异步调度、
# 第 24 章的 8 位 KV 缓存和第 25 章的投机解码。
#
# | 字段 | 默认值 | 含义 |
# |---|---|---|
# | `model` | — | Hugging Face 模型目录（config.json + safetensors） |
# | `max_num_batched_tokens` | 16384 | 一步的 token 预算 |
# | `max_num_seqs` | 512 | 一步最多处理的序列数 |
# | `max_model_len` | 4096 | 单个序列提示词加生成内容的最大 token 数（≤ `max_position_embeddings`） |
# | `gpu_memory_utilization` | 0.9 | 引擎可以占用的 GPU 显存比例（CUDA） |
# | `tensor_parallel_size` | 1 | rank 数（第 17 章启动多个 rank 之前只能是 1） |
# | `enforce_eager` | False | 不使用 CUDA Graph（第 14 章） |
# | `kvcache_block_size` | 256 | 每个 KV 块的 token 数 |
# | `num_kvcache_blocks` | -1 | KV 块数；-1 表示根据内存大小决定 |
# | `device` | "auto" | "cpu"、"cuda"，或 "auto"（有 CUDA 就用 CUDA） |
# | `dtype` | "auto" | "float32"、"bfloat16"、"float16"；auto 见下文 |
# | `attention_backend` | "auto" | "torch"（第 07 章的参考实现；第 11 章加入自己的内核） |
# | `enable_prefix_caching` | True | 复用共享提示词前缀的 KV（第 03 章） |
# | `kvcache_memory_gb` | 1.0 | 在 CPU 上且 `num_kvcache_blocks` 为 -1 时 KV 块池的大小 |
# | `fork_samples` | True | `n > 1` 的请求只 prefill 一次再分叉（第 05 章）；False：当作 n 个独立请求 |
# | `load_format` | "auto" | "auto"：读目录里的 safetensors；"dummy"：带种子的随机权重（基准测试用，第 06 章） |
#
# **`"auto"` 的含义：** `device`：torch 能看到 GPU 就用 CUDA，否则用 CPU。`dtype`：CPU 上用 float32
# （CPU 没有快速的半精度矩阵乘法，而且 float32 能让结果与 `transformers` 完全一致）；CUDA 上，若权重本身是
# bfloat16 或 float16 就用它，否则用 bfloat16。`attention_backend`：torch 参考实现，目前唯一的后端（第 11 章的
# Triton 内核会成为 GPU 上的默认选择）。`tensor_parallel_size` 在这里必须是 1：这个引擎在一个进程里运行，
# 第 17 章启动多个 rank 之后它才能更大。
#
# **块大小的规则：** nano-vllm 要求块大小是 256 的倍数，因为 flash-attn 的分页内核需要这样。我们的内核只要求
# 2 的幂（Triton 的 `tl.arange` 长度必须是 2 的幂），torch 参考实现则什么都能接受；而本书正是靠小块来演示各种机制。
# 所以这里的规则是：**2 的幂，从 1 到 1024**。
#
# 校验通过后，`"auto"` 会被就地解析成具体的值，这样引擎的其余部分只需读 `config.device == "cpu"`，不必重复这些规则；
# 另有三个字段由模型目录推出：`hf_config`、`eos_token_ids`（模型在 `generation_config.json` 或 `config.json`
# 中声明的每一个结束符 id）以及截断后的 `max_model_len`。这些文件同样是输入：读不了的 `generation_config.json`，
# 或者不在词表里的结束符 id，都会被拒绝，错误信息指明文件和字段，绝不会被悄悄用上。

# %% config checks
#| export config
from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig

from nanovllm.utils.checks import check
from nanovllm.models.loader import LOAD_FORMATS, read_model_dir

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_BLOCK_SIZE = 1024


class UnknownConfigKeyError(TypeError, ValueError):
    """An unknown keyword for `Config`.

    A `TypeError`, like any unexpected keyword argument in Python, and a `ValueError`, like
    every other bad configuration value, so that either `except` clause catches it.
    """
    # zh: `Config` 不认识的关键字。
    # zh:
    # zh: 它既是 `TypeError`（就像 Python 中任何意外的关键字参数），又是 `ValueError`（就像
    # zh: 其他所有错误的配置值），所以哪种 `except` 子句都能接住它。


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    return check(name, value, str, lambda v: v in choices, f"one of {list(choices)}")


def declared_eos_ids(model: str | os.PathLike, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """Every end-of-sequence id the model declares (generation_config.json first, then config.json). Each one
    must be a token of the vocabulary: a malformed file or a bad id is refused, naming the file and the field."""
    # zh: 模型声明的每一个序列结束 id（先看 generation_config.json，再看 config.json）。每一个都
    # zh: 必须是词表里的 token：格式错误的文件或不对的 id 都会被拒绝，并写明文件和字段。
    path, eos = Path(model) / "generation_config.json", None
    if path.is_file():
        try:
            eos = GenerationConfig.from_pretrained(model).eos_token_id
        # en: transformers raises OSError, ValueError, ...
        # zh: transformers 会抛出 OSError、ValueError 等异常。
        except Exception as error:
            raise ValueError(f"{path} cannot be read: {error}") from error
    if eos is None:
        path, eos = Path(model) / "config.json", getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    vocab = hf_config.vocab_size
    ids = [check(f"{path}: eos_token_id", token, int, lambda t: 0 <= t < vocab, f"a token id in [0, {vocab})")
           for token in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return tuple(dict.fromkeys(ids))


def check_tensor_parallel_size(hf_config: object, tp_size: int) -> None:
    """Refuse a tensor-parallel size this engine cannot run: one process runs the whole model."""
    # zh: 拒绝这个引擎无法运行的张量并行大小：一个进程运行整个模型。
    if tp_size != 1:
        raise ValueError(f"tensor_parallel_size={tp_size}, but this engine runs the model in one process: use 1")


def resolve_attention_backend(name: str, device: str, dtype: str) -> str:
    """The attention backend that the setting ``name`` asks for on ``device`` in ``dtype``: "auto" picks one. Here
    there is one, chapter 07's torch reference."""
    # zh: 设置 ``name`` 在 ``device`` 上、以 ``dtype`` 所要的注意力后端："auto" 会挑一个。这里只有一个，
    # zh: 就是第 07 章的 torch 参考实现。
    _choice("attention_backend", name, ("auto", "torch"))
    return "torch"

# %% [markdown] tags=["en"]
# Now the dataclass. `__post_init__` checks each field with chapter 01's `check` (the same
# helper `SamplingParams` uses), resolves the `"auto"` values and reads the model directory with
# chapter 06's `read_model_dir`, the one reader of `config.json`, which refuses a broken
# directory or a nonsense model size by name. The config it returns travels in `Config.hf_config`
# to the model runner and to every tensor-parallel rank: nothing else parses the file again.
# `from_kwargs` is what `LLM(model, **kwargs)` calls: it refuses keys that are not fields
# (suggesting the closest one), and also the derived fields, which are not settings.

# %% [markdown] tags=["zh"]
# 接下来是 dataclass 本身。`__post_init__` 用第 01 章的 `check`（`SamplingParams` 用的也是它）检查每个字段，
# 解析 `"auto"`，再用第 06 章的 `read_model_dir` 读取模型目录。它是 `config.json` 唯一的读取者，损坏的目录或荒谬的
# 模型尺寸都会被它点名拒绝。它返回的配置保存在 `Config.hf_config` 里，传给模型执行器和每个张量并行 rank：没有别的
# 地方会再解析这个文件。`from_kwargs` 供 `LLM(model, **kwargs)` 调用：它拒绝不是字段的键（并提示最接近的那个），
# 也拒绝派生字段，因为它们不是配置项。

# %% config
#| export config
@dataclass
class Config:
    """Everything the engine needs to know before it loads a model: the settings of `LLM(model, **settings)`
    and what is derived from the model directory."""
    # zh: 引擎加载模型之前需要知道的一切：`LLM(model, **settings)` 的设置，以及由模型目录推导出的东西。

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    kvcache_memory_gb: float = 1.0
    fork_samples: bool = True
    load_format: str = "auto"
    # en: Derived from the model directory, not settings (from_kwargs refuses them).
    # zh: 由模型目录推出，不是配置项（from_kwargs 会拒绝它们）。
    hf_config: PretrainedConfig | None = field(default=None, init=False, repr=False)
    eos_token_ids: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        load_format = _choice("load_format", self.load_format, LOAD_FORMATS)
        # en: The one read of config.json; the result travels in this object, to every rank.
        # zh: 对 config.json 的唯一一次读取（第 06 章）；结果随这个对象传下去，直到每个 rank。
        self.hf_config = read_model_dir(self.model, require_weights=load_format != "dummy")
        self.model = str(Path(self.model).expanduser())
        self._check_numbers()
        check_tensor_parallel_size(self.hf_config, self.tensor_parallel_size)
        self._resolve_device()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.eos_token_ids = declared_eos_ids(self.model, self.hf_config)

    def _check_numbers(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            self._check(name, int, lambda n: n >= 1, ">= 1")
        self._check("gpu_memory_utilization", float, lambda u: 0 < u <= 1, "in (0, 1]")
        self._check("tensor_parallel_size", int, lambda n: 1 <= n <= 8, "in [1, 8]")
        for name in ("enforce_eager", "enable_prefix_caching", "fork_samples"):
            self._check(name, bool)
        power_of_two = f"a power of two from 1 to {MAX_BLOCK_SIZE}"
        self._check("kvcache_block_size", int, lambda b: 1 <= b <= MAX_BLOCK_SIZE and not b & (b - 1), power_of_two)
        self._check("num_kvcache_blocks", int, lambda n: n == -1 or n >= 1, "-1 (size from memory) or >= 1")
        self._check("kvcache_memory_gb", float, lambda x: x > 0, "> 0")

    def _check(self, name: str, kind: type, ok: Callable[[Any], bool] | None = None, rule: str = "") -> None:
        # en: Keep the plain value `check` hands back: np.int64(4) becomes 4.
        # zh: 存下 `check` 交回的普通 Python 值（第 01 章）：np.int64(4) 变成 4。
        setattr(self, name, check(name, getattr(self, name), kind, ok, rule))

    def _resolve_device(self) -> None:
        device = _choice("device", self.device, DEVICES)
        dtype = _choice("dtype", self.dtype, ("auto", *DTYPES))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device (use device='cpu' or 'auto')")
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else _half_dtype_of(self.hf_config)
        backend = resolve_attention_backend(self.attention_backend, device, dtype)
        self.device, self.dtype, self.attention_backend = device, dtype, backend

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def settings(cls) -> list[str]:
        """The keyword arguments `from_kwargs` accepts (every field but `model` and the derived ones)."""
        # zh: `from_kwargs` 接受的关键字参数（除 `model` 和推导出的字段之外的每个字段）。
        return [f.name for f in fields(cls) if f.init and f.name != "model"]

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike, /, **kwargs: Any) -> Config:
        """Build a config from `LLM(model, **kwargs)`-style arguments; unknown keys are an error."""
        # zh: 由 `LLM(model, **kwargs)` 式的参数构建 config；不认识的键是错误。
        valid = cls.settings()
        unknown = [key for key in kwargs if key not in valid]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownConfigKeyError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}")
        return cls(model, **kwargs)


def _half_dtype_of(hf_config: PretrainedConfig) -> str:
    # en: A checkpoint saved in bf16 or fp16 runs in that type; one saved in fp32 (like our
    # en: dequantized SmolLM2) runs in bf16 on a GPU, which is what GPUs are fast at.
    # zh: 以 bf16 或 fp16 保存的权重就用该类型运行；以 fp32 保存的（比如我们反量化得到的 SmolLM2）
    # zh: 在 GPU 上用 bf16 运行，因为 GPU 擅长的正是它。
    saved = getattr(hf_config, "dtype", None)
    name = str(saved).removeprefix("torch.") if saved is not None else ""
    return name if name in ("bfloat16", "float16") else "bfloat16"

# %% [markdown] tags=["en"]
# ### See it
#
# A model directory for the examples: a tiny Llama with random weights (2 layers, hidden size
# 64), saved by `transformers` exactly as a real checkpoint is. `Config` only reads its
# `config.json`, `generation_config.json` and the names of its files.

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# 先准备一个供示例使用的模型目录：一个随机权重的小 Llama（2 层，隐藏维度 64），由 `transformers` 像保存真实
# 权重一样保存下来。`Config` 只会读取其中的 `config.json`、`generation_config.json` 以及文件名。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "torch dtype: {dtype} | hidden size: {hidden}": "torch 数据类型：{dtype} | 隐藏层大小：{hidden}",
    "misspelled key": "拼错的键",
    "derived field": "派生字段",
    "block size 48": "块大小 48",
    "bool as int": "把 bool 当 int",
    "zero blocks": "零个块",
    "utilization 1.5": "利用率 1.5",
    "unknown device": "未知设备",
    "dtype float64": "dtype float64",
    "missing dir": "目录不存在",
    "empty dir": "空目录",
    "malformed config": "格式错误的配置",
    "no weights": "没有权重",
    "hidden size -64": "隐藏层大小 -64",
    "no heads": "没有注意力头",
    "unknown backend": "未知的后端",
    "Config checks hold": "Config 的检查成立",
    "decode: {ids} {positions} {lens} {slots}": "decode：{ids} {positions} {lens} {slots}",
    "blocks 5, 6 now hold blocks 1, 2 in every layer; the other six are unchanged":
        "块 5、6 现在在每一层都存着块 1、2 的内容；其余六个块不变",
    "one block: {size} bytes -> {blocks} blocks in 1 MiB": "一个块：{size} 字节 -> 1 MiB 放得下 {blocks} 个块",
    "KV cache: {shape} = [2, layers, blocks, block_size, kv_heads, head_dim]":
        "KV 缓存：{shape} = [2, layers, blocks, block_size, kv_heads, head_dim]",
    "runner: {ours}  transformers: {theirs}": "执行器：{ours}  transformers：{theirs}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
import json
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from nanovllm.config import Config, UnknownConfigKeyError

# en: keep the page free of "Writing model shards" bars
# zh: 不让页面上出现 "Writing model shards" 进度条。
hf_logging.disable_progress_bar()


def tiny_llama_dir(root: Path) -> Path:
    """A 2-layer Llama with random weights, saved as a Hugging Face directory."""
    # zh: 一个权重随机的 2 层 Llama，保存为 Hugging Face 目录。
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = root / "tiny-llama"
    model = LlamaForCausalLM(hf)
    # en: Like many chat models, it declares two end-of-sequence ids.
    # zh: 和许多对话模型一样，它声明了两个结束符 id。
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    model.save_pretrained(path)
    return path


workdir = Path(tempfile.mkdtemp(prefix="nanovllm-ch08-"))
tiny = tiny_llama_dir(workdir)
config = Config.from_kwargs(tiny, kvcache_block_size=16, max_model_len=100_000)
print(config)
print(say("torch dtype: {dtype} | hidden size: {hidden}", dtype=config.torch_dtype,
          hidden=config.hf_config.hidden_size))

# %% [markdown] tags=["en"]
# `max_model_len=100_000` was capped at the model's 1024 positions, `"auto"` became concrete
# choices (CPU, float32 and the torch backend here; on a GPU, CUDA, the model's half dtype and
# the torch backend, until chapter 11 makes its kernels the GPU's default), and both EOS ids were found.
# Now the mistakes, each caught with a message that names the field:

# %% [markdown] tags=["zh"]
# `max_model_len=100_000` 被截断为模型的 1024 个位置，`"auto"` 变成了具体的选择（这里是 CPU、float32 和 torch
# 后端；在 GPU 上则是 CUDA、模型的半精度类型和 torch 后端，直到第 11 章把它的内核设为 GPU 上的默认值），两个
# EOS id 都被找到了。
# 下面是各种错误，每一个都会被拦下，报错信息指明是哪个字段：

# %%
broken = workdir / "broken"
broken.mkdir()
(broken / "config.json").write_text("{ not json", encoding="utf-8")
no_weights = workdir / "no-weights"
no_weights.mkdir()
(no_weights / "config.json").write_text((tiny / "config.json").read_text(encoding="utf-8"), encoding="utf-8")


def config_only(name: str, **changes: object) -> Path:
    """A directory holding only the tiny model's config.json, some of its fields changed."""
    # zh: 一个只装着小模型 config.json 的目录，其中一些字段被改过。
    directory = workdir / name
    directory.mkdir()
    fields = json.loads((tiny / "config.json").read_text(encoding="utf-8")) | changes
    (directory / "config.json").write_text(json.dumps(fields), encoding="utf-8")
    return directory


mistakes = {
    "misspelled key": lambda: Config.from_kwargs(tiny, max_num_seq=8),
    "derived field": lambda: Config.from_kwargs(tiny, eos_token_ids=(0,)),
    "block size 48": lambda: Config.from_kwargs(tiny, kvcache_block_size=48),
    "bool as int": lambda: Config.from_kwargs(tiny, max_num_seqs=True),
    "zero blocks": lambda: Config.from_kwargs(tiny, num_kvcache_blocks=0),
    "utilization 1.5": lambda: Config.from_kwargs(tiny, gpu_memory_utilization=1.5),
    "unknown device": lambda: Config.from_kwargs(tiny, device="tpu"),
    "dtype float64": lambda: Config.from_kwargs(tiny, dtype="float64"),
    "missing dir": lambda: Config.from_kwargs(workdir / "nowhere"),
    "empty dir": lambda: Config.from_kwargs(workdir),
    "malformed config": lambda: Config.from_kwargs(broken),
    "no weights": lambda: Config.from_kwargs(no_weights),
    "hidden size -64": lambda: Config.from_kwargs(config_only("negative", hidden_size=-64)),
    "no heads": lambda: Config.from_kwargs(config_only("headless", num_attention_heads=0)),
    "unknown backend": lambda: Config.from_kwargs(tiny, attention_backend="flash"),
}
caught = {}
for what, make in mistakes.items():
    try:
        make()
    except (TypeError, ValueError) as error:
        caught[what] = error
        print(f"{say(what):>17}: {type(error).__name__}: {str(error)[:150]}")
assert caught.keys() == mistakes.keys(), "every mistake must be refused"

# %% [markdown] tags=["en"]
# ### Check it

# %% [markdown] tags=["zh"]
# ### 验证

# %%
assert config.max_model_len == 1024 and config.eos_token_ids == (2, 3)
# en: "auto": the GPU and the model's half dtype where there is one. The backend is the torch reference, the only
# en: one of the core engine (on a GPU, chapter 11's kernels once the book has built them).
# zh: "auto" 的结果：有 GPU 时用 GPU 和模型的半精度类型。后端是 torch 参考实现，核心引擎唯一的后端（在 GPU 上，
# zh: 本书构建出第 11 章的内核之后就是它们）。
if torch.cuda.is_available():
    assert config.device == "cuda" and config.dtype in ("bfloat16", "float16")
    assert config.attention_backend in ("torch", "triton")
else:
    assert (config.device, config.dtype, config.attention_backend) == ("cpu", "float32", "torch")
# en: nano-vllm's defaults when nothing is given
# zh: 什么都不指定时，使用 nano-vllm 的默认值。
assert Config(str(tiny)).kvcache_block_size == 256
assert isinstance(caught["misspelled key"], UnknownConfigKeyError)
assert "did you mean 'max_num_seqs'" in str(caught["misspelled key"])
assert all(name in str(caught["misspelled key"]) for name in Config.settings())
assert "eos_token_ids" not in Config.settings() and "model" not in Config.settings()
for block_size in (1, 2, 16, 256, 1024):
    assert Config.from_kwargs(tiny, kvcache_block_size=block_size).kvcache_block_size == block_size
# en: Resolution is idempotent: a resolved config can be rebuilt from its own fields.
# zh: 解析是幂等的：已解析的配置可以用它自己的字段重新构造。
again = Config.from_kwargs(config.model, **{name: getattr(config, name) for name in Config.settings()})
assert (again.device, again.dtype, again.max_model_len) == (config.device, config.dtype, config.max_model_len)
print(say("Config checks hold"))

# %% [markdown] tags=["en"]
# ## Build it: the inputs of a step
#
# Chapter 07's `set_prefill_context` and `set_decode_context` turn per-sequence lengths and
# block tables into the context tensors (slots included). What is left for the runner is to
# read those lengths off the sequences, and to lay out `input_ids` and `positions`.

# %% [markdown] tags=["zh"]
# ## 动手：一步的输入
#
# 第 07 章的 `set_prefill_context` 和 `set_decode_context` 会把每个序列的长度和块表变成上下文张量（包括槽位）。
# 留给执行器的工作，是从序列上读出这些长度，并排好 `input_ids` 和 `positions`。

# %% prepare inputs
#| export
from __future__ import annotations

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.context import host_to_device, reset_context, set_decode_context, set_prefill_context


def prepare_prefill(
    seqs: list[Sequence], block_size: int, device: torch.device | str = "cpu", *, with_cache: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat input_ids and positions of a prefill step; installs the attention context.

    with_cache=False is the warm-up forward: no KV cache exists yet, so nothing is stored.
    """
    # zh: prefill 步展平的 input_ids 和 positions；装好注意力上下文。
    # zh:
    # zh: with_cache=False 表示预热前向：KV 缓存还不存在，所以什么都不存。
    input_ids: list[int] = []
    positions: list[int] = []
    seqlens_q: list[int] = []
    seqlens_k: list[int] = []
    for seq in seqs:
        start, count = seq.num_cached_tokens, seq.num_scheduled_tokens
        assert count >= 1, f"sequence {seq.seq_id} has no scheduled tokens in this prefill step"
        # en: A chunk sees its cached prefix plus itself, not the whole prompt.
        # zh: 一个分块能看到的是它的已缓存前缀加上它自己，而不是整个提示词。
        input_ids += seq.scheduled_token_ids
        positions += range(start, start + count)
        seqlens_q.append(count)
        seqlens_k.append(start + count)
    tables = [seq.block_table for seq in seqs] if with_cache else None
    set_prefill_context(seqlens_q, seqlens_k, tables, block_size, device)
    return _tensor(input_ids, device), _tensor(positions, device)


def prepare_decode(
    seqs: list[Sequence], block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and positions of a decode step (one token per sequence); installs the context."""
    # zh: decode 步的 input_ids 和 positions（每个序列一个 token）；装好上下文。
    for seq in seqs:
        assert seq.num_scheduled_tokens == 1 and seq.num_cached_tokens == len(seq) - 1, f"not ready to decode: {seq}"
    input_ids = [seq.last_token for seq in seqs]
    positions = [len(seq) - 1 for seq in seqs]
    set_decode_context([len(seq) for seq in seqs], [seq.block_table for seq in seqs], block_size, device)
    return _tensor(input_ids, device), _tensor(positions, device)


def _tensor(values: list[int], device: torch.device | str) -> torch.Tensor:
    return host_to_device(values, torch.int64, device)

# %% [markdown] tags=["en"]
# ### See it
#
# The example of the drawing: A is new with 5 tokens, B has 10 tokens of which 8 are cached
# (two blocks found by the prefix cache) and computes the last 2. We fill in the block tables
# by hand, as the block manager would.

# %% [markdown] tags=["zh"]
# ### 看它运行
#
# 上图中的例子：A 是新序列，5 个 token；B 有 10 个 token，其中 8 个已缓存（前缀缓存找到的两个块），本步计算最后 2 个。
# 我们像块管理器那样手工填写块表。

# %%
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.context import get_context, reset_context

a = Sequence([10, 11, 12, 13, 14], block_size=4)
a.block_table, a.num_scheduled_tokens = [7, 3], 5
b = Sequence(list(range(20, 30)), block_size=4)
b.block_table, b.num_cached_tokens, b.num_scheduled_tokens = [0, 1, 5], 8, 2

input_ids, positions = prepare_prefill([a, b], block_size=4)
ctx = get_context()
print("input_ids   ", input_ids.tolist())
print("positions   ", positions.tolist())
print("cu_seqlens_q", ctx.cu_seqlens_q.tolist(), " cu_seqlens_k", ctx.cu_seqlens_k.tolist())
print("slot_mapping", ctx.slot_mapping.tolist())
print("block_tables", ctx.block_tables.tolist())

# %%
assert input_ids.tolist() == [10, 11, 12, 13, 14, 28, 29]
assert positions.tolist() == [0, 1, 2, 3, 4, 8, 9]
assert ctx.cu_seqlens_q.tolist() == [0, 5, 7] and ctx.cu_seqlens_k.tolist() == [0, 5, 15]
# en: A's tokens 0..3 go to block 7 (slots 28..31), token 4 to block 3 (slot 12); B's 8, 9 to block 5.
# zh: A 的第 0..3 个 token 写入块 7（槽位 28..31），第 4 个写入块 3（槽位 12）；B 的第 8、9 个写入块 5。
assert ctx.slot_mapping.tolist() == [28, 29, 30, 31, 12, 20, 21]
assert ctx.block_tables.tolist() == [[7, 3, -1], [0, 1, 5]]

# en: Then both decode: A appended a token (now 6 long), B too (11 long).
# zh: 接着两者都进入 decode：A 追加了一个 token（现在长 6），B 也是（长 11）。
for seq, token in ((a, 15), (b, 30)):
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.append_token(token)
    seq.num_scheduled_tokens = 1
input_ids, positions = prepare_decode([a, b], block_size=4)
ctx = get_context()
print(say("decode: {ids} {positions} {lens} {slots}", ids=input_ids.tolist(), positions=positions.tolist(),
          lens=ctx.context_lens.tolist(), slots=ctx.slot_mapping.tolist()))
assert input_ids.tolist() == [15, 30] and positions.tolist() == [5, 10]
assert ctx.context_lens.tolist() == [6, 11] and ctx.slot_mapping.tolist() == [13, 22]
reset_context()

# %% [markdown] tags=["en"]
# ## Build it: how many KV blocks?
#
# One block holds, for every layer, the keys and the values of `block_size` tokens:
#
# `block_bytes = 2 × layers × block_size × kv_heads × head_dim × dtype size`
#
# - **On a GPU** (nano-vllm's rule): run one warm-up forward of the largest step the scheduler
#   can make, so that the activations' peak is known, then give the KV cache what is left of
#   `total × gpu_memory_utilization`: `total × utilization − used − peak + current`, where
#   `used` is what the device reports in use (other processes included), `peak` the highest
#   allocation of the warm-up and `current` what torch holds now (the weights).
# - **On a CPU** memory is shared with everything else and there is no reliable "free", so the
#   budget is explicit: `kvcache_memory_gb`.
# - `num_kvcache_blocks > 0` overrides both (tests use it to force preemption with a tiny pool).
#
# Either way, there is no point in more blocks than `max_num_seqs` sequences of `max_model_len`
# tokens can ever use, so the count is capped there: a tiny model on a laptop does not reserve
# a gigabyte it can never fill.
#
# `kv_cache_summary(config)` reports the pool the runner sized in one line (blocks, tokens, bytes;
# the benchmark prints it).
#
# A pool the machine cannot hold (`num_kvcache_blocks=10**9`, say) is refused with an error that
# names the setting to change, not with the allocator's message about bytes. On a CPU the pool
# is also compared with the machine's memory first: Linux may grant a huge allocation that it
# cannot back, and the process would be killed later, when the blocks fill up.

# %% [markdown] tags=["zh"]
# ## 动手：需要多少个 KV 块？
#
# 一个块为每一层保存 `block_size` 个 token 的键和值：
#
# `block_bytes = 2 × 层数 × block_size × kv_heads × head_dim × 数据类型字节数`
#
# - **GPU 上**（nano-vllm 的规则）：先用调度器可能产生的最大一步做一次预热前向，得到激活值的峰值，再把
#   `total × gpu_memory_utilization` 剩下的部分交给 KV 缓存：`total × utilization − used − peak + current`。
#   其中 `used` 是设备报告的已用显存（包括其他进程），`peak` 是预热时的最高分配量，
#   `current` 是 torch 当前持有的量（即权重）。
# - **CPU 上**内存与其他一切共享，没有可靠的“空闲量”，所以预算是显式给出的：`kvcache_memory_gb`。
# - `num_kvcache_blocks > 0` 会覆盖以上两者（测试用它配出一个很小的块池来强制抢占）。
#
# 无论哪种情况，块数都不必超过 `max_num_seqs` 个长度为 `max_model_len` 的序列所能用到的数量，所以在那里封顶：
# 笔记本电脑上的小模型不会预留一块永远填不满的 1 GB 内存。
#
# `kv_cache_summary(config)` 用一行报告执行器定好的块池（块数、token 数、字节数；基准测试会打印它）。
#
# 机器容纳不下的块池（比如 `num_kvcache_blocks=10**9`）会被拒绝，报错指明应当修改哪个配置项，而不是分配器那条
# 关于字节数的消息。在 CPU 上还会先把块池与机器的内存总量比较：Linux 可能答应一次它根本兑现不了的巨大分配，
# 进程要等到块被逐渐填满时才会被杀掉。

# %% kv cache sizing
#| export
import math
import os
from typing import Any

from nanovllm.config import Config
from nanovllm.models.qwen3 import head_dim_of


def kv_block_bytes(hf_config: Any, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block: keys and values of `block_size` tokens in every layer (one rank's heads), in the
    cache's ``dtype``."""
    # zh: 一个 KV 块的字节数：每层中 `block_size` 个 token 的键和值（一个 rank 的那些头），
    # zh: 按缓存的 ``dtype`` 计。
    kv_heads = max(1, hf_config.num_key_value_heads // tensor_parallel_size)
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim_of(hf_config) * dtype.itemsize


def kv_cache_torch_dtype(config: Config) -> torch.dtype:
    """The dtype of the cached K/V: the model's."""
    # zh: 缓存的 K/V 的 dtype：与模型的相同。
    return config.torch_dtype


def kv_cache_summary(config: Config) -> str:
    """One line on the KV pool of an engine built from ``config`` (once its runner has sized it)."""
    # zh: 用一行文字描述由 ``config`` 构建的引擎的 KV 块池（在它的执行器确定大小之后）。
    dtype, block_size = kv_cache_torch_dtype(config), config.kvcache_block_size
    block = kv_block_bytes(config.hf_config, block_size, dtype, config.tensor_parallel_size)
    blocks, kind = config.num_kvcache_blocks, str(dtype).removeprefix("torch.")
    rank = " per rank" if config.tensor_parallel_size > 1 else ""
    return (f"KV cache: {blocks:,} blocks x {block_size} tokens = {blocks * block_size:,} tokens, {kind}, "
            f"{block / 2**20:.2f} MiB a block, {blocks * block / 2**30:.2f} GiB{rank}")


def max_useful_blocks(config: Config) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens would fill."""
    # zh: max_num_seqs 个长为 max_model_len 的序列会占满的块数。
    per_seq = -(-config.max_model_len // config.kvcache_block_size)
    return per_seq * config.max_num_seqs


def num_kv_blocks(config: Config, block_bytes: int, *, available_bytes: float | None = None) -> int:
    """How many KV blocks to allocate (available_bytes: what the device can give the cache)."""
    # zh: 分配多少个 KV 块（available_bytes：设备能给缓存的内存）。
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    if available_bytes is None:
        available_bytes = config.kvcache_memory_gb * 2**30
    blocks = min(int(available_bytes // block_bytes), max_useful_blocks(config))
    if blocks < 1:
        raise ValueError(
            f"no room for a single KV block ({block_bytes / 2**20:.1f} MiB): {available_bytes / 2**20:.1f} MiB "
            f"available; raise kvcache_memory_gb / gpu_memory_utilization or lower kvcache_block_size"
        )
    return blocks


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, setting: str) -> torch.Tensor:
    """The KV cache tensor; a pool the device cannot hold is a ValueError naming ``setting``, the knob to lower."""
    # zh: KV 缓存张量；设备放不下的块池会引发 ValueError，写明 ``setting``，即该调小的那个设置。
    nbytes = math.prod(shape) * dtype.itemsize
    what = f"the KV cache of {shape[2]} blocks needs {nbytes / 2**30:,.1f} GiB"
    fix = f"lower {setting}" + (" (or leave it at -1 to size the cache from memory)"
                                if setting == "num_kvcache_blocks" else "")
    if device.type == "cpu" and nbytes > _physical_memory():
        raise ValueError(f"{what}, more than this machine's {_physical_memory() / 2**30:,.1f} GiB of memory; {fix}")
    try:
        # en: Zeros on a GPU, not empty memory: FlashAttention 4 reads whole pages, and a NaN left in an
        # en: unwritten row of a sequence's last page would poison its output (0 x NaN). It costs milliseconds, once.
        # zh: GPU 上用零，而不是未初始化的显存：FlashAttention 4（第 11 章）按整页读取，序列最后一页中未写入的行里
        # zh: 若残留 NaN，就会污染它的输出（0 × NaN）。这只花几毫秒，而且只做一次。
        if device.type == "cuda":
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)
    # en: torch.OutOfMemoryError on a GPU
    # zh: 在 GPU 上是 torch.OutOfMemoryError。
    except RuntimeError as error:
        cause = str(error).partition("\n")[0]
        raise ValueError(f"{what}, more than {device} can allocate ({cause}); {fix}") from error


def _physical_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # en: no sysconf (Windows)
    # zh: 没有 sysconf（Windows）。
    except (AttributeError, ValueError, OSError):
        return math.inf

# %% [markdown] tags=["en"]
# ## Build it: the copy in copy-on-write
#
# Chapter 05 lets the samples of one prompt share its blocks. When one of them is about to
# write into a block that another still holds, the block manager gives it a fresh block and
# writes the pair *(source, destination)* into `seq.blocks_to_copy`; the runner moves the data.
# All of a step's copies, in every layer, keys and values alike, are **one** indexed read and
# **one** indexed write on the single KV tensor: dimension 2 is the block, so
# `kv_cache[:, :, dst] = kv_cache[:, :, src]` copies whole blocks across all layers at once. The
# runner does it at the very start of a step, before the forward, so it is queued ahead of the
# step's K/V stores and stays outside any CUDA graph (chapter 14); with tensor parallelism every
# rank does the same on its own heads (chapter 16).

# %% [markdown] tags=["zh"]
# ## 动手：写时复制中的“复制”
#
# 第 05 章让同一个提示词的多个样本共享它的块。当其中一个样本要写入一个仍被别的样本持有的块时，块管理器给它一个新块，
# 并把 *(源块, 目标块)* 记进 `seq.blocks_to_copy`；搬数据的是执行器。一步中的所有拷贝，不论哪一层、K 还是 V，
# 都只是对那一个 KV 张量做**一次**按索引读取和**一次**按索引写入：第 2 维是块，所以
# `kv_cache[:, :, dst] = kv_cache[:, :, src]` 一次就把整块在所有层中拷贝过去。执行器在一步的最开头、前向计算
# 之前做这件事，因此它排在这一步写入 K/V 之前，也不在任何 CUDA Graph 之内（第 14 章）；张量并行时，每个 rank 对
# 自己的那部分头做同样的事（第 16 章）。

# %% copy blocks
#| export
def copy_kv_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """For each (source, destination) pair, give block destination the keys and values of block source, in
    every layer: one gather and one scatter for all of a step's copies. ``kv_cache``: [2, layers, blocks, ...]."""
    # zh: 对每一对（源，目的），在每一层里把源块的键和值交给目的块：一步的所有复制只用一次 gather 和
    # zh: 一次 scatter。``kv_cache``：[2, layers, blocks, ...]。
    if not copies:
        return
    sources = host_to_device([source for source, _ in copies], torch.int64, kv_cache.device)
    destinations = host_to_device([destination for _, destination in copies], torch.int64, kv_cache.device)
    kv_cache[:, :, destinations] = kv_cache[:, :, sources]

# %% [markdown] tags=["en"]
# A check on a small KV tensor: blocks 5 and 6 receive blocks 1 and 2 in both layers, keys and
# values, and no other block changes.

# %% [markdown] tags=["zh"]
# 在一个小 KV 张量上检查：块 5、6 在两层中、K 和 V 都收到了块 1、2 的内容，其余块都没有变。

# %%
import torch

from nanovllm.engine.model_runner import copy_kv_blocks

# en: [K/V, layers, blocks, block_size, kv_heads, head_dim]
# zh: 形状为 [K/V, layers, blocks, block_size, kv_heads, head_dim]。
kv = torch.randn(2, 2, 8, 4, 1, 3)
before = kv.clone()
copy_kv_blocks(kv, [(1, 5), (2, 6)])
assert torch.equal(kv[:, :, 5], before[:, :, 1]) and torch.equal(kv[:, :, 6], before[:, :, 2])
untouched = [b for b in range(8) if b not in (5, 6)]
assert torch.equal(kv[:, :, untouched], before[:, :, untouched])
print(say("blocks 5, 6 now hold blocks 1, 2 in every layer; the other six are unchanged"))

# %% [markdown] tags=["en"]
# ## Build it: `ModelRunner`
#
# The runner builds the model (chapter 06's `build_model` picks the class from
# `config.json`'s `architectures`), points every attention layer at the chosen backend,
# allocates **one** KV tensor `[2, layers, blocks, block_size, kv_heads, head_dim]` and gives
# each layer its two views `kv_cache[0, i]` and `kv_cache[1, i]`: one allocation, no copies.
#
# `run` is one step: `compute_logits` (the copy-on-write copies of chapter 05, the inputs, the
# model's forward, one row of logits per sequence: the last computed token's), then `sample`. A
# sequence whose prefill chunk does not reach the end of its prompt gets no token: its "next
# token" would be a prediction for a prompt position, which the scheduler throws away anyway.
# The runner returns `-1` for it instead of spending a sampling pass on it. A request that forks
# (chapter 05) gets its siblings' first tokens from its row too, after the step's own tokens, in
# `sibling_samples` order.
#
# That is upstream's `model_runner.py`, minus its shared-memory plumbing for ranks and its CUDA
# graphs. Later chapters add to it: chapter 11 compiles its kernels when the runner is built,
# chapter 14 compiles the small ops and captures graphs there too and lets `compute_logits` replay
# a decode step's graph, chapter 17 fills the hook `agreed_block_count` (the ranks agree on the
# pool), and chapter 18 adds `launch`, a step queued without waiting for its tokens.
#
# The runner builds what the layers compute with once and hands it down: one attention backend
# object (`attention_backend(config.attention_backend)`, chapter 07) given to every `Attention`
# layer, and chapter 08's `Sampler`.

# %% [markdown] tags=["zh"]
# ## 动手：`ModelRunner`
#
# 执行器构建模型（第 06 章的 `build_model` 会按 `config.json` 中的 `architectures` 选择模型类），让每个注意力层
# 使用选定的后端，分配**一个** KV 张量 `[2, layers, blocks, block_size, kv_heads, head_dim]`，再把它的两个视图
# `kv_cache[0, i]` 和 `kv_cache[1, i]` 交给第 `i` 层：只分配一次，没有拷贝。
#
# `run` 就是一步：`compute_logits`（第 05 章的写时复制拷贝、准备输入、模型的前向计算，为每个序列保留一行 logits：
# 它最后一个被计算的 token），然后 `sample`。如果某个序列的 prefill 分块没有到达提示词末尾，它就得不到 token：
# 它的“下一个 token”只是对提示词中某个位置的预测，调度器反正会丢掉。执行器为它返回 `-1`，而不是为它做一次采样。
# 要分叉的请求（第 05 章）还从它这一行为兄弟序列抽取首 token，排在这一步自己的 token 之后，顺序同 `sibling_samples`。
#
# 这就是上游的 `model_runner.py`，去掉了它为多个 rank 准备的共享内存管道和 CUDA Graph。后面的章节往上添加：第 11 章
# 在构建执行器时编译自己的内核，第 14 章也在那时编译小算子、捕获 CUDA Graph，并让 `compute_logits` 为 decode 步
# 重放图，第 17 章填上接缝 `agreed_block_count`（各 rank 就块池达成一致），第 18 章加上 `launch`：把一步排进队列
# 而不等它的 token。
#
# 执行器把各层用来计算的东西构建一次，再交下去：一个注意力后端对象（`attention_backend(config.attention_backend)`，
# 第 07 章）交给每个 `Attention` 层；还有第 08 章的 `Sampler`。

# %% model runner
#| export
from nanovllm.engine.sequence import sibling_samples
from nanovllm.layers.attention import Attention, attention_backend
from nanovllm.layers.sampler import Sampler, sampling_inputs
from nanovllm.models.loader import build_model

NOT_SAMPLED = -1


class ModelRunner:
    """Runs the model on the scheduler's steps; owns the model, the KV cache and the sampler."""
    # zh: 在调度器给出的各步上运行模型；拥有模型、KV 缓存和采样器。

    def __init__(self, config: Config) -> None:
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model = build_model(config.model, self.dtype, self.device, config.load_format, config.hf_config)
        # en: What the model's layers compute with is built once here and handed down: one attention backend
        # en: for every layer, and the sampler.
        # zh: 模型各层计算所用的东西在这里构建一次，再分发下去：所有层共用一个注意力后端，还有采样器。
        self.attention = attention_backend(config.attention_backend)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.attention
        self.sampler = Sampler()
        self.stopped = False
        self.kv_cache = self.allocate_kv_cache()
        # en: The scheduler sizes its block pool from this.
        # zh: 调度器据此确定块池的大小。
        config.num_kvcache_blocks = self.kv_cache.shape[2]

    # en: ---- the KV cache ---------------------------------------------------------
    # zh: ---- KV 缓存 -------------------------------------------------------------
    def allocate_kv_cache(self) -> torch.Tensor:
        """The one KV tensor of the model; each attention layer gets its two views."""
        # zh: 模型唯一的 KV 张量；每个注意力层得到它的两个视图。
        dtype = kv_cache_torch_dtype(self.config)
        kv_cache = allocate_kv(self.kv_cache_shape(dtype), dtype, self.device, self.memory_setting())
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
        return kv_cache

    def kv_cache_shape(self, dtype: torch.dtype) -> tuple[int, ...]:
        """[2, layers, blocks, block_size, kv_heads, head_dim], with as many blocks of ``dtype`` as
        `kv_block_count` allows."""
        # zh: [2, layers, blocks, block_size, kv_heads, head_dim]，块数为 `kv_block_count` 允许的
        # zh: ``dtype`` 块的个数。
        hf, ranks = self.config.hf_config, self.config.tensor_parallel_size
        blocks = self.kv_block_count(kv_block_bytes(hf, self.block_size, dtype, ranks))
        kv_heads = max(1, hf.num_key_value_heads // ranks)
        return (2, len(self.attention_layers), blocks, self.block_size, kv_heads, head_dim_of(hf))

    def memory_setting(self) -> str:
        """The setting that bounds the KV pool here: the one to change when the pool does not fit."""
        # zh: 这里限制 KV 块池大小的设置：块池放不下时该改的那一个。
        if self.config.num_kvcache_blocks > 0:
            return "num_kvcache_blocks"
        return "gpu_memory_utilization" if self.device.type == "cuda" else "kvcache_memory_gb"

    def kv_block_count(self, block_bytes: int) -> int:
        """How many KV blocks to allocate: the configured count, else what this device's memory holds."""
        # zh: 分配多少个 KV 块：配置了数目就用它，否则看这台设备的显存能装下多少。
        available = self._cuda_budget() if self.device.type == "cuda" else None
        return self.agreed_block_count(num_kv_blocks(self.config, block_bytes, available_bytes=available))

    def agreed_block_count(self, count: int) -> int:
        """The block count every rank can afford, given this one's: in one process, its own."""
        # zh: 已知本 rank 的块数，每个 rank 都负担得起的块数：在单个进程里，就是它自己的。
        return count

    def _cuda_budget(self) -> float:
        """Bytes left for the KV cache after a warm-up forward of the largest possible step."""
        # zh: 对可能的最大一步做一次预热前向之后，留给 KV 缓存的字节数。
        if self.config.num_kvcache_blocks > 0:
            # en: unused: the block count is given
            # zh: 用不上：块数已经给定。
            return 0.0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.warmup_model()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        return total * self.config.gpu_memory_utilization - (total - free) - peak + current

    # en: The warm-ups build their inputs inside inference mode, as run() does: a tensor made outside it
    # en: differs to torch.compile's guards, which would then compile again in the first real step.
    # zh: 预热在推理模式中构造输入，和 run() 一样：在推理模式之外创建的张量在 torch.compile 的守卫看来是不同的，
    # zh: 会导致第一个真实步骤再编译一次。
    @torch.inference_mode()
    def warmup_model(self) -> None:
        """One forward of the biggest prefill the scheduler may send, with no KV cache, as upstream's method of
        this name does: the activation peak it leaves in torch's statistics is what `_cuda_budget` keeps out of the
        KV cache. (Not the backends' `warm_up`, which compiles kernels.)"""
        # zh: 对调度器可能发来的最大 prefill 做一次不带 KV 缓存的前向，与上游的同名方法一样：它在 torch 统计中
        # zh: 留下的激活峰值，正是 `_cuda_budget` 从 KV 缓存中扣除的部分。（不是各后端的 `warm_up`，那个是编译内核的。）
        config = self.config
        seq_len = min(config.max_model_len, config.max_num_batched_tokens)
        num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
        seqs = [Sequence([0] * seq_len, block_size=self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        input_ids, positions = prepare_prefill(seqs, self.block_size, self.device, with_cache=False)
        self.model.compute_logits(self.model(input_ids, positions))
        reset_context()

    # en: ---- one step -------------------------------------------------------------
    # zh: ---- 一步 -----------------------------------------------------------------
    @torch.inference_mode()
    def compute_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor | None:
        """The forward of one step: one row of logits per sequence, its last computed token's."""
        # zh: 一步的前向计算：每个序列一行 logits，取自它最后计算的那个 token。
        if self.stopped:
            raise RuntimeError("this model runner was stopped (exit() was called)")
        # en: The engine refuses longer requests up front; the KV cache is sized for max_model_len.
        # zh: 引擎在入口处就拒绝更长的请求；KV 缓存是按 max_model_len 配置的。
        assert all(len(s) <= self.config.max_model_len for s in seqs), "a sequence is longer than max_model_len"
        # en: Copy-on-write: before this step writes into the fresh blocks, give them the
        # en: shared blocks' K/V, queued ahead of the step's stores.
        # zh: 写时复制（第 05 章）：在这一步写入新块之前，先把共享块的 K/V 复制过去，排在这一步的写入之前。
        self.copy_blocks(seqs)
        prepare = prepare_prefill if is_prefill else prepare_decode
        try:
            input_ids, positions = prepare(seqs, self.block_size, self.device)
            return self.model.compute_logits(self.model(input_ids, positions))
        finally:
            reset_context()

    def copy_blocks(self, seqs: list[Sequence]) -> None:
        """The copy-on-write copies that the block manager planned for ``seqs`` (`copy_kv_blocks`)."""
        # zh: 块管理器为 ``seqs`` 计划的写时复制（`copy_kv_blocks`）。
        copy_kv_blocks(self.kv_cache, [pair for seq in seqs for pair in seq.blocks_to_copy])

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """Compute one step: one sampled token per sequence (NOT_SAMPLED for a partial prefill chunk), then the
        first token of each sibling the step forks; None where there are no logits to sample."""
        # zh: 计算一步：每个序列采样一个 token（prefill 的部分分块为 NOT_SAMPLED），然后是这一步分叉出的
        # zh: 每个兄弟序列的第一个 token；没有 logits 可采样时为 None。
        logits = self.compute_logits(seqs, is_prefill)
        rows, sampled = self.sample(seqs, logits)
        if sampled is None:
            return None
        values = sampled.tolist()
        tokens = [NOT_SAMPLED] * len(seqs)
        for i, token in zip(rows, values[: len(rows)], strict=True):
            tokens[i] = token
        return tokens + values[len(rows) :]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """The rows of ``seqs`` that want a token, and the sampled tokens (None without logits): those rows'
        tokens, then the siblings' first tokens in `sibling_samples` order."""
        # zh: ``seqs`` 中需要 token 的那些行，以及采样出的 token（没有 logits 时为 None）：先是那些行的 token，
        # zh: 再是各兄弟序列的第一个 token，按 `sibling_samples` 的顺序。
        # en: Only rows whose whole sequence has been computed want a token. A request that forks
        # en: also draws its siblings' first tokens from its row, after the step's own rows.
        # zh: 只有整个序列都已算完的行才需要 token。要分叉的请求（第 05 章）还要从它这一行为兄弟序列抽取首 token，
        # zh: 排在本步各行之后。
        rows = [i for i, seq in enumerate(seqs) if seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq)]
        if logits is None or not rows:
            return rows, None if logits is None else logits.new_empty(0, dtype=torch.int64)
        siblings = sibling_samples(seqs)
        picks = rows + [i for i, _ in siblings]
        sample_indices = [seqs[i].sample_index for i in rows] + [k for _, k in siblings]
        wanted = [seqs[i] for i in picks]
        inputs = sampling_inputs([s.sampling_params for s in wanted], [len(s) for s in wanted], logits.device,
                                 sample_indices)
        # en: All of the logits only when the picks are exactly rows 0..n-1: a forked sibling may take a row's
        # en: place when another row is a partial chunk (same count, other rows).
        # zh: 只有挑选的恰好是第 0..n-1 行时才直接用全部 logits：某行是不完整的分块时，分叉出的兄弟序列可能
        # zh: 顶替它的位置（行数相同，行却不同）。
        whole = picks == list(range(len(seqs)))
        return rows, self.sampler(logits if whole else logits[picks], **inputs)

    def exit(self) -> None:
        """Release the KV cache and refuse further steps (the tensor-parallel runner also stops its rank processes)."""
        # zh: 释放 KV 缓存并拒绝之后的步（张量并行执行器还会停掉它的 rank 进程）。
        self.stopped = True
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = torch.tensor([])


# %% [markdown] tags=["en"]
# ### See it: a runner on a tiny model
#
# A tiny Qwen3 with a CPU budget of 1 MiB for the KV cache: how many blocks that buys, the one
# KV tensor, and each layer's views into it.

# %% [markdown] tags=["zh"]
# ### 看它运行：小模型上的执行器
#
# 一个小 Qwen3，CPU 上给 KV 缓存 1 MiB 的预算：这能换来多少个块、那一个 KV 张量，以及每一层指向它的视图。

# %%
from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams
from nanovllm.book.tiny_models import build_tiny_model

tiny = build_tiny_model("qwen3")
# en: the CPU rule
# zh: CPU 上的规则：KV 缓存的预算由 kvcache_memory_gb 显式给出。
config = Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, kvcache_memory_gb=1 / 1024)
block_bytes = kv_block_bytes(config.hf_config, 4, torch.float32)
runner = ModelRunner(config)
print(say("one block: {size} bytes -> {blocks} blocks in 1 MiB", size=block_bytes, blocks=config.num_kvcache_blocks))
print(kv_cache_summary(config))
print(say("KV cache: {shape} = [2, layers, blocks, block_size, kv_heads, head_dim]",
          shape=tuple(runner.kv_cache.shape)))
assert config.num_kvcache_blocks == 2**20 // block_bytes
for i, layer in enumerate(runner.attention_layers):
    # en: Views, not copies: layer i writes straight into the shared tensor.
    # zh: 是视图而不是拷贝：第 i 层直接写进共享的张量。
    assert layer.k_cache.data_ptr() == runner.kv_cache[0, i].data_ptr()
    assert layer.v_cache.data_ptr() == runner.kv_cache[1, i].data_ptr()

# %% [markdown] tags=["en"]
# ### Check it: two steps by hand, against `transformers`
#
# We play the scheduler: a 9-token prompt whose prefill is split into chunks of 5 and 4 tokens,
# then one decode step. The first chunk yields no token (`-1`); the second yields the first
# generated token, and the decode step the second. Both must be `transformers`' greedy choices.

# %% [markdown] tags=["zh"]
# ### 验证：手工执行两步，与 `transformers` 对比
#
# 我们扮演调度器：一个 9 个 token 的提示词，prefill 分成 5 个和 4 个 token 的两个分块，然后做一个 decode 步。
# 第一个分块不产生 token（`-1`）；第二个分块产生第一个生成的 token，decode 步产生第二个。
# 两者都必须等于 `transformers` 的贪心选择。

# %%
from transformers import AutoModelForCausalLM

prompt = [17, 4, 250, 33, 9, 88, 120, 5, 61]
seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=2), block_size=4)
# en: what the block manager would hand out
# zh: 块管理器本来会分给它的块。
seq.block_table = [6, 2, 9]

seq.num_scheduled_tokens = 5
# en: a chunk that stops inside the prompt
# zh: 停在提示词中间的分块。
assert runner.run([seq], is_prefill=True) == [NOT_SAMPLED]
seq.num_cached_tokens, seq.num_scheduled_tokens = 5, 4
(first,) = runner.run([seq], is_prefill=True)
seq.num_cached_tokens, seq.num_scheduled_tokens = 9, 0
seq.append_token(first)
# en: decode: position 9 goes to block 2 (index 9 // 4), slot 9*4 + 1 = 37
# zh: decode：位置 9 写入块表下标 2（9 // 4）的块，槽位 9*4 + 1 = 37。
seq.num_scheduled_tokens = 1
(second,) = runner.run([seq], is_prefill=False)

hf = AutoModelForCausalLM.from_pretrained(tiny).eval()
ids = torch.tensor([prompt])
expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False)[0, len(prompt):].tolist()
print(say("runner: {ours}  transformers: {theirs}", ours=[first, second], theirs=expected))
assert [first, second] == expected

# %% [markdown] tags=["en"]
# ## What we built
#
# - `prepare_prefill` / `prepare_decode`: a step's sequences → `input_ids`, `positions` and the
#   attention context; chunk-aware (`seqlen_k = num_cached + num_scheduled`), slots only for
#   the computed tokens, block tables only when a prefix is cached.
# - `kv_block_bytes`, `num_kv_blocks`: how big the paged KV cache is, from a CPU budget, the
#   GPU's free memory after a warm-up, or an explicit block count.
# - `Config`: nano-vllm's settings plus `device`, `dtype`, `attention_backend`,
#   `enable_prefix_caching` and `kvcache_memory_gb`; every field checked, `"auto"` resolved,
#   `max_model_len` capped, every EOS id collected; `Config.from_kwargs` refuses unknown keys.
# - `ModelRunner`: the model, one KV tensor with per-layer views, and `run(seqs, is_prefill)`,
#   which samples only the rows that want a token. Its forward half is a method of its own,
#   `compute_logits` (chapter 17's ranks use it too); `exit()` releases the KV cache.
#
# Chapter 10 puts the scheduler and the runner in one loop.
#
# ## Exercises
#
# 1. A decode step for sequences of lengths 6 and 11 with `block_size=4`: which positions do
#    the two input tokens have, and which blocks of their block tables do they write to?
# 2. SmolLM2 has 30 layers, 3 KV heads of dimension 64. How many bytes is one block of 256
#    tokens in float32? How many such blocks fit in 1 GiB?
# 3. Why would `run` be wrong if it sampled a token for every row of a chunked prefill and the
#    scheduler appended it?
# 4. Why does `Config.from_kwargs` take `model` as a positional-only parameter? What would
#    `Config.from_kwargs(path, model="other")` do otherwise?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `prepare_prefill` / `prepare_decode`：把一步的序列变成 `input_ids`、`positions` 和注意力上下文；能处理分块
#   （`seqlen_k = num_cached + num_scheduled`），只为本步计算的 token 分配槽位，只在存在已缓存前缀时才给出块表。
# - `kv_block_bytes`、`num_kv_blocks`：分页 KV 缓存有多大——来自 CPU 预算、预热后 GPU 的剩余显存，或者显式给出的块数。
# - `Config`：nano-vllm 的设置，加上 `device`、`dtype`、`attention_backend`、`enable_prefix_caching` 和
#   `kvcache_memory_gb`；每个字段都经过检查，`"auto"` 被解析为具体值，`max_model_len` 被截到模型上限，所有 EOS id
#   都被收集；`Config.from_kwargs` 拒绝未知的键。
# - `ModelRunner`：模型、一个带每层视图的 KV 张量，以及 `run(seqs, is_prefill)`——只为需要 token 的行采样。
#   它的前向部分 `compute_logits` 单独成为一个方法（第 17 章的各个 rank 也用它）；`exit()` 释放 KV 缓存。
#
# 第 10 章把调度器和执行器放进同一个循环。
#
# ## 练习
#
# 1. `block_size=4`，对长度分别为 6 和 11 的两个序列做一个 decode 步：两个输入 token 的位置是多少？
#    它们写入各自块表中的哪一块？
# 2. SmolLM2 有 30 层、3 个维度为 64 的 KV 头。一个 256 token 的块在 float32 下占多少字节？1 GiB 能放多少个这样的块？
# 3. 如果 `run` 为分块 prefill 的每一行都采样一个 token，而调度器又把它追加上去，会出什么错？
# 4. 为什么 `Config.from_kwargs` 把 `model` 设为只能按位置传入的参数？否则 `Config.from_kwargs(path, model="other")`
#    会怎样？

# %%
# en: Exercise 1: positions 5 and 10 (the last token of each), blocks at index 5 // 4 = 1 and 10 // 4 = 2.
# zh: 练习 1：位置 5 和 10（各自的最后一个 token），写入块表下标 5 // 4 = 1 和 10 // 4 = 2 的块。
x, y = Sequence([1] * 6, block_size=4), Sequence([1] * 11, block_size=4)
x.block_table, y.block_table = [3, 8], [0, 1, 5]
for s in (x, y):
    s.num_cached_tokens, s.num_scheduled_tokens = len(s) - 1, 1
_, pos = prepare_decode([x, y], block_size=4)
assert pos.tolist() == [5, 10] and get_context().slot_mapping.tolist() == [8 * 4 + 1, 5 * 4 + 2]
reset_context()

# en: Exercise 2: 2 * 30 * 256 * 3 * 64 * 4 bytes = 11.25 MiB per block, 91 blocks per GiB.
# zh: 练习 2：每块 2 * 30 * 256 * 3 * 64 * 4 字节 = 11.25 MiB，每 GiB 可放 91 块。
smol = type("SmolLM2", (), {"num_key_value_heads": 3, "num_hidden_layers": 30, "head_dim": 64})()
assert kv_block_bytes(smol, 256, torch.float32) == 11.25 * 2**20 and 2**30 // (11.25 * 2**20) == 91

# en: Exercise 3: the token would predict a position *inside* the prompt, and appending it would
# en: put a made-up token in the middle of the prompt. The runner returns -1 and the scheduler
# en: discards it (chapter 04).
# zh: 练习 3：这个 token 预测的是提示词*内部*的某个位置，追加它就等于在提示词中间塞进一个编造的 token。
# zh: 执行器返回 -1，调度器丢弃它（第 04 章）。
partial = Sequence(prompt, SamplingParams(temperature=0), block_size=4)
partial.block_table, partial.num_scheduled_tokens = [0, 1, 3], 8
assert runner.run([partial], is_prefill=True) == [NOT_SAMPLED]

# en: Exercise 4: the key "model" is then an unknown config key, refused with the list of valid
# en: ones, instead of Python's "got multiple values for argument 'model'".
# zh: 练习 4：这时键 "model" 就是一个未知的配置键，报错会列出所有合法的键，而不是 Python 的
# zh: “got multiple values for argument 'model'”。
try:
    Config.from_kwargs(tiny, model="other")
    raise AssertionError("model= must be refused")
except UnknownConfigKeyError as error:
    assert "'model'" in str(error)
print(say("all exercise answers check out"))
