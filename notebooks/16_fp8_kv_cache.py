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
# # 16 · An 8-bit KV cache
#
# PLACEHOLDER

# %% [markdown] tags=["zh"]
# # 16 · 8 位 KV 缓存
#
# PLACEHOLDER

# %% default module
#| default_exp layers.kv_quant

# %% kv quant
#| export
"""The 8-bit KV cache: float8 e4m3 keys and values, one float32 scale per token and KV head (chapter 16)."""

from __future__ import annotations

import torch

# en: The kv_cache_dtype setting: "auto" stores K/V in the model's dtype, "fp8" in float8 e4m3 with scales.
# zh: 配置项 kv_cache_dtype：“auto” 以模型的数据类型存储 K/V，“fp8” 以带缩放因子的 float8 e4m3 存储。
KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value, 1.75 * 2^8
# en: The smallest normal float32: a scale is never 0 (an all-zero row) nor subnormal (flushed to 0 on some GPUs).
# zh: 最小的正规 float32：缩放因子既不会是 0（全零的行），也不会是次正规数（某些 GPU 会把它冲刷成 0）。
MIN_SCALE = 2.0**-126
SCALE_BYTES = 4  # one float32 per (token, KV head), for K and for V


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """One scale per row of ``x`` [..., head_dim]: the row's largest magnitude / FP8_MAX, as float32 [...]."""
    amax = x.float().abs().amax(-1)
    # en: Divided by a tensor, not by the number: on a GPU torch divides by a Python number as a multiplication by
    # en: its reciprocal, one rounding away from the exact quotient the Triton store computes, and 0.1 % of the
    # en: bytes then differ (seen on the H200).
    # zh: 除以一个张量，而不是除以这个数：在 GPU 上，torch 把除以 Python 数实现为乘以它的倒数，比 Triton 存储内核
    # zh: 算出的精确商差一次舍入，于是约 0.1 % 的字节会不同（在 H200 上见到）。
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_dim] -> (float8 e4m3 [..., head_dim], float32 scales [...]): x ≈ q * scale, per row."""
    scales = row_scales(x)
    # en: Exact division, then round to nearest (even) on e4m3's grid; |x / scale| <= 448 by construction.
    # zh: 精确除法，再在 e4m3 的网格上就近（偶数）舍入；按构造 |x / scale| <= 448。
    return (x.float() / scales[..., None]).to(FP8), scales


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values that float8 rows ``q`` [..., head_dim] with ``scales`` [...] stand for, in ``dtype``."""
    return (q.float() * scales[..., None]).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an 8-bit cache gives back for ``x``: quantized and dequantized, in x's dtype."""
    return dequantize_kv(*quantize_kv(x), dtype=x.dtype)


def store_quantized(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize ``x`` [n, kv_heads, d] into rows ``slots`` [n] (int64) of one layer's float8 cache
    [blocks, block_size, kv_heads, d] and its scales [blocks, kv_heads, block_size]."""
    q, row_scale = quantize_kv(x)
    blocks, block_size, kv_heads, _ = cache.shape
    # en: Copied as bytes: indexing float8 tensors is missing on some devices and torch versions; bytes copy exactly.
    # en: (index_copy_ and index_select, not t[index]: on a CPU advanced indexing is a hundred times slower.)
    # zh: 按字节拷贝：某些设备和 torch 版本不支持对 float8 张量做索引；按字节拷贝是精确的。
    # zh: （用 index_copy_ 和 index_select，而不是 t[index]：在 CPU 上高级索引要慢上百倍。）
    cache.view(torch.uint8).view(blocks * block_size, -1).index_copy_(0, slots, q.view(torch.uint8).flatten(1))
    # en: The scale of (slot, head) sits at block * kv_heads * block_size + head * block_size + offset.
    # zh: （槽位，头）的缩放因子位于 block * kv_heads * block_size + head * block_size + offset。
    heads = torch.arange(kv_heads, device=slots.device)
    at = (slots // block_size * kv_heads * block_size + slots % block_size)[:, None] + heads * block_size
    scales.view(-1).index_copy_(0, at.flatten(), row_scale.flatten())


def gather_quantized(cache: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a float8 cache, dequantized: float32 [length, kv_heads, d]."""
    blocks = block_table[: -(-length // cache.shape[1])].long()
    q = cache.view(torch.uint8).index_select(0, blocks).view(FP8).flatten(0, 1)[:length]
    row_scale = scales.index_select(0, blocks).transpose(1, 2).flatten(0, 1)[:length]
    return dequantize_kv(q, row_scale)

# %% kv accuracy
#| export bench.kv_cache_accuracy
"""What an 8-bit KV cache costs on a real model (chapter 16): perplexity of two fixed texts and greedy agreement,
kv_cache_dtype="fp8" against "auto". ``python -m nanovllm.bench.kv_cache_accuracy [--out results.json]``."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nanovllm.bench.report import report_header, write_report
from nanovllm.layers.context import reset_context, set_prefill_context
from nanovllm.sampling_params import SamplingParams

# en: The fixed texts: the prose of chapters 01-04 in each language, frozen in the repository (notebooks/data).
# zh: 固定的文本：第 01–04 章各自语言的正文，冻结在仓库里（notebooks/data）。
TEXTS = Path(__file__).resolve().parents[2] / "notebooks" / "data"
LANGUAGES = ("en", "zh")


def text_token_ids(tokenizer: Any, lang: str, limit: int | None = None, texts: Path = TEXTS) -> list[int]:
    """The fixed text of ``lang`` ("en" or "zh") as token ids, at most ``limit`` of them."""
    path = Path(texts) / f"kv_cache_{lang}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the fixed texts ship in the repository's notebooks/data "
                                "(pass --texts DIR when the package runs outside the repository)")
    return tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[:limit]


@torch.inference_mode()
def perplexity(llm: Any, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood) of each token of ``token_ids`` given the ones before it, under ``llm``'s
    model, every logit computed through its attention backend and KV cache: the text is prefilled in chunks of
    ``chunk`` tokens into the first blocks of the pool, each chunk attending to the earlier chunks read back from
    the cache (float8 with kv_cache_dtype="fp8") and to itself. The engine must be idle (its pool is borrowed) and
    run on one process (tensor_parallel_size=1)."""
    runner, n = llm.model_runner, len(token_ids)
    table = list(range(-(-n // runner.block_size)))
    if n < 2 or chunk < 1:
        raise ValueError(f"need at least 2 tokens and chunk >= 1, got {n} tokens and chunk={chunk}")
    if llm.config.tensor_parallel_size != 1 or not llm.is_finished():
        raise ValueError("perplexity borrows the KV pool of an idle one-process engine")
    if len(table) > llm.config.num_kvcache_blocks or n > llm.config.max_model_len:
        raise ValueError(f"{n} tokens need {len(table)} blocks and max_model_len >= {n}; the engine has "
                         f"{llm.config.num_kvcache_blocks} blocks and max_model_len={llm.config.max_model_len}")
    nll = 0.0
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n)
        # en: Chunk [start, end) after a cached prefix of `start` tokens, as a chunked prefill computes it.
        # zh: 在 `start` 个已缓存 token 之后的分块 [start, end)，和分块预填充的算法一样。
        set_prefill_context([end - start], [end], [table], runner.block_size, runner.device)
        try:
            ids = torch.tensor(token_ids[start:end], device=runner.device)
            hidden = runner.model(ids, torch.arange(start, end, device=runner.device))
        finally:
            reset_context()
        # en: Without a context the LM head computes every row, not only the last one.
        # zh: 没有上下文时，LM head 计算每一行，而不只是最后一行。
        logits = runner.model.compute_logits(hidden).float()
        targets = torch.tensor(token_ids[start + 1 : end + 1], device=runner.device)
        nll += F.cross_entropy(logits[: len(targets)], targets, reduction="sum").item()
    return math.exp(nll / (n - 1))


@torch.inference_mode()
def next_token_probs(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """The model's probabilities of the token after ``token_ids`` (one prefill, through the borrowed pool as in
    `perplexity`)."""
    runner, n = llm.model_runner, len(token_ids)
    set_prefill_context([n], [n], [list(range(-(-n // runner.block_size)))], runner.block_size, runner.device)
    try:
        hidden = runner.model(torch.tensor(token_ids, device=runner.device), torch.arange(n, device=runner.device))
    finally:
        reset_context()
    return runner.model.compute_logits(hidden[-1:]).float().softmax(-1)[0]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two generations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def agreement_prompts(tokenizer: Any, count: int = 32, length: int = 24, texts: Path = TEXTS) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: the openings of the texts' paragraphs, English and Chinese in turn."""
    openings = {}
    for lang in LANGUAGES:
        paragraphs = (Path(texts) / f"kv_cache_{lang}.txt").read_text(encoding="utf-8").split("\n\n")
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in paragraphs]
        openings[lang] = [p[:length] for p in ids if len(p) >= length]
    prompts = [p for pair in zip(*openings.values(), strict=False) for p in pair][:count]
    if len(prompts) < count:
        raise ValueError(f"the texts have only {len(prompts)} paragraphs of {length} tokens or more")
    return prompts


def measure(
    model: str, *, tokens: int = 3000, prompts: int = 32, max_tokens: int = 64, chunk: int = 256,
    texts: Path = TEXTS, **settings: Any,
) -> dict[str, Any]:  # fmt: skip
    """Perplexity of the first ``tokens`` tokens of each text, and the greedy continuations of ``prompts`` prompts
    (``max_tokens`` each), with kv_cache_dtype "auto" and "fp8" (settings: other `LLM` keyword arguments)."""
    from nanovllm.llm import LLM

    results: dict[str, Any] = {"perplexity": {}, "tokens": {}}
    generations = {}
    for kv_cache_dtype in ("fp8", "auto"):  # "auto" last: it then explains where the two part
        with LLM(model, kv_cache_dtype=kv_cache_dtype, **settings) as llm:
            for lang in LANGUAGES:
                ids = text_token_ids(llm.tokenizer, lang, tokens, texts)
                results["tokens"][lang] = len(ids)
                results["perplexity"].setdefault(lang, {})[kv_cache_dtype] = perplexity(llm, ids, chunk)
            greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            inputs = agreement_prompts(llm.tokenizer, prompts, texts=texts)
            generations[kv_cache_dtype] = [o["token_ids"] for o in llm.generate(inputs, greedy, use_tqdm=False)]
            results["dtype"], results["device"] = llm.config.dtype, llm.config.device
            if kv_cache_dtype == "auto":
                # en: Where a pair first differs, how sure was the unquantized model of its own token?
                # zh: 两者第一次出现分歧的地方，未量化的模型对自己选的 token 有多大把握？
                margins, second = [], 0
                for prompt, ours, theirs in zip(inputs, generations["auto"], generations["fp8"], strict=True):
                    at = common_prefix(ours, theirs)
                    if at < max_tokens:
                        top = next_token_probs(llm, prompt + ours[:at]).topk(2)
                        margins.append((top.values[0] - top.values[1]).item())
                        second += top.indices[1].item() == theirs[at]
    for lang in LANGUAGES:
        ppl = results["perplexity"][lang]
        ppl["ratio"] = ppl["fp8"] / ppl["auto"]
    shared = [common_prefix(a, b) for a, b in zip(generations["auto"], generations["fp8"], strict=True)]
    results["agreement"] = {
        "prompts": prompts, "max_tokens": max_tokens, "mean_common_prefix": sum(shared) / prompts,
        "identical": sum(s == max_tokens for s in shared), "common_prefixes": shared,
        # en: At each first difference: the auto model's top-1 minus top-2 probability, and whether fp8 took the
        # en: second-best token.
        # zh: 在每个第一次分歧处：auto 模型第一名与第二名的概率差，以及 fp8 是否选了第二名。
        "margins_at_divergence": margins, "took_second_best": second,
    }
    return results


def print_results(results: dict[str, Any]) -> None:
    """The figures of `measure` as a small table."""
    print(f"perplexity (model and 'auto' cache in {results['dtype']}):")
    for lang, ppl in results["perplexity"].items():
        print(f"  {lang}, {results['tokens'][lang]} tokens: auto {ppl['auto']:.3f}, fp8 {ppl['fp8']:.3f} "
              f"({ppl['ratio'] - 1:+.2%})")
    agreement = results["agreement"]
    print(f"greedy agreement over {agreement['prompts']} prompts x {agreement['max_tokens']} tokens: mean common "
          f"prefix {agreement['mean_common_prefix']:.1f} tokens, {agreement['identical']} identical")
    margins = sorted(agreement["margins_at_divergence"])
    if margins:
        print(f"  at the {len(margins)} first differences: the auto model's top-2 probability gap, median "
              f"{margins[len(margins) // 2]:.3f}; fp8 took the second-best token {agreement['took_second_best']} times")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.bench.kv_cache_accuracy",
                                     description="Perplexity and greedy agreement: fp8 KV cache vs the model's dtype.")
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens of each text (default: 3000, all of it)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk of the perplexity runs")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--texts", type=Path, default=TEXTS, help="the folder of kv_cache_en.txt and kv_cache_zh.txt")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError, smollm2_dir

    try:
        model = args.model or str(smollm2_dir())
        results = measure(model, tokens=args.tokens, prompts=args.prompts, max_tokens=args.max_tokens,
                          chunk=args.chunk, texts=args.texts, device=args.device, enforce_eager=True)
    except (TypeError, ValueError, FileNotFoundError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print_results(results)
    write_report(report_header("python -m nanovllm.bench.kv_cache_accuracy", argv, results["device"])
                 | {"model": model} | results, args.out)
    return 0


# en: A notebook also runs this code as __main__; only a real `python -m` should act.
# zh: notebook 也会把这段代码当作 __main__ 运行；只有真正的 `python -m` 才应执行。
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    raise SystemExit(main())
