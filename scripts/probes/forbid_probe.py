"""What does a constrained step's mask cost on the GPU: chapter 29's `forbid` (three tensor operations through a
table) against chapter 29c's one Triton kernel (`triton_forbid`), and the rows' copy from pinned host memory?

    PYTHONPATH=$PWD python3 scripts/probes/forbid_probe.py [--rows 1 16 256] [--vocab 151936] [--out FILE.json]

GPU only. bfloat16 logits [rows, vocab] (the LM head's output), a bitmask that allows one token in a hundred (a JSON
grammar's usual row forbids nearly everything, so the kernel writes nearly every logit). Each operation is captured
20 times in one CUDA graph; the graph is replayed 50 times between two events: microseconds a call, device time
only. The kernel's result is checked against the table's first.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch


def device_us(work, calls: int = 20, replays: int = 50) -> float:
    """Microseconds a call of ``work``, captured ``calls`` times in one graph and replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()  # compiles the Triton variant outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            work()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", help="also write every figure to this JSON file")
    args = parser.parse_args()
    from nanovllm.engine.grammars import _forbidden_bits, pack_tokens
    from nanovllm.layers.triton_bitmask import triton_forbid

    def table_forbid(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # chapter 29's forbid, which on a GPU the package now replaces with the kernel
        forbidden = _forbidden_bits(logits.device)[bitmask.view(torch.uint8).int()]
        logits.masked_fill_(forbidden.flatten(1)[:, : logits.shape[1]], float("-inf"))

    torch.manual_seed(0)
    results = []
    print(f"{torch.cuda.get_device_name()}; vocab {args.vocab}; microseconds a call (device time)", flush=True)
    for rows in args.rows:
        allowed = torch.rand(rows, args.vocab) < 0.01
        host = torch.stack([pack_tokens(row.nonzero().flatten().tolist(), args.vocab) for row in allowed])
        host = host.pin_memory()
        bitmask = host.cuda()
        logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16)
        by_table, by_kernel = logits.clone(), logits.clone()
        table_forbid(by_table, bitmask)
        triton_forbid(by_kernel, bitmask)
        assert torch.equal(by_table, by_kernel), rows
        figures = {"rows": rows,
                   "table_us": device_us(functools.partial(table_forbid, logits, bitmask)),
                   "kernel_us": device_us(functools.partial(triton_forbid, logits, bitmask)),
                   "copy_us": device_us(functools.partial(bitmask.copy_, host, non_blocking=True))}
        results.append(figures)
        print(f"{rows:4d} rows: table {figures['table_us']:8.1f} us, kernel {figures['kernel_us']:7.1f} us "
              f"({figures['table_us'] / figures['kernel_us']:.1f}x), the rows' copy {figures['copy_us']:7.1f} us",
              flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({"device": torch.cuda.get_device_name(), "vocab": args.vocab, "results": results}, file,
                      indent=2)


if __name__ == "__main__":
    main()
