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
    return (x.float().abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)


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
    """Quantize ``x`` [n, kv_heads, d] into rows ``slots`` [n] of one layer's float8 cache
    [blocks, block_size, kv_heads, d] and its scales [blocks, kv_heads, block_size]."""
    q, row_scale = quantize_kv(x)
    block_size = cache.shape[1]
    # en: Copied as bytes: indexing float8 tensors is missing on some devices and torch versions; bytes copy exactly.
    # zh: 按字节拷贝：某些设备和 torch 版本不支持对 float8 张量做索引；按字节拷贝是精确的。
    cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots] = q.view(torch.uint8)
    scales.transpose(1, 2)[slots // block_size, slots % block_size] = row_scale


def gather_quantized(cache: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a float8 cache, dequantized: float32 [length, kv_heads, d]."""
    blocks = block_table[: -(-length // cache.shape[1])].long()
    q = cache.view(torch.uint8)[blocks].view(FP8).flatten(0, 1)[:length]
    row_scale = scales[blocks].transpose(1, 2).flatten(0, 1)[:length]
    return dequantize_kv(q, row_scale)
