"""Where does a 256-sequence constrained step's extra time go: more work on the device, or the device waiting?

    PYTHONPATH=$PWD python3 scripts/probes/constrained_gap_probe.py [--batch 256] [--workers 4] [--max-tokens 64]

GPU only (a diagnosis for issue 63, not a benchmark). One engine as chapter 29's structured benchmark builds it
(Qwen3-0.6B's shapes with random weights, `grammar_workers` as given), the benchmark's free and constrained greedy
requests, a warm-up each, then each run once under torch.profiler with CUDA activity. For each run it prints the
wall time, the device's busy time (the union of its kernels' and copies' intervals) and so its idle time, and the
kernels that take the most device time. If the constrained run's extra wall time is about its extra busy time, the
device's share (the rows' copy, the mask, the masked sampling) is what to shorten; if it is mostly idle time, the host
(the fill, its wait, the launches between steps) is.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm.bench.models import qwen3_06b_random
from nanovllm.bench.structured import ROSTER_SCHEMA, roster_prompts
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) intervals."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total, reached = total + max(0.0, end - max(start, reached)), max(reached, end)
    return total


def profiled_run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        torch.cuda.synchronize()
        wall_us = 1e6 * (time.perf_counter() - began)
    device_events = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(event.time_range.start, event.time_range.end) for event in device_events]
    by_name: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for event in device_events:
        by_name[event.name[:80]] += event.time_range.elapsed_us()
        counts[event.name[:80]] += 1
    busy = busy_us(intervals)
    span = max(end for _, end in intervals) - min(start for start, _ in intervals) if intervals else 0.0
    return {"wall_ms": wall_us / 1e3, "device_span_ms": span / 1e3, "device_busy_ms": busy / 1e3,
            "device_idle_ms": (span - busy) / 1e3,
            "top": [(name, round(us / 1e3, 3), counts[name]) for name, us in by_name.most_common(12)]}


def host_profiled_run(llm: LLM, prompts: list[str], params: SamplingParams, top: int = 25) -> list:
    """The run under cProfile (the main thread's functions only): the ``top`` functions by their own time."""
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.runcall(llm.generate, prompts, [params] * len(prompts), use_tqdm=False)
    wall_ms = 1e3 * (time.perf_counter() - began)
    stats = pstats.Stats(profiler)
    rows = sorted(((f"{path.rsplit('/', 1)[-1]}:{line}:{name}", calls, 1e3 * own, 1e3 * total)
                   for (path, line, name), (_, calls, own, total, _) in stats.stats.items()),
                  key=lambda row: -row[2])[:top]
    print(f"host profile, {'constrained' if params.structured_outputs else 'free'}: wall {wall_ms:.1f} ms")
    for where, calls, own, total in rows:
        print(f"    {own:8.2f} ms own {total:8.2f} ms total {calls:7d}x {where}")
    return rows


def add_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The options of issue 63's probes: --batch, --workers, --max-tokens (``max_tokens`` by default) and --out."""
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--out", help="also write the figures to this JSON file")


def engine_and_requests(batch: int, workers: int, max_tokens: int
                        ) -> tuple[LLM, dict[str, SamplingParams], list[str]]:
    """An engine as chapter 29's structured benchmark builds it (Qwen3-0.6B's shapes with random weights,
    ``grammar_workers=workers``), the benchmark's free and constrained greedy requests by name, and ``batch``
    prompts (issue 63's probes share them)."""
    llm = LLM(str(qwen3_06b_random()), max_num_seqs=max(256, batch), max_model_len=max_tokens + 256,
              grammar_workers=workers)
    roster = StructuredOutputsParams(json=ROSTER_SCHEMA)
    params = {"free": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              "constrained": SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=roster)}
    return llm, params, roster_prompts(batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, max_tokens=64)
    parser.add_argument("--host-profile", action="store_true",
                        help="then each run again under cProfile: the host's functions by their own time")
    args = parser.parse_args()
    llm, params, prompts = engine_and_requests(args.batch, args.workers, args.max_tokens)
    report = {"batch": args.batch, "workers": args.workers, "max_tokens": args.max_tokens,
              "device": torch.cuda.get_device_name()}
    try:
        for run_params in params.values():
            llm.generate(prompts, [run_params] * len(prompts), use_tqdm=False)  # warm-up, unprofiled
        for name, run_params in params.items():
            report[name] = run = profiled_run(llm, prompts, run_params)
            print(f"{name:11s}: wall {run['wall_ms']:8.1f} ms; device span {run['device_span_ms']:8.1f} ms, busy "
                  f"{run['device_busy_ms']:8.1f} ms, idle {run['device_idle_ms']:7.1f} ms", flush=True)
            for kernel, ms, count in run["top"]:
                print(f"    {ms:8.2f} ms {count:6d}x {kernel}")
        if args.host_profile:
            for name, run_params in params.items():
                report[f"{name}_host"] = host_profiled_run(llm, prompts, run_params)
        free, constrained = report["free"], report["constrained"]
        print(f"constrained - free: wall {constrained['wall_ms'] - free['wall_ms']:+.1f} ms, device busy "
              f"{constrained['device_busy_ms'] - free['device_busy_ms']:+.1f} ms, idle "
              f"{constrained['device_idle_ms'] - free['device_idle_ms']:+.1f} ms")
    finally:
        llm.exit()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
