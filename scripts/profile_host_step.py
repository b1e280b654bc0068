"""Where the host's time goes in one decode step at small batches (a GPU diagnosis, not a benchmark).

    PYTHONPATH=$PWD python3 scripts/profile_host_step.py --out build/host-step

At batch 1 a fused decode step needs well under a millisecond of GPU time, so the Python that
schedules, prepares and launches the next step is the wall (`python -m nanovllm.bench --latency`
reports it as "host launch"). For each batch this script runs the latency benchmark's workload
(Qwen3-0.6B shapes, prompts of 512 tokens, async scheduling as the engine runs) and, over a window
of decode steps in the middle:
1. cProfile: the Python functions by their own time and by cumulative time, per step;
2. torch.profiler (CPU activity only): the torch operators the host dispatches per step, by count
   and by CPU time, and the CUDA runtime calls (kernel launches, copies) among them.
cProfile slows every Python call (tqdm's set_postfix on a disabled bar: 27 us a call under it, 2 us without), so
read its shares, not its microseconds; the report gives the wall time per step under cProfile too.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from nanovllm.bench.engine import make_workload
from nanovllm.bench.models import qwen3_06b_random
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


def decode_until(llm: LLM, steps: int) -> list[float]:
    """Step the engine through ``steps`` decode steps (prefills are stepped but not counted); their wall times."""
    seconds = []
    while len(seconds) < steps and not llm.is_finished():
        began = time.perf_counter()
        _, num_tokens, is_prefill = llm.step()
        if not is_prefill and num_tokens:
            seconds.append(time.perf_counter() - began)
    return seconds


def profile_batch(llm: LLM, batch: int, window: int, out: Path) -> dict:
    workload = make_workload(batch, (512, 512), (1024, 1024), vocab_size=llm.config.hf_config.vocab_size, seed=batch)
    for prompt, params in zip(workload.prompts, workload.sampling_params(), strict=True):
        llm.add_request(prompt, params)
    decode_until(llm, 32)
    wall = decode_until(llm, window)
    report = {"batch": batch, "wall_ms_per_step": 1e3 * sum(wall) / len(wall)}

    profiler = cProfile.Profile()
    profiler.enable()
    profiled = decode_until(llm, window)
    profiler.disable()
    report["wall_ms_per_step_under_cprofile"] = 1e3 * sum(profiled) / len(profiled)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
        (out / f"cprofile-b{batch}-{order}.txt").write_text(text.getvalue())
    stats = pstats.Stats(profiler).stats
    by_function = sorted(((tt, ct, calls, f"{Path(f).name}:{line}:{name}")
                          for (f, line, name), (_, calls, tt, ct, _) in stats.items()), reverse=True)
    report["python_self_us_per_step"] = {where: round(1e6 * tt / window, 1) for tt, _, _, where in by_function[:30]}
    cumulative = sorted(by_function, key=lambda row: row[1], reverse=True)
    report["python_cumulative_us_per_step"] = {where: round(1e6 * ct / window, 1)
                                               for _, ct, _, where in cumulative[:45]}

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode_until(llm, window)
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        ops[event.name][0] += 1
        ops[event.name][1] += event.self_cpu_time_total
    table = sorted(ops.items(), key=lambda item: item[1][1], reverse=True)
    report["torch_ops_per_step"] = {name: {"calls": round(calls / window, 2), "self_us": round(us / window, 1)}
                                    for name, (calls, us) in table[:40]}
    report["cuda_runtime_calls_per_step"] = {name: round(calls / window, 2) for name, (calls, _) in table
                                             if name.startswith("cuda")}
    (out / f"torch-ops-b{batch}.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    while not llm.is_finished():
        llm.step()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/host-step")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--window", type=int, default=200, help="decode steps per measurement")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(str(qwen3_06b_random()), max_num_seqs=max(args.batches), max_model_len=4096)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    reports = []
    for batch in args.batches:
        report = profile_batch(llm, batch, args.window, out)
        print(json.dumps(report, indent=1))
        reports.append(report)
    (out / "host-step.json").write_text(json.dumps(reports, indent=1))
    llm.exit()


if __name__ == "__main__":
    main()
