"""Probe (GPU): chapter 26's sort of a decode step's (token, expert) pairs, `align_by_expert` (a dozen torch
operations, some fifteen kernels) against `align_in_one_program` (a fill and one Triton program), each replayed from
a CUDA graph, on Qwen3-30B-A3B's 128 experts and top-8.

Recorded on one H100 (2026-12-05), when the one-program kernel still took up to 256 pairs: 47.4 against 15.7 us at
one token (3.0x, about 1.5 ms of a 48-layer step), 47.2 / 19.3 at 4 tokens, 51.6 / 26.1 at 16, and 70.6 / 75.9 at
32 tokens (256 pairs: its one-hot tile no longer fits the registers). Hence `ONE_PROGRAM_PAIRS = 128`, the most that
`sort_by_expert` hands the one program.

    PYTHONPATH=$PWD python3 scripts/probes/moe_align_probe.py [--out FILE.json]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/probes/moe_align_probe.py --check   # on a CPU: the check alone
"""

from __future__ import annotations

import argparse
import json

import torch

from nanovllm.layers.fused_moe import ONE_PROGRAM_PAIRS, align_by_expert, align_in_one_program

EXPERTS, TOP_K, BLOCK_M = 128, 8, 16


def random_choices(tokens: int, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)]).to(device)


def check(device: str) -> None:
    """The one program's rows and tile experts equal align_by_expert's, routing and token counts varied, and every
    token on one expert (one long run)."""
    cases = [random_choices(tokens, device, seed) for seed, tokens in enumerate((1, 2, 5, ONE_PROGRAM_PAIRS // TOP_K))]
    for chosen in [*cases, torch.full((20, 1), 7, device=device)]:
        expected, got = align_by_expert(chosen, EXPERTS, BLOCK_M), align_in_one_program(chosen, EXPERTS, BLOCK_M)
        assert all(map(torch.equal, expected, got)), (chosen.shape, expected, got)
    print("align_in_one_program equals align_by_expert")


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
    for tokens in (1, 4, 8, ONE_PROGRAM_PAIRS // TOP_K):
        chosen = random_choices(tokens, device, tokens)
        torch_us = graph_time_ms(lambda chosen=chosen: align_by_expert(chosen, EXPERTS, BLOCK_M)) * 1e3
        triton_us = graph_time_ms(lambda chosen=chosen: align_in_one_program(chosen, EXPERTS, BLOCK_M)) * 1e3
        print(f"{tokens:3d} tokens: align_by_expert {torch_us:7.1f} us, one program {triton_us:7.1f} us "
              f"({torch_us / triton_us:.1f}x); per step of 48 layers {48 * (torch_us - triton_us) / 1e3:.2f} ms saved")
        rows.append({"tokens": tokens, "torch_us": torch_us, "triton_us": triton_us})
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
