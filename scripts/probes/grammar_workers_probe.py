"""Do grammar workers (chapter 29c) fill a step's bitmask rows faster than chapter 29's in-process loop, and does a
worker that spins while it waits (``spin_s``) answer sooner than one that sleeps?

    PYTHONPATH=$PWD python3 scripts/probes/grammar_workers_probe.py [--rows 1 16 256] [--workers 4 8]
        [--spins 0 0.005] [--steps 30] [--out FILE.json]

Host only, no GPU needed (run it on the GPU machine for its cores). Chapter 29's roster schema over the tiny model's
byte-level tokenizer with Qwen3's 151,936 ids. Each row walks one of eight token walks drawn once (so that a step
costs no drawing); between two fills the host sleeps 3 ms, about the rest of a 256-sequence step on an H100, so
that a worker which sleeps while it waits must be woken, as in the engine. Per row count: the median milliseconds of
a step's `fill`, in process (`Grammars`) and through `WorkerGrammars` for each worker count and spin, and for the
workers also the host's share when the gap comes between `start_fill` and `finish_fill` (chapter 29c's engine): with
each new token known, then pending until the next fill reads it from the step's samples, as under asynchronous
scheduling (the usual decode step's road, `WorkerGrammars.usual_step_tokens`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time

import torch


def walks(grammars, params, count: int = 8, length: int = 40) -> list[list[int]]:
    """``count`` random walks of ``length`` tokens that ``params``' grammar takes (never an end of sequence)."""
    from nanovllm.engine.grammars import allowed_tokens, bitmask_words
    from nanovllm.engine.sequence import Sequence

    rng, found = random.Random(0), []
    for _ in range(count):
        seq = Sequence([1, 2, 3], params, block_size=16)
        seq.num_cached_tokens = 3
        row, walk = torch.full((1, bitmask_words(grammars.vocab_size)), -1, dtype=torch.int32), []
        for _ in range(length):
            grammars.fill([seq], row)
            allowed = allowed_tokens(row[0], grammars.vocab_size).nonzero().flatten().tolist()
            walk.append(rng.choice([t for t in allowed if t not in grammars.eos_token_ids]))
            seq.append_token(walk[-1])
            seq.num_cached_tokens = len(seq)
        found.append(walk)
    return found


def timed_fills(grammars, params, paths: list[list[int]], rows: int, bitmask: torch.Tensor, steps: int,
                gap_s: float, overlapped: bool = False, pending: bool = False) -> float:
    """The median milliseconds of a step's fill for ``rows`` new sequences walking ``paths``: the whole `fill`, or,
    ``overlapped``, the host's share when the gap comes between `start_fill` and `finish_fill` (as chapter 29c's
    engine does the rest of its step there): the time in both calls, the gap not counted. ``pending``: each new token
    stays pending until the next fill has read it from the step's samples, as under asynchronous scheduling."""
    from nanovllm.engine.model_runner import SampledTokens
    from nanovllm.engine.sequence import Sequence

    seqs = [Sequence([1, 2, 3], params, block_size=16) for _ in range(rows)]
    for seq in seqs:
        seq.num_cached_tokens = 3
    seconds, previous, places = [], None, []
    for step in range(steps):
        step_seqs = list(seqs)
        start = time.perf_counter()
        if overlapped:
            grammars.start_fill(step_seqs, bitmask[:rows], previous)
            started = time.perf_counter()
            time.sleep(gap_s)
            resumed = time.perf_counter()
            grammars.finish_fill()
            seconds.append(started - start + time.perf_counter() - resumed)
        else:
            grammars.fill(step_seqs, bitmask[:rows], previous)
            seconds.append(time.perf_counter() - start)
            time.sleep(gap_s)
        tokens = [paths[row % len(paths)][step] for row in range(rows)]
        if pending:
            if previous is not None:  # the engine's postprocess of the step in flight, after the next step's fill
                for seq, place, token in zip(seqs, places, previous.token_ids(), strict=True):
                    seq.set_token(place, token)
            places = [seq.append_pending_token() for seq in seqs]
            sampled = torch.tensor(tokens)
            previous = SampledTokens(step_seqs, list(range(rows)), sampled, sampled,
                                     [(seq.request_id, seq.sample_index) for seq in seqs])
        else:
            for seq, token in zip(seqs, tokens, strict=True):
                seq.append_token(token)
        for seq in seqs:
            seq.num_cached_tokens = len(seq)
    return 1e3 * statistics.median(seconds[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--spins", type=float, nargs="+", default=[0.0, 0.005], help="spin_s values (seconds)")
    parser.add_argument("--steps", type=int, default=30, help="steps timed (at most 40; medians of all but 5)")
    parser.add_argument("--gap", type=float, default=0.003, help="seconds the host sleeps between two fills")
    parser.add_argument("--out", help="also write every figure to this JSON file")
    args = parser.parse_args()
    from nanovllm.bench.structured import ROSTER_SCHEMA
    from nanovllm.book.tiny_models import build_tiny_model
    from nanovllm.config import Config
    from nanovllm.engine.grammar_workers import GrammarWorkers, WorkerGrammars
    from nanovllm.engine.grammars import Grammars, bitmask_words, tokenizer_json
    from nanovllm.engine.inputs import load_tokenizer
    from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

    # the engine's process on a GPU runs few CPU kernels; torch's own threads would only compete with the workers
    torch.set_num_threads(1)
    model = str(build_tiny_model("qwen3", vocab_size=151936))
    params = SamplingParams(temperature=1.0, max_tokens=1000,
                            structured_outputs=StructuredOutputsParams(json=ROSTER_SCHEMA))
    in_process = Grammars(Config(model, device="cpu"))
    paths = walks(in_process, params)
    steps = min(args.steps, len(paths[0]))
    print(f"{os.cpu_count()} cores; {steps} steps, {1e3 * args.gap:.1f} ms between fills", flush=True)
    results = []
    bitmask = torch.full((max(args.rows), bitmask_words(in_process.vocab_size)), -1, dtype=torch.int32)
    for rows in args.rows:
        ms = timed_fills(in_process, params, paths, rows, bitmask, steps, args.gap)
        results.append({"workers": 0, "spin_s": None, "rows": rows, "fill_ms": ms})
        print(f"in process, {rows:4d} rows: {ms:7.3f} ms", flush=True)
    text = tokenizer_json(load_tokenizer(model))
    for spin in args.spins:
        for count in args.workers:
            grammars = WorkerGrammars(Config(model, device="cpu", grammar_workers=count))
            grammars._workers = GrammarWorkers(count, text, grammars.vocab_size, grammars.eos_token_ids,
                                               pinned=False, spin_s=spin)
            shared = grammars.host_bitmasks(max(args.rows), copies=1, pinned=False)[0]
            for rows in args.rows:
                ms = timed_fills(grammars, params, paths, rows, shared, steps, args.gap)
                overlapped = timed_fills(grammars, params, paths, rows, shared, steps, args.gap, overlapped=True)
                usual = timed_fills(grammars, params, paths, rows, shared, steps, args.gap, overlapped=True,
                                    pending=True)
                results.append({"workers": count, "spin_s": spin, "rows": rows, "fill_ms": ms,
                                "overlapped_ms": overlapped, "overlapped_pending_ms": usual})
                print(f"{count} workers, spin {spin:.3f} s, {rows:4d} rows: {ms:7.3f} ms; beside the host's gap "
                      f"{overlapped:7.3f} ms, its tokens pending {usual:7.3f} ms", flush=True)
            grammars.workers.close()
            del grammars
            gc.collect()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({"cores": os.cpu_count(), "steps": steps, "gap_s": args.gap, "results": results}, file,
                      indent=2)


if __name__ == "__main__":
    main()
