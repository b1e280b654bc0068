"""Probe: a tensor-core matmul for 1 to 16 rows that loads its weight tile before it waits for its input (PDL).

splitk_sweep.py found that a decode step's matmul kernels, cuBLAS's and chapter 15's tile kernel alike, read
their 2-8 MB at 40-55 % of the copy rate: the boundary between kernels costs about as much as the reading. The GEMV
escapes it because it loads its whole weight slice, then waits (gdc_wait) for the kernel before; the tile kernel
cannot, as it walks the input in a loop. This kernel does what the GEMV does with a tile: the input is split so finely
(split-K, CHUNK inputs a program) that a program's whole weight slice, [BLOCK_N, CHUNK], is one tile it loads before
it waits; after the wait it loads the rows' slice, normalizes it (the norm's sum of squares over the whole row, from
L2), multiplies once on the tensor cores, and leaves its partial sum to the last program of its column block, which
adds them in split order (gate and up alike: SiLU x mul comes after the sum).

Timed on Qwen3-0.6B's 28 layers of decode matmuls (with their norms and SiLU x mul) in one CUDA graph, at 1, 4, 8 and
16 rows, against cuBLAS's matmuls alone and chapter 15's small_matmul (the GEMV at 1-2 rows, the split-K tile kernel
above).

    PYTHONPATH=$PWD python3 scripts/probes/prefetch_tile_probe.py [--out FILE.json]

Checked against small_matmul in the Triton interpreter. First GPU run (H200, 2026-12-05, copy rate 4.25 TB/s, bound
207 us): best launch n32 chunk256 w4 at every row count, 564/815/840/782 us at 1/4/8/16 rows, against cuBLAS's
873/766/686/701 and small_matmul's 334 (the GEMV)/987/986/990. Loading the tile before the wait beats the tile kernel by
a fifth but not cuBLAS from 4 rows on; as written, not worth shipping (chapter 15 records it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from nanovllm.layers.fused_decode import MAX_TOKENS, load_rows, small_matmul, store_result
from nanovllm.layers.triton_attention import programmatic_launch
from scripts.probes.decode_matmul_chain import Q, chain_bound_us, cublas_chain, make_layers
from scripts.probes.decode_matmul_chain import fused_chain as small_matmul_chain

ROW_COUNTS = (1, 4, 8, 16)
LAUNCHES = [dict(block_n=n, chunk=c, warps=w) for n, c, w in itertools.product((16, 32), (128, 256), (4, 8))]


@triton.jit
def prefetch_tile_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, out_ptr, residual_out_ptr, partial_ptr, arrivals_ptr,
    M, N, K, eps, stride_x, stride_r, stride_w, stride_out, stride_ro,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
    ADD: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = split * CHUNK + tl.arange(0, CHUNK)
    k_mask = ks < K
    w_mask = col_mask[:, None] & k_mask[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The whole weight slice of this program, before the wait: it does not depend on the kernel before.
    w = tl.load(weight_ptr + cols[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    w_up = w
    if GLU:
        w_up = tl.load(weight_ptr + (N + cols)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x = load_rows(x_ptr, residual_ptr, rows, ks, row_mask[:, None] & k_mask[None, :], stride_x, stride_r, ADD)
    if NORM:
        # The norm's sum of squares over the whole row (the rows are small and in L2); split 0 of column block 0
        # writes x + residual, the new residual.
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, CHUNK):
            kk = k0 + tl.arange(0, CHUNK)
            mask = row_mask[:, None] & (kk < K)[None, :]
            xx = load_rows(x_ptr, residual_ptr, rows, kk, mask, stride_x, stride_r, ADD)
            if ADD and pid == 0 and split == 0:
                tl.store(residual_out_ptr + rows[:, None] * stride_ro + kk[None, :], xx, mask=mask)
            squares += tl.sum(xx.to(tl.float32) * xx.to(tl.float32), axis=1)
        inv_rms = tl.rsqrt(squares / K + eps)
        norm_weight = tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype)
        x = (norm_weight[None, :] * normed.to(tl.float32)).to(x.dtype)
    if UPCAST:  # the interpreter's tl.dot of 16-bit floats is wrong: multiply exact float32 copies there
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        up = tl.dot(x.to(tl.float32), tl.trans(w_up.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w))
        up = tl.dot(x, tl.trans(w_up))
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT == 1:
        store_result(acc, up, x_ptr, out_ptr, rows, cols, col_mask, out_mask, N, stride_out, GLU, False)
    else:
        # Partial sums [SPLIT, BLOCK_M, N] for gate (and [SPLIT, BLOCK_M, N] more for up): the last program of the
        # column block adds them in split order and finishes (SiLU x mul after the sums).
        partial = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(partial + split * BLOCK_M * N, acc, mask=out_mask)
        if GLU:
            tl.store(partial + (SPLIT + split) * BLOCK_M * N, up, mask=out_mask)
        if tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for part in tl.static_range(SPLIT):
                acc += tl.load(partial + part * BLOCK_M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if GLU:
                    up += tl.load(partial + (SPLIT + part) * BLOCK_M * N, mask=out_mask, other=0.0,
                                  cache_modifier=".cg")
            tl.store(arrivals_ptr + pid, 0)
            store_result(acc, up, x_ptr, out_ptr, rows, cols, col_mask, out_mask, N, stride_out, GLU, False)


_workspaces: dict = {}


def prefetch_matmul(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False, block_n: int = 32,
                    chunk: int = 256, warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """small_matmul's contract (no bias) through prefetch_tile_kernel."""
    tokens, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    split = triton.cdiv(k, chunk)
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    key = (x.device, n, block_n, split, glu)
    if key not in _workspaces:
        _workspaces[key] = (torch.empty((2 if glu else 1) * split, MAX_TOKENS, n, dtype=torch.float32, device=x.device),
                            torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=x.device))  # fmt: skip
    partial, arrivals = _workspaces[key]
    pdl = programmatic_launch(x.device)
    prefetch_tile_kernel[(triton.cdiv(n, block_n), split)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight, out,
        residual_out, partial, arrivals, tokens, n, k, eps, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0), residual_out.stride(0),
        BLOCK_M=MAX_TOKENS, BLOCK_N=block_n, CHUNK=chunk, SPLIT=split, NORM=norm_weight is not None,
        ADD=residual is not None, GLU=glu, PDL=pdl, UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return out, residual_out


def prefetch_chain(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, launch: dict) -> torch.Tensor:
    residual = torch.zeros_like(x)
    for layer in layers:
        qkv, residual = prefetch_matmul(x, layer["qkv"], residual=residual, norm_weight=layer["norm"], eps=1e-6,
                                        **launch)
        hidden, _ = prefetch_matmul(qkv[:, :Q], layer["o"], **launch)
        activated, residual = prefetch_matmul(hidden, layer["gate_up"], residual=residual, norm_weight=layer["norm"],
                                              eps=1e-6, glu=True, **launch)
        x, _ = prefetch_matmul(activated, layer["down"], **launch)
    return x


def check(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """prefetch_matmul against small_matmul (itself tested against chapter 06's layers), every form, 3 calls each."""
    torch.manual_seed(0)
    for tokens, (n, k), launch in itertools.product((1, 5, 16), ((48, 300), (64, 512)), LAUNCHES[:2]):
        x, residual = torch.randn(tokens, k, device=device, dtype=dtype), torch.randn(tokens, k, device=device,
                                                                                       dtype=dtype)  # fmt: skip
        norm_weight = torch.rand(k, device=device, dtype=dtype) + 0.5
        for glu in (False, True):
            weight = torch.randn((2 if glu else 1) * n, k, device=device, dtype=dtype) / 16
            kwargs = dict(residual=residual, norm_weight=norm_weight, eps=1e-6, glu=glu)
            expected, expected_residual = small_matmul(x, weight, **kwargs)
            for _ in range(3):
                got, got_residual = prefetch_matmul(x, weight, **kwargs, **launch)
                torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(got_residual, expected_residual)
            got, _ = prefetch_matmul(x, weight[:n] if not glu else weight, glu=glu, **launch)
            torch.testing.assert_close(got, small_matmul(x, weight[:n] if not glu else weight, glu=glu)[0],
                                       atol=2e-2, rtol=2e-2)  # fmt: skip
    print("prefetch_matmul matches small_matmul: 1/5/16 rows, plain, norm + residual, glu, 3 calls in a row")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    check()
    layers = make_layers()
    bound_us = chain_bound_us(layers, bandwidth)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; bound {bound_us:.0f} us")
    rows = []
    for tokens in ROW_COUNTS:
        x = torch.randn(tokens, layers[0]["qkv"].shape[1], device="cuda", dtype=torch.bfloat16)
        figures = {"cuBLAS (matmuls only)": graph_time_ms(lambda x=x: cublas_chain(layers, x)) * 1e3,
                   "small_matmul (chapter 15)": graph_time_ms(lambda x=x: small_matmul_chain(layers, x)) * 1e3}
        for launch in LAUNCHES:
            name = f"prefetch tile n{launch['block_n']} chunk{launch['chunk']} w{launch['warps']}"
            try:
                figures[name] = graph_time_ms(lambda x=x, launch=launch: prefetch_chain(layers, x, launch)) * 1e3
            except Exception as error:  # a launch that does not fit (registers, shared memory): say so, go on
                print(f"{tokens:2d} rows: {name}: {type(error).__name__}: {str(error)[:160]}")
        for name, us in figures.items():
            print(f"{tokens:2d} rows: {name:36} {us:7.1f} us ({bound_us / us:4.0%} of the bound)", flush=True)
        rows.append({"tokens": tokens, **figures})
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "bound_us": bound_us,
                       "rows": rows}, file, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
