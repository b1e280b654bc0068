"""Probe: can a Triton matmul for 1 to 16 rows stream Qwen3-0.6B's decode weights near the copy rate?

tile_gemv_probe.py (deleted) held a whole weight slice in registers and multiplied it once (no loop over the input):
three times cuBLAS. This one is the textbook shape for a skinny matmul instead: a loop over the input, BLOCK_K
elements a step, software-pipelined by Triton (num_stages loads in flight), tensor cores (tl.dot of a [16, BLOCK_K]
tile of rows by a [BLOCK_K, BLOCK_N] tile of the weight), and split-K for the narrow weights (o_proj and down_proj
have 1,024 output columns: 64 programs of 16 columns would leave half of the SMs idle). Each of the SPLIT programs of a
column block stores its float32 partial sum in its own slice of a [SPLIT, rows, N] buffer (no atomics: the result does
not depend on which program finishes first); the layer's next kernel would add the slices as it loads its input.

Each of the four weight shapes is timed alone, 28 different weights (one per layer, 881 MB in all, beyond the L2)
launched back to back in one CUDA graph, for every launch in a small sweep, against cuBLAS (F.linear) on the same
weights. Printed: per shape and row count, cuBLAS, the best launch and the share of the copy rate each reaches; then
the four shapes' best launches summed, the figure a decode step's matmuls would take.

    PYTHONPATH=$PWD python3 scripts/probes/splitk_sweep.py [--out FILE.json] [--chain-only]

Measured on one H100 (2026-12-05, copy 3.01 TB/s), µs per 28 matmuls at 4 rows, cuBLAS / best launch: q/k/v 163 / 179,
o_proj 167 / 148 (split 4), gate/up 203 / 218, down_proj 219 / 165 (split 4); 32-column tiles, 128 inputs a step and
five stages were best at every row count, which chapter 15's choose_launch now gives. Adding the splits in the kernel
(the last program of a column block) cost about 1 µs a launch against leaving them to the reader. The fused chain with
its norms: the launches shipped before (16-column tiles, no split) 1,272 µs, these 1,007 (with an early start, PDL,
1,083), cuBLAS's matmuls alone 737.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from nanovllm.layers.fused_decode import SmallMatmulLaunch
from scripts.probes.decode_matmul_chain import chain_bound_us, cublas_chain, fused_chain, make_layers

LAYERS = 28
# (output columns, input elements) of Qwen3-0.6B's four decode matmuls; gate_up is the merged gate and up weight.
SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down_proj": (1024, 3072)}
ROW_COUNTS = (1, 4, 8, 16)
BLOCK_M = 16  # tl.dot's smallest tile: 1 to 16 rows are padded (masked) to it


@triton.jit
def splitk_kernel(
    x_ptr, weight_ptr, partial_ptr, arrivals_ptr, out_ptr, M, N, K, K_CHUNK, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr, REDUCE: tl.constexpr,
):  # fmt: skip
    # Program (p, s) computes columns [p * BLOCK_N, (p + 1) * BLOCK_N) of the input slice [s * K_CHUNK, ...).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * K_CHUNK
    for k0 in tl.range(k_start, k_start + K_CHUNK, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(weight_ptr + cols[None, :] * stride_w + ks[:, None], mask=col_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc)
    # This split's partial sum, in float32, in its own slice of partial: [SPLIT, M, N].
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(partial_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)
    if REDUCE:
        # The last of the column block's SPLIT programs to arrive adds the slices, in split order (the same sum
        # whichever program is last), writes the result in the output's dtype, and resets the counter.
        if tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for part in tl.static_range(SPLIT):
                total += tl.load(partial_ptr + part * M * N + rows[:, None] * N + cols[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(arrivals_ptr + pid_n, 0)


class SplitK:
    """The buffers of one weight shape and row count: the float32 partial sums, the arrival counters, the result."""

    def __init__(self, m: int, n: int, split: int, block_n: int, device: str = "cuda") -> None:
        self.partial = torch.empty(split, m, n, device=device, dtype=torch.float32)
        self.arrivals = torch.zeros(triton.cdiv(n, block_n), device=device, dtype=torch.int32)
        self.out = torch.empty(m, n, device=device, dtype=torch.bfloat16)


def splitk_matmul(x: torch.Tensor, weight: torch.Tensor, buffers: SplitK, block_n: int, block_k: int, split: int,
                  warps: int, stages: int, reduce: bool = True) -> torch.Tensor:  # fmt: skip
    """x @ weight.T: buffers.out when ``reduce`` (the last program of each column block adds the splits' partial
    sums), else buffers.partial (the splits' partial sums, [split, rows, columns], to be added by the reader)."""
    m, k = x.shape
    n = weight.shape[0]
    k_chunk = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    splitk_kernel[(triton.cdiv(n, block_n), split)](
        x, weight, buffers.partial, buffers.arrivals, buffers.out, m, n, k, k_chunk, x.stride(0), weight.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, NUM_STAGES=stages,
        REDUCE=reduce, num_warps=warps,
    )  # fmt: skip
    return buffers.out if reduce else buffers.partial


def launches(k: int) -> list[dict]:
    sweep = itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), (4,), (3, 5))
    return [dict(block_n=n, block_k=bk, split=s, warps=w, stages=st) for n, bk, s, w, st in sweep
            if k // s >= bk]  # fmt: skip


def check() -> None:
    for (n, k), m, split in itertools.product(SHAPES.values(), (1, 5, 16), (1, 3)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        buffers = SplitK(m, n, split, 32)
        expected = x.float() @ weight.float().T
        got = splitk_matmul(x, weight, buffers, 32, 128, split, 4, 3, reduce=False).sum(0)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
        for _ in range(3):  # again and again: the counters must come back to zero
            got = splitk_matmul(x, weight, buffers, 32, 128, split, 4, 3)
            torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
    print("splitk_matmul matches float32 torch on every shape, 1/5/16 rows, splits 1 and 3, reduced or not")


def time_launch(x: torch.Tensor, weights: list[torch.Tensor], launch: dict) -> float:
    """Microseconds of one CUDA-graph replay of the launch over every weight, one after another."""
    buffers = SplitK(x.shape[0], weights[0].shape[0], launch["split"], launch["block_n"])
    return graph_time_ms(lambda: [splitk_matmul(x, w, buffers, **launch) for w in weights]) * 1e3


def chain_launches(best: dict[str, list[tuple[float, dict]]]) -> dict[str, SmallMatmulLaunch]:
    """chapter 15's launches from the sweep's best, shape by shape; gate/up keeps one split (SiLU needs the whole
    sum) and half the columns (each program reads a gate tile and an up tile)."""
    chosen = {}
    for name, results in best.items():
        glu = name == "gate_up"
        launch = next(launch for _, launch in results if not glu or launch["split"] == 1)
        chosen[name] = SmallMatmulLaunch(block_n=max(16, launch["block_n"] // 2) if glu else launch["block_n"],
                                         block_k=launch["block_k"], num_warps=launch["warps"],
                                         num_stages=launch["stages"], split=launch["split"])
    return chosen


# The sweep's best launches on one H100 (2026-12-05), the same at 4, 8 and 16 rows within 2 %: `--chain-only` times
# the chain at these without sweeping again.
H100_LAUNCHES = {
    "qkv": SmallMatmulLaunch(block_n=32, block_k=128, num_stages=5, split=2),
    "o_proj": SmallMatmulLaunch(block_n=32, block_k=128, num_stages=5, split=4),
    "gate_up": SmallMatmulLaunch(block_n=32, block_k=128, num_stages=5),
    "down_proj": SmallMatmulLaunch(block_n=32, block_k=128, num_stages=5, split=4),
}


def time_chains(launches_by_rows: dict[int, dict[str, SmallMatmulLaunch]], bandwidth: float) -> list[dict]:
    """The 28 layers' fused matmuls at each row count's launches, against cuBLAS and the shipped launches."""
    layers = make_layers()
    bound_us = chain_bound_us(layers, bandwidth)
    timed = []
    for m, launches in launches_by_rows.items():
        x = torch.randn(m, layers[0]["qkv"].shape[1], device="cuda", dtype=torch.bfloat16)
        figures = {
            "cuBLAS (matmuls only)": graph_time_ms(lambda x=x: cublas_chain(layers, x)) * 1e3,
            "small_matmul, shipped launches": graph_time_ms(lambda x=x: fused_chain(layers, x, {})) * 1e3,
            "small_matmul, these launches": graph_time_ms(
                lambda x=x, launches=launches: fused_chain(layers, x, launches)) * 1e3,
        }  # fmt: skip
        for kernel, us in figures.items():
            print(f"chain, {m:2d} rows: {kernel:38} {us:7.1f} us ({bound_us / us:4.0%} of {bound_us:.0f} us)")
        print(f"  launches: {launches}")
        chosen = {name: dataclasses.asdict(launch) for name, launch in launches.items()}
        timed.append({"rows": m, "bound_us": bound_us, **figures, "launches": chosen})
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--chain-only", action="store_true", help="time the chain at H100_LAUNCHES, no sweep")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    if args.chain_only:
        chains = time_chains({m: H100_LAUNCHES for m in ROW_COUNTS if m > 2}, bandwidth)
        if args.out:
            with open(args.out, "w") as file:
                json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "chains": chains}, file)
        return
    check()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s")
    rows, best_sum, cublas_sum = [], {m: 0.0 for m in ROW_COUNTS}, {m: 0.0 for m in ROW_COUNTS}
    best_by_rows: dict[int, dict[str, list]] = {m: {} for m in ROW_COUNTS if m > 2}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        bound_us = LAYERS * n * k * 2 / bandwidth * 1e6
        for m in ROW_COUNTS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = graph_time_ms(lambda x=x, weights=weights: [F.linear(x, w) for w in weights]) * 1e3
            results = []
            for launch in launches(k):
                try:
                    us = time_launch(x, weights, launch)
                except Exception as error:  # a launch that does not fit (shared memory): say so, go on
                    print(f"  {name} {launch}: {type(error).__name__}: {str(error)[:120]}")
                    continue
                results.append((us, launch))
            # The best launch again with the partial sums left to the reader (what the reduction costs).
            results.sort(key=lambda item: item[0])
            if results and results[0][1]["split"] > 1:
                unreduced = time_launch(x, weights, dict(results[0][1], reduce=False))
                print(f"  {name} {m} rows, best launch, partial sums left to the reader: {unreduced:.1f} us")
            best_us, best = results[0]
            if m in best_by_rows:
                best_by_rows[m][name] = results
            best_sum[m] += best_us
            cublas_sum[m] += cublas
            print(f"{name:9} {m:2d} rows: cuBLAS {cublas:6.1f} us ({bound_us / cublas:4.0%}), split-K best "
                  f"{best_us:6.1f} us ({bound_us / best_us:4.0%}) {best}; next: "
                  + "; ".join(f"{us:.1f} {launch}" for us, launch in results[1:3]), flush=True)
            rows.append({"shape": name, "rows": m, "bound_us": bound_us, "cublas_us": cublas,
                         "sweep": [{"us": us, **launch} for us, launch in results]})
    total_bytes = LAYERS * sum(n * k * 2 for n, k in SHAPES.values())
    bound_us = total_bytes / bandwidth * 1e6
    for m in ROW_COUNTS:
        print(f"{m:2d} rows, the 112 matmuls: cuBLAS {cublas_sum[m]:6.1f} us ({bound_us / cublas_sum[m]:4.0%}), "
              f"split-K at each shape's best {best_sum[m]:6.1f} us ({bound_us / best_sum[m]:4.0%}); bound "
              f"{bound_us:.0f} us")
    chains = time_chains({m: chain_launches(results) for m, results in best_by_rows.items()}, bandwidth)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows,
                       "chains": chains}, file, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
