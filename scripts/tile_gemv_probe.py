"""Probe: a GEMV-shaped matmul for 3 to 16 rows that multiplies on the tensor cores (tl.dot) instead of one row at a
time, with its weight slice loaded before it waits for its input (PDL) and the narrow weights split along the input
(split-K, partial sums added with atomics, the last program of a column block finishing the sum). Timed on Qwen3-0.6B's
28 layers of decode matmuls in one CUDA graph against cuBLAS and the shipped small_matmul.

    PYTHONPATH=$PWD python3 scripts/tile_gemv_probe.py [--out FILE.json]

Measured on one H100 (2026-12-05), microseconds per 28-layer chain: cuBLAS 731-746 at 1 to 16 tokens (40 % of the
bound), the shipped GEMV 378 at 1 token (78 %) and 498 at 2, but 1,276-1,298 at 4 to 16; this tile kernel 2,092-2,668
at its best launch (n16 w4, split o2/down3), without PDL 2,336-2,972. A dead end as written: three times cuBLAS.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.bench.attention import copy_bandwidth, graph_time_ms
from nanovllm.layers.triton_attention import programmatic_launch
from scripts.decode_matmul_chain import HIDDEN, INTERMEDIATE, Q, chain_bound_us, cublas_chain, make_layers
from scripts.decode_matmul_chain import fused_chain as shipped_chain


@triton.jit
def tile_gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, out_ptr, residual_out_ptr, partial_ptr, arrivals_ptr,
    M, N, eps, stride_w, stride_x, stride_r, stride_out, stride_ro,
    K: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
    ADD: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    part = tl.program_id(1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = part * CHUNK + tl.arange(0, CHUNK)
    k_mask = ks < K
    w_mask = col_mask[:, None] & k_mask[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(weight_ptr + cols[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    if GLU:
        w_up = tl.load(weight_ptr + (N + cols)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    if NORM:
        norm_weight = tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, 16)
    row_mask = rows < M
    x_mask = row_mask[:, None] & k_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=x_mask, other=0.0)
    if ADD:
        residual = tl.load(residual_ptr + rows[:, None] * stride_r + ks[None, :], mask=x_mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(residual_out_ptr + rows[:, None] * stride_ro + ks[None, :], x, mask=x_mask)
    if NORM:
        x32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, 1) / K + eps)
        x = (norm_weight[None, :] * (x32 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype)
    acc = tl.dot(x, tl.trans(w))
    out_mask = row_mask[:, None] & col_mask[None, :]
    if GLU:
        up = tl.dot(x, tl.trans(w_up))
        gate = acc.to(dtype).to(tl.float32)
        activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        result = (activated * up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], result, mask=out_mask)
    elif SPLIT == 1:
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(dtype), mask=out_mask)
    else:
        partial = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.atomic_add(partial, acc, mask=out_mask, sem="relaxed")
        if tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel") == SPLIT - 1:
            # The last of the column block's SPLIT programs: take the sum, leave zeros for the next use.
            zeros = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            total = tl.atomic_add(partial, zeros, mask=out_mask, sem="relaxed")
            tl.store(partial, zeros, mask=out_mask)
            tl.store(arrivals_ptr + pid, 0)
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], total.to(dtype), mask=out_mask)


_workspaces: dict = {}


def tile_gemv(x, weight, *, residual=None, norm_weight=None, eps=0.0, glu=False, block_n=16, split=1, warps=4,
              stages=1, pdl=True):
    tokens, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    key = (x.device, n, block_n)
    if key not in _workspaces:
        _workspaces[key] = (torch.zeros(16, n, dtype=torch.float32, device=x.device),
                            torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=x.device))
    partial, arrivals = _workspaces[key]
    pdl = pdl and programmatic_launch(x.device)
    chunk = triton.next_power_of_2(triton.cdiv(k, split))
    tile_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight, out,
        residual_out, partial, arrivals, tokens, n, eps, weight.stride(0), x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
        K=k, CHUNK=chunk, BLOCK_N=block_n, SPLIT=split, NORM=norm_weight is not None, ADD=residual is not None,
        GLU=glu, PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )  # fmt: skip
    return out, residual_out


def tile_chain(layers, x, cfg):
    residual = torch.zeros_like(x)
    for layer in layers:
        qkv, residual = tile_gemv(x, layer["qkv"], residual=residual, norm_weight=layer["norm"], eps=1e-6,
                                  **cfg["qkv"])
        hidden, _ = tile_gemv(qkv[:, :Q], layer["o"], **cfg["o"])
        activated, residual = tile_gemv(hidden, layer["gate_up"], residual=residual, norm_weight=layer["norm"],
                                        eps=1e-6, glu=True, **cfg["gate_up"])
        x, _ = tile_gemv(activated, layer["down"], **cfg["down"])
    return x


def check(layers) -> None:
    """Each matmul against torch on 1..16 rows (bf16 tolerances)."""
    layer = layers[0]
    for tokens in (1, 3, 7, 16):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        ref_in = F.rms_norm((x.float() + residual.float()).bfloat16(), (HIDDEN,), layer["norm"], 1e-6)
        got, res = tile_gemv(x, layer["qkv"], residual=residual, norm_weight=layer["norm"], eps=1e-6)
        torch.testing.assert_close(got, F.linear(ref_in, layer["qkv"]), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(res, (x.float() + residual.float()).bfloat16())
        got, _ = tile_gemv(x, layer["gate_up"], residual=residual, norm_weight=layer["norm"], eps=1e-6, glu=True,
                           warps=8)
        gate, up = F.linear(ref_in, layer["gate_up"]).chunk(2, -1)
        torch.testing.assert_close(got, F.silu(gate) * up, atol=3e-2, rtol=3e-2)
        for split in (1, 2, 3, 4):
            a = torch.randn(tokens, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):  # again and again: the workspace must come back zeroed
                got, _ = tile_gemv(a, layer["down"], split=split)
                torch.testing.assert_close(got, F.linear(a, layer["down"]), atol=3e-2, rtol=3e-2)
    print("tile_gemv matches torch on 1, 3, 7, 16 rows, splits 1-4")


CONFIGS = {
    "n16 w4 split o2/down3": dict(qkv=dict(), o=dict(split=2), gate_up=dict(warps=8), down=dict(split=3)),
    "n16 w4 split o4/down6": dict(qkv=dict(), o=dict(split=4), gate_up=dict(warps=8), down=dict(split=6)),
    "n16 w4 split o1/down1": dict(qkv=dict(), o=dict(warps=8), gate_up=dict(warps=8), down=dict(warps=8)),
    "n16 w8 split o2/down3": dict(qkv=dict(warps=8), o=dict(split=2, warps=8), gate_up=dict(warps=8),
                                  down=dict(split=3, warps=8)),
    "n32 w8 split o4/down6": dict(qkv=dict(block_n=32, warps=8), o=dict(block_n=32, split=4, warps=8),
                                  gate_up=dict(warps=8), down=dict(block_n=32, split=6, warps=8)),
    "n16 w4 split o2/down3 nopdl": dict(qkv=dict(pdl=False), o=dict(split=2, pdl=False),
                                        gate_up=dict(warps=8, pdl=False), down=dict(split=3, pdl=False)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    layers = make_layers()
    check(layers)
    bound_us = chain_bound_us(layers, bandwidth)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; bound {bound_us:.0f} us")
    rows = []

    def record(tokens, kernel, us):
        print(f"{tokens:2d} tokens: {kernel:34} {us:7.1f} us ({bound_us / us:4.0%} of the bound)", flush=True)
        rows.append({"tokens": tokens, "kernel": kernel, "us": us})

    for tokens in (1, 2, 4, 8, 16):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        record(tokens, "cuBLAS", graph_time_ms(lambda x=x: cublas_chain(layers, x)) * 1e3)
        record(tokens, "shipped", graph_time_ms(lambda x=x: shipped_chain(layers, x)) * 1e3)
        for name, cfg in CONFIGS.items():
            try:
                record(tokens, name, graph_time_ms(lambda x=x, cfg=cfg: tile_chain(layers, x, cfg)) * 1e3)
            except Exception as error:  # a launch that does not fit (registers, shared memory): say so, go on
                print(f"{tokens:2d} tokens: {name}: {type(error).__name__}: {str(error)[:200]}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "bound_us": bound_us,
                       "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
