"""Decode attention launch configurations on the benchmark's own shapes (GPU): which (BLOCK_N, warps, stages) wins.

    python3 scripts/decode_sweep.py [--kv-cache-dtype fp8] [--out sweep.json]

Batches of 256, 64 and 16 sequences whose context lengths are drawn like the nano-vllm workload's during decode
(uniform in [100, 2048]), Qwen3-0.6B's heads, block size 256, bf16 queries over a bf16 cache (or, with
--kv-cache-dtype fp8, a float8 e4m3 cache and its float32 scales: chapter 24); each configuration timed as the
engine runs it, in a CUDA graph, against the copy rate measured in the same run. The bytes counted are the cache's
(and the scales'). The winner for fp8 belongs in DECODE_LAUNCH["fp8"] (chapter 11's decode wrapper).
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

from nanovllm.bench.attention import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, copy_bandwidth, graph_time_ms
from nanovllm.layers.context import Context
from nanovllm.layers.kv_quant import FP8, SCALE_BYTES, values_by_dim
from nanovllm.layers.triton_attention import decode_attention

LAUNCHES = [(64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 8, 3), (64, 4, 4), (64, 4, 2), (128, 8, 2), (32, 2, 3),
            (16, 4, 3)]
# A float8 tile is half the bytes of a bf16 one: longer tiles and deeper pipelines are worth a try.
FP8_LAUNCHES = [*LAUNCHES, (256, 4, 3), (256, 8, 3), (128, 4, 4), (128, 8, 3), (256, 8, 2), (128, 4, 5), (64, 4, 5),
                (128, 8, 5)]


def sweep(batch: int, seed: int = 0, fp8: bool = False) -> dict:
    rng = random.Random(seed)
    lens = [rng.randint(100, 2048) for _ in range(batch)]
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    copies = 8  # different blocks each time, so that reads come from HBM
    total_blocks = copies * sum(blocks)
    k_cache = torch.randn(total_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    scales = {}
    if fp8:
        # Values in [-448, 448]: any will do for timing; a float8 cache keeps its values by dimension.
        k_cache, v_cache = k_cache.to(FP8), values_by_dim(v_cache.to(FP8))
        scales = {name: torch.rand(total_blocks, KV_HEADS, BLOCK_SIZE, device="cuda") for name in ("k_scales",
                                                                                                  "v_scales")}
    perm = torch.randperm(total_blocks).tolist()
    ctxs = []
    for c in range(copies):
        table = torch.full((batch, max(blocks)), -1, dtype=torch.int32)
        at = c * sum(blocks)
        for i, b in enumerate(blocks):
            table[i, :b] = torch.tensor(perm[at:at + b])
            at += b
        ctxs.append(Context(is_prefill=False, context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                            block_tables=table.cuda()))
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    kv_bytes = 2 * sum(lens) * KV_HEADS * (HEAD_DIM + SCALE_BYTES if fp8 else HEAD_DIM * 2)
    row = {"batch": batch, "kv_bytes": kv_bytes, "ms": {}}
    for launch in FP8_LAUNCHES if fp8 else LAUNCHES:
        def fn(launch=launch) -> None:
            for ctx in ctxs:
                decode_attention(q, k_cache, v_cache, ctx, HEAD_DIM**-0.5, launch=launch, **scales)

        try:
            row["ms"][str(launch)] = graph_time_ms(fn) / copies
        except Exception as error:  # a configuration that does not compile (shared memory) is reported, not fatal
            row["ms"][str(launch)] = None
            print(f"batch {batch} launch {launch}: {type(error).__name__}: {str(error)[:200]}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--out")
    args = parser.parse_args()
    copy = copy_bandwidth()
    print(f"copy {copy / 1e12:.2f} TB/s, KV cache {args.kv_cache_dtype}")
    rows = [sweep(b, fp8=args.kv_cache_dtype == "fp8") for b in (256, 64, 16)]
    for row in rows:
        line = " ".join(f"{k}={row['kv_bytes'] / (v * 1e-3) / copy:.0%}" for k, v in row["ms"].items() if v)
        print(f"batch {row['batch']}: {line}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
