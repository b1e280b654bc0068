"""Probe (GPU; written 2026-12-05, not yet run on a GPU): chapter 18's `align_by_expert` in one Triton kernel.

At one token a Qwen3-30B-A3B decode step launched 2,263 kernels on the H100 (about 47 a layer) and spent most of its
7.4 ms outside the expert matmuls; `align_by_expert` is some 15 of each layer's kernels (a histogram, cumulative sums,
a radix sort, gathers, a scatter, a search). Here the same rows and tile experts come from one program after a fill:
a one-hot [pairs, experts] tile gives each expert's count and each pair's rank among the pairs of its expert (a
cumulative sum down the tile, so the order is the stable sort's), the padded runs' starts place every pair, and a
[tiles, experts] comparison answers the search. Registers bound it to a few hundred pairs (32 tokens of top-8):
decode steps, where the launches dominate. Checked against `align_by_expert`, then timed against it in CUDA graphs.

    PYTHONPATH=$PWD python3 scripts/moe_align_probe.py [--out FILE.json]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/moe_align_probe.py --check      # on a CPU: the check alone
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from nanovllm.layers.fused_moe import align_by_expert

EXPERTS, TOP_K, BLOCK_M = 128, 8, 16
MAX_PAIRS = 256


@triton.jit
def align_kernel(chosen_ptr, rows_ptr, tile_expert_ptr, count, num_tiles,
                 NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
                 TILES: tl.constexpr):  # fmt: skip
    pair = tl.arange(0, PAIRS)
    valid = pair < count
    # Padding pairs go to bin NUM_EXPERTS, which no run includes.
    expert = tl.load(chosen_ptr + pair, mask=valid, other=NUM_EXPERTS).to(tl.int32)
    bins = tl.arange(0, EXPERTS)
    hit = (expert[:, None] == bins[None, :]).to(tl.int32)
    per_expert = tl.where(bins < NUM_EXPERTS, tl.sum(hit, axis=0), 0)
    padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # A pair's rank among its expert's pairs: how many of them come before it (the stable sort's order).
    rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1
    start = tl.sum(hit * starts[None, :], axis=1)
    tl.store(rows_ptr + start + rank, pair.to(tl.int64), mask=valid)
    # searchsorted(ends, tile * BLOCK_M, right=True): the experts whose run ends at or before the tile.
    tile = tl.arange(0, TILES)
    ended = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & (bins[None, :] < NUM_EXPERTS)
    tl.store(tile_expert_ptr + tile, tl.sum(ended.to(tl.int64), axis=1), mask=tile < num_tiles)


def align_in_one_kernel(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s (rows, tile experts) from a fill and one Triton program; at most MAX_PAIRS pairs."""
    pairs = chosen.numel()
    if pairs > MAX_PAIRS:
        raise ValueError(f"one program holds at most {MAX_PAIRS} pairs, not {pairs}")
    max_rows = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((max_rows,), pairs, dtype=torch.long, device=chosen.device)
    tiles = max_rows // block_m
    tile_expert = torch.empty(tiles, dtype=torch.long, device=chosen.device)
    align_kernel[(1,)](chosen.reshape(-1), rows, tile_expert, pairs, tiles, NUM_EXPERTS=num_experts, BLOCK_M=block_m,
                       PAIRS=triton.next_power_of_2(pairs), EXPERTS=triton.next_power_of_2(num_experts + 1),
                       TILES=triton.next_power_of_2(tiles), num_warps=8)
    return rows, tile_expert


def random_choices(tokens: int, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)]).to(device)


def check(device: str) -> None:
    """The kernel's rows and tile experts equal align_by_expert's, routing and token counts varied, and every token
    on one expert (one long run)."""
    cases = [random_choices(tokens, device, seed) for seed, tokens in enumerate((1, 2, 5, 16, 32))]
    for chosen in [*cases, torch.full((20, 1), 7, device=device)]:
        expected, got = align_by_expert(chosen, EXPERTS, BLOCK_M), align_in_one_kernel(chosen, EXPERTS, BLOCK_M)
        assert all(map(torch.equal, expected, got)), (chosen.shape, expected, got)
    print("align_in_one_kernel equals align_by_expert")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check against align_by_expert")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if args.check or device == "cpu":
        return
    from nanovllm.bench.attention import graph_time_ms

    rows = []
    for tokens in (1, 4, 16, 32):
        chosen = random_choices(tokens, device, tokens)
        torch_us = graph_time_ms(lambda chosen=chosen: align_by_expert(chosen, EXPERTS, BLOCK_M)) * 1e3
        triton_us = graph_time_ms(lambda chosen=chosen: align_in_one_kernel(chosen, EXPERTS, BLOCK_M)) * 1e3
        print(f"{tokens:3d} tokens: align_by_expert {torch_us:7.1f} us, one kernel {triton_us:7.1f} us "
              f"({torch_us / triton_us:.1f}x); per step of 48 layers {48 * (torch_us - triton_us) / 1e3:.2f} ms saved")
        rows.append({"tokens": tokens, "torch_us": torch_us, "triton_us": triton_us})
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
