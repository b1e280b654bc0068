"""The four matmuls of a Qwen3-0.6B decode layer at 1 and 16 tokens: `small_matmul` (chapter 09) under several
launches against cuBLAS (F.linear alone, the norm and SiLU x mul not counted), each timed as a CUDA graph replays
it, one weight after another out of enough copies that none is still in the L2 cache.

    PYTHONPATH=$PWD python3 scripts/small_matmul_sweep.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from nanovllm.layers.fused_decode import SmallMatmulLaunch, choose_launch, small_matmul

# (name, output rows of the weight, input elements, the fused work around it)
SHAPES = [
    ("qkv_proj + norm", 4096, 1024, "norm"),
    ("o_proj", 1024, 2048, ""),
    ("gate_up_proj + norm + SiLU x mul", 6144, 1024, "norm+glu"),
    ("down_proj", 1024, 3072, ""),
]


def time_per_call_us(fn, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn(weight), replayed in one CUDA graph over every copy of the weight."""
    return graph_time_ms(lambda: [fn(w) for w in weights]) * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer launches")
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s")
    launches = [SmallMatmulLaunch(*c) for c in itertools.product(
        (16, 32), (128, 256, 512) if not args.quick else (256, 512), (4, 8), (3, 4) if not args.quick else (4,))]
    results = []
    for name, rows, inputs, work in SHAPES:
        weight_bytes = rows * inputs * 2
        copies = max(2, math.ceil((256 << 20) / weight_bytes))
        weights = [torch.randn(rows, inputs, device="cuda", dtype=torch.bfloat16) / inputs**0.5
                   for _ in range(copies)]
        norm_weight = torch.ones(inputs, device="cuda", dtype=torch.bfloat16)
        for tokens in (1, 16):
            x = torch.randn(tokens, inputs, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x)
            fused = dict(residual=residual, norm_weight=norm_weight, eps=1e-6) if "norm" in work else {}
            fused["glu"] = "glu" in work
            cublas = time_per_call_us(lambda w, x=x: F.linear(x, w), weights)
            ideal = weight_bytes / bandwidth * 1e6
            timed = []
            for launch in [choose_launch(rows // 2 if fused["glu"] else rows, inputs), *launches]:
                try:
                    def run(w, x=x, launch=launch, fused=fused):
                        return small_matmul(x, w, launch=launch, **fused)

                    us = time_per_call_us(run, weights)
                except Exception as error:  # a launch that needs more shared memory than the GPU has
                    print(f"  {launch}: {type(error).__name__}")
                    continue
                timed.append((us, launch))
            best_us, best = min(timed, key=lambda pair: pair[0])
            default_us = timed[0][0]
            print(f"{name:34} {tokens:2d} tokens: cuBLAS {cublas:6.2f} us ({weight_bytes / cublas / 1e6:4.2f} TB/s), "
                  f"small_matmul default {default_us:6.2f} us, best {best_us:6.2f} us "
                  f"({weight_bytes / best_us / 1e6:4.2f} TB/s) {best}; ideal {ideal:5.2f} us")
            results.append({"shape": name, "tokens": tokens, "cublas_us": cublas, "default_us": default_us,
                            "best_us": best_us, "best": vars(best), "ideal_us": ideal,
                            "all": [(us, vars(launch)) for us, launch in timed]})
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"bandwidth": bandwidth, "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
