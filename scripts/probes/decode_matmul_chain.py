"""The matmuls of a Qwen3-0.6B decode step (28 layers: norm + q/k/v, o_proj, norm + gate/up + SiLU x mul, down_proj),
chained as a step chains them and replayed in one CUDA graph: cuBLAS (F.linear alone, the norms and SiLU x mul not
counted) against chapter 15's `small_matmul` (the GEMV up to GEMV_ROWS tokens, and the tile kernel), the GEMV under
several widths and with programmatic dependent launch (PDL) on and off. Weights are 881 MB, far beyond the L2 cache.

    PYTHONPATH=$PWD python3 scripts/probes/decode_matmul_chain.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

import nanovllm.layers.fused_decode as fused_decode
from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from nanovllm.layers.fused_decode import SmallMatmulLaunch, small_matmul

HIDDEN, Q, KV, INTERMEDIATE, LAYERS = 1024, 2048, 1024, 3072, 28


def make_layers() -> list[dict[str, torch.Tensor]]:
    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) / cols**0.5

    ones = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    return [dict(qkv=weight(Q + 2 * KV, HIDDEN), o=weight(HIDDEN, Q), gate_up=weight(2 * INTERMEDIATE, HIDDEN),
                 down=weight(HIDDEN, INTERMEDIATE), norm=ones) for _ in range(LAYERS)]


def chain_weight_bytes(layers: list[dict[str, torch.Tensor]]) -> int:
    """The bytes of the chain's matmul weights (the norms aside): what one pass reads, the bound of every probe."""
    return sum(t.numel() * t.element_size() for layer in layers for key, t in layer.items() if key != "norm")


def chain_bound_us(layers: list[dict[str, torch.Tensor]], bandwidth: float) -> float:
    """Microseconds to read the chain's matmul weights once at ``bandwidth`` bytes/s: every probe's bound."""
    return chain_weight_bytes(layers) / bandwidth * 1e6


def fused_chain(
    layers: list[dict[str, torch.Tensor]], x: torch.Tensor, launches: dict[str, SmallMatmulLaunch] | None = None
) -> torch.Tensor:
    """A decode step's matmuls with their norms and SiLU x mul, as chapter 15's fused layer runs them; ``launches``
    by weight ("qkv", "o_proj", "gate_up", "down_proj"), small_matmul's choice for those not given."""
    launches = launches or {}
    residual = torch.zeros_like(x)
    for layer in layers:
        qkv, residual = small_matmul(x, layer["qkv"], residual=residual, norm_weight=layer["norm"], eps=1e-6,
                                     launch=launches.get("qkv"))
        hidden, _ = small_matmul(qkv[:, :Q], layer["o"], launch=launches.get("o_proj"))
        activated, residual = small_matmul(hidden, layer["gate_up"], residual=residual, norm_weight=layer["norm"],
                                           eps=1e-6, glu=True, launch=launches.get("gate_up"))
        x, _ = small_matmul(activated, layer["down"], launch=launches.get("down_proj"))
    return x


def cublas_chain(layers: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        hidden = F.linear(F.linear(x, layer["qkv"])[:, :Q], layer["o"])
        x = F.linear(F.linear(hidden, layer["gate_up"])[:, :INTERMEDIATE], layer["down"])
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    layers = make_layers()
    weight_bytes = chain_weight_bytes(layers)
    bound_us = weight_bytes / bandwidth * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; {LAYERS} layers of matmuls "
          f"{weight_bytes / 1e6:.0f} MB, bound {bound_us:.0f} us")
    rows = []

    def record(tokens: int, kernel: str, us: float, **launch) -> None:
        print(f"{tokens:2d} tokens: {kernel:34} {us:7.1f} us ({bound_us / us:4.0%} of the bound) {launch or ''}")
        rows.append({"tokens": tokens, "kernel": kernel, "us": us, **launch})

    choose_width, choose_pdl = fused_decode.gemv_block_n, fused_decode.programmatic_launch
    for tokens in (1, 2, 4, 8, 16):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        record(tokens, "cuBLAS (matmuls only)", graph_time_ms(lambda x=x: cublas_chain(layers, x)) * 1e3)
        record(tokens, "small_matmul (fused, as shipped)", graph_time_ms(lambda x=x: fused_chain(layers, x)) * 1e3)
        # The tile kernel (what steps of 2 to 16 tokens took before the GEMV took several rows).
        fused_decode.GEMV_ROWS, shipped_rows = 0, fused_decode.GEMV_ROWS
        try:
            record(tokens, "small_matmul (tile kernel)", graph_time_ms(lambda x=x: fused_chain(layers, x)) * 1e3)
        finally:
            fused_decode.GEMV_ROWS = shipped_rows
        if tokens > 1:
            continue
        # The GEMV's width (columns a program) for the wide weights (q/k/v, gate/up) and the narrow ones (o_proj,
        # down_proj), with and without PDL: the widths gemv_block_n picks are the first pair. The stand-in takes
        # gemv_block_n's arguments, min_programs included, and its own widths by keyword only (when they followed
        # glu, small_matmul's min_programs, 256, became the wide width: 36 ms a step on an H200, 2026-12-05).
        for (wide, narrow), pdl in itertools.product([(8, 4), (8, 2), (16, 4), (8, 8), (4, 4)], (True, False)):
            fused_decode.gemv_block_n = (lambda n, k, glu, min_programs=256, *, wide=wide, narrow=narrow:
                                         narrow if n <= HIDDEN else wide)
            fused_decode.programmatic_launch = lambda device, pdl=pdl: pdl and choose_pdl(device)
            try:
                us = graph_time_ms(lambda x=x: fused_chain(layers, x)) * 1e3
            finally:
                fused_decode.gemv_block_n, fused_decode.programmatic_launch = choose_width, choose_pdl
            record(tokens, "GEMV", us, wide=wide, narrow=narrow, pdl=pdl and choose_pdl(x.device))
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "weight_bytes": weight_bytes,
                       "bound_us": bound_us, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
