"""Probe (GPU): one sparse layer of Qwen3-30B-A3B's shapes: loop, every expert or fused_moe, against the bound.

128 experts of width 768, 8 per token, hidden 2048, bfloat16, random weights, at 1, 8, 64 and 256 tokens: chapter
26's chosen-experts loop (eager), its every-expert path and `fused_moe` under a few launches (CUDA graph replays),
each against the step's bound for the experts the router touched (their bytes at the copy rate measured in the same
run), and fused_moe checked against the loop. Recorded on one H100 (2026-12-05, copy rate 3.00 TB/s; chapter 26
keeps the figures): fused_moe 95 / 242 / 511 / 555 us at 1 / 8 / 64 / 256 tokens, 26 / 68 / 78 / 73 % of that
bound, against the loop's 2,376-23,214 us and every expert's 2,923-3,833; the engine runs the fused path since.

    PYTHONPATH=$PWD python3 scripts/probes/moe_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from nanovllm.layers.fused_moe import fused_moe
from nanovllm.models.qwen3_moe import FusedExperts, SparseMoeBlock

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 768, 128, 8
# One expert in bfloat16: gate, up and down.
EXPERT_BYTES = 3 * HIDDEN * WIDTH * 2
LAUNCHES = [dict(block_m=16, block_n=64, block_k=64), dict(block_m=16, block_n=128, block_k=64),
            dict(block_m=32, block_n=64, block_k=64), dict(block_m=64, block_n=64, block_k=64)]


def measure(block: SparseMoeBlock, fused: FusedExperts, tokens: int, bandwidth: float) -> list[dict]:
    """One token count: each path's time against the bound of the experts the router touched."""
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, chosen = block.route(x)
    touched = len(chosen.unique())
    bound_us = touched * EXPERT_BYTES / bandwidth * 1e6
    reference = block.chosen_experts(x, weights, chosen)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        block.chosen_experts(x, weights, chosen)
    torch.cuda.synchronize()
    timings = {"chosen loop (eager, wall)": (time.perf_counter() - began) / 10 * 1e6,
               "every expert (graph)": graph_time_ms(lambda: block.every_expert(x, weights, chosen)) * 1e3}
    for launch in LAUNCHES:
        error = (fused_moe(x, fused.w13, fused.w2, weights, chosen, **launch) - reference).abs().max().item()
        name = "fused_moe m{block_m} n{block_n} k{block_k}".format(**launch)
        timings[name] = graph_time_ms(lambda launch=launch: fused_moe(x, fused.w13, fused.w2, weights, chosen,
                                                                      **launch)) * 1e3
        print(f"{tokens:3d} tokens: {name} max |error| vs the loop {error:.3e}")
    rows = []
    for name, us in timings.items():
        print(f"{tokens:3d} tokens, {touched:3d} experts touched: {name:34} {us:9.1f} us "
              f"({bound_us / us:6.1%} of the bound {bound_us:.1f} us)")
        rows.append({"tokens": tokens, "touched": touched, "kernel": name, "us": us, "bound_us": bound_us})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    block = SparseMoeBlock(HIDDEN, WIDTH, EXPERTS, TOP_K, norm_topk_prob=True).to("cuda", torch.bfloat16)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=HIDDEN**-0.5)
    fused = FusedExperts(block)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; an expert {EXPERT_BYTES / 1e6:.1f} MB")
    rows = [row for tokens in (1, 8, 64, 256) for row in measure(block, fused, tokens, bandwidth)]
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
