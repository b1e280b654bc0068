"""Probe: chapter 15's GEMV at 1 to 8 rows: what makes each row cost more?

The GEMV holds its weight slice (up to GEMV_SLICE = 16K elements, 128 bfloat16 a thread) in registers and ran the rows
past it one by one. At 4 rows it measured as slow as cuBLAS, and GEMV_ROWS stopped it at 2. A first run of this probe
(H200, 2026-12-05, copy rate 4.25 TB/s, bound 207 us) timed narrower slices too: each row more cost 110-200 us over
the 28 layers at every width (16K elements a program: 333 / 451 / 655 / 809 / 963 / 1,579 us at 1 / 2 / 3 / 4 / 5 / 8
rows; cuBLAS 870 / 852 / 763 / 767 / 808 / 683), 8K or 4K took at most a fifth off from 3 rows on (4 rows: 728 us,
1.05x cuBLAS; 8 rows: 1,262), 2K was slower everywhere, and the compiled kernels barely spill (3 of 91 compiled
kernels spill 2 or 4 registers): not registers. The next guess: row by row, each row waits for its own input load from
L2 and its own norm before its multiply-adds, and for the row before it to store its result. The second run's variants
loaded every row's input at once as one tile after the wait and normalized the rows together; one stored each row's
result as it was done, one kept them to store together at the end; with 4 warps or 8. Each variant is checked against
the shipped kernel's results, then timed on the 28-layer chain (Qwen3-0.6B's decode matmuls with their norms and SiLU
x mul, one CUDA graph) against cuBLAS. Second run (H100, 2026-12-05, copy rate 3.02 TB/s, bound 291 us; checks passed
in bfloat16): loading the rows as one tile takes 14-26 % off from 3 rows on. Against cuBLAS (about 730 us at every row
count), shipped / tile-loaded stored last / the same with 8K slices: 1 row 376 / 376 / 400 us, 2 rows 492 / 484 / 463,
3 rows 683 / 589 / 567, 4 rows 832 / 654 / 612, 5 rows 977 / 758 / 712, 8 rows 1,579 / 1,165 / 965; storing each row
as it is done is the same as storing last, and 8 warps are slower everywhere (up to 2.4x). So the tile-loaded GEMV
beats cuBLAS up to 4 rows (1.12-1.20x there), ties at 5 and loses at 8. The branch gemv-tile-loaded-rows ships it
(with GEMV_ROWS 8, to be set to 4): on the same H100 its batch-4 step took 1.172 ms fused against 1.334 unfused
(1.14x, python -m nanovllm.bench --latency --batches 1 4 --fused-decode both), batch 1 0.786 against 1.158, and the
GPU tests of chapters 14 and 15 passed. Chapter 15 now ships that kernel with GEMV_ROWS = 4: since then "shipped"
times the tile-loaded kernel too (it was labelled "shipped (row by row)" in the runs above), and the row-by-row
kernel and the probe's own variants (the tile-loaded kernel storing each row or all at the end) live in the runs'
figures only. What it times now: the shipped kernel at slices of 16K, 8K and 4K elements, and with 8 warps.

    PYTHONPATH=$PWD python3 scripts/probes/gemv_rows_probe.py [--out FILE.json]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/probes/gemv_rows_probe.py --check-only   # on a CPU
"""

from __future__ import annotations

import argparse
import json

import torch

import nanovllm.layers.fused_decode as fused_decode
from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from scripts.probes.decode_matmul_chain import HIDDEN, chain_bound_us, cublas_chain, fused_chain, make_layers

ROW_COUNTS = (1, 2, 3, 4, 5, 8)
# Largest weight elements a program holds: the shipped 16K, then a half and a quarter (the first run's eighth was
# slower everywhere).
SLICES = (1 << 14, 1 << 13, 1 << 12)


def compiled_gemvs() -> list[dict]:
    """Registers and spills of every gemv_kernel compiled so far (Triton 3.x's per-device cache)."""
    found = []
    for caches in fused_decode.gemv_kernel.device_caches.values():
        for key, kernel in caches[0].items():
            found.append(
                {
                    "key": str(key)[-160:],
                    "regs": getattr(kernel, "n_regs", None),
                    "spills": getattr(kernel, "n_spills", None),
                }
            )
    return found


class Launch:
    """A kernel that small_matmul launches as its GEMV, with ``extra`` launch arguments in place of its own."""

    def __init__(self, kernel, **extra) -> None:
        self.kernel, self.extra = kernel, extra

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, **self.extra})


KERNELS = {
    "shipped": None,
    "shipped, 8 warps": Launch(fused_decode.gemv_kernel, num_warps=8),
}


def with_kernel(name: str, fn, slice_elements: int = 1 << 14):
    """fn() with small_matmul's GEMV replaced by KERNELS[name], taking up to 8 rows, with slices of slice_elements."""
    shipped = (fused_decode.gemv_kernel, fused_decode.GEMV_ROWS, fused_decode.GEMV_SLICE)
    fused_decode.GEMV_ROWS, fused_decode.GEMV_SLICE = 8, slice_elements
    fused_decode.gemv_kernel = KERNELS[name] or shipped[0]
    try:
        return fn()
    finally:
        fused_decode.gemv_kernel, fused_decode.GEMV_ROWS, fused_decode.GEMV_SLICE = shipped


def check(device: str, dtype: torch.dtype) -> None:
    """The variants give the shipped GEMV's results (norm, residual, SiLU x mul), 1 to 8 rows."""
    torch.manual_seed(0)
    k, n = 96, 40
    weight = torch.randn(2 * n, k, device=device, dtype=dtype) / k**0.5
    norm_weight = torch.rand(k, device=device, dtype=dtype) + 0.5
    for rows in range(1, 9):
        x, residual = (torch.randn(rows, k, device=device, dtype=dtype) for _ in range(2))
        for glu in (False, True):

            def run(x=x, residual=residual, glu=glu):
                return fused_decode.small_matmul(
                    x, weight, residual=residual, norm_weight=norm_weight, eps=1e-6, glu=glu
                )

            expected = with_kernel("shipped", run)
            for name in KERNELS:
                got = with_kernel(name, run)
                for a, b in zip(got, expected, strict=True):
                    assert torch.equal(a, b), (name, rows, glu, (a.float() - b.float()).abs().max())
    print(f"check: the variants give the shipped kernel's results on {device} ({dtype})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--check-only", action="store_true", help="only compare the kernels (the CPU: interpreter)")
    args = parser.parse_args()
    if args.check_only:
        check("cuda" if torch.cuda.is_available() else "cpu", torch.float32)
        return
    try:
        check("cuda", torch.bfloat16)
    except AssertionError as mismatch:  # timed all the same: a different rounding is a finding to weigh
        print(f"check: a variant differs from the shipped kernel: {mismatch}")
    bandwidth = copy_bandwidth()
    layers = make_layers()
    bound_us = chain_bound_us(layers, bandwidth)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; bound {bound_us:.0f} us")
    rows = []
    for tokens in ROW_COUNTS:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        cublas = graph_time_ms(lambda x=x: cublas_chain(layers, x)) * 1e3
        print(f"{tokens} rows: cuBLAS {cublas:6.1f} us")
        rows.append({"tokens": tokens, "kernel": "cublas", "us": cublas})
        for name in KERNELS:
            # The open question: narrower slices from 3 rows on (the second run's 8K slices took 6 % more off).
            for slice_elements in SLICES if name == "shipped" else SLICES[:1]:
                try:
                    us = with_kernel(
                        name, lambda x=x: graph_time_ms(lambda: fused_chain(layers, x)) * 1e3, slice_elements
                    )
                except Exception as error:  # a launch that does not compile is a finding, not a crash
                    print(f"{tokens} rows, {name}, slice {slice_elements}: failed: {str(error)[:200]}")
                    continue
                print(
                    f"{tokens} rows, {name:25} slice {slice_elements:5d}: {us:6.1f} us ({bound_us / us:4.0%} of "
                    f"the bound, {cublas / us:4.2f}x cuBLAS)"
                )
                rows.append({"tokens": tokens, "kernel": name, "slice": slice_elements, "us": us})
    if args.out:
        with open(args.out, "w") as file:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "bandwidth": bandwidth,
                    "bound_us": bound_us,
                    "rows": rows,
                    "kernels": compiled_gemvs(),
                },
                file,
                indent=1,
            )


if __name__ == "__main__":
    main()
