"""Probe: split decode attention merged by a second kernel, or by the split kernel's last program (issue 34).

At one to sixteen sequences the decode kernel splits each context (split-K) and decode_reduce_kernel merges the
splits: two launches per layer, the second a few µs of mostly boundary (chapter 09b measured the two at 146 + 68 µs
of a one-sequence step on the H200). With `merge_in_kernel=True` the last of a (sequence, KV head)'s split programs
merges them inside the split kernel. This times both, each as 28 layers' decode attention back to back in one CUDA
graph (a cache per layer, so the reads come from HBM), on Qwen3-0.6B's shapes at 512-768 tokens of context, at the
batches where the engine splits, and checks that both give the same output.

    PYTHONPATH=$PWD python3 scripts/decode_merge_probe.py [--out FILE.json]

Checked in the Triton interpreter only (the kernel's tests); not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from nanovllm.bench.attention import graph_time_ms
from nanovllm.layers.context import Context
from nanovllm.layers.triton_attention import choose_num_splits, decode_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 16, 8, 128, 256
BATCHES = (1, 2, 4, 8, 16)


def layer_caches(batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor, Context]]:
    """One (K cache, V cache, decode context) per layer: ``batch`` sequences of about ``context`` tokens."""
    blocks = -(-context // BLOCK_SIZE)
    lens = torch.randint(context * 2 // 3, context + 1, (batch,), dtype=torch.int32, device="cuda")
    caches = []
    for _ in range(LAYERS):
        k_cache = torch.randn(batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).int()
        caches.append((k_cache, torch.randn_like(k_cache), Context(is_prefill=False, context_lens=lens,
                                                                   block_tables=tables)))  # fmt: skip
    return caches


def attend(q: torch.Tensor, caches: list, merge: bool) -> list[torch.Tensor]:
    """Every layer's decode attention for the same queries, the splits merged in the split kernel or not."""
    return [decode_attention(q, k, v, ctx, HEAD_DIM**-0.5, merge_in_kernel=merge) for k, v, ctx in caches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--out")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {LAYERS} layers of decode attention, contexts "
          f"{args.context * 2 // 3}-{args.context} tokens, µs per step")
    rows = []
    for batch in BATCHES:
        caches = layer_caches(batch, args.context)
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        splits = choose_num_splits(batch, KV_HEADS, -(-args.context // BLOCK_SIZE) * BLOCK_SIZE, sms)
        outputs = {merge: attend(q, caches, merge) for merge in (False, True)}
        for reduced, merged in zip(outputs[False], outputs[True], strict=True):
            torch.testing.assert_close(merged, reduced, atol=2e-2, rtol=2e-2)
        times = {merge: graph_time_ms(lambda q=q, caches=caches, merge=merge: attend(q, caches, merge)) * 1e3
                 for merge in (False, True)}
        print(f"batch {batch:2d} ({splits:2d} splits): reduce kernel {times[False]:6.1f}, merged in the split kernel "
              f"{times[True]:6.1f} ({times[False] / times[True]:.2f}x)", flush=True)
        rows.append({"batch": batch, "splits": splits, "reduce_kernel_us": times[False], "merged_us": times[True]})
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "context": args.context, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
